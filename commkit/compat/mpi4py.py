"""mpi4py's buffer interface over commkit's collectives: switch a program by wrapping its communicator.

::

    from mpi4py import MPI
    from commkit.compat.mpi4py import wrap

    comm = wrap(MPI.COMM_WORLD)           # the one changed line
    comm.Allreduce(MPI.IN_PLACE, [x, MPI.DOUBLE], op=MPI.SUM)

What goes where, and why:

* Collectives (``Bcast``, ``Reduce``, ``Allreduce``, ``Gather``, ``Scatter``,
  ``Allgather``, ``Alltoall``, ``Reduce_scatter_block``, ``Reduce_scatter``,
  ``Scan``, ``Exscan``, ``Barrier`` and their ``I``-forms) parse mpi4py's
  buffer specifications -- ``buf``, ``[buf, datatype]``, ``[buf, count,
  datatype]``, ``[buf, (count, displ), datatype]``, ``[buf, count, displ,
  datatype]`` -- and ``MPI.IN_PLACE`` exactly as mpi4py does (the count of a
  receive buffer of ``Gather``/``Allgather``/``Alltoall`` is per process,
  inferred as ``len // size`` when omitted), then run commkit's algorithms on
  a :class:`commkit.Communicator` over the same MPI communicator. That
  communicator works on duplicated contexts, so its traffic never meets the
  program's own messages.
* Point-to-point (``Send``, ``Recv``, ``Sendrecv``, ``Isend``, ``Irecv``) goes
  to the wrapped mpi4py communicator untouched. commkit's point-to-point is
  that same MPI call, so nothing is gained by rerouting it, and passing it
  through keeps every detail of mpi4py (``Status`` counts in the message's
  datatype, ``MPI.Request`` objects that ``MPI.Request.Waitall`` accepts)
  and lets wrapped and unwrapped code exchange messages.
* Any other attribute (the pickle-based lowercase methods, ``Get_name``,
  ``Probe``, ``Allgatherv`` ...) falls through to the mpi4py communicator:
  those calls run MPI's own implementation.

Semantics follow mpi4py and the MPI standard, with one deliberate difference:
where mpi4py would let MPI read or write past the end of a buffer (a count
larger than the buffer), this face raises InvalidBuffer before anything is sent.
Not supported (InvalidBuffer/UnsupportedOp, raised on every rank alike):
derived datatypes, ``MPI.BOTTOM``, pair types with ``MPI.MAXLOC``/``MINLOC``,
``MPI.REPLACE``/``NO_OP`` and user ops from ``MPI.Op.Create`` (pass a
:class:`commkit.Op` instead), intercommunicators.

Nonblocking collectives return a :class:`Request`; ``Request.Waitall`` (and
``Testall``) accept a mix of these and mpi4py's own requests, and keep
progressing all of them, so no waiting order can deadlock.
"""

from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI
from mpi4py.util.dtlib import to_numpy_dtype

from .._checks import check_rank, same_memory
from ..communicator import Communicator
from ..errors import InvalidArgument, InvalidBuffer, UnsupportedOp
from ..ops import Op, get_op
from ..transports.mpi import MPITransport
from . import as_array

__all__ = ["wrap", "Comm", "Request"]

_MPI_OPS = ((MPI.SUM, "sum"), (MPI.PROD, "prod"), (MPI.MAX, "max"), (MPI.MIN, "min"), (MPI.LAND, "land"),
            (MPI.LOR, "lor"), (MPI.LXOR, "lxor"), (MPI.BAND, "band"), (MPI.BOR, "bor"), (MPI.BXOR, "bxor"))
_MAX_SLEEP = 1e-3


def wrap(comm, *, timeout: float | None = None, check: bool | None = None) -> Comm:
    """Wrap an mpi4py intracommunicator so its buffer collectives run commkit's algorithms.

    Collective: every rank of ``comm`` must call it (it duplicates ``comm``).

    Args:
        comm: an ``mpi4py.MPI.Intracomm`` such as ``MPI.COMM_WORLD`` (a
            :class:`Comm` is returned as it is).
        timeout, check: as for :func:`commkit.init`.
    """
    if isinstance(comm, Comm):
        return comm
    return Comm(comm, timeout=timeout, check=check)


