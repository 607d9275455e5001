"""The simulator's other timing models: LogGP and the two-level (within / between nodes) model.

What must hold, written from each model's definition (commkit.cost.LogGP,
commkit.cost.TwoLevel), not from running it:

* the models change the clock only: messages, bytes, rounds and deadlocks are
  the alpha-beta model's for every algorithm;
* LogGP: one message costs o + L + kG + o; a rank's link and processor work at
  once, so an overlapped reduction hides behind a transfer, a root's sends
  leave back to back, and a pipelined ring beats the plain one at large sizes;
* two-level: with one node, or with equal constants at both levels, it is the
  alpha-beta model; a transfer costs the slower of its two levels; placement
  decides which messages cross nodes.
"""

from __future__ import annotations

import pytest

import commkit as ck
from commkit import algorithms, collectives, cost, sim
from commkit._units import format_seconds
from commkit.schedule import Exchange, Recv, Reduce, Send, Transfer

# Distinct scales so that every term shows in a total.
MODEL = cost.LogGP(L=5.0, o=1.0, g=0.5, G=0.01, gamma=0.001)


def _every_algorithm():
    return sorted((c, n) for c in sim.SIMULATED for n, a in algorithms.for_collective(c).items()
                  if a.schedule is not None)


def _counts(res):
    return (res.messages, res.bytes_sent, res.bytes_received, res.bytes_reduced, res.rounds, res.steps, res.ok)


# -- LogGP -----------------------------------------------------------------------------------------


def test_loggp_defaults_give_one_message_the_alpha_beta_time():
    model = cost.LogGP()
    assert 2 * model.o + model.L == pytest.approx(cost.ALPHA)
    assert model.G == cost.BETA and model.gamma == cost.GAMMA and model.alpha == pytest.approx(cost.ALPHA)
    assert cost.LogGP.from_alpha_beta(3.0, 2.0, 1.0) == cost.LogGP(L=1.0, o=1.0, g=1.0, G=2.0, gamma=1.0)
    for nbytes in (0, 1000, 1 << 20):
        ab = sim.simulate("broadcast", "naive", 2, nbytes)
        assert sim.simulate("broadcast", "naive", 2, nbytes, model="loggp").time == pytest.approx(ab.time)


def test_one_message_costs_o_plus_L_plus_kG_plus_o():
    def one(rank):
        yield Send(1, ("in", 0, 100)) if rank == 0 else Recv(0, ("out", 0, 100))

    res = sim.simulate_steps(one, 2, model=MODEL)
    # The sender is done once its link has sent the bytes; the receiver after L and its overhead.
    assert res.finish == [pytest.approx(1.0 + 100 * 0.01), pytest.approx(1.0 + 5.0 + 100 * 0.01 + 1.0)]
    assert res.alpha == pytest.approx(7.0) and res.beta == 0.01 and res.model is MODEL


def test_a_roots_sends_leave_back_to_back_on_its_link():
    # The root posts p-1 sends (o each) while its link sends them one after another (kG each, >= g).
    p, k = 5, 300

    def fan_out(rank):
        if rank == 0:
            yield Transfer(sends=[(q, ("in", 0, k)) for q in range(1, p)])
        else:
            yield Recv(0, ("out", 0, k))

    res = sim.simulate_steps(fan_out, p, model=MODEL)
    for q in range(1, p):
        injected = 1.0 + (q - 1) * k * 0.01  # the first leaves after one o; the next when the link is free
        assert res.finish[q] == pytest.approx(injected + 5.0 + k * 0.01 + 1.0)
    assert res.finish[0] == pytest.approx(1.0 + (p - 1) * k * 0.01)
    # The alpha-beta model charges the root p-1 full latencies instead.
    ab = sim.simulate_steps(fan_out, p, alpha=MODEL.alpha, beta=MODEL.G)
    assert ab.time == pytest.approx((p - 1) * MODEL.alpha + (p - 1) * k * 0.01)
    assert res.time < ab.time


