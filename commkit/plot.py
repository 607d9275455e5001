"""Pictures of collectives: timelines and communication diagrams, and the cost model over measurements.

Every drawing takes events in :mod:`commkit.tracing`'s format, so it draws a
real run (a :class:`~commkit.tracing.Tracer`) and the model (a result of
:func:`commkit.sim.simulate` with ``events=True``) alike:

* :func:`timeline` -- time on the x axis, one row per rank, a bar per step
  coloured by what it did, thin lines for messages;
* :func:`diagram` -- the communication diagram of the textbooks: ranks as
  rows, communication rounds as columns, an arrow per message (line width
  grows with its bytes) and a ``⊕`` where a rank reduces;
* :func:`ring_diagram` -- the same rounds on circles, so a ring is a ring;
* :func:`schedule_diagram` -- either from the simulator, with no run at all;
* :func:`buffer_states` -- whose data each element of every rank's output
  holds after each round, from a real run on threads;
* :func:`predicted_vs_measured` -- ``commkit bench`` results against the
  alpha-beta-gamma model, one colour per algorithm, crossovers marked.

Why colour by block: the textbook picture of ring allreduce follows one block
of the vector (its partial sum travels round the ring, gaining a contribution
at each rank), which colour by sender cannot show. Events carry the buffer
range of every message and reduction (:data:`commkit.tracing.RANGE_KEYS`), and
:class:`Blocks` maps a range to the block of ``partition(count, p)`` it lies
in, so the diagrams colour by block where the data is split into blocks and
fall back to colour by sender where every message carries the whole vector.

Why rounds, not step indices, as the diagram's columns: ranks take different
numbers of steps (a tree's leaves only receive, a Reduce sits between two
transfers), so step i of one rank has nothing to do with step i of another.
A rank's k-th transfer goes in the first column after its previous transfer
and not before any message it receives was sent (:func:`rounds`), which puts
every round of a ring, a tree or a butterfly in its own column.

matplotlib is imported only when a function here is called, and only its
object-oriented API is used (no pyplot): nothing here needs a display, and
figures are returned rather than shown, so a notebook displays each once.
Because no pyplot is involved, a notebook shows a returned figure as an image
only with ``%matplotlib inline`` active (or ``IPython.display.display(fig)``);
``fig.savefig("name.png")`` works everywhere.
"""

from __future__ import annotations

import math
from collections import defaultdict, deque
from itertools import pairwise

from . import _states, cost, sim
from ._crossover import changes
from ._events import MESSAGE_KINDS, events_of, messages
from ._units import format_bytes
from .algorithms import for_collective
from .errors import InvalidArgument
from .schedule import partition

__all__ = ["BLOCK_COLLECTIVES", "KIND_COLORS", "SEVERAL", "Blocks", "buffer_states", "diagram", "measured_crossovers",
           "predicted_crossovers", "predicted_vs_measured", "ring_diagram", "rounds", "schedule_diagram",
           "timeline"]

KIND_COLORS = {
    "exchange": "#4C72B0", "send": "#4C72B0", "recv": "#4C72B0", "transfer": "#4C72B0",
    "reduce": "#DD8452", "copy": "#A0A0A0", "native": "#8172B3",
}
"""Bar colours of :func:`timeline`: messages blue, reductions orange, copies grey, native calls purple."""

_KIND_LABELS = (("send / receive", ("exchange", "send", "recv", "transfer")), ("reduce", ("reduce",)),
                ("copy", ("copy",)), ("native", ("native",)))


