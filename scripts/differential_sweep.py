"""Differential correctness sweep: every collective x algorithm x call form against NumPy.

Each *scenario* is one (collective, algorithm, call form, op, dtype, count, p, seed)
run on every rank of a world, threads (:func:`commkit.run_local`, p = 1..8) or
``mpiexec`` (p = 2, 3), and checked on every rank against a NumPy reference built
from the deterministic per-rank payloads of ``tests/contracts.py`` (each rank's
input is a pure function of (seed, rank), so every rank computes the reference
alone and the code under test cannot corrupt it).

Call forms, each several calls of one scenario with fresh data every call:

* ``repeat``: the same arrays three times, refilled in place between calls (the
  third call runs the compiled plan for those arrays); results returned as new
  arrays must still hold their values after the later calls.
* ``new``: new arrays every call, three calls with a new ``out=`` and three
  without (the second of each compiles the shape plan, the third runs the
  fresh-array path of the collectives that have one); the vector collectives let
  the counts be exchanged (``counts=None``, or only this rank's row for alltoallv).
* ``inplace``: ``out=x``, for the collectives that allow it (broadcast, reduce,
  allreduce, scan, exscan): the same array three times, then a new one three
  times.
* ``timed``: ``timeout=30`` on every call.
* ``iform``: two ``i``-calls outstanding at once, waited in reverse order (the
  second starts from the first's cached schedule where the collective has a
  fresh-array path).
* ``persistent``: ``*_init`` once, then three ``start()``/``wait()`` rounds with the
  input refilled in between (not for the node engine's ``shm``, which refuses
  persistent requests by design, docs/node.md).
* ``plans_off``: ``comm.plans = False``: the interpreter, step by step.

Checks: the result equals the reference (exactly, except float/complex sum and
prod, held to contracts.py's tolerance); inputs are never modified (except by
``out=x`` where the result lands there; a non-root's ``x`` in an in-place reduce
must stay as it was); barrier lets no rank leave before every rank arrived
(threads); and where every rank gets the same result (allreduce, broadcast,
allgather, allgatherv), the ranks' results are the same bits. commkit promises
that for every non-reducing collective, for integer and bool reductions (exact),
and for floats only where docs/node.md says so (``shm``: every element is folded
by one rank in rank order). Float reductions by other algorithms that differ
across ranks are counted and shown, not failed: nothing promises otherwise.

The full product (about 1.2 million scenarios for threads p = 1..8 and mpiexec p = 2, 3)
is sampled down to ``--budget`` scenarios so that every (world, collective,
algorithm, form) cell gets the same share, as far as its size allows; ``--budget 0``
runs the whole product. Each world runs in a worker process (the script itself with
``--worker``; under ``mpiexec`` for MPI), watched for progress: a worker that hangs
for ``--hang-timeout`` seconds, or whose job dies, is ended with its whole process
group, the scenario it was in is reported, and the rest is run in a new worker.

Usage::

    python scripts/differential_sweep.py                      # full: threads 1-8, mpiexec 2,3, 200,000 scenarios
    python scripts/differential_sweep.py --quick              # a few hundred scenarios, seconds
    python scripts/differential_sweep.py --threads 1-4 --mpi none --collectives allreduce,scan --budget 5000
    python scripts/differential_sweep.py --repro '{"world": "threads", "p": 3, ...}'   # one scenario, in detail

Exit status 0 when nothing was wrong; 1 when any result was wrong, an unexpected
exception was raised, a worker hung or a scenario could not be run.

Duration. Measured on a 2-core machine shared with other jobs (so a quiet machine is
faster): a 20,000-scenario slice of the default run (``--budget 20000 --seed 11``, every
world, load average 2.7) took 91 s: about 1250 scenarios/s at threads p = 1, 470/s at
p = 3, 77/s at p = 8, and 940/s and 340/s under mpiexec p = 2, 3 (a 10,000 slice at load
3 to 6 took 71 s). The default full run (200,000 scenarios, 20,000 per world) took
948 s (199,114 scenarios, 2.5 million calls summed over ranks; load average 1 to 7, another
job running alongside); ``--budget 0`` (the whole product, 1.2 million) takes about 1.5 to
2.5 hours; ``--quick`` about 10 s for threads p = 1..8.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import zlib
from collections import Counter, defaultdict

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TESTS = os.path.join(ROOT, "tests")
# The sweep tests the commkit of the checkout it lives in, with that checkout's contracts.
for _path in (TESTS, ROOT):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import commkit as ck  # noqa: E402
from commkit import algorithms, collectives  # noqa: E402
from commkit._mpiexec import mpiexec_command, process_group  # noqa: E402

import contracts  # noqa: E402

FORMS = ("repeat", "new", "inplace", "timed", "iform", "persistent", "plans_off")
SAME_EVERYWHERE = ("allreduce", "broadcast", "allgather", "allgatherv")  # every rank gets the same result
DEFAULT_BUDGET = 200_000
QUICK_BUDGET = 300
TIMED = 30.0


# -- the scenarios ----------------------------------------------------------------------------------------------


def _shapes(collective: str, p: int, dtype: str) -> list[list]:
    """The shapes swept: 0-d where allowed, counts 0, 1, 3, 2p+1 (uneven vs p) and about 3 KiB (odd)."""
    kib = (3 * 1024 // np.dtype(dtype).itemsize) | 1
    counts = sorted({0, 1, 3, 2 * p + 1, kib})
    shapes = [[n] for n in counts]
    if collective != "reduce_scatter" and collective not in collectives.VECTOR:
        shapes.insert(0, [])
    return shapes


def _applies(form: str, collective: str, alg) -> bool:
    if form == "inplace":
        return collectives.get(collective).in_place
    if form == "persistent":
        return not algorithms.is_node_only(alg)  # docs/node.md: persistent requests refuse the arena
    return True


def _cells(world: str, p: int, names) -> dict:
    """``{(collective, algorithm, form): [(op, dtype, shape), ...]}`` for one world."""
    cells = {}
    for coll in names:
        reducing = coll in collectives.REDUCING
        for name, alg in sorted(algorithms.for_collective(coll).items()):
            if name == "native" and world != "mpi":
                continue  # the threads world has no library of its own (commkit/algorithms/native.py)
            combos = []
            for dtype in contracts.DTYPES:
                for op in (contracts.OPS if reducing else (None,)):
                    if op is not None and not contracts.op_applies(op, dtype):
                        continue
                    if alg.why_not(p, ck.ops.get_op(op) if op else None) is not None:
                        continue
                    combos.extend((op, dtype, shape) for shape in _shapes(coll, p, dtype))
            if coll == "barrier":
                combos = [(None, None, None)]
            for form in FORMS:
                if combos and _applies(form, coll, alg):
                    cells[(coll, name, form)] = combos
    return cells


def _seed(global_seed: int, key) -> int:
    return zlib.crc32(json.dumps([global_seed, key]).encode()) & 0x7FFFFFFF


def _scenario(world, p, coll, name, form, op, dtype, shape, global_seed) -> dict:
    seed = _seed(global_seed, [world, p, coll, name, form, op, dtype, shape])
    rng = random.Random(seed)
    sc = {"world": world, "p": p, "collective": coll, "algorithm": name, "form": form, "op": op,
          "dtype": dtype, "shape": shape, "seed": seed, "root": seed % p}
    n = shape[0] if shape else 1
    if coll == "reduce_scatter":
        sc["shape"], sc["counts"] = [], [rng.randint(0, 2 * n) for _ in range(p)]
    elif coll == "alltoallv":
        per = math.ceil(n / p)
        sc["counts"] = [[rng.randint(0, 2 * per) for _ in range(p)] for _ in range(p)]
    elif coll in collectives.VECTOR:
        sc["counts"] = [rng.randint(0, 2 * n) for _ in range(p)]
    sc["count"] = None if coll == "barrier" else n if shape else "0-d"
    return sc


def plan(worlds, names, budget: int, global_seed: int) -> list[dict]:
    """The scenarios to run, numbered (``"i"``), every (world, collective, algorithm, form) cell represented.

    ``budget`` 0 takes every combination; otherwise each cell gets the same quota (all of it
    if smaller), the quota as large as the budget allows, and at least one scenario per cell.
    """
    rng = random.Random(global_seed)
    cells = {(world, p) + key: combos for world, p in worlds for key, combos in _cells(world, p, names).items()}
    if budget:
        sizes = sorted(len(c) for c in cells.values())
        quota, low, high = 1, 1, max(sizes, default=1)
        while low <= high:  # the largest quota whose total fits the budget
            mid = (low + high) // 2
            if sum(min(s, mid) for s in sizes) <= budget:
                quota, low = mid, mid + 1
            else:
                high = mid - 1
        # What the quota leaves of the budget goes one scenario each to cells drawn at random.
        bigger = [key for key, combos in cells.items() if len(combos) > quota]
        left = budget - sum(min(len(c), quota) for c in cells.values())
        extra = set(rng.sample(bigger, min(max(left, 0), len(bigger))))
    chosen = []
    for key, combos in cells.items():
        take = len(combos) if not budget else min(len(combos), quota + (key in extra))
        picked = combos if take == len(combos) else rng.sample(combos, take)
        chosen.extend(_scenario(*key, *combo, global_seed) for combo in picked)
    if budget and len(chosen) > budget:  # more cells than the budget: one scenario for a sample of them
        chosen = rng.sample(chosen, budget)
    order = {world: k for k, world in enumerate(worlds)}
    chosen.sort(key=lambda sc: (order[(sc["world"], sc["p"])], sc["collective"], sc["algorithm"], sc["form"]))
    for i, sc in enumerate(chosen):
        sc["i"] = i
    return chosen


# -- inputs and references --------------------------------------------------------------------------------------


def _case(sc: dict, k: int) -> dict:
    """contracts.py's case for call ``k`` of a scenario: each call draws new data (seed + k)."""
    case = {"collective": sc["collective"], "dtype": sc["dtype"], "shape": sc["shape"], "seed": sc["seed"] + k,
            "root": sc["root"]}
    if sc["op"] is not None:
        case["op"] = sc["op"]
    if "counts" in sc:
        case["counts"] = sc["counts"]
    return case


