"""One description per collective: the facts every other module reads instead of deciding again.

Why. Which collectives reduce, which have a root, how their schedules are
called, how their message size is counted: each of these facts was once
decided in several modules (a tuple of reducing collectives lived in five
places, two of them without scan and exscan). A fact stated twice disagrees
one day. Here each collective is one :class:`Collective`, and the
communicator, the simulator, the cost model, bench, tune and the docs read it.

Adding a collective is one entry here, its algorithms in
:mod:`commkit.algorithms`, and its public method.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import InvalidArgument

__all__ = ["Collective", "COLLECTIVES", "NAMES", "FIXED", "VECTOR", "REDUCING", "ROOTED", "get", "steps",
           "buffer_sizes"]


@dataclass(frozen=True)
class Collective:
    """The facts about one collective.

    Attributes:
        name: the collective's name (``"allreduce"``); also its method's name.
        signature: how its schedules are called after ``(rank, size)``: a tuple of
            ``"count"`` (elements; per-rank counts for vector collectives and
            reduce_scatter), ``"op"`` and ``"root"``.
        rooted: it has a root rank.
        reduces: it combines data with an op.
        vector: ranks contribute or receive different counts (``*v``).
        in_place: whether ``out=x`` is meaningful (the result replaces the input).
        message: how the selector and the cost model count its message size ``n``
            in bytes, in words.
    """

    name: str
    signature: tuple
    rooted: bool = False
    reduces: bool = False
    vector: bool = False
    in_place: bool = False
    message: str = "the bytes of one rank's input"


_ALL = (
    Collective("barrier", (), message="0 (no data)"),
    Collective("broadcast", ("count", "root"), rooted=True, in_place=True),
    Collective("reduce", ("count", "op", "root"), rooted=True, reduces=True, in_place=True),
    Collective("allreduce", ("count", "op"), reduces=True, in_place=True),
    Collective("gather", ("count", "root"), rooted=True, message="the bytes of the gathered result (p blocks)"),
    Collective("scatter", ("count", "root"), rooted=True, message="the bytes of the root's input (p blocks)"),
    Collective("allgather", ("count",), message="the bytes of the gathered result (p blocks)"),
    Collective("reduce_scatter", ("count", "op"), reduces=True, message="the bytes of one rank's input (all blocks)"),
    Collective("alltoall", ("count",), message="the bytes of one block (what one rank sends to one other)"),
    Collective("scan", ("count", "op"), reduces=True, in_place=True),
    Collective("exscan", ("count", "op"), reduces=True, in_place=True),
    Collective("allgatherv", ("count",), vector=True, message="the bytes of the gathered result"),
    Collective("gatherv", ("count", "root"), rooted=True, vector=True, message="the bytes of the gathered result"),
    Collective("scatterv", ("count", "root"), rooted=True, vector=True, message="the bytes of the root's input"),
    Collective("alltoallv", ("count",), vector=True, message="the bytes of an average block"),
)

COLLECTIVES: dict[str, Collective] = {c.name: c for c in _ALL}
NAMES: tuple = tuple(COLLECTIVES)
FIXED: tuple = tuple(c.name for c in _ALL if not c.vector)
VECTOR: tuple = tuple(c.name for c in _ALL if c.vector)
REDUCING: frozenset = frozenset(c.name for c in _ALL if c.reduces)
ROOTED: frozenset = frozenset(c.name for c in _ALL if c.rooted)


def get(name: str) -> Collective:
    """The description of ``name``.

    Raises:
        InvalidArgument: no collective has that name.
    """
    try:
        return COLLECTIVES[name]
    except KeyError:
        raise InvalidArgument(f"unknown collective {name!r}; expected one of {list(NAMES)}.") from None


def buffer_sizes(collective: str, rank: int, size: int, count, root: int = 0) -> tuple[int, int]:
    """Elements of the ``in`` and ``out`` buffers a schedule of ``collective`` gets on ``rank``.

    ``count`` is the schedule's count argument: elements per rank, per-rank counts
    (reduce_scatter, allgatherv, gatherv, scatterv) or the p x p matrix (alltoallv).
    """
    if collective == "barrier":
        return 0, 0
    if collective == "gather":
        return count, (size * count if rank == root else 0)
    if collective == "scatter":
        return (size * count if rank == root else 0), count
    if collective == "allgather":
        return count, size * count
    if collective == "alltoall":
        return size * count, size * count
    if collective == "reduce_scatter":
        return sum(count), count[rank]
    if collective == "allgatherv":
        return count[rank], sum(count)
    if collective == "gatherv":
        return count[rank], (sum(count) if rank == root else 0)
    if collective == "scatterv":
        return (sum(count) if rank == root else 0), count[rank]
    if collective == "alltoallv":
        return sum(count[rank]), sum(row[rank] for row in count)
    return count, count  # broadcast, reduce, allreduce, scan, exscan


def steps(schedule, collective: str, rank: int, size: int, count=0, op=None, root: int = 0, segment=None,
          nodes=None, shared=False):
    """Call an algorithm's ``schedule`` with the arguments its collective's signature names.

    ``segment`` (elements) goes to a segmented algorithm's ``segment=`` parameter;
    None leaves the algorithm its default (``COMMKIT_SEGMENT_ELEMENTS`` or its own).
    ``nodes`` (every rank's node) goes to a node-aware algorithm's ``nodes=`` parameter,
    ``shared=True`` to a node algorithm's (the call's arrays are shared: its zero-copy form).
    """
    values = {"count": count, "op": op, "root": root}
    args = [values[name] for name in COLLECTIVES[collective].signature]
    extra = {k: v for k, v in (("segment", segment), ("nodes", nodes), ("shared", shared or None)) if v is not None}
    return schedule(rank, size, *args, **extra)
