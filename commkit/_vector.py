"""The vector collectives of :class:`~commkit.Communicator`: allgatherv, gatherv, scatterv, alltoallv.

Semantics are NumPy's, along axis 0: a rank contributes the *rows* of its
array, ``counts`` are numbers of rows, and a gathered result is
``np.concatenate`` of the ranks' arrays in rank order. Trailing dimensions
(``x.shape[1:]``) and the dtype must be the same on every rank. The schedules
(:mod:`commkit.algorithms.vector`) work in elements of flat buffers, so rows
are multiplied by the row size here, once.

Why every rank needs every count. The counts are part of the call's
identity (its tag, :mod:`commkit.identity`) and of the algorithm choice,
which must come out the same on every rank; and a tree algorithm needs
every subtree's size. So when the caller does not pass them, they are
exchanged first with one small :meth:`allgather_object`, which also carries
the trailing shape and dtype, so that a disagreement raises the same error on
every rank instead of hanging. For alltoallv every rank needs the whole p x p
matrix: pass it as ``send_counts`` (the same on every rank) to skip the
exchange, or pass this rank's row and let the rows be exchanged.

Validation order: communicator open, then local arguments (arrays, counts,
root, ``out``), then the exchange, then what the exchange tells (the same
check on every rank), all before any data moves.

Persistent forms (``allgatherv_init`` ...) are the same calls compiled once,
MPI-4 style (:class:`commkit.PersistentRequest`): the counts are fixed when
the request is made -- given, or exchanged then, so ``*_init`` with
``counts=None`` blocks until every rank has made it -- and every ``start()``
moves whatever ``x`` holds at that moment into the same ``out``. So ``x`` must
be an array the request can read in place: a C-contiguous NumPy or CuPy
array (a list, or an array NumPy would have to copy, raises
:class:`~commkit.errors.InvalidBuffer` instead of silently sending a stale
copy).

In place is not offered (no ``out=x``): for allgatherv and gatherv the output
is larger than the input, and for alltoallv blocks move between ranks, so an
overlapping ``out`` raises :class:`~commkit.errors.InvalidBuffer`.
"""

from __future__ import annotations

import reprlib

import numpy as np

from . import algorithms
from ._call import Call
from ._checks import array_module, check_out, check_rank, check_timeout, input_for, same_memory
from .errors import AlgorithmNotApplicable, InvalidArgument, InvalidBuffer

__all__ = ["VectorCollectives"]

_short = reprlib.Repr()
_short.maxlist = _short.maxtuple = 8
_short.maxlevel = 3


def _show(value) -> str:
    return _short.repr(value)


def _is_count(c) -> bool:
    return isinstance(c, (int, np.integer)) and not isinstance(c, (bool, np.bool_)) and c >= 0


def _counts(value, size: int, name: str) -> tuple:
    """``value`` as a tuple of ``size`` non-negative ints, or an error naming what is wrong."""
    if hasattr(value, "__iter__") and not hasattr(value, "__len__") and not isinstance(value, (str, bytes)):
        value = tuple(value)  # an iterator (a generator expression): read once
    if value is None or isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
        raise InvalidArgument(
            f"{name} must be a sequence of {size} non-negative ints (rows for each rank), got {_show(value)}.")
    if len(value) != size:
        raise InvalidArgument(
            f"{name} must have {size} entries, one per rank; got {len(value)}: {_show(value)}.")
    for q, c in enumerate(value):
        if not _is_count(c):
            raise InvalidArgument(
                f"{name}[{q}] must be a non-negative int (a number of rows), got {c!r} in {_show(value)}.")
    return tuple(int(c) for c in value)


def _result(comm, out, shape, x, collective: str, counts):
    """The result buffer: ``out`` checked, or a new array; counts too large for any array are an InvalidArgument.

    (Without this, NumPy's own ValueError or MemoryError surfaced on the ranks whose
    own count passed, while the others raised InvalidArgument for theirs.)
    """
    try:
        return comm._output(out, shape, x)
    except (MemoryError, ValueError) as exc:
        raise InvalidArgument(
            f"{collective}'s result would have shape {shape} (from counts {_show(counts)}), which cannot be "
            f"allocated ({type(exc).__name__}: {exc}); the counts are rows per rank, the same on every rank.") from None


