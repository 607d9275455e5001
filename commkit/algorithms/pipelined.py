"""Pipelined (segmented) ring algorithms: the ring of :mod:`.ring`, each block cut into segments.

The plain ring allreduce receives a whole block, then reduces it: the link
idles while the core reduces and the core idles while the link moves data.
Here every block is cut into K segments and each ring step becomes K
exchanges; the exchange of segment k carries, in ``overlap=``, the reduction
of segment k-1 (received by the previous exchange), so the link and the core
work at once (Gloo's chunked ring does the same). The price is K times as
many messages, so segments must be large enough that alpha stays small
against a segment's beta. The ring reduce-scatter is pipelined the same way,
and this module also holds the segment helpers the chain (:mod:`.chain`) and
tree pipelines (:mod:`.binary_tree`, :mod:`.double_tree`) cut their vectors with.

Segment size, in elements: the schedule's ``segment`` argument (from
``algorithm="ring_pipelined:SIZE"`` on a call or in
``COMMKIT_ALLREDUCE_ALGORITHM``, or a selection rule's ``segment_bytes``; see
:mod:`commkit.selection`), else the environment variable
``COMMKIT_SEGMENT_ELEMENTS``, else :data:`SEGMENT` (65536), read when a
schedule is generated. Plans cache a call shape's schedule, so the variable is
read at a shape's first call; set it before that. Every block is cut into the same
number K of near-equal segments, K = ⌈⌈count/p⌉/S⌉ (at most ⌊count/p⌋, so
no segment is empty when count >= p; a segment may then hold one element more
than S). Zero-length segments (count < p) send no message: both sides know
the lengths and skip them alike.

The cost model knows bytes, not dtypes: the registered formulas count
segments as if elements were 4 bytes (float32), as the selector's tests do.
"""

from __future__ import annotations

import math
import os

from ..errors import InvalidArgument
from ..schedule import Copy, Exchange, Recv, Reduce, Send, overlaps_safely, partition, partition_sizes
from . import algorithm
from ._blocks import block_offsets
from .ring import two_widest_blocks

SEGMENT = 1 << 16
"""Default segment size in elements (``COMMKIT_SEGMENT_ELEMENTS`` overrides it)."""
ENV_SEGMENT = "COMMKIT_SEGMENT_ELEMENTS"
COST_ITEMSIZE = 4  # the cost model's elements, in bytes (see the module docstring)


def segment_elements(segment: int | None = None) -> int:
    """The segment size in elements: ``segment`` if given (the call's or the selection table's),
    else ``COMMKIT_SEGMENT_ELEMENTS`` if set, else :data:`SEGMENT`."""
    if segment is not None:
        if isinstance(segment, bool) or not isinstance(segment, int) or segment < 1:
            raise InvalidArgument(f"a segment size is a positive number of elements, got {segment!r}.")
        return segment
    text = os.environ.get(ENV_SEGMENT, "").strip()
    if not text:
        return SEGMENT
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise InvalidArgument(f"{ENV_SEGMENT} must be a positive number of elements, got {text!r}.")
    return value


