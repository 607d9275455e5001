"""MPI segments a job leaves in /dev/shm are removed: after each job, and at the end of a test session.

MPICH (``mpich_shm_*``) and Open MPI (``sm_segment.*``) leave their shared-memory
files behind when a job does not end cleanly (``MPI_Abort``, a killed rank, a
timeout); every CI run used to add some, and nothing removes them. The rules are
tested on a stand-in /dev/shm (a temporary directory) so that no other user's
file is ever at stake, and once on the real one with a real aborted job.
"""

from __future__ import annotations

import mmap
import os
import shutil
import sys
import textwrap

import pytest

from conftest import have_mpi

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


# Where a test looks at the real /dev/shm after a real MPI job (or MPI started in a process of its own).
_NEEDS_MPI_AND_SHM = pytest.mark.skipif(
    not have_mpi() or not os.path.isdir("/dev/shm") or not os.path.exists("/proc/self/maps"),
    reason="needs mpi4py and mpiexec; the MPI libraries keep their segments in /dev/shm, and /proc names those a "
           "process maps")


def _stand_in(tmp_path) -> str:
    """A directory standing in for /dev/shm, by its real path (the one /proc names a mapped or open file by)."""
    shm = os.path.realpath(tmp_path / "shm")
    os.mkdir(shm)
    return shm


@pytest.fixture
def fake_shm(tmp_path, monkeypatch):
    """A stand-in for /dev/shm that this process's cleanup looks at instead."""
    from commkit import _mpiexec

    shm = _stand_in(tmp_path)
    monkeypatch.setattr(_mpiexec, "SHM", shm)
    return shm


def _touch(shm, name, size=4096):
    path = os.path.join(shm, name)
    with open(path, "wb") as f:
        f.write(os.urandom(size))
    return path


def test_only_new_unused_mpi_segments_of_this_user_are_removed(fake_shm):
    from commkit._mpiexec import remove_left_segments, shm_names

    _touch(fake_shm, "mpich_shm_older_0")
    before = shm_names()
    left = [_touch(fake_shm, name) for name in ("mpich_shm_5eed1e55_0", "sm_segment.host.0.1f2e3d4c.0")]
    _touch(fake_shm, "not_an_mpi_segment")
    held = open(_touch(fake_shm, "mpich_shm_held_0"), "rb")  # a job still running holds its segment open...
    with open(_touch(fake_shm, "sm_segment.host.0.mapped.0"), "r+b") as f:
        mapped = mmap.mmap(f.fileno(), 0)  # ...or only maps it, the descriptor closed
    others = os.geteuid() == 0
    if others:  # a file of another user (only root can make one)
        os.chown(_touch(fake_shm, "mpich_shm_someone_else_0"), 65534, 65534)
    try:
        removed = remove_left_segments(before, wait=0.0)
        assert sorted(removed) == sorted(os.path.basename(path) for path in left)
        assert not any(os.path.exists(path) for path in left)
        kept = {"mpich_shm_older_0", "not_an_mpi_segment", "mpich_shm_held_0", "sm_segment.host.0.mapped.0"}
        assert set(os.listdir(fake_shm)) == kept | ({"mpich_shm_someone_else_0"} if others else set())
    finally:
        held.close()
        mapped.close()
    # Once the job that held them has gone, they are removed too.
    assert sorted(remove_left_segments(before, wait=0.0)) == ["mpich_shm_held_0", "sm_segment.host.0.mapped.0"]


