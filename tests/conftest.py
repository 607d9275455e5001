"""Shared test fixtures: hypothesis profiles, the MPI job runner, and the net under /dev/shm.

Hypothesis profiles: ``ci`` (bounded, the default under CI=true) and ``thorough``
(local runs: ``HYPOTHESIS_PROFILE=thorough``); ``dev`` is the default otherwise.

An MPI job that does not end cleanly leaves its library's shared-memory segments
in /dev/shm, and nothing else ever removes them. Every job a test starts through
``run_mpi``, ``run_job``, ``run_group``, ``process_group`` or ``commkit.launch``
removes its own; a job started some other way is caught at the end of the
session, and listed, so that the test that leaked can be found and routed
through a helper.
"""

from __future__ import annotations

import os
import sys
import textwrap

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
settings.register_profile("dev", max_examples=50, deadline=None, suppress_health_check=list(HealthCheck))
settings.register_profile("thorough", max_examples=500, deadline=None, suppress_health_check=list(HealthCheck))
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))

HERE = os.path.dirname(os.path.abspath(__file__))
_SEGMENTS_BEFORE = pytest.StashKey[object]()
_SEGMENTS_LEFT = pytest.StashKey[list]()


def _bytecode_cache_outside_the_tree() -> str | None:
    """Where ``PYTHONDONTWRITEBYTECODE`` is set, cache this session's bytecode in a new temporary folder instead.

    The suite starts hundreds of Python processes (every rank of every MPI job,
    the pytest-xdist workers, the notebooks' and the CLI's runs), and each imports
    commkit from this tree. Without cached bytecode each compiles it again: 0.4 s
    of CPU per process (a 2-rank job doing one allreduce took 1.6 s of CPU, and
    1.0 s with the cache). The variable is honoured in the sense it is meant
    (nothing is written into the source tree): the session, and every process it
    starts, writes its bytecode under one temporary folder
    (``PYTHONPYCACHEPREFIX``), which :func:`pytest_unconfigure` removes. Runs as this file is imported, before
    pytest-xdist starts its workers, which inherit the setting. Returns the folder
    made here, or None where nothing was changed (the variable not set, or a
    prefix already chosen by the caller).
    """
    if not os.environ.get("PYTHONDONTWRITEBYTECODE") or os.environ.get("PYTHONPYCACHEPREFIX"):
        return None
    import tempfile

    folder = tempfile.mkdtemp(prefix="commkit-tests-pycache-")
    os.environ["PYTHONPYCACHEPREFIX"] = folder
    del os.environ["PYTHONDONTWRITEBYTECODE"]
    sys.pycache_prefix = folder  # this process's own later imports: the test modules, rewritten by pytest
    sys.dont_write_bytecode = False
    return folder


_PYCACHE_MADE_HERE = _bytecode_cache_outside_the_tree()

# Open MPI's TCP transport costs every rank 1.0 s of MPI_Init on this kind of machine (1.11 s against 0.10 s for
# a 2-rank Init without it: docs/troubleshooting.md), which was most of an Open MPI test job's wall time. Every
# job the suite starts runs on this one host, where Open MPI talks over shared memory (sm) whether or not TCP is
# loaded, so the suite leaves TCP out unless the caller chose the transports. MPICH ignores the variable.
os.environ.setdefault("OMPI_MCA_btl", "self,sm")


def pytest_unconfigure(config):
    """Remove the bytecode folder :func:`_bytecode_cache_outside_the_tree` made (in the process that made it), and
    the segment this process's own MPI leaves (:func:`_end_own_mpi`)."""
    _end_own_mpi()
    if _PYCACHE_MADE_HERE is not None:
        import shutil

        shutil.rmtree(_PYCACHE_MADE_HERE, ignore_errors=True)


