"""The picture in every algorithm's docstring is the one its schedule draws today (commkit/algorithms/_diagram.py).

Also: the pictures' interpreter ends every built-in schedule with exactly the collective's result
(so a picture cannot show something the schedule does not do), and ``--write`` redraws a stale
picture in the source file, one-line docstrings included.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
import textwrap

import pytest

from commkit import algorithms
from commkit.algorithms import _diagram
from commkit.schedule import Exchange, Recv, Send

BUILTIN = sorted(_diagram._builtin(), key=lambda alg: alg.qualname)


@pytest.mark.parametrize("alg", BUILTIN, ids=[alg.qualname for alg in BUILTIN])
def test_every_docstring_holds_the_picture_its_schedule_draws(alg):
    doc = inspect.cleandoc(alg.schedule.__doc__ or "")
    assert _diagram.section(alg) in doc, (
        f"{alg.qualname}: the picture in its docstring is stale or missing; run "
        "python -m commkit.algorithms._diagram --write")
    assert doc.count(_diagram.MARKER) == 1, alg.qualname


def test_the_check_command_agrees():
    assert _diagram.main(["--check"]) == 0
    assert _diagram.main(["--bogus"]) == 2


def _result(collective, p, root=0):
    """What every rank must hold at the end, per block of a cell: the collective's definition."""
    everyone = frozenset(range(p))
    nothing = frozenset()
    want = {}
    for x in range(p):
        if collective == "barrier":
            want[x] = (everyone,)
        elif collective == "allreduce":
            want[x] = (everyone,) * p
        elif collective == "reduce" and x == root:
            want[x] = (everyone,) * p
        elif collective == "broadcast":
            want[x] = (frozenset((root,)),) * p
        elif collective in ("allgather", "allgatherv", "alltoall", "alltoallv") or (
                collective in ("gather", "gatherv") and x == root):
            want[x] = tuple(frozenset((q,)) for q in range(p))
        elif collective in ("scatter", "scatterv"):
            want[x] = {x: frozenset((root,))}
        elif collective == "reduce_scatter":
            want[x] = {x: everyone}
        elif collective == "scan":
            want[x] = (frozenset(range(x + 1)),) * p
        elif collective == "exscan":
            want[x] = (frozenset(range(x)) if x else nothing,) * p
    return want


def _out(collective, p, count, x, root=0):
    """The symbols rank x's output must hold, element by element (None where the result is undefined)."""
    everyone = frozenset(range(p))
    if collective in ("broadcast", "allreduce", "scan", "exscan") or (collective == "reduce" and x == root):
        ranks = {"broadcast": frozenset((root,)), "scan": frozenset(range(x + 1)),
                 "exscan": frozenset(range(x))}.get(collective, everyone)
        return [(i, ranks) if ranks else None for i in range(count)]
    if collective in ("allgather", "allgatherv") or (collective in ("gather", "gatherv") and x == root):
        counts = count if isinstance(count, tuple) else (count,) * p
        return [(sum(counts[:q]) + j, frozenset((q,))) for q in range(p) for j in range(counts[q])]
    if collective in ("scatter", "scatterv", "reduce_scatter"):
        counts = count if isinstance(count, tuple) else (count,) * p
        ranks = everyone if collective == "reduce_scatter" else frozenset((root,))
        return [(sum(counts[:x]) + j, ranks) for j in range(counts[x])]
    if collective in ("alltoall", "alltoallv"):
        matrix = count if isinstance(count, tuple) else ((count,) * p,) * p
        return [((x, r, j), frozenset((r,))) for r in range(p) for j in range(matrix[r][x])]
    return None  # barrier; a non-root's output of reduce or gather


@pytest.mark.parametrize("alg", BUILTIN, ids=[alg.qualname for alg in BUILTIN])
def test_every_schedule_run_with_symbols_puts_each_contribution_in_its_place(alg):
    for p in (1, 2, 3, 4, 5, 7):
        count, segment = _diagram._example(alg)
        if alg.collective in ("reduce_scatter", "allgatherv", "gatherv", "scatterv"):
            count = tuple((3 * q + 1) % 4 for q in range(p))
        elif alg.collective == "alltoallv":
            count = tuple(tuple((i + 2 * j) % 3 for j in range(p)) for i in range(p))
        if alg.power_of_two and p & (p - 1):
            continue
        root = p - 1
        for x, out in enumerate(_diagram.outputs(alg, p, count, root, segment)):
            want = _out(alg.collective, p, count, x, root)
            if want is not None:
                assert out == want, (alg.qualname, p, count, x)


@pytest.mark.parametrize("alg", BUILTIN, ids=[alg.qualname for alg in BUILTIN])
def test_the_pictures_interpreter_ends_with_the_collectives_result(alg):
    count, segment = _diagram._example(alg)
    cells = _diagram.trace(alg, 4, count, 0, segment)
    for rank, want in _result(alg.collective, 4).items():
        final = cells[rank][-1][1]
        if isinstance(want, dict):  # only the rank's own block is defined
            for block, ranks in want.items():
                assert final[block] == ranks, (alg.qualname, rank, final)
        else:
            assert final == want, (alg.qualname, rank, final)


