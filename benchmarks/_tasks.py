"""What runs inside the jobs that ``benchmarks/compare.py`` starts: one task per job.

Each job reads a JSON spec, runs one task and (on rank 0) writes a JSON result.
Tasks under ``mpiexec``:

* ``bench``    -- :func:`commkit.bench.measure` over collectives and sizes,
  repeated in whole sweeps, so every ratio comes with the spread of repeated
  identical runs;
* ``gloo``     -- commkit ``auto``, ``native`` and torch.distributed's gloo
  backend interleaved on the same buffers (torch shares the NumPy memory);
* ``overhead`` -- a tiny allreduce through commkit against the raw mpi4py
  ``Sendrecv`` + ``np.add`` that its schedule performs;
* ``rss``      -- peak resident memory of one 64 MiB allreduce (a fresh job per algorithm).

And one task in a single plain process: ``null``, commkit's per-call Python
cost on a transport that moves nothing.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import socket
import sys
import time

import numpy as np



def main(spec_path: str, result_path: str) -> int:
    """Run the task a spec names; rank 0 (or the only process) writes the result."""
    with open(spec_path) as f:
        spec = json.load(f)
    result = TASKS[spec["task"]](spec)
    if result is not None:
        with open(result_path, "w") as f:
            json.dump(result, f)
    return 0


def _say(comm, text: str) -> None:
    if comm is None or comm.rank == 0:
        print(f"  {text}", file=sys.stderr, flush=True)


# -- how many runs a size gets -------------------------------------------------------------------------


def iterations(size: int, names: int, spec: dict) -> tuple[int, int]:
    """(timed runs, warmup runs) per name: about ``spec['budget']`` seconds per size, within bounds.

    The guess of one call's time is deliberately crude (30 us + 1 ns per byte);
    it only spreads the time budget so that small sizes get many runs and 64 MiB
    gets a few.
    """
    guess = 30e-6 + size * 1e-9
    iters = int(spec["budget"] / (names * guess))
    iters = max(spec["min_iters"], min(spec["max_iters"], iters))
    warmup = max(1, min(spec["warmup"], iters // 4 + 1))
    return iters, warmup


# -- bench -------------------------------------------------------------------------------------------


def _auto_choice(collective, p, size, op):
    from commkit import collectives, selection
    from commkit.ops import get_op

    return selection.select(collective, p, size, get_op(op) if collective in collectives.REDUCING else None).algorithm.name


def bench_task(spec):
    import commkit as ck
    from commkit import bench

    comm = ck.init("mpi")
    p = comm.size
    op, dtype = spec.get("op", "sum"), spec.get("dtype", "float32")
    itemsize = np.dtype(dtype).itemsize
    rows = []
    start = time.time()
    for rep in range(spec["repeats"]):
        for collective in spec["collectives"]:
            names = spec["names"] or (["auto"] + bench.candidates(collective, p, op))
            seen = set()
            for size in spec["sizes"]:
                actual = bench._actual_size(collective, p, size, itemsize)
                if actual in seen or actual == 0:
                    continue  # rounds to a size already measured (or to nothing)
                seen.add(actual)
                iters, warmup = iterations(actual, len(names), spec)
                for row in bench.measure(comm, collective, size, names, dtype=dtype, op=op, iters=iters,
                                         warmup=warmup):
                    record = row.__dict__.copy()
                    record["rep"] = rep
                    record["auto_choice"] = _auto_choice(collective, p, row.size, op)
                    rows.append(record)
            _say(comm, f"{p} ranks, sweep {rep + 1}/{spec['repeats']}: {collective} done "
                       f"({time.time() - start:.0f} s, load {os.getloadavg()[0]:.2f})")
    if comm.rank != 0:
        return None
    return {"rows": rows, "nprocs": p, "oversubscribed": p > (os.cpu_count() or 1),
            "seconds": time.time() - start}


# -- torch.distributed with gloo ---------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_call(dist, case, group):
    """A function running ``case``'s collective through torch.distributed, and one preparing its buffers.

    torch's allreduce, reduce and broadcast work in place, so their preparation
    (untimed, like commkit's poisoning of the output) copies the input into the
    output tensor. Returns None where gloo cannot run the case (uneven blocks).
    """
    import torch

    c, root = case.collective, case.root
    out = torch.from_numpy(case.out.reshape(-1))
    x = torch.from_numpy(case.x.reshape(-1)) if case.x is not None else None
    flat_out, flat_x = case.out.reshape(-1), case.x.reshape(-1)

    def copy_in():
        flat_out[...] = flat_x

    if c == "allreduce":
        return (lambda: dist.all_reduce(out, group=group)), copy_in
    if c == "reduce":
        return (lambda: dist.reduce(out, dst=root, group=group)), copy_in
    if c == "broadcast":
        return (lambda: dist.broadcast(out, src=root, group=group)), (copy_in if case.comm.rank == root else case.poison)
    if c == "allgather":
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return (lambda: gather(out, x, group=group)), case.poison
    if c == "reduce_scatter":
        if len(set(case.counts)) != 1:
            return None
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return (lambda: scatter(out, x, group=group)), case.poison
    if c == "alltoall":
        return (lambda: dist.all_to_all_single(out, x, group=group)), case.poison
    raise AssertionError(c)


def _measure_gloo(comm, dist, group, collective, size, iters, warmup):
    """commkit auto, native and gloo on the same buffers, interleaved as :func:`commkit.bench.measure` does."""
    from commkit import bench

    case = bench._Case(comm, collective, size, "float32", "sum", 0, np)
    gloo = _gloo_call(dist, case, group)
    names = ["auto", "native"] + (["gloo"] if gloo is not None else [])
    has_result = case.expected is not None

    def once(name):
        if name == "gloo":
            call, prepare = gloo
            prepare()
            comm.barrier(algorithm="native")
            t0 = time.perf_counter()
            call()
            t = time.perf_counter() - t0
            return t, (case.out if has_result else None)
        case.poison()
        comm.barrier(algorithm="native")
        t0 = time.perf_counter()
        result = case.run(name)
        return time.perf_counter() - t0, result

    times = np.zeros((len(names), iters))
    wrong = np.zeros(len(names), np.int64)
    for _ in range(warmup):
        for k, name in enumerate(names):
            wrong[k] += not case.correct(once(name)[1])
    for i in range(iters):
        shift = i % len(names)
        for k in list(range(shift, len(names))) + list(range(shift)):
            times[k, i], result = once(names[k])
            wrong[k] += not case.correct(result)
    everyone = comm.allgather_object((times, wrong))
    times = np.max([t for t, _ in everyone], axis=0)
    wrong = np.sum([w for _, w in everyone], axis=0)
    rows = []
    for k, name in enumerate(names):
        t = times[k]
        median = float(np.median(t))
        q25, q75 = np.percentile(t, [25, 75])
        rows.append({"collective": collective, "size": case.size, "algorithm": name, "nprocs": comm.size,
                     "time_us": median * 1e6, "min_us": float(t.min()) * 1e6,
                     "spread": float((q75 - q25) / median) if median else 0.0, "wrong": int(wrong[k]),
                     "runs": iters})
    return rows


def gloo_task(spec):
    import commkit as ck

    comm = ck.init("mpi")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # one core per rank, as the MPI ranks have
    port = comm.broadcast_object(_free_port() if comm.rank == 0 else None)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank, world_size=comm.size)
    rows = []
    start = time.time()
    try:
        group = dist.group.WORLD
        for rep in range(spec["repeats"]):
            for collective in spec["collectives"]:
                seen = set()
                for size in spec["sizes"]:
                    from commkit import bench

                    actual = bench._actual_size(collective, comm.size, size, 4)
                    if actual in seen or actual == 0:
                        continue
                    seen.add(actual)
                    iters, warmup = iterations(actual, 3, spec)
                    for row in _measure_gloo(comm, dist, group, collective, size, iters, warmup):
                        row["rep"] = rep
                        rows.append(row)
                _say(comm, f"gloo, sweep {rep + 1}/{spec['repeats']}: {collective} done "
                           f"({time.time() - start:.0f} s, load {os.getloadavg()[0]:.2f})")
    finally:
        dist.destroy_process_group()
    if comm.rank != 0:
        return None
    return {"rows": rows, "torch": torch.__version__, "seconds": time.time() - start}


# -- fixed overhead ------------------------------------------------------------------------------------


def _per_call(fns, order_names, blocks, calls, barrier, gather):
    """Median seconds per call of each function: ``blocks`` blocks of ``calls`` back-to-back calls.

    The order of the functions rotates every block; a block's time is the
    slowest rank's.
    """
    names = list(order_names)
    times = np.zeros((len(names), blocks))
    clock = time.perf_counter
    for b in range(blocks):
        shift = b % len(names)
        for k in list(range(shift, len(names))) + list(range(shift)):
            fn = fns[names[k]]
            barrier()
            t0 = clock()
            for _ in range(calls):
                fn()
            times[k, b] = (clock() - t0) / calls
    times = gather(times)
    out = {}
    for k, name in enumerate(names):
        t = times[k]
        median = float(np.median(t))
        q25, q75 = np.percentile(t, [25, 75])
        out[name] = {"us": median * 1e6, "min_us": float(t.min()) * 1e6,
                     "spread": float((q75 - q25) / median) if median else 0.0}
    return out


def _overhead_functions(comm, raw, count):
    """The calls the overhead task compares, on fresh buffers of ``count`` float32 each."""
    from mpi4py import MPI

    peer = 1 - comm.rank
    byte, mfloat, add = MPI.BYTE, MPI.FLOAT, np.add
    x = np.random.default_rng([comm.rank, count]).integers(-4, 5, count).astype(np.float32)
    out, tmp = np.empty_like(x), np.empty_like(x)

    def sendrecv_add():
        raw.Sendrecv([x, byte], peer, 7, [tmp, byte], peer, 7)
        add(x, tmp, out=out)

    fns = {
        "commkit auto": lambda: comm.allreduce(x, out=out),
        "mpi4py Sendrecv + np.add": sendrecv_add,
        "commkit native": lambda: comm.allreduce(x, out=out, algorithm="native"),
        "mpi4py Allreduce": lambda: raw.Allreduce([x, mfloat], [out, mfloat], MPI.SUM),
        "mpi4py Sendrecv": lambda: raw.Sendrecv([x, byte], peer, 7, [tmp, byte], peer, 7),
    }
    for fn in fns.values():  # warm up: plans cached, pages touched
        for _ in range(50):
            fn()
    expect = x + np.asarray(comm.allgather(x))[peer]
    assert np.array_equal(comm.allreduce(x), expect), "commkit's allreduce gave a wrong result"
    comm.allreduce(x, out=out)
    return fns, comm.last_algorithm


def overhead_task(spec):
    """commkit's allreduce on 2 ranks against the same exchange and add written directly in mpi4py."""
    from mpi4py import MPI

    import commkit as ck

    comm = ck.init("mpi")
    assert comm.size == 2, "the overhead task compares against a 2-rank exchange"
    raw = MPI.COMM_WORLD.Dup()
    results = []
    for count in spec["counts"]:
        fns, choice = _overhead_functions(comm, raw, count)
        timing = _per_call(fns, fns, spec["blocks"], spec["calls"], raw.Barrier,
                           lambda t: np.max(raw.allgather(t), axis=0))
        results.append({"count": count, "bytes": count * 4, "auto_choice": choice, "timing": timing})
    raw.Free()
    if comm.rank != 0:
        return None
    return {"rows": results}


class _NullPending:
    def test(self):
        return True

    def wait(self, timeout):
        return []


class NullTransport:
    """A transport that moves nothing and returns at once: what remains is commkit's own Python."""

    name = "null"
    supports_any_source = True
    tag_ub = 32767

    def __init__(self, rank=0, size=2):
        self.rank, self.size = rank, size

    def dup(self):
        return self

    def transfer(self, sends, recvs, tag, timeout):
        return []

    def post(self, sends, recvs, tag):
        return _NullPending()

    def free(self):
        pass


def _null_functions(comm, count):
    x = np.arange(count, dtype=np.float32)
    out, tmp = np.empty_like(x), np.empty_like(x)
    add = np.add
    fns = {
        "commkit allreduce (null transport)": lambda: comm.allreduce(x, out=out),
        "np.add alone": lambda: add(x, tmp, out=out),
        "commkit allreduce_ring (null transport)": lambda: comm.allreduce(x, out=out, algorithm="ring"),
    }
    for fn in fns.values():
        for _ in range(100):
            fn()
    comm.allreduce(x, out=out)
    return fns, comm.last_algorithm


def null_task(spec):
    """Per-call time of allreduce with a transport that does nothing, against the np.add it performs."""
    from commkit import Communicator

    comm = Communicator(NullTransport())
    results = []
    for count in spec["counts"]:
        fns, choice = _null_functions(comm, count)
        timing = _per_call(fns, fns, spec["blocks"], spec["calls"], lambda: None, lambda t: t)
        results.append({"count": count, "bytes": count * 4, "auto_choice": choice, "timing": timing})
    return {"rows": results}


# -- memory ------------------------------------------------------------------------------------------


def _status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return None


def rss_task(spec):
    """Peak RSS of ``spec['runs']`` allreduces of ``spec['bytes']`` with one algorithm, in a fresh job."""
    import commkit as ck
    from commkit import algorithms

    comm = ck.init("mpi")
    algorithm = spec["algorithm"]
    count = spec["bytes"] // 4
    # Built in place: a temporary as large as x would raise the peak before the calls and
    # hide the collective's own scratch.
    x = np.arange(count, dtype=np.float32)
    np.remainder(x, 7, out=x)
    x += comm.rank
    out = np.zeros_like(x)  # written now, so its pages are resident before the baseline
    comm.barrier(algorithm="native")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss_before = _status_kib("VmRSS")
    for _ in range(spec["runs"]):
        comm.allreduce(x, out=out, algorithm=None if algorithm == "auto" else algorithm)
    chosen = comm.last_algorithm
    comm.barrier(algorithm="native")
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    head = np.sum(comm.allgather_object(x[:16]), axis=0)
    wrong = int(not np.array_equal(out[:16], head))  # a cheap check that the runs did reduce
    alg = algorithms.get("allreduce", chosen)
    scratch = None if alg.schedule is None else alg.scratch(comm.rank, comm.size, count) * 4
    mine = {"rank": comm.rank, "maxrss_before_kib": before, "maxrss_after_kib": after, "rss_before_kib": rss_before,
            "rss_shmem_kib": _status_kib("RssShmem"), "rss_anon_kib": _status_kib("RssAnon"),
            "declared_scratch_bytes": scratch, "wrong": wrong}
    everyone = comm.gather_object(mine)
    if comm.rank != 0:
        return None
    return {"algorithm": algorithm, "chosen": chosen, "bytes": spec["bytes"], "nprocs": comm.size,
            "ranks": everyone}


# -- where it ran --------------------------------------------------------------------------------------


def machine_task(spec):
    """The machine, libraries and versions (one plain process, no MPI job)."""
    info = {"python": platform.python_version(), "platform": platform.platform(), "cores": os.cpu_count(),
            "hostname": socket.gethostname()}
    try:
        with open("/proc/cpuinfo") as f:
            models = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        info["cpu"] = models[0] if models else platform.processor()
    except OSError:
        info["cpu"] = platform.processor() or "unknown"
    try:
        with open("/proc/meminfo") as f:
            info["memory_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    import mpi4py

    import commkit

    info["commkit"] = commkit.__version__
    info["numpy"] = np.__version__
    info["mpi4py"] = mpi4py.__version__
    from mpi4py import MPI

    lines = [line.strip() for line in MPI.Get_library_version().splitlines() if line.strip()]
    info["mpi_library"] = lines[0] if lines else "unknown"
    info["mpi_details"] = [line for line in lines if line.split(":")[0] in ("MPICH Device", "MPICH configure",
                                                                             "MPICH Release date")]
    try:
        import torch

        info["torch"] = torch.__version__
    except ImportError:
        info["torch"] = None
    return info


TASKS = {"bench": bench_task, "gloo": gloo_task, "overhead": overhead_task, "null": null_task, "rss": rss_task,
         "machine": machine_task}
