"""The alpha-beta-gamma cost model, for teaching and for tuning.

Every algorithm in :mod:`commkit.algorithms` declares its textbook cost
(Thakur, Rabenseifner and Gropp, "Optimization of Collective Communication
Operations in MPICH", IJHPCA 2005; Chan et al., "Collective communication:
theory, practice, and experience", 2007): a message costs ``alpha`` seconds
plus ``beta`` seconds per byte, and reducing costs ``gamma`` seconds per byte.
This module evaluates those formulas, ranks the algorithms and finds the sizes
at which the winner changes::

    >>> from commkit import cost
    >>> [w.algorithm for w in cost.best("allreduce", 64, 1 << 20)][:3]   # who wins at p=64 for 1 MiB?
    ['rabenseifner', 'rabenseifner_textbook', 'ring']

(The textbook form of an algorithm sends the same messages and costs the same.)

::

    >>> cost.crossovers("allreduce", 64, itemsize=4)           # where does the winner change? (float32)
    [Regime('recursive_doubling', 0, 35103), Regime('rabenseifner', 35104, 16777219),
     Regime('ring_pipelined', 16777220, None)]
    >>> print(cost.table("allreduce", 64, 1 << 20))            # doctest: +SKIP

Message sizes are counted as :mod:`commkit.selection` counts them, and the
formulas' ``n`` is that same number, so a crossover is a threshold a tuning
file can use directly: the per-rank vector for allreduce, reduce, broadcast,
scan and exscan; the whole gathered or scattered vector for gather, scatter
and allgather; the whole input for reduce_scatter; the block sent to each
peer for alltoall.

:func:`commkit.sim.simulate` runs the schedules themselves under the same
model. Each formula is the simulated time for every p, either always or when
the vector splits into equal blocks; where it is not exact its registration
says whether it is a lower or an upper bound (``cost_exact`` and
``cost_bound`` of :class:`commkit.algorithms.Algorithm`, see :func:`accuracy`).
``tests/test_sim.py`` checks every algorithm's claim for p = 1 ... 64.

Two more models describe machines the formulas do not, and the simulator runs
the schedules under them (``model=`` of :func:`commkit.sim.simulate`, see
docs/cost_models.md): :class:`LogGP`, where each rank's processor and its link
are separate resources, so that overlapped and pipelined steps gain what they
should; and :class:`TwoLevel`, where ranks sit on nodes and a message between
nodes costs more than one within a node. Their defaults derive from
:data:`ALPHA`, :data:`BETA` and :data:`GAMMA` (and, between nodes,
:data:`ALPHA_INTER` and :data:`BETA_INTER`).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import algorithms, collectives, sim
from ._crossover import changes
from ._models import ALPHA, ALPHA_INTER, BETA, BETA_INTER, GAMMA, MODELS, LogGP, TwoLevel, checked_constants
from ._units import format_seconds
from .errors import InvalidArgument

# The constants and the timing models live in _models (the simulator needs them, and this
# module runs the simulator); they are commkit.cost's public names, documented there.

__all__ = ["ALPHA", "ALPHA_INTER", "BETA", "BETA_INTER", "GAMMA", "MODELS", "LogGP", "Prediction", "Regime",
           "TwoLevel", "accuracy", "applicable", "best", "constants", "crossovers", "formula", "model_bytes",
           "predict", "simulate", "table"]

_TIE = 1e-9  # relative: predictions this close are a tie, broken by the selector's preference order


@dataclass(frozen=True)
class Prediction:
    """One algorithm's predicted time for one call."""

    algorithm: str
    seconds: float
    formula: str

    def __repr__(self) -> str:
        return f"Prediction({self.algorithm!r}, {self.seconds:.4g} s)"


@dataclass(frozen=True)
class Regime:
    """A size range (bytes, inclusive; ``max_bytes`` None = unbounded) over which one algorithm wins."""

    algorithm: str
    min_bytes: int
    max_bytes: int | None

    def __repr__(self) -> str:
        return f"Regime({self.algorithm!r}, {self.min_bytes}, {self.max_bytes})"


