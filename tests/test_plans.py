"""Compiled plans, persistent collectives and the one request interface.

A plan replays a call shape compiled against fixed arrays, so the tests change
the data between calls (a plan that captured values instead of views would
fail), swap arrays, reinterpret dtypes, and mix plans with the general path.
"""

from __future__ import annotations

import re
import time

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import commkit as ck

from call_forms import counting_fresh, counting_general_path
from conftest import requires_mpi, run_mpi

COLLECTIVE_INITS = ["allreduce", "reduce", "scan", "exscan", "broadcast", "gather", "scatter", "allgather",
                    "alltoall", "reduce_scatter", "barrier"]


def _expected(name, inputs, rank, root=0):
    """NumPy's answer for ``rank`` given every rank's input of this round."""
    p = len(inputs)
    if name == "allreduce":
        return np.sum(inputs, axis=0)
    if name == "reduce":
        return np.sum(inputs, axis=0) if rank == root else None
    if name == "scan":
        return np.sum(inputs[: rank + 1], axis=0)
    if name == "exscan":
        return np.sum(inputs[:rank], axis=0) if rank else np.zeros_like(inputs[0])
    if name == "broadcast":
        return inputs[root]
    if name == "gather":
        return np.stack(inputs) if rank == root else None
    if name == "scatter":
        return inputs[root].reshape(p, -1)[rank]
    if name == "allgather":
        return np.stack(inputs)
    if name == "alltoall":
        return np.stack([inputs[j].reshape(p, -1)[rank] for j in range(p)])
    if name == "reduce_scatter":
        return np.sum(inputs, axis=0).reshape(p, -1)[rank]
    return None


def _setup(comm, name, n, root=0):
    """Arrays for one collective on this rank: (x, out, start(request) -> None, call(**kw) -> result)."""
    p, r = comm.size, comm.rank
    if name in ("scatter", "alltoall", "reduce_scatter"):
        x = np.zeros(p * n)
        shape = (p, n) if name == "alltoall" else (n,)
        out = np.empty(shape)
        xx = x.reshape(p, n) if name in ("alltoall", "scatter") else x
    else:
        x = np.zeros(n)
        xx = x
        out = np.empty((p, n)) if name in ("gather", "allgather") else np.empty(n)
    if name in ("reduce", "gather") and r != root:
        out = None
    kwargs = {"out": out}
    if name in ("reduce", "gather", "scatter", "broadcast"):
        kwargs["root"] = root
    if name == "scatter" and r != root:
        xx = None
    return x, xx, out, kwargs


@pytest.mark.parametrize("name", COLLECTIVE_INITS)
@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_persistent_collectives_restart_with_new_data(name, size):
    rounds, n = 4, 6

    def body(comm):
        x, xx, out, kwargs = _setup(comm, name, n)
        if name == "barrier":
            req = comm.barrier_init()
        else:
            req = getattr(comm, f"{name}_init")(xx, **kwargs)
        assert isinstance(req, ck.Request) and req.done
        got = []
        for k in range(rounds):
            x[...] = np.random.default_rng(100 * k + comm.rank).integers(-9, 9, x.size)
            req.start()
            result = req.wait()
            assert req.done and req.result is result
            got.append((x.copy(), None if result is None else np.array(result, copy=True)))
            comm.barrier()  # a regular call between runs must not disturb the request
        req.start()
        if not req.done:
            with pytest.raises(ck.InvalidArgument, match="is active: complete it with wait"):
                req.start()
        req.wait()
        req.free()
        with pytest.raises(ck.InvalidArgument, match="freed"):
            req.start()
        return got

    per_rank = ck.run_local(body, size)
    if name == "barrier":
        return
    for k in range(rounds):
        inputs = [per_rank[r][k][0] for r in range(size)]
        for r in range(size):
            want = _expected(name, inputs, r)
            result = per_rank[r][k][1]
            if want is None:
                assert result is None
            else:
                np.testing.assert_array_equal(result.reshape(want.shape), want)


@pytest.mark.parametrize("algorithm", ["naive", "ring", "recursive_doubling", "rabenseifner"])
def test_persistent_allreduce_in_place_and_two_requests_interleaved(algorithm):
    def body(comm):
        a = np.zeros(7)
        b = np.zeros(7, np.int64)
        ra = comm.allreduce_init(a, out=a, algorithm=algorithm)
        rb = comm.allreduce_init(b, "max", algorithm=algorithm)
        results = []
        for k in range(3):
            a[...] = comm.rank + k
            b[...] = comm.rank * (k + 1)
            ra.start()
            rb.start()
            # Waited in opposite orders on odd and even ranks: the requests drive each other.
            if comm.rank % 2:
                vb, va = rb.wait(timeout=10), ra.wait(timeout=10)
            else:
                va, vb = ra.wait(timeout=10), rb.wait(timeout=10)
            assert va is a  # in place: the result is the array itself
            results.append((va.copy(), vb.copy()))
        return results

    p = 4
    for rank_results in ck.run_local(body, p):
        for k, (va, vb) in enumerate(rank_results):
            np.testing.assert_array_equal(va, np.full(7, sum(range(p)) + p * k, float))
            np.testing.assert_array_equal(vb, np.full(7, (p - 1) * (k + 1)))


@settings(max_examples=30, deadline=None)
@given(size=st.integers(1, 6), n=st.integers(0, 9), calls=st.integers(2, 5),
       algorithm=st.sampled_from([None, "naive", "ring", "recursive_doubling", "rabenseifner"]))
def test_repeated_calls_on_the_same_arrays_use_a_plan_and_stay_right(size, n, calls, algorithm):
    def body(comm):
        x, out = np.zeros(n, np.float32), np.empty(n, np.float32)
        seen = []
        for k in range(calls):
            x[...] = np.arange(n) * (comm.rank + 1) + k
            result = comm.allreduce(x, out=out, algorithm=algorithm)
            assert result is out
            seen.append(out.copy())
            comm.allreduce(x, out=x, algorithm=algorithm)  # in place on the same array, its own plan
            np.testing.assert_array_equal(x, out)
        return seen, len(comm._fast)

    results = ck.run_local(body, size)
    for seen, plans in results:
        for k, got in enumerate(seen):
            np.testing.assert_array_equal(got, np.arange(n) * sum(range(1, size + 1)) + size * k)
        assert plans >= 1 or n * 4 > ck.Communicator._FAST_MAX_BYTES


def test_plan_is_not_used_when_the_call_changes():
    def body(comm):
        x, out = np.ones(4), np.empty(4)
        for _ in range(3):
            comm.allreduce(x, out=out)
        assert len(comm._fast) == 1
        # The same array object, reinterpreted: the plan must not run on the new dtype.
        x.dtype = np.int64
        x[...] = comm.rank + 1
        with pytest.raises(ck.InvalidBuffer, match="dtype"):
            comm.allreduce(x, out=out)
        y = np.empty(4, np.int64)
        comm.allreduce(x, out=y)
        assert y.tolist() == [sum(range(1, comm.size + 1))] * 4
        # A timeout set on the communicator takes the general path (it can give up).
        comm.timeout = 5
        x2 = np.ones(4)
        comm.allreduce(x2, out=out)
        comm.allreduce(x2, out=out)
        assert ("allreduce", id(x2), id(out), "sum", None) not in comm._fast
        return out.tolist()

    assert ck.run_local(body, 3) == [[3.0] * 4] * 3


@pytest.mark.parametrize("collective", ["allreduce", "broadcast"])
def test_a_loop_back_on_an_earlier_call_takes_its_plan_by_identity_again(collective):
    """Two compiled calls used in turn: going back to the first makes its plan the one tested first."""
    def body(comm):
        a, b, out_a, out_b = np.full(4, comm.rank + 1.0), np.full(8, 2.0), np.empty(4), np.empty(8)

        def call(x, out):
            if collective == "allreduce":
                return comm.allreduce(x, out=out)
            return comm.broadcast(x, 0, out=out)

        for _ in range(3):
            call(a, out_a)
        plan_a = comm.last_plan(collective)
        for _ in range(3):
            call(b, out_b)
        assert comm.last_plan(collective) is not plan_a
        a[...] = comm.rank + 10.0  # new data: the plan must read it
        call(a, out_a)
        assert comm.last_plan(collective) is plan_a
        want = sum(q + 10.0 for q in range(comm.size)) if collective == "allreduce" else 10.0
        return out_a.tolist() == [want] * 4

    assert all(ck.run_local(body, 3))


def test_plan_of_finds_a_calls_own_plan_and_a_forgotten_plan_is_never_ready_again():
    """plan_of looks a plan up by the call's exact arguments (another op, root or array is another call's);
    forget_plans retires every plan, so one kept outside the communicator stops running."""
    def body(comm):
        x, out = np.full(4, comm.rank + 1.0), np.empty(4)
        for _ in range(2):
            comm.allreduce(x, "sum", out=out)
            comm.broadcast(x, 1, out=x)
        plan, bplan = comm.plan_of("allreduce", x, out, "sum"), comm.plan_of("broadcast", x, x, 1)
        assert plan is not None and plan is comm.last_plan("allreduce") and plan.ready(x)
        assert bplan is not None and bplan is comm.last_plan("broadcast")
        assert comm.plan_of("allreduce", x, out, "max") is None
        assert comm.plan_of("allreduce", x, np.empty(4), "sum") is None
        assert comm.plan_of("broadcast", x, x, 0) is None
        x[:] = comm.rank + 1.0
        plan.run()  # the kept plan, run directly, as the mpi4py face does: this call's data
        assert out.tolist() == [sum(range(1, comm.size + 1))] * 4
        comm.forget_plans()
        assert not plan.ready(x) and not bplan.ready(x) and comm.plan_of("allreduce", x, out, "sum") is None
        for _ in range(2):
            comm.allreduce(x, "sum", out=out)
        again = comm.plan_of("allreduce", x, out, "sum")
        return again is not None and again is not plan and again.ready(x)

    assert all(ck.run_local(body, 3))


def test_wait_any_and_wait_all_over_any_mix_of_requests():
    def body(comm):
        peer_right, peer_left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
        persistent = comm.allreduce_init(np.ones(3))
        persistent.start()
        requests = [
            comm.irecv(peer_left, tag=5, shape=2, dtype=np.int64),
            comm.iallgather(np.array([comm.rank])),
            comm.ibarrier(),
            persistent,
        ]
        assert all(isinstance(r, ck.Request) for r in requests)
        comm.send(np.array([comm.rank, 7]), peer_right, tag=5)
        index, value = ck.wait_any(requests, timeout=10)
        assert requests[index].done
        results = ck.wait_all(requests, timeout=10)
        assert requests[0].status.source == peer_left
        assert all(r.status is None for r in requests[1:])
        return results[0].tolist(), results[1].ravel().tolist(), results[3].tolist()

    for rank, (got, gathered, total) in enumerate(ck.run_local(body, 3)):
        assert got == [(rank - 1) % 3, 7]
        assert gathered == [0, 1, 2]
        assert total == [3.0] * 3
    with pytest.raises(ck.InvalidArgument):
        ck.wait_any([])


@requires_mpi
@pytest.mark.mpi
def test_plans_and_persistent_collectives_under_mpiexec():
    code = """
    import numpy as np
    import commkit as ck
    c = ck.init()
    p, r = c.size, c.rank
    for algorithm in (None, "native", "ring", "recursive_doubling", "naive"):
        x, out = np.zeros(5, np.int64), np.empty(5, np.int64)
        req = c.allreduce_init(x, out=out, algorithm=algorithm)
        for k in range(4):
            x[...] = r * 10 + k
            assert c.allreduce(x, out=out, algorithm=algorithm) is out   # plans after the 2nd call
            assert out.tolist() == [sum(q * 10 + k for q in range(p))] * 5, (algorithm, out)
            out[...] = -1
            req.start(); req.wait()
            assert out.tolist() == [sum(q * 10 + k for q in range(p))] * 5, (algorithm, out)
        req.free()
    # broadcast in place with plans and persistently, native and not
    for algorithm in (None, "native", "binomial"):
        b = np.zeros(3)
        breq = c.broadcast_init(b, root=p - 1, out=b, algorithm=algorithm)
        for k in range(3):
            b[...] = k if r == p - 1 else -5
            c.broadcast(b, root=p - 1, out=b, algorithm=algorithm)
            assert b.tolist() == [k] * 3
            b[...] = k + 1 if r == p - 1 else -5
            breq.start(); breq.wait()
            assert b.tolist() == [k + 1] * 3
    print(f"ok {r}", flush=True)
    """
    for nprocs in (2, 3):
        # No default timeout (run_mpi sets one): a call with a timeout takes the timed path, not these plans.
        result = run_mpi(nprocs, code, timeout=120, env={"COMMKIT_TIMEOUT": ""})
        assert result.stdout.count("ok") == nprocs