def test_the_gap_spaces_small_messages():
    def burst(rank):
        if rank == 0:
            yield Transfer(sends=[(1, ("in", 0, 1))] * 4)
        else:
            yield Transfer(recvs=[(0, ("out", 0, 1))] * 4)

    model = cost.LogGP(L=1.0, o=0.1, g=2.0, G=0.0, gamma=0.0)
    res = sim.simulate_steps(burst, 2, model=model)
    # Sends start 0.1, 2.1, 4.1, 6.1 (g apart); the last arrives after L and is taken in o.
    assert res.finish[1] == pytest.approx(6.1 + 1.0 + 0.1)


def test_a_receivers_link_takes_one_message_at_a_time():
    # Three senders at once into one receiver: its link receives them one after another.
    def gather(rank):
        if rank == 0:
            yield Transfer(recvs=[(q, ("out", q, q + 1)) for q in (1, 2, 3)])
        else:
            yield Send(0, ("in", 0, 1))

    model = cost.LogGP(L=1.0, o=0.5, g=0.0, G=10.0, gamma=0.0)
    res = sim.simulate_steps(gather, 4, model=model, buffers=[{"in": 1, "out": 4, "tmp": 0}] * 4)
    # All start at o = 0.5 and arrive at 1.5; received back to back in 10 each, each taken in o after it lands.
    assert res.finish[0] == pytest.approx(1.5 + 30.0 + 0.5)


def test_overlapped_reduction_runs_while_the_transfer_travels():
    def swap_and_reduce(rank):
        yield Exchange(1 - rank, ("in", 0, 100), 1 - rank, ("tmp", 0, 100),
                       overlap=(Reduce(("out", 0, 1000), ("in", 0, 1000), ck.SUM),))

    def swap_then_reduce(rank):
        yield Exchange(1 - rank, ("in", 0, 100), 1 - rank, ("tmp", 0, 100))
        yield Reduce(("out", 0, 1000), ("in", 0, 1000), ck.SUM)

    transfer = 1.0 + 5.0 + 100 * 0.01 + 1.0  # o + L + kG + o
    reduction = 1000 * 0.001
    overlapped = sim.simulate_steps(swap_and_reduce, 2, model=MODEL)
    # Post (o), reduce while the message travels, then take it (o): the reduction hides inside L + kG.
    assert overlapped.time == pytest.approx(1.0 + max(reduction, 5.0 + 1.0) + 1.0) == pytest.approx(transfer)
    assert sim.simulate_steps(swap_then_reduce, 2, model=MODEL).time == pytest.approx(transfer + reduction)
    slow = cost.LogGP(L=5.0, o=1.0, g=0.5, G=0.01, gamma=0.1)  # now the reduction is the longer
    assert sim.simulate_steps(swap_and_reduce, 2, model=slow).time == pytest.approx(1.0 + 100.0 + 1.0)
    assert overlapped.bytes_reduced == [1000, 1000]


@pytest.mark.parametrize("p", [4, 8])
def test_pipelined_ring_beats_the_ring_at_large_sizes_and_not_at_small(p):
    big = 64 << 20
    ring = sim.simulate("allreduce", "ring", p, big, model="loggp")
    piped = sim.simulate("allreduce", "ring_pipelined", p, big, model="loggp")
    assert piped.ok and piped.messages[0] > ring.messages[0]
    # Each block's reduction hides behind the next segment's transfer: at least half of it is saved.
    hidden = (p - 1) * (big / p) * cost.GAMMA
    assert piped.time < ring.time - 0.5 * hidden
    # One segment per block (small vectors): nothing to overlap, so no gain (and no loss).
    small = 4 * 1024 * p
    assert sim.simulate("allreduce", "ring_pipelined", p, small, model="loggp").time == pytest.approx(
        sim.simulate("allreduce", "ring", p, small, model="loggp").time)


