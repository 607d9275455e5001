"""Recursive halving and doubling: log2(p) rounds of pairwise exchanges with rank XOR mask.

Recursive doubling doubles what each rank knows every round (small-message
allreduce, allgather, scan); recursive halving halves what each rank is
responsible for (reduce-scatter). Rabenseifner's allreduce is the two
composed: a halving reduce-scatter, then a doubling allgather; his reduce is
the halving reduce-scatter followed by a binomial gather to the root.

Non-powers of two are folded in and out as MPICH does: with pof2 the largest
power of two <= p and rem = p - pof2, each even rank below 2*rem first hands
its data to the odd rank above it and sits out; the remaining pof2 ranks run
the power-of-two algorithm under new ranks (odd rank i < 2*rem becomes i//2,
rank i >= 2*rem becomes i - rem); finally each odd rank gives its even
partner the result. New ranks keep the order of the ranks they stand for, so
non-commutative ops stay in rank order where the algorithm allows them.
"""

from __future__ import annotations

from ..schedule import TRANSFER, Copy, Exchange, Recv, Reduce, Send, partition
from . import algorithm, log2ceil
from ._blocks import block_offsets


def fold(size):
    pof2 = 1 << (size.bit_length() - 1)
    return pof2, size - pof2


def new_rank(rank, rem):
    if rank < 2 * rem:
        return rank // 2 if rank % 2 else -1
    return rank - rem


def old_rank(new, rem):
    return 2 * new + 1 if new < rem else new + rem


def lg(p):
    return p.bit_length() - 1


def _fold_in(rank, rem, op, mine, whole, incoming):
    """The fold of an allreduce for p not a power of two (module docstring); returns where my data now is.

    The even rank of a pair below ``2 * rem`` hands ``mine`` to the odd rank above
    it and waits for the result in ``whole``: None, it takes no other part. The odd
    rank folds its partner's vector in: ``whole``. Any other rank: ``mine``.
    """
    if rank >= 2 * rem:
        return mine
    if rank % 2 == 0:
        # Even rank of a folded pair: hand my vector up, wait for the result.
        yield Send(rank + 1, mine)
        yield Recv(rank + 1, whole)
        return None
    yield Recv(rank - 1, incoming)
    yield Reduce(whole, incoming, op, operand_first=True, src=mine)
    return whole


def doubling_rounds(new: int, pof2: int, rem: int) -> list[tuple[int, int]]:
    """The rounds of recursive doubling for new rank ``new`` among ``pof2``: ``(mask, partner)`` each.

    Round ``mask`` = 1, 2, 4, ... pairs ``new`` with new rank ``new ^ mask``;
    ``partner`` is the actual rank that stands for it. Recursive halving runs
    the same rounds in reverse order.
    """
    return [(1 << k, old_rank(new ^ (1 << k), rem)) for k in range(lg(pof2))]


# -- cost helpers (the closed forms of what the schedules below do; tests/test_sim.py checks them) --


def _fold_blocks(p):
    """Blocks (of n/p bytes) on the critical path of a folded recursive doubling or halving.

    With p' = 2^⌊log p⌋ and r = p - p', new rank i < r stands for two ranks. New rank 0
    holds the largest group in every round: 2^k + min(r, 2^k) blocks in the round of
    distance 2^k, so the rounds move p' - 1 + R blocks, R = Σₖ min(r, 2^k).
    """
    r = p - (1 << lg(p))
    return sum((1 << k) + min(r, 1 << k) for k in range(lg(p)))


def _scan_cost(p, n, a, b, g, inclusive):
    """The longer of the two critical paths of the recursive-doubling scan.

    With q = ⌈log p⌉ and t = p - 2^(q-1), the longest path through all q rounds
    reduces q + 1 + ⌊log t⌋ times (inclusive; one fewer for exscan, whose first
    contribution to the result is a copy), and the path inside the first 2^(q-1)
    ranks reduces twice in each of its q - 1 rounds. For p a power of two the
    first is q(α + nβ + 2nγ).
    """
    if p == 1:
        return 0.0
    q = log2ceil(p)
    t = p - (1 << (q - 1))
    skip = 0 if inclusive else 1
    full = q * (a + n * b) + (q + 1 + lg(t) - skip) * n * g
    inner = (q - 1) * (a + n * b) + max(2 * (q - 1) - skip, 0) * n * g
    return max(full, inner)


