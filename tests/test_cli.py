"""The ``commkit`` command: bench and tune under mpiexec, sim, and clear errors instead of tracebacks.

The MPI runs are smoke tests (2 processes, few sizes, few repetitions): their
output must parse and every result must be right. No test asserts on speed.
Every process a test starts runs in its own process group and is ended with it.
"""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import os
import sys

import pytest

import commkit as ck
from commkit import algorithms, bench, selection
from commkit.collectives import FIXED
from commkit.cli import main

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MPI_VARS = ("PMI_RANK", "PMI_SIZE", "PMI_FD", "PMI_PORT", "HYDRA_CONTROL_FD", "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "COMMKIT_CLI_CHILD", "COMMKIT_TUNING")


def run_commkit(args, *, timeout=240, env=None, pythonpath=()):
    """``python -m commkit ARGS`` in its own process group, ended (with any mpiexec it starts) on timeout."""
    from commkit._mpiexec import run_group

    full = {k: v for k, v in os.environ.items() if k not in MPI_VARS}
    full["PYTHONPATH"] = os.pathsep.join([*pythonpath, ROOT, full.get("PYTHONPATH", "")])
    full.update(env or {})
    return run_group([sys.executable, "-m", "commkit", *args], timeout=timeout, env=full, cwd=ROOT)


def parse_table(text):
    """Data lines of the printed table, as lists of cells."""
    return [line.split() for line in text.splitlines() if line.strip() and not line.startswith("#")]


# -- bench under mpiexec ----------------------------------------------------------------------------


@pytest.mark.mpi
def test_bench_starts_its_own_job_and_every_result_is_right(mpi, tmp_path):
    out_json, out_csv = tmp_path / "r.json", tmp_path / "r.csv"
    result = run_commkit(["bench", "-n", "2", "-c", ",".join(FIXED), "--sizes", "8,1K,12345",
                          "-i", "3", "-w", "1", "-r", "1", "--json", str(out_json), "--csv", str(out_csv)])
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    rows = json.loads(out_json.read_text())["rows"]
    meta = json.loads(out_json.read_text())["meta"]
    assert meta["nprocs"] == 2 and meta["transport"] == "mpi"
    assert {r["collective"] for r in rows} == set(FIXED)
    assert all(r["wrong"] == 0 for r in rows)
    for collective in FIXED:
        names = {r["algorithm"] for r in rows if r["collective"] == collective}
        assert names == set(bench.candidates(collective, 2)), collective
    native = [r for r in rows if r["algorithm"] == "native"]
    assert native and all(r["vs_native"] == pytest.approx(1.0) for r in native)
    assert all(r["time_us"] > 0 and r["runs"] == 3 for r in rows)
    # Sizes round down to whole elements (and whole per-rank blocks): 12345 B of float32 -> 12344 B.
    assert {r["size"] for r in rows if r["collective"] == "allreduce"} == {8, 1024, 12344}
    # The CSV and the printed table say the same.
    with open(out_csv) as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    table = parse_table(result.stdout)
    assert len(table) == len(rows) and all(len(cells) == 11 for cells in table)
    assert {cells[-1] for cells in table} == {"0"}


def test_bench_table_keeps_every_cell_apart_however_wide_the_numbers():
    # On a machine at load 5-6 one of three timed runs can take thousands of times the others: a
    # spread of 499950% filled its column, ran into the time before it, and the table parser found
    # ten cells instead of eleven (the bench test above failed that way in a full run).
    wide = bench.Row("allreduce", 8, 2, "float32", "sum", "double_binary_tree", 2, 1234567.8, 1.0, 4999.5,
                     123456.789, 123456.789, 12345.67, 0, 3)
    table = parse_table(bench.format_table([wide]))
    assert len(table) == 1 and len(table[0]) == 11, table
    assert table[0][6] == "499950%"


@pytest.mark.mpi
def test_bench_under_mpiexec_writes_json_to_stdout(mpi):
    from commkit._mpiexec import run_job

    env = {k: v for k, v in os.environ.items() if k not in MPI_VARS}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    result = run_job(2, [sys.executable, "-m", "commkit", "bench", "-c", "allreduce", "-c", "alltoall",
                         "-a", "ring,pairwise,native,auto", "--sizes", "64,4K", "-i", "2", "-w", "1",
                         "-d", "int32", "-o", "max", "--json", "-"], timeout=240, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)["rows"]  # nothing else on stdout
    assert {(r["collective"], r["algorithm"]) for r in rows} == {
        ("allreduce", "ring"), ("allreduce", "native"), ("allreduce", "auto"),
        ("alltoall", "pairwise"), ("alltoall", "native"), ("alltoall", "auto")}
    assert all(r["wrong"] == 0 and r["dtype"] == "int32" for r in rows)


# -- the bench engine in-process, on the threads world -------------------------------------------------


def test_wrong_results_are_counted(monkeypatch):
    real_run = bench.Case.run

    def broken(case, algorithm):
        result = real_run(case, algorithm)
        if algorithm == "ring" and case.comm.rank == 1:
            result.reshape(-1)[0] += 1
        return result

    monkeypatch.setattr(bench.Case, "run", broken)
    rows = ck.run_local(lambda comm: bench.run(comm, ["allreduce"], [64], names=["ring", "naive"], iters=4,
                                               warmup=1), 3)
    by_name = {r.algorithm: r for r in rows[0]}
    assert by_name["ring"].wrong == 5 and by_name["naive"].wrong == 0
    assert rows[0] == rows[2]  # every rank returns the same rows


def test_an_algorithm_that_writes_nothing_is_caught(monkeypatch):
    real_run = bench.Case.run

    def lazy(case, algorithm):
        if algorithm == "ring":
            return case.out  # whatever the last run left there
        return real_run(case, algorithm)

    monkeypatch.setattr(bench.Case, "run", lazy)
    rows = ck.run_local(lambda comm: bench.run(comm, ["allgather"], [96], names=["naive", "ring"], iters=3,
                                               warmup=0), 2)[0]
    assert {r.algorithm: r.wrong for r in rows} == {"naive": 0, "ring": 6}


@pytest.mark.parametrize("collective", FIXED)
def test_every_collective_checks_out_on_threads(collective):
    rows = ck.run_local(lambda comm: bench.run(comm, [collective], [0, 40, 1000], dtype="int16", op="bxor",
                                               root=2, iters=2, warmup=1), 3)[0]
    assert rows and all(r.wrong == 0 for r in rows)
    assert "native" not in {r.algorithm for r in rows}  # the threads world has no library collectives


def test_output_formats_round_trip():
    rows = ck.run_local(lambda comm: bench.run(comm, ["allreduce"], [8, 4096], iters=2, warmup=0), 2)[0]
    text = bench.format_table(rows)
    assert "size(B)" in text and "busbw(GB/s)" in text and "# wrong results: 0" in text
    assert len(parse_table(text)) == len(rows)
    parsed = list(csv.DictReader(io.StringIO(bench.to_csv(rows))))
    assert [int(r["size"]) for r in parsed] == [r.size for r in rows]
    assert json.loads(bench.to_json(rows, {"x": 1}))["rows"][0]["algorithm"] == rows[0].algorithm


def test_bandwidth_columns_follow_nccl_tests():
    assert bench.busbw_factor("allreduce", 8) == pytest.approx(2 * 7 / 8)
    assert bench.busbw_factor("allgather", 8) == bench.busbw_factor("reduce_scatter", 8) == pytest.approx(7 / 8)
    assert bench.busbw_factor("alltoall", 8) == pytest.approx(7 / 8)
    assert bench.busbw_factor("broadcast", 8) == bench.busbw_factor("reduce", 8) == 1.0


def test_sizes_parse():
    assert bench.parse_size("64K") == 65536 and bench.parse_size("1MiB") == 1 << 20 and bench.parse_size("8") == 8
    assert bench.parse_sizes("8,1K,1M") == [8, 1024, 1 << 20]
    assert bench.parse_sizes("8:64") == [8, 16, 32, 64] and bench.parse_sizes("1K:1M:32") == [1024, 32768, 1 << 20]
    assert bench.size_range(0, 4, 2) == [0, 1, 2, 4]
    for bad in ("", "x", "-8", "1.5", "8:1:2", "8:1M:1", "1Q"):
        with pytest.raises(ck.InvalidArgument):
            bench.parse_sizes(bad)


def test_progress_bar_only_when_asked():
    stream = io.StringIO()
    bar = bench.Progress(4, stream=stream)
    bar.advance("x")
    assert stream.getvalue() == ""  # not a terminal
    bar = bench.Progress(4, force=True, stream=stream)
    bar.advance("allreduce 1K")
    assert "[#######" in stream.getvalue() and "1/4 allreduce 1K" in stream.getvalue()


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    rows = ck.run_local(lambda comm: bench.run(comm, ["allreduce", "allgather"], [8, 4096], iters=2, warmup=0), 2)[0]
    path = tmp_path / "bench.png"
    bench.plot(rows, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- errors: one clear line, no traceback ---------------------------------------------------------------


@pytest.mark.parametrize("args,message", [
    (["bench", "--sizes", "1X"], "invalid size '1X'"),
    (["bench", "-b", "1M", "-e", "1K"], "smallest size (1048576 B) is larger than the largest (1024 B)"),
    (["bench", "-f", "1"], "factor must be an integer >= 2"),
    (["bench", "-c", "allreduse"], "unknown collective 'allreduse'"),
    (["bench", "-a", "rign"], "unknown algorithm 'rign' for allreduce"),
    (["bench", "-d", "float32", "-o", "band"], "op 'band' is not defined for dtype float32"),
    (["bench", "-d", "float33"], "unknown dtype 'float33'"),
    (["bench", "-i", "0"], "--iters must be an integer >= 1"),
    (["bench", "--json", "-", "--csv", "-"], "cannot both write to stdout"),
    (["bench", "--json", "{tmp}/missing/r.json"], "the directory {tmp}/missing does not exist"),
    (["bench", "--csv", "{tmp}"], "it is a directory"),
    (["tune", "-O", "{tmp}/missing/t.json"], "cannot write the tuning file"),
    (["tune", "--procs", "2,x"], "--procs must be comma-separated process counts"),
    (["tune", "--max-bytes", "lots"], "invalid size 'lots'"),
    (["sim", "allreduce", "-s", "-1"], "invalid size '-1'"),
])
def test_usage_errors_are_one_line(tmp_path, capsys, args, message):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message.replace("{tmp}", str(tmp_path)) in err and "Traceback" not in err
    assert err.startswith(f"commkit {args[0]}: error: ")


@pytest.mark.parametrize("rank_var,size_var", [
    ("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMIX_RANK", "PMIX_SIZE")])
@pytest.mark.parametrize("rank", [0, 1])
def test_dash_n_under_a_launcher_of_another_size(monkeypatch, capsys, rank_var, size_var, rank):
    # Every launcher's variables are read: the job's size is checked against -n, and only rank 0 reports.
    for var in (*MPI_VARS, "PMIX_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(rank_var, str(rank))
    monkeypatch.setenv(size_var, "2")
    assert main(["bench", "-n", "3", "--sizes", "8"]) == 2
    err = capsys.readouterr().err
    expected = "commkit bench: error: -n 3 was given, but this is already an MPI job of 2 processes"
    assert (expected in err) if rank == 0 else (err == "")


def test_missing_mpi_is_a_clear_message(tmp_path):
    fake = tmp_path / "fake" / "mpi4py"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError(\"No module named 'mpi4py'\")\n")
    result = run_commkit(["bench", "--sizes", "8"], pythonpath=[str(tmp_path / "fake")], timeout=60)
    assert result.returncode == 2
    assert "pip install 'commkit[mpi]'" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy is installed here")
def test_gpu_without_cupy_is_a_clear_message(capsys):
    assert main(["bench", "--gpu", "--sizes", "8"]) == 2
    err = capsys.readouterr().err
    assert "--gpu needs CuPy" in err and "pip install 'commkit[gpu]'" in err and "Traceback" not in err


def test_missing_mpiexec_is_a_clear_message(tmp_path):
    result = run_commkit(["bench", "-n", "2", "--sizes", "8"], env={"COMMKIT_MPIEXEC": str(tmp_path / "nope")},
                         timeout=60)
    assert result.returncode == 2
    assert f"cannot start {tmp_path / 'nope'}" in result.stderr and "Traceback" not in result.stderr


# -- sim ---------------------------------------------------------------------------------------------------


def test_sim_ranks_the_algorithms(capsys):
    assert main(["sim", "allreduce", "-p", "64", "-s", "1M", "--crossovers"]) == 0
    out = capsys.readouterr().out
    assert out.index("rabenseifner") < out.index("naive") and "crossovers (bytes):" in out
    assert main(["sim", "allgather", "-p", "12", "-s", "96K", "-a", "bruck", "--alpha", "1e-6"]) == 0
    out = capsys.readouterr().out
    assert "allgather_bruck: p=12" in out and "4 rounds" in out and "formula" in out


def test_sim_under_the_loggp_and_two_level_models(capsys):
    from commkit import sim

    assert main(["sim", "allreduce", "-p", "64", "-s", "16M", "--ranks-per-node", "8"]) == 0
    out = capsys.readouterr().out
    assert "simulated under ranks_per_node=8" in out
    two_level = sim.simulate("allreduce", "ring", 64, 16 << 20, ranks_per_node=8).time
    flat = sim.simulate("allreduce", "ring", 64, 16 << 20).time
    assert two_level > flat  # crossing nodes costs more than staying inside one
    assert main(["sim", "allreduce", "-p", "16", "-s", "1M", "--model", "loggp", "-a", "ring"]) == 0
    assert "LogGP(" in capsys.readouterr().out
    assert main(["sim", "allreduce", "-p", "16", "--ranks-per-node", "0"]) == 2
    assert "--ranks-per-node must be an integer >= 1" in capsys.readouterr().err


def test_python_dash_m_commkit_help():
    result = run_commkit(["--help"], timeout=60)
    assert result.returncode == 0 and "bench" in result.stdout and "tune" in result.stdout


# -- tune ---------------------------------------------------------------------------------------------------


@pytest.mark.mpi
def test_tune_writes_a_tuning_file_the_selector_accepts(mpi, tmp_path, monkeypatch):
    path = tmp_path / "tuned.json"
    result = run_commkit(["tune", "-n", "2", "--quick", "-c", "allreduce,broadcast", "--max-bytes", "1M",
                          "-O", str(path)], timeout=400)
    assert result.returncode == 0, result.stderr
    assert f"COMMKIT_TUNING={path}" in result.stdout
    table = selection.load_table(str(path))
    measured = table["measured"]
    assert measured["alpha"] > 0 and measured["beta"] > 0 and measured["gamma"] > 0 and measured["nprocs"] == 2
    assert table["machine"]["nprocs"] == 2 and table["machine"]["transport"] == "mpi"
    assert set(table) - {"version", "_comment", "machine", "measured", "model"} == {"allreduce", "broadcast"}
    for rule in table["allreduce"] + table["broadcast"]:
        assert "measured on 2 ranks" in rule["reason"] and rule["min_procs"] == rule["max_procs"] == 2
    monkeypatch.setenv("COMMKIT_TUNING", str(path))
    for nbytes in (8, 1 << 20, 1 << 26):
        assert selection.select("allreduce", 2, nbytes, ck.SUM).reason.startswith(str(path))


def test_tune_needs_two_processes():
    result = run_commkit(["tune", "-O", os.devnull], timeout=120)
    assert result.returncode == 2
    assert "needs at least 2 processes" in result.stderr and "Traceback" not in result.stderr



def test_load_registers_user_algorithms_for_sim(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_cli_algs.py").write_text(
        "from commkit.algorithms import algorithm\n"
        "from commkit.algorithms.naive import allreduce_naive\n"
        "@algorithm('allreduce', 'cli_student', commutative=True, scratch=lambda rank, size, count: count)\n"
        "def allreduce_cli_student(rank, size, count, op):\n"
        "    yield from allreduce_naive(rank, size, count, op)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    # load() records the module in COMMKIT_ALGORITHMS for child processes; set it here so that
    # monkeypatch puts the environment back afterwards.
    monkeypatch.setenv("COMMKIT_ALGORITHMS", "")
    try:
        assert main(["--load", "my_cli_algs", "sim", "allreduce", "-p", "4", "-s", "1K", "-a", "cli_student"]) == 0
        out = capsys.readouterr().out
        assert "cli_student" in out and "formula" not in out  # no cost formula declared: none printed
    finally:
        algorithms.unregister("allreduce", "cli_student")