def _is_matrix(value) -> bool:
    if isinstance(value, np.ndarray):
        return value.ndim == 2
    return bool(hasattr(value, "__len__") and len(value) and not isinstance(value, (str, bytes))
                and hasattr(value[0], "__len__") and not isinstance(value[0], (str, bytes)))


def _rows(x, collective: str):
    if x.ndim == 0:
        raise InvalidBuffer(
            f"{collective}'s x must have at least one dimension: ranks contribute the rows of axis 0; "
            "got a 0-d array. Pass x.reshape(1) to contribute one element.")
    return x.shape[0], tuple(x.shape[1:])


def _row_size(trailing) -> int:
    return int(np.prod(trailing, dtype=np.int64))


def _agree(collective: str, everyone, fields) -> None:
    """Raise the same error on every rank if the ranks' metadata differ in one of ``fields``.

    ``everyone`` is the list of every rank's metadata tuple; ``fields`` maps a tuple index
    to what it means (``{2: "trailing shape x.shape[1:]"}``).
    """
    for index, meaning in fields.items():
        seen: dict = {}
        for rank, meta in enumerate(everyone):
            seen.setdefault(meta[index], []).append(rank)
        if len(seen) > 1:
            parts = "; ".join(f"{value} on rank(s) {ranks}" for value, ranks in seen.items())
            raise InvalidBuffer(f"{collective} needs the same {meaning} on every rank; got {parts}.")


def _check_algorithm(collective: str, algorithm) -> None:
    """An unknown algorithm name raises before the counts are exchanged (the selector says the same later)."""
    if algorithm is None or algorithm == "auto":
        return
    if not isinstance(algorithm, str) or algorithms.get(collective, algorithm) is None:
        raise AlgorithmNotApplicable(
            f"unknown {collective} algorithm {algorithm!r} (from algorithm= argument); expected one of "
            f"{sorted(algorithms.for_collective(collective))} or 'auto'.")




