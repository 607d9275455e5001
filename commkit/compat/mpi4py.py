"""mpi4py's buffer interface over commkit's collectives: switch a program by wrapping its communicator.

::

    from mpi4py import MPI
    from commkit.compat.mpi4py import wrap

    comm = wrap(MPI.COMM_WORLD)           # the one changed line
    comm.Allreduce(MPI.IN_PLACE, [x, MPI.DOUBLE], op=MPI.SUM)

What goes where:

* Collectives (``Bcast``, ``Reduce``, ``Allreduce``, ``Gather``, ``Scatter``,
  ``Allgather``, ``Alltoall``, ``Reduce_scatter_block``, ``Reduce_scatter``,
  ``Scan``, ``Exscan``, ``Barrier`` and their ``I``-forms) take mpi4py's buffer
  specifications -- ``buf``, ``[buf, datatype]``, ``[buf, count, datatype]``,
  ``[buf, (count, displ), datatype]``, ``[buf, count, displ, datatype]`` -- and
  ``MPI.IN_PLACE`` (or ``None``, as mpi4py reads it) wherever mpi4py does, over
  any buffer mpi4py takes (NumPy and CuPy arrays, ``array.array``,
  ``bytearray``, ``memoryview``, DLPack producers), and run commkit's
  algorithms on a :class:`commkit.Communicator` over duplicated contexts of the
  same MPI communicator, so its traffic never meets the program's own messages.
* Point-to-point, the vector collectives (``Allgatherv``, ``Gatherv``,
  ``Scatterv``, ``Alltoallv``, ``Alltoallw``), persistent collectives
  (``Allreduce_init`` ...), the pickle-based lowercase methods and every other
  attribute go to the wrapped mpi4py communicator untouched: they run MPI's own
  implementation with every detail of mpi4py (``Status`` counts, ``MPI.Request``
  objects, buffer forms).
* What commkit cannot compute goes to the wrapped communicator's own method
  for that call (logged at debug level on the ``commkit.compat.mpi4py``
  logger, with the reason): ops without a commkit equivalent (``MPI.MAXLOC``, ``MPI.REPLACE``,
  ``MPI.Op.Create`` ops), reductions over derived or pair datatypes, an op not
  defined for the datatype, and every call on an intercommunicator.

The one rule that keeps ranks together
--------------------------------------

One collective call must take the same road -- commkit or MPI -- on every
rank, or the ranks wait for each other forever. So the face decides from
arguments that MPI itself requires to be equal on every rank, never from what
only one rank can see:

* data-movement collectives (``Bcast``, ``Gather``, ``Scatter``,
  ``Allgather``, ``Alltoall``) always run commkit's algorithms, and always on
  the bytes of the message. MPI lets ranks describe the same bytes with
  different datatypes (a root gathering matrix columns through a vector type
  while the others send plain ``MPI.DOUBLE``s), so the datatype cannot decide
  anything here. A buffer the face cannot view as one run of bytes -- a
  derived datatype, ``MPI.BOTTOM`` with absolute addresses, an object only
  mpi4py can read -- is packed and unpacked by MPI itself (a send to self,
  received as ``MPI.PACKED``), so every spec mpi4py accepts works, and mpi4py's
  own error is raised for one it rejects;
* reductions (``Reduce``, ``Allreduce``, ``Scan``, ``Exscan``,
  ``Reduce_scatter_block``, ``Reduce_scatter``) decide from the op and the
  datatype, which MPI requires to be the same on every rank: a mappable
  ``MPI.Op`` on a predefined numeric datatype runs in commkit, anything else
  runs MPI's reduction;
* ``IN_PLACE`` at a root (``Gather``, ``Scatter``, ``Reduce``) changes only how
  the root lays out its own block, never the road;
* an intercommunicator sends every collective to MPI, on every rank.

Errors the face raises itself come from its local checks of one rank's
buffers, at the places mpi4py checks them too (a read-only receive buffer, a
list of 5 items, send and receive counts that differ), before anything is
sent. One check is the face's own: where mpi4py would let MPI read or write
past the end of a buffer (a count larger than the buffer), the face raises
:class:`~commkit.InvalidBuffer`. Such a call is wrong on that rank alone, and
the other ranks wait for it exactly as they would in mpi4py; a timeout
(``wrap(comm, timeout=...)`` or ``COMMKIT_TIMEOUT``) turns that wait into
:class:`~commkit.CommTimeout`.

Cost: the common calls (NumPy arrays, mpi4py's builtin op objects) take a
short path that checks types by identity and looks ops and datatypes up in
tables built at import, and hands the communicator the very same arrays (or,
for data movement, the same byte views of them, kept per array) on every call,
so that it replays the plan it compiled for them. ``benchmarks/face_overhead.py``
measures what is left.

Nonblocking collectives return a :class:`Request`; ``Request.Waitall`` (and
``Testall``) accept a mix of these and mpi4py's own requests, and keep
progressing all of them, so no waiting order can deadlock.
"""

from __future__ import annotations

import ctypes
import logging
import time

import numpy as np
from mpi4py import MPI
from mpi4py.util.dtlib import to_numpy_dtype

from .._checks import check_rank, same_memory
from ..communicator import Communicator
from ..errors import InvalidArgument, InvalidBuffer
from ..ops import Op, get_op
from ..transports.mpi import MPITransport
from . import as_array

__all__ = ["Comm", "Request", "wrap"]

log = logging.getLogger("commkit.compat.mpi4py")

_ndarray = np.ndarray
_IN_PLACE = MPI.IN_PLACE
_BOTTOM = MPI.BOTTOM
_MPI_OP = MPI.Op
_MPI_DATATYPE = MPI.Datatype
_UINT8 = np.dtype(np.uint8)
_NUMERIC = "biufc"
_MAX_SLEEP = 1e-3
_PACK_TAG = 0
# Byte views of plain NumPy arrays a face keeps, and up to what size: like the
# communicator's compiled plans (which they let it reuse), they keep small arrays alive.
_VIEWS = 32
_VIEW_BYTES = 1 << 20

# The builtin MPI ops commkit computes, with the NumPy dtype kinds MPI defines each
# for: integers, floating point and complex for the arithmetic ops, no complex for
# MAX/MIN, integers and C_BOOL for the logical ops, integers and bytes for the
# bitwise ones. An op outside these runs MPI's reduction -- and MPI's error, on every
# rank, as it would in mpi4py.
_BUILTIN_OPS = (
    (MPI.SUM, "sum", "iufc"), (MPI.PROD, "prod", "iufc"), (MPI.MAX, "max", "iuf"), (MPI.MIN, "min", "iuf"),
    (MPI.LAND, "land", "iub"), (MPI.LOR, "lor", "iub"), (MPI.LXOR, "lxor", "iub"),
    (MPI.BAND, "band", "iu"), (MPI.BOR, "bor", "iu"), (MPI.BXOR, "bxor", "iu"),
)


