"""Run mpi4py's own test-suite and demo programs with the commkit face in place of ``MPI.COMM_WORLD``.

mpi4py's tests take their communicator from ``MPI.COMM_WORLD`` (``COMM =
MPI.COMM_WORLD`` in each test class, read when the module is imported), and so
do its demos. This script fetches the source distribution of the installed
mpi4py from PyPI (``pip download --no-binary mpi4py --no-deps mpi4py==X``),
then runs each rank with ``MPI.COMM_WORLD`` replaced by
``commkit.compat.mpi4py.wrap(MPI.COMM_WORLD)`` before any test module or demo
is imported. Nothing of mpi4py's is copied into this repository; the sdist is
unpacked under ``--workdir``.

Tests: the modules named on the command line (by default the ones the face
concerns: communicators, point-to-point, requests, statuses and every
``test_cco_*``), each in one job per process count, first on plain mpi4py
(``raw``) and then through the face, and a table of passed / failed / errors /
skipped per module and process count, with every test that fails through the
face but not on plain mpi4py.

Demos (``--demos``): the MPI reference examples (``demo/mpi-ref-v1``), the
``reductions`` demo's tests, ``compute-pi`` and the ``osu_*`` benchmarks, each
run raw and through the face, their outputs compared (the benchmarks' timings
masked, and run with few iterations: the code is the demo's, called with
smaller ``skip``/``loop``/message-size arguments).

::

    python scripts/run_mpi4py_tests.py                  # tests, 1..4 processes
    python scripts/run_mpi4py_tests.py --np 2 --modules test_comm test_p2p_obj
    python scripts/run_mpi4py_tests.py --demos --np 2 3 # demos instead of tests

Not part of the default test run (it downloads, and takes minutes).
"""

from __future__ import annotations

import argparse
import glob
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULES = ["test_comm", "test_p2p_obj", "test_p2p_buf", "test_p2p_buf_matched", "test_p2p_obj_matched",
           "test_request", "test_status", "test_cco_*"]
# The osu demos' loop arguments, made small: the point is the calls, not the timings.
OSU_ARGS = {"skip": 2, "loop": 5, "skip_large": 1, "loop_large": 2, "skip_small": 2, "loop_small": 5,
            "large_message_size": 1024, "MAX_MSG_SIZE": 1 << 13}


# -- in each rank ------------------------------------------------------------------------------


def _inject(raw: bool) -> None:
    """Put the face in place of ``MPI.COMM_WORLD`` (``raw``: leave mpi4py as it is)."""
    from mpi4py import MPI

    if not raw:
        from commkit.compat.mpi4py import wrap

        MPI.COMM_WORLD = wrap(MPI.COMM_WORLD)


def _child_tests(testdir: str, report: str, modules: list[str], dlpack: bool) -> None:
    import unittest

    sys.path.insert(0, testdir)
    if not dlpack:
        # mpi4py's test DLPack producer (dlpackimpl.py) frees its tensor when its capsule
        # dies, even once a consumer has taken the tensor over: NumPy's own np.from_dlpack,
        # which the face uses, then calls a freed deleter and the process segfaults. Its
        # arrayimpl.py leaves out the DLPack backends when this import fails.
        sys.modules["dlpackimpl"] = None
    from mpi4py import MPI

    suite = unittest.TestLoader().loadTestsFromNames(modules)
    result = unittest.TextTestRunner(stream=io.StringIO(), verbosity=0).run(suite)

    def ids(pairs):
        return {case.id(): text.strip().splitlines()[-1] for case, text in pairs}

    rank = MPI.COMM_WORLD.Get_rank()
    with open(os.path.join(report, f"rank{rank}.json"), "w") as f:  # ranks' stdout lines may interleave
        json.dump({"rank": rank, "run": result.testsRun, "failures": ids(result.failures),
                   "errors": ids(result.errors), "skipped": len(result.skipped)}, f)


def _child_demo(path: str, args: list[str]) -> None:
    import runpy

    sys.argv = [path] + args
    sys.path.insert(0, os.path.dirname(path))
    runpy.run_path(path, run_name="__main__")


