"""Segmented (pipelined) chains, trees and rings, and Rabenseifner's reduce.

Why segments. A chain or tree broadcast that forwards the whole vector makes
every rank wait for all n bytes before it passes on the first: depth x nβ.
Cut into K segments, a rank forwards segment k-1 while it receives segment k
(one :class:`~commkit.schedule.Exchange`, or one
:class:`~commkit.schedule.Transfer` with a send per child), so the depth is
paid once per segment instead of once per vector: (depth + K - 1) segments'
time instead of depth vectors' time (MPICH and Open MPI segment their chain
and binary-tree broadcasts the same way). The pipelined ring reduce-scatter
reduces segment k in the ``overlap=`` of the exchange that brings segment
k+1, as the pipelined ring allreduce of :mod:`.pipelined` does, with its
helpers. Rabenseifner's reduce (recursive halving, then a binomial gather)
lives here as the large-message reduce beside them; it cuts no segments.

Segment size. The schedules' ``segment`` argument (``algorithm="chain_pipelined:256K"``
or a selection rule's ``segment_bytes``, see :mod:`commkit.selection`), else
:func:`.pipelined.segment_elements` (``COMMKIT_SEGMENT_ELEMENTS``, default 65536
elements), read when a schedule is generated; plans cache a call
shape's schedule, so set it before a shape's first call. The broadcasts cut a
vector of c elements into K = ⌈c/S⌉ near-equal segments
(:func:`.pipelined.segment_count` with one block; the first c mod K are one
element longer), so none is empty; the reduce-scatter cuts every block into the
same K, and skips the empty segments of short blocks. No message is ever sent
for nothing; count 0 sends nothing at all.

Costs. The registered formulas are the simulator's model (:mod:`commkit.sim`)
of the schedules below: a transfer of k messages costs kα + β x max(bytes
sent, bytes received) once the peers have posted, an overlapped reduction runs
beside it. As in :mod:`.pipelined`, the model knows bytes, not dtypes, so the
formulas count segments as if elements were 4 bytes (float32).
"""

from __future__ import annotations

import math

from ..schedule import TRANSFER, Copy, Exchange, Recv, Reduce, Send, Transfer, partition
from . import algorithm, is_pow2, log2ceil
from .pipelined import COST_ITEMSIZE, segment_step, segment_count
from .recursive_halving import (
    fold,
    halving_reduce_scatter,
    lg,
    new_rank,
    old_rank,
    span,
)


def _segments(count: int, segment: int | None = None) -> tuple:
    """The (lo, hi) segments a vector of ``count`` elements is cut into (none when count is 0).

    ``segment``: the segment size in elements (None: :func:`.pipelined.segment_elements`'s default).
    """
    return partition(count, segment_count(count, 1, segment)) if count else ()


def _cost_segments(n: float) -> list:
    """Bytes of each segment of an n-byte vector, as the schedules cut it (4-byte elements)."""
    count = math.ceil(n / COST_ITEMSIZE)
    return [(hi - lo) * COST_ITEMSIZE for lo, hi in _segments(count)]


# -- pipelined chain broadcast -------------------------------------------------------------------


def _chain_cost(p, n, a, b, g):
    segs = _cost_segments(n)
    if p == 1 or not segs:
        return 0.0
    # The first segment crosses the p-2 links before the last one; the last link then carries
    # all K segments back to back. Segments never grow (partition), so the first is the longest.
    return (p - 2) * (a + segs[0] * b) + len(segs) * a + sum(segs) * b


@algorithm("broadcast", "chain_pipelined", cost=_chain_cost,
           formula="(p-2)(α + s₀β) + Kα + nβ, s₀ the bytes of the first (longest) segment; "
                   "(p+K-2)(α + nβ/K) for equal segments")
