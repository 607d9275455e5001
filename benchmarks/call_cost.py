#!/usr/bin/env python
"""What one small collective costs: commkit against the raw mpi4py call a user would write.

    mpiexec -n 2 python benchmarks/call_cost.py                    # the table, to stdout
    mpiexec -n 2 python benchmarks/call_cost.py --markdown FILE    # also as a Markdown page section
    mpiexec -n 2 python benchmarks/call_cost.py --quick            # a smoke run (seconds)

For each collective and size it times, interleaved in one job on the same
buffers (the order of the variants rotates from sweep to sweep, and the input
data changes between sweeps so no variant only measures the cache):

* ``raw``: the mpi4py call on a ``Dup`` of COMM_WORLD (``comm.Allreduce(x, out)``
  ...), what a user would otherwise write -- the baseline of every ratio;
* ``auto``: commkit with its selected algorithm, out of place and in place
  (``out=x``; broadcast is always in place, as ``MPI_Bcast`` is);
* ``native``: commkit's path to the same library call (what commkit's own call
  path costs on top of the library);
* for allreduce also: ``floor`` (the ``Sendrecv`` + ``np.add`` a 2-rank
  recursive-doubling allreduce performs, by hand: the Python floor of commkit's
  algorithm), ``persistent`` (``allreduce_init`` + ``start``/``wait``) when
  commkit has it, and ``check`` (``COMMKIT_DEBUG=check``).

Each cell is the median over sweeps of the mean time per call within a sweep;
the spread column is (max - min) / median over the sweeps of the ``auto``
variant. The 1-minute load average before and after the run is printed.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the checkout's commkit
if HERE not in sys.path:
    sys.path.insert(0, HERE)  # the benchmark helpers

import commkit as ck  # noqa: E402
from _tasks import calibration, calibration_line  # noqa: E402
from mpi4py import MPI  # noqa: E402

COLLECTIVES = ("allreduce", "broadcast", "reduce", "allgather", "alltoall", "reduce_scatter", "barrier")


def _variants(c, raw, collective, nbytes, rng):
    """The callables to time for one cell: name -> fn(), sharing buffers."""
    p, r = c.size, c.rank
    n = max(nbytes // 4, 1)
    f32 = np.float32
    x = rng.standard_normal(n).astype(f32)
    out = np.empty_like(x)
    v = {}
    if collective == "allreduce":
        v["raw"] = lambda: raw.Allreduce(x, out, MPI.SUM)
        v["raw in place"] = lambda: raw.Allreduce(MPI.IN_PLACE, out, MPI.SUM)
        v["auto"] = lambda: c.allreduce(x, out=out)
        v["auto in place"] = lambda: c.allreduce(out, out=out)
        v["native"] = lambda: c.allreduce(x, out=out, algorithm="native")
        tmp = np.empty_like(x)
        if p == 2:
            peer = 1 - r

            def floor():
                raw.Sendrecv([x, MPI.BYTE], peer, 0, [tmp, MPI.BYTE], peer, 0)
                np.add(x, tmp, out=out)
            v["floor"] = floor
        if hasattr(c, "allreduce_init"):
            req = c.allreduce_init(x, out=out)

            def persistent():
                req.start()
                req.wait()
            v["persistent"] = persistent
        checked = c.dup()
        checked.check = True
        v["check"] = lambda: checked.allreduce(x, out=out)
    elif collective == "broadcast":
        v["raw"] = lambda: raw.Bcast(out, 0)
        v["auto in place"] = lambda: c.broadcast(out, root=0, out=out)
        v["auto"] = lambda: c.broadcast(x, root=0, out=out)
        v["native"] = lambda: c.broadcast(out, root=0, out=out, algorithm="native")
    elif collective == "reduce":
        v["raw"] = lambda: raw.Reduce(x, out, MPI.SUM, 0)
        v["auto"] = lambda: c.reduce(x, root=0, out=out if r == 0 else None)
        v["native"] = lambda: c.reduce(x, root=0, out=out if r == 0 else None, algorithm="native")
    elif collective == "allgather":
        big = np.empty((p, n), f32)
        v["raw"] = lambda: raw.Allgather(x, big)
        v["auto"] = lambda: c.allgather(x, out=big)
        v["native"] = lambda: c.allgather(x, out=big, algorithm="native")
    elif collective == "alltoall":
        m = max(n // p, 1)
        a, b = rng.standard_normal((p, m)).astype(f32), np.empty((p, m), f32)
        v["raw"] = lambda: raw.Alltoall(a, b)
        v["auto"] = lambda: c.alltoall(a, out=b)
        v["native"] = lambda: c.alltoall(a, out=b, algorithm="native")
    elif collective == "reduce_scatter":
        m = max(n // p, 1)
        a, b = rng.standard_normal(p * m).astype(f32), np.empty(m, f32)
        v["raw"] = lambda: raw.Reduce_scatter_block(a, b, MPI.SUM)
        v["auto"] = lambda: c.reduce_scatter(a, out=b)
        v["native"] = lambda: c.reduce_scatter(a, out=b, algorithm="native")
    elif collective == "barrier":
        v["raw"] = raw.Barrier
        v["auto"] = c.barrier
        v["native"] = lambda: c.barrier(algorithm="native")
    return v, x


def _time(fn, calls, raw):
    raw.Barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="8,1024", help="message sizes in bytes (default 8,1024)")
    parser.add_argument("--collectives", default=",".join(COLLECTIVES))
    parser.add_argument("--sweeps", type=int, default=7)
    parser.add_argument("--calls", type=int, default=5000, help="calls per variant per sweep")
    parser.add_argument("--quick", action="store_true", help="2 sweeps of 200 calls")
    parser.add_argument("--markdown", help="also write the table as Markdown to this file")
    args = parser.parse_args(argv)
    if args.quick:
        args.sweeps, args.calls = 2, 200
    np.seterr(all="ignore")
    c = ck.init()
    raw = MPI.COMM_WORLD.Dup()
    load0 = os.getloadavg()[0]
    state = calibration(raw)
    rows = []
    for collective in args.collectives.split(","):
        for nbytes in [int(s) for s in args.sizes.split(",")]:
            if collective == "barrier" and rows and rows[-1][0] == "barrier":
                continue
            rng = np.random.default_rng(1234 + c.rank)
            variants, x = _variants(c, raw, collective, nbytes, rng)
            names = list(variants)
            for fn in variants.values():  # warm up: plans, caches, first-touch
                for _ in range(20):
                    fn()
            samples = {name: [] for name in names}
            for sweep in range(args.sweeps):
                # New data each sweep, so no variant only measures a warm cache. (The in-place variants
                # keep summing into their own result; its values may overflow, which costs nothing.)
                x[...] = rng.standard_normal(x.shape)
                k = sweep % len(names)
                for name in names[k:] + names[:k]:
                    samples[name].append(_time(variants[name], args.calls, raw))
            med = {name: float(np.median(s)) for name, s in samples.items()}
            auto = np.array(samples["auto"])
            spread = float((auto.max() - auto.min()) / np.median(auto))
            rows.append((collective, nbytes if collective != "barrier" else 0, med, spread))
    load1 = os.getloadavg()[0]
    state = calibration_line(state, calibration(raw))
    if c.rank != 0:
        return 0
    lines = [
        f"{c.size} ranks, {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} cores, "
        f"{MPI.Get_library_version().splitlines()[0].strip()}, mpi4py {__import__('mpi4py').__version__}, "
        f"numpy {np.__version__}; {args.sweeps} sweeps x {args.calls} calls per variant; "
        f"load average {load0:.2f} -> {load1:.2f}",
        "",
        state[0].upper() + state[1:] + ".",
        "",
        "Command: `mpiexec -n %d python benchmarks/call_cost.py %s`" % (c.size, " ".join(argv or sys.argv[1:])),
        "",
        "| collective | bytes | variant | time (us) | vs raw mpi4py | spread of auto |",
        "|---|---|---|---|---|---|",
    ]
    for collective, nbytes, med, spread in rows:
        base = med["raw"]
        for name, t in med.items():
            lines.append(f"| {collective} | {nbytes} | {name} | {t * 1e6:.2f} | {t / base:.2f} | "
                         f"{spread:.2f} |" if name == "auto" else
                         f"| {collective} | {nbytes} | {name} | {t * 1e6:.2f} | {t / base:.2f} | |")
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
