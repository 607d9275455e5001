"""Pictures: diagrams and timelines from real traces and from the simulator, and the model over bench rows."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections import Counter
from itertools import pairwise

import numpy as np
import pytest

import commkit as ck
from commkit import algorithms, cost, plot, sim, tracing
from commkit.schedule import Exchange
from commkit.tracing import messages, select

pytest.importorskip("matplotlib")

rng = np.random.default_rng()


def _traced(p, body):
    with ck.trace() as t:
        ck.run_local(body, p)
    return t


def _is_figure(obj) -> bool:
    from matplotlib.figure import Figure as _Figure

    return isinstance(obj, _Figure)


def _arrows(fig):
    from matplotlib.patches import FancyArrowPatch

    return [a for ax in fig.axes for a in ax.patches if isinstance(a, FancyArrowPatch)]


def _arrow_ends(fig):
    """(tail, head) data coordinates of every arrow."""
    return [(a._posA_posB[0], a._posA_posB[1]) for a in _arrows(fig)]


def test_commkit_imports_without_matplotlib():
    code = textwrap.dedent("""
        import sys
        sys.modules["matplotlib"] = None          # any import of matplotlib now fails
        import commkit, commkit.tracing, commkit.plot
        from commkit import sim
        res = sim.simulate("allreduce", "ring", 4, 64, events=True)
        commkit.plot.rounds(res)                  # layout needs no matplotlib
        try:
            commkit.plot.diagram(res)
        except ImportError as exc:
            assert "pip install matplotlib" in str(exc), exc
        else:
            raise SystemExit("diagram() drew without matplotlib")
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


# -- rounds: the diagram's columns ------------------------------------------------------------------


@pytest.mark.parametrize("collective, algorithm, p, expected", [
    ("broadcast", "binomial", 8, 3),
    ("broadcast", "binomial", 5, 3),
    ("allreduce", "ring", 4, 6),
    ("allreduce", "recursive_doubling", 8, 3),
    ("allreduce", "rabenseifner", 8, 6),
    ("allgather", "ring", 7, 6),
    ("barrier", "dissemination", 6, 3),
    ("alltoall", "pairwise", 5, 4),
])
def test_rounds_of_simulated_schedules_are_the_textbook_rounds(collective, algorithm, p, expected):
    res = sim.simulate(collective, algorithm, p, 64 * p, events=True)
    col = plot.rounds(res)
    transfers = [e for e in res.events if e["sends"] or e["recvs"]]
    assert max(col[(e["rank"], e["seq"], e["step"])] for e in transfers) + 1 == expected
    # Every message's receive is in its send's round or later, and each rank's transfers move on.
    for m in messages(res):
        assert col[(m.dst, m.seq, m.recv["step"])] >= col[(m.src, m.seq, m.send["step"])]
    for r in range(p):
        mine = [col[(e["rank"], e["seq"], e["step"])] for e in transfers if e["rank"] == r]
        assert mine == sorted(set(mine))


def test_rounds_of_a_real_run_equal_the_simulators():
    p, n = 6, 50

    def body(comm):
        comm.allreduce(rng.standard_normal(n), algorithm="rabenseifner")
    real = plot.rounds(_traced(p, body))
    model = plot.rounds(sim.simulate("allreduce", "rabenseifner", p, count=n, itemsize=8, events=True))
    assert real == model  # both are the communicator's first call, seq 0


def test_rounds_rejects_messages_that_wait_on_each_other():
    # Rank 0 receives from 1 before sending to 1; rank 1 does the same: no order can run this.
    events = []
    for r in (0, 1):
        peer = 1 - r
        events.append({"rank": r, "collective": "x", "seq": 0, "algorithm": "bad", "step": 0, "kind": "recv",
                       "sends": [], "recvs": [[peer, 8]], "bytes": 8, "start": 0.0, "end": 1.0})
        events.append({"rank": r, "collective": "x", "seq": 0, "algorithm": "bad", "step": 1, "kind": "send",
                       "sends": [[peer, 8]], "recvs": [], "bytes": 8, "start": 1.0, "end": 2.0})
    with pytest.raises(ck.InvalidArgument, match="cycle"):
        plot.rounds(events)


