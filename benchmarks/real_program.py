#!/usr/bin/env python
"""What a call costs in a real program, which makes new arrays every call: commkit against the mpi4py code.

    python benchmarks/real_program.py                      # starts its own 2-rank mpiexec job
    mpiexec -n 2 python benchmarks/real_program.py         # the same, inside a job you started (any MPI library)
    python benchmarks/real_program.py --quick              # a smoke run (seconds)
    python benchmarks/real_program.py --markdown FILE      # also write the tables as a Markdown section

A repeated call on the same arrays runs a compiled plan (docs/call_cost.md),
but a real program rarely repeats one: a conjugate-gradient loop reduces a new
dot product every iteration, a Monte Carlo code sums a new tally, a training
step starts an ``iallreduce`` on new gradients and computes while it runs.
This script times that: every call of every column gets a *new* input array,
made the same way in every column (``base.copy()``, inside the timed loop:
the allocation a program pays is counted on both sides), and every column
that writes a result allocates it anew, as the program would. The columns,
for allreduce (float64, ``op`` sum), broadcast (root 0), allgather, reduce, gather and scatter (root 0):

* ``raw new``: the mpi4py call on a ``Dup`` of COMM_WORLD, into a new result
  (``y = np.empty_like(x); raw.Allreduce(x, y, MPI.SUM)``; ``raw.Bcast(x, 0)``,
  in place on the new array, as ``MPI_Bcast`` has one form; ``Allgather`` into a
  new ``(p, n)`` array) -- the baseline of the blocking columns;
* ``commkit new x``: ``y = comm.allreduce(x)`` (no ``out``: commkit allocates it);
* ``commkit new x, out``: ``comm.allreduce(x, out=np.empty_like(x))``;
* ``raw i``: ``raw.Iallreduce(x, y, MPI.SUM).Wait()`` into a new ``y`` -- the
  baseline of ``commkit i``: ``comm.iallreduce(x).wait()``;
* ``commkit timed``: ``comm.allreduce(x, timeout=60)``;
* ``face``: commkit's mpi4py face (``commkit.compat.mpi4py.wrap(MPI.COMM_WORLD)``),
  ``face.Allreduce(x, y, MPI.SUM)`` into a new ``y``, the mpi4py program with its
  one changed line.

The same for the other collectives (``broadcast``/``ibroadcast``/``Bcast``/``Ibcast``,
``allgather``/``iallgather``/``Allgather``/``Iallgather``, ``reduce``/``ireduce``/``Reduce``/``Ireduce``
and ``gather``/``igather``/``Gather``/``Igather``, root 0: ranks other than the root pass mpi4py no receive
buffer and get None from commkit; ``scatter``/``iscatter``/``Scatter``/``Iscatter``, root 0: the root's new
input holds a block per rank, and every other rank's new array is the block it fills, given as ``out``
with ``x=None``, and as mpi4py's receive buffer; ``reduce_scatter``/``ireduce_scatter`` without counts against
``Reduce_scatter_block``/``Ireduce_scatter_block``, sum: every rank's new input holds a block per rank).
Every column of one
collective and size is measured interleaved in one job: each sweep runs every
column for ``--calls`` calls after a barrier, in an order that rotates from sweep
to sweep, on new input data (small integers, so every result is exact and the
last result of every column is checked: the "wrong results" count). A sweep's
time of a column is the mean per call of its slowest rank (``time.perf_counter``);
the time tables give the median over sweeps; a ratio is the median over sweeps
of the ratio within a sweep, with the lowest and highest sweep in brackets.
"bytes" is one rank's input message (a scatter's or a reduce_scatter's block). The targets (allreduce, 2 ranks) are
printed next to the ratios as ok or missed; they do not change the exit status,
which is 1 only when a result was wrong. Quote speed only for ranks <= cores.
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

import _tasks  # noqa: E402
import numpy as np  # noqa: E402
from _report import emit, fmt_size, fmt_us, script_header  # noqa: E402

COLLECTIVES = ("allreduce", "broadcast", "allgather", "reduce", "gather", "scatter", "reduce_scatter")
DTYPE = np.float64
RAW, NEW_X, NEW_X_OUT, RAW_I, I_FORM, TIMED, FACE = (
    "raw new", "commkit new x", "commkit new x, out", "raw i", "commkit i", "commkit timed", "face")
COLUMNS = (RAW, NEW_X, NEW_X_OUT, RAW_I, I_FORM, TIMED, FACE)
# Each commkit column over its mpi4py counterpart, with the allreduce target for that ratio.
RATIOS = ((NEW_X, RAW, 1.3), (NEW_X_OUT, RAW, 1.3), (I_FORM, RAW_I, 1.5), (TIMED, RAW, 1.3), (FACE, RAW, 1.4))
TARGETED = "allreduce"
TIMEOUT = 60.0
WARMUP = 20  # calls of each column before the sweeps: a shape's plan is made once it has come twice


def _parser():
    parser = argparse.ArgumentParser(prog="benchmarks/real_program.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="8,1K", help="one rank's message in bytes, a multiple of 8 (default 8,1K)")
    parser.add_argument("--collectives", default=",".join(COLLECTIVES),
                        help=f"comma-separated, from {', '.join(COLLECTIVES)} (default: all, allreduce first)")
    parser.add_argument("--sweeps", type=int, default=9, help="sweeps per collective and size (default 9)")
    parser.add_argument("--calls", type=int, default=3000, help="calls of each column per sweep (default 3000)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 sweeps of 50 calls (seconds)")
    parser.add_argument("--markdown", metavar="FILE", help="also write the tables as a Markdown section to FILE")
    return parser


def _arguments(argv):
    """The parsed arguments, or SystemExit with a sentence naming what was expected and what came."""
    from commkit.bench import parse_sizes
    from commkit.errors import InvalidArgument

    args = _parser().parse_args(argv)
    if args.quick:
        args.sweeps, args.calls = 2, 50
    try:
        args.sizes = parse_sizes(args.sizes)
    except InvalidArgument as e:
        raise SystemExit(f"real_program.py: {e}") from None
    odd = [s for s in args.sizes if s <= 0 or s % DTYPE().itemsize]
    if odd:
        raise SystemExit(f"real_program.py: sizes must be positive multiples of {DTYPE().itemsize} bytes "
                         f"(float64 elements); got {odd}.")
    args.collectives = [c.strip() for c in args.collectives.split(",") if c.strip()]
    unknown = [c for c in args.collectives if c not in COLLECTIVES]
    if unknown or not args.collectives:
        raise SystemExit(f"real_program.py: --collectives takes names from {list(COLLECTIVES)}; "
                         f"got {unknown or 'none'}.")
    if args.sweeps < 1 or args.calls < 1:
        raise SystemExit(f"real_program.py: --sweeps and --calls must be at least 1; got {args.sweeps} and "
                         f"{args.calls}.")
    return args


def columns(collective, comm, raw, face):
    """Each column's call on a new input ``x``, as a program writes it: name -> ``call(x)``, returning the result.

    The mpi4py calls are written out as a user writes them (no helper between
    the program and ``raw``), so the baseline carries no cost of this script's.
    """
    from mpi4py import MPI

    p = comm.size
    if collective == "allreduce":
        def raw_new(x):
            y = np.empty_like(x)
            raw.Allreduce(x, y, MPI.SUM)
            return y

        def raw_i(x):
            y = np.empty_like(x)
            raw.Iallreduce(x, y, MPI.SUM).Wait()
            return y

        def face_call(x):
            y = np.empty_like(x)
            face.Allreduce(x, y, MPI.SUM)
            return y

        return {RAW: raw_new, NEW_X: lambda x: comm.allreduce(x),
                NEW_X_OUT: lambda x: comm.allreduce(x, out=np.empty_like(x)),
                RAW_I: raw_i, I_FORM: lambda x: comm.iallreduce(x).wait(),
                TIMED: lambda x: comm.allreduce(x, timeout=TIMEOUT), FACE: face_call}
    if collective == "broadcast":
        def raw_new(x):  # MPI_Bcast has one form: in place, on the program's new array
            raw.Bcast(x, 0)
            return x

        def raw_i(x):
            raw.Ibcast(x, 0).Wait()
            return x

        def face_call(x):
            face.Bcast(x, 0)
            return x

        return {RAW: raw_new, NEW_X: lambda x: comm.broadcast(x, 0),
                NEW_X_OUT: lambda x: comm.broadcast(x, 0, out=np.empty_like(x)),
                RAW_I: raw_i, I_FORM: lambda x: comm.ibroadcast(x, 0).wait(),
                TIMED: lambda x: comm.broadcast(x, 0, timeout=TIMEOUT), FACE: face_call}
    if collective == "reduce":  # root 0: the others get None, and pass no receive buffer to mpi4py
        root = comm.rank == 0

        def raw_new(x):
            y = np.empty_like(x) if root else None
            raw.Reduce(x, y, MPI.SUM, 0)
            return y

        def raw_i(x):
            y = np.empty_like(x) if root else None
            raw.Ireduce(x, y, MPI.SUM, 0).Wait()
            return y

        def face_call(x):
            y = np.empty_like(x) if root else None
            face.Reduce(x, y, MPI.SUM, 0)
            return y

        return {RAW: raw_new, NEW_X: lambda x: comm.reduce(x, "sum", 0),
                NEW_X_OUT: lambda x: comm.reduce(x, "sum", 0, out=np.empty_like(x) if root else None),
                RAW_I: raw_i, I_FORM: lambda x: comm.ireduce(x, "sum", 0).wait(),
                TIMED: lambda x: comm.reduce(x, "sum", 0, timeout=TIMEOUT), FACE: face_call}
    if collective == "gather":  # root 0: the others get None, and pass no receive buffer to mpi4py
        root = comm.rank == 0

        def raw_new(x):
            y = np.empty((p, *x.shape), x.dtype) if root else None
            raw.Gather(x, y, 0)
            return y

        def raw_i(x):
            y = np.empty((p, *x.shape), x.dtype) if root else None
            raw.Igather(x, y, 0).Wait()
            return y

        def face_call(x):
            y = np.empty((p, *x.shape), x.dtype) if root else None
            face.Gather(x, y, 0)
            return y

        return {RAW: raw_new, NEW_X: lambda x: comm.gather(x, 0),
                NEW_X_OUT: lambda x: comm.gather(x, 0, out=np.empty((p, *x.shape), x.dtype) if root else None),
                RAW_I: raw_i, I_FORM: lambda x: comm.igather(x, 0).wait(),
                TIMED: lambda x: comm.gather(x, 0, timeout=TIMEOUT), FACE: face_call}
    if collective == "scatter":  # root 0's x holds a block per rank; each other rank's x is its new block to fill
        if comm.rank == 0:
            def raw_new(x):
                y = np.empty(x.shape[1:], x.dtype)
                raw.Scatter(x, y, 0)
                return y

            def raw_i(x):
                y = np.empty(x.shape[1:], x.dtype)
                raw.Iscatter(x, y, 0).Wait()
                return y

            def face_call(x):
                y = np.empty(x.shape[1:], x.dtype)
                face.Scatter(x, y, 0)
                return y

            return {RAW: raw_new, NEW_X: lambda x: comm.scatter(x, 0),
                    NEW_X_OUT: lambda x: comm.scatter(x, 0, out=np.empty(x.shape[1:], x.dtype)),
                    RAW_I: raw_i, I_FORM: lambda x: comm.iscatter(x, 0).wait(),
                    TIMED: lambda x: comm.scatter(x, 0, timeout=TIMEOUT), FACE: face_call}

        def raw_new(x):
            raw.Scatter(None, x, 0)
            return x

        def raw_i(x):
            raw.Iscatter(None, x, 0).Wait()
            return x

        def face_call(x):
            face.Scatter(None, x, 0)
            return x

        return {RAW: raw_new, NEW_X: lambda x: comm.scatter(None, 0, out=x),
                NEW_X_OUT: lambda x: comm.scatter(None, 0, out=x),  # (the other ranks' only form: their out)
                RAW_I: raw_i, I_FORM: lambda x: comm.iscatter(None, 0, out=x).wait(),
                TIMED: lambda x: comm.scatter(None, 0, out=x, timeout=TIMEOUT), FACE: face_call}
    if collective == "reduce_scatter":  # every rank's x holds a block per rank; each gets its block of the sum
        def raw_new(x):
            y = np.empty(len(x) // p, x.dtype)
            raw.Reduce_scatter_block(x, y, MPI.SUM)
            return y

        def raw_i(x):
            y = np.empty(len(x) // p, x.dtype)
            raw.Ireduce_scatter_block(x, y, MPI.SUM).Wait()
            return y

        def face_call(x):
            y = np.empty(len(x) // p, x.dtype)
            face.Reduce_scatter_block(x, y, MPI.SUM)
            return y

        return {RAW: raw_new, NEW_X: lambda x: comm.reduce_scatter(x),
                NEW_X_OUT: lambda x: comm.reduce_scatter(x, out=np.empty(len(x) // p, x.dtype)),
                RAW_I: raw_i, I_FORM: lambda x: comm.ireduce_scatter(x).wait(),
                TIMED: lambda x: comm.reduce_scatter(x, timeout=TIMEOUT), FACE: face_call}
    assert collective == "allgather", collective

    def raw_new(x):
        y = np.empty((p, *x.shape), x.dtype)
        raw.Allgather(x, y)
        return y

    def raw_i(x):
        y = np.empty((p, *x.shape), x.dtype)
        raw.Iallgather(x, y).Wait()
        return y

    def face_call(x):
        y = np.empty((p, *x.shape), x.dtype)
        face.Allgather(x, y)
        return y

    return {RAW: raw_new, NEW_X: lambda x: comm.allgather(x),
            NEW_X_OUT: lambda x: comm.allgather(x, out=np.empty((p, *x.shape), x.dtype)),
            RAW_I: raw_i, I_FORM: lambda x: comm.iallgather(x).wait(),
            TIMED: lambda x: comm.allgather(x, timeout=TIMEOUT), FACE: face_call}


def data(sweep: int, rank: int, n: int) -> np.ndarray:
    """Rank ``rank``'s input in sweep ``sweep``: small integers, new every sweep, so every sum is exact."""
    return ((np.arange(n) * (2 * sweep + 1) + 5 * rank + sweep) % 23 - 11).astype(DTYPE)


