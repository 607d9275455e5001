"""Contract checks shared by every transport: the same functions run on the threads world
(in-process) and under ``mpiexec`` (imported by the job scripts), as mpi4py runs one base
test class against several communicators.

Each rank's input is a pure function of (case, rank), so every rank can rebuild every
other rank's input and compute the NumPy reference locally: no gathering needed, and
the reference cannot be corrupted by the code under test.
"""

from __future__ import annotations


import numpy as np
from hypothesis import strategies as st

import commkit as ck
from commkit import algorithms
from commkit import collectives
from commkit.collectives import FIXED

ROOTED = tuple(c for c in FIXED if c in collectives.ROOTED)
REDUCING = tuple(c for c in FIXED if c in collectives.REDUCING)
DTYPES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
          "float16", "float32", "float64", "complex64", "complex128")
OPS = ("sum", "prod", "max", "min", "land", "lor", "lxor", "band", "bor", "bxor")


# -- point to point --------------------------------------------------------------------------


def payload(shape, dtype, seed, rank):
    """A deterministic random array for (seed, rank)."""
    rng = np.random.default_rng([seed, rank])
    dtype = np.dtype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, size=shape).astype(bool)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    if dtype.kind == "f":
        return (rng.standard_normal(shape) * 100).astype(dtype)
    return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)


def p2p_roundtrip(comm, shape, dtype, tag, shift, seed):
    """Every rank sends to rank+shift and receives from rank-shift, in several styles."""
    p, r = comm.size, comm.rank
    dest, source = (r + shift) % p, (r - shift) % p
    mine = payload(shape, dtype, seed, r)
    theirs = payload(shape, dtype, seed, source)
    before = mine.copy()

    # sendrecv: a ring exchange must not deadlock, whatever the shift.
    got = comm.sendrecv(mine, dest, source, sendtag=tag, recvtag=tag)
    np.testing.assert_array_equal(got, theirs)

    # isend/irecv into a given buffer, then wait_all.
    out = np.empty(shape, dtype)
    reqs = [comm.irecv(source, tag, out=out), comm.isend(mine, dest, tag)]
    results = ck.wait_all(reqs)
    assert results[0] is out
    np.testing.assert_array_equal(out, theirs)
    assert reqs[0].status.source == source and reqs[0].status.tag == tag
    assert reqs[0].status.nbytes == theirs.nbytes

    # Blocking send/recv in a deadlock-free order: even ranks of each pair send first
    # (with p == 1 or shift == 0 the rank talks to itself, so post the receive first).
    if dest == r:
        req = comm.irecv(r, tag, shape=shape, dtype=dtype)
        comm.send(mine, r, tag)
        np.testing.assert_array_equal(req.wait(), mine)
    else:
        req = comm.irecv(source, tag, shape=shape, dtype=dtype)
        comm.send(mine, dest, tag)
        np.testing.assert_array_equal(req.wait(), theirs)

    # Objects.
    comm.send_object({"from": r, "shape": shape}, dest, tag) if dest != r else None
    if dest != r:
        obj = comm.recv_object(source, tag)
        assert obj == {"from": source, "shape": shape}

    np.testing.assert_array_equal(mine, before)  # the send buffer is never modified


def p2p_any_source_and_order(comm, seed):
    """Rank 0 collects from everyone with ANY_SOURCE/ANY_TAG; per-pair order is kept."""
    p, r = comm.size, comm.rank
    if p == 1:
        return
    if r != 0:
        for i in range(3):
            comm.send(np.array([r, i], dtype=np.int64), 0, tag=10 + r)
    else:
        seen = {}
        for _ in range(3 * (p - 1)):
            arr, status = comm.recv(ck.ANY_SOURCE, ck.ANY_TAG, shape=2, dtype=np.int64, return_status=True)
            assert status.source == arr[0] and status.tag == 10 + arr[0]
            seen.setdefault(int(arr[0]), []).append(int(arr[1]))
        assert seen == {q: [0, 1, 2] for q in range(1, p)}
    comm.barrier()
    # Matching by tag: messages sent with tags 1 then 2 can be received 2 then 1.
    right, left = (r + 1) % p, (r - 1) % p
    reqs = [comm.isend(np.full(3, t, np.int32), right, tag=t) for t in (1, 2)]
    two = comm.recv(left, 2, shape=3, dtype=np.int32)
    one = comm.recv(left, 1, shape=3, dtype=np.int32)
    ck.wait_all(reqs)
    assert two.tolist() == [2, 2, 2] and one.tolist() == [1, 1, 1]


