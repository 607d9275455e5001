#!/usr/bin/env python
"""The mpi4py face against the raw mpi4py call, for every buffer form mpi4py programs use.

    mpiexec -n 2 python benchmarks/face_forms.py [--sizes 8,1024] [--sweeps 15] [--calls 1000]
                                                 [--collectives Bcast,Gather] [--forms 'numpy;[buf, T];mmap']

Rows: the collectives ``Bcast``, ``Reduce``, ``Allreduce``, ``Gather``,
``Scatter``, ``Allgather`` and ``Alltoall``, each with every buffer form:

* ``numpy`` / ``numpy <dtype>``: NumPy arrays given plainly (uint8 and
  float64 for data movement, float64 and int32 for reductions);
* ``[buf, T]`` and ``[buf, n, T]``: specifications over NumPy arrays, ``T``
  ``MPI.BYTE`` for data movement and ``MPI.DOUBLE`` for reductions (``n`` is
  per process in gathered and scattered buffers, as in mpi4py);
* ``IN_PLACE``: ``MPI.IN_PLACE`` wherever the collective takes it (the root
  of ``Reduce``, ``Gather`` and ``Scatter``; every rank of ``Allreduce``,
  ``Allgather`` and ``Alltoall``), the other ranks' buffers NumPy arrays;
  ``None``: the same with ``None``, which mpi4py reads as ``MPI.IN_PLACE``
  there;
* ``bytearray``, ``array.array``, ``mmap``, ``memoryview``: objects with the
  buffer protocol, given plainly (a ``bytearray`` or ``mmap`` in a reduction
  as ``[buf, MPI.DOUBLE]``: their bytes have no element type of their own);

then ``Allreduce`` of new arrays each call, and the lowercase
``allreduce(3.5)`` of a Python float against mpi4py's own (pickling) method.

Each row times the call written the way an mpi4py program writes it, on a
``Dup`` of COMM_WORLD (``raw``) and on ``wrap(MPI.COMM_WORLD)`` (``face``),
each over buffers of its own made the same way, interleaved with the face's
own communicator called directly on NumPy arrays of the same size
(``commkit``: the engine's floor, which no form can go under). One sweep
runs ``--calls`` back-to-back calls of every variant after a barrier, in an
order that rotates from sweep to sweep; a cell is the median over sweeps of
the time per call on rank 0, ``face / raw`` and ``commkit / raw`` the medians
of the per-sweep ratios. Quote numbers for ranks <= cores only.
"""

from __future__ import annotations

import argparse
import array
import mmap
import os
import statistics
import sys
import time

import numpy as np
from mpi4py import MPI

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for path in (HERE, ROOT):  # the checkout's commkit (also when it is not installed) and the benchmark helpers
    if path not in sys.path:
        sys.path.insert(0, path)

from _tasks import calibration, calibration_line  # noqa: E402

from commkit.compat.mpi4py import wrap  # noqa: E402

COLLECTIVES = ("Bcast", "Reduce", "Allreduce", "Gather", "Scatter", "Allgather", "Alltoall")
REDUCING = ("Reduce", "Allreduce")
FORMS = ("numpy", "numpy float64", "numpy int32", "[buf, T]", "[buf, n, T]", "IN_PLACE", "None",
         "bytearray", "array.array", "mmap", "memoryview")
IN_PLACE_TAKEN = ("Reduce", "Allreduce", "Gather", "Scatter", "Allgather", "Alltoall")


