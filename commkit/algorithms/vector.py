"""Vector collectives: allgatherv, gatherv, scatterv and alltoallv, where every rank's block has its own size.

The schedule argument is the tuple of per-rank element counts (allgatherv,
gatherv, scatterv) or, for alltoallv, the p x p matrix ``counts[i][j]`` =
elements rank i sends to rank j. Every rank knows all of it, so both sides
of every message know its length.

=============  ======================================  ==========================================
collective     generator arguments                     buffers (``N`` = ``sum(counts)``)
=============  ======================================  ==========================================
allgatherv     ``(rank, size, counts)``                in[counts[rank]] -> out[N]
gatherv        ``(rank, size, counts, root)``          in[counts[rank]] -> out[N] at the root
scatterv       ``(rank, size, counts, root)``          in[N] at the root -> out[counts[rank]]
alltoallv      ``(rank, size, counts)``                in[sum(row rank)] -> out[sum(column rank)]
=============  ======================================  ==========================================

Blocks are laid out in rank order: rank q's block of ``out`` (allgatherv,
gatherv) or ``in`` (scatterv) starts at ``sum(counts[:q])``; for alltoallv the
block for rank j starts at ``sum(counts[rank][:j])`` in ``in`` and the block
from rank i at ``sum(counts[k][rank] for k < i)`` in ``out``.

Why empty blocks send nothing. Uneven counts often mean zeros (a rank with
no particles this step). A zero-byte message still costs a latency, so no
schedule here sends one. That is safe because both ends of every message
compute its length from the same counts: when one side skips it, so does the
other (an :class:`~commkit.schedule.Exchange` with one empty side becomes a
plain ``Send`` or ``Recv``, with both sides empty it disappears).

Why the binomial trees stage in relative order. In the binomial tree over
relative ranks (``rel = (rank - root) % p``), a subtree is a contiguous range
of relative ranks, so a node forwards its subtree's blocks in one message.
In the output's layout (rank order), the same range is contiguous unless it
wraps past rank p-1; so inner nodes gather their subtree in ``tmp``, in
relative order, and the root receives each child subtree straight into
``out``, except the one subtree that wraps, which it receives into ``tmp``
and copies out in two pieces. A leaf, or a node whose children contribute
nothing, sends its input directly. ``scatterv`` runs the same tree
backwards. The scratch declaration cannot depend on the root (the registry's
``scratch(rank, size, counts)`` does not get it), so it is the whole vector,
``N``; a rank touches only its subtree's share of it.

Costs use ``n`` as :mod:`commkit.selection` counts a v-collective's message:
the whole gathered or scattered vector in bytes, and for alltoallv the
average block, ``sum(counts) * itemsize / p**2``. The formulas are the
simulated time when all blocks are equal and non-empty; uneven or empty
blocks move the time either way (fewer messages, but a longer largest block).
"""

from __future__ import annotations

from ..schedule import Copy, Exchange, Recv, Send, Transfer
from . import algorithm, log2ceil
from ._blocks import block_offsets
from .tree import binomial_children, binomial_parent, binomial_subtree_size


def _pair(dest, send, source, recv):
    """An exchange of two ranges, dropping an empty side (both peers drop the same one)."""
    if send[2] > send[1]:
        if recv[2] > recv[1]:
            yield Exchange(dest, send, source, recv)
        else:
            yield Send(dest, send)
    elif recv[2] > recv[1]:
        yield Recv(source, recv)


def _copy(dst, src):
    if dst[2] > dst[1]:
        yield Copy(dst, src)


def _whole(rank, size, counts):
    """Scratch of the tree algorithms: the whole vector (see the module docstring)."""
    return block_offsets(counts)[-1] if size > 1 else 0  # the total, without summing p counts on every rank


class _Tree:
    """The binomial tree over relative ranks, with the counts in relative order.

    ``rcounts[j]`` is the block of relative rank ``j`` (actual rank ``(j + root) % size``);
    ``span(first, last)`` is the number of elements of relative ranks ``[first, last)``.
    """

    def __init__(self, rank, size, counts, root):
        self.size = size
        self.root = root
        self.offsets = block_offsets(counts)
        self.rel = (rank - root) % size
        self.rcounts = tuple(counts[root:]) + tuple(counts[:root])  # relative order: the root's block first
        self.roffsets = block_offsets(self.rcounts)

    def actual(self, j: int) -> int:
        return (j + self.root) % self.size

    def subtree_end(self, j: int) -> int:
        """One past the last relative rank of the subtree rooted at ``j``."""
        return j + binomial_subtree_size(j, self.size)

    def span(self, first: int, last: int) -> int:
        return self.roffsets[last] - self.roffsets[first]

    def parent(self) -> int:
        """The actual rank of this rank's parent."""
        return self.actual(binomial_parent(self.rel))

    def children(self) -> list[int]:
        """Child relative ranks in increasing distance (smallest subtree first)."""
        return binomial_children(self.rel, self.size)

    def out_range(self, first: int, last: int):
        """Where relative ranks ``[first, last)`` lie in rank order: one range, or two if they wrap past p-1."""
        a, b = self.actual(first), self.actual(last - 1)
        if a <= b:
            return ((self.offsets[a], self.offsets[b + 1]),)
        return ((self.offsets[a], self.offsets[self.size]), (0, self.offsets[b + 1]))


