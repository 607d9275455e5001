"""What every transport provides, and the constants shared with the public API.

A transport moves bytes between the ranks of one communication context and
nothing else. The interface, as the executor and the communicator use it:

* ``rank``, ``size``, ``name``, ``tag_ub``, ``supports_any_source``;
* ``post(sends, recvs, tag) -> pending`` and ``transfer(sends, recvs, tag,
  timeout) -> pending_peers``, where ``sends``/``recvs`` are lists of
  ``(peer, flat_array)``; ``pending.test() -> bool`` and
  ``pending.wait(timeout) -> list`` of the peers still outstanding (empty when
  all completed, so an empty list means success); optionally
  ``pending.settles() -> bool``, ``test()`` a few times in one call (an
  i-form's start tries it before it leaves a transfer in flight). These
  receives, and those of ``bind_transfer`` / ``bind_timed_transfer`` /
  ``persistent_transfer``, are a collective's: each
  message must be exactly as long as its buffer, and one that is shorter or
  longer raises :class:`~commkit.errors.MessageTruncated` (:func:`short_receive`
  names the shorter kind). The schedule fixes every size, so a shorter message
  means the ranks disagree about the call, and the bytes it did not fill
  would be returned as if they had been sent;
* ``isend(buf, dest, tag)`` / ``irecv(buf, source, tag)`` for user
  point-to-point, ``send_object`` / ``recv_object`` / ``probe``: an ``irecv``
  may be longer than the message, as in MPI;
* ``dup()``, ``split(color, key)``, ``free()``, ``abort(exc)``;
* optionally ``native(collective, ...)``: the library's own collectives.

Transports live in this package because they are the only modules allowed to
import mpi4py or cupy. A helper every transport may use lives here too:
:func:`allgather_objects`, every rank's object over ``send_object`` /
``recv_object``. (:class:`Backoff`, the one spin-then-sleep rhythm of every
polling wait, lives in :mod:`commkit._wait` and is re-exported here.)
"""

from __future__ import annotations

from typing import NamedTuple

from .._wait import Backoff
from ..errors import MessageTruncated

__all__ = ["ANY_SOURCE", "ANY_TAG", "Backoff", "Status", "allgather_objects", "short_receive"]

ANY_SOURCE = -1
ANY_TAG = -1


class Status(NamedTuple):
    """What a completed receive learned: who sent it, with which tag, how many bytes."""

    source: int
    tag: int
    nbytes: int


def short_receive(peer: int, expected: int, received: int) -> MessageTruncated:
    """The error of a collective's receive from ``peer`` that got ``received`` of its ``expected`` bytes."""
    return MessageTruncated(
        f"expected {expected} bytes from rank {peer}, got {received}: a collective's message must fill the "
        "buffer posted for it, and the bytes it leaves were never sent.",
        peer=peer, expected=expected, received=received)


def inline(run, template: str, values: tuple, errors=None):
    """Mark the bound op ``run`` as writable into a plan's generated code; returns ``run``.

    ``template`` is one line of Python (simple statements, ``;`` between them) with ``{0}``, ``{1}`` ... for ``values``
    and ``tag`` for the call's tag, doing exactly what ``run(tag)`` does; with
    ``errors = (exception_type, translate)`` an exception of that type is raised
    as ``translate(exc)``, as ``run`` itself would. A plan writes such ops one
    after the other into a single function (:mod:`commkit.plan`), so a call
    costs no Python call per step; ops without the mark are called as ``op(tag)``.
    """
    run.inline = (template, tuple(values), errors)
    return run


def allgather_objects(chan, obj, tag: int, timeout: float | None, timed_out) -> list:
    """Every rank's ``obj``, in rank order, over ``chan``'s ``send_object`` / ``recv_object``.

    Each rank sends to every other rank without waiting (``isend_object`` where the
    channel has it: a large pickle goes by rendezvous, and ranks that all block in
    sends before receiving would wait for each other forever), then receives from
    each in rank order, then completes its sends. ``timed_out(peer)`` makes the
    exception raised when the receive from ``peer`` gets nothing within ``timeout``
    seconds.
    """
    isend = getattr(chan, "isend_object", None)
    pending = []
    for peer in range(chan.size):
        if peer != chan.rank:
            if isend is not None:
                pending.append(isend(obj, peer, tag))
            else:
                chan.send_object(obj, peer, tag)
    out = []
    for peer in range(chan.size):
        if peer == chan.rank:
            out.append(obj)
            continue
        got = chan.recv_object(peer, tag, timeout)
        if got is None:
            raise timed_out(peer)
        out.append(got[0])
    for request in pending:
        if request is not None:
            request.wait()
    return out