def _child_osu(path: str) -> None:
    import inspect
    import runpy

    name = os.path.basename(path)[:-3]
    function = runpy.run_path(path, run_name=name)[name]
    parameters = inspect.signature(function).parameters
    try:
        function(**{k: v for k, v in OSU_ARGS.items() if k in parameters})
    except SystemExit as exc:  # "This test requires ... processes": printed the same way raw and wrapped
        if exc.code:
            print(exc.code)


def child(argv: list[str]) -> None:
    raw = argv[0] == "raw"
    kind, rest = argv[1], argv[2:]
    _inject(raw)
    if kind == "tests":
        _child_tests(rest[0], rest[1], [m for m in rest[2:] if m != "--dlpack"], "--dlpack" in rest)
    elif kind == "demo":
        _child_demo(rest[0], rest[1:])
    else:
        _child_osu(rest[0])


# -- the driver ----------------------------------------------------------------------------------


def fetch(workdir: str) -> str:
    """The unpacked sdist of the installed mpi4py (downloaded once into ``workdir``)."""
    import mpi4py

    version = mpi4py.__version__
    source = os.path.join(workdir, f"mpi4py-{version}")
    if os.path.isdir(os.path.join(source, "test")):
        return source
    os.makedirs(workdir, exist_ok=True)
    # The sdist of mpi4py alone: with --no-binary :all: pip also builds its build requirements (Cython) from
    # source to read its metadata, which took over five minutes on a 2-core machine.
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", "mpi4py", "--no-deps",
                    f"mpi4py=={version}", "-d", workdir], check=True)
    with tarfile.open(os.path.join(workdir, f"mpi4py-{version}.tar.gz")) as tar:
        tar.extractall(workdir, filter="data")
    return source


def job(nprocs: int, argv: list[str], timeout: float, cwd: str | None = None, stdin: str | None = None):
    """Run this script's child mode on ``nprocs`` ranks: (exit code, stdout, stderr); code None on timeout."""
    sys.path.insert(0, ROOT)
    from commkit._mpiexec import mpiexec_command, process_group, terminate_group

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
               COMMKIT_ABORT_ON_EXCEPTION="0")
    cmd = mpiexec_command(nprocs, [sys.executable, os.path.abspath(__file__), "--child"] + argv)
    with process_group(cmd, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd) as proc:
        try:
            out, err = proc.communicate(stdin, timeout=timeout)
        except subprocess.TimeoutExpired:
            terminate_group(proc)
            out, err = proc.communicate()
            return None, out, err
        return proc.returncode, out, err


def run_tests(source: str, modules: list[str], nps: list[int], timeout: float, dlpack: bool) -> int:
    testdir = os.path.join(source, "test")
    names = []
    for pattern in modules:
        found = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(testdir, pattern + ".py")))
        names += [n for n in found if n not in names]
    bad = 0
    print(f"{'module':24} {'np':>2}  {'raw: run pass fail err skip':>29}  {'face: run pass fail err skip':>30}")
    for np_ in nps:
        for name in names:
            rows = {}
            for mode in ("raw", "face"):
                with tempfile.TemporaryDirectory() as report:
                    code, out, err = job(np_, [mode, "tests", testdir, report, name] + ["--dlpack"] * dlpack,
                                         timeout)
                    rows[mode] = _merge(report, code, err)
            raw, face = rows["raw"], rows["face"]
            print(f"{name:24} {np_:>2}  {_counts(raw):>29}  {_counts(face):>30}", flush=True)
            for test, why in sorted(face["broken"].items()):
                if test not in raw["broken"]:
                    bad += 1
                    print(f"    FACE ONLY  {test}: {why}")
            for test, why in sorted(raw["broken"].items()):
                print(f"    {'both' if test in face['broken'] else 'RAW ONLY'}  {test}: {why}")
    return bad


def _merge(report: str, code, err: str) -> dict:
    """One job's results over all ranks: rank 0's counts, and every test that failed on any rank."""
    ranks = []
    for path in glob.glob(os.path.join(report, "rank*.json")):
        with open(path) as f:
            ranks.append(json.load(f))
    if not ranks:
        tail = (err.strip().splitlines() or ["no output"])[-1]
        why = "timed out" if code is None else f"exit {code}: {tail}"
        return {"run": 0, "failed": 0, "errors": 0, "skipped": 0, "broken": {"<job>": why}}
    first = min(ranks, key=lambda r: r["rank"])
    broken = {}
    for r in ranks:
        broken.update(r["failures"])
        broken.update(r["errors"])
    failed, errors = len(first["failures"]), len(first["errors"])
    return {"run": first["run"], "failed": failed, "errors": errors, "skipped": first["skipped"], "broken": broken}