def _numeric(dtype) -> bool:
    return dtype.kind in _NUMERIC and dtype.isnative and not dtype.hasobject and dtype.fields is None


def _predefined_dtypes() -> dict[int, np.dtype]:
    """Every predefined MPI datatype with a numeric NumPy equivalent, by handle."""
    table = {}
    names = [n for n in dir(MPI) if n.isupper() and isinstance(getattr(MPI, n), MPI.Datatype)]
    for datatype in [getattr(MPI, n) for n in names] + list(MPI._typedict.values()):
        if datatype == MPI.DATATYPE_NULL or datatype == MPI.PACKED:
            continue
        try:
            dtype = np.dtype(to_numpy_dtype(datatype))
        except (ValueError, TypeError, KeyError, MPI.Exception):  # no NumPy twin, or not in this MPI library
            continue
        if _numeric(dtype):
            table[datatype.handle] = dtype
    return table


_DTYPES = _predefined_dtypes()
_COMBINERS = {getattr(MPI, n): n[len("COMBINER_"):] for n in dir(MPI) if n.startswith("COMBINER_")}
_ALL_DTYPES = frozenset(_DTYPES.values())


def _dtypes_for(op: Op, kinds: str = _NUMERIC) -> frozenset:
    """The NumPy dtypes the face runs ``op`` on: one set lookup per call."""
    return frozenset(d for d in _ALL_DTYPES if d.kind in kinds and d.kind in op.kinds)


# (commkit op, its dtypes) by MPI handle (MPI.Op objects are not hashable; a builtin
# op's handle is a constant no user-created op can take), and the same by the identity
# of mpi4py's own op objects, which live as long as the module: the short path's one
# dict lookup. An equal op in another object (MPI.Op(MPI.SUM)) takes the general
# path, which looks it up by handle.
_OP_DTYPES: dict[int, tuple[Op, frozenset]] = {
    mpi_op.handle: (get_op(name), _dtypes_for(get_op(name), kinds)) for mpi_op, name, kinds in _BUILTIN_OPS
}
_FAST_OPS: dict[int, tuple[Op, frozenset]] = {id(mpi_op): _OP_DTYPES[mpi_op.handle] for mpi_op, _, _ in _BUILTIN_OPS}


def wrap(comm, *, timeout: float | None = None, check: bool | None = None) -> Comm:
    """Wrap an mpi4py communicator so its buffer collectives run commkit's algorithms.

    Collective: every rank of ``comm`` must call it (it duplicates ``comm``).

    Args:
        comm: an ``mpi4py.MPI.Comm`` such as ``MPI.COMM_WORLD`` (a :class:`Comm`
            is returned as it is). An intercommunicator is wrapped too; all its
            collectives run MPI's own.
        timeout, check: as for :func:`commkit.init`.

    Raises:
        InvalidArgument: ``comm`` is not an mpi4py communicator, or is ``MPI.COMM_NULL``.
    """
    if isinstance(comm, Comm):
        return comm
    return Comm(comm, timeout=timeout, check=check)


class _PassThrough(Exception):
    """This call runs the wrapped communicator's own method; the message says why."""


class _Opaque(Exception):
    """The face cannot view this buffer spec as one typed run of memory; the message says why."""


