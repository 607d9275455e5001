"""Schedules: the step vocabulary algorithms speak, and the executor that runs them.

Why schedules. A collective algorithm is data-oblivious: who sends which block
to whom depends only on (rank, size, count, root), never on the values. So an
algorithm is a generator that yields steps over index ranges of named, flat
buffers and knows nothing of MPI, NCCL or threads. The same text then runs on
every transport (the executor below), step by step for nonblocking calls
(:class:`ScheduleRequest`), with no data at all in the simulator
(:mod:`commkit.sim`), and under the tracer (:mod:`commkit.tracing`).

One interpreter runs them: :func:`execute`, a generator that carries out the
steps and pauses whenever the run must wait for a posted transfer. A blocking
call drives it to the end (:func:`run_schedule`), a nonblocking one resumes it
from ``test()`` and ``wait()`` (:class:`ScheduleRequest`), and a traced run is
either with a tracer attached. A repeated call of a known shape skips the
interpreter: it runs a compiled plan (:mod:`commkit.plan`), the same steps
written out as one function.

The vocabulary is three steps:

* :class:`Transfer` -- post every send and receive it lists, then wait for
  all of them (``Send``, ``Recv`` and ``Exchange`` are its common shapes);
* :class:`Reduce` -- ``into = into (op) operand`` (or ``operand (op) into``
  when the operand holds lower ranks' contributions);
* :class:`Copy` -- a local copy between buffer ranges.

Node schedules (:mod:`commkit.algorithms.node`) speak five one-sided steps
beside them, over the node's shared arena (:mod:`commkit.transports._arena`):
:class:`Put` (into this rank's slot), :class:`Get` (out of any rank's slot),
:class:`ReduceSlots` (fold the same range of several ranks' slots),
:class:`Publish` and :class:`Wait` (a rank's monotonic counter, and waiting for
peers' counters), bracketed by :class:`Claim` and :class:`Release`, which take
the arena for one call and give it back. See docs/node.md.

A buffer range is a tuple ``(name, lo, hi)`` of element indices into the flat
view of a named buffer. Names used by the collectives: ``"in"`` (the caller's
input, never written), ``"out"`` (the result), ``"tmp"`` (scratch the
algorithm asked for in its ``scratch`` declaration).
"""

from __future__ import annotations

import bisect

import functools
import time
from typing import Any, Callable, Iterator

import numpy as np

from .errors import (AlgorithmNotApplicable, CollectiveMismatch, CommTimeout, InvalidArgument, InvalidBuffer,
                     MessageTruncated)
from .requests import Request
from ._wait import Backoff
from .watchdog import STATE, STEP, STEP_OBJ, T_END, FlightRecorder, blank_record

__all__ = [
    "Transfer",
    "Send",
    "Recv",
    "Exchange",
    "Reduce",
    "Copy",
    "Put",
    "Get",
    "ReduceSlots",
    "Publish",
    "Wait",
    "Claim",
    "Release",
    "slot",
    "peer",
    "counter_value",
    "check_overlap",
    "overlaps_safely",
    "partition",
    "partition_sizes",
    "execute",
    "run_schedule",
    "ScheduleRun",
    "ScheduleRequest",
    "CompletedRequest",
    "CallInfo",
    "check_in",
    "check_in_saying",
]

TRANSFER, REDUCE, COPY = 0, 1, 2
PUT, GET, REDUCE_SLOTS, PUBLISH, WAIT, CLAIM, RELEASE = 3, 4, 5, 6, 7, 8, 9
ONE_SIDED = frozenset((PUT, GET, REDUCE_SLOTS, PUBLISH, WAIT, CLAIM, RELEASE))


def has_one_sided(steps) -> bool:
    """Whether a schedule's ``steps`` use the node arena (a node algorithm's, docs/node.md)."""
    return any(step.kind in ONE_SIDED for step in steps)
"""The kinds of the steps that work on the node arena (every kind above COPY)."""


class Transfer:
    """Post all ``sends`` and ``recvs`` at once, then wait until every one completes.

    ``sends`` and ``recvs`` are tuples of ``(peer, (name, lo, hi))``. Messages
    between one pair of ranks are matched in the order they are posted.

    ``overlap`` holds local steps (:class:`Reduce`, :class:`Copy`) to run while
    the transfer is in flight: after it is posted, before it is waited for. This
    is how a schedule keeps the link and the core busy at once -- a root copies
    its input while sending it, a pipelined ring reduces segment k while segment
    k+1 travels. The overlapped steps must not touch the ranges this transfer
    moves (:func:`check_overlap` says whether they do).
    """

    __slots__ = ("sends", "recvs", "overlap")
    kind = TRANSFER

    def __init__(self, sends=(), recvs=(), overlap=()):
        self.sends = tuple(sends)
        self.recvs = tuple(recvs)
        self.overlap = tuple(overlap)

    def __repr__(self) -> str:
        parts = [f"send {b} to {p}" for p, b in self.sends] + [f"recv {b} from {p}" for p, b in self.recvs]
        if self.overlap:
            parts.append("while " + ", ".join(map(repr, self.overlap)))
        return f"{type(self).__name__}({'; '.join(parts)})"


class Send(Transfer):
    """Send one buffer range to ``to``."""

    __slots__ = ()

    def __init__(self, to: int, buf: tuple, overlap=()):
        self.sends = ((to, buf),)
        self.recvs = ()
        self.overlap = tuple(overlap)


class Recv(Transfer):
    """Receive one buffer range from ``frm``."""

    __slots__ = ()

    def __init__(self, frm: int, buf: tuple, overlap=()):
        self.sends = ()
        self.recvs = ((frm, buf),)
        self.overlap = tuple(overlap)


class Exchange(Transfer):
    """Send to ``send_to`` and receive from ``recv_from`` at the same time (MPI_Sendrecv)."""

    __slots__ = ("pair",)

    def __init__(self, send_to: int, send: tuple, recv_from: int, recv: tuple, overlap=()):
        self.sends = ((send_to, send),)
        self.recvs = ((recv_from, recv),)
        self.overlap = tuple(overlap)
        # Flattened once here so the executor's hot loop does no unpacking of nested tuples.
        self.pair = (send_to, *send, recv_from, *recv)


