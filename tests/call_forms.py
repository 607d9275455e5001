"""Every call form after every other: the rotation shared by the threads world and ``mpiexec``.

A collective can be called in many forms: on the same arrays again (a plan), on a new input (a
shape's entry), with or without ``out``, in place, with a timeout, as an i-form, through a
persistent request, with another algorithm, dtype or length. Each form has its own fast path, and
a call's path depends on what the calls before it left behind (the last arrays, the last shape's
entry, the hot plan). Two bugs of that kind were found by rotating a benchmark's columns, not by a
test: a loop that fell off its fast path for good after a call of another form. So
:func:`rotate` makes, on one communicator, every form after every other form (every ordered pair),
checks each call against NumPy (result, result array, inputs untouched), and counts the calls
that reach the general path or ``Communicator._fresh`` once a form has settled: none should.

Imported by tests/test_call_forms.py on the threads world and by the job scripts it runs under
``mpiexec`` (the tests directory is on their path), as tests/contracts.py is.
"""

from __future__ import annotations

import array
import itertools

import numpy as np

import contracts
from commkit import algorithms, collectives

#: The general paths a call can reach (the communicator's checked, interpreted calls).
GENERAL = ("_reduction", "_broadcast", "_allgather", "_alltoall", "_gather", "_scatter", "_reduce_scatter")

#: Calls of the first form before the second's, and calls of the second; the second form's calls from
#: ``SETTLED`` on must take neither the general path nor ``_fresh`` (its first calls may: they compile).
BEFORE, AFTER, SETTLED = 3, 8, 4

COLLECTIVES = ("allreduce", "reduce", "scan", "broadcast", "gather", "scatter", "allgather", "alltoall",
               "reduce_scatter", "exscan")


def counting_general_path(comm):
    """Count the calls that reach the general path (``_reduction``, ``_broadcast``, ...) on this communicator."""
    seen = []
    for entry in GENERAL:
        def counted(*args, _general=getattr(comm, entry), **kwargs):
            seen.append(args[0])
            return _general(*args, **kwargs)
        setattr(comm, entry, counted)
    return seen


def counting_fresh(comm):
    """Count the calls that reach ``Communicator._fresh`` (those no entry took), by collective ("i" before an
    i-form's); call the result's second item to stop counting."""
    calls = []
    real_fresh = comm._fresh

    def counted(*args, **kwargs):
        calls.append(("i" if kwargs.get("nonblocking") else "") + args[0])
        return real_fresh(*args, **kwargs)
    comm._fresh = counted
    return calls, lambda: setattr(comm, "_fresh", real_fresh)


def _case(comm, collective, seed, dtype="int64", count=5):
    """The contracts' case of one call: every rank draws every rank's input from it."""
    case = {"collective": collective, "seed": seed, "dtype": dtype, "shape": [count]}
    if collective in contracts.REDUCING:
        case["op"] = "sum"
    if collective in contracts.ROOTED:
        case["root"] = comm.size - 1 if collective == "broadcast" else comm.size // 2
    if collective == "reduce_scatter":
        case.update(shape=[], counts=[2] * comm.size)  # equal rows: the call gives no counts
    return case


def _args(case):
    """The positional arguments after ``x``."""
    return tuple(case[k] for k in ("op", "root") if k in case)


