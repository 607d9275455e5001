"""The threads world: N ranks as N threads of one process, for notebooks, tests and teaching.

Matching follows MPI's rules so that programs behave the same here as under
``mpiexec``: a receive names a context, a source (or ANY_SOURCE) and a tag (or
ANY_TAG); messages from one sender in one context are matched in the order
they were sent; posted receives are matched in the order they were posted.
Each destination rank keeps two queues, as MPI implementations do: messages
that arrived before a matching receive (unexpected) and receives posted before
a matching message (posted). Sends are eager: the payload is copied at send
time, so ``isend`` completes at once and the sender may reuse its buffer.

Both queues are indexed by ``(context, source, tag)``, each key holding its
entries in arrival (or posting) order, and every entry carries a world-wide
sequence number. Why: sends are eager, so the non-roots of a rooted
collective run ahead without bound, and a root fell 13,700 messages behind
over 16,000 reduces at p = 3; scanning one list per match made every receive
cost the whole backlog (a minute and more). A receive naming its source and
tag now takes the head of one deque. A wildcard (ANY_SOURCE, ANY_TAG) looks
at the head of each key of its context and takes the oldest, which is the
message a single list scanned in order would have found; a message looks at
the head of its own key among the posted receives and at the posted
wildcards (usually none), and takes the one posted first.

A receive posted by a collective (``post``/``transfer``) is exact: a message
shorter than its buffer is refused (:class:`~commkit.errors.MessageTruncated`),
since the bytes it did not fill were never sent. A user's ``irecv`` may be
longer than the message, as in MPI.

One lock guards the whole world; each rank waits on its own condition. When a
rank fails, :meth:`LocalWorld.fail` wakes every waiter, which then raises
:class:`~commkit.errors.PeerFailed` instead of hanging.
"""

from __future__ import annotations

import collections
import itertools
import pickle
import threading
import time

from ..errors import CommTimeout, InvalidBuffer, MessageTruncated, PeerFailed
from .base import ANY_SOURCE, ANY_TAG, Status, allgather_objects, short_receive

__all__ = ["LocalWorld", "LocalTransport"]


class _Message:
    __slots__ = ("ctx", "src", "tag", "payload", "is_object")

    def __init__(self, ctx, src, tag, payload, is_object):
        self.ctx = ctx
        self.src = src
        self.tag = tag
        self.payload = payload
        self.is_object = is_object


class _Receive:
    """A posted receive: where it matches and where the data goes."""

    __slots__ = ("ctx", "src", "tag", "buf", "is_object", "done", "status", "obj", "error", "world", "dst", "peer",
                 "exact")

    def __init__(self, world, dst, ctx, src, tag, buf, is_object, peer, exact=False):
        self.world = world
        self.dst = dst
        self.ctx = ctx
        self.src = src
        self.tag = tag
        self.buf = buf
        self.is_object = is_object
        self.done = False
        self.status = None
        self.obj = None
        self.error = None
        self.peer = peer
        self.exact = exact  # a collective's receive: the message must fill the buffer

    def matches(self, msg: _Message) -> bool:
        return (
            msg.ctx == self.ctx
            and (self.src == ANY_SOURCE or msg.src == self.src)
            and (self.tag == ANY_TAG or msg.tag == self.tag)
        )

    def fill(self, msg: _Message, local_source: int) -> None:
        """Deliver ``msg`` into this receive (called with the world lock held)."""
        if msg.is_object != self.is_object:
            want = "a Python object (recv_object)" if self.is_object else "an array (recv)"
            came = "a Python object" if msg.is_object else "an array"
            self.error = InvalidBuffer(f"rank {local_source} sent {came} but this rank posted {want} with a matching tag.")
        elif self.is_object:
            self.obj = pickle.loads(msg.payload)
            self.status = Status(local_source, msg.tag, len(msg.payload))
        else:
            nbytes = msg.payload.nbytes
            if nbytes > self.buf.nbytes:
                self.error = MessageTruncated(
                    f"message of {nbytes} bytes from rank {local_source} (tag {msg.tag}) does not fit "
                    f"the receive buffer of {self.buf.nbytes} bytes.",
                    peer=local_source, expected=self.buf.nbytes, received=nbytes,
                )
            elif self.exact and nbytes != self.buf.nbytes:
                self.error = short_receive(local_source, self.buf.nbytes, nbytes)
            elif nbytes:
                self.buf.view("u1")[:nbytes] = msg.payload.view("u1")
            self.status = Status(local_source, msg.tag, nbytes)
        self.done = True

    def wait(self, timeout: float | None) -> bool:
        """Block until filled; False on timeout. Raises PeerFailed or a delivery error."""
        world = self.world
        cond = world.conds[self.dst]
        deadline = None if timeout is None else time.monotonic() + timeout
        with world.lock:
            while not self.done:
                world.check_failed()
                if deadline is None:
                    cond.wait(1.0)
                else:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return False
                    cond.wait(min(remaining, 1.0))
        if self.error is not None:
            raise self.error
        return True

    def withdraw(self) -> None:
        """Take this receive off its rank's posted queue, if no message has matched it yet."""
        with self.world.lock:
            self.world.posted[self.dst].remove(self)

    def test(self) -> bool:
        if not self.done:
            self.world.check_failed()
            return False
        if self.error is not None:
            raise self.error
        return True


