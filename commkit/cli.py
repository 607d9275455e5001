"""The ``commkit`` command: ``bench``, ``tune``, ``sim`` and ``doctor``.

``commkit bench`` and ``commkit tune`` run inside an MPI job: start them with
``mpiexec -n 4 commkit bench ...``, or let them start the job themselves with
``commkit bench -n 4 ...`` (they re-run themselves under the ``mpiexec`` that
came with the installed MPI, pass the terminal through, and end every process
they started on Ctrl-C). ``commkit sim`` needs no MPI: it runs the schedules
in the simulator and ranks the algorithms under the cost model. ``commkit
doctor LOG...`` reads the watchdog's reports from a stuck job's stderr and says
which rank diverged first.

Every error a user can cause (MPI missing, a bad size, an output path that
cannot be written) ends with one line on stderr and exit status 2, never a
traceback; a benchmark that finds a wrong result exits with status 1.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import platform
import socket
import sys

from . import algorithms
from ._mpiexec import launcher_rank, launcher_size, mpiexec_command, process_group
from .errors import AlgorithmNotApplicable, CommError, InvalidArgument, TransportUnavailable, UnsupportedOp

__all__ = ["main"]

_CHILD = "COMMKIT_CLI_CHILD"   # set in the processes `-n N` starts, so they do not start another job
_TTY = "COMMKIT_CLI_TTY"       # the launching terminal shows a progress bar although mpiexec pipes stderr


class _Usage(CommError, ValueError):
    """A command-line argument is invalid."""


def _rank() -> int:
    return launcher_rank() or 0


# -- argument parsing ---------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="commkit",
        description="commkit: collective algorithms written once as schedules. Benchmark them, tune the "
                    "selection thresholds for this machine, or simulate them for any number of ranks.",
    )
    parser.add_argument("--load", metavar="MODULES", default="",
                        help="comma-separated modules that register algorithms (like COMMKIT_ALGORITHMS)")
    sub = parser.add_subparsers(dest="command", metavar="{bench,tune,sim,doctor}")
    sub.required = True

    bench = sub.add_parser(
        "bench", help="time every algorithm of a collective against native, nccl-tests/OSU style",
        description="Time every algorithm of the chosen collectives (and the MPI library's own, 'native') over "
                    "a size sweep, interleaved, on the same buffers, checking every result. Sizes count a "
                    "message as the selector does: the per-rank vector for allreduce, reduce, broadcast, scan; "
                    "the whole vector for gather, scatter, allgather, reduce_scatter; the block per peer for "
                    "alltoall. Run under mpiexec, or pass -n N.",
    )
    _job_options(bench)
    bench.add_argument("-c", "--collective", dest="collectives", action="append", metavar="NAME",
                       help=f"collective to time (repeatable, or comma-separated; default allreduce): "
                            f"{', '.join(algorithms.COLLECTIVES)}")
    bench.add_argument("-a", "--algorithms", metavar="LIST",
                       help="comma-separated algorithms to time (include 'native' for the ratio, 'auto' for "
                            "the selector's choice); default: every applicable one and native")
    bench.add_argument("-b", "--minbytes", default="8", metavar="SIZE", help="smallest size (default 8)")
    bench.add_argument("-e", "--maxbytes", default="1M", metavar="SIZE", help="largest size (default 1M)")
    bench.add_argument("-f", "--stepfactor", default="4", metavar="F", help="size multiplier (default 4)")
    bench.add_argument("--sizes", metavar="LIST", help="explicit sizes, e.g. 8,4K,1M or 8:1M:2 (overrides -b/-e/-f)")
    bench.add_argument("-d", "--dtype", default="float32", help="element type (default float32)")
    bench.add_argument("-o", "--op", default="sum", help="reduction op (default sum)")
    bench.add_argument("-r", "--root", default=0, type=int, help="root of broadcast, reduce, gather, scatter")
    bench.add_argument("-i", "--iters", default=20, type=int, help="timed runs per algorithm and size (default 20)")
    bench.add_argument("-w", "--warmup", default=3, type=int, help="untimed runs first (default 3)")
    bench.add_argument("--no-check", action="store_true", help="do not check results (they are checked by default)")
    bench.add_argument("--json", metavar="PATH", help="write the results as JSON ('-' for stdout)")
    bench.add_argument("--csv", metavar="PATH", help="write the results as CSV ('-' for stdout)")
    bench.add_argument("--plot", metavar="FILE.png", help="draw time and busbw against size (needs matplotlib)")
    bench.add_argument("--gpu", action="store_true", help="CuPy arrays over NCCL (one GPU per rank)")
    bench.set_defaults(func=_bench)

    tune = sub.add_parser(
        "tune", help="measure alpha, beta, gamma here and write a tuning file for COMMKIT_TUNING",
        description="Measure this machine's per-message cost (alpha), per-byte cost (beta) and per-byte "
                    "reduction cost (gamma) through commkit's own executor, derive where each algorithm wins "
                    "from the cost model, confirm each crossover with a short benchmark, time the segment sizes "
                    "of segmented algorithms (--segments), time the node engine (shm) where every rank shares "
                    "one node (--no-node skips it), and write a tuning file. Use it with: "
                    "export COMMKIT_TUNING=PATH. Run under mpiexec, or pass -n N.",
    )
    _job_options(tune)
    tune.add_argument("--output", "-O", default="commkit-tuning.json", metavar="PATH",
                      help="tuning file to write (default commkit-tuning.json)")
    tune.add_argument("--procs", metavar="LIST",
                      help="process counts to write rules for, e.g. 2,4,8,16 (default: this job's size; "
                           "other counts are model extrapolations and say so)")
    tune.add_argument("-c", "--collective", dest="collectives", action="append", metavar="NAME",
                      help="collectives to tune (default: all but barrier, scan, exscan)")
    tune.add_argument("--max-bytes", default="4M", metavar="SIZE",
                      help="largest size the confirming benchmark and the segment measurements run (default 4M)")
    tune.add_argument("-d", "--dtype", default="float32", help="element type measured (default float32)")
    tune.add_argument("-o", "--op", default="sum", help="reduction op measured (default sum)")
    tune.add_argument("--quick", action="store_true", help="fewer sizes and repetitions (a rough table)")
    tune.add_argument("--segments", metavar="LIST",
                      help="segment sizes to time for segmented algorithms such as ring_pipelined, besides each "
                           "one's default, e.g. 16K,64K,256K (default 16K,64K,256K,1M; only sizes below the "
                           "measured message run); the fastest becomes the rule's segment_bytes")
    tune.add_argument("--no-node", action="store_true",
                      help="do not time the node engine's shm algorithms (by default, where every rank shares one "
                           "node, tune times them against the table's choice and writes one_node rules where "
                           "they win)")
    tune.set_defaults(func=_tune)

    sim = sub.add_parser(
        "sim", help="simulate a collective's algorithms for any p (no MPI needed)",
        description="Run the schedules of every algorithm (or one) in the simulator and rank them under the "
                    "alpha-beta-gamma model: messages, bytes, rounds on the critical path, predicted time.",
    )
    sim.add_argument("collective", choices=algorithms.COLLECTIVES)
    sim.add_argument("-p", "--procs", type=int, default=16, help="number of ranks (default 16)")
    sim.add_argument("-s", "--size", default="1M", help="message size (default 1M)")
    sim.add_argument("-a", "--algorithm", help="simulate this algorithm only and show its per-rank report")
    sim.add_argument("--alpha", type=float, help="seconds per message (default: commkit.cost.ALPHA)")
    sim.add_argument("--beta", type=float, help="seconds per byte (default: commkit.cost.BETA)")
    sim.add_argument("--gamma", type=float, help="seconds per byte reduced (default: commkit.cost.GAMMA)")
    sim.add_argument("--crossovers", action="store_true", help="also print the size ranges where each wins")
    sim.add_argument("--model", choices=("alpha-beta", "loggp", "two-level"),
                     help="the simulator's timing model (default alpha-beta; see docs/cost_models.md)")
    sim.add_argument("--ranks-per-node", type=int, metavar="K",
                     help="ranks per node for the two-level model (block placement); implies --model two-level")
    sim.set_defaults(func=_sim)

    doctor = sub.add_parser(
        "doctor", help="read the watchdog reports of a stuck job and say which rank diverged first",
        description="Read commkit-flight-record lines (the watchdog's reports in the job's stderr, or files "
                    "from commkit.dump_flight_records()) from every rank and compare their recent collective "
                    "calls: the first call at which the ranks disagree, or the ranks that never reached it.",
    )
    doctor.add_argument("logs", nargs="*", help="log files (default: standard input)")
    doctor.set_defaults(func=_doctor)
    return parser


def _doctor(args, argv) -> int:
    from . import watchdog

    texts = []
    for path in args.logs:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                texts.append(f.read())
        except OSError as exc:
            raise _Usage(f"cannot read {path}: {exc.strerror}.") from None
    if not args.logs:
        texts.append(sys.stdin.read())
    reports = watchdog.read_reports(texts)
    print(watchdog.diagnose(reports))
    return 0 if reports else 1


def _job_options(parser):
    parser.add_argument("-n", "--nprocs", type=int, metavar="N",
                        help="start N processes under mpiexec (default: run in the current job)")


def _split(values):
    out = []
    for value in values or ():
        out.extend(v.strip() for v in value.split(",") if v.strip())
    return out


def _check_writable(path, what) -> None:
    """Fail now, not after a long benchmark, if ``path`` cannot be written."""
    if path is None or path == "-":
        return
    full = os.path.abspath(path)
    folder = os.path.dirname(full)
    if os.path.isdir(full):
        raise _Usage(f"cannot write the {what} to {path}: it is a directory.")
    if not os.path.isdir(folder):
        raise _Usage(f"cannot write the {what} to {path}: the directory {folder} does not exist.")
    if (os.path.exists(full) and not os.access(full, os.W_OK)) or not os.access(folder, os.W_OK):
        raise _Usage(f"cannot write the {what} to {path}: permission denied.")


def _write(path, text, what) -> None:
    if path == "-":
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
        sys.stdout.flush()
        return
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as exc:
        raise _Usage(f"cannot write the {what} to {path}: {exc.strerror}.") from None


def _collectives(values, default):
    names = _split(values) or list(default)
    for name in names:
        if name not in algorithms.COLLECTIVES:
            raise _Usage(f"unknown collective {name!r}; expected one of {', '.join(algorithms.COLLECTIVES)}.")
    return names


def _positive(value, what, minimum=1):
    if value is None or value < minimum:
        raise _Usage(f"{what} must be an integer >= {minimum}, got {value}.")
    return value


# -- running inside an MPI job ---------------------------------------------------------------------


def _launch(nprocs: int, argv: list[str]) -> int:
    """Run ``commkit ARGV`` on ``nprocs`` processes under mpiexec; end every one of them on the way out."""
    _positive(nprocs, "-n (the number of processes)")
    cmd = mpiexec_command(nprocs, [sys.executable, "-m", "commkit", *argv])
    env = dict(os.environ)
    env[_CHILD] = "1"
    if sys.stderr.isatty():
        env[_TTY] = "1"
    try:
        with process_group(cmd, env=env) as proc:  # (which also removes what an aborted job left in /dev/shm)
            return proc.wait()
    except OSError as exc:
        raise TransportUnavailable(f"cannot start {cmd[0]}: {exc.strerror}; set COMMKIT_MPIEXEC to a working "
                                   "mpiexec or install MPI with `pip install 'commkit[mpi]'`.") from None
    except KeyboardInterrupt:
        return 130


def _needs_launch(args) -> bool:
    """Whether this process must start the MPI job itself (``-n N`` outside mpiexec)."""
    if args.nprocs is None or os.environ.get(_CHILD):
        return False
    size = launcher_size()
    if size is not None:
        if size != args.nprocs:
            raise _Usage(f"-n {args.nprocs} was given, but this is already an MPI job of {size} processes; "
                         "drop -n when running under mpiexec.")
        return False
    return True


def _init(gpu: bool):
    import commkit as ck

    if gpu:
        try:
            return ck.init("nccl")
        except ImportError as exc:
            raise TransportUnavailable(f"--gpu needs the NCCL transport, CuPy and a CUDA GPU ({exc}); install "
                                       "CuPy with `pip install 'commkit[gpu]'`.") from None
    return ck.init("mpi")


def _machine(comm) -> dict:
    """Where this ran, for the output's metadata (collective: every rank calls it)."""
    hosts = comm.allgather_object(socket.gethostname())
    busiest = max(hosts.count(h) for h in set(hosts))
    info = {
        "hostname": socket.gethostname(), "platform": platform.platform(), "machine": platform.machine(),
        "cpus": os.cpu_count(), "python": platform.python_version(), "transport": comm.transport_name,
        "nprocs": comm.size, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    from . import __version__

    info["commkit"] = __version__
    # docs/architecture.md, Measuring: more ranks than cores is for correctness; quote speed only for ranks <= cores.
    info["oversubscribed"] = busiest > (os.cpu_count() or 1)
    if comm.transport_name == "mpi":
        try:
            from mpi4py import MPI

            info["mpi"] = MPI.Get_library_version().strip().splitlines()[0]
            info["mpi4py"] = __import__("mpi4py").__version__
        except Exception:  # noqa: BLE001 - metadata only
            pass
    return info


# -- bench --------------------------------------------------------------------------------------------


def _bench_sizes(args):
    from .bench import parse_size, parse_sizes, size_range

    if args.sizes:
        return parse_sizes(args.sizes)
    factor = args.stepfactor
    if not str(factor).isdigit():
        raise _Usage(f"-f (the size step factor) must be an integer >= 2, got {factor!r}.")
    return size_range(parse_size(args.minbytes), parse_size(args.maxbytes), int(factor))


def _bench(args, argv) -> int:
    from . import bench

    # Everything a user can get wrong is checked here, before any process starts.
    collectives = _collectives(args.collectives, ["allreduce"])
    sizes = _bench_sizes(args)
    names = _split([args.algorithms]) if args.algorithms else None
    known = {"auto"}.union(*(algorithms.for_collective(c) for c in collectives))
    for name in names or ():
        # A name applies to each chosen collective that has it (-c allreduce,alltoall -a ring,pairwise).
        if name not in known:
            raise _Usage(f"unknown algorithm {name!r} for {', '.join(collectives)}; expected some of "
                         f"{', '.join(sorted(known))}.")
    bench.check_dtype_op(args.dtype, args.op, collectives)
    _positive(args.iters, "--iters")
    _positive(args.warmup, "--warmup", 0)
    if args.root < 0:
        raise _Usage(f"--root must be a rank >= 0, got {args.root}.")
    if args.json == "-" and args.csv == "-":
        raise _Usage("--json - and --csv - cannot both write to stdout; give one of them a file name.")
    for path, what in ((args.json, "JSON results"), (args.csv, "CSV results"), (args.plot, "plot")):
        _check_writable(path, what)
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise _Usage("--plot needs matplotlib; install it with `pip install matplotlib`.")
    if args.gpu and importlib.util.find_spec("cupy") is None:
        raise TransportUnavailable("--gpu needs CuPy and a CUDA GPU; install CuPy with `pip install 'commkit[gpu]'`.")
    if _needs_launch(args):
        return _launch(args.nprocs, argv)

    comm = _init(args.gpu)
    machine = _machine(comm)
    if args.root >= comm.size:
        raise _Usage(f"--root must be a rank below the job's {comm.size} processes, got {args.root}.")
    for collective in collectives:
        bench.resolve_algorithms(collective, comm.size, names, args.op)  # unknown names fail before timing
    steps = len(collectives) * len(sizes) * args.iters
    # mpiexec pipes our stderr: the launching process says whether it was a terminal.
    progress = bench.Progress(steps, force=bool(os.environ.get(_TTY))) if comm.rank == 0 else None
    try:
        rows = bench.run(comm, collectives, sizes, names=names, dtype=args.dtype, op=args.op, root=args.root,
                         iters=args.iters, warmup=args.warmup, check=not args.no_check, gpu=args.gpu,
                         progress=progress)
    finally:
        if progress is not None:
            progress.close()
    if comm.rank != 0:
        return 1 if any(r.wrong for r in rows) else 0
    meta = dict(machine, dtype=args.dtype, op=args.op, iters=args.iters, warmup=args.warmup, root=args.root,
                checked=not args.no_check)
    if "-" not in (args.json, args.csv):
        if machine["oversubscribed"]:
            sys.stdout.write(f"# NOTE: more ranks than cores on {machine['hostname']}: these timings show "
                             "correctness, not speed\n")
        sys.stdout.write(bench.format_table(rows))
        if comm.size == 1 and not os.environ.get(_CHILD):
            sys.stdout.write("# 1 rank: start more with `commkit bench -n N` or `mpiexec -n N commkit bench`\n")
        sys.stdout.flush()
    if args.json:
        _write(args.json, bench.to_json(rows, meta), "JSON results")
    if args.csv:
        _write(args.csv, bench.to_csv(rows), "CSV results")
    if args.plot:
        bench.plot(rows, args.plot)
    wrong = sum(r.wrong for r in rows)
    if wrong:
        print(f"commkit bench: {wrong} wrong result(s); see the #wrong column.", file=sys.stderr)
        return 1
    return 0


# -- tune ---------------------------------------------------------------------------------------------


def _tune(args, argv) -> int:
    from . import bench, tune

    default = [c for c in algorithms.COLLECTIVES if c not in ("barrier", "scan", "exscan")]
    collectives = _collectives(args.collectives, default)
    procs = None
    if args.procs:
        try:
            procs = sorted({int(v) for v in _split([args.procs])})
        except ValueError:
            raise _Usage(f"--procs must be comma-separated process counts, e.g. 2,4,8; got {args.procs!r}.") from None
        if not procs or procs[0] < 1:
            raise _Usage(f"--procs must list process counts >= 1, got {args.procs!r}.")
    max_bytes = bench.parse_size(args.max_bytes)
    segments = tune.parse_segments(args.segments) if args.segments is not None else None
    bench.check_dtype_op(args.dtype, args.op, collectives)
    _check_writable(args.output, "tuning file")
    if _needs_launch(args):
        return _launch(args.nprocs, argv)

    comm = _init(False)
    if comm.size < 2:
        raise _Usage("tune measures messages between ranks and needs at least 2 processes: "
                     "run `commkit tune -n 2` (or more) or `mpiexec -n 2 commkit tune`.")
    log = (lambda text: print(text, file=sys.stderr, flush=True)) if comm.rank == 0 else (lambda text: None)
    machine = _machine(comm)
    if machine["oversubscribed"]:
        log("NOTE: more ranks than cores: the measurements include waiting for a core; use fewer ranks")
    table = tune.run(comm, procs=procs, collectives=collectives, max_bytes=max_bytes, dtype=args.dtype,
                     op=args.op, quick=args.quick, log=log, machine=machine, segments=segments,
                     node=not args.no_node)
    if comm.rank != 0:
        return 0
    from .selection import validate_table

    validate_table(table, args.output)
    import json

    _write(args.output, json.dumps(table, indent=1) + "\n", "tuning file")
    print(tune.summary(table))
    print(f"wrote {args.output}; use it with: export COMMKIT_TUNING={os.path.abspath(args.output)}")
    return 0


# -- sim ----------------------------------------------------------------------------------------------


def _sim(args, argv) -> int:
    from . import bench, cost, sim

    size = bench.parse_size(args.size)
    _positive(args.procs, "-p (the number of ranks)")
    model = {"alpha": args.alpha, "beta": args.beta, "gamma": args.gamma}
    # The timing model only changes the simulation; the formulas are the alpha-beta-gamma model's.
    timing = {"model": args.model, "ranks_per_node": args.ranks_per_node}
    if args.ranks_per_node is not None:
        _positive(args.ranks_per_node, "--ranks-per-node")
    if args.algorithm:
        res = sim.simulate(args.collective, args.algorithm, args.procs, size, **model, **timing)
        print(res.summary())
        if res.fallback:
            print(f"commkit sim: every rank's steps ran one by one: {res.fallback}.", file=sys.stderr)
        if algorithms.get(args.collective, args.algorithm).cost is not None:  # a user algorithm may have none
            predicted = cost.predict(args.collective, args.algorithm, args.procs, res.nbytes, **model)
            print(f"  formula          {cost.formula(args.collective, args.algorithm)} = {predicted:.4g} s")
        return 1 if res.deadlocked else 0
    _say_which_run_every_rank(args.collective, args.procs, size, timing)
    print(cost.table(args.collective, args.procs, size, simulate=True, **model, **timing))
    if args.crossovers:
        print("crossovers (bytes):")
        # In whole float32 elements, as simulated: no regime narrower than one element.
        for reg in cost.crossovers(args.collective, args.procs, itemsize=4, **model):
            top = "and up" if reg.max_bytes is None else f"to {reg.max_bytes}"
            print(f"  {reg.algorithm:<20} from {reg.min_bytes} {top}")
    return 0


def _say_which_run_every_rank(collective, p, size, timing) -> None:
    """One line on stderr per reason the table's simulations will run every rank one by one (slow at large p)."""
    from . import sim

    by_reason: dict = {}
    for name, alg in sorted(algorithms.for_collective(collective).items()):
        if alg.schedule is None or alg.why_not(p, None) is not None:
            continue  # not simulated, or not in the table (a restriction on p)
        why = sim.why_every_rank(collective, name, p, size, **timing)
        if why:
            by_reason.setdefault(why, []).append(name)
    for why, names in by_reason.items():
        print(f"commkit sim: every rank's steps run one by one for {', '.join(names)}: {why}.", file=sys.stderr)


# -- entry point ----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """Run the ``commkit`` command line; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        if args.load:
            algorithms.load(*[m for m in args.load.split(",") if m])
        return args.func(args, argv)
    except BrokenPipeError:
        # The reader went away (``commkit sim ... | head``): stop quietly, as Unix tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except _DETERMINISTIC as exc:
        # Bad arguments and a missing MPI fail alike on every rank, before any message: one report will do.
        if _rank() == 0:
            print(f"commkit {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except CommError as exc:
        # A timeout or a failed peer in the middle of a job: the other ranks may be waiting for this
        # one, so end the whole job rather than leave them hanging.
        print(f"commkit {args.command}: error on rank {_rank()}: {exc}", file=sys.stderr)
        _abort_job(2)
        return 2
    except KeyboardInterrupt:
        return 130


_DETERMINISTIC = (_Usage, InvalidArgument, TransportUnavailable, UnsupportedOp, AlgorithmNotApplicable)


def _abort_job(code: int) -> None:
    if (launcher_size() or 1) > 1 and "mpi4py.MPI" in sys.modules:
        sys.modules["mpi4py.MPI"].COMM_WORLD.Abort(code)