class Comm:
    """An mpi4py communicator whose buffer collectives run commkit's algorithms.

    Attributes:
        mpi: the wrapped ``mpi4py.MPI.Intracomm``.
        comm: the :class:`commkit.Communicator` running the collectives
            (``comm.comm.last_algorithm`` tells which algorithm ran).
    """

    def __init__(self, comm, *, timeout: float | None = None, check: bool | None = None, _owned: bool = False):
        if not isinstance(comm, MPI.Comm):
            raise InvalidArgument(
                f"wrap expects an mpi4py communicator such as MPI.COMM_WORLD, got {type(comm).__name__}."
            )
        if comm == MPI.COMM_NULL:
            raise InvalidArgument("cannot wrap MPI.COMM_NULL; wrap a communicator this rank belongs to.")
        if comm.Is_inter():
            raise InvalidArgument("intercommunicators are not supported; wrap an intracommunicator.")
        self.mpi = comm
        self.comm = Communicator(MPITransport(comm), timeout=timeout, check=check)
        self._owned = _owned

    def __getattr__(self, name):
        if name in ("mpi", "comm"):  # not set yet (during unpickling or a failed __init__)
            raise AttributeError(name)
        return getattr(self.mpi, name)

    def __repr__(self) -> str:
        return f"<commkit.compat.mpi4py.Comm over {self.mpi!r}: rank {self.comm.rank} of {self.comm.size}>"

    # -- basics ----------------------------------------------------------------

    def Get_rank(self) -> int:
        """This process's rank."""
        return self.comm.rank

    def Get_size(self) -> int:
        """The number of processes."""
        return self.comm.size

    @property
    def rank(self) -> int:
        """This process's rank."""
        return self.comm.rank

    @property
    def size(self) -> int:
        """The number of processes."""
        return self.comm.size

    def Split(self, color: int = 0, key: int = 0):
        """Like ``MPI.Comm.Split``: a wrapped new communicator, or ``MPI.COMM_NULL`` for ``MPI.UNDEFINED``."""
        new = self.mpi.Split(color, key)
        if new == MPI.COMM_NULL:
            return new
        return Comm(new, timeout=self.comm.timeout, check=self.comm.check, _owned=True)

    def Dup(self) -> Comm:
        """A wrapped duplicate (collective)."""
        return Comm(self.mpi.Dup(), timeout=self.comm.timeout, check=self.comm.check, _owned=True)

    def Free(self) -> None:
        """Free commkit's contexts and the MPI communicator (as ``MPI.Comm.Free``; MPI refuses COMM_WORLD)."""
        self.comm.free()
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
        """Broadcast ``buf`` from ``root`` into ``buf`` on every other process."""
        self._bcast(buf, root, False)

    def Ibcast(self, buf, root: int = 0) -> Request:
        """Nonblocking :meth:`Bcast`."""
        return self._bcast(buf, root, True)

    def _bcast(self, buf, root, nonblocking):
        root = self._root(root)
        is_root = self.comm.rank == root
        msg = _message(buf, "buf", writable=not is_root)
        out = msg.array if msg.array.flags.writeable else None  # a read-only root buffer is only read
        return self._start("broadcast", nonblocking, (msg,), msg.array, root, out=out)

    def Reduce(self, sendbuf, recvbuf, op=MPI.SUM, root: int = 0) -> None:
        """Reduce onto ``root``'s ``recvbuf`` (ignored elsewhere); ``sendbuf=MPI.IN_PLACE`` at the root."""
        self._reduce(sendbuf, recvbuf, op, root, False)

    def Ireduce(self, sendbuf, recvbuf, op=MPI.SUM, root: int = 0) -> Request:
        """Nonblocking :meth:`Reduce`."""
        return self._reduce(sendbuf, recvbuf, op, root, True)

    def _reduce(self, sendbuf, recvbuf, op, root, nonblocking):
        op, root = _op(op), self._root(root)
        if self.comm.rank != root:
            _not_in_place(sendbuf, "Reduce", "sendbuf", "only at the root")
            send = _message(sendbuf, "sendbuf")
            return self._start("reduce", nonblocking, (send,), send.array, op, root)
        send, recv = self._reduction_buffers("Reduce", sendbuf, recvbuf)
        return self._start("reduce", nonblocking, (send, recv), send.array, op, root, out=recv.array)

    def Allreduce(self, sendbuf, recvbuf, op=MPI.SUM) -> None:
        """Reduce into every process's ``recvbuf``; ``sendbuf=MPI.IN_PLACE`` reduces ``recvbuf`` itself."""
        self._reduction("allreduce", "Allreduce", sendbuf, recvbuf, op, False)

    def Iallreduce(self, sendbuf, recvbuf, op=MPI.SUM) -> Request:
        """Nonblocking :meth:`Allreduce`."""
        return self._reduction("allreduce", "Allreduce", sendbuf, recvbuf, op, True)

    def Scan(self, sendbuf, recvbuf, op=MPI.SUM) -> None:
        """Inclusive prefix reduction: rank r gets the reduction of ranks 0..r."""
        self._reduction("scan", "Scan", sendbuf, recvbuf, op, False)

    def Iscan(self, sendbuf, recvbuf, op=MPI.SUM) -> Request:
        """Nonblocking :meth:`Scan`."""
        return self._reduction("scan", "Scan", sendbuf, recvbuf, op, True)

    def Exscan(self, sendbuf, recvbuf, op=MPI.SUM) -> None:
        """Exclusive prefix reduction: rank r gets the reduction of ranks 0..r-1.

        As in MPI, rank 0's ``recvbuf`` is undefined; this face leaves it untouched.
        """
        self._reduction("exscan", "Exscan", sendbuf, recvbuf, op, False)

    def Iexscan(self, sendbuf, recvbuf, op=MPI.SUM) -> Request:
        """Nonblocking :meth:`Exscan`."""
        return self._reduction("exscan", "Exscan", sendbuf, recvbuf, op, True)

    def _reduction(self, collective, what, sendbuf, recvbuf, op, nonblocking):
        op = _op(op)
        send, recv = self._reduction_buffers(what, sendbuf, recvbuf)
        # Rank 0's result of an exclusive scan is undefined: leave its buffer alone.
        out = None if collective == "exscan" and self.comm.rank == 0 else recv.array
        return self._start(collective, nonblocking, (send, recv), send.array, op, out=out)

    def _reduction_buffers(self, what, sendbuf, recvbuf):
        recv = _message(recvbuf, "recvbuf", writable=True)
        if sendbuf is MPI.IN_PLACE:
            return recv, recv
        send = _message(sendbuf, "sendbuf")
        _match(what, send, recv)
        return send, recv

    def Gather(self, sendbuf, recvbuf, root: int = 0) -> None:
        """Gather every process's ``sendbuf`` into ``root``'s ``recvbuf``, in rank order."""
        self._gather(sendbuf, recvbuf, root, False)

    def Igather(self, sendbuf, recvbuf, root: int = 0) -> Request:
        """Nonblocking :meth:`Gather`."""
        return self._gather(sendbuf, recvbuf, root, True)

    def _gather(self, sendbuf, recvbuf, root, nonblocking):
        root, rank, size = self._root(root), self.comm.rank, self.comm.size
        if rank != root:
            _not_in_place(sendbuf, "Gather", "sendbuf", "only at the root")
            send = _message(sendbuf, "sendbuf")
            return self._start("gather", nonblocking, (send,), send.array, root)
        recv = _message(recvbuf, "recvbuf", blocks=size, writable=True)
        x = self._own_block(sendbuf, recv, "Gather")
        return self._start("gather", nonblocking, (recv,), x, root, out=recv.blocks(size))

    def Scatter(self, sendbuf, recvbuf, root: int = 0) -> None:
        """Scatter ``root``'s ``sendbuf`` in rank-order blocks; ``recvbuf=MPI.IN_PLACE`` at the root."""
        self._scatter(sendbuf, recvbuf, root, False)

    def Iscatter(self, sendbuf, recvbuf, root: int = 0) -> Request:
        """Nonblocking :meth:`Scatter`."""
        return self._scatter(sendbuf, recvbuf, root, True)

    def _scatter(self, sendbuf, recvbuf, root, nonblocking):
        root, rank, size = self._root(root), self.comm.rank, self.comm.size
        if rank != root:
            _not_in_place(recvbuf, "Scatter", "recvbuf", "only at the root")
            recv = _message(recvbuf, "recvbuf", writable=True)
            return self._start("scatter", nonblocking, (recv,), None, root, out=recv.array)
        send = _message(sendbuf, "sendbuf", blocks=size)
        if recvbuf is MPI.IN_PLACE:
            out = None  # the root keeps its block where it is, in sendbuf
        else:
            recv = _message(recvbuf, "recvbuf", writable=True)
            _match("Scatter", send, recv, "per-process send count")
            out = recv.array
        return self._start("scatter", nonblocking, (send,), send.blocks(size), root, out=out)

    def Allgather(self, sendbuf, recvbuf) -> None:
        """Every process gets every process's ``sendbuf``, in rank order, in ``recvbuf``."""
        self._allgather(sendbuf, recvbuf, False)

    def Iallgather(self, sendbuf, recvbuf) -> Request:
        """Nonblocking :meth:`Allgather`."""
        return self._allgather(sendbuf, recvbuf, True)

    def _allgather(self, sendbuf, recvbuf, nonblocking):
        size = self.comm.size
        recv = _message(recvbuf, "recvbuf", blocks=size, writable=True)
        x = self._own_block(sendbuf, recv, "Allgather")
        return self._start("allgather", nonblocking, (recv,), x, out=recv.blocks(size))

    def _own_block(self, sendbuf, recv, what):
        """The array this rank contributes to a gather into ``recv`` (its block there with IN_PLACE)."""
        rank, count = self.comm.rank, recv.count
        if sendbuf is MPI.IN_PLACE:
            # Copied: the algorithm writes recvbuf while it may still read the input.
            return recv.array[rank * count:(rank + 1) * count].copy()
        send = _message(sendbuf, "sendbuf")
        _match(what, send, recv, "send count", "per-process receive count")
        return send.array.copy() if same_memory(send.array, recv.array) else send.array

    def Alltoall(self, sendbuf, recvbuf) -> None:
        """Block j of ``sendbuf`` goes to rank j; block j of ``recvbuf`` comes from rank j."""
        self._alltoall(sendbuf, recvbuf, False)

    def Ialltoall(self, sendbuf, recvbuf) -> Request:
        """Nonblocking :meth:`Alltoall`."""
        return self._alltoall(sendbuf, recvbuf, True)

    def _alltoall(self, sendbuf, recvbuf, nonblocking):
        size = self.comm.size
        recv = _message(recvbuf, "recvbuf", blocks=size, writable=True)
        if sendbuf is MPI.IN_PLACE:
            x = recv.blocks(size).copy()
        else:
            send = _message(sendbuf, "sendbuf", blocks=size)
            _match("Alltoall", send, recv, "per-process send count", "per-process receive count")
            x = send.blocks(size)
            if same_memory(x, recv.array):
                x = x.copy()
        return self._start("alltoall", nonblocking, (recv,), x, out=recv.blocks(size))

    def Reduce_scatter_block(self, sendbuf, recvbuf, op=MPI.SUM) -> None:
        """Reduce ``size`` equal blocks; rank r gets block r in ``recvbuf``.

        With ``sendbuf=MPI.IN_PLACE`` the input is all of ``recvbuf`` and the
        result lands in its first block.
        """
        self._reduce_scatter_block(sendbuf, recvbuf, op, False)

    def Ireduce_scatter_block(self, sendbuf, recvbuf, op=MPI.SUM) -> Request:
        """Nonblocking :meth:`Reduce_scatter_block`."""
        return self._reduce_scatter_block(sendbuf, recvbuf, op, True)

    def _reduce_scatter_block(self, sendbuf, recvbuf, op, nonblocking):
        op, size = _op(op), self.comm.size
        if sendbuf is MPI.IN_PLACE:
            recv = _message(recvbuf, "recvbuf", blocks=size, writable=True)
            x, out = recv.array.copy(), recv.array[:recv.count]
        else:
            recv = _message(recvbuf, "recvbuf", writable=True)
            send = _message(sendbuf, "sendbuf", blocks=size)
            _match("Reduce_scatter_block", send, recv, "per-process send count")
            x, out = send.array, recv.array
            if same_memory(x, out):
                x = x.copy()
        return self._start("reduce_scatter", nonblocking, (recv,), x, op, out=out)

    def Reduce_scatter(self, sendbuf, recvbuf, recvcounts=None, op=MPI.SUM) -> None:
        """Reduce, then give rank r the next ``recvcounts[r]`` elements.

        ``recvcounts=None`` takes each rank's count from its ``recvbuf``, at the
        cost of one blocking allgather of the counts first, as in mpi4py (not
        allowed with ``MPI.IN_PLACE``, where the input is ``recvbuf`` itself and
        the result lands at its start).
        """
        self._reduce_scatter(sendbuf, recvbuf, recvcounts, op, False)

    def Ireduce_scatter(self, sendbuf, recvbuf, recvcounts=None, op=MPI.SUM) -> Request:
        """Nonblocking :meth:`Reduce_scatter`."""
        return self._reduce_scatter(sendbuf, recvbuf, recvcounts, op, True)

    def _reduce_scatter(self, sendbuf, recvbuf, recvcounts, op, nonblocking):
        op, rank, size = _op(op), self.comm.rank, self.comm.size
        recv = _message(recvbuf, "recvbuf", writable=True)
        if sendbuf is MPI.IN_PLACE:
            if recvcounts is None:
                raise InvalidArgument("Reduce_scatter with sendbuf=MPI.IN_PLACE needs recvcounts (one count per rank).")
            counts = _counts(recvcounts, size)
            if sum(counts) != recv.count:
                raise InvalidBuffer(
                    f"Reduce_scatter with MPI.IN_PLACE reads all of recvbuf, so it must hold sum(recvcounts) = "
                    f"{sum(counts)} elements; got {recv.count}."
                )
            x, out = recv.array.copy(), recv.array[:counts[rank]]
        else:
            send = _message(sendbuf, "sendbuf")
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
        return self._start("reduce_scatter", nonblocking, (recv,), x, op, counts=counts, out=out)

    # -- helpers --------------------------------------------------------------------------

    def _root(self, root) -> int:
        return check_rank(root, self.comm.size, "root")

    def _start(self, collective, nonblocking, keep, *args, **kwargs):
        """Call the communicator's blocking form, or its ``i``-form wrapped in a :class:`Request`."""
        if nonblocking:
            return Request(getattr(self.comm, "i" + collective)(*args, **kwargs), keep)
        getattr(self.comm, collective)(*args, **kwargs)
        return None


