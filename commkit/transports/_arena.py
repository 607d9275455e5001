"""The node arena: one block of shared memory per node communicator, and the counters that order its use.

Why. Every byte a two-sided schedule moves goes through the transport: under
MPI on one node that is two copies through the library's cells per message,
and no rank ever reads a peer's data where it lies. The node algorithms
(:mod:`commkit.algorithms.node`) instead copy into memory every rank of the
node can read, and read their peers' data from there (DeepSpeed's CPU
shared-memory allreduce, MPICH's release/gather collectives, Open MPI's xhc).

Layout. Every rank of the node owns one segment::

    [counter: 64 B][identity: 64 B][slot: slot_bytes]

The counter and the identity each sit on a cache line of their own, so a rank
polling a peer's counter never shares a line with data another rank writes.
The identity's line also holds where the rank's buffers of the call lie when
they are shared arrays (below).
The counter is monotonic: a step of a node schedule stores ``(call number <<
32) | k`` there (:func:`commkit.schedule.counter_value`), and a waiting peer
waits for a value at least as large; the identity holds the call's tag, so a
peer in another collective is told apart from one in the same call.

Ordering. CPython promises no memory ordering between threads or processes,
so every publication is explicit: data stores, a fence, then the counter
store; a reader loads the counter, fences, then loads the data. Under MPI the
fence is ``MPI_Win_sync`` inside a ``Lock_all`` epoch of the window (the MPI-3
unified memory model's memory barrier; MPICH implements it as a full
barrier). In the threads world it is one lock shared by the node's ranks,
taken around every counter store and load (a lock's release and acquire order
memory in CPython, free-threaded builds included).

Lifetime and size. The arena is made at the first node-algorithm call on a
communicator, by every rank at that call (collectively), with
``COMMKIT_NODE_ARENA_BYTES`` bytes of slot per rank (default 8 MiB), and is
never grown: a larger message goes through it in chunks. Under MPI the memory
is an ``MPI_Win_allocate_shared`` window, so the library frees it at
``MPI_Finalize`` or when the job ends, even when a rank dies; nothing is left in
``/dev/shm``. (It is not freed with its communicator: freeing a window is
collective, and a communicator may be freed by the garbage collector on one
rank alone.)

Shared arrays. ``Communicator.shared_empty`` allocates arrays every rank of the
node can read (one more MPI shared window per call, collectively; in the
threads world plain NumPy memory), numbered in the order they were made, which
every rank shares. A node call on such arrays skips the copies through the
slots: each rank writes, beside its identity, the allocation and the byte
offset of its ``in`` and ``out``, and its peers read them where they lie
(:meth:`Arena.locate`, :meth:`Arena.peer_view`). Like the arena, these windows
are freed by the library at ``MPI_Finalize``.

Nodes. Ranks share a node when ``MPI_Comm_split_type(COMM_TYPE_SHARED)`` puts
them together (in the threads world, always). As a testing aid,
``COMMKIT_RANKS_PER_NODE=k`` makes consecutive groups of k ranks of the world
(``MPI.COMM_WORLD`` ranks; in the threads world, world ranks) separate nodes
within that, so multi-node layouts can be tested on one machine. A node
schedule runs only on a communicator whose ranks all share one node.
"""

from __future__ import annotations

import os
import socket
import threading
import weakref

import numpy as np

from ..errors import AlgorithmNotApplicable, CommError, InvalidArgument

__all__ = ["Arena", "node_arena", "made_arena", "free_arena", "node_name", "count_nodes", "spans_nodes",
           "ranks_per_node", "arena_bytes", "lacks_room", "ENV_RANKS_PER_NODE", "ENV_ARENA_BYTES",
           "DEFAULT_ARENA_BYTES", "LINE"]

