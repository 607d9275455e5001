"""Mismatched calls never complete with a wrong answer; stuck ranks are explained; silent failures are loud.

Each test here would fail on commkit before its collective messages carried the
call's identity (see commkit/identity.py), while its shipped selection table
still picked MPI's own collectives (which carry none) for small calls, before the
watchdog, or before the checks it names.
"""

from __future__ import annotations

import os
import re
import sys
import textwrap
import time

import numpy as np
import pytest

import commkit as ck
from commkit import selection, watchdog
from commkit.schedule import CallInfo, Exchange, run_schedule
from commkit.transports.local import LocalTransport, LocalWorld

from conftest import requires_mpi, run_mpi

# Every kind of mismatch: (name, the call rank 0 makes, the call every other rank makes).
# Each returns (result, reference) where reference is what the call would give if every
# rank had made the same call as this one, so a "completed" rank can be checked.
MISMATCHES = {
    "collective": (lambda c, x: c.allreduce(x, timeout=T), lambda c, x: c.allgather(x, timeout=T)),
    "count": (lambda c, x: c.allreduce(x, timeout=T), lambda c, x: c.allreduce(np.concatenate([x, x]), timeout=T)),
    "dtype": (lambda c, x: c.allreduce(x, timeout=T), lambda c, x: c.allreduce(x.view(np.int32), timeout=T)),
    "op": (lambda c, x: c.allreduce(x, "max", timeout=T), lambda c, x: c.allreduce(x, "sum", timeout=T)),
    "root": (lambda c, x: c.reduce(x, root=0, timeout=T), lambda c, x: c.reduce(x, root=1, timeout=T)),
    "algorithm": (lambda c, x: c.allreduce(x, algorithm="ring", timeout=T),
                  lambda c, x: c.allreduce(x, algorithm="recursive_doubling", timeout=T)),
}
T = 0.6


def _mismatch_body(kind):
    first, other = MISMATCHES[kind]

    def body(comm):
        rng = np.random.default_rng(comm.rank)
        x = rng.standard_normal(12).astype(np.float32)
        call = first if comm.rank == 0 else other
        try:
            result = call(comm, x)
        except ck.CommTimeout as exc:
            return ("timeout", str(exc))
        return ("done", result)

    return body


@pytest.mark.parametrize("kind", sorted(MISMATCHES))
@pytest.mark.parametrize("size", [2, 3, 5, 8])
def test_mismatch_never_completes_with_a_wrong_answer_on_threads(kind, size):
    outcomes = ck.run_local(_mismatch_body(kind), size)
    # Rank 0's call differs from every other rank's: it can never complete.
    assert outcomes[0][0] == "timeout", outcomes[0]
    assert "timed out" in outcomes[0][1] and "Recent calls on this rank" in outcomes[0][1]
    for rank, (state, value) in enumerate(outcomes):
        # The only calls that may complete are the ones that produce nothing: a non-root of a
        # reduce only sends. Everything that returns data must have waited instead.
        assert state == "timeout" or value is None, (kind, size, rank, state, value)
    if kind == "root":
        assert outcomes[1][0] == "timeout"  # rank 1 believes it is the root and waits for data


def test_watchdog_report_names_the_first_divergent_call(monkeypatch, capsys):
    monkeypatch.setenv("COMMKIT_WATCHDOG", "0.2")

    def body(comm):
        x = np.arange(6, dtype=np.float64)
        comm.allreduce(x)  # call #0 agrees
        comm.barrier()     # call #1 agrees
        try:
            if comm.rank == 1:
                comm.broadcast(x, root=1, timeout=2.0)  # the root only sends: it completes
                comm.barrier(timeout=2.0)
            else:
                comm.allreduce(x, timeout=2.0)
        except ck.CommTimeout:
            pass
        return comm.flight_record()

    records = ck.run_local(body, 3)
    err = capsys.readouterr().err
    reports = watchdog.read_reports([err])
    assert {r["rank"] for r in reports} == {0, 1, 2}  # each stuck rank reported, once
    assert len(reports) == 3
    assert "has made no progress" in err and "waiting for rank(s)" in err
    verdict = watchdog.diagnose(reports)
    assert "DIVERGED at call #2" in verdict
    assert "broadcast(count=6, dtype=float64, root=1)" in verdict
    assert "allreduce(count=6, dtype=float64, op=sum)" in verdict
    # The flight recorder kept the calls with their outcomes.
    assert [c["collective"] for c in records[0]] == ["allreduce", "barrier", "allreduce"]
    assert [c["state"] for c in records[0]] == ["done", "done", "timed out"]


