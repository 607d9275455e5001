"""The NCCL bootstrap store: real sockets on 127.0.0.1 (ephemeral ports), and the groups built on it.

Every server, client, raw socket, thread and process a test opens is closed
by a fixture, a ``with`` block or a ``finally``. Waits that could hang carry
a generous timeout as a safety net only.

The security tests replay the attacks of the review against the store with
raw sockets: a pickle planted without the secret, a process squatting the
port, a huge unauthenticated length header, an infinite timeout. Each fails
on the store as it was before the handshake existed.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
import secrets
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from commkit import ANY_SOURCE, ANY_TAG, CommTimeout, InvalidArgument, PeerFailed, TransportUnavailable
from commkit.transports import _store
from commkit.transports._store import MemoryStore, StoreClient, StoreGroup, StoreServer, connect_rendezvous
from commkit.transports.nccl import _bootstrap

SAFETY = 30.0  # seconds: only ever reached if the code under test is broken
SECRET = "a-test-secret-0123456789abcdef"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def server():
    srv = StoreServer("127.0.0.1", 0)
    try:
        yield srv
    finally:
        srv.close()


@pytest.fixture
def connect(server):
    """Open clients to ``server`` with its secret; all are closed when the test ends."""
    clients = []

    def make(**kw):
        kw.setdefault("token", server.token)
        client = StoreClient("127.0.0.1", server.port, connect_timeout=SAFETY, **kw)
        clients.append(client)
        return client

    try:
        yield make
    finally:
        for client in clients:
            client.close()


def run_ranks(fn, size):
    """Run ``fn(rank)`` on ``size`` threads; return results in rank order, re-raising the first failure."""
    results, errors = [None] * size, [None] * size

    def body(rank):
        try:
            results[rank] = fn(rank)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors[rank] = exc

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(SAFETY * 2)
    assert not any(t.is_alive() for t in threads), "a rank thread did not finish"
    for exc in errors:
        if exc is not None:
            raise exc
    return results


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- what an attacker sends and sees ------------------------------------------------------------------------------

CALLS: list = []  # what unpickling an attacker's payload did: must stay empty


def _record(what):
    CALLS.append(what)
    return what


class _Payload:
    def __reduce__(self):
        return _record, ("attacker code ran",)


EVIL = pickle.dumps(_Payload())


@pytest.fixture(autouse=True)
def _no_attacker_calls():
    CALLS.clear()
    yield
    assert CALLS == [], "a rank unpickled an attacker's data"


def old_request(op: int, key: str, value: bytes = b"", timeout: float = -1.0) -> bytes:
    """A request in the wire format the store had before the handshake (op 1 was set, 2 get)."""
    raw = key.encode()
    return struct.pack("!BIQd", op, len(raw), len(value), timeout) + raw + value


def drain(sock: socket.socket, timeout: float = SAFETY) -> tuple[bytes, bool]:
    """Everything the peer sends until it hangs up: ``(data, hung_up)``; ``hung_up`` False on timeout."""
    sock.settimeout(timeout)
    data = b""
    try:
        while True:
            chunk = sock.recv(1 << 16)
            if not chunk:
                return data, True
            data += chunk
    except ConnectionResetError:
        return data, True
    except socket.timeout:
        return data, False


def recv_exact(sock: socket.socket, n: int) -> bytes:
    sock.settimeout(SAFETY)
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        assert chunk, "the peer hung up early"
        data += chunk
    return data


class Squatter:
    """A process that took the store's port first: records what clients send and answers ``answer``."""

    def __init__(self, answer: bytes):
        self.answer = answer
        self.received: list[bytes] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self.port = self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            with conn:
                got = b""
                try:
                    conn.settimeout(SAFETY)
                    while len(got) < 40:
                        chunk = conn.recv(40 - len(got))
                        if not chunk:
                            break
                        got += chunk
                    conn.sendall(self.answer)
                    rest, _ = drain(conn)
                    got += rest
                except OSError:
                    pass
                self.received.append(got)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(SAFETY)
        self._listener.close()


class Relay:
    """A man in the middle that forwards one connection to the store and flips byte ``corrupt`` of one direction."""

    def __init__(self, target_port: int, *, upstream: int | None = None, downstream: int | None = None):
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._target = target_port
        self._flip = {"up": upstream, "down": downstream}
        self._socks: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._run, daemon=True)]
        self._threads[0].start()

    def _run(self):
        self._listener.settimeout(SAFETY)
        try:
            client, _ = self._listener.accept()
        except OSError:
            return
        store = socket.create_connection(("127.0.0.1", self._target), timeout=SAFETY)
        self._socks += [client, store]
        for src, dst, way in ((client, store, "up"), (store, client, "down")):
            t = threading.Thread(target=self._pump, args=(src, dst, self._flip[way]), daemon=True)
            self._threads.append(t)
            t.start()

    @staticmethod
    def _pump(src, dst, flip):
        seen = 0
        try:
            while True:
                chunk = bytearray(src.recv(1 << 16))
                if not chunk:
                    break
                if flip is not None and seen <= flip < seen + len(chunk):
                    chunk[flip - seen] ^= 0x01
                seen += len(chunk)
                dst.sendall(chunk)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._listener.close()
        for s in self._socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in self._threads:
            t.join(SAFETY)
        for s in self._socks:
            s.close()


