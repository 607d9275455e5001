"""The torch.distributed-style face: in-place semantics, groups, async work, and data-parallel training.

The training tests run a small NumPy linear regression with full-batch
gradient descent, once in a single process and once data-parallel (each rank
holds a shard, gradients averaged with all_reduce), and require the same
weights -- on threads (the ``local`` backend) and under MPI (through
:func:`commkit.launch`).
"""

from __future__ import annotations

import array
import threading
import uuid

import numpy as np
import pytest
from conftest import have_mpi

import commkit as ck
import commkit.distributed as dist
from commkit.errors import CommError, InvalidArgument, InvalidBuffer, UnsupportedOp
from commkit import launch

STEPS, LR = 40, 0.05


def make_problem(seed, size, rows_per_rank=24, features=5):
    """Random regression data (X, y) and starting weights w0, with rows divisible among ``size`` ranks."""
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((rows_per_rank * size, features))
    y = X @ rng.standard_normal(features) + 0.1 * rng.standard_normal(len(X))
    return X, y, rng.standard_normal(features)


def train_single(X, y, w0):
    """Full-batch gradient descent on the mean squared error, in one process."""
    w = w0.copy()
    for _ in range(STEPS):
        w -= LR * (2.0 / len(y) * X.T @ (X @ w - y))
    return w