class _Pending:
    """The receives of one posted Transfer (its sends completed eagerly)."""

    __slots__ = ("receives",)

    def __init__(self, receives):
        self.receives = receives

    def test(self) -> bool:
        return all(r.test() for r in self.receives)

    def wait(self, timeout: float | None) -> list:
        deadline = None if timeout is None else time.monotonic() + timeout
        for r in self.receives:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not r.wait(remaining):
                return [x.peer for x in self.receives if not x.done]
        return []

    def abandon(self) -> None:
        """Withdraw the receives still posted, so a late message cannot land in their buffers."""
        for r in self.receives:
            if not r.done:
                r.withdraw()


class _Unexpected:
    """One rank's messages that arrived before a matching receive, indexed by ``(ctx, src, tag)``."""

    __slots__ = ("keys", "count")

    def __init__(self):
        self.keys: dict = {}  # ctx -> {(src, tag): deque of (order, msg, local_source)}, no empty deque kept
        self.count = 0

    def append(self, order: int, msg: _Message, local_source: int) -> None:
        keys = self.keys.get(msg.ctx)
        if keys is None:
            keys = self.keys[msg.ctx] = {}
        queue = keys.get((msg.src, msg.tag))
        if queue is None:
            queue = keys[msg.src, msg.tag] = collections.deque()
        queue.append((order, msg, local_source))
        self.count += 1

    def find(self, ctx, src: int, tag: int):
        """The oldest message matching ``(ctx, src, tag)`` (wildcards allowed), as its deque, or None."""
        keys = self.keys.get(ctx)
        if not keys:
            return None
        if src != ANY_SOURCE and tag != ANY_TAG:
            return keys.get((src, tag))
        best = None
        for (msrc, mtag), queue in keys.items():
            if (src == ANY_SOURCE or msrc == src) and (tag == ANY_TAG or mtag == tag):
                if best is None or queue[0][0] < best[0][0]:
                    best = queue
        return best

    def take(self, queue):
        """Remove and return ``(msg, local_source)`` at the head of ``queue`` (found by :meth:`find`)."""
        _, msg, local_source = queue.popleft()
        self.count -= 1
        if not queue:
            keys = self.keys[msg.ctx]
            del keys[msg.src, msg.tag]
            if not keys:
                del self.keys[msg.ctx]
        return msg, local_source


