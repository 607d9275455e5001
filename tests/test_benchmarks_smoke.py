"""Short smokes of the benchmark scripts behind docs/benchmarks.md, so they keep working.

It runs ``compare.py --quick`` (two sizes, a few runs, 2 ranks) into a temporary
directory and checks that the page, the figures and the raw results are written,
parse, and hold no wrong result; and ``memory_floor.py --quick`` and
``inplace.py --quick``, which start their own 2-rank jobs, checking their tables
and that the floor leaves no shared segment behind; and ``node_floor.py
--quick``, ``poll_first.py``, ``overlap_loop.py`` and ``nonblocking_forms.py`` (a few calls) under 2-rank jobs; and ``new_arrays.py --quick``, with and
without glibc's settings. Benchmarks are never timed
unit tests: nothing here asserts on speed.
"""

from __future__ import annotations

import json
import os

import pytest

from conftest import benchmark_module, run_benchmark, run_benchmark_as_main

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SCRIPT = os.path.join(ROOT, "benchmarks", "compare.py")
FLOOR = os.path.join(ROOT, "benchmarks", "memory_floor.py")
INPLACE = os.path.join(ROOT, "benchmarks", "inplace.py")
NODE_FLOOR = os.path.join(ROOT, "benchmarks", "node_floor.py")
NODE_IFORMS = os.path.join(ROOT, "benchmarks", "node_iforms.py")
NEW_ARRAYS = os.path.join(ROOT, "benchmarks", "new_arrays.py")
POLL_FIRST = os.path.join(ROOT, "benchmarks", "poll_first.py")
OVERLAP_LOOP = os.path.join(ROOT, "benchmarks", "overlap_loop.py")
NONBLOCKING_FORMS = os.path.join(ROOT, "benchmarks", "nonblocking_forms.py")
COLLECTIVES = ("allreduce", "broadcast", "reduce", "allgather", "reduce_scatter", "alltoall")


def _report():
    return benchmark_module("_report")


def _floor_segments():
    return {name for name in os.listdir("/dev/shm") if name.startswith("commkit-floor-")} \
        if os.path.isdir("/dev/shm") else set()


@pytest.mark.mpi
def test_quick_memory_floor_prints_its_table_and_leaves_no_segment(mpi, tmp_path):
    before = _floor_segments()
    md = tmp_path / "floor.md"
    out = run_benchmark([FLOOR, "--quick", "--markdown", str(md)])
    assert "Command: `mpiexec -n 2 python benchmarks/memory_floor.py --quick" in out
    row = next(line for line in out.splitlines() if line.startswith("| 1 |"))
    assert row.count("|") == 13 and "Wrong results: 0." in out
    assert md.read_text() in out + "\n"
    assert _floor_segments() == before


@pytest.mark.mpi
def test_quick_node_floor_prints_its_table_beside_the_memory_bandwidth(mpi):
    out = run_benchmark_as_main(mpi, [NODE_FLOOR, "--quick", "--sizes", "64K", "--collectives", "allreduce", "barrier"], 300)
    assert "memory: a 32 MiB np.copyto on every rank at once ran at" in out, out
    assert "allreduce 64Ki: shm / floor = " in out and "barrier" in out, out


@pytest.mark.mpi
def test_quick_node_iforms_times_shm_against_the_two_sided_i_form(mpi):
    out = run_benchmark_as_main(mpi, [NODE_IFORMS, "--quick", "--sizes", "64K", "--collectives", "allreduce", "alltoall"], 300)
    assert "i-forms on new arrays" in out and "shm / two" in out, out
    assert "allreduce           64Ki" in out and "alltoall            64Ki" in out, out
    out = run_benchmark_as_main(mpi, [NODE_IFORMS, "--quick", "--persistent", "--sizes", "16K", "--collectives", "broadcast",
                         "scatter"], 300)
    assert "persistent requests" in out and "broadcast           16Ki" in out and "scatter             16Ki" in out, out


