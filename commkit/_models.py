"""The cost model's constants and its timing models (LogGP, two-level).

Public as :mod:`commkit.cost`'s names (``commkit.cost.ALPHA``, ``commkit.cost.LogGP`` ...);
kept here so that :mod:`commkit.sim` (which runs schedules under these models) and
:mod:`commkit.cost` (which also runs the simulator) import them without importing
each other. See docs/cost_models.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import InvalidArgument

# Defaults: commkit's own costs over MPICH shared memory, as `commkit tune -n 2` measured
# them on a 2-core x86-64 VM (mpich 5.0.2 wheels, mpi4py 4.1.2, NumPy 2, float32 sum):
# alpha 3.17 us, beta 0.064 ns/B, gamma 0.053 ns/B, rounded. alpha is one schedule step
# through the executor, Python included, so it is a few times a C MPI's shared-memory
# latency; between machines over a network alpha and beta are larger. Measure your own
# with `commkit tune` and pass them in, or read them from its file with :func:`constants`.
ALPHA = 3e-6
"""Seconds per message: one commkit transfer step over MPICH shared memory (measured, see above)."""
BETA = 6.5e-11
"""Seconds per byte sent (about 15 GB/s, shared memory)."""
GAMMA = 5e-11
"""Seconds per byte reduced (float32 sum with NumPy, in place, arrays larger than the caches)."""

# Between nodes nothing was measured on the development machine (it is one node). The defaults
# describe a commodity cluster as an assumption, not a measurement: commkit's step (alpha above)
# plus a few microseconds of network latency, and about 2.5 GB/s (a 25 Gb/s link). They make
# crossing a node cost about 3x the latency and 6x the time per byte of staying inside it.
ALPHA_INTER = 1e-5
"""Seconds per message between two nodes (two-level model; an assumption, see above)."""
BETA_INTER = 4e-10
"""Seconds per byte sent between two nodes (about 2.5 GB/s; an assumption, see above)."""

MODELS = ("alpha-beta", "loggp", "two-level")
"""The simulator's models by name (:func:`commkit.sim.simulate`'s ``model=``)."""


def _check_seconds(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise InvalidArgument(f"{name} must be a non-negative number of seconds, got {value!r}.")
    return float(value)


def checked_constants(alpha, beta, gamma) -> list:
    """``[alpha, beta, gamma]`` in seconds, each None replaced by its default (:data:`ALPHA`, ...).

    Raises:
        InvalidArgument: a value that is not a non-negative number.
    """
    out = []
    for name, value, default in (("alpha", alpha, ALPHA), ("beta", beta, BETA), ("gamma", gamma, GAMMA)):
        out.append(_check_seconds(name, default if value is None else value))
    return out


@dataclass(frozen=True)
class LogGP:
    """The LogGP model (Alexandrov et al., 1995): a rank's processor and its link are separate resources.

    A message of ``k`` bytes from rank s to rank d:

    1. s's processor spends ``o`` posting it (one ``o`` per send, one after another);
    2. s's link injects it once the processor has posted it and the link is free,
       taking ``k*G``; the link starts its next message no sooner than ``max(g, k*G)``
       after this one started (``g``: the gap, the least time between two messages);
    3. its first byte reaches d after ``L``; d's link receives it in ``k*G``, one
       message after another, again at least ``g`` apart;
    4. d's processor spends ``o`` on it once it has fully arrived.

    One message alone thus takes ``o + L + k*G + o``. A reduction takes ``gamma``
    seconds per byte of the processor's time, and a copy is free, as in the
    alpha-beta-gamma model. Because the processor is free while the link works,
    the local steps a transfer carries in ``overlap=`` (a pipelined ring's
    reduction of the previous segment) run between the posting of the sends and
    the arrival of the receives, and a rank whose send is on the wire can already
    reduce: a pipelined schedule gains what it should, and no more.

    Messages are eager: a send leaves when its sender posts it, whether or not
    the receive is posted yet, and the receive's overhead is paid when both the
    message and the receiving processor are there. (The simulator still treats a
    send nobody receives as a deadlock, as in the alpha-beta model.)

    Defaults come from the alpha-beta-gamma constants: ``2o + L = ALPHA`` with
    ``o = L = ALPHA/3`` (commkit's per-message cost is mostly its processor's:
    Python steps on both ends), ``g = o`` (the link takes a new message as fast as
    a processor can post one), ``G = BETA`` and ``gamma = GAMMA``; so a single
    message costs the same in both models. Use :meth:`from_alpha_beta` to derive
    them from measured constants.

    Attributes:
        L: seconds from injecting a message's first byte to its arrival at the other end.
        o: seconds of processor time to send, and to receive, one message.
        g: least seconds between the starts of two messages on one rank's link (each direction).
        G: seconds per byte on the link.
        gamma: seconds per byte reduced.
    """

    L: float = ALPHA / 3
    o: float = ALPHA / 3
    g: float = ALPHA / 3
    G: float = BETA
    gamma: float = GAMMA

    def __post_init__(self):
        for name in ("L", "o", "g", "G", "gamma"):
            object.__setattr__(self, name, _check_seconds(name, getattr(self, name)))

    @classmethod
    def from_alpha_beta(cls, alpha: float | None = None, beta: float | None = None,
                        gamma: float | None = None) -> LogGP:
        """The LogGP parameters that give one message the alpha-beta time: ``o = L = g = alpha/3``, ``G = beta``."""
        a, b, g = checked_constants(alpha, beta, gamma)
        return cls(L=a / 3, o=a / 3, g=a / 3, G=b, gamma=g)

    @property
    def alpha(self) -> float:
        """The latency one message sees alone, ``2o + L`` (the alpha it matches)."""
        return 2 * self.o + self.L


_PLACEMENTS = ("block", "cyclic")


@dataclass(frozen=True)
class TwoLevel:
    """The two-level alpha-beta-gamma model: ranks grouped into nodes, messages dearer between nodes.

    A message between two ranks of one node costs ``alpha + k*beta``; between
    nodes ``alpha_inter + k*beta_inter``. A transfer (every send and receive of one
    step) costs, for the messages within the node and those between nodes
    separately, what the alpha-beta model charges (``m*alpha + beta*max(bytes out,
    bytes in)``, m the larger of its send and receive counts), and the step takes
    the longer of the two: shared memory and the network adapter work at once.
    With one node (or every rank alone on its node) it is the alpha-beta model
    with that level's constants.

    Attributes:
        ranks_per_node: ranks on each node (the last node may hold fewer).
        alpha, beta: seconds per message and per byte within a node (default :data:`ALPHA`, :data:`BETA`).
        alpha_inter, beta_inter: the same between nodes (default :data:`ALPHA_INTER`, :data:`BETA_INTER`).
        gamma: seconds per byte reduced.
        placement: which node each rank is on: ``"block"`` (ranks 0..k-1 on node 0,
            the next k on node 1, ...: what ``mpiexec`` does by default), ``"cyclic"``
            (rank r on node r mod nodes: round-robin), or a sequence giving each rank's node.
    """

    ranks_per_node: int
    alpha: float = ALPHA
    beta: float = BETA
    alpha_inter: float = ALPHA_INTER
    beta_inter: float = BETA_INTER
    gamma: float = GAMMA
    placement: object = "block"

    def __post_init__(self):
        k = self.ranks_per_node
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise InvalidArgument(f"ranks_per_node must be an int >= 1, got {k!r}.")
        for name in ("alpha", "beta", "alpha_inter", "beta_inter", "gamma"):
            object.__setattr__(self, name, _check_seconds(name, getattr(self, name)))
        where = self.placement
        if isinstance(where, str):
            if where not in _PLACEMENTS:
                raise InvalidArgument(
                    f"placement must be one of {list(_PLACEMENTS)} or a sequence of node numbers, got {where!r}.")
        else:
            try:
                nodes = tuple(where)
            except TypeError:
                raise InvalidArgument(
                    f"placement must be one of {list(_PLACEMENTS)} or a sequence of node numbers, "
                    f"got {where!r}.") from None
            if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in nodes):
                raise InvalidArgument(f"placement must list a node number (an int >= 0) per rank, got {where!r}.")
            object.__setattr__(self, "placement", nodes)

    def nodes(self, p: int) -> list[int]:
        """The node of each of ``p`` ranks.

        Raises:
            InvalidArgument: an explicit placement does not have ``p`` entries, or puts
                more than ``ranks_per_node`` ranks on one node.
        """
        k = self.ranks_per_node
        if self.placement == "block":
            return [r // k for r in range(p)]
        if self.placement == "cyclic":
            n_nodes = -(-p // k)
            return [r % n_nodes for r in range(p)]
        nodes = list(self.placement)
        if len(nodes) != p:
            raise InvalidArgument(f"placement lists {len(nodes)} nodes, one per rank, but p is {p}.")
        crowded = [n for n in set(nodes) if nodes.count(n) > k]
        if crowded:
            raise InvalidArgument(
                f"placement puts more than ranks_per_node={k} ranks on node(s) {sorted(crowded)}.")
        return nodes