# -- collectives ----------------------------------------------------------------------------------


def op_applies(op, dtype) -> bool:
    return np.dtype(dtype).kind in ck.ops.get_op(op).kinds


def collective_input(case, rank, size):
    """Rank ``rank``'s input for ``case`` (a dict), the same on every process."""
    coll, shape, dtype = case["collective"], tuple(case["shape"]), np.dtype(case["dtype"])
    if coll in ("scatter", "alltoall"):
        shape = (size,) + shape
    elif coll == "reduce_scatter":
        shape = (sum(case["counts"]),) + shape
    rng = np.random.default_rng([case["seed"], rank])
    op = case.get("op")
    if dtype.kind == "b":
        return rng.integers(0, 2, size=shape).astype(bool)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        if op == "prod":  # keep products from being all zeros: small odd-or-even mix
            return rng.integers(-3 if dtype.kind == "i" else 0, 4, size=shape).astype(dtype)
        return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    if op == "prod":
        values = rng.uniform(0.5, 1.5, size=shape)
    else:
        values = rng.uniform(-1, 1, size=shape)
    if dtype.kind == "c":
        values = values + 1j * (rng.uniform(0.5, 1.5, size=shape) if op == "prod" else rng.uniform(-1, 1, size=shape))
    x = values.astype(dtype)
    if dtype.kind == "f" and op in ("max", "min") and x.size and rng.random() < 0.3:
        x.flat[rng.integers(0, x.size)] = np.nan  # max/min must propagate NaN as NumPy does
    return x


def _fold(op, xs):
    op = ck.ops.get_op(op) if isinstance(op, str) else op
    acc = np.array(xs[0], copy=True)
    for x in xs[1:]:
        acc = np.asarray(op.fn(acc, x)).astype(acc.dtype)
    return acc


def expected(case, rank, size):
    """The NumPy reference result on ``rank``, or None where the collective returns None."""
    coll, root = case["collective"], case.get("root", 0)
    xs = [collective_input(case, q, size) for q in range(size)]
    op = case.get("op_obj") or case.get("op")
    if coll == "barrier":
        return None
    if coll == "broadcast":
        return xs[root]
    if coll == "allreduce":
        return _fold(op, xs)
    if coll == "reduce":
        return _fold(op, xs) if rank == root else None
    if coll == "scan":
        return _fold(op, xs[: rank + 1])
    if coll == "exscan":
        if rank == 0:
            identity = ck.ops.get_op(op).identity_array(xs[0].shape, xs[0].dtype) if isinstance(op, str) else None
            return identity
        return _fold(op, xs[:rank])
    if coll == "gather":
        return np.stack(xs) if rank == root else None
    if coll == "allgather":
        return np.stack(xs)
    if coll == "scatter":
        return xs[root][rank]
    if coll == "alltoall":
        return np.stack([xs[q][rank] for q in range(size)])
    if coll == "reduce_scatter":
        total = _fold(op, xs)
        offsets = np.cumsum([0] + list(case["counts"]))
        return total[offsets[rank]: offsets[rank + 1]]
    raise AssertionError(coll)


def _tolerance(case, size, exp, xs_abs):
    dtype = np.dtype(case["dtype"])
    eps = np.finfo(dtype).eps if dtype.kind in "fc" else 0
    return 8 * size * eps * np.maximum(xs_abs, 1.0)


