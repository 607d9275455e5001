"""The mpi4py face: mpi4py programs give the same results wrapped as with real mpi4py.

The MPI tests run each call twice in one job -- on the wrapped mpi4py
communicator itself (MPI's own collectives) and on the face (commkit's
algorithms, or mpi4py's own where the face hands a call over) -- from the same
fresh random data, and compare every result byte for byte. The data are small
integers, in every dtype, so that sums in any order are exact.

* ``TABLE`` crosses every collective the face implements with every buffer
  form mpi4py accepts for it and every kind of buffer, rotating dtype, count
  (0 included), in-place (``MPI.IN_PLACE`` and ``None``), blocking or not, and
  ranks that describe their buffers differently; the vector collectives the
  same way, in every vector form (counts inferred, one count, a stride,
  counts, (counts, displs) ...) with blocks back to back, with gaps, in
  reverse order or from an offset (on each rank its own layout, where ranks
  mix); every collective's persistent ``*_init`` form, started several times
  with fresh data in its buffers before each run; then the calls the face must
  pack (derived datatypes, ``MPI.BOTTOM``, in vector forms too) or hand to
  mpi4py (MAXLOC, user ops, reductions over derived types, intercommunicators),
  in blocking, nonblocking and persistent form. It also checks which road each
  call took. One job per process count, 1 to 4.
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

from commkit.compat.mpi4py import Request, wrap

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
# Vector specs: counts inferred, one count for all, a stride, counts, the datatype from the buffer,
# (counts, displs), four items, displs None. Only the last five take any counts, so only they mix.
VFORMS = ["bare", "typed", "uniform", "strided", "counts", "listonly", "tuple", "four", "nodispls"]
FREE_VFORMS = ["counts", "listonly", "tuple", "four", "nodispls"]
LAYOUTS = ["prefix", "gaps", "reversed", "offset"]  # where explicit displacements put the blocks
CYCLES = 3  # runs of each persistent request
OPS = {"iu": ["SUM", "PROD", "MAX", "MIN", "BAND", "BOR", "BXOR", "LAND", "LOR", "LXOR"],
       "f": ["SUM", "PROD", "MAX", "MIN"], "c": ["SUM", "PROD"]}


def make(kind, a):
    """The object of ``kind`` over ``a``'s values, how to read its contents back (as bytes), and how to write entries.

    The writer ``write(start, values)`` puts ``values`` at entry ``start`` of the
    object's memory (a persistent case refills its buffers between runs).
    """
    def write_a(start, values):
        a[start:start + len(values)] = values

    if kind == "cupy" and ON_FACE:
        d = cupy.asarray(a)

        def write_d(start, values):
            d[start:start + len(values)] = cupy.asarray(values)
        return d, lambda: cupy.asnumpy(d).tobytes(), write_d
    if kind in ("array", "bytearray") and (kind == "bytearray" or a.dtype.str[1:] in ARRAY_CODES):
        obj = array.array(ARRAY_CODES[a.dtype.str[1:]], a.tobytes()) if kind == "array" else bytearray(a.tobytes())

        def write_obj(start, values):
            memoryview(obj).cast("B")[start * a.itemsize:(start + len(values)) * a.itemsize] = values.tobytes()
        return obj, lambda: bytes(obj), write_obj
    if kind == "memoryview":
        return memoryview(a), a.tobytes, write_a
    if kind == "dlpack":
        return Versioned(a), a.tobytes, write_a
    if kind == "legacy":
        return Legacy(a), a.tobytes, write_a
    if kind == "fortran" and a.size % 2 == 0 and a.size:
        f = np.asfortranarray(a.reshape(2, -1, order="F"))  # the same bytes, in Fortran order (and memory)
        return f, lambda: f.tobytes(order="A"), write_a
    return a, a.tobytes, write_a


class Case:
    """One collective call, described by the columns of the table.

    With ``persistent`` the call runs as its ``*_init`` form: made once, then
    started ``CYCLES`` times; before every run but the first, the buffers that
    hold data get fresh values, and after every run every buffer is read.
    """

    def __init__(self, index, collective, form, kind, dtype, count, inplace, mix, nb, forms=None,
                 persistent=False):
        self.index, self.collective, self.dtype, self.count = index, collective, dtype, count
        self.inplace = inplace  # False, or the object meaning in place: MPI.IN_PLACE or None
        self.nb = nb
        self.persistent = persistent
        # Mixed cases give each rank its own buffer form and kind: MPI only asks the type
        # signatures to match, so ranks may describe their buffers differently.
        forms = forms or FORMS
        self.form = forms[(forms.index(form) + rank) % len(forms)] if mix else form
        kinds = TYPED_KINDS if mix else KINDS
        self.kind = kinds[(kinds.index(kind) + 2 * rank) % len(kinds)] if mix else kind
        if self.kind == "bytearray" and self.form == "bare" and collective in REDUCTIONS:
            self.kind = "numpy"  # a bare bytearray holds bytes, but the case's counts are entries of dtype
        # The plain side of a v-collective (its sendbuf or recvbuf of one block) takes its own form.
        self.simple = FORMS[(index + 3 + (rank if mix else 0)) % len(FORMS)]
        ops = OPS["iu" if dtype.kind in "iu" else dtype.kind]
        self.opname = ops[index % len(ops)]
        self.op = getattr(MPI, self.opname)
        self.root = index % size
        self.mix = mix
        self.reset()

    def reset(self):
        """Forget the buffers of a run: each communicator's run makes its own."""
        self.refills, self.reads, self.log = [], [], []

    def __repr__(self):
        return (f"#{self.index} {self.collective}{'_init' if self.persistent else ''} form={self.form} "
                f"kind={self.kind} dtype={self.dtype} count={self.count} inplace={self.inplace!r} "
                f"op={self.opname} root={self.root} nb={self.nb}")

    def values(self, rng, n):
        if self.opname == "PROD":
            v = rng.integers(-3, 4, n) if self.dtype.kind != "u" else rng.integers(0, 4, n)
        elif self.dtype.kind == "u":
            v = rng.integers(0, 60, n)
        else:
            v = rng.integers(-60, 61, n)
        return v.astype(self.dtype)

    def _object(self, rng, a, kind, data, undefined=None, offset=0):
        """``a`` as an object of ``kind``, its reader, and (for a persistent case) its refill of ``data`` ranges."""
        obj, raw_read, write = make(kind, a)

        def read():
            values = np.frombuffer(raw_read(), self.dtype).copy()
            if undefined is not None:
                values[offset + undefined[0]:offset + undefined[1]] = 0
            return (values + 0).tobytes()  # + 0 turns -0.0 into 0.0: its sign depends on the reduction order

        if self.persistent:
            self.reads.append(read)
            for lo, hi in data:
                self.refills.append(lambda lo=lo, hi=hi: write(lo, self.values(rng, hi - lo)))
        return obj, read

    def buf(self, rng, blocks=1, fill="sentinel", count=None, own=None, undefined=None, form=None):
        """A buffer spec of this case's form and kind with room for ``blocks`` blocks, and its reader.

        ``fill``: "data" (fresh values everywhere) or "sentinel"; ``own``: a block
        index to fill with data in a sentinel buffer (the in-place block);
        ``undefined``: a range of entries of the message that MPI leaves undefined
        (the reader blanks them); ``form``: another form than the case's.
        """
        form = form or self.form
        count = self.count if count is None else count
        n = count * max(blocks, 1)
        exact = form in ("bare", "typed", "tuple", "code")
        displ = 0 if exact or form == "count" else 2
        pad = 0 if exact else 3
        a = np.full(displ + n + pad, 7, self.dtype)
        data = []
        if fill == "data":
            data.append((displ, displ + n))
        if own is not None:
            data.append((displ + own * count, displ + (own + 1) * count))
        for lo, hi in data:
            a[lo:hi] = self.values(rng, hi - lo)
        kind = self.kind
        if kind == "bytearray" and form == "bare" and self.collective in VECTORS:
            kind = "numpy"  # the other side counts entries of dtype, not bytes
        obj, read = self._object(rng, a, kind, data, undefined, displ)
        t = MPI.Datatype.fromcode(self.dtype.char)
        spec = {"bare": obj, "typed": [obj, t], "tuple": (obj, t), "code": [obj, self.dtype.str[1:]],
                "count": [obj, count, t], "displ": [obj, (count, displ), t], "four": (obj, count, displ, t)}
        return spec[form], read

    def vbuf(self, rng, counts, fill="sentinel", own=None):
        """A vector buffer spec (one block per rank, ``counts[r]`` entries for rank r) of this case's form and kind.

        The form also decides where the blocks lie: back to back from the start,
        at a stride, with a gap before each, in reverse rank order, or from an
        offset. Returns the spec and its reader (the whole buffer, gaps included).
        """
        # Displacements are each rank's own: a mixed case lays its blocks out differently on each rank.
        form, layout = self.form, LAYOUTS[(self.index + (rank if self.mix else 0)) % len(LAYOUTS)]
        at, displs = 0, []
        for c in counts:
            displs.append(at)
            at += c
        if form == "strided":
            stride = counts[0] + 1
            displs = [stride * i for i in range(size)]
        elif form in ("tuple", "four") and layout == "gaps":
            displs = [d + i for i, d in enumerate(displs)]
        elif form in ("tuple", "four") and layout == "reversed":
            displs = [sum(counts[i + 1:]) for i in range(size)]
        elif form in ("tuple", "four") and layout == "offset":
            displs = [d + 2 for d in displs]
        exact = form in ("bare", "typed")
        length = max([d + c for d, c in zip(displs, counts)] + [0]) + (0 if exact else 2)
        a = np.full(length, 7, self.dtype)
        data = [(d, d + c) for d, c in zip(displs, counts)] if fill == "data" else []
        if own is not None:
            data.append((displs[own], displs[own] + counts[own]))
        for lo, hi in data:
            a[lo:hi] = self.values(rng, hi - lo)
        kind = "numpy" if self.kind == "bytearray" and form in ("bare", "listonly") else self.kind
        obj, read = self._object(rng, a, kind, data)
        t = MPI.Datatype.fromcode(self.dtype.char)
        spec = {"bare": obj, "typed": [obj, t], "uniform": [obj, counts[0], t],
                "strided": [obj, (counts[0], displs[1] if size > 1 else 0), t], "counts": [obj, counts, t],
                "listonly": [obj, counts], "tuple": (obj, (counts, displs), t), "four": [obj, counts, displs, t],
                "nodispls": [obj, counts, None, t]}
        return spec[form], read

    def counts(self):
        """The block counts of a v-collective (for Alltoallv, the matrix [sender][receiver]) its form can say."""
        if self.form in ("bare", "typed"):  # inferred from the buffer: its entries split as evenly as they go
            uniform = self.collective == "Alltoallv" and self.inplace is not False  # what i sends j, j sends i
            n = 2 * size + (0 if uniform else self.index % (size + 1))
            row = [n // size + (i < n % size) for i in range(size)]
            return [row] * size if self.collective == "Alltoallv" else row
        if self.form in ("uniform", "strided"):
            c = self.index % 3
            return [[c] * size] * size if self.collective == "Alltoallv" else [c] * size
        if self.collective == "Alltoallv":
            if self.inplace is not False:  # in place, what i sends j is what j sends i
                return [[(self.index + i + j) % 3 for j in range(size)] for i in range(size)]
            return [[(self.index + i + 2 * j) % 3 for j in range(size)] for i in range(size)]
        return [(self.index + 3 * i) % 4 for i in range(size)]

    def call(self, comm, name, *args, **kwargs):
        if not self.persistent:
            if self.nb:
                getattr(comm, "I" + name.lower())(*args, **kwargs).Wait()
            else:
                getattr(comm, name)(*args, **kwargs)
            return
        request = getattr(comm, name + "_init")(*args, **kwargs)
        for cycle in range(CYCLES):
            if cycle:
                for refill in self.refills:
                    refill()
            if self.nb:  # the face's helpers, which take any mix (on raw mpi4py, MPI's own calls)
                Request.Startall([request])
                while not Request.Testall([request]):
                    pass
            else:
                request.Start()
                request.Wait()
            self.log.append([read() for read in self.reads])
        request.Free()


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


def barrier(comm, c, rng):
    c.call(comm, "Barrier")
    return []


def allgatherv(comm, c, rng):
    counts = c.counts()
    in_place = c.inplace is not False
    recv, read = c.vbuf(rng, counts, own=rank if in_place else None)
    send = c.inplace if in_place else c.buf(rng, fill="data", count=counts[rank], form=c.simple)[0]
    c.call(comm, "Allgatherv", send, recv)
    return [read()]


def gatherv(comm, c, rng):
    counts = c.counts()
    if rank != c.root:
        send, _ = c.buf(rng, fill="data", count=counts[rank], form=c.simple)
        c.call(comm, "Gatherv", send, None if c.index % 2 else c.vbuf(rng, counts)[0], root=c.root)
        return []
    in_place = c.inplace is not False
    recv, read = c.vbuf(rng, counts, own=rank if in_place else None)
    send = c.inplace if in_place else c.buf(rng, fill="data", count=counts[rank], form=c.simple)[0]
    c.call(comm, "Gatherv", send, recv, root=c.root)
    return [read()]


def scatterv(comm, c, rng):
    counts = c.counts()
    if rank != c.root:
        recv, read = c.buf(rng, count=counts[rank], form=c.simple)
        c.call(comm, "Scatterv", None if c.index % 2 else c.vbuf(rng, counts)[0], recv, root=c.root)
        return [read()]
    send, read_send = c.vbuf(rng, counts, fill="data")
    if c.inplace is not False:
        c.call(comm, "Scatterv", send, c.inplace, root=c.root)
        return [read_send()]
    recv, read = c.buf(rng, count=counts[rank], form=c.simple)
    c.call(comm, "Scatterv", send, recv, root=c.root)
    return [read(), read_send()]


def alltoallv(comm, c, rng):
    matrix = c.counts()
    in_place = c.inplace is not False
    recv, read = c.vbuf(rng, [row[rank] for row in matrix], fill="data" if in_place else "sentinel")
    send = c.inplace if in_place else c.vbuf(rng, matrix[rank], fill="data")[0]
    c.call(comm, "Alltoallv", send, recv)
    return [read()]


COLLECTIVES = {
    "Bcast": (bcast, False), "Reduce": (rooted_reduce, "root"), "Allreduce": (reduction("Allreduce"), True),
    "Scan": (reduction("Scan"), True), "Exscan": (reduction("Exscan"), True), "Gather": (gather, "root"),
    "Scatter": (scatter, "root"), "Allgather": (allgather, True), "Alltoall": (alltoall, True),
    "Reduce_scatter_block": (reduce_scatter_block, True), "Reduce_scatter": (reduce_scatter, True),
}
REDUCTIONS = {"Reduce", "Allreduce", "Scan", "Exscan", "Reduce_scatter_block", "Reduce_scatter"}
VECTORS = {"Allgatherv": (allgatherv, True), "Gatherv": (gatherv, "root"), "Scatterv": (scatterv, "root"),
           "Alltoallv": (alltoallv, True)}


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
    # The v-collectives: every vector form x buffer kind, the same rotations.
    for collective, (run, in_place_ok) in VECTORS.items():
        for f, form in enumerate(VFORMS):
            for k, kind in enumerate(KINDS):
                i = len(cases)
                dtype = DTYPES[(f + k + i) % len(DTYPES)]
                inplace = False
                if in_place_ok and (f + k) % 2:
                    inplace = MPI.IN_PLACE if (f + k) % 4 == 1 else None
                mix = form in FREE_VFORMS and (f + k) % 3 == 0 and kind != "bytearray"
                cases.append((run, Case(i, collective, form, kind, dtype, 1, inplace, mix, nb=i % 3 == 1,
                                        forms=FREE_VFORMS if mix else None), False))
    return cases


def persistent_table():
    """Every collective's ``*_init`` form in half of the buffer forms (the other half for the next
    collective, so every form meets both halves), kinds, dtypes and in-place rotating."""
    cases = []
    counts = [3, 1, 0, 2]
    collectives = dict(COLLECTIVES, Barrier=(barrier, False), **VECTORS)
    for c, (collective, (run, in_place_ok)) in enumerate(collectives.items()):
        forms = VFORMS if collective in VECTORS else FORMS[:1] if collective == "Barrier" else FORMS
        for f, form in enumerate(forms):
            if (f + c) % 2 and collective != "Barrier":
                continue
            i = 2000 + len(cases)
            kind = KINDS[(3 * f + i) % len(KINDS)]
            dtype = DTYPES[(f + i) % len(DTYPES)]
            inplace = False
            if in_place_ok and f % 2:
                inplace = MPI.IN_PLACE if f % 4 == 1 else None
            mix = f == 4 and kind != "bytearray"
            cases.append((run, Case(i, collective, form, kind, dtype, counts[i % len(counts)], inplace, mix,
                                    nb=i % 2 == 1, forms=FREE_VFORMS if mix and collective in VECTORS else None,
                                    persistent=True), False))
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


def persistent(comm, c, rng):
    """One list of persistent requests -- commkit's, MPI's own (MAXLOC) and point-to-point -- started and
    waited together by the face's helpers, which take any mix (on mpi4py's, they call MPI.Prequest.Startall
    and MPI.Request.Waitall)."""
    x = rng.integers(-9, 9, 4)
    out = np.zeros(4, np.int64)
    b = rng.integers(0, 9, 3) if rank == c.root else np.zeros(3, np.int64)
    pairs = np.zeros(2, dtype=np.dtype([("value", "f8"), ("index", "i4")], align=True))
    best = np.zeros_like(pairs)
    got, sent = np.zeros(2, np.int64), np.zeros(2, np.int64)
    try:
        requests = [comm.Allreduce_init(x, out, op=MPI.SUM), comm.Bcast_init(b, root=c.root),
                    comm.Allreduce_init([pairs, MPI.DOUBLE_INT], [best, MPI.DOUBLE_INT], op=MPI.MAXLOC),
                    comm.Recv_init(got, (rank - 1) % size, 4), comm.Send_init(sent, (rank + 1) % size, 4)]
    except NotImplementedError:  # an MPI library older than MPI-4
        return [b"no persistent collectives"]
    results = []
    for k in range(CYCLES):
        x[...] = rng.integers(-9, 9, 4)
        if rank == c.root:
            b[...] = rng.integers(0, 9, 3)
        pairs["value"], pairs["index"] = rng.integers(0, 5, 2), rank
        sent[...] = [rank, k]
        Request.Startall(requests)
        Request.Waitall(requests)
        results += [out.tobytes(), b.tobytes(), best["value"].tobytes(), best["index"].tobytes(), got.tobytes()]
    for r in requests:
        r.Free()
    return results


def vector_columns(comm, c, rng):
    """The textbook v-pattern: the root gathers, then scatters, columns of a matrix through a vector type,
    at displacements in column order shifted by one; the others send plain doubles."""
    rows = 3
    col = rng.integers(-9, 9, rows).astype(np.float64)
    counts, displs = [1] * size, [(i + 1) % (size + 1) for i in range(size)]
    t = column_type(rows, size + 1) if rank == c.root else None
    try:
        matrix = np.full((rows, size + 1), -1.0)
        c.call(comm, "Gatherv", [col, rows, MPI.DOUBLE], [matrix, counts, displs, t] if rank == c.root else None,
               root=c.root)
        if rank == c.root:
            matrix[...] = rng.integers(-9, 9, matrix.shape)
        part = np.full(rows, -1.0)
        c.call(comm, "Scatterv", [matrix, (counts, displs[::-1]), t] if rank == c.root else None,
               [part, rows, MPI.DOUBLE], root=c.root)
    finally:
        if t is not None:
            t.Free()
    return [matrix.tobytes(), part.tobytes()]


def vector_mixed_types(comm, c, rng):
    """Even ranks count their blocks in pairs of int64 (a contiguous type), odd ranks in int64s: the same
    bytes, described differently on each rank, in Allgatherv and Alltoallv."""
    pair = MPI.INT64_T.Create_contiguous(2).Commit()
    try:
        mine = 2 * (rank % 2 + 1)
        x = rng.integers(0, 99, mine)
        counts = [2 * (q % 2 + 1) for q in range(size)]
        out = np.full(sum(counts) + 2, -1, np.int64)
        if rank % 2 == 0:
            recv = [out, [n // 2 for n in counts], [1 + sum(counts[:q]) // 2 for q in range(size)], pair]
            send = [x, mine // 2, pair]
        else:
            recv = [out, (counts, [2 + sum(counts[:q]) for q in range(size)]), MPI.INT64_T]
            send = x
        c.call(comm, "Allgatherv", send, recv)
        y = rng.integers(0, 99, 2 * size)
        z = np.full(2 * size, -1, np.int64)
        if rank % 2 == 0:
            c.call(comm, "Alltoallv", [y, [1] * size, [size - 1 - q for q in range(size)], pair],
                   [z, 2, MPI.INT64_T])
        else:
            c.call(comm, "Alltoallv", [y, 2, MPI.INT64_T], [z, (1, 1), pair])
    finally:
        pair.Free()
    return [out.tobytes(), z.tobytes()]


def allgatherv_bottom(comm, c, rng):
    """MPI.BOTTOM with absolute displacements (in entries): the blocks land at addresses, in reverse rank order."""
    r = np.full(2 * size + 3, -1, np.int64)
    base = MPI.Get_address(r) // r.itemsize
    displs = [base + 2 * (size - 1 - q) + 1 for q in range(size)]
    c.call(comm, "Allgatherv", rng.integers(0, 50, 2), [MPI.BOTTOM, [2] * size, displs, MPI.INT64_T])
    return [r.tobytes()]


def specials():
    cases = []
    rows = [
        (derived_bcast, False), (gather_columns, False), (scatter_columns, False), (allgather_mixed_types, False),
        (alltoall_derived, False), (bcast_bottom, False), (vector_columns, False), (vector_mixed_types, False),
        (allgatherv_bottom, False), (maxloc, True), (user_op, True), (derived_reduction, True),
        (float_logical, True), (persistent, None), (intercomm, None),
    ]
    if MPI.Get_version() < (4, 0):
        # Absolute addresses as displacements need MPI-4's MPI_Aint displacements (MPI_Allgatherv_c);
        # an MPI-3 library (Open MPI 5.0) takes C ints, and mpi4py's own call fails with MPI_ERR_ARG.
        rows.remove((allgatherv_bottom, False))
    for run, passes_through in rows:
        for mode in ("blocking", "nonblocking", "persistent"):
            if passes_through is None and mode != "blocking":
                continue
            i = 1000 + len(cases)
            case = Case(i, run.__name__, "bare", "numpy", np.dtype("i8"), 1, False, False, mode == "nonblocking",
                        persistent=mode == "persistent")
            cases.append((run, case, passes_through))
    return cases


def main(seed):
    global ON_FACE
    failures, ran = [], 0
    for run, case, passes_through in table() + persistent_table() + specials():
        results = []
        if TRACE:
            print(f"rank {rank} {case}", flush=True)
        for comm in (raw, face):
            ON_FACE = comm is face
            before = passes.count
            rng = np.random.default_rng([seed, case.index, rank])
            case.reset()
            results.append(run(comm, case, rng) + case.log)
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
@pytest.mark.parametrize("nprocs, timeout", [(1, "60"), (2, "60"), (3, "60"), (4, "60"), (2, ""), (3, "")])
def test_every_buffer_form_and_kind_matches_mpi4py(mpi, nprocs, timeout):
    """With a default timeout (run_mpi's) calls run the interpreter or timed plans; without one, the
    plans a program gets by default: on the same arrays, without out, and the shape plans."""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    result = mpi(nprocs, TABLE, args=(seed,), timeout=240, env={"COMMKIT_TIMEOUT": timeout})
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
@pytest.mark.parametrize("nprocs, timeout", [(3, "60"), (4, "60"), (3, "")])
def test_program_matches_real_mpi4py(mpi, nprocs, timeout):
    seed = int(np.random.SeedSequence().entropy % 2**32)
    result = mpi(nprocs, PROGRAM, args=(seed,), timeout=180, env={"COMMKIT_TIMEOUT": timeout})
    assert result.stdout.count("results identical") == nprocs, (seed, result.stdout, result.stderr)


REFUSED_AT_ONE_RANK = r'''
import numpy as np
from mpi4py import MPI
import commkit as ck
from commkit.compat.mpi4py import wrap
F = wrap(MPI.COMM_WORLD)
rank, size = F.Get_rank(), F.Get_size()
x = np.full(4, 100.0 + rank)
# Refused at the root only (its recvbuf holds 3 elements, not 4); the other ranks send theirs and go on.
try:
    F.Reduce(x, np.empty(3) if rank == 0 else None, op=MPI.SUM, root=0)
    refused = False
except ck.InvalidBuffer:
    refused = True
assert refused == (rank == 0), (rank, refused)
# Every later Reduce gets its own data, past the point where call numbers come round again.
for k in range(1100):
    y, out = np.full(4, float(k + 1) * (rank + 1)), np.empty(4)
    F.Reduce(y, out, op=MPI.SUM, root=0)
    assert rank != 0 or out[0] == (k + 1) * size * (size + 1) / 2, (k, out)
# The same for a persistent request: the refused one still takes its number among them at the root.
try:
    first = F.Reduce_init(x, np.empty(3) if rank == 0 else None, op=MPI.SUM, root=0)
except ck.InvalidBuffer:
    first = None
assert (first is None) == (rank == 0)
y, out = np.full(4, 1.0 + rank), np.empty(4)
second = F.Reduce_init(y, out, op=MPI.SUM, root=0)
if first is not None:
    first.Start()
    first.Wait()
second.Start()
second.Wait()
assert rank != 0 or out[0] == size * (size + 1) / 2, out
print("ok")
'''


@pytest.mark.mpi
def test_a_call_the_face_refuses_at_one_rank_still_counts_there(mpi):
    # The face checks a buffer before the communicator's call; the call still counts as made at the rank
    # that refused it, so what the others sent for it is never taken for a later call's data.
    result = mpi(3, REFUSED_AT_ONE_RANK, timeout=120)
    assert result.stdout.count("ok") == 3, result.stdout + result.stderr


OVERLAPPING_REDUCTIONS = r'''
import numpy as np
from mpi4py import MPI
from commkit.compat.mpi4py import wrap
F = wrap(MPI.COMM_WORLD)
rank, size = F.Get_rank(), F.Get_size()


def persistent(send, recv):
    req = F.Allreduce_init(send, recv)
    buf, start = send.base, send.base.copy()
    for _ in range(2):  # every start reads the send buffer as it is then: as at the first, here
        buf[:] = start
        req.Start()
        req.Wait()
    req.Free()


FORMS = {
    "Allreduce": (lambda s, r: F.Allreduce(s, r), range(size)),
    "Iallreduce": (lambda s, r: F.Iallreduce(s, r).Wait(), range(size)),
    "Allreduce_init": (persistent, range(size)),
    "Reduce": (lambda s, r: F.Reduce(s, r, root=size - 1), range(size) if rank == size - 1 else None),
    "Scan": (lambda s, r: F.Scan(s, r), range(rank + 1)),
    "Exscan": (lambda s, r: F.Exscan(s, r), range(rank) if rank else None),
}
# The send buffer is buf[:8], the receive buffer buf[1:9]: the result is what the send buffer held at the call.
for name, (call, ranks) in FORMS.items():
    kept = np.zeros(9)
    for k in range(4):  # new arrays, then the same array again (the face's kept views and plans)
        buf = np.arange(9.0) + 10.0 * k + 100 * rank if k < 2 else kept
        buf[:] = np.arange(9.0) + 10.0 * k + 100 * rank
        before = buf.copy()
        call(buf[:8], buf[1:9])
        if ranks is None:
            continue
        want = sum(np.arange(8.0) + 10.0 * k + 100 * r for r in ranks)
        assert buf[1:9].tolist() == want.tolist(), (name, k, rank, buf, want)
        assert buf[0] == before[0], (name, k)
print("ok")
'''


@pytest.mark.mpi
def test_a_reduction_whose_buffers_overlap_reads_its_send_buffer_as_it_was(mpi):
    """Overlapping send and receive buffers: the face reads a copy of the send buffer, as its other collectives
    do, on every path (new arrays, the same arrays again, nonblocking, persistent); MPI itself refuses or aborts."""
    result = mpi(3, OVERLAPPING_REDUCTIONS, timeout=120)
    assert result.stdout.count("ok") == 3, result.stdout + result.stderr


REPEATED_MOVES = r'''
import numpy as np
from mpi4py import MPI
import commkit as ck
from commkit.compat.mpi4py import wrap
F = wrap(MPI.COMM_WORLD)
rank, size = F.Get_rank(), F.Get_size()
x, rows, sent = np.zeros(3), np.zeros((size, 3)), np.zeros((size, 3))


def call(collective, root):
    if collective == "Bcast":
        F.Bcast(x, root=root)
    elif collective == "Gather":
        F.Gather(x, rows if rank == root else None, root=root)
    elif collective == "Scatter":
        F.Scatter(rows if rank == root else None, x, root=root)
    elif collective == "Allgather":
        F.Allgather(x, rows)
    else:
        F.Alltoall(sent, rows)


def check(collective, root, k):
    # Each rank's data new in place, as a loop's; every call's result is its own.
    x[:] = 100 * k + rank
    rows[:] = -1.0
    sent[:] = 100 * k + 10 * rank + np.arange(size)[:, None]  # (an Alltoall's: block j goes to rank j)
    if collective == "Scatter" and rank == root:
        rows[:] = 100 * k + np.arange(size)[:, None]
    call(collective, root)
    if collective == "Bcast":
        assert np.all(x == 100 * k + root), (collective, root, k, x)
    elif collective == "Scatter":
        assert np.all(x == 100 * k + rank), (collective, root, k, x)
    elif collective == "Alltoall":
        assert rows[:, 0].tolist() == [100.0 * k + 10 * r + rank for r in range(size)], (collective, k, rows)
    elif collective == "Allgather" or rank == root:
        assert rows[:, 0].tolist() == [100.0 * k + r for r in range(size)], (collective, root, k, rows)


for collective in ("Bcast", "Gather", "Scatter", "Allgather", "Alltoall"):
    for root in range(size):
        for k in range(5):
            check(collective, root, k)
        # The buffer a rank writes, made read-only there: that rank refuses the call, its peers may finish it.
        # Made writeable again, the loop goes on with every call's own data (on the face's replayed plans).
        writes = {"Bcast": rank != root, "Gather": rank == root}.get(collective, True)
        written = rows if collective in ("Gather", "Allgather", "Alltoall") else x
        if writes:
            written.flags.writeable = False
            try:
                call(collective, root)
                raise AssertionError(f"{collective} wrote a read-only buffer at rank {rank}")
            except ck.InvalidBuffer:
                pass
            written.flags.writeable = True
        else:  # (the root of a Bcast, a Gather's senders: nothing written here, the call made as any other)
            call(collective, root)
        for k in range(5, 10):
            check(collective, root, k)
        F.comm.forget_plans()
        for k in range(10, 13):
            check(collective, root, k)
print("ok")
'''


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 3])
def test_repeated_data_movement_calls_get_their_own_data_on_every_rank(mpi, nprocs):
    """Bcast, Gather, Scatter, Allgather, Alltoall repeated on the same arrays at every root: the face's plans give
    each call its own data, a rank whose written buffer turned read-only refuses (its peers may finish the call),
    and a communicator that forgot its plans is never run on an old one."""
    result = mpi(nprocs, REPEATED_MOVES, timeout=120, env={"COMMKIT_TIMEOUT": ""})
    assert result.stdout.count("ok") == nprocs, result.stdout + result.stderr


REPEATED_IN_PLACE = r'''
import numpy as np
from mpi4py import MPI
import commkit as ck
from commkit.compat.mpi4py import wrap
F = wrap(MPI.COMM_WORLD)
rank, size = F.Get_rank(), F.Get_size()
x, rows = np.zeros(3), np.zeros((size, 3))


def call(collective, root, mark):
    # mark: MPI.IN_PLACE or None (mpi4py reads None as IN_PLACE there), where this rank may give it
    if collective == "Gather":
        F.Gather(mark if rank == root else x, rows if rank == root else None, root=root)
    elif collective == "Scatter":
        F.Scatter(rows if rank == root else None, mark if rank == root else x, root=root)
    elif collective == "Allgather":
        F.Allgather(mark, rows)
    else:
        F.Alltoall(mark, rows)


def check(collective, root, k, mark):
    # Each rank's data new in place, as a loop's, its own block in rows included: every call's result is its own.
    x[:] = 100 * k + rank
    if collective == "Alltoall":
        rows[:] = 100 * k + 10 * rank + np.arange(size)[:, None]  # block j goes to rank j
    elif collective == "Scatter":
        rows[:] = 100 * k + np.arange(size)[:, None] if rank == root else -1.0
    else:
        rows[:] = -1.0
        rows[rank] = 100 * k + rank  # (an in-place gather's own block already sits in rows)
    call(collective, root, mark)
    if collective == "Scatter":
        got = rows[rank] if rank == root else x
        assert np.all(got == 100 * k + rank), (collective, root, k, got)
        assert rank != root or rows[:, 0].tolist() == [100.0 * k + q for q in range(size)], (k, rows)  # untouched
    elif collective == "Alltoall":
        assert rows[:, 0].tolist() == [100.0 * k + 10 * q + rank for q in range(size)], (collective, k, rows)
    elif collective == "Allgather" or rank == root:
        assert rows[:, 0].tolist() == [100.0 * k + q for q in range(size)], (collective, root, k, rows)


for collective in ("Gather", "Scatter", "Allgather", "Alltoall"):
    for root in range(size):
        for k in range(4):
            check(collective, root, k, MPI.IN_PLACE)
        for k in range(4, 7):
            check(collective, root, k, None)
        for k in range(7, 9):  # the same arrays given apart, then in place again: each call its own way
            if collective in ("Allgather", "Alltoall") or rank == root:
                x[:] = 100 * k + rank
                other = np.zeros((size, 3))
                if collective == "Gather":
                    F.Gather(x, other, root=root)
                elif collective == "Scatter":
                    F.Scatter(rows, other[0], root=root)
                elif collective == "Allgather":
                    F.Allgather(x, other)
                else:
                    F.Alltoall(rows, other)
            else:
                call(collective, root, MPI.IN_PLACE)
            check(collective, root, k, MPI.IN_PLACE)
        # The buffer a rank writes, made read-only there: that rank refuses the call, its peers may finish it.
        writes = collective != "Scatter" or rank != root
        written = rows if collective != "Scatter" else x
        if writes and (collective != "Gather" or rank == root):
            written.flags.writeable = False
            try:
                call(collective, root, MPI.IN_PLACE)
                raise AssertionError(f"{collective} wrote a read-only buffer at rank {rank}")
            except ck.InvalidBuffer:
                pass
            written.flags.writeable = True
        else:
            call(collective, root, MPI.IN_PLACE)
        for k in range(9, 12):
            check(collective, root, k, MPI.IN_PLACE)
        F.comm.forget_plans()
        for k in range(12, 14):
            check(collective, root, k, MPI.IN_PLACE)
print("ok")
'''


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 3])
def test_repeated_in_place_calls_get_their_own_data_on_every_rank(mpi, nprocs):
    """Gather, Scatter, Allgather and Alltoall with MPI.IN_PLACE (or None) repeated on the same arrays at every
    root: each call reads this call's own block (the face's replayed plans copy it again each call), switching to
    separate buffers and back takes each call its own way, a rank whose written buffer turned read-only refuses,
    and a communicator that forgot its plans is never run on an old one."""
    result = mpi(nprocs, REPEATED_IN_PLACE, timeout=120, env={"COMMKIT_TIMEOUT": ""})
    assert result.stdout.count("ok") == nprocs, result.stdout + result.stderr


