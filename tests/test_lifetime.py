"""Identity and limits over a communicator's whole life: persistent requests, long runs, misuse on every rank."""

from __future__ import annotations

import numpy as np
import pytest

import commkit as ck

from conftest import requires_mpi, run_mpi

# -- persistent requests keep an identity nobody else holds ---------------------------------------------


def _two_persistent_far_apart(comm, gap):
    """P and Q of one shape made ``gap`` calls apart, started together: each must get its own result."""
    n = 1000
    ra, rb = np.empty(n), np.empty(n)
    p = comm.allreduce_init(np.ones(n), out=ra, algorithm="ring")
    for _ in range(gap):
        comm.barrier()
    q = comm.allreduce_init(np.full(n, 100.0), out=rb, algorithm="ring")
    p.start(); q.start()
    p.wait(); q.wait()
    p.free(); q.free()
    return float(ra[0]), float(ra[-1]), float(rb[0]), float(rb[-1])


@pytest.mark.parametrize("size", [3, 4])
@pytest.mark.parametrize("gap", [1022, 1023, 2047])
def test_persistent_requests_made_a_call_number_cycle_apart_keep_their_data(size, gap):
    results = ck.run_local(lambda comm: _two_persistent_far_apart(comm, gap), size, timeout=60)
    assert set(results) == {(size * 1.0, size * 1.0, size * 100.0, size * 100.0)}


def test_persistent_request_never_shares_a_tag_with_ordinary_calls_of_its_shape():
    # Every ordinary call numbered s + 1024k once had the persistent request's tag (its base
    # hashed next to theirs): here ordinary iallreduces of the same shape run while P is active,
    # across several call-number cycles.
    def body(comm):
        n = 643  # the old layout hashed this shape's persistent and ordinary tag bases alike (threads' tag bound)
        out_p = np.empty(n)
        p = comm.allreduce_init(np.full(n, 1.0), out=out_p, algorithm="ring")
        bad = 0
        for i in range(1100):  # P runs beside every ordinary call, past call number 1024
            p.start()
            got = comm.iallreduce(np.full(n, 1000.0 + i), algorithm="ring").wait()
            p.wait()
            bad += int(not np.all(got == comm.size * (1000.0 + i))) + int(not np.all(out_p == comm.size))
        p.free()
        return bad

    assert ck.run_local(body, 3, timeout=120) == [0, 0, 0]


def test_persistent_channels_are_reused_and_freed():
    def body(comm):
        chans = comm._persistent_channels
        x = np.ones(4)
        first = comm.allreduce_init(x, algorithm="ring")
        made = [comm.allreduce_init(x, algorithm="ring") for _ in range(chans.per_channel)]
        # The next number is on a second channel; the first channel still has live requests.
        assert len(chans.live) == 2
        first.free()
        for r in made[:-1]:
            r.free()
        # The first channel hands out no more numbers and its last request is gone: freed.
        assert len(chans.live) == 1
        made[-1].free()
        again = comm.allreduce_init(x, algorithm="ring")
        again.start(); out = again.wait(); again.free()
        return float(out[0])

    assert ck.run_local(body, 2, timeout=60) == [2.0, 2.0]


# -- misuse of a persistent request is refused on every rank alike ---------------------------------------


@pytest.mark.parametrize("misuse", ["start", "free"])
def test_second_start_or_free_of_an_active_persistent_request_is_refused_on_every_rank(misuse):
    def body(comm):
        req = comm.allreduce_init(np.ones(4), algorithm="recursive_doubling")
        req.start()
        if comm.rank == 0:
            req.wait()  # rank 0's run is complete and waited: it may start again
            req.start()
        # Every rank's request is active (not yet completed by wait() or test()), however far its run got.
        with pytest.raises(ck.InvalidArgument, match="is active: complete it with wait"):
            getattr(req, misuse)()
        out = req.wait()
        if comm.rank != 0:
            req.start(); req.wait()
        req.free()
        return float(out[0])

    assert ck.run_local(body, 2, timeout=60) == [2.0, 2.0]


def test_a_test_that_returns_true_completes_a_persistent_run():
    def body(comm):
        req = comm.allreduce_init(np.ones(4), algorithm="recursive_doubling")
        for _ in range(3):
            req.start()
            while not req.test():
                pass
        req.free()
        return float(req.result[0])

    assert ck.run_local(body, 2, timeout=60) == [2.0, 2.0]