# -- the cost models --------------------------------------------------------------------------------------------


def _model(cost, formula: str) -> dict:
    """A vector collective's cost model, as :func:`algorithm` takes it (``**model``).

    The cost is nothing when there is nothing to move (every block empty sends nothing);
    otherwise ``cost``, exact when all blocks are equal and non-empty, off either way
    when they are not (the formula sees only the total, n).
    """
    def run(p, n, a, b, g):
        return 0.0 if n <= 0 else cost(p, n, a, b, g)
    return {"cost": run, "formula": f"{formula} (0 when n = 0)", "cost_exact": "even", "cost_bound": "either"}


# p-1 messages; every block but one crosses a link once (naive and ring allgatherv, naive gatherv and scatterv).
_LINEAR = _model(lambda p, n, a, b, g: (p - 1) * a + (p - 1) / p * n * b, "(p-1)α + ((p-1)/p)nβ")
# A binomial tree of ⌈log p⌉ rounds, whose inner ranks stage their subtree in scratch (gatherv, scatterv).
_BINOMIAL = dict(_model(lambda p, n, a, b, g: log2ceil(p) * a + (p - 1) / p * n * b, "⌈log p⌉α + ((p-1)/p)nβ"),
                 scratch=_whole)
# Every rank sends a block to each other rank (alltoallv; n is the average block).
_ALL_PAIRS = _model(lambda p, n, a, b, g: (p - 1) * (a + n * b), "(p-1)(α+nβ)")


# -- allgatherv ---------------------------------------------------------------------------------------------------


@algorithm("allgatherv", "naive", symmetry="rotation", **_LINEAR)
def allgatherv_naive(rank, size, counts):
    """Naive allgatherv: every rank sends its block straight to every other rank, all at once.

    Restrictions: none; empty blocks send no message. Cost: (p-1)α + ((p-1)/p)nβ,
    n = bytes gathered; exact when all blocks are equal and non-empty. All 2(p-1)
    transfers of a rank are in flight together, so there is no chain of rounds,
    but a rank with a large block sends it p-1 times over its own link.

    Picture, generated from the schedule (p = 4, count = (1, 2, 1, 2)): each cell lists, for every block
    of the result, the ranks whose input that rank holds for the whole block (- for none), after each
    round. Redrawn by ``python -m commkit.algorithms._diagram --write``::

        round       rank 0   rank 1   rank 2   rank 3
        0           0 - - -  - 1 - -  - - 2 -  - - - 3
        1           0 1 2 3  0 1 2 3  0 1 2 3  0 1 2 3
        msgs sent   3        3        3        3
        elems sent  3        6        3        6
        critical path (commkit.sim, each term alone): 3 messages, 6 elements sent
    """
    offsets = block_offsets(counts)
    mine = ("in", 0, counts[rank])
    yield from _copy(("out", offsets[rank], offsets[rank + 1]), mine)
    # Send to rank+1, rank+2, ... and receive from rank-1, rank-2, ..., so that no rank is
    # everyone's first destination.
    sends = [((rank + i) % size, mine) for i in range(1, size)] if counts[rank] else []
    sources = [(rank - i) % size for i in range(1, size)]
    recvs = [(q, ("out", offsets[q], offsets[q + 1])) for q in sources if counts[q]]
    if sends or recvs:
        yield Transfer(sends, recvs)


