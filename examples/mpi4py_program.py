"""An ordinary mpi4py program -- 1-D diffusion with halo exchange -- switched to commkit by one line.

Run it:

    mpiexec -n 4 python examples/mpi4py_program.py

Delete the line marked "the one line" and this is a plain mpi4py program
with the same output: every call below is mpi4py's API, with mpi4py's buffer
specifications, MPI.IN_PLACE and MPI.Request.Waitall. With the line, the
collectives run commkit's algorithms; point-to-point stays MPI's.
"""

import numpy as np
from mpi4py import MPI

from commkit.compat.mpi4py import wrap

comm = MPI.COMM_WORLD
comm = wrap(comm)  # the one line: collectives now run commkit's algorithms

rank, size = comm.Get_rank(), comm.Get_size()

# The root chooses the problem and broadcasts it: points per rank, steps, seed.
params = np.zeros(3, dtype=np.int64)
if rank == 0:
    params[:] = [64, 200, 2024]
comm.Bcast(params, root=0)
n, steps, seed = (int(v) for v in params)

# The root draws the initial field and scatters equal slices; each rank keeps
# one ghost cell on either side for its neighbours' edge values.
field = np.random.default_rng(seed).random(n * size) if rank == 0 else None
u = np.zeros(n + 2)
comm.Scatter([field, MPI.DOUBLE], [u[1:-1], MPI.DOUBLE], root=0)

# Explicit diffusion on a ring of ranks: exchange edges, then update.
left, right = (rank - 1) % size, (rank + 1) % size
for _ in range(steps):
    requests = [
        comm.Irecv([u[0:1], MPI.DOUBLE], source=left, tag=0),
        comm.Irecv([u[-1:], MPI.DOUBLE], source=right, tag=1),
        comm.Isend([u[1:2], MPI.DOUBLE], dest=left, tag=1),
        comm.Isend([u[-2:-1], MPI.DOUBLE], dest=right, tag=0),
    ]
    MPI.Request.Waitall(requests)
    u[1:-1] += 0.25 * (u[:-2] - 2 * u[1:-1] + u[2:])
mine = u[1:-1]

# Global mean and variance (in place), and the extremes.
sums = np.array([mine.sum(), (mine ** 2).sum()])
comm.Allreduce(MPI.IN_PLACE, [sums, MPI.DOUBLE], op=MPI.SUM)
mean = sums[0] / (n * size)
var = sums[1] / (n * size) - mean ** 2
lo, hi = np.empty(1), np.empty(1)
comm.Allreduce(mine.min(keepdims=True), lo, op=MPI.MIN)
comm.Allreduce(mine.max(keepdims=True), hi, op=MPI.MAX)

# A histogram with 4 bins per rank: Reduce_scatter_block hands each rank the
# global counts of its own 4 bins; Exscan numbers the values above the mean.
edges = np.linspace(lo[0], hi[0], 4 * size + 1)
local_hist = np.histogram(mine, bins=edges)[0].astype(np.int64)
my_bins = np.empty(4, dtype=np.int64)
comm.Reduce_scatter_block([local_hist, MPI.INT64_T], [my_bins, MPI.INT64_T], op=MPI.SUM)
above = np.array([np.count_nonzero(mine > mean)], dtype=np.int64)
first = above.copy()
comm.Exscan(MPI.IN_PLACE, first, op=MPI.SUM)
if rank == 0:
    first[0] = 0  # MPI leaves rank 0's Exscan result undefined

# The root collects every rank's share and reports (one printer keeps the output in order).
hist = np.empty(4 * size, dtype=np.int64) if rank == 0 else None
firsts = np.empty(size, dtype=np.int64) if rank == 0 else None
comm.Gather(my_bins, hist, root=0)
comm.Gather([first, 1, MPI.INT64_T], [firsts, 1, MPI.INT64_T], root=0)
if rank == 0:
    print(f"{size} ranks, {n * size} points, {steps} steps")
    print(f"mean {mean:.9f}  variance {var:.9f}  min {lo[0]:.9f}  max {hi[0]:.9f}")
    print(f"histogram {hist.tolist()} (total {hist.sum()})")
    print(f"values above the mean: rank r numbers its own from {firsts.tolist()}")
