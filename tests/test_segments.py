"""Segment size as a schedule parameter (issue 14): per call, in the environment, in the selection table."""

from __future__ import annotations

import json

import numpy as np
import pytest

import commkit as ck
from commkit import selection, tracing
from commkit.errors import AlgorithmNotApplicable, CollectiveMismatch, InvalidArgument


def _exchanges(events, rank, seq):
    """Messages steps of one call on one rank (a threads world's tracers share one list of every rank's events)."""
    return sum(1 for e in events if e["rank"] == rank and e["seq"] == seq
               and e["kind"] in ("exchange", "send", "recv", "transfer"))


@pytest.mark.parametrize("text, expected", [
    ("ring_pipelined", ("ring_pipelined", None)),
    ("ring_pipelined:16", ("ring_pipelined", 16)),
    ("ring_pipelined:64K", ("ring_pipelined", 65536)),
    ("ring_pipelined:1MiB", ("ring_pipelined", 1 << 20)),
])
def test_split_algorithm(text, expected):
    assert selection.split_algorithm(text, "allreduce") == expected


@pytest.mark.parametrize("text", ["ring_pipelined:", "ring_pipelined:0", "ring_pipelined:lots", "ring_pipelined:1.5"])
def test_bad_segment_sizes_are_refused_with_the_reason(text):
    with pytest.raises(AlgorithmNotApplicable, match="segment size"):
        selection.select("allreduce", 4, 1024, "sum", text)


def test_a_segment_for_an_algorithm_without_segments_is_refused():
    with pytest.raises(AlgorithmNotApplicable, match=r"'ring' takes no segment size.*segmented allreduce"):
        selection.select("allreduce", 4, 1024, "sum", "ring:4K")


def _run(c, algorithm, count=64):
    """The result and the number of message steps of one traced allreduce on this rank."""
    x = (np.arange(count, dtype=np.float32) + c.rank).astype(np.float32)
    seq = c.flight_recorder.calls[-1][0] + 1 if c.flight_recorder.calls else 0
    with tracing.trace(c) as t:
        got = c.allreduce(x, algorithm=algorithm)
        chosen = c.last_algorithm, c.last_choice
    c.barrier()  # every rank's events are in before anyone counts
    return got, _exchanges(t.events, c.rank, seq), chosen


