"""The algorithm registry: every collective algorithm, its restrictions and its cost, as data.

Each algorithm module (one per family, as MPICH keeps one file per algorithm)
registers its schedule generators with :func:`algorithm`. The selector,
the simulator, the docs and ``commkit bench`` all read :data:`REGISTRY`, so
an algorithm is described in exactly one place.

Schedule signatures, by collective (``count`` is elements per rank unless
noted; buffers are flat and named ``"in"``, ``"out"``, ``"tmp"``):

=================  =========================================  ==========================
collective         generator arguments                        buffers
=================  =========================================  ==========================
barrier            ``(rank, size)``                           none
broadcast          ``(rank, size, count, root)``              out[count] (in at root)
reduce             ``(rank, size, count, op, root)``          in[count] -> out[count]
allreduce          ``(rank, size, count, op)``                in[count] -> out[count]
gather             ``(rank, size, count, root)``              in[count] -> out[p*count]
scatter            ``(rank, size, count, root)``              in[p*count] -> out[count]
allgather          ``(rank, size, count)``                    in[count] -> out[p*count]
reduce_scatter     ``(rank, size, counts, op)``               in[sum(counts)] -> out[counts[rank]]
alltoall           ``(rank, size, count)``                    in[p*count] -> out[p*count]
scan, exscan       ``(rank, size, count, op)``                in[count] -> out[count]
=================  =========================================  ==========================

For reduce, every rank has an ``out`` buffer (scratch on non-roots).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable

__all__ = ["Algorithm", "algorithm", "REGISTRY", "COLLECTIVES", "get", "for_collective", "log2ceil", "is_pow2"]

COLLECTIVES = (
    "barrier", "broadcast", "reduce", "allreduce", "gather", "scatter",
    "allgather", "reduce_scatter", "alltoall", "scan", "exscan",
)


def log2ceil(p: int) -> int:
    """ceil(log2(p)) for p >= 1."""
    return (p - 1).bit_length()


def is_pow2(p: int) -> bool:
    return p > 0 and p & (p - 1) == 0


@dataclass(frozen=True)
class Algorithm:
    """One algorithm for one collective.

    Attributes:
        collective: which collective it implements.
        name: the short name used in ``algorithm=``, env variables, tuning files and traces.
        schedule: the generator function (None for ``native``).
        commutative: it reorders contributions, so the op must be commutative.
        power_of_two: it needs a power-of-two number of ranks.
        scratch: ``scratch(rank, size, count) -> elements`` of the ``tmp`` buffer
            (for reduce_scatter, ``count`` is the tuple of per-rank counts).
        cost: ``cost(p, n, alpha, beta, gamma) -> seconds``, the textbook
            alpha-beta-gamma model, ``n`` in bytes as :func:`message_bytes` defines it.
        formula: the cost as text, for docs and ``commkit.cost``.
    """

    collective: str
    name: str
    schedule: Callable | None
    commutative: bool = False
    power_of_two: bool = False
    scratch: Callable[[int, int, object], int] = field(default=lambda rank, size, count: 0)
    cost: Callable | None = None
    formula: str = ""

    @property
    def qualname(self) -> str:
        return f"{self.collective}_{self.name}"

    def why_not(self, size: int, op=None) -> str | None:
        """The reason this algorithm cannot run a call, or None if it can."""
        if self.commutative and op is not None and not op.commutative:
            return f"{self.qualname} reorders contributions and needs a commutative op; {op.name!r} is not"
        if self.power_of_two and not is_pow2(size):
            return f"{self.qualname} needs a power-of-two number of ranks, got {size}"
        return None

    @property
    def doc(self) -> str:
        return (self.schedule.__doc__ or "").strip() if self.schedule else ""


REGISTRY: dict[tuple[str, str], Algorithm] = {}


def algorithm(collective: str, name: str, *, commutative=False, power_of_two=False, scratch=None,
              cost=None, formula=""):
    """Register the decorated schedule generator as ``collective``'s algorithm ``name``."""
    assert collective in COLLECTIVES, collective

    def register(fn):
        REGISTRY[(collective, name)] = Algorithm(
            collective, name, fn, commutative, power_of_two,
            scratch or (lambda rank, size, count: 0), cost, formula,
        )
        return fn

    return register


_MODULES = ("naive", "ring", "recursive_halving", "tree", "bruck", "pairwise", "dissemination", "native")
_loaded = False


def _load() -> None:
    global _loaded
    if not _loaded:
        for module in _MODULES:
            importlib.import_module(f"{__name__}.{module}")
        _loaded = True


def get(collective: str, name: str) -> Algorithm | None:
    """The algorithm ``name`` of ``collective``, or None."""
    _load()
    return REGISTRY.get((collective, name))


def for_collective(collective: str) -> dict[str, Algorithm]:
    """All algorithms of one collective, by name."""
    _load()
    return {name: alg for (coll, name), alg in REGISTRY.items() if coll == collective}
