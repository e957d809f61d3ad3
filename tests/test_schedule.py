"""Unit tests for lightning_mmpp.core.schedule and lightning_mmpp.core.simulator (single process, fast)."""

from __future__ import annotations

from collections import Counter, defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_mmpp.core.kinds import Numbering, ScheduleName, SimulatorMode
from lightning_mmpp.errors import PipelineConfigError
from lightning_mmpp.core.placement import ModulePlacement, PipelineLayout
from lightning_mmpp.core.actions import Compute, Direction, Exchange, MessageKey, Phase, Schedule, Transfer
from lightning_mmpp.core.schedule import PhaseCosts, ZeroBubbleMemory, build_schedule, check_schedule_args, message_groups
from lightning_mmpp.core.simulator import DeadlockError, simulate, validate_schedule

P = ModulePlacement
FORWARD, BACKWARD = Phase.FORWARD, Phase.BACKWARD


def T(direction: Direction, src: str, dst: str, k: int, peer: int) -> Transfer:
    return Transfer(MessageKey(direction, src, dst, k), peer)

TF, TB = 1.0, 2.0


def chain(pp: int) -> PipelineLayout:
    return PipelineLayout({"a": P(pp=pp)}, {"a": []})


def two_encoders() -> PipelineLayout:
    return PipelineLayout(
        {"enc_a": P(pp=2), "enc_b": P(pp=1), "llm": P(pp=2)},
        {"enc_a": ["llm"], "enc_b": ["llm"], "llm": []},
    )


def fan_in_encoders() -> PipelineLayout:
    return PipelineLayout(
        {"vision": P(dp=2), "audio": P(dp=1), "llm": P(pp=2)},
        {"vision": ["llm"], "audio": ["llm"], "llm": []},
    )


def computes(schedule: Schedule, rank: int, module: str | None = None) -> list[tuple[str, int]]:
    return [
        (a.phase, a.microbatch)
        for a in schedule.for_rank(rank)
        if isinstance(a, Compute) and (module is None or a.module == module)
    ]


def expected_1f1b(m: int, warmup: int) -> list[tuple[str, int]]:
    order = [(FORWARD, k) for k in range(warmup)]
    for k in range(m):
        order.append((BACKWARD, k))
        if k + warmup < m:
            order.append((FORWARD, k + warmup))
    return order


def chain_cases():
    for pp in range(1, 6):
        for m in sorted({1, 2, max(1, pp - 1), pp, 2 * pp, 8}):
            yield pp, m


# --- structural checks shared by the chain and the random-DAG tests --------------------------


def check_compute_coverage(schedule: Schedule, layout: PipelineLayout) -> None:
    """Each (rank, module) forwards (and backwards) microbatches 0..m-1 once each, in order."""
    m = schedule.num_microbatches
    for rank in range(layout.world_size):
        held = {s.module for s in layout.slots(rank)}
        assert {a.module for a in schedule.for_rank(rank) if isinstance(a, Compute)} == held
        for module in held:
            seq = computes(schedule, rank, module)
            fwd = [k for phase, k in seq if phase == FORWARD]
            bwd = [k for phase, k in seq if phase == BACKWARD]
            assert fwd == list(range(m)), (rank, module, seq)
            assert bwd == ([] if schedule.forward_only else list(range(m))), (rank, module, seq)
            in_flight = 0
            for phase, _ in seq:  # a backward never precedes its own forward
                in_flight += 1 if phase == FORWARD else -1
                assert in_flight >= 0


