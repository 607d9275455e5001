"""The NCCL transport: CuPy arrays, one GPU per rank, moved by NCCL through ``cupy.cuda.nccl``.

Stream semantics. Every NCCL call is enqueued on the *current CuPy stream*
of the calling thread, exactly like a CuPy kernel, and returns once enqueued.
So a blocking collective returns before the GPU has run it, and its result is
ready for any later work on the same stream (CuPy kernels, ``.get()``, the
next collective); reading it on the host goes through ``.get()`` or
``cupy.cuda.get_current_stream().synchronize()``. The Reduce and Copy steps of
commkit's schedules are CuPy ufuncs and copies on that same stream, so a
schedule runs in stream order with no host synchronisation at all. Requests
follow: ``test()`` is True once the work is enqueued, and ``wait()`` returns
once the result is ready on the stream that is current when it is called (if
the work went to another stream, the current one is made to wait for it, on
the device). So a nonblocking collective's schedule is enqueued whole at its
first ``test()`` or ``wait()``. The exceptions wait on the host:
``barrier`` with ``algorithm="native"`` (a barrier is about processes), and
any wait with a timeout, since only the host can notice that the GPU made no
progress; a timeout then aborts the NCCL communicator (below), because NCCL
work cannot be cancelled any other way.

Group calls. A schedule's Transfer step is one ``groupStart()``/``groupEnd()``
around its receives and sends, so both directions of an exchange progress
together: two ranks that each sent before receiving, as separate NCCL calls on
one stream, would each wait for the other's receive forever. User ``isend`` /
``irecv`` calls are not enqueued one by one for the same reason: they are
collected and issued together, in one group, by the first ``wait()`` or
``test()`` of any of them (self-messages are copied on the device instead).

No tags, no sizes, no wildcards. NCCL matches the operations of two ranks in
the order they were issued on one communicator, which is what commkit's
schedules need (both sides derive the same sizes from the same schedule). For
user point-to-point it means: tags are accepted but not matched, a receive
must name its source (ANY_SOURCE is refused) and its buffer must be exactly
the size of the message. ``dup()`` and ``split()`` create new NCCL
communicators (a new unique id each), so contexts never mix.

Bootstrap. The NCCL unique id, made by rank 0, travels over MPI when the
process runs under ``mpiexec``, otherwise over the small TCP store of
:mod:`._store` served by rank 0 (loopback and a free port by default, a
per-job secret that every connection proves both ways, handed to the other
ranks in a rendezvous file only the user can read). The same channel carries
Python objects (``send_object``, the metadata of ``split``).

Types. Point-to-point and the data-moving native collectives move bytes, so
any dtype goes. NCCL reduces int8/uint8, int32/uint32, int64/uint64 and
float16/32/64 only: bool is reduced as uint8 (logical or = max, and = min),
complex sums as float pairs; every other (dtype, op) is not offered as
``native`` (the schedules, whose reductions are CuPy ufuncs in place, handle
it). Float max/min are not offered either: NCCL does not promise NumPy's NaN
propagation.

Shutdown. ``free()`` destroys the NCCL communicator. On an error -- an NCCL
asynchronous error, a timeout, ``abort()``, an uncaught exception -- every
NCCL communicator of the process is aborted with ``ncclCommAbort``, whose
kernels then stop waiting for peers, so a failing rank does not leave a GPU
spinning; the other ranks are told through MPI_Abort or the store.
"""

from __future__ import annotations

import functools
import socket
import time
from collections import deque

from ..errors import InvalidArgument, InvalidBuffer, PeerFailed, TransportUnavailable
from . import _cuda
from ._nccl_bootstrap import bootstrap, env_int
from ._nccl_requests import Enqueued, P2PRequest, SelfRequest
from ._nccl_session import Session, install_hooks
from ._nccl_support import NCCL_REDUCTIONS, choose_device, nccl_reduction, nccl_supports
from .._wait import Backoff
from .base import ANY_SOURCE

