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

import atexit
import functools
import os
import socket
import sys
import threading
import time
from collections import deque

import numpy as np

from ..errors import InvalidArgument, InvalidBuffer, PeerFailed, TransportUnavailable
from . import _cuda
from .base import ANY_SOURCE, Status

__all__ = ["NcclTransport", "choose_device", "nccl_reduction", "nccl_supports"]

cupy = None  # set by _load(): the transport imports CuPy only when one is created
nccl = None

_SPIN_SECONDS = 2e-4
_MAX_SLEEP = 1e-3
_HEALTH_EVERY = 0.05  # seconds between NCCL async-error checks while the host waits
_REMOTE_EVERY = 0.5   # seconds between looks at the store's abort flag

# NCCL's reduction types, by NumPy (kind, itemsize).
_NCCL_TYPES = {("i", 1): "int8", ("u", 1): "uint8", ("i", 4): "int32", ("u", 4): "uint32",
               ("i", 8): "int64", ("u", 8): "uint64", ("f", 2): "float16", ("f", 4): "float32",
               ("f", 8): "float64"}
# bool as uint8 0/1: "any true" is the maximum, "all true" the minimum.
_BOOL_OPS = {"sum": "max", "lor": "max", "max": "max", "bor": "max",
             "prod": "min", "land": "min", "min": "min", "band": "min"}
_DATA_MOVING = frozenset({"broadcast", "allgather", "gather", "scatter", "alltoall"})
_NCCL_REDUCTIONS = frozenset({"allreduce", "reduce", "reduce_scatter"})  # the reductions NCCL runs itself


