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

Why the registry is strict. A name is how a user forces an algorithm and how
the tuning tables and the selector find one, so registering under a name that
is taken raises :class:`~commkit.errors.InvalidArgument` unless the caller
says ``replace=True`` (a student's broken ``"ring"`` once silently replaced the
real one for forced *and* automatic selection). Redefining the same function
(re-running a notebook cell, reloading its module) is not a clash. Every
check raises a real error, never an ``assert``, so ``python -O`` keeps them.

Why user algorithms load by module path. Ranks started by ``commkit launch``
or ``mpiexec`` are fresh interpreters that never ran the notebook cell or
script that registered an algorithm. A module path travels: :func:`load`
imports modules and records them in ``COMMKIT_ALGORITHMS``, which every rank
inherits and reads when its registry is first used; installed packages can
advertise modules under the entry-point group ``commkit.algorithms``.

Why costs say how exact they are. ``commkit.cost`` ranks algorithms by their
formulas and :mod:`commkit.sim` runs the schedules under the same model.
Each registration states whether its formula is the simulated time for every
p and every count (``cost_exact="always"``), only when the vector splits into
equal blocks (``cost_exact="even"``, see :func:`even_blocks`), or never
(``cost_exact="never"``: a pipelined schedule whose critical path has no closed
form, bounded instead), and, where not exact, which way it errs (``cost_bound``;
for ``"never"`` its alpha terms bound the rounds the same way).
``tests/test_sim.py`` and :func:`commkit.testing.check_algorithm` hold every
algorithm to its word.
Likewise ``symmetry`` says that every rank's schedule is rank 0's with its
peers moved, which lets :mod:`commkit.sim` run rank 0 alone for all p ranks.