HANDSHAKE_UP = len(_store._MAGIC) + _store._NONCE + _store._PROOF          # what a client sends before requests
HANDSHAKE_DOWN = len(_store._MAGIC) + _store._NONCE + _store._PROOF + 1    # what the server sends before replies


# -- the verbs over a socket -----------------------------------------------------------------------------------


def test_set_get_pop_delete(connect):
    c = connect()
    assert c.get("absent", 0) is None
    c.set("k", b"value")
    assert c.get("k") == b"value"
    assert c.get("k", 0) == b"value"  # get leaves the key
    assert c.pop("k", 0) == b"value"
    assert c.pop("k", 0) is None      # pop removed it
    c.set("big", bytes(range(256)) * 4096)
    assert c.get("big") == bytes(range(256)) * 4096
    assert c.delete("big") is True
    assert c.delete("big") is False


def test_counters_and_wait_count(connect):
    a, b = connect(), connect()
    assert a.add("n", 1) == 1
    assert b.add("n", 2) == 3
    assert a.add("n", -5) == -2
    assert a.wait_count("n", -2, 0) is True
    assert a.wait_count("n", 1, 0) is False


def test_get_waits_in_the_server_until_another_client_sets(connect):
    waiter, setter = connect(), connect()
    started = threading.Event()
    got = []

    def wait():
        started.set()
        got.append(waiter.get("late", SAFETY))

    t = threading.Thread(target=wait)
    t.start()
    started.wait(SAFETY)
    setter.set("late", b"here")
    t.join(SAFETY)
    assert got == [b"here"]


def test_wait_count_wakes_when_the_counter_reaches_its_target(connect):
    clients = [connect() for _ in range(3)]

    def arrive(rank):
        clients[rank].add("arrived", 1)
        return clients[rank].wait_count("arrived", 3, SAFETY)

    assert run_ranks(arrive, 3) == [True, True, True]


def test_a_named_secret_is_proved_both_ways():
    with StoreServer("127.0.0.1", 0, token=SECRET) as srv:
        assert srv.token == SECRET
        good = StoreClient("127.0.0.1", srv.port, token=SECRET, connect_timeout=SAFETY)
        try:
            good.set("k", b"v")
            assert good.get("k") == b"v"
        finally:
            good.close()
        # The server sees the close on its own thread: wait for it, so that the count below is the rejected
        # clients' alone (it read 1 once, under load, with nothing wrong but this race).
        assert srv.wait_for_disconnects(0, SAFETY)
        with pytest.raises(TransportUnavailable, match="could not prove.*COMMKIT_STORE_TOKEN"):
            StoreClient("127.0.0.1", srv.port, token=SECRET.upper(), connect_timeout=SAFETY)
        with pytest.raises(InvalidArgument, match="needs the store's secret"):
            StoreClient("127.0.0.1", srv.port, connect_timeout=SAFETY)
        assert srv.connections == 0


def test_every_store_has_a_secret_of_real_length():
    with StoreServer() as a, StoreServer() as b:
        assert len(a.token) == 64 and a.token != b.token  # 256 random bits each
    with pytest.raises(InvalidArgument, match="at least 16 bytes.*got 6"):
        StoreServer("127.0.0.1", 0, token="s3cret")
    with pytest.raises(InvalidArgument, match="str or bytes"):
        StoreServer("127.0.0.1", 0, token=12345678901234567890)


def test_closed_server_gives_peer_failed(connect, server):
    c = connect()
    c.set("k", b"v")
    server.close()
    with pytest.raises(PeerFailed, match="closed the connection"):
        c.get("k", 0)


def test_close_wakes_a_client_waiting_in_the_server(connect, server):
    c = connect()
    started = threading.Event()
    outcome = []

    def wait():
        started.set()
        try:
            outcome.append(c.get("never", None))
        except PeerFailed as exc:
            outcome.append(exc)

    t = threading.Thread(target=wait)
    t.start()
    started.wait(SAFETY)
    server.close()
    t.join(SAFETY)
    assert not t.is_alive() and len(outcome) == 1


def test_no_server_is_transport_unavailable():
    port = free_port()
    with pytest.raises(TransportUnavailable, match=f"127.0.0.1:{port}.*COMMKIT_STORE_PORT"):
        StoreClient("127.0.0.1", port, token=SECRET, connect_timeout=0.2)