def _rows(sc: dict, rank: int) -> int:
    """Rows of ``rank``'s input to a vector collective."""
    coll, counts = sc["collective"], sc["counts"]
    if coll == "alltoallv":
        return sum(counts[rank])
    if coll == "scatterv":
        return sum(counts)
    return counts[rank]


def _vector_input(sc: dict, k: int, rank: int):
    return contracts.payload((_rows(sc, rank),), sc["dtype"], sc["seed"] + k, rank)


def make_input(sc: dict, k: int, rank: int):
    """Rank ``rank``'s ``x`` for call ``k`` (None where the collective reads none)."""
    coll = sc["collective"]
    if coll == "barrier" or (coll in ("scatter", "scatterv") and rank != sc["root"]):
        return None
    if coll in collectives.VECTOR:
        return _vector_input(sc, k, rank)
    # np.asarray: for a 0-d complex case contracts.py hands back a NumPy scalar, which a user would not pass.
    return np.asarray(contracts.collective_input(_case(sc, k), rank, sc["p"]))


def _vector_expected(sc: dict, k: int, rank: int):
    coll, p, counts, root = sc["collective"], sc["p"], sc["counts"], sc["root"]
    if coll == "gatherv" and rank != root:
        return None
    if coll in ("allgatherv", "gatherv"):
        return np.concatenate([_vector_input(sc, k, q) for q in range(p)])
    if coll == "scatterv":
        offsets = np.cumsum([0] + list(counts))
        return _vector_input(sc, k, root)[offsets[rank]:offsets[rank + 1]]
    blocks = []
    for q in range(p):  # alltoallv: the block every rank q sends to this rank, in rank order
        offsets = np.cumsum([0] + list(counts[q]))
        blocks.append(_vector_input(sc, k, q)[offsets[rank]:offsets[rank + 1]])
    return np.concatenate(blocks)