def test_watchdog_off_writes_nothing(monkeypatch, capsys):
    monkeypatch.setenv("COMMKIT_WATCHDOG", "0")

    def body(comm):
        if comm.rank == 0:
            with pytest.raises(ck.CommTimeout):
                comm.allreduce(np.ones(3), timeout=0.5)

    ck.run_local(body, 2)
    assert watchdog.MARKER not in capsys.readouterr().err


def test_dump_flight_records_and_doctor_cli(tmp_path, capsys):
    comms = ck.local_world(1)
    comms[0].allreduce(np.ones(2))
    path = tmp_path / "dump.txt"
    with open(path, "w") as f:
        reports = ck.dump_flight_records(f)
    assert any(r["calls"] and r["calls"][-1]["collective"] == "allreduce" for r in reports)
    from commkit.cli import main

    assert main(["doctor", str(path)]) == 0
    assert "communicator world" in capsys.readouterr().out
    assert main(["doctor", str(tmp_path / "missing.log")]) == 2


def test_truncated_message_names_the_call_the_step_and_the_peer():
    world = LocalWorld(2)
    chans = [LocalTransport(world, r) for r in range(2)]
    big, small = np.arange(8.0), np.empty(4)
    chans[1].post([(0, big)], [], 7)
    steps = [Exchange(1, ("in", 0, 4), 1, ("out", 0, 4))]
    with pytest.raises(ck.InvalidBuffer) as info:
        run_schedule(iter(steps), {"in": small.copy(), "out": small}, chans[0], 7, 1.0,
                     CallInfo("allreduce", "ring", 41, 0))
    text = str(info.value)
    assert "rank 0 in allreduce #41 (algorithm 'ring') at step 0" in text
    assert "64 bytes from rank 1" in text and "32 bytes" in text
    assert "disagree about this call's element count or dtype" in text


# -- bad input, caught before anything is sent ------------------------------------------------------


def test_partial_overlap_is_refused_and_exact_alias_is_in_place():
    def body(comm):
        buf = np.arange(20, dtype=np.float64) + comm.rank
        with pytest.raises(ck.InvalidBuffer, match="overlaps its input without being the same memory"):
            comm.allreduce(buf[0:10], out=buf[5:15])
        with pytest.raises(ck.InvalidBuffer, match="overlaps"):
            comm.broadcast(buf[0:10], out=buf[2:12])
        with pytest.raises(ck.InvalidBuffer, match="overlaps"):
            comm.allgather(buf[0:5], out=buf[:10].reshape(2, 5))
        x = buf[:10]
        comm.allreduce(x, out=x)
        return x

    a, b = ck.run_local(body, 2)
    np.testing.assert_array_equal(a, 2 * np.arange(10) + 1)
    np.testing.assert_array_equal(a, b)


@pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")
def test_ndarray_subclasses_are_converted_or_refused_before_sending():
    def body(comm):
        m = np.matrix([[1.0, 2.0], [3.0, 4.0]]) * (comm.rank + 1)
        total = comm.allreduce(m)
        masked = np.ma.masked_array(np.ones(3), mask=[0, 1, 0])
        with pytest.raises(ck.InvalidBuffer, match="masked array"):
            comm.allreduce(masked)
        with pytest.raises(ck.InvalidBuffer, match="masked array"):
            comm.allreduce(np.ones(3), out=masked)
        return np.asarray(total)

    a, b = ck.run_local(body, 2)
    np.testing.assert_array_equal(a, [[3.0, 6.0], [9.0, 12.0]])
    np.testing.assert_array_equal(a, b)


def test_root_only_error_cannot_shift_later_calls():
    def body(comm):
        if comm.rank == 0:
            with pytest.raises(ck.InvalidBuffer):
                comm.scatter(np.ones((comm.size + 1, 2)), root=0)  # wrong shape: raised on the root only
            return comm.broadcast(np.full(2, 7.0), root=0, timeout=T)
        try:
            return comm.scatter(None, root=0, out=np.empty(2), timeout=T)
        except ck.CommTimeout:
            return "timeout"

    outcomes = ck.run_local(body, 3)
    assert outcomes[1:] == ["timeout", "timeout"]  # never the broadcast's data


