"""A functional face in the style of ``torch.distributed``, over commkit communicators.

::

    import commkit.distributed as dist

    dist.init_process_group("mpi")                 # under mpiexec (or inside commkit.launch)
    dist.all_reduce(grad, op=dist.ReduceOp.SUM)    # in place, like torch
    grad /= dist.get_world_size()

Tensors are arrays: NumPy, CuPy, or anything exposing the buffer protocol,
``__cuda_array_interface__`` or DLPack (a PyTorch tensor included); every
collective works in place on the memory the caller passed, as torch's do.
``async_op=True`` returns a :class:`Work` with ``wait()`` and ``is_completed()``.
Ranks given to a collective (``src``, ``dst``) are global ranks even when a
``group`` is passed, as in torch.

Backends, and where the default group lives:

* ``"mpi"``: one process per rank under ``mpiexec``; rank and world size come
  from MPI. The default group belongs to the process.
* ``"nccl"``: CuPy arrays, one GPU per rank (commkit's NCCL transport).
  The default group belongs to the process.
* ``"local"`` (alias ``"threads"``): ranks are threads of one process, for
  notebooks and tests. Since every rank shares the module, the default group
  belongs to the *thread* that called :func:`init_process_group`. Threads meet
  by ``init_method`` (any string; all ranks of one job pass the same one) and
  each passes its ``rank`` and the ``world_size``, as torch processes do with
  ``tcp://``. Inside :func:`commkit.run_local` (or :func:`commkit.launch`),
  pass the rank's communicator instead: ``init_process_group("local", comm=comm)``.

Beyond torch's early API: ``ReduceOp.AVG`` (a sum, then a division, for
floating-point tensors), and the ``comm=`` and ``timeout=`` arguments.
"""

from __future__ import annotations

import datetime
import enum
import threading

import numpy as np

from . import _world
from ._checks import array_module, check_timeout
from .communicator import Communicator
from .compat import as_array
from .errors import CommError, InvalidArgument, InvalidBuffer, UnsupportedOp
from .transports.base import ANY_SOURCE
from .transports.local import LocalTransport, LocalWorld

__all__ = [
    "ReduceOp", "reduce_op", "Work", "Group", "GroupMember", "is_available", "init_process_group",
    "is_initialized", "destroy_process_group", "get_backend", "get_rank", "get_world_size", "new_group",
    "send", "recv", "isend", "irecv", "broadcast", "all_reduce", "reduce", "all_gather", "gather", "scatter",
    "reduce_scatter", "all_to_all", "barrier",
]


class ReduceOp(enum.Enum):
    """Reduction operations, named as in ``torch.distributed.ReduceOp``."""

    SUM = "sum"
    PRODUCT = "prod"
    MIN = "min"
    MAX = "max"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"
    AVG = "avg"


reduce_op = ReduceOp  # the name torch's earliest API used


class Group:
    """A process group: a commkit communicator and the global ranks of its members, in group-rank order."""

    def __init__(self, comm: Communicator, ranks, backend: str):
        self.comm = comm
        self.ranks = tuple(ranks)
        self.backend = backend
        self._global_to_group = {g: i for i, g in enumerate(self.ranks)}

    def rank(self) -> int:
        """This rank's rank within the group."""
        return self.comm.rank

    def size(self) -> int:
        """The number of ranks in the group."""
        return self.comm.size

    def group_rank(self, global_rank: int, name: str) -> int:
        """The group rank of ``global_rank``; InvalidArgument when it is not a member."""
        if isinstance(global_rank, bool) or not isinstance(global_rank, (int, np.integer)):
            raise InvalidArgument(f"{name} must be an int (a global rank), got {type(global_rank).__name__}.")
        try:
            return self._global_to_group[int(global_rank)]
        except KeyError:
            raise InvalidArgument(
                f"{name}={global_rank} is not in the group, whose members are global ranks {list(self.ranks)}."
            ) from None

    def __repr__(self) -> str:
        return f"<commkit.distributed.Group {self.backend}: ranks {list(self.ranks)}>"


class GroupMember:
    """Markers as in torch: ``WORLD`` is the default group, ``NON_GROUP_MEMBER`` what non-members get from new_group."""

    WORLD = None

    class _NonMember:
        def __repr__(self) -> str:
            return "GroupMember.NON_GROUP_MEMBER"

    NON_GROUP_MEMBER = _NonMember()


