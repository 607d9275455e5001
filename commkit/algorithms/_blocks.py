"""Where the blocks of uneven counts lie in a flat buffer: the layout helper every algorithm over counts shares.

``schedule.partition`` splits a count into p nearly equal blocks; the vector
collectives and reduce-scatter take one count per rank instead, and lay the
blocks out back to back in rank order. This module registers no algorithm.
"""

from __future__ import annotations

import functools
import itertools

__all__ = ["block_offsets"]


def block_offsets(counts) -> tuple[int, ...]:
    """Prefix sums of ``counts``: block q occupies ``[offsets[q], offsets[q + 1])``; the last entry is the total.

    Args:
        counts: the number of elements of each block, in order (non-negative ints).

    Returns:
        ``len(counts) + 1`` offsets, starting at 0 (a tuple, shared between callers:
        every rank of a simulated world asks for the same one).

    Cost: O(len(counts)) the first time for given counts; O(1) when asked again for the same tuple
    object (as every rank of a simulated world is); else a tuple conversion and a cache lookup,
    which hashes all the counts.
    """
    global _last
    last = _last  # one read: another thread may replace it, never change it
    if counts is last[0]:  # the same tuple again (every rank of a simulated world): no O(p) hash
        return last[1]
    offsets = _offsets(counts if type(counts) is tuple else tuple(counts))
    if type(counts) is tuple:
        _last = (counts, offsets)
    return offsets


_last: tuple = (None, None)  # the counts tuple asked for last, and its offsets


@functools.lru_cache(maxsize=64)
def _offsets(counts: tuple) -> tuple[int, ...]:
    return (0, *itertools.accumulate(counts))