@requires_mpi
def test_persistent_requests_a_cycle_apart_under_mpiexec():
    out = run_mpi(3, """
        import numpy as np
        import commkit as ck
        from mpi4py import MPI
        comm = ck.init()
        n = 1000
        ra, rb = np.empty(n), np.empty(n)
        p = comm.allreduce_init(np.ones(n), out=ra, algorithm="ring")
        for _ in range(1023):
            comm.barrier()
        q = comm.allreduce_init(np.full(n, 100.0), out=rb, algorithm="ring")
        p.start(); q.start(); p.wait(); q.wait()
        assert np.all(ra == 3.0) and np.all(rb == 300.0), (comm.rank, ra[:3], rb[:3])
        # The face's persistent requests are the same requests.
        from commkit.compat.mpi4py import Prequest, wrap
        face = wrap(MPI.COMM_WORLD)
        sa, sb = np.empty(n), np.empty(n)
        P = face.Allreduce_init(np.ones(n), sa)
        for _ in range(1023):
            face.Barrier()
        Q = face.Allreduce_init(np.full(n, 100.0), sb)
        Prequest.Startall([P, Q]); Prequest.Waitall([P, Q])
        assert np.all(sa == 3.0) and np.all(sb == 300.0), (comm.rank, sa[:3], sb[:3])
        print("ok", comm.rank)
    """, env={"COMMKIT_TIMEOUT": ""})
    assert out.stdout.count("ok") == 3


# -- the outstanding-request limit is decided alike on every rank ---------------------------------------


def test_outstanding_limit_counts_what_the_program_holds_not_what_happened_to_finish():
    # Rank 0 lags, so its peers' requests stay pending while some of rank 0's own complete inside
    # their i-call (the data is already there). Every rank must decide the same: a blocking call
    # with 1023 held requests runs; a 1024th i-call is refused on every rank.
    def body(comm):
        limit = comm._layout.max_in_flight
        if comm.rank == 0:
            import time
            time.sleep(0.2)
        held = [comm.iallreduce(np.full(3, float(i)), algorithm="recursive_doubling") for i in range(limit)]
        total = comm.allreduce(np.ones(2), algorithm="recursive_doubling")
        with pytest.raises(ck.InvalidArgument, match="outstanding on this communicator"):
            comm.iallreduce(np.ones(1))
        results = [r.wait()[0] for r in held]
        after = comm.iallreduce(np.ones(1)).wait()  # room again
        return float(total[0]), results == [comm.size * float(i) for i in range(limit)], float(after[0])

    assert ck.run_local(body, 3, timeout=120) == [(3.0, True, 3.0)] * 3


def test_a_request_dropped_unwaited_no_longer_counts():
    # Rank 1 starts late, so rank 0's requests are all still pending when it drops them: they stop
    # counting at the drop (the program's own order), not when they happen to finish.
    def body(comm):
        limit = comm._layout.max_in_flight
        if comm.rank == 1:
            import time
            time.sleep(0.3)
        for _ in range(limit + 5):
            comm.ibarrier()  # dropped: once it has finished on its own, it no longer counts
        for _ in range(limit + 5):
            comm.barrier()  # every wait drives the dropped requests too
        return comm._progress.held, len(comm._progress.requests)

    assert ck.run_local(body, 2, timeout=60) == [(0, 0), (0, 0)]


def test_an_old_request_in_flight_is_finished_before_a_call_that_reuses_its_tag():
    # A request started, then 1024 blocking calls: the 1024th has the request's tag. The request
    # is finished first on each rank, so neither call takes the other's data.
    def body(comm):
        n = 257
        first = comm.iallreduce(np.full(n, 5.0), algorithm="ring")
        outs = [comm.allreduce(np.full(n, float(i)), algorithm="ring") for i in range(1030)]
        ok = all(np.all(o == comm.size * float(i)) for i, o in enumerate(outs))
        return ok, float(first.wait()[0])

    assert ck.run_local(body, 3, timeout=120) == [(True, 15.0)] * 3


# -- a communicator the program drops is released at once -----------------------------------------------


def _every_call_form(c):
    x = np.arange(4.0 * c.size).reshape(c.size, 4)
    for _ in range(3):  # the third call of a shape runs its compiled plans
        c.allreduce(x)
        c.allreduce(x, out=np.empty_like(x))
        c.allreduce(np.ones(3), timeout=30)
        c.exscan(x[0])
        c.scan(x[0], out=np.empty(4))
        c.broadcast(x[0].copy())
        c.reduce(x[0])
        c.allgather(x[0])
        c.alltoall(x)
        c.reduce_scatter(x)
        c.iallreduce(x).wait()
        c.barrier()
    req = c.allreduce_init(np.ones(4), algorithm="ring")
    req.start(); req.wait()


