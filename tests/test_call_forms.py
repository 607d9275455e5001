"""Every call form after every other form, on one communicator: right answers, and every form settles on its fast path.

tests/call_forms.py holds the forms and the rotation (:func:`call_forms.rotate`); this file runs it on the
threads world and under ``mpiexec`` (where the forms include MPI's own collective). Each failure names the two
forms and the call. What the rotation found when it was written, each now fixed:

- an i-form that did not complete at its start (its request left outstanding) dropped every collective's
  i-form entry, so the next i-form on new arrays went through ``Communicator._fresh`` again (the usual
  overlap loop, ``req = comm.iallreduce(g); compute(); req.wait()``, paid it at every call);
- a reduce or gather given ``out`` off the root (``comm.reduce(x, out=y)`` on every rank, in place or not)
  took the general path at every call on new arrays.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import commkit as ck

import call_forms
from conftest import requires_mpi, run_mpi


@pytest.mark.parametrize("collective", call_forms.COLLECTIVES)
def test_every_call_form_after_every_other_gives_numpys_answer_and_settles_on_its_fast_path(collective):
    slow = ck.run_local(call_forms.rotate, 3, collective)
    assert slow == [[], [], []], slow


@requires_mpi
@pytest.mark.mpi
def test_every_call_form_after_every_other_under_mpiexec():
    """The same rotation on real MPI, with MPI's own collective (``native``) among the forms: 2 ranks, and
    3 for the rooted collectives (a rank that is neither the root nor its neighbour)."""
    code = """
    import sys
    import commkit as ck
    import call_forms
    c = ck.init()
    rooted = ("reduce", "gather", "scatter", "broadcast")
    for collective in call_forms.COLLECTIVES:
        if c.size == 2 or collective in rooted:
            slow = c.allgather_object(call_forms.rotate(c, collective, mpi=True))
            if c.rank == 0:
                print(f"{collective}: slow calls {slow}", flush=True)
    """
    for nprocs in (2, 3):
        # No default timeout (run_mpi sets one): the untimed forms are the rotation's own.
        result = run_mpi(nprocs, code, timeout=300, env={"COMMKIT_TIMEOUT": ""})
        lines = [line for line in result.stdout.splitlines() if ": slow calls " in line]
        assert len(lines) == (len(call_forms.COLLECTIVES) if nprocs == 2 else 4), result.stdout
        assert all(line.endswith(f" {[[]] * nprocs}") for line in lines), result.stdout


@requires_mpi
@pytest.mark.mpi
def test_random_call_sequences_through_the_face_on_kept_buffers_match_mpi4py():
    """The mpi4py face keeps what it can of a buffer between calls (replay memos of NumPy arrays, kept copies
    of other buffers, in-place memos): random sequences of collectives over a small pool of kept buffers, each
    buffer coming back in other roles, kinds, spec forms and counts, and calls repeated on new data, must leave
    both buffers of every call byte for byte as mpi4py's own call leaves copies of them (call_forms.face_rotate),
    untimed and timed."""
    code = """
    import sys
    from mpi4py import MPI
    from commkit.compat.mpi4py import wrap
    import call_forms
    face, raw = wrap(MPI.COMM_WORLD), MPI.COMM_WORLD.Dup()
    differ = call_forms.face_rotate(face, raw, int(sys.argv[1]))
    differ = raw.allgather(differ)
    if raw.Get_rank() == 0:
        print(f"differ: {differ}", flush=True)
    """
    for nprocs, timeout in ((2, ""), (3, ""), (2, "60")):
        result = run_mpi(nprocs, code, timeout=300, env={"COMMKIT_TIMEOUT": timeout}, args=(1000,))
        assert f"differ: {[[]] * nprocs}" in result.stdout, result.stdout


@requires_mpi
@pytest.mark.mpi
def test_a_nonblocking_call_keeps_its_temporary_input_until_it_completes_under_mpiexec():
    """``comm.iallreduce(x.copy())`` and the face's ``Iallreduce(x.copy(), y)``: the temporary input must live
    until the request completes. (mpi4py's own ``Iallreduce`` does not keep it: on Open MPI a temporary freed
    there was reused before MPI read it.) Rank 1 comes late, so rank 0's requests are in flight while it makes
    and fills new arrays of the same size, which reuse freed memory."""
    code = """
    import time
    import numpy as np
    from mpi4py import MPI
    import commkit as ck
    from commkit.compat.mpi4py import wrap
    c, face = ck.init(), wrap(MPI.COMM_WORLD)
    rank, size = c.rank, c.size
    n = 16384
    base = np.arange(n, dtype=np.float32) % 7
    want = size * base + sum(range(size))
    for k in range(6):
        if rank == 1:
            time.sleep(0.05)
        request = c.iallreduce(base + rank)
        junk = [np.full(n, -1.0e30, np.float32) for _ in range(4)]
        assert np.array_equal(request.wait(), want), k
        if rank == 1:
            time.sleep(0.05)
        out = np.empty(n, np.float32)
        request = face.Iallreduce(base + rank, out, MPI.SUM)
        junk = [np.full(n, -1.0e30, np.float32) for _ in range(4)]
        request.Wait()
        assert np.array_equal(out, want), k
    del junk
    print(f"ok {rank}", flush=True)
    """
    result = run_mpi(2, code, timeout=120, env={"COMMKIT_TIMEOUT": ""})
    assert result.stdout.count("ok") == 2, result.stdout


def test_an_i_form_left_in_flight_keeps_the_next_i_forms_entry():
    """A training step's loop: a blocking allreduce of a new loss, and an i-form of new gradients. Rank 1
    comes late to every i-form, so rank 0's request is still in flight after its start (which takes the
    blocking entries out of the way until it is waited for); the next i-form on a new array runs the shape's
    i-form entry, and the next blocking call its entry, put back when the request was waited for: neither
    goes through ``_fresh`` again."""
    def body(comm):
        fresh, stop = call_forms.counting_fresh(comm)
        got = []
        for k in range(8):
            loss = comm.allreduce(np.full(1, k + comm.rank, np.float64))
            if comm.rank == 1:
                time.sleep(0.005)
            request = comm.iallreduce(np.full(3, 10 * k + comm.rank, np.int64))
            got.append((loss.tolist(), request.wait().tolist()))
        stop()
        return fresh, got

    for fresh, got in ck.run_local(body, 2):
        assert got == [([2.0 * k + 1], [20 * k + 1] * 3) for k in range(8)]
        # the blocking call's first three (the general path; the general path again, which compiles the shape
        # plan; the shape plan, which makes the entry), the i-form's first two
        assert fresh.count("iallreduce") <= 2 and fresh.count("allreduce") <= 3, fresh


def test_an_entry_taken_out_of_the_way_goes_back_when_its_state_does():
    """Setting a default timeout takes the untimed entries out of the way (a timed call must not run them);
    setting it back puts them back, so the untimed loop on new arrays goes on without ``_fresh``. Check mode
    likewise; forgetting the plans drops them for good (the next call makes them again)."""
    def body(comm):
        fresh, stop = call_forms.counting_fresh(comm)
        got = []

        def loop(calls=4):
            before = len(fresh)
            for k in range(calls):
                got.append(comm.allreduce(np.full(2, k + comm.rank, np.int64)).tolist())
            return len(fresh) - before

        counts = {"first": loop()}  # the general path twice, then the shape plan, which makes the entry
        comm.timeout = 30.0
        counts["timed"] = loop()  # timed: the timed shape's plan and entry are made
        comm.timeout = None
        counts["untimed again"] = loop()  # the untimed entry is back
        comm.check = True
        loop(1)
        comm.check = False
        counts["after check mode"] = loop()  # back again
        comm.forget_plans()
        counts["forgotten"] = loop()  # made again
        stop()
        return counts, got

    for counts, got in ck.run_local(body, 2):
        assert got == [[2 * k + 1] * 2 for k in range(4)] * 3 + [[1, 1]] + [[2 * k + 1] * 2 for k in range(4)] * 2
        assert counts["untimed again"] == counts["after check mode"] == 0, counts
        assert counts["forgotten"] == counts["first"] == 3 and 1 <= counts["timed"] <= 3, counts


@pytest.mark.parametrize("collective", ["reduce", "gather"])
@pytest.mark.parametrize("in_place", [False, True])
def test_an_out_given_off_the_root_on_new_arrays_takes_the_fast_path_and_is_left_alone(collective, in_place):
    """``comm.reduce(x, out=y)`` (or ``out=x``) on every rank, as an SPMD program writes it: off the root the
    result is None and ``out`` untouched, as the general path leaves it, and from the third call on new arrays
    the shape's entry runs the call. An ``out`` the root could not take still goes to the general path (which
    names it, for a reduce; a gather's off the root it ignores)."""
    if collective == "gather" and in_place:
        pytest.skip("a gather is never in place")

    def body(comm):
        general = call_forms.counting_general_path(comm)
        call = getattr(comm, collective)
        results = []
        for k in range(8):
            x = np.full(4, 10 * k + comm.rank, np.int64)
            out = x if in_place else np.full((comm.size, 4) if collective == "gather" else 4, -1, np.int64)
            result = call(x, root=1, out=out)
            results.append((result if comm.rank == 1 else result is None,
                            in_place or comm.rank == 1 or bool((out == -1).all())))
        settled = len(general)
        refused = None
        if comm.rank != 1 and collective == "reduce" and not in_place:  # (refused before anything is sent)
            try:
                call(np.zeros(4, np.int64), root=1, out=np.zeros(5, np.int64))
            except ck.InvalidBuffer as exc:
                refused = str(exc)
        return results, settled, refused

    per_rank = ck.run_local(body, 3)
    for rank, (results, settled, refused) in enumerate(per_rank):
        assert settled <= 2, (rank, settled)
        for k, (result, untouched) in enumerate(results):
            assert untouched, (rank, k)
            if rank == 1:
                rows = [np.full(4, 10 * k + q, np.int64) for q in range(3)]
                want = np.stack(rows) if collective == "gather" else sum(rows)
                np.testing.assert_array_equal(result, want)
            else:
                assert result is True, (rank, k)
        if rank != 1 and collective == "reduce" and not in_place:
            assert refused and "shape (4,)" in refused, refused