@pytest.mark.parametrize("size", [2, 3, 4])
def test_per_call_segment_cuts_messages_and_keeps_the_answer(size):
    def body(c):
        small, n_small, _ = _run(c, "ring_pipelined:16")   # 4 float32 elements per segment
        default, n_default, _ = _run(c, "ring_pipelined")  # 65536-element default: one segment per block
        return small, default, n_small, n_default

    expected = sum(np.arange(64, dtype=np.float32) + r for r in range(size))
    for small, default, n_small, n_default in ck.run_local(body, size):
        np.testing.assert_array_equal(small, expected)
        np.testing.assert_array_equal(default, expected)
        blocks = -(-64 // size)
        k = min(-(-blocks // 4), 64 // size)
        assert n_default == 2 * (size - 1)
        assert n_small == 2 * (size - 1) * k


def test_segment_from_the_environment_override(monkeypatch):
    monkeypatch.setenv("COMMKIT_ALLREDUCE_ALGORITHM", "ring_pipelined:32")

    def body(c):
        _, n, (name, choice) = _run(c, None)
        return name, choice.segment, choice.reason, n

    for name, segment, reason, n in ck.run_local(body, 4):
        assert (name, segment) == ("ring_pipelined", 32)
        assert "COMMKIT_ALLREDUCE_ALGORITHM" in reason and "segment 32 B" in reason
        assert n == 2 * 3 * 2  # 16-element blocks in segments of 8 elements


def test_segment_from_a_tuning_rule(tmp_path, monkeypatch):
    table = {"allreduce": [{"algorithm": "ring_pipelined", "segment_bytes": 16, "commutative": True,
                            "reason": "test: small segments"}]}
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps(table))
    monkeypatch.setenv("COMMKIT_TUNING", str(path))
    choice = selection.select("allreduce", 4, 256, "sum")
    assert choice.algorithm.name == "ring_pipelined" and choice.segment == 16
    assert "test: small segments (segment 16 B)" in choice.reason

    def body(c):
        return _run(c, None)[:2]

    for got, n in ck.run_local(body, 4):
        np.testing.assert_array_equal(got, sum(np.arange(64, dtype=np.float32) + r for r in range(4)))
        assert n == 2 * 3 * 4


def test_tuning_rules_check_segment_bytes():
    ok = {"allreduce": [{"algorithm": "ring_pipelined", "segment_bytes": 4096}]}
    selection.validate_table(ok, "t.json")
    with pytest.raises(InvalidArgument, match="takes no segment size"):
        selection.validate_table({"allreduce": [{"algorithm": "ring", "segment_bytes": 4096}]}, "t.json")
    with pytest.raises(InvalidArgument, match="segment_bytes must be a positive integer"):
        selection.validate_table({"allreduce": [{"algorithm": "ring_pipelined", "segment_bytes": 0}]}, "t.json")


def test_ranks_that_disagree_about_the_segment_are_caught_in_check_mode():
    def body(c):
        x = np.arange(64, dtype=np.float32)
        with pytest.raises(CollectiveMismatch, match="segment"):
            c.allreduce(x, algorithm="ring_pipelined:16" if c.rank == 0 else "ring_pipelined:32")
        return True

    assert ck.run_local(body, 3, check=True, timeout=30) == [True] * 3


def test_the_segment_is_part_of_the_calls_identity():
    # Ranks cutting messages differently must not match each other's messages: different tags.
    def body(c):
        x = np.arange(64, dtype=np.float32)
        c.allreduce(x, algorithm="ring_pipelined:16")
        c.allreduce(x, algorithm="ring_pipelined:32")
        bases = {key[-1]: plan[5] for key, plan in c._plans.items()}
        return bases

    bases = ck.run_local(body, 2)[0]
    assert bases["ring_pipelined:16"] != bases["ring_pipelined:32"]


@pytest.mark.parametrize("collective, name", [
    ("broadcast", "chain_pipelined"), ("broadcast", "binary_tree_segmented"),
    ("reduce_scatter", "ring_pipelined"), ("allreduce", "ring_pipelined"),
])
def test_every_segmented_algorithm_takes_the_segment_per_call(collective, name):
    from commkit import algorithms, collectives
    from commkit.ops import get_op
    from commkit.schedule import TRANSFER

    alg = algorithms.get(collective, name)
    assert alg.segmented
    count = 96 if collective != "reduce_scatter" else (32, 32, 32)
    op = get_op("sum") if collective != "broadcast" else None

    def transfers(segment):
        return sum(1 for r in range(3)
                   for step in collectives.steps(alg.schedule, collective, r, 3, count, op, 0, segment)
                   if step.kind == TRANSFER)

    assert transfers(2) > transfers(16) > 0
    assert transfers(None) == transfers(1 << 16)  # the default: COMMKIT_SEGMENT_ELEMENTS or 65536

    def body(c):
        x = np.arange(96, dtype=np.float64) + c.rank
        if collective == "broadcast":
            return c.broadcast(x, root=1, algorithm=f"{name}:16")  # 2 float64 elements per segment
        if collective == "reduce_scatter":
            return c.reduce_scatter(x, algorithm=f"{name}:16")
        return c.allreduce(x, algorithm=f"{name}:16")

    total = sum(np.arange(96, dtype=np.float64) + r for r in range(3))
    for rank, got in enumerate(ck.run_local(body, 3)):
        want = {"broadcast": np.arange(96, dtype=np.float64) + 1, "allreduce": total,
                "reduce_scatter": total[32 * rank:32 * (rank + 1)]}[collective]
        np.testing.assert_array_equal(got, want)
