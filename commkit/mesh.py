"""Parallelism meshes: data-, model- and pipeline-parallel sub-communicators from one description.

A mesh arranges a communicator's ranks in an n-dimensional grid, one named
axis per kind of parallelism, and gives each rank one sub-communicator per
axis: the ranks that share every coordinate except that axis's.

The layout is row-major, the last axis varying fastest, as in NumPy's C order.
The keyword form ``comm.mesh(data=D, model=M, pipeline=P)`` orders the axes
``(pipeline, data, model)``, so

    rank = (pipeline * D + data) * M + model

Model-parallel (tensor-parallel) ranks are therefore adjacent, and when ranks
are packed onto nodes in blocks (ranks 0..R-1 on the first node, and so on) a
model-parallel group shares a node. That is the place for it: tensor
parallelism exchanges activations inside every layer, data parallelism
exchanges gradients once a step, pipeline parallelism passes one activation
per micro-batch between neighbouring stages. This is the convention
Megatron-LM and torch's ``DeviceMesh`` users know.

Why the layout is pure and separate: :class:`MeshLayout` maps ranks to
coordinates and groups without any communication, so it can be tested
exhaustively, printed for a thousand ranks in a notebook, and computed
identically on every rank. :func:`make_mesh` first builds and validates the
layout (no message is sent for a bad shape), then creates the groups with one
:meth:`Communicator.split` per axis, in axis order, so every rank makes the same
collective calls in the same order. Each split's colour is the group's index
along that axis and its key the rank's coordinate, so a group's ranks are
numbered by their coordinate, and the algorithms inside a group see only the
group's rank and size, as on any communicator.

The ``ranks_per_node`` hint changes which global rank sits at each grid
position, and only when the innermost axis's size does not divide it: each
node is then filled with as many whole innermost groups as fit, and the ranks
left over on every node form the remaining groups. That is the most groups
that can live inside one node; where the size divides ``ranks_per_node`` the
plain layout already achieves it and is kept unchanged.
"""

from __future__ import annotations

import keyword
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from .errors import CollectiveMismatch, CommClosed, InvalidArgument

if TYPE_CHECKING:  # only for the annotations: communicator.py imports this module (Communicator.mesh)
    from .communicator import Communicator

__all__ = ["STANDARD_AXES", "MeshLayout", "Mesh", "mesh_layout", "make_mesh"]

STANDARD_AXES = ("pipeline", "data", "model")
"""The keyword form's axes, outermost first: model-parallel ranks are adjacent."""


# -- checking a description ------------------------------------------------------------------


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _check_name(name) -> str:
    if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name) or name.startswith("_"):
        raise InvalidArgument(
            f"mesh axis names must be Python identifiers that do not start with '_', got {name!r}."
        )
    if name in _RESERVED:
        raise InvalidArgument(
            f"mesh axis name {name!r} is taken by a Mesh attribute; choose another name "
            f"(reserved: {', '.join(sorted(_RESERVED))})."
        )
    return name


def _check_axis_size(name: str, value) -> int:
    if not _is_int(value) or (value < 1 and value != -1):
        raise InvalidArgument(
            f"mesh axis {name!r} must have a positive int size, or -1 to infer it, got {value!r}."
        )
    return int(value)


