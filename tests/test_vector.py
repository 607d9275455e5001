"""The vector collectives (allgatherv, gatherv, scatterv, alltoallv) against NumPy, every algorithm.

On the threads world, hypothesis draws the world size (1..8), the dtype (bool to
complex128), per-rank row counts with zeros (all zero included), trailing
dimensions and the root; every example runs every algorithm, forced and
automatic, blocking and nonblocking, with counts given or exchanged and with
``out=`` given or not. Results must equal NumPy's ``concatenate``/``split`` bit
for bit. The schedules alone are driven for p = 1..16 by the simulator: they
must finish, match every message with a receive of its length, stay inside
their buffers, send no empty message, and cost what their formulas say for
equal blocks. Under ``mpiexec`` (2, 3 and 4 processes) every algorithm and
MPI's own collective run the same derandomized examples on every rank. The
persistent forms (``*_init``) are started again and again on inputs refilled
in place, p = 1..5 on threads, and under ``mpiexec`` with MPI's own collective.

Each rank's input is a pure function of (case, rank), so every rank (and every
process) computes the NumPy reference for all ranks locally.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, strategies as st

import commkit as ck
from commkit import algorithms, selection
from commkit.schedule import TRANSFER
from commkit.sim import simulate_steps

from conftest import requires_mpi, run_mpi

VECTOR = ("allgatherv", "gatherv", "scatterv", "alltoallv")
ROOTED = ("gatherv", "scatterv")
DTYPES = ("bool", "int8", "uint16", "int32", "int64", "float16", "float32", "float64", "complex64", "complex128")
TRAILING = ((), (), (2,), (3, 2), (0,))
STYLES = ("plain", "nonblocking", "out")


def schedule_names(collective):
    """Every algorithm of ``collective`` that has a schedule (all but ``native``)."""
    return sorted(name for name, alg in algorithms.for_collective(collective).items() if alg.schedule is not None)


# -- cases, inputs and the NumPy reference -------------------------------------------------------------------


def _counts(size):
    rows = st.sampled_from([0, 0, 1, 2, 3, 7])
    return st.one_of(st.just([0] * size), st.lists(rows, min_size=size, max_size=size))


@st.composite
def vector_cases(draw, size, collectives=VECTOR):
    """A random v-collective call for ``size`` ranks (a dict, the same on every rank that draws it)."""
    coll = draw(st.sampled_from(collectives))
    case = {"collective": coll, "seed": draw(st.integers(0, 2**32 - 1)), "dtype": draw(st.sampled_from(DTYPES)),
            "trailing": list(draw(st.sampled_from(TRAILING)))}
    if coll == "alltoallv":
        case["counts"] = [draw(_counts(size)) for _ in range(size)]
    else:
        case["counts"] = draw(_counts(size))
    if coll in ROOTED:
        case["root"] = draw(st.integers(0, size - 1))
    return case


def rows_of(case, rank):
    """Rows of the input ``rank`` holds (None: it has no input)."""
    coll, counts = case["collective"], case["counts"]
    if coll == "alltoallv":
        return sum(counts[rank])
    if coll == "scatterv":
        return sum(counts) if rank == case["root"] else None
    return counts[rank]


def case_input(case, rank):
    """Rank ``rank``'s ``x`` (None on the non-roots of scatterv)."""
    rows = rows_of(case, rank)
    if rows is None:
        return None
    shape = (rows, *case["trailing"])
    dtype = np.dtype(case["dtype"])
    rng = np.random.default_rng([case["seed"], rank])
    if dtype.kind == "b":
        return rng.integers(0, 2, size=shape).astype(bool)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    values = rng.standard_normal(shape) * 1e3
    if dtype.kind == "c":
        values = values + 1j * rng.standard_normal(shape)
    x = values.astype(dtype)
    if dtype.kind == "f" and x.size:
        x.flat[0] = -0.0 if rng.random() < 0.5 else np.nan  # bits NumPy's == would not tell apart
    return x


