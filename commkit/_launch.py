"""Launching MPI jobs from Python: ``launch(fn, nprocs)`` and the ``@launcher`` decorator.

How it works, and why:

* ``fn`` and its arguments are pickled *by value* with cloudpickle, so
  functions and lambdas defined in a notebook or in ``__main__`` reach the
  ranks, which cannot import them.
* The parent starts ``mpiexec -n N python -m commkit._launch_child JOBDIR`` in
  a process group of its own (:mod:`commkit._mpiexec`). The parent never
  imports mpi4py, so a notebook kernel does not become an MPI process.
* Results and failures travel out of band, as files in the private job
  directory, never through standard output (which belongs to the user):
  each rank writes ``result.R`` or ``error.R`` with an atomic rename. The
  first rank to fail also links its record to ``first-error``; ``os.link``
  fails if that name exists, so exactly one rank wins without any lock. That
  rank then calls ``MPI_Abort`` so the other ranks stop at once instead of
  waiting on it.
* A rank that ends without writing either file (``os._exit``, a signal, a
  crash in C) is noticed while the job runs, through a control socket each
  rank holds open (:class:`_Control`), because MPI may leave its peers
  blocked forever and because it must be told apart from the ranks MPI
  kills after it.
* Whatever happens -- success, a rank's error, a timeout, Ctrl-C -- the
  ``finally`` clause ends mpiexec, then waits until every rank has ended,
  killing by pid whatever lingers (:func:`_end_job`), so no child outlives
  the call.
* Output of the ranks is read by two threads and written to the caller's
  ``sys.stdout``/``sys.stderr`` as it arrives; looking those up at each write
  is what makes it appear in the right Jupyter cell.
"""

from __future__ import annotations

import functools
import os
import pickle
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid

from ._checks import check_timeout
from ._mpiexec import (OUTER_JOB_PREFIXES, after_job, launcher_rank, launcher_size, mpiexec_command, shm_names,
                       terminate_group)
from .errors import CommError, CommTimeout, InvalidArgument, RankError

__all__ = ["launch", "launcher"]

# How often the parent looks at the job directory and the ranks' pids while
# the job runs; small enough that a failure is reported within a blink, large
# enough to cost nothing next to the ranks' own work.
_POLL = 0.05
# After a rank has reported an error it aborts the job itself; give mpiexec
# this long to wind down (and print its own diagnostics) before ending the group.
_ABORT_GRACE = 2.0
# Every process of a job carries this variable, set to a fresh id, so that the
# final sweep can find any of them by that id (never by name).
_TAG = "COMMKIT_LAUNCH_JOB"