# -- overlap: local steps while a transfer is in flight ------------------------------------------------------


def _all_schedules(p, count=13, root=1):
    from commkit import algorithms, collectives
    from commkit.ops import SUM

    for collective in collectives.FIXED:
        for name, alg in algorithms.for_collective(collective).items():
            if alg.schedule is None or (alg.power_of_two and p & (p - 1)):
                continue
            arg = tuple([count] * p) if collective == "reduce_scatter" else count
            for rank in range(p):
                steps = collectives.steps(alg.schedule, collective, rank, p, arg, SUM, root % p)
                yield collective, name, rank, list(steps)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 8, 13, 16])
def test_overlapped_local_steps_never_race_with_their_transfer(p):
    from commkit.schedule import TRANSFER, check_overlap

    for collective, name, rank, steps in _all_schedules(p):
        for step in steps:
            if step.kind == TRANSFER and step.overlap:
                assert not check_overlap(step), (collective, name, rank, check_overlap(step))


def test_check_overlap_finds_a_race():
    from commkit.schedule import Copy, Exchange, Reduce, check_overlap, overlaps_safely
    from commkit.ops import SUM

    racy = Exchange(1, ("out", 0, 4), 1, ("tmp", 0, 4),
                    overlap=(Copy(("out", 2, 6), ("in", 2, 6)), Reduce(("out", 8, 9), ("tmp", 3, 4), SUM)))
    problems = check_overlap(racy)
    assert len(problems) == 2
    assert "writes ('out', 2, 6)" in problems[0] and "reads ('tmp', 3, 4)" in problems[1]
    safe = Exchange(1, ("out", 0, 4), 1, ("tmp", 0, 4), overlap=(Copy(("out", 4, 8), ("in", 4, 8)),))
    assert not check_overlap(safe)
    # each race alone, and none: the yes-or-no a generator asks agrees with the list
    reads_only = Exchange(1, ("out", 0, 4), 1, ("tmp", 0, 4), overlap=(Reduce(("out", 8, 9), ("tmp", 3, 4), SUM),))
    writes_only = Exchange(1, ("out", 0, 4), 1, ("tmp", 0, 4), overlap=(Copy(("out", 2, 6), ("in", 2, 6)),))
    assert [overlaps_safely(s) for s in (racy, reads_only, writes_only, safe)] == [False, False, False, True]
    assert [len(check_overlap(s)) for s in (reads_only, writes_only)] == [1, 1]


def test_broadcast_root_sends_from_its_input_and_copies_meanwhile():
    from commkit.algorithms.tree import broadcast_binomial
    from commkit.schedule import COPY, TRANSFER

    steps = list(broadcast_binomial(0, 4, 10, 0))
    assert steps[0].kind == TRANSFER and steps[0].sends[0][1] == ("in", 0, 10)
    assert [s.kind for s in steps[0].overlap] == [COPY]  # the copy rides along the first send
    assert all(s.kind == TRANSFER for s in steps)

    def body(comm):
        x = np.arange(6.0) * (comm.rank == 2)
        out = comm.broadcast(x, root=2, algorithm="binomial")
        same = comm.broadcast(x, root=2, out=x, algorithm="binomial")  # in place: nothing to copy
        return out.tolist(), same is x, x.tolist()

    for out, same, x in ck.run_local(body, 5):
        assert out == list(np.arange(6.0)) and same and x == out


def test_persistent_input_must_be_the_callers_own_memory():
    def body(comm):
        strided = np.arange(8.0)[::2]
        with pytest.raises(ck.InvalidBuffer, match="allreduce_init's x must be a C-contiguous array"):
            comm.allreduce_init(strided)
        with pytest.raises(ck.InvalidBuffer, match="broadcast_init's x must be a C-contiguous array"):
            comm.broadcast_init([1.0, 2.0])
        comm.allreduce(strided)  # blocking calls still copy what they must

    ck.run_local(body, 2)


# -- in-place safety, from the data flow (schedule.inplace_safe) --------------------------------------


def test_inplace_safe_follows_the_data():
    from commkit.ops import get_op
    from commkit.schedule import Copy, Exchange, Recv, Reduce, Send, inplace_safe

    add = get_op("sum")
    assert inplace_safe([Copy(("out", 0, 4), ("in", 0, 4)), Send(1, ("out", 0, 4))])  # identity copy
    assert inplace_safe([Exchange(1, ("in", 0, 4), 1, ("tmp", 0, 4)),
                         Reduce(("out", 0, 4), ("tmp", 0, 4), add, src=("in", 0, 4))])  # elementwise
    # Reading input the output has overwritten: in place it would read the new values.
    assert not inplace_safe([Recv(1, ("out", 0, 4)), Send(2, ("in", 2, 6))])
    assert not inplace_safe([Reduce(("out", 0, 4), ("tmp", 0, 4), add, src=("in", 0, 4)),
                             Copy(("tmp", 0, 2), ("in", 3, 5))])
    # Sending a range while receiving into the same range in one transfer.
    assert not inplace_safe([Exchange(1, ("in", 0, 4), 1, ("out", 2, 6))])
    # An overlapped local step that writes output the transfer's send reads.
    assert not inplace_safe([Send(1, ("in", 0, 4), overlap=(Copy(("out", 0, 4), ("tmp", 0, 4)),))])
    # A reduction whose input and output ranges differ but overlap.
    assert not inplace_safe([Reduce(("out", 1, 5), ("tmp", 0, 4), add, src=("in", 0, 4))])


@pytest.mark.parametrize("collective", ["broadcast", "reduce", "allreduce", "scan", "exscan"])
def test_inplace_safety_of_the_built_in_schedules(collective):
    # The algorithms once listed by hand as in-place safe are found safe from their steps, for
    # every rank, root and a spread of counts; a few are not safe and must say so.
    from commkit import algorithms, collectives
    from commkit.ops import get_op
    from commkit.schedule import inplace_safe

    by_hand = {("allreduce", "ring"), ("allreduce", "recursive_doubling"), ("allreduce", "rabenseifner"),
               ("allreduce", "naive"), ("scan", "recursive_doubling"), ("scan", "naive"),
               ("exscan", "recursive_doubling"), ("broadcast", "naive"), ("broadcast", "binomial"),
               ("broadcast", "ring")}
    op = get_op("sum") if collective in collectives.REDUCING else None
    verdicts = {}
    for name, alg in algorithms.for_collective(collective).items():
        if alg.schedule is None:
            continue
        verdicts[name] = all(
            inplace_safe(list(collectives.steps(alg.schedule, collective, r, p, count, op, root)))
            for p in range(1, 10) if alg.why_not(p, op) is None
            for count in (0, 1, 5, 16, 33)
            for root in (range(p) if collective in collectives.ROOTED else (0,))
            for r in range(p))
    for (c, name) in by_hand:
        if c == collective:
            assert verdicts[name], name
    if collective == "exscan":
        assert not verdicts["naive"]  # it reads its input after writing the output
    if collective == "reduce":
        assert not verdicts["naive"]


# -- shape plans: new arrays of a known shape, and calls without out ----------------------------------------


def _new_arrays_body(name, algorithm, n, rounds, root):
    """Each round: new input arrays, and the output given new, left out, or (same x) left out again."""
    def body(comm):
        r = comm.rank
        got = []
        same_x = None
        for k in range(rounds):
            x, xx, out, kwargs = _setup(comm, name, n, root)
            mode = ("new out", "no out", "no out, same x", "no out, same x")[k % 4]
            if mode.endswith("same x"):
                if same_x is None:
                    same_x = (x, xx)
                x, xx = same_x
            x[...] = np.random.default_rng(1000 * k + r).integers(-9, 9, x.size)
            given = x.copy()
            if mode != "new out" and not (name == "scatter" and r != root):
                kwargs["out"] = None
            result = getattr(comm, name)(xx, algorithm=algorithm, **kwargs)
            np.testing.assert_array_equal(x, given)  # the input is never touched
            if kwargs.get("out") is not None:
                assert result is kwargs["out"]
            got.append((given, result, None if result is None else result.copy()))
        compiled = [v for v in comm._shaped.values() if isinstance(v, ck.plan.Plan)]
        fresh = [v for v in comm._fast.values() if v is not None and v.hot is not None and v.hot[1] is None]
        return got, len(compiled), len(fresh)
    return body


@pytest.mark.parametrize("name", [c for c in COLLECTIVE_INITS if c != "barrier"])
@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_new_arrays_and_no_out_run_plans_and_stay_right(name, size):
    """Every algorithm: calls with new arrays run the shape plan, calls without out a plan that allocates.

    A result handed back must be the caller's to keep: the next call must not
    write into it (a plan that bound its output would).
    """
    rounds, n, root = 8, 3, size - 1
    for algorithm in [None, *(a for a in ck.algorithms.for_collective(name) if a != "native")]:
        alg = ck.algorithms.get(name, algorithm) if algorithm else None
        if alg is not None and alg.why_not(size, ck.ops.get_op("sum")) is not None:
            continue
        if algorithm == "shm":
            continue  # one-sided steps on the node arena: by design only the interpreter runs them (test_node.py)
        per_rank = ck.run_local(_new_arrays_body(name, algorithm, n, rounds, root), size)
        for k in range(rounds):
            inputs = [per_rank[r][0][k][0] for r in range(size)]
            for r in range(size):
                want = _expected(name, inputs, r, root)
                _, result, copy = per_rank[r][0][k]
                if want is None:
                    assert result is None
                    continue
                np.testing.assert_array_equal(copy.reshape(want.shape), want, err_msg=f"{algorithm} round {k}")
                np.testing.assert_array_equal(result, copy, err_msg=f"{algorithm}: a later call wrote into "
                                                                    f"round {k}'s result")
        for r in range(size):
            assert per_rank[r][1] >= 1, f"{name} {algorithm}: no shape plan on rank {r}"
            # exscan finishes its result after the run (rank 0's identity): its calls without out take the shape plan
            without_out = not (name == "scatter" and r != root)  # a scatter's non-root ranks always pass out
            if name != "exscan" and without_out and _expected(name, [np.zeros(n * size)] * size, r, root) is not None:
                assert per_rank[r][2] >= 1, f"{name} {algorithm}: no plan for the calls without out on rank {r}"


def test_a_shape_plan_is_refused_when_an_op_could_hold_a_view_of_its_own(monkeypatch):
    """Ops that are not written inline, or that bind a view the plan cannot re-slice, keep the general path."""
    from commkit import plan as plan_module
    from commkit.transports.base import inline

    def resliced(chan, sends, recvs):  # binds views of views: the plan cannot know to slice them per run
        sends = [(peer, view[0:len(view)]) for peer, view in sends]
        recvs = [(peer, view[0:len(view)]) for peer, view in recvs]

        def run(tag):
            chan.transfer(sends, recvs, tag, None)
        return inline(run, "{0}({1}, {2}, tag, None)", (chan.transfer, sends, recvs))

    def body(comm):
        results = []
        for k in range(4):
            x = np.full(5, comm.rank + k, np.float64)
            results.append(comm.allreduce(x, out=np.empty(5), algorithm="ring").tolist())
        # Large enough for overlap: the ring's reductions run in the op that waits for the transfer.
        big = ck.Communicator._FAST_MAX_BYTES // 16
        for k in range(3):
            comm.allreduce(np.ones(big), out=np.empty(big), algorithm="ring_pipelined:16K")
        return results, sorted(map(repr, comm._shaped.values()))

    monkeypatch.setattr(plan_module, "_generic_transfer", resliced)
    for rank, (results, shaped) in enumerate(ck.run_local(body, 3)):
        assert results == [[float(sum(q + k for q in range(3)))] * 5 for k in range(4)]
        assert shaped == ["False", "False"], shaped  # neither shape got a plan; the calls stayed right


# -- new arrays of a shape already run: checked in the method, run by the shape plan (Communicator._fresh) ----


