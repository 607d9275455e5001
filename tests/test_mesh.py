"""Meshes: the pure layout exhaustively, the groups on the threads world and under mpiexec.

The documented layout is restated here as its own formula,
``rank = (pipeline * D + data) * M + model``, and every check compares
against that formula (or against NumPy), never against the code under test.
The functions ``check_factorisation`` and ``check_example`` run on any
communicator: the threads tests call them in-process and the MPI job imports
this module and calls them on ``MPI.COMM_WORLD``.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import commkit as ck
from commkit import selection
from commkit.errors import CollectiveMismatch, CommClosed, InvalidArgument, RankError
from commkit.mesh import STANDARD_AXES, Mesh, make_mesh, mesh_layout


def triples(n: int) -> list[tuple[int, int, int]]:
    """Every ordered factorisation ``(data, model, pipeline)`` of ``n``."""
    return [(d, m, n // (d * m)) for d in range(1, n + 1) if n % d == 0
            for m in range(1, n // d + 1) if (n // d) % m == 0]


def documented_rank(D, M, pipeline, data, model) -> int:
    """The layout docs/mesh.md promises for the keyword form (no ranks_per_node hint)."""
    return (pipeline * D + data) * M + model


def documented_coords(D, M, rank) -> dict:
    return {"pipeline": rank // (D * M), "data": rank // M % D, "model": rank % M}


def documented_group(D, M, P, rank, axis) -> tuple:
    """The global ranks of ``rank``'s group along ``axis``, ordered by the axis coordinate."""
    coords = documented_coords(D, M, rank)
    n = {"data": D, "model": M, "pipeline": P}[axis]
    return tuple(documented_rank(D, M, **{**coords, axis: i}) for i in range(n))


def payload(seed, rank, dtype):
    """Fresh random data that any rank can rebuild for any other rank."""
    rng = np.random.default_rng([seed, rank])
    if np.dtype(dtype).kind == "i":
        return rng.integers(-10**6, 10**6, size=7, dtype=dtype)
    return rng.standard_normal(7).astype(dtype)


# -- the pure layout -------------------------------------------------------------------------


@pytest.mark.parametrize("size", range(1, 65))
def test_layout_matches_the_documented_formula_for_every_factorisation(size):
    for D, M, P in triples(size):
        layout = mesh_layout(size, data=D, model=M, pipeline=P)
        assert layout.names == STANDARD_AXES
        assert layout.shape == (P, D, M)
        for rank in range(size):
            coords = documented_coords(D, M, rank)
            assert layout.coords(rank) == coords
            assert layout.rank_of(coords) == rank
            assert layout.rank_of([coords[n] for n in STANDARD_AXES]) == rank
            for axis in STANDARD_AXES:
                assert layout.group(rank, axis) == documented_group(D, M, P, rank, axis)
        for axis, n in zip(STANDARD_AXES, (P, D, M)):
            groups = layout.groups(axis)
            assert len(groups) == size // n and all(len(g) == n for g in groups)
            assert sorted(r for g in groups for r in g) == list(range(size))  # a partition
            for colour, members in enumerate(groups):
                assert all(layout.group_index(r, axis) == colour for r in members)
        # Model-parallel ranks are adjacent: packed per node, a group never straddles a node of M ranks.
        assert all(g == tuple(range(g[0], g[0] + M)) and g[0] % M == 0 for g in layout.groups("model"))


@given(st.lists(st.integers(1, 4), min_size=1, max_size=4))
def test_general_axes_are_row_major_last_fastest(shape):
    names = [f"axis{i}" for i in range(len(shape))]
    size = int(np.prod(shape))
    layout = mesh_layout(size, dict(zip(names, shape)))
    assert layout.names == tuple(names) and layout.shape == tuple(shape)
    for coords in np.ndindex(*shape):
        rank = int(np.ravel_multi_index(coords, shape))
        assert layout.rank_of(coords) == rank
        assert layout.coords(rank) == dict(zip(names, coords))
        for a, name in enumerate(names):
            group = layout.group(rank, name)
            # The group varies only this axis's coordinate, in order.
            assert group == tuple(int(np.ravel_multi_index(coords[:a] + (i,) + coords[a + 1:], shape))
                                  for i in range(shape[a]))


