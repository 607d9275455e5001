#!/usr/bin/env python
"""The memory-work floor of a 2-rank allreduce, against commkit's allreduce and the raw mpi4py call.

    python benchmarks/memory_floor.py                     # starts its own 2-rank mpiexec job
    mpiexec -n 2 python benchmarks/memory_floor.py        # the same, inside a job you started
    python benchmarks/memory_floor.py --quick             # a smoke run (seconds)
    python benchmarks/memory_floor.py --markdown FILE     # also write the table as Markdown

Whatever it sends, a 2-rank sum allreduce of n elements must read both inputs,
add them and leave the sum in both outputs. The **floor** does only that memory
work, in shared memory, with no messages: both ranks map one segment holding
both inputs and both outputs; rank r adds its half of the vector from the two
inputs into its own output, and, once both halves are done (one barrier),
copies the other half of the result from the peer's output into its own. Both
ranks work at once, as they do in an allreduce. No real allreduce can do less
memory work, so ``commkit / floor`` says how close to the memory system's limit
commkit runs (target: at most 1.25 at 4 MiB and 32 MiB).

Timed in the same job, interleaved (the order rotates every sweep), on the same
input data (each rank's private input is a copy of its half of the segment):

* ``floor``: the above;
* ``auto``: ``comm.allreduce(x, out=out)``, the algorithm the selection table picks;
* ``ring_pipelined``: ``comm.allreduce(x, out=out, algorithm="ring_pipelined")``;
* ``raw``: ``comm.Allreduce(x, out, MPI.SUM)`` on an mpi4py ``Dup`` of COMM_WORLD
  (target: commkit at most 0.5x of it at 32 MiB).

One sweep times ``calls`` back-to-back calls of each variant after a barrier
(a sweep's time per call is the slower rank's); the input data change every
``--vary`` sweeps; every result is checked exactly (a sum of two floats is the
same in either order). A cell is the median over sweeps; a ratio is the median
over sweeps of the two variants' ratio within the sweep, with the lowest and
highest sweep. The segment is a file in /dev/shm that rank 0 creates and
unlinks as soon as both ranks have mapped it (and again, if still there, on
any way out); the mappings are closed on the way out.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for path in (HERE, ROOT):  # the checkout's commkit and the benchmark helpers
    if path not in sys.path:
        sys.path.insert(0, path)

import _tasks
import numpy as np
from _report import emit, script_header

VARIANTS = ("floor", "auto", "ring_pipelined", "raw")
COMMKIT = ("auto", "ring_pipelined")
FLOOR_TARGET, RAW_TARGET = 1.25, 0.5
FLOOR_SIZES, RAW_SIZES = (4, 32), (32,)


def _parser():
    parser = argparse.ArgumentParser(prog="benchmarks/memory_floor.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,4,8,16,32", help="MiB per rank, comma-separated (default 1,4,8,16,32)")
    parser.add_argument("--sweeps", type=int, default=9, help="sweeps per size (default 9)")
    parser.add_argument("--seconds", type=float, default=0.25, help="about this long per variant per sweep")
    parser.add_argument("--vary", type=int, default=3, help="new input data every this many sweeps (default 3)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 MiB, 2 sweeps, short")
    parser.add_argument("--markdown", metavar="FILE", help="also write the table as Markdown to FILE")
    return parser


class Segment:
    """Both ranks' inputs and outputs (4 x n float32) in one shared file mapping.

    Rank 0 creates the file and unlinks it once both ranks have it mapped, so it
    disappears even if a rank dies later; :meth:`close` unmaps (and unlinks, if
    it is still there). Use as a context manager.
    """

    def __init__(self, raw, n):
        self.raw, self.n, self.path, self.map = raw, n, None, None
        nbytes = max(4 * n * 4, mmap.PAGESIZE)
        try:
            if raw.rank == 0:
                where = "/dev/shm" if os.path.isdir("/dev/shm") else None
                fd, self.path = tempfile.mkstemp(prefix="commkit-floor-", dir=where)
                try:
                    os.ftruncate(fd, nbytes)
                    self.map = mmap.mmap(fd, nbytes)
                finally:
                    os.close(fd)
            path = raw.bcast(self.path, root=0)
            if raw.rank != 0:
                with open(path, "r+b") as f:
                    self.map = mmap.mmap(f.fileno(), nbytes)
            raw.Barrier()  # both mapped: the name is no longer needed
        finally:
            self._unlink()
        whole = np.frombuffer(self.map, dtype=np.float32, count=4 * n).reshape(4, n)
        self.inputs, self.outputs = whole[:2], whole[2:]

    def _unlink(self):
        if self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self.path = None

    def close(self):
        self._unlink()
        self.inputs = self.outputs = None
        if self.map is not None:
            try:
                self.map.close()
            except BufferError:
                pass  # a view is still alive (an exception's frames): the mapping goes with it; the file is gone
            self.map = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _floor(raw, seg, rank):
    """The memory work of a 2-rank allreduce: reduce my half of both inputs, then copy the peer's half."""
    n = seg.n
    half = n // 2
    mine = slice(0, half) if rank == 0 else slice(half, n)
    theirs = slice(half, n) if rank == 0 else slice(0, half)
    x0, x1 = seg.inputs
    out, peer_out = seg.outputs[rank], seg.outputs[1 - rank]
    add, copyto, barrier = np.add, np.copyto, raw.Barrier

    def floor():
        add(x0[mine], x1[mine], out=out[mine])
        barrier()  # the peer's half is ready
        copyto(out[theirs], peer_out[theirs])

    return floor


