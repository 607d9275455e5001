"""Make the figures under docs/_static/figures (committed, so building the docs runs nothing).

    python docs/make_figures.py              # everything
    python docs/make_figures.py schedules    # only the algorithm diagrams (simulator, no run)
    python docs/make_figures.py teaching     # ring allreduce on a circle, and its buffer states (threads)
    python docs/make_figures.py real         # the traced MPI run: diagram, timeline, Chrome trace
    python docs/make_figures.py bench        # measured vs predicted (runs `commkit bench` and `commkit tune`)
    python docs/make_figures.py real bench --reuse   # redraw from the stored JSON, run nothing

The schedule diagrams come from the simulator: they show what every rank of
the schedule does, with no process started. The real-run figures come from
``commkit.trace`` around collectives on 4 MPI processes started with the
``mpiexec`` of the installed MPI; the measured-vs-model figure from
``commkit bench`` and ``commkit tune`` on 2 processes (speed is quoted only
for ranks <= cores). Needs matplotlib, and MPI for ``real`` and ``bench``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "_static", "figures")
sys.path.insert(0, os.path.dirname(HERE))

DPI = 110

# (file name, collective, algorithm, p, bytes, extra simulator options): one or more per family page.
SCHEDULES = [
    ("naive_broadcast", "broadcast", "naive", 6, 4096, {}),
    ("naive_reduce", "reduce", "naive", 6, 4096, {}),
    ("ring_allreduce", "allreduce", "ring", 4, 4096, {}),
    ("ring_allgather", "allgather", "ring", 5, 5 * 1024, {}),
    ("ring_broadcast", "broadcast", "ring", 6, 6 * 1024, {}),
    ("recursive_doubling_allreduce", "allreduce", "recursive_doubling", 8, 4096, {}),
    ("recursive_doubling_allreduce_p6", "allreduce", "recursive_doubling", 6, 4096, {}),
    ("recursive_halving_reduce_scatter", "reduce_scatter", "recursive_halving", 8, 8 * 1024, {}),
    ("rabenseifner_allreduce", "allreduce", "rabenseifner", 8, 8 * 1024, {}),
    ("binomial_broadcast", "broadcast", "binomial", 8, 4096, {}),
    ("binomial_gather", "gather", "binomial", 8, 8 * 512, {}),
    ("binomial_reduce_root2", "reduce", "binomial", 6, 4096, {"root": 2}),
    ("bruck_allgather", "allgather", "bruck", 6, 6 * 512, {}),
    ("bruck_alltoall", "alltoall", "bruck", 5, 256, {}),
    ("pairwise_alltoall", "alltoall", "pairwise", 5, 256, {}),
    ("dissemination_barrier", "barrier", "dissemination", 6, 0, {}),
]


def schedules() -> None:
    from commkit import plot

    for name, collective, algorithm, p, nbytes, options in SCHEDULES:
        fig = plot.schedule_diagram(collective, algorithm, p, nbytes, **options)
        _save(fig, f"{name}.png")


def teaching() -> None:
    """The textbook pictures of ring allreduce: the rounds on a circle, and whose data each rank holds."""
    from commkit import plot

    _save(plot.schedule_diagram("allreduce", "ring", 4, 4096, layout="circle"), "ring_allreduce_circle.png")
    _save(plot.buffer_states("allreduce", "ring", 4), "ring_allreduce_states.png")


# -- the real run -------------------------------------------------------------------------------------

REAL_NPROCS = 4


def _traced_job(path: str) -> None:
    """Runs on every rank of the MPI job: warm up, then trace an allreduce and a broadcast."""
    import numpy as np

    import commkit as ck

    comm = ck.init("mpi")
    x = np.random.default_rng(comm.rank).standard_normal(1 << 18).astype(np.float32)  # 1 MiB
    for _ in range(3):
        comm.allreduce(x)
        comm.broadcast(x)
    comm.barrier()
    with ck.trace(comm) as t:
        comm.allreduce(x)   # the default table picks rabenseifner (commutative, > 2 KiB, p > 2)
        comm.broadcast(x)   # ... and ring (scatter + allgather) above 12 KiB on 3 or more ranks
    if comm.rank == 0:
        from mpi4py import MPI

        meta = {"nprocs": comm.size, "cores": os.cpu_count(), "hosts": sorted(set(t.hosts or [])),
                "mpi": MPI.Get_library_version().replace("\x00", "").splitlines()[0].strip()}
        with open(path, "w") as f:
            json.dump({"format": "commkit-trace", "version": 1, "meta": meta, "events": t.events}, f)


def real(reuse: bool) -> None:
    from commkit._mpiexec import run_job
    from commkit.tracing import load, to_chrome

    stored = os.path.join(OUT, "real_run_events.json")
    if reuse:
        events = load(stored)
        with open(stored) as f:
            meta = json.load(f)["meta"]
        _draw_real(events, meta)
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "events.json")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
        job = run_job(REAL_NPROCS, [sys.executable, os.path.abspath(__file__), "_traced_job", path], timeout=300,
                      env=env)
        if job.returncode != 0:
            sys.exit(f"the traced MPI run failed:\n{job.stdout}\n{job.stderr}")
        events = load(path)
        with open(path) as f:
            meta = json.load(f)["meta"]
    with open(stored, "w") as f:
        json.dump({"format": "commkit-trace", "version": 1, "meta": meta, "events": events}, f, indent=0)
    to_chrome(events, os.path.join(OUT, "real_run_chrome_trace.json"))
    _draw_real(events, meta)


def _draw_real(events, meta) -> None:
    from commkit import plot

    where = f"{meta['nprocs']} MPI processes, {meta['cores']} cores" + (
        ", oversubscribed" if meta["nprocs"] > meta["cores"] else "")
    print(f"traced on {where}; {meta['mpi']}")
    _save(plot.diagram(events, title=f"Traced run: {_names(events)} ({where})"), "real_run_diagram.png")
    _save(plot.timeline(events, title=f"Traced run: {_names(events)} ({where})"), "real_run_timeline.png")


def _names(events) -> str:
    from commkit.trace import calls

    return " then ".join(c.name for c in calls(events))


# -- measured against the model -----------------------------------------------------------------------

BENCH_JSON = os.path.join(OUT, "bench_allreduce_p2.json")
TUNE_JSON = os.path.join(OUT, "tune_p2.json")


def bench(reuse: bool) -> None:
    from commkit import plot

    if not reuse:
        cli = [sys.executable, "-m", "commkit"]
        subprocess.run(cli + ["tune", "-n", "2", "--quick", "-c", "allreduce", "-O", TUNE_JSON], check=True)
        subprocess.run(cli + ["bench", "-n", "2", "-c", "allreduce", "-b", "8", "-e", "4M", "-f", "4", "-i", "20",
                              "--json", BENCH_JSON], check=True)
    with open(BENCH_JSON) as f:
        rows = json.load(f)
    with open(TUNE_JSON) as f:
        measured = json.load(f)["measured"]
    fig = plot.predicted_vs_measured(rows, measured["alpha"], measured["beta"], measured["gamma"])
    _save(fig, "predicted_vs_measured_allreduce_p2.png")


def _save(fig, name: str) -> None:
    path = os.path.join(OUT, name)
    fig.savefig(path, dpi=DPI)
    print(f"wrote {os.path.relpath(path)}")


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "_traced_job":
        _traced_job(sys.argv[2])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", nargs="*", help="schedules, teaching, real and/or bench (default: all four)")
    parser.add_argument("--reuse", action="store_true", help="real, bench: redraw from the stored JSON, run nothing")
    args = parser.parse_args()
    sets = {"schedules", "teaching", "real", "bench"}
    what = set(args.what) or sets
    if what - sets:
        parser.error(f"unknown figure set(s) {sorted(what - sets)}")
    os.makedirs(OUT, exist_ok=True)
    if "schedules" in what:
        schedules()
    if "teaching" in what:
        teaching()
    if "real" in what:
        real(args.reuse)
    if "bench" in what:
        bench(args.reuse)


if __name__ == "__main__":
    main()