def _algorithm(collective, algorithm):
    if collective not in algorithms.COLLECTIVES:
        raise InvalidArgument(f"unknown collective {collective!r}; expected one of {list(algorithms.COLLECTIVES)}.")
    alg = algorithms.get(collective, algorithm)
    if alg is None or alg.cost is None:
        known = sorted(n for n, a in algorithms.for_collective(collective).items() if a.cost is not None)
        if alg is None:
            what = "is unknown"
        elif alg.schedule is None:
            what = "has no cost formula (it is the transport's own)"
        else:
            what = "has no cost formula (register it with cost= and formula= to predict it)"
        raise InvalidArgument(f"{collective} algorithm {algorithm!r} {what}; expected one of {known}.")
    return alg


def _check_size(p, nbytes):
    if isinstance(p, bool) or not isinstance(p, int) or p < 1:
        raise InvalidArgument(f"p must be an int >= 1, got {p!r}.")
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)) or not nbytes >= 0:
        raise InvalidArgument(f"nbytes must be a non-negative number of bytes, got {nbytes!r}.")


def model_bytes(collective: str, p: int, nbytes: float) -> float:
    """The ``n`` of the formulas for a message of ``nbytes`` as the selector counts it: the same number.

    Kept for callers of earlier versions, in which alltoall's formulas counted all
    p blocks a rank sends; every formula now counts what the selector counts
    (for alltoall, one block).
    """
    return nbytes


def accuracy(collective: str, algorithm: str) -> str:
    """How exact the algorithm's formula is, in words (``"exact"``, or when it is exact and which bound it is).

    Raises:
        InvalidArgument: unknown collective or algorithm, or one without a formula.
    """
    alg = _algorithm(collective, algorithm)
    if alg.cost_exact == "always":
        return "exact"
    side = {"lower": "a lower bound", "upper": "an upper bound", "either": "an estimate"}[alg.cost_bound]
    if alg.cost_exact == "never":
        return f"{side} for every call"
    return f"exact for equal blocks, otherwise {side}"


def predict(collective: str, algorithm: str, p: int, nbytes: float, *, alpha: float | None = None,
            beta: float | None = None, gamma: float | None = None) -> float:
    """Predicted seconds for ``collective``'s ``algorithm`` on ``p`` ranks and ``nbytes`` bytes.

    Cost: the algorithm's closed-form formula (see :func:`formula`), evaluated once.
    """
    alg = _algorithm(collective, algorithm)
    _check_size(p, nbytes)
    a, b, g = checked_constants(alpha, beta, gamma)
    return float(alg.cost(p, model_bytes(collective, p, nbytes), a, b, g))


def formula(collective: str, algorithm: str) -> str:
    """The algorithm's cost formula as text, e.g. ``2(p-1)α + 2((p-1)/p)nβ + ((p-1)/p)nγ``."""
    return _algorithm(collective, algorithm).formula


def _op(commutative: bool):
    """"sum", or a stand-in non-commutative op (restrictions only look at the flag)."""
    from .ops import SUM, Op

    return SUM if commutative else Op(lambda a, b: a, commutative=False, name="non-commutative")


def applicable(collective: str, p: int, commutative: bool = True) -> list[str]:
    """Names of the algorithms (with a cost formula) that can run ``collective`` on ``p`` ranks.

    The node engine's one-sided algorithms (``shm``) run only among ranks that
    share memory, where α is a flag's latency rather than a message's: this
    model of p ranks on a network leaves them out (the simulator prices them).
    """
    op = _op(commutative)
    names = []
    for name, alg in algorithms.for_collective(collective).items():
        if alg.cost is None or algorithms.is_node_only(alg):
            continue
        if alg.why_not(p, op if collective in collectives.REDUCING else None):
            continue
        names.append(name)
    return names


# Ties in the model (ring and Rabenseifner cost the same at p = 2) go to the
# algorithm with the simpler traffic pattern: neighbour-only ring before the
# recursive pairings, which measured up to 2-4x slower (and far noisier) at
# p = 2 between 512 KiB and 2 MiB on the 2-core development machine.
_TIE_ORDER = {"allreduce": ("recursive_doubling", "ring", "rabenseifner", "naive")}