def _axes_from(axes, data, model, pipeline) -> list[tuple[str, int]]:
    """The (name, size) pairs a call describes, outermost first; sizes may still hold one -1."""
    keywords = {"data": data, "model": model, "pipeline": pipeline}
    if axes is not None:
        given = [k for k, v in keywords.items() if v is not None]
        if given:
            raise InvalidArgument(
                f"pass the axes either as one ordered mapping or as data=/model=/pipeline= keywords, "
                f"not both; got a mapping and {', '.join(g + '=' for g in given)}."
            )
        if isinstance(axes, Mapping):
            pairs = list(axes.items())
        else:
            try:
                pairs = [tuple(item) for item in axes]
            except TypeError:
                raise InvalidArgument(
                    f"axes must be an ordered mapping of axis names to sizes (or a sequence of (name, size) "
                    f"pairs), got {type(axes).__name__}."
                ) from None
            if any(len(pair) != 2 for pair in pairs):
                raise InvalidArgument(f"axes must be (name, size) pairs, got {list(axes)!r}.")
        if not pairs:
            raise InvalidArgument("axes must name at least one axis, got none.")
        names = [_check_name(name) for name, _ in pairs]
        seen = set()
        for name in names:
            if name in seen:
                raise InvalidArgument(f"mesh axis names must be distinct; {name!r} appears more than once.")
            seen.add(name)
        return [(name, _check_axis_size(name, size)) for name, size in pairs]
    if data is None:
        # An omitted data axis takes whatever the other axes leave, unless one of them is already inferred.
        data = 1 if -1 in (model, pipeline) else -1
    sizes = {"data": data, "model": 1 if model is None else model, "pipeline": 1 if pipeline is None else pipeline}
    return [(name, _check_axis_size(name, sizes[name])) for name in STANDARD_AXES]


def _bracketed(groups) -> str:
    return " ".join("[" + " ".join(map(str, g)) + "]" for g in groups)


def _describe(pairs) -> str:
    return " x ".join(f"{name}={size}" for name, size in pairs)


