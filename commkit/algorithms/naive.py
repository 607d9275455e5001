"""Naive (linear) algorithms: one rank talks to every other rank in turn.

The teaching baseline for every collective. Linear algorithms send p-1
messages through one root, so their latency term grows as (p-1) alpha, but
they are the easiest to read and they reduce in exact rank order, so every op
(commutative or not) is allowed.
"""

from __future__ import annotations

from ..schedule import Copy, Recv, Reduce, Send, Transfer
from . import algorithm
from ._blocks import block_offsets

EMPTY = ("tmp", 0, 0)


def _linear_reduce(rank, size, count, op, root):
    """Root receives each rank's vector in rank order and folds it into ``out``.

    The textbook form copies rank 0's vector into ``out`` and folds every other
    one into it. Where rank 0's and rank 1's vectors do not both arrive in
    ``tmp`` (the root is one of them), the first fold reads both where they lie
    instead, ``Reduce(out, rank 1's, src=rank 0's)``: the same values in the same
    order, one copy fewer.
    """
    if rank != root:
        yield Send(root, ("in", 0, count))
        return
    whole, mine, incoming = ("out", 0, count), ("in", 0, count), ("tmp", 0, count)
    first = None  # rank 0's vector, where its copy into out was left for the first fold
    for source in range(size):
        operand = mine
        if source != root:
            # Wait for rank `source`'s vector; ranks are folded in rank order.
            yield Recv(source, incoming)
            operand = incoming
        if source == 0:
            if size > 1 and root <= 1:
                first = operand
            else:
                yield Copy(whole, operand)
        elif first is not None:
            yield Reduce(whole, operand, op, src=first)
            first = None
        else:
            yield Reduce(whole, operand, op)


def _linear_bcast(rank, size, count, root):
    """Root (whose data is already in ``out``) sends it to every other rank at once."""
    if rank == root:
        yield Transfer(sends=[(peer, ("out", 0, count)) for peer in range(size) if peer != root])
    else:
        yield Recv(root, ("out", 0, count))


@algorithm("barrier", "naive", cost=lambda p, n, a, b, g: 2 * (p - 1) * a, formula="2(p-1)α")
def barrier_naive(rank, size):
    """Naive barrier: everyone checks in with rank 0, which then releases everyone.

    Restrictions: none. Cost: 2(p-1)α.

    Picture, generated from the schedule (p = 4, count = 0): each cell lists the ranks a rank has heard
    from, directly or not, after each round. Redrawn by ``python -m commkit.algorithms._diagram
    --write``::

        round       rank 0  rank 1  rank 2  rank 3
        0           0       1       2       3
        1           0123    1       2       3
        2           0123    0123    0123    0123
        msgs sent   3       1       1       1
        elems sent  0       0       0       0
        critical path (commkit.sim, each term alone): 6 messages, 0 elements sent
    """
    if size == 1:
        return
    if rank == 0:
        yield Transfer(recvs=[(peer, EMPTY) for peer in range(1, size)])
        yield Transfer(sends=[(peer, EMPTY) for peer in range(1, size)])
    else:
        yield Send(0, EMPTY)
        yield Recv(0, EMPTY)


@algorithm("broadcast", "naive", cost=lambda p, n, a, b, g: (p - 1) * (a + n * b), formula="(p-1)(α+nβ)")
def broadcast_naive(rank, size, count, root):
    """Naive broadcast: the root sends the whole vector to each other rank.

    Restrictions: none. Cost: (p-1)(α + nβ).

    Picture, generated from the schedule (p = 4, count = 8, root = 0): each cell lists, for every block
    of the result, the ranks whose input that rank holds for the whole block (- for none), after each
    round. Redrawn by ``python -m commkit.algorithms._diagram --write``::

        round       rank 0   rank 1   rank 2   rank 3
        0           0 0 0 0  - - - -  - - - -  - - - -
        1           0 0 0 0  0 0 0 0  0 0 0 0  0 0 0 0
        msgs sent   3        0        0        0
        elems sent  24       0        0        0
        critical path (commkit.sim, each term alone): 3 messages, 24 elements sent
    """
    if rank == root:
        yield Copy(("out", 0, count), ("in", 0, count))
    yield from _linear_bcast(rank, size, count, root)


@algorithm("reduce", "naive", scratch=lambda r, p, n: n,
           cost=lambda p, n, a, b, g: (p - 1) * (a + n * b + n * g), formula="(p-1)(α+nβ+nγ)")