@pytest.mark.parametrize("calls", [False, True])
def test_a_dropped_communicator_is_released_without_the_cyclic_collector(calls):
    import gc

    def body(comm):
        gc.disable()
        try:
            alive = 0
            for _ in range(3):
                c = comm.dup()
                if calls:
                    _every_call_form(c)
                finalizer = c._finalizer
                del c
                alive += finalizer.alive
            return alive
        finally:
            gc.enable()

    assert ck.run_local(body, 2, timeout=60) == [0, 0]


@requires_mpi
def test_dup_in_a_loop_with_the_collector_off_never_exhausts_the_library():
    # MPICH runs out of communicators near 2048 contexts: each dup holds two of them.
    run_mpi(2, """
        import gc
        import numpy as np
        import commkit as ck
        comm = ck.init()
        gc.disable()
        for i in range(1500):
            c = comm.dup()
            c.allreduce(np.ones(2))
            c.allreduce(np.ones(2))
            del c
        print("ok")
    """, env={"COMMKIT_TIMEOUT": ""}, timeout=300)


LEFT_BEHIND = """
import sys
import warnings

import numpy as np

import commkit as ck

comm = ck.init()
never = sys.argv[1] == "never"
for case in range(int(sys.argv[2])):
    a = comm.dup()
    if never and comm.rank == 1:
        a.free = lambda: None  # (below: a rank that never frees; the others warn, and go on)
    # Each rank a broadcast's root: each sends the other a message no rank will receive; and rank 0 a message of
    # the size b's below, on a's point-to-point channel.
    a.broadcast(np.full(3, comm.rank, np.float64), root=comm.rank)
    if comm.rank == 0:
        a.send(np.full(2, 99.0), 1)
    checks = getattr(a.collective_transport, "checks_in_before_free", False)  # (MPI's channels)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        a.free()
    b = comm.dup()
    got = b.gather(np.full(2, comm.rank + 1.0), root=0, algorithm="binomial")  # (two-sided: b's own messages)
    if comm.rank == 0:
        b.send(np.full(2, 7.0), 1)
    else:
        got = b.recv(0, shape=2, dtype=np.float64)
    print(f"<case {case} rank {comm.rank}: {got.tolist()} checks {checks} warned {len(seen)}>", flush=True)
    b.free()
"""


@requires_mpi
@pytest.mark.parametrize("who", ["every", "never"])
def test_a_message_left_on_a_freed_communicator_never_takes_the_next_ones(who):
    """MPI gives a freed communicator's context id to the next one made, which then took the messages left for the
    freed one: under MPICH 5.0.2 the receive below got the freed communicator's 99s (wrong data, silently), under
    Open MPI 5.0.11 the gather timed out on rank 0 (its peer's first message lost). Raw mpi4py alike. free() now
    hears from every rank, then drops what came. With a rank that never frees, the others wait their timeout, warn
    and go on."""
    import re

    cases = 4 if who == "every" else 2  # (a rank that never frees costs each case the timeout)
    result = run_mpi(2, LEFT_BEHIND, args=(who, cases), env={"COMMKIT_TIMEOUT": "2"}, timeout=120)
    lines = sorted(re.findall(r"<(case .*?)>", result.stdout))  # (mpiexec may interleave the ranks' lines)
    assert len(lines) == 2 * cases, result.stdout + result.stderr
    checks = "checks True" in lines[0]
    warned = 1 if checks and who == "never" else 0  # rank 0 waits for rank 1 in vain: 2 s, then a warning
    assert lines == sorted([f"case {case} rank 0: [[1.0, 1.0], [2.0, 2.0]] checks {checks} warned {warned}"
                            for case in range(cases)] + [f"case {case} rank 1: [7.0, 7.0] checks {checks} warned 0"
                                                         for case in range(cases)]), result.stdout


