"""The mpi4py face: mpi4py programs give the same results wrapped as with real mpi4py.

The MPI tests run each call twice in one job -- on the wrapped mpi4py
communicator itself (MPI's own collectives) and on the face (commkit's
algorithms, or mpi4py's own where the face hands a call over) -- from the same
fresh random data, and compare every result byte for byte. The data are small
integers, in every dtype, so that sums in any order are exact.

* ``TABLE`` crosses every collective the face implements with every buffer
  form mpi4py accepts for it and every kind of buffer, rotating dtype, count
  (0 included), in-place (``MPI.IN_PLACE`` and ``None``), blocking or not, and
  ranks that describe their buffers differently; then the calls the face must
  pack (derived datatypes, ``MPI.BOTTOM``) or hand to mpi4py (MAXLOC, user ops,
  reductions over derived types, v-collectives, persistent collectives,
  intercommunicators). It also checks which road each call took. One job per
  process count, 1 to 4.
* ``PROGRAM`` is an mpi4py program using point-to-point, requests and
  communicator management alongside the collectives.
* The examples run with and without their one wrapping line.
"""

from __future__ import annotations

import inspect
import logging
import os
import re

import numpy as np
import pytest

pytest.importorskip("mpi4py")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
EXAMPLES = ["mpi4py_program.py", "mpi4py_sample_sort.py"]


class Legacy:
    """A host DLPack producer that only makes legacy (unversioned) capsules, as older libraries do."""

    def __init__(self, a):
        self.a = a

    def __dlpack__(self, stream=None):
        return self.a.__dlpack__()

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()


class Versioned(Legacy):
    """A DLPack producer that offers nothing but DLPack (versioned capsules), like a CPU tensor."""

    def __dlpack__(self, **kwargs):
        return self.a.__dlpack__(**kwargs)


# The job below defines the same two producers: it runs as a program of its own.
PRODUCERS = inspect.getsource(Legacy) + "\n\n" + inspect.getsource(Versioned)

