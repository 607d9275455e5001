#!/usr/bin/env python
"""A training step's loop: a blocking allreduce of a new loss and an i-form of new gradients, overlapped.

    mpiexec -n 2 python benchmarks/overlap_loop.py [--sizes 1K,64K,256K] [--sweeps 9] [--steps 1000]

Each step makes a new 8 B loss and reduces it with a blocking allreduce, then
starts an allreduce of a new gradient array (``--sizes``: bytes per rank,
float32), sums the gradient array it holds (the "compute" it overlaps), and
waits for the request. commkit's step (``comm.allreduce(loss)``,
``comm.iallreduce(grads)``, ``request.wait()``) is timed beside the mpi4py step
a user would write on a ``Dup`` of COMM_WORLD (new output arrays,
``Allreduce``, ``Iallreduce``, ``Wait``), interleaved in an order that
alternates from sweep to sweep. A cell is the median over sweeps of the time
per step (the slowest rank's), and ``commkit / raw`` the median of the
per-sweep ratios.

A gradient large enough not to arrive while its request starts leaves the
request outstanding: this is the loop that showed an i-form left in flight
dropping the next calls' entries (docs/call_cost.md). The machine's state
(``_tasks.calibration``) is printed before and after.
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

import numpy as np  # noqa: E402
from _tasks import RunState, timing_job  # noqa: E402
from mpi4py import MPI  # noqa: E402

from commkit.bench import format_size, parse_sizes  # noqa: E402


def _steps(comm, raw, nbytes):
    """commkit's step and mpi4py's, each on the same gradient array; each returns (loss, gradient sum)."""
    rank = raw.Get_rank()
    grads = np.arange(max(nbytes // 4, 1), dtype=np.float32) % 7 + rank

    def commkit_step(k):
        loss = comm.allreduce(np.full(1, k + rank, np.float64))
        request = comm.iallreduce(grads.copy())
        grads.sum()
        return loss, request.wait()

    def raw_step(k):
        loss = np.empty(1)
        raw.Allreduce(np.full(1, k + rank, np.float64), loss, MPI.SUM)
        send, total = grads.copy(), np.empty_like(grads)
        request = raw.Iallreduce(send, total, MPI.SUM)  # (send must live until the Wait: MPI reads it meanwhile)
        grads.sum()
        request.Wait()
        return loss, total

    return {"commkit": commkit_step, "raw": raw_step}


def _time(raw, steps, sweeps, count):
    """The median over sweeps of the slowest rank's time per step (us), per loop; and of commkit / raw."""
    want = None
    for name, step in steps.items():  # warm (commkit compiles its plans and entries), and check the answers
        for k in range(5):
            loss, total = step(k)
        got = (loss.tolist(), total.tolist())
        if want is not None and got != want:
            raise AssertionError(f"commkit's step and mpi4py's disagree: {got[0]} against {want[0]}")
        want = got
    times = {name: [] for name in steps}
    ratios = []
    for sweep in range(sweeps):
        got = {}
        for name in (("commkit", "raw") if sweep % 2 else ("raw", "commkit")):
            step = steps[name]
            raw.Barrier()
            t0 = time.perf_counter()
            for k in range(count):
                step(k)
            got[name] = raw.allreduce((time.perf_counter() - t0) / count, op=MPI.MAX) * 1e6
            times[name].append(got[name])
        ratios.append(got["commkit"] / got["raw"])
    return ({name: statistics.median(v) for name, v in times.items()}, statistics.median(ratios), min(ratios),
            max(ratios))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/overlap_loop.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1K,64K,256K", help="gradient bytes per rank (default 1K,64K,256K)")
    parser.add_argument("--sweeps", type=int, default=9, help="sweeps (default 9)")
    parser.add_argument("--steps", type=int, default=1000, help="steps of each loop per sweep (default 1000)")
    args = parser.parse_args(argv)
    job = timing_job("overlap_loop.py")
    if job is None:
        return 2
    raw, comm = job
    run = RunState(raw)
    rows = [(format_size(size), *_time(raw, _steps(comm, raw, size), args.sweeps, args.steps))
            for size in parse_sizes(args.sizes)]
    header = run.end()
    if raw.Get_rank() == 0:
        print(f"Command: `mpiexec -n {raw.Get_size()} python benchmarks/overlap_loop.py --sizes {args.sizes} "
              f"--sweeps {args.sweeps} --steps {args.steps}`")
        print()
        print(header)
        print()
        print("| gradient bytes | raw step (us) | commkit step (us) | commkit / raw (lowest-highest sweep) |")
        print("|---|---|---|---|")
        for size, times, ratio, low, high in rows:
            print(f"| {size} | {times['raw']:.1f} | {times['commkit']:.1f} | {ratio:.2f} ({low:.2f}-{high:.2f}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
