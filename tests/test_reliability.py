"""Failure modes: timeouts with a diagnosis, mismatched collectives, failing ranks, bad input, no data lost."""

from __future__ import annotations

import re
import threading
import time

import numpy as np
import pytest
from hypothesis import given, strategies as st

import commkit as ck

from conftest import mpi_segments, requires_mpi, run_mpi, segments_left

# -- timeouts -----------------------------------------------------------------------------


def test_timeout_names_rank_collective_algorithm_step_and_peer():
    def body(comm):
        if comm.rank == 2:
            return None  # never joins the allreduce
        with pytest.raises(ck.CommTimeout) as info:
            comm.allreduce(np.ones(8), algorithm="ring", timeout=0.3)
        return str(info.value)

    messages = ck.run_local(body, 3)
    assert re.search(r"rank 0 timed out after 0.3 s in allreduce #0 \(algorithm 'ring'\) at step \d+", messages[0])
    assert "waiting for rank(s) 2" in messages[0]  # rank 0's left neighbour in the ring
    assert "rank 1" in messages[1]


def test_communicator_default_timeout_and_env(monkeypatch):
    monkeypatch.setenv("COMMKIT_TIMEOUT", "0.2")

    def body(comm):
        assert comm.timeout == 0.2
        if comm.rank == 0:
            with pytest.raises(ck.CommTimeout, match="recv from rank 1 timed out after 0.2 s"):
                comm.recv(1, shape=1, dtype=int)
            with pytest.raises(ck.CommTimeout, match="broadcast #0"):
                comm.broadcast(np.ones(2), root=1)
            # A collective that timed out leaves the communicator broken (a late message
            # must not land in a later call); dup() gives a fresh one.
            with pytest.raises(ck.CommBroken, match="broadcast #0 timed out"):
                comm.barrier()
            fresh = comm.dup()
            with pytest.raises(ck.CommTimeout, match=r"wait\(\)|barrier"):
                fresh.ibarrier().wait(0.1)

    ck.run_local(body, 2)
    with pytest.raises(ck.InvalidArgument, match="timeout must be a positive number"):
        ck.init("local", timeout=-1)


def test_nonblocking_wait_timeout_reports_the_step():
    def body(comm):
        if comm.rank == 0:
            req = comm.iallgather(np.ones(3), algorithm="ring")
            with pytest.raises(ck.CommTimeout, match=r"allgather #0 \(algorithm 'ring'\) at step 1"):
                req.wait(timeout=0.2)

    ck.run_local(body, 2)


# -- mismatched collectives ---------------------------------------------------------------------


def test_debug_mode_catches_mismatched_collectives():
    def body(comm):
        x = np.ones(4 if comm.rank != 1 else 5)
        with pytest.raises(ck.CollectiveMismatch) as info:
            comm.allreduce(x)
        text = str(info.value)
        assert "count: 4 on ranks [0, 2]; 5 on ranks [1]" in text
        with pytest.raises(ck.CollectiveMismatch, match=r"collective: 'allreduce' on ranks \[0\]; 'broadcast' on ranks \[1, 2\]"):
            if comm.rank == 0:
                comm.allreduce(np.ones(2))
            else:
                comm.broadcast(np.ones(2))
        with pytest.raises(ck.CollectiveMismatch, match=r"op: 'max' on ranks \[0\]; 'sum' on ranks \[1, 2\]"):
            comm.allreduce(np.ones(2), op="sum" if comm.rank else "max")
        with pytest.raises(ck.CollectiveMismatch, match="dtype"):
            comm.allreduce(np.ones(2, np.float32 if comm.rank else np.float64))
        # Agreeing calls still work in check mode.
        return comm.allreduce(np.full(3, comm.rank))

    results = ck.run_local(body, 3, check=True)
    np.testing.assert_array_equal(results[0], [3, 3, 3])


def test_debug_mode_on_three_ranks_names_every_group():
    def body(comm):
        with pytest.raises(ck.CollectiveMismatch) as info:
            comm.reduce(np.ones(2), root=comm.rank % 2)
        return str(info.value)

    text = ck.run_local(body, 3, check=True)[0]
    assert "root: 0 on ranks [0, 2]; 1 on ranks [1]" in text


def test_check_mode_from_environment(monkeypatch):
    monkeypatch.setenv("COMMKIT_DEBUG", "check")
    assert ck.run_local(lambda c: c.check, 2) == [True, True]


# -- one rank fails -----------------------------------------------------------------------------