def mismatch(sc: dict, k: int, rank: int, got) -> str | None:
    """Why ``got`` is not call ``k``'s reference result on ``rank``, or None if it is."""
    if sc["collective"] == "barrier":
        return None if got is None else f"barrier returned {got!r}, expected None"
    case = dict(_case(sc, k), _rank=rank)
    if sc["collective"] in collectives.VECTOR:
        want = _vector_expected(sc, k, rank)
    else:
        want = contracts.expected(case, rank, sc["p"])
    try:
        contracts.assert_matches(case, got, want, sc["p"])
    except AssertionError as exc:
        first = str(exc).strip().splitlines()
        return " ".join(line.strip() for line in first[:8])
    return None


def result_shape(sc: dict, rank: int):
    """The shape of ``rank``'s result, or None where it gets none."""
    coll, p, shape, root = sc["collective"], sc["p"], tuple(sc["shape"] or ()), sc["root"]
    if coll == "barrier" or (coll in ("reduce", "gather", "gatherv") and rank != root):
        return None
    if coll in ("gather", "allgather", "alltoall"):
        return (p,) + shape
    if coll in ("reduce_scatter", "scatterv"):
        return (sc["counts"][rank],)
    if coll in ("allgatherv", "gatherv"):
        return (sum(sc["counts"]),)
    if coll == "alltoallv":
        return (sum(row[rank] for row in sc["counts"]),)
    return shape


def _needs_out(sc: dict, rank: int) -> bool:
    return sc["collective"] in ("scatter", "scatterv") and rank != sc["root"]


def _new_out(sc: dict, rank: int):
    shape = result_shape(sc, rank)
    return None if shape is None else np.empty(shape, sc["dtype"])


# -- one scenario on one rank ---------------------------------------------------------------------------------


def invoke(comm, sc: dict, x, out=None, *, kind: str = "", timeout=None, exchange: bool = False):
    """Call the scenario's collective the way a user does: ``kind`` "" (blocking), "i" or "init".

    ``exchange`` leaves the counts of a vector collective to be exchanged by the call
    (``counts=None``; for alltoallv only this rank's row of the matrix).
    """
    coll, op, root = sc["collective"], sc["op"], sc["root"]
    name = coll + "_init" if kind == "init" else kind + coll
    fn = getattr(comm, name)
    kw = {"algorithm": sc["algorithm"]}
    if out is not None:
        kw["out"] = out
    if timeout is not None:
        kw["timeout"] = timeout
    counts = sc.get("counts")
    if coll == "barrier":
        return fn(**kw)
    if coll in ("allreduce", "scan", "exscan"):
        return fn(x, op, **kw)
    if coll == "reduce":
        return fn(x, op, root, **kw)
    if coll == "reduce_scatter":
        return fn(x, op, counts=counts, **kw)
    if coll in ("broadcast", "gather", "scatter"):
        return fn(x, root, **kw)
    if coll in ("allgather", "alltoall"):
        return fn(x, **kw)
    if coll == "allgatherv":
        return fn(x, None if exchange else counts, **kw)
    if coll == "gatherv":
        return fn(x, root, None if exchange else counts, **kw)
    if coll == "scatterv":
        return fn(x, counts, root, **kw)
    if coll == "alltoallv":
        return fn(x, counts[comm.rank] if exchange else counts, **kw)
    raise AssertionError(coll)


