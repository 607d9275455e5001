"""CuPy helpers shared by the transports: is there a GPU, is MPI CUDA-aware, and host staging.

Nothing here imports CuPy at module level: ``import commkit`` must work where
CuPy is absent, so each helper imports it when first asked, and the checks
that only ask "is this a device array?" look for ``__cuda_array_interface__``.

Staging (for the MPI transport when the MPI library cannot read device
memory). mpi4py hands MPI the raw pointer of any object with
``__cuda_array_interface__``; an MPI built without CUDA support then reads or
writes device addresses as if they were host memory, which crashes or, worse,
moves garbage. So device buffers are staged through pinned host memory:

1. synchronise the current CuPy stream, so every kernel that produces a send
   buffer has finished (work is ordered on that stream, not on the host);
2. copy each send buffer to a pinned host buffer; give MPI host buffers to
   receive into;
3. when the MPI request completes, copy each received host buffer back to its
   device buffer on the current stream, and synchronise again before the
   host buffer is released.

A CUDA-aware MPI skips the copies but still needs step 1, as mpi4py's
documentation warns: MPI does not know CuPy's streams.
"""

from __future__ import annotations

import os
import sys

import numpy as np

from ..errors import TransportUnavailable

__all__ = ["load_cupy", "gpu_status", "nccl_status", "is_device_array", "synchronize", "follow", "mpi_cuda_aware",
           "kinds_allow_cuda", "stage", "stage_native", "StagedPending", "INSTALL_HINT"]

INSTALL_HINT = ("install CuPy for your CUDA version, e.g. `pip install 'commkit[gpu]'` (cupy-cuda12x) "
                "or `pip install cupy-cuda13x`")


def load_cupy(what: str = "GPU arrays"):
    """Import and return CuPy; raise TransportUnavailable naming ``what`` and the install command."""
    try:
        import cupy
    except ImportError as exc:
        raise TransportUnavailable(f"{what} need CuPy, which is not importable here ({exc}); {INSTALL_HINT}.") from None
    return cupy


def gpu_status() -> tuple[bool, str]:
    """``(True, description)`` when CuPy imports and sees a CUDA GPU, else ``(False, why not)``."""
    try:
        import cupy
    except ImportError:
        return False, "needs CuPy and a CUDA GPU (CuPy is not installed)"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - CUDARuntimeError, or a driver that cannot load
        return False, f"needs CuPy and a CUDA GPU (CuPy found no usable CUDA driver: {exc})"
    if count < 1:
        return False, "needs CuPy and a CUDA GPU (no GPU is visible to this process)"
    return True, f"{count} CUDA GPU(s), CuPy {cupy.__version__}"


def nccl_status() -> tuple[bool, str]:
    """Like :func:`gpu_status`, and also whether CuPy can load NCCL."""
    ok, why = gpu_status()
    if not ok:
        return ok, why
    try:
        from cupy.cuda import nccl
    except ImportError as exc:
        return False, f"needs NCCL through CuPy (cupy.cuda.nccl cannot be imported: {exc})"
    if not getattr(nccl, "available", False):
        return False, ("needs NCCL through CuPy (CuPy cannot load the NCCL library; install it, e.g. "
                       "`pip install nvidia-nccl-cu12` next to cupy-cuda12x)")
    return True, f"{why}, NCCL {nccl.get_version()}"


def is_device_array(x) -> bool:
    """Whether ``x`` lives in GPU memory (it exposes ``__cuda_array_interface__``)."""
    return type(x) is not np.ndarray and hasattr(x, "__cuda_array_interface__")


def synchronize() -> None:
    """Block until the current CuPy stream's work is done (nothing to do where CuPy was never imported).

    Benchmarks call this before reading the clock: NCCL and CuPy calls return
    once their work is queued on the stream, not when it has run.
    """
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        cupy.cuda.get_current_stream().synchronize()


def follow(event, stream_ptr: int) -> None:
    """Order the current CuPy stream after ``event``, recorded on the stream ``stream_ptr`` (a device-side wait).

    Nothing to do when the current stream is that stream: its work runs in order.
    """
    import cupy

    current = cupy.cuda.get_current_stream()
    if current.ptr != stream_ptr:
        current.wait_event(event)


_cuda_aware: dict = {}


def mpi_cuda_aware(MPI=None) -> bool:
    """Whether the MPI library reads and writes device memory itself (so no host staging is needed).

    In order: ``COMMKIT_MPI_CUDA_AWARE=1`` or ``0`` decides; otherwise the MPI-4.1
    memory-allocation-kinds query (``mpi_memory_alloc_kinds`` listing a ``cuda``
    kind, on ``MPI_COMM_WORLD``'s info or ``MPI_INFO_ENV``); otherwise False,
    which is always safe (staging works with any MPI). The answer is cached.
    """
    env = os.environ.get("COMMKIT_MPI_CUDA_AWARE", "").strip().lower()
    if env in ("1", "true", "yes"):
        return True
    if env in ("0", "false", "no"):
        return False
    if "answer" not in _cuda_aware:
        _cuda_aware["answer"] = _query_memory_kinds(MPI)
    return _cuda_aware["answer"]


