"""``commkit tune`` measures segment sizes: the ladder, the choice, the rules it writes, the CLI option.

Measurements run in a threads world of 2 ranks with few repetitions: they check
what is measured and written, never which size is fastest (a loaded machine
decides that). Where a test runs :func:`commkit.tune.run` whole, alpha, beta
and gamma are fixed so that the model's regimes (and so which rules are
segmented) do not depend on the machine's noise.
"""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

import commkit as ck
from commkit import algorithms, bench, cli, selection, tune
from commkit.algorithms.pipelined import ENV_SEGMENT, SEGMENT
from commkit.errors import InvalidArgument

ALPHA, BETA, GAMMA = 5e-6, 2e-10, 1e-10
DEFAULT = SEGMENT * 4  # the default segment of float32 calls, in bytes (256 KiB)
KIB = {64 << 10: "64 KiB", 128 << 10: "128 KiB", DEFAULT: "256 KiB"}  # as tune prints them


@pytest.fixture(autouse=True)
def _default_segment(monkeypatch):
    monkeypatch.delenv(ENV_SEGMENT, raising=False)
    monkeypatch.delenv("COMMKIT_TUNING", raising=False)
    monkeypatch.delenv("COMMKIT_ALLREDUCE_ALGORITHM", raising=False)


# -- the ladder -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value, expected", [
    ("16K,64K,256K", [16 << 10, 64 << 10, 256 << 10]),
    (" 1M , 4096,4K ", [4096, 1 << 20]),
    ([65536, "16KiB"], [16 << 10, 64 << 10]),
    ((1,), [1]),
])
def test_parse_segments(value, expected):
    assert tune.parse_segments(value) == expected


@pytest.mark.parametrize("value, message", [
    ("", "expected segment sizes in bytes such as '16K,64K,256K'.*got '' \\(no size\\)"),
    ([], "got \\[\\] \\(no size\\)"),
    ("16K,,64K", "segments '16K,,64K': an empty entry between commas"),
    ("16K,lots", "segments '16K,lots': invalid size 'lots': expected a number of bytes with an optional unit"),
    ("-4K", "invalid size '-4K': expected a number of bytes"),
    ("1.5", "invalid size '1.5': not a whole number of bytes"),
    ("64K,0", "segments '64K,0': a segment size must be at least 1 byte, got '0'"),
    ([4096, 2.5], "each size must be an int or a string such as '64K', got float 2.5"),
    ([True], "got bool True"),
    (65536, "expected segment sizes in bytes.*got int 65536"),
])
def test_parse_segments_names_what_came_and_what_was_expected(value, message):
    with pytest.raises(InvalidArgument, match=message):
        tune.parse_segments(value)


def test_candidates_are_the_ladder_below_the_message_and_the_default():
    ladder = tune.SEGMENT_LADDER
    assert ladder == (16 << 10, 64 << 10, 256 << 10, 1 << 20)
    assert tune.segment_candidates(100 << 10, ladder, DEFAULT) == [16 << 10, 64 << 10, DEFAULT]
    assert tune.segment_candidates(4 << 20, ladder, DEFAULT) == sorted({*ladder, DEFAULT})
    assert tune.segment_candidates(16 << 10, ladder, DEFAULT) == [DEFAULT]  # none is smaller than the message


# -- choosing a segment size --------------------------------------------------------------------------------


def _fake_measure(times_us, spread=0.01):
    """A stand-in for bench.measure: the given median (us) for each candidate, by its segment size."""
    calls = []

    def measure(comm, collective, size, names, **kw):
        calls.append((collective, size, list(names), kw))
        return [bench.Row(collective=collective, size=size, count=size // 4, dtype="float32", op="sum",
                          algorithm=name, nprocs=2, time_us=times_us[int(name.split(":")[1])], min_us=0.0,
                          spread=spread, algbw=0.0, busbw=0.0, vs_native=None, wrong=0, runs=kw["iters"])
                for name in names]
    return measure, calls


