"""Chains: the root passes the vector to the next rank, which passes it on, p-1 links in a line.

Why a chain. It is the simplest pipeline: every rank talks to the rank before
it and the rank after it (relative to the root), so every link carries the
vector once. Forwarding the whole vector makes the last rank wait p-1 vector
times; cut into K segments, a rank forwards segment k-1 while segment k
arrives (one :class:`~commkit.schedule.Exchange`), and the depth is paid once
per segment: (p + K - 2) segment times (MPICH and Open MPI segment their chain
broadcasts the same way). Segments are cut by :func:`.pipelined.segments`;
the segment size is the schedule's ``segment`` argument
(``algorithm="chain_pipelined:256K"``, a selection rule's ``segment_bytes``),
else ``COMMKIT_SEGMENT_ELEMENTS``, else 65536 elements (:mod:`.pipelined`).
"""

from __future__ import annotations

from ..schedule import Copy, Exchange, Recv, Send
from . import algorithm
from .pipelined import cost_segments, segments


def _chain_cost(p, n, a, b, g):
    segs = cost_segments(n)
    if p == 1 or not segs:
        return 0.0
    # The first segment crosses the p-2 links before the last one; the last link then carries
    # all K segments back to back. Segments never grow (partition), so the first is the longest.
    return (p - 2) * (a + segs[0] * b) + len(segs) * a + segs.total() * b


@algorithm("broadcast", "chain_pipelined", cost=_chain_cost,
           formula="(p-2)(α + s₀β) + Kα + nβ, s₀ the bytes of the first (longest) segment; "
                   "(p+K-2)(α + nβ/K) for equal segments")
def broadcast_chain_pipelined(rank, size, count, root, segment=None):
    """Pipelined chain broadcast: root -> root+1 -> ... -> root-1, the vector cut into K segments.

    Restrictions: none; every root, every count (count 0 sends nothing).
    Segments: K = ⌈count/S⌉, S = ``COMMKIT_SEGMENT_ELEMENTS`` or 65536 elements, near-equal
    (the first count mod K one element longer). A rank inside the chain receives segment 0,
    then in each of K-1 exchanges forwards segment k-1 while it receives segment k, then
    forwards segment K-1: K+1 transfers, so the pipeline fills once and every link is busy.
    Cost: (p-2)(α + s₀β) + Kα + nβ, s₀ the bytes of the first (longest) segment: the first
    segment crosses p-2 links, then the last link carries all K segments; for equal segments
    (p + K - 2)(α + nβ/K), against the unsegmented chain's (p-1)(α + nβ). Exact for every p
    and count. Messages: K per rank except the last of the chain, which sends none; each
    carries one segment to the next rank (n bytes sent per rank).
    In place (out is the input, at the root): the root sends from "in" and copies "in" to
    "out" only in the copy the executor skips when they are one array, so no copy of the
    input is needed.

    Picture, generated from the schedule (p = 4, count = 8, root = 0, segment = 2): each cell lists, for
    every block of the result, the ranks whose input that rank holds for the whole block (- for none),
    after each round. Redrawn by ``python -m commkit.algorithms._diagram --write``::

        round       rank 0   rank 1   rank 2   rank 3
        0           0 0 0 0  - - - -  - - - -  - - - -
        1           0 0 0 0  0 - - -  - - - -  - - - -
        2           0 0 0 0  0 0 - -  0 - - -  - - - -
        3           0 0 0 0  0 0 0 -  0 0 - -  0 - - -
        4           0 0 0 0  0 0 0 0  0 0 0 -  0 0 - -
        5           0 0 0 0  0 0 0 0  0 0 0 0  0 0 0 -
        6           0 0 0 0  0 0 0 0  0 0 0 0  0 0 0 0
        msgs sent   4        4        4        0
        elems sent  8        8        8        0
        critical path (commkit.sim, each term alone): 6 messages, 12 elements sent
    """
    whole = ("out", 0, count)
    segs = segments(count, segment)
    rel = (rank - root) % size
    if rel == 0:
        # The root sends every segment straight from its input; the copy into its own output
        # rides along with the first send (there is nothing to copy in place).
        copy = (Copy(whole, ("in", 0, count)),)
        if size == 1 or not segs:
            yield from copy
            return
        nxt = (rank + 1) % size
        for k, (lo, hi) in enumerate(segs):
            yield Send(nxt, ("in", lo, hi), overlap=copy if k == 0 else ())
        return
    if not segs:
        return
    prev = (rank - 1) % size
    if rel == size - 1:
        # The end of the chain only receives.
        for lo, hi in segs:
            yield Recv(prev, ("out", lo, hi))
        return
    nxt = (rank + 1) % size
    yield Recv(prev, ("out", *segs[0]))
    for k in range(1, len(segs)):
        # Forward segment k-1 to the next rank while segment k arrives from the previous one.
        yield Exchange(nxt, ("out", *segs[k - 1]), prev, ("out", *segs[k]))
    yield Send(nxt, ("out", *segs[-1]))