@pytest.mark.parametrize("size", [1, 2, 3, 5])
@pytest.mark.parametrize("name", ["allreduce", "scan", "broadcast"])
def test_new_arrays_of_a_known_shape_skip_the_general_path_and_stay_right(name, size):
    forms = [("float64", (7,), "sum", False, None), ("int32", (2, 3), "max", True, None),
             ("float32", (5,), "sum", False, 30.0), ("int64", (4, 2), "prod", True, 30.0),
             ("float64", (3,), "sum", "x", None), ("int16", (2, 2), "min", "x", 30.0)]  # "x": in place

    def body(comm):
        general = counting_general_path(comm)
        got = []
        for dtype, shape, op, with_out, timeout in forms:
            for k in range(6):
                x = (np.arange(np.prod(shape)).reshape(shape) % 5 + comm.rank + k).astype(dtype)
                given = x.copy()
                out = x if with_out == "x" else np.full(shape, -1, dtype) if with_out else None
                if name == "broadcast":  # the last rank is the root; the op's place holds it
                    result = comm.broadcast(x, comm.size - 1, out=out, timeout=timeout)
                else:
                    result = getattr(comm, name)(x, op, out=out, timeout=timeout)
                assert with_out is False or result is out
                if with_out != "x":
                    np.testing.assert_array_equal(x, given)  # the input is never touched
                got.append((given, result.copy()))
        return got, general

    per_rank = ck.run_local(body, size)
    fold = {"sum": np.add, "max": np.maximum, "prod": np.multiply, "min": np.minimum}
    for r in range(size):
        got, general = per_rank[r]
        case = 0
        for dtype, shape, op, _, _ in forms:
            for k in range(6):
                inputs = [per_rank[q][0][case][0] for q in range(size)]
                upto = inputs[:r + 1] if name == "scan" else inputs
                want = upto[0].copy()
                for more in upto[1:]:
                    want = fold[op](want, more).astype(dtype)
                if name == "broadcast":
                    want = inputs[-1]
                np.testing.assert_array_equal(got[case][1], want, err_msg=f"{dtype} {shape} {op} call {k}")
                case += 1
        # Two calls of each form take the general path (the second compiles the shape plan); the rest do not.
        assert len(general) == 2 * len(forms), (r, general)


@pytest.mark.parametrize("size", [1, 2, 3])
@pytest.mark.parametrize("name", ["allgather", "alltoall"])
def test_new_arrays_of_a_known_shape_skip_the_general_path_for_the_exchanges_too(name, size):
    def body(comm):
        general = counting_general_path(comm)
        got = []
        for dtype, with_out, timeout in (("float64", False, None), ("int16", True, None), ("int64", True, 30.0)):
            for k in range(5):
                shape = (comm.size, 2, 3) if name == "alltoall" else (2, 3)
                x = (np.arange(np.prod(shape)).reshape(shape) + 100 * comm.rank + k).astype(dtype)
                given = x.copy()
                stacked = (comm.size,) + shape if name == "allgather" else shape
                out = np.full(stacked, -1, dtype) if with_out else None
                result = getattr(comm, name)(x, out=out, timeout=timeout)
                assert out is None or result is out
                np.testing.assert_array_equal(x, given)
                got.append((given, result.copy()))
        return got, general

    per_rank = ck.run_local(body, size)
    for r in range(size):
        got, general = per_rank[r]
        for case, (given, result) in enumerate(got):
            inputs = [per_rank[q][0][case][0] for q in range(size)]
            want = np.stack(inputs) if name == "allgather" else np.stack([inputs[q][r] for q in range(size)])
            np.testing.assert_array_equal(result, want, err_msg=f"call {case}")
        assert len(general) == 2 * 3, (r, general)


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_i_forms_on_new_arrays_of_a_known_shape_skip_the_general_path_and_overlap(size):
    def body(comm):
        general = counting_general_path(comm)
        got = []
        for k in range(4):
            xs = [np.arange(6.0) + 10 * comm.rank + k + j for j in range(3)]
            given = [x.copy() for x in xs]
            requests = [comm.iallreduce(xs[0]), comm.iallreduce(xs[1], "max", out=np.empty(6), timeout=30),
                        comm.ibroadcast(xs[2], comm.size - 1), comm.iallgather(xs[0]), comm.iscan(xs[1]),
                        comm.ialltoall(np.repeat(xs[2][None], comm.size, axis=0))]
            results = [r.wait() for r in reversed(requests)][::-1]  # waited for in the other order
            for x, before in zip(xs, given):
                np.testing.assert_array_equal(x, before)
            got.append((given, [r.copy() for r in results]))
        return got, general

    per_rank = ck.run_local(body, size)
    for r in range(size):
        got, general = per_rank[r]
        for k, (given, results) in enumerate(got):
            inputs = [per_rank[q][0][k][0] for q in range(size)]
            np.testing.assert_array_equal(results[0], sum(i[0] for i in inputs))
            np.testing.assert_array_equal(results[1], np.max([i[1] for i in inputs], axis=0))
            np.testing.assert_array_equal(results[2], inputs[-1][2])
            np.testing.assert_array_equal(results[3], np.stack([i[0] for i in inputs]))
            np.testing.assert_array_equal(results[4], sum(i[1] for i in inputs[:r + 1]))
            np.testing.assert_array_equal(results[5], np.stack([i[2] for i in inputs]))
        assert len(general) == 6, (r, general)  # the first of each form only


@pytest.mark.parametrize("algorithm", [None, "ring", "recursive_doubling"])
def test_i_forms_in_place_on_new_arrays_skip_the_general_path(algorithm):
    def body(comm):
        general = counting_general_path(comm)
        got = []
        for k in range(4):
            y = np.arange(5.0) * (comm.rank + 1) + k
            got.append(comm.iallreduce(y, out=y, algorithm=algorithm).wait() is y and y.tolist())
        return got, general

    for rank, (got, general) in enumerate(ck.run_local(body, 3)):
        assert got == [[6.0 * v + 3 * k for v in range(5)] for k in range(4)], (rank, got)
        assert len(general) == 1, general


def test_new_arrays_that_a_first_call_would_refuse_are_refused_on_the_fast_path_too():
    def body(comm):
        for _ in range(3):  # the shape is known: calls on new arrays now take the fast path
            comm.allreduce(np.ones(6), out=np.empty(6))
            comm.allreduce(np.ones(6))
        errors = []
        read_only = np.empty(6)
        read_only.flags.writeable = False
        buf = np.ones(12)
        for out, why in [(read_only, "read-only"), (np.empty(6, np.float32), "dtype float64"),
                         (np.empty(5), r"shape \(6,\)"), (np.empty(12)[::2], "C-contiguous")]:
            with pytest.raises(ck.InvalidBuffer, match=why):
                comm.allreduce(np.ones(6), out=out)
            errors.append(why)
        with pytest.raises(ck.InvalidBuffer, match="overlaps its input"):
            comm.allreduce(buf[:6], out=buf[3:9])
        for _ in range(3):
            comm.allgather(np.ones(2), out=np.empty((comm.size, 2)))
            comm.alltoall(np.ones((comm.size, 2)), out=np.empty((comm.size, 2)))
        with pytest.raises(ck.InvalidBuffer, match="shape"):
            comm.allgather(np.ones(2), out=np.empty((comm.size + 1, 2)))
        for _ in range(2):
            comm.iallreduce(np.ones(6), out=np.empty(6)).wait()
        with pytest.raises(ck.InvalidBuffer, match="read-only"):
            comm.iallreduce(np.ones(6), out=read_only)
        for _ in range(3):
            x = np.ones(6)
            comm.allreduce(x, out=x)  # in place on new arrays: the fresh path from the third call
        read_only_x = np.ones(6)
        read_only_x.flags.writeable = False
        with pytest.raises(ck.InvalidBuffer, match="read-only"):
            comm.allreduce(read_only_x, out=read_only_x)
        square = np.ones((comm.size, 2))
        with pytest.raises(ck.InvalidBuffer, match="in place"):
            comm.alltoall(square, out=square)
        x = np.full(6, 2.0)
        in_place = comm.allreduce(x, out=x)  # in place: its own plan, through the general path
        strided = comm.allreduce(np.arange(12.0)[::2])  # copied to a contiguous array first
        listed = comm.allreduce([1.0] * 6)
        assert in_place is x
        return errors, x.tolist(), strided.tolist(), listed.tolist()

    for errors, in_place, strided, listed in ck.run_local(body, 3):
        assert len(errors) == 4
        assert in_place == [6.0] * 6
        assert strided == [3.0 * v for v in range(0, 12, 2)]
        assert listed == [3.0] * 6


@pytest.mark.parametrize("with_out", [False, True])
def test_a_new_array_given_to_two_collectives_in_turn_runs_each_ones_entry(with_out):
    """Each collective remembers its own last arrays on new arrays: the same x given to another one next is no
    loop of one call, so both calls keep their entries (with an out of its own, or none)."""
    def body(comm):
        r, p = comm.rank, comm.size
        fresh, stop_counting = None, None
        for k in range(12):
            if k == 4:  # (each shape's entry is made by its third call)
                fresh, stop_counting = counting_fresh(comm)
            x = np.full(4, r + k, np.float64)
            a = comm.allreduce(x, out=np.empty(4) if with_out else None)
            b = comm.reduce(x, root=0, out=np.empty(4) if with_out and r == 0 else None)
            total = sum(range(p)) + p * k
            assert a.tolist() == [total] * 4 and (b is None if r else b.tolist() == [total] * 4), (k, a, b)
        stop_counting()
        return fresh

    for fresh in ck.run_local(body, 2):
        assert fresh == [], f"{len(fresh)} of 16 calls on new arrays missed their entry: {fresh}"


@pytest.mark.parametrize("dtype", ["float64", "float32", "int8"])
def test_a_one_element_fold_into_its_own_operand_is_made_apart_and_gives_the_same_bits(dtype):
    """A one-element in-place allreduce's plan folds into a result made apart and copies it in (NumPy runs a
    one-element ufunc whose out overlaps an input through its general iterator, 1.2 us against 0.5): the same
    values, bit for bit, as the call out of place, call after call; a larger one folds in place."""
    def body(comm):
        r = comm.rank
        got = []
        for n in (1, 3):
            x = np.zeros(n, dtype)
            for k in range(4):  # the same array in place: its plan from the second call
                x[...] = (np.arange(n) + 1) * (r + 1) * (k + 1) / 7 if dtype != "int8" else 50 + r + k
                want = comm.allreduce(x.copy())
                assert comm.allreduce(x, out=x) is x
                assert x.tobytes() == want.tobytes(), (n, k, x, want)
            plan = comm.last_plan("allreduce")
            assert plan is not None and plan.hot[0] is x
            got.append("[...] = " in plan.run.source)
        return got

    for one, three in ck.run_local(body, 2):
        assert one and not three


@pytest.mark.parametrize("form", ["out", "no out", "in place"])
def test_a_timed_call_on_the_same_arrays_again_stays_on_its_timed_entry(form):
    """A timed call has no plan of its own arrays, so its timed entry runs it on the same arrays again as on new
    ones: a loop of ``comm.allreduce(x, out=out, timeout=60)`` went through ``Communicator._fresh`` at every call
    (the entry handed the same arrays back for a same-array plan that a timed call never gets). Each call still
    gets its own result, and an untimed loop on the same arrays still gets its own plan."""
    def body(comm):
        r, p = comm.rank, comm.size
        x = np.zeros(4)
        out = x if form == "in place" else np.empty(4) if form == "out" else None
        fresh = stop_counting = None
        for k in range(10):
            if k == 4:  # (the timed shape's entry is made by its third call)
                fresh, stop_counting = counting_fresh(comm)
            x[...] = r + k
            got = comm.allreduce(x, out=out, timeout=60.0)
            assert out is None or got is out
            assert got.tolist() == [sum(range(p)) + p * k] * 4, (k, got)
        stop_counting()
        for k in range(4):  # untimed, the same arrays: the general path compiles their plan, which then runs
            x[...] = r + k
            got = comm.allreduce(x, out=out)
            assert got.tolist() == [sum(range(p)) + p * k] * 4, (k, got)
        plan = comm.last_plan("allreduce")
        return fresh, plan is not None and plan.hot[0] is x

    for fresh, planned in ck.run_local(body, 2):
        assert fresh == [], f"{len(fresh)} of 6 timed calls on the same arrays missed their entry: {fresh}"
        assert planned


