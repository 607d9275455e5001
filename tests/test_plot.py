"""Pictures: diagrams and timelines from real traces and from the simulator, and the model over bench rows."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections import Counter

import numpy as np
import pytest

import commkit as ck
from commkit import cost, plot, sim, tracing
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
        held = [[bin(int(v)).count("1") for v in bits] for _, _, bits in seq]
        assert held[0] == [0] * p and held[-1] == [p] * p  # nothing at the start, everything at the end
        # After the reduce-scatter phase (p-1 exchanges, each followed by a reduce) this rank owns
        # exactly one finished block, the one ring allreduce gives it: (rank + 1) % p.
        after_phase_one = held[2 * (p - 1)]
        assert after_phase_one.count(p) == (1 if p > 1 else p)
        if p > 1:
            assert after_phase_one[(rank + 1) % p] == p
        # Contributions only ever grow.
        for before, after in zip(held, held[1:]):
            assert all(a >= b for a, b in zip(after, before))
    fig = plot.buffer_states("allreduce", "ring", p)
    grid = fig.axes[0].images[0].get_array()
    assert grid.shape[0] == p and np.nanmax(grid) == p
    with pytest.raises(ck.InvalidArgument, match="buffer_states shows"):
        tracing.buffer_states("alltoall", "pairwise", p)