def reduce_naive(rank, size, count, op, root):
    """Naive reduce: the root receives every vector in rank order and reduces it.

    Restrictions: none (rank order is kept, so non-commutative ops work).
    Cost: (p-1)(α + nβ + nγ).

    Picture, generated from the schedule (p = 4, count = 8, root = 0): each cell lists, for every block
    of the result, the ranks whose input that rank holds for the whole block (- for none), after each
    round. Redrawn by ``python -m commkit.algorithms._diagram --write``::

        round          rank 0               rank 1   rank 2   rank 3
        0              0    0    0    0     1 1 1 1  2 2 2 2  3 3 3 3
        1              01   01   01   01    1 1 1 1  2 2 2 2  3 3 3 3
        2              012  012  012  012   1 1 1 1  2 2 2 2  3 3 3 3
        3              0123 0123 0123 0123  1 1 1 1  2 2 2 2  3 3 3 3
        msgs sent      0                    1        1        1
        elems sent     0                    8        8        8
        elems reduced  24                   0        0        0
        critical path (commkit.sim, each term alone): 3 messages, 24 elements sent, 24 reduced
    """
    yield from _linear_reduce(rank, size, count, op, root)


@algorithm("allreduce", "naive", scratch=lambda r, p, n: n,
           cost=lambda p, n, a, b, g: 2 * (p - 1) * (a + n * b) + (p - 1) * n * g,
           formula="2(p-1)(α+nβ) + (p-1)nγ")
def allreduce_naive(rank, size, count, op):
    """Naive allreduce: linear reduce to rank 0, then linear broadcast from rank 0.

    Restrictions: none. Cost: 2(p-1)(α + nβ) + (p-1)nγ.

    Picture, generated from the schedule (p = 4, count = 8): each cell lists, for every block of the
    result, the ranks whose input that rank holds for the whole block (- for none), after each round.
    Redrawn by ``python -m commkit.algorithms._diagram --write``::

        round          rank 0               rank 1               rank 2               rank 3
        0              0    0    0    0     1    1    1    1     2    2    2    2     3    3    3    3
        1              01   01   01   01    1    1    1    1     2    2    2    2     3    3    3    3
        2              012  012  012  012   1    1    1    1     2    2    2    2     3    3    3    3
        3              0123 0123 0123 0123  1    1    1    1     2    2    2    2     3    3    3    3
        4              0123 0123 0123 0123  0123 0123 0123 0123  0123 0123 0123 0123  0123 0123 0123 0123
        msgs sent      3                    1                    1                    1
        elems sent     24                   8                    8                    8
        elems reduced  24                   0                    0                    0
        critical path (commkit.sim, each term alone): 6 messages, 48 elements sent, 24 reduced
    """
    yield from _linear_reduce(rank, size, count, op, 0)
    yield from _linear_bcast(rank, size, count, 0)


@algorithm("gather", "naive", cost=lambda p, n, a, b, g: (p - 1) * a + (p - 1) / p * n * b,
           formula="(p-1)α + ((p-1)/p)nβ")
def gather_naive(rank, size, count, root):
    """Naive gather: every rank sends its block straight to the root.

    Restrictions: none. Cost: (p-1)α + ((p-1)/p)nβ, n = bytes gathered.

    Picture, generated from the schedule (p = 4, count = 1, root = 0): each cell lists, for every block
    of the result, the ranks whose input that rank holds for the whole block (- for none), after each
    round. Redrawn by ``python -m commkit.algorithms._diagram --write``::

        round       rank 0   rank 1   rank 2   rank 3
        0           0 - - -  - 1 - -  - - 2 -  - - - 3
        1           0 1 2 3  - 1 - -  - - 2 -  - - - 3
        msgs sent   0        1        1        1
        elems sent  0        1        1        1
        critical path (commkit.sim, each term alone): 3 messages, 3 elements sent
    """
    if rank != root:
        yield Send(root, ("in", 0, count))
        return
    yield Copy(("out", root * count, (root + 1) * count), ("in", 0, count))
    yield Transfer(recvs=[(peer, ("out", peer * count, (peer + 1) * count)) for peer in range(size) if peer != root])


@algorithm("scatter", "naive", cost=lambda p, n, a, b, g: (p - 1) * a + (p - 1) / p * n * b,
           formula="(p-1)α + ((p-1)/p)nβ")
def scatter_naive(rank, size, count, root):
    """Naive scatter: the root sends each rank its block directly.

    Restrictions: none. Cost: (p-1)α + ((p-1)/p)nβ, n = bytes scattered.

    Picture, generated from the schedule (p = 4, count = 1, root = 0): each cell lists, for every block
    of the result, the ranks whose input that rank holds for the whole block (- for none), after each
    round. Redrawn by ``python -m commkit.algorithms._diagram --write``::

        round       rank 0   rank 1   rank 2   rank 3
        0           0 0 0 0  - - - -  - - - -  - - - -
        1           0 0 0 0  - 0 - -  - - 0 -  - - - 0
        msgs sent   3        0        0        0
        elems sent  3        0        0        0
        critical path (commkit.sim, each term alone): 3 messages, 3 elements sent
    """
    if rank != root:
        yield Recv(root, ("out", 0, count))
        return
    yield Transfer(sends=[(peer, ("in", peer * count, (peer + 1) * count)) for peer in range(size) if peer != root])
    yield Copy(("out", 0, count), ("in", root * count, (root + 1) * count))