def test_port_in_use_is_transport_unavailable(server):
    with pytest.raises(TransportUnavailable, match=f"{server.port}.*COMMKIT_STORE_PORT"):
        StoreServer("127.0.0.1", server.port)


def test_wait_for_disconnects_counts_authenticated_clients_only(connect, server):
    a, b = connect(), connect()
    a.set("x", b"1")  # both connections are being served
    b.get("x")
    with socket.create_connection(("127.0.0.1", server.port), timeout=SAFETY) as stranger:
        stranger.sendall(_store._MAGIC)  # in the handshake: not a client yet, and must not hold rank 0's exit
        assert server.connections == 2
        a.close()
        b.close()
        assert server.wait_for_disconnects(0, SAFETY)
        assert server.connections == 0


def test_garbage_on_the_port_drops_only_that_connection(connect, server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=SAFETY) as raw:
        raw.sendall(b"\x02" + b"\xff" * 20)  # a key length far beyond the limit
        assert drain(raw) == (b"", True)  # the server hung up without a word
    c = connect()
    c.set("still", b"serving")
    assert c.get("still") == b"serving"


def test_store_address_from_arguments_and_environment(monkeypatch):
    monkeypatch.delenv("COMMKIT_STORE_HOST", raising=False)
    monkeypatch.delenv("COMMKIT_STORE_PORT", raising=False)
    assert _store.store_address() == ("127.0.0.1", 0)  # no well-known port: rank 0 picks a free one
    monkeypatch.setenv("COMMKIT_STORE_HOST", "10.1.2.3")
    monkeypatch.setenv("COMMKIT_STORE_PORT", "40000")
    assert _store.store_address() == ("10.1.2.3", 40000)
    assert _store.store_address("localhost", 123) == ("localhost", 123)
    monkeypatch.setenv("COMMKIT_STORE_PORT", "eighty")
    with pytest.raises(InvalidArgument, match="COMMKIT_STORE_PORT"):
        _store.store_address()
    with pytest.raises(InvalidArgument, match="store_port"):
        _store.store_address("127.0.0.1", 70000)


# -- attacks without the secret -------------------------------------------------------------------------------------


def test_a_raw_socket_cannot_plant_a_pickle_for_a_broadcast(connect, server):
    """The review's attack: set the key of the first broadcast to a crafted pickle before rank 0 does."""
    clients = [connect(), connect()]
    with socket.create_connection(("127.0.0.1", server.port), timeout=SAFETY) as raw:
        raw.sendall(old_request(1, "w/b1", EVIL))
        assert drain(raw) == (b"", True)
    assert server._data == {} and clients[1].get("w/b1", 0) is None

    def body(rank):
        return StoreGroup(clients[rank], "w", rank, 2).bcast("from rank 0" if rank == 0 else None, timeout=SAFETY)

    assert run_ranks(body, 2) == ["from rank 0", "from rank 0"]


def test_a_raw_socket_cannot_read_what_the_ranks_stored(connect, server):
    connect().set("w/g1/0", pickle.dumps("rank 0's object"))
    with socket.create_connection(("127.0.0.1", server.port), timeout=SAFETY) as raw:
        raw.sendall(old_request(2, "w/g1/0", timeout=0.0))
        assert drain(raw) == (b"", True)


def test_a_guessed_proof_is_denied_before_any_request_is_read(connect, server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=SAFETY) as raw:
        raw.sendall(_store._MAGIC + secrets.token_bytes(_store._NONCE))
        hello = recv_exact(raw, len(_store._MAGIC) + _store._NONCE + _store._PROOF)
        assert hello.startswith(_store._MAGIC)
        # A guessed proof, then a request in the new format with a guessed tag.
        head = struct.pack("!BIQd", _store._SET, 4, len(EVIL), -1.0)
        raw.sendall(secrets.token_bytes(_store._PROOF) + head + b"w/b1" + EVIL + bytes(_store._PROOF))
        assert drain(raw) == (bytes([_store._DENIED]), True)
    assert server._data == {} and connect().get("w/b1", 0) is None