_FOLD = "p' = 2^⌊log p⌋, R = Σₖ min(p-p', 2ᵏ)"


@algorithm("allreduce", "recursive_doubling", scratch=lambda r, p, n: n,
           cost=lambda p, n, a, b, g: lg(p) * (a + n * b + n * g)
           + (0 if p & (p - 1) == 0 else 2 * (a + n * b) + n * g),
           formula="⌊log p⌋(α+nβ+nγ) (+ 2(α+nβ)+nγ when p is not a power of two)", symmetry="xor")
def allreduce_recursive_doubling(rank, size, count, op):
    """Recursive-doubling allreduce: each round, swap whole vectors with rank XOR mask and reduce.

    Restrictions: none (any op; rank order is kept). Non-powers of two are folded.
    Cost: ⌊log p⌋(α + nβ + nγ), plus 2(α + nβ) + nγ for the fold. Best for small messages.
    Optimised away from the textbook form (copy the input into the output, then ``out = out (op)
    received`` each round): the first round sends straight from "in" and its reduction reads "in"
    and writes "out" in one step (``Reduce(src=...)``), so the whole input is never copied.

    Picture, generated from the schedule (p = 4, count = 8): each cell lists, for every block of the
    result, the ranks whose input that rank holds for the whole block (- for none), after each round.
    Redrawn by ``python -m commkit.algorithms._diagram --write``::

        round          rank 0               rank 1               rank 2               rank 3
        0              0    0    0    0     1    1    1    1     2    2    2    2     3    3    3    3
        1              01   01   01   01    01   01   01   01    23   23   23   23    23   23   23   23
        2              0123 0123 0123 0123  0123 0123 0123 0123  0123 0123 0123 0123  0123 0123 0123 0123
        msgs sent      2                    2                    2                    2
        elems sent     16                   16                   16                   16
        elems reduced  16                   16                   16                   16
        critical path (commkit.sim, each term alone): 2 messages, 16 elements sent, 16 reduced
    """
    whole, incoming, mine = ("out", 0, count), ("tmp", 0, count), ("in", 0, count)
    if size == 1:
        yield Copy(whole, mine)
        return
    pof2, rem = fold(size)
    new = new_rank(rank, rem)
    current = yield from _fold_in(rank, rem, op, mine, whole, incoming)  # my partial result
    if current is None:
        return
    for _, partner in doubling_rounds(new, pof2, rem):
        # Swap partial results with my partner; the lower one goes on the left.
        yield Exchange(partner, current, partner, incoming)
        yield Reduce(whole, incoming, op, operand_first=partner < rank, src=current)
        current = whole
    if rank < 2 * rem:
        yield Send(rank - 1, whole)


def span(ranges, first, last):
    """Elements covered by consecutive ranges[first:last] (which are contiguous)."""
    if first >= last:
        return 0, 0
    return ranges[first][0], ranges[last - 1][1]


def halving_reduce_scatter(new, pof2, rem, ranges, buf, op, first=None):
    """Recursive halving among new ranks; afterwards new rank i holds ranges[i] of ``buf`` reduced.

    ``first`` names the buffer holding this rank's data before the first round
    (default ``buf``): the first round reads it and writes ``buf``.
    """
    lo, hi = 0, pof2
    source = first or buf
    for mask, partner in reversed(doubling_rounds(new, pof2, rem)):
        mid = (lo + hi) // 2
        if new & mask:
            keep, give = (mid, hi), (lo, mid)
        else:
            keep, give = (lo, mid), (mid, hi)
        klo, khi = span(ranges, *keep)
        glo, ghi = span(ranges, *give)
        # Send the half my partner keeps; receive its share of the half I keep.
        yield Exchange(partner, (source, glo, ghi), partner, ("tmp", 0, khi - klo))
        yield Reduce((buf, klo, khi), ("tmp", 0, khi - klo), op, src=(source, klo, khi))
        source = buf
        lo, hi = keep