LINE = 64
"""A cache line: the counter and the identity of each rank each have one to themselves."""
_HEADER = 2 * LINE
ENV_RANKS_PER_NODE = "COMMKIT_RANKS_PER_NODE"
"""Testing aid: consecutive groups of this many world ranks count as separate nodes."""
ENV_ARENA_BYTES = "COMMKIT_NODE_ARENA_BYTES"
"""Bytes of slot each rank has in its node's arena."""
DEFAULT_ARENA_BYTES = 8 << 20
"""8 MiB per rank: room for two chunks of 4 MiB, the most a chunk of ``shm:4M`` holds."""


def _positive_env(name: str, default: int | None) -> int | None:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise InvalidArgument(f"{name} must be a positive whole number, got {text!r}.")
    return value


def ranks_per_node() -> int | None:
    """``COMMKIT_RANKS_PER_NODE`` (consecutive world ranks per emulated node), or None when unset."""
    return _positive_env(ENV_RANKS_PER_NODE, None)


def node_name(transport) -> str:
    """The node ``transport``'s rank runs on, named alike by every rank of that node.

    The host's name (MPI's processor name under MPI); with ``COMMKIT_RANKS_PER_NODE=k``
    also the emulated node, ``world rank // k``, as the arena splits nodes.
    """
    if transport.name == "mpi":
        from mpi4py import MPI

        host, world = MPI.Get_processor_name(), MPI.COMM_WORLD.Get_rank()
    else:
        ranks = getattr(transport, "ranks", None)  # the threads world's world ranks
        host, world = socket.gethostname(), None if ranks is None else ranks[transport.rank]
    k = ranks_per_node()
    return host if k is None or world is None else f"{host}/{world // k}"