def test_the_fastest_segment_is_chosen_and_the_reason_lists_every_time(monkeypatch):
    measure, calls = _fake_measure({16 << 10: 900.0, 64 << 10: 500.0, DEFAULT: 700.0})
    monkeypatch.setattr(tune.bench, "measure", measure)
    segment, text, record = tune.measure_segments(None, "allreduce", "ring_pipelined", 1 << 20, "16K,64K", iters=3)
    assert calls == [("allreduce", 1 << 20, ["ring_pipelined:16384", "ring_pipelined:65536",
                                             f"ring_pipelined:{DEFAULT}"],
                      {"dtype": "float32", "op": "sum", "iters": 3, "warmup": 1})]
    assert segment == 64 << 10
    assert text.startswith("segment 64 KiB measured fastest at 1 MiB (16 KiB 900.0 us, 64 KiB 500.0 us, "
                           "256 KiB (default) 700.0 us")
    assert record["chosen"] == 64 << 10 and record["default"] == DEFAULT
    assert [x["segment_bytes"] for x in record["probes"]] == [16 << 10, 64 << 10, DEFAULT]


def test_a_win_within_the_spread_of_identical_runs_keeps_the_default(monkeypatch):
    measure, _ = _fake_measure({16 << 10: 690.0, DEFAULT: 700.0}, spread=0.05)
    monkeypatch.setattr(tune.bench, "measure", measure)
    segment, text, _ = tune.measure_segments(None, "broadcast", "chain_pipelined", 1 << 20, [16 << 10], iters=3)
    assert segment == DEFAULT
    assert "16 KiB was fastest by less than the spread of identical runs, so the default 256 KiB stays" in text


def test_the_default_candidate_follows_commkit_segment_elements(monkeypatch):
    monkeypatch.setenv(ENV_SEGMENT, "1024")  # 4 KiB of float32, 8 KiB of float64
    measure, calls = _fake_measure({2048: 10.0, 8192: 20.0})
    monkeypatch.setattr(tune.bench, "measure", measure)
    segment, text, record = tune.measure_segments(None, "allreduce", "ring_pipelined", 1 << 20, "2K", dtype="float64")
    assert calls[0][2] == ["ring_pipelined:2048", "ring_pipelined:8192"] and record["default"] == 8192
    assert segment == 2048 and "8 KiB (default) 20.0 us" in text


def test_no_smaller_ladder_size_means_nothing_to_measure(monkeypatch):
    measure, calls = _fake_measure({})
    monkeypatch.setattr(tune.bench, "measure", measure)
    segment, text, record = tune.measure_segments(None, "allreduce", "ring_pipelined", 8 << 10, "16K,64K")
    assert (segment, record, calls) == (None, None, [])
    assert "no size of the ladder (16 KiB, 64 KiB) is smaller than the 8 KiB message" in text


@pytest.mark.parametrize("name, message", [
    ("ring", "'ring' takes no segment size. Segmented allreduce algorithms: \\[.*'ring_pipelined'"),
    ("rign", "'rign' is not one"),
])
def test_only_segmented_algorithms_are_measured(name, message):
    with pytest.raises(InvalidArgument, match=message):
        tune.measure_segments(None, "allreduce", name, 1 << 20)


def test_measure_segments_in_a_threads_world():
    def body(c):
        return tune.measure_segments(c, "allreduce", "ring_pipelined", 4096, [256, 1024], iters=2)

    results = ck.run_local(body, 2, timeout=60)
    assert results[0] == results[1]  # every rank makes the same choice
    segment, text, record = results[0]
    assert segment in (256, 1024, DEFAULT) and record["chosen"] == segment
    assert [x["segment_bytes"] for x in record["probes"]] == [256, 1024, DEFAULT]
    assert all(x["time_us"] > 0 for x in record["probes"]) and "at 4 KiB" in text


# -- the table ------------------------------------------------------------------------------------------------


def _write(tmp_path, table):
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps(table))
    return str(path)


