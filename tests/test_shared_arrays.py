"""Shared arrays (``Communicator.shared_empty``) and the node algorithms' zero-copy forms (threads and mpiexec)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import commkit as ck
from commkit import collectives
from commkit.algorithms import get
from commkit.errors import CollectiveMismatch, InvalidArgument
from commkit.schedule import ONE_SIDED, inplace_safe

@pytest.fixture(autouse=True, scope="module")
def _zero_copy_at_every_size():
    # These tests run small calls, which keep the copying form by default (node.ZERO_COPY_MIN_BYTES).
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("COMMKIT_ZERO_COPY_MIN_BYTES", "0")
        yield


ZERO_COPY = ("allreduce", "broadcast", "allgather", "reduce_scatter", "alltoall")
BLOCKED = ("reduce_scatter", "alltoall")
"""Collectives whose input holds a block for every rank."""
IN_PLACE = ("allreduce", "broadcast")


def _data(rank, n, seed, dtype):
    rng = np.random.default_rng([seed, rank])
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(n).astype(dtype)
    return rng.integers(-1000, 1000, n).astype(dtype)


def _zero_copy_call(comm, collective, n, seed, dtype, root, in_place, nonblocking):
    """Run ``collective`` on shared arrays: ``(result, input as given, input after the call)``."""
    p = comm.size
    x = comm.shared_empty(n * p if collective in BLOCKED else n, dtype)
    x[:] = _data(comm.rank, x.size, seed, dtype)
    given_x = x.copy()
    if collective in ("allgather", "alltoall"):
        out = comm.shared_empty((p, n), dtype)
        x = x.reshape(p, n) if collective == "alltoall" else x
    elif collective == "reduce_scatter":
        out = comm.shared_empty(n, dtype)
    else:
        out = x if in_place else comm.shared_empty(n, dtype)
    forms = {"allreduce": (comm.allreduce, comm.iallreduce), "broadcast": (comm.broadcast, comm.ibroadcast),
             "allgather": (comm.allgather, comm.iallgather),
             "reduce_scatter": (comm.reduce_scatter, comm.ireduce_scatter),
             "alltoall": (comm.alltoall, comm.ialltoall)}
    blocking, start = forms[collective]
    kwargs = {"root": root} if collective == "broadcast" else {}
    if nonblocking:
        start(x, out=out, algorithm="shm", **kwargs).wait()
    else:
        blocking(x, out=out, algorithm="shm", **kwargs)
    return out.copy(), given_x, x.reshape(-1).copy()


@settings(max_examples=40, deadline=None)
@given(collective=st.sampled_from(ZERO_COPY), p=st.integers(1, 8), n=st.integers(0, 70), seed=st.integers(0, 2**31),
       dtype=st.sampled_from(["float32", "float64", "int32"]), root=st.integers(0, 7), in_place=st.booleans(),
       nonblocking=st.booleans())
def test_zero_copy_forms_match_numpy_on_threads(collective, p, n, seed, dtype, root, in_place, nonblocking):
    root %= p
    got = ck.run_local(lambda comm: _zero_copy_call(comm, collective, n, seed, dtype, root, in_place, nonblocking),
                       size=p)
    xs = [_data(r, n * p if collective in BLOCKED else n, seed, dtype) for r in range(p)]
    total = xs[0].copy()
    for x in xs[1:]:
        total = total + x
    for r, (result, given_x, after) in enumerate(got):
        if collective in ("allreduce", "reduce_scatter"):
            want = total if collective == "allreduce" else total[r * n:(r + 1) * n]
            if np.dtype(dtype).kind == "f":
                np.testing.assert_allclose(result, want, rtol=1e-5, atol=1e-5)
            else:
                np.testing.assert_array_equal(result, want)
            if collective == "allreduce":
                assert result.tobytes() == got[0][0].tobytes()  # one rank folds each element, in rank order
        elif collective == "broadcast":
            np.testing.assert_array_equal(result, xs[root])
        elif collective == "allgather":
            np.testing.assert_array_equal(result, np.stack(xs) if n else np.empty((p, 0), dtype))
        else:
            np.testing.assert_array_equal(result.reshape(-1), np.concatenate([x[r * n:(r + 1) * n] for x in xs]))
        if not (in_place and collective in IN_PLACE):
            np.testing.assert_array_equal(after, given_x)  # the input is the caller's: never written


@pytest.mark.parametrize("p", [2, 3, 5])
def test_zero_copy_allreduce_has_the_bits_of_the_copying_form(p):
    # Both fold every element in rank order, one rank each: shared arrays change where the data lies, not the sum.
    def body(comm):
        n = 1000
        x = comm.shared_empty(n, np.float32)
        x[:] = _data(comm.rank, n, 7, np.float32) * 1e3
        copied = comm.allreduce(x.copy(), algorithm="shm")
        out = comm.shared_empty(n, np.float32)
        comm.allreduce(x, out=out, algorithm="shm")
        comm.allreduce(x, out=x, algorithm="shm")  # in place: rank 2 and up fold into one of their operands
        return copied.tobytes(), out.tobytes(), x.tobytes()

    for copied, shared, in_place in ck.run_local(body, p):
        assert copied == shared == in_place


def test_shared_arrays_take_the_zero_copy_form_and_others_the_copying_one():
    # One trace around run_local records every rank thread (a trace opened in each thread records only
    # while every thread's is open); the two calls are told apart by their call numbers.
    def body(comm):
        x = comm.shared_empty(8, np.float64)
        out = comm.shared_empty(8, np.float64)
        x[:] = comm.rank
        comm.allreduce(x, out=out, algorithm="shm")
        comm.allreduce(np.full(8, float(comm.rank)), out=np.empty(8), algorithm="shm")
        return out.tolist()

    with ck.trace() as tracer:
        outs = ck.run_local(body, 2)
    first, second = sorted({e["seq"] for e in tracer.events if e["collective"] == "allreduce"})
    for r, out in enumerate(outs):
        names = {seq: set().union(*({e["range"][0], e["src_range"][0]} for e in tracer.events
                                    if e["rank"] == r and e["seq"] == seq)) for seq in (first, second)}
        shared, copied = names[first], names[second]
        assert f"out@{1 - r}" in shared and not any(name.startswith("slot") for name in shared), shared
        assert not any("@" in name for name in copied) and any(name.startswith("slot") for name in copied), copied
        assert out == [1.0] * 8


@pytest.mark.parametrize("p", [2, 3, 4])
def test_zero_copy_i_forms_in_flight_together_complete_in_any_order(p):
    # Node calls take the arena in call order (nonblocking ones may be in flight together); each records
    # where its own arrays lie when it takes it, so two zero-copy i-forms waited for in reverse order,
    # with a two-sided call between, each read their own peers' arrays.
    def body(comm):
        r = comm.rank
        a, b = comm.shared_empty(100, np.float64), comm.shared_empty(100, np.float64)
        oa, ob = comm.shared_empty(100, np.float64), comm.shared_empty(100, np.float64)
        for it in range(10):
            a[:], b[:] = r + it, 10 * r - it
            first = comm.iallreduce(a, out=oa, algorithm="shm")
            second = comm.iallreduce(b, out=ob, algorithm="shm")
            between = comm.allreduce(np.ones(3))
            second.wait()
            first.wait()
            assert (oa == sum(q + it for q in range(p))).all() and (ob == sum(10 * q - it for q in range(p))).all()
            assert (between == p).all()
        return "ok"

    assert ck.run_local(body, p) == ["ok"] * p


@pytest.mark.parametrize("p", [2, 3])
def test_a_repeated_call_reads_each_peers_arrays_where_they_are_now(p):
    # Rank 0 repeats one pair of shared arrays, so its calls run one node program; the last rank alternates two
    # pairs, and at 3 ranks rank 1 takes a new pair at every call. Each call must read every peer's arrays of
    # that call (a rank keeps its views of a peer's arrays by where the peer says they lie, read at each call).
    def body(comm):
        pairs = [(comm.shared_empty(64), comm.shared_empty(64)) for _ in range(2)]
        got = []
        for i in range(6):
            x, out = comm.shared_empty(64), comm.shared_empty(64)  # (collective: every rank makes the new pair)
            if comm.rank == 0:
                x, out = pairs[0]
            elif comm.rank == comm.size - 1:
                x, out = pairs[i % 2]
            x[:] = np.arange(64) * (comm.rank + 1) + i
            comm.allreduce(x, out=out, algorithm="shm")
            got.append(out.copy())
        return got

    for got in ck.run_local(body, size=p):
        for i, out in enumerate(got):
            np.testing.assert_array_equal(out, np.arange(64) * sum(range(1, p + 1)) + p * i)


def _traced_forms(body, p):
    """``run_local(body, p)``'s results, and each rank's node calls in call order: "zero copy" or "copying".

    One trace over the whole world: a trace opened by a rank thread records
    only while it is the innermost open one, so each rank's own would race.
    """
    with ck.trace() as t:
        results = ck.run_local(body, p)
    names = {}
    for e in t.events:
        if e["collective"] in ("allreduce", "broadcast"):
            names.setdefault((e["rank"], e["seq"]), set()).update((e["range"][0], e["src_range"][0]))
    forms = [["zero copy" if any("@" in name for name in names[key]) else "copying"
              for key in sorted(k for k in names if k[0] == r)] for r in range(p)]
    return results, forms


def test_each_collective_has_its_own_default_zero_copy_size(monkeypatch):
    # node.ZERO_COPY_MIN_BYTES: 512 KiB, but 1 MiB for the allreduce (measured to lose at 512 KiB where memory
    # is fast).
    monkeypatch.delenv("COMMKIT_ZERO_COPY_MIN_BYTES")
    calls = (("allreduce", 512 << 10), ("allreduce", 1 << 20), ("broadcast", 512 << 10))

    def run(comm):
        got = []
        for collective, nbytes in calls:
            x, out = comm.shared_empty(nbytes // 8, np.float64), comm.shared_empty(nbytes // 8, np.float64)
            x[:] = comm.rank + 1
            if collective == "allreduce":
                comm.allreduce(x, out=out, algorithm="shm")
            else:
                comm.broadcast(x, root=1, out=out, algorithm="shm")
            got.append(float(out[-1]))
        return got

    results, forms = _traced_forms(run, 2)
    assert results == [[3.0, 3.0, 2.0]] * 2
    seen = forms[0]
    assert seen == ["copying", "zero copy", "zero copy"], seen


def test_calls_below_the_zero_copy_size_keep_the_copying_form(monkeypatch):
    def outs(comm):
        got = []
        for n in (7, 8):  # 56 and 64 bytes of float64
            x, out = comm.shared_empty(n, np.float64), comm.shared_empty(n, np.float64)
            x[:] = comm.rank
            comm.allreduce(x, out=out, algorithm="shm")
            got.append(out.tolist())
        return got

    def forms():
        results, forms = _traced_forms(outs, 2)
        return [list(zip(f, r)) for f, r in zip(forms, results)]

    monkeypatch.setenv("COMMKIT_ZERO_COPY_MIN_BYTES", "64")
    for seen in forms():
        assert seen == [("copying", [1.0] * 7), ("zero copy", [1.0] * 8)], seen
    monkeypatch.delenv("COMMKIT_ZERO_COPY_MIN_BYTES")  # the default (the allreduce: 1 MiB)
    for seen in forms():
        assert [form for form, _ in seen] == ["copying", "copying"], seen
    monkeypatch.setenv("COMMKIT_ZERO_COPY_MIN_BYTES", "lots")

    def refused(comm):
        x = comm.shared_empty(4, np.float64)
        with pytest.raises(InvalidArgument) as info:  # on every rank, before anything is sent
            comm.allreduce(x, out=x, algorithm="shm")
        return str(info.value)

    for message in ck.run_local(refused, 2):
        assert "COMMKIT_ZERO_COPY_MIN_BYTES" in message and "'lots'" in message, message


@pytest.mark.parametrize("p", [2, 3])
def test_a_rank_whose_arrays_are_not_shared_is_named_on_every_rank(p):
    def body(comm):
        xs, outs = comm.shared_empty(5, np.float64), comm.shared_empty(5, np.float64)
        x, out = (xs, outs) if comm.rank == 0 else (np.ones(5), np.ones(5))
        x[:] = 1
        with pytest.raises(CollectiveMismatch) as info:
            comm.allreduce(x, out=out, algorithm="shm", timeout=30)
        return str(info.value)

    messages = ck.run_local(body, p)
    assert "this rank's arrays are shared" in messages[0] and "rank 1's are not" in messages[0], messages[0]
    for message in messages[1:]:
        assert "this rank's arrays are not shared" in message and "rank 0's are" in message, message


def test_shared_empty_refuses_bad_arguments_before_anything_is_sent():
    def body(comm):
        errors = []
        for args in (((-1,), np.float32), ("many", np.float32), ((3,), object)):
            with pytest.raises(InvalidArgument) as info:
                comm.shared_empty(*args)
            errors.append(str(info.value))
        a = comm.shared_empty((2, 3), np.int16)
        return errors, a.shape, a.dtype, a.flags.writeable

    for errors, shape, dtype, writeable in ck.run_local(body, 2):
        assert "must not be negative" in errors[0] and "(-1,)" in errors[0]
        assert "whole number" in errors[1] and "'many'" in errors[1]
        assert "not Python objects" in errors[2]
        assert shape == (2, 3) and dtype == np.int16 and writeable


@pytest.mark.parametrize("collective", ZERO_COPY)
@pytest.mark.parametrize("p", [2, 3, 4])
def test_zero_copy_forms_are_in_place_safe_where_the_communicator_relies_on_it(collective, p):
    # The communicator gives an in-place call its one array as both "in" and "out" only when the
    # schedule allows it; otherwise it would save the input to private memory, which peers cannot read.
    alg = get(collective, "shm")
    count = (37,) * p if collective == "reduce_scatter" else 37
    for rank in range(p):
        steps = list(collectives.steps(alg.schedule, collective, rank, p, count, ck.ops.get_op("sum"), 1,
                                       shared=True))
        assert any(step.kind in ONE_SIDED for step in steps)
        if collective in IN_PLACE:  # the others' input is never their output
            assert inplace_safe(steps), (collective, p, rank)


MPI_SCRIPT = """
import numpy as np
from mpi4py import MPI as M
import commkit as ck