Why phases. A composite algorithm (van de Geijn's broadcast: a binomial
scatter, then a ring allgather) has a root, so no rank stands for the others,
yet most of its steps belong to a phase in which every rank is alike. Built
with :func:`phased`, the schedule is one function that returns its phases in
order, each a :class:`Phase` that may declare its own ``symmetry``; the
generator every transport runs is made from those same phases, so the
schedule is still written once. :mod:`commkit.sim` then runs the rooted phase
for every rank and the symmetric one for all ranks at once.
"""

from __future__ import annotations

import importlib
import inspect
import keyword
import os
import re
import threading
import functools
import types
import warnings
from dataclasses import dataclass, field
from typing import Callable, Iterable

from ..errors import InvalidArgument

__all__ = ["Algorithm", "algorithm", "Phase", "phased", "unregister", "load", "loaded_modules", "REGISTRY", "COLLECTIVES", "get",
           "for_collective", "even_blocks", "log2ceil", "is_pow2", "ENV_VARIABLE", "ENTRY_POINT_GROUP",
           "COST_EXACT", "COST_BOUNDS", "SYMMETRIES"]

COLLECTIVES = (
    "barrier", "broadcast", "reduce", "allreduce", "gather", "scatter",
    "allgather", "reduce_scatter", "alltoall", "scan", "exscan",
    "allgatherv", "gatherv", "scatterv", "alltoallv",
)

ENV_VARIABLE = "COMMKIT_ALGORITHMS"
"""Comma-separated modules whose import registers algorithms, loaded when the registry is first used."""
ENTRY_POINT_GROUP = "commkit.algorithms"
"""Entry-point group of installed packages that register algorithms (the value names a module)."""

COST_EXACT = ("always", "even", "never")
"""When a formula equals the simulated time: for every count, when :func:`even_blocks` holds, or never (a bound)."""
COST_BOUNDS = ("lower", "upper", "either")
"""How a formula errs where it is not exact: never above the simulated time, never below, or either way."""
SYMMETRIES = ("rotation", "xor")
"""How every rank's schedule follows from rank 0's: peers shifted by the rank (mod p), or XORed with it."""

_RESERVED = {"auto": "means 'no override' to the selector", "native": "is the transport's own collective"}
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def log2ceil(p: int) -> int:
    """⌈log₂ p⌉ for p >= 1 (0 for p = 1): the rounds of a binomial tree or a butterfly over p ranks.

    The cost formulas of the built-in algorithms count rounds with it, e.g. a binomial
    broadcast's ``cost=lambda p, n, a, b, g: log2ceil(p) * (a + n * b)``.
    """
    return (p - 1).bit_length()


def is_pow2(p: int) -> bool:
    """Whether ``p`` is a power of two (1 included)."""
    return p > 0 and p & (p - 1) == 0


def even_blocks(collective: str, p: int, count) -> bool:
    """Whether a call splits into equal blocks for every algorithm, so ``cost_exact="even"`` formulas are exact.

    The vectors that algorithms cut into blocks are cut into p blocks (rings,
    pairwise) or into 2^⌊log p⌋ blocks (recursive halving), so ``count`` must be
    a multiple of both. Per-rank blocks (gather, scatter, allgather, alltoall)
    are always equal; where the count argument lists counts (reduce_scatter and
    the vector collectives), the blocks are equal when all those counts are.

    Args:
        collective: the collective.
        p: number of ranks.
        count: the schedule's count argument (per-rank counts for reduce_scatter, a
            tuple or a matrix of counts for the vector collectives).

    Returns:
        True if every block any algorithm forms has the same number of elements.
    """
    if isinstance(count, (tuple, list)):
        # A row shared by several ranks is read once: the simulator's p x p matrix of equal counts
        # is one row p times, which flattened would be p^2 entries (4.3 billion at p = 65,536).
        rows = {id(row): row for row in count if isinstance(row, (tuple, list))}.values()
        values = {c for row in rows for c in row} | {c for c in count if not isinstance(c, (tuple, list))}
        return len(values) <= 1
    if collective in ("barrier", "gather", "scatter", "allgather", "alltoall"):
        return True
    pof2 = 1 << (p.bit_length() - 1)
    return count % p == 0 and count % pof2 == 0


def _default_scratch(rank, size, count):
    return 0


@functools.lru_cache(maxsize=None)
def _takes(schedule, name: str) -> bool:
    """Whether a schedule function has the parameter ``name`` (asked once per function: planning asks often)."""
    try:
        return name in inspect.signature(schedule).parameters
    except (TypeError, ValueError):
        return False


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
        cost: ``cost(p, n, alpha, beta, gamma) -> seconds``, the alpha-beta-gamma
            model, ``n`` in bytes as the selector counts a message (see :mod:`commkit.cost`).
        formula: the cost as text, for docs and ``commkit.cost``.
        cost_exact: ``"always"`` if ``cost`` is the simulated time for every p and
            count; ``"even"`` if only when :func:`even_blocks` holds; ``"never"`` if it
            is only a bound (:attr:`cost_bound`), its alpha terms a bound on the rounds.
        cost_bound: where the formula is not exact, ``"lower"`` (it never exceeds
            the simulated time), ``"upper"`` (never below it) or ``"either"``;
            None when it is always exact.
        symmetry: ``"rotation"`` if, whenever :func:`even_blocks` holds, rank r's
            schedule is rank 0's with every peer shifted by r (mod p) and every range
            of the same length (with unequal blocks, ``"rotation"`` also promises that
            they turn with the rank: rank r's schedule is rank 0's with every block b
            read as block (b + r) mod p, which :mod:`commkit.sim` checks against one
            more rank's steps); ``"xor"`` the same with peers XORed with r, for p a
            power of two; None otherwise. :mod:`commkit.sim` then runs rank 0 alone
            (``tests/test_sim.py`` checks the result equals running every rank).
    """

    collective: str
    name: str
    schedule: Callable | None
    commutative: bool = False
    power_of_two: bool = False
    scratch: Callable[[int, int, object], int] = field(default=_default_scratch)
    cost: Callable | None = None
    formula: str = ""
    cost_exact: str = "always"
    cost_bound: str | None = None
    symmetry: str | None = None

    @property
    def qualname(self) -> str:
        return f"{self.collective}_{self.name}"

    @property
    def segmented(self) -> bool:
        """Whether the schedule takes a segment size (a ``segment=`` parameter, in elements).

        Its messages are cut into segments of that many elements; the selection
        table (``segment_bytes``), ``algorithm="name:SIZE"`` on a call or in
        ``COMMKIT_<COLLECTIVE>_ALGORITHM``, or ``COMMKIT_SEGMENT_ELEMENTS`` choose it
        (see :mod:`commkit.selection`).
        """
        if self.schedule is None:
            return False
        try:
            return "segment" in inspect.signature(self.schedule).parameters
        except (TypeError, ValueError):
            return False

    @property
    def node_aware(self) -> bool:
        """Whether the schedule takes every rank's node (a ``nodes=`` parameter: :mod:`commkit.algorithms.hier`)."""
        return self.schedule is not None and _takes(self.schedule, "nodes")

    @property
    def zero_copy(self) -> bool:
        """Whether the schedule has a form for shared arrays (a ``shared=`` parameter: :mod:`commkit.algorithms.node`).

        With ``shared=True`` it reads its peers' ``in`` and ``out`` where they lie,
        which every rank's call must allow (arrays of ``Communicator.shared_empty``).
        """
        return self.schedule is not None and _takes(self.schedule, "shared")

    def why_not(self, size: int, op=None) -> str | None:
        """The reason this algorithm cannot run a call, or None if it can."""
        if self.commutative and op is not None and not op.commutative:
            return f"{self.qualname} reorders contributions and needs a commutative op; {op.name!r} is not"
        if self.power_of_two and not is_pow2(size):
            return f"{self.qualname} needs a power-of-two number of ranks, got {size}"
        return None

    def cost_is_exact(self, p: int, count) -> bool:
        """Whether :attr:`cost` promises the simulated time for this call exactly."""
        return self.cost_exact == "always" or (self.cost_exact == "even" and even_blocks(self.collective, p, count))

    @property
    def doc(self) -> str:
        return (self.schedule.__doc__ or "").strip() if self.schedule else ""

    @property
    def phases(self) -> Callable | None:
        """``phases(rank, size, ...) -> tuple of Phase`` for a schedule built with :func:`phased`, else None.

        It takes the schedule's own arguments and returns that rank's phases, in order;
        the schedule yields exactly their steps, one phase after the other.
        """
        split = getattr(self.schedule, "phases", None) if self.schedule is not None else None
        return split if callable(split) else None


