#!/usr/bin/env python
"""A nonblocking allreduce on new arrays, started and waited: commkit's i-forms against mpi4py's.

    mpiexec -n 2 python benchmarks/nonblocking_forms.py [--sizes 8,1K,16K] [--sweeps 11] [--calls 1000]

Every call of every column gets a new input array (``base.copy()``, inside the
timed loop) and, where the column writes a result, a new output, as a program
that reduces a new tally or new gradients each step makes them. The columns:

* ``raw i``: ``raw.Iallreduce(x, y, MPI.SUM).Wait()`` on a ``Dup`` of
  COMM_WORLD into a new ``y`` -- the baseline of every ratio;
* ``commkit i``: ``comm.iallreduce(x).wait()`` (the selected algorithm's
  schedule, compiled: docs/architecture.md, path 2);
* ``commkit i native``: ``comm.iallreduce(x, algorithm="native").wait()``
  (the library's ``MPI_Iallreduce`` started by commkit);
* ``raw``: ``raw.Allreduce(x, y, MPI.SUM)`` into a new ``y``, and
  ``commkit``: ``comm.allreduce(x)``, the blocking calls beside them.

float64, op sum. Every column is checked against the others before timing.
One sweep runs ``--calls`` calls of each column after a barrier, in an order
that rotates from sweep to sweep; a cell is the median over sweeps of the time
per call on the slowest rank, and each ratio the median of the per-sweep
ratios to ``raw i``. The machine's state (``_tasks.calibration``) and the load
are printed before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for path in (HERE, ROOT):  # the checkout's commkit and the benchmark helpers
    if path not in sys.path:
        sys.path.insert(0, path)

import numpy as np  # noqa: E402
from _tasks import RunState, rotated_sweeps, timing_job  # noqa: E402
from mpi4py import MPI  # noqa: E402

from commkit.bench import format_size, parse_sizes  # noqa: E402

COLUMNS = ("raw i", "commkit i", "commkit i native", "raw", "commkit")


def _columns(comm, raw, nbytes):
    """Each column's call on a new array made from one base; each returns the result."""
    base = np.arange(max(nbytes // 8, 1), dtype=np.float64) + raw.Get_rank()

    def raw_i():
        x = base.copy()
        y = np.empty_like(x)
        raw.Iallreduce(x, y, MPI.SUM).Wait()
        return y

    def raw_blocking():
        x = base.copy()
        y = np.empty_like(x)
        raw.Allreduce(x, y, MPI.SUM)
        return y

    return {"raw i": raw_i,
            "commkit i": lambda: comm.iallreduce(base.copy()).wait(),
            "commkit i native": lambda: comm.iallreduce(base.copy(), algorithm="native").wait(),
            "raw": raw_blocking,
            "commkit": lambda: comm.allreduce(base.copy())}


def _time(raw, columns, sweeps, calls):
    """Per column: the median over sweeps of the slowest rank's time per call (us); and its ratio to raw i."""
    want = None
    for name, call in columns.items():  # warm (commkit compiles its shapes and entries), and check the answers
        for _ in range(5):
            got = call()
        if want is not None and not np.array_equal(got, want):
            raise AssertionError(f"{name} gave {got[:4]} where raw i gave {want[:4]}")
        want = got if want is None else want
    every = rotated_sweeps(raw, columns, sweeps, calls)
    return {name: (statistics.median(got[name] for got in every),
                   statistics.median(got[name] / got["raw i"] for got in every)) for name in columns}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/nonblocking_forms.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="8,1K,16K", help="bytes per rank (default 8,1K,16K)")
    parser.add_argument("--sweeps", type=int, default=11, help="sweeps (default 11)")
    parser.add_argument("--calls", type=int, default=1000, help="calls of each column per sweep (default 1000)")
    args = parser.parse_args(argv)
    job = timing_job("nonblocking_forms.py")
    if job is None:
        return 2
    raw, comm = job
    run = RunState(raw)
    rows = [(format_size(size), _time(raw, _columns(comm, raw, size), args.sweeps, args.calls))
            for size in parse_sizes(args.sizes)]
    header = run.end()
    if raw.Get_rank() == 0:
        print(f"Command: `mpiexec -n {raw.Get_size()} python benchmarks/nonblocking_forms.py --sizes {args.sizes} "
              f"--sweeps {args.sweeps} --calls {args.calls}`")
        print()
        print(header)
        print()
        print("| bytes | " + " | ".join(f"{name} (us)" for name in COLUMNS) + " | "
              + " | ".join(f"{name} / raw i" for name in COLUMNS[1:]) + " |")
        print("|---" * (2 * len(COLUMNS)) + "|")
        for size, cells in rows:
            print(f"| {size} | " + " | ".join(f"{cells[name][0]:.2f}" for name in COLUMNS) + " | "
                  + " | ".join(f"{cells[name][1]:.2f}" for name in COLUMNS[1:]) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
