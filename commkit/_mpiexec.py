"""Finding and running the ``mpiexec`` that came with the installed MPI, and knowing a process it started.

Used by the launcher, ``commkit bench -n N`` and the test-suite. Prefers the
``mpiexec`` next to the running Python (a virtual environment with the
``mpich`` wheels), then the one on PATH. Jobs start in their own process
group so that a timeout or Ctrl-C can end every process of the job and no
other (never by name).

A process started by a launcher knows it from its environment, before MPI is
initialised: :func:`under_mpiexec`, :func:`launcher_rank` and
:func:`launcher_size` read the variables that MPICH's Hydra (``PMI_*``),
Open MPI (``OMPI_COMM_WORLD_*``) and PMIx launchers such as ``srun`` or
``prterun`` (``PMIX_*``) set in every rank.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys

from .errors import TransportUnavailable

__all__ = ["find_mpiexec", "launcher_rank", "launcher_size", "mpiexec_command", "run_group", "run_job",
           "terminate_group", "under_mpiexec"]

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

    Raises:
        subprocess.TimeoutExpired: after ending every process of the job.
    """
    return run_group(mpiexec_command(nprocs, argv, label_output=label_output), timeout=timeout, env=env, cwd=cwd)


def run_group(cmd: list[str], *, timeout: float | None = None, env: dict | None = None,
              cwd: str | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` in a process group of its own and capture its output; end the whole group on timeout."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        terminate_group(proc)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
