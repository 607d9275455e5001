"""The pipelined chain, trees and rings keep their schedules step for step when their code moves or is rewritten.

Each digest below is the SHA-256 of every step of every rank (the step's kind, its sends and
receives with peers and buffer ranges in posting order, the local steps it overlaps, and each
reduction's operands, source and order) for p = 1..9, several counts, segment sizes and roots,
recorded from the schedules as they were before they were rewritten as plain generators (the
lockstep helper of the old ``segmented`` module). A digest that changes means some rank now
sends, receives or reduces something else, or in another order; :func:`describe` prints the
steps behind a digest so that two versions can be compared with ``diff``.

The results of the same algorithms are compared with NumPy on the threads world below, and at
length in tests/test_segmented.py and tests/test_pipelined.py.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

import commkit as ck
from commkit import algorithms, collectives, selection, testing
from commkit.schedule import COPY, REDUCE, TRANSFER

PROCS = range(1, 10)
SEGMENTS = (None, 1, 2, 3, 5)


def _counts(collective, p):
    if collective == "reduce_scatter":
        return [(0,) * p, (1,) * p, (4,) * p, tuple(q % 3 for q in range(p)), tuple((5 * q + 2) % 7 for q in range(p)),
                (0,) * (p - 1) + (p + 1,)]
    return sorted({0, 1, 2, 3, p - 1, p + 1, 2 * p + 3, 5 * p, 17, 64})


def _roots(collective, p):
    return sorted({0, p // 2, p - 1}) if collective in collectives.ROOTED else [0]


def _local(step):
    if step.kind == REDUCE:
        return ["reduce", list(step.into), list(step.operand), list(step.src), step.operand_first, step.op.name]
    assert step.kind == COPY, step
    return ["copy", list(step.dst), list(step.src)]


def _canonical(step):
    """A step as plain data: independent of how schedule.py prints steps."""
    if step.kind in (REDUCE, COPY):
        return _local(step)
    return [type(step).__name__, [[peer, list(buf)] for peer, buf in step.sends],
            [[peer, list(buf)] for peer, buf in step.recvs], [_local(s) for s in step.overlap]]


def _cases(collective, name):
    alg = algorithms.get(collective, name)
    for p in PROCS:
        for count in _counts(collective, p):
            for root in _roots(collective, p):
                for segment in (SEGMENTS if alg.segmented else (None,)):
                    yield p, count, root, segment


def describe(collective, name):
    """Every rank's steps of every case, one line each (what the digest hashes)."""
    alg = algorithms.get(collective, name)
    lines = []
    for p, count, root, segment in _cases(collective, name):
        for rank in range(p):
            steps = collectives.steps(alg.schedule, collective, rank, p, count, ck.SUM, root, segment)
            lines.append(json.dumps([p, count, root, segment, rank, [_canonical(s) for s in steps]]))
    return lines


def digest(collective, name):
    return hashlib.sha256("\n".join(describe(collective, name)).encode()).hexdigest()


RECORDED = {
    ("broadcast", "chain_pipelined"): "d9a20da388c4f0a3a23ac1f88350ffa7cb9120fa39b080993cd1c707189dcdc5",
    ("broadcast", "binary_tree_segmented"): "c87d1f44f6df8ca18baff754efb250b31a7f2d8649d743e111d79f8b9fde0076",
    ("broadcast", "double_binary_tree"): "3cb062e73c8376dbf204d3111547a4753363020f7c68d7b594029e61e2717067",
    ("reduce", "binary_tree_segmented"): "06d17a859a94c746e8cfd9c9c2aaafc299f4ef3e9983cb9c16dea6c7c2056fc1",
    ("reduce", "double_binary_tree"): "193b644d0c97b09e253f830a7cd012ecd3e8cf3da2e6440fe52358dabeb685cb",
    ("reduce", "rabenseifner"): "f1c4ea641d0ada87256aaaceef954b3bce4b0f147d2dff00a45a187d856c64a2",
    ("allreduce", "double_binary_tree"): "29af9b428814084fee7bb4f120e6fec539bbc4c7420c1bc5151ef4b0381c50a1",
    ("allreduce", "ring_pipelined"): "185c9aec2656c9c5ff03ca5cef409301db88dfed324ec90cd7e883cc1e2a7db0",
    ("allreduce", "ring"): "c6005c0d9ac3cfddee733cc93b51d586848a086ec4cf83bdadc84335277757a0",
    ("allreduce", "rabenseifner"): "6efa0b832dbf6980248796c80edbf8745fff0b00fa1c5673cf0f3cc61e7c6c85",
    ("reduce_scatter", "ring_pipelined"): "045ef22714dc0411491a73f0c3060dd403afc173b62f1ce4b43b107120e0f66f",
    ("reduce_scatter", "ring"): "4fe99a4a14b18dda1f4d1f4b784aea9503d5b10381705d2db4d5b804bce3ffb1",
    ("reduce_scatter", "recursive_halving"): "e19b0c5162cf98ae7bbd97c583de833b78cc40736d23992802fc483dc7434697",
}