def _split(x, counts):
    return np.split(x, np.cumsum(counts)[:-1])


def expected(case, rank, size):
    """The NumPy result on ``rank`` (None where the collective returns None)."""
    coll, counts = case["collective"], case["counts"]
    if coll in ("allgatherv", "gatherv"):
        if coll == "gatherv" and rank != case["root"]:
            return None
        return np.concatenate([case_input(case, q) for q in range(size)])
    if coll == "scatterv":
        return _split(case_input(case, case["root"]), counts)[rank]
    return np.concatenate([_split(case_input(case, q), counts[q])[rank] for q in range(size)])


def assert_same(got, exp, what=""):
    """Equal element for element, bit for bit (NaN payloads and the sign of zero included)."""
    if exp is None:
        assert got is None, f"{what}: expected None, got {got!r}"
        return
    assert got is not None, f"{what}: expected an array, got None"
    assert got.shape == exp.shape and got.dtype == exp.dtype, (what, got.shape, got.dtype, exp.shape, exp.dtype)
    assert got.tobytes() == exp.tobytes(), f"{what}: got {got!r}, expected {exp!r}"


def call(comm, case, algorithm, style, exchange=False):
    """Run ``case`` on ``comm`` in one calling style; returns (result, the out buffer passed or None)."""
    coll, counts, r = case["collective"], case["counts"], comm.rank
    x = case_input(case, r)
    nonblocking = style == "nonblocking"
    out = None
    if style == "out" or (coll == "scatterv" and r != case["root"]):
        exp = expected(case, r, comm.size)
        out = None if exp is None else np.full_like(exp, 1)
    kw = {"out": out, "algorithm": algorithm}
    if coll == "allgatherv":
        fn = comm.iallgatherv if nonblocking else comm.allgatherv
        result = fn(x, None if exchange else counts, **kw)
    elif coll == "gatherv":
        fn = comm.igatherv if nonblocking else comm.gatherv
        result = fn(x, case["root"], None if exchange else counts, **kw)
    elif coll == "scatterv":
        fn = comm.iscatterv if nonblocking else comm.scatterv
        result = fn(x, counts, case["root"], **kw)
    else:
        fn = comm.ialltoallv if nonblocking else comm.alltoallv
        if exchange:
            result = fn(x, counts[r], **kw)
        else:
            result = fn(x, counts, [row[r] for row in counts], **kw)
    if nonblocking:
        result = result.wait()
    return result, out


def check_case(comm, case, algorithm):
    """Every calling style of ``case`` with ``algorithm``: results, ``out`` identity, inputs untouched."""
    exp = expected(case, comm.rank, comm.size)
    for i, style in enumerate(STYLES):
        before = case_input(case, comm.rank)
        x = case_input(case, comm.rank)
        got, out = call(comm, case, algorithm, style, exchange=i % 2 == 0)
        what = f"{case['collective']} algorithm={algorithm} style={style} rank={comm.rank}"
        assert_same(got, exp, what)
        if out is not None and got is not None:
            assert got is out, what
        if algorithm is not None:
            assert comm.last_algorithm == algorithm, what
        if before is not None:
            assert_same(x, before, what + " (input changed)")


def _run_every_algorithm(size, case, extra=()):
    names = schedule_names(case["collective"]) + [None, *extra]

    def body(comm):
        for name in names:
            check_case(comm, case, name)
        return len(names)

    assert ck.run_local(body, size, timeout=30) == [len(names)] * size


@pytest.mark.parametrize("collective", VECTOR)
@given(data=st.data())
def test_vector_collectives_match_numpy(collective, data):
    size = data.draw(st.integers(1, 8), label="size")
    case = data.draw(vector_cases(size, (collective,)), label="case")
    _run_every_algorithm(size, case)


