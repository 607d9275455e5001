"""The picture in every algorithm's docstring, drawn from its schedule: who holds what after each round.

Why drawn, not written. A hand-drawn diagram of an algorithm is right the day
it is drawn; when the schedule changes it goes on showing the old one. So the
picture at the end of every built-in algorithm's docstring is the output of
:func:`picture`, which runs the schedule, and ``tests/test_diagrams.py`` fails
when a docstring's picture is not what the schedule draws today. Regenerate
them all with ``python -m commkit.algorithms._diagram --write``
(``--check`` lists the stale ones and exits 1).

How it is drawn. A small interpreter (:func:`trace`) runs every rank's steps
with symbols instead of numbers: element i of rank r's input holds "rank r's
contribution to position i of the result", a copy or a message moves such
symbols, and a reduction unites the contributions of its two operands. A
transfer completes one round after the later of its own rank's previous
transfer and the posting of the messages it receives (sends are buffered, as
the transports' small messages are), so a round is one message on the longest
chain. One-sided (node) steps run with their meaning: a Put copies symbols
into the rank's slot of a shared arena, a Get copies a slot's out, a
ReduceSlots unites several slots' symbols; a Publish records the rank's
round and what it has heard, and a Wait, which blocks until every peer it
names has published that step, ends a round: it completes one round after the
later of its own rank's round and the peers' publishes (Claim only sizes the
slots, as a single call finds the arena free; Release publishes the last
step). So a node algorithm's round is one wait on the longest chain. After every round, each rank's cell shows, for every block of the
result (p blocks, or a rank's own block for the per-rank collectives), the
ranks whose input the rank holds for all of that block, anywhere in its
buffers (a partial sum in scratch counts; for scans, whose partial sums in
scratch run past the rank's own prefix, only the result counts); ``-`` is
nothing yet. Barrier moves
no data: its cells show the ranks a rank has heard from, directly or not.
Below the rounds, the messages and elements each rank sent and the elements
it reduced, and the critical path that :mod:`commkit.sim` finds for α, β and
γ, each alone (element counts: the simulation runs with 1-byte elements).
A node algorithm sends no messages: its rows count each rank's waits and the
elements it put, got and folded, and its critical path is in waits, elements
copied and elements folded.
"""

from __future__ import annotations

import ast
import inspect
import sys
import textwrap
from collections import deque
from pathlib import Path

from .. import collectives
from ..ops import get_op
from ..schedule import (CLAIM, FINAL, GET, PUBLISH, PUT, REDUCE, REDUCE_SLOTS, RELEASE, TRANSFER, WAIT, partition,
                        slot, slot_rank)
from . import for_collective
from ._blocks import block_offsets

__all__ = ["picture", "section", "trace", "outputs", "stale", "write", "PROCS", "MARKER"]

PROCS = 4
MARKER = "Picture, generated from the schedule"
"""The first words of every docstring's picture section (how :func:`write` finds an old one)."""

# Example sizes at p = 4: two elements per block, one element per rank's block, uneven vector counts.
_COUNTS = {"reduce_scatter": (2, 2, 2, 2), "gather": 1, "scatter": 1, "allgather": 1, "alltoall": 1,
           "allgatherv": (1, 2, 1, 2), "gatherv": (1, 2, 1, 2), "scatterv": (1, 2, 1, 2),
           "alltoallv": tuple(tuple(1 + (i + j) % 2 for j in range(PROCS)) for i in range(PROCS)), "barrier": 0}
_COUNT = 8
# Segments small enough that the pipelines show: two elements, or one where blocks are cut (the rings).
_SEGMENT = {"allreduce_ring_pipelined": 1, "reduce_scatter_ring_pipelined": 1}
_DEFAULT_SEGMENT = 2


# A scan's partial sums in scratch cover other ranks' prefixes: show only what reached the result.
_SHOWN = {"scan": ("out",), "exscan": ("out",)}


def _example(alg):
    """The count and segment size the picture of ``alg`` is drawn for."""
    count = _COUNTS.get(alg.collective, _COUNT)
    segment = _SEGMENT.get(alg.qualname, _DEFAULT_SEGMENT) if alg.segmented else None
    return count, segment


