"""The notebooks under notebooks/ run top to bottom, each in under two minutes.

Each notebook is executed by nbmake, a maintained pytest plugin that runs a
notebook in a Jupyter kernel and fails on the first cell that raises. The
notebooks assert their own claims (results equal NumPy's, message counts
equal the formulas, the ranks follow the tuning file), so running them is the
test. nbmake runs in a pytest process of its own: a notebook starts a kernel,
threads and MPI jobs, and none of them should share this process. The
executed notebooks are not written back: the committed ones keep the outputs
of the run the docs show (made with nbclient, see docs/notebooks.md).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import have_mpi

pytest.importorskip("nbmake", reason="needs nbmake (pip install 'commkit[test]')")
pytest.importorskip("ipykernel", reason="needs ipykernel (pip install 'commkit[test]')")

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
# Each notebook runs in under two minutes on a 2-core machine. The
# limit covers the whole pytest process, kernel start-up included; today's
# notebooks take 5-20 s there, so only a real regression reaches it.
LIMIT = 120
# After the limit, pytest gets this long to shut the notebook's kernel down
# before its process group is killed. (Every MPI job a notebook starts has a
# launch timeout of its own, so none outlives the notebook for long.)
GRACE = 30
USE_MPI = {"01_getting_started.ipynb", "03_choosing_algorithms.ipynb"}


def _clean_env() -> dict:
    """This environment without commkit's settings: the notebooks show the defaults."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMMKIT_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def _run(notebook: Path) -> tuple[int, str, float]:
    """Run nbmake on ``notebook`` in a new process group; return (exit code, output, seconds).

    What the notebook's MPI jobs left in /dev/shm is removed afterwards (``process_group``).
    """
    from commkit._mpiexec import process_group

    cmd = [sys.executable, "-m", "pytest", "--nbmake", f"--nbmake-timeout={LIMIT}", "-p", "no:cacheprovider",
           "-q", "--no-header", "-o", "addopts=", str(notebook)]
    started = time.monotonic()
    with process_group(cmd, cwd=ROOT, env=_clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True) as proc:
        try:
            out, _ = proc.communicate(timeout=LIMIT)
        except subprocess.TimeoutExpired:
            # SIGINT lets pytest shut the kernel down the normal way; then nothing is left to chance.
            proc.send_signal(signal.SIGINT)
            try:
                out, _ = proc.communicate(timeout=GRACE)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, _ = proc.communicate()
            return -1, out, time.monotonic() - started
        return proc.returncode, out, time.monotonic() - started


def test_every_notebook_is_collected():
    assert {nb.name for nb in NOTEBOOKS} >= {
        "01_getting_started.ipynb", "02_how_the_algorithms_work.ipynb", "03_choosing_algorithms.ipynb",
        "04_exercises.ipynb", "05_node_aware.ipynb"}


def _params():
    needs_mpi = pytest.mark.skipif(not have_mpi(), reason="this notebook launches MPI jobs: needs mpi4py and "
                                                          "mpiexec (pip install 'commkit[mpi]')")
    return [pytest.param(nb, id=nb.stem, marks=[pytest.mark.mpi, needs_mpi] if nb.name in USE_MPI else [])
            for nb in NOTEBOOKS]


@pytest.mark.parametrize("notebook", _params())
def test_notebook_runs(notebook: Path):
    code, out, seconds = _run(notebook)
    if code == -1:
        pytest.fail(f"{notebook.name} did not finish within {LIMIT} s; stopped.\n{out[-6000:]}")
    assert code == 0, f"{notebook.name} failed (pytest --nbmake exit code {code}):\n{out[-6000:]}"
    assert seconds < LIMIT, f"{notebook.name} took {seconds:.0f} s; the limit is {LIMIT} s"