# -- diagram ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("collective, algorithm, p", [
    ("allreduce", "ring", 4), ("broadcast", "binomial", 7), ("alltoall", "bruck", 5), ("gather", "naive", 4),
    ("reduce_scatter", "recursive_halving", 8), ("barrier", "dissemination", 5),
])
def test_diagram_from_the_simulator_draws_one_arrow_per_message(collective, algorithm, p, tmp_path):
    res = sim.simulate(collective, algorithm, p, 96 * p, events=True)
    fig = plot.diagram(res)
    assert _is_figure(fig)
    assert len(_arrows(fig)) == sum(res.messages) == len(messages(res))
    fig.savefig(tmp_path / "d.png")  # renders with the Agg canvas, no display
    assert (tmp_path / "d.png").stat().st_size > 1000


def test_diagram_arrows_go_from_sender_row_to_receiver_row():
    p = 5

    def body(comm):
        comm.allreduce(rng.standard_normal(23), algorithm="ring")
    t = _traced(p, body)
    fig = plot.diagram(t)
    ends = _arrow_ends(fig)
    assert len(ends) == 2 * (p - 1) * p
    for (x0, y0), (x1, y1) in ends:
        # Ring: every arrow goes one row down (to the right neighbour), wrapping from the last to the first.
        assert round(y1) == (round(y0) + 1) % p
        assert 0 < x1 - x0 < 1  # sent and received in the same round
    # A ⊕ for each reduce step's round: p-1 reductions per rank.
    marks = [txt for ax in fig.axes for txt in ax.texts if txt.get_text() == "⊕"]
    assert len(marks) == p * (p - 1)


def test_diagram_of_a_trace_with_several_calls_names_each():
    def body(comm):
        x = rng.standard_normal(8)
        comm.allreduce(x, algorithm="recursive_doubling")
        comm.broadcast(x, root=1, algorithm="binomial")
    t = _traced(4, body)
    fig = plot.diagram(t, show_bytes=True)
    labels = {txt.get_text() for ax in fig.axes for txt in ax.texts}
    assert {"allreduce_recursive_doubling", "broadcast_binomial"} <= labels
    assert "64 B" in labels  # 8 float64 per message
    assert len(_arrows(fig)) == len(t.messages())
    one = plot.diagram(select(t, collective="broadcast"), show_bytes=False)
    assert len(_arrows(one)) == 3
    assert not [txt for txt in one.axes[0].texts if txt.get_text().endswith(" B")]


def test_schedule_diagram_needs_no_run_and_draws_into_given_axes():
    from matplotlib.figure import Figure

    fig = Figure()
    ax = fig.add_subplot()
    assert plot.schedule_diagram("scatter", "binomial", 8, 8 * 64, root=3, ax=ax) is fig
    assert len(_arrows(fig)) == 7
    assert "scatter_binomial" in ax.get_title()


def test_diagram_and_timeline_reject_empty_traces():
    with ck.trace() as t:
        pass
    with pytest.raises(ck.InvalidArgument, match="no events"):
        plot.diagram(t)
    with pytest.raises(ck.InvalidArgument, match="no events"):
        plot.timeline([])


# -- timeline --------------------------------------------------------------------------------------


def _bars(fig):
    """Number of bars of each kind (the collections' gid)."""
    from matplotlib.collections import PolyCollection

    out = Counter()
    for ax in fig.axes:
        for c in ax.collections:
            if isinstance(c, PolyCollection):
                out[c.get_gid()] += len(c.get_paths())
    return out


def test_timeline_draws_a_bar_per_step_and_a_line_per_message():
    p = 4

    def body(comm):
        comm.allreduce(rng.standard_normal(40), algorithm="ring")
        comm.allgather(rng.standard_normal(3), algorithm="bruck")
    t = _traced(p, body)
    fig = t.timeline()
    kinds = Counter(e["kind"] for e in t.events)
    bars = _bars(fig)
    assert sum(bars.values()) == len(t.events)
    assert bars["reduce"] == kinds["reduce"] == p * (p - 1)
    assert bars["send / receive"] == kinds["exchange"]
    arrows = [a for ax in fig.axes for a in ax.texts if getattr(a, "arrow_patch", None) is not None]
    assert len(arrows) == len(t.messages())
    ax = fig.axes[0]
    assert [tick.get_text() for tick in ax.get_yticklabels()] == [f"rank {r}" for r in range(p)]
    quiet = plot.timeline(t, show_messages=False).axes[0]
    assert not [a for a in quiet.texts if getattr(a, "arrow_patch", None) is not None]


def test_timeline_of_a_simulation_uses_model_time():
    res = sim.simulate("broadcast", "binomial", 4, 1000, itemsize=1, alpha=1.0, beta=0.01, events=True)
    fig = plot.timeline(res)
    ax = fig.axes[0]
    assert ax.get_xlabel() == "time (s) from the first step"
    assert ax.get_xlim()[1] == pytest.approx(res.time * 1.01)


