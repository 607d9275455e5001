"""Call identity: what a collective's messages carry so that mismatched calls can never match.

Why. Collective messages travel on a context of their own, so they never meet
the user's point-to-point traffic; but two *different* collective calls on one
communicator share that context. If their messages were told apart only by a
call number, rank 0's ``allreduce`` could complete with the data of rank 1's
``broadcast`` -- a wrong answer, silently. So every message of a call carries
the call's identity in its tag, and a receive only matches a message of the
same identity. A mismatch then becomes a wait, which the watchdog explains
(:mod:`commkit.watchdog`), never a wrong answer.

The tag is built once per call *shape* (it is part of the cached plan) and
combined with the call number by one shift and one OR per call::

    tag = (seq mod 2**S) << (bits - S)  |  kind << (D + H)  |  dtype << H  |  hash
          call number                      collective         element type   the rest

* ``kind`` (5 bits) and ``dtype`` (5 bits) are exact: calls of different
  collectives, or with different element types of the same byte size
  (float32 on one rank, int32 on another), never match.
* ``hash`` holds the rest of the call's signature -- root, op, element count
  (or the counts vector), algorithm, byte order -- in the remaining bits (9 on
  MPICH, whose ``MPI_TAG_UB`` is 2**29 - 1): two calls that differ only there
  share a tag with probability 2**-H. A count mismatch that still slips
  through a hash collision is caught as a truncated message by the transport.
* ``seq`` (S = 10 bits) tells calls of the same shape apart. It wraps after
  1024 calls; that is safe because the communicator refuses to have more than
  :data:`MAX_IN_FLIGHT` nonblocking collectives outstanding at once, and
  blocking calls on different ranks can drift apart by a whole multiple of
  1024 calls only if every call in between matched -- which the identity
  forbids. A rank that skipped a call stays one call behind, and every later
  call waits instead of matching.

Libraries whose tag bound is small (the MPI standard only promises 32767)
get a shorter layout: half the bits for the call number, the rest for a hash
of the whole signature, kind and dtype included.
"""

from __future__ import annotations

import zlib

__all__ = ["KINDS", "TagLayout", "kind_code", "dtype_code"]

# Fixed codes: a code, once given, is never reused for another collective, so
# tags mean the same on every rank whatever version of this table it runs.
KINDS = (
    "allreduce", "reduce", "broadcast", "gather", "scatter", "allgather", "alltoall", "reduce_scatter",
    "scan", "exscan", "barrier", "allgatherv", "gatherv", "scatterv", "alltoallv",
    "check", "meta", "object",
)
_KIND_CODE = {name: i + 1 for i, name in enumerate(KINDS)}  # 0 is "unknown"

# Element types by (kind, itemsize): everything commkit moves (bool, int, uint, float, complex).
_DTYPES = ("b1", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8", "f10", "f12", "f16",
           "c8", "c16", "c20", "c24", "c32")
_DTYPE_CODE = {name: i + 1 for i, name in enumerate(_DTYPES)}  # 0 is "no data" (barrier, metadata)

KIND_BITS = 5
DTYPE_BITS = 5
SEQ_BITS = 10
MAX_IN_FLIGHT = (1 << SEQ_BITS) - 1


def kind_code(collective: str) -> int:
    """The 5-bit code of a collective (or commkit's control traffic)."""
    return _KIND_CODE.get(collective, 0)


def dtype_code(dtype) -> int:
    """The 5-bit code of an element type (0 for None)."""
    if dtype is None:
        return 0
    return _DTYPE_CODE.get(f"{dtype.kind}{dtype.itemsize}", 31)


class TagLayout:
    """How a transport's tag bound is divided between call number, kind, dtype and signature hash."""

    __slots__ = ("bits", "seq_bits", "seq_shift", "seq_mask", "hash_bits", "exact")

    def __init__(self, tag_ub: int):
        bits = max(int(tag_ub), 1).bit_length()
        if int(tag_ub) < (1 << bits) - 1:
            bits -= 1  # only tags up to tag_ub are valid: use the bits that are all usable
        self.bits = bits
        # A small tag bound gets half its bits for the call number and a hash of everything for the rest.
        self.exact = bits >= SEQ_BITS + KIND_BITS + DTYPE_BITS + 4
        self.seq_bits = SEQ_BITS if self.exact else max(bits // 2, 1)
        self.seq_shift = bits - self.seq_bits
        self.seq_mask = (1 << self.seq_bits) - 1
        self.hash_bits = self.seq_shift - (KIND_BITS + DTYPE_BITS if self.exact else 0)

    def kind_of(self, tag: int) -> int | None:
        """The collective's kind code a tag carries (:func:`kind_code`), or None where the layout keeps none."""
        if not self.exact:
            return None
        return (tag >> (DTYPE_BITS + self.hash_bits)) & ((1 << KIND_BITS) - 1)

    @property
    def max_in_flight(self) -> int:
        """How many calls may be outstanding at once before call numbers could repeat."""
        return self.seq_mask

    def base(self, collective: str, dtype=None, signature=()) -> int:
        """The call-number-free part of the tag of one call shape."""
        kind, code = kind_code(collective), dtype_code(dtype)
        text = repr((collective, None if dtype is None else dtype.str, signature)).encode()
        digest = zlib.crc32(text)
        if self.exact:
            hashed = digest & ((1 << self.hash_bits) - 1)
            return (kind << (DTYPE_BITS + self.hash_bits)) | (code << self.hash_bits) | hashed
        return digest & ((1 << self.hash_bits) - 1)

    def tag(self, base: int, seq: int) -> int:
        """The tag of call number ``seq`` of the shape whose :meth:`base` is ``base``."""
        return ((seq & self.seq_mask) << self.seq_shift) | base
