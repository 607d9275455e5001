"""A small key-value store over TCP: how NCCL ranks launched without MPI find each other.

NCCL needs one 128-byte unique id, made on one rank and known to every rank,
before any GPU can talk; commkit also needs a way to move small Python
objects (``send_object``, the metadata of ``split``). Under ``mpiexec`` MPI
does both. Without it, rank 0 serves this store and every rank (rank 0 too)
is a client of it.

Why a store and not a mesh of sockets: one server, one connection per rank
and five verbs (set, get, pop, add, wait for a counter) are enough for a
bootstrap that moves a few kilobytes, and a crashed rank shows up as a closed
connection instead of a hang. Waiting happens in the server (a ``get`` with a
timeout blocks its connection's thread on a condition), so no rank polls.

Wire format, all integers big-endian::

    request:  op (1 byte) | key length (4) | value length (8) | timeout (8, double; < 0 waits forever) | key | value
    reply:    status (1 byte) | value length (8) | value

The server never unpickles anything; :class:`StoreGroup` pickles on the
client side. Anyone who can connect can therefore hand a client a pickle, so
the server binds to loopback by default, and a non-loopback bind should set a
shared token (``COMMKIT_STORE_TOKEN``), which every connection must present
first.

:class:`StoreGroup` builds what the NCCL transport needs from those verbs:
broadcast and allgather of objects, a barrier, tagged object messages with
MPI's matching rules (per-sender order, ANY_SOURCE, ANY_TAG), and ``dup`` /
``split`` into sub-groups with their own key spaces. :class:`MemoryStore`
offers the same verbs in-process, for a world of one rank (no socket at all).
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import pickle
import socket
import struct
import threading
import time
import warnings

from ..errors import CommTimeout, InvalidArgument, PeerFailed, TransportUnavailable
from .base import ANY_SOURCE, ANY_TAG, Status

__all__ = ["StoreServer", "StoreClient", "MemoryStore", "StoreGroup", "DEFAULT_HOST", "DEFAULT_PORT",
           "store_address"]

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 29517

_HELLO, _SET, _GET, _POP, _ADD, _DELETE, _WAIT_COUNT = range(7)
_OK, _MISSING, _DENIED = range(3)
_REQUEST = struct.Struct("!BIQd")
_REPLY = struct.Struct("!BQ")
_INT = struct.Struct("!q")
_MAX_KEY = 1 << 16
_MAX_VALUE = 1 << 31
_ABORT_KEY = "commkit/abort"


def store_address(host=None, port=None) -> tuple[str, int]:
    """The store's ``(host, port)``: the arguments, else ``COMMKIT_STORE_HOST``/``COMMKIT_STORE_PORT``, else loopback:29517."""
    host = host or os.environ.get("COMMKIT_STORE_HOST") or DEFAULT_HOST
    if port is None:
        text = os.environ.get("COMMKIT_STORE_PORT")
        if text:
            try:
                port = int(text)
            except ValueError:
                raise InvalidArgument(f"COMMKIT_STORE_PORT must be a port number, got {text!r}.") from None
        else:
            port = DEFAULT_PORT
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise InvalidArgument(f"store_port must be an int in [0, 65535], got {port!r}.")
    return str(host), port


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    """Read exactly ``n`` bytes; raise ConnectionError if the peer closed the connection first."""
    if n == 0:
        return b""
    chunks = []
    while n:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise ConnectionError("connection closed")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


# -- server ------------------------------------------------------------------------------------------


