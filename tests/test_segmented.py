"""Segmented and pipelined chains, trees and rings (commkit/algorithms/segmented.py, issue 14).

Results against NumPy on the threads world for p = 1..16 with segment sizes that do and do
not divide the count, every root; no deadlock for p = 1..64 and several segment counts;
message and byte counts from the algorithms' definitions; the cost formulas against the
simulator where they claim exactness; overlap and in-place safety of the schedules; and a
real MPI run.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from contracts import cases, check_case, collective_input
from hypothesis import given, settings
from hypothesis import strategies as st

import commkit as ck
from commkit import algorithms, communicator, sim, testing
from commkit.algorithms import pipelined, segmented
from commkit.schedule import COPY, REDUCE, Transfer, check_overlap, partition

NEW = [("broadcast", "chain_pipelined"), ("broadcast", "binary_tree_segmented"),
       ("reduce", "rabenseifner"), ("reduce_scatter", "ring_pipelined")]
SEGMENTED = [key for key in NEW if key != ("reduce", "rabenseifner")]  # the ones that cut segments
S = 4  # itemsize: the cost formulas count 4-byte elements


def _steps(coll, name, rank, p, count, root=0, op=ck.SUM):
    alg = algorithms.get(coll, name)
    if coll == "broadcast":
        return list(alg.schedule(rank, p, count, root))
    if coll == "reduce":
        return list(alg.schedule(rank, p, count, op, root))
    return list(alg.schedule(rank, p, count, op))


def _counts(coll, p):
    if coll == "reduce_scatter":
        return [(0,) * p, (1,) * p, (3,) * p, (16,) * p, tuple(q % 3 for q in range(p)),
                tuple((5 * q + 2) % 7 for q in range(p)), (0,) * (p - 1) + (p + 1,)]
    pof2 = 1 << (p.bit_length() - 1)
    return sorted({0, 1, max(p - 1, 1), p + 1, 2 * p + 3, 7 * p + 5, p * pof2})


# -- the registry's own check, at several segment sizes ------------------------------------------------


CHECKED = [(c, n, seg) for c, n in SEGMENTED for seg in ("2", "7", None)] + [("reduce", "rabenseifner", None)]


@pytest.mark.parametrize("coll,name,seg", CHECKED, ids=[f"{c}_{n}-segment={s}" for c, n, s in CHECKED])
def test_check_algorithm_passes(coll, name, seg, monkeypatch):
    if seg is None:
        monkeypatch.delenv(pipelined.ENV_SEGMENT, raising=False)
    else:
        monkeypatch.setenv(pipelined.ENV_SEGMENT, seg)
    report = testing.check_algorithm(coll, name, max_procs=6, sim_procs=24)
    report.raise_if_failed()
    assert report.ok


# -- results against NumPy on threads, p = 1..16 ----------------------------------------------------------


@pytest.mark.parametrize("coll", ["broadcast", "reduce", "reduce_scatter"])
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_results_match_numpy_with_any_segment_size(coll, data):
    size = data.draw(st.one_of(st.sampled_from([1, 2, 3, 5, 7, 13, 16]), st.integers(1, 16)), label="size")
    case = data.draw(cases(size, collectives=(coll,)), label="case")
    seg = data.draw(st.sampled_from(["1", "2", "3", "5", "64"]), label="segment")
    names = sorted(n for c, n in NEW if c == coll)

    def body(comm):
        for name in names:
            _, before = check_case(comm, case, name)
            np.testing.assert_array_equal(collective_input(case, comm.rank, comm.size), before)
        return True

    # Each run_local builds new communicators, so the segment size is read afresh (plans cache per shape).
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(pipelined.ENV_SEGMENT, seg)
        assert all(ck.run_local(body, size, timeout=30))


@pytest.mark.parametrize("name", ["chain_pipelined", "binary_tree_segmented"])
@pytest.mark.parametrize("seg", ["1", "3", "7"])
@pytest.mark.parametrize("trusted", [False, True], ids=["input-copied", "no-copy"])
def test_broadcast_in_place_from_every_root(name, seg, trusted, monkeypatch):
    monkeypatch.setenv(pipelined.ENV_SEGMENT, seg)
    if not trusted:
        # As if the data-flow check had refused it: the input is saved first.
        monkeypatch.setattr(communicator, "_inplace_safe", lambda steps: False)
    for p in (1, 2, 3, 4, 5, 8, 11):
        for n in (0, 1, p + 1, 23):
            for root in range(p):
                want = np.random.default_rng([p, n, root]).integers(-1000, 1000, n).astype(np.int64)

                def body(comm, root=root, want=want):
                    x = want.copy() if comm.rank == root else np.full(want.size, -7, np.int64)
                    got = comm.broadcast(x, root, out=x, algorithm=name)
                    assert got is x
                    np.testing.assert_array_equal(x, want)
                    return True

                assert all(ck.run_local(body, p, timeout=30))


def test_nonblocking_and_persistent_forms(monkeypatch):
    # The i-forms advance the schedule step by step and run overlapped steps after posting;
    # persistent requests replay compiled plans, so the segments must come out the same on restart.
    monkeypatch.setenv(pipelined.ENV_SEGMENT, "3")

    def body(comm):
        p, r = comm.size, comm.rank
        n = 4 * p + 3
        xs = [np.random.default_rng([n, q]).integers(-50, 50, n) for q in range(p)]
        for name in ("chain_pipelined", "binary_tree_segmented"):
            for root in range(p):
                x = xs[root].copy() if r == root else np.zeros(n, np.int64)
                np.testing.assert_array_equal(comm.ibroadcast(x, root, algorithm=name).wait(), xs[root])
                req = comm.broadcast_init(x, root, out=x, algorithm=name)
                for _ in range(2):
                    if r != root:
                        x[:] = 0
                    req.start()
                    req.wait()
                    np.testing.assert_array_equal(x, xs[root])
                req.free()
        for root in range(p):
            got = comm.ireduce(xs[r], "sum", root, algorithm="rabenseifner").wait()
            if r == root:
                np.testing.assert_array_equal(got, sum(xs))
        counts = [n // p + (q < n % p) for q in range(p)]
        got = comm.ireduce_scatter(xs[r], "sum", counts=counts, algorithm="ring_pipelined").wait()
        lo = sum(counts[:r])
        np.testing.assert_array_equal(got, sum(xs)[lo:lo + counts[r]])
        return True

    for p in (1, 2, 3, 5):
        assert all(ck.run_local(body, p, timeout=30))


# -- schedules: deadlock, counts, formulas, overlap and in-place safety -----------------------------------


def _rel_children(j, p):
    return [c for c in (2 * j + 1, 2 * j + 2) if c < p]


def _seg_count(c):
    return pipelined.segment_count(c, 1)


def expected_counts(coll, name, p, count, root):
    """(messages, elements sent) per rank, from each algorithm's definition (not by running it)."""
    msgs, elems = [0] * p, [0] * p
    if p == 1:
        return msgs, elems
    for r in range(p):
        rel = (r - root) % p
        if name == "chain_pipelined":
            if rel != p - 1:
                msgs[r], elems[r] = _seg_count(count), count
        elif name == "binary_tree_segmented":
            kids = len(_rel_children(rel, p))
            msgs[r], elems[r] = kids * _seg_count(count), kids * count
        elif coll == "reduce_scatter":
            k_segments = pipelined.segment_count(sum(count), p)
            for step in range(p - 1):
                block = count[(r - step - 1) % p]
                sizes = [hi - lo for lo, hi in partition(block, k_segments)] if k_segments else []
                msgs[r] += sum(1 for s in sizes if s)
                elems[r] += block
        elif name == "rabenseifner":
            if count == 0:
                continue
            pof2 = 1 << (p.bit_length() - 1)
            rem = p - pof2
            rel = (r - root - 1) % p  # the root is rel p-1
            if rel < 2 * rem and rel % 2 == 0:
                msgs[r], elems[r] = 1, count  # folded out: hands its vector up
                continue
            new = rel // 2 if rel < 2 * rem else rel - rem
            sizes = [hi - lo for lo, hi in partition(count, pof2)]
            lg = pof2.bit_length() - 1
            msgs[r] = lg  # halving: one exchange a round; sends all it does not keep
            elems[r] = count - sizes[new]
            if new != pof2 - 1:
                # Gather: at the round of its lowest clear bit m it sends its aligned group of m blocks.
                m = (new + 1) & -(new + 1)
                low = new & ~(2 * m - 1)
                group = sum(sizes[low:low + m])
                msgs[r] += 1 if group else 0
                elems[r] += group
    return msgs, elems


