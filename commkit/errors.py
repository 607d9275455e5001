"""The exception hierarchy: one base class, one subclass per way things go wrong.

Every error commkit raises on purpose is a :class:`CommError`, so ``except
commkit.CommError`` catches them all. Subclasses also derive from the built-in
exception a Python user would expect (``ValueError``, ``TypeError``,
``TimeoutError``) so existing handlers keep working.
"""

from __future__ import annotations

__all__ = [
    "CommError",
    "InvalidArgument",
    "InvalidBuffer",
    "UnsupportedOp",
    "AlgorithmNotApplicable",
    "CommClosed",
    "CommBroken",
    "MessageTruncated",
    "CommTimeout",
    "CollectiveMismatch",
    "PeerFailed",
    "ConcurrentCall",
    "TransportUnavailable",
    "RankError",
]


class CommError(Exception):
    """Base class of every error commkit raises on purpose."""


class InvalidArgument(CommError, ValueError):
    """A parameter (rank, root, tag, count, size ...) has an invalid value."""


class InvalidBuffer(CommError, TypeError):
    """A buffer has the wrong type, dtype, shape, layout or is read-only."""


class UnsupportedOp(CommError, TypeError):
    """A reduction op is unknown or is not defined for the array's dtype."""


class AlgorithmNotApplicable(CommError, ValueError):
    """A forced algorithm cannot run this call (its restrictions fail)."""


class CommClosed(CommError, RuntimeError):
    """The communicator was used after ``free()``."""


class CommBroken(CommClosed):
    """The communicator is unusable after a timeout or failure inside a collective.

    Messages of the interrupted call may still arrive; rather than let them land
    in a later call, every later call on this communicator raises this error.
    ``dup()`` of it (collective) or of its parent gives a fresh one.
    """


class MessageTruncated(InvalidBuffer):
    """A message did not fit the buffer posted to receive it.

    Any receive refuses a message larger than its buffer. A collective's
    receive also refuses a shorter one: its schedule fixes every size, so a
    short message means the ranks disagree about the call, and the rest of
    the buffer would hold bytes nobody sent. (A point-to-point ``recv`` into a
    larger buffer is allowed, as in MPI.)

    Attributes:
        peer: the sending rank (None when unknown).
        expected: the receive buffer's size in bytes.
        received: the message's size in bytes (None when the library did not say).
    """

    def __init__(self, message: str, peer=None, expected=None, received=None):
        super().__init__(message)
        self.peer = peer
        self.expected = expected
        self.received = received

    def __reduce__(self):
        return (type(self), (str(self), self.peer, self.expected, self.received))


class CommTimeout(CommError, TimeoutError):
    """A blocking operation made no progress within its timeout."""


class CollectiveMismatch(CommError, RuntimeError):
    """Ranks called different collectives (or the same one differently)."""


class PeerFailed(CommError, RuntimeError):
    """Another rank failed, so this rank's operation can never complete."""


class ConcurrentCall(CommError, RuntimeError):
    """Two threads called into one communicator's collectives at once."""


class TransportUnavailable(CommError, RuntimeError):
    """The requested transport cannot be used here (missing package, no MPI)."""


class RankError(CommError, RuntimeError):
    """A rank of a launched job raised; carries that rank and its traceback.

    Attributes:
        rank: the rank that failed first.
        remote_traceback: the formatted traceback from that rank, as text.
    """

    def __init__(self, rank: int, message: str, remote_traceback: str = ""):
        self.rank = rank
        self.message = message
        self.remote_traceback = remote_traceback
        text = f"rank {rank} failed: {message}"
        if remote_traceback:
            text += f"\n\nTraceback from rank {rank}:\n{remote_traceback.rstrip()}"
        super().__init__(text)

    def __reduce__(self):
        return (type(self), (self.rank, self.message, self.remote_traceback))