BROKEN_THEN_FREED = """
import warnings

import numpy as np

import commkit as ck

c = ck.init()
for k in range(4):
    d = c.dup()
    if c.rank == 0:  # a call rank 1 never makes: rank 0 times out, its message to rank 1 stays unreceived
        try:
            d.allreduce(np.full(2, 99.0), algorithm="recursive_doubling", timeout=0.3)
        except ck.CommTimeout:
            pass
    e = d.dup()  # as the broken communicator's message says: a new one, then free() the broken one
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        d.free()  # (the ranks' call numbers differ here: the check-in does not depend on them)
    total = e.allreduce(np.full(2, c.rank + 1.0), algorithm="recursive_doubling")
    f = c.dup()
    got = f.send(np.full(2, 5.0), 1) if c.rank == 0 else f.recv(0, shape=2, dtype=np.float64)
    print(f"<{k} {c.rank} {total.tolist()} {None if got is None else got.tolist()} {len(seen)}>", flush=True)
    e.free()
    f.free()
"""


@requires_mpi
def test_a_timed_out_communicator_freed_after_its_dup_leaves_nothing_to_later_ones():
    """The flow the broken communicator's message asks for. free()'s check-in first took a call number, which the
    ranks did not share here (rank 0's timed-out call took one): both waited 10 s and warned, the message of the
    call still unreceived; its tag now carries none."""
    import re

    result = run_mpi(2, BROKEN_THEN_FREED, env={"COMMKIT_TIMEOUT": "10"}, timeout=120)
    lines = sorted(re.findall(r"<(.*?)>", result.stdout))
    assert lines == sorted([f"{k} 0 [3.0, 3.0] None 0" for k in range(4)]
                           + [f"{k} 1 [3.0, 3.0] [5.0, 5.0] 0" for k in range(4)]), result.stdout + result.stderr


LEFT_BY_AN_EXCEPTION = """
import time
import warnings

import commkit as ck

c = ck.init()
if c.rank == 0:
    t = time.monotonic()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            with c.dup() as d:
                raise ValueError("this rank's own error")
        except ValueError:
            pass
    print(f"<left {[str(w.message)[:80] for w in seen]} {time.monotonic() - t < 5}>", flush=True)
else:
    d = c.dup()  # this rank never frees it: had rank 0 waited for it, it would have warned after 10 s
c.barrier()
"""


@requires_mpi
def test_a_with_block_left_by_an_exception_frees_without_waiting_for_the_other_ranks():
    import re

    result = run_mpi(2, LEFT_BY_AN_EXCEPTION, env={"COMMKIT_TIMEOUT": ""}, timeout=120)
    assert re.findall(r"<(left .*?)>", result.stdout) == ["left [] True"], result.stdout + result.stderr


# -- the plans keep every check the first call makes ----------------------------------------------------


@pytest.mark.parametrize("form", ["out", "in place", "broadcast in place"])
def test_an_output_made_read_only_after_its_plan_was_compiled_is_refused(form):
    def body(comm):
        x = np.ones(4)
        out = np.empty(4) if form == "out" else x
        call = comm.broadcast if form.startswith("broadcast") else comm.allreduce
        for _ in range(3):  # the third call runs the plan compiled for these arrays
            call(x, out=out)
        out.flags.writeable = False
        with pytest.raises(ck.InvalidBuffer, match="writ"):
            call(x, out=out)
        return True

    assert ck.run_local(body, 2) == [True, True]


def test_inputs_reshaped_in_place_after_their_plan_was_compiled_are_checked_again():
    def body(comm):
        assert comm.size == 3
        x, out = np.arange(24.0).reshape(3, 8), np.empty((3, 8))
        for _ in range(3):
            comm.alltoall(x, out=out)
        x.shape = (4, 6)  # p + 1 rows: the general path refuses it
        with pytest.raises(ck.InvalidBuffer, match="alltoall's x must have shape"):
            comm.alltoall(x, out=out)
        r = np.ones((6, 4))
        for _ in range(3):
            comm.reduce_scatter(r)
        r.shape = (8, 3)  # 8 rows do not divide among 3 ranks
        with pytest.raises(ck.InvalidBuffer, match="reduce_scatter"):
            comm.reduce_scatter(r)
        return True

    assert ck.run_local(body, 3) == [True] * 3