def test_a_shape_entry_runs_new_arrays_alone_and_hands_every_other_call_to_the_checked_path():
    """The entry of a known shape (Plan.entry) takes new arrays of that shape and nothing else.

    Every call that differs in a way the entry does not check for itself goes on to
    the checked path and gets the answer (or the error) it got before entries.
    """
    import logging

    def body(comm):
        r, p = comm.rank, comm.size
        for k in range(3):  # the shape's second call compiles its plan, the third makes its entry
            comm.allreduce(np.full(4, r + k, np.float64))
        entry = comm._new_allreduce
        assert entry is not None
        fresh, stop_counting = counting_fresh(comm)
        total = sum(range(p))
        for k in range(5):  # new arrays of the shape: the entry alone
            assert comm.allreduce(np.full(4, r + k, np.float64)).tolist() == [total + p * k] * 4
        assert fresh == [] and comm._new_allreduce is entry
        got = {}
        got["dtype"] = comm.allreduce(np.full(4, r, np.float32)).dtype
        got["shape"] = comm.allreduce(np.full(5, r, np.float64)).tolist()
        comm.allreduce(np.full(4, r, np.float64))  # (the entry of the shape it was, back again)
        got["op"] = comm.allreduce(np.full(4, r, np.float64), "max").tolist()
        comm.allreduce(np.full(4, r, np.float64))
        got["algorithm"] = comm.allreduce(np.full(4, r, np.float64), algorithm="ring").tolist(), comm.last_algorithm
        got["timeout"] = comm.allreduce(np.full(4, r, np.float64), timeout=30).tolist()
        out = np.empty(4)
        got["out"] = comm.allreduce(np.full(4, r, np.float64), out=out) is out and out.tolist()
        got["strided"] = comm.allreduce(np.full(8, r, np.float64)[::2]).tolist()
        x = np.full(4, r, np.float64)
        got["read-only out"] = None
        read_only = np.empty(4)
        read_only.flags.writeable = False
        try:
            comm.allreduce(x, out=read_only)
        except ck.InvalidBuffer as exc:
            got["read-only out"] = "read-only" in str(exc)
        # A concurrent call (another thread inside a call here): the general path names it.
        comm._entry.acquire()
        try:
            comm.allreduce(np.full(4, r, np.float64))
        except ck.ConcurrentCall:
            got["concurrent"] = True
        finally:
            comm._entry.release()
        # Check mode, a default timeout, an outstanding request: the entry is dropped while they last.
        dropped = []
        comm.check = True
        dropped.append(comm._new_allreduce)
        got["check"] = comm.allreduce(np.full(4, r, np.float64)).tolist()
        comm.check = False
        comm.timeout = 30
        dropped.append(comm._new_allreduce)
        got["default timeout"] = comm.allreduce(np.full(4, r, np.float64)).tolist()
        comm.timeout = None
        got["back after the timeout"] = comm._new_allreduce is entry  # (put back: see _update_plain)
        if r == 0:
            time.sleep(0.02)  # the other ranks' requests cannot complete at their start
        request = comm.iallreduce(np.full(4, r, np.float64))
        out_then = bool(comm._progress.requests)
        dropped.append(comm._new_allreduce if out_then else None)
        got["request out"] = out_then
        got["with a request out"] = comm.allreduce(np.full(4, r, np.float64)).tolist(), request.wait().tolist()
        got["back"] = comm._new_allreduce is entry  # (put back once no request is out)
        # Debug logging (one logger for every rank's thread: rank 0 turns it on and off): the general
        # path runs the call and logs it.
        records = []
        handler = logging.Handler(logging.DEBUG)
        handler.emit = records.append
        log = logging.getLogger("commkit")
        level = log.level
        comm.barrier()
        if r == 0:
            log.addHandler(handler)
            log.setLevel(logging.DEBUG)
        comm.barrier()
        try:
            comm.allreduce(np.full(4, r, np.float64))
        finally:
            comm.barrier()
            if r == 0:
                log.setLevel(level)
                log.removeHandler(handler)
        got["logged"] = sum("allreduce" in record.getMessage() for record in records) if r == 0 else p
        stop_counting()
        comm.free()
        try:
            comm.allreduce(np.full(4, r, np.float64))
        except ck.CommClosed:
            got["freed"] = True
        return got, dropped

    outstanding = []
    for p in (2, 3):
        total = float(sum(range(p)))
        for got, dropped in ck.run_local(body, p):
            outstanding.append(got["request out"])
            assert dropped == [None, None, None]
            assert got["dtype"] == np.float32
            assert got["shape"] == [total] * 5
            assert got["op"] == [float(p - 1)] * 4
            assert got["algorithm"] == ([total] * 4, "ring")
            assert got["timeout"] == got["check"] == got["default timeout"] == got["strided"] == [total] * 4
            assert got["out"] == [total] * 4
            assert got["read-only out"] is True
            assert got["concurrent"] is True
            assert got["with a request out"] == ([total] * 4, [total] * 4)
            assert got["back"] is True and got["back after the timeout"] is True
            assert got["logged"] >= p  # (each rank's call)
            assert got["freed"] is True
    assert any(outstanding)  # (a request its start completed is not outstanding: nothing to drop for it)


def test_a_timed_shape_entry_keeps_its_timeout_and_still_gives_up():
    """A timed call on new arrays runs its shape's timed entry: only for the same timeout (given, or the
    communicator's default while it is the same), and it gives up on a peer that does not come."""
    def body(comm):
        r, p = comm.rank, comm.size
        total = sum(range(p))
        calls, stop_counting = counting_fresh(comm)
        got = {}
        for k in range(8):
            assert comm.allreduce(np.full(3, r + k, np.float64), timeout=30).tolist() == [total + p * k] * 3
        got["given"] = len(calls), comm._entries.get("allreduce")
        got["another timeout"] = comm.allreduce(np.full(3, r, np.float64), timeout=31.0).tolist()
        comm.timeout = 20
        for k in range(8):
            assert comm.allreduce(np.full(3, r + k, np.float64)).tolist() == [total + p * k] * 3
        before = len(calls)
        comm.timeout = 25  # the entry made for the default of 20 must not run a call of 25 s
        got["new default"] = comm.allreduce(np.full(3, r, np.float64)).tolist(), len(calls) - before
        comm.timeout = None  # untimed again: no timed entry runs an untimed call
        before = len(calls)
        got["untimed"] = comm.allreduce(np.full(3, r, np.float64)).tolist(), len(calls) - before
        for k in range(3):
            comm.allreduce(np.full(3, r + k, np.float64), timeout=30)
        stop_counting()
        if r == p - 1:
            return got, None, None  # never joins the next call
        try:
            comm.allreduce(np.full(3, r, np.float64), timeout=0.3)
        except ck.CommTimeout as exc:
            message = str(exc)
        try:
            comm.allreduce(np.full(3, r, np.float64), timeout=30)
        except ck.CommBroken:
            broken = True
        return got, message, broken

    for p in (2, 3):
        total = float(sum(range(p)))
        for r, (got, message, broken) in enumerate(ck.run_local(body, p)):
            # Only the first three calls ask _fresh: the first two go on to the general path (the second
            # compiles the shape plan), the third runs the plan and makes the entry, which runs the other five.
            assert got["given"] == (3, True), got
            assert got["another timeout"] == [total] * 3
            assert got["new default"] == ([total] * 3, 1)
            assert got["untimed"] == ([total] * 3, 1)
            if r < p - 1:
                assert "timed out after 0.3 s in allreduce" in message and "waiting for rank(s)" in message, message
                assert broken is True


def test_an_i_form_entry_starts_new_arrays_alone_and_keeps_every_rule_of_the_requests():
    """The i-form entry of a known shape (plan.nonblocking_entry): right results whether its start completes
    the run or leaves a step in flight; check mode and a broken communicator still send the call on to the
    checked path. (The outstanding-request limit, through the entries too: test_lifetime, test_mismatch.)"""
    import time

    def body(comm):
        r, p = comm.rank, comm.size
        total = sum(range(p))
        for k in range(3):
            assert comm.iallreduce(np.full(4, r + k, np.float64)).wait().tolist() == [total + p * k] * 4
        assert comm._new_iallreduce is not None
        calls, stop_counting = counting_fresh(comm)
        got = {}
        # Started together, waited for in the other order; the last rank starts late, so the others' starts
        # leave their runs in flight.
        if r == p - 1:
            time.sleep(0.05)
        requests = [comm.iallreduce(np.full(4, r + k, np.float64)) for k in range(3)]
        got["in flight"] = [q.wait().tolist() for q in reversed(requests)][::-1]
        got["entry only"] = list(calls)
        held = [comm.iallreduce(np.full(4, r, np.float64)) for _ in range(3)]
        got["held"] = [q.wait().tolist() for q in held]
        comm.check = True
        got["check"] = comm.iallreduce(np.full(4, r, np.float64)).wait().tolist()
        comm.check = False
        stop_counting()
        if r == p - 1:
            return got, None
        try:
            comm.iallreduce(np.full(4, r, np.float64)).wait(timeout=0.3)
        except ck.CommTimeout:
            pass
        try:
            comm.iallreduce(np.full(4, r, np.float64))
        except ck.CommBroken:
            return got, "broken"
        return got, None

    for p in (2, 3):
        total = float(sum(range(p)))
        for r, (got, broken) in enumerate(ck.run_local(body, p)):
            assert got["in flight"] == [[total + p * k] * 4 for k in range(3)], got
            assert got["entry only"] == [], got
            assert got["held"] == [[total] * 4] * 3
            assert got["check"] == [total] * 4
            assert broken == ("broken" if r < p - 1 else None)


def test_an_exception_between_taking_the_guard_and_running_gives_the_guard_back():
    """A plan or entry that takes the communicator's guard gives it back whatever raises after it took it (an
    interrupt between two bookkeeping lines), so the next call runs instead of raising ConcurrentCall."""
    import collections

    class Interrupting(collections.deque):  # the flight recorder's list of calls, whose append can raise once
        armed = False

        def append(self, item):
            if self.armed:
                self.armed = False
                raise RuntimeError("interrupted")
            super().append(item)

    def body(comm):
        comm._recorder.calls = Interrupting(comm._recorder.calls, maxlen=comm._recorder.calls.maxlen)
        got = []
        x, out = np.full(3, 1.0 + comm.rank), np.empty(3)
        for form in ("entry", "same arrays"):
            for k in range(4):  # the entry of new arrays, or the plan of these very arrays, from the third call
                if form == "entry":
                    comm.allreduce(np.full(3, 1.0 + comm.rank))
                else:
                    comm.allreduce(x, out=out)
            comm._recorder.calls.armed = True  # every rank, at the same call: its number is taken alike
            try:
                comm.allreduce(np.full(3, 1.0 + comm.rank)) if form == "entry" else comm.allreduce(x, out=out)
            except RuntimeError:
                pass
            try:
                got.append(comm.allreduce(np.full(3, 2.0)).tolist() if form == "entry"
                           else comm.allreduce(x, out=out).tolist())
            except ck.ConcurrentCall as exc:
                got.append(str(exc))
        return got

    for got in ck.run_local(body, 2):
        assert got == [[4.0] * 3, [3.0] * 3], got


def test_shape_entries_of_every_collective_and_form_give_the_checked_paths_answers():
    """Each collective's entry (no out, its own out, in place; reduce on and off the root) against the
    interpreter's answers (plans off) for the same inputs, and the entry was the one that ran."""
    forms = {"allreduce": (None, "out", "x"), "scan": (None, "out", "x"), "reduce": (None, "out"),
             "broadcast": (None, "out", "x"), "allgather": (None, "out"), "alltoall": (None, "out"),
             "gather": (None, "out"), "scatter": (None, "out"), "reduce_scatter": (None, "out")}

    def call(comm, name, k, form):
        r, p = comm.rank, comm.size
        shape = (p, 3) if name == "alltoall" else (2 * p, 3) if name == "reduce_scatter" else (2, 3)
        x = (np.arange(np.prod(shape)).reshape(shape) * (r + 1) + k).astype(np.int64)
        result_shape = ((p,) + shape if name in ("allgather", "gather") else (2, 3) if name == "reduce_scatter"
                        else shape)
        out = x if form == "x" else np.empty(result_shape, np.int64) if form == "out" else None
        if name in ("reduce", "gather"):
            if out is not None and r != p - 1:
                out = None  # (only the root has a result)
            return comm.reduce(x, "sum", p - 1, out=out) if name == "reduce" else comm.gather(x, p - 1, out=out)
        if name == "scatter":  # the root's x holds a block per rank; the others fill their out, given alone
            if r == p - 1:
                blocks = (np.arange(p * 6).reshape(p, 2, 3) * (k + 1)).astype(np.int64)
                return comm.scatter(blocks, p - 1, out=None if out is None else np.empty((2, 3), np.int64))
            return comm.scatter(None, p - 1, out=np.full((2, 3), -1, np.int64))
        if name == "broadcast":
            return comm.broadcast(x, p - 1, out=out)
        if name in ("allgather", "alltoall"):
            return getattr(comm, name)(x, out=out)
        if name == "reduce_scatter":
            return comm.reduce_scatter(x, "max", out=out)
        return getattr(comm, name)(x, "prod" if name == "scan" else "sum", out=out)

    def body(comm):
        ran = {}
        answers = []
        for name, shapes in forms.items():
            for form in shapes:
                for k in range(6):
                    before = getattr(comm, "_new_" + name)
                    result = call(comm, name, k, form)
                    if k >= 3:  # from the fourth call the entry runs it, and stays
                        assert before is not None and getattr(comm, "_new_" + name) is before, (name, form, k)
                        ran[name, form] = True
                    answers.append(None if result is None else result.tolist())
        comm.plans = False
        reference = [None if (result := call(comm, name, k, form)) is None else result.tolist()
                     for name, shapes in forms.items() for form in shapes for k in range(6)]
        return answers, reference, len(ran)

    for p in (1, 2, 3):
        for answers, reference, ran in ck.run_local(body, p):
            assert answers == reference
            assert ran == sum(len(shapes) for shapes in forms.values())


