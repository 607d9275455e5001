"""``commkit tune``'s node pass: shm timed against the table's choice, one_node rules where it wins.

The threads-world runs test the mechanism, not the machine: the per-rank timing
(``tune._node_samples``) is replaced by one that makes shm win at chosen sizes,
and alpha, beta, gamma are fixed, so the rules that come out are known. One
short mpiexec run checks that the command writes a table the selector loads.
"""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

import commkit as ck
from commkit import cli, selection, tune
from commkit.transports._arena import ENV_RANKS_PER_NODE

from test_cli import run_commkit
from test_tune_segments import GAMMA, _fixed_constants  # the model's constants, fixed

K, M = 1 << 10, 1 << 20
QUICK_LADDER = [64 * K, 256 * K, 1 * M, 2 * M]  # node_ladder(2M, quick=True)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ("COMMKIT_TUNING", ENV_RANKS_PER_NODE, "COMMKIT_ALLREDUCE_ALGORITHM", "COMMKIT_ALLTOALL_ALGORITHM",
                 "COMMKIT_GATHER_ALGORITHM", "COMMKIT_BARRIER_ALGORITHM"):
        monkeypatch.delenv(name, raising=False)


def _fake_samples(monkeypatch, wins, *, wrong_at=(), per_rank=None):
    """Replace the per-rank timing: shm takes 1 s where ``wins[collective]`` holds the size, else 3 s; the other 2 s.

    ``per_rank[rank]``, where given, replaces ``wins`` on that rank. Returns the calls made,
    as ``(rank, collective, bytes, other)``.
    """
    calls = []
    lock = threading.Lock()

    def samples(case, other, reps):
        rank = case.comm.rank
        with lock:
            calls.append((rank, case.collective, case.size, other))
        table = (per_rank or {}).get(rank, wins)
        shm = 1.0 if case.size in table.get(case.collective, ()) else 3.0
        times = np.array([[shm] * reps, [2.0] * reps])
        return times, int((case.collective, case.size) in wrong_at)

    monkeypatch.setattr(tune, "_node_samples", samples)
    return calls


def _tune(collectives, max_bytes=2 * M, **kw):
    def body(c):
        return tune.run(c, collectives=collectives, max_bytes=max_bytes, quick=True, **kw)

    return ck.run_local(body, 2, timeout=120)


def _node_rules(table, collective):
    return [r for r in table[collective] if r.get("one_node")]


def _write(tmp_path, table):
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps(table))
    return str(path)


# -- the ladder ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_bytes, quick, expected", [
    (2 * M, True, QUICK_LADDER),
    (1 * M, False, [64 * K, 128 * K, 256 * K, 512 * K, 1 * M]),
    (100 * K, False, [64 * K, 100 * K]),
    (64 * K, False, [64 * K]),
    (16 * K, True, [16 * K]),
])
def test_node_ladder(max_bytes, quick, expected):
    assert tune.node_ladder(max_bytes, quick) == expected


# -- the rules -------------------------------------------------------------------------------------------------