def _layout(collective, p, count):
    """Where each input element ends up, and the blocks a cell shows, for ``collective`` on ``p`` ranks.

    Returns ``(position(rank, i), blocks(rank))``: the result position of element i of rank's
    input (any hashable value), and the lists of positions that make up each block of a cell.
    """
    if collective in ("gather", "allgather"):
        return (lambda r, i: r * count + i), (lambda r: [list(range(q * count, (q + 1) * count)) for q in range(p)])
    if collective in ("allgatherv", "gatherv"):
        offsets = block_offsets(count)
        return ((lambda r, i: offsets[r] + i),
                (lambda r: [list(range(offsets[q], offsets[q + 1])) for q in range(p)]))
    if collective in ("scatter", "scatterv", "reduce_scatter"):
        offsets = block_offsets(count if isinstance(count, tuple) else (count,) * p)
        return (lambda r, i: i), (lambda r: [list(range(offsets[q], offsets[q + 1])) for q in range(p)])
    if collective in ("alltoall", "alltoallv"):
        # Element j of the block rank r sends to rank d is position (d, r, j); rank d's cell shows its blocks by sender.
        matrix = count if isinstance(count, tuple) else tuple((count,) * p for _ in range(p))
        starts = [block_offsets(row) for row in matrix]

        def position(r, i):
            d = max(q for q in range(p) if starts[r][q] <= i and starts[r][q] < starts[r][q + 1])
            return d, r, i - starts[r][d]

        return position, (lambda d: [[(d, r, j) for j in range(matrix[r][d])] for r in range(p)])
    # broadcast, reduce, allreduce, scan, exscan: the vector, cut into p blocks.
    return (lambda r, i: i), (lambda r: [list(range(lo, hi)) for lo, hi in partition(count, p)])


class _Rank:
    """One rank in :func:`trace`: its symbolic buffers, its steps, its clock and what it has heard."""

    def __init__(self, rank, steps, bufs):
        self.rank = rank
        self.steps = iter(steps)
        self.bufs = bufs
        self.clock = 0
        self.heard = {rank}
        self.pending = None  # the receives of the transfer it waits on
        self.done = False
        self.cells = []  # (round, what it holds) every time that changes
        self.published = []  # one-sided: (counter step, round, ranks heard) per Publish or Release, in order
        self.blocked = None  # the Wait it waits on
        self.moved = {"waits": 0, "put": 0, "got": 0, "folded": 0}  # what its one-sided steps did


def _unite(a, b):
    if a is None or b is None:
        return a if b is None else b
    return a[0], a[1] | b[1]


def _fold(values):
    folded = None
    for v in values:
        folded = _unite(folded, v)
    return folded


def _local(rank, step, arena):
    """Run a step that waits for nobody: a copy, a reduction, a Put, a Get or a ReduceSlots."""
    bufs = rank.bufs

    def buf(name):
        return bufs[name] if slot_rank((name,)) is None else arena[name]

    if step.kind in (PUT, GET):
        (name, lo, hi), (sname, slo, _) = step.dst, step.src
        buf(name)[lo:hi] = buf(sname)[slo:slo + hi - lo]
        rank.moved["put" if step.kind == PUT else "got"] += hi - lo
    elif step.kind == REDUCE_SLOTS:
        name, lo, hi = step.dst
        bufs[name][lo:hi] = [_fold(buf(sname)[slo + k] for sname, slo, _ in step.operands) for k in range(hi - lo)]
        rank.moved["folded"] += (len(step.operands) - 1) * (hi - lo)
    elif step.kind == REDUCE:
        (name, lo, hi), (oname, olo, _), (sname, slo, _) = step.into, step.operand, step.src
        bufs[name][lo:hi] = [_unite(bufs[sname][slo + k], bufs[oname][olo + k]) for k in range(hi - lo)]
    else:
        (name, lo, hi), (sname, slo, _) = step.dst, step.src
        bufs[name][lo:hi] = bufs[sname][slo:slo + hi - lo]


