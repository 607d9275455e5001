"""GPU support: CuPy arrays on the threads world, the MPI transport and NCCL.

Two kinds of tests live here:

* CPU tests, which run everywhere: ``import commkit`` never imports CuPy,
  ``init("nccl")`` without CuPy says how to install it, and the pure functions
  behind the NCCL transport (device choice, dtype and op mapping, CUDA-aware
  MPI detection).
* GPU tests, marked ``gpu``: they run where CuPy sees a CUDA GPU and skip with
  the reason everywhere else. ``scripts/gpu_suite.sh`` runs them all.

Results are always compared with NumPy references built from the same
inputs (``contracts.py``), on host copies of the device results.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import commkit as ck
from commkit.collectives import FIXED
from commkit.transports import _cuda
from commkit.transports.nccl import choose_device, nccl_reduction, nccl_supports

from contracts import REDUCING, ROOTED, applicable_algorithms, assert_matches, collective_input, expected

GPU_OK, GPU_WHY = _cuda.gpu_status()
NCCL_OK, NCCL_WHY = _cuda.nccl_status() if GPU_OK else (False, GPU_WHY)
GPUS = 0
if GPU_OK:
    import cupy

    GPUS = cupy.cuda.runtime.getDeviceCount()

MULTI_OK = NCCL_OK and GPUS >= 2
MULTI_WHY = NCCL_WHY if not NCCL_OK else f"needs 2 or more CUDA GPUs for NCCL across processes (found {GPUS})"

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DTYPES = ("float32", "int64", "bool", "complex64", "float16", "int16", "uint8", "float64")


# -- CPU: import hygiene and the pure functions --------------------------------------------------------------


def _python(code: str, env=None, timeout=120):
    full = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, HERE, os.environ.get("PYTHONPATH", "")]))
    full.update(env or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=full)


def test_importing_commkit_never_imports_cupy():
    result = _python("""
        import importlib, pkgutil, sys
        import commkit
        for info in pkgutil.walk_packages(commkit.__path__, "commkit."):
            try:
                importlib.import_module(info.name)
            except Exception:  # an optional dependency (mpi4py, matplotlib) missing or broken here
                pass
        loaded = sorted(m for m in sys.modules if m == "cupy" or m.startswith("cupy."))
        print("LOADED", loaded)
    """)
    assert result.returncode == 0, result.stderr
    assert "LOADED []" in result.stdout, result.stdout


def test_init_nccl_without_cupy_says_how_to_install(monkeypatch):
    from commkit.transports import nccl

    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` now raises ImportError
    monkeypatch.setattr(nccl, "cupy", None)
    monkeypatch.setattr(nccl, "nccl", None)
    with pytest.raises(ck.TransportUnavailable, match=r"nccl transport need CuPy.*pip install 'commkit\[gpu\]'"):
        ck.init("nccl")


def test_init_nccl_in_a_fresh_process_without_cupy():
    result = _python("""
        import sys
        sys.modules["cupy"] = None
        import commkit as ck
        try:
            ck.init("nccl")
        except ck.TransportUnavailable as exc:
            print("UNAVAILABLE", exc)
    """)
    assert result.returncode == 0, result.stderr
    assert "UNAVAILABLE" in result.stdout and "commkit[gpu]" in result.stdout


def test_gpu_status_gives_a_reason():
    ok, why = _cuda.gpu_status()
    assert isinstance(ok, bool) and why
    if not ok:
        assert why.startswith("needs CuPy and a CUDA GPU")


@pytest.mark.parametrize("local_rank, local_size, count, requested, want", [
    (0, 1, 1, None, 0),
    (3, 4, 4, None, 3),
    (5, 8, 1, None, 0),     # one visible GPU per process (CUDA_VISIBLE_DEVICES set per rank)
    (1, 2, 8, None, 1),
    (0, 2, 4, 3, 3),        # an explicit device wins
])
def test_choose_device(local_rank, local_size, count, requested, want):
    assert choose_device(local_rank, local_size, count, requested) == want


def test_choose_device_refuses_what_nccl_cannot_do():
    with pytest.raises(ck.TransportUnavailable, match="none is visible"):
        choose_device(0, 1, 0)
    with pytest.raises(ck.TransportUnavailable, match="3 ranks run on this machine but only 2 GPUs"):
        choose_device(2, 3, 2)
    with pytest.raises(ck.InvalidArgument, match=r"range\(0, 2\)"):
        choose_device(0, 1, 2, requested=2)
    with pytest.raises(ck.InvalidArgument):
        choose_device(0, 1, 2, requested=True)


@pytest.mark.parametrize("dtype, op, want", [
    ("float32", "sum", ("float32", "sum", "float32")),
    ("int8", "prod", ("int8", "prod", "int8")),
    ("uint64", "max", ("uint64", "max", "uint64")),
    ("int32", "min", ("int32", "min", "int32")),
    ("float16", "sum", ("float16", "sum", "float16")),
    ("bool", "lor", ("uint8", "max", "uint8")),
    ("bool", "sum", ("uint8", "max", "uint8")),    # NumPy's bool + bool is logical or
    ("bool", "land", ("uint8", "min", "uint8")),
    ("bool", "prod", ("uint8", "min", "uint8")),
    ("complex64", "sum", ("float32", "sum", "float32")),
    ("complex128", "sum", ("float64", "sum", "float64")),
    ("complex64", "prod", None),                    # (a+bi)(c+di) is not elementwise on the parts
    ("float32", "max", None),                       # NaN propagation is not promised by NCCL
    ("int16", "sum", None),                         # NCCL has no 16-bit integers
    ("uint16", "max", None),
    ("int32", "band", None),                        # nor bitwise or logical ops
    ("int64", "lxor", None),
    ("bool", "lxor", None),
    (">i4", "sum", None),                           # byte-swapped data
])
def test_nccl_reduction_mapping(dtype, op, want):
    got = nccl_reduction(np.dtype(dtype), op)
    if want is None:
        assert got is None
    else:
        assert (got[0], got[1], got[2].name) == want


def test_nccl_supports_by_collective():
    f32, i16 = np.dtype("float32"), np.dtype("int16")
    assert nccl_supports("barrier", None, None)
    for coll in ("broadcast", "allgather", "gather", "scatter", "alltoall"):
        assert nccl_supports(coll, i16, None)  # bytes move whatever the dtype
    assert nccl_supports("allreduce", f32, ck.SUM) and nccl_supports("reduce_scatter", f32, ck.PROD)
    assert not nccl_supports("allreduce", i16, ck.SUM)
    assert not nccl_supports("scan", f32, ck.SUM) and not nccl_supports("exscan", f32, ck.SUM)
    assert not nccl_supports("allreduce", f32, ck.Op(np.subtract, True, name="sum"))  # the name, not the function
    assert not nccl_supports("allreduce", f32, ck.Op(lambda a, b: a + b, True, name="mine"))


def test_cuda_aware_detection(monkeypatch):
    assert _cuda.kinds_allow_cuda("mpi,system,cuda:device")
    assert _cuda.kinds_allow_cuda("cuda")
    assert not _cuda.kinds_allow_cuda("mpi,system,cuda:host")
    assert not _cuda.kinds_allow_cuda("mpi,system,rocm:device") and not _cuda.kinds_allow_cuda(None)
    monkeypatch.setenv("COMMKIT_MPI_CUDA_AWARE", "1")
    assert _cuda.mpi_cuda_aware() is True
    monkeypatch.setenv("COMMKIT_MPI_CUDA_AWARE", "0")
    assert _cuda.mpi_cuda_aware() is False


def test_is_device_array_looks_for_the_cuda_interface():
    assert not _cuda.is_device_array(np.zeros(3))
    assert not _cuda.is_device_array(None)


# -- GPU helpers -------------------------------------------------------------------------------------------------


def gpu_case(collective, size, dtype, seed):
    """A collective call on ``size`` ranks: ``(2p + 1,)`` elements, uneven reduce_scatter counts, a moving root."""
    case = {"collective": collective, "seed": seed, "dtype": dtype, "shape": [2 * size + 1]}
    if collective in REDUCING:
        case["op"] = "lor" if dtype == "bool" else ("prod" if seed % 3 == 0 and dtype != "float16" else "sum")
    if collective == "reduce_scatter":
        case["shape"] = []
        case["counts"] = [(seed + r) % 3 for r in range(size)]
    if collective in ROOTED:
        case["root"] = seed % size
    return case


def run_gpu_case(comm, case, algorithm=None):
    """Run ``case`` with CuPy arrays; check the result is a CuPy array on this GPU; return it on the host."""
    import cupy

    coll, r, root = case["collective"], comm.rank, case.get("root", 0)
    x = cupy.asarray(collective_input(case, r, comm.size))
    op = case.get("op")
    kw = {"algorithm": algorithm}
    if coll == "barrier":
        result = comm.barrier(**kw)
    elif coll == "broadcast":
        result = comm.broadcast(x, root, **kw)
    elif coll in ("allreduce", "scan", "exscan"):
        result = getattr(comm, coll)(x, op, **kw)
    elif coll == "reduce":
        result = comm.reduce(x, op, root, **kw)
    elif coll == "gather":
        result = comm.gather(x, root, **kw)
    elif coll == "allgather":
        result = comm.allgather(x, **kw)
    elif coll == "scatter":
        out = cupy.empty(tuple(case["shape"]), np.dtype(case["dtype"]))
        result = comm.scatter(x if r == root else None, root, out=out, **kw)
    elif coll == "alltoall":
        result = comm.alltoall(x, **kw)
    else:
        result = comm.reduce_scatter(x, op, counts=case["counts"], **kw)
    if result is None:
        return None
    assert isinstance(result, cupy.ndarray), f"{coll} returned a {type(result).__name__}, not a CuPy array"
    assert result.device.id == cupy.cuda.runtime.getDevice()
    return cupy.asnumpy(result)


def check_gpu_case(comm, case, algorithm=None):
    got = run_gpu_case(comm, case, algorithm)
    assert_matches(dict(case, _rank=comm.rank), got, expected(case, comm.rank, comm.size), comm.size)


def names_for(comm, case):
    """Every applicable algorithm for ``case`` on ``comm``, plus ``native`` where the transport runs it."""
    coll = case["collective"]
    op = ck.ops.get_op(case["op"]) if "op" in case else None
    names = applicable_algorithms(coll, comm.size, case.get("op", "sum"))
    if hasattr(comm._coll, "native_supports") and comm._coll.native_supports(coll, np.dtype(case["dtype"]), op):
        names.append("native")
    return names


# -- GPU: the threads world on one GPU ----------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not GPU_OK, reason=GPU_WHY)
@pytest.mark.parametrize("size", range(1, 9))
@pytest.mark.parametrize("collective", FIXED)
def test_threads_world_on_one_gpu_matches_numpy(collective, size):
    dtypes = [DTYPES[size % len(DTYPES)], DTYPES[(size + 3) % len(DTYPES)]]

    def body(comm):
        for seed, dtype in enumerate(dtypes):
            case = gpu_case(collective, size, dtype, seed + size)
            for name in applicable_algorithms(collective, size, case.get("op", "sum")):
                check_gpu_case(comm, case, name)
        return True

    assert ck.run_local(body, size, timeout=120) == [True] * size


@pytest.mark.gpu
@pytest.mark.skipif(not GPU_OK, reason=GPU_WHY)
def test_threads_world_point_to_point_and_nonblocking_on_gpu():
    import cupy

    def body(comm):
        p, r = comm.size, comm.rank
        mine = cupy.arange(5, dtype=cupy.float64) + 10 * r
        got = comm.sendrecv(mine, (r + 1) % p, (r - 1) % p)
        assert isinstance(got, cupy.ndarray)
        np.testing.assert_array_equal(cupy.asnumpy(got), np.arange(5) + 10 * ((r - 1) % p))
        req = comm.iallreduce(mine)
        total = req.wait()
        np.testing.assert_array_equal(cupy.asnumpy(total), p * np.arange(5) + 10 * sum(range(p)))
        return True

    assert ck.run_local(body, 4, timeout=120) == [True] * 4


# -- GPU: NCCL with one rank (in this process) --------------------------------------------------------------------


@pytest.fixture(scope="module")
def nccl_comm():
    if not NCCL_OK:
        pytest.skip(NCCL_WHY)
    comm = ck.init("nccl", bootstrap="store", rank=0, size=1)
    try:
        yield comm
    finally:
        comm.free()


@pytest.mark.gpu
@pytest.mark.parametrize("collective", FIXED)
def test_nccl_one_rank_every_algorithm_and_native(nccl_comm, collective):
    assert nccl_comm.transport_name == "nccl" and nccl_comm.size == 1
    for seed, dtype in enumerate(DTYPES):
        case = gpu_case(collective, 1, dtype, seed)
        for name in names_for(nccl_comm, case):
            check_gpu_case(nccl_comm, case, name)
            assert nccl_comm.last_algorithm == name


@pytest.mark.gpu
def test_nccl_native_refuses_what_nccl_cannot_reduce(nccl_comm):
    import cupy

    x = cupy.arange(4, dtype=cupy.int16)
    with pytest.raises(ck.AlgorithmNotApplicable, match="native"):
        nccl_comm.allreduce(x, algorithm="native")
    with pytest.raises(ck.AlgorithmNotApplicable):
        nccl_comm.scan(cupy.arange(4, dtype=cupy.float32), algorithm="native")
    # ... while the schedules reduce them with CuPy ufuncs.
    np.testing.assert_array_equal(cupy.asnumpy(nccl_comm.allreduce(x, algorithm="ring")), np.arange(4))


@pytest.mark.gpu
def test_nccl_point_to_point_and_objects_to_self(nccl_comm):
    import cupy

    x = cupy.arange(6, dtype=cupy.complex64) * (1 + 2j)
    out = cupy.empty_like(x)
    reqs = [nccl_comm.irecv(0, 3, out=out), nccl_comm.isend(x, 0, 3)]
    ck.wait_all(reqs)
    np.testing.assert_array_equal(cupy.asnumpy(out), cupy.asnumpy(x))
    assert reqs[0].status.source == 0 and reqs[0].status.nbytes == x.nbytes
    got = nccl_comm.sendrecv(x[:2], 0, 0)
    assert isinstance(got, cupy.ndarray)
    np.testing.assert_array_equal(cupy.asnumpy(got), cupy.asnumpy(x[:2]))
    req = nccl_comm.isend(x[:3], 0, 4)
    fresh = nccl_comm.recv(0, 4, shape=3, dtype=x.dtype)  # allocated on the GPU by the communicator
    req.wait()
    assert isinstance(fresh, cupy.ndarray)
    np.testing.assert_array_equal(cupy.asnumpy(fresh), cupy.asnumpy(x[:3]))
    nccl_comm.send_object({"a": [1, 2]}, 0, tag=5)
    assert nccl_comm.recv_object(0, 5) == {"a": [1, 2]}


@pytest.mark.gpu
def test_nccl_refuses_host_arrays_and_wildcards(nccl_comm):
    import cupy

    with pytest.raises(ck.InvalidBuffer, match="cupy.asarray"):
        nccl_comm.allreduce(np.arange(3.0), algorithm="native")
    with pytest.raises(ck.InvalidBuffer, match="cupy.asarray"):
        nccl_comm.isend(np.arange(3.0), 0)
    with pytest.raises(ck.InvalidArgument, match="ANY_SOURCE"):
        nccl_comm.irecv(ck.ANY_SOURCE, out=cupy.empty(3))


def _spin_kernel():
    """A kernel that busy-waits on the GPU clock, then writes ``value``: a slow producer on a stream."""
    import cupy

    return cupy.RawKernel(r"""
    extern "C" __global__ void spin_then_fill(float* x, int n, float value, long long cycles) {
        long long start = clock64();
        while (clock64() - start < cycles) { }
        for (int i = threadIdx.x; i < n; i += blockDim.x) x[i] = value;
    }
    """, "spin_then_fill")


@pytest.mark.gpu
@pytest.mark.parametrize("algorithm", ["native", "ring", "recursive_doubling"])
def test_nccl_work_is_ordered_on_the_current_stream(nccl_comm, algorithm):
    """A collective on a non-blocking stream sees what a slow kernel earlier on that stream wrote.

    If the transport used any other stream without ordering, it would read the
    zeros that were there before the kernel finished.
    """
    import cupy

    spin = _spin_kernel()
    n = 1 << 16
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        x = cupy.zeros(n, dtype=cupy.float32)
        stream.synchronize()
        spin((1,), (256,), (x, np.int32(n), np.float32(7.0), np.int64(200_000_000)))
        y = nccl_comm.allreduce(x, algorithm=algorithm)
        z = y * 2  # a consumer on the same stream, enqueued before the host waits for anything
        stream.synchronize()
    np.testing.assert_array_equal(cupy.asnumpy(z), np.full(n, 14.0, np.float32))


@pytest.mark.gpu
def test_nccl_wait_makes_the_result_ready_on_the_waiting_stream(nccl_comm):
    """A nonblocking native collective started on stream A and waited for on stream B is ready on B."""
    import cupy

    spin = _spin_kernel()
    n = 1 << 16
    a, b = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    with a:
        x = cupy.zeros(n, dtype=cupy.float32)
        a.synchronize()
        spin((1,), (256,), (x, np.int32(n), np.float32(3.0), np.int64(200_000_000)))
        req = nccl_comm.iallreduce(x, algorithm="native")
    with b:
        y = req.wait()
        z = y + 1
        b.synchronize()
    np.testing.assert_array_equal(cupy.asnumpy(z), np.full(n, 4.0, np.float32))


@pytest.mark.gpu
def test_nccl_with_a_timeout_waits_on_the_host(nccl_comm):
    import cupy

    x = cupy.arange(10, dtype=cupy.float32)
    for name in ("ring", "native"):
        y = nccl_comm.allreduce(x, algorithm=name, timeout=60)
        np.testing.assert_array_equal(cupy.asnumpy(y), np.arange(10, dtype=np.float32))
    nccl_comm.barrier(algorithm="native")
    nccl_comm.barrier()


@pytest.mark.gpu
def test_nccl_dup_split_and_free(nccl_comm):
    import cupy

    dup = nccl_comm.dup()
    sub = nccl_comm.split(0)
    assert nccl_comm.split(None) is None
    x = cupy.arange(3, dtype=cupy.int32)
    for c in (dup, sub):
        assert c.transport_name == "nccl"
        np.testing.assert_array_equal(cupy.asnumpy(c.allreduce(x)), [0, 1, 2])
        c.free()
    with pytest.raises(ck.CommClosed):
        dup.allreduce(x)


@pytest.mark.gpu
@pytest.mark.skipif(not NCCL_OK, reason=NCCL_WHY)
def test_nccl_abort_leaves_every_communicator_unusable():
    import cupy

    comm = ck.init("nccl", bootstrap="store", rank=0, size=1)
    try:
        comm.allreduce(cupy.ones(4), algorithm="native")
        comm.abort(RuntimeError("test abort"))
        with pytest.raises(ck.PeerFailed, match="aborted.*test abort"):
            comm.allreduce(cupy.ones(4), algorithm="native")
        with pytest.raises(ck.PeerFailed, match="aborted"):
            comm.dup()
    finally:
        comm.free()


@pytest.mark.gpu
def test_nccl_transport_steps_go_through_nccl_groups(nccl_comm):
    """Transfer steps straight on the transport: a send to and a receive from this rank in one NCCL group."""
    import cupy

    t = nccl_comm._coll
    a = cupy.arange(1000, dtype=cupy.float32) * 0.5
    b = cupy.zeros_like(a)
    assert t.transfer([(0, a)], [(0, b)], 0, None) == []
    np.testing.assert_array_equal(cupy.asnumpy(b), cupy.asnumpy(a))
    c = cupy.zeros(10, dtype=cupy.complex128)
    pending = t.post([(0, a[:40].view(cupy.complex128))], [(0, c)], 1)
    assert pending.test() and pending.wait(60) == []
    np.testing.assert_array_equal(cupy.asnumpy(c), cupy.asnumpy(a[:40].view(cupy.complex128)))
    # Empty messages travel as one token byte; a timeout makes the host wait for the GPU.
    assert t.transfer([(0, a[:0])], [(0, b[:0])], 2, 60) == []
    assert t.transfer([(0, a[:3])], [(0, b[5:8])], 3, 60) == []
    np.testing.assert_array_equal(cupy.asnumpy(b[5:8]), [0.0, 0.5, 1.0])


def _run_nccl_script(code: str):
    env = {"COMMKIT_NCCL_BOOTSTRAP": "store", "COMMKIT_SIZE": "1", "COMMKIT_RANK": "0"}
    return _python(code, env=env, timeout=300)


@pytest.mark.gpu
@pytest.mark.skipif(not NCCL_OK, reason=NCCL_WHY)
def test_nccl_process_that_raises_exits_instead_of_hanging():
    result = _run_nccl_script("""
        import cupy, commkit as ck
        comm = ck.init("nccl")
        comm.allreduce(cupy.ones(1 << 20), algorithm="native")
        raise RuntimeError("planted failure")
    """)
    assert result.returncode != 0
    assert "planted failure" in result.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not NCCL_OK, reason=NCCL_WHY)
def test_nccl_process_that_never_frees_exits_cleanly():
    result = _run_nccl_script("""
        import cupy, commkit as ck
        comm = ck.init("nccl")
        sub = comm.dup()
        y = sub.allreduce(cupy.arange(8), algorithm="native")
        print("SUM", int(y.sum()))
    """)
    assert result.returncode == 0, result.stderr
    assert "SUM 28" in result.stdout


@pytest.mark.gpu
def test_bench_runs_on_nccl(nccl_comm):
    from commkit import bench

    rows = bench.run(nccl_comm, ["allreduce", "allgather"], [4096], iters=2, warmup=1, gpu=True)
    assert {row.algorithm for row in rows} >= {"native", "ring"}
    assert all(row.wrong == 0 for row in rows)


# -- GPU: staging device buffers for the MPI transport --------------------------------------------------------------


class _Loopback:
    """A host 'network' for :func:`_cuda.stage`: each send lands in the receive at the same index."""

    def __init__(self, sends, recvs):
        for (_, s), (_, r) in zip(sends, recvs):
            r[: s.nbytes] = s.view(np.uint8)
        self.status = ck.Status(0, 0, sum(s.nbytes for _, s in sends)) if len(recvs) == 1 else None

    def test(self):
        return True

    def wait(self, timeout):
        return []


@pytest.mark.gpu
@pytest.mark.skipif(not GPU_OK, reason=GPU_WHY)
def test_staging_copies_device_bytes_through_the_host():
    import cupy

    src = cupy.arange(7, dtype=cupy.float64) * 1.5
    dst = cupy.full(10, -1.0)  # larger than the message: the tail must stay as it was
    pending = _cuda.stage(_Loopback, [(1, src)], [(1, dst)], cuda_aware=False)
    assert pending.wait(None) == []
    np.testing.assert_array_equal(cupy.asnumpy(dst[:7]), np.arange(7) * 1.5)
    np.testing.assert_array_equal(cupy.asnumpy(dst[7:]), [-1.0] * 3)
    seen = []
    _cuda.stage(lambda s, r: seen.append((s, r)) or _Loopback([], []), [(0, src)], [], cuda_aware=True)
    assert seen[0][0][0][1] is src  # CUDA-aware: the device buffer itself goes to MPI


def _mpi_patched() -> bool:
    try:
        from commkit.transports import mpi
    except Exception:  # noqa: BLE001 - no mpi4py
        return False
    return getattr(mpi, "_cuda", None) is not None


MPI_GPU_CODE = """
import numpy as np, cupy, commkit as ck
from commkit.collectives import FIXED
from test_gpu import gpu_case, check_gpu_case, names_for
comm = ck.init("mpi")
for seed, collective in enumerate(FIXED):
    for dtype in ("float32", "bool", "complex128", "int16"):
        case = gpu_case(collective, comm.size, dtype, seed)
        for name in names_for(comm, case):
            check_gpu_case(comm, case, name)