@pytest.mark.parametrize("collective", VECTOR)
def test_larger_worlds_and_every_root(collective):
    rng = np.random.default_rng(13)
    for size in (11, 16):
        counts = rng.choice([0, 0, 1, 4], size=(size, size) if collective == "alltoallv" else size).tolist()
        for root in ((0, size - 1, 5) if collective in ROOTED else (0,)):
            case = {"collective": collective, "seed": size, "dtype": "float32", "trailing": [2], "counts": counts,
                    "root": root}
            _run_every_algorithm(size, case)


def test_two_vector_requests_in_flight_are_waited_in_reverse_order():
    counts = [3, 0, 1, 2]
    matrix = [[(i * j) % 3 for j in range(4)] for i in range(4)]

    def body(comm):
        r = comm.rank
        x = np.arange(counts[r], dtype=np.int64) + 10 * r
        y = np.arange(sum(matrix[r]), dtype=np.float64) + 100 * r
        first = comm.iallgatherv(x, counts, algorithm="ring")
        second = comm.ialltoallv(y, matrix, algorithm="pairwise")
        third = comm.igatherv(x, 2, counts, algorithm="binomial")
        return third.wait(), second.wait(), first.wait()

    results = ck.run_local(body, 4)
    xs = [np.arange(counts[r], dtype=np.int64) + 10 * r for r in range(4)]
    ys = [np.arange(sum(matrix[r]), dtype=np.float64) + 100 * r for r in range(4)]
    for r, (gathered, exchanged, everyone) in enumerate(results):
        np.testing.assert_array_equal(everyone, np.concatenate(xs))
        assert (gathered is None) == (r != 2)
        np.testing.assert_array_equal(exchanged, np.concatenate([_split(ys[q], matrix[q])[r] for q in range(4)]))


def test_automatic_selection_follows_the_shipped_table():
    def pick(collective, p, nbytes):
        return selection.select(collective, p, nbytes, native_ok=True).algorithm.name

    assert pick("allgatherv", 4, 1 << 20) == "naive" and pick("allgatherv", 16, 1024) == "naive"
    assert pick("allgatherv", 16, 1 << 20) == "ring"
    assert pick("gatherv", 3, 100) == "naive" and pick("gatherv", 16, 1024) == "binomial"
    assert pick("gatherv", 16, 1 << 20) == "naive"
    assert pick("scatterv", 16, 1024) == "binomial" and pick("scatterv", 16, 1 << 20) == "naive"
    assert pick("alltoallv", 8, 1 << 20) == "naive" and pick("alltoallv", 64, 64) == "naive"
    assert pick("alltoallv", 64, 4096) == "pairwise"
    for collective in VECTOR:
        for rule in selection.default_table()[collective]:
            assert rule["reason"] and algorithms.get(collective, rule["algorithm"]) is not None

    def body(comm):
        comm.allgatherv(np.ones(comm.rank + 1))
        return comm.last_algorithm, comm.last_choice.reason

    name, reason = ck.run_local(body, 3)[0]
    assert name == "naive" and reason.startswith("default.json")


# -- the schedules alone, p = 1..16 --------------------------------------------------------------------------


def buffer_sizes(collective, alg, rank, p, counts, root):
    if collective == "alltoallv":
        n_in, n_out = sum(counts[rank]), sum(row[rank] for row in counts)
    elif collective == "allgatherv":
        n_in, n_out = counts[rank], sum(counts)
    elif collective == "gatherv":
        n_in, n_out = counts[rank], sum(counts) if rank == root else 0
    else:
        n_in, n_out = sum(counts) if rank == root else 0, counts[rank]
    return {"in": n_in, "out": n_out, "tmp": alg.scratch(rank, p, counts)}


def schedule_factory(alg, p, counts, root):
    if alg.collective in ROOTED:
        return lambda r: alg.schedule(r, p, counts, root)
    return lambda r: alg.schedule(r, p, counts)


