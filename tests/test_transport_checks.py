"""The transports' own checks: exact collective receives, MPI errors as commkit errors, matching cost, arithmetic.

* A collective's receive is exact: a message shorter than its buffer raises
  MessageTruncated naming the peer and both sizes, on every receive path of
  both transports (blocking, bound, persistent, posted), while a user's
  point-to-point receive may still be longer than its message. The collision
  of two calls' identities in the tag hash is made certain by hashing no
  signature at all, so ranks that disagree about a count meet.
* A truncated message reported by ``Waitall``/``Testall`` (``MPI_ERR_IN_STATUS``)
  is the MessageTruncated a single request gives.
* The threads world matches a receive without scanning the backlog, with
  MPI's ordering rules intact.
* MPI's own reductions run only where the library's arithmetic is NumPy's.

Each test of a fix fails on the transports before it.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import commkit as ck
from commkit.identity import TagLayout
from commkit.transports.base import ANY_SOURCE, ANY_TAG
from commkit.transports.local import LocalTransport, LocalWorld, _Receive

from conftest import requires_mpi, run_mpi

TAG = 77


def _hash_no_signature(monkeypatch):
    """Give every call of one collective and dtype the same tag base, as a hash collision would."""
    base = TagLayout.base
    monkeypatch.setattr(TagLayout, "base", lambda self, collective, dtype=None, signature=():
                        base(self, collective, dtype, ()))


def _short_error(exc, peer: int, expected: int, received: int) -> None:
    assert isinstance(exc, ck.MessageTruncated), repr(exc)
    assert (exc.peer, exc.expected, exc.received) == (peer, expected, received), vars(exc)
    assert f"expected {expected} bytes from rank {peer}, got {received}" in str(exc), str(exc)


# -- threads world: exact collective receives ---------------------------------------------------


@pytest.mark.parametrize("path", ["transfer", "timed transfer", "post wait", "post test", "two receives"])
def test_threads_collective_receive_shorter_than_its_buffer_raises(path):
    world = LocalWorld(2)
    sender, receiver = LocalTransport(world, 0), LocalTransport(world, 1)
    rng = np.random.default_rng(1)
    first = rng.integers(0, 256, 12, dtype=np.uint8)
    short = rng.integers(0, 256, 16, dtype=np.uint8)
    buf = np.zeros(20, np.uint8)
    if path == "two receives":  # the second of two receives is the short one
        sender.post([(1, first), (1, short)], [], TAG)
    else:
        sender.post([(1, short)], [], TAG)
    with pytest.raises(ck.MessageTruncated) as info:
        if path == "transfer":
            receiver.transfer([], [(0, buf)], TAG, None)
        elif path == "timed transfer":
            receiver.transfer([], [(0, buf)], TAG, 30.0)
        elif path == "post wait":
            receiver.post([], [(0, buf)], TAG).wait(None)
        elif path == "post test":
            receiver.post([], [(0, buf)], TAG).test()
        else:
            receiver.transfer([], [(0, np.zeros(12, np.uint8)), (0, buf)], TAG, None)
    _short_error(info.value, 0, 20, 16)


def test_threads_collective_receive_of_the_right_size_still_completes():
    world = LocalWorld(2)
    data = np.random.default_rng(2).integers(0, 256, 20, dtype=np.uint8)
    LocalTransport(world, 0).post([(1, data)], [], TAG)
    buf = np.zeros(20, np.uint8)
    assert LocalTransport(world, 1).transfer([], [(0, buf)], TAG, None) == []
    assert np.array_equal(buf, data)


def test_threads_user_receive_may_be_longer_than_the_message():
    def body(comm):
        data = np.random.default_rng(3).standard_normal(4)
        if comm.rank == 0:
            comm.send(data, 1, tag=5)
            return None
        out = np.full(6, -1.0)
        _, status = comm.recv(0, tag=5, out=out, return_status=True)
        return out, status.nbytes, data

    out, nbytes, data = ck.run_local(body, 2)[1]
    assert nbytes == 32
    assert np.array_equal(out[:4], data) and np.array_equal(out[4:], [-1.0, -1.0])


def _disagreeing_broadcast(comm):
    """Root broadcasts 16 float64, the other rank expects 20: its error, as text (or None)."""
    x = np.arange(16 if comm.rank == 0 else 20, dtype=np.float64)
    try:
        comm.broadcast(x, root=0, out=x, algorithm="binomial")
    except ck.MessageTruncated as exc:
        return exc
    return None


def test_threads_broadcast_whose_ranks_disagree_on_the_count_raises(monkeypatch):
    _hash_no_signature(monkeypatch)
    results = ck.run_local(_disagreeing_broadcast, 2)
    assert results[0] is None
    _short_error(results[1], 0, 160, 128)
    assert "broadcast" in str(results[1]) and "disagree" in str(results[1])


def test_threads_allgatherv_whose_ranks_disagree_on_a_count_raises(monkeypatch):
    _hash_no_signature(monkeypatch)

    def body(comm):
        counts = [3, 5] if comm.rank == 0 else [3, 4]
        x = np.random.default_rng(comm.rank).standard_normal(counts[comm.rank])
        try:
            return comm.allgatherv(x, counts, algorithm="ring")
        except ck.MessageTruncated as exc:
            return exc

    results = ck.run_local(body, 2)
    _short_error(results[0], 1, 40, 32)


# -- threads world: matching ---------------------------------------------------------------------


def _count_matches(monkeypatch) -> list:
    calls = [0]
    matches = _Receive.matches

    def counted(self, msg):
        calls[0] += 1
        return matches(self, msg)
    monkeypatch.setattr(_Receive, "matches", counted)
    return calls


def test_threads_receive_does_not_scan_the_backlog(monkeypatch):
    # A root 20,000 messages behind (rooted collectives' non-roots run ahead without bound):
    # its next receive names source and tag, and finds its message without looking at the others.
    world = LocalWorld(2)
    sender, receiver = LocalTransport(world, 1), LocalTransport(world, 0)
    one = np.zeros(1, np.uint8)
    for tag in range(20000):
        sender.isend(one + tag % 256, 0, tag)
    calls = _count_matches(monkeypatch)
    buf = np.zeros(1, np.uint8)
    receiver.irecv(buf, 1, 19999).wait(None)
    assert buf[0] == 19999 % 256
    assert calls[0] <= 1, f"the receive compared {calls[0]} messages"
    assert world.unexpected[0].count == 19999


def test_threads_message_does_not_scan_the_posted_receives(monkeypatch):
    world = LocalWorld(2)
    sender, receiver = LocalTransport(world, 1), LocalTransport(world, 0)
    handles = [receiver.irecv(np.zeros(1, np.uint8), 1, tag) for tag in range(5000)]
    calls = _count_matches(monkeypatch)
    sender.isend(np.full(1, 9, np.uint8), 0, 4999)
    assert handles[-1].test() and not handles[0].test()
    assert calls[0] <= 1, f"the message was compared with {calls[0]} receives"


def test_threads_16000_reduces_at_3_ranks():
    def body(comm):
        x = np.arange(4.0) + comm.rank
        for _ in range(16000):
            out = comm.reduce(x, root=0)
        return out

    results = ck.run_local(body, 3)
    assert np.array_equal(results[0], 3 * np.arange(4.0) + 3)


def _ordering_world():
    world = LocalWorld(3)
    return world, [LocalTransport(world, r) for r in range(3)]


def _send(chan, dest, tag, value):
    chan.isend(np.full(1, value, np.int64), dest, tag)


def _receive(chan, source, tag):
    buf = np.zeros(1, np.int64)
    handle = chan.irecv(buf, source, tag)
    assert handle.test(), "no message matched"
    return int(buf[0]), handle.status.source, handle.status.tag


def test_threads_wildcards_take_messages_in_the_order_sent():
    _, chans = _ordering_world()
    for value, (src, tag) in enumerate([(1, 5), (2, 6), (1, 6), (2, 5), (1, 5), (2, 7)]):
        _send(chans[src], 0, tag, value)
    assert _receive(chans[0], 2, ANY_TAG) == (1, 2, 6)  # rank 2's first
    assert _receive(chans[0], ANY_SOURCE, 5) == (0, 1, 5)  # the oldest tag 5
    assert _receive(chans[0], ANY_SOURCE, 5) == (3, 2, 5)
    assert _receive(chans[0], 1, ANY_TAG) == (2, 1, 6)
    assert chans[0].probe(ANY_SOURCE, ANY_TAG) == (1, 5, 8)
    assert _receive(chans[0], ANY_SOURCE, ANY_TAG) == (4, 1, 5)
    assert _receive(chans[0], ANY_SOURCE, ANY_TAG) == (5, 2, 7)
    assert chans[0].probe(ANY_SOURCE, ANY_TAG) is None


def test_threads_a_message_goes_to_the_receive_posted_first():
    _, chans = _ordering_world()
    first, second = np.zeros(1, np.int64), np.zeros(1, np.int64)
    wild = chans[0].irecv(first, ANY_SOURCE, ANY_TAG)
    exact = chans[0].irecv(second, 1, 5)
    _send(chans[1], 0, 5, 10)
    assert wild.test() and not exact.test() and first[0] == 10
    _send(chans[1], 0, 5, 11)
    assert exact.test() and second[0] == 11
    exact = chans[0].irecv(first, 2, 6)
    wild = chans[0].irecv(second, ANY_SOURCE, 6)
    _send(chans[2], 0, 6, 12)
    assert exact.test() and not wild.test() and first[0] == 12
    _send(chans[1], 0, 6, 13)
    assert wild.test() and second[0] == 13 and wild.status.source == 1


def test_threads_withdrawn_receive_matches_nothing():
    world, chans = _ordering_world()
    buf = np.zeros(1, np.int64)
    for source, tag in ((1, 5), (ANY_SOURCE, 5)):
        receive = chans[0]._receive(buf, source, tag, False)
        receive.withdraw()
        _send(chans[1], 0, 5, 7)
        assert not receive.done
        assert _receive(chans[0], 1, 5) == (7, 1, 5)
    assert world.unexpected[0].count == 0


# -- under mpiexec: exact receives and MPI errors ------------------------------------------------

_MPI_PATHS = r"""
import numpy as np
from mpi4py import MPI
import commkit as ck
from commkit.transports.mpi import MPITransport