def base_of(collective: str, sweep: int, rank: int, p: int, n: int) -> np.ndarray:
    """Rank ``rank``'s array of the sweep, which every call copies: its input (``data``), but for a scatter the
    root's every block (rank r's is ``data(sweep, r, n)``) and the other ranks' block to fill (zeros), and for a
    reduce_scatter a block for every rank (``data(sweep, rank, p * n)``)."""
    if collective == "reduce_scatter":
        return data(sweep, rank, p * n)
    if collective != "scatter":
        return data(sweep, rank, n)
    return np.stack([data(sweep, r, n) for r in range(p)]) if rank == 0 else np.zeros(n, DTYPE)


def expected(collective: str, sweep: int, p: int, n: int, rank: int = 0):
    """What rank ``rank``'s result must be when rank r's input is ``data(sweep, r, n)`` (None off a reduce's or a
    gather's root; a scatter's root sends them all, and rank r gets its own); for a reduce_scatter, rank r's
    input is ``data(sweep, r, p * n)``."""
    inputs = [data(sweep, r, n) for r in range(p)]
    if collective == "scatter":
        return inputs[rank]
    if collective == "reduce_scatter":
        return np.sum([data(sweep, r, p * n) for r in range(p)], axis=0)[rank * n:(rank + 1) * n]
    if collective in ("reduce", "gather"):
        if rank != 0:
            return None
        return np.sum(inputs, axis=0) if collective == "reduce" else np.stack(inputs)
    if collective == "allreduce":
        return np.sum(inputs, axis=0)
    if collective == "broadcast":
        return inputs[0]
    return np.stack(inputs)