class BarrierWitness:
    """Counts arrivals at each barrier call in a threads world: no rank may leave before all arrived."""

    def __init__(self, p: int):
        self.p = p
        self.lock = threading.Lock()
        self.arrived: Counter = Counter()

    def arrive(self, key) -> None:
        with self.lock:
            self.arrived[key] += 1

    def missing(self, key) -> int:
        with self.lock:
            return self.p - self.arrived[key]


class Checker:
    """Collects one rank's findings for one scenario: wrong results, touched inputs, the results' bits."""

    def __init__(self, sc: dict, rank: int, witness: BarrierWitness | None):
        self.sc, self.rank, self.witness = sc, rank, witness
        self.problems: list[dict] = []
        self.digest = hashlib.blake2b(digest_size=8)
        self.calls = 0

    def wrong(self, call: int, what: str) -> None:
        self.problems.append({"rank": self.rank, "call": call, "what": what})

    def before(self, call: int) -> None:
        if self.witness is not None and self.sc["collective"] == "barrier":
            self.witness.arrive((self.sc["i"], call))

    def result(self, call: int, k: int, got) -> None:
        """Check the result of call number ``call``, which used data ``k``."""
        self.calls += 1
        if self.witness is not None and self.sc["collective"] == "barrier":
            missing = self.witness.missing((self.sc["i"], call))
            if missing > 0:
                self.wrong(call, f"barrier returned while {missing} rank(s) had not arrived")
        why = mismatch(self.sc, k, self.rank, got)
        if why is not None:
            self.wrong(call, why)
        if got is not None:
            self.digest.update(np.ascontiguousarray(got).tobytes())

    def untouched(self, call: int, x, before: bytes | None, what: str = "the input x") -> None:
        if x is not None and x.tobytes() != before:
            self.wrong(call, f"{what} was modified by the call")


def _snapshot(x):
    return None if x is None else x.tobytes()


def _refill(x, sc, k, rank) -> None:
    if x is not None:
        x[...] = make_input(sc, k, rank)


def _blocking(comm, sc, chk, rank, *, timeout=None, calls=3):
    """The same arrays ``calls`` times, refilled between calls; earlier new results must stay intact."""
    x = make_input(sc, 0, rank)
    out = _new_out(sc, rank) if _needs_out(sc, rank) else None
    kept = []
    for k in range(calls):
        if k:
            _refill(x, sc, k, rank)
        before = _snapshot(x)
        chk.before(k)
        got = invoke(comm, sc, x, out, timeout=timeout)
        chk.untouched(k, x, before)
        chk.result(k, k, got)
        if out is None and got is not None:
            kept.append((k, got, got.copy()))
    for k, got, copy in kept:
        if got.tobytes() != copy.tobytes():
            chk.wrong(k, "a result returned as a new array changed during a later call")


def _new_arrays(comm, sc, chk, rank):
    """New arrays each call, three with a new out= and three without: the third of each runs the fresh path."""
    for k in range(6):
        x = make_input(sc, k, rank)
        out = _new_out(sc, rank) if k < 3 or _needs_out(sc, rank) else None
        before = _snapshot(x)
        chk.before(k)
        got = invoke(comm, sc, x, out, exchange=True)
        chk.untouched(k, x, before)
        chk.result(k, k, got)
        if out is not None and got is not out:
            chk.wrong(k, "the result is not the out= array passed")


def _in_place(comm, sc, chk, rank):
    """``out=x``: the same x three times (refilled), then a new x three times (the fresh path from the third)."""
    x = make_input(sc, 0, rank)
    has_result = result_shape(sc, rank) is not None
    for k in range(6):
        if k >= 3:
            x = make_input(sc, k, rank)
        elif k:
            _refill(x, sc, k, rank)
        before = _snapshot(x)
        chk.before(k)
        got = invoke(comm, sc, x, x)
        chk.result(k, k, got)
        if has_result and got is not x:
            chk.wrong(k, "out=x did not return x")
        if not has_result:
            chk.untouched(k, x, before, "x (out=x on a rank that gets no result)")


def _nonblocking(comm, sc, chk, rank):
    xs = [make_input(sc, k, rank) for k in (0, 1)]
    outs = [_new_out(sc, rank) if _needs_out(sc, rank) else None for _ in xs]
    befores = [_snapshot(x) for x in xs]
    for k in (0, 1):
        chk.before(k)
    reqs = [invoke(comm, sc, xs[k], outs[k], kind="i") for k in (0, 1)]
    for k in (1, 0):
        got = reqs[k].wait()
        chk.untouched(k, xs[k], befores[k])
        chk.result(k, k, got)


def _persistent(comm, sc, chk, rank):
    x = make_input(sc, 0, rank)
    out = _new_out(sc, rank) if _needs_out(sc, rank) else None
    req = invoke(comm, sc, x, out, kind="init")
    try:
        for k in range(3):
            if k:
                _refill(x, sc, k, rank)
            before = _snapshot(x)
            chk.before(k)
            req.start()
            got = req.wait()
            chk.untouched(k, x, before)
            chk.result(k, k, got)
    finally:
        req.free()


