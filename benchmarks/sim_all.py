"""Does the simulator hold its speed at every p? Every registered algorithm at p = 4095, 4096, 65,535 and 65,536.

Usage::

    python benchmarks/sim_all.py                         # every algorithm, 1 MiB, those four p, 60 s each at most
    python benchmarks/sim_all.py -p 4095,4096 --timeout 30
    python benchmarks/sim_all.py -a allreduce_ring,broadcast_ring --json out.json

Powers of two and their neighbours below: at 4096 and 65,536 blocks split
evenly and ranks are alike, so a declared symmetry lets rank 0 stand for all;
at 4095 and 65,535 they do not: a rotation's blocks then turn with the rank, and
rank 0's steps still stand for all, each computed for every rank with NumPy
(O(p^2) work in arrays, the slowest runs at 65,535); an algorithm that declares
classes of alike ranks (the node algorithms with a root or with slices of two
lengths) runs one rank of each class; a schedule in chunks (alltoall shm) is
evaluated chunk by chunk from the period its first chunks show; an xor symmetry
or an algorithm that declares none runs every rank one by one. The goal is every
run under ``--limit`` seconds (10 by default) on a quiet machine.

Each run is a fresh Python process (``sim_speed.py --one``), stopped after
``--timeout`` seconds, so one slow case cannot hide the others and no cache
carries over. A progress line is printed as each run ends; at the end come the
slowest runs, every run over the limit, and for each of those why the simulator
ran every rank one by one (``SimResult.fallback``). The limits and the ranking
are in CPU seconds of that process, which a loaded machine disturbs far less
than wall seconds (both are printed): its runs take longer by the clock, but
the same ones stop.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import sim_speed  # noqa: E402 - the one-run worker and the algorithm list live there

PROCS = (4095, 4096, 65535, 65536)
WALL_FACTOR = 20  # wall-clock limit per run, in CPU-time limits: room for a machine 20 times oversubscribed


def _limits(seconds: float, memory: int):
    """A child's limits: the kernel stops it (SIGXCPU) after ``seconds`` of its own CPU time, and
    refuses it more than ``memory`` bytes (a MemoryError), so that no run can take the machine's memory."""
    limit = max(1, math.ceil(seconds))

    def apply():
        resource.setrlimit(resource.RLIMIT_CPU, (limit, limit + 1))
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    return apply


def _lines(text) -> list:
    """The JSON objects a run printed, one a line (a stopped run's partial output included)."""
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    rows = []
    for line in (text or "").splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
    return rows


def _child_env() -> dict:
    """The environment of a run: the commkit this script imported comes first on its path too."""
    import commkit

    here = os.path.dirname(os.path.dirname(os.path.abspath(commkit.__file__)))
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": here + (os.pathsep + path if path else "")}


def _run(collective: str, name: str, p: int, nbytes: int, timeout: float, memory: int) -> dict:
    """One simulation in a fresh process; its row (``wall`` None when it was stopped, ``error`` if it failed).

    The limit is on the process's CPU time, which other work on a busy machine barely changes,
    so a loaded machine stops the same runs as a quiet one; a wall-clock limit of ``WALL_FACTOR``
    times that catches a run that waits instead of computing. The run prints why it will run
    every rank before it starts (``sim_speed.py``), so a stopped run has said it too.
    """
    cmd = [sys.executable, os.path.join(HERE, "sim_speed.py"), "--one", collective, name, str(p), str(nbytes)]
    row = {"collective": collective, "algorithm": name, "p": p, "nbytes": nbytes}
    started = time.perf_counter()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout * WALL_FACTOR,
                             preexec_fn=_limits(timeout, memory), env=_child_env())
    except subprocess.TimeoutExpired as exc:
        said = {k: v for line in _lines(exc.stdout) for k, v in line.items()}
        return {**row, **said, "wall": None, "timeout": timeout, "elapsed": time.perf_counter() - started}
    elapsed = time.perf_counter() - started
    said = {k: v for line in _lines(out.stdout) for k, v in line.items()}
    if out.returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        return {**row, **said, "wall": None, "timeout": timeout, "elapsed": elapsed}
    if out.returncode != 0:
        lines = out.stderr.strip().splitlines() or [f"exit status {out.returncode}, no output"]
        return {**row, **said, "wall": None, "error": lines[-1], "elapsed": elapsed}
    return {**row, **said, "elapsed": elapsed}