def _doubling_allgather(new, pof2, rem, ranges, buf):
    """Recursive doubling among new ranks; new rank i starts with ranges[i] of ``buf``, ends with all."""
    lo, hi = new, new + 1
    for mask, partner in doubling_rounds(new, pof2, rem):
        if new & mask:
            theirs = (lo - mask, lo)
        else:
            theirs = (hi, hi + mask)
        # Swap everything gathered so far with the partner's adjacent, equal-sized range.
        yield Exchange(partner, (buf, *span(ranges, lo, hi)), partner, (buf, *span(ranges, *theirs)))
        lo, hi = min(lo, theirs[0]), max(hi, theirs[1])


def _allreduce_rabenseifner_cost(p, n, a, b, g):
    pof2 = 1 << lg(p)
    return (2 * lg(p) * a + 2 * (pof2 - 1) / pof2 * n * b + (pof2 - 1) / pof2 * n * g
            + (0 if p == pof2 else 2 * (a + n * b) + n * g))


_RABENSEIFNER = "2⌊log p⌋α + 2((p'-1)/p')nβ + ((p'-1)/p')nγ (+ 2(α+nβ)+nγ when p ≠ p'); p' = 2^⌊log p⌋"


@algorithm("allreduce", "rabenseifner", commutative=True, scratch=lambda r, p, n: n,
           cost=_allreduce_rabenseifner_cost, formula=_RABENSEIFNER, cost_exact="even", cost_bound="lower",
           symmetry="xor")
def allreduce_rabenseifner(rank, size, count, op):
    """Rabenseifner's allreduce: recursive-halving reduce-scatter, then recursive-doubling allgather.

    Restrictions: commutative op. Non-powers of two are folded.
    Cost: 2⌊log p⌋α + 2((p'-1)/p')nβ + ((p'-1)/p')nγ, plus 2(α + nβ) + nγ for the fold when
    p ≠ p' = 2^⌊log p⌋; exact when count is a multiple of p', a lower bound otherwise.
    Best for large messages at larger p: the ring's bandwidth with a logarithmic latency term.
    Optimised away from the textbook form (``allreduce_rabenseifner_textbook``), which first
    copies the input into the output and works there: the fold and the first halving round read
    "in" and write "out" in one step (``Reduce(src=...)``), and the first round sends straight
    from "in", so the whole input is never copied; same messages, same cost.

    Picture, generated from the schedule (p = 4, count = 8): each cell lists, for every block of the
    result, the ranks whose input that rank holds for the whole block (- for none), after each round.
    Redrawn by ``python -m commkit.algorithms._diagram --write``::

        round          rank 0               rank 1               rank 2               rank 3
        0              0    0    0    0     1    1    1    1     2    2    2    2     3    3    3    3
        1              02   02   0    0     13   13   1    1     2    2    02   02    3    3    13   13
        2              0123 02   0    0     13   0123 1    1     2    2    0123 02    3    3    13   0123
        3              0123 0123 0    0     0123 0123 1    1     2    2    0123 0123  3    3    0123 0123
        4              0123 0123 0123 0123  0123 0123 0123 0123  0123 0123 0123 0123  0123 0123 0123 0123
        msgs sent      4                    4                    4                    4
        elems sent     12                   12                   12                   12
        elems reduced  6                    6                    6                    6
        critical path (commkit.sim, each term alone): 4 messages, 12 elements sent, 6 reduced
    """
    whole, incoming, mine = ("out", 0, count), ("tmp", 0, count), ("in", 0, count)
    if size == 1:
        yield Copy(whole, mine)
        return
    pof2, rem = fold(size)
    new = new_rank(rank, rem)
    held = yield from _fold_in(rank, rem, op, mine, whole, incoming)
    if held is None:
        return
    first = held[0]  # the buffer my data is in: "in", or "out" where the fold reduced into it
    ranges = partition(count, pof2)
    # Phase 1: reduce-scatter by recursive halving; new rank i then owns ranges[i].
    yield from halving_reduce_scatter(new, pof2, rem, ranges, "out", op, first)
    # Phase 2: allgather the reduced ranges by recursive doubling.
    yield from _doubling_allgather(new, pof2, rem, ranges, "out")
    if rank < 2 * rem:
        yield Send(rank - 1, whole)