def _plans_off(comm, sc, chk, rank):
    comm.plans = False
    try:
        _blocking(comm, sc, chk, rank, calls=2)
    finally:
        comm.plans = True


RUNNERS = {
    "repeat": _blocking,
    "new": _new_arrays,
    "inplace": _in_place,
    "timed": lambda comm, sc, chk, rank: _blocking(comm, sc, chk, rank, timeout=TIMED),
    "iform": _nonblocking,
    "persistent": _persistent,
    "plans_off": _plans_off,
}


def run_scenario(comm, sc: dict, witness: BarrierWitness | None = None) -> Checker:
    """Run one scenario on this rank and return its findings."""
    chk = Checker(sc, comm.rank, witness)
    RUNNERS[sc["form"]](comm, sc, chk, comm.rank)
    return chk


def _exception(exc: BaseException) -> dict:
    return {"type": type(exc).__name__, "message": str(exc)[:2000],
            "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-4000:]}


def run_world(comm, scenarios, sink, witness=None, position=None) -> None:
    """Run ``scenarios`` in order on this rank, writing one record per scenario to ``sink``.

    A native algorithm the transport cannot run for the dtype and op is refused on
    every rank before anything is sent: recorded as skipped. Any other exception is
    recorded and re-raised (the world cannot be trusted to continue).
    """
    comm.timeout = None  # plans run only on a communicator without a default timeout
    for sc in scenarios:
        if position is not None:
            position[comm.rank] = sc["i"]
        try:
            chk = run_scenario(comm, sc, witness)
        except ck.AlgorithmNotApplicable as exc:
            if sc["algorithm"] != "native":
                sink({"i": sc["i"], "rank": comm.rank, "exception": _exception(exc)})
                raise
            sink({"i": sc["i"], "rank": comm.rank, "skip": str(exc)[:300]})
            continue
        except BaseException as exc:
            sink({"i": sc["i"], "rank": comm.rank, "exception": _exception(exc)})
            raise
        sink({"i": sc["i"], "rank": comm.rank, "problems": chk.problems, "digest": chk.digest.hexdigest(),
              "calls": chk.calls})


def run_threads(p: int, scenarios, sinks) -> None:
    """Run ``scenarios`` on a threads world of ``p`` ranks; ``sinks[rank]`` takes that rank's records.

    A rank that raises ends the world (its peers get PeerFailed); the rest of the
    scenarios then run on a new world.
    """
    todo = list(scenarios)
    while todo:
        position = [todo[0]["i"]] * p
        witness = BarrierWitness(p)
        try:
            ck.run_local(lambda comm: run_world(comm, todo, sinks[comm.rank], witness, position), p)
            return
        except ck.RankError as exc:
            # Ranks behind the one that failed run again what they had not finished; ranks ahead
            # run again what they finished (their latest record is the one that counts).
            failed = position[exc.rank]
            todo = [sc for sc in todo if sc["i"] >= min(position) and sc["i"] != failed]


# -- merging what the ranks wrote -----------------------------------------------------------------------------


class Tally:
    """What a sweep found: scenarios run per collective and form, wrong results, exceptions."""

    def __init__(self):
        self.run = 0
        self.calls = 0
        self.by_form: Counter = Counter()
        self.by_world: Counter = Counter()
        self.seconds: Counter = Counter()
        self.skipped: Counter = Counter()
        self.wrong: list[dict] = []
        self.exceptions: list[dict] = []
        self.unpromised: list[dict] = []  # float reductions whose bits differ across ranks; nothing promises them

    def failed(self) -> bool:
        return bool(self.wrong or self.exceptions)

    def settle(self, sc: dict, records: dict, p: int) -> bool:
        """Account for scenario ``sc`` from its records by rank; False if it is not finished yet."""
        real = {r: rec for r, rec in records.items()
                if not ("exception" in rec and rec["exception"]["type"] == "PeerFailed")}
        raised = [rec for rec in real.values() if "exception" in rec]
        if raised:
            for rec in raised:
                self.exceptions.append({"scenario": _public(sc), "rank": rec["rank"], **rec["exception"]})
            return True
        if len(real) < p:
            return False
        if any("skip" in rec for rec in real.values()):
            self.skipped[sc["collective"], sc["algorithm"]] += 1
            return True
        self.run += 1
        self.calls += sum(rec["calls"] for rec in real.values())
        self.by_form[sc["collective"], sc["form"]] += 1
        self.by_world[sc["world"], sc["p"]] += 1
        for r in sorted(real):
            for problem in real[r]["problems"]:
                self.wrong.append({"scenario": _public(sc), **problem})
        if sc["collective"] in SAME_EVERYWHERE:
            digests = {real[r]["digest"] for r in real}
            if len(digests) > 1:
                if _bits_promised(sc):
                    self.wrong.append({"scenario": _public(sc), "rank": "all", "call": "all",
                                       "what": "ranks got results that differ in their bits"})
                else:
                    self.unpromised.append(_public(sc))
        return True

    def not_run(self, sc: dict, why: str, tail: str = "") -> None:
        self.exceptions.append({"scenario": _public(sc), "rank": "?", "type": "NotFinished", "message": why,
                                "traceback": tail})


def _bits_promised(sc: dict) -> bool:
    """Whether commkit promises every rank the same bits for this scenario (see the module docstring)."""
    if sc["collective"] not in collectives.REDUCING or np.dtype(sc["dtype"]).kind in "biu":
        return True
    return algorithms.is_node_only(algorithms.get(sc["collective"], sc["algorithm"]))


def _public(sc: dict) -> dict:
    return {key: sc[key] for key in sc if key != "i"}


def tally_memory(scenarios, records_by_rank, p: int, tally: Tally | None = None) -> Tally:
    """Merge in-memory records (lists per rank) into a Tally; the latest record of a rank wins."""
    tally = tally or Tally()
    latest: dict = defaultdict(dict)
    for records in records_by_rank:
        for rec in records:
            latest[rec["i"]][rec["rank"]] = rec
    for sc in scenarios:
        if not tally.settle(sc, latest.get(sc["i"], {}), p):
            tally.not_run(sc, "the world ended before every rank finished this scenario")
    return tally


def sweep_in_process(p: int, scenarios) -> Tally:
    """Run ``scenarios`` on a threads world in this process (no hang protection) and tally them.

    For tests: an algorithm registered in this process is seen here, where a worker
    process would not see it.
    """
    records = [[] for _ in range(p)]
    run_threads(p, scenarios, [r.append for r in records])
    return tally_memory(scenarios, records, p)


# -- workers and their supervision ------------------------------------------------------------------------------


def _file_sink(path: str):
    stream = open(path, "a", buffering=1)

    def write(record: dict) -> None:
        stream.write(json.dumps(record) + "\n")
        stream.flush()

    return write


def worker_main(world: str, todo_path: str, out_dir: str) -> int:
    """A worker: run the scenarios in ``todo_path`` on a threads world (size from the file) or on MPI."""
    with open(todo_path) as f:
        todo = json.load(f)
    if world == "threads":
        p = todo[0]["p"]
        run_threads(p, todo, [_file_sink(os.path.join(out_dir, f"rank{r}.jsonl")) for r in range(p)])
        return 0
    comm = ck.init("mpi")
    run_world(comm, todo, _file_sink(os.path.join(out_dir, f"rank{comm.rank}.jsonl")))
    return 0


class _Reader:
    """Reads the ranks' record files as they grow."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir
        self.offsets: dict = {}
        self.latest: dict = defaultdict(dict)
        self.lines = 0

    def poll(self) -> int:
        for name in sorted(os.listdir(self.out_dir)):
            if not name.endswith(".jsonl"):
                continue
            path = os.path.join(self.out_dir, name)
            with open(path) as f:
                f.seek(self.offsets.get(name, 0))
                chunk = f.read()
            complete = chunk[:chunk.rfind("\n") + 1]
            self.offsets[name] = self.offsets.get(name, 0) + len(complete.encode())
            for line in complete.splitlines():
                rec = json.loads(line)
                self.latest[rec["i"]][rec["rank"]] = rec
                self.lines += 1
        return self.lines


def _worker_command(world: str, p: int, todo_path: str, out_dir: str) -> list[str]:
    argv = [sys.executable, os.path.abspath(__file__), "--worker", world, "--todo", todo_path, "--out-dir", out_dir]
    return argv if world == "threads" else mpiexec_command(p, argv)


def supervise(world: str, p: int, scenarios, tally: Tally, *, hang_timeout: float, progress=None,
              max_restarts: int = 25) -> None:
    """Run one world's scenarios in worker processes, restarting after a hang, a crash or an exception.

    Every restart settles at least one scenario (the one that raised, or the first one
    the ranks did not all finish), so the loop ends; every process started is ended.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, TESTS, env.get("PYTHONPATH", "")]))
    pending = list(scenarios)
    restarts = 0
    with tempfile.TemporaryDirectory(prefix="commkit-sweep-") as tmp:
        while pending:
            out_dir = tempfile.mkdtemp(dir=tmp)
            todo_path = os.path.join(out_dir, "todo.json")
            with open(todo_path, "w") as f:
                json.dump(pending, f)
            log_path = os.path.join(out_dir, "worker.log")
            reader = _Reader(out_dir)
            started = time.monotonic()
            # The worker's group is ended on the way out, and what a hung or crashed MPI worker left in
            # /dev/shm is removed.
            with open(log_path, "w") as log, process_group(_worker_command(world, p, todo_path, out_dir),
                                                           stdout=log, stderr=subprocess.STDOUT, env=env) as proc:
                hung = False
                last_lines, last_change = 0, time.monotonic()
                while proc.poll() is None:
                    time.sleep(0.5)
                    lines = reader.poll()
                    if lines != last_lines:
                        last_lines, last_change = lines, time.monotonic()
                    elif time.monotonic() - last_change > hang_timeout:
                        hung = True
                        break
                    if progress is not None:
                        progress(world, p, len(reader.latest), len(pending))
            reader.poll()
            tally.seconds[world, p] += time.monotonic() - started
            with open(log_path) as f:
                tail = f.read()[-3000:]
            unsettled = [sc for sc in pending if not tally.settle(sc, reader.latest.get(sc["i"], {}), p)]
            if unsettled and not _any_raised(pending, reader):
                # Nothing raised, yet the ranks did not all finish: the first such scenario hung or crashed.
                why = (f"no progress for {hang_timeout:.0f} s" if hung else
                       f"the worker exited with status {proc.returncode}") + " during this scenario"
                tally.not_run(unsettled[0], why, tail)
                unsettled = unsettled[1:]
            pending = unsettled
            restarts += 1
            if pending and restarts > max_restarts:
                for sc in pending:
                    tally.not_run(sc, f"not run: the world was restarted {max_restarts} times")
                return


