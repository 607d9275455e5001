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


def inline(run, template: str, values: tuple, errors=None):
    """Mark the bound op ``run`` as writable into a plan's generated code; returns ``run``.

    ``template`` is one Python statement with ``{0}``, ``{1}`` ... for ``values``
    and ``tag`` for the call's tag, doing exactly what ``run(tag)`` does; with
    ``errors = (exception_type, translate)`` an exception of that type is raised
    as ``translate(exc)``, as ``run`` itself would. A plan writes such ops one
    after the other into a single function (:mod:`commkit.plan`), so a call
    costs no Python call per step; ops without the mark are called as ``op(tag)``.
    """
    run.inline = (template, tuple(values), errors)
    return run
