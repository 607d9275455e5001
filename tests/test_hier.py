"""Node-aware algorithms across nodes (commkit.algorithms.hier): layouts, schedules, threads, mpiexec, simulator.

The module is opt-in (loaded by name), so every test here registers it through
the ``hier`` fixture and removes it again: the suites that sweep every
registered algorithm see the same registry whichever order the tests run in.
"""

from __future__ import annotations

import contextlib
import importlib
import os

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import commkit as ck
from commkit import algorithms, cost, sim
from commkit.errors import AlgorithmNotApplicable
from commkit.ops import SUM
from commkit.schedule import TRANSFER, partition

MODULE = "commkit.algorithms.hier"


@pytest.fixture
def hier():
    """The hier module, its algorithms registered for the test and removed after it."""
    module = importlib.import_module(MODULE)
    module.register()
    try:
        yield module
    finally:
        module.unregister()


@contextlib.contextmanager
def _ranks_per_node(k):
    old = os.environ.get("COMMKIT_RANKS_PER_NODE")
    if k is None:
        os.environ.pop("COMMKIT_RANKS_PER_NODE", None)
    else:
        os.environ["COMMKIT_RANKS_PER_NODE"] = str(k)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("COMMKIT_RANKS_PER_NODE", None)
        else:
            os.environ["COMMKIT_RANKS_PER_NODE"] = old


def _data(rank, n, seed, dtype):
    rng = np.random.default_rng([seed, rank])
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(n).astype(dtype)
    return rng.integers(-1000, 1000, n).astype(dtype)


def _transfers(steps):
    """``(peer, elements, sent)`` of every message in ``steps``."""
    out = []
    for s in steps:
        if s.kind == TRANSFER:
            out += [(q, b[2] - b[1], True) for q, b in s.sends] + [(q, b[2] - b[1], False) for q, b in s.recvs]
    return out


# -- the layout -------------------------------------------------------------------------------------

def test_uneven_layout_gives_every_slice_one_owner_per_node(hier):
    lay = hier.layout(5, (7, 7, 7, 3, 3))  # 3 + 2: node numbers need not count from 0
    assert lay.members == ((0, 1, 2), (3, 4)) and lay.local == (0, 1, 2, 0, 1) and lay.width == 3
    # The 2-rank node's first rank owns two of the three slices: it is in two lanes.
    assert [lay.lane(j) for j in range(3)] == [(0, 3), (1, 3), (2, 4)]
    assert lay.representatives(0) == (0, 3) and lay.representatives(4) == (0, 4)


def test_the_default_layout_is_blocks_of_ranks_per_node(hier):
    with _ranks_per_node(3):
        assert hier.layout(5).members == ((0, 1, 2), (3, 4))
    with _ranks_per_node(None):
        assert hier.layout(5).members == ((0, 1, 2, 3, 4),)
    with pytest.raises(ck.errors.InvalidArgument, match="node of each of the 4 ranks"):
        hier.layout(4, (0, 0, 1))


@pytest.mark.parametrize("nodes", [(0, 0, 1, 1), (0, 0, 0, 1, 1, 1), (0, 0, 0, 1, 1), (0, 1, 0, 1, 2),
                                   (0, 0, 0, 0, 1, 1, 1, 1)])
def test_allreduce_crosses_nodes_only_within_a_lane(hier, nodes):
    # Between nodes a rank talks only to ranks that own its slices, and sends at most what it owns.
    lay = hier.layout(len(nodes), nodes)
    count = 1000
    for r in range(len(nodes)):
        lanes = {q for j in range(lay.width) if r in lay.lane(j) for q in lay.lane(j)}
        first, end = lay.owned(lay.node[r])[lay.local[r]]
        mine = sum(b - a for a, b in partition(count, lay.width)[first:end])
        for q, n, _ in _transfers(hier.allreduce_hier(r, len(nodes), count, SUM, nodes=nodes)):
            if nodes[q] != nodes[r]:
                assert q in lanes, (nodes, r, q)
                assert n <= mine, (nodes, r, q, n, mine)