@algorithm("allreduce", "rabenseifner_textbook", commutative=True, scratch=lambda r, p, n: n,
           cost=_allreduce_rabenseifner_cost, formula=_RABENSEIFNER, cost_exact="even", cost_bound="lower",
           symmetry="xor")
def allreduce_rabenseifner_textbook(rank, size, count, op):
    """Rabenseifner's allreduce as the textbook writes it: copy the input into the output, then work there.

    The same fold, recursive halving and recursive doubling as ``allreduce_rabenseifner``,
    without its optimisation: every step sends from and reduces into "out"
    (``out = out (op) received``), as in Rabenseifner's and Thakur, Rabenseifner and Gropp's
    description. Not in the selection table: force it with ``algorithm="rabenseifner_textbook"``.
    Restrictions: commutative op. Non-powers of two are folded (the module docstring).
    Cost: 2⌊log p⌋α + 2((p'-1)/p')nβ + ((p'-1)/p')nγ, plus 2(α + nβ) + nγ for the fold when
    p ≠ p' = 2^⌊log p⌋, as ``allreduce_rabenseifner`` (the simulator counts copies as free);
    exact when count is a multiple of p', a lower bound otherwise.

    Picture, generated from the schedule (p = 4, count = 8): each cell lists, for every block of the
    result, the ranks whose input that rank holds for the whole block (- for none), after each round.
    Redrawn by ``python -m commkit.algorithms._diagram --write``::

        round          rank 0               rank 1               rank 2               rank 3
        0              0    0    0    0     1    1    1    1     2    2    2    2     3    3    3    3
        1              02   02   0    0     13   13   1    1     2    2    02   02    3    3    13   13
        2              0123 02   0    0     13   0123 1    1     2    2    0123 02    3    3    13   0123
        3              0123 0123 0    0     0123 0123 1    1     2    2    0123 0123  3    3    0123 0123
        4              0123 0123 0123 0123  0123 0123 0123 0123  0123 0123 0123 0123  0123 0123 0123 0123
        msgs sent      4                    4                    4                    4
        elems sent     12                   12                   12                   12
        elems reduced  6                    6                    6                    6
        critical path (commkit.sim, each term alone): 4 messages, 12 elements sent, 6 reduced
    """
    whole, incoming = ("out", 0, count), ("tmp", 0, count)
    yield Copy(whole, ("in", 0, count))
    if size == 1:
        return
    pof2, rem = fold(size)
    new = new_rank(rank, rem)
    if (yield from _fold_in(rank, rem, op, whole, whole, incoming)) is None:
        return  # the even rank of a folded pair: its partner worked for both and sent it the result
    ranges = partition(count, pof2)
    # Phase 1: reduce-scatter by recursive halving; new rank i then owns ranges[i] of "out".
    yield from halving_reduce_scatter(new, pof2, rem, ranges, "out", op)
    # Phase 2: allgather the reduced ranges by recursive doubling.
    yield from _doubling_allgather(new, pof2, rem, ranges, "out")
    if rank < 2 * rem:
        yield Send(rank - 1, whole)


def _relabelled(steps, rank_of):
    """The steps of a schedule written for relative ranks, every peer turned into a real rank.

    Only exchanges are expected (the recursive halving of :mod:`.recursive_halving`).
    """
    for step in steps:
        if step.kind == TRANSFER:
            assert isinstance(step, Exchange), step
            (to, send), (frm, recv) = step.sends[0], step.recvs[0]
            yield Exchange(rank_of(to), send, rank_of(frm), recv, overlap=step.overlap)
        else:
            yield step


