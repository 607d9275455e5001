"""The lifetime of one ``init("nccl")``: its device, its bootstrap store and its live NCCL communicators.

Every NCCL communicator of a process must stop waiting for its peers when the
process fails, or a GPU keeps spinning on a kernel no peer will ever match. So
each :class:`Session` knows its live communicators, and on an NCCL error, a
timeout, ``abort()`` or an uncaught exception (:func:`install_hooks`) it
aborts them all; at exit it destroys what is still open and releases the
store.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading

__all__ = ["Session", "install_hooks"]


class Session:
    """The device, the bootstrap store and the live NCCL communicators of one ``init("nccl")``."""

    def __init__(self, device: int, group, store=None, server=None):
        self.device = device
        self.group = group  # the world's bootstrap group: how to tell the other ranks about a failure
        self.store = store
        self.server = server
        self.live: set = set()
        self.failed: str | None = None
        self.lock = threading.Lock()
        _SESSIONS.add(self)

    def attach(self, transport) -> None:
        with self.lock:
            self.live.add(transport)

    def detach(self, transport) -> None:
        with self.lock:
            self.live.discard(transport)
            last = not self.live
        if last:
            self.close()

    def abort_all(self, reason: str) -> None:
        """``ncclCommAbort`` every communicator of this session (their kernels stop waiting for peers)."""
        with self.lock:
            if self.failed is None:
                self.failed = reason
            live = list(self.live)
        for transport in live:
            transport.abort_communicator()

    def close(self) -> None:
        """Release the bootstrap store: rank 0 serves until every other rank has disconnected (bounded)."""
        _SESSIONS.discard(self)
        store, server, self.store, self.server = self.store, self.server, None, None
        if store is not None:
            store.close()
        if server is not None:
            server.wait_for_disconnects(0, float(os.environ.get("COMMKIT_STORE_EXIT_TIMEOUT", "300")))
            server.close()

    def shutdown(self) -> None:
        """At exit: destroy (or, after a failure, abort) what is still open, then close the store."""
        with self.lock:
            live = list(self.live)
        for transport in live:
            transport.free()
        self.close()


_SESSIONS: set = set()


def _at_exit() -> None:
    for session in list(_SESSIONS):
        session.shutdown()


def install_hooks() -> None:
    """Abort NCCL before an uncaught exception ends this process, and clean up at exit (once)."""
    if getattr(sys.excepthook, "_commkit_nccl", False):
        return
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        reason = f"an uncaught {exc_type.__name__} on this rank: {exc}"
        sessions = list(_SESSIONS)
        for session in sessions:
            session.abort_all(reason)  # local and quick: no kernel of this process waits on a peer any more
        previous(exc_type, exc, tb)  # under mpiexec this is commkit's MPI hook, which ends the job
        for session in sessions:
            if not getattr(session.group, "aborts_through_mpi", False):
                session.group.signal_abort(reason)  # the store's abort flag, which the other ranks poll

    hook._commkit_nccl = True
    sys.excepthook = hook
    atexit.register(_at_exit)