SWEEP = [(c, n, seg) for c, n in SEGMENTED for seg in ("1", "7", None)] + [("reduce", "rabenseifner", None)]


@pytest.mark.parametrize("coll,name,seg", SWEEP, ids=[f"{c}_{n}-segment={s}" for c, n, s in SWEEP])
def test_no_deadlock_and_textbook_counts_up_to_64_ranks(coll, name, seg, monkeypatch):
    if seg is None:
        monkeypatch.delenv(pipelined.ENV_SEGMENT, raising=False)
    else:
        monkeypatch.setenv(pipelined.ENV_SEGMENT, seg)
    alg = algorithms.get(coll, name)
    for p in range(1, 65):
        roots = sorted({0, p // 2, p - 1}) if coll in ("broadcast", "reduce") else [0]
        counts = _counts(coll, p)
        if seg == "1":  # thousands of segments per rank at the largest counts: keep the small ones
            counts = [c for c in counts if (sum(c) if isinstance(c, tuple) else c) <= 3 * p]
        for count in counts:
            for root in roots:
                res = sim.simulate(coll, name, p, count=count, root=root, itemsize=S, alpha=1.0, beta=1e-3,
                                   gamma=1e-6)
                where = f"{coll}_{name} p={p} count={count} root={root} segment={seg}"
                assert res.ok, f"{where}: {res.waiting[:2]} {res.mismatches[:2]}"
                msgs, elems = expected_counts(coll, name, p, count, root)
                assert res.messages == msgs, where
                assert res.bytes_sent == [e * S for e in elems], where
                want = alg.cost(p, res.nbytes, 1.0, 1e-3, 1e-6)
                if alg.cost_is_exact(p, count):
                    assert math.isclose(res.time, want, rel_tol=1e-9, abs_tol=1e-12), (where, res.time, want)
                elif alg.cost_bound == "lower":
                    assert want <= res.time * (1 + 1e-9), (where, res.time, want)
                assert res.rounds == alg.cost(p, res.nbytes, 1, 0, 0), where


@pytest.mark.parametrize("coll,name", NEW, ids=[f"{c}_{n}" for c, n in NEW])
@pytest.mark.parametrize("seg", ["1", "2", "3", "7"])
def test_overlapped_steps_never_race_and_empty_segments_send_nothing(coll, name, seg, monkeypatch):
    monkeypatch.setenv(pipelined.ENV_SEGMENT, seg)
    overlapped = 0
    for p in range(1, 17):
        for count in _counts(coll, p):
            for root in (sorted({0, p - 1, p // 2}) if coll != "reduce_scatter" else [0]):
                for rank in range(p):
                    for step in _steps(coll, name, rank, p, count, root):
                        if isinstance(step, Transfer):
                            assert not check_overlap(step), (p, count, rank, step)
                            overlapped += any(s.kind == REDUCE for s in step.overlap)
                            if (coll, name) in SEGMENTED:
                                assert all(hi > lo for _, (_, lo, hi) in step.sends + step.recvs), step
    if coll == "reduce_scatter" and seg != "1":
        assert overlapped  # the reduction of segment k really travels with segment k+1


@pytest.mark.parametrize("name", ["chain_pipelined", "binary_tree_segmented"])
@pytest.mark.parametrize("seg", ["1", "3", None])
def test_broadcast_schedules_are_in_place_safe(name, seg, monkeypatch):
    # What the communicator's in-place fast path needs: only the root reads "in", and the root
    # writes "out" only by copying "in" onto the same range (a copy skipped when they are one array).
    if seg is None:
        monkeypatch.delenv(pipelined.ENV_SEGMENT, raising=False)
    else:
        monkeypatch.setenv(pipelined.ENV_SEGMENT, seg)
    for p in range(1, 13):
        for count in (0, 1, p + 1, 3 * p + 2):
            for root in range(p):
                for rank in range(p):
                    for step in _steps("broadcast", name, rank, p, count, root):
                        transfer = isinstance(step, Transfer)
                        local = list(step.overlap) if transfer else [step]
                        if transfer and rank == root:
                            assert not step.recvs, step  # the root never receives into "out"
                        if transfer and rank != root:
                            assert all(b[0] != "in" for _, b in step.sends), (rank, step)
                        for ls in local:
                            assert ls.kind == COPY, step  # a broadcast reduces nothing
                            assert rank == root and ls.src == ("in", *ls.dst[1:]) and ls.dst[0] == "out", ls


def test_pipelining_pays_in_the_model(monkeypatch):
    # Bandwidth-bound: a chain of 8 with 16 segments takes (p+K-2)/K of one segment per hop,
    # about 1.4 n β, against the unsegmented chain's (p-1) n β.
    p, count = 8, 16 * 64
    model = {"itemsize": 4, "alpha": 1e-9, "beta": 1e-9, "gamma": 1e-10}
    monkeypatch.setenv(pipelined.ENV_SEGMENT, str(count))
    whole = sim.simulate("broadcast", "chain_pipelined", p, count=count, **model)
    tree_whole = sim.simulate("broadcast", "binary_tree_segmented", p, count=count, **model)
    monkeypatch.setenv(pipelined.ENV_SEGMENT, "64")
    cut = sim.simulate("broadcast", "chain_pipelined", p, count=count, **model)
    tree_cut = sim.simulate("broadcast", "binary_tree_segmented", p, count=count, **model)
    assert cut.time < whole.time / 4
    assert tree_cut.time < tree_whole.time / 1.2
    assert cut.messages[:-1] == [16] * (p - 1) and whole.messages[:-1] == [1] * (p - 1)
    # Reduction as slow as the link: the pipelined reduce-scatter hides its reductions behind the
    # transfers, so it takes little more than half the plain ring's time.
    model = {"itemsize": 4, "alpha": 1e-12, "beta": 1e-9, "gamma": 1e-9}
    counts = (256,) * 4
    ring = sim.simulate("reduce_scatter", "ring", 4, count=counts, **model)
    monkeypatch.setenv(pipelined.ENV_SEGMENT, "1000")
    one = sim.simulate("reduce_scatter", "ring_pipelined", 4, count=counts, **model)
    assert one.time == pytest.approx(ring.time) and one.messages == ring.messages
    monkeypatch.setenv(pipelined.ENV_SEGMENT, "32")
    eight = sim.simulate("reduce_scatter", "ring_pipelined", 4, count=counts, **model)
    assert eight.ok and eight.messages == [3 * 8] * 4 and eight.time < 0.6 * ring.time, (eight.time, ring.time)


def test_rabenseifner_reduce_moves_less_than_the_binomial_tree():
    p, nbytes = 16, 1 << 20
    raben = sim.simulate("reduce", "rabenseifner", p, nbytes, alpha=1e-6, beta=1e-9, gamma=1e-10)
    binomial = sim.simulate("reduce", "binomial", p, nbytes, alpha=1e-6, beta=1e-9, gamma=1e-10)
    # Each rank sends under 2n bytes (its halves, then its gathered blocks) and reduces under n,
    # where the binomial tree reduces n bytes ⌈log p⌉ times on the root's path.
    assert raben.ok and raben.time < binomial.time / 2
    assert max(raben.bytes_sent) < 2 * nbytes and max(raben.bytes_reduced) < nbytes
    assert max(binomial.bytes_reduced) == 4 * nbytes


def test_bad_segment_variable_is_rejected(monkeypatch):
    monkeypatch.setenv(pipelined.ENV_SEGMENT, "-3")
    with pytest.raises(ck.InvalidArgument, match="COMMKIT_SEGMENT_ELEMENTS"):
        list(segmented.broadcast_chain_pipelined(0, 2, 8, 0))


# -- under mpiexec --------------------------------------------------------------------------------------------

MPI_CODE = """
import numpy as np
import commkit as ck

comm = ck.init(timeout=60)
p, r = comm.size, comm.rank
for n in (0, 1, p - 1, p + 1, 1000, 70_001):
    xs = [np.random.default_rng([n, q]).integers(-100, 100, n).astype(np.float64) for q in range(p)]
    for root in range(p):
        for name in ("chain_pipelined", "binary_tree_segmented"):
            x = xs[root].copy() if r == root else np.zeros(n)
            comm.broadcast(x, root, out=x, algorithm=name)
            assert np.array_equal(x, xs[root]), (name, n, root, r)
        got = comm.reduce(xs[r], "sum", root, algorithm="rabenseifner")
        if r == root:
            assert np.array_equal(got, sum(xs)), ("rabenseifner", n, root)
    counts = [n // p + (1 if q < n % p else 0) for q in range(p)]
    got = comm.reduce_scatter(xs[r], "sum", counts=counts, algorithm="ring_pipelined")
    lo = sum(counts[:r])
    assert np.array_equal(got, sum(xs)[lo:lo + counts[r]]), ("ring_pipelined", n, r)
print("ok", r)
"""


@pytest.mark.parametrize("nprocs", [2, 3, 4, 5])
def test_under_mpiexec(mpi, nprocs):
    result = mpi(nprocs, MPI_CODE, env={pipelined.ENV_SEGMENT: "7"}, timeout=300)
    assert result.stdout.count("ok") == nprocs
