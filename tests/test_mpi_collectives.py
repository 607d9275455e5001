"""The collective properties under real mpiexec (2, 3, 4 and 5 processes).

Every rank runs the same derandomized hypothesis search, so all ranks draw the same
examples; after each example the ranks agree on whether it passed (allgather_object),
so when one rank fails they all fail the same example and shrink in step instead of
hanging. Each example runs every applicable algorithm and MPI's own collective
(``native``) on the same inputs: results must match NumPy, and integer results must
match MPI's element for element.
"""

from __future__ import annotations

import re

import pytest

from conftest import requires_mpi, run_mpi

SCRIPT = """
import sys, traceback
import numpy as np
from hypothesis import given, settings, strategies as st
import commkit as ck
from commkit import ops
from contracts import (REDUCING, applicable_algorithms, assert_matches, cases, check_case, collective_input,
                       expected, run_collective)

comm = ck.init(timeout=60)
examples = int(sys.argv[1])
ran = {"cases": 0, "native": 0}


def one_case(case):
    native = comm._coll.native_supports(case["collective"], np.dtype(case["dtype"]),
                                        ops.get_op(case["op"]) if "op" in case else None)
    results = {}
    for name in applicable_algorithms(case["collective"], comm.size) + (["native"] if native else []):
        got, before = check_case(comm, case, name)
        np.testing.assert_array_equal(collective_input(case, comm.rank, comm.size), before)
        results[name] = got
    if native and results["native"] is not None and np.dtype(case["dtype"]).kind in "biu":
        for name, got in results.items():
            np.testing.assert_array_equal(got, results["native"], err_msg=f"{name} vs MPI")
        ran["native"] += 1
    ran["cases"] += 1


@settings(derandomize=True, database=None, max_examples=examples, deadline=None)
@given(case=cases(comm.size))
def collectives(case):
    error = None
    try:
        one_case(case)
    except Exception as exc:
        error = f"rank {comm.rank}: {type(exc).__name__}: {exc}"
    # Agree on the verdict so every rank fails (and shrinks) the same example.
    verdicts = comm.allgather_object(error)
    failed = [v for v in verdicts if v]
    assert not failed, "\\n".join(failed)


collectives()
sys.stdout.write(f"rank {comm.rank} ok {ran['cases']} {ran['native']}\\n"); sys.stdout.flush()
"""


@requires_mpi
@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 3, 4, 5])
def test_collectives_match_numpy_and_mpi(nprocs):
    examples = {2: 150, 3: 100, 4: 80, 5: 60}[nprocs]
    result = run_mpi(nprocs, SCRIPT, args=[examples], timeout=600)
    reports = {int(r): (int(c), int(n)) for r, c, n in re.findall(r"rank (\d+) ok (\d+) (\d+)", result.stdout)}
    assert sorted(reports) == list(range(nprocs)), result.stdout
    cases, native = reports[0]
    assert cases >= examples // 2  # hypothesis ran real examples (not all filtered away)
    assert native > 0  # and some of them were compared with MPI's own collective
