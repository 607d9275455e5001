#!/usr/bin/env python
"""What a large collective on new arrays costs: the allocator's first touch, on both sides.

    mpiexec -n 2 python benchmarks/new_arrays.py [--sizes 256K,1M,4M,32M] [--sweeps 7] [--calls 100]
    mpiexec -n 2 -genv MALLOC_MMAP_THRESHOLD_ 268435456 -genv MALLOC_TRIM_THRESHOLD_ 536870912 \\
        python benchmarks/new_arrays.py                   # glibc told to keep freed memory (see below)

A program that makes a new input and a new result every call (``y =
comm.allreduce(x)`` on a new ``x``) pays, on Linux with glibc, for the pages
of those arrays at every call: glibc hands a large block back to the system
when it is freed (it maps blocks over its threshold on their own, and trims
the top of its heap), so the next one is fresh memory, whose first write
faults every page in. The collective's own copies are the ones that touch
them first. Three columns, float32 sum, each call on a new copy of the
sweep's input (``base.copy()``, in every column alike):

* ``raw new``: ``y = np.empty_like(x); raw.Allreduce(x, y, MPI.SUM)`` on a
  ``Dup`` of COMM_WORLD;
* ``commkit new``: ``y = comm.allreduce(x)``;
* ``commkit same``: ``comm.allreduce(x0, out=y0)`` on two arrays made once
  (the same call a loop on its own buffers makes).

The columns are interleaved sweep by sweep; a cell is the median over sweeps
of the mean per call on the slowest rank. The header says whether the two
glibc settings that keep freed memory (``MALLOC_MMAP_THRESHOLD_`` and
``MALLOC_TRIM_THRESHOLD_``, both needed: setting either alone turns glibc's
own adjustment of both off) were in the environment. Quote numbers for ranks
<= cores only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for path in (HERE, ROOT):  # the checkout's commkit and the benchmark helpers
    if path not in sys.path:
        sys.path.insert(0, path)

import _tasks  # noqa: E402
import numpy as np  # noqa: E402
from _report import emit, fmt_size, fmt_us, script_header  # noqa: E402

COLUMNS = ("raw new", "commkit new", "commkit same")
MALLOC = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def _arguments(argv):
    """The parsed arguments, or SystemExit naming what was expected and what came."""
    from commkit.bench import parse_sizes
    from commkit.errors import InvalidArgument

    parser = argparse.ArgumentParser(prog="benchmarks/new_arrays.py", description=__doc__.split("\n\n")[1])
    parser.add_argument("--sizes", default="256K,1M,4M,32M",
                        help="one rank's message in bytes (default 256K,1M,4M,32M)")
    parser.add_argument("--sweeps", type=int, default=7, help="sweeps per size (default 7)")
    parser.add_argument("--calls", type=int, default=100, help="calls of each column per sweep (default 100)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 64K and 256K, 2 sweeps of 5 calls")
    parser.add_argument("--markdown", metavar="FILE", help="also write the table as a Markdown section to FILE")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.sweeps, args.calls = "64K,256K", 2, 5
    try:
        args.sizes = parse_sizes(args.sizes)
    except InvalidArgument as e:
        raise SystemExit(f"new_arrays.py: {e}") from None
    odd = [s for s in args.sizes if s <= 0 or s % 4]
    if odd:
        raise SystemExit(f"new_arrays.py: sizes must be positive multiples of 4 bytes (float32); got {odd}.")
    if args.sweeps < 1 or args.calls < 1:
        raise SystemExit(f"new_arrays.py: --sweeps and --calls must be at least 1; got {args.sweeps} and "
                         f"{args.calls}.")
    return args


def measure(comm, raw, nbytes, sweeps, calls):
    """``{column: [per-call seconds of each sweep, the slowest rank's]}``, and whether every result was right."""
    from mpi4py import MPI

    n = nbytes // 4
    base = (np.arange(n) % 7 + comm.rank).astype(np.float32)
    want = sum((np.arange(n) % 7 + r).astype(np.float32) for r in range(comm.size))
    x0, y0 = np.empty_like(base), np.empty_like(base)

    def raw_new(x):
        y = np.empty_like(x)
        raw.Allreduce(x, y, MPI.SUM)
        return y

    def same(x):
        return comm.allreduce(x0, out=y0)

    def ck_new(x):
        return comm.allreduce(x)

    x0[...] = base
    forms = dict(zip(COLUMNS, (raw_new, ck_new, same)))
    for form in forms.values():  # warm up: plans, and the allocator's own state
        for _ in range(3):
            form(base.copy())
    samples = {name: [] for name in COLUMNS}
    right = True
    for sweep in range(sweeps):
        order = COLUMNS[sweep % 3:] + COLUMNS[:sweep % 3]
        for name in order:
            raw.Barrier()
            result = None
            start = time.perf_counter()
            for _ in range(calls):
                result = forms[name](base.copy())
            seconds = (time.perf_counter() - start) / calls
            samples[name].append(raw.allreduce(seconds, op=MPI.MAX))
            right = right and bool(np.array_equal(result, want))
    return samples, raw.allreduce(right, op=MPI.LAND)


def report(rows, argv, nprocs, machine, seconds, loads, wrong, sweeps, calls) -> str:
    """The Markdown section: heading, command, machine, load and allocator settings, and the table."""
    settings = ", ".join(f"{k}={os.environ[k]}" for k in MALLOC if k in os.environ) or "glibc's defaults"
    load = f"1-minute load average {loads[0]:.2f} before the run, {loads[-1]:.2f} after it"
    head = script_header("benchmarks/new_arrays.py", nprocs, argv, machine,
                         f"{sweeps} sweeps x {calls} calls per column, {seconds:.0f} s", load, wrong)
    lines = ["| bytes | " + " | ".join(COLUMNS) + " | new / same |", "|---|" + "---|" * (len(COLUMNS) + 1)]
    for nbytes, samples in rows:
        medians = {c: statistics.median(samples[c]) for c in COLUMNS}
        lines.append(f"| {fmt_size(nbytes)} | " + " | ".join(fmt_us(medians[c] * 1e6) for c in COLUMNS)
                     + f" | {medians['commkit new'] / medians['commkit same']:.2f} |")
    return "\n".join(["## New arrays every call: the allocator's first touch", "", *head,
                      f"Allocator: {settings}.", "",
                      ("Time per call in microseconds (allreduce, float32 sum): the median over sweeps of the mean "
                       "per call (slowest rank)."), "", *lines, ""])


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _arguments(argv)
    status = _tasks.relaunch(2, __file__, argv)
    if status is not None:
        return status
    from mpi4py import MPI

    import commkit as ck

    comm = ck.init("mpi")
    raw = MPI.COMM_WORLD.Dup()
    loads = [os.getloadavg()[0]]
    state = _tasks.calibration(raw)
    started = time.time()
    rows, wrong = [], 0
    try:
        for nbytes in args.sizes:
            samples, right = measure(comm, raw, nbytes, args.sweeps, args.calls)
            rows.append((nbytes, samples))
            wrong += not right
        loads.append(os.getloadavg()[0])
        machine = f"{_tasks.machine_line(raw)}; {_tasks.calibration_line(state, _tasks.calibration(raw))}"
    finally:
        raw.Free()
    if comm.rank == 0:
        emit(report(rows, argv, comm.size, machine, time.time() - started, loads, wrong, args.sweeps, args.calls),
             args.markdown)
    comm.free()
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