TYPED_SPECS = r'''
import numpy as np
from mpi4py import MPI
from commkit.compat.mpi4py import wrap
F = wrap(MPI.COMM_WORLD)
rank, size = F.Get_rank(), F.Get_size()
x, r = np.zeros(4), np.zeros(4)
rows, rows2 = np.zeros((size, 4)), np.zeros((size, 4))
for k in range(4):  # the same arrays in new [buf, T] lists each call, as programs write them
    x[:] = 10 * k + rank + np.arange(4)
    F.Allreduce([x, MPI.DOUBLE], [r, MPI.DOUBLE], op=MPI.SUM)
    assert r.tolist() == (size * (10 * k + np.arange(4)) + sum(range(size))).tolist(), (k, r)
    r[:] = -1
    F.Reduce([x, MPI.DOUBLE], [r, MPI.DOUBLE], op=MPI.MAX, root=size - 1)
    assert rank != size - 1 or r.tolist() == (10 * k + size - 1 + np.arange(4)).tolist(), (k, r)
    F.Bcast([x, MPI.DOUBLE], root=k % size)
    assert x.tolist() == (10 * k + k % size + np.arange(4)).tolist(), (k, x)
    x[:] = 10 * k + rank
    F.Allgather([x, MPI.DOUBLE], [rows, MPI.DOUBLE])
    assert rows[:, 0].tolist() == [10.0 * k + q for q in range(size)], (k, rows)
    F.Gather([x, MPI.DOUBLE], [rows2, MPI.DOUBLE] if rank == 0 else None, root=0)
    assert rank != 0 or rows2[:, 0].tolist() == [10.0 * k + q for q in range(size)], (k, rows2)
    F.Scatter([rows, MPI.DOUBLE] if rank == 1 % size else None, [x, MPI.DOUBLE], root=1 % size)
    assert x.tolist() == [10.0 * k + rank] * 4, (k, x)
    rows[:] = 100 * k + 10 * rank + np.arange(size)[:, None]
    F.Alltoall([rows, MPI.DOUBLE], [rows2, MPI.DOUBLE])
    assert rows2[:, 0].tolist() == [100.0 * k + 10 * q + rank for q in range(size)], (k, rows2)
for k in range(4):  # [buf, n, T] with n all of the array (per process where the count is): the array again
    x[:] = 10 * k + rank + np.arange(4)
    F.Allreduce([x, 4, MPI.DOUBLE], [r, 4, MPI.DOUBLE], op=MPI.SUM)
    assert r.tolist() == (size * (10 * k + np.arange(4)) + sum(range(size))).tolist(), (k, r)
    F.Bcast([x, 4, MPI.DOUBLE], root=k % size)
    assert x.tolist() == (10 * k + k % size + np.arange(4)).tolist(), (k, x)
    x[:] = 10 * k + rank
    F.Allgather([x, 4, MPI.DOUBLE], [rows, 4, MPI.DOUBLE])
    assert rows[:, 0].tolist() == [10.0 * k + q for q in range(size)], (k, rows)
    F.Gather([x, 4, MPI.DOUBLE], [rows2, 4, MPI.DOUBLE] if rank == 0 else None, root=0)
    assert rank != 0 or rows2[:, 0].tolist() == [10.0 * k + q for q in range(size)], (k, rows2)
    F.Scatter([rows, 4, MPI.DOUBLE] if rank == 1 % size else None, [x, 4, MPI.DOUBLE], root=1 % size)
    assert x.tolist() == [10.0 * k + rank] * 4, (k, x)
    rows[:] = 100 * k + 10 * rank + np.arange(size)[:, None]
    F.Alltoall([rows, 4, MPI.DOUBLE], [rows2, 4, MPI.DOUBLE])
    assert rows2[:, 0].tolist() == [100.0 * k + 10 * q + rank for q in range(size)], (k, rows2)
    # A count short of the array moves that many elements, as mpi4py reads it; the rest stays as it was.
    x[:] = 10 * k + rank + np.arange(4)
    r[:] = -1
    F.Allreduce([x, 3, MPI.DOUBLE], [r, 3, MPI.DOUBLE], op=MPI.SUM)
    assert r.tolist() == (size * (10 * k + np.arange(3)) + sum(range(size))).tolist() + [-1], (k, r)
    F.Bcast([x, 2, MPI.DOUBLE], root=0)
    assert x.tolist() == (10 * k + np.arange(2)).tolist() + (10 * k + rank + np.arange(2, 4)).tolist(), (k, x)
    rows2[:] = -1
    rows[:] = 10 * k + rank
    F.Allgather([rows, 2, MPI.DOUBLE], [rows2, 2, MPI.DOUBLE])  # (each rank's first two; rows2 has room for all)
    assert rows2.reshape(-1)[:2 * size].tolist() == sum(([10.0 * k + q] * 2 for q in range(size)), []), (k, rows2)
    assert np.all(rows2.reshape(-1)[2 * size:] == -1), (k, rows2)
# A datatype other than the array's elements is not the array: its bytes are read as that type, as mpi4py does.
ints = np.arange(4, dtype=np.int64) + rank
out = np.zeros(4)
F.Allreduce([ints.view(np.float64), MPI.INT64_T], [out, MPI.INT64_T], op=MPI.SUM)
assert out.view(np.int64).tolist() == (size * np.arange(4) + sum(range(size))).tolist(), out.view(np.int64)
print("ok")
'''


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 3])
def test_typed_specs_over_numpy_arrays_give_the_arrays_results(mpi, nprocs):
    """[buf, T] with T the array's own element type is the array itself (the face takes the array's paths),
    in every collective; another T reads the bytes as that type, as mpi4py does."""
    result = mpi(nprocs, TYPED_SPECS, timeout=120, env={"COMMKIT_TIMEOUT": ""})
    assert result.stdout.count("ok") == nprocs, result.stdout + result.stderr


