"""An ordinary mpi4py program -- a parallel sample sort with vector collectives -- switched to commkit by one line.

Run it:

    mpiexec -n 4 python examples/mpi4py_sample_sort.py

Delete the line marked "the one line" and this is a plain mpi4py program
with the same output. With the line, Gather, Bcast, Alltoall, Allreduce,
Exscan and Reduce run commkit's algorithms, and so do Alltoallv and Gatherv
(vector collectives, whose counts differ from rank to rank); the point-to-point
check runs MPI's own, through the same wrapped communicator.
"""

import numpy as np
from mpi4py import MPI

from commkit.compat.mpi4py import wrap

comm = MPI.COMM_WORLD
comm = wrap(comm)  # the one line: collectives now run commkit's algorithms

rank, size = comm.Get_rank(), comm.Get_size()

# Every rank draws its own unsorted keys: a skewed mix, so the buckets differ in size.
rng = np.random.default_rng([2024, rank])
n_local = 1000 + 137 * rank
keys = np.concatenate([rng.integers(0, 1_000_000, n_local // 2),
                       rng.integers(400_000, 410_000, n_local - n_local // 2)]).astype(np.int64)
keys.sort()

# Regular sampling: each rank offers size-1 samples; the root picks the splitters
# from all of them and broadcasts them.
picks = keys[(np.arange(1, size) * len(keys)) // size] if size > 1 else np.empty(0, np.int64)
samples = np.empty(size * (size - 1), np.int64) if rank == 0 else None
comm.Gather([picks, MPI.INT64_T], [samples, MPI.INT64_T], root=0)
splitters = np.empty(size - 1, np.int64)
if rank == 0:
    ordered = np.sort(samples)
    splitters[:] = ordered[(np.arange(1, size) * len(ordered)) // size]
comm.Bcast([splitters, MPI.INT64_T], root=0)

# Bucket j of every rank goes to rank j: exchange the counts (Alltoall), then the
# keys themselves with counts and displacements that differ per rank (Alltoallv).
bounds = np.searchsorted(keys, splitters, side="right")
send_counts = np.diff(np.concatenate([[0], bounds, [len(keys)]])).astype(np.int64)
recv_counts = np.empty(size, np.int64)
comm.Alltoall(send_counts, recv_counts)
send_displs = np.concatenate([[0], np.cumsum(send_counts)[:-1]])
recv_displs = np.concatenate([[0], np.cumsum(recv_counts)[:-1]])
mine = np.empty(int(recv_counts.sum()), np.int64)
comm.Alltoallv([keys, (send_counts, send_displs), MPI.INT64_T],
               [mine, (recv_counts, recv_displs), MPI.INT64_T])
mine.sort()

# Check the result collectively: no key lost, buckets in order across ranks
# (each rank's smallest key is >= its left neighbour's largest, via Sendrecv).
total = np.array([len(keys), len(mine)], np.int64)
comm.Allreduce(MPI.IN_PLACE, total, op=MPI.SUM)
edge = np.array([mine[-1] if len(mine) else np.iinfo(np.int64).min], np.int64)
left_edge = np.array([np.iinfo(np.int64).min], np.int64)
comm.Sendrecv(edge, dest=(rank + 1) % size, sendtag=7, recvbuf=left_edge, source=(rank - 1) % size, recvtag=7)
ordered = np.array([rank == 0 or len(mine) == 0 or mine[0] >= left_edge[0]], np.int32)
comm.Allreduce(MPI.IN_PLACE, [ordered, MPI.INT], op=MPI.LAND)

# Global positions: Exscan gives each rank the number of keys before its bucket.
offset = np.array([len(mine)], np.int64)
comm.Exscan(MPI.IN_PLACE, offset, op=MPI.SUM)
if rank == 0:
    offset[0] = 0  # MPI leaves rank 0's Exscan result undefined
checksum = np.array([int((mine * (offset[0] + np.arange(len(mine)) + 1) % 1_000_003).sum())], np.int64)
comm.Reduce(MPI.IN_PLACE if rank == 0 else checksum, checksum if rank == 0 else None, op=MPI.SUM, root=0)

# The root collects the whole sorted sequence with Gatherv (counts differ per rank).
counts = np.empty(size, np.int64) if rank == 0 else None
comm.Gather(np.array([len(mine)], np.int64), counts, root=0)
result = None
if rank == 0:
    result = np.empty(int(counts.sum()), np.int64)
comm.Gatherv(mine, [result, counts, None, MPI.INT64_T] if rank == 0 else None, root=0)

if rank == 0:
    print(f"{size} ranks sorted {total[0]} keys; {total[1]} arrived in the buckets")
    print(f"splitters {splitters.tolist()}")
    print(f"bucket sizes {counts.tolist()}; buckets in order: {bool(ordered[0])}")
    print(f"sorted: {bool(np.all(np.diff(result) >= 0))}; first {result[:3].tolist()} last {result[-3:].tolist()}")
    print(f"position-weighted checksum {checksum[0]}")
