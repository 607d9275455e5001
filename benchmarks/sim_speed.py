"""How fast the simulator runs: wall time and steps per second of every algorithm at a given p and size.

Usage::

    python benchmarks/sim_speed.py                          # every algorithm at p = 1024 and 4096, 1 MiB
    python benchmarks/sim_speed.py -p 4096 -a allreduce_ring,broadcast_ring
    python benchmarks/sim_speed.py --no-symmetry -p 1024    # the event engine alone (every rank simulated)
    python benchmarks/sim_speed.py --json out.json          # also write the rows as JSON
    python benchmarks/sim_speed.py --model loggp -p 1024    # another timing model's engine (see docs/cost_models.md)
    python benchmarks/sim_speed.py --engine-rate            # generators alone vs the engine, every rank run
    python benchmarks/sim_speed.py --engine-rate -p 1024 -a allreduce_ring,alltoall_pairwise,scan_recursive_doubling

Each measurement runs in a fresh Python process (no warm caches carried from
one algorithm to the next) and is stopped after ``--timeout`` seconds. The
columns: ``steps`` is the number of schedule steps the call consists of (all
ranks together); ``ranks run`` is how many ranks' schedules the simulator
actually ran (p, or one per class of equivalent ranks when it uses a
declared symmetry); ``steps run`` is how many steps it ran one by one
(fewer than ``steps`` where one rank stood for the others, or a symmetric
phase was computed for all ranks at once); ``steps/s`` is steps divided by
CPU time, so with symmetry it counts the steps the result stands for. The script works
against older commkit checkouts too (run it with ``PYTHONPATH`` pointing at
one) to measure before and after a change. ``cpu (s)`` is the process's CPU
time, which a busy machine disturbs less than the wall time.

``--engine-rate`` asks what a per-step engine can reach at all. For each
algorithm it runs, in a fresh process, every rank's schedule generator alone
(``for step in schedule: pass``, no simulation), then the simulation of every
rank (``use_symmetry=False``), and prints the steps per CPU second of each and
of the engine's own share (the simulation's time less the generators'). The
engine draws every step from a generator, so it can never run faster than the
generators alone: if they yield fewer than 2 million steps a second, no engine
that takes steps one by one in CPython reaches that rate.
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
            "steps_run": getattr(res, "steps_run", 0) or _steps_run(res, p), "ok": res.ok,
            "model": model or "alpha-beta", "fallback": getattr(res, "fallback", None)}


def _say_why_every_rank(collective: str, algorithm: str, p: int, nbytes: int, symmetry: bool, model) -> None:
    """Print, before simulating, a JSON line saying why every rank will run (so a run stopped later has said)."""
    from commkit import sim

    why_every_rank = getattr(sim, "why_every_rank", None)  # older checkouts cannot say
    if why_every_rank is not None and symmetry:
        print(json.dumps({"why_every_rank": why_every_rank(collective, algorithm, p, nbytes, model=model)}), flush=True)


def _steps_run(res, p) -> int:
    """Steps run one by one, for checkouts whose results do not say (rank 0's, or all of them)."""
    return res.steps // p if getattr(res, "ranks_simulated", p) == 1 else res.steps


def _rate(collective: str, algorithm: str, p: int, nbytes: int) -> dict:
    """Generators alone against the engine that runs every rank, in this process; return the row."""
    from commkit import algorithms, collectives, sim
    from commkit.ops import get_op

    alg = algorithms.get(collective, algorithm)
    count, _ = sim.schedule_args(collective, p, nbytes)
    op = get_op("sum")
    cpu = time.process_time()
    steps = 0
    for rank in range(p):
        for _ in collectives.steps(alg.schedule, collective, rank, p, count, op, 0):
            steps += 1
    generators = time.process_time() - cpu
    cpu = time.process_time()
    res = sim.simulate(collective, algorithm, p, nbytes, use_symmetry=False)
    engine = time.process_time() - cpu
    return {"collective": collective, "algorithm": algorithm, "p": p, "nbytes": nbytes, "steps": steps,
            "engine_steps": res.steps, "generators_cpu": generators, "engine_cpu": engine,
            "python": sys.version.split()[0]}


def _rate_table(args, nbytes, procs, only) -> list:
    """Run ``_rate`` for each algorithm in a fresh process and print generator-only against engine steps/s."""

    def per_s(steps, cpu):
        return f"{steps / cpu / 1e6:.2f} M" if cpu > 0 else "-"

    print(f"{'algorithm':<36} {'p':>5} {'steps':>10} {'generators alone':>17} {'engine, all ranks':>18} "
          f"{'engine own share':>17}  (steps per CPU second)", flush=True)

    def line(row):
        own = row["engine_cpu"] - row["generators_cpu"]
        return (f"{row['steps']:>10} {per_s(row['steps'], row['generators_cpu']):>17} "
                f"{per_s(row['steps'], row['engine_cpu']):>18} {per_s(row['steps'], own):>17}")

    return _each_in_a_process(args, nbytes, procs, only, ["--one-rate"], line, lambda: f" > {args.timeout:g} s")


def _each_in_a_process(args, nbytes, procs, only, flags, line, timed_out) -> list:
    """Run this script with ``flags`` for each algorithm and p in a fresh process; print a line per run.

    ``line(row)`` formats a finished run's JSON row after its name and p; ``timed_out()`` the cell of
    a run stopped at ``args.timeout``. Returns the rows (a stopped run's row says so, a failed one
    carries its error).
    """
    rows = []
    for p in procs:
        for collective, name in _algorithms(only):
            cmd = [sys.executable, os.path.abspath(__file__), *flags[:1], collective, name, str(p), str(nbytes),
                   *flags[1:]]
            head = f"{collective + '_' + name:<36} {p:>5} "
            try:
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, check=True)
                row = json.loads(out.stdout.strip().splitlines()[-1])
                text = head + line(row)
            except subprocess.TimeoutExpired:
                row = {"collective": collective, "algorithm": name, "p": p, "nbytes": nbytes, "wall": None,
                       "timeout": args.timeout}
                text = head + timed_out()
            except subprocess.CalledProcessError as exc:
                row = {"collective": collective, "algorithm": name, "p": p, "error": exc.stderr.strip()[-300:]}
                text = head + f" error: {row['error'].splitlines()[-1]}"
            rows.append(row)
            print(text, flush=True)
    return rows


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
    parser.add_argument("-p", "--procs", help="comma-separated process counts (default 1024,4096; "
                        "1024 with --engine-rate)")
    parser.add_argument("-s", "--size", default="1M", help="message size as the selector counts it (default 1M)")
    parser.add_argument("-a", "--algorithms", help="comma-separated collective_algorithm names (default: all; "
                        "allreduce_ring with --engine-rate)")
    parser.add_argument("--no-symmetry", action="store_true", help="simulate every rank (the event engine alone)")
    parser.add_argument("--model", help="the simulator's timing model, e.g. loggp (default: alpha-beta)")
    parser.add_argument("--engine-rate", action="store_true",
                        help="print the schedule generators' steps/s alone against the engine's (every rank run)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per measurement (default 600)")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--one", nargs=4, metavar=("COLL", "ALG", "P", "BYTES"), help=argparse.SUPPRESS)
    parser.add_argument("--one-rate", nargs=4, metavar=("COLL", "ALG", "P", "BYTES"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        coll, alg, p, nbytes = args.one
        _say_why_every_rank(coll, alg, int(p), int(nbytes), not args.no_symmetry, args.model)
        print(json.dumps(_one(coll, alg, int(p), int(nbytes), not args.no_symmetry, args.model)))
        return 0
    if args.one_rate:
        coll, alg, p, nbytes = args.one_rate
        print(json.dumps(_rate(coll, alg, int(p), int(nbytes))))
        return 0
    nbytes = _parse_size(args.size)
    procs = [int(x) for x in (args.procs or ("1024" if args.engine_rate else "1024,4096")).split(",")]
    only = set(args.algorithms.split(",")) if args.algorithms else ({"allreduce_ring"} if args.engine_rate else None)
    if args.engine_rate:
        rows = _rate_table(args, nbytes, procs, only)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"nbytes": nbytes, "engine_rate": True, "python": sys.version.split()[0], "rows": rows},
                          f, indent=1)
        return 0
    print(f"{'algorithm':<36} {'p':>5} {'wall (s)':>9} {'cpu (s)':>9} {'steps':>10} {'ranks run':>9} "
          f"{'steps run':>10} {'steps/s':>9}", flush=True)
    flags = ["--one"] + (["--no-symmetry"] if args.no_symmetry else []) + (["--model", args.model] if args.model else [])

    def line(row):
        rate = f"{row['steps'] / row['cpu'] / 1e6:.2f} M" if row["cpu"] > 0 else "-"
        return (f"{row['wall']:>9.2f} {row['cpu']:>9.2f} {row['steps']:>10} {row['ranks_run']:>9} "
                f"{row['steps_run']:>10} {rate:>9}")

    rows = _each_in_a_process(args, nbytes, procs, only, flags, line, lambda: f"{'> ' + format(args.timeout, 'g'):>9}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"nbytes": nbytes, "symmetry": not args.no_symmetry, "model": args.model or "alpha-beta",
                       "python": sys.version.split()[0],
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
