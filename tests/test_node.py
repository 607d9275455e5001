"""The node engine: the shared arena, the one-sided steps, the node algorithms (threads and mpiexec)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import commkit as ck
from commkit import algorithms, collectives, cost, sim
from commkit.errors import AlgorithmNotApplicable, CollectiveMismatch, CommError, CommTimeout, InvalidArgument
from commkit.schedule import Get, NodeProgram, Put, ReduceSlots, Transfer, Wait, inplace_safe

NODE = ("allreduce", "broadcast", "allgather", "reduce_scatter")
ROOTED_AND_ALLTOALL = ("reduce", "gather", "scatter", "alltoall")
BLOCKED = ("reduce_scatter", "scatter", "alltoall")
"""Collectives whose input holds a block for every rank (p times the per-rank count)."""


def _affine(a, b):
    """Apply map a, then map b: each complex element is one affine map, scale + i*shift (not commutative)."""
    return (a.real * b.real) + 1j * (a.imag * b.real + b.imag)


AFFINE = ck.ops.Op(_affine, commutative=False, name="affine")


def _data(rank, n, seed, dtype):
    rng = np.random.default_rng([seed, rank])
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(n).astype(dtype)
    return rng.integers(-1000, 1000, n).astype(dtype)


def _expected(collective, p, n, seed, dtype, root):
    """Each rank's result, from NumPy (None where the collective gives that rank none)."""
    xs = [_data(r, n * (p if collective in BLOCKED else 1), seed, dtype) for r in range(p)]
    total = xs[0].copy()
    for x in xs[1:]:
        total = total + x
    if collective == "allreduce":
        return [total] * p
    if collective == "reduce":
        return [total if r == root else None for r in range(p)]
    if collective == "broadcast":
        return [xs[root]] * p
    if collective == "allgather":
        return [np.concatenate(xs)] * p
    if collective == "gather":
        return [np.concatenate(xs) if r == root else None for r in range(p)]
    if collective == "scatter":
        return [xs[root][r * n:(r + 1) * n] for r in range(p)]
    if collective == "alltoall":
        return [np.concatenate([xs[q][r * n:(r + 1) * n] for q in range(p)]) for r in range(p)]
    return [total[r * n:(r + 1) * n] for r in range(p)]


def _run(comm, collective, n, seed, dtype, root, algorithm, nonblocking=False, repeat=1):
    """The call on this rank's data; with ``repeat``, its last of that many on new copies of the data (from the
    second on a shape's plan and entry, and an i-form's program generator)."""
    x = _data(comm.rank, n * (comm.size if collective in BLOCKED else 1), seed, dtype)
    for _ in range(repeat - 1):
        _call(comm, collective, x.copy(), n, dtype, root, algorithm, nonblocking)
    return _call(comm, collective, x, n, dtype, root, algorithm, nonblocking)


def _call(comm, collective, x, n, dtype, root, algorithm, nonblocking):
    p = comm.size
    if collective == "broadcast":
        return comm.broadcast(x, root=root, algorithm=algorithm)
    if collective in ("scatter", "alltoall"):
        x = x.reshape(p, n)
    if collective == "scatter":
        out = np.empty(n, dtype)
        mine = x if comm.rank == root else None
        if nonblocking:
            return comm.iscatter(mine, root=root, out=out, algorithm=algorithm).wait()
        return comm.scatter(mine, root=root, out=out, algorithm=algorithm)
    forms = {"allreduce": (comm.allreduce, comm.iallreduce), "allgather": (comm.allgather, comm.iallgather),
             "reduce_scatter": (comm.reduce_scatter, comm.ireduce_scatter), "alltoall": (comm.alltoall, comm.ialltoall),
             "reduce": (comm.reduce, comm.ireduce), "gather": (comm.gather, comm.igather)}
    blocking, start = forms[collective]
    kwargs = {"root": root} if collective in ("reduce", "gather") else {}
    return start(x, algorithm=algorithm, **kwargs).wait() if nonblocking else blocking(x, algorithm=algorithm, **kwargs)


def _check_against_numpy(got, want, dtype):
    for r, (mine, theirs) in enumerate(zip(got, want)):
        if theirs is None:
            assert mine is None, r
            continue
        assert mine.dtype == np.dtype(dtype)
        mine = mine.reshape(-1)  # gathered results have a row per rank
        if np.dtype(dtype).kind == "f":
            np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-5)
        else:
            np.testing.assert_array_equal(mine, theirs)


@settings(max_examples=40, deadline=None)
@given(collective=st.sampled_from(NODE), p=st.integers(1, 8), n=st.integers(0, 70), seed=st.integers(0, 2**31),
       dtype=st.sampled_from(["float32", "float64", "int32"]), segment=st.sampled_from([None, 8, 24, 64]),
       root=st.integers(0, 7), nonblocking=st.booleans(), repeat=st.sampled_from([1, 3]))
def test_node_algorithms_match_numpy_on_threads(collective, p, n, seed, dtype, segment, root, nonblocking, repeat):
    # Small segments put even these counts through the arena in many chunks (both halves of every slot);
    # a third call on new arrays runs the shape's plan or the program's generator.
    root %= p
    algorithm = "shm" if segment is None else f"shm:{segment}"
    got = ck.run_local(lambda comm: _run(comm, collective, n, seed, dtype, root, algorithm, nonblocking, repeat),
                       size=p)
    want = _expected(collective, p, n, seed, dtype, root)
    for r in range(p):
        assert got[r].dtype == np.dtype(dtype)
        got[r] = got[r].reshape(-1)  # allgather's result has a row per rank
        if np.dtype(dtype).kind == "f":
            np.testing.assert_allclose(got[r], want[r], rtol=1e-5, atol=1e-5)
        else:
            np.testing.assert_array_equal(got[r], want[r])
    if collective == "allreduce":
        for r in range(p):  # one rank folds each element: every rank has the same bits
            assert got[r].tobytes() == got[0].tobytes()


@settings(max_examples=40, deadline=None)
@given(collective=st.sampled_from(ROOTED_AND_ALLTOALL), p=st.integers(1, 8), n=st.integers(0, 70),
       seed=st.integers(0, 2**31), dtype=st.sampled_from(["float32", "float64", "int32"]),
       segment=st.sampled_from([None, 8, 24, 64]), root=st.integers(0, 7), nonblocking=st.booleans(),
       repeat=st.sampled_from([1, 3]))
def test_rooted_and_alltoall_node_algorithms_match_numpy_on_threads(collective, p, n, seed, dtype, segment, root,
                                                                   nonblocking, repeat):
    # Small segments put these counts through the arena in many chunks: reduce takes its sliced form
    # past one chunk, and scatter and alltoall cut every block into pieces of segment / (p - 1); a third call
    # on new arrays runs the shape's plan or the program's generator.
    root %= p
    algorithm = "shm" if segment is None else f"shm:{segment}"
    got = ck.run_local(lambda comm: _run(comm, collective, n, seed, dtype, root, algorithm, nonblocking, repeat),
                       size=p)
    _check_against_numpy(got, _expected(collective, p, n, seed, dtype, root), dtype)


def test_reduce_has_the_bits_of_the_allreduce():
    # Both fold every element from all p slots in rank order, whichever rank folds it: the same bits,
    # flat (one chunk) and sliced (many), whatever the root.
    def body(comm, n, algorithm):
        x = _data(comm.rank, n, 7, "float32") * 1e3
        return [comm.reduce(x, root=root, algorithm=algorithm) for root in range(comm.size)], \
            comm.allreduce(x, algorithm="shm")

    for n, algorithm in ((50, "shm"), (50, "shm:8"), (1001, "shm:64")):
        got = ck.run_local(body, 5, n, algorithm)
        for root in range(5):
            assert got[root][0][root].tobytes() == got[root][1].tobytes(), (n, algorithm, root)
            assert all(got[r][0][root] is None for r in range(5) if r != root)


@pytest.mark.parametrize("p", [2, 3, 5])
@pytest.mark.parametrize("segment", [None, 16])
def test_non_commutative_allreduce_and_reduce_scatter_fold_in_rank_order(p, segment):
    algorithm = "shm" if segment is None else f"shm:{segment}"
    maps = [np.random.default_rng(r).uniform(0.5, 1.5, 9) + 1j * np.random.default_rng(p + r).uniform(-1, 1, 9)
            for r in range(p)]

    def body(comm):
        ar = comm.allreduce(maps[comm.rank], op=AFFINE, algorithm=algorithm)
        rs = comm.reduce_scatter(np.tile(maps[comm.rank], p), op=AFFINE, algorithm=algorithm)
        return ar, rs

    got = ck.run_local(body, size=p)
    want = maps[0]
    for m in maps[1:]:
        want = _affine(want, m)
    for r in range(p):
        np.testing.assert_allclose(got[r][0], want, rtol=1e-12)
        np.testing.assert_allclose(got[r][1], want, rtol=1e-12)


