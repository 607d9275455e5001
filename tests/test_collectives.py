"""Every collective x every applicable algorithm, property-tested against NumPy on the threads world.

Hypothesis draws the world size (1..16, so 3, 5, 6, 7, 13 all occur), dtype (bool
to complex128), op, shape (scalars, zero-length, counts below p and not divisible
by p, 2-D), root and per-rank counts. Integer, bool and max/min results must be
exact; float sums and products are compared with a tolerance scaled by p and eps.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, strategies as st

import commkit as ck
from commkit.collectives import FIXED

from contracts import ROOTED, applicable_algorithms, cases, check_case, collective_input, expected

SIZES = st.one_of(st.sampled_from([1, 2, 3, 5, 6, 7, 13]), st.integers(1, 16))


def _run_all_algorithms(size, case):
    coll = case["collective"]
    names = applicable_algorithms(coll, size)

    def body(comm):
        for name in names:
            got, before = check_case(comm, case, name)
            # Out-of-place calls leave the input bit-identical.
            np.testing.assert_array_equal(collective_input(case, comm.rank, comm.size), before)
        return len(names)

    counts = ck.run_local(body, size, timeout=30)
    assert counts == [len(names)] * size


@pytest.mark.parametrize("collective", FIXED)
@given(data=st.data())
def test_collective_matches_numpy(collective, data):
    size = data.draw(SIZES, label="size")
    case = data.draw(cases(size, collectives=(collective,)), label="case")
    _run_all_algorithms(size, case)


def _affine(a, b):
    """Compose affine maps x -> m x + c stored as complex m + ic: apply a, then b.

    Associative but not commutative, so any reordering of ranks changes the result.
    """
    return (a.real * b.real) + 1j * (a.imag * b.real + b.imag)


AFFINE = ck.Op(_affine, commutative=False, name="affine")


@pytest.mark.parametrize("collective", ["allreduce", "reduce", "scan", "exscan", "reduce_scatter"])
@given(size=st.integers(1, 11), n=st.integers(0, 9), seed=st.integers(0, 2**31), root=st.integers(0, 10))
def test_non_commutative_ops_reduce_in_rank_order(collective, size, n, seed, root):
    rng = np.random.default_rng(seed)
    # Small integer coefficients keep every composition exact in float64.
    xs = [(rng.choice([-1.0, 1.0, 2.0], size=n) + 1j * rng.integers(-3, 4, size=n)) for _ in range(size)]
    counts = list(rng.multinomial(n, [1 / size] * size)) if collective == "reduce_scatter" else None
    root = root % size
    names = applicable_algorithms(collective, size, AFFINE)
    assert "naive" in names

    def body(comm):
        x = xs[comm.rank]
        for name in names:
            if collective == "allreduce":
                got = comm.allreduce(x, AFFINE, algorithm=name)
                exp = _chain(xs)
            elif collective == "reduce":
                got = comm.reduce(x, AFFINE, root, algorithm=name)
                exp = _chain(xs) if comm.rank == root else None
            elif collective == "scan":
                got = comm.scan(x, AFFINE, algorithm=name)
                exp = _chain(xs[: comm.rank + 1])
            elif collective == "exscan":
                got = comm.exscan(x, AFFINE, algorithm=name)
                exp = _chain(xs[: comm.rank]) if comm.rank else None
            else:
                got = comm.reduce_scatter(x, AFFINE, counts=counts, algorithm=name)
                off = np.cumsum([0] + counts)
                exp = _chain(xs)[off[comm.rank]: off[comm.rank + 1]]
            if exp is None:
                assert got is None
            else:
                np.testing.assert_array_equal(got, exp, err_msg=f"{collective}_{name}")

    ck.run_local(body, size, timeout=30)


def _chain(xs):
    acc = xs[0].copy()
    for x in xs[1:]:
        acc = _affine(acc, x)
    return acc


def test_commutative_only_algorithms_refuse_non_commutative_ops():
    def body(comm):
        with pytest.raises(ck.AlgorithmNotApplicable, match="commutative"):
            comm.allreduce(np.ones(4, complex), AFFINE, algorithm="ring")
        # Automatic selection never picks one.
        comm.allreduce(np.ones(4096, complex), AFFINE)
        return comm.last_algorithm

    assert ck.run_local(body, 3) == ["recursive_doubling"] * 3


@given(size=st.integers(1, 9), n=st.integers(0, 40), seed=st.integers(0, 2**31),
       algorithm=st.sampled_from(["naive", "ring", "recursive_doubling", "rabenseifner", "ring_pipelined"]))
def test_in_place_allreduce_changes_only_the_given_buffer(size, n, seed, algorithm):
    def body(comm):
        rng = np.random.default_rng([seed, comm.rank])
        x = rng.integers(-100, 100, size=n)
        other = rng.integers(-100, 100, size=n)
        other_before = other.copy()
        result = comm.allreduce(x, out=x, algorithm=algorithm)
        assert result is x
        np.testing.assert_array_equal(other, other_before)
        return x

    results = ck.run_local(body, size)
    total = sum(np.random.default_rng([seed, r]).integers(-100, 100, size=n) for r in range(size))
    for got in results:
        np.testing.assert_array_equal(got, total)


@given(size=st.integers(1, 8), n=st.integers(0, 30), seed=st.integers(0, 2**31), root=st.integers(0, 7),
       collective=st.sampled_from(["broadcast", "reduce", "scan", "exscan"]))
def test_in_place_other_collectives(size, n, seed, root, collective):
    root %= size
    case = {"collective": collective, "seed": seed, "dtype": "int64", "shape": [n], "op": "sum", "root": root}

    def body(comm):
        names = applicable_algorithms(collective, comm.size)
        for name in names:
            x = collective_input(case, comm.rank, comm.size)
            if collective == "broadcast":
                got = comm.broadcast(x, root, out=x, algorithm=name)
            elif collective == "reduce":
                got = comm.reduce(x, "sum", root, out=x if comm.rank == root else None, algorithm=name)
            else:
                got = getattr(comm, collective)(x, out=x, algorithm=name)
            exp = expected(case, comm.rank, comm.size)
            if exp is None:
                assert got is None
            else:
                assert got is x
                np.testing.assert_array_equal(x, exp)

    ck.run_local(body, size)


def test_out_buffer_receives_result_and_is_validated():
    def body(comm):
        x = np.arange(6, dtype=np.float32).reshape(2, 3) + comm.rank
        out = np.empty((2, 3), np.float32)
        assert comm.allreduce(x, out=out) is out
        np.testing.assert_array_equal(out, sum(np.arange(6, dtype=np.float32).reshape(2, 3) + r for r in range(comm.size)))
        with pytest.raises(ck.InvalidBuffer, match="dtype float32, got float64"):
            comm.allreduce(x, out=np.empty((2, 3)))
        with pytest.raises(ck.InvalidBuffer, match=r"shape \(2, 3\), got \(6,\)"):
            comm.allreduce(x, out=np.empty(6, np.float32))
        gathered = np.empty((comm.size, 2, 3), np.float32)
        assert comm.allgather(x, out=gathered) is gathered

    ck.run_local(body, 3)


@given(size=st.integers(1, 8), n=st.integers(0, 50), seed=st.integers(0, 2**31))
def test_two_nonblocking_collectives_in_flight(size, n, seed):
    def body(comm):
        rng = np.random.default_rng([seed, comm.rank])
        a, b = rng.integers(-9, 9, size=n), rng.integers(-9, 9, size=(comm.size, 2))
        r1 = comm.iallreduce(a, algorithm="ring")
        r2 = comm.iallgather(b, algorithm="bruck")
        r3 = comm.ibarrier()
        # Progress them in the "wrong" order: the schedules must not interfere.
        out3, out2, out1 = r3.wait(), r2.wait(), r1.wait()
        assert out3 is None
        return out1, out2

    results = ck.run_local(body, size)
    total = sum(np.random.default_rng([seed, r]).integers(-9, 9, size=n) for r in range(size))
    stacks = []
    for r in range(size):
        rng = np.random.default_rng([seed, r])
        rng.integers(-9, 9, size=n)
        stacks.append(rng.integers(-9, 9, size=(size, 2)))
    for out1, out2 in results:
        np.testing.assert_array_equal(out1, total)
        np.testing.assert_array_equal(out2, np.stack(stacks))


def test_nonblocking_test_polls_to_completion():
    def body(comm):
        req = comm.iallreduce(np.full(5, comm.rank + 1.0))
        while not req.test():
            pass
        assert req.done
        return req.wait()

    for out in ck.run_local(body, 4):
        np.testing.assert_array_equal(out, np.full(5, 10.0))


@pytest.mark.parametrize("collective", ROOTED)
def test_rooted_collectives_validate_root(collective):
    def body(comm):
        x = np.ones((comm.size, 2))
        with pytest.raises(ck.InvalidArgument, match=r"root must be in range\(0, 3\), got 3"):
            if collective == "scatter":
                comm.scatter(x, 3, out=np.empty(2))
            else:
                getattr(comm, collective)(x, root=3)

    ck.run_local(body, 3)


@pytest.mark.parametrize("collective", ["gather", "scatter"])
@pytest.mark.parametrize("p", [2, 3, 4, 5, 8])
def test_binomial_gather_and_scatter_copy_no_more_than_the_blocks_that_wrap(collective, p):
    # The root receives (gather) or sends (scatter) each subtree where it lies in its output or input, and a
    # leaf sends its input or receives into its output: only a subtree that runs past rank p-1 goes through
    # scratch at the root. At root 0 nothing wraps, so the root copies its own block alone, and a leaf nothing.
    from commkit import algorithms, collectives
    from commkit.schedule import COPY

    alg = algorithms.get(collective, "binomial")
    count = 3
    for root in range(p):
        copied = {}
        for rank in range(p):
            steps = list(collectives.steps(alg.schedule, collective, rank, p, count, None, root))
            copied[rank] = sum(s.dst[2] - s.dst[1] for s in steps if s.kind == COPY)
        wraps = p * count if root else 0  # at most the blocks before the wrap and after it, once each
        assert copied[root] <= count + wraps, (root, copied)
        if root == 0:
            assert copied[0] == count, copied
        leaves = [r for r in range(p) if not algorithms.tree.binomial_children((r - root) % p, p) and r != root]
        assert leaves and all(copied[r] == 0 for r in leaves), (root, copied)


@pytest.mark.parametrize("p", [3, 5, 6, 7, 8])
@pytest.mark.parametrize("dtype", [np.complex128, np.complex64])
def test_every_rank_holds_the_same_bits_of_a_complex_product(p, dtype):
    # NumPy's in-place complex multiply rounds differently from its out-of-place one (it fuses a multiply-add
    # in one loop and not the other), and an algorithm whose ranks fold the same values, one in place and one
    # not (recursive doubling at p = 7: ranks that took part in the fold and ranks that did not), left them
    # with different results. Every allreduce algorithm, at the first call, the compiled plans and in place.
    names = [name for name in ck.algorithms.for_collective("allreduce") if name not in ("native", "hier")]

    def body(comm):
        differs = []
        for count in (1, 3, 7, 100):
            rng = np.random.default_rng([comm.rank, count, p])
            x = (rng.standard_normal(count) + 1j * rng.standard_normal(count)).astype(dtype)
            for name in names:
                try:
                    got = [comm.allreduce(x, "prod", algorithm=name) for _ in range(3)]  # the third runs a plan
                except ck.AlgorithmNotApplicable:
                    continue
                inplace = x.copy()
                comm.allreduce(inplace, "prod", out=inplace, algorithm=name)
                mine = [y.tobytes() for y in got + [inplace]]
                everyone = comm.allgather_object(mine)
                if any(theirs != everyone[0] for theirs in everyone):
                    differs.append((name, count))
        return differs

    assert ck.run_local(body, size=p)[0] == []