class Forms:
    """The call forms of one collective on one communicator, each a function of the call's number ``k``.

    A form's function makes one call on data drawn for ``k`` and checks it; the arrays a form keeps (its
    "same arrays") live as long as this object, and so does its persistent request.
    """

    def __init__(self, comm, collective, mpi=False):
        self.comm, self.collective, self.mpi = comm, collective, mpi
        self.kept = {}
        in_place = collectives.get(collective).in_place
        registered = algorithms.for_collective(collective)
        self.forms = {
            "same arrays": lambda k: self.call(k, x="kept", out="kept"),
            "same x, no out": lambda k: self.call(k, x="kept"),
            "same x, new out": lambda k: self.call(k, x="kept", out="new"),
            "new x": lambda k: self.call(k),
            "new x, new out": lambda k: self.call(k, out="new"),
            "timed, same arrays": lambda k: self.call(k, x="kept", out="kept", timeout=30.0),
            "timed, new x": lambda k: self.call(k, timeout=30.0),
            "i-form, new x": lambda k: self.call(k, nonblocking=True),
            "i-form, same arrays": lambda k: self.call(k, x="kept", out="kept", nonblocking=True),
            "persistent": self.persistent,
            "naive, new x": lambda k: self.call(k, algorithm="naive"),
            "float32, new x": lambda k: self.call(k, dtype="float32"),
            "longer, new x": lambda k: self.call(k, count=8),
        }
        if in_place:
            self.forms["in place, same array"] = lambda k: self.call(k, x="kept", out="x")
            self.forms["in place, new array"] = lambda k: self.call(k, out="x")
        if "shm" in registered:  # the node engine's one-sided steps
            self.forms["shm, same arrays"] = lambda k: self.call(k, x="kept", out="kept", algorithm="shm")
        if mpi:
            self.forms["native, same arrays"] = lambda k: self.call(k, x="kept", out="kept", algorithm="native")
            self.forms["native, new x"] = lambda k: self.call(k, algorithm="native")
            self.forms["native i-form, new x"] = lambda k: self.call(k, algorithm="native", nonblocking=True)

    def _want(self, case, rank=None):
        rank = self.comm.rank if rank is None else rank
        return contracts.expected(dict(case, _rank=rank), rank, self.comm.size)

    def _array(self, name, like):
        """The kept array ``name`` (made once, like ``like``)."""
        if name not in self.kept:
            self.kept[name] = np.empty_like(like)
        return self.kept[name]

    def call(self, k, x="new", out=None, timeout=None, nonblocking=False, algorithm=None, dtype="int64", count=5):
        """One call: ``x`` "new" or "kept" (the form's own array, refilled), ``out`` None, "new", "kept" or
        "x" (in place); checks the result against NumPy, that a given ``out`` is the result, and that an
        input not given as ``out`` is untouched."""
        comm, case = self.comm, _case(self.comm, self.collective, k, dtype, count)
        data = contracts.collective_input(case, comm.rank, comm.size)
        want = self._want(case)
        where = (x, out, timeout, nonblocking, algorithm, dtype, count)  # the form: its own kept arrays
        arr = self._array(("x",) + where, data) if x == "kept" else np.empty_like(data)
        arr[...] = data
        target = None
        if self._receives_only(case):  # a scatter's other ranks give no x, and the block to fill as out
            arr, out = None, "new" if out in (None, "x") else out
        if out == "x":
            target = arr
        elif out is not None:  # off the root too (shaped as the root's result), where the call leaves it alone
            like = want if want is not None else self._want(dict(case, _rank=case["root"]), case["root"])
            target = np.empty_like(like) if out == "new" else self._array(("out",) + where, like)
            target[...] = -1
        method = getattr(comm, ("i" if nonblocking else "") + self.collective)
        result = method(arr, *_args(case), out=target, algorithm=algorithm, timeout=timeout)
        if nonblocking:
            result = result.wait()
        self._check(case, result, want, target, out == "x")
        if out != "x" and arr is not None:
            np.testing.assert_array_equal(arr, data, err_msg="the input changed")

    def _receives_only(self, case):
        return self.collective == "scatter" and self.comm.rank != case["root"]

    def persistent(self, k):
        """A persistent request on kept arrays, started and waited."""
        comm, case = self.comm, _case(self.comm, self.collective, k)
        data = contracts.collective_input(case, comm.rank, comm.size)
        want = self._want(case)
        if "request" not in self.kept:
            x = self.kept["px"] = None if self._receives_only(case) else np.empty_like(data)
            out = self.kept["pout"] = None if want is None else np.empty_like(want)
            self.kept["request"] = getattr(comm, self.collective + "_init")(x, *_args(case), out=out)
        if self.kept["px"] is not None:
            self.kept["px"][...] = data
        if self.kept["pout"] is not None:
            self.kept["pout"][...] = -1
        self.kept["request"].start()
        self.kept["request"].wait()
        self._check(case, self.kept["pout"], want, self.kept["pout"])
        if self.kept["px"] is not None:
            np.testing.assert_array_equal(self.kept["px"], data, err_msg="the input changed")

    def _check(self, case, result, want, target, in_place=False):
        if want is None:
            assert result is None, f"expected None off the root, got {result!r}"
            if target is not None and not in_place:
                assert (target == -1).all(), "an out given off the root was written"
            return
        if target is not None:
            assert result is target, "the result is not the out given"
        contracts.assert_matches(dict(case, _rank=self.comm.rank), result, want, self.comm.size)

    def free(self):
        if "request" in self.kept:
            self.kept["request"].free()