def test_too_many_outstanding_requests_is_an_error_not_a_wrapped_tag():
    def body(comm):
        limit = comm._layout.max_in_flight
        if comm.rank == 1:
            comm.recv(0, shape=1, dtype=np.int64)  # rank 0's requests cannot complete before this
        requests = [comm.iallreduce(np.ones(1)) for _ in range(limit)]
        if comm.rank == 0:
            with pytest.raises(ck.InvalidArgument, match="outstanding on this communicator"):
                comm.iallreduce(np.ones(1))
            comm.send(np.zeros(1, np.int64), 1)
        return float(sum(r.wait()[0] for r in requests)), limit

    (total, limit), _ = ck.run_local(body, 2)
    assert total == 2.0 * limit


# -- progress: nonblocking collectives move while the rank is anywhere in commkit -----------------------


@pytest.mark.parametrize("size", [2, 3, 4])
def test_waiting_on_two_requests_in_opposite_orders_completes(size):
    def body(comm):
        a = comm.iallreduce(np.full(5, comm.rank, np.int64), algorithm="ring")
        b = comm.iallgather(np.array([comm.rank]), algorithm="ring")
        if comm.rank % 2:
            gathered, total = b.wait(timeout=10), a.wait(timeout=10)
        else:
            total, gathered = a.wait(timeout=10), b.wait(timeout=10)
        blocking = comm.allreduce(np.ones(1))  # a blocking call with nothing outstanding
        return total.tolist(), gathered.ravel().tolist(), blocking.tolist()

    for total, gathered, blocking in ck.run_local(body, size):
        assert total == [sum(range(size))] * 5
        assert gathered == list(range(size))
        assert blocking == [size]


def test_blocking_call_drives_outstanding_requests():
    def body(comm):
        req = comm.iallreduce(np.full(3, comm.rank + 1.0), algorithm="ring")
        if comm.rank == 0:
            comm.send(np.arange(4.0), 1)          # drives req while it waits
            value = comm.allreduce(np.ones(1))    # a blocking collective with one outstanding
        else:
            first = req.wait(timeout=10)           # needs rank 0's next step of req
            got = comm.recv(0, shape=4, dtype=np.float64)
            value = comm.allreduce(np.ones(1))
            assert got.tolist() == [0, 1, 2, 3] and first.tolist() == [3, 3, 3]
        return req.wait(timeout=10).tolist(), value.tolist()

    assert ck.run_local(body, 2) == [([3.0] * 3, [2.0])] * 2


def test_spinning_on_test_completes():
    def body(comm):
        req = comm.iallreduce(np.full(64, comm.rank, np.float64), algorithm="ring")
        while not req.test():
            pass
        return req.wait()[0]

    assert ck.run_local(body, 4) == [6.0] * 4


# -- under mpiexec ---------------------------------------------------------------------------------------

_MPI_MISMATCH = """
import sys, time
import numpy as np
import commkit as ck
c = ck.init()
T = 1.5
kinds = sys.argv[1].split(",")
x = np.random.default_rng(c.rank).standard_normal(12).astype(np.float32)
# A communicator of its own for each mismatch, made before any: what one leaves behind (messages no call will
# receive, a broken communicator) stays there, kept to the end of the job.
comms = {kind: c.dup() for kind in kinds}
for kind in kinds:
    d = comms[kind]
    for _ in range(int(sys.argv[2])):  # calls before the mismatch, on its communicator
        d.allreduce(np.ones(1, np.float32), algorithm="recursive_doubling")
    calls = {
        "collective": (lambda: d.allreduce(x, timeout=T), lambda: d.allgather(x, timeout=T)),
        "count": (lambda: d.allreduce(x, timeout=T), lambda: d.allreduce(np.concatenate([x, x]), timeout=T)),
        "dtype": (lambda: d.allreduce(x, timeout=T), lambda: d.allreduce(x.view(np.int32), timeout=T)),
        "op": (lambda: d.allreduce(x, "max", timeout=T), lambda: d.allreduce(x, "sum", timeout=T)),
        "root": (lambda: d.reduce(x, root=0, timeout=T), lambda: d.reduce(x, root=1, timeout=T)),
        "algorithm": (lambda: d.allreduce(x, algorithm="ring", timeout=T),
                      lambda: d.allreduce(x, algorithm="recursive_doubling", timeout=T)),
    }[kind]
    try:
        result = (calls[0] if c.rank == 0 else calls[1])()
        print(f"<{kind}> rank {c.rank}: COMPLETED {'nothing' if result is None else 'data'}", flush=True)
    except ck.CommTimeout as exc:
        assert "Recent calls on this rank" in str(exc), exc
        print(f"<{kind}> rank {c.rank}: TIMEOUT", flush=True)
"""