def check_transfers(schedule: Schedule, layout: PipelineLayout) -> None:
    """Sends and recvs match one to one, exchanges pair up in order, messages are never split."""
    world = layout.world_size
    m = schedule.num_microbatches
    where: dict[tuple[int, str, Transfer], list[int]] = defaultdict(list)  # (rank, role, t) -> exchange idx
    for rank in range(world):
        for i, action in enumerate(schedule.for_rank(rank)):
            if not isinstance(action, Exchange):
                continue
            assert action.sends or action.recvs, (rank, i)
            for role, transfers in (("send", action.sends), ("recv", action.recvs)):
                for t in transfers:
                    assert 0 <= t.peer < world
                    where[(rank, role, t)].append(i)
                # all transfers of one fan-in / fan-out message sit in this one exchange
                for key, group in message_groups(transfers).items():
                    assert len({t.peer for t in group}) == len(group), (rank, key, group)
    # every transfer is posted once, and its mirror exactly once on the peer
    for (rank, role, t), idx in where.items():
        assert len(idx) == 1, (rank, role, t, idx)
        other = "recv" if role == "send" else "send"
        mirror = t.mirror(rank)
        assert len(where.get((t.peer, other, mirror), [])) == 1, (rank, role, t)

    # a message's transfers are all in one exchange (per role) on every rank
    message_at: dict[tuple[int, str, MessageKey], set[int]] = defaultdict(set)
    for (rank, role, t), (i,) in where.items():
        message_at[(rank, role, t.key)].add(i)
    assert all(len(v) == 1 for v in message_at.values()), message_at

    # exchange i on rank r pairs with exactly one exchange on each peer q, and in order:
    # the "same tick" property, which makes the lists deadlock-free under rendezvous
    pairing: dict[tuple[int, int, int], set[int]] = defaultdict(set)  # (r, i, q) -> exchanges on q
    for (rank, role, t), (i,) in where.items():
        other = "recv" if role == "send" else "send"
        mirror = t.mirror(rank)
        (j,) = where[(t.peer, other, mirror)]
        pairing[(rank, i, t.peer)].add(j)
    assert all(len(v) == 1 for v in pairing.values()), pairing
    by_pair: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    for (rank, i, q), (j,) in pairing.items():
        by_pair[(rank, q)].append((i, j))
    for pairs in by_pair.values():
        js = [j for _, j in sorted(pairs)]
        assert js == sorted(js), pairs

    # the transfers are what the layout prescribes, for every microbatch
    expected: Counter = Counter()
    for rank in range(world):
        for slot in layout.slots(rank):
            for k in range(m):
                is_sink_end = layout.is_loss_stage(slot)
                for dst, peer in layout.forward_targets(slot):
                    expected[(rank, "send", T(Direction.FORWARD, slot.module, dst, k, peer.rank))] += 1
                    if not schedule.forward_only:
                        expected[(rank, "recv", T(Direction.BACKWARD, slot.module, dst, k, peer.rank))] += 1
                for src, peer in layout.forward_sources(slot):
                    expected[(rank, "recv", T(Direction.FORWARD, src, slot.module, k, peer.rank))] += 1
                    if not schedule.forward_only:
                        expected[(rank, "send", T(Direction.BACKWARD, src, slot.module, k, peer.rank))] += 1
                assert not (is_sink_end and layout.forward_targets(slot))
    assert Counter({key: len(v) for key, v in where.items()}) == expected


def check_causality(schedule: Schedule, layout: PipelineLayout) -> None:
    """A compute runs only after the exchanges that bring its inputs (or gradients)."""
    for rank in range(layout.world_size):
        arrived: Counter = Counter()
        for action in schedule.for_rank(rank):
            if isinstance(action, Exchange):
                for t in action.recvs:
                    module = t.dst_module if t.direction is Direction.FORWARD else t.src_module
                    arrived[(t.direction, module, t.microbatch)] += 1
                continue
            slot = layout.slot(rank, action.module)
            if action.phase == FORWARD:
                need = len(layout.forward_sources(slot))
            else:
                need = len(layout.forward_targets(slot))
            direction = Direction.FORWARD if action.phase is FORWARD else Direction.BACKWARD
            assert arrived[(direction, action.module, action.microbatch)] == need, (rank, action)


# --- chains ----------------------------------------------------------------------------------


@pytest.mark.parametrize("pp, m", list(chain_cases()))
def test_chain_1f1b_order(pp, m):
    layout = chain(pp)
    schedule = build_schedule(layout, m, "1f1b")
    assert (schedule.name, schedule.num_microbatches, schedule.forward_only) == ("1f1b", m, False)
    for s in range(pp):
        warmup = min(m, pp - s)
        seq = computes(schedule, s)
        assert seq == expected_1f1b(m, warmup), (s, schedule.render(s))
        in_flight = peak = 0
        for phase, _ in seq:
            in_flight += 1 if phase == FORWARD else -1
            peak = max(peak, in_flight)
        assert peak == warmup
    check_compute_coverage(schedule, layout)
    check_transfers(schedule, layout)
    check_causality(schedule, layout)


@pytest.mark.parametrize("pp, m", list(chain_cases()))
def test_chain_gpipe_order(pp, m):
    layout = chain(pp)
    schedule = build_schedule(layout, m, "gpipe")
    for s in range(pp):
        assert computes(schedule, s) == [(FORWARD, k) for k in range(m)] + [(BACKWARD, k) for k in range(m)]
    check_compute_coverage(schedule, layout)
    check_transfers(schedule, layout)
    check_causality(schedule, layout)


@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
@pytest.mark.parametrize("pp, m", list(chain_cases()))
def test_chain_forward_only(name, pp, m):
    layout = chain(pp)
    schedule = build_schedule(layout, m, name, forward_only=True)
    assert schedule.forward_only
    for s in range(pp):
        assert computes(schedule, s) == [(FORWARD, k) for k in range(m)]
        for action in schedule.for_rank(s):
            if isinstance(action, Exchange):
                assert all(t.direction is Direction.FORWARD for t in action.sends + action.recvs)
    check_compute_coverage(schedule, layout)
    check_transfers(schedule, layout)
    check_causality(schedule, layout)
    for mode in ("rendezvous", "eager", "overlap"):
        result = simulate(schedule, layout, TF, TB, mode=mode)
        assert result.step_time == (m + pp - 1) * TF
        assert result.peak_stashed == (0,) * pp  # nothing is stashed without backward