def test_failing_thread_rank_unblocks_peers_and_is_reraised():
    seen = {}

    def body(comm):
        if comm.rank == 1:
            time.sleep(0.05)
            raise ValueError("bad data on rank 1")
        try:
            comm.allreduce(np.ones(4))
        except ck.PeerFailed as exc:
            seen[comm.rank] = str(exc)
            raise

    start = time.monotonic()
    with pytest.raises(ck.RankError, match="rank 1 failed: ValueError: bad data on rank 1") as info:
        ck.run_local(body, 4)
    assert time.monotonic() - start < 10
    assert info.value.rank == 1
    assert isinstance(info.value.__cause__, ValueError)
    assert "bad data on rank 1" in info.value.remote_traceback
    assert set(seen) == {0, 2, 3}
    assert all("rank 1 failed with ValueError" in s for s in seen.values())


RAISE_ON_ONE_RANK = """
import numpy as np
import commkit as ck
comm = ck.init()
comm.allreduce(np.ones(3))
if comm.rank == 1:
    raise RuntimeError("rank one gives up")
comm.allreduce(np.ones(3))   # the other ranks would wait here forever
"""


@requires_mpi
@pytest.mark.mpi
def test_uncaught_exception_under_mpiexec_ends_the_job(tmp_path):
    # Plain `python script.py` (not -m mpi4py): commkit.init installs the abort hook itself.
    import sys

    from commkit._mpiexec import run_job

    script = tmp_path / "fail.py"
    script.write_text(RAISE_ON_ONE_RANK)
    shm = mpi_segments()
    start = time.monotonic()
    result = run_job(3, [sys.executable, str(script)], timeout=60,
                     env={**__import__("os").environ, "PYTHONPATH": str(__import__("pathlib").Path(__file__).parents[1])})
    assert time.monotonic() - start < 30
    assert result.returncode != 0
    assert result.stderr.count("RuntimeError: rank one gives up") == 1
    assert "rank 1 raised RuntimeError" in result.stderr
    # MPI_Abort leaves the library's shared-memory segments behind; the launcher removes the job's own. The
    # job has ended, so a new segment some process still uses, or that goes within moments, is another
    # process's: an unmarked test's MPI job beside this one once failed the check (see segments_left).
    left = segments_left(shm)
    assert not left, left


SIGKILL_MID_COLLECTIVE = """
import os, signal
import numpy as np
import commkit as ck
comm = ck.init(timeout=5)
x = np.ones(1 << 16)
for i in range(1000):
    if comm.rank == 1 and i == 20:
        os.kill(os.getpid(), signal.SIGKILL)
    comm.allreduce(x, algorithm="ring")
"""


@requires_mpi
@pytest.mark.mpi
def test_rank_killed_mid_collective_survivors_exit_nonzero():
    start = time.monotonic()
    result = run_mpi(3, SIGKILL_MID_COLLECTIVE, timeout=90, check=False)
    elapsed = time.monotonic() - start
    assert result.returncode != 0
    assert elapsed < 60, f"survivors took {elapsed:.0f} s to exit"


# -- bad input ------------------------------------------------------------------------------------


def test_bad_input_is_refused_before_any_message():
    def body(comm):
        x = np.arange(6.0)
        with pytest.raises(ck.UnsupportedOp, match="op 'band' is not defined for dtype float64"):
            comm.allreduce(x, "band")
        with pytest.raises(ck.UnsupportedOp, match="unknown op 'avg'"):
            comm.allreduce(x, "avg")
        with pytest.raises(ck.InvalidBuffer, match="dtype object"):
            comm.allreduce(np.array([1, "a"], dtype=object))
        with pytest.raises(ck.InvalidBuffer, match="dtype <U1"):
            comm.allgather(np.array(["a"]))
        with pytest.raises(ck.InvalidBuffer, match="read-only"):
            out = np.empty(6)
            out.flags.writeable = False
            comm.allreduce(x, out=out)
        with pytest.raises(ck.InvalidBuffer, match="C-contiguous"):
            comm.allreduce(x, out=np.empty(12)[::2])
        with pytest.raises(ck.InvalidBuffer, match=r"alltoall's x must have shape \(2, \.\.\.\)"):
            comm.alltoall(np.ones(3))
        with pytest.raises(ck.InvalidBuffer, match="divisible by size 2"):
            comm.reduce_scatter(np.ones(3))
        with pytest.raises(ck.InvalidArgument, match="counts must sum to x.shape"):
            comm.reduce_scatter(np.ones(3), counts=[1, 1])
        with pytest.raises(ck.AlgorithmNotApplicable, match="unknown allreduce algorithm 'fastest'"):
            comm.allreduce(x, algorithm="fastest")
        with pytest.raises(ck.InvalidBuffer, match="needs out="):
            comm.scatter(None, root=(comm.rank + 1) % 2)
        # Non-contiguous *inputs* are copied, not refused.
        np.testing.assert_array_equal(comm.allreduce(np.arange(12.0)[::2]), 2 * np.arange(12.0)[::2])
        # Nothing was sent by the refused calls: both ranks' next collective lines up.
        return comm.allreduce(np.array([comm.rank]))

    assert [r.tolist() for r in ck.run_local(body, 2)] == [[1], [1]]