class StoreServer:
    """Serve a key-value store on ``(host, port)`` from background threads (``port=0``: any free port).

    Args:
        host: the address to bind (default loopback).
        port: the TCP port; 0 lets the system choose (read it back from ``port``).
        token: a shared secret every client must present first (``None``: none).

    Raises:
        TransportUnavailable: the address cannot be bound (in use, or not this machine's).
    """

    def __init__(self, host: str = DEFAULT_HOST, port: int = 0, token: str | None = None):
        if token is None and not _is_loopback(host):
            warnings.warn(
                f"the commkit store listens on {host}, beyond loopback, without a token: anyone who can reach "
                "that port can send pickled objects to every rank. Set COMMKIT_STORE_TOKEN on every rank.",
                RuntimeWarning, stacklevel=2)
        self._token = token.encode() if token else b""
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()
        self._closing = False
        self._conns: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            family, _, _, _, address = infos[0]
            listener = socket.socket(family, socket.SOCK_STREAM)
        except OSError as exc:
            raise TransportUnavailable(f"the commkit store cannot listen on {host}:{port}: {exc}.") from None
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(address)
            listener.listen(128)
        except OSError as exc:
            listener.close()
            raise TransportUnavailable(
                f"the commkit store cannot listen on {host}:{port}: {exc.strerror or exc}. Another job may hold "
                "that port: choose another with store_port= or COMMKIT_STORE_PORT (the same on every rank)."
            ) from None
        listener.settimeout(0.2)
        self._listener = listener
        self.host = host
        self.port = listener.getsockname()[1]
        self._acceptor = threading.Thread(target=self._accept_loop, name="commkit-store-accept", daemon=True)
        self._acceptor.start()

    def __enter__(self) -> "StoreServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def connections(self) -> int:
        """How many clients are connected now."""
        with self._cond:
            return len(self._conns)

    def wait_for_disconnects(self, remaining: int, timeout: float) -> bool:
        """Block until at most ``remaining`` clients are connected, or ``timeout`` seconds pass."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while len(self._conns) > remaining:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self) -> None:
        """Stop serving: close the listener and every connection, then join the threads (bounded)."""
        with self._cond:
            if self._closing:
                return
            self._closing = True
            conns = list(self._conns)
            self._cond.notify_all()
        self._listener.close()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._acceptor.join(5)
        for thread in list(self._threads):
            thread.join(5)

    def _accept_loop(self) -> None:
        while not self._closing:
            try:
                conn, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return  # the listener was closed
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._cond:
                if self._closing:
                    conn.close()
                    return
                self._conns.add(conn)
            thread = threading.Thread(target=self._serve, args=(conn,), name="commkit-store-conn", daemon=True)
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        authenticated = not self._token
        try:
            while True:
                op, keylen, vallen, timeout = _REQUEST.unpack(_recv_exact(conn, _REQUEST.size))
                if keylen > _MAX_KEY or vallen > _MAX_VALUE:
                    return  # not a commkit client: drop the connection
                key = _recv_exact(conn, keylen).decode("utf-8", "replace")
                value = _recv_exact(conn, vallen)
                if op == _HELLO:
                    authenticated = authenticated or hmac.compare_digest(value, self._token)
                    status, reply = (_OK, b"") if authenticated else (_DENIED, b"")
                elif not authenticated:
                    status, reply = _DENIED, b""
                else:
                    status, reply = self._apply(op, key, value, timeout)
                conn.sendall(_REPLY.pack(status, len(reply)) + reply)
                if status == _DENIED:
                    return
        except (ConnectionError, OSError, struct.error):
            return
        finally:
            with self._cond:
                self._conns.discard(conn)
                self._cond.notify_all()
            conn.close()

    def _apply(self, op: int, key: str, value: bytes, timeout: float):
        data, cond = self._data, self._cond
        with cond:
            if op == _SET:
                data[key] = value
                cond.notify_all()
                return _OK, b""
            if op == _ADD:
                total = (_INT.unpack(data[key])[0] if key in data else 0) + _INT.unpack(value)[0]
                data[key] = _INT.pack(total)
                cond.notify_all()
                return _OK, data[key]
            if op == _DELETE:
                return (_OK if data.pop(key, None) is not None else _MISSING), b""
            deadline = None if timeout < 0 else time.monotonic() + timeout
            if op == _WAIT_COUNT:
                target = _INT.unpack(value)[0]

                def ready():
                    return key in data and _INT.unpack(data[key])[0] >= target
            else:
                def ready():
                    return key in data
            while not ready():
                if self._closing:
                    return _MISSING, b""
                if deadline is None:
                    cond.wait()
                else:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return _MISSING, b""
                    cond.wait(left)
            if op == _POP:
                return _OK, data.pop(key)
            return _OK, data[key]


# -- clients --------------------------------------------------------------------------------------------


class StoreClient:
    """One connection to a :class:`StoreServer`; thread-safe (one request at a time).

    Connecting retries until ``connect_timeout`` passes, because rank 0 may
    start its server after the other ranks start their clients.

    Raises:
        TransportUnavailable: no server answered at ``(host, port)`` in time, or it refused the token.
    """

    def __init__(self, host: str, port: int, *, token: str | None = None, connect_timeout: float = 60.0):
        self.host, self.port = host, port
        self._lock = threading.Lock()
        deadline = time.monotonic() + connect_timeout
        delay = 0.01
        while True:
            try:
                sock = socket.create_connection((host, port), timeout=max(0.1, min(5.0, deadline - time.monotonic())))
                break
            except OSError as exc:
                if time.monotonic() + delay >= deadline:
                    raise TransportUnavailable(
                        f"no commkit store answered at {host}:{port} within {connect_timeout:g} s ({exc}). "
                        "Rank 0 serves it: check that rank 0 runs, and that COMMKIT_STORE_HOST and "
                        "COMMKIT_STORE_PORT (or store_host=/store_port=) are the same on every rank."
                    ) from None
                time.sleep(delay)
                delay = min(delay * 2, 0.5)
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock = sock
        if token:
            status, _ = self._request(_HELLO, "", token.encode(), -1.0)
            if status != _OK:
                self.close()
                raise TransportUnavailable(f"the commkit store at {host}:{port} refused this rank's token; "
                                           "COMMKIT_STORE_TOKEN must be the same on every rank.")

    def _request(self, op: int, key: str, value: bytes, timeout: float):
        raw = key.encode()
        if len(raw) > _MAX_KEY or len(value) > _MAX_VALUE:
            raise InvalidArgument(f"store key or value too large ({len(raw)} and {len(value)} bytes).")
        with self._lock:
            sock = self._sock
            if sock is None:
                raise PeerFailed("this rank's connection to the commkit store was closed.")
            try:
                sock.sendall(_REQUEST.pack(op, len(raw), len(value), timeout) + raw + value)
                status, n = _REPLY.unpack(_recv_exact(sock, _REPLY.size))
                reply = _recv_exact(sock, n)
            except (ConnectionError, OSError):
                raise PeerFailed(
                    f"the commkit store at {self.host}:{self.port} closed the connection; rank 0, which serves it, "
                    "has probably exited or failed."
                ) from None
        if status == _DENIED and op != _HELLO:
            raise TransportUnavailable(f"the commkit store at {self.host}:{self.port} wants a token; set "
                                       "COMMKIT_STORE_TOKEN (the same on every rank).")
        return status, reply

    @staticmethod
    def _timeout(timeout) -> float:
        return -1.0 if timeout is None else max(0.0, float(timeout))

    def set(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key`` (replacing any old value) and wake its waiters."""
        self._request(_SET, key, value, -1.0)

    def get(self, key: str, timeout: float | None = None) -> bytes | None:
        """The value of ``key``, waiting up to ``timeout`` seconds for it to appear (None: forever; 0: no wait)."""
        status, value = self._request(_GET, key, b"", self._timeout(timeout))
        return value if status == _OK else None

    def pop(self, key: str, timeout: float | None = None) -> bytes | None:
        """Like :meth:`get`, and delete the key in the same step."""
        status, value = self._request(_POP, key, b"", self._timeout(timeout))
        return value if status == _OK else None

    def add(self, key: str, delta: int) -> int:
        """Add ``delta`` to the integer counter ``key`` (created at 0) and return its new value."""
        _, value = self._request(_ADD, key, _INT.pack(delta), -1.0)
        return _INT.unpack(value)[0]

    def delete(self, key: str) -> bool:
        """Delete ``key``; whether it existed."""
        status, _ = self._request(_DELETE, key, b"", -1.0)
        return status == _OK

    def wait_count(self, key: str, target: int, timeout: float | None = None) -> bool:
        """Wait until the counter ``key`` reaches ``target``; False if ``timeout`` passed first."""
        status, _ = self._request(_WAIT_COUNT, key, _INT.pack(target), self._timeout(timeout))
        return status == _OK

    def close(self) -> None:
        """Close the connection (idempotent)."""
        with self._lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()