@pytest.mark.parametrize("mode", ["rendezvous", "eager", "overlap"])
@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
@pytest.mark.parametrize("pp, m", list(chain_cases()))
def test_chain_simulated_step_time_and_stash(mode, name, pp, m):
    layout = chain(pp)
    result = simulate(build_schedule(layout, m, name), layout, TF, TB, mode=mode)
    assert result.step_time == (m + pp - 1) * (TF + TB)
    assert result.busy == (m * (TF + TB),) * pp
    assert result.bubble_fraction == pytest.approx((pp - 1) / (m + pp - 1))
    if name == "1f1b":
        assert result.peak_stashed == tuple(min(m, pp - s) for s in range(pp))
    else:
        assert result.peak_stashed == (m,) * pp


def test_separate_phase_costs_bubble_and_stash_units():
    layout = chain(2)
    # 1F1B, m=2, per-stage costs: F 1/2, fused B 4 on stage 1 only
    result = simulate(build_schedule(layout, 2), layout, lambda mod, s: 1.0 + s, lambda mod, s: 2.0 + 2 * s)
    assert result.busy == (2 * (1 + 2), 2 * (2 + 4))
    # rank 0 F0 F1 [waits for g0] B0 [waits for g1] B1; rank 1 F0 B0 F1 B1 after rank 0's F0
    assert result.step_time == 1 + 2 + 4 + 2 + 4 + 2
    assert result.bubble == result.step_time - 12
    # zero bubble: I and W costs apart; a lone W (stage 0: nothing to send upstream) costs the fused B
    zb = build_schedule(layout, 2, "zero_bubble")
    assert [str(a) for a in zb.for_rank(1) if isinstance(a, Compute)] == ["F0:a", "I0:a", "F1:a", "I1:a", "W0:a", "W1:a"]
    assert [str(a) for a in zb.for_rank(0) if isinstance(a, Compute)] == ["F0:a", "F1:a", "W0:a", "W1:a"]
    r = simulate(zb, layout, 1.0, 5.0, input_cost=2.0, weight_cost=0.5, weight_stash=0.25)
    assert r.busy == (2 * (1 + 5), 2 * (1 + 2 + 0.5))
    assert r.peak_stashed == (2, 2)
    assert r.peak_stash_units == (2, 1.25)  # rank 1 after F1: F1 whole, I0 done (W0 pending)
    # rank 0: F0 F1, its lone W0 from t=4 (rank 1's I0 ends) to 9, then W1 to 14
    assert r.step_time == 14
    assert r.bubble == 14 - 12


def test_chain_with_latency_and_per_stage_costs():
    layout = chain(3)
    schedule = build_schedule(layout, 6)
    base = simulate(schedule, layout, lambda mod, s: 1.0 + s, lambda mod, s: 2.0 * (1.0 + s))
    assert base.busy == (18.0, 36.0, 54.0)
    slow = simulate(schedule, layout, lambda mod, s: 1.0 + s, lambda mod, s: 2.0 * (1.0 + s), latency=0.5)
    assert slow.step_time > base.step_time


def test_render_and_str():
    schedule = build_schedule(chain(2), 2)
    assert schedule.render(0).split()[0] == "F0:a"
    assert "a->a#0@1" in schedule.render(0)
    assert str(Compute(BACKWARD, "llm", 3)) == "B3:llm"
    assert str(T(Direction.BACKWARD, "vision", "llm", 1, 2)) == "vision<-llm#1@2"


def test_schedule_is_a_pure_function():
    layout = two_encoders()
    for name in ("1f1b", "gpipe"):
        for numbering in ("alap", "asap"):
            a = build_schedule(layout, 5, name, numbering=numbering)
            b = build_schedule(two_encoders(), 5, name, numbering=numbering)
            assert a == b


@pytest.mark.parametrize(
    "args, match",
    [
        ((0, "1f1b", "alap"), "num_microbatches=0"),
        ((2.0, "1f1b", "alap"), "num_microbatches=2.0"),
        ((True, "1f1b", "alap"), "num_microbatches=True"),
        ((2, "interleaved", "alap"), "unknown schedule 'interleaved'"),
        ((2, "1f1b", "middle"), "unknown stage numbering 'middle'"),
    ],
)
def test_bad_arguments(args, match):
    m, name, numbering = args
    with pytest.raises(PipelineConfigError, match=match):
        build_schedule(chain(2), m, name, numbering=numbering)