def trace(alg, p=PROCS, count=None, root=0, segment=None):
    """Run ``alg``'s schedules on ``p`` ranks with symbols instead of data: what each rank holds, round by round.

    Args:
        alg: a registered :class:`~commkit.algorithms.Algorithm` with a schedule.
        p, count, root, segment: the call (``count`` as the schedule takes it).

    Returns:
        For each rank, ``[(round, holdings), ...]``: after each round in which what it holds
        changed, for each block of the result the frozenset of ranks whose input it holds for
        the whole block (for barrier, one set: the ranks it has heard from); the last entry is
        the last round of all ranks.

    Raises:
        RuntimeError: the schedules deadlock, or a message and its receive differ in length.
    """
    ranks = _run(alg, p, count, root, segment)
    last = max(rank.clock for rank in ranks)
    return [_until(rank.cells[:-1], last) for rank in ranks]


def outputs(alg, p=PROCS, count=None, root=0, segment=None) -> list:
    """Each rank's ``out`` after the run of :func:`trace`: per element, (its result position, its ranks) or None."""
    return [rank.bufs["out"] for rank in _run(alg, p, count, root, segment)]


def _run(alg, p, count, root, segment):
    """Every rank's steps run with symbols, ranks taking turns until all end; the ranks, as they ended."""
    coll = alg.collective
    position, blocks = _layout(coll, p, count)
    op = get_op("sum")
    ranks, wire, arena = [], {}, {}
    for r in range(p):
        n_in, n_out = collectives.buffer_sizes(coll, r, p, count, root)
        # A broadcast's input means something at the root only.
        mine = coll != "broadcast" or r == root
        bufs = {"in": [(position(r, i), frozenset((r,))) if mine else None for i in range(n_in)], "out": [None] * n_out,
                "tmp": [None] * alg.scratch(r, p, count)}
        ranks.append(_Rank(r, collectives.steps(alg.schedule, coll, r, p, count, op, root, segment), bufs))

    def holdings(rank):
        if coll == "barrier":
            return (frozenset(rank.heard),)
        best = {}
        for name in _SHOWN.get(coll, rank.bufs):
            for v in rank.bufs[name]:
                if v is not None and len(v[1]) > len(best.get(v[0], ())):
                    best[v[0]] = v[1]
        return tuple(frozenset.intersection(*(best.get(pos, frozenset()) for pos in block)) if block else frozenset()
                     for block in blocks(rank.rank))

    def note(rank):
        now = holdings(rank)
        if not rank.cells or rank.cells[-1][1] != now:
            if rank.cells and rank.cells[-1][0] == rank.clock:
                rank.cells[-1] = (rank.clock, now)
            else:
                rank.cells.append((rank.clock, now))

    def _sync(rank, step):
        """Run a one-sided synchronisation step; False while its Wait is not yet satisfied (it stays blocked)."""
        if step.kind == CLAIM:
            # One call: no earlier call holds the arena, so the claim only sizes the slots.
            for q in range(step.size):
                name = slot(q, 0, 0)[0]
                arena.setdefault(name, [])
                arena[name] += [None] * (step.elements - len(arena[name]))
        elif step.kind in (PUBLISH, RELEASE):
            # What the rank stored is visible from now; peers that wait for it see its round and what it heard.
            rank.published.append((FINAL if step.kind == RELEASE else step.k, rank.clock, frozenset(rank.heard)))
        elif step.peers:
            first = [next((entry for entry in ranks[q].published if entry[0] >= step.k), None) for q in step.peers]
            if None in first:
                rank.blocked = step
                return False
            rank.blocked = None
            note(rank)  # what it holds before the wait, as of its clock
            rank.clock = max(rank.clock, *(stamp for _, stamp, _ in first)) + 1
            for _, _, heard in first:
                rank.heard |= heard
            rank.moved["waits"] += 1
            note(rank)
        return True

    def advance(rank):
        """Run rank's steps until it waits for a message or ends; whether it moved."""
        moved = False
        while True:
            if rank.blocked is not None:
                if not _sync(rank, rank.blocked):
                    return moved
                moved = True
            if rank.pending is not None:
                wanted = {}
                for peer, _ in rank.pending:
                    wanted[peer] = wanted.get(peer, 0) + 1
                if any(len(wire.get((peer, rank.rank), ())) < n for peer, n in wanted.items()):
                    return moved
                stamps = [rank.clock]
                for peer, (name, lo, hi) in rank.pending:
                    stamp, values, heard = wire[peer, rank.rank].popleft()
                    if len(values) != hi - lo:
                        raise RuntimeError(f"{alg.qualname}: rank {rank.rank} receives {hi - lo} elements from "
                                           f"rank {peer}, which sent {len(values)}.")
                    rank.bufs[name][lo:hi] = values
                    rank.heard |= heard
                    stamps.append(stamp)
                rank.pending = None
                rank.clock = max(stamps) + 1
                note(rank)
                moved = True
            step = next(rank.steps, None)
            if step is None:
                rank.done = True
                note(rank)
                rank.cells.append((rank.clock, None))  # the end (dropped by trace)
                return True
            moved = True
            if step.kind in (CLAIM, PUBLISH, RELEASE, WAIT):
                if not _sync(rank, step):
                    return moved
                continue
            if step.kind != TRANSFER:
                _local(rank, step, arena)
                continue
            note(rank)  # what it holds before this transfer, as of its clock
            for peer, (name, lo, hi) in step.sends:
                wire.setdefault((rank.rank, peer), deque()).append(
                    (rank.clock, rank.bufs[name][lo:hi], frozenset(rank.heard)))
            for local in step.overlap:
                _local(rank, local, arena)
            # A transfer of sends alone still takes its round: its messages are on the wire.
            rank.pending = step.recvs
            if not step.recvs:
                rank.pending = None
                rank.clock += 1

    while not all(rank.done for rank in ranks):
        if not any(advance(rank) for rank in ranks if not rank.done):
            stuck = [rank.rank for rank in ranks if not rank.done]
            raise RuntimeError(f"{alg.qualname} deadlocks in the picture's run (p = {p}): ranks {stuck} wait.")
    return ranks


