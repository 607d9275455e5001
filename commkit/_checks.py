"""Validation at the public boundary: one helper per kind of check.

Each helper raises an error that names the parameter, says what was expected
and what came. They run before any message is sent.

Layout policy (documented in the API docs): a non-contiguous *input* is copied
to a contiguous array (inputs are never written, so a copy is always safe); a
non-contiguous or read-only *output* buffer (``out=``, a receive buffer) is an
error, because commkit must write into that very memory.
"""

from __future__ import annotations

import re
import sys

import numpy as np

from .errors import InvalidArgument, InvalidBuffer

_KINDS = "biufc"


def array_module(x):
    """NumPy for host arrays, CuPy for device arrays (without importing CuPy here)."""
    if hasattr(x, "__cuda_array_interface__"):
        cupy = sys.modules.get("cupy")
        if cupy is not None:
            return cupy
    return np


def _is_array(x) -> bool:
    return isinstance(x, np.ndarray) or hasattr(x, "__cuda_array_interface__")


def check_dtype(dtype, name: str) -> None:
    if dtype.kind not in _KINDS or dtype.hasobject:
        raise InvalidBuffer(
            f"{name} has dtype {dtype}; commkit moves numeric and bool arrays only "
            "(bool, int, uint, float, complex). Use send_object for Python objects."
        )


def _plain(x, name: str):
    """An ndarray subclass as a plain ndarray view (np.matrix ...); masked arrays are refused."""
    if isinstance(x, np.ma.MaskedArray):
        raise InvalidBuffer(
            f"{name} is a masked array; commkit moves plain arrays and would ignore the mask. "
            f"Pass {name}.filled(value) (or {name}.data to ignore the mask on purpose)."
        )
    return np.asarray(x)


def as_input(x, name: str):
    """Return ``x`` as a C-contiguous array (a copy only if it was not contiguous)."""
    if type(x) is np.ndarray and x.flags.c_contiguous and x.dtype.kind in _KINDS:
        return x  # the common case, checked in one line
    if isinstance(x, np.ndarray) and type(x) is not np.ndarray:
        x = _plain(x, name)
    if not _is_array(x):
        if x is None:
            raise InvalidBuffer(f"{name} must be an array, got None.")
        try:
            x = np.asarray(x)
        except Exception:
            raise InvalidBuffer(f"{name} must be a NumPy or CuPy array, got {type(x).__name__}.") from None
    check_dtype(x.dtype, name)
    if not x.flags.c_contiguous:
        x = array_module(x).ascontiguousarray(x)
    return x


def input_for(x, mode, collective: str):
    """:func:`as_input`, except for a persistent call (``mode == "init"``): the caller's own memory, never a copy.

    A persistent request reads its input again at every ``start()``, so a copy made
    here (of a list, a strided view) would never see what the caller writes later:
    the request would send stale values. That is refused instead.

    Raises:
        InvalidBuffer: as :func:`as_input`, or a persistent call's ``x`` would need a copy.
    """
    if mode != "init" or (type(x) is np.ndarray and x.flags.c_contiguous):
        return as_input(x, "x")
    arr = as_input(x, "x")
    if arr is not x and not (hasattr(x, "nbytes") and arr.nbytes == x.nbytes and same_memory(arr, x)):
        raise InvalidBuffer(
            f"{collective}_init's x must be a C-contiguous array: the request reads it again at every start(), "
            f"and the copy a {type(x).__name__} would need could not see what you write into it later.")
    return arr


def check_out(out, shape: tuple, dtype, name: str = "out", like=None):
    """Check a buffer commkit will write: right type, dtype, shape; contiguous and writeable."""
    if (type(out) is np.ndarray and (like is None or type(like) is np.ndarray) and out.dtype == dtype
            and out.shape == shape and out.flags.c_contiguous and out.flags.writeable):
        return out  # the common case: every check below would pass
    if isinstance(out, np.ndarray) and type(out) is not np.ndarray:
        out = _plain(out, name)
    if not _is_array(out):
        raise InvalidBuffer(f"{name} must be a NumPy or CuPy array, got {type(out).__name__}.")
    if like is not None and array_module(out) is not array_module(like):
        raise InvalidBuffer(
            f"{name} is a {type(out).__module__}.{type(out).__name__} but the input is a "
            f"{type(like).__module__}.{type(like).__name__}; both must live on the same device."
        )
    if dtype is not None and out.dtype != dtype:
        raise InvalidBuffer(f"{name} must have dtype {np.dtype(dtype)}, got {out.dtype}.")
    if shape is not None and tuple(out.shape) != tuple(shape):
        raise InvalidBuffer(f"{name} must have shape {tuple(shape)}, got {tuple(out.shape)}.")
    check_dtype(out.dtype, name)
    if not out.flags.c_contiguous:
        raise InvalidBuffer(
            f"{name} must be C-contiguous because commkit writes into it; got strides {out.strides}. "
            "Pass a contiguous array and copy the result where you need it."
        )
    if not getattr(out.flags, "writeable", True):  # CuPy arrays are always writeable and have no such flag
        raise InvalidBuffer(f"{name} is read-only; commkit needs to write the result into it.")
    return out


