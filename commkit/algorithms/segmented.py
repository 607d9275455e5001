"""Segmented (pipelined) chains, trees, double trees and rings, and Rabenseifner's reduce.

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

Reductions up a tree, and the double binary tree. A segmented reduce up a
binary tree reduces segment k during the transfer that brings segment k+1.
The double binary tree (as NCCL uses it) cuts the vector in two halves and
runs one half through each of two binary trees at once, built so that every
rank is an inner rank of at most one of them: a rank's two parts, one per
tree, must then share its transfers. These schedules give every message a
global time and post all of a rank's messages of one time in one transfer
(:func:`_lockstep`), which rules out deadlock and bounds the time: their
formulas are upper bounds, the sum over times of the most one rank's step
can cost, exact in the cases their docstrings name.

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
formulas count segments as if elements were 4 bytes (float32). The double
binary tree and the segmented reduce have no closed form for every p and every
α, β, γ: a rank's two trees start and end their pipelines at different times,
a tree whose last level holds one rank has cheaper steps there, and while the
pipeline fills, transfers and reductions alternate on some ranks and overlap
on others. The critical path is irregular, so their formulas are upper bounds
(see above).
"""

from __future__ import annotations

import math

from ..schedule import TRANSFER, Copy, Exchange, Recv, Reduce, Send, Transfer, partition
from . import algorithm, is_pow2, log2ceil
from ._blocks import block_offsets
from .pipelined import COST_ITEMSIZE, SegmentBytes, segment_step, segment_count
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


def _cost_segments(n: float) -> SegmentBytes:
    """The segments of an n-byte vector, as the schedules cut it (4-byte elements)."""
    count = math.ceil(n / COST_ITEMSIZE)
    return SegmentBytes(count, segment_count(count, 1) if count else 0)


# -- pipelined chain broadcast -------------------------------------------------------------------


