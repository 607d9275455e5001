"""A tour of every collective, checked against NumPy: ``mpiexec -n 4 python -m commkit.demo``.

Each rank builds its input from its rank number, every rank can therefore
compute every other rank's input, and the demo checks each result against the
NumPy reference, printing (from rank 0) what was computed, which algorithm the
selector chose, and whether it matched. Without mpiexec it runs the same tour
on 4 threads (``python -m commkit.demo --local``). Exit status 1 if any check
failed.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

import commkit as ck


def _inputs(rank: int, n: int) -> np.ndarray:
    return np.random.default_rng(rank).integers(-9, 10, size=n).astype(np.int64)


def tour(comm, n: int = 6, out=print) -> int:
    """Run each collective once on ``comm``; rank 0 reports. Returns the number of failed checks."""
    p, r = comm.size, comm.rank
    xs = [_inputs(q, n) for q in range(p)]
    x = xs[r]
    total = np.sum(xs, axis=0)
    root = p - 1
    rows = []

    def check(name, got, want):
        algorithm = comm.last_algorithm
        ok = (got is None and want is None) or (got is not None and want is not None and np.array_equal(got, want))
        flags = comm.allgather_object(bool(ok))
        # Show the last rank's result: rank-dependent results (scan, scatter ...) are more telling there.
        results = comm.gather_object(got, 0)
        rows.append((name, algorithm, all(flags), results[-1] if results is not None else None))

    check("allreduce(sum)", comm.allreduce(x), total)
    check("allreduce(max)", comm.allreduce(x, "max"), np.max(xs, axis=0))
    check(f"reduce(prod) -> rank {root}", comm.reduce(x, "prod", root), np.prod(xs, axis=0) if r == root else None)
    check(f"broadcast from rank {root}", comm.broadcast(x, root), xs[root])
    check(f"gather(x[:2]) -> rank {root}", comm.gather(x[:2], root), np.stack([v[:2] for v in xs]) if r == root else None)
    check("allgather(rank)", comm.allgather(np.array(r)), np.arange(p))
    table = np.arange(p * 2).reshape(p, 2) * 10
    check("scatter(rows of a table) from 0", comm.scatter(table if r == 0 else None, 0, out=np.empty(2, np.int64)),
          table[r])
    blocks = np.tile(x[:2], p).reshape(p, 2)
    check("reduce_scatter(sum)", comm.reduce_scatter(blocks), np.sum([np.tile(v[:2], p).reshape(p, 2) for v in xs],
                                                                     axis=0)[r:r + 1])
    outgoing = np.array([[100 * r + j] for j in range(p)])
    check("alltoall", comm.alltoall(outgoing), np.array([[100 * j + r] for j in range(p)]))
    check("scan(sum)", comm.scan(x), np.sum(xs[: r + 1], axis=0))
    check("exscan(sum)", comm.exscan(x), np.sum(xs[:r], axis=0) if r else np.zeros(n, np.int64))
    comm.barrier()
    check("barrier", None, None)

    failures = sum(1 for row in rows if not row[2])
    if r == 0:
        out(f"commkit {ck.__version__} on {p} ranks ({comm.transport_name} transport); inputs: rank q holds")
        for q in range(p):
            out(f"  rank {q}: {xs[q].tolist()}")
        width = max(len(name) for name, *_ in rows)
        out(f"{'collective':<{width}}  {'algorithm':<19} {'check':<5} result on rank {p - 1}")
        for name, alg, ok, shown in rows:
            value = shown.tolist() if isinstance(shown, np.ndarray) else ("-" if shown is None else shown)
            out(f"{name:<{width}}  {alg:<19} {'OK   ' if ok else 'FAIL '} {value}")
        out(f"{len(rows) - failures}/{len(rows)} collectives match NumPy")
    return failures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m commkit.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--local", type=int, nargs="?", const=4, metavar="N",
                        help="run on N threads (default 4) instead of MPI")
    args = parser.parse_args(argv)
    if args.local:
        failures = ck.run_local(tour, args.local)
        return 1 if any(failures) else 0
    comm = ck.init(timeout=60)
    return 1 if tour(comm) else 0


if __name__ == "__main__":
    sys.exit(main())
