"""What NCCL does for one rank: which GPU it uses, and which (collective, dtype, op) NCCL runs itself.

Pure functions of their arguments (no CuPy), so they are tested on any
machine. :mod:`.nccl` re-exports the public ones.
"""

from __future__ import annotations

import os

import numpy as np

from ..errors import InvalidArgument, TransportUnavailable
from ..ops import OPS

__all__ = ["NCCL_REDUCTIONS", "choose_device", "nccl_reduction", "nccl_supports"]

# NCCL's reduction types, by NumPy (kind, itemsize).
_NCCL_TYPES = {("i", 1): "int8", ("u", 1): "uint8", ("i", 4): "int32", ("u", 4): "uint32",
               ("i", 8): "int64", ("u", 8): "uint64", ("f", 2): "float16", ("f", 4): "float32",
               ("f", 8): "float64"}
# bool as uint8 0/1: "any true" is the maximum, "all true" the minimum.
_BOOL_OPS = {"sum": "max", "lor": "max", "max": "max", "bor": "max",
             "prod": "min", "land": "min", "min": "min", "band": "min"}
_DATA_MOVING = frozenset({"broadcast", "allgather", "gather", "scatter", "alltoall"})
NCCL_REDUCTIONS = frozenset({"allreduce", "reduce", "reduce_scatter"})  # the reductions NCCL runs itself


def nccl_reduction(dtype, op: str):
    """How NCCL reduces ``dtype`` with commkit's builtin op ``op``, or None where it cannot.

    Returns ``(nccl_type, nccl_op, view)``: NCCL's names for the element type
    and the op (``"float32"``, ``"sum"``) and the NumPy dtype the buffers are
    viewed as (uint8 for bool, the float part for complex).
    """
    dtype = np.dtype(dtype)
    if dtype.byteorder not in "=|":
        return None
    if dtype.kind == "b":
        nop = _BOOL_OPS.get(op)
        return None if nop is None else ("uint8", nop, np.dtype(np.uint8))
    if dtype.kind == "c":
        part = _NCCL_TYPES.get(("f", dtype.itemsize // 2))
        if op != "sum" or part is None:
            return None
        return part, "sum", np.dtype(f"f{dtype.itemsize // 2}")
    name = _NCCL_TYPES.get((dtype.kind, dtype.itemsize))
    if name is None:
        return None
    if op in ("sum", "prod") or (op in ("max", "min") and dtype.kind in "iu"):
        return name, op, dtype
    return None


def nccl_supports(collective: str, dtype, op) -> bool:
    """Whether NCCL (directly or as grouped send/recv) runs ``collective`` on ``dtype`` with ``op``."""
    if collective == "barrier":
        return True
    if collective in _DATA_MOVING:
        return op is None
    if collective not in NCCL_REDUCTIONS or op is None:
        return False  # scan, exscan: NCCL has none
    builtin = OPS.get(op.name)
    if builtin is None or op.fn is not builtin.fn:
        return False  # a user function: only commkit's schedules can apply it
    return nccl_reduction(dtype, op.name) is not None


def choose_device(local_rank: int, local_size: int, device_count: int, requested=None) -> int:
    """The GPU for this rank: ``requested`` if given, else the rank's index among the ranks of its machine.

    A process that sees exactly one GPU uses it (launchers that give each rank
    its own ``CUDA_VISIBLE_DEVICES`` do that).

    Raises:
        TransportUnavailable: no GPU, or more ranks on this machine than GPUs.
        InvalidArgument: ``requested`` is not a visible device.
    """
    if device_count < 1:
        raise TransportUnavailable("the nccl transport needs a CUDA GPU, and none is visible to this process "
                                   f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}).")
    if requested is not None:
        if isinstance(requested, bool) or not isinstance(requested, (int, np.integer)) or not 0 <= requested < device_count:
            raise InvalidArgument(f"device must be an int in range(0, {device_count}) (the visible GPUs), "
                                  f"got {requested!r}.")
        return int(requested)
    if device_count == 1:
        return 0
    if local_size > device_count:
        raise TransportUnavailable(
            f"{local_size} ranks run on this machine but only {device_count} GPUs are visible, and NCCL needs one "
            f"GPU per rank. Start at most {device_count} ranks per machine, pass device= explicitly, or use the "
            "threads world (commkit.run_local) to run several ranks on one GPU."
        )
    return local_rank