p, r = comm.size, comm.rank
x = cupy.arange(4, dtype=cupy.int32) + r
got = comm.sendrecv(x, (r + 1) % p, (r - 1) % p)
assert isinstance(got, cupy.ndarray) and cupy.asnumpy(got).tolist() == [((r - 1) % p) + i for i in range(4)]
"""


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.skipif(not GPU_OK or not _mpi_patched(), reason=GPU_WHY if not GPU_OK else
                    "needs the CuPy staging in commkit/transports/mpi.py (issue 7)")
def test_mpi_transport_moves_cupy_arrays_through_host_memory(mpi):
    """Three ranks on one GPU; the MPI library is treated as not CUDA-aware, so every buffer is staged."""
    mpi(3, MPI_GPU_CODE, timeout=600, env={"COMMKIT_MPI_CUDA_AWARE": "0"})


# -- GPU: NCCL across processes, one GPU each ------------------------------------------------------------------------

NCCL_JOB = """
import numpy as np, cupy, commkit as ck
from commkit.collectives import FIXED
from test_gpu import gpu_case, check_gpu_case, names_for
comm = ck.init("nccl")
assert comm.transport_name == "nccl"
assert cupy.cuda.runtime.getDevice() == comm._base.device
for seed, collective in enumerate(FIXED):
    for dtype in ("float32", "bool", "complex64", "int16", "float16", "int64"):
        case = gpu_case(collective, comm.size, dtype, seed)
        for name in names_for(comm, case):
            check_gpu_case(comm, case, name)