class Work:
    """The handle of an ``async_op=True`` call (or of isend/irecv)."""

    def __init__(self, request, finish=None):
        self._request = request
        self._finish = finish
        self._done = False

    def _complete(self) -> None:
        self._done = True
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()

    def is_completed(self) -> bool:
        """Make progress without blocking; whether the operation has completed."""
        if not self._done and self._request.test():
            self._complete()
        return self._done

    def wait(self, timeout=None) -> bool:
        """Block until the operation has completed (``timeout``: seconds or a timedelta); returns True."""
        if not self._done:
            if isinstance(timeout, datetime.timedelta):
                timeout = timeout.total_seconds()
            self._request.wait(check_timeout(timeout))
            self._complete()
        return True


class _State:
    def __init__(self):
        self.default: Group | None = None
        self.groups: list[Group] = []


_process = _State()              # "mpi" and "nccl": one rank per process
_thread = threading.local()      # "local": one rank per thread, each with its own state
_rendezvous: dict = {}
_rendezvous_lock = threading.Lock()
_BACKENDS = {"mpi": "mpi", "nccl": "nccl", "local": "local", "threads": "local"}


def _state() -> _State:
    state = getattr(_thread, "state", None)
    return state if state is not None and state.default is not None else _process


def is_available() -> bool:
    """Always True: the face needs nothing beyond commkit (each backend checks its own packages)."""
    return True


def is_initialized() -> bool:
    """Whether this process (``mpi``/``nccl``) or thread (``local``) has a default group."""
    return _state().default is not None


def init_process_group(backend: str = "mpi", init_method: str | None = "env://", world_size: int = -1,
                       rank: int = -1, *, timeout=None, comm: Communicator | None = None) -> None:
    """Create the default process group.

    Args:
        backend: ``"mpi"``, ``"nccl"`` or ``"local"`` (threads; see the module docstring).
        init_method: ``"env://"`` for mpi and nccl (MPI's or the launcher's
            environment); for local, the name all threads of one job share.
        world_size, rank: required for local (unless ``comm`` is given); for mpi
            and nccl, checked against what MPI says when not -1.
        timeout: seconds (or a timedelta) without progress before a blocking
            call raises CommTimeout; default: wait forever (or ``COMMKIT_TIMEOUT``).
        comm: adopt this communicator as the default group (inside
            :func:`commkit.run_local` or :func:`commkit.launch`).

    Raises:
        CommError: a default group already exists here.
        InvalidArgument: an unknown backend, or world_size/rank that do not fit.
        TransportUnavailable: the backend's packages are missing.
    """
    if not isinstance(backend, str) or backend.lower() not in _BACKENDS:
        raise InvalidArgument(f"backend must be one of 'mpi', 'nccl', 'local' (or 'threads'), got {backend!r}.")
    backend = _BACKENDS[backend.lower()]
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    timeout = check_timeout(timeout)
    if is_initialized():
        raise CommError("the default process group is already initialized here; call destroy_process_group() first.")
    world_size, rank = _int_arg(world_size, "world_size"), _int_arg(rank, "rank")
    if comm is not None:
        if not isinstance(comm, Communicator):
            raise InvalidArgument(f"comm must be a commkit.Communicator, got {type(comm).__name__}.")
        local = comm.transport_name == "local"
    elif backend == "local":
        comm = _join_local(init_method, world_size, rank, timeout)
        local = True
    else:
        if init_method not in (None, "env://"):
            raise InvalidArgument(
                f"the {backend} backend takes rank and size from the MPI environment, so init_method must be "
                f"'env://'; got {init_method!r}."
            )
        comm = _world.init(backend, timeout=timeout)
        local = False
    for name, given, actual in (("world_size", world_size, comm.size), ("rank", rank, comm.rank)):
        if given != -1 and given != actual:
            raise InvalidArgument(f"{name}={given} was passed but the {backend} backend says {actual}.")
    state = _State()
    state.default = Group(comm, range(comm.size), backend)
    if local:
        _thread.state = state
    else:
        _process.default, _process.groups = state.default, []


