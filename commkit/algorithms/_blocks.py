"""Where the blocks of uneven counts lie in a flat buffer: the layout helper every algorithm over counts shares.

``schedule.partition`` splits a count into p nearly equal blocks; the vector
collectives and reduce-scatter take one count per rank instead, and lay the
blocks out back to back in rank order. This module registers no algorithm.
"""

from __future__ import annotations

__all__ = ["block_offsets"]


def block_offsets(counts) -> list[int]:
    """Prefix sums of ``counts``: block q occupies ``[offsets[q], offsets[q + 1])``; the last entry is the total.

    Args:
        counts: the number of elements of each block, in order (non-negative ints).

    Returns:
        ``len(counts) + 1`` offsets, starting at 0.

    Cost: O(len(counts)).
    """
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    return offsets
