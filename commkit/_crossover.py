"""Where the winner of a size changes: a grid scan with each change bisected to the exact size.

One search serves the cost model's regimes and the pictures' predicted
crossovers: both ask "from which size on does another algorithm win?", of a
function that is cheap to evaluate but not monotone (a segmented algorithm's
segment count jumps), so a scan alone would place a change only between two
grid points, and bisection alone would miss an algorithm that wins on an island.

This module imports nothing from commkit, so any module may use it.
"""

from __future__ import annotations

from typing import Callable, Hashable, Sequence

__all__ = ["changes"]


def changes(winner: Callable[[int], Hashable], grid: Sequence[int]) -> list[tuple[int, Hashable, Hashable]]:
    """Every size at which ``winner(size)`` changes, scanning ``grid`` and bisecting between its points.

    Between two consecutive grid points whose winners differ, bisection finds a
    size where the winner changes (the first one, when there is only one change
    between the points), and the search goes on from there until the winner is
    the next grid point's. A winner that wins only strictly between two grid
    points, and loses again before the next one, may not be seen: make the grid
    dense enough for the islands that matter.

    Args:
        winner: a function of an integer size (bytes); its values are compared with ``!=``.
        grid: increasing integer sizes; the first is where the scan starts.

    Returns:
        ``(first_size, old_winner, new_winner)`` for each change, smallest first;
        empty when ``grid`` has fewer than two points or the winner never changes.

    Cost: ``len(grid)`` evaluations of ``winner``, plus about ``log2(gap)`` more for each
    change, ``gap`` being the distance between the two grid points it lies between.
    """
    out = []
    if not grid:
        return out
    prev, current = grid[0], winner(grid[0])
    for point in grid[1:]:
        while winner(point) != current:
            lo, hi = prev, point  # winner(lo) == current != winner(hi): find the first size that changes
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if winner(mid) == current:
                    lo = mid
                else:
                    hi = mid
            new = winner(hi)
            out.append((hi, current, new))
            current, prev = new, hi
        prev = point
    return out
