"""Choosing an algorithm: thresholds as data, overrides most specific first.

Order of precedence, most specific first:

1. ``algorithm=`` on the call;
2. the environment variable ``COMMKIT_<COLLECTIVE>_ALGORITHM`` (for example
   ``COMMKIT_ALLREDUCE_ALGORITHM=ring``); ``auto`` means no override;
3. the tuning file named by ``COMMKIT_TUNING`` (written by ``commkit tune``);
4. the table shipped in ``commkit/tuning/default.json``.

A table maps each collective to an ordered list of rules. A rule may bound the
process count (``min_procs``/``max_procs``), the message size in bytes
(``min_bytes``/``max_bytes``, inclusive), require the op to be commutative
(``commutative: true``), require every rank on one node (``one_node: true``:
the communicator's ranks share one node's memory, so the node engine's
algorithms, :mod:`commkit.algorithms.node`, can run the call) and name the
transport it was measured on (``transport: "mpi"``; the threads world's
messages are handed over without a copy, so what wins under MPI need not win
there) and the MPI library (``library: "MPICH"`` or ``"Open MPI"``, as
``MPI.get_vendor()`` names it: where one library's runs all put an algorithm
ahead and the other's do not), and leave persistent requests out (``persistent: false``: where a
persistent request measured otherwise than a blocking call or an i-form); the
first rule whose bounds hold *and* whose algorithm
applies wins, so a rule naming ``ring`` is skipped for a non-commutative op.
Every rule carries a ``reason``. If no rule matches, the first applicable
algorithm of :data:`FALLBACK` is used.

The shipped table and :data:`FALLBACK` never pick ``native`` (the library's
own collective), even where it measured faster: commkit's algorithms carry each
call's identity in their messages' tags (:mod:`commkit.identity`), so ranks
that disagree about a call wait, while MPI's collectives carry none, and ranks
that disagree about an op, root or count could complete with wrong data.
``native`` runs only where asked for: ``algorithm="native"``, the environment
variable, or a tuning file's rule.

Message size (bytes), by collective: the per-rank vector for allreduce, reduce,
broadcast, scan and exscan; the whole gathered/scattered vector for gather,
scatter and allgather; the whole input vector for reduce_scatter; the block sent to each peer for
alltoall (as MPICH's thresholds are stated).

Segmented algorithms (those whose schedule takes ``segment=``, such as
``ring_pipelined``) cut their messages into segments. The segment size, in
bytes, comes from the most specific of: a size after the name in a forced
algorithm (``algorithm="ring_pipelined:256K"``, or the same in
``COMMKIT_ALLREDUCE_ALGORITHM``), a rule's ``segment_bytes``, and otherwise
the algorithm's default (``COMMKIT_SEGMENT_ELEMENTS`` elements, else its own).
:attr:`Choice.segment` carries it, and its reason says where it came from.
The communicator turns it into elements (at least one) for the call's dtype.

The node algorithms (``shm``) run only where the caller says they can
(``nodes=1`` and no ``node_why``): the communicator tells its node count
and why a call cannot use the arena (device arrays, a transport without one,
chunks larger than its slots). A caller that says nothing (``nodes=None``) gets no
node algorithm from a table, and a forced one is then checked when it runs.

A forced algorithm (argument or environment) that cannot run the call raises
:class:`~commkit.errors.AlgorithmNotApplicable`, unless
``COMMKIT_FALLBACK=warn``, which warns and selects automatically instead.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from functools import lru_cache
from importlib import resources

from . import algorithms
from ._checks import parse_size
from .errors import AlgorithmNotApplicable, InvalidArgument
from .ops import get_op
from .transports._arena import spans_nodes

__all__ = ["select", "load_table", "validate_table", "FALLBACK", "default_table", "Choice", "split_algorithm",
           "rule_matches"]

log = logging.getLogger("commkit")

FALLBACK = {
    "barrier": ("dissemination", "naive"),
    "broadcast": ("binomial", "naive"),
    "reduce": ("binomial", "naive"),
    "allreduce": ("recursive_doubling", "naive"),
    "gather": ("binomial", "naive"),
    "scatter": ("binomial", "naive"),
    "allgather": ("recursive_doubling", "naive"),
    "reduce_scatter": ("ring", "naive"),
    "alltoall": ("pairwise", "naive"),
    "scan": ("recursive_doubling", "naive"),
    "exscan": ("recursive_doubling", "naive"),
}

_RULE_KEYS = {"algorithm", "reason", "min_procs", "max_procs", "min_bytes", "max_bytes", "commutative",
              "segment_bytes", "one_node", "transport", "library", "persistent"}


class Choice:
    """The selected algorithm, its segment size (bytes, or None for the default) and why it was selected.

    ``forced`` is True when the caller or the environment named the algorithm
    (not a table or the fallback).
    """

    __slots__ = ("algorithm", "reason", "segment", "forced")

    def __init__(self, algorithm, reason: str, segment: int | None = None, forced: bool = False):
        self.algorithm = algorithm
        self.reason = reason
        self.segment = segment
        self.forced = forced

    def __repr__(self) -> str:
        seg = f", segment {self.segment} B" if self.segment is not None else ""
        return f"Choice({self.algorithm.qualname}{seg}: {self.reason})"


def split_algorithm(text: str, collective: str, source: str = "algorithm= argument") -> tuple[str, int | None]:
    """``"ring_pipelined:256K"`` -> ``("ring_pipelined", 262144)``; a plain name -> ``(name, None)``.

    Raises:
        AlgorithmNotApplicable: the size is not a positive size in bytes (see
            :func:`commkit.bench.parse_size` for the units).
    """
    name, sep, size = str(text).partition(":")
    if not sep:
        return name, None
    try:
        segment = parse_size(size)
    except InvalidArgument as exc:
        raise AlgorithmNotApplicable(f"{collective} algorithm {text!r} (from {source}): the segment size after "
                                     f"':' is not valid: {exc}") from None
    if segment < 1:
        raise AlgorithmNotApplicable(f"{collective} algorithm {text!r} (from {source}): the segment size after ':' "
                                     "must be at least 1 byte.")
    return name.strip(), segment


def validate_table(table, source: str) -> dict:
    """Check a tuning table's structure; raise :class:`InvalidArgument` naming ``source`` and the problem."""
    if not isinstance(table, dict):
        raise InvalidArgument(f"tuning file {source}: expected a JSON object at the top level, got {type(table).__name__}.")
    for collective, rules in table.items():
        if collective.startswith("_") or collective in ("version", "machine", "measured", "model"):
            continue
        if collective not in algorithms.COLLECTIVES:
            raise InvalidArgument(
                f"tuning file {source}: unknown collective {collective!r}; expected one of {list(algorithms.COLLECTIVES)}."
            )
        if not isinstance(rules, list):
            raise InvalidArgument(f"tuning file {source}: {collective!r} must map to a list of rules, got {type(rules).__name__}.")
        for i, rule in enumerate(rules):
            where = f"tuning file {source}: {collective}[{i}]"
            if not isinstance(rule, dict) or "algorithm" not in rule:
                raise InvalidArgument(f"{where}: each rule must be an object with an 'algorithm' key, got {rule!r}.")
            unknown = set(rule) - _RULE_KEYS
            if unknown:
                raise InvalidArgument(f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(_RULE_KEYS)}.")
            if algorithms.get(collective, rule["algorithm"]) is None:
                raise InvalidArgument(
                    f"{where}: unknown algorithm {rule['algorithm']!r}; {collective} has "
                    f"{sorted(algorithms.for_collective(collective))}."
                )
            for key in ("min_procs", "max_procs", "min_bytes", "max_bytes"):
                if key in rule and (not isinstance(rule[key], int) or isinstance(rule[key], bool) or rule[key] < 0):
                    raise InvalidArgument(f"{where}: {key} must be a non-negative integer, got {rule[key]!r}.")
            if "one_node" in rule and rule["one_node"] is not True:
                raise InvalidArgument(f"{where}: one_node must be true (the rule then needs every rank on one node), "
                                      f"got {rule['one_node']!r}; leave it out for a rule that holds anywhere.")
            if "persistent" in rule and rule["persistent"] is not False:
                raise InvalidArgument(f"{where}: persistent must be false (the rule then leaves persistent requests "
                                      f"out), got {rule['persistent']!r}; leave it out for a rule that holds for every "
                                      "form.")
            if "transport" in rule and not isinstance(rule["transport"], str):
                raise InvalidArgument(f"{where}: transport must be a transport's name such as \"mpi\", "
                                      f"got {rule['transport']!r}.")
            if "library" in rule and not isinstance(rule["library"], str):
                raise InvalidArgument(f"{where}: library must be an MPI library's name as MPI.get_vendor() gives it "
                                      f"(\"MPICH\", \"Open MPI\"), got {rule['library']!r}.")
            if "segment_bytes" in rule:
                seg = rule["segment_bytes"]
                if not isinstance(seg, int) or isinstance(seg, bool) or seg < 1:
                    raise InvalidArgument(f"{where}: segment_bytes must be a positive integer, got {seg!r}.")
                if not algorithms.get(collective, rule["algorithm"]).segmented:
                    raise InvalidArgument(f"{where}: segment_bytes is given, but {collective} algorithm "
                                          f"{rule['algorithm']!r} takes no segment size.")
    return table