def test_a_typed_spec_over_a_numpy_array_takes_the_arrays_own_path(face):
    import commkit

    MPI, comm = face
    x, r = np.arange(4.0), np.zeros(4)
    for _ in range(3):
        comm.Allreduce([x, MPI.DOUBLE], [r, MPI.DOUBLE], op=MPI.SUM)
        comm.Bcast([x, MPI.DOUBLE], root=0)
    assert comm._hot_allreduce[0] is x and comm._hot_allreduce[1] is r and comm._hot_bcast[0] is x
    assert r.tolist() == x.tolist()
    from commkit.compat.mpi4py import _whole

    for other in ([x, MPI.FLOAT], [x, 3, MPI.DOUBLE], [x, 4, MPI.FLOAT], [x.tolist(), MPI.DOUBLE], [x, "d"],
                  [x, 4.0, MPI.DOUBLE], [x, (4, 0), MPI.DOUBLE], [x, 2, MPI.DOUBLE]):
        # another type, a count short of the array, not an array, a type code, a count mpi4py reads otherwise:
        # the spec's own path
        assert _whole(other) is other and _whole(other, 1) is other
    assert _whole([x, 4, MPI.DOUBLE]) is x and _whole([x, 2, MPI.DOUBLE], 2) is x  # all of it (2 blocks of 2)
    assert _whole([x, 4, MPI.DOUBLE], 2) is not x  # 2 blocks of 4: more than the array holds, for mpi4py to refuse
    for _ in range(3):
        comm.Allreduce([x, 4, MPI.DOUBLE], [r, 4, MPI.DOUBLE], op=MPI.SUM)
    assert comm._hot_allreduce[0] is x and comm._hot_allreduce[1] is r
    for spec in (x[::2], [x[::2], MPI.DOUBLE]):  # a strided view is refused alike, given alone or in a spec
        with pytest.raises(commkit.InvalidBuffer, match="sendbuf must be contiguous"):
            comm.Allreduce(spec, np.zeros(2), op=MPI.SUM)


REPEATED_REDUCE = r'''
import numpy as np
from mpi4py import MPI
import commkit as ck
from commkit.compat.mpi4py import wrap
F = wrap(MPI.COMM_WORLD)
rank, size = F.Get_rank(), F.Get_size()
x, r = np.zeros(3), np.zeros(3)
for root in range(size):
    for k in range(12):
        x[:] = 100 * k + rank
        r[:] = -1.0
        if k == 6 and rank == root:  # the root's output read-only: refused there alone, the others send theirs
            r.flags.writeable = False
            try:
                F.Reduce(x, r, op=MPI.SUM, root=root)
                raise AssertionError("Reduce wrote a read-only buffer")
            except ck.InvalidBuffer:
                pass
            r.flags.writeable = True
            continue
        elif k == 6:
            F.Reduce(x, r, op=MPI.SUM, root=root)
            continue
        if k == 9:
            F.comm.forget_plans()
        F.Reduce(x, r, op=MPI.SUM, root=root)
        want = [100.0 * k * size + sum(range(size))] * 3 if rank == root else [-1.0] * 3
        assert r.tolist() == want, (root, k, r)
print("ok")
'''


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 3])
def test_repeated_reduces_get_their_own_data_on_every_rank(mpi, nprocs):
    """Reduce repeated on the same arrays at every root (the face's kept plans): each call's own sum, a root
    whose output turned read-only refusing alone, and a communicator that forgot its plans."""
    result = mpi(nprocs, REPEATED_REDUCE, timeout=120, env={"COMMKIT_TIMEOUT": ""})
    assert result.stdout.count("ok") == nprocs, result.stdout + result.stderr


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


