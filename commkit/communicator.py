"""The Communicator: validate once at the boundary, choose an algorithm, run its schedule.

A communicator owns two contexts on its transport, so traffic of one kind can
never match a receive of another: ``p2p`` for the user's point-to-point
messages (Python objects from ``send_object`` carry the top tag bit, so an
array receive can never silently take a pickle), and ``coll`` for collective
schedules and commkit's own small messages (debug checks, metadata). Every
collective message carries its call's identity in the tag -- collective,
dtype, a hash of root, count, op and algorithm, and the call number -- so a
mismatched call waits instead of matching (:mod:`commkit.identity`); the
watchdog explains such waits (:mod:`commkit.watchdog`).

Every public method checks its arguments in a fixed order (communicator open,
buffers, ranks and tags, op against dtype) and raises before anything is sent.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
import os
import sys
import threading
import time
import warnings
import weakref
import zlib
from contextlib import contextmanager

import numpy as np

from . import algorithms, collectives, selection
from . import watchdog as _watchdog
from ._call import Call
from ._events import active as _trace_active
from ._checks import (array_module, as_input, check_alias, check_dtype, check_out, check_rank, check_tag, owners_apart,
                      check_timeout, input_for, same_memory)
from ._vector import VectorCollectives
from .algorithms.node import zero_copy_min_bytes
from .algorithms.pipelined import segment_elements
from .algorithms.recursive_halving import allreduce_recursive_doubling
from .errors import (AlgorithmNotApplicable, CollectiveMismatch, CommBroken, CommClosed, CommError, CommTimeout,
                     ConcurrentCall, InvalidArgument, InvalidBuffer, PeerFailed, UnsupportedOp)
from .identity import TagLayout, kind_code
from .mesh import make_mesh
from .ops import MAX, get_op
from .plan import (SEEN, Entry, IEntry, InterpretedPersistentRequest, Plan, PersistentPool, PersistentRequest, Slots,
                   compile_ops, native_nonblocking_entry, nonblocking_entry, nonblocking_steps, persistent_steps,
                   stand_in, timed_native, write_out)
from .requests import Request, wait_all, wait_any
from .schedule import (CLAIM, TRANSFER, CallInfo, NodeProgram, Progress, ScheduleRequest, ScheduleRun, check_in,
                       check_in_saying, has_one_sided, inplace_safe, native_timeout_error, run_schedule, writes_input)
from .transports._arena import arena_bytes, count_nodes, free_arena, lacks_room, made_arena, node_name
from .transports.base import ANY_SOURCE, ANY_TAG, Status, allgather_objects, inline

__all__ = ["Communicator", "PointToPointRequest", "Request", "wait_all", "wait_any"]

log = logging.getLogger("commkit")

_EMPTY = np.empty(0, np.uint8)  # the "tmp" of algorithms that need no scratch (barrier's empty messages)
# Messages that may still arrive for calls that timed out: kept alive (never freed under the
# transport's feet) for as long as this process runs. Only timeouts add to it.
_ABANDONED: list = []
# The longest free() waits to hear from every rank where the library needs that (Communicator._check_in_before_free)
# and the communicator has no timeout of its own.
FREE_CHECK_IN_S = 10.0
_SEEN_ONCE = object()  # a shape seen once: its shape plan is compiled the next time
# What Communicator._fresh and an entry (plan.Plan.entry) answer when the call must take the general path;
# the mpi4py face, which calls an entry itself, reads it too.
GENERAL = object()
_weakref = weakref.ref
_IN_PLACE = 2  # _out_form of a call whose out is x itself


def _out_form(x, out) -> int:
    """How a call gives its output, as the fresh-array keys record it: 0 none, 1 an array of its own, 2 x itself."""
    return 0 if out is None else _IN_PLACE if out is x else 1


def _plan_key(call, algorithm, persistent: bool) -> tuple:
    """The key of ``Communicator._plans`` for ``call``'s shape: a persistent request's apart."""
    key = (call.collective, call.arg, call.dtype, call.op, call.root, algorithm)
    return key + (True,) if persistent else key


def _fresh_key(collective, op, algorithm, x, form, timeout) -> tuple:
    """The key of ``Communicator._by_shape`` (and ``_by_shape_i``): a call's kinds, not its arrays (see ``_fresh``).

    ``op`` is broadcast's root where it has one, None where there is neither;
    ``form`` is :func:`_out_form`'s; ``timeout`` the call's own or the communicator's.
    """
    return collective, op, algorithm, x.dtype, x.shape, form, timeout is None


# The collectives whose public method tries the entry of its last call shape on new arrays first
# (``_new_<collective>``, a generated function: plan.Plan.entry); _fresh makes them.
_FRESH_ENTRIES = ("allreduce", "reduce", "scan", "exscan", "broadcast", "allgather", "gather", "scatter", "alltoall",
                  "reduce_scatter")
_FRESH = frozenset(("allreduce", "scan", "exscan", "reduce"))  # the reductions _reduction registers with _fresh


class _NativeStart:
    """What a native i-form's entry calls: ``Communicator._fresh_native`` for one shape, through a proxy.

    The entry lives on the communicator (``_new_i<collective>``), so it holds the communicator weakly.
    """

    __slots__ = ("comm", "collective", "plan", "spec")

    def __init__(self, comm, collective, plan, spec):
        self.comm, self.collective, self.plan, self.spec = comm, collective, plan, spec

    def __call__(self, src, dst, result, timeout):
        return self.comm._fresh_native(self.collective, self.plan, self.spec, src, dst, result, timeout)


def _node_steps(steps, rank: int):
    """A node program's generator (``NodeProgram.steps``) as an i-form's steps: ``run(in, out, tmp, tag, rec)``.

    The call's number, collective and algorithm come from its flight-recorder
    entry ``rec``, as the program names them in its errors.
    """
    def run(src, dst, tmp, tag, rec):
        return steps({"in": src, "out": dst, "tmp": tmp}, tag, (rec[1], rec[2], rec[0], rank, None), rec)
    run.source = steps.source
    return run


def _then_write(run, value):
    """An i-form's compiled generator function (``run(in, out, ...)``) that writes ``value`` over ``out`` last.

    Rank 0's exscan (see ``Communicator._exscan_identity``): its steps leave its result to be written after
    them. ``run`` itself where ``value`` is None, and None where ``run`` is.
    """
    if run is None or value is None:
        return run

    def written(src, dst, *rest):
        yield from run(src, dst, *rest)
        dst[...] = value
    written.source = run.source + "\n# then: out[...] = the op's identity (rank 0's exscan result)"
    return written

# Algorithms that read "in" only before they first write "out", so in-place calls
# (out aliases the input) need no defensive copy of the input. Broadcast is safe for
# every algorithm: only the root reads "in", and the root never writes "out" except by
# copying "in" there, which the executor skips when they are the same array.
# Whether a schedule may run with "in" and "out" as one array (an in-place call) without first
# saving the input: computed from each rank's steps (schedule.inplace_safe), per call shape.
_inplace_safe = inplace_safe
_ROOTED = collectives.ROOTED


def _env_timeout():
    value = os.environ.get("COMMKIT_TIMEOUT")
    if not value:
        return None
    try:
        return check_timeout(float(value), "COMMKIT_TIMEOUT")
    except ValueError:
        raise InvalidArgument(f"COMMKIT_TIMEOUT must be a number of seconds, got {value!r}.") from None


def _env_check() -> bool:
    return os.environ.get("COMMKIT_DEBUG", "").lower() in ("check", "1", "true")


def _env_plans() -> bool:
    value = os.environ.get("COMMKIT_PLANS", "on").strip().lower()
    if value not in ("on", "off", "1", "0", "true", "false", ""):
        raise InvalidArgument(f"COMMKIT_PLANS must be 'on' or 'off', got {value!r}.")
    return value not in ("off", "0", "false")


class PointToPointRequest(Request):
    """A nonblocking point-to-point operation (``isend``/``irecv``).

    ``wait()`` returns the received array for ``irecv`` (None for ``isend``);
    ``test()`` returns whether it has completed, without blocking.
    """

    def __init__(self, pending, result=None, timeout=None, what: str = "", keep=None, comm=None, peers=()):
        self._pending = pending
        self._result = result
        self._timeout = timeout
        self._what = what
        self._keep = keep  # keeps a send buffer alive until completion
        self._comm = comm
        self._peers = peers
        self._done = False

    def test(self) -> bool:
        """Whether the operation has completed (makes progress, never blocks)."""
        if not self._done:
            self._done = self._pending.test()
            if not self._done and self._comm is not None:
                self._comm._progress.drive()
        return self._done

    def wait(self, timeout: float | None = None):
        """Block until complete; return the received array (irecv) or None (isend)."""
        if not self._done:
            timeout = check_timeout(timeout) if timeout is not None else self._timeout
            comm = self._comm
            recorder = comm._recorder if comm is not None else None
            if recorder is not None:
                recorder.active = (self._what, self._peers, time.monotonic())
            try:
                if comm is not None and comm._progress.requests:
                    pending = [] if comm._progress.wait(self._pending.test, timeout) else list(self._peers)
                else:
                    pending = self._pending.wait(timeout)
            finally:
                if recorder is not None:
                    recorder.active = None
            if pending:
                abandon = getattr(self._pending, "abandon", None)
                if abandon is not None:  # cancel the receive, so a late message cannot land in this buffer
                    abandon()
                raise CommTimeout(f"{self._what} timed out after {timeout:g} s waiting for rank(s) {pending}.")
            self._done = True
            self._keep = None
        return self._result

    @property
    def status(self) -> Status | None:
        """Source, tag and byte count of a completed receive."""
        return getattr(self._pending, "status", None) if self._done else None


class _RecvRequest(PointToPointRequest):
    """An ``irecv``: also refuses a message that was a Python object sent with ``send_object``."""

    def _check_kind(self) -> None:
        status = getattr(self._pending, "status", None)
        # A transport without tags (NCCL) reports ANY_TAG (-1): never an object message.
        if status is not None and self._comm is not None and status.tag >= 0 and status.tag & self._comm._object_bit:
            raise InvalidBuffer(
                f"{self._what}: the matching message from rank {status.source} is a Python object sent with "
                f"send_object (tag {status.tag & ~self._comm._object_bit}); receive it with recv_object()."
            )

    def test(self) -> bool:
        done = super().test()
        if done:
            self._check_kind()
        return done

    def wait(self, timeout: float | None = None):
        result = super().wait(timeout)
        self._check_kind()
        return result


_LOCAL_ERRORS = (InvalidArgument, InvalidBuffer, UnsupportedOp, AlgorithmNotApplicable)


def _announced(collective: str | None):
    """Wrap a collective's argument-checking entry so that, in check mode, its local errors reach every rank.

    Without check mode a rank whose arguments fail raises alone, before sending
    anything. Its call still counts as made, as on the ranks that went on with
    it: its call number is spent, and what they sent it for that call is
    dropped when it arrives (:meth:`Communicator._spend_number`). A rank that
    needs this one's messages waits in the call (the watchdog reports it; an
    uncaught error under mpiexec ends the job). In check mode every call is
    agreed on anyway, so a failed one is agreed on too: see
    :meth:`Communicator.announce_errors`. Persistent ``*_init`` calls are local
    and are not announced. ``collective`` None: the first argument names it.
    """
    def wrap(fn):
        def checked(self, *args, **kwargs):
            if _is_init(args):
                return fn(self, *args, **kwargs)
            with _Announcing(self, collective or args[0]):
                return fn(self, *args, **kwargs)

        # Written out with fn's own parameters: forwarding *args and **kwargs costs 0.3-0.4 us, which
        # every call without a plan would pay although only check mode needs the wrapper.
        params = list(inspect.signature(fn).parameters.values())
        if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY) for p in params):
            raise TypeError(f"_announced wraps entries with named parameters only, not {fn.__qualname__}")
        ns = {"_fn": fn, "_checked": checked}
        heads, positional, keywords = [], [], []
        for i, p in enumerate(params):
            if p.default is not p.empty:
                ns[f"_d{i}"] = p.default
            head = p.name if p.default is p.empty else f"{p.name}=_d{i}"
            if p.kind is p.KEYWORD_ONLY:
                if "*" not in heads:
                    heads.append("*")
                keywords.append(f"{p.name}={p.name}")
            else:
                positional.append(p.name)
            heads.append(head)
        forward = ", ".join(positional + keywords)
        self_ = params[0].name
        ns["_local_errors"], ns["_is_init"] = _LOCAL_ERRORS, _is_init
        # Without check mode a call that fails its local checks still spends its call number (see
        # Communicator._spend_number); a try costs nothing until something raises.
        exec(f"def run({', '.join(heads)}):\n"
             f"    if not {self_}._check:\n"
             f"        seq, claims = {self_}._seq, {self_}._persistent_channels.claims\n"
             f"        try:\n"
             f"            return _fn({forward})\n"
             f"        except _local_errors:\n"
             f"            {self_}._spend_number(seq, claims, _is_init(({', '.join(positional[1:])},)), "
             f"{collective!r} or {positional[1] if len(positional) > 1 else None})\n"
             f"            raise\n"
             f"    return _checked({forward})\n", ns)
        return functools.wraps(fn)(ns["run"])
    return wrap


def _is_init(args) -> bool:
    """Whether an entry's arguments are those of a persistent ``*_init`` call (its mode, ``"init"``, among them)."""
    return any(type(a) is str and a == "init" for a in args)


# The collectives whose every message carries their own kind in its tag (the vector ones may exchange their counts
# first): a refused one's stale messages are told by kind as well as call number (see Communicator._drop_stale).
_ONE_KIND = frozenset(("allreduce", "reduce", "broadcast", "gather", "scatter", "allgather", "alltoall",
                       "reduce_scatter", "scan", "exscan", "barrier"))


class _Announcing:
    """The context manager :meth:`Communicator.announce_errors` returns."""

    __slots__ = ("comm", "collective", "persistent", "seq", "claims", "kind")

    def __init__(self, comm, collective: str, persistent: bool = False, kind: str | None = None):
        self.comm, self.collective, self.persistent, self.seq, self.claims = comm, collective, persistent, None, None
        self.kind = kind or collective  # the commkit collective it runs as, where the name is another's

    def __enter__(self):
        self.seq, self.claims = self.comm._seq, self.comm._persistent_channels.claims
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        comm = self.comm
        if kind is None or not issubclass(kind, _LOCAL_ERRORS) or comm._closed:
            return False
        if self.persistent:  # made locally: nothing to announce, only its number to take (see _spend_number)
            comm._spend_number(self.seq, self.claims, True)
        elif comm._seq == self.seq:  # only a call that never started (its call number unused)
            if comm._check:
                comm._announce_failure(self.collective, exc)
            else:
                comm._spend_number(self.seq, self.claims, False, self.kind)
        return False