@algorithm("allgatherv", "ring", symmetry="rotation", **_LINEAR)
def allgatherv_ring(rank, size, counts):
    """Ring allgatherv: each step passes the block received last step to the right neighbour.

    Restrictions: none; a step whose block is empty is skipped by both neighbours.
    Cost: (p-1)α + ((p-1)/p)nβ, n = bytes gathered; exact when all blocks are equal and
    non-empty. Every rank sends each block but its right neighbour's once, to one neighbour.

    Picture, generated from the schedule (p = 4, count = (1, 2, 1, 2)): each cell lists, for every block
    of the result, the ranks whose input that rank holds for the whole block (- for none), after each
    round. Redrawn by ``python -m commkit.algorithms._diagram --write``::

        round       rank 0   rank 1   rank 2   rank 3
        0           0 - - -  - 1 - -  - - 2 -  - - - 3
        1           0 - - 3  0 1 - -  - 1 2 -  - - 2 3
        2           0 - 2 3  0 1 - 3  0 1 2 -  - 1 2 3
        3           0 1 2 3  0 1 2 3  0 1 2 3  0 1 2 3
        msgs sent   3        3        3        3
        elems sent  4        5        4        5
        critical path (commkit.sim, each term alone): 3 messages, 6 elements sent
    """
    offsets = block_offsets(counts)
    yield from _copy(("out", offsets[rank], offsets[rank + 1]), ("in", 0, counts[rank]))
    right, left = (rank + 1) % size, (rank - 1) % size
    for step in range(size - 1):
        # Rank r sends block r-step (its own at step 0) and receives block r-step-1 from the left.
        s, r = (rank - step) % size, (rank - step - 1) % size
        yield from _pair(right, ("out", offsets[s], offsets[s + 1]), left, ("out", offsets[r], offsets[r + 1]))


# -- gatherv ------------------------------------------------------------------------------------------------------


@algorithm("gatherv", "naive", **_LINEAR)
def gatherv_naive(rank, size, counts, root):
    """Naive gatherv: every rank with data sends its block straight to the root.

    Restrictions: none; empty blocks send no message. Cost: (p-1)α + ((p-1)/p)nβ,
    n = bytes gathered; exact when all blocks are equal and non-empty.

    Picture, generated from the schedule (p = 4, count = (1, 2, 1, 2), root = 0): each cell lists, for
    every block of the result, the ranks whose input that rank holds for the whole block (- for none),
    after each round. Redrawn by ``python -m commkit.algorithms._diagram --write``::

        round       rank 0   rank 1   rank 2   rank 3
        0           0 - - -  - 1 - -  - - 2 -  - - - 3
        1           0 1 2 3  - 1 - -  - - 2 -  - - - 3
        msgs sent   0        1        1        1
        elems sent  0        2        1        2
        critical path (commkit.sim, each term alone): 3 messages, 5 elements sent
    """
    offsets = block_offsets(counts)
    if rank != root:
        if counts[rank]:
            yield Send(root, ("in", 0, counts[rank]))
        return
    yield from _copy(("out", offsets[root], offsets[root + 1]), ("in", 0, counts[root]))
    recvs = [(q, ("out", offsets[q], offsets[q + 1])) for q in range(size) if q != root and counts[q]]
    if recvs:
        yield Transfer(recvs=recvs)


@algorithm("gatherv", "binomial", **_BINOMIAL)
def gatherv_binomial(rank, size, counts, root):
    """Binomial gatherv: each rank collects its subtree's blocks, then sends them up in one message.

    Restrictions: none; subtrees without data send nothing. Cost: ⌈log p⌉α + ((p-1)/p)nβ,
    n = bytes gathered; exact when all blocks are equal and non-empty. Uneven blocks can
    cost more than the formula: a large block is forwarded once per tree level above it.
    Scratch: inner ranks stage their subtree in relative order; the root receives straight
    into ``out`` except for the one child subtree that wraps past rank p-1.

    Picture, generated from the schedule (p = 4, count = (1, 2, 1, 2), root = 0): each cell lists, for
    every block of the result, the ranks whose input that rank holds for the whole block (- for none),
    after each round. Redrawn by ``python -m commkit.algorithms._diagram --write``::

        round       rank 0   rank 1   rank 2   rank 3
        0           0 - - -  - 1 - -  - - 2 -  - - - 3
        1           0 1 - -  - 1 - -  - - 2 3  - - - 3
        2           0 1 2 3  - 1 - -  - - 2 3  - - - 3
        msgs sent   0        1        1        1
        elems sent  0        2        3        2
        critical path (commkit.sim, each term alone): 2 messages, 5 elements sent
    """
    tree = _Tree(rank, size, counts, root)
    rel, own = tree.rel, tree.rcounts[tree.rel]
    if rel != 0:
        end = tree.subtree_end(rel)
        total = tree.span(rel, end)
        if total == own:
            # Nothing comes from below: send my own block (if any) to my parent directly.
            if own:
                yield Send(tree.parent(), ("in", 0, own))
            return
        yield from _copy(("tmp", 0, own), ("in", 0, own))
        for child in tree.children():
            # The child's subtree lands after the blocks of the relative ranks before it.
            lo = tree.span(rel, child)
            n = tree.span(child, tree.subtree_end(child))
            if n:
                yield Recv(tree.actual(child), ("tmp", lo, lo + n))
        yield Send(tree.parent(), ("tmp", 0, total))
        return
    yield from _copy(("out", tree.offsets[root], tree.offsets[root + 1]), ("in", 0, own))
    for child in tree.children():
        end = tree.subtree_end(child)
        n = tree.span(child, end)
        if not n:
            continue
        pieces = tree.out_range(child, end)
        if len(pieces) == 1:
            yield Recv(tree.actual(child), ("out", *pieces[0]))
            continue
        # This subtree runs past rank p-1 back to rank 0: receive it whole, then split it.
        yield Recv(tree.actual(child), ("tmp", 0, n))
        (lo1, hi1), (lo2, hi2) = pieces
        yield from _copy(("out", lo1, hi1), ("tmp", 0, hi1 - lo1))
        yield from _copy(("out", lo2, hi2), ("tmp", hi1 - lo1, n))