class Comm:
    """An mpi4py communicator whose buffer collectives run commkit's algorithms.

    Attributes:
        mpi: the wrapped ``mpi4py.MPI.Comm``.
        comm: the :class:`commkit.Communicator` running the collectives
            (``comm.comm.last_algorithm`` tells which algorithm ran); None on an
            intercommunicator.
    """

    def __new__(cls, comm=None, **kwargs):
        inter = cls is Comm and isinstance(comm, MPI.Comm) and comm != MPI.COMM_NULL and comm.Is_inter()
        return super().__new__(_Intercomm if inter else cls)

    def __init__(self, comm, *, timeout: float | None = None, check: bool | None = None):
        if not isinstance(comm, MPI.Comm):
            raise InvalidArgument(
                f"wrap expects an mpi4py communicator such as MPI.COMM_WORLD, got {type(comm).__name__}."
            )
        if comm == MPI.COMM_NULL:
            raise InvalidArgument("cannot wrap MPI.COMM_NULL; wrap a communicator this rank belongs to.")
        self.mpi = comm
        self._rank, self._size = comm.Get_rank(), comm.Get_size()
        self._timeout, self._check = timeout, check
        self._self = None  # MPI.COMM_SELF duplicate that packs what the face cannot view, made on first use
        self._views: dict = {}  # parsed specs over plain NumPy arrays: see _keep
        self.comm = None if comm.Is_inter() else Communicator(MPITransport(comm), timeout=timeout, check=check)
        # The communicator's blocking methods, bound once for the per-call path.
        self._blocking = {} if self.comm is None else {name: getattr(self.comm, name) for name in (
            "broadcast", "reduce", "allreduce", "scan", "exscan", "gather", "scatter", "allgather", "alltoall",
            "reduce_scatter")}

    def __getattr__(self, name):
        if name in ("mpi", "comm"):  # not set yet (during unpickling or a failed __init__)
            raise AttributeError(name)
        return getattr(self.mpi, name)

    def __repr__(self) -> str:
        kind = "intercommunicator (MPI's collectives)" if self.comm is None else "commkit's collectives"
        return f"<commkit.compat.mpi4py.Comm over {self.mpi!r}, {kind}: rank {self._rank} of {self._size}>"

    # -- basics ----------------------------------------------------------------

    def Get_rank(self) -> int:
        """This process's rank."""
        return self._rank

    def Get_size(self) -> int:
        """The number of processes (of the local group, on an intercommunicator)."""
        return self._size

    @property
    def rank(self) -> int:
        """This process's rank."""
        return self._rank

    @property
    def size(self) -> int:
        """The number of processes."""
        return self._size

    def Split(self, color: int = 0, key: int = 0):
        """Like ``MPI.Comm.Split``: a wrapped new communicator, or ``MPI.COMM_NULL`` for ``MPI.UNDEFINED``."""
        new = self.mpi.Split(color, key)
        if new == MPI.COMM_NULL:
            return new
        return Comm(new, timeout=self._timeout, check=self._check)

    def Dup(self) -> Comm:
        """A wrapped duplicate (collective)."""
        return Comm(self.mpi.Dup(), timeout=self._timeout, check=self._check)

    def Free(self) -> None:
        """Free commkit's contexts and the MPI communicator (as ``MPI.Comm.Free``; MPI refuses COMM_WORLD)."""
        self._views.clear()
        if self.comm is not None:
            self.comm.free()
        if self._self is not None:
            self._self.Free()
            self._self = None
        self.mpi.Free()

    # -- point to point: passed through (see the module docstring) -----------------

    def Send(self, buf, dest: int, tag: int = 0) -> None:
        """``MPI.Comm.Send``, unchanged."""
        self.mpi.Send(buf, dest, tag)

    def Recv(self, buf, source: int = MPI.ANY_SOURCE, tag: int = MPI.ANY_TAG, status=None) -> None:
        """``MPI.Comm.Recv``, unchanged."""
        self.mpi.Recv(buf, source, tag, status)

    def Sendrecv(self, sendbuf, dest: int, sendtag: int = 0, recvbuf=None, source: int = MPI.ANY_SOURCE,
                 recvtag: int = MPI.ANY_TAG, status=None) -> None:
        """``MPI.Comm.Sendrecv``, unchanged."""
        self.mpi.Sendrecv(sendbuf, dest, sendtag, recvbuf, source, recvtag, status)

    def Isend(self, buf, dest: int, tag: int = 0):
        """``MPI.Comm.Isend``, unchanged: returns an ``MPI.Request``."""
        return self.mpi.Isend(buf, dest, tag)

    def Irecv(self, buf, source: int = MPI.ANY_SOURCE, tag: int = MPI.ANY_TAG):
        """``MPI.Comm.Irecv``, unchanged: returns an ``MPI.Request``."""
        return self.mpi.Irecv(buf, source, tag)

    # -- collectives ---------------------------------------------------------------------

    def Barrier(self) -> None:
        """Block until every process has called Barrier."""
        self.comm.barrier()

    def Ibarrier(self) -> Request:
        """Nonblocking :meth:`Barrier`."""
        return Request(self.comm.ibarrier())

    def Bcast(self, buf, root: int = 0) -> None:
        """Broadcast ``buf`` from ``root`` into ``buf`` on every other process.

        Args:
            buf: a buffer spec (read at the root, written elsewhere).
            root: the sending rank.

        Raises:
            InvalidBuffer: ``buf`` is not a buffer spec mpi4py would take, or is
                read-only on a receiving rank.
            InvalidArgument: ``root`` is not a rank.
        """
        msg = self._views.get((True, id(buf), None, None, buf.dtype, 0)) if type(buf) is _ndarray else None
        if msg is not None and msg.source is buf and root.__class__ is int and 0 <= root < self._size \
                and buf.flags.writeable:
            self._blocking["broadcast"](msg.array, root, out=msg.array)  # the short path: a NumPy array seen before
            return
        self._bcast(buf, root, False)

    def Ibcast(self, buf, root: int = 0) -> Request:
        """Nonblocking :meth:`Bcast`."""
        return self._bcast(buf, root, True)

    def _bcast(self, buf, root, nonblocking):
        root = self._root(root)
        is_root = self._rank == root
        msg = self._raw(buf, "buf", writable=not is_root)
        out = msg.array if _writeable(msg.array) else None  # a read-only root buffer is only read
        return self._start("broadcast", nonblocking, msg.finish, msg.array, root, out=out)

    def Reduce(self, sendbuf, recvbuf, op=MPI.SUM, root: int = 0) -> None:
        """Reduce onto ``root``'s ``recvbuf`` (ignored elsewhere); ``sendbuf=MPI.IN_PLACE`` (or None) at the root.

        Args:
            sendbuf, recvbuf: buffer specs of the same datatype and count.
            op: an ``MPI.Op`` (ops commkit cannot compute run MPI's reduction) or a
                :class:`commkit.Op`.
            root: the rank that gets the result.

        Raises:
            InvalidBuffer: a spec mpi4py would refuse, send and receive buffers that
                differ in datatype or count, or a count past the end of a buffer.
            InvalidArgument: ``root`` is not a rank.
        """
        if root.__class__ is int and 0 <= root < self._size:
            short = self._short(sendbuf if self._rank == root else _IN_PLACE,
                                recvbuf if self._rank == root else sendbuf, op)
            if short is not None:
                x, kop = short
                self._blocking["reduce"](x, kop, root, out=recvbuf if self._rank == root else None)
                return
        self._reduce(sendbuf, recvbuf, op, root, False)

    def Ireduce(self, sendbuf, recvbuf, op=MPI.SUM, root: int = 0) -> Request:
        """Nonblocking :meth:`Reduce`."""
        return self._reduce(sendbuf, recvbuf, op, root, True)

    def _reduce(self, sendbuf, recvbuf, op, root, nonblocking):
        try:
            kop = _op(op)
            root = self._root(root)
            if self._rank != root:
                _not_in_place(sendbuf, "Reduce", "sendbuf", "only at the root")
                send = self._typed(sendbuf, "sendbuf", kop)
                return self._start("reduce", nonblocking, None, send.array, kop[0], root)
            send, recv = self._reduction_buffers("Reduce", sendbuf, recvbuf, kop)
        except _PassThrough as why:
            return self._pass("Reduce", nonblocking, why, sendbuf, recvbuf, op, root)
        return self._start("reduce", nonblocking, None, send.array, kop[0], root, out=recv.array)

    def Allreduce(self, sendbuf, recvbuf, op=MPI.SUM) -> None:
        """Reduce into every process's ``recvbuf``; ``sendbuf=MPI.IN_PLACE`` (or None) reduces ``recvbuf`` itself.

        Args:
            sendbuf, recvbuf: buffer specs of the same datatype and count.
            op: an ``MPI.Op`` (ops commkit cannot compute run MPI's reduction) or a
                :class:`commkit.Op`.

        Raises:
            InvalidBuffer: a spec mpi4py would refuse, send and receive buffers that
                differ in datatype or count, or a count past the end of a buffer.
        """
        short = self._short(sendbuf, recvbuf, op)
        if short is not None:
            self._blocking["allreduce"](short[0], short[1], out=recvbuf)
            return
        self._reduction("allreduce", "Allreduce", sendbuf, recvbuf, op, False)

    def Iallreduce(self, sendbuf, recvbuf, op=MPI.SUM) -> Request:
        """Nonblocking :meth:`Allreduce`."""
        return self._reduction("allreduce", "Allreduce", sendbuf, recvbuf, op, True)

    def Scan(self, sendbuf, recvbuf, op=MPI.SUM) -> None:
        """Inclusive prefix reduction: rank r gets the reduction of ranks 0..r (arguments as :meth:`Allreduce`)."""
        short = self._short(sendbuf, recvbuf, op)
        if short is not None:
            self._blocking["scan"](short[0], short[1], out=recvbuf)
            return
        self._reduction("scan", "Scan", sendbuf, recvbuf, op, False)

    def Iscan(self, sendbuf, recvbuf, op=MPI.SUM) -> Request:
        """Nonblocking :meth:`Scan`."""
        return self._reduction("scan", "Scan", sendbuf, recvbuf, op, True)

    def Exscan(self, sendbuf, recvbuf, op=MPI.SUM) -> None:
        """Exclusive prefix reduction: rank r gets the reduction of ranks 0..r-1 (arguments as :meth:`Allreduce`).

        As in MPI, rank 0's ``recvbuf`` is undefined; this face leaves it untouched.
        """
        short = self._short(sendbuf, recvbuf, op) if self._rank else None
        if short is not None:
            self._blocking["exscan"](short[0], short[1], out=recvbuf)
            return
        self._reduction("exscan", "Exscan", sendbuf, recvbuf, op, False)

    def Iexscan(self, sendbuf, recvbuf, op=MPI.SUM) -> Request:
        """Nonblocking :meth:`Exscan`."""
        return self._reduction("exscan", "Exscan", sendbuf, recvbuf, op, True)

    @staticmethod
    def _short(sendbuf, recvbuf, op):
        """``(x, op)`` for a reduction the short path takes, else None.

        The short path: mpi4py's own op object, and NumPy arrays of one shape,
        dtype and C layout (``sendbuf`` may be ``MPI.IN_PLACE`` or None), which
        the communicator takes as they are, so it replays the plan it compiled
        for them.
        """
        fast = _FAST_OPS.get(id(op))
        if fast is None or type(recvbuf) is not _ndarray or recvbuf.dtype not in fast[1] \
                or not recvbuf.flags.c_contiguous:
            return None
        if sendbuf is _IN_PLACE or sendbuf is None:
            return recvbuf, fast[0]
        if (type(sendbuf) is _ndarray and sendbuf.dtype is recvbuf.dtype and sendbuf.shape == recvbuf.shape
                and sendbuf.flags.c_contiguous):
            return sendbuf, fast[0]
        return None

    def _reduction(self, collective, what, sendbuf, recvbuf, op, nonblocking):
        try:
            kop = _op(op)
            send, recv = self._reduction_buffers(what, sendbuf, recvbuf, kop)
        except _PassThrough as why:
            return self._pass(what, nonblocking, why, sendbuf, recvbuf, op)
        # Rank 0's result of an exclusive scan is undefined: leave its buffer alone.
        out = None if collective == "exscan" and self._rank == 0 else recv.array
        return self._start(collective, nonblocking, None, send.array, kop[0], out=out)

    def Gather(self, sendbuf, recvbuf, root: int = 0) -> None:
        """Gather every process's ``sendbuf`` into ``root``'s ``recvbuf``, in rank order.

        Args:
            sendbuf: this rank's block; ``MPI.IN_PLACE`` (or None) at the root, whose
                block is then already in place in ``recvbuf``.
            recvbuf: at the root, room for ``size`` blocks (a count in its spec is
                per process); ignored elsewhere.
            root: the receiving rank.

        Raises:
            InvalidBuffer: a spec mpi4py would refuse, or a root whose own block does
                not fill one block of ``recvbuf``.
            InvalidArgument: ``root`` is not a rank.
        """
        self._gather(sendbuf, recvbuf, root, False)

    def Igather(self, sendbuf, recvbuf, root: int = 0) -> Request:
        """Nonblocking :meth:`Gather`."""
        return self._gather(sendbuf, recvbuf, root, True)

    def _gather(self, sendbuf, recvbuf, root, nonblocking):
        root, rank, size = self._root(root), self._rank, self._size
        if rank != root:
            _not_in_place(sendbuf, "Gather", "sendbuf", "only at the root")
            send = self._raw(sendbuf, "sendbuf")
            return self._start("gather", nonblocking, None, send.array, root)
        recv = self._raw(recvbuf, "recvbuf", blocks=size, writable=True)
        x = self._own_block(sendbuf, recv, "Gather")
        return self._start("gather", nonblocking, recv.finish, x, root, out=recv.shaped)

    def Scatter(self, sendbuf, recvbuf, root: int = 0) -> None:
        """Scatter ``root``'s ``sendbuf`` in rank-order blocks into every process's ``recvbuf``.

        Args:
            sendbuf: at the root, ``size`` blocks (a count in its spec is per
                process); ignored elsewhere.
            recvbuf: this rank's block; ``MPI.IN_PLACE`` (or None) at the root, which
                keeps its block where it is.
            root: the sending rank.

        Raises:
            InvalidBuffer: a spec mpi4py would refuse, or a root whose ``recvbuf``
                does not match one block of ``sendbuf``.
            InvalidArgument: ``root`` is not a rank.
        """
        self._scatter(sendbuf, recvbuf, root, False)

    def Iscatter(self, sendbuf, recvbuf, root: int = 0) -> Request:
        """Nonblocking :meth:`Scatter`."""
        return self._scatter(sendbuf, recvbuf, root, True)

    def _scatter(self, sendbuf, recvbuf, root, nonblocking):
        root, rank, size = self._root(root), self._rank, self._size
        if rank != root:
            _not_in_place(recvbuf, "Scatter", "recvbuf", "only at the root")
            recv = self._raw(recvbuf, "recvbuf", writable=True)
            return self._start("scatter", nonblocking, recv.finish, None, root, out=recv.array)
        send = self._raw(sendbuf, "sendbuf", blocks=size)
        finish = out = None  # with IN_PLACE the root keeps its block where it is, in sendbuf
        if not _in_place(recvbuf):
            recv = self._raw(recvbuf, "recvbuf", writable=True)
            _match("Scatter", send, recv, "per-process send count")
            out, finish = recv.array, recv.finish
        return self._start("scatter", nonblocking, finish, send.shaped, root, out=out)

    def Allgather(self, sendbuf, recvbuf) -> None:
        """Every process gets every process's ``sendbuf``, in rank order, in ``recvbuf``.

        Args:
            sendbuf: this rank's block, or ``MPI.IN_PLACE`` (or None) when it already
                sits at its place in ``recvbuf``.
            recvbuf: room for ``size`` blocks (a count in its spec is per process).

        Raises:
            InvalidBuffer: a spec mpi4py would refuse, or a block that does not fill
                one block of ``recvbuf``.
        """
        self._allgather(sendbuf, recvbuf, False)

    def Iallgather(self, sendbuf, recvbuf) -> Request:
        """Nonblocking :meth:`Allgather`."""
        return self._allgather(sendbuf, recvbuf, True)

    def _allgather(self, sendbuf, recvbuf, nonblocking):
        size = self._size
        recv = self._raw(recvbuf, "recvbuf", blocks=size, writable=True)
        x = self._own_block(sendbuf, recv, "Allgather")
        return self._start("allgather", nonblocking, recv.finish, x, out=recv.shaped)

    def _own_block(self, sendbuf, recv, what):
        """The bytes this rank contributes to a gather into ``recv`` (its block there with IN_PLACE)."""
        rank, count = self._rank, recv.count
        if _in_place(sendbuf):
            # Copied: the algorithm writes recvbuf while it may still read the input.
            return recv.copy_of(recv.array[rank * count:(rank + 1) * count])
        send = self._raw(sendbuf, "sendbuf")
        _match(what, send, recv, "send size", "per-process receive size")
        return send.array.copy() if same_memory(send.array, recv.array) else send.array

    def Alltoall(self, sendbuf, recvbuf) -> None:
        """Block j of ``sendbuf`` goes to rank j; block j of ``recvbuf`` comes from rank j.

        Args:
            sendbuf: ``size`` blocks, or ``MPI.IN_PLACE`` (or None) to send from
                ``recvbuf`` and overwrite it.
            recvbuf: room for ``size`` blocks (a count in its spec is per process).

        Raises:
            InvalidBuffer: a spec mpi4py would refuse, or send and receive blocks of
                different sizes.
        """
        self._alltoall(sendbuf, recvbuf, False)

    def Ialltoall(self, sendbuf, recvbuf) -> Request:
        """Nonblocking :meth:`Alltoall`."""
        return self._alltoall(sendbuf, recvbuf, True)

    def _alltoall(self, sendbuf, recvbuf, nonblocking):
        size = self._size
        recv = self._raw(recvbuf, "recvbuf", blocks=size, writable=True)
        if _in_place(sendbuf):
            x = recv.copy_of(recv.shaped)
        else:
            send = self._raw(sendbuf, "sendbuf", blocks=size)
            _match("Alltoall", send, recv, "per-process send size", "per-process receive size")
            x = send.shaped
            if same_memory(x, recv.array):
                x = x.copy()
        return self._start("alltoall", nonblocking, recv.finish, x, out=recv.shaped)

    def Reduce_scatter_block(self, sendbuf, recvbuf, op=MPI.SUM) -> None:
        """Reduce ``size`` equal blocks; rank r gets block r in ``recvbuf``.

        With ``sendbuf=MPI.IN_PLACE`` (or None) the input is all of ``recvbuf``
        and the result lands in its first block. Other arguments and errors as
        for :meth:`Allreduce`.
        """
        self._reduce_scatter_block(sendbuf, recvbuf, op, False)

    def Ireduce_scatter_block(self, sendbuf, recvbuf, op=MPI.SUM) -> Request:
        """Nonblocking :meth:`Reduce_scatter_block`."""
        return self._reduce_scatter_block(sendbuf, recvbuf, op, True)

    def _reduce_scatter_block(self, sendbuf, recvbuf, op, nonblocking):
        size = self._size
        try:
            kop = _op(op)
            if _in_place(sendbuf):
                recv = self._typed(recvbuf, "recvbuf", kop, blocks=size, writable=True)
                x, out = recv.copy_of(recv.array), recv.head(recv.count)
            else:
                recv = self._typed(recvbuf, "recvbuf", kop, writable=True)
                send = self._typed(sendbuf, "sendbuf", kop, blocks=size)
                _match("Reduce_scatter_block", send, recv, "per-process send count")
                x, out = send.array, recv.array
                if same_memory(x, out):
                    x = x.copy()
        except _PassThrough as why:
            return self._pass("Reduce_scatter_block", nonblocking, why, sendbuf, recvbuf, op)
        return self._start("reduce_scatter", nonblocking, None, x, kop[0], out=out)

    def Reduce_scatter(self, sendbuf, recvbuf, recvcounts=None, op=MPI.SUM) -> None:
        """Reduce, then give rank r the next ``recvcounts[r]`` elements.

        ``recvcounts=None`` takes each rank's count from its ``recvbuf``, at the
        cost of one blocking allgather of the counts first, as in mpi4py (not
        allowed with ``MPI.IN_PLACE``, where the input is ``recvbuf`` itself and
        the result lands at its start). Other arguments and errors as for
        :meth:`Allreduce`; ``recvcounts`` that are not one count per rank raise
        :class:`~commkit.InvalidArgument`.
        """
        self._reduce_scatter(sendbuf, recvbuf, recvcounts, op, False)

    def Ireduce_scatter(self, sendbuf, recvbuf, recvcounts=None, op=MPI.SUM) -> Request:
        """Nonblocking :meth:`Reduce_scatter`."""
        return self._reduce_scatter(sendbuf, recvbuf, recvcounts, op, True)

    def _reduce_scatter(self, sendbuf, recvbuf, recvcounts, op, nonblocking):
        rank, size = self._rank, self._size
        try:
            kop = _op(op)
            recv = self._typed(recvbuf, "recvbuf", kop, writable=True)
            if not _in_place(sendbuf):
                send = self._typed(sendbuf, "sendbuf", kop)
        except _PassThrough as why:
            return self._pass("Reduce_scatter", nonblocking, why, sendbuf, recvbuf, recvcounts, op)
        if _in_place(sendbuf):
            if recvcounts is None:
                raise InvalidArgument("Reduce_scatter with sendbuf=MPI.IN_PLACE needs recvcounts (one count per rank).")
            counts = _counts(recvcounts, size)
            if sum(counts) != recv.count:
                raise InvalidBuffer(
                    f"Reduce_scatter with MPI.IN_PLACE reads all of recvbuf, so it must hold sum(recvcounts) = "
                    f"{sum(counts)} elements; got {recv.count}."
                )
            x, out = recv.copy_of(recv.array), recv.head(counts[rank])
        else:
            if send.dtype != recv.dtype:
                raise InvalidBuffer(f"Reduce_scatter: sendbuf has dtype {send.dtype} but recvbuf has {recv.dtype}.")
            if recvcounts is None:
                counts = [int(c) for c in self.comm.allgather(np.array([recv.count], dtype=np.int64)).ravel()]
            else:
                counts = _counts(recvcounts, size)
            if send.count != sum(counts):
                raise InvalidBuffer(
                    f"Reduce_scatter: sendbuf must hold sum(recvcounts) = {sum(counts)} elements, got {send.count}."
                )
            if recv.count != counts[rank]:
                raise InvalidBuffer(
                    f"Reduce_scatter: recvbuf on rank {rank} must hold recvcounts[{rank}] = {counts[rank]} "
                    f"elements, got {recv.count}."
                )
            x, out = send.array, recv.array
            if same_memory(x, out):
                x = x.copy()
        return self._start("reduce_scatter", nonblocking, None, x, kop[0], counts=counts, out=out)

    # -- helpers --------------------------------------------------------------------------

    def _root(self, root) -> int:
        return check_rank(root, self._size, "root")

    def _start(self, collective, nonblocking, finish, *args, **kwargs):
        """Call the communicator's blocking form, or its ``i``-form wrapped in a :class:`Request`.

        ``finish`` (or None) runs once the operation has completed: it unpacks a
        receive buffer that MPI packed for the face.
        """
        if nonblocking:
            return Request(getattr(self.comm, "i" + collective)(*args, **kwargs), args, finish)
        self._blocking[collective](*args, **kwargs)
        if finish is not None:
            finish()
        return None

    def _pass(self, what, nonblocking, why, *args):
        """Run the wrapped communicator's own ``what`` (or its ``I``-form) with the caller's arguments."""
        name = "I" + what.lower() if nonblocking else what
        log.debug("%s runs mpi4py's %s: %s.", self.mpi.Get_name() or "a communicator", name, why)
        return getattr(self.mpi, name)(*args)

    def _raw(self, spec, name: str, *, blocks: int = 0, writable: bool = False) -> _Message:
        """A buffer spec as bytes (data-movement collectives); MPI packs what the face cannot view."""
        buf, count, displ, datatype = _split(spec, name)
        key = _cache_key(True, buf, count, displ, datatype, blocks)
        if key is not None:
            msg = self._views.get(key)
            if msg is not None and msg.source is buf and (not writable or buf.flags.writeable):
                return msg
        try:
            msg = _view(buf, count, displ, datatype, blocks, writable, name)
        except _Opaque as why:
            return self._packed(buf, count, displ, datatype, blocks, writable, name, why)
        array = msg.array
        if array.dtype is not _UINT8:
            array = array.view(_UINT8)
        return self._keep(key, buf, _Message(array, msg.count * msg.dtype.itemsize, _UINT8, blocks=blocks))

    def _typed(self, spec, name: str, op, *, blocks: int = 0, writable: bool = False) -> _Message:
        """A buffer spec of a reduction as a typed array; raises _PassThrough where MPI must reduce it.

        ``op`` is what :func:`_op` returns: the commkit op and the dtypes it runs on here.
        """
        buf, count, displ, datatype = _split(spec, name)
        key = _cache_key(False, buf, count, displ, datatype, blocks)
        msg = self._views.get(key) if key is not None else None
        if msg is None or msg.source is not buf or (writable and not buf.flags.writeable):
            try:
                msg = _view(buf, count, displ, datatype, blocks, writable, name)
            except _Opaque as why:
                raise _PassThrough(str(why)) from None
            msg = self._keep(key, buf, msg)
        if msg.dtype not in op[1]:
            raise _PassThrough(f"MPI does not define {op[0].name} for {msg.dtype}")
        return msg

    def _reduction_buffers(self, what, sendbuf, recvbuf, op):
        """The send and receive messages of a reduction at a rank that gets a result."""
        recv = self._typed(recvbuf, "recvbuf", op, writable=True)
        if _in_place(sendbuf):
            return recv, recv
        send = self._typed(sendbuf, "sendbuf", op)
        _match(what, send, recv)
        return send, recv

    def _keep(self, key, buf, msg: _Message) -> _Message:
        """Keep ``msg`` (the views of a plain NumPy array) for the next call with the same spec.

        The same views every call let the communicator replay the plan it
        compiled for them; the entry holds the array, so its id stays its own
        while the entry lives.
        """
        if key is not None and buf.nbytes <= _VIEW_BYTES:
            if len(self._views) >= _VIEWS:
                self._views.clear()
            msg.source = buf
            self._views[key] = msg
        return msg

    def _packed(self, buf, count, displ, datatype, blocks, writable, name, why) -> _Message:
        """The bytes of a spec as MPI packs them; for a receive buffer, ``finish`` unpacks the result into it."""
        log.debug("%s; MPI packs it for commkit's algorithm.", why)
        if self._self is None:
            self._self = MPI.COMM_SELF.Dup()
        local, n_blocks = self._self, max(blocks, 1)
        total = None if count is None else _index(count, name, "count") * n_blocks
        spec = [buf, total, displ, datatype]  # mpi4py's own parser reads it, and raises its own errors
        status = MPI.Status()
        sending = local.Isend(spec, 0, _PACK_TAG)
        message = local.Mprobe(0, _PACK_TAG, status)
        data = np.empty(status.Get_count(MPI.BYTE), np.uint8)
        message.Recv([data, MPI.PACKED])
        sending.Wait()
        if data.size % n_blocks:
            raise InvalidBuffer(f"{name}: {data.size} bytes do not split into {n_blocks} equal per-process blocks.")
        finish = None
        if writable:
            def finish():
                receiving = local.Isend([data, MPI.PACKED], 0, _PACK_TAG)
                local.Recv(spec, 0, _PACK_TAG)
                receiving.Wait()
        return _Message(data, data.size // n_blocks, _UINT8, finish, blocks)


class _MPIMethod:
    """A class attribute that reads the wrapped communicator's method of the same name."""

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, face, owner=None):
        if face is None:
            return self
        return getattr(face.mpi, self.name)  # AttributeError where mpi4py has none (Scan on an intercommunicator)


