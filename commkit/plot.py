"""Pictures of collectives: timelines and communication diagrams, and the cost model over measurements.

Every drawing takes events in :mod:`commkit.tracing`'s format, so it draws a
real run (a :class:`~commkit.tracing.Tracer`) and the model (a result of
:func:`commkit.sim.simulate` with ``events=True``) alike:

* :func:`timeline` -- time on the x axis, one row per rank, a bar per step
  coloured by what it did, thin lines for messages;
* :func:`diagram` -- the communication diagram of the textbooks: ranks as
  rows, communication rounds as columns, an arrow per message (line width
  grows with its bytes) and a ``⊕`` where a rank reduces;
* :func:`schedule_diagram` -- the same from the simulator, with no run at all;
* :func:`predicted_vs_measured` -- ``commkit bench`` results against the
  alpha-beta-gamma model, one colour per algorithm, crossovers marked.

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

from .errors import InvalidArgument
from .tracing import MESSAGE_KINDS, events_of, messages

__all__ = ["KIND_COLORS", "buffer_states", "diagram", "measured_crossovers", "predicted_crossovers",
           "predicted_vs_measured", "rounds", "schedule_diagram", "timeline"]

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
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and (n >= 10 * 1024 or n % scale == 0):
            value = n / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.3g} {unit}"
    return f"{int(n)} B"


def _time_unit(span: float):
    if span < 1e-3:
        return 1e6, "us"
    if span < 1:
        return 1e3, "ms"
    return 1.0, "s"


def _colors(n: int):
    from matplotlib import colormaps

    cmap = colormaps["tab10" if n <= 10 else "tab20" if n <= 20 else "turbo"]
    if n > 20:
        return [cmap(i / max(n - 1, 1)) for i in range(n)]
    return [cmap(i) for i in range(n)]


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


# -- timeline -------------------------------------------------------------------------------------


def timeline(source, *, ax=None, show_messages: bool | None = None, title: str | None = None, width: float = 10.0):
    """Draw each rank's steps against time: one row per rank, one bar per step.

    Args:
        source: a :class:`~commkit.tracing.Tracer`, a simulator result, or a list of events.
        ax: draw into these matplotlib Axes instead of a new figure.
        show_messages: draw a line from each send step's start to its receive step's end
            (default: when there are at most 400 messages).
        title: the title (default: the calls drawn and the number of ranks).
        width: figure width in inches (the height follows the number of ranks).

    Returns:
        the matplotlib Figure.

    Raises:
        InvalidArgument: no events. ImportError: matplotlib is missing.
    """
    _require()
    events = _nonempty(source)
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
        for m in msgs:
            ax.annotate("", xy=(x(m.recv["end"]), row[m.dst]), xytext=(x(m.send["start"]), row[m.src]),
                        arrowprops={"arrowstyle": "-|>", "color": "#222222", "lw": 0.6, "alpha": 0.45,
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


def diagram(source, *, ax=None, show_bytes: bool | None = None, show_reduces: bool = True, title: str | None = None):
    """Draw the communication diagram: ranks as rows, rounds as columns, an arrow per message.

    An arrow leaves its sender in the round of the send step and arrives at the
    end of the round of the matching receive; its width grows with the bytes it
    carries. A ``⊕`` marks where a rank reduces what it received.

    Args:
        source: a :class:`~commkit.tracing.Tracer`, a simulator result, or a list of events
            (filter one call first with :func:`commkit.tracing.select` if the trace holds many).
        ax: draw into these matplotlib Axes instead of a new figure.
        show_bytes: label each arrow with its size (default: when there are at most 40 messages).
        show_reduces: mark reduce steps.
        title: the title (default: the calls drawn and the number of ranks).

    Returns:
        the matplotlib Figure.

    Raises:
        InvalidArgument: no events. ImportError: matplotlib is missing.
    """
    _require()
    from matplotlib.patches import FancyArrowPatch

    events = _nonempty(source)
    col = rounds(events)
    ranks = sorted({e["rank"] for e in events})
    row = {r: i for i, r in enumerate(ranks)}
    # With fewer elements than ranks some blocks are empty: their 0-byte messages and reduces are
    # no work, so they are not drawn (a barrier's messages carry nothing and are all drawn).
    msgs = [m for m in messages(events) if m.nbytes or m.collective == "barrier"]
    # Local steps sit on the boundary after their rank's last transfer, so they add no column.
    ncols = max([col[(e["rank"], e["seq"], e["step"])] + 1 for e in events
                 if e["kind"] in MESSAGE_KINDS or e["kind"] == "native"], default=1)
    fig, ax = _figure(ax, (min(max(4.5, 1.6 + 1.0 * ncols), 18), 1.2 + 0.55 * len(ranks)))
    colors = _colors(len(ranks))

    for r in ranks:
        ax.plot([0, ncols], [row[r], row[r]], color="#D0D0D0", lw=1, zorder=1)
    for c in range(ncols + 1):
        ax.axvline(c, color="#EEEEEE", lw=0.8, zorder=0)

    biggest = max((m.nbytes for m in msgs), default=0)
    if show_bytes is None:
        show_bytes = 0 < len(msgs) <= 40 and biggest > 0
    departures = defaultdict(list)
    for m in msgs:
        x0 = col[(m.src, m.seq, m.send["step"])] + 0.12
        x1 = col[(m.dst, m.seq, m.recv["step"])] + 0.88
        y0, y1 = row[m.src], row[m.dst]
        width = 0.9 + 2.4 * (m.nbytes / biggest if biggest else 0)
        color = colors[row[m.src]]
        ax.add_patch(FancyArrowPatch((x0, y0), (x1, y1), arrowstyle="-|>", mutation_scale=9 + 2 * width,
                                     lw=width, color=color, shrinkA=0, shrinkB=0, zorder=3, alpha=0.9))
        ax.plot([x0], [y0], "o", color=color, markersize=3.5, zorder=4)
        departures[(x0, y0)].append(m.nbytes)
    if show_bytes:
        # One label per departure point, just above it: arrows overlap further along, tails never do.
        for (x0, y0), sizes in departures.items():
            lo, hi = min(sizes), max(sizes)
            text = _fmt_bytes(lo) if lo == hi else f"{_fmt_bytes(lo)}–{_fmt_bytes(hi)}"
            ax.text(x0 - 0.04, y0 - 0.13, text, fontsize=7, ha="left", va="bottom", color=colors[y0], zorder=5,
                    bbox={"boxstyle": "round,pad=0.1", "fc": "white", "ec": "none", "alpha": 0.8})
    for e in events:
        k = (e["rank"], e["seq"], e["step"])
        if e["kind"] == "native":
            ax.add_patch(_box(col[k], row[e["rank"]], "#8172B3"))
            ax.text(col[k] + 0.5, row[e["rank"]], "native", ha="center", va="center", fontsize=7, color="white",
                    zorder=4)
    if show_reduces:
        marks = {(col[(e["rank"], e["seq"], e["step"])], row[e["rank"]]) for e in events
                 if e["kind"] == "reduce" and e.get("bytes", 1)}
        for c, y in marks:
            ax.text(c, y, "⊕", ha="center", va="center", fontsize=13, color="#C0504D", zorder=6,
                    bbox={"boxstyle": "circle,pad=0.0", "fc": "white", "ec": "none"})
        if marks:
            ax.plot([], [], "none", label="⊕ reduce")

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


def _box(c, y, color):
    from matplotlib.patches import FancyBboxPatch

    return FancyBboxPatch((c + 0.1, y - 0.25), 0.8, 0.5, boxstyle="round,pad=0.02", fc=color, ec="none", zorder=3)


def schedule_diagram(collective: str, algorithm: str, p: int, nbytes: int = 4096, *, ax=None,
                     show_bytes: bool | None = None, show_reduces: bool = True, title: str | None = None,
                     **sim_options):
    """The communication diagram of ``collective``'s ``algorithm`` on ``p`` ranks, from the simulator (no run).

    Args:
        collective, algorithm, p, nbytes: what to simulate (see :func:`commkit.sim.simulate`).
        sim_options: more arguments for :func:`commkit.sim.simulate` (``root``, ``itemsize``, ``op`` ...).
        ax, show_bytes, show_reduces, title: as for :func:`diagram`.

    Returns:
        the matplotlib Figure.
    """
    from . import sim

    result = sim.simulate(collective, algorithm, p, nbytes, events=True, **sim_options).check()
    if title is None:
        size = "" if collective == "barrier" else f", {_fmt_bytes(result.nbytes)}"
        title = f"{collective}_{algorithm}: {p} ranks{size}"
    return diagram(result.events, ax=ax, show_bytes=show_bytes, show_reduces=show_reduces, title=title)


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
    from . import cost

    names = [a for a in algorithms if a != "native"]
    if not names or hi <= lo:
        return []

    def winner(n):
        return min(names, key=lambda a: (cost.predict(collective, a, p, n, alpha=alpha, beta=beta, gamma=gamma),
                                         names.index(a)))

    grid = sorted({lo, hi} | {round(lo * (hi / lo) ** (i / 256)) for i in range(257)} if lo > 0
                  else {0, hi} | {round(hi ** (i / 256)) for i in range(257)})
    out = []
    prev, current = grid[0], winner(grid[0])
    for point in grid[1:]:
        while winner(point) != current:
            a, b = prev, point
            while b - a > 1:
                mid = (a + b) // 2
                if winner(mid) == current:
                    a = mid
                else:
                    b = mid
            new = winner(b)
            out.append((b, current, new))
            current, prev = new, b
        prev = point
    return out


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
                          sizes=None, ax=None, title: str | None = None):
    """Measured times against the alpha-beta-gamma model: time against size, one colour per algorithm.

    Measured medians are drawn as markers joined by solid lines, the model's
    prediction (:func:`commkit.cost.predict`) for the same algorithm as a dashed
    line of the same colour, and ``native`` (no model) in black. Vertical lines
    mark the crossovers: dashed where the model's winner changes
    (:func:`predicted_crossovers`), dotted where the measured winner does
    (:func:`measured_crossovers`).

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

    Returns:
        the matplotlib Figure.

    Raises:
        InvalidArgument: the rows mix collectives or process counts and none was chosen, or
            there is nothing to draw. ImportError: matplotlib is missing.
    """
    _require()
    from . import cost

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
    colors = dict(zip([n for n in names if n != "native"], _colors(sum(n != "native" for n in names))))
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
        at = math.sqrt(a * b)
        ax.axvline(at, color=colors.get(new, "#555555"), ls=":", lw=1.4, zorder=0, gid="measured-crossover")
        _mark(ax, at, f"measured: {new}\nfrom {_fmt_bytes(b)}", sizes, top=False, color=colors.get(new, "#333333"),
              level=i % 2)
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
                  ax=None, title: str | None = None):
    """Each rank's output after each step, coloured by how many ranks' contributions an element holds.

    The textbook picture of an algorithm (ring allreduce: block i's partial sum
    grows by one contribution per round as it travels, then the finished blocks
    go round again), computed from a real run on threads by
    :func:`commkit.tracing.buffer_states`. Rows are ranks, columns are steps
    (each column shows the rank's whole output, one square per element), and the
    number in a square is how many ranks' data it holds.

    Returns:
        The matplotlib Figure (its image's data is ``fig.axes[0].images[0].get_array()``).
    """
    _require()
    import numpy as np

    from . import tracing

    states = tracing.buffer_states(collective, algorithm, p, count, root=root)
    steps = max(len(s) for s in states)
    width = max(len(bits) for s in states for _, _, bits in s) or 1
    grid = np.full((p, steps * (width + 1) - 1), np.nan)
    for r, seq in enumerate(states):
        for c, (_, _, bits) in enumerate(seq):
            held = np.array([bin(int(v)).count("1") for v in bits], float)
            grid[r, c * (width + 1): c * (width + 1) + len(held)] = held
    fig, ax = _figure(ax, (min(2.0 + 0.28 * grid.shape[1], 18), 1.0 + 0.45 * p))
    image = ax.imshow(grid, cmap="Blues", vmin=0, vmax=p, aspect="auto", interpolation="nearest")
    if grid.size <= 600:
        for (r, c), v in np.ndenumerate(grid):
            if not np.isnan(v):
                ax.text(c, r, f"{int(v)}", ha="center", va="center", fontsize=7,
                        color="white" if v > p / 2 else "black")
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    ax.set_xticks([c * (width + 1) + (width - 1) / 2 for c in range(steps)],
                  ["start"] + [f"step {c}" for c in range(steps - 1)], fontsize=7)
    fig.colorbar(image, ax=ax, label="contributions held", shrink=0.8)
    ax.set_title(title or f"{collective} {algorithm}, p={p}: what each rank's output holds after each step")
    return fig
