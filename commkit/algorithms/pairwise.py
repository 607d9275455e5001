"""Pairwise exchange: p-1 rounds, each rank swapping one block with one partner.

Each round every rank sends exactly one block and receives exactly one, so no
link carries more than one message at a time: the choice for large all-to-all
messages.
"""

from __future__ import annotations

from ..schedule import Copy, Exchange
from . import algorithm


@algorithm("alltoall", "pairwise", cost=lambda p, n, a, b, g: (p - 1) * (a + n * b), formula="(p-1)(α+nβ)",
           symmetry="rotation")
def alltoall_pairwise(rank, size, count):
    """Pairwise all-to-all: in round i, send to rank + i and receive from rank - i.

    Restrictions: none. Cost: (p-1)(α + nβ), n = bytes of one block (what a rank sends each peer).

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
    yield Copy(("out", rank * count, (rank + 1) * count), ("in", rank * count, (rank + 1) * count))
    for i in range(1, size):
        dest, source = (rank + i) % size, (rank - i) % size
        yield Exchange(dest, ("in", dest * count, (dest + 1) * count),
                       source, ("out", source * count, (source + 1) * count))