def _until(cells, last):
    """A rank's cells, its final holdings carried to round ``last`` (the end of the slowest rank)."""
    return cells if cells[-1][0] == last else cells + [(last, cells[-1][1])]


def _token(ranks) -> str:
    return "".join(str(r) for r in sorted(ranks)) or "-"


def _table(header, rows) -> list[str]:
    widths = [max(len(row[c]) for row in [header, *rows]) for c in range(len(header))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows]]


def picture(alg) -> list[str]:
    """The lines of ``alg``'s picture at p = 4 (without the heading of :func:`section`)."""
    from .. import sim

    count, segment = _example(alg)
    p = PROCS
    ranks = _run(alg, p, count, 0, segment)
    last = max(rank.clock for rank in ranks)
    cells = [_until(rank.cells[:-1], last) for rank in ranks]
    columns = []
    for history in cells:
        held, k, rows = history[0][1], 0, []
        for t in range(last + 1):
            while k < len(history) and history[k][0] <= t:
                held = history[k][1]
                k += 1
            rows.append([_token(b) for b in held])
        # Pad each block's token to its widest in this column, so that blocks line up down the rounds.
        widths = [max(len(row[b]) for row in rows) for b in range(len(rows[0]))]
        columns.append([" ".join(tok.ljust(w) for tok, w in zip(row, widths)).rstrip() for row in rows])

    def factory(rank):
        return collectives.steps(alg.schedule, alg.collective, rank, p, count, get_op("sum"), 0, segment)

    unit = {term: sim.simulate_steps(factory, p, alpha=float(term == "a"), beta=float(term == "b"),
                                     gamma=float(term == "g"))
            for term in "abg"}
    run = unit["a"]
    rows = [[str(t), *(col[t] for col in columns)] for t in range(last + 1)]
    one_sided = any(any(rank.moved.values()) for rank in ranks)
    if one_sided:
        # No messages: what a rank does is wait for peers and copy into, out of and across slots.
        for key, label in (("waits", "waits"), ("put", "elems put"), ("got", "elems got"),
                           ("folded", "elems folded")):
            if key == "waits" or any(rank.moved[key] for rank in ranks):
                rows.append([label, *(str(rank.moved[key]) for rank in ranks)])
    else:
        rows += [["msgs sent", *map(str, run.messages)], ["elems sent", *map(str, run.bytes_sent)]]
        if any(run.bytes_reduced):
            rows.append(["elems reduced", *map(str, run.bytes_reduced)])
    lines = _table(["round", *(f"rank {r}" for r in range(p))], rows)
    if one_sided:
        waits = unit['a'].rounds
        critical = f"{waits} wait{'' if waits == 1 else 's'}, {unit['b'].time:g} elements copied"
        if any(run.bytes_reduced):
            critical += f", {unit['g'].time:g} folded"
    else:
        critical = f"{unit['a'].rounds} messages, {unit['b'].time:g} elements sent"
        if any(run.bytes_reduced):
            critical += f", {unit['g'].time:g} reduced"
    return lines + [f"critical path (commkit.sim, each term alone): {critical}"]