def test_the_same_arrays_after_new_ones_still_get_their_own_plan():
    def body(comm):
        for _ in range(3):
            comm.allreduce(np.ones(4))
        x, out = np.ones(4), np.empty(4)
        for _ in range(4):
            comm.allreduce(x, out=out)
        return any(plan is not None and plan.keep == (x, out) for plan in comm._fast.values())

    assert ck.run_local(body, 2) == [True, True]


@pytest.mark.parametrize("form", ["no out", "out"])
def test_the_last_calls_arrays_on_new_arrays_are_held_weakly_so_views_let_go_and_arrays_free(form):
    # The communicator remembers the arrays of a collective's last call on new arrays (its entries on new
    # arrays send the same arrays again to the general path), weakly: a view of a bytearray lets it resize
    # afterwards, and an array the program drops is freed -- whichever of the general path, _fresh and the
    # shape's entry took the call. (Holding a small array itself would save about 0.1 us of an 8 B call; it
    # was tried, and given up: the communicator keeps no program's array alive.)
    import weakref

    def body(comm):
        held = bytearray(32)
        for _ in range(5):
            view = np.frombuffer(held, np.float64, count=4)  # (its base is the bytearray)
            out = None if form == "no out" else np.frombuffer(bytearray(32), np.float64, count=4)
            comm.allreduce(view, out=out)
        del view, out
        held.extend(b"more")  # BufferError while a view of it is alive
        gone = []
        for k in range(5):
            x = np.full(6, float(k))
            out = None if form == "no out" else np.empty_like(x)
            comm.allreduce(x, out=out)
            gone.append((weakref.ref(x), None if out is None else weakref.ref(out)))
            del x, out
        return [ref() is None and (out is None or out() is None) for ref, out in gone]

    assert ck.run_local(body, 2) == [[True] * 5] * 2


def test_a_timed_call_on_new_arrays_still_gives_up_and_breaks_the_communicator():
    def body(comm):
        for k in range(3):
            comm.allreduce(np.full(3, float(k)), timeout=30)
        if comm.rank == 1:
            return None
        with pytest.raises(ck.CommTimeout, match=r"allreduce #3"):
            comm.allreduce(np.ones(3), timeout=0.3)
        with pytest.raises(ck.CommBroken):
            comm.allreduce(np.ones(3), timeout=30)
        return comm.flight_recorder.calls[-1][8]

    assert ck.run_local(body, 2)[0] == "timed out"


@pytest.mark.parametrize("algorithm", ["ring", "recursive_doubling", "shm"])
def test_a_call_with_a_timeout_runs_a_timed_shape_plan_that_still_gives_up(algorithm):
    """Calls with a timeout run a plan too; when a peer stops coming, it times out as the interpreter does."""
    def body(comm):
        got = []
        for k in range(4):
            x = np.full(6, comm.rank + k, np.float32)
            got.append(comm.allreduce(x, algorithm=algorithm, timeout=30).tolist())
        timed = [v for (_, _, t), v in comm._shaped.items() if t and isinstance(v, ck.plan.Plan)]
        assert len(timed) == 1 and "_timeout" in timed[0].run.source
        if comm.rank == 3:
            return got, None, None
        with pytest.raises(ck.CommTimeout) as info:
            comm.allreduce(np.ones(6, np.float32), algorithm=algorithm, timeout=0.3)
        with pytest.raises(ck.CommBroken, match=r"allreduce #4 timed out"):
            comm.barrier()
        record = comm.flight_recorder.calls[-1]
        return got, str(info.value), record[8]

    def first_call(comm):  # the same call with no plan yet: the interpreter's message
        if algorithm == "shm":
            comm.barrier(algorithm="shm")  # the node arena, which a node call's first run makes (its Claim waits)
        if comm.rank == 3:
            return None
        with pytest.raises(ck.CommTimeout) as info:
            comm.allreduce(np.ones(6, np.float32), algorithm=algorithm, timeout=0.3)
        return str(info.value)

    interpreted = ck.run_local(first_call, 4)
    for rank, (got, message, state) in enumerate(ck.run_local(body, 4)):
        assert got == [[float(sum(q + k for q in range(4)))] * 6 for k in range(4)]
        if rank == 3:
            continue
        assert re.search(rf"rank {rank} timed out after 0.3 s in allreduce #4 \(algorithm '{algorithm}'\) "
                         r"at step \d+ \(.*\), waiting for rank\(s\) [0-9, ]+\.", message), message
        assert "Recent calls on this rank:" in message
        assert state == "timed out"
        # The same step, named by its place in the schedule, as the interpreter names it.
        step = re.search(r"at step (\d+ \(.*\)), waiting for rank\(s\) [0-9, ]+", message).group(1)
        assert step in interpreted[rank], (step, interpreted[rank])


def test_plans_keep_the_flight_record_the_log_and_the_result_shape_right(caplog):
    """What the general path does around a call, a plan does too (found by review: each failed before)."""
    import gc
    import logging
    import weakref

    def failing(a, b):
        if (a < 0).any() or (b < 0).any():
            raise ZeroDivisionError("the user's op failed")
        return a + b
    op = ck.Op(failing, commutative=True, name="failing")

    def body(comm):
        # A user's op that raises inside a shape plan: the call is recorded as failed, not running.
        for k in (0, 1, -1):  # the third call's op raises, in the shape plan the second compiled
            try:
                comm.allreduce(np.full(4, k, np.float64), op=op, algorithm="recursive_doubling")
            except ZeroDivisionError:
                assert k == -1
        state = comm.flight_recorder.calls[-1][8]
        # A call without out on an array reshaped in place: the result has the array's shape now.
        x = np.arange(6.0)
        for _ in range(3):
            comm.allreduce(x)
        x.shape = (2, 3)
        shape = comm.allreduce(x).shape
        # A plan that allocates its results keeps none of them.
        refs = [weakref.ref(comm.allreduce(x)) for _ in range(4)]
        gc.collect()
        return state, shape, [r() is None for r in refs]

    with caplog.at_level(logging.DEBUG, logger="commkit"):
        for state, shape, freed in ck.run_local(body, 2):
            assert state == "failed"
            assert shape == (2, 3)
            assert all(freed), freed
        ck.run_local(lambda comm: [comm.allreduce(np.ones(3) * k, algorithm="ring") for k in range(5)], 1)
    assert sum("allreduce" in r.getMessage() and "-> ring" in r.getMessage() for r in caplog.records) == 5


@requires_mpi
@pytest.mark.mpi
def test_shape_plans_fresh_outputs_and_timed_plans_under_mpiexec():
    """MPI's bound messages (Sendrecv on specification lists) re-sliced per run, for every algorithm."""
    code = """
    import numpy as np
    import commkit as ck
    c = ck.init()
    p, r = c.size, c.rank
    m = 3

    def x_of(q, k, rows=1):  # rank q's input in round k: one row, or one per rank
        x = (q * 10 + k + np.arange(rows * m)).reshape(rows, m)
        return x[0] if rows == 1 else x

    def want(name, k):
        xs = [x_of(q, k, p if name in ("scatter", "alltoall", "reduce_scatter") else 1) for q in range(p)]
        return {"allreduce": sum(xs), "reduce": sum(xs) if r == 0 else None, "scan": sum(xs[: r + 1]),
                "broadcast": xs[p - 1], "allgather": np.stack(xs), "gather": np.stack(xs) if r == 0 else None,
                "scatter": xs[0][r], "alltoall": np.stack([xs[q][r] for q in range(p)]),
                "reduce_scatter": sum(xs)[r:r + 1]}[name]

    sum_op = ck.ops.get_op("sum")
    for name in ("allreduce", "reduce", "scan", "broadcast", "allgather", "gather", "scatter", "alltoall",
                 "reduce_scatter"):
        names = [None, *ck.algorithms.for_collective(name)]
        for algorithm in names:
            alg = ck.algorithms.get(name, algorithm) if algorithm else None
            if alg is not None and alg.why_not(p, sum_op) is not None:
                continue
            kept, same = [], None
            for k in range(9):
                mode = ("new out", "no out", "timeout", "no out, same x")[k % 4]
                x = x_of(r, k, p if name in ("scatter", "alltoall", "reduce_scatter") else 1).astype(np.int64)
                if mode == "no out, same x":  # the same array again: a plan that allocates each result
                    if same is None:
                        same = x
                    same[...] = x
                    x = same
                given = x.copy()
                kw = {"algorithm": algorithm}
                if mode == "timeout":
                    kw["timeout"] = 30.0
                if name in ("reduce", "gather", "broadcast", "scatter"):
                    kw["root"] = p - 1 if name == "broadcast" else 0
                if name == "scatter" and r != 0:
                    x, kw["out"] = None, np.empty(m, np.int64)
                elif mode == "new out":
                    w = want(name, k)
                    kw["out"] = None if w is None else np.empty(w.shape, np.int64)
                got = getattr(c, name)(x, **kw)
                if x is not None:
                    assert (x == given).all(), (name, algorithm, "input changed")
                w = want(name, k)
                assert (got is None) == (w is None), (name, algorithm, mode)
                if w is not None:
                    assert got.tolist() == w.tolist(), (name, algorithm, mode, k, got, w)
                    kept.append((got, got.copy()))
            for got, copy in kept:
                assert (got == copy).all(), (name, algorithm, "a later call wrote into an earlier result")
    # Shape plans keep no caller's array (a native broadcast's root copy is written into the plan, not bound).
    import gc, weakref
    refs = []
    for k in range(4):
        b, o = np.full(3, k, np.int64), np.empty(3, np.int64)
        c.broadcast(b, root=0, out=o, algorithm="native")
        assert o.tolist() == [k] * 3
        refs += [weakref.ref(b), weakref.ref(o)]
    del b, o
    gc.collect()
    assert all(ref() is None for ref in refs), [ref() is None for ref in refs]
    print(f"ok {r}", flush=True)
    """
    for nprocs in (2, 3):
        # No default timeout (run_mpi sets one), so the untimed plans run; the "timeout" rounds pass their own.
        result = run_mpi(nprocs, code, timeout=240, env={"COMMKIT_TIMEOUT": ""})
        assert result.stdout.count("ok") == nprocs, result.stdout + result.stderr


@requires_mpi
@pytest.mark.mpi
def test_a_library_collective_with_a_timeout_runs_a_timed_plan_that_gives_up():
    """native with a timeout: its nonblocking form waited for in a plan, and the same error when it stalls."""
    code = """
    import re, time
    import numpy as np
    import commkit as ck
    c = ck.init()
    r = c.rank
    for k in range(4):
        x = np.full(3, r + k, np.float64)
        assert c.allreduce(x, algorithm="native", timeout=30).tolist() == [2.0 * k + 1] * 3
        b = c.broadcast(np.full(2, float(k) if r == 0 else -1.0), root=0, algorithm="native", timeout=30)
        assert b.tolist() == [k] * 2
    for k in range(3):  # in place on new arrays: MPI_IN_PLACE, in a timed shape plan too
        y = np.full(5, r + k, np.float64)
        assert c.allreduce(y, out=y, algorithm="native", timeout=30) is y and y.tolist() == [2.0 * k + 1] * 5
    assert any(key[1] and key[2] and plan for key, plan in c._shaped.items()), c._shaped
    if r == 0:
        try:
            c.allreduce(np.ones(3), algorithm="native", timeout=0.5)
        except ck.CommTimeout as exc:
            text = str(exc)
            assert re.search(r"rank 0 timed out after 0.5 s in allreduce #11 \\(algorithm 'native'\\): the "
                             r"library's own collective made no progress", text), text
            assert text.count("Recent calls on this rank:") == 1, text
            assert c.flight_recorder.calls[-1][8] == "timed out"
            assert c.broken and "allreduce #11 (native) timed out" in c.broken
        else:
            raise AssertionError("no timeout")
    else:
        # Then join, so rank 0's abandoned request completes before both finalize. With a timeout too:
        # MPI never matches a blocking collective with a nonblocking one, and a timed native call is one.
        time.sleep(1.5)
        assert c.allreduce(np.ones(3), algorithm="native", timeout=30).tolist() == [2.0] * 3
    # A persistent native request that times out: the same message, and its request kept alive.
    import gc, weakref
    d = c.dup()  # collective, and it works on a broken communicator
    req = d.allreduce_init(np.ones(4), algorithm="native", timeout=0.5)
    if r == 0:
        req.start()
        try:
            req.wait()
        except ck.CommTimeout as exc:
            assert "(algorithm 'native'): the library's own collective made no progress" in str(exc), str(exc)
        else:
            raise AssertionError("no timeout")
        library_request = weakref.ref(req._native)
        del req
        gc.collect()
        assert library_request() is not None  # still in flight, so kept alive
        assert d.broken and re.search(r"persistent allreduce #\\d+ \\(native\\) timed out on rank 0\\. ", d.broken), \\
            d.broken
    else:
        time.sleep(1.5)
        req.start()
        assert req.wait(30).tolist() == [2.0] * 4
        req.free()
    print(f"ok {r}", flush=True)
    """
    result = run_mpi(2, code, timeout=120, env={"COMMKIT_TIMEOUT": ""})
    assert result.stdout.count("ok") == 2, result.stdout + result.stderr


