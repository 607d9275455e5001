"""Schedules: the step vocabulary algorithms speak, and the executor that runs them.

Why schedules. A collective algorithm is data-oblivious: who sends which block
to whom depends only on (rank, size, count, root), never on the values. So an
algorithm is a generator that yields steps over index ranges of named, flat
buffers and knows nothing of MPI, NCCL or threads. The same text then runs on
every transport (the executor below), step by step for nonblocking calls
(:class:`ScheduleRequest`), with no data at all in the simulator
(:mod:`commkit.sim`), and under the tracer (:mod:`commkit.tracing`).

The vocabulary is three steps:

* :class:`Transfer` -- post every send and receive it lists, then wait for
  all of them (``Send``, ``Recv`` and ``Exchange`` are its common shapes);
* :class:`Reduce` -- ``into = into (op) operand`` (or ``operand (op) into``
  when the operand holds lower ranks' contributions);
* :class:`Copy` -- a local copy between buffer ranges.

A buffer range is a tuple ``(name, lo, hi)`` of element indices into the flat
view of a named buffer. Names used by the collectives: ``"in"`` (the caller's
input, never written), ``"out"`` (the result), ``"tmp"`` (scratch the
algorithm asked for in its ``scratch`` declaration).
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, Iterator

from .errors import CommTimeout

__all__ = [
    "Transfer",
    "Send",
    "Recv",
    "Exchange",
    "Reduce",
    "Copy",
    "partition",
    "run_schedule",
    "ScheduleRequest",
    "CallInfo",
]

TRANSFER, REDUCE, COPY = 0, 1, 2


class Transfer:
    """Post all ``sends`` and ``recvs`` at once, then wait until every one completes.

    ``sends`` and ``recvs`` are tuples of ``(peer, (name, lo, hi))``. Messages
    between one pair of ranks are matched in the order they are posted.
    """

    __slots__ = ("sends", "recvs")
    kind = TRANSFER

    def __init__(self, sends=(), recvs=()):
        self.sends = tuple(sends)
        self.recvs = tuple(recvs)

    @property
    def pair(self):
        """``(dest, name, lo, hi, source, name, lo, hi)`` for one send plus one receive, else None."""
        if len(self.sends) == 1 and len(self.recvs) == 1:
            (dest, sbuf), (source, rbuf) = self.sends[0], self.recvs[0]
            return (dest, *sbuf, source, *rbuf)
        return None

    def __repr__(self) -> str:
        parts = [f"send {b} to {p}" for p, b in self.sends] + [f"recv {b} from {p}" for p, b in self.recvs]
        return f"{type(self).__name__}({'; '.join(parts)})"


class Send(Transfer):
    """Send one buffer range to ``to``."""

    __slots__ = ()

    def __init__(self, to: int, buf: tuple):
        self.sends = ((to, buf),)
        self.recvs = ()


class Recv(Transfer):
    """Receive one buffer range from ``frm``."""

    __slots__ = ()

    def __init__(self, frm: int, buf: tuple):
        self.sends = ()
        self.recvs = ((frm, buf),)


class Exchange(Transfer):
    """Send to ``send_to`` and receive from ``recv_from`` at the same time (MPI_Sendrecv)."""

    __slots__ = ("pair",)

    def __init__(self, send_to: int, send: tuple, recv_from: int, recv: tuple):
        self.sends = ((send_to, send),)
        self.recvs = ((recv_from, recv),)
        # Flattened once here so the executor's hot loop does no unpacking of nested tuples.
        self.pair = (send_to, *send, recv_from, *recv)


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


class CallInfo:
    """What the executor knows about the call it runs, for timeouts and traces."""

    __slots__ = ("collective", "algorithm", "seq", "rank", "tracer")

    def __init__(self, collective: str, algorithm: str, seq: int, rank: int, tracer=None):
        self.collective = collective
        self.algorithm = algorithm
        self.seq = seq
        self.rank = rank
        self.tracer = tracer


def _views(bufs, pairs):
    return [(peer, bufs[name][lo:hi]) for peer, (name, lo, hi) in pairs]


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


def _timeout_error(info, index: int, step, pending_peers, timeout) -> CommTimeout:
    if not isinstance(info, CallInfo):
        info = CallInfo(*info)
    peers = ", ".join(str(p) for p in pending_peers) or "?"
    return CommTimeout(
        f"rank {info.rank} timed out after {timeout:g} s in {info.collective} #{info.seq} "
        f"(algorithm {info.algorithm!r}) at step {index} ({step!r}), waiting for rank(s) {peers}. "
        "A peer may have stopped, called a different collective, or be much slower; "
        "COMMKIT_DEBUG=check reports mismatched collectives."
    )


def run_schedule(steps: Iterator, bufs: dict, chan, tag: int, timeout: float | None, info: CallInfo) -> None:
    """Run a schedule to completion on the transport channel ``chan`` (blocking).

    ``bufs`` maps buffer names to flat (1-D, contiguous) arrays; ``tag``
    separates this call's messages from other calls in flight. ``info`` is a
    :class:`CallInfo` or the tuple of its fields (cheaper to build per call).
    """
    tracer = info.tracer if isinstance(info, CallInfo) else info[4]
    if tracer is not None:
        return _run_traced(steps, bufs, chan, tag, timeout, info, tracer)
    transfer = chan.transfer
    # A transport may offer a direct blocking exchange (MPI_Sendrecv); without a timeout
    # there is nothing to poll, so Exchange steps call it with no lists to build.
    sendrecv = getattr(chan, "sendrecv", None) if timeout is None else None
    for index, step in enumerate(steps):
        kind = step.kind
        if kind == TRANSFER:
            if type(step) is Exchange:
                d, sn, slo, shi, s, rn, rlo, rhi = step.pair
                if sendrecv is not None:
                    sendrecv(d, bufs[sn][slo:shi], s, bufs[rn][rlo:rhi], tag)
                    continue
                pending = transfer(((d, bufs[sn][slo:shi]),), ((s, bufs[rn][rlo:rhi]),), tag, timeout)
            else:
                pending = transfer([(peer, bufs[name][lo:hi]) for peer, (name, lo, hi) in step.sends],
                                   [(peer, bufs[name][lo:hi]) for peer, (name, lo, hi) in step.recvs], tag, timeout)
            if pending:
                raise _timeout_error(info, index, step, pending, timeout)
        elif kind == REDUCE:
            name, lo, hi = step.into
            if hi > lo:
                oname, olo, ohi = step.operand
                sname, slo, shi = step.src
                step.op.combine(bufs[name][lo:hi], bufs[oname][olo:ohi], step.operand_first, bufs[sname][slo:shi])
        else:
            _do_local(step, bufs)


def _run_traced(steps, bufs, chan, tag, timeout, info, tracer) -> None:
    for index, step in enumerate(steps):
        t0 = time.perf_counter()
        if step.kind == TRANSFER:
            pending = chan.transfer(_views(bufs, step.sends), _views(bufs, step.recvs), tag, timeout)
            if pending:
                raise _timeout_error(info, index, step, pending, timeout)
        else:
            _do_local(step, bufs)
        tracer.record(info, index, step, t0, time.perf_counter(), bufs)


class ScheduleRequest:
    """A nonblocking collective: advances its schedule on ``test()`` and ``wait()``.

    Returned by the ``i``-forms (``iallreduce`` ...). ``wait()`` returns the
    result the blocking form would have returned.
    """

    def __init__(self, steps: Iterator, bufs: dict, chan, tag: int, timeout, info: CallInfo,
                 finish: Callable[[], Any] | None = None, on_done: Callable[[], None] | None = None):
        self._steps = steps
        self._bufs = bufs
        self._chan = chan
        self._tag = tag
        self._timeout = timeout
        self._info = info
        self._finish = finish
        self._on_done = on_done
        self._pending = None
        self._step = None
        self._index = -1
        self._done = False
        self._result = None
        self._t0 = 0.0
        # Start at the call, as MPI's nonblocking collectives do, so that every rank starts its
        # requests in call order. On NCCL, whose steps complete once enqueued, this enqueues the
        # whole collective on the caller's stream here, whatever order the requests are waited in.
        self._advance()

    def _advance(self) -> bool:
        """Run local steps and post transfers until one is in flight or all are done."""
        tracer = self._info.tracer
        while True:
            if self._pending is not None:
                if not self._pending.test():
                    return False
                if tracer is not None:
                    tracer.record(self._info, self._index, self._step, self._t0, time.perf_counter(), self._bufs)
                self._pending = None
            step = next(self._steps, None)
            self._index += 1
            if step is None:
                self._complete()
                return True
            self._step = step
            if step.kind == TRANSFER:
                self._t0 = time.perf_counter()
                self._pending = self._chan.post(_views(self._bufs, step.sends), _views(self._bufs, step.recvs), self._tag)
            else:
                t0 = time.perf_counter()
                _do_local(step, self._bufs)
                if tracer is not None:
                    tracer.record(self._info, self._index, step, t0, time.perf_counter(), self._bufs)

    def _complete(self) -> None:
        self._done = True
        if self._finish is not None:
            self._result = self._finish()
        if self._on_done is not None:
            self._on_done()
        self._bufs = None

    def test(self) -> bool:
        """Make progress without blocking; return True once the collective is complete."""
        if self._done:
            return True
        return self._advance()

    def wait(self, timeout: float | None = None):
        """Block until complete and return the result (``timeout`` in seconds per step)."""
        timeout = self._timeout if timeout is None else timeout
        while not self._done:
            if self._advance():
                break
            pending = self._pending.wait(timeout)
            if pending:
                raise _timeout_error(self._info, self._index, self._step, pending, timeout)
        return self._result

    @property
    def done(self) -> bool:
        """Whether the collective has completed (without making progress)."""
        return self._done

