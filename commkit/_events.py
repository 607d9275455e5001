"""Trace events: the one format of a recorded or simulated step, who records it, and matching messages in it.

The layer under :mod:`commkit.tracing` and :mod:`commkit.plot`, apart so that the
imports go one way: the tracer imports the pictures (``Tracer.timeline``), the
pictures read events from here and not from the tracer, and the modules that run
collectives need only the stack of active recorders, not the tracer (which runs
collectives itself, in :func:`commkit.tracing.buffer_states`):

* :data:`active` and :func:`current`: the recorders active now, innermost last.
  The executor asks the innermost for every step it runs (the communicator and
  the plans test the list itself: empty means "nothing to record").
* :func:`step_event` and :func:`native_event`: the event of one step, the same
  dict whether a real run (:class:`Recorder`) or the simulator makes it; the
  fields are described in :mod:`commkit.tracing`.
* :class:`Recorder`: collects the events of every step run while it is active;
  :class:`commkit.tracing.Tracer` adds gathering from every rank and the views.
* :func:`events_of` and :func:`messages`: reading events back, as the tracer's
  views and the pictures do.

This module imports nothing from commkit but the schedule's step kinds and the errors.
"""

from __future__ import annotations

import threading
from collections import defaultdict, deque
from dataclasses import dataclass

from .errors import InvalidArgument
from .schedule import REDUCE, TRANSFER

__all__ = ["EVENT_KEYS", "MESSAGE_KINDS", "RANGE_KEYS", "Message", "Recorder", "active", "current", "events_of",
           "messages", "native_event", "step_event"]

# The fields of every event, real or simulated (documented as commkit.tracing.EVENT_KEYS).
EVENT_KEYS = ("rank", "collective", "seq", "algorithm", "step", "kind", "sends", "recvs", "bytes", "start", "end")

# The buffer ranges of a step, absent from traces saved before they existed (commkit.tracing.RANGE_KEYS).
RANGE_KEYS = ("send_ranges", "recv_ranges", "range", "src_range")

# The kinds of event that move messages.
MESSAGE_KINDS = frozenset({"send", "recv", "exchange", "transfer"})

active: list = []
"""The active recorders, innermost last: a :class:`Recorder` is on it inside its ``with`` block."""

_lock = threading.Lock()


def current():
    """The innermost active recorder, or None (the executor's zero-cost check)."""
    return active[-1] if active else None


# -- making events --------------------------------------------------------------------------------------------------


def step_event(rank: int, collective: str, seq: int, algorithm: str, index: int, step, start: float, end: float,
               itemsize) -> dict:
    """The event of one finished step of a schedule.

    Args:
        rank, collective, seq, algorithm: the call the step belongs to (``seq`` numbers a
            communicator's calls).
        index: the step's index in the rank's schedule.
        step: the :mod:`commkit.schedule` step (a Transfer, Reduce or Copy).
        start, end: when it ran (``time.perf_counter()`` seconds, or model seconds).
        itemsize: a function from the name of a buffer the step names (``"in"``, ``"out"``,
            ``"tmp"``) to its bytes per element (``{"in": 8, "out": 8, "tmp": 8}.__getitem__``).

    Returns:
        the event dict: every field of :data:`EVENT_KEYS`, and the ranges of :data:`RANGE_KEYS`
        that the step's kind has.
    """
    kind = step.kind
    event = {"rank": rank, "collective": collective, "seq": seq, "algorithm": algorithm, "step": index}
    if kind == TRANSFER:
        sends = [[peer, (buf[2] - buf[1]) * itemsize(buf[0])] for peer, buf in step.sends]
        recvs = [[peer, (buf[2] - buf[1]) * itemsize(buf[0])] for peer, buf in step.recvs]
        event.update(kind=type(step).__name__.lower(), sends=sends, recvs=recvs,
                     bytes=sum(b for _, b in sends) + sum(b for _, b in recvs), start=start, end=end,
                     send_ranges=[list(buf) for _, buf in step.sends],
                     recv_ranges=[list(buf) for _, buf in step.recvs])
    else:
        # A reduce's destination is ``into`` and its source the operand it folds in (for the
        # three-address form the other input, ``src``, is this rank's own data); a copy's are dst/src.
        dst, src = (step.into, step.operand) if kind == REDUCE else (step.dst, step.src)
        event.update(kind="reduce" if kind == REDUCE else "copy", sends=[], recvs=[],
                     bytes=(dst[2] - dst[1]) * itemsize(dst[0]), start=start, end=end, send_ranges=[],
                     recv_ranges=[], range=list(dst), src_range=list(src))
    return event


def native_event(rank: int, collective: str, seq: int, algorithm: str, start: float, end: float,
                 nbytes: int) -> dict:
    """The one event of a call the library ran whole (``native``: it has no steps to show)."""
    return {"rank": rank, "collective": collective, "seq": seq, "algorithm": algorithm, "step": 0, "kind": "native",
            "sends": [], "recvs": [], "bytes": int(nbytes), "start": start, "end": end, "send_ranges": [],
            "recv_ranges": []}