TABLE = r'''
import array
import logging
import os
import sys

import numpy as np
from mpi4py import MPI

from commkit.compat.mpi4py import wrap

# COMMKIT_FACE_TRACE=1 prints each case before it runs: the last line shows a case that hangs.
TRACE = os.environ.get("COMMKIT_FACE_TRACE")
world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
face = wrap(world)
raw = face.mpi  # the very communicator the face wraps: the face runs its own traffic on private duplicates

''' + PRODUCERS + r'''


class PassCounter(logging.Handler):
    """Counts the face's debug records saying a call ran mpi4py's own method."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.count = 0

    def emit(self, record):
        if "runs mpi4py's" in record.getMessage():
            self.count += 1


passes = PassCounter()
logger = logging.getLogger("commkit.compat.mpi4py")
logger.addHandler(passes)
logger.setLevel(logging.DEBUG)
logger.propagate = False

try:
    import cupy
    HAVE_CUPY = cupy.cuda.runtime.getDeviceCount() > 0
except Exception:
    HAVE_CUPY = False
ON_FACE = False  # whether the run in progress is the face's: mpi4py's own gets host copies of CuPy buffers

DTYPES = [np.dtype(t) for t in ("i4", "f8", "i8", "f4", "u1", "c16")]
ARRAY_CODES = {"i4": "i", "f8": "d", "i8": "q", "f4": "f", "u1": "B"}
TYPED_KINDS = ["numpy", "array", "memoryview", "dlpack", "legacy", "fortran"]
if HAVE_CUPY:
    TYPED_KINDS.append("cupy")
KINDS = TYPED_KINDS + ["bytearray"]
FORMS = ["bare", "typed", "tuple", "code", "count", "displ", "four"]
OPS = {"iu": ["SUM", "PROD", "MAX", "MIN", "BAND", "BOR", "BXOR", "LAND", "LOR", "LXOR"],
       "f": ["SUM", "PROD", "MAX", "MIN"], "c": ["SUM", "PROD"]}


def make(kind, a):
    """The object of ``kind`` over ``a``'s values, and how to read its contents back (as bytes)."""
    if kind == "cupy" and ON_FACE:
        d = cupy.asarray(a)
        return d, lambda: cupy.asnumpy(d).tobytes()
    if kind == "array" and a.dtype.str[1:] in ARRAY_CODES:
        obj = array.array(ARRAY_CODES[a.dtype.str[1:]], a.tobytes())
        return obj, lambda: bytes(obj)
    if kind == "bytearray":
        obj = bytearray(a.tobytes())
        return obj, lambda: bytes(obj)
    if kind == "memoryview":
        return memoryview(a), a.tobytes
    if kind == "dlpack":
        return Versioned(a), a.tobytes
    if kind == "legacy":
        return Legacy(a), a.tobytes
    if kind == "fortran" and a.size % 2 == 0 and a.size:
        f = np.asfortranarray(a.reshape(2, -1, order="F"))  # the same bytes, in Fortran order
        return f, lambda: f.tobytes(order="A")
    return a, a.tobytes


class Case:
    """One collective call, described by the columns of the table."""

    def __init__(self, index, collective, form, kind, dtype, count, inplace, mix, nb):
        self.index, self.collective, self.dtype, self.count = index, collective, dtype, count
        self.inplace = inplace  # False, or the object meaning in place: MPI.IN_PLACE or None
        self.nb = nb
        # Mixed cases give each rank its own buffer form and kind: MPI only asks the type
        # signatures to match, so ranks may describe their buffers differently.
        self.form = FORMS[(FORMS.index(form) + rank) % len(FORMS)] if mix else form
        kinds = TYPED_KINDS if mix else KINDS
        self.kind = kinds[(kinds.index(kind) + 2 * rank) % len(kinds)] if mix else kind
        if self.kind == "bytearray" and self.form == "bare" and collective in REDUCTIONS:
            self.kind = "numpy"  # a bare bytearray holds bytes, but the case's counts are entries of dtype
        ops = OPS["iu" if dtype.kind in "iu" else dtype.kind]
        self.opname = ops[index % len(ops)]
        self.op = getattr(MPI, self.opname)
        self.root = index % size
        self.mix = mix

    def __repr__(self):
        return (f"#{self.index} {self.collective} form={self.form} kind={self.kind} dtype={self.dtype} "
                f"count={self.count} inplace={self.inplace!r} op={self.opname} root={self.root} nb={self.nb}")

    def values(self, rng, n):
        if self.opname == "PROD":
            v = rng.integers(-3, 4, n) if self.dtype.kind != "u" else rng.integers(0, 4, n)
        elif self.dtype.kind == "u":
            v = rng.integers(0, 60, n)
        else:
            v = rng.integers(-60, 61, n)
        return v.astype(self.dtype)

    def buf(self, rng, blocks=1, fill="sentinel", count=None, own=None, undefined=None):
        """A buffer spec of this case's form and kind with room for ``blocks`` blocks, and its reader.

        ``fill``: "data" (fresh values everywhere) or "sentinel"; ``own``: a block
        index to fill with data in a sentinel buffer (the in-place block);
        ``undefined``: a range of entries of the message that MPI leaves undefined
        (the reader blanks them).
        """
        count = self.count if count is None else count
        n = count * max(blocks, 1)
        exact = self.form in ("bare", "typed", "tuple", "code")
        displ = 0 if exact or self.form == "count" else 2
        pad = 0 if exact else 3
        a = np.full(displ + n + pad, 7, self.dtype)
        if fill == "data":
            a[displ:displ + n] = self.values(rng, n)
        if own is not None:
            a[displ + own * count:displ + (own + 1) * count] = self.values(rng, count)
        obj, raw_read = make(self.kind, a)

        def read():
            values = np.frombuffer(raw_read(), self.dtype).copy()
            if undefined is not None:
                values[displ + undefined[0]:displ + undefined[1]] = 0
            return (values + 0).tobytes()  # + 0 turns -0.0 into 0.0: its sign depends on the reduction order

        t = MPI._typedict[self.dtype.char]
        spec = {"bare": obj, "typed": [obj, t], "tuple": (obj, t), "code": [obj, self.dtype.str[1:]],
                "count": [obj, count, t], "displ": [obj, (count, displ), t], "four": (obj, count, displ, t)}
        return spec[self.form], read

    def call(self, comm, name, *args, **kwargs):
        if self.nb:
            getattr(comm, "I" + name.lower())(*args, **kwargs).Wait()
        else:
            getattr(comm, name)(*args, **kwargs)


def bcast(comm, c, rng):
    s, read = c.buf(rng, fill="data" if rank == c.root else "sentinel")
    c.call(comm, "Bcast", s, root=c.root)
    return [read()]


def rooted_reduce(comm, c, rng):
    if rank != c.root:
        send, _ = c.buf(rng, fill="data")
        c.call(comm, "Reduce", send, None if c.index % 2 else c.buf(rng)[0], op=c.op, root=c.root)
        return []
    recv, read = c.buf(rng, fill="data" if c.inplace is not False else "sentinel")
    send = c.inplace if c.inplace is not False else c.buf(rng, fill="data")[0]
    c.call(comm, "Reduce", send, recv, op=c.op, root=c.root)
    return [read()]


def reduction(name):
    def run(comm, c, rng):
        recv, read = c.buf(rng, fill="data" if c.inplace is not False else "sentinel")
        send = c.inplace if c.inplace is not False else c.buf(rng, fill="data")[0]
        c.call(comm, name, send, recv, op=c.op)
        return [read()]
    return run


def gather(comm, c, rng):
    if rank != c.root:
        send, _ = c.buf(rng, fill="data")
        c.call(comm, "Gather", send, None if c.index % 2 else c.buf(rng)[0], root=c.root)
        return []
    in_place = c.inplace is not False
    recv, read = c.buf(rng, blocks=size, own=rank if in_place else None)
    send = c.inplace if in_place else c.buf(rng, fill="data")[0]
    c.call(comm, "Gather", send, recv, root=c.root)
    return [read()]


def scatter(comm, c, rng):
    if rank != c.root:
        recv, read = c.buf(rng)
        c.call(comm, "Scatter", None if c.index % 2 else c.buf(rng)[0], recv, root=c.root)
        return [read()]
    send, read_send = c.buf(rng, blocks=size, fill="data")
    if c.inplace is not False:
        c.call(comm, "Scatter", send, c.inplace, root=c.root)
        return [read_send()]
    recv, read = c.buf(rng)
    c.call(comm, "Scatter", send, recv, root=c.root)
    return [read(), read_send()]


def allgather(comm, c, rng):
    in_place = c.inplace is not False
    recv, read = c.buf(rng, blocks=size, own=rank if in_place else None)
    send = c.inplace if in_place else c.buf(rng, fill="data")[0]
    c.call(comm, "Allgather", send, recv)
    return [read()]


def alltoall(comm, c, rng):
    in_place = c.inplace is not False
    recv, read = c.buf(rng, blocks=size, fill="data" if in_place else "sentinel")
    send = c.inplace if in_place else c.buf(rng, blocks=size, fill="data")[0]
    c.call(comm, "Alltoall", send, recv)
    return [read()]


def reduce_scatter_block(comm, c, rng):
    if c.inplace is not False:  # the result lands in the first block; MPI leaves the others undefined
        recv, read = c.buf(rng, blocks=size, fill="data", undefined=(c.count, c.count * size))
        c.call(comm, "Reduce_scatter_block", c.inplace, recv, op=c.op)
        return [read()]
    recv, read = c.buf(rng)
    send, _ = c.buf(rng, blocks=size, fill="data")
    c.call(comm, "Reduce_scatter_block", send, recv, op=c.op)
    return [read()]


def reduce_scatter(comm, c, rng):
    counts = [c.count + (i % 3) for i in range(size)]
    if c.inplace is not False:
        recv, read = c.buf(rng, fill="data", count=sum(counts), undefined=(counts[rank], sum(counts)))
        c.call(comm, "Reduce_scatter", c.inplace, recv, counts, op=c.op)
        return [read()]
    recv, read = c.buf(rng, count=counts[rank])
    send, _ = c.buf(rng, fill="data", count=sum(counts))
    c.call(comm, "Reduce_scatter", send, recv, counts if c.index % 2 else None, op=c.op)
    return [read()]


COLLECTIVES = {
    "Bcast": (bcast, False), "Reduce": (rooted_reduce, "root"), "Allreduce": (reduction("Allreduce"), True),
    "Scan": (reduction("Scan"), True), "Exscan": (reduction("Exscan"), True), "Gather": (gather, "root"),
    "Scatter": (scatter, "root"), "Allgather": (allgather, True), "Alltoall": (alltoall, True),
    "Reduce_scatter_block": (reduce_scatter_block, True), "Reduce_scatter": (reduce_scatter, True),
}
REDUCTIONS = {"Reduce", "Allreduce", "Scan", "Exscan", "Reduce_scatter_block", "Reduce_scatter"}


def table():
    """Every collective x buffer form x buffer kind, with dtype, count, in-place, mixing and the
    nonblocking form rotating along the rows (each pair of columns meets more than once)."""
    cases = []
    counts = [3, 1, 0, 5, 2]
    for collective, (run, in_place_ok) in COLLECTIVES.items():
        for f, form in enumerate(FORMS):
            for k, kind in enumerate(KINDS):
                i = len(cases)
                dtype = DTYPES[(f + k + i) % len(DTYPES)]
                inplace = False
                if in_place_ok and (f + k) % 2:
                    inplace = MPI.IN_PLACE if (f + k) % 4 == 1 else None
                mix = (f * len(KINDS) + k) % 3 == 0 and kind != "bytearray"
                cases.append((run, Case(i, collective, form, kind, dtype, counts[i % len(counts)], inplace, mix,
                                        nb=i % 3 == 1), False))
    return cases


# -- what the face hands to mpi4py, and what it must still run itself --------------------------


def derived_bcast(comm, c, rng):
    """An indexed-block datatype on every rank: MPI packs it, commkit moves the bytes."""
    a = np.full(12, -1, np.int32)
    if rank == c.root:
        a[:] = rng.integers(0, 100, 12)
    t = MPI.INT.Create_indexed_block(2, [0, 3, 7]).Commit()
    try:
        c.call(comm, "Bcast", (a, 1, t), root=c.root)
    finally:
        t.Free()
    return [a.tobytes()]


def column_type(rows, cols):
    column = MPI.DOUBLE.Create_vector(rows, 1, cols)
    resized = column.Create_resized(0, MPI.DOUBLE.Get_size())
    column.Free()
    return resized.Commit()


def gather_columns(comm, c, rng):
    """The textbook pattern: the root receives columns through a vector type, the others send doubles."""
    rows = 3
    col = rng.integers(-9, 10, rows).astype(np.float64)
    if rank != c.root:
        c.call(comm, "Gather", [col, rows, MPI.DOUBLE], None, root=c.root)
        return []
    matrix = np.full((rows, size), -1.0)
    t = column_type(rows, size)
    try:
        c.call(comm, "Gather", [col, rows, MPI.DOUBLE], [matrix, 1, t], root=c.root)
    finally:
        t.Free()
    return [matrix.tobytes()]


def scatter_columns(comm, c, rng):
    rows = 2
    col = np.full(rows, -1.0)
    if rank != c.root:
        c.call(comm, "Scatter", None, [col, rows, MPI.DOUBLE], root=c.root)
        return [col.tobytes()]
    matrix = rng.integers(-9, 10, (rows, size)).astype(np.float64)
    t = column_type(rows, size)
    try:
        c.call(comm, "Scatter", [matrix, 1, t], [col, rows, MPI.DOUBLE], root=c.root)
    finally:
        t.Free()
    return [col.tobytes()]


def allgather_mixed_types(comm, c, rng):
    """Even ranks describe their blocks with a contiguous datatype, odd ranks with plain ints."""
    x = rng.integers(0, 99, 4).astype(np.int32)
    out = np.full(4 * size, -1, np.int32)
    pair = MPI.INT.Create_contiguous(2).Commit()
    try:
        send = [x, 2, pair] if rank % 2 == 0 else [x, 4, MPI.INT]
        recv = [out, 2, pair] if rank % 2 == 1 else [out, 4, MPI.INT]
        c.call(comm, "Allgather", send, recv)
    finally:
        pair.Free()
    return [out.tobytes()]


def alltoall_derived(comm, c, rng):
    x = rng.integers(0, 99, 2 * size).astype(np.int64)
    out = np.full(2 * size, -1, np.int64)
    pair = MPI.INT64_T.Create_contiguous(2).Commit()
    try:
        c.call(comm, "Alltoall", [x, 1, pair] if rank == 0 else x, [out, 1, pair] if rank == size - 1 else out)
    finally:
        pair.Free()
    return [out.tobytes()]


def bcast_bottom(comm, c, rng):
    """MPI.BOTTOM with a struct datatype of absolute addresses: an int array and a double array."""
    ints = np.full(3, -1, np.int32)
    reals = np.full(2, -1.0)
    if rank == c.root:
        ints[:] = rng.integers(0, 50, 3)
        reals[:] = rng.integers(0, 50, 2)
    t = MPI.Datatype.Create_struct([3, 2], [MPI.Get_address(ints), MPI.Get_address(reals)],
                                   [MPI.INT, MPI.DOUBLE]).Commit()
    try:
        c.call(comm, "Bcast", [MPI.BOTTOM, 1, t], root=c.root)
    finally:
        t.Free()
    return [ints.tobytes(), reals.tobytes()]


def maxloc(comm, c, rng):
    pairs = np.zeros(3, dtype=np.dtype([("value", "f8"), ("index", "i4")], align=True))
    pairs["value"] = rng.integers(0, 5, 3)
    pairs["index"] = rank
    out = np.zeros_like(pairs)
    c.call(comm, "Allreduce", [pairs, MPI.DOUBLE_INT], [out, MPI.DOUBLE_INT], op=MPI.MAXLOC)
    return [out["value"].tobytes(), out["index"].tobytes()]  # not the padding, which MPI may fill with anything


def user_op(comm, c, rng):
    def absmax(inbuf, inoutbuf, datatype):
        a = np.frombuffer(inbuf, np.int64)
        b = np.frombuffer(inoutbuf, np.int64)
        np.copyto(b, np.where(np.abs(a) > np.abs(b), a, b))

    op = MPI.Op.Create(absmax, commute=True)
    try:
        x = rng.integers(-50, 50, 5)
        out = np.zeros(5, np.int64)
        c.call(comm, "Allreduce", x, out, op=op)
    finally:
        op.Free()
    return [out.tobytes()]


def derived_reduction(comm, c, rng):
    """A reduction over a derived datatype runs MPI's: the same result, or the same error, on every rank."""
    x = rng.integers(-9, 9, 4)
    out = np.zeros(4, np.int64)
    pair = MPI.INT64_T.Create_contiguous(2).Commit()
    try:
        c.call(comm, "Allreduce", [x, 2, pair], [out, 2, pair], op=MPI.SUM)
    except MPI.Exception as exc:
        return [f"MPI.Exception {exc.Get_error_class()}".encode()]
    finally:
        pair.Free()
    return [out.tobytes()]


def float_logical(comm, c, rng):
    """MPI.LAND on doubles: MPI's answer (an error in MPICH), on every rank alike."""
    x = rng.integers(0, 2, 3).astype(np.float64)
    out = np.zeros(3)
    try:
        c.call(comm, "Allreduce", x, out, op=MPI.LAND)
    except MPI.Exception as exc:
        return [f"MPI.Exception {exc.Get_error_class()}".encode()]
    return [out.tobytes()]


def persistent(comm, c, rng):
    x = rng.integers(-9, 9, 4)
    out = np.zeros(4, np.int64)
    b = rng.integers(0, 9, 3) if rank == c.root else np.zeros(3, np.int64)
    try:
        requests = [comm.Allreduce_init(x, out, op=MPI.SUM), comm.Bcast_init(b, root=c.root)]
    except NotImplementedError:  # an MPI library older than MPI-4
        return [b"no persistent collectives"]
    results = []
    for _ in range(2):
        MPI.Prequest.Startall(requests)
        MPI.Request.Waitall(requests)
        results += [out.tobytes(), b.tobytes()]
        x += 1
    for r in requests:
        r.Free()
    return results


def intercomm(comm, c, rng):
    """Two halves joined by an intercommunicator: the wrapped one runs MPI's collectives."""
    if size < 2:
        return []
    half = comm.Split(rank % 2, rank)
    inter = half.Create_intercomm(0, comm if not hasattr(comm, "mpi") else comm.mpi, 1 - rank % 2, 5)
    if hasattr(comm, "mpi"):
        inter = wrap(inter)
    x = rng.integers(0, 9, 3)
    out = np.zeros(3, np.int64)
    inter.Allreduce(x, out, op=MPI.SUM)
    b = np.arange(4) * 10 if rank == 0 else np.zeros(4, np.int64)
    if rank % 2 == 0:
        inter.Bcast(b, root=MPI.ROOT if rank == 0 else MPI.PROC_NULL)
    else:
        inter.Bcast(b, root=0)
    inter.Free()
    half.Free()
    return [out.tobytes(), b.tobytes()]


def vector(name):
    """A v-collective (passed to mpi4py) in every buffer form mpi4py takes for it."""
    def run(comm, c, rng):
        counts = [1 + (i + c.index) % 3 for i in range(size)]
        displs = [sum(counts[:i]) + i for i in range(size)]  # a gap before each block
        span = displs[-1] + counts[-1] + 1
        form = c.form
        if form in ("typed", "bare"):  # inferred counts: mpi4py splits the buffer evenly
            counts = [2] * size
            displs = [2 * i for i in range(size)]
            span = 2 * size

        def vspec(a):
            t = MPI.INT64_T
            return {"four": [a, counts, displs, t], "displ": [a, (counts, displs), t], "count": [a, counts, t],
                    "typed": [a, t], "bare": a, "tuple": (a, (counts, displs), t)}[form]

        if form == "count":
            displs = [sum(counts[:i]) for i in range(size)]
            span = sum(counts)
        mine = counts[rank]
        own = rng.integers(0, 99, mine)
        if name == "Allgatherv":
            out = np.full(span, -1, np.int64)
            c.call(comm, "Allgatherv", own, vspec(out))
            return [out.tobytes()]
        if name == "Gatherv":
            out = np.full(span, -1, np.int64)
            c.call(comm, "Gatherv", own, vspec(out) if rank == c.root else None, root=c.root)
            return [out.tobytes()]
        if name == "Scatterv":
            data = rng.integers(0, 99, span)
            got = np.full(mine, -1, np.int64)
            c.call(comm, "Scatterv", vspec(data) if rank == c.root else None, got, root=c.root)
            return [got.tobytes()]
        # Alltoallv: rank r sends counts[j] + r % 2 ... keep it symmetric: everyone sends counts[j] to j
        # and receives counts[rank] from everyone.
        scounts = counts
        sdispls = displs
        rcounts = [mine] * size
        rdispls = [mine * j for j in range(size)]
        data = rng.integers(0, 99, span)
        out = np.full(mine * size, -1, np.int64)
        send = vspec(data)
        c.call(comm, "Alltoallv", send, [out, rcounts, rdispls, MPI.INT64_T])
        return [out.tobytes()]
    return run


def specials():
    cases = []
    rows = [
        (derived_bcast, False), (gather_columns, False), (scatter_columns, False), (allgather_mixed_types, False),
        (alltoall_derived, False), (bcast_bottom, False), (maxloc, True), (user_op, True),
        (derived_reduction, True), (float_logical, True), (persistent, None), (intercomm, None),
    ]
    for run, passes_through in rows:
        for nb in (False, True):
            if passes_through is None and nb:
                continue
            i = 1000 + len(cases)
            case = Case(i, run.__name__, "bare", "numpy", np.dtype("i8"), 1, False, False, nb)
            cases.append((run, case, passes_through))
    for name in ("Allgatherv", "Gatherv", "Scatterv", "Alltoallv"):
        for form in ("four", "displ", "count", "typed", "bare", "tuple"):
            if name == "Alltoallv" and form in ("typed", "bare"):
                continue  # the send side's counts cannot be inferred to match the receive side's
            i = 1000 + len(cases)
            cases.append((vector(name), Case(i, name, form, "numpy", np.dtype("i8"), 1, False, False,
                                             nb=i % 2 == 1), None))
    return cases


def main(seed):
    global ON_FACE
    failures, ran = [], 0
    for run, case, passes_through in table() + specials():
        results = []
        if TRACE:
            print(f"rank {rank} {case}", flush=True)
        for comm in (raw, face):
            ON_FACE = comm is face
            before = passes.count
            rng = np.random.default_rng([seed, case.index, rank])
            results.append(run(comm, case, rng))
        passed = passes.count - before
        ran += 1
        if results[0] != results[1]:
            failures.append(f"{case}: mpi4py {results[0]} face {results[1]}")
        if passes_through is False and passed:
            failures.append(f"{case}: the face handed this call to mpi4py")
        if passes_through is True and not passed:
            failures.append(f"{case}: the face ran this call itself")
    for line in failures:
        print(f"rank {rank} FAILED {line}")
    print(f"rank {rank}: {ran - len(failures)} of {ran} cases identical")
    sys.stdout.flush()


if __name__ == "__main__":
    main(int(sys.argv[1]))
'''


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
def test_every_buffer_form_and_kind_matches_mpi4py(mpi, nprocs):
    seed = int(np.random.SeedSequence().entropy % 2**32)
    result = mpi(nprocs, TABLE, args=(seed,), timeout=240)
    counts = re.findall(r"rank \d+: (\d+) of (\d+) cases identical", result.stdout)
    assert len(counts) == nprocs, (seed, result.stdout, result.stderr)
    assert all(done == total and int(total) > 500 for done, total in counts), (seed, result.stdout)


