"""How fast the simulator runs: wall time and steps per second of every algorithm at a given p and size.

Usage::

    python benchmarks/sim_speed.py                          # every algorithm at p = 1024 and 4096, 1 MiB
    python benchmarks/sim_speed.py -p 4096 -a allreduce_ring,broadcast_ring
    python benchmarks/sim_speed.py --no-symmetry -p 1024    # the event engine alone (every rank simulated)
    python benchmarks/sim_speed.py --json out.json          # also write the rows as JSON
    python benchmarks/sim_speed.py --model loggp -p 1024    # another timing model's engine (see docs/cost_models.md)

Each measurement runs in a fresh Python process (no warm caches carried from
one algorithm to the next) and is stopped after ``--timeout`` seconds. The
columns: ``steps`` is the number of schedule steps the call consists of (all
ranks together); ``ranks run`` is how many ranks' schedules the simulator
actually ran (p, or one per class of equivalent ranks when it uses a
declared symmetry); ``steps/s`` is steps divided by CPU time, so with
symmetry it counts the steps the result stands for. The script works
against older commkit checkouts too (run it with ``PYTHONPATH`` pointing at
one) to measure before and after a change. ``cpu (s)`` is the process's CPU
time, which a busy machine disturbs less than the wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _parse_size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    text = text.strip().lower().rstrip("b")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def _one(collective: str, algorithm: str, p: int, nbytes: int, symmetry: bool, model: str | None = None) -> dict:
    """Measure one simulation in this process; return its row."""
    import inspect

    from commkit import sim

    kwargs = {}
    if "use_symmetry" in inspect.signature(sim.simulate).parameters:
        kwargs["use_symmetry"] = symmetry
    if model:
        kwargs["model"] = model
    started, cpu = time.perf_counter(), time.process_time()
    res = sim.simulate(collective, algorithm, p, nbytes, **kwargs)
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    return {"collective": collective, "algorithm": algorithm, "p": p, "nbytes": nbytes, "wall": wall, "cpu": cpu,
            "steps": res.steps, "ranks_run": getattr(res, "ranks_simulated", p) or p, "time": res.time,
            "ok": res.ok, "model": model or "alpha-beta"}


def _algorithms(only):
    from commkit import algorithms, sim

    names = []
    for collective in getattr(sim, "SIMULATED", algorithms.COLLECTIVES):  # the collectives it models
        for name, alg in sorted(algorithms.for_collective(collective).items()):
            if alg.schedule is not None and (not only or f"{collective}_{name}" in only):
                names.append((collective, name))
    return names


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-p", "--procs", default="1024,4096", help="comma-separated process counts")
    parser.add_argument("-s", "--size", default="1M", help="message size as the selector counts it (default 1M)")
    parser.add_argument("-a", "--algorithms", help="comma-separated collective_algorithm names (default: all)")
    parser.add_argument("--no-symmetry", action="store_true", help="simulate every rank (the event engine alone)")
    parser.add_argument("--model", help="the simulator's timing model, e.g. loggp (default: alpha-beta)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per measurement (default 600)")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--one", nargs=4, metavar=("COLL", "ALG", "P", "BYTES"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        coll, alg, p, nbytes = args.one
        print(json.dumps(_one(coll, alg, int(p), int(nbytes), not args.no_symmetry, args.model)))
        return 0
    nbytes = _parse_size(args.size)
    procs = [int(x) for x in args.procs.split(",")]
    only = set(args.algorithms.split(",")) if args.algorithms else None
    rows = []
    print(f"{'algorithm':<36} {'p':>5} {'wall (s)':>9} {'cpu (s)':>9} {'steps':>10} {'ranks run':>9} "
          f"{'steps/s':>9}", flush=True)
    for p in procs:
        for collective, name in _algorithms(only):
            cmd = [sys.executable, os.path.abspath(__file__), "--one", collective, name, str(p), str(nbytes)]
            if args.no_symmetry:
                cmd.append("--no-symmetry")
            if args.model:
                cmd += ["--model", args.model]
            try:
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, check=True)
                row = json.loads(out.stdout.strip().splitlines()[-1])
                rate = f"{row['steps'] / row['cpu'] / 1e6:.2f} M" if row["cpu"] > 0 else "-"
                line = (f"{collective + '_' + name:<36} {p:>5} {row['wall']:>9.2f} {row['cpu']:>9.2f} "
                        f"{row['steps']:>10} {row['ranks_run']:>9} {rate:>9}")
            except subprocess.TimeoutExpired:
                row = {"collective": collective, "algorithm": name, "p": p, "nbytes": nbytes, "wall": None,
                       "timeout": args.timeout}
                line = f"{collective + '_' + name:<36} {p:>5} {'> ' + format(args.timeout, 'g'):>9}"
            except subprocess.CalledProcessError as exc:
                row = {"collective": collective, "algorithm": name, "p": p, "error": exc.stderr.strip()[-300:]}
                line = f"{collective + '_' + name:<36} {p:>5}  error: {row['error'].splitlines()[-1]}"
            rows.append(row)
            print(line, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"nbytes": nbytes, "symmetry": not args.no_symmetry, "model": args.model or "alpha-beta",
                       "python": sys.version.split()[0],
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
