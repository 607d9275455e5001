"""Ring algorithms: every rank talks only to its two neighbours, p-1 steps per phase.

Bandwidth-optimal for large messages: each rank sends and receives
((p-1)/p)n bytes per phase however many ranks there are, at the price of a
latency term linear in p. Ranks form the ring 0 -> 1 -> ... -> p-1 -> 0;
every step sends to the right neighbour and receives from the left one.
Blocks come from :func:`~commkit.schedule.partition`, so counts need not
divide by p (blocks may even be empty).
"""

from __future__ import annotations

from ..schedule import Copy, Exchange, Recv, Reduce, Send, partition
from . import Phase, algorithm, log2ceil, phased
from ._blocks import block_offsets


def _ring_allgather(rank, size, blocks, buf, origin=0):
    """p-1 ring steps over relative ranks; relative rank j (rank ``(j + origin) % size``) starts owning ``blocks[j]``.

    Every rank sends to its right neighbour and receives from its left one, blocks of
    equal length when the blocks are: rotation-symmetric whatever ``origin`` is.
    """
    me = (rank - origin) % size
    right, left = (rank + 1) % size, (rank - 1) % size
    for step in range(size - 1):
        send, recv = blocks[(me - step) % size], blocks[(me - step - 1) % size]
        # Pass on the block received last step; take the next one from the left.
        yield Exchange(right, (buf, *send), left, (buf, *recv))


