"""Segmented binary trees, and the pipelines through trees that the double binary tree shares.

Why a binary tree. A chain pays p - 1 links for the first segment; a binary
tree numbered as a heap (Open MPI's binary tree: relative rank j's children
are 2j+1 and 2j+2) pays ⌊log p⌋, at the price of every inner rank sending each
segment twice. Segments are cut by :func:`.pipelined.segments` (the schedules'
``segment`` argument, else ``COMMKIT_SEGMENT_ELEMENTS``, else 65536 elements).

Pipelines through a tree, tick by tick. A rank's part in one tree is a plain
generator, :func:`tree_down` (a broadcast) or :func:`tree_up` (a reduction),
that yields one :class:`~commkit.schedule.Transfer` per tick, empty when it has
nothing to do then: at tick k an inner rank of a reduction receives its
children's segment k, reduces segment k-1 in the transfer's ``overlap=`` (the
reduction runs while segment k is on the wire, as the pipelined ring of
:mod:`.pipelined` does), and sends segment k-2 to its parent. A send and its
receive happen at the same tick on both sides. :func:`together` turns a
rank's parts into its steps: each tick's messages of all its parts in one
transfer, and nothing for an idle tick. A rank of a single tree has one part;
a rank of the double binary tree (:mod:`.double_tree`) an inner part in one
tree and a leaf part in the other, posted together so that neither tree waits
for the other.

By induction on the tick nothing can deadlock: once every transfer before
tick t has completed, every rank posts its transfer of tick t, whose every
message a peer's transfer of the same tick matches (within a transfer, the
parts' messages keep the parts' order on both sides, so two messages between
one pair of ranks match in posting order). The same induction bounds the
time: all work of tick t ends by Σ_{u≤t} C_u, C_u the most any one rank's
step of tick u can cost, which is what the reductions' cost formulas sum
(:func:`reduce_bound`).
"""

from __future__ import annotations

import itertools

from ..schedule import Copy, Exchange, Recv, Reduce, Transfer
from . import algorithm, is_pow2, log2ceil
from .pipelined import cost_segments, segments

__all__ = ["broadcast_binary_tree_segmented", "reduce_binary_tree_segmented", "tree_down", "tree_up", "together",
           "reduce_bound"]


# -- segmented binary-tree broadcast ---------------------------------------------------------------------------


def _tree_children(rel: int, size: int) -> list:
    """Children of relative rank ``rel`` in the binary tree numbered as a heap: 2rel+1 and 2rel+2."""
    return [c for c in (2 * rel + 1, 2 * rel + 2) if c < size]


