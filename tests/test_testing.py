"""Writing your own algorithm: the registry's safety, loading algorithms by module path, and commkit.testing.

A student's algorithm must never replace a built-in by accident, a bad
registration must fail with a sentence (also under ``python -O``), algorithms
in a module must reach every process (``COMMKIT_ALGORITHMS``, entry points),
and :func:`commkit.testing.check_algorithm` must pass the built-ins and catch
each kind of mistake with its smallest failing case.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import commkit as ck
from commkit import algorithms, testing
from commkit.schedule import Copy, Exchange, Recv, Reduce, Send, Transfer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = {"max_procs": 5, "sim_procs": 9, "timeout": 10}  # enough ranks for 3, 5 and a power of two


def copy_only(rank, size, count, op):
    """Not an allreduce at all: every rank returns its own input."""
    yield Copy(("out", 0, count), ("in", 0, count))


# -- the registry ---------------------------------------------------------------------------------------


def test_a_taken_name_is_refused_and_the_builtin_stays():
    ring = algorithms.get("allreduce", "ring")
    with pytest.raises(ck.InvalidArgument, match=r"allreduce algorithm 'ring' is already registered \(by "
                                                 r"commkit\.algorithms\.ring\.allreduce_ring\).*replace=True"):
        algorithms.algorithm("allreduce", "ring")(copy_only)
    assert algorithms.get("allreduce", "ring") is ring

    def body(comm):
        return comm.allreduce(np.ones(3), algorithm="ring")

    assert all(list(r) == [2.0] * 3 for r in ck.run_local(body, 2))


def test_replace_true_replaces_on_purpose():
    ring = algorithms.get("allreduce", "ring")
    try:
        algorithms.algorithm("allreduce", "ring", replace=True)(copy_only)
        assert algorithms.get("allreduce", "ring").schedule is copy_only
    finally:
        algorithms.REGISTRY[("allreduce", "ring")] = ring


def test_defining_the_same_function_again_is_not_a_clash():
    # A re-run notebook cell or a reloaded module defines a new function object with the same name.
    namespace = {}
    source = "def student_copy(rank, size, count, op):\n    yield from ()\n"
    try:
        for _ in range(2):
            exec(compile(source, "<cell>", "exec"), namespace)
            namespace["student_copy"].__module__ = "student_notebook"
            algorithms.algorithm("allreduce", "student_copy")(namespace["student_copy"])
        assert algorithms.get("allreduce", "student_copy").schedule is namespace["student_copy"]
        with pytest.raises(ck.InvalidArgument, match="already registered"):
            algorithms.algorithm("allreduce", "student_copy")(lambda rank, size, count, op: iter(()))
    finally:
        algorithms.unregister("allreduce", "student_copy")
    with pytest.raises(ck.InvalidArgument, match="cannot unregister allreduce algorithm 'student_copy'"):
        algorithms.unregister("allreduce", "student_copy")


@pytest.mark.parametrize("args,kwargs,message", [
    (("allreduxe", "x"), {}, r"unknown collective 'allreduxe'; expected one of \['barrier'"),
    (("allreduce", "my ring"), {}, "must be a Python identifier such as 'my_ring'"),
    (("allreduce", "auto"), {}, "'auto' is reserved"),
    (("allreduce", "native"), {}, "'native' is reserved"),
    (("allreduce", "x"), {"commutative": "yes"}, "commutative must be True or False, got 'yes'"),
    (("allreduce", "x"), {"scratch": 8}, r"scratch must be a function scratch\(rank, size, count\)"),
    (("allreduce", "x"), {"cost": lambda p, n, a, b, g: a}, "a cost function needs its formula as text"),
    (("allreduce", "x"), {"cost_exact": "mostly"}, r"cost_exact must be one of \['always', 'even', 'never'\]"),
    (("allreduce", "x"), {"cost_exact": "even"}, "needs cost_bound, one of"),
    (("allreduce", "x"), {"cost_bound": "lower"}, "but cost_exact='always' says it always is"),
    (("allreduce", "x"), {"replace": 1}, "replace must be True or False"),
])
def test_bad_registrations_raise_sentences(args, kwargs, message):
    with pytest.raises(ck.InvalidArgument, match=message):
        algorithms.algorithm(*args, **kwargs)(copy_only)


def test_registration_checks_survive_python_O():
    code = textwrap.dedent("""
        import commkit
        from commkit import algorithms
        bad_collective = lambda: algorithms.algorithm("allreduxe", "x")
        not_callable = lambda: algorithms.algorithm("allreduce", "x")(42)
        for attempt in (bad_collective, not_callable):
            try:
                attempt()
            except commkit.InvalidArgument:
                print("raised")
    """)
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.stdout.split() == ["raised", "raised"], out.stderr


def test_load_imports_a_module_and_exports_it_to_child_processes(tmp_path, monkeypatch):
    (tmp_path / "student_algs_a.py").write_text(textwrap.dedent("""
        from commkit.algorithms import algorithm
        from commkit.schedule import Copy

        @algorithm("broadcast", "student_local")
        def broadcast_student_local(rank, size, count, root):
            if rank == root:
                yield Copy(("out", 0, count), ("in", 0, count))
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(algorithms.ENV_VARIABLE, "already.there")
    try:
        found = algorithms.load("student_algs_a")
        assert [a.qualname for a in found] == ["broadcast_student_local"]
        assert os.environ[algorithms.ENV_VARIABLE] == "already.there,student_algs_a"
        assert "student_algs_a" in algorithms.loaded_modules()
        with pytest.raises(ck.InvalidArgument, match=r"cannot load algorithms from module 'no_such_mod_xyz' "
                                                     r"\(given to commkit.algorithms.load\): ModuleNotFoundError"):
            algorithms.load("no_such_mod_xyz")
        with pytest.raises(ck.InvalidArgument, match="expected a dotted module path"):
            algorithms.load("student algs")
    finally:
        algorithms.unregister("broadcast", "student_local")
        sys.modules.pop("student_algs_a", None)