@pytest.mark.parametrize("p", [2, 3, 5])
@pytest.mark.parametrize("segment", [None, 16])
def test_non_commutative_reduce_folds_in_rank_order(p, segment):
    # 40 elements: one flat fold without a segment, a sliced fold over three chunks of 16.
    algorithm = "shm" if segment is None else f"shm:{segment}"
    maps = [np.random.default_rng(r).uniform(0.5, 1.5, 40) + 1j * np.random.default_rng(p + r).uniform(-1, 1, 40)
            for r in range(p)]
    got = ck.run_local(lambda comm: [comm.reduce(maps[comm.rank], op=AFFINE, root=root, algorithm=algorithm)
                                     for root in range(p)], size=p)
    want = maps[0]
    for m in maps[1:]:
        want = _affine(want, m)
    for root in range(p):
        np.testing.assert_allclose(got[root][root], want, rtol=1e-12)


@pytest.mark.parametrize("segment", [16, 64])
def test_two_ranks_fold_their_own_half_from_their_input_in_place_and_not(segment):
    # Of two ranks each copies in only the half of a chunk the other folds, and folds its own half from
    # its input: rank 1's input is the second operand of its fold, and in place it is the output too. A
    # non-commutative op tells the operands' order; the calls repeat on the same arrays and on new ones,
    # so that node programs and plans run them as well as the interpreter; inputs not in place stay
    # as they were.
    algorithm = f"shm:{segment}"
    n = 5 * segment + 3  # chunks of uneven halves, the last one short
    maps = [np.random.default_rng(r).uniform(0.5, 1.5, n) + 1j * np.random.default_rng(2 + r).uniform(-1, 1, n)
            for r in range(2)]
    want = _affine(maps[0], maps[1])

    def body(comm):
        mine = maps[comm.rank]
        x, out, results = mine.copy(), np.empty_like(mine), []
        for _ in range(4):  # the same arrays
            results.append(comm.allreduce(x, op=AFFINE, out=out, algorithm=algorithm).copy())
            results.append(comm.reduce(x, op=AFFINE, root=1, out=out if comm.rank == 1 else None,
                                       algorithm=algorithm))
            results[-1] = None if results[-1] is None else results[-1].copy()
        assert x.tobytes() == mine.tobytes()
        for _ in range(4):  # in place, a new array each call
            y = mine.copy()
            results.append(comm.allreduce(y, op=AFFINE, out=y, algorithm=algorithm))
            z = mine.copy()
            got = comm.reduce(z, op=AFFINE, root=0, out=z if comm.rank == 0 else None, algorithm=algorithm)
            results.append(got)
            if comm.rank != 0:
                assert z.tobytes() == mine.tobytes()
        return results

    got = ck.run_local(body, size=2)
    for rank in range(2):
        for i, result in enumerate(got[rank]):
            rooted, root = i % 2 == 1, 1 if i < 8 else 0
            if rooted and rank != root:
                assert result is None
                continue
            np.testing.assert_allclose(result, want, rtol=1e-12)
            assert result.tobytes() == got[0][0].tobytes()  # every result has the allreduce's bits


def test_two_ranks_copy_in_only_the_half_the_other_folds():
    width = 1000
    for coll in ("allreduce", "reduce"):
        for r in range(2):
            steps = list(collectives.steps(algorithms.get(coll, "shm").schedule, coll, r, 2, 5 * width, ck.ops.SUM,
                                           root=0, segment=width))
            puts = [s for s in steps if isinstance(s, Put)]
            copied_in = 5 * width // 2  # half of every chunk (its folded half goes back too, but the root's)
            put_back = 0 if coll == "reduce" and r == 0 else 5 * width // 2
            assert sum(s.dst[2] - s.dst[1] for s in puts) == copied_in + put_back, (coll, r)
            folds = [s for s in steps if isinstance(s, ReduceSlots)]
            assert all([o[0] for o in s.operands] == (["in", "slot1"] if r == 0 else ["slot0", "in"])
                       for s in folds), (coll, r)
            assert inplace_safe(steps)


def test_barrier_waits_for_every_rank():
    import time

    def body(comm):
        if comm.rank == 1:
            time.sleep(0.3)
        t0 = time.monotonic()
        comm.barrier(algorithm="shm")
        return time.monotonic() - t0

    waited = ck.run_local(body, size=3)
    assert waited[0] > 0.2 and waited[2] > 0.2