@pytest.mark.parametrize("root", [0, 1, 4])
def test_broadcast_and_reduce_cross_nodes_through_representatives(hier, root):
    # 3 + 2 ranks: only the root and the other node's leader talk across; the vector crosses once.
    nodes, count = (0, 0, 0, 1, 1), 40
    reps = hier.layout(5, nodes).representatives(root)
    for schedule, args in ((hier.broadcast_hier, (count, root)), (hier.reduce_hier, (count, SUM, root))):
        crossing = 0
        for r in range(5):
            for q, n, sent in _transfers(schedule(r, 5, *args, nodes=nodes)):
                if nodes[q] != nodes[r]:
                    assert r in reps and q in reps, (schedule.__name__, root, r, q)
                    crossing += n if sent else 0
        assert crossing == count, (schedule.__name__, root)


# -- threads: against NumPy -------------------------------------------------------------------------

def _call(comm, collective, x, root, nonblocking, inplace):
    out = x.copy() if inplace else None
    if collective == "allreduce":
        if nonblocking:
            return comm.iallreduce(x if out is None else out, out=out, algorithm="hier").wait()
        return comm.allreduce(x if out is None else out, out=out, algorithm="hier")
    if collective == "broadcast":
        start = comm.ibroadcast if nonblocking else comm.broadcast
        got = start(x, root=root, algorithm="hier")
        return got.wait() if nonblocking else got
    out = out if comm.rank == root else None
    start = comm.ireduce if nonblocking else comm.reduce
    got = start(x if out is None else out, root=root, out=out, algorithm="hier")
    return got.wait() if nonblocking else got


@settings(max_examples=60, deadline=None)
@given(collective=st.sampled_from(["allreduce", "broadcast", "reduce"]), p=st.integers(1, 8),
       k=st.integers(1, 4), n=st.integers(0, 40), seed=st.integers(0, 2**31),
       dtype=st.sampled_from(["float32", "float64", "int64"]), root=st.integers(0, 7), nonblocking=st.booleans(),
       inplace=st.booleans())
def test_hier_matches_numpy_on_emulated_nodes(hier, collective, p, k, n, seed, dtype, root, nonblocking, inplace):
    # k ranks per node over p ranks: even (2 x 2), uneven (3 + 2), one node, one rank per node; counts
    # from 0 through fewer than k up.
    root %= p
    with _ranks_per_node(k):
        got = ck.run_local(lambda comm: _call(comm, collective, _data(comm.rank, n, seed, dtype), root,
                                              nonblocking, inplace), size=p)
    xs = [_data(r, n, seed, dtype) for r in range(p)]
    total = np.sum(xs, axis=0, dtype=dtype) if n else np.zeros(0, dtype)
    for r in range(p):
        if collective == "reduce" and r != root:
            assert got[r] is None
            continue
        want = xs[root] if collective == "broadcast" else total
        assert got[r].dtype == np.dtype(dtype)
        if np.dtype(dtype).kind == "f" and collective != "broadcast":
            np.testing.assert_allclose(got[r], want, rtol=1e-5, atol=1e-4)
        else:
            np.testing.assert_array_equal(got[r], want)
        if collective != "reduce":  # every rank holds the same bits
            assert got[r].tobytes() == got[0].tobytes()


def test_repeated_calls_take_the_cached_plans(hier):
    # The second and third calls of a shape run compiled plans: the same results as the first.
    def body(comm):
        x = _data(comm.rank, 33, 5, "float64")
        return [comm.allreduce(x, algorithm="hier") for _ in range(3)] + \
               [comm.broadcast(x, root=4, algorithm="hier") for _ in range(3)]

    with _ranks_per_node(3):
        got = ck.run_local(body, size=5)
    total = np.sum([_data(r, 33, 5, "float64") for r in range(5)], axis=0)
    for r in range(5):
        for a in got[r][:3]:
            assert a.tobytes() == got[0][0].tobytes()
            np.testing.assert_allclose(a, total, rtol=1e-12)
        for b in got[r][3:]:
            np.testing.assert_array_equal(b, _data(4, 33, 5, "float64"))


