"""Node-aware algorithms across nodes: a level inside each node, and lanes or leaders between nodes.

Why. On a cluster a message between nodes costs far more than one inside a
node, and every rank of a node shares one network link. A flat ring or tree
over all ranks sends about as many bytes between nodes as it sends inside
them. Here each collective is two levels (Open MPI's HAN, MPICH's node-aware
collectives, Träff's multi-lane decomposition): the node's ranks first work
together, then only what must cross nodes crosses, once.

* allreduce: a reduce-scatter inside every node leaves local rank i of each
  node with 1/k of the node's sum; the ranks that hold the same slice on
  every node (a *lane*) allreduce it between nodes, all lanes at once, so the
  k ranks of a node drive its link together, each with 1/k of the vector;
  an allgather inside every node then hands every rank the whole result.
* broadcast: the root sends to one representative of every other node (its
  first rank, the *leader*), then every node broadcasts from its
  representative; the root stands for its own node, leader or not.
* reduce: every node reduces to its representative (the root on the root's
  node, the leader elsewhere), then the representatives reduce to the root.

Each level runs an existing two-sided algorithm, chosen by
:func:`commkit.selection.select` for that level's ranks and count (counted as
float32 elements: a schedule knows elements, not bytes), so a tuning table
and ``COMMKIT_<COLLECTIVE>_ALGORITHM`` steer the levels too; a choice that
cannot run inside another schedule (``native``, the node engine's ``shm``,
these algorithms themselves) falls back to :data:`commkit.selection.FALLBACK`.
A level's steps are the chosen schedule's own, with its ranks and buffer
ranges moved onto this communicator's (:func:`moved`), so the whole
algorithm is one schedule of two-sided steps: it runs on every transport,
blocking or not, and the tracer and the simulator read it like any other.

The layout. ``nodes`` lists the node of every rank (any ints, as
:meth:`commkit.cost.TwoLevel.nodes` gives them); a node's ranks in rank order
are its local ranks 0, 1, ...; its leader is its first. Given none, the
schedules take consecutive blocks of ``COMMKIT_RANKS_PER_NODE`` ranks of the
communicator (one node when it is unset), which is the emulated layout of
the world communicator. The layout never decides correctness, only which
messages cross nodes: every step is a transfer on the whole communicator.
Every rank must see the same layout (the same environment).

Uneven nodes. With L the size of the largest node, the vector is cut into L
slices; a node of k ranks gives local rank i the slices
``partition(L, k)[i]``, a contiguous range, so its node-level reduce-scatter
and allgather have one block per rank. The lane of a slice is its owner on
every node; on nodes of k < L ranks a rank owns several slices and takes part
in one lane per run of slices whose lanes are the same, in slice order (no
two ranks wait for each other in opposite orders). Counts smaller than L
leave slices empty; an empty slice sends nothing.

Restrictions: commutative ops (the node level regroups contributions); not
in the default selection table (chosen by name, ``algorithm="hier"``, once
this module is loaded: ``commkit.algorithms.load("commkit.algorithms.hier")``
or ``COMMKIT_ALGORITHMS=commkit.algorithms.hier``). Cost: no closed form is
registered (each level's algorithm depends on its size); the simulator
predicts it under :class:`commkit.cost.TwoLevel` (:func:`simulate`).
Results are the same bits on every rank: each element of an allreduce is
reduced by one lane, whose allreduce gives its members the same bits, and the
node allgather copies them.
"""

from __future__ import annotations

import functools

from .. import algorithms, collectives, selection
from ..errors import AlgorithmNotApplicable, InvalidArgument
from ..ops import SUM
from ..schedule import (COPY, REDUCE, TRANSFER, Copy, Exchange, Reduce, Transfer, inplace_safe, partition,
                        partition_sizes)
from ..transports._arena import ranks_per_node
from .pipelined import COST_ITEMSIZE

__all__ = ["NAME", "Layout", "layout", "moved", "allreduce_hier", "broadcast_hier", "reduce_hier", "register",
           "unregister", "simulate"]

NAME = "hier"
"""The name the three algorithms are registered under: ``algorithm="hier"``."""


