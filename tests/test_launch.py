"""The launcher: results in rank order, errors naming the rank, and no process left behind.

Cleanup is checked two ways after every path (success, a rank's error, a
rank that vanished, a timeout, Ctrl-C): the pids the ranks recorded must be
gone, and no process may remain whose environment carries the test's unique
marker -- which covers mpiexec and its proxies too, whose pids no rank knows.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import numpy as np
import pytest
from conftest import have_mpi, requires_mpi, run_mpi

from commkit.errors import CommTimeout, InvalidArgument, RankError
from commkit import launch, launcher

pytestmark = [pytest.mark.mpi, pytest.mark.skipif(not have_mpi(), reason="needs mpi4py and mpiexec")]

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


# -- helpers ------------------------------------------------------------------------------------------


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except OSError:
        return None


def gone(pid: int) -> bool:
    """The process has ended (a zombie no one has reaped yet counts as ended: it runs no code)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return _state(pid) in ("Z", "X")


def survivors(marker: str) -> list[int]:
    """Running processes whose environment holds ``marker`` (Linux /proc)."""
    found = []
    needle = marker.encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if needle in env and not gone(int(entry)):
            found.append(int(entry))
    return found


@pytest.fixture
def job(tmp_path):
    """A unique marker for the job's environment and a directory for the ranks' pid files.

    After the test, no process of the job may be running.
    """
    marker = f"COMMKIT_TEST_JOB={uuid.uuid4().hex}"
    yield {"env": {"COMMKIT_TEST_JOB": marker.split("=", 1)[1]}, "dir": str(tmp_path), "marker": marker}
    left = survivors(marker)
    for pid in left:  # ours (the marker proves it): end them so one failure does not leak into the next test
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes of the job outlived the call: {left}"


def recorded_pids(directory: str) -> list[int]:
    pids = []
    for name in os.listdir(directory):
        if name.startswith("pid."):
            with open(os.path.join(directory, name)) as f:
                pids.append(int(f.read()))
    return pids


def assert_all_gone(directory: str, expected: int | None) -> None:
    """Every rank that recorded its pid has ended (``expected``: how many must have recorded one)."""
    pids = recorded_pids(directory)
    if expected is not None:
        assert len(pids) == expected, f"expected {expected} ranks to record their pid, found {len(pids)}"
    alive = [pid for pid in pids if not gone(pid)]
    assert not alive, f"ranks still running after the call returned: {alive}"


def record_pid(comm, directory):
    # Written aside and renamed into place: a test polling the directory never reads a file half written.
    aside = os.path.join(directory, f"writing.{comm.rank}")
    with open(aside, "w") as f:
        f.write(str(os.getpid()))
    os.replace(aside, os.path.join(directory, f"pid.{comm.rank}"))


# Rank functions live at module level so the ranks import them by name; the
# notebook test below covers functions that cannot be imported.

def allreduce_rank(comm, directory, scale, *, offset=0):
    record_pid(comm, directory)
    total = comm.allreduce(np.array([comm.rank * scale + offset]))
    return comm.rank, comm.size, int(total[0])


def fail_on(comm, directory, bad_rank):
    record_pid(comm, directory)
    comm.barrier()  # every rank has recorded its pid
    if comm.rank == bad_rank:
        raise ValueError(f"bad input on rank {comm.rank}")
    comm.barrier()  # the others wait here for the failed rank: only an abort can free them
    return comm.rank


def vanish_on(comm, directory, bad_rank):
    record_pid(comm, directory)
    comm.barrier()
    if comm.rank == bad_rank:
        os._exit(0)  # ends without returning, without an exception, with a success code
    comm.barrier()
    return comm.rank


def sleep_forever(comm, directory):
    record_pid(comm, directory)
    time.sleep(3600)


def talk(comm, directory):
    record_pid(comm, directory)
    print(f"hello from {comm.rank}")
    print(f"second line from {comm.rank}")
    return comm.rank


# -- success -------------------------------------------------------------------------------------------