def test_one_rule_per_winning_range_before_the_models_rules(tmp_path, monkeypatch):
    _fixed_constants(monkeypatch)
    wins = {"allreduce": {256 * K, 1 * M}, "alltoall": {64 * K, 2 * M}}
    calls = _fake_samples(monkeypatch, wins)
    tables = _tune(["allreduce", "alltoall", "gather"])
    table = tables[0]
    assert tables[1] == table

    [allreduce] = _node_rules(table, "allreduce")
    assert allreduce == {
        "min_procs": 2, "max_procs": 2, "one_node": True, "transport": "local", "min_bytes": 256 * K,
        "max_bytes": 1 * M, "algorithm": "shm", "reason": allreduce["reason"]}
    first, last = _node_rules(table, "alltoall")
    assert (first["min_bytes"], first["max_bytes"]) == (64 * K, 64 * K)
    assert last["min_bytes"] == 2 * M and "max_bytes" not in last
    assert _node_rules(table, "gather") == []
    for collective in ("allreduce", "alltoall"):
        rules = table[collective]
        node = _node_rules(table, collective)
        assert rules[:len(node)] == node and len(rules) > len(node)  # first, and the model's rules follow
    # The reasons give the times measured in the range and at the sizes bounding it.
    other = {size: name for rank, c, size, name in calls if c == "allreduce" and rank == 0}
    assert allreduce["reason"].startswith(
        f"measured: shm 1000000.0 us against {other[256 * K]} 2000000.0 us at 256 KiB, shm 1000000.0 us against "
        f"{other[1 * M]} 2000000.0 us at 1 MiB; shm not faster by more than the spread of runs at 64 KiB (shm "
        f"3000000.0 us against {other[64 * K]} 2000000.0 us)")
    assert "(commkit tune, measured on 2 ranks of one node, local transport, 5 reps" in allreduce["reason"]
    assert "faster at the largest size measured, so the rule is left open above 2 MiB" in last["reason"]

    # Every probe is recorded: each collective with shm, at every size of the ladder, on every rank.
    node = table["measured"]["node"]
    assert [(x["collective"], x["bytes"]) for x in node] == [
        (c, n) for c in ("allreduce", "alltoall", "gather") for n in QUICK_LADDER]
    assert all(x["shm_faster"] == (x["bytes"] in wins.get(x["collective"], ())) for x in node)
    assert sorted(calls) == sorted((r, x["collective"], x["bytes"], x["other"]) for r in (0, 1) for x in node)
    assert "(one node, local)" in tune.summary(table)

    path = _write(tmp_path, table)
    assert selection.load_table(path) == selection.validate_table(table, "test")
    monkeypatch.setenv("COMMKIT_TUNING", path)

    def chosen(collective, nbytes, **kw):
        return selection.select(collective, 2, nbytes, "sum" if collective == "allreduce" else None, **kw)

    for nbytes in (256 * K, 600 * K, 1 * M):
        choice = chosen("allreduce", nbytes, nodes=1, transport="local")
        assert choice.algorithm.name == "shm" and choice.reason.startswith(f"{path}: measured: shm"), nbytes
    for nbytes in (64 * K, 256 * K - 1, 1 * M + 1, 2 * M, 64 * M):
        assert chosen("allreduce", nbytes, nodes=1, transport="local").algorithm.name != "shm", nbytes
    for kw in ({"nodes": 2, "transport": "local"}, {"nodes": 1, "transport": "mpi"}, {"transport": "local"}):
        assert chosen("allreduce", 512 * K, **kw).algorithm.name != "shm", kw
    assert chosen("alltoall", 64 * M, nodes=1, transport="local").algorithm.name == "shm"
    assert chosen("alltoall", 1 * M, nodes=1, transport="local").algorithm.name != "shm"
    # The competitor timed at each size is what the written table selects where shm does not run.
    for size, name in other.items():
        assert chosen("allreduce", size, transport="local").algorithm.name == name, size


def test_the_slowest_rank_decides_and_every_rank_returns_the_same_table(monkeypatch):
    # Alone, rank 0 would write shm for allreduce from 64 KiB up; rank 1 measured it slower at 256 KiB.
    _fixed_constants(monkeypatch)
    _fake_samples(monkeypatch, {}, per_rank={0: {"allreduce": set(QUICK_LADDER)},
                                             1: {"allreduce": {64 * K, 1 * M, 2 * M}}})
    tables = _tune(["allreduce"])
    assert tables[0] == tables[1]
    rules = _node_rules(tables[0], "allreduce")
    assert [(r["min_bytes"], r.get("max_bytes")) for r in rules] == [(64 * K, 64 * K), (1 * M, None)]


