"""The point-to-point contract, on the threads world (sizes 1..8) and under real mpiexec (1..4 ranks)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, strategies as st

import commkit as ck

from conftest import requires_mpi, run_mpi
from contracts import DTYPES, p2p_any_source_and_order, p2p_roundtrip

SHAPES = st.one_of(st.just(()), st.tuples(st.integers(0, 40)), st.tuples(st.integers(0, 5), st.integers(1, 4)))


@given(size=st.integers(1, 8), shape=SHAPES, dtype=st.sampled_from(DTYPES), tag=st.integers(0, 2**20),
       shift=st.integers(0, 8), seed=st.integers(0, 2**32 - 1))
def test_p2p_contract_threads(size, shape, dtype, tag, shift, seed):
    ck.run_local(p2p_roundtrip, size, shape, dtype, tag, shift, seed, timeout=20)


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8])
def test_any_source_and_ordering_threads(size):
    ck.run_local(p2p_any_source_and_order, size, 0, timeout=20)


MPI_P2P = """
import sys
import numpy as np
from hypothesis import given, settings, strategies as st
import commkit as ck
from contracts import DTYPES, p2p_any_source_and_order, p2p_roundtrip

comm = ck.init(timeout=30)
SHAPES = st.one_of(st.just(()), st.tuples(st.integers(0, 40)), st.tuples(st.integers(0, 5), st.integers(1, 4)))

# derandomize: every rank draws the same examples, so all ranks run the same exchange.
@settings(derandomize=True, database=None, max_examples=int(sys.argv[1]), deadline=None)
@given(shape=SHAPES, dtype=st.sampled_from(DTYPES), tag=st.integers(0, 2**20), shift=st.integers(0, 8),
       seed=st.integers(0, 2**32 - 1))
def contract(shape, dtype, tag, shift, seed):
    p2p_roundtrip(comm, shape, dtype, tag, shift, seed)

contract()
p2p_any_source_and_order(comm, 0)
comm.barrier()
import sys; sys.stdout.write(f"rank {comm.rank} ok\\n"); sys.stdout.flush()
"""


@requires_mpi
@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
def test_p2p_contract_mpi(nprocs):
    result = run_mpi(nprocs, MPI_P2P, args=[15], timeout=240)
    assert result.stdout.count(" ok") == nprocs


USER_TRAFFIC = """
import numpy as np
from mpi4py import MPI
import commkit as ck

world = MPI.COMM_WORLD
comm = ck.init(timeout=30)
r, p = world.Get_rank(), world.Get_size()
right, left = (r + 1) % p, (r - 1) % p
# The user's own messages on COMM_WORLD use the very tags commkit uses (0 for its
# first collective, 0 for a default send); post them first so they are in flight.
user_out = np.full(4, 1000 + r, np.int64)
user_in = np.empty(4, np.int64)
reqs = [world.Irecv(user_in, left, 0), world.Isend(user_out, right, 0)]
total = comm.allreduce(np.full(4, r, np.int64))
got = comm.sendrecv(np.full(4, 2000 + r, np.int64), right, left, sendtag=0, recvtag=0)
MPI.Request.Waitall(reqs)
assert total.tolist() == [sum(range(p))] * 4, total
assert got.tolist() == [2000 + left] * 4, got
assert user_in.tolist() == [1000 + left] * 4, user_in
import sys; sys.stdout.write(f"rank {r} ok\\n"); sys.stdout.flush()
"""


@requires_mpi
@pytest.mark.mpi
def test_user_comm_world_traffic_never_meets_commkit_traffic():
    result = run_mpi(3, USER_TRAFFIC, timeout=120)
    assert result.stdout.count(" ok") == 3


def test_invalid_peers_and_tags_raise_before_sending():
    def body(comm):
        x = np.arange(3)
        with pytest.raises(ck.InvalidArgument, match=r"dest must be in range\(0, 2\), got 2"):
            comm.send(x, 2)
        with pytest.raises(ck.InvalidArgument, match=r"dest must be in range\(0, 2\), got -1"):
            comm.isend(x, -1)
        with pytest.raises(ck.InvalidArgument, match="tag must be between 0 and"):
            comm.send(x, 0, tag=-5)
        with pytest.raises(ck.InvalidArgument, match="tag must be between 0 and"):
            comm.send(x, 0, tag=2**40)
        with pytest.raises(ck.InvalidArgument, match="source must be in range"):
            comm.recv(7, out=np.empty(3))
        with pytest.raises(ck.InvalidArgument, match="recv needs a buffer"):
            comm.recv(0)
        with pytest.raises(ck.InvalidBuffer, match="read-only"):
            ro = np.empty(3)
            ro.flags.writeable = False
            comm.recv(0, out=ro)
        with pytest.raises(ck.InvalidBuffer, match="C-contiguous"):
            comm.recv(0, out=np.empty((3, 4))[:, 1])
        with pytest.raises(ck.InvalidBuffer, match="dtype object"):
            comm.send(np.array([object()]), 0)
        # Nothing was sent: a matching receive would now find nothing.
        assert comm._p2p.probe(ck.ANY_SOURCE, ck.ANY_TAG) is None

    ck.run_local(body, 2)


def test_message_larger_than_buffer_is_an_error_not_truncation():
    def body(comm):
        if comm.rank == 0:
            comm.send(np.arange(10), 1)
        else:
            with pytest.raises(ck.InvalidBuffer, match="80 bytes .* does not fit the receive buffer of 40 bytes"):
                comm.recv(0, out=np.empty(5, np.int64))

    ck.run_local(body, 2)


def test_non_contiguous_send_is_copied_and_arrives_whole():
    def body(comm):
        base = np.arange(24).reshape(4, 6)
        if comm.rank == 0:
            comm.send(base[:, ::2], 1)
        else:
            np.testing.assert_array_equal(comm.recv(0, shape=(4, 3), dtype=base.dtype), base[:, ::2])

    ck.run_local(body, 2)


def test_send_recv_to_self_and_probe():
    def body(comm):
        req = comm.isend(np.array([1.5, 2.5]), comm.rank, tag=3)
        status = comm._p2p.probe(comm.rank, 3)
        assert status is not None and status.nbytes == 16
        np.testing.assert_array_equal(comm.recv(comm.rank, 3, shape=2, dtype=float), [1.5, 2.5])
        req.wait()

    ck.run_local(body, 1)


def test_split_and_dup_keep_traffic_apart():
    def body(comm):
        sub = comm.split(comm.rank % 2, key=-comm.rank)
        # Keys reverse the order inside each colour.
        members = sub.allgather(np.array(comm.rank))
        expected = sorted([r for r in range(comm.size) if r % 2 == comm.rank % 2], reverse=True)
        assert members.tolist() == expected
        twin = comm.dup()
        a = twin.sendrecv(np.array([comm.rank]), (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size)
        assert a.tolist() == [(comm.rank - 1) % comm.size]
        none = comm.split(None if comm.rank == 0 else 1)
        assert (none is None) == (comm.rank == 0)
        for c in (sub, twin, none):
            if c is not None:
                c.free()
        with pytest.raises(ck.CommClosed, match="freed"):
            twin.allreduce(np.ones(1))
        with pytest.raises(ck.CommClosed):
            sub.send(np.ones(1), 0)

    ck.run_local(body, 5)


def test_context_manager_frees():
    def body(comm):
        with comm.dup() as c:
            c.barrier()
        with pytest.raises(ck.CommClosed):
            c.barrier()

    ck.run_local(body, 2)
