"""MPI's own vector collectives (``algorithm="native"``): Allgatherv, Gatherv, Scatterv, Alltoallv.

The communicator hands over flat arrays and the call's counts in elements,
exactly the schedule argument (per-rank counts, or for alltoallv the p x p
matrix of what rank i sends rank j). MPI is given bytes: buffers go as
``[array, MPI.BYTE]`` like every other message of the MPI transport, so any
dtype works (float16 and bool included), and counts and displacements are
multiplied by the itemsize. Blocks are packed in rank order, so the
displacements are the prefix sums of the counts. mpi4py 4 calls the MPI-4
large-count routines where a count passes 2**31 - 1 bytes.

Where MPI ignores a buffer (the receive side of a gatherv on non-roots, the
send side of a scatterv on non-roots) it is passed as None, whatever the
communicator handed in.
"""

from __future__ import annotations

from mpi4py import MPI

__all__ = ["native_vector"]

_NAMES = {"allgatherv": "Allgatherv", "gatherv": "Gatherv", "scatterv": "Scatterv", "alltoallv": "Alltoallv"}


def _layout(counts, itemsize: int):
    """Byte counts and displacements of blocks packed in rank order."""
    sizes = [int(c) * itemsize for c in counts]
    displs, at = [], 0
    for size in sizes:
        displs.append(at)
        at += size
    return sizes, displs


def native_vector(comm, collective: str, sendbuf, recvbuf, counts, root: int, nonblocking: bool):
    """Run MPI's ``collective`` (one of allgatherv, gatherv, scatterv, alltoallv) on flat arrays.

    Args:
        comm: the ``mpi4py.MPI.Comm`` to run on.
        collective: ``"allgatherv"``, ``"gatherv"``, ``"scatterv"`` or ``"alltoallv"``.
        sendbuf: this rank's flat input (None or ignored where MPI ignores it).
        recvbuf: this rank's flat output (None or ignored where MPI ignores it).
        counts: elements per rank (a sequence of p ints), or for alltoallv the p x p
            matrix whose entry ``[i][j]`` is what rank i sends rank j.
        root: the root of gatherv and scatterv (ignored otherwise).
        nonblocking: start the nonblocking form and return its request.

    Returns:
        The ``mpi4py.MPI.Request`` when ``nonblocking``, else None (the call has completed).

    Raises:
        ValueError: ``collective`` is not one of the four.
        mpi4py.MPI.Exception: whatever the library reports.
    """
    name = _NAMES.get(collective)
    if name is None:
        raise ValueError(f"no native vector collective {collective!r}; expected one of {sorted(_NAMES)}.")
    rank = comm.Get_rank()
    itemsize = (sendbuf if sendbuf is not None else recvbuf).dtype.itemsize
    byte = MPI.BYTE
    if collective == "alltoallv":
        size = comm.Get_size()
        scounts, sdispls = _layout(counts[rank], itemsize)
        rcounts, rdispls = _layout([counts[q][rank] for q in range(size)], itemsize)
        args = ([sendbuf, scounts, sdispls, byte], [recvbuf, rcounts, rdispls, byte])
    else:
        sizes, displs = _layout(counts, itemsize)
        vector = [recvbuf if collective != "scatterv" else sendbuf, sizes, displs, byte]
        if collective == "allgatherv":
            args = ([sendbuf, byte], vector)
        elif collective == "gatherv":
            args = ([sendbuf, byte], vector if rank == root else None, root)
        else:
            args = (vector if rank == root else None, [recvbuf, byte], root)
    method = getattr(comm, "I" + name.lower() if nonblocking else name)
    request = method(*args)
    return request if nonblocking else None