def test_every_rank_returns_the_same_reduce_points(monkeypatch):
    # Each rank times the reduction itself; the table keeps the ranks' mean, as it does for gamma.
    _fixed_constants(monkeypatch)
    _fake_samples(monkeypatch, {})

    def measure_gamma(dtype, op, sizes, reps=5):
        rank = int(threading.current_thread().name.rsplit("-", 1)[1])
        return GAMMA * (1 + rank), [(n, GAMMA * n * (1 + rank)) for n in sizes]

    monkeypatch.setattr(tune, "measure_gamma", measure_gamma)
    tables = _tune(["allreduce"])
    assert tables[0] == tables[1]
    assert tables[0]["measured"]["gamma"] == pytest.approx(1.5 * GAMMA)
    assert [t for _, t in tables[0]["measured"]["reduce_points"]] == pytest.approx(
        [1.5 * GAMMA * n for n, _ in tables[0]["measured"]["reduce_points"]])


def test_a_wrong_result_never_wins(monkeypatch):
    _fixed_constants(monkeypatch)
    _fake_samples(monkeypatch, {"allreduce": set(QUICK_LADDER)}, wrong_at={("allreduce", 1 * M)})
    lines = []
    table = ck.run_local(lambda c: tune.run(c, collectives=["allreduce"], max_bytes=2 * M, quick=True,
                                            log=lines.append if c.rank == 0 else lambda text: None), 2, timeout=120)[0]
    low, high = _node_rules(table, "allreduce")
    assert (low["min_bytes"], low["max_bytes"], high["min_bytes"]) == (64 * K, 256 * K, 2 * M)
    assert "shm gave a wrong result at 1 MiB" in low["reason"] and "shm gave a wrong result at 1 MiB" in high["reason"]
    assert [x["wrong"] for x in table["measured"]["node"]] == [0, 0, 2, 0]  # both ranks saw it
    assert "node pass allreduce: shm faster at 64 KiB-256 KiB, >= 2 MiB of 4 measured; WRONG RESULTS from shm at " \
           "1 MiB" in lines


def test_barrier_is_measured_once_and_its_rule_has_no_sizes(tmp_path, monkeypatch):
    _fixed_constants(monkeypatch)
    calls = _fake_samples(monkeypatch, {"barrier": {0}})
    table = _tune(["barrier"])[0]
    [rule] = _node_rules(table, "barrier")
    assert "min_bytes" not in rule and "max_bytes" not in rule and rule["algorithm"] == "shm"
    assert {(c, n) for _, c, n, _ in calls} == {("barrier", 0)}
    assert "left open" not in rule["reason"]  # one size: nothing was extrapolated
    monkeypatch.setenv("COMMKIT_TUNING", _write(tmp_path, table))
    assert selection.select("barrier", 2, 0, nodes=1, transport="local").algorithm.name == "shm"


# -- when there is no node pass ---------------------------------------------------------------------------------


def test_no_node_pass_where_the_ranks_span_nodes(monkeypatch):
    monkeypatch.setenv(ENV_RANKS_PER_NODE, "1")  # the threads world's 2 ranks on 2 emulated nodes
    _fixed_constants(monkeypatch)
    calls = _fake_samples(monkeypatch, {"allreduce": set(QUICK_LADDER)})
    lines = []
    tables = ck.run_local(lambda c: (c.nodes, tune.run(c, collectives=["allreduce"], max_bytes=2 * M, quick=True,
                                                        log=lines.append if c.rank == 0 else lambda t: None)),
                          2, timeout=120)
    assert [nodes for nodes, _ in tables] == [2, 2]
    table = tables[0][1]
    assert calls == [] and _node_rules(table, "allreduce") == [] and "node" not in table["measured"]
    assert table["measured"]["node_pass"] == "not run: the ranks span 2 nodes"
    assert "no node pass: the ranks span 2 nodes" in lines