class _Intercomm(Comm):
    """A wrapped intercommunicator: every collective is MPI's own (commkit's algorithms are intra-group)."""

    for _name in ("Barrier", "Bcast", "Reduce", "Allreduce", "Scan", "Exscan", "Gather", "Scatter", "Allgather",
                  "Alltoall", "Reduce_scatter_block", "Reduce_scatter"):
        locals()[_name] = _MPIMethod()
        locals()["I" + _name.lower()] = _MPIMethod()
    del _name


class Request:
    """A nonblocking collective of this face, with mpi4py's request methods."""

    def __init__(self, pending, keep=(), finish=None):
        self._pending = pending
        self._keep = keep  # the user's buffers stay referenced until completion, as with mpi4py
        self._finish = finish

    def _completed(self) -> None:
        self._keep = ()
        finish, self._finish = self._finish, None
        if finish is not None:
            finish()

    def Wait(self, status=None) -> bool:
        """Block until the operation completes; returns True (as mpi4py does)."""
        self._pending.wait()
        self._completed()
        return True

    def Test(self, status=None) -> bool:
        """Make progress; return whether the operation has completed."""
        done = self._pending.test()
        if done:
            self._completed()
        return done

    @staticmethod
    def Waitall(requests, statuses=None) -> bool:
        """Wait for every request: these and ``MPI.Request`` alike, progressing all of them together."""
        requests = list(requests)
        statuses = _statuses(statuses, len(requests))
        if all(isinstance(r, MPI.Request) for r in requests):
            return MPI.Request.Waitall(requests, statuses)
        pending = list(range(len(requests)))
        sleep = 1e-6
        while pending:
            # Testing every request in turn (never waiting on one alone) keeps each
            # commkit schedule moving while MPI completes the others.
            still = [i for i in pending if not requests[i].Test(statuses[i] if statuses else None)]
            if len(still) == len(pending):
                time.sleep(sleep)
                sleep = min(sleep * 2, _MAX_SLEEP)
            else:
                sleep = 1e-6
            pending = still
        return True

    @staticmethod
    def Testall(requests, statuses=None) -> bool:
        """Make progress on every request; return whether all have completed."""
        requests = list(requests)
        statuses = _statuses(statuses, len(requests))
        done = [r.Test(statuses[i] if statuses else None) for i, r in enumerate(requests)]
        return all(done)


