"""Short smokes of the benchmark scripts no other test runs, so they keep working.

``null_transport.py`` (a few hundred calls over a transport that moves nothing,
no MPI) runs in a plain process, and its transport's posted transfers are
checked to complete at once; ``call_cost.py``, ``face_forms.py``,
``face_overhead.py``, ``recv_check.py``, ``first_call.py`` and ``floor_parts.py``
(2 sweeps of a few calls) run under 2-rank jobs, as a user runs them inside a job of their own;
``profile_steps.py``, which starts its own 2-rank job, runs two algorithms for
2 iterations. Each must exit 0, print no traceback, and print the table or
lines it promises. Benchmarks are never timed unit tests: nothing here asserts
on speed.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import benchmark_module, run_benchmark, run_benchmark_as_main

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BENCHMARKS = os.path.join(ROOT, "benchmarks")
NULL_TRANSPORT = os.path.join(BENCHMARKS, "null_transport.py")
CALL_COST = os.path.join(BENCHMARKS, "call_cost.py")
FACE_FORMS = os.path.join(BENCHMARKS, "face_forms.py")
FACE_OVERHEAD = os.path.join(BENCHMARKS, "face_overhead.py")
PROFILE_STEPS = os.path.join(BENCHMARKS, "profile_steps.py")
RECV_CHECK = os.path.join(BENCHMARKS, "recv_check.py")
FIRST_CALL = os.path.join(BENCHMARKS, "first_call.py")
FLOOR_PARTS = os.path.join(BENCHMARKS, "floor_parts.py")


def test_null_transport_prints_commkits_per_call_cost_beside_the_bare_reduction():
    result = subprocess.run([sys.executable, NULL_TRANSPORT, "--calls", "200", "--sweeps", "2"],
                            capture_output=True, text=True, timeout=60, cwd=ROOT, check=False)
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert "Traceback" not in result.stderr, result.stderr
    out = result.stdout
    assert "allreduce(x, out=out), 8 B, 2 ranks, null transport: " in out and "(median of 2 x 200)" in out, out
    assert "np.add(x, out, out=out) alone:" in out and "algorithm chosen: " in out, out


def test_null_transport_completes_posted_and_nonblocking_transfers_at_once(monkeypatch):
    # The script's 8 B allreduce never posts; these do: an i-form posts every transfer, and a large
    # pipelined ring posts the transfers it overlaps with its reductions (schedule.execute).
    from commkit.communicator import Communicator

    null = benchmark_module("null_transport")
    pending = null.NullTransport().post([], [], 0)
    assert pending.test() and pending.wait(None) == [] and pending.wait(0.0) == []
    posted = []
    post = null.NullTransport.post
    monkeypatch.setattr(null.NullTransport, "post", lambda self, *args: posted.append(args) or post(self, *args))
    comm = Communicator(null.NullTransport())
    x = np.ones(2, np.float32)
    request = comm.iallreduce(x, out=np.empty_like(x))
    assert request.test() and len(posted) == 1
    request.wait()
    big = np.ones(1 << 18, np.float32)
    comm.allreduce(big, out=np.empty_like(big), algorithm="ring_pipelined")
    assert comm.last_algorithm == "ring_pipelined" and len(posted) > 1
    comm.free()


@pytest.mark.mpi
def test_call_cost_prints_every_variant_of_every_collective_and_writes_the_same_markdown(mpi, tmp_path):
    md = tmp_path / "call_cost.md"
    out = run_benchmark_as_main(mpi, [CALL_COST, "--sweeps", "2", "--calls", "20", "--markdown", str(md)])
    assert "Command: `mpiexec -n 2 python benchmarks/call_cost.py --sweeps 2 --calls 20" in out, out
    assert "Machine state before the run: raw 8 B Allreduce " in out and "; after it: " in out, out
    assert "| collective | bytes | variant | time (us) | vs raw mpi4py | spread of auto |" in out, out
    for variant in ("raw", "raw in place", "auto", "auto in place", "native", "floor", "persistent", "check"):
        for size in (8, 1024):
            assert f"| allreduce | {size} | {variant} |" in out, (variant, size)
    for collective in ("broadcast", "reduce", "allgather", "alltoall", "reduce_scatter"):
        assert f"| {collective} | 1024 | auto |" in out, collective
    assert "| barrier | 0 | native |" in out, out
    assert md.read_text() in out + "\n"


@pytest.mark.mpi
def test_face_forms_prints_a_row_for_every_buffer_form_of_every_collective(mpi):
    out = run_benchmark_as_main(mpi, [FACE_FORMS, "--sizes", "8", "--sweeps", "2", "--calls", "5"])
    assert "# command: mpiexec -n 2 python benchmarks/face_forms.py --sizes 8 --sweeps 2 --calls 5" in out, out
    assert "# machine state before the run: " in out, out
    assert "| call | bytes | raw (us) | face (us) | commkit (us) | face / raw | commkit / raw |" in out, out
    forms = ("numpy", "[buf, T]", "[buf, n, T]", "bytearray", "array.array", "mmap", "memoryview")
    for collective in ("Bcast", "Reduce", "Allreduce", "Gather", "Scatter", "Allgather", "Alltoall"):
        for form in forms:
            assert f"| {collective} {form} | 8 |" in out, (collective, form)
    for collective in ("Reduce", "Allreduce", "Gather", "Scatter", "Allgather", "Alltoall"):
        assert f"| {collective} IN_PLACE | 8 |" in out and f"| {collective} None | 8 |" in out, collective
    assert "| Allreduce new arrays | 8 |" in out and "| allreduce(3.5) | 8 |" in out, out


@pytest.mark.mpi
def test_face_overhead_prints_every_variant_and_the_faces_own_cost_at_each_size(mpi):
    out = run_benchmark_as_main(mpi, [FACE_OVERHEAD, "--sizes", "8,1024", "--sweeps", "2", "--calls", "5"])
    assert "# float32 sum allreduce, 2 ranks, " in out and "2 sweeps x 5 calls" in out, out
    lines = out.splitlines()
    for size in (8, 1024):
        for variant in ("mpi4py", "face", "commkit", "face_init", "commkit_init"):
            assert any(line.split()[:2] == [str(size), variant] for line in lines if line.strip()), (size, variant)
        assert f"{size:>6}  face own cost: " in out and f"{size:>6}  face_init own cost: " in out, out


@pytest.mark.mpi
def test_profile_steps_prints_each_algorithms_steps_on_every_rank_beside_native(mpi):
    out = run_benchmark([PROFILE_STEPS, "allreduce", "4K", "-a", "recursive_doubling,ring", "-i", "2"])
    assert out.startswith("allreduce, 4K B, 2 ranks, median of 2 runs (ms)"), out
    assert "  native: " in out, out
    for name in ("recursive_doubling", "ring"):
        assert f"  {name}: " in out, (name, out)
    assert out.count("    rank 0: 0:exchange") == 2 and out.count("    rank 1: 0:exchange") == 2, out


@pytest.mark.mpi
def test_recv_check_prints_all_four_sendrecv_forms_and_the_checks_cost(mpi):
    out = run_benchmark_as_main(mpi, [RECV_CHECK, "--calls", "20", "--rounds", "2"])
    assert "MPI_Sendrecv of 8 B, 2 ranks, 20 calls x 2 rounds" in out, out
    for form in ("raw", "status", "bound", "sendrecv"):
        assert f"  {form:9s} median " in out, (form, out)
    assert "  the check: " in out and "ns/call (status - raw)" in out, out


@pytest.mark.mpi
def test_first_call_prints_every_call_form_at_each_size(mpi):
    out = run_benchmark_as_main(mpi, [FIRST_CALL, "--sizes", "8,1024", "--sweeps", "2", "--calls", "5"])
    assert "# machine state raw 8 B Allreduce " in out, out
    assert "# float32 sum allreduce (recursive_doubling), 2 ranks, 2 sweeps x 5 calls" in out, out
    header = next(line for line in out.splitlines() if line.split()[:1] == ["bytes"])
    for form in ("raw mpi4py", "raw, new out", "plan", "no out", "new out", "raw, new x", "new x", "new x, out",
                 "timeout", "raw i-form", "i-form"):
        assert form in header, (form, header)
    for size in (8, 1024):
        row = next(line for line in out.splitlines() if line.split()[:1] == [str(size)])
        assert len(row.split()) == 12, row  # the size and one time for each of the 11 forms


@pytest.mark.mpi
def test_floor_parts_prints_each_collectives_parts_beside_the_raw_call(mpi):
    out = run_benchmark_as_main(mpi, [FLOOR_PARTS, "--sizes", "8,1024", "--sweeps", "2", "--calls", "5"])
    assert "Command: `mpiexec -n 2 python benchmarks/floor_parts.py --sizes 8,1024 --sweeps 2 --calls 5" in out, out
    assert "| call | bytes | raw (us) | p2p / raw | + least bookkeeping / raw | commkit / raw | face / raw |" in out
    for collective in ("Bcast", "Reduce", "Allreduce", "Gather", "Scatter", "Allgather", "Alltoall"):
        for size in (8, 1024):
            row = next(line for line in out.splitlines() if line.startswith(f"| {collective} | {size} |"))
            assert len(row.strip("|").split("|")) == 7, row


@pytest.mark.mpi
def test_floor_parts_says_it_needs_two_ranks_when_run_on_three(mpi):
    code = f"""
    import runpy
    import sys

    sys.argv = [{FLOOR_PARTS!r}, "--calls", "5", "--sweeps", "1"]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as exc:
        assert exc.code == 2, exc.code
    """
    result = mpi(3, code, timeout=120)
    assert "run it under mpiexec -n 2 (got 3)" in result.stderr, result.stderr
