"""Check a new collective algorithm in one call: :func:`check_algorithm`.

Why one call. A schedule that is right for p = 4 and a count of 1024 can still
be wrong for p = 3, a count of 2, an empty vector, a root other than 0, a
non-commutative op or a dtype whose ufunc behaves differently; it can
deadlock only for some p; and its cost formula can be right only for powers
of two. The built-in algorithms are held to all of this by commkit's own
test-suite. A student writing a new algorithm should get the same scrutiny
without learning that test-suite, so this module runs it, as a library:

1. **Simulation** (:mod:`commkit.sim`) for p = 1 ... ``sim_procs``, awkward
   counts and several roots: no deadlock, every message meets a receive of
   its length, every buffer range inside the buffers the communicator
   allocates (a too small ``scratch`` declaration shows here). Cases that
   fail here are not run on threads, where they would hang or crash.
2. **Results against NumPy** on the threads world (:func:`commkit.run_local`)
   for p = 1 ... ``max_procs``, through the communicator's public API with the
   algorithm forced (``comm.allreduce(x, algorithm=name)``), exactly as a user
   calls it: counts 0, 1, below p and not divisible by p, every root, every
   dtype with every builtin op defined for it, and, where the algorithm says it
   keeps rank order (``commutative=False``), a non-commutative op. Inputs are
   chosen so that every reduction is exact in floating point (small integers,
   powers of two), so results must be bit-identical to NumPy's, whatever the
   order of reduction. The caller's input must be left untouched.
3. **The cost formula against the simulation**: exact where the registration
   says it is (``cost_exact``), on the declared side elsewhere
   (``cost_bound``), and its α coefficient equal to the rounds on the
   simulated critical path.
4. For barrier, which moves no data: no rank may leave before the last one
   arrives (simulated with each rank late in turn).
5. A declared ``symmetry`` (which lets the simulator run rank 0 alone) must
   give the same result as simulating every rank. Every other simulation here
   runs every rank, so a wrong declaration cannot hide a deadlock.

A schedule function that is not registered is registered under a fresh name
for the duration of the check and removed afterwards, so a student's
``"ring"`` never replaces the built-in one. The result is a :class:`Report`
that reads as a summary (what passed, what failed, the smallest failing case
and a hint) and can raise :class:`AlgorithmCheckFailed`, an
:class:`AssertionError`, for use inside pytest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from . import algorithms, collectives, sim
from .errors import CommError, InvalidArgument, RankError
from .ops import OPS, Op, get_op
from .schedule import Reduce

__all__ = ["check_algorithm", "Report", "Check", "Failure", "Case", "AlgorithmCheckFailed", "DTYPES",
           "NON_COMMUTATIVE"]

DTYPES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
          "float16", "float32", "float64", "complex64", "complex128")
"""Every dtype the check tries (each with every builtin op defined for it)."""

_REDUCING = collectives.REDUCING
_ROOTED = collectives.ROOTED
_MAX_FAILURES = 20  # per check: enough to find the smallest, few enough to stay readable


def _compose(first, then):
    """Compose affine maps x -> m*x + c, stored as complex numbers m + c*1j: apply ``first``, then ``then``."""
    return first.real * then.real + 1j * (first.imag * then.real + then.imag)


NON_COMMUTATIVE = Op(_compose, commutative=False, name="noncommutative", kinds="c")
"""An associative, non-commutative op on complex numbers (composition of affine maps): any reordering of
ranks changes the result, so an algorithm that claims to keep rank order is caught if it does not."""


def _op(name):
    return NON_COMMUTATIVE if name == NON_COMMUTATIVE.name else get_op(name)


class AlgorithmCheckFailed(AssertionError):
    """:func:`check_algorithm` found a problem; ``report`` holds everything it found.

    Attributes:
        report: the :class:`Report`.
    """

    def __init__(self, report: "Report"):
        super().__init__(report.summary())
        self.report = report


@dataclass(frozen=True)
class Case:
    """One collective call: which algorithm, on how many ranks, with which data.

    ``repr(case)`` is the constructor call, so a failing case can be pasted and
    re-run with :meth:`run` (while the algorithm is registered under ``algorithm``).

    Attributes:
        collective, algorithm: what runs (``algorithm`` is the registered name).
        p: number of ranks.
        count: elements per rank vector or block, as the schedule's count argument
            (a tuple of per-rank counts for reduce_scatter).
        dtype: NumPy dtype name.
        op: a builtin op's name, or ``"noncommutative"`` (:data:`NON_COMMUTATIVE`); None without reduction.
        root: the root of rooted collectives.
        seed: seeds every rank's data.
    """

    collective: str
    algorithm: str
    p: int
    count: object
    dtype: str = "int64"
    op: str | None = None
    root: int = 0
    seed: int = 0

    def __str__(self) -> str:
        parts = [f"p={self.p}"]
        if self.collective != "barrier":
            parts += [f"count={self.count}", self.dtype]
        if self.op is not None:
            parts.append(f"op {self.op!r}")
        if self.collective in _ROOTED:
            parts.append(f"root {self.root}")
        return f"{self.collective} {self.algorithm!r} with " + ", ".join(parts)

    @property
    def sort_key(self) -> tuple:
        """Sort key: smaller cases first (ranks, then elements, then dtype and op)."""
        total = sum(self.count) if isinstance(self.count, tuple) else self.count
        return (self.p, total, DTYPES.index(self.dtype) if self.dtype in DTYPES else 0, str(self.op), self.root)

    def input(self, rank: int) -> np.ndarray | None:
        """Rank ``rank``'s input array (the same on every call: a function of the case and the rank)."""
        c = self.collective
        if c == "barrier":
            return None
        if c in ("scatter", "alltoall"):
            shape = (self.p, self.count)
        elif c == "reduce_scatter":
            shape = (sum(self.count),)
        else:
            shape = (self.count,)
        return _values(np.random.default_rng([self.seed, self.p, rank]), shape, np.dtype(self.dtype), self.op)

    def expected(self, rank: int) -> np.ndarray | None:
        """The NumPy reference result on ``rank`` (None where the collective returns None)."""
        c, p, root = self.collective, self.p, self.root
        if c == "barrier":
            return None
        xs = [self.input(q) for q in range(p)]
        if c == "broadcast":
            return xs[root]
        if c in ("allreduce", "reduce"):
            return _fold(self.op, xs) if c == "allreduce" or rank == root else None
        if c == "scan":
            return _fold(self.op, xs[: rank + 1])
        if c == "exscan":
            if rank == 0:
                return _op(self.op).identity_array(xs[0].shape, xs[0].dtype)
            return _fold(self.op, xs[:rank])
        if c == "gather":
            return np.stack(xs) if rank == root else None
        if c == "allgather":
            return np.stack(xs)
        if c == "scatter":
            return xs[root][rank]
        if c == "alltoall":
            return np.stack([xs[q][rank] for q in range(p)])
        if c == "reduce_scatter":
            offsets = np.cumsum((0,) + tuple(self.count))
            return _fold(self.op, xs)[offsets[rank]: offsets[rank + 1]]
        raise InvalidArgument(f"unknown collective {c!r}.")

    def call(self, comm, x=None):
        """Run this case's collective on ``comm`` (one rank of a ``p``-rank world); return its result.

        ``x`` is this rank's input (default :meth:`input`).
        """
        c, kw = self.collective, {"algorithm": self.algorithm}
        if x is None:
            x = self.input(comm.rank)
        op = _op(self.op) if self.op is not None else None
        if c == "barrier":
            return comm.barrier(**kw)
        if c == "broadcast":
            return comm.broadcast(x, self.root, **kw)
        if c in ("allreduce", "scan", "exscan"):
            return getattr(comm, c)(x, op, **kw)
        if c == "reduce":
            return comm.reduce(x, op, self.root, **kw)
        if c in ("gather",):
            return comm.gather(x, self.root, **kw)
        if c == "allgather":
            return comm.allgather(x, **kw)
        if c == "scatter":
            out = np.empty(self.count, self.dtype)
            return comm.scatter(x if comm.rank == self.root else None, self.root, out=out, **kw)
        if c == "alltoall":
            return comm.alltoall(x, **kw)
        if c == "reduce_scatter":
            return comm.reduce_scatter(x, op, counts=list(self.count), **kw)
        raise InvalidArgument(f"unknown collective {c!r}.")

    def problem(self, comm) -> str | None:
        """Run the case on ``comm`` and describe what is wrong on this rank, or return None."""
        x = self.input(comm.rank)
        before = None if x is None else x.copy()
        got = self.call(comm, x)
        wrong = _compare(got, self.expected(comm.rank), comm.rank)
        if wrong is None and x is not None and not np.array_equal(x, before):
            changed = np.flatnonzero(x.reshape(-1) != before.reshape(-1))
            wrong = (f"rank {comm.rank}'s input was written (element {int(changed[0])} changed from "
                     f"{before.reshape(-1)[changed[0]]} to {x.reshape(-1)[changed[0]]})")
        return wrong

    def run(self, timeout: float | None = 20.0) -> list:
        """Run the case on a fresh threads world; return each rank's problem (None where right).

        Raises:
            RankError: a rank raised (the schedule crashed, or timed out after ``timeout`` s).
        """
        from ._world import run_local

        return run_local(self.problem, self.p, timeout=timeout)