@pytest.mark.parametrize("prefix", ["none", "handshake"])
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmRSS from /proc/self/status")
def test_an_unauthenticated_huge_length_header_is_not_read(connect, server, prefix):
    """A 512 MiB request without the secret: the server hangs up after the handshake bytes, allocating nothing."""
    def rss() -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS line")

    peak, stop = [rss()], threading.Event()

    def sample():
        while not stop.is_set():
            peak.append(rss())
            stop.wait(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    huge = 512 << 20
    chunk = bytes(1 << 20)
    sent = 0
    base = rss()
    sampler.start()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=SAFETY) as raw:
            if prefix == "handshake":
                raw.sendall(_store._MAGIC + secrets.token_bytes(_store._NONCE))
            raw.sendall(old_request(1, "k") + struct.pack("!BIQd", _store._SET, 1, huge, -1.0) + b"k")
            try:
                while sent < huge:
                    raw.sendall(chunk)
                    sent += len(chunk)
            except (BrokenPipeError, ConnectionResetError):
                pass
            _, hung_up = drain(raw, timeout=_store._HANDSHAKE_TIMEOUT / 2)  # sooner than any handshake deadline
            assert hung_up
    finally:
        stop.set()
        sampler.join(SAFETY)
    assert sent < 64 << 20, f"the server read {sent >> 20} MiB of an unauthenticated body"
    assert max(peak) - base < 64 << 20, f"RSS grew by {(max(peak) - base) >> 20} MiB"
    c = connect()
    c.set("still", b"serving")
    assert c.get("still", 0) == b"serving"


def test_handshakes_in_progress_are_capped(connect, server):
    held = []
    try:
        for _ in range(_store._MAX_PENDING):
            held.append(socket.create_connection(("127.0.0.1", server.port), timeout=SAFETY))
        deadline = time.monotonic() + SAFETY
        while server._pending < _store._MAX_PENDING and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server._pending == _store._MAX_PENDING
        with socket.create_connection(("127.0.0.1", server.port), timeout=SAFETY) as extra:
            assert drain(extra) == (b"", True)  # closed at once, not queued behind the others
    finally:
        for s in held:
            s.close()
    c = connect()  # the slots free again as the held connections close
    c.set("k", b"v")
    assert c.get("k", 0) == b"v"


# -- a process squatting the port ---------------------------------------------------------------------------------


@pytest.mark.parametrize("answer", ["old-store-reply", "forged-proof"])
def test_a_squatter_learns_nothing_and_the_client_refuses_it(answer):
    if answer == "old-store-reply":  # what the store used to answer: status OK and a pickle
        reply, match = struct.pack("!BQ", 0, len(EVIL)) + EVIL, "is not a commkit store"
    else:
        reply = _store._MAGIC + secrets.token_bytes(_store._NONCE) + secrets.token_bytes(_store._PROOF) + b"\x00"
        match = "could not prove.*trusted it with nothing"
    with Squatter(reply) as squatter:
        for _ in range(2):
            with pytest.raises(TransportUnavailable, match=match):
                StoreClient("127.0.0.1", squatter.port, token=SECRET, connect_timeout=SAFETY)
    assert len(squatter.received) == 2
    for got in squatter.received:
        # All it got: the magic and a fresh random nonce. No secret, no hash of it, no proof.
        assert len(got) == len(_store._MAGIC) + _store._NONCE and got.startswith(_store._MAGIC)
        assert SECRET.encode() not in got and hashlib.sha256(SECRET.encode()).digest() not in got
    assert squatter.received[0] != squatter.received[1]


def test_the_bootstrap_refuses_a_squatter_on_the_named_port():
    forged = _store._MAGIC + secrets.token_bytes(_store._NONCE + _store._PROOF)
    with Squatter(forged) as squatter:
        options = dict(bootstrap="store", size=2, store_port=squatter.port, store_token=SECRET,
                       connect_timeout=SAFETY)
        with pytest.raises(TransportUnavailable, match="could not prove"):
            _bootstrap(dict(options, rank=1))
        with pytest.raises(TransportUnavailable, match=f"cannot listen on 127.0.0.1:{squatter.port}"):
            _bootstrap(dict(options, rank=0))
    assert [len(got) for got in squatter.received] == [len(_store._MAGIC) + _store._NONCE]


@pytest.mark.parametrize("direction", ["request", "reply"])
def test_a_relay_cannot_change_a_value_in_flight(connect, server, direction):
    if direction == "request":  # flip the first byte of the value of the first request
        relay_args, match = {"upstream": HANDSHAKE_UP + _store._REQUEST.size + len("k")}, "closed the connection"
    else:  # flip the status byte of the first reply
        relay_args, match = {"downstream": HANDSHAKE_DOWN}, "failed its integrity check"
    with Relay(server.port, **relay_args) as relay:
        victim = StoreClient("127.0.0.1", relay.port, token=server.token, connect_timeout=SAFETY)
        try:
            with pytest.raises(PeerFailed, match=match):
                victim.set("k", EVIL)
            with pytest.raises(PeerFailed):
                victim.get("k", 0)  # the connection is not used again
        finally:
            victim.close()
    stored = connect().get("k", 0)
    assert stored in (None, EVIL)  # the server stored only what the client sent, or nothing
    if direction == "request":
        assert stored is None


