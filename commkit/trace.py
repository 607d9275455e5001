"""Recording what collectives really did: per-rank step timelines.

``with commkit.trace() as t:`` records every step of every collective run on
any communicator while the block is active (all ranks of a threads world share
one recorder). Under MPI pass the communicator, ``commkit.trace(comm)``, and
the ranks' records are gathered to rank 0 when the block ends.

Each event is a dict: ``rank``, ``collective``, ``seq``, ``algorithm``,
``step`` (index in the schedule), ``kind`` (``send``/``recv``/``exchange``/
``transfer``/``reduce``/``copy``), ``sends`` and ``recvs`` (lists of
``[peer, bytes]``), ``bytes`` and ``start``/``end`` (seconds, ``perf_counter``).
"""

from __future__ import annotations

import threading

from .schedule import REDUCE, TRANSFER

__all__ = ["trace", "Tracer", "current"]

_active: list = []
_lock = threading.Lock()


def current():
    """The innermost active tracer, or None (the executor's zero-cost check)."""
    return _active[-1] if _active else None


class Tracer:
    """Collects step events; see the module docstring for their fields."""

    def __init__(self, comm=None):
        self.comm = comm
        self.events: list[dict] = []

    def record(self, info, index, step, t0, t1, bufs) -> None:
        kind = step.kind
        if kind == TRANSFER:
            sends = [[peer, _nbytes(bufs, buf)] for peer, buf in step.sends]
            recvs = [[peer, _nbytes(bufs, buf)] for peer, buf in step.recvs]
            name = type(step).__name__.lower()
            nbytes = sum(b for _, b in sends) + sum(b for _, b in recvs)
        else:
            sends, recvs = [], []
            name = "reduce" if kind == REDUCE else "copy"
            nbytes = _nbytes(bufs, step.into if kind == REDUCE else step.dst)
        self.events.append({
            "rank": info.rank, "collective": info.collective, "seq": info.seq, "algorithm": info.algorithm,
            "step": index, "kind": name, "sends": sends, "recvs": recvs, "bytes": nbytes, "start": t0, "end": t1,
        })

    def __enter__(self) -> "Tracer":
        with _lock:
            _active.append(self)
        return self

    def __exit__(self, *exc) -> None:
        with _lock:
            _active.remove(self)
        if self.comm is not None and exc[0] is None and getattr(self.comm, "transport_name", "local") != "local":
            gathered = self.comm.gather_object(self.events, root=0)
            if gathered is not None:
                self.events = [event for events in gathered for event in events]

    def ranks(self) -> list[int]:
        return sorted({e["rank"] for e in self.events})


def _nbytes(bufs, buf) -> int:
    name, lo, hi = buf
    return (hi - lo) * bufs[name].itemsize


def trace(comm=None) -> Tracer:
    """Record every collective step run inside the ``with`` block; see :class:`Tracer`."""
    return Tracer(comm)


