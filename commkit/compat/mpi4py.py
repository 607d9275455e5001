"""mpi4py's buffer interface over commkit's collectives: switch a program by wrapping its communicator.

::

    from mpi4py import MPI
    from commkit.compat.mpi4py import wrap

    comm = wrap(MPI.COMM_WORLD)           # the one changed line
    comm.Allreduce(MPI.IN_PLACE, [x, MPI.DOUBLE], op=MPI.SUM)

What goes where:

* Collectives (``Bcast``, ``Reduce``, ``Allreduce``, ``Gather``, ``Scatter``,
  ``Allgather``, ``Alltoall``, ``Reduce_scatter_block``, ``Reduce_scatter``,
  ``Scan``, ``Exscan``, ``Barrier``), the vector collectives (``Allgatherv``,
  ``Gatherv``, ``Scatterv``, ``Alltoallv``), their ``I``-forms and their
  persistent ``*_init`` forms (MPI-4, as in mpi4py 4) take mpi4py's buffer
  specifications -- ``buf``, ``[buf, datatype]``, ``[buf, count, datatype]``,
  ``[buf, (count, displ), datatype]``, ``[buf, count, displ, datatype]``, and
  for a vector buffer ``[buf, counts, displs, datatype]``,
  ``[buf, (counts, displs), datatype]``, ``[buf, counts, datatype]`` ... with
  counts inferred, one count for every block, a stride or a list -- and
  ``MPI.IN_PLACE`` (or ``None``, as mpi4py reads it) wherever mpi4py does, over
  any buffer mpi4py takes (NumPy and CuPy arrays, ``array.array``,
  ``bytearray``, ``memoryview``, DLPack producers), and run commkit's
  algorithms on a :class:`commkit.Communicator` over duplicated contexts of the
  same MPI communicator, so its traffic never meets the program's own messages.
* The face *is* an ``MPI.Intracomm``: a subclass sharing the wrapped
  communicator's handle (as mpi4py's own ``util.pkl5`` and ``reductions``
  demo extend it), so every function of mpi4py that takes a communicator
  takes the face (``MPI.Comm(face)``, ``MPI.Comm.Compare``,
  ``MPI.Message.Iprobe``, ``MPI.Win.Allocate_shared``, ``MPI.File.Open``,
  ``mpi4py.util.pkl5``), and point-to-point, ``Alltoallw``, the neighborhood
  collectives and every method this module does not define are mpi4py's own,
  on the same handle, with every detail of mpi4py. Communicators made from it
  (``Dup`` with or without info, ``Clone``, ``Idup``, ``Split``,
  ``Split_type``, ``Create``, ``Create_group``) are faces; topologies and
  intercommunicators made from it are mpi4py's (wrapped, they are faces of
  mpi4py's topology classes, and an ``MPI.Intercomm`` whose every method is
  mpi4py's).
* The pickle-based ``bcast``, ``allgather``, ``reduce`` and ``allreduce``
  send a Python or NumPy scalar as its value through commkit's collectives
  (see "Lowercase methods" below); any other object runs mpi4py's own
  method.
* What commkit cannot compute goes to the wrapped communicator's own method
  for that call, in the same form (blocking, ``I`` or ``_init``; logged at
  debug level on the ``commkit.compat.mpi4py`` logger, with the reason): ops
  without a commkit equivalent (``MPI.MAXLOC``, ``MPI.REPLACE``,
  ``MPI.Op.Create`` ops), reductions over derived or pair datatypes, an op not
  defined for the datatype, and every call on an intercommunicator.

The one rule that keeps ranks together
--------------------------------------

One collective call must take the same road -- commkit or MPI -- on every
rank, or the ranks wait for each other forever. So the face decides from
arguments that MPI itself requires to be equal on every rank, never from what
only one rank can see:

* data-movement collectives (``Bcast``, ``Gather``, ``Scatter``,
  ``Allgather``, ``Alltoall`` and the four vector collectives) always run
  commkit's algorithms, and always on the bytes of the message. MPI lets ranks
  describe the same bytes with different datatypes (a root gathering matrix
  columns through a vector type while the others send plain ``MPI.DOUBLE``s),
  so the datatype cannot decide anything here. A buffer the face cannot view
  as one run of bytes -- a derived datatype, ``MPI.BOTTOM`` with absolute
  addresses, an object only mpi4py can read -- is packed and unpacked by MPI
  itself (a send to self, received as ``MPI.PACKED``), so every spec mpi4py
  accepts works, and mpi4py's own error is raised for one it rejects;
* reductions (``Reduce``, ``Allreduce``, ``Scan``, ``Exscan``,
  ``Reduce_scatter_block``, ``Reduce_scatter``) decide from the op and the
  datatype, which MPI requires to be the same on every rank: a mappable
  ``MPI.Op`` on a predefined numeric datatype runs in commkit, anything else
  runs MPI's reduction;
* ``IN_PLACE`` at a root (``Gather``, ``Scatter``, ``Reduce`` and the vector
  forms) changes only how the root lays out its own block, never the road;
* a persistent ``*_init`` call takes the road its blocking form would take,
  decided once, when the request is made: a :class:`Prequest` over commkit's
  persistent collective, or mpi4py's own ``MPI.Prequest``;
* an intercommunicator sends every collective to MPI, on every rank.

Vector collectives: counts are the same everywhere, displacements are local
---------------------------------------------------------------------------

commkit's vector collectives move contiguous blocks in rank order, and every
rank must pass them the same counts (they are part of the call's identity and
of the algorithm's choice). MPI requires only the *amounts* to match across
ranks; the displacements, and the datatype that measures a block, are each
rank's own. So the face turns every block into its size in bytes -- counts
times the datatype's size, the same number on every rank of a correct
program however each rank describes it -- and hands commkit those sizes.
Blocks that lie back to back in rank order (the prefix sums of the counts,
possibly from an offset) are read and written in the user's memory itself;
any other layout (gaps, blocks in another order, a stride) goes through a
contiguous staging buffer that the face copies from or into the blocks
locally, after the call; a layout only MPI can read (a derived datatype,
``MPI.BOTTOM``) is packed and unpacked by MPI through one hindexed datatype of
the blocks. No rank needs another's displacements, so no layout can send
ranks down different roads.

Where only some ranks know the counts -- ``Gatherv`` (the root knows them),
``Scatterv`` (the root) and ``Alltoallv`` (each rank knows its row and its
column) -- the face first exchanges the block sizes with one small allgather
on its communicator, on every rank alike. That exchange also checks each
rank's claim against the others' (a rank sending 24 bytes where the root's
``recvcounts`` say 16), so a mismatch raises the same
:class:`~commkit.InvalidBuffer` on every rank instead of leaving some waiting.
It costs the ``I``-forms of these three their independence: they return once
every rank has made the call (the data then moves as the request progresses),
where MPI's return at once; and their ``*_init`` forms exchange at init, which
then returns once every rank has made it (mpi4py's own ``Reduce_scatter_init``
without ``recvcounts`` does the same). ``Allgatherv`` needs no exchange: every
rank holds every count.

Errors the face raises itself come from its local checks of one rank's
buffers, at the places mpi4py checks them too (a read-only receive buffer, a
list of 5 items, send and receive counts that differ), before anything is
sent. One check is the face's own: where mpi4py would let MPI read or write
past the end of a buffer (a count larger than the buffer, a vector block past
its end), the face raises :class:`~commkit.InvalidBuffer`. Such a call is
wrong on that rank alone, and the other ranks wait for it exactly as they
would in mpi4py; a timeout (``wrap(comm, timeout=...)`` or
``COMMKIT_TIMEOUT``) turns that wait into :class:`~commkit.CommTimeout`.

Cost: the common calls (NumPy arrays, mpi4py's builtin op objects) take a
short path that checks types by identity and looks ops and datatypes up in
tables built at import, and hands the communicator the very same arrays (or,
for data movement, the same byte views of them, kept per array) on every call,
so that it replays the plan it compiled for them. The blocking collectives
take it for every buffer an earlier call parsed -- given plainly, as ``[buf,
datatype]`` or ``[buf, count, datatype]``, or as the receive buffer of an
``IN_PLACE`` call -- and for other buffers than NumPy arrays through a copy
kept per buffer (see ``_Staged``); anything else, and every error, takes the
general path. A persistent request parses nothing at all after its init.
``benchmarks/face_overhead.py`` and ``benchmarks/face_forms.py`` measure what
is left.

Lowercase methods
-----------------

Ranks may pass objects of different types to one ``allreduce`` (an int on
one rank, a float or a list on another), so no rank can decide alone whether
its object travels as a value. Every rank first shares a record of 32 bytes:
its value (an int within int64, a bool, float or complex, or a NumPy scalar
of a numeric type up to 16 bytes), or a mark that it is none of these.
``bcast`` broadcasts the root's record, the others allgather them. If every
object was a scalar, that was the whole call; otherwise every rank runs
mpi4py's own method, which pickles (one small collective more than mpi4py's
alone). A reduction applies mpi4py's own op to the objects in the
order mpi4py applies it (a binomial tree onto rank 0, lower ranks on the left;
a left fold with ``mpi4py.rc.fast_reduce = False``), so the result is
mpi4py's to the bit and to the type (``MPI.SUM`` of bools is an int,
``MPI.MAX(1, True)`` is 1). These calls take the communicator's locks that
mpi4py's own take (``MPI._comm_lock_table``).

Requests
--------

Nonblocking collectives return a :class:`Request`, persistent ones a
:class:`Prequest` (``Start``, ``Wait``, ``Test``, ``Free``; what the face
copies from the user's memory or MPI packs is redone at every ``Start``, what
MPI unpacks at every completion). ``Request.Waitall`` (and ``Testall``) accept
a mix of these and mpi4py's own requests, and keep progressing all of them, so
no waiting order can deadlock; ``Request.Startall`` starts any mix of
persistent requests. mpi4py's own ``MPI.Request.Waitall`` and
``MPI.Prequest.Startall`` take only mpi4py's requests and cannot be made to
take these: they hand MPI the requests' C handles, and a commkit collective
has none -- it is a schedule that Python code advances, which MPI's wait would
never run. Use the face's helpers for mixed lists (on lists of mpi4py's own
requests they call mpi4py's).
"""

from __future__ import annotations

import array
import ctypes
import functools
import logging
import mmap
import threading
import weakref
from functools import partial

import mpi4py
import numpy as np
from mpi4py import MPI
from mpi4py.util.dtlib import to_numpy_dtype

from .._checks import array_module, check_rank, owners_apart, same_memory
from ..communicator import GENERAL, Communicator
from ..errors import InvalidArgument, InvalidBuffer
from ..ops import Op, get_op
from .._wait import Backoff
from ..transports.mpi import MPITransport, install_abort_on_exception
from . import as_array

__all__ = ["Comm", "Prequest", "Request", "wrap"]

log = logging.getLogger("commkit.compat.mpi4py")

_ndarray = np.ndarray
_IN_PLACE = MPI.IN_PLACE
_BOTTOM = MPI.BOTTOM
_MPI_OP = MPI.Op
_MPI_DATATYPE = MPI.Datatype
_UINT8 = np.dtype(np.uint8)
_NUMERIC = "biufc"
_PACK_TAG = 0
# Byte views of plain NumPy arrays a face keeps, and up to what size: like the
# communicator's compiled plans (which they let it reuse), they keep small arrays alive.
_VIEWS = 32
_VIEW_BYTES = 1 << 20
# Buffers NumPy must view afresh at every call (a kept view would hold an export of their
# memory, and the program could no longer resize a bytearray, close an mmap or release a
# memoryview), which a blocking call moves through a kept copy up to this size: see _Staged.
_STAGED_TYPES = frozenset((bytearray, bytes, array.array, mmap.mmap, memoryview))
_TYPEDICT = MPI._typedict  # the buffer formats mpi4py maps to a datatype (a memoryview's .format)
_STAGE_BYTES = 64 << 10
_weakref = weakref.ref

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


# The element types whose bytes the face moves as they lie: the numeric ones, found by one set lookup at a call.
_VIEWABLE = frozenset(dtype for dtype in map(np.dtype, np.typecodes["All"]) if _numeric(dtype))


def _predefined_dtypes() -> dict[int, np.dtype]:
    """Every predefined MPI datatype with a numeric NumPy equivalent, by handle."""
    table = {}
    names = [n for n in dir(MPI) if n.isupper() and isinstance(getattr(MPI, n), MPI.Datatype)]
    for datatype in [getattr(MPI, n) for n in names]:
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

# The lowercase (pickle) methods: what one rank's object becomes in a fixed record of four
# int64s -- [kind, unused, 16 bytes of value] -- that every rank can read. A Python int
# (within int64), bool, float or complex, or a NumPy scalar of a numeric type up to 16
# bytes, travels as its value; anything else (a larger int included) marks the call as
# one for mpi4py's own method, which pickles.
_INT, _BOOL, _FLOAT, _COMPLEX, _PICKLED = 1, 2, 3, 4, 5
_SCALAR_DTYPES: dict[int, np.dtype] = {}
for _code in "?bhilqpBHILQPefdgFD":
    _d = np.dtype(_code)
    if _d.itemsize <= 16 and _d.type not in {d.type for d in _SCALAR_DTYPES.values()}:
        _SCALAR_DTYPES[6 + len(_SCALAR_DTYPES)] = _d
del _code, _d
_SCALAR_KINDS = {d.type: kind for kind, d in _SCALAR_DTYPES.items()}
_INT64 = (-(1 << 63), (1 << 63) - 1)
_FAST_REDUCE = bool(getattr(mpi4py.rc, "fast_reduce", True))  # read by mpi4py when MPI is imported, as here


def wrap(comm, *, timeout: float | None = None, check: bool | None = None) -> Comm:
    """Wrap an mpi4py communicator so its buffer collectives run commkit's algorithms.

    Collective: every rank of ``comm`` must call it (it duplicates ``comm``).

    Args:
        comm: an ``mpi4py.MPI.Comm`` such as ``MPI.COMM_WORLD`` (a :class:`Comm`
            is returned as it is). An intercommunicator is wrapped too; all its
            collectives run MPI's own.
        timeout, check: as for :func:`commkit.init`.

    As :func:`commkit.init` does, it makes an uncaught exception on any rank end
    the whole MPI job (the traceback is printed, then ``MPI_Abort``), as
    ``python -m mpi4py`` does, so a rank that dies of a bad argument does not leave
    the others waiting in their next collective; ``COMMKIT_ABORT_ON_EXCEPTION=0``
    keeps Python's default.

    Raises:
        InvalidArgument: ``comm`` is not an mpi4py communicator, or is ``MPI.COMM_NULL``.
    """
    if isinstance(comm, (Comm, _Intercomm)):
        return comm
    face = Comm(comm, timeout=timeout, check=check)
    install_abort_on_exception()
    return face


class _PassThrough(Exception):
    """This call runs the wrapped communicator's own method; the message says why."""


class _Opaque(Exception):
    """The face cannot view this buffer spec as one typed run of memory; the message says why."""


_NOTHING = object()  # matches no argument: the empty state of a last-call cache
_NO_MEMO = (_NOTHING,) * 4 + (None, None)  # the data-movement memos' (see Comm._memo)
_NO_REDUCE_MEMO = (_NOTHING,) * 6  # Allreduce's and Reduce's (see Comm._reduce_memo)


# The one commkit collective each face method runs (a method that may run more, such as Reduce_scatter with its
# counts' allgather, is not here): a call refused on one rank drops only that collective's messages (see
# Communicator._drop_stale).
_RUNS_AS = {"Bcast": "broadcast", "Reduce": "reduce", "Gather": "gather", "Scatter": "scatter",
            "Allgather": "allgather", "Alltoall": "alltoall", "Reduce_scatter_block": "reduce_scatter"}


def _announced(what: str | None):
    """A face call whose arguments fail on one rank still counts as made there; in check mode it fails everywhere.

    The face checks arguments where mpi4py does, on each rank's own buffers, so
    a bad one raises on that rank only (:meth:`commkit.Communicator.announce_errors`).
    The call counts as made on that rank, as on the ranks that went on with it,
    so nothing they sent it for the call is taken for a later call's data. With
    the communicator in check mode (``COMMKIT_DEBUG=check`` or ``wrap(comm,
    check=True)``) the error is announced first: the other ranks' call raises
    :class:`commkit.errors.PeerFailed` naming the rank and its error, and nobody
    waits. A persistent ``*_init`` is local: it is never announced, and one
    that fails on one rank still takes its number among persistent requests.
    ``what`` None: the call's second argument names it (``_reduction``).

    Whatever way the call ends, the fresh views of the buffers it staged go
    (see :class:`_Staged`).
    """
    def wrap(fn):
        @functools.wraps(fn)
        def run(self, *args):
            comm = self.comm
            try:
                with comm.announce_errors(what or args[1], persistent=isinstance(args[-1], _Init),
                                          kind=_RUNS_AS.get(what) if what else args[0]):
                    return fn(self, *args)
            finally:
                if self._attached:
                    self._detach()
        return run
    return wrap