def arena_bytes() -> int:
    """The slot bytes per rank of a new arena: ``COMMKIT_NODE_ARENA_BYTES``, else 8 MiB; a multiple of 64."""
    value = _positive_env(ENV_ARENA_BYTES, DEFAULT_ARENA_BYTES)
    return -(-value // LINE) * LINE


def lacks_room(size: int, shm: str = "/dev/shm") -> str | None:
    """Why a node of ``size`` ranks has no room for an MPI arena in ``shm``, or None (room, or no way to tell).

    The MPI libraries back a shared window with a file in ``/dev/shm``; asked
    for more than it holds, Open MPI 5.0 fails the allocation on the node's
    first rank only and leaves the others inside the library's collective for
    good, so the room is looked at before any rank enters it (each rank of the
    node sees the same ``/dev/shm``).
    """
    need = size * (_HEADER + arena_bytes())
    try:
        stat = os.statvfs(shm)
    except OSError:
        return None
    room = stat.f_bavail * stat.f_frsize
    if need <= room:
        return None
    return _cannot_allocate(arena_bytes(), size, f"{shm} has {room} bytes free and the node's arena needs {need}",
                            f", make {shm} larger,")


def spans_nodes(what: str, nodes: int) -> str:
    """Why the node algorithms cannot run on a ``what`` (a communicator) of ``nodes`` nodes."""
    return (f"the node algorithms need every rank of the communicator on one node, but this {what} spans {nodes} "
            f"nodes{' (COMMKIT_RANKS_PER_NODE=' + str(ranks_per_node()) + ')' if ranks_per_node() else ''}; run "
            "them on a communicator of one node's ranks (comm.split by node), or choose a two-sided algorithm")


def _spans_nodes(what: str, nodes: int) -> AlgorithmNotApplicable:
    return AlgorithmNotApplicable(spans_nodes(what, nodes) + ".")


def _cannot_allocate(nbytes: int, size: int, why: str, also: str = "") -> str:
    """Why a node arena of ``nbytes`` of slot for each of ``size`` ranks cannot be had, and what to do."""
    return (f"could not allocate the node arena ({nbytes} bytes of slot for each of {size} ranks): {why}. Set "
            f"{ENV_ARENA_BYTES} lower (large messages then go through it in more chunks){also or ','} or choose a "
            "two-sided algorithm; those do not need the arena.")


def _no_memory(nbytes: int, size: int, exc: BaseException) -> CommError:
    return CommError(_cannot_allocate(nbytes, size, f"{type(exc).__name__}: {exc}"))


class Arena:
    """One rank's view of its node's arena: every rank's slot, counter and identity, and the fence.

    Attributes:
        rank: this rank (its rank in the communicator, which is its rank in the node).
        size: ranks in the node.
        slot_bytes: bytes in each rank's slot.
        slots: every rank's slot, as bytes (``slots[q]``).
        last: the call number of this rank's previous node call (-1: none yet).
    """

    def __init__(self, rank: int, size: int, segments, fence, failed=None, keep=(), allocate=None, shared=None,
                 release=None):
        self._keep = list(keep)  # what the memory belongs to (MPI windows and their communicator), kept alive
        self._release = release  # frees the slots' memory (collective under MPI), or None: the collector does
        self.rank = rank
        self.size = size
        self.slot_bytes = len(segments[0]) - _HEADER
        self.slots = [seg[_HEADER:] for seg in segments]
        # Each rank's counter and call identity as one-item memoryviews: an item read is a Python int at once
        # (a NumPy element read then converted costs about 0.05 us more, and a small node call reads five).
        self._counters = [memoryview(seg[:8]).cast("q") for seg in segments]
        self._idents = [memoryview(seg[LINE:LINE + 8]).cast("q") for seg in segments]
        # Where a rank's "in" and "out" lie when they are shared arrays: (allocation, byte offset, bytes) each.
        self._where = [seg[LINE + 8:LINE + 56].view(np.int64) for seg in segments]
        self._where_in = [memoryview(seg[LINE + 8:LINE + 16]).cast("q") for seg in segments]  # (shares reads it)
        self._allocate = allocate  # nbytes -> this rank's part (collective under MPI), or None
        self._shared = {} if shared is None else shared  # allocation number -> every rank's part (bytes)
        self._made = 0  # shared allocations this rank made: the next one's number
        self._bounds: list = []  # (first byte's address, bytes) of this rank's part of each allocation, by number
        # Shared arrays located before, by id: (the array, where it lies). A pointer costs NumPy 0.8 us to
        # give, and a loop on shared arrays asks for the same two at every call. Only shared arrays are kept
        # (their memory is the arena's until free), a handful at a time.
        self._located: dict = {}
        self._peer_views: dict = {}  # (peer, its record of where, dtype) -> its in and out (see peer_arrays)
        self._recorded = None  # what set_where wrote last into this rank's record
        self._views: dict = {}  # (bytes, dtype) -> every rank's slot viewed so (see slot_views)
        self._fence = fence
        self._failed = failed  # the threads world's check for a failed rank
        self.last = -1
        # Turn-taking of this rank's own node calls: nonblocking ones may be in flight together,
        # but only one at a time may use the slots, in call order (tickets are taken at the call).
        self._tickets = 0
        self._serving = 0

    # -- ordering ------------------------------------------------------------------------------------

    def publish(self, value: int) -> None:
        """Make every store before it visible, then set this rank's counter to ``value``."""
        self._fence(self._counters[self.rank], value)

    def counter(self, peer: int) -> int:
        """``peer``'s counter, with the fence after the load (what it published is visible after this)."""
        return self._fence(self._counters[peer])

    def set_identity(self, tag: int) -> None:
        """Record the call this rank is in (made visible by its next :meth:`publish`)."""
        self._idents[self.rank][0] = tag

    def identity(self, peer: int) -> int:
        """The call ``peer`` recorded last (read after a :meth:`counter` that showed its publication)."""
        return self._idents[peer][0]

    def free(self) -> None:
        """Give the slots' memory back (under MPI: ``MPI_Win_free``, which waits until every rank of the node frees).

        Every rank of the node calls it, once no node call of its communicator can
        run again; the views of the slots are dropped first, so none outlives the
        memory. Shared arrays (:meth:`allocate`) are the caller's and stay.
        """
        self.slots, self._counters, self._idents, self._where, self._where_in = [], [], [], [], []
        self._views = {}
        self._located, self._bounds, self._peer_views = {}, [], {}
        release, self._release = self._release, None
        if release is not None:
            release()

    # -- shared arrays -------------------------------------------------------------------------------

    def allocate(self, nbytes: int) -> np.ndarray:
        """This rank's part (``nbytes`` bytes, cache-line aligned) of a new shared allocation; every rank calls it.

        Collective in the order of the calls: the n-th allocation of every rank
        is allocation n, so ranks name each other's parts by number.
        """
        number = self._made
        try:
            part, keep = self._allocate(number, nbytes)
        except MemoryError as exc:
            raise CommError(f"could not allocate {nbytes} bytes of shared memory: {exc}.") from None
        self._made = number + 1
        self._keep.append(keep)
        self._bounds.append((part.__array_interface__["data"][0], part.nbytes))
        return part

    def locate(self, array) -> tuple | None:
        """``(allocation, byte offset, bytes)`` of a C-contiguous ``array`` in this rank's shared memory, or None."""
        if not self._made or not array.flags.c_contiguous:
            return None
        hit = self._located.get(id(array))
        if hit is not None and hit[0] is array:
            return hit[1]
        start = array.__array_interface__["data"][0]
        end = start + array.nbytes
        for number, (base, nbytes) in enumerate(self._bounds):
            if base <= start and end <= base + nbytes:
                where = number, start - base, array.nbytes
                if len(self._located) >= 16:
                    self._located.clear()
                self._located[id(array)] = (array, where)
                return where
        return None

    def slot_views(self, nbytes: int, dtype) -> dict:
        """Every rank's slot, its first ``nbytes`` bytes as ``dtype``, by slot name (made once per size and dtype)."""
        key = (nbytes, dtype)
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= 16:
                self._views.clear()
            views = self._views[key] = {f"slot{q}": memory[:nbytes].view(dtype) for q, memory in enumerate(self.slots)}
        return views

    def set_where(self, where_in, where_out) -> None:
        """Record where this call's ``in`` and ``out`` lie (published with the identity): located, or None."""
        values = (_NOWHERE if where_in is None and where_out is None  # (most calls: their arrays are not shared)
                  else (*(where_in or (-1, 0, 0)), *(where_out or (-1, 0, 0))))
        # (a loop on the same arrays records them once: no rank but this one writes)
        if values is not self._recorded and values != self._recorded:
            self._where[self.rank][:] = values
            self._recorded = values

    def shares(self, peer: int) -> bool:
        """Whether ``peer`` recorded shared arrays for its current call (:meth:`where` says where)."""
        return self._where_in[peer][0] >= 0

    def where(self, peer: int) -> tuple:
        """``(in, out)`` as ``peer`` recorded them for its current call: each located, or None."""
        values = [int(v) for v in self._where[peer]]
        return tuple(None if values[i] < 0 else tuple(values[i:i + 3]) for i in (0, 3))

    def peer_arrays(self, peer: int, dtype) -> tuple:
        """``peer``'s ``in`` and ``out`` where it recorded them for its current call, as flat arrays of ``dtype``.

        Viewed once per place: a shared allocation stays where it is while the
        arena lives, so the views of one record serve every call that repeats it.
        """
        key = (peer, self._where[peer].tobytes(), dtype)
        views = self._peer_views.get(key)
        if views is None:
            where = self.where(peer)
            views = self.peer_view(peer, where[0], dtype), self.peer_view(peer, where[1], dtype)
            if len(self._peer_views) >= 64:
                self._peer_views.clear()
            self._peer_views[key] = views
        return views

    def peer_view(self, peer: int, where: tuple, dtype) -> np.ndarray:
        """``peer``'s buffer that ``where`` (from :meth:`where`) locates, as a flat array of ``dtype``."""
        number, offset, nbytes = where
        return self._shared[number][peer][offset:offset + nbytes].view(dtype)

    def check_failed(self) -> None:
        """Raise :class:`~commkit.errors.PeerFailed` if a rank of the threads world has failed."""
        if self._failed is not None:
            self._failed()

    # -- turns ---------------------------------------------------------------------------------------

    def take_turn(self) -> int:
        """A ticket for this rank's next node call; its turn comes when :meth:`my_turn` says so."""
        ticket = self._tickets
        self._tickets = ticket + 1
        return ticket

    def my_turn(self, ticket: int) -> bool:
        """Whether every earlier node call of this rank has ended (see :meth:`end_turn`)."""
        return self._serving == ticket

    def end_turn(self, seq: int) -> None:
        """This rank's node call ``seq`` is done with the arena: let its next one in."""
        self.last = seq
        self._serving += 1


_NOWHERE = (-1, 0, 0, -1, 0, 0)  # set_where's record of a call whose arrays are not shared arrays


# -- MPI ---------------------------------------------------------------------------------------------

def _mpi_node(comm):
    """This rank's node: the ranks of ``comm`` that share its memory (and its emulated node, when one is set)."""
    from mpi4py import MPI

    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    k = ranks_per_node()
    if k is not None:
        emulated = node.Split(MPI.COMM_WORLD.Get_rank() // k, comm.Get_rank())
        node.Free()
        node = emulated
    return node


def count_nodes(transport) -> int:
    """How many nodes ``transport``'s communicator spans; 1 when all its ranks share one node's memory.

    Collective under MPI (every rank of the communicator calls it, as when the
    communicator is made); in the threads world every rank is on one node
    unless ``COMMKIT_RANKS_PER_NODE`` says otherwise, read at each call.
    """
    if transport.name != "mpi":
        k = ranks_per_node()
        return 1 if k is None else len({w // k for w in transport.ranks})
    comm = transport.comm
    node = _mpi_node(comm)
    try:
        if node.Get_size() == comm.Get_size():
            return 1  # (then every rank's node holds every rank: all return here, none sums below)
        return comm.allreduce(1 if node.Get_rank() == 0 else 0)
    finally:
        node.Free()


def _mpi_arena(transport) -> Arena:
    from mpi4py import MPI

    comm = transport.comm
    node = _mpi_node(comm)
    if node.Get_size() != comm.Get_size():
        # Every node is then smaller than the communicator: every rank raises here, none allocates.
        nodes = comm.allreduce(1 if node.Get_rank() == 0 else 0)
        node.Free()
        raise _spans_nodes("communicator", nodes)
    nbytes = arena_bytes()
    try:
        # A line more than needed: a segment is used from its first cache line (MPICH gives a one-rank node
        # malloc'd memory on a 16-byte boundary; a segment shared between processes starts on a page, so the
        # offset is the same in every rank's mapping).
        win = MPI.Win.Allocate_shared(_HEADER + nbytes + LINE, 1, comm=node)
    except MPI.Exception as exc:
        raise _no_memory(nbytes, node.Get_size(), exc) from None
    win.Lock_all(MPI.MODE_NOCHECK)
    segments = []
    for q in range(node.Get_size()):
        buf, _ = win.Shared_query(q)
        whole = np.frombuffer(buf, np.uint8)
        skip = -whole.ctypes.data % LINE
        segments.append(whole[skip:skip + _HEADER + nbytes])
    segments[node.Get_rank()][:_HEADER] = 0
    win.Sync()
    node.Barrier()  # every counter is zero before any rank reads one
    sync = win.Sync
    shared: dict = {}

    def allocate(number, nbytes):
        try:
            part = MPI.Win.Allocate_shared(-(-max(nbytes, 1) // LINE) * LINE, 1, comm=node)
        except MPI.Exception as exc:
            raise MemoryError(str(exc)) from None
        shared[number] = [np.frombuffer(part.Shared_query(q)[0], np.uint8) for q in range(node.Get_size())]
        mine = shared[number][node.Get_rank()][:nbytes]
        return mine, part

    def fence(counter, value=None):
        if value is None:
            got = counter[0]
            sync()
            return got
        sync()
        counter[0] = value
        return value

    def release():
        # (the shared arrays' windows stay: their memory is the caller's; the node communicator goes, and
        # MPI keeps what those windows need of it)
        win.Unlock_all()
        win.Free()
        node.Free()

    # MPI frees the windows and the node communicator at finalize, unless the communicator is freed first
    return Arena(node.Get_rank(), node.Get_size(), segments, fence, keep=(win, node), allocate=allocate, shared=shared,
                 release=release)


# -- threads -------------------------------------------------------------------------------------------

class _Shared:
    """The memory of one threads-world arena, shared by the rank threads of one context."""

    def __init__(self, size: int, nbytes: int):
        self.lock = threading.Lock()
        self.arrays: dict = {}  # shared allocation number -> every rank's part, filled in by each rank thread
        try:
            self.segments = [np.zeros(_HEADER + nbytes, np.uint8) for _ in range(size)]
        except MemoryError as exc:
            raise _no_memory(nbytes, size, exc) from None


_SHARED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # world -> {context: _Shared}
_SHARED_LOCK = threading.Lock()


def _local_arena(transport) -> Arena:
    k = ranks_per_node()
    if k is not None:
        nodes = len({w // k for w in transport.ranks})
        if nodes > 1:
            raise _spans_nodes("communicator", nodes)
    nbytes = arena_bytes()
    with _SHARED_LOCK:
        contexts = _SHARED.setdefault(transport.world, {})
        shared = contexts.get(transport.ctx)
        if shared is None:
            shared = contexts[transport.ctx] = _Shared(transport.size, nbytes)
    lock = shared.lock

    def fence(counter, value=None):
        with lock:
            if value is None:
                return counter[0]
            counter[0] = value
            return value

    def allocate(number, nbytes):
        lines = -(-max(nbytes, 1) // LINE) * LINE
        memory = np.empty(lines + LINE, np.uint8)
        skip = -memory.ctypes.data % LINE
        part = memory[skip:skip + lines]  # cache-line aligned, as MPI's windows are
        with lock:
            shared.arrays.setdefault(number, [None] * transport.size)[transport.rank] = part
        return part[:nbytes], None

    return Arena(transport.rank, transport.size, shared.segments, fence, transport.world.check_failed,
                 allocate=allocate, shared=shared.arrays)


_ARENAS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # transport -> Arena


def made_arena(transport) -> Arena | None:
    """``transport``'s node arena if a node call has made it, else None (nothing is made)."""
    return _ARENAS.get(transport)


def free_arena(transport) -> None:
    """Give back ``transport``'s node arena, if it has one (every rank of the node calls it; see :meth:`Arena.free`)."""
    arena = _ARENAS.pop(transport, None)
    transport.__dict__.pop("_node_arena", None)
    if arena is not None:
        arena.free()


def node_arena(transport, rendezvous=None) -> Arena:
    """The node arena of ``transport``'s communicator, made at the first call (collectively under MPI).

    Every rank of the communicator must make its first call at the same
    collective call (the first node-algorithm call does). ``rendezvous()``, if
    given, runs first when the arena is made: the caller's timed check that every
    rank has come (making it is the library's collective, which cannot time out).

    Raises:
        AlgorithmNotApplicable: the communicator's ranks are not all on one node.
        CommError: the memory could not be allocated.
        InvalidArgument: ``COMMKIT_RANKS_PER_NODE`` or ``COMMKIT_NODE_ARENA_BYTES`` is malformed.
    """
    arena = _ARENAS.get(transport)
    if arena is None:
        if rendezvous is not None:
            rendezvous()
        arena = _ARENAS[transport] = _mpi_arena(transport) if transport.name == "mpi" else _local_arena(transport)
    return arena
