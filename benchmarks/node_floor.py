#!/usr/bin/env python
"""The node engine against the memory floor and MPI's own collectives, on one node.

    mpiexec -n 2 python benchmarks/node_floor.py            # the full table (minutes)
    mpiexec -n 2 python benchmarks/node_floor.py --quick    # a smoke run (seconds)
    mpiexec -n 4 python benchmarks/node_floor.py --collectives reduce gather --sizes 64K 4M
    mpiexec -n 2 python benchmarks/node_floor.py --new-arrays --sizes 16K 64K   # a new input every call

Float32 sum, at 64 KiB, 1, 4 and 32 MiB per rank. Timed in one job, interleaved
(the variants in a new order every sweep, the same on every rank), each sweep ``--calls``
back-to-back calls after a barrier, its time per call the slowest rank's; a
cell is the median over sweeps, a ratio the median of the per-sweep ratios,
against MPI's own call (its in-place form for an in-place row, where it has one).

Every call first writes its input, as a program's call sends what it has just
computed: the same copy from the same source for every variant of a
collective, on every rank that reads an input (a broadcast's and a scatter's
root alone), timed with the call. An input never written again stays clean in
the caches and flatters the variants that send the caller's own array. With
``--new-arrays`` each call's input is a new copy of that source instead, as in
a loop that makes new arrays (the shared arrays' rows and the floor keep
writing their own).

allreduce, each in place (``out=x``) and not:

* ``write``: the input's write alone, which every row includes (the floor
  ratios printed last take it out of both sides);
* ``floor``: the memory work no allreduce can avoid, numpy only: every rank's
  input and output lie in one MPI shared window; rank r adds its 1/p slice of
  every input into its output, then (one barrier) copies every other slice of
  the result from its owner's output;
* ``mpi``: ``MPI_Allreduce`` on a ``Dup`` of ``COMM_WORLD``;
* ``commkit``: ``comm.allreduce(x, out=out)``, the default selection (``shm`` where
  the table names it, with the table's chunk size);
* ``ring``: ``comm.allreduce(x, algorithm="ring")``;
* ``shm``: ``comm.allreduce(x, algorithm="shm")`` (the node engine);
* ``shm shared``: the same on arrays of ``comm.shared_empty`` (its zero-copy
  form: peers read each other's arrays where they lie, as the floor does).

The other collectives: ``shm`` against ``mpi``, root 0 where there is one:
broadcast (``Bcast``), reduce (``Reduce``), gather and scatter (``Gather``,
``Scatter``; the size is one rank's block), allgather (``Allgather``),
reduce_scatter (``Reduce_scatter_block``), and alltoall (``Alltoall``; the size
is one rank's whole input, p blocks), and barrier (``Barrier``: no data, what a
node call's waits cost, timed at every size alike); ``commkit``, the default selection
(a two-sided algorithm, or ``shm`` where the table names it), runs beside each (the broadcast in place too, as
``Bcast`` is, and so does ``shm``); broadcast, allgather, reduce_scatter and
alltoall also on shared arrays (``shm shared``; the broadcast in place, as
``Bcast`` is). Every ``shm`` result is checked
against MPI's once per size. The load average is printed with the table:
timings on a loaded machine say nothing; so is the memory's copy bandwidth,
measured before and after the table, every rank copying at once.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for path in (HERE, ROOT):  # the checkout's commkit and the benchmark helpers
    if path not in sys.path:
        sys.path.insert(0, path)

import numpy as np  # noqa: E402
from _tasks import copy_bandwidth  # noqa: E402
from mpi4py import MPI  # noqa: E402

import commkit as ck  # noqa: E402

SIZES = (64 << 10, 1 << 20, 4 << 20, 32 << 20)
COLLECTIVES = ("allreduce", "broadcast", "reduce", "gather", "scatter", "allgather", "reduce_scatter", "alltoall",
               "barrier")
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20}


def _size(text: str) -> int:
    """``64K``, ``4M`` or a number of bytes: a message size, a multiple of 4 bytes (float32)."""
    unit = text[-1:].upper() if text[-1:].upper() in _UNITS else ""
    try:
        nbytes = int(text[:len(text) - len(unit)]) * _UNITS[unit]
    except ValueError:
        nbytes = 0
    if nbytes < 4 or nbytes % 4:
        raise argparse.ArgumentTypeError(f"a size is a positive multiple of 4 bytes such as 64K or 4M, got {text!r}")
    return nbytes


def _parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="two sizes, few sweeps: proves the script runs")
    parser.add_argument("--sweeps", type=int, default=15, help="sweeps per size (default 15)")
    parser.add_argument("--calls", type=int, default=0, help="calls per sweep (default: about 20 ms of work)")
    parser.add_argument("--sizes", type=_size, nargs="+", help="sizes per rank (default 64K 1M 4M 32M)")
    parser.add_argument("--new-arrays", action="store_true",
                        help="each call on a new copy of its input, as a loop that makes new arrays calls (default: "
                             "one input array per variant, written again before each call)")
    parser.add_argument("--collectives", nargs="+", choices=COLLECTIVES, default=list(COLLECTIVES),
                        help="which collectives to time (default all)")
    return parser


class Floor:
    """Every rank's input and output of one size in one shared window (the floor's memory)."""

    def __init__(self, raw, n):
        p, r = raw.Get_size(), raw.Get_rank()
        self.raw = raw
        self.win = MPI.Win.Allocate_shared(2 * n * 4, 4, comm=raw)
        self.win.Lock_all(MPI.MODE_NOCHECK)  # a passive epoch: Win_sync is the memory barrier inside it
        self.ins, self.outs = [], []
        for q in range(p):
            buf, _ = self.win.Shared_query(q)
            both = np.frombuffer(buf, np.float32, 2 * n)
            self.ins.append(both[:n])
            self.outs.append(both[n:])
        self.slices = [(q * n // p, (q + 1) * n // p) for q in range(p)]
        self.rank = r

    def run(self):
        lo, hi = self.slices[self.rank]
        out = self.outs[self.rank]
        np.add(self.ins[0][lo:hi], self.ins[1][lo:hi], out=out[lo:hi])
        for src in self.ins[2:]:
            np.add(out[lo:hi], src[lo:hi], out=out[lo:hi])
        self.win.Sync()
        self.raw.Barrier()
        self.win.Sync()
        for q, (a, b) in enumerate(self.slices):
            if q != self.rank:
                out[a:b] = self.outs[q][a:b]
        self.raw.Barrier()  # the next run may overwrite what a peer still copies

    def free(self):
        self.win.Unlock_all()
        self.win.Free()


def variants(comm, sc, raw, n, rng, new_arrays=False):
    """``{collective: {name: callable}}`` for vectors of ``n`` float32 elements, and a check of each.

    ``new_arrays``: each call's input a new array (see ``fed``), else one written again before each call.
    """
    p = comm.size
    is_root = comm.rank == 0
    x = rng.standard_normal(n).astype(np.float32)
    floor = Floor(raw, n)
    floor.ins[comm.rank][:] = x
    out, y = np.empty_like(x), x.copy()
    xs, rs = np.tile(x, p), np.empty(n, np.float32)
    gathered = np.empty((p, n), np.float32)
    block = np.empty(n, np.float32)
    blocks = rng.standard_normal((p, n)).astype(np.float32)
    a2a = rng.standard_normal((p, n // p)).astype(np.float32)
    a2a_out = np.empty_like(a2a)
    # The zero-copy forms' arrays (shared_empty: the library frees them at the end of the job), and their
    # calls, on a communicator of their own (sc): on one with shared arrays a node call on new arrays takes
    # the general path, which looks for them (docs/node.md).
    xsh, osh, ysh = (sc.shared_empty(n, np.float32) for _ in range(3))
    xsh[:] = x
    bsh = sc.shared_empty(n, np.float32)
    gsh = sc.shared_empty((p, n), np.float32)
    xssh, rssh = sc.shared_empty(p * n, np.float32), sc.shared_empty(n, np.float32)
    xssh[:] = xs
    a2ash, a2ash_out = sc.shared_empty((p, n // p), np.float32), sc.shared_empty((p, n // p), np.float32)
    a2ash[:] = a2a
    sum_ = MPI.SUM
    # Each call first writes its input (a program's call sends what it has just computed): the same copy, from
    # the same source, for every variant of a collective, where this rank reads an input. An input left
    # unwritten between calls is clean in the caches, which flattered the variants whose input is the
    # caller's array (MPI's, the two-sided algorithms): a peer that has read a buffer makes the next write to
    # it dearer. With ``new_arrays`` the input is a new copy of its source at every call instead (a shared
    # array's variant keeps writing its own, as it must, and so does the floor's window).
    xi, xsi = np.empty_like(x), sc.shared_empty(n, np.float32)  # allreduce, reduce, gather, allgather inputs
    bi = np.empty_like(x)  # a broadcast root's input, not in place
    blocks_i, xs_i, a2a_i = np.empty_like(blocks), np.empty_like(xs), np.empty_like(a2a)

    def fed(call, buf, src, fixed=False):
        """``call(input)`` after writing ``buf`` from ``src`` (or on a new copy of ``src``: ``new_arrays``)."""
        if new_arrays and not fixed:
            return lambda: call(src.copy())
        return lambda: (np.copyto(buf, src), call(buf))

    def fed_root(call, buf, src, fixed=False):  # only the root reads an input; the others pass their buffer as it is
        return fed(call, buf, src, fixed) if is_root else lambda: call(buf)

    table = {
        "allreduce": {
            "write": fed(lambda v: None, xi, x),  # the input's write alone, which every row's time includes
            "floor": fed(lambda v: floor.run(), floor.ins[comm.rank], x, fixed=True),
            "mpi": fed(lambda v: raw.Allreduce(v, out, sum_), xi, x),
            "mpi in place": fed(lambda v: raw.Allreduce(MPI.IN_PLACE, v, sum_), y, x),
            "commkit": fed(lambda v: comm.allreduce(v, out=out), xi, x),
            "commkit in place": fed(lambda v: comm.allreduce(v, out=v), y, x),
            "ring": fed(lambda v: comm.allreduce(v, out=out, algorithm="ring"), xi, x),
            "ring in place": fed(lambda v: comm.allreduce(v, out=v, algorithm="ring"), y, x),
            "shm": fed(lambda v: comm.allreduce(v, out=out, algorithm="shm"), xi, x),
            "shm in place": fed(lambda v: comm.allreduce(v, out=v, algorithm="shm"), y, x),
            "shm shared": fed(lambda v: sc.allreduce(v, out=osh, algorithm="shm"), xsh, x, fixed=True),
            "shm shared in place": fed(lambda v: sc.allreduce(v, out=v, algorithm="shm"), ysh, x, fixed=True),
        },
        "broadcast": {
            "mpi": fed_root(lambda v: raw.Bcast(v, root=0), block, x),
            "commkit": fed_root(lambda v: comm.broadcast(v, root=0, out=block), bi, x),
            "commkit in place": fed_root(lambda v: comm.broadcast(v, root=0, out=v), block, x),
            "shm": fed_root(lambda v: comm.broadcast(v, root=0, out=block, algorithm="shm"), bi, x),
            "shm in place": fed_root(lambda v: comm.broadcast(v, root=0, out=v, algorithm="shm"), block, x),
            "shm shared": fed_root(lambda v: sc.broadcast(v, root=0, out=v, algorithm="shm"), bsh, x, fixed=True),
        },
        "reduce": {
            "mpi": fed(lambda v: raw.Reduce(v, out, sum_, root=0), xi, x),
            "commkit": fed(lambda v: comm.reduce(v, root=0, out=out if is_root else None), xi, x),
            "shm": fed(lambda v: comm.reduce(v, root=0, out=out if is_root else None, algorithm="shm"), xi, x),
        },
        "gather": {
            "mpi": fed(lambda v: raw.Gather(v, gathered, root=0), xi, x),
            "commkit": fed(lambda v: comm.gather(v, root=0, out=gathered if is_root else None), xi, x),
            "shm": fed(lambda v: comm.gather(v, root=0, out=gathered if is_root else None, algorithm="shm"), xi, x),
        },
        "scatter": {
            "mpi": fed_root(lambda v: raw.Scatter(v, block, root=0), blocks_i, blocks),
            "commkit": fed_root(lambda v: comm.scatter(v if is_root else None, root=0, out=block), blocks_i, blocks),
            "shm": fed_root(lambda v: comm.scatter(v if is_root else None, root=0, out=block, algorithm="shm"),
                            blocks_i, blocks),
        },
        "allgather": {
            "mpi": fed(lambda v: raw.Allgather(v, gathered), xi, x),
            "commkit": fed(lambda v: comm.allgather(v, out=gathered), xi, x),
            "shm": fed(lambda v: comm.allgather(v, out=gathered, algorithm="shm"), xi, x),
            "shm shared": fed(lambda v: sc.allgather(v, out=gsh, algorithm="shm"), xsi, x, fixed=True),
        },
        "reduce_scatter": {
            "mpi": fed(lambda v: raw.Reduce_scatter_block(v, rs, sum_), xs_i, xs),
            "commkit": fed(lambda v: comm.reduce_scatter(v, out=rs), xs_i, xs),
            "shm": fed(lambda v: comm.reduce_scatter(v, out=rs, algorithm="shm"), xs_i, xs),
            "shm shared": fed(lambda v: sc.reduce_scatter(v, out=rssh, algorithm="shm"), xssh, xs, fixed=True),
        },
        "barrier": {  # no data: what a node call's synchronisation costs (the same at every size)
            "mpi": raw.Barrier,
            "commkit": comm.barrier,
            "shm": lambda: comm.barrier(algorithm="shm"),
        },
        "alltoall": {
            "mpi": fed(lambda v: raw.Alltoall(v, a2a_out), a2a_i, a2a),
            "commkit": fed(lambda v: comm.alltoall(v, out=a2a_out), a2a_i, a2a),
            "shm": fed(lambda v: comm.alltoall(v, out=a2a_out, algorithm="shm"), a2a_i, a2a),
            "shm shared": fed(lambda v: sc.alltoall(v, out=a2ash_out, algorithm="shm"), a2ash, a2a, fixed=True),
        },
    }
    # Each commkit variant against MPI's result on the same data, once.
    want = np.empty_like(x)
    raw.Allreduce(x, want, sum_)
    for name in ("ring", "shm"):
        np.testing.assert_allclose(comm.allreduce(x, algorithm=name), want, rtol=1e-4, atol=1e-3)
    sc.allreduce(xsh, out=osh, algorithm="shm")
    np.testing.assert_array_equal(osh, comm.allreduce(x, algorithm="shm"))  # the same folds, the same bits
    floor.run()
    np.testing.assert_allclose(floor.outs[comm.rank], want, rtol=1e-4, atol=1e-3)
    # The other shm collectives against MPI's on the same data: sums close (another fold order), the rest equal.
    ref = x.copy()
    raw.Bcast(ref, root=0)
    np.testing.assert_array_equal(comm.broadcast(x, root=0, algorithm="shm"), ref)
    block[:] = x
    comm.broadcast(block, root=0, out=block, algorithm="shm")
    np.testing.assert_array_equal(block, ref)
    bsh[:] = x
    sc.broadcast(bsh, root=0, out=bsh, algorithm="shm")
    np.testing.assert_array_equal(bsh, ref)
    raw.Reduce(x, ref, sum_, root=0)
    got = comm.reduce(x, root=0, algorithm="shm")
    assert (got is None) != is_root
    if is_root:
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-3)
    raw.Gather(x, gathered, root=0)
    got = comm.gather(x, root=0, algorithm="shm")
    assert (got is None) != is_root
    if is_root:
        np.testing.assert_array_equal(got, gathered)
    raw.Scatter(blocks, ref, root=0)
    np.testing.assert_array_equal(comm.scatter(blocks if is_root else None, root=0, out=block, algorithm="shm"), ref)
    raw.Allgather(x, gathered)
    np.testing.assert_array_equal(comm.allgather(x, algorithm="shm"), gathered)
    sc.allgather(xsh, out=gsh, algorithm="shm")
    np.testing.assert_array_equal(gsh, gathered)
    raw.Reduce_scatter_block(xs, rs, sum_)
    np.testing.assert_allclose(comm.reduce_scatter(xs, algorithm="shm"), rs, rtol=1e-4, atol=1e-3)
    sc.reduce_scatter(xssh, out=rssh, algorithm="shm")
    np.testing.assert_allclose(rssh, rs, rtol=1e-4, atol=1e-3)
    raw.Alltoall(a2a, a2a_out)
    np.testing.assert_array_equal(comm.alltoall(a2a, algorithm="shm"), a2a_out)
    sc.alltoall(a2ash, out=a2ash_out, algorithm="shm")
    np.testing.assert_array_equal(a2ash_out, a2a_out)
    return table, floor


def time_sweep(raw, fns, calls, order):
    """Seconds per call of each variant in ``order``: the slowest rank's."""
    times = {}
    for name in order:
        fn = fns[name]
        raw.Barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times[name] = raw.allreduce((time.perf_counter() - t0) / calls, op=MPI.MAX)
    return times