@dataclass(frozen=True)
class Phase:
    """One phase of a schedule built with :func:`phased`: this rank's steps of it, and how ranks relate in it.

    Attributes:
        steps: the phase's steps on this rank, in order (usually a generator, not yet started).
        symmetry: ``"rotation"`` if, whenever :func:`even_blocks` holds, rank r's steps of this
            phase are rank 0's with every peer shifted by r (mod p) and every range of the same
            length; ``"xor"`` the same with peers XORed with r, for p a power of two; None
            otherwise (as :attr:`Algorithm.symmetry`, for this phase alone). The phases before
            it must leave no message unmatched: every send they post is received by them.

    Raises:
        InvalidArgument: ``symmetry`` is not one of :data:`SYMMETRIES` or None.
    """

    steps: Iterable
    symmetry: str | None = None

    def __post_init__(self):
        if self.symmetry is not None and self.symmetry not in SYMMETRIES:
            raise InvalidArgument(f"Phase: symmetry must be one of {list(SYMMETRIES)} or None, got {self.symmetry!r}.")


def phased(fn: Callable) -> Callable:
    """Make a schedule generator from a function that returns the schedule's phases.

    Example::

        from commkit.schedule import partition

        @algorithm("broadcast", "scatter_allgather")
        @phased
        def broadcast_scatter_allgather(rank, size, count, root):
            blocks = partition(count, size)
            return (Phase(my_scatter(rank, size, blocks, root)),
                    Phase(my_ring_allgather(rank, size, blocks), symmetry="rotation"))

    Args:
        fn: ``fn(rank, size, ...) -> sequence of Phase``, with the schedule's arguments.

    Returns:
        The schedule: a generator function with ``fn``'s name, signature and docstring that
        yields the steps of every phase ``fn`` returns, in order. ``fn`` itself stays
        reachable as its ``phases`` attribute (:attr:`Algorithm.phases`), which is how
        :mod:`commkit.sim` runs each phase on its own.

    Raises:
        InvalidArgument: ``fn`` is not callable; from the schedule, when ``fn`` returns
            something other than a sequence of :class:`Phase`.
    """
    if not callable(fn):
        raise InvalidArgument(f"phased decorates a function that returns a schedule's phases; got {fn!r}.")

    @functools.wraps(fn)
    def schedule(*args, **kwargs):
        for phase in fn(*args, **kwargs):
            if not isinstance(phase, Phase):
                raise InvalidArgument(
                    f"{_where(fn)} must return a sequence of commkit.algorithms.Phase (it is @phased); "
                    f"one of its phases is {phase!r}.")
            yield from phase.steps

    schedule.phases = fn
    return schedule