def _groups_inside_one_node(groups, ranks_per_node) -> int:
    return sum(len({r // ranks_per_node for r in g}) == 1 for g in groups)


@given(inner=st.integers(1, 7), outer=st.integers(1, 7), ranks_per_node=st.integers(1, 16))
def test_ranks_per_node_keeps_the_most_model_groups_inside_a_node(inner, outer, ranks_per_node):
    size = inner * outer
    plain = mesh_layout(size, model=inner)
    hinted = mesh_layout(size, model=inner, ranks_per_node=ranks_per_node)
    assert sorted(hinted.order) == list(range(size))
    for rank in range(size):
        assert hinted.rank_of(hinted.coords(rank)) == rank
    # The best any layout can do: each node holds floor(ranks on it / inner) whole groups.
    nodes = [min(ranks_per_node, size - start) for start in range(0, size, ranks_per_node)]
    best = sum(n // inner for n in nodes)
    assert _groups_inside_one_node(hinted.groups("model"), ranks_per_node) == best
    assert _groups_inside_one_node(plain.groups("model"), ranks_per_node) <= best
    if ranks_per_node % inner == 0:
        assert hinted.order == plain.order  # the conventional layout already fits: keep it
    for axis in STANDARD_AXES:
        assert sorted(r for g in hinted.groups(axis) for r in g) == list(range(size))


def test_ranks_per_node_example_from_the_docs():
    layout = mesh_layout(12, model=3, ranks_per_node=4)
    assert layout.groups("model") == [(0, 1, 2), (4, 5, 6), (8, 9, 10), (3, 7, 11)]
    assert layout.groups("data") == [(0, 4, 8, 3), (1, 5, 9, 7), (2, 6, 10, 11)]


@pytest.mark.parametrize("size, kwargs, shape", [
    (8, {}, (1, 8, 1)),
    (8, {"model": 2}, (1, 4, 2)),
    (8, {"model": 2, "pipeline": 2}, (2, 2, 2)),
    (8, {"model": -1, "data": 2}, (1, 2, 4)),
    (8, {"model": -1}, (1, 1, 8)),            # an omitted data axis is 1 when another axis is inferred
    (8, {"pipeline": -1, "model": 2}, (4, 1, 2)),
    (12, {"data": -1, "model": 3, "pipeline": 2}, (2, 2, 3)),
    (1, {"data": -1}, (1, 1, 1)),
])
def test_inferred_axis(size, kwargs, shape):
    assert mesh_layout(size, **kwargs).shape == shape


def test_mapping_and_pairs_forms_agree():
    a = mesh_layout(12, {"stage": 2, "replica": -1, "shard": 3})
    b = mesh_layout(12, [("stage", 2), ("replica", 2), ("shard", 3)])
    assert a == b and a.names == ("stage", "replica", "shard") and a.shape == (2, 2, 3)


@pytest.mark.parametrize("size, args, kwargs, message", [
    (8, (), {"data": 3, "model": 2},
     "a mesh of pipeline=1 x data=3 x model=2 needs 6 ranks, but the communicator has 8"),
    (6, (), {"data": 2, "model": 2, "pipeline": 2},
     "a mesh of pipeline=2 x data=2 x model=2 needs 8 ranks, but the communicator has 6"),
    (8, (), {"model": 3}, "cannot infer mesh axis 'data': the other axes (pipeline=1 x model=3) hold 3 ranks, "
                          "which does not divide the communicator's 8 ranks"),
    (8, (), {"data": -1, "model": -1}, "only one mesh axis may be -1 (inferred), got -1 for 'data' and 'model'"),
    (8, (), {"model": 0}, "mesh axis 'model' must have a positive int size, or -1 to infer it, got 0"),
    (8, (), {"pipeline": -2}, "mesh axis 'pipeline' must have a positive int size, or -1 to infer it, got -2"),
    (8, (), {"data": 2.0}, "mesh axis 'data' must have a positive int size, or -1 to infer it, got 2.0"),
    (8, (), {"data": True}, "mesh axis 'data' must have a positive int size, or -1 to infer it, got True"),
    (8, ({"x": 8},), {"model": 1}, "not both; got a mapping and model="),
    (8, ({},), {}, "axes must name at least one axis, got none"),
    (8, ({"x": 2, "y": 2},), {}, "a mesh of x=2 x y=2 needs 4 ranks, but the communicator has 8"),
    (8, ([("x", 4), ("x", 2)],), {}, "mesh axis names must be distinct; 'x' appears more than once"),
    (8, ({"2d": 8},), {}, "mesh axis names must be Python identifiers that do not start with '_', got '2d'"),
    (8, ({"_x": 8},), {}, "must be Python identifiers that do not start with '_', got '_x'"),
    (8, ({"free": 8},), {}, "mesh axis name 'free' is taken by a Mesh attribute"),
    (8, ([("x", 2, 4)],), {}, "axes must be (name, size) pairs"),
    (8, (5,), {}, "axes must be an ordered mapping of axis names to sizes"),
    (8, (), {"ranks_per_node": 0}, "ranks_per_node must be a positive int or None, got 0"),
    (0, (), {}, "size must be a positive int, got 0"),
])
def test_invalid_descriptions_are_refused_with_a_clear_message(size, args, kwargs, message):
    with pytest.raises(InvalidArgument, match=re.escape(message)):
        mesh_layout(size, *args, **kwargs)


def test_layout_queries_validate_their_arguments():
    layout = mesh_layout(8, data=2, model=2, pipeline=2)
    with pytest.raises(InvalidArgument, match=re.escape("this mesh has no axis 'tensor'; its axes are")):
        layout.groups("tensor")
    with pytest.raises(InvalidArgument, match=re.escape("rank must be an int in range(0, 8), got 8")):
        layout.coords(8)
    with pytest.raises(InvalidArgument, match=re.escape("coordinate data must be an int in range(0, 2), got 2")):
        layout.rank_of({"pipeline": 0, "data": 2, "model": 0})
    with pytest.raises(InvalidArgument, match=re.escape("coords must give exactly the axes")):
        layout.rank_of({"data": 0})


def test_format_draws_the_grid_and_the_groups():
    text = mesh_layout(8, data=2, model=2, pipeline=2).format(mark=5)
    assert text == "\n".join([
        "mesh of 8 ranks: pipeline=2 x data=2 x model=2 (model varies fastest)",
        "pipeline=0",
        "        model=0 model=1",
        "data=0        0       1",
        "data=1        2       3",
        "pipeline=1",
        "        model=0 model=1",
        "data=0        4      *5",
        "data=1        6       7",
        "model groups:    [0 1] [2 3] [4 5] [6 7]",
        "data groups:     [0 2] [1 3] [4 6] [5 7]",
        "pipeline groups: [0 4] [1 5] [2 6] [3 7]",
        "* rank 5 is at pipeline=1, data=0, model=1",
    ])


@given(st.lists(st.integers(1, 4), min_size=1, max_size=4), st.integers(1, 9))
def test_format_shows_every_rank_once_in_the_grid(shape, ranks_per_node):
    size = int(np.prod(shape))
    layout = mesh_layout(size, {f"a{i}": n for i, n in enumerate(shape)}, ranks_per_node=ranks_per_node)
    grid_lines = [line for line in layout.format().splitlines()[1:] if "groups:" not in line
                  and not line.startswith("nodes:")]
    cells = [int(tok) for line in grid_lines for tok in line.split() if tok.isdigit()]
    assert sorted(cells) == list(range(size))


# -- communicators on the threads world -----------------------------------------------------


def check_factorisation(comm, D, M, P, seed) -> None:
    """Build the (D, M, P) mesh on ``comm`` and check its groups and collectives against the formula."""
    size = comm.size
    with comm.mesh(data=D, model=M, pipeline=P) as mesh:
        assert isinstance(mesh, Mesh) and mesh.shape == (P, D, M)
        assert mesh.coords == documented_coords(D, M, comm.rank)
        subs = []
        for axis, n in zip(STANDARD_AXES, (P, D, M)):
            sub = mesh[axis]
            subs.append(sub)
            assert sub is getattr(mesh, axis)
            assert (sub.size, sub.rank) == (n, mesh.coords[axis])
            expected = documented_group(D, M, P, comm.rank, axis)
            assert mesh.ranks(axis) == expected
            # Who is really in the group: each member contributes its global rank.
            assert tuple(sub.allgather(np.array(comm.rank)).tolist()) == expected

        # An allreduce in the data-parallel group sums exactly the ranks the layout names.
        members = documented_group(D, M, P, comm.rank, "data")
        for dtype in ("int64", "float64"):
            got = mesh.data.allreduce(payload(seed, comm.rank, dtype))
            want = np.sum([payload(seed, r, dtype) for r in members], axis=0)
            if dtype == "int64":
                np.testing.assert_array_equal(got, want)
            else:
                np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)

        # A model-parallel allgather stacks the shards in model order.
        shards = [payload(seed + 1, r, "float64") for r in documented_group(D, M, P, comm.rank, "model")]
        np.testing.assert_array_equal(mesh.model.allgather(payload(seed + 1, comm.rank, "float64")), np.stack(shards))

        # The last pipeline stage broadcasts to the earlier ones.
        stages = documented_group(D, M, P, comm.rank, "pipeline")
        got = mesh.pipeline.broadcast(payload(seed + 2, comm.rank, "int64"), root=P - 1)
        np.testing.assert_array_equal(got, payload(seed + 2, stages[-1], "int64"))
    assert mesh.closed
    for sub in subs:
        with pytest.raises(CommClosed):
            sub.barrier()
    assert size == comm.size and comm.allreduce(np.array(1)) == size  # the parent stays usable


def check_every_factorisation(comm, seed) -> int:
    for D, M, P in triples(comm.size):
        check_factorisation(comm, D, M, P, seed)
    return len(triples(comm.size))


@pytest.mark.parametrize("size", range(1, 17))
def test_threads_every_factorisation(size):
    seed = int(np.random.default_rng().integers(2**31))
    assert ck.run_local(check_every_factorisation, size, seed, timeout=120) == [len(triples(size))] * size


def test_threads_general_axes_and_ranks_per_node():
    def body(comm):
        layout = mesh_layout(comm.size, {"stage": 2, "replica": -1, "shard": 3}, ranks_per_node=4)
        with comm.mesh({"stage": 2, "replica": -1, "shard": 3}, ranks_per_node=4) as mesh:
            assert mesh.layout == layout and mesh.names == ("stage", "replica", "shard")
            for axis in mesh.names:
                got = tuple(mesh[axis].allgather(np.array(comm.rank)).tolist())
                assert got == layout.group(comm.rank, axis) == mesh.ranks(axis)
            return mesh.ranks("shard")

    shards = ck.run_local(body, 12, timeout=60)
    # Nodes of 4 ranks and shards of 3: each of the three nodes holds one whole shard group.
    assert sorted(set(shards)) == [(0, 1, 2), (3, 7, 11), (4, 5, 6), (8, 9, 10)]


def test_threads_selection_sees_only_the_group():
    """Every applicable algorithm runs inside a group, and automatic selection uses the group's size."""
    seed = int(np.random.default_rng().integers(2**31))

    def body(comm):
        with comm.mesh(data=3, model=2, pipeline=2) as mesh:
            for axis in mesh.names:
                sub, members = mesh[axis], mesh.ranks(axis)
                x = payload(seed, comm.rank, "float64")
                want = np.sum([payload(seed, r, "float64") for r in members], axis=0)
                auto = sub.allreduce(x)
                assert sub.last_algorithm == selection.select("allreduce", sub.size, x.nbytes,
                                                              ck.SUM).algorithm.name
                np.testing.assert_allclose(auto, want, rtol=1e-12)
                for name in ("naive", "ring", "recursive_doubling", "rabenseifner"):
                    np.testing.assert_allclose(sub.allreduce(x, algorithm=name), want, rtol=1e-12)
                    assert sub.last_algorithm == name
                for name in ("naive", "ring", "recursive_doubling", "bruck"):
                    got = sub.allgather(np.array([comm.rank]), algorithm=name)
                    assert tuple(got.ravel().tolist()) == members
        return True

    assert all(ck.run_local(body, 12, timeout=60))


def test_mesh_object_api():
    def body(comm):
        mesh = comm.mesh(model=2, pipeline=2)
        assert mesh.axes == {"pipeline": 2, "data": 1, "model": 2} and mesh.size == 4
        assert mesh.comm is comm and mesh.rank == comm.rank
        assert mesh.group("model") is mesh.model is mesh.comms["model"]
        assert repr(mesh).startswith("<commkit.Mesh pipeline=2 x data=1 x model=2: rank ")
        assert f"*{comm.rank}" in mesh.format()
        with pytest.raises(InvalidArgument, match="this mesh has no axis 'tensor'"):
            mesh["tensor"]
        with pytest.raises(AttributeError):
            mesh.tensor
        mesh.free()
        mesh.free()  # twice is harmless
        with pytest.raises(CommClosed, match="this mesh was freed"):
            mesh.model
        return True

    assert all(ck.run_local(body, 4, timeout=60))


def test_make_mesh_checks_its_communicator():
    with pytest.raises(InvalidArgument, match="comm must be a commkit.Communicator, got int"):
        make_mesh(4, data=4)
    comm = ck.local_world(1)[0]
    comm.free()
    with pytest.raises(CommClosed):
        comm.mesh()


@pytest.mark.parametrize("check", [False, True])
def test_a_bad_shape_is_refused_before_any_communication(check):
    # Rank 0 of a 6-rank world calls alone: any message would block, and any split or gather is recorded.
    comm = ck.local_world(6, check=check)[0]
    calls = []
    for name in ("split", "dup", "allgather_object", "barrier"):
        setattr(comm, name, lambda *a, _name=name, **k: calls.append(_name))
    with pytest.raises(InvalidArgument, match=re.escape("needs 8 ranks, but the communicator has 6")):
        comm.mesh(data=2, model=2, pipeline=2)
    with pytest.raises(InvalidArgument, match=re.escape("cannot infer mesh axis 'data'")):
        comm.mesh(model=4)
    assert calls == []


def test_debug_mode_reports_ranks_that_describe_different_meshes():
    def body(comm):
        with comm.mesh(data=4) if comm.rank == 0 else comm.mesh(model=2):
            pass

    with pytest.raises(RankError) as info:
        ck.run_local(body, 4, check=True, timeout=60)
    assert isinstance(info.value.__cause__, CollectiveMismatch)
    assert "ranks describe different meshes: pipeline=1 x data=4 x model=1 on ranks [0]; " \
           "pipeline=1 x data=2 x model=2 on ranks [1, 2, 3]" in str(info.value)


# -- the example: data-parallel gradient averaging with a model-parallel allgather -------------


def example_data(D, M, seed):
    """A softmax-regression batch (X, one-hot T) and weights W, sized to split D ways by rows and M by classes."""
    rng = np.random.default_rng(seed)
    n, features, classes = 4 * D, 5, 2 * M
    X = rng.standard_normal((n, features))
    T = np.eye(classes)[rng.integers(0, classes, size=n)]
    W = rng.standard_normal((features, classes))
    return X, T, W


def train_step(mesh, X, T, W, lr):
    """One SGD step of softmax regression on this rank's share; returns (loss, this rank's new W shard).

    Data parallelism splits the rows of X and T; model parallelism splits the
    classes (columns of W). The softmax needs a whole row of logits, so the
    model group allgathers its shards; the gradients are averaged over the
    data group, as a data-parallel trainer does after every backward pass.
    """
    D, M = mesh.axes["data"], mesh.axes["model"]
    d, m = mesh.coords["data"], mesh.coords["model"]
    rows = slice(d * len(X) // D, (d + 1) * len(X) // D)
    cols = slice(m * W.shape[1] // M, (m + 1) * W.shape[1] // M)
    x, t, w = X[rows], T[rows], W[:, cols]

    shard = x @ w                                                  # this rank's columns of the logits
    logits = np.concatenate(list(mesh.model.allgather(shard)), axis=1)
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    local_loss = -np.mean(np.sum(t * np.log(p), axis=1))
    local_grad = x.T @ ((p - t)[:, cols] / len(x))                 # mean over this rank's rows

    grad = mesh.data.allreduce(local_grad) / D                     # average over the data-parallel group
    loss = mesh.data.allreduce(np.array(local_loss)) / D
    return float(loss), w - lr * grad


def one_process_step(X, T, W, lr):
    logits = X @ W
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    loss = -np.mean(np.sum(T * np.log(p), axis=1))
    return float(loss), W - lr * (X.T @ (p - T) / len(X))


def check_example(comm, D, M, seed) -> None:
    """The mesh training step gives the numbers of the one-process step on every rank."""
    X, T, W = example_data(D, M, seed)
    loss_1, W_1 = one_process_step(X, T, W, lr=0.5)
    with comm.mesh(data=D, model=M) as mesh:
        loss, w = train_step(mesh, X, T, W, lr=0.5)
        np.testing.assert_allclose(loss, loss_1, rtol=1e-12)
        m = mesh.coords["model"]
        np.testing.assert_allclose(w, W_1[:, m * w.shape[1]:(m + 1) * w.shape[1]], rtol=1e-12, atol=1e-14)
        # The whole updated W, reassembled across the model group, is the one-process W.
        np.testing.assert_allclose(np.concatenate(list(mesh.model.allgather(w)), axis=1), W_1,
                                   rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("D, M", [(1, 1), (2, 1), (1, 3), (2, 2), (3, 2), (2, 3)])
def test_example_matches_one_process(D, M):
    seed = int(np.random.default_rng().integers(2**31))
    ck.run_local(check_example, D * M, D, M, seed, timeout=60)


# -- under mpiexec -----------------------------------------------------------------------------

MPI_JOB = """
import numpy as np
import commkit as ck
from commkit.errors import InvalidArgument
from test_mesh import check_every_factorisation, check_example, triples

comm = ck.init("mpi")
seed = int(comm.broadcast_object(int(np.random.default_rng().integers(2**31))))
count = check_every_factorisation(comm, seed)
examples = 0
for D, M, P in triples(comm.size):
    if P == 1:
        check_example(comm, D, M, seed)
        examples += 1
try:
    comm.mesh(data=comm.size + 1)
except InvalidArgument as exc:
    assert "needs %d ranks, but the communicator has %d" % (comm.size + 1, comm.size) in str(exc)
else:
    raise AssertionError("a mesh larger than the world was accepted")
assert comm.allreduce(np.array(1)) == comm.size
if comm.rank == 0:
    print("mesh ok: %d factorisations, %d examples on %d ranks" % (count, examples, comm.size))
"""


@pytest.mark.parametrize("nprocs", [2, 3, 4, 5, 6])
def test_mpi_every_factorisation(mpi, nprocs):
    result = mpi(nprocs, MPI_JOB)
    examples = sum(P == 1 for _, _, P in triples(nprocs))
    assert f"mesh ok: {len(triples(nprocs))} factorisations, {examples} examples on {nprocs} ranks" in result.stdout