@requires_mpi
def test_plans_keep_their_checks_under_mpiexec_and_through_the_face():
    run_mpi(2, """
        import numpy as np
        import commkit as ck
        from mpi4py import MPI
        from commkit.compat.mpi4py import wrap
        comm = ck.init()
        x, out = np.ones(4), np.empty(4)
        for _ in range(3):
            comm.allreduce(x, out=out)
        out.flags.writeable = False
        try:
            comm.allreduce(x, out=out)
        except ck.InvalidBuffer as exc:
            assert "writ" in str(exc)
        else:
            raise AssertionError("a read-only out was written")
        face = wrap(MPI.COMM_WORLD)
        s, r = np.ones(4), np.empty(4)
        for _ in range(3):
            face.Allreduce(s, r)
        r.flags.writeable = False
        try:
            face.Allreduce(s, r)
        except (BufferError, ck.InvalidBuffer):
            pass
        else:
            raise AssertionError("the face wrote a read-only recvbuf")
        print("ok")
    """, env={"COMMKIT_TIMEOUT": ""})


# -- bad arguments get a clear error, the same on every rank --------------------------------------------


@pytest.mark.parametrize("call, error, match", [
    (lambda c: c.allreduce(np.ones(2), op=["sum"]), ck.UnsupportedOp, "op must be a name"),
    (lambda c: c.allreduce(np.ones(2), algorithm=["ring"]), ck.InvalidArgument, "algorithm must be"),
    (lambda c: c.reduce(np.ones(2), op={"sum"}), ck.UnsupportedOp, "op must be a name"),
    (lambda c: c.broadcast(np.ones(2), root=[0]), ck.InvalidArgument, "root must be an int"),
    (lambda c: c.barrier(algorithm=["dissemination"]), ck.InvalidArgument, "algorithm must be"),
    (lambda c: c.reduce_scatter(np.ones((4, 2)), counts=3), ck.InvalidArgument, "counts must be"),
    (lambda c: c.allgatherv(np.ones(2), counts=[2, 10**18]), ck.InvalidArgument, "counts"),
    (lambda c: c.allgatherv(np.ones(2), counts=[2, 2**62]), ck.InvalidArgument, "counts"),
])
def test_bad_arguments_raise_a_clear_error_on_every_rank(call, error, match):
    def body(comm):
        with pytest.raises(error, match=match):
            call(comm)
        return comm.allreduce(np.ones(1))[0]  # nothing was left half-sent

    assert ck.run_local(body, 2, timeout=30) == [2.0, 2.0]


def test_counts_given_as_an_iterator_are_read_once():
    def body(comm):
        a = comm.reduce_scatter(np.ones((4, 2)), counts=(c for c in [2, 2]))
        b = comm.allgatherv(np.full(2, comm.rank), counts=iter([2, 2]))
        return a.tolist(), b.tolist()

    assert ck.run_local(body, 2) == [([[2.0, 2.0], [2.0, 2.0]], [0, 0, 1, 1])] * 2


# -- a student's edit always runs; the caller's input is never written ----------------------------------


def _register_student(version):
    from commkit.algorithms import algorithm
    from commkit.schedule import Copy, Reduce

    if version == 1:  # not an allreduce yet: every rank returns its own input
        @algorithm("allreduce", "student_edit", replace=True)
        def allreduce_student_edit(rank, size, count, op):
            yield Copy(("out", 0, count), ("in", 0, count))
    else:  # doubles the input: a different answer, so the test sees which code ran
        @algorithm("allreduce", "student_edit", replace=True)
        def allreduce_student_edit(rank, size, count, op):
            yield Copy(("out", 0, count), ("in", 0, count))
            yield Reduce(("out", 0, count), ("in", 0, count), op)


@pytest.mark.parametrize("plans", [True, False])
def test_an_algorithm_registered_again_runs_at_the_next_call_on_the_same_communicator(plans):
    from commkit.algorithms import unregister

    def body(comm):
        comm.plans = plans
        x, out = np.arange(4.0), np.empty(4)
        if comm.rank == 0:
            _register_student(1)
        comm.barrier()
        first = [comm.allreduce(x, algorithm="student_edit", out=out).tolist() for _ in range(3)]
        first.append(comm.allreduce(x, algorithm="student_edit").tolist())
        comm.barrier()
        if comm.rank == 0:
            _register_student(2)  # the same name and shape, edited code: as a re-run notebook cell does
        comm.barrier()
        second = [comm.allreduce(x, algorithm="student_edit", out=out).tolist() for _ in range(3)]
        second.append(comm.allreduce(x, algorithm="student_edit").tolist())
        return first, second

    try:
        results = ck.run_local(body, 2)
    finally:
        unregister("allreduce", "student_edit")
    for first, second in results:
        assert first == [[0.0, 1.0, 2.0, 3.0]] * 4
        assert second == [[0.0, 2.0, 4.0, 6.0]] * 4