def _any_raised(pending, reader) -> bool:
    return any("exception" in rec and rec["exception"]["type"] != "PeerFailed"
               for sc in pending for rec in reader.latest.get(sc["i"], {}).values())


# -- the report -------------------------------------------------------------------------------------------------


def _heading(sc: dict) -> str:
    return (f"{sc['world']} p={sc['p']} {sc['collective']} algorithm={sc['algorithm']} form={sc['form']} "
            f"op={sc['op']} dtype={sc['dtype']} count={sc['count']} root={sc['root']} seed={sc['seed']}")


def _repro(sc: dict) -> str:
    return f"python scripts/differential_sweep.py --repro '{json.dumps(sc, separators=(',', ':'))}'"


def report(tally: Tally, elapsed: float, out=sys.stdout) -> None:
    """Print the summary: scenarios per collective and form, per world, and every finding."""
    w = out.write
    forms = [f for f in FORMS if any(form == f for _, form in tally.by_form)]
    colls = sorted({c for c, _ in tally.by_form}, key=collectives.NAMES.index)
    w("\nscenarios by collective and call form\n")
    w(f"{'collective':<16}" + "".join(f"{f:>11}" for f in forms) + f"{'total':>9}\n")
    for c in colls:
        row = [tally.by_form[c, f] for f in forms]
        w(f"{c:<16}" + "".join(f"{n:>11}" for n in row) + f"{sum(row):>9}\n")
    w(f"{'total':<16}" + "".join(f"{sum(tally.by_form[c, f] for c in colls):>11}" for f in forms)
      + f"{tally.run:>9}\n")
    w("\nscenarios by world\n")
    for (world, p), n in sorted(tally.by_world.items()):
        secs = tally.seconds[world, p]
        rate = f"{n / secs:8.0f}/s" if secs else ""
        w(f"  {world:<8} p={p:<2} {n:>8}  {secs:8.1f} s {rate}\n")
    if tally.skipped:
        w("\nskipped (native refused the dtype/op on this transport, before anything was sent): "
          + ", ".join(f"{c}/{a}: {n}" for (c, a), n in sorted(tally.skipped.items())) + "\n")
    if tally.unpromised:
        groups = Counter((sc["collective"], sc["algorithm"], sc["world"]) for sc in tally.unpromised)
        w(f"\nfloat reductions whose ranks got different bits (not promised, not failed): {len(tally.unpromised)} "
          + ", ".join(f"{c}/{a}/{wd}: {n}" for (c, a, wd), n in sorted(groups.items())) + "\n")
    grouped: dict = defaultdict(list)  # a scenario's findings on every rank and call, under one heading
    for item in tally.wrong:
        grouped[json.dumps(item["scenario"])].append(f"rank {item['rank']} call {item['call']}: {item['what']}")
    w(f"\nwrong results: {len(tally.wrong)} in {len(grouped)} scenarios\n")
    for text, findings in grouped.items():
        sc = json.loads(text)
        more = ""
        if len(findings) > 4:
            more = f"    ... {len(findings) - 4} more on other ranks and calls (all in --json)\n"
        w(f"  WRONG {_heading(sc)}\n" + "".join(f"    {line}\n" for line in findings[:4]) + more
          + f"    reproduce: {_repro(sc)}\n")
    ranks: dict = defaultdict(list)  # the same exception on several ranks is listed once
    for item in tally.exceptions:
        ranks[json.dumps(item["scenario"]), item["type"], item["message"]].append((item["rank"], item["traceback"]))
    w(f"unexpected exceptions: {len(tally.exceptions)} in {len({key[0] for key in ranks})} scenarios\n")
    for (text, kind, message), where in ranks.items():
        sc = json.loads(text)
        w(f"  EXCEPTION {_heading(sc)}\n    rank(s) {','.join(str(r) for r, _ in where)}: {kind}: {message[:500]}\n")
        if kind == "NotFinished" and where[0][1]:  # what the worker printed last
            w("".join(f"    | {line}\n" for line in where[0][1].strip().splitlines()[-8:]))
        w(f"    reproduce: {_repro(sc)}\n")
    w(f"\nscenarios run: {tally.run} ({tally.calls} calls summed over ranks) in {elapsed:.1f} s; "
      f"wrong results: {len(tally.wrong)}; unexpected exceptions: {len(tally.exceptions)}\n")


