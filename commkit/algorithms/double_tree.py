"""The double binary tree: half the vector through each of two binary trees at once, in segments.

Why two trees. A pipelined binary tree (:mod:`.binary_tree`) wastes half the
machine: in a broadcast its leaves, about half the ranks, never send, while
every inner rank sends each byte twice (a reduce mirrors this), so its
bandwidth term is 2nβ. The double binary tree (as NCCL uses it) cuts the
vector in two halves and runs one half through each of two trees at once,
built so that every rank is an inner rank of at most one of them
(:func:`double_tree`): every rank's link then carries about n bytes each way
and the bandwidth term drops to nβ.

How a rank plays two trees. Its part in each tree is the tick-by-tick
pipeline of :mod:`.binary_tree` (:func:`.binary_tree.tree_down` or
:func:`.binary_tree.tree_up`, at the tick its depth gives), and
:func:`.binary_tree.together` posts each tick's messages of both parts in one
transfer, so neither tree waits for the other and nothing can deadlock. The
formulas are therefore upper bounds, the sum over ticks of the most one
rank's step can cost, exact in the cases the docstrings name: a rank's two
trees start and end their pipelines at different ticks, a tree whose last
level holds one rank has cheaper steps there, and while the pipeline fills,
transfers and reductions alternate on some ranks and overlap on others.

Segments. Both halves are cut into the same K = ⌈⌈c/2⌉/S⌉ segments
(:func:`_halves`), S the schedules' ``segment`` argument, else
``COMMKIT_SEGMENT_ELEMENTS``, else 65536 elements (:mod:`.pipelined`).
"""

from __future__ import annotations

import math

from ..schedule import Copy, Transfer, partition
from . import algorithm
from .binary_tree import reduce_bound, together, tree_down, tree_up
from .pipelined import COST_ITEMSIZE, SegmentBytes, segment_count

__all__ = ["broadcast_double_binary_tree", "reduce_double_binary_tree", "allreduce_double_binary_tree",
           "double_tree", "inorder_parent", "inorder_children"]


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
    Cost: an upper bound, the tick-by-tick sum of what a step can cost (two messages each way):
    2(D + K)α + 2(Ds₀ + h)β, D = ⌊log(p-1)⌋ the trees' depth, s₀ the bytes of the first
    (longest) segment of the larger half and h its bytes: about 2(D + K)α + nβ + 2Ds₀β. It is the
    simulated time when p-1 is not a power of two, K ≥ 2 and the segments are equal; with one
    segment per half it is up to twice the simulated time. Against ``binary_tree_segmented``'s
    2(⌈log p⌉ - 2)(α + s₀β) + 2(Kα + nβ), the bandwidth term is nβ instead of 2nβ, for K
    segments per half where the single tree cuts the whole vector into K.
    Messages: K to each of its children in its inner tree (fewer where half 1 has empty
    segments), none from a leaf of both; the root sends 2K, one per segment, n bytes in all.

    Picture, generated from the schedule (p = 4, count = 8, root = 0, segment = 2): each cell lists, for
    every block of the result, the ranks whose input that rank holds for the whole block (- for none),
    after each round. Redrawn by ``python -m commkit.algorithms._diagram --write``::

        round       rank 0   rank 1   rank 2   rank 3
        0           0 0 0 0  - - - -  - - - -  - - - -
        1           0 0 0 0  - - - -  0 - - -  - - 0 -
        2           0 0 0 0  0 - 0 -  0 0 0 -  0 - 0 0
        3           0 0 0 0  0 0 0 0  0 0 0 0  0 0 0 0
        msgs sent   4        0        4        4
        elems sent  8        0        8        8
        critical path (commkit.sim, each term alone): 6 messages, 12 elements sent
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
        parts = [tree_down(None, [top], 0, base, segs, src="in")
                 for top, (base, segs) in zip(_tree_tops(m, rank_of), halves)]
        yield from together(*parts, iter([Transfer(overlap=copy)]))
        return
    if not k_segments:
        return
    # A rank at depth d of a tree receives segment k of that tree's half at time d + k.
    yield from together(*(tree_down(root if up is None else up, kids, d, base, segs)
                          for (up, kids, d), (base, segs) in zip(_double_tree_ranks(rel - 1, m, rank_of), halves)))


