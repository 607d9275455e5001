"""The mpi4py face: mpi4py-style programs give the same results wrapped as with real mpi4py.

Each MPI test runs one program twice in the same job -- on ``MPI.COMM_WORLD``
(real mpi4py, MPI's own collectives) and on ``wrap(MPI.COMM_WORLD)`` (commkit's
algorithms) -- from the same fresh random data, and compares every result
element for element: integers exactly, floating-point sums to rounding.
"""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

pytest.importorskip("mpi4py")

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(os.path.dirname(HERE), "examples", "mpi4py_program.py")

# The mpi4py-style program. It takes the communicator and the Waitall to use
# (MPI.Request.Waitall for real mpi4py, the face's Request.Waitall wrapped,
# since that one list mixes collective and point-to-point requests).
PROGRAM = r'''
import sys
import numpy as np
from mpi4py import MPI
from commkit.compat.mpi4py import Request, wrap


def program(comm, waitall, seed):
    rank, size = comm.Get_rank(), comm.Get_size()
    rng = np.random.default_rng([seed, rank])
    out = {}
    ints = lambda n: rng.integers(-1000, 1000, n, dtype=np.int64)
    root = size - 1

    # Bcast: plain array, [buf, datatype], [buf, count, datatype], a bytearray.
    a = ints(5) if rank == 0 else np.zeros(5, np.int64)
    comm.Bcast(a, root=0); out["bcast"] = a
    b = rng.random(4) if rank == root else np.zeros(4)
    comm.Bcast([b, MPI.DOUBLE], root=root); out["bcast_typed"] = b
    c = np.full(6, -1, np.int32)
    if rank == 0:
        c[:3] = [7, 8, 9]
    comm.Bcast([c, 3, MPI.INT], root=0); out["bcast_count"] = c     # only the first 3 move
    raw = bytearray(rng.integers(0, 255, 8, dtype=np.uint8).tobytes() if rank == 1 % size else bytes(8))
    comm.Bcast(raw, root=1 % size); out["bcast_bytearray"] = np.frombuffer(raw, np.uint8).copy()

    # Allreduce: every builtin op, IN_PLACE, counts and displacements.
    x = ints(11)
    for name in ("SUM", "MAX", "MIN", "BAND", "BOR", "BXOR", "LAND", "LOR", "LXOR"):
        r = np.empty_like(x)
        comm.Allreduce(x % 7 if name.startswith("L") else x, r, op=getattr(MPI, name))
        out["allreduce_" + name] = r
    small = rng.integers(-3, 4, 6).astype(np.int32)
    r = np.empty_like(small); comm.Allreduce([small, MPI.INT], [r, MPI.INT], MPI.PROD); out["allreduce_prod"] = r
    f = rng.standard_normal(9)
    r = np.zeros(9); comm.Allreduce([f, MPI.DOUBLE], [r, MPI.DOUBLE], op=MPI.SUM); out["allreduce_float"] = r
    inplace = ints(10)
    comm.Allreduce(MPI.IN_PLACE, inplace, op=MPI.SUM); out["allreduce_in_place"] = inplace
    part = ints(8)
    comm.Allreduce(MPI.IN_PLACE, [part, 3, MPI.INT64_T], op=MPI.MAX); out["allreduce_count"] = part
    disp = ints(8)
    comm.Allreduce(MPI.IN_PLACE, [disp, (3, 2), MPI.INT64_T], op=MPI.SUM); out["allreduce_displ"] = disp
    matrix = rng.standard_normal((3, 4)).astype(np.float32)
    r = np.zeros((3, 4), np.float32); comm.Allreduce(matrix, r, MPI.MIN); out["allreduce_2d"] = r
    fortran = np.asfortranarray(ints(6).reshape(2, 3))
    comm.Allreduce(MPI.IN_PLACE, fortran, MPI.SUM); out["allreduce_fortran"] = fortran

    # Reduce: plain, IN_PLACE at the root, recvbuf=None elsewhere.
    x = ints(7)
    r = np.full(7, -5, np.int64) if rank == root else None
    comm.Reduce(x, r, op=MPI.SUM, root=root); out["reduce"] = r if rank == root else np.zeros(0)
    y = ints(5)
    if rank == 0:
        comm.Reduce(MPI.IN_PLACE, y, op=MPI.MAX, root=0)
    else:
        comm.Reduce(y, None, op=MPI.MAX, root=0)
    out["reduce_in_place"] = y

    # Gather: plain, a per-process count in a larger buffer, IN_PLACE.
    x = ints(3)
    r = np.full(size * 3, -1, np.int64) if rank == root else None
    comm.Gather(x, r, root=root); out["gather"] = r if rank == root else np.zeros(0)
    x = ints(2).astype(np.int32)
    r = np.full(size * 2 + 3, -1, np.int32)
    comm.Gather([x, MPI.INT], [r, 2, MPI.INT], root=0); out["gather_count"] = r
    g = np.full(size * 4, -1, np.int64)
    g[rank * 4:(rank + 1) * 4] = ints(4)
    if rank == 0:
        comm.Gather(MPI.IN_PLACE, g, root=0)
    else:
        comm.Gather(g[rank * 4:(rank + 1) * 4].copy(), None, root=0)
    out["gather_in_place"] = g

    # Scatter: plain, IN_PLACE at the root.
    s = ints(size * 3) if rank == 0 else None
    r = np.zeros(3, np.int64); comm.Scatter(s, r, root=0); out["scatter"] = r
    s = rng.standard_normal(size * 2) if rank == root else None
    if rank == root:
        comm.Scatter([s, MPI.DOUBLE], MPI.IN_PLACE, root=root); out["scatter_in_place"] = s
    else:
        r = np.zeros(2); comm.Scatter(None, [r, MPI.DOUBLE], root=root); out["scatter_in_place"] = r

    # Allgather and Alltoall: plain and IN_PLACE.
    x = ints(3)
    r = np.zeros(size * 3, np.int64); comm.Allgather(x, r); out["allgather"] = r
    r = np.zeros((size, 2), np.int64); r[rank] = ints(2)
    comm.Allgather(MPI.IN_PLACE, r); out["allgather_in_place"] = r
    x = ints(size * 2)
    r = np.zeros(size * 2, np.int64); comm.Alltoall(x, r); out["alltoall"] = r
    r = ints(size * 3)
    comm.Alltoall(MPI.IN_PLACE, [r, MPI.INT64_T]); out["alltoall_in_place"] = r

    # Reduce_scatter_block and Reduce_scatter: plain, IN_PLACE, uneven and gathered counts.
    x = ints(size * 3)
    r = np.zeros(3, np.int64); comm.Reduce_scatter_block(x, r, op=MPI.SUM); out["rsb"] = r
    r = ints(size * 2)
    comm.Reduce_scatter_block(MPI.IN_PLACE, r, op=MPI.BXOR); out["rsb_in_place"] = r
    counts = [(i % 3) + 1 for i in range(size)]
    x = ints(sum(counts))
    r = np.zeros(counts[rank], np.int64); comm.Reduce_scatter(x, r, counts, MPI.SUM); out["rs"] = r
    r = np.zeros(counts[rank], np.int64); comm.Reduce_scatter(x, r, op=MPI.MAX); out["rs_inferred"] = r
    r = ints(sum(counts))
    comm.Reduce_scatter(MPI.IN_PLACE, r, counts, MPI.SUM); out["rs_in_place"] = r

    # Scan and Exscan. Rank 0's Exscan result is undefined in MPI; MPICH leaves the
    # buffer as it was, and so does the face, so its sentinel is compared too.
    x = ints(5)
    r = np.zeros(5, np.int64); comm.Scan(x, r, MPI.SUM); out["scan"] = r
    r = ints(4); comm.Scan(MPI.IN_PLACE, r, MPI.MAX); out["scan_in_place"] = r
    r = np.full(5, 12345, np.int64); comm.Exscan(x, r, MPI.SUM)
    out["exscan"] = r
    r = ints(4); comm.Exscan(MPI.IN_PLACE, r, MPI.MIN); out["exscan_in_place"] = r

    # Point to point and requests: a ring with Sendrecv, then Isend/Irecv mixed
    # with nonblocking collectives in one Waitall.
    right, left = (rank + 1) % size, (rank - 1) % size
    send, recv = ints(4), np.zeros(4, np.int64)
    status = MPI.Status()
    comm.Sendrecv(send, right, 3, recv, left, 3, status); out["sendrecv"] = recv
    out["sendrecv_count"] = np.array([status.Get_source(), status.Get_count(MPI.INT64_T)])
    got, total, shared = np.zeros(6), ints(5), (rng.random(3) if rank == 0 else np.zeros(3))
    requests = [comm.Irecv([got, MPI.DOUBLE], left, 9), comm.Isend([rng.random(6), MPI.DOUBLE], right, 9)]
    requests += [comm.Iallreduce(MPI.IN_PLACE, total, MPI.SUM), comm.Ibcast(shared, root=0)]
    waitall(requests)
    out["irecv"], out["iallreduce"], out["ibcast"] = got, total, shared
    gathered = np.zeros(size, np.int64)
    comm.Ialltoall(ints(size), gathered).Wait(); out["ialltoall"] = gathered
    comm.Barrier()

    # Split (with MPI.UNDEFINED), Dup and Free.
    sub = comm.Split(rank % 2, -rank)
    v = np.array([rank, sub.Get_rank(), sub.Get_size()], np.int64)
    sub.Allreduce(MPI.IN_PLACE, v, MPI.SUM); out["split"] = v
    sub.Free()
    none = comm.Split(MPI.UNDEFINED if rank == 0 else 0, 0)
    out["split_undefined"] = np.array([none == MPI.COMM_NULL])
    if none != MPI.COMM_NULL:
        none.Free()
    dup = comm.Dup()
    v = ints(3); dup.Allreduce(MPI.IN_PLACE, v, MPI.SUM); out["dup"] = v
    dup.Free()
    return out


if __name__ == "__main__":
    seed = int(sys.argv[1])
    expected = program(MPI.COMM_WORLD, MPI.Request.Waitall, seed)
    comm = wrap(MPI.COMM_WORLD)
    got = program(comm, Request.Waitall, seed)
    assert comm.comm.last_algorithm != "native", comm.comm.last_algorithm
    assert expected.keys() == got.keys()
    for key in expected:
        e, g = np.asarray(expected[key]), np.asarray(got[key])
        assert e.dtype == g.dtype and e.shape == g.shape, (key, e.dtype, g.dtype, e.shape, g.shape)
        if e.dtype.kind == "f":
            assert np.allclose(e, g, rtol=1e-5 if e.dtype.itemsize == 4 else 1e-12), (key, e, g)
        else:
            assert np.array_equal(e, g), (key, e, g)
    print(f"rank {MPI.COMM_WORLD.Get_rank()}: {len(expected)} results identical")
'''


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [3, 4])
def test_program_matches_real_mpi4py(mpi, nprocs):
    seed = int(np.random.SeedSequence().entropy % 2**32)
    result = mpi(nprocs, PROGRAM, args=(seed,), timeout=180)
    assert result.stdout.count("results identical") == nprocs, (seed, result.stdout, result.stderr)