def _session(tmp_path, test_module: str):
    """Run a test session of ``test_module`` under this suite's conftest.py, its /dev/shm a stand-in that holds
    one MPI segment from before it began. Returns (the stand-in, the session's CompletedProcess)."""
    from commkit._mpiexec import run_group

    fake_shm = _stand_in(tmp_path)
    _touch(fake_shm, "mpich_shm_before_0")  # not the session's to remove
    session = tmp_path / "session"
    session.mkdir()
    shutil.copy(os.path.join(HERE, "conftest.py"), session / "conftest.py")
    # Replaced as the module is collected, before the session's net looks at /dev/shm.
    (session / "test_session.py").write_text(
        'import os\nfrom commkit import _mpiexec\n_mpiexec.SHM = os.environ["FAKE_SHM"]\n'
        + textwrap.dedent(test_module))
    env = dict(os.environ, FAKE_SHM=fake_shm, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:nbmake", str(session)]
    result = run_group(cmd, timeout=120, env=env, cwd=str(session))
    assert result.returncode == 0, result.stdout + result.stderr
    return fake_shm, result


LEAKY_SESSION = """
running = []


def test_a_job_that_left_its_segment():
    with open(os.path.join(_mpiexec.SHM, "mpich_shm_1eaced_0"), "wb") as f:
        f.write(b"segment")


def test_a_job_still_running_at_the_end():
    running.append(open(os.path.join(_mpiexec.SHM, "sm_segment.host.0.a11ve.0"), "wb"))
"""


def test_a_session_removes_and_lists_what_its_jobs_left_and_keeps_what_is_in_use(tmp_path):
    fake_shm, result = _session(tmp_path, LEAKY_SESSION)
    out = result.stdout + result.stderr
    assert "warning: MPI segments left in /dev/shm" in out
    assert os.path.join(fake_shm, "mpich_shm_1eaced_0") in out
    assert "a11ve" not in out and "mpich_shm_before_0" not in out
    # Kept: the session still held it when its net looked.
    assert sorted(os.listdir(fake_shm)) == ["mpich_shm_before_0", "sm_segment.host.0.a11ve.0"]


def test_a_session_whose_jobs_left_nothing_says_nothing(tmp_path):
    fake_shm, result = _session(tmp_path, "def test_nothing_left():\n    pass\n")
    assert "/dev/shm" not in result.stdout + result.stderr
    assert os.listdir(fake_shm) == ["mpich_shm_before_0"]


# A job's lines that write down the MPI segments this rank maps, once its MPI has made them: one file per rank
# ("mapped.<pid>") beside the job's script, written and closed before the job goes on. (Not printed: an abort ends
# the launcher's forwarding of the ranks' output, and once kept only "mapped:" of a line.)
WRITES_MAPPED = """
import os
with open("/proc/self/maps") as f:
    mapped = {line.split("/dev/shm/")[1].split()[0] for line in f if "/dev/shm/" in line}
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), f"mapped.{os.getpid()}"), "w") as f:
    f.write(" ".join(sorted(name for name in mapped if name.startswith(("mpich_shm_", "sm_segment.")))))
"""


def _still_there(job_dir, nprocs: int = 2) -> list:
    """The segments the job's ranks wrote down as mapped (:data:`WRITES_MAPPED`) that are still in /dev/shm."""
    files = sorted(job_dir.glob("mapped.*"))
    assert len(files) == nprocs, files  # else a rank never got there
    mapped = {name for path in files for name in path.read_text().split()}
    assert mapped, files  # else the job made no segment and the test proves nothing
    return sorted(name for name in mapped if os.path.exists(os.path.join("/dev/shm", name)))


def _job(tmp_path, code: str):
    """``code`` as a script in ``tmp_path``, and an environment that finds this checkout's commkit."""
    job = tmp_path / "job.py"
    job.write_text(code)
    return job, dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))


ABORTS = """
from mpi4py import MPI

comm = MPI.COMM_WORLD
comm.Barrier()  # every rank has made or attached the library's segments
""" + WRITES_MAPPED + """
comm.Barrier()
if comm.Get_rank() == 1:
    comm.Abort(3)
comm.Barrier()
"""

STARTS_ITS_OWN_JOB = """
import subprocess
import sys

from commkit._mpiexec import mpiexec_command

# As `commkit bench -n 2` and the benchmark scripts do: the job in a session of its own, waited for.
sys.exit(subprocess.Popen(mpiexec_command(2, [sys.executable, sys.argv[1]]), start_new_session=True).wait())
"""


@pytest.mark.mpi
@_NEEDS_MPI_AND_SHM
def test_a_program_run_in_a_group_that_starts_an_aborting_job_leaves_no_segment(tmp_path):
    from commkit._mpiexec import run_group

    job, env = _job(tmp_path, ABORTS)
    result = run_group([sys.executable, "-c", STARTS_ITS_OWN_JOB, str(job)], timeout=120, env=env)
    assert result.returncode == 3, result.stdout + result.stderr
    assert not _still_there(tmp_path)