@pytest.mark.parametrize("op", ["prod", "max", "user op without identity"])
def test_rank_0s_exscan_on_new_arrays_is_the_ops_identity_in_every_form(op):
    """No exscan step writes rank 0's result: the general path fills in the op's identity after the run, and
    every compiled form on new arrays (the shape plan, its entry, a timed one, an i-form's generator) ends
    with the same write. An op without an identity gives rank 0 None, which only the general path returns, so
    its calls there never compile. The outs start at -7, so an unwritten result shows (a sum's identity 0
    could be what a new array holds anyway)."""
    given = ck.Op(np.add, name="plus", identity=None) if op.startswith("user") else op
    identity = {"prod": 1, "max": np.iinfo(np.int64).min}.get(op)

    def body(comm):
        general = call_forms.counting_general_path(comm)
        results = []
        for form in ("new x", "new x, new out", "in place", "timed", "i-form"):
            for k in range(6):
                x = np.full(3, k + 2 + comm.rank, np.int64)
                out = x if form == "in place" else np.full(3, -7, np.int64) if form == "new x, new out" else None
                if form == "i-form":
                    result = comm.iexscan(x, given, out=out).wait()
                else:
                    result = comm.exscan(x, given, out=out, timeout=30.0 if form == "timed" else None)
                results.append((form, k, None if result is None else result.tolist(), len(general)))
        return results

    for rank, results in enumerate(ck.run_local(body, 3)):
        for form, k, result, _ in results:
            values = [k + 2 + r for r in range(rank)]
            want = ([identity] * 3 if identity is not None else None) if rank == 0 else [
                int(np.prod(values)) if op == "prod" else max(values) if op == "max" else sum(values)] * 3
            assert result == want, (rank, form, k, result, want)
        if rank == 0 and identity is None:
            continue  # every call takes the general path
        # each form's later calls take no general path (the first ones compile)
        settled = [calls for form, k, _, calls in results if k >= 3]
        by_form = [settled[i:i + 3] for i in range(0, len(settled), 3)]
        assert all(calls[0] == calls[-1] for calls in by_form), (rank, results)
