"""Recording what collectives really did: per-rank step timelines, messages, and their export.

``with commkit.trace(comm) as t:`` records every step of every collective run
while the block is active. One event per step, the same format the simulator
emits (:func:`commkit.sim.simulate` with ``events=True``), so every picture and
export below works on a real run and on the model alike::

    {"rank": 1, "collective": "allreduce", "seq": 0, "algorithm": "ring",
     "step": 0, "kind": "exchange", "sends": [[2, 24]], "recvs": [[0, 32]],
     "bytes": 56, "start": 2240.9142, "end": 2240.9143,
     "send_ranges": [["out", 3, 6]], "recv_ranges": [["tmp", 0, 4]]}

``seq`` numbers the calls of one communicator; ``step`` is the index in the
schedule; ``kind`` is ``send``/``recv``/``exchange``/``transfer`` (messages),
``reduce``/``copy`` (local work) or ``native`` (the library's own collective,
one event per call); ``sends``/``recvs`` list ``[peer, bytes]``; ``bytes`` is
what the step moved or reduced; ``start``/``end`` are ``time.perf_counter()``
seconds (model seconds from the simulator). Ranks are the communicator's own.

Which data each step touches (block identity): ``send_ranges`` and
``recv_ranges`` run parallel to ``sends`` and ``recvs`` and give each message's
buffer range ``[buffer, lo, hi]`` in elements (``buffer`` is ``"in"``, ``"out"``
or ``"tmp"``, as in :mod:`commkit.schedule`); a reduce or copy event also has
``range`` (the range it writes) and ``src_range`` (the range it reads: a
reduce's operand, a copy's source). These keys are not in :data:`EVENT_KEYS`:
traces saved before they existed still load, and the pictures fall back to
colouring by sender without them.

Where the records end up. The executor appends to the innermost active
tracer, so the design is about getting every rank's events to one place:

* MPI (and NCCL): one tracer per process. With ``trace(comm)`` the events are
  gathered to ``root`` when the block ends (a collective call, like the block
  itself); other ranks keep their own. ``perf_counter`` is one clock per
  machine, so ranks on one host need no correction; when ranks span several
  hosts, each rank's times are shifted to rank ``root``'s clock by the moment
  they all left a common synchronisation point (accurate to about one message
  latency).
* threads (:func:`commkit.run_local`): all ranks share one process. Wrap the
  ``run_local`` call in ``with commkit.trace():``, or write the same code as
  under MPI -- every rank's ``with commkit.trace(comm):`` joins one shared
  recorder, and ``root`` gets everyone's events when the block ends.

Messages are matched as the transports match them: the i-th send from ``a`` to
``b`` in one call is the i-th receive at ``b`` from ``a`` in that call
(:func:`messages`).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass

from . import _events
from ._events import Message, Recorder, current, events_of, messages
from ._states import buffer_states
from ._units import format_seconds
from .errors import InvalidArgument

__all__ = [
    "EVENT_KEYS", "RANGE_KEYS", "Call", "Message", "Tracer", "buffer_states", "calls", "current", "events_of", "load",
    "messages", "save", "select", "summary", "to_chrome", "trace",
]

# The event format, the recorder and reading events back are commkit._events's (so that commkit.plot
# needs no tracer), and buffer_states is commkit._states's (it runs collectives): this module is their
# public face.

EVENT_KEYS = _events.EVENT_KEYS
"""The fields of every event, real or simulated."""

RANGE_KEYS = _events.RANGE_KEYS
"""The buffer ranges of a step (block identity): ``send_ranges``/``recv_ranges`` on every event,
``range``/``src_range`` on reduce and copy events. Absent from traces saved before they existed."""

MESSAGE_KINDS = _events.MESSAGE_KINDS  # the kinds of event that move messages

_FORMAT = "commkit-trace"

_lock = threading.Lock()
_shared: dict = {}  # threads world id -> [events list, tracers inside]; see Tracer.__enter__


class Tracer(Recorder):
    """Collects step events while active; see the module docstring for their fields.

    Build it with :func:`trace`. After the ``with`` block, :attr:`events` holds
    the events (on ``root``: every rank's), and the methods below summarise,
    export and draw them. While it is active, the executor hands it each step
    it runs (``record``) and each call the library runs whole (``record_native``).

    Attributes:
        comm: the communicator whose ranks' events are gathered (None: this process only).
        root: the rank that receives everyone's events.
        events: the list of event dicts.
        hosts: the host name of each rank, when the events were gathered from several processes.
    """

    def __init__(self, comm=None, *, root: int = 0):
        if comm is not None:
            comm = _communicator(comm)
            if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < comm.size:
                raise InvalidArgument(f"root must be a rank of comm (0 <= root < {comm.size}), got {root!r}.")
        super().__init__()
        self.comm = comm
        self.root = root
        self.hosts: list[str] | None = None
        self._world = None

    # -- the with block (recording is Recorder's: the executor calls record and record_native) -----

    def __enter__(self) -> Tracer:
        world = _threads_world(self.comm)
        if world is not None:
            with _lock:
                # Every rank thread of one threads world records into one list, whichever tracer
                # happens to be innermost when a step ends; a call keeps the tracer it found when it
                # started, so a rank's steps may land on another rank's tracer after that rank left
                # its block: the sink stays the shared list even once `events` holds its own result.
                entry = _shared.setdefault(id(world), [[], 0])
                entry[1] += 1
                self.events = self._sink = entry[0]
                self._world = id(world)
        return super().__enter__()

    def __exit__(self, exc_type, exc, tb) -> None:
        super().__exit__(exc_type, exc, tb)
        if self._world is not None:
            self._exit_threads(exc_type is None)
        elif self.comm is not None and exc_type is None and self.comm.size > 1:
            self._gather()

    def _exit_threads(self, ok: bool) -> None:
        comm = self.comm
        if ok:
            # Once root has heard from every rank, every rank's collectives in the block are done.
            comm.gather_object(None, root=self.root)
        with _lock:
            entry = _shared[self._world]
            entry[1] -= 1
            if entry[1] == 0:
                del _shared[self._world]
            shared = list(entry[0])
        self._world = None
        if ok and comm.rank == self.root:
            self.events = _ordered(shared)
        else:
            self.events = _ordered(e for e in shared if e["rank"] == comm.rank)

    def _gather(self) -> None:
        comm = self.comm
        hosts = comm.allgather_object(socket.gethostname())
        synced = time.perf_counter()  # every rank leaves the allgather at about the same moment
        gathered = comm.gather_object((synced, self.events), root=self.root)
        self.hosts = hosts
        if gathered is None:
            return
        ref = gathered[self.root][0]
        merged = []
        for rank_synced, events in gathered:
            # perf_counter is one clock per machine; only ranks on several hosts need a shift.
            shift = ref - rank_synced if len(set(hosts)) > 1 else 0.0
            for e in events:
                if shift:
                    e = dict(e, start=e["start"] + shift, end=e["end"] + shift)
                merged.append(e)
        self.events = _ordered(merged)

    # -- views of the events ----------------------------------------------------------------------

    def ranks(self) -> list[int]:
        """The ranks that have events, sorted."""
        return sorted({e["rank"] for e in self.events})

    def calls(self) -> list[Call]:
        """The collective calls recorded; see :func:`calls`."""
        return calls(self.events)

    def messages(self, strict: bool = False) -> list[Message]:
        """Every send matched with its receive; see :func:`messages`."""
        return messages(self.events, strict=strict)

    def summary(self) -> str:
        """A text table of the calls; see :func:`summary`."""
        return summary(self.events)

    def to_chrome(self, path=None) -> dict:
        """The Chrome/Perfetto trace; see :func:`to_chrome`."""
        return to_chrome(self.events, path)

    def save(self, path) -> None:
        """Write the events as JSON; read them back with :func:`load`."""
        save(self.events, path)

    def timeline(self, **kwargs):
        """:func:`commkit.plot.timeline` of these events (needs matplotlib)."""
        from . import plot  # (at first use: drawing is not what a traced run is for)
        return plot.timeline(self.events, **kwargs)

    def diagram(self, **kwargs):
        """:func:`commkit.plot.diagram` of these events (needs matplotlib)."""
        from . import plot
        return plot.diagram(self.events, **kwargs)

    def __len__(self) -> int:
        return len(self.events)

    def __repr__(self) -> str:
        return f"<commkit.Tracer: {len(self.events)} events, {len(self.calls())} calls>"


def trace(comm=None, *, root: int = 0) -> Tracer:
    """Record every collective step run inside the ``with`` block.

    Args:
        comm: gather every rank's events of this communicator to ``root`` when
            the block ends (every rank must then run the block). A wrapped mpi4py
            communicator (:func:`commkit.compat.mpi4py.wrap`) or a
            :mod:`commkit.distributed` group works too. Leave it out to record
            only this process -- in a threads world, wrapping ``run_local`` in the
            block records every rank.
        root: the rank that receives every rank's events.

    Returns:
        a :class:`Tracer`; use it as a context manager.

    Raises:
        InvalidArgument: ``comm`` is not a communicator or ``root`` not one of its ranks.
    """
    return Tracer(comm, root=root)


# What the tracer uses of a communicator. It recognises one by these rather than by its class:
# commkit.communicator imports this module (every call asks current()), so this one cannot import it.
_COMMUNICATOR_API = ("rank", "size", "transport_name", "collective_transport", "gather_object", "allgather_object")


def _is_communicator(obj) -> bool:
    return obj is not None and all(hasattr(obj, name) for name in _COMMUNICATOR_API)


def _communicator(comm):
    """``comm``, or the commkit Communicator a compatibility face holds as ``.comm`` (mpi4py ``Comm``, ``Group``)."""
    if _is_communicator(comm):
        return comm
    inner = getattr(comm, "comm", None)
    if _is_communicator(inner):
        return inner
    raise InvalidArgument(
        f"comm must be a commkit Communicator (or an object holding one as .comm, such as a wrapped mpi4py "
        f"communicator), got {type(comm).__name__}."
    )


def _threads_world(comm):
    """The world shared by the rank threads of a threads communicator, or None (other transports, one rank)."""
    if comm is None or comm.transport_name != "local" or comm.size == 1:
        return None
    # Every context of a threads world (dup, split) lives in the one world of its rank threads.
    return comm.collective_transport.world


def _ordered(events) -> list:
    return sorted(events, key=lambda e: (e["start"], e["rank"], e["seq"], e["step"]))


# -- working with events, real or simulated ------------------------------------------------------


def select(source, *, collective: str | None = None, seq: int | None = None, algorithm: str | None = None,
           ranks=None, kinds=None) -> list[dict]:
    """The events of ``source`` that match every filter given (for example one call: ``collective`` and ``seq``)."""
    events = events_of(source)
    ranks = None if ranks is None else set(ranks)
    kinds = None if kinds is None else set(kinds)
    return [
        e for e in events
        if (collective is None or e["collective"] == collective) and (seq is None or e["seq"] == seq)
        and (algorithm is None or e["algorithm"] == algorithm) and (ranks is None or e["rank"] in ranks)
        and (kinds is None or e["kind"] in kinds)
    ]


@dataclass(frozen=True)
class Call:
    """One collective call in a trace, over all its ranks."""

    collective: str
    seq: int
    algorithm: str
    ranks: tuple
    start: float
    end: float
    steps: int
    messages: int
    bytes_sent: int

    @property
    def name(self) -> str:
        """``collective_algorithm``, the greppable name."""
        return f"{self.collective}_{self.algorithm}"

    @property
    def duration(self) -> float:
        return self.end - self.start


def calls(source) -> list[Call]:
    """The collective calls in ``source``, in the order they started."""
    groups: dict = {}
    for e in events_of(source):
        groups.setdefault((e["collective"], e["seq"], e["algorithm"]), []).append(e)
    out = []
    for (collective, seq, algorithm), group in groups.items():
        out.append(Call(
            collective, seq, algorithm, tuple(sorted({e["rank"] for e in group})),
            min(e["start"] for e in group), max(e["end"] for e in group), len(group),
            sum(len(e["sends"]) for e in group), sum(b for e in group for _, b in e["sends"]),
        ))
    out.sort(key=lambda c: (c.start, c.seq))
    return out


def summary(source) -> str:
    """A text table: one line per call with its ranks, time, steps, messages and bytes sent."""
    found = calls(source)
    if not found:
        return "no collective steps recorded"
    rows = [("call", "seq", "ranks", "time", "steps", "messages", "bytes sent")]
    for c in found:
        rows.append((c.name, str(c.seq), str(len(c.ranks)), format_seconds(c.duration), str(c.steps),
                     str(c.messages), str(c.bytes_sent)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


# -- export --------------------------------------------------------------------------------------


def _step_name(e) -> str:
    parts = [f"->{peer}" for peer, _ in e["sends"]] + [f"<-{peer}" for peer, _ in e["recvs"]]
    return f"{e['kind']} {' '.join(parts)}" if parts else e["kind"]


def to_chrome(source, path=None) -> dict:
    """The events as a Chrome trace (open it in https://ui.perfetto.dev or chrome://tracing).

    One track per rank (``pid`` = rank): a slice per collective call with a
    slice per step nested in it, and a flow arrow from each send step to its
    matching receive step (:func:`messages`). Times are microseconds from the
    first event.

    Args:
        source: a :class:`Tracer`, a simulator result or a list of events.
        path: also write the JSON there.

    Returns:
        the trace as a dict (``{"traceEvents": [...], ...}``).
    """
    events = events_of(source)
    origin = min((e["start"] for e in events), default=0.0)

    def us(t):
        return (t - origin) * 1e6

    out = []
    for rank in sorted({e["rank"] for e in events}):
        out.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        out.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": 0, "args": {"name": "collectives"}})
    per_call: dict = {}
    for e in events:
        per_call.setdefault((e["rank"], e["collective"], e["seq"], e["algorithm"]), []).append(e)
    for (rank, collective, seq, algorithm), group in per_call.items():
        start, end = min(e["start"] for e in group), max(e["end"] for e in group)
        out.append({"ph": "X", "name": f"{collective}_{algorithm} #{seq}", "cat": "collective", "pid": rank, "tid": 0,
                    "ts": us(start), "dur": us(end) - us(start),
                    "args": {"collective": collective, "algorithm": algorithm, "seq": seq, "steps": len(group)}})
    for e in events:
        out.append({"ph": "X", "name": _step_name(e), "cat": e["kind"], "pid": e["rank"], "tid": 0,
                    "ts": us(e["start"]), "dur": us(e["end"]) - us(e["start"]),
                    "args": {k: e[k] for k in ("collective", "seq", "algorithm", "step", "kind", "sends", "recvs",
                                               "bytes", *RANGE_KEYS) if k in e}})
    for i, m in enumerate(messages(events)):
        # Each end is placed inside its step's slice so the flow binds to that step.
        common = {"name": "message", "cat": "message", "id": i, "tid": 0}
        out.append(dict(common, ph="s", pid=m.src, ts=us((m.send["start"] + m.send["end"]) / 2),
                        args={"bytes": m.nbytes, "to": m.dst}))
        out.append(dict(common, ph="f", bp="e", pid=m.dst, ts=us((m.recv["start"] + m.recv["end"]) / 2),
                        args={"bytes": m.nbytes, "from": m.src}))
    doc = {"traceEvents": out, "displayTimeUnit": "ns",
           "otherData": {"producer": "commkit", "events": len(events)}}
    if path is not None:
        with open(path, "w") as f:
            json.dump(doc, f)
    return doc


def save(source, path) -> None:
    """Write the events of ``source`` as JSON (``{"format": "commkit-trace", "version": 1, "events": [...]}``)."""
    events = events_of(source)
    with open(path, "w") as f:
        json.dump({"format": _FORMAT, "version": 1, "events": events}, f)


def load(path) -> list[dict]:
    """Read events written by :func:`save` (or :meth:`Tracer.save`).

    Raises:
        InvalidArgument: the file is not a commkit trace.
    """
    try:
        with open(path) as f:
            doc = json.load(f)
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}).") from None
    if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
        raise InvalidArgument(f"{path}: not a commkit trace (expected a JSON object with format {_FORMAT!r}).")
    return events_of(doc["events"])