def _end_own_mpi() -> list[str]:
    """Finalize the MPI this pytest process started itself, and remove the /dev/shm segment it leaves; their names.

    Test modules that use the mpi4py face in the test process import ``mpi4py.MPI``,
    which starts MPI there: a singleton, one per pytest process (each xdist
    worker). Open MPI 5.0.11's singleton leaves its 16 MiB ``sm_segment.*`` file
    in /dev/shm after ``MPI_Finalize``, still mapped until the process exits: every
    Open MPI run of the suite left one per worker (the session's sweep caught a
    worker that ended early, and warned). MPICH removes its own. Only a process
    that is no rank of a larger job does this (its MPI segments are then its
    singleton's alone), after finalizing, so nothing can attach to them any more.
    (commkit's MPI transport unlinks it at exit too, :func:`commkit.transports.mpi.forget_singleton_segment`,
    but only in a process that imports it, and an xdist worker may end without running exit handlers.)
    """
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized() or mpi.COMM_WORLD.Get_size() != 1:
        return []
    mpi.Finalize()
    from commkit._mpiexec import remove_own_segments

    return remove_own_segments()


def have_mpi() -> bool:
    try:
        import mpi4py  # noqa: F401

        from commkit._mpiexec import find_mpiexec

        find_mpiexec()
        return True
    except Exception:
        return False


_SKIP_WITHOUT_MPI = pytest.mark.skipif(not have_mpi(), reason="needs mpi4py and mpiexec (pip install 'commkit[mpi]')")


def requires_mpi(test):
    """Skip ``test`` where MPI is unavailable, and mark it ``mpi``: a test that needs mpiexec starts MPI jobs.

    The mark puts it with the other MPI jobs (one at a time, see
    :func:`pytest_collection_modifyitems`) and into ``.ci/run``'s Open MPI run.
    This decorator was once the skip alone: four tests of test_lifetime.py and
    one of test_transport_checks.py started their jobs beside the MPI group's and
    never ran on Open MPI.
    """
    return pytest.mark.mpi(_SKIP_WITHOUT_MPI(test))


def benchmark_module(name: str):
    """Import ``benchmarks/<name>.py`` (a helper module of the benchmark scripts, such as ``_report``)."""
    import importlib

    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


# Set by an outer mpiexec or commkit command; a benchmark script that starts its own job must not see them.
OUTER_JOB_VARIABLES = ("PMI_RANK", "PMI_SIZE", "PMI_FD", "PMI_PORT", "HYDRA_CONTROL_FD", "COMMKIT_CLI_CHILD")


def run_benchmark(argv, timeout=120, env=None) -> str:
    """Run a benchmark script that starts its own mpiexec job, in a process group of its own: the group is ended
    on a timeout, and whatever the job left in /dev/shm is removed (``run_group``). Its stdout, once it has
    exited 0 with no traceback."""
    from commkit._mpiexec import run_group

    full = {k: v for k, v in os.environ.items() if k not in OUTER_JOB_VARIABLES}
    full.update(env or {})
    result = run_group([sys.executable, *argv], timeout=timeout, env=full, cwd=os.path.dirname(HERE))
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert "Traceback" not in result.stderr, result.stderr
    return result.stdout


def run_benchmark_as_main(mpi, argv, timeout=120) -> str:
    """Run a benchmark script that runs under mpiexec (it starts no job of its own) as each of 2 ranks' main
    program, with arguments ``argv[1:]`` (``mpi``: the fixture); its stdout, once it has exited 0 with no
    traceback."""
    code = f"""
    import runpy
    import sys

    sys.argv = {list(argv)!r}
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as exc:
        assert not exc.code, exc.code
    """
    result = mpi(2, code, timeout=timeout)
    assert "Traceback" not in result.stderr, result.stderr
    return result.stdout