def _rabenseifner_reduce_cost(p, n, a, b, g):
    if p == 1 or n <= 0:
        return 0.0
    rounds = lg(p)
    pof2 = 1 << rounds
    folding = 0.0 if pof2 == p else a + n * b + n * g
    return folding + 2 * rounds * a + (pof2 - 1) / pof2 * n * (2 * b + g)


@algorithm("reduce", "rabenseifner", commutative=True, scratch=lambda r, p, n: n,
           cost=_rabenseifner_reduce_cost,
           formula="2⌊log p⌋α + ((p'-1)/p')n(2β+γ) (+ α+nβ+nγ when p ≠ p'); p' = 2^⌊log p⌋",
           cost_exact="even", cost_bound="lower")
def reduce_rabenseifner(rank, size, count, op, root):
    """Rabenseifner's reduce: a recursive-halving reduce-scatter, then a binomial gather of the blocks to the root.

    Restrictions: commutative op. Any p, root and count.
    Ranks are taken relative to the rank after the root, rel = (rank - root - 1) mod p, so the
    root is rel p-1, which MPICH's fold of a non-power-of-two p never sets aside: with
    p' = 2^⌊log p⌋ and r = p - p', each even rel < 2r first hands its vector to the odd rel
    above it and sits out (the module docstring); the p' others reduce-scatter by recursive
    halving, new rank i ending with block i of p', and gather the blocks towards new rank p'-1
    (the root), a doubling range each round.
    Cost: 2⌊log p⌋α + ((p'-1)/p')n(2β + γ), plus α + nβ + nγ for the fold when p ≠ p'; exact
    when count is a multiple of p', a lower bound otherwise. Against the binomial reduce's
    ⌈log p⌉(α + nβ + nγ) it moves and reduces about n bytes per rank instead of n⌈log p⌉:
    the large-message reduce.
    Messages: the fold's one, ⌊log p⌋ exchanges, then at most ⌊log p⌋ gather messages on the
    root's side (one send for every other rank of the p'); ranges of a count below p' may be
    empty, and the halving's exchanges then carry no elements.
    Optimised as ``allreduce_rabenseifner`` is: the fold and the first halving round read "in" and
    write "out" in one step (``Reduce(src=...)``) instead of starting from a copy of the input.

    Picture, generated from the schedule (p = 4, count = 8, root = 0): each cell lists, for every block
    of the result, the ranks whose input that rank holds for the whole block (- for none), after each
    round. Redrawn by ``python -m commkit.algorithms._diagram --write``::

        round          rank 0               rank 1       rank 2         rank 3
        0              0    0    0    0     1    1  1 1  2    2    2 2  3 3 3    3
        1              0    0    02   02    13   13 1 1  02   02   2 2  3 3 13   13
        2              0    0    02   0123  0123 13 1 1  02   0123 2 2  3 3 0123 13
        3              0    0    0123 0123  0123 13 1 1  0123 0123 2 2  3 3 0123 13
        4              0123 0123 0123 0123  0123 13 1 1  0123 0123 2 2  3 3 0123 13
        msgs sent      2                    3            3              3
        elems sent     6                    8            10             8
        elems reduced  6                    6            6              6
        critical path (commkit.sim, each term alone): 4 messages, 12 elements sent, 6 reduced
    """
    whole, incoming, mine = ("out", 0, count), ("tmp", 0, count), ("in", 0, count)
    if size == 1:
        yield Copy(whole, mine)
        return
    if count == 0:
        return

    def rank_of(rel):
        return (rel + root + 1) % size

    rel = (rank - root - 1) % size
    pof2, rem = fold(size)
    new = new_rank(rel, rem)
    first = "in"
    if rel < 2 * rem:
        if new < 0:
            # Even rel of a folded pair: my partner above reduces for both of us.
            yield Send(rank_of(rel + 1), mine)
            return
        yield Recv(rank_of(rel - 1), incoming)
        yield Reduce(whole, incoming, op, src=mine)
        first = "out"
    ranges = partition(count, pof2)
    # Phase 1: reduce-scatter by recursive halving; new rank i then owns ranges[i] of "out".
    yield from _relabelled(halving_reduce_scatter(new, pof2, rem, ranges, "out", op, first), rank_of)
    # Phase 2: binomial gather towards new rank p'-1 (the root): each round the ranks whose bit is
    # clear hand everything they hold to the partner across that bit, which holds the adjacent range.
    mask = 1
    while mask < pof2:
        low = new & ~(2 * mask - 1)  # first new rank of my pair of groups
        below = span(ranges, low, low + mask)
        partner = rank_of(old_rank(new ^ mask, rem))
        if below[1] > below[0]:  # (a count below p' leaves some ranges empty: nothing to send)
            yield (Recv if new & mask else Send)(partner, ("out", *below))
        if not new & mask:
            return
        mask <<= 1