def _preference(collective):
    """Tie-break order: an explicit order where one is known, else the selector's fallback order, then by name."""
    from .selection import FALLBACK

    order = _TIE_ORDER.get(collective) or FALLBACK.get(collective, ())
    return lambda name: (order.index(name) if name in order else len(order), name)


def best(collective: str, p: int, nbytes: float, *, alpha: float | None = None, beta: float | None = None,
         gamma: float | None = None, commutative: bool = True) -> list[Prediction]:
    """Every applicable algorithm's prediction, fastest first ("which wins at p=64 for 1 MiB?").

    Ties (within a relative 1e-9) keep the selector's preference order.
    """
    if collective not in algorithms.COLLECTIVES:
        raise InvalidArgument(f"unknown collective {collective!r}; expected one of {list(algorithms.COLLECTIVES)}.")
    _check_size(p, nbytes)
    a, b, g = checked_constants(alpha, beta, gamma)
    n = model_bytes(collective, p, nbytes)
    prefer = _preference(collective)
    preds = []
    for name in applicable(collective, p, commutative):
        alg = algorithms.get(collective, name)
        preds.append(Prediction(name, float(alg.cost(p, n, a, b, g)), alg.formula))
    fastest = min((x.seconds for x in preds), default=0.0)
    return sorted(preds, key=lambda x: (x.seconds > fastest * (1 + _TIE), x.seconds, prefer(x.algorithm)))


def _winner(collective, p, nbytes, a, b, g, commutative):
    return best(collective, p, nbytes, alpha=a, beta=b, gamma=g, commutative=commutative)[0].algorithm


