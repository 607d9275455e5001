"""One request interface for everything that completes later, and waiting on any mix of them.

Every nonblocking operation commkit starts returns a :class:`Request`:
point-to-point ``isend``/``irecv``, the collectives' ``i``-forms (a schedule
advanced step by step, or the library's own nonblocking collective) and the
persistent collectives (``allreduce_init`` ...). They all answer the same five
questions, so :func:`wait_all` and :func:`wait_any` take any mix of them:

* ``test()`` -- make progress without blocking; True once complete;
* ``wait(timeout=None)`` -- block until complete and return the result;
* ``done`` -- whether it has completed (without making progress);
* ``result`` -- what ``wait()`` returns, once done (None before);
* ``status`` -- source, tag and byte count of a completed receive (None otherwise).
"""

from __future__ import annotations

from .errors import CommTimeout, InvalidArgument
from ._wait import Backoff

__all__ = ["Request", "wait_all", "wait_any"]


class Request:
    """What every commkit request offers (see the module docstring).

    Subclasses implement :meth:`test` and :meth:`wait` and keep ``_done`` and
    ``_result``; the properties below read them.
    """

    _done = False
    _result = None

    def test(self) -> bool:  # pragma: no cover - every subclass overrides it
        """Make progress without blocking; return True once complete."""
        raise NotImplementedError

    def wait(self, timeout: float | None = None):  # pragma: no cover - every subclass overrides it
        """Block until complete and return the result."""
        raise NotImplementedError

    @property
    def done(self) -> bool:
        """Whether the operation has completed (without making progress)."""
        return self._done

    @property
    def result(self):
        """The result :meth:`wait` returns, once the operation is done (None before)."""
        return self._result if self.done else None

    @property
    def status(self):
        """Source, tag and byte count of a completed receive; None for everything else."""
        return None


def wait_all(requests, timeout: float | None = None) -> list:
    """Wait for every request (any mix of kinds); return their results in order."""
    return [r.wait(timeout) for r in requests]


def wait_any(requests, timeout: float | None = None) -> tuple[int, object]:
    """Wait until one of ``requests`` completes; return ``(its index, its result)``.

    Requests already complete count at once (the lowest index wins). Every
    request is driven while waiting. ``timeout`` is the total wait in seconds.

    Raises:
        InvalidArgument: ``requests`` is empty.
        CommTimeout: none completed within ``timeout``.
    """
    requests = list(requests)
    if not requests:
        raise InvalidArgument("wait_any needs at least one request, got none.")
    backoff = Backoff(timeout, first=1e-6)
    while True:
        for index, request in enumerate(requests):
            if request.test():
                return index, request.wait()
        if not backoff.pause():
            raise CommTimeout(f"none of {len(requests)} requests completed within {timeout:g} s.")
