"""The regimes of a tuned table: no rule narrower than the documented minimum, none given to noise.

`commkit tune` writes one rule per regime of the cost model; where two formulas nearly tie, the
model's winner flips every few bytes, and those slivers are merged into their neighbours
(docs/selection.md, "Tuning for your machine"). These tests build tables from the model alone
(no MPI), and with a stand-in ``confirm`` for the measured boundaries.
"""

from __future__ import annotations

from hypothesis import example, given
from hypothesis import strategies as st

from commkit import algorithms, collectives, cost, selection, tune
from commkit.ops import SUM, Op

NONCOMM = Op(lambda a, b: a, commutative=False, name="first")

# The documented minimum: a bounded rule spans at least 1/8 of its lower bound.
FRACTION = 8

SEGMENTED = [c for c in algorithms.COLLECTIVES
             if any(a.segmented and a.cost is not None for a in algorithms.for_collective(c).values())]

# Constants whose model regimes have slivers (cost.crossovers finds regimes a few bytes wide).
REDUCE_P2 = dict(alpha=30e-6, beta=0.5e-9, gamma=0.2e-9)
QUICK_RUN = dict(alpha=3.0308447424934722e-06, beta=9.440596439512311e-11, gamma=1.648848352826738e-11)
SELECTION = dict(alpha=5e-6, beta=2e-10, gamma=1e-10)  # tests/test_selection.py's


def _narrow(lo, hi):
    return hi is not None and (hi + 1 - lo) * FRACTION < lo


def _groups(table, collective):
    """The table's rules for ``collective``, by (process count, commutative flag), in order."""
    groups = {}
    for rule in table[collective]:
        groups.setdefault((rule["min_procs"], rule.get("commutative")), []).append(rule)
    return groups


def _span(rule):
    return rule.get("min_bytes", 0), rule.get("max_bytes")


def _check_table(table, constants, itemsize):
    """Every property a tuned table's model rules must have; the model's regimes for comparison."""
    selection.validate_table(table, "the tuned table")
    for collective in (c for c in algorithms.COLLECTIVES if c in table):
        for (p, flag), rules in _groups(table, collective).items():
            assert rules[0]["max_procs"] == p
            reducing = collective in collectives.REDUCING
            commutative = flag is True or not reducing
            op = (SUM if commutative else NONCOMM) if reducing else None
            model = cost.crossovers(collective, p, commutative=commutative, itemsize=itemsize, **constants)
            where = f"{collective} p={p} commutative={commutative}: {[(_span(r), r['algorithm']) for r in rules]}"
            # The rules tile every size, from 0 up with no upper bound, each with an algorithm that applies.
            assert _span(rules[0])[0] == 0 and _span(rules[-1])[1] is None, where
            for before, after in zip(rules, rules[1:]):
                assert _span(after)[0] == _span(before)[1] + 1, where
                assert before["algorithm"] != after["algorithm"], where  # the same algorithm twice: one rule
            for rule in rules:
                assert not _narrow(*_span(rule)), where
                alg = algorithms.get(collective, rule["algorithm"])
                assert alg.why_not(p, op) is None, where
                assert rule["algorithm"] in cost.applicable(collective, p, commutative), where
            # Merging only takes boundaries away: each one left is the model's, and every regime of the
            # model that is wide enough keeps its algorithm.
            assert {_span(r)[0] for r in rules} <= {r.min_bytes for r in model}, where
            for regime in model:
                if not _narrow(regime.min_bytes, regime.max_bytes):
                    holder = next(r for r in rules if _span(r)[1] is None or regime.min_bytes <= _span(r)[1])
                    assert holder["algorithm"] == regime.algorithm, (regime, where)


def _log_uniform(low, high):
    return st.floats(min_value=low, max_value=high).map(lambda e: 10.0 ** e)


@given(alpha=_log_uniform(-7, -4), beta=_log_uniform(-11.5, -8), gamma=_log_uniform(-12, -8),
       procs=st.lists(st.sampled_from([2, 3, 4, 5, 6, 8, 12, 16, 33, 64]), min_size=1, max_size=2, unique=True),
       segmented=st.sampled_from(SEGMENTED),
       others=st.lists(st.sampled_from(algorithms.COLLECTIVES), max_size=2, unique=True),
       itemsize=st.sampled_from([None, 1, 4, 8]))