@pytest.mark.parametrize("placement", ["cyclic", (0, 1, 1, 0, 2, 2, 1)])
def test_any_placement_gives_the_same_results(hier, placement):
    # Nodes that are not blocks of ranks (round-robin; scattered): the schedules take the layout as given.
    p = 7
    nodes = tuple(cost.TwoLevel(3, placement=placement).nodes(p))

    def allreduce_placed(rank, size, count, op):
        yield from hier.allreduce_hier(rank, size, count, op, nodes=nodes)

    def reduce_placed(rank, size, count, op, root):
        yield from hier.reduce_hier(rank, size, count, op, root, nodes=nodes)

    algorithms.algorithm("allreduce", "hier_placed", commutative=True,
                         scratch=lambda r, s, c: hier._allreduce_scratch(r, s, c, nodes))(allreduce_placed)
    algorithms.algorithm("reduce", "hier_placed", commutative=True,
                         scratch=lambda r, s, c: hier._reduce_scratch(r, s, c, nodes))(reduce_placed)
    try:
        def body(comm):
            x = _data(comm.rank, 20, 3, "int64")
            return comm.allreduce(x, algorithm="hier_placed"), [comm.reduce(x, root=q, algorithm="hier_placed")
                                                                  for q in range(p)]
        got = ck.run_local(body, size=p)
    finally:
        algorithms.unregister("allreduce", "hier_placed")
        algorithms.unregister("reduce", "hier_placed")
    total = np.sum([_data(r, 20, 3, "int64") for r in range(p)], axis=0)
    for r in range(p):
        np.testing.assert_array_equal(got[r][0], total)
        np.testing.assert_array_equal(got[r][1][r], total)


def test_the_communicator_hands_node_aware_schedules_its_nodes(hier):
    # Every rank's node, as the communicator finds it: on the world the blocks of the emulation, and on
    # a sub-communicator of every other rank each rank alone on its node (no longer blocks of its ranks).
    seen = {}

    def allreduce_spy(rank, size, count, op, nodes=None):
        seen[(size, rank)] = hier.layout(size, nodes).members
        yield from hier.allreduce_hier(rank, size, count, op, nodes=nodes)

    algorithms.algorithm("allreduce", "hier_spy", commutative=True,
                         scratch=lambda r, s, c, nodes=None: hier._allreduce_scratch(r, s, c, nodes))(allreduce_spy)
    try:
        def body(comm):
            x = _data(comm.rank, 9, 1, "int64")
            sub = comm.split(comm.rank % 2)
            return comm.allreduce(x, algorithm="hier_spy"), sub.allreduce(x, algorithm="hier_spy")

        with _ranks_per_node(2):
            got = ck.run_local(body, size=6)
    finally:
        algorithms.unregister("allreduce", "hier_spy")
    assert seen[(6, 0)] == ((0, 1), (2, 3), (4, 5))
    assert seen[(3, 0)] == ((0,), (1,), (2,))
    xs = [_data(r, 9, 1, "int64") for r in range(6)]
    for r in range(6):
        np.testing.assert_array_equal(got[r][0], np.sum(xs, axis=0))
        np.testing.assert_array_equal(got[r][1], np.sum(xs[r % 2::2], axis=0))


def test_non_commutative_ops_are_refused_before_anything_is_sent(hier):
    def body(comm):
        with pytest.raises(AlgorithmNotApplicable, match="commutative"):
            comm.allreduce(np.ones(4), op=ck.ops.Op(np.subtract, commutative=False, name="minus"), algorithm="hier")
        return True

    assert all(ck.run_local(body, size=3))