def _buffer(form, nbytes, reducing):
    """``(object, spec)``: a buffer of ``nbytes`` in ``form``, and how the call names it."""
    n = max(nbytes // 8, 1) * 8 if reducing else nbytes  # a reduction moves whole float64s
    datatype = MPI.DOUBLE if reducing else MPI.BYTE
    dtype = np.float64 if reducing else np.uint8
    if form == "numpy":
        buf = np.zeros(n // np.dtype(dtype).itemsize, dtype)
        return buf, buf
    if form == "numpy float64":
        buf = np.zeros(n // 8, np.float64)
        return buf, buf
    if form == "numpy int32":
        buf = np.zeros(n // 4, np.int32)
        return buf, buf
    if form == "[buf, T]":
        buf = np.zeros(n // np.dtype(dtype).itemsize, dtype)
        return buf, [buf, datatype]
    if form == "[buf, n, T]":
        buf = np.zeros(n // np.dtype(dtype).itemsize, dtype)
        return buf, None  # the count is per process: the caller writes the spec
    if form == "bytearray":
        buf = bytearray(n)
        return buf, [buf, datatype] if reducing else buf
    if form == "array.array":
        buf = array.array("d" if reducing else "B", bytes(n))
        return buf, buf
    if form == "mmap":
        buf = mmap.mmap(-1, n)
        return buf, [buf, datatype] if reducing else buf
    if form == "memoryview":
        backing = array.array("d" if reducing else "B", bytes(n))
        buf = memoryview(backing)
        return buf, buf
    raise ValueError(form)


def _applies(collective, form):
    reducing = collective in REDUCING
    if form in ("IN_PLACE", "None"):
        return collective in IN_PLACE_TAKEN
    if form == "numpy float64":
        return not reducing
    if form == "numpy int32":
        return reducing
    return True


def _call(comm, collective, form, nbytes, p, rank):
    """The call of ``collective`` on ``comm`` with buffers in ``form`` (a fresh set for each communicator)."""
    reducing = collective in REDUCING
    in_place = form in ("IN_PLACE", "None")
    made = "numpy" if in_place else form
    blocks = p if collective in ("Gather", "Scatter", "Allgather", "Alltoall") else 1
    one, one_spec = _buffer(made, nbytes, reducing)
    many, many_spec = _buffer(made, nbytes * blocks, reducing) if blocks > 1 else _buffer(made, nbytes, reducing)
    if form == "[buf, n, T]":
        datatype = MPI.DOUBLE if reducing else MPI.BYTE
        count = len(one)
        one_spec, many_spec = [one, count, datatype], [many, count, datatype]
    IP = MPI.IN_PLACE if form == "IN_PLACE" else None
    if collective == "Bcast":
        return lambda: comm.Bcast(one_spec, root=0)
    if collective == "Reduce":
        send = IP if in_place and rank == 0 else one_spec
        return lambda: comm.Reduce(send, many_spec, op=MPI.SUM, root=0)
    if collective == "Allreduce":
        send = IP if in_place else one_spec
        return lambda: comm.Allreduce(send, many_spec, op=MPI.SUM)
    if collective == "Gather":
        send = IP if in_place and rank == 0 else one_spec
        return lambda: comm.Gather(send, many_spec, root=0)
    if collective == "Scatter":
        recv = IP if in_place and rank == 0 else one_spec
        return lambda: comm.Scatter(many_spec, recv, root=0)
    if collective == "Allgather":
        send = IP if in_place else one_spec
        return lambda: comm.Allgather(send, many_spec)
    if collective == "Alltoall":
        send = IP if in_place else many_spec
        other, other_spec = _buffer(made, nbytes * blocks, reducing)
        if form == "[buf, n, T]":
            other_spec = [other, len(one), MPI.BYTE]
        return lambda: comm.Alltoall(send, other_spec)
    raise ValueError(collective)


def _engine(comm, collective, nbytes, p):
    """The face's communicator called directly on NumPy arrays of the same size: the engine's floor."""
    reducing = collective in REDUCING
    x = np.zeros(max(nbytes // 8, 1), np.float64) if reducing else np.zeros(nbytes, np.uint8)
    rows = np.zeros((p,) + x.shape, x.dtype)
    out, out_rows = np.zeros_like(x), np.zeros_like(rows)
    run = {
        "Bcast": lambda: comm.broadcast(x, 0, out=x),
        "Reduce": lambda: comm.reduce(x, "sum", 0, out=out),
        "Allreduce": lambda: comm.allreduce(x, "sum", out=out),
        "Gather": lambda: comm.gather(x, 0, out=out_rows),
        "Scatter": lambda: comm.scatter(rows, 0, out=out),
        "Allgather": lambda: comm.allgather(x, out=out_rows),
        "Alltoall": lambda: comm.alltoall(rows, out=out_rows),
    }
    return run[collective]


def _time(world, variants, sweeps, calls):
    """Medians over sweeps of each variant's time per call (us), and of its per-sweep ratio to ``raw``."""
    for call in variants.values():  # warm: the face and the communicator compile their plans on the first calls
        for _ in range(20):
            call()
    names = list(variants)
    times = {name: [] for name in names}
    ratios = {name: [] for name in names}
    for sweep in range(sweeps):
        shift = sweep % len(names)
        got = {}
        for name in names[shift:] + names[:shift]:
            call = variants[name]
            world.Barrier()
            t = time.perf_counter()
            for _ in range(calls):
                call()
            got[name] = (time.perf_counter() - t) / calls * 1e6
            times[name].append(got[name])
        for name in names:
            ratios[name].append(got[name] / got["raw"])
    return ({name: statistics.median(v) for name, v in times.items()},
            {name: statistics.median(v) for name, v in ratios.items()})


def main(argv=None):
    parser = argparse.ArgumentParser(prog="benchmarks/face_forms.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="8,1024", help="bytes per rank (per block), comma-separated (default 8,1024)")
    parser.add_argument("--sweeps", type=int, default=15, help="sweeps per row (default 15)")
    parser.add_argument("--calls", type=int, default=1000, help="calls of each variant per sweep (default 1000)")
    parser.add_argument("--collectives", default=",".join(COLLECTIVES), help="which collectives (default all)")
    parser.add_argument("--forms", default=";".join(FORMS),
                        help="which buffer forms, separated by ';' (their names hold commas; default all)")
    args = parser.parse_args(argv)
    unknown = [c for c in args.collectives.split(",") if c not in COLLECTIVES]
    if unknown:
        parser.error(f"--collectives takes names from {', '.join(COLLECTIVES)} (mpi4py's spelling); got {unknown}")
    unknown = [f for f in args.forms.split(";") if f not in FORMS]
    if unknown:
        parser.error(f"--forms takes names from {'; '.join(FORMS)}; got {unknown}")
    world = MPI.COMM_WORLD
    raw, face = world.Dup(), wrap(world)
    rank, p = world.Get_rank(), world.Get_size()
    load = os.getloadavg()[0]
    state = calibration(world)
    forms = [f for f in FORMS if f in args.forms.split(";")]
    rows = []
    for nbytes in (int(s) for s in args.sizes.split(",")):
        for collective in args.collectives.split(","):
            engine = _engine(face.comm, collective, nbytes, p)
            for form in forms:
                if not _applies(collective, form):
                    continue
                variants = {"raw": _call(raw, collective, form, nbytes, p, rank),
                            "face": _call(face, collective, form, nbytes, p, rank), "commkit": engine}
                medians, ratios = _time(world, variants, args.sweeps, args.calls)
                rows.append((f"{collective} {form}", nbytes, medians, ratios))
        new = max(nbytes // 8, 1)
        variants = {
            "raw": lambda: raw.Allreduce(np.ones(new), np.empty(new), op=MPI.SUM),
            "face": lambda: face.Allreduce(np.ones(new), np.empty(new), op=MPI.SUM),
            "commkit": lambda: face.comm.allreduce(np.ones(new), out=np.empty(new)),
        }
        medians, ratios = _time(world, variants, args.sweeps, args.calls)
        rows.append(("Allreduce new arrays", nbytes, medians, ratios))
    variants = {"raw": lambda: raw.allreduce(3.5), "face": lambda: face.allreduce(3.5)}
    medians, ratios = _time(world, variants, args.sweeps, args.calls)
    rows.append(("allreduce(3.5)", 8, medians, ratios))
    state = calibration_line(state, calibration(world))
    if rank == 0:
        library = MPI.Get_library_version().splitlines()[0].strip().rstrip("\x00")[:40]
        print(f"# {p} ranks, {library}; {args.sweeps} sweeps x {args.calls} calls; load average {load:.2f} -> "
              f"{os.getloadavg()[0]:.2f}")
        print(f"# command: mpiexec -n {p} python benchmarks/face_forms.py --sizes {args.sizes} "
              f"--sweeps {args.sweeps} --calls {args.calls}")
        print(f"# {state}")
        print("| call | bytes | raw (us) | face (us) | commkit (us) | face / raw | commkit / raw |")
        print("|---|---|---|---|---|---|---|")
        for name, nbytes, m, r in rows:
            engine = f"{m['commkit']:.2f}" if "commkit" in m else "-"
            engine_ratio = f"{r['commkit']:.2f}" if "commkit" in r else "-"
            print(f"| {name} | {nbytes} | {m['raw']:.2f} | {m['face']:.2f} | {engine} | {r['face']:.2f} | "
                  f"{engine_ratio} |")
    raw.Free()  # the face wraps COMM_WORLD itself, which is never freed


if __name__ == "__main__":
    main()
