"""Binomial-tree algorithms: broadcast, reduce, gather and scatter in ⌈log2 p⌉ rounds.

Ranks are renumbered relative to the root (``rel = (rank - root) % p``). In
the binomial tree, relative rank ``j``'s parent is ``j`` with its lowest set
bit cleared, and its children are ``j + mask`` for each power of two ``mask``
below that bit. A subtree is a contiguous range of relative ranks, which is
what lets gather and scatter move a whole subtree's blocks in one message.
The walk itself (:func:`binomial_parent`, :func:`binomial_children`,
:func:`binomial_subtree_size`) is written once here; the other binomial trees
(``vector.py``'s v-collectives) use it too.
"""

from __future__ import annotations

from ..schedule import Copy, Recv, Reduce, Send
from . import algorithm, log2ceil


def binomial_parent(rel: int) -> int:
    """The parent of relative rank ``rel`` > 0: ``rel`` with its lowest set bit cleared."""
    return rel & (rel - 1)


def binomial_children(rel: int, size: int) -> list[int]:
    """The children of relative rank ``rel`` among ``size`` ranks, nearest (smallest subtree) first.

    They are ``rel + mask`` for each power of two ``mask`` below ``rel``'s lowest
    set bit (below ``size`` for the root, ``rel = 0``), as long as that is a rank.
    """
    low = rel & -rel if rel else size
    children = []
    mask = 1
    while mask < low and rel + mask < size:
        children.append(rel + mask)
        mask <<= 1
    return children


def binomial_subtree_size(rel: int, size: int) -> int:
    """Number of relative ranks in the subtree rooted at ``rel``: ``[rel, rel + this)``."""
    low = rel & -rel if rel else size
    return min(low, size - rel)


@algorithm("broadcast", "binomial", cost=lambda p, n, a, b, g: log2ceil(p) * (a + n * b),
           formula="⌈log p⌉(α+nβ)")
def broadcast_binomial(rank, size, count, root):
    """Binomial broadcast: receive the vector from the parent, forward it to each child.

    Restrictions: none. Cost: ⌈log p⌉(α + nβ). Best for small messages.

    The root sends straight from its input and copies the input into its output
    while the first message is on the wire (nothing to copy in place), so the
    copy never delays the broadcast.

    Picture, generated from the schedule (p = 4, count = 8, root = 0): each cell lists, for every block
    of the result, the ranks whose input that rank holds for the whole block (- for none), after each
    round. Redrawn by ``python -m commkit.algorithms._diagram --write``::

        round       rank 0   rank 1   rank 2   rank 3
        0           0 0 0 0  - - - -  - - - -  - - - -
        1           0 0 0 0  - - - -  0 0 0 0  - - - -
        2           0 0 0 0  0 0 0 0  0 0 0 0  0 0 0 0
        msgs sent   2        0        1        0
        elems sent  16       0        8        0
        critical path (commkit.sim, each term alone): 2 messages, 16 elements sent
    """
    whole = ("out", 0, count)
    rel = (rank - root) % size
    if rel:
        # Wait for the parent.
        yield Recv((binomial_parent(rel) + root) % size, whole)
    src = ("in", 0, count) if rank == root else whole
    pending_copy = (Copy(whole, src),) if rank == root else ()
    for child in reversed(binomial_children(rel, size)):
        # Forward to each child, the farthest subtree first.
        yield Send((child + root) % size, src, overlap=pending_copy)
        pending_copy = ()
    if pending_copy:  # a root without children (p = 1)
        yield from pending_copy


def _binomial_reduce(rank, size, count, op, root):
    """Reduce into ``out`` at ``root``; children hold higher relative ranks than their parent."""
    rel = (rank - root) % size
    whole = ("out", 0, count)
    yield Copy(whole, ("in", 0, count))
    for child in binomial_children(rel, size):
        # Fold in the child subtree, which holds the next higher ranks.
        yield Recv((child + root) % size, ("tmp", 0, count))
        yield Reduce(whole, ("tmp", 0, count), op)
    if rel:
        # My subtree is complete: send it to my parent.
        yield Send((binomial_parent(rel) + root) % size, whole)


@algorithm("reduce", "binomial", scratch=lambda r, p, n: n,
           cost=lambda p, n, a, b, g: log2ceil(p) * (a + n * b + n * g), formula="⌈log p⌉(α+nβ+nγ)")
def reduce_binomial(rank, size, count, op, root):
    """Binomial reduce: fold each child subtree in, then pass the result to the parent.

    Restrictions: none. For a non-commutative op the tree is rooted at rank 0, where
    subtrees are rank-ordered ranges, and the result then moves to ``root`` (one more
    message). Cost: ⌈log p⌉(α + nβ + nγ).

    Picture, generated from the schedule (p = 4, count = 8, root = 0): each cell lists, for every block
    of the result, the ranks whose input that rank holds for the whole block (- for none), after each
    round. Redrawn by ``python -m commkit.algorithms._diagram --write``::

        round          rank 0               rank 1   rank 2       rank 3
        0              0    0    0    0     1 1 1 1  2  2  2  2   3 3 3 3
        1              01   01   01   01    1 1 1 1  23 23 23 23  3 3 3 3
        2              0123 0123 0123 0123  1 1 1 1  23 23 23 23  3 3 3 3
        msgs sent      0                    1        1            1
        elems sent     0                    8        8            8
        elems reduced  16                   0        8            0
        critical path (commkit.sim, each term alone): 2 messages, 16 elements sent, 16 reduced
    """
    if op.commutative or root == 0:
        yield from _binomial_reduce(rank, size, count, op, root)
        return
    yield from _binomial_reduce(rank, size, count, op, 0)
    if rank == 0:
        yield Send(root, ("out", 0, count))
    elif rank == root:
        yield Recv(0, ("out", 0, count))