world = MPI.COMM_WORLD
comm = world.Dup()
t = MPITransport(comm)
import os
assert t.poll_first == (os.environ["COMMKIT_MPI_POLL_FIRST"] == "1"), t.poll_first
# COMMKIT_MPI_TAG_UB caps the tag bound (the short tag layout under mpiexec); a bound MPI could not have is refused.
os.environ["COMMKIT_MPI_TAG_UB"] = "40000"
capped = MPITransport(comm)
assert capped.tag_ub == min(40000, comm.Get_attr(MPI.TAG_UB)) and t.tag_ub == comm.Get_attr(MPI.TAG_UB), capped.tag_ub
for bad in ("12", "many"):
    os.environ["COMMKIT_MPI_TAG_UB"] = bad
    try:
        MPITransport(comm)
    except ck.InvalidArgument as exc:
        assert "COMMKIT_MPI_TAG_UB must be an integer of at least 32767" in str(exc) and repr(bad) in str(exc), exc
    else:
        raise AssertionError(f"COMMKIT_MPI_TAG_UB={bad} was taken")
del os.environ["COMMKIT_MPI_TAG_UB"]
rank = world.Get_rank()
T = 77
rng = np.random.default_rng(7)
s8 = rng.integers(0, 256, 8, dtype=np.uint8)


