"""Finding and running the ``mpiexec`` that came with the installed MPI, and knowing a process it started.

Used by the launcher, ``commkit bench -n N`` and the test-suite. Prefers the
``mpiexec`` next to the running Python (a virtual environment with the
``mpich`` wheels), then the one on PATH. Jobs start in their own process
group so that a timeout or Ctrl-C can end every process of the job and no
other (never by name). Once a job has ended, the shared-memory segments its
MPI library left in /dev/shm (it does after ``MPI_Abort`` or a killed rank)
are removed: :func:`process_group`, :func:`run_group` and :func:`run_job` do
it for every job they start.

A process started by a launcher knows it from its environment, before MPI is
initialised: :func:`under_mpiexec`, :func:`launcher_rank` and
:func:`launcher_size` read the variables that MPICH's Hydra (``PMI_*``),
Open MPI (``OMPI_COMM_WORLD_*``) and PMIx launchers such as ``srun`` or
``prterun`` (``PMIX_*``) set in every rank.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import subprocess
import sys
import time

from .errors import TransportUnavailable

__all__ = ["after_job", "find_mpiexec", "launcher_rank", "launcher_size", "mpiexec_command", "process_group",
           "remove_left_segments", "run_group", "run_job", "shm_names", "terminate_group", "under_mpiexec"]

# The rank and the size of this process in its job, as each launcher names them.
RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")
SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE")
# Any of these says a launcher started this process.
_LAUNCHED_VARS = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "HYDRA_CONTROL_FD")
# Variables of an enclosing MPI job; a nested mpiexec that inherits them would try to join the
# outer job instead of starting its own.
OUTER_JOB_PREFIXES = ("PMI_", "PMIX_", "HYDRA_")


def under_mpiexec() -> bool:
    """Whether a launcher (mpiexec, mpirun, srun) started this process, judged from its environment."""
    return any(var in os.environ for var in _LAUNCHED_VARS)


def _first_int(names) -> int | None:
    for name in names:
        text = os.environ.get(name, "")
        if text.isdigit():
            return int(text)
    return None


def launcher_rank() -> int | None:
    """This process's rank as its launcher set it in the environment, or None where none did."""
    return _first_int(RANK_VARS)


def launcher_size() -> int | None:
    """The number of processes in this process's job as its launcher set it, or None where none did."""
    return _first_int(SIZE_VARS)


def find_mpiexec() -> str:
    """Path of ``mpiexec``; raises TransportUnavailable with the install command if there is none."""
    env = os.environ.get("COMMKIT_MPIEXEC")
    if env:
        return env
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.path.exists(here):
        return here
    found = shutil.which("mpiexec")
    if found:
        return found
    raise TransportUnavailable(
        "no mpiexec found next to this Python or on PATH; install MPI with `pip install 'commkit[mpi]'` "
        "(mpi4py plus the mpich wheels, which provide mpiexec) or set COMMKIT_MPIEXEC."
    )


@functools.lru_cache(maxsize=4)
def _is_open_mpi(mpiexec: str) -> bool:
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "Open MPI" in out or "OpenRTE" in out


def mpiexec_command(nprocs: int, argv: list[str], *, label_output: bool = False) -> list[str]:
    """The command line running ``argv`` on ``nprocs`` ranks (oversubscription allowed).

    MPICH's Hydra oversubscribes by default, runs as any user and labels each
    line with ``-l``. Open MPI's launcher needs ``--oversubscribe`` to start more
    ranks than cores, refuses to run as root without ``--allow-run-as-root``
    (a container's usual user, where commkit's own jobs are started on purpose),
    and labels lines with ``--tag-output``.
    """
    mpiexec = find_mpiexec()
    cmd = [mpiexec, "-n", str(int(nprocs))]
    if _is_open_mpi(mpiexec):
        cmd.append("--oversubscribe")
        if os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
        if label_output:
            cmd.append("--tag-output")
    elif label_output:
        cmd.append("-l")
    return cmd + list(argv)


def terminate_group(proc: subprocess.Popen, grace: float = 3.0) -> None:
    """End ``proc`` and every process in its process group: SIGTERM, then SIGKILL after ``grace`` s."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def run_job(nprocs: int, argv: list[str], *, timeout: float | None = None, env: dict | None = None,
            cwd: str | None = None, label_output: bool = False) -> subprocess.CompletedProcess:
    """Run ``argv`` under mpiexec and capture its output; the whole job is ended on timeout.

    A job that did not end cleanly (``MPI_Abort``, a rank killed, the timeout) leaves
    its MPI library's shared-memory segments in ``/dev/shm``: they are removed once
    the job has ended (see :func:`process_group`).

    Raises:
        subprocess.TimeoutExpired: after ending every process of the job.
    """
    return run_group(mpiexec_command(nprocs, argv, label_output=label_output), timeout=timeout, env=env, cwd=cwd)


def after_job(before: set | None, returncode: int | None) -> None:
    """Once a job has ended: remove what it left in /dev/shm (``before``: :func:`shm_names` when it started).

    After an unclean end (``returncode`` not 0, or None: the job was stopped) a rank
    may still be going for a moment, so files in use are looked at again for 2 s.
    """
    if before is not None:
        remove_left_segments(before, wait=0.0 if returncode == 0 else 2.0)


SHM = "/dev/shm"
# The names MPICH (its intranode segments and shared windows) and Open MPI (its sm segments) give their files there.
_SEGMENT_PREFIXES = ("mpich_shm_", "sm_segment.")


def shm_names() -> set | None:
    """The names of the files in /dev/shm now (None where there is none): what a job's cleanup compares against."""
    try:
        return set(os.listdir(SHM))
    except OSError:  # no /dev/shm (not Linux): nothing to look after
        return None


