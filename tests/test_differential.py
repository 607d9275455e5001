"""The differential sweep (scripts/differential_sweep.py) runs, passes on commkit, and catches what it must.

A sweep that never fails proves nothing, so besides running a quick slice of
it (threads, and mpiexec) these tests register algorithms that are wrong on
purpose -- a wrong result for some counts, an exception on one rank, a hang --
and require the sweep to name each one, to go on with the scenarios after it,
and to end every worker it started.
"""

from __future__ import annotations

import io
import json
import os
import sys
import textwrap

import pytest

from commkit import algorithms
from commkit.schedule import Copy, Recv, Reduce, Send

from conftest import have_mpi, mpi_segments, segments_left

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "differential_sweep.py")
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import differential_sweep as sweep  # noqa: E402

sys.path.pop(0)


def _run_script(*args, timeout=300):
    """Run the sweep in a process group of its own, ended on a timeout; what its jobs left in /dev/shm is removed."""
    from commkit._mpiexec import run_group

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    return run_group([sys.executable, SCRIPT, *args], timeout=timeout, env=env, cwd=ROOT)


def _check_clean_run(result, summary_path):
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    with open(summary_path) as f:
        summary = json.load(f)
    assert summary["scenarios"] > 0 and not summary["wrong"] and not summary["exceptions"]
    assert f"scenarios run: {summary['scenarios']} " in result.stdout
    return summary


def test_quick_threads_sweep_passes(tmp_path):
    summary_path = tmp_path / "summary.json"
    result = _run_script("--quick", "--mpi", "none", "--json", str(summary_path), timeout=120)
    summary = _check_clean_run(result, summary_path)
    assert set(summary["by_world"]) == {f"threads/{p}" for p in range(1, 9)}
    assert {key.split("/")[1] for key in summary["by_collective_form"]} == set(sweep.FORMS)


@pytest.mark.mpi
@pytest.mark.skipif(not have_mpi(), reason="needs mpi4py and mpiexec")
def test_quick_mpiexec_sweep_passes(tmp_path):
    summary_path = tmp_path / "summary.json"
    result = _run_script("--threads", "none", "--mpi", "2,3", "--budget", "200", "--json", str(summary_path))
    summary = _check_clean_run(result, summary_path)
    assert set(summary["by_world"]) == {"mpi/2", "mpi/3"}
    assert any(key.startswith("allreduce/") for key in summary["by_collective_form"])


# -- the sweep catches a wrong algorithm ----------------------------------------------------------------------


def _chain(rank, size, count, op, drop_last=False):
    """A chain allreduce (docs/extending.md); ``drop_last`` leaves out rank p-1's input on odd counts."""
    whole, incoming = ("out", 0, count), ("tmp", 0, count)
    yield Copy(whole, ("in", 0, count))
    if rank > 0:
        yield Recv(rank - 1, incoming)
        if drop_last and rank == size - 1 and count % 2:
            yield Copy(whole, incoming)
        else:
            yield Reduce(whole, incoming, op, operand_first=True)
    if rank < size - 1:
        yield Send(rank + 1, whole)
        yield Recv(rank + 1, whole)
    if rank > 0:
        yield Send(rank - 1, whole)


def allreduce_drops_the_last_rank_on_odd_counts(rank, size, count, op):
    """Wrong on purpose: the chain allreduce without rank p-1's input when the count is odd."""
    yield from _chain(rank, size, count, op, drop_last=True)


def allreduce_raises_on_rank_one(rank, size, count, op):
    """Wrong on purpose: rank 1 raises while making its schedule for a count of 3; right otherwise."""
    if rank == 1 and count == 3:
        raise RuntimeError("deliberate failure for a count of 3")
    yield from _chain(rank, size, count, op)


def _report_text(tally) -> str:
    out = io.StringIO()
    sweep.report(tally, 1.0, out=out)
    return out.getvalue()


def _register(name, schedule):
    algorithms.algorithm("allreduce", name, scratch=lambda rank, size, count: count)(schedule)