def expected_messages(collective, name, p, counts, root):
    """Messages each rank sends, from the algorithms' definitions (empty blocks send none)."""
    if collective == "alltoallv":
        return [sum(1 for j in range(p) if j != r and counts[r][j]) for r in range(p)]
    if collective == "allgatherv":
        if name == "naive":
            return [(p - 1) if counts[r] else 0 for r in range(p)]
        # Ring: rank r forwards every non-empty block except its right neighbour's.
        return [sum(1 for q in range(p) if q != (r + 1) % p and counts[q]) if p > 1 else 0 for r in range(p)]
    rel_counts = [counts[(j + root) % p] for j in range(p)]

    def subtree(j):
        low = j & -j if j else p
        return sum(rel_counts[j:min(j + low, p)])

    def children(j):
        low = j & -j if j else p
        return [j + m for m in (1 << k for k in range(p.bit_length())) if m < low and j + m < p]

    sent = [0] * p
    for j in range(p):
        r = (j + root) % p
        if collective == "gatherv":
            if j and (subtree(j) if name == "binomial" else rel_counts[j]):
                sent[r] = 1
        elif name == "naive":
            sent[r] = sum(1 for q in range(1, p) if rel_counts[q]) if j == 0 else 0
        else:
            sent[r] = sum(1 for c in children(j) if subtree(c))
    return sent


@given(data=st.data())
def test_schedules_finish_for_every_p_up_to_16(data):
    p = data.draw(st.integers(1, 16), label="p")
    counts = data.draw(_counts(p), label="counts")
    matrix = data.draw(st.lists(_counts(p), min_size=p, max_size=p), label="matrix")
    root = data.draw(st.integers(0, p - 1), label="root")
    for collective in VECTOR:
        arg = tuple(map(tuple, matrix)) if collective == "alltoallv" else tuple(counts)
        for name in schedule_names(collective):
            alg = algorithms.get(collective, name)
            what = f"{collective}_{name} p={p} counts={arg} root={root}"
            for r in range(p):
                for step in schedule_factory(alg, p, arg, root)(r):
                    if step.kind == TRANSFER:
                        for _, (_, lo, hi) in step.sends + step.recvs:
                            assert hi > lo, f"{what}: rank {r} posts an empty message in {step!r}"
            sizes = [buffer_sizes(collective, alg, r, p, arg, root) for r in range(p)]
            result = simulate_steps(schedule_factory(alg, p, arg, root), p, buffers=sizes, collective=collective,
                                    algorithm=name)
            assert not result.waiting, f"{what}: deadlock: {result.waiting[0]}"
            assert not result.mismatches, f"{what}: {result.mismatches[0]}"
            assert result.messages == expected_messages(collective, name, p, arg, root), what


A, B, G, S = 1.0, 1e-3, 1e-6, 4


@pytest.mark.parametrize("collective", VECTOR)
def test_formulas_are_the_simulated_time_for_equal_blocks(collective):
    for name in schedule_names(collective):
        alg = algorithms.get(collective, name)
        for p in range(1, 17):
            for block in (1, 5):
                if collective == "alltoallv":
                    arg, n = ((block,) * p,) * p, block * S
                else:
                    arg, n = (block,) * p, block * p * S
                for root in ((0, p - 1) if collective in ROOTED else (0,)):
                    sizes = [buffer_sizes(collective, alg, r, p, arg, root) for r in range(p)]
                    result = simulate_steps(schedule_factory(alg, p, arg, root), p, itemsize=S, alpha=A, beta=B,
                                            gamma=G, buffers=sizes)
                    assert result.time == pytest.approx(alg.cost(p, n, A, B, G), rel=1e-12), (name, p, block, root)


# -- errors, before anything is sent ----------------------------------------------------------------------------


def _raises(exc, pattern, fn, *args, **kwargs):
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    assert re.search(pattern, str(info.value)), str(info.value)