def test_schedule_names_are_enums_spelled_as_strings():
    """``"1f1b"`` and ``ScheduleName.ONE_F_ONE_B`` are one argument; parsing names the choices."""
    layout = two_encoders()
    for name in ScheduleName:
        assert build_schedule(layout, 4, name.value) == build_schedule(layout, 4, name)
        assert build_schedule(layout, 4, name).name is name
    assert check_schedule_args("zero_bubble", 2, "asap") == (ScheduleName.ZERO_BUBBLE, Numbering.ASAP)
    assert check_schedule_args("gpipe", 2) == (ScheduleName.GPIPE, Numbering.ALAP)  # the one default numbering
    assert build_schedule(layout, 5) == build_schedule(layout, 5, "1f1b", numbering="alap")
    assert build_schedule(layout, 5) != build_schedule(layout, 5, numbering="asap")  # they differ on this layout
    assert f"{ScheduleName.ONE_F_ONE_B}" == str(ScheduleName.ONE_F_ONE_B) == "1f1b"
    assert repr(ScheduleName.ZERO_BUBBLE) == "'zero_bubble'"  # messages and generated code quote the spelling
    with pytest.raises(PipelineConfigError, match=r"choose one of \['1f1b', 'gpipe', 'zero_bubble', 'interleaved_1f1b', 'zbv'\]"):
        check_schedule_args("1F1B", 2)


# --- the simulator rejects broken lists ------------------------------------------------------


def test_simulator_detects_both_ranks_receiving_first():
    layout = chain(2)
    to_1 = T(Direction.FORWARD, "a", "a", 0, 1)
    to_0 = T(Direction.FORWARD, "a", "a", 0, 0)
    actions = (
        (Exchange((), (to_1,)), Exchange((to_1,), ())),  # rank 0: recv from 1, then send to 1
        (Exchange((), (to_0,)), Exchange((to_0,), ())),  # rank 1: recv from 0, then send to 0
    )
    schedule = Schedule("1f1b", 1, True, actions)
    for mode in ("rendezvous", "eager"):
        with pytest.raises(DeadlockError, match="deadlock"):
            simulate(schedule, layout, mode=mode)
    # overlap posts a receive and goes on (no compute here consumes it): the sends follow
    assert simulate(schedule, layout, mode="overlap").step_time == 0.0


def test_simulator_detects_send_before_recv_cycle_only_in_rendezvous():
    # both ranks send first, then receive: fine with buffered (eager) sends, a deadlock when a
    # send waits for its receive
    layout = chain(2)
    to_1 = T(Direction.FORWARD, "a", "a", 0, 1)
    to_0 = T(Direction.FORWARD, "a", "a", 0, 0)
    actions = (
        (Exchange((to_1,), ()), Exchange((), (to_1,))),
        (Exchange((to_0,), ()), Exchange((), (to_0,))),
    )
    schedule = Schedule("1f1b", 1, True, actions)
    with pytest.raises(DeadlockError, match="deadlock"):
        simulate(schedule, layout, mode="rendezvous")
    assert simulate(schedule, layout, mode="eager").step_time == 0.0


def test_simulator_detects_a_missing_other_end():
    layout = chain(2)
    actions = (
        (Compute(FORWARD, "a", 0), Exchange((T(Direction.FORWARD, "a", "a", 0, 1),), ())),
        (Compute(FORWARD, "a", 0),),  # never receives
    )
    schedule = Schedule("1f1b", 1, True, actions)
    for mode in ("rendezvous", "eager", "overlap"):
        with pytest.raises(DeadlockError, match="never posts the other end"):
            simulate(schedule, layout, mode=mode)


def test_simulator_detects_a_mismatched_microbatch():
    layout = chain(2)
    actions = (
        (Exchange((T(Direction.FORWARD, "a", "a", 0, 1),), ()),),
        (Exchange((), (T(Direction.FORWARD, "a", "a", 1, 0),)),),
    )
    with pytest.raises(DeadlockError, match="never posts the other end"):
        simulate(Schedule("1f1b", 1, True, actions), layout)


def test_simulator_rejects_a_transfer_posted_twice():
    # regression: a duplicated transfer used to surface as a bare KeyError
    layout = chain(2)
    to_1 = T(Direction.FORWARD, "a", "a", 0, 1)
    to_0 = T(Direction.FORWARD, "a", "a", 0, 0)
    actions = (
        (Exchange((to_1,), ()), Exchange((to_1,), ())),
        (Exchange((), (to_0,)), Exchange((), (to_0,))),
    )
    with pytest.raises(DeadlockError, match="twice"):
        simulate(Schedule("1f1b", 1, True, actions), layout)


def test_simulator_unknown_mode():
    layout = chain(1)
    with pytest.raises(PipelineConfigError, match=r"unknown simulator mode 'async'; choose one of \['rendezvous', 'eager', 'overlap'\]"):
        simulate(build_schedule(layout, 1), layout, mode="async")
    strict = simulate(build_schedule(layout, 1), layout, mode=SimulatorMode.RENDEZVOUS)
    assert strict == simulate(build_schedule(layout, 1), layout, mode="rendezvous")