class Layout:
    """Which ranks share a node: members, local ranks, leaders and lanes.

    Attributes:
        node: the index of every rank's node (0, 1, ... in order of each node's first rank).
        members: every node's ranks, in rank order.
        local: every rank's position on its node.
        width: ranks on the largest node (L: the number of slices an allreduce cuts).
    """

    def __init__(self, nodes):
        index: dict = {}
        members: list = []
        for r, n in enumerate(nodes):
            if n not in index:
                index[n] = len(members)
                members.append([])
            members[index[n]].append(r)
        self.node = tuple(index[n] for n in nodes)
        self.members = tuple(tuple(m) for m in members)
        local = [0] * len(nodes)
        for m in self.members:
            for i, r in enumerate(m):
                local[r] = i
        self.local = tuple(local)
        self.width = max((len(m) for m in self.members), default=0)

    def __repr__(self) -> str:
        return f"Layout({'+'.join(str(len(m)) for m in self.members)} ranks)"

    def representatives(self, root: int) -> tuple:
        """Each node's representative for a rooted call: ``root`` on its own node, the leader on the others."""
        return tuple(root if self.node[root] == n else m[0] for n, m in enumerate(self.members))

    def owned(self, n: int) -> tuple:
        """The slices each local rank of node ``n`` owns: ``(first, end)`` per local rank (``partition(L, k)``)."""
        return partition(self.width, len(self.members[n]))

    def owner(self, n: int, j: int) -> int:
        """The rank of node ``n`` that owns slice ``j`` (the inverse of :meth:`owned`, without listing it)."""
        long, short, n_long = partition_sizes(self.width, len(self.members[n]))
        i = j // long if j < n_long * long else n_long + (j - n_long * long) // short
        return self.members[n][i]

    def lane(self, j: int) -> tuple:
        """The ranks that allreduce slice ``j`` between nodes: its owner on every node, in node order."""
        return tuple(self.owner(n, j) for n in range(len(self.members)))


@functools.lru_cache(maxsize=64)
def _layout(nodes: tuple) -> Layout:
    return Layout(nodes)