def test_bad_arguments_raise_whole_sentences_before_sending():
    def body(comm):
        r = comm.rank
        x = np.ones((2, 3), np.float32)
        e = np.empty((6, 3), np.float32)
        for fn in (comm.allgatherv, comm.iallgatherv):
            _raises(ck.InvalidArgument, r"counts must have 3 entries, one per rank; got 2", fn, x, [2, 2])
            _raises(ck.InvalidArgument, r"counts\[1\] must be a non-negative int .*got -1", fn, x, [2, -1, 2])
            _raises(ck.InvalidArgument, r"counts\[1\] must be a non-negative int .*got True", fn, x, [2, True, 2])
            _raises(ck.InvalidArgument, r"counts\[2\] must be a non-negative int .*got 2.0", fn, x, [2, 2, 2.0])
            _raises(ck.InvalidArgument, r"counts must be a sequence of 3 non-negative ints .*got 6", fn, x, 6)
            _raises(ck.InvalidArgument, rf"counts\[{r}\] must equal x.shape\[0\] on rank {r}, 2; got 1", fn, x,
                    [1, 1, 1])
        _raises(ck.InvalidBuffer, r"at least one dimension.*0-d", comm.allgatherv, np.float32(1), [1, 1, 1])
        _raises(ck.InvalidBuffer, r"out must have dtype float32, got float64", comm.allgatherv, x, [2, 2, 2],
                out=np.empty((6, 3)))
        _raises(ck.InvalidBuffer, r"out must have shape \(6, 3\), got \(7, 3\)", comm.allgatherv, x, [2, 2, 2],
                out=np.empty((7, 3), np.float32))
        _raises(ck.InvalidBuffer, r"out must have shape \(total rows, 3\).*got shape \(18,\)", comm.allgatherv, x,
                [2, 2, 2], out=np.empty(18, np.float32))
        _raises(ck.InvalidBuffer, r"allgatherv cannot run in place", comm.allgatherv, e[2 * r:2 * r + 2], [2, 2, 2],
                out=e)
        # out is ignored off the root, so only the root finds the overlap; every rank makes the call (a refused
        # call counts as made), and the others' part of it completes.
        if r == 0:
            _raises(ck.InvalidBuffer, r"gatherv cannot run in place", comm.gatherv, e[:2], 0, [2, 2, 2], out=e)
        else:
            comm.gatherv(e[:2], 0, [2, 2, 2], out=e)
        _raises(ck.InvalidArgument, r"root must be in range\(0, 3\), got 3", comm.gatherv, x, 3)
        _raises(ck.AlgorithmNotApplicable, r"unknown gatherv algorithm 'ring'.*'binomial'", comm.gatherv, x, 0,
                algorithm="ring")
        _raises(ck.AlgorithmNotApplicable, r"gatherv_native is not available on this transport", comm.gatherv, x, 0,
                [2, 2, 2], algorithm="native")
        _raises(ck.InvalidArgument, r"timeout must be a positive number", comm.allgatherv, x, timeout=-1)
        # scatterv
        _raises(ck.InvalidArgument, r"counts must be a sequence of 3 non-negative ints .*got None", comm.scatterv,
                e, None)
        if r == 0:
            _raises(ck.InvalidArgument, r"counts must sum to the rows of x on the root, 6; they sum to 5",
                    comm.scatterv, e, [2, 2, 1])
            _raises(ck.InvalidBuffer, r"scatterv cannot run in place", comm.scatterv, e, [2, 2, 2], out=e[:2])
        else:
            _raises(ck.InvalidBuffer, rf"scatterv on non-root rank {r} needs out= .*shape \(2, ...\)", comm.scatterv,
                    None, [2, 2, 2])
            _raises(ck.InvalidBuffer, rf"out on rank {r} must have counts\[{r}\] = 2 rows .*got shape \(3, 3\)",
                    comm.scatterv, None, [2, 2, 2], out=np.empty((3, 3), np.float32))
        # alltoallv
        _raises(ck.InvalidArgument, rf"send counts of rank {r} must sum to x.shape\[0\] = 2 .*sum to 3",
                comm.alltoallv, x, [1, 1, 1])
        _raises(ck.InvalidArgument, r"send_counts as a matrix must have 3 rows, .*got 2", comm.alltoallv, x,
                [[1, 1, 0], [1, 1, 0]])
        _raises(ck.InvalidArgument, r"send_counts\[1\] must have 3 entries", comm.alltoallv, x,
                [[1, 1, 0], [1, 1], [1, 1, 0]])
        column = re.escape(str((2, 2, 2) if r == 0 else (0, 0, 0)))
        _raises(ck.InvalidArgument, rf"recv_counts of rank {r} must be what each rank sends it, {column}; got",
                comm.alltoallv, x, [[2, 0, 0]] * 3, [1, 1, 0])
        to_self = [[2 if i == j else 0 for j in range(3)] for i in range(3)]
        _raises(ck.InvalidBuffer, r"alltoallv cannot run in place", comm.alltoallv, x, to_self, out=x)
        # After all that, nothing was sent: a correct call still works.
        return comm.allgatherv(x, [2, 2, 2]).shape

    assert ck.run_local(body, 3, timeout=10) == [(6, 3)] * 3