def _double_reduce_cost(p, n, a, b, g):
    segs = _half_cost_segments(n)
    if p == 1 or not segs:
        return 0.0
    return reduce_bound(segs, 2 * ((p - 1).bit_length() - 1), 2, a, b, g)


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
    Cost: an upper bound, the tick-by-tick sum of what a step can cost (two messages each way, two
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
    Optimised as ``reduce_binary_tree_segmented`` is: leaves send straight from "in", inner ranks
    reduce "in" with their children's segments into "out" in one step (``Reduce(src=...)``).

    Picture, generated from the schedule (p = 4, count = 8, root = 0, segment = 2): each cell lists, for
    every block of the result, the ranks whose input that rank holds for the whole block (- for none),
    after each round. Redrawn by ``python -m commkit.algorithms._diagram --write``::

        round          rank 0               rank 1   rank 2       rank 3
        0              0    0    0    0     1 1 1 1  2   2   2 2  3 3 3   3
        1              0    0    0    0     1 1 1 1  2   2   2 2  3 3 3   3
        2              0    0    0    0     1 1 1 1  123 2   2 2  3 3 123 3
        3              123  0    123  0     1 1 1 1  123 123 2 2  3 3 123 123
        4              0123 0123 0123 0123  1 1 1 1  123 123 2 2  3 3 123 123
        msgs sent      0                    4        4            4
        elems sent     0                    8        8            8
        elems reduced  8                    0        8            8
        critical path (commkit.sim, each term alone): 8 messages, 16 elements sent, 12 reduced
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

    def rank_of(j):
        return (j + 1 + root) % size

    if rel == 0:
        # The tops of both trees send me segment k at time 2D + k (tree t's into tmp slot t).
        yield from together(*(tree_up(None, [top], 2 * depth, base, segs, op, width, slot=tree)
                              for tree, (top, (base, segs)) in enumerate(zip(_tree_tops(m, rank_of), halves))))
        return
    parts = []
    for (up, kids, d), (base, segs) in zip(_double_tree_ranks(rel - 1, m, rank_of), halves):
        # A rank at depth d sends segment k up at time 2(D - d) + k; its children sent theirs 2 earlier.
        first = 2 * (depth - d) - (2 if kids else 0)
        parts.append(tree_up(root if up is None else up, kids, first, base, segs, op, width))
    yield from together(*parts)


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
    Cost: an upper bound, the tick-by-tick sum of what a step can cost (two messages each way while
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
    Optimised as ``reduce_binary_tree_segmented`` is: leaves send straight from "in", inner ranks
    reduce "in" with their children's segments into "out" in one step (``Reduce(src=...)``).

    Picture, generated from the schedule (p = 4, count = 8, segment = 2): each cell lists, for every
    block of the result, the ranks whose input that rank holds for the whole block (- for none), after
    each round. Redrawn by ``python -m commkit.algorithms._diagram --write``::

        round          rank 0               rank 1               rank 2               rank 3
        0              0    0    0    0     1    1    1    1     2    2    2    2     3    3    3    3
        1              0    0    0    0     1    1    1    1     2    2    2    2     3    3    3    3
        2              0    0    0    0     012  1    1    1     2    2    123  2     3    3    3    3
        3              0    0    123  0     012  012  1    1     2    2    123  123   012  3    3    3
        4              0    0    0123 123   012  012  1    1     2    2    123  123   0123 012  3    3
        5              0    0    0123 0123  0123 012  1    1     2    2    0123 123   0123 0123 3    3
        6              0123 0    0123 0123  0123 0123 0123 1     0123 2    0123 0123  0123 0123 0123 3
        7              0123 0123 0123 0123  0123 0123 0123 0123  0123 0123 0123 0123  0123 0123 0123 0123
        msgs sent      4                    8                    8                    4
        elems sent     8                    16                   16                   8
        elems reduced  4                    8                    8                    4
        critical path (commkit.sim, each term alone): 11 messages, 22 elements sent, 10 reduced
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
        parts.append(tree_up(up, kids, first, base, segs, op, width))
        # Down again: the top sends segment k at time 2D + k, a rank at depth d receives it at 2D + d - 1 + k.
        parts.append(tree_down(up, kids, 2 * depth + d - (up is not None), base, segs))
    yield from together(*parts)