def layout(size: int, nodes=None) -> Layout:
    """The layout of ``size`` ranks: ``nodes`` (each rank's node), else blocks of ``COMMKIT_RANKS_PER_NODE``.

    Raises:
        InvalidArgument: ``nodes`` does not list one node per rank.
    """
    if nodes is None:
        k = ranks_per_node() or size or 1
        nodes = tuple(r // k for r in range(size))
    else:
        nodes = tuple(nodes)
        if len(nodes) != size:
            raise InvalidArgument(f"nodes must list the node of each of the {size} ranks, got {len(nodes)} entries.")
    return _layout(nodes)


# -- levels ------------------------------------------------------------------------------------------

def _level(collective: str, p: int, count, op):
    """The algorithm one level runs on ``p`` ranks: the selector's, if it is two-sided and not this one.

    ``count`` is the level's schedule argument (per-rank counts for reduce_scatter and
    allgatherv); the selector sees it as float32 elements.
    """
    elements = sum(count) if isinstance(count, tuple) else count
    try:
        alg = selection.select(collective, p, elements * COST_ITEMSIZE, op).algorithm
    except AlgorithmNotApplicable:  # a forced COMMKIT_<COLLECTIVE>_ALGORITHM this level cannot run
        alg = None
    if alg is None or alg.schedule is None or alg.name == NAME or algorithms.is_node_only(alg):
        # The selector's fallbacks; the vector collectives have none there, and naive always applies.
        names = selection.FALLBACK.get(collective, ("naive",))
        alg = next(a for a in map(lambda name: algorithms.get(collective, name), names) if a.why_not(p, op) is None)
    return alg


def moved(steps, ranks, buffers):
    """A level's ``steps`` as this communicator's: peer q becomes ``ranks[q]``, a buffer range moves.

    Args:
        steps: a two-sided schedule over ``len(ranks)`` ranks (Transfer, Reduce, Copy).
        ranks: this communicator's rank of each of the level's ranks.
        buffers: ``{name: (name here, offset)}`` for every buffer the level names.

    Yields:
        The same steps over this communicator's ranks and buffers.
    """
    def ref(r):
        name, lo, hi = r
        here, off = buffers[name]
        return here, lo + off, hi + off

    def local(step):
        if step.kind == REDUCE:
            return Reduce(ref(step.into), ref(step.operand), step.op, step.operand_first, ref(step.src))
        return Copy(ref(step.dst), ref(step.src))

    for step in steps:
        kind = step.kind
        if kind == TRANSFER:
            overlap = tuple(local(s) for s in step.overlap)
            if type(step) is Exchange:
                (d, sb), (s, rb) = step.sends[0], step.recvs[0]
                yield Exchange(ranks[d], ref(sb), ranks[s], ref(rb), overlap)
            else:
                yield Transfer([(ranks[q], ref(b)) for q, b in step.sends],
                               [(ranks[q], ref(b)) for q, b in step.recvs], overlap)
        elif kind in (REDUCE, COPY):
            yield local(step)
        else:
            raise AssertionError(f"a level of a node-aware schedule must be two-sided; got {step!r}")


class _Run:
    """One level this rank takes part in: its algorithm, ranks, its place among them, and its arguments."""

    __slots__ = ("alg", "ranks", "me", "count", "op", "root", "buffers")

    def __init__(self, collective, ranks, me, count, op, root, buffers):
        self.alg = _level(collective, len(ranks), count, op)
        self.ranks, self.me, self.count, self.op, self.root, self.buffers = ranks, me, count, op, root, buffers

    @property
    def scratch(self) -> int:
        return self.alg.scratch(self.me, len(self.ranks), self.count)

    def steps(self, rank: int | None = None):
        me = self.me if rank is None else rank
        return collectives.steps(self.alg.schedule, self.alg.collective, me, len(self.ranks), self.count, self.op,
                                 self.root)


def _run_through(run: _Run, tmp_at: int, alias: tuple):
    """``run``'s steps here; where its ``in`` aliases its ``out`` and it cannot run in place, from a copy in tmp.

    ``alias`` is the ``(name, offset, elements)`` of this rank's range both name.
    """
    steps = list(run.steps())
    if inplace_safe(steps):
        return moved(steps, run.ranks, run.buffers)
    name, off, n = alias
    buffers = dict(run.buffers, **{"in": ("tmp", tmp_at)})
    return [Copy(("tmp", tmp_at, tmp_at + n), (name, off, off + n)), *moved(steps, run.ranks, buffers)]


def _needs_copy(run: _Run) -> bool:
    return not inplace_safe(list(run.steps()))


# -- allreduce ----------------------------------------------------------------------------------------

def _allreduce_levels(rank, size, count, op, nodes):
    """This rank's three levels: ``(node reduce-scatter, [lane allreduces], node allgather)``.

    Each lane allreduce is ``(run, lo, hi)``: the run and the range of the vector it reduces.
    """
    lay = layout(size, nodes)
    n = lay.node[rank]
    members, i = lay.members[n], lay.local[rank]
    cuts = [lo for lo, _ in partition(count, lay.width)] + [count]
    blocks = tuple(cuts[b] - cuts[a] for a, b in lay.owned(n))
    lo = cuts[lay.owned(n)[i][0]]
    whole = {"in": ("in", 0), "tmp": ("tmp", 0)}
    scatter = _Run("reduce_scatter", members, i, blocks, op, 0, dict(whole, out=("out", lo)))
    gather = _Run("allgatherv", members, i, blocks, None, 0,
                  {"in": ("out", lo), "out": ("out", 0), "tmp": ("tmp", 0)})
    lanes = []
    first, end = lay.owned(n)[i]
    j = first
    while j < end:
        # A run of slices with the same lane is one allreduce: every member of the lane sees the same run.
        lane, k = lay.lane(j), j + 1
        while k < end and lay.lane(k) == lane:
            k += 1
        a, b = cuts[j], cuts[k]
        if b > a and len(lane) > 1:
            run = _Run("allreduce", lane, lane.index(rank), b - a, op, 0,
                       {"in": ("out", a), "out": ("out", a), "tmp": ("tmp", 0)})
            lanes.append((run, a, b))
        j = k
    return scatter, lanes, gather


def _allreduce_scratch(rank, size, count, nodes=None):
    # Planned with SUM: the op is commutative (a restriction), and the selector asks no more of it.
    scatter, lanes, gather = _allreduce_levels(rank, size, count, SUM, nodes)
    level = max([scatter.scratch, gather.scratch] + [run.scratch for run, _, _ in lanes])
    copies = [b - a for run, a, b in lanes if _needs_copy(run)]
    return level + max(copies, default=0)


def allreduce_hier(rank, size, count, op, nodes=None):
    """Node-aware allreduce: node reduce-scatter, an allreduce per lane between nodes, node allgather.

    Restrictions: commutative op. ``nodes`` (each rank's node) defaults to blocks of
    ``COMMKIT_RANKS_PER_NODE`` ranks. Cost, with k ranks on each of N nodes and ring
    algorithms at both levels (α, β inside a node; α', β' between nodes; equal blocks):
    2(k-1)(α + (n/k)β) + (k-1)(n/k)γ inside, plus 2(N-1)(α' + (n/kN)β') + (N-1)(n/kN)γ
    between, where every rank of a node sends its own lane's share at once, against a flat
    ring's 2(Nk-1) rounds. Not registered as a formula (each level's algorithm is the
    selector's, by its size): the simulator gives it (:func:`simulate`).

    Phases: (1) reduce-scatter inside each node, local rank i keeping its slices of the
    node's sum in its output; (2) for each run of slices with one lane, an allreduce of
    that range of the output between the lane's ranks (one per node); (3) allgather
    inside each node of every local rank's range.
    """
    if count == 0:
        return
    scatter, lanes, gather = _allreduce_levels(rank, size, count, op, nodes)
    tmp_at = max([scatter.scratch, gather.scratch] + [run.scratch for run, _, _ in lanes])
    # Phase 1: reduce-scatter inside the node; this rank's slices of the node's sum land in its output.
    yield from moved(scatter.steps(), scatter.ranks, scatter.buffers)
    # Phase 2: one allreduce per lane between nodes, in place on this rank's range of the output.
    for run, a, b in lanes:
        yield from _run_through(run, tmp_at, ("out", a, b - a))
    # Phase 3: allgather inside the node: every local rank's reduced range to every other.
    yield from moved(gather.steps(), gather.ranks, gather.buffers)


# -- broadcast ----------------------------------------------------------------------------------------

def _broadcast_levels(rank, size, count, root, nodes):
    """This rank's levels: ``(between representatives or None, inside the node)``."""
    lay = layout(size, nodes)
    n = lay.node[rank]
    reps, members = lay.representatives(root), lay.members[n]
    between = None
    if rank in reps and len(reps) > 1:
        between = _Run("broadcast", reps, n, count, None, lay.node[root],
                       {"in": ("in", 0), "out": ("out", 0), "tmp": ("tmp", 0)})
    # The representative broadcasts from its output (what it received), the root from its input.
    source = ("in", 0) if rank == root else ("out", 0)
    inside = _Run("broadcast", members, lay.local[rank], count, None, members.index(reps[n]),
                  {"in": source, "out": ("out", 0), "tmp": ("tmp", 0)})
    return between, inside


def _rooted_scratch(collective, rank, size, count, nodes, copy):
    """Scratch for a rooted call on ``rank`` whatever its root (the scratch declaration is not told it).

    The root decides which ranks represent their nodes and where each level is rooted,
    not which algorithm a level runs (that depends on its size and count): so the most
    any place in either level asks for, plus ``count`` where the level between nodes
    may have to run from a copy.
    """
    lay = layout(size, nodes)
    n = lay.node[rank]
    op = SUM if collective == "reduce" else None
    levels = [(len(lay.members[n]), lay.local[rank])]
    if len(lay.members) > 1:
        levels.append((len(lay.members), n))
    need = max(_level(collective, p, count, op).scratch(me, p, count) for p, me in levels)
    return need + (count if copy and len(levels) > 1 else 0)


def _broadcast_scratch(rank, size, count, nodes=None):
    return _rooted_scratch("broadcast", rank, size, count, nodes, copy=False)


def broadcast_hier(rank, size, count, root, nodes=None):
    """Node-aware broadcast: the root to one representative per node, then each node from its representative.

    Restrictions: none. The root represents its own node; every other node's leader
    (first rank) represents it. Cost: the between-node broadcast over N representatives,
    then the node broadcast over k ranks: each byte crosses into a node once.
    """
    if count == 0:
        return
    between, inside = _broadcast_levels(rank, size, count, root, nodes)
    # Phase 1: between nodes, the root to every other node's leader.
    if between is not None:
        yield from moved(between.steps(), between.ranks, between.buffers)
    # Phase 2: inside every node, from its representative (a broadcast's root only copies in to out).
    yield from moved(inside.steps(), inside.ranks, inside.buffers)


# -- reduce -------------------------------------------------------------------------------------------

def _reduce_levels(rank, size, count, op, root, nodes):
    """This rank's levels: ``(inside the node, between representatives or None)``."""
    lay = layout(size, nodes)
    n = lay.node[rank]
    reps, members = lay.representatives(root), lay.members[n]
    inside = _Run("reduce", members, lay.local[rank], count, op, members.index(reps[n]),
                  {"in": ("in", 0), "out": ("out", 0), "tmp": ("tmp", 0)})
    between = None
    if rank in reps and len(reps) > 1:
        between = _Run("reduce", reps, n, count, op, lay.node[root],
                       {"in": ("out", 0), "out": ("out", 0), "tmp": ("tmp", 0)})
    return inside, between


def _reduce_scratch(rank, size, count, nodes=None):
    # Planned with SUM: the op is commutative (a restriction), and the selector asks no more of it.
    return _rooted_scratch("reduce", rank, size, count, nodes, copy=True)


def reduce_hier(rank, size, count, op, root, nodes=None):
    """Node-aware reduce: every node to its representative, then the representatives to the root.

    Restrictions: commutative op. The root represents its own node, every other node's
    leader its node. Cost: a node reduce over k ranks, then a reduce over N
    representatives: each node sends one vector out of it.
    """
    if count == 0:
        return
    inside, between = _reduce_levels(rank, size, count, op, root, nodes)
    # Phase 1: inside every node, to its representative's output.
    yield from moved(inside.steps(), inside.ranks, inside.buffers)
    # Phase 2: between nodes, the representatives' partial results to the root.
    if between is not None:
        tmp_at = _rooted_scratch("reduce", rank, size, count, nodes, copy=False)
        yield from _run_through(between, tmp_at, ("out", 0, count))


# -- registration -------------------------------------------------------------------------------------

_ALGORITHMS = (
    ("allreduce", allreduce_hier, dict(commutative=True, scratch=_allreduce_scratch)),
    ("broadcast", broadcast_hier, dict(scratch=_broadcast_scratch)),
    ("reduce", reduce_hier, dict(commutative=True, scratch=_reduce_scratch)),
)


def register() -> None:
    """Register the three algorithms as ``hier`` (again, after :func:`unregister`); importing this module does."""
    for collective, schedule, options in _ALGORITHMS:
        algorithms.algorithm(collective, NAME, **options)(schedule)


def unregister() -> None:
    """Remove the three ``hier`` algorithms from the registry (the module stays imported)."""
    for collective, _, _ in _ALGORITHMS:
        if algorithms.get(collective, NAME) is not None:
            algorithms.unregister(collective, NAME)


def simulate(collective: str, p: int, count: int, model, *, root: int = 0, itemsize: int = 4):
    """Predict a ``hier`` call with :func:`commkit.sim.simulate_steps` under a two-level ``model``.

    The schedules are given the model's own placement (``model.nodes(p)``), so the
    levels follow the nodes the model charges for.

    Args:
        collective: ``"allreduce"``, ``"broadcast"`` or ``"reduce"``.
        p: ranks.
        count: elements per rank.
        model: a :class:`commkit.cost.TwoLevel`.
        root: the root of broadcast and reduce.
        itemsize: bytes per element.

    Returns:
        The :class:`commkit.sim.SimResult`.
    """
    from .. import sim

    schedule = {c: s for c, s, _ in _ALGORITHMS}.get(collective)
    if schedule is None:
        raise InvalidArgument(f"hier has allreduce, broadcast and reduce; got {collective!r}.")
    nodes = tuple(model.nodes(p))
    args = {"allreduce": (count, SUM), "broadcast": (count, root), "reduce": (count, SUM, root)}[collective]
    return sim.simulate_steps(lambda r: schedule(r, p, *args, nodes=nodes), p, itemsize=itemsize, model=model,
                              collective=collective, algorithm=NAME)


register()
