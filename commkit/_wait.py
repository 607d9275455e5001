"""The pauses of a polling wait: one rhythm for every loop that polls until something happens or time runs out.

A wait that polls spins first (most waits end within microseconds, and a sleep
costs tens of microseconds of latency), then sleeps, each sleep twice the one
before up to a ceiling, so that a long wait costs little CPU and still ends soon
after its event. The executor, the requests and the transports poll their
messages with the defaults below; the store's clients (``transports/_store.py``)
retry a connection or poll a server with longer first sleeps and ceilings,
since each of their polls is a round trip or a new connection.

This module imports nothing from commkit, so any module may use it.
"""

from __future__ import annotations

import os
import time

__all__ = ["MAX_SLEEP", "SPIN_SECONDS", "Backoff", "oversubscribed", "share_cores"]

# A polling wait spins this long before it sleeps: most waits end within it, and a sleep
# costs tens of microseconds of latency.
SPIN_SECONDS = 2e-4
# The longest sleep between two polls: short enough that a wait ends within a millisecond
# of its event, long enough that oversubscribed ranks leave the core to the peer they wait on.
MAX_SLEEP = 1e-3

# More ranks than cores on this host (set by share_cores): a spinning wait gives its core away after each
# poll. Read by every spinning loop, here and in the transports.
oversubscribed = False


def share_cores(ranks_here: int, cores: int | None = None) -> bool:
    """Tell the waits how many ranks share this host's cores; True when they are more than the cores.

    With more ranks than cores (4 ranks on a 2-core laptop, a notebook, a
    classroom), a rank that spins while it waits holds a core the rank it waits
    for needs: every spinning poll then yields the core (``os.sched_yield``),
    which costs a fraction of a microsecond when no one else wants it. The
    transports call this once they know how many ranks run here.
    """
    global oversubscribed
    cores = (os.cpu_count() or 1) if cores is None else cores
    oversubscribed = ranks_here > cores
    return oversubscribed


class Backoff:
    """The pauses of a polling wait: spin for ``spin`` seconds, then sleep ``first`` seconds, doubling up to ``most``.

    ``timeout`` (seconds, or None for no limit) counts from the creation, or
    from the last :meth:`progressed`. Poll, and call :meth:`pause` after each
    poll that found nothing::

        backoff = Backoff(timeout)
        while not ready():
            if not backoff.pause():
                return False  # timed out

    No sleep runs past the timeout, so the last poll comes at the deadline.

    Args:
        timeout: seconds before :meth:`pause` answers False; None waits forever.
        spin: seconds from the start during which :meth:`pause` does not sleep.
        first: the first sleep, in seconds (and the sleep after :meth:`progressed`).
        most: the longest sleep, in seconds.

    Cost: one ``time.monotonic()`` per pause, and one ``time.sleep`` once the spin is over (while
    spinning, one ``os.sched_yield()`` too where ranks outnumber cores: :func:`share_cores`).
    """

    __slots__ = ("deadline", "first", "most", "sleep", "spin", "start", "timeout")

    def __init__(self, timeout: float | None = None, spin: float = SPIN_SECONDS, first: float = 1e-5,
                 most: float = MAX_SLEEP):
        self.start = time.monotonic()
        self.timeout = timeout
        self.deadline = None if timeout is None else self.start + timeout
        self.spin = spin
        self.first = first
        self.most = most
        self.sleep = first

    def pause(self) -> bool:
        """Wait a little before the next poll; False, at once, when the timeout has passed."""
        now = time.monotonic()
        if self.deadline is not None and now >= self.deadline:
            return False
        if now - self.start > self.spin:
            time.sleep(self.sleep if self.deadline is None else min(self.sleep, self.deadline - now))
            self.sleep = min(self.sleep * 2, self.most)
        elif oversubscribed:
            os.sched_yield()
        return True

    def progressed(self) -> None:
        """Something moved: the timeout counts again from now, and the next sleep is the shortest."""
        if self.timeout is not None:
            self.deadline = time.monotonic() + self.timeout
        self.sleep = self.first

    def left(self) -> float | None:
        """Seconds until the timeout (0 or less once it has passed); None when there is no timeout."""
        return None if self.deadline is None else self.deadline - time.monotonic()