def _cell(row) -> str:
    if "timeout" in row:
        return f"> {row['timeout']:g} s cpu (stopped)"
    if "error" in row:
        return f"error: {row['error']}"
    if row["ranks_run"] == 1:
        how = "one rank for all"
    elif row["ranks_run"] < row["p"]:
        how = f"a rank for each of {row['ranks_run']} classes"
    else:
        how = "symmetric phase" if row["steps_run"] < row["steps"] else "every rank"
    return f"{row['wall']:8.2f} s wall {row['cpu']:8.2f} s cpu  {row['steps']:>12} steps  ({how})"


def _seconds(row) -> float:
    """How long a run took, for ranking and the limit: its CPU time, or the limit it was stopped at."""
    if "timeout" in row:
        return row["timeout"]
    return row["cpu"] if "cpu" in row else 0.0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-p", "--procs", default=",".join(map(str, PROCS)),
                        help="comma-separated process counts (default 4095,4096,65535,65536)")
    parser.add_argument("-s", "--size", default="1M", help="message size as the selector counts it (default 1M)")
    parser.add_argument("-a", "--algorithms", help="comma-separated collective_algorithm names (default: all)")
    parser.add_argument("--timeout", type=float, default=60,
                        help="CPU seconds before a run is stopped (default 60)")
    parser.add_argument("--limit", type=float, default=10, help="the goal in CPU seconds per run (default 10)")
    parser.add_argument("--memory", type=float, default=4,
                        help="GiB of address space a run may take before it fails (default 4)")
    parser.add_argument("--slowest", type=int, default=10, help="how many of the slowest runs to list (default 10)")
    parser.add_argument("--json", help="also write every row to this file")
    args = parser.parse_args(argv)
    nbytes = sim_speed._parse_size(args.size)
    procs = [int(x) for x in args.procs.split(",")]
    only = set(args.algorithms.split(",")) if args.algorithms else None
    runs = [(c, n, p) for p in procs for c, n in sim_speed._algorithms(only)]
    if not runs:
        parser.error(f"no registered algorithm is named {sorted(only)}")
    print(f"{len(runs)} runs: every algorithm at p = {', '.join(map(str, procs))}, {nbytes} B, "
          f"each in its own process, stopped after {args.timeout:g} s of CPU time or {args.memory:g} GiB", flush=True)
    rows = []
    for i, (collective, name, p) in enumerate(runs, 1):
        row = _run(collective, name, p, nbytes, args.timeout, int(args.memory * (1 << 30)))
        rows.append(row)
        print(f"[{i:>3}/{len(runs)}] {collective + '_' + name:<36} p={p:<6} {_cell(row)}", flush=True)
    ranked = sorted(rows, key=_seconds, reverse=True)
    print(f"\nslowest {min(args.slowest, len(ranked))}:", flush=True)
    for row in ranked[:args.slowest]:
        print(f"  {row['collective'] + '_' + row['algorithm']:<36} p={row['p']:<6} {_cell(row)}")
    over = [row for row in ranked if _seconds(row) > args.limit or "timeout" in row or "error" in row]
    print(f"\nover {args.limit:g} s of CPU time, stopped or failed: {len(over)} of {len(rows)}")
    for row in over:
        why = row.get("fallback") or row.get("why_every_rank")
        print(f"  {row['collective'] + '_' + row['algorithm']:<36} p={row['p']:<6} {_cell(row)}"
              + (f"\n      every rank ran one by one: {why}" if why else ""), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"nbytes": nbytes, "limit": args.limit, "python": sys.version.split()[0], "rows": rows}, f,
                      indent=1)
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