def _ranges_meet(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and a[1] < b[2] and b[1] < a[2] and a[2] > a[1] and b[2] > b[1]


def check_overlap(step: Transfer) -> list:
    """The conflicts between a transfer and its overlapped local steps (empty when it is safe).

    A local step may not write a range the transfer sends or receives, nor read
    a range it receives into: both would race with the data on the wire.
    """
    return [f"{local!r} writes {mine} while the transfer moves {theirs}" if writes else
            f"{local!r} reads {mine} while the transfer receives into {theirs}"
            for local, writes, mine, theirs in _races(step)]


def overlaps_safely(step: Transfer) -> bool:
    """Whether no overlapped local step of ``step`` races with it (:func:`check_overlap` says how one does).

    What a schedule generator asks of each step it makes: it stops at the first
    race and describes none (a pipelined ring asks it of every segment).
    """
    return not _races(step, first=True)


def _races(step: Transfer, first: bool = False) -> list:
    """``(local step, writes, its range, the transfer's range)`` for each race; with ``first``, the first one only.

    A list built by plain loops, not a generator: a pipelined ring's schedule asks
    this of every segment (millions of times in the simulator's tests at 24 ranks).
    """
    found = []
    landing = step.recvs
    moved = step.sends + landing
    for local in step.overlap:
        if local.kind == REDUCE:
            writes, reads = (local.into,), (local.operand, local.src)
        else:
            writes, reads = (local.dst,), (local.src,)
        for w in writes:
            for _, t in moved:
                if _ranges_meet(w, t):
                    found.append((local, True, w, t))
                    if first:
                        return found
        for r in reads:
            for _, t in landing:
                if _ranges_meet(r, t):
                    found.append((local, False, r, t))
                    if first:
                        return found
    return found


def writes_input(steps):
    """``(index, step)`` of the first step that writes the caller's input ``"in"``, or None.

    A schedule reads ``"in"`` and writes ``"out"`` and ``"tmp"``: the caller's
    input is never modified (an in-place call passes one array as both, and the
    communicator saves the input where the schedule needs it). A step that
    receives into, reduces into or copies onto ``"in"`` -- the commonest slip is
    a ``Copy`` with its two ranges swapped -- would overwrite the caller's data.
    """
    for index, step in enumerate(steps):
        kind = getattr(step, "kind", None)
        if kind == TRANSFER:
            targets = [b for _, b in step.recvs] + [getattr(local, "into", getattr(local, "dst", None))
                                                    for local in step.overlap]
        elif kind == REDUCE:
            targets = [step.into]
        else:  # Copy and the one-sided steps name what they write as dst (NO_RANGE where nothing)
            targets = [getattr(step, "dst", None)]
        if any(t is not None and t[0] == "in" and t[2] > t[1] for t in targets):
            return index, step
    return None


def inplace_safe(steps) -> bool:
    """Whether this rank's ``steps`` compute the same result when ``in`` and ``out`` are one array.

    An in-place call (``out=x``) gives the schedule one array as both ``in`` and
    ``out``; the communicator saves the input first unless this says that is
    not needed. It follows the data: a step may read a range of ``in`` only
    while no earlier step (and no step running at the same time: a transfer's
    sends and receives and its overlapped local steps) has written new values
    into that range of ``out``. A copy of ``in`` onto the same range of ``out``
    writes nothing new (in place it is skipped), and a reduction may read and
    write exactly the same range (element by element). Conservative: any other
    overlap, or a write to ``in``, counts as unsafe.
    """
    starts: list = []  # ranges of out that hold new values: sorted, disjoint, merged (starts[i], ends[i])
    ends: list = []

    def meets(ref, ranges):
        return any(ref[1] < hi and lo < ref[2] for lo, hi in ranges)

    def meets_written(ref):
        i = bisect.bisect_right(starts, ref[1]) - 1  # the last range starting at or before ref's start
        if i >= 0 and ends[i] > ref[1]:
            return True
        return i + 1 < len(starts) and starts[i + 1] < ref[2]

    def write(lo, hi):
        i = bisect.bisect_left(ends, lo)  # the first range that ends at or after lo: it may merge
        j = bisect.bisect_right(starts, hi)  # ranges i .. j-1 touch [lo, hi)
        if i < j:
            lo, hi = min(lo, starts[i]), max(hi, ends[j - 1])
        starts[i:j], ends[i:j] = [lo], [hi]

    def effects(step):
        """(reads of in, writes of out/in, exempt (read, write) pairs) of a local step."""
        if step.kind == REDUCE:
            reads = [r for r in (step.src, step.operand) if r[0] == "in" and r[2] > r[1]]
            write = step.into
            exempt = [r for r in reads if r[1:] == write[1:]]  # elementwise on the same elements
            return reads, ([write] if write[0] in ("in", "out") and write[2] > write[1] else []), exempt
        if step.kind == REDUCE_SLOTS:
            reads = [r for r in step.operands if r[0] == "in" and r[2] > r[1]]
            write = step.dst
            exempt = [r for r in reads if r[1:] == write[1:]]  # elementwise on the same elements
            return reads, ([write] if write[0] in ("in", "out") and write[2] > write[1] else []), exempt
        src, dst = step.src, step.dst
        if src[0] == "in" and dst[0] == "out" and src[1:] == dst[1:]:
            return [src], [], []  # the identity copy: nothing new is written
        reads = [src] if src[0] == "in" and src[2] > src[1] else []
        return reads, ([dst] if dst[0] in ("in", "out") and dst[2] > dst[1] else []), []

    for step in steps:
        if step.kind == TRANSFER:
            group = [([b for _, b in step.sends if b[0] == "in" and b[2] > b[1]],
                      [b for _, b in step.recvs if b[0] in ("in", "out") and b[2] > b[1]], [])]
            group += [effects(local) for local in step.overlap]
        else:
            group = [effects(step)]
        now = [(g, w[1], w[2]) for g, (_, writes, _) in enumerate(group) for w in writes]
        for g, (reads, _, exempt) in enumerate(group):
            for r in reads:
                if meets_written(r):
                    return False
                # Writes at the same time: all of this group's but the one exempt write of this very step.
                if meets(r, [(lo, hi) for wg, lo, hi in now if not (wg == g and r in exempt and (lo, hi) == r[1:])]):
                    return False
        for _, lo, hi in now:
            write(lo, hi)
    return True


class Reduce:
    """``into = into (op) operand``; with ``operand_first``, ``into = operand (op) into``.

    Use ``operand_first=True`` when ``operand`` holds the contributions of
    lower ranks than ``into`` does, so non-commutative ops keep rank order.
    With ``src``, the left-hand value is read from ``src`` instead of ``into``
    (``into = src (op) operand``): a three-address reduce that lets an algorithm
    combine its input with a received block straight into the output, without
    first copying the whole input there.
    """

    __slots__ = ("into", "operand", "op", "operand_first", "src")
    kind = REDUCE

    def __init__(self, into: tuple, operand: tuple, op: Any, operand_first: bool = False, src: tuple | None = None):
        self.into = into
        self.operand = operand
        self.op = op
        self.operand_first = operand_first
        self.src = into if src is None else src

    def __repr__(self) -> str:
        order = f"{self.operand} (op) {self.src}" if self.operand_first else f"{self.src} (op) {self.operand}"
        return f"Reduce({self.into} = {order})"


class Copy:
    """Copy the range ``src`` into the range ``dst`` (same length)."""

    __slots__ = ("dst", "src")
    kind = COPY

    def __init__(self, dst: tuple, src: tuple):
        self.dst = dst
        self.src = src

    def __repr__(self) -> str:
        return f"Copy({self.dst} <- {self.src})"


# -- one-sided steps: the node arena ------------------------------------------------------------------
#
# A node schedule runs on ranks that share memory. Each rank owns a slot of the node's arena and a
# counter; it copies into its own slot (Put), tells its peers (Publish), and they, having waited for
# that (Wait), read the slot where it lies (Get, ReduceSlots). A slot is named like a buffer,
# ``slot(q, lo, hi) == ("slot<q>", lo, hi)``, its range in elements of the call's type, so every
# step still names the ranges it reads (``src``) and writes (``dst``), as a Copy does.
# When the call's arrays are themselves shared (``Communicator.shared_empty``), a schedule reads a
# peer's buffer where it lies, ``peer(q, "in", lo, hi) == ("in@<q>", lo, hi)``, with no slot between.

FINAL = (1 << 32) - 1
"""The counter step a rank publishes when it is done with the arena for its call (:class:`Release`)."""
NO_RANGE = ("tmp", 0, 0)
"""The range of a step that moves no data (Publish, Wait, Claim, Release)."""

_SLOT_NAMES: list = []


def slot(rank: int, lo: int, hi: int) -> tuple:
    """The range ``[lo, hi)`` (elements) of ``rank``'s slot in the node arena, as a buffer range."""
    while len(_SLOT_NAMES) <= rank:
        _SLOT_NAMES.append(f"slot{len(_SLOT_NAMES)}")
    return (_SLOT_NAMES[rank], lo, hi)


def peer(rank: int, name: str, lo: int, hi: int) -> tuple:
    """The range ``[lo, hi)`` of ``rank``'s own buffer ``name`` ("in" or "out"), read where it lies.

    Only for calls whose arrays every rank allocated as shared arrays (the zero-copy
    forms of the node algorithms); the peer must have published it, and this rank
    waited for that (:class:`Wait`), as for a slot.
    """
    return (f"{name}@{rank}", lo, hi)


def slot_rank(ref: tuple) -> int | None:
    """The rank whose memory the range ``ref`` names (a slot, or a peer's shared buffer), or None for this rank's."""
    name = ref[0]
    if name.startswith("slot"):
        return int(name[4:])
    at = name.find("@")
    return int(name[at + 1:]) if at >= 0 else None


def counter_value(seq: int, k: int) -> int:
    """What a rank's counter holds after its call number ``seq`` published step ``k`` (monotonic in both)."""
    return (seq << 32) | k


class Put:
    """Copy ``src`` (a range of this rank's buffers) into ``dst``, a range of this rank's own slot.

    Peers may read it only after this rank's next :class:`Publish`.
    """

    __slots__ = ("dst", "src")
    kind = PUT

    def __init__(self, dst: tuple, src: tuple):
        self.dst = dst
        self.src = src

    def __repr__(self) -> str:
        return f"Put({self.dst} <- {self.src})"


class Get:
    """Copy ``src``, a range of any rank's slot, into ``dst`` (a range of this rank's buffers).

    The slot's owner must have published it, and this rank waited for that (:class:`Wait`).
    """

    __slots__ = ("dst", "src")
    kind = GET

    def __init__(self, dst: tuple, src: tuple):
        self.dst = dst
        self.src = src

    def __repr__(self) -> str:
        return f"Get({self.dst} <- {self.src})"


class ReduceSlots:
    """``dst = operands[0] (op) operands[1] (op) ...``: the same range of several ranks' slots, folded in order.

    ``dst`` is a range of this rank's buffers; ``operands`` are slot ranges of one
    length, listed in the order they combine (rank order keeps non-commutative ops
    right, and makes every rank that folds the same slots get the same bits).
    """

    __slots__ = ("dst", "operands", "op")
    kind = REDUCE_SLOTS

    def __init__(self, dst: tuple, operands, op: Any):
        self.dst = dst
        self.operands = tuple(operands)
        self.op = op

    @property
    def src(self) -> tuple:
        return self.operands[0]

    def __repr__(self) -> str:
        return f"ReduceSlots({self.dst} = {' (op) '.join(map(str, self.operands))})"


class Publish:
    """Fence, then set this rank's counter to (this call, ``k``): every store before it is visible to peers."""

    __slots__ = ("k",)
    kind = PUBLISH
    dst = src = NO_RANGE

    def __init__(self, k: int):
        self.k = k

    def __repr__(self) -> str:
        return f"Publish({self.k})"


class Wait:
    """Wait until every rank in ``peers`` has published (this call, ``k``) or later; then fence.

    Like a receive, it names the ranks it waits for (``recvs``), which a timeout
    error and the watchdog report.
    """

    __slots__ = ("peers", "k")
    kind = WAIT
    dst = src = NO_RANGE
    sends = ()

    def __init__(self, peers, k: int):
        self.peers = tuple(peers)
        self.k = k

    @property
    def recvs(self) -> tuple:
        return tuple((peer, NO_RANGE) for peer in self.peers)

    def __repr__(self) -> str:
        return f"Wait(ranks {list(self.peers)} reach {self.k})"


class Claim:
    """Take the node arena for this call; its slots must hold ``elements`` elements of the call's type.

    Waits until this rank's earlier node calls have released it (nonblocking
    ones may be in flight), and then until every rank of the node has released
    it from the previous node call, so no peer still reads a slot this call
    overwrites. Then records the call's identity, which every :class:`Wait`
    checks. The first node call on a communicator makes the arena, every rank at
    that call. With ``shared``, the call's ``in`` and ``out`` are shared arrays,
    read by peers where they lie (:func:`peer`): the claim records where, and
    every wait checks its peers' arrays are shared too.
    """

    __slots__ = ("elements", "size", "shared")
    kind = CLAIM
    dst = src = NO_RANGE
    sends = ()

    def __init__(self, elements: int, size: int, shared: bool = False):
        self.elements = elements
        self.size = size
        self.shared = shared

    @property
    def recvs(self) -> tuple:
        return tuple((peer, NO_RANGE) for peer in range(self.size))

    def __repr__(self) -> str:
        return f"Claim({self.elements} elements per slot{', shared arrays' if self.shared else ''})"


class Release:
    """Publish (this call, :data:`FINAL`) and let this rank's next node call take the arena."""

    __slots__ = ()
    kind = RELEASE
    dst = src = NO_RANGE

    def __repr__(self) -> str:
        return "Release()"


@functools.lru_cache(maxsize=64)
def partition(count: int, parts: int) -> tuple[tuple[int, int], ...]:
    """Split ``range(count)`` into ``parts`` contiguous ``(lo, hi)`` blocks.

    The first ``count % parts`` blocks get one extra element, so blocks differ
    in length by at most one and empty blocks are allowed (count < parts).
    Cached: every rank of a simulated world asks for the same partition, which
    would otherwise cost O(p^2) time and memory at p = 4096.
    """
    base, extra = divmod(count, parts)
    blocks = []
    lo = 0
    for i in range(parts):
        hi = lo + base + (1 if i < extra else 0)
        blocks.append((lo, hi))
        lo = hi
    return tuple(blocks)


def partition_sizes(count: int, parts: int) -> tuple[int, int, int]:
    """The block lengths :func:`partition` gives, without listing the blocks: ``(long, short, n_long)``.

    ``partition(count, parts)`` has ``n_long`` blocks of ``long`` elements first, then
    ``parts - n_long`` of ``short`` (``long = short + 1``). Cost formulas use it to sum
    over millions of segments in constant time.
    """
    short, n_long = divmod(count, parts)
    return short + 1, short, n_long


class CallInfo:
    """What the executor knows about the call it runs, for timeouts and traces."""

    __slots__ = ("collective", "algorithm", "seq", "rank", "tracer")

    def __init__(self, collective: str, algorithm: str, seq: int, rank: int, tracer=None):
        self.collective = collective
        self.algorithm = algorithm
        self.seq = seq
        self.rank = rank
        self.tracer = tracer


def _do_local(step, bufs) -> None:
    if step.kind == REDUCE:
        name, lo, hi = step.into
        oname, olo, ohi = step.operand
        if hi > lo:
            sname, slo, shi = step.src
            step.op.combine(bufs[name][lo:hi], bufs[oname][olo:ohi], step.operand_first, bufs[sname][slo:shi])
    else:
        name, lo, hi = step.dst
        sname, slo, shi = step.src
        dst, src = bufs[name], bufs[sname]
        # In-place calls bind "in" and "out" to the same array: copying a range onto
        # itself is skipped (the communicator guarantees no other aliasing).
        if hi > lo and not (dst is src and lo == slo):
            dst[lo:hi] = src[slo:shi]


def _info(info) -> CallInfo:
    return info if isinstance(info, CallInfo) else CallInfo(*info)


def _call_text(info, index: int, step) -> str:
    info = _info(info)
    return (f"rank {info.rank} in {info.collective} #{info.seq} (algorithm {info.algorithm!r}) "
            f"at step {index} ({step!r})")


def _gave_up(info, timeout, where: str, recent: str) -> CommTimeout:
    """A collective's timeout error: who gave up, after how long, in which call, ``where`` in it, and why."""
    text = (
        f"rank {info.rank} timed out after {timeout:g} s in {info.collective} #{info.seq} "
        f"(algorithm {info.algorithm!r}){where} A peer may have stopped, called a different collective (or the "
        "same one with another root, count, dtype or op), or be much slower; COMMKIT_DEBUG=check reports "
        "mismatched collectives."
    )
    if recent:
        text += f" Recent calls on this rank: {recent}."
    return CommTimeout(text)


def timeout_error(info, index: int, step, pending_peers, timeout, recent: str = "") -> CommTimeout:
    """The error of a collective step that waited ``timeout`` seconds: the rank, call, algorithm, step and peers.

    ``info`` is a :class:`CallInfo` or the tuple of its fields; ``pending_peers`` the ranks
    still outstanding; ``recent`` this rank's recent calls (the flight record), if known.
    """
    peers = ", ".join(str(p) for p in pending_peers) or "?"
    return _gave_up(_info(info), timeout, f" at step {index} ({step!r}), waiting for rank(s) {peers}.", recent)


def native_timeout_error(info, timeout, recent: str = "") -> CommTimeout:
    """The error of a library collective (``native``) that made no progress within ``timeout`` seconds.

    ``info`` is a :class:`CallInfo` or the tuple of its fields; ``recent`` this
    rank's recent calls (the flight record), if known.
    """
    return _gave_up(_info(info), timeout, ": the library's own collective made no progress.", recent)


def transfer_error(info, index: int, step, exc: BaseException) -> BaseException:
    """A transport's error inside a collective, re-raised naming the call, step and peer."""
    hint = ""
    if isinstance(exc, MessageTruncated):
        hint = (" The ranks disagree about this call's element count or dtype; "
                "COMMKIT_DEBUG=check names the ranks and values that differ.")
    err = type(exc)(f"{_call_text(info, index, step)}: {exc}{hint}")
    err.__dict__.update(exc.__dict__)
    return err


NODE_SPIN_SECONDS = 5e-3
"""How long a wait on the node arena spins before it sleeps (:class:`commkit._wait.Backoff`)."""


class _Until:
    """A wait on the node arena, as the drivers of :func:`execute` see a posted transfer: ``test``, ``wait``.

    ``ready()`` polls; ``blockers()`` names the ranks still short when a wait gives up.
    Polls spin, then back off (:class:`~commkit._wait.Backoff`); in the threads world
    each poll that found nothing lets the other rank threads run (``relax``).
    """

    __slots__ = ("ready", "blockers", "relax", "failed")

    def __init__(self, ready, blockers, relax, failed):
        self.ready = ready
        self.blockers = blockers
        self.relax = relax
        self.failed = failed

    def test(self) -> bool:
        if self.ready():
            return True
        self.failed()
        return False

    def wait(self, timeout: float | None) -> list:
        # Peers of a node call arrive as far apart as their copies and folds take (hundreds of
        # microseconds for megabytes), and a sleep overshoots by tens: spin for longer than a
        # message's wait does (MPI's own waits spin throughout); a rank sharing its core still
        # yields it at every poll (commkit._wait.share_cores).
        backoff = Backoff(timeout, spin=NODE_SPIN_SECONDS, first=1e-6)
        while not self.ready():
            self.failed()
            if not backoff.pause():
                return self.blockers()
            if self.relax is not None:
                self.relax()
        return []

    def peers_waiting(self) -> list:
        return self.blockers()


class _Reached:
    """A wait on the node arena that its peers had already satisfied when it was made: ``test()`` is True."""

    __slots__ = ()

    @staticmethod
    def test() -> bool:
        return True


_REACHED = _Reached()


def _fold(into, operands: list, op) -> None:
    """ReduceSlots: ``into`` = ``op`` over ``operands`` in their order (views of one range each)."""
    first, *rest = operands
    if not rest:
        into[...] = first
    # In place, the output may be one of the operands: folded into the output before its
    # turn, its values would be lost, so such a fold goes through a copy of the output.
    final = into
    if len(rest) > 1 and any(np.may_share_memory(into, operand) for operand in rest[1:]):
        into = np.empty_like(into)
    for i, operand in enumerate(rest):
        op.combine(into, operand, False, first if i == 0 else into)
    if into is not final:
        final[...] = into


def _turn(arena, ticket: int, relax) -> _Until:
    """A Claim's wait: this rank's turn (``ticket``), then every rank done with the previous node call."""
    counter, ranks = arena.counter, range(arena.size)

    def ready():
        if not arena.my_turn(ticket):
            return False
        last = arena.last
        return last < 0 or all(counter(q) >= counter_value(last, FINAL) for q in ranks)

    def blockers():
        if not arena.my_turn(ticket):
            return [arena.rank]  # its own earlier node call still holds the arena
        return [q for q in ranks if counter(q) < counter_value(arena.last, FINAL)]

    return _Until(ready, blockers, relax, arena.check_failed)


def _wait_for(arena, peers, value: int, relax):
    """A Wait's pending: every rank of ``peers`` has published ``value`` (:data:`_REACHED` if all have already)."""
    counter = arena.counter
    for q in peers:
        if counter(q) < value:
            break
    else:
        return _REACHED  # (often: the peers are there already, and nothing is made to wait with)
    return _Until(lambda: all(counter(q) >= value for q in peers),
                  lambda: [q for q in peers if counter(q) < value], relax, arena.check_failed)


def _located(arena, bufs: dict, info, step) -> tuple:
    """A shared Claim's ``(in, out)``: where in the node's shared arrays the call's two arrays lie."""
    where = (arena.locate(bufs["in"]), arena.locate(bufs["out"]))
    if None in where:
        raise InvalidArgument(
            f"{_call_text(info, 0, step)}: this schedule reads the call's arrays where they lie, but "
            f"its {'in' if where[0] is None else 'out'} is not an array of shared_empty; allocate "
            "both with comm.shared_empty, or let the node algorithm copy them through its arena.")
    return where


def _check_peers(arena, info, step, tag: int, shared: bool, bufs: dict) -> None:
    """After a Wait: every peer it waited for is in this very call (``tag``), with shared arrays iff this rank is.

    With ``shared``, a peer's arrays are viewed into ``bufs`` (``"in@q"``,
    ``"out@q"``) where it recorded them, the first time a wait reaches it.
    """
    for q in step.peers:
        theirs = arena.identity(q)
        if theirs != tag:
            raise CollectiveMismatch(
                f"{_call_text(info, -1, step)}: rank {q} published on the node arena from another call "
                f"(identity {theirs:#x}, this call's {tag:#x}): the ranks called different collectives, "
                "or the same one with another count, dtype, op or root. COMMKIT_DEBUG=check names them.")
        if arena.shares(q) != shared:
            mine, its = ("", " not") if shared else (" not", "")
            raise CollectiveMismatch(
                f"{_call_text(info, -1, step)}: this rank's arrays are{mine} shared (comm.shared_empty) "
                f"and rank {q}'s are{its}: a node call reads peers' arrays where they lie only when every "
                "rank's are shared; pass shared arrays on every rank or on none.")
        if shared and "in@%d" % q not in bufs:
            bufs["in@%d" % q], bufs["out@%d" % q] = arena.peer_arrays(q, bufs["out"].dtype)


_CLAIMING, _COPYING, _FOLDING, _PUBLISHING, _WAITING, _LOCAL, _RELEASING = range(7)


class NodeProgram:
    """A node schedule written once as one Python function, for the calls that repeat its shape.

    At every call the interpreter (:func:`execute`) finds each range of each
    step by its buffer's name and tells each step's kind: about 25 us of a
    2-rank allreduce on shared arrays whose memory work takes 4. A program does
    that once, when it is made: each slot range viewed, each step written out
    as a line or two of one generated function (``print(program.source)``),
    as a compiled plan writes its transfers. A call then runs that function on
    its own arrays, and takes its turn, waits and checks its peers with the
    interpreter's own functions (:func:`_turn`, :func:`_wait_for`,
    :func:`_check_peers`), so a timeout, the flight record the watchdog reads,
    a mismatched or failed peer and a non-shared array are told exactly as the
    interpreter tells them.

    Made (:meth:`make`) for a schedule of one Claim, one-sided and local steps,
    and its Release last; a schedule with transfers (the node-aware
    algorithms across nodes) keeps the interpreter.
    """

    __slots__ = ("arena", "source", "_run", "_parts", "_steps")

    def __init__(self, arena, ops, relax, views):
        self.arena = arena
        # ops: (kind, index, step, a, b), one entry per step that does something, as _write_program writes it
        self.source, self._run = _write_program(arena, ops, relax, views)
        self._parts = (ops, relax, views)
        self._steps = None  # the nonblocking form, made at its first use (see steps)

    @classmethod
    def make(cls, steps, bufs: dict, chan, arena) -> NodeProgram | None:
        """The program of ``steps`` on ``arena`` (``chan``'s, made), its slots viewed for ``bufs``' type; or None.

        None where the interpreter must run the schedule: a transfer among the
        steps, not exactly one Claim, no Release last, or chunks larger than the
        arena's slots (the interpreter's Claim then raises, naming the size).
        """
        claims = [step for step in steps if step.kind == CLAIM]
        if (len(claims) != 1 or steps[-1].kind != RELEASE
                or any(step.kind == TRANSFER or step.kind == RELEASE for step in steps[:-1])):
            return None
        out = bufs.get("out")
        dtype = out.dtype if out is not None else np.dtype(np.uint8)  # (as the interpreter's Claim reads it)
        nbytes = claims[0].elements * dtype.itemsize
        if nbytes > arena.slot_bytes:
            return None
        views = arena.slot_views(nbytes, dtype)

        def bound(ref):  # a slot's range, viewed now; another buffer's stays a name, sliced at each call
            name, lo, hi = ref
            return views[name][lo:hi] if name in views else ref

        ops = []
        for index, step in enumerate(steps):
            kind = step.kind
            if kind == CLAIM:
                ops.append((_CLAIMING, index, step, None, None))
            elif kind == PUT or kind == GET:
                if step.dst[2] > step.dst[1]:
                    ops.append((_COPYING, index, step, bound(step.dst), bound(step.src)))
            elif kind == REDUCE_SLOTS:
                if step.dst[2] > step.dst[1]:
                    ops.append((_FOLDING, index, step, bound(step.dst), [bound(r) for r in step.operands]))
            elif kind == PUBLISH:
                ops.append((_PUBLISHING, index, step, step.k, None))
            elif kind == WAIT:
                ops.append((_WAITING, index, step, step.peers, step.k))
            elif kind == RELEASE:
                ops.append((_RELEASING, index, step, None, None))
            else:  # a local step (Copy, Reduce), as the interpreter runs it
                ops.append((_LOCAL, index, step, None, None))
        relax = getattr(chan, "relax", None)
        return cls(arena, tuple(ops), relax, views if any(op[0] == _LOCAL for op in ops) else None)

    def run(self, bufs: dict, tag: int, timeout: float | None, info, rec: list) -> None:
        """One blocking call on ``bufs`` ("in", "out", "tmp"): the schedule's steps, as :func:`run_schedule` runs them.

        ``tag`` is the call's identity, ``info`` its :class:`CallInfo` or the
        tuple of its fields (its number third), ``rec`` its flight-recorder
        entry, which names each step as it runs.

        Raises:
            CommTimeout: a wait (the Claim's included) did not end within ``timeout``.
            CollectiveMismatch: a peer published from another call, or one rank's
                arrays are shared and another's are not.
        """
        self._run(bufs, tag, timeout, info, rec)

    @property
    def steps(self):
        """The program as an i-form's generator function: ``steps(bufs, tag, info, rec)``, its text ``.source``.

        The same lines as :meth:`run`'s, but where the blocking program waits
        (its turn at the Claim, a peer's counter at a Wait) the generator yields
        ``(index, step, pending)`` once a first test finds the wait not over, as
        :func:`execute` does for a nonblocking run: the request's run
        (:class:`ScheduleRun`) drives it, with its timeout, and resumes it when
        the wait has ended, where the peer checks follow as in :meth:`run`.
        """
        if self._steps is None:
            ops, relax, views = self._parts
            source, steps = _write_program(self.arena, ops, relax, views, nonblocking=True)
            steps.source = source
            self._steps = steps
        return self._steps


def _write_program(arena, ops, relax, views, nonblocking=False):
    """``(source, function)``: a :class:`NodeProgram`'s ``ops`` written out, views and steps as constants.

    ``nonblocking``: a generator function ``run(bufs, tag, info, rec)`` that
    yields each wait still in flight after a first test (see :attr:`NodeProgram.steps`).
    """
    ns = {"_arena": arena, "_counter": arena.counter, "_publish": arena.publish, "_relax": relax,
          "_identity": arena.identity, "_shares": arena.shares,
          "_views": views, "_fold": _fold, "_do_local": _do_local, "_located": _located, "_turn": _turn,
          "_short_of": _short_of, "_wait_for": _wait_for, "_waited": _waited, "_check_peers": _check_peers,
          "_counter_value": counter_value, "_FINAL": FINAL}
    consts: list = []

    def const(value, prefix: str) -> str:
        name = f"_{prefix}{len(consts)}"
        consts.append(value)
        ns[name] = value
        return name

    def ref(r) -> str:  # a range of the call's own buffers is sliced at each call; a slot's is a constant
        return f"bufs[{r[0]!r}][{r[1]}:{r[2]}]" if type(r) is tuple else const(r, "v")

    shared = any(code == _CLAIMING and step.shared for code, _, step, _, _ in ops)

    def wait(pending: str, indent: str, index: int, s: str) -> list:
        """The lines that wait for ``pending`` (one expression): at once, or yielded to the request's driver."""
        if not nonblocking:
            return [f"{indent}_waited({pending}, timeout, info, {index}, {s})"]
        return [f"{indent}_pending = {pending}", f"{indent}if not _pending.test():",
                f"{indent}    yield {index}, {s}, _pending"]

    lines = ["def run(bufs, tag, info, rec):" if nonblocking else "def run(bufs, tag, timeout, info, rec):",
             "    seq = info[2] if type(info) is tuple else info.seq",
             "    base = _counter_value(seq, 0)"]
    if views is not None:
        lines.append("    bufs.update(_views)  # (for the local steps, which find the slots by name)")
    for code, index, step, a, b in ops:
        s = const(step, "s")
        lines += [f"    # step {index}: {step!r}",
                  f"    rec[{STEP}] = {index}; rec[{STEP_OBJ}] = {s}  # record.step, record.step_obj"]
        if code == _COPYING:
            lines.append(f"    {ref(a) if type(a) is tuple else ref(a) + '[...]'} = {ref(b)}")
        elif code == _FOLDING and len(b) == 2:  # (what _fold does with two operands)
            op = step.op
            typed = next((r for r in (a, *b) if type(r) is not tuple), None)  # a slot's view: the call's dtype
            if typed is not None and op.is_ufunc and not (op.fresh_for_complex and typed.dtype.kind == "c"):
                # Op.combine's ufunc case written out (calling combine cost about 0.2 us)
                lines.append(f"    {const(op.fn, 'f')}({ref(b[0])}, {ref(b[1])}, out={ref(a)})")
            else:
                lines.append(f"    {s}.op.combine({ref(a)}, {ref(b[1])}, False, {ref(b[0])})")
        elif code == _FOLDING:
            lines.append(f"    _fold({ref(a)}, [{', '.join(ref(r) for r in b)}], {s}.op)")
        elif code == _PUBLISHING:
            lines.append(f"    _publish(base | {a})")
        elif code == _WAITING:
            lines += [f"    value = base | {b}",
                      f"    if {' or '.join(f'_counter({q}) < value' for q in a)}:",
                      *wait(f"_wait_for(_arena, {s}.peers, value, _relax)", "        ", index, s),
                      # the checks of _check_peers, tested inline; it runs (and raises, or views the peers'
                      # arrays the first time) only where one fails
                      f"    if {' or '.join(_peer_test(q, shared) for q in a)}:",
                      f"        _check_peers(_arena, info, {s}, tag, {shared}, bufs)"]
        elif code == _CLAIMING:
            if step.shared:
                lines.append(f"    where = _located(_arena, bufs, info, {s})")
            lines += ["    ticket = _arena.take_turn()",
                      "    last = _arena.last",
                      "    if not _arena.my_turn(ticket) or last >= 0 and _short_of(_arena, "
                      "_counter_value(last, _FINAL)):",
                      *wait("_turn(_arena, ticket, _relax)", "        ", index, s),
                      "    _arena.set_where(*where)" if step.shared else "    _arena.set_where(None, None)",
                      "    _arena.set_identity(tag)"]
        elif code == _LOCAL and step.kind == COPY:  # (what _do_local does with a Copy, written out)
            (name, lo, hi), (sname, slo, shi) = step.dst, step.src
            copy = f"bufs[{name!r}][{lo}:{hi}] = bufs[{sname!r}][{slo}:{shi}]"
            if hi > lo and lo == slo:  # in place, "in" and "out" are one array: a range onto itself is skipped
                lines.append(f"    if bufs[{name!r}] is not bufs[{sname!r}]: {copy}")
            elif hi > lo:
                lines.append(f"    {copy}")
        elif code == _LOCAL:
            lines.append(f"    _do_local({s}, bufs)")
        else:
            lines.append("    _publish(base | _FINAL)")
            lines.append("    _arena.end_turn(seq)")
    if nonblocking:
        lines.append("    yield from ()  # (a generator even where no wait is written)")
    source = "\n".join(lines)
    exec(compile(source, "<commkit node program, nonblocking>" if nonblocking else "<commkit node program>", "exec"),
         ns)
    return source, ns["run"]


def _peer_test(q: int, shared: bool) -> str:
    """A program's inline test that peer ``q`` may be read after a wait: True where :func:`_check_peers` must run."""
    if shared:
        return f"_identity({q}) != tag or not _shares({q}) or 'in@{q}' not in bufs"
    return f"_identity({q}) != tag or _shares({q})"


def _waited(pending, timeout: float | None, info, index: int, step) -> None:
    """Wait for a node step's ``pending`` as :func:`run_schedule` does: a timeout raises, naming the step."""
    if not pending.test():
        stuck = pending.wait(timeout)
        if stuck:
            raise timeout_error(info, index, step, stuck, timeout)


def _short_of(arena, value: int) -> bool:
    """Whether some other rank of the node has not yet published ``value`` (this rank's own counter is its own
    doing: a call asks only after publishing it)."""
    counter, me = arena.counter, arena.rank
    for q in range(arena.size):
        if q != me and counter(q) < value:
            return True
    return False


def check_in(chan, tag: int, timeout: float | None) -> list:
    """An empty message to and from every other rank of ``chan`` on ``tag``: the ranks not heard from in ``timeout``.

    What comes before a collective of the library's that no timeout can end (making
    or freeing a node arena), so that a rank that never comes is named instead.
    """
    nothing = np.empty(0, np.uint8)
    peers = [q for q in range(chan.size) if q != chan.rank]
    return chan.transfer([(q, nothing) for q in peers], [(q, nothing) for q in peers], tag, timeout)


def check_in_saying(chan, ok: bool, tag: int, timeout: float | None) -> tuple[list, list]:
    """:func:`check_in` that also tells every other rank whether this one is ``ok``.

    Returns the ranks not heard from within ``timeout``, and the ranks that said
    they are not ok (every rank that hears from all gets the same answers).
    """
    peers = [q for q in range(chan.size) if q != chan.rank]
    mine = np.array([ok], np.uint8)
    theirs = [np.empty(1, np.uint8) for _ in peers]
    stuck = chan.transfer([(q, mine) for q in peers], list(zip(peers, theirs)), tag, timeout)
    return stuck, [q for q, got in zip(peers, theirs) if not stuck and not got[0]]


class _NodeCall:
    """One run's use of the node arena: the arena, the call's number and tag, its turn (see :class:`Claim`)."""

    __slots__ = ("arena", "seq", "base", "tag", "ticket", "relax", "info", "bufs", "where")

    def __init__(self, chan, tag: int, info, timeout, index: int, step):
        make = getattr(chan, "arena", None)
        if make is None:
            raise AlgorithmNotApplicable(
                f"the {getattr(chan, 'name', '?')} transport has no shared-memory arena, which the node algorithms "
                "need; choose a two-sided algorithm.")

        def rendezvous():
            # Making the arena is a collective of the library's, which no timeout can end: first every
            # rank checks in with every other, on this call's tag, so a rank that never comes is named.
            stuck = check_in(chan, tag, timeout)
            if stuck:
                raise timeout_error(info, index, step, stuck, timeout)

        self.arena = make(rendezvous)
        self.info = _info(info)
        self.seq = self.info.seq
        self.base = counter_value(self.seq, 0)
        self.tag = tag
        self.ticket = None
        self.relax = getattr(chan, "relax", None)
        self.bufs = None
        self.where = None  # where this call's "in" and "out" lie, when its arrays are shared

    def start(self, step, bufs):
        """Carry out ``step``; a wait returns its pending (the caller waits for it, then calls :meth:`finish`)."""
        kind = step.kind
        if kind == PUT or kind == GET:
            name, lo, hi = step.dst
            sname, slo, shi = step.src
            if hi > lo:
                bufs[name][lo:hi] = bufs[sname][slo:shi]
        elif kind == REDUCE_SLOTS:
            name, lo, hi = step.dst
            if hi > lo:
                _fold(bufs[name][lo:hi], [bufs[n][a:b] for n, a, b in step.operands], step.op)
        elif kind == PUBLISH:
            self.arena.publish(self.base | step.k)
        elif kind == WAIT:
            return _wait_for(self.arena, step.peers, self.base | step.k, self.relax)
        elif kind == CLAIM:
            return self._claim(step, bufs)
        elif kind == RELEASE:
            self.arena.publish(self.base | FINAL)
            self.arena.end_turn(self.seq)
            self.ticket = None
        else:
            raise InvalidArgument(f"{_call_text(self.info, -1, step)}: not a step of the schedule vocabulary.")
        return None

    def _claim(self, step, bufs) -> _Until:
        arena = self.arena
        self.bufs = bufs
        if step.shared:
            self.where = _located(arena, bufs, self.info, step)
        out = bufs.get("out")
        dtype = out.dtype if out is not None else np.dtype(np.uint8)  # a barrier has no buffers
        nbytes = step.elements * dtype.itemsize
        if nbytes > arena.slot_bytes:
            raise InvalidArgument(
                f"{_call_text(self.info, 0, step)}: its chunks need {nbytes} bytes of slot per rank, but the node "
                f"arena has {arena.slot_bytes} (COMMKIT_NODE_ARENA_BYTES); choose a smaller segment "
                "(algorithm='shm:1M') or a larger arena.")
        bufs.update(arena.slot_views(nbytes, dtype))
        self.ticket = ticket = arena.take_turn()
        return _turn(arena, ticket, self.relax)

    def finish(self, step) -> None:
        """After a wait: a Claim records the call's identity; a Wait checks its peers are in this very call."""
        arena = self.arena
        if step.kind == CLAIM:
            arena.set_where(*(self.where or (None, None)))
            arena.set_identity(self.tag)
            return
        _check_peers(arena, self.info, step, self.tag, self.where is not None, self.bufs)


def execute(steps: Iterator, bufs: dict, chan, tag: int, timeout: float | None, info, rec: list,
            tracer=None, blocking: bool = True):
    """The interpreter of steps: every run of a schedule that is not a compiled plan goes through it.

    Blocking, nonblocking and traced runs differ only in how they drive this
    generator. It runs each local step (Reduce, Copy), carries out each
    transfer, writes the step index and step into the flight-recorder entry
    ``rec`` before each transfer (what the watchdog and error messages read),
    records each step with ``tracer`` (when given) once it has completed, and
    yields ``(index, step, pending)`` whenever the run must wait for a posted
    transfer. Whoever drives it waits for or tests ``pending`` and then resumes
    it; a transport error from ``pending`` is the driver's to report.

    Args:
        steps: the schedule (any iterable of steps).
        bufs: buffer names to flat (1-D, contiguous) arrays.
        chan: the transport channel (``post``, ``transfer``, optionally ``sendrecv``).
        tag: this call's tag (its identity, :mod:`commkit.identity`).
        timeout: seconds a transfer run inline may wait (None: forever).
        info: a :class:`CallInfo` or the tuple of its fields, for error messages.
        rec: the call's flight-recorder entry.
        tracer: records every step with its start and end times, or None.
        blocking: True: a transfer with no overlapped steps, or one too small to gain
            from overlap (:data:`OVERLAP_MIN_BYTES`), runs to completion inline with
            the transport's cheapest blocking form (``sendrecv`` for an Exchange when
            there is no timeout, else ``transfer``), so only large overlapped
            transfers are yielded. False (nonblocking requests): every transfer is
            posted and yielded.

    Raises:
        CommTimeout: a transfer run inline did not complete within ``timeout``.
        InvalidBuffer: a transport refused a message; the driver names the call and step
            (:func:`transfer_error` with ``rec``'s step).
    """
    transfer = chan.transfer
    post = chan.post
    # A transport may offer a direct blocking exchange (MPI_Sendrecv); without a timeout
    # there is nothing to poll, so Exchange steps call it with no lists to build.
    sendrecv = getattr(chan, "sendrecv", None) if blocking and timeout is None else None
    perf = time.perf_counter
    t0 = 0.0
    node = None  # the run's use of the node arena, from its Claim on (one-sided steps only)
    for index, step in enumerate(steps):
        if tracer is not None:
            t0 = perf()
        kind = step.kind
        if kind == TRANSFER:
            rec[STEP] = index
            rec[STEP_OBJ] = step
            overlap = step.overlap
            if blocking and not overlap and type(step) is Exchange:  # most steps: no lists to build
                d, sn, slo, shi, s, rn, rlo, rhi = step.pair
                if sendrecv is not None:
                    sendrecv(d, bufs[sn][slo:shi], s, bufs[rn][rlo:rhi], tag)
                else:
                    stuck = transfer(((d, bufs[sn][slo:shi]),), ((s, bufs[rn][rlo:rhi]),), tag, timeout)
                    if stuck:
                        raise timeout_error(info, index, step, stuck, timeout)
            else:
                sends = [(peer, bufs[name][lo:hi]) for peer, (name, lo, hi) in step.sends]
                recvs = [(peer, bufs[name][lo:hi]) for peer, (name, lo, hi) in step.recvs]
                # Below OVERLAP_MIN_BYTES, posting and waiting later costs more Python than the
                # local work it would hide: a blocking run does the transfer first and its
                # overlapped steps after (they never touch the ranges it moves).
                if blocking and (not overlap or wire_bytes(sends, recvs) < OVERLAP_MIN_BYTES):
                    stuck = transfer(sends, recvs, tag, timeout)
                    if stuck:
                        raise timeout_error(info, index, step, stuck, timeout)
                    for local in overlap:
                        _do_local(local, bufs)
                else:
                    pending = post(sends, recvs, tag)
                    for local in overlap:
                        _do_local(local, bufs)
                    yield index, step, pending
        elif kind == REDUCE:
            name, lo, hi = step.into
            if hi > lo:
                oname, olo, ohi = step.operand
                sname, slo, shi = step.src
                step.op.combine(bufs[name][lo:hi], bufs[oname][olo:ohi], step.operand_first, bufs[sname][slo:shi])
        elif kind == COPY:
            _do_local(step, bufs)
        else:  # a one-sided step on the node arena
            rec[STEP] = index
            rec[STEP_OBJ] = step
            if node is None:
                node = _NodeCall(chan, tag, info, timeout, index, step)
            pending = node.start(step, bufs)
            if pending is not None:
                if not pending.test():
                    yield index, step, pending
                node.finish(step)
        if tracer is not None:
            tracer.record(info, index, step, t0, perf(), bufs)


def run_schedule(steps: Iterator, bufs: dict, chan, tag: int, timeout: float | None, info: CallInfo,
                 rec: list | None = None) -> None:
    """Run a schedule to completion on the transport channel ``chan`` (blocking; :func:`execute` driven to the end).

    ``bufs`` maps buffer names to flat (1-D, contiguous) arrays; ``tag``
    carries this call's identity (:mod:`commkit.identity`). ``info`` is a
    :class:`CallInfo` or the tuple of its fields (cheaper to build per call);
    its tracer, if any, records every step. ``rec`` is the call's
    flight-recorder entry (see :func:`execute`).
    """
    tracer = info.tracer if isinstance(info, CallInfo) else info[4]
    if rec is None:
        rec = blank_record()
    try:
        for index, step, pending in execute(steps, bufs, chan, tag, timeout, info, rec, tracer):
            stuck = pending.wait(timeout)
            if stuck:
                abandon = getattr(pending, "abandon", None)
                if abandon is not None:
                    abandon()
                raise timeout_error(info, index, step, stuck, timeout)
    except InvalidBuffer as exc:
        raise transfer_error(info, rec[STEP], rec[STEP_OBJ], exc) from None


# Below this many bytes on the wire, posting a transfer and waiting for it later costs more
# Python than the local work it would hide: such a transfer runs first and its overlapped
# steps after (they never touch the ranges it moves, so either order is right).
OVERLAP_MIN_BYTES = 64 * 1024


def wire_bytes(sends, recvs) -> int:
    """Bytes a transfer's views move (sends and receives)."""
    return sum(buf.nbytes for _, buf in sends) + sum(buf.nbytes for _, buf in recvs)


class Progress:
    """The outstanding nonblocking operations of one communicator, driven together.

    MPI makes progress on every pending operation whenever a rank is inside
    any MPI call; a schedule here advances only when someone runs its next
    step. So that the patterns MPI allows cannot deadlock (two ranks waiting on
    two outstanding i-collectives in opposite orders; a rank blocked in a
    large send while its peer waits on an i-collective that needs this rank's
    next step), every blocking call and every ``wait()``/``test()`` on a
    communicator drives all of its outstanding requests. With nothing
    outstanding, blocking calls take their direct path and pay nothing.
    """

    __slots__ = ("requests", "relax", "held", "on_change")

    def __init__(self, relax: Callable[[], None] | None = None, on_change: Callable[[], None] | None = None):
        self.requests: list = []
        self.relax = relax or (lambda: None)
        # Nonblocking collectives the program started and has not yet seen end (ScheduleRequest): what
        # the outstanding-request limit counts. It follows the program's own calls, so every rank running
        # the same program decides the limit alike, however far each rank's requests got on their own.
        self.held = 0
        self.on_change = on_change  # called when the list becomes empty or stops being empty

    def add(self, request) -> None:
        self.requests.append(request)
        if len(self.requests) == 1 and self.on_change is not None:
            self.on_change()

    def discard(self, request) -> None:
        try:
            self.requests.remove(request)
        except ValueError:
            return
        if not self.requests and self.on_change is not None:
            self.on_change()

    def drive(self, skip=None) -> bool:
        """Advance every outstanding request once (never blocks); True if any completed a step."""
        moved = False
        for request in tuple(self.requests):
            if request is not skip and request._advance_once():
                moved = True
        return moved

    def settle(self, seq: int, span: int, timeout: float | None) -> None:
        """Complete every request still in flight whose call number is ``seq - span`` or earlier.

        Its tag is the tag call ``seq`` is about to use (call numbers are kept
        modulo ``span``). Once this rank has finished it, every message it sent
        went out before call ``seq``'s and every receive it posted matched, so
        MPI's in-order matching gives each call its own messages. Waiting here
        is local progress, never an error that some ranks would raise and others
        not; ranks that are in call ``seq`` too drive the old request as well.
        """
        oldest = seq - span
        for request in tuple(self.requests):
            number = getattr(request, "tag_seq", None)
            if number is not None and number <= oldest and not request.done:
                if not self.wait(lambda r=request: r.done or r._advance(), timeout, skip=request):
                    request._timed_out(_peers_of(request._step), timeout)

    def wait(self, test: Callable[[], bool], timeout: float | None, skip=None) -> bool:
        """Poll ``test`` while driving the other requests; False if ``timeout`` passes without progress."""
        backoff = Backoff(timeout, first=1e-6)
        while True:
            if test():
                return True
            if self.drive(skip):
                backoff.progressed()
                continue
            spinning = time.monotonic() - backoff.start <= backoff.spin
            if not backoff.pause():
                return False
            if spinning:
                self.relax()  # the pause does not sleep yet: let the threads of other ranks run


class ScheduleRun:
    """The engine side of a nonblocking collective: advances its schedule on ``test()`` and ``wait()``.

    :class:`Progress` drives it from every call on its communicator. A blocking
    call made while requests are outstanding runs as one of these and waits for
    it; an ``i``-form hands the program a :class:`ScheduleRequest` that wraps
    one, so that the program dropping its request is seen at once while the run
    goes on being driven.
    """

    __slots__ = ("tag_seq", "_value", "_bufs", "_chan", "_tag", "_timeout", "_info", "_finish", "_progress",
                 "_recorder", "_rec", "_on_timeout", "_pending", "_step", "_index", "_done", "_result", "_error",
                 "_run")

    def __init__(self, steps: Iterator, bufs: dict, chan, tag: int, timeout, info: CallInfo,
                 finish: Callable[[], Any] | None = None, progress: Progress | None = None,
                 recorder=None, rec: list | None = None, on_timeout: Callable[[Any], None] | None = None,
                 value=None, run: Iterator | None = None, begun=None):
        # info: a CallInfo, or the tuple of its fields (cheaper to make per call).
        self.tag_seq = info[2] if type(info) is tuple else info.seq  # the call number in its tag (Progress.settle)
        self._value = value  # the result when there is no finish to compute it
        self._bufs = bufs
        self._chan = chan
        self._tag = tag
        self._timeout = timeout
        self._info = info
        self._finish = finish
        self._progress = progress
        self._recorder = recorder
        self._rec = rec if rec is not None else blank_record()
        self._on_timeout = on_timeout
        self._pending = None
        self._step = None
        self._index = -1
        self._done = False
        self._result = None
        self._error = None  # the error that ended the run early: raised again by every later test() or wait()
        # run: the same steps compiled for this call shape (commkit.plan.nonblocking_steps), else interpreted.
        if run is None:
            tracer = info[4] if type(info) is tuple else info.tracer
            run = execute(steps, bufs, chan, tag, timeout, info, self._rec, tracer, blocking=False)
        self._run = run
        if begun is not None:  # its start already ran up to this step, in flight (plan.nonblocking_entry)
            self._index, self._step, self._pending = begun
        # Start at the call, as MPI's nonblocking collectives do, so that every rank starts its
        # requests in call order. On NCCL, whose steps complete once enqueued, this enqueues the
        # whole collective on the caller's stream here, whatever order the requests are waited in.
        # A run that the start completed (a small exchange often has, with the fold after it) is
        # never outstanding: it joins the requests to drive only if it did not.
        if not self._advance() and progress is not None:
            progress.add(self)

    def _advance(self) -> bool:
        """Run local steps and post transfers until one is in flight or all are done."""
        if self._error is not None:
            raise self._error
        try:
            while True:
                if self._pending is not None:
                    if not self._pending.test():
                        return False
                    self._pending = None
                item = next(self._run, None)  # the interpreter records the completed transfer, then goes on
                if item is None:
                    self._complete()
                    return True
                self._index, self._step, self._pending = item
        except InvalidBuffer as exc:
            raise self._failed(exc) from None
        except BaseException as exc:  # a local step (a user's op) or the transport raised: the run is over
            self._fail("failed", exc)
            raise

    def _advance_once(self) -> bool:
        """Advance without blocking; True if a step completed (used by :class:`Progress`)."""
        if self._done:
            return False
        before = self._index
        return self._advance() or self._index != before

    def _complete(self) -> None:
        self._done = True
        if self._progress is not None and self._progress.requests:  # (a run the start completed never joined)
            self._progress.discard(self)
        rec = self._rec  # (FlightRecorder.finish, written out: a call costs more than these two lines)
        rec[T_END] = time.monotonic()
        rec[STATE] = "done"
        self._result = self._finish() if self._finish is not None else self._value
        self._bufs = self._run = None

    def _failed(self, exc: InvalidBuffer) -> BaseException:
        """Stop after a transport error; the error to raise, naming the call and step."""
        error = transfer_error(self._info, self._rec[STEP], self._rec[STEP_OBJ], exc)
        self._fail("failed", error)
        return error

    def _fail(self, state: str, error: BaseException) -> None:
        """End the run early: it never completes, and every later test() or wait() raises ``error``."""
        self._error = error
        self._run = self._pending = None
        if self._progress is not None and self._progress.requests:
            self._progress.discard(self)
        FlightRecorder.finish(self._rec, state)

    def test(self) -> bool:
        """Make progress without blocking; return True once the collective is complete."""
        if self._done or self._advance() or (self._progress is not None and self._progress.drive(skip=self)
                                             and self._advance()):
            return True
        self._chan_relax()
        return False

    def _chan_relax(self) -> None:
        relax = getattr(self._chan, "relax", None)
        if relax is not None:
            relax()

    def wait(self, timeout: float | None = None):
        """Block until complete and return the result (``timeout`` in seconds without progress)."""
        if self._done:
            return self._result
        timeout = self._timeout if timeout is None else timeout
        recorder = self._recorder
        if recorder is not None:
            recorder.active = self._rec
        try:
            while not self._done:
                if self._advance():
                    break
                progress = self._progress
                if progress is not None and len(progress.requests) > 1:
                    if not progress.wait(self._test_pending, timeout, skip=self):
                        self._timed_out(self._pending.peers_waiting() if hasattr(self._pending, "peers_waiting")
                                        else _peers_of(self._step), timeout)
                    continue
                try:
                    pending = self._pending.wait(timeout)
                except InvalidBuffer as exc:
                    raise self._failed(exc) from None
                if pending:
                    self._timed_out(pending, timeout)
                self._pending = None  # complete (its receives checked): the next step, without testing it again
        finally:
            if recorder is not None:
                recorder.active = None
        return self._result

    def _test_pending(self) -> bool:
        """Whether the transfer in flight has completed; a transport error ends the run, naming the step."""
        try:
            return self._pending.test()
        except InvalidBuffer as exc:
            raise self._failed(exc) from None

    def _timed_out(self, peers, timeout):
        from .watchdog import recent_summary

        pending = self._pending
        self._fail("timed out", None)  # first, so that the recent calls the error lists show it timed out
        error = self._error = timeout_error(self._info, self._index, self._step, peers, timeout,
                                            recent_summary(self._recorder))
        if self._on_timeout is not None:
            self._on_timeout(pending, str(error))
        raise error

    @property
    def done(self) -> bool:
        """Whether the collective has completed (without making progress)."""
        return self._done


class ScheduleRequest(Request):
    """A nonblocking collective: advances its schedule on ``test()`` and ``wait()``.

    Returned by the ``i``-forms (``iallreduce`` ...). ``wait()`` returns the
    result the blocking form would have returned. While it is outstanding,
    every blocking call, ``wait()`` or ``test()`` on its communicator also
    advances it (see :class:`Progress`), dropped or not.

    It counts as held, towards the outstanding-request limit, from the call
    until the program sees it end: ``wait()`` returns or raises, ``test()``
    returns True or raises, or the program drops it. Those are points in the
    program's own order, so every rank running the same program counts alike,
    however far each rank's messages got on their own.
    """

    __slots__ = ("_run", "_progress")

    def __init__(self, run: ScheduleRun, progress: Progress):
        self._run = run
        self._progress = progress
        progress.held += 1

    def _let_go(self) -> None:
        if self._progress is not None:
            self._progress.held -= 1
            self._progress = None

    def __del__(self) -> None:
        if self._progress is not None:  # (_let_go, written out: every request ends here)
            self._progress.held -= 1

    def test(self) -> bool:
        """Make progress without blocking; return True once the collective is complete."""
        try:
            if not self._run.test():
                return False
        except BaseException:
            self._let_go()
            raise
        self._let_go()
        return True

    def wait(self, timeout: float | None = None):
        """Block until complete and return the result (``timeout`` in seconds without progress)."""
        run = self._run
        if run._done:  # (a small call's run often completed at its start)
            self._let_go()
            return run._result
        try:
            return run.wait(timeout)
        finally:
            self._let_go()

    @property
    def done(self) -> bool:
        """Whether the collective has completed (without making progress)."""
        return self._run._done

    @property
    def result(self):
        """The result :meth:`wait` returns, once the collective is done (None before)."""
        return self._run._result if self._run._done else None


class CompletedRequest(ScheduleRequest):
    """The request of a nonblocking collective that its start completed: no run to drive, only its result.

    An i-form's entry (:func:`commkit.plan.nonblocking_entry`) hands one back when
    every step completed at the call, without making a :class:`ScheduleRun`. It
    counts towards the outstanding-request limit, as every request does, until the
    program sees it end (``wait()``, ``test()``, or dropping it).
    """

    __slots__ = ("_result",)

    def __init__(self, result, progress: Progress):
        # No run: pointing ``_run`` at itself made every such request a reference cycle, which only Python's
        # cyclic collector frees (a collection every few hundred calls, and a full one now and then).
        self._result = result
        self._progress = progress
        progress.held += 1

    def test(self) -> bool:
        """True: the collective completed at its start."""
        self._let_go()
        return True

    def wait(self, timeout: float | None = None):
        """The result (the collective completed at its start)."""
        progress = self._progress
        if progress is not None:  # (_let_go, written out)
            progress.held -= 1
            self._progress = None
        return self._result

    @property
    def done(self) -> bool:
        """True: the collective completed at its start."""
        return True

    @property
    def result(self):
        """The result :meth:`wait` returns."""
        return self._result


def _peers_of(step) -> list:
    if step is None:
        return []
    return sorted({p for p, _ in step.recvs} | {p for p, _ in step.sends})