REGISTRY: dict[tuple[str, str], Algorithm] = {}


def _where(fn) -> str:
    return f"{getattr(fn, '__module__', None) or '?'}.{getattr(fn, '__qualname__', None) or type(fn).__name__}"


def _is_builtin(fn) -> bool:
    return (getattr(fn, "__module__", None) or "").startswith(__name__ + ".")


def _check_registration(collective, name, commutative, power_of_two, scratch, cost, formula, cost_exact,
                        cost_bound, symmetry) -> None:
    what = f"algorithm({collective!r}, {name!r})"
    if collective not in COLLECTIVES:
        raise InvalidArgument(f"{what}: unknown collective {collective!r}; expected one of {list(COLLECTIVES)}.")
    if not isinstance(name, str) or not _NAME.fullmatch(name) or keyword.iskeyword(name):
        raise InvalidArgument(
            f"{what}: the name must be a Python identifier such as 'my_ring' (it appears in algorithm=, "
            f"environment variables and tuning files), got {name!r}.")
    if name in _RESERVED:
        raise InvalidArgument(f"{what}: the name {name!r} is reserved: it {_RESERVED[name]}. Choose another name.")
    for flag, value in (("commutative", commutative), ("power_of_two", power_of_two)):
        if not isinstance(value, bool):
            raise InvalidArgument(f"{what}: {flag} must be True or False, got {value!r}.")
    for arg, value, shape in (("scratch", scratch, "scratch(rank, size, count) -> elements"),
                              ("cost", cost, "cost(p, n, alpha, beta, gamma) -> seconds")):
        if value is not None and not callable(value):
            raise InvalidArgument(f"{what}: {arg} must be a function {shape} or None, got {value!r}.")
    if not isinstance(formula, str):
        raise InvalidArgument(f"{what}: formula must be the cost as text, got {type(formula).__name__}.")
    if cost is not None and not formula.strip():
        raise InvalidArgument(
            f"{what}: a cost function needs its formula as text (formula='...'), for the docs and "
            "commkit.cost.formula; got none.")
    if cost_exact not in COST_EXACT:
        raise InvalidArgument(f"{what}: cost_exact must be one of {list(COST_EXACT)}, got {cost_exact!r}.")
    if cost_exact == "always" and cost_bound is not None:
        raise InvalidArgument(
            f"{what}: cost_bound={cost_bound!r} describes where the formula is not exact, but cost_exact='always' "
            "says it always is; use cost_exact='even' or leave cost_bound out.")
    if cost_exact != "always" and cost_bound not in COST_BOUNDS:
        raise InvalidArgument(
            f"{what}: cost_exact={cost_exact!r} needs cost_bound, one of {list(COST_BOUNDS)}, saying how the "
            f"formula errs for uneven blocks; got {cost_bound!r}.")
    if symmetry is not None and symmetry not in SYMMETRIES:
        raise InvalidArgument(f"{what}: symmetry must be one of {list(SYMMETRIES)} or None, got {symmetry!r}.")