def test_environment_variable_and_entry_points_are_read_at_first_use(tmp_path):
    (tmp_path / "student_algs_b.py").write_text(textwrap.dedent("""
        from commkit.algorithms import algorithm
        from commkit.schedule import Copy

        @algorithm("allreduce", "student_env")
        def allreduce_student_env(rank, size, count, op):
            yield Copy(("out", 0, count), ("in", 0, count))
    """))
    (tmp_path / "student_plugin.py").write_text(textwrap.dedent("""
        from commkit.algorithms import algorithm
        from commkit.algorithms.ring import allgather_ring

        algorithm("allgather", "plugin_ring")(allgather_ring)
    """))
    dist = tmp_path / "student_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: student-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[commkit.algorithms]\nring = student_plugin\n")
    code = textwrap.dedent("""
        import commkit
        from commkit import algorithms
        print(algorithms.get("allreduce", "student_env").qualname, algorithms.get("allgather", "plugin_ring").qualname)
        print(commkit.run_local(lambda c: int(c.allreduce(c.rank + 1, algorithm="student_env")), 2))
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT]), COMMKIT_ALGORITHMS="student_algs_b")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.stdout.split("\n")[:2] == ["allreduce_student_env allgather_plugin_ring", "[1, 2]"], out.stderr
    env["COMMKIT_ALGORITHMS"] = "student_algs_b,missing_student_mod"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode != 0
    assert ("cannot load algorithms from module 'missing_student_mod' (from the environment variable "
            "COMMKIT_ALGORITHMS): ModuleNotFoundError") in out.stderr


# -- commkit.testing ------------------------------------------------------------------------------------


@pytest.mark.parametrize("collective,name", [("allreduce", "recursive_doubling"), ("reduce_scatter", "ring"),
                                             ("gather", "binomial"), ("exscan", "recursive_doubling"),
                                             ("barrier", "dissemination")])
def test_builtin_algorithms_pass(collective, name):
    report = testing.check_algorithm(collective, name, **SMALL)
    assert report.ok, report.summary()
    assert "PASSED" in report.summary() and not report.registered_for_check
    assert report.raise_if_failed() is report


def test_a_wrong_result_is_reported_with_the_smallest_case():
    report = testing.check_algorithm("allreduce", copy_only, **SMALL)
    assert not report.ok and report.registered_for_check and report.algorithm == "check_copy_only"
    results = report.check("results equal NumPy's on the threads world, inputs untouched")
    smallest = results.smallest
    assert (smallest.case.p, smallest.case.count) == (2, 1)  # p = 1 and count = 0 are right by accident
    assert "got [" in smallest.message and "expected [" in smallest.message
    text = report.summary()
    assert "FAILED" in text and "smallest failing case: allreduce 'check_copy_only' with p=2, count=1" in text
    assert "commkit.testing.Case(collective='allreduce'" in text
    # The fresh name is gone after the check, and nothing else changed.
    assert algorithms.get("allreduce", "check_copy_only") is None
    with pytest.raises(testing.AlgorithmCheckFailed) as info:
        testing.check_algorithm("allreduce", copy_only, raise_on_failure=True, **dict(SMALL, dtypes=("int64",)))
    assert isinstance(info.value, AssertionError) and not info.value.report.ok


def ring_allreduce_reordering(rank, size, count, op):
    """The built-in ring, but claimed to keep rank order (commutative=False)."""
    yield from algorithms.get("allreduce", "ring").schedule(rank, size, count, op)


def test_a_false_claim_of_rank_order_is_caught():
    report = testing.check_algorithm("allreduce", ring_allreduce_reordering, name="ring",
                                     scratch=lambda r, p, n: -(-n // p), **SMALL)
    assert report.algorithm == "ring_2"  # a fresh name: "ring" is taken
    assert report.check("results equal NumPy's on the threads world, inputs untouched").passed
    order = report.check("non-commutative op reduced in rank order")
    assert not order.passed and order.smallest.case.op == "noncommutative" and order.smallest.case.p == 2
    assert "declare commutative=True" in report.summary()
    assert algorithms.get("allreduce", "ring").schedule.__name__ == "allreduce_ring"


def test_deadlock_small_scratch_and_written_input_are_caught():
    def allreduce_deadlock(rank, size, count, op):
        yield Copy(("out", 0, count), ("in", 0, count))
        if size > 1:
            yield Recv((rank + 1) % size, ("tmp", 0, count))
            yield Send((rank - 1) % size, ("in", 0, count))

    report = testing.check_algorithm("allreduce", allreduce_deadlock, scratch=lambda r, p, n: n, **SMALL)
    simulation = report.checks[0]
    assert not simulation.passed and simulation.smallest.case.p == 2
    assert simulation.smallest.message.startswith("deadlock: rank 0 waits at step 1")
    assert "commkit.sim.simulate('allreduce', 'check_allreduce_deadlock', 2, count=0).check()" in report.summary()

    def allreduce_in_place(rank, size, count, op):  # recursive doubling that reduces into its input
        mask = 1
        while mask < size:
            partner = rank ^ mask
            yield Exchange(partner, ("in", 0, count), partner, ("tmp", 0, count))
            yield Reduce(("in", 0, count), ("tmp", 0, count), op, operand_first=partner < rank)
            mask <<= 1
        yield Copy(("out", 0, count), ("in", 0, count))

    report = testing.check_algorithm("allreduce", allreduce_in_place, power_of_two=True, **SMALL)
    assert report.checks[0].failed  # no scratch declared: tmp[0:1] is outside its 0 elements
    assert "outside the 0 elements" in report.checks[0].smallest.message
    report = testing.check_algorithm("allreduce", allreduce_in_place, power_of_two=True,
                                     scratch=lambda r, p, n: n, **SMALL)
    results = report.check("results equal NumPy's on the threads world, inputs untouched")
    # The communicator refuses a schedule that writes "in" before anything is sent, naming the step.
    assert 'writes the caller\'s input "in" at step 1' in results.smallest.message
    assert results.smallest.case.p == 2


def test_a_crashing_schedule_is_one_failure_and_the_other_cases_still_run():
    def allreduce_crash_at_3(rank, size, count, op):
        if size == 3 and count == 1 and rank == 2:
            raise ZeroDivisionError("student bug")
        yield from algorithms.get("allreduce", "naive").schedule(rank, size, count, op)

    report = testing.check_algorithm("allreduce", allreduce_crash_at_3, scratch=lambda r, p, n: n,
                                     dtypes=("int64",), **SMALL)
    simulation = report.checks[0]
    assert [(f.case.p, f.case.count) for f in simulation.failures] == [(3, 1)]
    assert "ZeroDivisionError: student bug" in simulation.smallest.message
    # The case that crashed in the simulator is not run on threads: the other cases still run and pass,
    # and the result check counts it as skipped instead of claiming it.
    results = report.check("results equal NumPy's on the threads world, inputs untouched")
    assert results.failed == 0 and results.not_run == 1 and results.cases > 0 and not results.passed
    assert f"{results.cases} cases; 1 skipped, not checked" in report.summary()


def test_cases_a_deadlocking_schedule_cannot_run_are_reported_skipped_not_ok():
    def allreduce_recv_first(rank, size, count, op):
        """A student's ring that receives before it sends: every rank waits for its left neighbour."""
        yield Copy(("out", 0, count), ("in", 0, count))
        for _ in range(size - 1):
            yield Recv((rank - 1) % size, ("tmp", 0, count))
            yield Reduce(("out", 0, count), ("tmp", 0, count), op)
            yield Send((rank + 1) % size, ("in", 0, count))

    report = testing.check_algorithm("allreduce", allreduce_recv_first, scratch=lambda r, p, n: n, commutative=True,
                                     dtypes=("int64", "float32"), **SMALL)
    assert not report.ok
    results = report.check("results equal NumPy's on the threads world, inputs untouched")
    # Only p = 1 runs (no message to wait for); every case at p >= 2 deadlocks in the simulator.
    assert results.failed == 0 and results.not_run > 0 and not results.passed
    ring = algorithms.get("allreduce", "ring")  # commutative too: the same cases
    planned = [len(testing._data_cases(ring, p, ("int64", "float32"), None, 0)) for p in range(1, 6)]
    assert (results.cases, results.not_run) == (planned[0], sum(planned[1:]))
    text = report.summary()
    line = next(x for x in text.splitlines() if "results equal NumPy's" in x)
    assert line.startswith("  FAIL") and f"{results.not_run} skipped, not checked" in line, text
    assert "skipped: their schedules deadlock" in text
    assert report.failures and all(f is not None for f in report.failures)
    with pytest.raises(testing.AlgorithmCheckFailed):
        report.raise_if_failed()


def test_cost_formulas_are_held_to_their_declaration():
    fast = dict(SMALL, max_procs=3, dtypes=("int64",))  # the formula is what is checked here
    naive = algorithms.get("allreduce", "naive")
    # The ring's textbook formula, declared exact: wrong for counts that do not split evenly.
    ring = algorithms.get("allreduce", "ring")
    kw = dict(commutative=True, scratch=ring.scratch, cost=ring.cost, formula=ring.formula)
    report = testing.check_algorithm("allreduce", ring.schedule, **kw, **fast)
    formula = report.checks[-2]
    assert not formula.passed and "declared exact here" in formula.smallest.message
    report = testing.check_algorithm("allreduce", ring.schedule, cost_exact="even", cost_bound="lower", **kw, **fast)
    assert report.ok, report.summary()
    report = testing.check_algorithm("allreduce", ring.schedule, cost_exact="even", cost_bound="upper", **kw, **fast)
    assert "declared an upper bound" in report.checks[-2].smallest.message
    # A latency term that counts the wrong number of rounds.
    report = testing.check_algorithm("allreduce", naive.schedule, scratch=naive.scratch,
                                     cost=lambda p, n, a, b, g: (p - 1) * a, formula="(p-1)α", **fast)
    rounds = report.check("rounds on the critical path equal the formula's alpha terms")
    assert not rounds.passed and "rounds" in rounds.smallest.message
    assert testing.check_algorithm("allreduce", copy_only, **fast).check(
        "cost formula equals the simulation").skipped


def test_a_wrong_symmetry_declaration_is_caught():
    ring = algorithms.get("allreduce", "ring")

    def allreduce_lopsided(rank, size, count, op):  # rank 0 does less work than the others
        yield from ring.schedule(rank, size, count, op)
        if rank:
            yield Reduce(("tmp", 0, 1), ("tmp", 0, 1), op)

    report = testing.check_algorithm("allreduce", allreduce_lopsided, commutative=True, symmetry="rotation",
                                     scratch=lambda r, p, n: max(1, -(-n // p)), dtypes=("int64",), **SMALL)
    sym = report.check("declared symmetry 'rotation': rank 0 alone gives the full simulation's result")
    assert not sym.passed and sym.smallest.case.p == 2 and "differs from running every rank" in sym.smallest.message
    assert report.check("results equal NumPy's on the threads world, inputs untouched").passed
    assert testing.check_algorithm("allreduce", ring.schedule, commutative=True, symmetry="rotation",
                                   scratch=ring.scratch, dtypes=("int64",), **SMALL).ok


def test_a_barrier_that_lets_ranks_leave_early_is_caught():
    def barrier_broadcast_only(rank, size):
        if rank == 0 and size > 1:
            yield Transfer(sends=[(q, ("tmp", 0, 0)) for q in range(1, size)])
        elif rank:
            yield Recv(0, ("tmp", 0, 0))

    report = testing.check_algorithm("barrier", barrier_broadcast_only, **SMALL)
    waits = report.check("barrier: no rank leaves before the last one arrives")
    # On 2 ranks its one message is a barrier: a send completes only once the receive is posted.
    assert not waits.passed and waits.smallest.case.p == 3
    assert "with rank 1 arriving late, rank(s) [2] left before it arrived" in waits.smallest.message


def test_case_reruns_and_describes_itself():
    case = testing.Case("scan", "naive", 3, 2, "float32", "prod", seed=4)
    assert case.run() == [None, None, None]
    assert str(case) == "scan 'naive' with p=3, count=2, float32, op 'prod'"
    assert eval(repr(case), {"Case": testing.Case}) == case
    first = testing.Case("exscan", "naive", 2, 3, "complex128", "noncommutative")
    assert first.expected(0) is None  # no identity for a user op: rank 0 gets None


def test_check_algorithm_validates_its_arguments():
    with pytest.raises(ck.InvalidArgument, match="unknown allreduce algorithm 'rin'"):
        testing.check_algorithm("allreduce", "rin")
    with pytest.raises(ck.InvalidArgument, match=r"\['commutative'\] cannot be given with a registered"):
        testing.check_algorithm("allreduce", "ring", commutative=False)
    with pytest.raises(ck.InvalidArgument, match="has no schedule to check"):
        testing.check_algorithm("allreduce", "native")
    with pytest.raises(ck.InvalidArgument, match="unknown dtype"):
        testing.check_algorithm("allreduce", "ring", dtypes=("float128x",))
    with pytest.raises(ck.InvalidArgument, match="max_procs must be an int >= 1"):
        testing.check_algorithm("allreduce", "ring", max_procs=0)


def test_the_example_in_the_docs_passes(tmp_path):
    # docs/extending.md teaches with a chain allreduce; it must stay correct, and its formula exact.
    with open(os.path.join(ROOT, "docs", "extending.md"), encoding="utf-8") as f:
        page = f.read()
    source = page.split("```python\n", 1)[1].split("```", 1)[0]
    namespace = {"__name__": "extending_example"}
    exec(compile(source, "docs/extending.md", "exec"), namespace)
    try:
        report = testing.check_algorithm("allreduce", "chain", **SMALL)
        assert report.ok, report.summary()
    finally:
        algorithms.unregister("allreduce", "chain")


# -- plots for teaching -------------------------------------------------------------------------------------


def test_model_only_plot_is_not_titled_measured():
    pytest.importorskip("matplotlib")
    from commkit import plot

    fig = plot.predicted_vs_measured(collective="allreduce", nprocs=8, sizes=[2 ** k for k in range(4, 12)])
    title = fig.axes[0].get_title()
    assert "measured and predicted" not in title and "no measurements" in title