class _Posted:
    """One rank's receives posted before a matching message: by ``(ctx, src, tag)``, wildcards apart."""

    __slots__ = ("exact", "wild")

    def __init__(self):
        self.exact: dict = {}  # (ctx, src, tag) -> deque of (order, receive), no empty deque kept
        self.wild: list = []  # (order, receive) of receives with ANY_SOURCE or ANY_TAG, in posting order

    def append(self, order: int, receive: _Receive) -> None:
        if receive.src == ANY_SOURCE or receive.tag == ANY_TAG:
            self.wild.append((order, receive))
            return
        key = (receive.ctx, receive.src, receive.tag)
        queue = self.exact.get(key)
        if queue is None:
            queue = self.exact[key] = collections.deque()
        queue.append((order, receive))

    def take(self, msg: _Message):
        """Remove and return the receive posted first among those matching ``msg``, or None."""
        key = (msg.ctx, msg.src, msg.tag)
        queue = self.exact.get(key)
        wild = None
        for i, (order, receive) in enumerate(self.wild):
            if receive.matches(msg):
                wild = i
                break
        if queue is not None and (wild is None or queue[0][0] < self.wild[wild][0]):
            _, receive = queue.popleft()
            if not queue:
                del self.exact[key]
            return receive
        if wild is not None:
            return self.wild.pop(wild)[1]
        return None

    def remove(self, receive: _Receive) -> None:
        """Take ``receive`` off the queue if it is still there."""
        if receive.src == ANY_SOURCE or receive.tag == ANY_TAG:
            self.wild = [entry for entry in self.wild if entry[1] is not receive]
            return
        key = (receive.ctx, receive.src, receive.tag)
        queue = self.exact.get(key)
        if queue is None:
            return
        for entry in queue:
            if entry[1] is receive:
                queue.remove(entry)
                break
        if not queue:
            del self.exact[key]


class LocalWorld:
    """The shared state of one threads world of ``size`` ranks."""

    def __init__(self, size: int):
        self.size = size
        self.lock = threading.Lock()
        self.conds = [threading.Condition(self.lock) for _ in range(size)]
        self.unexpected = [_Unexpected() for _ in range(size)]
        self.posted = [_Posted() for _ in range(size)]
        self.failed = None
        # Orders every message and every posted receive: a wildcard match takes the oldest.
        self._order = itertools.count()

    def fail(self, rank: int, exc: BaseException) -> None:
        """Record that ``rank`` failed and wake every waiting rank."""
        with self.lock:
            if self.failed is None:
                self.failed = (rank, exc)
            for cond in self.conds:
                cond.notify_all()

    def check_failed(self) -> None:
        if self.failed is not None:
            rank, exc = self.failed
            raise PeerFailed(
                f"rank {rank} failed with {type(exc).__name__}: {exc}; "
                "this rank's operation can never complete."
            )

    def deliver(self, dst: int, msg: _Message, local_source: int) -> None:
        with self.lock:
            receive = self.posted[dst].take(msg)
            if receive is not None:
                receive.fill(msg, local_source)
            else:
                self.unexpected[dst].append(next(self._order), msg, local_source)
            self.conds[dst].notify_all()

    def post_receive(self, receive: _Receive) -> None:
        with self.lock:
            unexpected = self.unexpected[receive.dst]
            queue = unexpected.find(receive.ctx, receive.src, receive.tag)
            if queue is not None:
                receive.fill(*unexpected.take(queue))
                return
            self.posted[receive.dst].append(next(self._order), receive)

    def discard(self, dst: int, ctx, src: int, tag: int) -> None:
        """Take the oldest message to ``dst`` matching ``(ctx, src, tag)`` off its queue, unread (if one is there)."""
        with self.lock:
            queue = self.unexpected[dst].find(ctx, src, tag)
            if queue is not None:
                self.unexpected[dst].take(queue)

    def probe(self, dst: int, ctx, src: int, tag: int):
        with self.lock:
            queue = self.unexpected[dst].find(ctx, src, tag)
            if queue is None:
                return None
            _, msg, local_source = queue[0]
            return Status(local_source, msg.tag, msg.payload.nbytes if not msg.is_object else len(msg.payload))