def _refused_on_one_rank(comm, collective):
    """``collective`` with an argument only one rank gets wrong (the rank that only receives); True where refused.

    Its peers need nothing from that rank, so they finish the call and send it
    what it was to receive.
    """
    rank, buf = comm.rank, np.arange(8.0 * comm.size + 1) + 100 * comm.rank
    x, overlapping = buf[:8], buf[1:9]
    read_only = np.empty(8)
    read_only.flags.writeable = False
    try:
        if collective == "reduce":  # the root's out overlaps its input
            comm.reduce(x, "sum", 0, out=overlapping if rank == 0 else None)
        elif collective == "gather":  # the root's out holds its input
            comm.gather(x, 0, out=buf[:8 * comm.size].reshape(comm.size, 8) if rank == 0 else None)
        elif collective == "broadcast":  # a leaf's out has the wrong shape
            comm.broadcast(x, 0, out=np.empty(5) if rank == comm.size - 1 else None)
        else:  # a leaf's out is read-only
            rows = np.arange(8.0 * comm.size).reshape(comm.size, 8) if rank == 0 else None
            comm.scatter(rows, 0, out=read_only if rank == comm.size - 1 else np.empty(8))
    except ck.InvalidBuffer:
        return True
    return False


def _later_calls(comm, collective, calls):
    """``calls`` more calls of ``collective`` with new values each; every rank's results, as lists.

    New arrays each call for the first half (the entries of new arrays), then the same arrays filled in
    place (their plans), which are the paths the calls around number 1024 take.
    """
    got = []
    rows, y_same, out_same = np.empty((comm.size, 8)), np.empty(8), np.empty(8)
    rows_in = np.empty((comm.size, 8))
    for k in range(calls):
        same = k >= calls // 2
        y = np.full(8, float(k + 1) * (comm.rank + 1))
        if same:
            y_same[:] = y
            y = y_same
        if collective == "reduce":
            r = comm.reduce(y, "sum", 0, out=out_same if same and comm.rank == 0 else None)
        elif collective == "gather":
            r = comm.gather(y, 0, out=rows if comm.rank == 0 else None)
        elif collective == "broadcast":
            r = comm.broadcast(y, 0, out=y if same else None)
        else:
            parts = y[None] * np.arange(1, comm.size + 1)[:, None]
            if same:
                rows_in[:] = parts
                parts = rows_in
            r = comm.scatter(parts if comm.rank == 0 else None, 0, out=out_same if same else np.empty(8))
        got.append(None if r is None else np.asarray(r)[..., 0].tolist())
    return got


def _expected_later(collective, size, rank, calls):
    want = []
    for k in range(calls):
        v = float(k + 1)
        if collective == "reduce":
            want.append(v * size * (size + 1) / 2 if rank == 0 else None)
        elif collective == "gather":
            want.append([v * (r + 1) for r in range(size)] if rank == 0 else None)
        elif collective == "broadcast":
            want.append(v)
        else:
            want.append(v * (rank + 1))
    return want


@pytest.mark.parametrize("collective", ["reduce", "gather", "broadcast", "scatter"])
@pytest.mark.parametrize("size", [2, 3])
def test_a_call_refused_on_one_rank_only_still_counts_there_so_later_calls_get_their_own_data(collective, size):
    # Its peers finished the refused call and sent their part. Had the refusing rank not counted the call,
    # its next call would have matched those messages and returned the refused call's data, and so on at
    # every call after (one call late, silently). The calls run past the point where call numbers come round
    # again (1024), where a message of the refused call left in the queue would be matched again.
    calls = 1100

    def body(comm):
        refused = _refused_on_one_rank(comm, collective)
        return refused, _later_calls(comm, collective, calls)

    results = ck.run_local(body, size)
    assert [refused for refused, _ in results] == [collective in ("reduce", "gather") and r == 0
                                                   or collective in ("broadcast", "scatter") and r == size - 1
                                                   for r in range(size)]
    for rank, (_, got) in enumerate(results):
        assert got == _expected_later(collective, size, rank, calls), (rank, collective)