# A pytest process that starts MPI itself (a test module importing mpi4py.MPI), as the test session's conftest
# ends it: the segments its MPI mapped, printed before, and what _end_own_mpi removed.
OWN_MPI = """
import os
import sys

sys.path.insert(0, sys.argv[1])
import conftest
from mpi4py import MPI

assert MPI.COMM_WORLD.Get_size() == 1
with open("/proc/self/maps") as f:
    print("mapped:", *sorted({line.split("/dev/shm/", 1)[1].split()[0] for line in f if "/dev/shm/" in line}))
print("removed:", *conftest._end_own_mpi())
"""


@pytest.mark.mpi
@_NEEDS_MPI_AND_SHM
def test_a_test_process_that_started_mpi_itself_leaves_no_segment():
    # Open MPI 5.0.11's singleton left its 16 MiB sm_segment file behind, once per pytest worker and run.
    lines = _run_alone(OWN_MPI, HERE)
    mapped, removed = lines["mapped"], lines["removed"]
    assert set(removed) <= set(mapped)
    assert not [name for name in mapped if os.path.exists(os.path.join("/dev/shm", name))], (mapped, removed)


def _run_alone(code: str, *args: str) -> dict:
    """Run ``code`` in a Python process of its own, a singleton (no launcher's variables), and return its output's
    ``name: words`` lines as ``{name: [words]}``."""
    import subprocess

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    for name in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMIX_NAMESPACE"):
        env.pop(name, None)  # (a singleton even when the suite itself runs under a launcher)
    result = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    return {name: words.split() for name, sep, words in (line.partition(":") for line in result.stdout.splitlines())
            if sep and name in ("mapped", "removed")}


# A program started without mpiexec (a singleton), as a user runs one: commkit's own entry, or the face.
SINGLETON = """
import sys

import numpy as np

if sys.argv[1] == "init":
    import commkit

    assert commkit.init().allreduce(np.ones(4)).tolist() == [1.0] * 4
else:
    from mpi4py import MPI

    from commkit.compat.mpi4py import wrap

    assert wrap(MPI.COMM_WORLD).allreduce(2.5) == 2.5
with open("/proc/self/maps") as f:
    print("mapped:", *sorted({line.split("/dev/shm/", 1)[1].split()[0] for line in f if "/dev/shm/" in line}))
"""


@pytest.mark.mpi
@_NEEDS_MPI_AND_SHM
@pytest.mark.parametrize("entry", ["init", "wrap"])
def test_a_program_run_without_mpiexec_leaves_no_segment(entry):
    # Open MPI 5.0.11's singleton left a 16 MiB sm_segment file per run of `python script.py` (or notebook kernel).
    mapped = _run_alone(SINGLETON, entry)["mapped"]
    assert not [name for name in mapped if os.path.exists(os.path.join("/dev/shm", name))], mapped


# A commkit program whose rank raises: commkit's hook aborts the job (see transports.mpi.abort_job).
RAISES = """
import numpy as np

import commkit

comm = commkit.init()
comm.allreduce(np.ones(4))  # every rank has made or attached the library's segments
""" + WRITES_MAPPED + """
comm.barrier()
if comm.rank == 1:
    raise ValueError("a rank's own error")
comm.barrier()
"""


@pytest.mark.mpi
@_NEEDS_MPI_AND_SHM
def test_a_rank_that_raises_under_a_plain_mpiexec_leaves_no_segment(tmp_path):
    # MPICH's launcher removes nothing an aborted job leaves (2 MiB a node each time); the aborting rank unlinks
    # what it maps. Run as a user runs it: mpiexec itself, in a group of its own, with no cleanup after it.
    import subprocess

    from commkit._mpiexec import mpiexec_command, terminate_group

    job, env = _job(tmp_path, RAISES)
    proc = subprocess.Popen(mpiexec_command(2, [sys.executable, str(job)]), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        terminate_group(proc)
    assert proc.returncode != 0 and "rank 1 raised ValueError" in err, out + err
    assert not _still_there(tmp_path)