def persistent(r, run):
    p = t.persistent_transfer([], [(0, r)], T)
    p.start()
    try:
        run(p)
    finally:
        p.free()


def timed_posted(sends, r):
    # What a timed shape plan's transfer runs (bind_timed_transfer, written inline only): posted, then
    # polled until the timeout by _polled's timed finish.
    from commkit.transports.mpi import _polled
    finish = _polled([0] + [peer for peer, _ in sends], [(0, r)], timed=True)
    requests = [t.comm.Irecv([r, MPI.BYTE], 0, T)] + [t.comm.Isend([b, MPI.BYTE], peer, T) for peer, b in sends]
    assert finish(requests, 30.0) == ()


def spin(test):
    while not test():
        pass


# path name -> (rank 1 sends to rank 0 too, the receive of 20 bytes on rank 1)
PATHS = {
    "sendrecv": (True, lambda r: t.sendrecv(0, s8, 0, r, T)),
    "transfer Sendrecv": (True, lambda r: t.transfer([(0, s8)], [(0, r)], T, None)),
    "transfer Recv": (False, lambda r: t.transfer([], [(0, r)], T, None)),
    "transfer with a timeout": (False, lambda r: t.transfer([], [(0, r)], T, 30.0)),
    "exchange with a timeout": (True, lambda r: t.transfer([(0, s8)], [(0, r)], T, 30.0)),
    "two receives and a send": (True, lambda r: t.transfer([(0, s8)], [(0, np.zeros(12, np.uint8)), (0, r)], T, None)),
    "bound Sendrecv": (True, lambda r: t.bind_transfer([(0, s8)], [(0, r)])(T)),
    "bound Recv": (False, lambda r: t.bind_transfer([], [(0, r)])(T)),
    "bound pair": (True, lambda r: t.bind_transfer([(0, s8)], [(0, np.zeros(12, np.uint8)), (0, r)])(T)),
    "posted, Waitall": (False, lambda r: t.post([], [(0, r)], T).wait(None)),
    "posted, Testall polled": (False, lambda r: t.post([], [(0, r)], T).wait(30.0)),
    "posted, test()": (False, lambda r: spin(t.post([], [(0, r)], T).test)),
    "posted, settles()": (False, lambda r: spin(t.post([], [(0, r)], T).settles)),
    "persistent, Waitall": (False, lambda r: persistent(r, lambda p: p.wait(None))),
    "persistent, Testall polled": (False, lambda r: persistent(r, lambda p: p.wait(30.0))),
    "persistent, test()": (False, lambda r: persistent(r, lambda p: spin(p.test))),
    "timed, posted and polled": (False, lambda r: timed_posted([], r)),
    "timed exchange, posted and polled": (True, lambda r: timed_posted([(0, s8)], r)),
}
for name, (exchange, receive) in PATHS.items():
    for nbytes in (16, 20, 24):
        if rank == 0:
            data = rng.integers(0, 256, nbytes, dtype=np.uint8)
            if "two receives" in name or "pair" in name:
                comm.Send([np.zeros(12, np.uint8), MPI.BYTE], 1, T)
            if exchange:
                comm.Sendrecv([data, MPI.BYTE], 1, T, [np.empty(64, np.uint8), MPI.BYTE], 1, T)
            else:
                comm.Send([data, MPI.BYTE], 1, T)
        elif rank == 1:
            buf = np.zeros(20, np.uint8)
            try:
                receive(buf)
                error = None
            except ck.MessageTruncated as exc:
                error = exc
            if nbytes == 20:
                assert error is None, (name, error)
            else:
                assert error is not None, f"{name}: a message of {nbytes} bytes into 20 was accepted"
                assert (error.peer, error.expected) == (0, 20), (name, vars(error))
            if nbytes == 16:
                assert error.received == 16, (name, vars(error))
                assert "expected 20 bytes from rank 0, got 16" in str(error), (name, str(error))
            if nbytes == 24:
                assert "larger than the receive buffer of 20 bytes" in str(error), (name, str(error))
        world.Barrier()