@pytest.fixture
def face():
    """A face of its own for each test (over a Dup of COMM_SELF), so that what one test's calls leave behind
    (the face's memos, kept copies and views, its communicator's plans and entries) meets no other test."""
    from mpi4py import MPI

    from commkit.compat.mpi4py import wrap

    comm = wrap(MPI.COMM_SELF.Dup())
    yield MPI, comm
    if comm:  # (a test may have freed it)
        comm.Free()


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


def _new_vectors_counting(comm, monkeypatch, parse, method, op, dtype, calls):
    """``calls`` calls of ``method`` on new vectors of ``dtype`` (one rank: each result is its input), counting
    those that reach the face's ``parse`` (in the list returned, which goes on counting), and the last input."""
    parsed = []
    real = getattr(comm, parse)
    monkeypatch.setattr(comm, parse, lambda *args: parsed.append(1) or real(*args))
    rng = np.random.default_rng(3)
    for _ in range(calls):
        x = rng.integers(-9, 9, 4).astype(dtype)
        r = np.empty_like(x)
        getattr(comm, method)(x, r, op)
        assert np.array_equal(r, x)
    return parsed, x


def test_allreduce_on_new_arrays_goes_to_the_communicators_entry_and_every_other_call_stays_right(face, monkeypatch):
    """New arrays each call skip the face's own parse: the communicator's entry for their shape takes them."""
    import commkit

    MPI, comm = face
    parsed, x = _new_vectors_counting(comm, monkeypatch, "_short", "Allreduce", MPI.SUM, np.float64, 8)
    # (the shape's entry comes at its third call)
    assert len(parsed) <= 3, f"{len(parsed)} of 8 calls on new arrays parsed by the face"
    # Another op, in place, the same arrays twice, an output of another dtype: each still right.
    r = np.empty_like(x)
    comm.Allreduce(x, r, MPI.MAX)
    assert np.array_equal(r, x)
    y = x.copy()
    comm.Allreduce(MPI.IN_PLACE, y, MPI.SUM)
    assert np.array_equal(y, x)
    for _ in range(2):
        r[:] = 0
        comm.Allreduce(x, r, MPI.SUM)
        assert np.array_equal(r, x)
    with pytest.raises(commkit.errors.InvalidBuffer):
        comm.Allreduce(x, np.empty(4, np.float32), MPI.SUM)


@pytest.mark.parametrize("method", ["Bcast", "Gather", "Scatter", "Allgather"])
def test_data_movement_on_new_vectors_goes_to_the_communicators_entry_and_every_other_call_stays_right(
        face, monkeypatch, method):
    """New NumPy vectors each call (Scatter's recvbuf) skip the face's own byte views and memo: the communicator's entry for their
    shape takes their bytes. The same vector again gets its plan; strided, 2-D, read-only and object arrays,
    and a root given as a bool, take the other paths, with mpi4py's results and errors."""
    from commkit.errors import InvalidArgument, InvalidBuffer

    MPI, comm = face
    viewed = []  # calls that made the face's own byte views, and its memo of them
    real = comm._memo
    monkeypatch.setattr(comm, "_memo", lambda *args: viewed.append(1) or real(*args))

    def call(x, root=0, out=None):
        if method == "Bcast":
            comm.Bcast(x, root)
            return x
        out = np.full(6, -1, x.dtype) if out is None else out
        getattr(comm, method)(x, out, root) if method in ("Gather", "Scatter") else comm.Allgather(x, out)
        return out

    rng = np.random.default_rng(5)
    for k in range(8):
        x = rng.integers(-9, 9, 6).astype(np.int32)
        want = x.copy()
        if k % 2 and method == "Scatter":  # every rank's blocks as a matrix of a row per rank
            assert np.array_equal(call(x.reshape(1, 6)), want), k
        elif k % 2 and method != "Bcast":
            assert np.array_equal(call(x, 0, np.full((1, 6), -1, np.int32)), want.reshape(1, 6)), k
        else:
            assert np.array_equal(call(x), want), k
    assert len(viewed) <= 3, f"{len(viewed)} of 8 calls on new vectors viewed by the face"  # (the entry: 3rd)
    # The same vector again: the face's memo and then the communicator's plan for it.
    x, out = np.arange(6, dtype=np.int32), np.empty(6, np.int32)
    for k in range(5):
        x[:] = k
        assert np.array_equal(call(x, 0, out), np.full(6, k)), k
    hot = getattr(comm, "_hot_" + method.lower())
    assert hot[0] is x and hot[4] is not None
    # Other arrays: each right through whichever path takes it.
    grid = np.arange(6.0).reshape(2, 3)
    assert np.array_equal(call(grid).reshape(2, 3) if method == "Bcast" else call(grid).reshape(2, 3), grid)
    with pytest.raises(InvalidBuffer, match="contiguous"):  # as mpi4py refuses it
        call(np.arange(12, dtype=np.int32)[::2])
    frozen = np.arange(6, dtype=np.int32)
    frozen.flags.writeable = False
    assert np.array_equal(call(frozen), np.arange(6))  # (only read: Bcast's root, the others' send buffer)
    with pytest.raises(KeyError, match="cannot map 'O'"):  # mpi4py's own error, as the raw call raises
        call(np.array([object()] * 6))
    if method != "Allgather":
        for root in (False, 0.0):  # equal to 0, the root of the entry, but not a rank
            with pytest.raises(InvalidArgument, match="root"):
                call(np.arange(6, dtype=np.int32), root)


def test_reduce_scatter_block_of_vectors_goes_to_the_communicator_and_every_other_call_stays_right(face, monkeypatch):
    """One-type vectors, new each call, skip the face's own parse; overlapping, 2-D, mismatched, read-only
    or IN_PLACE buffers take it, with mpi4py's results and errors."""
    import commkit

    MPI, comm = face
    parsed, _ = _new_vectors_counting(comm, monkeypatch, "_reduce_scatter_block", "Reduce_scatter_block", MPI.MAX,
                                      np.int32, 6)
    assert parsed == []
    both = np.arange(8, dtype=np.float64)  # send and receive buffers in one array: the face copies the input
    comm.Reduce_scatter_block(both[:4], both[2:6], MPI.SUM)
    assert both.tolist() == [0, 1, 0, 1, 2, 3, 6, 7]
    grid = np.arange(4.0).reshape(2, 2)
    out = np.empty((2, 2))
    comm.Reduce_scatter_block(grid, out, MPI.SUM)
    assert np.array_equal(out, grid)
    y = np.arange(4.0)
    comm.Reduce_scatter_block(MPI.IN_PLACE, y, MPI.SUM)
    assert y.tolist() == [0, 1, 2, 3]
    assert len(parsed) == 3
    frozen = np.empty(4)
    frozen.flags.writeable = False
    with pytest.raises(commkit.errors.InvalidBuffer):
        comm.Reduce_scatter_block(np.arange(4.0), frozen, MPI.SUM)
    with pytest.raises(commkit.errors.InvalidBuffer):
        comm.Reduce_scatter_block(np.arange(4.0), np.empty(4, np.float32), MPI.SUM)


def test_a_repeated_allreduce_runs_its_plan_and_every_call_sees_new_data(face):
    """The face keeps the communicator's plan for a call it sees again, and runs it only while it may."""
    import commkit

    MPI, comm = face
    x = np.zeros(5, np.int64)
    r = np.full(5, -1, np.int64)
    for i in range(6):  # the data changes in place between calls, as a training loop's does
        x[:] = np.arange(5) * i
        comm.Allreduce(x, r, MPI.SUM)
        assert np.array_equal(r, x), i
    plan = comm.comm.last_plan("allreduce")
    assert plan is not None and plan.hot[0] is x and plan.hot[1] is r
    # The face runs that plan itself: count its runs.
    runs = []
    compiled = plan.run

    def counted():
        runs.append(1)
        return compiled()

    plan.run = counted
    try:
        x[:] = 5
        comm.Allreduce(x, r, MPI.SUM)
        assert np.array_equal(r, x) and len(runs) == 1
        # While a trace records, the plan steps aside so the call is recorded (and still right).
        with commkit.trace() as t:
            x[:] = 11
            comm.Allreduce(x, r, MPI.SUM)
        assert np.array_equal(r, x) and len(runs) == 1
        assert [e["collective"] for e in t.events] == ["allreduce"]
        # Another op, or another output array, is another call: never the SUM plan.
        comm.Allreduce(x, r, MPI.MAX)
        comm.Allreduce(x, np.empty_like(r), MPI.SUM)
        assert len(runs) == 1
        comm.Allreduce(x, r, MPI.SUM)
        assert len(runs) == 2
        comm.Allreduce(x, r, MPI.SUM)  # (the face keeps the plan again, and runs it itself)
        comm.Allreduce(x, r, MPI.SUM)
        assert len(runs) == 4 and comm._hot_allreduce[5] is plan
        # A plan the communicator forgot (an algorithm edited since) is never run again, though the face kept it.
        comm.comm.forget_plans()
        for i in range(3):
            x[:] = 20 + i
            comm.Allreduce(x, r, MPI.SUM)
            assert np.array_equal(r, x) and len(runs) == 4
    finally:
        plan.run = compiled
    with pytest.raises(commkit.errors.InvalidArgument, match="allreduce"):
        comm.comm.last_plan("allreduse")


def _counting_runs(plan):
    """Count the runs of ``plan`` in the list returned (``plan.run`` restored by the caller from ``plan.run``)."""
    runs, compiled = [], plan.run

    def counted():
        runs.append(1)
        return compiled()
    plan.run = counted
    return runs, compiled


def _runs_its_plan_only_while_it_may(comm, name, plan, check, call, written):
    """The face runs ``plan`` (the communicator's, for a repeated ``call``; ``check(i)`` makes it with new data and
    checks its result) itself, but not under a trace, not where ``written`` (the array the call writes; None
    where it writes none) is read-only, which is refused as a first call would be, and never again once the
    communicator forgot its plans."""
    import commkit

    runs, compiled = _counting_runs(plan)
    try:
        check(5)
        assert len(runs) == 1
        with commkit.trace() as t:
            check(6)
        assert len(runs) == 1 and [e["collective"] for e in t.events] == [name]
        check(7)
        assert len(runs) == 2
        if written is not None:
            written.flags.writeable = False
            with pytest.raises(commkit.InvalidBuffer):
                call()
            assert len(runs) == 2
            written.flags.writeable = True
        comm.comm.forget_plans()  # (what registering an edited algorithm does): never the old plan again
        for i in range(8, 11):
            check(i)
        assert len(runs) == 2
    finally:
        plan.run = compiled
    assert comm.comm.last_plan(name) not in (None, plan)


@pytest.mark.parametrize("collective", ["Bcast", "Gather", "Scatter", "Allgather", "Alltoall"])
def test_a_repeated_data_movement_call_runs_its_plan_only_while_it_may(face, collective):
    """Bcast, Gather, Scatter, Allgather and Alltoall on the same plain arrays again run the communicator's plan
    for their bytes; an array made read-only, a plan the communicator dropped, or a trace, takes the call's own
    path."""
    MPI, comm = face
    x, rows = np.zeros(3), np.zeros((1, 3))
    name = {"Bcast": "broadcast", "Gather": "gather", "Scatter": "scatter", "Allgather": "allgather",
            "Alltoall": "alltoall"}[collective]
    call = {"Bcast": lambda: comm.Bcast(x, root=0), "Gather": lambda: comm.Gather(x, rows, root=0),
            "Scatter": lambda: comm.Scatter(rows, x, root=0), "Allgather": lambda: comm.Allgather(x, rows),
            "Alltoall": lambda: comm.Alltoall(x, rows)}[collective]

    def check(i):
        # New data in place, as a loop's: the result is always this call's.
        src, dst = {"Bcast": (x, x), "Scatter": (rows, x)}.get(collective, (x, rows))
        dst[...] = -1
        src[...] = i
        call()
        assert np.all(dst == i), (collective, i, dst)

    for i in range(5):  # (new arrays: the communicator runs its entry for their shape, then compiles their plan)
        check(i)
    plan = comm.comm.last_plan(name)
    assert plan is not None
    # (the root of a Bcast only reads its buffer: a read-only one is fine)
    written = None if collective == "Bcast" else rows if collective in ("Gather", "Allgather", "Alltoall") else x
    _runs_its_plan_only_while_it_may(comm, name, plan, check, call, written)


@pytest.mark.parametrize("collective", ["Gather", "Scatter", "Allgather", "Alltoall"])
def test_a_repeated_in_place_call_runs_its_plan_only_while_it_may(face, collective):
    """Gather, Scatter, Allgather and Alltoall with MPI.IN_PLACE on the same array again run the communicator's
    plan, reading this call's own block; a read-only array, a trace or a forgotten plan takes the call's own
    path."""
    MPI, comm = face
    rows = np.zeros((1, 3))
    name = {"Gather": "gather", "Scatter": "scatter", "Allgather": "allgather", "Alltoall": "alltoall"}[collective]
    call = {"Gather": lambda: comm.Gather(MPI.IN_PLACE, rows, root=0),
            "Scatter": lambda: comm.Scatter(rows, MPI.IN_PLACE, root=0),
            "Allgather": lambda: comm.Allgather(MPI.IN_PLACE, rows),
            "Alltoall": lambda: comm.Alltoall(MPI.IN_PLACE, rows)}[collective]

    def check(i):
        rows[...] = i  # the own block new in place, as a loop's: the result is this call's
        call()
        assert np.all(rows == i), (collective, i, rows)

    for i in range(5):
        check(i)
    plan = comm.comm.last_plan(name)
    memo = getattr(comm, "_hot_" + name)  # the face keeps the call and the plan, and runs it itself
    assert memo[0 if collective != "Scatter" else 1] is MPI.IN_PLACE and memo[4] is plan and plan is not None
    # (an in-place Scatter's root only reads: a read-only array is fine)
    _runs_its_plan_only_while_it_may(comm, name, plan, check, call, None if collective == "Scatter" else rows)