def _scenarios(name, p, forms=sweep.FORMS):
    """Every sum scenario of ``allreduce`` with algorithm ``name`` at ``p`` threads, for int32 and float64.

    Sum, because leaving out a rank's input changes every element of a sum (not always a max).
    """
    chosen = [sc for sc in sweep.plan([("threads", p)], ("allreduce",), 0, 5)
              if sc["algorithm"] == name and sc["form"] in forms and sc["dtype"] in ("int32", "float64")
              and sc["op"] == "sum"]
    for i, sc in enumerate(chosen):
        sc["i"] = i
    return chosen


def test_the_sweep_reports_every_wrong_result_of_a_wrong_algorithm():
    name = "sweep_drops_last_rank"
    _register(name, allreduce_drops_the_last_rank_on_odd_counts)
    try:
        scenarios = _scenarios(name, 3)
        tally = sweep.sweep_in_process(3, scenarios)
    finally:
        algorithms.unregister("allreduce", name)
    assert tally.failed() and not tally.exceptions
    assert tally.run == len(scenarios)
    wrong = {json.dumps(item["scenario"], sort_keys=True) for item in tally.wrong}
    # Exactly the scenarios with an odd count are wrong (a 0-d array holds one element: odd too).
    odd = {json.dumps(sweep._public(sc), sort_keys=True) for sc in scenarios
           if sc["count"] == "0-d" or sc["count"] % 2}
    assert wrong == odd
    assert {item["rank"] for item in tally.wrong} == {0, 1, 2}

    text = _report_text(tally)
    assert f"wrong results: {len(tally.wrong)}" in text
    assert f"WRONG threads p=3 allreduce algorithm={name} form=" in text
    assert "reproduce: python scripts/differential_sweep.py --repro '{" in text


def test_an_exception_on_one_rank_is_reported_and_the_sweep_goes_on():
    name = "sweep_raises_on_rank_one"
    _register(name, allreduce_raises_on_rank_one)
    try:
        scenarios = _scenarios(name, 3, forms=("repeat", "iform"))
        tally = sweep.sweep_in_process(3, scenarios)
    finally:
        algorithms.unregister("allreduce", name)
    failing = [sc for sc in scenarios if sc["count"] == 3]
    assert failing and len(failing) < len(scenarios)
    raised = {json.dumps(item["scenario"], sort_keys=True) for item in tally.exceptions}
    assert raised == {json.dumps(sweep._public(sc), sort_keys=True) for sc in failing}
    # commkit makes a registered algorithm's schedules for every rank on each rank (so that all of them
    # refuse a bad one alike): whichever rank raises first is reported, its peers only see PeerFailed.
    assert all(item["type"] == "RuntimeError" and "deliberate failure" in item["message"]
               for item in tally.exceptions)
    assert tally.run == len(scenarios) - len(failing) and not tally.wrong


def barrier_leaves_at_once(rank, size):
    """Wrong on purpose: a barrier with no steps, so every rank leaves as soon as it arrives."""
    yield from ()


def test_a_barrier_that_lets_ranks_leave_early_is_reported():
    algorithms.algorithm("barrier", "sweep_no_wait")(barrier_leaves_at_once)
    try:
        scenarios = [sc for sc in sweep.plan([("threads", 4)], ("barrier",), 0, 5)
                     if sc["algorithm"] == "sweep_no_wait"]
        for i, sc in enumerate(scenarios):
            sc["i"] = i
        tally = sweep.sweep_in_process(4, scenarios)
    finally:
        algorithms.unregister("barrier", "sweep_no_wait")
    assert tally.run == len(scenarios) == len(sweep.FORMS) - 1  # no in-place barrier
    # A rank that leaves at once sees the ranks that have not arrived yet; the first thread to run always does.
    assert tally.wrong and all("barrier returned while" in item["what"] for item in tally.wrong)