# The mpi4py-style program. It takes the communicator and the Waitall to use
# (MPI.Request.Waitall for real mpi4py, the face's Request.Waitall wrapped,
# since that one list mixes collective and point-to-point requests).
PROGRAM = r'''
import sys
import numpy as np
from mpi4py import MPI
from commkit.compat.mpi4py import Request, wrap


def program(comm, waitall, seed):
    rank, size = comm.Get_rank(), comm.Get_size()
    rng = np.random.default_rng([seed, rank])
    out = {}
    ints = lambda n: rng.integers(-1000, 1000, n, dtype=np.int64)
    root = size - 1

    # Bcast: plain array, [buf, datatype], [buf, count, datatype], a bytearray.
    a = ints(5) if rank == 0 else np.zeros(5, np.int64)
    comm.Bcast(a, root=0); out["bcast"] = a
    b = rng.random(4) if rank == root else np.zeros(4)
    comm.Bcast([b, MPI.DOUBLE], root=root); out["bcast_typed"] = b
    c = np.full(6, -1, np.int32)
    if rank == 0:
        c[:3] = [7, 8, 9]
    comm.Bcast([c, 3, MPI.INT], root=0); out["bcast_count"] = c     # only the first 3 move
    raw = bytearray(rng.integers(0, 255, 8, dtype=np.uint8).tobytes() if rank == 1 % size else bytes(8))
    comm.Bcast(raw, root=1 % size); out["bcast_bytearray"] = np.frombuffer(raw, np.uint8).copy()

    # Allreduce: every builtin op, IN_PLACE, counts and displacements.
    x = ints(11)
    for name in ("SUM", "MAX", "MIN", "BAND", "BOR", "BXOR", "LAND", "LOR", "LXOR"):
        r = np.empty_like(x)
        comm.Allreduce(x % 7 if name.startswith("L") else x, r, op=getattr(MPI, name))
        out["allreduce_" + name] = r
    small = rng.integers(-3, 4, 6).astype(np.int32)
    r = np.empty_like(small); comm.Allreduce([small, MPI.INT], [r, MPI.INT], MPI.PROD); out["allreduce_prod"] = r
    f = rng.standard_normal(9)
    r = np.zeros(9); comm.Allreduce([f, MPI.DOUBLE], [r, MPI.DOUBLE], op=MPI.SUM); out["allreduce_float"] = r
    inplace = ints(10)
    comm.Allreduce(MPI.IN_PLACE, inplace, op=MPI.SUM); out["allreduce_in_place"] = inplace
    part = ints(8)
    comm.Allreduce(MPI.IN_PLACE, [part, 3, MPI.INT64_T], op=MPI.MAX); out["allreduce_count"] = part
    disp = ints(8)
    comm.Allreduce(MPI.IN_PLACE, [disp, (3, 2), MPI.INT64_T], op=MPI.SUM); out["allreduce_displ"] = disp
    matrix = rng.standard_normal((3, 4)).astype(np.float32)
    r = np.zeros((3, 4), np.float32); comm.Allreduce(matrix, r, MPI.MIN); out["allreduce_2d"] = r
    fortran = np.asfortranarray(ints(6).reshape(2, 3))
    comm.Allreduce(MPI.IN_PLACE, fortran, MPI.SUM); out["allreduce_fortran"] = fortran

    # Reduce: plain, IN_PLACE at the root, recvbuf=None elsewhere.
    x = ints(7)
    r = np.full(7, -5, np.int64) if rank == root else None
    comm.Reduce(x, r, op=MPI.SUM, root=root); out["reduce"] = r if rank == root else np.zeros(0)
    y = ints(5)
    if rank == 0:
        comm.Reduce(MPI.IN_PLACE, y, op=MPI.MAX, root=0)
    else:
        comm.Reduce(y, None, op=MPI.MAX, root=0)
    out["reduce_in_place"] = y

    # Gather: plain, a per-process count in a larger buffer, IN_PLACE.
    x = ints(3)
    r = np.full(size * 3, -1, np.int64) if rank == root else None
    comm.Gather(x, r, root=root); out["gather"] = r if rank == root else np.zeros(0)
    x = ints(2).astype(np.int32)
    r = np.full(size * 2 + 3, -1, np.int32)
    comm.Gather([x, MPI.INT], [r, 2, MPI.INT], root=0); out["gather_count"] = r
    g = np.full(size * 4, -1, np.int64)
    g[rank * 4:(rank + 1) * 4] = ints(4)
    if rank == 0:
        comm.Gather(MPI.IN_PLACE, g, root=0)
    else:
        comm.Gather(g[rank * 4:(rank + 1) * 4].copy(), None, root=0)
    out["gather_in_place"] = g

    # Scatter: plain, IN_PLACE at the root.
    s = ints(size * 3) if rank == 0 else None
    r = np.zeros(3, np.int64); comm.Scatter(s, r, root=0); out["scatter"] = r
    s = rng.standard_normal(size * 2) if rank == root else None
    if rank == root:
        comm.Scatter([s, MPI.DOUBLE], MPI.IN_PLACE, root=root); out["scatter_in_place"] = s
    else:
        r = np.zeros(2); comm.Scatter(None, [r, MPI.DOUBLE], root=root); out["scatter_in_place"] = r

    # Allgather and Alltoall: plain and IN_PLACE.
    x = ints(3)
    r = np.zeros(size * 3, np.int64); comm.Allgather(x, r); out["allgather"] = r
    r = np.zeros((size, 2), np.int64); r[rank] = ints(2)
    comm.Allgather(MPI.IN_PLACE, r); out["allgather_in_place"] = r
    x = ints(size * 2)
    r = np.zeros(size * 2, np.int64); comm.Alltoall(x, r); out["alltoall"] = r
    r = ints(size * 3)
    comm.Alltoall(MPI.IN_PLACE, [r, MPI.INT64_T]); out["alltoall_in_place"] = r

    # Reduce_scatter_block and Reduce_scatter: plain, IN_PLACE, uneven and gathered counts.
    x = ints(size * 3)
    r = np.zeros(3, np.int64); comm.Reduce_scatter_block(x, r, op=MPI.SUM); out["rsb"] = r
    r = ints(size * 2)
    comm.Reduce_scatter_block(MPI.IN_PLACE, r, op=MPI.BXOR); out["rsb_in_place"] = r
    counts = [(i % 3) + 1 for i in range(size)]
    x = ints(sum(counts))
    r = np.zeros(counts[rank], np.int64); comm.Reduce_scatter(x, r, counts, MPI.SUM); out["rs"] = r
    r = np.zeros(counts[rank], np.int64); comm.Reduce_scatter(x, r, op=MPI.MAX); out["rs_inferred"] = r
    r = ints(sum(counts))
    comm.Reduce_scatter(MPI.IN_PLACE, r, counts, MPI.SUM); out["rs_in_place"] = r

    # Scan and Exscan. Rank 0's Exscan result is undefined in MPI; MPICH leaves the
    # buffer as it was, and so does the face, so its sentinel is compared too.
    x = ints(5)
    r = np.zeros(5, np.int64); comm.Scan(x, r, MPI.SUM); out["scan"] = r
    r = ints(4); comm.Scan(MPI.IN_PLACE, r, MPI.MAX); out["scan_in_place"] = r
    r = np.full(5, 12345, np.int64); comm.Exscan(x, r, MPI.SUM)
    out["exscan"] = r
    r = ints(4); comm.Exscan(MPI.IN_PLACE, r, MPI.MIN); out["exscan_in_place"] = r

    # Point to point and requests: a ring with Sendrecv, then Isend/Irecv mixed
    # with nonblocking collectives in one Waitall.
    right, left = (rank + 1) % size, (rank - 1) % size
    send, recv = ints(4), np.zeros(4, np.int64)
    status = MPI.Status()
    comm.Sendrecv(send, right, 3, recv, left, 3, status); out["sendrecv"] = recv
    out["sendrecv_count"] = np.array([status.Get_source(), status.Get_count(MPI.INT64_T)])
    got, total, shared = np.zeros(6), ints(5), (rng.random(3) if rank == 0 else np.zeros(3))
    requests = [comm.Irecv([got, MPI.DOUBLE], left, 9), comm.Isend([rng.random(6), MPI.DOUBLE], right, 9)]
    requests += [comm.Iallreduce(MPI.IN_PLACE, total, MPI.SUM), comm.Ibcast(shared, root=0)]
    waitall(requests)
    out["irecv"], out["iallreduce"], out["ibcast"] = got, total, shared
    gathered = np.zeros(size, np.int64)
    comm.Ialltoall(ints(size), gathered).Wait(); out["ialltoall"] = gathered
    comm.Barrier()

    # Split (with MPI.UNDEFINED), Dup and Free.
    sub = comm.Split(rank % 2, -rank)
    v = np.array([rank, sub.Get_rank(), sub.Get_size()], np.int64)
    sub.Allreduce(MPI.IN_PLACE, v, MPI.SUM); out["split"] = v
    sub.Free()
    none = comm.Split(MPI.UNDEFINED if rank == 0 else 0, 0)
    out["split_undefined"] = np.array([none == MPI.COMM_NULL])
    if none != MPI.COMM_NULL:
        none.Free()
    dup = comm.Dup()
    v = ints(3); dup.Allreduce(MPI.IN_PLACE, v, MPI.SUM); out["dup"] = v
    dup.Free()
    return out


if __name__ == "__main__":
    seed = int(sys.argv[1])
    expected = program(MPI.COMM_WORLD, MPI.Request.Waitall, seed)
    comm = wrap(MPI.COMM_WORLD)
    got = program(comm, Request.Waitall, seed)
    assert comm.comm.last_algorithm != "native", comm.comm.last_algorithm
    assert expected.keys() == got.keys()
    for key in expected:
        e, g = np.asarray(expected[key]), np.asarray(got[key])
        assert e.dtype == g.dtype and e.shape == g.shape, (key, e.dtype, g.dtype, e.shape, g.shape)
        if e.dtype.kind == "f":
            assert np.allclose(e, g, rtol=1e-5 if e.dtype.itemsize == 4 else 1e-12), (key, e, g)
        else:
            assert np.array_equal(e, g), (key, e, g)
    print(f"rank {MPI.COMM_WORLD.Get_rank()}: {len(expected)} results identical")
'''


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [3, 4])
def test_program_matches_real_mpi4py(mpi, nprocs):
    seed = int(np.random.SeedSequence().entropy % 2**32)
    result = mpi(nprocs, PROGRAM, args=(seed,), timeout=180)
    assert result.stdout.count("results identical") == nprocs, (seed, result.stdout, result.stderr)