class VectorCollectives:
    """The vector collectives, mixed into :class:`~commkit.Communicator`.

    Uses the communicator's ``rank``, ``size``, ``_check_open``, ``_output``,
    ``_run`` and ``allgather_object``. Each worker's ``nonblocking`` is what
    ``_run`` takes: False (blocking), True (the ``i``-form) or ``"init"`` (the
    persistent form).
    """

    # -- allgatherv ---------------------------------------------------------------------------------------------

    def allgatherv(self, x, counts=None, *, out=None, algorithm=None, timeout=None):
        """Every rank gets every rank's rows, concatenated in rank order: ``np.concatenate(xs, axis=0)``.

        Ranks may contribute different numbers of rows (including none); the
        trailing shape ``x.shape[1:]`` and the dtype must be the same everywhere.

        Args:
            x: this rank's rows, an array of at least one dimension.
            counts: rows of every rank (``counts[r] == x.shape[0]`` on rank r), the same
                sequence on every rank. None exchanges the row counts first with one extra
                small collective (:meth:`allgather_object`), which also checks that every
                rank has the same trailing shape and dtype.
            out: optional result buffer of shape ``(sum(counts), *x.shape[1:])`` and x's
                dtype; it must not overlap ``x``.
            algorithm: force an algorithm (``"naive"``, ``"ring"``, ``"native"``); default: selected.
            timeout: seconds without progress before CommTimeout (default: the communicator's).

        Returns:
            The concatenation (``out`` if given).

        Raises:
            InvalidArgument: counts of the wrong length, negative or not ints, or
                ``counts[rank]`` differing from ``x.shape[0]``.
            InvalidBuffer: a 0-d or non-numeric ``x``; an ``out`` of the wrong shape or dtype,
                or overlapping ``x``; ranks disagreeing about the trailing shape or dtype
                (found by the exchange when ``counts`` is None, raised on every rank).
            AlgorithmNotApplicable: an unknown or unavailable ``algorithm``.
        """
        return self._allgatherv(x, counts, out, algorithm, timeout, False)

    def iallgatherv(self, x, counts=None, *, out=None, algorithm=None, timeout=None):
        """Nonblocking :meth:`allgatherv`; ``wait()`` returns the concatenation.

        With ``counts=None`` the row counts are exchanged before this returns (that
        exchange blocks); the data moves as the request progresses.
        """
        return self._allgatherv(x, counts, out, algorithm, timeout, True)

    def allgatherv_init(self, x, counts=None, *, out=None, algorithm=None, timeout=None):
        """Persistent :meth:`allgatherv` (MPI-4 ``MPI_Allgatherv_init``): made once, then started as often as needed.

        ``req.start()`` begins one run (it never blocks) with whatever ``x`` holds
        then, and ``req.wait()`` completes it and returns the concatenation (always
        the same array: ``out``, or one allocated here). Every rank makes its
        persistent collectives, and starts them, in the same order. ``req.free()``
        releases it.

        Args:
            x: this rank's rows, a C-contiguous array that the request reads at every
                start (refill it in place between runs).
            counts: rows of every rank, the same sequence on every rank; None
                exchanges them now (this call then blocks until every rank has made it).
            out, algorithm, timeout: as for :meth:`allgatherv`.

        Returns:
            A :class:`commkit.PersistentRequest`.

        Raises:
            InvalidArgument, InvalidBuffer, AlgorithmNotApplicable: as for
                :meth:`allgatherv`; InvalidBuffer also for an ``x`` the request
                cannot read in place (a list, a non-contiguous array).
        """
        return self._allgatherv(x, counts, out, algorithm, timeout, "init")

    def _allgatherv(self, x, counts, out, algorithm, timeout, nonblocking):
        self._check_open()
        x = input_for(x, nonblocking, "allgatherv")
        rows, trailing = _rows(x, "allgatherv")
        rank, size = self.rank, self.size
        if counts is not None:
            counts = _counts(counts, size, "counts")
            _own_rows(counts, rank, rows, "counts", "x.shape[0]")
        _pre_check_out(out, trailing, x.dtype)
        timeout = _pre_check(timeout, "allgatherv", algorithm)
        if counts is None:
            everyone = self.allgather_object((rows, trailing, str(x.dtype)), timeout=timeout)
            _agree("allgatherv", everyone, {1: "trailing shape x.shape[1:]", 2: "dtype"})
            counts = tuple(meta[0] for meta in everyone)
        shape = (sum(counts),) + trailing
        out = _result(self, out, shape, x, "allgatherv", counts)
        _no_overlap(x, out, "allgatherv")
        elems = tuple(c * _row_size(trailing) for c in counts)
        call = Call("allgatherv", elems, x.reshape(-1), out.reshape(-1), None, 0, sum(elems) * x.dtype.itemsize,
                     x.dtype, array_module(x), False, shape)
        call.result = out
        return self._run(call, algorithm, timeout, nonblocking)

    # -- gatherv ------------------------------------------------------------------------------------------------

    def gatherv(self, x, root: int = 0, counts=None, *, out=None, algorithm=None, timeout=None):
        """``root`` gets every rank's rows concatenated in rank order; the other ranks get None.

        Args:
            x: this rank's rows, an array of at least one dimension (same trailing shape
                and dtype on every rank).
            root: the rank that receives the result.
            counts: rows of every rank, the same sequence on every rank. None exchanges the
                row counts first with one extra small collective (:meth:`allgather_object`;
                every rank needs every count: the tree algorithms forward whole subtrees).
            out: the root's optional result buffer, shape ``(sum(counts), *x.shape[1:])``,
                not overlapping ``x``; ignored on other ranks.
            algorithm: force an algorithm (``"naive"``, ``"binomial"``, ``"native"``); default: selected.
            timeout: seconds without progress before CommTimeout (default: the communicator's).

        Returns:
            The concatenation on ``root`` (``out`` if given), None elsewhere.

        Raises:
            InvalidArgument: a bad ``root``; counts of the wrong length, negative or not ints,
                or ``counts[rank]`` differing from ``x.shape[0]``.
            InvalidBuffer: as for :meth:`allgatherv`.
            AlgorithmNotApplicable: an unknown or unavailable ``algorithm``.
        """
        return self._gatherv(x, root, counts, out, algorithm, timeout, False)

    def igatherv(self, x, root: int = 0, counts=None, *, out=None, algorithm=None, timeout=None):
        """Nonblocking :meth:`gatherv`; ``wait()`` returns the result (None off the root).

        With ``counts=None`` the row counts are exchanged before this returns.
        """
        return self._gatherv(x, root, counts, out, algorithm, timeout, True)

    def gatherv_init(self, x, root: int = 0, counts=None, *, out=None, algorithm=None, timeout=None):
        """Persistent :meth:`gatherv` (MPI-4 ``MPI_Gatherv_init``); see :meth:`allgatherv_init`.

        Args:
            x: this rank's rows, a C-contiguous array read at every start.
            root: the rank that receives the result.
            counts: rows of every rank, the same sequence on every rank; None
                exchanges them now (this call then blocks until every rank has made it).
            out, algorithm, timeout: as for :meth:`gatherv`.

        Returns:
            A :class:`commkit.PersistentRequest` whose ``wait()`` returns the
            concatenation on ``root`` and None elsewhere.

        Raises:
            InvalidArgument, InvalidBuffer, AlgorithmNotApplicable: as for
                :meth:`gatherv` and :meth:`allgatherv_init`.
        """
        return self._gatherv(x, root, counts, out, algorithm, timeout, "init")

    def _gatherv(self, x, root, counts, out, algorithm, timeout, nonblocking):
        self._check_open()
        x = input_for(x, nonblocking, "gatherv")
        rows, trailing = _rows(x, "gatherv")
        rank, size = self.rank, self.size
        root = check_rank(root, size, "root")
        if counts is not None:
            counts = _counts(counts, size, "counts")
            _own_rows(counts, rank, rows, "counts", "x.shape[0]")
        if rank == root:
            _pre_check_out(out, trailing, x.dtype)
        timeout = _pre_check(timeout, "gatherv", algorithm)
        if counts is None:
            everyone = self.allgather_object((rows, trailing, str(x.dtype)), timeout=timeout)
            _agree("gatherv", everyone, {1: "trailing shape x.shape[1:]", 2: "dtype"})
            counts = tuple(meta[0] for meta in everyone)
        shape = (sum(counts),) + trailing
        xp = array_module(x)
        if rank == root:
            out = _result(self, out, shape, x, "gatherv", counts)
            _no_overlap(x, out, "gatherv")
        else:
            out = xp.empty(0, dtype=x.dtype)
        elems = tuple(c * _row_size(trailing) for c in counts)
        call = Call("gatherv", elems, x.reshape(-1), out.reshape(-1), None, root, sum(elems) * x.dtype.itemsize,
                     x.dtype, xp, False, shape, rank == root)
        call.result = out
        return self._run(call, algorithm, timeout, nonblocking)

    # -- scatterv -----------------------------------------------------------------------------------------------

    def scatterv(self, x, counts, root: int = 0, *, out=None, algorithm=None, timeout=None):
        """Rank r gets ``counts[r]`` rows of the root's ``x``: the root's ``x`` split along axis 0.

        Rank r's block is ``x[sum(counts[:r]) : sum(counts[:r + 1])]`` of the root's ``x``.
        As for :meth:`scatter`, only the root's ``x`` is read: other ranks pass ``x=None``
        and ``out=`` a buffer for their block, which says its trailing shape and dtype.

        Args:
            x: on the root, the rows to split (``x.shape[0] == sum(counts)``); ignored elsewhere.
            counts: rows for every rank, the same sequence on every rank.
            root: the rank whose ``x`` is split.
            out: the block buffer, shape ``(counts[rank], *x.shape[1:])`` with the root's
                dtype: required on every rank but the root, optional there (and then it
                must not overlap ``x``).
            algorithm: force an algorithm (``"naive"``, ``"binomial"``, ``"native"``); default: selected.
            timeout: seconds without progress before CommTimeout (default: the communicator's).

        Returns:
            This rank's block (``out`` if given).

        Raises:
            InvalidArgument: a bad ``root``; counts of the wrong length, negative or not ints,
                or not summing to the root's ``x.shape[0]``.
            InvalidBuffer: a 0-d or non-numeric ``x`` on the root; a missing ``out`` on
                another rank; an ``out`` whose rows differ from ``counts[rank]`` (or whose
                shape or dtype differ from the root's blocks, on the root); an ``out``
                overlapping ``x``.
            AlgorithmNotApplicable: an unknown or unavailable ``algorithm``.
        """
        return self._scatterv(x, counts, root, out, algorithm, timeout, False)

    def iscatterv(self, x, counts, root: int = 0, *, out=None, algorithm=None, timeout=None):
        """Nonblocking :meth:`scatterv`; ``wait()`` returns this rank's block."""
        return self._scatterv(x, counts, root, out, algorithm, timeout, True)

    def scatterv_init(self, x, counts, root: int = 0, *, out=None, algorithm=None, timeout=None):
        """Persistent :meth:`scatterv` (MPI-4 ``MPI_Scatterv_init``); see :meth:`allgatherv_init`.

        ``counts`` are required, as for :meth:`scatterv`: nothing is exchanged.

        Args:
            x: on the root, the C-contiguous rows to split, read at every start;
                ignored elsewhere (pass None).
            counts: rows for every rank, the same sequence on every rank.
            root: the rank whose ``x`` is split.
            out, algorithm, timeout: as for :meth:`scatterv` (``out`` is required
                on every rank but the root).

        Returns:
            A :class:`commkit.PersistentRequest` whose ``wait()`` returns this rank's block.

        Raises:
            InvalidArgument, InvalidBuffer, AlgorithmNotApplicable: as for
                :meth:`scatterv` and :meth:`allgatherv_init`.
        """
        return self._scatterv(x, counts, root, out, algorithm, timeout, "init")

    def _scatterv(self, x, counts, root, out, algorithm, timeout, nonblocking):
        self._check_open()
        rank, size = self.rank, self.size
        root = check_rank(root, size, "root")
        counts = _counts(counts, size, "counts")
        if rank == root:
            x = input_for(x, nonblocking, "scatterv")
            rows, trailing = _rows(x, "scatterv")
            if rows != sum(counts):
                raise InvalidArgument(
                    f"scatterv's counts must sum to the rows of x on the root, {rows}; they sum to "
                    f"{sum(counts)}: {_show(counts)}.")
            out = self._output(out, (counts[rank],) + trailing, x)
            _no_overlap(x, out, "scatterv")
            like = x
        else:
            if out is None:
                raise InvalidBuffer(
                    f"scatterv on non-root rank {rank} needs out= (a buffer of shape ({counts[rank]}, ...) "
                    "and the root's dtype); only the root's x is read.")
            out = check_out(out, None, None, "out")
            if out.ndim == 0 or out.shape[0] != counts[rank]:
                raise InvalidBuffer(
                    f"scatterv's out on rank {rank} must have counts[{rank}] = {counts[rank]} rows "
                    f"(shape ({counts[rank]}, ...)), got shape {tuple(out.shape)}.")
            trailing, like = tuple(out.shape[1:]), out
        timeout = _pre_check(timeout, "scatterv", algorithm)
        xp = array_module(like)
        src = x.reshape(-1) if rank == root else xp.empty(0, dtype=like.dtype)
        elems = tuple(c * _row_size(trailing) for c in counts)
        call = Call("scatterv", elems, src, out.reshape(-1), None, root, sum(elems) * like.dtype.itemsize,
                     like.dtype, xp, False, out.shape)
        call.result = out
        return self._run(call, algorithm, timeout, nonblocking)

    # -- alltoallv ----------------------------------------------------------------------------------------------

    def alltoallv(self, x, send_counts, recv_counts=None, *, out=None, algorithm=None, timeout=None):
        """Rank r sends ``send_counts[j]`` rows of ``x`` to rank j; it gets the rows sent to it, in rank order.

        ``x`` is split along axis 0 into p consecutive blocks, ``send_counts[j]`` rows for
        rank j. The result is the concatenation of the blocks received from ranks
        0, 1, ..., p-1 (rank i's block has ``recv_counts[i]`` rows, what rank i sends here).

        Every rank needs the whole p x p matrix of counts: it is part of the call's identity
        and of the algorithm choice, which must agree on every rank. Pass it as
        ``send_counts`` (``send_counts[i][j]`` = rows rank i sends rank j, the same matrix
        on every rank) and nothing is exchanged; pass this rank's row and the rows are
        exchanged first with one extra small collective (:meth:`allgather_object`), which
        also checks ``recv_counts`` against what the others send.

        Args:
            x: this rank's rows, ``x.shape[0] == sum(send_counts)`` (same trailing shape and
                dtype on every rank).
            send_counts: rows for each rank (p ints), or the whole p x p matrix.
            recv_counts: optional rows expected from each rank (p ints), checked; by default
                taken from the matrix.
            out: optional result buffer, shape ``(sum(recv_counts), *x.shape[1:])``, not
                overlapping ``x``.
            algorithm: force an algorithm (``"naive"``, ``"pairwise"``, ``"native"``); default: selected.
            timeout: seconds without progress before CommTimeout (default: the communicator's).

        Returns:
            The received rows in rank order (``out`` if given).

        Raises:
            InvalidArgument: counts of the wrong length or shape, negative or not ints,
                ``send_counts`` not summing to ``x.shape[0]``, or ``recv_counts`` differing
                from what the other ranks send (raised on every rank after the exchange).
            InvalidBuffer: a 0-d or non-numeric ``x``; an ``out`` of the wrong shape or dtype,
                or overlapping ``x``; ranks disagreeing about the trailing shape or dtype.
            AlgorithmNotApplicable: an unknown or unavailable ``algorithm``.
        """
        return self._alltoallv(x, send_counts, recv_counts, out, algorithm, timeout, False)

    def ialltoallv(self, x, send_counts, recv_counts=None, *, out=None, algorithm=None, timeout=None):
        """Nonblocking :meth:`alltoallv`; ``wait()`` returns the received rows.

        Unless ``send_counts`` is the whole matrix, the rows of counts are exchanged
        before this returns.
        """
        return self._alltoallv(x, send_counts, recv_counts, out, algorithm, timeout, True)

    def alltoallv_init(self, x, send_counts, recv_counts=None, *, out=None, algorithm=None, timeout=None):
        """Persistent :meth:`alltoallv` (MPI-4 ``MPI_Alltoallv_init``); see :meth:`allgatherv_init`.

        Args:
            x: this rank's rows, a C-contiguous array read at every start.
            send_counts: the whole p x p matrix (nothing is exchanged), or this rank's
                row (the rows are exchanged now: this call then blocks until every
                rank has made it).
            recv_counts, out, algorithm, timeout: as for :meth:`alltoallv`.

        Returns:
            A :class:`commkit.PersistentRequest` whose ``wait()`` returns the received rows.

        Raises:
            InvalidArgument, InvalidBuffer, AlgorithmNotApplicable: as for
                :meth:`alltoallv` and :meth:`allgatherv_init`.
        """
        return self._alltoallv(x, send_counts, recv_counts, out, algorithm, timeout, "init")

    def _alltoallv(self, x, send_counts, recv_counts, out, algorithm, timeout, nonblocking):
        self._check_open()
        x = input_for(x, nonblocking, "alltoallv")
        rows, trailing = _rows(x, "alltoallv")
        rank, size = self.rank, self.size
        matrix = None
        if _is_matrix(send_counts):
            if len(send_counts) != size:
                raise InvalidArgument(
                    f"send_counts as a matrix must have {size} rows, one per sending rank; got {len(send_counts)}.")
            matrix = tuple(_counts(row, size, f"send_counts[{q}]") for q, row in enumerate(send_counts))
            mine = matrix[rank]
        else:
            mine = _counts(send_counts, size, "send_counts")
        if sum(mine) != rows:
            raise InvalidArgument(
                f"alltoallv's send counts of rank {rank} must sum to x.shape[0] = {rows} (the rows to send); "
                f"they sum to {sum(mine)}: {_show(mine)}.")
        if recv_counts is not None:
            recv_counts = _counts(recv_counts, size, "recv_counts")
        if matrix is not None and recv_counts is not None:
            _check_recv(rank, recv_counts, tuple(row[rank] for row in matrix))
        _pre_check_out(out, trailing, x.dtype)
        timeout = _pre_check(timeout, "alltoallv", algorithm)
        if matrix is None:
            everyone = self.allgather_object((mine, recv_counts, trailing, str(x.dtype)), timeout=timeout)
            _agree("alltoallv", everyone, {2: "trailing shape x.shape[1:]", 3: "dtype"})
            matrix = tuple(meta[0] for meta in everyone)
            for q, meta in enumerate(everyone):  # every rank checks every claim: the same error everywhere
                if meta[1] is not None:
                    _check_recv(q, meta[1], tuple(row[q] for row in matrix))
        received = sum(row[rank] for row in matrix)
        shape = (received,) + trailing
        out = _result(self, out, shape, x, "alltoallv", matrix)
        _no_overlap(x, out, "alltoallv")
        row_size = _row_size(trailing)
        elems = tuple(tuple(c * row_size for c in row) for row in matrix)
        # The selector's size of an all-to-all is one block: here the average block, the same on every rank.
        nbytes = sum(map(sum, elems)) * x.dtype.itemsize // (size * size)
        call = Call("alltoallv", elems, x.reshape(-1), out.reshape(-1), None, 0, nbytes, x.dtype,
                     array_module(x), False, shape)
        call.result = out
        return self._run(call, algorithm, timeout, nonblocking)


