"""What the mpi4py face costs per call, on top of the communicator it wraps.

    mpiexec -n 2 python benchmarks/face_overhead.py [--sizes 8,1024] [--sweeps 41] [--calls 300]

Six ways to run the same float32 sum allreduce, on the same input and output
arrays, interleaved in one job:

* ``mpi4py``: the raw ``MPI.Comm.Allreduce`` on a ``Dup`` of COMM_WORLD, the call
  an mpi4py program makes today;
* ``face``: ``wrap(MPI.COMM_WORLD).Allreduce(x, out, op=MPI.SUM)``, the same
  program with its one changed line;
* ``commkit``: the face's own :class:`commkit.Communicator`, called directly as
  ``allreduce(x, out=out)``;
* ``mpi4py_init``, ``face_init``, ``commkit_init``: the persistent forms, made
  once before the sweeps -- the raw ``Allreduce_init`` (MPI-4, on its own ``Dup``),
  the face's ``Allreduce_init`` and the communicator's ``allreduce_init`` -- and
  timed as one ``Start()``/``Wait()`` (``start()``/``wait()``) per call.

``face - commkit`` is the face's own per-call cost (buffer parsing, op mapping,
dispatch), ``face_init - commkit_init`` the same for persistent requests;
``commkit - mpi4py`` is the engine's. One sweep times ``--calls``
back-to-back calls of each variant, in an order that rotates from sweep to
sweep, after a barrier; the table gives the median over sweeps of the time per
call, with the 10th-90th percentile spread of the sweeps, measured on rank 0
(every rank takes part in every call). The face's own cost is also given as
the median over sweeps of the difference face - commkit within each sweep,
which a busy machine disturbs less than the difference of two medians. Quote
numbers for ranks <= cores only.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
from mpi4py import MPI

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # the checkout's commkit, also when it is not installed

from commkit.compat.mpi4py import wrap


def _parser():
    parser = argparse.ArgumentParser(prog="benchmarks/face_overhead.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="8,1024", help="message sizes in bytes, comma-separated (default 8,1024)")
    parser.add_argument("--sweeps", type=int, default=41, help="sweeps per size (default 41)")
    parser.add_argument("--calls", type=int, default=300, help="calls of each variant per sweep (default 300)")
    return parser


def _variants(world, x, out):
    raw = world.Dup()
    face = wrap(world)
    engine = face.comm
    variants = {
        "mpi4py": lambda: raw.Allreduce(x, out, op=MPI.SUM),
        "face": lambda: face.Allreduce(x, out, op=MPI.SUM),
        "commkit": lambda: engine.allreduce(x, out=out),
    }
    # Persistent requests, made once (every rank makes them in the same order).
    requests = []
    try:
        native = raw.Allreduce_init(x, out, op=MPI.SUM)
    except NotImplementedError:  # an MPI library older than MPI-4: no raw persistent collective to compare
        native = None
    if native is not None:
        requests.append(native)
        variants["mpi4py_init"] = lambda: (native.Start(), native.Wait())
    ours = face.Allreduce_init(x, out, op=MPI.SUM)
    engines = engine.allreduce_init(x, out=out)
    requests += [ours, engines]
    variants["face_init"] = lambda: (ours.Start(), ours.Wait())
    variants["commkit_init"] = lambda: (engines.start(), engines.wait())
    return raw, face, variants, requests


def _sweep(world, run, calls):
    world.Barrier()
    start = time.perf_counter()
    for _ in range(calls):
        run()
    return (time.perf_counter() - start) / calls


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    sizes = [int(s) for s in args.sizes.split(",")]
    rows, paired = [], {}
    for nbytes in sizes:
        x = np.random.default_rng(rank).random(max(nbytes // 4, 1)).astype(np.float32)
        out = np.empty_like(x)
        raw, face, variants, requests = _variants(world, x, out)
        names = list(variants)
        expected = np.empty_like(x)
        raw.Allreduce(x, expected, op=MPI.SUM)
        for name in names:  # warm up, and check every variant computes the same sum
            out[...] = 0
            variants[name]()
            if not np.allclose(out, expected, rtol=1e-6):
                raise SystemExit(f"{name} computed a different sum than mpi4py at {nbytes} B.")
        times = {name: [] for name in names}
        for sweep in range(args.sweeps):
            k = sweep % len(names)
            for name in names[k:] + names[:k]:  # rotate which variant runs first
                times[name].append(_sweep(world, variants[name], args.calls))
        for name in names:
            t = np.array(times[name]) * 1e6
            rows.append((nbytes, name, np.median(t), np.percentile(t, 10), np.percentile(t, 90)))
        for variant, engine in (("face", "commkit"), ("face_init", "commkit_init")):
            own = (np.array(times[variant]) - np.array(times[engine])) * 1e6
            paired[nbytes, variant] = (np.median(own), np.percentile(own, 10), np.percentile(own, 90))
        for request in requests:  # mpi4py's and the face's have Free(), the communicator's free()
            (request.Free if hasattr(request, "Free") else request.free)()
        face.comm.free()  # the face wraps COMM_WORLD itself: free only its private contexts
        raw.Free()
    if rank == 0:
        print(f"# float32 sum allreduce, {size} ranks, {MPI.Get_library_version().splitlines()[0].strip()}, "
              f"{args.sweeps} sweeps x {args.calls} calls, median us per call [p10-p90 of sweeps]")
        print(f"{'bytes':>6}  {'variant':<12} {'us/call':>8}  spread")
        by_size = {}
        for nbytes, name, med, lo, hi in rows:
            by_size.setdefault(nbytes, {})[name] = med
            print(f"{nbytes:>6}  {name:<12} {med:8.2f}  [{lo:.2f}-{hi:.2f}]")
        for nbytes, meds in by_size.items():
            med, lo, hi = paired[nbytes, "face"]
            print(f"{nbytes:>6}  face own cost: {meds['face'] - meds['commkit']:.2f} us between medians, "
                  f"{med:.2f} us [{lo:.2f}-{hi:.2f}] paired within sweeps; face / mpi4py "
                  f"{meds['face'] / meds['mpi4py']:.2f}x, commkit / mpi4py {meds['commkit'] / meds['mpi4py']:.2f}x")
            med, lo, hi = paired[nbytes, "face_init"]
            versus = (f"face_init / mpi4py_init {meds['face_init'] / meds['mpi4py_init']:.2f}x, "
                      if "mpi4py_init" in meds else "")
            print(f"{nbytes:>6}  face_init own cost: {meds['face_init'] - meds['commkit_init']:.2f} us between "
                  f"medians, {med:.2f} us [{lo:.2f}-{hi:.2f}] paired within sweeps; {versus}"
                  f"face_init / mpi4py {meds['face_init'] / meds['mpi4py']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