comm = ck.init("mpi")
raw = M.COMM_WORLD.Dup()
p, r = comm.size, comm.rank
for n in (0, 1, 7, 5000, 70_001):
    rng = np.random.default_rng([n, r])
    x = comm.shared_empty(n, np.float32)
    x[:] = rng.standard_normal(n).astype(np.float32)
    given = x.copy()
    out = comm.shared_empty(n, np.float32)
    comm.allreduce(x, out=out, algorithm="shm")
    ref = np.empty_like(given)
    raw.Allreduce(given, ref)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(x, given)
    every = raw.allgather(out.tobytes())
    assert all(b == every[0] for b in every)
    assert out.tobytes() == comm.allreduce(given, algorithm="shm").tobytes()
    comm.allreduce(x, out=x, algorithm="shm")
    assert x.tobytes() == out.tobytes()
    b = comm.shared_empty(n, np.float32)
    b[:] = given
    root = n % p
    comm.broadcast(b, root=root, out=b, algorithm="shm")
    bref = given.copy()
    raw.Bcast(bref, root=root)
    np.testing.assert_array_equal(b, bref)
    g = comm.shared_empty((p, n), np.float32)
    x[:] = given
    comm.allgather(x, out=g, algorithm="shm")
    gref = np.empty((p, n), np.float32)
    raw.Allgather(given, gref)
    np.testing.assert_array_equal(g, gref)
    comm.iallreduce(x, out=out, algorithm="shm").wait()
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-4)
    blocks = comm.shared_empty((p, n), np.float32)
    blocks[:] = rng.standard_normal((p, n)).astype(np.float32)
    rs = comm.shared_empty(n, np.float32)
    comm.reduce_scatter(blocks.reshape(-1), out=rs, algorithm="shm")
    rref = np.empty(n, np.float32)
    raw.Reduce_scatter_block(blocks.copy(), rref)
    np.testing.assert_allclose(rs, rref, rtol=1e-5, atol=1e-4)
    a2a = comm.shared_empty((p, n), np.float32)
    comm.alltoall(blocks, out=a2a, algorithm="shm")
    aref = np.empty((p, n), np.float32)
    raw.Alltoall(blocks.copy(), aref)
    np.testing.assert_array_equal(a2a, aref)
