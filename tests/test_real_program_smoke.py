"""A short smoke of ``benchmarks/real_program.py``, so it keeps working; and its tables' verdicts.

The script runs ``--quick`` under ``mpiexec -n 2`` (as a user runs it inside a
job of their own) and must print its two tables with every collective and size,
check every result, and write the same section to ``--markdown``. Benchmarks
are never timed unit tests: nothing here asserts on speed; the verdict logic
is checked on made-up times instead.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import benchmark_module

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SCRIPT = os.path.join(ROOT, "benchmarks", "real_program.py")
COLLECTIVES = ("allreduce", "broadcast", "allgather", "reduce", "gather", "scatter", "reduce_scatter")
TIME_HEADER = ("| collective | bytes | raw new | commkit new x | commkit new x, out | raw i | commkit i | "
               "commkit timed | face |")
RATIO_HEADER = ("| collective | bytes | new x / raw new | new x, out / raw new | i / raw i | timed / raw new | "
                "face / raw new |")


@pytest.mark.mpi
def test_quick_run_under_mpiexec_prints_both_tables_with_right_results(mpi, tmp_path):
    from commkit._mpiexec import run_job

    md = tmp_path / "real.md"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    result = run_job(2, [sys.executable, SCRIPT, "--quick", "--markdown", str(md)], timeout=240, env=env, cwd=ROOT)
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert "Traceback" not in result.stderr
    out = result.stdout
    assert out.startswith("## A real program: new arrays every call")
    assert "Command: `mpiexec -n 2 python benchmarks/real_program.py --quick" in out
    assert "Wrong results: 0." in out and "load average" in out
    # The machine's state beside the table, before and after the run (see _tasks.calibration).
    assert re.search(r"machine state before the run: raw 8 B Allreduce [0-9.]+ us, sum\(range\(1000\)\) [0-9.]+ us, "
                     r"8 MiB copy [0-9.]+ GB/s a rank; after it: raw 8 B Allreduce", out), out
    assert TIME_HEADER in out and RATIO_HEADER in out
    assert "| target (allreduce) | | ≤ 1.3 | ≤ 1.3 | ≤ 1.5 | ≤ 1.3 | ≤ 1.4 |" in out
    for collective in COLLECTIVES:
        for size in ("8 B", "1 KiB"):
            rows = [line for line in out.splitlines() if line.startswith(f"| {collective} | {size} |")]
            assert len(rows) == 2, (collective, size, rows)  # one in each table
            time_row, ratio_row = rows
            assert time_row.count("|") == TIME_HEADER.count("|")
            assert ratio_row.count("|") == RATIO_HEADER.count("|")
            verdicts = ratio_row.count(" ok") + ratio_row.count("**missed**")
            assert verdicts == (5 if collective == "allreduce" else 0), ratio_row
    assert "Targets (allreduce, 2 ranks" in out
    assert md.read_text() in out + "\n"


@pytest.mark.parametrize("argv, words", [
    (["--sizes", "12"], "sizes must be positive multiples of 8 bytes (float64 elements); got [12]."),
    (["--collectives", "allreduce,scan"], "--collectives takes names from"),
    (["--sweeps", "0"], "--sweeps and --calls must be at least 1; got 0 and"),
])
def test_bad_arguments_are_refused_before_any_job_starts(argv, words):
    env = {k: v for k, v in os.environ.items() if k not in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK",
                                                              "PMIX_RANK")}
    result = subprocess.run([sys.executable, SCRIPT, *argv], capture_output=True, text=True, timeout=60, env=env,
                            cwd=ROOT)
    assert result.returncode != 0
    assert words in result.stderr and "Traceback" not in result.stderr
    assert "## A real program" not in result.stdout


def _samples(mine, base):
    """Made-up per-sweep times (seconds) of every column: ``mine`` for the commkit columns, ``base`` for raw."""
    real = benchmark_module("real_program")
    return {c: [mine if c.startswith("commkit") or c == real.FACE else base] * 3 for c in real.COLUMNS}


def test_targets_apply_to_allreduce_only_and_each_ratio_has_its_own():
    real = benchmark_module("real_program")
    # 1.35x: over the 1.3 of the blocking forms, under the 1.4 of the face and the 1.5 of the i-form.
    rows = [("allreduce", 8, _samples(1.35e-6, 1e-6)), ("broadcast", 8, _samples(5e-6, 1e-6))]
    text, met, missed = real.ratio_table(rows)
    line = next(row for row in text.splitlines() if row.startswith("| allreduce | 8 B |"))
    cells = [c.strip() for c in line.strip("|").split("|")][2:]
    assert cells == ["1.35 (1.35–1.35) **missed**", "1.35 (1.35–1.35) **missed**", "1.35 (1.35–1.35) ok",
                     "1.35 (1.35–1.35) **missed**", "1.35 (1.35–1.35) ok"]
    assert met == 2 and len(missed) == 3
    assert missed[0] == "allreduce 8 B new x / raw new 1.35 (target 1.3)"
    broadcast = next(row for row in text.splitlines() if row.startswith("| broadcast | 8 B |"))
    assert "5.00 (5.00–5.00)" in broadcast and "ok" not in broadcast and "missed" not in broadcast


def test_a_ratio_is_the_median_of_the_ratios_within_each_sweep():
    real = benchmark_module("real_program")
    samples = {"commkit new x": [2.0, 3.0, 12.0], "raw new": [1.0, 2.0, 4.0]}
    assert real.ratio_cell(samples, "commkit new x", "raw new") == (2.0, 1.5, 3.0)


def test_expected_results_follow_the_inputs_of_every_rank():
    real = benchmark_module("real_program")
    inputs = [real.data(3, r, 5) for r in range(3)]
    assert not np.array_equal(inputs[0], inputs[1]) and not np.array_equal(real.data(3, 0, 5), real.data(4, 0, 5))
    assert np.array_equal(real.expected("allreduce", 3, 3, 5), inputs[0] + inputs[1] + inputs[2])
    assert np.array_equal(real.expected("broadcast", 3, 3, 5), inputs[0])
    assert real.expected("allgather", 3, 3, 5).shape == (3, 5)
    assert np.array_equal(real.expected("allgather", 3, 3, 5)[2], inputs[2])
    assert np.array_equal(real.expected("gather", 3, 3, 5), np.stack(inputs))
    assert real.expected("gather", 3, 3, 5, rank=1) is None and real.expected("reduce", 3, 3, 5, rank=2) is None
    # A scatter's root holds every rank's block; rank r gets its own, into the zeros it gave.
    assert np.array_equal(real.base_of("scatter", 3, 0, 3, 5), np.stack(inputs))
    assert np.array_equal(real.base_of("scatter", 3, 2, 3, 5), np.zeros(5))
    assert np.array_equal(real.expected("scatter", 3, 3, 5, rank=2), inputs[2])
    # A reduce_scatter's every rank holds a block per rank; rank r gets its block of the sum.
    wide = [real.base_of("reduce_scatter", 3, r, 3, 5) for r in range(3)]
    assert wide[1].shape == (15,) and np.array_equal(wide[1], real.data(3, 1, 15))
    assert np.array_equal(real.expected("reduce_scatter", 3, 3, 5, rank=1), (wide[0] + wide[1] + wide[2])[5:10])