_HOW = "python -m commkit.algorithms._diagram --write"


def section(alg) -> str:
    """The picture section of ``alg``'s docstring, as it must appear there (dedented)."""
    count, segment = _example(alg)
    shown = "count[i][j] = 1 + (i + j) mod 2" if alg.collective == "alltoallv" else f"count = {count}"
    call = f"p = {PROCS}, {shown}"
    if alg.collective in collectives.ROOTED:
        call += ", root = 0"
    if segment is not None:
        call += f", segment = {segment}"
    if alg.collective == "barrier":
        cells = "each cell lists the ranks a rank has heard from, directly or not"
    else:
        cells = ("each cell lists, for every block of the result, the ranks whose input that rank holds for the "
                 "whole block (- for none)")
    head = textwrap.wrap(f"{MARKER} ({call}): {cells}, after each round. Redrawn by ``{_HOW}``::", 100,
                         break_on_hyphens=False)
    return "\n".join([*head, "", *("    " + line for line in picture(alg))])


def _builtin():
    from . import COLLECTIVES

    for collective in COLLECTIVES:
        for alg in for_collective(collective).values():
            if alg.schedule is not None and alg.schedule.__module__.startswith(__package__ + "."):
                yield alg


def stale() -> list:
    """The built-in algorithms whose docstring does not hold the picture their schedule draws today."""
    return [alg for alg in _builtin() if section(alg) not in inspect.cleandoc(alg.schedule.__doc__ or "")]


def _docstring_lines(path: Path, name: str):
    """(first line, last line, indent) of function ``name``'s docstring in ``path`` (1-based, inclusive)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            doc = node.body[0]
            if isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str):
                return doc.lineno, doc.end_lineno, doc.col_offset
    raise LookupError(f"no docstring of a function {name!r} in {path}")


def write(algs=None) -> list:
    """Put today's picture into the docstring of each algorithm of ``algs`` (default: the stale ones).

    Returns the algorithms whose docstring was rewritten.
    """
    algs = stale() if algs is None else list(algs)
    for alg in algs:
        fn = inspect.unwrap(alg.schedule)
        path = Path(inspect.getsourcefile(fn))
        first, last, indent = _docstring_lines(path, fn.__name__)
        lines = path.read_text(encoding="utf-8").split("\n")
        body = lines[first - 1:last]
        pad = " " * indent
        if len(body) == 1:  # """One line.""" -> opening line, closing quotes on their own line
            text = body[0].rstrip()
            body = [text[:-3], pad + '"""']
        elif body[-1].strip() != '"""':
            body = body[:-1] + [body[-1].rstrip()[:-3].rstrip(), pad + '"""']
        start = next((i for i, line in enumerate(body) if line.strip().startswith(MARKER)), len(body) - 1)
        kept = body[:start]
        while kept and not kept[-1].strip():
            kept.pop()
        new = kept + [""] + [(pad + line).rstrip() for line in section(alg).split("\n")] + [pad + '"""']
        lines[first - 1:last] = new
        path.write_text("\n".join(lines), encoding="utf-8")
    return algs


def main(argv=None) -> int:
    """``python -m commkit.algorithms._diagram [--write | --check]``: redraw or check every docstring's picture."""
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--write"]:
        for alg in write():
            print(f"redrew {alg.qualname}")
        return 0
    if argv in ([], ["--check"]):
        old = stale()
        for alg in old:
            print(f"{alg.qualname}: its docstring's picture is not what its schedule draws; run {_HOW}")
        return 1 if old else 0
    print("usage: python -m commkit.algorithms._diagram [--write | --check]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