# -- scatterv -----------------------------------------------------------------------------------------------------


@algorithm("scatterv", "naive", **_LINEAR)
def scatterv_naive(rank, size, counts, root):
    """Naive scatterv: the root sends every rank its block directly, all at once.

    Restrictions: none; empty blocks send no message. Cost: (p-1)α + ((p-1)/p)nβ,
    n = bytes scattered; exact when all blocks are equal and non-empty.

    Picture, generated from the schedule (p = 4, count = (1, 2, 1, 2), root = 0): each cell lists, for
    every block of the result, the ranks whose input that rank holds for the whole block (- for none),
    after each round. Redrawn by ``python -m commkit.algorithms._diagram --write``::

        round       rank 0   rank 1   rank 2   rank 3
        0           0 0 0 0  - - - -  - - - -  - - - -
        1           0 0 0 0  - 0 - -  - - 0 -  - - - 0
        msgs sent   3        0        0        0
        elems sent  5        0        0        0
        critical path (commkit.sim, each term alone): 3 messages, 5 elements sent
    """
    offsets = block_offsets(counts)
    if rank != root:
        if counts[rank]:
            yield Recv(root, ("out", 0, counts[rank]))
        return
    sends = [(q, ("in", offsets[q], offsets[q + 1])) for q in range(size) if q != root and counts[q]]
    if sends:
        yield Transfer(sends=sends)
    yield from _copy(("out", 0, counts[root]), ("in", offsets[root], offsets[root + 1]))


@algorithm("scatterv", "binomial", **_BINOMIAL)
def scatterv_binomial(rank, size, counts, root):
    """Binomial scatterv: each rank receives its subtree's blocks and hands each child its share.

    Restrictions: none; subtrees without data receive nothing. Cost: ⌈log p⌉α + ((p-1)/p)nβ,
    n = bytes scattered; exact when all blocks are equal and non-empty (a large block is
    forwarded once per tree level above its rank, so uneven blocks can cost more).
    Scratch: inner ranks hold their subtree in relative order; the root sends straight from
    ``in`` except for the one child subtree that wraps past rank p-1.

    Picture, generated from the schedule (p = 4, count = (1, 2, 1, 2), root = 0): each cell lists, for
    every block of the result, the ranks whose input that rank holds for the whole block (- for none),
    after each round. Redrawn by ``python -m commkit.algorithms._diagram --write``::

        round       rank 0   rank 1   rank 2   rank 3
        0           0 0 0 0  - - - -  - - - -  - - - -
        1           0 0 0 0  - - - -  - - 0 0  - - - -
        2           0 0 0 0  - 0 - -  - - 0 0  - - - 0
        msgs sent   2        0        1        0
        elems sent  5        0        2        0
        critical path (commkit.sim, each term alone): 2 messages, 5 elements sent
    """
    tree = _Tree(rank, size, counts, root)
    rel, own = tree.rel, tree.rcounts[tree.rel]
    children = tree.children()[::-1]  # largest subtree first: it has the most to forward
    if rel == 0:
        for child in children:
            end = tree.subtree_end(child)
            n = tree.span(child, end)
            if not n:
                continue
            pieces = tree.out_range(child, end)
            if len(pieces) == 1:
                yield Send(tree.actual(child), ("in", *pieces[0]))
                continue
            # This subtree runs past rank p-1 back to rank 0: put it in relative order first.
            (lo1, hi1), (lo2, hi2) = pieces
            yield from _copy(("tmp", 0, hi1 - lo1), ("in", lo1, hi1))
            yield from _copy(("tmp", hi1 - lo1, n), ("in", lo2, hi2))
            yield Send(tree.actual(child), ("tmp", 0, n))
        yield from _copy(("out", 0, own), ("in", tree.offsets[root], tree.offsets[root + 1]))
        return
    end = tree.subtree_end(rel)
    total = tree.span(rel, end)
    if total == own:
        # Nothing to forward: receive my own block (if any) straight into out.
        if own:
            yield Recv(tree.parent(), ("out", 0, own))
        return
    yield Recv(tree.parent(), ("tmp", 0, total))
    for child in children:
        lo = tree.span(rel, child)
        n = tree.span(child, tree.subtree_end(child))
        if n:
            yield Send(tree.actual(child), ("tmp", lo, lo + n))
    yield from _copy(("out", 0, own), ("tmp", 0, own))


