"""Node algorithms: collectives through the node's shared arena, at the memory floor.

Why. On one node every two-sided schedule pays the transport's copies (MPI's
shared-memory transport copies each message twice, through its cells) and no
rank reads a peer's data where it lies. Here each rank copies its input once
into its own slot of the node arena (:mod:`commkit.transports._arena`), and its
peers read it from there: an allreduce reduces a 1/p slice of every rank's
slot and every rank copies the reduced slices out (DeepSpeed's CPU
shared-memory allreduce), a broadcast is one copy in and p-1 copies out. The
rest follow from these two: a reduce is the allreduce whose root alone copies
the slices out; a gather is the broadcast reversed (p-1 copies in, the root's
p-1 copies out), a scatter the broadcast with a block per rank; allgather,
reduce_scatter and alltoall put every rank's input once and let each rank take
what is its own.

The steps are the one-sided vocabulary of :mod:`commkit.schedule`: ``Put``
into this rank's slot, ``Publish`` a counter step, ``Wait`` for peers'
counters, ``Get`` and ``ReduceSlots`` out of any rank's slot, between a
``Claim`` and a ``Release`` of the arena. Large messages go through the
bounded arena in chunks of ``segment`` elements (``algorithm="shm:1M"``, else
``COMMKIT_SEGMENT_ELEMENTS``; where a chunk holds a piece of several blocks,
as in reduce_scatter, scatter and alltoall, the pieces together), two chunks
in flight: chunk k+1 is written
into the other half of the slot while peers still read chunk k, and a chunk's
half is written again only after a wait that every rank passes after it read
that half (each algorithm says which).

Every counter step a rank publishes is (call number, k), and a wait is for
(call number, k) or later, so a rank in a later call never satisfies an
earlier one's wait by accident; a wait that is satisfied checks its peers
recorded this very call (the identity).

Results are the same bits on every rank: each element of a reduction is
folded once, by one rank, in rank order (or by every rank in the same order);
a reduce gives its root the bits the allreduce gives every rank.
Zero copy. When every rank's arrays are shared arrays (``comm.shared_empty``),
allreduce, broadcast, allgather, reduce_scatter and alltoall take their
``shared=True`` form: no slot,
no chunks; a rank reads its peers' ``in`` and ``out`` where they lie
(``peer(q, "in", lo, hi)``), and waits once more at the end, until every
peer has read its arrays, before the caller may write them again.

Restrictions: every rank of the communicator on one node (MPI's
``COMM_TYPE_SHARED``; ``COMMKIT_RANKS_PER_NODE`` emulates nodes for tests);
persistent requests run them through the interpreter at each start. Costs are in the simulator's node terms (see
:mod:`commkit.sim`): a wait is one α (a flag crossing cores, plus a step of
Python), a copy into or out of the arena β per byte, a fold of k slots
(k-1)γ per byte.
"""

from __future__ import annotations

import functools
import os
from typing import Callable, NamedTuple

from .._checks import parse_size
from ..errors import InvalidArgument
from ..schedule import Claim, Copy, Get, Publish, Put, ReduceSlots, Release, Wait, partition, peer, slot
from . import algorithm
from ._blocks import block_offsets
from .pipelined import COST_ITEMSIZE, segment_elements

ZERO_COPY_MIN_BYTES = {"allreduce": 1 << 20, "broadcast": 512 << 10, "allgather": 512 << 10,
                       "reduce_scatter": 512 << 10, "alltoall": 512 << 10}
"""Calls on shared arrays of fewer bytes (as the selector counts them) keep the copying form, by collective.

A zero-copy form waits once more than the copying one (a rank returns only when its
peers have read its arrays), and a wait costs a few microseconds of Python. Measured on
2 ranks (benchmarks/node_floor.py with and without ``COMMKIT_ZERO_COPY_MIN_BYTES=0``,
MPICH and Open MPI, docs/node.md): from 512 KiB every zero-copy form wins or ties but the
allreduce's, which at 512 KiB loses where memory is fast (0.59-0.69 of MPI's against the
copying form's 0.49-0.60) and ties at 1 MiB; below 512 KiB the broadcast's loses.
``COMMKIT_ZERO_COPY_MIN_BYTES`` (a size such as ``64K``; ``0`` for every call) sets one
threshold for all, read at a call shape's first call on shared arrays.
"""
ENV_ZERO_COPY_MIN_BYTES = "COMMKIT_ZERO_COPY_MIN_BYTES"


def zero_copy_min_bytes(collective: str) -> int:
    """``collective``'s :data:`ZERO_COPY_MIN_BYTES`, or ``COMMKIT_ZERO_COPY_MIN_BYTES`` when set."""
    text = os.environ.get(ENV_ZERO_COPY_MIN_BYTES, "").strip()
    if not text:
        return ZERO_COPY_MIN_BYTES.get(collective, 1 << 20)
    try:
        return parse_size(text)
    except InvalidArgument as exc:
        raise InvalidArgument(f"{ENV_ZERO_COPY_MIN_BYTES}: {exc}") from None


SMALL = 16384
"""Allreduces and reduces of at most this many elements fold all p slots (every rank; the root): one wait, not two.

Small calls are latency-bound, and the flat form has one synchronisation where
the sliced form has two; from 64 KiB of float32 up, reading p inputs per rank
costs more memory traffic than the second wait (for a reduce, the root alone
folds all p inputs). Measured on 2 ranks (2026-12-07, MPICH and Open MPI,
float32 sum, each form forced side by side in one job, 15 sweeps, two runs on
MPICH and one on Open MPI): the flat form 5.8-5.9 µs at 16 KiB against the
sliced 6.5-6.6, a tie at 32 KiB (6.7-7.0 against 7.0-7.2), and at 64 KiB
(16384 elements, still flat) 8.7-8.9 against 8.0-8.2: the crossover lies
between 32 and 64 KiB, and where it is exactly moves the call by under 10%.
"""