def test_allreduce_schedule_shape():
    # Small: one wait, every rank folds all p slots. Large: per chunk two waits, one fold of a 1/p
    # slice, p-1 gets; never a two-sided transfer.
    p, width = 4, 1000
    small = list(algorithms.get("allreduce", "shm").schedule(1, p, 100, ck.ops.SUM))
    assert [type(s).__name__ for s in small] == ["Claim", "Put", "Publish", "Wait", "ReduceSlots", "Release"]
    assert len(small[4].operands) == p
    large = list(algorithms.get("allreduce", "shm").schedule(1, p, 5 * width, ck.ops.SUM, segment=width))
    assert not any(isinstance(s, Transfer) for s in large)
    assert sum(isinstance(s, Wait) for s in large) == 2 * 5
    assert sum(isinstance(s, Get) for s in large) == (p - 1) * 5
    folds = [s for s in large if isinstance(s, ReduceSlots)]
    assert [s.dst[2] - s.dst[1] for s in folds] == [width // p] * 5
    assert large[0].elements == 2 * width  # two chunks in flight
    assert inplace_safe(large) and inplace_safe(small)


def test_rooted_and_alltoall_schedule_shapes():
    # The textbook counts of each rank's steps, for K chunks of a block: never a two-sided transfer.
    def steps(coll, rank, p, count, root, segment):
        return list(collectives.steps(algorithms.get(coll, "shm").schedule, coll, rank, p, count, ck.ops.SUM, root,
                                      segment))

    def kinds(seq, kind):
        return [s for s in seq if isinstance(s, kind)]

    p, root = 4, 2
    # reduce, small: every rank puts; only the root waits, once, and folds all p slots.
    for r in range(p):
        small = steps("reduce", r, p, 100, root, None)
        names = ["Claim", "Put", "Publish", "Wait", "ReduceSlots", "Release"] if r == root else \
            ["Claim", "Put", "Publish", "Release"]
        assert [type(s).__name__ for s in small] == names and inplace_safe(small)
    assert len(kinds(steps("reduce", root, p, 100, root, None), ReduceSlots)[0].operands) == p
    # reduce, large (5 chunks of 1000): the root waits twice per chunk and gets p-1 slices; the others
    # wait once, fold a quarter, put it back, and get nothing.
    width, k = 1000, 5
    for r in range(p):
        large = steps("reduce", r, p, k * width, root, width)
        assert not kinds(large, Transfer) and inplace_safe(large) and large[0].elements == 2 * width
        assert [s.dst[2] - s.dst[1] for s in kinds(large, ReduceSlots)] == [width // p] * k
        assert len(kinds(large, Wait)) == (2 * k if r == root else k)
        assert len(kinds(large, Get)) == ((p - 1) * k if r == root else 0)
        assert len(kinds(large, Put)) == (k if r == root else 2 * k)
    # gather: the root waits once per chunk and gets p-1 chunks; the others put, and wait from the third on.
    for r in range(p):
        g = steps("gather", r, p, k * width, root, width)
        assert len(kinds(g, Wait)) == (k if r == root else k - 2)
        assert sum(s.dst[2] - s.dst[1] for s in kinds(g, Get)) == ((p - 1) * k * width if r == root else 0)
        assert sum(s.dst[2] - s.dst[1] for s in kinds(g, Put)) == (0 if r == root else k * width)
    # scatter and alltoall: a chunk holds one piece of each of p-1 blocks, at most width/(p-1) = 333
    # elements each, so a block of k*width elements goes through in 16 chunks.
    pieces = -(-k * width // (width // (p - 1)))
    assert pieces == 16
    for r in range(p):
        s = steps("scatter", r, p, k * width, root, width)
        assert len(kinds(s, Wait)) == (pieces - 2 if r == root else pieces)
        assert sum(x.dst[2] - x.dst[1] for x in kinds(s, Put)) == ((p - 1) * k * width if r == root else 0)
        assert sum(x.dst[2] - x.dst[1] for x in kinds(s, Get)) == (0 if r == root else k * width)
        a = steps("alltoall", r, p, k * width, None, width)
        assert len(kinds(a, Wait)) == pieces and not kinds(a, Transfer)
        for kind in (Put, Get):
            assert sum(x.dst[2] - x.dst[1] for x in kinds(a, kind)) == (p - 1) * k * width
        assert max(x.src[2] for x in kinds(a, Get)) <= a[1].elements  # what a rank reads lies in a claimed slot


def test_simulator_and_formulas_agree_on_large_calls():
    for coll, count in (("allreduce", 3_000_001), ("broadcast", 1_000_003), ("allgather", 400_000),
                        ("reduce_scatter", (300_000,) * 3), ("reduce", 3_000_001), ("gather", 400_003),
                        ("scatter", 400_003), ("alltoall", 300_001)):
        for p in (2, 3, 5):
            c = count if coll != "reduce_scatter" else (count[0],) * p
            for root in ((0, p - 1) if coll in collectives.ROOTED else (0,)):
                res = sim.simulate(coll, "shm", p, count=c, root=root)
                assert res.ok and res.messages == [0] * p, coll
                want = cost.predict(coll, "shm", p, res.nbytes)
                assert res.time == pytest.approx(want, rel=1e-9), (coll, p, root)
                assert res.rounds == cost.predict(coll, "shm", p, res.nbytes, alpha=1, beta=0, gamma=0)


def test_a_rank_that_never_arrives_times_out_naming_the_step_and_the_peer():
    # At the first node call the arena is made, after every rank has checked in (Claim); at a later
    # call the others wait for the missing rank's counter (Wait). Either way the error names both.
    def body(comm):
        first, later = comm.dup(), comm.dup()  # a timeout leaves its communicator broken: one per case
        later.allreduce(np.ones(10), algorithm="shm")  # its arena is made: rank 2 skips only the next call
        if comm.rank == 2:
            return None
        texts = []
        for c in (first, later):
            try:
                c.allreduce(np.ones(10), algorithm="shm", timeout=0.5)
            except CommTimeout as exc:
                texts.append(str(exc))
        return texts

    got = ck.run_local(body, size=3)
    for first, later in got[:2]:
        assert "(Claim(10 elements per slot))" in first and "waiting for rank(s) 2" in first, first
        assert "(Wait(ranks" in later and "waiting for rank(s) 2" in later, later


def test_ranks_in_different_collectives_are_told_apart():
    def body(comm):
        comm.barrier(algorithm="shm")  # the arena is made (a first call that disagrees waits at the check-in)
        try:
            if comm.rank == 0:
                comm.allreduce(np.ones(4), algorithm="shm", timeout=1)
            else:
                comm.broadcast(np.ones(4), root=0, algorithm="shm", timeout=1)
        except (CommTimeout, CollectiveMismatch) as exc:
            return type(exc).__name__, str(exc)
        return None, ""

    got = ck.run_local(body, size=2)
    assert got[1][0] == "CollectiveMismatch" and "rank 0" in got[1][1], got
    assert got[0][0] == "CommTimeout"


# Rank 0's call, rank 1's call, and which ranks must find the other in another call (each of them
# waits for the other's counter before it reads its slot). A rank that only writes may finish.
MISMATCHES = [
    ("reduce", {"root": 1}, "reduce", {"root": 1, "n": 5}, [1]),  # another count
    ("gather", {"root": 0}, "scatter", {"root": 1}, [0]),
    ("scatter", {"root": 0}, "alltoall", {}, [1]),
    ("alltoall", {}, "allgather", {}, [0, 1]),
    ("gather", {"root": 1}, "gather", {"root": 1, "dtype": "int32"}, [1]),  # another element type
]


@pytest.mark.parametrize("first,first_args,second,second_args,told", MISMATCHES)
def test_a_rank_never_reads_a_slot_written_for_another_call(first, first_args, second, second_args, told):
    def call(comm, collective, args):
        n, dtype = args.get("n", 4), args.get("dtype", "float64")
        x = np.arange(n * (2 if collective in ("scatter", "alltoall") else 1), dtype=dtype) + 10 * comm.rank
        root = args.get("root", 0)
        if collective == "scatter":
            return comm.scatter(x.reshape(2, n) if comm.rank == root else None, root=root, out=np.empty(n, dtype),
                                algorithm="shm", timeout=1)
        if collective == "alltoall":
            return comm.alltoall(x.reshape(2, n), algorithm="shm", timeout=1)
        kwargs = {"root": root} if collective in ("reduce", "gather") else {}
        return getattr(comm, collective)(x, algorithm="shm", timeout=1, **kwargs)

    def body(comm):
        comm.barrier(algorithm="shm")  # the arena is made (a first call that disagrees waits at the check-in)
        collective, args = (first, first_args) if comm.rank == 0 else (second, second_args)
        try:
            call(comm, collective, args)
        except (CommTimeout, CollectiveMismatch) as exc:
            return type(exc).__name__, str(exc)
        return None, ""

    got = ck.run_local(body, size=2)
    for r in told:
        assert got[r][0] == "CollectiveMismatch" and f"rank {1 - r}" in got[r][1], got


def test_arena_failures_are_clear_and_two_sided_algorithms_keep_working(monkeypatch):
    def body(comm, big):
        try:
            comm.allreduce(np.ones(50_000), algorithm="shm")
        except (CommError, InvalidArgument) as exc:
            error = str(exc)
        else:
            error = ""
        return error, comm.allreduce(np.full(5, comm.rank + 1.0), algorithm="ring")

    monkeypatch.setenv("COMMKIT_NODE_ARENA_BYTES", str(1 << 62))
    for error, result in ck.run_local(body, size=2, big=True):
        assert "could not allocate the node arena" in error and "COMMKIT_NODE_ARENA_BYTES" in error, error
        np.testing.assert_array_equal(result, np.full(5, 3.0))
    monkeypatch.setenv("COMMKIT_NODE_ARENA_BYTES", "1024")
    for error, result in ck.run_local(body, size=2, big=False):
        assert "bytes of slot per rank, but the node arena has 1024" in error, error
        np.testing.assert_array_equal(result, np.full(5, 3.0))


def test_repeated_calls_and_outstanding_nonblocking_calls_complete_in_any_order():
    def body(comm):
        x = np.arange(40.0) + comm.rank
        out = np.empty_like(x)
        runs = [comm.allreduce(x, out=out, algorithm="shm").copy() for _ in range(4)]  # (no compiled plan: a program)
        first = comm.iallreduce(x, algorithm="shm:64")  # (the interpreter's; the second, the program's generator,
        second = comm.iallreduce(2 * x, algorithm="shm:64")  # waits at its Claim for the first's turn to end)
        late = second.wait(), first.wait()  # in the other order
        return runs, late

    p = 3
    want = sum(np.arange(40.0) + r for r in range(p))
    for runs, (second, first) in ck.run_local(body, size=p):
        for run in runs:
            np.testing.assert_array_equal(run, want)
        np.testing.assert_array_equal(first, want)
        np.testing.assert_array_equal(second, 2 * want)


# Each node collective on one rank's vector x: its method, and the arguments it takes for x.
NODE_FORMS = {
    "allreduce": ("allreduce", lambda comm, x: ((x,), {"algorithm": "shm"})),
    "allreduce in chunks": ("allreduce", lambda comm, x: ((x,), {"algorithm": "shm:64"})),
    "allreduce in place": ("allreduce", lambda comm, x: ((x,), {"out": x, "algorithm": "shm:64"})),
    "allreduce with out": ("allreduce", lambda comm, x: ((x,), {"out": np.empty_like(x), "algorithm": "shm"})),
    "reduce": ("reduce", lambda comm, x: ((x,), {"root": 1, "algorithm": "shm"})),
    "broadcast": ("broadcast", lambda comm, x: ((x, 1), {"algorithm": "shm:64"})),
    # (in place: a program skips the root's per-chunk Copy of its input onto itself)
    "broadcast in place": ("broadcast", lambda comm, x: ((x, 1), {"out": x, "algorithm": "shm:64"})),
    "gather": ("gather", lambda comm, x: ((x, 0), {"algorithm": "shm"})),
    "scatter": ("scatter", lambda comm, x: ((np.tile(x, (comm.size, 1)) if comm.rank == 2 % comm.size else None,
                                             2 % comm.size), {"out": np.empty_like(x), "algorithm": "shm"})),
    "allgather": ("allgather", lambda comm, x: ((x,), {"algorithm": "shm:64"})),
    "reduce_scatter": ("reduce_scatter", lambda comm, x: ((np.tile(x, comm.size),), {"algorithm": "shm"})),
    "alltoall": ("alltoall", lambda comm, x: ((np.tile(x, (comm.size, 1)),), {"algorithm": "shm"})),
    "barrier": ("barrier", lambda comm, x: ((), {"algorithm": "shm"})),
}
# The forms each test below runs.
NODE_CALLS = [name for name in NODE_FORMS if name not in ("allreduce in place", "allreduce with out")]
FRESH_NODE_CALLS = [name for name in NODE_FORMS if name not in ("allreduce in chunks", "barrier")]
NODE_I_FORMS = [name for name in FRESH_NODE_CALLS if name != "allreduce with out"]


def node_call(comm, name, x, form="", **extra):
    """Node collective ``name`` on a copy of ``x``: its result, or with ``form="i"`` its i-form's request."""
    method, arguments = NODE_FORMS[name]
    args, kwargs = arguments(comm, x.copy())
    return getattr(comm, form + method)(*args, **kwargs, **extra)


@pytest.mark.parametrize("p", [2, 3])
def test_repeated_blocking_calls_run_their_node_program_and_give_the_interpreters_bits(p, monkeypatch):
    # A blocking node call runs its NodeProgram once the arena is made: every collective, repeated on new data,
    # bit for bit what the interpreter (which a trace forces) computes, and the program did run.
    runs = []
    program_run = NodeProgram.run
    monkeypatch.setattr(NodeProgram, "run", lambda self, *a: (runs.append(1), program_run(self, *a))[1])

    def body(comm):
        cases = [(name, np.random.default_rng([i, comm.rank]).standard_normal(100))
                 for name in NODE_CALLS for i in range(3)]
        fast = [node_call(comm, name, x) for name, x in cases]
        comm.barrier(algorithm="dissemination")  # (a trace is the whole world's: every rank is done with the above)
        with ck.trace(comm):
            slow = [node_call(comm, name, x) for name, x in cases]
        return {(name, i): pair for i, (name, pair) in enumerate(zip([c[0] for c in cases], zip(fast, slow)))}

    for got in ck.run_local(body, size=p):
        for (name, i), (fast, slow) in got.items():
            if slow is None:
                assert fast is None, name
            else:
                np.testing.assert_array_equal(fast, slow, err_msg=name)
    # Every call but each rank's first (which makes the arena) and the traced ones.
    assert len(runs) == p * (3 * len(NODE_CALLS) - 1)


@pytest.mark.parametrize("p", [2, 3])
def test_calls_on_new_arrays_run_their_node_program_from_the_shapes_plan_and_give_the_interpreters_bits(
        p, monkeypatch):
    # A loop that makes new arrays every call (no out, an out of its own, in place; untimed and timed) runs the
    # shape's plan from its second call and its entry from its third, with the node program as the plan's one op:
    # every result bit for bit what the interpreter (which a trace forces) computes on the same data.
    monkeypatch.delenv("COMMKIT_TIMEOUT", raising=False)  # (untimed calls take the untimed entries)
    timed_runs = []
    timed_run = ck.plan._timed_node_run
    monkeypatch.setattr(ck.plan, "_timed_node_run", lambda *a: (timed_runs.append(1), timed_run(*a))[1])

    def body(comm):
        comm.barrier(algorithm="shm")  # the arena
        timeout = 30.0
        cases = [(name, t, np.random.default_rng([i, comm.rank]).standard_normal(100))
                 for name in FRESH_NODE_CALLS for t in (None, timeout) for i in range(4)]
        fast = [node_call(comm, name, x, timeout=t) for name, t, x in cases]
        entry = comm._new_allreduce  # (the last allreduce shape's: the timed one with an out of its own)
        comm.barrier(algorithm="dissemination")  # (a trace is the whole world's: every rank is done with the above)
        with ck.trace(comm):
            slow = [node_call(comm, name, x, timeout=t) for name, t, x in cases]
        return [(name, t, f, s) for (name, t, _), f, s in zip(cases, fast, slow)], entry.source

    for got, entry in ck.run_local(body, size=p):
        for name, timeout, fast, slow in got:
            if slow is None:
                assert fast is None, name
            else:
                np.testing.assert_array_equal(fast, slow, err_msg=f"{name}, timeout {timeout}")
        assert "'in': _b_in" in entry and "_timeout" in entry, entry  # the node program, on the run's arrays
    # The timed calls of each collective from the second on (the first has no shape plan yet), on every rank;
    # a form's first call finds the plan another form of its shape made ("allreduce" and "with out" share one).
    assert p * 3 * len(FRESH_NODE_CALLS) <= len(timed_runs) <= p * 4 * len(FRESH_NODE_CALLS)


@pytest.mark.parametrize("p", [2, 3])
def test_i_forms_on_new_arrays_run_their_node_programs_generator_and_give_the_interpreters_bits(p, monkeypatch):
    # From a shape's second i-form on, the request runs the node program's generator (NodeProgram.steps): every
    # result bit for bit the interpreter's (a trace forces it), two requests outstanding at a time and waited for
    # in the other order, so that the second's Claim waits for the first's turn.
    monkeypatch.delenv("COMMKIT_TIMEOUT", raising=False)
    made = []
    steps = ck.schedule.NodeProgram.steps
    monkeypatch.setattr(ck.schedule.NodeProgram, "steps", property(lambda self: (made.append(1), steps.fget(self))[1]))

    def body(comm):
        comm.barrier(algorithm="shm")  # the arena
        cases = [(name, np.random.default_rng([i, comm.rank]).standard_normal(100))
                 for name in NODE_I_FORMS for i in range(4)]
        fast = []
        for k in range(0, len(cases), 2):
            a, b = (node_call(comm, name, x, "i") for name, x in cases[k:k + 2])
            fast += list(reversed([b.wait(), a.wait()]))
        compiled = [entry[1] for entry in comm._by_shape_i.values() if entry[1] is not None]
        comm.barrier(algorithm="dissemination")
        with ck.trace(comm):
            slow = [node_call(comm, name, x, "i").wait() for name, x in cases]
        return [(name, f, s) for (name, _), f, s in zip(cases, fast, slow)], [c.source for c in compiled]

    for got, sources in ck.run_local(body, size=p):
        for name, fast, slow in got:
            if slow is None:
                assert fast is None, name
            else:
                np.testing.assert_array_equal(fast, slow, err_msg=name)
        assert len(sources) == len(NODE_I_FORMS), sources  # one program's generator per form's shape
        assert all("if not _pending.test():" in source for source in sources), sources  # its Claim's wait, at least
    assert made  # (made once per program, at the first i-form of its shape that finds the arena made)


def test_a_node_i_forms_generator_tells_a_missing_peer_as_the_interpreter_does():
    def body(comm):
        c = comm.dup()  # a timeout leaves its communicator broken
        for k in range(3):  # the shape's i-form entry, on the program's generator
            c.iallreduce(np.full(10, float(k)), algorithm="shm", timeout=0.5).wait()
        if comm.rank == 2:
            return None
        request = c.iallreduce(np.ones(10), algorithm="shm", timeout=0.5)
        with pytest.raises(CommTimeout) as info:
            request.wait()
        return str(info.value), c.flight_recorder.calls[-1][8]

    got = ck.run_local(body, size=3)
    for text, state in got[:2]:
        assert "(Wait(ranks" in text and "waiting for rank(s) 2" in text and "allreduce #3" in text, text
        assert state == "timed out"


def test_shared_arrays_turn_a_node_calls_shape_plans_off_so_each_call_finds_its_own_form(monkeypatch):
    # A node call's shape plan runs the copying form; once shared_empty has made arrays here, a call on shared
    # arrays must take the zero-copy form on every rank, so new arrays of a node call's shape take the general
    # path, which looks at each call's arrays.
    monkeypatch.setenv("COMMKIT_ZERO_COPY_MIN_BYTES", "0")
    monkeypatch.delenv("COMMKIT_TIMEOUT", raising=False)

    def body(comm):
        for i in range(3):  # new private arrays: the shape's plan, then its entry
            comm.allreduce(np.full(40, float(i + comm.rank)), algorithm="shm")
        had_entry = comm._new_allreduce is not None
        x = comm.shared_empty(40)
        got = []
        for i in range(3):
            x[:] = i + comm.rank
            got.append(comm.allreduce(x, algorithm="shm").tolist())
        return had_entry, comm._new_allreduce, got

    for had_entry, entry, got in ck.run_local(body, size=2):
        assert had_entry and entry is None
        assert got == [[2.0 * i + 1] * 40 for i in range(3)]


@pytest.mark.parametrize("p", [2, 3])
@pytest.mark.parametrize("shared", [False, True])
def test_a_loop_on_the_same_arrays_runs_its_node_program_from_a_compiled_plan(p, shared, monkeypatch):
    # The second call on the same arrays compiles a plan whose one op is the node program (the zero-copy form's,
    # on shared arrays, whatever the size); new values in place at every call, every result right.
    monkeypatch.setenv("COMMKIT_ZERO_COPY_MIN_BYTES", "0")
    monkeypatch.delenv("COMMKIT_TIMEOUT", raising=False)  # (plans compile for untimed calls)
    runs = []
    program_run = NodeProgram.run
    monkeypatch.setattr(NodeProgram, "run", lambda self, *a: (runs.append(1), program_run(self, *a))[1])

    def body(comm):
        x, out = (comm.shared_empty(40), comm.shared_empty(40)) if shared else (np.empty(40), np.empty(40))
        got = []
        for i in range(5):
            x[:] = np.arange(40.0) * (comm.rank + 1) + i
            got.append(comm.allreduce(x, out=out, algorithm="shm").copy())
        plan = comm._hot_allreduce
        return got, plan is not None and plan.run is not None and plan.hot[0] is x

    for got, compiled in ck.run_local(body, size=p):
        assert compiled
        for i, result in enumerate(got):
            np.testing.assert_array_equal(result, np.arange(40.0) * sum(range(1, p + 1)) + p * i)
    # Every call; without shared arrays (whose allocation makes the arena) but the first, which made it.
    assert len(runs) == p * (5 if shared else 4)


def test_plans_off_turns_the_node_program_off(monkeypatch):
    runs = []
    program_run = NodeProgram.run
    monkeypatch.setattr(NodeProgram, "run", lambda self, *a: (runs.append(1), program_run(self, *a))[1])

    def body(comm):
        x = np.arange(50.0) + comm.rank
        comm.allreduce(x, algorithm="shm")  # the arena
        comm.plans = False
        off = [comm.allreduce(x, algorithm="shm") for _ in range(3)]
        comm.plans = True
        return off, comm.allreduce(x, algorithm="shm")

    for off, on in ck.run_local(body, size=2):
        for got in off:
            np.testing.assert_array_equal(got, on)
    assert len(runs) == 2  # each rank's last call alone


def test_a_node_program_tells_a_mismatch_and_a_missing_peer_as_the_interpreter_does():
    def body(comm):
        first, later = comm.dup(), comm.dup()  # a failed call leaves its communicator broken: one per case
        for c in (first, later):
            c.allreduce(np.ones(10), algorithm="shm")  # the arena, and the shape's program
        texts = []
        try:  # rank 0 with another count: its peers' program finds it in another call
            first.allreduce(np.ones(10 if comm.rank else 12), algorithm="shm", timeout=1)
        except (CommTimeout, CollectiveMismatch) as exc:
            texts.append(type(exc).__name__)
        if comm.rank != 2:
            try:  # rank 2 skips the call
                later.allreduce(np.ones(10), algorithm="shm", timeout=0.5)
            except CommTimeout as exc:
                texts.append(str(exc))
        return texts

    got = ck.run_local(body, size=3)
    assert "CollectiveMismatch" in got[1] + got[2], got
    for texts in got[:2]:
        assert "(Wait(ranks" in texts[-1] and "waiting for rank(s) 2" in texts[-1], texts


@pytest.mark.parametrize("p", [2, 3, 5])
def test_persistent_requests_run_the_node_algorithms_as_requests(p):
    # Compiled plans run no one-sided step: each start runs the schedule on the request's own buffers, with a new
    # call number, as an i-form does (its node program's generator). Restarted with new data, in place, overlapped
    # with two-sided calls and an i-form, with two requests in flight started in one order and waited in the other;
    # every result against the blocking form's, and a request's misuse refused as a compiled one's is.
    def body(comm):
        got = []
        x = np.zeros(70_001, np.float32)
        y = np.zeros(5, np.float64)
        big = comm.allreduce_init(x, algorithm="shm:16K")  # several chunks through the arena
        small = comm.reduce_init(y, "max", root=p - 1, algorithm="shm")
        inplace = np.zeros(9)
        mine = comm.allreduce_init(inplace, out=inplace, algorithm="shm")
        assert "(shm)" in repr(big) and "(shm)" in repr(small)
        for k in range(3):
            x[:] = np.arange(70_001, dtype=np.float32) * (comm.rank + k)
            y[:] = comm.rank * (k + 1.0)
            inplace[:] = comm.rank + k
            big.start()
            small.start()
            side = comm.iallreduce(np.full(3, k + 1.0), algorithm="ring")
            with pytest.raises(InvalidArgument, match="is active"):
                big.start()
            smallest = small.wait()
            biggest = big.wait()
            mine.start()
            got.append((biggest.copy(), None if smallest is None else smallest.copy(), mine.wait().copy(),
                        side.wait().copy(), comm.allreduce(x, algorithm="ring")))
        assert all(type(request._program) is NodeProgram for request in (big, small, mine))  # (made at its start)
        for request in (big, small, mine):
            request.free()
        with pytest.raises(InvalidArgument, match="was freed"):
            big.start()
        return got

    for r, got in enumerate(ck.run_local(body, size=p)):
        for k, (biggest, smallest, mine, side, ring) in enumerate(got):
            np.testing.assert_allclose(biggest, ring, rtol=1e-6)
            np.testing.assert_array_equal(mine, np.full(9, sum(q + k for q in range(p))))
            np.testing.assert_array_equal(side, np.full(3, p * (k + 1.0)))
            if r == p - 1:
                np.testing.assert_array_equal(smallest, np.full(5, (p - 1) * (k + 1.0)))
            else:
                assert smallest is None


def test_a_persistent_node_request_whose_peer_never_starts_times_out_naming_it():
    # allreduce_init makes the arena of the request's channel (the library's collective, after a timed check
    # that every rank has come); a later start whose peer never comes times out in wait(), naming the peer.
    def body(comm):
        request = comm.allreduce_init(np.ones(10), algorithm="shm", timeout=0.3)
        request.start()
        request.wait()
        if comm.rank == 1:
            return None  # never starts it again
        request.start()
        with pytest.raises(CommTimeout) as info:
            request.wait()
        with pytest.raises(ck.CommBroken):
            comm.allreduce(np.ones(2), algorithm="ring")
        return str(info.value)

    message = ck.run_local(body, size=2)[0]
    assert "allreduce #1 (algorithm 'shm')" in message and "waiting for rank(s) 1" in message, message


def test_emulated_nodes_on_threads(monkeypatch):
    monkeypatch.setenv("COMMKIT_RANKS_PER_NODE", "2")

    def body(comm):
        with pytest.raises(AlgorithmNotApplicable, match="spans 2 nodes"):
            comm.allreduce(np.ones(3), algorithm="shm")
        node = comm.split(comm.rank // 2)
        return node.allreduce(np.full(3, comm.rank + 1.0), algorithm="shm")

    got = ck.run_local(body, size=4)
    for r in range(4):
        np.testing.assert_array_equal(got[r], np.full(3, 3.0 if r < 2 else 7.0))


MPI_SCRIPT = """
import os, sys
import numpy as np
import commkit as ck
from commkit.errors import AlgorithmNotApplicable

from mpi4py import MPI as M

comm = ck.init()
raw = M.COMM_WORLD.Dup()
per_node = int(os.environ.get("COMMKIT_RANKS_PER_NODE", "0")) or comm.size
if per_node < comm.size:
    try:
        comm.allreduce(np.ones(3), algorithm="shm")
    except AlgorithmNotApplicable as exc:
        assert "spans" in str(exc)
    else:
        raise AssertionError("shm ran on a communicator that spans nodes")
    comm = comm.split(comm.rank // per_node)
    raw = raw.Split(raw.Get_rank() // per_node, raw.Get_rank())
for n in (0, 1, 7, 5000, 70_001):
    for segment in ("shm", "shm:4K"):
        rng = np.random.default_rng([n, comm.rank, M.COMM_WORLD.Get_rank()])
        x = rng.standard_normal(n).astype(np.float32)
        y = comm.allreduce(x, algorithm=segment)
        ref = np.empty_like(x)
        raw.Allreduce(x, ref)
        np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-4)
        # The same bits on every rank of the node.
        every = raw.allgather(y.tobytes())
        assert all(b == every[0] for b in every)
        g = comm.allgather(x, algorithm=segment)
        gref = np.empty(comm.size * n, np.float32)
        raw.Allgather(x, gref)
        np.testing.assert_array_equal(g.reshape(-1), gref)
        b = comm.broadcast(x, root=comm.size - 1, algorithm=segment)
        bref = x.copy()
        raw.Bcast(bref, root=comm.size - 1)
        np.testing.assert_array_equal(b, bref)
        xs = np.tile(x, comm.size)
        rs = comm.reduce_scatter(xs, algorithm=segment)
        rref = np.empty(n, np.float32)
        raw.Reduce_scatter_block(xs, rref)
        np.testing.assert_allclose(rs, rref, rtol=1e-5, atol=1e-4)
        comm.barrier(algorithm="shm")
        inplace = x.copy()
        comm.allreduce(inplace, out=inplace, algorithm=segment)
        np.testing.assert_array_equal(inplace, y)
        # The rooted collectives, at a root that moves with n, and alltoall: each against MPI's own.
        root = n % comm.size
        red = comm.reduce(x, root=root, algorithm=segment)
        redref = np.empty_like(x)
        raw.Reduce(x, redref, root=root)
        gat = comm.gather(x, root=root, algorithm=segment)
        gatref = np.empty(comm.size * n, np.float32)
        raw.Gather(x, gatref, root=root)
        if comm.rank == root:
            np.testing.assert_allclose(red, redref, rtol=1e-5, atol=1e-4)
            np.testing.assert_array_equal(red, y)  # every element folded in rank order, as the allreduce does
            np.testing.assert_array_equal(gat.reshape(-1), gatref)
        else:
            assert red is None and gat is None
        inplace = x.copy()
        comm.reduce(inplace, root=root, out=inplace if comm.rank == root else None, algorithm=segment)
        if comm.rank == root:
            np.testing.assert_array_equal(inplace, y)
        blocks = rng.standard_normal((comm.size, n)).astype(np.float32)
        sc = comm.scatter(blocks if comm.rank == root else None, root=root, out=np.empty(n, np.float32),
                          algorithm=segment)
        scref = np.empty(n, np.float32)
        raw.Scatter(blocks, scref, root=root)
        np.testing.assert_array_equal(sc, scref)
        a2a = comm.alltoall(blocks, algorithm=segment)
        a2aref = np.empty_like(blocks)
        raw.Alltoall(blocks, a2aref)
        np.testing.assert_array_equal(a2a, a2aref)
print("ok", comm.rank, flush=True)
"""


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs,per_node", [(2, None), (3, None), (4, None), (4, 2)])
def test_node_algorithms_under_mpiexec_agree_with_mpi(mpi, nprocs, per_node):
    env = {"COMMKIT_RANKS_PER_NODE": str(per_node)} if per_node else {}
    result = mpi(nprocs, MPI_SCRIPT, env=env, timeout=300)
    assert result.stdout.count("ok") == nprocs


LOOP_SCRIPT = """
import numpy as np
import commkit as ck
from mpi4py import MPI as M

comm = ck.init()
raw = M.COMM_WORLD.Dup()
p, n = comm.size, 6000
assert comm.timeout is None  # (untimed: a loop on the same arrays compiles its plan)
for shared in (False, True):
    new = (lambda *shape: comm.shared_empty(shape, np.float32)) if shared else \\
        (lambda *shape: np.empty(shape, np.float32))
    x, out, y = new(n), new(n), new(n)
    xs, rs, g, a, at = new(p * n), new(n), new(p, n), new(p, n), new(p, n)
    for i in range(6):  # new values in the same arrays at every call
        rng = np.random.default_rng([i, comm.rank, int(shared)])
        x[:] = rng.standard_normal(n)
        xs[:] = rng.standard_normal(p * n)
        a[:] = rng.standard_normal((p, n))
        ref = np.empty(n, np.float32)
        raw.Allreduce(x, ref)
        np.testing.assert_allclose(comm.allreduce(x, out=out, algorithm="shm"), ref, rtol=1e-5, atol=1e-4)
        y[:] = x
        comm.allreduce(y, out=y, algorithm="shm")
        np.testing.assert_array_equal(y, out)
        rref = np.empty(n, np.float32)
        raw.Reduce_scatter_block(xs, rref)
        np.testing.assert_allclose(comm.reduce_scatter(xs, out=rs, algorithm="shm"), rref, rtol=1e-5, atol=1e-4)
        gref = np.empty((p, n), np.float32)
        raw.Allgather(x, gref)
        np.testing.assert_array_equal(comm.allgather(x, out=g, algorithm="shm"), gref)
        aref = np.empty((p, n), np.float32)
        raw.Alltoall(a, aref)
        np.testing.assert_array_equal(comm.alltoall(a, out=at, algorithm="shm"), aref)
        bref = x.copy()
        raw.Bcast(bref, root=p - 1)
        y[:] = x
        np.testing.assert_array_equal(comm.broadcast(y, root=p - 1, out=y, algorithm="shm"), bref)
    assert comm._hot_allreduce is not None and comm._hot_allreduce.run is not None
print("ok")
"""


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 3])
def test_loops_on_the_same_arrays_run_compiled_node_calls_that_agree_with_mpi_under_mpiexec(mpi, nprocs):
    # Untimed, so each loop compiles its node calls into plans (private arrays, then shared ones in their
    # zero-copy form): every call against MPI's own collective on new values in the same arrays.
    result = mpi(nprocs, LOOP_SCRIPT, env={"COMMKIT_TIMEOUT": "", "COMMKIT_ZERO_COPY_MIN_BYTES": "0"}, timeout=180)
    assert result.stdout.count("ok") == nprocs


NEW_ARRAYS_SCRIPT = """
import numpy as np
import commkit as ck
from mpi4py import MPI as M

comm = ck.init()
raw = M.COMM_WORLD.Dup()
p, n = comm.size, 6000
for timeout in (None, 30.0):
    for i in range(6):  # new arrays every call: from a shape's second call on, its program (blocking) or its
        # program's generator (an i-form, two outstanding at once)
        rng = np.random.default_rng([i, comm.rank])
        x, xs, a = (rng.standard_normal(shape).astype(np.float32) for shape in (n, p * n, (p, n)))
        ref, rref, gref, aref = np.empty(n, np.float32), np.empty(n, np.float32), np.empty((p, n), np.float32), \\
            np.empty((p, n), np.float32)
        raw.Allreduce(x, ref)
        raw.Reduce_scatter_block(xs, rref)
        raw.Allgather(x, gref)
        raw.Alltoall(a, aref)
        bref = x.copy()
        raw.Bcast(bref, root=p - 1)
        np.testing.assert_allclose(comm.allreduce(x.copy(), algorithm="shm", timeout=timeout), ref, rtol=1e-5,
                                   atol=1e-4)
        np.testing.assert_allclose(comm.reduce_scatter(xs.copy(), algorithm="shm", timeout=timeout), rref,
                                   rtol=1e-5, atol=1e-4)
        np.testing.assert_array_equal(comm.allgather(x.copy(), algorithm="shm", timeout=timeout), gref)
        np.testing.assert_array_equal(comm.alltoall(a.copy(), algorithm="shm", timeout=timeout), aref)
        np.testing.assert_array_equal(comm.broadcast(x.copy(), root=p - 1, algorithm="shm", timeout=timeout), bref)
        first = comm.iallreduce(x.copy(), algorithm="shm", timeout=timeout)
        second = comm.ibroadcast(x.copy(), root=p - 1, algorithm="shm", timeout=timeout)
        np.testing.assert_array_equal(second.wait(), bref)
        np.testing.assert_allclose(first.wait(), ref, rtol=1e-5, atol=1e-4)
        np.testing.assert_array_equal(comm.iallgather(x.copy(), algorithm="shm", timeout=timeout).wait(), gref)
        np.testing.assert_array_equal(comm.ialltoall(a.copy(), algorithm="shm", timeout=timeout).wait(), aref)
# a shape plan whose op is the program, and an i-form's generator
assert any("'in': _b_in" in getattr(getattr(v, "run", None), "source", "") for v in comm._shaped.values())
assert any(e[1] is not None and "_pending" in e[1].source for e in comm._by_shape_i.values())
print("ok")
"""


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 3])
def test_node_calls_on_new_arrays_agree_with_mpi_under_mpiexec(mpi, nprocs):
    # Blocking calls and i-forms on new arrays every call, untimed and timed: their node programs (from the shapes'
    # plans and entries, and the programs' generators) against MPI's own collectives on the same data.
    result = mpi(nprocs, NEW_ARRAYS_SCRIPT, env={"COMMKIT_TIMEOUT": ""}, timeout=180)
    assert result.stdout.count("ok") == nprocs