def _run_plain(nprocs: int, code: str, env: dict):
    """``mpiexec -n N python script.py``, as a user runs it (not under ``python -m mpi4py``)."""
    import tempfile

    from commkit._mpiexec import run_job

    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(textwrap.dedent(code))
    full_env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    full_env.update(env)
    full_env = {k: v for k, v in full_env.items() if v != ""}
    try:
        return run_job(nprocs, [sys.executable, f.name], timeout=60, env=full_env)
    finally:
        os.unlink(f.name)


def _outcomes(stdout: str, kind: str = r"\w+") -> list:
    # mpiexec may interleave the ranks' lines: find each rank's verdict wherever it is (of one mismatch's kind).
    return sorted(re.findall(rf"<{kind}> (rank \d+: (?:TIMEOUT|COMPLETED \w+))", stdout))


_KINDS = ["collective", "count", "dtype", "op", "algorithm", "root"]


@requires_mpi
@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 3, 4])
def test_mismatch_under_mpiexec_never_completes(nprocs):
    # One job for all six kinds, each mismatch on a communicator of its own (a job for each spent most of its time
    # starting its ranks).
    result = run_mpi(nprocs, _MPI_MISMATCH, args=(",".join(_KINDS), 0), timeout=120)
    for kind in _KINDS:
        lines = _outcomes(result.stdout, kind)
        assert len(lines) == nprocs, (kind, result.stdout, result.stderr)
        assert lines[0] == "rank 0: TIMEOUT", (kind, lines)
        assert not any(line.endswith("COMPLETED data") for line in lines), (kind, lines)


# Mismatches on 2 ranks at the sizes where MPI's own collective (native) is fastest, made with the
# DEFAULT choice: MPI's messages carry no call identity, so had the default picked native for them,
# the ranks would complete with different answers (sum on one, max on the other), another rank's
# data in a root's buffer, or a short message's tail left as it was -- MPICH does all three.
_MPI_DEFAULT_MISMATCH = """
import sys
import numpy as np
import commkit as ck
c = ck.init()
T = 1.5
r = c.rank
kind = sys.argv[1]
x = np.random.default_rng(r).integers(-1000, 1000, 16).astype(np.int64)
calls = {
    "allreduce op": lambda: c.allreduce(x[:1], "sum" if r == 0 else "max", timeout=T),
    "reduce op": lambda: c.reduce(x[:4], "sum" if r == 0 else "max", root=0, timeout=T),
    "broadcast root": lambda: c.broadcast(x[:4], root=r, timeout=T),
    "broadcast count": lambda: c.broadcast(x[:4 + 4 * r], root=0, timeout=T),
    "allgather count": lambda: c.allgather(x[:1 + r], timeout=T),
    "reduce_scatter count": lambda: c.reduce_scatter(x[:2 + 2 * r], timeout=T),
}
mine = x[:4] if kind == "broadcast root" else x[:4 + 4 * r]
try:
    result = calls[kind]()
    own = result is not None and kind.startswith("broadcast") and np.array_equal(result, mine)
    verdict = "COMPLETED " + ("nothing" if result is None else "own" if own else "data")
except ck.CommTimeout as exc:
    assert "Recent calls on this rank" in str(exc), exc
    verdict = "TIMEOUT"
print(f"rank {r}: {verdict} ({c.last_algorithm})", flush=True)
if kind == "broadcast root":
    # Both ranks were roots: nothing was received, so nothing of that call may reach the next one.
    y = c.broadcast(np.full(4, 7 + r, np.int64), root=0, timeout=T)
    print(f"rank {r}: next broadcast {y.tolist()}", flush=True)
"""