@pytest.mark.parametrize("size", [2, 3])
def test_a_call_refused_between_calls_of_a_compiled_plan_still_counts_there(size):
    # The calls around the refused one repeat on the same arrays, so they run the plan compiled for them and
    # never the general path: the plan itself must drop what the others sent for the refused call.
    calls = 1100

    def body(comm):
        rank = comm.rank
        y, out = np.empty(8), np.empty(8)
        for k in range(5):
            y[:] = rank + 1
            comm.reduce(y, "sum", 0, out=out if rank == 0 else None)
        assert comm.last_plan("reduce") is not None
        refused = _refused_on_one_rank(comm, "reduce")
        got = []
        for k in range(calls):
            y[:] = float(k + 1) * (rank + 1)
            comm.reduce(y, "sum", 0, out=out if rank == 0 else None)
            got.append(out[0] if rank == 0 else None)
        return refused, got

    results = ck.run_local(body, size)
    assert [refused for refused, _ in results] == [True] + [False] * (size - 1)
    assert results[0][1] == [(k + 1) * size * (size + 1) / 2 for k in range(calls)]


@requires_mpi
@pytest.mark.mpi
@pytest.mark.parametrize("size, timeout", [(2, "60"), (3, "")])
def test_a_call_refused_on_one_rank_only_still_counts_there_under_mpiexec(size, timeout):
    # The same under MPI, where a peer's message of the refused call waits in the library's queue: with a
    # timeout (the timed plans) and without (the plans on the same arrays and on new ones).
    import pathlib

    code = f"""
import sys
sys.path.insert(0, {str(pathlib.Path(__file__).parent)!r})
import commkit as ck
from test_reliability import _expected_later, _later_calls, _refused_on_one_rank
comm = ck.init()
for collective in ("reduce", "gather", "broadcast", "scatter"):
    receiver = 0 if collective in ("reduce", "gather") else comm.size - 1
    assert _refused_on_one_rank(comm, collective) == (comm.rank == receiver), collective
    got = _later_calls(comm, collective, 1100)
    assert got == _expected_later(collective, comm.size, comm.rank, 1100), (comm.rank, collective)
print("ok", comm.rank)
"""
    result = run_mpi(size, code, env={"COMMKIT_TIMEOUT": timeout}, timeout=180)
    assert result.stdout.count("ok") == size, result.stdout + result.stderr


@pytest.mark.parametrize("size", [2, 3])
def test_a_persistent_request_refused_on_one_rank_still_takes_its_number_there(size):
    # Persistent requests pair across ranks by the order they were made in. Had the root's refused request
    # taken no number, its next one would have paired with the others' first, and got that one's data.
    def body(comm):
        rank = comm.rank
        buf = np.arange(9.0) + 100 * rank
        try:
            first = comm.reduce_init(buf[:8], "sum", 0, out=buf[1:9] if rank == 0 else None)
        except ck.InvalidBuffer:
            first = None
        y, out = np.full(8, 1.0 + rank), np.empty(8)
        second = comm.reduce_init(y, "sum", 0, out=out if rank == 0 else None)
        if first is not None:
            first.start()
            first.wait()
        second.start()
        second.wait()
        return first is None, out[0] if rank == 0 else None

    assert ck.run_local(body, size, timeout=30) == [(True, size * (size + 1) / 2)] + [(False, None)] * (size - 1)


def test_a_call_refused_on_one_rank_stays_dropped_through_a_long_run_of_persistent_starts():
    # Persistent starts take call numbers too: 1100 of them carry the numbers past the refused call's window,
    # and its messages, had they stayed queued, would be matched by the reduce whose number comes round to it.
    def body(comm):
        refused = _refused_on_one_rank(comm, "reduce")
        z, total = np.ones(1), np.empty(1)
        req = comm.allreduce_init(z, "sum", out=total)
        for _ in range(1100):
            req.start()
            req.wait()
        req.free()
        return refused, total[0], _later_calls(comm, "reduce", 1100)

    results = ck.run_local(body, 2, timeout=60)
    assert [r[0] for r in results] == [True, False]
    assert [r[1] for r in results] == [2.0, 2.0]
    for rank, (_, _, got) in enumerate(results):
        assert got == _expected_later("reduce", 2, rank, 1100), rank


def test_zero_size_and_scalar_arrays_work():
    def body(comm):
        empty = np.empty((0, 3), np.float32)
        assert comm.allreduce(empty).shape == (0, 3)
        assert comm.allgather(empty).shape == (comm.size, 0, 3)
        assert comm.alltoall(np.empty((comm.size, 0))).shape == (comm.size, 0)
        assert comm.broadcast(np.array(7.5) if comm.rank == 0 else np.array(0.0)).item() == 7.5
        return comm.allreduce(np.array(comm.rank)).item()

    assert ck.run_local(body, 3) == [3, 3, 3]