# --- multi-module layouts --------------------------------------------------------------------


def test_two_encoders_alap_warmup():
    # enc_a (pp=2) and enc_b (pp=1) -> llm (pp=2): depth 4; ASAP puts enc_b at 0, ALAP at 1
    layout = two_encoders()
    assert layout.depth == 4
    m = 8
    for numbering, enc_b_limit in (("asap", 4), ("alap", 3)):
        schedule = build_schedule(layout, m, "1f1b", numbering=numbering)
        rank_b = layout.rank_of("enc_b", 0, 0)
        assert computes(schedule, rank_b) == expected_1f1b(m, enc_b_limit), numbering
        for module, stage, limit in (("enc_a", 0, 4), ("enc_a", 1, 3), ("llm", 0, 2), ("llm", 1, 1)):
            assert computes(schedule, layout.rank_of(module, stage, 0)) == expected_1f1b(m, limit)
        result = simulate(schedule, layout, TF, TB)
        assert result.peak_stashed[rank_b] == enc_b_limit


def test_fan_in_message_in_one_exchange():
    layout = fan_in_encoders()  # vision dp=2 on ranks 0-1, audio rank 2, llm ranks 3-4
    schedule = build_schedule(layout, 4)
    llm0 = layout.rank_of("llm", 0, 0)
    first = next(a for a in schedule.for_rank(llm0) if isinstance(a, Exchange))
    assert {(t.src_module, t.peer) for t in first.recvs} == {("vision", 0), ("vision", 1), ("audio", 2)}
    check_transfers(schedule, layout)
    simulate(schedule, layout, mode="rendezvous")


def test_fan_out_and_colocation():
    # a (dp=1) fans out to b and c (dp=2, colocated on ranks 1-2), which both feed d (dp=1)
    layout = PipelineLayout(
        {"a": P(), "b": P(dp=2, rank_offset=1), "c": P(dp=2, rank_offset=1), "d": P(pp=2, rank_offset=3)},
        {"a": ["b", "c"], "b": ["d"], "c": ["d"], "d": []},
    )
    for name in ("1f1b", "gpipe"):
        schedule = build_schedule(layout, 4, name)
        check_compute_coverage(schedule, layout)
        check_transfers(schedule, layout)
        check_causality(schedule, layout)
        first = next(a for a in schedule.for_rank(0) if isinstance(a, Exchange))
        assert sorted((t.dst_module, t.peer) for t in first.sends) == [("b", 1), ("b", 2), ("c", 1), ("c", 2)]
        for mode in ("rendezvous", "eager", "overlap"):
            simulate(schedule, layout, mode=mode)


def test_colocated_modules_send_to_themselves():
    layout = PipelineLayout({"enc": P(rank_offset=0), "llm": P(rank_offset=0)}, {"enc": ["llm"], "llm": []})
    assert layout.world_size == 1
    schedule = build_schedule(layout, 3)
    sends = [t for a in schedule.for_rank(0) if isinstance(a, Exchange) for t in a.sends]
    assert T(Direction.FORWARD, "enc", "llm", 0, 0) in sends
    assert computes(schedule, 0, "enc") == expected_1f1b(3, 2)
    assert computes(schedule, 0, "llm") == expected_1f1b(3, 1)
    check_transfers(schedule, layout)
    for mode in ("rendezvous", "eager", "overlap"):
        simulate(schedule, layout, mode=mode)


def test_colocated_pipelined_modules_wrap_around():
    # enc and llm (pp=2 each) on ranks 0-1: enc stage 1 (rank 1) feeds llm stage 0 (rank 0)
    layout = PipelineLayout(
        {"enc": P(pp=2, rank_offset=0), "llm": P(pp=2, rank_offset=0)}, {"enc": ["llm"], "llm": []}
    )
    for name in ("1f1b", "gpipe"):
        schedule = build_schedule(layout, 3, name)
        sends = [t for a in schedule.for_rank(1) if isinstance(a, Exchange) for t in a.sends]
        assert T(Direction.FORWARD, "enc", "llm", 0, 0) in sends
        check_compute_coverage(schedule, layout)
        check_transfers(schedule, layout)
        check_causality(schedule, layout)
        for mode in ("rendezvous", "eager", "overlap"):
            simulate(schedule, layout, mode=mode)


# --- property test on random DAGs ------------------------------------------------------------


@st.composite
def random_layouts(draw):
    n = draw(st.integers(2, 6))
    names = [f"m{i}" for i in range(n)]
    topology = {m: [names[j] for j in range(i + 1, n) if draw(st.booleans())] for i, m in enumerate(names)}
    groups: list[list[str]] = []  # colocated modules share pp, dp and rank_offset
    sizes: list[tuple[int, int]] = []
    for name in names:
        if groups and draw(st.integers(0, 3)) == 0:
            g = draw(st.integers(0, len(groups) - 1))
            groups[g].append(name)
        else:
            groups.append([name])
            sizes.append((draw(st.integers(1, 3)), draw(st.sampled_from([1, 2, 4]))))
    order = draw(st.permutations(range(len(groups))))  # rank order of the groups
    placements = {}
    cursor = 0
    for g in order:
        pp, dp = sizes[g]
        for name in groups[g]:
            placements[name] = P(pp=pp, dp=dp, rank_offset=cursor)
        cursor += pp * dp
    return placements, topology