def _values(rng, shape, dtype, op):
    """Random data on which every builtin op (and :data:`NON_COMMUTATIVE`) is exact in any order."""
    kind = dtype.kind
    if kind == "b":
        return rng.integers(0, 2, size=shape).astype(bool)
    if op == NON_COMMUTATIVE.name:
        return (rng.choice([-1.0, 1.0, 2.0], size=shape) + 1j * rng.integers(-3, 4, size=shape)).astype(dtype)
    if op == "prod":
        if kind == "c":
            return rng.choice(np.array([1, -1, 1j, -1j, 1 + 1j]), size=shape).astype(dtype)
        if kind == "f":
            return rng.choice([-2.0, -1.0, -0.5, 0.5, 1.0, 2.0], size=shape).astype(dtype)
        return rng.integers(-3 if kind == "i" else 1, 4, size=shape).astype(dtype)
    if kind in "iu":
        info = np.iinfo(dtype)  # wrapping integer sums are exact in any order too
        return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    if kind == "c":
        return (rng.integers(-8, 9, size=shape) + 1j * rng.integers(-8, 9, size=shape)).astype(dtype)
    return rng.integers(-8, 9, size=shape).astype(dtype)


def _fold(op_name, xs):
    op = _op(op_name)
    acc = np.array(xs[0], copy=True)
    for x in xs[1:]:
        acc = np.asarray(op.fn(acc, x)).astype(acc.dtype)
    return acc


