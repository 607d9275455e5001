"""One prepared collective call: what the communicator's entry points hand to its engine.

Shared by :mod:`commkit.communicator` and the vector collectives' mixin
(:mod:`commkit._vector`), which build calls the same way.
"""

from __future__ import annotations

import numpy as np


class Call:
    """One prepared collective call: flat buffers, sizes, and how to shape the result."""

    __slots__ = ("collective", "arg", "src", "dst", "op", "root", "nbytes", "dtype", "xp", "aliased",
                 "shape", "has_result", "signature_count", "result", "key", "keep", "fresh")

    def __init__(self, collective, arg, src, dst, op=None, root=0, nbytes=0, dtype=None, xp=np,
                 aliased=False, shape=None, has_result=True, signature_count=None):
        self.collective = collective
        self.arg = arg
        self.src = src
        self.dst = dst
        self.op = op
        self.root = root
        self.nbytes = nbytes
        self.dtype = dtype
        self.xp = xp
        self.aliased = aliased
        self.shape = shape
        self.has_result = has_result
        self.signature_count = arg if signature_count is None else signature_count
        self.result = None  # the array handed back to the caller (``out`` itself when given)
        self.key = None     # the blocking call's plan-cache key, when its arrays may be bound (see plan.py)
        self.keep = None    # the caller's arrays that key names by identity
        self.fresh = None   # the call's key by its arguments' kinds, for new arrays of this shape (Communicator._fresh)