class _NewRankRanges:
    """Element range each new rank stands for (two blocks for folded pairs, else one), moved by ``shift``.

    Indexed by new rank and computed when asked: a rank reads about 2 log p of the p - rem
    ranges, and listing them all on every rank costs O(p^2) for a simulated world.
    """

    __slots__ = ("rem", "offsets", "shift")

    def __init__(self, rem, offsets, shift=0):
        self.rem, self.offsets, self.shift = rem, offsets, shift

    def __getitem__(self, new):
        first = 2 * new if new < self.rem else new + self.rem
        last = first + (2 if new < self.rem else 1)
        return self.offsets[first] + self.shift, self.offsets[last] + self.shift


class _Multiples:
    """``offsets[r] = r * count``: the block offsets of equal blocks, without listing p + 1 of them."""

    __slots__ = ("count",)

    def __init__(self, count):
        self.count = count

    def __getitem__(self, r):
        return r * self.count


@algorithm("reduce_scatter", "recursive_halving", commutative=True,
           scratch=lambda r, p, counts: 2 * block_offsets(counts)[-1],
           cost=lambda p, n, a, b, g: lg(p) * a + _fold_blocks(p) / p * n * (b + g)
           + (0 if p & (p - 1) == 0 else 2 * a + (p + 1) / p * n * b + n * g),
           formula="⌊log p⌋α + ((p'-1+R)/p)n(β+γ) (+ 2α + ((p+1)/p)nβ + nγ when p ≠ p'); " + _FOLD,
           cost_exact="even", cost_bound="either", symmetry="xor")
def reduce_scatter_recursive_halving(rank, size, counts, op):
    """Recursive-halving reduce-scatter: halve the vector each round, keeping the half my side owns.

    Restrictions: commutative op. Per-rank counts may differ. Non-powers of two are folded.
    Cost: ⌊log p⌋α + ((p'-1+R)/p)n(β + γ), plus 2α + ((p+1)/p)nβ + nγ for the fold when
    p ≠ p' = 2^⌊log p⌋ (R = Σₖ min(p - p', 2ᵏ); ((p-1)/p)n(β + γ) for p a power of two),
    n = bytes of the whole vector; exact when all counts are equal, otherwise an estimate
    (the fold's pairs may then hold more or less than two average blocks).
    Scratch: a working copy of the vector, plus room for the halves received.

    Picture, generated from the schedule (p = 4, count = (2, 2, 2, 2)): each cell lists, for every block
    of the result, the ranks whose input that rank holds for the whole block (- for none), after each
    round. Redrawn by ``python -m commkit.algorithms._diagram --write``::

        round          rank 0       rank 1       rank 2       rank 3
        0              0    0  0 0  1  1    1 1  2 2 2    2   3 3 3  3
        1              02   02 0 0  13 13   1 1  2 2 02   02  3 3 13 13
        2              0123 02 0 0  13 0123 1 1  2 2 0123 02  3 3 13 0123
        msgs sent      2            2            2            2
        elems sent     6            6            6            6
        elems reduced  6            6            6            6
        critical path (commkit.sim, each term alone): 2 messages, 6 elements sent, 6 reduced
    """
    offsets = block_offsets(counts)
    total = offsets[-1]
    mine = (offsets[rank], offsets[rank + 1])
    pof2, rem = fold(size)
    new = new_rank(rank, rem)
    if rank < 2 * rem and new < 0:
        # Even rank of a folded pair: hand over the whole vector, then receive my block.
        yield Send(rank + 1, ("in", 0, total))
        yield Recv(rank + 1, ("out", 0, counts[rank]))
        return
    # Work on a copy (tmp[total:2*total]) so the caller's input is never written;
    # tmp[0:...] receives the incoming halves.
    yield Copy(("tmp", total, 2 * total), ("in", 0, total))
    if rank < 2 * rem:
        yield Recv(rank - 1, ("tmp", 0, total))
        yield Reduce(("tmp", total, 2 * total), ("tmp", 0, total), op, operand_first=True)
    ranges = _NewRankRanges(rem, offsets, total)
    yield from halving_reduce_scatter(new, pof2, rem, ranges, "tmp", op)
    if rank < 2 * rem:
        # I stand for ranks rank-1 and rank: give my even partner its block.
        yield Send(rank - 1, ("tmp", total + offsets[rank - 1], total + offsets[rank]))
    yield Copy(("out", 0, counts[rank]), ("tmp", total + mine[0], total + mine[1]))