@pytest.mark.parametrize("coll,name", _every_algorithm())
def test_other_models_change_the_clock_only(coll, name):
    alg = algorithms.get(coll, name)
    for p in (1, 3, 4, 6):
        if alg.why_not(p) is not None:
            continue
        for root in ((0, p - 1) if coll in collectives.ROOTED else (0,)):
            nbytes = 4 * 3 * p * p + 8
            ab = sim.simulate(coll, name, p, nbytes, root=root, use_symmetry=False)
            for model in ("loggp", cost.TwoLevel(2), cost.TwoLevel(2, placement="cyclic")):
                other = sim.simulate(coll, name, p, nbytes, root=root, model=model)
                where = f"{coll}_{name} p={p} root={root} model={model}"
                assert _counts(other) == _counts(ab), where
                assert other.ranks_simulated == p and other.time >= 0, where


def test_deadlocks_are_found_under_every_model():
    def both_receive_first(rank):
        yield Recv(1 - rank, ("out", 0, 4))
        yield Send(1 - rank, ("in", 0, 4))

    for model in ("loggp", cost.TwoLevel(1)):
        res = sim.simulate_steps(both_receive_first, 2, model=model)
        assert [(w.rank, w.step, w.recvs_from) for w in res.waiting] == [(0, 0, (1,)), (1, 0, (0,))]

    def lonely(rank):
        if rank == 0:
            yield Send(2, ("in", 0, 3))

    assert [(w.rank, w.sends_to) for w in sim.simulate_steps(lonely, 3, model="loggp").waiting] == [(0, (2,))]


def test_loggp_events_follow_its_clock():
    res = sim.simulate("allreduce", "ring_pipelined", 4, 4 << 20, model="loggp", events=True)
    assert max(e["end"] for e in res.events) == pytest.approx(res.time)
    assert all(0 <= e["start"] <= e["end"] for e in res.events)
    ends = {}
    for e in res.events:
        assert e["start"] >= ends.get(e["rank"], 0.0) - 1e-15  # a rank's steps follow one another
        ends[e["rank"]] = e["end"]


# -- two levels ------------------------------------------------------------------------------------


def test_one_node_is_the_alpha_beta_model():
    for coll, name in (("allreduce", "ring"), ("allreduce", "recursive_doubling"), ("alltoall", "bruck")):
        ab = sim.simulate(coll, name, 8, 1 << 16, alpha=2e-6, beta=1e-9, gamma=1e-10)
        one = sim.simulate(coll, name, 8, 1 << 16, ranks_per_node=8, alpha=2e-6, beta=1e-9, gamma=1e-10)
        assert one.time == pytest.approx(ab.time, rel=1e-12)
        same = cost.TwoLevel(1, alpha=2e-6, beta=1e-9, alpha_inter=2e-6, beta_inter=1e-9, gamma=1e-10)
        assert sim.simulate(coll, name, 8, 1 << 16, model=same).time == pytest.approx(ab.time, rel=1e-12)


def test_a_transfer_costs_the_slower_of_its_two_levels():
    model = cost.TwoLevel(2, alpha=1.0, beta=0.01, alpha_inter=10.0, beta_inter=0.1)

    def step(rank):
        # Rank 0 sends 100 elements to rank 1 (same node) and 30 to rank 2 (the other node).
        if rank == 0:
            yield Transfer(sends=[(1, ("in", 0, 100)), (2, ("in", 0, 30))])
        else:
            yield Recv(0, ("out", 0, 100 if rank == 1 else 30))

    res = sim.simulate_steps(step, 4, model=model)
    # Each side pays for its own transfer, as in the alpha-beta model: the sender both levels, so the slower.
    assert res.finish == [pytest.approx(max(1.0 + 1.0, 10.0 + 3.0)), pytest.approx(1.0 + 1.0),
                          pytest.approx(10.0 + 3.0), 0.0]


def test_a_ring_is_as_slow_as_its_slowest_hop():
    # Ring allgather on 8 ranks: each step is gated by the hops between nodes, wherever they are.
    model = {"alpha": 1.0, "beta": 0.0, "alpha_inter": 10.0, "beta_inter": 0.0}
    for placement in ("block", "cyclic"):
        res = sim.simulate("allgather", "ring", 8, 64 * 8, model=cost.TwoLevel(4, placement=placement, **model))
        assert res.time == pytest.approx(7 * 10.0)
    assert sim.simulate("allgather", "ring", 8, 64 * 8, model=cost.TwoLevel(8, **model)).time == pytest.approx(7.0)