class MemoryStore:
    """The verbs of :class:`StoreClient` on an in-process dictionary (a world of one process)."""

    def __init__(self):
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()

    def _wait(self, ready, timeout) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not ready():
            if deadline is None:
                self._cond.wait()
            else:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def set(self, key: str, value: bytes) -> None:
        with self._cond:
            self._data[key] = bytes(value)
            self._cond.notify_all()

    def get(self, key: str, timeout: float | None = None) -> bytes | None:
        with self._cond:
            return self._data[key] if self._wait(lambda: key in self._data, timeout) else None

    def pop(self, key: str, timeout: float | None = None) -> bytes | None:
        with self._cond:
            return self._data.pop(key) if self._wait(lambda: key in self._data, timeout) else None

    def add(self, key: str, delta: int) -> int:
        with self._cond:
            total = (_INT.unpack(self._data[key])[0] if key in self._data else 0) + int(delta)
            self._data[key] = _INT.pack(total)
            self._cond.notify_all()
            return total

    def delete(self, key: str) -> bool:
        with self._cond:
            return self._data.pop(key, None) is not None

    def wait_count(self, key: str, target: int, timeout: float | None = None) -> bool:
        with self._cond:
            return self._wait(lambda: key in self._data and _INT.unpack(self._data[key])[0] >= target, timeout)

    def close(self) -> None:
        """Nothing to release."""