def run_collective(comm, case, algorithm=None, out=None, nonblocking=None):
    """Call the collective described by ``case`` on ``comm``; return its result.

    ``nonblocking`` (default: the case's own ``"nonblocking"`` draw) calls the
    ``i``-form instead and waits for its request, so every property test covers
    both forms of every collective.
    """
    coll, r = case["collective"], comm.rank
    x = collective_input(case, r, comm.size)
    op = case.get("op_obj") or case.get("op")
    root = case.get("root", 0)
    kw = {"algorithm": algorithm}
    if nonblocking is None:
        nonblocking = case.get("nonblocking", False)
    prefix = "i" if nonblocking else ""

    def call(name, *args, **more):
        result = getattr(comm, prefix + name)(*args, **kw, **more)
        return result.wait() if nonblocking else result

    if coll == "barrier":
        return call("barrier")
    if coll == "broadcast":
        return call("broadcast", x, root)
    if coll in ("allreduce", "scan", "exscan"):
        return call(coll, x, op)
    if coll == "reduce":
        return call("reduce", x, op, root)
    if coll == "gather":
        return call("gather", x, root)
    if coll == "allgather":
        return call("allgather", x)
    if coll == "scatter":
        out = np.empty(tuple(case["shape"]), np.dtype(case["dtype"]))
        return call("scatter", x if r == root else None, root, out=out)
    if coll == "alltoall":
        return call("alltoall", x)
    if coll == "reduce_scatter":
        return call("reduce_scatter", x, op, counts=case["counts"])
    raise AssertionError(coll)


def assert_matches(case, got, exp, size):
    """Compare a result with the reference: exact for integers, bool and max/min; tolerances for float sums."""
    if exp is None:
        assert got is None, f"expected None, got {got!r}"
        return
    assert got is not None, "expected an array, got None"
    assert got.shape == exp.shape, (got.shape, exp.shape)
    assert got.dtype == exp.dtype, (got.dtype, exp.dtype)
    dtype = np.dtype(case["dtype"])
    op = case.get("op")
    if dtype.kind in "fc" and op in ("sum", "prod") and case["collective"] in REDUCING:
        xs = [np.abs(collective_input(case, q, size)).astype(np.float64) for q in range(size)]
        if case["collective"] == "reduce_scatter":
            offsets = np.cumsum([0] + list(case["counts"]))
            xs = [x[offsets[case["_rank"]]: offsets[case["_rank"] + 1]] for x in xs]
        scale = sum(xs) if op == "sum" else np.ones_like(xs[0]) * (1.5 ** size)
        tol = _tolerance(case, size, exp, scale)
        diff = np.abs(got.astype(np.complex128) - exp.astype(np.complex128))
        assert np.all(diff <= tol), f"max error {diff.max()} above tolerance {tol.max()}"
    else:
        np.testing.assert_array_equal(got, exp)


def check_case(comm, case, algorithm=None):
    """Run one case with ``algorithm`` and check this rank's result and that inputs are untouched."""
    x_before = collective_input(case, comm.rank, comm.size)
    got = run_collective(comm, case, algorithm)
    case = dict(case, _rank=comm.rank)
    assert_matches(case, got, expected(case, comm.rank, comm.size), comm.size)
    assert comm.last_algorithm == (algorithm or comm.last_algorithm)
    return got, x_before


def applicable_algorithms(collective, size, op="sum"):
    """Names of every non-native algorithm of ``collective`` that can run with ``size`` ranks and ``op``."""
    op_obj = ck.ops.get_op(op) if isinstance(op, str) else op
    return sorted(name for name, alg in algorithms.for_collective(collective).items()
                  if name != "native" and alg.why_not(size, op_obj if collective in REDUCING else None) is None)


@st.composite
def cases(draw, size, collectives=FIXED):
    """A random collective call for ``size`` ranks: collective, op, dtype, shape, root, counts, seed."""
    coll = draw(st.sampled_from(collectives))
    case = {"collective": coll, "seed": draw(st.integers(0, 2**32 - 1)), "nonblocking": draw(st.booleans())}
    dtype = draw(st.sampled_from(DTYPES))
    if coll in REDUCING:
        op = draw(st.sampled_from([o for o in OPS if op_applies(o, dtype)]))
        case["op"] = op
    case["dtype"] = dtype
    # Shapes: scalars, 1-D with counts 0, 1, < p and not divisible by p, and a 2-D case.
    shape = draw(st.one_of(
        st.just(()),
        st.tuples(st.integers(0, 2 * size + 3)),
        st.tuples(st.integers(0, 4), st.integers(1, 3)),
        st.tuples(st.integers(20, 70)),
    ))
    if coll == "reduce_scatter":
        shape = shape[1:] if len(shape) > 1 else ()
        case["counts"] = draw(st.lists(st.integers(0, 4), min_size=size, max_size=size))
    case["shape"] = list(shape)
    if coll in ROOTED:
        case["root"] = draw(st.integers(0, size - 1))
    return case