def test_results_in_rank_order_with_args_and_kwargs(job):
    scale, offset = np.random.default_rng().integers(1, 100, 2)
    results = launch(allreduce_rank, 4, job["dir"], int(scale), offset=int(offset), env=job["env"], timeout=120)
    total = sum(r * int(scale) + int(offset) for r in range(4))
    assert results == [(r, 4, total) for r in range(4)]
    assert_all_gone(job["dir"], 4)


def test_decorator_form(job):
    @launcher(nprocs=3, env=job["env"], timeout=120)
    def total(comm, directory, scale):
        return allreduce_rank(comm, directory, scale)

    assert [t[2] for t in total(job["dir"], 5)] == [15, 15, 15]
    assert total.__wrapped__.__name__ == "total"
    assert_all_gone(job["dir"], 3)


def test_notebook_functions_and_lambdas_travel_by_value(job):
    """A function from a notebook cell lives in a module the ranks cannot import."""
    cell = {"__name__": "__notebook_cell__"}
    exec(textwrap.dedent("""
        import numpy as np
        factor = 7
        def cell_fn(comm, extra):
            return int(comm.allreduce(np.array([comm.rank * factor + extra]))[0])
    """), cell)
    assert launch(cell["cell_fn"], 2, 1, env=job["env"], timeout=120) == [9, 9]
    assert launch(lambda comm: comm.rank * 10, 3, env=job["env"], timeout=120) == [0, 10, 20]


