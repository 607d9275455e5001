"""What runs inside the jobs that ``benchmarks/compare.py`` starts: one task per job.

Each job reads a JSON spec, runs one task and (on rank 0) writes a JSON result.
Tasks under ``mpiexec``:

* ``bench``    -- :func:`measure_forms` over collectives and sizes, repeated
  in whole sweeps (new input data every sweep), so every ratio comes with the
  spread of repeated identical runs. With ``spec["raw"]``: the raw mpi4py call
  on a ``Dup`` of COMM_WORLD, commkit ``auto`` and commkit ``native``, each out
  of place and, where the collective allows it, in place; without: every
  commkit algorithm with ``auto`` and ``native``;
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
    """Every form of :func:`forms_task` (``spec["raw"]``), or every commkit algorithm with auto and native."""
    return forms_task(spec)


# -- forms: the raw mpi4py call and commkit's, out of place and in place ------------------------------

IN_PLACE = " in place"


def in_place_allowed(collective: str) -> bool:
    """Whether commkit takes ``out=x`` for ``collective`` (read from :mod:`commkit.collectives`)."""
    from commkit import collectives

    return collectives.get(collective).in_place


def form_names(collective: str, bases) -> list[str]:
    """``bases`` ("raw", "auto", "native" or an algorithm), each followed by its in-place form where allowed.

    The raw broadcast has one form: ``MPI_Bcast`` is in place (the root's buffer is
    the one sent), so ``raw`` is the baseline of both of commkit's broadcast forms.
    """
    names = []
    for base in bases:
        names.append(base)
        if in_place_allowed(collective) and not (base == "raw" and collective == "broadcast"):
            names.append(base + IN_PLACE)
    return names


def raw_baseline(collective: str, name: str) -> str:
    """The raw mpi4py form a commkit form is compared with: the same placement (broadcast: always ``raw``)."""
    if name.endswith(IN_PLACE) and collective != "broadcast":
        return "raw" + IN_PLACE
    return "raw"


_MPI_OPS = {"sum": "SUM", "prod": "PROD", "max": "MAX", "min": "MIN"}


def _raw_form(case, raw, in_place):
    """(prepare, call) of the mpi4py call a user would write for ``case``, on ``case``'s buffers."""
    from mpi4py import MPI

    c, x, out, root = case.collective, case.x, case.out, case.root
    me = case.comm.rank
    op = getattr(MPI, _MPI_OPS[case.op.name]) if case.op is not None else None
    IP = MPI.IN_PLACE

    def copy_in():
        out[...] = x

    if c in ("allreduce", "scan", "exscan"):
        fn = getattr(raw, {"allreduce": "Allreduce", "scan": "Scan", "exscan": "Exscan"}[c])
        prepare = copy_in if in_place else case.poison
        if in_place:
            return prepare, lambda: fn(IP, out, op)
        return prepare, lambda: fn(x, out, op)
    if c == "reduce":
        if me != root:
            return case.poison, lambda: raw.Reduce(x, None, op, root)
        if in_place:
            return copy_in, lambda: raw.Reduce(IP, out, op, root)
        return case.poison, lambda: raw.Reduce(x, out, op, root)
    if c == "broadcast":
        return (copy_in if me == root else case.poison), lambda: raw.Bcast(out, root)
    if c == "allgather":
        return case.poison, lambda: raw.Allgather(x, out)
    if c == "alltoall":
        return case.poison, lambda: raw.Alltoall(x, out)
    if c == "reduce_scatter":
        if len(set(case.counts)) == 1:
            return case.poison, lambda: raw.Reduce_scatter_block(x, out, op)
        counts = list(case.counts)
        return case.poison, lambda: raw.Reduce_scatter(x, out, counts, op)
    raise AssertionError(c)


def _commkit_form(case, algorithm, in_place):
    """(prepare, call) of commkit's ``algorithm`` for ``case``; in place: ``out=x`` with ``x`` the output.

    In place, the input is first copied into the output (untimed), so every run
    reduces the same data. A reduce's non-root ranks have no output: their call
    is the out-of-place one.
    """
    comm, c, x, out, root = case.comm, case.collective, case.x, case.out, case.root
    if not in_place or (c == "reduce" and comm.rank != root):
        return case.poison, (lambda: case.run(algorithm))
    kw = {"algorithm": None if algorithm == "auto" else algorithm}

    def copy_in():
        out[...] = x

    if c in ("allreduce", "scan", "exscan"):
        method = getattr(comm, c)
        return copy_in, lambda: method(out, case.op, out=out, **kw)
    if c == "reduce":
        return copy_in, lambda: comm.reduce(out, case.op, root, out=out, **kw)
    if c == "broadcast":
        return (copy_in if comm.rank == root else case.poison), lambda: comm.broadcast(out, root, out=out, **kw)
    raise AssertionError(f"{c} has no in-place form")