class Request:
    """A nonblocking collective of this face, with mpi4py's request methods."""

    def __init__(self, pending, keep=()):
        self._pending = pending
        self._keep = keep  # the user's buffers stay referenced until completion, as with mpi4py

    def Wait(self, status=None) -> bool:
        """Block until the operation completes; returns True (as mpi4py does)."""
        self._pending.wait()
        self._keep = ()
        return True

    def Test(self, status=None) -> bool:
        """Make progress; return whether the operation has completed."""
        done = self._pending.test()
        if done:
            self._keep = ()
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
    """A parsed buffer spec: a flat array over the user's memory and the per-block count."""

    __slots__ = ("array", "count", "dtype")

    def __init__(self, array, count, dtype):
        self.array = array
        self.count = count
        self.dtype = dtype

    def blocks(self, size: int):
        """The array as ``(size, count)``: one row per process."""
        return self.array.reshape(size, self.count)


def _message(spec, name: str, *, blocks: int = 0, writable: bool = False) -> _Message:
    """Parse an mpi4py buffer spec, as mpi4py's ``message_simple`` does.

    ``blocks`` is the number of equal per-process blocks the buffer holds (0 for
    one message): an explicit count is per block, an inferred one is the
    buffer's length divided by ``blocks``.
    """
    if spec is MPI.IN_PLACE:
        raise InvalidBuffer(f"MPI.IN_PLACE is not valid as {name} here.")
    if spec is None or spec is MPI.BOTTOM:
        raise InvalidBuffer(f"{name} must be a buffer or a [buffer, count, datatype] list, got {spec!r}.")
    buf, count, displ, datatype = spec, None, None, None
    if isinstance(spec, (list, tuple)):
        if len(spec) == 2:
            buf, count = spec
            if isinstance(count, (MPI.Datatype, str)):
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
            raise InvalidBuffer(
                f"{name} as a list must have 2 to 4 items [buf, count, displ, datatype], got {len(spec)}."
            )
    arr = as_array(buf, name, writable=writable)
    if not (arr.flags.c_contiguous or arr.flags.f_contiguous):
        raise InvalidBuffer(f"{name} must be contiguous, as mpi4py requires; got strides {arr.strides}.")
    dtype = _dtype(datatype, name) if datatype is not None else arr.dtype
    if dtype.kind not in "biufc" or dtype.hasobject:
        raise InvalidBuffer(f"{name} has element type {dtype}; commkit's collectives move numeric and bool data.")
    raw = arr.reshape(-1, order="A").view(np.uint8)
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
    array = raw[offset:offset + count * n_blocks * size].view(dtype)
    return _Message(array, count, dtype)


