"""Plans and the interpreter give the same answers: every collective x algorithm, both paths, bit for bit.

A compiled plan is the interpreter's work written out once for a call shape
(commkit/plan.py); ``COMMKIT_PLANS=off`` (or ``comm.plans = False``) runs every
call through the interpreter instead. Speed must never buy a second truth, so
each call shape here runs through every path a call can take -- the
interpreter, a plan for the same arrays, a shape plan for new arrays, a plan
that allocates its output, the entries of new arrays with and without out,
i-forms -- and the results must be identical.
"""

from __future__ import annotations

import numpy as np
import pytest

import commkit as ck
from commkit.collectives import FIXED

from contracts import applicable_algorithms, assert_matches, collective_input, expected

SIZES = (1, 2, 3, 4, 5)


def _case(collective, size, dtype):
    case = {"collective": collective, "dtype": dtype, "seed": 1234 + size, "shape": [2 * size + 1],
            "root": size - 1, "op": "sum"}
    if collective == "reduce_scatter":
        case["shape"] = []
        case["counts"] = [(r % 3) + 1 for r in range(size)]
    return case


def _call(comm, case, x, out, algorithm, nonblocking=False):
    """The case's call on these arrays; with ``nonblocking`` its i-form, waited for."""
    coll, root = case["collective"], case["root"]
    kw = {"algorithm": algorithm} if out is None else {"algorithm": algorithm, "out": out}
    if nonblocking:
        return _call(_IForms(comm), case, x, out, algorithm)
    if coll == "barrier":
        return comm.barrier(algorithm=algorithm)
    if coll in ("allreduce", "scan", "exscan"):
        return getattr(comm, coll)(x, "sum", **kw)
    if coll == "reduce":
        return comm.reduce(x, "sum", root, **kw)
    if coll == "reduce_scatter":
        return comm.reduce_scatter(x, "sum", counts=case["counts"], **kw)
    if coll in ("broadcast", "gather"):
        return getattr(comm, coll)(x, root, **kw)
    if coll == "scatter":
        if out is None:
            kw["out"] = np.empty(tuple(case["shape"]), x.dtype)
        return comm.scatter(x if comm.rank == root else None, root, **kw)
    return getattr(comm, coll)(x, **kw)  # allgather, alltoall


class _IForms:
    """A communicator whose collectives are its i-forms, each waited for at once."""

    def __init__(self, comm):
        self.comm, self.rank = comm, comm.rank

    def __getattr__(self, name):
        start = getattr(self.comm, "i" + name)
        return lambda *args, **kwargs: start(*args, **kwargs).wait()


def _output_like(comm, case, x):
    coll, p, r = case["collective"], comm.size, comm.rank
    if coll in ("barrier", "scatter") or (coll in ("reduce", "gather") and r != case["root"]):
        return None
    if coll == "allgather" or coll == "gather":
        return np.empty((p,) + x.shape, x.dtype)
    if coll == "reduce_scatter":
        return np.empty((case["counts"][r],) + x.shape[1:], x.dtype)
    return np.empty_like(x)


def _every_path(comm, case, algorithm):
    """This rank's result through each path, as (path, copy of the result)."""
    x = collective_input(case, comm.rank, comm.size)
    out = _output_like(comm, case, x)
    seen = []
    comm.plans = False
    seen.append(("interpreter", _call(comm, case, x, out, algorithm)))
    comm.plans = True
    for k in range(3):  # the second call compiles, the third runs the plan for these very arrays
        seen.append((f"same arrays #{k}", _call(comm, case, x, out, algorithm)))
    for k in range(3):  # new arrays of the same shape: the shape plan
        x2 = x.copy()
        seen.append((f"new arrays #{k}", _call(comm, case, x2, None if out is None else np.empty_like(out),
                                                algorithm)))
    for k in range(3):  # no out: a plan that allocates its result
        seen.append((f"no out #{k}", _call(comm, case, x, None, algorithm)))
    for k in range(4):  # new arrays, no out: from the third, the shape's entry
        seen.append((f"new arrays, no out #{k}", _call(comm, case, x.copy(), None, algorithm)))
    for k in range(4):  # i-forms on new arrays: from the third, the i-form's entry
        seen.append((f"i-form #{k}", _call(comm, case, x.copy(), None if out is None else np.empty_like(out),
                                           algorithm, nonblocking=True)))
    return [(path, None if got is None else np.array(got, copy=True)) for path, got in seen]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("collective", FIXED)
def test_every_path_gives_the_interpreters_answer(collective, size):
    names = applicable_algorithms(collective, size)
    assert names, f"no algorithm applies to {collective} at {size} ranks"

    def body(comm):
        report = []
        for dtype in ("float64", "int32"):
            case = _case(collective, size, dtype)
            for name in names:
                paths = _every_path(comm, case, name)
                reference = paths[0][1]
                ranked = dict(case, _rank=comm.rank)
                want = expected(ranked, comm.rank, comm.size)
                for path, got in paths:
                    if (got is None) != (reference is None) or (got is not None and (
                            got.dtype != reference.dtype or got.tobytes() != reference.tobytes())):
                        report.append(f"{name} {dtype}: {path} gave {got!r}, the interpreter {reference!r}")
                if collective != "barrier":
                    assert_matches(ranked, reference, want, comm.size)
        return report

    reports = ck.run_local(body, size, timeout=120)
    problems = [f"rank {r}: {line}" for r, report in enumerate(reports) for line in report]
    assert not problems, "\n".join(problems)


def test_plans_switch_is_checked():
    def body(comm):
        with pytest.raises(ck.InvalidArgument, match="plans must be True or False"):
            comm.plans = "off"
        return comm.plans

    assert ck.run_local(body, 1) == [True]