def forms(case, raw, names):
    """name -> (prepare, call) for each of ``names`` (see :func:`form_names`); all share ``case``'s buffers.

    ``prepare`` runs untimed before each call (poison the output, or copy the
    input into it for an in-place call); ``call`` returns what is checked
    against ``case``'s reference.
    """
    has_result = case.expected is not None
    out = {}
    for name in names:
        in_place = name.endswith(IN_PLACE)
        base = name[: -len(IN_PLACE)] if in_place else name
        if base == "raw":
            prepare, fn = _raw_form(case, raw, in_place)
            if case.collective == "exscan" and case.comm.rank == 0:
                # MPI defines no exscan result on rank 0 (commkit gives the identity): nothing to check there.
                out[name] = (prepare, (lambda fn=fn: (fn(), case.expected)[1]))
            else:
                out[name] = (prepare, (lambda fn=fn: (fn(), case.out if has_result else None)[1]))
        else:
            out[name] = _commkit_form(case, base, in_place)
    return out


def measure_forms(comm, raw, case, names, iters, warmup):
    """Interleaved timing of ``names`` on one case, as :func:`commkit.bench.measure` times algorithms.

    Every timed run is preceded by its untimed preparation and an ``MPI_Barrier``
    on ``raw``; the order of the forms rotates every repetition; a run's time is
    the slowest rank's; every result is checked. Returns one dict per name, the
    same on every rank.
    """
    table = forms(case, raw, names)
    times = np.zeros((len(names), iters))
    wrong = np.zeros(len(names), np.int64)
    barrier, clock = raw.Barrier, time.perf_counter
    for _ in range(warmup):
        for k, name in enumerate(names):
            prepare, call = table[name]
            prepare()
            wrong[k] += not case.correct(call())
    for i in range(iters):
        shift = i % len(names)
        for k in list(range(shift, len(names))) + list(range(shift)):
            prepare, call = table[names[k]]
            prepare()
            barrier()
            t0 = clock()
            result = call()
            times[k, i] = clock() - t0
            wrong[k] += not case.correct(result)
    return _rows(raw.allgather((times, wrong)), names, case.collective, case.size, comm.size, iters)


def forms_task(spec):
    """Collectives x sizes x sweeps through :func:`measure_forms`.

    With ``spec["raw"]``: the raw mpi4py call, commkit ``auto`` and ``native``
    (``spec["bases"]``), out of place and in place. Without: ``spec["names"]``,
    or ``auto`` and every algorithm that applies, and ``native``, out of place.
    (Timings are gathered with mpi4py's own allgather on the ``Dup``, so the
    measurement never depends on commkit's object collectives.)
    """
    from mpi4py import MPI

    import commkit as ck
    from commkit import bench

    comm = ck.init("mpi")
    raw = MPI.COMM_WORLD.Dup()
    p = comm.size
    op, dtype = spec.get("op", "sum"), spec.get("dtype", "float32")
    itemsize = np.dtype(dtype).itemsize
    rows, loads = [], []
    start = time.time()
    try:
        for rep in range(spec["repeats"]):
            loads.append(os.getloadavg()[0])
            for collective in spec["collectives"]:
                if spec.get("raw"):
                    names = form_names(collective, spec.get("bases", ["raw", "auto", "native"]))
                else:
                    names = spec.get("names") or ["auto", *bench.candidates(collective, p, op)]
                seen = set()
                for size in spec["sizes"]:
                    actual = bench.actual_size(collective, p, size, itemsize)
                    if actual in seen or actual == 0:
                        continue  # rounds to a size already measured (or to nothing)
                    seen.add(actual)
                    # New data every sweep (seed = sweep), in buffers made for this size.
                    case = bench.Case(comm, collective, size, dtype, op, 0, np, seed=rep)
                    iters, warmup = iterations(actual, len(names), spec)
                    for record in measure_forms(comm, raw, case, names, iters, warmup):
                        record["rep"] = rep
                        record["auto_choice"] = _auto_choice(collective, p, record["size"], op)
                        rows.append(record)
                _say(comm, f"{p} ranks, sweep {rep + 1}/{spec['repeats']}: {collective} done "
                           f"({time.time() - start:.0f} s, load {os.getloadavg()[0]:.2f})")
        loads.append(os.getloadavg()[0])
    finally:
        raw.Free()
    if comm.rank != 0:
        return None
    return {"rows": rows, "nprocs": p, "oversubscribed": p > (os.cpu_count() or 1),
            "seconds": time.time() - start, "load_per_sweep": loads}


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

    case = bench.Case(comm, collective, size, "float32", "sum", 0, np)
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
    return _rows(comm.allgather_object((times, wrong)), names, collective, case.size, comm.size, iters)