def launch(fn, nprocs: int = 4, *args, timeout: float | None = None, label: bool = False,
           env: dict | None = None, **kwargs) -> list:
    """Run ``fn(comm, *args, **kwargs)`` on ``nprocs`` MPI processes; return the results in rank order.

    ``comm`` is each rank's :class:`commkit.Communicator` over ``MPI.COMM_WORLD``.
    Works from scripts and notebooks (functions and lambdas defined there are
    sent by value). ``nprocs`` may exceed the number of cores.

    Args:
        fn: the function every rank runs; its first argument is the communicator.
        nprocs: number of MPI processes (ranks).
        args, kwargs: further arguments for ``fn``; they and the return values
            must be picklable by cloudpickle. (``timeout``, ``label`` and ``env``
            are the launcher's own and are not passed to ``fn``.)
        timeout: seconds the whole job may take; None waits forever.
        label: prefix every line the ranks print with ``"[rank] "`` (like ``mpiexec -l``).
        env: extra environment variables for the ranks (e.g. ``{"COMMKIT_TIMEOUT": "60"}``).

    Returns:
        The list of the ``nprocs`` return values, element r from rank r.

    Raises:
        RankError: a rank raised (the first one to fail is named, with its
            traceback; its exception is chained when it could be unpickled),
            or a rank ended without returning.
        CommTimeout: the job ran longer than ``timeout``; all its processes were stopped.
        KeyboardInterrupt: re-raised after stopping every process of the job.
        TransportUnavailable: no ``mpiexec`` was found.
    """
    if not callable(fn):
        raise InvalidArgument(f"launch expects a callable fn(comm, ...), got {type(fn).__name__}.")
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise InvalidArgument(f"nprocs must be a positive int, got {nprocs!r}.")
    timeout = check_timeout(timeout)
    outer = launcher_size()
    if outer is not None and outer > 1:
        # Every rank of the outer job would start a job of its own: nprocs x the ranks, none of them
        # talking to the others' jobs.
        raise InvalidArgument(
            f"launch starts an MPI job of its own, but this process is already rank {launcher_rank()} of a "
            f"job of {outer} started by mpiexec, so every one of them would start {nprocs} more. Under mpiexec, "
            "call fn(commkit.init()) directly; use launch from a notebook or a plain python process.")
    if env is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in dict(env).items()):
        raise InvalidArgument("env must map variable names to string values.")
    job = _pack(fn, args, kwargs, label)
    name = getattr(fn, "__qualname__", type(fn).__name__)
    jobdir = tempfile.mkdtemp(prefix="commkit-launch-")
    if len(os.path.join(jobdir, "ctl").encode()) > 100 and os.path.isdir("/tmp"):
        # A Unix socket's path must fit in about 104 bytes; a long TMPDIR (macOS) does not.
        os.rmdir(jobdir)
        jobdir = tempfile.mkdtemp(prefix="commkit-launch-", dir="/tmp")
    try:
        with open(os.path.join(jobdir, "job.pkl"), "wb") as f:
            f.write(job)
        control = _Control(jobdir, nprocs)
        tag = f"{_TAG}={uuid.uuid4().hex}"
        argv = [sys.executable, "-m", "commkit._launch_child", jobdir]
        shm = shm_names()
        try:
            proc = subprocess.Popen(mpiexec_command(nprocs, argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, env=_child_env(env, tag), start_new_session=True)
        except BaseException:
            control.close()
            raise
        pumps = [_pump(proc.stdout, "stdout"), _pump(proc.stderr, "stderr")]
        try:
            timed_out = _watch(proc, control, jobdir, None if timeout is None else time.monotonic() + timeout)
        finally:
            _end_job(proc, control, tag)
            control.close()
            for pump in pumps:
                pump.join(5)
            after_job(shm, proc.returncode)  # (a job that did not end cleanly leaves its MPI's segments behind)
        if timed_out:
            raise CommTimeout(
                f"launch: {name} on {nprocs} ranks did not finish within {timeout:g} s; "
                "every process of the job was stopped."
            )
        return _collect(jobdir, nprocs, proc.returncode, name, control)
    finally:
        shutil.rmtree(jobdir, ignore_errors=True)


def launcher(nprocs: int = 4, *, timeout: float | None = None, label: bool = False, env: dict | None = None):
    """Decorator form of :func:`launch`: calling the decorated function launches it.

    Example::

        @commkit.launcher(nprocs=4)
        def total(comm, x):
            return comm.allreduce(np.array([x * comm.rank]))

        total(10)          # -> [array([60]), array([60]), array([60]), array([60])]

    The undecorated function stays reachable as ``total.__wrapped__``.
    """
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise InvalidArgument(f"nprocs must be a positive int, got {nprocs!r}.")
    timeout = check_timeout(timeout)

    def decorate(fn):
        if not callable(fn):
            raise InvalidArgument(f"@launcher decorates a callable fn(comm, ...), got {type(fn).__name__}.")

        @functools.wraps(fn)
        def run(*args, **kwargs):
            return launch(fn, nprocs, *args, timeout=timeout, label=label, env=env, **kwargs)

        return run

    return decorate


# -- the parent's side ------------------------------------------------------------------


def _pack(fn, args, kwargs, label) -> bytes:
    """The job file: plain-pickled settings around the cloudpickled call."""
    try:
        import cloudpickle
    except ImportError:  # pragma: no cover - cloudpickle is a dependency
        cloudpickle = None
    dumps = cloudpickle.dumps if cloudpickle is not None else pickle.dumps
    try:
        call = dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        hint = "" if cloudpickle is not None else " (install cloudpickle to send notebook functions and lambdas)"
        raise InvalidArgument(
            f"launch must pickle fn and its arguments to send them to the ranks, and that failed{hint}: "
            f"{type(exc).__name__}: {exc}"
        ) from None
    # The ranks start in the caller's working directory; giving them the caller's
    # sys.path too lets them import whatever fn refers to by module name.
    return pickle.dumps({"sys_path": list(sys.path), "label": bool(label), "call": call},
                        protocol=pickle.HIGHEST_PROTOCOL)


def _child_env(extra: dict | None, tag: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(OUTER_JOB_PREFIXES)}
    name, _, value = tag.partition("=")
    env[name] = value
    # The ranks must import this very commkit, even when it is not installed
    # (a source checkout put on sys.path by hand).
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    if extra:
        env.update(extra)
    return env


def _pump(pipe, stream_name: str) -> threading.Thread:
    """Copy the job's ``pipe`` to the caller's ``sys.<stream_name>`` line by line, in a thread."""

    def copy():
        with pipe:
            for line in iter(pipe.readline, b""):
                stream = getattr(sys, stream_name)
                try:
                    stream.write(line.decode("utf-8", "replace"))
                    stream.flush()
                except Exception:  # noqa: BLE001 - a closed caller stream must not kill the job
                    pass

    thread = threading.Thread(target=copy, name=f"commkit-launch-{stream_name}", daemon=True)
    thread.start()
    return thread


class _Control:
    """The parent's end of the ranks' control connections (a Unix socket in the job directory).

    Each rank connects when it starts and sends ``"hello RANK PID"``, then
    ``"done"`` once its result or error file is written. The kernel closes a
    process's sockets the moment it dies, before its parent (the MPI proxy)
    even hears of it, so the first connection to end without ``"done"``
    names the rank that vanished first -- not the ranks MPI killed after it.
    """

    def __init__(self, jobdir: str, nprocs: int):
        self.path = os.path.join(jobdir, "ctl")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.path)
        self.listener.listen(nprocs)
        self.listener.setblocking(False)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ)
        self.ranks: dict = {}    # connection -> [rank or None, finished, buffered bytes, pid]
        self.pids: dict = {}     # rank -> pid, for every rank that ever connected
        self.vanished: int | None = None

    def poll(self, timeout: float) -> None:
        """Accept connections and read messages for up to ``timeout`` s."""
        for key, _ in self.selector.select(timeout):
            if key.fileobj is self.listener:
                try:
                    conn, _ = self.listener.accept()
                except BlockingIOError:
                    continue
                conn.setblocking(False)
                self.ranks[conn] = [None, False, b"", None]
                self.selector.register(conn, selectors.EVENT_READ)
                continue
            self._read(key.fileobj)

    def _read(self, conn) -> None:
        state = self.ranks[conn]
        try:
            data = conn.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            *lines, state[2] = (state[2] + data).split(b"\n")
            for line in lines:
                word, _, value = line.decode().partition(" ")
                if word == "hello":
                    rank, pid = value.split()
                    state[0], state[3] = int(rank), int(pid)
                    self.pids[state[0]] = state[3]
                elif word == "done":
                    state[1] = True
            return
        self.selector.unregister(conn)
        conn.close()
        del self.ranks[conn]
        if state[0] is not None and not state[1] and self.vanished is None:
            self.vanished = state[0]

    def running(self) -> list:
        """Pids of the ranks whose connection is still open: their processes have not ended."""
        return [state[3] for state in self.ranks.values() if state[3] is not None]

    def wait_closed(self, timeout: float) -> None:
        """Read until every rank's connection has ended, for up to ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while self.ranks and time.monotonic() < deadline:
            self.poll(_POLL)

    def drain(self) -> None:
        """Read everything already sent, end-of-connections included (after the job ended)."""
        for _ in range(4 * len(self.ranks) + 4):
            if not self.selector.select(0):
                return
            self.poll(0)

    def close(self) -> None:
        for conn in list(self.ranks):
            try:
                self.selector.unregister(conn)
            except (KeyError, ValueError):
                pass
            conn.close()
        self.selector.close()
        self.listener.close()


def _watch(proc: subprocess.Popen, control: _Control, jobdir: str, deadline: float | None) -> bool:
    """Wait until the job ends, a rank fails or a rank vanishes (False), or ``deadline`` passes (True)."""
    first_error = os.path.join(jobdir, "first-error")
    while True:
        control.poll(_POLL)
        if proc.poll() is not None:
            control.drain()
            return False
        if os.path.exists(first_error):
            # The failing rank is aborting the job; let MPI finish that itself.
            try:
                proc.wait(_ABORT_GRACE)
            except subprocess.TimeoutExpired:
                pass
            return False
        if control.vanished is not None:
            return False
        if deadline is not None and time.monotonic() >= deadline:
            return True


def _end_job(proc: subprocess.Popen, control: _Control, tag: str) -> None:
    """End every process of the job -- mpiexec, its proxies, the ranks -- and wait until none runs.

    MPICH's mpiexec puts each proxy and rank in a session of its own, so ending
    mpiexec's process group is not enough: on SIGTERM mpiexec asks its proxies
    to end the ranks, and after an abort it may exit before they are gone.
    The ranks' control connections show which still run; any that outlast a
    grace period, and (on Linux) any process still carrying this job's tag in
    its environment, get SIGKILL by pid.
    """
    terminate_group(proc)
    try:  # whatever stayed in mpiexec's group after mpiexec ended (MPIs that keep ranks there)
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    control.wait_closed(_ABORT_GRACE)
    for pid in control.running():
        _kill(pid)
    control.wait_closed(_ABORT_GRACE)
    # A closed connection means the rank is exiting, not yet that it has exited.
    _wait_ended(control.pids.values())
    for _ in range(100):
        left = _tagged(tag)
        if not left:
            break
        for pid in left:
            _kill(pid)
        time.sleep(_POLL)


def _wait_ended(pids) -> None:
    """Wait until none of ``pids`` runs any more; SIGKILL those still running after a grace period."""
    left = [pid for pid in pids if _running(pid)]
    for last_try in (False, True):
        deadline = time.monotonic() + _ABORT_GRACE
        while left and time.monotonic() < deadline:
            time.sleep(0.01)
            left = [pid for pid in left if _running(pid)]
        if not left or last_try:
            return
        for pid in left:
            _kill(pid)


def _running(pid: int) -> bool:
    """Whether ``pid`` still runs code (a zombie waiting to be reaped does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return _state(pid) not in ("Z", "X", None)


def _state(pid: int) -> str | None:
    """The state letter of ``pid`` from /proc ("R", "S", "Z" ...); "?" without /proc, None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return None if os.path.isdir("/proc") else "?"
    except (OSError, IndexError):
        return "?"


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _tagged(tag: str) -> list:
    """Running processes whose environment holds ``tag`` (Linux; elsewhere none can be found)."""
    if not os.path.isdir("/proc"):
        return []
    needle = tag.encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle not in f.read():
                    continue
        except OSError:
            continue
        if _running(int(entry)):
            found.append(int(entry))
    return found


def _collect(jobdir: str, nprocs: int, returncode: int | None, name: str, control: _Control) -> list:
    """The results in rank order, or the right error for the first rank that failed."""
    record = _load(os.path.join(jobdir, "first-error"))
    if record is not None:
        raise _rank_error(record)
    missing = [r for r in range(nprocs) if not os.path.exists(os.path.join(jobdir, f"result.{r}"))]
    if missing:
        rank = control.vanished if control.vanished is not None else missing[0]
        started = "" if rank in control.pids else " (it ended before it could start fn)"
        raise RankError(
            rank,
            f"exited without returning a result from {name}{started}; mpiexec exited with code {returncode}. "
            "A rank that calls sys.exit is reported as raising SystemExit; this one ended some other way "
            "(os._exit, a signal, a crash in native code or running out of memory).",
        )
    results = []
    for rank in range(nprocs):
        with open(os.path.join(jobdir, f"result.{rank}"), "rb") as f:
            data = f.read()
        try:
            results.append(pickle.loads(data))
        except Exception as exc:
            raise CommError(
                f"the return value of rank {rank} could not be unpickled in the caller: {type(exc).__name__}: {exc}"
            ) from None
    return results


def _load(path: str):
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except FileNotFoundError:
        return None


def _rank_error(record: dict) -> RankError:
    """A RankError from a rank's failure record, chained to the original exception when it unpickles."""
    error = RankError(record["rank"], record["message"], record["traceback"])
    original = None
    if record.get("exception") is not None:
        try:
            original = pickle.loads(record["exception"])
        except Exception:  # noqa: BLE001 - the text traceback still tells the story
            original = None
    error.__cause__ = original if isinstance(original, BaseException) else None
    error.__suppress_context__ = True
    return error