def run_mpi(nprocs: int, code: str, *, timeout: float = 120, env: dict | None = None, args=(), check=True):
    """Run Python ``code`` on ``nprocs`` MPI ranks (``python -m mpi4py``, so an uncaught
    exception aborts the whole job). Returns the CompletedProcess; with ``check`` a
    non-zero exit fails the test showing every rank's output.
    """
    from commkit._mpiexec import run_job

    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False, dir=None) as f:
        f.write(textwrap.dedent(code))
        path = f.name
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), HERE, full_env.get("PYTHONPATH", "")])
    full_env.setdefault("COMMKIT_TIMEOUT", "60")
    if env:
        full_env.update(env)
    try:
        result = run_job(nprocs, [sys.executable, "-m", "mpi4py", path, *map(str, args)], timeout=timeout, env=full_env)
    finally:
        os.unlink(path)
    if check and result.returncode != 0:
        pytest.fail(f"mpiexec -n {nprocs} exited {result.returncode}\n--- stdout ---\n{result.stdout}\n--- stderr ---\n{result.stderr}")
    return result


def mpi_segments() -> set | None:
    """The MPI libraries' files in /dev/shm now (None where there is no /dev/shm)."""
    from commkit._mpiexec import _SEGMENT_PREFIXES, shm_names

    names = shm_names()
    return None if names is None else {name for name in names if name.startswith(_SEGMENT_PREFIXES)}


def segments_left(before: set | None, settle: float = 2.0) -> list[str]:
    """The MPI segments made since ``before`` (:func:`mpi_segments`) that no process uses, still there ``settle`` s on.

    /dev/shm is the machine's. While a test checks it, a job of the other
    pytest-xdist worker may be starting (its new file already held open) or
    ending (its file closed and about to be unlinked by MPI): such a file is gone
    within moments, where one a job left stays. [] where there is no /dev/shm.
    """
    if before is None:
        return []
    import time

    from commkit._mpiexec import _in_use

    deadline = time.monotonic() + settle
    while True:
        left = sorted((mpi_segments() or set()) - before - _in_use())
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


@pytest.fixture
def mpi():
    """The :func:`run_mpi` helper, skipping the test where MPI is unavailable."""
    if not have_mpi():
        pytest.skip("needs mpi4py and mpiexec (pip install 'commkit[mpi]')")
    return run_mpi