def algorithm(collective: str, name: str, *, commutative: bool = False, power_of_two: bool = False,
              scratch: Callable | None = None, cost: Callable | None = None, formula: str = "",
              cost_exact: str = "always", cost_bound: str | None = None, symmetry: str | None = None,
              replace: bool = False):
    """Register the decorated schedule generator as ``collective``'s algorithm ``name``.

    Example::

        @algorithm("allreduce", "my_ring", commutative=True, scratch=lambda r, p, n: n)
        def allreduce_my_ring(rank, size, count, op):
            ...

    Args:
        collective: one of :data:`COLLECTIVES`.
        name: a Python identifier, not ``auto`` or ``native``.
        commutative: the algorithm reorders contributions (needs a commutative op).
        power_of_two: the algorithm needs a power-of-two number of ranks.
        scratch: ``scratch(rank, size, count) -> elements`` of the ``tmp`` buffer (default none).
        cost: ``cost(p, n, alpha, beta, gamma) -> seconds`` (n in bytes as the selector counts them).
        formula: the cost as text; required with ``cost``.
        cost_exact: ``"always"``, ``"even"`` or ``"never"``; see :class:`Algorithm`.
        cost_bound: ``"lower"``, ``"upper"`` or ``"either"`` when ``cost_exact`` is ``"even"`` or ``"never"``.
        symmetry: ``"rotation"`` or ``"xor"`` if every rank's schedule is rank 0's with peers
            moved (see :class:`Algorithm`): the simulator then runs one rank for all.
        replace: replace an algorithm already registered under this name (built-ins included).

    Returns:
        The decorator, which registers the function and returns it unchanged.

    Raises:
        InvalidArgument: a bad argument (raised at once), or, from the decorator, a
            name already taken by another function without ``replace=True``, or a
            decorated object that is not callable.
    """
    _check_registration(collective, name, commutative, power_of_two, scratch, cost, formula, cost_exact, cost_bound,
                        symmetry)
    if not isinstance(replace, bool):
        raise InvalidArgument(f"algorithm({collective!r}, {name!r}): replace must be True or False, got {replace!r}.")

    def register(fn):
        if not callable(fn):
            raise InvalidArgument(
                f"algorithm({collective!r}, {name!r}) decorates a schedule generator function; got {fn!r}.")
        if not _is_builtin(fn):
            _load_builtins()  # so that a clash with a built-in is seen now, not when the built-ins load later
        old = REGISTRY.get((collective, name))
        if old is not None and not replace and not _same_function(old.schedule, fn):
            raise InvalidArgument(
                f"{collective} algorithm {name!r} is already registered (by {_where(old.schedule)}); registering "
                f"{_where(fn)} under the same name would replace it for forced and automatic selection. "
                f"Choose another name, or pass replace=True to replace it on purpose."
            )
        REGISTRY[(collective, name)] = Algorithm(
            collective, name, fn, commutative, power_of_two, scratch or _default_scratch, cost, formula,
            cost_exact, cost_bound, symmetry,
        )
        if old is not None or _ready:
            _changed(collective, name)
        return fn

    return register


_LISTENERS: list = []


def on_change(listener: Callable[[str, str], None]) -> None:
    """Call ``listener(collective, name)`` whenever an algorithm is registered or unregistered.

    The communicators use it to drop what they cached for the old schedule, so an
    edited algorithm (``replace=True``, a re-run notebook cell) runs at its next call.
    """
    _LISTENERS.append(listener)


def _changed(collective: str, name: str) -> None:
    for listener in _LISTENERS:
        listener(collective, name)


def is_node_only(alg: "Algorithm") -> bool:
    """Whether ``alg`` runs only among ranks that share memory (the node engine's one-sided algorithms)."""
    return getattr(alg.schedule, "__module__", None) == __name__ + ".node"


def is_builtin(alg: "Algorithm") -> bool:
    """Whether ``alg``'s schedule is one of commkit's own (not registered by a user or a plugin)."""
    return _is_builtin(alg.schedule)


def _same_function(old, new) -> bool:
    """The same top-level function defined again: a re-run notebook cell or a reloaded module."""
    if old is new:
        return True
    if old is None:
        return False
    where = _where(new)
    # Functions made inside other functions share a name but may differ: those never count as the same.
    return where == _where(old) and "<lambda>" not in where and "<locals>" not in where


def unregister(collective: str, name: str) -> Algorithm:
    """Remove an algorithm from the registry (e.g. one registered only for a check) and return it.

    Raises:
        InvalidArgument: no algorithm ``name`` is registered for ``collective``.
    """
    _load()
    alg = REGISTRY.pop((collective, name), None)
    if alg is None:
        raise InvalidArgument(
            f"cannot unregister {collective} algorithm {name!r}: it is not registered; "
            f"{collective} has {sorted(n for c, n in REGISTRY if c == collective)}.")
    _changed(collective, name)
    return alg


_MODULES = ("naive", "ring", "pipelined", "recursive_halving", "tree", "bruck", "pairwise", "dissemination", "vector",
            "chain", "binary_tree", "double_tree", "node", "native")
# Loading is guarded by one re-entrant lock: rank threads of a threads world ask the registry at
# the same moment, and must wait for a load in progress; the thread that loads re-enters it when
# the modules it imports register their algorithms (or a plugin asks the registry for one).
_lock = threading.RLock()
_builtins_loaded = False
_loading_builtins = False
_loading_plugins = False
_ready = False  # built-ins and plugins loaded: the lock-free fast path
_user_modules: list[str] = []


