"""The NCCL bootstrap store: real sockets on 127.0.0.1 (ephemeral ports), and the groups built on it.

Every server and client a test opens is closed by a fixture or a ``with``
block. Waits that could hang carry a generous timeout as a safety net only:
no test asserts how long anything took.
"""

from __future__ import annotations

import pickle
import socket
import threading

import pytest
from hypothesis import given, strategies as st

from commkit import ANY_SOURCE, ANY_TAG, CommTimeout, InvalidArgument, PeerFailed, TransportUnavailable
from commkit.transports import _store
from commkit.transports._store import MemoryStore, StoreClient, StoreGroup, StoreServer

SAFETY = 30.0  # seconds: only ever reached if the code under test is broken


@pytest.fixture
def server():
    srv = StoreServer("127.0.0.1", 0)
    try:
        yield srv
    finally:
        srv.close()


@pytest.fixture
def connect(server):
    """Open clients to ``server``; all are closed when the test ends."""
    clients = []

    def make(**kw):
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


def test_token_is_required_when_set():
    with StoreServer("127.0.0.1", 0, token="s3cret") as srv:
        good = StoreClient("127.0.0.1", srv.port, token="s3cret", connect_timeout=SAFETY)
        try:
            good.set("k", b"v")
            assert good.get("k") == b"v"
        finally:
            good.close()
        with pytest.raises(TransportUnavailable, match="refused this rank's token"):
            StoreClient("127.0.0.1", srv.port, token="wrong", connect_timeout=SAFETY)
        anonymous = StoreClient("127.0.0.1", srv.port, connect_timeout=SAFETY)
        try:
            with pytest.raises(TransportUnavailable, match="COMMKIT_STORE_TOKEN"):
                anonymous.get("k", 0)
        finally:
            anonymous.close()


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
    with socket.socket() as s:  # an ephemeral port that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(TransportUnavailable, match=f"127.0.0.1:{port}.*COMMKIT_STORE_PORT"):
        StoreClient("127.0.0.1", port, connect_timeout=0.2)


def test_port_in_use_is_transport_unavailable(server):
    with pytest.raises(TransportUnavailable, match=f"{server.port}.*COMMKIT_STORE_PORT"):
        StoreServer("127.0.0.1", server.port)


def test_wait_for_disconnects(connect, server):
    a, b = connect(), connect()
    a.set("x", b"1")  # both connections are being served
    b.get("x")
    assert server.connections == 2
    a.close()
    b.close()
    assert server.wait_for_disconnects(0, SAFETY)
    assert server.connections == 0


def test_garbage_on_the_port_drops_only_that_connection(connect, server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=SAFETY) as raw:
        raw.sendall(b"\x02" + b"\xff" * 20)  # a key length far beyond the limit
        assert raw.recv(1) == b""  # the server hung up
    c = connect()
    c.set("still", b"serving")
    assert c.get("still") == b"serving"


def test_store_address_from_arguments_and_environment(monkeypatch):
    monkeypatch.delenv("COMMKIT_STORE_HOST", raising=False)
    monkeypatch.delenv("COMMKIT_STORE_PORT", raising=False)
    assert _store.store_address() == ("127.0.0.1", 29517)
    monkeypatch.setenv("COMMKIT_STORE_HOST", "10.1.2.3")
    monkeypatch.setenv("COMMKIT_STORE_PORT", "40000")
    assert _store.store_address() == ("10.1.2.3", 40000)
    assert _store.store_address("localhost", 123) == ("localhost", 123)
    monkeypatch.setenv("COMMKIT_STORE_PORT", "eighty")
    with pytest.raises(InvalidArgument, match="COMMKIT_STORE_PORT"):
        _store.store_address()
    with pytest.raises(InvalidArgument, match="store_port"):
        _store.store_address("127.0.0.1", 70000)


def test_loopback_detection():
    assert _store._is_loopback("127.0.0.1") and _store._is_loopback("::1") and _store._is_loopback("localhost")
    assert not _store._is_loopback("10.0.0.1") and not _store._is_loopback("example.org")


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
        clients = [StoreClient("127.0.0.1", srv.port, connect_timeout=SAFETY) for _ in range(size)]
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
