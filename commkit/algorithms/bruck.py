"""Bruck's algorithms: ⌈log2 p⌉ rounds for any p, at the price of local rotations.

In round k every rank sends to ``rank - 2**k`` (allgather) or ``rank + 2**k``
(alltoall) and receives from the opposite side. Data is kept in an order
relative to the rank, so what moves each round is a contiguous (allgather) or
bit-selected (alltoall) set of blocks; a final rotation puts blocks in rank
order. Good for small messages at any process count.
"""

from __future__ import annotations

from ..schedule import Copy, Exchange
from . import algorithm, log2ceil


@algorithm("allgather", "bruck", scratch=lambda r, p, n: p * n,
           cost=lambda p, n, a, b, g: log2ceil(p) * a + (p - 1) / p * n * b,
           formula="⌈log p⌉α + ((p-1)/p)nβ", symmetry="rotation")
def allgather_bruck(rank, size, count):
    """Bruck allgather: tmp block i holds rank (rank + i)'s block; round k doubles what is held.

    Restrictions: none. Cost: ⌈log p⌉α + ((p-1)/p)nβ, n = bytes gathered.

    Picture, generated from the schedule (p = 4, count = 1): each cell lists, for every block of the
    result, the ranks whose input that rank holds for the whole block (- for none), after each round.
    Redrawn by ``python -m commkit.algorithms._diagram --write``::

        round       rank 0   rank 1   rank 2   rank 3
        0           0 - - -  - 1 - -  - - 2 -  - - - 3
        1           0 1 - -  - 1 2 -  - - 2 3  0 - - 3
        2           0 1 2 3  0 1 2 3  0 1 2 3  0 1 2 3
        msgs sent   2        2        2        2
        elems sent  3        3        3        3
        critical path (commkit.sim, each term alone): 2 messages, 3 elements sent
    """
    yield Copy(("tmp", 0, count), ("in", 0, count))
    dist = 1
    while dist < size:
        n = min(dist, size - dist)
        # Send the first n blocks I hold to rank - dist; rank + dist sends me its first n,
        # which are the blocks of ranks rank + dist ... rank + dist + n - 1.
        yield Exchange((rank - dist) % size, ("tmp", 0, n * count),
                       (rank + dist) % size, ("tmp", dist * count, (dist + n) * count))
        dist <<= 1
    # Rotate: tmp block i belongs to rank (rank + i) % p.
    head = (size - rank) * count
    yield Copy(("out", rank * count, size * count), ("tmp", 0, head))
    yield Copy(("out", 0, rank * count), ("tmp", head, size * count))


def _alltoall_bruck_scratch(rank, size, count):
    return size * count + 2 * ((size + 1) // 2) * count


def _one_bits(p):
    """Number of 1 bits in the binary forms of 0, 1, ..., p-1: the blocks Bruck's alltoall sends in all."""
    total, bit = 0, 1
    while bit < p:
        period = bit << 1
        total += (p // period) * bit + max(0, p % period - bit)
        bit = period
    return total


@algorithm("alltoall", "bruck", scratch=_alltoall_bruck_scratch,
           cost=lambda p, n, a, b, g: log2ceil(p) * a + _one_bits(p) * n * b,
           formula="⌈log p⌉α + b(p)nβ, b(p) = number of 1 bits in 0, 1, ..., p-1 "
                   "((p/2)log p for p a power of two)",
           symmetry="rotation")
def alltoall_bruck(rank, size, count):
    """Bruck all-to-all: rotate, then in round k forward every block whose index has bit k set.

    Restrictions: none. Cost: ⌈log p⌉α + b(p)nβ, n = bytes of one block, b(p) = the number of
    1 bits in 0, 1, ..., p-1 (round k forwards the b_k blocks whose index has bit k set;
    b(p) = (p/2)log p for p a power of two): fewer messages than pairwise, more bytes, so it
    wins only for small blocks.
    Scratch: the rotated vector plus a pack and an unpack area.

    Picture, generated from the schedule (p = 4, count = 1): each cell lists, for every block of the
    result, the ranks whose input that rank holds for the whole block (- for none), after each round.
    Redrawn by ``python -m commkit.algorithms._diagram --write``::

        round       rank 0   rank 1   rank 2   rank 3
        0           0 - - -  - 1 - -  - - 2 -  - - - 3
        1           0 - - 3  0 1 - -  - 1 2 -  - - 2 3
        2           0 1 2 3  0 1 2 3  0 1 2 3  0 1 2 3
        msgs sent   2        2        2        2
        elems sent  4        4        4        4
        critical path (commkit.sim, each term alone): 2 messages, 4 elements sent
    """
    data = 0
    pack = size * count
    unpack = pack + ((size + 1) // 2) * count
    # Phase 1: rotate so tmp block i holds the data destined for rank (rank + i) % p.
    head = (size - rank) * count
    yield Copy(("tmp", data, data + head), ("in", rank * count, size * count))
    yield Copy(("tmp", data + head, data + size * count), ("in", 0, rank * count))
    # Phase 2: in round k, blocks whose index has bit k set move 2**k ranks forward.
    dist = 1
    while dist < size:
        chosen = [i for i in range(size) if i & dist]
        for j, i in enumerate(chosen):
            yield Copy(("tmp", pack + j * count, pack + (j + 1) * count), ("tmp", data + i * count, data + (i + 1) * count))
        n = len(chosen) * count
        yield Exchange((rank + dist) % size, ("tmp", pack, pack + n), (rank - dist) % size, ("tmp", unpack, unpack + n))
        for j, i in enumerate(chosen):
            yield Copy(("tmp", data + i * count, data + (i + 1) * count), ("tmp", unpack + j * count, unpack + (j + 1) * count))
        dist <<= 1
    # Phase 3: tmp block i now came from rank (rank - i) % p; put it in its place.
    for i in range(size):
        src = (rank - i) % size
        yield Copy(("out", src * count, (src + 1) * count), ("tmp", data + i * count, data + (i + 1) * count))