# -- timeouts and bad requests ------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [math.inf, math.nan, -1.0, -math.inf, 1e400, "1", True])
def test_bad_timeouts_are_refused_on_the_client(connect, bad):
    c = connect()
    for call in (lambda: c.get("k", bad), lambda: c.pop("k", bad), lambda: c.wait_count("k", 1, bad)):
        with pytest.raises(InvalidArgument, match="timeout must be None .wait forever. or a"):
            call()
    c.set("k", b"v")
    assert c.get("k", 0) == b"v"


@pytest.mark.parametrize("bad", [math.inf, math.nan, -1.0])
def test_bad_timeouts_are_refused_in_memory_too(bad):
    m = MemoryStore()
    with pytest.raises(InvalidArgument, match="timeout must be None"):
        m.get("k", bad)
    with pytest.raises(InvalidArgument, match="timeout must be None"):
        m.wait_count("k", 1, bad)


def test_bad_connect_timeouts_are_refused():
    for bad in (math.inf, math.nan, -1.0):
        with pytest.raises(InvalidArgument, match="connect_timeout"):
            StoreClient("127.0.0.1", 1, token=SECRET, connect_timeout=bad)
        with pytest.raises(InvalidArgument, match="connect_timeout"):
            _bootstrap(dict(bootstrap="store", rank=1, size=2, connect_timeout=bad))


@pytest.mark.parametrize("op, value, timeout, match", [
    (_store._GET, b"", math.inf, "timeout must be finite"),      # the review's inf: killed the thread before
    (_store._GET, b"", math.nan, "timeout must be finite"),
    (_store._POP, b"", 1e300, None),                             # huge but finite: waits in slices, key present
    (_store._WAIT_COUNT, struct.pack("!q", 1), math.inf, "timeout must be finite"),
    (_store._WAIT_COUNT, b"\x01", 0.0, "counter operand must be 8 bytes"),
    (_store._ADD, b"", -1.0, "counter operand must be 8 bytes"),
    (_store._ADD, struct.pack("!q", 1), -1.0, "not a counter"),
    (0, b"", -1.0, "operation code"),
    (255, b"", -1.0, "operation code"),
])
def test_bad_request_fields_get_an_error_reply_and_the_connection_survives(connect, server, op, value, timeout,
                                                                            match):
    c = connect()
    c.set("k", b"not a counter")
    if match is None:
        assert c._request(op, "k", value, timeout) == (_store._OK, b"not a counter")
    else:
        with pytest.raises(InvalidArgument, match=f"refused a request: .*{match}"):
            c._request(op, "k", value, timeout)
    c.set("after", b"still served")  # on the same connection: its server thread is alive
    assert c.get("after", 0) == b"still served"
    assert server.connections == 1


def test_counter_overflow_is_an_error_not_a_dropped_connection(connect):
    c = connect()
    c.add("n", 2**63 - 1)
    with pytest.raises(InvalidArgument, match="signed 64-bit"):
        c.add("n", 1)
    with pytest.raises(InvalidArgument, match="signed 64-bit"):
        c.add("n", 2**63)
    assert c.add("n", 0) == 2**63 - 1
    m = MemoryStore()
    m.add("n", 2**63 - 1)
    with pytest.raises(InvalidArgument, match="signed 64-bit"):
        m.add("n", 1)


def test_oversized_keys_and_values_are_refused_before_sending(connect):
    c = connect()
    with pytest.raises(InvalidArgument, match="at most 65536 bytes"):
        c.set("k" * (_store._MAX_KEY + 1), b"")

    class Huge(bytes):
        def __len__(self):
            return _store._MAX_VALUE + 1

    with pytest.raises(InvalidArgument, match="at most 1073741824 bytes"):
        c.set("k", Huge())
    c.set("k", b"v")
    assert c.get("k", 0) == b"v"


# -- the rendezvous file ------------------------------------------------------------------------------------------


def test_the_rendezvous_file_is_private_and_gone_once_every_rank_connected(tmp_path):
    path = tmp_path / "store.json"
    with StoreServer() as srv:
        srv.publish(str(path), ranks=2)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        record = json.loads(path.read_text())
        assert (record["host"], record["port"], record["size"]) == ("127.0.0.1", srv.port, 2)
        assert bytes.fromhex(record["secret"]) == srv.token.encode()
        assert [p.name for p in tmp_path.iterdir()] == ["store.json"]  # no temporary file left behind
        first = StoreClient("127.0.0.1", srv.port, token=srv.token, connect_timeout=SAFETY)
        try:
            assert path.exists()
            second = connect_rendezvous(str(path), size=2, connect_timeout=SAFETY)
            try:
                assert not path.exists()  # both ranks hold the secret: it leaves the disk
                second.set("k", b"v")
                assert first.get("k", 0) == b"v"
            finally:
                second.close()
        finally:
            first.close()