@example(procs=[2], segmented="reduce", others=[], itemsize=4, **REDUCE_P2)
@example(procs=[2], segmented="allreduce", others=[], itemsize=4, **QUICK_RUN)
@example(procs=[4], segmented="broadcast", others=[], itemsize=None, **SELECTION)
def test_no_rule_is_narrower_than_the_minimum(alpha, beta, gamma, procs, segmented, others, itemsize):
    chosen = list(dict.fromkeys([segmented, *others]))
    table = tune.build_table(alpha, beta, gamma, procs, chosen, measured_p=procs[0], itemsize=itemsize)
    _check_table(table, dict(alpha=alpha, beta=beta, gamma=gamma), itemsize)


def _sizes(lo, hi, step):
    count = (hi + 1 - lo) // step
    return sorted({lo + k * (count - 1) // 4 * step for k in range(5)})


def test_the_slivers_of_a_quick_run_are_merged():
    # Reduce at p=2 traded rabenseifner and binary_tree_segmented (whose formulas agree to the last bit
    # at whole elements) over ranges from 260 B to 32 KiB wide; with the constants a quick `commkit tune`
    # measured on the development machine, allreduce at p=2 had ring_pipelined alone at 1470524 B-1572867 B.
    cases = [("reduce", 2, REDUCE_P2, ["binomial", "binary_tree_segmented", "rabenseifner"]),
             ("allreduce", 2, QUICK_RUN, ["recursive_doubling", "ring", "ring_pipelined", "ring"])]
    for collective, p, constants, want in cases:
        model = cost.crossovers(collective, p, itemsize=4, **constants)
        slivers = [r for r in model if _narrow(r.min_bytes, r.max_bytes)]
        assert slivers, model  # the model itself still has them
        table = tune.build_table(**constants, procs=(p,), collectives=[collective], measured_p=p, itemsize=4)
        rules = _groups(table, collective)[(p, True)]
        assert [r["algorithm"] for r in rules] == want, rules
        _check_table(table, constants, 4)
        for sliver in slivers:
            rule = next(r for r in rules if _span(r)[1] is None or sliver.min_bytes <= _span(r)[1])
            if rule["algorithm"] == sliver.algorithm:
                continue  # what lay between it and a wider range of its own algorithm was merged instead
            assert f"{sliver.algorithm} at " in rule["reason"] and "are merged in" in rule["reason"], rule
            for n in _sizes(sliver.min_bytes, sliver.max_bytes, 4):  # a near-tie: under 1% given up
                ours = cost.predict(collective, rule["algorithm"], p, n, **constants)
                assert ours <= cost.predict(collective, sliver.algorithm, p, n, **constants) * 1.01, (n, rule)


def test_the_bench_confirms_only_the_crossovers_left():
    calls = []

    def confirm(collective, low, high, boundary, lower, upper):
        calls.append((low, high, boundary))
        return boundary, "confirmed", []

    table = tune.build_table(**REDUCE_P2, procs=(2,), collectives=["reduce"], measured_p=2, confirm=confirm,
                             itemsize=4)
    rules = _groups(table, "reduce")[(2, True)]
    assert calls == [(a["algorithm"], b["algorithm"], b["min_bytes"]) for a, b in zip(rules, rules[1:])]
    assert len(calls) == 2 and len(table["measured"]["confirmations"]) == 2


def test_a_measured_boundary_is_kept_even_where_it_leaves_a_narrow_rule():
    # The bench finds binomial faster up to the last element binary_tree_segmented's range allows:
    # that one-element rule rests on measurements, so it stays, and its reason says why it is narrow.
    def confirm(collective, low, high, boundary, lower, upper):
        if low == "binomial":
            return upper, "binomial faster throughout", []
        return boundary, "confirmed", []

    table = tune.build_table(**REDUCE_P2, procs=(2,), collectives=["reduce"], measured_p=2, confirm=confirm,
                             itemsize=4)
    selection.validate_table(table, "the tuned table")
    rules = _groups(table, "reduce")[(2, True)]
    assert [r["algorithm"] for r in rules] == ["binomial", "binary_tree_segmented", "rabenseifner"]
    lo, hi = _span(rules[1])
    assert hi + 1 - lo == 4 and _narrow(lo, hi), rules[1]
    assert "kept as measured" in rules[1]["reason"] and "binomial faster throughout" in rules[1]["reason"]
    assert all("kept as measured" not in r["reason"] for r in (rules[0], rules[2]))