def test_collective_from_two_threads_on_one_communicator_is_an_error():
    entered = threading.Event()

    def body(comm):
        if comm.rank == 1:
            entered.wait(5)
            time.sleep(0.2)  # let rank 0's second thread try while the first is inside
            return comm.allreduce(np.ones(2)).tolist()
        errors = []

        def second():
            entered.wait(5)
            try:
                comm.allreduce(np.ones(2))
            except ck.ConcurrentCall as exc:
                errors.append(str(exc))

        t = threading.Thread(target=second)
        t.start()
        entered.set()
        result = comm.allreduce(np.ones(2)).tolist()  # blocks until rank 1 joins
        t.join()
        assert len(errors) == 1 and "another thread" in errors[0] and "comm.dup()" in errors[0]
        return result

    assert ck.run_local(body, 2) == [[2.0, 2.0], [2.0, 2.0]]


def test_use_after_free():
    def body(comm):
        c = comm.dup()
        c.free()
        c.free()  # idempotent
        for call in (lambda: c.allreduce(np.ones(1)), lambda: c.send(np.ones(1), 0), lambda: c.barrier(),
                     lambda: c.split(0), lambda: c.dup()):
            with pytest.raises(ck.CommClosed, match="freed"):
                call()

    ck.run_local(body, 2)


# -- nothing lost ----------------------------------------------------------------------------------


@given(size=st.integers(2, 6), seed=st.integers(0, 2**31), n=st.integers(0, 33))
def test_inputs_are_bit_identical_after_every_out_of_place_call(size, seed, n):
    def body(comm):
        rng = np.random.default_rng([seed, comm.rank])
        x = rng.standard_normal(n).astype(np.float32)
        x.flat[:1] = np.nan  # NaN payloads must survive untouched too
        rows = rng.standard_normal((comm.size, 2))
        snapshot = x.tobytes(), rows.tobytes()
        comm.allreduce(x)
        comm.allreduce(x, "max", algorithm="rabenseifner")
        comm.scan(x)
        comm.exscan(x, algorithm="naive")
        comm.reduce(x, root=comm.size - 1)
        comm.allgather(x, algorithm="bruck")
        comm.alltoall(rows, algorithm="bruck")
        comm.reduce_scatter(rows, algorithm="recursive_halving")
        comm.gather(rows, root=1)
        assert (x.tobytes(), rows.tobytes()) == snapshot

    ck.run_local(body, size)


LOAD = """
import numpy as np
import commkit as ck
comm = ck.init(timeout=60)
p, r = comm.size, comm.rank
rng = np.random.default_rng(12345)        # the same schedule of calls on every rank
calls = 0
for i in range(int(__import__("sys").argv[1])):
    kind = rng.integers(0, 6)
    n = int(rng.choice([0, 1, 3, 17, 256, 4099, 65536]))
    mine = np.random.default_rng([i, r]).integers(-1000, 1000, size=n)
    every = [np.random.default_rng([i, q]).integers(-1000, 1000, size=n) for q in range(p)]
    if kind == 0:
        got, want = comm.allreduce(mine), np.sum(every, axis=0)
    elif kind == 1:
        root = int(rng.integers(0, p))
        got, want = comm.broadcast(mine, root), every[root]
    elif kind == 2:
        got, want = comm.allgather(mine), np.stack(every)
    elif kind == 3:
        got, want = comm.scan(mine), np.sum(every[: r + 1], axis=0)
    elif kind == 4:
        shift = int(rng.integers(1, p))
        got = comm.sendrecv(mine, (r + shift) % p, (r - shift) % p, sendtag=i % 1000, recvtag=i % 1000)
        want = every[(r - shift) % p]
    else:
        blocks = np.tile(mine[: n // p * p].reshape(p, -1) if n >= p else np.zeros((p, 0), int), 1)
        got = comm.reduce_scatter(blocks)
        want = np.sum([e[: n // p * p].reshape(p, -1) if n >= p else np.zeros((p, 0), int) for e in every], axis=0)[r:r + 1]
    assert np.array_equal(got, want), (i, kind, n)
    calls += 1
comm.barrier()
import sys
sys.stdout.write(f"rank {r} checked {calls}\\n")
"""


@requires_mpi
@pytest.mark.mpi
@pytest.mark.slow
def test_load_ten_thousand_mixed_calls_on_four_ranks():
    result = run_mpi(4, LOAD, args=[10000], timeout=900)
    assert result.stdout.count("checked 10000") == 4