def _timed(call, base, calls):
    """Seconds for ``calls`` calls, each on a new copy of ``base``; and the last call's result."""
    result = None
    t0 = time.perf_counter()
    for _ in range(calls):
        result = call(base.copy())
    return time.perf_counter() - t0, result


def measure(comm, raw, face, collective, nbytes, args):
    """``{column: [per-call seconds of each sweep, the slowest rank's]}`` and the number of wrong results here."""
    from mpi4py import MPI

    n = nbytes // DTYPE().itemsize
    calls = columns(collective, comm, raw, face)
    names = list(calls)
    warm = base_of(collective, args.sweeps, comm.rank, comm.size, n)
    for call in calls.values():
        for _ in range(WARMUP):
            call(warm.copy())
    samples = {name: [] for name in names}
    wrong = 0
    for sweep in range(args.sweeps):
        base = base_of(collective, sweep, comm.rank, comm.size, n)
        want = expected(collective, sweep, comm.size, n, comm.rank)
        k = sweep % len(names)
        for name in names[k:] + names[:k]:
            raw.Barrier()
            seconds, result = _timed(calls[name], base, args.calls)
            samples[name].append(raw.allreduce(seconds / args.calls, op=MPI.MAX))
            if not (result is None if want is None else np.array_equal(result, want)):  # shapes and values
                wrong += 1
                print(f"rank {comm.rank}: {collective} {nbytes} B `{name}` returned a wrong result in sweep "
                      f"{sweep}.", file=sys.stderr, flush=True)
    return samples, wrong