__all__ = ["NcclTransport", "choose_device", "nccl_reduction", "nccl_supports"]

# The pieces of this transport, by concern: which GPU and which NCCL collectives
# (._nccl_support), how the ranks meet (._nccl_bootstrap), the lifetime of one
# init("nccl") and the failure hooks (._nccl_session), the handles it returns
# (._nccl_requests). This module keeps the transport itself.

_bootstrap = bootstrap  # the name tests/test_store.py imports

cupy = None  # set by _load(): the transport imports CuPy only when one is created
nccl = None

_HEALTH_EVERY = 0.05  # seconds between NCCL async-error checks while the host waits
_REMOTE_EVERY = 0.5   # seconds between looks at the store's abort flag


def _load():
    """Import CuPy and its NCCL bindings into this module's globals, or explain what is missing."""
    global cupy, nccl
    if nccl is not None:
        return
    cp = _cuda.load_cupy("the nccl transport")
    ok, why = _cuda.nccl_status()
    if not ok:
        raise TransportUnavailable(f"the nccl transport {why}.")
    from cupy.cuda import nccl as bindings

    cupy, nccl = cp, bindings


# -- the transport ---------------------------------------------------------------------------------------------


class NcclTransport:
    """One NCCL communicator (one GPU per rank), seen as a commkit transport.

    Create the world's with :meth:`create` (``commkit.init("nccl", ...)``);
    every other one comes from :meth:`dup` or :meth:`split`.
    """

    name = "nccl"
    supports_any_source = False

    def __init__(self, comm, group, session: Session):
        self._comm = comm
        self._group = group
        self._session = session
        self.rank = group.rank
        self.size = group.size
        self.device = session.device
        self.tag_ub = group.tag_ub
        self._deferred: list = []
        self._self_sends: deque = deque()
        self._self_recvs: deque = deque()
        self._scratch = None
        self._next_health = 0.0
        self._next_remote = 0.0
        self._freed = False
        session.attach(self)

    # -- creation ------------------------------------------------------------------------------------------

    @classmethod
    def create(cls, *, device=None, **options) -> NcclTransport:
        """The world transport: bootstrap, pick this rank's GPU, create the NCCL communicator.

        Args:
            device: the GPU index (default: ``COMMKIT_DEVICE``, else the rank's index among
                the ranks of its machine).
            bootstrap: ``"mpi"`` (default under mpiexec) or ``"store"`` (otherwise).
            rank, size: this rank and the world size for the store bootstrap (default:
                ``COMMKIT_RANK``/``COMMKIT_SIZE``, else ``RANK``/``WORLD_SIZE``, else a world of one).
            store_host, store_port: the store's address (default: ``COMMKIT_STORE_HOST``/
                ``COMMKIT_STORE_PORT``, else 127.0.0.1 and a free port that rank 0 picks); rank 0 serves it.
            store_token: the store's secret, at least 16 bytes of random text (default:
                ``COMMKIT_STORE_TOKEN``, else a fresh random secret made by rank 0). Every
                connection proves it both ways with an HMAC challenge; it never crosses the wire.
            store_file: the rendezvous file through which rank 0 hands address and secret to the
                other ranks, readable by this user only (default: ``COMMKIT_STORE_FILE``, else a
                private per-user directory, named after the port or the parent process). Not used
                when every rank is given both ``store_port`` and ``store_token``.
            connect_timeout: seconds to wait for the store (default: ``COMMKIT_STORE_TIMEOUT``, else 120).

        Raises:
            TransportUnavailable: CuPy, NCCL or a GPU is missing, or the bootstrap failed (no store
                came in time, or the one found could not prove the secret).
            InvalidArgument: an option has a wrong value.
        """
        _load()
        options = dict(options)
        group, store, server = bootstrap(options)
        if options:
            raise InvalidArgument(f"unknown nccl option(s) {sorted(options)}; expected device, bootstrap, rank, size, "
                                  "store_host, store_port, store_token, store_file, connect_timeout.")
        try:
            hosts = group.allgather(socket.gethostname())
            mine = hosts[group.rank]
            local_rank = sum(1 for h in hosts[: group.rank] if h == mine)
            local_size = hosts.count(mine)
            if device is None:
                device = env_int("COMMKIT_DEVICE")
            dev = choose_device(local_rank, local_size, cupy.cuda.runtime.getDeviceCount(), device)
            cupy.cuda.Device(dev).use()
        except BaseException:
            if server is not None:
                server.close()
            if store is not None:
                store.close()
            raise
        session = Session(dev, group, store, server)
        install_hooks()
        try:
            return cls._over(group, session)
        except BaseException:
            session.close()
            raise

    @classmethod
    def _over(cls, group, session) -> NcclTransport:
        """A transport with a new NCCL communicator over ``group`` (collective over the group)."""
        uid = group.bcast(nccl.get_unique_id() if group.rank == 0 else None, 0)
        with cupy.cuda.Device(session.device):
            try:
                comm = nccl.NcclCommunicator(group.size, uid, group.rank)
            except Exception as exc:  # noqa: BLE001 - NcclError, CUDARuntimeError
                raise TransportUnavailable(
                    f"NCCL could not create a communicator of {group.size} ranks on GPU {session.device} "
                    f"(rank {group.rank}): {exc}. Two ranks on one GPU, or a peer that stopped, are the usual causes."
                ) from None
        return cls(comm, group, session)

    # -- checks --------------------------------------------------------------------------------------------------

    def _usable(self):
        comm = self._comm
        if comm is None:
            if self._session.failed is not None:
                raise PeerFailed(f"this NCCL communicator was aborted ({self._session.failed}).")
            raise PeerFailed("this NCCL communicator was freed.")
        if cupy.cuda.runtime.getDevice() != self.device:
            raise InvalidBuffer(
                f"the current CUDA device is {cupy.cuda.runtime.getDevice()} but this communicator runs on GPU "
                f"{self.device}; call it inside `with cupy.cuda.Device({self.device}):` (or make that device current)."
            )
        return comm

    def _ptr(self, buf, role: str) -> int:
        """The device pointer of a flat buffer NCCL will read or write, after checking where it lives."""
        if type(buf) is not cupy.ndarray and not isinstance(buf, cupy.ndarray):
            raise InvalidBuffer(
                f"the nccl transport moves CuPy arrays, but the {role} is a {type(buf).__module__}."
                f"{type(buf).__name__}; move it to the GPU with cupy.asarray(x) first."
            )
        if buf.data.device_id != self.device:
            raise InvalidBuffer(f"the {role} lives on GPU {buf.data.device_id} but this communicator runs on GPU "
                                f"{self.device}.")
        if not buf.flags.c_contiguous:
            raise InvalidBuffer(f"the {role} must be contiguous for NCCL.")
        return buf.data.ptr

    def _token(self):
        """Two device bytes: a zero-byte message travels as one byte, so empty messages still order the ranks."""
        if self._scratch is None:
            with cupy.cuda.Device(self.device):
                self._scratch = cupy.zeros(8, dtype=cupy.int32)  # [0:4] token bytes, [4] the barrier's int
        base = self._scratch.data.ptr
        return base, base + 1

    # -- health, waiting and failure ------------------------------------------------------------------------------

    def check_health(self) -> None:
        """Raise PeerFailed (after aborting) on an NCCL asynchronous error or a peer's abort signal.

        Looks at most every 50 ms (the store's abort flag every 0.5 s): cheap enough to call at every poll.
        """
        now = time.monotonic()
        if now < self._next_health:
            return
        self._next_health = now + _HEALTH_EVERY
        comm = self._comm
        if comm is None:
            self._usable()
            return
        try:
            comm.check_async_error()
        except Exception as exc:  # noqa: BLE001 - cupy's NcclError
            self._fail(f"NCCL reported an asynchronous error on rank {self.rank}: {exc}")
        if now >= self._next_remote:
            self._next_remote = now + _REMOTE_EVERY
            reason = self._group.aborted()
            if reason is not None:
                self._fail(f"another rank aborted: {reason}")

    def _fail(self, reason: str):
        self._session.abort_all(reason)
        raise PeerFailed(f"{reason}. Every NCCL communicator of this process was aborted, so no GPU keeps waiting.")

    def wait_event(self, event, timeout, peers) -> list:
        """Wait on the host until the CUDA ``event`` has happened: ``[]``, or on timeout ``peers`` after aborting.

        NCCL work cannot be cancelled, so a timeout aborts every NCCL communicator
        of this process. Raises PeerFailed on an NCCL error or a peer's abort.
        """
        if event.done:
            return []
        backoff = Backoff(timeout)
        while not event.done:
            self.check_health()
            if not backoff.pause():
                self._session.abort_all(f"rank {self.rank} timed out after {timeout:g} s waiting for rank(s) "
                                        f"{', '.join(map(str, peers))}")
                return list(peers)
        return []

    def _record(self, stream):
        event = cupy.cuda.Event(block=False, disable_timing=True)
        event.record(stream)
        return event

    def abort_communicator(self) -> None:
        """``ncclCommAbort`` this communicator alone, at once and telling no one (its session aborts them all)."""
        comm, self._comm = self._comm, None
        if comm is not None:
            try:
                comm.abort()
            except Exception:  # noqa: BLE001 - already broken: nothing more to release
                pass

    def synchronize(self) -> None:
        """Block the host until the current stream's work (this transport's included) is done."""
        self._usable()
        cupy.cuda.get_current_stream().synchronize()

    # -- schedule steps ------------------------------------------------------------------------------------------------

    def _enqueue(self, comm, sends, recvs, stream: int) -> None:
        """One NCCL group with every receive and send of a step (pointers checked before the group opens)."""
        ops = []
        for peer, buf in recvs:
            n = buf.nbytes
            ops.append((False, peer, self._ptr(buf, "receive buffer") if n else None, n))
        for peer, buf in sends:
            n = buf.nbytes
            ops.append((True, peer, self._ptr(buf, "send buffer") if n else None, n))
        if ops:
            self._group_call(comm, ops, stream)

    def _group_call(self, comm, ops, stream: int) -> None:
        """Issue ``ops``, ``(is_send, peer, pointer or None, nbytes)``, as one NCCL group on ``stream``."""
        send_token, recv_token = self._token()
        uint8 = nccl.NCCL_UINT8
        nccl.groupStart()
        try:
            for is_send, peer, ptr, n in ops:
                if ptr is None:  # an empty message still travels, as one byte, so it orders the two ranks
                    ptr, n = (send_token if is_send else recv_token), 1
                if is_send:
                    comm.send(ptr, n, uint8, peer, stream)
                else:
                    comm.recv(ptr, n, uint8, peer, stream)
        finally:
            nccl.groupEnd()

    def post(self, sends, recvs, tag: int) -> Enqueued:
        """Enqueue one Transfer step on the current stream; the handle completes for the stream at once."""
        comm = self._usable()
        stream = cupy.cuda.get_current_stream()
        self._enqueue(comm, sends, recvs, stream.ptr)
        return Enqueued(self, self._record(stream), stream.ptr, [p for p, _ in recvs] + [p for p, _ in sends])

    def transfer(self, sends, recvs, tag: int, timeout) -> list:
        """Enqueue one Transfer step; with a timeout, also wait on the host until the GPU has done it."""
        comm = self._usable()
        stream = cupy.cuda.get_current_stream()
        self._enqueue(comm, sends, recvs, stream.ptr)
        if timeout is None:
            return []
        return self.wait_event(self._record(stream), timeout, [p for p, _ in recvs] + [p for p, _ in sends])

    # -- user point to point -------------------------------------------------------------------------------------------

    def isend(self, buf, dest: int, tag: int):
        """Post a send of ``buf``'s bytes to ``dest`` (issued at the first wait/test of any pending request)."""
        self._usable()
        ptr = self._ptr(buf, "send buffer") if buf.nbytes else None
        if dest == self.rank:
            return self._send_self(buf, tag)
        request = P2PRequest(self, dest, tag, buf.nbytes, False)
        self._deferred.append((True, dest, ptr, buf.nbytes, cupy.cuda.get_current_stream(), request))
        return request

    def irecv(self, buf, source: int, tag: int):
        """Post a receive into ``buf`` from ``source``; the message must have exactly ``buf.nbytes`` bytes."""
        self._usable()
        if source == ANY_SOURCE:
            raise InvalidArgument(
                "the nccl transport cannot receive from ANY_SOURCE: NCCL matches every receive to one named rank. "
                "Name the source, or move this message with the mpi transport."
            )
        ptr = self._ptr(buf, "receive buffer") if buf.nbytes else None
        if source == self.rank:
            return self._recv_self(buf, tag)
        request = P2PRequest(self, source, tag, buf.nbytes, True)
        self._deferred.append((False, source, ptr, buf.nbytes, cupy.cuda.get_current_stream(), request))
        return request

    def flush(self) -> None:
        """Issue every deferred user send and receive in one NCCL group on the current stream.

        Requests posted while another stream was current are ordered after that
        stream's work (an event), so a send never reads a buffer its producer has
        not finished writing.
        """
        if not self._deferred:
            return
        comm = self._usable()
        deferred, self._deferred = self._deferred, []
        stream = cupy.cuda.get_current_stream()
        for other in {entry[4].ptr: entry[4] for entry in deferred if entry[4].ptr != stream.ptr}.values():
            stream.wait_event(self._record(other))
        self._group_call(comm, [entry[:4] for entry in deferred], stream.ptr)
        event = self._record(stream)
        for *_, request in deferred:
            request.event = event
            request.stream = stream.ptr

    def _send_self(self, buf, tag):
        payload = buf.copy()  # on the stream: later changes to buf cannot reach the receiver
        if self._self_recvs:
            self._deliver_self(self._self_recvs.popleft(), payload)
        else:
            self._self_sends.append(payload)
        return SelfRequest(self.rank, tag, False)

    def _recv_self(self, buf, tag):
        request = SelfRequest(self.rank, tag, True)
        if self._self_sends:
            self._deliver_self((buf, request), self._self_sends.popleft())
        else:
            self._self_recvs.append((buf, request))
        return request

    def _deliver_self(self, receive, payload) -> None:
        buf, request = receive
        n = payload.nbytes
        if n > buf.nbytes:
            raise InvalidBuffer(f"message of {n} bytes from rank {self.rank} (itself) does not fit the receive "
                                f"buffer of {buf.nbytes} bytes.")
        if n:
            buf.view(cupy.uint8)[:n] = payload.view(cupy.uint8)
        request.nbytes = n
        request.done = True

    def send_object(self, obj, dest: int, tag: int) -> None:
        """Send a picklable object over the bootstrap channel (MPI or the store), not through the GPU."""
        self._group.send_object(obj, dest, tag)

    def isend_object(self, obj, dest: int, tag: int):
        """:meth:`send_object` without waiting for the receiver: a request with ``wait()``, or None when sent."""
        isend = getattr(self._group, "isend_object", None)
        if isend is not None:
            return isend(obj, dest, tag)
        self._group.send_object(obj, dest, tag)  # the store never waits for the receiver
        return None

    def recv_object(self, source: int, tag: int, timeout, object_bit: int = 0):
        """Receive an object from the bootstrap channel: ``(obj, Status)``, or None on timeout.

        ``object_bit`` is not needed here: arrays travel through the GPU, never on this channel.
        """
        return self._group.recv_object(source, tag, timeout)

    def probe(self, source: int, tag: int):
        """Objects only: whether a matching object message has arrived (array messages cannot be probed)."""
        return self._group.probe(source, tag)

    # -- communicators -----------------------------------------------------------------------------------------------------

    def dup(self) -> NcclTransport:
        """A new NCCL communicator (new unique id) over the same ranks (collective)."""
        self._usable()
        return self._over(self._group.dup(), self._session)

    def split(self, color, key: int, timeout=None):
        """A new NCCL communicator per ``color``, ranks ordered by ``(key, rank)``; None for ``color=None``."""
        self._usable()
        group = self._group.split(color, key, timeout)
        return None if group is None else self._over(group, self._session)

    def free(self) -> None:
        """Destroy the NCCL communicator (after a failure it was aborted instead); release the bootstrap."""
        if self._freed:
            return
        self._freed = True
        comm, self._comm = self._comm, None
        if comm is not None:
            with cupy.cuda.Device(self.device):
                comm.destroy()
        self._group.free()
        self._session.detach(self)

    def abort(self, exc: BaseException) -> None:
        """Abort every NCCL communicator of this process and tell the other ranks the job cannot continue."""
        reason = f"rank {self.rank} called abort ({type(exc).__name__}: {exc})"
        self._session.abort_all(reason)
        self._group.signal_abort(reason)

    # -- native collectives -------------------------------------------------------------------------------------------------

    def native_supports(self, collective: str, dtype, op) -> bool:
        """Whether NCCL runs ``collective`` on ``dtype`` with ``op`` (see :func:`nccl_supports`)."""
        return nccl_supports(collective, dtype, op)

    def native(self, collective: str, sendbuf, recvbuf, *, op=None, root: int = 0, counts=None,
               inplace: bool = False, nonblocking: bool = False):
        """Run NCCL's own collective (or grouped send/recv) on flat CuPy arrays, on the current stream.

        Returns a pending handle if ``nonblocking``, else None. Only ``barrier``
        waits on the host; everything else is ordered on the stream.
        """
        comm = self._usable()
        stream = cupy.cuda.get_current_stream()
        s = stream.ptr
        if collective == "barrier":
            self._token()
            flag = self._scratch.data.ptr + 4  # an int32 that stays 0: the sum of zeros
            comm.allReduce(flag, flag, 1, nccl.NCCL_INT32, nccl.NCCL_SUM, s)
            event = self._record(stream)
            if nonblocking:
                return Enqueued(self, event, s, [-1], host=True)
            self.wait_event(event, None, [-1])
            return None
        if collective in NCCL_REDUCTIONS:
            self._native_reduction(comm, collective, sendbuf, recvbuf, op, root, counts, inplace, s)
        elif collective == "broadcast":
            ptr = self._ptr(recvbuf, "broadcast buffer")
            unit, count = _unit(recvbuf.nbytes, ptr)
            if count:
                comm.broadcast(ptr, ptr, count, unit, root, s)
        elif collective == "allgather":
            sptr, rptr = self._ptr(sendbuf, "send buffer"), self._ptr(recvbuf, "receive buffer")
            unit, count = _unit(sendbuf.nbytes, sptr, rptr)
            if count:
                comm.allGather(sptr, rptr, count, unit, s)
        elif collective in ("alltoall", "gather", "scatter"):
            self._native_pairwise(comm, collective, sendbuf, recvbuf, root, s)
        else:
            raise ValueError(f"NCCL has no native {collective}")
        if nonblocking:
            return Enqueued(self, self._record(stream), s, [-1])
        return None

    def _native_reduction(self, comm, collective, sendbuf, recvbuf, op, root, counts, inplace, s) -> None:
        ntype, nop, per = _reduction_args(sendbuf.dtype, op.name)
        sptr = self._ptr(sendbuf, "send buffer")
        if collective == "allreduce":
            rptr = self._ptr(recvbuf, "receive buffer")
            if sendbuf.size:
                comm.allReduce(rptr if inplace else sptr, rptr, sendbuf.size * per, ntype, nop, s)
        elif collective == "reduce":
            rptr = self._ptr(recvbuf, "receive buffer") if recvbuf is not None else sptr
            if sendbuf.size:
                comm.reduce(rptr if inplace else sptr, rptr, sendbuf.size * per, ntype, nop, root, s)
        else:  # reduce_scatter: counts[r] elements for rank r
            rptr = self._ptr(recvbuf, "receive buffer")
            counts = [int(c) for c in counts]
            if len(set(counts)) == 1:
                if counts[0]:
                    comm.reduceScatter(sptr, rptr, counts[0] * per, ntype, nop, s)
                return
            # Uneven blocks: NCCL's reduceScatter wants equal ones, so reduce each block to its rank,
            # all in one group (NCCL runs grouped collectives together).
            item = sendbuf.dtype.itemsize
            nccl.groupStart()
            try:
                offset = 0
                for r, c in enumerate(counts):
                    if c:
                        block = sptr + offset * item
                        comm.reduce(block, rptr if r == self.rank else block, c * per, ntype, nop, r, s)
                    offset += c
            finally:
                nccl.groupEnd()

    def _native_pairwise(self, comm, collective, sendbuf, recvbuf, root, s) -> None:
        """alltoall, gather and scatter as grouped sends and receives (NCCL's own recipe for them)."""
        p, me = self.size, self.rank
        if collective == "alltoall":
            block = sendbuf.nbytes // p
            sends = [(r, sendbuf, r * block) for r in range(p) if r != me]
            recvs = [(r, recvbuf, r * block) for r in range(p) if r != me]
            local = (recvbuf, me * block, sendbuf, me * block)
        elif collective == "gather":
            block = sendbuf.nbytes
            sends = [(root, sendbuf, 0)] if me != root else []
            recvs = [(r, recvbuf, r * block) for r in range(p) if r != me] if me == root else []
            local = (recvbuf, me * block, sendbuf, 0) if me == root else None
        else:  # scatter
            block = recvbuf.nbytes
            sends = [(r, sendbuf, r * block) for r in range(p) if r != me] if me == root else []
            recvs = [(root, recvbuf, 0)] if me != root else []
            local = (recvbuf, 0, sendbuf, me * block) if me == root else None
        if block == 0:
            return
        if local is not None:
            dst, dlo, src, slo = local
            dst.view(cupy.uint8)[dlo: dlo + block] = src.view(cupy.uint8)[slo: slo + block]
        ptrs = {}
        for _, buf, _ in sends + recvs:
            if id(buf) not in ptrs:
                ptrs[id(buf)] = self._ptr(buf, "buffer")
        uint8 = nccl.NCCL_UINT8
        nccl.groupStart()
        try:
            for r, buf, offset in recvs:
                comm.recv(ptrs[id(buf)] + offset, block, uint8, r, s)
            for r, buf, offset in sends:
                comm.send(ptrs[id(buf)] + offset, block, uint8, r, s)
        finally:
            nccl.groupEnd()


@functools.lru_cache(maxsize=256)
def _reduction_args(dtype, op: str):
    """CuPy's constants for NCCL's type and op, and NCCL elements per array element (2 for complex)."""
    how = nccl_reduction(dtype, op)
    assert how is not None, "the selector offers native only where native_supports said yes"
    type_name, op_name, view = how
    return (getattr(nccl, "NCCL_" + type_name.upper()), getattr(nccl, "NCCL_" + op_name.upper()),
            dtype.itemsize // view.itemsize)


def _unit(nbytes: int, *ptrs):
    """The widest NCCL type (8, 4 or 1 bytes) that divides ``nbytes`` and aligns every pointer: ``(type, count)``.

    Moving bytes in wider units keeps counts small (some CuPy versions pass
    broadcast's count as a C int).
    """
    for size, name in ((8, "NCCL_UINT64"), (4, "NCCL_UINT32")):
        if nbytes % size == 0 and all(ptr % size == 0 for ptr in ptrs):
            return getattr(nccl, name), nbytes // size
    return nccl.NCCL_UINT8, nbytes