p, r = comm.size, comm.rank
# A ring exchange in both directions at once, then a blocking pair in a safe order.
x = cupy.arange(5, dtype=cupy.float64) + 100 * r
got = comm.sendrecv(x, (r + 1) % p, (r - 1) % p)
np.testing.assert_array_equal(cupy.asnumpy(got), np.arange(5) + 100 * ((r - 1) % p))
reqs = [comm.irecv((r + 1) % p, out=cupy.empty(5)), comm.isend(x, (r - 1) % p)]
back = ck.wait_all(reqs)[0]
np.testing.assert_array_equal(cupy.asnumpy(back), np.arange(5) + 100 * ((r + 1) % p))
assert comm.allgather_object(r) == list(range(p))
sub = comm.split(r % 2, key=-r)
y = sub.allreduce(cupy.ones(3, dtype=cupy.int32) * r)
assert cupy.asnumpy(y).tolist() == [sum(q for q in range(p) if q % 2 == r % 2)] * 3
sub.free()
comm.barrier(algorithm="native")
bootstrap = type(comm._base._group).__name__
comm.free()
print("RANK", r, "OK", bootstrap)
"""


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.skipif(not NCCL_OK, reason=NCCL_WHY)
def test_nccl_every_gpu_under_mpiexec(mpi):
    """One rank per visible GPU, the unique id shared over MPI (with one GPU: the MPI bootstrap alone)."""
    result = mpi(GPUS, NCCL_JOB, timeout=900)
    assert result.stdout.count("OK _MPIGroup") == GPUS, result.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not MULTI_OK, reason=MULTI_WHY)
def test_nccl_every_gpu_through_the_tcp_store():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, HERE, os.environ.get("PYTHONPATH", "")]),
               COMMKIT_NCCL_BOOTSTRAP="store", COMMKIT_SIZE=str(GPUS), COMMKIT_STORE_PORT=str(port))
    procs = [subprocess.Popen([sys.executable, "-c", NCCL_JOB], env=dict(env, COMMKIT_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(GPUS)]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=900)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert all(proc.returncode == 0 for proc in procs), "\n".join(outputs)
    assert sum(out.count("OK StoreGroup") for out in outputs) == GPUS