# -- alltoallv ----------------------------------------------------------------------------------------------------


def _alltoallv_layout(rank, size, counts):
    """(range of ``in`` sent to each rank, range of ``out`` received from each rank)."""
    send = block_offsets(counts[rank])
    recv = block_offsets([counts[q][rank] for q in range(size)])
    return ([("in", send[q], send[q + 1]) for q in range(size)],
            [("out", recv[q], recv[q + 1]) for q in range(size)])


@algorithm("alltoallv", "naive", symmetry="rotation", **_ALL_PAIRS)
def alltoallv_naive(rank, size, counts):
    """Naive all-to-all-v: post every non-empty send and receive at once, then wait for all.

    Restrictions: none; empty blocks send no message. Cost: (p-1)(α + nβ), n = bytes of the
    average block (``sum(counts) * itemsize / p**2``); exact when all blocks are equal and
    non-empty.

    Picture, generated from the schedule (p = 4, count[i][j] = 1 + (i + j) mod 2): each cell lists, for
    every block of the result, the ranks whose input that rank holds for the whole block (- for none),
    after each round. Redrawn by ``python -m commkit.algorithms._diagram --write``::

        round       rank 0   rank 1   rank 2   rank 3
        0           0 - - -  - 1 - -  - - 2 -  - - - 3
        1           0 1 2 3  0 1 2 3  0 1 2 3  0 1 2 3
        msgs sent   3        3        3        3
        elems sent  5        5        5        5
        critical path (commkit.sim, each term alone): 3 messages, 5 elements sent
    """
    send, recv = _alltoallv_layout(rank, size, counts)
    yield from _copy(recv[rank], send[rank])
    order = [(rank + i) % size for i in range(1, size)]  # start with rank+1, so no rank is everyone's first
    sends = [(q, send[q]) for q in order if counts[rank][q]]
    recvs = [(q, recv[q]) for q in order[::-1] if counts[q][rank]]
    if sends or recvs:
        yield Transfer(sends, recvs)


@algorithm("alltoallv", "pairwise", symmetry="rotation", **_ALL_PAIRS)
def alltoallv_pairwise(rank, size, counts):
    """Pairwise all-to-all-v: in round i, send to rank + i and receive from rank - i.

    Restrictions: none; an empty block skips its half of the round on both sides.
    Cost: (p-1)(α + nβ), n = bytes of the average block; exact when all blocks are equal
    and non-empty. At most one message in and one out per rank at any time.

    Picture, generated from the schedule (p = 4, count[i][j] = 1 + (i + j) mod 2): each cell lists, for
    every block of the result, the ranks whose input that rank holds for the whole block (- for none),
    after each round. Redrawn by ``python -m commkit.algorithms._diagram --write``::

        round       rank 0   rank 1   rank 2   rank 3
        0           0 - - -  - 1 - -  - - 2 -  - - - 3
        1           0 - - 3  0 1 - -  - 1 2 -  - - 2 3
        2           0 - 2 3  0 1 - 3  0 1 2 -  - 1 2 3
        3           0 1 2 3  0 1 2 3  0 1 2 3  0 1 2 3
        msgs sent   3        3        3        3
        elems sent  5        5        5        5
        critical path (commkit.sim, each term alone): 3 messages, 5 elements sent
    """
    send, recv = _alltoallv_layout(rank, size, counts)
    yield from _copy(recv[rank], send[rank])
    for i in range(1, size):
        dest, source = (rank + i) % size, (rank - i) % size
        yield from _pair(dest, send[dest], source, recv[source])
