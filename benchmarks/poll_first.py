#!/usr/bin/env python
"""A compiled plan's blocking transfers, posted and polled or MPI's blocking calls: which costs less here.

    mpiexec -n 2 python benchmarks/poll_first.py [--sizes 8,1024] [--sweeps 11] [--calls 2000]
                                                 [--collectives allreduce,broadcast,reduce,allgather]

``commkit.transports.mpi.POLL_FIRST`` decides, per MPI library, whether a
compiled plan's blocking transfer posts ``Irecv``/``Isend`` and tests them a
few times before it waits, or calls MPI's blocking ``Sendrecv``/``Send``/``Recv``
(``COMMKIT_MPI_POLL_FIRST=1`` or ``0`` overrides it). Which is cheaper depends
on the library (MPICH's blocking wait cost more than a small message takes to
arrive, Open MPI's less, when the rule was set) and on the machine: on one
2-core VM the same code measured the other way round in a state where Python
ran at 60% of its usual speed. So the rule is decided by this script, run on
the machine in question, with nothing else running.

In one job it makes two communicators over COMM_WORLD, one with each setting,
and times, for each collective and size, the raw mpi4py call on a ``Dup`` of
COMM_WORLD and the same call on each communicator (the same arrays, so each
runs its compiled plan), interleaved in an order that rotates from sweep to
sweep. A cell is the median over sweeps of the time per call (the slowest
rank's); ``polled / blocking`` is the median of the per-sweep ratios. The
machine's state (``_tasks.calibration``) is printed before and after.
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
from _tasks import calibration, calibration_line, machine_line, rotated_sweeps  # noqa: E402
from mpi4py import MPI  # noqa: E402

import commkit as ck  # noqa: E402
from commkit.transports import mpi as mpi_transport  # noqa: E402

COLLECTIVES = ("allreduce", "broadcast", "reduce", "allgather")
ENV = "COMMKIT_MPI_POLL_FIRST"


def _communicator(poll_first: bool):
    """A world communicator whose transport polls first (or not), whatever the environment said."""
    before = os.environ.get(ENV)
    os.environ[ENV] = "1" if poll_first else "0"  # read when the transport is made
    try:
        return ck.init("mpi")
    finally:
        if before is None:
            del os.environ[ENV]
        else:
            os.environ[ENV] = before


def _calls(collective, raw, polled, blocking, nbytes):
    """The three variants of one cell: name -> fn(), each on buffers of its own made alike."""
    p, rank = raw.Get_size(), raw.Get_rank()
    n = max(nbytes // 4, 1)

    def buffers():
        x = np.arange(n, dtype=np.float32) + rank
        return x, np.empty_like(x), np.empty((p, n), np.float32)

    (x0, y0, g0), (x1, y1, g1), (x2, y2, g2) = buffers(), buffers(), buffers()
    if collective == "allreduce":
        return {"raw": lambda: raw.Allreduce(x0, y0, MPI.SUM),
                "polled": lambda: polled.allreduce(x1, out=y1),
                "blocking": lambda: blocking.allreduce(x2, out=y2)}
    if collective == "broadcast":
        return {"raw": lambda: raw.Bcast(x0, 0),
                "polled": lambda: polled.broadcast(x1, 0, out=x1),
                "blocking": lambda: blocking.broadcast(x2, 0, out=x2)}
    if collective == "reduce":
        at_root = rank == 0
        return {"raw": lambda: raw.Reduce(x0, y0, MPI.SUM, 0),
                "polled": lambda: polled.reduce(x1, "sum", 0, out=y1 if at_root else None),
                "blocking": lambda: blocking.reduce(x2, "sum", 0, out=y2 if at_root else None)}
    if collective == "allgather":
        return {"raw": lambda: raw.Allgather(x0, g0),
                "polled": lambda: polled.allgather(x1, out=g1),
                "blocking": lambda: blocking.allgather(x2, out=g2)}
    raise ValueError(collective)


def _time(raw, variants, sweeps, calls):
    """Per variant: the median over sweeps of the slowest rank's time per call (us), and of polled / blocking."""
    for fn in variants.values():  # warm: each communicator compiles its plan at the second call
        for _ in range(20):
            fn()
    every = rotated_sweeps(raw, variants, sweeps, calls)
    ratios = [got["polled"] / got["blocking"] for got in every]
    return {name: statistics.median(got[name] for got in every) for name in variants}, statistics.median(ratios), \
        min(ratios), max(ratios)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/poll_first.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="8,1024", help="bytes per rank, comma-separated (default 8,1024)")
    parser.add_argument("--sweeps", type=int, default=11, help="sweeps (default 11)")
    parser.add_argument("--calls", type=int, default=2000, help="calls of each variant per sweep (default 2000)")
    parser.add_argument("--collectives", default=",".join(COLLECTIVES), help="which collectives (default all)")
    args = parser.parse_args(argv)
    unknown = [c for c in args.collectives.split(",") if c not in COLLECTIVES]
    if unknown:
        parser.error(f"--collectives takes names from {', '.join(COLLECTIVES)}; got {unknown}")
    raw = MPI.COMM_WORLD.Dup()
    if raw.Get_size() < 2:
        print("poll_first.py times transfers between ranks: run it under mpiexec -n 2 or more.", file=sys.stderr)
        return 2
    polled, blocking = _communicator(True), _communicator(False)
    load = [os.getloadavg()[0]]
    state = calibration(raw)
    rows = []
    for collective in args.collectives.split(","):
        for nbytes in (int(s) for s in args.sizes.split(",")):
            rows.append((collective, nbytes, *_time(raw, _calls(collective, raw, polled, blocking, nbytes),
                                                    args.sweeps, args.calls)))
    state = calibration_line(state, calibration(raw))
    load.append(os.getloadavg()[0])
    if raw.Get_rank() == 0:
        rule = "polls first" if mpi_transport.POLL_FIRST else "calls MPI's blocking transfers"
        print(f"Command: `mpiexec -n {raw.Get_size()} python benchmarks/poll_first.py --sizes {args.sizes} "
              f"--sweeps {args.sweeps} --calls {args.calls} --collectives {args.collectives}`")
        print()
        print(f"{machine_line(raw)}; load average {load[0]:.2f} -> {load[1]:.2f}; {state}. "
              f"The shipped rule for this library: a plan {rule}.")
        print()
        print("| collective | bytes | raw (us) | polled (us) | blocking (us) | polled / blocking (lowest-highest sweep) |")
        print("|---|---|---|---|---|---|")
        for collective, nbytes, t, ratio, lo, hi in rows:
            print(f"| {collective} | {nbytes} | {t['raw']:.2f} | {t['polled']:.2f} | {t['blocking']:.2f} | "
                  f"{ratio:.2f} ({lo:.2f}-{hi:.2f}) |")
        faster = sum(r[3] < 1 for r in rows)
        print()
        print(f"Polled faster in {faster} of {len(rows)} rows.")
    polled.free()
    blocking.free()
    raw.Free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