@pytest.mark.mpi
def test_a_missing_rank_times_out_under_mpiexec(mpi):
    code = """
    import time
    import numpy as np
    import commkit as ck
    from commkit.errors import CommTimeout

    comm = ck.init()
    first, later = comm.dup(), comm.dup()
    later.allreduce(np.ones(8), algorithm="shm")  # its arena is made: rank 1 skips only the next call
    if comm.rank == 1:
        time.sleep(4)
    else:
        for c in (first, later):
            try:
                c.allreduce(np.ones(8), algorithm="shm", timeout=1)
            except CommTimeout as exc:
                print("TIMEOUT", exc, flush=True)
    """
    result = mpi(2, code, timeout=120)
    lines = [line for line in result.stdout.splitlines() if line.startswith("TIMEOUT")]
    assert len(lines) == 2, result.stdout
    assert "(Claim(8 elements per slot))" in lines[0] and "waiting for rank(s) 1" in lines[0]
    assert "(Wait(ranks [1] reach 1))" in lines[1] and "waiting for rank(s) 1" in lines[1]


def test_traced_node_calls_record_every_step():
    steps = list(algorithms.get("allreduce", "shm").schedule(0, 2, 100, ck.ops.SUM, segment=8))
    with ck.trace() as tracer:
        ck.run_local(lambda comm: comm.allreduce(np.ones(100), algorithm="shm:64"), size=2)
    events = [e for e in tracer.events if e["rank"] == 0]
    assert [e["step"] for e in events] == list(range(len(steps)))
    puts = [e for e, s in zip(events, steps) if isinstance(s, Put)]
    assert puts and all(e["range"][0] == "slot0" for e in puts)  # the ranges each step touches


