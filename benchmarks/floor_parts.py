#!/usr/bin/env python
"""Where a small call's time goes: MPI's collective, the point-to-point calls under it, Python, bookkeeping.

    mpiexec -n 2 python benchmarks/floor_parts.py [--sizes 8,1024] [--sweeps 11] [--calls 2000]
                                                  [--collectives Bcast,Allreduce]

The per-call targets of the face and the communicator are ratios to MPI's own
collective. This script takes such a call apart, on 2 ranks (where each of
commkit's algorithms is one message each way), so a reader can see which part
of a ratio any Python library could remove and which it cannot. Columns, each
the time per call on buffers of its own, interleaved:

* ``raw``: MPI's collective on a ``Dup`` of COMM_WORLD (``Bcast``, ``Reduce``,
  ``Allreduce``, ``Gather``, ``Scatter``, ``Allgather``, ``Alltoall``);
* ``p2p``: the same collective written by hand as commkit's 2-rank algorithm
  runs it: MPI's ``Send``/``Recv``/``Sendrecv`` with a fixed tag and the NumPy
  copy or sum, in one Python function (what being Python and
  point-to-point costs, with no bookkeeping at all);
* ``p2p + least bookkeeping``: that function with the least of what commkit
  keeps per call for its guarantees, written inline: the guard that refuses a
  concurrent call on the communicator, the call number carried in the
  message's tag (so ranks that disagree about a call wait instead of matching),
  and the flight-recorder entry the watchdog and a timeout name the call by;
* ``commkit``: the communicator's call on the same arrays (its compiled plan);
* ``face``: ``wrap(COMM_WORLD)``'s call on the same kind of NumPy arrays.

A cell is the median over sweeps of the slowest rank's time per call; the
ratios are medians of the per-sweep ratios to ``raw``. The ``least
bookkeeping`` column is the floor for any library that keeps those
guarantees in Python: a target under it cannot be met without dropping one.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import threading

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for path in (HERE, ROOT):  # the checkout's commkit and the benchmark helpers
    if path not in sys.path:
        sys.path.insert(0, path)

import numpy as np  # noqa: E402
from _tasks import calibration, calibration_line, machine_line, rotated_sweeps  # noqa: E402
from mpi4py import MPI  # noqa: E402

from commkit.compat.mpi4py import wrap  # noqa: E402

COLLECTIVES = ("Bcast", "Reduce", "Allreduce", "Gather", "Scatter", "Allgather", "Alltoall")
VARIANTS = ("raw", "p2p", "booked", "commkit", "face")

# Each collective's 2-rank algorithm by hand, as commkit's schedules run it (root 0; q is the other rank).
# The names: C (the raw communicator), x/y (a rank's input and output), g (p blocks), t (a temporary).
P2P = {
    "Bcast": ("if r == 0:\n    C.Send(x, 1, tag)\nelse:\n    C.Recv(x, 0, tag)"),
    "Reduce": ("if r == 0:\n    C.Recv(t, 1, tag)\n    add(x, t, out=y)\nelse:\n    C.Send(x, 0, tag)"),
    "Allreduce": "C.Sendrecv(x, q, tag, t, q, tag)\nadd(x, t, out=y)",
    "Gather": "if r == 0:\n    g[0] = x\n    C.Recv(g[1], 1, tag)\nelse:\n    C.Send(x, 0, tag)",
    "Scatter": "if r == 0:\n    y[...] = g[0]\n    C.Send(g[1], 1, tag)\nelse:\n    C.Recv(y, 0, tag)",
    "Allgather": "g[r] = x\nC.Sendrecv(x, q, tag, g[q], q, tag)",
    "Alltoall": "y2[r] = g[r]\nC.Sendrecv(g[q], q, tag, y2[q], q, tag)",
}

# The least bookkeeping (see the module docstring), around the body.
BOOKED = """\
def run():
    if not acquire(False):
        raise RuntimeError("a concurrent call")
    try:
        seq = state.seq
        state.seq = seq + 1
        tag = ((seq & 255) << 12) | 7
        rec = [seq, name, "p2p", None, 0.0, None, 0, None, "running"]
        append(rec)
{body}
        rec[8] = "done"
    finally:
        release()