def nccl_reduction(dtype, op: str):
    """How NCCL reduces ``dtype`` with commkit's builtin op ``op``, or None where it cannot.

    Returns ``(nccl_type, nccl_op, view)``: NCCL's names for the element type
    and the op (``"float32"``, ``"sum"``) and the NumPy dtype the buffers are
    viewed as (uint8 for bool, the float part for complex).
    """
    dtype = np.dtype(dtype)
    if dtype.byteorder not in "=|":
        return None
    if dtype.kind == "b":
        nop = _BOOL_OPS.get(op)
        return None if nop is None else ("uint8", nop, np.dtype(np.uint8))
    if dtype.kind == "c":
        part = _NCCL_TYPES.get(("f", dtype.itemsize // 2))
        if op != "sum" or part is None:
            return None
        return part, "sum", np.dtype(f"f{dtype.itemsize // 2}")
    name = _NCCL_TYPES.get((dtype.kind, dtype.itemsize))
    if name is None:
        return None
    if op in ("sum", "prod") or (op in ("max", "min") and dtype.kind in "iu"):
        return name, op, dtype
    return None


def nccl_supports(collective: str, dtype, op) -> bool:
    """Whether NCCL (directly or as grouped send/recv) runs ``collective`` on ``dtype`` with ``op``."""
    if collective == "barrier":
        return True
    if collective in _DATA_MOVING:
        return op is None
    if collective not in _NCCL_REDUCTIONS or op is None:
        return False  # scan, exscan: NCCL has none
    from ..ops import OPS

    builtin = OPS.get(op.name)
    if builtin is None or op.fn is not builtin.fn:
        return False  # a user function: only commkit's schedules can apply it
    return nccl_reduction(dtype, op.name) is not None


def choose_device(local_rank: int, local_size: int, device_count: int, requested=None) -> int:
    """The GPU for this rank: ``requested`` if given, else the rank's index among the ranks of its machine.

    A process that sees exactly one GPU uses it (launchers that give each rank
    its own ``CUDA_VISIBLE_DEVICES`` do that).

    Raises:
        TransportUnavailable: no GPU, or more ranks on this machine than GPUs.
        InvalidArgument: ``requested`` is not a visible device.
    """
    if device_count < 1:
        raise TransportUnavailable("the nccl transport needs a CUDA GPU, and none is visible to this process "
                                   f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}).")
    if requested is not None:
        if isinstance(requested, bool) or not isinstance(requested, (int, np.integer)) or not 0 <= requested < device_count:
            raise InvalidArgument(f"device must be an int in range(0, {device_count}) (the visible GPUs), "
                                  f"got {requested!r}.")
        return int(requested)
    if device_count == 1:
        return 0
    if local_size > device_count:
        raise TransportUnavailable(
            f"{local_size} ranks run on this machine but only {device_count} GPUs are visible, and NCCL needs one "
            f"GPU per rank. Start at most {device_count} ranks per machine, pass device= explicitly, or use the "
            "threads world (commkit.run_local) to run several ranks on one GPU."
        )
    return local_rank


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


def _env_int(name):
    text = os.environ.get(name)
    if text in (None, ""):
        return None
    try:
        return int(text)
    except ValueError:
        raise InvalidArgument(f"{name} must be an integer, got {text!r}.") from None


def _under_mpiexec() -> bool:
    from .._world import _under_mpiexec as under

    return under()


# -- what the transports of one init() share -------------------------------------------------------------


class _Session:
    """The device, the bootstrap store and the live NCCL communicators of one ``init("nccl")``."""

    def __init__(self, device: int, group, store=None, server=None):
        self.device = device
        self.group = group  # the world's bootstrap group: how to tell the other ranks about a failure
        self.store = store
        self.server = server
        self.live: set = set()
        self.failed: str | None = None
        self.lock = threading.Lock()
        _SESSIONS.add(self)

    def attach(self, transport) -> None:
        with self.lock:
            self.live.add(transport)

    def detach(self, transport) -> None:
        with self.lock:
            self.live.discard(transport)
            last = not self.live
        if last:
            self.close()

    def abort_all(self, reason: str) -> None:
        """``ncclCommAbort`` every communicator of this session (their kernels stop waiting for peers)."""
        with self.lock:
            if self.failed is None:
                self.failed = reason
            live = list(self.live)
        for transport in live:
            transport._abort_comm()

    def close(self) -> None:
        """Release the bootstrap store: rank 0 serves until every other rank has disconnected (bounded)."""
        _SESSIONS.discard(self)
        store, server, self.store, self.server = self.store, self.server, None, None
        if store is not None:
            store.close()
        if server is not None:
            server.wait_for_disconnects(0, float(os.environ.get("COMMKIT_STORE_EXIT_TIMEOUT", "300")))
            server.close()

    def shutdown(self) -> None:
        """At exit: destroy (or, after a failure, abort) what is still open, then close the store."""
        with self.lock:
            live = list(self.live)
        for transport in live:
            transport.free()
        self.close()


_SESSIONS: set = set()


def _at_exit() -> None:
    for session in list(_SESSIONS):
        session.shutdown()


def _install_hooks() -> None:
    """Abort NCCL before an uncaught exception ends this process, and clean up at exit (once)."""
    if getattr(sys.excepthook, "_commkit_nccl", False):
        return
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        reason = f"an uncaught {exc_type.__name__} on this rank: {exc}"
        sessions = list(_SESSIONS)
        for session in sessions:
            session.abort_all(reason)  # local and quick: no kernel of this process waits on a peer any more
        previous(exc_type, exc, tb)  # under mpiexec this is commkit's MPI hook, which ends the job
        for session in sessions:
            if not isinstance(session.group, _MPIGroup):
                session.group.signal_abort(reason)

    hook._commkit_nccl = True
    sys.excepthook = hook
    atexit.register(_at_exit)


# -- bootstrap over MPI ------------------------------------------------------------------------------------


class _MPIGroup:
    """The bootstrap channel of a communicator under mpiexec: an MPI communicator of its own."""

    def __init__(self, comm, owned: bool):
        from .mpi import MPITransport

        self.comm = comm
        self.owned = owned
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self._objects = MPITransport(comm)
        self.tag_ub = self._objects.tag_ub

    def bcast(self, obj, root: int = 0, timeout=None):
        return self.comm.bcast(obj, root)

    def allgather(self, obj, timeout=None) -> list:
        return self.comm.allgather(obj)

    def barrier(self, timeout=None) -> None:
        self.comm.Barrier()

    def send_object(self, obj, dest: int, tag: int) -> None:
        self._objects.send_object(obj, dest, tag)

    def recv_object(self, source: int, tag: int, timeout):
        return self._objects.recv_object(source, tag, timeout)

    def probe(self, source: int, tag: int):
        return self._objects.probe(source, tag)

    def dup(self) -> "_MPIGroup":
        return _MPIGroup(self.comm.Dup(), True)

    def split(self, color, key: int, timeout=None):
        from .mpi import MPI

        comm = self.comm.Split(MPI.UNDEFINED if color is None else color, key)
        return None if comm == MPI.COMM_NULL else _MPIGroup(comm, True)

    def free(self) -> None:
        from .mpi import MPI

        if self.owned and not MPI.Is_finalized() and self.comm != MPI.COMM_NULL:
            self.comm.Free()

    def signal_abort(self, reason: str) -> None:  # pragma: no cover - ends the job
        from .mpi import MPI

        sys.stderr.write(f"commkit: {reason}; aborting the MPI job.\n")
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)

    def aborted(self):
        return None  # MPI_Abort ends every process: there is nothing left to notice


