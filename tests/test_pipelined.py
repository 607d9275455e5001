"""The pipelined (segmented) ring allreduce: results, overlap safety, cost formula, and a real MPI run."""

from __future__ import annotations

import numpy as np
import pytest

import commkit as ck
from commkit import algorithms, sim, testing
from commkit.algorithms import pipelined
from commkit.schedule import Transfer, check_overlap

SEGMENTS = ("1", "3", "7", None)  # None: the module default (one segment per block at test sizes)


@pytest.fixture(params=SEGMENTS, ids=lambda s: f"segment={s or 'default'}")
def segment(request, monkeypatch):
    if request.param is None:
        monkeypatch.delenv(pipelined.ENV_SEGMENT, raising=False)
    else:
        monkeypatch.setenv(pipelined.ENV_SEGMENT, request.param)
    return request.param


def test_check_algorithm_passes(segment):
    report = testing.check_algorithm("allreduce", "ring_pipelined", max_procs=6, sim_procs=24)
    report.raise_if_failed()
    assert report.ok


def test_module_default_is_used_without_the_variable(monkeypatch):
    monkeypatch.delenv(pipelined.ENV_SEGMENT, raising=False)
    monkeypatch.setattr(pipelined, "SEGMENT", 2)
    assert pipelined.segment_count(40, 4) == 5
    testing.check_algorithm("allreduce", "ring_pipelined", max_procs=4, sim_procs=8, raise_on_failure=True)


def test_bad_segment_variable_is_rejected(monkeypatch):
    monkeypatch.setenv(pipelined.ENV_SEGMENT, "0")
    with pytest.raises(ck.InvalidArgument, match="COMMKIT_SEGMENT_ELEMENTS"):
        list(pipelined.allreduce_ring_pipelined(0, 2, 8, ck.SUM))


@pytest.mark.parametrize("seg", ["1", "2", "3", "7", "64"])
def test_overlapped_steps_never_race(seg, monkeypatch):
    monkeypatch.setenv(pipelined.ENV_SEGMENT, seg)
    overlapped = 0
    for p in range(1, 17):
        for count in sorted({0, 1, p - 1, p, p + 1, 2 * p + 3, 7 * p, 7 * p + 5, 64 * p + 1}):
            for rank in range(p):
                for step in pipelined.allreduce_ring_pipelined(rank, p, count, ck.SUM):
                    if isinstance(step, Transfer):
                        assert not check_overlap(step), (p, count, rank, step)
                        assert all(hi > lo for _, (_, lo, hi) in step.sends + step.recvs), "zero-length message"
                        overlapped += bool(step.overlap)
    assert overlapped  # the pipelining really happens


def test_segments_overlap_the_reduction_in_the_simulator(monkeypatch):
    # Reduction-bound model: with K >= 2 segments the reduction hides behind the transfers, so the
    # pipelined ring beats the plain ring; K = 1 is the plain ring exactly.
    p, count = 4, 4 * 64
    model = {"itemsize": 4, "alpha": 1e-9, "beta": 1e-9, "gamma": 1e-8}
    ring = sim.simulate("allreduce", "ring", p, count=count, **model)
    monkeypatch.setenv(pipelined.ENV_SEGMENT, "1000")
    one = sim.simulate("allreduce", "ring_pipelined", p, count=count, **model)
    assert one.time == pytest.approx(ring.time) and one.messages == ring.messages
    monkeypatch.setenv(pipelined.ENV_SEGMENT, "16")
    four = sim.simulate("allreduce", "ring_pipelined", p, count=count, **model)
    assert four.ok and four.messages == [2 * (p - 1) * 4] * p and four.time < ring.time
    assert four.time == pytest.approx(algorithms.get("allreduce", "ring_pipelined").cost(p, 4 * count, 1e-9, 1e-9,
                                                                                          1e-8))


def test_threads_world_large_vector(monkeypatch):
    monkeypatch.setenv(pipelined.ENV_SEGMENT, "1000")
    n = 3 * 10_007

    def body(comm):
        x = np.arange(n, dtype=np.float64) * (comm.rank + 1)
        return comm.allreduce(x, algorithm="ring_pipelined")

    for p in (2, 3):
        for out in ck.run_local(body, p):
            np.testing.assert_allclose(out, np.arange(n, dtype=np.float64) * (p * (p + 1) // 2))


MPI_CODE = """
import sys
import numpy as np
import commkit as ck

comm = ck.init(timeout=60)
p, r = comm.size, comm.rank
for n in (0, 1, p - 1, p + 1, 1000, 65_537, 300_001):
    rng = np.random.default_rng([n, r])
    x = rng.integers(-100, 100, n).astype(np.float64)
    want = sum(np.random.default_rng([n, q]).integers(-100, 100, n).astype(np.float64) for q in range(p))
    got = comm.allreduce(x, algorithm="ring_pipelined")
    assert np.array_equal(got, want), (n, r)
    inplace = x.copy()
    comm.allreduce(inplace, out=inplace, algorithm="ring_pipelined")
    assert np.array_equal(inplace, want), (n, r, "in place")
print("ok", r)
"""


@pytest.mark.parametrize("nprocs", [2, 3])
@pytest.mark.parametrize("seg", ["7", "4096"])
def test_under_mpiexec(mpi, nprocs, seg):
    result = mpi(nprocs, MPI_CODE, env={pipelined.ENV_SEGMENT: seg})
    assert result.stdout.count("ok") == nprocs