def rotate(comm, collective, mpi=False):
    """Every form of ``collective`` after every other (each ordered pair, ``BEFORE`` then ``AFTER`` calls) on
    ``comm``. Returns the settled calls that took a slow path, as ``(first form, second form, call, general
    calls, _fresh calls); a wrong result raises, naming the pair and the call."""
    forms = Forms(comm, collective, mpi)
    general = counting_general_path(comm)
    fresh, stop = counting_fresh(comm)
    slow = []
    seed = 0
    try:
        for first, second in itertools.product(forms.forms, repeat=2):
            for _ in range(BEFORE):
                seed += 1
                forms.forms[first](seed)
            for n in range(AFTER):
                seed += 1
                g, f = len(general), len(fresh)
                try:
                    forms.forms[second](seed)
                except AssertionError as exc:
                    raise AssertionError(f"{collective}, {first!r} then {second!r}, call {n}: {exc}") from exc
                if n >= SETTLED and (len(general) > g or len(fresh) > f):
                    slow.append((first, second, n, general[g:], fresh[f:]))
    finally:
        stop()
        forms.free()
    return slow


# -- the mpi4py face: random sequences on kept buffers, against mpi4py itself ----------------------------------


#: The buffer kinds the face's kept paths tell apart: NumPy arrays (replay memos), and buffers it stages
#: through a kept copy (bytearray, array.array, a memoryview).
FACE_KINDS = ("numpy", "bytearray", "array", "memoryview")

#: collective -> (its send buffer holds a block per rank, its receive buffer does (None: it has none))
FACE_SHAPES = {"Allreduce": (0, 0), "Reduce": (0, 0), "Scan": (0, 0), "Bcast": (0, None), "Allgather": (0, 1),
               "Gather": (0, 1), "Scatter": (1, 0), "Alltoall": (1, 1)}


def _buffer(kind, n):
    """A buffer of ``kind`` holding ``n`` zero doubles (a memoryview: of a NumPy array's)."""
    a = np.zeros(n)
    if kind == "bytearray":
        return bytearray(a.tobytes())
    if kind == "array":
        return array.array("d", a)
    return memoryview(a) if kind == "memoryview" else a


def _copy(buf):
    """A buffer of ``buf``'s kind holding its bytes."""
    if isinstance(buf, memoryview):
        return memoryview(np.frombuffer(buf, np.float64).copy())
    if isinstance(buf, array.array):
        return array.array("d", buf)
    return bytearray(buf) if isinstance(buf, bytearray) else buf.copy()


def _bytes(buf):
    return bytes(memoryview(buf).cast("B"))