@algorithm("allgather", "recursive_doubling",
           cost=lambda p, n, a, b, g: lg(p) * a + _fold_blocks(p) / p * n * b
           + (0 if p & (p - 1) == 0 else 2 * a + (p + 1) / p * n * b),
           formula="⌊log p⌋α + ((p'-1+R)/p)nβ (+ 2α + ((p+1)/p)nβ when p ≠ p'); " + _FOLD, symmetry="xor")
def allgather_recursive_doubling(rank, size, count):
    """Recursive-doubling allgather: each round, swap everything gathered so far with rank XOR mask.

    Restrictions: none; non-powers of two are folded. Cost: ⌊log p⌋α + ((p'-1+R)/p)nβ, plus
    2α + ((p+1)/p)nβ for the fold when p ≠ p' = 2^⌊log p⌋ (R = Σₖ min(p - p', 2ᵏ);
    ((p-1)/p)nβ for p a power of two), n = bytes gathered.

    Picture, generated from the schedule (p = 4, count = 1): each cell lists, for every block of the
    result, the ranks whose input that rank holds for the whole block (- for none), after each round.
    Redrawn by ``python -m commkit.algorithms._diagram --write``::

        round       rank 0   rank 1   rank 2   rank 3
        0           0 - - -  - 1 - -  - - 2 -  - - - 3
        1           0 1 - -  0 1 - -  - - 2 3  - - 2 3
        2           0 1 2 3  0 1 2 3  0 1 2 3  0 1 2 3
        msgs sent   2        2        2        2
        elems sent  3        3        3        3
        critical path (commkit.sim, each term alone): 2 messages, 3 elements sent
    """
    mine = ("out", rank * count, (rank + 1) * count)
    yield Copy(mine, ("in", 0, count))
    pof2, rem = fold(size)
    new = new_rank(rank, rem)
    if rank < 2 * rem:
        if new < 0:
            yield Send(rank + 1, mine)
            yield Recv(rank + 1, ("out", 0, size * count))
            return
        yield Recv(rank - 1, ("out", (rank - 1) * count, rank * count))
    yield from _doubling_allgather(new, pof2, rem, _NewRankRanges(rem, _Multiples(count)), "out")
    if rank < 2 * rem:
        yield Send(rank - 1, ("out", 0, size * count))


@algorithm("scan", "recursive_doubling", scratch=lambda r, p, n: 2 * n,
           cost=lambda p, n, a, b, g: _scan_cost(p, n, a, b, g, inclusive=True),
           formula="max(q(α+nβ) + (q+1+⌊log t⌋)nγ, (q-1)(α+nβ+2nγ)); q = ⌈log p⌉, t = p - 2^(q-1) "
                   "(q(α+nβ+2nγ) for p a power of two)")
