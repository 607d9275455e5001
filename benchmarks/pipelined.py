#!/usr/bin/env python
"""Pipelined ring allreduce against the plain ring and the library's own MPI_Allreduce.

    mpiexec -n 2 python benchmarks/pipelined.py                 # 1, 4, 32 MiB float32, 9 sweeps
    mpiexec -n 2 python benchmarks/pipelined.py --quick         # a smoke run
    COMMKIT_SEGMENT_ELEMENTS=262144 mpiexec -n 2 python benchmarks/pipelined.py

Variants, timed interleaved in one job on the same buffers (the order rotates
from sweep to sweep, the input changes between sweeps): ``ring``,
``ring_pipelined`` (segment size: ``COMMKIT_SEGMENT_ELEMENTS`` or 65536
elements) and ``native`` (commkit's path to ``MPI_Allreduce``). Each cell is
the median over sweeps of the mean time per call within a sweep; ``spread``
is (max - min) / median over the sweeps. The 1-minute load average before and
after the run is printed.

MPICH from pip has no asynchronous progress thread: a posted transfer may
only move while some rank is inside an MPI call, so the reduction overlapped
with it in Python may not hide anything. This benchmark says whether it does.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the checkout's commkit

import commkit as ck  # noqa: E402
from mpi4py import MPI  # noqa: E402

VARIANTS = ("ring", "ring_pipelined", "native")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,4,32", help="MiB, comma-separated")
    parser.add_argument("--sweeps", type=int, default=9)
    parser.add_argument("--seconds", type=float, default=0.3, help="about this long per variant per sweep")
    parser.add_argument("--quick", action="store_true", help="2 sweeps, sizes 1 MiB only")
    args = parser.parse_args(argv)
    if args.quick:
        args.sweeps, args.sizes, args.seconds = 2, "1", 0.05
    comm = ck.init(timeout=120)
    raw = MPI.COMM_WORLD
    load0 = os.getloadavg()[0]
    rows = []
    for mib in (float(s) for s in args.sizes.split(",")):
        n = int(mib * (1 << 20)) // 4
        x = np.empty(n, dtype=np.float32)
        out = np.empty_like(x)
        want = np.empty_like(x)
        # Calls per sweep, from one timed call of the ring (agreed on by all ranks).
        comm.allreduce(x, out=out, algorithm="ring")
        t0 = time.perf_counter()
        comm.allreduce(x, out=out, algorithm="ring")
        calls = max(1, int(raw.allreduce(args.seconds / max(time.perf_counter() - t0, 1e-6), op=MPI.MIN)))
        times = {v: [] for v in VARIANTS}
        for sweep in range(args.sweeps):
            x[:] = np.random.default_rng([sweep, comm.rank]).standard_normal(n, dtype=np.float32)
            raw.Allreduce(x, want, MPI.SUM)
            k = sweep % len(VARIANTS)
            for name in VARIANTS[k:] + VARIANTS[:k]:
                comm.allreduce(x, out=out, algorithm=name)  # warm (plans, pages)
                np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4 * len(VARIANTS))
                raw.Barrier()
                t0 = time.perf_counter()
                for _ in range(calls):
                    comm.allreduce(x, out=out, algorithm=name)
                elapsed = (time.perf_counter() - t0) / calls
                times[name].append(raw.allreduce(elapsed, op=MPI.MAX))
        rows.append((mib, calls, {v: (statistics.median(t), (max(t) - min(t)) / statistics.median(t))
                                  for v, t in times.items()}))
    load1 = os.getloadavg()[0]
    if comm.rank == 0:
        from commkit.algorithms import pipelined

        print(f"# {comm.size} ranks, {MPI.Get_library_version().splitlines()[0]}; segment "
              f"{pipelined.segment_elements()} elements; {args.sweeps} sweeps; load {load0:.2f} -> {load1:.2f} "
              f"on {os.cpu_count()} CPUs")
        print(f"{'MiB':>6} {'calls':>6} " + " ".join(f"{v + ' ms (spread)':>28}" for v in VARIANTS)
              + "   pipelined/ring")
        for mib, calls, cells in rows:
            print(f"{mib:6g} {calls:6d} " + " ".join(f"{cells[v][0] * 1e3:18.3f} ({cells[v][1]:6.1%})"
                                                     for v in VARIANTS)
                  + f"   {cells['ring_pipelined'][0] / cells['ring'][0]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
