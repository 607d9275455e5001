"""A small authenticated key-value store over TCP: how NCCL ranks launched without MPI find each other.

NCCL needs one 128-byte unique id, made on one rank and known to every rank,
before any GPU can talk; commkit also needs a way to move small Python
objects (``send_object``, the metadata of ``split``). Under ``mpiexec`` MPI
does both. Without it, rank 0 serves this store and every rank (rank 0 too)
is a client of it.

Why a store and not a mesh of sockets: one server, one connection per rank
and six verbs (set, get, pop, add, delete, wait for a counter) are enough for
a bootstrap that moves a few kilobytes, and a crashed rank shows up as a
closed connection instead of a hang. Waiting happens in the server (a ``get``
with a timeout blocks its connection's thread on a condition), so no rank
polls.

Threat model. :class:`StoreGroup` unpickles what it reads from the store, so
a value written by anyone but a rank of this job is code run inside every
rank. Loopback is no boundary between users (login nodes, shared GPU boxes),
and a port is no secret. So the store trusts exactly one thing, a per-job
secret, and nothing reaches a client or the key space without proof of it:

* The secret. Whenever commkit starts the store it draws 256 random bits
  (:func:`secrets.token_hex`), unless the user named one
  (``COMMKIT_STORE_TOKEN``, at least 16 bytes of random text). A store never
  runs without a secret.
* How it reaches the other ranks. Rank 0 binds a free port (port 0) unless
  one is named, then :meth:`StoreServer.publish` writes host, port and secret
  to a rendezvous file: created with mode 0600, written whole under a
  temporary name and renamed into place (readers see all of it or nothing);
  the default directory must be the user's and closed to everyone else
  (mode 0700), a named file's directory is the user's choice. The other
  ranks wait for the file (:func:`connect_rendezvous`) and refuse one that
  is a symbolic link, is not a regular file, is owned by someone else or is
  open to group or others.
  The file is deleted once every rank has connected, and at the latest when
  the server closes. The default file is
  ``$XDG_RUNTIME_DIR/commkit/store-<id>.json`` (else
  ``<tmp>/commkit-<uid>/store-<id>.json``), ``<id>`` being the named port or
  else the parent process id, which the ranks of one launch share; a user
  who passes both port and secret to every rank needs no file at all.
* Mutual proof before anything else. A connection starts with a fixed-size
  handshake: the client sends a magic and a fresh 32-byte nonce; the server
  answers with its own fresh nonce and ``HMAC(secret, "server" | both
  nonces)``; only if that checks out (:func:`hmac.compare_digest`) does the
  client answer ``HMAC(secret, "client" | both nonces)``. The secret itself
  never crosses the wire, a process squatting the port learns one random
  nonce and nothing else (the client speaks second and stops when the proof
  fails), and the server reads no request before the client has proved the
  secret.
* Every message after it is authenticated too: both sides derive a session
  key from the secret and the two nonces, and each request and reply carries
  ``HMAC(session key, direction | sequence number | header | key | value)``.
  A relay or an injected segment cannot change, replay or reorder a value
  without the connection being closed, so every pickle a rank unpickles was
  written by a rank of this job.
* Limits. Before authentication the server reads only the 40 handshake bytes
  and the 32-byte proof, with a 10 s deadline, from at most 64 such
  connections at a time; a wrong magic or proof closes the connection
  without reading further. After it, keys are limited to 64 KiB and values
  to 1 GiB, checked on the header before any body is read.
* Requests cannot kill the server. Clients accept timeouts that are None
  (wait forever) or finite and non-negative, and say so clearly otherwise;
  the server still checks every field (operation, timeout, counter sizes,
  UTF-8 keys) and answers a bad one with an error reply that the client
  raises as :class:`InvalidArgument`, keeping the connection.

What it does not do: values travel unencrypted (authenticated, not secret;
reading loopback traffic takes root), and a local user can still slow a
bootstrap down (holding the named port, or handshake slots for 10 s) though
not read or write anything. A secret chosen by the user must be random:
anyone who connects gets one HMAC of it to guess against offline.

Wire format, all integers big-endian::

    handshake:  client: magic (8) | client nonce (32)
                server: magic (8) | server nonce (32) | server proof (32)
                client: client proof (32)
                server: status (1 byte: OK, or DENIED and the connection closes)
    request:    op (1 byte) | key length (4) | value length (8) | timeout (8, double; < 0 waits forever)
                | key | value | tag (32)
    reply:      status (1 byte) | value length (8) | value | tag (32)

:class:`StoreGroup` builds what the NCCL transport needs from those verbs:
broadcast and allgather of objects, a barrier, tagged object messages with
MPI's matching rules (per-sender order, ANY_SOURCE, ANY_TAG), and ``dup`` /
``split`` into sub-groups with their own key spaces. :class:`MemoryStore`
offers the same verbs in-process, for a world of one rank (no socket at all).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import numbers
import os
import pickle
import secrets
import socket
import stat
import struct
import tempfile
import threading
import time

from .._wait import Backoff
from ..errors import CommTimeout, InvalidArgument, PeerFailed, TransportUnavailable
from .base import ANY_SOURCE, ANY_TAG, Status

__all__ = ["StoreServer", "StoreClient", "MemoryStore", "StoreGroup", "DEFAULT_HOST", "store_address",
           "rendezvous_path", "connect_rendezvous"]

DEFAULT_HOST = "127.0.0.1"

_MAGIC = b"CKSTORE2"
_NONCE = 32
_PROOF = 32                      # an HMAC-SHA256 digest
_SERVER_PROOF = b"commkit-store/server-proof\0"
_CLIENT_PROOF = b"commkit-store/client-proof\0"
_SESSION = b"commkit-store/session-key\0"
_REQUEST_TAG, _REPLY_TAG = b"Q", b"R"
_HANDSHAKE_TIMEOUT = 10.0        # seconds an unauthenticated connection may take to prove the secret
_MAX_PENDING = 64                # unauthenticated connections served at a time; more are closed at once
_MIN_TOKEN = 16                  # bytes of a user-chosen secret

_SET, _GET, _POP, _ADD, _DELETE, _WAIT_COUNT = range(1, 7)
_WAITING_OPS = frozenset((_GET, _POP, _WAIT_COUNT))
_OK, _MISSING, _DENIED, _BAD = range(4)
_REQUEST = struct.Struct("!BIQd")
_REPLY = struct.Struct("!BQ")
_INT = struct.Struct("!q")
_SEQ = struct.Struct("!Q")
_MAX_KEY = 1 << 16
_MAX_VALUE = 1 << 30
_MAX_REPLY_TEXT = 1 << 12        # an error reply's message
_WAIT_SLICE = 3600.0             # the server waits in slices no longer than this (Condition.wait's limit)
_MAX_RENDEZVOUS = 4096           # bytes of a rendezvous file
_ABORT_KEY = "commkit/abort"


def store_address(host=None, port=None) -> tuple[str, int]:
    """The store's ``(host, port)``: the arguments, else ``COMMKIT_STORE_HOST``/``COMMKIT_STORE_PORT``.

    The defaults are loopback and port 0: rank 0 binds a free port and the other
    ranks learn it from the rendezvous file.

    Args:
        host: the address rank 0 binds and the others connect to (None: the environment, else 127.0.0.1).
        port: the TCP port (None: the environment, else 0).

    Raises:
        InvalidArgument: the port is not an int in [0, 65535].
    """
    host = host or os.environ.get("COMMKIT_STORE_HOST") or DEFAULT_HOST
    if port is None:
        text = os.environ.get("COMMKIT_STORE_PORT")
        if text:
            try:
                port = int(text)
            except ValueError:
                raise InvalidArgument(f"COMMKIT_STORE_PORT must be a port number, got {text!r}.") from None
        else:
            port = 0
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise InvalidArgument(f"store_port must be an int in [0, 65535], got {port!r}.")
    return str(host), port


def _secret_bytes(token) -> bytes:
    """The store secret as bytes, after checking it is one (its value never appears in a message)."""
    if isinstance(token, str):
        raw = token.encode("utf-8")
    elif isinstance(token, (bytes, bytearray)):
        raw = bytes(token)
    else:
        raise InvalidArgument(f"the store secret (store_token, COMMKIT_STORE_TOKEN) must be a str or bytes, got "
                              f"{type(token).__name__}.")
    if len(raw) < _MIN_TOKEN:
        raise InvalidArgument(
            f"the store secret (store_token, COMMKIT_STORE_TOKEN) must be at least {_MIN_TOKEN} bytes of random "
            f"text, got {len(raw)} bytes; make one with: python -c 'import secrets; print(secrets.token_hex(16))'.")
    return raw


def _wire_timeout(timeout, what: str = "timeout") -> float:
    """A client's timeout as the wire carries it: -1.0 for None (wait forever), else finite seconds >= 0."""
    if timeout is None:
        return -1.0
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise InvalidArgument(f"the store {what} must be None (wait forever) or a number of seconds, "
                              f"got {timeout!r}.")
    try:
        seconds = float(timeout)
    except OverflowError:
        seconds = math.inf
    if not math.isfinite(seconds) or seconds < 0:
        raise InvalidArgument(f"the store {what} must be None (wait forever) or a finite number of seconds >= 0, "
                              f"got {timeout!r}.")
    return seconds