def _chunks(count: int, segment) -> tuple:
    """The (lo, hi) chunks a vector of ``count`` elements goes through the arena in (none when count is 0)."""
    if not count:
        return ()
    return partition(count, -(-count // segment_elements(segment)))


def _others(rank, size):
    return [q for q in range(size) if q != rank]


def _piece_chunks(count: int, parts: int, segment) -> tuple:
    """The (lo, hi) pieces a block of ``count`` elements is cut into when each chunk holds ``parts`` blocks' pieces.

    Scatter and alltoall lay one piece of each of ``parts`` blocks side by side in a
    chunk, so a piece is at most segment / parts elements (at least one); none when
    count is 0.
    """
    if not count:
        return ()
    piece = max(1, segment_elements(segment) // parts)
    return partition(count, -(-count // piece))


def _alike(key):
    """Declare which ranks take alike steps, for :mod:`commkit.sim`: ``key(rank, size, *the schedule's arguments)``.

    Ranks with equal keys take the same steps with the same lengths and counter steps,
    and each of their waits names peers of the same keys; the simulator then runs one
    rank of each key for all of them (its classes of alike ranks). Nothing changes when
    the schedule runs: the key is an attribute of the function, read by the simulator
    alone, and ``tests/test_sim.py`` holds every key to running every rank.
    """
    def declare(fn):
        fn.alike = key
        return fn
    return declare


class _Chunks(NamedTuple):
    """A schedule in chunks: ``head``, ``body(c, lo, hi)`` for each chunk ``(lo, hi)`` of ``chunks``, ``tail``.

    Every chunk's steps are the first chunk's with each length that is the chunk's own
    (``hi - lo``) taken from its chunk, and each counter step moved by the same amount a
    chunk: what lets :mod:`commkit.sim` model the chunks by their period, not step by step.
    """

    head: tuple
    chunks: tuple
    body: Callable | None
    tail: tuple


def _in_chunks(fn):
    """Make a schedule generator from ``fn(rank, size, ...) -> _Chunks``, the steps of its parts in order.

    ``fn`` stays reachable as the schedule's ``chunked`` attribute, which :mod:`commkit.sim` reads;
    the steps every transport runs are the same either way, so the schedule is written once.
    """
    @functools.wraps(fn)
    def schedule(*args, **kwargs):
        parts = fn(*args, **kwargs)
        yield from parts.head
        for c, (lo, hi) in enumerate(parts.chunks):
            yield from parts.body(c, lo, hi)
        yield from parts.tail

    schedule.chunked = fn
    return schedule


def _chunk_lengths(count: int, segment) -> tuple:
    """The distinct lengths of :func:`_chunks` (one or two), without listing the chunks."""
    if not count:
        return ()
    k = -(-count // segment_elements(segment))
    short, extra = divmod(count, k)
    return (short, short + 1) if extra else (short,)


def _slice_key(index: int, size: int, count: int, segment) -> tuple:
    """Which of a chunk's slices (``partition(m, size)``) slice ``index`` is, long or short, for each chunk length m.

    The long slices come first, so a rank whose slice is long sees every other slice as
    every other long-sliced rank does (one long fewer, then the short ones, in order).
    """
    return tuple(index < m % size for m in _chunk_lengths(count, segment))


def _copy_in(rank, size, half, a, b, lo, hi) -> Put:
    """The Put of chunk ``[a, b)`` into half ``half`` of this rank's slot, whose slice of the chunk is ``[lo, hi)``.

    Of two ranks, a rank's slice is one end of its chunk, so what the other rank folds
    is one range: only that goes in, and the rank folds its own slice from its input,
    where it lies (:func:`_fold_operands`), a copy in of half the chunk saved. With
    more ranks a middle rank's slice would leave two ranges to copy, of lengths that
    differ from rank to rank, so that the simulator could no longer run one rank for
    all ranks alike (:func:`_alike`): the whole chunk goes in.
    """
    m = b - a
    if size != 2:
        return Put(slot(rank, half, half + m), ("in", a, b))
    if lo == 0:  # my slice is the first: the other folds the rest
        return Put(slot(rank, half + hi, half + m), ("in", a + hi, b))
    return Put(slot(rank, half, half + lo), ("in", a, a + lo))


def _fold_operands(rank, size, half, a, lo, hi) -> list:
    """The ranges a rank folds its slice ``[lo, hi)`` of chunk ``a`` from, in rank order: every rank's slot, but
    its own input for its own slot where it kept its slice out of it (two ranks, :func:`_copy_in`)."""
    return [("in", a + lo, a + hi) if q == rank and size == 2 else slot(q, half + lo, half + hi)
            for q in range(size)]


# -- allreduce ----------------------------------------------------------------------------------------

def _allreduce_time(p, count, alpha, beta_e, gamma_e, segment=None):
    """The simulated time of :func:`allreduce_shm`, phase by phase (ranks wait for each other every phase)."""
    if p == 1:
        return 0.0
    width = segment_elements(segment)
    if count <= min(SMALL, width):
        return beta_e * count + alpha + (p - 1) * gamma_e * count
    t = 0.0
    chunks = _chunks(count, segment)
    for c, (a, b) in enumerate(chunks):
        m = b - a
        big, small = -(-m // p), m // p
        kept = p == 2  # of two ranks, each keeps its own slice out of its slot (_copy_in)
        if c == 0:  # of two, the rank with the smaller slice copies in the larger half
            t += beta_e * (m - small if kept else m)
        t += alpha + big * ((p - 1) * gamma_e + beta_e) + alpha
        # The rank with the smallest slice of its own gets the most slices (and of two, copies in the most of
        # the next chunk: its slice there is the smaller too): it publishes the next chunk last.
        nxt = chunks[c + 1][1] - chunks[c + 1][0] if c + 1 < len(chunks) else 0
        t += beta_e * (m - small + (nxt - nxt // p if kept else nxt))
    return t


def _allreduce_alike(rank, size, count, op, segment=None):
    """Ranks alike in :func:`allreduce_shm`: all of them for small vectors, else by their slices' lengths."""
    if count <= min(SMALL, segment_elements(segment)):
        return ()
    return _slice_key(rank, size, count, segment)


@algorithm("allreduce", "shm",
           cost=lambda p, n, a, b, g: _allreduce_time(p, int(n) // COST_ITEMSIZE, a, b * COST_ITEMSIZE,
                                                      g * COST_ITEMSIZE),
           formula="α + nβ + (p-1)nγ up to 16384 elements; else per chunk of m bytes 2α + (2m - ⌊m/p⌋)β "
                   "+ ⌈m/p⌉((p-1)γ + β); of two ranks 2α + 2(m - ⌊m/p⌋)β + ⌈m/p⌉(γ + β)")
@_alike(_allreduce_alike)
def allreduce_shm(rank, size, count, op, segment=None, shared=False):
    """Shared-memory allreduce: every rank folds a 1/p slice of every rank's slot, then all copy the slices out.

    Restrictions: one node. Small vectors (at most :data:`SMALL` elements and one
    chunk): each rank puts its vector, waits for all, and folds all p slots in rank
    order into its output (one wait). Larger: per chunk, each rank puts the chunk,
    waits for all (1), folds its slice of the chunk from all p slots into its output
    and puts that slice back into its slot, waits for all (2), and gets every other
    slice. The half of the slot chunk k used is written again by chunk k+2, after
    wait (1) of chunk k+1, which every rank passes only after its gets of chunk k.
    Of two ranks, each puts only the half of the chunk the other folds, and folds its
    own half from its input where it lies (:func:`_copy_in`).
    Cost: α + nβ + (p-1)nγ small; large, per chunk of m bytes, 2α + (2m - ⌊m/p⌋)β +
    ⌈m/p⌉((p-1)γ + β), and of two ranks 2α + 2(m - ⌊m/p⌋)β + ⌈m/p⌉(γ + β) (exact: the
    formula follows the slowest rank of each phase).

    With ``shared`` (every rank's ``in`` and ``out`` are shared arrays): each rank folds
    its slice of every rank's input, where it lies, into its output; waits for all; gets
    every other slice from its owner's output; and waits until every rank has read its
    arrays. The memory floor, with three waits: 3α + ⌈n/p⌉(p-1)γ + (n - ⌊n/p⌋)β.

    Picture, generated from the schedule (p = 4, count = 8, segment = 2): each cell lists, for every
    block of the result, the ranks whose input that rank holds for the whole block (- for none), after
    each round. Redrawn by ``python -m commkit.algorithms._diagram --write``::

        round         rank 0               rank 1               rank 2               rank 3
        0             0    0    0    0     1    1    1    1     2    2    2    2     3    3    3    3
        1             0    0    0    0     1    1    1    1     2    2    2    2     3    3    3    3
        2             0123 0    0    0     0123 1    1    1     0123 2    2    2     0123 3    3    3
        3             0123 0    0    0     0123 1    1    1     0123 2    2    2     0123 3    3    3
        4             0123 0123 0    0     0123 0123 1    1     0123 0123 2    2     0123 0123 3    3
        5             0123 0123 0    0     0123 0123 1    1     0123 0123 2    2     0123 0123 3    3
        6             0123 0123 0123 0     0123 0123 0123 1     0123 0123 0123 2     0123 0123 0123 3
        7             0123 0123 0123 0     0123 0123 0123 1     0123 0123 0123 2     0123 0123 0123 3
        8             0123 0123 0123 0123  0123 0123 0123 0123  0123 0123 0123 0123  0123 0123 0123 0123
        waits         8                    8                    8                    8
        elems put     12                   12                   8                    8
        elems got     4                    4                    8                    8
        elems folded  12                   12                   0                    0
        critical path (commkit.sim, each term alone): 8 waits, 20 elements copied, 12 folded
    """
    if size == 1:
        yield Copy(("out", 0, count), ("in", 0, count))
        return
    others = _others(rank, size)
    if shared:
        yield from _allreduce_shared(rank, size, count, op, others)
        return
    if count <= min(SMALL, segment_elements(segment)):
        # Phase 1: every rank's vector into its slot; phase 2: every rank folds all slots.
        yield Claim(count, size)
        yield Put(slot(rank, 0, count), ("in", 0, count))
        yield Publish(1)
        yield Wait(others, 1)
        yield ReduceSlots(("out", 0, count), [slot(q, 0, count) for q in range(size)], op)
        yield Release()
        return
    chunks = _chunks(count, segment)
    width = chunks[0][1] - chunks[0][0] if chunks else 0
    yield Claim(2 * width, size)
    for c, (a, b) in enumerate(chunks):
        half = (c % 2) * width
        m = b - a
        lo, hi = partition(m, size)[rank]
        # Copy in (of two ranks, only the half the other folds), and wait until every rank's is in its slot.
        yield _copy_in(rank, size, half, a, b, lo, hi)
        yield Publish(2 * c + 1)
        yield Wait(others, 2 * c + 1)
        # Reduce-scatter: fold my slice of every rank's chunk, in rank order; publish the result in my slot.
        yield ReduceSlots(("out", a + lo, a + hi), _fold_operands(rank, size, half, a, lo, hi), op)
        yield Put(slot(rank, half + lo, half + hi), ("out", a + lo, a + hi))
        yield Publish(2 * c + 2)
        yield Wait(others, 2 * c + 2)
        # Allgather: copy every other rank's reduced slice out of its slot.
        for q in others:
            qlo, qhi = partition(m, size)[q]
            yield Get(("out", a + qlo, a + qhi), slot(q, half + qlo, half + qhi))
    yield Release()


def _allreduce_shared(rank, size, count, op, others):
    """:func:`allreduce_shm` on shared arrays: the reduce-scatter and the allgather read peers' arrays in place.

    Right in place too (``out`` is ``in``): a rank writes only its own slice of its
    output while its peers fold (they read their own slices of its input), and the
    other slices only after every rank has folded.
    """
    slices = partition(count, size)
    lo, hi = slices[rank]
    yield Claim(0, size, shared=True)
    yield Publish(1)  # my input is the caller's, ready: peers may read it
    yield Wait(others, 1)
    yield ReduceSlots(("out", lo, hi), [("in", lo, hi) if q == rank else peer(q, "in", lo, hi)
                                        for q in range(size)], op)
    yield Publish(2)
    yield Wait(others, 2)
    for q in others:
        qlo, qhi = slices[q]
        yield Get(("out", qlo, qhi), peer(q, "out", qlo, qhi))
    yield Publish(3)
    yield Wait(others, 3)  # every peer has read my arrays: the caller may write them again
    yield Release()


# -- reduce -------------------------------------------------------------------------------------------

def _reduce_time(p, count, alpha, beta_e, gamma_e, segment=None):
    """The simulated time of :func:`reduce_shm`, phase by phase (the root is the last to publish every chunk)."""
    if p == 1:
        return 0.0
    if count <= min(SMALL, segment_elements(segment)):
        return beta_e * count + alpha + (p - 1) * gamma_e * count
    t = 0.0
    chunks = _chunks(count, segment)
    for c, (a, b) in enumerate(chunks):
        m = b - a
        slices = partition(m, p)
        mine = slices[0][1] - slices[0][0]  # the root's slice: the first, a longest one
        other = slices[1][1] - slices[1][0]  # the longest slice of the others
        kept = p == 2  # of two ranks, each keeps its own slice out of its slot (_copy_in)
        if c == 0:  # of two, the other rank (the smaller slice) copies in the larger half
            t += beta_e * (m - m // p if kept else m)
        # Wait (1), the slowest fold (the root keeps its slice; the others put theirs back), wait (2).
        t += alpha + max(mine * (p - 1) * gamma_e, other * ((p - 1) * gamma_e + beta_e)) + alpha
        # The root gets every other slice, then puts the next chunk (of two ranks, all but its own slice):
        # it publishes that chunk last.
        nxt = chunks[c + 1][1] - chunks[c + 1][0] if c + 1 < len(chunks) else 0
        t += beta_e * (m - mine + (nxt - -(-nxt // p) if kept else nxt))
    return t


def _reduce_alike(rank, size, count, op, root, segment=None):
    """Ranks alike in :func:`reduce_shm`: the root alone; the others all, or by their slices' lengths."""
    if rank == root:
        return ("root",)
    if count <= min(SMALL, segment_elements(segment)):
        return ()
    return _slice_key((rank - root) % size, size, count, segment)


@algorithm("reduce", "shm",
           cost=lambda p, n, a, b, g: _reduce_time(p, int(n) // COST_ITEMSIZE, a, b * COST_ITEMSIZE,
                                                   g * COST_ITEMSIZE),
           formula="α + nβ + (p-1)nγ up to 16384 elements; else per chunk of m bytes 2α + (2m - ⌈m/p⌉)β "
                   "+ max(⌈m/p⌉(p-1)γ, s((p-1)γ + β)), s the longest slice after the root's; of two ranks "
                   "2α + 2(m - ⌈m/p⌉)β + max(⌈m/p⌉γ, ⌊m/p⌋(γ + β))")
@_alike(_reduce_alike)
def reduce_shm(rank, size, count, op, root, segment=None):
    """Shared-memory reduce: every rank folds a 1/p slice of every rank's slot, and the root copies the slices out.

    Restrictions: one node. Small vectors (at most :data:`SMALL` elements and one
    chunk): each rank puts its vector, and the root waits for all and folds all p slots
    in rank order into its output (one wait). Larger: per chunk, each rank puts the
    chunk, waits for all (1), and folds its slice of the chunk (slices counted from the
    root, which folds the first) from all p slots in rank order; the others put their
    folded slice back into their slot and publish it, and the root waits for them (2)
    and gets every other slice. It is the allreduce without its allgather: only the
    root copies out. The half of a slot chunk k used is written again by chunk k+2,
    after wait (1) of chunk k+1, which the root passes only after its gets of chunk k.
    Of two ranks, each puts only the half of the chunk the other folds (:func:`_copy_in`).
    Cost: α + nβ + (p-1)nγ small; large, per chunk of m bytes, 2α + (2m - ⌈m/p⌉)β +
    max(⌈m/p⌉(p-1)γ, s((p-1)γ + β)), s the longest slice after the root's, and of two
    ranks 2α + 2(m - ⌈m/p⌉)β + max(⌈m/p⌉γ, ⌊m/p⌋(γ + β)) (exact).

    Picture, generated from the schedule (p = 4, count = 8, root = 0, segment = 2): each cell lists, for
    every block of the result, the ranks whose input that rank holds for the whole block (- for none),
    after each round. Redrawn by ``python -m commkit.algorithms._diagram --write``::

        round         rank 0               rank 1   rank 2   rank 3
        0             0    0    0    0     1 1 1 1  2 2 2 2  3 3 3 3
        1             0    0    0    0     1 1 1 1  2 2 2 2  3 3 3 3
        2             0123 0    0    0     1 1 1 1  2 2 2 2  3 3 3 3
        3             0123 0    0    0     1 1 1 1  2 2 2 2  3 3 3 3
        4             0123 0123 0    0     1 1 1 1  2 2 2 2  3 3 3 3
        5             0123 0123 0    0     1 1 1 1  2 2 2 2  3 3 3 3
        6             0123 0123 0123 0     1 1 1 1  2 2 2 2  3 3 3 3
        7             0123 0123 0123 0     1 1 1 1  2 2 2 2  3 3 3 3
        8             0123 0123 0123 0123  1 1 1 1  2 2 2 2  3 3 3 3
        waits         8                    4        4        4
        elems put     8                    12       8        8
        elems got     4                    0        0        0
        elems folded  12                   12       0        0
        critical path (commkit.sim, each term alone): 8 waits, 16 elements copied, 12 folded
    """
    if size == 1:
        yield Copy(("out", 0, count), ("in", 0, count))
        return
    others = _others(rank, size)
    if count <= min(SMALL, segment_elements(segment)):
        # Every rank's vector into its slot; the root folds all slots.
        yield Claim(count, size)
        yield Put(slot(rank, 0, count), ("in", 0, count))
        yield Publish(1)
        if rank == root:
            yield Wait(others, 1)
            yield ReduceSlots(("out", 0, count), [slot(q, 0, count) for q in range(size)], op)
        yield Release()
        return
    chunks = _chunks(count, segment)
    width = chunks[0][1] - chunks[0][0] if chunks else 0
    yield Claim(2 * width, size)
    for c, (a, b) in enumerate(chunks):
        half = (c % 2) * width
        slices = partition(b - a, size)
        lo, hi = slices[(rank - root) % size]
        # Copy in (of two ranks, only the half the other folds), and wait until every rank's is in its slot.
        yield _copy_in(rank, size, half, a, b, lo, hi)
        yield Publish(2 * c + 1)
        yield Wait(others, 2 * c + 1)
        # Fold my slice of every rank's chunk, in rank order (on a non-root, "out" is scratch).
        yield ReduceSlots(("out", a + lo, a + hi), _fold_operands(rank, size, half, a, lo, hi), op)
        if rank != root:
            yield Put(slot(rank, half + lo, half + hi), ("out", a + lo, a + hi))
            yield Publish(2 * c + 2)
            continue
        # The root gathers: every other rank's folded slice out of its slot.
        yield Wait(others, 2 * c + 2)
        for q in others:
            qlo, qhi = slices[(q - root) % size]
            yield Get(("out", a + qlo, a + qhi), slot(q, half + qlo, half + qhi))
    yield Release()


# -- broadcast ----------------------------------------------------------------------------------------

def _broadcast_time(p, count, alpha, beta_e, segment=None):
    """The simulated time of :func:`broadcast_shm`: the root's chunks and the others' acknowledgements."""
    if p == 1 or not count:
        return 0.0
    root_t = late = 0.0
    acks = []
    for c, (a, b) in enumerate(_chunks(count, segment)):
        m = b - a
        if c >= 2:  # the root waits until every rank read the chunk that used this half
            root_t = max(root_t, acks[c - 2]) + alpha
        root_t += beta_e * m
        late = max(late, root_t) + alpha + beta_e * m
        acks.append(late)
    return max(root_t, late)


def _rooted_alike(rank, size, count, root, segment=None):
    """Ranks alike in the broadcast, gather and scatter: the root alone, and every other rank."""
    return rank == root


@algorithm("broadcast", "shm",
           cost=lambda p, n, a, b, g: _broadcast_time(p, int(n) // COST_ITEMSIZE, a, b * COST_ITEMSIZE),
           formula="per chunk of m bytes: the root mβ, every other rank α + mβ after it; from the third chunk "
                   "on the root first waits (α) for the chunk two before to be read; 2nβ + α for one chunk")
@_alike(_rooted_alike)
def broadcast_shm(rank, size, count, root, segment=None, shared=False):
    """Shared-memory broadcast: the root puts each chunk in its slot once, every other rank gets it.

    Restrictions: one node. Per chunk k, the root puts it into half k mod 2 of its slot,
    publishes k+1, and copies it into its own output (not in place) while its peers read
    it, from the cache the put has just read it into; every other rank waits for that,
    gets the chunk, and publishes k+1 itself (its acknowledgement); the root writes a half again (chunk k+2) only
    after every rank acknowledged chunk k. Cost: 2nβ + α for one chunk; in general the
    pipeline of the root's copies in and the others' waits and copies out (exact).

    With ``shared`` (every rank's arrays are shared arrays): every other rank gets the
    root's input where it lies, in one copy, while the root copies it into its own output,
    and the root waits until all have: 2α + nβ.

    Picture, generated from the schedule (p = 4, count = 8, root = 0, segment = 2): each cell lists, for
    every block of the result, the ranks whose input that rank holds for the whole block (- for none),
    after each round. Redrawn by ``python -m commkit.algorithms._diagram --write``::

        round      rank 0   rank 1   rank 2   rank 3
        0          0 0 0 0  - - - -  - - - -  - - - -
        1          0 0 0 0  0 - - -  0 - - -  0 - - -
        2          0 0 0 0  0 0 - -  0 0 - -  0 0 - -
        3          0 0 0 0  0 0 0 -  0 0 0 -  0 0 0 -
        4          0 0 0 0  0 0 0 0  0 0 0 0  0 0 0 0
        waits      2        4        4        4
        elems put  8        0        0        0
        elems got  0        8        8        8
        critical path (commkit.sim, each term alone): 4 waits, 10 elements copied
    """
    if size == 1:
        yield Copy(("out", 0, count), ("in", 0, count))
        return
    # The root's own copy into its output (none in place) comes after what its peers wait for: they read
    # meanwhile, and chunk by chunk it reads its input where the Put has just read it, in the cache.
    others = _others(root, size) if rank == root else None  # only the root names every other rank
    if shared:
        yield Claim(0, size, shared=True)
        if rank == root:
            yield Publish(1)
            yield Copy(("out", 0, count), ("in", 0, count))
            yield Wait(others, 2)  # every rank has read my input: the caller may write it again
        else:
            yield Wait([root], 1)
            yield Get(("out", 0, count), peer(root, "in", 0, count))
            yield Publish(2)
        yield Release()
        return
    chunks = _chunks(count, segment)
    width = chunks[0][1] - chunks[0][0] if chunks else 0
    yield Claim(2 * width, size)
    for c, (a, b) in enumerate(chunks):
        half = (c % 2) * width
        if rank == root:
            if c >= 2:
                yield Wait(others, c - 1)  # every rank has read chunk c-2, which used this half
            yield Put(slot(root, half, half + b - a), ("in", a, b))
            yield Publish(c + 1)
            yield Copy(("out", a, b), ("in", a, b))
        else:
            yield Wait([root], c + 1)
            yield Get(("out", a, b), slot(root, half, half + b - a))
            yield Publish(c + 1)
    yield Release()


# -- allgather ----------------------------------------------------------------------------------------

@algorithm("allgather", "shm",
           cost=lambda p, n, a, b, g: 0.0 if p == 1 else (
               len(_chunks(int(n) // COST_ITEMSIZE // p, None)) * a + n * b),
           formula="Kα + nβ, K the chunks of one block, n the bytes gathered", symmetry="rotation")
def allgather_shm(rank, size, count, segment=None, shared=False):
    """Shared-memory allgather: each rank puts its block in its slot, every rank gets every other block.

    Restrictions: one node. Per chunk k of the blocks: put my chunk into half k mod 2
    of my slot, publish k+1, copy it into my own block of the output (from the cache
    the put has just read it into), wait for all, get every other rank's chunk. A half is
    written again (chunk k+2) after the wait of chunk k+1, which every rank passes
    only after its gets of chunk k. Cost: Kα + nβ, K chunks, n the bytes gathered (exact).

    With ``shared`` (every rank's arrays are shared arrays): every rank gets every other
    rank's input where it lies, and waits until all have read its own: 2α + nβ.

    Picture, generated from the schedule (p = 4, count = 1, segment = 2): each cell lists, for every
    block of the result, the ranks whose input that rank holds for the whole block (- for none), after
    each round. Redrawn by ``python -m commkit.algorithms._diagram --write``::

        round      rank 0   rank 1   rank 2   rank 3
        0          0 - - -  - 1 - -  - - 2 -  - - - 3
        1          0 1 2 3  0 1 2 3  0 1 2 3  0 1 2 3
        waits      1        1        1        1
        elems put  1        1        1        1
        elems got  3        3        3        3
        critical path (commkit.sim, each term alone): 1 wait, 4 elements copied
    """
    mine = ("out", rank * count, (rank + 1) * count)
    if size == 1:
        yield Copy(mine, ("in", 0, count))
        return
    # My own block goes into my output after what my peers wait for (as the broadcast's root does): they
    # read meanwhile, and chunk by chunk I read my input where the Put has just read it, in the cache.
    if shared:
        others = _others(rank, size)
        yield Claim(0, size, shared=True)
        yield Publish(1)
        yield Copy(mine, ("in", 0, count))
        yield Wait(others, 1)
        for q in others:
            yield Get(("out", q * count, (q + 1) * count), peer(q, "in", 0, count))
        yield Publish(2)
        yield Wait(others, 2)  # every peer has read my input: the caller may write it again
        yield Release()
        return
    chunks = _chunks(count, segment)
    width = chunks[0][1] - chunks[0][0] if chunks else 0
    others = _others(rank, size)
    yield Claim(2 * width, size)
    for c, (a, b) in enumerate(chunks):
        half = (c % 2) * width
        yield Put(slot(rank, half, half + b - a), ("in", a, b))
        yield Publish(c + 1)
        yield Copy(("out", rank * count + a, rank * count + b), ("in", a, b))
        yield Wait(others, c + 1)
        for q in others:
            yield Get(("out", q * count + a, q * count + b), slot(q, half, half + b - a))
    yield Release()


# -- gather -------------------------------------------------------------------------------------------

def _gather_time(p, count, alpha, beta_e, segment=None):
    """The simulated time of :func:`gather_shm`: the others' chunks and the root's waits and copies out."""
    if p == 1 or not count:
        return 0.0
    root_t = put = 0.0
    read = []
    for c, (a, b) in enumerate(_chunks(count, segment)):
        m = b - a
        if c >= 2:  # every other rank waits until the root read the chunk that used this half
            put = max(put, read[c - 2]) + alpha
        put += beta_e * m
        root_t = max(root_t, put) + alpha + (p - 1) * beta_e * m
        read.append(root_t)
    return max(root_t, put)


@algorithm("gather", "shm",
           cost=lambda p, n, a, b, g: _gather_time(p, int(n) // COST_ITEMSIZE // p, a, b * COST_ITEMSIZE),
           formula="per chunk of m bytes of a block: every other rank mβ, the root α + (p-1)mβ after it; from "
                   "the third chunk on the others first wait (α) for the root to read the chunk two before; "
                   "α + nβ for one chunk, n the bytes gathered")
@_alike(_rooted_alike)
def gather_shm(rank, size, count, root, segment=None):
    """Shared-memory gather: every rank puts its block in its slot, the root gets every block.

    Restrictions: one node. The broadcast reversed. Per chunk k of the blocks, every
    other rank puts its chunk into half k mod 2 of its slot and publishes k+1; the root
    waits for all, gets every chunk, and publishes k+1 itself (it has read chunk k); a
    rank writes a half again (chunk k+2) only after the root has read chunk k. Cost:
    α + nβ for one chunk; in general the pipeline of the others' copies in and the
    root's waits and copies out (exact).

    Picture, generated from the schedule (p = 4, count = 1, root = 0, segment = 2): each cell lists, for
    every block of the result, the ranks whose input that rank holds for the whole block (- for none),
    after each round. Redrawn by ``python -m commkit.algorithms._diagram --write``::

        round      rank 0   rank 1   rank 2   rank 3
        0          0 - - -  - 1 - -  - - 2 -  - - - 3
        1          0 1 2 3  - 1 - -  - - 2 -  - - - 3
        waits      1        0        0        0
        elems put  0        1        1        1
        elems got  3        0        0        0
        critical path (commkit.sim, each term alone): 1 wait, 4 elements copied
    """
    if rank == root:
        yield Copy(("out", root * count, (root + 1) * count), ("in", 0, count))
    if size == 1:
        return
    chunks = _chunks(count, segment)
    width = chunks[0][1] - chunks[0][0] if chunks else 0
    others = _others(root, size) if rank == root else None  # only the root names every other rank
    yield Claim(2 * width, size)
    for c, (a, b) in enumerate(chunks):
        half = (c % 2) * width
        if rank == root:
            yield Wait(others, c + 1)
            for q in others:
                yield Get(("out", q * count + a, q * count + b), slot(q, half, half + b - a))
            yield Publish(c + 1)
        else:
            if c >= 2:
                yield Wait([root], c - 1)  # the root has read chunk c-2, which used this half
            yield Put(slot(rank, half, half + b - a), ("in", a, b))
            yield Publish(c + 1)
    yield Release()


# -- scatter ------------------------------------------------------------------------------------------

def _scatter_time(p, count, alpha, beta_e, segment=None):
    """The simulated time of :func:`scatter_shm`: the root's chunks and the others' acknowledgements."""
    if p == 1 or not count:
        return 0.0
    root_t = late = 0.0
    read = []
    for c, (a, b) in enumerate(_piece_chunks(count, p - 1, segment)):
        m = b - a
        if c >= 2:  # the root waits until every rank read the chunk that used this half
            root_t = max(root_t, read[c - 2]) + alpha
        root_t += (p - 1) * beta_e * m
        late = max(late, root_t) + alpha + beta_e * m
        read.append(late)
    return max(root_t, late)


@algorithm("scatter", "shm",
           cost=lambda p, n, a, b, g: _scatter_time(p, int(n) // COST_ITEMSIZE // p, a, b * COST_ITEMSIZE),
           formula="per chunk of m bytes of a block: the root (p-1)mβ, every other rank α + mβ after it; from "
                   "the third chunk on the root first waits (α) for the chunk two before to be read; "
                   "α + nβ for one chunk, n the bytes of the root's input")
@_alike(_rooted_alike)
def scatter_shm(rank, size, count, root, segment=None):
    """Shared-memory scatter: the root puts every other rank's block in its slot once, each rank gets its own.

    Restrictions: one node. The broadcast with a block per rank. Every block is cut
    into K pieces; chunk k is piece k of every other rank's block, laid side by side
    in half k mod 2 of the root's slot. Per chunk, the root puts it and publishes k+1;
    every other rank waits for that, gets its piece, and publishes k+1 itself (its
    acknowledgement); the root writes a half again (chunk k+2) only after every rank
    acknowledged chunk k. Cost: α + nβ for one chunk; in general the pipeline of the
    root's copies in and the others' waits and copies out (exact).

    Picture, generated from the schedule (p = 4, count = 1, root = 0, segment = 2): each cell lists, for
    every block of the result, the ranks whose input that rank holds for the whole block (- for none),
    after each round. Redrawn by ``python -m commkit.algorithms._diagram --write``::

        round      rank 0   rank 1   rank 2   rank 3
        0          0 0 0 0  - - - -  - - - -  - - - -
        1          0 0 0 0  - 0 - -  - - 0 -  - - - 0
        waits      0        1        1        1
        elems put  3        0        0        0
        elems got  0        1        1        1
        critical path (commkit.sim, each term alone): 1 wait, 4 elements copied
    """
    if rank == root:
        yield Copy(("out", 0, count), ("in", root * count, (root + 1) * count))
    if size == 1:
        return
    pieces = _piece_chunks(count, size - 1, segment)
    others = _others(root, size) if rank == root else None  # only the root names every other rank
    width = (size - 1) * (pieces[0][1] - pieces[0][0]) if pieces else 0
    yield Claim(2 * width, size)
    for c, (a, b) in enumerate(pieces):
        half = (c % 2) * width
        m = b - a
        if rank == root:
            if c >= 2:
                yield Wait(others, c - 1)  # every rank has read chunk c-2, which used this half
            for j, q in enumerate(others):
                yield Put(slot(root, half + j * m, half + (j + 1) * m), ("in", q * count + a, q * count + b))
            yield Publish(c + 1)
        else:
            j = rank - (rank > root)  # my place among the others, the root left out
            yield Wait([root], c + 1)
            yield Get(("out", a, b), slot(root, half + j * m, half + (j + 1) * m))
            yield Publish(c + 1)
    yield Release()


# -- reduce_scatter -----------------------------------------------------------------------------------

def _reduce_scatter_chunks(counts, size, segment):
    """How many chunks the blocks go through the arena in: each chunk holds one piece of every block."""
    largest = max(counts) if counts else 0
    if not largest:
        return 0
    piece = max(1, segment_elements(segment) // size)
    return -(-largest // piece)


def _reduce_scatter_time(p, n, alpha, beta, gamma):
    """:func:`reduce_scatter_shm`'s simulated time for equal blocks (a lower bound otherwise)."""
    if p == 1 or not n:
        return 0.0
    block = -(-(int(n) // COST_ITEMSIZE) // p)  # an average block, rounded up: the largest when all are equal
    k = _reduce_scatter_chunks((block,) * p, p, None)
    return k * alpha + (p - 1) / p * n * (beta + gamma)  # each rank copies in the blocks the others fold


def _reduce_scatter_alike(rank, size, counts, op, segment=None):
    """Ranks alike in :func:`reduce_scatter_shm`: those whose blocks are equally long (they fold equal pieces),
    and whose copies in, of every other block in rank order, are too."""
    return counts[rank], tuple(counts[:rank]) + tuple(counts[rank + 1:])


@algorithm("reduce_scatter", "shm", cost=lambda p, n, a, b, g: _reduce_scatter_time(p, n, a, b, g),
           formula="Kα + ((p-1)/p)n(β + γ), K the chunks, n the bytes of one rank's input",
           cost_exact="even", cost_bound="lower")
@_alike(_reduce_scatter_alike)
def reduce_scatter_shm(rank, size, counts, op, segment=None, shared=False):
    """Shared-memory reduce-scatter: each rank folds its own block from every rank's slot, straight into its output.

    Restrictions: one node. Every block is cut into K pieces; chunk k is piece k of every
    block, laid side by side in half k mod 2 of each rank's slot. Per chunk: put it but
    my own block's piece, publish k+1, wait for all, fold my piece from my input and
    every other rank's chunk, in rank order, into my output. A half is written again
    (chunk k+2) after the wait of chunk k+1, which every rank passes only after its
    fold of chunk k. Cost: Kα + ((p-1)/p)n(β + γ)
    for equal blocks; otherwise the largest block sets each chunk's fold (a lower bound).

    With ``shared`` (every rank's arrays are shared arrays): each rank folds its block of
    every rank's input where it lies into its output, and waits until every rank has
    folded: no copy at all, 2α + ((p-1)/p)nγ for equal blocks.

    Picture, generated from the schedule (p = 4, count = (2, 2, 2, 2), segment = 2): each cell lists,
    for every block of the result, the ranks whose input that rank holds for the whole block (- for
    none), after each round. Redrawn by ``python -m commkit.algorithms._diagram --write``::

        round         rank 0      rank 1      rank 2      rank 3
        0             0    0 0 0  1 1    1 1  2 2 2    2  3 3 3 3
        1             0    0 0 0  1 1    1 1  2 2 2    2  3 3 3 3
        2             0123 0 0 0  1 0123 1 1  2 2 0123 2  3 3 3 0123
        waits         2           2           2           2
        elems put     6           6           6           6
        elems folded  6           6           6           6
        critical path (commkit.sim, each term alone): 2 waits, 6 elements copied, 6 folded
    """
    offsets = block_offsets(counts)
    if size == 1:
        yield Copy(("out", 0, counts[0]), ("in", 0, counts[0]))
        return
    others = _others(rank, size)
    if shared:
        lo, hi = offsets[rank], offsets[rank] + counts[rank]
        yield Claim(0, size, shared=True)
        yield Publish(1)
        yield Wait(others, 1)
        yield ReduceSlots(("out", 0, hi - lo), [("in", lo, hi) if q == rank else peer(q, "in", lo, hi)
                                                for q in range(size)], op)
        yield Publish(2)
        yield Wait(others, 2)  # every peer has folded its block of my input: the caller may write it again
        yield Release()
        return
    k = _reduce_scatter_chunks(counts, size, segment)
    pieces = [partition(n, k) if k else () for n in counts]
    width = max((sum(pieces[q][c][1] - pieces[q][c][0] for q in range(size)) for c in range(k)), default=0)
    yield Claim(2 * width, size)
    for c in range(k):
        half = (c % 2) * width
        # Chunk c: piece c of every block, side by side.
        at = half
        mine = None
        for q in range(size):
            lo, hi = pieces[q][c]
            if q == rank:  # my own piece I fold from my input, where it lies: the others' only go in
                mine = (at, lo, hi)
            elif hi > lo:
                yield Put(slot(rank, at, at + hi - lo), ("in", offsets[q] + lo, offsets[q] + hi))
            at += hi - lo
        yield Publish(c + 1)
        yield Wait(others, c + 1)
        at, lo, hi = mine
        own = ("in", offsets[rank] + lo, offsets[rank] + hi)
        yield ReduceSlots(("out", lo, hi), [own if q == rank else slot(q, at, at + hi - lo) for q in range(size)],
                          op)
    yield Release()


# -- alltoall -----------------------------------------------------------------------------------------

@algorithm("alltoall", "shm",
           cost=lambda p, n, a, b, g: 0.0 if p == 1 else (
               len(_piece_chunks(int(n) // COST_ITEMSIZE, p - 1, None)) * a + 2 * (p - 1) * n * b),
           formula="Kα + 2(p-1)nβ, K the chunks, n the bytes of one block", symmetry="rotation")
@_in_chunks
def alltoall_shm(rank, size, count, segment=None, shared=False):
    """Shared-memory alltoall: each rank puts every block it sends in its slot, each rank gets the blocks for it.

    Restrictions: one node. Every block is cut into K pieces; chunk k is piece k of
    every block a rank sends to another, laid side by side in destination order in
    half k mod 2 of its slot. Per chunk: put it, publish k+1, wait for all, get my
    piece from every other rank's slot. A half is written again (chunk k+2) after the
    wait of chunk k+1, which every rank passes only after its gets of chunk k. Cost:
    Kα + 2(p-1)nβ, n the bytes of one block (exact).

    With ``shared`` (every rank's arrays are shared arrays): each rank gets the block for
    it from every other rank's input where it lies, and waits until every rank has read
    its own: 2α + (p-1)nβ.

    Picture, generated from the schedule (p = 4, count = 1, segment = 2): each cell lists, for every
    block of the result, the ranks whose input that rank holds for the whole block (- for none), after
    each round. Redrawn by ``python -m commkit.algorithms._diagram --write``::

        round      rank 0   rank 1   rank 2   rank 3
        0          0 - - -  - 1 - -  - - 2 -  - - - 3
        1          0 1 2 3  0 1 2 3  0 1 2 3  0 1 2 3
        waits      1        1        1        1
        elems put  3        3        3        3
        elems got  3        3        3        3
        critical path (commkit.sim, each term alone): 1 wait, 6 elements copied
    """
    mine = Copy(("out", rank * count, (rank + 1) * count), ("in", rank * count, (rank + 1) * count))
    if size == 1:
        return _Chunks((mine,), (), None, ())
    others = _others(rank, size)
    if shared:
        gets = tuple(Get(("out", q * count, (q + 1) * count), peer(q, "in", rank * count, (rank + 1) * count))
                     for q in others)
        return _Chunks((mine, Claim(0, size, shared=True), Publish(1), Wait(others, 1), *gets, Publish(2),
                        Wait(others, 2), Release()), (), None, ())
    pieces = _piece_chunks(count, size - 1, segment)
    width = (size - 1) * (pieces[0][1] - pieces[0][0]) if pieces else 0

    def chunk(c, a, b):
        half = (c % 2) * width
        m = b - a
        # Chunk c: piece c of the block for every other rank, in rank order.
        for j, d in enumerate(others):
            yield Put(slot(rank, half + j * m, half + (j + 1) * m), ("in", d * count + a, d * count + b))
        yield Publish(c + 1)
        yield Wait(others, c + 1)
        # My piece sits in rank q's slot where q put the pieces for the ranks below me (all but q itself).
        for q in others:
            j = rank if rank < q else rank - 1
            yield Get(("out", q * count + a, q * count + b), slot(q, half + j * m, half + (j + 1) * m))

    return _Chunks((mine, Claim(2 * width, size)), pieces, chunk, (Release(),))


# -- barrier ------------------------------------------------------------------------------------------

@algorithm("barrier", "shm", cost=lambda p, n, a, b, g: a if p > 1 else 0.0, formula="α", symmetry="rotation")
def barrier_shm(rank, size):
    """Shared-memory barrier: every rank publishes, then waits until every other rank has.

    Restrictions: one node. Cost: α (one wait on p-1 counters).

    Picture, generated from the schedule (p = 4, count = 0): each cell lists the ranks a rank has heard
    from, directly or not, after each round. Redrawn by ``python -m commkit.algorithms._diagram
    --write``::

        round  rank 0  rank 1  rank 2  rank 3
        0      0       1       2       3
        1      0123    0123    0123    0123
        waits  1       1       1       1
        critical path (commkit.sim, each term alone): 1 wait, 0 elements copied
    """
    if size == 1:
        return
    yield Claim(0, size)
    yield Publish(1)
    yield Wait(_others(rank, size), 1)
    yield Release()