def _bootstrap(options):
    """This rank's bootstrap group and session parts: ``(group, store, server)``.

    Under mpiexec (or ``bootstrap="mpi"``) the group is a dup of MPI_COMM_WORLD.
    Otherwise rank 0 starts a :class:`._store.StoreServer` with a secret (the
    user's ``store_token``, else a fresh random one) on the named port or a
    free one, and every rank connects to it with a :class:`._store.StoreClient`
    that proves the secret. Unless the user gave every rank both the port and
    the secret, rank 0 publishes address and secret in a rendezvous file only
    this user can read (``store_file``, else :func:`._store.rendezvous_path`),
    which the other ranks wait for.

    Raises:
        InvalidArgument: an option or environment variable has a wrong value.
        TransportUnavailable: the store cannot be started, found or trusted.
    """
    from . import _store

    how = options.pop("bootstrap", None) or os.environ.get("COMMKIT_NCCL_BOOTSTRAP") or None
    rank = options.pop("rank", None)
    size = options.pop("size", None)
    host, port = _store.store_address(options.pop("store_host", None), options.pop("store_port", None))
    token = options.pop("store_token", None) or os.environ.get("COMMKIT_STORE_TOKEN") or None
    path = options.pop("store_file", None) or os.environ.get("COMMKIT_STORE_FILE") or None
    connect_timeout = options.pop("connect_timeout", None)
    if connect_timeout is None:
        text = os.environ.get("COMMKIT_STORE_TIMEOUT") or "120"
        try:
            connect_timeout = float(text)
        except ValueError:
            raise InvalidArgument(f"COMMKIT_STORE_TIMEOUT must be a number of seconds, got {text!r}.") from None
    if (isinstance(connect_timeout, bool) or not isinstance(connect_timeout, (int, float))
            or not 0 < connect_timeout < float("inf")):
        raise InvalidArgument(f"connect_timeout (COMMKIT_STORE_TIMEOUT) must be a finite positive number of seconds, "
                              f"got {connect_timeout!r}.")
    if how is None:
        how = "mpi" if _under_mpiexec() and rank is None and size is None else "store"
    if how == "mpi":
        from .mpi import MPI, install_abort_on_exception

        install_abort_on_exception()
        return _MPIGroup(MPI.COMM_WORLD.Dup(), True), None, None
    if how != "store":
        raise InvalidArgument(f"bootstrap must be 'mpi' or 'store', got {how!r}.")
    if rank is None:
        rank = _env_int("COMMKIT_RANK")
        rank = _env_int("RANK") if rank is None else rank
    if size is None:
        size = _env_int("COMMKIT_SIZE")
        size = _env_int("WORLD_SIZE") if size is None else size
    size = 1 if size is None else size
    rank = 0 if rank is None else rank
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise InvalidArgument(f"size must be a positive int, got {size!r}.")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
        raise InvalidArgument(f"rank must be an int in range(0, {size}), got {rank!r}.")
    if size == 1:
        memory = _store.MemoryStore()
        return _store.StoreGroup(memory, "w", 0, 1), memory, None
    # Port and secret both given to every rank: nothing to publish. Otherwise the rendezvous file carries them.
    direct = bool(port) and token is not None and path is None
    if not direct and path is None:
        path = _store.rendezvous_path(port)
    if rank == 0:
        server = _store.StoreServer(host, port, token)
        try:
            if not direct:
                server.publish(path, ranks=size)
            client = _store.StoreClient(host, server.port, token=server.token, connect_timeout=connect_timeout)
        except BaseException:
            server.close()
            raise
        return _store.StoreGroup(client, "w", rank, size), client, server
    if direct:
        client = _store.StoreClient(host, port, token=token, connect_timeout=connect_timeout)
    else:
        client = _store.connect_rendezvous(path, size=size, token=token, connect_timeout=connect_timeout)
    return _store.StoreGroup(client, "w", rank, size), client, None