# What each rank may do, per kind: a rank whose part of the call only sends (the non-root of a
# reduce, a broadcast's root) completes without receiving; every rank that receives waits.
_DEFAULT_MISMATCH_OUTCOMES = {
    "allreduce op": ["rank 0: TIMEOUT", "rank 1: TIMEOUT"],
    "reduce op": ["rank 0: TIMEOUT", "rank 1: COMPLETED nothing"],
    "broadcast root": ["rank 0: COMPLETED own", "rank 1: COMPLETED own"],
    "broadcast count": ["rank 0: COMPLETED own", "rank 1: TIMEOUT"],
    "allgather count": ["rank 0: TIMEOUT", "rank 1: TIMEOUT"],
    "reduce_scatter count": ["rank 0: TIMEOUT", "rank 1: TIMEOUT"],
}
_AUTO = {"COMMKIT_TUNING": "", **{f"COMMKIT_{c.upper()}_ALGORITHM": "auto" for c in
                                  ("allreduce", "reduce", "broadcast", "allgather", "reduce_scatter")}}


@requires_mpi
@pytest.mark.mpi
@pytest.mark.parametrize("kind", sorted(_DEFAULT_MISMATCH_OUTCOMES))
def test_default_choice_waits_on_a_mismatch_where_native_would_complete(kind):
    result = run_mpi(2, _MPI_DEFAULT_MISMATCH, args=(kind,), env=_AUTO, timeout=60)
    found = sorted(re.findall(r"rank \d+: (?:TIMEOUT|COMPLETED \w+) \((\w+)\)", result.stdout))
    lines = sorted(re.findall(r"rank \d+: (?:TIMEOUT|COMPLETED \w+)", result.stdout))
    assert lines == _DEFAULT_MISMATCH_OUTCOMES[kind], (kind, result.stdout, result.stderr)
    assert "native" not in found, (kind, result.stdout)
    if kind == "broadcast root":
        assert result.stdout.count("next broadcast [7, 7, 7, 7]") == 2, result.stdout


def test_default_choice_for_the_mismatch_tests_is_not_native(monkeypatch):
    # The promise holds for commkit's own algorithms only: a call that asks for native gets it, and
    # MPI's collective, whose messages carry no identity, is the library's to match.
    for var in _AUTO:
        monkeypatch.delenv(var, raising=False)
    shapes = [("allreduce", 8, "sum"), ("reduce", 32, "max"), ("broadcast", 32, None),
              ("allgather", 16, None), ("reduce_scatter", 32, "sum")]
    for collective, nbytes, op in shapes:
        for size in (1, 2, 3, 4):
            for n in (0, nbytes, 1 << 12, 1 << 16, 1 << 20):
                choice = selection.select(collective, size, n, op, native_ok=True)
                assert choice.algorithm.name != "native", (collective, size, n, choice)
        forced = selection.select(collective, 2, nbytes, op, requested="native", native_ok=True)
        assert forced.algorithm.name == "native" and forced.reason == "forced by algorithm= argument"


@requires_mpi
@pytest.mark.mpi
def test_mismatch_after_70000_calls_is_caught():
    # Past the old tag wrap (32,768 calls) and many wraps of the 10-bit call number.
    result = run_mpi(2, _MPI_MISMATCH, args=("dtype", 70_000), timeout=120)
    assert _outcomes(result.stdout) == ["rank 0: TIMEOUT", "rank 1: TIMEOUT"], result.stdout + result.stderr


@requires_mpi
@pytest.mark.mpi
def test_issue_script_reports_on_both_ranks_and_doctor_finds_the_divergence(tmp_path):
    code = """
    import numpy as np, commkit
    c = commkit.init(); x = np.ones(10)
    if c.rank == 0: c.allreduce(x)
    else: c.broadcast(x, root=1)
    print(f"returned {c.rank}", flush=True)
    """
    # The watchdog reports after 0.5 s and the waiting goes on; the timeout (3 s) then ends the job.
    result = _run_plain(2, code, {"COMMKIT_WATCHDOG": "0.5", "COMMKIT_TIMEOUT": "3"})
    assert result.returncode != 0
    assert "CommTimeout" in result.stderr
    assert "returned 0" not in result.stdout  # rank 0's allreduce never completes with rank 1's data
    reports = watchdog.read_reports([result.stderr])
    assert {r["rank"] for r in reports} == {0, 1}, result.stderr
    verdict = watchdog.diagnose(reports)
    assert "DIVERGED at call #0" in verdict and "broadcast" in verdict and "allreduce" in verdict
    log = tmp_path / "job.log"
    log.write_text(result.stderr)
    from commkit.cli import main

    assert main(["doctor", str(log)]) == 0