LARGE = """
import numpy as np
import commkit as ck
comm = ck.init(timeout=600)
n = 2**31 + 11          # more elements (and bytes) than a 32-bit count can say
peer = 1 - comm.rank
x = np.empty(n, np.int8)
x[:] = 1 + comm.rank
x[-7:] = np.arange(7, dtype=np.int8)
if comm.rank == 0:
    comm.send(x, 1)
else:
    got = comm.recv(0, out=np.empty(n, np.int8))
    assert got[0] == 1 and got[n // 2] == 1 and got[-7:].tolist() == list(range(7)), got[-8:]
    del got
y = comm.allreduce(x, algorithm="ring", out=x)
assert y[0] == 3 and y[n - 8] == 3 and y[-7:].tolist() == [2 * k for k in range(7)], y[-8:]
import sys
sys.stdout.write(f"rank {comm.rank} large ok\\n")
"""


@requires_mpi
@pytest.mark.mpi
@pytest.mark.slow
def test_messages_above_two_to_the_31_elements():
    result = run_mpi(2, LARGE, timeout=600)
    assert result.stdout.count("large ok") == 2


_BIG_OBJECTS = """
import numpy as np
import commkit as ck

c = ck.init()
# 800 KB pickles go by rendezvous: ranks that all sent before receiving used to wait forever.
got = c.allgather_object(np.full(100_000, c.rank, dtype=np.float64))
assert [int(a[0]) for a in got] == list(range(c.size)), got
print(f"rank {c.rank}: OK", flush=True)
"""


@requires_mpi
@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 3])
def test_allgather_object_of_large_objects_completes(nprocs):
    result = run_mpi(nprocs, _BIG_OBJECTS, timeout=60)
    assert result.stdout.count("OK") == nprocs, result.stdout


# -- a nonblocking collective that failed stays failed ------------------------------------------------------------


def test_a_failed_nonblocking_request_raises_again_and_never_completes():
    """A transport error ends a nonblocking run; waiting again must not return a half-computed result."""
    from commkit.errors import InvalidBuffer
    from commkit.schedule import CallInfo, Exchange, ScheduleRun

    class Pending:
        def __init__(self):
            self.polls = 0

        def test(self):
            self.polls += 1
            return self.polls > 1  # in flight when the request is made, complete at the next poll

        def wait(self, timeout):
            return []

    class RefusesTheSecondPost:
        posts = 0

        def post(self, sends, recvs, tag):
            self.posts += 1
            if self.posts == 2:
                raise InvalidBuffer("the transport refused this message")
            return Pending()

        def transfer(self, sends, recvs, tag, timeout):
            raise AssertionError("a nonblocking run posts every transfer")

    steps = [Exchange(0, ("out", 0, 2), 0, ("tmp", 0, 2)), Exchange(0, ("out", 2, 4), 0, ("tmp", 2, 4))]
    bufs = {"out": np.zeros(4), "tmp": np.zeros(4)}
    finished = []
    req = ScheduleRun(iter(steps), bufs, RefusesTheSecondPost(), 0, None, CallInfo("allreduce", "test", 0, 0),
                          finish=lambda: finished.append(True) or "a result")
    with pytest.raises(InvalidBuffer, match="refused") as first:
        req.test()
    assert "allreduce #0" in str(first.value) and "step 1" in str(first.value)
    for again in (req.wait, req.test, req.wait):
        with pytest.raises(InvalidBuffer, match="refused"):
            again()
    assert not req.done and not finished


class _Pending:
    """A transfer in flight for the hand-driven requests below: ``polls`` answers to test(), then complete."""

    def __init__(self, answers=(False,), stuck=()):
        self.answers, self.stuck = list(answers), list(stuck)

    def test(self):
        answer = self.answers.pop(0) if self.answers else True
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def wait(self, timeout):
        return self.stuck


class _Chan:
    def __init__(self, *pendings):
        self.pendings = list(pendings)

    def post(self, sends, recvs, tag):
        return self.pendings.pop(0)

    def transfer(self, sends, recvs, tag, timeout):
        raise AssertionError("a nonblocking run posts every transfer")


def _request(chan, steps, **kwargs):
    from commkit.schedule import CallInfo, ScheduleRun

    bufs = {"out": np.zeros(4), "tmp": np.zeros(4)}
    return ScheduleRun(iter(steps), bufs, chan, 0, None, CallInfo("allreduce", "test", 0, 0), **kwargs)