class LocalTransport:
    """One rank's view of a communication context in a :class:`LocalWorld`."""

    name = "local"
    supports_any_source = True
    tag_ub = 2**31 - 1

    def __init__(self, world: LocalWorld, rank: int, ranks: tuple | None = None, ctx=("world",)):
        self.world = world
        self.ranks = tuple(range(world.size)) if ranks is None else tuple(ranks)
        self.rank = rank
        self.size = len(self.ranks)
        self.ctx = ctx
        self._world_rank = self.ranks[rank]
        self._local_of = {w: i for i, w in enumerate(self.ranks)}
        self._children = 0

    # -- point to point ------------------------------------------------------

    def _send(self, payload, dest: int, tag: int, is_object: bool) -> None:
        self.world.check_failed()
        msg = _Message(self.ctx, self._world_rank, tag, payload, is_object)
        self.world.deliver(self.ranks[dest], msg, self.rank)

    def _receive(self, buf, source: int, tag: int, is_object: bool, exact: bool = False) -> _Receive:
        src = source if source == ANY_SOURCE else self.ranks[source]
        receive = _Receive(self.world, self._world_rank, self.ctx, src, tag, buf, is_object, source, exact)
        self.world.post_receive(receive)
        return receive

    def isend(self, buf, dest: int, tag: int):
        """Post a send; the payload is copied now, so the returned handle is already complete."""
        self._send(buf.copy(), dest, tag, False)
        return _Pending(())

    def irecv(self, buf, source: int, tag: int):
        """Post a receive into ``buf``; the handle's ``status`` is set once it completes."""
        return _RecvHandle(self._receive(buf, source, tag, False))

    def send_object(self, obj, dest: int, tag: int) -> None:
        self._send(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dest, tag, True)

    def recv_object(self, source: int, tag: int, timeout: float | None, object_bit: int = 0):
        """Receive a pickled object; returns ``(obj, status)`` or ``None`` on timeout.

        ``object_bit`` is not needed here: a message knows whether it is an object, and a
        receive of the wrong kind fails with an error naming both.
        """
        receive = self._receive(None, source, tag, True)
        if not receive.wait(timeout):
            receive.withdraw()
            return None
        return receive.obj, receive.status

    def probe(self, source: int, tag: int):
        src = source if source == ANY_SOURCE else self.ranks[source]
        return self.world.probe(self._world_rank, self.ctx, src, tag)

    def discard(self, status) -> None:
        """Drop the message :meth:`probe` found (``status``): data of a call this rank gave up."""
        self.world.discard(self._world_rank, self.ctx, self.ranks[status.source], status.tag)

    # -- schedule steps --------------------------------------------------------

    def post(self, sends, recvs, tag: int) -> _Pending:
        """Post a collective step's receives (each must be filled exactly) and send its messages eagerly."""
        receives = [self._receive(buf, peer, tag, False, exact=True) for peer, buf in recvs]
        for peer, buf in sends:
            self._send(buf.copy(), peer, tag, False)
        return _Pending(receives)

    def transfer(self, sends, recvs, tag: int, timeout: float | None) -> list:
        pending = self.post(sends, recvs, tag)
        stuck = pending.wait(timeout)
        if stuck:
            pending.abandon()
        return stuck

    @staticmethod
    def relax() -> None:
        """Called by a rank that polls without progress: let the other ranks' threads run.

        Without it, a thread spinning on ``test()`` keeps the GIL for its whole switch
        interval (5 ms) while the peer it waits for cannot run.
        """
        time.sleep(2e-5)

    # -- communicators ---------------------------------------------------------

    def dup(self) -> "LocalTransport":
        """A new context over the same ranks (collective: every rank calls it in the same order)."""
        self._children += 1
        return LocalTransport(self.world, self.rank, self.ranks, self.ctx + (("dup", self._children),))

    def split(self, color, key: int, timeout: float | None = None):
        """Split by ``color`` (None for no new group), ordering ranks by ``(key, rank)``."""
        self._children += 1
        label = ("split", self._children)
        ctl = LocalTransport(self.world, self.rank, self.ranks, self.ctx + (label, "ctl"))
        entries = allgather_objects(ctl, (color, key), 0, timeout, lambda peer: CommTimeout(
            f"rank {self.rank} timed out in split waiting for rank {peer}."))
        if color is None:
            return None
        members = sorted((k, r) for r, (c, k) in enumerate(entries) if c == color)
        group = tuple(self.ranks[r] for _, r in members)
        new_rank = [r for _, r in members].index(self.rank)
        return LocalTransport(self.world, new_rank, group, self.ctx + (label, color))

    def free(self) -> None:
        """Nothing to release: contexts are plain tuples."""

    def abort(self, exc: BaseException) -> None:
        self.world.fail(self._world_rank, exc)

    def arena(self, rendezvous=None):
        """This communicator's node arena (:mod:`._arena`): one NumPy block shared by its rank threads."""
        made = self.__dict__.get("_node_arena")  # every node call asks: one dict lookup once it is made
        if made is None:
            from ._arena import node_arena

            made = self._node_arena = node_arena(self, rendezvous)
        return made


class _RecvHandle(_Pending):
    __slots__ = ()

    def __init__(self, receive: _Receive):
        super().__init__((receive,))

    @property
    def status(self):
        return self.receives[0].status