def measure(comm, raw, args, mib, loads):
    """{variant: [seconds per call, per sweep]}, the auto choice, calls per sweep and wrong results."""
    from mpi4py import MPI

    n = int(mib * (1 << 20)) // 4
    rank = raw.rank
    times = {v: [] for v in VARIANTS}
    wrong = dict.fromkeys(VARIANTS, 0)
    with Segment(raw, n) as seg:
        x = np.empty(n, np.float32)
        out = np.empty(n, np.float32)
        expected = np.empty(n, np.float32)
        fns = {
            "floor": _floor(raw, seg, rank),
            "auto": lambda: comm.allreduce(x, out=out),
            "ring_pipelined": lambda: comm.allreduce(x, out=out, algorithm="ring_pipelined"),
            "raw": lambda: raw.Allreduce(x, out, MPI.SUM),
        }
        result = {"floor": seg.outputs[rank], "auto": out, "ring_pipelined": out, "raw": out}
        calls = 1
        for sweep in range(args.sweeps):
            if sweep % args.vary == 0:
                # New data: each rank writes its input into the segment and keeps a private copy.
                seg.inputs[rank][...] = np.random.default_rng([sweep, rank, n]).standard_normal(n, np.float32)
                raw.Barrier()
                x[...] = seg.inputs[rank]
                np.add(seg.inputs[0], seg.inputs[1], out=expected)
                for name in VARIANTS:  # warm: plans, first touch of every page
                    for _ in range(2):
                        fns[name]()
                if sweep == 0:  # calls per sweep, from one timed floor and raw call (the same on both ranks)
                    raw.Barrier()
                    t0 = time.perf_counter()
                    fns["raw"]()
                    fns["floor"]()
                    guess = (time.perf_counter() - t0) / 2
                    calls = max(1, int(raw.allreduce(args.seconds / max(guess, 1e-6), op=MPI.MIN)))
            if rank == 0:
                loads.append(os.getloadavg()[0])
            k = sweep % len(VARIANTS)
            for name in VARIANTS[k:] + VARIANTS[:k]:
                fn = fns[name]
                result[name].fill(np.nan)  # poisoned, untimed: a run that writes nothing fails the check
                raw.Barrier()
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                elapsed = (time.perf_counter() - t0) / calls
                raw.Barrier()  # the floor's peer may still be copying into its own output
                wrong[name] += int(not np.array_equal(result[name], expected))
                times[name].append(raw.allreduce(elapsed, op=MPI.MAX))
        comm.allreduce(x, out=out)
        choice = comm.last_algorithm
        del fns, result, fn  # they hold views of the segment, which closes now
    wrong = {k: raw.allreduce(v, op=MPI.SUM) for k, v in wrong.items()}
    return times, choice, calls, wrong