def _mapped(pid="self") -> set:
    """The names of the files in /dev/shm that process ``pid`` maps.

    Raises:
        OSError: the process has ended, is another user's, or there is no /proc.
    """
    with open(f"/proc/{pid}/maps") as f:
        return {line.rsplit(SHM + "/", 1)[1].split()[0] for line in f if SHM + "/" in line}


def _unlink_own(name: str) -> bool:
    """Unlink /dev/shm file ``name`` if it is this user's; whether it did."""
    path = os.path.join(SHM, name)
    try:
        if os.stat(path).st_uid != os.getuid():
            return False
        os.unlink(path)
    except OSError:  # (already gone)
        return False
    return True


def _in_use() -> set:
    """The names of the files in /dev/shm that a process this user can see maps or holds open."""
    used = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            used |= _mapped(pid)
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith(SHM + "/"):
                    used.add(target[len(SHM) + 1:].split()[0])
        except OSError:  # the process ended, or is another user's
            continue
    return used


def remove_left_segments(before: set, wait: float = 2.0) -> list[str]:
    """Remove the MPI libraries' /dev/shm segments that appeared since ``before`` and that nothing uses.

    Called once a job has ended without cleaning up (MPI does not, on an abort or
    when a rank is killed). Only files of this user, named as MPICH and Open MPI
    name theirs, made while the job ran, that no process maps or holds open: a
    job running beside it keeps its own. A rank the launcher killed may still be
    going when it returns, so a file in use is looked at again for up to ``wait``
    seconds. Returns the names removed.
    """
    now = shm_names() or set()
    fresh = {name for name in now - before if name.startswith(_SEGMENT_PREFIXES)}
    removed = []
    deadline = time.monotonic() + wait
    while fresh:
        used = _in_use()
        for name in sorted(fresh - used):
            fresh.discard(name)
            if _unlink_own(name):
                removed.append(name)
        if not fresh or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return removed


def remove_own_segments(prefixes: tuple = _SEGMENT_PREFIXES) -> list[str]:
    """Unlink the /dev/shm files named with one of ``prefixes`` that this process maps; their names.

    What a process that is its own MPI job calls as it ends (see
    :func:`commkit.transports.mpi.forget_singleton_segment`): the files stay
    mapped where they are mapped (an unlinked file lives until its last mapping
    goes), but no new process can attach to them by name and none is left
    behind. Only this user's files; nothing where there is no /proc (not Linux).
    """
    try:
        mapped = _mapped()
    except OSError:
        return []
    return [name for name in sorted(mapped) if name.startswith(prefixes) and _unlink_own(name)]


@contextlib.contextmanager
def process_group(cmd: list[str], **popen_args):
    """Start ``cmd`` in a process group of its own; on the way out, end the group and clean up after its MPI job.

    For an MPI job, or a program that starts one (``commkit bench -n 2``, a
    benchmark script), run by a caller that watches it itself. Yields the
    ``Popen`` (``popen_args`` are passed to it). On leaving, the group is ended if
    ``cmd`` is still running (:func:`terminate_group`), and the segments a job
    that did not end cleanly left in /dev/shm are removed (:func:`after_job`).
    """
    before = shm_names()
    proc = subprocess.Popen(cmd, start_new_session=True, **popen_args)
    try:
        yield proc
    finally:
        terminate_group(proc)
        after_job(before, proc.returncode)


def run_group(cmd: list[str], *, timeout: float | None = None, env: dict | None = None,
              cwd: str | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` in a process group of its own and capture its output; end the whole group on timeout.

    ``cmd`` may be an MPI job or a program that starts one: what such a job left in
    /dev/shm is removed once the group has ended (see :func:`process_group`).

    Raises:
        subprocess.TimeoutExpired: after ending every process of the group.
    """
    with process_group(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException:
            terminate_group(proc)
            proc.communicate()
            _await_group(proc.pid)
            raise
        if proc.returncode != 0:  # an aborted job's launcher may return before the ranks it killed have gone
            _await_group(proc.pid)
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _await_group(pgid: int, grace: float = 5.0) -> None:
    """Wait until no process of group ``pgid`` is left: SIGKILL the stragglers after ``grace`` s, give up after twice.

    (A killed process nobody reaps stays in its group as a zombie: hence the bound.)
    """
    start = time.monotonic()
    killed = False
    while True:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):  # none left (or only another user's: not ours to wait for)
            return
        waited = time.monotonic() - start
        if waited > 2 * grace:
            return
        if waited > grace and not killed:
            killed = True
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                return
        time.sleep(0.01)