def _statuses(statuses, n):
    if statuses is None:
        return None
    statuses = list(statuses)
    if len(statuses) != n:
        raise InvalidArgument(f"statuses must hold one MPI.Status per request ({n}), got {len(statuses)}.")
    return statuses


# -- buffer specifications ----------------------------------------------------------------


class _Message:
    """A parsed buffer spec: a flat array over the message's memory and the per-block count.

    ``shaped`` is the array as ``(blocks, count)``, one row per process, for a
    spec read as per-process blocks (the array itself otherwise); ``finish`` is
    None, or (for a receive buffer MPI packed) what copies the result back into
    the user's memory once the operation has completed; ``source`` is the user's
    array for a message kept in a face's view cache.
    """

    __slots__ = ("_head", "_scratch", "array", "count", "dtype", "finish", "shaped", "source")

    def __init__(self, array, count, dtype, finish=None, blocks=0):
        self.array = array
        self.count = count
        self.dtype = dtype
        self.finish = finish
        self.shaped = array.reshape(blocks, count) if blocks else array
        self.source = None
        self._scratch = self._head = None

    def copy_of(self, view):
        """A copy of ``view`` (part of this message) that an in-place call reads while it writes the message.

        A kept message copies into the same array every call, so the
        communicator sees the same input and replays its plan (a receive buffer
        is in one operation at a time, so one copy per message suffices).
        """
        scratch = self._scratch
        if self.source is None or scratch is None or scratch.shape != view.shape:
            scratch = view.copy()
            if self.source is not None:
                self._scratch = scratch
            return scratch
        scratch[...] = view
        return scratch

    def head(self, n: int):
        """The first ``n`` entries (where an in-place reduce-scatter leaves its result); the same view every call."""
        head = self._head
        if head is None or len(head) != n:
            head = self.array[:n]
            if self.source is not None:
                self._head = head
        return head