@algorithm("allgather", "naive",
           cost=lambda p, n, a, b, g: (p - 1) * a + (p - 1) / p * n * b + (p - 1) * (a + n * b),
           formula="(p-1)α + ((p-1)/p)nβ + (p-1)(α+nβ)")
def allgather_naive(rank, size, count):
    """Naive allgather: gather every block at rank 0, then broadcast the whole vector.

    Restrictions: none. Cost: (p-1)α + ((p-1)/p)nβ + (p-1)(α + nβ), n = bytes gathered.

    Picture, generated from the schedule (p = 4, count = 1): each cell lists, for every block of the
    result, the ranks whose input that rank holds for the whole block (- for none), after each round.
    Redrawn by ``python -m commkit.algorithms._diagram --write``::

        round       rank 0   rank 1   rank 2   rank 3
        0           0 - - -  - 1 - -  - - 2 -  - - - 3
        1           0 1 2 3  - 1 - -  - - 2 -  - - - 3
        2           0 1 2 3  0 1 2 3  0 1 2 3  0 1 2 3
        msgs sent   3        1        1        1
        elems sent  12       1        1        1
        critical path (commkit.sim, each term alone): 6 messages, 15 elements sent
    """
    yield from gather_naive(rank, size, count, 0)
    yield from _linear_bcast(rank, size, size * count, 0)


@algorithm("reduce_scatter", "naive", scratch=lambda r, p, counts: 2 * sum(counts) if r == 0 else 0,
           cost=lambda p, n, a, b, g: (p - 1) * (a + n * b + n * g) + (p - 1) * a + (p - 1) / p * n * b,
           formula="(p-1)(α+nβ+nγ) + (p-1)α + ((p-1)/p)nβ", cost_exact="even", cost_bound="either")
def reduce_scatter_naive(rank, size, counts, op):
    """Naive reduce-scatter: linear reduce of the whole vector to rank 0, then rank 0 sends each block.

    Restrictions: none (rank order kept). Cost: (p-1)(α + nβ + nγ) + (p-1)α + ((p-1)/p)nβ,
    n = bytes of the whole vector; exact when all counts are equal, otherwise off by the
    difference between rank 0's block and an average one (either way).

    Picture, generated from the schedule (p = 4, count = (2, 2, 2, 2)): each cell lists, for every block
    of the result, the ranks whose input that rank holds for the whole block (- for none), after each
    round. Redrawn by ``python -m commkit.algorithms._diagram --write``::

        round          rank 0               rank 1      rank 2      rank 3
        0              0    0    0    0     1 1    1 1  2 2 2    2  3 3 3 3
        1              01   01   01   01    1 1    1 1  2 2 2    2  3 3 3 3
        2              012  012  012  012   1 1    1 1  2 2 2    2  3 3 3 3
        3              0123 0123 0123 0123  1 1    1 1  2 2 2    2  3 3 3 3
        4              0123 0123 0123 0123  1 0123 1 1  2 2 0123 2  3 3 3 0123
        msgs sent      3                    1           1           1
        elems sent     6                    8           8           8
        elems reduced  24                   0           0           0
        critical path (commkit.sim, each term alone): 6 messages, 30 elements sent, 24 reduced
    """
    offsets = block_offsets(counts)
    total = offsets[-1]
    if rank != 0:
        yield Send(0, ("in", 0, total))
        yield Recv(0, ("out", 0, counts[rank]))
        return
    # `out` holds only rank 0's block, so rank 0 accumulates the whole vector in the
    # first half of tmp and receives each rank's vector into the second half.
    acc = ("tmp", 0, total)
    yield Copy(acc, ("in", 0, total))
    for source in range(1, size):
        yield Recv(source, ("tmp", total, 2 * total))
        yield Reduce(acc, ("tmp", total, 2 * total), op)
    yield Transfer(sends=[(peer, ("tmp", offsets[peer], offsets[peer + 1])) for peer in range(1, size)])
    yield Copy(("out", 0, counts[0]), ("tmp", 0, counts[0]))


@algorithm("alltoall", "naive", cost=lambda p, n, a, b, g: (p - 1) * (a + n * b), formula="(p-1)(α+nβ)",
           symmetry="rotation")