# Every bound transfer with peers is written inline into a plan, whatever the rule: an op that is not keeps
# its call shape off the shape plans, and its calls on new arrays off the fast paths (a naive broadcast's root
# and every step with several peers, on Open MPI, took the general path at every call).
for sends, recvs in (([(0, s8)], [(0, np.zeros(4, np.uint8))]), ([(0, s8), (1, s8)], []),
                     ([], [(0, np.zeros(4, np.uint8)), (1, np.zeros(4, np.uint8))]),
                     ([(0, s8), (1, s8)], [(0, np.zeros(4, np.uint8)), (1, np.zeros(4, np.uint8))])):
    assert getattr(t.bind_transfer(sends, recvs), "inline", None) is not None, (len(sends), len(recvs))

# A user's point-to-point receive keeps MPI's semantics: the message may be shorter.
c = ck.init()
data = np.random.default_rng(8).standard_normal(4)
if rank == 0:
    c.send(data, 1, tag=5)
    c.isend(data, 1, tag=6).wait()
elif rank == 1:
    for tag in (5, 6):
        out = np.full(6, -1.0)
        if tag == 5:
            _, status = c.recv(0, tag=5, out=out, return_status=True)
        else:
            request = c.irecv(0, tag=6, out=out)
            request.wait()
            status = request.status
        assert status.nbytes == 32 and np.array_equal(out[:4], data) and np.all(out[4:] == -1.0), (out, status)