def train_data_parallel(X, y, w0, how="sum"):
    """The same descent with the rows sharded over the default group's ranks.

    Equal shards make the average of the ranks' mean gradients the global mean
    gradient, so the weights must match :func:`train_single`.
    """
    rank, size = dist.get_rank(), dist.get_world_size()
    w = w0.copy() if rank == 0 else np.zeros_like(w0)
    dist.broadcast(w, src=0)  # every replica starts from rank 0's weights
    rows = len(y) // size
    Xr, yr = X[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
    for _ in range(STEPS):
        grad = 2.0 / rows * Xr.T @ (Xr @ w - yr)
        if how == "avg":
            dist.all_reduce(grad, op=dist.ReduceOp.AVG)
        elif how == "async":
            work = dist.all_reduce(grad, op=dist.ReduceOp.SUM, async_op=True)
            work.wait()
            assert work.is_completed()
            grad /= size
        else:
            dist.all_reduce(grad, op=dist.ReduceOp.SUM)
            grad /= size
        w -= LR * grad
    return w


def _check_training(seed, size, weights):
    X, y, w0 = make_problem(seed, size)
    expected = train_single(X, y, w0)
    assert not np.allclose(expected, w0), "training did not move the weights"
    for rank, w in enumerate(weights):
        np.testing.assert_allclose(w, expected, rtol=1e-10, atol=1e-12, err_msg=f"seed {seed}, rank {rank}")
        # Replicas must stay identical, or data parallelism drifts.
        assert np.array_equal(w, weights[0]), f"seed {seed}: rank {rank} differs from rank 0"


def _seed():
    return int(np.random.SeedSequence().entropy % 2**32)


def run_threads(size, fn, *args):
    """Run ``fn(rank, *args)`` on ``size`` threads, torch-spawn style; return results, re-raise the first error."""
    results, errors = [None] * size, []

    def body(rank):
        try:
            results[rank] = fn(rank, *args)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank thread hung"
    if errors:
        raise errors[0]
    return results


# -- data-parallel training ---------------------------------------------------------------------


@pytest.mark.parametrize("size", [3, 4])
def test_training_on_threads_matches_single_process(size):
    seed, job = _seed(), f"local://{uuid.uuid4()}"
    X, y, w0 = make_problem(seed, size)

    def rank_main(rank):
        dist.init_process_group("local", init_method=job, world_size=size, rank=rank)
        try:
            assert (dist.get_rank(), dist.get_world_size(), dist.get_backend()) == (rank, size, "local")
            return train_data_parallel(X, y, w0)
        finally:
            dist.destroy_process_group()

    _check_training(seed, size, run_threads(size, rank_main))
    assert not dist.is_initialized(), "the default group of a local rank leaked into the main thread"


@pytest.mark.parametrize("how", ["avg", "async"])
def test_training_in_run_local_with_avg_and_async(how):
    seed, size = _seed(), 4
    X, y, w0 = make_problem(seed, size)

    def rank_main(comm):
        dist.init_process_group("local", comm=comm)
        try:
            return train_data_parallel(X, y, w0, how)
        finally:
            dist.destroy_process_group()

    _check_training(seed, size, ck.run_local(rank_main, size=size))


def _train_under_mpi(comm, seed, size):
    """A launched rank: the mpi backend from the environment, then the same training."""
    dist.init_process_group("mpi", world_size=size)
    try:
        assert dist.get_rank() == comm.rank
        X, y, w0 = make_problem(seed, size)
        return train_data_parallel(X, y, w0)
    finally:
        dist.destroy_process_group()


@pytest.mark.mpi
@pytest.mark.skipif(not have_mpi(), reason="needs mpi4py and mpiexec (pip install 'commkit[mpi]')")
def test_training_under_mpi_matches_single_process():
    seed, size = _seed(), 3
    weights = launch(_train_under_mpi, size, seed, size, timeout=120)
    _check_training(seed, size, weights)


# -- collective semantics, against NumPy -----------------------------------------------------------


def _in_local_group(size, fn):
    """Run ``fn(rank, seed)`` on ``size`` threads, each with the default group set up; return (seed, results)."""
    seed = _seed()

    def rank_main(comm):
        dist.init_process_group("threads", comm=comm)
        try:
            return fn(comm.rank, seed)
        finally:
            dist.destroy_process_group()

    return seed, ck.run_local(rank_main, size=size)


def _data(seed, rank, shape=(2, 3)):
    return np.random.default_rng([seed, rank, 99]).integers(-100, 100, shape)


def test_collectives_work_in_place_like_torch():
    size = 3

    def body(rank, seed):
        mine = _data(seed, rank)
        out = {}
        out["broadcast"] = t = mine.copy()
        dist.broadcast(t, src=1)
        out["all_reduce"] = t = mine.copy()
        dist.all_reduce(t, op=dist.ReduceOp.BXOR)
        out["reduce"] = t = mine.copy()
        assert dist.reduce(t, dst=2, op=dist.ReduceOp.MAX) is None  # no Work without async_op
        lst = [np.zeros_like(mine) for _ in range(size)]
        dist.all_gather(lst, mine)
        out["all_gather"] = np.stack(lst)
        lst = [np.zeros_like(mine) for _ in range(size)] if rank == 1 else None
        dist.gather(mine, lst, dst=1)
        out["gather"] = np.stack(lst) if rank == 1 else None
        out["scatter"] = t = np.zeros_like(mine)
        dist.scatter(t, [_data(seed, 100 + i) for i in range(size)] if rank == 2 else None, src=2)
        out["reduce_scatter"] = t = np.zeros_like(mine)
        dist.reduce_scatter(t, [_data(seed, 10 * rank + i) for i in range(size)], op=dist.ReduceOp.SUM)
        outs = [np.zeros_like(mine) for _ in range(size)]
        dist.all_to_all(outs, [_data(seed, 10 * rank + i) for i in range(size)])
        out["all_to_all"] = np.stack(outs)
        dist.barrier()
        return out

    seed, results = _in_local_group(size, body)
    inputs = [_data(seed, r) for r in range(size)]
    for rank, out in enumerate(results):
        assert np.array_equal(out["broadcast"], inputs[1])
        assert np.array_equal(out["all_reduce"], np.bitwise_xor.reduce(inputs))
        assert np.array_equal(out["reduce"], np.max(inputs, axis=0) if rank == 2 else inputs[rank])
        assert np.array_equal(out["all_gather"], np.stack(inputs))
        assert out["gather"] is None if rank != 1 else np.array_equal(out["gather"], np.stack(inputs))
        assert np.array_equal(out["scatter"], _data(seed, 100 + rank))
        assert np.array_equal(out["reduce_scatter"], sum(_data(seed, 10 * r + rank) for r in range(size)))
        assert np.array_equal(out["all_to_all"], np.stack([_data(seed, 10 * r + rank) for r in range(size)]))


def test_point_to_point_returns_sender_and_work_handles():
    def body(rank, seed):
        if rank == 0:
            got, senders = np.zeros(4), []
            for _ in range(2):
                senders.append(dist.recv(got, src=None, tag=7))
                assert got[0] == senders[-1]
            work = dist.irecv(got, src=2)
            work.wait()
            return sorted(senders), got.tolist()
        dist.send(np.full(4, float(rank)), dst=0, tag=7)
        if rank == 2:
            work = dist.isend(np.arange(4.0), dst=0)
            work.wait()
            assert work.is_completed()
        return None

    _, results = _in_local_group(3, body)
    assert results[0] == ([1, 2], [0.0, 1.0, 2.0, 3.0])


def test_new_group_uses_global_ranks_and_skips_non_members():
    def body(rank, seed):
        group = dist.new_group([3, 1])             # order does not matter: sorted, as in torch
        t = np.array([float(rank)])
        if group is dist.GroupMember.NON_GROUP_MEMBER:
            assert dist.get_rank(group) == -1 and dist.get_world_size(group) == -1
            assert dist.all_reduce(t, group=group) is None  # a non-member's call does nothing
            return None
        dist.broadcast(t, src=3, group=group)      # src is a global rank
        s = np.array([rank])
        dist.all_reduce(s, group=group)
        with pytest.raises(InvalidArgument, match="not in the group"):
            dist.broadcast(t, src=0, group=group)
        return dist.get_rank(group), dist.get_world_size(group), group.ranks, t[0], s[0]

    _, results = _in_local_group(4, body)
    assert results[0] is None and results[2] is None
    assert results[1] == (0, 2, (1, 3), 3.0, 4)
    assert results[3] == (1, 2, (1, 3), 3.0, 4)


def test_async_collectives_return_work():
    def body(rank, seed):
        a = np.full(3, rank + 1.0)
        lst = [np.zeros(3) for _ in range(2)]
        works = [dist.all_reduce(a, op=dist.ReduceOp.PRODUCT, async_op=True),
                 dist.all_gather(lst, np.full(3, float(rank)), async_op=True),
                 dist.barrier(async_op=True)]
        while not all(w.is_completed() for w in works):
            pass
        assert all(w.wait() for w in works)
        return a.tolist(), [x.tolist() for x in lst]

    _, results = _in_local_group(2, body)
    for a, lst in results:
        assert a == [2.0, 2.0, 2.0] and lst == [[0.0] * 3, [1.0] * 3]


def test_buffer_protocol_and_dlpack_tensors_are_reduced_in_place():
    class DLPackOnly:
        """Offers only DLPack, like a PyTorch CPU tensor."""

        def __init__(self, a):
            self.a = a

        def __dlpack__(self, **kwargs):
            return self.a.__dlpack__(**kwargs)

        def __dlpack_device__(self):
            return self.a.__dlpack_device__()

    def body(rank, seed):
        buf = array.array("d", [rank, 2.0 * rank])
        dist.all_reduce(buf)
        tensor = DLPackOnly(np.array([rank + 1, 10], dtype=np.int32))
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return list(buf), tensor.a.tolist()

    _, results = _in_local_group(3, body)
    assert all(r == ([3.0, 6.0], [3, 10]) for r in results)


# -- errors -----------------------------------------------------------------------------------------


def test_errors_name_what_was_expected():
    assert not dist.is_initialized()
    with pytest.raises(CommError, match="not been initialized"):
        dist.all_reduce(np.zeros(2))
    with pytest.raises(InvalidArgument, match="backend must be one of"):
        dist.init_process_group("gloo")
    with pytest.raises(InvalidArgument, match="world_size >= 1"):
        dist.init_process_group("local")
    with pytest.raises(InvalidArgument, match="init_method must be 'env://'"):
        dist.init_process_group("mpi", init_method="tcp://127.0.0.1:23456")

    def body(rank, seed):
        with pytest.raises(CommError, match="already initialized"):
            dist.init_process_group("local", world_size=2, rank=rank)
        with pytest.raises(InvalidArgument, match=r"a list of 2 tensors \(one per rank\), got a list of 1"):
            dist.all_gather([np.zeros(2)], np.zeros(2))
        with pytest.raises(InvalidBuffer, match=r"must have shape \(2,\)"):
            dist.all_gather([np.zeros(2), np.zeros(3)], np.zeros(2))
        with pytest.raises(UnsupportedOp, match="AVG needs a floating-point"):
            dist.all_reduce(np.zeros(2, np.int64), op=dist.ReduceOp.AVG)
        with pytest.raises(InvalidBuffer, match="contiguous"):
            dist.all_reduce(np.zeros(4)[::2])
        with pytest.raises(InvalidBuffer, match="read-only"):
            dist.all_reduce(np.frombuffer(b"\0" * 16))
        return True

    _, results = _in_local_group(2, body)
    assert results == [True, True]


def test_local_rendezvous_rejects_a_rank_twice():
    job = f"local://{uuid.uuid4()}"
    errors = []

    def rank_main(rank):
        dist.init_process_group("local", init_method=job, world_size=2, rank=0)

    t = threading.Thread(target=rank_main, args=(0,))
    t.start()
    t.join()
    with pytest.raises(InvalidArgument, match="rank 0 already joined"):
        try:
            rank_main(0)
        finally:
            errors.append(dist.is_initialized())
    assert errors == [False]