def test_more_ranks_than_cores(job):
    nprocs = (os.cpu_count() or 2) + 2
    results = launch(allreduce_rank, nprocs, job["dir"], 1, env=job["env"], timeout=300)
    assert [r[:2] for r in results] == [(r, nprocs) for r in range(nprocs)]
    assert {r[2] for r in results} == {nprocs * (nprocs - 1) // 2}
    assert_all_gone(job["dir"], nprocs)


def test_output_reaches_the_caller_labelled_when_asked(job, capfd):
    launch(talk, 2, job["dir"], env=job["env"], timeout=120)
    out = capfd.readouterr().out.splitlines()
    assert sorted(line for line in out if "from" in line) == [
        "hello from 0", "hello from 1", "second line from 0", "second line from 1"]
    launch(talk, 2, job["dir"], label=True, env=job["env"], timeout=120)
    out = capfd.readouterr().out.splitlines()
    assert sorted(line for line in out if "from" in line) == [
        "[0] hello from 0", "[0] second line from 0", "[1] hello from 1", "[1] second line from 1"]


# -- failures --------------------------------------------------------------------------------------------


def test_a_rank_error_names_the_rank_and_carries_its_traceback(job):
    with pytest.raises(RankError) as info:
        launch(fail_on, 4, job["dir"], 2, env=job["env"], timeout=120)
    err = info.value
    assert err.rank == 2
    assert "ValueError: bad input on rank 2" in str(err)
    assert "in fail_on" in err.remote_traceback and "raise ValueError" in err.remote_traceback
    assert isinstance(err.__cause__, ValueError)
    assert_all_gone(job["dir"], 4)


def test_a_rank_that_exits_without_returning_is_reported(job):
    with pytest.raises(RankError, match="exited without returning a result from vanish_on") as info:
        launch(vanish_on, 3, job["dir"], 1, env=job["env"], timeout=120)
    assert info.value.rank == 1
    assert_all_gone(job["dir"], 3)


def test_sys_exit_and_unpicklable_results_are_errors(job):
    with pytest.raises(RankError, match="SystemExit") as info:
        launch(lambda comm: sys.exit(3) if comm.rank == 1 else comm.rank, 2, env=job["env"], timeout=120)
    assert info.value.rank == 1
    with pytest.raises(RankError, match="while pickling its return value"):
        launch(lambda comm: _Unpicklable(), 2, env=job["env"], timeout=120)


class _Unpicklable:
    def __reduce__(self):
        raise TypeError("this object refuses to be pickled")


def test_timeout_stops_every_process(job):
    with pytest.raises(CommTimeout, match="did not finish within 5 s"):
        launch(sleep_forever, 2, job["dir"], env=job["env"], timeout=5)
    # On a loaded machine a rank may not have reached fn in 5 s; the job
    # fixture's environment scan still covers every process of the job.
    assert_all_gone(job["dir"], None)


def test_ctrl_c_in_the_caller_stops_every_process(job):
    script = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{ROOT!r}, {HERE!r}]
        from commkit import launch
        from test_launch import sleep_forever
        launch(sleep_forever, 3, {job['dir']!r}, env={job['env']!r})
    """)
    caller = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=True)
    try:
        for _ in range(1200):  # the ranks record their pids once they run fn
            if len(recorded_pids(job["dir"])) == 3 or caller.poll() is not None:
                break
            time.sleep(0.05)
        assert len(recorded_pids(job["dir"])) == 3, caller.communicate(timeout=30)
        caller.send_signal(signal.SIGINT)
        _, err = caller.communicate(timeout=60)
    finally:
        if caller.poll() is None:
            os.killpg(caller.pid, signal.SIGKILL)
            caller.wait()
    assert caller.returncode != 0 and "KeyboardInterrupt" in err, err
    assert_all_gone(job["dir"], 3)


# -- validation (no processes start) ---------------------------------------------------------------------


def test_arguments_are_checked_before_anything_starts():
    import threading

    with pytest.raises(InvalidArgument, match="nprocs must be a positive int, got 0"):
        launch(print, 0)
    with pytest.raises(InvalidArgument, match="callable"):
        launch("not a function", 2)
    with pytest.raises(InvalidArgument, match="must pickle fn and its arguments"):
        launch(lambda comm, lock: None, 2, threading.Lock())
    with pytest.raises(InvalidArgument, match="timeout"):
        launch(print, 2, timeout=-1)


_LAUNCHER_VARS = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMIX_SIZE",
                  "HYDRA_CONTROL_FD")


def test_a_launched_process_knows_its_rank_and_size_from_the_environment(monkeypatch):
    from commkit._mpiexec import launcher_rank, launcher_size, under_mpiexec

    for var in _LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)
    assert not under_mpiexec() and launcher_rank() is None and launcher_size() is None
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "3")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "8")
    assert under_mpiexec() and (launcher_rank(), launcher_size()) == (3, 8)
    monkeypatch.setenv("PMI_RANK", "x")  # not a number: the next launcher's variable is read
    assert launcher_rank() == 3
    for var in _LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HYDRA_CONTROL_FD", "7")  # Hydra's marker alone says "launched", with no rank to read
    assert under_mpiexec() and launcher_rank() is None


@requires_mpi
def test_launch_under_mpiexec_refuses_to_start_a_job_per_rank():
    result = run_mpi(2, """
        import commkit as ck
        try:
            ck.launch(lambda c: c.rank, nprocs=4)
        except ck.InvalidArgument as exc:
            assert "already rank" in str(exc) and "call fn(commkit.init()) directly" in str(exc), exc
            print("refused")
    """)
    assert result.stdout.count("refused") == 2


@pytest.mark.parametrize("version,euid,label,extra", [
    ("HYDRA build details:\n    Version: 5.0.2", 0, True, ["-l"]),
    ("HYDRA build details:\n    Version: 5.0.2", 1000, False, []),
    ("mpiexec (Open MPI) 5.0.11", 0, True, ["--oversubscribe", "--allow-run-as-root", "--tag-output"]),
    ("mpiexec (Open MPI) 5.0.11", 1000, False, ["--oversubscribe"]),
])
def test_mpiexec_command_gives_each_launcher_its_own_flags(tmp_path, monkeypatch, version, euid, label, extra):
    from commkit import _mpiexec

    fake = tmp_path / "mpiexec"
    fake.write_text(f"#!/bin/sh\ncat <<'END'\n{version}\nEND\n")
    fake.chmod(0o755)
    monkeypatch.setenv("COMMKIT_MPIEXEC", str(fake))
    monkeypatch.setattr(os, "geteuid", lambda: euid)
    _mpiexec._is_open_mpi.cache_clear()
    try:
        assert _mpiexec.mpiexec_command(3, ["prog", "arg"], label_output=label) == [str(fake), "-n", "3", *extra,
                                                                                     "prog", "arg"]
    finally:
        _mpiexec._is_open_mpi.cache_clear()