def _int_arg(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < -1:
        raise InvalidArgument(f"{name} must be a non-negative int (or -1 for unspecified), got {value!r}.")
    return int(value)


def _join_local(init_method, world_size: int, rank: int, timeout) -> Communicator:
    """Meet the other threads of a local job by ``init_method``; return this rank's communicator."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise InvalidArgument(
            f"the local backend needs world_size >= 1 and 0 <= rank < world_size (or comm=); "
            f"got world_size={world_size}, rank={rank}."
        )
    key = init_method or "env://"
    with _rendezvous_lock:
        world, joined = _rendezvous.setdefault(key, (LocalWorld(world_size), set()))
        if world.size != world_size:
            raise InvalidArgument(
                f"init_method {key!r} is a local job of world_size {world.size}; this thread passed {world_size}."
            )
        if rank in joined:
            raise InvalidArgument(f"rank {rank} already joined the local job {key!r}; each thread needs its own rank.")
        joined.add(rank)
        if len(joined) == world_size:
            del _rendezvous[key]  # complete: the name may start a new job
    return Communicator(LocalTransport(world, rank), timeout=timeout)


def destroy_process_group(group=None) -> None:
    """Free ``group``; with None, the default group and every group made by new_group here."""
    state = _state()
    if group is None:
        for g in state.groups:
            g.comm.free()
        if state.default is not None:
            state.default.comm.free()
        state.default, state.groups = None, []
        if state is not _process:
            _thread.state = None
        return
    if group is GroupMember.NON_GROUP_MEMBER:
        return
    if not isinstance(group, Group):
        raise InvalidArgument(f"group must be a Group from new_group or None, got {type(group).__name__}.")
    group.comm.free()
    if group in state.groups:
        state.groups.remove(group)


def _default() -> Group:
    group = _state().default
    if group is None:
        raise CommError(
            "the default process group has not been initialized; call init_process_group() first "
            "(in this thread, for the local backend)."
        )
    return group


def _group(group) -> Group | None:
    """The Group a call runs on, or None when this rank is not a member (the call then does nothing)."""
    if group is None:
        return _default()
    if group is GroupMember.NON_GROUP_MEMBER:
        return None
    if not isinstance(group, Group):
        raise InvalidArgument(f"group must be a Group from new_group or None, got {type(group).__name__}.")
    return group


def get_backend(group=None) -> str:
    """The backend's name: ``"mpi"``, ``"nccl"`` or ``"local"``."""
    g = _group(group)
    if g is None:
        raise InvalidArgument("this rank is not a member of the group.")
    return g.backend


def get_rank(group=None) -> int:
    """This rank in ``group`` (the default group if None); -1 if it is not a member."""
    g = _group(group)
    return -1 if g is None else g.rank()


def get_world_size(group=None) -> int:
    """The number of ranks in ``group`` (the default group if None); -1 if this rank is not a member."""
    g = _group(group)
    return -1 if g is None else g.size()


def new_group(ranks=None, timeout=None, backend=None) -> Group:
    """A group of the given global ranks (all if None), ordered by global rank.

    Collective over the default group: every rank calls it, members or not,
    in the same order. Non-members get ``GroupMember.NON_GROUP_MEMBER``.
    """
    default = _default()
    world = default.size()
    members = list(range(world)) if ranks is None else list(ranks)
    if any(isinstance(r, bool) or not isinstance(r, (int, np.integer)) or not 0 <= r < world for r in members):
        raise InvalidArgument(f"ranks must be global ranks in range(0, {world}), got {members!r}.")
    if len(set(members)) != len(members):
        raise InvalidArgument(f"ranks must not repeat, got {members!r}.")
    if backend is not None and _BACKENDS.get(str(backend).lower()) != default.backend:
        raise InvalidArgument(f"new_group runs on the default group's backend {default.backend!r}, got {backend!r}.")
    members = sorted(int(r) for r in members)
    me = default.rank()
    sub = default.comm.split(0 if me in members else None, me)
    if sub is None:
        return GroupMember.NON_GROUP_MEMBER
    if timeout is not None:
        sub.timeout = check_timeout(timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout)
    group = Group(sub, members, default.backend)
    _state().groups.append(group)
    return group


# -- helpers for the calls -------------------------------------------------------------------


def _tensor(tensor, name: str):
    """The array over ``tensor``'s memory; it must be contiguous, since results are written into it."""
    arr = as_array(tensor, name, writable=True)
    if not arr.flags.c_contiguous:
        raise InvalidBuffer(
            f"{name} must be contiguous because the result is written into it; got strides {arr.strides}."
        )
    return arr


def _tensors(tensors, name: str, size: int, like):
    """A list of ``size`` arrays shaped like ``like`` (one per rank), each over its tensor's memory."""
    arrays = [_tensor(t, f"{name}[{i}]") for i, t in enumerate(_list(tensors, name, size))]
    _same_as(arrays, like, name)
    return arrays


def _op(op, dtype, size: int):
    """The commkit op for ``op``, and what to do after the reduction (AVG divides)."""
    if isinstance(op, str):
        try:
            op = ReduceOp[op.upper()] if op.upper() in ReduceOp.__members__ else ReduceOp(op.lower())
        except ValueError:
            raise UnsupportedOp(f"unknown op {op!r}; expected a ReduceOp such as ReduceOp.SUM.") from None
    if not isinstance(op, ReduceOp):
        raise UnsupportedOp(f"op must be a ReduceOp such as ReduceOp.SUM, got {op!r}.")
    if op is not ReduceOp.AVG:
        return op.value, None
    if dtype.kind not in "fc":
        raise UnsupportedOp(f"ReduceOp.AVG needs a floating-point or complex tensor, got dtype {dtype}.")
    return "sum", size


def _run(async_op: bool, request, finish=None):
    """Return a Work for ``async_op``; else complete ``request`` (already run) and finish now."""
    if async_op:
        return Work(request, finish)
    if finish is not None:
        finish()
    return None


def _divide(arr, size):
    if size is None:
        return None

    def finish():
        arr[...] /= size

    return finish


def _copy_rows(stacked, targets):
    def finish():
        for row, target in zip(stacked, targets):
            target[...] = row

    return finish


# -- point to point ----------------------------------------------------------------------------


def send(tensor, dst: int, group=None, tag: int = 0) -> None:
    """Send ``tensor`` to global rank ``dst``."""
    g = _group(group)
    if g is not None:
        g.comm.send(as_array(tensor, "tensor"), g.group_rank(dst, "dst"), tag)


def recv(tensor, src: int | None = None, group=None, tag: int = 0) -> int:
    """Receive into ``tensor`` from global rank ``src`` (any rank if None); returns the sender's global rank."""
    g = _group(group)
    if g is None:
        return -1
    source = ANY_SOURCE if src is None else g.group_rank(src, "src")
    _, status = g.comm.recv(source, tag, out=_tensor(tensor, "tensor"), return_status=True)
    return g.ranks[status.source]


def isend(tensor, dst: int, group=None, tag: int = 0) -> Work | None:
    """Start sending ``tensor`` to global rank ``dst``; do not modify it until the Work completes."""
    g = _group(group)
    if g is None:
        return None
    return Work(g.comm.isend(as_array(tensor, "tensor"), g.group_rank(dst, "dst"), tag))


def irecv(tensor, src: int | None = None, group=None, tag: int = 0) -> Work | None:
    """Start receiving into ``tensor`` from global rank ``src`` (any rank if None)."""
    g = _group(group)
    if g is None:
        return None
    source = ANY_SOURCE if src is None else g.group_rank(src, "src")
    return Work(g.comm.irecv(source, tag, out=_tensor(tensor, "tensor")))


# -- collectives ---------------------------------------------------------------------------------


def broadcast(tensor, src: int = 0, group=None, async_op: bool = False):
    """Every rank's ``tensor`` becomes global rank ``src``'s."""
    g = _group(group)
    if g is None:
        return None
    arr, root = _tensor(tensor, "tensor"), g.group_rank(src, "src")
    call = g.comm.ibroadcast if async_op else g.comm.broadcast
    return _run(async_op, call(arr, root, out=arr))


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op: bool = False):
    """Reduce ``tensor`` across the group, in place on every rank."""
    g = _group(group)
    if g is None:
        return None
    arr = _tensor(tensor, "tensor")
    name, avg = _op(op, arr.dtype, g.size())
    call = g.comm.iallreduce if async_op else g.comm.allreduce
    return _run(async_op, call(arr, name, out=arr), _divide(arr, avg))