@pytest.mark.parametrize("in_place", [False, True])
def test_a_repeated_reduce_runs_its_plan_only_while_it_may(face, in_place):
    """Reduce on the same arrays again runs the communicator's plan for them, as Allreduce does; another op,
    an output made read-only, a trace or a forgotten plan takes the call's own path."""
    import commkit

    MPI, comm = face
    x, r = np.zeros(4), np.zeros(4)

    def call(i, op=MPI.SUM):
        x[:] = i
        if in_place:
            r[:] = i
        comm.Reduce(MPI.IN_PLACE if in_place else x, r, op=op, root=0)
        assert r.tolist() == [i] * 4, (i, r)

    for i in range(5):
        call(i)
    plan = comm.comm.last_plan("reduce")
    assert plan is not None and comm._hot_reduce[5] is plan
    runs, compiled = _counting_runs(plan)
    try:
        call(5)
        assert len(runs) == 1
        with commkit.trace() as t:
            call(6)
        assert len(runs) == 1 and [e["collective"] for e in t.events] == ["reduce"]
        call(7, MPI.MAX)  # another op: another call
        assert len(runs) == 1
        r.flags.writeable = False
        with pytest.raises(commkit.InvalidBuffer):
            comm.Reduce(MPI.IN_PLACE if in_place else x, r, op=MPI.SUM, root=0)
        r.flags.writeable = True
        call(8)
        call(9)
        assert comm._hot_reduce[5] is plan and len(runs) >= 2
        seen = len(runs)
        comm.comm.forget_plans()
        for i in range(10, 13):
            call(i)
        assert len(runs) == seen
    finally:
        plan.run = compiled


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
    comm.Set_name("a face of its own")  # (the fixture's face is over a Dup, which MPI leaves unnamed)
    assert comm.Get_name() == "a face of its own" == MPI.Intracomm.Get_name(comm)
    assert comm.allreduce(3) == 3  # mpi4py's pickle-based method
    assert re.search("rank 0 of 1", repr(comm))
    x, out = np.arange(3), np.zeros(3, np.int64)
    types = [MPI.INT64_T]
    comm.Alltoallw([x, [3], [0], types], [out, [3], [0], types])  # commkit has no Alltoallw: MPI's own
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


def test_persistent_collectives_run_commkit_and_start_again(face, debug_log):
    from commkit.compat.mpi4py import Prequest, Request

    MPI, comm = face
    x, out = np.arange(3), np.zeros(3, np.int64)
    request = comm.Allreduce_init(x, out, op=MPI.SUM)
    assert isinstance(request, Prequest) and request
    assert request.Test()  # inactive: nothing to wait for, as in MPI
    for shift in (0, 10, 5):
        x += shift
        request.Start()
        request.Wait()
        assert out.tolist() == x.tolist()
    request.Free()
    assert not request  # like a freed MPI.Request
    assert "runs mpi4py's" not in debug_log.text

    # MAXLOC has no commkit equivalent: MPI's own persistent request, decided at init.
    pairs = np.zeros(2, dtype=np.dtype([("value", "f8"), ("index", "i4")], align=True))
    best = np.zeros_like(pairs)
    theirs = comm.Allreduce_init([pairs, MPI.DOUBLE_INT], [best, MPI.DOUBLE_INT], op=MPI.MAXLOC)
    assert isinstance(theirs, MPI.Prequest) and "runs mpi4py's Allreduce_init" in debug_log.text
    ours = comm.Bcast_init(x, root=0)
    # MPI's Startall hands MPI the requests' handles, and a commkit collective has none: the face's helpers
    # take the mix.
    with pytest.raises(TypeError):
        MPI.Prequest.Startall([theirs, ours])
    for k in range(2):
        pairs["value"] = [k, 3]
        Request.Startall([theirs, ours])
        Request.Waitall([theirs, ours])
        assert best["value"].tolist() == [k, 3]
    theirs.Free()
    ours.Free()


def test_vector_collectives_run_commkit_in_every_layout(face, debug_log):
    MPI, comm = face
    own = np.arange(4, dtype=np.int64)
    for spec, expected in [
        (lambda out: [out, [4], [0], MPI.INT64_T], [0, 1, 2, 3, -1, -1]),
        (lambda out: [out, ([4], [2]), MPI.INT64_T], [-1, -1, 0, 1, 2, 3]),
        (lambda out: [out, 4, MPI.INT64_T], [0, 1, 2, 3, -1, -1]),
        (lambda out: [out, [4]], [0, 1, 2, 3, -1, -1]),
    ]:
        for call in (lambda s: comm.Allgatherv(own, s), lambda s: comm.Gatherv(own, s, root=0),
                     lambda s: comm.Iallgatherv(own, s).Wait(),
                     lambda s: comm.Alltoallv([own, (4, 0), MPI.INT64_T], s)):
            out = np.full(6, -1, np.int64)
            call(spec(out))
            assert out.tolist() == expected, (spec(out)[1:], out)
    got = np.zeros(3, np.int64)
    comm.Scatterv([np.arange(6), ([3], [3]), MPI.INT64_T], got, root=0)
    assert got.tolist() == [3, 4, 5]
    inplace = np.arange(5, dtype=np.int64)
    comm.Allgatherv(MPI.IN_PLACE, [inplace, ([3], [1]), MPI.INT64_T])
    comm.Alltoallv(None, [inplace, [5], [0], MPI.INT64_T])
    assert inplace.tolist() == [0, 1, 2, 3, 4]
    assert "runs mpi4py's" not in debug_log.text


def test_vector_spec_errors_are_raised_before_anything_is_sent(face):
    from commkit.errors import InvalidBuffer

    MPI, comm = face
    x, out = np.arange(4, dtype=np.int64), np.zeros(4, np.int64)
    with pytest.raises(InvalidBuffer, match=r"block 0 \(5 entries at displacement 0\) does not lie inside"):
        comm.Allgatherv(x[:1], [out, [5], [0], MPI.INT64_T])
    with pytest.raises(InvalidBuffer, match=r"block 0 \(2 entries at displacement 3\)"):
        comm.Gatherv(x[:2], [out, ([2], [3]), MPI.INT64_T], root=0)
    with pytest.raises(InvalidBuffer, match="counts must have 1 entries, one per rank; got 2"):
        comm.Allgatherv(x, [out, [2, 2], MPI.INT64_T])
    with pytest.raises(InvalidBuffer, match="sendbuf holds 16 bytes but this rank's block of recvbuf"):
        comm.Allgatherv(x[:2], [out, [3], MPI.INT64_T])
    with pytest.raises(InvalidBuffer, match="must be \\(counts, displs\\), got 3 items"):
        comm.Alltoallv(x, [out, ([1], [0], [0]), MPI.INT64_T])
    with pytest.raises(InvalidBuffer, match="read-only"):
        comm.Allgatherv(x, [_readonly(4), [4], MPI.INT64_T])
    with pytest.raises(InvalidBuffer, match="cannot infer the counts"):
        comm.Allgatherv(x, [bytearray(7), MPI.INT64_T])
    column = MPI.INT64_T.Create_vector(2, 1, 3).Commit()
    try:  # a derived type that reaches past the buffer: MPI would write past its end, the face refuses
        with pytest.raises(InvalidBuffer, match="its blocks span bytes 0 to 32 but the buffer holds 24"):
            comm.Allgatherv(x[:2], [np.zeros(3, np.int64), [1], [0], column])
    finally:
        column.Free()
    comm.Allgatherv(x, [out, [4], MPI.INT64_T])  # nothing was sent before: the next call still matches
    assert out.tolist() == x.tolist()


VECTOR_MISMATCH = r'''
import numpy as np
from mpi4py import MPI
from commkit.compat.mpi4py import wrap
from commkit.errors import InvalidBuffer

comm = wrap(MPI.COMM_WORLD)
rank, size = comm.Get_rank(), comm.Get_size()
errors = []
# The root's recvcounts say 2 entries from rank 1, which sends 3: found by the count exchange, on every rank.
counts = [2] * size
try:
    comm.Gatherv(np.zeros(3 if rank == 1 else 2), [np.zeros(2 * size), counts, MPI.DOUBLE] if rank == 0 else None)
except InvalidBuffer as exc:
    errors.append(str(exc))
try:  # rank 0 expects 1 entry from everyone; everyone sends 2 to rank 0
    comm.Alltoallv(np.zeros(2 * size), [np.zeros(2 * size), [1 if rank == 0 else 2] * size, MPI.DOUBLE])
except InvalidBuffer as exc:
    errors.append(str(exc))
everyone = comm.mpi.allgather(errors)
assert all(e == everyone[0] for e in everyone) and len(everyone[0]) == 2, everyone
out = np.zeros(size)
comm.Allgatherv(np.full(1, rank, float), [out, [1] * size, MPI.DOUBLE])  # and the ranks are still together
assert out.tolist() == list(range(size))
if rank == 0:  # every rank checked above that it raised the very same errors
    print(" | ".join(errors), flush=True)
'''


@pytest.mark.mpi
def test_vector_count_mismatch_raises_the_same_error_on_every_rank(mpi):
    result = mpi(3, VECTOR_MISMATCH, timeout=60)
    assert "Gatherv: rank 1 sends 24 bytes but the root's recvcounts give its block 16 bytes" in result.stdout
    assert "Alltoallv: rank 0 expects 8 bytes from rank 0, which sends it 16" in result.stdout


# -- the face is an mpi4py communicator ------------------------------------------------------------

IS_A_COMMUNICATOR = r'''
import threading
import numpy as np
from mpi4py import MPI
from mpi4py.util import pkl5
from commkit.compat.mpi4py import Comm, wrap

world = MPI.COMM_WORLD
face = wrap(world)
rank, size = face.Get_rank(), face.Get_size()
assert isinstance(face, MPI.Intracomm) and isinstance(face, Comm)
assert MPI.Comm(face) == world and type(MPI.Comm(face)) is MPI.Comm  # mpi4py's C-level constructor takes it
assert MPI.Comm.Compare(face, world) == MPI.IDENT

# Matched probes and mpi4py's lock table take it (C functions typed to MPI.Comm).
if size > 1:
    if rank == 0:
        face.Send(np.arange(3, dtype=np.int64), 1, tag=7)
    elif rank == 1:
        status = MPI.Status()
        message = None
        while message is None:
            message = MPI.Message.Iprobe(face, 0, 7, status)
        got = np.zeros(3, np.int64)
        message.Recv(got)
        assert got.tolist() == [0, 1, 2] and status.Get_count(MPI.INT64_T) == 3
    face.Barrier()
    if rank == 0:
        face.send({"a": 1}, 1, tag=8)
    elif rank == 1:
        assert MPI.Message.probe(face, 0, 8).recv() == {"a": 1}
assert isinstance(MPI._comm_lock_table(face), dict)
face.bcast(None, root=0)
assert isinstance(MPI._comm_lock_table(face)["bcast"], type(threading.Lock()))

# mpi4py.util.pkl5 and one-sided windows over it.
big = pkl5.Intracomm(face)
assert big.bcast(["x" * 10, rank] if rank == 0 else None, root=0) == ["x" * 10, 0]
shared = MPI.Win.Allocate_shared(8 if rank == 0 else 0, 8, comm=face)
shared.Free()

# Communicators made from the face are faces, running commkit; Free releases both sides once.
def check_face(comm, expected_size):
    assert isinstance(comm, Comm) and comm.Get_size() == expected_size
    x = np.full(2, comm.Get_rank() + 1, np.int64)
    comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)
    assert x.tolist() == [expected_size * (expected_size + 1) // 2] * 2
    assert comm.comm.last_algorithm != "native", comm.comm.last_algorithm

dup = face.Dup(MPI.INFO_NULL)
assert MPI.Comm.Compare(face, dup) == MPI.CONGRUENT
check_face(dup, size)
inner = dup.comm
dup.Free()
assert dup == MPI.COMM_NULL and inner.broken is None and repr(inner).endswith("freed>")
try:
    dup.Free()
except MPI.Exception:
    pass
else:
    raise AssertionError("a second Free must raise mpi4py's error")
check_face(face.Dup(), size)
check_face(face.Clone(), size)
new, request = face.Idup()
request.Wait()
assert MPI.Comm.Compare(face, new) == MPI.CONGRUENT
check_face(new, size)
new.Free()
group = face.Get_group()
check_face(face.Create_group(group), size)
check_face(face.Create(group), size)
half = group.Incl([r for r in range(size) if r % 2 == 0])
made = face.Create_group(half) if rank % 2 == 0 else None
if rank % 2 == 0:
    check_face(made, (size + 1) // 2)
    made.Free()
check_face(face.Split(rank % 2, rank), len(range(rank % 2, size, 2)))
try:
    face.Free()  # MPI refuses COMM_WORLD, and the face keeps working
except MPI.Exception:
    pass
check_face(face, size)
print(f"rank {rank}: the face is an mpi4py communicator")
'''


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 3])
def test_the_face_is_an_mpi4py_intracomm_every_mpi4py_function_takes(mpi, nprocs):
    result = mpi(nprocs, IS_A_COMMUNICATOR, timeout=120)
    assert result.stdout.count("the face is an mpi4py communicator") == nprocs, result.stdout


LOWERCASE = r'''
import functools
import numpy as np
from mpi4py import MPI
from commkit.compat.mpi4py import wrap

raw = MPI.COMM_WORLD
face = wrap(raw)
rank, size = raw.Get_rank(), raw.Get_size()
VALUES = {
    "int": lambda r: 3 * r - 4, "int near int64": lambda r: (1 << 62) * (r + 1) - r,
    "int past int64": lambda r: (1 << 70) + r, "bool": lambda r: r % 2 == 0,
    "float": lambda r: 0.1 * (r + 1) + 1e-17 * r, "complex": lambda r: complex(r, -0.3 * r),
    "mixed types": lambda r: [1, 2.5, True, 1 + 1j][r % 4], "np.float32": lambda r: np.float32(0.1 * (r + 1)),
    "np.int8": lambda r: np.int8(100 + r), "np.bool_": lambda r: np.bool_(r % 2),
    "np.uint64": lambda r: np.uint64(2**63 + r), "np.complex64": lambda r: np.complex64(r + 0.5j),
    "np.float16": lambda r: np.float16(r / 3), "nan": lambda r: float("nan") if r == 1 else -0.0,
    "list": lambda r: [r, "x" * r], "scalar or tuple": lambda r: r if r % 2 else (r,),
}
OPS = {"SUM": MPI.SUM, "PROD": MPI.PROD, "MAX": MPI.MAX, "MIN": MPI.MIN, "LAND": MPI.LAND, "LOR": MPI.LOR,
       "LXOR": MPI.LXOR, "BAND": MPI.BAND, "BOR": MPI.BOR, "BXOR": MPI.BXOR, "last": lambda a, b: b}


def same(a, b):
    return type(a) is type(b) and repr(a) == repr(b)


compared, differ = 0, []
np.seterr(all="ignore")
for name, value in VALUES.items():
    x = value(rank)
    for opname, op in OPS.items():
        try:  # an op that raises on these objects raises on one rank in mpi4py while the others wait
            functools.reduce(op, [value(r) for r in range(size)])
        except Exception:
            continue
        calls = [("allreduce", lambda c: c.allreduce(x, op))]
        calls += [(f"reduce root {root}", lambda c, root=root: c.reduce(x, op, root)) for root in range(size)]
        for what, call in calls:
            theirs, ours = call(raw), call(face)
            compared += 1
            if not same(theirs, ours):
                differ.append(f"{what} {name} {opname}: mpi4py {theirs!r} face {ours!r}")
    for root in range(size):
        theirs = raw.bcast(x if rank == root else None, root)
        ours = face.bcast(x if rank == root else None, root)
        compared += 1
        if not same(theirs, ours):
            differ.append(f"bcast {name}: mpi4py {theirs!r} face {ours!r}")
    theirs, ours = raw.allgather(x), face.allgather(x)
    compared += 1
    if not (len(theirs) == len(ours) and all(same(a, b) for a, b in zip(theirs, ours))):
        differ.append(f"allgather {name}: mpi4py {theirs!r} face {ours!r}")
# A scalar takes commkit's buffer path: the last collective was commkit's allgather of the records.
face.allreduce(rank + 0.5, MPI.SUM)
assert face.comm.last_choice is not None and face.comm.last_algorithm is not None
for line in differ:
    print(f"rank {rank} DIFFERS {line}")
print(f"rank {rank}: {compared - len(differ)} of {compared} identical")
'''


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
def test_lowercase_methods_return_what_mpi4py_returns_for_every_scalar_type_and_op(mpi, nprocs):
    result = mpi(nprocs, LOWERCASE, timeout=240)
    counts = re.findall(r"rank \d+: (\d+) of (\d+) identical", result.stdout)
    assert len(counts) == nprocs and all(a == b and int(b) > 100 for a, b in counts), result.stdout