def test_closing_the_server_removes_its_rendezvous_file_only(tmp_path):
    path = tmp_path / "store.json"
    with StoreServer() as srv:
        srv.publish(str(path))
    assert not path.exists()
    first, second = StoreServer(), StoreServer()
    try:
        first.publish(str(path))
        second.publish(str(path))  # replaced since: no longer first's to delete
        first.close()
        assert json.loads(path.read_text())["port"] == second.port
    finally:
        first.close()
        second.close()
    assert not path.exists()


def test_a_stale_file_is_waited_past_until_rank_0_replaces_it(tmp_path):
    path = tmp_path / "store.json"
    stale = {"host": "127.0.0.1", "port": free_port(), "secret": secrets.token_hex(32), "size": 2, "pid": 1}
    other_job = dict(stale, size=5)
    for record in (stale, other_job):
        path.write_text(json.dumps(record))
        path.chmod(0o600)
        with pytest.raises(TransportUnavailable, match="store.json within 0.3 s"):
            connect_rendezvous(str(path), size=2, connect_timeout=0.3)
    got = []
    waiter = threading.Thread(target=lambda: got.append(connect_rendezvous(str(path), size=2, connect_timeout=SAFETY)))
    with StoreServer() as srv:
        waiter.start()
        srv.publish(str(path), ranks=2)
        waiter.join(SAFETY)
        assert len(got) == 1
        try:
            got[0].set("k", b"v")
            assert srv._data == {"k": b"v"}
        finally:
            got[0].close()


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX permissions")
def test_a_rendezvous_file_open_to_others_or_a_link_is_refused(tmp_path):
    path = tmp_path / "store.json"
    record = {"host": "127.0.0.1", "port": 1, "secret": secrets.token_hex(32), "size": None}
    path.write_text(json.dumps(record))
    path.chmod(0o644)
    with pytest.raises(TransportUnavailable, match="mode 0600.*0644"):
        connect_rendezvous(str(path), connect_timeout=SAFETY)
    path.chmod(0o600)
    link = tmp_path / "link.json"
    link.symlink_to(path)
    with pytest.raises(TransportUnavailable, match="symbolic link"):
        connect_rendezvous(str(link), connect_timeout=SAFETY)
    path.write_text("{not json")
    with pytest.raises(TransportUnavailable, match="does not hold"):
        connect_rendezvous(str(path), connect_timeout=SAFETY)


def test_no_rendezvous_file_names_what_to_check(tmp_path):
    with pytest.raises(TransportUnavailable, match="never appeared.*COMMKIT_STORE_FILE"):
        connect_rendezvous(str(tmp_path / "absent.json"), connect_timeout=0.2)


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX permissions")
def test_the_default_directory_must_be_private(tmp_path, monkeypatch):
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    path = _store.rendezvous_path()
    assert path == str(tmp_path / f"commkit-{os.getuid()}" / f"store-ppid{os.getppid()}.json")
    assert _store.rendezvous_path(4242).endswith("store-port4242.json")
    with StoreServer() as srv:
        srv.publish(path)
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    os.chmod(os.path.dirname(path), 0o755)  # as another user could have made it before us
    with StoreServer() as srv:
        with pytest.raises(TransportUnavailable, match="mode 0700.*0755"):
            srv.publish(path)


WORKER = """
import json, sys
from commkit.transports.nccl import _bootstrap
group, store, server = _bootstrap({"bootstrap": "store", "connect_timeout": 60})
got = group.allgather(group.rank * 10, timeout=60)
obj = group.bcast({"uid": "from rank 0"} if group.rank == 0 else None, timeout=60)
group.barrier(60)
store.close()
if server is not None:
    assert server.wait_for_disconnects(0, 60)
    server.close()
print(json.dumps({"rank": group.rank, "got": got, "obj": obj}))
"""