def _show(a) -> str:
    text = np.array2string(np.asarray(a), threshold=8, edgeitems=3, max_line_width=200)
    return " ".join(text.split())


def _compare(got, exp, rank) -> str | None:
    if exp is None:
        return None if got is None else f"rank {rank} returned {_show(got)}, expected None"
    if got is None:
        return f"rank {rank} returned None, expected {_show(exp)}"
    got = np.asarray(got)
    if got.shape != exp.shape or got.dtype != exp.dtype:
        return (f"rank {rank} returned shape {got.shape} {got.dtype}, expected shape {exp.shape} {exp.dtype}")
    if not np.array_equal(got, exp):
        wrong = np.flatnonzero(got.reshape(-1) != exp.reshape(-1))
        return (f"rank {rank} got {_show(got)}, expected {_show(exp)} "
                f"({len(wrong)} of {exp.size} elements differ, first at index {int(wrong[0]) if len(wrong) else 0})")
    return None


@dataclass
class Failure:
    """One failing case.

    Attributes:
        case: the call that failed (a :class:`Case`), or None for a failure not tied to one call.
        message: what went wrong.
        rerun: Python code that reproduces it.
    """

    case: Case | None
    message: str
    rerun: str = ""

    def __str__(self) -> str:
        return f"{self.case}: {self.message}" if self.case is not None else self.message


@dataclass
class Check:
    """One kind of check and its outcome.

    Attributes:
        name: what was checked, in a few words.
        scope: which cases (e.g. ``"p = 1..8, 5 counts, every root"``).
        cases: how many cases ran.
        failures: the failing cases (at most a few dozen are kept), smallest first.
        failed: how many cases failed in all.
        skipped: why the check did not run, or None.
        not_run: how many of its cases could not run (their schedule failed in the simulator, so
            running them would hang or crash); a check with any such case has not passed.
        not_run_why: why they could not run, for the summary.
        hint: what usually causes such a failure.
        note: extra information for the summary (e.g. messages per rank).
    """

    name: str
    scope: str = ""
    cases: int = 0
    failures: list = field(default_factory=list)
    failed: int = 0
    skipped: str | None = None
    hint: str = ""
    note: str = ""
    not_run: int = 0
    not_run_why: str = ""

    @property
    def passed(self) -> bool:
        """Every case ran and none failed (a check skipped as a whole has nothing to fail)."""
        return not self.failed and not self.not_run

    def fail(self, case, message, rerun: str = "") -> None:
        self.failed += 1
        self.failures.append(Failure(case, message, rerun))
        if len(self.failures) > _MAX_FAILURES:
            self.failures.sort(key=_failure_key)
            del self.failures[_MAX_FAILURES:]

    @property
    def smallest(self) -> Failure | None:
        """The smallest failing case (fewest ranks, then fewest elements)."""
        return min(self.failures, key=_failure_key, default=None)


def _failure_key(f: Failure):
    return f.case.sort_key if f.case is not None else (0,)