def _query_memory_kinds(MPI) -> bool:
    if MPI is None:
        try:
            from mpi4py import MPI
        except ImportError:
            return False
    texts = []
    try:
        info = MPI.COMM_WORLD.Get_info()
        try:
            texts.append(info.Get("mpi_memory_alloc_kinds"))
        finally:
            info.Free()
    except Exception:  # noqa: BLE001 - MPI before 4.1 has no such key, or no Get_info
        pass
    try:
        texts.append(MPI.INFO_ENV.Get("mpi_memory_alloc_kinds"))
    except Exception:  # noqa: BLE001
        pass
    return any(kinds_allow_cuda(text) for text in texts)


def kinds_allow_cuda(text) -> bool:
    """Whether an MPI-4.1 memory-kinds string (``"mpi,system,cuda:device"``) includes CUDA device memory."""
    if not text:
        return False
    for kind in str(text).split(","):
        name, _, restrictor = kind.strip().partition(":")
        if name == "cuda" and restrictor in ("", "device"):
            return True
    return False


# -- staging device buffers through host memory -------------------------------------------------------------


class StagedPending:
    """An MPI request over host copies of device buffers; copies the received bytes back when it completes."""

    __slots__ = ("inner", "copies", "_done")

    def __init__(self, inner, copies):
        self.inner = inner
        self.copies = copies  # (device byte view, pinned host array) per staged receive
        self._done = False

    def _finish(self) -> None:
        if not self._done:
            self._done = True
            _copy_back(self.copies, getattr(self.inner, "status", None))
            self.copies = ()

    def test(self) -> bool:
        if self.inner.test():
            self._finish()
            return True
        return False

    def wait(self, timeout) -> list:
        pending = self.inner.wait(timeout)
        if not pending:
            self._finish()
        return pending

    @property
    def status(self):
        return getattr(self.inner, "status", None)


def _copy_back(copies, status=None) -> None:
    """Copy staged host bytes to their device buffers, then wait for the copies (the host buffers go next)."""
    if not copies:
        return
    import cupy

    for device, host in copies:
        # A user receive may get fewer bytes than its buffer holds: copy back only those.
        n = host.nbytes if status is None else min(status.nbytes, host.nbytes)
        if n:
            device[:n].set(host[:n])
    cupy.cuda.get_current_stream().synchronize()


def _byte_view(buf):
    return buf.reshape(-1).view(np.uint8) if type(buf) is np.ndarray else buf.reshape(-1).view("u1")


def stage(post, sends, recvs, cuda_aware: bool):
    """Run ``post(sends, recvs)`` on device buffers; return its pending, wrapped so received bytes land on the device.

    ``sends``/``recvs`` are lists of ``(peer, buffer)`` where some buffers may be
    NumPy arrays (passed through) and some CuPy arrays. The current stream is
    synchronised first either way; with ``cuda_aware`` the device buffers go to
    MPI as they are.
    """
    import cupy
    import cupyx

    cupy.cuda.get_current_stream().synchronize()
    if cuda_aware:
        return post(sends, recvs)
    host_sends = []
    for peer, buf in sends:
        if is_device_array(buf) and buf.nbytes:
            host = cupyx.empty_pinned(buf.nbytes, np.uint8)
            _byte_view(buf).get(out=host)  # blocking: the bytes are on the host when it returns
            buf = host
        elif is_device_array(buf):
            buf = np.empty(0, np.uint8)
        host_sends.append((peer, buf))
    host_recvs, copies = [], []
    for peer, buf in recvs:
        if is_device_array(buf):
            host = cupyx.empty_pinned(buf.nbytes, np.uint8) if buf.nbytes else np.empty(0, np.uint8)
            if buf.nbytes:
                copies.append((_byte_view(buf), host))
            buf = host
        host_recvs.append((peer, buf))
    return StagedPending(post(host_sends, host_recvs), copies)


def stage_native(run, collective: str, sendbuf, recvbuf, kwargs: dict, cuda_aware: bool):
    """Run the MPI library's own collective ``run(collective, send, recv, **kwargs)`` on device buffers.

    Staged buffers keep their dtype (MPI reduces them). The receive buffer is
    staged with its current contents, because in-place calls and the root of
    a broadcast read it. Returns what ``run`` returns, a pending handle wrapped
    to copy the result back when it completes, or None after copying back.
    """
    import cupy

    cupy.cuda.get_current_stream().synchronize()
    if cuda_aware:
        return run(collective, sendbuf, recvbuf, **kwargs)
    host_send = sendbuf.get() if is_device_array(sendbuf) else sendbuf
    host_recv, copies = recvbuf, []
    if is_device_array(recvbuf):
        host_recv = recvbuf.get()
        if recvbuf.nbytes:
            copies.append((_byte_view(recvbuf), _byte_view(host_recv)))
    pending = run(collective, host_send, host_recv, **kwargs)
    if pending is None:
        _copy_back(copies)
        return None
    return StagedPending(pending, copies)