# -- requests ------------------------------------------------------------------------------------------------


def _follow(event, stream_ptr: int) -> None:
    """Make the current stream wait for ``event`` if the work was enqueued on another stream."""
    current = cupy.cuda.get_current_stream()
    if current.ptr != stream_ptr:
        current.wait_event(event)


class _Enqueued:
    """Work enqueued on a stream: complete for that stream at once; ``wait(timeout)`` waits on the host.

    ``wait()`` makes the result ready on the stream that is current when it is
    called: if that is not the stream the work went to, the current stream is
    made to wait for it (a device-side wait, the host does not block).
    """

    __slots__ = ("transport", "event", "stream", "peers", "host")

    def __init__(self, transport, event, stream: int, peers, host: bool = False):
        self.transport = transport
        self.event = event
        self.stream = stream
        self.peers = peers
        self.host = host

    def test(self) -> bool:
        if not self.host:
            return True
        if self.event.done:
            return True
        self.transport._check_health()
        return False

    def wait(self, timeout) -> list:
        if timeout is None and not self.host:
            _follow(self.event, self.stream)
            return []
        return self.transport._wait_event(self.event, timeout, self.peers)


class _P2PRequest:
    """A user ``isend``/``irecv``: issued, with the others waiting, at its first ``test()`` or ``wait()``."""

    __slots__ = ("transport", "peer", "tag", "nbytes", "event", "stream", "recv")

    def __init__(self, transport, peer, tag, nbytes, recv):
        self.transport = transport
        self.peer = peer
        self.tag = tag
        self.nbytes = nbytes
        self.recv = recv
        self.event = None
        self.stream = None

    def test(self) -> bool:
        self.transport._flush()
        return True

    def wait(self, timeout) -> list:
        self.transport._flush()
        if timeout is None:
            _follow(self.event, self.stream)
            return []
        return self.transport._wait_event(self.event, timeout, [self.peer])

    @property
    def status(self):
        return Status(self.peer, self.tag, self.nbytes) if self.recv else None


class _SelfRequest:
    """A message from a rank to itself: a device copy, matched in order of posting."""

    __slots__ = ("rank", "tag", "nbytes", "done", "recv")

    def __init__(self, rank, tag, recv):
        self.rank = rank
        self.tag = tag
        self.recv = recv
        self.nbytes = 0
        self.done = not recv

    def test(self) -> bool:
        return self.done

    def wait(self, timeout) -> list:
        deadline = None if timeout is None else time.monotonic() + timeout
        sleep = 1e-5
        while not self.done:  # only another thread of this rank can post the matching send
            if deadline is not None and time.monotonic() >= deadline:
                return [self.rank]
            time.sleep(sleep)
            sleep = min(sleep * 2, _MAX_SLEEP)
        return []

    @property
    def status(self):
        return Status(self.rank, self.tag, self.nbytes) if self.recv else None


# -- the transport ---------------------------------------------------------------------------------------------