world.Barrier()
print(f"paths ok {rank}", flush=True)
"""


@requires_mpi
@pytest.mark.mpi
@pytest.mark.parametrize("poll_first", ["1", "0"])  # the bound ops posted and polled, and MPI's blocking calls
def test_mpi_every_collective_receive_is_exact_and_every_truncation_is_translated(poll_first):
    result = run_mpi(2, _MPI_PATHS, timeout=300, env={"COMMKIT_MPI_POLL_FIRST": poll_first})
    assert sorted(re.findall(r"paths ok \d", result.stdout)) == ["paths ok 0", "paths ok 1"], result.stdout


_MPI_CALLS = r"""
import numpy as np
import commkit as ck
from commkit.identity import TagLayout

base = TagLayout.base
TagLayout.base = lambda self, collective, dtype=None, signature=(): base(self, collective, dtype, ())
c = ck.init()


def outcome(run):
    try:
        run()
    except ck.MessageTruncated as exc:
        return exc
    return None


# The root broadcasts n0 float64 and rank 1 expects 20: short (16), right (20) and long (24);
# blocking (three calls: the third runs the compiled plan), with a timeout, i-form, persistent.
for n0 in (16, 20, 24):
    x = np.arange(n0 if c.rank == 0 else 20, dtype=np.float64)
    forms = {
        "blocking": lambda: c.broadcast(x, root=0, out=x, algorithm="binomial"),
        "timeout": lambda: c.broadcast(x, root=0, out=x, algorithm="binomial", timeout=30),
        "i-form": lambda: c.ibroadcast(x, root=0, out=x, algorithm="binomial").wait(),
        "persistent": lambda: c.broadcast_init(x, root=0, algorithm="binomial").start().wait(),
    }
    for form, run in forms.items():
        for attempt in range(3 if form in ("blocking", "timeout") else 1):
            error = outcome(run)
            if c.rank == 0 or n0 == 20:
                assert error is None, (n0, form, error)
                continue
            assert error is not None, f"{form}: a broadcast of {n0} elements into 20 completed"
            assert (error.peer, error.expected) == (0, 160), (n0, form, vars(error))
            if n0 == 16:
                assert "expected 160 bytes from rank 0, got 128" in str(error), (form, str(error))
            assert "broadcast" in str(error), str(error)
        if c.rank == 1 and form == "blocking" and n0 == 16:
            plan = c.last_plan("broadcast")
            # The compiled plan ran: its receive checked inline, or by the op that polls its posted requests.
            polled = c.collective_transport.poll_first
            written = "tag)])" if polled else "Get_count"
            assert plan is not None and written in plan.run.source, ("the plan did not check its receive",
                                                                     plan and plan.run.source)
    c.barrier()

# allgatherv whose ranks disagree on rank 1's count: rank 0 expects 5 rows, rank 1 sends 4.
for algorithm in ("ring", "naive"):
    counts = [3, 5] if c.rank == 0 else [3, 4]
    x = np.random.default_rng(c.rank).standard_normal(counts[c.rank])
    error = outcome(lambda: c.allgatherv(x, counts, algorithm=algorithm))
    if c.rank == 0:
        assert error is not None and (error.peer, error.expected, error.received) == (1, 40, 32), vars(error)
    c.barrier()
