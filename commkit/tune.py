"""``commkit tune``: measure alpha, beta and gamma here, derive the crossovers, confirm them, write a table.

How, and why this way:

* alpha and beta are measured through commkit's own executor, running a
  schedule of ring exchanges (every rank sends right and receives left, all
  at once, as in the collectives) on a private communicator. The model
  charges a transfer step ``alpha + beta * bytes``, so this is the very cost
  to fit; a C ping-pong would miss Python's per-step overhead, which is most
  of alpha. beta is the least-squares slope over the large sizes (where
  bandwidth dominates) and alpha the time of the smallest size less its beta
  share, so neither is dragged by the other's noise.
* gamma is the slope of the reduction ufunc applied in place over large
  arrays (the Reduce step's work).
* The fits use the best of several repetitions, not the median: on a machine
  shared with other work (the 2-core development machine measured alpha
  3.2 us when quiet and 19.6 us under load, with medians) other processes
  only ever add time, so the minimum is the least disturbed sample.
* The crossovers come from :func:`commkit.cost.crossovers` with those
  constants, less the model's regimes narrower than 1/8 of their lower bound
  (:data:`MIN_REGIME_FRACTION`): the formulas of segmented algorithms are
  sawtooths, and where two of them nearly tie the winner flips every few
  bytes (reduce at p = 2 traded rabenseifner and binary_tree_segmented over
  ranges a few hundred bytes wide, where the two formulas agree to the last
  bit). Such a regime's sizes go to the neighbour whose algorithm has the
  lower mean predicted time over them, and the rule's reason names what was
  merged and the predicted time given up. Each crossover left inside the benchmarked range is then
  confirmed: both algorithms run (interleaved, same buffers) at half and twice
  the crossover. Where the measurement disagrees, more sizes are probed in the
  direction it points and the threshold moves to where the measured winner
  changes; every rule's ``reason`` states the prediction and the measurement.
  A moved threshold stays where it was measured even if it leaves a rule
  narrower than the model's minimum: that is evidence, not a near-tie of two
  formulas, and the rule's reason says it was kept as measured.
* Segmented algorithms (:attr:`commkit.algorithms.Algorithm.segmented`, such
  as allreduce ``ring_pipelined``) get their segment size measured, not
  modelled: the cost formulas know only the default segment. For every rule
  at the measured process count whose algorithm is segmented, the algorithm
  runs at one size inside the rule's range (the power of two nearest the
  geometric middle of the range, capped by ``max_bytes``) once with each
  segment size of a ladder (:data:`SEGMENT_LADDER` or ``segments=``) smaller
  than that message, and once with its default segment (interleaved, same
  buffers). The fastest median wins, unless it beats the default by no more
  than the spread of identical runs: then the default stays. The rule carries
  the winner as ``segment_bytes`` and its reason lists every time measured.
  Rules for other process counts leave the segment to the algorithm's default
  and say so.
* Rules are bounded to the process counts they were derived for. Other
  counts (``--procs``) use the same alpha, beta, gamma and say so: they are
  model extrapolations, not measurements.
* The node engine's algorithms (``shm``, :mod:`commkit.algorithms.node`) have
  no place in the cost model, so where every rank shares one node
  (``comm.nodes == 1``) a node pass measures them instead, after the model's
  table is built: for each tuned collective with a ``shm`` algorithm, at
  ``comm.size`` ranks only, ``shm`` runs against the algorithm the table being
  written (then the shipped one) selects, at each size of :func:`node_ladder`
  (interleaved, alternating which goes first, same buffers, a barrier before
  each run; the median over repetitions of the slowest rank's time). shm wins
  a size only by more than the spread of identical runs. Each contiguous
  range of wins becomes one ``one_node`` rule for this transport, placed
  before the collective's other rules, from the smallest winning size to the
  largest: the sizes between a win and a loss stay with the table's choice,
  and a range that reaches the largest size measured is left open above it
  (the best evidence there is: shm won the last size measured, and the
  table's rule above it is not measured either). Every rank gathers every
  rank's times, so all take the same decisions and return the same table.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from . import algorithms, bench, collectives, cost, selection
from ._checks import parse_size
from ._units import format_bytes, format_seconds
from .algorithms.pipelined import segment_elements
from .errors import InvalidArgument
from .ops import get_op
from .schedule import CallInfo, Exchange, run_schedule

__all__ = ["measure_alpha_beta", "fit_alpha_beta", "measure_gamma", "build_table", "run", "summary",
           "MIN_REGIME_FRACTION", "SEGMENT_LADDER", "parse_segments", "segment_candidates", "measure_segments",
           "NODE_LADDER_START", "node_ladder", "measure_node", "node_rules"]

_REDUCING = collectives.REDUCING


def _size(n) -> str:
    """``n`` bytes in the log and the reasons: exact binary units (``'64 KiB'``, ``'1536 B'``); None is no limit."""
    return format_bytes(n, none="no limit")


# -- measuring ------------------------------------------------------------------------------------


def _ring_exchanges(rank, size, nbytes, rounds):
    right, left = (rank + 1) % size, (rank - 1) % size
    for _ in range(rounds):
        yield Exchange(right, ("in", 0, nbytes), left, ("out", 0, nbytes))


def measure_alpha_beta(comm, sizes, reps: int = 5) -> list[tuple[int, float]]:
    """Seconds per ring-exchange step at each size (slowest rank, best of ``reps``); collective.

    Runs the schedule on a duplicate of ``comm``, so no message can meet the caller's.

    Cost: about ``reps * rounds`` steps per size, rounds chosen to take ~10 ms.
    """
    with comm.dup() as dup:  # (a with block left by an error frees it without waiting for the other ranks)
        chan = dup.collective_transport  # where collective schedules run: the cost the model charges
        points = []
        for nbytes in sizes:
            rounds = 200 if nbytes <= 4096 else 50 if nbytes <= 256 << 10 else 10
            bufs = {"in": np.ones(max(nbytes, 1), np.uint8), "out": np.empty(max(nbytes, 1), np.uint8),
                    "tmp": np.empty(0, np.uint8)}
            info = CallInfo("tune", "ring_exchange", 0, comm.rank)
            run_schedule(_ring_exchanges(comm.rank, comm.size, nbytes, 3), bufs, chan, 0, None, info)  # warm up
            samples = np.zeros(reps)
            for i in range(reps):
                dup.barrier()
                t0 = time.perf_counter()
                run_schedule(_ring_exchanges(comm.rank, comm.size, nbytes, rounds), bufs, chan, 0, None, info)
                samples[i] = (time.perf_counter() - t0) / rounds
            samples = dup.allreduce(samples, op="max")
            points.append((nbytes, float(np.min(samples))))
    return points


def fit_alpha_beta(points) -> tuple[float, float]:
    """``(alpha, beta)`` from ``(bytes, seconds)`` points: beta the slope over the large half, alpha the rest.

    Raises InvalidArgument with fewer than two distinct sizes.
    """
    points = sorted(points)
    if len({n for n, _ in points}) < 2:
        raise InvalidArgument("fitting alpha and beta needs measurements at two or more different sizes.")
    large = points[len(points) // 2:] if len(points) >= 4 else points
    xs = np.array([n for n, _ in large], dtype=float)
    ys = np.array([t for _, t in large])
    if np.ptp(xs) == 0:
        xs = np.array([n for n, _ in points], dtype=float)
        ys = np.array([t for _, t in points])
    beta = float(np.polyfit(xs, ys, 1)[0])
    if beta <= 0:  # noise on a tiny range: fall back to the two ends
        (n0, t0), (n1, t1) = points[0], points[-1]
        beta = max((t1 - t0) / (n1 - n0), 0.0)
    n0, t0 = points[0]
    alpha = max(t0 - beta * n0, 0.0)
    return alpha, beta


def measure_gamma(dtype, op, sizes, reps: int = 5) -> tuple[float, list[tuple[int, float]]]:
    """Seconds per byte of ``op`` applied in place (``a = a op b``), the slope over ``sizes`` (bytes)."""
    dtype = np.dtype(dtype)
    op = get_op(op)
    points = []
    for nbytes in sizes:
        n = max(nbytes // dtype.itemsize, 1)
        a = np.ones(n, dtype)
        b = np.ones(n, dtype)
        op.combine(a, b, False)
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            op.combine(a, b, False)
            samples.append(time.perf_counter() - t0)
        points.append((n * dtype.itemsize, float(np.min(samples))))
    xs = np.array([n for n, _ in points], dtype=float)
    ys = np.array([t for _, t in points])
    gamma = float(np.polyfit(xs, ys, 1)[0]) if len(points) > 1 else ys[0] / xs[0]
    if gamma <= 0:
        gamma = float(ys[-1] / xs[-1])
    return gamma, points


# -- confirming a crossover --------------------------------------------------------------------------


def _probe(comm, collective, size, names, dtype, op, iters):
    rows = bench.measure(comm, collective, size, names, dtype=dtype, op=op, iters=iters, warmup=1)
    return {r.algorithm: r for r in rows}


def _confirm(comm, collective, low, high, boundary, lower_bound, upper_bound, dtype, op, iters, max_bytes):
    """Measure ``low`` (predicted to win below ``boundary``) against ``high`` around it.

    Returns ``(boundary, text, probes)``: the boundary the measurement supports,
    kept inside ``[lower_bound, upper_bound]`` so the neighbouring regimes stay
    non-empty; a sentence for the rule's reason; the raw medians.
    """
    probes = []

    def high_wins(size):
        """True or False where the medians differ by more than the runs' spread, else None (noise)."""
        got = _probe(comm, collective, size, [low, high], dtype, op, iters)
        t_low, t_high = got[low].time_us, got[high].time_us
        spread = max(got[low].spread, got[high].spread)
        probes.append({"bytes": got[low].size, low: round(t_low, 2), high: round(t_high, 2),
                       "spread": round(spread, 3)})
        if abs(t_low - t_high) <= spread * min(t_low, t_high):
            return None
        return t_high < t_low

    def said():
        return ", ".join(f"{_size(x['bytes'])}: {low} {x[low]:.1f} us vs {high} {x[high]:.1f} us" for x in probes)

    top = min(max_bytes, upper_bound) if upper_bound is not None else max_bytes
    below, above = max(boundary // 2, 1), min(boundary * 2, top)
    at_below, at_above = high_wins(below), high_wins(above)
    # Only a difference larger than the spread of identical runs counts against the model.
    up = at_above is False       # `low` clearly still faster above the predicted crossover
    down = at_below is True      # `high` clearly already faster below it
    if up == down:
        verdict = "confirmed" if (at_below, at_above) == (False, True) else (
            "inconclusive (differences within the spread of identical runs); kept the model's threshold")
        return boundary, f"bench {said()}: {verdict}", probes
    if up:
        size = above
        while size * 2 <= top and len(probes) < 6:
            size *= 2
            if high_wins(size) is not False:
                return size, f"bench {said()}: threshold moved up to {_size(size)}", probes
        new = min(size + 1, upper_bound) if upper_bound is not None else size + 1
        return new, f"bench {said()}: {low} faster throughout; threshold moved up", probes
    size = below
    while size // 2 >= max(lower_bound, 1) and len(probes) < 6:
        size //= 2
        if high_wins(size) is not True:
            return size * 2, f"bench {said()}: threshold moved down to {_size(size * 2)}", probes
    return max(size, lower_bound), f"bench {said()}: {high} faster throughout; threshold moved down", probes


# -- measuring the segment size ------------------------------------------------------------------------


SEGMENT_LADDER = (16 << 10, 64 << 10, 256 << 10, 1 << 20)
"""Segment sizes in bytes that ``tune`` tries for a segmented algorithm unless told otherwise (``segments=``)."""


def parse_segments(value) -> list[int]:
    """The segment sizes of a ladder, in bytes, sorted and without repeats.

    Args:
        value: a comma-separated string such as ``"16K,64K,256K"`` (the units of
            :func:`commkit._checks.parse_size`: K, M, G are powers of 1024), or a
            sequence of such strings or of ints.

    Returns:
        the sizes in bytes, smallest first.

    Raises:
        InvalidArgument: ``value`` is neither; it lists no size; a size is not a
            size in bytes, or is 0.
    """
    expected = "segment sizes in bytes such as '16K,64K,256K' or [16384, 65536]"
    if isinstance(value, str):
        parts = [part.strip() for part in value.split(",")]
        if all(not part for part in parts):
            raise InvalidArgument(f"segments: expected {expected}, got {value!r} (no size).")
        if any(not part for part in parts):
            raise InvalidArgument(f"segments {value!r}: an empty entry between commas; expected {expected}.")
    elif isinstance(value, (list, tuple)):
        parts = list(value)
        if not parts:
            raise InvalidArgument(f"segments: expected {expected}, got {value!r} (no size).")
    else:
        raise InvalidArgument(f"segments: expected {expected}, got {type(value).__name__} {value!r}.")
    sizes = set()
    for part in parts:
        if isinstance(part, bool) or not isinstance(part, (int, str)):
            raise InvalidArgument(f"segments {value!r}: each size must be an int or a string such as '64K', "
                                  f"got {type(part).__name__} {part!r}.")
        try:
            size = parse_size(part)
        except InvalidArgument as exc:
            raise InvalidArgument(f"segments {value!r}: {exc}") from None
        if size < 1:
            raise InvalidArgument(f"segments {value!r}: a segment size must be at least 1 byte, got {part!r}.")
        sizes.add(size)
    return sorted(sizes)


def segment_candidates(nbytes: int, ladder, default: int) -> list[int]:
    """The segment sizes worth timing for an ``nbytes`` message: the ladder's below ``nbytes``, and ``default``.

    A segment as large as the message leaves it whole, so only one such size
    (the default, whatever its size) is kept. Sorted, without repeats.
    """
    return sorted({s for s in ladder if s < nbytes} | {default})


def _size_times(probes, default) -> str:
    return ", ".join(f"{_size(x['segment_bytes'])}{' (default)' if x['segment_bytes'] == default else ''} "
                     f"{x['time_us']:.1f} us" for x in probes)


def measure_segments(comm, collective: str, algorithm: str, nbytes: int, ladder=SEGMENT_LADDER, *,
                     dtype="float32", op="sum", iters: int = 20):
    """Time a segmented algorithm at one size with each candidate segment size and pick one; collective call.

    The candidates are :func:`segment_candidates` of ``ladder`` and the
    algorithm's default segment (``COMMKIT_SEGMENT_ELEMENTS`` elements of
    ``dtype``, else its own default). They run interleaved through
    :func:`commkit.bench.measure`, forced as ``algorithm="NAME:BYTES"``. The
    fastest median wins unless it beats the default by no more than the
    spread of identical runs (then the default is kept: noise must not pick).

    Args:
        comm: the communicator to measure on (every rank calls this, with the same arguments).
        collective, algorithm: a segmented algorithm (its schedule takes ``segment=``).
        nbytes: the message size, in bytes as :mod:`commkit.selection` counts it.
        ladder: segment sizes in bytes (see :func:`parse_segments`).
        dtype, op: the call's element type and reduction op.
        iters: timed runs of each candidate (one untimed run first).

    Returns:
        ``(segment_bytes, text, record)``, the same on every rank: the chosen size,
        a sentence for the rule's reason, and the raw medians for the table's
        ``"measured"`` key. When fewer than two candidates exist (no ladder size
        below ``nbytes``) nothing runs and the result is ``(None, text, None)``.

    Raises:
        InvalidArgument: an unknown algorithm, or one that takes no segment size.

    Cost: ``(iters + 1) * len(candidates)`` calls of ``nbytes``, plus a barrier before each.
    """
    alg = algorithms.get(collective, algorithm)
    if alg is None or not alg.segmented:
        segmented = sorted(a.name for a in algorithms.for_collective(collective).values() if a.segmented)
        what = "is not one" if alg is None else "takes no segment size"
        raise InvalidArgument(f"measuring segment sizes needs a segmented {collective} algorithm; {algorithm!r} "
                              f"{what}. Segmented {collective} algorithms: {segmented or 'none'}.")
    ladder = parse_segments(ladder if isinstance(ladder, (str, list, tuple)) else list(ladder))
    default = segment_elements() * np.dtype(dtype).itemsize
    candidates = segment_candidates(nbytes, ladder, default)
    if len(candidates) < 2:
        return None, (f"segment size not measured: no size of the ladder ({', '.join(map(_size, ladder))}) is "
                      f"smaller than the {_size(nbytes)} message, so the default ({_size(default)}) stays"), None
    names = [f"{algorithm}:{s}" for s in candidates]
    rows = {r.algorithm: r for r in bench.measure(comm, collective, nbytes, names, dtype=dtype, op=op, iters=iters,
                                                  warmup=1)}
    probes = [{"segment_bytes": s, "time_us": round(rows[name].time_us, 2), "spread": round(rows[name].spread, 3)}
              for s, name in zip(candidates, names)]
    fastest = min(probes, key=lambda x: (x["time_us"], x["segment_bytes"]))
    base = next(x for x in probes if x["segment_bytes"] == default)
    spread = max(fastest["spread"], base["spread"])
    size = rows[names[0]].size
    said = _size_times(probes, default)
    if fastest is base:
        chosen, verdict = default, f"segment {_size(default)} (the default) measured fastest at {_size(size)}"
    elif base["time_us"] - fastest["time_us"] <= spread * fastest["time_us"]:
        chosen = default
        verdict = (f"segment sizes measured at {_size(size)}: {_size(fastest['segment_bytes'])} was fastest by less "
                   f"than the spread of identical runs, so the default {_size(default)} stays")
    else:
        chosen = fastest["segment_bytes"]
        verdict = f"segment {_size(chosen)} measured fastest at {_size(size)}"
    record = {"collective": collective, "algorithm": algorithm, "bytes": size, "default": default,
              "chosen": chosen, "probes": probes}
    return chosen, f"{verdict} ({said}; median of {iters})", record


def _segment_probe_size(min_bytes: int, max_bytes, cap: int) -> int | None:
    """Where to measure a rule's segment: the power of two nearest the geometric middle of its range, capped.

    None when the range starts above ``cap`` (the largest size tune runs); 0 for the range of 0 B alone.
    """
    top = cap if max_bytes is None else min(max_bytes, cap)
    if top < min_bytes:
        return None
    if top == 0:
        return 0
    low = max(min_bytes, 1)
    middle = 1 << round(math.log2(math.sqrt(low * top)))
    return min(max(middle, low), top)


# -- the node pass ----------------------------------------------------------------------------------

NODE_LADDER_START = 64 << 10
"""The smallest size the node pass measures: below it a node call's waits (several microseconds of
Python each) cost more than the copies it saves (benchmarks/node_floor.py, docs/node.md)."""


def node_ladder(max_bytes: int, quick: bool = False) -> list[int]:
    """The sizes the node pass measures: :data:`NODE_LADDER_START` doubling (x4 with ``quick``), then ``max_bytes``.

    ``[max_bytes]`` alone when ``max_bytes`` is not above the start.
    """
    sizes, size = [], NODE_LADDER_START
    while size < max_bytes:
        sizes.append(size)
        size *= 4 if quick else 2
    return [*sizes, max_bytes]


def _table_choice(table, collective, p, nbytes, op, transport) -> str:
    """The two-sided algorithm ``table``, then the shipped table, then the fallback select for this call.

    As :func:`commkit.selection.select` walks them, without ``COMMKIT_TUNING`` (the
    table being written takes its place) and with no rule for one node matching:
    what the call would run were there no node algorithm.
    """
    for rule in (*table.get(collective, ()), *selection.default_table().get(collective, ())):
        if selection.rule_matches(rule, p, nbytes, op, False, transport):
            alg = algorithms.get(collective, rule["algorithm"])
            if alg.name != "native" and not algorithms.is_node_only(alg) and alg.why_not(p, op) is None:
                return alg.name
    return next(name for name in selection.FALLBACK[collective]
                if algorithms.get(collective, name).why_not(p, op) is None)


def _node_samples(case, other, reps):
    """This rank's seconds for ``shm`` and ``other`` on ``case`` (shape ``(2, reps)``), and shm's wrong results.

    One untimed run of each first (it makes the plans and the arena, and is
    checked); then ``reps`` rounds, each running both, which goes first
    alternating, a barrier before every run.
    """
    names = ("shm", other)
    wrong = 0
    for name in names:
        case.poison()
        result = case.run(name)
        if name == "shm" and not case.correct(result):
            wrong += 1
    samples = np.zeros((2, reps))
    for i in range(reps):
        for k in ((0, 1) if i % 2 == 0 else (1, 0)):
            case.comm.barrier()
            t0 = time.perf_counter()
            case.run(names[k])
            samples[k, i] = time.perf_counter() - t0
    return samples, wrong


def measure_node(comm, collective: str, nbytes: int, other: str, *, dtype="float32", op="sum",
                 reps: int = 11) -> dict:
    """Time ``shm`` against ``other`` for one collective and size; collective call, the same record on every rank.

    Returns ``{"collective", "bytes" (as commkit.selection counts them, rounded as
    :class:`commkit.bench.Case` rounds), "shm_seconds", "other", "other_seconds",
    "spread", "wrong", "shm_faster"}``: the medians over ``reps`` of the slowest
    rank's time, the larger interquartile spread of the two relative to its
    median, shm's wrong results, and whether shm is faster by more than the spread.

    Cost: ``2 * (reps + 1)`` calls of ``nbytes`` and ``2 * reps`` barriers.
    """
    case = bench.Case(comm, collective, nbytes, dtype, op, 0, np)
    samples, wrong = _node_samples(case, other, reps)
    everyone = comm.allgather_object((samples, wrong))
    times = np.max([s for s, _ in everyone], axis=0)  # a run lasts until its slowest rank finishes
    wrong = int(sum(w for _, w in everyone))
    median = np.median(times, axis=1)
    q25, q75 = np.percentile(times, [25, 75], axis=1)
    spread = float(np.max((q75 - q25) / median)) if np.all(median > 0) else 0.0
    t_shm, t_other = float(median[0]), float(median[1])
    faster = wrong == 0 and t_other - t_shm > spread * t_shm
    return {"collective": collective, "bytes": case.size, "shm_seconds": t_shm, "other": other,
            "other_seconds": t_other, "spread": round(spread, 3), "wrong": wrong, "shm_faster": faster}


def _us(probe) -> str:
    return f"shm {probe['shm_seconds'] * 1e6:.1f} us against {probe['other']} {probe['other_seconds'] * 1e6:.1f} us"


def node_rules(p: int, transport: str, probes, reps: int) -> list[dict]:
    """One ``one_node`` rule naming ``shm`` for each contiguous range of ``probes`` (ascending sizes) shm won.

    A range runs from its smallest winning size to its largest (``max_bytes``
    left out where it reaches the last probe); its reason gives every time
    measured in it and at the sizes that bound it.
    """
    rules = []
    i = 0
    while i < len(probes):
        if not probes[i]["shm_faster"]:
            i += 1
            continue
        j = i
        while j + 1 < len(probes) and probes[j + 1]["shm_faster"]:
            j += 1
        won = probes[i:j + 1]
        rule = {"min_procs": p, "max_procs": p, "one_node": True, "transport": transport}
        if won[0]["bytes"] > 0:
            rule["min_bytes"] = int(won[0]["bytes"])
        notes = ["measured: " + ", ".join(f"{_us(x)} at {_size(x['bytes'])}" for x in won)]
        for k in (i - 1, j + 1):
            if 0 <= k < len(probes):
                why = "gave a wrong result" if probes[k]["wrong"] else "not faster by more than the spread of runs"
                notes.append(f"shm {why} at {_size(probes[k]['bytes'])} ({_us(probes[k])})")
        if j == len(probes) - 1:
            if won[-1]["bytes"] > 0:  # (a barrier has no sizes to extrapolate to)
                notes.append(f"faster at the largest size measured, so the rule is left open above "
                             f"{_size(won[-1]['bytes'])} (not measured there)")
        else:
            rule["max_bytes"] = int(won[-1]["bytes"])
        rule["algorithm"] = "shm"
        rule["reason"] = (f"{'; '.join(notes)} (commkit tune, measured on {p} ranks of one node, {transport} "
                          f"transport, {reps} reps, interleaved; the median of the slowest rank)")
        rules.append(rule)
        i = j + 1
    return rules


def _node_pass(comm, table, collectives, sizes, dtype, op, reps, log) -> None:
    """Measure shm against the table's choice at ``comm.size`` ranks; put its rules first in ``table``."""
    p, transport = comm.size, comm.transport_name
    records = table["measured"]["node"] = []
    for collective in collectives:
        if algorithms.get(collective, "shm") is None:
            continue
        the_op = get_op(op) if collective in _REDUCING else None
        probes = []
        for nbytes in ([0] if collective == "barrier" else sizes):
            actual = bench.actual_size(collective, p, nbytes, np.dtype(dtype).itemsize)
            other = _table_choice(table, collective, p, actual, the_op, transport)
            probes.append(measure_node(comm, collective, actual, other, dtype=dtype, op=op, reps=reps))
        records.extend(probes)
        rules = node_rules(p, transport, probes, reps)
        table[collective] = rules + table.get(collective, [])
        wrong = [_size(x["bytes"]) for x in probes if x["wrong"]]
        won = ", ".join(_span(r.get("min_bytes", 0), r.get("max_bytes")) for r in rules)
        log(f"node pass {collective}: shm {'faster at ' + won if rules else 'not faster at any size'} of "
            f"{len(probes)} measured" + (f"; WRONG RESULTS from shm at {', '.join(wrong)}" if wrong else ""))


def _span(lo, hi) -> str:
    return f"{_size(lo)}-{_size(hi)}" if hi is not None else f">= {_size(lo)}"


# -- the table ---------------------------------------------------------------------------------------


MIN_REGIME_FRACTION = 8
"""A model regime narrower than 1/8 of its lower bound is merged into its neighbours (see :func:`_regimes`).

Such a regime spans less than a sixth of an octave. The formulas of segmented
algorithms are sawtooths (their cost jumps wherever the segment count does), so two
nearly equal algorithms trade the win back and forth over a few bytes, which is noise
in the formulas, not a regime: the teeth sit where the default segment puts them, and
``tune`` measures the segment of a segmented rule instead. The confirming bench, which
measures at half and twice a crossover, cannot resolve a range that narrow either.
Wider islands, such as ring_pipelined's win from 64 to 83 MiB at p = 165, stay. What is
merged is a near-tie: over 300 random constants and process counts of the collectives
with segmented algorithms, the predicted time given up was under 0.1% for most merged
rules and 2.5% at most; each rule's reason quotes its own figure."""


@dataclass(frozen=True)
class _Merged:
    """A regime of the table and the model's regimes it covers (``pieces``, in order, some won by others)."""

    regime: cost.Regime
    pieces: tuple

    @property
    def given_up(self):
        """The pieces whose sizes the model gives to another algorithm than this regime's."""
        return [x for x in self.pieces if x.algorithm != self.regime.algorithm]


def _too_narrow(reg) -> bool:
    """Narrower than 1/:data:`MIN_REGIME_FRACTION` of its lower bound (the first and the last regime never are)."""
    return reg.max_bytes is not None and (reg.max_bytes + 1 - reg.min_bytes) * MIN_REGIME_FRACTION < reg.min_bytes


def _sizes_in(reg, step, most=9):
    """Up to ``most`` call sizes spread evenly over ``reg`` (whole ``step``-byte elements), both ends included."""
    count = (reg.max_bytes + 1 - reg.min_bytes) // step
    picks = sorted({round(k * (count - 1) / (most - 1)) for k in range(most)}) if count > most else range(count)
    return [reg.min_bytes + k * step for k in picks]


def _regimes(collective, p, alpha, beta, gamma, commutative, itemsize):
    """The model's regimes (:func:`commkit.cost.crossovers`) with the too narrow ones merged into their neighbours.

    A regime narrower than 1/:data:`MIN_REGIME_FRACTION` of its lower bound (the
    narrowest relative to its lower bound first) gives its sizes to the neighbour
    whose algorithm has the lower mean predicted time over them; neighbours that then
    name the same algorithm become one regime. The neighbours keep the sizes the model
    says they win, so of the tables without that regime this one has the least
    predicted time over the neighbours' and its sizes together. Only a neighbour's
    algorithm can be chosen, and every regime's algorithm applies at ``p`` and for
    the op (applicability depends on neither the size nor the neighbours), so the
    merged regime's does too.

    Returns:
        a list of :class:`_Merged`, smallest sizes first: contiguous from 0, the last unbounded.
    """
    model = cost.crossovers(collective, p, alpha=alpha, beta=beta, gamma=gamma, commutative=commutative,
                            itemsize=itemsize)
    step = itemsize or 1

    def mean_time(algorithm, sizes):
        return sum(cost.predict(collective, algorithm, p, n, alpha=alpha, beta=beta, gamma=gamma)
                   for n in sizes) / len(sizes)

    merged = [_Merged(reg, (reg,)) for reg in model]
    while True:
        narrow = [i for i, m in enumerate(merged) if _too_narrow(m.regime)]
        if not narrow:
            return merged
        i = min(narrow, key=lambda k: ((merged[k].regime.max_bytes + 1 - merged[k].regime.min_bytes)
                                       / merged[k].regime.min_bytes, k))
        sizes = _sizes_in(merged[i].regime, step)
        # A narrow regime is neither the first nor the last, so it has a neighbour on each side.
        into = min((i - 1, i + 1), key=lambda k: (mean_time(merged[k].regime.algorithm, sizes), k))
        algorithm = merged[into].regime.algorithm
        merged[i] = _Merged(cost.Regime(algorithm, merged[i].regime.min_bytes, merged[i].regime.max_bytes),
                            merged[i].pieces)
        merged = _joined(merged)


def _joined(merged):
    """``merged`` with each run of neighbours that name the same algorithm made one."""
    out = []
    for m in merged:
        if out and out[-1].regime.algorithm == m.regime.algorithm:
            last = out.pop()
            m = _Merged(cost.Regime(m.regime.algorithm, last.regime.min_bytes, m.regime.max_bytes),
                        last.pieces + m.pieces)
        out.append(m)
    return out


def _merged_note(collective, p, merged, alpha, beta, gamma, step):
    """A sentence on the model's narrow regimes merged into this one and the predicted time given up; None if none."""
    given_up = merged.given_up
    if not given_up:
        return None
    worst = 0.0
    for piece in given_up:
        for n in _sizes_in(piece, step):
            best = cost.predict(collective, piece.algorithm, p, n, alpha=alpha, beta=beta, gamma=gamma)
            ours = cost.predict(collective, merged.regime.algorithm, p, n, alpha=alpha, beta=beta, gamma=gamma)
            if best > 0:
                worst = max(worst, ours / best - 1)
    listed = ", ".join(f"{x.algorithm} at {_span(x.min_bytes, x.max_bytes)}" for x in given_up[:4])
    more = f" and {len(given_up) - 4} more" if len(given_up) > 4 else ""
    slower = f"at most {worst:.1%}" if worst >= 0.001 else "less than 0.1%"
    return (f"the model's regimes {listed}{more} are merged in (each was narrower than 1/{MIN_REGIME_FRACTION} "
            f"of its lower bound: two near-equal formulas trading the win, not a regime of its own); "
            f"{merged.regime.algorithm} is predicted {slower} slower there")


def _rule(p, reg, collective, reason, commutative_only, segment=None):
    rule = {"min_procs": p, "max_procs": p}
    if reg.min_bytes > 0:
        rule["min_bytes"] = int(reg.min_bytes)
    if reg.max_bytes is not None:
        rule["max_bytes"] = int(reg.max_bytes)
    if commutative_only:
        rule["commutative"] = True
    rule["algorithm"] = reg.algorithm
    if segment is not None:
        rule["segment_bytes"] = int(segment)
    rule["reason"] = reason
    return rule


def _model_reason(collective, p, merged, alpha, beta, gamma, measured_p, commutative, step):
    reg = merged.regime
    lo, hi = reg.min_bytes, reg.max_bytes
    # Quote the ranking inside the widest range the algorithm won in the model itself, not inside a merged one.
    own = max((x for x in merged.pieces if x.algorithm == reg.algorithm),
              key=lambda x: math.inf if x.max_bytes is None else x.max_bytes - x.min_bytes)
    probe = own.min_bytes
    if own.max_bytes is not None:  # the middle element: the formulas count whole elements
        probe += (own.max_bytes + 1 - own.min_bytes) // step // 2 * step
    ranking = cost.best(collective, p, probe, alpha=alpha, beta=beta, gamma=gamma, commutative=commutative)
    runner = next((x for x in ranking if x.algorithm != reg.algorithm), None)
    span = f"{_size(lo)} to {_size(hi)}" if hi is not None else f"{_size(lo)} and up"
    text = (f"p={p}: with alpha={format_seconds(alpha)}, beta={beta * 1e9:.3g} ns/B, gamma={gamma * 1e9:.3g} ns/B "
            f"(measured on {measured_p} ranks) the model predicts {reg.algorithm} fastest for {span}")
    if runner is not None:
        text += (f" ({format_seconds(ranking[0].seconds)} vs {runner.algorithm} {format_seconds(runner.seconds)} "
                 f"at {_size(probe)}; {ranking[0].formula})")
    note = _merged_note(collective, p, merged, alpha, beta, gamma, step)
    if note is not None:
        text += f"; {note}"
    if not commutative:
        text += "; for non-commutative ops"
    if p != measured_p:
        text += f"; model extrapolation to p={p}, not benchmarked"
    return text


def build_table(alpha: float, beta: float, gamma: float, procs, collectives, *, measured_p: int,
                confirm=None, measure_segment=None, machine: dict | None = None,
                measured: dict | None = None, itemsize: int | None = None) -> dict:
    """The tuning table for ``procs`` x ``collectives`` from the model (no MPI needed).

    Args:
        alpha, beta, gamma: the model's constants.
        procs: process counts to write rules for.
        collectives: collectives to write rules for.
        measured_p: the process count alpha, beta, gamma were measured on.
        confirm: optional ``confirm(collective, low, high, boundary, lower, upper) -> (boundary, text, probes)``
            run for each crossover at ``p == measured_p`` (the short benchmark).
        measure_segment: optional ``measure_segment(collective, algorithm, min_bytes, max_bytes) ->
            (segment_bytes or None, text, record or None)``, run for each rule at ``p == measured_p``
            whose algorithm is segmented, after ``confirm`` has set the rule's range (``max_bytes``
            None: no upper bound). A size becomes the rule's ``segment_bytes``; the text joins its
            reason; records are kept under ``measured["segments"]``. Segmented rules it does not
            measure leave the segment to the algorithm's default, and their reasons say so.
        machine, measured: metadata stored under ``"machine"`` and ``"measured"``.
        itemsize: the bytes of one element of the dtype the table is for (``run`` passes its
            ``dtype``'s): every threshold then falls on a whole element and no rule covers less
            than one element (see :func:`commkit.cost.crossovers`), also after ``confirm`` moves
            one. None: thresholds in single bytes, the empty call a size of its own.

    Returns:
        a table that :func:`commkit.selection.validate_table` accepts.
    """
    table = {
        "version": 1,
        "_comment": "written by `commkit tune`: thresholds in bytes as commkit.selection counts a message; "
                    "use with COMMKIT_TUNING=<this file>. Process counts without rules fall back to the "
                    "shipped defaults.",
        "machine": machine or {},
        "measured": dict(measured or {}, alpha=alpha, beta=beta, gamma=gamma, nprocs=measured_p, confirmations=[],
                         segments=[]),
        "model": "alpha-beta-gamma (commkit.cost): a message costs alpha + beta*bytes, a reduction gamma*bytes",
    }
    for collective in collectives:
        if collective not in algorithms.COLLECTIVES:
            raise InvalidArgument(f"unknown collective {collective!r}; expected one of {list(algorithms.COLLECTIVES)}.")
        rules = []
        reducing = collective in _REDUCING
        for p in sorted(procs):
            for commutative in ((True, False) if reducing else (True,)):
                merged = _regimes(collective, p, alpha, beta, gamma, commutative, itemsize)
                model = [m.regime for m in merged]
                final, notes = model, [[] for _ in model]
                if confirm is not None and p == measured_p and commutative:
                    final, notes = _confirmed(collective, model, confirm, table["measured"]["confirmations"],
                                              itemsize or 1)
                for predicted, reg, note in zip(merged, final, notes):
                    # The reason states the model's own range, then what the bench made of its ends.
                    reason = _model_reason(collective, p, predicted, alpha, beta, gamma, measured_p, commutative,
                                           itemsize or 1)
                    if reg != predicted.regime and _too_narrow(reg):
                        # Measured ends are evidence, not formula noise: such a rule stays, and says why it is narrow.
                        note = [*note, f"narrower than 1/{MIN_REGIME_FRACTION} of its lower bound once the bench "
                                       f"moved its ends; kept as measured"]
                    segment, seg_note = _segment_for(collective, p, reg, measured_p, measure_segment,
                                                     table["measured"]["segments"])
                    rules.append(_rule(p, reg, collective, "; ".join([reason, *note, *seg_note]),
                                       reducing and commutative, segment))
        table[collective] = rules
    return table


def _segment_for(collective, p, reg, measured_p, measure_segment, log):
    """``(segment_bytes or None, [note])`` for one rule; ``(None, [])`` when its algorithm takes no segment."""
    if not algorithms.get(collective, reg.algorithm).segmented:
        return None, []
    if p != measured_p:
        return None, [f"segment size not measured at p={p}: the algorithm's default applies"]
    if measure_segment is None:
        return None, ["segment size not measured: the algorithm's default applies"]
    segment, text, record = measure_segment(collective, reg.algorithm, reg.min_bytes, reg.max_bytes)
    if record is not None:
        log.append(record)
    return segment, [text]


def _confirmed(collective, regimes, confirm, log, step=1):
    """Run ``confirm`` at each crossover; return the regimes with measured boundaries, and notes for each.

    A moved boundary is rounded up to a multiple of ``step`` (one element) and kept
    where both regimes beside it still hold at least one element.
    """
    regimes = list(regimes)
    notes = [[] for _ in regimes]
    for i in range(len(regimes) - 1):
        low, high = regimes[i], regimes[i + 1]
        boundary = high.min_bytes
        lower = low.min_bytes + step
        upper = None if high.max_bytes is None else high.max_bytes + 1 - step
        result = confirm(collective, low.algorithm, high.algorithm, boundary, lower, upper)
        if result is None:
            notes[i + 1].append(f"crossover at {_size(boundary)} not benchmarked (beyond --max-bytes)")
            continue
        new, text, probes = result
        new = max(-(-new // step) * step, lower)
        new = new if upper is None else min(new, upper)
        log.append({"collective": collective, "low": low.algorithm, "high": high.algorithm,
                    "predicted": boundary, "chosen": new, "probes": probes})
        regimes[i] = cost.Regime(low.algorithm, low.min_bytes, new - 1)
        regimes[i + 1] = cost.Regime(high.algorithm, new, high.max_bytes)
        text = f"crossover {low.algorithm} -> {high.algorithm} predicted at {_size(boundary)}, {text}"
        notes[i].append(text)
        notes[i + 1].append(text)
    return regimes, notes


def run(comm, *, procs=None, collectives=None, max_bytes: int = 4 << 20, dtype="float32", op="sum",
        quick: bool = False, log=lambda text: None, machine: dict | None = None, segments=None,
        node: bool = True) -> dict:
    """Measure, derive, confirm, measure segment sizes, time the node engine; return the table on every rank.

    A collective call.

    Args:
        comm: a communicator of 2 or more ranks.
        procs: process counts to write rules for (default: ``[comm.size]``).
        collectives: default: all but barrier, scan and exscan.
        max_bytes: the largest size the confirming benchmark and the segment measurements run.
        dtype, op: what gamma and the benchmark measure.
        quick: fewer sizes and repetitions.
        log: called with progress lines (rank 0 passes ``print``).
        machine: metadata for the table's ``"machine"`` key.
        segments: the segment sizes (bytes) tried for segmented algorithms, besides each
            one's default: ``"16K,64K"`` or a list (see :func:`parse_segments`); default
            :data:`SEGMENT_LADDER`. Only sizes below the measured message are tried.
        node: where every rank shares one node (``comm.nodes == 1``), time each
            collective's ``shm`` against the table's choice at :func:`node_ladder`
            sizes and write ``one_node`` rules where it wins (see the module
            docstring); False: no node pass.

    Raises:
        InvalidArgument: fewer than 2 ranks, or bad ``segments`` (raised before anything is measured).

    Cost: the segment measurements add, for each segmented rule at ``comm.size`` ranks,
    ``(iters + 1)`` calls per candidate size (iters 5 with ``quick``, else 20); the node
    pass ``2 * (iters + 1)`` calls per collective and ladder size.
    """
    ladder = list(SEGMENT_LADDER) if segments is None else parse_segments(segments)
    segment_elements()  # a bad COMMKIT_SEGMENT_ELEMENTS fails now, not after the measurements
    if comm.size < 2:
        raise InvalidArgument("tune measures messages between ranks and needs at least 2 processes.")
    collectives = list(collectives or [c for c in algorithms.COLLECTIVES if c not in ("barrier", "scan", "exscan")])
    procs = sorted(set(procs or [comm.size]))
    reps = 3 if quick else 11
    sizes = [8, 4 << 10, 256 << 10, 2 << 20] if quick else [8, 512, 4 << 10, 32 << 10, 256 << 10, 1 << 20, 4 << 20]
    log(f"measuring alpha and beta: ring exchanges on {comm.size} ranks at {len(sizes)} sizes ...")
    points = measure_alpha_beta(comm, sizes, reps)
    alpha, beta = fit_alpha_beta(points)
    gsizes = [256 << 10, 1 << 20, 4 << 20] if quick else [256 << 10, 1 << 20, 4 << 20, 16 << 20]
    gamma, gpoints = measure_gamma(dtype, op, gsizes, reps)
    # Every rank measured its own gamma; use their mean (they share the machine's cores), and keep the mean
    # of the points behind it, so that every rank returns the same table.
    means = comm.allreduce(np.array([gamma, *(t for _, t in gpoints)]), op="sum") / comm.size
    gamma = float(means[0])
    gpoints = [(n, float(t)) for (n, _), t in zip(gpoints, means[1:])]
    log(f"alpha = {format_seconds(alpha)}, beta = {beta * 1e9:.3g} ns/B "
        f"({1 / beta / 1e9 if beta else float('inf'):.2f} GB/s), gamma = {gamma * 1e9:.3g} ns/B ({dtype} {op})")
    iters = 5 if quick else 20

    def confirm(collective, low, high, boundary, lower, upper):
        if boundary > max_bytes or boundary < 2:
            return None
        log(f"confirming {collective}: {low} -> {high} at {_size(boundary)} ...")
        return _confirm(comm, collective, low, high, boundary, lower, upper, dtype, op, iters, max_bytes)

    def measure_segment(collective, algorithm, lo, hi):
        size = _segment_probe_size(lo, hi, max_bytes)
        if size is None:
            return None, (f"segment size not measured: the rule's sizes, from {_size(lo)}, are beyond --max-bytes "
                          f"({_size(max_bytes)}), so the algorithm's default applies"), None
        log(f"measuring segment sizes for {collective} {algorithm} at {_size(size)} ...")
        segment, text, record = measure_segments(comm, collective, algorithm, size, ladder, dtype=dtype, op=op,
                                                 iters=iters)
        if record is not None:
            times = _size_times(record["probes"], record["default"])
            log(f"  {collective} {algorithm}: segment {_size(segment)} ({times})")
        return segment, text, record

    measured = {
        "how": "alpha, beta: least-squares fit of commkit ring-exchange steps (slowest rank, best of "
               f"{reps}); gamma: {op} on {dtype} in place (best of {reps}), mean of the ranks; segment sizes: "
               f"each segmented rule's algorithm at one size, with every ladder size below it and its default "
               f"(interleaved, median of {iters})",
        "dtype": dtype, "op": op,
        "exchange_points": [[n, t] for n, t in points],
        "reduce_points": [[n, t] for n, t in gpoints],
        "segment_ladder": ladder,
    }
    table = build_table(alpha, beta, gamma, procs, collectives, measured_p=comm.size, confirm=confirm,
                        measure_segment=measure_segment, machine=machine, measured=measured,
                        itemsize=np.dtype(dtype).itemsize)
    nodes = comm.nodes
    if not node:
        table["measured"]["node_pass"] = "not run: turned off (--no-node)"
    elif nodes != 1:
        why = "the transport has no node arena" if nodes is None else f"the ranks span {nodes} nodes"
        table["measured"]["node_pass"] = f"not run: {why}"
        log(f"no node pass: {why}")
    else:
        sizes = node_ladder(max_bytes, quick)
        log(f"node pass: the {comm.size} ranks share one node; timing shm against the table's choice at "
            f"{', '.join(map(_size, sizes))} ...")
        _node_pass(comm, table, collectives, sizes, dtype, op, iters, log)
        table["measured"]["node_pass"] = (f"shm against the table's choice at {comm.size} ranks, {op} on {dtype}, "
                                          f"interleaved, median of {iters} of the slowest rank's times")
    return table


def summary(table: dict) -> str:
    """A few lines describing a tuning table: the constants, each collective's thresholds and measured segments.

    Rules for one node name their transport: ``p=2 >= 1 MiB: shm (one node, mpi)``.
    """
    m = table.get("measured", {})
    lines = [f"alpha = {format_seconds(m.get('alpha', 0))}, beta = {m.get('beta', 0) * 1e9:.3g} ns/B, "
             f"gamma = {m.get('gamma', 0) * 1e9:.3g} ns/B (measured on {m.get('nprocs')} ranks)"]
    for collective in algorithms.COLLECTIVES:
        rules = table.get(collective)
        if not rules:
            continue
        parts = []
        for rule in rules:
            if rule.get("commutative") is False:
                continue
            span = _span(rule.get("min_bytes", 0), rule.get("max_bytes"))
            if rule.get("one_node"):
                extra = f" (one node, {rule.get('transport', 'any transport')})"
            else:
                extra = "" if "commutative" in rule or collective not in _REDUCING else " (non-commutative)"
            if "segment_bytes" in rule:
                extra += f" (segment {_size(rule['segment_bytes'])})"
            parts.append(f"p={rule.get('min_procs')} {span}: {rule['algorithm']}{extra}")
        lines.append(f"  {collective:<15} " + "; ".join(parts))
    return "\n".join(lines)