@pytest.fixture(autouse=True)
def _mpi_jobs_only_in_mpi_tests(request, monkeypatch):
    """Fail a test not marked ``mpi`` that starts an MPI job through commkit's launchers.

    An unmarked test's job runs beside the MPI group's (two jobs on the cores at
    once) and never on Open MPI in ``.ci/run``: five tests did so unseen until a
    watcher on /dev/shm caught their segments. Every launcher in this process
    builds its command with ``mpiexec_command`` (``run_job``, ``commkit.launch``,
    the CLI's ``-n``), so in an unmarked test that function refuses, and the test
    fails naming the fix (also where the caller swallowed the error).
    """
    if request.node.get_closest_marker("mpi") is not None:
        yield
        return
    from commkit import _launch, _mpiexec, cli

    started = []

    def refuse(nprocs, argv, **kwargs):
        started.append(argv)
        raise RuntimeError(f"{request.node.nodeid} starts an MPI job ({nprocs} ranks) but is not marked mpi: ask for "
                           "the mpi fixture, decorate it with @requires_mpi, or mark it @pytest.mark.mpi.")

    for module in (_mpiexec, _launch, cli):
        monkeypatch.setattr(module, "mpiexec_command", refuse)
    yield
    if started:
        pytest.fail(f"{request.node.nodeid} started an MPI job but is not marked mpi (see the error above).",
                    pytrace=False)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Mark every test that starts MPI jobs ``mpi``, and keep those tests on one pytest-xdist worker.

    A test that asks for the :func:`mpi` fixture launches mpiexec, so it is an
    ``mpi`` test whether or not it says so (``-m "not mpi"`` leaves it out, and
    ``.ci/run`` runs it again on Open MPI). Under pytest-xdist (``-n``, on by
    default: see pytest.ini) the ``mpi`` tests form one group, run one after
    another on one worker while the other workers run the threads-world tests:
    two MPI jobs at once would put twice the ranks on the machine's cores, and the
    jobs' timeouts were chosen for one job at a time. Runs first, so that ``-m``
    sees the marks added here.
    """
    for item in items:
        if "mpi" in getattr(item, "fixturenames", ()) and item.get_closest_marker("mpi") is None:
            item.add_marker(pytest.mark.mpi)
        if item.get_closest_marker("mpi") is not None:
            item.add_marker(pytest.mark.xdist_group("mpiexec"))


class _GroupInTheNodeId:
    """Put the ``xdist_group`` name into each grouped test's node id, where pytest-xdist's own hook no longer can.

    ``--dist loadgroup`` tells groups apart by a suffix of the node id
    (``...::test[2]@mpiexec``) that the worker's hook writes into ``item._nodeid``;
    since pytest 9.2 a node id is read from ``item._id`` instead, the suffix is
    lost, and the ``mpi`` tests ran two at a time on the two workers, twice the
    ranks on the cores (pytest-dev/pytest-xdist#1386). Runs after that hook and
    adds the suffix only where it is missing, so it does nothing on the versions
    where pytest-xdist's own works.
    """

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config, items):
        for item in items:
            names = sorted({str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
                            for mark in item.iter_markers("xdist_group")})
            nodeid = item.nodeid
            if not names or nodeid.rfind("@") > nodeid.rfind("]"):
                continue
            grouped = f"{nodeid}@{'_'.join(names)}"
            if hasattr(item, "_id"):
                from _pytest.nodeid import NodeId

                item._id = NodeId.parse(grouped)
            else:
                item._nodeid = grouped


def pytest_configure(config):
    """On a pytest-xdist worker that distributes by group, make sure the groups reach the scheduler."""
    if hasattr(config, "workerinput") and config.getvalue("loadgroup"):
        config.pluginmanager.register(_GroupInTheNodeId(), "commkit-xdist-group")


def _controller(config) -> bool:
    """Whether this process runs the session as a whole (not a pytest-xdist worker, which runs a share of it)."""
    return not hasattr(config, "workerinput")


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session):
    """Note which MPI segments are in /dev/shm before the session's first test (see :func:`pytest_sessionfinish`).

    Once the tests are collected (a test module may point ``_mpiexec.SHM``
    elsewhere as it is imported) and before any runs, workers included: a
    pytest-xdist worker runs its first test only when this process, in its
    own loop, hands it one. Returns None, so the loop itself runs next.
    """
    if _controller(session.config):
        from commkit import _mpiexec

        session.config.stash[_SEGMENTS_BEFORE] = _mpiexec.shm_names()


def pytest_sessionfinish(session):
    """At the end of the session, remove the MPI segments left in /dev/shm since it began; the summary lists them.

    Only what :func:`commkit._mpiexec.remove_left_segments` would remove after a job:
    this user's ``mpich_shm_*``/``sm_segment.*`` files made during the session that
    no process maps or holds open (a job running beside the session keeps its own).
    Done by the process that runs the whole session, once every worker's jobs have
    ended; a worker that finished its share early would sweep while another
    worker's job is starting.
    """
    config = session.config
    before = config.stash.get(_SEGMENTS_BEFORE, None)  # (set only where the whole session runs)
    if before is not None:
        from commkit import _mpiexec

        # Every job of the session has ended: a file still in use is another session's.
        config.stash[_SEGMENTS_LEFT] = _mpiexec.remove_left_segments(before, wait=0.0)


def pytest_terminal_summary(terminalreporter, config):
    """Warn about the segments :func:`pytest_sessionfinish` had to remove, naming each."""
    left = config.stash.get(_SEGMENTS_LEFT, [])
    if not left:
        return
    from commkit._mpiexec import SHM

    terminalreporter.write_sep("=", "warning: MPI segments left in /dev/shm", yellow=True, bold=True)
    terminalreporter.write_line(
        f"removed {len(left)} file(s) that appeared during this session and that no process used: an MPI job that "
        "did not end cleanly left them, started other than through run_mpi, run_job, run_group, process_group or "
        "commkit.launch (which clean up after their own):")
    for name in left:
        terminalreporter.write_line(f"    {os.path.join(SHM, name)}")
