#!/usr/bin/env bash
# commkit's whole GPU test suite, in one command, on a machine with NVIDIA GPUs:
#
#     bash scripts/gpu_suite.sh
#
# 1. Makes a fresh virtual environment and installs commkit[gpu,test,mpi] into it
#    (CuPy, mpi4py with the mpich wheels, pytest, hypothesis), plus NCCL's library.
# 2. Runs every test marked `gpu` (pytest -m gpu) and the bootstrap-store tests:
#    the threads world on one GPU (sizes 1..8), NCCL with one rank, the MPI
#    transport with CuPy arrays, and NCCL with every visible GPU, under mpiexec
#    and through the TCP store (the last two need 2 or more GPUs).
# 3. Runs `commkit bench --gpu` with one rank per GPU (busbw against NCCL's own
#    collectives) as a last, end-to-end check.
#
# It stops at nothing: every step runs, each one's log is kept, and the exit
# status is non-zero if any step failed. Skipped tests are listed with their
# reasons at the end of step 2's output.
#
# Settings (environment variables):
#   COMMKIT_SUITE_PYTHON=/path/to/python  use this interpreter as it is, with CuPy and the test
#                                         tools already installed: no virtual environment, no install
#   COMMKIT_SUITE_VENV=DIR                where to make the virtual environment (default: a
#                                         temporary folder, removed at the end)
#   COMMKIT_SUITE_CUPY=cupy-cuda13x       the CuPy wheel to use instead of the gpu extra's cupy-cuda12x
#   COMMKIT_SUITE_NCCL=nvidia-nccl-cu13   NCCL's wheel (default: the one matching the CuPy wheel)
#   COMMKIT_SUITE_LOGS=DIR                where the logs go (default: build/gpu-suite-logs)
set -uo pipefail
cd "$(dirname "$0")/.."

logs="${COMMKIT_SUITE_LOGS:-build/gpu-suite-logs}"
mkdir -p "$logs"
failed=()

step() {  # step NAME COMMAND...: run it, keep its log, remember a failure
    local name="$1"; shift
    echo
    echo "=== $name"
    if "$@" 2>&1 | tee "$logs/$name.log"; then
        echo "=== $name: ok"
    else
        echo "=== $name: FAILED (log: $logs/$name.log)"
        failed+=("$name")
    fi
}

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_suite: no NVIDIA GPU answers nvidia-smi here; run this on a machine with CUDA GPUs." >&2
    exit 2
fi
nvidia-smi -L | tee "$logs/gpus.txt"

# Open MPI refuses to start as root unless told twice (GPU machines and containers often run
# as root); MPICH needs nothing. This only affects this script's own runs.
if [ "$(id -u)" = 0 ]; then
    export OMPI_ALLOW_RUN_AS_ROOT="${OMPI_ALLOW_RUN_AS_ROOT:-1}" OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="${OMPI_ALLOW_RUN_AS_ROOT_CONFIRM:-1}"
fi

if [ -n "${COMMKIT_SUITE_PYTHON:-}" ]; then
    py="$COMMKIT_SUITE_PYTHON"
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    venv="${COMMKIT_SUITE_VENV:-}"
    if [ -z "$venv" ]; then
        venv="$(mktemp -d)/venv"
        trap 'rm -rf "$(dirname "$venv")"' EXIT
    fi
    python3 -m venv "$venv" || exit 2
    py="$venv/bin/python"
    cupy="${COMMKIT_SUITE_CUPY:-}"
    if [ -n "$cupy" ]; then
        specs=(".[test,mpi]" "$cupy")
    else
        specs=(".[gpu,test,mpi]")
        cupy="cupy-cuda12x"
    fi
    # CuPy loads NCCL at run time; its wheel is separate (nvidia-nccl-cu12 for cupy-cuda12x, ...).
    cuda="$(echo "$cupy" | sed -n 's/^cupy-cuda\([0-9][0-9]*\)x.*/\1/p')"
    nccl="${COMMKIT_SUITE_NCCL:-${cuda:+nvidia-nccl-cu$cuda}}"
    step install "$py" -m pip install --upgrade pip "${specs[@]}" ${nccl:+"$nccl"}
fi

step versions "$py" - <<'PY'
import platform, numpy, cupy
from cupy.cuda import nccl
from commkit.transports import _cuda
print("python", platform.python_version(), "numpy", numpy.__version__, "cupy", cupy.__version__)
print("gpus:", _cuda.gpu_status()[1])
print("nccl:", _cuda.nccl_status()[1])
try:
    from mpi4py import MPI
    print("mpi:", MPI.Get_library_version().splitlines()[0], "CUDA-aware:", _cuda.mpi_cuda_aware(MPI))
except Exception as exc:  # noqa: BLE001
    print("mpi: not usable:", exc)
PY

step pytest-gpu "$py" -m pytest -m gpu -rs -p no:cacheprovider tests
step pytest-store "$py" -m pytest -rs -p no:cacheprovider tests/test_store.py

gpus="$("$py" -c 'import cupy; print(cupy.cuda.runtime.getDeviceCount())' 2>/dev/null || echo 0)"
if [ "${gpus:-0}" -ge 1 ]; then
    step bench-gpu "$py" -m commkit bench --gpu -n "$gpus" -c allreduce,allgather,reduce_scatter,broadcast \
        -b 1K -e 256M -f 8 -i 10 -w 2 --json "$logs/bench-gpu.json"
fi

echo
if [ "${#failed[@]}" -eq 0 ]; then
    echo "gpu_suite: every step passed (logs in $logs)."
else
    echo "gpu_suite: failed steps: ${failed[*]} (logs in $logs)."
    exit 1
fi