# -- a group of ranks over a store ----------------------------------------------------------------------


class StoreGroup:
    """``size`` ranks that exchange small Python objects through a store, under the key prefix ``prefix``.

    Object messages follow MPI's matching rules: messages from one sender are
    received in the order they were sent; a receive names a source (or
    ANY_SOURCE) and a tag (or ANY_TAG). Each message is one key,
    ``<prefix>/m/<src>><dst>/<n>``, popped by its receiver; messages that
    arrive ahead of a matching receive wait in this rank's ``_unexpected`` list.

    ``bcast``, ``allgather`` and ``barrier`` are collective: every rank of the
    group calls them in the same order (their keys are numbered by that order).
    ``dup`` and ``split`` make sub-groups whose prefixes every rank derives the
    same way, so they need no agreement beyond ``split``'s allgather.
    """

    def __init__(self, store, prefix: str, rank: int, size: int):
        self.store = store
        self.prefix = prefix
        self.rank = rank
        self.size = size
        self.tag_ub = 2**31 - 1
        self._sent = [0] * size         # next message number to each destination
        self._next = [0] * size         # next message number expected from each source
        self._unexpected: list = []     # (source, tag, payload) fetched but not yet matched
        self._collectives = 0
        self._children = 0
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()

    # -- collectives over keys -------------------------------------------------------------------

    def _key(self, kind: str) -> str:
        self._collectives += 1
        return f"{self.prefix}/{kind}{self._collectives}"

    def _get(self, key: str, timeout, what: str) -> bytes:
        value = self.store.get(key, timeout)
        if value is None:
            raise CommTimeout(f"rank {self.rank} timed out after {timeout:g} s in {what} over the commkit store; "
                              "another rank may not have reached it.")
        return value

    def _done(self, key: str, keys) -> None:
        """Count this rank out of a collective; the last rank out deletes its keys."""
        if self.store.add(key + "/out", 1) == self.size:
            for k in keys:
                self.store.delete(k)
            self.store.delete(key + "/out")

    def bcast(self, obj, root: int = 0, timeout: float | None = None):
        """``root``'s ``obj`` on every rank (collective)."""
        key = self._key("b")
        if self.size == 1:
            return obj
        if self.rank == root:
            self.store.set(key, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        else:
            obj = pickle.loads(self._get(key, timeout, "a broadcast"))
        self._done(key, [key])
        return obj

    def allgather(self, obj, timeout: float | None = None) -> list:
        """Every rank's ``obj`` in rank order (collective)."""
        key = self._key("g")
        if self.size == 1:
            return [obj]
        self.store.set(f"{key}/{self.rank}", pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        out = [obj if r == self.rank else pickle.loads(self._get(f"{key}/{r}", timeout, "an allgather"))
               for r in range(self.size)]
        self._done(key, [f"{key}/{r}" for r in range(self.size)])
        return out

    def barrier(self, timeout: float | None = None) -> None:
        """Return once every rank has entered (collective)."""
        key = self._key("w")
        if self.size == 1:
            return
        self.store.add(key, 1)
        if not self.store.wait_count(key, self.size, timeout):
            raise CommTimeout(f"rank {self.rank} timed out after {timeout:g} s in a barrier over the commkit store.")
        self._done(key, [key])

    # -- tagged object messages -----------------------------------------------------------------------

    def _mailbox(self, src: int, dst: int, n: int) -> str:
        return f"{self.prefix}/m/{src}>{dst}/{n}"

    def send_object(self, obj, dest: int, tag: int) -> None:
        """Send a picklable ``obj`` to ``dest`` with ``tag`` (never blocks on the receiver)."""
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            n = self._sent[dest]
            self._sent[dest] = n + 1
        self.store.set(self._mailbox(self.rank, dest, n), _INT.pack(tag) + payload)

    def _take(self, source: int, timeout) -> bool:
        """Move the next message from ``source`` into the unexpected list; False if none came in ``timeout``."""
        raw = self.store.pop(self._mailbox(source, self.rank, self._next[source]), timeout)
        if raw is None:
            return False
        self._next[source] += 1
        self._unexpected.append((source, _INT.unpack(raw[:8])[0], raw[8:]))
        return True

    def _match(self, source: int, tag: int, remove: bool):
        for i, (src, t, payload) in enumerate(self._unexpected):
            if (source == ANY_SOURCE or src == source) and (tag == ANY_TAG or t == tag):
                if remove:
                    del self._unexpected[i]
                return src, t, payload
        return None

    def recv_object(self, source: int, tag: int, timeout: float | None):
        """Receive an object sent with :meth:`send_object`: ``(obj, Status)``, or None on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        sources = range(self.size) if source == ANY_SOURCE else (source,)
        sleep = 1e-4
        with self._recv_lock:
            while True:
                found = self._match(source, tag, remove=True)
                if found is not None:
                    src, t, payload = found
                    return pickle.loads(payload), Status(src, t, len(payload))
                if any(self._take(s, 0) for s in sources):
                    continue
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                if source != ANY_SOURCE:
                    # One sender: let the server wait, in short slices so that the client connection
                    # (shared by this rank's threads) is never held for long.
                    self._take(source, 0.1 if left is None else min(left, 0.1))
                else:
                    time.sleep(sleep if left is None else min(sleep, left))
                    sleep = min(sleep * 2, 0.01)

    def probe(self, source: int, tag: int):
        """The Status of a matching message that has arrived, without receiving it; None if none has."""
        sources = range(self.size) if source == ANY_SOURCE else (source,)
        with self._recv_lock:
            while True:
                found = self._match(source, tag, remove=False)
                if found is not None:
                    src, t, payload = found
                    return Status(src, t, len(payload))
                if not any(self._take(s, 0) for s in sources):
                    return None

    # -- sub-groups and failure -------------------------------------------------------------------------

    def free(self) -> None:
        """Nothing to release: the keys of finished collectives and received messages are already gone."""

    def dup(self) -> "StoreGroup":
        """A group over the same ranks with a key space of its own (every rank calls it in the same order)."""
        self._children += 1
        return StoreGroup(self.store, f"{self.prefix}.d{self._children}", self.rank, self.size)

    def split(self, color, key: int, timeout: float | None = None):
        """Split by ``color`` (None: no new group), ordering ranks by ``(key, rank)`` (collective)."""
        self._children += 1
        label = self._children
        entries = self.allgather((color, key), timeout)
        if color is None:
            return None
        members = sorted((k, r) for r, (c, k) in enumerate(entries) if c == color)
        new_rank = [r for _, r in members].index(self.rank)
        return StoreGroup(self.store, f"{self.prefix}.s{label}c{color}", new_rank, len(members))

    def signal_abort(self, reason: str) -> None:
        """Tell every rank of every group on this store that the job cannot continue."""
        try:
            self.store.set(_ABORT_KEY, reason.encode("utf-8", "replace"))
        except PeerFailed:
            pass  # the store is gone: nobody is left to tell

    def aborted(self) -> str | None:
        """The reason a rank gave in :meth:`signal_abort`, or None."""
        value = self.store.get(_ABORT_KEY, 0)
        return None if value is None else value.decode("utf-8", "replace")