print(f"calls ok {c.rank}", flush=True)
"""


@requires_mpi
@pytest.mark.mpi
@pytest.mark.parametrize("poll_first", ["1", "0"])
def test_mpi_collectives_whose_ranks_disagree_on_a_count_raise(poll_first):
    # No default timeout, so that blocking calls run the compiled plan that binds its receive once.
    result = run_mpi(2, _MPI_CALLS, timeout=300, env={"COMMKIT_TIMEOUT": "", "COMMKIT_MPI_POLL_FIRST": poll_first})
    assert sorted(re.findall(r"calls ok \d", result.stdout)) == ["calls ok 0", "calls ok 1"], result.stdout


# -- under mpiexec: the library's arithmetic -----------------------------------------------------

_SATURATING = r"""
import numpy as np
import commkit as ck
from commkit.ops import SUM
from commkit.transports import mpi

c = ck.init()
t = c.collective_transport
int8 = np.dtype(np.int8)
x = np.full(1000, 100, np.int8)
want = (x.astype(np.int64) * 2).astype(np.int8)  # NumPy's sum wraps: 100 + 100 = -56

from mpi4py import MPI
if "Open MPI" in MPI.Get_library_version():
    # Open MPI's own int8 sum does saturate (from 16 elements up): the probe refuses it for real.
    assert not t.native_supports("reduce", int8, SUM)
else:
    assert t.native_supports("reduce", int8, SUM)
    got = c.reduce(x, root=0, algorithm="native")  # MPICH's own reduce, asked for (the default never picks it)
    assert c.last_algorithm == "native", c.last_algorithm
    if c.rank == 0:
        assert np.array_equal(got, want)

real = mpi._library_reduce


def saturating(op_name, inbuf, inoutbuf):
    # A library whose vectorised int8 sum saturates, as Open MPI's does from 16 elements up.
    if op_name == "sum" and inbuf.dtype == np.int8 and len(inbuf) >= 16:
        inoutbuf[...] = np.clip(inbuf.astype(np.int64) + inoutbuf, -128, 127)
    else:
        real(op_name, inbuf, inoutbuf)


mpi._library_reduce = saturating
mpi._ARITHMETIC.clear()
assert not t.native_supports("reduce", int8, SUM)
if "Open MPI" not in MPI.Get_library_version():  # Open MPI's int16 sum saturates too; MPICH's wraps
    assert t.native_supports("reduce", np.dtype(np.int16), SUM)
x, want = x[:999].copy(), want[:999]  # a new shape: no plan of the call above applies
got = c.reduce(x, root=0)
assert c.last_algorithm != "native", c.last_algorithm
if c.rank == 0:
    assert np.array_equal(got, want), got[:4]
try:
    c.reduce(x, root=0, algorithm="native")
    raise SystemExit("native ran on a library whose arithmetic is not NumPy's")
except ck.AlgorithmNotApplicable:
    pass
print(f"saturating ok {c.rank}", flush=True)
"""


@requires_mpi
@pytest.mark.mpi
def test_mpi_native_is_refused_where_the_library_saturates():
    result = run_mpi(2, _SATURATING, timeout=120)
    assert sorted(re.findall(r"saturating ok \d", result.stdout)) == ["saturating ok 0", "saturating ok 1"], \
        result.stdout


_EVERY_OP = r"""
import numpy as np
import commkit as ck
from commkit.ops import OPS
from commkit.transports.mpi import _same_values