def _load_builtins() -> None:
    global _builtins_loaded, _loading_builtins
    if _builtins_loaded:
        return
    with _lock:
        if _builtins_loaded or _loading_builtins:
            return
        _loading_builtins = True
        try:
            for module in _MODULES:
                importlib.import_module(f"{__name__}.{module}")
            _builtins_loaded = True
        finally:
            _loading_builtins = False


def _load() -> None:
    """Load the built-in algorithms, then, once, those ``COMMKIT_ALGORITHMS`` and entry points name."""
    global _loading_plugins, _ready
    if _ready:
        return
    with _lock:
        _load_builtins()
        if _ready or _loading_plugins or _loading_builtins:
            return
        _loading_plugins = True
        try:
            _import(_split(os.environ.get(ENV_VARIABLE, "")), f"from the environment variable {ENV_VARIABLE}")
            _load_entry_points()
            _ready = True  # not set on failure: the next use fails again, rather than silently lacking them
        finally:
            _loading_plugins = False


def _split(text: str) -> list[str]:
    return [m.strip() for m in text.split(",") if m.strip()]


def _import(modules, source: str) -> None:
    for module in modules:
        if not isinstance(module, str) or not all(_NAME.fullmatch(part) for part in module.split(".")):
            raise InvalidArgument(
                f"cannot load algorithms {source}: expected a dotted module path such as 'mypkg.myalgs', "
                f"got {module!r}.")
        try:
            importlib.import_module(module)
        except InvalidArgument as exc:
            raise InvalidArgument(f"loading algorithms from module {module!r} ({source}) failed: {exc}") from exc
        except Exception as exc:
            raise InvalidArgument(
                f"cannot load algorithms from module {module!r} ({source}): {type(exc).__name__}: {exc}. "
                "The module must be importable from sys.path in this process (and in every rank)."
            ) from exc
        if module not in _user_modules:
            _user_modules.append(module)


def _load_entry_points() -> None:
    try:
        from importlib.metadata import entry_points

        found = entry_points(group=ENTRY_POINT_GROUP)
    except Exception:  # noqa: BLE001 - broken metadata must not stop the built-in algorithms
        return
    for ep in found:
        try:
            obj = ep.load()
            if callable(obj) and not isinstance(obj, types.ModuleType):
                obj()
        except Exception as exc:  # noqa: BLE001 - an installed plugin must not break every collective
            warnings.warn(
                f"commkit: the algorithms of entry point {ep.name!r} ({ep.value}, group {ENTRY_POINT_GROUP!r}) "
                f"were not loaded: {type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=3)


def load(*modules: str) -> list[Algorithm]:
    """Import modules that register algorithms, here and in every process started from here.

    The modules are also added to the environment variable ``COMMKIT_ALGORITHMS``
    of this process, so ranks started by :func:`commkit.launch`, ``commkit ... -n``
    or ``mpiexec`` from it (which inherit the environment) load them when their
    registry is first used. A module already imported registers nothing new.

    Args:
        modules: dotted module paths, e.g. ``"mypkg.myalgs"``; each must be importable.

    Returns:
        The algorithms registered by functions of those modules (new or not).

    Raises:
        InvalidArgument: a module path is malformed, the import fails, or the module
            registers a name that is taken (the message says which).
    """
    _load()
    with _lock:
        _import(modules, "given to commkit.algorithms.load")
    current = _split(os.environ.get(ENV_VARIABLE, ""))
    merged = current + [m for m in modules if m not in current]
    if merged != current:
        os.environ[ENV_VARIABLE] = ",".join(merged)
    wanted = set(modules)
    return [alg for alg in REGISTRY.values()
            if alg.schedule is not None and getattr(alg.schedule, "__module__", None) in wanted]


def loaded_modules() -> tuple[str, ...]:
    """Modules loaded through :func:`load` or ``COMMKIT_ALGORITHMS``, in load order."""
    return tuple(_user_modules)


def get(collective: str, name: str) -> Algorithm | None:
    """The algorithm ``name`` of ``collective``, or None."""
    _load()
    return REGISTRY.get((collective, name))


def for_collective(collective: str) -> dict[str, Algorithm]:
    """All algorithms of one collective, by name."""
    _load()
    return {name: alg for (coll, name), alg in REGISTRY.items() if coll == collective}