print("ok", r, flush=True)
"""


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 3, 4])
def test_zero_copy_forms_under_mpiexec_agree_with_mpi(mpi, nprocs):
    result = mpi(nprocs, MPI_SCRIPT, timeout=300, env={"COMMKIT_ZERO_COPY_MIN_BYTES": "0"})
    assert result.stdout.count("ok") == nprocs


@pytest.mark.mpi
def test_shared_empty_on_a_communicator_across_emulated_nodes_says_why_under_mpiexec(mpi):
    code = """
    import numpy as np
    import commkit as ck
    from commkit.errors import AlgorithmNotApplicable

    comm = ck.init("mpi")
    try:
        comm.shared_empty(4, np.float64)
    except AlgorithmNotApplicable as exc:
        assert "spans 2 nodes" in str(exc), exc
        print("refused", comm.rank, flush=True)
    node = comm.split(comm.rank // 2)
    a = node.shared_empty(4, np.float64)
    a[:] = comm.rank
    node.allreduce(a, out=a, algorithm="shm")
    assert a.tolist() == [float(sum(range(comm.rank // 2 * 2, comm.rank // 2 * 2 + 2)))] * 4, a
    print("ok", comm.rank, flush=True)
    """
    result = mpi(4, code, env={"COMMKIT_RANKS_PER_NODE": "2"}, timeout=120)
    assert result.stdout.count("refused") == 4 and result.stdout.count("ok") == 4