def test_placement_decides_which_messages_cross_nodes():
    model = {"alpha": 1.0, "beta": 0.0, "alpha_inter": 10.0, "beta_inter": 0.0}
    # Recursive doubling pairs r with r^1, r^2, r^4: with blocks of 4 only the last round crosses nodes,
    # round-robin over 2 nodes only the first.
    for placement in ("block", "cyclic"):
        res = sim.simulate("allreduce", "recursive_doubling", 8, 64,
                           model=cost.TwoLevel(4, placement=placement, gamma=0.0, **model))
        assert res.time == pytest.approx(1.0 + 1.0 + 10.0)
    assert cost.TwoLevel(3).nodes(7) == [0, 0, 0, 1, 1, 1, 2]
    assert cost.TwoLevel(3, placement="cyclic").nodes(7) == [0, 1, 2, 0, 1, 2, 0]
    explicit = cost.TwoLevel(2, placement=[1, 0, 0, 1], gamma=0.0, **model)
    res = sim.simulate("allreduce", "recursive_doubling", 4, 64, model=explicit)
    assert res.time == pytest.approx(10.0 + 10.0)  # both rounds cross: 0<->1 and 0<->2 are on different nodes


def test_model_arguments_are_checked():
    with pytest.raises(ck.InvalidArgument, match="model must be one of"):
        sim.simulate("allreduce", "ring", 4, 64, model="logp")
    with pytest.raises(ck.InvalidArgument, match="needs ranks_per_node"):
        sim.simulate("allreduce", "ring", 4, 64, model="two-level")
    with pytest.raises(ck.InvalidArgument, match="asks for the two-level model"):
        sim.simulate("allreduce", "ring", 4, 64, model="alpha-beta", ranks_per_node=2)
    with pytest.raises(ck.InvalidArgument, match="one level"):
        sim.simulate("allreduce", "ring", 4, 64, model="loggp", ranks_per_node=2)
    with pytest.raises(ck.InvalidArgument, match="cannot be given with a model instance"):
        sim.simulate("allreduce", "ring", 4, 64, model=cost.LogGP(), alpha=1.0)
    with pytest.raises(ck.InvalidArgument, match="ranks_per_node must be an int >= 1"):
        cost.TwoLevel(0)
    with pytest.raises(ck.InvalidArgument, match="o must be a non-negative"):
        cost.LogGP(o=-1)
    with pytest.raises(ck.InvalidArgument, match="placement must be one of"):
        cost.TwoLevel(2, placement="scatter")
    with pytest.raises(ck.InvalidArgument, match="placement lists 3 nodes"):
        sim.simulate("allreduce", "ring", 4, 64, model=cost.TwoLevel(2, placement=[0, 0, 1]))
    with pytest.raises(ck.InvalidArgument, match="more than ranks_per_node=2"):
        sim.simulate("allreduce", "ring", 4, 64, model=cost.TwoLevel(2, placement=[0, 0, 0, 1]))
    assert cost.simulate("allreduce", "ring", 4, 64, model="loggp").model == cost.LogGP()


def test_cost_table_simulates_under_a_model():
    text = cost.table("allreduce", 16, 1 << 20, model="loggp")
    assert "simulated under loggp" in text and "rounds" in text
    text = cost.table("allreduce", 16, 1 << 20, ranks_per_node=4)
    ring = sim.simulate("allreduce", "ring", 16, 1 << 20, ranks_per_node=4).time
    assert "ranks_per_node=4" in text and format_seconds(ring, 4) in text
    assert "TwoLevel(ranks_per_node=4" in cost.table("allreduce", 16, 1 << 20, model=cost.TwoLevel(4))