def test_a_picture_shows_each_round():
    # Ring allgather, p = 4: after round t every rank holds its own block and the t blocks to its left.
    cells = _diagram.trace(algorithms.get("allgather", "ring"), 4, 1)
    for rank, history in enumerate(cells):
        assert [t for t, _ in history] == [0, 1, 2, 3], rank
        for t, held in history:
            have = {q for q in range(4) if held[q]}
            assert have == {(rank - k) % 4 for k in range(t + 1)}, (rank, t, held)


def _half_ring(rank, size, count, op):
    """A ring allreduce that forgets its allgather: every rank ends with one reduced block."""
    full = algorithms.get("allreduce", "ring").schedule
    steps = list(full(rank, size, count, op))
    yield from steps[:len(steps) - (size - 1)]


def test_the_picture_changes_with_the_schedule():
    ring = algorithms.get("allreduce", "ring")
    algorithms.algorithm("allreduce", "half_ring_for_picture", commutative=True, scratch=ring.scratch)(_half_ring)
    try:
        half = algorithms.get("allreduce", "half_ring_for_picture")
        assert _diagram.picture(half) != _diagram.picture(ring)
        # Rank 0 ends with block 1 complete, and the partial sums it passed on of blocks 2 and 3.
        assert _diagram.trace(half, 4, 8)[0][-1][1] == (frozenset((0,)), frozenset(range(4)), frozenset((0, 2, 3)),
                                                         frozenset((0, 3)))
    finally:
        algorithms.unregister("allreduce", "half_ring_for_picture")


def _stuck(rank, size, count, root):
    """Every rank receives before it sends: a deadlock for p > 1."""
    yield Recv((rank - 1) % size, ("out", 0, count))
    yield Send((rank + 1) % size, ("out", 0, count))


def _short(rank, size, count, root):
    """Rank 0 sends one element where rank 1 expects all of them."""
    if rank == 0:
        yield Exchange(1, ("in", 0, 1), 1, ("out", 0, count))
    elif rank == 1:
        yield Exchange(0, ("out", 0, count), 0, ("out", 0, count))


@pytest.mark.parametrize("schedule,message", [(_stuck, "deadlocks"), (_short, "receives 8 elements")])
def test_a_broken_schedule_cannot_be_drawn(schedule, message):
    name = f"picture_{schedule.__name__.strip('_')}"
    algorithms.algorithm("broadcast", name)(schedule)
    try:
        with pytest.raises(RuntimeError, match=message):
            _diagram.trace(algorithms.get("broadcast", name), 4, 8)
    finally:
        algorithms.unregister("broadcast", name)


MODULE = '''
from commkit.algorithms import algorithm
from commkit.schedule import Copy, Exchange


@algorithm("allgather", "picture_one_line")
def allgather_one_line(rank, size, count):
    """Pairs swap blocks, then stop (a one-line docstring)."""
    yield Copy(("out", rank * count, (rank + 1) * count), ("in", 0, count))
    if rank ^ 1 < size:
        yield Exchange(rank ^ 1, ("in", 0, count), rank ^ 1, ("out", (rank ^ 1) * count, ((rank ^ 1) + 1) * count))


@algorithm("allgather", "picture_stale")
def allgather_stale(rank, size, count):
    """Only copies.

    Picture, generated from the schedule (an old one)::

        nothing like it
    """
    yield Copy(("out", rank * count, (rank + 1) * count), ("in", 0, count))
'''


def test_write_redraws_stale_pictures_in_the_source(tmp_path):
    path = tmp_path / "picture_module.py"
    path.write_text(textwrap.dedent(MODULE), encoding="utf-8")
    spec = importlib.util.spec_from_file_location("picture_module", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["picture_module"] = module
    try:
        spec.loader.exec_module(module)
        algs = [algorithms.get("allgather", "picture_one_line"), algorithms.get("allgather", "picture_stale")]
        assert _diagram.write(algs) == algs
        text = path.read_text(encoding="utf-8")
        for alg in algs:
            assert textwrap.indent(_diagram.section(alg), "    ").replace("    \n", "\n") in text, alg.qualname
        assert "nothing like it" not in text and text.count(_diagram.MARKER) == 2
        assert '    """Pairs swap blocks, then stop (a one-line docstring).\n\n    Picture' in text
        compile(text, str(path), "exec")
        first = text
        _diagram.write(algs)  # redrawing an up-to-date picture changes nothing
        assert path.read_text(encoding="utf-8") == first
    finally:
        algorithms.unregister("allgather", "picture_one_line")
        algorithms.unregister("allgather", "picture_stale")
        sys.modules.pop("picture_module", None)


def test_a_node_picture_counts_waits_and_copies_not_messages():
    alg = algorithms.for_collective("allgather")["shm"]
    lines = _diagram.picture(alg)
    assert not any(line.startswith(("msgs sent", "elems sent")) for line in lines)
    rows = {line.split()[0] + (" " + line.split()[1] if line.startswith("elems") else ""): line.split()[-4:]
            for line in lines[1:-1]}
    assert rows["waits"] == ["1"] * 4 and rows["elems got"] == ["3"] * 4
    assert lines[-1].endswith("1 wait, 4 elements copied")