@pytest.mark.parametrize("how", ["default-file", "named-file", "named-port", "named-port-and-secret"])
def test_ranks_in_processes_bootstrap_through_the_store(tmp_path, how):
    """Three processes, the others started before rank 0; the rendezvous leaves no file behind."""
    size = 3
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMMKIT_") and k != "XDG_RUNTIME_DIR"}
    env.update(PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), TMPDIR=str(tmp_path),
               COMMKIT_NCCL_BOOTSTRAP="store", COMMKIT_SIZE=str(size))
    if how == "named-file":
        (tmp_path / "job").mkdir()
        env["COMMKIT_STORE_FILE"] = str(tmp_path / "job" / "store.json")
    if how.startswith("named-port"):
        env["COMMKIT_STORE_PORT"] = str(free_port())
    if how == "named-port-and-secret":
        env["COMMKIT_STORE_TOKEN"] = secrets.token_hex(16)
    procs = []
    try:
        for rank in (1, 2, 0):
            procs.append(subprocess.Popen([sys.executable, "-c", WORKER], env=dict(env, COMMKIT_RANK=str(rank)),
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        outputs = [proc.communicate(timeout=SAFETY * 4) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert all(proc.returncode == 0 for proc in procs), "\n".join(err for _, err in outputs)
    results = sorted((json.loads(out) for out, _ in outputs), key=lambda r: r["rank"])
    assert results == [{"rank": r, "got": [0, 10, 20], "obj": {"uid": "from rank 0"}} for r in range(size)]
    left = [str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()]
    assert left == []  # the rendezvous file was deleted once every rank had connected


# -- groups: the same contract over a socket and in memory -------------------------------------------------------


@pytest.fixture(params=["socket", "memory"])
def group_stores(request):
    """``make(size)`` returns one store per rank (separate clients, or one shared MemoryStore)."""
    opened, servers = [], []

    def make(size):
        if request.param == "memory":
            shared = MemoryStore()
            return [shared] * size
        srv = StoreServer("127.0.0.1", 0)
        servers.append(srv)
        clients = [StoreClient("127.0.0.1", srv.port, token=srv.token, connect_timeout=SAFETY) for _ in range(size)]
        opened.extend(clients)
        return clients

    try:
        yield make
    finally:
        for c in opened:
            c.close()
        for s in servers:
            s.close()


def _leftovers(store):
    data = store._data if isinstance(store, MemoryStore) else None
    return sorted(data) if data is not None else None


def test_group_collectives_and_cleanup(group_stores):
    size = 4
    stores = group_stores(size)

    def body(rank):
        g = StoreGroup(stores[rank], "w", rank, size)
        out = {"bcast": g.bcast({"root": rank} if rank == 2 else None, root=2, timeout=SAFETY),
               "gather": g.allgather(rank * rank, timeout=SAFETY)}
        g.barrier(SAFETY)
        out["again"] = g.allgather(f"r{rank}", timeout=SAFETY)
        g.barrier(SAFETY)
        return out

    results = run_ranks(body, size)
    for out in results:
        assert out == {"bcast": {"root": 2}, "gather": [0, 1, 4, 9], "again": ["r0", "r1", "r2", "r3"]}
    if isinstance(stores[0], MemoryStore):
        assert _leftovers(stores[0]) == []  # the last rank out of each collective deleted its keys


def test_group_messages_follow_mpi_matching(group_stores):
    size = 3
    stores = group_stores(size)

    def body(rank):
        g = StoreGroup(stores[rank], "w", rank, size)
        if rank != 0:
            for i in range(3):
                g.send_object({"from": rank, "i": i}, 0, tag=10 + i)
            return None
        # Tags out of order from one sender: the message with tag 12 is found past 10 and 11.
        obj, status = g.recv_object(1, 12, SAFETY)
        assert obj == {"from": 1, "i": 2} and status.source == 1 and status.tag == 12
        assert status.nbytes == len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        # ANY_TAG keeps the sender's order among what is left.
        assert g.recv_object(1, ANY_TAG, SAFETY)[0] == {"from": 1, "i": 0}
        assert g.recv_object(1, ANY_TAG, SAFETY)[0] == {"from": 1, "i": 1}
        # ANY_SOURCE with a tag: rank 2's three messages, in their order.
        seen = [g.recv_object(ANY_SOURCE, ANY_TAG, SAFETY) for _ in range(3)]
        assert [(s.source, o["i"]) for o, s in seen] == [(2, 0), (2, 1), (2, 2)]
        assert g.recv_object(ANY_SOURCE, ANY_TAG, 0.05) is None  # nothing left: a timeout, not a hang
        return None

    run_ranks(body, size)


def test_group_probe_sees_without_receiving(group_stores):
    stores = group_stores(2)
    g0, g1 = StoreGroup(stores[0], "w", 0, 2), StoreGroup(stores[1], "w", 1, 2)
    assert g1.probe(0, ANY_TAG) is None
    g0.send_object("hello", 1, tag=7)
    g0.send_object("world", 1, tag=8)
    status = g1.probe(ANY_SOURCE, 8)
    assert (status.source, status.tag) == (0, 8)
    assert g1.recv_object(0, 8, SAFETY)[0] == "world"
    assert g1.recv_object(0, 7, SAFETY)[0] == "hello"
    assert g1.probe(0, ANY_TAG) is None


def test_dup_and_split_keep_contexts_apart(group_stores):
    size = 5
    stores = group_stores(size)

    def body(rank):
        world = StoreGroup(stores[rank], "w", rank, size)
        dup = world.dup()
        # The same (source, tag) on the world and on its dup never meet.
        world.send_object(("world", rank), (rank + 1) % size, tag=1)
        dup.send_object(("dup", rank), (rank + 1) % size, tag=1)
        left = (rank - 1) % size
        got_dup = dup.recv_object(left, 1, SAFETY)[0]
        got_world = world.recv_object(left, 1, SAFETY)[0]
        # Odd and even ranks in two groups, ordered by descending key; rank 4 stays out.
        color = None if rank == 4 else rank % 2
        sub = world.split(color, key=-rank, timeout=SAFETY)
        members = None if sub is None else sub.allgather(rank, timeout=SAFETY)
        return got_world, got_dup, None if sub is None else (sub.rank, sub.size), members

    results = run_ranks(body, size)
    for rank, (got_world, got_dup, where, members) in enumerate(results):
        left = (rank - 1) % size
        assert got_world == ("world", left) and got_dup == ("dup", left)
        if rank == 4:
            assert where is None and members is None
        else:
            expect = [3, 1] if rank % 2 else [2, 0]
            assert members == expect and where == (expect.index(rank), 2)


def test_group_timeouts_raise_comm_timeout():
    store = MemoryStore()
    g = StoreGroup(store, "w", 1, 2)
    with pytest.raises(CommTimeout, match="broadcast"):
        g.bcast(None, root=0, timeout=0.01)
    with pytest.raises(CommTimeout, match="barrier"):
        StoreGroup(store, "w2", 0, 2).barrier(0.01)


def test_a_group_takes_an_infinite_timeout_as_forever(group_stores):
    """commkit's own timeouts may be inf; the group turns that into the store's None instead of an error."""
    stores = group_stores(2)

    def body(rank):
        g = StoreGroup(stores[rank], "w", rank, 2)
        got = g.bcast("x" if rank == 0 else None, timeout=math.inf)
        g.barrier(math.inf)
        return got

    assert run_ranks(body, 2) == ["x", "x"]


def test_abort_signal_reaches_every_group_of_the_store(group_stores):
    stores = group_stores(2)
    a, b = StoreGroup(stores[0], "w", 0, 2), StoreGroup(stores[1], "w.d1", 1, 2)
    assert b.aborted() is None
    a.signal_abort("rank 0 failed")
    assert b.aborted() == "rank 0 failed"


@given(messages=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 3), st.integers()), max_size=30),
       order=st.randoms(use_true_random=False))