def test_levels_never_run_what_cannot_run_inside_a_schedule(hier, monkeypatch):
    # Forced by the environment for every allreduce, hier must not choose itself for its lanes, nor the
    # node engine's shm (one node only) or MPI's own collective for its node level: the fallbacks run.
    monkeypatch.setenv("COMMKIT_ALLREDUCE_ALGORITHM", "hier")
    monkeypatch.setenv("COMMKIT_REDUCE_SCATTER_ALGORITHM", "shm")
    monkeypatch.setenv("COMMKIT_ALLGATHERV_ALGORITHM", "native")
    monkeypatch.setenv("COMMKIT_RANKS_PER_NODE", "2")

    def body(comm):
        y = comm.allreduce(_data(comm.rank, 11, 2, "int64"))
        return y, comm.last_algorithm

    got = ck.run_local(body, size=4)
    total = np.sum([_data(r, 11, 2, "int64") for r in range(4)], axis=0)
    for y, name in got:
        assert name == "hier"
        np.testing.assert_array_equal(y, total)
    for collective in ("allreduce", "reduce_scatter", "allgatherv"):
        assert hier._level(collective, 2, (5, 5) if collective != "allreduce" else 10, SUM).name in \
            ck.selection.FALLBACK.get(collective, ("naive",))


def test_it_is_chosen_only_by_name(hier):
    # Not in the default table: nothing measured it on a cluster yet.
    from commkit import selection

    for p in (2, 4, 8, 64):
        for nbytes in (8, 1 << 20, 64 << 20):
            for collective in ("allreduce", "broadcast", "reduce"):
                assert selection.select(collective, p, nbytes, "sum" if collective != "broadcast" else None
                                        ).algorithm.name != "hier"
    assert selection.select("allreduce", 4, 8, "sum", "hier").algorithm.name == "hier"


@pytest.mark.parametrize("collective", ["allreduce", "broadcast", "reduce"])
def test_the_grader_passes_it_on_emulated_nodes(hier, collective):
    # commkit.testing's own check: every dtype and op against NumPy on threads (p = 1..6), and the
    # simulator's matching of every message (p = 1..16), with nodes of 3 ranks (uneven from p = 4).
    from commkit import testing

    with _ranks_per_node(3):
        report = testing.check_algorithm(collective, "hier", max_procs=6, sim_procs=16)
    assert report.ok, report.summary()


# -- the simulator's two-level model ----------------------------------------------------------------

def test_the_two_level_model_predicts_the_lanes_win_for_large_vectors(hier):
    # 4 nodes x 4 ranks, 1 MiB of float32: each node link carries the vector about twice, where a flat
    # ring or Rabenseifner's algorithm puts traffic of every rank of the node on it.
    model = cost.TwoLevel(4)
    mine = hier.simulate("allreduce", 16, 1 << 18, model)
    assert not mine.waiting and not mine.mismatches
    for name in ("ring", "rabenseifner", "recursive_doubling"):
        assert mine.time < 0.7 * sim.simulate("allreduce", name, 16, 1 << 20, model=model).time, name
    # The broadcast through leaders beats the flat binomial tree there too.
    assert hier.simulate("broadcast", 16, 1 << 18, model, root=5).time < \
        sim.simulate("broadcast", "binomial", 16, 1 << 20, model=model, root=5).time


@pytest.mark.parametrize("nodes,k", [(2, 2), (3, 2), (4, 4), (2, 8), (5, 3)])
def test_with_rings_at_both_levels_the_simulation_is_the_textbook_formula(hier, monkeypatch, nodes, k):
    # 2(k-1)(α + (n/k)β) + (k-1)(n/k)γ inside the nodes, 2(N-1)(α' + (n/kN)β') + (N-1)(n/kN)γ between.
    for collective in ("ALLREDUCE", "REDUCE_SCATTER", "ALLGATHERV"):
        monkeypatch.setenv(f"COMMKIT_{collective}_ALGORITHM", "ring")
    model = cost.TwoLevel(k, alpha=1.0, beta=1e-3, alpha_inter=10.0, beta_inter=1e-2, gamma=1e-5)
    count = 60 * k * nodes
    n = 4 * count
    a, b, a2, b2, g = model.alpha, model.beta, model.alpha_inter, model.beta_inter, model.gamma
    want = (2 * (k - 1) * (a + n / k * b) + (k - 1) * n / k * g
            + 2 * (nodes - 1) * (a2 + n / (k * nodes) * b2) + (nodes - 1) * n / (k * nodes) * g)
    assert hier.simulate("allreduce", nodes * k, count, model).time == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("placement", ["block", "cyclic"])