DEFAULT_SCRIPT = """
import os
import numpy as np
import commkit as ck
from mpi4py import MPI as M

comm = ck.init()
raw = M.COMM_WORLD.Dup()
one_node = "COMMKIT_RANKS_PER_NODE" not in os.environ
assert comm.nodes == (1 if one_node else 2), comm.nodes
n = 1 << 18  # 1 MiB of float32: the shipped table's shm rules start here at 2 ranks on one node
for trial in range(3):  # the first call, the second (its plan) and the third (compiled where it can be)
    rng = np.random.default_rng([trial, comm.rank])
    x = rng.standard_normal(n).astype(np.float32)
    ref = np.empty_like(x)
    raw.Allreduce(x, ref)
    y = comm.allreduce(x)
    assert comm.last_algorithm == ("shm" if one_node else "ring"), comm.last_choice
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-4)
    assert np.array_equal(comm.iallreduce(x).wait(), y)  # the i-form runs the same algorithm
    assert comm.last_algorithm == ("shm" if one_node else "ring"), comm.last_choice
    assert np.array_equal(comm.allreduce(x, timeout=60), y)  # and so does a timed call
    red = comm.reduce(x, root=1)
    assert comm.last_algorithm == ("shm" if one_node else "naive"), comm.last_choice
    if comm.rank == 1:
        np.testing.assert_array_equal(red, y)
    half = x[: n // 2].copy()
    gat = comm.gather(half, root=0)  # 1 MiB gathered
    assert comm.last_algorithm == ("shm" if one_node else "binomial"), comm.last_choice
    gref = np.empty(n, np.float32) if comm.rank == 0 else None
    raw.Gather(half, gref, root=0)
    if comm.rank == 0:
        np.testing.assert_array_equal(gat.reshape(-1), gref)
    blocks = x.reshape(2, -1)  # 1 MiB scattered
    sc = comm.scatter(blocks if comm.rank == 1 else None, root=1, out=np.empty(n // 2, np.float32))
    assert comm.last_algorithm == ("shm" if one_node else "binomial"), comm.last_choice
    scref = np.empty(n // 2, np.float32)
    raw.Scatter(blocks, scref, root=1)
    np.testing.assert_array_equal(sc, scref)
# Arrays every rank of the node can read: the default's shm reads peers' arrays where they lie (no slot).
if one_node:
    xs, outs = comm.shared_empty(n, np.float32), comm.shared_empty(n, np.float32)
    xs[:] = x
    with ck.trace() as traced:
        comm.allreduce(xs, out=outs)
    assert comm.last_algorithm == "shm", comm.last_choice
    np.testing.assert_array_equal(outs, y)
    names = {name for e in traced.events if e["rank"] == comm.rank for name in (e["range"][0], e["src_range"][0])}
    assert f"out@{1 - comm.rank}" in names and not any(name.startswith("slot") for name in names), names
# A persistent request of the same shape runs the same algorithm (its steps through the interpreter).
req = comm.allreduce_init(x)
for _ in range(3):
    req.start()
    np.testing.assert_array_equal(req.wait(), y)
assert ("(shm)" if one_node else "(ring)") in repr(req), repr(req)
req.free()
assert np.array_equal(comm.allreduce(x), y) and comm.last_algorithm == ("shm" if one_node else "ring")
# At 32 KiB every form of the allreduce runs shm (blocking and i-form compiled, a persistent request its program's
# generator); a persistent broadcast only from 16 KiB, where a blocking one runs shm from 8 KiB.
small = x[: 8 << 10]
want = np.empty_like(small)
raw.Allreduce(small, want)
np.testing.assert_array_equal(comm.allreduce(small), want)
assert comm.last_algorithm == ("shm" if one_node else "recursive_doubling"), comm.last_choice
np.testing.assert_array_equal(comm.iallreduce(small).wait(), want)
assert comm.last_algorithm == ("shm" if one_node else "recursive_doubling"), comm.last_choice
req = comm.allreduce_init(small)
np.testing.assert_array_equal(req.start().wait(), want)
assert ("(shm)" if one_node else "(recursive_doubling)") in repr(req), repr(req)
req.free()
eight = x[: 2 << 10].copy()  # 8 KiB
bref = eight.copy()
raw.Bcast(bref, root=0)
np.testing.assert_array_equal(comm.broadcast(eight, root=0), bref)
assert comm.last_algorithm == ("shm" if one_node else "binomial"), comm.last_choice
req = comm.broadcast_init(eight.copy(), root=0)
np.testing.assert_array_equal(req.start().wait(), bref)
assert "(binomial)" in repr(req), repr(req)
req.free()
# At 8 KiB a rank the allreduce, reduce, gather and allgather run shm on MPICH alone (a rule naming the library):
# Open MPI's runs did not put it ahead there.
mpich = one_node and M.get_vendor()[0] == "MPICH"
mine = eight + comm.rank  # (ranks' data differ)
aref, gref8 = np.empty_like(mine), np.empty((2, mine.size), np.float32)
raw.Allreduce(mine, aref)
raw.Allgather(mine, gref8)
np.testing.assert_array_equal(comm.allreduce(mine), aref)
assert comm.last_algorithm == ("shm" if mpich else "recursive_doubling"), comm.last_choice
assert ("MPICH only" in comm.last_choice.reason) == mpich, comm.last_choice
np.testing.assert_array_equal(comm.allgather(mine), gref8)
assert comm.last_algorithm == ("shm" if mpich else "recursive_doubling"), comm.last_choice
print("ok", comm.rank, flush=True)
"""