@dataclass
class Report:
    """What :func:`check_algorithm` found.

    Attributes:
        collective: the collective.
        algorithm: the name the algorithm ran under.
        registered_for_check: the function was registered under ``algorithm`` for the check only.
        checks: every :class:`Check`, in the order run.
    """

    collective: str
    algorithm: str
    registered_for_check: bool = False
    checks: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Every check that ran passed."""
        return all(c.passed for c in self.checks)

    @property
    def failures(self) -> list:
        """The smallest failing case of every check with one (a check that only could not run has none)."""
        return [c.smallest for c in self.checks if c.failures]

    def check(self, name: str) -> Check:
        """The check called ``name``.

        Raises:
            KeyError: no check has that name.
        """
        for c in self.checks:
            if c.name == name:
                return c
        raise KeyError(f"no check named {name!r}; the checks are {[c.name for c in self.checks]}.")

    def summary(self) -> str:
        """The report as text: one line per check, and for each failure its smallest case and a hint."""
        how = " (registered under this name for the check)" if self.registered_for_check else ""
        verdict = "PASSED" if self.ok else "FAILED"
        lines = [f"check_algorithm: {self.collective} algorithm {self.algorithm!r}{how}: {verdict}"]
        for c in self.checks:
            if c.skipped:
                lines.append(f"  skip  {c.name}: {c.skipped}")
                continue
            status = "ok  " if c.passed else "FAIL"
            counted = f"{c.cases} case{'s' if c.cases != 1 else ''}"
            if c.failed:
                counted = f"{c.failed} of {counted} failed"
            if c.not_run:
                counted += f"; {c.not_run} skipped, not checked"
            lines.append(f"  {status}  {c.name} ({c.scope}): {counted}")
            if c.not_run:
                lines.append(f"        skipped: {c.not_run_why}")
            if c.note:
                lines.append(f"        {c.note}")
            if c.failures:
                lines.append(f"        smallest failing case: {c.smallest}")
                if c.smallest.rerun:
                    how = (f" (with the function registered as {self.algorithm!r})"
                           if self.registered_for_check else "")
                    lines.append(f"        to re-run it{how}: {c.smallest.rerun}")
                if c.hint:
                    lines.append(f"        hint: {c.hint}")
        return "\n".join(lines)

    __str__ = summary

    def raise_if_failed(self) -> "Report":
        """Return self, or raise :class:`AlgorithmCheckFailed` if any check failed."""
        if not self.ok:
            raise AlgorithmCheckFailed(self)
        return self


# -- the checks ---------------------------------------------------------------------------------


_UNSET = object()


def check_algorithm(collective: str, algorithm, *, max_procs: int = 8, sim_procs: int = 32, name: str | None = None,
                    commutative=_UNSET, power_of_two=_UNSET, scratch=_UNSET, cost=_UNSET, formula=_UNSET,
                    cost_exact=_UNSET, cost_bound=_UNSET, symmetry=_UNSET, dtypes=DTYPES, ops=None, seed: int = 0,
                    timeout: float = 20.0, raise_on_failure: bool = False) -> Report:
    """Check a collective algorithm against NumPy, the simulator and its own cost formula.

    Example::

        from commkit import testing

        def allreduce_my_ring(rank, size, count, op):
            ...  # yields Exchange/Reduce/Copy steps

        report = testing.check_algorithm("allreduce", allreduce_my_ring, commutative=True,
                                         scratch=lambda rank, size, count: count)
        print(report)                       # what passed, what failed, the smallest failing case
        report.raise_if_failed()            # or raise_on_failure=True: an AssertionError for pytest

    Args:
        collective: the collective it implements (:data:`commkit.algorithms.COLLECTIVES`).
        algorithm: a registered algorithm's name, or a schedule generator function. A
            function registered with :func:`commkit.algorithms.algorithm` is checked under
            its registration; any other function (or one given new declarations below) is
            registered under a fresh name for the check and removed afterwards.
        max_procs: run on threads for p = 1 ... max_procs (powers of two only if the
            algorithm needs them).
        sim_procs: simulate for p = 1 ... sim_procs.
        name: base of the fresh name (default ``check_`` + the function's name).
        commutative, power_of_two, scratch, cost, formula, cost_exact, cost_bound, symmetry: the
            declarations of :func:`commkit.algorithms.algorithm`, for a function checked
            under a fresh name (defaults as there); not allowed with a registered name.
        dtypes: dtype names to try (default :data:`DTYPES`, all of them).
        ops: builtin op names to try for reductions (default every one defined for each dtype).
        seed: seeds the data.
        timeout: seconds a threads-world call may wait for a message before it fails.
        raise_on_failure: raise :class:`AlgorithmCheckFailed` (an AssertionError) if a check fails.

    Returns:
        a :class:`Report`.

    Raises:
        InvalidArgument: an unknown collective or algorithm name, declarations given with
            a registered name, or bad sizes; the registration's own errors for a fresh one.
        AlgorithmCheckFailed: with ``raise_on_failure=True``, when a check fails.

    Cost: one to a few seconds at the defaults (a few thousand simulated calls, up to about
    a thousand threads-world calls).
    """
    if collective not in algorithms.COLLECTIVES:
        raise InvalidArgument(f"unknown collective {collective!r}; expected one of {list(algorithms.COLLECTIVES)}.")
    if collective not in collectives.FIXED:
        raise InvalidArgument(f"check_algorithm does not cover {collective} yet (the vector collectives' per-rank "
                              f"counts need a checker of their own); it covers {list(collectives.FIXED)}.")
    for arg, value, low in (("max_procs", max_procs, 1), ("sim_procs", sim_procs, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise InvalidArgument(f"{arg} must be an int >= {low}, got {value!r}.")
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown:
        raise InvalidArgument(f"unknown dtype(s) {unknown}; expected some of {list(DTYPES)}.")
    if ops is not None:
        bad = [o for o in ops if o not in OPS]
        if bad:
            raise InvalidArgument(f"unknown op(s) {bad}; expected builtin op names from {sorted(OPS)}.")
    declared = {k: v for k, v in (("commutative", commutative), ("power_of_two", power_of_two),
                                  ("scratch", scratch), ("cost", cost), ("formula", formula),
                                  ("cost_exact", cost_exact), ("cost_bound", cost_bound), ("symmetry", symmetry))
                if v is not _UNSET}
    alg, fresh = _resolve(collective, algorithm, name, declared)
    report = Report(collective, alg.name, fresh)
    try:
        sims = _Simulations(alg)
        _check_simulation(report, alg, sims, sim_procs, max_procs)
        if alg.symmetry is not None:
            _check_symmetry(report, alg, sims, sim_procs)
        if collective == "barrier":
            _check_barrier_waits(report, alg, min(sim_procs, 16))
        _check_results(report, alg, sims, max_procs, dtypes, ops, seed, timeout)
        _check_cost(report, alg, sims, sim_procs)
    finally:
        if fresh:
            algorithms.unregister(collective, alg.name)
    if raise_on_failure:
        report.raise_if_failed()
    return report


def _resolve(collective, algorithm, name, declared):
    """The Algorithm to check, and whether it was registered for the check."""
    if isinstance(algorithm, str):
        alg = algorithms.get(collective, algorithm)
        if alg is None:
            raise InvalidArgument(
                f"unknown {collective} algorithm {algorithm!r}; expected a schedule function or one of "
                f"{sorted(algorithms.for_collective(collective))}.")
        if declared:
            raise InvalidArgument(
                f"{sorted(declared)} cannot be given with a registered algorithm's name: {alg.qualname} is checked "
                "as registered. Pass the schedule function itself to check it with other declarations.")
        if alg.schedule is None:
            raise InvalidArgument(f"{alg.qualname} is the transport's own collective and has no schedule to check.")
        return alg, False
    if not callable(algorithm):
        raise InvalidArgument(
            f"check_algorithm expects a registered algorithm's name or a schedule generator function, "
            f"got {algorithm!r}.")
    if not declared and name is None:
        for alg in algorithms.for_collective(collective).values():
            if alg.schedule is algorithm:
                return alg, False
    base = name or "check_" + "".join(ch if ch.isalnum() or ch == "_" else "_"
                                      for ch in getattr(algorithm, "__name__", "schedule"))
    fresh, k = base, 2
    while algorithms.get(collective, fresh) is not None:
        fresh, k = f"{base}_{k}", k + 1
    algorithms.algorithm(collective, fresh, **declared)(algorithm)
    return algorithms.get(collective, fresh), True


def _procs(alg, top):
    return [p for p in range(1, top + 1) if not alg.power_of_two or algorithms.is_pow2(p)]


def _counts(collective, p):
    """Counts 0, 1, below p and not divisible by p (per-rank counts for reduce_scatter)."""
    if collective == "barrier":
        return [0]
    if collective == "reduce_scatter":
        shapes = [(0,) * p, (1,) * p, (3,) * p, tuple(q % 3 for q in range(p)),
                  tuple((5 * q + 2) % 7 for q in range(p)), (0,) * (p - 1) + (p + 1,)]
        return list(dict.fromkeys(shapes))
    return sorted({0, 1, max(p - 1, 1), p + 1, 2 * p + 3})


def _roots(collective, p):
    return sorted({0, p // 2, p - 1}) if collective in _ROOTED else [0]


def _sim_op(alg):
    if alg.collective not in _REDUCING:
        return "sum"
    return "sum" if alg.commutative else NON_COMMUTATIVE


class _Simulations:
    """Simulated calls by (p, count, root): what went wrong, or None. Shared by the checks, computed once."""

    def __init__(self, alg):
        self.alg = alg
        self.found: dict = {}
        self.results: dict = {}

    def problem(self, p, count, root):
        key = (p, count, root)
        if key not in self.found:
            alg = self.alg
            problem = res = None
            try:
                res = sim.simulate(alg.collective, alg.name, p, count=count, root=root, op=_sim_op(alg),
                                   use_symmetry=False)
                if res.waiting:
                    more = len(res.waiting) - 1
                    problem = f"deadlock: {res.waiting[0]}" + (f" (and {more} more ranks stuck)" if more else "")
                elif res.mismatches:
                    problem = f"message lengths differ: {res.mismatches[0]}"
            except CommError as exc:
                problem = str(exc)
            except Exception as exc:  # noqa: BLE001 - the schedule's own code raised
                problem = f"the schedule raised {type(exc).__name__}: {exc}"
            self.found[key] = problem
            self.results[key] = res
        return self.found[key]


def _check_simulation(report, alg, sims, sim_procs, max_procs) -> None:
    """Deadlocks, unmatched messages and bad ranges, for every p up to sim_procs."""
    scope = f"p = 1..{max(sim_procs, max_procs)}"
    if alg.collective != "barrier":
        scope += ", counts 0, 1, p-1, p+1, 2p+3"
    if alg.collective in _ROOTED:
        scope += ", roots 0, p/2, p-1"
    check = Check("simulation: no deadlock, messages matched, ranges inside buffers", scope,
                  hint="every send needs a receive of the same length posted by its peer (an Exchange for a "
                       "swap), in the same order per pair of ranks; a range of 'tmp' outside the buffer means "
                       "the scratch= declaration is too small.")
    report.checks.append(check)
    notes = []
    for p in _procs(alg, max(sim_procs, max_procs)):
        counts = _counts(alg.collective, p)
        for count in counts:
            for root in _roots(alg.collective, p):
                check.cases += 1
                problem = sims.problem(p, count, root)
                if problem is not None:
                    rooted = f", root={root}" if alg.collective in _ROOTED else ""
                    check.fail(Case(alg.collective, alg.name, p, count, root=root), problem,
                               f"commkit.sim.simulate({alg.collective!r}, {alg.name!r}, {p}, count={count!r}"
                               f"{rooted}).check()")
        res = sims.results.get((p, counts[-1], 0))
        if p in (2, 3, sim_procs) and res is not None and res.ok:
            lo, hi = min(res.messages), max(res.messages)
            notes.append(f"p={p}: {lo if lo == hi else f'{lo}-{hi}'}, {res.rounds}")
    if notes:
        check.note = "messages per rank and rounds at the largest count: " + "; ".join(notes)


def _check_symmetry(report, alg, sims, sim_procs):
    """The simulator trusts a declared symmetry and runs rank 0 alone: it must give what running every rank gives."""
    check = Check(f"declared symmetry {alg.symmetry!r}: rank 0 alone gives the full simulation's result",
                  f"p = 1..{sim_procs}, equal blocks",
                  hint="symmetry='rotation' promises that rank r's schedule is rank 0's with every peer shifted by "
                       "r (mod p) and ranges of the same lengths ('xor': peers XORed with r); leave symmetry out "
                       "if that is not so.")
    report.checks.append(check)
    op = _sim_op(alg)
    for p in _procs(alg, sim_procs):
        for count in _counts(alg.collective, p):
            if not algorithms.even_blocks(alg.collective, p, count):
                continue
            if sims.problem(p, count, 0) is not None:
                _not_run(check)
                continue
            check.cases += 1
            args = dict(count=count, op=op, alpha=1.0, beta=1e-3, gamma=1e-6)
            try:
                fast = sim.simulate(alg.collective, alg.name, p, **args)
                full = sim.simulate(alg.collective, alg.name, p, use_symmetry=False, **args)
            except Exception as exc:  # noqa: BLE001
                check.fail(Case(alg.collective, alg.name, p, count), f"simulating raised {type(exc).__name__}: {exc}")
                continue
            differ = [f for f in ("time", "rounds", "messages", "bytes_sent", "bytes_received", "bytes_reduced",
                                  "finish", "steps") if getattr(fast, f) != getattr(full, f)]
            if differ:
                check.fail(Case(alg.collective, alg.name, p, count),
                           f"running rank 0 alone differs from running every rank in {', '.join(differ)} "
                           f"(time {fast.time:.10g} s against {full.time:.10g} s)",
                           f"commkit.sim.simulate({alg.collective!r}, {alg.name!r}, {p}, count={count!r}, "
                           "use_symmetry=False)")


def _total(count):
    return sum(count) if isinstance(count, tuple) else count


def _check_barrier_waits(report, alg, top):
    check = Check("barrier: no rank leaves before the last one arrives", f"p = 2..{top}, each rank late in turn",
                  hint="every rank must hear, directly or through others, from every other rank before it returns.")
    report.checks.append(check)
    late = 1000.0
    for p in _procs(alg, top):
        if p < 2:
            continue
        for slow in range(p):
            check.cases += 1

            def steps(rank, p=p, slow=slow):
                if rank == slow:  # a stand-in for arriving late: a reduction that costs `late` seconds
                    yield Reduce(("tmp", 0, int(late)), ("tmp", 0, int(late)), NON_COMMUTATIVE)
                yield from alg.schedule(rank, p)

            try:
                res = sim.simulate_steps(steps, p, alpha=1.0, beta=0.0, gamma=1.0)
            except Exception as exc:  # noqa: BLE001
                check.fail(Case("barrier", alg.name, p, 0), f"the schedule raised {type(exc).__name__}: {exc}")
                continue
            early = [r for r, t in enumerate(res.finish) if t < late]
            if res.waiting:  # the simulation check says why
                check.cases -= 1
                _not_run(check)
                continue
            if early:
                check.fail(Case("barrier", alg.name, p, 0),
                           f"with rank {slow} arriving late, rank(s) {early} left before it arrived",
                           f"commkit.sim.simulate('barrier', {alg.name!r}, {p}, events=True).events")


def _data_cases(alg, p, dtypes, ops, seed):
    """The threads-world cases for p ranks: the main sweep, the dtype-and-op sweep, non-commutative ops."""
    c = alg.collective
    reducing = c in _REDUCING
    cases = []
    main_op = "sum" if reducing else None
    for count in _counts(c, p):
        for root in (range(p) if c in _ROOTED else [0]):
            cases.append(Case(c, alg.name, p, count, "int64", main_op, root, seed))
    if c != "barrier":
        count = _counts(c, p)[-1]
        for dtype in dtypes:
            kind = np.dtype(dtype).kind
            names = [o for o in (ops or OPS) if kind in OPS[o].kinds] if reducing else [None]
            for op in names:
                cases.append(Case(c, alg.name, p, count, dtype, op, p - 1 if c in _ROOTED else 0, seed))
    if reducing and not alg.commutative:
        for count in _counts(c, p):
            for root in (range(p) if c in _ROOTED else [0]):
                cases.append(Case(c, alg.name, p, count, "complex128", NON_COMMUTATIVE.name, root, seed))
    return list(dict.fromkeys(cases))


def _check_results(report, alg, sims, max_procs, dtypes, ops, seed, timeout):
    c = alg.collective
    procs = _procs(alg, max_procs)
    scope = f"p = {', '.join(map(str, procs))}" if alg.power_of_two else f"p = 1..{max_procs}"
    what = "counts 0, 1, p-1, p+1, 2p+3" if c != "barrier" else "no data"
    if c in _ROOTED:
        what += ", every root"
    if c != "barrier":
        what += f", {len(dtypes)} dtypes" + (" x every op defined for each" if c in _REDUCING else "")
    check = Check("results equal NumPy's on the threads world, inputs untouched", f"{scope}; {what}",
                  hint="compare with the NumPy reference in the case (Case.expected(rank)); the 'in' buffer "
                       "must never be written (copy into 'out' or 'tmp' first).")
    order = None
    if c in _REDUCING and not alg.commutative:
        order = Check("non-commutative op reduced in rank order", f"{scope}; counts 0, 1, p-1, p+1, 2p+3",
                      hint="the algorithm is declared commutative=False, so it must combine contributions in rank "
                           "order (Reduce(..., operand_first=True) when the operand holds lower ranks' data); "
                           "declare commutative=True if it reorders them.")
    report.checks.append(check)
    if order is not None:
        report.checks.append(order)
    elif c in _REDUCING:
        report.checks.append(Check("non-commutative op reduced in rank order",
                                   skipped="the algorithm is declared commutative=True, so the selector never "
                                           "gives it a non-commutative op"))
    for p in procs:
        # A case whose simulation fails would hang or crash here: the simulation check reports why, and
        # this check counts it as not run, and so not passed.
        cases = []
        for case in _data_cases(alg, p, dtypes, ops, seed):
            if sims.problem(p, case.count, case.root) is None:
                cases.append(case)
            else:
                _not_run(order if order is not None and case.op == NON_COMMUTATIVE.name else check)
        for case, problem in _run_cases(cases, p, timeout):
            target = order if order is not None and case.op == NON_COMMUTATIVE.name else check
            target.cases += 1
            if problem:
                target.fail(case, problem, f"commkit.testing.{case!r}.run()")


def _not_run(check, cases: int = 1) -> None:
    """Count cases of ``check`` that cannot run because their schedule failed in the simulator."""
    check.not_run += cases
    check.not_run_why = ("their schedules deadlock, mismatch or raise in the simulator (see the simulation "
                         "check), so running them would hang or crash; fix those first")


def _run_cases(cases, p, timeout):
    """Yield (case, problem or None) for every case, on as few threads worlds as crashes allow."""
    from ._world import run_local

    queue = list(cases)
    while queue:
        progress = [0] * p
        problems: dict = {}

        def body(comm, todo=tuple(queue), progress=progress, problems=problems):
            for i, case in enumerate(todo):
                progress[comm.rank] = i
                problem = case.problem(comm)
                if problem:
                    problems.setdefault(i, problem)
            progress[comm.rank] = len(todo)

        try:
            run_local(body, p, timeout=timeout)
        except RankError as exc:
            # Cases every rank finished stand; the crashed one fails; the rest run again on a fresh world.
            done, crashed = min(progress), progress[exc.rank]
            for i in range(done):
                yield queue[i], problems.get(i)
            yield queue[crashed], f"raised on rank {exc.rank}: {exc.message}"
            queue = queue[done:crashed] + queue[crashed + 1:]
            continue
        for i, case in enumerate(queue):
            yield case, problems.get(i)
        return


# Two machines for the formula: distinct scales (each term shows) and one where bandwidth and reduction dominate.
_MODELS = ((1.0, 1e-3, 1e-6), (1e-4, 1.0, 0.5))
_DIRECTION = {"lower": "a lower bound (never above the simulated time)",
              "upper": "an upper bound (never below the simulated time)",
              "either": "an estimate (within a factor of two either way)"}


def _check_cost(report, alg, sims, sim_procs):
    if alg.cost is None:
        report.checks.append(Check("cost formula equals the simulation",
                                   skipped="no cost formula declared (cost= and formula= in the registration)"))
        return
    exactness = "exact" if alg.cost_exact == "always" else (
        f"{_DIRECTION[alg.cost_bound]} for every call" if alg.cost_exact == "never" else
        f"exact for equal blocks, else {_DIRECTION[alg.cost_bound]}")
    check = Check(f"cost formula {alg.formula!r} against the simulation",
                  f"declared {exactness}; p = 1..{sim_procs}" + (
                      ", counts 0, 1, p-1, p+1, 2p+3 and equal blocks" if alg.collective != "barrier" else ""),
                  hint="the formula must be the simulated time where cost_exact says so (Transfer: k*alpha + "
                       "beta*max(bytes sent, received), after the peers have posted; Reduce: gamma*bytes); "
                       "declare cost_exact='even' and cost_bound= if it holds only for equal blocks, "
                       "cost_exact='never' if it is only a bound.")
    bound_only = alg.cost_exact == "never"
    rounds = Check("rounds on the critical path " + (f"bounded by the formula's alpha terms ({alg.cost_bound})"
                                                     if bound_only else "equal the formula's alpha terms"),
                   f"p = 1..{sim_procs}",
                   hint="the coefficient of alpha in the formula must count the messages on the longest chain of "
                        "dependent transfers, with k alpha for a transfer of k messages.")
    report.checks += [check, rounds]
    op = _sim_op(alg)
    itemsize = 4
    for p in _procs(alg, sim_procs):
        pof2 = 1 << (p.bit_length() - 1)
        counts = _counts(alg.collective, p)
        counts += [(p * pof2,) * p] if alg.collective == "reduce_scatter" else (
            [] if alg.collective == "barrier" else [p * pof2])
        for count in dict.fromkeys(counts):
            if sims.problem(p, count, 0) is not None:
                _not_run(check, len(_MODELS))
                _not_run(rounds)
                continue
            case = Case(alg.collective, alg.name, p, count)
            exact = alg.cost_is_exact(p, count)
            for i, (a, b, g) in enumerate(_MODELS):
                res = sim.simulate(alg.collective, alg.name, p, count=count, op=op, itemsize=itemsize,
                                   alpha=a, beta=b, gamma=g, use_symmetry=False)
                n = res.nbytes
                if i == 0:  # the critical path's rounds do not depend on the constants
                    rounds.cases += 1
                    want_rounds = float(alg.cost(p, n, 1.0, 0.0, 0.0))
                    if bound_only:  # the alpha terms bound the rounds as the formula bounds the time
                        wrong = _formula_problem(alg, False, res.rounds, want_rounds) is not None
                    else:
                        wrong = not math.isclose(res.rounds, want_rounds, rel_tol=1e-9, abs_tol=1e-9)
                    if wrong:
                        rounds.fail(case, f"the simulated critical path has {res.rounds} rounds, "
                                          f"the formula's alpha terms {want_rounds:g}",
                                    f"commkit.sim.simulate({alg.collective!r}, {alg.name!r}, {p}, "
                                    f"count={count!r}).rounds")
                want = float(alg.cost(p, n, a, b, g))
                check.cases += 1
                problem = _formula_problem(alg, exact, res.time, want)
                if problem:
                    model = f"alpha={a:g}, beta={b:g}, gamma={g:g}"
                    check.fail(case, f"{problem} ({model}, n={n} bytes)",
                               f"commkit.sim.simulate({alg.collective!r}, {alg.name!r}, {p}, count={count!r}, "
                               f"itemsize={itemsize}, {model}).time")


def _formula_problem(alg, exact, simulated, want) -> str | None:
    if math.isclose(simulated, want, rel_tol=1e-9, abs_tol=1e-12):
        return None
    error = (want - simulated) / simulated if simulated else math.inf
    text = f"formula {want:.10g} s, simulated {simulated:.10g} s" + (f" ({error:+.3g} relative)" if simulated else "")
    if exact:
        return f"{text}, but the formula is declared exact here"
    if alg.cost_bound == "lower" and error > 1e-9:
        return f"{text}, above the simulation, but the formula is declared a lower bound"
    if alg.cost_bound == "upper" and error < -1e-9:
        return f"{text}, below the simulation, but the formula is declared an upper bound"
    if alg.cost_bound == "either" and abs(error) > 1.0:
        return f"{text}: off by more than a factor of two, too far for an estimate"
    return None