def _in_place(spec) -> bool:
    """Whether ``spec`` asks for in-place operation: mpi4py reads None as ``MPI.IN_PLACE`` there."""
    return spec is _IN_PLACE or spec is None


def _split(spec, name: str):
    """``(buf, count, displ, datatype)`` of a buffer spec, unpacked as mpi4py's ``message_simple`` does."""
    if type(spec) is _ndarray or not isinstance(spec, (list, tuple)):
        if spec is None:
            raise InvalidBuffer(f"{name} must be a buffer or a [buffer, count, datatype] list, got None.")
        return spec, None, None, None
    count = displ = datatype = None
    if len(spec) == 2:
        buf, count = spec
        if isinstance(count, (_MPI_DATATYPE, str)):
            count, datatype = None, count
        elif isinstance(count, (list, tuple)):
            count, displ = count
    elif len(spec) == 3:
        buf, count, datatype = spec
        if isinstance(count, (list, tuple)):
            count, displ = count
    elif len(spec) == 4:
        buf, count, displ, datatype = spec
    else:
        raise InvalidBuffer(f"{name} as a list must have 2 to 4 items [buf, count, displ, datatype], got {len(spec)}.")
    return buf, count, displ, datatype


def _cache_key(raw: bool, buf, count, displ, datatype, blocks: int):
    """The view-cache key of a spec over a plain NumPy array (None for any other spec)."""
    if type(buf) is not _ndarray or (count is not None and count.__class__ is not int) or (
            displ is not None and displ.__class__ is not int):
        return None
    if datatype is None:
        typekey = buf.dtype
    elif datatype.__class__ is str:
        typekey = datatype
    elif isinstance(datatype, _MPI_DATATYPE) and datatype.handle in _DTYPES:
        typekey = datatype.handle  # predefined: a handle no other datatype takes
    else:
        return None
    return raw, id(buf), count, displ, typekey, blocks