def _rows(everyone, names, collective, size, nprocs, iters) -> list:
    """One result row per variant from every rank's ``(times, wrong)``: the slowest rank's times, all ranks' errors."""
    times = np.max([t for t, _ in everyone], axis=0)
    wrong = np.sum([w for _, w in everyone], axis=0)
    rows = []
    for k, name in enumerate(names):
        t = times[k]
        median = float(np.median(t))
        q25, q75 = np.percentile(t, [25, 75])
        rows.append({"collective": collective, "size": size, "algorithm": name, "nprocs": nprocs,
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

                    actual = bench.actual_size(collective, comm.size, size, 4)
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


# -- helpers for the stand-alone scripts (inplace.py, memory_floor.py) ---------------------------------

_LAUNCHED = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")


def relaunch(nprocs: int, script: str, argv) -> int | None:
    """Run ``script`` under ``mpiexec -n nprocs`` unless this process is already a rank of a job.

    Returns the job's exit status, or None when already inside a job (run the
    script's body). The job runs in its own process group, which is ended --
    every process of it -- when it finishes, fails or this process is interrupted;
    what it left in /dev/shm is removed.
    """
    if any(k in os.environ for k in _LAUNCHED):
        return None
    from commkit._mpiexec import mpiexec_command, process_group

    root = os.path.dirname(os.path.dirname(os.path.abspath(script)))
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    cmd = mpiexec_command(nprocs, [sys.executable, os.path.abspath(script), *argv])
    try:
        with process_group(cmd, env=env) as proc:
            return proc.wait()
    except KeyboardInterrupt:
        return 130


def git_revision(root: str) -> str | None:
    """``git <short hash>``, marked when commkit/ has uncommitted changes; None outside a checkout."""
    import subprocess

    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=10, check=False).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "commkit"], cwd=root,
                               capture_output=True, text=True, timeout=10, check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    if not rev:
        return None
    return f"git {rev}" + (" with uncommitted changes to commkit/" if dirty else "")


def machine_line(raw) -> str:
    """One line naming the machine and the libraries, for the scripts' headers."""
    import mpi4py
    from mpi4py import MPI

    info = machine_task({})
    return (f"{raw.Get_size()} ranks on {info.get('cpu')} ({info.get('cores')} cores), "
            f"{' '.join(MPI.Get_library_version().replace(chr(0), '').splitlines()[0].split())}, "
            f"mpi4py {mpi4py.__version__}, "
            f"NumPy {np.__version__}, Python {info.get('python')}, commkit at "
            f"{git_revision(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) or 'an unknown revision'}")