@settings(max_examples=60, deadline=None, database=None)
@given(
    random_layouts(),
    st.integers(1, 9),
    st.sampled_from(["1f1b", "gpipe"]),
    st.sampled_from(["alap", "asap"]),
    st.booleans(),
)
def test_random_dags(data, m, name, numbering, forward_only):
    placements, topology = data
    layout = PipelineLayout(placements, topology)
    schedule = build_schedule(layout, m, name, forward_only=forward_only, numbering=numbering)
    validate_schedule(schedule, layout)
    check_compute_coverage(schedule, layout)
    check_transfers(schedule, layout)
    check_causality(schedule, layout)
    strict = simulate(schedule, layout, TF, TB, mode="rendezvous")
    eager = simulate(schedule, layout, TF, TB, mode="eager")
    assert eager.step_time <= strict.step_time + 1e-9
    assert strict.busy == eager.busy
    for rank in range(layout.world_size):
        work = sum(1 for a in schedule.for_rank(rank) if isinstance(a, Compute))
        assert work == len(layout.slots(rank)) * m * (1 if forward_only else 2)
    if forward_only:
        assert strict.peak_stashed == (0,) * layout.world_size
        return

    assert strict.peak_stashed == eager.peak_stashed  # the stash depends on the order alone

    def bound(rank: int, numbering: str) -> int:
        return sum(
            min(m, layout.depth - layout.stage_index(s.module, s.stage, numbering)) for s in layout.slots(rank)
        )

    if name == "1f1b":
        for rank in range(layout.world_size):
            assert strict.peak_stashed[rank] <= bound(rank, numbering)
        other = "asap" if numbering == "alap" else "alap"
        other_result = simulate(build_schedule(layout, m, name, numbering=other), layout, TF, TB)
        alap, asap = (strict, other_result) if numbering == "alap" else (other_result, strict)
        assert sum(alap.peak_stashed) <= sum(asap.peak_stashed)
        gpipe = simulate(build_schedule(layout, m, "gpipe"), layout, TF, TB)
        assert sum(strict.peak_stashed) <= sum(gpipe.peak_stashed)
    else:
        for rank in range(layout.world_size):
            assert strict.peak_stashed[rank] <= m * len(layout.slots(rank))


@settings(max_examples=40, deadline=None, database=None)
@given(random_layouts(), st.integers(1, 9), st.sampled_from(["1f1b", "gpipe"]), st.data())
def test_random_dags_with_frozen_modules(data, m, name, draw):
    """Frozen modules with nothing trainable upstream: forwards only, never a gradient for them."""
    placements, topology = data
    layout = PipelineLayout(placements, topology)
    frozen = {mod for mod in layout.modules if draw.draw(st.booleans())}
    no_grad = layout.no_backward_modules(frozen)
    schedule = build_schedule(layout, m, name, no_backward_modules=no_grad)
    validate_schedule(schedule, layout, no_grad)
    simulate(schedule, layout, TF, TB, mode="rendezvous")
    simulate(schedule, layout, TF, TB, mode="eager")
    for rank in range(layout.world_size):
        for slot in layout.slots(rank):
            seq = computes(schedule, rank, slot.module)
            assert [k for p, k in seq if p == FORWARD] == list(range(m))
            backwards = [k for p, k in seq if p == BACKWARD]
            assert backwards == ([] if slot.module in no_grad else list(range(m)))
        for action in schedule.for_rank(rank):
            if isinstance(action, Exchange):
                for t in action.sends + action.recvs:
                    assert not (t.direction is Direction.BACKWARD and t.src_module in no_grad)


# --- zero bubble ---------------------------------------------------------------------------------