@pytest.mark.mpi
@pytest.mark.parametrize("per_node", [None, 1])
def test_the_default_picks_the_node_engine_on_one_node_under_mpiexec(mpi, per_node):
    # 2 ranks on one node from 1 MiB: the shipped table names shm (measured); on two emulated nodes the two-sided
    # algorithms, and a persistent request, which runs compiled plans, takes the table's next rule.
    env = {"COMMKIT_RANKS_PER_NODE": str(per_node)} if per_node else {}
    result = mpi(2, DEFAULT_SCRIPT, env=env, timeout=120)
    assert result.stdout.count("ok") == 2


def test_the_threads_world_keeps_the_two_sided_default():
    # The table's shm rules name the transport they were measured on: in the threads world messages are handed
    # over without a copy, and the arena measured 2-5x slower there (the ring at 1 MiB: 169 us, shm: 569).
    def body(comm):
        y = comm.allreduce(np.ones(1 << 18, np.float32))
        return comm.last_algorithm, float(y[0])

    assert ck.run_local(body, size=2) == [("ring", 2.0)] * 2


def test_nodes_counts_what_the_emulation_knob_splits(monkeypatch):
    assert ck.run_local(lambda comm: comm.nodes, size=3) == [1, 1, 1]
    monkeypatch.setenv("COMMKIT_RANKS_PER_NODE", "2")
    assert ck.run_local(lambda comm: comm.nodes, size=5) == [3] * 5


