"""Transports: the only modules that import mpi4py or cupy.

``local`` (threads, always available), ``mpi`` (mpi4py) and ``nccl``
(CuPy's NCCL bindings). ``mpi`` and ``nccl`` are imported only when a
communicator needs them, so ``import commkit`` works with neither mpi4py nor
cupy installed; ``nccl`` imports CuPy itself only when one is created.
"""

from .base import ANY_SOURCE, ANY_TAG, Status

__all__ = ["ANY_SOURCE", "ANY_TAG", "Status"]