@pytest.mark.mpi
@pytest.mark.parametrize("example", EXAMPLES)
def test_example_program_runs_unchanged_but_for_one_line(mpi, example):
    """Each example runs as plain mpi4py without its wrapping line, and prints the same with it."""
    with open(os.path.join(ROOT, "examples", example)) as f:
        source = f.read()
    wrapping = [line for line in source.splitlines() if "wrap(" in line and not line.lstrip().startswith("#")]
    assert len(wrapping) == 1, wrapping
    plain = source.replace(wrapping[0] + "\n", "")
    outputs = []
    for code in (plain, source):
        result = mpi(3, code, timeout=120)
        outputs.append(sorted(result.stdout.splitlines()))
    assert outputs[0], "the example printed nothing"
    assert outputs[0] == outputs[1]


# -- single-process checks (COMM_SELF, one rank, in this process) -------------------------------


@pytest.fixture(scope="module")
def face():
    from mpi4py import MPI

    from commkit.compat.mpi4py import wrap

    return MPI, wrap(MPI.COMM_SELF)


@pytest.fixture
def debug_log(caplog):
    caplog.set_level(logging.DEBUG, logger="commkit.compat.mpi4py")
    return caplog


def test_one_rank_collectives_copy_like_mpi(face):
    MPI, comm = face
    x = np.random.default_rng().integers(-50, 50, 6)
    r = np.zeros_like(x)
    comm.Allreduce(x, r, op=MPI.SUM)
    assert np.array_equal(r, x)
    r = np.zeros(6, np.int64)
    comm.Allgather([x, 6, MPI.INT64_T], r)
    assert np.array_equal(r, x)
    assert comm.Get_rank() == 0 and comm.Get_size() == 1


