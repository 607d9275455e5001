"""What a call costs when it is not the same call on the same arrays again.

    mpiexec -n 2 python benchmarks/first_call.py [--sizes 8,1024] [--sweeps 9] [--calls 4000] [--algorithm A]

A repeated call on the same arrays runs a compiled plan (docs/call_cost.md).
A call without ``out`` runs a plan that allocates its result; a call on new
arrays of a known shape has its arguments checked and then runs the shape's
plan (``commkit.plan``); a call with a timeout and a nonblocking call run the
step interpreter (``commkit.schedule.execute``). This script times those forms
of a float32 sum allreduce (``recursive_doubling``, the algorithm the shipped
table picks at these sizes on 2 ranks) next to the raw mpi4py call on a
``Dup`` of COMM_WORLD (with the same output, with a new output each call,
which is what a caller who wants a fresh result writes, with a new input and
output as ``y = comm.allreduce(x.copy())`` has, and ``Iallreduce(...).Wait()``
for the i-form), on the same input, in
CPU time of rank 0
(``time.process_time``: a busy machine disturbs it less than wall time). The
variants rotate from sweep to sweep; each cell is the best sweep's time per
call, in microseconds. To compare two versions of commkit, run the script of
each checkout, alternating (it imports the commkit of the checkout it lives in).
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
if HERE not in sys.path:
    sys.path.insert(0, HERE)  # the benchmark helpers

import commkit as ck  # noqa: E402
from _tasks import calibration, calibration_line  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/first_call.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="8,1024", help="message sizes in bytes, comma-separated (default 8,1024)")
    parser.add_argument("--sweeps", type=int, default=9, help="sweeps (default 9)")
    parser.add_argument("--calls", type=int, default=4000, help="calls of each variant per sweep (default 4000)")
    parser.add_argument("--algorithm", default="recursive_doubling",
                        help="the allreduce algorithm (default recursive_doubling; native: MPI's own collective)")
    args = parser.parse_args(argv)
    comm = ck.init()
    raw = MPI.COMM_WORLD.Dup()
    alg = args.algorithm
    state = calibration_line(calibration(raw))
    if comm.rank == 0:
        print(f"# {state}")
        print(f"# float32 sum allreduce ({alg}), {comm.size} ranks, {args.sweeps} sweeps x {args.calls} calls, "
              f"best sweep, CPU us per call on rank 0; load average {os.getloadavg()[0]:.2f}")
        print(f"{'bytes':>6}  {'raw mpi4py':>10}  {'raw, new out':>12}  {'plan':>8}  {'no out':>8}  "
              f"{'new out':>8}  {'raw, new x':>10}  {'new x':>8}  {'new x, out':>10}  {'timeout':>8}  {'raw i-form':>10}  {'i-form':>8}")
    for size in (int(s) for s in args.sizes.split(",")):
        x = np.ones(max(size // 4, 1), np.float32)
        out = np.empty_like(x)
        def raw_new_out():
            result = np.empty_like(x)
            raw.Allreduce(x, result, MPI.SUM)
            return result

        def raw_new_x():  # what `y = comm.allreduce(x.copy())` does, written for mpi4py
            result = np.empty_like(x)
            raw.Allreduce(x.copy(), result, MPI.SUM)
            return result

        variants = {
            "raw mpi4py": lambda: raw.Allreduce(x, out, MPI.SUM),
            "raw, new out": raw_new_out,
            "plan": lambda: comm.allreduce(x, out=out, algorithm=alg),
            "no out": lambda: comm.allreduce(x, algorithm=alg),
            "new out": lambda: comm.allreduce(x, out=np.empty_like(x), algorithm=alg),
            "raw, new x": raw_new_x,
            "new x": lambda: comm.allreduce(x.copy(), algorithm=alg),
            "new x, out": lambda: comm.allreduce(x.copy(), out=np.empty_like(x), algorithm=alg),
            "timeout": lambda: comm.allreduce(x, out=out, algorithm=alg, timeout=60.0),
            "raw i-form": lambda: raw.Iallreduce(x, out, MPI.SUM).Wait(),
            "i-form": lambda: comm.iallreduce(x, out=out, algorithm=alg).wait(),
        }
        names = list(variants)
        best = dict.fromkeys(names, float("inf"))
        for sweep in range(args.sweeps):
            x[:] = sweep  # new data every sweep
            for name in names[sweep % len(names):] + names[:sweep % len(names)]:
                call = variants[name]
                comm.barrier()
                t0 = time.process_time()
                for _ in range(args.calls):
                    call()
                best[name] = min(best[name], (time.process_time() - t0) / args.calls * 1e6)
        if comm.rank == 0:
            print(f"{size:>6}  " + "  ".join(f"{best[n]:>{max(8, len(n))}.2f}" for n in names))
    raw.Free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
