"""Reduction operations: a name, how to combine two arrays, and what is known of it.

An :class:`Op` combines ``a`` (contributions of lower ranks) with ``b``
(contributions of higher ranks). Algorithms that reorder contributions are
only allowed for ops declared ``commutative``; every builtin op here is
commutative and associative for exact types. (Floating-point sums are not
associative, so different algorithms may differ in the last bits; tests compare
floats with tolerances that fit the reduction order.)
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .errors import UnsupportedOp

__all__ = ["Op", "SUM", "PROD", "MAX", "MIN", "LAND", "LOR", "LXOR", "BAND", "BOR", "BXOR", "get_op", "OPS"]

_INTS = "iu"
_BOOL = "b"
_NUMERIC = "biufc"


class Op:
    """A reduction operation.

    Args:
        fn: either a NumPy ufunc of two arguments (used in place with ``out=``),
            or a Python function ``fn(a, b) -> array`` returning ``a (op) b``
            elementwise, where ``a`` holds the lower ranks' contribution.
        commutative: whether ``fn(a, b) == fn(b, a)``. Non-commutative ops are
            reduced in rank order, exactly as ``functools.reduce`` over the
            inputs of ranks 0, 1, ..., p-1.
        name: a short name for messages, traces and tuning keys.
        identity: the neutral element, if any (used for the result of
            ``exscan`` on rank 0).
        kinds: NumPy dtype kinds (``"biufc"`` letters) the op accepts.

    An op cannot be changed once made (as an MPI op cannot): a compiled plan
    writes its function into the code it runs, and finds the op again by
    identity, so a changed ``fn`` would be the general path's alone. Make a new
    ``Op`` instead; assigning any attribute raises ``AttributeError``.
    """

    __slots__ = ("fn", "commutative", "name", "identity", "kinds", "is_ufunc", "fresh_for_complex")

    def __init__(
        self,
        fn: Callable[[Any, Any], Any],
        commutative: bool = False,
        name: str | None = None,
        identity: Any = None,
        kinds: str = _NUMERIC,
    ):
        if not callable(fn):
            raise UnsupportedOp(f"Op expects a callable fn(a, b), got {type(fn).__name__}.")
        init = object.__setattr__
        init(self, "fn", fn)
        init(self, "commutative", bool(commutative))
        init(self, "name", name or getattr(fn, "__name__", "user"))
        init(self, "identity", identity)
        init(self, "kinds", kinds)
        init(self, "is_ufunc", isinstance(fn, np.ufunc))
        # NumPy multiplies complex numbers with fused multiply-adds in one loop and without in another, and
        # picks the loop by whether the output overlaps an input: x *= y and z = x * y can differ in the last
        # bit. Two ranks that fold the same values, one in place and one not, would then hold different
        # results; a complex product is therefore always computed into new memory (see out_of_place).
        init(self, "fresh_for_complex", fn is np.multiply)

    def __setattr__(self, name, value):
        raise AttributeError(f"an Op cannot be changed once made (setting {name!r} of {self!r}): the plans "
                             f"compiled for it run the function it was made with. Make a new Op instead.")

    def __delattr__(self, name):
        self.__setattr__(name, None)

    def __reduce__(self):  # pickled (and copied) by its arguments, not by setting its slots
        return Op, (self.fn, self.commutative, self.name, self.identity, self.kinds)

    def out_of_place(self, dtype) -> bool:
        """Whether a fold of ``dtype`` must compute into new memory, then copy (``into[...] = fn(a, b)``).

        True for functions that are not ufuncs (they return their result), and
        for a complex product, whose last bit NumPy's in-place loop rounds
        differently: every rank that computes the same fold then gets the same bits.
        """
        return not self.is_ufunc or (self.fresh_for_complex and dtype.kind == "c")

    def __repr__(self) -> str:
        return f"Op({self.name!r}, commutative={self.commutative})"

    def check_dtype(self, dtype: np.dtype) -> None:
        """Raise :class:`UnsupportedOp` if this op is not defined for ``dtype``."""
        if dtype.kind not in self.kinds:
            raise UnsupportedOp(
                f"op {self.name!r} is not defined for dtype {dtype}; it accepts dtype kinds "
                f"{_describe_kinds(self.kinds)}."
            )

    def combine(self, into, operand, operand_first: bool, src=None) -> None:
        """Set ``into = operand (op) src`` if ``operand_first`` else ``src (op) operand``.

        ``src`` defaults to ``into``. All are same-length arrays; ``into`` is
        written in place (elementwise, so ``src`` may be ``into`` itself).
        """
        if src is None:
            src = into
        if self.is_ufunc and not (self.fresh_for_complex and into.dtype.kind == "c"):
            if operand_first:
                self.fn(operand, src, out=into)
            else:
                self.fn(src, operand, out=into)
        else:
            result = self.fn(operand, src) if operand_first else self.fn(src, operand)
            into[...] = result

    def identity_array(self, shape, dtype, xp=np):
        """An array filled with the identity, or ``None`` if the op has none."""
        if self.identity is None:
            return None
        if callable(self.identity):
            return self.identity(shape, dtype)
        return xp.full(shape, self.identity, dtype=dtype)


def _describe_kinds(kinds: str) -> str:
    words = {"b": "bool", "i": "signed int", "u": "unsigned int", "f": "float", "c": "complex"}
    return ", ".join(words[k] for k in kinds)


def _extreme(which):
    def identity(shape, dtype):
        dtype = np.dtype(dtype)
        if dtype.kind == "b":
            value = which == "min"
        elif dtype.kind in _INTS:
            info = np.iinfo(dtype)
            value = info.max if which == "min" else info.min
        else:
            value = np.inf if which == "min" else -np.inf
        return np.full(shape, value, dtype=dtype)

    return identity


def _band_identity(shape, dtype):
    dtype = np.dtype(dtype)
    if dtype.kind == "b":
        return np.ones(shape, dtype=dtype)
    return np.full(shape, -1 if dtype.kind == "i" else np.iinfo(dtype).max, dtype=dtype)


SUM = Op(np.add, True, "sum", 0)
PROD = Op(np.multiply, True, "prod", 1)
MAX = Op(np.maximum, True, "max", _extreme("max"), kinds="biuf")
MIN = Op(np.minimum, True, "min", _extreme("min"), kinds="biuf")
LAND = Op(np.logical_and, True, "land", True, kinds="biuf")
LOR = Op(np.logical_or, True, "lor", False, kinds="biuf")
LXOR = Op(np.logical_xor, True, "lxor", False, kinds="biuf")
BAND = Op(np.bitwise_and, True, "band", _band_identity, kinds="biu")
BOR = Op(np.bitwise_or, True, "bor", 0, kinds="biu")
BXOR = Op(np.bitwise_xor, True, "bxor", 0, kinds="biu")


OPS: dict[str, Op] = {op.name: op for op in (SUM, PROD, MAX, MIN, LAND, LOR, LXOR, BAND, BOR, BXOR)}
_ALIASES = {"add": "sum", "product": "prod", "multiply": "prod", "maximum": "max", "minimum": "min",
            "logical_and": "land", "logical_or": "lor", "logical_xor": "lxor",
            "bitwise_and": "band", "bitwise_or": "bor", "bitwise_xor": "bxor"}


def get_op(op: "str | Op | np.ufunc") -> Op:
    """Resolve ``op`` (a name such as ``"sum"``, an :class:`Op`, or a ufunc) to an :class:`Op`."""
    if isinstance(op, Op):
        return op
    found = OPS.get(op) if isinstance(op, str) else None
    if found is not None:
        return found
    if isinstance(op, str):
        key = op.lower()
        key = _ALIASES.get(key, key)
        if key in OPS:
            return OPS[key]
        raise UnsupportedOp(f"unknown op {op!r}; expected one of {sorted(OPS)} or a commkit.Op.")
    if isinstance(op, np.ufunc):
        for candidate in OPS.values():
            if candidate.fn is op:
                return candidate
        raise UnsupportedOp(f"ufunc {op.__name__} is not a known reduction; wrap it in commkit.Op(fn, commutative=...).")
    raise UnsupportedOp(f"op must be a name, a commkit.Op or a NumPy ufunc, got {type(op).__name__}.")