class Recorder:
    """Collects the event of every step the executor runs while it is active (``with recorder:``).

    Attributes:
        events: the list of event dicts, in the order the steps ended.
    """

    def __init__(self):
        self.events: list[dict] = []
        # Where record() appends. A call keeps the recorder it found when it started, so its later
        # steps land here even after the with block ended (a subclass may point it at a shared list).
        self._sink = self.events

    def record(self, info, index, step, t0, t1, bufs) -> None:
        """Append the event of one finished step (the executor's hook).

        Args:
            info: the call's :class:`commkit.schedule.CallInfo`.
            index, step, t0, t1: as for :func:`step_event`.
            bufs: the call's buffers by name (arrays).
        """
        self._sink.append(step_event(info.rank, info.collective, info.seq, info.algorithm, index, step, t0, t1,
                                     lambda name: bufs[name].itemsize))

    def record_native(self, info, t0: float, t1: float, nbytes: int) -> None:
        """Append one ``native`` event for a whole library collective (it has no steps to show)."""
        self._sink.append(native_event(info.rank, info.collective, info.seq, info.algorithm, t0, t1, nbytes))

    def __enter__(self):
        with _lock:
            active.append(self)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        with _lock:
            active.remove(self)


# -- reading events -------------------------------------------------------------------------------------------------


def events_of(source) -> list[dict]:
    """The event list of ``source``: a :class:`~commkit.tracing.Tracer`, a simulator result, or a list of events.

    Raises:
        InvalidArgument: ``source`` holds no events or an event lacks one of :data:`EVENT_KEYS`.
    """
    events = getattr(source, "events", source)
    if events is None:
        raise InvalidArgument("no events: simulate with events=True, or record a run with commkit.trace().")
    if isinstance(events, (str, bytes, dict)) or not hasattr(events, "__iter__"):
        raise InvalidArgument(
            f"expected a Tracer, a simulator result or a list of events, got {type(source).__name__}."
        )
    events = list(events)
    for e in events:
        if not isinstance(e, dict) or any(k not in e for k in EVENT_KEYS):
            missing = [k for k in EVENT_KEYS if not isinstance(e, dict) or k not in e]
            raise InvalidArgument(f"not a trace event (missing {missing}): {e!r}.")
    return events


@dataclass(frozen=True)
class Message:
    """One message of a trace: a send step on ``src`` matched with a receive step on ``dst``."""

    src: int
    dst: int
    nbytes: int
    collective: str
    seq: int
    algorithm: str
    send: dict
    recv: dict
    send_range: tuple | None = None
    """``(buffer, lo, hi)`` the sender sent, when its events carry ranges (:data:`RANGE_KEYS`)."""
    recv_range: tuple | None = None
    """``(buffer, lo, hi)`` the receiver received into, likewise."""

    @property
    def key(self) -> tuple:
        """``(collective, seq)``: the call the message belongs to."""
        return self.collective, self.seq


def _program_order(events):
    return sorted(events, key=lambda e: (e["seq"], e["collective"], e["rank"], e["step"]))


def messages(source, *, strict: bool = False) -> list[Message]:
    """Every send of ``source`` matched with its receive, in the order the sends were posted.

    Messages match as transports match them: within one call (``collective``,
    ``seq``), the i-th send from ``a`` to ``b`` is the i-th receive at ``b``
    from ``a``. A send or receive whose partner is not in the events (a
    filtered trace, a failed run) is left out, or with ``strict`` raises.

    Raises:
        InvalidArgument: ``strict`` and some send or receive has no partner.
    """
    ordered = _program_order(events_of(source))
    pending = defaultdict(deque)
    for e in ordered:
        ranges = e.get("send_ranges")
        for i, (peer, nbytes) in enumerate(e["sends"]):
            pending[(e["collective"], e["seq"], e["rank"], peer)].append((e, nbytes, _range(ranges, i)))
    out = []
    lonely = []
    for e in ordered:
        ranges = e.get("recv_ranges")
        for i, (peer, nbytes) in enumerate(e["recvs"]):
            queue = pending.get((e["collective"], e["seq"], peer, e["rank"]))
            if not queue:
                lonely.append(f"rank {e['rank']} step {e['step']} receives {nbytes} B from rank {peer}")
                continue
            send, sent, sent_range = queue.popleft()
            out.append(Message(peer, e["rank"], sent, e["collective"], e["seq"], e["algorithm"], send, e,
                               sent_range, _range(ranges, i)))
    if strict:
        lonely += [f"rank {src} step {s['step']} sends {b} B to rank {dst}"
                   for (_, _, src, dst), queue in pending.items() for s, b, _ in queue]
        if lonely:
            raise InvalidArgument(f"{len(lonely)} unmatched message end(s), e.g. {lonely[0]}.")
    out.sort(key=lambda m: (m.seq, m.send["start"], m.src, m.send["step"]))
    return out


def _range(ranges, i):
    """The i-th of an event's ranges as a tuple, or None when the event carries none."""
    return tuple(ranges[i]) if ranges is not None and i < len(ranges) else None