def _counts(r: dict) -> str:
    passed = r["run"] - r["failed"] - r["errors"] - r["skipped"]
    return f"{r['run']:>4} {passed:>4} {r['failed']:>4} {r['errors']:>3} {r['skipped']:>4}"


def _demos(source: str) -> list:
    """(name, child argv, directory to run in, stdin, mask timings)."""
    demo = os.path.join(source, "demo")
    found = []
    for path in sorted(glob.glob(os.path.join(demo, "mpi-ref-v1", "ex-*.py"))):
        found.append((f"mpi-ref-v1/{os.path.basename(path)}", ["demo", path], os.path.dirname(path), None, False))
    reductions = os.path.join(demo, "reductions", "test_reductions.py")
    found.append(("reductions/test_reductions.py", ["demo", reductions], os.path.dirname(reductions), None, False))
    for name in ("cpi-cco.py", "cpi-rma.py"):
        path = os.path.join(demo, "compute-pi", name)
        found.append((f"compute-pi/{name}", ["demo", path], os.path.dirname(path), "100\n1000\n0\n", False))
    for path in sorted(glob.glob(os.path.join(demo, "osu_*.py"))):
        found.append((os.path.basename(path), ["osu", path], demo, None, True))
    return found


_NUMBER = re.compile(r"\d+\.\d+(e[-+]?\d+)?")


def _normal(text: str, masked: bool) -> list[str]:
    """A demo's output to compare: its lines sorted (ranks print in any order), timings masked for the benchmarks."""
    lines = text.splitlines()
    if masked:  # a timing's width moves the columns too
        lines = [" ".join(_NUMBER.sub("T", line).split()) for line in lines]
    # unittest's "Ran N tests in 0.123s" differs in its timing alone
    lines = [re.sub(r" in \d+\.\d+s$", "", line) for line in lines]
    return sorted(lines)


def run_demos(source: str, nps: list[int], timeout: float) -> int:
    bad = 0
    for np_ in nps:
        for name, argv, cwd, stdin, masked in _demos(source):
            results = [job(np_, [mode] + argv, timeout, cwd=cwd, stdin=stdin) for mode in ("raw", "face")]
            (rc0, out0, err0), (rc1, out1, err1) = results
            same = rc0 == rc1 and _normal(out0, masked) == _normal(out1, masked) \
                and _normal(err0, True) == _normal(err1, True)
            verdict = "same" if same else "DIFFERENT"
            print(f"{name:36} np={np_}  raw exit {rc0}, face exit {rc1}: output {verdict}", flush=True)
            if not same:
                bad += 1
                print("    raw: " + (out0 + err0).strip().replace("\n", "\n         ")[-2000:])
                print("    face: " + (out1 + err1).strip().replace("\n", "\n          ")[-2000:])
    return bad


def main() -> int:
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--np", type=int, nargs="+", default=[1, 2, 3, 4], help="process counts (default 1 2 3 4)")
    parser.add_argument("--modules", nargs="+", default=MODULES, help="test modules (globs) to run")
    parser.add_argument("--demos", action="store_true", help="run the demo programs instead of the tests")
    parser.add_argument("--workdir", default=os.path.join(ROOT, "build", "mpi4py-sdist"),
                        help="where the sdist is downloaded and unpacked")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per job")
    parser.add_argument("--dlpack", action="store_true",
                        help="keep the test-suite's own DLPack array backends (they crash NumPy's from_dlpack)")
    args = parser.parse_args()
    source = fetch(args.workdir)
    if args.demos:
        bad = run_demos(source, args.np, args.timeout)
    else:
        bad = run_tests(source, args.modules, args.np, args.timeout, args.dlpack)
    print(f"{bad} {'demo runs differ' if args.demos else 'tests fail through the face only'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