@pytest.mark.parametrize("name", ["allreduce", "allgather"])
def test_new_arrays_whose_kinds_change_every_call_stay_right(name):
    """Calls that alternate between kinds (dtype, shape, op, out, timeout) each find their own shape plan:
    the check of a collective's last kinds (``_fresh_hot``) never runs one kind's plan for another."""
    forms = [("float64", (4,), "sum", None, None), ("float32", (4,), "sum", None, None),
             ("float64", (2, 2), "max", "out", None), ("float64", (4,), "sum", "x", 30.0),
             ("float64", (4,), "sum", None, 30.0), ("int64", (4,), "min", "out", 30.0)]

    def body(comm):
        general = counting_general_path(comm)
        got = []
        for k in range(5):
            for dtype, shape, op, with_out, timeout in forms:
                x = (np.arange(4).reshape(shape) * (comm.rank + 1) + k).astype(dtype)
                given = x.copy()
                stack = (comm.size,) + shape if name == "allgather" else shape
                out = np.empty(stack, dtype) if with_out == "out" else None
                if with_out == "x" and name == "allreduce":
                    out = x
                if name == "allreduce":
                    result = comm.allreduce(x, op, out=out, timeout=timeout)
                else:
                    result = comm.allgather(x, out=out, timeout=timeout)
                assert result.dtype == np.dtype(dtype) and result.shape == stack
                got.append((given, result.copy()))
        return got, general

    size = 3
    per_rank = ck.run_local(body, size)
    fold = {"sum": np.add, "max": np.maximum, "min": np.minimum}
    for r in range(size):
        got, general = per_rank[r]
        for case, (_, _, op, _, _) in enumerate(forms * 5):
            inputs = [per_rank[q][0][case][0] for q in range(size)]
            if name == "allgather":
                want = np.stack(inputs)
            else:
                want = inputs[0].copy()
                for more in inputs[1:]:
                    want = fold[op](want, more)
            np.testing.assert_array_equal(got[case][1], want, err_msg=f"case {case}")
        assert len(general) <= 2 * len(forms), general  # each kind at most twice, then its shape plan


@pytest.mark.timeout(60)  # the bug this catches hangs
def test_a_default_timeout_set_between_calls_on_new_arrays_is_obeyed():
    """A loop of untimed calls on new arrays, then ``comm.timeout`` set: the next call on a new array
    times out when a peer never comes, instead of running the untimed plan of the kinds it repeats."""
    def body(comm):
        for k in range(4):
            comm.allreduce(np.full(3, float(k)))
        if comm.rank == 1:
            return "left"
        comm.timeout = 0.5
        with pytest.raises(ck.CommTimeout):
            comm.allreduce(np.full(3, 9.0))
        return "timed out"

    assert ck.run_local(body, 2) == ["timed out", "left"]


