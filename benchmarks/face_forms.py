#!/usr/bin/env python
"""The mpi4py face against the raw mpi4py call, for the buffer forms mpi4py programs use.

    mpiexec -n 2 python benchmarks/face_forms.py [--sizes 8,1024] [--sweeps 15] [--calls 2000]

Each row times one call written the way an mpi4py program writes it, once on a
``Dup`` of COMM_WORLD (``raw``) and once on ``wrap(MPI.COMM_WORLD)`` (``face``),
on the same buffers, interleaved: each sweep runs ``--calls`` back-to-back calls
of every variant after a barrier, the order rotating from sweep to sweep, and
the buffers' contents change between sweeps. A cell is the median over sweeps
of the time per call on rank 0; ``face / raw`` is the median of the per-sweep
ratios. Forms: a NumPy uint8 array given plainly, as ``[buf, n, MPI.BYTE]``,
with ``MPI.IN_PLACE``; a ``bytearray`` and an ``array.array``; new arrays each
call (``Allreduce`` of fresh input and output); and the lowercase
``allreduce(3.5)`` of a Python float. Quote numbers for ranks <= cores only.
"""

from __future__ import annotations

import argparse
import array
import os
import statistics
import sys
import time

import numpy as np
from mpi4py import MPI

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the checkout's commkit

from commkit.compat.mpi4py import wrap  # noqa: E402


def forms(comm, n, p):
    """(name, callable) pairs for a communicator, over buffers made here (the same for raw and face)."""
    u8 = np.zeros(n, np.uint8)
    out8 = np.zeros(n * p, np.uint8)
    f32 = np.ones(max(n // 4, 1), np.float32)
    r32 = np.empty_like(f32)
    inplace = np.zeros(n * p, np.uint8)
    ba = bytearray(n)
    aa = array.array("f", [1.0] * max(n // 4, 1))
    ra = array.array("f", [0.0] * max(n // 4, 1))
    return [
        ("Bcast numpy", lambda: comm.Bcast(u8, root=0)),
        ("Bcast [buf, n, BYTE]", lambda: comm.Bcast([u8, n, MPI.BYTE], root=0)),
        ("Bcast bytearray", lambda: comm.Bcast(ba, root=0)),
        ("Allreduce numpy", lambda: comm.Allreduce(f32, r32, op=MPI.SUM)),
        ("Allreduce array.array", lambda: comm.Allreduce(aa, ra, op=MPI.SUM)),
        ("Allreduce new arrays", lambda: comm.Allreduce(np.ones(max(n // 4, 1), np.float32),
                                                        np.empty(max(n // 4, 1), np.float32), op=MPI.SUM)),
        ("Gather [buf, n, BYTE]", lambda: comm.Gather([u8, n, MPI.BYTE], [out8, n, MPI.BYTE], root=0)),
        ("Allgather IN_PLACE", lambda: comm.Allgather(MPI.IN_PLACE, inplace)),
        ("Alltoall numpy", lambda: comm.Alltoall(out8, inplace)),
        ("allreduce(3.5)", lambda: comm.allreduce(3.5)),
    ]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="8,1024", help="bytes per rank (default 8,1024)")
    parser.add_argument("--sweeps", type=int, default=15)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args(argv)
    world = MPI.COMM_WORLD
    raw, face = world.Dup(), wrap(world)
    rank, p = world.Get_rank(), world.Get_size()
    load = os.getloadavg()[0]
    rows = []
    for n in (int(s) for s in args.sizes.split(",")):
        pairs = list(zip(forms(raw, n, p), forms(face, n, p)))
        for (name, raw_call), (_, face_call) in pairs:
            for call in (raw_call, face_call):  # warm: the face compiles its plans on the first calls
                for _ in range(20):
                    call()
            times = {"raw": [], "face": []}
            ratios = []
            for sweep in range(args.sweeps):
                order = [("raw", raw_call), ("face", face_call)][:: 1 if sweep % 2 else -1]
                got = {}
                for label, call in order:
                    world.Barrier()
                    t = time.perf_counter()
                    for _ in range(args.calls):
                        call()
                    got[label] = (time.perf_counter() - t) / args.calls * 1e6
                    times[label].append(got[label])
                ratios.append(got["face"] / got["raw"])
            rows.append((name, n, statistics.median(times["raw"]), statistics.median(times["face"]),
                         statistics.median(ratios)))
    if rank == 0:
        library = MPI.Get_library_version().splitlines()[0].strip().rstrip("\x00")[:40]
        print(f"# {p} ranks, {library}; {args.sweeps} sweeps x {args.calls} calls; load average {load:.2f} -> "
              f"{os.getloadavg()[0]:.2f}")
        print(f"# command: mpiexec -n {p} python benchmarks/face_forms.py --sizes {args.sizes} "
              f"--sweeps {args.sweeps} --calls {args.calls}")
        print("| call | bytes | raw (us) | face (us) | face / raw |")
        print("|---|---|---|---|---|")
        for name, n, r, f, ratio in rows:
            print(f"| {name} | {n} | {r:.2f} | {f:.2f} | {ratio:.2f} |")
    raw.Free()  # the face wraps COMM_WORLD itself, which is never freed


if __name__ == "__main__":
    main()