def scan_recursive_doubling(rank, size, count, op):
    """Recursive-doubling inclusive scan: swap partial sums with rank XOR mask; keep those from below.

    Restrictions: none (rank order kept). Cost: ⌈log p⌉(α + nβ + 2nγ) for p a power of two;
    otherwise max(q(α + nβ) + (q + 1 + ⌊log t⌋)nγ, (q - 1)(α + nβ + 2nγ)), q = ⌈log p⌉,
    t = p - 2^(q-1): some ranks skip rounds whose partner does not exist.

    Picture, generated from the schedule (p = 4, count = 8): each cell lists, for every block of the
    result, the ranks whose input that rank holds for the whole block (- for none), after each round.
    Redrawn by ``python -m commkit.algorithms._diagram --write``::

        round          rank 0   rank 1       rank 2           rank 3
        0              0 0 0 0  1  1  1  1   2   2   2   2    3    3    3    3
        1              0 0 0 0  01 01 01 01  2   2   2   2    23   23   23   23
        2              0 0 0 0  01 01 01 01  012 012 012 012  0123 0123 0123 0123
        msgs sent      2        2            2                2
        elems sent     16       16           16               16
        elems reduced  16       24           24               32
        critical path (commkit.sim, each term alone): 2 messages, 16 elements sent, 32 reduced
    """
    yield from _scan(rank, size, count, op, inclusive=True)


@algorithm("exscan", "recursive_doubling", scratch=lambda r, p, n: 2 * n,
           cost=lambda p, n, a, b, g: _scan_cost(p, n, a, b, g, inclusive=False),
           formula="max(q(α+nβ) + (q+⌊log t⌋)nγ, (q-1)(α+nβ) + (2q-3)nγ); q = ⌈log p⌉, t = p - 2^(q-1) "
                   "(q(α+nβ) + (2q-1)nγ for p a power of two; 0 for p = 1)")
def exscan_recursive_doubling(rank, size, count, op):
    """Recursive-doubling exclusive scan; rank 0's result is the op's identity.

    Restrictions: none (rank order kept). Cost: ⌈log p⌉(α + nβ) + (2⌈log p⌉ - 1)nγ for p a
    power of two (each rank's first contribution is a copy, not a reduction); otherwise
    max(q(α + nβ) + (q + ⌊log t⌋)nγ, (q - 1)(α + nβ) + (2q - 3)nγ), q = ⌈log p⌉, t = p - 2^(q-1).

    Picture, generated from the schedule (p = 4, count = 8): each cell lists, for every block of the
    result, the ranks whose input that rank holds for the whole block (- for none), after each round.
    Redrawn by ``python -m commkit.algorithms._diagram --write``::

        round          rank 0   rank 1   rank 2       rank 3
        0              - - - -  - - - -  -  -  -  -   -   -   -   -
        1              - - - -  0 0 0 0  -  -  -  -   2   2   2   2
        2              - - - -  0 0 0 0  01 01 01 01  012 012 012 012
        msgs sent      2        2        2            2
        elems sent     16       16       16           16
        elems reduced  16       16       16           24
        critical path (commkit.sim, each term alone): 2 messages, 16 elements sent, 24 reduced
    """
    yield from _scan(rank, size, count, op, inclusive=False)


def _scan(rank, size, count, op, inclusive):
    partial, incoming, out = ("tmp", 0, count), ("tmp", count, 2 * count), ("out", 0, count)
    yield Copy(partial, ("in", 0, count))
    have_out = inclusive
    if inclusive:
        yield Copy(out, ("in", 0, count))
    mask = 1
    while mask < size:
        partner = rank ^ mask
        if partner < size:
            # Swap partial sums; `partial` covers a contiguous range of ranks ending at mine.
            yield Exchange(partner, partial, partner, incoming)
            if partner < rank:
                yield Reduce(partial, incoming, op, operand_first=True)
                if have_out:
                    yield Reduce(out, incoming, op, operand_first=True)
                else:
                    yield Copy(out, incoming)
                    have_out = True
            else:
                yield Reduce(partial, incoming, op)
        mask <<= 1