def time_table(rows) -> str:
    """Markdown: per collective and size, each column's median time per call in microseconds."""
    lines = ["| collective | bytes | " + " | ".join(COLUMNS) + " |", "|---|---|" + "---|" * len(COLUMNS)]
    for collective, nbytes, samples in rows:
        lines.append(f"| {collective} | {fmt_size(nbytes)} | "
                     + " | ".join(fmt_us(statistics.median(samples[c]) * 1e6) for c in COLUMNS) + " |")
    return "\n".join(lines)


def ratio_cell(samples, mine, base):
    """The median over sweeps of ``mine`` / ``base`` within a sweep, and the lowest and highest sweep."""
    per_sweep = [a / b for a, b in zip(samples[mine], samples[base])]
    return statistics.median(per_sweep), min(per_sweep), max(per_sweep)


def ratio_table(rows):
    """Markdown: each commkit column over its mpi4py one, with the targets; and the targets missed."""
    head = [f"{mine.removeprefix('commkit ')} / {base}" for mine, base, _ in RATIOS]
    lines = ["| collective | bytes | " + " | ".join(head) + " |", "|---|---|" + "---|" * len(RATIOS),
             f"| target ({TARGETED}) | | " + " | ".join(f"≤ {t}" for *_, t in RATIOS) + " |"]
    missed, met = [], 0
    for collective, nbytes, samples in rows:
        cells = []
        for (mine, base, target), label in zip(RATIOS, head):
            ratio, lo, hi = ratio_cell(samples, mine, base)
            cell = f"{ratio:.2f} ({lo:.2f}–{hi:.2f})"
            if collective == TARGETED:
                if ratio <= target:
                    met += 1
                    cell += " ok"
                else:
                    missed.append(f"{collective} {fmt_size(nbytes)} {label} {ratio:.2f} (target {target})")
                    cell += " **missed**"
            cells.append(cell)
        lines.append(f"| {collective} | {fmt_size(nbytes)} | " + " | ".join(cells) + " |")
    return "\n".join(lines), met, missed


