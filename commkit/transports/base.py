"""What every transport provides, and the constants shared with the public API.

A transport moves bytes between the ranks of one communication context and
nothing else. The interface, as the executor and the communicator use it:

* ``rank``, ``size``, ``name``, ``tag_ub``, ``supports_any_source``;
* ``post(sends, recvs, tag) -> pending`` and ``transfer(sends, recvs, tag,
  timeout) -> pending_peers``, where ``sends``/``recvs`` are lists of
  ``(peer, flat_array)``; ``pending.test() -> bool`` and
  ``pending.wait(timeout) -> list`` of the peers still outstanding (empty when
  all completed, so an empty list means success);
* ``isend(buf, dest, tag)`` / ``irecv(buf, source, tag)`` for user
  point-to-point, ``send_object`` / ``recv_object`` / ``probe``;
* ``dup()``, ``split(color, key)``, ``free()``, ``abort(exc)``;
* optionally ``native(collective, ...)``: the library's own collectives.

Transports live in this package because they are the only modules allowed to
import mpi4py or cupy.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["ANY_SOURCE", "ANY_TAG", "Status"]

ANY_SOURCE = -1
ANY_TAG = -1


class Status(NamedTuple):
    """What a completed receive learned: who sent it, with which tag, how many bytes."""

    source: int
    tag: int
    nbytes: int