def test_none_means_in_place_where_mpi4py_reads_it_so(face, debug_log):
    MPI, comm = face
    x = np.random.default_rng().integers(-50, 50, 5)
    buf = x.copy()
    comm.Allgather(None, buf)
    comm.Gather(None, buf, root=0)
    comm.Scatter([buf, MPI.INT64_T], None, root=0)
    comm.Allreduce(None, buf, op=MPI.MAX)
    comm.Reduce(None, buf, op=MPI.SUM, root=0)
    assert np.array_equal(buf, x)
    assert "runs mpi4py's" not in debug_log.text  # commkit ran every one of them


def test_derived_datatypes_move_through_mpi_pack(face, debug_log):
    """A data-movement collective with a derived datatype runs commkit on the bytes MPI packs."""
    MPI, comm = face
    indexed = MPI.INT.Create_indexed_block(2, [0, 3, 7]).Commit()
    try:
        a = np.arange(12, dtype=np.int32)
        comm.Bcast((a, 1, indexed), root=0)
        assert np.array_equal(a, np.arange(12))
        out = np.full(12, -1, np.int32)
        comm.Allgather([a, 1, indexed], [out, 1, indexed])
        expected = np.full(12, -1, np.int32)
        expected[[0, 1, 3, 4, 7, 8]] = a[[0, 1, 3, 4, 7, 8]]
        assert np.array_equal(out, expected)
    finally:
        indexed.Free()
    assert "MPI packs it" in debug_log.text and "runs mpi4py's" not in debug_log.text