def test_lowercase_scalars_travel_as_values_and_the_rest_as_pickles():
    from commkit.compat import mpi4py as face_module

    np_ = np
    rec = np_.zeros(4, np_.int64)
    for value in (7, -(1 << 63), (1 << 63) - 1, True, 2.5, float("-inf"), 1 - 2j, np_.float32(1.5), np_.uint64(2**64 - 1),
                  np_.bool_(True), np_.longdouble(1) / 3):
        face_module._encode(value, rec)
        assert rec[0] != face_module._PICKLED, value
        back = face_module._decode(rec)
        assert type(back) is type(value) and repr(back) == repr(value), (value, back)
    for value in (1 << 63, -(1 << 63) - 1, [1], "s", np_.clongdouble(1), np_.datetime64(1, "s")):
        face_module._encode(value, rec)
        assert rec[0] == face_module._PICKLED, value


def test_reductions_apply_the_op_in_mpi4py_binomial_order():
    from commkit.compat.mpi4py import _binomial

    pairs = lambda a, b: f"({a}{b})"  # noqa: E731
    assert _binomial(list("abcdefg"), pairs) == "(((ab)(cd))((ef)g))"
    assert _binomial(list("abc"), pairs) == "((ab)c)"
    assert _binomial(["a"], pairs) == "a"


class HostInterface:
    """Host memory behind ``__cuda_array_interface__`` (as mpi4py's test-suite's fake GPU arrays): MPI reads it."""

    def __init__(self, a):
        self.a = a
        self.__cuda_array_interface__ = {"version": 0, "data": (a.ctypes.data, False),
                                         "typestr": a.dtype.str, "shape": a.shape}


def test_vector_buffers_only_mpi_can_read_take_their_datatype_and_size_from_mpi4py(face):
    MPI, comm = face
    try:
        import cupy  # noqa: F401
        pytest.skip("with CuPy the face views such memory itself")
    except ImportError:
        pass
    send, recv = np.arange(3, dtype=np.int32), np.full(3, -1, np.int32)
    comm.Allgatherv(HostInterface(send), [HostInterface(recv), 3])  # counts inferred, datatype from the interface
    assert recv.tolist() == [0, 1, 2]


# -- the same buffers call after call: kept views, kept copies, short paths ----------------------

REPEATED = r'''
import array
import mmap
import sys

import numpy as np
from mpi4py import MPI

from commkit.compat.mpi4py import wrap

world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
face = wrap(world)
raw = world.Dup()
rng = np.random.default_rng(int(sys.argv[1]))
MOVING = ["Bcast", "Gather", "Scatter", "Allgather", "Alltoall"]
REDUCING = ["Reduce", "Allreduce"]
KINDS = ["numpy", "numpy-u1", "bytearray", "bytes", "array", "mmap", "memoryview"]
FORMS = ["bare", "typed", "count", "inplace"]
DATATYPES = {"f8": MPI.DOUBLE, "i4": MPI.INT, "u1": MPI.BYTE}
N = 3  # entries per block


class Buf:
    """A buffer of one kind holding ``n`` entries of ``dtype``, rewritten in place between calls."""

    def __init__(self, kind, n, dtype):
        self.kind, self.dtype = kind, dtype
        nbytes = n * dtype.itemsize
        if kind.startswith("numpy"):
            self.obj = np.zeros(n, dtype)
        elif kind == "bytearray":
            self.obj = bytearray(nbytes)
        elif kind == "bytes":  # read-only: only ever sent, so a fresh object carries each call's data
            self.obj = bytes(nbytes)
        elif kind == "array":
            self.obj = array.array(dtype.char, bytes(nbytes))
        elif kind == "mmap":
            self.obj = mmap.mmap(-1, nbytes)
        else:
            self.backing = array.array(dtype.char, bytes(nbytes))
            self.obj = memoryview(self.backing)

    def write(self, values):
        data = values.astype(self.dtype).tobytes()
        if self.kind == "bytes":
            self.obj = data
            return
        view = memoryview(self.obj).cast("B")
        view[:] = data
        view.release()

    def read(self):
        return bytes(memoryview(self.obj).cast("B"))

    def spec(self, form):
        t = DATATYPES[self.dtype.str[1:]]
        return {"bare": self.obj, "typed": [self.obj, t], "count": [self.obj, N, t]}[form]

    def let_go(self):
        """Resize, close or release the buffer: it fails (BufferError) while anything holds a view of it."""
        if self.kind == "bytearray":
            self.obj.extend(b"x")
        elif self.kind == "array":
            self.obj.append(0)
        elif self.kind == "mmap":
            self.obj.close()
        elif self.kind == "memoryview":
            self.obj.release()
            self.backing.append(0)


def cases():
    for collective in MOVING + REDUCING:
        for kind in KINDS:
            for form in FORMS:
                reducing = collective in REDUCING
                if kind == "numpy-u1" and reducing:
                    continue
                if form == "bare" and reducing and kind in ("bytearray", "bytes", "mmap"):
                    continue  # bytes have no element type to reduce: mpi4py takes them as MPI.BYTE
                if kind == "bytes" and (form == "inplace" or collective in ("Bcast", "Scatter")):
                    continue  # nothing is only sent there
                yield collective, kind, form


def run(comm, collective, form, bufs, root):
    inplace = form == "inplace"
    small, big, other = (b.spec("typed" if inplace else form) for b in bufs)
    if bufs[0].kind == "bytes":  # the receiving buffers of a case that sends bytes are NumPy arrays
        big, other = bufs[1].obj, bufs[2].obj
    IP = MPI.IN_PLACE
    if collective == "Bcast":
        comm.Bcast(small, root)
    elif collective == "Reduce":
        comm.Reduce(IP if inplace and rank == root else small, big, MPI.SUM, root)
    elif collective == "Allreduce":
        comm.Allreduce(IP if inplace else small, big, MPI.SUM)
    elif collective == "Gather":
        comm.Gather(IP if inplace and rank == root else small, big, root)
    elif collective == "Scatter":
        comm.Scatter(big, IP if inplace and rank == root else small, root)
    elif collective == "Allgather":
        comm.Allgather(IP if inplace else small, big)
    else:
        comm.Alltoall(IP if inplace else big, other)


compared = 0
for collective, kind, form in cases():
    dtype = np.dtype("i4" if collective in REDUCING else "u1" if kind == "numpy-u1" else "f8")
    blocks = size if collective in ("Gather", "Scatter", "Allgather", "Alltoall") else 1
    sizes = [N, N * blocks, N * blocks]
    receiving = "numpy" if kind == "bytes" else kind
    made = {c: [Buf(kind, sizes[0], dtype), Buf(receiving, sizes[1], dtype), Buf(receiving, sizes[2], dtype)]
            for c in ("raw", "face")}
    for repeat in range(4):  # the same buffer objects every call, new data in them each time
        values = [rng.integers(-50, 50, n) for n in sizes]
        for c in ("raw", "face"):
            for buf, v in zip(made[c], values):
                buf.write(v)
        root = repeat % size
        run(raw, collective, form, made["raw"], root)
        run(face, collective, form, made["face"], root)
        for r, f in zip(made["raw"], made["face"]):
            assert r.read() == f.read(), (collective, kind, form, repeat, r.read(), f.read())
        compared += 1
    for buf in made["face"]:
        buf.let_go()
raw.Free()
print(f"rank {rank}: {compared} repeated calls identical")
'''


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs, timeout", [(2, ""), (3, ""), (2, "60")])
def test_every_buffer_form_gives_mpi4py_results_call_after_call_and_leaves_buffers_free(mpi, nprocs, timeout):
    """The same buffers called again and again (kept views, kept copies, short paths), with new data each call.

    Objects that are not NumPy arrays go through a kept copy in blocking calls; after the calls
    every one of them can be resized, closed or released, as after mpi4py's own.
    """
    result = mpi(nprocs, REPEATED, timeout=240, env={"COMMKIT_TIMEOUT": timeout}, args=(nprocs * 7,))
    counts = re.findall(r"rank \d+: (\d+) repeated calls identical", result.stdout)
    assert len(counts) == nprocs and all(int(c) > 500 for c in counts), result.stdout


def _buffer_of(kind, values):
    import array
    import mmap

    if kind == "bytearray":
        return bytearray(values.tobytes())
    if kind == "array":
        return array.array("d", values.tobytes())
    if kind == "mmap":
        m = mmap.mmap(-1, values.nbytes)
        m[:] = values.tobytes()
        return m
    return memoryview(array.array("d", values.tobytes()))


def _let_go(buf):
    if isinstance(buf, memoryview):
        base = buf.obj
        buf.release()
        base.append(0.0)
    elif hasattr(buf, "close"):
        buf.close()
    elif isinstance(buf, bytearray):
        buf.extend(b"x")
    else:
        buf.append(0.0)


@pytest.mark.parametrize("kind", ["bytearray", "array", "mmap", "memoryview"])
@pytest.mark.parametrize("collective", ["Allgather", "Allreduce", "Bcast", "Gather"])
def test_buffers_that_are_not_numpy_arrays_run_one_kept_plan(face, kind, collective):
    """A blocking call over a bytearray, array.array, mmap or memoryview replays the communicator's plan.

    The face copies such a buffer into a kept array (a view kept across calls
    would stop the program resizing or closing it), so the communicator sees
    the same arrays every call and compiles, then reuses, one plan; the data
    still come from the buffer each call, and the buffer stays free. (A bare
    buffer's ``Bcast`` goes to the communicator's entry on a fresh view of it
    instead, and keeps nothing.)
    """
    MPI, comm = face
    rng = np.random.default_rng()
    send = _buffer_of(kind, np.zeros(4))
    recv = _buffer_of(kind, np.zeros(4))
    typed = (lambda b: [b, MPI.DOUBLE]) if kind in ("bytearray", "mmap") else (lambda b: b)
    name = {"Allgather": "allgather", "Allreduce": "allreduce", "Bcast": "broadcast", "Gather": "gather"}[collective]
    before = comm.comm.last_plan(name)
    plans = []
    for _ in range(5):
        values = rng.integers(-50, 50, 4).astype(np.float64)
        view = memoryview(send).cast("B")
        view[:] = values.tobytes()
        view.release()
        if collective == "Allgather":
            comm.Allgather(typed(send), typed(recv))
        elif collective == "Allreduce":
            comm.Allreduce(typed(send), typed(recv), op=MPI.SUM)
        elif collective == "Gather":
            comm.Gather(typed(send), typed(recv), root=0)
        else:
            comm.Bcast(typed(send), root=0)
            recv = send
        assert np.frombuffer(bytes(memoryview(recv).cast("B")), np.float64).tolist() == values.tolist()
        plans.append(comm.comm.last_plan(name))
    if collective == "Bcast" and typed(send) is send:
        # A bare buffer's broadcast goes to the communicator's entry for new arrays on a fresh byte view every
        # call (cheaper than the kept copy): no copy is kept, and the view is gone after each call.
        assert not [key for key in comm._stages if id(send) in key], comm._stages
    else:
        assert plans[-1] is not None and plans[-1] is not before and plans[-1] is plans[-2], (before, plans)
    _let_go(send)
    if recv is not send:
        _let_go(recv)


def test_a_call_that_fails_after_copying_a_buffer_leaves_it_free(face):
    """The face lets go of the fresh views of a call's buffers also when the call raises."""
    import commkit

    MPI, comm = face
    recv = bytearray(16)
    comm.Allgather(bytearray(b"a" * 16), recv)
    comm.Allgather(bytearray(b"b" * 16), recv)  # recv's kept copy exists: the next call fills it, then fails
    with pytest.raises(commkit.InvalidBuffer, match="send size"):
        comm.Allgather(bytearray(24), recv)
    assert recv == bytearray(b"b" * 16)
    recv.extend(b"x")  # BufferError while the face held a view of it


@pytest.mark.parametrize("shape", ["2-D", "big-endian", "offset", "part"])
def test_kept_copies_of_memoryviews_of_any_shape_and_format_move_their_bytes(face, shape):
    """A memoryview in two dimensions, of a non-native format, starting inside its object, or a message that
    is only part of it: call after call the receive buffer gets the send buffer's bytes (only the message's,
    where it is part of the buffer), and both are free to release after."""
    MPI, comm = face
    rng = np.random.default_rng()

    def make():
        if shape == "big-endian":
            return None, memoryview(np.zeros(4, ">f8"))
        base = bytearray(32 if shape == "2-D" else 48)
        if shape == "2-D":
            return base, memoryview(base).cast("d", (2, 2))
        return base, memoryview(base)[8:40]  # "offset" and "part": 32 bytes from byte 8 of a bytearray

    (send_base, send), (recv_base, recv) = make(), make()
    spec = (lambda b: [b, 2, MPI.DOUBLE]) if shape == "part" else (lambda b: [b, MPI.DOUBLE])
    moved = 16 if shape == "part" else 32
    for _ in range(4):
        memoryview(send).cast("B")[:] = rng.integers(0, 256, 32, dtype=np.uint8).tobytes()
        before = bytes(memoryview(recv).cast("B"))
        comm.Allgather(spec(send), spec(recv))
        got = bytes(memoryview(recv).cast("B"))
        assert got[:moved] == bytes(memoryview(send).cast("B"))[:moved] and got[moved:] == before[moved:]
    send.release()
    recv.release()
    for base in (send_base, recv_base):
        if base is not None:
            base.extend(b"x")  # BufferError while any view of it lives