class Communicator(VectorCollectives):
    """A group of ranks that exchange messages and run collectives.

    Build one with :func:`commkit.init` (or :func:`commkit.run_local`); derive
    others with :meth:`split` and :meth:`dup`.

    Attributes:
        rank: this process's (or thread's) rank, ``0 <= rank < size``.
        size: the number of ranks.
        timeout: default timeout in seconds for blocking calls (None waits forever).
        check: whether collective calls are cross-checked across ranks (debug mode).
        last_algorithm: the algorithm the last collective on this rank ran.
    """

    def __init__(self, transport, *, timeout: float | None = None, check: bool | None = None,
                 plans: bool | None = None, owns_transport: bool = False, label: str = "world"):
        self._base = transport
        self._owns_base = owns_transport
        # A transport commkit made for this communicator (dup, split) carries the user's
        # point-to-point traffic itself; one it was handed (COMM_WORLD) is never used directly.
        self._p2p = transport if owns_transport else transport.dup()
        self._coll = transport.dup()
        # How many nodes the ranks span (the node algorithms need one): under MPI a collective, made here
        # where every rank is (MPI_Comm_split_type); other transports answer locally at each plan (_node_why).
        self._node_count = count_nodes(self._coll) if self._coll.name == "mpi" else None
        self.rank = transport.rank
        self.size = transport.size
        self._timeout = check_timeout(timeout) if timeout is not None else _env_timeout()
        self._check = _env_check() if check is None else bool(check)
        self._plans_on = _env_plans() if plans is None else bool(plans)
        self._plain = False  # no timeout, no check mode, usable: compiled plans may run (see _update_plain)
        self._shapes_on = False  # the same but for the timeout: shape plans may run (see _fresh)
        self._fast: dict = {}  # plans of recent blocking calls, keyed by call shape and the arrays' identity
        self._forget_hot()
        self._seen: dict = {}  # keys seen once (weakly): a plan is compiled the second time
        self._shaped: dict = {}  # shape plans (plan.py): (id of a cached plan, aliased, timed) -> Plan, _SEEN_ONCE or False
        self._by_shape: dict = {}  # the same shape plans by the arguments' kinds, for new arrays (see _fresh)
        self._by_shape_i: dict = {}  # the cached schedules of i-forms by the arguments' kinds (see _fresh)
        self._fresh_hot: dict = {}  # collective -> the kinds and entry of its last call _fresh ran (see _fresh)
        self._fresh_hot_i: dict = {}  # the same for the i-forms
        # Each collective's weak references to x and out of its last call on new arrays (None: no out), in
        # a list its shape entries (plan.Plan.entry) read and write without the communicator's attributes
        # (see _fresh). Per collective: the same x given to another collective next is no loop of one call.
        self._fresh_last = {collective: [None, None] for collective in _FRESH_ENTRIES}
        for collective in _FRESH_ENTRIES:  # the entry of each collective's last shape on new arrays (see _fresh)
            setattr(self, "_new_" + collective, None)
            setattr(self, "_new_i" + collective, None)  # and of its i-form's
        self._iforms_on = False
        self._entries: dict = {}  # collective -> whether its installed entry is timed (see _drop_entries)
        self._parked: dict = {}  # collective -> (entry, timed): taken out of the way until its state comes back
        self._last = (None, None)  # (algorithm, selection choice) of the last collective: one store per call
        self._seq = 0
        # Call number -> the first number past its window (see _spend_number). Plans hold this dict itself
        # and look at it after taking their number: it is emptied and filled, never replaced.
        self._stale: dict = {}
        self._closed = None  # None while usable, else the reason it is not
        self._entry = threading.Lock()
        self._scratch: dict = {}
        self._plans: dict = {}
        self._nodes = None  # every rank's node, exchanged at the first node-aware call (see _node_args)
        self._arena_failed = None  # why the node arena could not be made, which every rank agreed (see _no_arena)
        self._shared_arrays = False  # whether shared_empty made arrays here (node calls then look for them)
        self._zero_copy_steps: dict = {}  # call shape -> (the zero-copy form's steps, whether in place is safe)
        self._node_programs: dict = {}  # id(steps) -> (steps, their NodeProgram or None): see _node_program
        self._layout = TagLayout(self._coll.tag_ub)
        self._max_in_flight = self._layout.max_in_flight  # (read by every i-form: a property costs a call)
        self._pool_budget = [self._POOL_BUDGET]  # bytes the i-forms' PersistentPools may still take
        # User tags use all but the top bit of the tag space; Python objects set it.
        p2p_bits = TagLayout(self._p2p.tag_ub).bits
        self._tag_ub = (1 << (p2p_bits - 1)) - 1
        self._object_bit = 1 << (p2p_bits - 1)
        self._progress = Progress(getattr(self._coll, "relax", None), on_change=_weak_method(self._update_plain))
        self._sends: list = []  # (pending, buffer) of isends from copies commkit made
        self._label = label
        self._children = itertools.count()
        self._recorder = _watchdog.FlightRecorder(self.rank, self.size, label)
        _watchdog.register(self._recorder)
        chans = (self._p2p, self._coll) + ((self._base,) if owns_transport and self._base is not self._p2p else ())
        self._seq_span = self._layout.seq_mask + 1  # call numbers are kept modulo this (see identity.py)
        self._persistent_channels = _PersistentChannels(self._coll, self._seq_span)
        # Communicators dropped without free() release their contexts when collected, so a
        # program that makes many never runs the MPI library out of communicators.
        self._finalizer = weakref.finalize(self, _free_channels, chans, self._persistent_channels)
        _LIVE.add(self)
        self._update_plain()

    def _update_plain(self) -> None:
        # Compiled plans run only when nothing needs the general path: plans on, no timeout to poll
        # for, no check mode, no outstanding request to drive, a usable communicator.
        self._shapes_on = (self._plans_on and not self._check and not self._closed and not self._progress.requests)
        self._plain = self._shapes_on and self._timeout is None
        self._iforms_on = self._plans_on and not self._check and not self._closed  # (read by i-form entries)
        if not self._plain and self._entries:
            # (an i-form's entry stays: it checks _iforms_on itself, and a request left outstanding -- an
            # i-form that did not complete at its start -- is no reason for the next i-form to lose its entry)
            self._drop_entries(untimed_only=self._shapes_on, iforms=not self._iforms_on, park=True)
        if self._parked and self._shapes_on:
            # The state an entry was taken out for has ended (the requests were waited for, the default
            # timeout set back): it goes back where _fresh would put it at the next call, without that call.
            plain = self._plain
            for collective, (entry, timed) in list(self._parked.items()):
                if timed != plain:
                    setattr(self, "_new_" + collective, entry)
                    self._entries[collective] = timed
                    del self._parked[collective]

    @property
    def plans(self) -> bool:
        """Whether calls may run compiled plans (default: on; ``COMMKIT_PLANS=off`` turns them off).

        With plans off, every collective call runs its schedule through the
        interpreter (:func:`commkit.schedule.execute`), one step at a time: the
        reference path, to read, trace or debug a schedule (a ``print`` in a
        generator still runs once per call shape; see docs/extending.md). Results
        are the same either way; the contract tests run both.
        """
        return self._plans_on

    @plans.setter
    def plans(self, value) -> None:
        if not isinstance(value, bool):
            raise InvalidArgument(f"plans must be True or False, got {value!r}.")
        self._plans_on = value
        self.forget_plans()

    def forget_plans(self) -> None:
        """Drop every cached schedule and plan: the next call of each shape selects and compiles anew.

        commkit calls it on every live communicator when an algorithm is registered
        again or unregistered, so an edited algorithm runs at its next call.
        """
        self._plans.clear()
        self._forget_shapes()
        self._retire_fast()
        self._seen.clear()
        self._forget_hot()
        self._node_programs.clear()
        self._update_plain()

    @property
    def last_algorithm(self) -> str | None:
        """The algorithm the last collective on this rank ran (None before the first)."""
        return self._last[0]

    @property
    def last_choice(self):
        """How the last collective's algorithm was chosen (:class:`commkit.selection.Choice`), with its reason."""
        return self._last[1]

    def _retire_fast(self) -> None:
        """Forget the plans of repeated calls, and retire each (:meth:`commkit.plan.Plan.retire`): one kept
        elsewhere to run while ``plan.ready(x)`` holds is never run again."""
        for plan in self._fast.values():
            if plan is not None:
                plan.retire()
        self._fast.clear()

    def plan_of(self, collective: str, x, out, *args):
        """The compiled plan of a blocking ``collective`` call on exactly these arguments, or None.

        ``args``: the rest of the call's arguments that make it another call,
        in the method's order: the op (reductions), then the root (rooted
        collectives); no algorithm. A wrapper that makes the same call again
        and again (the mpi4py face) may keep the plan and run ``plan.run()``
        directly while ``plan.ready(x)`` holds, as :meth:`last_plan` says.
        """
        plan = _known(self._fast, (collective, id(x), id(out), *args, None))
        return plan if plan is not None and plan.hot is not None and plan.hot[0] is x and plan.hot[1] is out \
            else None

    def last_plan(self, collective: str):
        """The compiled plan of the last blocking ``collective`` call made with the same arguments twice, or None.

        A wrapper that sees the same call again and again (the mpi4py face) may keep
        it and run ``plan.run()`` directly while ``plan.ready(x)`` holds, skipping
        this communicator's own argument check; ``plan.hot`` holds the arguments it
        was made for (``x``, ``out``, then the rest of the call's key). See
        :mod:`commkit.plan`.

        Raises:
            InvalidArgument: ``collective`` is not the name of a collective.
        """
        if collective not in algorithms.COLLECTIVES and collective not in self._HOT:
            raise InvalidArgument(f"last_plan: unknown collective {collective!r}; expected one of "
                                  f"{list(algorithms.COLLECTIVES)}.")
        return getattr(self, "_hot_" + collective, None)

    @property
    def timeout(self) -> float | None:
        """Default timeout in seconds for blocking calls (None waits forever)."""
        return self._timeout

    @timeout.setter
    def timeout(self, value) -> None:
        self._timeout = check_timeout(value)
        self._update_plain()

    @property
    def check(self) -> bool:
        """Whether collective calls are cross-checked across ranks (debug mode)."""
        return self._check

    @check.setter
    def check(self, value) -> None:
        self._check = bool(value)
        self._update_plain()

    # -- basics -----------------------------------------------------------------

    @property
    def transport_name(self) -> str:
        """``"local"``, ``"mpi"`` or ``"nccl"``."""
        return self._base.name

    @property
    def nodes(self) -> int | None:
        """How many nodes this communicator's ranks span (1: they share one node's memory), or None.

        None where the transport has no shared-memory arena (NCCL). Under MPI it
        was found when the communicator was made (``MPI_Comm_split_type``); the
        threads world is one node unless ``COMMKIT_RANKS_PER_NODE`` splits it. The
        node algorithms (``shm``) need 1, and the selector's ``one_node`` rules
        (:mod:`commkit.selection`) match only then.
        """
        return self._node_why(None)[0]

    def __repr__(self) -> str:
        state = "freed" if self._closed else f"rank {self.rank} of {self.size}"
        return f"<commkit.Communicator {self.transport_name}: {state}>"

    def check_open(self) -> None:
        """Raise CommClosed after free(), CommBroken after a call that failed midway; return while usable."""
        if self._closed:
            raise (CommBroken if self._closed is not _FREED else CommClosed)(self._closed)

    _check_open = check_open

    @property
    def collective_transport(self):
        """The transport this communicator's collectives run on (a context of its own).

        For tools that run a schedule directly, as ``commkit tune`` does to measure
        the cost model's constants on the channel collectives use.
        """
        return self._coll

    def _break(self, reason: str) -> None:
        """Mark this communicator unusable: messages of an interrupted call may still arrive."""
        self._plain = self._shapes_on = self._iforms_on = False
        self._drop_entries()
        if not self._closed:
            self._closed = (
                f"this communicator is broken: {reason} Messages of that call may still arrive, so every later "
                "call on it raises. dup() it (collective: every rank) or use a fresh communicator, then free() "
                "this one (collective too: it drops what that call left, which a later communicator would get); "
                "see docs/troubleshooting.md."
            )

    @property
    def broken(self) -> str | None:
        """Why this communicator cannot be used any more (None while it can)."""
        return self._closed if self._closed and self._closed is not _FREED else None

    def free(self) -> None:
        """Release the communicator's contexts. Using it afterwards raises CommClosed.

        Collective, as ``MPI_Comm_free`` is: every rank calls it. On a communicator
        whose calls used the node engine (docs/node.md) it also gives the node arena
        back, which waits until every rank has called ``free()`` (for the timeout,
        when one is set; a rank that does not come then leaves the arena to the end
        of the job, with a warning). Under MPI every rank first hears from every
        other (for the timeout, or 10 s without one; then a warning, and freed all
        the same), and the messages that came for calls no rank will finish are
        dropped: MPI would hand them to the next communicator made with the freed
        one's context id (docs/troubleshooting.md).

        A ``with`` block left by an exception frees without waiting for anyone
        (the other ranks may never come: the error must reach the program, or
        commkit's hook that ends the job, now); its node arena then stays to the
        end of the job.
        """
        self._free(wait=True)

    def _free(self, wait: bool) -> None:
        """:meth:`free`; ``wait=False`` leaves out the check-ins (and so the node arena's release)."""
        if self._closed is _FREED:
            return
        self._closed = _FREED
        self._plain = self._shapes_on = self._iforms_on = False
        self._retire_fast()
        self._forget_shapes()
        self._forget_hot()
        self._node_programs.clear()  # (they view the arena, which goes next)
        if wait and self._free_arena() is None:  # (an arena's release checks in, or warned that a rank did not)
            self._check_in_before_free()
        self._finalizer()
        if self._progress.requests:
            _ABANDONED.extend(self._progress.requests)
        self._sends.clear()

    def _free_arena(self) -> bool | None:
        """Give the node arena back, once every rank is known to be freeing it too (see :meth:`free`).

        Returns None where there is no arena, True once freed, False where a rank did
        not come (and the arena stays, with a warning).

        ``MPI_Win_free`` returns only when every rank of the node has called it, and
        no timeout can end it, so every rank first checks in with every other, twice
        (each round on a tag of its own, within the timeout): a rank frees the arena
        only when all have come and all know that all have, and a rank that gave up
        in either round never lets another reach the library's call alone. Only the
        arena of the communicator's own calls: a persistent request's channel is
        freed when its last request is, by each rank at its own time, so its arena
        stays to the end of the job. Under MPI only: the threads world's arena is
        NumPy memory, which the collector gives back.
        """
        if self._coll.name != "mpi" or made_arena(self._coll) is None:
            return None
        for round_ in range(2):
            stuck, reason = self._hear_from_every_rank("free", round_, self.timeout)
            if stuck:
                warnings.warn(f"communicator {self._label} on rank {self.rank}: its node arena stays until the job "
                              f"ends, since {reason}; free() is collective.", RuntimeWarning, stacklevel=3)
                return False
        free_arena(self._coll)
        return True

    def _hear_from_every_rank(self, kind: str, round_: int, timeout) -> tuple[list, str]:
        """One of free()'s check-ins (:func:`~commkit.schedule.check_in`): the ranks not heard from, and why.

        Its tag is ``kind``'s with ``round_`` where a call's number goes: a
        communicator is freed once, and ranks whose calls disagreed (one timed out
        in a call another never made, so their call numbers differ) still meet.
        """
        try:
            stuck = check_in(self._coll, self._ctl_tag(kind, round_), timeout)
        except CommError as exc:
            return [q for q in range(self.size) if q != self.rank], str(exc)
        return stuck, f"rank(s) {stuck} did not call free() within {timeout} s"

    def _check_in_before_free(self) -> None:
        """Every rank hears from every other before the contexts are freed, so nothing left for them is on its way.

        Why, and how each channel's ``free`` then drops what came: see
        ``MPITransport.checks_in_before_free``. Waits at most the communicator's
        timeout, or :data:`FREE_CHECK_IN_S` without one (a rank still computing must
        not make free() hang for ever where the library's own returns at once); a
        rank not heard from by then is warned about, and the communicator freed all
        the same. (Freeing the node arena checks in already: :meth:`_free_arena`.)
        """
        if not getattr(self._coll, "checks_in_before_free", False):
            return
        stuck, reason = self._hear_from_every_rank(
            "free contexts", 0, self.timeout if self.timeout is not None else FREE_CHECK_IN_S)
        if stuck:
            warnings.warn(f"communicator {self._label} on rank {self.rank}: freed without hearing from every rank, "
                          f"since {reason}; free() is collective. A message still on its way to it may be taken "
                          "by the next communicator made (see docs/troubleshooting.md).", RuntimeWarning, stacklevel=3)

    @property
    def flight_recorder(self) -> _watchdog.FlightRecorder:
        """The recorder of this communicator's recent calls (what :meth:`flight_record` reads)."""
        return self._recorder

    def flight_record(self) -> list[dict]:
        """This rank's recent collective calls on this communicator, oldest first (see :mod:`commkit.watchdog`)."""
        return self._recorder.entries()

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, kind, exc, tb) -> None:
        self._free(wait=kind is None)  # (see free: an exception leaves at once)

    def dup(self) -> "Communicator":
        """A new communicator over the same ranks (collective: every rank must call it).

        Works on a communicator that is broken after a timeout too: that is how to get a
        fresh one with the same ranks.
        """
        if self._closed is _FREED:
            self._check_open()
        return Communicator(_checked_dup(self._base), timeout=self.timeout, check=self.check, plans=self._plans_on,
                            owns_transport=True, label=f"{self._label}.dup{next(self._children)}")

    def split(self, color: int | None, key: int = 0) -> "Communicator | None":
        """Partition the ranks by ``color``; order each part by ``(key, rank)``.

        Collective. Ranks passing ``color=None`` get None back (MPI_UNDEFINED).
        """
        self._check_open()
        if color is not None and (isinstance(color, bool) or not isinstance(color, (int, np.integer)) or color < 0):
            raise InvalidArgument(f"color must be a non-negative int or None, got {color!r}.")
        if isinstance(key, bool) or not isinstance(key, (int, np.integer)):
            raise InvalidArgument(f"key must be an int, got {type(key).__name__}.")
        sub = self._base.split(None if color is None else int(color), int(key), self.timeout)
        child = next(self._children)
        if sub is None:
            return None
        return Communicator(sub, timeout=self.timeout, check=self.check, plans=self._plans_on, owns_transport=True,
                            label=f"{self._label}.split{child}[{int(color)}]")

    def abort(self, exc: BaseException | None = None) -> None:
        """Tell every rank this job cannot continue (MPI: MPI_Abort; threads: wake and fail peers)."""
        self._base.abort(exc or RuntimeError("abort() called"))

    # -- point to point ------------------------------------------------------------

    def _recv_buffer(self, out, shape, dtype, name="out"):
        if out is not None:
            return check_out(out, None, None, name)
        if shape is None or dtype is None:
            raise InvalidArgument(
                f"recv needs a buffer: pass {name}=array, or shape= and dtype= to allocate one."
            )
        dtype = np.dtype(dtype)
        check_dtype(dtype, "dtype")
        # An NCCL communicator receives into GPU memory (CuPy is loaded whenever one exists).
        xp = sys.modules["cupy"] if self._base.name == "nccl" else np
        return xp.empty(shape, dtype=dtype)

    def send(self, x, dest: int, tag: int = 0, *, timeout: float | None = None) -> None:
        """Send array ``x`` to rank ``dest`` (blocks until ``x`` may be reused)."""
        self.isend(x, dest, tag).wait(timeout)

    def isend(self, x, dest: int, tag: int = 0) -> Request:
        """Start sending ``x`` to ``dest``; do not modify ``x`` until the request completes."""
        self._check_open()
        given = x
        x = as_input(x, "x")
        dest = check_rank(dest, self.size, "dest")
        tag = check_tag(tag, self._tag_ub)
        flat = x.reshape(-1)
        pending = self._p2p.isend(flat, dest, tag)
        if self._sends:
            self._sends = [entry for entry in self._sends if not entry[0].test()]
        if x is not given:
            # The message goes out of a copy commkit made (a list, a strided view ...): keep it
            # alive until the send completes, even if the caller drops the request.
            self._sends.append((pending, flat))
        return PointToPointRequest(pending, None, self.timeout, f"rank {self.rank}: send to rank {dest}", keep=flat,
                       comm=self, peers=(dest,))

    def recv(self, source: int = ANY_SOURCE, tag: int = ANY_TAG, *, out=None, shape=None, dtype=None,
             timeout: float | None = None, return_status: bool = False):
        """Receive an array from ``source`` (or any rank) into ``out`` or a new array.

        Returns the array, or ``(array, Status)`` with ``return_status=True``.
        A message larger than the buffer raises InvalidBuffer.
        """
        request = self.irecv(source, tag, out=out, shape=shape, dtype=dtype)
        result = request.wait(timeout)
        return (result, request.status) if return_status else result

    def irecv(self, source: int = ANY_SOURCE, tag: int = ANY_TAG, *, out=None, shape=None, dtype=None) -> Request:
        """Start receiving into ``out`` (or a new array of ``shape``/``dtype``); ``wait()`` returns it."""
        self._check_open()
        buf = self._recv_buffer(out, shape, dtype)
        source = check_rank(source, self.size, "source", allow_any=True)
        tag = check_tag(tag, self._tag_ub, allow_any=True)
        pending = self._p2p.irecv(buf.reshape(-1), source, tag)
        who = "any rank" if source == ANY_SOURCE else f"rank {source}"
        return _RecvRequest(pending, buf, self.timeout, f"rank {self.rank}: recv from {who}", comm=self,
                            peers=(source,) if source != ANY_SOURCE else ())

    def sendrecv(self, x, dest: int, source: int = ANY_SOURCE, *, sendtag: int = 0, recvtag: int = ANY_TAG,
                 out=None, shape=None, dtype=None, timeout: float | None = None):
        """Send ``x`` to ``dest`` and receive from ``source`` at the same time (never deadlocks in a ring).

        The receive buffer defaults to a new array shaped like ``x``.
        """
        self._check_open()
        x = as_input(x, "x")
        if out is None and shape is None:
            out = array_module(x).empty(x.shape, x.dtype)  # on the device when x is a CuPy array
        receive = self.irecv(source, recvtag, out=out, shape=shape, dtype=dtype)
        self.isend(x, dest, sendtag).wait(timeout)
        return receive.wait(timeout)

    def send_object(self, obj, dest: int, tag: int = 0) -> None:
        """Send a small picklable Python object to ``dest``."""
        self._check_open()
        dest = check_rank(dest, self.size, "dest")
        tag = check_tag(tag, self._tag_ub)
        self._p2p.send_object(obj, dest, tag | self._object_bit)

    def recv_object(self, source: int = ANY_SOURCE, tag: int = ANY_TAG, *, timeout: float | None = None,
                    return_status: bool = False):
        """Receive a Python object sent with :meth:`send_object`."""
        self._check_open()
        source = check_rank(source, self.size, "source", allow_any=True)
        tag = check_tag(tag, self._tag_ub, allow_any=True)
        timeout = check_timeout(timeout) if timeout is not None else self.timeout
        want = tag if tag == ANY_TAG else tag | self._object_bit
        got = self._p2p.recv_object(source, want, timeout, object_bit=self._object_bit)
        if got is None:
            raise CommTimeout(f"rank {self.rank}: recv_object from {source} timed out after {timeout:g} s.")
        obj, status = got
        if not status.tag & self._object_bit:
            raise InvalidBuffer(
                f"rank {self.rank}: recv_object matched an array that rank {status.source} sent with send() "
                f"(tag {status.tag}, {status.nbytes} bytes); receive arrays with recv()."
            )
        status = status._replace(tag=status.tag & ~self._object_bit)
        return (obj, status) if return_status else obj

    # -- object collectives (small metadata, on the ctl context) -------------------

    def _ctl_allgather(self, obj, tag, timeout):
        def timed_out(peer):
            return CommTimeout(
                f"rank {self.rank} timed out after {timeout:g} s exchanging call metadata with rank {peer}; "
                "that rank may not have reached the same call."
            )
        return allgather_objects(self._coll, obj, tag, timeout, timed_out)

    def allgather_object(self, obj, *, timeout: float | None = None) -> list:
        """Every rank's ``obj``, in rank order, on every rank (small picklable objects)."""
        self._check_open()
        with self._serial("allgather_object"):
            seq = self._next_seq()
            return self._ctl_allgather(obj, self._ctl_tag("object", seq), timeout or self.timeout)

    def shared_empty(self, shape, dtype=np.float64) -> np.ndarray:
        """A new uninitialised array in memory every rank of this node can read: the node algorithms' zero copy.

        Collective: every rank calls it, in the same order as its other calls (each
        rank may ask for its own shape). The node algorithms (``algorithm="shm"``)
        copy every array through the node's arena; an allreduce, broadcast,
        allgather, reduce_scatter or alltoall whose ``in`` and ``out`` on every rank are such arrays (``out=``
        given, or in place with ``out=x``) reads its peers' arrays where they lie
        instead, with no copy in or out: the memory floor. Slices of a shared array
        are shared too. Ranks that mix shared and other arrays in one call get a
        :class:`~commkit.errors.CollectiveMismatch`.

        The memory is the library's (an MPI shared window per call; in the threads
        world plain NumPy memory) and lives until the job ends, as the arena does:
        allocate once and reuse, as with pinned buffers.

        Example::

            x = comm.shared_empty(1 << 20, np.float32)
            x[:] = local_gradient
            comm.allreduce(x, out=x, algorithm="shm")   # in place, no copy through the arena

        Raises:
            AlgorithmNotApplicable: the ranks are not all on one node, or the transport has
                no shared memory (NCCL).
            InvalidArgument: a malformed shape or dtype.
        """
        self._check_open()
        try:
            shape = tuple(int(n) for n in shape) if np.ndim(shape) else (int(shape),)
        except (TypeError, ValueError):
            raise InvalidArgument(f"shape must be a whole number or a tuple of them, got {shape!r}.") from None
        if any(n < 0 for n in shape):
            raise InvalidArgument(f"shape must not be negative, got {shape}.")
        try:
            dtype = np.dtype(dtype)
        except TypeError:
            raise InvalidArgument(f"dtype must be a NumPy dtype, got {dtype!r}.") from None
        if dtype.hasobject:
            raise InvalidArgument(f"a shared array holds plain data, not Python objects; got dtype {dtype}.")
        make = getattr(self._coll, "arena", None)
        if make is None:
            raise AlgorithmNotApplicable(
                f"the {self.transport_name} transport has no shared memory; shared_empty is for MPI and the "
                "threads world.")
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        with self._serial("shared_empty"):
            seq = self._next_seq()
            # Every rank checks in first, timed, so a rank that never comes is named (the allocation
            # itself is the library's collective, which no timeout can end).
            self._ctl_allgather(nbytes, self._ctl_tag("shared", seq), self.timeout)
            part = make().allocate(nbytes)
        if not self._shared_arrays:
            self._shared_arrays = True
            self._forget_shapes()  # (a node call's shape plan would run the copying form on shared arrays too)
        return part.view(dtype).reshape(shape)

    def gather_object(self, obj, root: int = 0, *, timeout: float | None = None):
        """Every rank's ``obj`` in rank order at ``root`` (None elsewhere)."""
        self._check_open()
        root = check_rank(root, self.size, "root")
        with self._serial("gather_object"):
            seq = self._next_seq()
            tag = self._ctl_tag("object", seq, root)
            timeout = timeout or self.timeout
            if self.rank != root:
                self._coll.send_object(obj, root, tag)
                return None
            out = []
            for peer in range(self.size):
                if peer == root:
                    out.append(obj)
                    continue
                got = self._coll.recv_object(peer, tag, timeout)
                if got is None:
                    raise CommTimeout(f"rank {root} timed out in gather_object waiting for rank {peer}.")
                out.append(got[0])
            return out

    def broadcast_object(self, obj, root: int = 0, *, timeout: float | None = None):
        """``root``'s ``obj`` on every rank (small picklable objects)."""
        self._check_open()
        root = check_rank(root, self.size, "root")
        with self._serial("broadcast_object"):
            seq = self._next_seq()
            return self._bcast_meta(obj, root, seq, timeout or self.timeout)

    def _bcast_meta(self, obj, root, seq, timeout):
        tag = self._ctl_tag("meta", seq, root)
        if self.rank == root:
            for peer in range(self.size):
                if peer != root:
                    self._coll.send_object(obj, peer, tag)
            return obj
        got = self._coll.recv_object(root, tag, timeout)
        if got is None:
            raise CommTimeout(f"rank {self.rank} timed out after {timeout:g} s waiting for metadata from root {root}.")
        return got[0]

    # -- collective machinery ---------------------------------------------------------

    @contextmanager
    def _serial(self, what):
        if not self._entry.acquire(blocking=False):
            raise self._concurrent(what)
        try:
            yield
        finally:
            self._entry.release()

    def _ctl_tag(self, kind: str, seq: int, root=None) -> int:
        return self._layout.tag(self._layout.base(kind, None, (root,)), seq)

    def _next_seq(self) -> int:
        seq = self._seq
        self._seq = seq + 1
        if self._stale:
            self._drop_stale(seq)
        if self._progress.requests:
            self._progress.settle(seq, self._seq_span, self.timeout)
        return seq

    def _spend_number(self, seq: int, claims: int, persistent: bool, collective: str | None = None) -> None:
        """A call that failed its local checks on this rank before taking call number ``seq``: take it now.

        Why. The other ranks made the call too, and where they need nothing from
        this rank (a reduce or gather to it as root, a broadcast or scatter to it
        as a leaf) they finished it and sent what it was to receive. Had this
        rank's next call taken ``seq``, it would have matched those messages (the
        same tag, when it repeats the call), and returned the failed call's data,
        one call late at every call after: a wrong answer, silently. So the
        failed call counts as made here as well, as MPI counts every collective
        call a rank makes, and its messages are dropped as they come
        (:meth:`_drop_stale`), before the call number comes round again. A call
        refused on every rank alike spends the number on every rank alike.

        A persistent ``*_init`` takes no call number, but a number on the
        persistent channels (:class:`_PersistentChannels`), which pairs it with
        the other ranks' request made at the same point: one that failed before
        taking its own (``claims`` were made before the call) takes it and gives
        it back, so that this rank's next request pairs with theirs, not with the
        one it failed to make. ``seq`` and ``claims``: the counts before the call;
        ``persistent``: whether it was a ``*_init`` call.
        """
        if self._closed:
            return
        if persistent:
            if self._persistent_channels.claims == claims:
                self._persistent_channels.claim()[2]()
            return
        if self._seq != seq:  # the call took its number, and failed after
            return
        self._next_seq()
        # (Alone, no rank sent it anything; NCCL's channel has no tags to tell a stale message by.)
        if self.size > 1 and getattr(self._coll, "discard", None) is not None:
            # (every path that takes a call number looks at it.) The collective's kind, where the tags carry one
            # and the call is named: see _drop_stale.
            kind = kind_code(collective) if collective in _ONE_KIND else 0
            self._stale[seq] = (seq + self._seq_span, kind if kind and self._layout.exact else None)

    def _drop_stale(self, seq: int) -> None:
        """Before call ``seq`` sends anything: receive and drop what peers sent for calls this rank gave up.

        A message of given-up call ``n`` is told by the call number in its tag
        (no call between ``n`` and ``n + span`` has that number), and comes from
        each peer before anything that peer sent for a later call. So each peer's
        oldest message is looked at while it carries such a number, at every
        call until the number comes round again (see :meth:`_spend_number`).

        Near the window's end a peer a call or more ahead may already have sent
        a message of call ``n + span``, which carries ``n``'s number too (3
        ranks, one late: it was dropped, and that call waited). Where the tags
        carry the collective's kind (an exact layout, :class:`TagLayout`) and
        the refused call was named, only messages of ``n``'s collective (and
        control traffic, kind 0) are dropped, so a later call of another
        collective keeps its messages; one of the same collective, a call
        ahead just then, is the case left.
        """
        layout, coll, stale = self._layout, self._coll, self._stale
        for number, (until, kind) in list(stale.items()):
            if seq >= until:
                del stale[number]
                continue
            residue = number & layout.seq_mask
            for source in range(self.size):
                if source == self.rank:
                    continue
                while True:
                    status = coll.probe(source, ANY_TAG)
                    if status is None or (status.tag >> layout.seq_shift) & layout.seq_mask != residue or (
                            kind is not None and layout.kind_of(status.tag) not in (kind, 0)):
                        break  # (kind 0: the call's control traffic, such as the node arena's agreement)
                    coll.discard(status)

    def _scratch_buffer(self, xp, dtype, n, nonblocking, role="tmp"):
        """Scratch of ``n`` elements, reused across blocking calls (one buffer per role and dtype)."""
        if nonblocking:
            return xp.empty(n, dtype=dtype)
        key = (role, xp, dtype)
        buf = self._scratch.get(key)
        if buf is None or buf.size < n:
            buf = xp.empty(max(n, 1), dtype=dtype)
            self._scratch[key] = buf
        return buf[:n]

    def _verify_call(self, call: Call, seq: int, algorithm: str, timeout, signature=(), nonblocking=False) -> None:
        """Debug mode: all ranks compare what they are about to run; mismatch raises everywhere.

        For a library collective that includes its form: MPI never matches a
        blocking call with a nonblocking one, which a timeout or an i-form makes.
        """
        form = None
        if algorithm == "native":
            form = "nonblocking" if nonblocking or timeout is not None else "blocking"
        segment = dict(signature).get("segment")
        if segment is not None:
            algorithm = f"{algorithm} (segment {segment})"
        self._agree({
            "collective": call.collective,
            "seq": seq,
            "op": call.op.name if call.op is not None else None,
            "root": call.root if call.collective in _ROOTED else None,
            "dtype": str(call.dtype) if call.dtype is not None else None,
            "count": call.signature_count,
            "algorithm": algorithm,
            "library form": form,
            "failed": None,
        }, seq, timeout)

    def announce_errors(self, collective: str, *, persistent: bool = False, kind: str | None = None):
        """A context manager: in check mode, an argument error raised in it reaches every rank.

        For code that checks a collective's arguments before calling it (the
        mpi4py face does): if the block raises an argument error
        (:class:`InvalidBuffer`, :class:`InvalidArgument`, :class:`UnsupportedOp`,
        :class:`AlgorithmNotApplicable`) before any collective started on this
        communicator, and check mode is on (``COMMKIT_DEBUG=check``), every other
        rank's matching call raises :class:`PeerFailed` naming this rank and its
        error, instead of waiting forever; this rank raises its own error. Outside
        check mode nobody is told (the agreement costs one small allreduce per
        call, which is what check mode pays anyway), but the call still counts
        as made on this rank, as on the ranks that went on with it: what they
        sent it for that call is dropped, never taken for a later call's data.
        commkit's own collectives do this for their own argument checks.

        ``persistent=True``: the block makes a persistent request (``*_init``),
        which is local: nothing is announced, but a request that fails on this
        rank still takes its number among persistent requests, so this rank's
        next one pairs with the other ranks' next one, not with the one it
        failed to make.

        ``kind``: the commkit collective the call runs as (``"broadcast"``),
        where ``collective`` names it otherwise (the face's ``"Bcast"``): the
        messages dropped for a failed call are then only those of that
        collective (see :meth:`_drop_stale`).

        Example::

            with comm.announce_errors("allreduce"):
                x = parse(args)            # may raise InvalidBuffer on one rank
                comm.allreduce(x, out=x)
        """
        return _Announcing(self, collective, persistent, kind)

    def _announce_failure(self, collective: str, exc: BaseException) -> None:
        """Check mode: this rank's call failed its local checks; tell every rank, so none waits for it.

        The other ranks are in (or will reach) the same call's check, which
        compares every rank's description of it: this rank's says it failed and
        why, so they raise :class:`PeerFailed` naming it instead of waiting for
        messages that will never come. Then this rank raises its own error.
        The call number is used up on every rank alike, so later calls still match.
        """
        seq = self._next_seq()
        failed = f"{type(exc).__name__}: {exc}"
        try:
            self._agree({"collective": collective, "seq": seq, "op": None, "root": None, "dtype": None,
                         "count": None, "algorithm": None, "library form": None, "failed": failed}, seq,
                        self.timeout)
        except PeerFailed:
            pass  # the others know (every rank raises, this one its own error)

    def _agree(self, mine: dict, seq: int, timeout) -> None:
        tag = self._ctl_tag("check", seq)
        # Fast path: one small recursive-doubling allreduce of (hash, -hash) per field with
        # MAX tells every rank whether all ranks agree (max == min for every field), in
        # log p messages. Only a disagreement pays for gathering every rank's description.
        k = len(mine)
        sig = np.array([zlib.crc32(repr(v).encode()) for v in mine.values()], dtype=np.int64)
        both, agreed = np.concatenate([sig, -sig]), np.empty(2 * k, np.int64)
        steps = allreduce_recursive_doubling(self.rank, self.size, 2 * k, MAX)
        run_schedule(steps, {"in": both, "out": agreed, "tmp": np.empty(2 * k, np.int64)}, self._coll, tag,
                     timeout, ("check", "recursive_doubling", seq, self.rank, None))
        if np.array_equal(agreed[:k], -agreed[k:]):
            return
        everyone = self._ctl_allgather(mine, tag, timeout)
        failed = {rank: sig["failed"] for rank, sig in enumerate(everyone) if sig.get("failed")}
        if failed:
            first = min(failed)
            raise PeerFailed(
                f"{everyone[first]['collective']} call #{seq} was abandoned on every rank: rank(s) "
                f"{sorted(failed)} rejected their arguments before sending anything (rank {first}: "
                f"{failed[first].rstrip('.')}). Check mode (COMMKIT_DEBUG=check) tells every rank; see "
                "docs/troubleshooting.md."
            )
        differing = [field for field in mine if len({repr(sig[field]) for sig in everyone}) > 1]
        if differing:
            lines = []
            for field in differing:
                values = {}
                for rank, sig in enumerate(everyone):
                    values.setdefault(repr(sig[field]), []).append(rank)
                lines.append(f"{field}: " + "; ".join(f"{v} on ranks {r}" for v, r in values.items()))
            raise CollectiveMismatch(
                f"ranks disagree about collective call #{seq} (seen on rank {self.rank}):\n  " + "\n  ".join(lines)
            )

    def _node_why(self, call: Call | None):
        """``(nodes, why)`` for the selector: how many nodes the ranks span, and why this call cannot use them.

        ``why`` is None when a node algorithm can run the call; else it says why
        not: the transport has no arena, or the arrays are on a device (the arena
        is host memory). Every rank answers alike: the same call on the same
        communicator.
        """
        transport = self._coll
        if getattr(transport, "arena", None) is None:
            return None, (f"the {transport.name} transport has no shared-memory arena, which the node algorithms "
                          "need; choose a two-sided algorithm")
        nodes = self._node_count if self._node_count is not None else count_nodes(transport)
        if self._arena_failed is not None:
            return nodes, self._arena_failed
        if call is not None and call.xp is not np:
            return nodes, ("the node arena is host memory and these arrays are on a device; choose a two-sided "
                           "algorithm")
        return nodes, None

    def _no_arena(self, timeout) -> str | None:
        """Make the node arena for a node algorithm a table chose; None once made, else why it cannot be.

        Called where a call's plan is made, before the call takes its number, by
        every rank at the same call (the first whose table picks a node
        algorithm). Every rank first says to every other whether it can make the
        arena (within ``timeout``): under MPI whether ``/dev/shm`` has room for it
        (``_arena.lacks_room``), looked at before the library's collective, which
        a rank that fails alone would leave the others inside for good; in the
        threads world, whether the memory could be had. If any rank cannot, all of
        them keep the two-sided algorithms for this communicator from then on,
        with one warning, instead of raising: a table's choice must not make a
        call fail that a two-sided algorithm runs. A node algorithm asked for by
        name still raises the arena's error.
        """
        transport = self._coll
        if self._arena_failed is not None or made_arena(transport) is not None:
            return self._arena_failed
        seq = self._seq  # (the call's own number; the tags are the control traffic's)
        why = self._agree_on_arena(transport, self._ctl_tag("arena", seq), timeout, f"before call #{seq}")
        if why is None:
            return None
        self._arena_failed = why
        warnings.warn(f"communicator {self._label} on rank {self.rank}: {self._arena_failed} The node algorithms "
                      "are off for this communicator; the two-sided ones run its calls.", RuntimeWarning,
                      stacklevel=4)
        return self._arena_failed

    def _agree_on_arena(self, transport, tag: int, timeout, when: str) -> str | None:
        """Make ``transport``'s node arena once every rank says it can; None when made, else why not (every rank alike).

        Every rank first tells every other whether it can make the arena (within
        ``timeout``): under MPI whether ``/dev/shm`` has room for it
        (``_arena.lacks_room``), looked at before the library's collective, which a
        rank that fails alone would leave the others inside for good; in the
        threads world, whether the memory could be had. The answers go out even
        where this rank's arena is made already: a threads-world rank may have made
        it where another failed, and every rank must take the same path.
        """
        why = None
        if made_arena(transport) is None:
            if transport.name == "mpi":
                why = lacks_room(self.size)
            else:
                try:
                    transport.arena()
                except CommError as exc:  # (not AlgorithmNotApplicable: the selector already knows the node count)
                    why = str(exc)
        # Every rank's answer, which is also every rank's check-in before the library's call.
        stuck, failed = check_in_saying(transport, why is None, tag, timeout)
        if stuck:
            raise CommTimeout(f"rank {self.rank} timed out after {timeout:g} s agreeing on the node arena {when}, "
                              f"waiting for rank(s) {stuck}.")
        if why is None and not failed:
            transport.arena()  # (MPI: the library's collective, every rank now known to be here)
            return None
        return why or f"the node arena could not be made on rank(s) {failed}."

    def _arena_why(self, choice, call: Call, timeout):
        """Why the node arena cannot run ``call`` under ``choice`` (a node algorithm a table chose), or None if it can.

        A schedule that claims no slot (one rank's) needs no arena. One that does
        needs its chunks to fit a slot, and the arena made (:meth:`_no_arena`).
        """
        itemsize = call.dtype.itemsize if call.dtype is not None else 1
        segment = None if choice.segment is None else max(1, choice.segment // itemsize)
        claim = next((step for step in self._steps(choice.algorithm, call, segment) if step.kind == CLAIM), None)
        if claim is None:
            return None
        made = made_arena(self._coll)  # (its size was read when it was made)
        have = made.slot_bytes if made is not None else arena_bytes()
        if claim.elements * itemsize > have:
            return (f"this call's chunks need {claim.elements * itemsize} bytes of node arena slot per rank, and the "
                    f"arena has {have} (COMMKIT_NODE_ARENA_BYTES); choose a smaller segment or a larger arena")
        return self._no_arena(timeout)

    def _native_ok(self, call: Call) -> bool:
        """Whether the transport's own collective (``native``) can run ``call``."""
        transport = self._coll
        if call.collective == "barrier" or call.dtype is None:
            return hasattr(transport, "native")
        return hasattr(transport, "native_supports") and transport.native_supports(call.collective, call.dtype,
                                                                                     call.op)

    def _plan(self, call: Call, algorithm, timeout=None, persistent=False):
        """Select the algorithm for this call shape and materialise its schedule (cached).

        Schedules are data-oblivious, so the steps for one (collective, size, count,
        dtype, op, root, algorithm) never change: they are computed once per
        communicator and replayed, which keeps selection and generator costs off the
        per-call path. Environment overrides are therefore read at the first call of
        each shape on a communicator. The plan also holds the shape's tag base (its
        identity, :mod:`commkit.identity`) and its flight-recorder signature.
        ``persistent``: a persistent request's, whose plans are kept apart
        (:func:`_plan_key`): a table's rule may leave persistent requests out.
        """
        key = _plan_key(call, algorithm, persistent)
        transport = self._coll
        native_ok = self._native_ok(call)
        nodes, node_why = self._node_why(call)
        library = getattr(transport, "library", None)
        choice = selection.select(call.collective, self.size, call.nbytes, call.op, algorithm, native_ok, nodes,
                                  node_why, transport.name, persistent, library)
        if not choice.forced and algorithms.is_node_only(choice.algorithm):
            # A table chose the node engine: a call the arena cannot hold (COMMKIT_NODE_ARENA_BYTES set small,
            # or COMMKIT_SEGMENT_ELEMENTS large), or an arena that cannot be had, takes the next rule instead of
            # failing where a two-sided one runs.
            node_why = self._arena_why(choice, call, timeout)
            if node_why is not None:
                choice = selection.select(call.collective, self.size, call.nbytes, call.op, algorithm, native_ok,
                                          nodes, node_why, transport.name, persistent, library)
        alg = choice.algorithm
        root = call.root if call.collective in _ROOTED else None
        op = call.op.name if call.op is not None else None
        signature = (("count", call.signature_count), ("dtype", None if call.dtype is None else str(call.dtype)),
                     ("root", root), ("op", op))
        segment = None
        if alg.segmented:
            # Segment size in elements for this dtype; the ranks must agree on it (their messages are cut
            # by it), so it is part of the call's identity: the environment's default when none was chosen.
            if choice.segment is not None:
                itemsize = call.dtype.itemsize if call.dtype is not None else 1
                segment = max(1, choice.segment // itemsize)
            signature += (("segment", segment if segment is not None else segment_elements()),)
        tagbase = self._layout.base(call.collective, call.dtype,
                                    (root, op, call.signature_count, alg.name) + signature[4:])
        if alg.name == "native":
            # In place is always safe for the library: MPI_IN_PLACE, or a broadcast's buffer as it is.
            plan = (choice, None, 0, True, alg.name, tagbase, signature)
        else:
            steps = tuple(self._steps(alg, call, segment))
            self._refuse_input_writes(alg, call, segment, steps)
            plan = (choice, steps, alg.scratch(self.rank, self.size, call.arg, **self._node_args(alg)),
                    _inplace_safe(steps), alg.name, tagbase, signature)
        if len(self._plans) >= 512:
            self._plans.clear()
            self._forget_shapes()
        self._plans[key] = plan
        return plan

    def _zero_copy(self, call: Call, plan, algorithm):
        """The zero-copy steps of a node call whose ``in`` and ``out`` are shared arrays, else None (cached).

        Each rank decides from its own arrays and the call's size (from
        :func:`commkit.algorithms.node.zero_copy_min_bytes` up); a rank whose arrays
        are not shared runs the copying form, and the first wait on either side raises
        the mismatch.
        """
        alg = plan[0].algorithm
        if not alg.zero_copy:
            return None
        arena = self._coll.arena()
        if arena.locate(call.dst) is None or arena.locate(call.src) is None:
            return None
        key = (call.collective, call.arg, call.dtype, call.op, call.root, algorithm)
        found = self._zero_copy_steps.get(key, _SEEN_ONCE)
        if found is _SEEN_ONCE:
            if len(self._zero_copy_steps) >= 64:
                self._zero_copy_steps.clear()
            found = None  # a small call keeps the copying form: it costs fewer waits (node.ZERO_COPY_MIN_BYTES)
            if call.nbytes >= zero_copy_min_bytes(call.collective):
                steps = tuple(collectives.steps(alg.schedule, call.collective, self.rank, self.size, call.arg,
                                                call.op, call.root, shared=True))
                found = (steps, _inplace_safe(steps))
            self._zero_copy_steps[key] = found
        if found is None:
            return None
        if call.aliased and not found[1]:
            return None  # the input would be saved to private memory first, which peers cannot read
        return found

    _CHECK_EVERY_RANK = 64  # up to this size, a registered algorithm's schedules are checked for every rank

    def _refuse_input_writes(self, alg, call: Call, segment, steps) -> None:
        """Raise before anything is sent if a schedule writes the caller's input ``"in"``.

        This rank's schedule is always checked. A schedule registered outside
        commkit is checked for every rank too (up to :attr:`_CHECK_EVERY_RANK`
        ranks), so that every rank raises the same error instead of the others
        waiting for the one that refused.
        """
        ranks = [(self.rank, steps)]
        if not algorithms.is_builtin(alg) and self.size <= self._CHECK_EVERY_RANK:
            ranks += [(r, self._steps(alg, call, segment, r)) for r in range(self.size) if r != self.rank]
        for rank, rank_steps in ranks:
            wrong = writes_input(rank_steps)
            if wrong is not None:
                raise InvalidArgument(
                    f"{call.collective} algorithm {alg.name!r} writes the caller's input \"in\" at step {wrong[0]} "
                    f"({wrong[1]!r}) on rank {rank}; a schedule reads \"in\" and writes \"out\" or \"tmp\" "
                    "(see docs/extending.md). Nothing was sent.")

    def _run(self, call: Call, algorithm, timeout, nonblocking):
        if algorithm is not None and type(algorithm) is not str:
            raise InvalidArgument(f"algorithm must be an algorithm's name (a str) or None, got "
                                  f"{type(algorithm).__name__} {algorithm!r}.")
        if nonblocking == "init":
            return self._persistent(call, algorithm, timeout)
        if not self._entry.acquire(False):
            raise self._concurrent(call.collective)
        try:
            return self._run_locked(call, algorithm, timeout, nonblocking)
        finally:
            self._entry.release()

    def _concurrent(self, what) -> ConcurrentCall:
        return ConcurrentCall(
            f"{what} was called on rank {self.rank} while another thread was inside a collective call on "
            "the same communicator; give each thread its own communicator (comm.dup())."
        )

    def _run_locked(self, call: Call, algorithm, timeout, nonblocking):
        # The per-call path: every line here runs on every collective, so it avoids
        # work that the cached plan already did (selection, schedule generation, tag base).
        timeout = self.timeout if timeout is None else check_timeout(timeout)
        plan = self._plans.get((call.collective, call.arg, call.dtype, call.op, call.root, algorithm))
        if plan is None:
            plan = self._plan(call, algorithm, timeout)
        choice, steps, scratch_n, inplace_safe, name, tagbase, signature = plan
        self._last = (name, choice)
        if (not nonblocking and self._plans_on and not self._check and not self._progress.requests
                and not _trace_active):
            if call.key is not None and timeout is None:
                self._remember(call, plan, algorithm)
            if (call.xp is np and call.nbytes <= self._FAST_MAX_BYTES and (inplace_safe or not call.aliased)
                    and not (self._shared_arrays and choice.algorithm.zero_copy)):
                # A known call shape on new arrays (or with a timeout): its shape plan, once it has one
                # (the second call). Keyed by the cached plan's identity: _shaped is emptied whenever _plans is.
                # Not a node algorithm's on a communicator with shared arrays: whether a call's arrays are
                # shared decides its steps (the zero-copy form, below), call by call.
                timed = timeout is not None
                key = (id(plan), call.aliased, timed)
                shaped = self._shaped.get(key)
                if shaped is None or shaped is _SEEN_ONCE:
                    shaped = self._shape_plan(call, plan, key, shaped, timed)
                if shaped:
                    if call.fresh is not None and call.aliased == (call.fresh[5] == _IN_PLACE and call.has_result):
                        # later calls: _fresh (off a reduce's root, "in place" reads x alone and writes scratch)
                        self._by_shape[call.fresh] = [shaped, steps is None, None]  # (2: its entry, see _fresh)
                        self._fresh_hot.pop(call.collective, None)  # (its last entry may be of this key)
                    if log.isEnabledFor(logging.DEBUG):
                        log.debug("rank %d: %s #%d of %d bytes on %d ranks -> %s (%s; shape plan)", self.rank,
                                  call.collective, self._seq, call.nbytes, self.size, name, choice.reason)
                    src = call.dst if call.aliased else call.src
                    if not timed:
                        shaped.run(src, call.dst)
                    else:
                        seq = self._seq
                        try:
                            shaped.run(src, call.dst, timeout)
                        except CommTimeout as exc:  # the plan marked the call timed out in the flight record
                            raise self._gave_up(call.collective, seq, exc, steps is None) from None
                    return self._finish(call) if call.has_result else None
        if self._shared_arrays and call.xp is np and steps is not None:
            shared_steps = self._zero_copy(call, plan, algorithm)  # (before the call takes its number)
            if shared_steps is not None:
                steps, inplace_safe = shared_steps
        if nonblocking and steps is not None and self._progress.held >= self._layout.max_in_flight:
            raise InvalidArgument(
                f"{self._progress.held} nonblocking collectives are outstanding on this communicator (started, "
                "and not yet completed by wait() or a test() that returned True), the most whose messages can be "
                "told apart; complete some before starting more."
            )
        seq = self._seq
        self._seq = seq + 1
        if self._stale:  # (a shape plan above drops them itself, as every path that takes a number does)
            self._drop_stale(seq)
        if self._progress.requests and steps is not None:
            self._progress.settle(seq, self._seq_span, timeout)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("rank %d: %s #%d of %d bytes on %d ranks -> %s (%s)", self.rank, call.collective, seq,
                      call.nbytes, self.size, name, choice.reason)
        if self.check:
            self._verify_call(call, seq, name, timeout, signature, bool(nonblocking))
        tracer = _trace_active[-1] if _trace_active else None
        info = (call.collective, name, seq, self.rank, tracer)
        recorder = self._recorder
        rec = recorder.start(seq, call.collective, name, signature)
        if steps is None:
            starter = getattr(self._coll, "native_starter", None)
            if (nonblocking is True and call.fresh is not None and starter is not None and call.xp is np
                    and call.aliased == (call.fresh[5] == _IN_PLACE and call.has_result)):
                # later i-forms: _fresh starts the library's call itself (4: what _fresh_native passes it)
                _, _, inplace, counts, _ = self._native_args(call)
                start = starter(call.collective, call.dtype, op=call.op, root=call.root, inplace=inplace,
                                counts=counts)
                if start is not None:
                    spec = (call.root, start, self._exscan_identity(call))
                    self._by_shape_i[call.fresh] = [plan, None, None, None, spec]
                    self._fresh_hot_i.pop(call.collective, None)
            return self._run_native(call, nonblocking, timeout, CallInfo(*info), rec)
        src = call.src
        if call.aliased:
            # The executor skips a Copy whose source and destination are the same object.
            src = call.dst if inplace_safe else src.copy()
        if scratch_n == 0:
            tmp = _EMPTY
        else:
            tmp = self._scratch_buffer(call.xp, call.dtype, scratch_n, nonblocking)
        bufs = {"in": src, "out": call.dst, "tmp": tmp}
        layout = self._layout
        tag = ((seq & layout.seq_mask) << layout.seq_shift) | tagbase
        if nonblocking or tracer is not None or self._progress.requests:
            info = CallInfo(*info)
        if nonblocking or self._progress.requests:
            # With requests outstanding, a blocking call runs as one more request and waits
            # for it, driving the others meanwhile (see schedule.Progress).
            run = ScheduleRun(iter(steps), bufs, self._coll, tag, timeout, info,
                              finish=lambda: self._finish(call), progress=self._progress,
                              recorder=recorder, rec=rec, on_timeout=self._collective_timed_out)
            if not nonblocking:
                return run.wait()
            if call.fresh is not None and call.aliased == (call.fresh[5] == _IN_PLACE and call.has_result):
                # later i-forms: _fresh (3: the shape's entry, made by _fresh at its next call)
                compiled = self._nonblocking_steps(call, plan)
                # (rank 0's exscan result is written by the compiled forms alone, see _exscan_identity; a node
                # schedule's program waits for the arena, which this run's Claim may be the one to make)
                if compiled is not None or ((call.collective != "exscan" or self.rank != 0)
                                            and (made_arena(self._coll) is not None or not has_one_sided(plan[1]))):
                    self._by_shape_i[call.fresh] = [plan, compiled, self._pool(call, plan), None]
                    self._fresh_hot_i.pop(call.collective, None)
            return ScheduleRequest(run, self._progress)
        recorder.active = rec
        on = self._plans_on and not self._check and tracer is None  # (the switch that turns plans off, this too)
        program = self._node_program(steps, bufs) if on else None
        try:
            if program is not None:
                program.run(bufs, tag, timeout, info, rec)
            else:
                run_schedule(steps, bufs, self._coll, tag, timeout, info, rec)
        except CommTimeout as exc:
            recorder.finish(rec, "timed out")
            raise self._gave_up(call.collective, seq, exc) from None
        except BaseException:
            recorder.finish(rec, "failed")
            raise
        finally:
            recorder.active = None
        recorder.finish(rec)
        return self._finish(call) if call.has_result else None

    def _node_program(self, steps, bufs) -> NodeProgram | None:
        """The :class:`~commkit.schedule.NodeProgram` of a call's ``steps`` (an i-form runs its ``steps``); None: the
        interpreter's.

        Made at a shape's first call once the node arena exists (a schedule
        with no node steps is remembered as None), kept by the identity of
        the cached steps, and dropped with the arena it views: a program whose
        arena is no longer the transport's (freed) is never run.
        """
        found = self._node_programs.get(id(steps))
        if found is not None and found[0] is steps:
            program = found[1]
            if program is None or program.arena is made_arena(self._coll):
                return program
        arena = made_arena(self._coll)
        if arena is None:
            return None  # (no node call has run: none of these steps is one, or the interpreter makes the arena)
        if len(self._node_programs) >= 64:
            self._node_programs.clear()
        program = NodeProgram.make(steps, bufs, self._coll, arena)
        self._node_programs[id(steps)] = (steps, program)
        return program

    # -- compiled plans (plan.py) --------------------------------------------------------------

    _FAST_MAX_BYTES = 1 << 20  # plans keep their arrays alive: only small calls, where per-call cost matters
    # A shape plan or i-form shape gets persistent transfers (PersistentPool) when one call's in, out and
    # scratch fit in this many bytes: a 1 KiB recursive-doubling allreduce's 3 KiB does. A pool reserves
    # a slot per call number (1024), at most 4 MiB, and a communicator's pools _POOL_BUDGET bytes.
    _POOL_MAX_BYTES = 4096
    _POOL_BUDGET = 32 << 20
    _FAST_ENTRIES = 64

    # The vector collectives' entries (commkit/_vector.py), announced like the others.
    _allgatherv = _announced("allgatherv")(VectorCollectives._allgatherv)
    _gatherv = _announced("gatherv")(VectorCollectives._gatherv)
    _scatterv = _announced("scatterv")(VectorCollectives._scatterv)
    _alltoallv = _announced("alltoallv")(VectorCollectives._alltoallv)

    _HOT = ("allreduce", "reduce", "scan", "exscan", "broadcast", "gather", "scatter", "allgather", "alltoall",
            "reduce_scatter")

    def _forget_hot(self) -> None:
        """Drop the last plan of each collective (``_hot_<collective>``): the check before the plan cache.

        A loop that repeats one call with the same arrays finds its plan by four
        identity tests on the arguments (``plan.hot``), before building a key and
        looking it up: about 0.2 us less per call than the dict alone.
        """
        for name in self._HOT:
            setattr(self, "_hot_" + name, None)

    def _remember(self, call: Call, plan, algorithm=None) -> None:
        """Compile a plan for this blocking call's arrays the second time they come (see plan.py).

        A call without ``out`` (``keep`` ends in None where the call has a result)
        gets a plan that allocates its output at each run, where the plan can be
        written so (NumPy arrays, every op inline); else none, and its calls take
        the shape plan. A node call on shared arrays gets the plan of its
        zero-copy form (:meth:`_zero_copy`), whatever its size: a plan keeps its
        arrays alive, and shared arrays live as long as the arena anyway.
        """
        keep = call.keep
        if keep:  # (x, out): written out, as this runs on every call that has no plan yet
            x, out = keep
            fresh = out is None and call.has_result
            if fresh and (call.xp is not np or call.result is None or self._bare_exscan(call)):
                return
            nbytes = (0 if x is None else x.nbytes) + (0 if out is None else out.nbytes)
        else:  # barrier
            x = out = None
            fresh, nbytes = False, 0
        key = call.key
        big = nbytes > self._FAST_MAX_BYTES
        if (big and not self._shared_arrays) or key in self._fast:
            return
        # A key names arrays by identity, and an identity is reused once its array is gone: the
        # first sighting keeps weak references, so a fresh view per call never looks "seen".
        seen = self._seen
        refs = seen.get(key)
        if refs is None or (refs[0] is not None and refs[0]() is not x) or (refs[1] is not None
                                                                            and refs[1]() is not out):
            if len(seen) >= 4 * self._FAST_ENTRIES:
                seen.clear()
            try:
                seen[key] = (None if x is None else weakref.ref(x), None if out is None else weakref.ref(out))
            except TypeError:  # an array type without weak references: no plan for it
                pass
            return
        zero = (self._zero_copy(call, plan, algorithm) if self._shared_arrays and call.xp is np and plan[1] is not None
                else None)
        if len(self._fast) >= self._FAST_ENTRIES:
            self._fast.clear()
        if big and zero is None:  # (known, so its next calls skip these tests: the general path runs them)
            self._fast[key] = None
            return
        if zero is not None:  # the steps the call runs (see _run_locked)
            plan = (plan[0], zero[0], plan[2], zero[1]) + plan[4:]
        compiled = self._compile(call, plan, ("out",), fresh=True) if fresh else self._compile(call, plan)
        if compiled.run is None:  # None: the key stays known, and its calls go the general way
            self._fast[call.key] = None
            return
        self._fast[call.key] = compiled
        if call.collective in self._HOT:
            # The arguments themselves, in the order the method tests them: x, out, then the key's rest.
            compiled.hot = call.keep + call.key[3:]
            setattr(self, "_hot_" + call.collective, compiled)

    def _bound(self, call: Call, plan, persistent_tag=None, slots=(), timed=False, chan=None):
        """The ops of ``call`` on its own buffers: ``(ops, prologue, slots)``; ``persistent_tag`` for *_init.

        ``slots`` names the buffers a plan takes at each run instead (``"in"``,
        ``"out"``; see :class:`commkit.plan.Slots`): a shape plan compiles the
        schedule against stand-ins for both, a call without ``out`` against its
        own output.
        """
        choice, steps, scratch_n, inplace_safe, name, tagbase, signature = plan
        prologue = None
        if steps is None:
            send, recv, inplace, counts, prologue = self._native_args(call)
            bind = getattr(self._coll, "bind_native", None)
            taken = None
            if slots:  # the library takes the call's whole buffers (or None, or IN_PLACE)
                taken = Slots({"in": call.src, "out": call.dst}, slots)
                taken.whole("in", call.src)
                taken.whole("out", call.dst)
            if timed:  # the library's nonblocking form, waited for with the run's timeout
                run = timed_native(self._coll, call.collective, send, recv, call.op, call.root, counts, inplace)
            elif bind is not None:
                run = bind(call.collective, send, recv, op=call.op, root=call.root, counts=counts, inplace=inplace)
            else:
                def run(tag, coll=self._coll):
                    coll.native(call.collective, send, recv, op=call.op, root=call.root, counts=counts,
                                inplace=inplace)
            ops = [(TRANSFER, run, None, (), 0)]
            identity = self._exscan_identity(call) if persistent_tag is None else None
            if identity is not None:  # (MPI leaves rank 0's exscan result undefined)
                ops.append(write_out({"out": call.dst}, identity, taken))
            return ops, prologue, taken
        if "in" in slots and call.src is not None:  # a shape plan: no array of this call is bound
            src = stand_in(len(call.src), call.dtype)
            bufs = {"in": src, "out": src if call.aliased else stand_in(len(call.dst), call.dtype)}
        else:
            bufs, prologue = self._own_buffers(call, inplace_safe)
        bufs["tmp"] = self._tmp_for(call, scratch_n, private=persistent_tag is not None)
        taken = Slots(bufs, slots) if slots else None
        # A node schedule compiles into a plan on these arrays, once the arena it views is made.
        arena = made_arena(self._coll) if chan is None and persistent_tag is None else None
        ops = compile_ops(steps, bufs, chan or self._coll, persistent_tag, taken, timed, arena)
        identity = self._exscan_identity(call) if persistent_tag is None and chan is None else None
        if ops is not None and identity is not None:
            ops.append(write_out(bufs, identity, taken))
        return ops, prologue, taken

    def _exscan_identity(self, call: Call):
        """Rank 0's exscan result, flat (the op's identity), that its compiled forms write last; else None.

        No step of an exscan schedule (nor MPI's ``MPI_Exscan``) writes rank 0's
        result: the interpreter's :meth:`_finish` fills it after the run, and a
        compiled form ends with this write instead (:func:`commkit.plan.write_out`),
        so that a plan, a shape plan, its entry and an i-form all return what the
        general path returns. An op without an identity gives rank 0 None, which
        only the general path returns (:meth:`_bare_exscan`).
        """
        if call.collective != "exscan" or not call.has_result or self.rank != 0 or call.dst is None:
            return None
        identity = call.op.identity_array((len(call.dst),), call.dtype)
        return None if identity is None else call.xp.asarray(identity)

    def _bare_exscan(self, call: Call) -> bool:
        """Whether ``call`` is rank 0's exscan with an op that has no identity: its result is None, general path only."""
        return call.collective == "exscan" and self.rank == 0 and call.op.identity is None

    def _own_buffers(self, call: Call, inplace_safe: bool):
        """``({"in": ..., "out": ...}, prologue)``: the arrays a run of ``call`` reads and writes.

        In place, an algorithm that reads its input after writing its output reads a
        copy the ``prologue`` (``prologue(tag)``, None if none is needed) saves first.
        """
        src, dst, prologue = call.src, call.dst, None
        if call.aliased:
            if inplace_safe:
                src = call.dst
            else:  # the algorithm reads the input after writing the output: save the input first, each run
                src = call.xp.empty_like(call.src)

                def prologue(tag, dst=src, given=call.src):
                    dst[...] = given
        return {"in": src, "out": dst}, prologue

    def _tmp_for(self, call: Call, scratch_n: int, private: bool):
        """The scratch ``"tmp"`` of a run of ``call``: none, the communicator's, or its own (``private``)."""
        return _EMPTY if scratch_n == 0 else self._scratch_buffer(call.xp, call.dtype, scratch_n, private)

    def _compile(self, call: Call, plan, slots=(), fresh=False, timed=False) -> Plan | None:
        """The plan of a blocking call: on its arrays, on new arrays each run (``slots``), or a new output.

        ``timed``: a shape plan whose transfers (or library collective, in its
        nonblocking form) give up after the run's timeout.
        """
        ops, prologue, taken = self._bound(call, plan, slots=slots, timed=timed)
        keep, result, finish, allocate = call.keep, None, None, None
        if slots and not fresh:  # a shape plan: no arrays of its own, and the caller finishes the call
            keep = None
        elif fresh:  # the result is allocated by each run: the plan keeps none of them
            allocate = (call.result.shape, call.dtype, call.keep[0])
        else:
            result = call.result if call.has_result else None
            if call.has_result and self._bare_exscan(call):
                finish = lambda: self._finish(call)  # noqa: E731 - rank 0's result is None (see _exscan_identity)
        return Plan(self, ops, plan[5], call.collective, plan[4], plan[0], plan[6], call.dtype, keep, result,
                    finish, prologue, taken, allocate, timed)

    def _shape_plan(self, call: Call, plan, key, state, timed):
        """The shape plan for ``call``'s shape: compiled the second time the shape comes, else None or False."""
        shaped = self._shaped
        if state is None:
            if len(shaped) >= self._FAST_ENTRIES:
                shaped.clear()
            shaped[key] = _SEEN_ONCE
            return None
        # A timed call's transfers are posted and polled until its timeout (the transport's
        # bind_timed_transfer) on every library: a persistent slot per call number, with its copies and
        # bookkeeping, measured slower on MPICH and on Open MPI alike (docs/call_cost.md). An untimed call
        # keeps the transport's blocking transfer.
        compiled = self._compile(call, plan, ("in", "out"), timed=timed)
        shaped[key] = compiled = compiled if compiled is not None and compiled.run is not None else False
        return compiled

    def _forget_shapes(self) -> None:
        for entry in self._by_shape_i.values():  # (the i-forms' pools: a shape plan has none)
            if entry[2] is not None:
                entry[2].free()
        self._shaped.clear()
        self._by_shape.clear()
        self._by_shape_i.clear()
        self._fresh_hot.clear()
        self._fresh_hot_i.clear()
        for last in self._fresh_last.values():
            last[:] = (None, None)
        self._drop_entries()

    def _drop_entries(self, untimed_only: bool = False, iforms: bool = True, park: bool = False) -> None:
        """Take the collectives' entries on new arrays out of their public methods' way (see _fresh).

        An untimed entry is installed only while the communicator is plain
        (``_plain``: no default timeout, check mode, outstanding request, and
        usable), a timed one while all but the default timeout holds
        (``_shapes_on``); each is dropped as soon as its condition ends, so an
        entry need not check it itself. ``untimed_only``: drop the untimed ones alone;
        ``iforms``: the i-forms' entries too, which check for themselves that i-forms may
        run compiled (outstanding requests do not stop them), so only a change of that
        drops them. With ``park`` (a change of state, ``_update_plain``) each dropped entry
        is kept aside and goes back when its state does (an untimed one when the
        communicator is plain again, a timed one when only the timeout keeps it from
        being plain); without (plans forgotten, a broken or freed communicator) nothing
        is, and ``_fresh`` installs an entry again at the next such call.
        """
        entries, parked = self._entries, self._parked
        if not park:
            parked.clear()
        for collective, timed in list(entries.items()):
            if not (untimed_only and timed):
                if park:
                    parked[collective] = (getattr(self, "_new_" + collective), timed)
                setattr(self, "_new_" + collective, None)
                del entries[collective]
        if iforms and not untimed_only:
            for collective in _FRESH_ENTRIES:
                setattr(self, "_new_i" + collective, None)

    def _fresh(self, collective, x, out, op, algorithm, timeout, stacked=False, nonblocking=False, root=None,
               scattered=False, split=False):
        """A call on new arrays of a shape already run: checked here and run from its cache; else GENERAL.

        The arrays are not those of a plan, but their kinds are those of a call
        the general path has checked and run (``_run_locked`` keeps it under
        ``call.fresh``): same collective, op and algorithm arguments (``op``:
        broadcast's root; None where there is neither), element type, shape,
        ``out`` given or not, timed or not. What can differ per array is checked
        here as the general path checks it: ``x`` contiguous; ``out`` a writeable
        contiguous NumPy array of the result's type and shape that shares no
        memory with ``x``, or ``x`` itself (in place) writeable. Anything else (a
        list, a strided view, an ``out`` overlapping ``x``, a concurrent call)
        takes the general path, which names the problem.

        A blocking call runs the shape's plan (``_by_shape``: compiled the second
        time the shape came). An untimed one repeating the arrays of the last
        call run here takes the general path instead, so that a loop on the same
        arrays gets its own compiled plan (``_remember``); a timed call has none.
        An i-form (``nonblocking``) starts its request on the shape's schedule
        (``_by_shape_i``), as the general path would, without its argument
        handling. ``collective`` has a result the shape of ``x`` on every rank
        (allreduce, scan, alltoall, broadcast), or with ``stacked`` one ``x`` per
        rank (allgather), or with ``root`` on that rank only (reduce, and with
        ``stacked`` gather: the others run into scratch, given no ``out``, and
        return None). With ``scattered`` (scatter) the root's result is one row
        of its ``x``, and the other ranks, whose ``x`` the call ignores, pass
        their ``out`` as ``x`` (and no ``out``): it is the block they fill, and
        their schedule reads an empty input. With ``split`` (reduce_scatter
        without counts) every rank's result is its share of ``x``'s rows.

        A loop's next call usually has the kinds of its last: each collective's
        last entry (``_fresh_hot``, ``_fresh_hot_i``) is checked first, by
        identity of the arguments and the element type, before the key is
        built and looked up.
        """
        if type(x) is not np.ndarray or _trace_active or log.isEnabledFor(logging.DEBUG):
            return GENERAL  # (the general path logs each call)
        if not (self._shapes_on or nonblocking and self._iforms_on):
            return GENERAL  # outstanding requests stop the blocking plans only: they do not drive them
        form = 0 if out is None else _IN_PLACE if out is x else 1  # _out_form, written out
        given_timeout = timeout
        hot = self._fresh_hot_i if nonblocking else self._fresh_hot
        h = hot.get(collective)
        if (h is not None and h[0] is x.dtype and h[1] == x.shape and h[2] is op and h[3] is algorithm
                and h[4] is timeout and h[5] == form and (timeout is not None or h[6] is self._timeout)
                and h[10] == root):
            entry, shape, timeout = h[7], h[8], h[9]  # (a given timeout was checked by the call that made h)
        else:
            if timeout is None:
                timeout = self._timeout
            try:
                entry = (self._by_shape_i if nonblocking else self._by_shape).get(
                    _fresh_key(collective, op if root is None else (op, root), algorithm, x, form, timeout))
            except TypeError:  # an unhashable argument: the general path names it
                return GENERAL
            if entry is None:
                return GENERAL
            if given_timeout is not None:
                timeout = check_timeout(timeout)
            shape = ((self.size,) + x.shape if stacked else x.shape[1:] if scattered and root == self.rank
                     else (x.shape[0] // self.size,) + x.shape[1:] if split else x.shape)
            hot[collective] = (x.dtype, x.shape, op, algorithm, given_timeout, form, self._timeout, entry, shape,
                               timeout, root)
        if not x.flags.c_contiguous:
            return GENERAL
        blocking_untimed = timeout is None and not nonblocking
        if blocking_untimed:
            last_pair = self._fresh_last[collective]
            last, last_out = last_pair
            # The same x as the last call here: the general path, so that a loop on the same arrays gets its own
            # plan. No last out means the last call had none, or an entry did not record it for a new x: this
            # call's out is recorded now, so that a loop giving a new out each call with the same x
            # (comm.allreduce(x, out=np.empty_like(x))) takes the shape's plan from its next call on, where it
            # took the general path at every call.
            if last is not None and last() is x:
                if last_out is None:
                    if form == 1:
                        last_pair[1] = _weakref(out)
                    return GENERAL
                if last_out() is out:
                    return GENERAL
        given_out = out
        result = scratch = None
        lead = x  # the array whose kinds the shape's entry checks (see plan.Entry)
        receiving = scattered and root != self.rank
        if (scattered or split) and form == _IN_PLACE:
            return GENERAL  # (the general path refuses it: a block is not the whole x)
        if receiving:  # x is the block to fill (see plan.Entry.receiving): the schedule's "in" is empty
            if out is not None or not x.flags.writeable:
                return GENERAL
            out = result = given_out = x
            x = scratch = self._scratch_buffer(np, x.dtype, 0, nonblocking, role="scatter-in")
        elif root is not None and root != self.rank:  # no result here: the schedule's "out" is scratch
            # An out given here is left alone, as the general path leaves it: one the root could take passes
            # (the general path checks a reduce's so; a gather's it ignores), anything else goes there.
            if form == 1 and not (type(out) is np.ndarray and out.dtype == x.dtype and out.shape == shape
                                  and (flags := out.flags).c_contiguous and flags.writeable):
                return GENERAL
            if form == _IN_PLACE and not x.flags.writeable:
                return GENERAL
            # (a gather's other ranks write no out: the general path gives them an empty one)
            out = scratch = self._scratch_buffer(np, x.dtype, x.size if collective == "reduce" else 0, nonblocking,
                                                 role="reduce-out")
        elif out is None:
            out = result = np.empty(shape, x.dtype)
        elif form == _IN_PLACE:
            if not x.flags.writeable:
                return GENERAL
        elif not (type(out) is np.ndarray and out.dtype == x.dtype and out.shape == shape
                  and (flags := out.flags).c_contiguous and flags.writeable
                  # two arrays that each own their memory (the usual fresh pair), or views of two such, cannot
                  # share it (the entries write the first case out: they are the hotter path)
                  and (owners_apart(x, x.base, out, out.base) or not np.may_share_memory(x, out))):
            return GENERAL
        if given_out is not None and scratch is None:
            result = out
        if not self._entry.acquire(False):
            return GENERAL
        try:
            src, dst = x if x.ndim == 1 else x.reshape(-1), out if out.ndim == 1 else out.reshape(-1)
            if nonblocking:
                if form == _IN_PLACE and scratch is None and not entry[0][3]:  # reads its input after writing out
                    src = src.copy()
                request = self._fresh_request(collective, entry, src, dst, result, timeout)
                if entry[3] is None and entry[1] is not None:  # the shape's entry: its next i-form comes to it
                    kinds = Entry(lead.dtype, lead.shape, op, root, algorithm, form, shape, scratch, log, GENERAL,
                                  _weakref, self._fresh_last[collective], timeout, given_timeout, self._timeout,
                                  receiving=receiving)
                    entry[3] = nonblocking_entry(kinds, IEntry(collective, *entry[:3], weakref.proxy(self), _EMPTY))
                elif entry[3] is None and entry[0][1] is None:  # the library's own: its i-form's entry
                    kinds = Entry(lead.dtype, lead.shape, op, root, algorithm, form, shape, scratch, log, GENERAL,
                                  _weakref, self._fresh_last[collective], timeout, given_timeout, self._timeout,
                                  receiving=receiving)
                    start = _NativeStart(weakref.proxy(self), collective, entry[0], entry[4])
                    entry[3] = native_nonblocking_entry(kinds, start)
                setattr(self, "_new_i" + collective, entry[3])
                return request
            shaped, native, made = entry
            if blocking_untimed:
                # Weakly: the communicator keeps no caller's array alive (a new one may then reuse an id,
                # never a weak reference's answer).
                self._fresh_last[collective][:] = ((_weakref(out), None) if receiving else
                                                   (_weakref(x), None if given_out is None else _weakref(given_out)))
                shaped.run(src, dst)
                if made is None:  # the shape's entry: its next call on new arrays comes straight to it
                    made = entry[2] = shaped.entry(Entry(lead.dtype, lead.shape, op, root, algorithm, form, shape,
                                                         scratch, log, GENERAL, _weakref, self._fresh_last[collective],
                                                         receiving=receiving)) or False
                if made and self._plain:
                    setattr(self, "_new_" + collective, made)
                    self._entries[collective] = False
            else:
                seq = self._seq
                try:
                    shaped.run(src, dst, timeout)
                except CommTimeout as exc:  # the plan marked the call timed out in the flight record
                    raise self._gave_up(collective, seq, exc, native) from None
                if made is None:  # the timed shape's entry (for this timeout, or this default timeout)
                    made = entry[2] = shaped.entry(Entry(lead.dtype, lead.shape, op, root, algorithm, form, shape,
                                                         scratch, log, GENERAL, _weakref, self._fresh_last[collective],
                                                         timeout, given_timeout, self._timeout, native,
                                                         receiving=receiving)) or False
                if made and self._shapes_on:
                    setattr(self, "_new_" + collective, made)
                    self._entries[collective] = True
        finally:
            self._entry.release()
        return result

    def _nonblocking_steps(self, call: Call, plan):
        """The i-form of ``call``'s shape compiled (:func:`commkit.plan.nonblocking_steps`), or None.

        A node schedule's is its :class:`~commkit.schedule.NodeProgram`'s generator
        (``steps``), once the arena is made: the same steps, turn, waits and peer
        checks as the interpreter's, written out.
        """
        _, steps, scratch_n, inplace_safe, name, _, _ = plan
        if call.xp is not np or steps is None:
            return None
        src = stand_in(len(call.src), call.dtype)
        dst = src if call.aliased and inplace_safe else stand_in(len(call.dst), call.dtype)
        bufs = {"in": src, "out": dst, "tmp": stand_in(scratch_n, call.dtype)}
        if has_one_sided(steps):  # (the blocking calls' program of these steps)
            program = self._node_program(steps, bufs)
            return None if program is None else _node_steps(program.steps, self.rank)
        return _then_write(nonblocking_steps(steps, bufs, self._coll, call.collective, name),
                           self._exscan_identity(call))

    def _pool(self, call: Call, plan):
        """The persistent transfers of ``call``'s i-form shape (:class:`commkit.plan.PersistentPool`), or None.

        Only for small messages (``_POOL_MAX_BYTES``: where the per-call cost is the time, and a slot per call
        number costs little memory) on a transport with persistent requests. The pool carries the generator
        that runs a slot (:func:`commkit.plan.persistent_steps`).
        """
        _, steps, scratch_n, _, name, tagbase, _ = plan
        if call.src is None or call.dst is None:  # (a barrier; a scatter's ranks but the root)
            return None
        sizes = (len(call.src), len(call.dst), scratch_n)
        if (call.xp is not np or steps is None or getattr(self._coll, "persistent_transfer", None) is None
                or sum(sizes) * call.dtype.itemsize > self._POOL_MAX_BYTES
                or PersistentPool.cost(steps, sizes, call.dtype, self._layout) > self._pool_budget[0]):
            return None
        # Stand-ins of their own for "in" and "out", never one array: a slot's are two.
        bufs = {"in": stand_in(len(call.src), call.dtype), "out": stand_in(len(call.dst), call.dtype),
                "tmp": stand_in(scratch_n, call.dtype)}
        run = _then_write(persistent_steps(steps, bufs, call.collective, name), self._exscan_identity(call))
        if run is None:
            return None
        return PersistentPool(run, steps, self._coll, sizes, call.dtype, tagbase, self._layout, self._pool_budget)

    def _fresh_request(self, collective, entry, src, dst, result, timeout):
        """The request of an i-form that ``_fresh`` checked: the general path's nonblocking start, on known steps."""
        progress = self._progress
        if progress.held >= self._max_in_flight:
            return GENERAL  # the general path raises, naming the limit
        plan, compiled, pool = entry[:3]
        _, steps, scratch_n, _, name, tagbase, signature = plan
        if steps is None:
            return self._fresh_native(collective, plan, entry[4], src, dst, result, timeout)
        seq = self._seq
        self._seq = seq + 1
        if self._stale:
            self._drop_stale(seq)
        if progress.requests:
            progress.settle(seq, self._seq_span, timeout)  # (so the slot of this call number is back, below)
        recorder = self._recorder
        rec = recorder.start(seq, collective, name, signature)
        self._last = (name, plan[0])
        layout = self._layout
        tag = ((seq & layout.seq_mask) << layout.seq_shift) | tagbase
        info = (collective, name, seq, self.rank, None)
        if pool is not None and pool.slots[seq & layout.seq_mask] is not None:  # (a number's first call posts)
            index = seq & layout.seq_mask
            slot = pool.slots[index]
            pool.slots[index] = SEEN  # while its run is in flight (see PersistentPool)
            if slot is SEEN:
                slot = pool.make(seq)
            # (positional: binding these as keywords cost about 0.25 us per call)
            run = ScheduleRun(None, None, self._coll, tag, timeout, info, None, progress, recorder, rec,
                              self._collective_timed_out, result, pool.run(src, dst, slot, pool.slots, index, rec))
            return ScheduleRequest(run, progress)
        if pool is not None:
            pool.slots[seq & layout.seq_mask] = SEEN
        tmp = np.empty(scratch_n, src.dtype) if scratch_n else _EMPTY
        bufs = {"in": src, "out": dst, "tmp": tmp}
        run = ScheduleRun(iter(steps), bufs, self._coll, tag, timeout, info, None, progress, recorder, rec,
                          self._collective_timed_out, result,
                          None if compiled is None else compiled(src, dst, tmp, tag, rec))
        return ScheduleRequest(run, progress)

    def _fresh_native(self, collective, plan, spec, src, dst, result, timeout):
        """An i-form of the library's own collective (``native``) on arrays ``_fresh`` checked: its call, a thin request.

        What the general path's ``_run_native`` does for a nonblocking call,
        with the library's arguments read off the checked arrays instead of
        built from a call object: ``src`` is ``dst`` in place, off a reduce's or
        gather's root there is nothing to receive, off a scatter's nothing to
        send, and a broadcast root copies its input into its output first.
        """
        root, start, identity = spec  # (see _run_locked; identity: rank 0's exscan result, else None)
        choice, _, _, _, name, _, signature = plan
        send, recv = src, dst  # (in place, the shape's starter passes MPI.IN_PLACE itself)
        me = self.rank
        if collective == "broadcast":
            if me == root and src is not dst:
                dst[...] = src
            send = None
        elif (collective == "reduce" or collective == "gather") and me != root:
            recv = None
        elif collective == "scatter" and me != root:
            send = None
        seq = self._seq
        self._seq = seq + 1
        if self._stale:
            self._drop_stale(seq)
        recorder = self._recorder
        rec = recorder.start(seq, collective, name, signature)
        self._last = (name, choice)
        recorder.active = rec
        try:
            pending = start(send, recv)  # (the transport's call for this shape, looked up once)
        except BaseException:
            recorder.finish(rec, "failed")
            raise
        finally:
            recorder.active = None
        try:
            settles = getattr(pending, "settles", None)  # (tested a few times: a small call whose peers are there
            settled = settles is not None and settles()  # completes now)
        except BaseException:
            recorder.finish(rec, "failed")
            raise
        if settled:  # nothing left to drive: no request joins the outstanding ones
            recorder.finish(rec)
            if identity is not None:
                dst[...] = identity
            return _NativeDone(result)

        def finish():
            if identity is not None:
                dst[...] = identity
            return result
        return _NativeRequest(pending, finish, timeout, CallInfo(collective, name, seq, me, None), self, rec)

    def _persistent(self, call: Call, algorithm, timeout) -> PersistentRequest:
        """A persistent collective for ``call`` (MPI-4 ``*_init``); see :class:`commkit.plan.PersistentRequest`."""
        timeout = self.timeout if timeout is None else check_timeout(timeout)
        plan = self._plans.get(_plan_key(call, algorithm, True)) or self._plan(call, algorithm, timeout, True)
        one_sided = plan[1] is not None and has_one_sided(plan[1])
        claim = None
        if one_sided:  # (compiled plans run no one-sided step)
            plan, claim = self._persistent_arena(call, algorithm, plan, timeout)
            one_sided = claim is not None
        choice, steps, scratch_n, inplace_safe, name, tagbase, signature = plan
        if call.has_result and call.result is None:
            call.result = call.dst.reshape(call.shape)
        if not call.has_result:  # a private output: a running request must not share scratch
            call.dst = call.xp.empty_like(call.dst)
        finish = (lambda: self._finish(call)) if call.collective == "exscan" and call.has_result else None
        result = call.result if call.has_result else None
        root = call.root if call.collective in _ROOTED else None
        op = call.op.name if call.op is not None else None
        native = None
        chan, tag, release = self._coll, None, None
        if steps is None:
            send, recv, inplace, counts, prologue = self._native_args(call)
            make = getattr(self._coll, "native_init", None)
            native = make(call.collective, send, recv, op=call.op, root=call.root, counts=counts,
                          inplace=inplace) if make is not None else None
            if native is None:
                native = _NativeRestart(self._coll, call.collective, send, recv, call.op, call.root, counts, inplace)
            ops = []
        else:
            # Its own identity for the life of the request (see _PersistentChannels): a channel that
            # ordinary calls never use, and a number there that no other live persistent request holds.
            chan, number, release = claim or self._persistent_channels.claim()
            base = self._layout.base(call.collective, call.dtype, (root, op, call.signature_count, name))
            tag = self._layout.tag(base, number)
            if one_sided:
                bufs, prologue = self._own_buffers(call, inplace_safe)
                bufs["tmp"] = self._tmp_for(call, scratch_n, private=True)
                return InterpretedPersistentRequest(self, steps, bufs, chan, tag, call.collective, name, signature,
                                                    result, finish, prologue, timeout, release)
            ops, prologue, _ = self._bound(call, plan, persistent_tag=tag, chan=chan)
        request = PersistentRequest(self, ops, tag, call.collective, name, signature, result, finish, prologue,
                                    timeout, native, release)
        if steps is None:  # mpi4py's *_init requests hold no reference to their buffers (see transports/mpi.py)
            request.held = (send, recv)
        return request

    def _persistent_arena(self, call: Call, algorithm, plan, timeout):
        """``(plan, claim)`` for a persistent request whose ``plan`` runs a node algorithm: its channel's arena made.

        The request runs on a channel of its own (:class:`_PersistentChannels`),
        whose arena is made here, at ``*_init``, so that no ``start()`` fails for
        want of it; ``claim`` is that channel's ``(channel, number, release)``. As
        :meth:`_no_arena` does for the communicator's arena, every rank first tells
        every other whether it can make it, before the library's collective. If any
        rank cannot, a node algorithm the table chose gives way, with one warning,
        to the two-sided algorithm the selection picks with the node engine ruled
        out (``claim`` is then None: that plan claims its channel as any other);
        one asked for by name raises.
        """
        chan, number, release = claim = self._persistent_channels.claim()
        try:
            why = self._agree_on_arena(chan, self._ctl_tag("arena", number), timeout,
                                       f"of a persistent {call.collective} request")
        except BaseException:
            release()
            raise
        if why is None:
            return plan, claim
        release()
        if plan[0].forced:
            raise AlgorithmNotApplicable(
                f"a persistent {call.collective} request with algorithm {plan[4]!r}, asked for by name, runs on a "
                f"node arena of its own, which cannot be had: {why}")
        choice = selection.select(call.collective, self.size, call.nbytes, call.op, algorithm, self._native_ok(call),
                                  self._node_why(call)[0], why, self._coll.name, True,
                                  getattr(self._coll, "library", None))
        name = choice.algorithm.name
        plan = self._plan(call, name if choice.segment is None else f"{name}:{choice.segment}", timeout, True)
        # (stacklevel: the caller of *_init, through _persistent, _run and its _announced wrapper, and the form's
        # own helper such as _reduction)
        warnings.warn(f"communicator {self._label} on rank {self.rank}: {why} This persistent {call.collective} "
                      f"request runs the two-sided algorithm {name!r} instead of the node algorithm the table "
                      "chose.", RuntimeWarning, stacklevel=7)
        return plan, None

    def _gave_up(self, collective: str, seq: int, exc: CommTimeout, native: bool = False) -> CommTimeout:
        """A blocking collective timed out (its flight record says so): the error to raise.

        Keeps what the library still has in flight alive (a timed plan's error
        carries it as ``.pending``), breaks this communicator, and adds this
        rank's recent calls to the message.
        """
        pending = getattr(exc, "pending", None)
        if pending is not None:
            _ABANDONED.append(pending)
        self._break(f"{collective} #{seq}{' (native)' if native else ''} timed out on rank {self.rank}.")
        return CommTimeout(f"{exc} Recent calls on this rank: {_watchdog.recent_summary(self._recorder)}.")

    def _collective_timed_out(self, pending, reason: str) -> None:
        abandon = getattr(pending, "abandon", None)
        if abandon is not None:
            abandon()
        _ABANDONED.append(pending)
        self._break(reason.split(". ")[0] + ".")

    def _steps(self, alg, call: Call, segment=None, rank=None):
        return collectives.steps(alg.schedule, call.collective, self.rank if rank is None else rank, self.size,
                                 call.arg, call.op, call.root, segment, **self._node_args(alg))

    def _node_args(self, alg) -> dict:
        """``{"nodes": every rank's node}`` for a node-aware algorithm (exchanged once, at its first call), else {}."""
        if not alg.node_aware:
            return {}
        if self._nodes is None:
            tag = self._ctl_tag("nodes", self._next_seq())
            self._nodes = tuple(self._ctl_allgather(node_name(self._coll), tag, self.timeout))
        return {"nodes": self._nodes}

    def _native_args(self, call: Call):
        """What the library's collective takes: ``(send, recv, inplace, counts, prologue)``.

        ``prologue`` is a local op to run before the library call (a broadcast root's
        copy of its input into the output), or None.
        """
        c = call.collective
        send, recv = call.src, call.dst
        inplace = call.aliased and c in ("allreduce", "scan", "exscan", "reduce")
        prologue = None
        if c == "broadcast":
            if self.rank == call.root and not same_memory(call.src, call.dst):
                def prologue(tag, dst=call.dst, src=call.src):
                    dst[...] = src
                inline(prologue, "{0}[...] = {1}", (call.dst, call.src))
            send = None
        if c in ("reduce", "gather") and self.rank != call.root:
            recv = None
        if c == "scatter" and self.rank != call.root:
            send = None
        counts = call.arg if c in ("reduce_scatter", "allgatherv", "gatherv", "scatterv", "alltoallv") else None
        return send, recv, inplace, counts, prologue

    def _run_native(self, call: Call, nonblocking, timeout, info, rec):
        c = call.collective
        send, recv, inplace, counts, prologue = self._native_args(call)
        if prologue is not None:
            prologue(None)
        t0 = time.perf_counter()

        def finish():
            if info.tracer is not None:  # a library collective has no steps: record it whole
                info.tracer.record_native(info, t0, time.perf_counter(), call.nbytes)
            return self._finish(call)

        # With a timeout, even a blocking call goes through the library's nonblocking
        # form so that waiting can give up (a blocking MPI call cannot be interrupted).
        # MPI never matches a blocking collective with a nonblocking one, so the form
        # must not depend on what else this rank has going on: a blocking call with
        # requests outstanding first drives them to completion (they may need this
        # rank's next step), then takes the same form as a rank with none.
        recorder = self._recorder
        progress = self._progress
        if progress.requests and not nonblocking:
            recorder.active = rec
            try:
                done = progress.wait(lambda: not progress.requests, timeout)
            finally:
                recorder.active = None
            if not done:
                recorder.finish(rec, "timed out")
                self._break(f"{c} #{info.seq} (native) timed out on rank {self.rank}.")
                raise CommTimeout(
                    f"rank {self.rank} timed out after {timeout:g} s in {c} #{info.seq} (algorithm 'native') "
                    f"finishing this rank's {len(progress.requests)} outstanding nonblocking call(s) first (a "
                    "blocking library collective never matches a nonblocking one, so they must be complete "
                    f"before it starts). Recent calls on this rank: {_watchdog.recent_summary(recorder)}.")
        recorder.active = rec
        try:
            pending = self._coll.native(c, send, recv, op=call.op, root=call.root, counts=counts, inplace=inplace,
                                        nonblocking=nonblocking or timeout is not None)
        except BaseException:
            recorder.finish(rec, "failed")
            raise
        finally:
            recorder.active = None
        if pending is None:
            recorder.finish(rec)
            return finish()
        request = _NativeRequest(pending, finish, timeout, info, self, rec)
        return request if nonblocking else request.wait()

    def _finish(self, call: Call):
        if not call.has_result:
            return None
        if call.collective == "exscan" and self.rank == 0:
            identity = call.op.identity_array(call.dst.shape, call.dtype)
            if identity is None:
                return None
            call.dst[...] = call.xp.asarray(identity)
        if call.result is not None:
            return call.result
        return call.dst.reshape(call.shape)

    # -- preparing calls --------------------------------------------------------------

    def _output(self, out, shape, like, name="out"):
        if out is None:
            return (np if type(like) is np.ndarray else array_module(like)).empty(shape, dtype=like.dtype)
        return check_out(out, shape, like.dtype, name, like=like)

    @_announced(None)
    def _reduction(self, collective, x, op, out, algorithm, timeout, nonblocking, root=0, rooted=False, key=None):
        self._check_open()
        given, given_out, given_op = x, out, op
        x = input_for(x, nonblocking, collective)
        if rooted:
            root = check_rank(root, self.size, "root")
        op = get_op(op)
        if x.dtype.kind not in op.kinds:
            op.check_dtype(x.dtype)  # raises, naming the op and the dtype
        has_result = not rooted or self.rank == root
        if has_result:
            # A freshly allocated output cannot alias the input: skip the overlap test.
            if out is None and type(x) is np.ndarray:
                out, aliased = np.empty(x.shape, x.dtype), False
            else:
                aliased = out is not None
                out = self._output(out, x.shape, x)
                aliased = aliased and check_alias(x, out, collective)
        else:
            if out is not None:
                check_out(out, x.shape, x.dtype, "out", like=x)
            out = self._scratch_buffer(array_module(x), x.dtype, x.size, nonblocking, role="reduce-out")
            aliased = False
        # Flat views of both (a 1-D array is its own: reshape costs more than the rest of this line).
        call = Call(collective, x.size, x if x.ndim == 1 else x.reshape(-1), out if out.ndim == 1 else out.reshape(-1),
                    op, root, x.nbytes, x.dtype, np if type(x) is np.ndarray else array_module(x), aliased, x.shape,
                    has_result)
        call.result = out
        if key is not None and x is given and (out is given_out or given_out is None or not has_result):
            call.key, call.keep = key, (given, given_out)
        if collective in _FRESH and x is given and nonblocking != "init" and not self._bare_exscan(call):
            call.fresh = _fresh_key(collective, (given_op, root) if rooted else given_op, algorithm, x,
                                    _out_form(given, given_out), self._timeout if timeout is None else timeout)
        return self._run(call, algorithm, timeout, nonblocking)

    def allreduce(self, x, op="sum", *, out=None, algorithm=None, timeout=None):
        """Reduce ``x`` across all ranks with ``op``; every rank gets the result.

        Args:
            x: array of any shape and numeric dtype (same on every rank).
            op: "sum", "prod", "max", "min", "land", "lor", "lxor", "band", "bor",
                "bxor", or a :class:`commkit.Op`.
            out: optional result buffer (``out=x`` reduces in place).
            algorithm: force an algorithm ("ring", "recursive_doubling", ...); default: selected.
            timeout: seconds without progress before CommTimeout (default: the communicator's).

        Returns:
            The reduced array (``out`` if given).

        Raises:
            InvalidBuffer, UnsupportedOp, AlgorithmNotApplicable: before anything is sent.
        """
        plan = self._hot_allreduce  # the plan of the last call, if it had these very arguments (see _remember)
        if plan is not None and timeout is None:
            h = plan.hot
            if (h[0] is x and h[1] is out and h[2] is op and h[3] is algorithm
                    and self._plain and plan.dtype is x.dtype and not _trace_active and x.shape == plan.shape_x
                    and (out is None or out.flags.writeable and out.shape == plan.shape_out)):
                return plan.run()
        fn = self._new_allreduce  # the last shape's entry on new arrays (see _fresh)
        if fn is not None:
            result = fn(x, out, algorithm, timeout, op, None)
            if result is not GENERAL:
                return result
        key = ('allreduce', id(x), id(out), op, algorithm)
        plan = _known(self._fast, key) if timeout is None else None
        if plan is not None and plan.ready(x):
            self._hot_allreduce = plan  # a loop repeating this call takes the identity check next time
            return plan.run()
        result = self._fresh("allreduce", x, out, op, algorithm, timeout)
        if result is not GENERAL:
            return result
        return self._reduction("allreduce", x, op, out, algorithm, timeout, False, key=key)

    def iallreduce(self, x, op="sum", *, out=None, algorithm=None, timeout=None) -> Request:
        """Nonblocking :meth:`allreduce`; ``wait()`` returns the result."""
        fn = self._new_iallreduce  # the last shape's i-form entry on new arrays (see _fresh)
        if fn is not None:
            request = fn(x, out, algorithm, timeout, op, None)
            if request is not GENERAL:
                return request
        request = self._fresh("allreduce", x, out, op, algorithm, timeout, nonblocking=True)
        if request is not GENERAL:
            return request
        return self._reduction("allreduce", x, op, out, algorithm, timeout, True)

    def allreduce_init(self, x, op="sum", *, out=None, algorithm=None, timeout=None) -> PersistentRequest:
        """Persistent :meth:`allreduce` (MPI-4 ``MPI_Allreduce_init``).

        Compiles the call once for these arrays; then ``req.start()`` runs it
        (without blocking) and ``req.wait()`` completes it and returns the result,
        as many times as needed. Fill ``x`` before each ``start()``; read the
        result after ``wait()``. Every rank creates and starts its persistent
        collectives in the same order. ``req.free()`` releases it.

        Example::

            req = comm.allreduce_init(grad, out=total)
            for step in range(steps):
                grad[...] = compute()
                req.start(); req.wait()
        """
        return self._reduction("allreduce", x, op, out, algorithm, timeout, "init")

    def reduce(self, x, op="sum", root: int = 0, *, out=None, algorithm=None, timeout=None):
        """Reduce ``x`` across ranks onto ``root``; returns the result there, None elsewhere."""
        plan = self._hot_reduce  # the plan of the last call, if it had these very arguments (see _remember)
        if plan is not None and timeout is None:
            h = plan.hot
            if (h[0] is x and h[1] is out and h[2] is op and h[3] is root and h[4] is algorithm
                    and self._plain and plan.dtype is x.dtype and not _trace_active and x.shape == plan.shape_x
                    and (out is None or out.flags.writeable and out.shape == plan.shape_out)):
                return plan.run()
        fn = self._new_reduce  # the last shape's entry on new arrays (see _fresh)
        if fn is not None and type(root) is int:
            result = fn(x, out, algorithm, timeout, op, root)
            if result is not GENERAL:
                return result
        key = ('reduce', id(x), id(out), op, root, algorithm)
        if type(root) is int:  # (keys compare by value, and 0.0 == False == 0: another root takes the general path)
            plan = _known(self._fast, key) if timeout is None else None
            if plan is not None and plan.ready(x):
                self._hot_reduce = plan  # a loop repeating this call takes the identity check next time
                return plan.run()
            result = self._fresh("reduce", x, out, op, algorithm, timeout, root=root)
            if result is not GENERAL:
                return result
        return self._reduction("reduce", x, op, out, algorithm, timeout, False, root, rooted=True, key=key)

    def ireduce(self, x, op="sum", root: int = 0, *, out=None, algorithm=None, timeout=None) -> Request:
        """Nonblocking :meth:`reduce`."""
        if type(root) is int:
            fn = self._new_ireduce  # the last shape's i-form entry on new arrays (see _fresh)
            if fn is not None:
                request = fn(x, out, algorithm, timeout, op, root)
                if request is not GENERAL:
                    return request
            request = self._fresh("reduce", x, out, op, algorithm, timeout, nonblocking=True, root=root)
            if request is not GENERAL:
                return request
        return self._reduction("reduce", x, op, out, algorithm, timeout, True, root, rooted=True)

    def reduce_init(self, x, op="sum", root: int = 0, *, out=None, algorithm=None, timeout=None) -> PersistentRequest:
        """Persistent :meth:`reduce` (see :meth:`allreduce_init`)."""
        return self._reduction("reduce", x, op, out, algorithm, timeout, "init", root, rooted=True)

    def scan(self, x, op="sum", *, out=None, algorithm=None, timeout=None):
        """Inclusive prefix reduction: rank r gets x_0 (op) ... (op) x_r."""
        plan = self._hot_scan  # the plan of the last call, if it had these very arguments (see _remember)
        if plan is not None and timeout is None:
            h = plan.hot
            if (h[0] is x and h[1] is out and h[2] is op and h[3] is algorithm
                    and self._plain and plan.dtype is x.dtype and not _trace_active and x.shape == plan.shape_x
                    and (out is None or out.flags.writeable and out.shape == plan.shape_out)):
                return plan.run()
        fn = self._new_scan  # the last shape's entry on new arrays (see _fresh)
        if fn is not None:
            result = fn(x, out, algorithm, timeout, op, None)
            if result is not GENERAL:
                return result
        key = ('scan', id(x), id(out), op, algorithm)
        plan = _known(self._fast, key) if timeout is None else None
        if plan is not None and plan.ready(x):
            self._hot_scan = plan  # a loop repeating this call takes the identity check next time
            return plan.run()
        result = self._fresh("scan", x, out, op, algorithm, timeout)
        if result is not GENERAL:
            return result
        return self._reduction("scan", x, op, out, algorithm, timeout, False, key=key)

    def iscan(self, x, op="sum", *, out=None, algorithm=None, timeout=None) -> Request:
        """Nonblocking :meth:`scan`."""
        fn = self._new_iscan  # the last shape's i-form entry on new arrays (see _fresh)
        if fn is not None:
            request = fn(x, out, algorithm, timeout, op, None)
            if request is not GENERAL:
                return request
        request = self._fresh("scan", x, out, op, algorithm, timeout, nonblocking=True)
        if request is not GENERAL:
            return request
        return self._reduction("scan", x, op, out, algorithm, timeout, True)

    def scan_init(self, x, op="sum", *, out=None, algorithm=None, timeout=None) -> PersistentRequest:
        """Persistent :meth:`scan` (see :meth:`allreduce_init`)."""
        return self._reduction("scan", x, op, out, algorithm, timeout, "init")

    def exscan(self, x, op="sum", *, out=None, algorithm=None, timeout=None):
        """Exclusive prefix reduction: rank r gets x_0 (op) ... (op) x_{r-1}.

        Rank 0 gets the op's identity (zeros for sum); for a user op without an
        identity, rank 0 gets None.
        """
        plan = self._hot_exscan  # the plan of the last call, if it had these very arguments (see _remember)
        if plan is not None and timeout is None:
            h = plan.hot
            if (h[0] is x and h[1] is out and h[2] is op and h[3] is algorithm
                    and self._plain and plan.dtype is x.dtype and not _trace_active and x.shape == plan.shape_x
                    and (out is None or out.flags.writeable and out.shape == plan.shape_out)):
                return plan.run()
        fn = self._new_exscan  # the last shape's entry on new arrays (see _fresh)
        if fn is not None:
            result = fn(x, out, algorithm, timeout, op, None)
            if result is not GENERAL:
                return result
        key = ('exscan', id(x), id(out), op, algorithm)
        plan = _known(self._fast, key) if timeout is None else None
        if plan is not None and plan.ready(x):
            self._hot_exscan = plan  # a loop repeating this call takes the identity check next time
            return plan.run()
        result = self._fresh("exscan", x, out, op, algorithm, timeout)
        if result is not GENERAL:
            return result
        return self._reduction("exscan", x, op, out, algorithm, timeout, False, key=key)

    def iexscan(self, x, op="sum", *, out=None, algorithm=None, timeout=None) -> Request:
        """Nonblocking :meth:`exscan`."""
        fn = self._new_iexscan  # the last shape's i-form entry on new arrays (see _fresh)
        if fn is not None:
            request = fn(x, out, algorithm, timeout, op, None)
            if request is not GENERAL:
                return request
        request = self._fresh("exscan", x, out, op, algorithm, timeout, nonblocking=True)
        if request is not GENERAL:
            return request
        return self._reduction("exscan", x, op, out, algorithm, timeout, True)

    def exscan_init(self, x, op="sum", *, out=None, algorithm=None, timeout=None) -> PersistentRequest:
        """Persistent :meth:`exscan` (see :meth:`allreduce_init`)."""
        return self._reduction("exscan", x, op, out, algorithm, timeout, "init")

    def broadcast(self, x, root: int = 0, *, out=None, algorithm=None, timeout=None):
        """Every rank gets ``root``'s ``x``.

        Non-root ranks pass an array of the root's shape and dtype (its values are
        ignored) or ``x=None`` with ``out=`` the buffer to fill. ``out=x``
        broadcasts in place.
        """
        if x is None and type(out) is np.ndarray and root != self.rank:
            x = out  # a rank that only receives makes the in-place call (as the general path would): its fast paths
        plan = self._hot_broadcast  # the plan of the last call, if it had these very arguments (see _remember)
        if plan is not None and timeout is None:
            h = plan.hot
            if (h[0] is x and h[1] is out and h[2] is root and h[3] is algorithm
                    and self._plain and not _trace_active
                    and (x is None or plan.dtype is x.dtype and x.shape == plan.shape_x)
                    and (out is None or out.flags.writeable and out.shape == plan.shape_out)):
                return plan.run()
        fn = self._new_broadcast  # the last shape's entry on new arrays (see _fresh)
        if fn is not None:
            result = fn(x, out, algorithm, timeout, root, None)
            if result is not GENERAL:
                return result
        key = ('broadcast', id(x), id(out), root, algorithm)
        if type(root) is int:  # (keys compare by value, and 0.0 == False == 0: another root takes the general path)
            plan = _known(self._fast, key) if timeout is None else None
            if plan is not None and plan.ready(x):
                self._hot_broadcast = plan  # a loop repeating this call takes the identity check next time
                return plan.run()
            result = self._fresh("broadcast", x, out, root, algorithm, timeout)
            if result is not GENERAL:
                return result
        return self._broadcast(x, root, out, algorithm, timeout, False, key=key)

    def ibroadcast(self, x, root: int = 0, *, out=None, algorithm=None, timeout=None) -> Request:
        """Nonblocking :meth:`broadcast`."""
        if x is None and type(out) is np.ndarray and root != self.rank:
            x = out  # (as in broadcast)
        if type(root) is int:  # (another root, a NumPy integer or a wrong one, takes the general path)
            fn = self._new_ibroadcast  # the last shape's i-form entry on new arrays (see _fresh)
            if fn is not None:
                request = fn(x, out, algorithm, timeout, root, None)
                if request is not GENERAL:
                    return request
            request = self._fresh("broadcast", x, out, root, algorithm, timeout, nonblocking=True)
            if request is not GENERAL:
                return request
        return self._broadcast(x, root, out, algorithm, timeout, True)

    def broadcast_init(self, x, root: int = 0, *, out=None, algorithm=None, timeout=None) -> PersistentRequest:
        """Persistent :meth:`broadcast` (see :meth:`allreduce_init`)."""
        return self._broadcast(x, root, out, algorithm, timeout, "init")

    @_announced("broadcast")
    def _broadcast(self, x, root, out, algorithm, timeout, nonblocking, key=None):
        self._check_open()
        given, given_out, root_given = x, out, root
        root = check_rank(root, self.size, "root")
        if x is None and self.rank != root:
            if out is None:
                raise InvalidBuffer(
                    f"broadcast on non-root rank {self.rank} needs to know the shape and dtype: pass an array "
                    "like the root's, or x=None with out= the buffer to fill."
                )
            x = check_out(out, None, None, "out")
        x = input_for(x, nonblocking, "broadcast")
        out = self._output(out, x.shape, x)
        call = Call("broadcast", x.size, x if x.ndim == 1 else x.reshape(-1), out if out.ndim == 1 else out.reshape(-1),
                    None, root, x.nbytes, x.dtype, array_module(x), check_alias(x, out, "broadcast"), x.shape)
        call.result = out
        if key is not None and (x is given or x is given_out) and (out is given_out or given_out is None):
            call.key, call.keep = key, (given, given_out)
        if x is given and nonblocking != "init":
            call.fresh = _fresh_key("broadcast", root_given, algorithm, x, _out_form(given, given_out),
                                    self._timeout if timeout is None else timeout)
        return self._run(call, algorithm, timeout, nonblocking)

    def gather(self, x, root: int = 0, *, out=None, algorithm=None, timeout=None):
        """``root`` gets every rank's ``x`` stacked in rank order: shape ``(size, *x.shape)``; None elsewhere."""
        plan = self._hot_gather  # the plan of the last call, if it had these very arguments (see _remember)
        if plan is not None and timeout is None:
            h = plan.hot
            if (h[0] is x and h[1] is out and h[2] is root and h[3] is algorithm
                    and self._plain and plan.dtype is x.dtype and not _trace_active and x.shape == plan.shape_x
                    and (out is None or out.flags.writeable and out.shape == plan.shape_out)):
                return plan.run()
        fn = self._new_gather  # the last shape's entry on new arrays (see _fresh)
        if fn is not None and type(root) is int:
            result = fn(x, out, algorithm, timeout, None, root)
            if result is not GENERAL:
                return result
        key = ('gather', id(x), id(out), root, algorithm)
        if type(root) is int:  # (keys compare by value, and 0.0 == False == 0: another root takes the general path)
            plan = _known(self._fast, key) if timeout is None else None
            if plan is not None and plan.ready(x):
                self._hot_gather = plan  # a loop repeating this call takes the identity check next time
                return plan.run()
            result = self._fresh("gather", x, out, None, algorithm, timeout, stacked=True, root=root)
            if result is not GENERAL:
                return result
        return self._gather(x, root, out, algorithm, timeout, False, key=key)

    def igather(self, x, root: int = 0, *, out=None, algorithm=None, timeout=None) -> Request:
        """Nonblocking :meth:`gather`."""
        if type(root) is int:
            fn = self._new_igather  # the last shape's i-form entry on new arrays (see _fresh)
            if fn is not None:
                request = fn(x, out, algorithm, timeout, None, root)
                if request is not GENERAL:
                    return request
            request = self._fresh("gather", x, out, None, algorithm, timeout, stacked=True, nonblocking=True,
                                  root=root)
            if request is not GENERAL:
                return request
        return self._gather(x, root, out, algorithm, timeout, True)

    def gather_init(self, x, root: int = 0, *, out=None, algorithm=None, timeout=None) -> PersistentRequest:
        """Persistent :meth:`gather` (see :meth:`allreduce_init`)."""
        return self._gather(x, root, out, algorithm, timeout, "init")

    @_announced("gather")
    def _gather(self, x, root, out, algorithm, timeout, nonblocking, key=None):
        self._check_open()
        given, given_out = x, out
        x = input_for(x, nonblocking, "gather")
        root = check_rank(root, self.size, "root")
        shape = (self.size,) + x.shape
        xp = array_module(x)
        if self.rank == root:
            out = self._output(out, shape, x)
            check_alias(x, out, "gather")
        else:
            out = xp.empty(0, dtype=x.dtype)
        call = Call("gather", x.size, x.reshape(-1), out.reshape(-1), None, root, x.nbytes * self.size, x.dtype,
                     xp, False, shape, self.rank == root)
        call.result = out
        if key is not None and x is given and (out is given_out or given_out is None or self.rank != root):
            call.key, call.keep = key, (given, given_out)
        if x is given and nonblocking != "init":  # (never in place: the checks above refuse out=x)
            call.fresh = _fresh_key("gather", (None, root), algorithm, x, _out_form(given, given_out),
                                    self._timeout if timeout is None else timeout)
        return self._run(call, algorithm, timeout, nonblocking)

    def scatter(self, x, root: int = 0, *, out=None, algorithm=None, timeout=None):
        """Rank r gets ``x[r]`` of the root's ``x`` (shape ``(size, ...)``).

        Non-root ranks pass ``x=None`` (it is ignored there) and ``out=`` a buffer
        of the block's shape and dtype.
        """
        plan = self._hot_scatter  # the plan of the last call, if it had these very arguments (see _remember)
        if plan is not None and timeout is None:
            h = plan.hot
            if (h[0] is x and h[1] is out and h[2] is root and h[3] is algorithm
                    and plan.ready(x)):
                return plan.run()
        fn = self._new_scatter  # the last shape's entry on new arrays (see _fresh_scatter)
        if fn is not None and type(root) is int:
            # (the other ranks' entries check and fill their out: plan.Entry.receiving)
            result = (fn(x, out, algorithm, timeout, None, root) if root == self.rank else
                      fn(out, None, algorithm, timeout, None, root) if x is None else GENERAL)
            if result is not GENERAL:
                return result
        key = ('scatter', id(x), id(out), root, algorithm)
        if type(root) is int:  # (keys compare by value, and 0.0 == False == 0: another root takes the general path)
            plan = _known(self._fast, key) if timeout is None else None
            if plan is not None and plan.ready(x):
                self._hot_scatter = plan  # a loop repeating this call takes the identity check next time
                return plan.run()
            result = self._fresh_scatter(x, out, root, algorithm, timeout, False)
            if result is not GENERAL:
                return result
        return self._scatter(x, root, out, algorithm, timeout, False, key=key)

    def iscatter(self, x, root: int = 0, *, out=None, algorithm=None, timeout=None) -> Request:
        """Nonblocking :meth:`scatter`."""
        if type(root) is int:
            fn = self._new_iscatter  # the last shape's i-form entry on new arrays (see _fresh_scatter)
            if fn is not None:
                request = (fn(x, out, algorithm, timeout, None, root) if root == self.rank else
                           fn(out, None, algorithm, timeout, None, root) if x is None else GENERAL)
                if request is not GENERAL:
                    return request
            request = self._fresh_scatter(x, out, root, algorithm, timeout, True)
            if request is not GENERAL:
                return request
        return self._scatter(x, root, out, algorithm, timeout, True)

    def _fresh_scatter(self, x, out, root, algorithm, timeout, nonblocking):
        """A scatter on new arrays through :meth:`_fresh`: the root's kinds are its ``x``'s, the others' their
        ``out``'s, handed over as ``x`` (their ``x`` must be None: the general path would ignore anything else)."""
        if root == self.rank:
            return self._fresh("scatter", x, out, None, algorithm, timeout, nonblocking=nonblocking, root=root,
                               scattered=True)
        if x is not None:
            return GENERAL
        return self._fresh("scatter", out, None, None, algorithm, timeout, nonblocking=nonblocking, root=root,
                           scattered=True)

    def scatter_init(self, x, root: int = 0, *, out=None, algorithm=None, timeout=None) -> PersistentRequest:
        """Persistent :meth:`scatter` (see :meth:`allreduce_init`)."""
        return self._scatter(x, root, out, algorithm, timeout, "init")

    @_announced("scatter")
    def _scatter(self, x, root, out, algorithm, timeout, nonblocking, key=None):
        self._check_open()
        given, given_out = x, out
        root = check_rank(root, self.size, "root")
        if self.rank == root:
            x = input_for(x, nonblocking, "scatter")
            if x.ndim == 0 or x.shape[0] != self.size:
                raise InvalidBuffer(
                    f"scatter's x on the root must have shape ({self.size}, ...): one block per rank; "
                    f"got shape {tuple(x.shape)}."
                )
            block_shape, like = tuple(x.shape[1:]), x
        else:
            if out is None:
                raise InvalidBuffer(
                    f"scatter on non-root rank {self.rank} needs out= (a buffer of the block's shape and dtype); "
                    "only the root's x is read."
                )
            block_shape, like = tuple(out.shape), out
        out = self._output(out, block_shape, like)
        if self.rank == root:
            check_alias(x, out, "scatter")
        count = int(np.prod(block_shape, dtype=np.int64))
        xp = array_module(like)
        src = x.reshape(-1) if self.rank == root else xp.empty(0, dtype=like.dtype)
        call = Call("scatter", count, src, out.reshape(-1), None, root, count * like.dtype.itemsize * self.size,
                     like.dtype, xp, False, block_shape)
        call.result = out
        if key is not None and (x is given or self.rank != root) and (out is given_out or given_out is None):
            call.key, call.keep = key, (given, given_out)
        if nonblocking != "init":
            # The kinds a later call on new arrays is matched by (see _fresh_scatter): the root's x and its
            # out form; the other ranks' out alone, when they gave None for x (which only the root reads).
            timeout_of = self._timeout if timeout is None else timeout
            if self.rank == root:
                if x is given:
                    call.fresh = _fresh_key("scatter", (None, root), algorithm, x, _out_form(given, given_out),
                                            timeout_of)
            elif given is None and out is given_out:
                call.fresh = _fresh_key("scatter", (None, root), algorithm, out, 0, timeout_of)
        return self._run(call, algorithm, timeout, nonblocking)

    def allgather(self, x, *, out=None, algorithm=None, timeout=None):
        """Every rank gets every rank's ``x`` stacked in rank order: shape ``(size, *x.shape)``."""
        plan = self._hot_allgather  # the plan of the last call, if it had these very arguments (see _remember)
        if plan is not None and timeout is None:
            h = plan.hot
            if (h[0] is x and h[1] is out and h[2] is algorithm
                    and self._plain and plan.dtype is x.dtype and not _trace_active and x.shape == plan.shape_x
                    and (out is None or out.flags.writeable and out.shape == plan.shape_out)):
                return plan.run()
        fn = self._new_allgather  # the last shape's entry on new arrays (see _fresh)
        if fn is not None:
            result = fn(x, out, algorithm, timeout, None, None)
            if result is not GENERAL:
                return result
        key = ('allgather', id(x), id(out), algorithm)
        plan = _known(self._fast, key) if timeout is None else None
        if plan is not None and plan.ready(x):
            self._hot_allgather = plan  # a loop repeating this call takes the identity check next time
            return plan.run()
        result = self._fresh("allgather", x, out, None, algorithm, timeout, stacked=True)
        if result is not GENERAL:
            return result
        return self._allgather(x, out, algorithm, timeout, False, key=key)

    def iallgather(self, x, *, out=None, algorithm=None, timeout=None) -> Request:
        """Nonblocking :meth:`allgather`."""
        fn = self._new_iallgather  # the last shape's i-form entry on new arrays (see _fresh)
        if fn is not None:
            request = fn(x, out, algorithm, timeout, None, None)
            if request is not GENERAL:
                return request
        request = self._fresh("allgather", x, out, None, algorithm, timeout, stacked=True, nonblocking=True)
        if request is not GENERAL:
            return request
        return self._allgather(x, out, algorithm, timeout, True)

    def allgather_init(self, x, *, out=None, algorithm=None, timeout=None) -> PersistentRequest:
        """Persistent :meth:`allgather` (see :meth:`allreduce_init`)."""
        return self._allgather(x, out, algorithm, timeout, "init")

    @_announced("allgather")
    def _allgather(self, x, out, algorithm, timeout, nonblocking, key=None):
        self._check_open()
        given, given_out = x, out
        x = input_for(x, nonblocking, "allgather")
        shape = (self.size,) + x.shape
        out = self._output(out, shape, x)
        check_alias(x, out, "allgather")
        call = Call("allgather", x.size, x.reshape(-1), out.reshape(-1), None, 0, x.nbytes * self.size, x.dtype,
                     array_module(x), False, shape)
        call.result = out
        if key is not None and x is given and (out is given_out or given_out is None):
            call.key, call.keep = key, (given, given_out)
        if x is given and nonblocking != "init":  # (never in place: the checks above refuse out=x)
            call.fresh = _fresh_key("allgather", None, algorithm, x, _out_form(given, given_out),
                                    self._timeout if timeout is None else timeout)
        return self._run(call, algorithm, timeout, nonblocking)

    def alltoall(self, x, *, out=None, algorithm=None, timeout=None):
        """Rank r sends ``x[j]`` to rank j and receives rank j's ``x[r]`` into ``result[j]``.

        ``x`` must have shape ``(size, ...)``; the result has the same shape.
        """
        plan = self._hot_alltoall  # the plan of the last call, if it had these very arguments (see _remember)
        if plan is not None and timeout is None:
            h = plan.hot
            if (h[0] is x and h[1] is out and h[2] is algorithm
                    and self._plain and plan.dtype is x.dtype and not _trace_active and x.shape == plan.shape_x
                    and (out is None or out.flags.writeable and out.shape == plan.shape_out)):
                return plan.run()
        fn = self._new_alltoall  # the last shape's entry on new arrays (see _fresh)
        if fn is not None:
            result = fn(x, out, algorithm, timeout, None, None)
            if result is not GENERAL:
                return result
        key = ('alltoall', id(x), id(out), algorithm)
        plan = _known(self._fast, key) if timeout is None else None
        if plan is not None and plan.ready(x):
            self._hot_alltoall = plan  # a loop repeating this call takes the identity check next time
            return plan.run()
        result = self._fresh("alltoall", x, out, None, algorithm, timeout)
        if result is not GENERAL:
            return result
        return self._alltoall(x, out, algorithm, timeout, False, key=key)

    def ialltoall(self, x, *, out=None, algorithm=None, timeout=None) -> Request:
        """Nonblocking :meth:`alltoall`."""
        fn = self._new_ialltoall  # the last shape's i-form entry on new arrays (see _fresh)
        if fn is not None:
            request = fn(x, out, algorithm, timeout, None, None)
            if request is not GENERAL:
                return request
        request = self._fresh("alltoall", x, out, None, algorithm, timeout, nonblocking=True)
        if request is not GENERAL:
            return request
        return self._alltoall(x, out, algorithm, timeout, True)

    def alltoall_init(self, x, *, out=None, algorithm=None, timeout=None) -> PersistentRequest:
        """Persistent :meth:`alltoall` (see :meth:`allreduce_init`)."""
        return self._alltoall(x, out, algorithm, timeout, "init")

    @_announced("alltoall")
    def _alltoall(self, x, out, algorithm, timeout, nonblocking, key=None):
        self._check_open()
        given, given_out = x, out
        x = input_for(x, nonblocking, "alltoall")
        if x.ndim == 0 or x.shape[0] != self.size:
            raise InvalidBuffer(
                f"alltoall's x must have shape ({self.size}, ...): one block per destination rank; "
                f"got shape {tuple(x.shape)}."
            )
        out = self._output(out, x.shape, x)
        if same_memory(x, out):
            raise InvalidBuffer("alltoall cannot run in place: pass an out buffer that does not overlap x.")
        count = x.size // self.size
        call = Call("alltoall", count, x.reshape(-1), out.reshape(-1), None, 0, count * x.dtype.itemsize, x.dtype,
                     array_module(x), False, x.shape)
        call.result = out
        if key is not None and x is given and (out is given_out or given_out is None):
            call.key, call.keep = key, (given, given_out)
        if x is given and nonblocking != "init":  # (never in place: the checks above refuse out=x)
            call.fresh = _fresh_key("alltoall", None, algorithm, x, _out_form(given, given_out),
                                    self._timeout if timeout is None else timeout)
        return self._run(call, algorithm, timeout, nonblocking)

    def reduce_scatter(self, x, op="sum", *, counts=None, out=None, algorithm=None, timeout=None):
        """Reduce ``x`` across ranks, then give rank r its block of the result.

        With ``counts=None``, ``x.shape[0]`` must divide by ``size`` and rank r gets
        rows ``[r*m, (r+1)*m)``, ``m = x.shape[0] // size``. With ``counts`` (one row
        count per rank, summing to ``x.shape[0]``) rank r gets ``counts[r]`` rows.
        """
        plan = self._hot_reduce_scatter  # the plan of the last call, if it had these very arguments (see _remember)
        if plan is not None and timeout is None:
            h = plan.hot
            if (h[0] is x and h[1] is out and h[2] is op and h[3] is counts and h[4] is algorithm
                    and self._plain and plan.dtype is x.dtype and not _trace_active and x.shape == plan.shape_x
                    and (out is None or out.flags.writeable and out.shape == plan.shape_out)):
                return plan.run()
        if counts is not None and not hasattr(counts, "__len__"):
            counts = _listed(counts)  # an iterator is read once, here: the key and the checks see the same counts
        fn = self._new_reduce_scatter  # the last shape's entry on new arrays, without counts (see _fresh)
        if fn is not None and counts is None:
            result = fn(x, out, algorithm, timeout, op, None)
            if result is not GENERAL:
                return result
        key = ("reduce_scatter", id(x), id(out), op, None if counts is None else _listed(counts, tuple), algorithm)
        plan = _known(self._fast, key) if timeout is None else None
        if plan is not None and plan.ready(x):
            self._hot_reduce_scatter = plan  # a loop repeating this call takes the identity check next time
            return plan.run()
        if counts is None:
            result = self._fresh("reduce_scatter", x, out, op, algorithm, timeout, split=True)
            if result is not GENERAL:
                return result
        return self._reduce_scatter(x, op, counts, out, algorithm, timeout, False, key=key)

    def ireduce_scatter(self, x, op="sum", *, counts=None, out=None, algorithm=None, timeout=None) -> Request:
        """Nonblocking :meth:`reduce_scatter`."""
        if counts is None:
            fn = self._new_ireduce_scatter  # the last shape's i-form entry on new arrays (see _fresh)
            if fn is not None:
                request = fn(x, out, algorithm, timeout, op, None)
                if request is not GENERAL:
                    return request
            request = self._fresh("reduce_scatter", x, out, op, algorithm, timeout, nonblocking=True, split=True)
            if request is not GENERAL:
                return request
        return self._reduce_scatter(x, op, counts, out, algorithm, timeout, True)

    def reduce_scatter_init(self, x, op="sum", *, counts=None, out=None, algorithm=None,
                            timeout=None) -> PersistentRequest:
        """Persistent :meth:`reduce_scatter` (see :meth:`allreduce_init`)."""
        return self._reduce_scatter(x, op, counts, out, algorithm, timeout, "init")

    @_announced("reduce_scatter")
    def _reduce_scatter(self, x, op, counts, out, algorithm, timeout, nonblocking, key=None):
        self._check_open()
        given, given_out, given_op, even = x, out, op, counts is None
        x = input_for(x, nonblocking, "reduce_scatter")
        if x.ndim == 0:
            raise InvalidBuffer("reduce_scatter's x must have at least one dimension (rows are split among ranks).")
        rows = x.shape[0]
        if counts is None:
            if rows % self.size:
                raise InvalidBuffer(
                    f"reduce_scatter without counts needs x.shape[0] divisible by size {self.size}; got "
                    f"{rows}. Pass counts=[rows for each rank] for uneven blocks."
                )
            counts = [rows // self.size] * self.size
        else:
            counts = _listed(counts)
            if type(counts) is not list or len(counts) != self.size or any(
                isinstance(c, bool) or not isinstance(c, (int, np.integer)) or c < 0 for c in counts
            ):
                raise InvalidArgument(f"counts must be {self.size} non-negative ints (one per rank), got {counts!r}.")
            if sum(counts) != rows:
                raise InvalidArgument(f"counts must sum to x.shape[0] = {rows}, got sum {sum(counts)}.")
        op = get_op(op)
        op.check_dtype(x.dtype)
        row = x.size // rows if rows else int(np.prod(x.shape[1:], dtype=np.int64))
        shape = (counts[self.rank],) + x.shape[1:]
        out = self._output(out, shape, x)
        if same_memory(x, out):
            raise InvalidBuffer("reduce_scatter cannot run in place: pass an out buffer that does not overlap x.")
        elems = tuple(int(c) * row for c in counts)
        call = Call("reduce_scatter", elems, x.reshape(-1), out.reshape(-1), op, 0, x.nbytes, x.dtype,
                     array_module(x), False, shape)
        call.result = out
        if key is not None and x is given and (out is given_out or given_out is None):
            call.key, call.keep = key, (given, given_out)
        if even and x is given and nonblocking != "init":  # (never in place: the checks above refuse it)
            call.fresh = _fresh_key("reduce_scatter", given_op, algorithm, x, _out_form(given, given_out),
                                    self._timeout if timeout is None else timeout)
        return self._run(call, algorithm, timeout, nonblocking)

    def barrier(self, *, algorithm=None, timeout=None) -> None:
        """Block until every rank has called barrier."""
        plan = _known(self._fast, ("barrier", algorithm)) if timeout is None else None
        if plan is not None and plan.ready(None):
            plan.run()
            return
        self._barrier(algorithm, timeout, False)

    def ibarrier(self, *, algorithm=None, timeout=None) -> Request:
        """Nonblocking :meth:`barrier`."""
        return self._barrier(algorithm, timeout, True)

    def barrier_init(self, *, algorithm=None, timeout=None) -> PersistentRequest:
        """Persistent :meth:`barrier` (MPI-4 ``MPI_Barrier_init``): ``start()``/``wait()`` as often as needed."""
        return self._barrier(algorithm, timeout, "init")

    @_announced("barrier")
    def _barrier(self, algorithm, timeout, mode):
        self._check_open()
        call = Call("barrier", 0, None, None, None, 0, 0, None, np, False, None, False)
        call.key = ("barrier", algorithm)
        return self._run(call, algorithm, timeout, mode)


    # -- other conveniences --------------------------------------------------------------

    def mesh(self, axes=None, /, *, data=None, model=None, pipeline=None, ranks_per_node=None):
        """Split this communicator into data/model/pipeline groups (collective).

        ``comm.mesh(data=2, model=4)`` or ``comm.mesh({"pp": 2, "dp": -1, "tp": 2})``;
        see :func:`commkit.mesh.make_mesh` for the layout and the returned :class:`~commkit.mesh.Mesh`.
        """
        return make_mesh(self, axes, data=data, model=model, pipeline=pipeline, ranks_per_node=ranks_per_node)


class _NativeRestart:
    """A persistent native collective where the library has none: its nonblocking form, started anew."""

    def __init__(self, transport, collective, send, recv, op, root, counts, inplace):
        self._start = lambda: transport.native(collective, send, recv, op=op, root=root, counts=counts,
                                               inplace=inplace, nonblocking=True)
        self._pending = None

    def Start(self) -> None:  # noqa: N802 - the mpi4py Prequest interface PersistentRequest drives
        self._pending = self._start()

    def Test(self) -> bool:  # noqa: N802
        return self._pending is None or self._pending.test()

    def Wait(self) -> None:  # noqa: N802
        if self._pending is not None:
            self._pending.wait(None)

    def Free(self) -> None:  # noqa: N802
        self._pending = None


class _NativeRequest(Request):
    """A nonblocking native collective: one library request, then the result."""

    def __init__(self, pending, finish, timeout, info, comm, rec):
        self._pending = pending
        self._finish = finish
        self._timeout = timeout
        self._info = info
        self._comm = comm
        self._rec = rec
        self._done = False
        self._result = None
        comm._progress.add(self)

    def _complete(self) -> None:
        self._done = True
        self._comm._progress.discard(self)
        self._comm._recorder.finish(self._rec)
        self._result = self._finish()

    def _advance_once(self) -> bool:
        if not self._done and self._pending.test():
            self._complete()
            return True
        return False

    def test(self) -> bool:
        if not self._done and not self._advance_once():
            self._comm._progress.drive(skip=self)
        return self._done

    def wait(self, timeout: float | None = None):
        if not self._done:
            timeout = self._timeout if timeout is None else timeout
            comm = self._comm
            comm._recorder.active = self._rec
            try:
                if len(comm._progress.requests) > 1:
                    stuck = not comm._progress.wait(self._pending.test, timeout, skip=self)
                else:
                    stuck = bool(self._pending.wait(timeout))
            finally:
                comm._recorder.active = None
            if stuck:
                comm._recorder.finish(self._rec, "timed out")
                comm._progress.discard(self)
                _ABANDONED.append(self._pending)
                comm._break(f"{self._info.collective} #{self._info.seq} (native) timed out on rank {self._info.rank}.")
                raise native_timeout_error(self._info, timeout, _watchdog.recent_summary(comm._recorder))
            self._complete()
        return self._result

    @property
    def done(self) -> bool:
        return self._done


class _NativeDone(Request):
    """A nonblocking native collective that completed at its start (``Communicator._fresh_native``): its result."""

    __slots__ = ("_result",)
    _done = True

    def __init__(self, result):
        self._result = result

    def test(self) -> bool:
        return True

    def wait(self, timeout: float | None = None):
        return self._result


_FREED = "this communicator was freed; create a new one with dup() or split() before freeing."


# Every live communicator, so that a change in the algorithm registry reaches their caches.
_LIVE: "weakref.WeakSet[Communicator]" = weakref.WeakSet()


def _registry_changed(collective: str, name: str) -> None:
    for comm in list(_LIVE):
        comm.forget_plans()


algorithms.on_change(_registry_changed)


def _known(plans: dict, key):
    """The plan kept under ``key``, or None; None too for a key holding an unhashable argument
    (``op=[...]``), which the general path then names in its error."""
    try:
        return plans.get(key)
    except TypeError:
        return None


def _listed(values, kind=list):
    """``values`` (any iterable) as a ``kind``; a non-iterable is returned as it is, for the checks to name."""
    try:
        return kind(values)
    except TypeError:
        return values


def _weak_method(method):
    """``method`` of an object, called through a weak reference: holding it keeps the object alive no longer."""
    ref = weakref.WeakMethod(method)

    def call(*args):
        bound = ref()
        if bound is not None:
            return bound(*args)
    return call


def _free_channels(chans, persistent=None) -> None:
    if persistent is not None:
        chans = tuple(chans) + persistent.close()
    for chan in chans:
        try:
            chan.free()
        except Exception:  # noqa: BLE001 - at collection or exit, nothing can be done about it
            pass


class _PersistentChannels:
    """Where persistent requests' messages travel: channels of their own, numbered slots on each.

    Why. An ordinary call's tag holds its call number modulo 2**S, which is safe
    because ordinary calls are short-lived (see :mod:`commkit.identity`). A
    persistent request lives as long as the user keeps it, so a tag fixed at its
    creation would, 2**S calls later, be the tag of an ordinary call or of another
    persistent request of the same shape, and the two would exchange data. So
    persistent requests get channels of their own (duplicates of the collective
    channel, never used by ordinary calls), and each channel hands out each of its
    2**S numbers once: the next creation after the last number duplicates a fresh
    channel. Creation is collective and ordered, so every rank claims the same
    channel and number for the same request. A channel is freed when its last
    request is freed (or collected) and it hands out no more numbers.
    """

    __slots__ = ("source", "per_channel", "current", "used", "live", "claims")

    def __init__(self, source, per_channel: int):
        self.source = source
        self.per_channel = per_channel
        self.current = None  # the channel handing out numbers
        self.used = 0        # numbers it has handed out
        self.live: dict = {}  # channel -> its requests not yet freed
        self.claims = 0      # numbers handed out on every channel so far

    def claim(self):
        """``(channel, number, release)`` for a new persistent request; ``release()`` when it is freed."""
        if self.current is None or self.used == self.per_channel:
            retired = self.current
            self.current, self.used = _checked_dup(self.source), 0
            self.live[self.current] = 0
            if retired is not None and self.live[retired] == 0:
                self._drop(retired)
        chan, number = self.current, self.used
        self.used += 1
        self.claims += 1
        self.live[chan] += 1
        return chan, number, functools.partial(self._release, chan)

    def _release(self, chan) -> None:
        count = self.live.get(chan)
        if count is None:  # the communicator was freed first
            return
        self.live[chan] = count - 1
        if count == 1 and chan is not self.current:
            self._drop(chan)

    def _drop(self, chan) -> None:
        del self.live[chan]
        _free_channels((chan,))

    def close(self) -> tuple:
        """Forget every channel; returns them, for the caller to free."""
        chans = tuple(self.live)
        self.live.clear()
        self.current = None
        return chans


def _checked_dup(transport):
    try:
        return transport.dup()
    except Exception as exc:  # noqa: BLE001 - the library's own exception types vary
        if isinstance(exc, CommError):
            raise
        alive = _watchdog.alive()
        raise CommError(
            f"the {transport.name} library could not create another communicator ({type(exc).__name__}: {exc}). "
            f"{alive} commkit communicators are alive in this process, each holding two of the library's; "
            "free() the ones you no longer need (or let them be garbage-collected)."
        ) from exc


_ = algorithms  # the registry is loaded lazily by selection
