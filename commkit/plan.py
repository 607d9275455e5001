"""Plans: one call shape compiled against its buffers, run with little more than the transport calls.

Why. A schedule is data-oblivious, so for one call shape (collective,
algorithm, count, dtype, op, root) on fixed buffers everything but the data
is known in advance: which views of which buffers each step touches, which
transport call moves them, which ufunc reduces them. The first call of a
shape on a given pair of arrays compiles all of that into a :class:`Plan` --
a flat list of bound operations -- and every later call with the same arrays
runs the list. What is left per call is the call number (it goes into the
tag), a flight-recorder entry and the transport calls themselves.

Three users of plans:

* the communicator's blocking calls, which keep the plans of recent
  ``(collective, x, out, op, algorithm)`` combinations (keyed by the arrays'
  identity; the plan holds the arrays, so the identity stays theirs). A
  call without ``out`` gets a plan that allocates its result at each run;
* *shape plans*: the same code with the input and output taken at each run,
  so a call with new arrays of a known shape (a fresh ``out``, a new ``x``)
  runs a plan too, once its arguments are checked. They are compiled against
  stand-in arrays that hold no memory (:func:`stand_in`), and only when every
  op is written inline, so the generated code slices the run's own arrays
  (:class:`Slots`);
* persistent collectives (:meth:`commkit.Communicator.allreduce_init` ...),
  MPI-4 style: compiled once, then ``start()``/``wait()`` any number of
  times. Their transfers may be bound once too (MPI persistent requests), so
  a restart parses no buffer at all.

An operation is a callable ``op(tag)``. A transfer op moves its views (the
transport binds it: :meth:`bind_transfer`); a local op (reduce, copy) ignores
the tag.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Callable
from typing import NamedTuple
from time import monotonic as _monotonic

import numpy as np

from ._events import active as _trace_active
from ._checks import owners_apart
from .errors import CommTimeout, InvalidArgument, InvalidBuffer
from .transports.base import inline
from .requests import Request
from .watchdog import STATE, STEP, STEP_OBJ, T_END, FlightRecorder, recent_summary
from .schedule import (COPY, OVERLAP_MIN_BYTES, REDUCE, TRANSFER, CompletedRequest, NodeProgram, ScheduleRequest,
                       ScheduleRun, native_timeout_error, timeout_error, transfer_error, wire_bytes)

__all__ = ["SEEN", "Entry", "IEntry", "Plan", "PersistentPool", "PersistentRequest", "InterpretedPersistentRequest",
           "Slots", "compile_ops", "native_nonblocking_entry", "nonblocking_entry", "nonblocking_steps",
           "persistent_steps", "stand_in", "timed_native"]


def _view(bufs, ref, slots=None):
    name, lo, hi = ref
    view = bufs[name][lo:hi]
    if slots is not None and name in slots.names:
        slots[id(view)] = (view, name, lo, hi)
    return view


class Slots(dict):
    """The buffers a plan takes at each run instead of binding them, and every view sliced from them.

    A plan compiled with slots is a *shape plan*: it runs any arrays of its call
    shape. It is compiled against stand-ins of the right length
    (:func:`stand_in`), and every op must be written inline, so the generated
    function slices the run's own arrays where the stand-ins' views were bound
    (``id(view) -> (view, name, lo, hi)``). ``names`` are the buffers taken per
    run (``"in"``, ``"out"``); ``lengths`` their lengths.
    """

    def __init__(self, bufs: dict, names: tuple):
        super().__init__()
        self.names = names
        self.lengths = {name: len(bufs[name]) for name in names if bufs.get(name) is not None}
        # The arrays compiled against (stand-ins, or the call's own): no constant of the plan may share
        # memory with one of them.
        self.compiled_against = [bufs[name] for name in names if bufs.get(name) is not None]

    def whole(self, name: str, array) -> None:
        """``array`` (a call's whole buffer, as a library collective takes it) is buffer ``name`` of each run."""
        if array is not None and name in self.names:
            self[id(array)] = (array, name, 0, len(array))


def stand_in(n: int, dtype):
    """A read-only array of ``n`` elements over one element's memory: what a shape plan is compiled against.

    It holds no caller's data and costs no memory; a shape plan refuses to bind
    it (or any view of it) as a constant, so running the plan can only touch the
    arrays of the run.
    """
    return np.lib.stride_tricks.as_strided(np.empty(1, dtype), (n,), (0,), writeable=False)


def _shares(value, arrays) -> bool:
    """Whether ``value`` (an array, or a list, tuple or dict holding one at any depth) may share memory
    with one of ``arrays``."""
    if isinstance(value, np.ndarray):
        return any(np.may_share_memory(value, a) for a in arrays)
    if type(value) in (list, tuple):
        return any(_shares(item, arrays) for item in value)
    if type(value) is dict:
        return any(_shares(item, arrays) for item in value.values())
    return False


def _reduce_op(step, bufs, slots=None):
    into, operand, src = (_view(bufs, step.into, slots), _view(bufs, step.operand, slots),
                          _view(bufs, step.src, slots))
    fn = step.op.fn
    a, b = (operand, src) if step.operand_first else (src, operand)
    # A one-element fold into one of its operands: NumPy runs a ufunc whose out overlaps an input of one
    # element through its general iterator (1.2 us against 0.5 here), so the result is made apart and
    # copied in, which costs less (the same operands, so the same bits).
    aliased = into.size == 1 and (np.may_share_memory(into, a) or np.may_share_memory(into, b))
    if not step.op.out_of_place(into.dtype) and not aliased:
        def run(tag, fn=fn, a=a, b=b, out=into):
            fn(a, b, out=out)
        return inline(run, "{0}({1}, {2}, out={3})", (fn, a, b, into))

    def run(tag, fn=fn, a=a, b=b, out=into):
        out[...] = fn(a, b)
    return inline(run, "{3}[...] = {0}({1}, {2})", (fn, a, b, into))


def _copy_op(dst, src):
    def run(tag, dst=dst, src=src):
        dst[...] = src
    return inline(run, "{0}[...] = {1}", (dst, src))


def write_out(bufs: dict, value, slots: Slots | None = None) -> tuple:
    """An op, as :func:`compile_ops` lists them, writing ``value`` over the whole of ``bufs["out"]``.

    For a result no step of the schedule computes: rank 0's exscan result, the
    op's identity. Placed after the schedule's ops, it is one more inline line of
    a plan (``_b_out[...] = _c0`` in a shape plan), so that every compiled form
    of the call writes the result the interpreter's finish writes.
    """
    dst = _view(bufs, ("out", 0, len(bufs["out"])), slots)
    return (COPY, _copy_op(dst, value), None, (), 0)


def _generic_transfer(chan, sends, recvs):
    def run(tag):
        chan.transfer(sends, recvs, tag, None)
    return inline(run, "{0}({1}, {2}, tag, None)", (chan.transfer, sends, recvs))


def _timed_transfer(chan, sends, recvs):
    """A transfer that gives up after the run's ``_timeout`` seconds: only written inline (a timed shape plan)."""
    def run(tag):
        raise TypeError("a timed transfer runs only inside a generated plan, which passes its timeout")
    return inline(run, "if (_stuck := {0}({1}, {2}, tag, _timeout)): raise _timed_out(rec, seq, _stuck, _timeout)",
                  (chan.transfer, sends, recvs))


def timed_native(chan, collective, send, recv, op, root, counts, inplace):
    """A library collective that gives up after the run's ``_timeout`` seconds: only written inline.

    Its nonblocking form (``chan.native(..., nonblocking=True)``), waited for
    with the timeout; on a timeout the plan raises the error a nonblocking
    native call raises, carrying the request still in flight (``.pending``) for
    the communicator to keep alive.
    """
    def run(tag):
        raise TypeError("a timed library collective runs only inside a generated plan, which passes its timeout")
    return inline(run, "if (_pending := {0}({1}, {2}, {3}, op={4}, root={5}, counts={6}, inplace={7}, "
                  "nonblocking=True)).wait(_timeout): raise _native_timed_out(rec, seq, _pending, _timeout)",
                  (chan.native, collective, send, recv, op, root, counts, inplace))


def _overlapped_transfer(chan, sends, recvs, local):
    def run(tag):
        pending = chan.post(sends, recvs, tag)
        for op in local:
            op(tag)
        pending.wait(None)
    return run


def _local_ops(steps, bufs, slots=None, index=0) -> list:
    ops = []
    for step in steps:
        if step.kind == REDUCE:
            if step.into[2] > step.into[1]:
                ops.append((REDUCE, _reduce_op(step, bufs, slots), step, (), index))
        else:
            dst, src = _view(bufs, step.dst, slots), _view(bufs, step.src, slots)
            same = bufs[step.dst[0]] is bufs[step.src[0]] and step.dst[1] == step.src[1]
            if step.dst[2] > step.dst[1] and not same:
                ops.append((COPY, _copy_op(dst, src), step, (), index))
    return ops


def _node_op(program, bufs: dict, timed=False):
    """A node schedule's whole run as one op of a plan: its :class:`NodeProgram`, written inline.

    The program names its steps in the call's flight record itself, and its
    errors are the interpreter's; the generated plan gives it the call's
    number and record (so it runs only written inline, as a timed transfer does).
    A program views its arena's slots and reads the buffers it is given at each
    run, so a shape plan's program runs on the run's own arrays. ``timed``: it
    gives up after the run's ``_timeout``, and marks the call timed out in its
    record first (:func:`_timed_node_run`), as a timed transfer does.
    """
    def run(tag):
        raise TypeError("a node program runs only inside a generated plan, which passes its call number and record")
    if timed:
        return inline(run, "{0}({1}, {{'in': {2}, 'out': {3}, 'tmp': {4}}}, tag, _timeout, "
                      "(rec[1], rec[2], seq, _rank, None), rec)",
                      (_timed_node_run, program.run, bufs["in"], bufs["out"], bufs["tmp"]))
    return inline(run, "{0}({{'in': {1}, 'out': {2}, 'tmp': {3}}}, tag, None, (rec[1], rec[2], seq, _rank, None), rec)",
                  (program.run, bufs["in"], bufs["out"], bufs["tmp"]))


def _timed_node_run(run, bufs: dict, tag: int, timeout: float, info, rec) -> None:
    """A node program's ``run`` with a timeout: one that passes marks the call timed out in ``rec``, then raises."""
    try:
        run(bufs, tag, timeout, info, rec)
    except CommTimeout:
        FlightRecorder.finish(rec, "timed out")
        raise


def compile_ops(steps, bufs: dict, chan, persistent_tag=None, slots: Slots | None = None, timed=False,
                arena=None) -> list:
    """The steps of a schedule as a list of ``(kind, op, step, overlapped, index)``, views sliced and calls bound.

    ``kind`` is TRANSFER or a local kind; with ``persistent_tag`` the transfer
    ops are the transport's persistent transfers for that tag (``start()``,
    ``test()``, ``wait()``) and ``overlapped`` the local ops to run once one is
    started; else transfers are callables ``op(tag)`` that move the data (running
    their overlapped local ops while it is in flight) and return when done.
    Empty ranges and copies of a range onto itself are dropped. With ``slots``
    (a shape plan's), every view of a buffer it names is recorded there; with
    ``timed`` each transfer gives up after the run's timeout (shape plans only).
    A schedule of the node arena's one-sided steps compiles, once the node
    ``arena`` is made, into one op: its :class:`NodeProgram` (:func:`_node_op`),
    on fixed arrays or a shape plan's (the program reads whatever buffers a run
    gives it), timed or not. Else None, so the call keeps the
    general path (a persistent request of one is an
    :class:`InterpretedPersistentRequest`).
    """
    if any(step.kind not in (TRANSFER, REDUCE, COPY) for step in steps):
        if persistent_tag is not None:  # (the communicator gives those an InterpretedPersistentRequest)
            raise TypeError("one-sided steps run only in the interpreter; a persistent request of such a schedule "
                            "is an InterpretedPersistentRequest.")
        if arena is None:
            return None
        program = NodeProgram.make(steps, bufs, chan, arena)
        if program is None:
            return None
        if slots is not None:  # the program takes the run's whole buffers
            slots.whole("in", bufs["in"])
            slots.whole("out", bufs["out"])
        return [(TRANSFER, _node_op(program, bufs, timed), steps[0], (), 0)]
    ops = []
    for index, step in enumerate(steps):  # index: the step's place in the schedule, as messages name it
        if step.kind != TRANSFER:
            ops.extend(_local_ops((step,), bufs, slots, index))
            continue
        sends = [(peer, _view(bufs, ref, slots)) for peer, ref in step.sends]
        recvs = [(peer, _view(bufs, ref, slots)) for peer, ref in step.recvs]
        local = tuple(entry[1] for entry in _local_ops(step.overlap, bufs, slots, index))
        if persistent_tag is not None:
            make = getattr(chan, "persistent_transfer", None)
            op = make(sends, recvs, persistent_tag) if make is not None else None
            if op is None:  # no persistent requests on this transport (or for these buffers)
                op = _Reposted(chan, sends, recvs, persistent_tag)
            ops.append((TRANSFER, op, step, local, index))
            continue
        if local and wire_bytes(sends, recvs) >= OVERLAP_MIN_BYTES:
            ops.append((TRANSFER, _overlapped_transfer(chan, sends, recvs, local), step, (), index))
            continue
        bind = getattr(chan, "bind_transfer", None)
        if timed:
            bind_timed = getattr(chan, "bind_timed_transfer", None)
            op = bind_timed(sends, recvs) if bind_timed is not None else None
            if op is None:
                op = _timed_transfer(chan, sends, recvs)
        else:
            op = bind(sends, recvs) if bind is not None else _generic_transfer(chan, sends, recvs)
        ops.append((TRANSFER, op, step, (), index))
        # Too small to hide anything: the overlapped local steps run after the transfer.
        ops.extend(_local_ops(step.overlap, bufs, slots, index))
    return ops


def fuse(ops) -> list:
    """Blocking ops grouped as units of work: each transfer with the local ops after it.

    Returns ``(index, step, [op, ...])`` triples, ``step`` being the unit's
    transfer (None for local ops before the first one) and ``index`` its place in
    the schedule: a plan's flight record names the unit running, not every local
    op, by the number the interpreter gives it.
    """
    units = []
    for kind, op, step, _, index in ops:
        if kind == TRANSFER or not units:
            units.append((index if kind == TRANSFER else 0, step if kind == TRANSFER else None, [op]))
        else:
            units[-1][2].append(op)
    return units


_INLINE_UNITS = 256  # plans with more units run a loop instead of one straight-line function


def _one_line(step) -> str:
    """A step's repr fit for a comment in generated code."""
    text = " ".join(repr(step).split())
    return text if len(text) <= 100 else text[:97] + "..."


def _mentions(value, slots) -> bool:
    """Whether a list or tuple holds (at any depth) a view a shape plan slices per run."""
    for item in value:
        if id(item) in slots or (type(item) in (list, tuple) and _mentions(item, slots)):
            return True
    return False


class _Names:
    """The names a generated function gives its constants (``_c0`` ...) and the views of its run's buffers.

    ``const(value)`` returns the name to write for ``value``. With ``slots`` (a
    shape plan's), a view of a buffer taken per run is written as a slice of
    that run's buffer (``_b_in[0:4]``, one line in ``sliced`` per range), as is
    a list or tuple holding one; a constant that may share memory with a
    compiled-against buffer is added to ``unsafe`` (the plan is then not
    generated: it could touch memory that is not the run's). Names are kept by
    ``id()``, so every value named is held here until generation ends: a
    temporary freed meanwhile could hand its id, and its name, to another.
    """

    def __init__(self, ns: dict, slots=None):
        self.ns, self.slots = ns, slots
        self.consts: dict = {}
        self.sliced: list = []
        self.ranges: dict = {}
        self.unsafe: list = []
        self.named: list = []  # every value given a name (see above)

    def const(self, value) -> str:
        consts, slots, sliced = self.consts, self.slots, self.sliced
        name = consts.get(id(value))
        if name is not None:
            return name
        self.named.append(value)
        if slots:
            hit = slots.get(id(value))
            if hit is not None and hit[0] is value:
                _, buf, lo, hi = hit
                if lo == 0 and hi == slots.lengths[buf]:
                    name = f"_b_{buf}"
                else:  # one view per range, however many ops use it
                    name = self.ranges.get((buf, lo, hi))
                    if name is None:
                        name = self.ranges[buf, lo, hi] = f"_v{len(sliced)}"
                        sliced.append(f"{name} = _b_{buf}[{lo}:{hi}]")
                consts[id(value)] = name
                return name
            if type(value) in (list, tuple) and _mentions(value, slots):
                items = ", ".join(self.const(item) for item in value)
                name = f"_v{len(sliced)}"
                sliced.append(f"{name} = [{items}]" if type(value) is list else f"{name} = ({items},)")
                consts[id(value)] = name
                return name
            if _shares(value, slots.compiled_against):
                self.unsafe.append(value)
        name = consts[id(value)] = f"_c{len(consts)}"
        self.ns[name] = value
        return name


class Entry(NamedTuple):
    """The call kinds a shape plan's entry (:meth:`Plan.entry`) accepts; anything else takes the general path.

    ``a`` is matched by identity (the op, or broadcast's root, as the general
    path got it), ``b`` by value (reduce's root; None elsewhere). ``form``: 0
    without ``out``, 1 with an ``out`` of its own, 2 in place (``out is x``).
    ``result_shape`` is the result's (``out``'s) shape; ``scratch``, where this
    rank gets no result (reduce off the root), the array its run writes
    instead. ``log`` is the communicator's logger (a call it would log at
    DEBUG takes the general path, which logs it); ``general`` the value that
    says "take the general path"; ``weak`` makes weak references, and ``last``
    is the communicator's list of weak references to ``x`` and ``out`` of its
    collective's last call on new arrays (see ``Communicator._fresh``).

    A timed entry (``timeout`` the seconds its calls wait, for a timed shape
    plan) takes calls that give the same ``timeout`` object (``given``), or
    none while the communicator's default is still the object it was
    (``default``); ``native``: its plan runs the library's collective.

    ``receiving``: a scatter off its root, whose call the public method hands
    over with its ``out`` as ``x`` (the block it fills, in place, and the
    result) and no ``out``; the run reads ``scratch`` (empty) as its input.
    """

    dtype: object
    shape: tuple
    a: object
    b: object
    algorithm: object
    form: int
    result_shape: tuple
    scratch: object
    log: object
    general: object
    weak: Callable
    last: list
    timeout: float | None = None
    given: object = None
    default: object = None
    native: bool = False
    receiving: bool = False


def _entry_head(entry: Entry, ns: dict, nonblocking=False) -> tuple[list, list]:
    """The lines of an entry before its run's body, and those taking the guard (the first two) and after.

    The communicator installs an untimed blocking entry only while it is plain
    (no timeout, check mode or outstanding request; usable), a timed one while
    only the timeout keeps it from being plain, and drops each as soon as that
    ends, so a blocking entry does not check it; an i-form's (``nonblocking``,
    :func:`nonblocking_entry`) checks for itself that i-forms may run compiled,
    and its timeout as a timed entry does.
    """
    log = entry.log
    # The logger's own cache of its isEnabledFor answers, read as a dict (False: DEBUG is off); where
    # there is none, or it holds no answer yet, the call takes the general path, which asks.
    cache = getattr(log, "_cache", None)
    debug = "_log_cache.get(10) is not False" if type(cache) is dict else "_debug(10)"  # 10: logging.DEBUG
    ns.update(_ndarray=np.ndarray, _e_dtype=entry.dtype, _e_shape=entry.shape, _e_a=entry.a, _e_b=entry.b,
              _e_alg=entry.algorithm, _e_rshape=entry.result_shape, _trace_active=_trace_active,
              _log_cache=cache, _debug=log.isEnabledFor, _GENERAL=entry.general, _weak=entry.weak,
              _empty=np.empty, _may_share=np.may_share_memory, _e_scratch=entry.scratch, _e_last=entry.last,
              _owners_apart=owners_apart)
    form = entry.form
    kinds = ["type(_x) is not _ndarray", "_x.dtype is not _e_dtype", "_x.shape != _e_shape", "_a is not _e_a",
             "_alg is not _e_alg"]
    if entry.timeout is None and not nonblocking:
        kinds.append("_to is not None")
    else:  # the timeout given, or none while the communicator's default is the one this was made for
        ns.update(_e_given=entry.given, _e_default=entry.default)
        kinds.append("_to is not _e_given" + (" or _comm._timeout is not _e_default" if entry.given is None else ""))
    if entry.b is not None:
        kinds.append("_b != _e_b")
    if nonblocking:  # (an i-form's entry stays installed: it checks that i-forms may run compiled)
        kinds.append("not _comm._iforms_on")
    kinds += ["_trace_active", debug]
    kinds.append("_out is not None" if form == 0 else "_out is not _x" if form == 2 else "_out is None or _out is _x")
    written = form == 2 or entry.receiving
    kinds.append("not (_fl := _x.flags).c_contiguous" + (" or not _fl.writeable" if written else ""))
    head = ["    if (" + "\n            or ".join(kinds) + "):", "        return _GENERAL"]
    flat_in = "_x" if len(entry.shape) == 1 else "_x.reshape(-1)"
    if entry.receiving:  # x is the block this rank fills (a scatter off its root): nothing to read
        head += ["    _result = _x", f"    _b_out = {flat_in}"]
        flat_in = "_e_scratch"
    elif entry.scratch is not None:  # no result on this rank: the run writes scratch (an i-form's own)
        if form == 1:  # an out given here is left alone; one the root could not take goes to the general path
            head += ["    if not (type(_out) is _ndarray and _out.dtype is _e_dtype and _out.shape == _e_rshape",
                     "            and (_fo := _out.flags).c_contiguous and _fo.writeable):",
                     "        return _GENERAL"]
        head += ["    _result = None",
                 f"    _b_out = _empty({entry.scratch.size}, _e_dtype)" if nonblocking else "    _b_out = _e_scratch"]
    elif form == 0:
        head.append("    _result = _empty(_e_rshape, _e_dtype)")
        head.append("    _b_out = _result" if len(entry.result_shape) == 1 else "    _b_out = _result.reshape(-1)")
    elif form == 1:
        head += ["    if not (type(_out) is _ndarray and _out.dtype is _e_dtype and _out.shape == _e_rshape",
                 "            and (_fo := _out.flags).c_contiguous and _fo.writeable",
                 "            # two arrays that each own their memory (the usual fresh pair), or views of two such",
                 "            # arrays (an mpi4py face's byte views), cannot share it",
                 "            and ((_xo := _x.base) is None and _out.base is None",
                 "                 or _owners_apart(_x, _xo, _out, _out.base) or not _may_share(_x, _out))):",
                 "        return _GENERAL",
                 "    _result = _out",
                 "    _b_out = _out" if len(entry.result_shape) == 1 else "    _b_out = _out.reshape(-1)"]
    else:
        head += ["    _result = _out"]
    # A timed call has no plan of its own arrays (Communicator._fresh): it runs here on the same arrays too,
    # and records nothing.
    timed_blocking = entry.timeout is not None and not nonblocking
    if entry.timeout is None and not nonblocking:
        # The same arrays as the last call here: the general path, which gives a loop on them its own plan.
        # With an out of its own, the last out is known only where the x before was this x too (see the
        # guard): the same x after an unknown out takes the general path, and Communicator._fresh records
        # that out, so the same x with yet another out runs here from the next call on.
        if form == 1:
            head += ["    _w, _wo = _e_last",
                     "    _again = _w is not None and _w() is _x",
                     "    if _again and (_wo is None or _wo() is _out):",
                     "        return _GENERAL"]
        else:
            last_out = "_wo is None" if form == 0 else "_wo is not None and _wo() is _out"
            head += ["    _w, _wo = _e_last",
                     f"    if _w is not None and _w() is _x and {last_out}:",
                     "        return _GENERAL"]
    head.append(f"    _b_in = {flat_in}")
    if form == 2 and entry.scratch is None:
        head.append("    _b_out = _b_in")
    if entry.timeout is not None:
        ns["_timeout"] = entry.timeout
    guard = ["    if not _acquire(False):",
             "        return _GENERAL  # (the general path raises ConcurrentCall)"]
    if not timed_blocking:
        # weakly: the communicator keeps no caller's array alive; a new x's out is not recorded
        # (a weak reference costs about 0.05x the raw call), as only the same x again asks for it
        guard.append("    _e_last[0] = _weak(_x)" if form == 0 else
                     "    _e_last[:] = _weak(_x), _weak(_out) if _again else None" if form == 1 and not nonblocking else
                     "    _e_last[:] = _weak(_x), _weak(_out)")
        if form == 0:
            guard.append("    _e_last[1] = None")
    return head, guard


def _generate(plan, units, prologue, slots=None, fresh=None, timed=False) -> Callable[..., object] | None:
    """The body of :meth:`Plan.run`, written for this plan and compiled once.

    A call of a known shape then runs as one Python function: the concurrency
    guard, the call number and tag, the flight-recorder entry, and each unit's
    transport call and local ops written out in order with their arguments bound
    as constants -- no loop, no Python call per op where the op says how to be
    written inline (:func:`inline`). A 2-rank recursive-doubling allreduce is a
    ``Sendrecv`` and an ``np.add`` between the bookkeeping.

    With ``slots`` the buffers it names are not constants: a shape plan's
    ``run(_b_in, _b_out)`` takes them, or (``fresh = (shape, dtype, x)``, for a
    call without ``out``) ``run()`` allocates the output each time, shaped as
    ``x`` is then, and returns it. Each view of them is sliced at the top of the run, each message
    specification holding one is built there. Returns None when that cannot be
    done safely: an op that is not written inline (it may hold a view of its
    own), or a constant that may share memory with a compiled-against buffer.
    A ``timed`` shape plan's ``run(_b_in, _b_out, _timeout)`` gives up on a
    transfer, or on the library collective it runs in its nonblocking form,
    after ``_timeout`` seconds: it marks the call timed out in the flight
    record and raises the interpreter's :class:`CommTimeout` (for a library
    collective, the one a nonblocking native call raises, carrying the request
    still in flight as ``.pending`` for the communicator to keep alive). An
    exception while that request runs (an interrupt) hands it to the
    communicator, which keeps it alive and breaks.
    """
    ns = {"_acquire": plan.lock.acquire, "_release": plan.lock.release, "_comm": plan.comm, "_CommTimeout": CommTimeout,
          "_append": plan.append, "_recorder": plan.recorder, "_last": plan.last, "_plan": plan,
          "_InvalidBuffer": InvalidBuffer, "transfer_error": transfer_error, "_rank": plan.comm.rank,
          "_finish": plan.finish, "_result": plan.result, "_end": FlightRecorder.finish, "_stale": plan.comm._stale,
          "_attrs": plan.comm.__dict__}
    names = _Names(ns, slots)
    const, sliced, unsafe = names.const, names.sliced, names.unsafe

    body = []
    if prologue is not None:
        spec = getattr(prologue, "inline", None)
        if spec is not None and spec[2] is None:
            body.append(spec[0].format(*(const(v) for v in spec[1])))
        else:
            unsafe.append(prologue)
            ns["_prologue"] = prologue
            body.append("_prologue(tag)")
    straight = len(units) <= _INLINE_UNITS
    if straight:
        many = len(units) > 1
        for index, step, ops in units:
            body.append(f"# schedule step {index}: {_one_line(step)} (then the local steps fused after it)"
                        if len(ops) > 1 else f"# schedule step {index}: {_one_line(step)}")
            if many:
                body.append(f"rec[{STEP}] = {index}; rec[{STEP_OBJ}] = {const(step)}  # record.step, record.step_obj")
            for op in ops:
                spec = getattr(op, "inline", None)
                if spec is None:
                    unsafe.append(op)
                    body.append(f"{const(op)}(tag)")
                    continue
                template, values, errors = spec
                line = template.format(*(const(v) for v in values))
                if errors is None:
                    body.append(line)
                else:
                    body += ["try:", f"    {line}", f"except {const(errors[0])} as exc:",
                             f"    raise {const(errors[1])}(exc) from None"]
    else:
        unsafe.append(units)
        ns["_units"] = tuple((index, step, tuple(ops)) for index, step, ops in units)
        body += ["for index, step, ops in _units:",
                 f"    rec[{STEP}] = index; rec[{STEP_OBJ}] = step",
                 "    for op in ops:", "        op(tag)"]
    if slots is not None and unsafe:
        return None
    if not body:
        body.append("pass")
    # What the run's bookkeeping names: its first step (index and object) and the call's signature.
    marks = (units[0][0] if units else 0, const(units[0][1] if units else None), const(plan.signature))
    if slots is not None and fresh is None:
        # A shape plan keeps what it was written as (no caller's array: see _Names), so that its
        # entries (Plan.entry) are assembled from the same lines.
        plan.parts = (dict(ns), tuple(body), tuple(sliced), marks, timed)
    return _assemble(plan, ns, body, sliced, marks, slots, fresh, timed, None)


def _assemble(plan, ns, body, sliced, marks, slots, fresh, timed, entry):
    """The run's function from the lines :func:`_generate` wrote: its head, bookkeeping and ``body``."""
    done = "return _finish()" if plan.finish is not None else "return _result"
    head = []
    if timed:
        info = (plan.collective, plan.algorithm, plan.comm.rank)

        def timed_out(rec, seq, stuck, timeout):
            FlightRecorder.finish(rec, "timed out")
            return timeout_error((info[0], info[1], seq, info[2], None), rec[STEP], rec[STEP_OBJ], stuck, timeout)
        ns["_timed_out"] = timed_out

        def native_timed_out(rec, seq, pending, timeout):
            FlightRecorder.finish(rec, "timed out")
            error = native_timeout_error((info[0], info[1], seq, info[2], None), timeout)
            error.pending = pending
            return error
        ns["_native_timed_out"] = native_timed_out

        def interrupted(pending, seq):  # an exception (an interrupt) while the library's request runs
            plan.comm._collective_timed_out(pending, f"{info[0]} #{seq} (native) was interrupted on rank "
                                                     f"{info[2]}")
        ns["_interrupted"] = interrupted
    if fresh is not None:
        # The result's shape follows the input's, read at each run: an array reshaped in place
        # (x.shape = ...) between calls gets a result of its new shape.
        shape, dtype, x = fresh
        ns["_empty"], ns["_shape"], ns["_dtype"], ns["_x"] = np.empty, shape, dtype, x
        p = plan.comm.size
        if shape == x.shape:
            shape_of = "_x.shape"
        elif shape == (p,) + x.shape:
            shape_of = f"({p},) + _x.shape"
        elif shape == x.shape[1:]:
            shape_of = "_x.shape[1:]"
        else:
            shape_of = "_shape"
        head = [f"    _result = _empty({shape_of}, _dtype)", "    _b_out = _result.reshape(-1)"]
    guard = []  # how the run takes the communicator's guard (a shape plan's caller holds it)
    if entry is not None:
        head, guard = _entry_head(entry, ns)
    elif slots is None or fresh is not None:
        guard = ["    if not _acquire(False):", f"        raise _comm._concurrent({plan.collective!r})"]
    head += ["    " + line for line in sliced]
    first, step0, signature_name = marks
    # A call whose ops all run inline without a tag (the transport's own collective) skips computing it.
    uses_tag = any(re.search(r"\btag\b", line) for line in body)
    coll, alg = repr(plan.collective), repr(plan.algorithm)
    shape_plan = slots is not None and fresh is None and entry is None  # its caller holds the guard
    waits_native = timed and any("_pending" in line for line in body)  # a timed library collective
    if entry is not None:
        signature = "def run(_x, _out, _alg, _to, _a, _b):"
    elif shape_plan:
        signature = "def run(_b_in, _b_out, _timeout):" if timed else "def run(_b_in, _b_out):"
    else:
        signature = "def run():"
    takes_guard = bool(guard)
    # Everything after the guard is taken runs inside a try whose finally gives it back, so that an
    # exception anywhere there (an interrupt between two bookkeeping lines) never leaves it held.
    guarded = [
        *(line[4:] for line in guard[2:]),
        # The call number and last choice through the communicator's own attributes (its __dict__, which
        # holds no reference back): the weak proxy's attribute access costs more, at every call.
        "seq = _attrs['_seq']",
        "_attrs['_seq'] = seq + 1",
        "if _stale:  # messages of a call this rank refused, to drop before they could match (Communicator._spend_number)",
        "    _comm._drop_stale(seq)",
        *([f"tag = ((seq & {plan.seq_mask}) << {plan.seq_shift}) | {plan.tagbase}"] if uses_tag else []),
        "# the flight-recorder entry (watchdog.FlightRecorder): seq, collective, algorithm, signature, start,",
        "# end, step, step_obj, state",
        f"rec = [seq, {coll}, {alg}, {signature_name}, 0.0, None, {first}, {step0}, 'running']",
        *(["_pending = None"] if waits_native else []),
        "_append(rec)",
        "_attrs['_last'] = _last",
        "_recorder.active = rec",
        "try:",
        *("    " + line for line in body),
        "except _InvalidBuffer as exc:",
        "    _end(rec, 'failed')",
        f"    raise transfer_error(({coll}, {alg}, seq, _rank, None), rec[{STEP}], rec[{STEP_OBJ}], "
        "exc) from None",
        *([f"except _CommTimeout as exc:  # (the run marked the call timed out in its record)",
           f"    raise _comm._gave_up({coll}, seq, exc, {entry.native}) from None"]
          if entry is not None and timed else []),
        "except BaseException:",  # a user's op that raised, an interrupt: the record says so
        f"    if rec[{STATE}] == 'running':  # record.state",
        "        _end(rec, 'failed')",
        *(["        if _pending is not None:", "            _interrupted(_pending, seq)"]
          if waits_native else []),
        "    raise",
        "finally:",
        "    _recorder.active = None",
        f"rec[{STATE}] = 'done'  # record.state",
        done,
    ]
    if takes_guard:
        guarded = ["try:", *("    " + line for line in guarded), "finally:", "    _release()"]
    source = "\n".join([signature, *head, *guard[:2], *("    " + line for line in guarded)])
    exec(compile(source, f"<commkit plan: {plan.collective} {plan.algorithm}>", "exec"), ns)
    run = ns["run"]
    run.source = source  # for the curious: print(plan.run.source)
    return run


def _i_form_body(steps, bufs: dict, slots, names, begin):
    """The body of an i-form's generator: each local step written inline, each transfer begun and yielded.

    ``begin(step)`` gives a transfer step's line that begins it and the name of what
    it began, which the body yields for the driver to wait on; the transfer's
    overlapped local steps come between the two. None where a local step cannot be
    written inline (the interpreter then runs the call).
    """
    const = names.const
    body = []

    def local(ops) -> None:
        for _, op, _, _, _ in ops:
            spec = getattr(op, "inline", None)
            if spec is None or spec[2] is not None:
                names.unsafe.append(op)
                return
            body.append(spec[0].format(*(const(v) for v in spec[1])))

    for index, step in enumerate(steps):
        if step.kind != TRANSFER:
            local(_local_ops((step,), bufs, slots, index))
            continue
        line, pending = begin(step)
        body.append(f"# schedule step {index}: {_one_line(step)}")
        body.append(f"rec[{STEP}] = {index}; rec[{STEP_OBJ}] = {const(step)}  # record.step, record.step_obj")
        body.append(line)
        local(_local_ops(step.overlap, bufs, slots, index))
        body.append(f"yield {index}, {const(step)}, {pending}")
    return None if names.unsafe else body


def nonblocking_steps(steps, bufs: dict, chan, collective: str, algorithm: str):
    """An i-form's schedule for any arrays of one call shape, compiled: ``run(_b_in, _b_out, _b_tmp, tag, rec)``.

    What :func:`commkit.schedule.execute` does for a nonblocking run, written
    out for these steps as one generator function: each transfer records its
    step in the flight-recorder entry ``rec``, is posted (``chan.post``), has
    its overlapped local steps run while it is in flight, and is yielded as
    ``(index, step, pending)`` for :class:`commkit.schedule.ScheduleRun` to
    test or wait for; each local step between is one inline line. So an
    i-form on new arrays of a known shape runs the same steps as the
    interpreter in the same order, without interpreting them.

    ``bufs`` are the stand-ins (:func:`stand_in`) the views are cut from; the
    generated code slices each run's own buffers at the same places. Returns
    None where that cannot be done safely (a step of another kind, such as the
    node arena's one-sided steps, or an op not written inline): the interpreter
    then runs the call. Its text is ``run.source``.
    """
    if any(step.kind not in (TRANSFER, REDUCE, COPY) for step in steps):
        return None
    slots = Slots(bufs, ("in", "out", "tmp"))
    ns = {"_post": chan.post}
    names = _Names(ns, slots)

    def post(step):
        sends = [(peer, _view(bufs, ref, slots)) for peer, ref in step.sends]
        recvs = [(peer, _view(bufs, ref, slots)) for peer, ref in step.recvs]
        return f"_pending = _post({names.const(sends)}, {names.const(recvs)}, tag)", "_pending"

    body = _i_form_body(steps, bufs, slots, names, post)
    if body is None:
        return None
    source = "\n".join([
        "def run(_b_in, _b_out, _b_tmp, tag, rec):",
        *("    " + line for line in names.sliced),
        *("    " + line for line in body),
        *([] if any(line.startswith("yield") for line in body) else ["    yield from ()"]),
    ])
    exec(compile(source, f"<commkit i-form: {collective} {algorithm}>", "exec"), ns)
    run = ns["run"]
    run.source = source
    return run


def persistent_steps(steps, bufs: dict, collective: str, algorithm: str):
    """An i-form's schedule compiled over persistent transfers: ``run(_src, _dst, _slot, _pool, _i, rec)``.

    The same steps as :func:`nonblocking_steps`, run on the buffers of one
    :class:`PersistentPool` slot (``_slot``: its ``in``, ``out`` and ``tmp``, then
    one persistent transfer per transfer step, bound to those buffers with the
    call's tag): the input is copied into the slot's ``in`` first, each transfer
    is started instead of posted (nothing is parsed per call), and the slot's
    ``out`` is copied to ``_dst`` last. Where no transfer moves ``in`` (or
    ``out``), the local steps use ``_src`` (``_dst``) itself, with no copy. The run then hands its slot back
    (``_pool[_i] = _slot``); a run that fails or times out never does, so a
    slot whose requests may still be active is never started again. None where
    :func:`nonblocking_steps` would refuse. Its text is ``run.source``.
    """
    if any(step.kind not in (TRANSFER, REDUCE, COPY) for step in steps):
        return None
    slots = Slots(bufs, ("in", "out", "tmp"))
    ns = {}
    names = _Names(ns, slots)
    moved = _moved(steps)
    own = [f"_b_{name} = {arg}" for name, arg in (("in", "_src"), ("out", "_dst")) if name not in moved]
    transfers = []

    def start(step):
        name = f"_t{len(transfers)}"
        transfers.append(name)
        return f"{name}.start()", name

    body = _i_form_body(steps, bufs, slots, names, start)
    if body is None:
        return None
    if "in" in moved:
        body.insert(0, "_b_in[...] = _src")
    if "out" in moved:
        body.append("_dst[...] = _b_out")
    body.append("_pool[_i] = _slot  # (a run that raised never gets here)")
    source = "\n".join([
        "def run(_src, _dst, _slot, _pool, _i, rec):",
        f"    _b_in, _b_out, _b_tmp, {''.join(t + ', ' for t in transfers)}= _slot",
        *("    " + line for line in own),
        *("    " + line for line in names.sliced),
        *("    " + line for line in body),
        *([] if transfers else ["    yield from ()"]),
    ])
    exec(compile(source, f"<commkit i-form: {collective} {algorithm}, persistent>", "exec"), ns)
    run = ns["run"]
    run.source = source
    return run


def _moved(steps) -> set:
    """The buffers a transfer of ``steps`` moves: a pool's slot holds those (and ``tmp``), the run's own the rest."""
    return {ref[0] for step in steps if step.kind == TRANSFER for _, ref in (*step.sends, *step.recvs)}


# A slot-list entry: this call number came once (its call posted its transfers), or its slot is in
# flight or was given up; the number's next call makes a slot (see PersistentPool).
SEEN = "seen"


class IEntry(NamedTuple):
    """What an i-form's entry (:func:`nonblocking_entry`) runs, besides the kinds its :class:`Entry` says.

    ``collective`` names the call; ``plan`` is the communicator's cached plan tuple (choice, steps, scratch
    count, in-place safety, name, tag base, signature); ``compiled`` the
    shape's generator function (:func:`nonblocking_steps`); ``pool`` its
    persistent transfers (:class:`PersistentPool`) or None. ``comm`` is the
    communicator (a proxy); ``empty`` the scratch of algorithms that need none.
    """

    collective: str
    plan: tuple
    compiled: Callable
    pool: object
    comm: object
    empty: object


def _soon(pending) -> bool:
    """Whether ``pending`` completes within a few more tests (its transport's ``settles()``): an i-form entry's start.

    A small exchange between ranks that are both there completes about a
    microsecond after it is started; testing it a few more times then costs
    less than the run object and request that drive a transfer still in
    flight, and the start returns a completed request instead. A peer that is
    not there yet costs the start these few tests, and the run goes on as before.
    A transport without ``settles()`` (the threads world, NCCL) is not tested again.
    """
    settles = getattr(pending, "settles", None)
    return settles is not None and settles()


def nonblocking_entry(entry: Entry, spec: IEntry):
    """An i-form on new arrays of a known shape as one generated function: ``run(x, out, algorithm, timeout, a, b)``.

    What the communicator's ``_fresh`` and ``_fresh_request`` do for such a call,
    written out for its kinds: the checks of :class:`Entry` (and that i-forms may
    run compiled: plans on, no check mode, a usable communicator), the
    outstanding-request limit, the guard, the call number (settling the requests
    outstanding first, as every call does), the flight-recorder entry and the
    tag; then the call's transfers started from a persistent slot where the
    number has one (its first call posts), or posted. Its steps are driven at
    once, as :class:`commkit.schedule.ScheduleRun` drives them at its start,
    each transfer tested a few times (:func:`_soon`): a
    run that completes there (a small call's usually does) is handed back as a
    completed request (:class:`commkit.schedule.CompletedRequest`) without
    making a run object; one that does not becomes a
    run from the step in flight, which :class:`commkit.schedule.Progress` drives
    from then on. Anything else returns ``entry.general`` before anything is
    sent. Its text is ``run.source``.
    """
    comm = spec.comm
    choice, steps, scratch_n, inplace_safe, name, tagbase, signature = spec.plan
    layout, progress, recorder = comm._layout, comm._progress, comm._recorder
    ns = {"_comm": comm, "_attrs": comm.__dict__, "_acquire": comm._entry.acquire, "_release": comm._entry.release,
          "_progress": progress,
          "_stale": comm._stale, "_recorder": recorder, "_append": recorder.calls.append, "_last": (name, choice), "_sig": signature,
          "_monotonic": _monotonic, "_compiled": spec.compiled, "_chan": comm._coll, "_Request": ScheduleRequest,
          "_Run": ScheduleRun, "_Completed": CompletedRequest,
          # through the proxy at each call: a bound method would keep the communicator alive
          "_on_timeout": lambda pending, reason: comm._collective_timed_out(pending, reason),
          "_EMPTY": spec.empty, "_InvalidBuffer": InvalidBuffer, "transfer_error": transfer_error,
          "_end": FlightRecorder.finish, "_max_held": comm._max_in_flight, "_span": comm._seq_span,
          "_rank": comm.rank, "_soon": _soon}
    head, _ = _entry_head(entry, ns, nonblocking=True)
    coll, alg = repr(spec.collective), repr(name)
    timeout = repr(entry.timeout) if entry.timeout is not None else "None"
    ns["_timeout"] = entry.timeout
    if entry.form == 2 and entry.scratch is None and not inplace_safe:  # reads its input after writing out
        head.append("    _b_in = _b_in.copy()")
    start = [f"_tmp = _empty({scratch_n}, _e_dtype)" if scratch_n else "_tmp = _EMPTY",
             "_gen = _compiled(_b_in, _b_out, _tmp, tag, rec)"]
    pool = spec.pool
    if pool is not None:
        ns.update(_slots=pool.slots, _make=pool.make, _pool_run=pool.run, _SEEN=SEEN)
        start = ["_i = seq & " + str(layout.seq_mask), "_slot = _slots[_i]", "_slots[_i] = _SEEN",
                 "if _slot is None:  # the number's first call posts its transfers",
                 *("    " + line for line in start), "else:",
                 "    if _slot is _SEEN:", "        _slot = _make(seq)",
                 "    _gen = _pool_run(_b_in, _b_out, _slot, _slots, _i, rec)"]
    info = f"({coll}, {alg}, seq, _rank, None)"
    source = "\n".join([
        "def run(_x, _out, _alg, _to, _a, _b):",
        *head,
        "    if _progress.held >= _max_held or not _acquire(False):",
        "        return _GENERAL  # (the general path raises, naming the limit or the concurrent call)",
        "    try:",
        "        seq = _attrs['_seq']  # (as in a plan's run)",
        "        _attrs['_seq'] = seq + 1",
        "        if _stale:  # (as in a plan's run)",
        "            _comm._drop_stale(seq)",
        "        if _progress.requests:",
        f"            _progress.settle(seq, _span, {timeout})",
        "        # the flight-recorder entry (watchdog.FlightRecorder): seq, collective, algorithm, signature, start,",
        "        # end, step, step_obj, state",
        f"        rec = [seq, {coll}, {alg}, _sig, _monotonic(), None, -1, None, 'running']",
        "        _append(rec)",
        "        _attrs['_last'] = _last",
        f"        tag = ((seq & {layout.seq_mask}) << {layout.seq_shift}) | {tagbase}",
        *("        " + line for line in start),
        "        # Driven at once, as a run is at its start: the steps that complete now.",
        "        try:",
        "            for _item in _gen:",
        "                if not (_item[2].test() or _soon(_item[2])):  # in flight: a run drives it from here",
        f"                    return _Request(_Run(None, None, _chan, tag, _timeout, {info}, None, _progress,",
        "                                         _recorder, rec, _on_timeout, _result, _gen, _item), _progress)",
        "        except _InvalidBuffer as exc:",
        "            _end(rec, 'failed')",
        f"            raise transfer_error({info}, rec[{STEP}], rec[{STEP_OBJ}], exc) from None",
        "        except BaseException:",
        f"            if rec[{STATE}] == 'running':",
        "                _end(rec, 'failed')",
        "            raise",
        f"        rec[{T_END}] = _monotonic()",
        f"        rec[{STATE}] = 'done'",
        "        return _Completed(_result, _progress)",
        "    finally:",
        "        _release()",
    ])
    exec(compile(source, f"<commkit i-form entry: {spec.collective} {name}>", "exec"), ns)
    run = ns["run"]
    run.source = source
    return run


def native_nonblocking_entry(entry: Entry, start):
    """The library's i-form (``native``) on new arrays of a known shape: ``run(x, out, algorithm, timeout, a, b)``.

    The checks of :class:`Entry` (and that i-forms may run compiled), the
    guard, then ``start(in, out, result, timeout)``, which starts the
    library's nonblocking collective on the flat arrays and returns its thin
    request (the communicator's ``_fresh_native``): no schedule to compile,
    so nothing else is written out. Anything else returns ``entry.general``
    before anything is sent. Its text is ``run.source``.
    """
    ns = {"_start": start, "_timeout": entry.timeout}
    comm = start.comm
    ns.update(_comm=comm, _acquire=comm._entry.acquire, _release=comm._entry.release)
    head, guard = _entry_head(entry, ns, nonblocking=True)
    source = "\n".join([
        "def run(_x, _out, _alg, _to, _a, _b):",
        *head,
        *guard[:2],
        "    try:",
        *("    " + line for line in guard[2:]),
        "        return _start(_b_in, _b_out, _result, _timeout)",
        "    finally:",
        "        _release()",
    ])
    exec(compile(source, "<commkit i-form entry: native>", "exec"), ns)
    run = ns["run"]
    run.source = source
    return run


class PersistentPool:
    """One call shape's persistent transfers, a slot per call number, made when the number comes a second time.

    A call's tag carries its call number (modulo ``span``, :mod:`commkit.identity`),
    and a persistent request's tag is fixed: so each number has a slot of its own
    (``slots[seq % span]``: scratch ``in``/``out``/``tmp`` and the transfers bound to
    them with that call's tag), and a call's messages are those the posted path sends,
    tag for tag. Which slot a call takes depends on its call number only, the same on
    every rank. A number's first call posts its transfers and marks it ``SEEN`` (a slot
    costs about 8 us to make: a program that never comes round the numbers would pay
    it and gain nothing); its next call makes the slot. A slot is out of the pool
    (``SEEN``) while its run is in flight and comes back when the run completes, so a
    run that failed or timed out leaves its number to make a new one; the run that last
    held a number is finished before that number comes round again (by
    ``Progress.settle``, before the number's next call), so a slot is never started
    while active. A pool reserves the scratch of all its slots from the communicator's
    ``budget`` (bytes, shared by its pools) when it is made, and gives it back when it
    is collected; a shape whose pool the budget cannot hold gets none, and its calls
    post their transfers.
    """

    __slots__ = ("slots", "run", "chan", "transfers", "sizes", "dtype", "tagbase", "seq_mask", "seq_shift",
                 "budget", "reserved")

    def __init__(self, run, steps, chan, sizes: tuple, dtype, tagbase: int, layout, budget: list):
        self.run = run  # the i-form's generator that runs a slot (persistent_steps)
        self.chan = chan
        self.transfers = [step for step in steps if step.kind == TRANSFER]
        self.sizes = self.slot_sizes(steps, sizes)
        self.dtype = dtype
        self.tagbase = tagbase
        self.seq_mask, self.seq_shift = layout.seq_mask, layout.seq_shift
        self.slots = [None] * (layout.seq_mask + 1)
        self.budget = budget
        self.reserved = len(self.slots) * sum(self.sizes) * dtype.itemsize
        assert budget[0] >= self.reserved, "the caller checks the budget (PersistentPool.cost)"
        budget[0] -= self.reserved

    @staticmethod
    def slot_sizes(steps, sizes: tuple) -> tuple:
        """Elements of a slot's in, out and tmp: none for an in or out no transfer moves (the run's own serves)."""
        moved = _moved(steps)
        return tuple(n if name == "tmp" or name in moved else 0 for name, n in zip(("in", "out", "tmp"), sizes))

    @classmethod
    def cost(cls, steps, sizes: tuple, dtype, layout) -> int:
        """The bytes of scratch a pool of these steps reserves (a slot per call number)."""
        return (layout.seq_mask + 1) * sum(cls.slot_sizes(steps, sizes)) * dtype.itemsize

    def make(self, seq: int):
        """A new slot for call number ``seq``: its in, out and tmp, then one persistent transfer per transfer step."""
        bufs = dict(zip(("in", "out", "tmp"), (np.empty(n, self.dtype) for n in self.sizes)))
        tag = ((seq & self.seq_mask) << self.seq_shift) | self.tagbase
        made = []
        for step in self.transfers:
            transfer = self.chan.persistent_transfer([(peer, _view(bufs, ref)) for peer, ref in step.sends],
                                                     [(peer, _view(bufs, ref)) for peer, ref in step.recvs], tag)
            assert transfer is not None, "pools are made only for host arrays on transports with persistent requests"
            made.append(transfer)
        return (bufs["in"], bufs["out"], bufs["tmp"], *made)

    def free(self) -> None:
        """Free the requests of the slots in the pool (a run in flight keeps its own, and hands it back after)."""
        for index, slot in enumerate(self.slots):
            if type(slot) is tuple:
                self.slots[index] = None
                for transfer in slot[3:]:
                    transfer.free()

    def __del__(self) -> None:
        self.budget[0] += self.reserved
        try:
            self.free()
        except Exception:  # noqa: BLE001 - at exit the library may be gone: nothing is left to free then
            pass


class _Reposted:
    """A persistent transfer on a transport without persistent requests: post it again at each start."""

    __slots__ = ("chan", "sends", "recvs", "tag", "pending")

    def __init__(self, chan, sends, recvs, tag):
        self.chan, self.sends, self.recvs, self.tag, self.pending = chan, sends, recvs, tag, None

    def start(self) -> None:
        self.pending = self.chan.post(self.sends, self.recvs, self.tag)

    def test(self) -> bool:
        return self.pending.test()

    def wait(self, timeout):
        return self.pending.wait(timeout)

    def abandon(self) -> None:
        abandon = getattr(self.pending, "abandon", None)
        if abandon is not None:
            abandon()

    def free(self) -> None:
        self.pending = None


def _never(x) -> bool:
    """A retired plan's ``ready``."""
    return False


def _never_steady() -> bool:
    """A retired plan's ``steady``."""
    return False


def _readiness(plan):
    """``plan.ready(x)``: whether the plan may run for a call that passed its very arrays again.

    The arrays are the same objects, but the program may have changed them in
    place since the first call checked them: a new shape (``x.shape = ...``), a
    new element type, an output made read-only. The plan then does not run,
    and the call takes the general path, which checks it as a first call does
    (and raises where the new state is wrong). Nor does it run while the
    communicator needs the general path (see ``Communicator._update_plain``) or
    a trace is recording. Written out for the plan's own arrays, as the plan is.
    A plan its communicator forgot is never ready again (:meth:`Plan.retire`).
    """
    ns = {"_comm": plan.comm, "_trace": _trace_active, "_dtype": plan.dtype}
    terms = ["(x is None or x.dtype is _dtype)", "_comm._plain", "not _trace"]
    x, out = plan.keep if plan.keep else (None, None)
    # The same tests, written out in the communicator's methods whose x is never None (a call there
    # costs about 0.1 us more than the tests themselves): the shapes compiled for.
    plan.shape_x = None if x is None else x.shape
    plan.shape_out = None if out is None else out.shape
    for name, array in (("_x", x), ("_o", out if out is not x else None)):
        if array is not None:
            ns[name], ns[name + "s"] = array, array.shape
            terms.append(f"{name}.shape == {name}s")
    if out is not None:
        terms.append(f"{'_x' if out is x else '_o'}.flags.writeable")
    exec(f"def ready(x):\n    return {' and '.join(terms)}\n", ns)
    # steady(): the terms that do not read the plan's arrays, for a caller that made those arrays itself and
    # never hands them out (the mpi4py face's byte views of a program's buffers), so that their shape, element
    # type and flags are still what they were; the face checks the program's own buffers before it asks.
    exec(f"def steady():\n    return {' and '.join(terms[1:3])}\n", ns)
    plan.steady = ns["steady"]
    return ns["ready"]


class Plan:
    """A blocking collective call compiled against fixed buffers (see the module docstring).

    ``plan.run()`` is the whole per-call path of a call whose plan is known: a
    function generated for this plan (:func:`_generate`; its text is
    ``plan.run.source``), with every attribute it needs resolved once, here.
    Two variants take buffers per run instead (``slots``): a call without
    ``out`` allocates its result at each ``run()``, and a *shape plan*'s
    ``run(src, dst)`` runs any flat arrays of its call shape.
    """

    __slots__ = ("comm", "run", "collective", "algorithm", "choice", "signature", "dtype", "keep", "result",
                 "finish", "recorder", "append", "lock", "last", "tagbase", "seq_mask", "seq_shift", "hot", "ready",
                 "shape_x", "shape_out", "parts", "steady")

    def __init__(self, comm, ops, tagbase, collective, algorithm, choice, signature, dtype, keep, result,
                 finish=None, prologue=None, slots=None, fresh=None, timed=False):
        # The communicator keeps its plans, so a plan refers to it weakly: a communicator the program
        # drops is released at once (its contexts freed), not when the cyclic collector runs.
        comm = self.comm = weakref.proxy(comm)
        self.tagbase = tagbase
        self.seq_mask = comm._layout.seq_mask
        self.seq_shift = comm._layout.seq_shift
        self.collective = collective
        self.algorithm = algorithm
        self.choice = choice
        self.last = (algorithm, choice)  # what the communicator reports as last_algorithm / last_choice
        self.signature = signature
        self.dtype = dtype
        self.keep = keep          # the caller's arrays: their identity is this plan's key
        self.ready = _readiness(self)
        self.result = result      # what the call returns
        self.finish = finish      # a callable for calls whose result needs work (exscan on rank 0)
        self.recorder = comm._recorder
        self.append = comm._recorder.calls.append
        self.lock = comm._entry
        self.hot = None           # the call's arguments, for the communicator's last-plan check
        # prologue: a local op run first (saving the input of an in-place call that needs it)
        # slots: the buffers each run takes (a shape plan: run(in, out)), or with fresh, allocates (out).
        # run is None when the ops cannot be written that way (see _generate): use the general path.
        self.parts = None  # a shape plan's lines, for its entries (set by _generate)
        self.run = None if ops is None else _generate(self, fuse(ops), prologue, slots, fresh, timed)

    def entry(self, entry: "Entry"):
        """This shape plan as the whole call on new arrays: ``run(x, out, algorithm, timeout, a, b)``, or None.

        The public method hands it its arguments as it got them (``a``: the op,
        or broadcast's root; ``b``: reduce's root). The function checks them
        against the call kinds it was written for (``entry``: those the general
        path checked and ran, see :class:`Entry`) with the checks the
        communicator's ``_fresh`` makes, takes the communicator's guard, and runs
        the plan's body on the arrays given, allocating the result where no
        ``out`` came. Anything else -- another shape, dtype, op, form, a
        timeout, a strided or overlapping array, tracing, debug logging, the
        same arrays as the last call (whose loop gets its own plan), a
        concurrent call -- returns ``_GENERAL`` before anything is sent, and the
        general path takes the call (and names what is wrong). The
        communicator installs an untimed entry only while it is plain (no
        timeout, check mode or outstanding request), a timed one while only its
        timeout keeps it from being plain, and drops each when that ends. So a
        call on new arrays costs its checks, the bookkeeping and the transport
        calls, in one Python function. Its text is ``run.source``.
        """
        if self.parts is None:
            return None
        ns, body, sliced, marks, timed = self.parts
        return _assemble(self, dict(ns), list(body), list(sliced), marks, True, None, timed, entry)

    def retire(self) -> None:
        """Never ready again: its communicator forgot it (an algorithm edited since, or the communicator freed).

        Whoever kept the plan to run it while ``ready(x)`` holds (the mpi4py
        face) then makes the call the communicator's way, which selects and
        compiles anew.
        """
        self.ready = _never
        self.steady = _never_steady



class PersistentRequest(Request):
    """A persistent collective (MPI-4 ``MPI_Allreduce_init`` and friends): start, wait, restart, free.

    Made by the communicator's ``*_init`` methods. The call shape, buffers and
    tag are fixed when it is made; ``start()`` begins one run of the
    collective (it does not block), ``test()``/``wait()`` advance and complete
    it, and it may be started again once complete. ``free()`` releases it.
    Like every request, an outstanding run is also advanced by any blocking
    call or wait on its communicator.

    Every rank must create its persistent collectives in the same order, and
    start them in the same order, as MPI requires.
    """

    def __init__(self, comm, ops, tag, collective, algorithm, signature, result, finish=None, prologue=None,
                 timeout=None, native=None, release=None):
        self._comm = comm
        self._ops = ops
        self._tag = tag
        self._collective = collective
        self._algorithm = algorithm
        self._signature = signature
        self._result_value = result
        self._finish = finish
        self._prologue = prologue
        self._timeout = timeout
        self._native = native  # a library persistent request (native algorithm), if any
        self._append = comm._recorder.calls.append
        # Only a schedule with more than one transfer needs others to drive it: the library
        # progresses a started persistent transfer (or its own persistent collective) by itself,
        # and what follows the last transfer is local work that wait() or test() runs.
        self._driven = native is None and sum(1 for entry in ops if entry[0] == TRANSFER) > 1
        self._index = len(ops)
        self._pending = None
        # _running: a run's transfers or local ops are not all done. _active: started and not yet seen
        # complete by this rank's test() or wait(). start() and free() look at _active only, which
        # follows the program's own calls, so a misuse is refused on every rank alike -- never on the
        # rank whose run is still in flight and accepted on one where start() happened to finish it.
        self._running = False
        self._active = False
        self._freed = False
        # Gives back this request's identity (its channel and number, see Communicator._persistent)
        # when it is freed, or collected without free().
        self._release = weakref.finalize(self, release) if release is not None else None
        self._rec = None
        self._seq = None
        self._result = None

    # -- the request interface --------------------------------------------------------------------------

    def start(self) -> "PersistentRequest":
        """Begin one run of the collective (never blocks). Returns the request."""
        self._begin()
        if self._native is not None:
            self._native.Start()  # the library progresses it; test() and wait() look at it
            return self
        self._index = 0
        self._pending = None
        if self._driven:
            self._comm._progress.add(self)
        self._advance()
        return self

    def _begin(self) -> None:
        """What every start does first: refuse a misuse, take the call number and its flight record, the prologue."""
        if self._freed:
            raise InvalidArgument(f"this persistent {self._collective} was freed; create a new one.")
        if self._active:
            raise self._still_active("starting it again")
        comm = self._comm
        if comm._closed:
            comm._check_open()
        seq = comm._seq
        comm._seq = seq + 1
        if comm._stale:  # (its own channel never carries them, but a start must not let their number come round)
            comm._drop_stale(seq)
        self._seq = seq
        rec = self._rec = [seq, self._collective, self._algorithm, self._signature, _monotonic(), None, -1, None,
                           "running"]  # as FlightRecorder.start, without the call
        self._append(rec)
        self._active = self._running = True
        if self._prologue is not None:
            self._prologue(self._tag)

    def _still_active(self, before: str) -> InvalidArgument:
        return InvalidArgument(f"this persistent {self._collective} is active: complete it with wait() (or a "
                               f"test() that returns True) before {before}.")

    def _advance(self) -> bool:
        """Run local ops and start transfers until one is in flight or the run is complete."""
        if self._native is not None:
            if self._native.Test():
                self._complete()
                return True
            return False
        ops = self._ops
        try:
            while True:
                if self._pending is not None:
                    if not self._pending.test():
                        return False
                    self._pending = None
                    self._index += 1
                if self._index >= len(ops):
                    self._complete()
                    return True
                kind, op, step, overlapped, index = ops[self._index]
                if kind == TRANSFER:
                    self._rec[STEP] = index
                    self._rec[STEP_OBJ] = step
                    op.start()
                    self._pending = op
                    for local in overlapped:
                        local(self._tag)
                else:
                    op(self._tag)
                    self._index += 1
        except InvalidBuffer as exc:
            raise self._failed(exc) from None

    def _failed(self, exc: InvalidBuffer) -> BaseException:
        """Stop this run after a transport error; the error to raise, naming the call and step."""
        self._stop("failed")
        return transfer_error((self._collective, self._algorithm, self._seq, self._comm.rank, None),
                               self._rec[STEP], self._rec[STEP_OBJ], exc)

    def _advance_once(self) -> bool:
        if not self._running:
            return False
        before = self._index
        return self._advance() or self._index != before

    def _complete(self) -> None:
        self._stop("done")
        self._result = self._finish() if self._finish is not None else self._result_value

    def _stop(self, state: str) -> None:
        self._running = False
        if state != "done":  # the run failed or timed out, and its error says so: nothing left to complete
            self._active = False
        if self._driven:
            self._comm._progress.discard(self)
        FlightRecorder.finish(self._rec, state)

    def test(self) -> bool:
        """Advance without blocking; True once the current run is complete (or none was started).

        A True answer completes the run, as MPI_Test does: the request may then be started again or freed.
        """
        if not self._running or self._advance():
            self._active = False
            return True
        self._comm._progress.drive(skip=self)
        return False

    def wait(self, timeout: float | None = None):
        """Block until the current run completes; return its result (the output array, or None)."""
        if not self._running:
            self._active = False
            return self._result
        timeout = self._timeout if timeout is None else timeout
        comm = self._comm
        recorder = comm._recorder
        recorder.active = rec = self._rec
        if self._native is not None and timeout is None and not comm._progress.requests:
            # Nothing to drive and no timeout: block in the library's own wait, then complete
            # (what _complete does, written out: this is the whole per-run path of a native request).
            try:
                self._native.Wait()
            finally:
                recorder.active = None
            self._active = self._running = False
            rec[T_END] = _monotonic()
            rec[STATE] = "done"
            self._result = self._finish() if self._finish is not None else self._result_value
            return self._result
        try:
            while self._running:
                if (self._pending is not None and timeout is None and self._native is None
                        and len(comm._progress.requests) == self._driven):
                    # Nothing else to drive and no timeout: block in the transport at once
                    # (no test first), then run what follows the transfer.
                    try:
                        self._pending.wait(None)
                    except InvalidBuffer as exc:
                        raise self._failed(exc) from None
                    self._pending = None
                    self._index += 1
                if self._advance():
                    break
                waitable = self._native if self._native is not None else self._pending
                test = waitable.Test if self._native is not None else waitable.test
                if len(comm._progress.requests) > self._driven or self._native is not None or timeout is not None:
                    if not comm._progress.wait(test, timeout, skip=self):
                        self._timed_out(timeout)
                else:
                    waitable.wait(None)
        finally:
            comm._recorder.active = None
        self._active = False
        return self._result

    def _timed_out(self, timeout):
        info = (self._collective, self._algorithm, self._seq, self._comm.rank, None)
        self._stop("timed out")
        recent = recent_summary(self._comm._recorder)
        if self._native is not None:  # the library's request may still use the buffers: keep it alive
            error = native_timeout_error(info, timeout, recent)
            in_flight, form = self._native, " (native)"
        else:
            step = self._rec[STEP_OBJ]
            peers = sorted({p for p, _ in step.recvs} | {p for p, _ in step.sends}) if step is not None else []
            error = timeout_error(info, self._rec[STEP], step, peers, timeout, recent)
            in_flight, form = self._pending, ""
        # Cancels what can be cancelled, keeps the rest alive, and breaks the communicator.
        self._comm._collective_timed_out(in_flight, f"persistent {self._collective} #{self._seq}{form} timed out "
                                                    f"on rank {self._comm.rank}")
        raise error

    @property
    def done(self) -> bool:
        """Whether no run is in progress (without making progress)."""
        return not self._running

    @property
    def result(self):
        """The result of the last completed run (None before the first one)."""
        return self._result

    @property
    def status(self):
        """Collectives have no status (for the common request interface)."""
        return None

    def free(self) -> None:
        """Release the request (and the transport's persistent requests behind it)."""
        if self._freed:
            return
        if self._active:
            raise self._still_active("free()")
        self._freed = True
        if self._release is not None:
            self._release()
        for entry in self._ops:
            if entry[0] == TRANSFER:
                entry[1].free()
        if self._native is not None:
            self._native.Free()
        self._ops = ()

    def __enter__(self) -> "PersistentRequest":
        return self

    def __exit__(self, *exc) -> None:
        if self._active and exc[0] is None:
            self.wait()
        if not self._active:
            self.free()

    def __repr__(self) -> str:
        state = "freed" if self._freed else ("running" if self._running else "active" if self._active else "inactive")
        return f"<commkit.PersistentRequest {self._collective} ({self._algorithm}): {state}>"


class InterpretedPersistentRequest(PersistentRequest):
    """A persistent collective whose schedule has one-sided steps (the node algorithms, docs/node.md).

    Compiled plans run no one-sided step, so each ``start()`` runs the schedule
    as a request on the request's buffers, as an i-form does
    (:class:`~commkit.schedule.ScheduleRun`): its node program's generator
    (``NodeProgram.steps``, made at the first start) where one can be made and
    plans are on, else the interpreter, with the request's own tag (its
    identity on its channel's arena) and a new call number. Everything else is
    :class:`PersistentRequest`'s: the same misuse is refused, the same flight
    record kept, a timeout breaks the communicator alike. Its channel's arena is
    made at ``*_init`` (``Communicator._persistent_arena``, after a timed check
    that every rank can make it), so no start fails for want of it.
    """

    def __init__(self, comm, steps, bufs, chan, tag, collective, algorithm, signature, result, finish=None,
                 prologue=None, timeout=None, release=None):
        super().__init__(comm, (), tag, collective, algorithm, signature, result, finish, prologue, timeout,
                         release=release)
        self._steps, self._bufs, self._chan = steps, bufs, chan
        self._run = None
        self._program = None  # its NodeProgram on its channel's arena (False: none can be made), at its first start

    def _program_steps(self, info):
        """This start's run of the node program's generator (``NodeProgram.steps``), or None: the interpreter's.

        As a blocking node call and an i-form run theirs, but not with plans off
        or in check mode (the switches that turn every compiled form off).
        """
        comm = self._comm
        if not comm._plans_on or comm._check:
            return None
        program = self._program
        if program is None:
            from .transports._arena import made_arena

            arena = made_arena(self._chan)  # (made at *_init)
            made = None if arena is None else NodeProgram.make(self._steps, self._bufs, self._chan, arena)
            program = self._program = made or False
        return program.steps(self._bufs, self._tag, info, self._rec) if program else None

    def start(self) -> "InterpretedPersistentRequest":
        """Begin one run of the collective (never blocks). Returns the request."""
        self._begin()
        comm = self._comm
        info = (self._collective, self._algorithm, self._seq, comm.rank, None)
        try:
            self._run = ScheduleRun(iter(self._steps), self._bufs, self._chan, self._tag, self._timeout, info,
                                    self._finish, comm._progress, comm._recorder, self._rec,
                                    comm._collective_timed_out, self._result_value, self._program_steps(info))
        except BaseException:
            self._active = self._running = False
            raise
        return self

    @property
    def done(self) -> bool:
        """Whether no run is in progress (without making progress)."""
        return not self._running or self._run._done

    def _ended(self) -> None:
        self._active = self._running = False
        self._result = self._run._result

    def test(self) -> bool:
        """Advance without blocking; True once the current run is complete (or none was started)."""
        if not self._running:
            self._active = False
            return True
        try:
            if not self._run.test():
                return False
        except BaseException:
            self._active = self._running = False
            raise
        self._ended()
        return True

    def wait(self, timeout: float | None = None):
        """Block until the current run completes; return its result (the output array, or None)."""
        if not self._running:
            self._active = False
            return self._result
        try:
            self._run.wait(timeout)
        except BaseException:
            self._active = self._running = False
            raise
        self._ended()
        return self._result