def test_disagreements_found_by_the_exchange_raise_the_same_error_on_every_rank():
    def body(comm):
        r = comm.rank
        errors = []
        for fn in (comm.allgatherv, lambda x: comm.gatherv(x, 1)):
            with pytest.raises(ck.InvalidBuffer) as info:
                fn(np.ones((1, 2 + (r == 2))))
            errors.append(str(info.value))
            with pytest.raises(ck.InvalidBuffer) as info:
                fn(np.ones(2, np.float32 if r else np.float64))
            errors.append(str(info.value))
        with pytest.raises(ck.InvalidArgument) as info:
            comm.alltoallv(np.ones(3), [1, 1, 1], [1, 1, 1] if r != 1 else [0, 1, 2])
        errors.append(str(info.value))
        return errors, comm.alltoallv(np.full(3, r), [1, 1, 1]).tolist()

    results = ck.run_local(body, 3, timeout=10)
    errors = results[0][0]
    assert all(res[0] == errors for res in results)  # the same words on every rank
    assert "allgatherv needs the same trailing shape x.shape[1:] on every rank; got (2,) on rank(s) [0, 1]; " \
           "(3,) on rank(s) [2]." == errors[0]
    assert "dtype on every rank; got float64 on rank(s) [0]; float32 on rank(s) [1, 2]" in errors[1]
    assert errors[2].startswith("gatherv needs the same trailing shape")
    assert errors[4] == "recv_counts of rank 1 must be what each rank sends it, (1, 1, 1); got (0, 1, 2)."
    assert all(res[1] == [0, 1, 2] for res in results)


# -- under mpiexec: every algorithm and MPI's own ------------------------------------------------------------

MPI_SCRIPT = """
import sys
import numpy as np
from hypothesis import given, settings
import commkit as ck
import test_vector as tv

comm = ck.init(timeout=60)
examples = int(sys.argv[1])
ran = {"cases": 0, "examples": 0}


@settings(derandomize=True, database=None, max_examples=examples, deadline=None)
@given(case=tv.vector_cases(comm.size))
def vector(case):
    error = None
    turn = ran["examples"] % 2  # counted on every rank alike, failed examples included
    ran["examples"] += 1
    try:
        for name in tv.schedule_names(case["collective"]) + [None, "native"]:
            tv.check_case(comm, case, name)
        # Persistent, in turn with MPI's own collective restarted and with the automatic choice.
        tv.check_persistent(comm, case, "native" if turn else None, exchange=turn == 1, with_out=turn == 0, rounds=2)
        ran["cases"] += 1
    except Exception as exc:
        error = f"rank {comm.rank}: {type(exc).__name__}: {exc}"
    # Agree on the verdict so every rank fails (and shrinks) the same example.
    verdicts = comm.allgather_object(error)
    failed = [v for v in verdicts if v]
    assert not failed, "\\n".join(failed)


vector()
sys.stdout.write(f"rank {comm.rank} ok {ran['cases']}\\n"); sys.stdout.flush()
"""