class Comm(MPI.Intracomm):
    """An mpi4py intracommunicator whose buffer collectives run commkit's algorithms.

    It *is* an ``MPI.Intracomm`` (a subclass sharing the wrapped communicator's
    handle, as mpi4py's ``util.pkl5.Intracomm`` is), so every mpi4py function
    that takes a communicator takes it -- ``MPI.Comm(face)``,
    ``MPI.Comm.Compare``, ``MPI.Message.Iprobe(face)``, ``MPI.Win.Allocate_shared``,
    ``MPI.File.Open``, ``mpi4py.util.pkl5`` -- and every method this class does
    not define is mpi4py's own on the same handle. Communicators made from it
    (``Dup``, ``Clone``, ``Idup``, ``Split``, ``Create``, ``Create_group`` ...)
    are faces too; topologies and intercommunicators made from it are mpi4py's.

    Attributes:
        mpi: a plain mpi4py communicator with the same handle (the one given to
            :func:`wrap`, where it made this face).
        comm: the :class:`commkit.Communicator` running the collectives
            (``comm.comm.last_algorithm`` tells which algorithm ran).
    """

    def __new__(cls, comm=None, *, timeout: float | None = None, check: bool | None = None):
        if cls is Comm and isinstance(comm, MPI.Comm) and comm != MPI.COMM_NULL:
            if comm.Is_inter():
                return _Intercomm(comm)
            cls = _TOPOLOGIES.get(comm.Get_topology(), cls)
        # With no communicator this is mpi4py's own New(type(self)) in Dup, Clone and Idup:
        # a null handle that MPI then fills, and the face's method sets up (see _derived).
        return MPI.Intracomm.__new__(cls, comm if isinstance(comm, MPI.Comm) else None)

    def __init__(self, comm, *, timeout: float | None = None, check: bool | None = None):
        if not isinstance(comm, MPI.Comm):
            raise InvalidArgument(
                f"wrap expects an mpi4py communicator such as MPI.COMM_WORLD, got {type(comm).__name__}."
            )
        if comm == MPI.COMM_NULL:
            raise InvalidArgument("cannot wrap MPI.COMM_NULL; wrap a communicator this rank belongs to.")
        self._attach(comm, timeout, check)
        self._connect()

    def _attach(self, mpi, timeout, check) -> None:
        """The face's local state; nothing here calls MPI (an ``Idup``'s handle is not usable yet)."""
        self.mpi = mpi
        self._timeout, self._check = timeout, check
        self._self = None  # MPI.COMM_SELF duplicate that packs what the face cannot view, made on first use
        self._views: dict = {}  # parsed specs over plain NumPy arrays: see _keep
        self._stages: dict = {}  # kept copies of other buffers' messages, for blocking calls: see _Staged
        self._byte_views: dict = {}  # the byte views of the NumPy arrays of the last few calls: see _bytes_of
        self._attached: list = []  # the _Staged messages of the call under way that hold a view to let go
        self._apart_pair = (_NOTHING, _NOTHING)  # the last kept send and receive messages found apart: see _apart
        self._arrays_apart_pair = (_NOTHING, _NOTHING)  # the last NumPy arrays found apart: see _arrays_apart
        # The arguments of the last Allreduce that took the short path, and what they became:
        # (sendbuf, recvbuf, op, x, commkit op, the communicator's plan for them once it has one).
        # A loop repeating one call skips _short, and runs the plan while plan.ready() holds.
        self._hot_allreduce = _NO_REDUCE_MEMO
        # The last buffer Bcast, Gather, Scatter (its recvbuf) and Allgather handed to the communicator's entry,
        # weakly (as the communicator holds its own last call's arrays: it keeps no program's array alive).
        self._new_bcast = self._new_gather = self._new_scatter = self._new_allgather = None
        self._entry_op = (_NOTHING,) * 3  # the last MPI op and dtype of an Allreduce handed to the entry: see Allreduce
        self._hot_reduce = _NO_REDUCE_MEMO  # Reduce's: (sendbuf, recvbuf, op, root, x, plan), see _reduce_memo
        # The last Bcast, Gather, Scatter, Allgather and Alltoall of plain NumPy arrays, or of IN_PLACE and one
        # (see _memo): a loop repeating one of them on its arrays runs the communicator's plan for them, while it may.
        self._hot_bcast = self._hot_gather = self._hot_scatter = self._hot_allgather = self._hot_alltoall = _NO_MEMO
        # The last call of each blocking collective above on kept copies of other buffers (see _Staged, _move_memo).
        self._moved_allreduce = self._moved_reduce = self._moved_bcast = self._moved_gather = self._moved_scatter = \
            self._moved_allgather = self._moved_alltoall = _NO_MOVE

    def _connect(self) -> None:
        """Make the commkit communicator (collective: it duplicates the handle twice)."""
        # A plain twin of the handle: the transport duplicates it with mpi4py's own Dup, never the face's.
        self.comm = Communicator(MPITransport(MPI.Intracomm(self)), timeout=self._timeout, check=self._check)
        # The communicator's blocking methods, bound once for the per-call path.
        self._blocking = {name: getattr(self.comm, name) for name in (
            "broadcast", "reduce", "allreduce", "scan", "exscan", "gather", "scatter", "allgather", "alltoall",
            "reduce_scatter", "allgatherv", "gatherv", "scatterv", "alltoallv")}
        self._allreduce = self._blocking["allreduce"]

    def __getattr__(self, name):
        # Only for what a face made by Idup sets up late: its rank and size once MPI has
        # completed the duplicate, its commkit communicator at its first collective that
        # runs commkit (every rank makes that same call, so it is made collectively).
        if name in ("_rank", "_size"):
            self._rank, self._size = MPI.Intracomm.Get_rank(self), MPI.Intracomm.Get_size(self)
            return self.__dict__[name]
        if name in ("comm", "_blocking", "_allreduce") and "mpi" in self.__dict__ and self:
            self._connect()
            return self.__dict__[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __repr__(self) -> str:
        if not self:
            return "<commkit.compat.mpi4py.Comm: freed>"
        return f"<commkit.compat.mpi4py.Comm over {self.mpi!r}, commkit's collectives: rank {self._rank} of {self._size}>"

    # -- basics ----------------------------------------------------------------

    def Get_rank(self) -> int:
        """This process's rank."""
        return self._rank

    def Get_size(self) -> int:
        """The number of processes."""
        return self._size

    @property
    def rank(self) -> int:
        """This process's rank."""
        return self._rank

    @property
    def size(self) -> int:
        """The number of processes."""
        return self._size

    # -- communicators made from this one: faces too --------------------------------

    def _derived(self, new, connect: bool = True):
        """``new`` (a communicator mpi4py just made from this one) as a face with this face's settings."""
        if new == MPI.COMM_NULL:
            return new
        if not isinstance(new, Comm):
            return Comm(new, timeout=self._timeout, check=self._check)
        new._attach(_plain(new), self._timeout, self._check)
        if connect:
            new._connect()
        return new

    def Dup(self, info=None) -> Comm:
        """A face over a duplicate (collective; ``info`` as for ``MPI.Comm.Dup``)."""
        return self._derived(MPI.Intracomm.Dup(self, info))

    def Dup_with_info(self, info) -> Comm:
        """A face over a duplicate with hints (collective)."""
        return self._derived(MPI.Intracomm.Dup_with_info(self, info))

    def Clone(self) -> Comm:
        """A face over a duplicate (collective)."""
        return self._derived(MPI.Intracomm.Clone(self))

    def Idup(self, info=None):
        """Nonblocking duplicate: ``(face, MPI.Request)``; use the face once the request has completed.

        The face makes its commkit communicator at its first collective that
        runs commkit, so completing the request stays local, as in MPI.
        """
        new, request = MPI.Intracomm.Idup(self, info)
        return self._derived(new, connect=False), request

    def Idup_with_info(self, info):
        """Nonblocking duplicate with hints (as :meth:`Idup`)."""
        new, request = MPI.Intracomm.Idup_with_info(self, info)
        return self._derived(new, connect=False), request

    def Split(self, color: int = 0, key: int = 0):
        """Like ``MPI.Comm.Split``: a face over the new communicator, or ``MPI.COMM_NULL`` for ``MPI.UNDEFINED``."""
        return self._derived(MPI.Intracomm.Split(self, color, key))

    def Split_type(self, split_type: int, key: int = 0, info=MPI.INFO_NULL):
        """Like ``MPI.Comm.Split_type``: a face, or ``MPI.COMM_NULL``."""
        return self._derived(MPI.Intracomm.Split_type(self, split_type, key, info))

    def Create(self, group):
        """Like ``MPI.Comm.Create``: a face for the members of ``group``, ``MPI.COMM_NULL`` elsewhere."""
        return self._derived(MPI.Intracomm.Create(self, group))

    def Create_group(self, group, tag: int = 0):
        """Like ``MPI.Intracomm.Create_group`` (collective over ``group`` only): a face, or ``MPI.COMM_NULL``."""
        return self._derived(MPI.Intracomm.Create_group(self, group, tag))

    def Free(self) -> None:
        """Free the MPI communicator, then commkit's contexts (as ``MPI.Comm.Free``; MPI refuses COMM_WORLD).

        MPI frees first: where it refuses (a predefined or an already freed
        communicator) it raises mpi4py's error and the face keeps working.
        """
        MPI.Intracomm.Free(self)
        self._views.clear()
        self._stages.clear()
        self._byte_views.clear()
        comm = self.__dict__.get("comm")
        if comm is not None:
            comm.free()
        if self._self is not None:
            self._self.Free()
            self._self = None

    # -- the pickle-based lowercase methods ----------------------------------------------
    #
    # mpi4py pickles every object; for a scalar the face sends its value instead. Ranks may
    # pass objects of different types to one call (an int here, a float there, a list
    # elsewhere), so no rank can choose the road alone: every rank first shares a fixed
    # record of its object (its value, or a mark that it is no scalar), and the records
    # decide for all: values, or mpi4py's own method for everyone. Reductions then apply mpi4py's own op to the objects, in the order mpi4py's
    # tree would (_mpi4py_order), so the result -- its type, a bool sum, a float's last bit
    # -- is the one mpi4py returns.

    def bcast(self, obj=None, root: int = 0):
        """mpi4py's ``bcast``: ``root``'s object on every rank (a scalar travels as its value, not pickled)."""
        if root.__class__ is not int or not 0 <= root < self._size:
            return MPI.Intracomm.bcast(self, obj, root)  # mpi4py's own error
        records = self._object_records()
        rec = records.sent
        lock = records.bcast_lock
        lock.acquire()
        try:
            if self._rank == root:
                _encode(obj, rec)
            plan = records.bcast_plan
            if plan is not None and records.bcast_root == root and plan.steady():
                plan.run()
            else:
                self._blocking["broadcast"](rec, root, out=rec)
                records.bcast_plan, records.bcast_root = self.comm.plan_of("broadcast", rec, rec, root), root
            if rec[0] != _PICKLED:
                return _decode(rec)
        finally:
            lock.release()
        return MPI.Intracomm.bcast(self, obj, root)

    def allgather(self, sendobj):
        """mpi4py's ``allgather``: every rank's object, in rank order (scalars travel as their values)."""
        objects = self._gathered(sendobj, None)
        return MPI.Intracomm.allgather(self, sendobj) if objects is None else objects

    def allreduce(self, sendobj, op=MPI.SUM):
        """mpi4py's ``allreduce``: ``op`` over every rank's object, the very result mpi4py gives (scalars unpickled).

        ``op`` (an ``MPI.Op`` or a function of two objects) is applied as mpi4py
        applies it, in the same order. Where any rank's object is not a scalar,
        every rank runs mpi4py's own method.
        """
        if not callable(op):
            return MPI.Intracomm.allreduce(self, sendobj, op)
        objects = self._gathered(sendobj, None)
        if objects is None:
            return MPI.Intracomm.allreduce(self, sendobj, op)
        if len(objects) == 2:  # (_mpi4py_order's first case, written out: the commonest call)
            return op(objects[0], objects[1])
        return _mpi4py_order(objects, op)

    def reduce(self, sendobj, op=MPI.SUM, root: int = 0):
        """mpi4py's ``reduce``: ``op`` over every rank's object at ``root`` (None elsewhere), as :meth:`allreduce`."""
        if not callable(op) or root.__class__ is not int or not 0 <= root < self._size:
            return MPI.Intracomm.reduce(self, sendobj, op, root)
        objects = self._gathered(sendobj, root)
        if objects is None:
            return MPI.Intracomm.reduce(self, sendobj, op, root)
        return _mpi4py_order(objects, op) if self._rank == root else None

    def _object_records(self):
        """The face's records of the lowercase methods' objects (:class:`_Records`), made at the first such call."""
        records = self.__dict__.get("_records")
        if records is None:
            records = self._records = _Records(self._size, MPI._comm_lock_table(self))
        return records

    def _gathered(self, sendobj, root):
        """Every rank's object, on every rank (``root`` None) or at ``root`` (an empty list elsewhere).

        None, on every rank, where some rank's object is not a scalar: the
        caller then runs mpi4py's own method, which pickles.
        """
        records = self.__dict__.get("_records") or self._object_records()
        lock = records.allgather_lock
        lock.acquire()
        try:
            if sendobj.__class__ is float:  # _encode's commonest case, written out
                records.mine_q[0] = _FLOAT
                records.mine_d[2] = sendobj
            else:
                _encode(sendobj, records.mine)
            plan = records.allgather_plan
            if plan is not None and plan.steady():
                plan.run()
            else:
                self._blocking["allgather"](records.mine, out=records.every)
                records.allgather_plan = self.comm.plan_of("allgather", records.mine, records.every)
            every_q = records.every_q
            kinds = set(every_q[::4])
            if _PICKLED in kinds:
                return None
            if root is not None and self._rank != root:
                return []
            if len(kinds) == 1:  # every rank sent the same kind: all at once
                kind = kinds.pop()
                if kind == _FLOAT:
                    return records.every_d[2::4].tolist()
                if kind == _INT:
                    return every_q[2::4].tolist()
            return [_decode(r) for r in records.every]
        finally:
            lock.release()

    # -- collectives ---------------------------------------------------------------------
    #
    # One worker per collective takes a ``mode``: False (the blocking call), True (its
    # I-form) or an _Init (its persistent *_init form). The worker parses the buffers and
    # decides the road, the same way for all three; _start then runs the chosen form.
    # ``prep`` (a list for *_init, else None) collects what must be redone at every
    # Start: copies the face takes of the user's memory, and what MPI packs for it.

    def Barrier(self) -> None:
        """Block until every process has called Barrier."""
        self.comm.barrier()

    def Ibarrier(self) -> Request:
        """Nonblocking :meth:`Barrier`."""
        return Request(self.comm.ibarrier())

    def Barrier_init(self, info=MPI.INFO_NULL) -> Prequest:
        """Persistent :meth:`Barrier` (MPI-4 ``MPI_Barrier_init``): ``Start()``/``Wait()`` as often as needed.

        ``info`` is accepted and ignored, as MPI allows for hints.
        """
        return Prequest(self.comm.barrier_init())

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
        if buf.__class__ is list:  # [buf, T] or [buf, n, T]: see _whole
            buf = _whole(buf)
        h = self._hot_bcast
        plan = h[4]
        if plan is not None and h[0] is buf and h[2] is root and _still_plain(buf) and plan.steady():
            plan.run()
            return
        if buf.__class__ is _ndarray and buf.ndim == 1 and buf.dtype in _VIEWABLE:
            # A new vector, of the kinds of the communicator's last new-array broadcast: straight to that entry,
            # which checks the rest (installed only while no check mode holds, see Communicator._fresh). The
            # vector of the last call here or of the memo again takes the way below, which gives a loop on it a
            # plan of its own as soon as before.
            entry = self.comm._new_broadcast
            if (entry is not None and buf is not h[0] and buf.flags.c_contiguous
                    and not ((last := self._new_bcast) is not None and last() is buf)):
                data = buf.view(_BYTE)
                if entry(data, data, None, None, root, None) is not GENERAL:
                    self._new_bcast = _weakref(buf)
                    return
        if root.__class__ is int and 0 <= root < self._size:
            if buf.__class__ in _STAGED_TYPES and (buf.__class__ is not memoryview or buf.format in _TYPEDICT) \
                    and (data := _fresh_bytes(buf)) is not None:
                # Another buffer (a bytearray, an mmap ...), new or not: a fresh byte view for this call alone
                # (it lets go when the call returns, so the program can resize or close the buffer), to the
                # communicator's entry for it, or its broadcast, which makes that entry by the next call or two.
                # A kept copy (below) costs more; one NumPy cannot view, or read-only, or a memoryview whose format
                # mpi4py maps to no datatype (a structured array's 'T{...}'), goes below, which raises as mpi4py.
                entry = self.comm._new_broadcast
                if entry is not None and entry(data, data, None, None, root, None) is not GENERAL:
                    return
                if data.flags.writeable and not self.comm.check:
                    self._blocking["broadcast"](data, root, out=data)
                    return
            if _plain_array(buf) and not self.comm.check:  # a NumPy array, new or not
                # Its bytes, in place, as the general path moves them (every rank's message alike, whatever
                # form each rank gave its buffer in).
                data = self._bytes_of(buf)
                self._blocking["broadcast"](data, root, out=data)
                self._hot_bcast = self._memo(h, "broadcast", buf, None, data, data, root)
                return
            if self._moved_bcast[2] == root and self._moved("_moved_bcast", buf, None):
                return
            at_root = self._rank == root
            msg = self._kept(buf, 0, not at_root, fill=at_root)  # the short path: a buffer seen before
            if msg is not None:
                # As the general path: the root's buffer is only read, and written only where it may be.
                out = msg.array if not at_root or _writeable(msg.array) else None
                self._run_kept(self._blocking["broadcast"], msg.array, root, out=out)
                self._moved_bcast = _move_memo("broadcast", root, buf, _UNREAD, ((msg, 0, at_root),), msg.array, out)
                return
        self._bcast(buf, root, False)

    def Ibcast(self, buf, root: int = 0) -> Request:
        """Nonblocking :meth:`Bcast`."""
        return self._bcast(buf, root, True)

    def Bcast_init(self, buf, root: int = 0, info=MPI.INFO_NULL) -> Prequest:
        """Persistent :meth:`Bcast` (MPI-4 ``MPI_Bcast_init``): each ``Start()`` sends what the root's ``buf`` holds.

        Arguments and errors as for :meth:`Bcast`; ``info`` is accepted and ignored.
        """
        return self._bcast(buf, root, _Init(info))

    @_announced('Bcast')
    def _bcast(self, buf, root, mode):
        root = self._root(root)
        is_root = self._rank == root
        prep = _prep(mode)
        msg = self._raw(buf, "buf", writable=not is_root, blocking=mode is False)
        out = msg.array if _writeable(msg.array) else None  # a read-only root buffer is only read
        x = self._payload(msg, prep) if is_root else msg.array
        return self._start("broadcast", mode, msg.finish, x, root, out=out, prep=prep)

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
        if sendbuf.__class__ is list:  # [buf, T] or [buf, n, T]: see _whole
            sendbuf = _whole(sendbuf)
        if recvbuf.__class__ is list:
            recvbuf = _whole(recvbuf)
        h = self._hot_reduce
        if h[0] is sendbuf and h[1] is recvbuf and h[2] is op and h[3] is root:
            plan = h[5]
            if plan is not None and plan.ready(h[4]):  # (as Allreduce's: the plan's checks are the call's)
                plan.run()
                return
        if root.__class__ is int and 0 <= root < self._size:
            fast = _FAST_OPS.get(id(op))
            if fast is not None:
                comm = self.comm
                if self._rank == root:
                    if type(recvbuf) is _ndarray and recvbuf.dtype in fast[1] and self._by_entry(
                            comm._new_reduce, comm._hot_reduce, 1,
                            recvbuf if sendbuf is _IN_PLACE or sendbuf is None else sendbuf, recvbuf, fast[0], root):
                        return
                elif type(sendbuf) is _ndarray and sendbuf.dtype in fast[1] and self._by_entry(
                        comm._new_reduce, comm._hot_reduce, 0, sendbuf, None, fast[0], root):
                    return
            if self._rank == root:
                short = self._short(sendbuf, recvbuf, op)
                if short is not None:
                    self._blocking["reduce"](short[0], short[1], root, out=recvbuf)
                    self._hot_reduce = self._reduce_memo(h, sendbuf, recvbuf, op, root, short, recvbuf)
                    return
                if self._moved_reduce[2] == (op, root) and self._moved("_moved_reduce", sendbuf, recvbuf):
                    return
                kept = self._kept_reduction(sendbuf, recvbuf, op)  # buffers seen before, of any kind
                if kept is not None:
                    send, recv, kop = kept
                    self._run_kept(self._blocking["reduce"], send.array, kop, root, out=recv.array)
                    self._moved_reduce = _move_memo("reduce", (op, root), sendbuf, recvbuf, _reduced(send, recv),
                                                    send.array, recv.array, args=(kop, root))
                    return
            else:  # the other ranks only send, from their send buffer (never IN_PLACE there)
                short = self._short(_IN_PLACE, sendbuf, op)
                if short is not None:
                    self._blocking["reduce"](short[0], short[1], root)
                    self._hot_reduce = self._reduce_memo(h, sendbuf, recvbuf, op, root, short, None)
                    return
                if self._moved_reduce[2] == (op, root) and self._moved("_moved_reduce", sendbuf, None):
                    return
                kept = self._kept_send(sendbuf, op)
                if kept is not None:
                    self._run_kept(self._blocking["reduce"], kept[0].array, kept[1], root)
                    # (The receive buffer is not read off the root, as in mpi4py.)
                    self._moved_reduce = _move_memo("reduce", (op, root), sendbuf, _UNREAD, ((kept[0], 0, True),),
                                                    kept[0].array, None, args=(kept[1], root))
                    return
        self._reduce(sendbuf, recvbuf, op, root, False)

    def Ireduce(self, sendbuf, recvbuf, op=MPI.SUM, root: int = 0) -> Request:
        """Nonblocking :meth:`Reduce`."""
        return self._reduce(sendbuf, recvbuf, op, root, True)

    def Reduce_init(self, sendbuf, recvbuf, op=MPI.SUM, root: int = 0, info=MPI.INFO_NULL) -> Prequest:
        """Persistent :meth:`Reduce` (MPI-4 ``MPI_Reduce_init``; as :meth:`Allreduce_init`)."""
        return self._reduce(sendbuf, recvbuf, op, root, _Init(info))

    @_announced('Reduce')
    def _reduce(self, sendbuf, recvbuf, op, root, mode):
        try:
            kop = _op(op)
            root = self._root(root)
            if self._rank != root:
                _not_in_place(sendbuf, "Reduce", "sendbuf", "only at the root")
                send = self._typed(sendbuf, "sendbuf", kop, blocking=mode is False)
                return self._start("reduce", mode, None, send.array, kop[0], root)
            prep = _prep(mode)
            x, recv = self._reduction_buffers("Reduce", sendbuf, recvbuf, kop, mode is False, prep)
        except _PassThrough as why:
            return self._pass("Reduce", mode, why, sendbuf, recvbuf, op, root)
        return self._start("reduce", mode, recv.finish, x, kop[0], root, out=recv.array, prep=prep)

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
        if sendbuf.__class__ is list:  # [buf, T] or [buf, n, T]: see _whole
            sendbuf = _whole(sendbuf)
        if recvbuf.__class__ is list:
            recvbuf = _whole(recvbuf)
        h = self._hot_allreduce
        again = h[1] is recvbuf and h[0] is sendbuf and h[2] is op
        if again:
            plan = h[5]
            if plan is not None and plan.ready(h[3]):
                plan.run()
                return
            # Else the checks below again: the program may have reshaped or retyped the arrays in place since
            # (the memo's x and op were made for them as they were then).
        comm = self.comm
        entry = comm._new_allreduce  # new arrays of the communicator's last shape: _by_entry, written out
        if entry is not None and not again and type(recvbuf) is _ndarray:
            known = self._entry_op  # (op, dtype, commkit op) of the last Allreduce the entry was handed
            if known[0] is op and known[1] is recvbuf.dtype:
                kop = known[2]
            else:
                fast = _FAST_OPS.get(id(op))
                kop = fast[0] if fast is not None and recvbuf.dtype in fast[1] else None
                if kop is not None:
                    self._entry_op = (op, recvbuf.dtype, kop)
            hot = comm._hot_allreduce
            if kop is not None and (hot is None or hot.hot[1] is not recvbuf) and entry(
                    recvbuf if sendbuf is _IN_PLACE or sendbuf is None else sendbuf, recvbuf, None, None, kop,
                    None) is not GENERAL:
                return
        short = self._short(sendbuf, recvbuf, op)
        if short is not None:
            self._allreduce(short[0], short[1], out=recvbuf)
            # The memo (none that would hold an array past _VIEW_BYTES); its plan from the second call, when the
            # communicator compiles one (it retires it at forget_plans).
            self._hot_allreduce = _NO_REDUCE_MEMO if not (_small(sendbuf) and _small(recvbuf)) else (
                sendbuf, recvbuf, op, short[0], short[1],
                self.comm.plan_of("allreduce", short[0], recvbuf, short[1]) if again else None)
            return
        if self._moved_allreduce[2] == (op, None) and self._moved("_moved_allreduce", sendbuf, recvbuf):
            return
        kept = self._kept_reduction(sendbuf, recvbuf, op)  # buffers seen before, of any kind
        if kept is not None:
            send, recv, kop = kept
            self._run_kept(self._allreduce, send.array, kop, out=recv.array)
            self._moved_allreduce = _move_memo("allreduce", (op, None), sendbuf, recvbuf,
                                               _reduced(send, recv), send.array, recv.array, args=(kop,))
            return
        self._reduction("allreduce", "Allreduce", sendbuf, recvbuf, op, False)

    def Iallreduce(self, sendbuf, recvbuf, op=MPI.SUM) -> Request:
        """Nonblocking :meth:`Allreduce`."""
        return self._reduction("allreduce", "Allreduce", sendbuf, recvbuf, op, True)

    def Allreduce_init(self, sendbuf, recvbuf, op=MPI.SUM, info=MPI.INFO_NULL) -> Prequest:
        """Persistent :meth:`Allreduce` (MPI-4 ``MPI_Allreduce_init``).

        The road is decided here, once, as for :meth:`Allreduce`: a :class:`Prequest`
        over commkit's persistent allreduce, or (for an op or datatype commkit cannot
        reduce) MPI's own ``MPI.Prequest``. Fill ``sendbuf`` before each ``Start()``;
        read ``recvbuf`` after ``Wait()``.

        Args:
            sendbuf, recvbuf, op: as for :meth:`Allreduce`.
            info: passed on to MPI where the call runs MPI's own; ignored otherwise.

        Returns:
            A :class:`Prequest`, or an ``MPI.Prequest``.

        Raises:
            InvalidBuffer: as for :meth:`Allreduce`, before anything is sent.
        """
        return self._reduction("allreduce", "Allreduce", sendbuf, recvbuf, op, _Init(info))

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

    def Scan_init(self, sendbuf, recvbuf, op=MPI.SUM, info=MPI.INFO_NULL) -> Prequest:
        """Persistent :meth:`Scan` (as :meth:`Allreduce_init`)."""
        return self._reduction("scan", "Scan", sendbuf, recvbuf, op, _Init(info))

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

    def Exscan_init(self, sendbuf, recvbuf, op=MPI.SUM, info=MPI.INFO_NULL) -> Prequest:
        """Persistent :meth:`Exscan` (as :meth:`Allreduce_init`; rank 0's ``recvbuf`` is left untouched)."""
        return self._reduction("exscan", "Exscan", sendbuf, recvbuf, op, _Init(info))

    def _reduce_memo(self, h, sendbuf, recvbuf, op, root, short, out):
        """Reduce's memo after a short-path call (``short``: what :meth:`_short` made of it, ``out`` the
        communicator's), given the memo ``h`` before it: ``(sendbuf, recvbuf, op, root, x, plan)``, as
        :meth:`_memo` keeps for the data-movement calls (the op is part of the call here)."""
        if not (_small(sendbuf) and _small(recvbuf)):
            return _NO_REDUCE_MEMO
        if h[0] is sendbuf and h[1] is recvbuf and h[2] is op and h[3] is root:
            plan = h[5]
            if plan is None or not plan.ready(short[0]):
                return h[:5] + (self.comm.plan_of("reduce", short[0], out, short[1], root),)
            return h
        return (sendbuf, recvbuf, op, root, short[0], None)

    def _moved(self, memo: str, sendbuf, recvbuf) -> bool:
        """Whether the memo (the attribute ``memo``, see :func:`_move_memo`) of a blocking collective's last call
        on kept copies ran this call, whose root (and op) the caller found the memo's.

        Both specs must be written as the memo's (:func:`_staged_buf`; one the
        call does not read at this rank is not looked at), and each kept copy
        must attach its buffer again (still that object, of that size); else
        the call takes the kept or the general path, which parse the specs.
        """
        h = getattr(self, memo)
        key = h[0]
        if key is not None:
            sendbuf = _staged_buf(sendbuf, key)
            if sendbuf is _NOTHING:
                return False
        key = h[1]
        if key is not None:
            recvbuf = _staged_buf(recvbuf, key)
            if recvbuf is _NOTHING:
                return False
        held = None  # the receive copy, which holds a fresh view of its buffer until its result is back
        for msg, which, fill in h[3]:  # (a send copy first: one that fails to attach leaves no view behind)
            if not msg.attach(recvbuf if which else sendbuf, fill):
                if held is not None:
                    held.detach()
                return False
            if msg.finish is not None:
                held = msg
        collective, x, out, own, plan, args = h[4:]
        try:
            if own is not None:  # in place: the blocks this rank sends, read from a copy (see copy_of)
                x[...] = own
            if plan is not None and plan.ready(x):
                plan.run()
            else:
                self._blocking[collective](x, *args, out=out)
                if plan is None or not plan.ready(x):  # (the communicator compiles one after a call or two)
                    setattr(self, memo, h[:8] + (self.comm.plan_of(collective, x, out, *args), args))
            if held is not None:
                held.finish()  # the result into the user's buffer; the fresh view goes
        except BaseException:
            if held is not None:
                held.detach()
            raise
        return True

    def _memo(self, h, collective, a, b, x, out, *root, fill=None):
        """The memo of a call just made on plain NumPy arrays ``a`` and ``b`` (or ``MPI.IN_PLACE`` and one) as
        the communicator's ``collective`` of ``x`` into ``out`` (their byte views; ``root`` where it has
        one), given the memo ``h`` before it.

        A memo is ``(a, b, root, x, plan, fill)``: ``plan`` is None after the
        first call on these arrays, then the communicator's plan for them (it
        compiles one at the second; None while it keeps none, as with a
        timeout); ``fill`` is None, or for an in-place call ``(x, own)``: ``x``
        the copy of its own blocks that the call reads (see :meth:`_in_place_memo`),
        taken again from ``own`` before each run. The method runs ``plan``
        while ``a`` and ``b`` are the same objects, still plain where this rank
        reads or writes them (:func:`_still_plain`), and ``plan.steady()``: the
        communicator's state allows it (a plan it forgot is never steady
        again). ``x`` and ``out`` are the face's own views, handed to no one,
        so what ``plan.ready(x)`` would check of them (shape, element type,
        flags) cannot have changed: the program's arrays are what
        ``_still_plain`` checks.
        """
        r = root[0] if root else None
        if not (_small(a) and _small(b)):  # (the face keeps no array past _VIEW_BYTES alive, as the general path)
            return _NO_MEMO
        if h[0] is a and h[1] is b and h[2] is r and h[3] is x:
            plan = h[4]
            if plan is None or not plan.ready(x):
                return h[:4] + (self.comm.plan_of(collective, x, out, *root), fill)
            return h
        return (a, b, r, x, None, fill)

    def _in_place_memo(self, h, collective, a, b, block, *root):
        """Run an in-place ``collective`` (``a`` is ``MPI.IN_PLACE`` or None) into the plain NumPy array ``b``
        and return its memo (see :meth:`_memo`), given the memo ``h`` before it.

        The call reads a copy of this rank's own blocks in ``b`` (row ``block`` of its byte rows, or all of
        them where ``block`` is None), as the general path reads one: the algorithm writes ``b`` while it
        reads them. The copy is the memo's again where it was made for the same call, so that the
        communicator sees the same input and replays its plan; the memo's ``fill`` takes it again from
        ``b`` before each run.
        """
        rows = self._bytes_of(b, self._size)
        own = rows if block is None else rows[block]
        fill = h[5]
        if fill is None or h[0] is not a or h[1] is not b or h[2] is not (root[0] if root else None) \
                or fill[0].shape != own.shape:
            fill = own.copy(), own
        else:
            fill[0][...] = own
        self._blocking[collective](fill[0], *root, out=rows)
        return self._memo(h, collective, a, b, fill[0], rows, *root, fill=fill)

    @staticmethod
    def _by_entry(entry, hot, index: int, x, out, op, root=None) -> bool:
        """Whether ``entry`` ran this reduction: the communicator's entry for its last shape on new arrays.

        It checks the arrays as :meth:`_short` and the communicator's own call
        would (type, dtype, shape, layout, writeable, overlap), and hands back
        anything else, the same arrays again included, before anything is sent.
        ``hot`` is the communicator's same-array plan of the collective, if any:
        a call on its array ``index`` (0 ``x``, 1 ``out``) goes to that plan, as
        the communicator's own call would.
        """
        return (entry is not None and (hot is None or hot.hot[index] is not (out if index else x))
                and entry(x, out, None, None, op, root) is not GENERAL)

    def _short(self, sendbuf, recvbuf, op):
        """``(x, op)`` for a reduction the short path takes, else None.

        The short path: mpi4py's own op object, and NumPy arrays of one shape,
        dtype and C layout, apart in memory (``sendbuf`` may be ``MPI.IN_PLACE``,
        None or ``recvbuf`` itself), which the communicator takes as they are,
        so it replays the plan it compiled for them. Overlapping arrays take the
        general path, which reads a copy of the send buffer.
        """
        fast = _FAST_OPS.get(id(op))
        if fast is None or type(recvbuf) is not _ndarray or recvbuf.dtype not in fast[1] \
                or not recvbuf.flags.c_contiguous:
            return None
        if sendbuf is _IN_PLACE or sendbuf is None:
            return recvbuf, fast[0]
        if (type(sendbuf) is _ndarray and sendbuf.dtype is recvbuf.dtype and sendbuf.shape == recvbuf.shape
                and sendbuf.flags.c_contiguous and (sendbuf is recvbuf or self._arrays_apart(sendbuf, recvbuf))):
            return sendbuf, fast[0]
        return None

    @_announced(None)
    def _reduction(self, collective, what, sendbuf, recvbuf, op, mode):
        try:
            kop = _op(op)
            prep = _prep(mode)
            x, recv = self._reduction_buffers(what, sendbuf, recvbuf, kop, mode is False, prep)
        except _PassThrough as why:
            return self._pass(what, mode, why, sendbuf, recvbuf, op)
        # Rank 0's result of an exclusive scan is undefined: leave its buffer alone.
        out = None if collective == "exscan" and self._rank == 0 else recv.array
        return self._start(collective, mode, recv.finish, x, kop[0], out=out, prep=prep)

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
        if sendbuf.__class__ is list:  # [buf, T] or [buf, n, T]: see _whole
            sendbuf = _whole(sendbuf)
        if recvbuf.__class__ is list:
            recvbuf = _whole(recvbuf, self._size)
        h = self._hot_gather
        plan = h[4]
        if plan is not None and h[0] is sendbuf and h[1] is recvbuf and h[2] is root \
                and _still_plain(sendbuf) and (self._rank != root or _still_plain(recvbuf)) and plan.steady():
            if h[5] is not None:  # in place: the root's own block, read from a copy
                h[3][...] = h[5][1]
            plan.run()
            return
        if (sendbuf.__class__ is _ndarray and root.__class__ is int and sendbuf.ndim == 1
                and sendbuf.dtype in _VIEWABLE):
            # A new vector, of the kinds of the communicator's last new-array gather: straight to that entry, as
            # Bcast's; the root's recvbuf a vector or a matrix of a row per rank, the others' ignored (as the
            # general path ignores it).
            entry = self.comm._new_gather
            if (entry is not None and sendbuf is not h[0] and sendbuf.flags.c_contiguous
                    and not ((last := self._new_gather) is not None and last() is sendbuf)):
                if self._rank != root:
                    done = entry(sendbuf.view(_BYTE), None, None, None, None, root) is not GENERAL
                else:
                    done = (recvbuf.__class__ is _ndarray and recvbuf.dtype in _VIEWABLE and sendbuf.size
                            and recvbuf.nbytes == self._size * sendbuf.nbytes and recvbuf.flags.c_contiguous
                            and (rows := _byte_rows(recvbuf, self._size)) is not None
                            and entry(sendbuf.view(_BYTE), rows, None, None, None, root) is not GENERAL)
                if done:
                    self._new_gather = _weakref(sendbuf)
                    return
        if root.__class__ is int and 0 <= root < self._size:
            if not self.comm.check:  # NumPy arrays, new or not: their bytes, as the general path moves them
                if self._rank != root:
                    if _plain_array(sendbuf):
                        x = self._bytes_of(sendbuf)
                        self._blocking["gather"](x, root)
                        self._hot_gather = self._memo(h, "gather", sendbuf, recvbuf, x, None, root)
                        return
                elif (views := self._byte_blocks(sendbuf, recvbuf)) is not None:
                    self._blocking["gather"](views[0], root, out=views[1])
                    self._hot_gather = self._memo(h, "gather", sendbuf, recvbuf, *views, root)
                    return
                elif (sendbuf is _IN_PLACE or sendbuf is None) and _plain_array(recvbuf) \
                        and not recvbuf.size % self._size:  # the root's block already sits in recvbuf
                    self._hot_gather = self._in_place_memo(h, "gather", sendbuf, recvbuf, root, root)
                    return
            # The short path: buffers seen before.
            if self._moved_gather[2] == root and self._moved("_moved_gather", sendbuf, recvbuf):
                return
            if self._rank != root:
                send = self._kept(sendbuf, 0, False)
                if send is not None:
                    self._blocking["gather"](send.array, root)
                    self._moved_gather = _move_memo("gather", root, sendbuf, _UNREAD, ((send, 0, True),), send.array,
                                                    None)
                    return
            elif sendbuf is _IN_PLACE or sendbuf is None:  # the root's block already sits in recvbuf
                recv = self._kept(recvbuf, self._size, True)
                if recv is not None:
                    # Copied, as the general path does: the algorithm writes recvbuf while it reads the block.
                    own = recv.row(root)
                    x = recv.copy_of(own)
                    self._run_kept(self._blocking["gather"], x, root, out=recv.shaped)
                    self._moved_gather = _move_memo("gather", root, sendbuf, recvbuf, ((recv, 1, True),), x,
                                                    recv.shaped, own)
                    return
            else:
                recv = self._kept(recvbuf, self._size, True, fill=False)
                send = self._kept(sendbuf, 0, False) if recv is not None else None
                if send is not None and send.count == recv.count and self._apart(send, recv):
                    self._run_kept(self._blocking["gather"], send.array, root, out=recv.shaped)
                    self._moved_gather = _move_memo("gather", root, sendbuf, recvbuf,
                                                    ((send, 0, True), (recv, 1, False)), send.array, recv.shaped)
                    return
        self._gather(sendbuf, recvbuf, root, False)

    def Igather(self, sendbuf, recvbuf, root: int = 0) -> Request:
        """Nonblocking :meth:`Gather`."""
        return self._gather(sendbuf, recvbuf, root, True)

    def Gather_init(self, sendbuf, recvbuf, root: int = 0, info=MPI.INFO_NULL) -> Prequest:
        """Persistent :meth:`Gather` (MPI-4 ``MPI_Gather_init``; ``info`` ignored)."""
        return self._gather(sendbuf, recvbuf, root, _Init(info))

    @_announced('Gather')
    def _gather(self, sendbuf, recvbuf, root, mode):
        root, rank, size = self._root(root), self._rank, self._size
        prep = _prep(mode)
        if rank != root:
            _not_in_place(sendbuf, "Gather", "sendbuf", "only at the root")
            send = self._raw(sendbuf, "sendbuf", blocking=mode is False)
            return self._start("gather", mode, None, self._payload(send, prep), root, prep=prep)
        recv = self._raw(recvbuf, "recvbuf", blocks=size, writable=True, blocking=mode is False)
        x = self._own_block(sendbuf, recv, "Gather", prep, mode is False)
        return self._start("gather", mode, recv.finish, x, root, out=recv.shaped, prep=prep)

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
        if sendbuf.__class__ is list:  # [buf, T] or [buf, n, T]: see _whole
            sendbuf = _whole(sendbuf, self._size)
        if recvbuf.__class__ is list:
            recvbuf = _whole(recvbuf)
        h = self._hot_scatter
        plan = h[4]
        if plan is not None and h[0] is sendbuf and h[1] is recvbuf and h[2] is root \
                and _still_plain(recvbuf) and (self._rank != root or _still_plain(sendbuf)) and plan.steady():
            plan.run()
            return
        if (recvbuf.__class__ is _ndarray and root.__class__ is int and recvbuf.ndim == 1
                and recvbuf.dtype in _VIEWABLE):
            # A new vector to fill, of the kinds of the communicator's last new-array scatter: straight to that
            # entry, as Bcast's; the root's sendbuf a vector or a matrix of a row per rank, the others' ignored.
            # (Gather's mirror, written out: one helper for both cost 0.1-0.2x the raw call at 8 B.)
            entry = self.comm._new_scatter
            if (entry is not None and recvbuf is not h[1] and recvbuf.flags.c_contiguous
                    and not ((last := self._new_scatter) is not None and last() is recvbuf)):
                if self._rank != root:
                    done = entry(recvbuf.view(_BYTE), None, None, None, None, root) is not GENERAL
                else:
                    p = self._size
                    done = (sendbuf.__class__ is _ndarray and sendbuf.dtype in _VIEWABLE and recvbuf.size
                            and sendbuf.nbytes == p * recvbuf.nbytes and sendbuf.flags.c_contiguous
                            and (rows := _byte_rows(sendbuf, p)) is not None
                            and entry(rows, recvbuf.view(_BYTE), None, None, None, root) is not GENERAL)
                if done:
                    self._new_scatter = _weakref(recvbuf)
                    return
        if root.__class__ is int and 0 <= root < self._size:
            if not self.comm.check:  # NumPy arrays, new or not: their bytes, as the general path moves them
                if self._rank != root:
                    if _plain_array(recvbuf):
                        out = self._bytes_of(recvbuf)
                        self._blocking["scatter"](None, root, out=out)
                        self._hot_scatter = self._memo(h, "scatter", sendbuf, recvbuf, None, out, root)
                        return
                elif (views := self._byte_blocks(recvbuf, sendbuf)) is not None:
                    self._blocking["scatter"](views[1], root, out=views[0])
                    self._hot_scatter = self._memo(h, "scatter", sendbuf, recvbuf, views[1], views[0], root)
                    return
                elif (recvbuf is _IN_PLACE or recvbuf is None) and _plain_array(sendbuf) \
                        and not sendbuf.size % self._size:  # the root's block stays where it is, in sendbuf
                    x = self._bytes_of(sendbuf, self._size)
                    self._blocking["scatter"](x, root)
                    self._hot_scatter = self._memo(h, "scatter", sendbuf, recvbuf, x, None, root)
                    return
            # The short path: buffers seen before.
            if self._moved_scatter[2] == root and self._moved("_moved_scatter", sendbuf, recvbuf):
                return
            if self._rank != root:
                recv = self._kept(recvbuf, 0, True, fill=False)
                if recv is not None:
                    self._run_kept(self._blocking["scatter"], None, root, out=recv.array)
                    self._moved_scatter = _move_memo("scatter", root, _UNREAD, recvbuf, ((recv, 1, False),), None,
                                                     recv.array)
                    return
            elif recvbuf is _IN_PLACE or recvbuf is None:  # the root's block stays where it is, in sendbuf
                send = self._kept(sendbuf, self._size, False)
                if send is not None:
                    self._run_kept(self._blocking["scatter"], send.shaped, root)
                    self._moved_scatter = _move_memo("scatter", root, sendbuf, recvbuf, ((send, 0, True),),
                                                     send.shaped, None)
                    return
            else:
                recv = self._kept(recvbuf, 0, True, fill=False)
                send = self._kept(sendbuf, self._size, False) if recv is not None else None
                if send is not None and send.count == recv.count and self._apart(send, recv):
                    self._run_kept(self._blocking["scatter"], send.shaped, root, out=recv.array)
                    self._moved_scatter = _move_memo("scatter", root, sendbuf, recvbuf,
                                                     ((send, 0, True), (recv, 1, False)), send.shaped, recv.array)
                    return
        self._scatter(sendbuf, recvbuf, root, False)

    def Iscatter(self, sendbuf, recvbuf, root: int = 0) -> Request:
        """Nonblocking :meth:`Scatter`."""
        return self._scatter(sendbuf, recvbuf, root, True)

    def Scatter_init(self, sendbuf, recvbuf, root: int = 0, info=MPI.INFO_NULL) -> Prequest:
        """Persistent :meth:`Scatter` (MPI-4 ``MPI_Scatter_init``; ``info`` ignored)."""
        return self._scatter(sendbuf, recvbuf, root, _Init(info))

    @_announced('Scatter')
    def _scatter(self, sendbuf, recvbuf, root, mode):
        root, rank, size = self._root(root), self._rank, self._size
        prep = _prep(mode)
        if rank != root:
            _not_in_place(recvbuf, "Scatter", "recvbuf", "only at the root")
            recv = self._raw(recvbuf, "recvbuf", writable=True, blocking=mode is False)
            return self._start("scatter", mode, recv.finish, None, root, out=recv.array)
        send = self._raw(sendbuf, "sendbuf", blocks=size, blocking=mode is False)
        x = self._payload(send, prep, shaped=True)
        finish = out = None  # with IN_PLACE the root keeps its block where it is, in sendbuf
        if not _in_place(recvbuf):
            recv = self._raw(recvbuf, "recvbuf", writable=True, blocking=mode is False)
            _match("Scatter", send, recv, "per-process send count")
            out, finish = recv.array, recv.finish
        return self._start("scatter", mode, finish, x, root, out=out, prep=prep)

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
        if sendbuf.__class__ is list:  # [buf, T] or [buf, n, T]: see _whole
            sendbuf = _whole(sendbuf)
        if recvbuf.__class__ is list:
            recvbuf = _whole(recvbuf, self._size)
        h = self._hot_allgather
        plan = h[4]
        if plan is not None and h[0] is sendbuf and h[1] is recvbuf \
                and _still_plain(sendbuf) and _still_plain(recvbuf) and plan.steady():
            if h[5] is not None:  # in place: this rank's own block, read from a copy
                h[3][...] = h[5][1]
            plan.run()
            return
        p = self._size
        if (sendbuf.__class__ is _ndarray and recvbuf.__class__ is _ndarray and sendbuf.ndim == 1
                and sendbuf.dtype in _VIEWABLE and recvbuf.dtype in _VIEWABLE):
            # New vectors, of the kinds of the communicator's last new-array allgather: straight to that entry, as
            # Bcast's (the entry checks the views' kinds, layout and overlap as _byte_blocks would).
            entry = self.comm._new_allgather
            if (entry is not None and sendbuf.size and recvbuf.nbytes == p * sendbuf.nbytes
                    and sendbuf.flags.c_contiguous and recvbuf.flags.c_contiguous
                    and sendbuf is not h[0] and not ((last := self._new_allgather) is not None and last() is sendbuf)
                    and (rows := _byte_rows(recvbuf, p)) is not None):
                if entry(sendbuf.view(_BYTE), rows, None, None, None, None) is not GENERAL:
                    self._new_allgather = _weakref(sendbuf)
                    return
        in_place = sendbuf is _IN_PLACE or sendbuf is None
        if not self.comm.check:  # NumPy arrays, new or not: their bytes, as the general path moves them
            if (views := self._byte_blocks(sendbuf, recvbuf)) is not None:
                self._blocking["allgather"](views[0], out=views[1])
                self._hot_allgather = self._memo(h, "allgather", sendbuf, recvbuf, *views)
                return
            if in_place and _plain_array(recvbuf) and not recvbuf.size % p:
                self._hot_allgather = self._in_place_memo(h, "allgather", sendbuf, recvbuf, self._rank)
                return
        # The short path: buffers seen before. In place, this rank's block already sits in recvbuf.
        if self._moved_allgather[2] is None and self._moved("_moved_allgather", sendbuf, recvbuf):
            return
        recv = self._kept(recvbuf, p, True, fill=in_place)
        if in_place:
            if recv is not None:
                # Copied, as the general path does: the algorithm writes recvbuf while it reads the block.
                own = recv.row(self._rank)
                x = recv.copy_of(own)
                self._run_kept(self._blocking["allgather"], x, out=recv.shaped)
                self._moved_allgather = _move_memo("allgather", None, sendbuf, recvbuf, ((recv, 1, True),), x,
                                                   recv.shaped, own)
                return
        else:
            send = self._kept(sendbuf, 0, False) if recv is not None else None
            if send is not None and send.count == recv.count and self._apart(send, recv):
                self._run_kept(self._blocking["allgather"], send.array, out=recv.shaped)
                self._moved_allgather = _move_memo("allgather", None, sendbuf, recvbuf,
                                                   ((send, 0, True), (recv, 1, False)), send.array, recv.shaped)
                return
        self._allgather(sendbuf, recvbuf, False)

    def Iallgather(self, sendbuf, recvbuf) -> Request:
        """Nonblocking :meth:`Allgather`."""
        return self._allgather(sendbuf, recvbuf, True)

    def Allgather_init(self, sendbuf, recvbuf, info=MPI.INFO_NULL) -> Prequest:
        """Persistent :meth:`Allgather` (MPI-4 ``MPI_Allgather_init``; ``info`` ignored)."""
        return self._allgather(sendbuf, recvbuf, _Init(info))

    @_announced('Allgather')
    def _allgather(self, sendbuf, recvbuf, mode):
        size = self._size
        prep = _prep(mode)
        recv = self._raw(recvbuf, "recvbuf", blocks=size, writable=True, blocking=mode is False)
        x = self._own_block(sendbuf, recv, "Allgather", prep, mode is False)
        return self._start("allgather", mode, recv.finish, x, out=recv.shaped, prep=prep)

    def _own_block(self, sendbuf, recv, what, prep, blocking):
        """The bytes this rank contributes to a gather into ``recv`` (its block there with IN_PLACE)."""
        rank, count = self._rank, recv.count
        if _in_place(sendbuf):
            # Copied: the algorithm writes recvbuf while it may still read the input.
            return self._snapshot(recv, recv.array[rank * count:(rank + 1) * count], prep)
        send = self._raw(sendbuf, "sendbuf", blocking=blocking)
        _match(what, send, recv, "send size", "per-process receive size")
        x = self._payload(send, prep)
        return _copy(x, prep) if same_memory(x, recv.array) else x

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
        if sendbuf.__class__ is list:  # [buf, T] or [buf, n, T]: see _whole
            sendbuf = _whole(sendbuf, self._size)
        if recvbuf.__class__ is list:
            recvbuf = _whole(recvbuf, self._size)
        h = self._hot_alltoall
        plan = h[4]
        if plan is not None and h[0] is sendbuf and h[1] is recvbuf \
                and _still_plain(sendbuf) and _still_plain(recvbuf) and plan.steady():
            if h[5] is not None:  # in place: the blocks this rank sends, read from a copy
                h[3][...] = h[5][1]
            plan.run()
            return
        in_place = sendbuf is _IN_PLACE or sendbuf is None
        if not self.comm.check:  # NumPy arrays, new or not: their bytes as rows, one per rank
            if (views := self._byte_blocks(sendbuf, recvbuf, rows=True)) is not None:
                self._blocking["alltoall"](views[0], out=views[1])
                self._hot_alltoall = self._memo(h, "alltoall", sendbuf, recvbuf, *views)
                return
            if in_place and _plain_array(recvbuf) and not recvbuf.size % self._size:
                self._hot_alltoall = self._in_place_memo(h, "alltoall", sendbuf, recvbuf, None)
                return
        # The short path: buffers seen before. In place, recvbuf holds what this rank sends.
        if self._moved_alltoall[2] is None and self._moved("_moved_alltoall", sendbuf, recvbuf):
            return
        recv = self._kept(recvbuf, self._size, True, fill=in_place)
        if in_place:
            if recv is not None:
                # Copied, as the general path does: the algorithm writes recvbuf while it reads the blocks.
                x = recv.copy_of(recv.shaped)
                self._run_kept(self._blocking["alltoall"], x, out=recv.shaped)
                self._moved_alltoall = _move_memo("alltoall", None, sendbuf, recvbuf, ((recv, 1, True),), x,
                                                  recv.shaped, recv.shaped)
                return
        else:
            send = self._kept(sendbuf, self._size, False) if recv is not None else None
            if send is not None and send.count == recv.count and self._apart(send, recv):
                self._run_kept(self._blocking["alltoall"], send.shaped, out=recv.shaped)
                self._moved_alltoall = _move_memo("alltoall", None, sendbuf, recvbuf,
                                                  ((send, 0, True), (recv, 1, False)), send.shaped, recv.shaped)
                return
        self._alltoall(sendbuf, recvbuf, False)

    def Ialltoall(self, sendbuf, recvbuf) -> Request:
        """Nonblocking :meth:`Alltoall`."""
        return self._alltoall(sendbuf, recvbuf, True)

    def Alltoall_init(self, sendbuf, recvbuf, info=MPI.INFO_NULL) -> Prequest:
        """Persistent :meth:`Alltoall` (MPI-4 ``MPI_Alltoall_init``; ``info`` ignored)."""
        return self._alltoall(sendbuf, recvbuf, _Init(info))

    @_announced('Alltoall')
    def _alltoall(self, sendbuf, recvbuf, mode):
        size = self._size
        prep = _prep(mode)
        recv = self._raw(recvbuf, "recvbuf", blocks=size, writable=True, blocking=mode is False)
        if _in_place(sendbuf):
            x = self._snapshot(recv, recv.shaped, prep)
        else:
            send = self._raw(sendbuf, "sendbuf", blocks=size, blocking=mode is False)
            _match("Alltoall", send, recv, "per-process send size", "per-process receive size")
            x = self._payload(send, prep, shaped=True)
            if same_memory(x, recv.array):
                x = _copy(x, prep)
        return self._start("alltoall", mode, recv.finish, x, out=recv.shaped, prep=prep)

    def Reduce_scatter_block(self, sendbuf, recvbuf, op=MPI.SUM) -> None:
        """Reduce ``size`` equal blocks; rank r gets block r in ``recvbuf``.

        With ``sendbuf=MPI.IN_PLACE`` (or None) the input is all of ``recvbuf``
        and the result lands in its first block. Other arguments and errors as
        for :meth:`Allreduce`.
        """
        fast = _FAST_OPS.get(id(op))
        if (fast is not None and type(sendbuf) is _ndarray and type(recvbuf) is _ndarray
                and sendbuf.dtype in fast[1] and recvbuf.dtype is sendbuf.dtype and sendbuf.ndim == 1
                and recvbuf.ndim == 1 and sendbuf.size == self._size * recvbuf.size
                and sendbuf.flags.c_contiguous and (flags := recvbuf.flags).c_contiguous and flags.writeable
                and self._arrays_apart(sendbuf, recvbuf)):
            # Vectors of one type, as the communicator splits them (its entry for new arrays, or its plan for
            # these): each rank's block of the reduced sendbuf, straight into recvbuf.
            self.comm.reduce_scatter(sendbuf, fast[0], out=recvbuf)
            return
        self._reduce_scatter_block(sendbuf, recvbuf, op, False)

    def Ireduce_scatter_block(self, sendbuf, recvbuf, op=MPI.SUM) -> Request:
        """Nonblocking :meth:`Reduce_scatter_block`."""
        return self._reduce_scatter_block(sendbuf, recvbuf, op, True)

    def Reduce_scatter_block_init(self, sendbuf, recvbuf, op=MPI.SUM, info=MPI.INFO_NULL) -> Prequest:
        """Persistent :meth:`Reduce_scatter_block` (as :meth:`Allreduce_init`)."""
        return self._reduce_scatter_block(sendbuf, recvbuf, op, _Init(info))

    @_announced('Reduce_scatter_block')
    def _reduce_scatter_block(self, sendbuf, recvbuf, op, mode):
        size = self._size
        prep = _prep(mode)
        try:
            kop = _op(op)
            if _in_place(sendbuf):
                recv = self._typed(recvbuf, "recvbuf", kop, blocks=size, writable=True)
                x, out = self._snapshot(recv, recv.array, prep), recv.head(recv.count)
            else:
                recv = self._typed(recvbuf, "recvbuf", kop, writable=True)
                send = self._typed(sendbuf, "sendbuf", kop, blocks=size)
                _match("Reduce_scatter_block", send, recv, "per-process send count")
                x, out = send.array, recv.array
                if same_memory(x, out):
                    x = _copy(x, prep)
        except _PassThrough as why:
            return self._pass("Reduce_scatter_block", mode, why, sendbuf, recvbuf, op)
        return self._start("reduce_scatter", mode, None, x, kop[0], out=out, prep=prep)

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

    def Reduce_scatter_init(self, sendbuf, recvbuf, recvcounts=None, op=MPI.SUM, info=MPI.INFO_NULL) -> Prequest:
        """Persistent :meth:`Reduce_scatter` (as :meth:`Allreduce_init`; ``recvcounts=None`` gathers them here)."""
        return self._reduce_scatter(sendbuf, recvbuf, recvcounts, op, _Init(info))

    @_announced('Reduce_scatter')
    def _reduce_scatter(self, sendbuf, recvbuf, recvcounts, op, mode):
        rank, size = self._rank, self._size
        prep = _prep(mode)
        try:
            kop = _op(op)
            recv = self._typed(recvbuf, "recvbuf", kop, writable=True)
            if not _in_place(sendbuf):
                send = self._typed(sendbuf, "sendbuf", kop)
        except _PassThrough as why:
            return self._pass("Reduce_scatter", mode, why, sendbuf, recvbuf, recvcounts, op)
        if _in_place(sendbuf):
            if recvcounts is None:
                raise InvalidArgument("Reduce_scatter with sendbuf=MPI.IN_PLACE needs recvcounts (one count per rank).")
            counts = _counts(recvcounts, size)
            if sum(counts) != recv.count:
                raise InvalidBuffer(
                    f"Reduce_scatter with MPI.IN_PLACE reads all of recvbuf, so it must hold sum(recvcounts) = "
                    f"{sum(counts)} elements; got {recv.count}."
                )
            x, out = self._snapshot(recv, recv.array, prep), recv.head(counts[rank])
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
                x = _copy(x, prep)
        return self._start("reduce_scatter", mode, None, x, kop[0], counts=counts, out=out, prep=prep)

    # -- vector collectives ----------------------------------------------------------------
    #
    # Data movement, so always commkit's algorithms, on bytes (see the module docstring).
    # The counts commkit needs are block sizes in bytes, the same on every rank; the
    # displacements are each rank's own business: blocks that lie back to back in rank
    # order are read and written in place, any other layout goes through a contiguous
    # staging buffer copied from or into the blocks locally.

    def Allgatherv(self, sendbuf, recvbuf) -> None:
        """Every process gets every process's ``sendbuf``, block r of ``recvbuf`` from rank r.

        Args:
            sendbuf: this rank's block, or ``MPI.IN_PLACE`` (or None) when it already
                sits at its place in ``recvbuf``.
            recvbuf: a vector spec -- ``[buf, counts, displs, datatype]``,
                ``[buf, (counts, displs), datatype]``, ``[buf, counts, datatype]``,
                ``[buf, datatype]`` or a bare buffer, as mpi4py reads them -- whose
                block r (``counts[r]`` entries at displacement ``displs[r]``) receives
                rank r's block.

        Raises:
            InvalidBuffer: a spec mpi4py would refuse, a block past the end of
                ``recvbuf``, or a ``sendbuf`` whose size differs from this rank's block.
        """
        self._allgatherv(sendbuf, recvbuf, False)

    def Iallgatherv(self, sendbuf, recvbuf) -> Request:
        """Nonblocking :meth:`Allgatherv` (every rank knows every count: nothing is exchanged first)."""
        return self._allgatherv(sendbuf, recvbuf, True)

    def Allgatherv_init(self, sendbuf, recvbuf, info=MPI.INFO_NULL) -> Prequest:
        """Persistent :meth:`Allgatherv` (MPI-4 ``MPI_Allgatherv_init``; ``info`` ignored)."""
        return self._allgatherv(sendbuf, recvbuf, _Init(info))

    @_announced('Allgatherv')
    def _allgatherv(self, sendbuf, recvbuf, mode):
        rank = self._rank
        prep = _prep(mode)
        recv = self._blocks(recvbuf, "recvbuf", writable=True)
        out, finish = recv.landing()
        if _in_place(sendbuf):
            x = self._own_vblock(recv, out, prep)
        else:
            send = self._raw(sendbuf, "sendbuf")
            x = self._payload(send, prep)
            if x.size != recv.sizes[rank]:
                raise InvalidBuffer(
                    f"Allgatherv: sendbuf holds {x.size} bytes but this rank's block of recvbuf (block {rank}) "
                    f"holds {recv.sizes[rank]}; they must be the same size."
                )
            if same_memory(x, out):
                x = _copy(x, prep)
        return self._start("allgatherv", mode, finish, x, recv.sizes, out=out, prep=prep)

    def Gatherv(self, sendbuf, recvbuf, root: int = 0) -> None:
        """Gather every process's ``sendbuf`` into block r (for rank r) of ``root``'s ``recvbuf``.

        Only the root knows every count, and commkit's algorithms need them on
        every rank, so the block sizes are exchanged first (one small allgather);
        that exchange also checks them against what each rank sends, and a
        mismatch raises the same error on every rank.

        Args:
            sendbuf: this rank's block; ``MPI.IN_PLACE`` (or None) at the root, whose
                block is then already in place in ``recvbuf``.
            recvbuf: at the root, a vector spec (as for :meth:`Allgatherv`); ignored
                elsewhere.
            root: the receiving rank.

        Raises:
            InvalidBuffer: a spec mpi4py would refuse or a block past the end of a
                buffer (on that rank alone, before anything is sent); a rank sending
                a block of another size than the root's ``recvcounts`` say (on every
                rank, after the exchange).
            InvalidArgument: ``root`` is not a rank.
        """
        self._gatherv(sendbuf, recvbuf, root, False)

    def Igatherv(self, sendbuf, recvbuf, root: int = 0) -> Request:
        """Nonblocking :meth:`Gatherv`.

        The block sizes are exchanged before this returns, so unlike MPI's it
        returns once every rank has made the call; the data then moves as the
        request progresses.
        """
        return self._gatherv(sendbuf, recvbuf, root, True)

    def Gatherv_init(self, sendbuf, recvbuf, root: int = 0, info=MPI.INFO_NULL) -> Prequest:
        """Persistent :meth:`Gatherv` (MPI-4 ``MPI_Gatherv_init``; ``info`` ignored).

        The block sizes are exchanged here, once: this returns once every rank
        has made the call.
        """
        return self._gatherv(sendbuf, recvbuf, root, _Init(info))

    @_announced('Gatherv')
    def _gatherv(self, sendbuf, recvbuf, root, mode):
        root, rank, size = self._root(root), self._rank, self._size
        prep = _prep(mode)
        meta = np.full(size + 1, -1, np.int64)  # [bytes this rank sends, the root's block sizes]
        if rank == root:
            recv = self._blocks(recvbuf, "recvbuf", writable=True)
            out, finish = recv.landing()
            if _in_place(sendbuf):
                x = self._own_vblock(recv, out, prep)
            else:
                x = self._payload(self._raw(sendbuf, "sendbuf"), prep)
                if same_memory(x, out):
                    x = _copy(x, prep)
            meta[1:] = recv.sizes
        else:
            _not_in_place(sendbuf, "Gatherv", "sendbuf", "only at the root")
            x = self._payload(self._raw(sendbuf, "sendbuf"), prep)
            out = finish = None
        meta[0] = x.size
        everyone = self._exchange(meta)
        counts = [row[0] for row in everyone]
        for q, (sent, expected) in enumerate(zip(counts, everyone[root][1:])):
            if sent != expected:
                raise InvalidBuffer(
                    f"Gatherv: rank {q} sends {sent} bytes but the root's recvcounts give its block {expected} "
                    f"bytes; they must match (found on every rank by exchanging the counts)."
                )
        return self._start("gatherv", mode, finish, x, root, counts, out=out, prep=prep)

    def Scatterv(self, sendbuf, recvbuf, root: int = 0) -> None:
        """Scatter block r (for rank r) of ``root``'s ``sendbuf`` into every process's ``recvbuf``.

        As for :meth:`Gatherv`, the block sizes are exchanged first (one small
        allgather) and checked against every rank's ``recvbuf``.

        Args:
            sendbuf: at the root, a vector spec (as for :meth:`Allgatherv`); ignored
                elsewhere.
            recvbuf: this rank's block; ``MPI.IN_PLACE`` (or None) at the root, which
                keeps its block where it is.
            root: the sending rank.

        Raises:
            InvalidBuffer: a spec mpi4py would refuse or a block past the end of a
                buffer (on that rank alone); a ``recvbuf`` of another size than the
                root's ``sendcounts`` say (on every rank, after the exchange).
            InvalidArgument: ``root`` is not a rank.
        """
        self._scatterv(sendbuf, recvbuf, root, False)

    def Iscatterv(self, sendbuf, recvbuf, root: int = 0) -> Request:
        """Nonblocking :meth:`Scatterv` (the block sizes are exchanged before it returns, as for :meth:`Igatherv`)."""
        return self._scatterv(sendbuf, recvbuf, root, True)

    def Scatterv_init(self, sendbuf, recvbuf, root: int = 0, info=MPI.INFO_NULL) -> Prequest:
        """Persistent :meth:`Scatterv` (the block sizes are exchanged here, once, as for :meth:`Gatherv_init`)."""
        return self._scatterv(sendbuf, recvbuf, root, _Init(info))

    @_announced('Scatterv')
    def _scatterv(self, sendbuf, recvbuf, root, mode):
        root, rank, size = self._root(root), self._rank, self._size
        prep = _prep(mode)
        meta = np.full(size + 1, -1, np.int64)  # [bytes this rank receives, the root's block sizes]
        x = out = finish = None
        if rank == root:
            send = self._blocks(sendbuf, "sendbuf")
            x = self._contiguous(send, prep)
            mine = send.sizes[rank]
            if not _in_place(recvbuf):  # with IN_PLACE the root's block stays where it is
                recv = self._raw(recvbuf, "recvbuf", writable=True)
                out, finish, mine = recv.array, recv.finish, recv.array.size
                if same_memory(x, out):
                    x = _copy(x, prep)
            meta[1:] = send.sizes
        else:
            _not_in_place(recvbuf, "Scatterv", "recvbuf", "only at the root")
            recv = self._raw(recvbuf, "recvbuf", writable=True)
            out, finish, mine = recv.array, recv.finish, recv.array.size
        meta[0] = mine
        everyone = self._exchange(meta)
        counts = everyone[root][1:]
        for q, (got, expected) in enumerate(zip((row[0] for row in everyone), counts)):
            if got != expected:
                raise InvalidBuffer(
                    f"Scatterv: the root's sendcounts give rank {q} a block of {expected} bytes but its recvbuf "
                    f"holds {got}; they must match (found on every rank by exchanging the counts)."
                )
        return self._start("scatterv", mode, finish, x, counts, root, out=out, prep=prep)

    def Alltoallv(self, sendbuf, recvbuf) -> None:
        """Block j of ``sendbuf`` goes to rank j; block j of ``recvbuf`` comes from rank j.

        commkit's algorithms need the whole matrix of counts on every rank, so
        each rank's send and receive block sizes are exchanged first (one small
        allgather) and checked against each other.

        Args:
            sendbuf: a vector spec (as for :meth:`Allgatherv`), or ``MPI.IN_PLACE``
                (or None) to send from ``recvbuf`` by its counts and displacements
                and overwrite it.
            recvbuf: a vector spec.

        Raises:
            InvalidBuffer: a spec mpi4py would refuse or a block past the end of a
                buffer (on that rank alone); a rank expecting another amount than its
                sender sends (on every rank, after the exchange).
        """
        self._alltoallv(sendbuf, recvbuf, False)

    def Ialltoallv(self, sendbuf, recvbuf) -> Request:
        """Nonblocking :meth:`Alltoallv` (the block sizes are exchanged before it returns, as for :meth:`Igatherv`)."""
        return self._alltoallv(sendbuf, recvbuf, True)

    def Alltoallv_init(self, sendbuf, recvbuf, info=MPI.INFO_NULL) -> Prequest:
        """Persistent :meth:`Alltoallv` (the block sizes are exchanged here, once, as for :meth:`Gatherv_init`)."""
        return self._alltoallv(sendbuf, recvbuf, _Init(info))

    @_announced('Alltoallv')
    def _alltoallv(self, sendbuf, recvbuf, mode):
        size = self._size
        prep = _prep(mode)
        recv = self._blocks(recvbuf, "recvbuf", writable=True)
        out, finish = recv.landing()
        if _in_place(sendbuf):
            x = recv.stage()  # a copy: the blocks are overwritten while they are sent
            recv.read(x)
            if prep is not None:
                prep.append(partial(recv.read, x))
            sizes = recv.sizes
        else:
            send = self._blocks(sendbuf, "sendbuf")
            x = self._contiguous(send, prep)
            if same_memory(x, out):
                x = _copy(x, prep)
            sizes = send.sizes
        everyone = self._exchange(np.array(sizes + recv.sizes, np.int64))
        matrix = tuple(tuple(row[:size]) for row in everyone)
        for q, row in enumerate(everyone):
            for j, (expected, sent) in enumerate(zip(row[size:], (matrix[j][q] for j in range(size)))):
                if expected != sent:
                    raise InvalidBuffer(
                        f"Alltoallv: rank {q} expects {expected} bytes from rank {j}, which sends it {sent}; they "
                        f"must match (found on every rank by exchanging the counts)."
                    )
        return self._start("alltoallv", mode, finish, x, matrix, out=out, prep=prep)

    def _own_vblock(self, recv, out, prep):
        """This rank's block of ``recv``, as the bytes it contributes with IN_PLACE."""
        rank = self._rank
        if recv.raw is None:  # MPI packs the blocks: pack this rank's own
            x = np.empty(recv.sizes[rank], np.uint8)
            recv.read(x, rank)
            if prep is not None:
                prep.append(partial(recv.read, x, rank))
            return x
        view = recv.block(rank)
        # Written in place, the block is overwritten (with itself) while it may still be read: copy it.
        return _copy(view, prep) if out is recv.direct else view

    @staticmethod
    def _contiguous(send, prep):
        """The blocks of ``send`` back to back in rank order: the buffer itself where they lie so, else a copy."""
        if send.direct is not None:
            return send.direct
        x = send.stage()
        send.read(x)
        if prep is not None:
            prep.append(partial(send.read, x))
        return x

    def _exchange(self, meta):
        """Every rank's ``meta`` (int64), as a list of lists: one blocking allgather on the face's communicator."""
        return self.comm.allgather(meta).tolist()

    # -- helpers --------------------------------------------------------------------------

    def _root(self, root) -> int:
        return check_rank(root, self._size, "root")

    def _start(self, collective, mode, finish, *args, prep=None, **kwargs):
        """Run the communicator's blocking form, its ``i``-form in a :class:`Request`, or its ``*_init`` form.

        ``finish`` (or None) runs once the operation has completed (after every
        run of a persistent one): it unpacks or copies what commkit received
        into the user's memory. ``prep`` (persistent only) runs before every start.
        """
        if mode is False:
            self._blocking[collective](*args, **kwargs)
            if finish is not None:
                finish()
            return None
        if mode is True:
            return Request(getattr(self.comm, "i" + collective)(*args, **kwargs), args, finish)
        return Prequest(getattr(self.comm, collective + "_init")(*args, **kwargs), args, finish, prep)

    def _pass(self, what, mode, why, *args):
        """Run the wrapped communicator's own ``what`` (its ``I``- or ``_init`` form) with the caller's arguments."""
        if mode is False:
            name = what
        elif mode is True:
            name = "I" + what.lower()
        else:
            name, args = what + "_init", args + (mode.info,)
        log.debug("%s runs mpi4py's %s: %s.", MPI.Intracomm.Get_name(self) or "a communicator", name, why)
        return getattr(MPI.Intracomm, name)(self, *args)

    @staticmethod
    def _payload(msg, prep, shaped=False):
        """What ``msg`` sends; a persistent call packs it again at every start where MPI packed it."""
        if prep is not None and msg.refresh is not None:
            prep.append(msg.refresh)
        return msg.shaped if shaped else msg.array

    @staticmethod
    def _snapshot(msg, view, prep):
        """A copy of ``view`` (part of the receive message ``msg``) that an in-place call reads while it writes ``msg``.

        Blocking and nonblocking calls reuse the message's own copy (see
        :meth:`_Message.copy_of`); a persistent one keeps a private copy, taken
        again at every start (after MPI packs the message again, where it packed it).
        """
        if prep is None:
            return msg.copy_of(view)
        if msg.refresh is not None:
            prep.append(msg.refresh)
        return _copy(view, prep)

    def _raw(self, spec, name: str, *, blocks: int = 0, writable: bool = False, blocking: bool = False) -> _Message:
        """A buffer spec as bytes (data-movement collectives); MPI packs what the face cannot view.

        ``blocking``: the message of a blocking call, which may go through a
        :class:`_Staged` copy (never kept past the call's end).
        """
        buf, count, displ, datatype = _split(spec, name)
        key = _cache_key(True, buf, count, displ, datatype, blocks)
        if key is not None:
            msg = self._views.get(key)
            if msg is not None and _still_kept(msg, buf, writable):
                return msg
        elif blocking and type(buf) in _STAGED_TYPES:
            key = _spec_key((True, writable), buf, count, displ, datatype, blocks)
            msg = self._fill(key, buf)
            if msg is not None:
                return msg
        try:
            msg = _view(buf, count, displ, datatype, blocks, writable, name)
        except _Opaque as why:
            return self._packed(buf, count, displ, datatype, blocks, writable, name, why)
        array = msg.array
        if array.dtype is not _UINT8:
            array = array.view(_UINT8)
        msg = _Message(array, msg.count * msg.dtype.itemsize, _UINT8, blocks=blocks)
        if type(buf) is _ndarray:
            return self._keep(key, buf, msg)
        return self._stage(key, buf, msg, writable, blocks) if blocking else msg

    def _bytes_of(self, array, blocks: int = 0):
        """The bytes of a NumPy array (:func:`_plain_array`), as the general path moves them; ``blocks`` rows.

        The same view object for the same array while it is among the last few
        seen, so that a loop repeating a call on its arrays runs the
        communicator's plan for them (found by identity); new arrays get a new
        view each (a cheap one: the cache holds a handful, strongly).
        """
        cache = self._byte_views
        key = id(array)
        hit = cache.get(key)
        if hit is not None and hit[0] is array and hit[2] == blocks:
            return hit[1]
        # A C-contiguous array viewed as bytes keeps its shape but the last axis: a vector, or a matrix of
        # one row per block, is already the view wanted (each reshape costs about a tenth of a microsecond).
        ndim = array.ndim
        if ndim == 1 and not blocks or ndim == 2 and array.shape[0] == blocks:
            data = array.view(_BYTE)
        else:
            data = array.reshape(-1).view(_BYTE)
            if blocks:
                data = data.reshape(blocks, -1)
        if array.nbytes <= _VIEW_BYTES:  # (as the general path, the face keeps no larger array alive)
            if len(cache) >= 8:
                cache.clear()
            cache[key] = (array, data, blocks)
        return data

    def _kept(self, spec, blocks: int, writable: bool, raw: bool = True, fill: bool = True):
        """The message an earlier call made of ``spec``, ready for this call; None where the spec needs parsing.

        The blocking collectives' short path: a plain NumPy array, ``[buf,
        datatype]`` or ``[buf, count, datatype]`` over one (its kept views,
        see :meth:`_keep`), or a buffer of another kind given the same ways
        (its kept copy, filled from the buffer now unless ``fill`` is False,
        for a buffer the call only writes: :class:`_Staged`). One dict lookup
        stands for the parse, since the kept message is exactly what
        :meth:`_raw` (``raw``) or :meth:`_typed` would make of the spec again,
        with ``writable`` as the general path asks it; anything else (and
        every error) takes the general path.
        """
        t = spec.__class__
        if t is _ndarray:
            buf, count, datatype = spec, None, None
        elif t is list or t is tuple:
            n = len(spec)
            if n == 2:
                buf, count, datatype = spec[0], None, spec[1]
            elif n == 3:
                buf, count, datatype = spec
            else:
                return None
            if datatype is None or datatype.__class__ is int:  # [buf, count]: mpi4py reads a count there
                return None
        else:
            buf, count, datatype = spec, None, None
        if buf.__class__ is _ndarray:
            key = _spec_key(raw, buf, count, None, datatype, blocks)
            msg = self._views.get(key) if key is not None else None
            if msg is None or not _still_kept(msg, buf, writable):
                return None
            return msg
        if buf.__class__ in _STAGED_TYPES:
            return self._fill(_spec_key((raw, writable), buf, count, None, datatype, blocks), buf, fill)
        return None

    def _run_kept(self, run, *args, out=None) -> None:
        """Run a short path's call, ``run(*args, out=out)``; then the staged receive buffers it attached get its result.

        Whatever way the call ends, the fresh views of the buffers it staged go.
        """
        attached = self._attached
        if not attached:  # NumPy arrays, and staged buffers the call only reads: nothing to copy back or let go
            run(*args, out=out)
            return
        try:
            run(*args, out=out)
            for msg in attached:  # each a staged receive buffer of this call (see _fill); finish lets its view go
                msg.finish()
        except BaseException:
            self._detach()
            raise
        attached.clear()

    def _byte_blocks(self, block, blocks, rows: bool = False):
        """The byte views (:meth:`_bytes_of`) of ``block`` (one rank's) and ``blocks`` (every rank's, as rows),
        where they take the direct path of NumPy arrays; else None. ``rows``: ``block`` holds a block for
        every rank as well (an all-to-all's send buffer), and is viewed as rows too.

        Both plain (:func:`_plain_array`, written out: this runs at every call),
        ``blocks`` the size of ``size`` blocks, and apart in memory; anything
        else takes the short or the general path.
        """
        if block.__class__ is not _ndarray or blocks.__class__ is not _ndarray or not block.ndim or not blocks.ndim:
            return None
        flags, rows_flags, dtype, rows_dtype = block.flags, blocks.flags, block.dtype, blocks.dtype
        if not (flags.c_contiguous and flags.writeable and rows_flags.c_contiguous and rows_flags.writeable
                and dtype in _VIEWABLE and rows_dtype in _VIEWABLE
                # (whole elements a block, as mpi4py counts them: 3 doubles do not split over 2 ranks)
                and not blocks.size % self._size
                and (blocks.nbytes == block.nbytes and not block.size % self._size if rows
                     else blocks.nbytes == self._size * block.nbytes)
                # (_arrays_apart's first test, written out: 0.1 us of the call it saves, at every call)
                and (block.base is None and blocks.base is None and block is not blocks
                     or self._arrays_apart(block, blocks))):
            return None
        return self._bytes_of(block, self._size if rows else 0), self._bytes_of(blocks, self._size)

    def _arrays_apart(self, send, recv) -> bool:
        """Whether NumPy arrays ``send`` and ``recv`` lie apart in memory (the direct paths' check, 0.27 us).

        Arrays in two different arrays that own their memory (a program's new
        pair, or views of two such) lie apart (:func:`owners_apart`). Of other
        views, the last pair found apart is remembered (and so kept alive: NumPy will not
        resize an array another reference holds, so its memory cannot move) and found
        again by identity.
        """
        send_base, recv_base = send.base, recv.base
        if send_base is None and recv_base is None:  # (written out: a program's new pair, at every call)
            return send is not recv
        if owners_apart(send, send_base, recv, recv_base):
            return True
        pair = self._arrays_apart_pair
        if pair[0] is send and pair[1] is recv:
            return True
        if same_memory(send, recv):
            return False
        if send.nbytes <= _VIEW_BYTES and recv.nbytes <= _VIEW_BYTES:  # (no larger array kept alive)
            self._arrays_apart_pair = (send, recv)
        return True

    def _apart(self, send, recv) -> bool:
        """Whether kept messages ``send`` and ``recv`` lie apart in memory (else the general path copies one).

        A kept message's array never moves (a view of the user's array, which
        NumPy will not resize while it is viewed, or a stage of the face's own),
        so the last pair found apart is remembered and found again by identity.
        """
        if self._apart_pair[0] is send and self._apart_pair[1] is recv:
            return True
        if same_memory(send.array, recv.array):
            return False
        self._apart_pair = (send, recv)
        return True

    def _kept_reduction(self, sendbuf, recvbuf, op):
        """``(send, recv, commkit op)`` of a reduction whose buffers :meth:`_kept` has, for an mpi4py op; or None."""
        fast = _FAST_OPS.get(id(op))
        if fast is None:
            return None
        in_place = sendbuf is _IN_PLACE or sendbuf is None
        recv = self._kept(recvbuf, 0, True, False, in_place)
        if recv is None or recv.dtype not in fast[1]:
            return None
        if in_place:
            return recv, recv, fast[0]
        send = self._kept(sendbuf, 0, False, False)
        if send is None or send.dtype is not recv.dtype or send.count != recv.count or (
                send is not recv and not self._apart(send, recv)):
            return None
        return send, recv, fast[0]

    def _kept_send(self, sendbuf, op):
        """``(send, commkit op)`` of a send buffer :meth:`_kept` has, at a rank that gets no result; or None."""
        fast = _FAST_OPS.get(id(op))
        if fast is None:
            return None
        send = self._kept(sendbuf, 0, False, False)
        if send is None or send.dtype not in fast[1]:
            return None
        return send, fast[0]

    def _typed(self, spec, name: str, op, *, blocks: int = 0, writable: bool = False,
               blocking: bool = False) -> _Message:
        """A buffer spec of a reduction as a typed array; raises _PassThrough where MPI must reduce it.

        ``op`` is what :func:`_op` returns: the commkit op and the dtypes it runs on here;
        ``blocking`` as for :meth:`_raw`.
        """
        buf, count, displ, datatype = _split(spec, name)
        key = _cache_key(False, buf, count, displ, datatype, blocks)
        msg = None
        if key is not None:
            msg = self._views.get(key)
            if msg is not None and not _still_kept(msg, buf, writable):
                msg = None
        elif blocking and type(buf) in _STAGED_TYPES:
            key = _spec_key((False, writable), buf, count, displ, datatype, blocks)
            msg = self._fill(key, buf)
        if msg is None:
            try:
                msg = _view(buf, count, displ, datatype, blocks, writable, name)
            except _Opaque as why:
                raise _PassThrough(str(why)) from None
            if type(buf) is _ndarray:
                msg = self._keep(key, buf, msg)
            elif blocking:
                msg = self._stage(key, buf, msg, writable, blocks)
        if msg.dtype not in op[1]:
            raise _PassThrough(f"MPI does not define {op[0].name} for {msg.dtype}")
        return msg

    def _reduction_buffers(self, what, sendbuf, recvbuf, op, blocking, prep):
        """What a reduction at a rank that gets a result reads (an array) and its receive message.

        A send buffer that overlaps the receive buffer is read from a copy
        (for a persistent call, taken again at every start: ``prep``), as the
        face's other collectives read theirs: the call then computes what the
        program meant, where MPI itself aborts or refuses (MPICH: "Buffers must
        not be aliased"). The same memory given twice is the in-place call.
        """
        recv = self._typed(recvbuf, "recvbuf", op, writable=True, blocking=blocking)
        if _in_place(sendbuf):
            return recv.array, recv
        send = self._typed(sendbuf, "sendbuf", op, blocking=blocking)
        _match(what, send, recv)
        x = send.array
        if send is not recv and same_memory(x, recv.array):
            x = _copy(x, prep)
        return x, recv

    def _fill(self, key, buf, fill: bool = True):
        """The kept :class:`_Staged` message of ``key``, attached to ``buf`` for this call; None if it has none.

        ``fill``: the call reads the message, so its bytes are copied into the stage.
        """
        msg = self._stages.get(key) if key is not None else None
        if msg is None or not msg.attach(buf, fill):
            return None
        if msg.finish is not None:
            self._attached.append(msg)
        return msg

    def _stage(self, key, buf, msg: _Message, writable: bool, blocks: int) -> _Message:
        """``msg`` (a fresh view of ``buf``, not a NumPy array) as a kept :class:`_Staged` message, where it may be.

        Only up to :data:`_STAGE_BYTES` (larger messages are worth no copy:
        the communicator's general path costs little beside moving them) and
        for buffers NumPy views as one run of bytes; else ``msg`` itself.
        """
        if key is None or msg.array.nbytes > _STAGE_BYTES or type(msg.array) is not _ndarray:
            return msg
        try:
            mem = np.frombuffer(buf, _UINT8)
            memoryview(buf).cast("B")  # how _Staged.attach views it
        except (ValueError, BufferError, TypeError):  # e.g. a memoryview with strides: the fresh view serves
            return msg
        stages = self._stages
        if len(stages) >= _VIEWS:
            stages.clear()
        stages[key] = _Staged(msg, buf, mem, writable, blocks)
        return self._fill(key, buf) or msg

    def _detach(self) -> None:
        """Let go of the fresh views the call that ends attached (see :class:`_Staged`)."""
        for msg in self._attached:
            msg.detach()
        self._attached.clear()

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
            msg.form = (buf.dtype, buf.shape, buf.flags.writeable)
            self._views[key] = msg
        return msg

    def _local(self):
        """The ``MPI.COMM_SELF`` duplicate through which MPI packs and unpacks for the face (made on first use)."""
        if self._self is None:
            self._self = MPI.COMM_SELF.Dup()
        return self._self

    def _packed(self, buf, count, displ, datatype, blocks, writable, name, why) -> _Message:
        """The bytes of a spec as MPI packs them; for a receive buffer, ``finish`` unpacks the result into it.

        ``refresh`` packs the spec again into the same bytes: a persistent call
        runs it at every start, to send what the buffer holds then.
        """
        log.debug("%s; MPI packs it for commkit's algorithm.", why)
        if writable and buf is not None and buf is not _BOTTOM and _read_only(buf):
            # Before any message is sent: the result could not be unpacked into it (mpi4py would refuse it too).
            raise InvalidBuffer(f"{name} is read-only; the face must write the result into it.")
        local, n_blocks = self._local(), max(blocks, 1)
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

        def refresh():
            again = local.Isend(spec, 0, _PACK_TAG)
            local.Recv([data, MPI.PACKED], 0, _PACK_TAG)
            again.Wait()

        finish = None
        if writable:
            def finish():
                receiving = local.Isend([data, MPI.PACKED], 0, _PACK_TAG)
                try:
                    local.Recv(spec, 0, _PACK_TAG)
                except BaseException:
                    # Take the packed result back off the face's own queue, where the next packed call would
                    # match it (and wait for its own for ever), then raise what mpi4py raised.
                    if local.Iprobe(0, _PACK_TAG):
                        local.Recv([np.empty_like(data), MPI.PACKED], 0, _PACK_TAG)
                    receiving.Wait()
                    raise
                receiving.Wait()
        msg = _Message(data, data.size // n_blocks, _UINT8, finish, blocks)
        msg.refresh = refresh
        return msg

    def _blocks(self, spec, name: str, *, writable: bool = False) -> _Blocks:
        """A vector buffer spec (``[buf, counts, displs, datatype]`` ...) as ``size`` blocks of bytes.

        Counts and displacements are read as mpi4py's ``message_vector`` reads
        them; what the face cannot view as memory (a derived datatype,
        ``MPI.BOTTOM``, an object only mpi4py reads) MPI packs and unpacks.

        Raises:
            InvalidBuffer: a spec mpi4py would refuse, a read-only buffer to write,
                or a block past the end of the buffer.
        """
        buf, counts, displs, datatype = _vsplit(spec, name)
        size = self._size
        arr = dtype = opaque = None
        if buf is None or buf is _BOTTOM:
            opaque = f"{name} addresses MPI.BOTTOM"
        else:
            try:
                arr = _array(buf, name, writable)
            except _Opaque as why:
                opaque = str(why)
        if datatype is not None:
            try:
                dtype = _dtype(datatype, name)
            except _Opaque as why:
                opaque = opaque or str(why)
        elif arr is not None and not _numeric(arr.dtype):
            raise InvalidBuffer(
                f"{name} has element type {arr.dtype}, which maps to no MPI datatype; "
                "pass the datatype in the spec: [buf, counts, displs, datatype]."
            )
        elif arr is not None:
            dtype = arr.dtype
        raw = None if arr is None else _bytes_of(arr, name)
        if opaque is None:
            itemsize = dtype.itemsize
            counts = _vcounts(counts, raw.size, itemsize, size, name)
            displs = _vdispls(displs, counts, name)
            n = raw.size // itemsize
            for i, (c, d) in enumerate(zip(counts, displs)):
                if c and (d < 0 or (d + c) * itemsize > raw.size):
                    raise InvalidBuffer(
                        f"{name}: block {i} ({c} entries at displacement {d}) does not lie inside the buffer "
                        f"of {n} {dtype} entries."
                    )
            return _Blocks([c * itemsize for c in counts], raw, [d * itemsize for d in displs])
        if datatype is None:
            datatype = _interface_datatype(buf)
        if datatype is None:
            raise InvalidBuffer(f"{name}: {opaque}, and has no datatype in its spec; pass [buf, counts, displs, "
                                "datatype] so that MPI can pack it.")
        log.debug("%s; MPI packs its blocks for commkit's algorithm.", opaque)
        base = datatype if isinstance(datatype, _MPI_DATATYPE) else MPI.Datatype.fromcode(datatype)
        extent, tsize = base.Get_extent()[1], base.Get_size()
        counts = _vcounts(counts, _nbytes(buf) if raw is None else raw.size, extent, size, name)
        displs = _vdispls(displs, counts, name)
        blocks = _Blocks([c * tsize for c in counts], None, None,
                         (buf, base, counts, [d * extent for d in displs], self._local()))
        if raw is not None and any(counts):
            lower, span = blocks.true_extent()
            if lower < 0 or lower + span > raw.size:
                raise InvalidBuffer(
                    f"{name}: its blocks span bytes {lower} to {lower + span} but the buffer holds {raw.size}."
                )
        return blocks


class _Records:
    """The fixed records the face's lowercase methods send, and the plans that move them.

    ``mine`` (``bcast`` has its own, ``sent``) holds this rank's object as
    ``[kind, unused, 16 bytes of value]`` (:func:`_encode`); ``every`` gets every
    rank's, one row each. They are the face's own arrays, handed to no one, so
    once the communicator has compiled a plan for a call on them the face runs
    it directly while ``plan.steady()`` holds, and reads and writes them through
    memoryviews (``*_q`` as int64s, ``*_d`` as float64s: a Python number at
    once). Another thread's call must not write them before this one has read
    them: each method holds the lock of the communicator that mpi4py's own
    lowercase method takes (``MPI._comm_lock_table``), released before it runs
    one of those.
    """

    __slots__ = ("mine", "sent", "every", "mine_q", "mine_d", "every_q", "every_d", "bcast_lock",
                 "allgather_lock", "allgather_plan", "bcast_plan", "bcast_root")

    def __init__(self, size: int, lock_table: dict):
        self.mine, self.sent, self.every = np.zeros(4, np.int64), np.zeros(4, np.int64), np.zeros((size, 4), np.int64)
        self.mine_q = memoryview(self.mine).cast("B").cast("q")
        self.mine_d = memoryview(self.mine).cast("B").cast("d")
        self.every_q = memoryview(self.every).cast("B").cast("q")
        self.every_d = memoryview(self.every).cast("B").cast("d")
        self.bcast_lock = lock_table.setdefault("bcast", threading.Lock())
        self.allgather_lock = lock_table.setdefault("allgather", threading.Lock())
        self.allgather_plan = self.bcast_plan = self.bcast_root = None


def _encode(obj, rec) -> None:
    """Write ``obj`` into ``rec`` (int64[4]) as a value, or mark it as one that only a pickle carries."""
    t = obj.__class__
    if t is int and _INT64[0] <= obj <= _INT64[1]:
        rec[0], rec[2] = _INT, obj
        return
    if t is float:
        rec[0] = _FLOAT
        rec.view(np.float64)[2] = obj
        return
    if t is bool:
        rec[0], rec[2] = _BOOL, obj
        return
    if t is complex:
        rec[0] = _COMPLEX
        rec.view(np.float64)[2:] = obj.real, obj.imag
        return
    kind = _SCALAR_KINDS.get(t)
    if kind is not None:
        rec[0] = kind
        dtype = _SCALAR_DTYPES[kind]
        rec.view(np.uint8)[16:16 + dtype.itemsize].view(dtype)[0] = obj
        return
    rec[0] = _PICKLED


def _decode(rec):
    """The object a value record holds, of the type it was sent as (a fresh copy, as unpickling gives)."""
    kind = rec[0]
    if kind == _INT:
        return int(rec[2])
    if kind == _FLOAT:
        return float(rec.view(np.float64)[2])
    if kind == _BOOL:
        return bool(rec[2])
    if kind == _COMPLEX:
        f = rec.view(np.float64)
        return complex(f[2], f[3])
    dtype = _SCALAR_DTYPES[int(kind)]
    return rec.view(np.uint8)[16:16 + dtype.itemsize].view(dtype)[0]


_BYTE = np.dtype(np.uint8)


def _fresh_bytes(buf):
    """A new uint8 view of all of a C-contiguous buffer that is not a NumPy array (:data:`_STAGED_TYPES`), or None
    where NumPy cannot view it so (not C-contiguous, an mmap closed ...): the general path then names the problem."""
    try:
        return np.frombuffer(buf, _BYTE)
    except (BufferError, TypeError, ValueError):
        return None


def _byte_rows(array, p: int):
    """The bytes of a C-contiguous NumPy array of ``p`` equal nonempty blocks as ``p`` rows, where that is a view
    of one step (a vector, or a matrix of ``p`` rows, as :meth:`Comm._bytes_of` views them); else None.

    A block is whole elements, as mpi4py counts it: a vector whose elements do not split into ``p`` blocks
    (3 doubles on 2 ranks) is None, though its bytes would, and the general path names the problem.
    """
    ndim = array.ndim
    if ndim == 2 and array.shape[0] == p:
        return array.view(_BYTE)
    return array.view(_BYTE).reshape(p, -1) if ndim == 1 and not array.size % p else None


def _whole(spec, blocks: int = 1):
    """``buf`` for a spec ``[buf, T]`` or ``[buf, n, T]`` over a NumPy array whose elements are of datatype ``T``
    and, with ``n``, whose ``n`` elements a block (``blocks`` of them: a gathered or scattered buffer's count is per
    process) are all of it: mpi4py reads either as all of ``buf``, as it reads ``buf`` alone, so the spec takes the
    array's own paths (its replayed plan included); else ``spec``."""
    n = len(spec)
    if n == 2:
        buf, datatype = spec
        count = None
    elif n == 3:
        buf, count, datatype = spec
    else:
        return spec
    if buf.__class__ is _ndarray and datatype.__class__ is _MPI_DATATYPE and _DTYPES.get(datatype.handle) is buf.dtype \
            and (count is None or count.__class__ is int and count * blocks == buf.size):
        return buf
    return spec


def _read_only(buf) -> bool:
    """Whether ``buf`` (an object with the buffer protocol) is read-only; False where it cannot say."""
    if buf.__class__ is _ndarray:
        return not buf.flags.writeable
    try:
        with memoryview(buf) as view:
            return view.readonly
    except (TypeError, ValueError, BufferError):  # no buffer protocol, or released: mpi4py names it later
        return False


def _small(array) -> bool:
    """Whether a face's memo may hold a call's argument: anything but a NumPy array past ``_VIEW_BYTES``, as
    the general path keeps no larger array alive (a dropped 4 MiB array is freed). ``MPI.IN_PLACE``, None and
    a buffer this rank ignores (a non-root's ``recvbuf`` of a Gather) are held as they come."""
    return array.__class__ is not _ndarray or array.nbytes <= _VIEW_BYTES


def _still_kept(msg, buf, writable: bool) -> bool:
    """Whether the message a face kept for the NumPy array ``buf`` (:meth:`Comm._keep`) still is its message.

    The same object, of the element type and shape it had (the program may set
    either in place: the kept views, or the array itself, would then give the
    communicator arrays of another shape or type than mpi4py reads), and, for a
    call that writes it, writeable now and when kept (views made of a read-only
    array stay read-only).
    """
    form = msg.form
    return (msg.source is buf and form[0] is buf.dtype and form[1] == buf.shape
            and (not writable or form[2] and buf.flags.writeable))


def _still_plain(array) -> bool:
    """Whether a NumPy array that was plain (:func:`_plain_array`) at an earlier call still is, as its bytes go.

    The same object keeps its class and its memory; a shape or element type set
    in place since keeps its bytes, which are what the face moves; its flags can
    change what may be done with them, and so can an element type mpi4py would
    refuse (bytes ``S8``, ``datetime64``: the general path then raises as mpi4py). ``MPI.IN_PLACE`` and None
    (an in-place call's memo holds one of them) stay what they were.
    """
    if array is _IN_PLACE or array is None:
        return True
    flags = array.flags
    return flags.writeable and flags.c_contiguous and array.dtype in _VIEWABLE


def _plain_array(buf) -> bool:
    """Whether ``buf`` is a NumPy array the communicator takes as mpi4py would read it: whole, C-contiguous,
    writeable, of a native numeric type, at least one dimension (a message of ``buf.size`` elements)."""
    if buf.__class__ is not _ndarray or not buf.ndim:
        return False
    flags = buf.flags
    return flags.c_contiguous and flags.writeable and buf.dtype in _VIEWABLE


def _mpi4py_order(objects, op):
    """``op`` over every rank's object in the order mpi4py's ``reduce``/``allreduce`` apply it."""
    if len(objects) == 2:  # both orders below are then this one call
        return op(objects[0], objects[1])
    if not _FAST_REDUCE:  # mpi4py.rc.fast_reduce = False: mpi4py gathers and folds left to right
        return functools.reduce(op, objects)
    return _binomial(objects, op)


def _binomial(objects, op):
    """``op`` over ``objects`` as mpi4py's reduce applies it: a binomial tree onto rank 0, lower ranks on the left.

    mpi4py's ``reduce`` and ``allreduce`` combine, at step k, the partial result
    of rank r (r a multiple of 2^(k+1)) with the one of rank r + 2^k as
    ``op(mine, theirs)``; doing the same here gives its result to the bit, and
    to the type (``MPI.MAX(1, True)`` is 1, ``MPI.MAX(True, 1)`` is True).
    """
    acc = list(objects)
    n, step = len(acc), 1
    while step < n:
        for r in range(0, n - step, 2 * step):
            acc[r] = op(acc[r], acc[r + step])
        step *= 2
    return acc[0]


def _plain(comm):
    """A plain mpi4py communicator (of the face's mpi4py class) with the same handle."""
    return next(c for c in type(comm).__mro__ if c.__module__ == "mpi4py.MPI")(comm)


class _Cartcomm(Comm, MPI.Cartcomm):
    """A face over a Cartesian topology: the topology's methods and neighborhood collectives are mpi4py's."""


class _Graphcomm(Comm, MPI.Graphcomm):
    """A face over a graph topology: the topology's methods and neighborhood collectives are mpi4py's."""


class _Distgraphcomm(Comm, MPI.Distgraphcomm):
    """A face over a distributed graph topology: its own methods are mpi4py's."""


_TOPOLOGIES = {MPI.CART: _Cartcomm, MPI.GRAPH: _Graphcomm, MPI.DIST_GRAPH: _Distgraphcomm}


class _Intercomm(MPI.Intercomm):
    """A wrapped intercommunicator: an ``MPI.Intercomm`` whose every method is mpi4py's own.

    commkit's algorithms work within one group, so every collective runs MPI's,
    on every rank. Communicators mpi4py makes from it (``Dup``, ``Merge`` ...)
    are mpi4py's, a duplicate of this same class.
    """

    comm = None  # no commkit communicator: nothing here runs commkit

    def __new__(cls, comm=None, *, timeout: float | None = None, check: bool | None = None):
        return super().__new__(cls, comm)

    def __init__(self, comm=None, *, timeout: float | None = None, check: bool | None = None):
        pass

    @property
    def mpi(self):
        """A plain ``MPI.Intercomm`` with the same handle."""
        return MPI.Intercomm(self)

    def __repr__(self) -> str:
        if not self:
            return "<commkit.compat.mpi4py.Comm: freed intercommunicator>"
        return (f"<commkit.compat.mpi4py.Comm over {self.mpi!r}, intercommunicator (MPI's collectives): "
                f"rank {self.Get_rank()} of {self.Get_size()}>")


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
    def Startall(requests) -> None:
        """Start every persistent request, in order: this face's :class:`Prequest` and ``MPI.Prequest`` alike.

        ``MPI.Prequest.Startall`` takes only mpi4py's own requests (it hands MPI
        their handles, and a commkit collective has none); this takes any mix.
        """
        requests = list(requests)
        if all(isinstance(r, MPI.Prequest) for r in requests):
            MPI.Prequest.Startall(requests)
            return
        for request in requests:
            request.Start()

    @staticmethod
    def Waitall(requests, statuses=None) -> bool:
        """Wait for every request: these and ``MPI.Request`` alike, progressing all of them together.

        ``MPI.Request.Waitall`` takes only mpi4py's own requests: it blocks inside
        MPI, where nothing advances commkit's schedules. This takes any mix.
        """
        requests = list(requests)
        statuses = _statuses(statuses, len(requests))
        if all(isinstance(r, MPI.Request) for r in requests):
            return MPI.Request.Waitall(requests, statuses)
        pending = list(range(len(requests)))
        backoff = Backoff(spin=0, first=1e-6)
        while pending:
            # Testing every request in turn (never waiting on one alone) keeps each
            # commkit schedule moving while MPI completes the others.
            still = [i for i in pending if not requests[i].Test(statuses[i] if statuses else None)]
            if len(still) == len(pending):
                backoff.pause()
            else:
                backoff.progressed()
            pending = still
        return True

    @staticmethod
    def Testall(requests, statuses=None) -> bool:
        """Make progress on every request; return whether all have completed."""
        requests = list(requests)
        statuses = _statuses(statuses, len(requests))
        done = [r.Test(statuses[i] if statuses else None) for i, r in enumerate(requests)]
        return all(done)


class Prequest(Request):
    """A persistent collective of this face (``Allreduce_init`` ...), with the methods of mpi4py's ``Prequest``.

    ``Start()`` begins one run without blocking, ``Wait()``/``Test()`` complete
    it, and it may be started again as often as needed; ``Free()`` releases it.
    Behind it is a :class:`commkit.PersistentRequest`: the call compiled once
    against the user's buffers. Where the face copies from the user's memory
    (an in-place block) or MPI packs it (a derived datatype), that is redone
    at every ``Start()``; where MPI unpacks a result into it, at every
    completion.

    ``MPI.Prequest.Startall`` and ``MPI.Request.Waitall`` take only mpi4py's own
    requests; :meth:`Request.Startall` and :meth:`Request.Waitall` take these
    mixed with mpi4py's.
    """

    def __init__(self, persistent, keep=(), finish=None, prep=None):
        super().__init__(persistent, keep)
        self._after = finish
        self._prep = tuple(prep) if prep else ()
        self._running = False
        self._freed = False

    def Start(self) -> None:
        """Begin one run of the collective with what the buffers hold now (never blocks)."""
        for refresh in self._prep:
            refresh()
        self._pending.start()
        self._running = True

    def Wait(self, status=None) -> bool:
        """Block until the current run completes (at once if none is running); returns True."""
        if self._running:
            self._pending.wait()
            self._ran()
        return True

    def Test(self, status=None) -> bool:
        """Make progress; return whether no run is in progress any more."""
        if not self._running:
            return True
        if not self._pending.test():
            return False
        self._ran()
        return True

    def _ran(self) -> None:
        self._running = False
        if self._after is not None:
            self._after()

    def Free(self) -> None:
        """Release the request (it must not be running, as in MPI)."""
        self._pending.free()
        self._keep = ()
        self._freed = True

    def __bool__(self) -> bool:
        """False once freed, like an ``MPI.Request`` that became ``MPI.REQUEST_NULL``."""
        return not self._freed


def _statuses(statuses, n):
    if statuses is None:
        return None
    statuses = list(statuses)
    if len(statuses) != n:
        raise InvalidArgument(f"statuses must hold one MPI.Status per request ({n}), got {len(statuses)}.")
    return statuses


class _Init:
    """The mode of a persistent call (``*_init``): it carries the ``info`` that MPI's own form takes."""

    __slots__ = ("info",)

    def __init__(self, info):
        self.info = info


def _prep(mode):
    """What a persistent call redoes at every start (a list to fill), or None for the other forms."""
    return [] if mode.__class__ is _Init else None


def _refill(dst, src) -> None:
    dst[...] = src


def _copy(view, prep):
    """A private copy of ``view``; for a persistent call, taken again at every start."""
    copy = view.copy()
    if prep is not None:
        prep.append(partial(_refill, copy, view))
    return copy


# -- buffer specifications ----------------------------------------------------------------


class _Message:
    """A parsed buffer spec: a flat array over the message's memory and the per-block count.

    ``shaped`` is the array as ``(blocks, count)``, one row per process, for a
    spec read as per-process blocks (the array itself otherwise); ``finish`` is
    None, or (for a receive buffer MPI packed) what copies the result back into
    the user's memory once the operation has completed; ``refresh`` is None, or
    (for a buffer MPI packed) what packs it again, for a persistent call's next
    start; ``source`` is the user's array for a message kept in a face's view
    cache, and ``form`` that array's element type, shape and writeability when
    it was kept (see :func:`_still_kept`).
    """

    __slots__ = ("_head", "_row", "_scratch", "array", "count", "dtype", "finish", "refresh", "shaped", "source",
                 "form")

    def __init__(self, array, count, dtype, finish=None, blocks=0):
        self.array = array
        self.count = count
        self.dtype = dtype
        self.finish = finish
        self.refresh = None
        self.shaped = array.reshape(blocks, count) if blocks else array
        self.source = self.form = None
        self._scratch = self._head = self._row = None

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

    def row(self, i: int):
        """Block ``i`` of a message of blocks (a rank's own block in an in-place gather); the same view every call."""
        row = self._row
        if row is None or row[0] != i:
            row = (i, self.shaped[i])
            if self.source is not None:
                self._row = row
        return row[1]


class _Staged(_Message):
    """A blocking call's message over a buffer that is not a NumPy array, through a kept copy.

    A view of a ``bytearray``, ``array.array``, ``mmap`` or ``memoryview``
    holds an export of its memory, and while one lives the program cannot
    resize, close or release the buffer (mpi4py releases it when the call
    returns). So the face keeps no view of such a buffer across calls: it
    keeps this message, whose ``array`` is a stage of the message's size that
    the communicator sees on every call (and so replays the plan it compiled
    for it). :meth:`attach` views the buffer afresh -- a ``memoryview`` of its
    bytes, which costs less to make and to copy through than a NumPy view --
    and copies the message's bytes into the stage where the call reads them;
    for a receive buffer ``finish`` copies the result back and lets the view
    go. The face detaches what a call attached when the call ends, also when
    it raises (see :func:`_announced` and :meth:`Comm._run_kept`).
    """

    __slots__ = ("_bytes", "_lo", "_hi", "_total", "_whole", "_owner", "_user")

    def __init__(self, msg: _Message, buf, mem, writable: bool, blocks: int):
        nbytes = msg.array.nbytes
        stage = np.empty(nbytes, _UINT8)
        super().__init__(stage if msg.dtype is _UINT8 else stage.view(msg.dtype), msg.count, msg.dtype, None, blocks)
        self.finish = self._unstage if writable else None
        self._bytes = memoryview(stage)  # the face's own memory: a view of it may live as long as the stage
        # Where the message lies in the buffer's bytes: where its view begins, from where the buffer's does.
        self._lo = msg.array.__array_interface__["data"][0] - mem.__array_interface__["data"][0]
        self._hi, self._total = self._lo + nbytes, mem.size
        self._whole = self._lo == 0 and nbytes == mem.size
        # A memoryview kept alive would keep its object's memory exported: only a weak reference to it.
        self._owner = buf if type(buf) in (bytearray, bytes) else _weakref(buf)
        self._user = None
        # A kept message (copy_of and head keep their arrays, see _Message): marked with the weak reference, not
        # the buffer, which would keep a memoryview's object exported, and a dropped buffer alive.
        self.source = self._owner

    def attach(self, buf, fill: bool = True) -> bool:
        """View ``buf`` afresh for this call; False where ``buf`` is not this message's any more.

        ``fill``: copy the message's bytes into the stage (a call that reads
        them); a call that only writes the message skips that copy. For a
        receive buffer the fresh view is kept until :meth:`_unstage` (or the
        call's end) lets it go.
        """
        owner = self._owner
        if (owner if type(owner) is not _weakref else owner()) is not buf:
            return False
        try:
            user = memoryview(buf).cast("B")
        except (ValueError, BufferError, TypeError):  # released, closed, or no longer one run of bytes
            return False
        if user.nbytes != self._total:
            return False
        # No writeable check: whether a bytearray, bytes, array.array, mmap or memoryview can be
        # written is fixed when it is made, and a receive buffer's stage was made from a writable view.
        if not self._whole:
            user = user[self._lo:self._hi]
        if fill:
            self._bytes[:] = user
        if self.finish is not None:
            self._user = user
        return True

    def _unstage(self) -> None:
        user, self._user = self._user, None
        user[:] = self._bytes

    def detach(self) -> None:
        """Let the fresh view go (a call that raised before ``finish``)."""
        self._user = None


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
    if type(buf) is not _ndarray:
        return None
    return _spec_key(raw, buf, count, displ, datatype, blocks)


def _staged_key(spec):
    """How a blocking call's spec of a buffer it stages (or ``MPI.IN_PLACE``) was written: ``(id of the buffer,
    count, datatype)``, None where a part was not given; :func:`_staged_buf` finds the same writing again."""
    if spec.__class__ is list or spec.__class__ is tuple:
        return (id(spec[0]), None, spec[1]) if len(spec) == 2 else (id(spec[0]), spec[1], spec[2])
    return id(spec), None, None


def _staged_buf(spec, key):
    """The buffer of ``spec`` where it is written as :func:`_staged_key` ``key`` says, else ``_NOTHING``.

    The same buffer object (by identity: the memo's :class:`_Staged` message
    holds it, or checks a weak reference to it, so no other object can have
    taken its id), the same datatype object and the same count; a new list
    each call, as programs write ``[buf, MPI.DOUBLE]``, is found again.
    """
    t = spec.__class__
    if t is list or t is tuple:
        n = len(spec)
        buf = spec[0]
        if id(buf) != key[0]:
            return _NOTHING
        if n == 2:
            return buf if key[1] is None and spec[1] is key[2] else _NOTHING
        if n == 3:
            count = spec[1]
            return buf if count.__class__ is int and count == key[1] and spec[2] is key[2] else _NOTHING
        return _NOTHING
    return spec if id(spec) == key[0] and key[2] is None else _NOTHING


_UNREAD = object()  # a buffer a call does not read at this rank, which its memo does not look at (see _move_memo)
_NO_MOVE = (None, None, _NOTHING, (), None, None, None, None, None, ())  # the empty memo of _move_memo


def _move_memo(collective: str, tag, sendbuf, recvbuf, msgs, x, out, own=None, args=None):
    """The memo of a blocking collective just run on kept copies, for ``Comm._moved``; the empty memo where a
    message is not a :class:`_Staged` copy (NumPy arrays have paths of their own).

    ``msgs``: the kept messages the call attached, each as ``(message, 0 for
    the send spec or 1 for the receive spec, whether the call read it)``, a
    send copy first; ``x`` and ``out``: what the call handed the communicator
    (arrays of those copies, which never move); ``own``: for an in-place call,
    the blocks of this rank's that ``x`` copies before each run; ``tag``: what
    the caller compares before it tries the memo (the root, None where the
    collective has none; ``(op, root)`` for a reduction); ``args``: the rest of
    the communicator's call (for a reduction its op, then any root; by default
    the root, where there is one). A spec given as ``_UNREAD`` (``recvbuf``
    off a Gather's or Reduce's root, ``sendbuf`` off a Scatter's, Bcast's
    second) is not compared. The memo is ``(send key, receive key, tag, msgs,
    collective, x, out, own, plan, args)``.
    """
    for msg, _, _ in msgs:
        if msg.__class__ is not _Staged:
            return _NO_MOVE
    # (None, like MPI.IN_PLACE, is an in-place call's spec: it is compared as one.)
    keys = tuple(None if spec is _UNREAD else _staged_key(spec) for spec in (sendbuf, recvbuf))
    if args is None:
        args = () if tag is None else (tag,)
    return keys + (tag, msgs, collective, x, out, own, None, args)


def _reduced(send, recv):
    """The ``msgs`` of :func:`_move_memo` for a reduction of kept message ``send`` into ``recv`` (the same in place)."""
    return ((recv, 1, True),) if send is recv else ((send, 0, True), (recv, 1, False))


def _spec_key(tag, buf, count, displ, datatype, blocks: int):
    """A key naming the buffer by identity and the rest of its spec by value (None where it cannot)."""
    if (count is not None and count.__class__ is not int) or (displ is not None and displ.__class__ is not int):
        return None
    if datatype is None:
        typekey = buf.dtype if type(buf) is _ndarray else None
    elif datatype.__class__ is str:
        typekey = datatype
    elif isinstance(datatype, _MPI_DATATYPE) and datatype.handle in _DTYPES:
        typekey = datatype.handle  # predefined: a handle no other datatype takes
    else:
        return None
    return tag, id(buf), count, displ, typekey, blocks


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
        try:
            datatype = MPI.Datatype.fromcode(code)
        except ValueError:
            raise InvalidBuffer(f"{name}: cannot map type code {code!r} to an MPI datatype.") from None
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


class _Blocks:
    """One rank's vector buffer as ``size`` blocks of bytes (see :meth:`Comm._blocks`).

    ``sizes`` are the blocks' lengths in bytes, in rank order, and ``total``
    their sum. Over memory the face can view, ``raw`` is the whole buffer as
    bytes and ``starts`` the blocks' offsets in it; ``direct`` is the run of
    bytes the blocks make where they lie back to back in rank order (commkit
    then reads or writes the user's memory itself), else None. Over memory
    only MPI can read, ``raw`` is None and ``packing`` holds what describes the
    blocks to MPI: the buffer, its datatype, the counts, the displacements in
    bytes, and the communicator MPI packs through. One hindexed datatype of
    those blocks makes MPI pack them back to back in rank order, and unpack
    them from there.
    """

    __slots__ = ("sizes", "total", "raw", "starts", "direct", "packing")

    def __init__(self, sizes, raw, starts, packing=None):
        self.sizes = sizes
        self.total = sum(sizes)
        self.raw, self.starts, self.packing = raw, starts, packing
        self.direct = None
        if raw is not None:
            first = at = None
            for start, n in zip(starts, sizes):
                if not n:
                    continue  # an empty block lies anywhere
                if at is None:
                    first = at = start
                elif start != at:
                    break
                at += n
            else:
                lo = 0 if first is None else first
                self.direct = raw[lo:lo + self.total]

    def block(self, i):
        """Block ``i`` as bytes of the user's memory (viewable buffers only)."""
        start = self.starts[i]
        return self.raw[start:start + self.sizes[i]]

    def stage(self):
        """A fresh contiguous buffer for all the blocks, on the buffer's device."""
        xp = np if self.raw is None else array_module(self.raw)
        return xp.empty(self.total, np.uint8)

    def landing(self):
        """Where commkit writes the blocks: ``(out, finish)``, the buffer itself (finish None) or a staging copy."""
        if self.direct is not None:
            return self.direct, None
        out = self.stage()
        return out, partial(self.write, out)

    def read(self, into, only=None) -> None:
        """Copy the blocks (or block ``only``) back to back, in rank order, into ``into``."""
        if self.raw is None:
            self._through_mpi(into, only, pack=True)
        elif only is not None:
            into[...] = self.block(only)
        else:
            at = 0
            for start, n in zip(self.starts, self.sizes):
                into[at:at + n] = self.raw[start:start + n]
                at += n

    def write(self, data) -> None:
        """Copy ``data`` (the blocks back to back, in rank order) into the blocks."""
        if self.raw is None:
            self._through_mpi(data, None, pack=False)
            return
        at = 0
        for start, n in zip(self.starts, self.sizes):
            self.raw[start:start + n] = data[at:at + n]
            at += n

    def _datatype(self, only=None):
        buf, base, counts, displs, local = self.packing
        if only is None:
            return base.Create_hindexed(counts, displs).Commit()
        return base.Create_hindexed([counts[only]], [displs[only]]).Commit()

    def true_extent(self) -> tuple[int, int]:
        """``(lower bound, extent)`` in bytes of what the blocks touch, as MPI computes it."""
        datatype = self._datatype()
        try:
            return datatype.Get_true_extent()
        finally:
            datatype.Free()

    def _through_mpi(self, data, only, pack: bool) -> None:
        buf, _, _, _, local = self.packing
        datatype = self._datatype(only)
        spec = [_BOTTOM if buf is None else buf, 1, datatype]
        try:
            if pack:
                sending = local.Isend(spec, 0, _PACK_TAG)
                local.Recv([data, MPI.PACKED], 0, _PACK_TAG)
            else:
                sending = local.Isend([data, MPI.PACKED], 0, _PACK_TAG)
                local.Recv(spec, 0, _PACK_TAG)
            sending.Wait()
        finally:
            datatype.Free()


def _nbytes(buf) -> int:
    """The bytes of a buffer the face cannot view, as mpi4py's own reader counts them (0 where it has none)."""
    if buf is None or buf is _BOTTOM:
        return 0
    try:
        return len(MPI.buffer(buf))
    except (TypeError, ValueError, BufferError, MPI.Exception):
        return 0


def _interface_datatype(buf):
    """The MPI datatype of a ``__cuda_array_interface__`` object's elements (as mpi4py reads it), or None.

    Without CuPy the face cannot view such memory, but MPI can pack it, as mpi4py
    hands it to MPI: by its address (host memory behind the interface, or
    device memory with a CUDA-aware MPI).
    """
    interface = getattr(buf, "__cuda_array_interface__", None)
    if not isinstance(interface, dict) or "typestr" not in interface:
        return None
    try:
        return MPI._typedict.get(np.dtype(interface["typestr"]).char)
    except TypeError:
        return None


def _vsplit(spec, name: str):
    """``(buf, counts, displs, datatype)`` of a vector buffer spec, unpacked as mpi4py's ``message_vector`` does.

    Unlike a plain spec, a list in the second place is the counts; only a tuple
    there is ``(counts, displs)``.
    """
    if type(spec) is _ndarray or not isinstance(spec, (list, tuple)):
        if spec is None:
            raise InvalidBuffer(f"{name} must be a buffer or a [buffer, counts, displs, datatype] list, got None.")
        return spec, None, None, None
    counts = displs = datatype = None
    if len(spec) == 2:
        buf, counts = spec
        if isinstance(counts, (_MPI_DATATYPE, str)):
            counts, datatype = None, counts
        elif isinstance(counts, tuple):
            counts, displs = _pair(counts, name)
    elif len(spec) == 3:
        buf, counts, datatype = spec
        if isinstance(counts, tuple):
            counts, displs = _pair(counts, name)
    elif len(spec) == 4:
        buf, counts, displs, datatype = spec
    else:
        raise InvalidBuffer(
            f"{name} as a list must have 2 to 4 items [buf, counts, displs, datatype], got {len(spec)}."
        )
    return buf, counts, displs, datatype


def _pair(value, name: str):
    if len(value) != 2:
        raise InvalidBuffer(f"{name}: a tuple in the counts' place must be (counts, displs), got {len(value)} items.")
    return value


def _vcounts(counts, nbytes: int, unit: int, size: int, name: str) -> list:
    """Entries per block, as mpi4py reads them: inferred (the buffer split as evenly as it goes), one int, or a list."""
    if counts is None:
        if unit <= 0 or nbytes % unit:
            raise InvalidBuffer(
                f"{name}: cannot infer the counts: the buffer's {nbytes} bytes are not a whole number of entries "
                f"of {unit} bytes."
            )
        n = nbytes // unit
        return [n // size + (i < n % size) for i in range(size)]
    if isinstance(counts, (int, np.integer)) and not isinstance(counts, bool):
        return [_index(counts, name, "count")] * size
    values = _sequence(counts, size, name, "counts")
    return [_index(c, name, "count") for c in values]


def _vdispls(displs, counts, name: str) -> list:
    """Displacements per block in entries: the prefix sums of the counts, a stride, or a list."""
    size = len(counts)
    if displs is None:
        out, at = [], 0
        for c in counts:
            out.append(at)
            at += c
        return out
    if isinstance(displs, (int, np.integer)) and not isinstance(displs, bool):
        return [int(displs) * i for i in range(size)]
    values = _sequence(displs, size, name, "displs")
    for d in values:
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)):
            raise InvalidBuffer(f"{name}: displacements must be ints, got {d!r}.")
    return [int(d) for d in values]


def _sequence(value, size: int, name: str, what: str) -> list:
    try:
        values = list(value)
    except TypeError:
        raise InvalidBuffer(
            f"{name}: {what} must be an int or a sequence of {size} ints, got {type(value).__name__}."
        ) from None
    if len(values) != size:
        raise InvalidBuffer(f"{name}: {what} must have {size} entries, one per rank; got {len(values)}.")
    return values


def _bytes_of(arr, name: str):
    """The memory of a contiguous array as flat bytes, in memory order."""
    if arr.flags.c_contiguous:
        flat = arr.reshape(-1)
    elif arr.flags.f_contiguous:
        flat = arr.T.reshape(-1)
    else:
        raise InvalidBuffer(f"{name} must be contiguous, as mpi4py requires; got strides {arr.strides}.")
    return flat if flat.dtype == _UINT8 else flat.view(_UINT8)