def _max_block(count, size):
    return -(-count // size)


def two_widest_blocks(rank, size, counts):
    """Scratch of the ring reduce-scatters: two blocks of the largest count, used alternately.

    Every rank asks with the same counts tuple (and a simulated world asks p times), so the largest
    count is kept for the tuple asked last: O(1) a rank instead of O(p), which made asking every rank
    of a simulated world at p = 65,535 take half a minute.
    """
    global _widest
    last = _widest  # one read: another thread may replace it, never change it
    if counts is not last[0]:
        last = (counts, max(counts))
        if type(counts) is tuple:
            _widest = last
    return 2 * last[1]


_widest: tuple = (None, 0)  # the counts tuple asked for last, and its largest count


def _allreduce_ring_cost(p, n, a, b, g):
    return 2 * (p - 1) * a + 2 * (p - 1) / p * n * b + (p - 1) / p * n * g


@algorithm("allreduce", "ring", commutative=True, scratch=lambda r, p, n: _max_block(n, p),
           cost=_allreduce_ring_cost, formula="2(p-1)α + 2((p-1)/p)nβ + ((p-1)/p)nγ", cost_exact="even",
           cost_bound="lower", symmetry="rotation")
def allreduce_ring(rank, size, count, op):
    """Ring allreduce: a ring reduce-scatter, then a ring allgather of the reduced blocks.

    Restrictions: commutative op (each block is reduced starting at a different rank).
    Cost: 2(p-1)α + 2((p-1)/p)nβ + ((p-1)/p)nγ, exact when count is a multiple of p (uneven
    blocks take longer: a lower bound). Sends 2(p-1) messages per rank, only to its right neighbour.
    Optimised away from the textbook form (``allreduce_ring_textbook``), which first copies the
    input into the output and then works there: the first step sends its block straight from
    "in", and every reduction reads "in" and writes "out" in one step (``Reduce(src=...)``), so
    the whole input is never copied; same messages, same cost.

    Picture, generated from the schedule (p = 4, count = 8): each cell lists, for every block of the
    result, the ranks whose input that rank holds for the whole block (- for none), after each round.
    Redrawn by ``python -m commkit.algorithms._diagram --write``::

        round          rank 0               rank 1               rank 2               rank 3
        0              0    0    0    0     1    1    1    1     2    2    2    2     3    3    3    3
        1              0    0    0    03    01   1    1    1     2    12   2    2     3    3    23   3
        2              0    0    023  03    01   1    1    013   012  12   2    2     3    123  23   3
        3              0    0123 023  03    01   1    0123 013   012  12   2    0123  0123 123  23   3
        4              0123 0123 023  03    01   0123 0123 013   012  12   0123 0123  0123 123  23   0123
        5              0123 0123 023  0123  0123 0123 0123 013   012  0123 0123 0123  0123 123  0123 0123
        6              0123 0123 0123 0123  0123 0123 0123 0123  0123 0123 0123 0123  0123 0123 0123 0123
        msgs sent      6                    6                    6                    6
        elems sent     12                   12                   12                   12
        elems reduced  6                    6                    6                    6
        critical path (commkit.sim, each term alone): 6 messages, 12 elements sent, 6 reduced
    """
    if size == 1:
        yield Copy(("out", 0, count), ("in", 0, count))
        return
    blocks = partition(count, size)
    right, left = (rank + 1) % size, (rank - 1) % size
    # Phase 1: reduce-scatter. After p-1 steps this rank owns block (rank + 1) % p.
    # Each block is reduced here at most once, so every reduction reads this rank's
    # input and writes the output directly: no up-front copy of the whole vector.
    for step in range(size - 1):
        send, recv = blocks[(rank - step) % size], blocks[(rank - step - 1) % size]
        length = recv[1] - recv[0]
        yield Exchange(right, ("in" if step == 0 else "out", *send), left, ("tmp", 0, length))
        yield Reduce(("out", *recv), ("tmp", 0, length), op, src=("in", *recv))
    # Phase 2: allgather the reduced blocks around the same ring.
    for step in range(size - 1):
        send, recv = blocks[(rank - step + 1) % size], blocks[(rank - step) % size]
        yield Exchange(right, ("out", *send), left, ("out", *recv))


@algorithm("allreduce", "ring_textbook", commutative=True, scratch=lambda r, p, n: _max_block(n, p),
           cost=_allreduce_ring_cost, formula="2(p-1)α + 2((p-1)/p)nβ + ((p-1)/p)nγ", cost_exact="even",
           cost_bound="lower", symmetry="rotation")
def allreduce_ring_textbook(rank, size, count, op):
    """Ring allreduce as the textbook writes it: copy the input to the output, then reduce-scatter and allgather.

    The same ring as ``allreduce_ring``, without its optimisation: every step sends from and
    reduces into "out" (``out = out (op) received``), so it reads like the pseudo-code of
    Patarasuk and Yuan and of the MPI textbooks. Not in the selection table: force it with
    ``algorithm="ring_textbook"``.
    Restrictions: commutative op. Cost: 2(p-1)α + 2((p-1)/p)nβ + ((p-1)/p)nγ, as ``allreduce_ring``
    (the simulator counts copies as free); exact when count is a multiple of p, a lower bound
    otherwise. Sends 2(p-1) messages per rank, only to its right neighbour.

    Picture, generated from the schedule (p = 4, count = 8): each cell lists, for every block of the
    result, the ranks whose input that rank holds for the whole block (- for none), after each round.
    Redrawn by ``python -m commkit.algorithms._diagram --write``::

        round          rank 0               rank 1               rank 2               rank 3
        0              0    0    0    0     1    1    1    1     2    2    2    2     3    3    3    3
        1              0    0    0    03    01   1    1    1     2    12   2    2     3    3    23   3
        2              0    0    023  03    01   1    1    013   012  12   2    2     3    123  23   3
        3              0    0123 023  03    01   1    0123 013   012  12   2    0123  0123 123  23   3
        4              0123 0123 023  03    01   0123 0123 013   012  12   0123 0123  0123 123  23   0123
        5              0123 0123 023  0123  0123 0123 0123 013   012  0123 0123 0123  0123 123  0123 0123
        6              0123 0123 0123 0123  0123 0123 0123 0123  0123 0123 0123 0123  0123 0123 0123 0123
        msgs sent      6                    6                    6                    6
        elems sent     12                   12                   12                   12
        elems reduced  6                    6                    6                    6
        critical path (commkit.sim, each term alone): 6 messages, 12 elements sent, 6 reduced
    """
    yield Copy(("out", 0, count), ("in", 0, count))
    if size == 1:
        return
    blocks = partition(count, size)
    right, left = (rank + 1) % size, (rank - 1) % size
    # Phase 1: reduce-scatter. Step s: send block rank-s, receive block rank-s-1 and add it in.
    for step in range(size - 1):
        send, recv = blocks[(rank - step) % size], blocks[(rank - step - 1) % size]
        length = recv[1] - recv[0]
        yield Exchange(right, ("out", *send), left, ("tmp", 0, length))
        yield Reduce(("out", *recv), ("tmp", 0, length), op)
    # Phase 2: allgather. This rank's block rank+1 is complete; pass the complete blocks around.
    for step in range(size - 1):
        send, recv = blocks[(rank - step + 1) % size], blocks[(rank - step) % size]
        yield Exchange(right, ("out", *send), left, ("out", *recv))


@algorithm("reduce_scatter", "ring", commutative=True, scratch=two_widest_blocks,
           cost=lambda p, n, a, b, g: (p - 1) * a + (p - 1) / p * n * (b + g),
           formula="(p-1)α + ((p-1)/p)n(β+γ)", cost_exact="even", cost_bound="lower", symmetry="rotation")
def reduce_scatter_ring(rank, size, counts, op):
    """Ring reduce-scatter: partial sums of block b travel the ring and end, complete, at rank b.

    Restrictions: commutative op. Per-rank counts may differ (and be zero).
    Cost: (p-1)α + ((p-1)/p)n(β + γ), n = bytes of the whole vector; exact when all counts
    are equal, a lower bound otherwise.
    Scratch: two blocks, used alternately as the receive buffer and the next send.

    Picture, generated from the schedule (p = 4, count = (2, 2, 2, 2)): each cell lists, for every block
    of the result, the ranks whose input that rank holds for the whole block (- for none), after each
    round. Redrawn by ``python -m commkit.algorithms._diagram --write``::

        round          rank 0         rank 1         rank 2         rank 3
        0              0    0   0  0  1 1    1   1   2  2 2    2    3   3  3 3
        1              0    0   03 0  1 1    1   01  12 2 2    2    3   23 3 3
        2              0    023 03 0  1 1    013 01  12 2 2    012  123 23 3 3
        3              0123 023 0  0  1 0123 013 1   2  2 0123 012  123 3  3 0123
        msgs sent      3              3              3              3
        elems sent     6              6              6              6
        elems reduced  6              6              6              6
        critical path (commkit.sim, each term alone): 3 messages, 6 elements sent, 6 reduced
    """
    offsets = block_offsets(counts)

    def block(b):
        return offsets[b], offsets[b + 1]

    if size == 1:
        yield Copy(("out", 0, counts[0]), ("in", 0, counts[0]))
        return
    right, left = (rank + 1) % size, (rank - 1) % size
    width = max(counts)
    areas = [("tmp", 0), ("tmp", width)]
    lo, hi = block((rank - 1) % size)
    sending = ("in", lo, hi)  # step 0 passes on this rank's own contribution to block rank-1
    for step in range(size - 1):
        b = (rank - step - 2) % size
        lo, hi = block(b)
        name, base = areas[step % 2]
        recv = (name, base, base + hi - lo)
        # Receive the partial sum of block b from the left, add this rank's share of it.
        yield Exchange(right, sending, left, recv)
        yield Reduce(recv, ("in", lo, hi), op)
        sending = recv
    yield Copy(("out", 0, counts[rank]), sending)


@algorithm("allgather", "ring", cost=lambda p, n, a, b, g: (p - 1) * a + (p - 1) / p * n * b,
           formula="(p-1)α + ((p-1)/p)nβ", symmetry="rotation")
def allgather_ring(rank, size, count):
    """Ring allgather: each step passes the block received last step to the right.

    Restrictions: none. Cost: (p-1)α + ((p-1)/p)nβ, n = bytes gathered.

    Picture, generated from the schedule (p = 4, count = 1): each cell lists, for every block of the
    result, the ranks whose input that rank holds for the whole block (- for none), after each round.
    Redrawn by ``python -m commkit.algorithms._diagram --write``::

        round       rank 0   rank 1   rank 2   rank 3
        0           0 - - -  - 1 - -  - - 2 -  - - - 3
        1           0 - - 3  0 1 - -  - 1 2 -  - - 2 3
        2           0 - 2 3  0 1 - 3  0 1 2 -  - 1 2 3
        3           0 1 2 3  0 1 2 3  0 1 2 3  0 1 2 3
        msgs sent   3        3        3        3
        elems sent  3        3        3        3
        critical path (commkit.sim, each term alone): 3 messages, 3 elements sent
    """
    blocks = [(r * count, (r + 1) * count) for r in range(size)]
    yield Copy(("out", *blocks[rank]), ("in", 0, count))
    yield from _ring_allgather(rank, size, blocks, "out")


def binomial_scatter_blocks(rank, size, blocks, buf, root):
    """Binomial scatter inside one buffer: relative rank j ends up holding ``blocks[j]``.

    The root starts with every block; each subtree's blocks are contiguous, so one
    message per tree edge carries a whole subtree's share.
    """
    rel = (rank - root) % size

    def actual(j):
        return (j + root) % size

    def span(first, last):  # elements covering relative blocks [first, last)
        return blocks[first][0], blocks[last - 1][1]

    mask = 1
    while mask < size:
        if rel & mask:
            # Receive my subtree's blocks from my parent.
            yield Recv(actual(rel - mask), (buf, *span(rel, min(rel + mask, size))))
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:
        if rel + mask < size:
            # Hand the upper half of my subtree to the child at distance `mask`.
            yield Send(actual(rel + mask), (buf, *span(rel + mask, min(rel + 2 * mask, size))))
        mask >>= 1


def _broadcast_scatter(rank, size, count, root, blocks):
    """Phase 1 of :func:`broadcast_ring`: the root's copy, then block j down a binomial tree to relative rank j."""
    if rank == root:
        yield Copy(("out", 0, count), ("in", 0, count))
    if size > 1:
        yield from binomial_scatter_blocks(rank, size, blocks, "out", root)


@algorithm("broadcast", "ring",
           cost=lambda p, n, a, b, g: (log2ceil(p) + p - 1) * a + 2 * (p - 1) / p * n * b,
           formula="(⌈log p⌉ + p - 1)α + 2((p-1)/p)nβ", cost_exact="even", cost_bound="lower")
@phased
def broadcast_ring(rank, size, count, root):
    """Broadcast by binomial scatter then ring allgather (van de Geijn).

    Restrictions: none (count < p leaves some blocks empty).
    Cost: (⌈log p⌉ + p - 1)α + 2((p-1)/p)nβ (exact when count is a multiple of p, else a lower
    bound): about twice the bandwidth term's minimum,
    independent of p, which beats the binomial tree's ⌈log p⌉nβ for large n.

    Two phases (:func:`~commkit.algorithms.phased`): the scatter has a root, the allgather
    treats every rank alike (rotation symmetry), so the simulator runs the scatter for every
    rank and the allgather for all ranks at once.

    Picture, generated from the schedule (p = 4, count = 8, root = 0): each cell lists, for every block
    of the result, the ranks whose input that rank holds for the whole block (- for none), after each
    round. Redrawn by ``python -m commkit.algorithms._diagram --write``::

        round       rank 0   rank 1   rank 2   rank 3
        0           0 0 0 0  - - - -  - - - -  - - - -
        1           0 0 0 0  - - - -  - - 0 0  - - - -
        2           0 0 0 0  - 0 - -  - - 0 0  - - - 0
        3           0 0 0 0  0 0 - -  - 0 0 0  - - 0 0
        4           0 0 0 0  0 0 - 0  0 0 0 0  - 0 0 0
        5           0 0 0 0  0 0 0 0  0 0 0 0  0 0 0 0
        msgs sent   5        3        4        3
        elems sent  12       6        8        6
        critical path (commkit.sim, each term alone): 5 messages, 12 elements sent
    """
    blocks = partition(count, size)  # block j goes to relative rank j
    return (
        # Phase 1: scatter block j to relative rank j down a binomial tree.
        Phase(_broadcast_scatter(rank, size, count, root, blocks)),
        # Phase 2: ring allgather over relative ranks; every rank's steps are rank 0's shifted.
        Phase(_ring_allgather(rank, size, blocks, "out", root), symmetry="rotation"),
    )