@requires_mpi
@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 3, 4])
def test_vector_collectives_match_numpy_and_mpi(nprocs):
    examples = {2: 100, 3: 70, 4: 50}[nprocs]
    result = run_mpi(nprocs, MPI_SCRIPT, args=[examples], timeout=300)
    reports = {int(r): int(c) for r, c in re.findall(r"rank (\d+) ok (\d+)", result.stdout)}
    assert sorted(reports) == list(range(nprocs)), result.stdout
    assert reports[0] == examples


# -- persistent forms: made once, started again and again ------------------------------------------------------


def make_persistent(comm, case, algorithm, exchange, out):
    """The ``*_init`` request of ``case`` on ``comm``; returns it and the array it reads (None where none)."""
    coll, counts, r = case["collective"], case["counts"], comm.rank
    x = case_input(case, r)
    kw = {"out": out, "algorithm": algorithm}
    if coll == "allgatherv":
        request = comm.allgatherv_init(x, None if exchange else counts, **kw)
    elif coll == "gatherv":
        request = comm.gatherv_init(x, case["root"], None if exchange else counts, **kw)
    elif coll == "scatterv":
        request = comm.scatterv_init(x, counts, case["root"], **kw)
    elif exchange:
        request = comm.alltoallv_init(x, counts[r], **kw)
    else:
        request = comm.alltoallv_init(x, counts, [row[r] for row in counts], **kw)
    return request, x


def check_persistent(comm, case, algorithm, exchange, with_out, rounds=3):
    """Start and wait one request ``rounds`` times, refilling its input in place with new values each time."""
    r = comm.rank
    exp = expected(case, r, comm.size)
    out = None
    if (with_out or (case["collective"] == "scatterv" and r != case["root"])) and exp is not None:
        out = np.full_like(exp, 1)
    request, x = make_persistent(comm, case, algorithm, exchange, out)
    what = f"{case['collective']}_init algorithm={algorithm} exchange={exchange} out={with_out} rank={r}"
    assert isinstance(request, ck.PersistentRequest), what
    if algorithm is not None:
        assert f"({algorithm})" in repr(request), (what, repr(request))
    for k in range(rounds):
        again = dict(case, seed=case["seed"] + 7919 * k)  # the same shapes, new values
        if x is not None:
            x[...] = case_input(again, r)
        request.start()
        got = request.wait()
        assert_same(got, expected(again, r, comm.size), f"{what} round {k}")
        if out is not None and got is not None:
            assert got is out, what
    request.free()
    with pytest.raises(ck.InvalidArgument, match="was freed"):
        request.start()
    return rounds


