"""The dissemination barrier (Hensgen, Finkel and Manber, 1988).

In round k each rank signals ``rank + 2**k`` and waits for ``rank - 2**k``;
after ⌈log2 p⌉ rounds every rank has heard, directly or not, from every other,
so none can leave before all have arrived. Works for any p.
"""

from __future__ import annotations

from ..schedule import Exchange
from . import algorithm, log2ceil

EMPTY = ("tmp", 0, 0)


@algorithm("barrier", "dissemination", cost=lambda p, n, a, b, g: log2ceil(p) * a, formula="⌈log p⌉α",
           symmetry="rotation")
def barrier_dissemination(rank, size):
    """Dissemination barrier: round k signals rank + 2**k and waits for rank - 2**k.

    Restrictions: none. Cost: ⌈log p⌉α.

    Picture, generated from the schedule (p = 4, count = 0): each cell lists the ranks a rank has heard
    from, directly or not, after each round. Redrawn by ``python -m commkit.algorithms._diagram
    --write``::

        round       rank 0  rank 1  rank 2  rank 3
        0           0       1       2       3
        1           03      01      12      23
        2           0123    0123    0123    0123
        msgs sent   2       2       2       2
        elems sent  0       0       0       0
        critical path (commkit.sim, each term alone): 2 messages, 0 elements sent
    """
    dist = 1
    while dist < size:
        yield Exchange((rank + dist) % size, EMPTY, (rank - dist) % size, EMPTY)
        dist <<= 1