def _view(buf, count, displ, datatype, blocks: int, writable: bool, name: str) -> _Message:
    """The message as a flat typed array over the user's memory, by mpi4py's count rules.

    ``blocks`` is the number of equal per-process blocks the buffer holds (0 for
    one message): an explicit count is per block, an inferred one is the
    buffer's length divided by ``blocks``.

    Raises:
        _Opaque: a derived or non-numeric datatype, ``MPI.BOTTOM``, or an object
            NumPy cannot view (MPI can still handle it).
        InvalidBuffer: an error mpi4py would raise too, or a count past the end.
    """
    dtype = None
    if datatype is not None:
        dtype = _dtype(datatype, name)
    if buf is None or buf is _BOTTOM:
        if dtype is not None and not count:  # no entries at no address: an empty message
            return _Message(np.empty(0, dtype), 0, dtype)
        raise _Opaque(f"{name} addresses MPI.BOTTOM")
    if type(buf) is _ndarray and count is None and displ is None and buf.flags.c_contiguous and (
            dtype is None or dtype is buf.dtype):
        # The common case: a whole C-ordered NumPy array.
        if not _numeric(buf.dtype):
            raise _Opaque(f"{name} has element type {buf.dtype}, which has no commkit equivalent")
        if writable and not buf.flags.writeable:
            raise InvalidBuffer(f"{name} is read-only; the face must write the result into it.")
        array = buf if buf.ndim == 1 else buf.reshape(-1)
        n_blocks = max(blocks, 1)
        if array.size % n_blocks:
            raise InvalidBuffer(
                f"{name}: {array.size} entries do not split into {n_blocks} equal per-process blocks."
            )
        return _Message(array, array.size // n_blocks, array.dtype)
    arr = _array(buf, name, writable)
    if dtype is None:
        dtype = arr.dtype
        if not _numeric(dtype):
            raise _Opaque(f"{name} has element type {dtype}, which has no commkit equivalent")
    if arr.flags.c_contiguous:
        flat = arr.reshape(-1)
    elif arr.flags.f_contiguous:
        flat = arr.T.reshape(-1)  # the transpose of an F-ordered array is C-ordered: memory order
    else:
        raise InvalidBuffer(f"{name} must be contiguous, as mpi4py requires; got strides {arr.strides}.")
    raw = flat.view(_UINT8) if flat.dtype is not _UINT8 else flat
    size = dtype.itemsize
    offset = _index(displ, name, "displacement") * size if displ is not None else 0
    if offset > raw.size:
        raise InvalidBuffer(
            f"{name}: displacement {offset // size} is past the end of a buffer of {raw.size // size} entries."
        )
    available = raw.size - offset
    n_blocks = max(blocks, 1)
    if count is None:
        if available % size:
            raise InvalidBuffer(
                f"{name}: buffer length {available} bytes is not a multiple of the {dtype} size {size}."
            )
        if (available // size) % n_blocks:
            raise InvalidBuffer(
                f"{name}: {available // size} entries do not split into {n_blocks} equal per-process blocks."
            )
        count = available // size // n_blocks
    else:
        count = _index(count, name, "count")
        if count * n_blocks * size > available:
            what = f"{n_blocks} blocks of {count}" if blocks else f"{count}"
            raise InvalidBuffer(
                f"{name}: count asks for {what} {dtype} entries but the buffer holds {available // size}."
            )
    array = raw[offset:offset + count * n_blocks * size]
    return _Message(array.view(dtype) if dtype is not _UINT8 else array, count, dtype)


def _dtype(datatype, name: str) -> np.dtype:
    """The NumPy dtype of a predefined MPI datatype (or mpi4py type code); _Opaque for any other."""
    if isinstance(datatype, str):
        code = datatype
        datatype = MPI._typedict.get(code)
        if datatype is None:
            raise InvalidBuffer(f"{name}: cannot map type code {code!r} to an MPI datatype.")
    if not isinstance(datatype, _MPI_DATATYPE):
        raise InvalidBuffer(f"{name}: expected an MPI datatype such as MPI.DOUBLE, got {type(datatype).__name__}.")
    dtype = _DTYPES.get(datatype.handle)
    if dtype is None:
        if datatype.is_predefined:
            raise _Opaque(f"{name} uses the predefined datatype {datatype.Get_name()}, which has no NumPy twin")
        combiner = _COMBINERS.get(datatype.Get_envelope()[-1], "derived")
        label = f"{combiner}, {datatype.Get_name()}" if datatype.Get_name() else combiner
        raise _Opaque(f"{name} uses a derived datatype ({label})")
    return dtype


def _array(buf, name: str, writable: bool):
    """A NumPy or CuPy array over ``buf``'s memory; writable where mpi4py would write into it."""
    if type(buf) is _ndarray:
        arr = buf
    else:
        try:
            arr = as_array(buf, name)
        except InvalidBuffer as why:
            raise _Opaque(str(why)) from None
    if writable and not _writeable(arr):
        alias = _legacy_dlpack_alias(buf, arr)
        if alias is None:
            raise InvalidBuffer(f"{name} is read-only; the face must write the result into it.")
        arr = alias
    return arr


def _writeable(arr) -> bool:
    return getattr(arr.flags, "writeable", True)  # CuPy arrays are always writeable and have no such flag


def _legacy_dlpack_alias(buf, arr):
    """A writable alias of host memory NumPy took from a legacy (unversioned) DLPack capsule, or None.

    NumPy marks such arrays read-only, since a legacy capsule cannot say whether
    its memory may be written; mpi4py writes into them, so the face does too. A
    versioned capsule states it, and NumPy follows what it says.
    """
    if type(arr) is not _ndarray or isinstance(buf, _ndarray) or not hasattr(buf, "__dlpack__"):
        return None
    if not (arr.flags.c_contiguous or arr.flags.f_contiguous):
        return None
    try:
        buf.__dlpack__(max_version=(1, 0), copy=False)
        return None  # a versioned capsule: its read-only flag stands
    except TypeError:
        pass
    if arr.nbytes == 0:
        return np.empty(arr.shape, arr.dtype)
    memory = (ctypes.c_char * arr.nbytes).from_address(arr.__array_interface__["data"][0])
    memory.keep = arr  # the capsule's owner lives as long as the alias
    return _ndarray(arr.shape, arr.dtype, buffer=memory, strides=arr.strides)


def _index(value, name: str, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise InvalidBuffer(f"{name}: {what} must be a non-negative int, got {value!r}.")
    return int(value)


def _counts(recvcounts, size: int) -> list:
    counts = list(recvcounts)
    if len(counts) != size or any(isinstance(c, bool) or not isinstance(c, (int, np.integer)) or c < 0
                                  for c in counts):
        raise InvalidArgument(f"recvcounts must be {size} non-negative ints (one per rank), got {counts!r}.")
    return [int(c) for c in counts]


def _match(what: str, send: _Message, recv: _Message, send_name="send count", recv_name="receive count") -> None:
    """mpi4py's check that send and receive buffers agree in datatype and count."""
    if send.dtype != recv.dtype:
        raise InvalidBuffer(f"{what}: mismatch in send and receive datatypes: {send.dtype} and {recv.dtype}.")
    if send.count != recv.count:
        raise InvalidBuffer(f"{what}: mismatch in {send_name} {send.count} and {recv_name} {recv.count}.")


def _not_in_place(spec, what: str, name: str, where: str) -> None:
    if spec is _IN_PLACE:
        raise InvalidBuffer(f"{what}: MPI.IN_PLACE is valid as {name} {where}.")


def _op(op) -> tuple[Op, frozenset]:
    """The commkit op for an ``MPI.Op`` (or a name / :class:`commkit.Op`) and the dtypes the face runs it on.

    Raises:
        _PassThrough: an ``MPI.Op`` commkit has no equivalent for (the same op on every rank).
    """
    if type(op) is _MPI_OP:
        found = _OP_DTYPES.get(op.handle)
        if found is None:
            raise _PassThrough(f"{_op_name(op)} has no commkit equivalent")
        return found
    if isinstance(op, (str, Op)):
        op = get_op(op)
        return op, _dtypes_for(op)
    raise _PassThrough(f"op {op!r} is not an MPI.Op commkit knows")


def _op_name(op) -> str:
    """``MPI.MAXLOC`` for a predefined op (mpi4py's ops have no names of their own), else what it is."""
    for name in ("MAXLOC", "MINLOC", "REPLACE", "NO_OP", "OP_NULL"):
        if op == getattr(MPI, name, None):
            return f"MPI.{name}"
    return "the user-defined op" if not op.is_predefined else f"the predefined op with handle {op.handle:#x}"