def _require() -> None:
    """Import matplotlib, or say how to install it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ImportError("commkit.plot needs matplotlib: pip install matplotlib") from None


def _figure(ax, size):
    """A new Agg-safe Figure and Axes (no pyplot, no display), or ``ax`` and its figure."""
    if ax is not None:
        return ax.figure, ax
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, layout="constrained")
    return fig, fig.add_subplot()


def _fmt_bytes(n: float) -> str:
    """Exact bytes below 10 KiB (what a schedule moves is rarely a round number), else 3 digits."""
    return format_bytes(n, 3, exact_below=10 << 10)


def _time_unit(span: float):
    if span < 1e-3:
        return 1e6, "us"
    if span < 1:
        return 1e3, "ms"
    return 1.0, "s"


def _colors(n: int):
    """``n`` distinct colours, never grey: grey means "several blocks" (and native calls, copies)."""
    from matplotlib import colormaps

    if n <= 9:
        cmap = colormaps["tab10"]
        return [cmap(i) for i in (0, 1, 2, 3, 4, 5, 6, 8, 9)[:n]]
    if n <= 18:
        cmap = colormaps["tab20"]
        return [cmap(i) for i in range(20) if i not in (14, 15)][:n]
    cmap = colormaps["turbo"]
    return [cmap(i / max(n - 1, 1)) for i in range(n)]


def _call_names(events) -> str:
    seen = []
    for e in sorted(events, key=lambda e: (e["seq"], e["start"])):
        name = f"{e['collective']}_{e['algorithm']}"
        if name not in seen:
            seen.append(name)
    return ", ".join(seen[:3]) + (f" and {len(seen) - 3} more" if len(seen) > 3 else "")


def _nonempty(source):
    events = events_of(source)
    if not events:
        raise InvalidArgument("there are no events to draw: was a collective run inside the trace block?")
    return events


# -- which logical block a range belongs to ---------------------------------------------------------

BLOCK_COLLECTIVES = frozenset({"allreduce", "reduce", "broadcast", "scan", "exscan", "allgather", "gather",
                               "scatter", "reduce_scatter", "alltoall"})
"""Collectives whose data the diagrams can colour by logical block (the vector split into p blocks)."""

SEVERAL = -1
"""The block of a range that spans more than one logical block (a whole vector, half of it ...)."""

_SEVERAL_COLOR = "#9A9A9A"
_OWN_BLOCK = {("allgather", "in"), ("gather", "in"), ("scatter", "out"), ("reduce_scatter", "out")}


class Blocks:
    """The logical blocks of every call in a trace: which block a buffer range of a rank holds.

    A collective's data is a vector split into p blocks by
    :func:`commkit.schedule.partition` (blocks differ by at most one element and may be
    empty). Block b of an allreduce is elements ``partition(count, p)[b]`` of ``in`` and
    ``out``; of an allgather or gather, rank b's contribution (``in`` on rank b, the b-th
    block of ``out``); of a scatter, the piece for rank b; of a reduce_scatter, the piece
    that ends at rank b; of an alltoall, the b-th block of ``in`` (for rank b) and of
    ``out`` (from rank b). ``tmp`` holds no fixed block, so a message is identified by the
    sender's range and, failing that, by the receiver's.

    The vector's length is not in the events; it is the furthest element any range of the
    call touches, or ``count`` (the schedule's count, as :func:`commkit.sim.schedule_args`
    gives it) when given.
    """

    def __init__(self, events, count=None):
        self._calls: dict = {}
        reach: dict = defaultdict(lambda: defaultdict(int))
        ranks: dict = defaultdict(int)
        for e in events:
            key = (e["collective"], e["seq"])
            ranks[key] = max(ranks[key], e["rank"] + 1)
            for r in _ranges(e):
                reach[key][r[0]] = max(reach[key][r[0]], r[2])
        for key, p in ranks.items():
            collective = key[0]
            if collective not in BLOCK_COLLECTIVES:
                continue
            far = reach[key]
            if count is not None:
                total = sum(count) if isinstance(count, (tuple, list)) else int(count)
                if collective in ("allgather", "gather", "scatter", "alltoall"):
                    total *= p  # their count is one rank's block
            elif collective in ("allgather", "gather"):
                total = max(far["in"] * p, far["out"])
            elif collective == "scatter":
                total = max(far["out"] * p, far["in"])
            else:
                total = max(far["in"], far["out"])
            self._calls[key] = (p, partition(total, p))

    def of(self, collective: str, seq: int, rank: int, rng) -> int | None:
        """The block ``rng`` (``(buffer, lo, hi)``) of ``rank`` holds: its index, :data:`SEVERAL`, or None.

        None means the range is empty or not tied to a block (``tmp``, a collective
        without blocks, events without ranges).
        """
        layout = self._calls.get((collective, seq))
        if layout is None or rng is None:
            return None
        name, lo, hi = rng
        if hi <= lo or name not in ("in", "out"):
            return None
        p, blocks = layout
        if (collective, name) in _OWN_BLOCK:
            return rank if 0 <= rank < p else None
        found = [b for b, (blo, bhi) in enumerate(blocks) if bhi > blo and lo < bhi and blo < hi]
        if not found:
            return None
        return found[0] if len(found) == 1 else SEVERAL

    def of_message(self, m) -> int | None:
        """The block a :class:`~commkit.tracing.Message` carries (the sender's range first)."""
        b = self.of(m.collective, m.seq, m.src, m.send_range)
        return b if b is not None else self.of(m.collective, m.seq, m.dst, m.recv_range)

    def of_local(self, e) -> int | None:
        """The block a reduce or copy event writes (or, writing ``tmp``, reads)."""
        rng = e.get("range")
        b = self.of(e["collective"], e["seq"], e["rank"], None if rng is None else tuple(rng))
        if b is None and e.get("src_range") is not None:
            b = self.of(e["collective"], e["seq"], e["rank"], tuple(e["src_range"]))
        return b


def _ranges(e):
    for rng in (*e.get("send_ranges", ()), *e.get("recv_ranges", ()), e.get("range"), e.get("src_range")):
        if rng is not None:
            yield rng


def _color_mode(color, events, msgs, blocks) -> str:
    """``"block"`` or ``"sender"``: the mode asked for, or the automatic choice for ``color=None``."""
    if color not in (None, "block", "sender"):
        raise InvalidArgument(f"color must be 'block', 'sender' or None (automatic), got {color!r}.")
    if color == "sender":
        return color
    have_ranges = all("send_ranges" in e for e in events)
    if color == "block":
        if not have_ranges:
            raise InvalidArgument(
                "color='block' needs the buffer ranges of each step (send_ranges, recv_ranges), which these "
                "events lack (saved before commkit recorded them?); use color='sender'.")
        return color
    single = any(blocks.of_message(m) not in (None, SEVERAL) for m in msgs)
    # An alltoall has p blocks per rank, one per (sender, receiver) pair: block colours there would
    # only repeat the receiver, so it is drawn by sender unless asked.
    whole = all(e["collective"] in BLOCK_COLLECTIVES and e["collective"] != "alltoall" for e in events)
    return "block" if have_ranges and whole and single else "sender"


def _block_palette(blocks_seen, p):
    colors = _colors(max(p, 1))
    return {b: (_SEVERAL_COLOR if b == SEVERAL else colors[b % len(colors)]) for b in blocks_seen}


def _block_legend(ax, palette, reduces: bool, unblocked: bool, **kwargs):
    """The legend of a picture coloured by block: the blocks drawn (at most 16 named), the reduce mark
    when ``reduces``, and a line for messages of no fixed block when ``unblocked``.

    Where no message or reduction holds a single block (recursive doubling, a tree: every message
    carries the whole vector) everything is grey, and the legend says so instead of promising colours.
    """
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    named = sorted(b for b in palette if b not in (SEVERAL, None))
    handles = [Patch(color=palette[b], label=f"block {b}") for b in named[:16]]
    if len(named) > 16:
        handles.append(Patch(color="white", label=f"... {len(named) - 16} more"))
    if SEVERAL in palette:
        handles.append(Patch(color=_SEVERAL_COLOR, label="several blocks" if named else
                             "several blocks: every message\ncarries more than one"))
    if reduces:
        handles.append(Line2D([], [], ls="none", marker=r"$\oplus$", color="#555555", markersize=9,
                              label="reduce (colour: its block)" if named else "reduce"))
    if unblocked:
        handles.append(Line2D([], [], color="#555555", lw=2, label="no fixed block"))
    ax.legend(handles=handles, fontsize=8, frameon=False, **kwargs)


# -- timeline -------------------------------------------------------------------------------------


def timeline(source, *, ax=None, show_messages: bool | None = None, title: str | None = None, width: float = 10.0,
             color: str | None = None, count=None):
    """Draw each rank's steps against time: one row per rank, one bar per step.

    A bar spans its step from start to end, waiting included: a message bar
    includes the wait for the partner, and in a run on the threads world every
    bar includes the wait for the thread's turn to run Python (the ranks take
    turns on the interpreter), so a copy of a few KiB, microseconds of memory
    work, can show as a bar of a millisecond. Read bar lengths of a threads run
    as the order of events, not as costs; the simulator's events (model times)
    and an MPI run (a process per rank) do not have that turn-taking.

    Args:
        source: a :class:`~commkit.tracing.Tracer`, a simulator result, or a list of events.
        ax: draw into these matplotlib Axes instead of a new figure.
        show_messages: draw a line from each send step's start to its receive step's end
            (default: when there are at most 400 messages).
        title: the title (default: the calls drawn and the number of ranks).
        width: figure width in inches (the height follows the number of ranks).
        color: colour the message lines by the block they carry (``"block"``, as in
            :func:`diagram`) or by sender (``"sender"``); default: all dark grey.
        count: the schedule's count, for the block boundaries (default: inferred).

    Returns:
        the matplotlib Figure.

    Raises:
        InvalidArgument: no events, an unknown ``color``, or ``color="block"`` for events
            without ranges. ImportError: matplotlib is missing.
    """
    _require()
    events = _nonempty(source)
    if color is not None:
        blocks = Blocks(events, _count_of(source, count))
        mode = _color_mode(color, events, [], blocks)
    ranks = sorted({e["rank"] for e in events})
    row = {r: i for i, r in enumerate(ranks)}
    origin = min(e["start"] for e in events)
    span = max(e["end"] for e in events) - origin
    scale, unit = _time_unit(span if span > 0 else 1e-6)
    fig, ax = _figure(ax, (width, 1.4 + 0.45 * len(ranks)))

    def x(t):
        return (t - origin) * scale

    # Calls as alternating background bands, labelled when there are few enough to read.
    found = sorted({(e["seq"], e["collective"], e["algorithm"]) for e in events})
    bands = []
    for seq, collective, algorithm in found:
        group = [e for e in events if (e["seq"], e["collective"], e["algorithm"]) == (seq, collective, algorithm)]
        bands.append((x(min(e["start"] for e in group)), x(max(e["end"] for e in group)), f"{collective}_{algorithm}"))
    bands.sort()
    for i, (lo, hi, name) in enumerate(bands):
        if i % 2 == 0:
            ax.axvspan(lo, hi, color="#F2F2F2", zorder=0)
        if 1 < len(bands) <= 8:
            ax.text((lo + hi) / 2, -0.75, name, ha="center", va="bottom", fontsize=8, color="#555555", clip_on=False)

    bar = 0.6
    for label, kinds in _KIND_LABELS:
        spans = defaultdict(list)
        for e in events:
            if e["kind"] in kinds:
                # Zero-length steps (empty copies, model steps without cost) still get a sliver.
                spans[e["rank"]].append((x(e["start"]), max(x(e["end"]) - x(e["start"]), span * scale * 2e-4)))
        for rank, pieces in spans.items():
            ax.broken_barh(pieces, (row[rank] - bar / 2, bar), facecolors=KIND_COLORS[kinds[0]],
                           edgecolors="white", linewidth=0.3, label=label if rank == next(iter(spans)) else None,
                           gid=label, zorder=2)

    msgs = messages(events)
    if show_messages is None:
        show_messages = len(msgs) <= 400
    if show_messages and msgs:
        tint = ["#222222"] * len(msgs)
        if color is not None and mode == "block":
            which = [blocks.of_message(m) for m in msgs]
            palette = _block_palette({b for b in which if b is not None}, len(ranks))
            tint = [palette.get(b, "#222222") for b in which]
            for b in sorted(palette):
                ax.plot([], [], color=palette[b], lw=1.2, label="several blocks" if b == SEVERAL else f"block {b}")
        elif color is not None:
            senders = _colors(len(ranks))
            tint = [senders[row[m.src]] for m in msgs]
        for m, line in zip(msgs, tint):
            ax.annotate("", xy=(x(m.recv["end"]), row[m.dst]), xytext=(x(m.send["start"]), row[m.src]),
                        arrowprops={"arrowstyle": "-|>", "color": line, "lw": 0.6 if color is None else 1.0,
                                    "alpha": 0.45 if color is None else 0.8,
                                    "shrinkA": 0, "shrinkB": 0, "mutation_scale": 6}, zorder=3)
        ax.plot([], [], color="#222222", lw=0.6, alpha=0.6, label="message:\nsend start to\nreceive end")

    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.set_ylim(len(ranks) - 0.4, -0.9 if 1 < len(bands) <= 8 else -0.5)
    ax.set_xlim(0, span * scale * 1.01 if span > 0 else 1)
    ax.set_xlabel(f"time ({unit}) from the first step")
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    ax.set_title(title if title is not None else f"{_call_names(events)}: {len(ranks)} ranks", fontsize=10)
    return fig


# -- communication diagram -----------------------------------------------------------------------


def rounds(source) -> dict:
    """The column of every step in the communication diagram, keyed by ``(rank, seq, step)``.

    A transfer (or native) step goes in the first column after the same rank's
    previous transfer and not before the column of any message it receives; a
    local step (reduce, copy) gets the column of the rank's last transfer plus
    one, the boundary at which its data arrived.

    Raises:
        InvalidArgument: the messages depend on each other in a cycle (no
            schedule that runs can do this).
    """
    events = events_of(source)
    per_rank = defaultdict(list)
    for e in events:
        per_rank[e["rank"]].append(e)
    for rank_events in per_rank.values():
        rank_events.sort(key=lambda e: (e["seq"], e["step"]))

    def key(e):
        return e["rank"], e["seq"], e["step"]

    comm_steps = {r: [e for e in evs if e["kind"] in MESSAGE_KINDS or e["kind"] == "native"]
                  for r, evs in per_rank.items()}
    # A step comes at least one round after the rank's previous transfer, and no earlier
    # than the send of any message it receives: users[a] lists (b, gap) with col[b] >= col[a] + gap.
    users = defaultdict(list)
    for evs in comm_steps.values():
        for prev, e in pairwise(evs):
            users[key(prev)].append((key(e), 1))
    for m in messages(events):
        users[key(m.send)].append((key(m.recv), 0))
    nodes = [key(e) for evs in comm_steps.values() for e in evs]
    # Longest paths by relaxation from a work list: an exchange's send and receive sit in
    # one round, so the ranks of a ring depend on each other in a cycle of zero weight.
    col = dict.fromkeys(nodes, 0)
    work = deque(nodes)
    queued = set(nodes)
    limit = len(nodes) + 1
    while work:
        n = work.popleft()
        queued.discard(n)
        for u, gap in users[n]:
            if col[n] + gap > col[u]:
                col[u] = col[n] + gap
                if col[u] > limit:
                    raise InvalidArgument(
                        "the messages in these events wait on each other in a cycle; they cannot be drawn in rounds."
                    )
                if u not in queued:
                    queued.add(u)
                    work.append(u)
    for evs in per_rank.values():
        last = -1
        for e in evs:
            k = key(e)
            if k in col:
                last = col[k]
            else:
                col[k] = last + 1
    return col


def diagram(source, *, ax=None, show_bytes: bool | None = None, show_reduces: bool = True, title: str | None = None,
            color: str | None = None, count=None, layout: str = "rows"):
    """Draw the communication diagram: ranks as rows, rounds as columns, an arrow per message.

    An arrow leaves its sender in the round of the send step and arrives at the
    end of the round of the matching receive; its width grows with the bytes it
    carries. A ``⊕`` marks where a rank reduces what it received.

    Colour says either which logical block a message carries (``color="block"``:
    block b of the vector split into p blocks, see :class:`Blocks`, with a legend;
    grey where a message carries several blocks) or who sent it (``"sender"``).

    Args:
        source: a :class:`~commkit.tracing.Tracer`, a simulator result, or a list of events
            (filter one call first with :func:`commkit.tracing.select` if the trace holds many).
        ax: draw into these matplotlib Axes instead of a new figure.
        show_bytes: label each arrow with its size (default: when there are at most 40 messages).
        show_reduces: mark reduce steps.
        title: the title (default: the calls drawn and the number of ranks).
        color: ``"block"``, ``"sender"``, or None: by block when the events carry buffer ranges,
            the collective's data is split into blocks and some message carries a single one
            (ring, Rabenseifner ...), else by sender (recursive doubling, trees: every message
            carries the whole vector; Bruck, which sends from scratch; alltoall, whose block
            colour would only repeat the receiver).
        count: the schedule's count, for the block boundaries (default: inferred from the ranges).
        layout: ``"rows"`` (this picture) or ``"circle"`` (:func:`ring_diagram`; ``ax`` not allowed).

    Returns:
        the matplotlib Figure.

    Raises:
        InvalidArgument: no events, an unknown ``color`` or ``layout``, or ``color="block"``
            for events without ranges. ImportError: matplotlib is missing.
    """
    if layout == "circle":
        if ax is not None:
            raise InvalidArgument("layout='circle' draws one small circle per round and takes no ax=.")
        return ring_diagram(source, show_reduces=show_reduces, title=title, color=color, count=count)
    if layout != "rows":
        raise InvalidArgument(f"layout must be 'rows' or 'circle', got {layout!r}.")
    _require()
    from matplotlib.patches import FancyArrowPatch

    events = _nonempty(source)
    col = rounds(events)
    ranks = sorted({e["rank"] for e in events})
    row = {r: i for i, r in enumerate(ranks)}
    msgs = _drawn_messages(events)
    blocks = Blocks(events, _count_of(source, count))
    by_block = _color_mode(color, events, msgs, blocks) == "block"
    # Local steps sit on the boundary after their rank's last transfer, so they add no column.
    ncols = max([col[(e["rank"], e["seq"], e["step"])] + 1 for e in events
                 if e["kind"] in MESSAGE_KINDS or e["kind"] == "native"], default=1)
    fig, ax = _figure(ax, (min(max(4.5, 1.6 + 1.0 * ncols), 18) + (1.3 if by_block else 0),
                           1.2 + 0.55 * len(ranks)))
    colors = _colors(len(ranks))
    if by_block:
        which = [blocks.of_message(m) for m in msgs]
        reduce_blocks = {id(e): blocks.of_local(e) for e in events if e["kind"] == "reduce"}
        palette = _block_palette({b for b in which if b is not None}
                                 | {b for b in reduce_blocks.values() if b is not None}, max(ranks) + 1)
        palette[None] = "#555555"
        tint = [palette[b] for b in which]
    else:
        tint = [colors[row[m.src]] for m in msgs]

    for r in ranks:
        ax.plot([0, ncols], [row[r], row[r]], color="#D0D0D0", lw=1, zorder=1)
    for c in range(ncols + 1):
        ax.axvline(c, color="#EEEEEE", lw=0.8, zorder=0)

    biggest = max((m.nbytes for m in msgs), default=0)
    if show_bytes is None:
        show_bytes = 0 < len(msgs) <= 40 and biggest > 0
    departures = defaultdict(list)
    for m, color_of in zip(msgs, tint):
        x0 = col[(m.src, m.seq, m.send["step"])] + 0.12
        x1 = col[(m.dst, m.seq, m.recv["step"])] + 0.88
        y0, y1 = row[m.src], row[m.dst]
        width = 0.9 + 2.4 * (m.nbytes / biggest if biggest else 0)
        ax.add_patch(FancyArrowPatch((x0, y0), (x1, y1), arrowstyle="-|>", mutation_scale=9 + 2 * width,
                                     lw=width, color=color_of, shrinkA=0, shrinkB=0, zorder=3, alpha=0.9))
        ax.plot([x0], [y0], "o", color=color_of, markersize=3.5, zorder=4)
        departures[(x0, y0)].append((m.nbytes, color_of))
    if show_bytes:
        # One label per departure point, just above it: arrows overlap further along, tails never do.
        for (x0, y0), sent in departures.items():
            lo, hi = min(n for n, _ in sent), max(n for n, _ in sent)
            text = _fmt_bytes(lo) if lo == hi else f"{_fmt_bytes(lo)}–{_fmt_bytes(hi)}"
            tints = {c for _, c in sent}
            ax.text(x0 - 0.04, y0 - 0.13, text, fontsize=7, ha="left", va="bottom",
                    color=tints.pop() if len(tints) == 1 else "#333333", zorder=5,
                    bbox={"boxstyle": "round,pad=0.1", "fc": "white", "ec": "none", "alpha": 0.8})
    for e in events:
        k = (e["rank"], e["seq"], e["step"])
        if e["kind"] == "native":
            ax.add_patch(_box(col[k], row[e["rank"]], "#8172B3"))
            ax.text(col[k] + 0.5, row[e["rank"]], "native", ha="center", va="center", fontsize=7, color="white",
                    zorder=4)
    if show_reduces:
        marks = {(col[(e["rank"], e["seq"], e["step"])], row[e["rank"]]):
                 palette[reduce_blocks[id(e)]] if by_block else "#C0504D"
                 for e in events if e["kind"] == "reduce" and e.get("bytes", 1)}
        for (c, y), mark_color in marks.items():
            ax.text(c, y, "⊕", ha="center", va="center", fontsize=13, color=mark_color, zorder=6,
                    bbox={"boxstyle": "circle,pad=0.0", "fc": "white", "ec": "none"})
        if marks:
            ax.plot([], [], "none", label="⊕ reduce")
    if by_block:
        del palette[None]
        _block_legend(ax, palette, bool(show_reduces and marks), None in set(which), loc="upper left",
                      bbox_to_anchor=(1.0, 1.0))

    found = sorted({(e["seq"], e["collective"], e["algorithm"]) for e in events})
    if len(found) > 1:
        # Several calls: bracket each call's rounds and name it above them.
        for seq, collective, algorithm in found:
            cols = [col[(e["rank"], e["seq"], e["step"])] for e in events
                    if (e["seq"], e["collective"], e["algorithm"]) == (seq, collective, algorithm)]
            lo, hi = min(cols), max(cols) + 1
            ax.plot([lo + 0.05, hi - 0.05], [-0.75, -0.75], color="#888888", lw=1, clip_on=False)
            ax.text((lo + hi) / 2, -0.8, f"{collective}_{algorithm}", ha="center", va="bottom", fontsize=8,
                    color="#555555", clip_on=False)
    ax.set_xlim(-0.15, ncols + 0.15)
    ax.set_ylim(len(ranks) - 0.5, -0.6 if len(found) == 1 else -1.0)
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ticks = range(ncols)
    step = max(1, math.ceil(ncols / 24))
    ax.set_xticks([c + 0.5 for c in ticks][::step], [str(c + 1) for c in ticks][::step])
    ax.tick_params(axis="x", length=0)
    ax.set_xlabel("communication round")
    for side in ("top", "right", "bottom"):
        ax.spines[side].set_visible(False)
    if title is None:
        title = f"{_call_names(events)}: {len(ranks)} ranks, {len(msgs)} messages"
    ax.set_title(title, fontsize=10)
    return fig


def _count_of(source, count):
    """``count``, or the schedule count a simulator result carries (a trace carries none)."""
    if count is not None:
        return count
    found = getattr(source, "count", None)
    return found if isinstance(found, (int, tuple)) and not isinstance(found, bool) else None


def _drawn_messages(events):
    """The messages a picture draws: with fewer elements than ranks some blocks are empty, and
    their 0-byte messages are no work, so they are left out (a barrier's carry nothing and all stay)."""
    return [m for m in messages(events) if m.nbytes or m.collective == "barrier"]


def _box(c, y, color):
    from matplotlib.patches import FancyBboxPatch

    return FancyBboxPatch((c + 0.1, y - 0.25), 0.8, 0.5, boxstyle="round,pad=0.02", fc=color, ec="none", zorder=3)


def schedule_diagram(collective: str, algorithm: str, p: int, nbytes: int = 4096, *, ax=None,
                     show_bytes: bool | None = None, show_reduces: bool = True, title: str | None = None,
                     color: str | None = None, layout: str = "rows", **sim_options):
    """The communication diagram of ``collective``'s ``algorithm`` on ``p`` ranks, from the simulator (no run).

    Args:
        collective, algorithm, p, nbytes: what to simulate (see :func:`commkit.sim.simulate`).
        sim_options: more arguments for :func:`commkit.sim.simulate` (``root``, ``itemsize``, ``op`` ...).
        ax, show_bytes, show_reduces, title, color, layout: as for :func:`diagram` (``layout="circle"``
            draws :func:`ring_diagram`, which ignores ``ax`` and ``show_bytes``).

    Returns:
        the matplotlib Figure.
    """
    result = sim.simulate(collective, algorithm, p, nbytes, events=True, **sim_options).check()
    if title is None:
        size = "" if collective == "barrier" else f", {_fmt_bytes(result.nbytes)}"
        title = f"{collective}_{algorithm}: {p} ranks{size}"
    if layout == "circle":
        return ring_diagram(result.events, show_reduces=show_reduces, title=title, color=color, count=result.count)
    return diagram(result.events, ax=ax, show_bytes=show_bytes, show_reduces=show_reduces, title=title, color=color,
                   count=result.count, layout=layout)


def ring_diagram(source, *, rounds_shown=None, color: str | None = None, count=None, show_reduces: bool = True,
                 columns: int | None = None, title: str | None = None, panel: float = 2.4):
    """The communication rounds on a circle: one small panel per round, ranks round the rim.

    In the row diagram the ring's wrap-around message (rank p-1 to rank 0) crosses
    every row; here each rank sits on a circle (rank 0 at the top, the ring running
    clockwise), so a ring step is p short arcs between neighbours, and any other
    pattern (halving, doubling, Bruck) shows as chords. Each arrow is coloured by the
    block it carries (or its sender, see :func:`diagram`'s ``color``), labelled with the
    block's number in block mode, and a ``⊕`` beside a rank means it reduced what it
    received that round. Messages of empty blocks are not drawn.

    Args:
        source: a :class:`~commkit.tracing.Tracer`, a simulator result, or a list of events
            (one call: filter with :func:`commkit.tracing.select`).
        rounds_shown: the rounds to draw, numbered from 1 as in :func:`diagram` (default: all,
            at most 36).
        color, count, show_reduces, title: as for :func:`diagram`.
        columns: panels per row (default: an even number of rounds from 4 to 16 in two rows, the
            phases of a ring or of halving and doubling; otherwise up to 6).
        panel: size of each panel in inches.

    Returns:
        the matplotlib Figure.

    Raises:
        InvalidArgument: no events, more than 36 rounds and no ``rounds_shown``, or a round
            that does not exist. ImportError: matplotlib is missing.
    """
    _require()
    from matplotlib.figure import Figure
    from matplotlib.patches import Circle, FancyArrowPatch

    events = _nonempty(source)
    count = _count_of(source, count)
    col = rounds(events)
    p = max(e["rank"] for e in events) + 1
    msgs = _drawn_messages(events)
    blocks = Blocks(events, count)
    by_block = _color_mode(color, events, msgs, blocks) == "block"
    per_round = defaultdict(list)
    for m in msgs:
        per_round[col[(m.src, m.seq, m.send["step"])]].append(m)
    reduces = defaultdict(list)
    for e in events:
        if e["kind"] == "reduce" and e["bytes"]:
            # A reduce sits on the boundary after the round whose data it folds in.
            reduces[max(col[(e["rank"], e["seq"], e["step"])] - 1, 0)].append(e)
    total = max([c + 1 for c in per_round] + [c + 1 for c in reduces], default=1)
    if rounds_shown is None:
        if total > 36:
            raise InvalidArgument(f"these events have {total} rounds; choose at most 36 with rounds_shown= "
                                  f"(for example range(1, 13)).")
        shown = list(range(total))
    else:
        shown = [int(r) - 1 for r in rounds_shown]
        bad = [r + 1 for r in shown if not 0 <= r < total]
        if bad or not shown:
            raise InvalidArgument(f"rounds_shown must be rounds 1 to {total}, got {list(rounds_shown)!r}.")
    # An even number of rounds (a ring's two phases, halving then doubling) goes in two rows of phases.
    ncol = columns or (len(shown) // 2 if len(shown) % 2 == 0 and 4 <= len(shown) <= 16 else min(len(shown), 6))
    nrow = math.ceil(len(shown) / ncol)
    fig = Figure(figsize=(panel * ncol + (1.6 if by_block else 0.2), panel * nrow + 0.5), layout="constrained")
    axes = fig.subplots(nrow, ncol, squeeze=False)

    sender_colors = _colors(p)
    which = {}
    palette = {}
    if by_block:
        for m in msgs:
            which[id(m)] = blocks.of_message(m)
        palette = _block_palette({b for b in which.values() if b is not None}
                                 | {blocks.of_local(e) for es in reduces.values() for e in es} - {None}, p)
    where = [(math.sin(2 * math.pi * r / p), math.cos(2 * math.pi * r / p)) for r in range(p)]
    node = 0.13 if p <= 8 else max(0.05, 0.9 / p)
    for i, ax in enumerate(axes.flat):
        ax.set_xlim(-1.38, 1.38)
        ax.set_ylim(-1.38, 1.38)
        ax.set_aspect("equal")
        ax.axis("off")
        if i >= len(shown):
            continue
        c = shown[i]
        ax.add_patch(Circle((0, 0), 1.0, fill=False, ec="#E4E4E4", lw=1, zorder=0))
        for r, (x, y) in enumerate(where):
            ax.add_patch(Circle((x, y), node, fc="white", ec="#666666", lw=1, zorder=4))
            if p <= 16:
                ax.text(x, y, str(r), ha="center", va="center", fontsize=8 if p <= 8 else 6, zorder=5)
        for m in per_round[c]:
            b = which.get(id(m))
            tint = palette.get(b, "#555555") if by_block else sender_colors[m.src]
            (x0, y0), (x1, y1) = where[m.src], where[m.dst]
            rad = -0.25  # bulge outwards, along the circle
            ax.add_patch(FancyArrowPatch((x0, y0), (x1, y1), arrowstyle="-|>", mutation_scale=10, lw=1.6,
                                         color=tint, connectionstyle=f"arc3,rad={rad}", zorder=3,
                                         shrinkA=node * 72 * panel / 2.76, shrinkB=node * 72 * panel / 2.76))
            if by_block and b is not None and b != SEVERAL and p <= 16:
                # The quadratic curve's midpoint: half-way to arc3's control point.
                mx = (x0 + x1) / 2 + rad / 2 * (y1 - y0)
                my = (y0 + y1) / 2 - rad / 2 * (x1 - x0)
                ax.text(mx, my, str(b), fontsize=7, ha="center", va="center", color=tint, zorder=6,
                        bbox={"boxstyle": "round,pad=0.1", "fc": "white", "ec": "none", "alpha": 0.85})
        if show_reduces:
            for e in reduces.get(c, ()):
                x, y = where[e["rank"]]
                tint = palette.get(blocks.of_local(e), "#555555") if by_block else "#C0504D"
                ax.text(x * 1.25, y * 1.25, "⊕", ha="center", va="center", fontsize=11, color=tint, zorder=6)
        ax.set_title(f"round {c + 1}", fontsize=9)
    if by_block:
        _block_legend(fig, palette, bool(show_reduces and reduces), any(b is None for b in which.values()),
                      loc="outside right upper")
    if title is None:
        title = f"{_call_names(events)}: {p} ranks on a circle, {len(msgs)} messages"
    fig.suptitle(title, fontsize=10)
    return fig


# -- the cost model over measurements --------------------------------------------------------------


def _rows(rows) -> list[dict]:
    """Bench rows as dicts: :class:`commkit.bench.Row` objects, dicts, or ``commkit bench --json`` output."""
    if isinstance(rows, dict):
        rows = rows.get("rows", None)
        if rows is None:
            raise InvalidArgument("expected bench rows or `commkit bench --json` output with a 'rows' list.")
    out = []
    for r in rows:
        d = r if isinstance(r, dict) else getattr(r, "__dict__", None)
        if not isinstance(d, dict) or any(k not in d for k in ("collective", "size", "algorithm", "nprocs", "time_us")):
            raise InvalidArgument(
                f"each bench row needs collective, size, algorithm, nprocs and time_us, got {r!r}."
            )
        out.append({"collective": d["collective"], "size": int(d["size"]), "algorithm": d["algorithm"],
                    "nprocs": int(d["nprocs"]), "time_us": float(d["time_us"])})
    return out


def _only(values, what):
    values = sorted(set(values))
    if len(values) != 1:
        raise InvalidArgument(f"the rows hold several {what}s {values}; choose one with {what}=.")
    return values[0]


def predicted_crossovers(collective: str, p: int, algorithms, lo: int, hi: int, *, alpha=None, beta=None,
                         gamma=None) -> list[tuple[int, str, str]]:
    """Sizes in ``[lo, hi]`` where the model's fastest of ``algorithms`` changes.

    Returns:
        ``(first_size, old_winner, new_winner)`` for each change, smallest first;
        ``first_size`` is the exact byte at which ``new_winner`` takes over.
    """
    names = [a for a in algorithms if a != "native"]
    if not names or hi <= lo:
        return []

    def winner(n):
        return min(names, key=lambda a: (cost.predict(collective, a, p, n, alpha=alpha, beta=beta, gamma=gamma),
                                         names.index(a)))

    grid = sorted({lo, hi} | {round(lo * (hi / lo) ** (i / 256)) for i in range(257)} if lo > 0
                  else {0, hi} | {round(hi ** (i / 256)) for i in range(257)})
    return changes(winner, grid)


def measured_crossovers(rows, *, collective: str | None = None, nprocs: int | None = None, algorithms=None,
                        tolerance: float = 0.1) -> list[tuple[int, int, str, str]]:
    """Where the fastest measured algorithm changes between consecutive sizes (``native`` left out).

    Timings are noisy, and two algorithms within a few percent of each other
    would "cross" at every other size. So the winner changes only when the
    previous winner is more than ``tolerance`` (relative) slower than the
    fastest at a size.

    Returns:
        ``(size_before, size_after, old_winner, new_winner)`` for each change.
    """
    data = _select_rows(_rows(rows), collective, nprocs)
    names = set(algorithms or {r["algorithm"] for r in data}) - {"native"}
    times = defaultdict(dict)
    for r in data:
        if r["algorithm"] in names:
            times[r["size"]][r["algorithm"]] = r["time_us"]
    out = []
    winner, last = None, None
    for size in sorted(times):
        at = times[size]
        fastest = min(at, key=lambda a: (at[a], a))
        if winner is None:
            winner = fastest
        elif winner not in at or at[winner] > at[fastest] * (1 + tolerance):
            out.append((last, size, winner, fastest))
            winner = fastest
        last = size
    return out


def _select_rows(data, collective, nprocs):
    if collective is not None:
        data = [r for r in data if r["collective"] == collective]
    if nprocs is not None:
        data = [r for r in data if r["nprocs"] == nprocs]
    if data:
        _only([r["collective"] for r in data], "collective")
        _only([r["nprocs"] for r in data], "nprocs")
    return data


def _algorithm_colors(collective: str, names) -> dict:
    """One colour per algorithm, the same in every figure of ``collective``: by registry order.

    Falls back to one colour per name drawn when the registry order would need more than
    the nine colours of the fixed palette (or a name is not registered).
    """
    order = [n for n in for_collective(collective) if n != "native"]
    palette = _colors(9)
    if all(n in order and order.index(n) < len(palette) for n in names):
        return {n: palette[order.index(n)] for n in names}
    return dict(zip(names, _colors(len(names))))


def _mark(ax, x, text, sizes, *, top, color, level=0):
    """Label a vertical line at ``x``: on its left near the right edge; ``level`` staggers neighbours."""
    lo, hi = math.log(sizes[0]), math.log(max(sizes[-1], sizes[0] + 1))
    right = (math.log(x) - lo) / (hi - lo) > 0.75
    dy = 3 + 20 * level
    ax.annotate(text, xy=(x, 1.0 if top else 0.0), xycoords=("data", "axes fraction"),
                xytext=(-3 if right else 3, -dy if top else dy), textcoords="offset points", fontsize=7,
                ha="right" if right else "left", va="top" if top else "bottom", color=color)


def predicted_vs_measured(rows=(), alpha: float | None = None, beta: float | None = None, gamma: float | None = None,
                          *, collective: str | None = None, nprocs: int | None = None, algorithms=None,
                          sizes=None, ax=None, title: str | None = None, colors: dict | None = None):
    """Measured times against the alpha-beta-gamma model: time against size, one colour per algorithm.

    Measured medians are drawn as markers joined by solid lines, the model's
    prediction (:func:`commkit.cost.predict`) for the same algorithm as a dashed
    line of the same colour, and ``native`` (no model) in black. Vertical lines
    mark the crossovers: dashed where the model's winner changes
    (:func:`predicted_crossovers`), dotted where the measured winner does
    (:func:`measured_crossovers`), half-way (on the log axis) between the two
    measured sizes it changed between, which its label names.

    Args:
        rows: ``commkit bench`` results: :class:`commkit.bench.Row` objects, dicts, or the
            parsed ``--json`` output. May be empty to draw the model alone.
        alpha, beta, gamma: the model's constants (default: :mod:`commkit.cost`'s); a tuning
            file's ``"measured"`` entry holds this machine's.
        collective, nprocs: which rows to draw (needed when the rows hold several, or none).
        algorithms: the algorithms to draw (default: every one in the rows, or every one the
            model applies to when there are no rows).
        sizes: sizes (bytes) to evaluate the model at (default: 128 points over the measured range).
        ax, title: as for :func:`timeline`.
        colors: a colour for each algorithm name (any matplotlib colour), so that a notebook's
            figures show one algorithm in one colour; algorithms left out get the default palette.

    Returns:
        the matplotlib Figure.

    Raises:
        InvalidArgument: the rows mix collectives or process counts and none was chosen, or
            there is nothing to draw. ImportError: matplotlib is missing.
    """
    _require()
    data = _select_rows(_rows(rows), collective, nprocs)
    if data:
        collective = collective or data[0]["collective"]
        nprocs = nprocs or data[0]["nprocs"]
    if collective is None or nprocs is None:
        raise InvalidArgument("with no bench rows, name the collective= and nprocs= to draw the model for.")
    names = list(algorithms) if algorithms is not None else (
        sorted({r["algorithm"] for r in data}) if data else cost.applicable(collective, nprocs))
    if not names:
        raise InvalidArgument(f"no algorithms to draw for {collective} on {nprocs} ranks.")
    measured_sizes = sorted({r["size"] for r in data if r["size"] > 0})
    if sizes is None:
        lo, hi = (measured_sizes[0], measured_sizes[-1]) if measured_sizes else (8, 1 << 20)
        hi = max(hi, lo * 2)
        sizes = sorted({max(1, round(lo * (hi / lo) ** (i / 127))) for i in range(128)})
    sizes = [s for s in sizes if s > 0]
    fig, ax = _figure(ax, (9, 5.5))
    colors = dict(_algorithm_colors(collective, [n for n in names if n != "native"]), **(colors or {}))
    for name in names:
        mine = sorted((r["size"], r["time_us"]) for r in data if r["algorithm"] == name and r["size"] > 0)
        if name == "native":
            if mine:
                ax.plot(*zip(*mine), "x-", color="black", lw=1.2, markersize=5, label="native (measured)")
            continue
        color = colors[name]
        if mine:
            ax.plot(*zip(*mine), "o-", color=color, lw=1.4, markersize=4, label=f"{name}")
        model = [cost.predict(collective, name, nprocs, s, alpha=alpha, beta=beta, gamma=gamma) * 1e6 for s in sizes]
        ax.plot(sizes, model, "--", color=color, lw=1.2, alpha=0.85, label=None if mine else f"{name} (model)")

    predicted = predicted_crossovers(collective, nprocs, names, sizes[0], sizes[-1], alpha=alpha, beta=beta,
                                     gamma=gamma)
    for i, (size, old, new) in enumerate(predicted):
        ax.axvline(size, color="#555555", ls="--", lw=0.9, zorder=0, gid="predicted-crossover")
        _mark(ax, size, f"model: {new}\nfrom {_fmt_bytes(size)}", sizes, top=True, color="#333333", level=i % 2)
    for i, (a, b, old, new) in enumerate(measured_crossovers(data, algorithms=names) if data else []):
        # The winner changed somewhere between two measured sizes: the line sits between them (at their
        # geometric mean, the middle on this log axis), and so does the label; neither claims a size.
        at = math.sqrt(a * b)
        ax.axvline(at, color=colors.get(new, "#555555"), ls=":", lw=1.4, zorder=0, gid="measured-crossover")
        _mark(ax, at, f"measured: {new}\nbetween {_fmt_bytes(a)} and {_fmt_bytes(b)}", sizes, top=False,
              color=colors.get(new, "#333333"), level=i % 2)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size (bytes, as the selector counts it)")
    ax.set_ylabel("time (us)")
    ax.grid(True, which="major", alpha=0.3)
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter

    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _fmt_bytes(v) if v >= 1 else ""))
    handles, labels = ax.get_legend_handles_labels()
    if data:
        handles += [Line2D([], [], color="gray", marker="o", lw=1.4, markersize=4),
                    Line2D([], [], color="gray", ls="--", lw=1.2)]
        labels += ["measured (median)", "model"]
    ax.legend(handles, labels, fontsize=8, loc="upper left", frameon=False)
    a, b, g = (cost.ALPHA if alpha is None else alpha, cost.BETA if beta is None else beta,
               cost.GAMMA if gamma is None else gamma)
    if title is None:
        what = "measured and predicted" if data else "predicted by the model (no measurements)"
        title = (f"{collective} on {nprocs} ranks: {what}\n"
                 f"α = {a * 1e6:.3g} us, β = {b * 1e9:.3g} ns/B, γ = {g * 1e9:.3g} ns/B")
    ax.set_title(title, fontsize=10)
    return fig


