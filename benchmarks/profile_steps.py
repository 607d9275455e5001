#!/usr/bin/env python
"""Where a collective's time goes, step by step: the profile behind the notes in docs/benchmarks.md.

    python benchmarks/profile_steps.py allreduce 16M
    python benchmarks/profile_steps.py broadcast 64M -a binomial,ring -n 2 -i 15

Runs the named commkit algorithms (default: every one that applies) and
``native`` on the same buffers, interleaved, under ``mpiexec -n N`` (started
and ended by this script), with :func:`commkit.trace` recording every schedule
step. Prints, per algorithm, the median time of the whole call and of each step
on each rank -- transfers, reductions and copies -- next to native's time, so
a gap to native can be attributed to a step. The tracer adds well under a
microsecond per step: read small sizes with that in mind.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def _parser():
    parser = argparse.ArgumentParser(prog="benchmarks/profile_steps.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("collective")
    parser.add_argument("size", help="bytes, as commkit bench counts them (4K, 16M, ...)")
    parser.add_argument("-a", "--algorithms", help="comma-separated commkit algorithms (default: all that apply)")
    parser.add_argument("-n", "--nprocs", type=int, default=2)
    parser.add_argument("-i", "--iters", type=int, default=15)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser


def _launch(args, argv) -> int:
    from commkit._mpiexec import mpiexec_command, process_group

    env = {k: v for k, v in os.environ.items() if not k.startswith("COMMKIT_") or k == "COMMKIT_MPIEXEC"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    with process_group(mpiexec_command(args.nprocs, [sys.executable, os.path.abspath(__file__), *argv, "--worker"]),
                       env=env) as proc:
        return proc.wait()


def _worker(args) -> int:
    import numpy as np

    import commkit as ck
    from commkit import bench

    comm = ck.init("mpi")
    size = bench.parse_size(args.size)
    names = [a for a in args.algorithms.split(",") if a] if args.algorithms else \
        [a for a in bench.candidates(args.collective, comm.size) if a != "native"]
    case = bench.Case(comm, args.collective, size, "float32", "sum", 0, np)
    order = names + ["native"]
    totals = {name: [] for name in order}
    with ck.trace(comm) as tracer:
        for i in range(args.iters + 2):
            shift = i % len(order)
            for name in order[shift:] + order[:shift]:
                case.poison()
                comm.barrier(algorithm="native")
                t0 = time.perf_counter()
                result = case.run(name)
                t = time.perf_counter() - t0
                assert case.correct(result), f"{name} gave a wrong result"
                if i >= 2:  # the first two rounds warm up
                    totals[name].append(max(comm.allgather_object(t)))
                else:
                    comm.allgather_object(t)
    if comm.rank != 0:
        return 0
    events = [e for e in tracer.events if e["collective"] == args.collective]
    warm = sorted({e["seq"] for e in events})
    steps = {}
    for e in events:
        steps.setdefault((e["algorithm"], e["rank"], e["step"], e["kind"], e["bytes"]), []).append(
            (e["seq"], e["end"] - e["start"]))
    skip = set(warm[: 2 * len(order)])
    print(f"{args.collective}, {bench.format_size(case.size)} B, {comm.size} ranks, median of {args.iters} runs "
          f"(ms); step times per rank (ms)")
    native = float(np.median(totals["native"])) * 1e3
    print(f"  native: {native:.3f}")
    for name in names:
        total = float(np.median(totals[name])) * 1e3
        print(f"  {name}: {total:.3f} ({total / native:.2f}x native)")
        for rank in range(comm.size):
            parts = []
            for (alg, r, step, kind, nbytes), values in sorted(steps.items()):
                if alg != name or r != rank:
                    continue
                timed = [t for seq, t in values if seq not in skip]
                if timed:
                    parts.append(f"{step}:{kind} {bench.format_size(nbytes)}B {np.median(timed) * 1e3:.3f}")
            print(f"    rank {rank}: " + "; ".join(parts))
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    if args.worker:
        return _worker(args)
    return _launch(args, argv)


if __name__ == "__main__":
    sys.exit(main())
