#!/usr/bin/env python
"""commkit's own per-call cost, with a transport that moves nothing.

    python benchmarks/null_transport.py [--calls 100000] [--sweeps 7]

A 2-rank communicator over a transport whose transfers return at once: what is
left of a repeated ``allreduce(x, out=out)`` is commkit's per-call path (plan
lookup, call number and tag, flight recorder) plus the reduction itself, which is
printed next to it. No MPI needed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from commkit.communicator import Communicator  # noqa: E402


class _Done:
    """A posted transfer that moved nothing: complete from the start, no peer ever outstanding."""

    def test(self) -> bool:
        return True

    def settles(self) -> bool:
        return True

    def wait(self, timeout):
        return []

    def abandon(self):
        pass


class NullTransport:
    """Two ranks that exchange nothing: every transfer completes at once."""

    name = "null"
    tag_ub = 2**29 - 1
    rank, size = 0, 2

    def dup(self):
        return NullTransport()

    def free(self):
        pass

    def sendrecv(self, dest, sbuf, source, rbuf, tag):
        pass

    def post(self, sends, recvs, tag):
        return _Done()

    def transfer(self, sends, recvs, tag, timeout):
        return []


def per_call(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=100_000, help="calls per sweep (default 100000)")
    parser.add_argument("--sweeps", type=int, default=7, help="sweeps (default 7)")
    args = parser.parse_args(argv)
    if args.calls < 1 or args.sweeps < 1:
        parser.error(f"--calls and --sweeps must be at least 1; got {args.calls} and {args.sweeps}.")
    comm = Communicator(NullTransport())
    x = np.ones(2, np.float32)
    out = np.empty_like(x)
    calls, sweeps = args.calls, args.sweeps
    allreduce = [per_call(lambda: comm.allreduce(x, out=out), calls) for _ in range(sweeps)]
    add = [per_call(lambda: np.add(x, out, out=out), calls) for _ in range(sweeps)]
    print(f"allreduce(x, out=out), 8 B, 2 ranks, null transport: {np.median(allreduce) * 1e6:.2f} us per call "
          f"(median of {sweeps} x {calls:,})")
    print(f"np.add(x, out, out=out) alone:                          {np.median(add) * 1e6:.2f} us per call")
    print(f"algorithm chosen: {comm.last_algorithm}; load average {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