def test_segmented_rules_carry_the_measured_segment_and_others_none(tmp_path, monkeypatch):
    calls = []

    def measure_segment(collective, algorithm, lo, hi):
        calls.append((collective, algorithm, lo, hi))
        if hi == 0:
            return None, "segment size not measured: 0 B", None
        return 16 << 10, "segment 16 KiB measured fastest", {"collective": collective, "chosen": 16 << 10}

    chosen = ["allreduce", "allgather"]  # (the model's broadcast crossovers take seconds to find)
    table = tune.build_table(ALPHA, BETA, GAMMA, (4, 16), chosen, measured_p=4, measure_segment=measure_segment)
    measured = []
    for collective in chosen:
        for rule in table[collective]:
            segmented = algorithms.get(collective, rule["algorithm"]).segmented
            if not segmented:
                assert "segment_bytes" not in rule and "segment size not measured" not in rule["reason"], rule
            elif rule["min_procs"] != 4:
                assert "segment_bytes" not in rule and "segment size not measured at p=16" in rule["reason"]
            elif rule.get("max_bytes") == 0:
                assert "segment_bytes" not in rule and "segment size not measured: 0 B" in rule["reason"]
            else:
                assert rule["segment_bytes"] == 16 << 10 and "segment 16 KiB measured fastest" in rule["reason"]
                assert (collective, rule["algorithm"], rule.get("min_bytes", 0), rule.get("max_bytes")) in calls
                measured.append((collective, rule["algorithm"]))
    # ring_pipelined is the model's choice for the largest messages at p = 4: at least that one was measured.
    assert ("allreduce", "ring_pipelined") in measured
    assert len(table["measured"]["segments"]) == len(measured) == len([c for c in calls if c[3] != 0])
    assert "(segment 16 KiB)" in tune.summary(table)

    path = _write(tmp_path, table)
    assert selection.load_table(path) == table
    monkeypatch.setenv("COMMKIT_TUNING", path)
    top = next(r for r in table["allreduce"] if r["min_procs"] == 4 and "segment_bytes" in r)
    choice = selection.select("allreduce", 4, top["min_bytes"] + 1, "sum")
    assert (choice.algorithm.name, choice.segment) == ("ring_pipelined", 16 << 10)
    assert "measured fastest" in choice.reason and choice.reason.endswith("(segment 16384 B)")
    # Another process count: the algorithm's default segment.
    assert selection.select("allreduce", 16, 1 << 30, "sum").segment is None


def test_without_a_measurement_segmented_rules_say_the_default_applies():
    table = tune.build_table(ALPHA, BETA, GAMMA, (16,), ["allreduce"], measured_p=16)
    rules = [r for r in table["allreduce"] if r["algorithm"] == "ring_pipelined"]
    assert rules and all("segment_bytes" not in r for r in rules)
    assert all("segment size not measured: the algorithm's default applies" in r["reason"] for r in rules)


def _fixed_constants(monkeypatch):
    """Make tune.run's alpha, beta, gamma those above, so the model's regimes are known."""
    def measure_alpha_beta(comm, sizes, reps=5):
        return [(n, ALPHA + BETA * n) for n in sizes]

    def measure_gamma(dtype, op, sizes, reps=5):
        return GAMMA, [(n, GAMMA * n) for n in sizes]

    monkeypatch.setattr(tune, "measure_alpha_beta", measure_alpha_beta)
    monkeypatch.setattr(tune, "measure_gamma", measure_gamma)


def test_rules_beyond_max_bytes_keep_the_default_segment(monkeypatch):
    # At p = 2 the model's ring_pipelined regime starts at 512 KiB, beyond --max-bytes 256K: nothing runs there.
    _fixed_constants(monkeypatch)

    def body(c):
        return tune.run(c, collectives=["allreduce"], max_bytes=256 << 10, quick=True, segments=[4096])

    table = ck.run_local(body, 2, timeout=60)[0]
    [top] = [r for r in table["allreduce"] if r["algorithm"] == "ring_pipelined" and "max_bytes" not in r]
    assert "segment_bytes" not in top and table["measured"]["segments"] == []
    # (524292 B: the first whole float32 element above 512 KiB, where the model's winner changes.)
    assert ("segment size not measured: the rule's sizes, from 524292 B, are beyond --max-bytes (256 KiB), so the "
            "algorithm's default applies") in top["reason"]


def test_run_refuses_a_bad_ladder_before_measuring():
    with pytest.raises(InvalidArgument, match="segments '8K,x': invalid size 'x'"):
        tune.run(None, segments="8K,x")


# -- the command line ------------------------------------------------------------------------------------------