@pytest.mark.parametrize("env", [{"COMMKIT_NODE_ARENA_BYTES": "65536"}, {"COMMKIT_SEGMENT_ELEMENTS": str(1 << 22)}])
def test_a_table_rule_for_the_node_engine_yields_to_an_arena_too_small_for_the_call(tmp_path, monkeypatch, env):
    # The shipped shm rules hold under MPI only; a tuning file's rule for the threads world shows the same path.
    # An arena set small, or segments set large for the pipelined algorithms, must not turn a call the two-sided
    # default runs into an error: the rule is passed over. Forced by name, the call still says why it cannot run.
    table = {"allreduce": [{"one_node": True, "algorithm": "shm", "reason": "test"},
                           {"algorithm": "ring", "reason": "test"}]}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(table))
    monkeypatch.setenv("COMMKIT_TUNING", str(path))

    for key, value in env.items():
        monkeypatch.setenv(key, value)

    def body(comm):
        x = np.full(1 << 21, comm.rank + 1.0, np.float32)  # 8 MiB: in one chunk of 4M elements, 16 MiB of slot
        small = comm.allreduce(x[:1000])  # fits the arena: the rule holds
        assert comm.last_algorithm == "shm", comm.last_choice
        got = comm.allreduce(x)
        algorithm = comm.last_algorithm
        try:
            comm.allreduce(x, algorithm="shm")
        except InvalidArgument as exc:
            error = str(exc)
        else:
            error = ""
        return float(small[0]), float(got[0]), algorithm, error

    for small, value, algorithm, error in ck.run_local(body, size=2):
        assert (small, value, algorithm) == (3.0, 3.0, "ring")
        assert "bytes of slot per rank, but the node arena has" in error, error


def test_an_arena_that_cannot_be_allocated_leaves_a_tables_calls_to_the_two_sided_algorithms(tmp_path, monkeypatch):
    # A table's pick must not turn a call the two-sided algorithms run into an error: every rank learns the arena
    # could not be made, warns once, and keeps the next rule for this communicator. Asked for by name, the node
    # algorithm still says why it cannot run, before anything is sent.
    table = {"allreduce": [{"one_node": True, "algorithm": "shm", "reason": "test"},
                           {"algorithm": "ring", "reason": "test"}]}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(table))
    monkeypatch.setenv("COMMKIT_TUNING", str(path))
    monkeypatch.setenv("COMMKIT_NODE_ARENA_BYTES", str(1 << 50))  # (NumPy cannot allocate a petabyte)

    def body(comm):
        sums = [float(comm.allreduce(np.full(1000, comm.rank + k, np.float64))[0]) for k in range(3)]
        algorithm = comm.last_algorithm
        try:
            comm.allreduce(np.ones(1000), algorithm="shm")
        except ck.CommError as exc:
            error = str(exc)
        else:
            error = ""
        fresh = comm.dup()  # another communicator tries again, and falls back alike
        again = float(fresh.allreduce(np.ones(10))[0]), fresh.last_algorithm
        return sums, algorithm, error, again

    import warnings

    with warnings.catch_warnings(record=True) as caught:  # (in this thread: the rank threads share the module)
        warnings.simplefilter("always")
        results = ck.run_local(body, size=2)
    for sums, algorithm, error, again in results:
        assert sums == [1.0, 3.0, 5.0] and algorithm == "ring"
        assert "could not allocate the node arena" in error, error
        assert again == (2.0, "ring")
    warned = sorted(str(w.message) for w in caught if "node arena" in str(w.message))
    # One warning per rank and communicator, each saying what happens next.
    assert len(warned) == 4, warned
    assert all("could not allocate the node arena" in w and "node algorithms are off for this communicator" in w
               for w in warned), warned


def test_the_room_for_an_arena_is_looked_at_before_the_librarys_collective(tmp_path, monkeypatch):
    from commkit.transports._arena import lacks_room

    assert lacks_room(2, shm=str(tmp_path)) is None  # 2 x 8 MiB: a test machine's tmp holds that
    assert lacks_room(2, shm=str(tmp_path / "missing")) is None  # no way to tell: the library decides
    monkeypatch.setenv("COMMKIT_NODE_ARENA_BYTES", str(1 << 50))
    why = lacks_room(2, shm=str(tmp_path))
    assert why.startswith("could not allocate the node arena") and "COMMKIT_NODE_ARENA_BYTES" in why, why
    assert f"needs {2 * (128 + (1 << 50))}" in why, why