np.seterr(all="ignore")  # the operands overflow on purpose
c = ck.init()
t = c.collective_transport
passed = []
for code in "?bBhHiIlLqQfdgFDG":
    dtype = np.dtype(code)
    for name, op in OPS.items():
        if dtype.kind not in op.kinds or not t.native_supports("allreduce", dtype, op):
            continue
        passed.append((name, dtype.str))
        # Fresh operands (not the probe's), over the whole range, specials included.
        inputs = []
        for r in range(c.size):  # every rank makes every rank's operands, from the same seeds
            rng = np.random.default_rng([r, len(passed)])
            if dtype.kind == "b":
                inputs.append(rng.integers(0, 2, 300).astype(bool))
            elif dtype.kind in "iu":
                info = np.iinfo(dtype)
                inputs.append(rng.integers(info.min, info.max, 300, dtype=dtype, endpoint=True))
            else:
                real = np.dtype(f"f{dtype.itemsize // 2}") if dtype.kind == "c" else dtype
                v = (rng.standard_normal(300) * 10.0 ** rng.integers(-3, 30, 300)).astype(real)
                v[rng.integers(0, 300, 40)] = rng.choice(np.array([0.0, -0.0, np.inf, -np.inf, np.nan], real), 40)
                if dtype.kind == "c":
                    v, parts = np.empty(300, dtype), v
                    v.real, v.imag = parts, parts[::-1]
                inputs.append(v)
        want = np.empty(300, dtype)
        op.combine(want, inputs[0].astype(dtype), True, inputs[1].astype(dtype))
        got = c.allreduce(inputs[c.rank].astype(dtype), op, algorithm="native")
        assert c.last_algorithm == "native"
        assert _same_values(got, want), (name, dtype, got[:5], want[:5])
from mpi4py import MPI
saturates = "Open MPI" in MPI.Get_library_version()  # its vectorised int8 sum saturates: the probe refuses it
assert (("sum", "|i1") in passed) != saturates and ("prod", "<i8") in passed and ("sum", "<f8") in passed, passed
print(f"every op ok {c.rank} {len(passed)}", flush=True)
"""


@requires_mpi
@pytest.mark.mpi
def test_mpi_every_op_and_dtype_the_probe_passes_gives_numpys_answer():
    result = run_mpi(2, _EVERY_OP, timeout=300)
    assert len(re.findall(r"every op ok \d", result.stdout)) == 2, result.stdout


# -- waits where ranks outnumber cores -----------------------------------------------------------------------


def test_a_spinning_wait_yields_its_core_only_where_ranks_outnumber_cores(monkeypatch):
    from commkit import _wait

    yields = []
    monkeypatch.setattr(_wait.os, "sched_yield", lambda: yields.append(1))
    monkeypatch.setattr(_wait, "oversubscribed", False)
    try:
        for ranks, cores, shared in ((4, 2, True), (2, 2, False), (0, 2, False), (3, 1, True)):
            assert _wait.share_cores(ranks, cores) is shared
            yields.clear()
            backoff = _wait.Backoff(None, spin=10.0)  # spinning for the whole test
            for _ in range(5):
                assert backoff.pause()
            assert len(yields) == (5 if shared else 0), (ranks, cores)
    finally:
        _wait.share_cores(0)


@requires_mpi
def test_the_mpi_transport_reads_how_many_ranks_share_the_host(monkeypatch):
    from commkit.transports import mpi

    for env, want in (({"MPI_LOCALNRANKS": "4"}, 4), ({"OMPI_COMM_WORLD_LOCAL_SIZE": "3"}, 3), ({}, 0),
                      ({"MPI_LOCALNRANKS": "x", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, 2)):
        for name in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        assert mpi._ranks_here() == want, env


def test_a_tag_says_the_kind_of_collective_it_was_sent_for_where_the_layout_has_room():
    import numpy as np

    from commkit.identity import KINDS, kind_code

    exact, small = TagLayout(2**31 - 1), TagLayout(2**15 - 1)
    assert exact.exact and not small.exact
    for collective in KINDS:
        for seq in (0, 1, 1023, 1024, 70_000):
            tag = exact.tag(exact.base(collective, np.dtype(np.float64), (("root", 1),)), seq)
            assert exact.kind_of(tag) == kind_code(collective), (collective, seq)
            assert small.kind_of(small.tag(small.base(collective), seq)) is None
    assert exact.kind_of(exact.tag(exact.base("arena"), 5)) == 0  # control traffic: no collective's kind
