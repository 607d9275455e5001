"""The simulator: run all p schedules of an algorithm in one process, without data.

Why a simulator. Schedules are data-oblivious, so the steps every rank takes
can be generated for any p without a single byte moving. Driving all p
generators together answers the questions a teacher, a test or the selector
asks: how many messages and bytes each rank sends, how many rounds lie on the
critical path, how long the alpha-beta-gamma model says the call takes, and
whether the schedules deadlock.

How it runs. A naive simulator that rescans every rank each round took 287 s
for ring allreduce at p = 4096 (a prototype before this module), so this one is event-driven, after
LogGOPSim's single event queue: a rank runs until it posts a transfer that
cannot complete yet, and is put back on a work list only when the last of its
peers posts the matching operation. Total cost is proportional to the number
of steps. Messages between one pair of ranks match in posting order, as in
MPI, through one FIFO per (source, destination) channel that holds either
unmatched sends or unmatched receives, never both.

The timing model (full duplex, one port per direction, as in the textbook
formulas of Thakur, Rabenseifner and Gropp, 2005):

* a :class:`~commkit.schedule.Transfer` with ``s`` sends and ``r`` receives
  costs ``k*alpha + beta*max(bytes sent, bytes received)`` with
  ``k = max(s, r)``; it cannot finish before every matching peer step was
  posted: ``finish = max(own start, peers' post times) + cost``;
* a :class:`~commkit.schedule.Reduce` costs ``gamma * bytes``; a
  :class:`~commkit.schedule.Copy` is free.

"Rounds on the critical path" is the same recurrence with alpha = 1 and
beta = gamma = 0: the latency term of the algorithm, the coefficient of alpha.

Two other clocks run the same schedules (``model=``; see docs/cost_models.md).
:class:`commkit.cost.TwoLevel` groups ranks into nodes: a transfer costs the
alpha-beta time of its messages within the node and of those between nodes,
whichever is longer, with each level's own constants. :class:`commkit.cost.LogGP`
gives each rank a processor and a link that work at once (overheads ``o``,
latency ``L``, gap ``g``, ``G`` per byte): sends are eager, a rank's link sends
its messages one after another while its processor goes on, and the local steps
a transfer carries in ``overlap=`` run while its messages travel; it is run by
an engine of its own (:class:`_LogGPEngine`), which shares the matching and
checks. Neither changes which messages match or whether schedules deadlock,
only the clock (``tests/test_cost_models.py``).

If the work list empties while some rank has not finished, the schedules
deadlock (or a message is never received); the result then names, for every
stuck rank, the step it is blocked in and the peers it waits for.

Symmetric schedules. Even an event engine runs every step of every rank: 33
million steps for ring allreduce at p = 4096, most of the time spent in the
schedules' own generators. An algorithm registered with a ``symmetry``
(:class:`commkit.algorithms.Algorithm`) promises that, for equal blocks,
rank r's schedule is rank 0's with every peer shifted by r (``"rotation"``)
or XORed with r (``"xor"``, p a power of two), ranges of the same lengths.
Then every rank is in the same class: all take each step at the same moment,
so :func:`simulate` runs rank 0 alone and the step's finish is its start
plus its cost. It checks, step by step, what rank 0 alone can show: that
every message rank 0 sends to offset d is matched, in the same step, by a
receive from offset -d (rotation) or d (xor) of the same length, which is
what rank d's shifted copy of the step posts. If any step fails that check,
or anything else is unusual, it falls back to running every rank. The
promise itself cannot be checked from rank 0, so ``tests/test_sim.py``
proves it for every declared algorithm: the two give identical results for
p = 1 ... 64 and every count.

The node arena's one-sided steps (``Put``, ``Get``, ``ReduceSlots``,
``Publish``, ``Wait``) run on this path too, for a whole schedule: every peer
publishes each counter step at the moment rank 0 does, so a wait on any peers,
all p-1 of them included, ends alpha after the later of its start and rank 0's
own publication, one lookup whatever the peers. A wait for a step rank 0 has
not published yet would wait forever on every rank (a deadlock, which every
rank run then reports). A wait pairs with nothing rank 0's steps could check,
so rank p-1's one-sided steps are compared with rank 0's (lengths, counter
steps, peers seen from the rank): a split into p parts gives rank 0 the
longest part and rank p-1 the shortest, so slices that do not divide evenly
show there, and every rank runs.

Schedules in chunks. Rank 0 alone can still be too long to run step by step:
the alltoall through the arena cuts each block into pieces of segment / (p-1)
elements and takes 2(p - 1) steps a piece, 134 million steps of rank 0's at
p = 4095 and 1 MiB a block, 34 billion at 65,535. Its chunks repeat: chunk c
is chunk 0's steps with its own length and counter step c + 1. Such a schedule
is built from its parts (:func:`commkit.algorithms.node._in_chunks`: a head,
a body per chunk, a tail; the generator every transport runs yields their
steps, so it is written once), and the symmetric path reads the parts
(:func:`_symmetric_chunks`): the head and the tail step by step, and the
first two chunks and the last, which must be one period (:func:`_period`:
each length the chunk's own or the same in all, each counter step moved by
one amount a chunk, the same peers); every chunk is then evaluated from that
period, a run of equal copies at a time. A run of n copies of x adds x n
times, which :func:`_add_repeatedly` does in a few operations per binade the
sum crosses, the same sums as the loop, bit for bit (inside a binade each
addition adds the same multiple of its ulp). Rank p-1's head, chunks read and
tail are checked as above. At p = 65,535 the alltoall then reads 393,213 steps
of rank 0's for its 262,144 chunks.

Schedules in phases. A composite algorithm such as van de Geijn's broadcast
(a binomial scatter, then a ring allgather) has a root, so no rank stands for
the others, yet nearly all its steps (16.8 million of them at p = 4096) are in
a phase where every rank is alike. Built with
:func:`commkit.algorithms.phased`, such a schedule names its phases, and a
phase may declare a symmetry. :func:`simulate` then runs each phase on its
own (:func:`_simulate_phased`): a phase without one in the event engine, every
rank starting at the time its previous phase ended; a symmetric phase from
rank 0's steps alone, each step computed for all p ranks at once with NumPy
(:func:`_symmetric_steps`). Rank r's step i is rank 0's with every peer moved,
and the operations it matches are its peers' step i (the same check as
above), so it finishes at max(its post, those peers' posts) + its cost: a
max and a sum over arrays of p start times, the engine's own operations on
the same numbers, so the times agree bit for bit. Phases can be run apart
because messages between two ranks match in posting order: when every phase
run on its own matches all its operations (checked), no message crosses a
phase boundary. Anything unusual falls back to running every rank, which
reports it; ``tests/test_sim.py`` compares the two for p = 1 ... 64.

Unequal blocks that turn with the rank. Where p does not divide the count
(p = 4095, 65,535), a ring's blocks are of q and q+1 elements and the ranks
differ in their message lengths, so no rank is another's copy; run one by one,
a ring's O(p) steps on each of p ranks add up to O(p^2) steps (12.9 billion
for ring allreduce at p = 65,535), beyond any engine that takes steps one by
one. But the ranks differ only in which blocks they carry: under a rotation,
rank r does what rank 0 does with every peer shifted by r and every block b
read as block (b + r) mod p. So :func:`simulate` runs rank 0's steps alone
here too (:func:`_simulate_turning`), giving each of its ranges a label that
says how long it is on every rank (:class:`_TurningBlocks`: a block, a rank's
own block, a length fixed on every rank, or, in scratch, what was last written
there), and computes each step for all p ranks at once with NumPy
(:func:`_turning_steps`), the engine's operations on the same numbers, so the
times are bit for bit the engine's. Its check is the symmetric one, per length
(a receive from offset s is as long as the matching send is on rank s), and,
since rank 0 cannot show that the blocks turn, the steps of one more rank, the
first whose own block is not as long as rank 0's, must be the ones the labels
foretell. A step costs a few array operations over p ranks: O(p^2) work still,
but in NumPy (ring allreduce at p = 65,535: about 6 s of CPU, against days).
Empty blocks (an empty range names no block) and a pipelined ring's segments
(part of a block) run every rank; ``tests/test_sim.py`` compares the turning
path with every rank run for p up to 67.

Ranks alike in classes. A node algorithm with a root (a broadcast through the
shared arena), or one whose ranks fold slices of a chunk that p does not divide
(q + 1 elements on the first ranks, q on the rest), has ranks that differ, but
only in a few ways: the root and every other rank; a long slice and a short one.
Each of its steps names a whole chunk or one slice, and every rank waits on all
p - 1 others, so a rank's steps are O(p) and every rank run one by one is
O(p^2) steps (17 billion for allreduce shm at p = 65,535, 1 MiB). Such an
algorithm declares which ranks are alike: its schedule function carries
``alike(rank, size, *its arguments)``, a key equal for ranks that take the same
steps with the same lengths and counter steps and whose waits name ranks of the
same keys (:mod:`commkit.algorithms.node`). :func:`simulate` then runs the
first rank of each class for its class (:func:`_simulate_alike`): ranks of a
class take each step at the same moment, so a wait ends alpha after the later
of its start and the publications of the classes its peers belong to, the
engine's own arithmetic on the same numbers (times bit for bit the engine's).
The last rank of each class is compared with its first, step by step; a
deadlock, a step of another kind (a message) or a difference makes every rank
run, which reports it. ``tests/test_sim.py`` compares the two for p up to 67,
over one chunk and many, roots anywhere. A declaration that puts every rank in
a class of its own leaves nothing to stand in, and every rank runs.

The engine itself takes steps one by one, and every step comes from a
schedule's generator: ``benchmarks/sim_speed.py --engine-rate`` measures the
generators alone against the engine, the bound on any such engine.

When every rank runs. Where no symmetry may stand in, :func:`simulate` says
why in :attr:`SimResult.fallback` (``commkit sim`` prints it):
:func:`_why_every_rank` names what shows before any step runs (no symmetry
declared, unequal blocks under an xor symmetry or for alltoallv, empty blocks,
xor symmetry on a p that is not a power of two, events, another timing model,
classes of alike ranks each of one rank), and the symmetric paths and the
classes raise :class:`_Refused` naming the step rank 0 (or the witness) cannot
stand for. A step of a kind the symmetric path does not know is one such refusal: the event engine, which checks every step, then runs
it, so a new kind of step is handled correctly (if slowly) before the fast
paths learn it. ``benchmarks/sim_all.py`` lists the cases that still run
every rank at p = 4095 ... 65,536.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import itertools
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np

from . import _models as cost  # the constants and models, as commkit.cost names them
from . import algorithms, collectives
from ._events import step_event
from ._units import format_seconds
from .errors import AlgorithmNotApplicable, CommError, InvalidArgument
from .ops import get_op
from .schedule import (CLAIM, COPY, FINAL, GET, ONE_SIDED, PUBLISH, PUT, REDUCE, REDUCE_SLOTS, RELEASE, TRANSFER,
                       WAIT, Exchange, partition)

__all__ = ["simulate", "simulate_steps", "schedule_args", "why_every_rank", "SimResult", "Waiting", "SimulationError",
           "SIMULATED"]

_REDUCING = collectives.REDUCING
SIMULATED = collectives.NAMES
"""The collectives :func:`simulate` models (whose buffers and message sizes it knows): every one."""
_PER_RANK = ("reduce_scatter", "allgatherv", "gatherv", "scatterv")  # count argument: one count per rank


class SimulationError(CommError, RuntimeError):
    """A schedule did something no transport could run (bad peer, range outside its buffer, unknown step)."""


@dataclass(frozen=True)
class Waiting:
    """One rank stuck at the end of a simulation.

    Attributes:
        rank: the stuck rank.
        step: index of the transfer it is blocked in (0-based, counting every step).
        description: ``repr`` of that step.
        sends_to: peers whose matching receive was never posted.
        recvs_from: peers whose matching send was never posted.
    """

    rank: int
    step: int
    description: str
    sends_to: tuple
    recvs_from: tuple

    def __str__(self) -> str:
        parts = []
        if self.recvs_from:
            parts.append("a send from rank " + ", ".join(map(str, self.recvs_from)))
        if self.sends_to:
            parts.append("a receive by rank " + ", ".join(map(str, self.sends_to)))
        return f"rank {self.rank} waits at step {self.step} ({self.description}) for " + " and ".join(parts)


@dataclass
class SimResult:
    """What a simulation found; per-rank lists are indexed by rank.

    Attributes:
        collective, algorithm: what was simulated (``algorithm`` is the short name).
        p: number of ranks.
        count: the schedule's count argument (a tuple of per-rank counts for reduce_scatter).
        nbytes: the message size in bytes, as :mod:`commkit.selection` counts it.
        itemsize: bytes per element.
        alpha, beta, gamma: the model's constants (s, s/B, s/B).
        messages: messages each rank sent.
        bytes_sent, bytes_received, bytes_reduced: per rank.
        finish: model time at which each rank finished (s); unfinished ranks keep their last time.
        time: predicted time of the call, the latest finish (s).
        rounds: alpha terms on the critical path (the latest finish with alpha=1, beta=gamma=0).
        steps: steps simulated, all ranks together.
        waiting: the stuck ranks if the schedules deadlock, else empty.
        mismatches: messages whose send and receive lengths differ (text).
        events: per-step events in :mod:`commkit.tracing`'s format, if requested.
        wall: seconds the simulation took.
        ranks_simulated: how many ranks' schedules were run: p, or 1 when the algorithm's
            declared symmetry let rank 0 stand for all (see the module docstring; on unequal
            blocks one more rank's steps are read, as a witness, and not counted), or the
            number of classes of ranks the algorithm declares alike (one rank run for each).
        steps_run: how many of the ``steps`` the simulator ran one by one: all of them, rank 0's
            when it stood for every rank, or, for a schedule in phases whose symmetric phase was
            computed for all ranks at once, the other phases' steps and rank 0's of that one.
        fallback: why :func:`simulate` ran every rank's steps one by one instead of letting rank 0
            stand for the others (a phrase such as ``"the blocks are unequal ..."``); None when a
            declared symmetry stood in, or when there was nothing to stand in (one rank, or
            :func:`simulate_steps`, which always runs every rank).
        model: the timing model: None for the alpha-beta-gamma model, else the
            :class:`commkit.cost.LogGP` or :class:`commkit.cost.TwoLevel` it ran under
            (``alpha``, ``beta``, ``gamma`` are then LogGP's ``2o + L``, ``G`` and ``gamma``,
            or the two-level model's constants within a node).
    """

    collective: str
    algorithm: str
    p: int
    count: object
    nbytes: int
    itemsize: int
    alpha: float
    beta: float
    gamma: float
    messages: list
    bytes_sent: list
    bytes_received: list
    bytes_reduced: list
    finish: list
    time: float
    rounds: int
    steps: int
    waiting: list = field(default_factory=list)
    mismatches: list = field(default_factory=list)
    events: list | None = None
    wall: float = 0.0
    ranks_simulated: int = 0
    model: object = None
    steps_run: int = 0
    fallback: str | None = None

    @property
    def deadlocked(self) -> bool:
        """Whether some rank never finished its schedule."""
        return bool(self.waiting)

    @property
    def ok(self) -> bool:
        """No deadlock and every message matched a receive of the same length."""
        return not self.waiting and not self.mismatches

    @property
    def total_messages(self) -> int:
        return sum(self.messages)

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_sent)

    def check(self) -> "SimResult":
        """Return self, or raise :class:`SimulationError` describing the deadlock or mismatch."""
        if self.waiting:
            lines = [str(w) for w in self.waiting[:8]]
            more = f"\n  ... and {len(self.waiting) - 8} more" if len(self.waiting) > 8 else ""
            raise SimulationError(
                f"{self.collective}_{self.algorithm} deadlocks on {self.p} ranks: "
                f"{len(self.waiting)} rank(s) never finish.\n  " + "\n  ".join(lines) + more
            )
        if self.mismatches:
            raise SimulationError(
                f"{self.collective}_{self.algorithm} on {self.p} ranks: send and receive lengths differ:\n  "
                + "\n  ".join(self.mismatches[:8])
            )
        return self

    def summary(self) -> str:
        """A short human-readable report."""

        def spread(values, unit=""):
            lo, hi = min(values, default=0), max(values, default=0)
            return f"{lo}{unit}" if lo == hi else f"{lo}{unit} .. {hi}{unit}"

        count = self.count
        if isinstance(count, tuple):  # per-rank counts, or alltoallv's matrix: the elements in all
            count = sum(sum(c) if isinstance(c, tuple) else c for c in count)
        lines = [
            f"{self.collective}_{self.algorithm}: p={self.p}, {self.nbytes} B message "
            f"(count {count} x {self.itemsize} B)",
            f"  predicted time   {format_seconds(self.time)}   "
            f"(alpha={format_seconds(self.alpha)}, beta={self.beta:.3g} s/B, gamma={self.gamma:.3g} s/B)",
            *([f"  model            {self.model}"] if self.model is not None else []),
            f"  critical path    {self.rounds} rounds (alpha terms)",
            f"  messages/rank    {spread(self.messages)}   (total {self.total_messages})",
            f"  bytes sent/rank  {spread(self.bytes_sent)}   (total {self.total_bytes})",
            f"  bytes reduced    {spread(self.bytes_reduced)}",
            f"  {self.steps} steps simulated in {self.wall:.3f} s" + (
                f" (symmetric: rank 0's {self.steps // self.p} stand for every rank)"
                if self.ranks_simulated == 1 and self.p > 1 else
                f" ({self.steps_run} run one by one, the rest for all ranks at once in a symmetric phase)"
                if 0 < self.steps_run < self.steps else ""),
        ]
        if self.waiting:
            lines.append(f"  DEADLOCK: {len(self.waiting)} rank(s) never finish; e.g. {self.waiting[0]}")
        if self.mismatches:
            lines.append(f"  LENGTH MISMATCH: {self.mismatches[0]}")
        return "\n".join(lines)

    __str__ = summary


def _check_int(value, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidArgument(f"{name} must be an int >= {minimum}, got {value!r}.")
    return value


def schedule_args(collective: str, p: int, nbytes: int, itemsize: int = 4):
    """The schedule's ``count`` argument for a message of ``nbytes`` bytes on ``p`` ranks.

    ``nbytes`` is counted as :mod:`commkit.selection` counts it: the per-rank
    vector for allreduce, reduce, broadcast, scan and exscan; the whole
    gathered/scattered vector for gather, scatter and allgather (so the
    per-rank block is ``nbytes / p``); the whole input vector for
    reduce_scatter (split into p blocks differing by at most one element);
    the block sent to each peer for alltoall. Sizes round down to whole
    elements (and whole per-rank blocks).

    The vector collectives get even counts by default: allgatherv, gatherv and
    scatterv split the whole gathered or scattered vector into p counts
    differing by at most one element (as reduce_scatter does); alltoallv, whose
    ``nbytes`` is the average block, gets that block from every rank to every
    rank (the p x p matrix of equal counts). Pass ``counts=`` to
    :func:`simulate` for uneven ones.

    Returns ``(count, actual_nbytes)``.
    """
    elems = nbytes // itemsize
    if collective in ("gather", "scatter", "allgather"):
        count = elems // p
        return count, count * p * itemsize
    if collective in _PER_RANK:
        counts = tuple(hi - lo for lo, hi in partition(elems, p))
        return counts, elems * itemsize
    if collective == "alltoallv":
        row = (elems,) * p  # one row shared by every rank: p x p counts in O(p) memory
        return (row,) * p, elems * itemsize
    if collective == "barrier":
        return 0, 0
    return elems, elems * itemsize


def _buffer_sizes(collective, alg, rank, p, count, root):
    """Elements of the ``in``, ``out`` and ``tmp`` buffers the communicator gives ``rank``."""
    n_in, n_out = collectives.buffer_sizes(collective, rank, p, count, root)
    return {"in": n_in, "out": n_out, "tmp": alg.scratch(rank, p, count)}


def _all_buffer_sizes(collective, alg, p, count, root):
    """Every rank's :func:`_buffer_sizes`, without the O(p) sum per rank where counts are listed per rank.

    Where the count argument lists one count per rank, :func:`commkit.collectives.buffer_sizes`
    sums the counts for each rank it is asked about: O(p^2) for all ranks (12.4 s of CPU for
    reduce_scatter at p = 65,536, 1 MiB, against 0.02 s this way, both on a loaded machine). A
    rank's ``in`` and ``out`` sizes depend on it only through its own count and whether it is
    the root, so ranks alike in both share one answer (``tests/test_sim.py`` holds this to
    asking for every rank). ``tmp`` is the algorithm's own function of the rank, asked of each
    (a scratch function that sums the counts is still O(p) a rank).
    """
    if collective not in _PER_RANK:
        return [_buffer_sizes(collective, alg, r, p, count, root) for r in range(p)]
    known: dict = {}
    sizes = []
    for r in range(p):
        key = (count[r], r == root)
        if key not in known:
            known[key] = collectives.buffer_sizes(collective, r, p, count, root)
        n_in, n_out = known[key]
        sizes.append({"in": n_in, "out": n_out, "tmp": alg.scratch(r, p, count)})
    return sizes


class _Refused(Exception):
    """A symmetry cannot stand in for every rank here; the message says why, for :attr:`SimResult.fallback`."""


def _unsymmetric(i, step, symmetry) -> str:
    mate = "the mirrored offset" if symmetry == "rotation" else "the same peer"
    return (f"rank 0's step {i} ({step!r}) does not pair each send with a receive of the same length from "
            f"{mate} ({symmetry} symmetry), or names a rank or range outside the call")


def _outside(i, step) -> str:
    return f"rank 0's step {i} ({step!r}) names a rank or a buffer range outside the call"


def _why_every_rank(alg, collective, p, count, use_symmetry, events, timing, root=0) -> str | None:
    """Why :func:`simulate` must run every rank one by one, as far as it shows before any step; None if not.

    A symmetry (the algorithm's, or a phase's) or classes of alike ranks can still be refused
    once the steps are seen (:class:`_Refused`).
    """
    if not use_symmetry:
        return "use_symmetry=False asks for every rank"
    if events:
        return "events=True records every rank's own steps"
    if timing is not None:
        return f"the {type(timing).__name__} model runs every rank (symmetry is used under alpha-beta only)"
    if _alike_key(alg) is not None:
        try:
            classes = _alike_classes(alg, collective, p, count, root)[1]
        except Exception as exc:  # noqa: BLE001 - the full simulation reports the schedule's own errors
            return f"its declaration of alike ranks raised {type(exc).__name__}: {exc}"
        if len(classes) == p and p > 1:
            return (f"its declaration of alike ranks puts each of the {p} ranks in a class of its own, so no rank "
                    f"can stand for another")
        return None
    if alg.symmetry is None and alg.phases is None:
        return "it declares no symmetry and no phases, so no rank can stand for the others"
    if alg.phases is None and alg.symmetry == "xor" and not algorithms.is_pow2(p):
        return f"its xor symmetry needs p a power of two, and p = {p}"
    if algorithms.even_blocks(collective, p, count):
        return None
    if collective == "alltoallv":
        return (f"the blocks are unequal ({_unequal(count, p)}), and alltoallv's counts are a matrix, not one "
                f"vector of blocks that turns with the rank")
    if alg.phases is None and alg.symmetry != "rotation":
        return (f"the blocks are unequal ({_unequal(count, p)}), and an {alg.symmetry} symmetry holds for equal "
                f"blocks only (ranks then differ in their message lengths)")
    if min(_block_lengths(collective, p, count)) == 0:
        return (f"the blocks are unequal ({_unequal(count, p)}) and some are empty, and an empty range does not "
                f"say which block it is (so rank 0 cannot stand for the others)")
    return None  # a rotation: the blocks turn with the rank (_simulate_turning)


def _unequal(count, p) -> str:
    """How the blocks of ``count`` on ``p`` ranks are unequal, in words."""
    if isinstance(count, tuple):
        rows = {id(row): row for row in count}.values()  # a row many ranks share is read once
        values = {c for row in rows for c in (row if isinstance(row, tuple) else (row,))}
        return f"counts from {min(values)} to {max(values)}"
    if count % p:
        return f"count {count} is not a multiple of p = {p}"
    return f"count {count} is not a multiple of {1 << (p.bit_length() - 1)}, the largest power of two below p"


def _factory(collective, schedule, p, count, root, op):
    return lambda r: collectives.steps(schedule, collective, r, p, count, op, root)


def simulate(collective: str, algorithm: str, p: int, nbytes: int = 0, *, itemsize: int = 4, root: int = 0,
             op="sum", count=None, counts=None, alpha: float | None = None, beta: float | None = None,
             gamma: float | None = None, model=None, ranks_per_node: int | None = None, events: bool = False,
             use_symmetry: bool = True) -> SimResult:
    """Simulate ``collective``'s ``algorithm`` on ``p`` ranks for a message of ``nbytes`` bytes.

    Args:
        collective: ``"allreduce"``, ``"broadcast"``, ... (:data:`commkit.algorithms.COLLECTIVES`).
        algorithm: the algorithm's short name (``"ring"``, ``"recursive_doubling"``, ...).
        p: number of ranks (1 or more).
        nbytes: message size as :mod:`commkit.selection` counts it; see :func:`schedule_args`.
        itemsize: bytes per element (4 for float32).
        root: the root of broadcast, reduce, gather and scatter.
        op: the reduction op (restrictions such as commutativity are checked against it).
        count: the schedule's count argument directly, instead of ``nbytes``: elements per
            rank, or for reduce_scatter and the vector collectives a tuple of per-rank counts
            (an int means that count for every rank), for alltoallv the p x p matrix
            ``count[i][j]`` = elements rank i sends to rank j (an int: every block).
        counts: the same as ``count``, by the name the per-rank counts of reduce_scatter
            and the vector collectives usually go by (give one of the two).
        alpha, beta, gamma: seconds per message, per byte sent, per byte reduced
            (default: :data:`commkit.cost.ALPHA`, ``BETA``, ``GAMMA``). Under
            ``model="loggp"`` they are what the LogGP parameters are derived from
            (:meth:`commkit.cost.LogGP.from_alpha_beta`); under the two-level model
            they are the constants within a node.
        model: the timing model: None or ``"alpha-beta"`` (the default, described in the
            module docstring); ``"loggp"`` or a :class:`commkit.cost.LogGP` (processor and
            link as separate resources, so overlapped and pipelined steps gain what they
            should); ``"two-level"`` or a :class:`commkit.cost.TwoLevel` (ranks grouped into
            nodes, messages between nodes dearer). Under a model other than the default,
            every rank is simulated (no symmetry), and ``rounds`` still counts alpha terms.
        ranks_per_node: ranks per node for the two-level model, ranks placed in blocks
            (``ranks_per_node=8`` alone means ``model=cost.TwoLevel(8)`` with ``alpha``,
            ``beta``, ``gamma`` as given and the default between-node constants).
        events: also return every step as a :mod:`commkit.tracing` event with model times.
        use_symmetry: let rank 0 stand for every rank when the algorithm declares a
            symmetry and the blocks are equal, or declares a rotation and the blocks
            (unequal, none empty) turn with the rank, or, for a schedule in phases
            (:func:`commkit.algorithms.phased`), for every rank in a phase that declares
            one (see the module docstring); False runs every rank. The results are the same.

    Returns:
        a :class:`SimResult`; call ``.check()`` to raise on deadlock.

    Raises:
        InvalidArgument: an unknown collective or algorithm, ``native``, or a bad size.
        AlgorithmNotApplicable: the algorithm's restrictions fail for ``p`` or ``op``.
        SimulationError: a schedule names a rank or a buffer range that does not exist.

    Cost: proportional to the total number of steps of all ranks; for a symmetric
    algorithm with equal blocks, to the steps of rank 0 alone; for a rotation on unequal
    blocks and for a symmetric phase, to rank 0's steps (of it), each one a few NumPy
    operations on arrays of p entries.
    """
    if collective not in algorithms.COLLECTIVES:
        raise InvalidArgument(f"unknown collective {collective!r}; expected one of {list(algorithms.COLLECTIVES)}.")
    if collective not in SIMULATED:
        raise InvalidArgument(
            f"the simulator does not model {collective} yet (its buffers and message size); it models "
            f"{list(SIMULATED)}. simulate_steps() runs any schedules.")
    alg = algorithms.get(collective, algorithm)
    if alg is None:
        raise InvalidArgument(
            f"unknown {collective} algorithm {algorithm!r}; expected one of "
            f"{sorted(n for n in algorithms.for_collective(collective) if n != 'native')}."
        )
    if alg.schedule is None:
        raise InvalidArgument(f"{alg.qualname} is the transport's own collective and has no schedule to simulate.")
    p = _check_int(p, "p", 1)
    itemsize = _check_int(itemsize, "itemsize", 1)
    root = _check_int(root, "root", 0)
    if root >= p:
        raise InvalidArgument(f"root must be a rank below p={p}, got {root}.")
    op = get_op(op)
    why = alg.why_not(p, op if collective in _REDUCING else None)
    if why is not None:
        raise AlgorithmNotApplicable(why + ".")
    if counts is not None:
        if count is not None:
            raise InvalidArgument("give count= or counts=, not both (they are the same argument).")
        count = counts
    if count is None:
        nbytes = _check_int(nbytes, "nbytes", 0)
        count, nbytes = schedule_args(collective, p, nbytes, itemsize)
    else:
        count = _check_count(collective, count, p)
        nbytes = _message_bytes(collective, count, p, itemsize)
    timing = _model(model, ranks_per_node, alpha, beta, gamma)
    factory = _factory(collective, alg.schedule, p, count, root, op)
    result = None
    why = _why_every_rank(alg, collective, p, count, use_symmetry, events, timing, root)
    if why is None:
        try:
            if _alike_key(alg) is not None:
                classes = _alike_classes(alg, collective, p, count, root)
                sizes = [_buffer_sizes(collective, alg, r, p, count, root) for r in classes[1]]
                result = _simulate_alike(factory, p, classes, sizes, itemsize, alpha, beta, gamma, collective,
                                         algorithm)
            elif alg.symmetry is not None and not algorithms.even_blocks(collective, p, count):
                # A rotation (_why_every_rank refused the rest): the blocks turn with the rank.
                blocks = _TurningBlocks(_block_lengths(collective, p, count),
                                        _all_buffer_sizes(collective, alg, p, count, root), p)
                result = _simulate_turning(factory, p, blocks, itemsize, alpha, beta, gamma, collective, algorithm)
            elif alg.symmetry is not None and (alg.symmetry == "rotation" or algorithms.is_pow2(p)):
                chunked = getattr(alg.schedule, "chunked", None)
                parts = None if chunked is None else (
                    lambda r: collectives.steps(chunked, collective, r, p, count, op, root))
                result = _simulate_symmetric(factory, p, alg.symmetry,
                                             _buffer_sizes(collective, alg, 0, p, count, root),
                                             itemsize, alpha, beta, gamma, collective, algorithm, parts)
            else:
                result = _simulate_phased(alg, collective, p, count, root, op, itemsize, alpha, beta, gamma,
                                          algorithm)
        except _Refused as refused:
            why = str(refused)
    if result is None:
        sizes = _all_buffer_sizes(collective, alg, p, count, root)
        if timing is not None:
            alpha = beta = gamma = None  # the model holds them now
        result = simulate_steps(factory, p, itemsize=itemsize, alpha=alpha, beta=beta, gamma=gamma, events=events,
                                buffers=sizes, collective=collective, algorithm=algorithm, model=timing)
        result.fallback = why if p > 1 else None  # one rank: nothing another could have stood in for
    result.count = count
    result.nbytes = nbytes
    return result


def why_every_rank(collective: str, algorithm: str, p: int, nbytes: int = 0, *, itemsize: int = 4, count=None,
                   root: int = 0, model=None, ranks_per_node: int | None = None) -> str | None:
    """Why :func:`simulate` will run every rank's steps one by one for this call; None if a symmetry may stand in.

    What shows before any step runs: the algorithm's declarations, the blocks, p and the model.
    A symmetry can still be refused once rank 0's steps are seen (``SimResult.fallback`` then
    says why). Arguments as for :func:`simulate`, which validates them; here they are trusted.
    """
    alg = algorithms.get(collective, algorithm)
    if count is None:
        count, _ = schedule_args(collective, p, nbytes, itemsize)
    else:
        count = _check_count(collective, count, p)
    if p == 1:
        return None
    timing = _model(model, ranks_per_node, None, None, None)
    return _why_every_rank(alg, collective, p, count, True, False, timing, root)


def _is_count(c) -> bool:
    return isinstance(c, int) and not isinstance(c, bool) and c >= 0


def _check_count(collective, count, p):
    if collective in _PER_RANK:
        if _is_count(count):
            count = (count,) * p
        try:
            counts = tuple(count)
        except TypeError:
            counts = ()
        if len(counts) != p or not all(_is_count(c) for c in counts):
            raise InvalidArgument(
                f"counts for {collective} must be {p} non-negative ints (one per rank), got {count!r}.")
        return counts
    if collective == "alltoallv":
        if _is_count(count):
            return ((count,) * p,) * p
        try:
            matrix = tuple(tuple(row) for row in count)
        except TypeError:
            matrix = ()
        if len(matrix) != p or not all(len(row) == p and all(_is_count(c) for c in row) for row in matrix):
            raise InvalidArgument(
                f"counts for alltoallv must be a {p} x {p} matrix of non-negative ints (counts[i][j]: elements "
                f"rank i sends to rank j), got {count!r}.")
        return matrix
    return _check_int(count, "count", 0)


def _message_bytes(collective, count, p, itemsize):
    """The message size in bytes as :mod:`commkit.selection` counts it (``collectives.Collective.message``)."""
    if collective in _PER_RANK:
        return sum(count) * itemsize
    if collective == "alltoallv":
        total = sum(map(sum, count)) * itemsize  # the average block: a whole number of bytes when it is one
        return total // (p * p) if total % (p * p) == 0 else total / (p * p)
    if collective in ("gather", "scatter", "allgather"):
        return count * p * itemsize
    return count * itemsize


def _model(model, ranks_per_node, alpha, beta, gamma):
    """The timing model :func:`simulate` and :func:`simulate_steps` run under: None (alpha-beta) or an instance."""
    given = {k: v for k, v in (("alpha", alpha), ("beta", beta), ("gamma", gamma)) if v is not None}
    if isinstance(model, (cost.LogGP, cost.TwoLevel)):
        if given:
            raise InvalidArgument(
                f"{sorted(given)} cannot be given with a model instance, which holds its own constants; got "
                f"model={model!r}.")
        if ranks_per_node is not None and getattr(model, "ranks_per_node", None) != ranks_per_node:
            raise InvalidArgument(
                f"ranks_per_node={ranks_per_node!r} disagrees with model={model!r}; give it in the model only.")
        return model
    if model not in (None,) + cost.MODELS:
        raise InvalidArgument(
            f"model must be one of {list(cost.MODELS)}, a commkit.cost.LogGP or a commkit.cost.TwoLevel, "
            f"got {model!r}.")
    if model == "loggp":
        if ranks_per_node is not None:
            raise InvalidArgument("the LogGP model has one level; ranks_per_node= belongs to the two-level model.")
        return cost.LogGP.from_alpha_beta(alpha, beta, gamma)
    if ranks_per_node is None:
        if model == "two-level":
            raise InvalidArgument("the two-level model needs ranks_per_node= (ranks on each node).")
        return None
    if model == "alpha-beta":
        raise InvalidArgument("ranks_per_node= asks for the two-level model, but model='alpha-beta' was given.")
    return cost.TwoLevel(ranks_per_node, **given)


def simulate_steps(factory: Callable[[int], Iterable], p: int, *, itemsize: int = 1,
                   alpha: float | None = None, beta: float | None = None, gamma: float | None = None,
                   events: bool = False, buffers: list | None = None, collective: str = "custom",
                   algorithm: str = "custom", model=None, ranks_per_node: int | None = None) -> SimResult:
    """Simulate any schedules: ``factory(rank)`` returns rank's iterable of steps.

    The engine behind :func:`simulate`, for schedules of your own (a teaching
    exercise, a new algorithm, a deliberately broken one).

    Args:
        factory: ``factory(rank) -> iterable of Transfer/Reduce/Copy steps``.
        p: number of ranks.
        itemsize: bytes per element of every buffer.
        alpha, beta, gamma: the model's constants (default: :mod:`commkit.cost`'s).
        events: record :mod:`commkit.tracing`-style events with model times.
        buffers: optional per-rank ``{name: elements}``; every range is then checked against it.
        collective, algorithm: labels for the result and the events.
        model, ranks_per_node: the timing model, as for :func:`simulate`.

    Cost: proportional to the total number of steps of all ranks.
    """
    p = _check_int(p, "p", 1)
    itemsize = _check_int(itemsize, "itemsize", 1)
    timing = _model(model, ranks_per_node, alpha, beta, gamma)
    if timing is not None:
        started = time.perf_counter()
        if isinstance(timing, cost.LogGP):
            engine = _LogGPEngine(factory, p, itemsize, timing, events, buffers, collective, algorithm)
        else:
            engine = _Engine(factory, p, itemsize, timing.alpha, timing.beta, timing.gamma, events, buffers,
                             collective, algorithm, timing)
        with _no_cyclic_gc():
            engine.run()
        return engine.result(collective, algorithm, time.perf_counter() - started)
    alpha, beta, gamma = cost.checked_constants(alpha, beta, gamma)
    started = time.perf_counter()
    engine = _Engine(factory, p, itemsize, alpha, beta, gamma, events, buffers, collective, algorithm)
    with _no_cyclic_gc():
        engine.run()
    wall = time.perf_counter() - started
    return engine.result(collective, algorithm, wall)


def _symmetric_steps(steps, p, symmetry, sizes, alpha, beta_e, gamma_e, t, lt, arena=None):
    """Run rank 0's ``steps`` of a symmetric schedule (or phase) for every rank, or raise :class:`_Refused`.

    Every rank's step i is rank 0's with each peer moved (``symmetry``), so the operations
    matching it are the peers' step i: that needs every send to offset d matched within the
    step by a receive from offset -d (rotation) or d (xor) of the same length, in the same
    order per peer, which is checked here. Then rank r's transfer i finishes at the latest
    of its post and its peers' posts of step i, plus its cost: the engine's rule.

    ``t`` (model time) and ``lt`` (alpha terms) are when the ranks start: one number when
    they all start together, so all take every step at the same moment and a step finishes
    at its start plus its cost; or NumPy arrays indexed by rank (after a rooted phase), and
    then each step is computed for all p ranks at once, one array operation per peer. The
    floating-point operations are the engine's (a max, a sum of the same two numbers), so
    the times are bit for bit the same.

    Args:
        steps: rank 0's steps.
        p: number of ranks.
        symmetry: ``"rotation"`` or ``"xor"``.
        sizes: rank 0's buffer sizes, which its ranges are checked against.
        alpha, beta_e, gamma_e: seconds per message, per element sent, per element reduced.
        t, lt: start times: a float and an int, or a float and an int NumPy array of p entries.
        arena: for a whole schedule (one start time), ``(beta, gamma, itemsize, shape, published,
            times)`` to run the node arena's one-sided steps with (the engine's own products),
            ``shape`` a list that receives each such step's :func:`_one_sided_shape`, ``published``
            and ``times`` the counter steps rank 0 has published and when (t, lt), appended to
            (a schedule in chunks runs in parts); None refuses them.

    Returns:
        ``(t, lt, messages, sent, received, reduced, steps)``: finish times as ``t`` and ``lt``
        came, then each rank's counts (elements; the same for every rank).

    Raises:
        _Refused: a step is not one rank 0 can show symmetric, or anything else is unusual
            (the message says which step and why).
    """
    rotation = symmetry == "rotation"
    vector = isinstance(t, np.ndarray)
    ranks = np.arange(p) if vector and not rotation else None

    def moved(a, d):  # a[the peer at offset d of rank r], for every rank r
        return np.roll(a, -d) if rotation else a[ranks ^ d]

    msgs = sent = recvd = reduced = n_steps = 0
    if arena is not None:
        arena_beta, arena_gamma, arena_itemsize, arena_shape, published, pub_times = arena
    else:
        published, pub_times = [], []  # rank 0's counter steps, and when (t, lt) it published each
    try:
        for step in steps:
            kind = step.kind
            if kind == TRANSFER:
                out_e = in_e = 0
                sends, recvs = step.sends, step.recvs
                if len(sends) == 1 and len(recvs) == 1:  # the common case: one exchange
                    (dest, (name, lo, hi)), (source, (rname, rlo, rhi)) = sends[0], recvs[0]
                    out_e, in_e = hi - lo, rhi - rlo
                    if (out_e != in_e or not 0 <= lo <= hi <= sizes[name] or not 0 <= rlo <= rhi <= sizes[rname]
                            or not 0 <= dest < p or (source != (p - dest) % p if rotation else source != dest)):
                        raise _Refused(_unsymmetric(n_steps, step, symmetry))
                    peers = (dest, source) if source != dest else (dest,)
                else:
                    posted: dict = {}
                    for peer, (name, lo, hi) in sends:
                        if not 0 <= lo <= hi <= sizes[name] or not 0 <= peer < p:
                            raise _Refused(_outside(n_steps, step))
                        posted.setdefault(peer, []).append(hi - lo)
                        out_e += hi - lo
                    matched: dict = {}
                    for peer, (name, lo, hi) in recvs:
                        if not 0 <= lo <= hi <= sizes[name] or not 0 <= peer < p:
                            raise _Refused(_outside(n_steps, step))
                        matched.setdefault((p - peer) % p if rotation else peer, []).append(hi - lo)
                        in_e += hi - lo
                    if posted != matched:
                        raise _Refused(_unsymmetric(n_steps, step, symmetry))
                    peers = {peer for peer, _ in sends} | {peer for peer, _ in recvs}
                ns, nr = len(sends), len(recvs)
                k = ns if ns > nr else nr
                msgs += ns
                sent += out_e
                recvd += in_e
                c = k * alpha + beta_e * (out_e if out_e > in_e else in_e)
                local = 0
                for ov in getattr(step, "overlap", None) or ():
                    if ov.kind == REDUCE:
                        name, lo, hi = ov.into
                        n = hi - lo
                        if any(blo < 0 or bhi - blo != n or bhi > sizes[bname] for bname, blo, bhi in
                               (ov.into, ov.operand, ov.src)):
                            raise _Refused(_outside(n_steps, step))
                        reduced += n
                        local += n
                    elif ov.kind == COPY:
                        name, lo, hi = ov.dst
                        sname, slo, shi = ov.src
                        if (not 0 <= lo <= hi <= sizes[name] or shi - slo != hi - lo
                                or not 0 <= slo <= shi <= sizes[sname]):
                            raise _Refused(_outside(n_steps, step))
                    else:
                        raise _Refused(
                            f"rank 0's step {n_steps} ({step!r}) overlaps {ov!r}, which is not a Reduce or Copy step")
                if vector:
                    # The peers' posts of the same step; a peer at offset 0 is the rank itself.
                    rdy, lrdy = t, lt
                    for d in peers:
                        if d:
                            rdy = np.maximum(rdy, moved(t, d))
                            lrdy = np.maximum(lrdy, moved(lt, d))
                    end = rdy + c
                    if local:
                        end = np.maximum(end, t + gamma_e * local)
                    t = end
                    lt = lrdy + k
                else:
                    end = t + c
                    if local and t + gamma_e * local > end:
                        end = t + gamma_e * local
                    t = end
                    lt += k
            elif kind == REDUCE:
                name, lo, hi = step.into
                n = hi - lo
                oname, olo, ohi = step.operand
                sname, slo, shi = step.src
                if (not 0 <= lo <= hi <= sizes[name] or ohi - olo != n or not 0 <= olo <= ohi <= sizes[oname]
                        or shi - slo != n or not 0 <= slo <= shi <= sizes[sname]):
                    raise _Refused(_outside(n_steps, step))
                reduced += n
                t = t + gamma_e * n
            elif kind == COPY:
                name, lo, hi = step.dst
                sname, slo, shi = step.src
                if not 0 <= lo <= hi <= sizes[name] or shi - slo != hi - lo or not 0 <= slo <= shi <= sizes[sname]:
                    raise _Refused(_outside(n_steps, step))
            elif kind in ONE_SIDED:
                if vector or arena is None:
                    raise _Refused(f"rank 0's step {n_steps} ({step!r}) works on the node arena, which the "
                                   "symmetric path runs only for a whole schedule, every rank starting at once")
                if kind == PUT or kind == GET:
                    t += beta_e * (step.dst[2] - step.dst[1])
                elif kind == REDUCE_SLOTS:
                    n, k = step.dst[2] - step.dst[1], len(step.operands)
                    t += (arena_gamma * (k - 1) if k > 1 else arena_beta) * arena_itemsize * n  # the engine's
                    reduced += (k - 1) * n
                elif kind == PUBLISH or kind == RELEASE:
                    published.append(FINAL if kind == RELEASE else step.k)
                    pub_times.append((t, lt))
                elif kind == WAIT and step.peers:
                    # Every peer publishes what rank 0 publishes, at the same moment; a value rank 0 has
                    # not published yet, its peers publish only after this same wait: a deadlock.
                    if any(not 0 <= q < p for q in step.peers):
                        raise _Refused(_outside(n_steps, step))
                    j = bisect.bisect_left(published, step.k)
                    if j == len(published):
                        raise _Refused(f"rank 0's step {n_steps} ({step!r}) waits for a counter step it has not "
                                       "published itself, so no rank would (a deadlock, which every rank shows)")
                    pt, plt = pub_times[j]
                    t, lt = (t if t > pt else pt) + alpha, (lt if lt > plt else plt) + 1
                arena_shape.append(_one_sided_shape(step, 0, p))
            else:
                raise _Refused(f"rank 0's step {n_steps} is of a kind the symmetric path does not know ({step!r}); "
                              "the event engine runs every rank and checks it")
            n_steps += 1
    except _Refused:
        raise
    except Exception as exc:  # noqa: BLE001 - anything unusual: the full simulation reports it properly
        raise _Refused(f"rank 0's schedule raised {type(exc).__name__}: {exc}") from None
    return t, lt, msgs, sent, recvd, reduced, n_steps


def _schedule_of(factory, rank: int):
    """``factory(rank)``, or :class:`_Refused` naming the rank whose schedule raised (the full run reports it)."""
    try:
        return factory(rank)
    except Exception as exc:  # noqa: BLE001 - the full simulation reports it properly
        raise _Refused(f"rank {rank}'s schedule raised {type(exc).__name__}: {exc}") from None


def _one_sided_shape(step, r, p, symmetry="rotation") -> tuple:
    """What rank r's one-sided ``step`` costs and waits for, its peers seen from r: equal for alike ranks."""
    kind = step.kind
    if kind == WAIT:
        return kind, step.k, frozenset((q - r) % p if symmetry == "rotation" else q ^ r for q in step.peers)
    if kind == PUBLISH:
        return kind, step.k
    if kind == REDUCE_SLOTS:
        return kind, step.dst[2] - step.dst[1], len(step.operands)
    return kind, step.dst[2] - step.dst[1]


