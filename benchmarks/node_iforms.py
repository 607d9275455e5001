#!/usr/bin/env python
"""A node call's i-form against the two-sided default's, on new arrays every call: where the table's rules start.

    mpiexec -n 2 python benchmarks/node_iforms.py                      # sizes 32K to 1M, every collective
    mpiexec -n 2 python benchmarks/node_iforms.py --quick              # a smoke run (seconds)
    mpiexec -n 2 python benchmarks/node_iforms.py --sizes 64K 128K --collectives allreduce broadcast
    mpiexec -n 2 python benchmarks/node_iforms.py --persistent      # persistent requests instead

A blocking node call runs its compiled program, an i-form (``comm.iallreduce(x).wait()``)
the program's generator (``NodeProgram.steps``), and a persistent request the
interpreter's steps at every start; a node rule that wins for the one can lose for
the other at the same size. This script times the i-forms against the two-sided
default's, for the table's rules (docs/node.md). Each row is one collective and size
(node_floor.py's sizes: a rank's vector; a rank's block for gather, scatter,
allgather and reduce_scatter; a rank's whole input for alltoall), every call on a
new copy of its input, timed in one job: ``shm`` forced against the default the
table gives without its node rules (``two``, on a communicator of its own whose
first call of each shape reads that table). Sweeps interleaved in a new order each,
the same on every rank; a cell is the median over sweeps of the slowest rank's time
per call, the ratio the median of the per-sweep ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for path in (HERE, ROOT):
    if path not in sys.path:
        sys.path.insert(0, path)

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402
from node_floor import _size, between_ranks  # noqa: E402

COLLECTIVES = ("allreduce", "broadcast", "reduce", "gather", "scatter", "allgather", "reduce_scatter", "alltoall")
SIZES = ("32K", "64K", "128K", "256K", "512K", "1M")


def _parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="two sizes, two sweeps: proves the script runs")
    parser.add_argument("--sweeps", type=int, default=9, help="sweeps per collective and size (default 9)")
    parser.add_argument("--sizes", type=_size, nargs="+", help="sizes per rank (default 32K to 1M)")
    parser.add_argument("--collectives", nargs="+", choices=COLLECTIVES, default=list(COLLECTIVES))
    parser.add_argument("--persistent", action="store_true",
                        help="persistent requests (*_init, then start() and wait() per call, the input written "
                             "into the request's buffer) instead of i-forms")
    return parser


def no_node_table() -> str:
    """A tuning file: the shipped table less its node rules (the two-sided default)."""
    from commkit.selection import default_table

    table = {name: [rule for rule in rules if not rule.get("one_node")] if isinstance(rules, list) else rules
             for name, rules in default_table().items()}
    fd, path = tempfile.mkstemp(suffix=".json", prefix="commkit-no-node-")
    with os.fdopen(fd, "w") as f:
        json.dump(table, f)
    return path


def forms(comm, two, n):
    """``{collective: (input, {"two": call, "shm": call})}``: each call takes a new input and waits for its i-form."""
    p, r, root = comm.size, comm.rank, 0
    x = np.random.default_rng(r).standard_normal(n).astype(np.float32)
    blocks = np.random.default_rng(9).standard_normal((p, n)).astype(np.float32)
    xs, a2a = np.tile(x, p), np.tile(x[: max(1, n // p)], (p, 1))
    block = np.empty(n, np.float32)
    return {
        "allreduce": (x, {"two": lambda v: two.iallreduce(v).wait(),
                          "shm": lambda v: comm.iallreduce(v, algorithm="shm").wait()}),
        "broadcast": (x, {"two": lambda v: two.ibroadcast(v, root).wait(),
                          "shm": lambda v: comm.ibroadcast(v, root, algorithm="shm").wait()}),
        "reduce": (x, {"two": lambda v: two.ireduce(v, root=root).wait(),
                       "shm": lambda v: comm.ireduce(v, root=root, algorithm="shm").wait()}),
        "gather": (x, {"two": lambda v: two.igather(v, root).wait(),
                       "shm": lambda v: comm.igather(v, root, algorithm="shm").wait()}),
        "scatter": (blocks, {"two": lambda v: two.iscatter(v if r == root else None, root, out=block).wait(),
                             "shm": lambda v: comm.iscatter(v if r == root else None, root, out=block,
                                                            algorithm="shm").wait()}),
        "allgather": (x, {"two": lambda v: two.iallgather(v).wait(),
                          "shm": lambda v: comm.iallgather(v, algorithm="shm").wait()}),
        "reduce_scatter": (xs, {"two": lambda v: two.ireduce_scatter(v).wait(),
                                "shm": lambda v: comm.ireduce_scatter(v, algorithm="shm").wait()}),
        "alltoall": (a2a, {"two": lambda v: two.ialltoall(v).wait(),
                           "shm": lambda v: comm.ialltoall(v, algorithm="shm").wait()}),
    }


def persistent_forms(comm, two, n):
    """As :func:`forms` for persistent requests: each call writes the request's input, then starts and waits.

    ``{collective: (input, {"two": call, "shm": call}, requests)}``: the requests are made here, once, on
    their own input buffers (the same data as :func:`forms` gives its calls).
    """
    p, r, root = comm.size, comm.rank, 0
    made = forms(comm, two, n)
    inputs = [made[c][0] for c in COLLECTIVES]
    table = {}
    makers = {
        "allreduce": lambda c, v, **k: c.allreduce_init(v, **k),
        "broadcast": lambda c, v, **k: c.broadcast_init(v, root, **k),
        "reduce": lambda c, v, **k: c.reduce_init(v, root=root, **k),
        "gather": lambda c, v, **k: c.gather_init(v, root, **k),
        "scatter": lambda c, v, **k: c.scatter_init(v if r == root else None, root, out=np.empty(n, np.float32), **k),
        "allgather": lambda c, v, **k: c.allgather_init(v, **k),
        "reduce_scatter": lambda c, v, **k: c.reduce_scatter_init(v, **k),
        "alltoall": lambda c, v, **k: c.alltoall_init(v, **k),
    }
    for collective, source in zip(COLLECTIVES, inputs):
        calls, requests = {}, []
        for name, c, kwargs in (("two", two, {}), ("shm", comm, {"algorithm": "shm"})):
            buf = source.copy()
            request = makers[collective](c, buf, **kwargs)
            requests.append(request)
            calls[name] = (lambda request, buf: lambda v: (np.copyto(buf, v), request.start().wait()))(request, buf)
        table[collective] = (source, calls, requests)
    return table


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    started = between_ranks("node_iforms.py")
    if started is None:
        return 2
    comm, raw = started
    two = comm.dup()
    sizes = args.sizes or [_size(s) for s in (SIZES[:2] if args.quick else SIZES)]
    sweeps = 2 if args.quick else args.sweeps
    table = no_node_table() if comm.rank == 0 else None
    table = raw.bcast(table, root=0)
    loads = [os.getloadavg()[0]]
    rows = []
    try:
        for nbytes in sizes:
            if args.persistent:  # (the requests choose when made: the two-sided ones under the table less its
                os.environ["COMMKIT_TUNING"] = table  # node rules, shm by name)
                calls_of = persistent_forms(comm, two, nbytes // 4)
                del os.environ["COMMKIT_TUNING"]
            else:
                calls_of = {c: (base, calls, ()) for c, (base, calls) in forms(comm, two, nbytes // 4).items()}
            for collective in args.collectives:
                base, calls, _ = calls_of[collective]
                os.environ["COMMKIT_TUNING"] = table  # an i-form's first call of the shape chooses; its plan is kept
                calls["two"](base.copy())
                del os.environ["COMMKIT_TUNING"]
                n_calls = 5 if args.quick else max(20, min(200, (1 << 20) // nbytes))
                for call in calls.values():
                    for _ in range(3):
                        call(base.copy())
                samples = {name: [] for name in calls}
                for s in range(sweeps):
                    for name in random.Random(s).sample(list(calls), len(calls)):
                        call = calls[name]
                        raw.Barrier()
                        t0 = time.perf_counter()
                        for _ in range(n_calls):
                            call(base.copy())
                        samples[name].append(raw.allreduce((time.perf_counter() - t0) / n_calls, op=MPI.MAX))
                ratio = statistics.median(a / b for a, b in zip(samples["shm"], samples["two"]))
                rows.append((collective, nbytes, statistics.median(samples["two"]), statistics.median(samples["shm"]),
                             ratio))
            for _, _, requests in calls_of.values():
                for request in requests:
                    request.free()
            loads.append(os.getloadavg()[0])
    finally:
        raw.Barrier()
        if comm.rank == 0:
            os.unlink(table)
    if comm.rank == 0:
        form = "persistent requests" if args.persistent else "i-forms on new arrays"
        print(f"{comm.size} ranks, {form}, float32, {sweeps} sweeps; load average "
              f"{min(loads):.2f}-{max(loads):.2f} (timings on a loaded machine say nothing); MPI: "
              f"{MPI.Get_library_version().splitlines()[0].strip()}")
        print(f"{'collective':<15} {'size':>8} {'two-sided':>12} {'shm':>10} {'shm / two':>10}")
        for collective, nbytes, two_t, shm_t, ratio in rows:
            print(f"{collective:<15} {nbytes >> 10:>6}Ki {two_t * 1e6:>10.1f}us {shm_t * 1e6:>8.1f}us {ratio:>10.2f}")
    two.free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