def _connect_seconds(timeout) -> float:
    """A connect timeout: finite seconds >= 0 (a rank that waits forever for a store that never comes is a hang)."""
    try:
        seconds = float(timeout) if isinstance(timeout, numbers.Real) and not isinstance(timeout, bool) else math.nan
    except OverflowError:
        seconds = math.inf
    if not 0 <= seconds < math.inf:
        raise InvalidArgument(f"the store connect_timeout must be a finite number of seconds >= 0, got {timeout!r}.")
    return seconds


def _mac(key: bytes, label: bytes, *parts) -> bytes:
    digest = hmac.new(key, label, hashlib.sha256)
    for part in parts:
        digest.update(part)
    return digest.digest()


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


# -- the rendezvous file ------------------------------------------------------------------------------


def _uid():
    return os.getuid() if hasattr(os, "getuid") else None


def _private(st) -> bool:
    """Whether a file's status says it belongs to this user and is closed to group and others."""
    uid = _uid()
    return (uid is None or st.st_uid == uid) and not st.st_mode & 0o077


def rendezvous_path(port: int = 0) -> str:
    """The default rendezvous file: the same path on every rank a launcher started together.

    The directory is ``$XDG_RUNTIME_DIR/commkit`` where that variable names a
    directory, else ``commkit-<uid>`` in the temporary directory; the name is
    ``store-port<port>.json`` when a port is named, else
    ``store-ppid<parent pid>.json`` (ranks started by one shell loop or launcher
    share their parent). Ranks started by different parents must name a file
    of their own (``COMMKIT_STORE_FILE``, the same on every rank).

    Args:
        port: the named store port, or 0 when rank 0 picks one.
    """
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        directory = os.path.join(runtime, "commkit")
    else:
        directory = os.path.join(tempfile.gettempdir(), f"commkit-{_uid() if _uid() is not None else 'user'}")
    name = f"store-port{port}.json" if port else f"store-ppid{os.getppid()}.json"
    return os.path.join(directory, name)