def check_zero_bubble(schedule: Schedule, layout: PipelineLayout, no_backward: frozenset[str],
                      memory: ZeroBubbleMemory, numbering: str = "alap") -> None:
    """F, I, W of every microbatch once each, in dependency order, within the memory rule."""
    m = schedule.num_microbatches
    for rank in range(layout.world_size):
        for slot in layout.slots(rank):
            seq = computes(schedule, rank, slot.module)
            assert sorted(k for p, k in seq if p is Phase.FORWARD) == list(range(m))
            assert not [p for p, _ in seq if p is BACKWARD]  # never a fused backward
            inputs = [k for p, k in seq if p is Phase.BACKWARD_INPUT]
            weights = [k for p, k in seq if p is Phase.BACKWARD_WEIGHT]
            if slot.module in no_backward:
                assert inputs == weights == [], (rank, slot)
                continue
            assert sorted(weights) == list(range(m)), (rank, slot, seq)
            has_input = layout.sends_input_gradients(slot, no_backward)
            assert sorted(inputs) == (list(range(m)) if has_input else []), (rank, slot, seq)
            position = {(p, k): i for i, (p, k) in enumerate(seq)}
            for k in range(m):
                assert position[(FORWARD, k)] < position[(Phase.BACKWARD_WEIGHT, k)]
                if has_input:
                    assert position[(FORWARD, k)] < position[(Phase.BACKWARD_INPUT, k)]
                    assert position[(Phase.BACKWARD_INPUT, k)] < position[(Phase.BACKWARD_WEIGHT, k)]
            # the memory rule, after every forward: the unit's cap
            own = memory.extra + layout.depth - layout.stage_index(slot.module, slot.stage, numbering)
            cap = memory.extra + layout.depth if memory.bound == "max" else own
            for held in _held_after_forwards(seq, memory.weight_fraction, has_input):
                assert held <= cap + 1e-9, (rank, slot, seq)
    if memory.bound == "max":  # and no rank beyond 1F1B's fullest rank
        rank_cap = max(
            sum(min(m, memory.extra + layout.depth - layout.stage_index(s.module, s.stage, numbering))
                for s in layout.slots(r) if s.module not in no_backward)
            for r in range(layout.world_size)
        )
        for rank in range(layout.world_size):
            assert _rank_peak(schedule, layout, rank, no_backward, memory.weight_fraction) <= rank_cap + 1e-9, rank


def _held_after_forwards(seq, fraction: float, has_input: bool) -> list[float]:
    full = deferred = 0
    out = []
    for p, _ in seq:
        if p is FORWARD:
            full += 1
            out.append(full + fraction * deferred)
        elif p is Phase.BACKWARD_INPUT:
            full, deferred = full - 1, deferred + 1
        elif has_input:
            deferred -= 1
        else:
            full -= 1
    return out


def _rank_peak(schedule: Schedule, layout: PipelineLayout, rank: int, no_backward, fraction: float) -> float:
    """The most a rank holds at once, over its trained units, along its action list."""
    has_input = {s.module: layout.sends_input_gradients(s, no_backward) for s in layout.slots(rank)}
    full: Counter = Counter()
    deferred: Counter = Counter()
    peak = 0.0
    for a in schedule.for_rank(rank):
        if not isinstance(a, Compute) or a.module in no_backward:
            continue
        if a.phase is FORWARD:
            full[a.module] += 1
        elif a.phase is Phase.BACKWARD_INPUT:
            full[a.module] -= 1
            deferred[a.module] += 1
        elif has_input[a.module]:
            deferred[a.module] -= 1
        else:
            full[a.module] -= 1
        peak = max(peak, sum(full.values()) + fraction * sum(deferred.values()))
    return peak


@settings(max_examples=80, deadline=None, database=None)
@given(
    random_layouts(),
    st.integers(1, 9),
    st.sampled_from([ZeroBubbleMemory(), ZeroBubbleMemory("stage"), ZeroBubbleMemory("max", 0.5, 1),
                     ZeroBubbleMemory("stage", 0.0)]),
    st.sampled_from(["alap", "asap"]),
    st.data(),
)
def test_random_dags_zero_bubble(data, m, memory, numbering, draw):
    placements, topology = data
    layout = PipelineLayout(placements, topology)
    frozen = {mod for mod in layout.modules if draw.draw(st.booleans())}
    no_backward = layout.no_backward_modules(frozen)
    costs = draw.draw(st.sampled_from([PhaseCosts(), PhaseCosts(1.0, 2.0, 0.5), PhaseCosts(3.0, 1.0, 1.0)]))
    schedule = build_schedule(layout, m, "zero_bubble", numbering=numbering, no_backward_modules=no_backward,
                              memory=memory, costs=costs)
    assert (schedule.name, schedule.forward_only) == ("zero_bubble", False)
    validate_schedule(schedule, layout, no_backward)  # coverage, order, transfers, causality, no deadlock
    check_zero_bubble(schedule, layout, no_backward, memory, numbering)
    sent = [t for r in range(layout.world_size) for a in schedule.for_rank(r) if isinstance(a, Exchange) for t in a.sends]
    assert not [t for t in sent if t.direction is Direction.BACKWARD and t.src_module in no_backward]
    strict = simulate(schedule, layout, TF, TB, mode="rendezvous")
    eager = simulate(schedule, layout, TF, TB, mode="eager")
    assert eager.step_time <= strict.step_time + 1e-9
    assert strict.peak_stashed == eager.peak_stashed
    # same work as 1F1B: I + W cost the fused backward
    one_f_one_b = simulate(build_schedule(layout, m, "1f1b", numbering=numbering, no_backward_modules=no_backward),
                           layout, TF, TB, mode="eager")
    assert eager.busy == pytest.approx(one_f_one_b.busy)