def test_a_nonblocking_request_whose_reduction_raised_never_completes():
    """A user's op that raises inside a step ends the run: waiting again raises, it never returns a result."""
    from commkit.schedule import Exchange, Reduce

    class Broken:
        def combine(self, *args):
            raise ZeroDivisionError("the user's op failed")

    steps = [Exchange(0, ("out", 0, 2), 0, ("tmp", 0, 2)), Reduce(("out", 0, 2), ("tmp", 0, 2), Broken())]
    finished = []
    req = _request(_Chan(_Pending()), steps, finish=lambda: finished.append(True))
    for again in (req.test, req.wait, req.wait):
        with pytest.raises(ZeroDivisionError, match="user's op"):
            again()
    assert not req.done and not finished


def test_a_transport_error_while_other_requests_are_driven_names_the_step_and_ends_the_run():
    from commkit.errors import InvalidBuffer
    from commkit.schedule import Exchange, Progress

    progress = Progress()
    step = Exchange(0, ("out", 0, 2), 0, ("tmp", 0, 2))
    failing = _request(_Chan(_Pending([False, False, InvalidBuffer("the message was cut short")])), [step],
                       progress=progress)
    other = _request(_Chan(_Pending([False] * 1000)), [step], progress=progress)
    assert len(progress.requests) == 2
    with pytest.raises(InvalidBuffer, match="cut short") as caught:
        failing.wait()
    assert "allreduce #0" in str(caught.value) and "step 0" in str(caught.value)
    assert failing not in progress.requests and other in progress.requests and not failing.done
    with pytest.raises(InvalidBuffer, match="cut short"):
        failing.wait()


def test_a_timed_out_request_lists_itself_as_timed_out_among_the_recent_calls():
    from commkit.errors import CommTimeout
    from commkit.schedule import Exchange
    from commkit.watchdog import FlightRecorder

    recorder = FlightRecorder(0, 2, "test")
    rec = recorder.start(0, "allreduce", "test", {})
    req = _request(_Chan(_Pending([False] * 1000, stuck=[1])), [Exchange(1, ("out", 0, 2), 1, ("tmp", 0, 2))],
                   recorder=recorder, rec=rec)
    with pytest.raises(CommTimeout) as caught:
        req.wait(timeout=0.01)
    assert "waiting for rank(s) 1" in str(caught.value)
    assert "Recent calls on this rank: #0 allreduce (test) timed out" in str(caught.value)
    with pytest.raises(CommTimeout):
        req.wait()


@requires_mpi
@pytest.mark.mpi
@pytest.mark.parametrize("timeout", ["", "60"])
def test_a_library_collective_never_waits_on_another_form_of_itself(timeout):
    """A blocking native call on a rank with a request outstanding, beside a rank without one.

    MPI never matches a blocking collective with a nonblocking one. The rank
    with a request outstanding used to call the library's nonblocking form (to
    drive the request while waiting) and the other its blocking form, and both
    waited forever at the first call (found this stop). Now the
    rank finishes its requests first and both take the same form.
    """
    code = """
    import numpy as np
    import commkit as ck
    c = ck.init()
    r = c.rank
    for k in range(20):
        req = c.iallreduce(np.full(4, k, np.float64), algorithm="recursive_doubling")
        if r == 1:
            req.wait()
        assert c.allreduce(np.full(3, r + k, np.float64), algorithm="native").tolist() == [2.0 * k + 1] * 3
        b = c.broadcast(np.full(2, float(k)) if r == 0 else np.empty(2), root=0, algorithm="native")
        assert b.tolist() == [k] * 2
        if r == 0:
            assert req.wait().tolist() == [2.0 * k] * 4
    print(f"ok {r}", flush=True)
    """
    result = run_mpi(2, code, timeout=60, env={"COMMKIT_TIMEOUT": timeout, "COMMKIT_WATCHDOG": "20"})
    assert result.stdout.count("ok") == 2, result.stdout + result.stderr


@requires_mpi
@pytest.mark.mpi
def test_check_mode_names_ranks_that_disagree_on_a_library_collectives_form():
    """A timeout on one rank only makes its native call nonblocking: check mode says so instead of hanging."""
    code = """
    import numpy as np
    import commkit as ck
    c = ck.init(check=True)
    r = c.rank
    try:
        c.allreduce(np.ones(3), algorithm="native", timeout=(30 if r == 0 else None))
    except ck.CollectiveMismatch as exc:
        assert "library form: 'nonblocking' on ranks [0]; 'blocking' on ranks [1]" in str(exc), str(exc)
        print(f"ok {r}", flush=True)
    # Agreeing forms run: both with a timeout.
    assert c.allreduce(np.ones(3), algorithm="native", timeout=30).tolist() == [2.0] * 3
    """
    result = run_mpi(2, code, timeout=60, env={"COMMKIT_TIMEOUT": ""})
    assert result.stdout.count("ok") == 2, result.stdout + result.stderr


