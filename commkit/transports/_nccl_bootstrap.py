"""How the ranks of an NCCL world find each other: over MPI under mpiexec, else over commkit's TCP store.

The bootstrap gives each rank a *group* (the world's, then one per ``dup`` and
``split``): a small channel for Python objects that carries the NCCL unique
id, the metadata of ``split``, ``send_object`` messages and, after a failure,
the news that the job cannot go on. See :mod:`.nccl` for the design and
:mod:`._store` for the store and its secret.
"""

from __future__ import annotations

import os

from .._mpiexec import under_mpiexec
from ..errors import InvalidArgument
from . import _store

__all__ = ["bootstrap", "env_int"]


def env_int(name):
    """The integer in the environment variable ``name``, or None where it is unset or empty.

    Raises:
        InvalidArgument: the variable holds something other than an integer.
    """
    text = os.environ.get(name)
    if text in (None, ""):
        return None
    try:
        return int(text)
    except ValueError:
        raise InvalidArgument(f"{name} must be an integer, got {text!r}.") from None


# The MPI pieces are imported where used: mpi4py is optional, and the store bootstrap needs none of it.
class _MPIGroup:
    """The bootstrap channel of a communicator under mpiexec: an MPI communicator of its own."""

    # An uncaught exception ends the whole job through commkit's MPI hook (see
    # mpi.install_abort_on_exception), so the NCCL hook has no one left to tell.
    aborts_through_mpi = True

    def __init__(self, comm, owned: bool):
        from .mpi import MPITransport

        self.comm = comm
        self.owned = owned
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self._objects = MPITransport(comm)
        self.tag_ub = self._objects.tag_ub

    def bcast(self, obj, root: int = 0, timeout=None):
        return self.comm.bcast(obj, root)

    def allgather(self, obj, timeout=None) -> list:
        return self.comm.allgather(obj)

    def barrier(self, timeout=None) -> None:
        self.comm.Barrier()

    def send_object(self, obj, dest: int, tag: int) -> None:
        self._objects.send_object(obj, dest, tag)

    def isend_object(self, obj, dest: int, tag: int):
        return self._objects.isend_object(obj, dest, tag)

    def recv_object(self, source: int, tag: int, timeout):
        return self._objects.recv_object(source, tag, timeout)

    def probe(self, source: int, tag: int):
        return self._objects.probe(source, tag)

    def dup(self) -> _MPIGroup:
        return _MPIGroup(self.comm.Dup(), True)

    def split(self, color, key: int, timeout=None):
        from .mpi import MPI

        comm = self.comm.Split(MPI.UNDEFINED if color is None else color, key)
        return None if comm == MPI.COMM_NULL else _MPIGroup(comm, True)

    def free(self) -> None:
        from .mpi import MPI

        if self.owned and not MPI.Is_finalized() and self.comm != MPI.COMM_NULL:
            self.comm.Free()

    def signal_abort(self, reason: str) -> None:  # pragma: no cover - ends the job
        from .mpi import abort_job

        abort_job(f"commkit: {reason}; aborting the MPI job.")

    def aborted(self):
        return None  # MPI_Abort ends every process: there is nothing left to notice


def bootstrap(options):
    """This rank's bootstrap group and session parts: ``(group, store, server)``.

    Under mpiexec (or ``bootstrap="mpi"``) the group is a dup of MPI_COMM_WORLD.
    Otherwise rank 0 starts a :class:`._store.StoreServer` with a secret (the
    user's ``store_token``, else a fresh random one) on the named port or a
    free one, and every rank connects to it with a :class:`._store.StoreClient`
    that proves the secret. Unless the user gave every rank both the port and
    the secret, rank 0 publishes address and secret in a rendezvous file only
    this user can read (``store_file``, else :func:`._store.rendezvous_path`),
    which the other ranks wait for.

    Raises:
        InvalidArgument: an option or environment variable has a wrong value.
        TransportUnavailable: the store cannot be started, found or trusted.
    """
    how = options.pop("bootstrap", None) or os.environ.get("COMMKIT_NCCL_BOOTSTRAP") or None
    rank = options.pop("rank", None)
    size = options.pop("size", None)
    host, port = _store.store_address(options.pop("store_host", None), options.pop("store_port", None))
    token = options.pop("store_token", None) or os.environ.get("COMMKIT_STORE_TOKEN") or None
    path = options.pop("store_file", None) or os.environ.get("COMMKIT_STORE_FILE") or None
    connect_timeout = options.pop("connect_timeout", None)
    if connect_timeout is None:
        text = os.environ.get("COMMKIT_STORE_TIMEOUT") or "120"
        try:
            connect_timeout = float(text)
        except ValueError:
            raise InvalidArgument(f"COMMKIT_STORE_TIMEOUT must be a number of seconds, got {text!r}.") from None
    if (isinstance(connect_timeout, bool) or not isinstance(connect_timeout, (int, float))
            or not 0 < connect_timeout < float("inf")):
        raise InvalidArgument(f"connect_timeout (COMMKIT_STORE_TIMEOUT) must be a finite positive number of seconds, "
                              f"got {connect_timeout!r}.")
    if how is None:
        how = "mpi" if under_mpiexec() and rank is None and size is None else "store"
    if how == "mpi":
        from .mpi import MPI, install_abort_on_exception

        install_abort_on_exception()
        return _MPIGroup(MPI.COMM_WORLD.Dup(), True), None, None
    if how != "store":
        raise InvalidArgument(f"bootstrap must be 'mpi' or 'store', got {how!r}.")
    if rank is None:
        rank = env_int("COMMKIT_RANK")
        rank = env_int("RANK") if rank is None else rank
    if size is None:
        size = env_int("COMMKIT_SIZE")
        size = env_int("WORLD_SIZE") if size is None else size
    size = 1 if size is None else size
    rank = 0 if rank is None else rank
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise InvalidArgument(f"size must be a positive int, got {size!r}.")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
        raise InvalidArgument(f"rank must be an int in range(0, {size}), got {rank!r}.")
    if size == 1:
        memory = _store.MemoryStore()
        return _store.StoreGroup(memory, "w", 0, 1), memory, None
    # Port and secret both given to every rank: nothing to publish. Otherwise the rendezvous file carries them.
    direct = bool(port) and token is not None and path is None
    if not direct and path is None:
        path = _store.rendezvous_path(port)
    if rank == 0:
        server = _store.StoreServer(host, port, token)
        try:
            if not direct:
                server.publish(path, ranks=size)
            client = _store.StoreClient(host, server.port, token=server.token, connect_timeout=connect_timeout)
        except BaseException:
            server.close()
            raise
        return _store.StoreGroup(client, "w", rank, size), client, server
    if direct:
        client = _store.StoreClient(host, port, token=token, connect_timeout=connect_timeout)
    else:
        client = _store.connect_rendezvous(path, size=size, token=token, connect_timeout=connect_timeout)
    return _store.StoreGroup(client, "w", rank, size), client, None
