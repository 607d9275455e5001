"""The suite's own layout: under pytest-xdist, the tests that start MPI jobs run one after another on one worker.

conftest.py marks every such test ``mpi`` and puts it in one ``xdist_group``; two
MPI jobs at once would put twice the ranks on the machine's cores, and the jobs'
timeouts were chosen for one job at a time. This broke once without a sound (a
pytest release changed where a node id is kept, and pytest-xdist's group suffix
was lost), so a small session under this suite's conftest checks it.
"""

from __future__ import annotations

import os
import shutil
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

SESSION = """
import os
import time

import pytest


def _note(tmp_path_factory, kind, i):
    where = tmp_path_factory.getbasetemp().parent.parent / "workers"
    where.mkdir(exist_ok=True)
    (where / f"{kind}.{i}").write_text(os.environ.get("PYTEST_XDIST_WORKER", "none"))


@pytest.mark.mpi
@pytest.mark.parametrize("i", range(6))
def test_marked(i, tmp_path_factory):
    _note(tmp_path_factory, "mpi", i)
    time.sleep(0.1)


@pytest.mark.parametrize("i", range(6))
def test_unmarked(i, tmp_path_factory):
    _note(tmp_path_factory, "threads", i)
    time.sleep(0.1)
"""


def test_the_mpi_tests_run_on_one_worker(tmp_path):
    pytest.importorskip("xdist", reason="needs pytest-xdist, which the test extra installs")
    from commkit._mpiexec import run_group

    session = tmp_path / "session"
    session.mkdir()
    shutil.copy(os.path.join(HERE, "conftest.py"), session / "conftest.py")
    (session / "test_session.py").write_text(SESSION)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    env.pop("PYTEST_XDIST_WORKER", None)
    (tmp_path / "base").mkdir()
    base = tmp_path / "base" / "run"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:nbmake", "-n", "2",
           "--dist", "loadgroup", "--basetemp", str(base), str(session)]
    result = run_group(cmd, timeout=120, env=env, cwd=str(session))
    assert result.returncode == 0, result.stdout + result.stderr
    notes = {path.name: path.read_text() for path in (tmp_path / "base" / "workers").iterdir()}
    mpi = {worker for name, worker in notes.items() if name.startswith("mpi.")}
    threads = {worker for name, worker in notes.items() if name.startswith("threads.")}
    assert len(notes) == 12 and threads <= {"gw0", "gw1"}, notes
    assert len(mpi) == 1 and mpi <= {"gw0", "gw1"}, notes  # the group, on one worker