# -- an argument error that only some ranks can see ----------------------------------------------------------

# Only the non-roots can tell that scatterv lacks out=; the root has everything it needs and goes on.
SCATTERV_WITHOUT_OUT = """
import numpy as np
import commkit as ck
comm = ck.init()
x = np.arange(6.0) if comm.rank == 0 else None
comm.scatterv(x, [2] * comm.size, root=0, out=np.empty(2) if comm.rank == 0 else None)
comm.barrier()   # the root would wait here for the others forever
"""


@requires_mpi
@pytest.mark.mpi
def test_an_argument_error_on_some_ranks_only_ends_the_job_with_its_cause(tmp_path):
    import os
    import sys

    from commkit._mpiexec import run_job

    script = tmp_path / "scatterv.py"
    script.write_text(SCATTERV_WITHOUT_OUT)
    env = {**os.environ, "PYTHONPATH": str(__import__("pathlib").Path(__file__).parents[1])}
    env.pop("COMMKIT_TIMEOUT", None)  # no timeout to rescue the root: only the job ending can
    start = time.monotonic()
    result = run_job(3, [sys.executable, str(script)], timeout=60, env=env)
    assert time.monotonic() - start < 30
    assert result.returncode != 0
    assert "scatterv on non-root rank" in result.stderr and "needs out=" in result.stderr, result.stderr
    assert "aborting the MPI job" in result.stderr


def test_an_argument_error_on_some_ranks_only_wakes_the_others_on_threads():
    seen = {}

    def body(comm):
        x = np.arange(2.0 * comm.size) if comm.rank == 0 else None
        comm.scatterv(x, [2] * comm.size, root=0, out=np.empty(2) if comm.rank == 0 else None)
        try:
            comm.barrier()
        except ck.PeerFailed as exc:
            seen[comm.rank] = str(exc)
            raise

    start = time.monotonic()
    with pytest.raises(ck.RankError, match="needs out=") as info:
        ck.run_local(body, 3)  # no timeout: only the failing rank's error can free the root
    assert time.monotonic() - start < 10
    assert info.value.rank in (1, 2)
    assert "failed with InvalidBuffer" in seen.get(0, "failed with InvalidBuffer")


# A library collective started on a temporary (a new array made for the call and dropped at once) must finish on
# that temporary's data: mpi4py 4.1's nonblocking collectives hold no reference to their buffers, and Open MPI
# reads a send buffer after the call has returned. Arrays made between the start and the wait take the freed
# memory, as a program's next allocations would; the input was then summed with malloc's bookkeeping.
_NATIVE_TEMPORARIES = """
import numpy as np
import commkit as ck
c = ck.init()
p, r = c.size, c.rank
n = 128
calls = {
    "iallreduce": lambda x, **kw: c.iallreduce(x, **kw),
    "ireduce": lambda x, **kw: c.ireduce(x, root=p - 1, **kw),
    "iscan": lambda x, **kw: c.iscan(x, **kw),
    "ibroadcast": lambda x, **kw: c.ibroadcast(x, root=0, **kw),
    "iallgather": lambda x, **kw: c.iallgather(x, **kw),
    "ialltoall": lambda x, **kw: c.ialltoall(x.reshape(p, -1), **kw),
}
wrong = []
for name, start in calls.items():
    for timeout in (None, 30.0):
        for k in range(40):  # the general path first, then the entry for new arrays of this shape
            base = np.arange(n * p, dtype=np.float64) + 1000 * r + k
            want = start(base.copy(), algorithm="naive", timeout=timeout).wait()
            request = start(base.copy(), algorithm="native", timeout=timeout)  # the input: a temporary
            junk = [np.full(n * p, -7.0) for _ in range(4)]
            got = request.wait()
            if (got is None) != (want is None) or (got is not None and not np.array_equal(got, want)):
                wrong.append((name, timeout, k))
print(f"rank {r} wrong {wrong[:5]} of {len(wrong)}", flush=True)
assert not wrong
"""


@requires_mpi
@pytest.mark.mpi
def test_library_nonblocking_collectives_on_temporaries_give_the_right_answer_under_mpiexec():
    result = run_mpi(2, _NATIVE_TEMPORARIES, timeout=120)
    assert result.stdout.count("wrong [] of 0") == 2, result.stdout + result.stderr