def test_a_short_path_call_that_raises_lets_its_buffers_go_untouched(face):
    """A call on kept copies that fails inside the communicator writes nothing back and holds no view."""
    MPI, comm = face
    send, recv = bytearray(b"s" * 16), bytearray(b"r" * 16)
    calls = {"allgather": lambda: comm.Allgather(send, recv), "alltoall": lambda: comm.Alltoall(MPI.IN_PLACE, recv)}
    for name, call in calls.items():
        call()
        call()  # kept now: the next call takes the short path
        recv[:] = b"q" * 16
        ran = []

        def fail(*args, **kwargs):
            ran.append(args)
            raise RuntimeError("the communicator failed")

        run, comm._blocking[name] = comm._blocking[name], fail
        # The face's memo of the call would run the plan compiled for its kept copies itself: retired, the
        # memo calls the communicator's method, which fails (a failing plan: test_repeated_data_movement_...).
        comm.comm.forget_plans()
        try:
            with pytest.raises(RuntimeError, match="the communicator failed"):
                call()
        finally:
            comm._blocking[name] = run
        assert ran and recv == bytearray(b"q" * 16)
    recv.extend(b"x")  # BufferError while the face held a view of it
    send.extend(b"x")


def test_short_paths_keep_every_check_of_the_general_path(face):
    """A NumPy array seen before skips the parse, never a check: what the general path refuses, it refuses."""
    import commkit

    MPI, comm = face
    x = np.arange(6, dtype=np.float64)
    r = np.zeros(6)
    for call in (lambda: comm.Gather(x, r, root=0), lambda: comm.Allgather(x, r),
                 lambda: comm.Alltoall(x, r), lambda: comm.Scatter(x, r, root=0)):
        for i in range(3):
            x[:] = np.arange(6) * i
            r[:] = -1
            call()
            assert r.tolist() == x.tolist()
        r.flags.writeable = False
        with pytest.raises(commkit.InvalidBuffer, match="read-only"):
            call()
        r.flags.writeable = True
    short = np.zeros(4)
    with pytest.raises(commkit.InvalidBuffer, match="mismatch"):
        comm.Gather(short, r, root=0)
    # Send and receive buffers that overlap: the general path copies the send block first, as before.
    both = np.arange(6, dtype=np.float64)
    comm.Allgather(both, both)
    assert both.tolist() == list(range(6))


IN_PLACE_SHORT = r"""
import array
import mmap
import sys

import numpy as np
from mpi4py import MPI

from commkit.compat import mpi4py as face_module
from commkit.compat.mpi4py import wrap

# Count the calls that take the general path (the parse): a short path never gets there.
general = [0]
for name in ("_bcast", "_reduce", "_reduction", "_gather", "_scatter", "_allgather", "_alltoall"):
    def counted(self, *args, _run=getattr(face_module.Comm, name)):
        general[0] += 1
        return _run(self, *args)
    setattr(face_module.Comm, name, counted)

world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
raw, face = world.Dup(), wrap(world)
rng = np.random.default_rng(int(sys.argv[1]))
N = 3  # float64s per block
KINDS = ["numpy", "typed", "count", "bytearray", "array", "mmap", "memoryview", "read-only"]


class Buf:
    # n float64s in a buffer of one kind, named in the call the way an mpi4py program names it.
    def __init__(self, kind, n, blocks):
        self.kind = kind
        if kind in ("numpy", "typed", "count", "read-only"):
            self.obj = np.zeros(n)
        elif kind == "bytearray":
            self.obj = bytearray(8 * n)
        elif kind == "array":
            self.obj = array.array("d", bytes(8 * n))
        elif kind == "mmap":
            self.obj = mmap.mmap(-1, 8 * n)
        else:
            self.backing = array.array("d", bytes(8 * n))
            self.obj = memoryview(self.backing)
        typed = kind in ("typed", "bytearray", "mmap")  # bytes have no element type of their own
        self.spec = [self.obj, MPI.DOUBLE] if typed else [self.obj, n // blocks, MPI.DOUBLE] if kind == "count" \
            else self.obj

    def write(self, values):
        if self.kind == "read-only":
            self.obj.flags.writeable = True
        view = memoryview(self.obj).cast("B")
        view[:] = values.tobytes()
        view.release()
        if self.kind == "read-only":
            self.obj.flags.writeable = False

    def read(self):
        return bytes(memoryview(self.obj).cast("B"))

    def let_go(self):  # raises BufferError while anything still views the buffer
        if self.kind == "bytearray":
            self.obj.extend(b"x")
        elif self.kind == "array":
            self.obj.append(0.0)
        elif self.kind == "mmap":
            self.obj.close()
        elif self.kind == "memoryview":
            self.obj.release()
            self.backing.append(0.0)


def cases():
    # (collective, root, kind of this rank's buffers, how IN_PLACE is written): each rank its own kind.
    index = 0
    for collective in ("Gather", "Scatter", "Allgather", "Alltoall", "Reduce", "Allreduce", "Bcast"):
        for root in range(size) if collective in ("Gather", "Scatter", "Reduce", "Bcast") else [0]:
            for in_place in (MPI.IN_PLACE, None):
                kind = KINDS[(rank + index) % len(KINDS)]
                index += 1
                yield collective, root, kind, in_place


def run(comm, collective, root, in_place, one, many):
    IP = in_place
    if collective == "Gather":
        comm.Gather(IP if rank == root else one.spec, many.spec, root)
    elif collective == "Scatter":
        comm.Scatter(many.spec, IP if rank == root else one.spec, root)
    elif collective == "Allgather":
        comm.Allgather(IP, many.spec)
    elif collective == "Alltoall":
        comm.Alltoall(IP, many.spec)
    elif collective == "Reduce":
        comm.Reduce(IP if rank == root else one.spec, many.spec if rank == root else None, MPI.SUM, root)
    elif collective == "Allreduce":
        comm.Allreduce(IP, one.spec, MPI.SUM)
    else:
        comm.Bcast(one.spec, root)


compared, slow = 0, []
for collective, root, kind, in_place in cases():
    blocks = size if collective in ("Gather", "Scatter", "Allgather", "Alltoall") else 1
    # A read-only buffer only where this rank only sends from it: the others are NumPy arrays.
    only_sends = {"Gather": rank != root, "Reduce": rank != root, "Bcast": rank == root}.get(collective, False)
    one_kind = kind if kind != "read-only" or only_sends else "numpy"
    many_kind = kind if kind != "read-only" else "numpy"
    made = {c: (Buf(one_kind, N, 1), Buf(many_kind, N * blocks, blocks)) for c in ("raw", "face")}
    for repeat in range(4):  # the same buffers every call, new data in them each time
        values = [rng.integers(-50, 50, n).astype(np.float64) for n in (N, N * blocks)]
        for c in ("raw", "face"):
            for buf, v in zip(made[c], values):
                buf.write(v)
        run(raw, collective, root, in_place, *made["raw"])
        before = general[0]
        run(face, collective, root, in_place, *made["face"])
        if repeat >= 2 and general[0] != before:  # the first calls parse; the later ones must not
            slow.append(f"{collective} root {root} {kind} {in_place}")
        for r, f in zip(made["raw"], made["face"]):
            assert r.read() == f.read(), (collective, root, kind, in_place, repeat, r.read(), f.read())
        compared += 1
    for buf in made["face"]:
        buf.let_go()
raw.Free()
for line in slow:
    print(f"rank {rank} GENERAL PATH {line}")
print(f"rank {rank}: {compared} calls identical")
"""


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs, debug", [(2, ""), (3, ""), (4, ""), (3, "check")])
def test_in_place_and_send_only_buffers_take_the_short_path_with_mpi4py_results(mpi, nprocs, debug):
    """IN_PLACE (or None) in Gather, Scatter, Allgather, Alltoall, Reduce and Allreduce, a Bcast root's
    buffer and a Reduce's send buffer off the root, each rank with a buffer of its own kind: a call
    repeated on the same buffers parses nothing after the first, gives mpi4py's results, and leaves
    every buffer free to resize, close or release. In check mode every rank's call must also agree
    with the others' (the same collective on the same byte counts), whatever form each rank used."""
    result = mpi(nprocs, IN_PLACE_SHORT, timeout=180, env={"COMMKIT_DEBUG": debug}, args=(nprocs * 11,))
    counts = re.findall(r"rank \d+: (\d+) calls identical", result.stdout)
    assert len(counts) == nprocs and all(int(c) > 40 for c in counts), result.stdout
    assert "GENERAL PATH" not in result.stdout, result.stdout


IN_PLACE_ERRORS = r"""
import numpy as np
from mpi4py import MPI

import commkit
from commkit.compat.mpi4py import wrap

world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
face, fresh = wrap(world), wrap(world.Dup())  # fresh has seen no buffer: every call of it parses
N = 3
other = (rank + 1) % size
ba = {c: bytearray(8 * N * size) for c in ("Allgather", "Alltoall", "Gather", "Scatter")}
ro = np.zeros(N * size)
send = bytearray(8 * N)
# Warm the face on every buffer, so that the calls below find them kept.
face.Allgather(MPI.IN_PLACE, [ba["Allgather"], MPI.DOUBLE])
face.Allgather(MPI.IN_PLACE, ro)
face.Alltoall(MPI.IN_PLACE, [ba["Alltoall"], MPI.DOUBLE])
for root in range(size):
    face.Gather(MPI.IN_PLACE if rank == root else send, [ba["Gather"], MPI.DOUBLE] if rank == root else None, root)
    face.Scatter([ba["Scatter"], MPI.DOUBLE] if rank == root else None, MPI.IN_PLACE if rank == root else send, root)
    face.Reduce(MPI.IN_PLACE if rank == root else [send, N, MPI.DOUBLE], [ba["Gather"], N, MPI.DOUBLE], MPI.SUM, root)
for buf in ba.values():
    buf.extend(b"x")  # no longer whole float64s: every call below on it is wrong on this rank
del send[8:]  # now shorter than the count its spec asks for
ro.flags.writeable = False
# Each is wrong on this rank alone and raises before anything is sent, so each rank calls alone.
wrong = {
    "Allgather resized": lambda c: c.Allgather(MPI.IN_PLACE, [ba["Allgather"], MPI.DOUBLE]),
    "Allgather read-only": lambda c: c.Allgather(None, ro),
    "Alltoall resized": lambda c: c.Alltoall(MPI.IN_PLACE, [ba["Alltoall"], MPI.DOUBLE]),
    "Gather resized root": lambda c: c.Gather(MPI.IN_PLACE, [ba["Gather"], MPI.DOUBLE], rank),
    "Scatter resized root": lambda c: c.Scatter([ba["Scatter"], MPI.DOUBLE], None, rank),
    "Reduce short send": lambda c: c.Reduce([send, N, MPI.DOUBLE], None, MPI.SUM, other),
}
if size > 1:
    wrong.update({
        "Gather IN_PLACE off the root": lambda c: c.Gather(MPI.IN_PLACE, [ba["Gather"], MPI.DOUBLE], other),
        "Scatter IN_PLACE off the root": lambda c: c.Scatter(None, MPI.IN_PLACE, other),
        "Reduce IN_PLACE off the root": lambda c: c.Reduce(MPI.IN_PLACE, None, MPI.SUM, other),
    })
for what, call in wrong.items():
    messages = []
    for c in (face, fresh):
        try:
            call(c)
        except commkit.InvalidBuffer as error:
            messages.append(str(error))
        else:
            raise AssertionError(f"{what}: no error")
    assert messages[0] == messages[1] and messages[0].endswith("."), (what, messages)
    print(f"rank {rank} {what}: {messages[0]}")
out = np.zeros(size)
face.Allgather(np.full(1, float(rank)), out)  # the ranks are still together
assert out.tolist() == list(range(size))
print(f"rank {rank}: errors as the general path raises them")
"""


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [1, 2, 3])
def test_short_paths_for_in_place_raise_the_general_paths_errors(mpi, nprocs):
    """Buffers the face keeps, then made wrong (resized, read-only, IN_PLACE off the root, a count past
    the end): the call raises what a face that never saw them raises, before anything is sent."""
    result = mpi(nprocs, IN_PLACE_ERRORS, timeout=120)
    assert result.stdout.count("errors as the general path raises them") == nprocs, result.stdout
    assert "IN_PLACE is valid as recvbuf only at the root" in result.stdout or nprocs == 1, result.stdout
    assert "read-only" in result.stdout, result.stdout


NEW_ARRAYS = r'''
import numpy as np
from mpi4py import MPI
import commkit.compat.mpi4py as face_module
from commkit.compat.mpi4py import wrap

general = [0]  # calls that take the general path (the parse): new NumPy arrays never get there
for name in ("_bcast", "_gather", "_scatter", "_allgather"):
    def counted(self, *args, _run=getattr(face_module.Comm, name)):
        general[0] += 1
        return _run(self, *args)
    setattr(face_module.Comm, name, counted)

raw = MPI.COMM_WORLD.Dup()
face = wrap(MPI.COMM_WORLD)
rank, size = raw.Get_rank(), raw.Get_size()
for k in range(6):  # new arrays every call, each rank its own view of the same bytes
    # Bcast: the root's float64 array; the others receive the same 16 bytes as int32, a (2, 2) array, or bytes.
    kinds = [np.zeros(2, np.float64), np.zeros(4, np.int32), np.zeros((2, 2), np.int32), np.zeros(16, np.uint8)]
    bufs = [kinds[rank % 4].copy() for _ in range(2)]
    if rank == 0:
        bufs = [np.array([1.5 + k, -2.25]), np.array([1.5 + k, -2.25])]
    raw.Bcast(bufs[0], 0)
    face.Bcast(bufs[1], 0)
    assert bufs[0].tobytes() == bufs[1].tobytes(), (k, bufs)
    # Allgather: 12 bytes from each rank (3 int32), received as int16 (p * 12 bytes) or as bytes.
    send = np.arange(3, dtype=np.int32) + 10 * rank + k
    recvs = [np.zeros(6 * size, np.int16) if rank % 2 else np.zeros(12 * size, np.uint8) for _ in range(2)]
    raw.Allgather(send, recvs[0])
    face.Allgather(send, recvs[1])
    assert recvs[0].tobytes() == recvs[1].tobytes(), (k, recvs)
    # Gather and Scatter at every root: 8 bytes a rank (float64 or 2 int32), the root's p blocks as int16.
    for root in range(size):
        mine = np.array([k + 0.5 * rank]) if rank % 2 else np.array([k, -rank], np.int32)
        into = [np.zeros(4 * size, np.int16) if rank == root else None for _ in range(2)]
        raw.Gather(mine, into[0], root)
        face.Gather(mine, into[1], root)
        assert rank != root or into[0].tobytes() == into[1].tobytes(), (k, root, into)
        blocks = np.arange(4 * size, dtype=np.int16) * (k + 1) if rank == root else None
        got = [np.zeros(1) if rank % 2 else np.zeros(2, np.int32) for _ in range(2)]
        raw.Scatter(blocks, got[0], root)
        face.Scatter(blocks, got[1], root)
        assert got[0].tobytes() == got[1].tobytes(), (k, root, got)
assert general[0] == 0, f"rank {rank}: {general[0]} calls on new NumPy arrays took the general path"
print(f"rank {rank}: ok")
'''


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 3, 4])
def test_new_numpy_arrays_of_any_type_give_mpi4py_bytes_through_bcast_allgather_gather_scatter(mpi, nprocs):
    """The face's direct path for NumPy arrays moves bytes, as its general path and MPI do: ranks that view
    one message as different types (float64 at the root, int32 or bytes elsewhere) still meet."""
    result = mpi(nprocs, NEW_ARRAYS, timeout=120)
    assert result.stdout.count(": ok") == nprocs, result.stdout