def test_what_commkit_cannot_reduce_runs_mpi4py_and_says_why(face, debug_log):
    MPI, comm = face
    pairs = np.zeros(2, dtype=np.dtype([("value", "f8"), ("index", "i4")], align=True))
    pairs["value"], pairs["index"] = [3.0, 1.0], [0, 0]
    out = np.zeros_like(pairs)
    comm.Allreduce([pairs, MPI.DOUBLE_INT], [out, MPI.DOUBLE_INT], op=MPI.MAXLOC)
    assert out["value"].tolist() == [3.0, 1.0]
    assert "runs mpi4py's Allreduce" in debug_log.text and "MAXLOC" in debug_log.text

    op = MPI.Op.Create(lambda a, b, t: None, commute=True)
    try:
        x = np.arange(3)
        comm.Iallreduce(MPI.IN_PLACE, x, op=op).Wait()  # an MPI.Request: the same call as mpi4py's
    finally:
        op.Free()
    assert "runs mpi4py's Iallreduce" in debug_log.text

    pair = MPI.INT64_T.Create_contiguous(2).Commit()
    x = np.arange(4)
    try:
        with pytest.raises(MPI.Exception) as raised:  # MPI's own answer, as mpi4py gives it
            comm.Allreduce(MPI.IN_PLACE, [x, 2, pair], op=MPI.SUM)
    finally:
        pair.Free()
    with pytest.raises(MPI.Exception) as expected:
        MPI.COMM_SELF.Allreduce(MPI.IN_PLACE, [x, 2, MPI.INT64_T.Create_contiguous(2).Commit()], op=MPI.SUM)
    assert raised.value.Get_error_class() == expected.value.Get_error_class()