def check_rank(value, size: int, name: str, allow_any: bool = False) -> int:
    """A rank in ``range(size)`` (or ANY_SOURCE = -1 when ``allow_any``)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidArgument(f"{name} must be an int rank, got {type(value).__name__}.")
    value = int(value)
    if allow_any and value == -1:
        return value
    if not 0 <= value < size:
        extra = " or commkit.ANY_SOURCE" if allow_any else ""
        raise InvalidArgument(f"{name} must be in range(0, {size}){extra}, got {value}.")
    return value


def check_tag(tag, tag_ub: int, name: str = "tag", allow_any: bool = False) -> int:
    """A tag in ``[0, tag_ub]`` (or ANY_TAG = -1 when ``allow_any``)."""
    if isinstance(tag, bool) or not isinstance(tag, (int, np.integer)):
        raise InvalidArgument(f"{name} must be an int, got {type(tag).__name__}.")
    tag = int(tag)
    if allow_any and tag == -1:
        return tag
    if not 0 <= tag <= tag_ub:
        extra = " or commkit.ANY_TAG" if allow_any else ""
        raise InvalidArgument(f"{name} must be between 0 and {tag_ub}{extra}, got {tag}.")
    return tag


def check_timeout(timeout, name: str = "timeout"):
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise InvalidArgument(f"{name} must be a positive number of seconds or None, got {timeout!r}.")
    return float(timeout)


def _extent(a):
    if array_module(a) is np:
        return a.__array_interface__["data"][0], a.nbytes
    return a.data.ptr, a.nbytes


def check_alias(x, out, collective: str) -> bool:
    """True when ``out`` is exactly ``x``'s memory (in place); an error when they only partly overlap.

    A partial overlap (``allreduce(buf[0:10], out=buf[5:15])``) would let the
    collective read data it has already overwritten: every rank would get a
    wrong answer, so it is refused before anything is sent.
    """
    if out is x:
        return True
    if not same_memory(x, out):
        return False
    (xa, xn), (oa, on) = _extent(x), _extent(out)
    if xa == oa and xn == on:
        return True
    raise InvalidBuffer(
        f"{collective}'s out overlaps its input without being the same memory (input bytes "
        f"[{xa:#x}, +{xn}), out bytes [{oa:#x}, +{on})); pass out=x for in place, or a separate buffer."
    )


def owners_apart(a, a_base, b, b_base) -> bool:
    """Whether NumPy arrays ``a`` and ``b`` (given with their ``.base``) lie in two different arrays that each
    own their memory, so cannot overlap: each is such an array or a view of one (NumPy makes a view's ``base``
    the array that owns the memory). False means "not known this way" (ask :func:`same_memory`), not "overlap".
    """
    owner_a = a if a_base is None else a_base
    owner_b = b if b_base is None else b_base
    return (owner_a is not owner_b and type(owner_a) is np.ndarray and type(owner_b) is np.ndarray
            and owner_a.base is None and owner_b.base is None)


def same_memory(a, b) -> bool:
    """Whether two arrays overlap in memory (used to detect in-place calls)."""
    if a is b:
        return True
    if type(a) is np.ndarray and type(b) is np.ndarray or array_module(a) is np and array_module(b) is np:
        return np.may_share_memory(a, b)
    if a.nbytes == 0 or b.nbytes == 0:
        return False  # CuPy gives every empty array the pointer 0
    (lo_a, n_a), (lo_b, n_b) = _extent(a), _extent(b)
    return lo_a < lo_b + n_b and lo_b < lo_a + n_a


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


def parse_size(text) -> int:
    """Bytes from ``"4096"``, ``"4K"``, ``"1MiB"``, ``"2G"`` (binary units); raises InvalidArgument."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
        unit = match and _UNITS.get(match.group(2).lower())
        if not match or unit is None:
            raise InvalidArgument(
                f"invalid size {text!r}: expected a number of bytes with an optional unit K, M or G "
                "(powers of 1024), e.g. 8, 64K, 1M."
            )
        number = float(match.group(1)) * unit
        if number != int(number):
            raise InvalidArgument(f"invalid size {text!r}: not a whole number of bytes.")
        value = int(number)
    if value < 0:
        raise InvalidArgument(f"invalid size {text!r}: sizes are non-negative.")
    return value