def _prepare_directory(path: str) -> None:
    """Create the rendezvous file's directory (mode 0700) if missing; a default one must be private."""
    directory = os.path.dirname(os.path.abspath(path))
    default = os.path.dirname(rendezvous_path())
    try:
        if directory == default:
            try:
                os.mkdir(directory, 0o700)
            except FileExistsError:
                pass
        st = os.lstat(directory)
    except OSError as exc:
        raise TransportUnavailable(f"the commkit store cannot use the directory {directory} for its rendezvous "
                                   f"file: {exc.strerror or exc}.") from None
    if not stat.S_ISDIR(st.st_mode):
        raise TransportUnavailable(f"the commkit store wanted a directory at {directory} for its rendezvous file, "
                                   "but found something else (or a symbolic link) there.")
    if directory == default and not _private(st):
        raise TransportUnavailable(
            f"the directory {directory} must belong to this user and be closed to everyone else (mode 0700) to hold "
            f"the store secret, but it has owner uid {st.st_uid} and mode {stat.S_IMODE(st.st_mode):04o}. Remove it, "
            "or name another rendezvous file with COMMKIT_STORE_FILE (the same on every rank).")


def _write_rendezvous(path: str, record: dict) -> tuple[int, int]:
    """Write ``record`` to ``path`` atomically with mode 0600; return the file's ``(st_dev, st_ino)``."""
    _prepare_directory(path)
    directory, name = os.path.split(os.path.abspath(path))
    temporary = os.path.join(directory, f".{name}.{os.getpid()}.{secrets.token_hex(8)}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(temporary, flags, 0o600)
        try:
            if hasattr(os, "fchmod"):
                os.fchmod(fd, 0o600)
            os.write(fd, json.dumps(record).encode())
            st = os.fstat(fd)
        finally:
            os.close(fd)
        os.replace(temporary, path)
    except OSError as exc:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise TransportUnavailable(f"the commkit store cannot write its rendezvous file {path}: "
                                   f"{exc.strerror or exc}.") from None
    return st.st_dev, st.st_ino


def _read_rendezvous(path: str):
    """The record in the rendezvous file at ``path``; None while there is none.

    Raises:
        TransportUnavailable: the file exists but is not a private regular file of this user, or is malformed.
    """
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise TransportUnavailable(f"the commkit store rendezvous file {path} cannot be opened ({exc.strerror or exc}"
                                   "); it must be a regular file, not a symbolic link.") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or not _private(st):
            raise TransportUnavailable(
                f"the commkit store rendezvous file {path} must be a regular file of this user that nobody else can "
                f"read or write (mode 0600), but it has owner uid {st.st_uid} and mode "
                f"{stat.S_IMODE(st.st_mode):04o}; it was not written by rank 0 of this job, so it is not used.")
        raw = os.read(fd, _MAX_RENDEZVOUS + 1)
    finally:
        os.close(fd)
    try:
        record = json.loads(raw) if len(raw) <= _MAX_RENDEZVOUS else None
    except ValueError:
        record = None
    if (not isinstance(record, dict) or not isinstance(record.get("host"), str)
            or type(record.get("port")) is not int or not 0 < record["port"] <= 65535
            or not isinstance(record.get("secret"), str) or not _is_hex(record["secret"])
            or not (record.get("size") is None or type(record.get("size")) is int)):
        raise TransportUnavailable(f"the commkit store rendezvous file {path} does not hold a host, a port and a "
                                   "secret as rank 0 writes them; delete it and start the job again.")
    return record


def _is_hex(text: str) -> bool:
    try:
        return len(bytes.fromhex(text)) >= _MIN_TOKEN
    except ValueError:
        return False


def connect_rendezvous(path: str, *, size: int | None = None, token: str | None = None,
                       connect_timeout: float = 60.0) -> "StoreClient":
    """Wait for rank 0's rendezvous file at ``path``, then connect to the store it names, with its secret.

    A file that names another job (another world size, a stale address, a
    server that cannot prove the secret) is read again until rank 0 of this job
    replaces it or ``connect_timeout`` passes.

    Args:
        path: the rendezvous file (the same on every rank; see :func:`rendezvous_path`).
        size: this job's world size; a file for another size is waited past (None: any).
        token: the secret to prove (None: the one in the file).
        connect_timeout: seconds to wait for the file and the store together.

    Raises:
        TransportUnavailable: no usable file and store came in time, or the file is not private to this user.
        InvalidArgument: ``connect_timeout`` is not a finite number of seconds >= 0.
    """
    backoff = Backoff(_connect_seconds(connect_timeout), spin=0, first=0.01, most=0.2)
    last = None
    while True:
        record = _read_rendezvous(path)
        if record is not None and size is not None and record.get("size") not in (None, size):
            last = f"the file names a job of {record['size']} ranks, not {size}"
        elif record is not None:
            try:
                secret = bytes.fromhex(record["secret"]) if token is None else token
                return StoreClient(record["host"], record["port"], token=secret,
                                   connect_timeout=max(0.0, min(backoff.left(), 2.0)))
            except TransportUnavailable as exc:
                last = str(exc)
        if not backoff.pause():
            found = "it never appeared" if last is None else f"last attempt: {last}"
            raise TransportUnavailable(
                f"no commkit store could be reached through the rendezvous file {path} within "
                f"{connect_timeout:g} s ({found}). Rank 0 writes that file when it starts the store: check that rank "
                "0 runs, and that every rank names the same file (COMMKIT_STORE_FILE or store_file=; the default is "
                "named after the port, else after the parent process, so ranks with different parents must set it).")


# -- server ------------------------------------------------------------------------------------------


class StoreServer:
    """Serve a key-value store on ``(host, port)`` from background threads, to clients that prove ``token``.

    Args:
        host: the address to bind (default loopback).
        port: the TCP port; 0 (the default) lets the system choose (read it back from ``port``).
        token: the secret every client must prove (None: a fresh random one, read it back from ``token``).

    Raises:
        TransportUnavailable: the address cannot be bound (in use, or not this machine's).
        InvalidArgument: ``token`` is not a str or bytes of at least 16 bytes.
    """

    def __init__(self, host: str = DEFAULT_HOST, port: int = 0, token: str | bytes | None = None):
        self.token = secrets.token_hex(32) if token is None else token
        self._secret = _secret_bytes(self.token)
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()
        self._closing = False
        self._conns: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._pending = 0        # connections still in the handshake
        self._clients = 0        # authenticated connections open now
        self._admitted = 0       # authenticated connections ever
        self._published = None   # (path, st_dev, st_ino, ranks) of the rendezvous file this server wrote
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
                f"the commkit store cannot listen on {host}:{port}: {exc.strerror or exc}. Another program may hold "
                "that port: leave COMMKIT_STORE_PORT unset (rank 0 then picks a free port) or choose another with "
                "store_port= or COMMKIT_STORE_PORT (the same on every rank)."
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
        """How many authenticated clients are connected now (connections still in the handshake do not count)."""
        with self._cond:
            return self._clients

    def publish(self, path: str, ranks: int | None = None) -> None:
        """Write this store's host, port and secret to the rendezvous file ``path`` for the other ranks.

        The file is created with mode 0600 under a temporary name and renamed
        into place, so a reader sees all of it or none. It is deleted once
        ``ranks`` clients have authenticated (every rank holds the secret then),
        else by :meth:`close`; a file some other process put there since is left alone.

        Args:
            path: where to write (see :func:`rendezvous_path`); the default directory is created with mode 0700.
            ranks: delete the file once this many clients have authenticated (None: only at close).

        Raises:
            TransportUnavailable: the file cannot be written, or the default directory is not private to this user.
        """
        record = {"host": self.host, "port": self.port, "secret": self._secret.hex(), "size": ranks,
                  "pid": os.getpid()}
        dev, ino = _write_rendezvous(path, record)
        with self._cond:
            self._published = (path, dev, ino, ranks)
            done = ranks is not None and self._admitted >= ranks
        if done:
            self._unpublish()

    def _unpublish(self) -> None:
        with self._cond:
            published, self._published = self._published, None
        if published is None:
            return
        path, dev, ino, _ = published
        try:
            st = os.lstat(path)
            if (st.st_dev, st.st_ino) == (dev, ino):
                os.unlink(path)
        except OSError:
            pass  # already gone, or no longer ours to remove

    def wait_for_disconnects(self, remaining: int, timeout: float) -> bool:
        """Block until at most ``remaining`` authenticated clients are connected, or ``timeout`` seconds pass."""
        with self._cond:
            return _wait_for(self._cond, lambda: self._clients <= remaining, time.monotonic() + timeout)

    def close(self) -> None:
        """Stop serving: delete the rendezvous file, close the listener and every connection, join the threads."""
        with self._cond:
            if self._closing:
                return
            self._closing = True
            conns = list(self._conns)
            self._cond.notify_all()
        self._unpublish()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept() at once where the system allows it
        except OSError:
            pass
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
            with self._cond:
                if self._closing or self._pending >= _MAX_PENDING:
                    conn.close()
                    if self._closing:
                        return
                    continue
                self._pending += 1
                self._conns.add(conn)
            thread = threading.Thread(target=self._serve, args=(conn,), name="commkit-store-conn", daemon=True)
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
            try:
                thread.start()
            except RuntimeError:  # no thread to serve it: drop this connection, keep accepting
                self._threads.remove(thread)
                self._forget(conn, authenticated=False)

    def _forget(self, conn: socket.socket, authenticated: bool) -> None:
        with self._cond:
            if conn in self._conns:
                self._conns.discard(conn)
                if authenticated:
                    self._clients -= 1
                else:
                    self._pending -= 1
            self._cond.notify_all()
        conn.close()

    def _handshake(self, conn: socket.socket):
        """Prove the secret to the client and check its proof; the session key, or None to hang up.

        The final OK byte is left to the caller, which counts the client in first.
        """
        conn.settimeout(_HANDSHAKE_TIMEOUT)
        if _recv_exact(conn, len(_MAGIC)) != _MAGIC:
            return None  # not a commkit client: nothing more is read
        client_nonce = _recv_exact(conn, _NONCE)
        server_nonce = secrets.token_bytes(_NONCE)
        conn.sendall(_MAGIC + server_nonce + _mac(self._secret, _SERVER_PROOF, client_nonce, server_nonce))
        proof = _recv_exact(conn, _PROOF)
        if not hmac.compare_digest(proof, _mac(self._secret, _CLIENT_PROOF, client_nonce, server_nonce)):
            conn.sendall(bytes([_DENIED]))
            return None
        return _mac(self._secret, _SESSION, client_nonce, server_nonce)

    def _serve(self, conn: socket.socket) -> None:
        authenticated = False
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            session = self._handshake(conn)
            if session is None:
                return
            with self._cond:
                self._pending -= 1
                self._clients += 1
                self._admitted += 1
                authenticated = True
                published = self._published
                done = published is not None and published[3] is not None and self._admitted >= published[3]
            if done:
                self._unpublish()
            conn.sendall(bytes([_OK]))
            conn.settimeout(None)
            seq = 0
            while True:
                head = _recv_exact(conn, _REQUEST.size)
                op, keylen, vallen, timeout = _REQUEST.unpack(head)
                if keylen > _MAX_KEY or vallen > _MAX_VALUE:
                    return  # a commkit client checks these limits before sending: hang up, read no body
                key = _recv_exact(conn, keylen)
                value = _recv_exact(conn, vallen)
                tag = _recv_exact(conn, _PROOF)
                number = _SEQ.pack(seq)
                seq += 1
                if not hmac.compare_digest(tag, _mac(session, _REQUEST_TAG, number, head, key, value)):
                    return  # not written by the client that proved the secret
                status, reply = self._dispatch(op, key, value, timeout)
                reply_head = _REPLY.pack(status, len(reply))
                conn.sendall(reply_head + reply + _mac(session, _REPLY_TAG, number, reply_head, reply))
        except (ConnectionError, OSError):
            return
        finally:
            self._forget(conn, authenticated)

    def _dispatch(self, op: int, raw_key: bytes, value: bytes, timeout: float):
        """``(status, reply)`` for an authenticated request: a bad field gets ``_BAD`` and a message, not an error."""
        try:
            key = raw_key.decode("utf-8")
        except UnicodeDecodeError:
            return _bad("the key is not UTF-8 text.")
        if not _SET <= op <= _WAIT_COUNT:
            return _bad(f"the operation code must be in [{_SET}, {_WAIT_COUNT}], got {op}.")
        if op in _WAITING_OPS and (math.isnan(timeout) or timeout == math.inf):
            return _bad(f"the timeout must be finite seconds >= 0 (or negative: wait forever), got {timeout!r}.")
        if op in (_ADD, _WAIT_COUNT) and len(value) != _INT.size:
            return _bad(f"a counter operand must be {_INT.size} bytes, got {len(value)}.")
        try:
            return self._apply(op, key, value, timeout)
        except Exception as exc:  # noqa: BLE001 - a request must never end the connection's thread
            return _bad(f"the store could not carry out the request ({type(exc).__name__}: {exc}).")

    def _apply(self, op: int, key: str, value: bytes, timeout: float):
        data, cond = self._data, self._cond
        with cond:
            if op in (_ADD, _WAIT_COUNT) and key in data and len(data[key]) != _INT.size:
                return _bad(f"the value of {key!r} is not a counter: it has {len(data[key])} bytes, not {_INT.size}.")
            if op == _SET:
                data[key] = value
                cond.notify_all()
                return _OK, b""
            if op == _ADD:
                total = (_INT.unpack(data[key])[0] if key in data else 0) + _INT.unpack(value)[0]
                if not -(1 << 63) <= total < (1 << 63):
                    return _bad(f"the counter {key!r} would leave the range of a signed 64-bit integer.")
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
            if not _wait_for(cond, ready, deadline, closing=lambda: self._closing):
                return _MISSING, b""
            if op == _POP:
                return _OK, data.pop(key)
            return _OK, data[key]


def _wait_for(cond, ready, deadline, closing=None) -> bool:
    """Wait on ``cond`` (held by the caller) until ``ready()``; False once ``deadline`` passes or ``closing()`` holds.

    Args:
        cond: a :class:`threading.Condition` the caller holds; whoever makes ``ready()`` true notifies it.
        ready: the predicate waited for, called with ``cond`` held.
        deadline: a ``time.monotonic()`` time, or None to wait without limit.
        closing: a predicate that ends the wait early (the server shutting down), or None.

    Each wait is at most :data:`_WAIT_SLICE` seconds (``Condition.wait``'s limit).
    """
    while not ready():
        if closing is not None and closing():
            return False
        if deadline is None:
            cond.wait(_WAIT_SLICE)
        else:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            cond.wait(min(left, _WAIT_SLICE))
    return True


def _bad(message: str):
    return _BAD, message.encode("utf-8")[:_MAX_REPLY_TEXT]


# -- clients --------------------------------------------------------------------------------------------


class _NotTheStore(Exception):
    """The peer answered the handshake, but not as this job's store."""


class StoreClient:
    """One authenticated connection to a :class:`StoreServer`; thread-safe (one request at a time).

    Connecting retries until ``connect_timeout`` passes, because rank 0 may
    start its server after the other ranks start their clients. The client
    sends nothing but a random nonce until the server has proved the secret,
    and refuses (without retrying) a server that cannot.

    Args:
        host, port: the store's address.
        token: the store secret (required; at least 16 bytes).
        connect_timeout: seconds to keep trying to connect.

    Raises:
        TransportUnavailable: no server answered at ``(host, port)`` in time, or the one there could not prove
            the secret (or refused this rank's proof).
        InvalidArgument: no usable secret, or ``connect_timeout`` is not a finite number of seconds >= 0.
    """

    def __init__(self, host: str, port: int, *, token: str | bytes | None = None, connect_timeout: float = 60.0):
        if token is None:
            raise InvalidArgument("a commkit store client needs the store's secret (token=): the store serves only "
                                  "clients that prove it.")
        secret = _secret_bytes(token)
        wait = _connect_seconds(connect_timeout)
        self.host, self.port = host, port
        self._lock = threading.Lock()
        self._seq = 0
        backoff = Backoff(wait, spin=0, first=0.01, most=0.5)
        while True:
            left = backoff.left()
            sock = None
            try:
                sock = socket.create_connection((host, port), timeout=max(0.1, min(5.0, left)))
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.settimeout(max(1.0, min(_HANDSHAKE_TIMEOUT, left)))
                self._session = self._handshake(sock, secret)
                break
            except _NotTheStore as exc:
                sock.close()
                raise TransportUnavailable(str(exc)) from None
            except OSError as exc:  # refused, reset, closed or timed out: rank 0 may not be serving yet
                if sock is not None:
                    sock.close()
                if not backoff.pause():
                    raise TransportUnavailable(
                        f"no commkit store answered at {host}:{port} within {wait:g} s "
                        f"({str(exc) or type(exc).__name__}). "
                        "Rank 0 serves it: check that rank 0 runs, and that COMMKIT_STORE_HOST and "
                        "COMMKIT_STORE_PORT (or store_host=/store_port=) are the same on every rank."
                    ) from None
        sock.settimeout(None)
        self._sock = sock

    def _handshake(self, sock: socket.socket, secret: bytes) -> bytes:
        """Check the server's proof of the secret, then give this client's; the session key."""
        client_nonce = secrets.token_bytes(_NONCE)
        sock.sendall(_MAGIC + client_nonce)
        if _recv_exact(sock, len(_MAGIC)) != _MAGIC:
            raise _NotTheStore(f"the process listening at {self.host}:{self.port} is not a commkit store (it "
                               "answered the handshake with something else); this rank sent it nothing but a random "
                               "nonce. Check COMMKIT_STORE_HOST and COMMKIT_STORE_PORT.")
        server_nonce = _recv_exact(sock, _NONCE)
        proof = _recv_exact(sock, _PROOF)
        if not hmac.compare_digest(proof, _mac(secret, _SERVER_PROOF, client_nonce, server_nonce)):
            raise _NotTheStore(
                f"the process listening at {self.host}:{self.port} could not prove that it knows this job's store "
                "secret, so this rank trusted it with nothing (it sent only a random nonce). Either it is not this "
                "job's rank 0 (another program holds the port) or the ranks were given different secrets "
                "(COMMKIT_STORE_TOKEN must be the same on every rank).")
        sock.sendall(_mac(secret, _CLIENT_PROOF, client_nonce, server_nonce))
        if _recv_exact(sock, 1) != bytes([_OK]):
            raise _NotTheStore(f"the commkit store at {self.host}:{self.port} refused this rank's proof of the "
                               "secret; COMMKIT_STORE_TOKEN must be the same on every rank.")
        return _mac(secret, _SESSION, client_nonce, server_nonce)

    def _request(self, op: int, key: str, value: bytes, timeout: float):
        try:
            raw = key.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidArgument(f"a store key must be encodable as UTF-8, got {key!r}.") from None
        if len(raw) > _MAX_KEY:
            raise InvalidArgument(f"a store key may have at most {_MAX_KEY} bytes, got {len(raw)}.")
        if len(value) > _MAX_VALUE:
            raise InvalidArgument(f"a store value may have at most {_MAX_VALUE} bytes (1 GiB), got {len(value)}: "
                                  "the bootstrap store is for small objects; send large data through the transport.")
        head = _REQUEST.pack(op, len(raw), len(value), timeout)
        with self._lock:
            sock = self._sock
            if sock is None:
                raise PeerFailed("this rank's connection to the commkit store was closed.")
            number = _SEQ.pack(self._seq)
            self._seq += 1
            tag = _mac(self._session, _REQUEST_TAG, number, head, raw, value)
            try:
                if len(value) < 1 << 16:
                    sock.sendall(head + raw + value + tag)
                else:
                    sock.sendall(head + raw)
                    sock.sendall(value)
                    sock.sendall(tag)
                reply_head = _recv_exact(sock, _REPLY.size)
                status, n = _REPLY.unpack(reply_head)
                if n > _MAX_VALUE:
                    raise ConnectionError("reply too long")
                reply = _recv_exact(sock, n)
                reply_tag = _recv_exact(sock, _PROOF)
            except (ConnectionError, OSError):
                raise PeerFailed(
                    f"the commkit store at {self.host}:{self.port} closed the connection; rank 0, which serves it, "
                    "has probably exited or failed."
                ) from None
            if not hmac.compare_digest(reply_tag, _mac(self._session, _REPLY_TAG, number, reply_head, reply)):
                self._sock = None
                sock.close()
                raise PeerFailed(
                    f"a reply on this rank's connection to the commkit store at {self.host}:{self.port} failed its "
                    "integrity check: something other than this job's store wrote to the connection, so this rank "
                    "closed it.")
        if status == _BAD:
            raise InvalidArgument(f"the commkit store at {self.host}:{self.port} refused a request: "
                                  f"{reply.decode('utf-8', 'replace')}")
        if status not in (_OK, _MISSING):
            raise PeerFailed(f"the commkit store at {self.host}:{self.port} answered with the unknown status "
                             f"{status}; rank 0 may run another commkit version.")
        return status, reply

    def set(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key`` (replacing any old value) and wake its waiters."""
        self._request(_SET, key, value, -1.0)

    def get(self, key: str, timeout: float | None = None) -> bytes | None:
        """The value of ``key``, waiting up to ``timeout`` seconds for it to appear (None: forever; 0: no wait).

        Raises:
            InvalidArgument: ``timeout`` is not None or a finite number of seconds >= 0.
            PeerFailed: the connection to the store broke.
        """
        status, value = self._request(_GET, key, b"", _wire_timeout(timeout))
        return value if status == _OK else None

    def pop(self, key: str, timeout: float | None = None) -> bytes | None:
        """Like :meth:`get`, and delete the key in the same step."""
        status, value = self._request(_POP, key, b"", _wire_timeout(timeout))
        return value if status == _OK else None

    def add(self, key: str, delta: int) -> int:
        """Add ``delta`` to the integer counter ``key`` (created at 0) and return its new value."""
        _, value = self._request(_ADD, key, _counter(delta, "delta"), -1.0)
        return _INT.unpack(value)[0]

    def delete(self, key: str) -> bool:
        """Delete ``key``; whether it existed."""
        status, _ = self._request(_DELETE, key, b"", -1.0)
        return status == _OK

    def wait_count(self, key: str, target: int, timeout: float | None = None) -> bool:
        """Wait until the counter ``key`` reaches ``target``; False if ``timeout`` passed first."""
        status, _ = self._request(_WAIT_COUNT, key, _counter(target, "target"), _wire_timeout(timeout))
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


def _counter(value, what: str) -> bytes:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not -(1 << 63) <= value < (1 << 63):
        raise InvalidArgument(f"a store counter's {what} must be an int in the signed 64-bit range, got {value!r}.")
    return _INT.pack(int(value))


class MemoryStore:
    """The verbs of :class:`StoreClient` on an in-process dictionary (a world of one process).

    Timeouts and counters are checked as :class:`StoreClient` checks them, so
    code that works on one works on the other.
    """

    def __init__(self):
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()

    def _wait(self, ready, timeout) -> bool:
        seconds = _wire_timeout(timeout)
        return _wait_for(self._cond, ready, None if seconds < 0 else time.monotonic() + seconds)

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
        operand = _INT.unpack(_counter(delta, "delta"))[0]
        with self._cond:
            total = (_INT.unpack(self._data[key])[0] if key in self._data else 0) + operand
            if not -(1 << 63) <= total < (1 << 63):
                raise InvalidArgument(f"the counter {key!r} would leave the range of a signed 64-bit integer.")
            self._data[key] = _INT.pack(total)
            self._cond.notify_all()
            return total

    def delete(self, key: str) -> bool:
        with self._cond:
            return self._data.pop(key, None) is not None

    def wait_count(self, key: str, target: int, timeout: float | None = None) -> bool:
        _counter(target, "target")
        with self._cond:
            return self._wait(lambda: key in self._data and _INT.unpack(self._data[key])[0] >= target, timeout)

    def close(self) -> None:
        """Nothing to release."""


def _forever(timeout):
    """A group's timeout for the store: commkit's timeouts may be ``inf`` where the store's say None."""
    return None if timeout == math.inf else timeout


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

    Values are pickled here, on the client side, and unpickled only as they
    come from ``store``: a :class:`StoreClient`, whose every reply is
    authenticated as coming from this job's store, or a :class:`MemoryStore`.
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
        value = self.store.get(key, _forever(timeout))
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
        if not self.store.wait_count(key, self.size, _forever(timeout)):
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
        sources = range(self.size) if source == ANY_SOURCE else (source,)
        # Polls of every sender's mailbox (ANY_SOURCE) are round trips to the server: sleep
        # longer between them than a wait for local messages would.
        backoff = Backoff(timeout, spin=0, first=1e-4, most=0.01)
        with self._recv_lock:
            while True:
                found = self._match(source, tag, remove=True)
                if found is not None:
                    src, t, payload = found
                    return pickle.loads(payload), Status(src, t, len(payload))
                if any(self._take(s, 0) for s in sources):
                    continue
                if source == ANY_SOURCE:
                    if not backoff.pause():
                        return None
                    continue
                left = backoff.left()
                if left is not None and left <= 0:
                    return None
                # One sender: let the server wait, in short slices so that the client connection
                # (shared by this rank's threads) is never held for long.
                self._take(source, 0.1 if left is None else min(left, 0.1))

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