def report(rows, argv, nprocs, machine, seconds, loads, wrong, sweeps, calls) -> str:
    """The Markdown section: heading, command, machine and load, the two tables, and the targets' verdict."""
    load = f"1-minute load average {loads[0]:.2f} before the run, {loads[-1]:.2f} after it"
    head = script_header("benchmarks/real_program.py", nprocs, argv, machine, f"{sweeps} sweeps x {calls} calls "
                         f"per column, {seconds:.0f} s", load, wrong)
    ratios, met, missed = ratio_table(rows)
    verdict = (f"No {TARGETED} was measured, so no target applies." if not any(r[0] == TARGETED for r in rows) else
               f"Targets ({TARGETED}, {nprocs} ranks; the other collectives' ratios are shown without one): "
               f"met {met} of {met + len(missed)}"
               + ("." if not missed else "; missed: " + "; ".join(missed) + "."))
    return "\n".join([
        "## A real program: new arrays every call", "", *head,
        "Time per call in microseconds: the median over sweeps of the mean per call (slowest rank), every call "
        "on a new input array (`base.copy()`, in every column alike).", "",
        time_table(rows), "",
        "Each commkit column over its mpi4py counterpart: the median over sweeps of the ratio within a sweep "
        "(lowest–highest sweep in brackets).", "",
        ratios, "",
        verdict, ""])


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _arguments(argv)
    status = _tasks.relaunch(2, __file__, argv)
    if status is not None:
        return status
    from mpi4py import MPI

    import commkit as ck
    from commkit.compat.mpi4py import wrap

    comm = ck.init("mpi")
    raw = MPI.COMM_WORLD.Dup()
    face = wrap(MPI.COMM_WORLD)
    loads = [os.getloadavg()[0]]
    state = _tasks.calibration(raw)
    started = time.time()
    rows, wrong = [], 0
    try:
        for collective in [c for c in COLLECTIVES if c in args.collectives]:
            for nbytes in args.sizes:
                samples, bad = measure(comm, raw, face, collective, nbytes, args)
                rows.append((collective, nbytes, samples))
                wrong += bad
        wrong = raw.allreduce(wrong, op=MPI.SUM)
        loads.append(os.getloadavg()[0])
        machine = f"{_tasks.machine_line(raw)}; {_tasks.calibration_line(state, _tasks.calibration(raw))}"
    finally:
        face.comm.free()  # the face wraps COMM_WORLD itself: free only its own contexts
        raw.Free()
    if comm.rank == 0:
        emit(report(rows, argv, comm.size, machine, time.time() - started, loads, wrong, args.sweeps, args.calls),
             args.markdown)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