@pytest.mark.mpi
def test_example_program_runs_unchanged_but_for_one_line(mpi, tmp_path):
    """The example runs as plain mpi4py without its wrapping line, and prints the same with it."""
    with open(EXAMPLE) as f:
        source = f.read()
    wrapping = [line for line in source.splitlines() if "wrap(" in line and not line.lstrip().startswith("#")]
    assert len(wrapping) == 1, wrapping
    plain = source.replace(wrapping[0] + "\n", "")
    outputs = []
    for code in (plain, source):
        result = mpi(3, code, timeout=120)
        outputs.append(sorted(result.stdout.splitlines()))
    assert outputs[0], "the example printed nothing"
    assert outputs[0] == outputs[1]


# -- single-process checks of the parsing rules (COMM_SELF, one rank, in this process) --------


@pytest.fixture(scope="module")
def face():
    from mpi4py import MPI

    from commkit.compat.mpi4py import wrap

    return MPI, wrap(MPI.COMM_SELF)


def test_one_rank_collectives_copy_like_mpi(face):
    MPI, comm = face
    x = np.random.default_rng().integers(-50, 50, 6)
    r = np.zeros_like(x)
    comm.Allreduce(x, r, op=MPI.SUM)
    assert np.array_equal(r, x)
    r = np.zeros(6, np.int64)
    comm.Allgather([x, 6, MPI.INT64_T], r)
    assert np.array_equal(r, x)
    assert comm.Get_rank() == 0 and comm.Get_size() == 1