@requires_mpi
@pytest.mark.mpi
def test_mpi_silent_failures_are_loud():
    code = """
    import gc
    import numpy as np
    import commkit as ck
    from mpi4py import MPI
    c = ck.init()
    # isend of a copy commkit made, request dropped: the message still arrives intact.
    big = np.arange(2 * (8 << 20), dtype=np.float32)
    if c.rank == 0:
        c.isend(big[::2], 1)
        gc.collect()
        junk = [np.full(8 << 20, -1.0, np.float32) for _ in range(4)]
    else:
        got = c.recv(0, shape=8 << 20, dtype=np.float32)
        assert np.array_equal(got, big[::2]), "isend from a dropped request arrived damaged"
    # A receive buffer that is too small: commkit's error, naming sizes, with and without a timeout.
    for timeout in (None, 5.0):
        if c.rank == 0:
            c.send(np.arange(8.0), 1, tag=3)
        else:
            try:
                c.recv(0, tag=3, out=np.empty(4), timeout=timeout)
                raise SystemExit("a truncated message was accepted")
            except ck.MessageTruncated as exc:
                assert "32 bytes" in str(exc), exc
    # recv() of a message sent with send_object is refused, not handed over as pickle bytes.
    if c.rank == 0:
        c.send_object({"a": 1}, 1, tag=4)
    else:
        try:
            c.recv(0, tag=ck.ANY_TAG, out=np.empty(1000, np.uint8))
            raise SystemExit("recv accepted a pickled object")
        except ck.InvalidBuffer as exc:
            assert "send_object" in str(exc), exc
    # Communicators dropped without free() are released: far more dups than MPICH's 2048 contexts.
    for i in range(1500):
        d = c.dup()
        d.allreduce(np.ones(1))
    c.barrier()
    print(f"ok {c.rank}", flush=True)
    """
    result = run_mpi(2, code, timeout=120)
    assert sorted(re.findall(r"ok \d", result.stdout)) == ["ok 0", "ok 1"], result.stdout


@requires_mpi
@pytest.mark.mpi
def test_sys_exit_of_one_rank_ends_the_job():
    code = """
    import sys, numpy as np, commkit as ck
    c = ck.init()
    if c.rank == 1:
        sys.exit(2)
    c.allreduce(np.ones(4))
    """
    start = time.monotonic()
    result = _run_plain(3, code, {"COMMKIT_TIMEOUT": ""})
    assert result.returncode != 0
    assert time.monotonic() - start < 30
    assert "called sys.exit(2)" in result.stderr


# -- issue 15: in check mode a local argument error reaches every rank ------------------------------


def _one_rank_rejects(c, bad_rank):
    """Each collective once with a bad output on ``bad_rank``; then a good call. Returns what each call raised."""
    from commkit.errors import CommError

    x = np.arange(4.0)
    p = c.size

    def out(n):
        return np.empty(n - 1 if c.rank == bad_rank else n)

    calls = {
        "allreduce": lambda: c.allreduce(x, out=out(4)),
        "broadcast": lambda: c.broadcast(x, root=0, out=out(4)),
        "allgather": lambda: c.allgather(x, out=np.empty((p, 3 if c.rank == bad_rank else 4))),
        "alltoall": lambda: c.alltoall(np.arange(2.0 * p).reshape(p, 2),
                                       out=np.empty((p, 1 if c.rank == bad_rank else 2))),
        "allgatherv": lambda: c.allgatherv(x, counts=[4] * p, out=out(4 * p)),
        "ireduce": lambda: c.ireduce(x, op="sum", root=0, out=out(4)).wait(),
    }
    seen = {}
    for name, call in calls.items():
        try:
            call()
            seen[name] = "completed"
        except CommError as exc:
            seen[name] = (type(exc).__name__, str(exc))
    seen["after"] = c.allreduce(x).tolist()  # the call numbers still agree: later calls match
    return seen