@lru_cache(maxsize=8)
def load_table(path: str | None = None) -> dict:
    """Read and validate a tuning table (the shipped default when ``path`` is None)."""
    if path is None:
        text = resources.files("commkit.tuning").joinpath("default.json").read_text()
        source = "commkit/tuning/default.json"
    else:
        source = path
        try:
            with open(path) as f:
                text = f.read()
        except OSError as exc:
            raise InvalidArgument(f"tuning file {path}: cannot be read ({exc.strerror}).") from None
    try:
        table = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"tuning file {source}: not valid JSON ({exc.msg} at line {exc.lineno}).") from None
    return validate_table(table, source)


def default_table() -> dict:
    return load_table(None)


def rule_matches(rule: dict, size: int, nbytes: int, op, one_node: bool, transport: str | None,
                 persistent: bool = False, library: str | None = None) -> bool:
    """Whether ``rule``'s bounds hold for a call (its algorithm may still not apply: see :func:`select`)."""
    if rule.get("one_node") and not one_node:
        return False
    if persistent and rule.get("persistent", True) is False:
        return False
    if rule.get("transport", transport) != transport:
        return False
    if "library" in rule and rule["library"] != library:
        return False
    if size < rule.get("min_procs", 0) or size > rule.get("max_procs", size):
        return False
    if nbytes < rule.get("min_bytes", 0) or nbytes > rule.get("max_bytes", nbytes):
        return False
    if rule.get("commutative") and op is not None and not op.commutative:
        return False
    return True