def broadcast_chain_pipelined(rank, size, count, root, segment=None):
    """Pipelined chain broadcast: root -> root+1 -> ... -> root-1, the vector cut into K segments.

    Restrictions: none; every root, every count (count 0 sends nothing).
    Segments: K = ⌈count/S⌉, S = ``COMMKIT_SEGMENT_ELEMENTS`` or 65536 elements, near-equal
    (the first count mod K one element longer). A rank inside the chain receives segment 0,
    then in each of K-1 exchanges forwards segment k-1 while it receives segment k, then
    forwards segment K-1: K+1 transfers, so the pipeline fills once and every link is busy.
    Cost: (p-2)(α + s₀β) + Kα + nβ, s₀ the bytes of the first (longest) segment: the first
    segment crosses p-2 links, then the last link carries all K segments; for equal segments
    (p + K - 2)(α + nβ/K), against the unsegmented chain's (p-1)(α + nβ). Exact for every p
    and count. Messages: K per rank except the last of the chain, which sends none; each
    carries one segment to the next rank (n bytes sent per rank).
    In place (out is the input, at the root): the root sends from "in" and copies "in" to
    "out" only in the copy the executor skips when they are one array, so no copy of the
    input is needed.
    """
    whole = ("out", 0, count)
    segs = _segments(count, segment)
    rel = (rank - root) % size
    if rel == 0:
        # The root sends every segment straight from its input; the copy into its own output
        # rides along with the first send (there is nothing to copy in place).
        copy = (Copy(whole, ("in", 0, count)),)
        if size == 1 or not segs:
            yield from copy
            return
        nxt = (rank + 1) % size
        for k, (lo, hi) in enumerate(segs):
            yield Send(nxt, ("in", lo, hi), overlap=copy if k == 0 else ())
        return
    if not segs:
        return
    prev = (rank - 1) % size
    if rel == size - 1:
        # The end of the chain only receives.
        for lo, hi in segs:
            yield Recv(prev, ("out", lo, hi))
        return
    nxt = (rank + 1) % size
    yield Recv(prev, ("out", *segs[0]))
    for k in range(1, len(segs)):
        # Forward segment k-1 to the next rank while segment k arrives from the previous one.
        yield Exchange(nxt, ("out", *segs[k - 1]), prev, ("out", *segs[k]))
    yield Send(nxt, ("out", *segs[-1]))


# -- pipelined ring reduce-scatter ----------------------------------------------------------------