def reduce(tensor, dst: int = 0, op=ReduceOp.SUM, group=None, async_op: bool = False):
    """Reduce ``tensor`` across the group into global rank ``dst``'s ``tensor`` (others are left as they were)."""
    g = _group(group)
    if g is None:
        return None
    arr, root = _tensor(tensor, "tensor"), g.group_rank(dst, "dst")
    name, avg = _op(op, arr.dtype, g.size())
    is_root = g.rank() == root
    call = g.comm.ireduce if async_op else g.comm.reduce
    request = call(arr, name, root, out=arr if is_root else None)
    return _run(async_op, request, _divide(arr, avg) if is_root else None)


def all_gather(tensor_list, tensor, group=None, async_op: bool = False):
    """Fill ``tensor_list[i]`` with rank i's ``tensor`` on every rank."""
    g = _group(group)
    if g is None:
        return None
    arr = as_array(tensor, "tensor")
    targets = _tensors(tensor_list, "tensor_list", g.size(), arr)
    stacked = array_module(arr).empty((g.size(),) + arr.shape, dtype=arr.dtype)
    call = g.comm.iallgather if async_op else g.comm.allgather
    return _run(async_op, call(arr, out=stacked), _copy_rows(stacked, targets))


def gather(tensor, gather_list=None, dst: int = 0, group=None, async_op: bool = False):
    """Global rank ``dst`` gets every rank's ``tensor`` in ``gather_list`` (given only there)."""
    g = _group(group)
    if g is None:
        return None
    arr, root = as_array(tensor, "tensor"), g.group_rank(dst, "dst")
    if g.rank() == root:
        targets = _tensors(gather_list, "gather_list", g.size(), arr)
        stacked = array_module(arr).empty((g.size(),) + arr.shape, dtype=arr.dtype)
        finish = _copy_rows(stacked, targets)
    else:
        if gather_list:
            raise InvalidArgument(f"gather_list must be given only on the destination rank {dst}, not on this rank.")
        stacked, finish = None, None
    call = g.comm.igather if async_op else g.comm.gather
    return _run(async_op, call(arr, root, out=stacked), finish)