@pytest.mark.parametrize("size", [2, 3, 5])
def test_check_mode_turns_one_ranks_argument_error_into_an_error_on_every_rank(size):
    bad = size - 1
    results = ck.run_local(_one_rank_rejects, size, bad, check=True, timeout=30)
    for rank, seen in enumerate(results):
        assert seen.pop("after") == (np.arange(4.0) * size).tolist()
        for name, outcome in seen.items():
            assert outcome != "completed", (rank, name)
            kind, message = outcome
            if rank == bad:
                assert kind == "InvalidBuffer", (name, message)  # its own error, unchanged
            else:
                assert kind == "PeerFailed", (rank, name, message)
                assert f"rank(s) [{bad}] rejected their arguments" in message, message
                assert "InvalidBuffer" in message and "shape" in message, message


def test_without_check_mode_nothing_is_announced():
    # The failing rank raises alone and uses no call number: a caught error costs the others nothing
    # when they, too, skip the call (here: everyone checks its own arguments and all fail alike).
    def body(c):
        from commkit.errors import InvalidBuffer

        with pytest.raises(InvalidBuffer):
            c.allreduce(np.arange(4.0), out=np.empty(3))
        return c.allreduce(np.arange(4.0)).tolist()

    assert ck.run_local(body, 3, check=False, timeout=30) == [[0.0, 3.0, 6.0, 9.0]] * 3


_FACE_ANNOUNCES = """
import numpy as np
from mpi4py import MPI
from commkit.compat.mpi4py import wrap
from commkit.errors import CommError

comm = wrap(MPI.COMM_WORLD, check=True, timeout=30)
r, p = comm.Get_rank(), comm.Get_size()
bad = p - 1
x, out = np.arange(4.0), np.empty(4)
calls = [
    ("Allreduce", lambda: comm.Allreduce([x, 9 if r == bad else 4, MPI.DOUBLE], out, op=MPI.SUM)),
    ("Bcast", lambda: comm.Bcast([out, 9 if r == bad else 4, MPI.DOUBLE], root=0)),
    ("Allgatherv", lambda: comm.Allgatherv(x, [np.empty(3 if r == bad else 4 * p), [4] * p, None, MPI.DOUBLE])),
]
for name, call in calls:
    try:
        call()
        print(f"rank {r}: {name} COMPLETED", flush=True)
    except CommError as exc:
        print(f"rank {r}: {name} {type(exc).__name__}: {exc}", flush=True)
comm.Allreduce(x, out, op=MPI.SUM)
print(f"rank {r}: after {out.tolist()}", flush=True)
"""


@requires_mpi
@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 3])
def test_face_argument_error_on_one_rank_raises_on_every_rank_in_check_mode(nprocs):
    result = run_mpi(nprocs, _FACE_ANNOUNCES, timeout=90)
    out = result.stdout
    bad = nprocs - 1
    for name in ("Allreduce", "Bcast", "Allgatherv"):
        assert f"rank {bad}: {name} InvalidBuffer" in out, out
        for rank in range(bad):
            assert re.search(rf"rank {rank}: {name} PeerFailed: {name} call #\d+ was abandoned on every rank: "
                             rf"rank\(s\) \[{bad}\]", out), out
    assert "COMPLETED" not in out, out
    assert out.count(f"after {(np.arange(4.0) * nprocs).tolist()}") == nprocs, out


_FACE_UNCAUGHT = """
import time
import numpy as np
from mpi4py import MPI
from commkit.compat.mpi4py import wrap

comm = wrap(MPI.COMM_WORLD)
x, out = np.arange(4.0), np.empty(4)
ro = np.empty(4)
ro.flags.writeable = False
start = time.monotonic()
comm.Allreduce(x, ro if comm.Get_rank() == 1 else out, op=MPI.SUM)  # rank 1 raises, uncaught
print(f"rank {comm.Get_rank()}: COMPLETED after {time.monotonic() - start:.1f} s", flush=True)
"""


@requires_mpi
@pytest.mark.mpi
def test_an_uncaught_face_error_ends_the_job_instead_of_leaving_the_others_waiting():
    # Plain `mpiexec -n 2 python prog.py`, as an mpi4py user runs it (not `python -m mpi4py`).
    start = time.monotonic()
    result = _run_plain(2, _FACE_UNCAUGHT, {"COMMKIT_WATCHDOG": "0", "COMMKIT_TIMEOUT": ""})
    assert time.monotonic() - start < 45, "the job waited"
    assert result.returncode != 0
    assert "InvalidBuffer" in result.stderr and "aborting the MPI job" in result.stderr, result.stderr
    assert "COMPLETED" not in result.stdout