# -- the model over measurements --------------------------------------------------------------------


def _model_rows(collective, p, names, sizes, a, b, g, noise=0.0):
    rows = []
    for name in names:
        for s in sizes:
            t = cost.predict(collective, name, p, s, alpha=a, beta=b, gamma=g) * 1e6
            rows.append({"collective": collective, "size": s, "algorithm": name, "nprocs": p,
                         "time_us": t * (1 + noise * rng.uniform(-1, 1))})
    return rows


def test_predicted_crossovers_agree_with_cost_crossovers():
    a, b, g = 2e-5, 3e-10, 1e-10
    p = 16
    names = cost.applicable("allreduce", p)
    regimes = cost.crossovers("allreduce", p, alpha=a, beta=b, gamma=g, max_bytes=1 << 26)
    found = plot.predicted_crossovers("allreduce", p, names, 1, 1 << 26, alpha=a, beta=b, gamma=g)
    # The plot scans from 1 byte; cost.crossovers from 0, where an algorithm that sends nothing for an
    # empty vector (ring_pipelined skips zero-length messages) wins. Compare the boundaries both see.
    seen = [r for r in regimes[1:] if r.min_bytes > 1]
    assert [size for size, _, _ in found] == [r.min_bytes for r in seen]
    assert [new for _, _, new in found] == [r.algorithm for r in seen]


def test_measured_crossovers_find_where_the_winner_changes():
    sizes = [2 ** k for k in range(3, 23, 2)]
    rows = _model_rows("allreduce", 8, ["recursive_doubling", "ring"], sizes, 1e-5, 1e-9, 1e-10)
    found = plot.measured_crossovers(rows, tolerance=0)
    assert len(found) == 1
    before, after, old, new = found[0]
    assert (old, new) == ("recursive_doubling", "ring")
    (boundary, *_), = plot.predicted_crossovers("allreduce", 8, ["recursive_doubling", "ring"], 8, 1 << 22,
                                                alpha=1e-5, beta=1e-9, gamma=1e-10)
    assert before < boundary <= after


def test_measured_crossovers_ignore_near_ties():
    rows = []
    for i, size in enumerate([8, 64, 512, 4096, 32768, 262144]):
        a, b = (10.0, 10.4) if i % 2 else (10.4, 10.0)  # a 4% tie that flips at every size
        rows += [{"collective": "allgather", "size": size, "algorithm": "ring", "nprocs": 4, "time_us": a},
                 {"collective": "allgather", "size": size, "algorithm": "bruck", "nprocs": 4, "time_us": b}]
    assert plot.measured_crossovers(rows) == []
    assert len(plot.measured_crossovers(rows, tolerance=0)) == 5
    rows.append({"collective": "allgather", "size": 1 << 21, "algorithm": "ring", "nprocs": 4, "time_us": 50.0})
    rows.append({"collective": "allgather", "size": 1 << 21, "algorithm": "bruck", "nprocs": 4, "time_us": 90.0})
    assert plot.measured_crossovers(rows) == [(262144, 1 << 21, "bruck", "ring")]


def test_predicted_vs_measured_draws_measured_model_and_crossovers():
    sizes = [2 ** k for k in range(3, 23)]
    names = ["recursive_doubling", "ring", "rabenseifner"]
    a, b, g = 1e-5, 1e-9, 1e-10
    rows = _model_rows("allreduce", 8, names, sizes, a, b, g, noise=0.02)
    rows += [dict(r, algorithm="native", time_us=r["time_us"] * 0.8) for r in rows if r["algorithm"] == "ring"]
    fig = plot.predicted_vs_measured(rows, a, b, g)
    ax = fig.axes[0]
    lines = [ln for ln in ax.get_lines() if ln.get_gid() is None and len(ln.get_xdata()) > 1]
    solid = [ln for ln in lines if ln.get_linestyle() == "-"]
    dashed = [ln for ln in lines if ln.get_linestyle() == "--"]
    assert len(solid) == len(names) + 1  # measured, native included
    assert len(dashed) == len(names)     # the model: none for native
    predicted = [ln for ln in ax.get_lines() if ln.get_gid() == "predicted-crossover"]
    expected = plot.predicted_crossovers("allreduce", 8, names, sizes[0], sizes[-1], alpha=a, beta=b, gamma=g)
    assert len(predicted) == len(expected) >= 1
    measured = [ln for ln in ax.get_lines() if ln.get_gid() == "measured-crossover"]
    assert len(measured) == len(plot.measured_crossovers(rows))