def copy_bandwidth(raw, nbytes=32 << 20, repeats=5) -> float:
    """GB/s of one rank's ``np.copyto`` of ``nbytes`` while every rank copies at once: the slowest rank's, median.

    Collective: every rank of ``raw`` calls it.
    """
    from mpi4py import MPI

    src = np.ones(nbytes // 8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # (the pages touched first)
    rates = []
    for _ in range(repeats):
        raw.Barrier()
        t0 = time.perf_counter()
        np.copyto(dst, src)
        rates.append(nbytes / raw.allreduce(time.perf_counter() - t0, op=MPI.MAX) / 1e9)
    return float(np.median(rates))


def rotated_sweeps(raw, variants: dict, sweeps: int, calls: int) -> list[dict]:
    """Time ``variants`` (name -> fn()) interleaved: per sweep, name -> the slowest rank's us per call.

    Each sweep runs ``calls`` back-to-back calls of every variant after a
    barrier on ``raw``, in an order that rotates from sweep to sweep (so no
    variant always runs first or after the same one); every rank of ``raw``
    calls it with the same variants. Warm them up first.
    """
    from mpi4py import MPI

    names = list(variants)
    every = []
    for sweep in range(sweeps):
        k = sweep % len(names)
        got = {}
        for name in names[k:] + names[:k]:
            fn = variants[name]
            raw.Barrier()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            got[name] = raw.allreduce((time.perf_counter() - t0) / calls, op=MPI.MAX) * 1e6
        every.append(got)
    return every


def calibration(raw, calls=2000, repeats=5) -> dict:
    """The machine's state in three numbers, so that a reader can tell a ratio the machine moved from one the code did.

    The same code on the same VM has run at half its speed for days: the raw
    8 B allreduce went from 2.2 to 5.4 us, Python slowed more than MPI, and
    every commkit / raw ratio rose with it. A table that prints these beside
    itself (before and after the run) says which state it was measured in.

    Collective (every rank of ``raw`` calls it; about 0.1 s). Returns
    ``allreduce_us`` (the raw 8 B ``Allreduce`` on ``raw``, median of
    ``repeats`` runs of ``calls``, the slowest rank's), ``python_us`` (one
    ``sum(range(1000))``, the best of ``repeats``, the slowest rank's: the
    interpreter's speed) and ``copy_gbs`` (:func:`copy_bandwidth` of 8 MiB).
    """
    from mpi4py import MPI

    x, y = np.ones(1), np.empty(1)
    allreduce, python = [], []
    for _ in range(repeats):
        raw.Barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            raw.Allreduce(x, y)
        allreduce.append(raw.allreduce((time.perf_counter() - t0) / calls, op=MPI.MAX))
        t0 = time.perf_counter()
        for _ in range(100):
            sum(range(1000))
        python.append((time.perf_counter() - t0) / 100)
    return {"allreduce_us": float(np.median(allreduce)) * 1e6,
            "python_us": raw.allreduce(min(python), op=MPI.MAX) * 1e6,
            "copy_gbs": copy_bandwidth(raw, 8 << 20)}


def calibration_line(before: dict, after: dict | None = None) -> str:
    """:func:`calibration` as one line for a table's header: before the run and, where given, after it."""
    def one(c):
        return (f"raw 8 B Allreduce {c['allreduce_us']:.2f} us, sum(range(1000)) {c['python_us']:.1f} us, "
                f"8 MiB copy {c['copy_gbs']:.1f} GB/s a rank")
    return "machine state " + (f"before the run: {one(before)}; after it: {one(after)}" if after else one(before))


def timing_job(script: str):
    """``(raw, comm)`` for a script that times calls between ranks, or None (said why) outside such a job.

    ``raw`` is a ``Dup`` of COMM_WORLD (the mpi4py side), ``comm`` commkit's
    communicator over MPI; a ``COMMKIT_TIMEOUT`` in the environment is
    pointed out, as it makes every commkit call a timed one.
    """
    from mpi4py import MPI

    import commkit as ck

    raw = MPI.COMM_WORLD.Dup()
    if raw.Get_size() < 2:
        print(f"{script} times calls between ranks: run it under mpiexec -n 2 or more.", file=sys.stderr)
        return None
    comm = ck.init("mpi")
    if comm.timeout is not None:
        print(f"note: COMMKIT_TIMEOUT={comm.timeout:g} makes every commkit call a timed one", file=sys.stderr)
    return raw, comm


class RunState:
    """The load and the machine's state (:func:`calibration`) when a timed run starts; :meth:`end` when it ends.

    Collective, as :func:`calibration` is: every rank makes it and calls ``end``.
    """

    def __init__(self, raw):
        self.raw = raw
        self.load = os.getloadavg()[0]
        self.before = calibration(raw)

    def end(self) -> str:
        """The header line: the machine, the load before and after, and the machine's state before and after."""
        after = calibration(self.raw)
        return (f"{machine_line(self.raw)}; load average {self.load:.2f} -> {os.getloadavg()[0]:.2f}; "
                f"{calibration_line(self.before, after)}.")


def load_line(samples) -> str:
    """The 1-minute load averages sampled during a run: min, median, max."""
    if not samples:
        return "load not recorded"
    ordered = sorted(samples)
    return (f"1-minute load average sampled {len(ordered)} times during the run: min {ordered[0]:.2f}, "
            f"median {float(np.median(ordered)):.2f}, max {ordered[-1]:.2f} (each rank busy-waiting in MPI adds about 1)")


TASKS = {"bench": bench_task, "gloo": gloo_task, "overhead": overhead_task, "null": null_task, "rss": rss_task,
         "machine": machine_task}