def test_buffer_spec_errors_name_what_was_expected(face):
    from commkit.errors import InvalidBuffer

    MPI, comm = face
    x = np.arange(4, dtype=np.int64)
    with pytest.raises(InvalidBuffer, match="mismatch in send count 4 and receive count 3"):
        comm.Allreduce(x, np.zeros(3, np.int64))
    with pytest.raises(InvalidBuffer, match="datatypes"):
        comm.Allreduce(x, np.zeros(4, np.float64))
    with pytest.raises(InvalidBuffer, match="count asks for 9 .* holds 4"):
        comm.Allreduce(MPI.IN_PLACE, [x, 9, MPI.INT64_T])
    with pytest.raises(InvalidBuffer, match="read-only"):
        comm.Allreduce(x, _readonly(4))
    with pytest.raises(InvalidBuffer, match="read-only"):
        comm.Allgather(x, _readonly(4))
    with pytest.raises(InvalidBuffer, match="contiguous"):
        comm.Allreduce(MPI.IN_PLACE, np.zeros(8, np.int64)[::2])
    with pytest.raises(InvalidBuffer, match="2 to 4 items"):
        comm.Bcast([x])
    with pytest.raises(InvalidBuffer, match="got None"):
        comm.Bcast(None)
    with pytest.raises(InvalidBuffer, match="5 bytes is not a multiple of the int32 size 4"):
        comm.Allreduce(MPI.IN_PLACE, [bytearray(5), MPI.INT])
    with pytest.raises(TypeError):  # mpi4py's own error, from the spec only mpi4py could have read
        comm.Bcast([object(), 1, MPI.INT], root=0)