def test_no_node_pass_when_turned_off(monkeypatch):
    _fixed_constants(monkeypatch)
    calls = _fake_samples(monkeypatch, {"allreduce": set(QUICK_LADDER)})
    table = _tune(["allreduce"], node=False)[0]
    assert calls == [] and _node_rules(table, "allreduce") == []
    assert table["measured"]["node_pass"] == "not run: turned off (--no-node)"


# -- the command line -------------------------------------------------------------------------------------------


def _cli_tune(monkeypatch, args):
    """``commkit tune ARGS`` run in-process by both ranks of a threads world; the exit statuses."""
    comms = {}
    monkeypatch.setattr(cli, "_init", lambda gpu: comms[threading.get_ident()])

    def body(c):
        comms[threading.get_ident()] = c
        return cli.main(["tune", "--quick", "-c", "allreduce", "--max-bytes", "256K", *args])

    return ck.run_local(body, 2, timeout=120)


@pytest.mark.parametrize("flag", [[], ["--no-node"]])
def test_cli_runs_the_node_pass_unless_no_node(tmp_path, monkeypatch, capsys, flag):
    _fixed_constants(monkeypatch)
    calls = _fake_samples(monkeypatch, {"allreduce": {64 * K, 256 * K}})
    path = str(tmp_path / "tuned.json")
    assert _cli_tune(monkeypatch, [*flag, "-O", path]) == [0, 0]
    out, err = capsys.readouterr()
    table = selection.load_table(path)
    rules = _node_rules(table, "allreduce")
    if flag:
        assert calls == [] and rules == [] and "node pass" not in err
        assert table["measured"]["node_pass"] == "not run: turned off (--no-node)"
        return
    assert [(r["min_bytes"], r.get("max_bytes")) for r in rules] == [(64 * K, None)]
    assert "node pass: the 2 ranks share one node; timing shm against the table's choice at 64 KiB, 256 KiB" in err
    assert "node pass allreduce: shm faster at >= 64 KiB of 2 measured" in err
    assert "p=2 >= 64 KiB: shm (one node, local)" in out


# -- under mpiexec ----------------------------------------------------------------------------------------------


@pytest.mark.mpi
def test_cli_tune_under_mpi_writes_one_node_rules_the_selector_loads(mpi, tmp_path, monkeypatch):
    path = tmp_path / "tuned.json"
    result = run_commkit(["tune", "-n", "2", "--quick", "-c", "allreduce,gather", "--max-bytes", "256K",
                          "-O", str(path)], timeout=400)
    assert result.returncode == 0, result.stderr
    assert "node pass allreduce: shm " in result.stderr and "node pass gather: shm " in result.stderr
    table = selection.load_table(str(path))
    node = table["measured"]["node"]
    assert [(x["collective"], x["bytes"]) for x in node] == [
        (c, n) for c in ("allreduce", "gather") for n in (64 * K, 256 * K)]
    assert all(x["shm_seconds"] > 0 and x["other_seconds"] > 0 and x["wrong"] == 0 for x in node)
    monkeypatch.setenv("COMMKIT_TUNING", str(path))
    for collective, op in (("allreduce", "sum"), ("gather", None)):
        rules = _node_rules(table, collective)
        # shm may lose everywhere on a loaded machine; where it won, the rules say so and select it.
        assert bool(rules) == any(x["shm_faster"] for x in node if x["collective"] == collective)
        for rule in rules:
            assert (rule["transport"], rule["algorithm"], rule["min_procs"], rule["max_procs"]) == ("mpi", "shm", 2, 2)
            choice = selection.select(collective, 2, rule["min_bytes"], op, nodes=1, transport="mpi")
            assert choice.algorithm.name == "shm" and choice.reason.startswith(f"{path}: measured: shm")
        assert table[collective][:len(rules)] == rules
        choice = selection.select(collective, 2, 8, op, nodes=1, transport="mpi")
        assert choice.algorithm.name != "shm" and choice.reason.startswith(str(path))