def _dtype(datatype, name: str) -> np.dtype:
    if isinstance(datatype, str):
        try:
            datatype = MPI._typedict[datatype]
        except KeyError:
            raise InvalidBuffer(f"{name}: cannot map type code {datatype!r} to an MPI datatype.") from None
    if not isinstance(datatype, MPI.Datatype):
        raise InvalidBuffer(f"{name}: expected an MPI datatype such as MPI.DOUBLE, got {type(datatype).__name__}.")
    if not datatype.is_predefined:
        raise InvalidBuffer(
            f"{name} uses a derived datatype; commkit's collectives take predefined datatypes only "
            "(call the method on the wrapped communicator's .mpi to use MPI's own)."
        )
    try:
        return np.dtype(to_numpy_dtype(datatype))
    except (ValueError, TypeError, KeyError):
        raise InvalidBuffer(f"{name}: MPI datatype {datatype.Get_name()} has no NumPy equivalent.") from None


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
    if spec is MPI.IN_PLACE:
        raise InvalidBuffer(f"{what}: MPI.IN_PLACE is valid as {name} {where}.")


def _op(op) -> Op:
    """The commkit op for an ``MPI.Op`` (or a name / :class:`commkit.Op`, passed through)."""
    if isinstance(op, (str, Op)):
        return get_op(op)
    if isinstance(op, MPI.Op):
        for mpi_op, name in _MPI_OPS:
            if op == mpi_op:
                return get_op(name)
    raise UnsupportedOp(
        f"op {op!r} has no commkit equivalent; use MPI.SUM, PROD, MAX, MIN, LAND, LOR, LXOR, BAND, BOR or BXOR, "
        "or a commkit.Op (MPI.MAXLOC/MINLOC, REPLACE, NO_OP and MPI.Op.Create ops are not supported)."
    )
