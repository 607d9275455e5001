#!/usr/bin/env python
"""commkit's collectives against the MPI library's own, in one command.

    python benchmarks/compare.py                     # the full comparison; rewrites docs/benchmarks.md
    python benchmarks/compare.py --quick --out DIR   # the CI smoke: two sizes, a few runs, into DIR

What it runs, each part in its own job (started through ``commkit._mpiexec``,
in its own process group, and ended -- the whole group -- when it finishes,
fails, times out or the script is interrupted):

1. 2 ranks: the raw mpi4py call on a ``Dup`` of COMM_WORLD (what a user would
   otherwise write) against commkit ``auto`` and commkit ``native`` (its own
   path to the same library call), each out of place and, for allreduce,
   broadcast and reduce, in place (``out=x``; raw: ``MPI.IN_PLACE``, and
   ``MPI_Bcast``, which is in place), for allreduce, broadcast, reduce,
   allgather, reduce_scatter and alltoall, 4 B to 64 MiB in powers of 2,
   interleaved on the same buffers, in several separate sweeps with new data
   each, so that every ratio has the spread of repeated runs;
2. every commkit algorithm with ``auto`` and ``native``, for 2 ranks and the
   other ``--ranks`` (3 and 4 oversubscribe a 2-core machine: reported, not
   targeted): the crossovers behind the selection table;
3. the fixed cost of one call: a tiny allreduce against the raw mpi4py
   ``Sendrecv`` + ``np.add`` its schedule performs, and against a transport
   that moves nothing;
4. peak RSS of a 64 MiB allreduce per algorithm, each in a fresh job;
5. torch.distributed with gloo (loopback TCP), interleaved with commkit in the
   same job -- skipped, with a note, when torch is not installed.

The memory-work floor of a 2-rank allreduce and the in-place table of every
algorithm are separate scripts (``memory_floor.py``, ``inplace.py``); their
tables are pasted, with their commands, into a block of the page that this
script keeps, as it keeps the hand-written analysis.

Then it writes ``OUT/benchmarks.md``, ``OUT/_static/benchmarks.png`` and
``OUT/_static/benchmarks_algorithms.png`` and the raw results as JSON; the
analysis block of an existing page is kept. Exit status: 0, or 1 if any
result was wrong, or 2 on a usage error or a failed job.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
if ROOT not in sys.path:
    sys.path.insert(1, ROOT)  # the checkout's commkit, also when it is not installed

COLLECTIVES = ("allreduce", "broadcast", "reduce", "allgather", "reduce_scatter", "alltoall")
DEFAULT_OUT = os.path.join(ROOT, "docs")
DEFAULT_DATA = os.path.join(HERE, "results.json")

# Variables that would change what is measured: a forced algorithm or tuning file
# replaces the shipped selection, and a timeout turns every blocking call into a
# polled nonblocking one. The jobs run without them (the page says so).
_CLEARED_PREFIXES = ("COMMKIT_",)
_KEPT = ("COMMKIT_MPIEXEC",)


class JobFailed(RuntimeError):
    """A benchmark job exited with an error or ran out of time."""


def _parser():
    parser = argparse.ArgumentParser(
        prog="benchmarks/compare.py",
        description="Run commkit's collectives against the MPI library's own (and torch gloo) and write "
                    "docs/benchmarks.md with its plots. Starts its own mpiexec jobs.")
    parser.add_argument("--quick", action="store_true",
                        help="the CI smoke: 2 sizes, a few runs, 2 ranks; writes into --out (default: a new "
                             "temporary directory), never into docs/")
    parser.add_argument("--out", metavar="DIR",
                        help="where benchmarks.md and _static/benchmarks*.png go (default: docs/)")
    parser.add_argument("--data", metavar="PATH",
                        help="raw results as JSON (default: benchmarks/results.json, or OUT/benchmarks.json "
                             "when --out is given)")
    parser.add_argument("--ranks", metavar="LIST", help="rank counts for the every-algorithm sweep "
                                                        "(default 2,3,4; --quick: 2); 2 ranks always run")
    parser.add_argument("--repeats", type=int, metavar="N", help="sweeps of the 2-rank comparison (default 3)")
    parser.add_argument("--collectives", metavar="LIST", help=f"subset of {','.join(COLLECTIVES)}")
    parser.add_argument("--max-size", metavar="SIZE", help="largest size (default 64M)")
    parser.add_argument("--skip", metavar="LIST", default="",
                        help="parts to leave out: detail, overhead, rss, gloo")
    parser.add_argument("--tuning", metavar="PATH",
                        help="measure with this tuning file (COMMKIT_TUNING) instead of the shipped table only: "
                             "to test proposed thresholds; the page says so at the top")
    parser.add_argument("--from", dest="from_json", metavar="PATH",
                        help="do not measure: re-render the page and figures from saved results")
    parser.add_argument("--timeout", type=float, default=1800, metavar="S",
                        help="seconds before a job is ended (default 1800)")
    parser.add_argument("--worker", nargs=2, metavar=("SPEC", "RESULT"), help=argparse.SUPPRESS)
    return parser


def _split(text):
    return [v.strip() for v in (text or "").split(",") if v.strip()]


# -- running jobs --------------------------------------------------------------------------------------


def _env(tuning=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith(_CLEARED_PREFIXES) or k in _KEPT}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = "1"
    if tuning:
        env["COMMKIT_TUNING"] = tuning
    return env


def _cleared():
    return sorted(k for k in os.environ if k.startswith(_CLEARED_PREFIXES) and k not in _KEPT)


class Runner:
    """Starts each job (under mpiexec, or one plain process) and ends all of its processes afterwards."""

    def __init__(self, workdir, timeout, tuning=None):
        self.workdir = workdir
        self.timeout = timeout
        self.tuning = tuning
        self.count = 0

    def __call__(self, nprocs, spec, what):
        from commkit._mpiexec import mpiexec_command, process_group

        self.count += 1
        spec_path = os.path.join(self.workdir, f"spec{self.count}.json")
        result_path = os.path.join(self.workdir, f"result{self.count}.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        argv = [sys.executable, os.path.abspath(__file__), "--worker", spec_path, result_path]
        cmd = mpiexec_command(nprocs, argv) if nprocs else argv
        print(f"[{time.strftime('%H:%M:%S')}] {what}", file=sys.stderr, flush=True)
        # Whatever happened, no process of the job outlives it, nor what it left in /dev/shm.
        with process_group(cmd, env=_env(self.tuning), cwd=ROOT) as proc:
            try:
                code = proc.wait(self.timeout)
            except subprocess.TimeoutExpired:
                raise JobFailed(f"{what}: no result after {self.timeout:g} s; the job was ended.") from None
        if code != 0 or not os.path.exists(result_path):
            raise JobFailed(f"{what}: the job exited with status {code} (its output is above).")
        with open(result_path) as f:
            return json.load(f)


class LoadSampler:
    """The 1-minute load average every ``every`` seconds, in a daemon thread."""

    def __init__(self, every=5.0):
        self.every = every
        self.samples = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.start = os.getloadavg()

    def _run(self):
        t0 = time.time()
        while not self._stop.is_set():
            self.samples.append((round(time.time() - t0, 1), os.getloadavg()[0]))
            self._stop.wait(self.every)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def summary(self):
        return {"start": self.start, "end": os.getloadavg(), "every": self.every, "samples": self.samples}


# -- the plan ------------------------------------------------------------------------------------------


def _sizes(max_size, factor):
    sizes, size = [], 4
    while size <= max_size:
        sizes.append(size)
        size *= factor
    return sizes


def plan(args):
    """The jobs to run, as (description, nprocs, spec, result key)."""
    from commkit.bench import parse_size

    collectives = _split(args.collectives) or list(COLLECTIVES)
    for c in collectives:
        if c not in COLLECTIVES:
            raise SystemExit(f"compare.py: unknown collective {c!r}; expected some of {', '.join(COLLECTIVES)}.")
    skip = set(_split(args.skip))
    unknown = skip - {"detail", "overhead", "rss", "gloo"}
    if unknown:
        raise SystemExit(f"compare.py: --skip takes detail, overhead, rss, gloo; got {sorted(unknown)}.")
    ranks = sorted({2, *(int(r) for r in _split(args.ranks or ("2" if args.quick else "2,3,4")))})
    if ranks[0] < 2:
        raise SystemExit("compare.py: --ranks must be 2 or more.")
    max_size = parse_size(args.max_size or ("64K" if args.quick else "64M"))
    repeats = args.repeats or (2 if args.quick else 3)
    if repeats < 1:
        raise SystemExit("compare.py: --repeats must be at least 1.")
    if args.quick:
        main_sizes = detail_sizes = [4, max_size]
        timing = {"budget": 0.01, "min_iters": 3, "max_iters": 5, "warmup": 1}
        detail_timing = timing
        gloo_timing = timing
        overhead = {"counts": [1], "blocks": 5, "calls": 20}
        null = {"counts": [1], "blocks": 5, "calls": 100}
        rss = {"bytes": 1 << 20, "runs": 1, "algorithms": ["auto", "native"]}
    else:
        main_sizes = _sizes(max_size, 2)
        detail_sizes = _sizes(max_size, 4)
        timing = {"budget": 0.6, "min_iters": 15, "max_iters": 400, "warmup": 10}
        detail_timing = {"budget": 0.3, "min_iters": 7, "max_iters": 150, "warmup": 5}
        gloo_timing = {"budget": 0.3, "min_iters": 7, "max_iters": 200, "warmup": 10}
        overhead = {"counts": [1, 16, 256], "blocks": 60, "calls": 200}
        null = {"counts": [1, 16, 256], "blocks": 60, "calls": 2000}
        rss = {"bytes": 64 << 20, "runs": 3,
               "algorithms": ["auto", "native", "recursive_doubling", "ring", "rabenseifner", "naive"]}
    jobs = [("machine and versions", 0, {"task": "machine"}, "machine")]
    base = {"task": "bench", "collectives": collectives, "op": "sum", "dtype": "float32"}
    jobs.append(("2 ranks: raw mpi4py vs commkit auto and native, in and out of place, every size", 2,
                 dict(base, raw=True, bases=["raw", "auto", "native"], sizes=main_sizes, repeats=repeats,
                      **timing), "bench/2"))
    if "overhead" not in skip:
        jobs.append(("2 ranks: fixed overhead of one call", 2, dict(overhead, task="overhead"), "overhead"))
        jobs.append(("1 process: per-call Python with a null transport", 0, dict(null, task="null"), "null"))
    if "rss" not in skip and "allreduce" in collectives:
        for alg in rss["algorithms"]:
            jobs.append((f"2 ranks: peak RSS of allreduce, {alg}", 2,
                         {"task": "rss", "algorithm": alg, "bytes": rss["bytes"], "runs": rss["runs"]}, "rss"))
    if "gloo" not in skip:
        jobs.append(("2 ranks: commkit vs torch.distributed gloo", 2,
                     dict(base, task="gloo", sizes=main_sizes, repeats=1 if args.quick else 2, **gloo_timing), "gloo"))
    if "detail" not in skip:
        for p in ranks:
            jobs.append((f"{p} ranks: every algorithm" + (" (oversubscribed)" if p > (os.cpu_count() or 1) else ""),
                         p, dict(base, names=None, sizes=detail_sizes, repeats=1, **detail_timing), f"detail/{p}"))
    meta = {"tuning": args.tuning, "collectives": collectives, "repeats": repeats, "quick": bool(args.quick), "ranks": ranks,
            "sizes": main_sizes, "detail_sizes": detail_sizes}
    return jobs, meta


def _torch_missing():
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return "torch is not installed (it is not a commkit dependency); `pip install torch` to add this comparison."
    return None


def _git():
    import _tasks

    return _tasks.git_revision(ROOT)


def measure_all(args, command):
    jobs, meta = plan(args)
    results = {"meta": meta}
    started = time.time()
    revision = _git()
    with tempfile.TemporaryDirectory(prefix="commkit-compare-") as workdir, LoadSampler() as load:
        run = Runner(workdir, args.timeout, args.tuning)
        for what, nprocs, spec, key in jobs:
            if spec["task"] == "gloo":
                missing = _torch_missing()
                if missing:
                    print(f"[{time.strftime('%H:%M:%S')}] gloo skipped: {missing}", file=sys.stderr, flush=True)
                    results["gloo"] = {"skipped": missing}
                    continue
            before = os.getloadavg()[0]
            result = run(nprocs, spec, what)
            meta.setdefault("jobs", []).append({"what": what, "nprocs": nprocs,
                                                "load": [before, os.getloadavg()[0]]})
            if key == "machine":
                meta["machine"] = result
            elif key == "rss":
                results.setdefault("rss", []).append(result)
            elif "/" in key:
                part, p = key.split("/")
                results.setdefault(part, {})[p] = result
            else:
                results[key] = result
                results[key].update({k: spec[k] for k in ("blocks", "calls") if k in spec})
    if _git() != revision:
        revision = f"{revision}; the checkout changed during the run, now {_git()}"
    meta.update(load=load.summary(), seconds=time.time() - started, command=command, git=revision,
                env_removed=_cleared(),
                date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))
    return results


def wrong_results(results) -> int:
    total = 0
    for part in ("bench", "detail"):
        for job in (results.get(part) or {}).values():
            total += sum(r["wrong"] for r in job["rows"])
    total += sum(r["wrong"] for r in (results.get("gloo") or {}).get("rows", []) if r["algorithm"] != "gloo")
    total += sum(x["wrong"] for r in results.get("rss", []) for x in r["ranks"])
    return total


def _print_summary(results, page_path):
    """The ratios (the page's target tables), the load during the run and the command that reproduces it."""
    with open(page_path) as f:
        text = f.read()
    start, end = text.find("## Targets"), text.find("### Cells that miss")
    if start >= 0 and end > start:
        print(text[start:end].strip())
    meta = results["meta"]
    load = (meta.get("load") or {}).get("samples") or []
    if load:
        ones = sorted(s[1] for s in load)
        print(f"\nload average (1 min) during the run: min {ones[0]:.2f}, median {ones[len(ones) // 2]:.2f}, "
              f"max {ones[-1]:.2f}")
    print(f"reproduce: {meta.get('command', 'python benchmarks/compare.py')}\n")


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _interrupt_on_termination():
    """SIGTERM and SIGHUP end the running job the way Ctrl-C does (Python would otherwise exit at once
    and leave the job's processes, which run in their own session, behind)."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    if args.worker:
        import _tasks

        return _tasks.main(*args.worker)
    import _report

    if args.quick and not args.out:
        args.out = tempfile.mkdtemp(prefix="commkit-bench-quick-")
    out = os.path.abspath(args.out or DEFAULT_OUT)
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as exc:
        print(f"compare.py: cannot use --out {out}: {exc.strerror}.", file=sys.stderr)
        return 2
    data = args.data or (DEFAULT_DATA if args.out is None else os.path.join(out, "benchmarks.json"))
    if args.tuning:
        from commkit.errors import InvalidArgument
        from commkit.selection import load_table

        args.tuning = os.path.abspath(args.tuning)
        try:
            load_table(args.tuning)
        except InvalidArgument as exc:
            print(f"compare.py: {exc}", file=sys.stderr)
            return 2
    if args.from_json:
        with open(args.from_json) as f:
            results = json.load(f)
    else:
        _interrupt_on_termination()
        shown = ["python", "benchmarks/compare.py"] + [a for a in argv if not a.startswith("--worker")]
        try:
            results = measure_all(args, shlex.join(shown))
        except JobFailed as exc:
            print(f"compare.py: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("compare.py: interrupted; every job it started was ended.", file=sys.stderr)
            return 130
        results["meta"]["data_path"] = os.path.relpath(data, ROOT) if data.startswith(ROOT) else data
        with open(data, "w") as f:
            json.dump(results, f, separators=(",", ":"))
    paths = _report.write(results, out)
    wrong = wrong_results(results)
    _print_summary(results, paths["page"])
    print(f"wrote {paths['page']}")
    for key in ("main", "algorithms"):
        if key in paths:
            print(f"wrote {paths[key]}")
    if not args.from_json:
        print(f"wrote {data}")
    if wrong:
        print(f"compare.py: {wrong} wrong result(s); see the wrong columns.", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