@pytest.mark.mpi
def test_poll_first_times_both_transfer_forms_beside_the_raw_call(mpi):
    out = run_benchmark_as_main(mpi, [POLL_FIRST, "--sweeps", "2", "--calls", "20", "--collectives", "allreduce,broadcast"], 120)
    assert "| collective | bytes | raw (us) | polled (us) | blocking (us) | polled / blocking" in out, out
    for row in ("| allreduce | 8 |", "| allreduce | 1024 |", "| broadcast | 8 |", "| broadcast | 1024 |"):
        assert row in out, out
    assert "The shipped rule for this library: a plan " in out and "machine state before the run" in out, out
    assert "Polled faster in " in out and " of 4 rows." in out, out


@pytest.mark.mpi
def test_overlap_loop_times_a_training_steps_loop_beside_mpi4pys(mpi):
    out = run_benchmark_as_main(mpi, [OVERLAP_LOOP, "--sweeps", "2", "--steps", "20", "--sizes", "8,64K"], 120)
    assert "| gradient bytes | raw step (us) | commkit step (us) | commkit / raw" in out, out
    assert "| 8 |" in out and "| 64K |" in out and "machine state before the run" in out, out


@pytest.mark.mpi
def test_nonblocking_forms_times_commkits_i_forms_beside_mpi4pys(mpi):
    out = run_benchmark_as_main(mpi, [NONBLOCKING_FORMS, "--sweeps", "2", "--calls", "20", "--sizes", "8,1K"], 120)
    assert "| bytes | raw i (us) | commkit i (us) | commkit i native (us) |" in out, out
    assert "| 8 |" in out and "| 1K |" in out and "machine state before the run" in out, out


@pytest.mark.mpi
def test_quick_inplace_table_covers_every_in_place_collective(mpi):
    out = run_benchmark([INPLACE, "--quick"])
    assert "Wrong results: 0." in out
    for collective in ("allreduce", "broadcast", "reduce", "scan", "exscan"):
        for name in ("raw mpi4py", "`native`"):
            assert f"| {collective} | {name} | 1 KiB |" in out, (collective, name)
    assert "| allreduce | `ring` | 64 KiB |" in out


@pytest.mark.mpi
def test_quick_new_arrays_table_says_which_allocator_settings_it_ran_with(mpi, tmp_path):
    md = tmp_path / "new.md"
    out = run_benchmark([NEW_ARRAYS, "--quick", "--markdown", str(md)])
    assert "Wrong results: 0." in out and "Allocator: glibc's defaults." in out
    assert "machine state before the run: raw 8 B Allreduce " in out and "; after it: " in out
    assert "| bytes | raw new | commkit new | commkit same | new / same |" in out
    assert "| 64 KiB |" in out and "| 256 KiB |" in out
    assert md.read_text() in out + "\n"
    kept = {"MALLOC_MMAP_THRESHOLD_": "268435456", "MALLOC_TRIM_THRESHOLD_": "536870912"}
    out = run_benchmark([NEW_ARRAYS, "--quick"], env=kept)
    assert "Allocator: MALLOC_MMAP_THRESHOLD_=268435456, MALLOC_TRIM_THRESHOLD_=536870912." in out
    assert "| 64 KiB |" in out and "Wrong results: 0." in out