"""


def _indent(text, spaces):
    return "\n".join(" " * spaces + line for line in text.splitlines())


def _variants(collective, raw, face, nbytes):
    """name -> fn() for one cell, each variant on buffers of its own made alike."""
    p, r = raw.Get_size(), raw.Get_rank()
    reducing = collective in ("Reduce", "Allreduce")
    dtype = np.float64 if reducing else np.uint8
    n = max(nbytes // np.dtype(dtype).itemsize, 1)
    comm = face.comm

    def buffers():
        x = (np.arange(n) % 7 + r).astype(dtype)
        return {"x": x, "y": np.empty_like(x), "t": np.empty_like(x), "g": np.zeros((p, n), dtype),
                "y2": np.zeros((p, n), dtype)}

    def namespace(b):
        lock = threading.Lock()
        state = type("State", (), {"seq": 0})()
        return {"C": raw, "r": r, "q": 1 - r, "add": np.add, "acquire": lock.acquire, "release": lock.release,
                "state": state, "append": collections.deque(maxlen=64).append, "name": collective, **b}

    bufs = [buffers() for _ in VARIANTS]
    plain_ns = namespace(bufs[1])
    exec(f"def run():\n    tag = 7\n{_indent(P2P[collective], 4)}\n", plain_ns)  # noqa: S102 (our own text)
    booked_ns = namespace(bufs[2])
    exec(BOOKED.format(body=_indent(P2P[collective], 8)), booked_ns)  # noqa: S102
    x0, y0, g0, z0 = bufs[0]["x"], bufs[0]["y"], bufs[0]["g"], bufs[0]["y2"]
    x3, y3, g3, z3 = bufs[3]["x"], bufs[3]["y"], bufs[3]["g"], bufs[3]["y2"]
    x4, y4, g4, z4 = bufs[4]["x"], bufs[4]["y"], bufs[4]["g"], bufs[4]["y2"]
    at_root = r == 0
    calls = {
        "Bcast": (lambda: raw.Bcast(x0, 0), lambda: comm.broadcast(x3, 0, out=x3), lambda: face.Bcast(x4, 0)),
        "Reduce": (lambda: raw.Reduce(x0, y0, MPI.SUM, 0),
                   lambda: comm.reduce(x3, "sum", 0, out=y3 if at_root else None),
                   lambda: face.Reduce(x4, y4, MPI.SUM, 0)),
        "Allreduce": (lambda: raw.Allreduce(x0, y0, MPI.SUM), lambda: comm.allreduce(x3, out=y3),
                      lambda: face.Allreduce(x4, y4, MPI.SUM)),
        "Gather": (lambda: raw.Gather(x0, g0, 0), lambda: comm.gather(x3, 0, out=g3 if at_root else None),
                   lambda: face.Gather(x4, g4, 0)),
        "Scatter": (lambda: raw.Scatter(g0, y0, 0), lambda: comm.scatter(g3 if at_root else None, 0, out=y3),
                    lambda: face.Scatter(g4, y4, 0)),
        "Allgather": (lambda: raw.Allgather(x0, g0), lambda: comm.allgather(x3, out=g3),
                      lambda: face.Allgather(x4, g4)),
        "Alltoall": (lambda: raw.Alltoall(g0, z0), lambda: comm.alltoall(g3, out=z3), lambda: face.Alltoall(g4, z4)),
    }[collective]
    return {"raw": calls[0], "p2p": plain_ns["run"], "booked": booked_ns["run"], "commkit": calls[1],
            "face": calls[2]}


def _time(raw, variants, sweeps, calls):
    """Per variant: the median over sweeps of the slowest rank's us per call, and the median ratio to raw."""
    for fn in variants.values():  # warm: the communicator compiles its plan at the second call
        for _ in range(20):
            fn()
    every = rotated_sweeps(raw, variants, sweeps, calls)
    return ({name: statistics.median(got[name] for got in every) for name in variants},
            {name: statistics.median(got[name] / got["raw"] for got in every) for name in variants})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/floor_parts.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="8,1024", help="bytes per rank's block, comma-separated (default 8,1024)")
    parser.add_argument("--sweeps", type=int, default=11, help="sweeps (default 11)")
    parser.add_argument("--calls", type=int, default=2000, help="calls of each variant per sweep (default 2000)")
    parser.add_argument("--collectives", default=",".join(COLLECTIVES), help="which collectives (default all)")
    args = parser.parse_args(argv)
    chosen = args.collectives.split(",")
    unknown = [c for c in chosen if c not in COLLECTIVES]
    if unknown:
        parser.error(f"--collectives takes names from {', '.join(COLLECTIVES)}; got {unknown}")
    raw = MPI.COMM_WORLD.Dup()
    if raw.Get_size() != 2:
        if raw.Get_rank() == 0:
            print(f"floor_parts.py writes each collective by hand for 2 ranks: run it under mpiexec -n 2 "
                  f"(got {raw.Get_size()}).", file=sys.stderr)
        raw.Free()
        return 2
    face = wrap(MPI.COMM_WORLD)
    load = [os.getloadavg()[0]]
    state = calibration(raw)
    rows = []
    for collective in chosen:
        for nbytes in (int(s) for s in args.sizes.split(",")):
            rows.append((collective, nbytes, *_time(raw, _variants(collective, raw, face, nbytes),
                                                    args.sweeps, args.calls)))
    state = calibration_line(state, calibration(raw))
    load.append(os.getloadavg()[0])
    if raw.Get_rank() == 0:
        print(f"Command: `mpiexec -n 2 python benchmarks/floor_parts.py --sizes {args.sizes} --sweeps {args.sweeps} "
              f"--calls {args.calls} --collectives {args.collectives}`")
        print()
        print(f"{machine_line(raw)}; load average {load[0]:.2f} -> {load[1]:.2f}; {state}.")
        print()
        print("| call | bytes | raw (us) | p2p / raw | + least bookkeeping / raw | commkit / raw | face / raw |")
        print("|---|---|---|---|---|---|---|")
        for collective, nbytes, t, ratio in rows:
            print(f"| {collective} | {nbytes} | {t['raw']:.2f} | {ratio['p2p']:.2f} | {ratio['booked']:.2f} | "
                  f"{ratio['commkit']:.2f} | {ratio['face']:.2f} |")
        print()
        print("p2p: the 2-rank algorithm by hand with MPI's point-to-point calls; least bookkeeping: with the "
              "concurrent-call guard, the call number in the tag and a flight-recorder entry written inline.")
    face.comm.free()  # the face wraps COMM_WORLD itself: free only its own contexts
    raw.Free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