class NcclTransport:
    """One NCCL communicator (one GPU per rank), seen as a commkit transport.

    Create the world's with :meth:`create` (``commkit.init("nccl", ...)``);
    every other one comes from :meth:`dup` or :meth:`split`.
    """

    name = "nccl"
    supports_any_source = False

    def __init__(self, comm, group, session: _Session):
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
    def create(cls, *, device=None, **options) -> "NcclTransport":
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
        group, store, server = _bootstrap(options)
        if options:
            raise InvalidArgument(f"unknown nccl option(s) {sorted(options)}; expected device, bootstrap, rank, size, "
                                  "store_host, store_port, store_token, store_file, connect_timeout.")
        try:
            hosts = group.allgather(socket.gethostname())
            mine = hosts[group.rank]
            local_rank = sum(1 for h in hosts[: group.rank] if h == mine)
            local_size = hosts.count(mine)
            if device is None:
                device = _env_int("COMMKIT_DEVICE")
            dev = choose_device(local_rank, local_size, cupy.cuda.runtime.getDeviceCount(), device)
            cupy.cuda.Device(dev).use()
        except BaseException:
            if server is not None:
                server.close()
            if store is not None:
                store.close()
            raise
        session = _Session(dev, group, store, server)
        _install_hooks()
        try:
            return cls._over(group, session)
        except BaseException:
            session.close()
            raise

    @classmethod
    def _over(cls, group, session) -> "NcclTransport":
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

    def _check_health(self) -> None:
        """Raise PeerFailed (after aborting) on an NCCL asynchronous error or a peer's abort signal."""
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

    def _wait_event(self, event, timeout, peers) -> list:
        """Wait on the host until ``event`` has happened; on timeout abort and return ``peers``."""
        if event.done:
            return []
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        sleep = 1e-5
        while not event.done:
            self._check_health()
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                self._session.abort_all(f"rank {self.rank} timed out after {timeout:g} s waiting for rank(s) "
                                        f"{', '.join(map(str, peers))}")
                return list(peers)
            if now - start > _SPIN_SECONDS:
                time.sleep(sleep)
                sleep = min(sleep * 2, _MAX_SLEEP)
        return []

    def _record(self, stream):
        event = cupy.cuda.Event(block=False, disable_timing=True)
        event.record(stream)
        return event

    def _abort_comm(self) -> None:
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
        if not ops:
            return
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

    def post(self, sends, recvs, tag: int) -> _Enqueued:
        """Enqueue one Transfer step on the current stream; the handle completes for the stream at once."""
        comm = self._usable()
        stream = cupy.cuda.get_current_stream()
        self._enqueue(comm, sends, recvs, stream.ptr)
        return _Enqueued(self, self._record(stream), stream.ptr, [p for p, _ in recvs] + [p for p, _ in sends])

    def transfer(self, sends, recvs, tag: int, timeout) -> list:
        """Enqueue one Transfer step; with a timeout, also wait on the host until the GPU has done it."""
        comm = self._usable()
        stream = cupy.cuda.get_current_stream()
        self._enqueue(comm, sends, recvs, stream.ptr)
        if timeout is None:
            return []
        return self._wait_event(self._record(stream), timeout, [p for p, _ in recvs] + [p for p, _ in sends])

    # -- user point to point -------------------------------------------------------------------------------------------

    def isend(self, buf, dest: int, tag: int):
        """Post a send of ``buf``'s bytes to ``dest`` (issued at the first wait/test of any pending request)."""
        self._usable()
        ptr = self._ptr(buf, "send buffer") if buf.nbytes else None
        if dest == self.rank:
            return self._send_self(buf, tag)
        request = _P2PRequest(self, dest, tag, buf.nbytes, False)
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
        request = _P2PRequest(self, source, tag, buf.nbytes, True)
        self._deferred.append((False, source, ptr, buf.nbytes, cupy.cuda.get_current_stream(), request))
        return request

    def _flush(self) -> None:
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
        send_token, recv_token = self._token()
        uint8 = nccl.NCCL_UINT8
        nccl.groupStart()
        try:
            for is_send, peer, ptr, n, _, _ in deferred:
                if ptr is None:
                    ptr, n = (send_token if is_send else recv_token), 1
                (comm.send if is_send else comm.recv)(ptr, n, uint8, peer, stream.ptr)
        finally:
            nccl.groupEnd()
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
        return _SelfRequest(self.rank, tag, False)

    def _recv_self(self, buf, tag):
        request = _SelfRequest(self.rank, tag, True)
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

    def recv_object(self, source: int, tag: int, timeout, object_bit: int = 0):
        """Receive an object from the bootstrap channel: ``(obj, Status)``, or None on timeout.

        ``object_bit`` is not needed here: arrays travel through the GPU, never on this channel.
        """
        return self._group.recv_object(source, tag, timeout)

    def probe(self, source: int, tag: int):
        """Objects only: whether a matching object message has arrived (array messages cannot be probed)."""
        return self._group.probe(source, tag)

    # -- communicators -----------------------------------------------------------------------------------------------------

    def dup(self) -> "NcclTransport":
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
                return _Enqueued(self, event, s, [-1], host=True)
            self._wait_event(event, None, [-1])
            return None
        if collective in _NCCL_REDUCTIONS:
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
            return _Enqueued(self, self._record(stream), s, [-1])
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