def summary(tally: Tally, elapsed: float) -> dict:
    """The report as data (``--json``)."""
    return {"scenarios": tally.run, "calls": tally.calls, "seconds": elapsed,
            "by_collective_form": {f"{c}/{f}": n for (c, f), n in sorted(tally.by_form.items())},
            "by_world": {f"{w}/{p}": n for (w, p), n in sorted(tally.by_world.items())},
            "skipped": {f"{c}/{a}": n for (c, a), n in sorted(tally.skipped.items())},
            "unpromised_float_differences": tally.unpromised, "wrong": tally.wrong, "exceptions": tally.exceptions}


# -- command line -----------------------------------------------------------------------------------------------


def _sizes(text: str, name: str) -> list[int]:
    """``"1-8"``, ``"2,3"``, ``"1-4,8"`` or ``"none"`` as a list of world sizes."""
    if text.strip().lower() in ("", "none", "0"):
        return []
    sizes = []
    try:
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            sizes.extend(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise SystemExit(f"--{name} must be sizes like 1-8, 2,3 or none; got {text!r}.") from None
    if any(s < 1 for s in sizes):
        raise SystemExit(f"--{name} sizes must be at least 1; got {text!r}.")
    return sorted(set(sizes))


def _mpi_available() -> bool:
    try:
        import mpi4py  # noqa: F401

        from commkit._mpiexec import find_mpiexec

        find_mpiexec()
        return True
    except Exception:
        return False


def repro(text: str) -> int:
    """Run one scenario (as printed by a report) and show each rank's findings."""
    sc = dict(json.loads(text), i=0)
    sc.setdefault("count", sc["shape"][0] if sc["shape"] else "0-d")
    tally = Tally()
    begun = time.monotonic()
    if sc["world"] == "threads":
        tally = sweep_in_process(sc["p"], [sc])
    else:
        supervise("mpi", sc["p"], [sc], tally, hang_timeout=60)
    report(tally, time.monotonic() - begun)
    return 1 if tally.failed() or not tally.run else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", default="1-8", help="threads world sizes (default 1-8; 'none' for none)")
    parser.add_argument("--mpi", default="2,3", help="mpiexec world sizes (default 2,3; 'none' for none)")
    parser.add_argument("--budget", type=int, default=None,
                        help=f"scenarios to run (default {DEFAULT_BUDGET}, {QUICK_BUDGET} with --quick; 0: all)")
    parser.add_argument("--seed", type=int, default=0, help="draws the sample and every scenario's data")
    parser.add_argument("--collectives", default=None, help="comma-separated collectives (default: all)")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_BUDGET} scenarios")
    parser.add_argument("--hang-timeout", type=float, default=120.0,
                        help="seconds without progress before a worker is ended (default 120)")
    parser.add_argument("--json", default=None, help="also write the summary as JSON to this path")
    parser.add_argument("--repro", default=None, help="run one scenario given as the JSON a report prints")
    parser.add_argument("--worker", choices=("threads", "mpi"), help=argparse.SUPPRESS)
    parser.add_argument("--todo", help=argparse.SUPPRESS)
    parser.add_argument("--out-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker_main(args.worker, args.todo, args.out_dir)
    if args.repro:
        return repro(args.repro)

    names = collectives.NAMES
    if args.collectives:
        names = tuple(n.strip() for n in args.collectives.split(",") if n.strip())
        unknown = [n for n in names if n not in collectives.NAMES]
        if unknown:
            raise SystemExit(f"--collectives: unknown {unknown}; expected some of {list(collectives.NAMES)}.")
    worlds = [("threads", p) for p in _sizes(args.threads, "threads")]
    mpi_sizes = _sizes(args.mpi, "mpi")
    if mpi_sizes and not _mpi_available():
        print("mpiexec or mpi4py is not available: the MPI worlds are left out.", flush=True)
        mpi_sizes = []
    worlds += [("mpi", p) for p in mpi_sizes]
    if not worlds:
        raise SystemExit("no world to run: give --threads or --mpi sizes.")
    budget = args.budget if args.budget is not None else (QUICK_BUDGET if args.quick else DEFAULT_BUDGET)
    scenarios = plan(worlds, names, budget, args.seed)
    print(f"{len(scenarios)} scenarios over {len(worlds)} worlds "
          f"({', '.join(f'{w} p={p}' for w, p in worlds)}), seed {args.seed}", flush=True)

    tally = Tally()
    begun = time.monotonic()
    shown = [0.0]

    def progress(world, p, done, total):
        now = time.monotonic()
        if now - shown[0] >= 5:
            shown[0] = now
            print(f"  [{now - begun:7.1f} s] {world} p={p}: {done}/{total} of this world; {tally.run} settled, "
                  f"{len(tally.wrong)} wrong, {len(tally.exceptions)} exceptions", flush=True)

    for world, p in worlds:
        mine = [sc for sc in scenarios if sc["world"] == world and sc["p"] == p]
        if mine:
            supervise(world, p, mine, tally, hang_timeout=args.hang_timeout, progress=progress)
    elapsed = time.monotonic() - begun
    report(tally, elapsed)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary(tally, elapsed), f, indent=1)
    return 1 if tally.failed() or tally.run == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