@requires_mpi
def test_an_algorithm_registered_again_runs_under_mpiexec():
    run_mpi(2, """
        import numpy as np
        import commkit as ck
        from test_lifetime import _register_student
        comm = ck.init()
        x = np.arange(4.0)
        _register_student(1)
        a = [comm.allreduce(x, algorithm="student_edit").tolist() for _ in range(3)]
        _register_student(2)
        b = [comm.allreduce(x, algorithm="student_edit").tolist() for _ in range(3)]
        assert a == [[0.0, 1.0, 2.0, 3.0]] * 3 and b == [[0.0, 2.0, 4.0, 6.0]] * 3, (a, b)
        print("ok")
    """, env={"COMMKIT_TIMEOUT": ""})


@pytest.mark.parametrize("rank_that_errs", [None, 1])
def test_a_schedule_that_writes_its_input_is_refused_before_anything_is_sent(rank_that_errs):
    from commkit.algorithms import algorithm, unregister
    from commkit.schedule import Copy

    @algorithm("allreduce", "writes_in", replace=True)
    def allreduce_writes_in(rank, size, count, op):
        if rank_that_errs is None or rank == rank_that_errs:
            yield Copy(("in", 0, count), ("out", 0, count))  # source and destination swapped
        else:
            yield Copy(("out", 0, count), ("in", 0, count))

    def body(comm):
        x = np.arange(4.0) + comm.rank
        with pytest.raises(ck.InvalidArgument, match=r'writes the caller\'s input "in" at step 0 .* on rank'):
            comm.allreduce(x, algorithm="writes_in")
        assert x.tolist() == (np.arange(4.0) + comm.rank).tolist()
        return comm.allreduce(np.ones(1))[0]  # every rank refused the same call: nothing is left pending

    try:
        assert ck.run_local(body, 3, timeout=30) == [3.0, 3.0, 3.0]
    finally:
        unregister("allreduce", "writes_in")


def test_plans_off_runs_every_call_through_the_interpreter(monkeypatch):
    from commkit import schedule

    ran = []
    real = schedule.execute

    def counting(*args, **kwargs):
        ran.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(schedule, "execute", counting)
    monkeypatch.setenv("COMMKIT_PLANS", "off")

    def body(comm):
        assert comm.plans is False
        x, out = np.ones(8), np.empty(8)
        for _ in range(5):
            comm.allreduce(x, out=out, algorithm="ring")
        return out[0]

    assert ck.run_local(body, 2) == [2.0, 2.0]
    assert len(ran) == 2 * 5


# -- what the tag layout leaves to chance, measured ------------------------------------------------------


@pytest.mark.parametrize("tag_ub, exact_kind, hash_bits", [(2**29 - 1, True, 9), (32767, False, 8)])
def test_the_chance_that_two_signatures_share_a_tag_base_is_what_the_docs_state(tag_ub, exact_kind, hash_bits):
    # docs/troubleshooting.md ("What identity guarantees") states these numbers; this measures them by
    # brute force over signatures that differ only in root, op, count or algorithm.
    from commkit.identity import TagLayout

    layout = TagLayout(tag_ub)
    assert layout.exact == exact_kind and layout.hash_bits == hash_bits
    dtype = np.dtype("float64")
    bases = {}
    for count in range(0, 400):
        for op in ("sum", "max", "prod"):
            for root in (None, 0, 1, 2):
                for alg in ("ring", "recursive_doubling"):
                    base = layout.base("allreduce", dtype, (root, op, count, alg))
                    bases[base] = bases.get(base, 0) + 1
    signatures = sum(bases.values())
    pairs = signatures * (signatures - 1) // 2
    colliding = sum(n * (n - 1) // 2 for n in bases.values())
    rate = colliding / pairs
    assert 0.7 * 2.0 ** -hash_bits < rate < 1.3 * 2.0 ** -hash_bits, rate
    # Different collectives or element types never share a base where the layout keeps them exactly.
    kinds = {layout.base(c, dtype, (None, "sum", 8, "ring")) >> (layout.hash_bits + 5)
             for c in ("allreduce", "reduce", "broadcast", "scan")}
    dtypes = {(layout.base("allreduce", np.dtype(t), (None, "sum", 8, "ring")) >> layout.hash_bits) & 31
              for t in ("float32", "int32", "float64", "int64")}
    if exact_kind:
        assert len(kinds) == 4 and len(dtypes) == 4