@pytest.mark.parametrize("collective", VECTOR)
def test_persistent_vector_collectives_restart_with_new_data(collective):
    """p = 1..5, every algorithm and the automatic choice, counts given or exchanged at init, out or not."""
    rng = np.random.default_rng(sum(map(ord, collective)))
    for size in range(1, 6):
        shape = (size, size) if collective == "alltoallv" else (size,)
        counts = rng.choice([0, 1, 2, 5], size=shape).tolist()
        case = {"collective": collective, "seed": 100 + size, "dtype": DTYPES[size * 2 % len(DTYPES)],
                "trailing": [[], [2], [], [3, 1], []][size - 1], "counts": counts, "root": size // 2}
        names = schedule_names(collective) + [None]
        exchanges = (False,) if collective == "scatterv" else (False, True)

        def body(comm):
            runs = 0
            for i, name in enumerate(names):
                for exchange in exchanges:
                    runs += check_persistent(comm, case, name, exchange, with_out=(i + exchange) % 2 == 0)
            return runs

        assert ck.run_local(body, size, timeout=30) == [3 * len(names) * len(exchanges)] * size


def test_persistent_vector_requests_interleave_with_each_other_and_with_blocking_calls():
    counts = [2, 0, 3]
    matrix = [[1, 0, 2], [0, 2, 1], [3, 1, 0]]

    def body(comm):
        r = comm.rank
        x = np.zeros(counts[r], np.float64)
        y = np.zeros(sum(matrix[r]), np.int32)
        gathered = comm.allgatherv_init(x, counts, algorithm="ring")
        exchanged = comm.alltoallv_init(y, matrix[r])  # the rows of the matrix are exchanged here
        seen = []
        for k in range(4):
            x[...] = np.arange(counts[r]) + 10 * r + k
            y[...] = np.arange(y.size) + 100 * r + k
            gathered.start()
            exchanged.start()
            total = comm.allreduce(np.array([k + r]))  # a blocking call while both are in flight
            if (r + k) % 2:  # waited in either order
                b, a = exchanged.wait(), gathered.wait()
            else:
                a, b = gathered.wait(), exchanged.wait()
            seen.append((a.copy(), b.copy(), int(total[0])))
        gathered.free()
        exchanged.free()
        return seen

    results = ck.run_local(body, 3, timeout=20)
    for r, seen in enumerate(results):
        for k, (a, b, total) in enumerate(seen):
            xs = [np.arange(counts[q]) + 10 * q + k for q in range(3)]
            ys = [(np.arange(sum(matrix[q])) + 100 * q + k).astype(np.int32) for q in range(3)]
            np.testing.assert_array_equal(a, np.concatenate(xs))
            np.testing.assert_array_equal(b, np.concatenate([_split(ys[q], matrix[q])[r] for q in range(3)]))
            assert total == 3 * k + 3


def test_persistent_vector_input_must_be_read_in_place():
    def body(comm):
        r = comm.rank
        fortran = np.asfortranarray(np.ones((2, 3)))
        _raises(ck.InvalidBuffer, r"allgatherv_init's x must be a C-contiguous array: .* every start\(\)",
                comm.allgatherv_init, fortran, [2, 2])
        _raises(ck.InvalidBuffer, r"gatherv_init's x must be a C-contiguous array.*a list", comm.gatherv_init,
                [1.0, 2.0], 0, [2, 2])
        _raises(ck.InvalidBuffer, r"alltoallv_init's x must be a C-contiguous array", comm.alltoallv_init,
                np.ones(8)[::2], [[2, 2], [2, 2]])
        # Only the root's x is read; every rank makes the request (a refused one counts as made where it is
        # refused, so that requests made later pair up), and the others' is freed unused.
        if r == 0:
            _raises(ck.InvalidBuffer, r"scatterv_init's x must be a C-contiguous array", comm.scatterv_init,
                    np.ones(8)[::2], [2, 2])
        else:
            comm.scatterv_init(None, [2, 2], out=np.empty(2)).free()
        # Counts are still checked before anything is sent, as for the blocking forms.
        _raises(ck.InvalidArgument, r"counts must have 2 entries, one per rank; got 3", comm.allgatherv_init,
                np.ones(2), [2, 2, 2])
        # A view of a C-contiguous array is the caller's memory: accepted.
        base = np.zeros(6)
        request = comm.allgatherv_init(base[2 * r:2 * r + 2], [2, 2])
        base[2 * r:2 * r + 2] = r + 1
        request.start()
        return request.wait().tolist()

    assert ck.run_local(body, 2, timeout=10) == [[1.0, 1.0, 2.0, 2.0]] * 2