def _resolve(size: int, pairs) -> tuple[int, ...]:
    """Fill in the one inferred (-1) axis and check the sizes multiply to the communicator's size."""
    inferred = [name for name, s in pairs if s == -1]
    if len(inferred) > 1:
        raise InvalidArgument(
            f"only one mesh axis may be -1 (inferred), got -1 for {' and '.join(map(repr, inferred))}."
        )
    known = int(np.prod([s for _, s in pairs if s != -1], dtype=np.int64))
    if inferred:
        if size % known:
            rest = _describe([(n, s) for n, s in pairs if s != -1])
            raise InvalidArgument(
                f"cannot infer mesh axis {inferred[0]!r}: the other axes ({rest}) hold {known} ranks, "
                f"which does not divide the communicator's {size} ranks."
            )
        return tuple(size // known if s == -1 else s for _, s in pairs)
    if known != size:
        raise InvalidArgument(
            f"a mesh of {_describe(pairs)} needs {known} ranks, but the communicator has {size}; "
            "the axis sizes must multiply to the communicator's size (pass -1 for one axis to infer it)."
        )
    return tuple(s for _, s in pairs)


def _node_order(size: int, inner: int, ranks_per_node: int | None) -> tuple[int, ...]:
    """Global ranks in grid order: each node's whole innermost groups first, then the ranks left over."""
    if ranks_per_node is None or inner == 1 or ranks_per_node % inner == 0:
        return tuple(range(size))
    fitted, leftover = [], []
    for start in range(0, size, ranks_per_node):
        node = range(start, min(start + ranks_per_node, size))
        whole = len(node) // inner * inner
        fitted.extend(node[:whole])
        leftover.extend(node[whole:])
    return tuple(fitted + leftover)


# -- the pure layout -------------------------------------------------------------------------


class MeshLayout:
    """Where every rank sits in a mesh, and the groups along each axis; computed without communication.

    Build one with :func:`mesh_layout`. Grid position ``(c_0, ..., c_{n-1})``
    (outermost axis first) holds global rank ``order[ravel(c)]``, where ravel is
    row-major (last axis fastest); without a ``ranks_per_node`` hint that
    moves ranks, ``order`` is ``0, 1, ..., size-1``.

    Attributes:
        names: the axis names, outermost first.
        shape: the axis sizes, in the same order.
        size: the number of ranks (the product of ``shape``).
        ranks_per_node: the hint the layout was built with (None: none).
        order: ``order[i]`` is the global rank at row-major grid position ``i``.
    """

    def __init__(self, names, shape, ranks_per_node=None, order=None):
        self.names = tuple(names)
        self.shape = tuple(int(s) for s in shape)
        self.size = int(np.prod(self.shape, dtype=np.int64))
        self.ranks_per_node = ranks_per_node
        self.order = tuple(range(self.size)) if order is None else tuple(order)
        assert sorted(self.order) == list(range(self.size)), "order must be a permutation of the ranks"
        self._grid = np.array(self.order, dtype=np.int64).reshape(self.shape)
        self._position = np.empty(self.size, dtype=np.int64)
        self._position[self._grid.reshape(-1)] = np.arange(self.size)

    @property
    def axes(self) -> dict[str, int]:
        """Axis name to size, outermost first."""
        return dict(zip(self.names, self.shape))

    def __eq__(self, other) -> bool:
        return isinstance(other, MeshLayout) and (self.names, self.shape, self.order) == (
            other.names, other.shape, other.order)

    def __hash__(self) -> int:
        return hash((self.names, self.shape, self.order))

    def __repr__(self) -> str:
        hint = f", ranks_per_node={self.ranks_per_node}" if self.ranks_per_node is not None else ""
        return f"MeshLayout({_describe(zip(self.names, self.shape))}{hint})"

    def __str__(self) -> str:
        return self.format()

    def _axis(self, axis: str) -> int:
        try:
            return self.names.index(axis)
        except ValueError:
            raise InvalidArgument(f"this mesh has no axis {axis!r}; its axes are {list(self.names)}.") from None

    def _rank(self, rank) -> int:
        if not _is_int(rank) or not 0 <= rank < self.size:
            raise InvalidArgument(f"rank must be an int in range(0, {self.size}), got {rank!r}.")
        return int(rank)

    def coords(self, rank: int) -> dict[str, int]:
        """The grid coordinates of global ``rank``, one per axis (outermost first)."""
        position = np.unravel_index(self._position[self._rank(rank)], self.shape)
        return {name: int(c) for name, c in zip(self.names, position)}

    def rank_of(self, coords) -> int:
        """The global rank at ``coords``: a mapping of every axis name to a coordinate, or a sequence in axis order."""
        if isinstance(coords, Mapping):
            if set(coords) != set(self.names):
                raise InvalidArgument(
                    f"coords must give exactly the axes {list(self.names)}, got {sorted(coords)}."
                )
            coords = [coords[name] for name in self.names]
        coords = list(coords)
        if len(coords) != len(self.names):
            raise InvalidArgument(f"coords must have {len(self.names)} entries (one per axis), got {len(coords)}.")
        for name, n, c in zip(self.names, self.shape, coords):
            if not _is_int(c) or not 0 <= c < n:
                raise InvalidArgument(f"coordinate {name} must be an int in range(0, {n}), got {c!r}.")
        return int(self._grid[tuple(int(c) for c in coords)])

    def groups(self, axis: str) -> list[tuple[int, ...]]:
        """Every group along ``axis``: global ranks in group-rank order, groups in split-colour order."""
        a = self._axis(axis)
        rows = np.moveaxis(self._grid, a, -1).reshape(-1, self.shape[a])
        return [tuple(int(r) for r in row) for row in rows]

    def group_index(self, rank: int, axis: str) -> int:
        """Which of :meth:`groups` (``axis``) holds ``rank``: the colour its split uses."""
        a = self._axis(axis)
        position = np.unravel_index(self._position[self._rank(rank)], self.shape)
        others = [c for i, c in enumerate(position) if i != a]
        other_shape = [n for i, n in enumerate(self.shape) if i != a]
        return int(np.ravel_multi_index(others, other_shape)) if others else 0

    def group(self, rank: int, axis: str) -> tuple[int, ...]:
        """The global ranks of ``rank``'s group along ``axis``, in group-rank order (index = coordinate)."""
        return self.groups(axis)[self.group_index(rank, axis)]

    def _title(self) -> str:
        title = f"mesh of {self.size} rank{'s' if self.size != 1 else ''}: {_describe(zip(self.names, self.shape))}"
        if len(self.names) > 1:
            title += f" ({self.names[-1]} varies fastest)"
        if self.ranks_per_node is not None:
            title += f"; nodes of {self.ranks_per_node} ranks"
        return title

    def format(self, mark: int | None = None) -> str:
        """The mesh as text: a grid of global ranks (last two axes as rows and columns), then the groups per axis.

        Args:
            mark: a global rank to flag with ``*`` (for example this rank).
        """
        if mark is not None:
            mark = self._rank(mark)
        lines = [self._title()]
        inner_name, inner = self.names[-1], self.shape[-1]
        row_name = self.names[-2] if len(self.names) > 1 else None
        rows = self.shape[-2] if row_name else 1
        row_label = len(f"{row_name}={rows - 1}") + 2 if row_name else 0
        width = max(len(str(self.size - 1)) + 1, len(f"{inner_name}={inner - 1}"))  # +1: room for the mark
        panels = list(np.ndindex(*self.shape[:-2]))  # one grid per combination of the outer axes
        grid = self._grid.reshape(len(panels), rows, inner)
        for panel, coords in enumerate(panels):
            if len(panels) > 1:
                lines.append(", ".join(f"{n}={c}" for n, c in zip(self.names, coords)))
            lines.append(" " * row_label + " ".join(f"{inner_name}={c}".rjust(width) for c in range(inner)))
            for r in range(rows):
                cells = (("*" if x == mark else "") + str(x) for x in grid[panel, r].tolist())
                label = f"{row_name}={r}" if row_name else ""
                lines.append(label.ljust(row_label) + " ".join(c.rjust(width) for c in cells))
        label = max(len(n) for n in self.names) + len(" groups:")
        for name in reversed(self.names):
            lines.append(f"{name} groups:".ljust(label) + " " + _bracketed(self.groups(name)))
        if self.ranks_per_node is not None:
            step = self.ranks_per_node
            nodes = [range(start, min(start + step, self.size)) for start in range(0, self.size, step)]
            lines.append("nodes:".ljust(label) + " " + _bracketed(nodes))
        if mark is not None:
            where = ", ".join(f"{n}={c}" for n, c in self.coords(mark).items())
            lines.append(f"* rank {mark} is at {where}")
        return "\n".join(lines)


def mesh_layout(size: int, axes=None, /, *, data=None, model=None, pipeline=None,
                ranks_per_node: int | None = None) -> MeshLayout:
    """The layout of a mesh over ``size`` ranks, computed without any communication.

    Describe the axes either with keywords (``data``, ``model``, ``pipeline``;
    laid out ``pipeline, data, model``, model fastest) or with ``axes``, an
    ordered mapping of names to sizes, outermost first (its last axis varies
    fastest). One size may be -1, inferred from ``size``. With keywords, an
    omitted ``model`` or ``pipeline`` is 1 and an omitted ``data`` takes the
    ranks left (it is 1 if another axis is -1).

    Args:
        size: the number of ranks the mesh covers.
        axes: ``{"name": size, ...}`` or ``[("name", size), ...]``, outermost first.
        data, model, pipeline: the keyword form's axis sizes.
        ranks_per_node: ranks are packed onto nodes in blocks of this many; keeps
            groups along the innermost axis inside one node where possible.

    Returns:
        A :class:`MeshLayout`.

    Raises:
        InvalidArgument: the axes do not multiply to ``size``, two axes are -1, a
            name or size is malformed, or the hint is not a positive int.
    """
    if not _is_int(size) or size < 1:
        raise InvalidArgument(f"size must be a positive int, got {size!r}.")
    pairs = _axes_from(axes, data, model, pipeline)
    if ranks_per_node is not None and (not _is_int(ranks_per_node) or ranks_per_node < 1):
        raise InvalidArgument(f"ranks_per_node must be a positive int or None, got {ranks_per_node!r}.")
    shape = _resolve(int(size), pairs)
    rpn = None if ranks_per_node is None else int(ranks_per_node)
    return MeshLayout([name for name, _ in pairs], shape, rpn, _node_order(int(size), shape[-1], rpn))


# -- the communicators -----------------------------------------------------------------------


class Mesh:
    """This rank's place in a mesh: one sub-communicator per axis, its coordinates, and the layout.

    Get one from :meth:`Communicator.mesh` (or :func:`make_mesh`). ``mesh[axis]``
    and ``mesh.<axis>`` (``mesh.data``, ``mesh.model`` ...) are the
    sub-communicators; their ranks are this rank's coordinates along the axes.
    A mesh is a context manager: leaving the block frees every group (the
    communicator it was built from stays open).

    Attributes:
        comm: the communicator the mesh was built from.
        layout: the :class:`MeshLayout` (pure: groups of every rank, not only this one's).
        rank: this rank in ``comm``.
        coords: this rank's coordinate along each axis, outermost first.
        comms: axis name to sub-communicator, outermost first.
    """

    def __init__(self, comm: Communicator, layout: MeshLayout):
        assert comm.size == layout.size, "make_mesh validates the layout against the communicator"
        self.comm = comm
        self.layout = layout
        self.rank = comm.rank
        self.coords = layout.coords(comm.rank)
        self.comms: dict[str, Communicator] = {}
        self._closed = False
        try:
            if comm.check:
                _agree(comm, layout)
            for name in layout.names:
                # One split per axis, in axis order on every rank: colour = which group, key = coordinate.
                sub = comm.split(layout.group_index(comm.rank, name), key=self.coords[name])
                self.comms[name] = sub
                if sub.size != layout.axes[name] or sub.rank != self.coords[name]:
                    raise CollectiveMismatch(
                        f"rank {comm.rank} expected a {name} group of {layout.axes[name]} ranks with itself "
                        f"at rank {self.coords[name]}, but the split gave {sub.size} ranks with it at rank "
                        f"{sub.rank}: the ranks described different meshes. Run with COMMKIT_DEBUG=check "
                        "to compare the descriptions."
                    )
        except BaseException:
            self._free(wait=False)  # (the other ranks may never come to free theirs: see Communicator.free)
            raise

    @property
    def names(self) -> tuple[str, ...]:
        """The axis names, outermost first."""
        return self.layout.names

    @property
    def shape(self) -> tuple[int, ...]:
        """The axis sizes, outermost first."""
        return self.layout.shape

    @property
    def axes(self) -> dict[str, int]:
        """Axis name to size, outermost first."""
        return self.layout.axes

    @property
    def size(self) -> int:
        """The number of ranks in the mesh (``comm.size``)."""
        return self.layout.size

    @property
    def closed(self) -> bool:
        """Whether :meth:`free` has run."""
        return self._closed

    def __getitem__(self, axis: str) -> Communicator:
        """The sub-communicator along ``axis`` holding this rank."""
        if self._closed:
            raise CommClosed("this mesh was freed, and its groups with it; build a new one with comm.mesh(...).")
        try:
            return self.comms[axis]
        except KeyError:
            raise InvalidArgument(f"this mesh has no axis {axis!r}; its axes are {list(self.names)}.") from None

    def __getattr__(self, name: str) -> Communicator:
        # Reached only for names that are not ordinary attributes: the axis names.
        layout = self.__dict__.get("layout")
        if layout is not None and name in layout.names:
            return self[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def group(self, axis: str) -> Communicator:
        """The sub-communicator along ``axis`` holding this rank (same as ``mesh[axis]``)."""
        return self[axis]

    def ranks(self, axis: str) -> tuple[int, ...]:
        """The global ranks (in ``comm``) of this rank's group along ``axis``, in group-rank order."""
        return self.layout.group(self.rank, axis)

    def format(self) -> str:
        """The layout as text with this rank marked ``*``; see :meth:`MeshLayout.format`."""
        return self.layout.format(mark=self.rank)

    def __str__(self) -> str:
        return self.format()

    def show(self) -> None:
        """Print :meth:`format`: the grid of ranks and the groups along each axis."""
        print(self.format())

    def __repr__(self) -> str:
        state = "freed" if self._closed else ", ".join(f"{n}={c}" for n, c in self.coords.items())
        return f"<commkit.Mesh {_describe(zip(self.names, self.shape))}: rank {self.rank} at {state}>"

    def free(self) -> None:
        """Free every group of the mesh (not ``comm``); call it on every rank, like any ``free``. Safe twice."""
        self._free(wait=True)

    def _free(self, wait: bool) -> None:
        self._closed = True
        for sub in self.comms.values():
            sub._free(wait)

    def __enter__(self) -> "Mesh":
        return self

    def __exit__(self, kind, exc, tb) -> None:
        self._free(wait=kind is None)  # (as a communicator's: an exception leaves at once)


# Names a mesh axis cannot take, because ``mesh.<axis>`` must reach the axis, not a Mesh attribute.
_RESERVED = frozenset(n for n in dir(Mesh) if not n.startswith("_")) | {"comm", "layout", "rank", "coords", "comms"}


def _agree(comm: Communicator, layout: MeshLayout) -> None:
    """Debug mode: every rank compares the mesh it describes; a difference raises on every rank."""
    mine = (layout.names, layout.shape, layout.ranks_per_node)
    everyone = comm.allgather_object(mine)
    kinds: dict = {}
    for rank, description in enumerate(everyone):
        kinds.setdefault(description, []).append(rank)
    if len(kinds) > 1:
        listed = "; ".join(
            f"{_describe(zip(names, shape))}" + (f" (ranks_per_node={rpn})" if rpn is not None else "")
            + f" on ranks {ranks}"
            for (names, shape, rpn), ranks in kinds.items()
        )
        raise CollectiveMismatch(f"ranks describe different meshes: {listed}.")


def _is_communicator(comm) -> bool:
    """Whether ``comm`` offers what a mesh uses of a communicator (known by its methods: see the imports)."""
    return all(callable(getattr(comm, name, None)) for name in ("check_open", "split", "allgather_object"))


def make_mesh(comm: Communicator, axes=None, /, *, data=None, model=None, pipeline=None,
              ranks_per_node: int | None = None) -> Mesh:
    """Split ``comm`` into one sub-communicator per mesh axis (collective: every rank calls it alike).

    The axes are described as in :func:`mesh_layout`; the layout is checked
    before any communicator is created, so a bad shape raises on every rank
    with nothing sent.

    Args:
        comm: the communicator to arrange (it stays open; the mesh owns only its groups).
        axes: ``{"name": size, ...}`` or ``[("name", size), ...]``, outermost first.
        data, model, pipeline: the keyword form (axes ``pipeline, data, model``, model fastest).
        ranks_per_node: ranks are packed onto nodes in blocks of this many; keeps
            model-parallel (innermost) groups inside one node where possible.

    Returns:
        A :class:`Mesh`; use it as a context manager or call :meth:`Mesh.free`.

    Raises:
        InvalidArgument: the description does not fit ``comm.size`` (before any communication).
        CommClosed: ``comm`` was freed.
        CollectiveMismatch: ranks described different meshes (always detected in
            debug mode, ``COMMKIT_DEBUG=check``; otherwise when the groups come out wrong).
    """
    if not _is_communicator(comm):
        raise InvalidArgument(f"comm must be a commkit.Communicator, got {type(comm).__name__}.")
    comm.check_open()
    layout = mesh_layout(comm.size, axes, data=data, model=model, pipeline=pipeline,
                         ranks_per_node=ranks_per_node)
    return Mesh(comm, layout)
