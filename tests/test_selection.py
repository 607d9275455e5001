"""Choosing an algorithm: precedence of the overrides, restrictions, and tuning files.

Precedence, most specific first: ``algorithm=``, ``COMMKIT_<COLLECTIVE>_ALGORITHM``,
the ``COMMKIT_TUNING`` file, the shipped table. The selector never picks an
algorithm whose restrictions fail; a forced one that cannot apply raises unless
``COMMKIT_FALLBACK=warn``. A malformed tuning file fails with an error naming the
file and the problem. Tables written by ``commkit tune`` (built here without MPI
from given alpha, beta, gamma) pass validation and select the model's winner.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from hypothesis import given, strategies as st

import commkit as ck
from commkit import algorithms, collectives, cost, selection, tune
from commkit.ops import SUM

NONCOMM = ck.Op(lambda a, b: a - b, commutative=False, name="minus")
REDUCING = collectives.REDUCING


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for var in ("COMMKIT_TUNING", "COMMKIT_FALLBACK"):
        monkeypatch.delenv(var, raising=False)
    for collective in algorithms.COLLECTIVES:
        monkeypatch.delenv(f"COMMKIT_{collective.upper()}_ALGORITHM", raising=False)


def write_table(tmp_path, table, name="tuning.json"):
    path = tmp_path / name
    path.write_text(table if isinstance(table, str) else json.dumps(table))
    return str(path)


# -- precedence -----------------------------------------------------------------------------------


def test_shipped_table_is_the_default():
    choice = selection.select("allreduce", 8, 1 << 20, SUM)
    assert choice.algorithm.name == "rabenseifner" and choice.reason.startswith("default.json")
    assert selection.select("allreduce", 8, 64, SUM).algorithm.name == "recursive_doubling"


def test_tuning_file_overrides_the_shipped_table(tmp_path, monkeypatch):
    path = write_table(tmp_path, {"allreduce": [{"algorithm": "ring", "reason": "measured here"}]})
    monkeypatch.setenv("COMMKIT_TUNING", path)
    choice = selection.select("allreduce", 8, 1 << 20, SUM)
    assert choice.algorithm.name == "ring" and choice.reason == f"{path}: measured here"
    # Collectives the file does not mention keep the shipped rules.
    assert selection.select("broadcast", 8, 64).reason.startswith("default.json")


def test_environment_overrides_the_tuning_file(tmp_path, monkeypatch):
    monkeypatch.setenv("COMMKIT_TUNING", write_table(tmp_path, {"allreduce": [{"algorithm": "ring"}]}))
    monkeypatch.setenv("COMMKIT_ALLREDUCE_ALGORITHM", "naive")
    choice = selection.select("allreduce", 8, 1 << 20, SUM)
    assert choice.algorithm.name == "naive" and "COMMKIT_ALLREDUCE_ALGORITHM" in choice.reason
    monkeypatch.setenv("COMMKIT_ALLREDUCE_ALGORITHM", "auto")  # auto: no override
    assert selection.select("allreduce", 8, 1 << 20, SUM).algorithm.name == "ring"


def test_argument_overrides_the_environment(monkeypatch):
    monkeypatch.setenv("COMMKIT_ALLREDUCE_ALGORITHM", "naive")
    choice = selection.select("allreduce", 8, 1 << 20, SUM, requested="recursive_doubling")
    assert choice.algorithm.name == "recursive_doubling" and choice.reason == "forced by algorithm= argument"
    # algorithm="auto" defers to the environment.
    assert selection.select("allreduce", 8, 1 << 20, SUM, requested="auto").algorithm.name == "naive"


def test_precedence_through_the_communicator(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("COMMKIT_TUNING", write_table(tmp_path, {"allreduce": [{"algorithm": "naive", "reason": "t"}]}))
    x = np.arange(40, dtype=np.int64)

    def body(comm):
        out = [comm.allreduce(x).sum(), comm.last_algorithm]
        out += [comm.allreduce(x, algorithm="ring").sum(), comm.last_algorithm]
        return out

    with caplog.at_level(logging.DEBUG, logger="commkit"):
        results = ck.run_local(body, 3)
    total = 3 * x.sum()
    assert results == [[total, "naive", total, "ring"]] * 3
    assert any("-> naive" in r.getMessage() for r in caplog.records)  # the choice is in the debug log

    monkeypatch.setenv("COMMKIT_ALLREDUCE_ALGORITHM", "recursive_doubling")
    assert ck.run_local(lambda c: (c.allreduce(x), c.last_algorithm)[1], 2) == ["recursive_doubling"] * 2


# -- restrictions ---------------------------------------------------------------------------------


def test_rules_whose_algorithm_cannot_run_are_skipped(tmp_path, monkeypatch):
    monkeypatch.setenv("COMMKIT_TUNING", write_table(tmp_path, {"allreduce": [{"algorithm": "ring"}]}))
    choice = selection.select("allreduce", 8, 1 << 20, NONCOMM)
    assert choice.algorithm.name != "ring" and choice.algorithm.why_not(8, NONCOMM) is None


def test_forced_algorithm_that_cannot_apply_raises(monkeypatch):
    with pytest.raises(ck.AlgorithmNotApplicable, match="commutative.*COMMKIT_FALLBACK=warn"):
        selection.select("allreduce", 4, 64, NONCOMM, requested="ring")
    monkeypatch.setenv("COMMKIT_REDUCE_SCATTER_ALGORITHM", "ring")
    with pytest.raises(ck.AlgorithmNotApplicable, match="forced by COMMKIT_REDUCE_SCATTER_ALGORITHM"):
        selection.select("reduce_scatter", 4, 64, NONCOMM)
    with pytest.raises(ck.AlgorithmNotApplicable, match="allreduce_native is not available"):
        selection.select("allreduce", 4, 64, SUM, requested="native", native_ok=False)
    with pytest.raises(ck.AlgorithmNotApplicable, match="unknown allreduce algorithm 'rign'"):
        selection.select("allreduce", 4, 64, SUM, requested="rign")


def test_fallback_warn_selects_automatically(monkeypatch):
    monkeypatch.setenv("COMMKIT_FALLBACK", "warn")
    with pytest.warns(RuntimeWarning, match="falling back"):
        choice = selection.select("allreduce", 4, 64, NONCOMM, requested="ring")
    assert choice.algorithm.why_not(4, NONCOMM) is None


def test_forced_inapplicable_algorithm_raises_before_sending():
    def body(comm):
        with pytest.raises(ck.AlgorithmNotApplicable):
            comm.allreduce(np.ones(4), NONCOMM, algorithm="rabenseifner")
        return comm.allreduce(np.ones(4), NONCOMM, algorithm="naive")

    assert all(np.array_equal(r, np.ones(4) * -1) for r in ck.run_local(body, 3))


ALL_NAMES = sorted({name for c in algorithms.COLLECTIVES for name in algorithms.for_collective(c)})
rule_strategy = st.fixed_dictionaries(
    {"algorithm": st.sampled_from(ALL_NAMES)},
    optional={"min_procs": st.integers(0, 70), "max_procs": st.integers(0, 70), "min_bytes": st.integers(0, 1 << 21),
              "max_bytes": st.integers(0, 1 << 21), "commutative": st.booleans(), "one_node": st.just(True),
              "transport": st.sampled_from(["mpi", "local"]), "persistent": st.just(False),
              "library": st.sampled_from(["MPICH", "Open MPI"])},
)


@given(collective=st.sampled_from(algorithms.COLLECTIVES), size=st.integers(1, 70), nbytes=st.integers(0, 1 << 21),
       commutative=st.booleans(), rules=st.lists(rule_strategy, max_size=6), native_ok=st.booleans(),
       nodes=st.sampled_from([None, 1, 2, 5]), node_why=st.sampled_from([None, "persistent"]),
       transport=st.sampled_from([None, "mpi", "local"]), persistent=st.booleans(),
       library=st.sampled_from([None, "MPICH", "Open MPI"]))
def test_selection_never_picks_an_algorithm_that_cannot_run(tmp_path_factory, collective, size, nbytes, commutative,
                                                           rules, native_ok, nodes, node_why, transport, persistent,
                                                           library):
    rules = [r for r in rules if algorithms.get(collective, r["algorithm"]) is not None]
    path = write_table(tmp_path_factory.mktemp("t"), {collective: rules})
    op = (SUM if commutative else NONCOMM) if collective in REDUCING else None
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("COMMKIT_TUNING", path)
        choice = selection.select(collective, size, nbytes, op, native_ok=native_ok, nodes=nodes, node_why=node_why,
                                  transport=transport, persistent=persistent, library=library)
    alg = choice.algorithm
    if alg.name == "native":
        assert native_ok
    else:
        assert alg.why_not(size, op) is None
    if algorithms.is_node_only(alg):  # only where every rank shares one node and the call may use the arena
        assert nodes == 1 and node_why is None, choice
    if choice.reason.startswith(path):
        rule = next(r for r in rules if r["algorithm"] == alg.name and r.get("transport", transport) == transport
                    and r.get("library", library) == library
                    and (not r.get("one_node") or (nodes == 1 and node_why is None))
                    and not (persistent and r.get("persistent", True) is False))
        assert rule is not None


def test_one_node_rules_need_one_node_the_transport_and_a_call_that_can_use_the_arena(tmp_path, monkeypatch):
    path = write_table(tmp_path, {"allreduce": [
        {"one_node": True, "transport": "mpi", "algorithm": "shm", "reason": "measured under MPI"},
        {"algorithm": "ring", "reason": "anywhere"}]})
    monkeypatch.setenv("COMMKIT_TUNING", path)

    def pick(**where):
        return selection.select("allreduce", 2, 1 << 20, SUM, **where).algorithm.name

    assert pick(nodes=1, transport="mpi") == "shm"
    assert pick(nodes=2, transport="mpi") == "ring"  # spans nodes
    assert pick(nodes=1, transport="local") == "ring"  # measured on another transport
    assert pick(nodes=1) == "ring"  # transport not known
    assert pick(transport="mpi") == "ring"  # nodes not known
    assert pick(nodes=1, transport="mpi", node_why="a persistent request") == "ring"


def test_a_rule_naming_an_mpi_library_matches_that_library_alone(tmp_path, monkeypatch):
    path = write_table(tmp_path, {"allreduce": [
        {"one_node": True, "transport": "mpi", "library": "MPICH", "max_bytes": 1000, "algorithm": "shm",
         "reason": "MPICH's runs"},
        {"library": "Open MPI", "algorithm": "rabenseifner", "reason": "Open MPI's runs"},
        {"algorithm": "ring", "reason": "anywhere"}]})
    monkeypatch.setenv("COMMKIT_TUNING", path)

    def pick(nbytes=64, **where):
        return selection.select("allreduce", 4, nbytes, SUM, nodes=1, transport="mpi", **where).algorithm.name

    assert pick(library="MPICH") == "shm"
    assert pick(library="MPICH", nbytes=2000) == "ring"  # past its bound, and the next rule names Open MPI
    assert pick(library="Open MPI") == "rabenseifner"
    assert pick() == "ring"  # no library known (the threads world, NCCL): neither rule
    assert pick(library="Intel MPI") == "ring"


def test_a_forced_node_algorithm_where_it_cannot_run_says_why_before_sending():
    with pytest.raises(ck.AlgorithmNotApplicable, match="spans 3 nodes"):
        selection.select("allreduce", 6, 64, SUM, requested="shm", nodes=3)
    with pytest.raises(ck.AlgorithmNotApplicable, match="persistent collectives run compiled plans"):
        selection.select("allreduce", 2, 64, SUM, requested="shm", nodes=1, node_why="persistent collectives run "
                         "compiled plans")
    # Not known (a caller of select that says nothing): checked when it runs, as before.
    assert selection.select("allreduce", 2, 64, SUM, requested="shm").algorithm.name == "shm"


def test_the_default_picks_shm_only_where_it_was_measured_to_win():
    def pick(collective, nbytes, **where):
        return selection.select(collective, 2, nbytes, SUM if collective in REDUCING else None, **where).algorithm.name

    mpi_node = {"nodes": 1, "transport": "mpi"}
    assert pick("allreduce", 16 << 10, **mpi_node) == "shm"
    assert pick("allreduce", (16 << 10) - 4, **mpi_node) == "recursive_doubling"
    assert pick("reduce", 16 << 10, **mpi_node) == "shm"
    assert pick("reduce", (16 << 10) - 4, **mpi_node) != "shm"
    assert pick("gather", 32 << 10, **mpi_node) == "shm"
    assert pick("gather", 32 << 20, **mpi_node) == "binomial"
    assert pick("scatter", 16 << 10, **mpi_node) == "shm"
    assert pick("scatter", 8 << 20, **mpi_node) == "binomial"
    assert pick("broadcast", 8 << 10, **mpi_node) == "shm"
    assert pick("broadcast", 4 << 20, **mpi_node) == "shm"
    assert pick("allgather", 32 << 10, **mpi_node) == "shm"
    assert pick("allgather", 8 << 20, **mpi_node) == "shm"
    assert pick("reduce_scatter", 16 << 10, **mpi_node) == "shm"
    assert pick("alltoall", 32 << 10, **mpi_node) == "shm"
    assert pick("alltoall", 1 << 20, **mpi_node) == "shm"
    # Measured not to win: each collective's sizes next to its rule's.
    for collective, nbytes in (("broadcast", 8 << 20), ("broadcast", 4 << 10), ("allgather", 16 << 20),
                               ("allgather", 16 << 10), ("reduce_scatter", 8 << 10), ("alltoall", 2 << 20),
                               ("alltoall", 16 << 10), ("gather", 16 << 10), ("scatter", 8 << 10),
                               ("reduce", 8 << 10), ("allreduce", 8 << 10)):
        assert pick(collective, nbytes, **mpi_node) != "shm", (collective, nbytes)
    # A persistent request: the same bounds, but the broadcast's (a tie at 8 KiB).
    for collective, nbytes in (("allreduce", 16 << 10), ("reduce", 16 << 10), ("gather", 32 << 10),
                               ("scatter", 16 << 10), ("allgather", 32 << 10), ("reduce_scatter", 16 << 10),
                               ("alltoall", 32 << 10), ("broadcast", 16 << 10)):
        assert pick(collective, nbytes, persistent=True, **mpi_node) == "shm", collective
        assert pick(collective, nbytes - 4, persistent=True, **mpi_node) != "shm", collective
    assert pick("broadcast", 8 << 10, **mpi_node) == "shm"
    assert pick("broadcast", 8 << 10, persistent=True, **mpi_node) != "shm"
    # The threads world (messages handed over without a copy), another node count, a persistent request.
    assert pick("allreduce", 4 << 20, nodes=1, transport="local") == "ring"
    assert pick("allreduce", 4 << 20, nodes=2, transport="mpi") == "ring"
    assert pick("allreduce", 4 << 20, node_why="persistent", **mpi_node) == "ring"
    assert selection.select("allreduce", 3, 4 << 20, SUM, **mpi_node).algorithm.name != "shm"  # measured at 2
    # One size down, MPICH's runs all put shm ahead and Open MPI's did not: a rule for MPICH alone.
    for collective, nbytes in (("allreduce", 8 << 10), ("reduce", 8 << 10), ("gather", 16 << 10),
                               ("allgather", 16 << 10)):
        for persistent in (False, True):
            assert pick(collective, nbytes, library="MPICH", persistent=persistent, **mpi_node) == "shm", collective
            assert pick(collective, nbytes, library="Open MPI", persistent=persistent, **mpi_node) != "shm"
        assert pick(collective, nbytes - 8, library="MPICH", **mpi_node) != "shm", collective
    assert pick("broadcast", 4 << 10, library="MPICH", **mpi_node) != "shm"


# -- tuning files ----------------------------------------------------------------------------------


@pytest.mark.parametrize("content,problem", [
    ("{not json", r"not valid JSON \(Expecting property name"),
    ("[1, 2]", "expected a JSON object at the top level, got list"),
    ({"allreduse": []}, "unknown collective 'allreduse'"),
    ({"allreduce": {"algorithm": "ring"}}, "'allreduce' must map to a list of rules, got dict"),
    ({"allreduce": ["ring"]}, r"allreduce\[0\]: each rule must be an object with an 'algorithm' key"),
    ({"allreduce": [{"max_bytes": 8}]}, r"allreduce\[0\]: each rule must be an object with an 'algorithm' key"),
    ({"allreduce": [{"algorithm": "ring", "max_byte": 8}]}, r"unknown key\(s\) \['max_byte'\]"),
    ({"allreduce": [{"algorithm": "ring"}, {"algorithm": "bruck"}]}, r"allreduce\[1\]: unknown algorithm 'bruck'"),
    ({"allreduce": [{"algorithm": "ring", "max_bytes": -1}]}, "max_bytes must be a non-negative integer, got -1"),
    ({"allreduce": [{"algorithm": "ring", "min_procs": True}]}, "min_procs must be a non-negative integer, got True"),
    ({"allreduce": [{"algorithm": "ring", "max_bytes": "1M"}]}, "max_bytes must be a non-negative integer, got '1M'"),
    ({"allreduce": [{"algorithm": "shm", "one_node": 1}]}, "one_node must be true .* got 1"),
    ({"allreduce": [{"algorithm": "shm", "transport": 3}]}, "transport must be a transport's name .* got 3"),
    ({"allreduce": [{"algorithm": "shm", "persistent": True}]}, "persistent must be false .* got True"),
    ({"allreduce": [{"algorithm": "shm", "library": ["MPICH"]}]}, r"library must be an MPI library's name .* got \['MPICH'\]"),
])
def test_malformed_tuning_files_name_the_file_and_the_problem(tmp_path, monkeypatch, content, problem):
    path = write_table(tmp_path, content)
    monkeypatch.setenv("COMMKIT_TUNING", path)
    with pytest.raises(ck.InvalidArgument, match=f"tuning file {path}") as info:
        selection.select("allreduce", 4, 64, SUM)
    assert info.match(problem)


def test_missing_tuning_file(tmp_path, monkeypatch):
    path = str(tmp_path / "nope.json")
    monkeypatch.setenv("COMMKIT_TUNING", path)
    with pytest.raises(ck.InvalidArgument, match=f"tuning file {path}: cannot be read"):
        selection.select("allreduce", 4, 64, SUM)


def test_metadata_keys_are_allowed():
    table = {"version": 1, "machine": {"cpus": 2}, "measured": {"alpha": 1e-6}, "model": "abg", "_note": "x",
             "allreduce": [{"algorithm": "ring", "reason": "r"}]}
    assert selection.validate_table(table, "t.json") is table


def test_shipped_table_is_valid_and_every_rule_says_why():
    table = selection.default_table()
    for collective in algorithms.COLLECTIVES:
        assert table[collective], collective
        for rule in table[collective]:
            assert rule.get("reason"), (collective, rule)


@given(collective=st.sampled_from(algorithms.COLLECTIVES), size=st.integers(1, 70), nbytes=st.integers(0, 1 << 27),
       commutative=st.booleans())
def test_shipped_table_never_picks_native(collective, size, nbytes, commutative):
    # MPI's own collectives carry no call identity, so a mismatched call on them could complete with
    # wrong data; the default keeps every call on commkit's algorithms, where a mismatch waits.
    assert all(rule["algorithm"] != "native" for rule in selection.default_table()[collective])
    op = (SUM if commutative else NONCOMM) if collective in REDUCING else None
    choice = selection.select(collective, size, nbytes, op, native_ok=True)
    assert choice.algorithm.name != "native", choice


def test_native_runs_where_asked_for(tmp_path, monkeypatch):
    assert selection.select("allreduce", 2, 8, SUM, requested="native", native_ok=True).algorithm.name == "native"
    monkeypatch.setenv("COMMKIT_BROADCAST_ALGORITHM", "native")
    assert selection.select("broadcast", 2, 8, native_ok=True).algorithm.name == "native"
    monkeypatch.delenv("COMMKIT_BROADCAST_ALGORITHM")
    monkeypatch.setenv("COMMKIT_TUNING", write_table(tmp_path, {"reduce": [{"algorithm": "native", "reason": "t"}]}))
    choice = selection.select("reduce", 2, 8, SUM, native_ok=True)
    assert choice.algorithm.name == "native" and choice.reason.endswith(": t")
    # Where the transport has no such library collective, the tuning file's rule is skipped.
    assert selection.select("reduce", 2, 8, SUM, native_ok=False).algorithm.name != "native"


# -- tables written by `commkit tune` ---------------------------------------------------------------

ALPHA, BETA, GAMMA = 5e-6, 2e-10, 1e-10


def _build(procs, confirm):
    return tune.build_table(ALPHA, BETA, GAMMA, procs, algorithms.COLLECTIVES, measured_p=4, confirm=confirm,
                            machine={"hostname": "test"}, measured={"how": "given"})


_BUILT: dict = {}  # procs -> the table built without confirmation, as JSON: each test reads its own copy


def tuned(tmp_path, procs=(2, 4, 64), confirm=None):
    """A table `commkit tune` would write for ALPHA, BETA, GAMMA, and its file in ``tmp_path``.

    Without ``confirm`` the table is a pure function of ``procs`` and is built once per
    session (building it scans every algorithm's cost at every size for every p; about a
    second of CPU per p); each caller gets a fresh copy parsed from the same text.
    """
    if confirm is not None:
        text = json.dumps(_build(procs, confirm))
    else:
        text = _BUILT.get(procs)
        if text is None:
            text = _BUILT[procs] = json.dumps(_build(procs, None))
    return json.loads(text), write_table(tmp_path, text, "tuned.json")


def test_tuned_table_is_valid_and_says_what_was_measured(tmp_path):
    table, path = tuned(tmp_path)
    assert selection.load_table(path) == table
    assert table["machine"] == {"hostname": "test"}
    assert table["measured"]["alpha"] == ALPHA and table["measured"]["nprocs"] == 4
    for collective in algorithms.COLLECTIVES:
        for rule in table[collective]:
            assert "alpha=5 us" in rule["reason"] and "measured on 4 ranks" in rule["reason"], rule
            if rule["min_procs"] != 4:
                assert "model extrapolation" in rule["reason"]


@pytest.mark.parametrize("p", [2, 4, 64])
@pytest.mark.parametrize("collective", ["allreduce", "broadcast", "allgather", "reduce_scatter", "alltoall"])
def test_tuned_table_selects_the_models_winner(tmp_path, monkeypatch, collective, p):
    _, path = tuned(tmp_path)
    monkeypatch.setenv("COMMKIT_TUNING", path)
    op = SUM if collective in REDUCING else None
    for nbytes in (0, 100, 5000, 70000, 1 << 20, 1 << 26):
        want = cost.best(collective, p, nbytes, alpha=ALPHA, beta=BETA, gamma=GAMMA)[0].algorithm
        choice = selection.select(collective, p, nbytes, op)
        assert choice.reason.startswith(path), (nbytes, choice)
        if choice.algorithm.name != want:
            # Only where the model's winner holds a regime too narrow for tune to keep, merged into a neighbour.
            regime = next(r for r in cost.crossovers(collective, p, alpha=ALPHA, beta=BETA, gamma=GAMMA)
                          if r.max_bytes is None or nbytes <= r.max_bytes)
            assert regime.algorithm == want and regime.max_bytes is not None, (nbytes, regime, choice)
            assert (regime.max_bytes + 1 - regime.min_bytes) * tune.MIN_REGIME_FRACTION < regime.min_bytes, regime
            assert "are merged in" in choice.reason and f"{want} at " in choice.reason, (nbytes, choice)
    if collective in REDUCING:  # non-commutative ops get rules of their own
        choice = selection.select(collective, p, 1 << 20, NONCOMM)
        assert choice.reason.startswith(path) and choice.algorithm.why_not(p, NONCOMM) is None


def test_tuned_table_leaves_other_process_counts_to_the_defaults(tmp_path, monkeypatch):
    _, path = tuned(tmp_path, procs=(4,))
    monkeypatch.setenv("COMMKIT_TUNING", path)
    assert selection.select("allreduce", 4, 1 << 20, SUM).reason.startswith(path)
    assert selection.select("allreduce", 8, 1 << 20, SUM).reason.startswith("default.json")


def test_confirmation_moves_thresholds_and_is_recorded(tmp_path, monkeypatch):
    calls = []

    def confirm(collective, low, high, boundary, lower, upper):
        calls.append((collective, low, high, boundary))
        if collective != "allreduce":
            return None  # e.g. beyond --max-bytes
        return boundary * 2, "bench moved it up", [{"bytes": boundary, low: 1.0, high: 2.0}]

    table, path = tuned(tmp_path, procs=(4,), confirm=confirm)
    predicted = cost.crossovers("allreduce", 4, alpha=ALPHA, beta=BETA, gamma=GAMMA)
    boundary = predicted[1].min_bytes
    assert ("allreduce", predicted[0].algorithm, predicted[1].algorithm, boundary) in calls
    rules = [r for r in table["allreduce"] if r.get("commutative")]
    assert rules[0]["max_bytes"] == 2 * boundary - 1 and rules[1]["min_bytes"] == 2 * boundary
    assert "bench moved it up" in rules[1]["reason"]
    assert table["measured"]["confirmations"][0]["chosen"] == 2 * boundary
    assert any("not benchmarked" in r["reason"] for c in ("broadcast", "allgather") for r in table[c])
    selection.load_table(path)


def test_fit_alpha_beta_recovers_a_line():
    points = [(n, 4e-6 + 3e-10 * n) for n in (8, 512, 4096, 1 << 15, 1 << 18, 1 << 20)]
    alpha, beta = tune.fit_alpha_beta(points)
    assert alpha == pytest.approx(4e-6, rel=1e-6) and beta == pytest.approx(3e-10, rel=1e-6)
    with pytest.raises(ck.InvalidArgument, match="two or more different sizes"):
        tune.fit_alpha_beta([(8, 1e-6)])
