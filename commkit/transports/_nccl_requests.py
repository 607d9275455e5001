"""The handles of the NCCL transport: work enqueued on a stream, user point-to-point, and messages to self.

Each is ``test() -> bool`` and ``wait(timeout) -> list`` of the peers still
outstanding, as every transport's pending handle (:mod:`.base`); how they
relate to CUDA streams is in :mod:`.nccl`.
"""

from __future__ import annotations

from . import _cuda
from .._wait import Backoff
from .base import Status

__all__ = ["Enqueued", "P2PRequest", "SelfRequest"]


class Enqueued:
    """Work enqueued on a stream: complete for that stream at once; ``wait(timeout)`` waits on the host.

    ``wait()`` makes the result ready on the stream that is current when it is
    called: if that is not the stream the work went to, the current stream is
    made to wait for it (a device-side wait, the host does not block).
    """

    __slots__ = ("event", "host", "peers", "stream", "transport")

    def __init__(self, transport, event, stream: int, peers, host: bool = False):
        self.transport = transport
        self.event = event
        self.stream = stream
        self.peers = peers
        self.host = host

    def test(self) -> bool:
        if not self.host:
            return True
        if self.event.done:
            return True
        self.transport.check_health()
        return False

    def wait(self, timeout) -> list:
        if timeout is None and not self.host:
            _cuda.follow(self.event, self.stream)
            return []
        return self.transport.wait_event(self.event, timeout, self.peers)


class P2PRequest(Enqueued):
    """A user ``isend``/``irecv``: issued, with the others waiting, at its first ``test()`` or ``wait()``.

    Until then it has no event: :meth:`NcclTransport.flush` gives it the event
    and the stream of the group that carries it.
    """

    __slots__ = ("nbytes", "peer", "recv", "tag")

    def __init__(self, transport, peer, tag, nbytes, recv):
        super().__init__(transport, None, None, [peer])
        self.peer = peer
        self.tag = tag
        self.nbytes = nbytes
        self.recv = recv

    def test(self) -> bool:
        self.transport.flush()
        return True

    def wait(self, timeout) -> list:
        self.transport.flush()
        return super().wait(timeout)

    @property
    def status(self):
        return Status(self.peer, self.tag, self.nbytes) if self.recv else None


class SelfRequest:
    """A message from a rank to itself: a device copy, matched in order of posting."""

    __slots__ = ("done", "nbytes", "rank", "recv", "tag")

    def __init__(self, rank, tag, recv):
        self.rank = rank
        self.tag = tag
        self.recv = recv
        self.nbytes = 0
        self.done = not recv

    def test(self) -> bool:
        return self.done

    def wait(self, timeout) -> list:
        backoff = Backoff(timeout, spin=0)
        while not self.done:  # only another thread of this rank can post the matching send
            if not backoff.pause():
                return [self.rank]
        return []

    @property
    def status(self):
        return Status(self.rank, self.tag, self.nbytes) if self.recv else None
