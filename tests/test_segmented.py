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
    _use_segment(monkeypatch, seg)
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
    _check_with_segment(data, case, size, sorted(n for c, n in NEW if c == coll))


def _check_with_segment(data, case, size, names):
    """Run ``case`` with each algorithm of ``names`` on ``size`` threads, at a drawn segment size."""
    seg = data.draw(st.sampled_from(["1", "2", "3", "5", "64"]), label="segment")

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


def _use_segment(monkeypatch, seg):
    """Set the default segment size (elements) for this test; None leaves the built-in default."""
    if seg is None:
        monkeypatch.delenv(pipelined.ENV_SEGMENT, raising=False)
    else:
        monkeypatch.setenv(pipelined.ENV_SEGMENT, seg)


SWEEP = [(c, n, seg) for c, n in SEGMENTED for seg in ("1", "7", None)] + [("reduce", "rabenseifner", None)]


@pytest.mark.parametrize("coll,name,seg", SWEEP, ids=[f"{c}_{n}-segment={s}" for c, n, s in SWEEP])
def test_no_deadlock_and_textbook_counts_up_to_64_ranks(coll, name, seg, monkeypatch):
    _use_segment(monkeypatch, seg)
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
    _use_segment(monkeypatch, seg)
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
# The double binary tree and the segmented binary-tree reduce (segments of 7 elements; 64 KiB per call).
for n, name in ((0, "double_binary_tree"), (1, "double_binary_tree"), (p + 1, "double_binary_tree"),
                (300, "double_binary_tree"), (70_001, "double_binary_tree:64K")):
    xs = [np.random.default_rng([n, q]).integers(-100, 100, n).astype(np.float64) for q in range(p)]
    for root in range(p):
        x = xs[root].copy() if r == root else np.zeros(n)
        comm.broadcast(x, root, out=x, algorithm=name)
        assert np.array_equal(x, xs[root]), (name, n, root, r)
        for reduce_name in (name, name.replace("double_binary_tree", "binary_tree_segmented")):
            got = comm.reduce(xs[r], "sum", root, algorithm=reduce_name)
            if r == root:
                assert np.array_equal(got, sum(xs)), (reduce_name, n, root)
    x = xs[r].copy()
    comm.allreduce(x, out=x, algorithm=name)
    assert np.array_equal(x, sum(xs)), (name, n, r)