def _readonly(n):
    a = np.zeros(n, np.int64)
    a.setflags(write=False)
    return a


def test_unknown_attributes_fall_through_to_mpi4py(face):
    MPI, comm = face
    assert comm.Get_name() == MPI.COMM_SELF.Get_name()
    assert comm.allreduce(3) == 3  # mpi4py's pickle-based method
    assert re.search("rank 0 of 1", repr(comm))
    out = np.zeros(3, np.int64)
    comm.Allgatherv(np.arange(3), [out, [3], [0], MPI.INT64_T])  # a v-collective: MPI's own
    assert out.tolist() == [0, 1, 2]


def test_buffer_protocol_and_dlpack_objects(face):
    import array

    MPI, comm = face
    buf = array.array("d", [1.5, 2.5, 3.5])
    comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    assert list(buf) == [1.5, 2.5, 3.5]
    target = np.zeros(3)
    comm.Allreduce([Versioned(np.array([1.0, 2.0, 3.0])), MPI.DOUBLE], Versioned(target), op=MPI.SUM)
    assert target.tolist() == [1.0, 2.0, 3.0]


def test_legacy_dlpack_receive_buffers_are_written_as_mpi4py_writes_them(face):
    """NumPy marks arrays from legacy capsules read-only; mpi4py writes into them, and so does the face."""
    MPI, comm = face
    x = np.random.default_rng().integers(0, 9, 4)
    for call in (lambda out: comm.Allreduce(x, out, op=MPI.SUM), lambda out: comm.Allgather(x, out),
                 lambda out: comm.Reduce(x, out, op=MPI.SUM, root=0)):
        for recv in (Legacy(np.zeros(4, np.int64)), Legacy(np.zeros((2, 2), np.int64, order="F"))):
            call(recv)
            assert recv.a.ravel(order="A").tolist() == x.tolist()
    mpi4py_out = Legacy(np.zeros(4, np.int64))
    MPI.COMM_SELF.Allreduce(x, mpi4py_out, op=MPI.SUM)
    assert mpi4py_out.a.tolist() == x.tolist()
    readonly = np.zeros(4, np.int64)
    readonly.setflags(write=False)  # a versioned capsule says so, and both refuse to write
    with pytest.raises(BufferError):
        MPI.COMM_SELF.Allreduce(x, Versioned(readonly), op=MPI.SUM)
    with pytest.raises(TypeError, match="read-only"):
        comm.Allreduce(x, Versioned(readonly), op=MPI.SUM)


def test_persistent_collectives_are_mpi4pys(face):
    MPI, comm = face
    if not hasattr(MPI.Comm, "Allreduce_init"):
        pytest.skip("mpi4py without persistent collectives")
    x, out = np.arange(3), np.zeros(3, np.int64)
    try:
        request = comm.Allreduce_init(x, out, op=MPI.SUM)
    except NotImplementedError:
        pytest.skip("an MPI library without persistent collectives")
    assert isinstance(request, MPI.Prequest)
    for shift in (0, 10):
        x += shift
        request.Start()
        request.Wait()
        assert out.tolist() == x.tolist()
    request.Free()