def _tree_bcast_cost(p, n, a, b, g):
    segs = cost_segments(n)
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

    Picture, generated from the schedule (p = 4, count = 8, root = 0, segment = 2): each cell lists, for
    every block of the result, the ranks whose input that rank holds for the whole block (- for none),
    after each round. Redrawn by ``python -m commkit.algorithms._diagram --write``::

        round       rank 0   rank 1   rank 2   rank 3
        0           0 0 0 0  - - - -  - - - -  - - - -
        1           0 0 0 0  0 - - -  0 - - -  - - - -
        2           0 0 0 0  0 0 - -  0 0 - -  0 - - -
        3           0 0 0 0  0 0 0 -  0 0 0 -  0 0 - -
        4           0 0 0 0  0 0 0 0  0 0 0 0  0 0 0 -
        5           0 0 0 0  0 0 0 0  0 0 0 0  0 0 0 0
        msgs sent   8        4        0        0
        elems sent  16       8        0        0
        critical path (commkit.sim, each term alone): 8 messages, 16 elements sent
    """
    segs = segments(count, segment)
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


# -- pipelines through a tree, one transfer per tick -------------------------------------------------------------

_IDLE = Transfer()


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


def tree_down(parent, kids, first, base, segs, src="out"):
    """A rank's part in a segmented broadcast down one tree: one transfer per tick (see :func:`together`).

    It receives segment k from ``parent`` at tick first + k and passes it to ``kids`` at tick
    first + k + 1; with no parent (the top) it sends segment k of ``src`` at tick first + k.
    ``segs`` are the segments of the piece of the vector that starts at element ``base``.
    """
    lag = 0 if parent is None else 1
    # Segment k as (lo, hi) of the whole vector, or None when empty (computed once: a simulation at
    # 65,536 ranks asks for every rank's ticks).
    at = [(base + lo, base + hi) if hi > lo else None for lo, hi in segs]
    n = len(at)
    for _ in range(first):
        yield _IDLE
    for k in range(n + lag):
        got = at[k] if parent is not None and k < n else None
        passed = at[k - lag] if k >= lag else None
        if got is None and passed is None:
            yield _IDLE
            continue
        # Pass the segment received last tick on to my children while the next one arrives.
        yield Transfer(sends=[(c, (src, *passed)) for c in kids] if passed is not None else (),
                       recvs=[(parent, ("out", *got))] if got is not None else ())


def tree_up(parent, kids, first, base, segs, op, width, slot=0):
    """A rank's part in a pipelined reduce up one tree: one transfer per tick (see :func:`together`).

    A leaf sends segment k of its input to ``parent`` at tick first + k. A rank with children
    receives their segment k at tick first + k into ``tmp`` (child i's at (``slot`` + i)·``width``
    plus the segment's offset, so no two segments in flight share scratch), reduces it with its
    input into ``out`` during the transfer of tick first + k + 1 (a segment's reduction overlaps
    the next segment's transfer), and sends the result to ``parent`` (if any) at tick first + k + 2.
    ``segs`` are the segments of the piece of the vector that starts at element ``base``.
    """
    if not kids:
        for t in range(first + len(segs)):
            mine = _at(base, segs, t - first, "in")
            yield Transfer(sends=[(parent, mine)] if mine is not None else ())
        return

    def landing(i, lo, hi):
        return "tmp", (slot + i) * width + lo, (slot + i) * width + hi

    for t in range(first + len(segs) + 2):
        k = t - first
        seg, done = _seg(segs, k), _seg(segs, k - 1)
        recvs = [(c, landing(i, *seg)) for i, c in enumerate(kids)] if seg is not None else []
        local = []
        if done is not None:
            lo, hi = done
            landed = [landing(i, lo, hi) for i in range(len(kids))]
            # The children's segments are combined in scratch first, so that the one step that reads
            # the input writes the output only where it reads (in place, "in" is "out"): the steps
            # overlapped with one transfer count as running at once for the data-flow check.
            local = [Reduce(landed[0], rng, op) for rng in landed[1:]] + [
                Reduce(("out", base + lo, base + hi), landed[0], op, src=("in", base + lo, base + hi))]
        up = _at(base, segs, k - 2, "out") if parent is not None else None
        yield Transfer(sends=[(parent, up)] if up is not None else (), recvs=recvs, overlap=local)


def together(*parts):
    """A rank's steps for the parts it plays at once, each a generator of one transfer per tick.

    Tick by tick, the messages of all parts go into one transfer (an
    :class:`~commkit.schedule.Exchange` when that is one send and one receive), with the parts'
    local steps in its ``overlap=``; at a tick with no message those local steps run alone, and a
    tick with nothing at all yields nothing. The parts' order is kept inside every transfer.
    """
    for ticks in itertools.zip_longest(*parts, fillvalue=_IDLE):
        sends, recvs, local = [], [], []
        for tick in ticks:
            if tick is not _IDLE:  # (most ticks of a rank deep in a large tree)
                sends += tick.sends
                recvs += tick.recvs
                local += tick.overlap
        if not sends and not recvs:
            yield from local
        elif len(sends) == 1 and len(recvs) == 1:
            yield Exchange(*sends[0], *recvs[0], overlap=local)
        else:
            yield Transfer(sends=sends, recvs=recvs, overlap=local)


def reduce_bound(segs, fill, width, a, b, g):
    """The tick-by-tick bound of a pipelined reduce whose first segment takes ``fill`` + 1 ticks to reach the top.

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
    segs = cost_segments(n)
    if p == 1 or not segs:
        return 0.0
    return reduce_bound(segs, 2 * (p.bit_length() - 1) - 2, min(2, p - 1), a, b, g)


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
    Cost: an upper bound, the tick-by-tick sum of what a step can cost: c(α + s₀β) + (2D-2)·max(
    c(α + s₀β), cs₀γ) + Σₖ₌₁..K₋₁ max(c(α + sₖβ), csₖ₋₁γ) + cs_{K-1}γ, c = 2 (1 for p = 2), sₖ
    the bytes of segment k; D·c(α + nβ + nγ) for K = 1. It is the simulated time when the
    segments are equal, p is not a power of two and the transfers outweigh the reductions
    (α + sβ ≥ sγ); with p a power of two the last level has a single rank and the call is up to
    2(α + s₀β) shorter, and where the reductions dominate it is looser (the fill pays both).
    With many segments that is about 2Kα + 2n·max(β, γ) however large p is, the reductions
    hidden behind the transfers, against the binomial reduce's ⌈log p⌉(α + nβ + nγ).
    Messages: K per rank but the root, each a segment to its parent; n bytes sent per rank.
    Scratch: two vectors (a landing place for each child's segments at their own offsets).
    Optimised away from the textbook form (copy the input into the output, then add each child's
    segment into it): a leaf sends straight from "in", and an inner rank adds its children's
    segments in scratch and then reads "in" and writes "out" in one step (``Reduce(src=...)``).

    Picture, generated from the schedule (p = 4, count = 8, root = 0, segment = 2): each cell lists, for
    every block of the result, the ranks whose input that rank holds for the whole block (- for none),
    after each round. Redrawn by ``python -m commkit.algorithms._diagram --write``::

        round          rank 0               rank 1       rank 2   rank 3
        0              0    0    0    0     1  1  1  1   2 2 2 2  3 3 3 3
        1              0    0    0    0     1  1  1  1   2 2 2 2  3 3 3 3
        2              0    0    0    0     13 1  1  1   2 2 2 2  3 3 3 3
        3              13   0    0    0     13 13 1  1   2 2 2 2  3 3 3 3
        4              0123 13   0    0     13 13 13 1   2 2 2 2  3 3 3 3
        5              0123 0123 13   0     13 13 13 13  2 2 2 2  3 3 3 3
        6              0123 0123 0123 0123  13 13 13 13  2 2 2 2  3 3 3 3
        msgs sent      0                    4            4        4
        elems sent     0                    8            8        8
        elems reduced  16                   8            0        0
        critical path (commkit.sim, each term alone): 10 messages, 20 elements sent, 18 reduced
    """
    if size == 1:
        yield Copy(("out", 0, count), ("in", 0, count))
        return
    segs = segments(count, segment)
    if not segs:
        return
    rel = (rank - root) % size
    kids = [(c + root) % size for c in _tree_children(rel, size)]
    parent = ((rel - 1) // 2 + root) % size if rel else None
    # Tick k: my children's segment k arrives while I reduce segment k-1 and send segment k-2 up. Alone
    # in one tree a rank needs no global clock (idle ticks yield nothing), so its ticks start at 0; it
    # keeps the docstring's times anyway, since each of its receives waits for its children's sends.
    yield from together(tree_up(parent, kids, 0, 0, segs, op, count))