def test_zero_bubble_chain_removes_two_thirds_of_the_bubble():
    # ZB-H1 on a 4-stage chain, F = I = W = 1 (fused B = 2), m = 8: step 27 against 1F1B's 33,
    # bubble (step - busiest rank's compute) 3 against 9
    layout = chain(4)
    zb = simulate(build_schedule(layout, 8, "zero_bubble"), layout, 1.0, 2.0, mode="eager")
    base = simulate(build_schedule(layout, 8, "1f1b"), layout, 1.0, 2.0, mode="eager")
    assert (zb.step_time, zb.bubble, base.step_time, base.bubble) == (27, 3, 33, 9)
    assert zb.peak_stashed == (4, 4, 4, 4)  # 1F1B's busiest rank holds 4 too
    stage = simulate(build_schedule(layout, 8, "zero_bubble", memory=ZeroBubbleMemory("stage")), layout, 1, 2,
                     mode="eager")
    assert stage.peak_stashed == base.peak_stashed == (4, 3, 2, 1)
    assert base.step_time > stage.step_time > zb.step_time


def test_zero_bubble_forward_only_and_bad_memory():
    layout = chain(3)
    assert build_schedule(layout, 4, "zero_bubble", forward_only=True).actions == \
        build_schedule(layout, 4, "gpipe", forward_only=True).actions
    with pytest.raises(PipelineConfigError, match="bound='none'"):
        ZeroBubbleMemory("none")
    with pytest.raises(PipelineConfigError, match="weight_fraction=2"):
        ZeroBubbleMemory(weight_fraction=2)
    with pytest.raises(PipelineConfigError, match="every cost must be > 0"):
        PhaseCosts(input=0)
    with pytest.raises(PipelineConfigError, match="every cost must be > 0"):
        PhaseCosts(lone_weight=-1.0)
    assert PhaseCosts(input=2.0, weight=0.5).lone_weight_cost == 2.5
    # the planning costs shape the order, never the correctness
    layout = two_encoders()
    cheap_w = build_schedule(layout, 6, "zero_bubble", costs=PhaseCosts(weight=0.25, lone_weight=0.25))
    validate_schedule(cheap_w, layout)


@pytest.mark.parametrize("name", ["1f1b", "gpipe", "zero_bubble"])
def test_tp_groups_are_scheduled_through_their_leads(name):
    """The pipeline plans one unit per tp group (its lead); the other ranks' lists stay empty
    (they run their lead's), and the simulator accepts the result."""
    from lightning_mmpp.core.simulator import validate_schedule

    layout = PipelineLayout(
        {"enc": ModulePlacement(pp=1, dp=2), "llm": ModulePlacement(pp=2, tp=2)}, {"enc": ["llm"], "llm": []}
    )
    schedule = build_schedule(layout, 4, name)
    assert [bool(schedule.for_rank(r)) for r in range(6)] == [True, True, True, False, True, False]
    assert {t.peer for a in schedule.for_rank(0) if isinstance(a, Exchange) for t in a.sends} == {2}
    validate_schedule(schedule, layout)


def test_overlap_mode_waits_at_the_consumer_not_at_the_exchange():
    # encoders -> LM, m=2: the LM's rank receives microbatch 1's inputs before its B0. The runtime
    # (overlap) only posts that receive and runs B0 at once; eager waits there for the encoders' F1
    layout = PipelineLayout({"image": ModulePlacement(1, 1, 0), "audio": ModulePlacement(1, 2, 1),
                             "lm": ModulePlacement(1, 1, 3)}, {"image": ["lm"], "audio": ["lm"], "lm": []})
    schedule = build_schedule(layout, 2, "1f1b")
    forward = lambda module, stage: {"image": 10.0, "audio": 16.0, "lm": 8.0}[module]  # noqa: E731
    backward = lambda module, stage: 2 * forward(module, stage)  # noqa: E731

    def starts(mode):
        result = simulate(schedule, layout, forward, backward, mode=mode)
        return {(r, str(a)): s for r, s, _e, a in result.computes}, result.step_time

    eager, eager_step = starts("eager")
    overlap, overlap_step = starts("overlap")
    assert eager[(3, "B0:lm")] == 32.0  # after audio's F1 (16 + 16)
    assert overlap[(3, "B0:lm")] == 24.0  # right after its F0 (16 + 8)
    assert overlap[(3, "F1:lm")] == 40.0  # its inputs came at 32; B0 ran until 40
    # audio's B0 waits for the LM's B0 (ends 40), its B1 for the LM's B1 (48-64): 40 + 32 + 32
    assert (overlap_step, eager_step) == (104.0, 112.0)
    # the deadlock check is still the strict mode's: overlap accepts what rendezvous accepts
    simulate(schedule, layout, forward, backward, mode="rendezvous")