print("ok", r)
"""


@pytest.mark.parametrize("nprocs", [2, 3, 4, 5])
def test_under_mpiexec(mpi, nprocs):
    result = mpi(nprocs, MPI_CODE, env={pipelined.ENV_SEGMENT: "7"}, timeout=300)
    assert result.stdout.count("ok") == nprocs


# -- the segmented binary-tree reduce and the double binary tree ------------------------------------------------

TREES = [("broadcast", "double_binary_tree"), ("reduce", "double_binary_tree"),
         ("allreduce", "double_binary_tree"), ("reduce", "binary_tree_segmented")]
TREE_IDS = [f"{c}_{n}" for c, n in TREES]


def _inorder(m):
    """Parent and depth of positions 1..m in the in-order tree, built here by splitting ranges.

    A range's top is its position with the largest lowest set bit; the positions below and above
    it form its two subtrees. (The module computes the same tree by bit arithmetic.)
    """
    parent, depth = {}, {}
    todo = [(1, m, 0, 0)]
    while todo:
        lo, hi, up, d = todo.pop()
        if lo > hi:
            continue
        top = max(range(lo, hi + 1), key=lambda i: i & -i)
        parent[top], depth[top] = up, d
        todo += [(lo, top - 1, top, d + 1), (top + 1, hi, top, d + 1)]
    return parent, depth


def _two_trees(m):
    """For each relative rank j < m: [(parent or -1, children, depth) in tree 0, the same in tree 1].

    Tree 0 puts j at position j + 1, tree 1 at position (j - 1) mod m, plus one.
    """
    parent, depth = _inorder(m)
    trees = []
    for to_pos, to_rel in ((lambda j: j + 1, lambda q: q - 1), (lambda j: (j - 1) % m + 1, lambda q: q % m)):
        kids = {q: [] for q in range(1, m + 1)}
        for q, up in parent.items():
            if up:
                kids[up].append(q)
        trees.append([(to_rel(parent[to_pos(j)]) if parent[to_pos(j)] else -1,
                       sorted(to_rel(c) for c in kids[to_pos(j)]), depth[to_pos(j)]) for j in range(m)])
    return [(trees[0][j], trees[1][j]) for j in range(m)]


@pytest.mark.parametrize("m", list(range(1, 70)) + [127, 128, 129])
def test_double_tree_every_rank_is_inner_in_at_most_one_tree(m):
    trees = _two_trees(m)
    assert [tuple((up, sorted(kids), d) for up, kids, d in segmented.double_tree(j, m)) for j in range(m)] == \
        [tuple(t) for t in trees]
    for j, both in enumerate(trees):
        inner = [bool(kids) for _, kids, _ in both]
        assert sum(inner) <= 1, (m, j)
        assert any(inner) or (j == 0 and m % 2 == 1) or m == 1, (m, j)  # only rank 0, for odd m, is a leaf twice
        assert all(len(kids) <= 2 and d <= m.bit_length() - 1 for _, kids, d in both)
    assert max(t[0][2] for t in trees) == m.bit_length() - 1  # depth ⌊log m⌋


def test_double_tree_for_8_ranks_is_the_documented_table():
    # docs/algorithms/double_binary_tree.md shows this table.
    rows = [segmented.double_tree(j, 8) for j in range(8)]
    assert [j for j, (t0, _) in enumerate(rows) if t0[1]] == [1, 3, 5, 7]
    assert [j for j, (_, t1) in enumerate(rows) if t1[1]] == [0, 2, 4, 6]
    assert [(t0[0], t1[0]) for t0, t1 in rows] == [(1, -1), (3, 2), (1, 4), (7, 2), (5, 0), (3, 6), (5, 4), (-1, 6)]


def test_registration_and_selection():
    from commkit import selection

    for coll, name in TREES:
        alg = algorithms.get(coll, name)
        assert alg.segmented and alg.cost is not None and alg.cost_bound == "upper", (coll, name)
        assert alg.commutative == (coll != "broadcast")
        choice = selection.select(coll, 8, 1 << 20, "sum" if coll != "broadcast" else None, f"{name}:64K")
        assert choice.algorithm is alg and choice.segment == 65536
        with pytest.raises(ck.AlgorithmNotApplicable, match="commutative"):
            if coll != "broadcast":
                selection.select(coll, 8, 1 << 20, ck.Op(lambda a, b: a, commutative=False, name="first"), name)
            else:
                raise ck.AlgorithmNotApplicable("broadcast has no op to be commutative")
    # Never chosen by default: only when asked for.
    for coll in ("broadcast", "reduce", "allreduce"):
        for p in (2, 3, 8, 17, 64):
            for nbytes in (0, 8, 1 << 12, 1 << 20, 1 << 26):
                op = "sum" if coll != "broadcast" else None
                assert selection.select(coll, p, nbytes, op).algorithm.name not in ("double_binary_tree",
                                                                                   "binary_tree_segmented")


@pytest.mark.parametrize("coll", ["broadcast", "reduce", "allreduce"])
@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_trees_match_numpy_with_any_segment_size(coll, data):
    size = data.draw(st.one_of(st.sampled_from([1, 2, 3, 4, 5, 8, 9, 16]), st.integers(1, 16)), label="size")
    case = data.draw(cases(size, collectives=(coll,)), label="case")
    _check_with_segment(data, case, size, sorted(n for c, n in TREES if c == coll))


@pytest.mark.parametrize("seg", ["1", "3"])
def test_trees_in_place_from_every_root(seg, monkeypatch):
    # Odd counts with segment 1 leave half 1 with an empty last segment; count 1 leaves half 1 empty.
    monkeypatch.setenv(pipelined.ENV_SEGMENT, seg)
    for p in (1, 2, 3, 4, 5, 8, 9):
        for n in (0, 1, 2, p + 2, 23):
            xs = [np.random.default_rng([p, n, q]).integers(-1000, 1000, n).astype(np.int64) for q in range(p)]

            def body(comm):
                r = comm.rank
                for root in range(p):
                    x = xs[r].copy() if r == root else np.full(n, -7, np.int64)
                    assert comm.broadcast(x, root, out=x, algorithm="double_binary_tree") is x
                    np.testing.assert_array_equal(x, xs[root])
                    for name in ("double_binary_tree", "binary_tree_segmented"):
                        x = xs[r].copy()
                        got = comm.reduce(x, "sum", root, out=x if r == root else None, algorithm=name)
                        if r == root:
                            assert got is x
                            np.testing.assert_array_equal(x, sum(xs))
                x = xs[r].copy()
                assert comm.allreduce(x, out=x, algorithm="double_binary_tree") is x
                np.testing.assert_array_equal(x, sum(xs))
                return True

            assert all(ck.run_local(body, p, timeout=30))


def test_tree_schedules_need_no_copy_of_the_input_in_place():
    # The communicator's in-place fast path: the data-flow check finds every rank's steps safe.
    from commkit import collectives
    from commkit.schedule import inplace_safe

    for coll, name in TREES:
        alg = algorithms.get(coll, name)
        for p in range(1, 11):
            for count in (0, 1, 5, 2 * p + 1):
                for seg in (1, 2, 7):
                    for root in (range(p) if coll != "allreduce" else [0]):
                        for r in range(p):
                            steps = list(collectives.steps(alg.schedule, coll, r, p, count, ck.SUM, root, seg))
                            assert inplace_safe(steps), (coll, name, p, count, seg, root, r)


def test_trees_nonblocking_persistent_and_per_call_segments():
    def body(comm):
        p, r = comm.size, comm.rank
        n = 6 * p + 5
        xs = [np.random.default_rng([n, q]).integers(-50, 50, n) for q in range(p)]
        for root in range(p):
            x = xs[root].copy() if r == root else np.zeros(n, np.int64)
            np.testing.assert_array_equal(comm.ibroadcast(x, root, algorithm="double_binary_tree:16").wait(), xs[root])
            for name in ("double_binary_tree:24", "binary_tree_segmented:8"):
                got = comm.ireduce(xs[r], "sum", root, algorithm=name).wait()
                if r == root:
                    np.testing.assert_array_equal(got, sum(xs))
        np.testing.assert_array_equal(comm.iallreduce(xs[r], algorithm="double_binary_tree:8").wait(), sum(xs))
        # Persistent requests replay a compiled plan: the segments must come out the same on restart.
        x = xs[r].copy()
        out = np.empty_like(x)
        req = comm.allreduce_init(x, out=out, algorithm="double_binary_tree:16")
        for _ in range(2):
            out[:] = 0
            req.start()
            req.wait()
            np.testing.assert_array_equal(out, sum(xs))
        req.free()
        return True

    for p in (1, 2, 3, 5, 6):
        assert all(ck.run_local(body, p, timeout=30))


def test_trees_take_the_segment_per_call():
    from commkit import collectives

    for coll, name in TREES:
        alg = algorithms.get(coll, name)

        def transfers(segment):
            return sum(1 for r in range(5)
                       for step in collectives.steps(alg.schedule, coll, r, 5, 96, ck.SUM, 2, segment)
                       if isinstance(step, Transfer))

        assert transfers(2) > transfers(16) > 0, (coll, name)
        assert transfers(None) == transfers(1 << 16)


def tree_counts(coll, name, p, count, root, seg):
    """(messages, elements sent) per rank, from the trees built in this file (not by running the schedules)."""
    msgs, elems = [0] * p, [0] * p
    if p == 1 or count == 0:
        return msgs, elems
    if name == "binary_tree_segmented":
        k_segments = -(-count // seg)
        for r in range(p):
            if r != root:
                msgs[r], elems[r] = k_segments, count
        return msgs, elems
    h = (count + 1) // 2
    k_segments = -(-h // seg)
    lengths = (h, count - h)
    filled = (k_segments, min(k_segments, count - h))  # segments that hold elements, per half
    m = p if coll == "allreduce" else p - 1
    trees = _two_trees(m)
    for r in range(p):
        if coll != "allreduce" and r == root:
            if coll == "broadcast":
                msgs[r], elems[r] = sum(filled), count
            continue
        j = r if coll == "allreduce" else (r - root - 1) % p
        for t, (up, kids, _) in enumerate(trees[j]):
            if coll in ("broadcast", "allreduce"):
                msgs[r] += len(kids) * filled[t]
                elems[r] += len(kids) * lengths[t]
            if coll == "reduce" or (coll == "allreduce" and up >= 0):
                msgs[r] += filled[t]
                elems[r] += lengths[t]
    return msgs, elems


@pytest.mark.parametrize("coll,name", TREES, ids=TREE_IDS)
@pytest.mark.parametrize("seg", ["1", "7", None])
def test_trees_never_deadlock_and_send_what_the_trees_say_up_to_64_ranks(coll, name, seg, monkeypatch):
    _use_segment(monkeypatch, seg)
    alg = algorithms.get(coll, name)
    a, b, g = 1.0, 1e-3, 1e-6
    for p in range(1, 65):
        pof2 = 1 << (p.bit_length() - 1)
        # Segment 1 cuts the most segments: fewer counts and roots there. By default a half is one segment.
        counts = {"1": [1, p + 2], "7": [2 * p + 3, 7 * p + 5], None: [0, p + 1, p * pof2]}[seg]
        roots = sorted({0, p - 1}) if coll != "allreduce" else [0]
        for count in counts:
            for root in roots:
                res = sim.simulate(coll, name, p, count=count, root=root, itemsize=S, alpha=a, beta=b, gamma=g)
                where = f"{coll}_{name} p={p} count={count} root={root} segment={seg}"
                assert res.ok, f"{where}: {res.waiting[:2]} {res.mismatches[:2]}"
                msgs, elems = tree_counts(coll, name, p, count, root, int(seg or pipelined.SEGMENT))
                assert res.messages == msgs, where
                assert res.bytes_sent == [e * S for e in elems], where
                # The formula is an upper bound on the time, and its alpha terms on the rounds.
                assert alg.cost(p, res.nbytes, a, b, g) >= res.time * (1 - 1e-9), where
                assert alg.cost(p, res.nbytes, 1, 0, 0) >= res.rounds, where


@pytest.mark.parametrize("coll,name", TREES, ids=TREE_IDS)
def test_tree_bounds_hold_whichever_term_dominates(coll, name, monkeypatch):
    alg = algorithms.get(coll, name)
    for seg in ("2", "5"):
        monkeypatch.setenv(pipelined.ENV_SEGMENT, seg)
        for p in (2, 3, 4, 5, 7, 8, 9, 12, 17, 33):
            for count in (1, 2 * p + 3, 9 * p):
                for a, b, g in ((0, 1, 0), (0, 0, 1), (1e-3, 1, 0.5), (1, 0.1, 0.3)):
                    res = sim.simulate(coll, name, p, count=count, root=p // 2, itemsize=S, alpha=a, beta=b, gamma=g)
                    assert alg.cost(p, res.nbytes, a, b, g) >= res.time * (1 - 1e-9), (p, count, seg, (a, b, g))


def _pow2(x):
    return x & (x - 1) == 0


@pytest.mark.parametrize("coll,name", TREES, ids=TREE_IDS)
def test_tree_bounds_are_the_simulated_time_where_the_docstrings_say(coll, name, monkeypatch):
    # Equal segments (4 elements each), K ≥ 2, transfers that outweigh the reductions (α + sβ ≥ sγ).
    alg = algorithms.get(coll, name)
    seg = 4
    monkeypatch.setenv(pipelined.ENV_SEGMENT, str(seg))
    exact = 0
    for k_segments in (2, 3, 9):
        for p in list(range(2, 34)) + [63, 64, 65]:
            count = (1 if name == "binary_tree_segmented" else 2) * seg * k_segments
            for a, b, g in ((1, 0, 0), (0, 1, 0), (1, 1e-3, 1e-6), (1, 0.1, 0.1)):
                res = sim.simulate(coll, name, p, count=count, itemsize=S, alpha=a, beta=b, gamma=g)
                want = alg.cost(p, res.nbytes, a, b, g)
                link = a + seg * S * b
                if link < seg * S * g:
                    continue  # the reductions dominate: the bound is looser there
                where = (p, k_segments, (a, b, g), res.time, want)
                if coll == "allreduce":
                    if p >= 4 and g == 0:
                        depth = p.bit_length() - 1
                        assert res.time * (1 - 1e-9) <= want <= res.time + (depth + 2) * link * (1 + 1e-9), where
                        exact += math.isclose(want, res.time, rel_tol=1e-9)
                    continue
                if name == "double_binary_tree" and _pow2(p - 1) or name == "binary_tree_segmented" and _pow2(p):
                    continue
                assert math.isclose(want, res.time, rel_tol=1e-9), where
                exact += 1
    assert exact


def test_trees_overlap_reductions_safely_and_send_no_empty_segments(monkeypatch):
    for seg in ("1", "2", "7"):
        monkeypatch.setenv(pipelined.ENV_SEGMENT, seg)
        for coll, name in TREES:
            overlapped = 0
            for p in range(1, 14):
                for count in (0, 1, 2, p + 1, 3 * p + 2):
                    for root in (sorted({0, p // 2, p - 1}) if coll != "allreduce" else [0]):
                        for rank in range(p):
                            for step in _steps(coll, name, rank, p, count, root):
                                if isinstance(step, Transfer):
                                    assert not check_overlap(step), (coll, name, p, count, rank, step)
                                    assert all(hi > lo for _, (_, lo, hi) in step.sends + step.recvs), step
                                    overlapped += any(s.kind == REDUCE for s in step.overlap)
            if coll != "broadcast":
                assert overlapped, (coll, name, seg)  # a segment's reduction travels with the next transfer


def test_double_tree_pays_in_the_model():
    # Bandwidth-bound, 32 segments per half: the double tree's broadcast moves about n bytes per
    # rank where the segmented binary tree moves 2n; its allreduce about 2n, as the ring does.
    model = {"itemsize": 4, "alpha": 1e-9, "beta": 1e-9, "gamma": 1e-10}
    p, count = 16, 64 * 64
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(pipelined.ENV_SEGMENT, "64")
        double = sim.simulate("broadcast", "double_binary_tree", p, count=count, **model)
        mp.setenv(pipelined.ENV_SEGMENT, "128")  # the same K for the single tree, which does not halve the vector
        single = sim.simulate("broadcast", "binary_tree_segmented", p, count=count, **model)
        assert double.ok and double.time < 0.6 * single.time, (double.time, single.time)
        mp.setenv(pipelined.ENV_SEGMENT, "64")
        reduce = sim.simulate("reduce", "double_binary_tree", p, count=count, **model)
        tree = sim.simulate("reduce", "binary_tree_segmented", p, count=count, **model)
        binomial = sim.simulate("reduce", "binomial", p, count=count, **model)
        assert reduce.time < tree.time < binomial.time / 1.5, (reduce.time, tree.time, binomial.time)
        allreduce = sim.simulate("allreduce", "double_binary_tree", p, count=count, **model)
        ring = sim.simulate("allreduce", "ring", p, count=count, **model)
        assert allreduce.time < 1.3 * ring.time, (allreduce.time, ring.time)
        assert max(allreduce.bytes_sent) <= 2 * count * 4 and max(reduce.bytes_sent) <= count * 4


@pytest.mark.parametrize("coll,name", TREES, ids=TREE_IDS)
def test_tree_algorithms_pass_the_registrys_own_check(coll, name, monkeypatch):
    # Results against NumPy, the simulator, and the formula as the upper bound it is declared (cost_exact="never").
    monkeypatch.setenv(pipelined.ENV_SEGMENT, "3")
    testing.check_algorithm(coll, name, max_procs=6, sim_procs=24).raise_if_failed()
