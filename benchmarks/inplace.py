#!/usr/bin/env python
"""In place against out of place, for every collective and algorithm that allows ``out=x``.

    python benchmarks/inplace.py                          # starts its own 2-rank mpiexec job
    mpiexec -n 2 python benchmarks/inplace.py             # the same, inside a job you started
    python benchmarks/inplace.py --quick                  # a smoke run (seconds)
    python benchmarks/inplace.py --markdown FILE          # also write the table as Markdown

For each collective whose description allows in place (``commkit.collectives``:
broadcast, reduce, allreduce, scan, exscan), each algorithm that applies on
this many ranks, commkit's ``native`` path and the raw mpi4py call on a ``Dup``
of COMM_WORLD (``MPI.IN_PLACE``; the raw ``MPI_Bcast`` has one form, it is in
place), it times the call out of place (``out=out``) and in place (``out=x``)
at each size. Every form of a collective runs on the same buffers, interleaved
(the order rotates every run), an ``MPI_Barrier`` before each run, a run's time
its slowest rank's; before an in-place run the input is copied into the output,
untimed, and every result is checked against NumPy. Each sweep draws new data
in new buffers; a cell is the median over sweeps of the per-sweep ratio in
place / out of place (each sweep's time is the median of its runs), with the
lowest and highest sweep. Target: never above 1.
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

import _tasks
import numpy as np

SIZES = "1K,64K,1M,8M"


def _parser():
    parser = argparse.ArgumentParser(prog="benchmarks/inplace.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default=SIZES, help=f"message sizes (default {SIZES})")
    parser.add_argument("--collectives", help="subset of the collectives that allow in place (default: all)")
    parser.add_argument("--sweeps", type=int, default=5, help="sweeps over every size (default 5)")
    parser.add_argument("--budget", type=float, default=0.4, help="seconds per size per sweep, about (default 0.4)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 KiB and 64 KiB, 2 sweeps, few runs")
    parser.add_argument("--markdown", metavar="FILE", help="also write the table as Markdown to FILE")
    return parser


def _collectives(args):
    from commkit import collectives

    allowed = [c.name for c in collectives.COLLECTIVES.values() if c.in_place and not c.vector]
    chosen = [c.strip() for c in (args.collectives or "").split(",") if c.strip()] or allowed
    unknown = [c for c in chosen if c not in allowed]
    if unknown:
        raise SystemExit(f"inplace.py: {unknown} take no in-place form; choose from {allowed}.")
    return chosen


def measure(comm, raw, args, collectives, sizes, loads):
    """Rows (dicts) of every form at every size and sweep; the same on every rank."""
    from commkit import bench

    spec = {"budget": args.budget, "min_iters": 3 if args.quick else 9, "max_iters": 400,
            "warmup": 1 if args.quick else 3}
    rows = []
    for sweep in range(args.sweeps):
        loads.append(os.getloadavg()[0])
        for collective in collectives:
            algorithms = bench.candidates(collective, comm.size, "sum")
            names = _tasks.form_names(collective, ["raw", *algorithms])
            for size in sizes:
                case = bench.Case(comm, collective, size, "float32", "sum", 0, np, seed=sweep)
                iters, warmup = _tasks.iterations(case.size, len(names), spec)
                for row in _tasks.measure_forms(comm, raw, case, names, iters, warmup):
                    row["rep"] = sweep
                    rows.append(row)
        if comm.rank == 0:
            print(f"  sweep {sweep + 1}/{args.sweeps} done (load {os.getloadavg()[0]:.2f})", file=sys.stderr,
                  flush=True)
    loads.append(os.getloadavg()[0])
    return rows


def _fmt(ratio):
    """Two decimals, or three where two would print 1.00 for a ratio that is not 1."""
    return f"{ratio:.3f}" if round(ratio, 2) == 1.0 and ratio != 1.0 else f"{ratio:.2f}"


def table(rows, collectives):
    """Markdown: per collective, algorithm and size, both times and the in place / out of place ratio."""
    from _report import fmt_size, fmt_us

    cells = {}
    for r in rows:
        in_place = r["algorithm"].endswith(_tasks.IN_PLACE)
        base = r["algorithm"][: -len(_tasks.IN_PLACE)] if in_place else r["algorithm"]
        cell = cells.setdefault((r["collective"], base, r["size"]), {})
        cell.setdefault(r["rep"], {})["in" if in_place else "out"] = r
    lines = [("| collective | algorithm | size | out of place (us) | in place (us) | in place / out of place | "
              "each sweep | ≤ 1 | wrong |"), "|---|---|---|---|---|---|---|---|---|"]
    above = []
    for c in collectives:
        keys = sorted((k for k in cells if k[0] == c), key=lambda k: (k[1] != "raw", k[1] == "native", k[1], k[2]))
        for key in keys:
            reps = cells[key]
            outs = [v["out"]["time_us"] for v in reps.values() if "out" in v]
            wrong = sum(x["wrong"] for v in reps.values() for x in v.values())
            pairs = [v["in"]["time_us"] / v["out"]["time_us"] for v in reps.values() if "in" in v and "out" in v]
            name = "raw mpi4py" if key[1] == "raw" else f"`{key[1]}`"
            if not pairs:  # the raw broadcast: one form, in place
                lines.append(f"| {c} | {name} | {fmt_size(key[2])} | {fmt_us(statistics.median(outs))} (in place "
                             "by nature) | – | – | – | – | " + str(wrong) + " |")
                continue
            ins = [v["in"]["time_us"] for v in reps.values() if "in" in v]
            ratio = statistics.median(pairs)
            ok = ratio <= 1.0
            if not ok:
                above.append((c, key[1], key[2], ratio))
            lines.append(f"| {c} | {name} | {fmt_size(key[2])} | {fmt_us(statistics.median(outs))} | "
                         f"{fmt_us(statistics.median(ins))} | **{_fmt(ratio)}** | {min(pairs):.2f}–{max(pairs):.2f} | "
                         f"{'yes' if ok else '**no**'} | {wrong} |")
    return "\n".join(lines), above


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(argv)
    status = _tasks.relaunch(2, __file__, argv)
    if status is not None:
        return status
    if args.quick:
        args.sizes, args.sweeps, args.budget = "1K,64K", 2, 0.01
    from mpi4py import MPI

    import commkit as ck
    from commkit.bench import parse_sizes

    collectives = _collectives(args)
    sizes = parse_sizes(args.sizes)
    comm = ck.init("mpi")
    raw = MPI.COMM_WORLD.Dup()
    loads = []
    started = time.time()
    try:
        rows = measure(comm, raw, args, collectives, sizes, loads)
        machine = _tasks.machine_line(raw)
    finally:
        raw.Free()
    if comm.rank != 0:
        return 0
    from _report import emit, fmt_size, script_header

    text, above = table(rows, collectives)
    wrong = sum(r["wrong"] for r in rows)
    head = script_header("benchmarks/inplace.py", comm.size, argv, machine,
                         f"{args.sweeps} sweeps, {time.time() - started:.0f} s", _tasks.load_line(loads), wrong)
    verdict = ("In place is never slower than out of place (median over sweeps) at any size measured."
               if not above else "In place is slower than out of place (median over sweeps) at: " + ", ".join(
                   f"{c} `{a}` {fmt_size(s)} ({_fmt(r)})" for c, a, s, r in above) + ".")
    emit("\n".join(head) + "\n" + text + "\n\n" + verdict + "\n", args.markdown)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