def test_ranks_that_disagree_in_their_bits_are_wrong_where_commkit_promises_the_same_bits():
    def records(digests):
        return {r: {"i": 0, "rank": r, "problems": [], "digest": d, "calls": 3} for r, d in enumerate(digests)}

    base = {"i": 0, "world": "threads", "p": 2, "form": "repeat", "op": "sum", "shape": [3], "count": 3,
            "seed": 1, "root": 0}
    for collective, algorithm, dtype, promised in (("allreduce", "ring", "int64", True),
                                                   ("allreduce", "shm", "float64", True),
                                                   ("broadcast", "binomial", "float32", True),
                                                   ("allreduce", "recursive_doubling", "float64", False)):
        sc = dict(base, collective=collective, algorithm=algorithm, dtype=dtype)
        tally = sweep.Tally()
        assert tally.settle(sc, records(["aa", "aa"]), 2) and not tally.failed()
        tally = sweep.Tally()
        assert tally.settle(sc, records(["aa", "bb"]), 2)
        assert tally.failed() == promised, (collective, algorithm, dtype)
        assert len(tally.unpromised) == (not promised)


FAULTY_MODULE = '''
from commkit.algorithms import algorithm
from commkit.schedule import Exchange, Recv, Reduce


@algorithm("allreduce", "sweep_faulty", scratch=lambda rank, size, count: count)
def allreduce_sweep_faulty(rank, size, count, op):
    """Wrong on purpose, for 2 ranks: raises for a count of 2, hangs for 3 (rank 0 waits for a message
    nobody sends), a right swap-and-reduce otherwise."""
    if count == 2:
        raise RuntimeError("deliberate failure for a count of 2")
    if count == 3 and rank == 0:
        yield Recv(1, ("tmp", 0, count))
    yield Exchange(1 - rank, ("in", 0, count), 1 - rank, ("tmp", 0, count))
    yield Reduce(("out", 0, count), ("tmp", 0, count), op, src=("in", 0, count), operand_first=rank == 1)
'''


def _supervise_faulty(world, tmp_path, monkeypatch):
    """Run counts 1, 2 (raises), 3 (hangs), 4 of the faulty algorithm in workers of ``world`` (2 ranks)."""
    (tmp_path / "sweep_faulty_alg.py").write_text(textwrap.dedent(FAULTY_MODULE))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv(algorithms.ENV_VARIABLE, "sweep_faulty_alg")
    scenarios = [dict(sweep._scenario(world, 2, "allreduce", "sweep_faulty", "repeat", "sum", "int32", [n], 9), i=i)
                 for i, n in enumerate((1, 2, 3, 4))]
    tally = sweep.Tally()
    shm = mpi_segments()
    sweep.supervise(world, 2, scenarios, tally, hang_timeout=3)
    # The hung worker was ended and the raising one aborted: neither job's segments stay in /dev/shm
    # (those of jobs running beside this one are in use, or go within moments: see segments_left).
    left = segments_left(shm)
    assert not left, left
    by_count = {}
    for item in tally.exceptions:
        by_count.setdefault(item["scenario"]["count"], set()).add(item["type"])
    assert by_count == {2: {"RuntimeError"}, 3: {"NotFinished"}}
    assert any("deliberate failure" in item["message"] for item in tally.exceptions)
    assert any("no progress for 3 s" in item["message"] for item in tally.exceptions)
    assert tally.run == 2 and not tally.wrong  # counts 1 and 4, before and after the faults
    text = _report_text(tally)
    assert "unexpected exceptions: " in text and "RuntimeError: deliberate failure for a count of 2" in text
    assert "NotFinished: no progress for 3 s during this scenario" in text


def test_an_exception_and_a_hang_in_a_threads_worker_are_reported_and_the_rest_runs(tmp_path, monkeypatch):
    _supervise_faulty("threads", tmp_path, monkeypatch)


@pytest.mark.mpi
@pytest.mark.skipif(not have_mpi(), reason="needs mpi4py and mpiexec")
def test_an_exception_and_a_hang_under_mpiexec_are_reported_and_the_rest_runs(tmp_path, monkeypatch):
    _supervise_faulty("mpi", tmp_path, monkeypatch)
