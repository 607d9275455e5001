"""The tracer: what it records on every transport, how messages match, and the exports."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

import commkit as ck
from commkit import sim
from commkit.schedule import CallInfo, partition
from commkit.tracing import (
    EVENT_KEYS,
    Tracer,
    calls,
    events_of,
    load,
    messages,
    save,
    select,
    summary,
    to_chrome,
)

rng = np.random.default_rng()


def _traced_local(p, body):
    with ck.trace() as t:
        results = ck.run_local(body, p)
    return t, results


def _ring(n):
    def body(comm):
        return comm.allreduce(rng.standard_normal(n), algorithm="ring")
    return body


# -- recording -----------------------------------------------------------------------------------


@pytest.mark.parametrize("p", [2, 3, 5])
def test_ring_allreduce_events_match_the_schedule(p):
    n = 10 * p + 3  # uneven blocks
    t, _ = _traced_local(p, _ring(n))
    assert t.ranks() == list(range(p))
    for e in t.events:
        local = e["kind"] in ("reduce", "copy")
        assert set(e) == set(EVENT_KEYS) | {"send_ranges", "recv_ranges"} | ({"range", "src_range"} if local else set())
        assert e["collective"] == "allreduce" and e["algorithm"] == "ring"
        assert e["end"] >= e["start"]
    blocks = [hi - lo for lo, hi in partition(n, p)]
    for r in range(p):
        mine = sorted((e for e in t.events if e["rank"] == r), key=lambda e: e["step"])
        assert [e["step"] for e in mine] == list(range(len(mine)))
        sends = [s for e in mine for s in e["sends"]]
        # 2(p-1) messages per rank, all to the right neighbour, each one block of float64.
        assert len(sends) == 2 * (p - 1)
        assert {peer for peer, _ in sends} == {(r + 1) % p}
        assert all(nbytes in {8 * b for b in blocks} for _, nbytes in sends)
        assert {peer for e in mine for peer, _ in e["recvs"]} == {(r - 1) % p}
        assert Counter(e["kind"] for e in mine) == {"exchange": 2 * (p - 1), "reduce": p - 1}
        for e in mine:
            assert e["bytes"] == sum(b for _, b in e["sends"]) + sum(b for _, b in e["recvs"]) or e["kind"] == "reduce"


def test_nothing_is_recorded_outside_the_block_or_for_point_to_point():
    with ck.trace() as t:
        pass
    assert t.events == [] and len(t) == 0
    ck.run_local(_ring(8), 2)
    assert t.events == []

    def p2p(comm):
        if comm.rank == 0:
            comm.send(np.arange(3.0), 1)
        else:
            comm.recv(0, out=np.empty(3))

    with ck.trace() as t2:
        ck.run_local(p2p, 2)
    assert t2.events == []


def test_every_collective_call_is_a_separate_call_with_increasing_seq():
    def body(comm):
        x = rng.standard_normal(6)
        comm.allreduce(x, algorithm="recursive_doubling")
        comm.broadcast(x, algorithm="binomial")
        comm.barrier()
        comm.iallreduce(x, algorithm="ring").wait()
    t, _ = _traced_local(4, body)
    found = t.calls()
    assert [(c.collective, c.algorithm) for c in found] == [
        ("allreduce", "recursive_doubling"), ("broadcast", "binomial"), ("barrier", "dissemination"),
        ("allreduce", "ring")]
    assert [c.seq for c in found] == sorted(c.seq for c in found)
    assert all(c.ranks == (0, 1, 2, 3) for c in found)
    assert found[1].messages == 3  # a binomial tree on 4 ranks has 3 edges
    assert found[2].bytes_sent == 0 and found[2].messages == 4 * 2  # dissemination: log2(4) rounds, empty
    text = summary(t)
    for name in ("allreduce_recursive_doubling", "broadcast_binomial", "barrier_dissemination", "allreduce_ring"):
        assert name in text


def test_trace_comm_inside_run_local_gathers_every_rank_to_root():
    p, root = 4, 2

    def body(comm):
        with ck.trace(comm, root=root) as t:
            comm.allreduce(rng.standard_normal(9), algorithm="ring")
        return t.events

    # Repeated: ranks leave their blocks in a different order each time, while others'
    # steps are still being recorded (a race once lost events here).
    steps = 3 * (p - 1)  # ring allreduce: 2(p-1) exchanges and p-1 reductions per rank
    for _ in range(30):
        per_rank = ck.run_local(body, p)
        assert sorted(e["rank"] for e in per_rank[root]) == sorted(list(range(p)) * steps)
        for r in range(p):
            if r != root:
                assert [e["rank"] for e in per_rank[r]] == [r] * steps
        # Root holds exactly the union of what every rank recorded.
        mine = sorted((e["rank"], e["step"]) for r in range(p) if r != root for e in per_rank[r])
        theirs = sorted((e["rank"], e["step"]) for e in per_rank[root] if e["rank"] != root)
        assert mine == theirs
        assert len(messages(per_rank[root], strict=True)) == 2 * (p - 1) * p


def test_trace_rejects_a_bad_root_and_a_non_communicator():
    comm = ck.init("local")
    with pytest.raises(ck.InvalidArgument, match="root"):
        ck.trace(comm, root=1)
    with pytest.raises(ck.InvalidArgument, match="Communicator"):
        ck.trace(object())


def test_trace_accepts_the_communicator_inside_a_distributed_group():
    from commkit import distributed as dist

    def body(comm):
        dist.init_process_group("local", comm=comm)
        try:
            group = dist.new_group()
            x = rng.standard_normal(7)
            with ck.trace(group) as t:
                dist.all_reduce(x, group=group)
            return t.events
        finally:
            dist.destroy_process_group()

    per_rank = ck.run_local(body, 3)
    assert {e["rank"] for e in per_rank[0]} == {0, 1, 2}
    assert {e["collective"] for e in per_rank[0]} == {"allreduce"}
    assert {e["rank"] for e in per_rank[2]} == {2}


def test_record_native_adds_one_event_per_call():
    t = Tracer()
    t.record_native(CallInfo("allreduce", "native", 7, 3), 1.0, 1.5, 4096)
    (e,) = t.events
    assert e["kind"] == "native" and e["rank"] == 3 and e["seq"] == 7 and e["bytes"] == 4096
    assert set(e) == set(EVENT_KEYS) | {"send_ranges", "recv_ranges"}
    assert e["send_ranges"] == e["recv_ranges"] == []
    assert messages(t) == []


def test_events_carry_the_buffer_ranges_each_step_touches():
    # Ring allreduce, as in commkit/algorithms/ring.py: in step k of the reduce-scatter rank r sends
    # block (r - k) % p (from "in" at k = 0, from "out" after) and receives block (r - k - 1) % p into
    # "tmp", then reduces it into "out"; in the allgather it passes the finished blocks on in "out".
    p, n = 4, 10 * 4 + 3
    blocks = partition(n, p)
    t, _ = _traced_local(p, _ring(n))
    for r in range(p):
        mine = sorted((e for e in t.events if e["rank"] == r), key=lambda e: e["step"])
        transfers = [e for e in mine if e["kind"] == "exchange"]
        reduces = [e for e in mine if e["kind"] == "reduce"]
        assert len(transfers) == 2 * (p - 1) and len(reduces) == p - 1
        for e in transfers:
            assert len(e["send_ranges"]) == len(e["sends"]) == 1 and len(e["recv_ranges"]) == len(e["recvs"]) == 1
            (_, lo, hi), (peer, nbytes) = e["send_ranges"][0], e["sends"][0]
            assert nbytes == (hi - lo) * 8 and peer == (r + 1) % p
        for k in range(p - 1):
            send, recv = blocks[(r - k) % p], blocks[(r - k - 1) % p]
            assert transfers[k]["send_ranges"] == [["in" if k == 0 else "out", *send]]
            assert transfers[k]["recv_ranges"] == [["tmp", 0, recv[1] - recv[0]]]
            assert reduces[k]["range"] == ["out", *recv]
            assert reduces[k]["src_range"] == ["tmp", 0, recv[1] - recv[0]]
            assert "range" not in transfers[k]
        for k in range(p - 1):
            e = transfers[p - 1 + k]
            assert e["send_ranges"] == [["out", *blocks[(r - k + 1) % p]]]
            assert e["recv_ranges"] == [["out", *blocks[(r - k) % p]]]
    # Matched messages carry both ends' ranges, and the two ends have the same length.
    for m in t.messages(strict=True):
        assert m.send_range[0] in ("in", "out") and m.recv_range[0] in ("tmp", "out")
        assert m.send_range[2] - m.send_range[1] == m.recv_range[2] - m.recv_range[1] == m.nbytes // 8


def test_copy_events_name_destination_and_source():
    def body(comm):
        comm.allreduce(rng.standard_normal(6), algorithm="ring")
    t, _ = _traced_local(1, body)  # one rank: the ring copies its input to its output
    (e,) = t.events
    assert e["kind"] == "copy" and e["range"] == ["out", 0, 6] and e["src_range"] == ["in", 0, 6]
    assert e["send_ranges"] == e["recv_ranges"] == []


def test_chrome_trace_steps_carry_their_ranges():
    res = sim.simulate("allreduce", "ring", 3, 96, events=True)
    steps = [ev for ev in to_chrome(res)["traceEvents"] if ev["ph"] == "X" and ev.get("cat") in ("exchange", "reduce")]
    assert steps and all(ev["args"]["send_ranges"] and ev["args"]["recv_ranges"] for ev in steps
                         if ev["cat"] == "exchange")
    assert all(ev["args"]["range"][0] == "out" for ev in steps if ev["cat"] == "reduce")


def test_events_without_ranges_still_load_and_match(tmp_path):
    # A trace saved before the ranges existed: every helper still works, messages have no ranges.
    res = sim.simulate("allreduce", "ring", 3, 96, events=True)
    old = [{k: e[k] for k in EVENT_KEYS} for e in res.events]
    save(old, tmp_path / "old.json")
    back = load(tmp_path / "old.json")
    msgs = messages(back, strict=True)
    assert len(msgs) == sum(res.messages)
    assert all(m.send_range is None and m.recv_range is None for m in msgs)


# -- messages --------------------------------------------------------------------------------------


def test_messages_match_sends_to_receives_in_order():
    p = 5

    def body(comm):
        comm.alltoall(rng.standard_normal((p, 3)), algorithm="pairwise")
        comm.gather(rng.standard_normal(2), root=1, algorithm="naive")
    t, _ = _traced_local(p, body)
    msgs = t.messages(strict=True)
    assert len(msgs) == sum(len(e["sends"]) for e in t.events)
    assert len(msgs) == sum(len(e["recvs"]) for e in t.events)
    for m in msgs:
        assert [m.dst, m.nbytes] in m.send["sends"] and [m.src, m.nbytes] in m.recv["recvs"]
        assert m.send["rank"] == m.src and m.recv["rank"] == m.dst
        assert m.send["seq"] == m.recv["seq"] == m.seq
    alltoall = [m for m in msgs if m.collective == "alltoall"]
    assert Counter((m.src, m.dst) for m in alltoall) == {(a, b): 1 for a in range(p) for b in range(p) if a != b}
    gather = [m for m in msgs if m.collective == "gather"]
    assert sorted(m.src for m in gather) == [0, 2, 3, 4] and {m.dst for m in gather} == {1}


def test_messages_between_one_pair_match_in_posting_order():
    # On 2 ranks the ring's two ranks exchange twice: the i-th send must meet the i-th receive.
    res = sim.simulate("allreduce", "ring", 2, 64, itemsize=8, events=True)
    msgs = messages(res, strict=True)
    pairs = [(m.src, m.dst, m.send["step"], m.recv["step"]) for m in msgs]
    # On 2 ranks each exchange step k of rank 0 meets exchange step k of rank 1.
    assert all(s == r for _, _, s, r in pairs)
    assert len(msgs) == sum(res.messages)


def test_unmatched_messages_are_dropped_or_raise_when_strict():
    t, _ = _traced_local(3, _ring(12))
    half = select(t, ranks=[0, 1])
    matched = messages(half)
    assert all(m.src in (0, 1) and m.dst in (0, 1) for m in matched)
    assert len(matched) == 2 * 2  # only 0 -> 1 messages survive: 2(p-1) of them
    with pytest.raises(ck.InvalidArgument, match="unmatched"):
        messages(half, strict=True)


# -- selecting and validating ----------------------------------------------------------------------


def test_select_filters_by_every_field():
    def body(comm):
        comm.allreduce(rng.standard_normal(5), algorithm="naive")
        comm.allgather(rng.standard_normal(2), algorithm="ring")
    t, _ = _traced_local(3, body)
    gathered = select(t, collective="allgather")
    assert gathered and {e["collective"] for e in gathered} == {"allgather"}
    assert select(t, algorithm="ring") == gathered
    seq = gathered[0]["seq"]
    assert select(t, seq=seq) == gathered
    assert {e["rank"] for e in select(t, ranks=[2])} == {2}
    assert {e["kind"] for e in select(t, kinds=["reduce"])} == {"reduce"}
    assert select(t, collective="alltoall") == []


@pytest.mark.parametrize("bad", [None, "events", {"rank": 0}, [{"rank": 0}], 42])
def test_events_of_rejects_what_is_not_events(bad):
    with pytest.raises(ck.InvalidArgument):
        events_of(bad)


def test_events_of_accepts_tracers_simulations_and_lists():
    res = sim.simulate("broadcast", "binomial", 4, 32, events=True)
    assert events_of(res) == res.events
    assert events_of(list(res.events)) == res.events
    assert calls(res)[0].name == "broadcast_binomial"
    with pytest.raises(ck.InvalidArgument, match="events=True"):
        events_of(sim.simulate("broadcast", "binomial", 4, 32))


# -- exports ---------------------------------------------------------------------------------------


def _check_chrome(doc, events):
    json.dumps(doc)  # serialisable as is
    items = doc["traceEvents"]
    ranks = sorted({e["rank"] for e in events})
    names = {(i["pid"], i["args"]["name"]) for i in items if i["ph"] == "M" and i["name"] == "process_name"}
    assert names == {(r, f"rank {r}") for r in ranks}
    steps = [i for i in items if i["ph"] == "X" and i["cat"] != "collective"]
    assert len(steps) == len(events)
    assert all(i["dur"] >= 0 and i["ts"] >= 0 for i in items if i["ph"] == "X")
    assert min(i["ts"] for i in steps) == 0
    per_call = {(e["rank"], e["collective"], e["seq"]) for e in events}
    assert len([i for i in items if i["ph"] == "X" and i["cat"] == "collective"]) == len(per_call)
    starts = {i["id"]: i for i in items if i["ph"] == "s"}
    finishes = {i["id"]: i for i in items if i["ph"] == "f"}
    msgs = messages(events)
    assert len(starts) == len(finishes) == len(msgs)
    assert set(starts) == set(finishes)
    for m_id, s in starts.items():
        f = finishes[m_id]
        assert f["bp"] == "e" and s["args"]["to"] == f["pid"] and f["args"]["from"] == s["pid"]
        # Each end lies inside a step slice of its own rank, so it binds to that step.
        for end in (s, f):
            assert any(x["pid"] == end["pid"] and x["ts"] <= end["ts"] <= x["ts"] + x["dur"] for x in steps)
    return items


def test_chrome_trace_of_a_real_run(tmp_path):
    def body(comm):
        comm.allreduce(rng.standard_normal(40), algorithm="rabenseifner")
        comm.scatter(rng.standard_normal((4, 3)), root=3, out=np.empty(3), algorithm="binomial")
    t, _ = _traced_local(4, body)
    path = tmp_path / "trace.json"
    doc = t.to_chrome(path)
    assert json.loads(path.read_text()) == json.loads(json.dumps(doc))
    items = _check_chrome(doc, t.events)
    step_args = [i["args"] for i in items if i["ph"] == "X" and i["cat"] != "collective"]
    assert {a["algorithm"] for a in step_args} == {"rabenseifner", "binomial"}


def test_chrome_trace_of_a_simulation():
    res = sim.simulate("alltoall", "bruck", 6, 64, events=True, alpha=1e-6, beta=1e-9)
    items = _check_chrome(to_chrome(res), res.events)
    assert sum(1 for i in items if i["ph"] == "s") == sum(res.messages)


def test_save_and_load_round_trip(tmp_path):
    t, _ = _traced_local(3, _ring(7))
    path = tmp_path / "events.json"
    t.save(path)
    assert load(path) == t.events
    save(t.events[:2], path)
    assert load(path) == t.events[:2]
    (tmp_path / "other.json").write_text(json.dumps({"traceEvents": []}))
    with pytest.raises(ck.InvalidArgument, match="not a commkit trace"):
        load(tmp_path / "other.json")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ck.InvalidArgument, match="not valid JSON"):
        load(tmp_path / "broken.json")


def test_real_and_simulated_events_have_the_same_shape():
    p, n = 4, 13

    def body(comm):
        comm.allgather(rng.standard_normal(n), algorithm="bruck")
    t, _ = _traced_local(p, body)
    res = sim.simulate("allgather", "bruck", p, count=n, itemsize=8, events=True)

    def shape(events):
        return sorted((e["rank"], e["step"], e["kind"], json.dumps(e["sends"]), json.dumps(e["recvs"]), e["bytes"],
                       json.dumps([e.get(k) for k in ("send_ranges", "recv_ranges", "range", "src_range")]))
                      for e in events)

    assert shape(t.events) == shape(res.events)
    assert [(m.src, m.dst, m.nbytes) for m in sorted(messages(t), key=lambda m: (m.send["step"], m.src))] == \
        [(m.src, m.dst, m.nbytes) for m in sorted(messages(res), key=lambda m: (m.send["step"], m.src))]


# -- MPI ---------------------------------------------------------------------------------------------


def test_trace_under_mpi_gathers_every_rank_to_root(mpi, tmp_path):
    out = tmp_path / "events.json"
    mpi(3, f"""
        import numpy as np
        import commkit as ck
        from commkit.tracing import messages
        comm = ck.init("mpi")
        x = np.random.default_rng(comm.rank).standard_normal(50)
        with ck.trace(comm, root=1) as t:
            comm.allreduce(x, algorithm="ring")
            comm.broadcast(x, root=2, algorithm="binomial")
        if comm.rank == 1:
            assert {{e["rank"] for e in t.events}} == {{0, 1, 2}}, t.events
            assert len(messages(t, strict=True)) == 2 * 2 * 3 + 2
            assert t.hosts is not None and len(t.hosts) == 3
            t.save({str(out)!r})
        else:
            assert {{e["rank"] for e in t.events}} == {{comm.rank}}
    """)
    from commkit.tracing import load

    events = load(out)
    assert {(c.collective, c.algorithm) for c in calls(events)} == {("allreduce", "ring"), ("broadcast", "binomial")}
    _check_chrome(to_chrome(events), events)


def test_trace_under_mpi_through_the_mpi4py_face(mpi):
    mpi(2, """
        import numpy as np
        from mpi4py import MPI
        import commkit as ck
        from commkit.compat.mpi4py import wrap
        comm = wrap(MPI.COMM_WORLD)
        x = np.arange(10.0) + comm.Get_rank()
        with ck.trace(comm) as t:
            comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)
        if comm.Get_rank() == 0:
            assert {e["rank"] for e in t.events} == {0, 1}, t.events
            assert {e["collective"] for e in t.events} == {"allreduce"}
            assert len(t.messages(strict=True)) >= 2
    """)