def test_the_simulator_runs_every_layout_to_the_end(hier, placement):
    for p in range(1, 10):
        for k in (1, 2, 3):
            model = cost.TwoLevel(k, placement=placement)
            for collective in ("allreduce", "broadcast", "reduce"):
                for count in (0, 1, 5):
                    res = hier.simulate(collective, p, count, model, root=p - 1)
                    assert not res.waiting and not res.mismatches, (collective, p, k, count)


# -- mpiexec: against MPI's own collectives ---------------------------------------------------------

MPI_SCRIPT = """
import numpy as np
import commkit as ck
from mpi4py import MPI as M

ck.algorithms.load("commkit.algorithms.hier")
comm = ck.init()
raw = M.COMM_WORLD.Dup()
p, me = comm.size, comm.rank


def same_bits(y):
    every = raw.allgather(y.tobytes())
    assert all(b == every[0] for b in every)


for n in (0, 1, 2, 5, 1000, 70_001):
    rng = np.random.default_rng([n, me])
    x = rng.standard_normal(n).astype(np.float32)
    y = comm.allreduce(x, algorithm="hier")
    ref = np.empty_like(x)
    raw.Allreduce(x, ref)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-4)
    same_bits(y)
    z = comm.iallreduce(x, algorithm="hier").wait()
    assert z.tobytes() == y.tobytes()
    inplace = x.copy()
    comm.allreduce(inplace, out=inplace, algorithm="hier")
    assert inplace.tobytes() == y.tobytes()
    i = rng.integers(-1000, 1000, n)
    iref = np.empty_like(i)
    raw.Allreduce(i, iref)
    np.testing.assert_array_equal(comm.allreduce(i, algorithm="hier"), iref)
    for root in sorted({0, 1, p - 1}):
        b = comm.broadcast(x, root=root, algorithm="hier")
        bref = x.copy()
        raw.Bcast(bref, root=root)
        np.testing.assert_array_equal(b, bref)
        red = comm.reduce(x, root=root, algorithm="hier")
        redref = np.empty_like(x)
        raw.Reduce(x, redref, root=root)
        ired = comm.reduce(i, root=root, algorithm="hier")
        iredref = np.empty_like(i)
        raw.Reduce(i, iredref, root=root)
        if me == root:
            np.testing.assert_allclose(red, redref, rtol=1e-5, atol=1e-4)
            np.testing.assert_array_equal(ired, iredref)
        else:
            assert red is None and ired is None
# A sub-communicator: the blocks of ranks per node no longer match the emulated nodes, which changes
# only what crosses them, never the result.
half = comm.split(me % 2)
x = np.random.default_rng([9, me]).standard_normal(999)
sub = raw.Split(me % 2, me)
ref = np.empty_like(x)
sub.Allreduce(x, ref)
np.testing.assert_allclose(half.allreduce(x, algorithm="hier"), ref, rtol=1e-12)
print("ok", me, flush=True)
"""


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs,per_node", [(4, 2), (6, 2), (5, 3)])
def test_hier_under_mpiexec_agrees_with_mpi(mpi, nprocs, per_node):
    # 2 nodes x 2 ranks, 3 x 2, and the uneven 3 + 2.
    result = mpi(nprocs, MPI_SCRIPT, env={"COMMKIT_RANKS_PER_NODE": str(per_node)}, timeout=300)
    assert result.stdout.count("ok") == nprocs