def segment_count(count: int, size: int, segment: int | None = None) -> int:
    """K: how many segments each of the p ring blocks is cut into (0 when count is 0).

    ``segment``: the segment size in elements (None: :func:`segment_elements`'s default).
    """
    largest, smallest = -(-count // size), count // size
    if largest == 0:
        return 0
    if smallest == 0:
        return 1
    return max(1, min(-(-largest // segment_elements(segment)), smallest))


def segments(count: int, segment: int | None = None) -> tuple:
    """The (lo, hi) segments a whole vector of ``count`` elements is cut into (none when count is 0).

    K = ⌈count/S⌉ near-equal segments (:func:`segment_count` with one block), the first
    count mod K one element longer, so none is empty: the cut of the chain and tree pipelines.
    ``segment``: the segment size S in elements (None: :func:`segment_elements`'s default).
    """
    return partition(count, segment_count(count, 1, segment)) if count else ()


def cost_segments(n: float) -> SegmentBytes:
    """The segments of a whole n-byte vector as :func:`segments` cuts it, in bytes (4-byte elements)."""
    count = math.ceil(n / COST_ITEMSIZE)
    return SegmentBytes(count, segment_count(count, 1) if count else 0)


def _max_block(count, size):
    return -(-count // size)


def segment_step(send_to, send, recv_from, recv, local):
    """The transfer of one segment (None if both sides are empty) and the local step left to run alone."""
    has_send, has_recv = send[2] > send[1], recv[2] > recv[1]
    overlap = (local,) if local is not None else ()
    if has_send and has_recv:
        step = Exchange(send_to, send, recv_from, recv, overlap=overlap)
    elif has_send:
        step = Send(send_to, send, overlap=overlap)
    elif has_recv:
        step = Recv(recv_from, recv, overlap=overlap)
    else:
        return None, local
    if overlap and not overlaps_safely(step):
        # Unsafe to overlap (e.g. one segment per block: the reduced block is sent next): run it first.
        return type(step)(*_plain_args(step)), local
    return step, None


def _plain_args(step):
    if isinstance(step, Exchange):
        (to, send), (frm, recv) = step.sends[0], step.recvs[0]
        return to, send, frm, recv
    return step.sends[0] if step.sends else step.recvs[0]


class SegmentBytes:
    """The bytes of each of K segments as :func:`~commkit.schedule.partition` cuts a vector, without listing them.

    ``partition`` gives ``n_long`` segments one element longer than the rest, first. A
    cost formula sums over the segments; at 16 GiB in 64-element segments a list of
    them would not fit in memory, and :func:`commkit.cost.crossovers` evaluates the
    formulas thousands of times. So this holds the two lengths and sums in O(1).
    Indexing by an int (``segs[k]``, ``segs[-1]``), ``len`` and truth work as on the list.
    """

    __slots__ = ("long", "short", "n_long", "k")

    def __init__(self, count: int, parts: int, itemsize: int = COST_ITEMSIZE):
        long, short, n_long = partition_sizes(count, parts) if parts else (0, 0, 0)
        self.long, self.short, self.n_long, self.k = long * itemsize, short * itemsize, n_long, parts

    def __len__(self) -> int:
        return self.k

    def __getitem__(self, k: int) -> int:
        if not -self.k <= k < self.k:
            raise IndexError(f"segment {k} of {self.k}")
        return self.long if k % self.k < self.n_long else self.short

    def total(self) -> int:
        """The bytes of all segments."""
        return self.n_long * self.long + (self.k - self.n_long) * self.short

    def _range(self, start: int, stop: int | None) -> int:
        stop = self.k if stop is None else stop
        if start < 0 or stop > self.k:
            raise IndexError(f"segments [{start}, {stop}) of {self.k}: sums take 0 <= start, stop <= K")
        return stop

    def sum(self, f, start: int = 0, stop: int | None = None) -> float:
        """``sum(f(segs[k]) for k in range(start, stop))``, for ``0 <= start`` and ``stop <= K``."""
        stop = self._range(start, stop)
        if stop <= start:
            return 0.0
        mid = min(max(self.n_long, start), stop)
        return (mid - start) * f(self.long) + (stop - mid) * f(self.short)

    def sum_pairs(self, f, start: int = 0, stop: int | None = None) -> float:
        """``sum(f(segs[k], segs[k - 1]) for k in range(start, stop))``, ``segs[-1]`` before ``segs[0]``.

        For ``0 <= start`` and ``stop <= K``.
        """
        stop = self._range(start, stop)
        total, k = 0.0, start
        if k >= stop:
            return total
        if k == 0:
            total += f(self[0], self[-1])
            k = 1
        long_end = min(max(self.n_long, k), stop)  # [k, long_end): a long segment after a long one
        total += (long_end - k) * f(self.long, self.long)
        k = long_end
        if k < stop and k == self.n_long:  # the first short segment, after the last long one
            total += f(self.short, self.long)
            k += 1
        return total + max(stop - k, 0) * f(self.short, self.short)


def _pipelined_cost(p, n, a, b, g):
    if p == 1 or n <= 0:
        return 0.0
    count = math.ceil(n / COST_ITEMSIZE)
    k_segments = segment_count(count, p)
    if k_segments <= 1:
        return 2 * (p - 1) * a + 2 * (p - 1) / p * n * b + (p - 1) / p * n * g
    segs = SegmentBytes(count // p, k_segments)

    def step(seg, prev):  # segment k overlaps the reduction of segment k-1 (cyclically)
        return max(a + seg * b, prev * g)

    return (p - 1) * (k_segments * a + segs.total() * b) + (p - 1) * segs.sum_pairs(step)


@algorithm("allreduce", "ring_pipelined", commutative=True, scratch=lambda r, p, n: _max_block(n, p),
           cost=_pipelined_cost,
           formula="(p-1)(Kα + mβ) + (p-1)Σₖ max(α + mₖβ, mₖ₋₁γ), m = n/p, mₖ = segment k (K ≥ 2); "
                   "ring's 2(p-1)α + 2((p-1)/p)nβ + ((p-1)/p)nγ when K = 1",
           cost_exact="even", cost_bound="either", symmetry="rotation")
def allreduce_ring_pipelined(rank, size, count, op, segment=None):
    """Pipelined ring allreduce: the ring reduce-scatter and allgather, every block cut into K segments.

    Restrictions: commutative op (each block is reduced starting at a different rank).
    Segments: K = ⌈⌈count/p⌉/S⌉ per block (at most ⌊count/p⌋), S = ``segment`` elements
    (``algorithm="ring_pipelined:256K"`` on the call, or the selection table's ``segment_bytes``),
    else ``COMMKIT_SEGMENT_ELEMENTS``, else 65536, read when the schedule is generated (plans
    cache it per call shape).
    Each exchange of segment k overlaps the reduction of segment k-1 received just before
    (the last reduction overlaps the allgather's first exchange); with K = 1 nothing can be
    overlapped and the schedule is exactly ``ring``'s (less the zero-length messages).
    Cost, K ≥ 2: (p-1)(Kα + mβ) + (p-1)Σₖ max(α + mₖβ, mₖ₋₁γ) with m = n/p and mₖ the bytes
    of segment k (k-1 taken cyclically); for equal segments (p-1)(Kα + mβ) + (p-1)max(Kα + mβ, mγ):
    the reduction hides behind the transfers. K = 1: ring's 2(p-1)α + 2((p-1)/p)nβ + ((p-1)/p)nγ.
    Exact when count is a multiple of p (4-byte elements: the model knows bytes only); otherwise
    off either way. Sends 2(p-1)K messages per rank (fewer when count < p: empty blocks send
    nothing), only to its right neighbour; receives only from its left one.
    Optimised as ``allreduce_ring`` is (see ``allreduce_ring_textbook`` for the form without it): the first
    step sends straight from "in", and each reduction reads "in" and the received segment and writes "out"
    in one step (``Reduce(src=...)``), so the whole input is never copied.

    Picture, generated from the schedule (p = 4, count = 8, segment = 1): each cell lists, for every
    block of the result, the ranks whose input that rank holds for the whole block (- for none), after
    each round. Redrawn by ``python -m commkit.algorithms._diagram --write``::

        round          rank 0               rank 1               rank 2               rank 3
        0              0    0    0    0     1    1    1    1     2    2    2    2     3    3    3    3
        1              0    0    0    0     1    1    1    1     2    2    2    2     3    3    3    3
        2              0    0    0    0     1    1    1    1     2    2    2    2     3    3    3    3
        3              0    0    -    03    01   1    1    -     -    12   2    2     3    -    23   3
        4              0    0    23   03    01   1    1    03    01   12   2    2     3    12   23   3
        5              0    -    023  03    01   1    -    013   012  12   2    -     -    123  23   3
        6              0    123  023  03    01   1    023  013   012  12   2    013   012  123  23   3
        7              0    0123 023  03    01   1    0123 013   012  12   2    0123  0123 123  23   3
        8              0123 0123 023  03    01   0123 0123 013   012  12   0123 0123  0123 123  23   0123
        9              0123 0123 023  03    01   0123 0123 013   012  12   0123 0123  0123 123  23   0123
        10             0123 0123 023  0123  0123 0123 0123 013   012  0123 0123 0123  0123 123  0123 0123
        11             0123 0123 023  0123  0123 0123 0123 013   012  0123 0123 0123  0123 123  0123 0123
        12             0123 0123 0123 0123  0123 0123 0123 0123  0123 0123 0123 0123  0123 0123 0123 0123
        msgs sent      12                   12                   12                   12
        elems sent     12                   12                   12                   12
        elems reduced  6                    6                    6                    6
        critical path (commkit.sim, each term alone): 12 messages, 12 elements sent, 6 reduced
    """
    if size == 1:
        yield Copy(("out", 0, count), ("in", 0, count))
        return
    k_segments = segment_count(count, size, segment)
    if k_segments == 0:
        return
    blocks = partition(count, size)
    segments = [tuple((lo + s, lo + e) for s, e in partition(hi - lo, k_segments)) for lo, hi in blocks]
    right, left = (rank + 1) % size, (rank - 1) % size
    pending = None  # the reduce of the segment received last, not yet run
    # Phase 1: reduce-scatter. After p-1 steps this rank owns block (rank + 1) % p. A received
    # segment lands in "tmp" at its offset inside the block, so consecutive segments never share
    # scratch and segment k-1 can be reduced while segment k arrives.
    for step in range(size - 1):
        send_b, recv_b = (rank - step) % size, (rank - step - 1) % size
        base = blocks[recv_b][0]
        for k in range(k_segments):
            slo, shi = segments[send_b][k]
            rlo, rhi = segments[recv_b][k]
            landing = ("tmp", rlo - base, rhi - base)
            transfer, alone = segment_step(right, ("in" if step == 0 else "out", slo, shi), left, landing, pending)
            if alone is not None:
                yield alone
            if transfer is not None:
                yield transfer
            pending = Reduce(("out", rlo, rhi), landing, op, src=("in", rlo, rhi)) if rhi > rlo else None
    # Phase 2: allgather the reduced blocks around the same ring, segment by segment.
    for step in range(size - 1):
        send_b, recv_b = (rank - step + 1) % size, (rank - step) % size
        for k in range(k_segments):
            transfer, alone = segment_step(right, ("out", *segments[send_b][k]), left, ("out", *segments[recv_b][k]),
                                    pending)
            pending = None
            if alone is not None:
                yield alone
            if transfer is not None:
                yield transfer
    if pending is not None:
        yield pending


def _ring_reduce_scatter_cost(p, n, a, b, g):
    count = math.ceil(n / COST_ITEMSIZE)
    k_segments = segment_count(count, p)
    if p == 1 or k_segments == 0:
        return 0.0
    if k_segments == 1:
        # Nothing to overlap: the ring's p-1 transfers, each followed by its reduction.
        return (p - 1) * a + (p - 1) / p * n * (b + g)
    segs = SegmentBytes(count // p, k_segments)

    def hidden(seg, prev):  # every transfer but the first hides the reduction of the segment received before it
        return max(a + seg * b, prev * g)

    return a + segs[0] * b + (p - 2) * segs.sum_pairs(hidden) + segs.sum_pairs(hidden, 1) + segs[-1] * g


@algorithm("reduce_scatter", "ring_pipelined", commutative=True, scratch=two_widest_blocks,
           cost=_ring_reduce_scatter_cost,
           formula="α + m₀β + (p-2)Σₖ max(α + mₖβ, mₖ₋₁γ) + Σₖ₌₁..K₋₁ max(α + mₖβ, mₖ₋₁γ) + m_{K-1}γ, "
                   "m = n/p in K segments mₖ (k-1 taken cyclically), K ≥ 2; "
                   "the ring's (p-1)α + ((p-1)/p)n(β+γ) when K = 1",
           cost_exact="even", cost_bound="lower", symmetry="rotation")
def reduce_scatter_ring_pipelined(rank, size, counts, op, segment=None):
    """Pipelined ring reduce-scatter: the ring of ``reduce_scatter_ring``, every block cut into K segments.

    Restrictions: commutative op (each block is reduced starting at a different rank). Per-rank
    counts may differ and be zero.
    Segments: every block is cut into the same K = ⌈⌈c/p⌉/S⌉ near-equal segments (at most ⌊c/p⌋,
    c = the whole vector; :func:`.pipelined.segment_count`, S = ``COMMKIT_SEGMENT_ELEMENTS`` or
    65536), so a block shorter than K has empty segments, which send nothing.
    Each exchange of segment k carries, in ``overlap=``, the reduction of segment k-1 received
    just before (the last segment of a step overlaps the next step's first exchange); with K = 1
    nothing can be overlapped and the schedule is ``reduce_scatter_ring``'s, less its zero-length
    messages. The last step receives straight into ``out`` and reduces there.
    Cost, K ≥ 2: α + m₀β + (p-2)Σₖ max(α + mₖβ, mₖ₋₁γ) + Σₖ₌₁..K₋₁ max(α + mₖβ, mₖ₋₁γ) + m_{K-1}γ,
    m = n/p bytes per block in segments mₖ (k-1 cyclic): the reduction hides behind the transfers.
    K = 1: (p-1)α + ((p-1)/p)n(β + γ). Exact when all counts are equal (4-byte elements);
    otherwise a lower bound (the largest block sets the pace, and it is at least the average).
    Messages: (p-1)K per rank when every block has K elements or more (one per non-empty
    segment), only to the right neighbour; n - counts[rank] elements sent.
    Scratch: two blocks of the largest count, used alternately to receive and to send on.

    Picture, generated from the schedule (p = 4, count = (2, 2, 2, 2), segment = 1): each cell lists,
    for every block of the result, the ranks whose input that rank holds for the whole block (- for
    none), after each round. Redrawn by ``python -m commkit.algorithms._diagram --write``::

        round          rank 0         rank 1         rank 2         rank 3
        0              0    0   0  0  1 1    1   1   2  2 2    2    3   3  3 3
        1              0    0   0  0  1 1    1   1   2  2 2    2    3   3  3 3
        2              0    0   0  0  1 1    1   1   2  2 2    2    3   3  3 3
        3              0    -   03 0  1 1    -   01  12 2 2    -    -   23 3 3
        4              0    23  03 0  1 1    03  01  12 2 2    01   12  23 3 3
        5              -    023 03 0  1 -    013 01  12 2 -    012  123 23 3 -
        6              0123 023 03 0  1 0123 013 01  12 2 0123 012  123 23 3 0123
        msgs sent      6              6              6              6
        elems sent     6              6              6              6
        elems reduced  6              6              6              6
        critical path (commkit.sim, each term alone): 6 messages, 6 elements sent, 6 reduced
    """
    offsets = block_offsets(counts)
    if size == 1:
        yield Copy(("out", 0, counts[0]), ("in", 0, counts[0]))
        return
    k_segments = segment_count(offsets[-1], size, segment)
    if k_segments == 0:
        return
    segments = [tuple((s, e) for s, e in partition(counts[b], k_segments)) for b in range(size)]
    right, left = (rank + 1) % size, (rank - 1) % size
    width = max(counts)
    pending = None  # the reduction of the segment received last, not yet run
    for step in range(size - 1):
        # Step s: pass on the partial result of block rank-s-1, receive block rank-s-2's from the left.
        send_b, recv_b = (rank - step - 1) % size, (rank - step - 2) % size
        if step == 0:
            send_buf, send_base = "in", offsets[send_b]  # my own contribution starts the partial sum
        else:
            send_buf, send_base = "tmp", width * ((step - 1) % 2)
        if step == size - 2:
            recv_buf, recv_base = "out", 0  # recv_b is this rank's own block: finish it in place
        else:
            recv_buf, recv_base = "tmp", width * (step % 2)
        for k in range(k_segments):
            slo, shi = segments[send_b][k]
            rlo, rhi = segments[recv_b][k]
            landing = (recv_buf, recv_base + rlo, recv_base + rhi)
            transfer, alone = segment_step(right, (send_buf, send_base + slo, send_base + shi), left, landing, pending)
            if alone is not None:
                yield alone
            if transfer is not None:
                yield transfer
            # Add this rank's share of the segment just received (run while the next one travels).
            mine = ("in", offsets[recv_b] + rlo, offsets[recv_b] + rhi)
            pending = Reduce(landing, mine, op) if rhi > rlo else None
    if pending is not None:
        yield pending