def test_cli_tune_measures_segments_and_calls_use_them(tmp_path, monkeypatch, capsys):
    # `commkit tune --segments` run in-process by both ranks of a threads world (no MPI needed). At p = 2
    # the model's last allreduce regime is ring_pipelined, from 512 KiB; wherever the confirming benchmark
    # moves it, it starts below --max-bytes 2M, so its segment is measured (64K, 128K and the default).
    _fixed_constants(monkeypatch)
    comms = {}
    monkeypatch.setattr(cli, "_init", lambda gpu: comms[threading.get_ident()])
    path = str(tmp_path / "tuned.json")

    def body(c):
        comms[threading.get_ident()] = c
        return cli.main(["tune", "--quick", "-c", "allreduce", "--max-bytes", "2M", "--segments", "128K,64K",
                         "--no-node", "-O", path])

    assert ck.run_local(body, 2, timeout=120) == [0, 0]
    out, err = capsys.readouterr()
    table = selection.load_table(path)  # the normal loader, segment_bytes validated
    assert table["measured"]["segment_ladder"] == [64 << 10, 128 << 10]
    [rule] = [r for r in table["allreduce"] if "segment_bytes" in r]
    assert rule["algorithm"] == "ring_pipelined" and "max_bytes" not in rule
    assert rule["segment_bytes"] in (64 << 10, 128 << 10, DEFAULT)
    assert "measured fastest at" in rule["reason"] or f"so the default {KIB[DEFAULT]} stays" in rule["reason"]
    [record] = table["measured"]["segments"]
    assert record["chosen"] == rule["segment_bytes"]
    assert [x["segment_bytes"] for x in record["probes"]] == [64 << 10, 128 << 10, DEFAULT]
    # At 0 B every algorithm that sends nothing costs 0, but no float32 call of data is that small: the
    # empty call belongs to the rule for one element (recursive doubling), and no rule is narrower.
    first = [r for r in table["allreduce"] if r.get("commutative")][0]
    assert "min_bytes" not in first and first["algorithm"] == "recursive_doubling", first
    assert all(r.get("max_bytes") is None or r["max_bytes"] + 1 - r.get("min_bytes", 0) >= 4
               for r in table["allreduce"])
    # Progress on stderr and the summary on stdout show the segment chosen.
    assert "measuring segment sizes for allreduce ring_pipelined at " in err
    assert f"allreduce ring_pipelined: segment {KIB[rule['segment_bytes']]} (64 KiB " in err
    assert f"ring_pipelined (segment {KIB[rule['segment_bytes']]})" in out

    monkeypatch.setenv("COMMKIT_TUNING", path)
    count = (rule["min_bytes"] + 4) // 4

    def call(c):
        got = c.allreduce(np.ones(count, np.float32))
        return float(got[0]), c.last_algorithm, c.last_choice.segment, c.last_choice.reason

    for value, name, segment, reason in ck.run_local(call, 2, timeout=60):
        assert (value, name, segment) == (2.0, "ring_pipelined", rule["segment_bytes"])
        assert reason.startswith(path) and f"(segment {rule['segment_bytes']} B)" in reason


@pytest.mark.parametrize("value, message", [
    ("16K,lots", "segments '16K,lots': invalid size 'lots'"),
    ("0", "a segment size must be at least 1 byte, got '0'"),
    ("", "got '' (no size)"),
])
def test_cli_bad_segments_are_one_line(tmp_path, capsys, value, message):
    assert cli.main(["tune", "--segments", value, "-O", str(tmp_path / "t.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("commkit tune: error: ") and message in err and "Traceback" not in err


def test_tables_for_a_dtype_have_no_rule_narrower_than_one_element():
    # The model alone gave allreduce at p=2 a rule for 0 B, and a confirmation that moved its boundary
    # to the first benchmarked size widened it to "0 B-15 B: double_binary_tree", which the ranks obeyed
    # at 4 B where recursive doubling is faster.
    def confirm(collective, low, high, boundary, lower, upper):
        return max(boundary, 16) + 3, "bench moved it", []

    table = tune.build_table(ALPHA, BETA, GAMMA, (2, 4), ["allreduce"], measured_p=2, confirm=confirm, itemsize=4)
    for rule in table["allreduce"]:
        lo, hi = rule.get("min_bytes", 0), rule.get("max_bytes")
        assert lo % 4 == 0 and (hi is None or ((hi + 1) % 4 == 0 and hi + 1 - lo >= 4)), rule
    first = [r for r in table["allreduce"] if r["min_procs"] == 2 and r.get("commutative")][0]
    assert first["algorithm"] == "recursive_doubling" and first["max_bytes"] + 1 >= 20, first