@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_reduce_on_new_arrays_of_a_known_shape_skips_the_general_path_and_stays_right(size):
    """``reduce`` and ``ireduce`` on new arrays take the fresh-array path too: the root gets the result
    (in a new array, its ``out`` or in place), every other rank None, and inputs stay untouched."""
    forms = [(0, "float64", "sum", None, None), (size - 1, "int32", "max", "out", None),
             (size // 2, "float32", "sum", "x", 30.0), (0, "int64", "prod", None, 30.0)]

    def body(comm):
        general = counting_general_path(comm)
        got = []
        for root, dtype, op, with_out, timeout in forms:
            for k in range(5):
                for nonblocking in (False, True):
                    x = (np.arange(6) % 4 + comm.rank + k).astype(dtype)
                    given = x.copy()
                    out = None
                    if comm.rank == root:
                        out = x if with_out == "x" else np.full(6, -1, dtype) if with_out else None
                    call = comm.ireduce if nonblocking else comm.reduce
                    result = call(x, op, root, out=out, timeout=timeout)
                    if nonblocking:
                        result = result.wait()
                    if comm.rank != root:
                        assert result is None
                        np.testing.assert_array_equal(x, given)
                    else:
                        assert out is None or result is out
                        if with_out != "x":
                            np.testing.assert_array_equal(x, given)
                    got.append((given, None if result is None else result.copy()))
        return got, general

    per_rank = ck.run_local(body, size)
    case = 0
    for root, dtype, op, _, _ in forms:
        for k in range(5):
            for _ in range(2):
                want = _reduced([per_rank[q][0][case][0] for q in range(size)], op, dtype)
                np.testing.assert_array_equal(per_rank[root][0][case][1], want, err_msg=f"{op} root {root} call {k}")
                case += 1
    for r in range(size):
        # Each form's first calls (blocking and i-form) take the general path, then their shape plans.
        assert len(per_rank[r][1]) <= 3 * 2 * len(forms), per_rank[r][1]


def _reduced(inputs, op, dtype):
    """What ``op`` makes of the ranks' ``inputs`` (in rank order), in ``dtype``: the NumPy reference."""
    fold = {"sum": np.add, "max": np.maximum, "prod": np.multiply, "min": np.minimum}[op]
    want = inputs[0].copy()
    for more in inputs[1:]:
        want = fold(want, more).astype(dtype)
    return want


def _rooted_forms(size):
    """(root, dtype, shape, out given, timeout) of the rooted collectives' new-array tests."""
    return [(0, "float64", (3,), None, None), (size - 1, "int32", (2, 2), "out", None),
            (size // 2, "uint8", (5,), None, 30.0), (0, "int64", (1,), "out", 30.0)]


def _rooted_calls(comm, forms, one):
    """Each form of ``forms`` (:func:`_rooted_forms`) five times, blocking and as an i-form:
    ``one(comm, root, dtype, shape, with_out, timeout, k, nonblocking)`` makes the call and checks what it can
    alone, returning what to keep. Returns the kept values, and the calls that took the general path."""
    general = counting_general_path(comm)
    got = [one(comm, root, dtype, shape, with_out, timeout, k, nonblocking)
           for root, dtype, shape, with_out, timeout in forms for k in range(5) for nonblocking in (False, True)]
    return got, general


def _few_general_calls(generals, forms):
    """Each form's first two blocking calls (the second compiles the shape plan) and its first i-form take the
    general path; the other seven of its ten calls (five of each) do not, on any rank."""
    for r, general in enumerate(generals):
        assert len(general) <= 3 * len(forms), (r, general)


@pytest.mark.parametrize("size", [1, 2, 3])
@pytest.mark.parametrize("name", ["allreduce", "scan", "allgather", "alltoall"])
def test_the_same_input_with_a_new_out_each_call_leaves_the_general_path(name, size):
    """``comm.allreduce(x, out=np.empty_like(x))`` in a loop (the same ``x``, a new ``out`` every call): after a
    call on a new ``x`` (which records no ``out``), the same ``x`` again took the general path, and as no ``out``
    was ever recorded for it, so did every call after (38 us against 13 at 8 B, 2 ranks, in this machine's slow
    state). The second call now records its ``out``, and from the third on the shape's plan runs them, each with
    its own result; the same ``x`` with the same ``out`` still gets its own plan."""
    def body(comm):
        general = counting_general_path(comm)
        rows = (comm.size,) if name == "alltoall" else ()
        x = np.arange(comm.size * 3 if rows else 3, dtype=np.float64).reshape(rows + (-1,) if rows else (3,))
        call = getattr(comm, name)
        for k in range(3):  # new x and new out: the shape's entry, which records x alone
            call(x + k, out=np.empty((comm.size,) + x.shape if name == "allgather" else x.shape))
        before = len(general)
        results = []
        for k in range(10):
            x[...] += 1  # new data in the same x, as a loop's
            out = np.full((comm.size,) + x.shape if name == "allgather" else x.shape, -1.0)
            assert call(x, out=out) is out
            results.append((x.copy(), out))
        loop_general = len(general) - before
        kept = np.empty((comm.size,) + x.shape if name == "allgather" else x.shape)
        for _ in range(4):  # the same x and the same out: its own plan (the general path compiles it)
            call(x, out=kept)
        return results, loop_general, comm.last_plan(name) is not None and comm.last_plan(name).hot[1] is kept

    per_rank = ck.run_local(body, size)
    for r, (results, loop_general, planned) in enumerate(per_rank):
        assert loop_general <= 1, (name, r, loop_general)
        assert planned, (name, r)
        for k, (given, out) in enumerate(results):
            everyone = [per_rank[q][0][k][0] for q in range(size)]
            want = {"allreduce": lambda: sum(everyone), "scan": lambda: sum(everyone[:r + 1]),
                    "allgather": lambda: np.stack(everyone),
                    "alltoall": lambda: np.stack([everyone[q][r] for q in range(size)])}[name]()
            np.testing.assert_array_equal(out, want, err_msg=f"{name} rank {r} call {k}")


@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_gather_on_new_arrays_of_a_known_shape_skips_the_general_path_and_stays_right(size):
    """``gather`` and ``igather`` on new arrays take the fresh-array path too: the root gets every rank's
    ``x`` stacked (in a new array or its ``out``), every other rank None, and inputs stay untouched."""
    forms = _rooted_forms(size)

    def one(comm, root, dtype, shape, with_out, timeout, k, nonblocking):
        x = (np.arange(np.prod(shape)).reshape(shape) + 7 * comm.rank + k).astype(dtype)
        given = x.copy()
        out = np.full((comm.size,) + shape, 99, dtype) if with_out and comm.rank == root else None
        result = (comm.igather if nonblocking else comm.gather)(x, root, out=out, timeout=timeout)
        if nonblocking:
            result = result.wait()
        np.testing.assert_array_equal(x, given)
        if comm.rank != root:
            assert result is None
        else:
            assert out is None or result is out
        return given, None if result is None else result.copy()

    per_rank = ck.run_local(lambda comm: _rooted_calls(comm, forms, one), size)
    case = 0
    for root, dtype, shape, _, _ in forms:
        for k in range(5):
            for _ in range(2):
                want = np.stack([per_rank[q][0][case][0] for q in range(size)])
                np.testing.assert_array_equal(per_rank[root][0][case][1], want, err_msg=f"root {root} call {k}")
                case += 1
    _few_general_calls([general for _, general in per_rank], forms)


@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_scatter_on_new_arrays_of_a_known_shape_skips_the_general_path_and_stays_right(size):
    """``scatter`` and ``iscatter`` on new arrays take the fresh-array path too: the root's ``x`` (a block per
    rank) is new each call, and so is every other rank's ``out``, which that rank gives alone (``x=None``);
    each rank gets its block, in a new array or its ``out``, and the root's ``x`` stays untouched."""
    forms = _rooted_forms(size)

    def one(comm, root, dtype, shape, with_out, timeout, k, nonblocking):
        blocks = (np.arange(comm.size * np.prod(shape)).reshape((comm.size,) + shape) + k).astype(dtype)
        if comm.rank == root:
            x, given = blocks, blocks.copy()
            out = np.full(shape, 99, dtype) if with_out else None
        else:
            x, given, out = None, None, np.full(shape, 99, dtype)
        result = (comm.iscatter if nonblocking else comm.scatter)(x, root, out=out, timeout=timeout)
        if nonblocking:
            result = result.wait()
        assert out is None or result is out
        if given is not None:
            np.testing.assert_array_equal(x, given)
        np.testing.assert_array_equal(result, blocks[comm.rank], err_msg=f"root {root} call {k}")

    per_rank = ck.run_local(lambda comm: _rooted_calls(comm, forms, one), size)
    _few_general_calls([general for _, general in per_rank], forms)


@pytest.mark.parametrize("size", [1, 2, 3])
def test_reduce_scatter_on_new_arrays_of_a_known_shape_skips_the_general_path_and_stays_right(size):
    """``reduce_scatter`` and ``ireduce_scatter`` without counts on new arrays take the fresh-array path: each
    rank gets its share of the rows reduced (in a new array or its ``out``); a call with counts, even of the
    same shape, still takes the general path, which splits the rows as the counts say."""
    forms = [("float64", (2, 3), "sum", None, None), ("int32", (4,), "max", "out", None),
             ("int64", (1, 2), "prod", None, 30.0)]

    def body(comm):
        general = counting_general_path(comm)
        got = []
        p = comm.size
        for dtype, block, op, with_out, timeout in forms:
            for k in range(5):
                for nonblocking in (False, True):
                    x = (np.arange(p * np.prod(block)).reshape((p * block[0],) + block[1:]) % 7 + comm.rank + k
                         ).astype(dtype)
                    given = x.copy()
                    out = np.full(block, -1, dtype) if with_out else None
                    call = comm.ireduce_scatter if nonblocking else comm.reduce_scatter
                    result = call(x, op, out=out, timeout=timeout)
                    if nonblocking:
                        result = result.wait()
                    assert out is None or result is out
                    np.testing.assert_array_equal(x, given)
                    got.append((given, result.copy()))
        entries = len(general)
        # Counts of the same x: the rows split as they say (all to the last rank), through the general path.
        x = np.arange(p * 2.0).reshape(p * 2, 1) + comm.rank
        uneven = comm.reduce_scatter(x, counts=[0] * (p - 1) + [2 * p])
        return got, entries, uneven.tolist(), len(general) - entries

    per_rank = ck.run_local(body, size)
    case = 0
    for dtype, block, op, _, _ in forms:
        for k in range(5):
            for _ in range(2):
                total = _reduced([per_rank[q][0][case][0] for q in range(size)], op, dtype)
                rows = block[0]
                for r in range(size):
                    np.testing.assert_array_equal(per_rank[r][0][case][1], total[r * rows:(r + 1) * rows],
                                                  err_msg=f"{op} rank {r} call {k}")
                case += 1
    for r, (_, entries, uneven, general_after) in enumerate(per_rank):
        assert entries <= 3 * len(forms), (r, entries)
        assert general_after == 1
        want = (np.arange(size * 2.0) * size + sum(range(size))).reshape(-1, 1).tolist()
        assert uneven == (want if r == size - 1 else []), (r, uneven)


def test_a_receiving_ranks_broadcast_into_out_alone_takes_the_fast_paths():
    """``broadcast(None, root, out=buf)`` off the root, as the docs say a receiving rank may call it, is the
    in-place call on ``buf``: new buffers take the shape's entry, the same one its plan; a read-only ``out``
    or a root without ``x`` still raise the general path's errors."""
    def body(comm):
        general = counting_general_path(comm)
        r, p = comm.rank, comm.size
        got = []
        for k in range(8):
            x = np.arange(3.0) + k if r == 0 else None
            out = None if r == 0 else np.full(3, -1.0)
            got.append(comm.broadcast(x, 0, out=out).tolist())
            got.append(comm.ibroadcast(np.arange(3.0) - k if r == 0 else None, 0, out=out).wait().tolist())
        calls = len(general)
        kept = np.zeros(2)
        for k in range(4):  # the same buffer every call: its plan
            comm.broadcast(np.full(2, 7.0 + k) if r == 0 else None, 0, out=None if r == 0 else kept)
        errors = []
        if r > 0:
            frozen = np.zeros(3)
            frozen.flags.writeable = False
            try:
                comm.broadcast(None, 0, out=frozen)
            except ck.InvalidBuffer as exc:
                errors.append("read-only" if "writeable" in str(exc) or "read-only" in str(exc) else str(exc))
        else:
            try:
                comm.broadcast(None, 0, out=np.zeros(3))
            except (ck.InvalidBuffer, ck.InvalidArgument) as exc:
                errors.append(type(exc).__name__)
        return got, calls, kept.tolist(), errors

    for p in (2, 3):
        for r, (got, calls, kept, errors) in enumerate(ck.run_local(body, p)):
            assert got == [v for k in range(8) for v in ((np.arange(3.0) + k).tolist(), (np.arange(3.0) - k).tolist())]
            assert calls <= 3, (r, calls)  # the blocking form's first two calls and the i-form's first
            assert kept == ([0.0, 0.0] if r == 0 else [10.0, 10.0])
            assert errors == (["InvalidBuffer"] if r == 0 else ["read-only"]), (r, errors)


def test_a_scatter_entry_hands_every_other_call_to_the_checked_path():
    """The fresh-array path of a scatter takes only the calls the general path would run the same way: a root
    without x, another rank giving an x (which only the root reads), a read-only or overlapping out, another
    root or dtype all take the general path, which names the problem or runs the call."""
    def body(comm):
        r, p = comm.rank, comm.size
        for k in range(4):  # the shapes' entries, on every rank
            comm.scatter(np.arange(2.0 * p).reshape(p, 2) if r == 0 else None, 0, out=np.empty(2))
        errors = []
        if r == 0:  # the root without x
            try:
                comm.scatter(None, 0, out=np.empty(2))
            except ck.InvalidBuffer as exc:
                errors.append(type(exc).__name__)
        else:  # a read-only out
            frozen = np.empty(2)
            frozen.flags.writeable = False
            try:
                comm.scatter(None, 0, out=frozen)
            except ck.InvalidBuffer as exc:
                errors.append(type(exc).__name__)
        comm.barrier()
        # An x off the root is ignored, as the general path ignores it; the root's overlapping out is refused.
        x = np.arange(2.0 * p).reshape(p, 2) * 3
        got = comm.scatter(x if r == 0 else np.ones((p, 2)), 0, out=np.empty(2))
        # Every rank makes the call, as every rank makes every collective call (a refused one counts as made):
        # the root's overlapping out is refused, and so is the others' read-only one, so none waits.
        frozen = np.empty(2)
        frozen.flags.writeable = False
        try:
            comm.scatter(x if r == 0 else None, 0, out=x[1] if r == 0 else frozen)
        except ck.InvalidBuffer as exc:
            if r == 0:
                errors.append(type(exc).__name__)
            else:
                assert "read-only" in str(exc)
        comm.barrier()
        return errors, got.tolist()

    for p in (2, 3):
        for r, (errors, got) in enumerate(ck.run_local(body, p)):
            assert errors == ["InvalidBuffer"] * (2 if r == 0 else 1), (r, errors)
            assert got == [6.0 * r, 6.0 * r + 3], (r, got)


@requires_mpi
@pytest.mark.mpi
def test_i_forms_on_new_arrays_start_persistent_transfers_one_slot_per_call_number_under_mpiexec():
    """An i-form shape's PersistentPool: a slot per call number, reused a whole cycle later, every result right."""
    code = """
    import numpy as np
    import commkit as ck
    from commkit.communicator import _fresh_key
    from commkit.plan import PersistentPool
    c = ck.init()
    p, r = c.size, c.rank
    span = c._seq_span

    def x_of(q, k):  # rank q's input of round k, known to every rank; whole numbers, so every sum is exact
        return np.random.default_rng([q, k]).integers(-99, 99, 5).astype(np.float32)

    held = []
    for k in range(3 * span):  # three cycles of call numbers: slots are made (a number's second call), taken again
        x = x_of(r, k)
        given = x.copy()
        total = sum(x_of(q, k) for q in range(p))
        form = k % 4
        if form == 0:
            request, want, out = c.iallreduce(x), total, None
        elif form == 1:
            out = np.empty(5, np.float32)
            request, want = c.iallreduce(x, out=out), total
        elif form == 2:  # in place: the result lands in x itself
            request, want, out = c.iallreduce(x, out=x), total, x
        else:
            request, want, out = c.ireduce(x, root=p - 1), total if r == p - 1 else None, None
        held.append((request, want, out, x, given, form))
        if k % 3 == 0:  # two or three in flight, waited for newest first
            for request, want, out, x, given, form in reversed(held):
                got = request.wait()
                if want is None:
                    assert got is None
                else:
                    assert got.tolist() == want.tolist(), (k, form, got, want)
                    assert out is None or got is out
                if form != 2:
                    assert x.tolist() == given.tolist(), (k, form, "input changed")
            held.clear()
        if k % 5 == 0:  # another call between, so each shape meets every call number
            assert c.allreduce(np.full(2, k)).tolist() == [p * k] * 2
    for request, *_ in held:
        request.wait()
    x = x_of(r, 0)
    pool = c._by_shape_i[_fresh_key("allreduce", "sum", None, x, 0, c.timeout)][2]
    assert isinstance(pool, PersistentPool) and ".start()" in pool.run.source, pool
    kept = sum(type(slot) is tuple for slot in pool.slots)
    assert 0 < kept <= span, kept
    assert not c._progress.requests and c._progress.held == 0
    c.free()
    assert not any(type(slot) is tuple for slot in pool.slots)  # their requests freed with the communicator
    print(f"ok {r} {kept}", flush=True)
    """
    for nprocs in (2, 3):
        result = run_mpi(nprocs, code, timeout=240)
        assert result.stdout.count("ok") == nprocs, result.stdout + result.stderr


_CYCLE_FREE_CODE = """
import gc
import numpy as np
import commkit as ck
from commkit.compat.mpi4py import wrap
c = ck.init() if {mpi} else None

def body(c):
    from mpi4py import MPI
    face = wrap(MPI.COMM_WORLD) if {mpi} else None
    persistent = c.allreduce_init(np.zeros(64, np.float32))

    def start_wait(x):
        persistent.start()
        persistent.wait()

    forms = {{
        "blocking": lambda x: c.allreduce(x), "out": lambda x: c.allreduce(x, out=np.empty_like(x)),
        "timed": lambda x: c.allreduce(x, timeout=60),
        "i-form": lambda x: c.iallreduce(x).wait(), "timed i-form": lambda x: c.iallreduce(x, timeout=60).wait(),
        "test loop": lambda x: [None for _ in iter(c.iallreduce(x).test, True)],
        "ireduce": lambda x: c.ireduce(x, "sum", 0).wait(), "iallgather": lambda x: c.iallgather(x).wait(),
        "ibroadcast": lambda x: c.ibroadcast(x, 0).wait(), "ibarrier": lambda x: c.ibarrier().wait(),
        "persistent": start_wait, "broadcast": lambda x: c.broadcast(x, 0),
    }}
    if face is not None:
        forms["native"] = lambda x: c.allreduce(x, algorithm="native")
        forms["native i-form"] = lambda x: c.iallreduce(x, algorithm="native").wait()
        forms["face"] = lambda x: face.Allreduce(x, np.empty_like(x), MPI.SUM)
        forms["face i-form"] = lambda x: face.Iallreduce(x, np.empty_like(x), MPI.SUM).Wait()
        forms["face scalar"] = lambda x: face.allreduce(3.5)
    found = {{}}
    for name, call in forms.items():
        x = np.arange(64, dtype=np.float32)
        for _ in range(300):  # past every shape's entries and, under MPI, a whole cycle of pool slots
            call(x.copy())
        gc.collect()
        gc.disable()
        for _ in range(200):
            call(x.copy())
        found[name] = gc.collect()  # the unreachable objects the calls left: freed only by the cyclic collector
        gc.enable()
    persistent.free()
    return found

found = body(c) if {mpi} else None
"""


def test_calls_leave_no_reference_cycles_behind():
    """A call of any form frees what it made when its result is returned (plain reference counting): garbage
    in cycles would stop the program for Python's cyclic collector every few hundred calls, and now and then
    for a full collection of the whole heap (an i-form whose completed request pointed at itself did so:
    10-30 ms every few thousand calls). Threads world; under mpiexec, with the pools and the face, below."""
    namespace = {}
    exec(_CYCLE_FREE_CODE.format(mpi=False), namespace)
    # (The collector is the process's: a cycle either rank thread leaves shows in a count, one rank's or both.)
    for found in ck.run_local(namespace["body"], 2):
        assert found == {name: 0 for name in found}, found


@requires_mpi
@pytest.mark.mpi
def test_calls_leave_no_reference_cycles_behind_under_mpiexec():
    """The same loop on real MPI ranks: pooled i-form slots, persistent requests and the mpi4py face too."""
    code = _CYCLE_FREE_CODE.format(mpi=True) + """
print("found", c.rank, sorted(found.items()), flush=True)
assert found == {name: 0 for name in found}, found
c.free()
"""
    result = run_mpi(2, code, timeout=240, env={"COMMKIT_TIMEOUT": ""})
    assert result.stdout.count("found") == 2, result.stdout + result.stderr


@requires_mpi
@pytest.mark.mpi
def test_an_i_form_on_persistent_transfers_that_times_out_names_the_peer_and_drops_its_slot():
    """A peer that calls another shape: the persistent i-form waits, gives up naming it, and never reuses the slot."""
    code = """
    import numpy as np
    import commkit as ck
    from commkit.communicator import _fresh_key
    c = ck.init()
    r = c.rank
    for k in range(4):
        assert c.iallreduce(np.full(4, k, np.float32), timeout=30).wait().tolist() == [2 * k] * 4
    x = np.ones(4 if r == 0 else 5, np.float32)  # rank 1 disagrees about the count
    seq = c._seq
    request = c.iallreduce(x, timeout=0.5)
    try:
        request.wait()
    except ck.CommTimeout as exc:
        message = str(exc)
    else:
        raise AssertionError("a mismatched i-form completed")
    assert f"allreduce #{seq}" in message and f"waiting for rank(s) {1 - r}" in message, message
    if r == 0:
        pool = c._by_shape_i[_fresh_key("allreduce", "sum", None, x, 0, 30)][2]
        assert pool is not None and type(pool.slots[seq % c._seq_span]) is not tuple, "a slot that timed out"
    try:
        c.barrier()
    except ck.CommBroken:
        pass
    else:
        raise AssertionError("the communicator is not broken")
    print(f"ok {r}", flush=True)
    """
    result = run_mpi(2, code, timeout=120)
    assert result.stdout.count("ok") == 2, result.stdout + result.stderr


@requires_mpi
@pytest.mark.mpi
@pytest.mark.parametrize("poll_first", ["0", "1"])
def test_a_timed_shape_plan_posts_and_polls_stays_right_and_still_gives_up_under_mpiexec(poll_first):
    """A timed shape plan posts its transfers and polls them until its timeout, whether or not the transport
    polls its blocking transfers first (``transports.mpi.POLL_FIRST``), past three cycles of call numbers,
    with no pool; when the peer calls another shape it gives up, names the call, and breaks the communicator."""
    code = """
    import os
    import numpy as np
    import commkit as ck
    c = ck.init()
    p, r = c.size, c.rank
    span = c._seq_span
    for k in range(3 * span):  # three cycles of call numbers, each number's tag used again
        x = np.arange(3, dtype=np.float32) + 10 * r + k
        want = sum(np.arange(3, dtype=np.float32) + 10 * q + k for q in range(p))
        out = np.empty(3, np.float32) if k % 2 else None
        got = c.allreduce(x, out=out, timeout=30)
        assert got.tolist() == want.tolist() and (out is None or got is out), (k, got, want)
        if k % 7 == 0:
            assert c.allreduce(np.full(2, k)).tolist() == [p * k] * 2  # untimed, between
    plans = [plan for (_, _, timed), plan in c._shaped.items() if timed and isinstance(plan, ck.plan.Plan)]
    assert len(plans) == 1, plans
    assert "_timeout)): raise _timed_out(" in plans[0].run.source, plans[0].run.source
    assert c.collective_transport.poll_first == (os.environ["COMMKIT_MPI_POLL_FIRST"] == "1")
    seq = c._seq
    x = np.ones(3 if r == 0 else 4, np.float32)  # the last rank disagrees about the count
    try:
        c.allreduce(x, timeout=0.5)
    except ck.CommTimeout as exc:
        message = str(exc)
    else:
        raise AssertionError("a mismatched call completed")
    assert f"allreduce #{seq}" in message and "waiting for rank(s)" in message, message
    assert "Recent calls on this rank:" in message, message
    assert c.flight_recorder.calls[-1][8] == "timed out"
    try:
        c.barrier()
    except ck.CommBroken:
        pass
    else:
        raise AssertionError("the communicator is not broken")
    print(f"ok {r}", flush=True)
    """
    result = run_mpi(2, code, timeout=120, env={"COMMKIT_TIMEOUT": "", "COMMKIT_MPI_POLL_FIRST": poll_first})
    assert result.stdout.count("ok") == 2, result.stdout + result.stderr


@requires_mpi
@pytest.mark.mpi
# Blocking transfers polled first or not (timed: posted and polled); the second on the short tag layout that a
# library with the least tag bound MPI allows gets (7 bits of call number: a cycle of 128 calls, not 1024).
@pytest.mark.parametrize("poll_first,tag_ub", [("0", ""), ("1", "32767")])
def test_every_collective_and_algorithm_on_persistent_transfers_gives_the_interpreters_answer_under_mpiexec(
        poll_first, tag_ub):
    """Timed calls and i-forms of every collective and algorithm, past a cycle of call numbers: the i-forms'
    slots made and used, the timed calls posted and polled, every answer the interpreter's."""
    code = """
    import os
    import numpy as np
    import commkit as ck
    c = ck.init()
    p, r = c.size, c.rank
    span = c._seq_span
    m = 3
    reference = c.dup()
    reference.plans = False  # the interpreter's answers

    def x_of(name, k):
        rows = p if name in ("scatter", "alltoall", "reduce_scatter") else 1
        x = (np.random.default_rng([r, k]).integers(-9, 9, rows * m)).astype(np.int64).reshape(rows, m)
        return x[0] if rows == 1 else x

    sum_op = ck.ops.get_op("sum")
    pooled = 0
    for name in ("allreduce", "reduce", "scan", "broadcast", "allgather", "gather", "scatter", "alltoall",
                 "reduce_scatter"):
        for algorithm in ck.algorithms.for_collective(name):
            alg = ck.algorithms.get(name, algorithm)
            if algorithm == "native" or alg.why_not(p, sum_op) is not None:
                continue
            for nonblocking in (False, True):
                if nonblocking and name not in ("allreduce", "reduce", "scan", "broadcast", "allgather", "alltoall"):
                    continue
                method = getattr(c, ("i" if nonblocking else "") + name)
                kw = {"algorithm": algorithm, "timeout": 30.0}
                if name in ("reduce", "gather", "broadcast", "scatter"):
                    kw["root"] = p - 1
                for k in range(span + 40):  # the last 40 calls take numbers seen before: their slots
                    x = x_of(name, k)
                    arg = None if name == "scatter" and r != p - 1 else x
                    extra = {"out": np.empty(m, np.int64)} if arg is None else {}
                    got = method(arg, **kw, **extra)
                    if nonblocking:
                        got = got.wait()
                    if k >= span:
                        want = getattr(reference, name)(arg, **kw, **extra)
                        assert (got is None) == (want is None), (name, algorithm, k)
                        if want is not None:
                            assert got.tolist() == want.tolist(), (name, algorithm, nonblocking, k, got, want)
                pools = [entry[2] for entry in c._by_shape_i.values() if entry[2] is not None]
                pooled += sum(type(slot) is tuple for pool in pools for slot in pool.slots)
                c.forget_plans()  # each algorithm's own pools
    assert pooled > 0
    assert span == (1024 if os.environ.get("COMMKIT_MPI_TAG_UB") == "" else 128), span
    print(f"ok {r} {pooled}", flush=True)
    """
    # 3 ranks, where every algorithm has more than one exchange (2 ranks: the tests above); about 30 s on the
    # full layout, since each shape runs a whole cycle of call numbers before its slots are made.
    env = {"COMMKIT_TIMEOUT": "", "COMMKIT_MPI_POLL_FIRST": poll_first, "COMMKIT_MPI_TAG_UB": tag_ub}
    result = run_mpi(3, code, timeout=300, env=env)
    assert result.stdout.count("ok") == 3, result.stdout + result.stderr


def test_owners_apart_knows_only_arrays_in_two_different_owners():
    """The fast paths' cheap overlap test: views of two arrays that own their memory are apart; anything it
    cannot tell (one owner, foreign buffers, subclasses) answers False, and the caller asks NumPy."""
    from commkit._checks import owners_apart

    def apart(a, b):
        return owners_apart(a, a.base, b, b.base)

    a, b = np.zeros(8), np.zeros(8)
    assert apart(a, b) and apart(a[2:], b[:3]) and apart(a.view(np.uint8), b.reshape(2, 4))
    assert not apart(a, a) and not apart(a[:4], a[4:]) and not apart(a.view(np.uint8), a)
    foreign = np.frombuffer(bytearray(64))
    assert not apart(foreign, a) and not apart(a, foreign[1:])
    assert apart(np.zeros(3).view(np.recarray), b)  # a view's owner is the plain array it views
    assert not apart(np.recarray((3,), float), b)  # an owner of a subclass: NumPy is asked


_NOT_INT_ROOTS_CODE = """
import numpy as np
import commkit as ck
from commkit.errors import InvalidArgument

def body(c):
    # A root that is not an int (0.0 == False == 0 by value) is refused after the fast paths know the shape,
    # on new arrays and on the same ones, as the general path refuses it on the first call.
    p, r = c.size, c.rank
    x, out, block = np.arange(4.0), np.empty(4), np.empty(4)
    stack = np.arange(4.0 * p).reshape(p, 4)
    forms = {
        "broadcast new": lambda root: c.broadcast(np.arange(4.0), root),
        "broadcast same": lambda root: c.broadcast(x, root, out=out),
        "ibroadcast new": lambda root: c.ibroadcast(np.arange(4.0), root).wait(),
        "reduce new": lambda root: c.reduce(np.arange(4.0), root=root),
        "reduce same": lambda root: c.reduce(x, root=root, out=out if r == 0 else None),
        "gather same": lambda root: c.gather(x, root=root, out=np.empty((p, 4)) if r == 0 else None),
        "gather new": lambda root: c.gather(np.arange(4.0), root=root),
        "scatter same": lambda root: c.scatter(stack if r == 0 else None, root=root, out=block),
    }
    refused = {}
    for name, call in forms.items():
        for _ in range(4):  # the shape's plan, its entry, and the same arrays' plan
            call(0)
        for bad in (0.0, False):
            try:
                call(bad)
            except InvalidArgument as exc:
                assert "root" in str(exc), exc
                refused[name] = refused.get(name, 0) + 1
    return refused
"""


def test_a_root_that_is_not_an_int_is_refused_on_the_fast_paths_too():
    ns = {}
    exec(_NOT_INT_ROOTS_CODE, ns)
    got = ck.run_local(ns["body"], size=2)
    assert got[0] == got[1] == {name: 2 for name in got[0]} and len(got[0]) == 8, got


@requires_mpi
@pytest.mark.mpi
def test_a_root_that_is_not_an_int_is_refused_on_the_fast_paths_under_mpiexec():
    code = _NOT_INT_ROOTS_CODE + """
c = ck.init()
got = body(c)
assert got == {name: 2 for name in got} and len(got) == 8, got
print("refused", c.rank, flush=True)
c.free()
"""
    result = run_mpi(2, code, timeout=120, env={"COMMKIT_TIMEOUT": ""})
    assert result.stdout.count("refused") == 2, result.stdout + result.stderr


def test_an_op_cannot_be_changed_once_made_so_no_plan_runs_an_old_function():
    # A plan writes its op's function into the code it runs and finds the op again by identity: an op
    # changed in place would be the general path's alone. So it cannot be changed; a new Op is new.
    import copy
    import pickle

    op = ck.ops.Op(np.add, True, "mine")
    for name in ("fn", "commutative", "name", "identity", "kinds", "is_ufunc"):
        with pytest.raises(AttributeError, match="cannot be changed"):
            setattr(op, name, np.maximum)
    with pytest.raises(AttributeError, match="cannot be changed"):
        del op.fn
    assert op.fn is np.add and op.is_ufunc
    for twin in (copy.copy(op), pickle.loads(pickle.dumps(op))):
        assert (twin.fn, twin.commutative, twin.name, twin.kinds) == (np.add, True, "mine", op.kinds)

    def body(comm):
        results = [comm.allreduce(np.full(3, comm.rank + 1.0), op) for _ in range(4)]
        other = ck.ops.Op(np.maximum, True, "mine")  # the same name, another function: another op
        results.append(comm.allreduce(np.full(3, comm.rank + 1.0), other))
        return results

    got = ck.run_local(body, size=2)
    assert [r.tolist() for r in got[0]] == [[3.0] * 3] * 4 + [[2.0] * 3]