def _ratio(times, a, b):
    per = [x / y for x, y in zip(times[a], times[b])]
    return statistics.median(per), min(per), max(per)


def report(rows, argv, machine, loads, seconds, sweeps):
    lines = script_header("benchmarks/memory_floor.py", 2, argv, machine, f"{sweeps} sweeps per size, {seconds:.0f} s",
                          _tasks.load_line(loads), sum(sum(w.values()) for *_, w in rows))
    lines += [("| MiB per rank | calls per sweep | floor (ms) | auto (ms) | ring_pipelined (ms) | raw mpi4py (ms) | "
               "auto / floor | ring_pipelined / floor | raw / floor | auto / raw | ring_pipelined / raw | "
               "spread (floor, auto, rp, raw) |"),
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    verdicts = []
    for mib, calls, choice, times, wrong in rows:
        med = {v: statistics.median(t) * 1e3 for v, t in times.items()}
        spread = ", ".join(f"{(max(t) - min(t)) / statistics.median(t):.0%}" for t in times.values())
        cells = []
        for a, b in (("auto", "floor"), ("ring_pipelined", "floor"), ("raw", "floor"), ("auto", "raw"),
                     ("ring_pipelined", "raw")):
            m, lo, hi = _ratio(times, a, b)
            cells.append(f"**{m:.2f}** ({lo:.2f}–{hi:.2f})")
        lines.append(f"| {mib:g} | {calls} | {med['floor']:.3f} | {med['auto']:.3f} (`{choice}`) | "
                     f"{med['ring_pipelined']:.3f} | {med['raw']:.3f} | " + " | ".join(cells) + f" | {spread} |")
        for name in COMMKIT:
            if mib in FLOOR_SIZES:
                m = _ratio(times, name, "floor")[0]
                verdicts.append(f"{name} at {mib:g} MiB: {m:.2f}x the floor (target ≤ {FLOOR_TARGET:g}): "
                                + ("PASS" if m <= FLOOR_TARGET else "**MISS**"))
            if mib in RAW_SIZES:
                m = _ratio(times, name, "raw")[0]
                verdicts.append(f"{name} at {mib:g} MiB: {m:.2f}x the raw MPI_Allreduce (target ≤ "
                                f"{RAW_TARGET:g}): " + ("PASS" if m <= RAW_TARGET else "**MISS**"))
    lines += ["", ("Times: median over sweeps of the time per call (the slower rank's); ratios: median over sweeps "
                   "of the ratio within a sweep (lowest–highest sweep); spread: (max - min) / median over sweeps.")]
    if verdicts:
        lines += ["", "Targets:", ""] + [f"- {v}" for v in verdicts]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(argv)
    status = _tasks.relaunch(2, __file__, argv)
    if status is not None:
        return status
    if args.quick:
        args.sizes, args.sweeps, args.seconds, args.vary = "1", 2, 0.02, 1
    if args.sweeps < 1 or args.vary < 1:
        raise SystemExit("memory_floor.py: --sweeps and --vary must be at least 1.")
    from mpi4py import MPI

    import commkit as ck

    comm = ck.init("mpi")
    raw = MPI.COMM_WORLD.Dup()
    if raw.size != 2:
        raw.Free()
        raise SystemExit(f"memory_floor.py: the floor is for 2 ranks; this job has {raw.size}.")
    loads, rows = [], []
    started = time.time()
    try:
        for mib in (float(s) for s in args.sizes.split(",")):
            times, choice, calls, wrong = measure(comm, raw, args, mib, loads)
            rows.append((mib, calls, choice, times, wrong))
            if raw.rank == 0:
                print(f"  {mib:g} MiB done (load {os.getloadavg()[0]:.2f})", file=sys.stderr, flush=True)
        machine = _tasks.machine_line(raw)
    finally:
        raw.Free()
    if comm.rank != 0:
        return 0
    emit(report(rows, argv, machine, loads, time.time() - started, args.sweeps), args.markdown)
    return 1 if any(sum(w.values()) for *_, w in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
