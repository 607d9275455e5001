"""The cost of checking a collective receive's size: MPI_Sendrecv of 8 B with and without it, 2 ranks.

Run: mpiexec -n 2 python benchmarks/recv_check.py [--calls N] [--rounds R]

Four forms, interleaved round by round on one Dup of COMM_WORLD (rank 0 prints):
  raw       comm.Sendrecv(s, peer, tag, r, peer, tag)              (no status: commkit before the check)
  status    the same with a preallocated MPI.Status, then status.Get_count() == 8 or refuse(status)
  bound     MPITransport.bind_transfer(...)(tag), the plan op called as a function
  sendrecv  MPITransport.sendrecv(...), the interpreter's fast path (builds both buffer specs per call)
Medians over the rounds of the per-call time, and the check's cost (status - raw).
Timings are meaningful only on a quiet machine with ranks <= cores.
"""

import argparse
import os
import statistics
import sys
import time

import numpy as np
from mpi4py import MPI

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # the checkout's commkit, also when it is not installed (or another copy is)

from commkit.transports.mpi import MPITransport  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD.Dup()
    rank, peer = comm.Get_rank(), 1 - comm.Get_rank()
    t = MPITransport(comm)
    sbuf, rbuf = np.full(8, rank, np.uint8), np.zeros(8, np.uint8)
    sspec, rspec, sendrecv = [sbuf, MPI.BYTE], [rbuf, MPI.BYTE], comm.Sendrecv
    status = MPI.Status()

    def refuse(st):  # what the transport raises; never reached here, the sizes agree
        raise RuntimeError(f"short message: {st.Get_count()} bytes")
    bound = t.bind_transfer([(peer, sbuf)], [(peer, rbuf)])
    tag = 5

    def raw(n):
        for _ in range(n):
            sendrecv(sspec, peer, tag, rspec, peer, tag)

    def checked(n):
        for _ in range(n):
            sendrecv(sspec, peer, tag, rspec, peer, tag, status); status.Get_count() == 8 or refuse(status)

    def bound_op(n):
        for _ in range(n):
            bound(tag)

    def transport(n):
        for _ in range(n):
            t.sendrecv(peer, sbuf, peer, rbuf, tag)

    forms = {"raw": raw, "status": checked, "bound": bound_op, "sendrecv": transport}
    times = {name: [] for name in forms}
    for form in forms.values():
        form(1000)  # warm up
    for _ in range(args.rounds):
        for name, form in forms.items():
            comm.Barrier()
            start = time.perf_counter()
            form(args.calls)
            times[name].append((time.perf_counter() - start) / args.calls * 1e6)
    if rank == 0:
        load = os.getloadavg()[0]
        print(f"MPI_Sendrecv of 8 B, 2 ranks, {args.calls} calls x {args.rounds} rounds, load {load:.2f}")
        for name, values in times.items():
            print(f"  {name:9s} median {statistics.median(values):6.3f} us/call "
                  f"(min {min(values):6.3f}, max {max(values):6.3f})")
        cost = statistics.median(times["status"]) - statistics.median(times["raw"])
        print(f"  the check: {cost * 1000:+.0f} ns/call (status - raw)")
    comm.Free()


if __name__ == "__main__":
    main()