@pytest.mark.mpi
def test_quick_comparison_writes_page_figures_and_right_results(mpi, tmp_path):
    # The script must clear overrides like this one.
    out = run_benchmark([SCRIPT, "--quick", "--out", str(tmp_path)], timeout=150, env={"COMMKIT_ALLREDUCE_ALGORITHM": "naive"})

    results = json.loads((tmp_path / "benchmarks.json").read_text())
    rows = results["bench"]["2"]["rows"]
    assert {r["collective"] for r in rows} == set(COLLECTIVES)
    forms = {"raw", "auto", "native"}
    for collective in COLLECTIVES:
        # In place where commkit allows out=x; the raw MPI_Bcast is in place by nature, so it has one form.
        want = set(forms)
        if collective in ("allreduce", "reduce"):
            want |= {f"{f} in place" for f in forms}
        elif collective == "broadcast":
            want |= {"auto in place", "native in place"}
        assert {r["algorithm"] for r in rows if r["collective"] == collective} == want, collective
    assert all(r["wrong"] == 0 and r["time_us"] > 0 for r in rows)
    assert sum(r["wrong"] for r in results["detail"]["2"]["rows"]) == 0
    # auto is the shipped table's choice, not the environment's override.
    assert {r["auto_choice"] for r in rows if r["collective"] == "allreduce"} == {"recursive_doubling"}
    assert "COMMKIT_ALLREDUCE_ALGORITHM" in results["meta"]["env_removed"]
    assert results["overhead"]["rows"] and results["null"]["rows"]
    assert [r["algorithm"] for r in results["rss"]] == ["auto", "native"]
    gloo = results["gloo"]
    assert gloo.get("skipped") or all(r["wrong"] == 0 for r in gloo["rows"])

    page = (tmp_path / "benchmarks.md").read_text()
    assert page.startswith("# Benchmarks")
    assert "python benchmarks/compare.py --quick" in page
    assert "reproduce: python benchmarks/compare.py --quick" in out and "## Targets" in out
    targets = page.split("## Targets", 1)[1].split("###", 1)[0]
    for collective in COLLECTIVES:
        assert f"| `{collective}` |" in targets
    assert "Wrong results in these runs (every form): **0**" in page
    for name in ("benchmarks.png", "benchmarks_algorithms.png"):
        png = tmp_path / "_static" / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"_static/{name}" in page


def test_page_keeps_the_hand_written_analysis_and_notes_a_skipped_gloo(tmp_path):
    report = _report()
    rows = [{"collective": "allreduce", "size": size, "algorithm": name, "rep": rep, "time_us": t,
             "spread": 0.05, "runs": 10, "wrong": 0, "auto_choice": "recursive_doubling"}
            for rep in range(2) for size, name, t in ((1024, "auto", 12.0), (1024, "raw", 10.0),
                                                      (8 << 20, "auto", 900.0), (8 << 20, "raw", 1000.0),
                                                      (8 << 20, "auto in place", 1100.0),
                                                      (8 << 20, "raw in place", 1000.0))]
    results = {"meta": {"collectives": ["allreduce"], "repeats": 2, "machine": {"mpi_library": "MPICH"}},
               "bench": {"2": {"rows": rows}}, "gloo": {"skipped": "torch is not installed"}}
    (tmp_path / "benchmarks.md").write_text(
        f"old page\n{report.ANALYSIS_START}\nThe 8 MiB cell misses because of X.\n{report.ANALYSIS_END}\n")
    report.write(results, str(tmp_path))
    page = (tmp_path / "benchmarks.md").read_text()
    assert "The 8 MiB cell misses because of X." in page and "old page" not in page
    assert "Skipped: torch is not installed" in page
    # Against the raw mpi4py call: 1 KiB: 1.2 <= 1.3 passes; 8 MiB: 0.9 > 0.8 misses, by 12%.
    line = next(line for line in page.splitlines() if line.startswith("| `allreduce` |"))
    assert line.count("PASS") == 1 and line.count("**MISS**") == 1
    assert "8 MiB 0.90 (+12%" in page
    # In place, 8 MiB: 1.1 over the raw in-place call, and slower than out of place (1.1 / 0.9).
    assert "8 MiB 1.10 (+38%" in page
    assert "| `allreduce` | `auto` | 1.22 at 8 MiB" in page


def test_pasted_tables_survive_a_rewrite(tmp_path):
    report = _report()
    results = {"meta": {"collectives": ["allreduce"], "repeats": 1, "machine": {"mpi_library": "MPICH"}}}
    (tmp_path / "benchmarks.md").write_text(f"{report.PASTED_START}\n| floor | 1.00 |\n{report.PASTED_END}\n")
    report.write(results, str(tmp_path))
    assert "| floor | 1.00 |" in (tmp_path / "benchmarks.md").read_text()