def buffer_states(collective: str, algorithm: str, p: int, count: int | None = None, *, root: int = 0,
                  ax=None, title: str | None = None, columns: str = "round", color: str = "count"):
    """Each rank's output after each round (or step): how many ranks' data an element holds, or whose.

    The textbook picture of an algorithm (ring allreduce: block i's partial sum
    grows by one contribution per round as it travels, then the finished blocks
    go round again; a binomial broadcast: the data doubles its reach each round),
    computed from a real run on threads by :func:`commkit.tracing.buffer_states`.
    Rows are ranks; each column shows every rank's whole output, one square per
    element. A rank holds its own input from the start, so its own contribution
    counts everywhere it belongs (every element of an allreduce, scan, reduce or
    reduce_scatter; its own block of an allgather; the root's whole vector of a
    broadcast) before any message arrives: the first column ("start") is the
    inputs. An element the schedule never writes holds nothing, as the result will
    (a naive reduce's non-roots; an allgather that forgets to copy its own block).

    Args:
        collective, algorithm, p, count, root: what to run (see :func:`commkit.tracing.buffer_states`).
        ax, title: as for :func:`diagram`.
        columns: ``"round"``: one column per communication round of :func:`rounds` (the state
            once the round's messages have arrived and been reduced), so that all ranks line
            up even when they take different steps (a tree's leaves, a fold); ``"step"``: one
            column per step of each rank's schedule.
        color: ``"count"``: the number in a square is how many ranks' data it holds, the
            colour scaled from 0 to the most any square holds; ``"origin"``: the colour (and
            number) is the rank whose data the square holds, grey with ``Σk`` where it holds a
            partial result of k ranks, white where it holds nothing.

    Returns:
        The matplotlib Figure. Its image's data (``fig.axes[0].images[0].get_array()``) is the
        count of ranks per square (``"count"``), or the rank of origin, ``p`` for several and
        NaN for none (``"origin"``); NaN also in the gaps between columns.

    Raises:
        InvalidArgument: see :func:`commkit.tracing.buffer_states`; an unknown ``columns`` or ``color``.
    """
    if columns not in ("round", "step"):
        raise InvalidArgument(f"columns must be 'round' or 'step', got {columns!r}.")
    if color not in ("count", "origin"):
        raise InvalidArgument(f"color must be 'count' or 'origin', got {color!r}.")
    _require()
    import numpy as np

    states, events = _states.buffer_states(collective, algorithm, p, count, root=root, with_events=True)
    written = _first_writes(events, [len(seq[0][2]) for seq in states])
    if columns == "round":
        states, labels = _by_round(states, events)
    else:
        labels = ["start"] + [f"step {c}" for c in range(max(len(s) for s in states) - 1)]
    steps = len(labels)
    width = max(len(bits) for s in states for _, _, bits in s) or 1
    grid = np.full((p, steps * (width + 1) - 1), np.nan)
    several = {}  # (row, column) -> how many ranks' data a square of several holds ("origin")
    for r, seq in enumerate(states):
        own = _own_input(collective, p, root, r, len(seq[0][2]))
        for c, (step, _, bits) in enumerate(seq):
            for i, held in enumerate(_held(bits, own, written[r], step)):
                x = c * (width + 1) + i
                if color == "count":
                    grid[r, x] = held.bit_count()
                elif held.bit_count() == 1:
                    grid[r, x] = held.bit_length() - 1
                elif held:
                    grid[r, x], several[r, x] = p, held.bit_count()
    size = (min(max(4.5, 2.0 + 0.28 * grid.shape[1]), 18) + (1.0 if color == "origin" else 0), 1.0 + 0.45 * p)
    fig, ax = _figure(ax, size)
    if color == "count":
        top = max(1, int(np.nanmax(grid)) if not np.isnan(grid).all() else 1)
        image = ax.imshow(grid, cmap="Blues", vmin=0, vmax=top, aspect="auto", interpolation="nearest")
        fig.colorbar(image, ax=ax, label="ranks' data held", shrink=0.8, ticks=_int_ticks(top))
    else:
        from matplotlib.colors import ListedColormap
        from matplotlib.patches import Patch

        palette = [*_colors(p), _SEVERAL_COLOR]
        image = ax.imshow(grid, cmap=ListedColormap(palette), vmin=-0.5, vmax=p + 0.5, aspect="auto",
                          interpolation="nearest")
        present = sorted({int(v) for v in grid[~np.isnan(grid)]})
        handles = [Patch(color=palette[v], label=f"rank {v}'s data" if v < p else "several ranks' (Σk: k of them)")
                   for v in present[:17]]
        ax.legend(handles=handles, fontsize=8, frameon=False, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    if grid.size <= 600:
        for (r, c), v in np.ndenumerate(grid):
            if np.isnan(v):
                continue
            if color == "count":
                text, dark = f"{int(v)}", v > top / 2
            else:
                text, dark = (f"Σ{several[r, c]}", False) if (r, c) in several else (f"{int(v)}", True)
            ax.text(c, r, text, ha="center", va="center", fontsize=7, color="white" if dark else "black")
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    ax.set_xticks([c * (width + 1) + (width - 1) / 2 for c in range(steps)], labels, fontsize=7)
    gap = "\n" if size[0] < 8 else " "  # a narrow figure gets its title on two lines
    what = "how many ranks' data" if color == "count" else "whose data"
    ax.set_title(title or f"{collective} {algorithm}, p={p}:{gap}{what} each rank's output holds, start = its input",
                 fontsize=10)
    return fig


def _int_ticks(top: int) -> list:
    """At most about 8 whole-number ticks from 0 to ``top``."""
    step = max(1, math.ceil(top / 8))
    return list(range(0, top + 1, step))


def _own_input(collective: str, p: int, root: int, rank: int, width: int) -> tuple[list, bool]:
    """The bit of ``rank``'s own input at each of its output's ``width`` elements (0 where it has none),
    and whether the output holds it before any step runs.

    A rank's input is a contribution to every element of a reduction's output (allreduce, scan,
    reduce, reduce_scatter: its block of the input is the one it keeps) and to its own block of an
    allgather; the schedule puts it there. A broadcast root's input is the data itself, and its
    output holds it from the start without a step of the schedule writing it.
    """
    bit = 1 << rank
    if collective == "allgather":
        block = width // p
        return [bit if rank * block <= i < (rank + 1) * block else 0 for i in range(width)], False
    if collective == "broadcast":
        return [bit if rank == root else 0] * width, True
    return [bit] * width, False


_NEVER = 1 << 62  # the first step that writes an element no step writes


def _first_writes(events, widths) -> list:
    """For each rank, the first step that writes each element of its output (:data:`_NEVER`: none does)."""
    first = [[_NEVER] * width for width in widths]
    for e in events:
        row = first[e["rank"]]
        for name, lo, hi in [*e.get("recv_ranges", ()), *([e["range"]] if e.get("range") else [])]:
            if name == "out":
                for i in range(lo, min(hi, len(row))):
                    row[i] = min(row[i], e["step"])
    return first


def _held(bits, own, first_write, step: int) -> list:
    """The ranks (as bits) each output element holds after ``step``.

    Once a step has written the element, what it holds is what the output says. Before that
    the output holds nothing yet (or garbage: a non-root's scratch output of a reduce is not
    initialised), and the rank holds towards it only its own input, counted where the schedule
    writes the element at some point or the output starts with it (``own`` from
    :func:`_own_input`): an element it never writes (a naive reduce's non-root, an allgather
    that forgets to copy its own block) holds nothing, as its result will.
    """
    bits_of, preset = own
    return [int(v) if first <= step else (o if preset or first < _NEVER else 0)
            for v, o, first in zip(bits, bits_of, first_write)]


def _by_round(states, events):
    """Each rank's states at the end of every communication round, and the column labels.

    A transfer counts in its own round; a local step (reduce, copy) in the round whose data
    it works on, the one before the boundary :func:`rounds` puts it on.
    """
    col = rounds(events)
    where = {}
    for e in events:
        c = col[(e["rank"], e["seq"], e["step"])]
        where[(e["rank"], e["step"])] = c if e["kind"] in MESSAGE_KINDS else max(c - 1, 0)
    total = 1 + max([col[(e["rank"], e["seq"], e["step"])] for e in events if e["kind"] in MESSAGE_KINDS],
                    default=-1)
    if total == 0:  # nothing was sent (one rank): only the start and the end
        return [[seq[0], seq[-1]] for seq in states], ["start", "end"]
    out = []
    for rank, seq in enumerate(states):
        current, row, pending = seq[0], [seq[0]], list(seq[1:])
        for k in range(total):
            # Steps come in program order, and their rounds never decrease.
            while pending and min(where[(rank, pending[0][0])], total - 1) <= k:
                current = pending.pop(0)
            row.append(current)
        out.append(row)
    return out, ["start"] + [f"round {c + 1}" for c in range(total)]