def crossovers(collective: str, p: int, *, alpha: float | None = None, beta: float | None = None,
               gamma: float | None = None, commutative: bool = True, max_bytes: int = 1 << 34,
               itemsize: int | None = None) -> list[Regime]:
    """The size ranges over which each algorithm is predicted fastest, smallest sizes first.

    Scans 16 sizes per octave (powers of two and 15 steps between them) up to
    ``max_bytes`` and bisects each change of winner to the exact size, so
    ``Regime.min_bytes`` is the first size at which the algorithm wins. The last
    regime is unbounded. Costs are not monotone in n everywhere (a segmented
    algorithm's segment count jumps), so an algorithm can win on an island
    inside another's range: the dense scan finds every island wider than
    1/16 of an octave (a power-of-two scan missed ring_pipelined's win from 64 to
    83 MiB at p = 165).

    With ``itemsize`` (the bytes of one element of the call's dtype) the sizes
    are whole elements: every boundary is a multiple of ``itemsize`` and no
    regime is narrower than one element, so each regime holds calls that can
    happen and its rules can be probed. The first regime is the winner at one
    element, and it also covers the empty call: for 0 bytes a schedule that
    sends nothing for an empty vector (the segmented ones) costs nothing at all
    and would otherwise win a regime of that one size, which no call of data
    falls into. Without ``itemsize`` every byte count is a size of its own,
    0 included, so each regime's winner is :func:`best`'s at every size in it.

    Raises:
        InvalidArgument: a bad ``p``, constant or ``itemsize``.

    Cost: O(16 log2(max_bytes) * algorithms) formula evaluations, plus a bisection per crossover.
    """
    _check_size(p, 0)
    a, b, g = checked_constants(alpha, beta, gamma)
    if itemsize is not None and (isinstance(itemsize, bool) or not isinstance(itemsize, int) or itemsize < 1):
        raise InvalidArgument(f"itemsize must be the bytes of one element, an int >= 1, got {itemsize!r}.")
    step = itemsize or 1
    first = 0 if itemsize is None else 1  # in units of `step`: the empty call, or one element

    def win(units):
        return _winner(collective, p, units * step, a, b, g, commutative)

    top = max(int(max_bytes) // step, first + 1)
    grid = sorted({first} | {(1 << k) + j * (1 << k) // 16 for k in range(max(1, top.bit_length()))
                             for j in range(16)})
    regimes = []
    start, current = 0, win(first)
    for units, old, new in changes(win, grid):
        regimes.append(Regime(old, start, units * step - 1))
        start, current = units * step, new
    regimes.append(Regime(current, start, None))
    return regimes


def table(collective: str, p: int, nbytes: int, *, alpha: float | None = None, beta: float | None = None,
          gamma: float | None = None, commutative: bool = True, simulate: bool = False, itemsize: int = 4,
          model=None, ranks_per_node: int | None = None) -> str:
    """A text table ranking the algorithms for one call, with their formulas.

    With ``simulate=True`` each algorithm's schedules also run in the simulator,
    which adds its predicted time, rounds and messages per rank (the formulas
    assume the ideal case; the simulator runs the real schedule, uneven blocks
    and non-power-of-two folds included). ``model`` and ``ranks_per_node`` choose
    the simulator's model (see :func:`commkit.sim.simulate`) and imply
    ``simulate=True``; the ranking and the formulas stay alpha-beta-gamma's.
    """
    a, b, g = checked_constants(alpha, beta, gamma)
    ranking = best(collective, p, nbytes, alpha=a, beta=b, gamma=g, commutative=commutative)
    header = f"{collective} on p={p}, {nbytes} B (alpha={a:.3g} s, beta={b:.3g} s/B, gamma={g:.3g} s/B)"
    timing = {"model": model, "ranks_per_node": ranks_per_node}
    if not isinstance(model, (LogGP, TwoLevel)):
        timing.update(alpha=a, beta=b, gamma=g)  # an instance holds its own constants
    if model is not None or ranks_per_node is not None:
        simulate = True
        header += f"; simulated under {model if model is not None else f'ranks_per_node={ranks_per_node}'}"
    rows = [("algorithm", "predicted", "simulated", "rounds", "msgs/rank", "formula") if simulate
            else ("algorithm", "predicted", "formula")]
    for pred in ranking:
        if simulate:
            res = sim.simulate(collective, pred.algorithm, p, int(nbytes), itemsize=itemsize,
                               op=_op(commutative), **timing)
            rows.append((pred.algorithm, format_seconds(pred.seconds, 4), format_seconds(res.time, 4),
                         str(res.rounds),
                         str(max(res.messages)), pred.formula))
        else:
            rows.append((pred.algorithm, format_seconds(pred.seconds, 4), pred.formula))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = [header]
    for row in rows:
        lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1])
    return "\n".join(lines)


def constants(tuning=None) -> tuple[float, float, float]:
    """``(alpha, beta, gamma)`` measured by ``commkit tune``: from a tuning file's path or table.

    With no argument, from the file ``COMMKIT_TUNING`` names; the defaults
    (:data:`ALPHA`, :data:`BETA`, :data:`GAMMA`) where none is set.

    Raises:
        InvalidArgument: the file cannot be read, is not a tuning table, or holds no measurements.
    """
    import os

    from .selection import load_table

    if tuning is None:
        tuning = os.environ.get("COMMKIT_TUNING")
        if not tuning:
            return ALPHA, BETA, GAMMA
    table = load_table(tuning) if isinstance(tuning, str) else tuning
    measured = table.get("measured") if isinstance(table, dict) else None
    if not isinstance(measured, dict) or not all(k in measured for k in ("alpha", "beta", "gamma")):
        where = tuning if isinstance(tuning, str) else "the table"
        raise InvalidArgument(f"{where} has no measured alpha, beta and gamma; write one with `commkit tune`.")
    return tuple(checked_constants(measured["alpha"], measured["beta"], measured["gamma"]))


def simulate(*args, **kwargs):
    """:func:`commkit.sim.simulate`: ``simulate("allreduce", "ring", 64, 1 << 20)``.

    Its ``model=`` takes ``"alpha-beta"`` (the default), ``"loggp"``, a :class:`LogGP`,
    ``"two-level"`` with ``ranks_per_node=``, or a :class:`TwoLevel`.
    """
    return sim.simulate(*args, **kwargs)
