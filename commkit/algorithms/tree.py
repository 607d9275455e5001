"""Binomial-tree algorithms: broadcast, reduce, gather and scatter in ⌈log2 p⌉ rounds.

Ranks are renumbered relative to the root (``rel = (rank - root) % p``). In
the binomial tree, relative rank ``j``'s parent is ``j`` with its lowest set
bit cleared, and its children are ``j + mask`` for each power of two ``mask``
below that bit. A subtree is a contiguous range of relative ranks, which is
what lets gather and scatter move a whole subtree's blocks in one message.
"""

from __future__ import annotations

from ..schedule import Copy, Recv, Reduce, Send
from . import algorithm, log2ceil


def _subtree(rel: int, size: int) -> int:
    """Number of relative ranks in the subtree rooted at ``rel``."""
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
    """
    whole = ("out", 0, count)
    rel = (rank - root) % size
    mask = 1
    while mask < size:
        if rel & mask:
            # Wait for the parent: relative rank rel with its lowest set bit cleared.
            yield Recv((rel - mask + root) % size, whole)
            break
        mask <<= 1
    mask >>= 1
    src = ("in", 0, count) if rank == root else whole
    pending_copy = (Copy(whole, src),) if rank == root else ()
    while mask > 0:
        # Forward to each child, the farthest subtree first.
        if rel + mask < size:
            yield Send((rel + mask + root) % size, src, overlap=pending_copy)
            pending_copy = ()
        mask >>= 1
    if pending_copy:  # a root without children (p = 1)
        yield from pending_copy


def _binomial_reduce(rank, size, count, op, root):
    """Reduce into ``out`` at ``root``; children hold higher relative ranks than their parent."""
    rel = (rank - root) % size
    whole = ("out", 0, count)
    yield Copy(whole, ("in", 0, count))
    mask = 1
    while mask < size:
        if rel & mask:
            # My subtree is complete: send it to my parent and stop.
            yield Send((rel - mask + root) % size, whole)
            return
        child = rel + mask
        if child < size:
            # Fold in the child subtree, which holds the next higher ranks.
            yield Recv((child + root) % size, ("tmp", 0, count))
            yield Reduce(whole, ("tmp", 0, count), op)
        mask <<= 1


@algorithm("reduce", "binomial", scratch=lambda r, p, n: n,
           cost=lambda p, n, a, b, g: log2ceil(p) * (a + n * b + n * g), formula="⌈log p⌉(α+nβ+nγ)")
def reduce_binomial(rank, size, count, op, root):
    """Binomial reduce: fold each child subtree in, then pass the result to the parent.

    Restrictions: none. For a non-commutative op the tree is rooted at rank 0, where
    subtrees are rank-ordered ranges, and the result then moves to ``root`` (one more
    message). Cost: ⌈log p⌉(α + nβ + nγ).
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
    Scratch: the subtree's blocks, in relative order; the root rotates them into place.
    """
    rel = (rank - root) % size
    yield Copy(("tmp", 0, count), ("in", 0, count))
    have = 1  # blocks of relative ranks [rel, rel + have) sit at tmp[0 : have*count]
    mask = 1
    while mask < size:
        if rel & mask:
            yield Send((rel - mask + root) % size, ("tmp", 0, have * count))
            return
        child = rel + mask
        if child < size:
            n = _subtree(child, size)
            yield Recv((child + root) % size, ("tmp", mask * count, (mask + n) * count))
            have = mask + n
        mask <<= 1
    # Root: tmp holds blocks of relative ranks 0..p-1; relative j is rank (j + root) % p.
    head = (size - root) * count
    yield Copy(("out", root * count, size * count), ("tmp", 0, head))
    yield Copy(("out", 0, root * count), ("tmp", head, size * count))


@algorithm("scatter", "binomial", scratch=lambda r, p, n: p * n,
           cost=lambda p, n, a, b, g: log2ceil(p) * a + (p - 1) / p * n * b,
           formula="⌈log p⌉α + ((p-1)/p)nβ")
def scatter_binomial(rank, size, count, root):
    """Binomial scatter: each rank receives its subtree's blocks and hands each child its share.

    Restrictions: none. Cost: ⌈log p⌉α + ((p-1)/p)nβ, n = bytes scattered.
    """
    rel = (rank - root) % size
    if rel == 0:
        # Rotate the root's blocks into relative order: tmp block j is for rank (j + root) % p.
        head = (size - root) * count
        yield Copy(("tmp", 0, head), ("in", root * count, size * count))
        yield Copy(("tmp", head, size * count), ("in", 0, root * count))
    mask = 1
    while mask < size:
        if rel & mask:
            yield Recv((rel - mask + root) % size, ("tmp", 0, _subtree(rel, size) * count))
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:
        child = rel + mask
        if child < size:
            yield Send((child + root) % size, ("tmp", mask * count, (mask + _subtree(child, size)) * count))
        mask >>= 1
    yield Copy(("out", 0, count), ("tmp", 0, count))