@pytest.mark.parametrize("collective,name", sorted(RECORDED), ids=[f"{c}_{n}" for c, n in sorted(RECORDED)])
def test_schedules_are_the_recorded_ones(collective, name):
    assert digest(collective, name) == RECORDED[collective, name], (
        f"{collective}_{name}: some rank's steps differ from the recorded schedule; compare "
        f"describe({collective!r}, {name!r}) before and after the change")


@pytest.mark.parametrize("collective,name", sorted(RECORDED), ids=[f"{c}_{n}" for c, n in sorted(RECORDED)])
def test_results_equal_numpy(collective, name):
    rng = np.random.default_rng(7)
    # Segments of two int64 elements, so that the pipelines run with many segments in flight.
    forced = f"{name}:16" if algorithms.get(collective, name).segmented else name
    for p in (1, 2, 3, 4, 5, 7):
        counts = [tuple(int(c) for c in rng.integers(0, 6, p)), (3,) * p] if collective == "reduce_scatter" \
            else [0, 1, p + 1, 4 * p + 3]
        for count in counts:
            root = p - 1
            total = sum(count) if collective == "reduce_scatter" else count
            data = [rng.integers(-50, 50, total).astype(np.int64) for _ in range(p)]

            def body(comm, data=data, count=count, root=root):
                x = data[comm.rank]
                if collective == "broadcast":
                    return comm.broadcast(x, root=root, algorithm=forced)
                if collective == "reduce":
                    return comm.reduce(x, root=root, algorithm=forced)
                if collective == "reduce_scatter":
                    return comm.reduce_scatter(x, counts=list(count), algorithm=forced)
                return comm.allreduce(x, algorithm=forced)

            got = ck.run_local(body, p)
            total_sum = np.sum(data, axis=0)
            offsets = np.cumsum((0,) + count) if collective == "reduce_scatter" else None
            for rank in range(p):
                if collective == "broadcast":
                    want = data[root]
                elif collective == "reduce":
                    if rank != root:
                        continue
                    want = total_sum
                elif collective == "reduce_scatter":
                    want = total_sum[offsets[rank]:offsets[rank + 1]]
                else:
                    want = total_sum
                np.testing.assert_array_equal(got[rank], want, err_msg=f"{collective}_{name} p={p} count={count}")


# -- the textbook forms of the ring and Rabenseifner allreduce ------------------------------------------------------

TEXTBOOK = {"ring_textbook": "ring", "rabenseifner_textbook": "rabenseifner"}


@pytest.mark.parametrize("name", sorted(TEXTBOOK))
def test_textbook_variants_pass_check_algorithm(name):
    report = testing.check_algorithm("allreduce", name, max_procs=6, sim_procs=24)
    assert report.ok, report.summary()


def _messages(name, rank, p, count):
    """Every transfer's peers and lengths, without the buffers: what travels, not where it lands."""
    steps = algorithms.get("allreduce", name).schedule(rank, p, count, ck.SUM)
    return [([(peer, hi - lo) for peer, (_, lo, hi) in s.sends], [(peer, hi - lo) for peer, (_, lo, hi) in s.recvs])
            for s in steps if s.kind == TRANSFER]


@pytest.mark.parametrize("name", sorted(TEXTBOOK))
def test_textbook_variants_send_what_the_optimised_ones_send_and_read_only_out(name):
    for p in PROCS:
        for count in _counts("allreduce", p):
            for rank in range(p):
                assert _messages(name, rank, p, count) == _messages(TEXTBOOK[name], rank, p, count), (name, p, count)
                steps = list(algorithms.get("allreduce", name).schedule(rank, p, count, ck.SUM))
                # The textbook form copies its input once, first, and then reads only "out" and "tmp".
                assert steps[0].kind == COPY and steps[0].src == ("in", 0, count), (name, p, count)
                for s in steps[1:]:
                    if s.kind == TRANSFER:
                        assert all(buf[0] != "in" for _, buf in s.sends), (name, p, count, s)
                    elif s.kind == REDUCE:
                        assert s.src == s.into, (name, p, count, s)
    # The optimised forms are the ones that read "in" after the start (else the variant would be pointless).
    for name in TEXTBOOK.values():
        steps = list(algorithms.get("allreduce", name).schedule(0, 4, 8, ck.SUM))
        assert any(s.kind == REDUCE and s.src[0] == "in" for s in steps), name


def test_textbook_variants_are_not_in_the_selection_table():
    table = selection.default_table()
    assert not {rule["algorithm"] for rule in table["allreduce"]} & set(TEXTBOOK)