def test_the_default_model_by_name_and_bad_steps_under_loggp():
    ab = sim.simulate("allreduce", "rabenseifner", 6, 1000)
    named = sim.simulate("allreduce", "rabenseifner", 6, 1000, model="alpha-beta")
    assert named.time == ab.time and named.model is None
    with pytest.raises(sim.SimulationError, match="names rank 5; p is 2"):
        sim.simulate_steps(lambda r: [Send(5, ("in", 0, 1))], 2, model="loggp")
    with pytest.raises(sim.SimulationError, match="not a valid Transfer, Reduce or Copy"):
        sim.simulate_steps(lambda r: ["not a step"], 1, model="loggp")
    with pytest.raises(sim.SimulationError, match=r"in\[0:9\], outside the 8 elements"):
        sim.simulate_steps(lambda r: [Exchange(1 - r, ("in", 0, 9), 1 - r, ("out", 0, 9))], 2, model="loggp",
                           buffers=[{"in": 8, "out": 9, "tmp": 0}] * 2)


def test_vector_collectives_under_the_other_models():
    counts = (3, 0, 700, 5, 1)
    for coll, name in (("allgatherv", "ring"), ("gatherv", "binomial"), ("scatterv", "binomial")):
        ab = sim.simulate(coll, name, 5, counts=counts, root=2)
        for model in ("loggp", cost.TwoLevel(2)):
            other = sim.simulate(coll, name, 5, counts=counts, root=2, model=model)
            assert _counts(other) == _counts(ab) and other.time > 0


# -- crossovers in whole elements --------------------------------------------------------------------


@pytest.mark.parametrize("itemsize", [4, 8])
@pytest.mark.parametrize("collective", [c for c in algorithms.COLLECTIVES if c != "barrier"])
def test_crossovers_never_give_a_regime_narrower_than_one_element(collective, itemsize):
    # Without itemsize the empty call is a regime of its own wherever a schedule sends nothing for it
    # (allreduce: double_binary_tree for 0 B alone), a regime no call of data falls into.
    for p in range(2, 65):
        regimes = cost.crossovers(collective, p, itemsize=itemsize)
        assert regimes[0].min_bytes == 0 and regimes[-1].max_bytes is None, (p, regimes)
        for before, after in zip(regimes, regimes[1:]):
            assert before.max_bytes + 1 == after.min_bytes and before.algorithm != after.algorithm, (p, regimes)
            assert after.min_bytes % itemsize == 0, (p, regimes)
        for reg in regimes[:-1]:
            assert reg.max_bytes - reg.min_bytes + 1 >= itemsize, (p, reg)
        # Each regime names the model's winner at its first and last whole element (the last regime
        # is unbounded beyond the scan: its first element).
        for reg in regimes:
            first = max(reg.min_bytes, itemsize)
            last = first if reg.max_bytes is None else reg.max_bytes + 1 - itemsize
            for n in {first, last}:
                assert cost.best(collective, p, n)[0].algorithm == reg.algorithm, (p, reg, n)


def test_the_empty_call_joins_the_first_elements_regime():
    assert cost.predict("allreduce", "double_binary_tree", 64, 0) == 0.0  # the schedule sends nothing for it
    assert sim.simulate("allreduce", "double_binary_tree", 64, 0).rounds == 0
    by_byte = cost.crossovers("allreduce", 64)
    assert by_byte[0] == cost.Regime("double_binary_tree", 0, 0)
    regimes = cost.crossovers("allreduce", 64, itemsize=4)
    assert regimes[0].algorithm == cost.best("allreduce", 64, 4)[0].algorithm == "recursive_doubling"
    assert regimes[0].min_bytes == 0 and regimes[1].min_bytes == -(-by_byte[2].min_bytes // 4) * 4
    with pytest.raises(ck.InvalidArgument, match="itemsize must be the bytes of one element"):
        cost.crossovers("allreduce", 4, itemsize=0)


def test_the_cost_modules_examples_are_true():
    import doctest

    failed, tried = doctest.testmod(cost, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert tried >= 3 and failed == 0
