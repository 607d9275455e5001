"""Building communicators: ``init`` from the environment, and ``run_local`` on threads."""

from __future__ import annotations

import atexit
import importlib.util
import os
import threading
import time
import traceback
import weakref

from ._checks import check_timeout
from ._mpiexec import under_mpiexec
from .communicator import Communicator
from .errors import InvalidArgument, PeerFailed, RankError
from .transports.local import LocalTransport, LocalWorld

__all__ = ["init", "run_local", "local_world"]


def init(transport: str | None = None, *, timeout: float | None = None, check: bool | None = None, **options) -> Communicator:
    """Create the world communicator.

    Args:
        transport: ``"mpi"`` (wraps ``MPI.COMM_WORLD``; also when mpi4py is
            importable and no transport is named), ``"local"`` (a one-rank threads
            world; use :func:`run_local` for more ranks), or ``"nccl"`` (CuPy +
            NCCL, one GPU per rank). ``COMMKIT_TRANSPORT`` sets the default.
        timeout: default seconds without progress before a blocking call raises
            CommTimeout (default: ``COMMKIT_TIMEOUT``, else wait forever).
        check: verify every collective across ranks (default: ``COMMKIT_DEBUG=check``).
        options: transport-specific settings (nccl: ``device``, ``bootstrap``, ``rank``, ``size``,
            ``store_host``, ``store_port``, ``store_token``, ``store_file``, ``connect_timeout``; see docs/gpu.md).

    Raises:
        TransportUnavailable: the transport's package is missing, with the install command.
    """
    timeout = check_timeout(timeout)
    transport = transport or os.environ.get("COMMKIT_TRANSPORT") or None
    if transport is None:
        transport = "mpi" if under_mpiexec() or _mpi_importable() else "local"
    if transport == "local":
        return Communicator(LocalTransport(LocalWorld(1), 0), timeout=timeout, check=check)
    if transport == "mpi":
        from .transports.mpi import MPI, MPITransport, install_abort_on_exception

        install_abort_on_exception()
        comm = Communicator(MPITransport(MPI.COMM_WORLD), timeout=timeout, check=check)
        if comm.size > 1 and not _exit_barriers:
            _exit_barriers.append(weakref.ref(comm))
            atexit.register(_exit_barrier)
        return comm
    if transport == "nccl":
        from .transports.nccl import NcclTransport

        return Communicator(NcclTransport.create(**options), timeout=timeout, check=check, owns_transport=True)
    raise InvalidArgument(f"unknown transport {transport!r}; expected 'mpi', 'local' or 'nccl'.")


_exit_barriers: list = []


def _exit_barrier() -> None:
    """At exit, wait for every rank in a nonblocking barrier the watchdog can see.

    MPI_Finalize waits for the other ranks too, but it runs after Python has shut
    its threads down, so a rank whose peers are stuck (one of them in a collective
    that this rank's call never matched) would wait there without a word. Here the
    wait is a watchdog-visible one: after ``COMMKIT_WATCHDOG`` seconds it is
    reported, with this rank's last calls, like any other stuck call.
    """
    from .transports.mpi import MPI

    if not MPI.Is_initialized() or MPI.Is_finalized():
        return
    comm = _exit_barriers[0]() if _exit_barriers else None
    recorder = comm.flight_recorder if comm is not None else None
    world = MPI.COMM_WORLD
    peers = tuple(r for r in range(world.Get_size()) if r != world.Get_rank())
    try:
        request = world.Ibarrier()  # on COMM_WORLD: whatever state commkit's communicators are in
        if recorder is not None:
            recorder.active = ("exit: waiting for every rank to finish (MPI_Finalize)", peers, time.monotonic())
        request.Wait()
    except Exception:  # noqa: BLE001 - at exit, MPI_Finalize will report what is wrong
        pass
    finally:
        if recorder is not None:
            recorder.active = None


def _mpi_importable() -> bool:
    try:
        return importlib.util.find_spec("mpi4py") is not None
    except (ImportError, ValueError):
        return False


def local_world(size: int, *, timeout: float | None = None, check: bool | None = None) -> list[Communicator]:
    """``size`` communicators of one threads world, one per rank (drive them from your own threads)."""
    return _threads_world(size, timeout, check)[1]


def _threads_world(size, timeout, check) -> tuple[LocalWorld, list[Communicator]]:
    """A threads world of ``size`` ranks and a communicator over it for each rank."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise InvalidArgument(f"size must be a positive int, got {size!r}.")
    world = LocalWorld(size)
    return world, [Communicator(LocalTransport(world, r), timeout=timeout, check=check) for r in range(size)]


def run_local(fn, size: int = 4, *args, timeout: float | None = None, check: bool | None = None, **kwargs) -> list:
    """Run ``fn(comm, *args, **kwargs)`` on ``size`` threads, one rank each; return the results in rank order.

    If a rank raises, the other ranks are woken (their pending operations raise
    PeerFailed) and the first failure is re-raised here as :class:`RankError`
    naming the rank, with the original exception as its cause.
    """
    if not callable(fn):
        raise InvalidArgument(f"fn must be callable, got {type(fn).__name__}.")
    world, comms = _threads_world(size, timeout, check)
    results: list = [None] * size
    errors: list = [None] * size
    order: list[int] = []

    def body(rank):
        try:
            results[rank] = fn(comms[rank], *args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            errors[rank] = exc
            order.append(rank)
            world.fail(rank, exc)

    threads = [threading.Thread(target=body, args=(r,), name=f"commkit-rank-{r}", daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    try:
        for t in threads:
            t.join()
    except KeyboardInterrupt:
        world.fail(-1, KeyboardInterrupt("interrupted"))
        for t in threads:
            t.join(5)
        raise
    if order:
        # Report the rank that failed first with its own error, not a peer's PeerFailed.
        first = next((r for r in order if not isinstance(errors[r], PeerFailed)), order[0])
        exc = errors[first]
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        raise RankError(first, f"{type(exc).__name__}: {exc}", tb) from exc
    return results