def _chain_cost(p, n, a, b, g):
    segs = _cost_segments(n)
    if p == 1 or not segs:
        return 0.0
    # The first segment crosses the p-2 links before the last one; the last link then carries
    # all K segments back to back. Segments never grow (partition), so the first is the longest.
    return (p - 2) * (a + segs[0] * b) + len(segs) * a + segs.total() * b


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
    segs = SegmentBytes(count // p, k_segments)

    def hidden(seg, prev):  # every transfer but the first hides the reduction of the segment received before it
        return max(a + seg * b, prev * g)

    return a + segs[0] * b + (p - 2) * segs.sum_pairs(hidden) + segs.sum_pairs(hidden, 1) + segs[-1] * g


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
        return k_segments * a + segs.total() * b  # one child: the chain
    if k_segments == 1:
        return log2ceil(p) * (a + n * b)
    # Every inner rank sends each segment twice (2α + 2sβ a stage); the first segment fills the
    # ⌈log p⌉-2 stages above the last, which then passes all K segments on.
    total = 2 * (log2ceil(p) - 2) * (a + segs[0] * b) + 2 * (k_segments * a + segs.total() * b)
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


# -- pipelines in lockstep: the driver of the segmented reduce and of the double binary tree ----------------------
#
# Every message of these schedules has a global time t: a send and its receive carry the same t,
# and each rank posts its messages of time t together in one transfer, in time order (a time at
# which a rank has no message costs it nothing: it has no transfer then). By induction on t no
# schedule can deadlock: once every transfer before t has completed, every rank posts its transfer
# of time t, whose every message a peer's transfer of the same t matches. A rank that plays two
# parts at once (interior node of one tree and leaf of the other) merges both into its transfers
# the same way; within a transfer, the first tree's messages come before the second's on both
# sides, so that two messages between one pair of ranks match in posting order. The same
# induction bounds the time: all work of time t ends by Σ_{u≤t} C_u, C_u the most any one rank's
# step of time u can cost, which is what the cost formulas below sum.


class _Part:
    """One part a rank plays in a lockstep schedule: its messages and local steps, by global time.

    ``sends(t)`` and ``recvs(t)`` give ``[(peer, range)]``; ``local(t)`` the reductions to run
    during the transfer of time t (alone if the rank has no transfer then). Any of them may be None.
    """

    __slots__ = ("sends", "recvs", "local")

    def __init__(self, sends=None, recvs=None, local=None):
        self.sends = sends
        self.recvs = recvs
        self.local = local


def _lockstep(parts, times):
    """The steps of a rank playing ``parts`` for global times 0 .. times-1: one transfer per busy time.

    The local steps of time t ride in the ``overlap=`` of the transfer of time t; at a time with
    no transfer they run alone, before any transfer of a later time.
    """
    for t in range(times):
        sends, recvs, local = [], [], []
        for part in parts:
            if part.sends is not None:
                sends += part.sends(t)
            if part.recvs is not None:
                recvs += part.recvs(t)
            if part.local is not None:
                local += part.local(t)
        if not sends and not recvs:
            yield from local
        elif len(sends) == 1 and len(recvs) == 1:
            yield Exchange(sends[0][0], sends[0][1], recvs[0][0], recvs[0][1], overlap=local)
        else:
            yield Transfer(sends=sends, recvs=recvs, overlap=local)


def _seg(segs, k):
    """Segment k of ``segs`` as (lo, hi), or None if there is none (k out of range, or an empty segment)."""
    if 0 <= k < len(segs):
        lo, hi = segs[k]
        if hi > lo:
            return lo, hi
    return None


def _at(base, segs, k, name):
    """Segment k of the piece of the vector that starts at ``base``, as a range of buffer ``name`` (or None)."""
    seg = _seg(segs, k)
    return None if seg is None else (name, base + seg[0], base + seg[1])


def _tree_down(parent, kids, first, base, segs, src="out"):
    """A rank's part in a segmented broadcast down one tree.

    It receives segment k from ``parent`` at time first + k and passes it to ``kids`` at time
    first + k + 1; with no parent (the top) it sends segment k of ``src`` at time first + k.
    """

    def recvs(t):
        rng = _at(base, segs, t - first, "out") if parent is not None else None
        return [(parent, rng)] if rng is not None else []

    def sends(t):
        rng = _at(base, segs, t - first - (parent is not None), src)
        return [(c, rng) for c in kids] if rng is not None else []

    return _Part(sends=sends, recvs=recvs)


def _tree_up(parent, kids, first, base, segs, op, width, slot=0):
    """A rank's part in a pipelined reduce up one tree, its children's segment k arriving at time first + k.

    A leaf sends segment k of its input to ``parent`` at time first + k. A rank with children
    receives their segment k at time first + k into ``tmp`` (child i's at (``slot`` + i)·``width``
    plus the segment's offset, so no two segments in flight share scratch), reduces it with its
    input into ``out`` during the transfer of time first + k + 1 (a segment's reduction overlaps
    the next segment's transfer), and sends the result to ``parent`` (if any) at time first + k + 2.
    """
    if not kids:
        def leaf_sends(t):
            rng = _at(base, segs, t - first, "in")
            return [(parent, rng)] if rng is not None else []

        return _Part(sends=leaf_sends)

    def recvs(t):
        seg = _seg(segs, t - first)
        if seg is None:
            return []
        return [(c, ("tmp", (slot + i) * width + seg[0], (slot + i) * width + seg[1])) for i, c in enumerate(kids)]

    def local(t):
        seg = _seg(segs, t - first - 1)
        if seg is None:
            return []
        lo, hi = seg
        into = ("out", base + lo, base + hi)
        landed = [("tmp", (slot + i) * width + lo, (slot + i) * width + hi) for i in range(len(kids))]
        # The children's segments are combined in scratch first, so that the one step that reads
        # the input writes the output only where it reads (in place, "in" is "out"): the steps
        # overlapped with one transfer count as running at once for the data-flow check.
        return [Reduce(landed[0], rng, op) for rng in landed[1:]] + [
            Reduce(into, landed[0], op, src=("in", base + lo, base + hi))]

    def sends(t):
        rng = _at(base, segs, t - first - 2, "out") if parent is not None else None
        return [(parent, rng)] if rng is not None else []

    return _Part(sends=sends, recvs=recvs, local=local)


def _reduce_bound(segs, fill, width, a, b, g):
    """The lockstep bound of a pipelined reduce whose first segment takes ``fill`` + 1 times to reach the top.

    A step sends or receives at most ``width`` segments each way and reduces at most ``width``;
    with one segment transfers and reductions alternate, so they add instead of overlapping.
    """
    head = width * (a + segs[0] * b)
    if len(segs) == 1:
        return (fill // 2 + 1) * (head + width * segs[0] * g)
    return (head + fill * max(head, width * segs[0] * g)
            + segs.sum_pairs(lambda seg, prev: max(width * (a + seg * b), width * prev * g), 1)
            + width * segs[-1] * g)


# -- segmented binary-tree reduce ------------------------------------------------------------------------------


def _tree_reduce_cost(p, n, a, b, g):
    segs = _cost_segments(n)
    if p == 1 or not segs:
        return 0.0
    return _reduce_bound(segs, 2 * (p.bit_length() - 1) - 2, min(2, p - 1), a, b, g)


@algorithm("reduce", "binary_tree_segmented", commutative=True, scratch=lambda r, p, n: 2 * n,
           cost=_tree_reduce_cost,
           formula="upper bound: c(α + s₀β) + (2⌊log p⌋-2)·max(c(α + s₀β), cs₀γ) + Σₖ₌₁..K₋₁ max(c(α + sₖβ), "
                   "csₖ₋₁γ) + cs_{K-1}γ, c = 2 (1 for p = 2), sₖ the bytes of segment k, K ≥ 2; "
                   "⌊log p⌋·c(α + nβ + nγ) when K = 1",
           cost_exact="never", cost_bound="upper")
def reduce_binary_tree_segmented(rank, size, count, op, root, segment=None):
    """Segmented binary-tree reduce: segments go up a binary tree, each reduction overlapping the next transfer.

    The counterpart of ``broadcast_binary_tree_segmented``, on the same tree: relative ranks
    rel = (rank - root) mod p numbered as a heap (children 2rel+1 and 2rel+2, parent (rel-1)//2,
    depth D = ⌊log p⌋).

    Restrictions: commutative op (the heap does not combine ranks in rank order). Any p, root
    and count (count 0 sends nothing).
    Segments: K = ⌈count/S⌉ near-equal segments, S = ``segment`` elements (``algorithm=
    "binary_tree_segmented:64K"``, a selection rule's ``segment_bytes``), else
    ``COMMKIT_SEGMENT_ELEMENTS``, else 65536. Every message has a global time: a rank at depth d
    sends segment k to its parent at time 2(D - d) + k. A leaf sends its input's segment; an
    inner rank receives its children's segment k two times earlier, reduces it with its input
    during the transfer of the next time (which brings segment k + 1: the reduction overlaps
    it), and sends the result on. The root's last reduction runs alone.
    Cost: an upper bound, the lockstep sum of what a step can cost: c(α + s₀β) + (2D-2)·max(
    c(α + s₀β), cs₀γ) + Σₖ₌₁..K₋₁ max(c(α + sₖβ), csₖ₋₁γ) + cs_{K-1}γ, c = 2 (1 for p = 2), sₖ
    the bytes of segment k; D·c(α + nβ + nγ) for K = 1. It is the simulated time when the
    segments are equal, p is not a power of two and the transfers outweigh the reductions
    (α + sβ ≥ sγ); with p a power of two the last level has a single rank and the call is up to
    2(α + s₀β) shorter, and where the reductions dominate it is looser (the fill pays both).
    With many segments that is about 2Kα + 2n·max(β, γ) however large p is, the reductions
    hidden behind the transfers, against the binomial reduce's ⌈log p⌉(α + nβ + nγ).
    Messages: K per rank but the root, each a segment to its parent; n bytes sent per rank.
    Scratch: two vectors (a landing place for each child's segments at their own offsets).
    """
    if size == 1:
        yield Copy(("out", 0, count), ("in", 0, count))
        return
    segs = _segments(count, segment)
    if not segs:
        return
    rel = (rank - root) % size
    kids = [(c + root) % size for c in _tree_children(rel, size)]
    parent = ((rel - 1) // 2 + root) % size if rel else None
    depth = size.bit_length() - 1
    d = (rel + 1).bit_length() - 1
    first = 2 * (depth - d) - (2 if kids else 0)  # when my children's segment 0 arrives (a leaf: when I send it)
    yield from _lockstep([_tree_up(parent, kids, first, 0, segs, op, count)], 2 * depth + len(segs) + 1)


# -- double binary tree -----------------------------------------------------------------------------------------


def inorder_parent(i: int, m: int) -> int:
    """Parent of position ``i`` (1 .. m) in the in-order binary tree over positions 1 .. m; 0 for its root.

    The tree: the position i whose lowest set bit is 2^h has height h; its children are i - 2^(h-1)
    and the largest i + 2^g ≤ m with g < h (none if i = m). Odd positions are the leaves, the root
    is the largest power of two ≤ m, and the depth is ⌊log m⌋; a subtree holds consecutive positions.
    """
    low = i & -i
    if i == 1 << (m.bit_length() - 1):
        return 0
    up = (i ^ low) | (low << 1)  # the parent in the complete tree: i - low or i + low, a multiple of 2·low
    return up if up <= m else i - low


def inorder_children(i: int, m: int) -> list:
    """Children of position ``i`` (1 .. m) in the in-order binary tree of :func:`inorder_parent`, left first."""
    half = (i & -i) >> 1
    if not half:
        return []
    kids = [i - half]
    while half and i + half > m:
        half >>= 1
    if half:
        kids.append(i + half)
    return kids


def _inorder_depth(i: int, m: int) -> int:
    depth = 0
    while True:
        i = inorder_parent(i, m)
        if not i:
            return depth
        depth += 1


def double_tree(j: int, m: int) -> tuple:
    """Where relative rank ``j`` (0 .. m-1) sits in the two trees of the double binary tree over m ranks.

    Tree 0 is the in-order binary tree of :func:`inorder_parent` with j at position j + 1; tree 1
    is the same tree with every rank moved one position down (j at position j, rank 0 at position
    m). Tree 0's inner ranks are the odd j, tree 1's the even j ≥ 2 and, when m is even, 0: every
    rank is an inner rank of at most one tree and a leaf of the other (rank 0 is a leaf of both
    when m is odd). Both trees have depth ⌊log m⌋.

    Args:
        j: the relative rank, 0 ≤ j < m.
        m: the number of ranks in the trees, m ≥ 1.

    Returns:
        Two ``(parent, children, depth)``, one per tree: the parent's relative rank (-1 at the
        top of the tree), the children's relative ranks (left first) and the depth (0 at the top).
    """
    out = []
    for shift in (1, 0):  # tree 0: position j + 1; tree 1: position (j - 1) mod m, plus one
        pos = (j + shift - 1) % m + 1
        up = inorder_parent(pos, m)
        kids = [(c - shift) % m for c in inorder_children(pos, m)]
        out.append(((up - shift) % m if up else -1, kids, _inorder_depth(pos, m)))
    return tuple(out)


def _double_tree_ranks(j, m, rank_of):
    """Both trees' (parent rank or None, children's ranks, depth) for relative rank j, as real ranks."""
    return [(None if up < 0 else rank_of(up), [rank_of(c) for c in kids], depth)
            for up, kids, depth in double_tree(j, m)]


def _tree_tops(m, rank_of):
    """The real ranks at the top of tree 0 and of tree 1 of the double binary tree over m ranks."""
    top = 1 << (m.bit_length() - 1)
    return rank_of(top - 1), rank_of(top % m)


def _halves(count: int, segment: int | None) -> tuple:
    """The two halves of a vector and their segments: ((0, segments), (h, segments)), h = ⌈count/2⌉.

    Both halves are cut into the same K = ⌈h/S⌉ near-equal segments, so segment k of half 1 is as
    long as segment k of half 0 or one element shorter; it is empty only when half 1 has fewer
    than K elements (S = 1 and count odd, or count 1), and an empty segment sends nothing.
    """
    h = (count + 1) // 2
    k_segments = segment_count(h, 1, segment) if h else 0
    if not k_segments:
        return (0, ()), (h, ())
    return (0, partition(h, k_segments)), (h, partition(count - h, k_segments))


def _half_cost_segments(n: float) -> SegmentBytes:
    """The segments of the larger half of an n-byte vector, as :func:`_halves` cuts it (4-byte elements)."""
    h = (math.ceil(n / COST_ITEMSIZE) + 1) // 2
    return SegmentBytes(h, segment_count(h, 1) if h else 0)


def _double_bcast_cost(p, n, a, b, g):
    segs = _half_cost_segments(n)
    if p == 1 or not segs:
        return 0.0
    depth = (p - 1).bit_length() - 1
    return 2 * (depth + len(segs)) * a + 2 * (depth * segs[0] + segs.total()) * b


@algorithm("broadcast", "double_binary_tree", cost=_double_bcast_cost,
           formula="upper bound: 2(D + K)α + 2(Ds₀ + h)β, D = ⌊log(p-1)⌋, K segments per half, s₀ the bytes of "
                   "the first (longest) segment of the larger half and h its bytes (n/2 for an even count): "
                   "about 2(D + K)α + nβ",
           cost_exact="never", cost_bound="upper")
def broadcast_double_binary_tree(rank, size, count, root, segment=None):
    """Double binary tree broadcast: half the vector down each of two trees, in segments.

    Trees: the double binary tree (NCCL's tree algorithms use one), over the p-1 ranks other than
    the root (relative rank j = rel - 1, rel = (rank - root) mod p; :func:`double_tree`). Tree 0
    is the in-order binary tree of :func:`inorder_parent` (the odd j are its inner ranks), tree 1
    the same tree with every rank moved one place (the even j are). Every rank is an inner rank
    of at most one tree and a leaf of the other, so it receives from one parent per tree and
    sends to at most two children in all: where one binary tree has its inner ranks send every
    byte twice while its leaves (half the ranks) send nothing, here every rank's link carries
    about n bytes each way, in both trees at once.
    Halves and segments: half 0, [0, ⌈c/2⌉), goes down tree 0 and the rest down tree 1, each cut
    into the same K = ⌈⌈c/2⌉/S⌉ near-equal segments, S = ``segment`` elements
    (``algorithm="double_binary_tree:64K"``, a selection rule's ``segment_bytes``), else
    ``COMMKIT_SEGMENT_ELEMENTS``, else 65536. Every message has a global time, the same on both
    sides: the root sends segment k of each half to the top of its tree at time k, straight from
    its input (copying its input to its output alongside the first transfer, skipped in place);
    a rank at depth d of a tree receives segment k at time d + k and passes it to its children at
    time d + k + 1. A rank sends and receives all its messages of one time, in both trees, in one
    transfer, so neither tree waits for the other and nothing can deadlock.
    Restrictions: none; every root, every count (count 0 sends nothing).
    Cost: an upper bound, the lockstep sum of what a step can cost (two messages each way):
    2(D + K)α + 2(Ds₀ + h)β, D = ⌊log(p-1)⌋ the trees' depth, s₀ the bytes of the first
    (longest) segment of the larger half and h its bytes: about 2(D + K)α + nβ + 2Ds₀β. It is the
    simulated time when p-1 is not a power of two, K ≥ 2 and the segments are equal; with one
    segment per half it is up to twice the simulated time. Against ``binary_tree_segmented``'s
    2(⌈log p⌉ - 2)(α + s₀β) + 2(Kα + nβ), the bandwidth term is nβ instead of 2nβ, for K
    segments per half where the single tree cuts the whole vector into K.
    Messages: K to each of its children in its inner tree (fewer where half 1 has empty
    segments), none from a leaf of both; the root sends 2K, one per segment, n bytes in all.
    """
    whole = ("out", 0, count)
    halves = _halves(count, segment)
    k_segments = len(halves[0][1])
    rel = (rank - root) % size
    m = size - 1

    def rank_of(j):
        return (j + 1 + root) % size

    if rel == 0:
        copy = (Copy(whole, ("in", 0, count)),)
        if size == 1 or not k_segments:
            yield from copy
            return
        # Segment k of each half goes to the top of its tree at time k, straight from the input;
        # the copy into my own output rides along with the first transfer (nothing to copy in place).
        parts = [_tree_down(None, [top], 0, base, segs, src="in")
                 for top, (base, segs) in zip(_tree_tops(m, rank_of), halves)]
        parts.append(_Part(local=lambda t: copy if t == 0 else ()))
        yield from _lockstep(parts, k_segments)
        return
    if not k_segments:
        return
    # A rank at depth d of a tree receives segment k of that tree's half at time d + k.
    parts = [_tree_down(root if up is None else up, kids, d, base, segs)
             for (up, kids, d), (base, segs) in zip(_double_tree_ranks(rel - 1, m, rank_of), halves)]
    yield from _lockstep(parts, (m.bit_length() - 1) + k_segments + 1)


def _double_reduce_cost(p, n, a, b, g):
    segs = _half_cost_segments(n)
    if p == 1 or not segs:
        return 0.0
    return _reduce_bound(segs, 2 * ((p - 1).bit_length() - 1), 2, a, b, g)


@algorithm("reduce", "double_binary_tree", commutative=True, scratch=lambda r, p, n: 2 * ((n + 1) // 2),
           cost=_double_reduce_cost,
           formula="upper bound: 2(α + s₀β) + 2D·max(2α + 2s₀β, 2s₀γ) + Σₖ₌₁..K₋₁ max(2α + 2sₖβ, 2sₖ₋₁γ) + "
                   "2s_{K-1}γ, D = ⌊log(p-1)⌋, sₖ the bytes of segment k of the larger half, K ≥ 2; "
                   "2(D+1)(α + s₀β + s₀γ) when K = 1",
           cost_exact="never", cost_bound="upper")
def reduce_double_binary_tree(rank, size, count, op, root, segment=None):
    """Double binary tree reduce: half the vector up each of two trees, in segments, reductions overlapped.

    Trees: the double binary tree (NCCL's tree algorithms use one), over the p-1 ranks other than
    the root (relative rank j = rel - 1, rel = (rank - root) mod p; :func:`double_tree`). Tree 0
    is the in-order binary tree of :func:`inorder_parent` (the odd j are its inner ranks), tree 1
    the same tree with every rank moved one place (the even j are). Every rank is an inner rank
    of at most one tree and a leaf of the other, so it sends to one parent per tree and receives
    from at most two children in all: every rank's link carries about n bytes each way, in both
    trees at once, where a single binary tree receives 2n at its inner ranks and nothing at its
    leaves. The tops of both trees send their results to the root.
    Halves and segments: half 0, [0, ⌈c/2⌉), is reduced up tree 0 and the rest up tree 1, each cut
    into the same K = ⌈⌈c/2⌉/S⌉ near-equal segments, S = ``segment`` elements
    (``algorithm="double_binary_tree:64K"``, a selection rule's ``segment_bytes``), else
    ``COMMKIT_SEGMENT_ELEMENTS``, else 65536. Every message has a global time, the same on both
    sides: a rank at depth d of a tree sends segment k of that tree's half up at time 2(D - d) + k,
    D = ⌊log(p-1)⌋. A leaf sends its input's segment; an inner rank receives its children's two
    times earlier and reduces them with its input during the transfer of the time between (which
    brings the next segment: each reduction overlaps a transfer). The root receives segment k of
    both halves at time 2D + k and reduces them into its output while the next arrive; its last
    reductions run alone. A rank sends and receives all its messages of one time, in both trees,
    in one transfer, so neither tree waits for the other and nothing can deadlock.
    Restrictions: commutative op (the trees combine ranks out of rank order). Any p, root and
    count (count 0 sends nothing).
    Cost: an upper bound, the lockstep sum of what a step can cost (two messages each way, two
    segments reduced): 2(α + s₀β) + 2D·max(2α + 2s₀β, 2s₀γ) + Σₖ₌₁..K₋₁ max(2α + 2sₖβ, 2sₖ₋₁γ) +
    2s_{K-1}γ, sₖ the bytes of segment k of the larger half (n/2K for equal segments), K ≥ 2;
    2(D + 1)(α + s₀β + s₀γ) when K = 1. For equal segments s and transfers that outweigh the
    reductions (α + sβ ≥ sγ) that is 2(2D + K)(α + sβ) + 2sγ, the simulated time when p-1 is not
    a power of two; it is looser where the reductions dominate. The bandwidth and reduction terms are about
    n(β + γ), against the binomial reduce's ⌈log p⌉n(β + γ).
    Messages: K per tree per rank but the root, each a segment of that tree's half to its parent
    there (fewer where half 1 has empty segments): n bytes sent per rank.
    Scratch: ⌈c/2⌉ elements for each of two children (the root: one per tree), every segment at
    its own offset.
    """
    if size == 1:
        yield Copy(("out", 0, count), ("in", 0, count))
        return
    halves = _halves(count, segment)
    k_segments = len(halves[0][1])
    if not k_segments:
        return
    width = (count + 1) // 2
    rel = (rank - root) % size
    m = size - 1
    depth = m.bit_length() - 1
    times = 2 * depth + k_segments + 2

    def rank_of(j):
        return (j + 1 + root) % size

    if rel == 0:
        # The tops of both trees send me segment k at time 2D + k (tree t's into tmp slot t).
        parts = [_tree_up(None, [top], 2 * depth, base, segs, op, width, slot=tree)
                 for tree, (top, (base, segs)) in enumerate(zip(_tree_tops(m, rank_of), halves))]
        yield from _lockstep(parts, times)
        return
    parts = []
    for (up, kids, d), (base, segs) in zip(_double_tree_ranks(rel - 1, m, rank_of), halves):
        # A rank at depth d sends segment k up at time 2(D - d) + k; its children sent theirs 2 earlier.
        first = 2 * (depth - d) - (2 if kids else 0)
        parts.append(_tree_up(root if up is None else up, kids, first, base, segs, op, width))
    yield from _lockstep(parts, times)


def _double_allreduce_cost(p, n, a, b, g):
    segs = _half_cost_segments(n)
    if p == 1 or not segs:
        return 0.0
    depth = p.bit_length() - 1
    k_segments = len(segs)
    link = a + segs[0] * b
    if k_segments == 1:
        # Up: transfers and reductions alternate, D of each; down: D transfers.
        return depth * (4 * link + 2 * segs[0] * g)
    both = min(p, 4)  # messages each way of a step that moves segments up and down at once
    return (2 * link + (2 * depth - 1) * max(2 * link, 2 * segs[0] * g)
            + segs.sum(lambda seg: max(both * link, 2 * seg * g), 1, k_segments - 1)
            + max(2 * link, 2 * segs[-1] * g) + 2 * depth * link)


@algorithm("allreduce", "double_binary_tree", commutative=True, scratch=lambda r, p, n: 2 * ((n + 1) // 2),
           cost=_double_allreduce_cost,
           formula="upper bound: 2(α + s₀β) + (2D-1)·max(2α + 2s₀β, 2s₀γ) + Σₖ₌₁..K₋₂ max(q(α + s₀β), 2sₖγ) + "
                   "max(2α + 2s₀β, 2s_{K-1}γ) + 2D(α + s₀β), D = ⌊log p⌋, q = min(p, 4), sₖ the bytes of segment "
                   "k of the larger half, K ≥ 2; D(4α + 4s₀β + 2s₀γ) when K = 1",
           cost_exact="never", cost_bound="upper")
def allreduce_double_binary_tree(rank, size, count, op, segment=None):
    """Double binary tree allreduce: each half reduced up its tree and broadcast back down, pipelined.

    Trees: the double binary tree (NCCL's tree algorithms use one), over all p ranks
    (:func:`double_tree`). Tree 0 is the in-order binary tree of :func:`inorder_parent` (the odd
    ranks are its inner ranks), tree 1 the same tree with every rank moved one place (the even
    ones are). Every rank is an inner rank of at most one tree and a leaf of the other, so every
    rank's link carries about 2n bytes each way in all, in both trees at once.
    Halves and segments: half 0, [0, ⌈c/2⌉), is reduced up tree 0 and broadcast back down it, the
    rest up and down tree 1, each cut into the same K = ⌈⌈c/2⌉/S⌉ near-equal segments,
    S = ``segment`` elements (``algorithm="double_binary_tree:64K"``, a selection rule's
    ``segment_bytes``), else ``COMMKIT_SEGMENT_ELEMENTS``, else 65536. Every message has a global
    time, the same on both sides. Up, as in ``reduce_double_binary_tree``: a rank at depth d sends
    segment k to its parent at time 2(D - d) + k, D = ⌊log p⌋, after reducing its children's
    segment k with its input during the transfer before (each reduction overlaps a transfer).
    Down, as soon as a tree's top has reduced segment k it sends it back down at time 2D + k; a
    rank at depth d receives it at time 2D + d - 1 + k and passes it on at the next time, while
    later segments are still on their way up (NCCL's tree allreduce pipelines the same way). A
    rank's partial result of a segment has gone up before the final one comes down into the same
    place. A rank sends and receives all its messages of one time, in both trees and both
    directions, in one transfer, so nothing waits for more than it must and nothing can deadlock.
    Restrictions: commutative op (the trees combine ranks out of rank order). Any p and count
    (count 0 sends nothing).
    Cost: an upper bound, the lockstep sum of what a step can cost (two messages each way while
    segments only go up or only down, q = min(p, 4) while both): 2(α + s₀β) + (2D - 1)·max(2α +
    2s₀β, 2s₀γ) + Σₖ₌₁..K₋₂ max(q(α + s₀β), 2sₖγ) + max(2α + 2s₀β, 2s_{K-1}γ) + 2D(α + s₀β), sₖ
    the bytes of segment k of the larger half, K ≥ 2; D(4α + 4s₀β + 2s₀γ) when K = 1. For equal
    segments s = n/2K and cheap reductions that is (4K + 6D - 6)(α + sβ) (p ≥ 4): the bandwidth
    term 2nβ is the ring's 2((p-1)/p)nβ, with 4K + 6D latency terms instead of 2(p - 1). Without
    reduction costs the simulated time lies 0 to (D + 2)(α + sβ) below it for p ≥ 4 and K ≥ 2
    (3(α + sβ) once K is large against D); with one segment per half the bound is up to twice
    the simulated time, and where the reductions dominate it is looser.
    Messages: K per tree up to the parent (none from a tree's top) and K to each child in the
    rank's inner tree (fewer where half 1 has empty segments).
    Scratch: ⌈c/2⌉ elements for each of two children, every segment at its own offset.
    """
    if size == 1:
        yield Copy(("out", 0, count), ("in", 0, count))
        return
    halves = _halves(count, segment)
    k_segments = len(halves[0][1])
    if not k_segments:
        return
    width = (count + 1) // 2
    depth = size.bit_length() - 1
    parts = []
    for (up, kids, d), (base, segs) in zip(_double_tree_ranks(rank, size, lambda j: j), halves):
        # Up as in reduce_double_binary_tree: a rank at depth d sends segment k up at time 2(D - d) + k.
        first = 2 * (depth - d) - (2 if kids else 0)
        parts.append(_tree_up(up, kids, first, base, segs, op, width))
        # Down again: the top sends segment k at time 2D + k, a rank at depth d receives it at 2D + d - 1 + k.
        parts.append(_tree_down(up, kids, 2 * depth + d - (up is not None), base, segs))
    yield from _lockstep(parts, 3 * depth + k_segments + 1)