def alltoall_naive(rank, size, count):
    """Naive all-to-all: post every send and every receive at once, then wait for all.

    Restrictions: none. Cost: (p-1)(α + nβ), n = bytes of one block (what a rank sends each peer).

    Picture, generated from the schedule (p = 4, count = 1): each cell lists, for every block of the
    result, the ranks whose input that rank holds for the whole block (- for none), after each round.
    Redrawn by ``python -m commkit.algorithms._diagram --write``::

        round       rank 0   rank 1   rank 2   rank 3
        0           0 - - -  - 1 - -  - - 2 -  - - - 3
        1           0 1 2 3  0 1 2 3  0 1 2 3  0 1 2 3
        msgs sent   3        3        3        3
        elems sent  3        3        3        3
        critical path (commkit.sim, each term alone): 3 messages, 3 elements sent
    """
    yield Copy(("out", rank * count, (rank + 1) * count), ("in", rank * count, (rank + 1) * count))
    peers = [peer for peer in range(size) if peer != rank]
    yield Transfer(
        sends=[(peer, ("in", peer * count, (peer + 1) * count)) for peer in peers],
        recvs=[(peer, ("out", peer * count, (peer + 1) * count)) for peer in peers],
    )


@algorithm("scan", "naive", scratch=lambda r, p, n: n,
           cost=lambda p, n, a, b, g: (p - 1) * (a + n * b + n * g), formula="(p-1)(α+nβ+nγ)")
def scan_naive(rank, size, count, op):
    """Naive (chain) inclusive scan: rank r waits for the prefix of ranks < r, adds its own, passes it on.

    Restrictions: none. Cost: (p-1)(α + nβ + nγ) on the critical path.

    Picture, generated from the schedule (p = 4, count = 8): each cell lists, for every block of the
    result, the ranks whose input that rank holds for the whole block (- for none), after each round.
    Redrawn by ``python -m commkit.algorithms._diagram --write``::

        round          rank 0   rank 1       rank 2           rank 3
        0              0 0 0 0  1  1  1  1   2   2   2   2    3    3    3    3
        1              0 0 0 0  01 01 01 01  2   2   2   2    3    3    3    3
        2              0 0 0 0  01 01 01 01  012 012 012 012  3    3    3    3
        3              0 0 0 0  01 01 01 01  012 012 012 012  0123 0123 0123 0123
        msgs sent      1        1            1                0
        elems sent     8        8            8                0
        elems reduced  0        8            8                8
        critical path (commkit.sim, each term alone): 3 messages, 24 elements sent, 24 reduced
    """
    yield Copy(("out", 0, count), ("in", 0, count))
    if rank > 0:
        yield Recv(rank - 1, ("tmp", 0, count))
        yield Reduce(("out", 0, count), ("tmp", 0, count), op, operand_first=True)
    if rank < size - 1:
        yield Send(rank + 1, ("out", 0, count))


@algorithm("exscan", "naive", scratch=lambda r, p, n: n,
           cost=lambda p, n, a, b, g: (p - 1) * (a + n * b) + max(p - 2, 0) * n * g,
           formula="(p-1)(α+nβ) + (p-2)nγ")
def exscan_naive(rank, size, count, op):
    """Naive (chain) exclusive scan: rank r receives the prefix of ranks < r and forwards prefix (op) own.

    Restrictions: none. Rank 0's result is the op's identity. Cost: (p-1)(α + nβ) + (p-2)nγ.

    Picture, generated from the schedule (p = 4, count = 8): each cell lists, for every block of the
    result, the ranks whose input that rank holds for the whole block (- for none), after each round.
    Redrawn by ``python -m commkit.algorithms._diagram --write``::

        round          rank 0   rank 1   rank 2       rank 3
        0              - - - -  - - - -  -  -  -  -   -   -   -   -
        1              - - - -  0 0 0 0  -  -  -  -   -   -   -   -
        2              - - - -  0 0 0 0  01 01 01 01  -   -   -   -
        3              - - - -  0 0 0 0  01 01 01 01  012 012 012 012
        msgs sent      1        1        1            0
        elems sent     8        8        8            0
        elems reduced  0        8        8            0
        critical path (commkit.sim, each term alone): 3 messages, 24 elements sent, 16 reduced
    """
    if rank == 0:
        if size > 1:
            yield Send(1, ("in", 0, count))
        return
    yield Recv(rank - 1, ("out", 0, count))
    if rank < size - 1:
        yield Copy(("tmp", 0, count), ("out", 0, count))
        yield Reduce(("tmp", 0, count), ("in", 0, count), op)
        yield Send(rank + 1, ("tmp", 0, count))