NEW_REDUCTIONS = r'''
import os

import numpy as np
from mpi4py import MPI
import commkit.compat.mpi4py as face_module
from commkit.compat.mpi4py import wrap

parsed = [0]  # calls that reached the face's own parse of a reduction's buffers
_short = face_module.Comm._short


def counted(self, sendbuf, recvbuf, op):
    parsed[0] += 1
    return _short(self, sendbuf, recvbuf, op)


face_module.Comm._short = counted
raw = MPI.COMM_WORLD.Dup()
face = wrap(MPI.COMM_WORLD)
rank, size = raw.Get_rank(), raw.Get_size()
calls = 0
for root in range(size):
    for op in (MPI.SUM, MPI.MAX):
        for k in range(8):  # new arrays every call: after the first few, the communicator's entry takes them
            x = (np.arange(5) * (rank + 1) - k).astype(np.float64)
            mine, want = np.full(5, -1.0), np.full(5, -1.0)
            raw.Reduce(x, want if rank == root else None, op, root)
            face.Reduce(x, mine if rank == root else None, op, root)
            assert rank != root or np.array_equal(mine, want), (root, op, k, mine, want)
            both = [np.empty(5), np.empty(5)]
            raw.Allreduce(x, both[0], op)
            face.Allreduce(x, both[1], op)
            assert np.array_equal(both[0], both[1]), (root, op, k, both)
            calls += 2
        # In place at the root, and the same arrays twice: right, through whichever path takes them.
        y = (np.arange(5) + rank + root).astype(np.float64)
        want = np.empty(5)
        raw.Reduce(y, want if rank == root else None, op, root)
        for _ in range(2):
            z = y.copy()
            face.Reduce(MPI.IN_PLACE if rank == root else z, z if rank == root else None, op, root)
            assert rank != root or np.array_equal(z, want), (root, op, z, want)
# Untimed, the entries take most calls. (Timed, a transport whose timed plans run on a slot per call number
# sends each number's first call to the general path, the communicator's own calls too: the first 1024 here.)
if not os.environ.get("COMMKIT_TIMEOUT"):
    assert parsed[0] <= calls // 2, f"rank {rank}: {parsed[0]} of {calls} calls on new arrays parsed by the face"
print(f"rank {rank}: ok {parsed[0]} of {calls} parsed")
'''


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs, timeout", [(2, ""), (3, ""), (2, "60")])
def test_reductions_on_new_arrays_go_to_the_communicators_entry_with_mpi4py_results(mpi, nprocs, timeout):
    """Reduce (root and the others) and Allreduce on new arrays each call skip the face's parse once the
    communicator has an entry for their shape, and give mpi4py's results, at every root and op (timed too)."""
    result = mpi(nprocs, NEW_REDUCTIONS, timeout=120, env={"COMMKIT_TIMEOUT": timeout})
    assert result.stdout.count(": ok") == nprocs, result.stdout


STAGED_MEMO = r"""
import array
import os

import numpy as np
from mpi4py import MPI

import commkit
from commkit.compat.mpi4py import wrap

F = wrap(MPI.COMM_WORLD)
raw = MPI.COMM_WORLD.Dup()
rank = F.Get_rank()
rng = np.random.default_rng(rank)
calls = 0


def fill(buf, values):
    memoryview(buf).cast("B")[:] = np.ascontiguousarray(values).tobytes()


def got(buf, dtype=np.float64):
    return np.frombuffer(bytes(memoryview(buf).cast("B")), dtype)


def check(send, recv, op, spec=lambda b: b, dtype=np.float64, n=None):
    # The face's Allreduce on spec(send), spec(recv) against mpi4py's on copies of the same bytes.
    global calls
    before = got(recv, dtype).copy()
    mine = before.copy() if send is MPI.IN_PLACE else got(send, dtype).copy()
    want = before.copy()
    m = len(mine) if n is None else n
    raw.Allreduce(mine[:m].copy(), want[:m], op=op)
    F.Allreduce(MPI.IN_PLACE if send is MPI.IN_PLACE else spec(send), spec(recv), op=op)
    assert got(recv, dtype).tobytes() == want.tobytes(), (got(recv, dtype), want)
    calls += 1


# The same buffers, new data each call, as plain objects and as [buf, MPI.DOUBLE] written anew each call;
# the op changes now and then (the memo is the op's), and so does which buffer sends.
a, b, c = (array.array("d", bytes(32)) for _ in range(3))
for i in range(12):
    fill(a, rng.integers(-9, 9, 4).astype(np.float64))
    fill(c, rng.integers(-9, 9, 4).astype(np.float64))
    op = MPI.MAX if i % 5 == 4 else MPI.SUM
    check(c if i % 4 == 3 else a, b, op)
    check(MPI.IN_PLACE, b, op)
s, r = bytearray(32), bytearray(32)
for i in range(6):
    fill(s, rng.integers(-9, 9, 4).astype(np.float64))
    check(s, r, MPI.SUM, spec=lambda buf: [buf, MPI.DOUBLE])
# Another datatype for the same bytes: the values are read as int64 now.
for i in range(3):
    fill(s, rng.integers(-2**40, 2**40, 4))
    check(s, r, MPI.SUM, spec=lambda buf: [buf, MPI.INT64_T], dtype=np.int64)
# Another count: only the first element is reduced, the rest of the receive buffer is left as it was.
for i in range(3):
    fill(s, rng.integers(-9, 9, 4).astype(np.float64))
    fill(r, np.full(4, -1.0))
    check(s, r, MPI.SUM, spec=lambda buf: [buf, 1, MPI.DOUBLE], n=1)
# A receive buffer that grew since: refused before anything is sent, as on its first call.
b.append(0.0)
try:
    F.Allreduce(a, b, op=MPI.SUM)
except commkit.InvalidBuffer as exc:
    assert "count" in str(exc) or "size" in str(exc), exc
else:
    raise AssertionError("a receive buffer of 5 doubles for a send buffer of 4 was taken")
b.pop()
check(a, b, MPI.SUM)
# A memoryview released since its last call: refused as mpi4py refuses it.
view = memoryview(array.array("d", bytes(32)))
check(view, b, MPI.SUM)
check(view, b, MPI.SUM)
base = view.obj
view.release()
try:
    F.Allreduce(view, b, op=MPI.SUM)
except (ValueError, commkit.InvalidBuffer):
    pass
else:
    raise AssertionError("a released memoryview was read")
base.append(0.0)  # free: no view of it lives
# A call that fails inside the communicator writes nothing back and holds no view.
for i in range(3):
    check(a, r, MPI.SUM, spec=lambda buf: buf if buf is a else [buf, MPI.DOUBLE])
h = F._moved_allreduce
assert len(h[3]) == 2 and h[2] == (MPI.SUM, None), h  # a send copy and a receive copy, for the sum
if not os.environ.get("COMMKIT_TIMEOUT"):  # (a timed call keeps no plan: the memo then calls the communicator)
    assert h[8] is not None, h  # the memo holds the compiled plan: the next call runs it


class Failing:
    def ready(self, x):
        return True

    def run(self):
        raise RuntimeError("the communicator failed")


F._moved_allreduce = h[:8] + (Failing(), h[9])
fill(r, np.full(4, 7.0))
try:
    F.Allreduce(a, [r, MPI.DOUBLE], op=MPI.SUM)
except RuntimeError:
    pass
else:
    raise AssertionError("the memo did not run its plan")
assert got(r).tolist() == [7.0] * 4
r.extend(b"x")
F._moved_allreduce = h
# Reduce: the root's receive buffer (or IN_PLACE there) and every rank's send buffer, the root moving now and
# then; off the root the receive buffer is neither read nor written, as in mpi4py.
r = bytearray(32)
for send, recv, spec in ((a, b, lambda buf: buf), (s, r, lambda buf: [buf, MPI.DOUBLE])):
    for i in range(12):
        root = (i // 4) % F.Get_size()
        op = MPI.MAX if i == 6 else MPI.SUM
        in_place = i >= 9 and rank == root
        fill(send, rng.integers(-9, 9, 4).astype(np.float64))
        fill(recv, np.full(4, -1.0))
        before = got(recv).copy()
        mine = before.copy() if in_place else got(send).copy()
        want = before.copy()
        raw.Reduce(mine, want, op=op, root=root)
        F.Reduce(MPI.IN_PLACE if in_place else spec(send), spec(recv), op=op, root=root)
        assert got(recv).tobytes() == (want if rank == root else before).tobytes(), (i, got(recv), want, before)
        calls += 1
h = F._moved_reduce
assert h[4] == "reduce" and h[3][0][0].__class__.__name__ == "_Staged", h
print(f"rank {rank}: {calls} staged calls matched mpi4py")
"""


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs, timeout", [(2, ""), (3, ""), (2, "60")])
def test_a_repeated_allreduce_or_reduce_on_kept_copies_follows_every_change_of_its_arguments(mpi, nprocs, timeout):
    """The face's memo of the last Allreduce (and Reduce) on buffers that are not NumPy arrays (their kept
    copies' plan) is taken only while the call is written the same way over the same buffers: a new op,
    send buffer, datatype, count or root, a buffer that grew or a released memoryview each take the path that
    checks them, with mpi4py's answer or error; a failure inside the call writes nothing back and holds no view."""
    result = mpi(nprocs, STAGED_MEMO, env={"COMMKIT_TIMEOUT": timeout})
    assert result.stdout.count("staged calls matched mpi4py") == nprocs, result.stdout + result.stderr


MOVED_MEMO = r"""
import array
import os

import numpy as np
from mpi4py import MPI

from commkit.compat.mpi4py import wrap

F = wrap(MPI.COMM_WORLD)
raw = MPI.COMM_WORLD.Dup()
rank, p = F.Get_rank(), F.Get_size()
rng = np.random.default_rng(rank + 10)
N = 2  # doubles a block


def make(kind, blocks):
    return bytearray(8 * N * blocks) if kind == "bytearray" else array.array("d", bytes(8 * N * blocks))


def refill(buf):
    memoryview(buf).cast("B")[:] = rng.integers(-99, 99, len(memoryview(buf).cast("B")) // 8).astype(
        np.float64).tobytes()


def as_array(buf):
    return np.frombuffer(bytes(memoryview(buf).cast("B")), np.float64).copy()


# (send blocks, receive blocks, rooted, the call on (comm, send spec, receive spec, root)); in place, the
# spec mpi4py reads as IN_PLACE takes the place of the send (Scatter: the receive) buffer's.
CALLS = {
    "Bcast": (1, 0, True, lambda c, s, r, root: c.Bcast(s, root=root)),
    "Gather": (1, p, True, lambda c, s, r, root: c.Gather(s, r, root=root)),
    "Scatter": (p, 1, True, lambda c, s, r, root: c.Scatter(s, r, root=root)),
    "Allgather": (1, p, False, lambda c, s, r, root: c.Allgather(s, r)),
    "Alltoall": (p, p, False, lambda c, s, r, root: c.Alltoall(s, r)),
}
SPECS = {
    "as is": lambda b: b,
    "[buf, T]": lambda b: [b, MPI.DOUBLE],
    "[buf, n, T]": lambda b: [b, N, MPI.DOUBLE],
    "[buf, 1, T]": lambda b: [b, 1, MPI.DOUBLE],  # another count: half of each block moves
    "[buf, INT64_T]": lambda b: [b, MPI.INT64_T],  # another datatype over the same bytes
}
planned = set()
calls = 0
for name, (sends, recvs, rooted, call) in CALLS.items():
    for kind in ("array", "bytearray"):
        send, recv = make(kind, sends), make(kind, recvs) if recvs else None
        for spec_name, spec in SPECS.items():
            if kind == "bytearray" and spec_name == "as is":
                continue  # (a bytearray has no element type: mpi4py reads it as bytes)
            for i in range(9):
                root = (i // 3) % p if rooted else None
                in_place = spec_name == "[buf, T]" and i >= 6 and name != "Bcast"
                if in_place and rooted and rank != root:
                    in_place = False  # (only the root's call is in place)
                refill(send)
                if recv is not None:
                    refill(recv)
                mine_s, mine_r = as_array(send), None if recv is None else as_array(recv)
                want_s, want_r = mine_s.copy(), None if recv is None else mine_r.copy()
                args = [spec(want_s), None if recv is None else spec(want_r)]
                face = [spec(send), None if recv is None else spec(recv)]
                if in_place:
                    which = 1 if name == "Scatter" else 0
                    args[which] = face[which] = MPI.IN_PLACE
                call(raw, *args, root)
                call(F, *face, root)
                assert as_array(send).tobytes() == want_s.tobytes(), (name, kind, spec_name, i, "send")
                if recv is not None:
                    assert as_array(recv).tobytes() == want_r.tobytes(), (name, kind, spec_name, i, as_array(recv),
                                                                          want_r)
                calls += 1
            if getattr(F, "_moved_" + name.lower())[8] is not None:
                planned.add(name)
        # Free: the face holds no view of either buffer.
        for buf in (send, recv):
            if buf is not None:
                buf.extend(b"\0" * 8) if kind == "bytearray" else buf.append(0.0)

# A call on a memo whose plan fails inside writes nothing back and holds no view.
send, recv = make("bytearray", 1), make("bytearray", p)
for _ in range(3):
    refill(send)
    F.Allgather([send, MPI.DOUBLE], [recv, MPI.DOUBLE])
h = F._moved_allgather


class Failing:
    def ready(self, x):
        return True

    def run(self):
        raise RuntimeError("the communicator failed")


F._moved_allgather = h[:8] + (Failing(), h[9])
before = bytes(recv)
try:
    F.Allgather([send, MPI.DOUBLE], [recv, MPI.DOUBLE])
except RuntimeError:
    pass
else:
    raise AssertionError("the memo did not run its plan")
assert bytes(recv) == before
recv.extend(b"x")
F._moved_allgather = h
if not os.environ.get("COMMKIT_TIMEOUT"):  # (a timed call keeps no plan)
    assert planned == set(CALLS), planned
print(f"rank {rank}: {calls} moved calls matched mpi4py")
"""


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs, timeout", [(2, ""), (3, ""), (2, "60")])
def test_repeated_data_movement_on_kept_copies_follows_every_change_of_its_arguments(mpi, nprocs, timeout):
    """Bcast, Gather, Scatter, Allgather and Alltoall on buffers that are not NumPy arrays, call after call with
    new data: each collective's memo of its last call (the kept copies and the plan for them) is taken only while
    the call is written the same way (buffer objects, count, datatype, root, in place or not), and gives
    mpi4py's bytes in every buffer, send buffers untouched; a failure inside writes nothing back."""
    result = mpi(nprocs, MOVED_MEMO, timeout=180, env={"COMMKIT_TIMEOUT": timeout})
    assert result.stdout.count("moved calls matched mpi4py") == nprocs, result.stdout + result.stderr