def _ring_reduce_scatter_cost(p, n, a, b, g):
    count = math.ceil(n / COST_ITEMSIZE)
    k_segments = segment_count(count, p)
    if p == 1 or k_segments == 0:
        return 0.0
    if k_segments == 1:
        # Nothing to overlap: the ring's p-1 transfers, each followed by its reduction.
        return (p - 1) * a + (p - 1) / p * n * (b + g)
    segs = [(hi - lo) * COST_ITEMSIZE for lo, hi in partition(count // p, k_segments)]
    # Every transfer but the first hides the reduction of the segment received just before it.
    hidden = [max(a + segs[k] * b, segs[k - 1] * g) for k in range(k_segments)]
    return a + segs[0] * b + (p - 2) * sum(hidden) + sum(hidden[1:]) + segs[-1] * g


@algorithm("reduce_scatter", "ring_pipelined", commutative=True, scratch=lambda r, p, counts: 2 * max(counts),
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
    """
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
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


# -- Rabenseifner's reduce: recursive-halving reduce-scatter, then binomial gather ------------------


def _relabelled(steps, rank_of):
    """The steps of a schedule written for relative ranks, every peer turned into a real rank.

    Only exchanges are expected (the recursive halving of :mod:`.recursive_halving`).
    """
    for step in steps:
        if step.kind == TRANSFER:
            assert isinstance(step, Exchange), step
            (to, send), (frm, recv) = step.sends[0], step.recvs[0]
            yield Exchange(rank_of(to), send, rank_of(frm), recv, overlap=step.overlap)
        else:
            yield step


def _rabenseifner_reduce_cost(p, n, a, b, g):
    if p == 1 or n <= 0:
        return 0.0
    rounds = lg(p)
    pof2 = 1 << rounds
    folding = 0.0 if pof2 == p else a + n * b + n * g
    return folding + 2 * rounds * a + (pof2 - 1) / pof2 * n * (2 * b + g)


@algorithm("reduce", "rabenseifner", commutative=True, scratch=lambda r, p, n: n,
           cost=_rabenseifner_reduce_cost,
           formula="2⌊log p⌋α + ((p'-1)/p')n(2β+γ) (+ α+nβ+nγ when p ≠ p'); p' = 2^⌊log p⌋",
           cost_exact="even", cost_bound="lower")
def reduce_rabenseifner(rank, size, count, op, root):
    """Rabenseifner's reduce: a recursive-halving reduce-scatter, then a binomial gather of the blocks to the root.

    Restrictions: commutative op. Any p, root and count.
    Ranks are taken relative to the rank after the root, rel = (rank - root - 1) mod p, so the
    root is rel p-1, which MPICH's fold of a non-power-of-two p never sets aside: with
    p' = 2^⌊log p⌋ and r = p - p', each even rel < 2r first hands its vector to the odd rel
    above it and sits out (:mod:`.recursive_halving`); the p' others reduce-scatter by recursive
    halving, new rank i ending with block i of p', and gather the blocks towards new rank p'-1
    (the root), a doubling range each round.
    Cost: 2⌊log p⌋α + ((p'-1)/p')n(2β + γ), plus α + nβ + nγ for the fold when p ≠ p'; exact
    when count is a multiple of p', a lower bound otherwise. Against the binomial reduce's
    ⌈log p⌉(α + nβ + nγ) it moves and reduces about n bytes per rank instead of n⌈log p⌉:
    the large-message reduce.
    Messages: the fold's one, ⌊log p⌋ exchanges, then at most ⌊log p⌋ gather messages on the
    root's side (one send for every other rank of the p'); ranges of a count below p' may be
    empty, and the halving's exchanges then carry no elements.
    """
    whole, incoming, mine = ("out", 0, count), ("tmp", 0, count), ("in", 0, count)
    if size == 1:
        yield Copy(whole, mine)
        return
    if count == 0:
        return

    def rank_of(rel):
        return (rel + root + 1) % size

    rel = (rank - root - 1) % size
    pof2, rem = fold(size)
    new = new_rank(rel, rem)
    first = "in"
    if rel < 2 * rem:
        if new < 0:
            # Even rel of a folded pair: my partner above reduces for both of us.
            yield Send(rank_of(rel + 1), mine)
            return
        yield Recv(rank_of(rel - 1), incoming)
        yield Reduce(whole, incoming, op, src=mine)
        first = "out"
    ranges = partition(count, pof2)
    # Phase 1: reduce-scatter by recursive halving; new rank i then owns ranges[i] of "out".
    yield from _relabelled(halving_reduce_scatter(new, pof2, rem, ranges, "out", op, first), rank_of)
    # Phase 2: binomial gather towards new rank p'-1 (the root): each round the ranks whose bit is
    # clear hand everything they hold to the partner across that bit, which holds the adjacent range.
    mask = 1
    while mask < pof2:
        low = new & ~(2 * mask - 1)  # first new rank of my pair of groups
        below = span(ranges, low, low + mask)
        partner = rank_of(old_rank(new ^ mask, rem))
        if below[1] > below[0]:  # (a count below p' leaves some ranges empty: nothing to send)
            yield (Recv if new & mask else Send)(partner, ("out", *below))
        if not new & mask:
            return
        mask <<= 1


# -- segmented binary tree --------------------------------------------------------------------------


def _tree_children(rel: int, size: int) -> list:
    """Children of relative rank ``rel`` in the binary tree numbered as a heap: 2rel+1 and 2rel+2."""
    return [c for c in (2 * rel + 1, 2 * rel + 2) if c < size]


def _tree_bcast_cost(p, n, a, b, g):
    segs = _cost_segments(n)
    k_segments = len(segs)
    if p == 1 or not segs:
        return 0.0
    if p == 2:
        return k_segments * a + sum(segs) * b  # one child: the chain
    if k_segments == 1:
        return log2ceil(p) * (a + n * b)
    # Every inner rank sends each segment twice (2α + 2sβ a stage); the first segment fills the
    # ⌈log p⌉-2 stages above the last, which then passes all K segments on.
    total = 2 * (log2ceil(p) - 2) * (a + segs[0] * b) + 2 * (k_segments * a + sum(segs) * b)
    if is_pow2(p):
        # The last rank hangs alone below a one-child rank, whose exchange costs the longer segment.
        total += (segs[-2] - segs[-1]) * b
    return total


@algorithm("broadcast", "binary_tree_segmented", cost=_tree_bcast_cost,
           formula="2(⌈log p⌉-2)(α + s₀β) + 2(Kα + nβ) (+ (s_{K-2} - s_{K-1})β for p a power of two), "
                   "s₀ the first (longest) segment, K ≥ 2, p ≥ 3; ⌈log p⌉(α + nβ) when K = 1; "
                   "Kα + nβ for p = 2")
def broadcast_binary_tree_segmented(rank, size, count, root, segment=None):
    """Segmented binary-tree broadcast: segments flow down a binary tree, each rank forwarding k while k+1 arrives.

    Restrictions: none; every root, every count (count 0 sends nothing).
    Tree: relative ranks rel = (rank - root) mod p numbered as a heap (Open MPI's binary tree):
    rel's children are 2rel+1 and 2rel+2, its parent (rel-1)//2; depth ⌊log p⌋.
    Segments: K = ⌈count/S⌉, S = ``COMMKIT_SEGMENT_ELEMENTS`` or 65536 elements, near-equal.
    An inner rank receives segment 0, then in K-1 transfers sends segment k-1 to both children
    while segment k arrives, then sends segment K-1: K+1 transfers. The root sends straight
    from its input and copies it to its output alongside the first send (skipped in place).
    Cost, K ≥ 2 and p ≥ 3: 2(⌈log p⌉-2)(α + s₀β) + 2(Kα + nβ), plus (s_{K-2} - s_{K-1})β when
    p is a power of two, s₀ the bytes of the first (longest) segment: a stage sends each
    segment to two children (2α + 2sβ), and the pipeline fills once. K = 1: ⌈log p⌉(α + nβ).
    p = 2: the chain's Kα + nβ. Exact for every p and count. Against the binomial tree's
    ⌈log p⌉(α + nβ), the bandwidth term stays about 2nβ however large p is.
    Messages: K to each child (2K from a rank with two children), none from a leaf.
    """
    segs = _segments(count, segment)
    rel = (rank - root) % size
    kids = [(c + root) % size for c in _tree_children(rel, size)]
    if rel == 0:
        copy = (Copy(("out", 0, count), ("in", 0, count)),)
        if not kids or not segs:
            yield from copy
            return
        for k, (lo, hi) in enumerate(segs):
            # Every segment goes to both children at once, straight from the root's input.
            yield Transfer(sends=[(c, ("in", lo, hi)) for c in kids], overlap=copy if k == 0 else ())
        return
    if not segs:
        return
    parent = ((rel - 1) // 2 + root) % size
    if not kids:
        for lo, hi in segs:
            yield Recv(parent, ("out", lo, hi))
        return
    yield Recv(parent, ("out", *segs[0]))
    for k in range(1, len(segs)):
        # Pass segment k-1 to my children while segment k arrives from my parent.
        yield Transfer(sends=[(c, ("out", *segs[k - 1])) for c in kids], recvs=[(parent, ("out", *segs[k]))])
    yield Transfer(sends=[(c, ("out", *segs[-1])) for c in kids])