def _own_rows(counts, rank, rows, name, what) -> None:
    if counts[rank] != rows:
        raise InvalidArgument(
            f"{name}[{rank}] must equal {what} on rank {rank}, {rows}; got {counts[rank]} "
            f"(counts are rows per rank, the same sequence on every rank).")


def _check_recv(rank, claimed, sent) -> None:
    if tuple(claimed) != sent:
        raise InvalidArgument(
            f"recv_counts of rank {rank} must be what each rank sends it, {_show(sent)}; got {_show(tuple(claimed))}.")


def _pre_check(timeout, collective, algorithm):
    """Checks that need no peer: the timeout and the algorithm's name. Returns the timeout."""
    if timeout is not None:
        timeout = check_timeout(timeout)
    _check_algorithm(collective, algorithm)
    return timeout


def _pre_check_out(out, trailing, dtype) -> None:
    """What can be checked of ``out`` before the row total is known: type, dtype, trailing shape, layout."""
    if out is None:
        return
    check_out(out, None, dtype, "out")
    if out.ndim == 0 or tuple(out.shape[1:]) != trailing:
        expected = "".join(f", {d}" for d in trailing)
        raise InvalidBuffer(
            f"out must have shape (total rows{expected}): rows shaped like x's, x.shape[1:] = {trailing}; "
            f"got shape {tuple(out.shape)}.")


def _no_overlap(x, out, collective) -> None:
    if same_memory(x, out):
        raise InvalidBuffer(f"{collective} cannot run in place: pass an out buffer that does not overlap x.")
