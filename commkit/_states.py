"""Whose contributions each element holds, step by step: a collective run on threads with its buffers recorded.

:func:`buffer_states` is public as :func:`commkit.tracing.buffer_states`, and
:func:`commkit.plot.buffer_states` draws it. It lives in a module of its own
because it runs collectives (:func:`commkit.run_local`), which puts it above the
communicator, while the recording it uses (:mod:`commkit._events`) lies below.
"""

from __future__ import annotations

import numpy as np

from ._events import Recorder
from ._world import run_local
from .errors import InvalidArgument
from .schedule import TRANSFER

__all__ = ["buffer_states"]

_COLLECTIVES = ("allreduce", "reduce_scatter", "reduce", "scan", "allgather", "broadcast")


class _StateRecorder(Recorder):
    """A recorder that also keeps a copy of every rank's ``out`` buffer after each step."""

    def __init__(self):
        super().__init__()
        self.snapshots: list = []

    def record(self, info, index, step, t0, t1, bufs) -> None:
        super().record(info, index, step, t0, t1, bufs)
        self.snapshots.append((info.rank, index, step.kind == TRANSFER, bufs["out"].copy()))


def buffer_states(collective: str, algorithm: str, p: int, count: int | None = None, *, root: int = 0,
                  with_events: bool = False) -> list | tuple:
    """Whose contributions each element of every rank's output holds, after each step of a real run.

    The textbook picture of ring allreduce (block i's partial sum travelling round the
    ring), recursive halving or Bruck, computed rather than drawn by hand: the
    collective runs on the threads world with every element of rank r's input set to
    the bit ``1 << r`` and the reduction op ``"bor"``, so an element's value is the set
    of ranks whose data it holds. Data-moving collectives (allgather, broadcast) carry
    the bits unchanged.

    Args:
        collective: one of allreduce, reduce_scatter, reduce, scan, allgather, broadcast.
        algorithm: a registered algorithm of it.
        p: number of ranks, 1 to 62.
        count: elements per rank (default ``p``: one element per block).
        root: the root of reduce and broadcast.
        with_events: also return the run's trace events (to align the states by round, as
            :func:`commkit.plot.buffer_states` does).

    Returns:
        For each rank, a list of ``(step, is_transfer, bits)``: ``bits`` is the rank's whole
        output (a 1-D int64 array) after that step, starting with ``(-1, False, zeros)``.
        With ``with_events``, the pair ``(states, events)``.

    Raises:
        InvalidArgument: an unsupported collective, or ``p`` outside 1..62.
    """
    if collective not in _COLLECTIVES:
        raise InvalidArgument(f"buffer_states shows {', '.join(_COLLECTIVES)}; got {collective!r}.")
    if isinstance(p, bool) or not isinstance(p, int) or not 1 <= p <= 62:
        raise InvalidArgument(f"p must be an int from 1 to 62 (one bit per rank in an int64), got {p!r}.")
    count = p if count is None else int(count)
    rows = count * p if collective == "reduce_scatter" else count

    def body(comm):
        x = np.full(rows, 1 << comm.rank, np.int64)
        if collective == "allgather":
            out = np.zeros((p, count), np.int64)
            comm.allgather(x, out=out, algorithm=algorithm)
        elif collective == "broadcast":
            out = np.zeros(count, np.int64)
            comm.broadcast(x, root=root, out=out, algorithm=algorithm)
        elif collective == "reduce":
            comm.reduce(x, "bor", root=root, out=np.zeros(count, np.int64) if comm.rank == root else None,
                        algorithm=algorithm)
        elif collective == "reduce_scatter":
            comm.reduce_scatter(x, "bor", out=np.zeros(count, np.int64), algorithm=algorithm)
        else:
            getattr(comm, collective)(x, "bor", out=np.zeros(count, np.int64), algorithm=algorithm)

    recorder = _StateRecorder()
    with recorder:
        run_local(body, p)
    states = [[] for _ in range(p)]
    for rank, step, is_transfer, bits in recorder.snapshots:
        if not states[rank]:
            states[rank].append((-1, False, np.zeros_like(bits)))
        states[rank].append((step, is_transfer, bits))
    return (states, recorder.events) if with_events else states