@pytest.mark.parametrize("p", [2, 3])
def test_a_persistent_request_the_table_sends_to_the_node_engine_falls_back_when_its_arena_cannot_be_had(
        tmp_path, monkeypatch, p):
    # A persistent request runs on a channel of its own, whose arena is made at *_init. Where the communicator's
    # arena is made but the channel's cannot be had (COMMKIT_NODE_ARENA_BYTES raised between the two past what NumPy
    # can allocate), a table's node pick gives way at init to the two-sided algorithm, on every rank, with one
    # warning, instead of failing at the first start(). Asked for by name, shm raises at init.
    table = {"allreduce": [{"one_node": True, "algorithm": "shm", "reason": "test"},
                           {"algorithm": "ring", "reason": "test"}]}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(table))
    monkeypatch.setenv("COMMKIT_TUNING", str(path))
    monkeypatch.setenv("COMMKIT_NODE_ARENA_BYTES", str(1 << 20))  # (restored after a rank thread raises it)
    n = 1000

    def body(comm):
        comm.allreduce(np.ones(n))  # the table's shm: the communicator's own arena is made
        before = comm.last_algorithm
        comm.barrier()
        if comm.rank == 0:
            os.environ["COMMKIT_NODE_ARENA_BYTES"] = str(1 << 50)  # (NumPy cannot allocate a petabyte)
        comm.barrier()
        x = np.empty(n)
        request = comm.allreduce_init(x)
        got = []
        for k in range(4):
            x[:] = _data(comm.rank, n, k, "float64")
            request.start()
            got.append(request.wait().copy())
        try:
            comm.allreduce_init(x, algorithm="shm")
        except CommError as exc:
            error = str(exc)
        else:
            error = ""
        comm.allreduce(x)  # the communicator's own arena still serves the table's pick
        return before, repr(request), got, error, comm.last_algorithm

    import warnings

    with warnings.catch_warnings(record=True) as caught:  # (in this thread: the rank threads share the module)
        warnings.simplefilter("always")
        results = ck.run_local(body, size=p)
    for before, request, got, error, after in results:
        assert (before, after) == ("shm", "shm") and "(ring)" in request, (before, after, request)
        for k, value in enumerate(got):
            np.testing.assert_allclose(value, sum(_data(r, n, k, "float64") for r in range(p)), rtol=1e-12)
        assert "asked for by name" in error and "could not allocate the node arena" in error, error
    warned = [str(w.message) for w in caught if "node arena" in str(w.message)]
    assert len(warned) == p, warned  # one per rank, none at the starts
    assert {w.filename for w in caught} == {__file__}, [(w.filename, w.lineno) for w in caught]  # the *_init's line
    assert all("could not allocate the node arena" in w and "persistent allreduce request runs the two-sided "
               "algorithm 'ring'" in w for w in warned), warned


ONE_RANK_SCRIPT = """
import numpy as np
import commkit as ck

comm = ck.init()
x = np.arange(1 << 18, dtype=np.float32)  # 1 MiB: the shipped table picks shm, whose one-rank form claims no slot
assert np.array_equal(comm.allreduce(x), x) and comm.last_algorithm == "shm", comm.last_choice
a, b = comm.shared_empty(x.shape, x.dtype), comm.shared_empty(x.shape, x.dtype)  # the arena, made at one rank
a[:] = x
assert comm.allreduce(a, out=b, algorithm="shm") is b and np.array_equal(b, x)
print("ok", flush=True)
"""


@pytest.mark.mpi
def test_a_one_rank_communicator_runs_the_node_engine_and_its_shared_arrays_under_mpiexec(mpi):
    # MPICH gives a one-rank node's shared window malloc'd memory on a 16-byte boundary: the arena uses each
    # segment from its first cache line (it asserted and raised before), and a table's pick makes no arena for a
    # schedule that claims no slot.
    result = mpi(1, ONE_RANK_SCRIPT, timeout=120)
    assert "ok" in result.stdout, result.stdout + result.stderr


ARENA_FAILS_SCRIPT = """
import warnings
import numpy as np
from mpi4py import MPI
import commkit as ck

comm = ck.init()
raw = MPI.COMM_WORLD.Dup()
x = np.arange(1 << 18, dtype=np.float32) + comm.rank  # 1 MiB: the shipped table picks shm on one node
want = np.empty_like(x)
raw.Allreduce(x, want, MPI.SUM)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    got = comm.allreduce(x)
assert np.array_equal(got, want) and comm.last_algorithm != "shm", comm.last_choice
assert len(caught) == 1 and "could not allocate the node arena" in str(caught[0].message), caught
try:
    comm.allreduce(x, algorithm="shm")
except ck.CommError as exc:
    assert "could not allocate the node arena" in str(exc), exc
else:
    raise AssertionError("a node algorithm asked for by name ran without its arena")
assert np.array_equal(comm.allreduce(x), want)  # still usable, still two-sided
print("ok", comm.rank, flush=True)
"""


@pytest.mark.mpi
def test_an_arena_that_cannot_be_allocated_under_mpiexec_leaves_the_default_to_the_two_sided_algorithms(mpi):
    result = mpi(2, ARENA_FAILS_SCRIPT, env={"COMMKIT_NODE_ARENA_BYTES": str(1 << 50)}, timeout=120)
    assert result.stdout.count("ok") == 2, result.stdout + result.stderr


PERSISTENT_ARENA_FAILS_SCRIPT = """
import os, warnings
import numpy as np
from mpi4py import MPI
import commkit as ck

comm = ck.init()
raw = MPI.COMM_WORLD.Dup()
n = 1 << 18  # 1 MiB of float32: the shipped table picks shm on one node
comm.allreduce(np.ones(n, np.float32))
assert comm.last_algorithm == "shm", comm.last_choice  # the communicator's own arena is made
os.environ["COMMKIT_NODE_ARENA_BYTES"] = str(1 << 50)  # /dev/shm has no room for the request's channel's
x = np.empty(n, np.float32)
want = np.empty_like(x)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    request = comm.allreduce_init(x)
    for k in range(4):
        x[:] = np.random.default_rng([k, comm.rank]).standard_normal(n)
        raw.Allreduce(x, want)
        request.start()
        np.testing.assert_allclose(request.wait(), want, rtol=1e-6)
assert "(shm)" not in repr(request), repr(request)
assert len(caught) == 1, [str(w.message) for w in caught]
assert "could not allocate the node arena" in str(caught[0].message), caught[0].message
assert "persistent allreduce request runs the two-sided algorithm" in str(caught[0].message), caught[0].message
try:
    comm.allreduce_init(x, algorithm="shm")
except ck.CommError as exc:
    assert "asked for by name" in str(exc) and "could not allocate the node arena" in str(exc), exc
else:
    raise AssertionError("a persistent node request asked for by name was made without its arena")
request.free()
assert np.array_equal(comm.allreduce(x), want) and comm.last_algorithm == "shm", comm.last_choice
print("ok", comm.rank, flush=True)
"""


@pytest.mark.mpi
def test_a_persistent_request_whose_arena_cannot_be_had_under_mpiexec_runs_two_sided(mpi):
    result = mpi(2, PERSISTENT_ARENA_FAILS_SCRIPT, timeout=120)
    assert result.stdout.count("ok") == 2, result.stdout + result.stderr


FREE_SCRIPT = """
import time, warnings
import numpy as np
import commkit as ck

comm = ck.init()
x = np.ones(1 << 18, np.float32)


def mapped():  # bytes of /dev/shm files (MPI's shared windows among them) this rank maps now
    total = 0
    with open("/proc/self/maps") as f:
        for line in f:
            if "/dev/shm/" in line:
                start, end = line.split()[0].split("-")
                total += int(end, 16) - int(start, 16)
    return total


# Communicators that used the node engine give their arena back when freed (on every rank): 30 of them at
# 1 MiB left 31 MiB in /dev/shm until the job ended before. A shared array made on one outlives it.
# Counted in what this rank maps, not in /dev/shm's usage: that is the machine's, and other jobs (the test
# suite's other workers) add to it while the loop runs. Each arena maps 16 MiB, so a leak shows 30 times that.
kept = []
comm.barrier()
before = mapped()
for _ in range(30):
    d = comm.dup()
    d.allreduce(x, algorithm="shm")
    kept.append(d.shared_empty(4, np.float64))
    d.free()
comm.barrier()
grown = mapped() - before
kept[0][:] = comm.rank
assert kept[0].tolist() == [comm.rank] * 4
assert grown < (8 << 20), f"this rank maps {grown} bytes more of /dev/shm after 30 freed communicators"

# A rank that frees alone (its peer comes after the timeout) gives up with a warning, and so does the peer:
# neither waits in the library's free for a rank that will not come.
d = comm.dup()
d.allreduce(x, algorithm="shm")
d.timeout = 0.5
if comm.rank == 1:
    time.sleep(1.5)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    d.free()
assert any("node arena stays until the job ends" in str(w.message) for w in caught), [str(w.message) for w in caught]
comm.barrier()
print("ok", comm.rank, grown, flush=True)
"""


@pytest.mark.mpi
def test_freeing_a_communicator_gives_its_node_arena_back_under_mpiexec(mpi):
    result = mpi(2, FREE_SCRIPT, timeout=120)
    assert result.stdout.count("ok") == 2, result.stdout + result.stderr