def test_buffer_spec_errors_name_what_was_expected(face):
    from commkit.errors import InvalidBuffer, UnsupportedOp

    MPI, comm = face
    x = np.arange(4, dtype=np.int64)
    with pytest.raises(InvalidBuffer, match="mismatch in send count 4 and receive count 3"):
        comm.Allreduce(x, np.zeros(3, np.int64))
    with pytest.raises(InvalidBuffer, match="datatypes"):
        comm.Allreduce(x, np.zeros(4, np.float64))
    with pytest.raises(InvalidBuffer, match="count asks for 9 .* holds 4"):
        comm.Allreduce(MPI.IN_PLACE, [x, 9, MPI.INT64_T])
    with pytest.raises(InvalidBuffer, match="read-only"):
        comm.Allreduce(x, _readonly(4))
    with pytest.raises(InvalidBuffer, match="contiguous"):
        comm.Allreduce(MPI.IN_PLACE, np.zeros(8, np.int64)[::2])
    with pytest.raises(InvalidBuffer, match="derived datatype"):
        vec = MPI.INT64_T.Create_contiguous(2).Commit()
        try:
            comm.Allreduce(MPI.IN_PLACE, [x, 2, vec])
        finally:
            vec.Free()
    with pytest.raises(UnsupportedOp, match="MAXLOC"):
        comm.Allreduce(MPI.IN_PLACE, x, op=MPI.MAXLOC)
    with pytest.raises(InvalidBuffer, match="2 to 4 items"):
        comm.Bcast([x])


def _readonly(n):
    a = np.zeros(n, np.int64)
    a.setflags(write=False)
    return a


def test_unknown_attributes_fall_through_to_mpi4py(face):
    MPI, comm = face
    assert comm.Get_name() == MPI.COMM_SELF.Get_name()
    assert comm.allreduce(3) == 3  # mpi4py's pickle-based method
    assert re.search("rank 0 of 1", repr(comm))


def test_buffer_protocol_and_dlpack_objects(face):
    import array

    MPI, comm = face
    buf = array.array("d", [1.5, 2.5, 3.5])
    comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    assert list(buf) == [1.5, 2.5, 3.5]

    class DLPackOnly:
        """An array that offers nothing but DLPack, like a PyTorch CPU tensor."""

        def __init__(self, a):
            self._a = a

        def __dlpack__(self, **kwargs):
            return self._a.__dlpack__(**kwargs)

        def __dlpack_device__(self):
            return self._a.__dlpack_device__()

    target = np.zeros(3)
    comm.Allreduce([DLPackOnly(np.array([1.0, 2.0, 3.0])), MPI.DOUBLE], DLPackOnly(target), op=MPI.SUM)
    assert target.tolist() == [1.0, 2.0, 3.0]

