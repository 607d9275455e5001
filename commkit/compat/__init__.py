"""Faces for people coming from other libraries, as thin adapters over :class:`commkit.Communicator`.

* :mod:`commkit.compat.mpi4py` -- mpi4py's buffer methods (``Allreduce(sendbuf,
  recvbuf, op)``, ``MPI.IN_PLACE``, ``Request.Waitall`` ...): wrap an mpi4py
  communicator in one line and keep the rest of the program.
* :mod:`commkit.distributed` -- the functional style of ``torch.distributed``
  (``init_process_group``, ``all_reduce(tensor)`` in place, ``new_group`` ...).

Neither is a second implementation: both parse their arguments, then call the
same communicator methods as everyone else. This package holds what they
share: turning whatever array the user hands over into an array view of the
same memory.
"""

from __future__ import annotations

import numpy as np

from ..errors import InvalidBuffer, TransportUnavailable

__all__ = ["as_array"]

_DLPACK_CPU, _DLPACK_CUDA, _DLPACK_CUDA_MANAGED = 1, 2, 13


def as_array(obj, name: str, *, writable: bool = False):
    """A NumPy (host) or CuPy (device) array over the very memory of ``obj``; never a copy.

    Accepts NumPy and CuPy arrays, objects with the buffer protocol
    (``bytearray``, ``array.array``, ``memoryview`` ...), CUDA-array-interface
    objects and DLPack producers (e.g. PyTorch tensors, CPU or CUDA).

    Raises:
        InvalidBuffer: ``obj`` exposes no memory commkit can use, or ``writable``
            is asked and the memory is read-only.
    """
    if isinstance(obj, np.ndarray):
        arr = obj
    elif hasattr(obj, "__cuda_array_interface__"):
        arr = _cupy(name).asarray(obj)
    else:
        try:
            arr = np.asarray(memoryview(obj))
        except TypeError:
            arr = _from_dlpack(obj, name)
    if writable and not arr.flags.writeable:
        raise InvalidBuffer(f"{name} is read-only; commkit must write the result into it.")
    return arr


def _from_dlpack(obj, name: str):
    if not hasattr(obj, "__dlpack__"):
        raise InvalidBuffer(
            f"{name} must be an array (NumPy, CuPy, or anything exposing the buffer protocol, "
            f"__cuda_array_interface__ or DLPack), got {type(obj).__name__}."
        )
    device = obj.__dlpack_device__()[0] if hasattr(obj, "__dlpack_device__") else _DLPACK_CPU
    if device == _DLPACK_CPU:
        return np.from_dlpack(obj)
    if device in (_DLPACK_CUDA, _DLPACK_CUDA_MANAGED):
        return _cupy(name).from_dlpack(obj)
    raise InvalidBuffer(f"{name} lives on DLPack device type {device}; commkit handles host and CUDA memory only.")


def _cupy(name: str):
    from ..transports._cuda import load_cupy  # only commkit.transports imports CuPy

    try:
        return load_cupy(f"{name} (a GPU array)")
    except TransportUnavailable as exc:
        raise InvalidBuffer(str(exc)) from None