def scatter(tensor, scatter_list=None, src: int = 0, group=None, async_op: bool = False):
    """Rank i's ``tensor`` receives ``scatter_list[i]`` of global rank ``src`` (the list is given only there)."""
    g = _group(group)
    if g is None:
        return None
    arr, root = _tensor(tensor, "tensor"), g.group_rank(src, "src")
    if g.rank() == root:
        parts = [as_array(t, f"scatter_list[{i}]") for i, t in enumerate(_list(scatter_list, "scatter_list", g.size()))]
        _same_as(parts, arr, "scatter_list")
        x = array_module(arr).stack(parts)
    else:
        if scatter_list:
            raise InvalidArgument(f"scatter_list must be given only on the source rank {src}, not on this rank.")
        x = None
    call = g.comm.iscatter if async_op else g.comm.scatter
    return _run(async_op, call(x, root, out=arr))


def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op: bool = False):
    """Reduce ``input_list[i]`` across the group into rank i's ``output``."""
    g = _group(group)
    if g is None:
        return None
    out = _tensor(output, "output")
    parts = [as_array(t, f"input_list[{i}]") for i, t in enumerate(_list(input_list, "input_list", g.size()))]
    _same_as(parts, out, "input_list")
    name, avg = _op(op, out.dtype, g.size())
    x = array_module(out).stack(parts)
    call = g.comm.ireduce_scatter if async_op else g.comm.reduce_scatter
    return _run(async_op, call(x, name, out=out.reshape((1,) + out.shape)), _divide(out, avg))


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op: bool = False):
    """Rank j's ``output_tensor_list[i]`` receives rank i's ``input_tensor_list[j]`` (equal shapes)."""
    g = _group(group)
    if g is None:
        return None
    parts = [as_array(t, f"input_tensor_list[{i}]")
             for i, t in enumerate(_list(input_tensor_list, "input_tensor_list", g.size()))]
    _same_as(parts, parts[0], "input_tensor_list")
    targets = _tensors(output_tensor_list, "output_tensor_list", g.size(), parts[0])
    xp = array_module(parts[0])
    x = xp.stack(parts)
    stacked = xp.empty_like(x)
    call = g.comm.ialltoall if async_op else g.comm.alltoall
    return _run(async_op, call(x, out=stacked), _copy_rows(stacked, targets))


def barrier(group=None, async_op: bool = False):
    """Block until every rank of the group has called barrier."""
    g = _group(group)
    if g is None:
        return None
    if async_op:
        return Work(g.comm.ibarrier())
    g.comm.barrier()
    return None


def _list(tensors, name: str, size: int) -> list:
    if not isinstance(tensors, (list, tuple)) or len(tensors) != size:
        got = f"a list of {len(tensors)}" if isinstance(tensors, (list, tuple)) else type(tensors).__name__
        raise InvalidArgument(f"{name} must be a list of {size} tensors (one per rank), got {got}.")
    return list(tensors)


def _same_as(parts, like, name: str) -> None:
    for i, a in enumerate(parts):
        if a.shape != like.shape or a.dtype != like.dtype:
            raise InvalidBuffer(
                f"{name}[{i}] must have shape {tuple(like.shape)} and dtype {like.dtype}; "
                f"got shape {tuple(a.shape)}, dtype {a.dtype}."
            )