def test_predicted_vs_measured_accepts_bench_rows_and_json():
    from commkit import bench

    rows = [bench.Row("broadcast", s, s // 4, "float32", "sum", alg, 4, t, t, 0.01, 1.0, 1.0, None, 0, 10)
            for alg, base in (("binomial", 10.0), ("ring", 30.0)) for s, t in ((64, base), (1 << 20, base * 20))]
    fig = plot.predicted_vs_measured(rows)
    assert "broadcast on 4 ranks" in fig.axes[0].get_title()
    doc = {"meta": {}, "rows": [r.__dict__ for r in rows]}
    assert _is_figure(plot.predicted_vs_measured(doc))


def test_predicted_vs_measured_model_only_and_errors():
    fig = plot.predicted_vs_measured(collective="alltoall", nprocs=16, sizes=[2 ** k for k in range(16)])
    dashed = [ln for ln in fig.axes[0].get_lines() if ln.get_linestyle() == "--" and ln.get_gid() is None]
    assert len(dashed) == len(cost.applicable("alltoall", 16))
    with pytest.raises(ck.InvalidArgument, match="collective= and nprocs="):
        plot.predicted_vs_measured([])
    mixed = _model_rows("allreduce", 4, ["ring"], [64], 1e-5, 1e-9, 0) + \
        _model_rows("allreduce", 8, ["ring"], [64], 1e-5, 1e-9, 0)
    with pytest.raises(ck.InvalidArgument, match="nprocs"):
        plot.predicted_vs_measured(mixed)
    assert _is_figure(plot.predicted_vs_measured(mixed, nprocs=8))
    with pytest.raises(ck.InvalidArgument, match="time_us"):
        plot.predicted_vs_measured([{"collective": "allreduce"}])


def test_diagram_does_not_draw_empty_blocks_as_work():
    from commkit import sim

    # allreduce ring with 2 elements on 4 ranks: half the blocks are empty.
    events = sim.simulate("allreduce", "ring", 4, count=2, events=True).events
    ax = plot.diagram(events).axes[0]
    arrows = [p for p in ax.patches if type(p).__name__ == "FancyArrowPatch"]
    nonempty = [m for m in tracing.messages(events) if m.nbytes]
    assert len(arrows) == len(nonempty) < len(tracing.messages(events))
    reduces = [t for t in ax.texts if t.get_text() == "⊕"]
    assert len(reduces) == len({(e["rank"], e["step"]) for e in events if e["kind"] == "reduce" and e["bytes"]})
    # A barrier's messages are empty by nature and are all drawn.
    barrier = sim.simulate("barrier", "dissemination", 4, events=True).events
    ax = plot.diagram(barrier).axes[0]
    assert len([p for p in ax.patches if type(p).__name__ == "FancyArrowPatch"]) == len(tracing.messages(barrier))


@pytest.mark.parametrize("p", [2, 3, 4, 5])
def test_buffer_states_show_the_ring_textbook_picture(p):
    states = tracing.buffer_states("allreduce", "ring", p)
    for rank, seq in enumerate(states):
        held = [[int(v).bit_count() for v in bits] for _, _, bits in seq]
        assert held[0] == [0] * p and held[-1] == [p] * p  # nothing at the start, everything at the end
        # After the reduce-scatter phase (p-1 exchanges, each followed by a reduce) this rank owns
        # exactly one finished block, the one ring allreduce gives it: (rank + 1) % p.
        after_phase_one = held[2 * (p - 1)]
        assert after_phase_one.count(p) == min(p, 1)
        if p > 1:
            assert after_phase_one[(rank + 1) % p] == p
        # Contributions only ever grow.
        for before, after in pairwise(held):
            assert all(a >= b for a, b in zip(after, before))
    fig = plot.buffer_states("allreduce", "ring", p)
    grid = fig.axes[0].images[0].get_array()
    assert grid.shape[0] == p and np.nanmax(grid) == p
    with pytest.raises(ck.InvalidArgument, match="buffer_states shows"):
        tracing.buffer_states("alltoall", "pairwise", p)


# -- colour by block -------------------------------------------------------------------------------


def _rgb(c):
    from matplotlib.colors import to_rgb

    return tuple(round(v, 4) for v in to_rgb(c))


def _ring_block(rank, column, p):
    """The block ring allreduce's rank sends in a round (0-based), from commkit/algorithms/ring.py."""
    if column < p - 1:
        return (rank - column) % p               # reduce-scatter: block (r - k) % p
    return (rank - (column - (p - 1)) + 1) % p   # allgather: the finished block (r - k + 1) % p


@pytest.mark.parametrize("p, n", [(4, 16), (5, 23)])
def test_ring_diagram_colours_each_arrow_by_the_block_it_carries(p, n):
    def body(comm):
        comm.allreduce(rng.standard_normal(n), algorithm="ring")
    t = _traced(p, body)
    fig = plot.diagram(t)  # the ring splits the vector into p blocks: block colours by default
    palette = plot._colors(p)
    arrows = _arrows(fig)
    assert len(arrows) == 2 * p * (p - 1)
    for a in arrows:
        (x0, y0), _ = a._posA_posB
        assert _rgb(a.get_edgecolor()) == _rgb(palette[_ring_block(round(y0), int(x0), p)])
    legend = [txt.get_text() for txt in fig.axes[0].get_legend().get_texts()]
    assert [f"block {b}" for b in range(p)] == legend[:p]
    # The reduce marks take the colour of the block reduced: rank r's k-th reduce is block (r - k - 1) % p.
    col = plot.rounds(t)
    marks = {(round(m.get_position()[0]), round(m.get_position()[1])): _rgb(m.get_color())
             for m in fig.axes[0].texts if m.get_text() == "⊕"}
    for e in t.events:
        if e["kind"] == "reduce":
            c = col[(e["rank"], e["seq"], e["step"])]
            assert marks[(c, e["rank"])] == _rgb(palette[(e["rank"] - (c - 1) - 1) % p])
    # By sender on request: every arrow has its sender's colour, and no block legend.
    by_sender = plot.diagram(t, color="sender")
    for a in _arrows(by_sender):
        assert _rgb(a.get_edgecolor()) == _rgb(palette[round(a._posA_posB[0][1])])
    assert by_sender.axes[0].get_legend() is None


def test_whole_vector_algorithms_default_to_sender_colours_and_show_several_blocks_on_request():
    def body(comm):
        comm.allreduce(rng.standard_normal(16), algorithm="recursive_doubling")
    t = _traced(4, body)
    assert plot.diagram(t).axes[0].get_legend() is None  # every message is the whole vector
    fig = plot.diagram(t, color="block")
    assert {_rgb(a.get_edgecolor()) for a in _arrows(fig)} == {_rgb(plot._SEVERAL_COLOR)}
    assert [txt.get_text() for txt in fig.axes[0].get_legend().get_texts()] == [
        "several blocks: every message\ncarries more than one", "reduce"]


def test_block_colours_need_ranges_and_a_known_mode():
    events = sim.simulate("allreduce", "ring", 4, 64, events=True).events
    old = [{k: e[k] for k in tracing.EVENT_KEYS} for e in events]  # a trace saved before ranges existed
    assert plot.diagram(old).axes[0].get_legend() is None         # falls back to sender colours
    with pytest.raises(ck.InvalidArgument, match="needs the buffer ranges"):
        plot.diagram(old, color="block")
    with pytest.raises(ck.InvalidArgument, match="color must be"):
        plot.diagram(events, color="rainbow")
    with pytest.raises(ck.InvalidArgument, match="layout must be"):
        plot.diagram(events, layout="spiral")


def test_blocks_know_each_collectives_layout():
    p, count = 4, 3
    b = plot.Blocks([], None)
    assert b.of("allreduce", 0, 0, ("out", 0, 1)) is None  # no such call in the events
    events = sim.simulate("allgather", "ring", p, count=count, events=True).events
    b = plot.Blocks(events)
    assert b.of("allgather", 0, 2, ("in", 0, count)) == 2              # a rank's input is its own block
    assert b.of("allgather", 0, 0, ("out", count, 2 * count)) == 1
    assert b.of("allgather", 0, 0, ("out", 0, 2 * count)) == plot.SEVERAL
    assert b.of("allgather", 0, 0, ("out", 4, 4)) is None               # empty
    assert b.of("allgather", 0, 0, ("tmp", 0, 3)) is None               # scratch holds no fixed block
    # reduce_scatter: the input splits as partition(total, p), the output is the rank's own block.
    events = sim.simulate("reduce_scatter", "ring", p, count=(3, 3, 2, 2), events=True).events
    b = plot.Blocks(events)
    assert [b.of("reduce_scatter", 0, 0, ("in", lo, hi)) for lo, hi in ((0, 3), (3, 6), (6, 8), (8, 10))] == \
        [0, 1, 2, 3]
    assert b.of("reduce_scatter", 0, 3, ("out", 0, 2)) == 3
    # With fewer elements than ranks, ranges fall in the non-empty blocks; count= overrides the inference.
    events = sim.simulate("allreduce", "ring", 6, count=3, events=True).events
    assert plot.Blocks(events).of("allreduce", 0, 0, ("out", 2, 3)) == 2
    assert plot.Blocks(events, count=12).of("allreduce", 0, 0, ("out", 2, 3)) == 1


def test_timeline_colours_message_lines_by_block_on_request():
    def body(comm):
        comm.allreduce(rng.standard_normal(12), algorithm="ring")
    t = _traced(3, body)
    plain = plot.timeline(t)
    assert {_rgb(a.arrow_patch.get_edgecolor()) for a in plain.axes[0].texts if a.arrow_patch} == \
        {_rgb("#222222")}
    fig = plot.timeline(t, color="block")
    assert {_rgb(a.arrow_patch.get_edgecolor()) for a in fig.axes[0].texts if a.arrow_patch} == \
        {_rgb(c) for c in plot._colors(3)}
    assert {"block 0", "block 1", "block 2"} <= {txt.get_text() for txt in fig.axes[0].get_legend().get_texts()}


# -- the ring on a circle ----------------------------------------------------------------------------


@pytest.mark.parametrize("p", [4, 5])
def test_ring_diagram_puts_ranks_on_a_circle_and_every_arrow_between_neighbours(p):
    res = sim.simulate("allreduce", "ring", p, 64 * p, events=True)
    fig = plot.ring_diagram(res)
    panels = [ax for ax in fig.axes if ax.get_title()]
    assert [ax.get_title() for ax in panels] == [f"round {k}" for k in range(1, 2 * (p - 1) + 1)]
    where = [(np.sin(2 * np.pi * r / p), np.cos(2 * np.pi * r / p)) for r in range(p)]
    chord = np.hypot(where[1][0] - where[0][0], where[1][1] - where[0][1])
    for ax in panels:
        arrows = [a for a in ax.patches if type(a).__name__ == "FancyArrowPatch"]
        assert len(arrows) == p  # one message per rank per round
        ends = set()
        for a in arrows:
            (x0, y0), (x1, y1) = a._posA_posB
            # Neighbours only: the wrap-around p-1 -> 0 is as short as every other arrow.
            assert np.isclose(np.hypot(x1 - x0, y1 - y0), chord)
            src = min(range(p), key=lambda r: np.hypot(where[r][0] - x0, where[r][1] - y0))
            dst = min(range(p), key=lambda r: np.hypot(where[r][0] - x1, where[r][1] - y1))
            assert dst == (src + 1) % p
            ends.add(src)
        assert ends == set(range(p))
        labels = sorted(int(txt.get_text()) for txt in ax.texts if txt.get_text().isdigit()
                        and txt.get_bbox_patch() is not None)
        assert labels == list(range(p))  # each round moves every block once
    assert len(fig.legends) == 1 and "block 0" in [t.get_text() for t in fig.legends[0].get_texts()]
    same = plot.schedule_diagram("allreduce", "ring", p, 64 * p, layout="circle")
    assert len([ax for ax in same.axes if ax.get_title()]) == 2 * (p - 1)


def test_ring_diagram_leaves_out_empty_blocks_and_chooses_rounds():
    res = sim.simulate("allreduce", "ring", 4, count=2, events=True)  # half the blocks are empty
    fig = plot.ring_diagram(res)
    arrows = [a for ax in fig.axes for a in ax.patches if type(a).__name__ == "FancyArrowPatch"]
    assert len(arrows) == len([m for m in tracing.messages(res) if m.nbytes]) < len(tracing.messages(res))
    marks = [txt for ax in fig.axes for txt in ax.texts if txt.get_text() == "⊕"]
    assert len(marks) == len([e for e in res.events if e["kind"] == "reduce" and e["bytes"]])
    two = plot.ring_diagram(res, rounds_shown=[1, 6])
    assert [ax.get_title() for ax in two.axes if ax.get_title()] == ["round 1", "round 6"]
    with pytest.raises(ck.InvalidArgument, match="rounds_shown must be rounds 1 to 6"):
        plot.ring_diagram(res, rounds_shown=[7])
    big = sim.simulate("allreduce", "ring", 20, 4096, events=True)
    with pytest.raises(ck.InvalidArgument, match="38 rounds"):
        plot.ring_diagram(big)
    with pytest.raises(ck.InvalidArgument, match="takes no ax"):
        plot.diagram(res, layout="circle", ax=plot.diagram(res).axes[0])


# -- the model over measurements: labels say what the lines show -------------------------------------


def test_crossover_labels_match_their_lines_and_colours_can_be_fixed():
    sizes = [2 ** k for k in range(3, 23)]
    names = ["recursive_doubling", "ring"]
    rows = _model_rows("allreduce", 8, names, sizes, 1e-5, 1e-9, 1e-10)
    fig = plot.predicted_vs_measured(rows, 1e-5, 1e-9, 1e-10, colors={"ring": "#123456"})
    ax = fig.axes[0]
    (line,) = [ln for ln in ax.get_lines() if ln.get_gid() == "measured-crossover"]
    ((before, after, _, new),) = plot.measured_crossovers(rows)
    x = line.get_xdata()[0]
    assert before < x < after
    texts = [t.get_text() for t in ax.texts]
    assert f"measured: {new}\nbetween {plot._fmt_bytes(before)} and {plot._fmt_bytes(after)}" in texts
    assert not any(t.startswith("measured:") and "from" in t for t in texts)
    ring = [ln for ln in ax.get_lines() if ln.get_label() == "ring"]
    assert ring and _rgb(ring[0].get_color()) == _rgb("#123456")
    model_only = plot.predicted_vs_measured(collective="allreduce", nprocs=8, algorithms=names)
    title = model_only.axes[0].get_title()
    assert "no measurements" in title and "measured and" not in title


def test_buffer_states_by_round_line_ranks_up_even_when_their_steps_differ():
    # Binomial broadcast from root 2 on 8 ranks: leaves take one step, the root four; by round
    # the data reaches 2, 4, then 8 ranks (at the start only the root holds it: its input).
    fig = plot.buffer_states("broadcast", "binomial", 8, count=1, root=2)
    ax = fig.axes[0]
    grid = ax.images[0].get_array()
    assert [t.get_text() for t in ax.get_xticklabels()] == ["start", "round 1", "round 2", "round 3"]
    assert [int(np.nansum(grid[:, 2 * c])) for c in range(4)] == [1, 2, 4, 8]
    assert grid[2, 0] == 1
    # Ring allreduce by round: after round k of the reduce-scatter each rank has one block with
    # k + 1 contributions; after the allgather every block holds all p.
    p = 4
    grid = plot.buffer_states("allreduce", "ring", p).axes[0].images[0].get_array()
    for k in range(1, p):
        for r in range(p):
            block = grid[r, k * (p + 1): k * (p + 1) + p]
            assert max(block) == k + 1 and list(block).count(k + 1) == 1
    assert (grid[:, -p:] == p).all()
    steps = plot.buffer_states("allreduce", "ring", p, columns="step").axes[0]
    assert len(steps.get_xticklabels()) == 1 + 3 * (p - 1)  # exchange + reduce, then exchanges
    one = plot.buffer_states("allreduce", "ring", 1).axes[0]
    assert [t.get_text() for t in one.get_xticklabels()] == ["start", "end"]
    with pytest.raises(ck.InvalidArgument, match="columns must be"):
        plot.buffer_states("allreduce", "ring", p, columns="time")


def test_an_algorithm_keeps_its_colour_across_figures():
    def colour_of(fig, name):
        (line,) = [ln for ln in fig.axes[0].get_lines() if ln.get_label() == f"{name} (model)"]
        return _rgb(line.get_color())

    two = plot.predicted_vs_measured(collective="allreduce", nprocs=8, algorithms=["ring", "naive"])
    three = plot.predicted_vs_measured(collective="allreduce", nprocs=8,
                                       algorithms=["recursive_doubling", "rabenseifner", "ring"])
    assert colour_of(two, "ring") == colour_of(three, "ring")
    assert colour_of(two, "naive") != colour_of(two, "ring")


@pytest.mark.parametrize("p", [3, 4, 5])
def test_buffer_states_count_each_ranks_own_input_from_the_start(p):
    # Ring allreduce: every rank holds its own contribution to every element before any message,
    # so no square is ever empty, and rank r's own block (r) holds its input until the allgather
    # brings the finished sum (it used to show 0 there until the last round).
    grid = plot.buffer_states("allreduce", "ring", p).axes[0].images[0].get_array()
    columns = [grid[:, c * (p + 1): c * (p + 1) + p] for c in range((grid.shape[1] + 1) // (p + 1))]
    assert (columns[0] == 1).all()  # start: each rank's input
    for r in range(p):
        assert all(col[r, r] >= 1 for col in columns)
    assert not any((col == 0).all() for col in columns)
    # Allgather: a rank starts with its own block only; 0/1 squares use the whole colour scale.
    fig = plot.buffer_states("allgather", "ring", p, count=1)
    image = fig.axes[0].images[0]
    start = image.get_array()[:, :p]
    assert (start == np.eye(p)).all()
    assert image.get_clim() == (0, 1)
    assert fig.axes[1].get_yticks().tolist() == [0, 1]  # the colour bar counts whole ranks


def test_buffer_states_colour_by_origin_says_whose_data_a_square_holds():
    p = 4
    ax = plot.buffer_states("allgather", "ring", p, count=1, color="origin").axes[0]
    grid = np.ma.filled(ax.images[0].get_array(), np.nan)  # NaN: holds nothing
    start, end = grid[:, :p], grid[:, -p:]
    assert all(start[r, r] == r for r in range(p)) and np.isnan(start[~np.eye(p, dtype=bool)]).all()
    assert (end == np.arange(p)).all()  # every rank holds block b from rank b
    assert {t.get_text() for t in ax.get_legend().get_texts()} == {f"rank {r}'s data" for r in range(p)}
    # Ring allreduce: partial sums are "several" (value p, labelled Σk), the finished ones Σp.
    ax = plot.buffer_states("allreduce", "ring", p, color="origin").axes[0]
    grid = np.ma.filled(ax.images[0].get_array(), np.nan)
    assert (grid[:, :p] == np.arange(p)[:, None]).all() and (grid[:, -p:] == p).all()
    texts = [t.get_text() for t in ax.texts]
    assert "Σ2" in texts and "Σ4" in texts
    assert "several ranks' (Σk: k of them)" in [t.get_text() for t in ax.get_legend().get_texts()]
    with pytest.raises(ck.InvalidArgument, match="color must be 'count' or 'origin'"):
        plot.buffer_states("allreduce", "ring", p, color="block")


def test_buffer_states_show_nothing_where_the_schedule_never_writes_the_output():
    # Naive reduce: non-roots never write their output (uninitialised scratch): it holds nothing, whatever
    # bits the buffer happens to contain; the binomial tree's non-roots do write theirs (partial sums).
    grid = np.ma.filled(plot.buffer_states("reduce", "naive", 4, root=1).axes[0].images[0].get_array(), np.nan)
    others = grid[[0, 2, 3]]
    assert (others[~np.isnan(others)] == 0).all() and grid[1, 0] == 1 and grid[1, -1] == 4
    grid = np.ma.filled(plot.buffer_states("reduce", "binomial", 4, root=1).axes[0].images[0].get_array(), np.nan)
    assert (grid[:, :4] == 1).all()

    # An allgather that forgets to copy its own block into out passes zeros round: its input never
    # reaches its output, and the picture must not pretend that it does.
    def allgather_forgets_own_block(rank, size, count):
        right, left = (rank + 1) % size, (rank - 1) % size
        for step in range(size - 1):
            send, recv = (rank - step) % size, (rank - step - 1) % size
            yield Exchange(right, ("out", send * count, (send + 1) * count), left,
                           ("out", recv * count, (recv + 1) * count))

    algorithms.algorithm("allgather", "forgets_own_block")(allgather_forgets_own_block)
    try:
        grid = plot.buffer_states("allgather", "forgets_own_block", 4, count=1).axes[0].images[0].get_array()
    finally:
        algorithms.unregister("allgather", "forgets_own_block")
    assert np.nansum(grid) == 0


def test_block_colours_where_no_message_holds_one_block_say_so():
    # Recursive doubling swaps whole vectors: every arrow is grey, so the legend must not promise
    # that a reduction's colour is its block.
    for layout in ("rows", "circle"):
        fig = plot.schedule_diagram("allreduce", "recursive_doubling", 4, 64, color="block", layout=layout)
        legend = fig.axes[0].get_legend() if layout == "rows" else fig.legends[0]
        texts = [t.get_text() for t in legend.get_texts()]
        assert texts == ["several blocks: every message\ncarries more than one", "reduce"], texts
        fig = plot.schedule_diagram("allreduce", "ring", 4, 64, color="block", layout=layout)
        legend = fig.axes[0].get_legend() if layout == "rows" else fig.legends[0]
        assert "reduce (colour: its block)" in [t.get_text() for t in legend.get_texts()]