def between_ranks(script: str):
    """``(comm, raw)``: commkit's world and a ``Dup`` of ``COMM_WORLD``; None, having said why, on one rank."""
    comm = ck.init()
    if comm.size < 2:
        print(f"{script} compares collectives between ranks: run it under mpiexec -n 2 or more.", file=sys.stderr)
        return None
    return comm, MPI.COMM_WORLD.Dup()


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    started = between_ranks("node_floor.py")
    if started is None:
        return 2
    comm, raw = started
    shared_comm = comm.dup()  # the shared arrays' (see variants)
    sizes = args.sizes or (SIZES[:2] if args.quick else SIZES)
    sweeps = 3 if args.quick else args.sweeps
    rng = np.random.default_rng(comm.rank)
    rows = []
    loads = [os.getloadavg()[0]]
    bandwidth = [copy_bandwidth(raw)]
    for nbytes in sizes:
        n = nbytes // 4
        table, floor = variants(comm, shared_comm, raw, n, rng, args.new_arrays)
        calls = args.calls or max(1, min(200, (20 << 20) // nbytes))
        for collective, fns in table.items():
            if collective not in args.collectives:
                continue
            names = list(fns)
            samples = {name: [] for name in names}
            for s in range(sweeps):
                # A new order every sweep, the same on every rank: a large message's first call finds in the
                # caches what the variant before it left, so no variant may always follow the same one (as
                # rotating the order would have it: "commkit" after "mpi", "shm" after "commkit in place").
                order = random.Random(s).sample(names, len(names))
                for name, t in time_sweep(raw, fns, 200 if collective == "barrier" else calls, order).items():
                    samples[name].append(t)
            for name in names:
                # (an in-place row against MPI's in-place call, where the collective has one of its own)
                base = samples["mpi in place" if "in place" in name and "mpi in place" in samples else "mpi"]
                ratio = statistics.median(a / b for a, b in zip(samples[name], base))
                rows.append((collective, nbytes, name, statistics.median(samples[name]), ratio))
            loads.append(os.getloadavg()[0])
        floor.free()
    bandwidth.append(copy_bandwidth(raw))
    if comm.rank == 0:
        print(f"{comm.size} ranks, float32 sum, {sweeps} sweeps; load average {min(loads):.2f}-{max(loads):.2f} "
              f"(timings on a loaded machine say nothing)")
        print(f"memory: a 32 MiB np.copyto on every rank at once ran at {bandwidth[0]:.1f} GB/s a rank before the "
              f"table and {bandwidth[1]:.1f} after it (a ratio that moves with this moved with the machine)")
        print(f"{'collective':<15} {'size':>8} {'variant':<20} {'median':>12} {'/ mpi':>7}")
        for collective, nbytes, name, t, ratio in rows:
            print(f"{collective:<15} {nbytes >> 10:>6}Ki {name:<20} {t * 1e6:>10.1f}us {ratio:>7.2f}")
        # Against the floor, each time less the input's write (the "write" row), which the floor's own work
        # leaves out: the allreduce's memory work against the least any allreduce must do.
        floors = {nbytes: t for c, nbytes, name, t, _ in rows if c == "allreduce" and name == "floor"}
        writes = {nbytes: t for c, nbytes, name, t, _ in rows if c == "allreduce" and name == "write"}
        for collective, nbytes, name, t, _ in rows:
            if (collective == "allreduce" and name in ("commkit", "shm", "shm shared", "ring", "mpi")
                    and nbytes in floors):
                w = writes[nbytes]
                print(f"allreduce {nbytes >> 10}Ki: {name} / floor = {(t - w) / (floors[nbytes] - w):.2f} "
                      f"(each less the input's write, {w * 1e6:.1f}us)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