def face_rotate(face, raw, calls, seed=11, count=4):
    """``calls`` collective calls through ``face`` (the mpi4py face), each made again by ``raw`` (mpi4py on a
    ``Dup`` of the same communicator) on copies of the same buffers; returns the calls whose buffers differ.

    The calls are drawn alike on every rank from ``seed`` (collective, buffer kinds, spec form ``buf`` /
    ``[buf, T]`` / ``[buf, n, T]`` with ``n`` short of the buffer or not, root, ``MPI.IN_PLACE``, i-form,
    ``None`` off the root), over a pool of two kept buffers per kind and size, so that each buffer comes back in
    other roles, kinds and counts; four calls in ten repeat the last call on new data (the face replays what it
    kept). Each rank's data is new at every call; the whole of both buffers must match mpi4py's, byte for byte
    (what a call does not write must be left as it was).
    """
    from mpi4py import MPI

    rank, size = raw.Get_rank(), raw.Get_size()
    shared, mine = np.random.default_rng(seed), np.random.default_rng([seed, rank])
    pool = {(kind, blocks, i): _buffer(kind, count * size if blocks else count)
            for kind in FACE_KINDS for blocks in (0, 1) for i in (0, 1)}

    def draw():
        collective = str(shared.choice(list(FACE_SHAPES)))
        kinds = [str(k) for k in shared.choice(FACE_KINDS, 2)]
        form = str(shared.choice(["plain", "typed", "counted"]))
        if form == "plain" and "bytearray" in kinds:
            form = "typed"  # (a bytearray alone is bytes: its count would not be the doubles')
        n = count if form != "counted" or shared.random() < 0.5 else int(shared.integers(1, count))
        return dict(collective=collective, kinds=kinds, form=form, n=n, i=int(shared.integers(0, 2)),
                    root=int(shared.integers(0, size)), in_place=bool(shared.random() < 0.3),
                    nonblocking=bool(shared.random() < 0.3), none_off_root=bool(shared.random() < 0.5))

    def spec(buf, c):
        if buf is None or c["form"] == "plain":
            return buf
        return [buf, MPI.DOUBLE] if c["form"] == "typed" else [buf, c["n"], MPI.DOUBLE]

    def make(comm, c, send, recv):
        name, root = c["collective"], c["root"]
        s, r = spec(send, c), spec(recv, c)
        mine_in = MPI.IN_PLACE if c["in_place"] else None
        off = c["none_off_root"] and rank != root
        if name == "Bcast":
            args, kw = (s,), {"root": root}
        elif name in ("Allreduce", "Scan"):
            args, kw = (mine_in or s, r, MPI.SUM), {}
        elif name == "Reduce":
            args, kw = ((mine_in if rank == root and mine_in else s), None if off else r, MPI.SUM), {"root": root}
        elif name in ("Allgather", "Alltoall"):
            args, kw = (mine_in or s, r), {}
        elif name == "Gather":
            args, kw = ((mine_in if rank == root and mine_in else s), None if off else r), {"root": root}
        else:  # Scatter
            args, kw = (None if off else s, (mine_in if rank == root and mine_in else r)), {"root": root}
        if c["nonblocking"]:
            getattr(comm, "I" + name.lower())(*args, **kw).Wait()
        else:
            getattr(comm, name)(*args, **kw)

    differ, last = [], None
    for k in range(calls):
        c = last if last is not None and shared.random() < 0.4 else draw()
        last = c
        send_blocks, recv_blocks = FACE_SHAPES[c["collective"]]
        send = pool[(c["kinds"][0], send_blocks, c["i"])]
        apart = c["kinds"][0] == c["kinds"][1] and send_blocks == recv_blocks  # (then the other of the two)
        recv = None if recv_blocks is None else pool[(c["kinds"][1], recv_blocks, 1 - c["i"] if apart else c["i"])]
        for buf in (send, recv):
            if buf is not None:  # new data (in place: the input; else what must stay where nothing is written)
                view = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, np.float64)
                view[...] = mine.integers(0, 9, view.size)
                del view  # (a view of a bytearray would keep its memory exported)
        send2, recv2 = _copy(send), None if recv is None else _copy(recv)
        make(face, c, send, recv)
        make(raw, c, send2, recv2)
        if _bytes(send) != _bytes(send2) or recv is not None and _bytes(recv) != _bytes(recv2):
            differ.append((k, c))
    return differ