def _check_last_rank(factory, p, symmetry, shape) -> None:
    """Raise :class:`_Refused` unless rank p-1's one-sided steps have rank 0's ``shape``, peers moved.

    A node-arena schedule's steps pair with nothing that rank 0's own steps could check (a
    wait names every peer whatever their lengths), so one more rank is compared: rank p-1,
    which a split into p parts (``partition``) gives the shortest part where rank 0 gets the
    longest, so slices that do not divide evenly show here.
    """
    last = p - 1
    try:
        theirs = [_one_sided_shape(step, last, p, symmetry) for step in factory(last) if step.kind in ONE_SIDED]
    except Exception as exc:  # noqa: BLE001 - the full simulation reports it properly
        raise _Refused(f"rank {last}'s schedule raised {type(exc).__name__}: {exc}") from None
    for i, (mine, its) in enumerate(itertools.zip_longest(shape, theirs)):
        if mine != its:
            raise _Refused(f"rank {last}'s one-sided step {i} is not rank 0's with its peers moved ({symmetry} "
                           f"symmetry): its lengths, counter steps or peers differ, so the ranks are not alike")


def _add_repeatedly(t: float, x: float, n: int) -> float:
    """``t`` after ``n`` times ``t += x`` in floating point, bit for bit, in O(binades crossed) operations.

    Within one binade every sum is rounded to a multiple of the same ulp, and the amount an
    addition adds is the same from one to the next (a tie rounds to an even multiple, so after
    one tie in the binade the rest add the same too): so after three additions in one binade,
    the next ones, while the sums stay clear of its top, add the difference of the last two. Near the top, and in a
    new binade, it adds one by one again. Each step is the loop's own addition or a sum of exact
    multiples of one ulp, so the result is the loop's.
    """
    if not x > 0.0:  # zero, negative or not a number: nothing here to learn from, and rare
        for _ in range(n):
            t += x
        return t
    while n >= 3:
        a = t + x
        b = a + x
        c = b + x
        n -= 3
        d = c - b
        if d == 0.0:  # x is below half an ulp of c: no further addition moves it
            return c
        exponent = math.frexp(a)[1]
        t = c
        if math.frexp(b)[1] != exponent or math.frexp(c)[1] != exponent:
            continue  # a sum left the binade: b, on its ulps, may not have been rounded there
        u = math.ulp(c)
        # Sums from c + k*d up stay at least two ulps below the binade's top: their rounding stays in it.
        k = min(n, max(0, int((math.ldexp(1.0, exponent) - 2 * u - c) // d) - 1))
        t = c + k * d
        n -= k
    for _ in range(n):
        t += x
    return t


def _parts_of(parts, rank: int):
    """``parts(rank)``, a schedule's :class:`~commkit.algorithms.node._Chunks`, or :class:`_Refused` naming the rank."""
    try:
        return parts(rank)
    except Exception as exc:  # noqa: BLE001 - the full simulation reports it properly
        raise _Refused(f"rank {rank}'s schedule raised {type(exc).__name__}: {exc}") from None


def _read_chunks(chunks) -> list:
    """The chunks whose steps the period is read from and checked against: the first two and the last."""
    return sorted({0, min(1, len(chunks) - 1), len(chunks) - 1}) if chunks else []


def _chunk_steps(mine, seen) -> list:
    """A schedule in chunks as steps: its head, the bodies of the chunks ``seen``, its tail."""
    return [*mine.head, *(s for c in seen for s in mine.body(c, *mine.chunks[c])), *mine.tail]


def _period(mine, seen, p):
    """The steps of one chunk as runs the simulator evaluates for every chunk, or raise :class:`_Refused`.

    Every chunk's steps must be the first's, each length either the chunk's own (``hi - lo``)
    in every chunk read or the same in all, each counter step moved by one amount a chunk, and
    each wait for the same peers; consecutive copies (or folds) of one length make one run.
    Returns ``(runs, steps in a chunk)``; a run is ``("copy", own, n, times)``,
    ``("fold", own, n, k, times)`` (``own``: n is the chunk's own length), ``("publish", k)``
    or ``("wait", k)`` (k in the first chunk), the counter step's move a chunk appended.
    """
    bodies = {c: list(mine.body(c, *mine.chunks[c])) for c in seen}
    lengths = {c: mine.chunks[c][1] - mine.chunks[c][0] for c in seen}
    first = bodies[0]
    if any(len(body) != len(first) for body in bodies.values()):
        raise _Refused("its chunks take different numbers of steps, so they have no period")
    counters = [i for i, step in enumerate(first) if step.kind in (PUBLISH, WAIT)]
    move = bodies[1][counters[0]].k - first[counters[0]].k if counters and 1 in bodies else 0
    runs: list = []
    for i, step in enumerate(first):
        kind = step.kind
        others = [(c, bodies[c][i]) for c in seen if c]
        if any(other.kind != kind for _, other in others):
            raise _Refused(f"step {i} of its chunks is not of one kind in every chunk, so they have no period")
        if kind in (PUT, GET, REDUCE_SLOTS):
            n = step.dst[2] - step.dst[1]
            k = len(step.operands) if kind == REDUCE_SLOTS else 0
            sizes = [(c, other.dst[2] - other.dst[1], len(other.operands) if kind == REDUCE_SLOTS else 0)
                     for c, other in others]
            if any(ko != k for _, _, ko in sizes):
                raise _Refused(f"step {i} of its chunks folds different numbers of slots from chunk to chunk")
            if all(no == n for _, no, _ in sizes):
                own = False
            elif n == lengths[0] and all(no == lengths[c] for c, no, _ in sizes):
                own, n = True, 0
            else:
                raise _Refused(f"step {i} of its chunks has a length that is neither its chunk's own nor the same "
                               "in every chunk, so they have no period")
            tag = "copy" if kind != REDUCE_SLOTS else "fold"
            if runs and runs[-1][0] == tag and runs[-1][1:-1] == ((own, n) if tag == "copy" else (own, n, k)):
                runs[-1] = (*runs[-1][:-1], runs[-1][-1] + 1)
            else:
                runs.append((tag, own, n, 1) if tag == "copy" else (tag, own, n, k, 1))
        elif kind in (PUBLISH, WAIT):
            if any(other.k != step.k + c * move for c, other in others):
                raise _Refused(f"step {i} of its chunks does not move its counter step by {move} a chunk, so "
                               "they have no period")
            if kind == WAIT:
                if any(set(other.peers) != set(step.peers) for _, other in others):
                    raise _Refused(f"step {i} of its chunks waits for other ranks in other chunks")
                if step.peers:
                    if any(not 0 <= q < p for q in step.peers):
                        raise _Refused(_outside(i, step))
                    runs.append(("wait", step.k, move))
            else:
                runs.append(("publish", step.k, move))
        else:
            raise _Refused(f"step {i} of its chunks ({step!r}) is not a copy into or out of the arena, a fold, a "
                           "publication or a wait, which is all a chunk's period holds")
    return runs, len(first)


def _symmetric_chunks(parts, p, symmetry, sizes, alpha, beta_e, gamma_e, arena):
    """Run rank 0's schedule in chunks (``parts``) for every rank, its chunks by their period, or :class:`_Refused`.

    The head and tail run as :func:`_symmetric_steps` runs them. Each chunk is the first one's
    steps with its own lengths and counter steps (:func:`_period`, checked against the second
    chunk's and the last's), evaluated as the symmetric path would evaluate its steps, one run
    of equal copies at a time (:func:`_add_repeatedly`: the same sums, bit for bit). Rank p-1's
    head, read chunks and tail are compared with rank 0's (:func:`_check_last_rank`).

    Returns:
        as :func:`_symmetric_steps`, the steps of every chunk counted, and the steps read.
    """
    arena_beta, arena_gamma, arena_itemsize, _, published, pub_times = arena
    mine = _parts_of(parts, 0)
    seen = _read_chunks(mine.chunks)
    t, lt, msgs, sent, recvd, reduced, n_head = _symmetric_steps(mine.head, p, symmetry, sizes, alpha, beta_e,
                                                                 gamma_e, 0.0, 0, arena)
    runs, per_chunk = _period(mine, seen, p) if seen else ([], 0)
    for c, (lo, hi) in enumerate(mine.chunks):
        m = hi - lo
        for run in runs:
            tag = run[0]
            if tag == "copy":
                _, own, n, times = run
                t = _add_repeatedly(t, beta_e * (m if own else n), times)
            elif tag == "fold":
                _, own, n, k, times = run
                n = m if own else n
                t = _add_repeatedly(t, (arena_gamma * (k - 1) if k > 1 else arena_beta) * arena_itemsize * n, times)
                reduced += (k - 1) * n * times
            elif tag == "publish":
                published.append(run[1] + c * run[2])
                pub_times.append((t, lt))
            else:
                k = run[1] + c * run[2]
                j = bisect.bisect_left(published, k)
                if j == len(published):
                    raise _Refused(f"chunk {c} waits for a counter step ({k}) rank 0 has not published itself, so "
                                   "no rank would (a deadlock, which every rank shows)")
                pt, plt = pub_times[j]
                t, lt = (t if t > pt else pt) + alpha, (lt if lt > plt else plt) + 1
    t, lt, m_tail, s_tail, r_tail, d_tail, n_tail = _symmetric_steps(mine.tail, p, symmetry, sizes, alpha, beta_e,
                                                                     gamma_e, t, lt, arena)
    shape = [_one_sided_shape(step, 0, p, symmetry) for step in _chunk_steps(mine, seen) if step.kind in ONE_SIDED]
    last = _parts_of(parts, p - 1)
    if last.chunks != mine.chunks:
        raise _Refused(f"rank {p - 1}'s chunks are not rank 0's, so the ranks are not alike")
    _check_last_rank(lambda r: _chunk_steps(last, seen), p, symmetry, shape)
    steps = n_head + per_chunk * len(mine.chunks) + n_tail
    return (t, lt, msgs + m_tail, sent + s_tail, recvd + r_tail, reduced + d_tail, steps,
            n_head + per_chunk * len(seen) + n_tail)


def _simulate_symmetric(factory, p, symmetry, sizes, itemsize, alpha, beta, gamma, collective, algorithm,
                        parts=None):
    """Run rank 0 alone for a schedule whose ranks are all alike, or raise :class:`_Refused` saying why not.

    Every rank takes step i at the same moment, so a transfer finishes at its start plus its cost
    (:func:`_symmetric_steps` with one start time for all). So does a node-arena step: every
    peer publishes a counter step when rank 0 does, so a wait for it ends alpha after the later
    of its start and rank 0's own publication (rank p-1's one-sided steps are checked alike).
    A schedule in chunks (``parts``: each rank's :class:`~commkit.algorithms.node._Chunks`)
    runs its chunks by their period (:func:`_symmetric_chunks`).
    """
    alpha, beta, gamma = cost.checked_constants(alpha, beta, gamma)
    started = time.perf_counter()
    shape: list = []
    arena = (beta, gamma, itemsize, shape, [], [])
    if parts is not None:
        try:
            t, lt, msgs, sent, recvd, reduced, steps, run = _symmetric_chunks(
                parts, p, symmetry, sizes, alpha, beta * itemsize, gamma * itemsize, arena)
        except _Refused:
            raise
        except Exception as exc:  # noqa: BLE001 - a chunk's steps raised: the full simulation reports it properly
            raise _Refused(f"its chunks raised {type(exc).__name__}: {exc}") from None
    else:
        rank0 = _schedule_of(factory, 0)
        t, lt, msgs, sent, recvd, reduced, steps = _symmetric_steps(rank0, p, symmetry, sizes, alpha,
                                                                    beta * itemsize, gamma * itemsize, 0.0, 0,
                                                                    arena=arena)
        if shape:
            _check_last_rank(factory, p, symmetry, shape)
        run = steps
    return SimResult(
        collective=collective, algorithm=algorithm, p=p, count=None, nbytes=0, itemsize=itemsize,
        alpha=alpha, beta=beta, gamma=gamma, messages=[msgs] * p, bytes_sent=[sent * itemsize] * p,
        bytes_received=[recvd * itemsize] * p, bytes_reduced=[reduced * itemsize] * p, finish=[t] * p,
        time=t, rounds=lt, steps=steps * p, wall=time.perf_counter() - started, ranks_simulated=1, steps_run=run,
    )


def _alike_key(alg):
    """The algorithm's declaration of which ranks take alike steps (``schedule.alike``), or None.

    None too where the algorithm declares a symmetry or phases, which stand in with fewer ranks.
    """
    if alg.symmetry is not None or alg.phases is not None:
        return None
    return getattr(alg.schedule, "alike", None)


def _alike_classes(alg, collective, p, count, root):
    """The classes of alike ranks the algorithm declares: ``(class of each rank, first rank of each, another
    rank of each or None, ranks in each)``, in order of their first rank."""
    key = _alike_key(alg)
    index: dict = {}
    cls, first, other, members = [0] * p, [], [], []
    for r in range(p):
        c = index.setdefault(collectives.steps(key, collective, r, p, count, None, root), len(first))
        cls[r] = c
        if c == len(first):
            first.append(r)
            other.append(None)
            members.append(1)
        else:
            other[c] = r  # the last rank of the class: the one compared with its first
            members[c] += 1
    return cls, first, other, members


def _alike_shape(step, cls) -> tuple:
    """What a step costs and waits for, the ranks it waits for as their classes: equal for alike ranks."""
    kind = step.kind
    if kind == WAIT:
        return kind, step.k, frozenset(cls[q] for q in step.peers)
    if kind == PUBLISH:
        return kind, step.k
    if kind == REDUCE_SLOTS:
        return kind, step.dst[2] - step.dst[1], len(step.operands)
    if kind in (PUT, GET, COPY):
        return kind, step.dst[2] - step.dst[1]
    return (kind,)


def _simulate_alike(factory, p, classes, sizes, itemsize, alpha, beta, gamma, collective, algorithm):
    """Run one rank of each class of alike ranks for all of them, or raise :class:`_Refused` saying why not.

    ``classes`` as :func:`_alike_classes` gives them; ``sizes``: the buffer sizes of each class's
    first rank. Ranks of one class take the same steps, so they take each at the same moment:
    the first rank of each class runs for its class, its clock the engine's own arithmetic on
    the same numbers (so the times are bit for bit the engine's). A wait ends alpha after the
    later of its start and the publications of the classes its peers are in; a class whose
    first rank has not published that counter step yet holds the wait until it does, and a
    wait that no class can end any more is a deadlock, which every rank run then reports.
    The last rank of each class is compared with its first, step by step (lengths, counter
    steps, the classes it waits for): what the declaration promises of every rank.
    """
    cls, first, other, members = classes
    alpha, beta, gamma = cost.checked_constants(alpha, beta, gamma)
    beta_e = beta * itemsize
    started = time.perf_counter()
    n = len(first)
    gens = [iter(_schedule_of(factory, r)) for r in first]
    witnesses = [None if w is None else iter(_schedule_of(factory, w)) for w in other]
    t, lt, steps, reduced = [0.0] * n, [0] * n, [0] * n, [0] * n
    held: list = [None] * n  # a class's wait that could not end yet: (step, the classes it waits for)
    published = [([], [], []) for _ in range(n)]  # per class: counter steps, and when (t, lt) it published each
    done = [False] * n

    def compare(c, step):
        w = witnesses[c]
        if w is None:
            return
        theirs = next(w, None)
        if theirs is None or _alike_shape(theirs, cls) != _alike_shape(step, cls):
            raise _Refused(f"rank {other[c]}'s step {steps[c]} ({theirs!r}) is not rank {first[c]}'s ({step!r}) "
                           f"though the algorithm declares them alike: its lengths, counter steps or the classes "
                           f"it waits for differ")

    def wait(c, step, named):
        """End class c's wait for ``named`` classes' counter step ``step.k``: True, or False while one has not."""
        rdy, lrdy = t[c], lt[c]
        for d in named:
            values, times, rounds = published[d]
            j = bisect.bisect_left(values, step.k)
            if j == len(values):
                if d == c or done[d]:
                    raise _Refused(f"rank {first[c]}'s step {steps[c]} ({step!r}) waits for a counter step that "
                                   f"the ranks it waits for never publish first (a deadlock, which every rank shows)")
                return False
            if times[j] > rdy:
                rdy = times[j]
            if rounds[j] > lrdy:
                lrdy = rounds[j]
        t[c], lt[c] = rdy + alpha, lrdy + 1
        return True

    def advance(c) -> bool:
        """Run class c until it waits for a class that has not published yet or ends; whether it took a step."""
        moved = False
        if held[c] is not None:
            if not wait(c, *held[c]):
                return False
            held[c] = None
            steps[c] += 1
            moved = True
        for step in gens[c]:
            compare(c, step)
            kind = step.kind
            if kind == PUT or kind == GET:
                t[c] += beta_e * (step.dst[2] - step.dst[1])
            elif kind == REDUCE_SLOTS:
                m, k = step.dst[2] - step.dst[1], len(step.operands)
                t[c] += (gamma * (k - 1) if k > 1 else beta) * itemsize * m  # the engine's own products
                reduced[c] += (k - 1) * m
            elif kind == PUBLISH or kind == RELEASE:
                values, times, rounds = published[c]
                values.append(FINAL if kind == RELEASE else step.k)
                times.append(t[c])
                rounds.append(lt[c])
            elif kind == WAIT and step.peers:
                if min(step.peers) < 0 or max(step.peers) >= p:
                    raise _Refused(_outside(steps[c], step))
                named = {cls[q] for q in step.peers}
                if not wait(c, step, named):
                    held[c] = (step, named)
                    return moved
            elif kind == COPY:
                name, lo, hi = step.dst
                sname, slo, shi = step.src
                if (not 0 <= lo <= hi <= sizes[c][name] or shi - slo != hi - lo
                        or not 0 <= slo <= shi <= sizes[c][sname]):
                    raise _Refused(_outside(steps[c], step))
            elif kind != CLAIM and kind != WAIT:
                raise _Refused(f"rank {first[c]}'s step {steps[c]} ({step!r}) is not a node-arena step or a Copy, "
                               "which is all the classes of alike ranks run")
            steps[c] += 1
            moved = True
        if witnesses[c] is not None and next(witnesses[c], None) is not None:
            raise _Refused(f"rank {other[c]} takes more steps than rank {first[c]}, which the algorithm declares "
                           "alike")
        done[c] = True
        return True

    try:
        while not all(done):
            if not any([advance(c) for c in range(n) if not done[c]]):
                raise _Refused("every class of alike ranks waits for a counter step no class publishes "
                               "(a deadlock, which every rank shows)")
    except _Refused:
        raise
    except Exception as exc:  # noqa: BLE001 - anything unusual: the full simulation reports it properly
        raise _Refused(f"a schedule raised {type(exc).__name__}: {exc}") from None
    finish = [t[c] for c in cls]
    return SimResult(
        collective=collective, algorithm=algorithm, p=p, count=None, nbytes=0, itemsize=itemsize,
        alpha=alpha, beta=beta, gamma=gamma, messages=[0] * p, bytes_sent=[0] * p, bytes_received=[0] * p,
        bytes_reduced=[reduced[c] * itemsize for c in cls], finish=finish, time=max(finish), rounds=max(lt),
        steps=sum(s * m for s, m in zip(steps, members)), wall=time.perf_counter() - started, ranks_simulated=n,
        steps_run=sum(steps),
    )


def _block_lengths(collective, p, count):
    """The vector of p blocks the algorithms cut for this call, as lengths; None where there is none (alltoallv)."""
    if collective == "alltoallv":
        return None
    if collective in _PER_RANK:
        return tuple(count)
    return tuple(hi - lo for lo, hi in partition(count, p))


class _TurningBlocks:
    """How long each of rank 0's ranges is on every rank, when the blocks are unequal and turn with the rank.

    A rotation-symmetric algorithm on unequal blocks (a ring over ``partition(count, p)``, or over
    per-rank counts) makes rank r do what rank 0 does with every peer shifted by r and every block b
    replaced by block (b + r) mod p: the same steps, whose ranges differ in length. So each range of
    rank 0's gets a *label*: block j >= 0, ``lengths[(j + r) % p]`` elements on rank r; or -(n + 1),
    n elements on every rank. Where a range lies tells its label: in a buffer that holds the whole
    vector on every rank, a block's extent is that block and the whole buffer is fixed; in one that
    holds a rank's own block, all of it is block 0 (its own); in a buffer of one size everywhere
    (scratch), the label of what rank 0 last wrote there (a receive takes the label of the matching
    send, shifted to the sender), or the whole buffer. A range that none of these names (part of a
    block, several blocks, an empty block) has no label, and the caller refuses the step.
    """

    WHOLE, OWN, SAME = "the whole vector", "the rank's own block", "one size on every rank"

    def __init__(self, lengths, sizes, p):
        assert min(lengths) > 0, "_why_every_rank refuses empty blocks"
        self.p = p
        self.lengths = lengths
        self.longest = max(lengths)
        elems = np.array(lengths, dtype=np.int64)
        self.cyc = np.concatenate((elems, elems, elems))  # cyc[j + r] = lengths[(j + r) % p] for j + r < 3p
        offsets = (0, *itertools.accumulate(lengths))
        self.total = offsets[-1]
        self.block = {(offsets[j], offsets[j + 1]): j for j in range(p)}
        self.kind, self.size = {}, {}
        for name, first in sizes[0].items():
            values = [s[name] for s in sizes]
            if all(v == self.total for v in values):
                self.kind[name] = self.WHOLE
            elif values == list(lengths):
                self.kind[name] = self.OWN
            elif all(v == first for v in values):
                self.kind[name] = self.SAME
            self.size[name] = first  # a buffer of any other sizes has no kind: no range in it has a label
        self.written: dict = {}  # per SAME buffer: (lo, hi) -> the label rank 0 last wrote there

    def witness(self):
        """A rank whose own block is not as long as rank 0's (None if all are): see :func:`_witness`."""
        return next((r for r, n in enumerate(self.lengths) if n != self.lengths[0]), None)

    def length(self, label) -> int:
        """Rank 0's length of a range with this label."""
        return self.lengths[label] if label >= 0 else -label - 1

    def longest_of(self, label) -> int:
        return self.longest if label >= 0 else -label - 1

    def shifted(self, label, d):
        """The label of the same range on rank d (as rank 0 would name it)."""
        return (label + d) % self.p if label >= 0 else label

    def read(self, name, lo, hi):
        """The label of rank 0's range (name, lo, hi), or None."""
        kind = self.kind.get(name)
        if kind is self.WHOLE:
            j = self.block.get((lo, hi))
            if j is not None:
                return j
        elif kind is self.OWN:
            return 0 if lo == 0 and hi == self.lengths[0] else None
        elif kind is self.SAME:
            label = self.written.get(name, {}).get((lo, hi))
            if label is not None:
                return label
        else:
            return None
        return -hi - 1 if lo == 0 and hi == self.size[name] else None

    def write(self, name, lo, hi, label) -> bool:
        """Record that rank 0 writes what ``label`` names into (name, lo, hi); False if that cannot be so."""
        if self.kind.get(name) is not self.SAME:
            return self.read(name, lo, hi) == label
        if lo < 0 or hi - lo != self.length(label) or lo + self.longest_of(label) > self.size[name]:
            return False
        table = self.written.setdefault(name, {})
        # On some rank the range is as long as the label's longest block: drop what that may overwrite.
        end = lo + self.longest_of(label)
        for key in [key for key, old in table.items() if key[0] < end and lo < key[0] + self.longest_of(old)]:
            del table[key]
        table[(lo, hi)] = label
        return True

    def elements(self, labels):
        """Elements of all ``labels`` together, on rank x of the relative frame, for x in [0, 2p): an array or an int."""
        fixed = sum(-label - 1 for label in labels if label < 0)
        blocks = [label for label in labels if label >= 0]
        if not blocks:
            return fixed
        p = self.p
        total = np.full(2 * p, fixed, dtype=np.int64)
        if len(blocks) <= 8:
            for j in blocks:
                total += self.cyc[j:j + 2 * p]
            return total
        # Many blocks (a naive algorithm's p - 1 messages): runs of consecutive labels, by prefix sums.
        prefix = np.concatenate(([0], np.cumsum(self.cyc)))
        counts = np.bincount(blocks, minlength=p)
        for times in set(counts.tolist()) - {0}:
            js = np.flatnonzero(counts == times)
            breaks = np.flatnonzero(np.diff(js) != 1)
            for a, b in zip(js[np.concatenate(([0], breaks + 1))], js[np.concatenate((breaks, [len(js) - 1]))]):
                total += times * (prefix[b + 1:b + 1 + 2 * p] - prefix[a:a + 2 * p])
        return total

    def per_rank(self, counts, fixed):
        """``fixed + sum(counts[j] * lengths[(j + r) % p] for j)`` for every rank r, as an int64 array."""
        p = self.p
        ranks = np.arange(p)
        window = np.concatenate(([0], np.cumsum(np.concatenate((counts, counts)))))
        out = np.full(p, fixed, dtype=np.int64)
        elems = self.cyc[:p]
        edges = np.flatnonzero(np.diff(elems)) + 1
        for a, b in zip(np.concatenate(([0], edges)), np.concatenate((edges, [p]))):
            start = (a - ranks) % p  # rank r's block i holds block (i - r) of rank 0's count
            out += int(elems[a]) * (window[start + (b - a)] - window[start])
        return out


def _latest(t, peers, p):
    """A new array: for every rank r, the latest of ``t[r]`` and ``t[(r + d) % p]`` for each offset d in ``peers``."""
    if len(peers) == p - 1:  # every other rank: the latest of all
        return np.full(p, t.max())
    end, mine = np.empty_like(t), t
    for d in peers:  # rank r's peer at offset d is r + d, less p past the end: two slices, no copy of t
        np.maximum(mine[:p - d], t[d:], out=end[:p - d])
        np.maximum(mine[p - d:], t[:d], out=end[p - d:])
        mine = end
    return end


def _turning_transfer(i, step, p, blocks):
    """The labels of a transfer's sends and receives, and its peers' offsets, or raise :class:`_Refused`.

    Each receive of rank 0's from offset s is matched, in order, by a send of rank 0's to offset -s,
    which rank s makes as its own block: the receive's label is that send's shifted to rank s.
    """
    posted: dict = {}
    out_labels = []
    for peer, rng in step.sends:
        label = blocks.read(*rng) if 0 <= peer < p else None
        if label is None:
            raise _Refused(_unlabelled(i, step))
        posted.setdefault(peer, []).append(label)
        out_labels.append(label)
    in_labels = []
    taken: dict = {}
    for peer, (name, lo, hi) in step.recvs:
        mate = (p - peer) % p
        queue, k = posted.get(mate, ()), taken.get(mate, 0)
        if not 0 <= peer < p or k >= len(queue):
            raise _Refused(_unsymmetric(i, step, "rotation"))
        taken[mate] = k + 1
        label = blocks.shifted(queue[k], peer)
        if blocks.length(label) != hi - lo or not blocks.write(name, lo, hi, label):
            raise _Refused(_unsymmetric(i, step, "rotation"))
        in_labels.append(label)
    if any(taken.get(peer, 0) != len(queue) for peer, queue in posted.items()):
        raise _Refused(_unsymmetric(i, step, "rotation"))
    peers = ({peer for peer, _ in step.sends} | {peer for peer, _ in step.recvs}) - {0}
    return tuple(out_labels), tuple(in_labels), peers


def _witness(i, witness, kind, foretold, p, blocks):
    """Check the witness rank's next step against what rank 0's step ``i`` and its labels foretell, or refuse.

    ``foretold``: for a transfer, its sends and receives as (offset, label) lists; for a Reduce or a
    Copy, the label of what it writes.
    """
    w, steps = witness
    step = next(steps, None)

    def on_w(label):
        return blocks.lengths[(label + w) % p] if label >= 0 else -label - 1

    if step is None or step.kind != kind:
        same = False
    elif kind == TRANSFER:
        sends, recvs = foretold
        same = ([(peer, hi - lo) for peer, (_, lo, hi) in step.sends]
                == [((peer + w) % p, on_w(label)) for peer, label in sends]
                and [(peer, hi - lo) for peer, (_, lo, hi) in step.recvs]
                == [((peer + w) % p, on_w(label)) for peer, label in recvs])
    else:
        _, lo, hi = step.into if kind == REDUCE else step.dst
        same = hi - lo == on_w(foretold)
    if not same:
        raise _Refused(f"rank {w}'s step {i} ({step!r}) is not rank 0's with every peer shifted by {w} and every "
                       f"block read {w} blocks on: its blocks do not turn with the rank")


def _unlabelled(i, step) -> str:
    return (f"rank 0's step {i} ({step!r}) names a range that is not a whole block, a rank's own block or a "
            f"whole buffer, so its length on the other ranks is unknown (blocks unequal)")


def _turning_steps(steps, p, blocks, alpha, beta_e, gamma_e, t, lt, witness=None):
    """Run rank 0's ``steps`` of a rotation-symmetric schedule on unequal blocks for every rank, or raise :class:`_Refused`.

    As :func:`_symmetric_steps` with NumPy arrays over ranks, where the ranks' message lengths
    differ too: rank r's step i is rank 0's with every peer shifted by r and every block b read
    as block (b + r) mod p (``blocks``, a :class:`_TurningBlocks`, labels rank 0's ranges). The
    check is the symmetric one, per length: each receive of rank 0's from offset s is matched, in
    order, by a send to offset -s, and is as long as that send is on rank s. A transfer's cost on
    rank r is the engine's ``k*alpha + beta*max(sent, received)`` of rank r's lengths, and it
    finishes at the latest of its post and its peers' posts plus that: the engine's operations on
    the same numbers, so the times are bit for bit the engine's. One step costs a few operations
    on arrays of p entries; the costs of a transfer are computed once per pattern of labels
    relative to its first block, and sliced for each step that repeats the pattern (a ring's).

    What rank 0 alone cannot show, another rank can: ``witness`` is ``(w, w's steps)``, a rank
    whose own block differs in length from rank 0's, and each of its steps must be the one the
    labels foretell (peers shifted by w, every length the label's on rank w). An algorithm that
    is rotation-symmetric for equal blocks only (one that always sends block 0, say) fails there.

    Returns:
        ``(t, lt, messages, sent, received, reduced, steps)``: times as :func:`_symmetric_steps`
        gives them (a float and an int while all ranks keep one time), messages (the same for
        every rank), and int64 arrays of each rank's elements sent, received and reduced.
    """
    vector = isinstance(t, np.ndarray)
    lvector = isinstance(lt, np.ndarray)
    gammas = gamma_e * blocks.cyc
    costs: dict = {}
    read, write, length = blocks.read, blocks.write, blocks.length
    counted = {"sent": [0] * p, "recvd": [0] * p, "reduced": [0] * p}
    fixed = {"sent": 0, "recvd": 0, "reduced": 0}

    def count(what, label):
        if label >= 0:
            counted[what][label] += 1
        else:
            fixed[what] += -label - 1

    def reduce_label(i, step):
        labels = {read(*step.into), read(*step.operand), read(*step.src)}
        if len(labels) != 1 or None in labels:
            raise _Refused(_unlabelled(i, step))
        label = labels.pop()
        write(*step.into, label)
        return label

    def copy(i, step):
        label = read(*step.src)
        if label is None or not write(*step.dst, label):
            raise _Refused(_unlabelled(i, step))

    if isinstance(t, np.ndarray):
        t = t.copy()  # updated in place from here on
    if isinstance(lt, np.ndarray):
        lt = lt.copy()
    exchange = Exchange
    msgs = n_steps = 0
    try:
        for step in steps:
            kind = step.kind
            if kind == TRANSFER:
                if type(step) is exchange:  # one send and one receive (a ring's every step): unrolled
                    dest, name, lo, hi, source, rname, rlo, rhi = step.pair
                    label = read(name, lo, hi) if 0 <= dest < p else None
                    if label is None:
                        raise _Refused(_unlabelled(n_steps, step))
                    if source != (p - dest) % p:
                        raise _Refused(_unsymmetric(n_steps, step, "rotation"))
                    rlabel = blocks.shifted(label, source)
                    if length(rlabel) != rhi - rlo or not write(rname, rlo, rhi, rlabel):
                        raise _Refused(_unsymmetric(n_steps, step, "rotation"))
                    out_labels, in_labels = (label,), (rlabel,)
                    k = ns = 1
                    peers = (dest, source) if dest != source else (dest,)
                    if not dest:
                        peers = ()
                else:
                    out_labels, in_labels, peers = _turning_transfer(n_steps, step, p, blocks)
                    ns, nr = len(step.sends), len(step.recvs)
                    k = ns if ns > nr else nr
                if witness is not None:
                    foretold = [(peer, label) for (peer, _), label in zip(step.sends, out_labels)], [
                        (peer, label) for (peer, _), label in zip(step.recvs, in_labels)]
                    _witness(n_steps, witness, TRANSFER, foretold, p, blocks)
                msgs += ns
                for label in out_labels:
                    count("sent", label)
                for label in in_labels:
                    count("recvd", label)
                first = next((label for label in out_labels + in_labels if label >= 0), None)
                if first is None:  # every length fixed: one cost for all ranks, as the engine computes it
                    out_e, in_e = blocks.elements(out_labels), blocks.elements(in_labels)
                    c = k * alpha + beta_e * (out_e if out_e > in_e else in_e)
                else:
                    key = (k, tuple(label if label < 0 else (label - first) % p for label in out_labels),
                           tuple(label if label < 0 else (label - first) % p for label in in_labels))
                    pattern = costs.get(key)
                    if pattern is None:
                        pattern = costs[key] = k * alpha + beta_e * np.maximum(blocks.elements(key[1]),
                                                                               blocks.elements(key[2]))
                    c = pattern[first:first + p]
                local = []
                for ov in step.overlap if type(step) is exchange else getattr(step, "overlap", None) or ():
                    if ov.kind == REDUCE:
                        local.append(reduce_label(n_steps, ov))
                        count("reduced", local[-1])
                    elif ov.kind == COPY:
                        copy(n_steps, ov)
                    else:
                        raise _Refused(
                            f"rank 0's step {n_steps} ({step!r}) overlaps {ov!r}, which is not a Reduce or Copy step")
                if vector and peers:
                    end = _latest(t, peers, p)
                    end += c
                else:
                    end = t + c
                if local:  # the overlapped reductions run from the post; the step ends when both have
                    n = blocks.elements(local)
                    local_end = t + gamma_e * (n[:p] if isinstance(n, np.ndarray) else n)
                    end = (np.maximum(end, local_end) if isinstance(end, np.ndarray) or isinstance(local_end, np.ndarray)
                           else max(end, local_end))
                t = end
                vector = isinstance(t, np.ndarray)
                if lvector and peers:
                    lt = _latest(lt, peers, p)
                    lt += k
                else:
                    lt = lt + k
            elif kind == REDUCE:
                label = reduce_label(n_steps, step)
                if witness is not None:
                    _witness(n_steps, witness, REDUCE, label, p, blocks)
                count("reduced", label)
                if vector:
                    t += gammas[label:label + p] if label >= 0 else gamma_e * (-label - 1)
                else:
                    t = t + (gammas[label:label + p] if label >= 0 else gamma_e * (-label - 1))
                    vector = isinstance(t, np.ndarray)
            elif kind == COPY:
                copy(n_steps, step)
                if witness is not None:
                    _witness(n_steps, witness, COPY, read(*step.dst), p, blocks)
            else:
                raise _Refused(f"rank 0's step {n_steps} is of a kind the symmetric path does not know ({step!r}); "
                               "the event engine runs every rank and checks it")
            n_steps += 1
        if witness is not None and next(witness[1], None) is not None:
            raise _Refused(f"rank {witness[0]} takes more steps than rank 0 ({n_steps})")
    except _Refused:
        raise
    except Exception as exc:  # noqa: BLE001 - anything unusual: the full simulation reports it properly
        raise _Refused(f"rank 0's schedule raised {type(exc).__name__}: {exc}") from None
    sent, recvd, reduced = (blocks.per_rank(counted[what], fixed[what]) for what in ("sent", "recvd", "reduced"))
    return t, lt, msgs, sent, recvd, reduced, n_steps


def _simulate_turning(factory, p, blocks, itemsize, alpha, beta, gamma, collective, algorithm):
    """Run rank 0 alone for a rotation-symmetric schedule on unequal blocks, or raise :class:`_Refused` saying why not.

    Every rank starts at 0; :func:`_turning_steps` computes each of rank 0's steps for all ranks.
    """
    alpha, beta, gamma = cost.checked_constants(alpha, beta, gamma)
    started = time.perf_counter()
    rank0 = _schedule_of(factory, 0)
    w = blocks.witness()
    witness = None if w is None else (w, iter(_schedule_of(factory, w)))
    t, lt, msgs, sent, recvd, reduced, steps = _turning_steps(rank0, p, blocks, alpha, beta * itemsize,
                                                             gamma * itemsize, 0.0, 0, witness)
    finish = t.tolist() if isinstance(t, np.ndarray) else [t] * p
    return SimResult(
        collective=collective, algorithm=algorithm, p=p, count=None, nbytes=0, itemsize=itemsize,
        alpha=alpha, beta=beta, gamma=gamma, messages=[msgs] * p, bytes_sent=(sent * itemsize).tolist(),
        bytes_received=(recvd * itemsize).tolist(), bytes_reduced=(reduced * itemsize).tolist(), finish=finish,
        time=max(finish), rounds=int(lt.max()) if isinstance(lt, np.ndarray) else lt, steps=steps * p,
        wall=time.perf_counter() - started, ranks_simulated=1, steps_run=steps,
    )


def _simulate_phased(alg, collective, p, count, root, op, itemsize, alpha, beta, gamma, algorithm):
    """Simulate a :func:`~commkit.algorithms.phased` schedule phase by phase, or raise :class:`_Refused`.

    A phase that declares a symmetry usable for this call (``"rotation"``; ``"xor"`` when
    :func:`~commkit.algorithms.even_blocks` holds and p is a power of two) runs once, from rank
    0's steps, for all ranks at once (:func:`_symmetric_steps`, or :func:`_turning_steps` where
    the blocks are unequal, from each rank's own start time); any other phase runs rank by rank
    in the event engine, each rank starting when its previous phase ended.

    Why that is the whole simulation's result. Messages between two ranks match in posting
    order, and each rank posts a phase's operations after those of the phases before. So if
    every phase, run on its own, matches all of its operations (checked: the engine must
    finish every rank, the symmetric check balances every step), the k-th message of a
    channel and its k-th receive belong to the same phase, and a phase's times depend only
    on when each rank started it. Anything else (a deadlock, a length mismatch, a bad range,
    a step that is not symmetric) raises :class:`_Refused`, and the full simulation runs and
    reports it; ``tests/test_sim.py`` compares the two for p = 1 ... 64. The caller has
    checked that no block is empty where they are unequal (:func:`_why_every_rank`).

    Returns:
        a :class:`SimResult` (``count`` and ``nbytes`` left for the caller).
    """

    even = algorithms.even_blocks(collective, p, count)

    def usable(symmetry):
        return symmetry == "rotation" or (symmetry == "xor" and algorithms.is_pow2(p) and even)

    alpha, beta, gamma = cost.checked_constants(alpha, beta, gamma)
    started = time.perf_counter()
    try:
        split = alg.phases
        phases = [tuple(collectives.steps(split, collective, r, p, count, op, root)) for r in range(p)]
    except Exception as exc:  # noqa: BLE001 - the full simulation reports it properly
        raise _Refused(f"its phases raised {type(exc).__name__}: {exc}") from None
    # Every rank must return the same phases, by their declared symmetries, as rank 0.
    shape = [getattr(phase, "symmetry", False) for phase in phases[0]]
    if not any(usable(s) for s in shape):
        unequal = "" if even else f" with unequal blocks ({_unequal(count, p)})"
        raise _Refused(f"none of its phases declares a symmetry usable on {p} ranks{unequal} (declared: {shape})")
    for r, mine in enumerate(phases):
        if len(mine) != len(shape) or any(not isinstance(ph, algorithms.Phase) or ph.symmetry != s
                                          for ph, s in zip(mine, shape)):
            raise _Refused(f"rank {r} returns other phases than rank 0 (by their symmetries)")
    sizes = [_buffer_sizes(collective, alg, r, p, count, root) for r in range(p)]
    blocks = None if even else _TurningBlocks(_block_lengths(collective, p, count), sizes, p)
    clock, lat = [0.0] * p, [0] * p
    msgs, sent, recvd, reduced = [0] * p, [0] * p, [0] * p, [0] * p
    steps = run = 0
    for k, symmetry in enumerate(shape):
        if usable(symmetry):
            together = min(clock) == max(clock) and min(lat) == max(lat)
            t, lt = (clock[0], lat[0]) if together else (np.array(clock), np.array(lat, dtype=np.int64))
            try:
                if even:
                    out = _symmetric_steps(phases[0][k].steps, p, symmetry, sizes[0], alpha, beta * itemsize,
                                           gamma * itemsize, t, lt)
                else:
                    w = blocks.witness()
                    out = _turning_steps(phases[0][k].steps, p, blocks, alpha, beta * itemsize, gamma * itemsize,
                                         t, lt, None if w is None else (w, iter(phases[w][k].steps)))
            except _Refused as why:
                raise _Refused(f"in phase {k}, {why}") from None
            t, lt, m, s, rv, rd, n = out
            clock = t.tolist() if isinstance(t, np.ndarray) else [t] * p
            lat = lt.tolist() if isinstance(lt, np.ndarray) else [lt] * p
            counts = [m] * p, *(x.tolist() if isinstance(x, np.ndarray) else [x] * p for x in (s, rv, rd))
            steps += n * p
            run += n
        else:
            engine = _Engine(lambda r, k=k: phases[r][k].steps, p, itemsize, alpha, beta, gamma, False, sizes,
                             collective, algorithm, start=(clock, lat))
            try:
                with _no_cyclic_gc():
                    engine.run()
            except Exception as exc:  # noqa: BLE001 - the full simulation reports it properly
                raise _Refused(f"phase {k} raised {type(exc).__name__}: {exc}") from None
            if not all(engine.done) or engine.mismatches:
                raise _Refused(f"phase {k}, run on its own, leaves operations unmatched or lengths differing")
            clock, lat = engine.clock, engine.lat
            counts = engine.msgs, engine.sent, engine.recvd, engine.reduced
            steps += sum(engine.index)
            run += sum(engine.index)
        for total, phase_counts in zip((msgs, sent, recvd, reduced), counts):
            total[:] = [a + b for a, b in zip(total, phase_counts)]
    return SimResult(
        collective=collective, algorithm=algorithm, p=p, count=None, nbytes=0, itemsize=itemsize,
        alpha=alpha, beta=beta, gamma=gamma, messages=msgs, bytes_sent=[e * itemsize for e in sent],
        bytes_received=[e * itemsize for e in recvd], bytes_reduced=[e * itemsize for e in reduced],
        finish=clock, time=max(clock), rounds=max(lat), steps=steps, wall=time.perf_counter() - started,
        ranks_simulated=p, steps_run=run,
    )


@contextlib.contextmanager
def _no_cyclic_gc():
    """Pause Python's cyclic garbage collector while an engine runs (reference counting still frees).

    p live generators and the steps they allocate are what the collector keeps walking: at
    p = 4095 its passes took about a fifth of the engine's time, and steps form no cycles.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class _Unbounded(dict):
    """Buffer sizes for schedules of unknown buffers: every name exists and is unbounded."""

    def __missing__(self, name):
        return float("inf")


class _Engine:
    """One simulation. Per-rank state lives in flat lists indexed by rank (fast in CPython).

    Channels: ``chan[src*p + dst]`` holds the oldest unmatched operation of that
    channel as an int, ``len+1`` for a send and ``-(len+1)`` for a receive; any
    later ones wait, in order, in ``overflow[key]`` (rare: it needs two
    unmatched messages between one pair of ranks).
    """

    def __init__(self, factory, p, itemsize, alpha, beta, gamma, events, buffers, collective, algorithm,
                 model=None, start=None):
        self.p = p
        self.itemsize = itemsize
        self.alpha, self.beta, self.gamma = alpha, beta, gamma
        self.model = model
        # Two-level model: each rank's node, and the between-node constants per element.
        self.node = model.nodes(p) if hasattr(model, "nodes") else None
        if self.node is not None:
            self.alpha_inter, self.beta_inter_e = model.alpha_inter, model.beta_inter * itemsize
        self.factory = factory
        self.events = [] if events else None
        self.buffers = buffers
        self.collective, self.algorithm = collective, algorithm
        # ``start``: (times, alpha terms) at which each rank starts, when a previous phase ran apart (else 0).
        self.clock = list(start[0]) if start else [0.0] * p  # start of the current step (finish of the previous)
        self.lat = list(start[1]) if start else [0] * p      # the same clock with alpha = 1, beta = gamma = 0
        self.ready = [0.0] * p      # max(start, peers' post times) of the pending transfer
        self.lready = [0] * p
        self.cost = [0.0] * p       # cost of the pending transfer
        self.overlap_end = [-1.0] * p  # when the local steps overlapped with it end (-1: none)
        self.kcost = [0] * p        # its alpha terms
        self.waiting = [0] * p      # its operations not matched yet
        self.index = [0] * p        # steps taken so far
        self.current = [None] * p   # the pending transfer
        self.done = [False] * p
        self.msgs = [0] * p
        self.sent = [0] * p         # elements
        self.recvd = [0] * p
        self.reduced = [0] * p
        self.chan = {}
        self.overflow = {}
        self.mismatches = []
        self.published = None  # the node arena's counters, once a one-sided step runs (see _one_sided)

    def run(self) -> None:  # one flat loop: in CPython every attribute lookup and call here costs
        p = self.p
        alpha = self.alpha
        beta_e = self.beta * self.itemsize
        gamma_e = self.gamma * self.itemsize
        clock, lat, ready, lready = self.clock, self.lat, self.ready, self.lready
        cost, kcost, waiting, index, current, done = (self.cost, self.kcost, self.waiting, self.index,
                                                       self.current, self.done)
        overlap_end = self.overlap_end
        node = self.node
        msgs, sent, recvd, reduced = self.msgs, self.sent, self.recvd, self.reduced
        chan, overflow = self.chan, self.overflow
        chan_pop = chan.pop
        events = self.events
        buffers = self.buffers
        unbounded = _Unbounded()
        exchange = Exchange
        gens = [None] * p
        work = []
        pop = work.pop
        push = work.append
        fresh = 0
        r = i = -1
        step = None
        try:
            while True:
                if work:
                    r = pop()
                    # The last peer this rank waited for has posted: its pending transfer completes.
                    t = ready[r] + cost[r]
                    if overlap_end[r] > t:
                        t = overlap_end[r]
                    lt = lready[r] + kcost[r]
                    i = index[r]
                    if events is not None:
                        self._event(r, i, current[r], clock[r], t)
                    i += 1
                    g = gens[r]
                elif fresh < p:
                    r = fresh
                    fresh += 1
                    g = gens[r] = self._start(r)
                    t = clock[r]
                    lt = lat[r]
                    i = 0
                else:
                    break
                sizes = buffers[r] if buffers is not None else unbounded
                base = r * p
                # This run of r's steps counts its messages in locals, added to r's totals when it ends.
                n_msgs = n_sent = n_recvd = 0
                for step in g:
                    is_exchange = type(step) is exchange  # most steps: one test instead of reading .kind
                    if is_exchange or step.kind == TRANSFER:
                        if is_exchange:
                            # One send and one receive (most steps): the generic code below, unrolled.
                            peer, name, lo, hi, source, rname, rlo, rhi = step.pair
                            out_e = hi - lo
                            in_e = rhi - rlo
                            if (lo < 0 or out_e < 0 or hi > sizes[name] or peer < 0 or peer >= p
                                    or rlo < 0 or in_e < 0 or rhi > sizes[rname] or source < 0 or source >= p):
                                self._bad_step(r, i, step, sizes)
                            rdy = t
                            lrdy = lt
                            unmatched = 0
                            key = base + peer
                            v = chan_pop(key, None)
                            if v is not None and v < 0:
                                if overflow:
                                    self._refill(key)
                                if v != -out_e - 1:
                                    self._mismatch(r, peer, out_e, -v - 1)
                                pt = clock[peer]
                                if pt > rdy:
                                    rdy = pt
                                pt = lat[peer]
                                if pt > lrdy:
                                    lrdy = pt
                                if t > ready[peer]:
                                    ready[peer] = t
                                if lt > lready[peer]:
                                    lready[peer] = lt
                                w = waiting[peer] - 1
                                waiting[peer] = w
                                if not w:
                                    push(peer)
                            else:
                                if v is None:
                                    chan[key] = out_e + 1
                                else:
                                    chan[key] = v
                                    self._queue(key, out_e + 1)
                                unmatched = 1
                            key = source * p + r
                            v = chan_pop(key, None)
                            if v is not None and v > 0:
                                if overflow:
                                    self._refill(key)
                                if v != in_e + 1:
                                    self._mismatch(source, r, v - 1, in_e)
                                if source == r:
                                    unmatched -= 1
                                else:
                                    pt = clock[source]
                                    if pt > rdy:
                                        rdy = pt
                                    pt = lat[source]
                                    if pt > lrdy:
                                        lrdy = pt
                                    if t > ready[source]:
                                        ready[source] = t
                                    if lt > lready[source]:
                                        lready[source] = lt
                                    w = waiting[source] - 1
                                    waiting[source] = w
                                    if not w:
                                        push(source)
                            else:
                                if v is None:
                                    chan[key] = -in_e - 1
                                else:
                                    chan[key] = v
                                    self._queue(key, -in_e - 1)
                                unmatched += 1
                            k = 1
                            n_msgs += 1
                            n_sent += out_e
                            n_recvd += in_e
                        else:
                            rdy = t
                            lrdy = lt
                            unmatched = 0
                            sends = step.sends
                            out_e = 0
                            for peer, (name, lo, hi) in sends:
                                n = hi - lo
                                if lo < 0 or n < 0 or hi > sizes[name] or peer < 0 or peer >= p:
                                    self._bad_step(r, i, step, sizes)
                                out_e += n
                                key = base + peer
                                v = chan_pop(key, None)
                                if v is not None and v < 0:
                                    # The oldest receive `peer` posted on this channel matches.
                                    if overflow:
                                        self._refill(key)
                                    if v != -n - 1:
                                        self._mismatch(r, peer, n, -v - 1)
                                    pt = clock[peer]
                                    if pt > rdy:
                                        rdy = pt
                                    pt = lat[peer]
                                    if pt > lrdy:
                                        lrdy = pt
                                    if t > ready[peer]:
                                        ready[peer] = t
                                    if lt > lready[peer]:
                                        lready[peer] = lt
                                    w = waiting[peer] - 1
                                    waiting[peer] = w
                                    if not w:
                                        push(peer)
                                else:
                                    if v is None:
                                        chan[key] = n + 1
                                    else:
                                        chan[key] = v
                                        self._queue(key, n + 1)
                                    unmatched += 1
                            recvs = step.recvs
                            in_e = 0
                            for peer, (name, lo, hi) in recvs:
                                n = hi - lo
                                if lo < 0 or n < 0 or hi > sizes[name] or peer < 0 or peer >= p:
                                    self._bad_step(r, i, step, sizes)
                                in_e += n
                                key = peer * p + r
                                v = chan_pop(key, None)
                                if v is not None and v > 0:
                                    # The oldest send `peer` posted on this channel matches.
                                    if overflow:
                                        self._refill(key)
                                    if v != n + 1:
                                        self._mismatch(peer, r, v - 1, n)
                                    if peer == r:
                                        unmatched -= 1  # a send to myself in this same transfer
                                        continue
                                    pt = clock[peer]
                                    if pt > rdy:
                                        rdy = pt
                                    pt = lat[peer]
                                    if pt > lrdy:
                                        lrdy = pt
                                    if t > ready[peer]:
                                        ready[peer] = t
                                    if lt > lready[peer]:
                                        lready[peer] = lt
                                    w = waiting[peer] - 1
                                    waiting[peer] = w
                                    if not w:
                                        push(peer)
                                else:
                                    if v is None:
                                        chan[key] = -n - 1
                                    else:
                                        chan[key] = v
                                        self._queue(key, -n - 1)
                                    unmatched += 1
                            ns = len(sends)
                            nr = len(recvs)
                            k = ns if ns > nr else nr
                            n_msgs += ns
                            n_sent += out_e
                            n_recvd += in_e
                        if node is None:
                            c = k * alpha + beta_e * (out_e if out_e > in_e else in_e)
                        else:
                            c = self._two_level_cost(r, step)
                        # Local steps overlapped with the transfer run from its post; it ends when both have.
                        ov = step.overlap if is_exchange else getattr(step, "overlap", None)
                        local_end = t + gamma_e * self._overlapped(r, i, step, ov, sizes) if ov else -1.0
                        if unmatched:
                            # Blocked: the peer whose post completes this transfer puts r on the work list;
                            # until then peers matching r's operations read its post time from clock[r].
                            clock[r] = t
                            lat[r] = lt
                            ready[r] = rdy
                            lready[r] = lrdy
                            waiting[r] = unmatched
                            cost[r] = c
                            kcost[r] = k
                            overlap_end[r] = local_end
                            current[r] = step
                            index[r] = i
                            msgs[r] += n_msgs
                            sent[r] += n_sent
                            recvd[r] += n_recvd
                            break
                        end = rdy + c
                        if local_end > end:
                            end = local_end
                        if events is not None:
                            self._event(r, i, step, t, end)
                        t = end
                        lt = lrdy + k
                    elif (kind := step.kind) == REDUCE:
                        name, lo, hi = step.into
                        n = hi - lo
                        oname, olo, ohi = step.operand
                        if lo < 0 or n < 0 or hi > sizes[name] or olo < 0 or ohi - olo != n or ohi > sizes[oname]:
                            self._bad_step(r, i, step, sizes)
                        src = step.src
                        if src is not step.into:  # three-address: into = src (op) operand
                            sname, slo, shi = src
                            if slo < 0 or shi - slo != n or shi > sizes[sname]:
                                self._bad_step(r, i, step, sizes)
                        reduced[r] += n
                        if events is not None:
                            self._event(r, i, step, t, t + gamma_e * n)
                        t += gamma_e * n
                    elif kind == COPY:
                        name, lo, hi = step.dst
                        sname, slo, shi = step.src
                        if (lo < 0 or hi < lo or hi > sizes[name]
                                or slo < 0 or shi - slo != hi - lo or shi > sizes[sname]):
                            self._bad_step(r, i, step, sizes)
                        if events is not None:
                            self._event(r, i, step, t, t)
                    elif kind in ONE_SIDED:
                        t, lt = self._one_sided(r, i, step, t, lt, push)
                        if t is None:  # waiting for a peer's counter
                            msgs[r] += n_msgs
                            sent[r] += n_sent
                            recvd[r] += n_recvd
                            break
                    else:
                        raise SimulationError(
                            f"rank {r} yielded a step of unknown kind {kind!r} at step {i}: {step!r}.")
                    i += 1
                else:
                    done[r] = True
                    clock[r] = t
                    lat[r] = lt
                    index[r] = i
                    msgs[r] += n_msgs
                    sent[r] += n_sent
                    recvd[r] += n_recvd
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise self._not_a_step(exc, (_Engine.run.__code__,), r, i, step, buffers, p) from None

    # -- the node arena's one-sided steps (commkit.algorithms.node) ----------------------------------------
    #
    # A copy into or out of the arena (Put, Get) costs beta per byte: on one node beta is memory
    # bandwidth. A fold of k slots (ReduceSlots) costs (k-1) gamma per byte. A Wait is a flag crossing
    # cores: it ends alpha after the later of its own start and the peers' publications of the
    # counter step it waits for, and counts one round. Publish, Claim and Release take no time.

    def _one_sided(self, r, i, step, t, lt, push):
        """Run one one-sided step of rank r from time ``t``: its end ``(t, lt)``, or (None, None) while it waits."""
        if self.published is None:
            self.published = [([], [], []) for _ in range(self.p)]  # per rank: values, times, rounds
            self.watchers = [[] for _ in range(self.p)]  # per rank: (waiting rank, value) not yet reached
        kind = step.kind
        start = t
        if kind == PUT or kind == GET:
            t += self.beta * self.itemsize * (step.dst[2] - step.dst[1])
        elif kind == REDUCE_SLOTS:
            n, k = step.dst[2] - step.dst[1], len(step.operands)
            t += (self.gamma * (k - 1) if k > 1 else self.beta) * self.itemsize * n
            self.reduced[r] += (k - 1) * n
        elif kind == PUBLISH or kind == RELEASE:
            self._publish(r, FINAL if kind == RELEASE else step.k, t, lt, push)
        elif kind == WAIT and step.peers:
            rdy, lrdy, short = t, lt, 0
            for q in step.peers:
                values, times, rounds = self.published[q]
                j = bisect.bisect_left(values, step.k)
                if j < len(values):
                    rdy, lrdy = max(rdy, times[j]), max(lrdy, rounds[j])
                else:
                    short += 1
                    self.watchers[q].append((r, step.k))
            if short:
                self.clock[r], self.lat[r], self.index[r], self.current[r] = t, lt, i, step
                self.waiting[r] = short
                self.kcost[r] = 1
                self._wake(r, rdy, lrdy, block=True)
                return None, None
            t, lt = rdy + self.alpha, lrdy + 1
        elif kind != CLAIM and kind != WAIT:
            raise SimulationError(f"rank {r} yielded a step of unknown kind {kind!r} at step {i}: {step!r}.")
        if self.events is not None:
            self._event(r, i, step, start, t)
        return t, lt

    def _publish(self, r, value, t, lt, push) -> None:
        values, times, rounds = self.published[r]
        values.append(value)
        times.append(t)
        rounds.append(lt)
        waiting = self.watchers[r]
        if waiting:
            self.watchers[r] = [(w, k) for w, k in waiting if k > value]
            for w, k in waiting:
                if k <= value:
                    self._wake(w, t, lt)
                    self.waiting[w] -= 1
                    if not self.waiting[w]:
                        push(w)

    def _wake(self, w, t, lt, block=False) -> None:
        """Rank w's Wait can end no sooner than alpha after ``t`` (``block``: it starts waiting now)."""
        if block:
            self.ready[w], self.lready[w] = t, lt
            self.cost[w], self.overlap_end[w] = self.alpha, -1.0
        else:
            self.ready[w], self.lready[w] = max(self.ready[w], t), max(self.lready[w], lt)

    @staticmethod
    def _not_a_step(exc, loops, r, i, step, buffers, p):
        """The error for a malformed step that tripped an engine loop (``exc`` itself if the schedule raised it)."""
        tb = exc.__traceback__
        while tb.tb_next is not None:
            tb = tb.tb_next
        if tb.tb_frame.f_code not in loops:
            return exc  # raised inside the schedule's own code (or a check above): not ours to rephrase
        # Not a step, or a malformed one: say which rank and step, not where the loop tripped.
        return SimulationError(
            f"rank {r} yielded {step!r} at step {i}, which is not a valid Transfer, Reduce or Copy step "
            f"({type(exc).__name__}: {exc}); buffers this collective has: "
            f"{sorted(buffers[r]) if buffers is not None and 0 <= r < p else 'any'}."
        )

    def _copy(self, r, i, step, t, sizes, events) -> None:
        """Check a Copy step (and record its event): what the engines' loops do for one."""
        name, lo, hi = step.dst
        sname, slo, shi = step.src
        if lo < 0 or hi < lo or hi > sizes[name] or slo < 0 or shi - slo != hi - lo or shi > sizes[sname]:
            self._bad_step(r, i, step, sizes)
        if events is not None:
            self._event(r, i, step, t, t)

    def _start(self, r):
        steps = self.factory(r)
        try:
            return iter(steps)
        except TypeError:
            raise SimulationError(f"factory({r}) returned {type(steps).__name__}, not an iterable of steps.") from None

    def _overlapped(self, r, i, step, local_steps, sizes) -> int:
        """Check the local steps a transfer overlaps; count their reductions; return the elements reduced."""
        n_reduced = 0
        for local in local_steps:
            kind = getattr(local, "kind", None)
            if kind == REDUCE:
                name, lo, hi = local.into
                n = hi - lo
                for bname, blo, bhi in (local.into, local.operand, local.src):
                    if blo < 0 or bhi - blo != n or bhi > sizes[bname]:
                        self._bad_step(r, i, local, sizes)
                n_reduced += n
            elif kind == COPY:
                name, lo, hi = local.dst
                sname, slo, shi = local.src
                if lo < 0 or hi < lo or hi > sizes[name] or slo < 0 or shi - slo != hi - lo or shi > sizes[sname]:
                    self._bad_step(r, i, local, sizes)
            else:
                raise SimulationError(
                    f"rank {r} step {i} ({step!r}) overlaps {local!r}, which is not a Reduce or Copy step.")
        self.reduced[r] += n_reduced
        return n_reduced

    def _queue(self, key, value):
        queue = self.overflow.get(key)
        if queue is None:
            queue = self.overflow[key] = deque()
        queue.append(value)

    def _refill(self, key):
        queue = self.overflow.get(key)
        if queue:
            self.chan[key] = queue.popleft()
            if not queue:
                del self.overflow[key]

    def _bad_step(self, r, i, step, sizes):
        """Raise the error that describes what is wrong with ``step`` (a peer or a range)."""
        kind = step.kind
        if kind == TRANSFER:
            for peer, _ in step.sends + step.recvs:
                if not 0 <= peer < self.p:
                    raise SimulationError(f"rank {r} step {i} ({step!r}) names rank {peer}; p is {self.p}.")
            ranges = [buf for _, buf in step.sends] + [buf for _, buf in step.recvs]
        elif kind == REDUCE:
            ranges = [step.into, step.operand, step.src]
        else:
            ranges = [step.dst, step.src]
        if kind != TRANSFER and len({hi - lo for _, lo, hi in ranges}) > 1:
            what = "reduces" if kind == REDUCE else "copies between"
            raise SimulationError(f"rank {r} step {i} ({step!r}) {what} ranges of different lengths.")
        for name, lo, hi in ranges:
            size = sizes[name]
            if not 0 <= lo <= hi <= size:
                raise SimulationError(
                    f"rank {r} step {i} ({step!r}) uses {name}[{lo}:{hi}], outside the {size} elements "
                    f"that buffer has on rank {r}."
                )
        raise AssertionError("_bad_step called for a valid step")

    # -- checks and records (off the fast path) ---------------------------------------------

    def _mismatch(self, src, dst, sent_elems, recv_elems):
        if len(self.mismatches) < 100:
            self.mismatches.append(
                f"rank {src} sends {sent_elems} elements to rank {dst}, which receives {recv_elems}"
            )

    def _event(self, r, i, step, start, end):
        size = self.itemsize
        self.events.append(step_event(r, self.collective, 0, self.algorithm, i, step, start, end, lambda _: size))

    def _two_level_cost(self, r, step) -> float:
        """A transfer's cost in the two-level model: each level's alpha-beta cost; the step takes the longer."""
        node = self.node
        here = node[r]
        counts = [[0, 0, 0, 0], [0, 0, 0, 0]]  # per level (0 within the node, 1 between): sends, recvs, elements
        for peer, (_, lo, hi) in step.sends:
            level = counts[node[peer] != here]
            level[0] += 1
            level[2] += hi - lo
        for peer, (_, lo, hi) in step.recvs:
            level = counts[node[peer] != here]
            level[1] += 1
            level[3] += hi - lo
        beta_e = self.beta * self.itemsize
        (s0, r0, o0, i0), (s1, r1, o1, i1) = counts
        within = max(s0, r0) * self.alpha + beta_e * max(o0, i0)
        between = max(s1, r1) * self.alpha_inter + self.beta_inter_e * max(o1, i1)
        return max(within, between)

    def _heads(self):
        """``(source, destination, is_send)`` of the oldest unmatched operation of every channel."""
        p = self.p
        for key, head in self.chan.items():
            yield (*divmod(key, p), head > 0)

    def _stuck(self) -> list:
        sends_to: dict = {}
        recvs_from: dict = {}
        for src, dst, is_send in self._heads():
            if is_send:
                sends_to.setdefault(src, []).append(dst)
            else:
                recvs_from.setdefault(dst, []).append(src)
        stuck = []
        for r in range(self.p):
            if not self.done[r]:
                stuck.append(Waiting(r, self.index[r], repr(self.current[r]),
                                     tuple(sorted(sends_to.get(r, ()))), tuple(sorted(recvs_from.get(r, ())))))
        return stuck

    def result(self, collective, algorithm, wall) -> SimResult:
        size = self.itemsize
        if self.events is not None:
            self.events.sort(key=lambda e: (e["rank"], e["step"]))
        return SimResult(
            collective=collective, algorithm=algorithm, p=self.p, count=None, nbytes=0, itemsize=size,
            alpha=self.alpha, beta=self.beta, gamma=self.gamma,
            messages=list(self.msgs),
            bytes_sent=[e * size for e in self.sent],
            bytes_received=[e * size for e in self.recvd],
            bytes_reduced=[e * size for e in self.reduced],
            finish=list(self.clock), time=max(self.clock), rounds=max(self.lat),
            steps=sum(self.index), waiting=self._stuck(), mismatches=list(self.mismatches),
            events=self.events, wall=wall, ranks_simulated=self.p, model=self.model, steps_run=sum(self.index),
        )


class _LogGPEngine(_Engine):
    """One simulation under :class:`commkit.cost.LogGP`: each rank's processor and link are separate clocks.

    Matching and every check are the alpha-beta engine's (a rank still waits until
    each of its operations is matched, so deadlocks are found alike); only the
    clock differs. Clear rather than fast: it runs every rank, without symmetry.
    A rank's step works in this order: its processor posts the sends (``o`` each)
    while its link injects them; then it runs the step's overlapped local steps;
    then it takes each message as it arrives (``o`` each, in order of arrival).
    A send's arrival time is fixed when its sender posts it (messages are eager),
    so it travels with the send in the channel until a receive matches it.
    """

    def __init__(self, factory, p, itemsize, model, events, buffers, collective, algorithm):
        super().__init__(factory, p, itemsize, model.alpha, model.G, model.gamma, events, buffers, collective,
                         algorithm, model)
        self.link_out = [0.0] * p    # when each rank's link can start sending its next message
        self.link_in = [0.0] * p     # when it can start receiving the next one
        self.cpu = [0.0] * p         # when the pending transfer's processor work before its receives ends
        self.sends_end = [0.0] * p   # when the pending transfer's last send has left the link
        self.arrivals = [[] for _ in range(p)]  # (first byte at the link, elements) of its receives matched so far
        self.queues: dict = {}       # channel key -> unmatched operations, oldest first: (is_send, elements, first)

    def _heads(self):
        p = self.p
        for key, queue in self.queues.items():
            if queue:
                yield (*divmod(key, p), queue[0][0])

    def _wake(self, w, t, lt, block=False) -> None:
        """Rank w's Wait ends alpha after ``t`` at the soonest: on its processor, with no message to take."""
        if block:
            self.cpu[w], self.sends_end[w], self.lready[w] = t + self.alpha, 0.0, lt
        else:
            self.cpu[w], self.lready[w] = max(self.cpu[w], t + self.alpha), max(self.lready[w], lt)

    def _finish(self, r) -> float:
        """When r's pending transfer ends: its receives taken in order of arrival, after its processor's work."""
        model = self.model
        o, g, G_e = model.o, model.g, model.G * self.itemsize
        link_in = self.link_in[r]
        cpu = self.cpu[r]
        for first, n in sorted(self.arrivals[r]):
            start = max(first, link_in)
            busy = n * G_e
            link_in = start + max(busy, g)
            cpu = max(cpu, start + busy) + o
        self.link_in[r] = link_in
        self.arrivals[r] = []
        return max(cpu, self.sends_end[r])

    def _match(self, key, is_send, n, first, r, lt) -> int | None:
        """Post one operation of rank r on channel ``key``; return the peer it matched (None: it waits)."""
        queue = self.queues.get(key)
        if queue and queue[0][0] != is_send:
            _, other, other_first = queue.popleft()
            src, dst = divmod(key, self.p)
            peer = dst if is_send else src
            if is_send:
                if other != n:
                    self._mismatch(r, peer, n, other)
                self.arrivals[peer].append((first, n))
            else:
                if other != n:
                    self._mismatch(peer, r, other, n)
                self.arrivals[r].append((other_first, n))
            if peer != r:
                # The peer is blocked in its pending transfer: one operation fewer to wait for.
                self.lready[peer] = max(self.lready[peer], lt)
                self.waiting[peer] -= 1
                if not self.waiting[peer]:
                    self.work.append(peer)
            return peer
        if queue is None:
            queue = self.queues[key] = deque()
        queue.append((is_send, n, first))
        return None

    def run(self) -> None:
        p = self.p
        model = self.model
        o, L, g, G_e = model.o, model.L, model.g, model.G * self.itemsize
        gamma_e = model.gamma * self.itemsize
        clock, lat, lready, waiting = self.clock, self.lat, self.lready, self.waiting
        index, current, done, events = self.index, self.current, self.done, self.events
        buffers = self.buffers
        unbounded = _Unbounded()
        gens = [None] * p
        self.work = work = []
        fresh = 0
        r = i = -1
        step = None
        try:
            while True:
                if work:
                    r = work.pop()
                    t = self._finish(r)
                    lt = lready[r] + self.kcost[r]
                    i = index[r]
                    if events is not None:
                        self._event(r, i, current[r], clock[r], t)
                    i += 1
                    gen = gens[r]
                elif fresh < p:
                    r = fresh
                    fresh += 1
                    gen = gens[r] = self._start(r)
                    t = 0.0
                    lt = 0
                    i = 0
                else:
                    break
                sizes = buffers[r] if buffers is not None else unbounded
                for step in gen:
                    kind = step.kind
                    if kind == TRANSFER:
                        sends, recvs = step.sends, step.recvs
                        for peer, (name, lo, hi) in sends + recvs:
                            if lo < 0 or hi < lo or hi > sizes[name] or not 0 <= peer < p:
                                self._bad_step(r, i, step, sizes)
                        lrdy = lt
                        unmatched = 0
                        cpu = t
                        sends_end = t
                        link_out = self.link_out[r]
                        for peer, (name, lo, hi) in sends:
                            n = hi - lo
                            cpu += o  # the processor posts it ...
                            start = max(cpu, link_out)  # ... and the link sends it when free
                            busy = n * G_e
                            link_out = start + max(busy, g)
                            sends_end = max(sends_end, start + busy)
                            self.sent[r] += n
                            matched = self._match(r * p + peer, True, n, start + L, r, lt)
                            if matched is None:
                                unmatched += 1
                            elif lat[matched] > lrdy:
                                lrdy = lat[matched]
                        self.link_out[r] = link_out
                        for peer, (name, lo, hi) in recvs:
                            n = hi - lo
                            self.recvd[r] += n
                            matched = self._match(peer * p + r, False, n, None, r, lt)
                            if matched is None:
                                unmatched += 1
                            elif matched == r:
                                unmatched -= 1  # a send to myself in this same transfer
                            elif lat[matched] > lrdy:
                                lrdy = lat[matched]
                        self.msgs[r] += len(sends)
                        k = max(len(sends), len(recvs))
                        ov = step.overlap
                        if ov:
                            cpu += gamma_e * self._overlapped(r, i, step, ov, sizes)
                        self.cpu[r] = cpu
                        self.sends_end[r] = sends_end
                        self.kcost[r] = k
                        if unmatched:
                            clock[r] = t
                            lat[r] = lt
                            lready[r] = lrdy
                            waiting[r] = unmatched
                            current[r] = step
                            index[r] = i
                            break
                        end = self._finish(r)
                        if events is not None:
                            self._event(r, i, step, t, end)
                        t = end
                        lt = lrdy + k
                    elif kind == REDUCE:
                        name, lo, hi = step.into
                        n = hi - lo
                        for bname, blo, bhi in (step.into, step.operand, step.src):
                            if blo < 0 or bhi - blo != n or n < 0 or bhi > sizes[bname]:
                                self._bad_step(r, i, step, sizes)
                        self.reduced[r] += n
                        if events is not None:
                            self._event(r, i, step, t, t + gamma_e * n)
                        t += gamma_e * n
                    elif kind == COPY:
                        self._copy(r, i, step, t, sizes, events)
                    elif kind in ONE_SIDED:
                        t, lt = self._one_sided(r, i, step, t, lt, work.append)
                        if t is None:  # waiting for a peer's counter
                            break
                    else:
                        raise SimulationError(
                            f"rank {r} yielded a step of unknown kind {kind!r} at step {i}: {step!r}.")
                    i += 1
                else:
                    done[r] = True
                    clock[r] = t
                    lat[r] = lt
                    index[r] = i
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise self._not_a_step(exc, (_LogGPEngine.run.__code__, _LogGPEngine._match.__code__, _Engine._copy.__code__),
                                   r, i, step, buffers, p) from None