def _why_not(alg, size, op, native_ok, nodes, node_why) -> str | None:
    if alg.name == "native":
        return None if native_ok else f"{alg.collective}_native is not available on this transport for this dtype and op"
    if (node_why is not None or (nodes or 1) > 1) and algorithms.is_node_only(alg):
        return node_why or spans_nodes("communicator", nodes)
    return alg.why_not(size, op)


def select(collective: str, size: int, nbytes: int, op=None, requested: str | None = None,
           native_ok: bool = False, nodes: int | None = None, node_why: str | None = None,
           transport: str | None = None, persistent: bool = False, library: str | None = None) -> Choice:
    """Choose the algorithm for one call; see the module docstring for the precedence.

    ``op`` is a :class:`~commkit.ops.Op` or an op name such as ``"sum"`` (None for
    collectives without a reduction). ``nodes`` is how many nodes the
    communicator spans (None: not known); ``node_why`` says why this call cannot
    run a node algorithm even so (None: it can, when ``nodes`` is 1).
    ``transport`` is the name of the transport the call runs on (None: not
    known; rules naming one then do not match). ``persistent``: True for a
    persistent request (``*_init``), which rules marked ``"persistent": false`` skip.
    ``library``: the MPI library under the transport (``"MPICH"``, ``"Open MPI"``;
    None: none, or not known), which a rule naming one must match.
    """
    one_node = nodes == 1 and node_why is None
    if isinstance(op, str):
        op = get_op(op)
    forced, source = requested, "algorithm= argument"
    if forced is None or forced == "auto":
        forced = os.environ.get(f"COMMKIT_{collective.upper()}_ALGORITHM") or None
        source = f"COMMKIT_{collective.upper()}_ALGORITHM"
        if forced == "auto":
            forced = None
    if forced is not None:
        name, segment = split_algorithm(forced, collective, source)
        alg = algorithms.get(collective, name)
        if alg is None:
            raise AlgorithmNotApplicable(
                f"unknown {collective} algorithm {forced!r} (from {source}); expected one of "
                f"{sorted(algorithms.for_collective(collective))} or 'auto'."
            )
        if segment is not None and not alg.segmented:
            segmented = sorted(a.name for a in algorithms.for_collective(collective).values() if a.segmented)
            raise AlgorithmNotApplicable(
                f"{collective} algorithm {name!r} takes no segment size, but {forced!r} (from {source}) gives one; "
                f"segmented {collective} algorithms: {segmented or 'none'}.")
        why = _why_not(alg, size, op, native_ok, nodes, node_why)
        if why is None:
            seg = f", segment {segment} B" if segment is not None else ""
            return Choice(alg, f"forced by {source}{seg}", segment, forced=True)
        if os.environ.get("COMMKIT_FALLBACK", "").lower() != "warn":
            raise AlgorithmNotApplicable(f"{why} (forced by {source}); set COMMKIT_FALLBACK=warn to fall back instead.")
        warnings.warn(f"{why}; falling back to automatic selection.", RuntimeWarning, stacklevel=3)
    tables = []
    tuning = os.environ.get("COMMKIT_TUNING")
    if tuning:
        tables.append((load_table(tuning), tuning))
    tables.append((default_table(), "default.json"))
    for table, name in tables:
        for rule in table.get(collective, ()):
            if rule_matches(rule, size, nbytes, op, one_node, transport, persistent, library):
                alg = algorithms.get(collective, rule["algorithm"])
                if algorithms.is_node_only(alg) and not one_node:
                    continue  # a table's node algorithm runs only where the caller says every rank shares one node
                if _why_not(alg, size, op, native_ok, nodes, node_why) is None:
                    segment = rule.get("segment_bytes")
                    seg = f" (segment {segment} B)" if segment is not None else ""
                    return Choice(alg, f"{name}: {rule.get('reason', 'rule matched')}{seg}", segment)
    for name in FALLBACK[collective]:
        alg = algorithms.get(collective, name)
        if alg.why_not(size, op) is None:
            return Choice(alg, "fallback: no rule matched")
    raise AssertionError(f"no {collective} algorithm applies")  # naive always applies