@algorithm("gather", "binomial", scratch=lambda r, p, n: p * n,
           cost=lambda p, n, a, b, g: log2ceil(p) * a + (p - 1) / p * n * b,
           formula="⌈log p⌉α + ((p-1)/p)nβ")
def gather_binomial(rank, size, count, root):
    """Binomial gather: each rank collects its subtree's blocks, then sends them up in one message.

    Restrictions: none. Cost: ⌈log p⌉α + ((p-1)/p)nβ, n = bytes gathered.
    Scratch: an inner rank's subtree blocks, in relative order. A leaf sends its input
    where it lies, and the root receives each subtree straight into place in its
    output (through scratch only a subtree that wraps past rank p-1): no copy of
    the gathered vector.

    Picture, generated from the schedule (p = 4, count = 1, root = 0): each cell lists, for every block
    of the result, the ranks whose input that rank holds for the whole block (- for none), after each
    round. Redrawn by ``python -m commkit.algorithms._diagram --write``::

        round       rank 0   rank 1   rank 2   rank 3
        0           0 - - -  - 1 - -  - - 2 -  - - - 3
        1           0 1 - -  - 1 - -  - - 2 3  - - - 3
        2           0 1 2 3  - 1 - -  - - 2 3  - - - 3
        msgs sent   0        1        1        1
        elems sent  0        1        2        1
        critical path (commkit.sim, each term alone): 2 messages, 3 elements sent
    """
    rel = (rank - root) % size
    children = binomial_children(rel, size)
    if rel and not children:
        yield Send((binomial_parent(rel) + root) % size, ("in", 0, count))  # a leaf sends its input as it lies
        return
    if rel:
        # tmp holds the blocks of my subtree in relative order: relative rank j's at (j - rel) * count.
        yield Copy(("tmp", 0, count), ("in", 0, count))
        for child in children:
            lo = child - rel
            yield Recv((child + root) % size, ("tmp", lo * count, (lo + binomial_subtree_size(child, size)) * count))
        yield Send((binomial_parent(rel) + root) % size, ("tmp", 0, binomial_subtree_size(rel, size) * count))
        return
    # The root: each child's subtree is relative ranks child .. child + size - 1, ranks (child + root) % p
    # on: received straight into place, unless it runs past rank p - 1 (then through tmp, in two pieces).
    yield Copy(("out", root * count, (root + 1) * count), ("in", 0, count))
    for child in children:
        first, n = (child + root) % size, binomial_subtree_size(child, size)
        if first + n <= size:
            yield Recv(first, ("out", first * count, (first + n) * count))
            continue
        head = size - first  # the subtree's blocks before the wrap
        yield Recv(first, ("tmp", child * count, (child + n) * count))
        yield Copy(("out", first * count, size * count), ("tmp", child * count, (child + head) * count))
        yield Copy(("out", 0, (n - head) * count), ("tmp", (child + head) * count, (child + n) * count))


@algorithm("scatter", "binomial", scratch=lambda r, p, n: p * n,
           cost=lambda p, n, a, b, g: log2ceil(p) * a + (p - 1) / p * n * b,
           formula="⌈log p⌉α + ((p-1)/p)nβ")
def scatter_binomial(rank, size, count, root):
    """Binomial scatter: each rank receives its subtree's blocks and hands each child its share.

    Restrictions: none. Cost: ⌈log p⌉α + ((p-1)/p)nβ, n = bytes scattered.
    The root sends each subtree's blocks from its input where they lie (through scratch
    only a subtree that wraps past rank p-1), and a leaf receives straight into its
    output: only inner ranks stage their subtree in scratch.

    Picture, generated from the schedule (p = 4, count = 1, root = 0): each cell lists, for every block
    of the result, the ranks whose input that rank holds for the whole block (- for none), after each
    round. Redrawn by ``python -m commkit.algorithms._diagram --write``::

        round       rank 0   rank 1   rank 2   rank 3
        0           0 0 0 0  - - - -  - - - -  - - - -
        1           0 0 0 0  - - - -  - - 0 0  - - - -
        2           0 0 0 0  - 0 - -  - - 0 0  - - - 0
        msgs sent   2        0        1        0
        elems sent  3        0        1        0
        critical path (commkit.sim, each term alone): 2 messages, 3 elements sent
    """
    rel = (rank - root) % size
    children = list(reversed(binomial_children(rel, size)))  # the farthest first
    if rel == 0:
        # Each child's subtree is ranks (child + root) % p on: sent from the input where it lies,
        # unless it runs past rank p - 1 (then gathered into tmp first, from two pieces).
        for child in children:
            first, n = (child + root) % size, binomial_subtree_size(child, size)
            if first + n <= size:
                yield Send(first, ("in", first * count, (first + n) * count))
                continue
            head = size - first
            yield Copy(("tmp", child * count, (child + head) * count), ("in", first * count, size * count))
            yield Copy(("tmp", (child + head) * count, (child + n) * count), ("in", 0, (n - head) * count))
            yield Send(first, ("tmp", child * count, (child + n) * count))
        yield Copy(("out", 0, count), ("in", root * count, (root + 1) * count))
        return
    parent = (binomial_parent(rel) + root) % size
    if not children:
        yield Recv(parent, ("out", 0, count))  # a leaf receives its block straight into its output
        return
    # tmp receives the blocks of my subtree in relative order: relative rank j's at (j - rel) * count.
    yield Recv(parent, ("tmp", 0, binomial_subtree_size(rel, size) * count))
    for child in children:
        lo = child - rel
        yield Send((child + root) % size, ("tmp", lo * count, (lo + binomial_subtree_size(child, size)) * count))
    yield Copy(("out", 0, count), ("tmp", 0, count))