def test_per_sender_and_tag_order_is_kept(messages, order):
    """Whatever order the receiver asks for tags in, each (sender, tag) stream arrives in sending order."""
    store = MemoryStore()
    groups = [StoreGroup(store, "w", r, 4) for r in range(4)]
    for src, tag, value in messages:
        groups[src].send_object(value, 3, tag)
    wanted = [(src, tag) for src, tag, _ in messages]
    order.shuffle(wanted)
    got = {}
    for src, tag in wanted:
        obj, status = groups[3].recv_object(src, tag, 1.0)
        assert (status.source, status.tag) == (src, tag)
        got.setdefault((src, tag), []).append(obj)
    expect = {}
    for src, tag, value in messages:
        expect.setdefault((src, tag), []).append(value)
    assert got == expect
    assert store._data == {}


# -- properties: what a stranger sends never lands, what a client sends never kills the server -------------------------


@pytest.fixture(scope="module")
def shared_server():
    srv = StoreServer("127.0.0.1", 0)
    client = StoreClient("127.0.0.1", srv.port, token=srv.token, connect_timeout=SAFETY)
    try:
        yield srv, client
    finally:
        client.close()
        srv.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prefix=st.sampled_from([b"", _store._MAGIC, _store._MAGIC + bytes(_store._NONCE)]), data=st.binary(max_size=200))
def test_nothing_a_stranger_sends_is_stored_or_stops_the_server(shared_server, prefix, data):
    srv, client = shared_server
    with socket.create_connection(("127.0.0.1", srv.port), timeout=SAFETY) as raw:
        try:
            raw.sendall(prefix + data)
            raw.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the server may have hung up already
        got, hung_up = drain(raw)
    assert hung_up
    assert got in (b"", ) or got[len(_store._MAGIC) + _store._NONCE + _store._PROOF:] in (b"", bytes([_store._DENIED]))
    assert srv._data == {}
    client.set("alive", b"yes")
    assert client.pop("alive", 0) == b"yes"


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(op=st.integers(0, 255), key=st.text(max_size=8), value=st.binary(max_size=16),
       timeout=st.floats(allow_nan=True, allow_infinity=True))
def test_no_authenticated_request_ends_its_connection(shared_server, op, key, value, timeout):
    """Whatever fields a client sends: a reply or an InvalidArgument, and the connection keeps working."""
    srv, client = shared_server
    try:
        client.set(key, struct.pack("!q", 2**63 - 1))  # present and at its maximum: no request waits
    except InvalidArgument:
        return  # a key that is not UTF-8: refused on the client
    try:
        client._request(op, key, value, timeout)
    except InvalidArgument:
        pass
    client.set("alive", b"yes")
    assert client.pop("alive", 0) == b"yes"
    client.delete(key)
    assert srv.connections == 1
