"""Ranks sharing their host's cores: the processor-sharing clock and the planner's use of it."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from lightning_mmpp.core.actions import Phase
from lightning_mmpp.core.host_sharing import Work, simulate_shared
from lightning_mmpp.core.placement import ModulePlacement, PipelineLayout
from lightning_mmpp.core.schedule import build_schedule
from lightning_mmpp.core.simulator import DeadlockError, simulate
from lightning_mmpp.plan import Calibration, plan_placements
from lightning_mmpp.plan.costs import CostModel
from lightning_mmpp.plan.sharing import shared_step_seconds, shares_cores
from tests.test_plan import encoders_and_lm, heterogeneous

TOPOLOGY = {"a": ["c"], "b": ["c"], "c": []}


def _dag() -> PipelineLayout:
    return PipelineLayout({"a": ModulePlacement(rank_offset=0), "b": ModulePlacement(rank_offset=1),
                           "c": ModulePlacement(pp=2, rank_offset=2)}, TOPOLOGY)


def test_with_a_core_per_rank_the_shared_clock_is_the_simulator_clock():
    # the simulator's overlap clock (the runtime's): on the fan-in layout, the LM's rank runs its
    # B0 before the next microbatch's inputs arrive, which the eager clock waits for
    fan_in = PipelineLayout({"a": ModulePlacement(rank_offset=0), "b": ModulePlacement(dp=2, rank_offset=1),
                             "c": ModulePlacement(rank_offset=3)}, TOPOLOGY)

    costs = {"a": 1.0, "b": 1.5, "c": 2.0}

    def forward(module, stage):
        return costs[module] + 0.25 * stage

    for layout, name, encoder_b in itertools.product((_dag(), fan_in), ("1f1b", "gpipe"), (1.5, 3.0)):
        costs["b"] = encoder_b
        schedule = build_schedule(layout, 8, name)
        reference = simulate(schedule, layout, forward, lambda m, s: 2 * forward(m, s), mode="overlap")
        if layout is fan_in and name == "1f1b" and encoder_b == 3.0:  # the case the two clocks differ on
            assert reference.step_time < simulate(schedule, layout, forward, lambda m, s: 2 * forward(m, s),
                                                  mode="eager").step_time

        def work(rank, action, stage):
            seconds = forward(action.module, stage) * (1 if action.phase is Phase.FORWARD else 2)
            return Work(0.25 * seconds, 0.75 * seconds)

        for cores in (4, 100):
            timing = simulate_shared(schedule, layout, work, cores=cores, ranks_per_host=4)
            assert timing.step_time == pytest.approx(reference.step_time)
        # one core for all four ranks: never less than the core work over one core, nor the step alone
        busy = sum(0.75 * (end - start) for _, start, end, _ in reference.computes)
        one = simulate_shared(schedule, layout, work, cores=1, ranks_per_host=4).step_time
        assert one >= busy - 1e-9 and one > reference.step_time
        # four hosts of one rank each, one core each: no sharing
        assert simulate_shared(schedule, layout, work, cores=1, ranks_per_host=1).step_time == \
            pytest.approx(reference.step_time)


def test_ranks_computing_at_once_share_the_cores_syncs_run_beside_and_the_optimizer_after():
    layout = PipelineLayout({"a": ModulePlacement(dp=4, rank_offset=0)}, {"a": []})
    schedule = build_schedule(layout, 1, "1f1b")
    # four ranks, two cores: every forward and backward (1 s of core work) takes 2 s; the sync
    # waits 0.5 s; the optimizer's core second, again four at once, takes 2 s
    timing = simulate_shared(schedule, layout, lambda r, a, s: Work(0.0, 1.0), cores=2, ranks_per_host=4,
                             syncs={(r, "a"): Work(0.5, 0.0) for r in range(4)},
                             finals={r: Work(0.0, 1.0) for r in range(4)})
    assert timing.actions_end == (4.0,) * 4 and timing.step_time == pytest.approx(6.5)
    # a part that waits is never slowed: 1 s of waiting and 1 s of core work, four ranks on two cores
    waits = simulate_shared(schedule, layout, lambda r, a, s: Work(1.0, 1.0), cores=2, ranks_per_host=4)
    assert waits.step_time == pytest.approx(2 * (1.0 + 2.0))
    with pytest.raises(ValueError, match="cores"):
        simulate_shared(schedule, layout, lambda r, a, s: Work(), cores=0, ranks_per_host=4)
    # a piece a tp group of 2 runs in lockstep needs 2 cores: on 2 cores beside one more rank's,
    # all three run at 2/3 speed
    two = PipelineLayout({"a": ModulePlacement(dp=2, rank_offset=0)}, {"a": []})
    pair = build_schedule(two, 1, "1f1b")
    grouped = simulate_shared(pair, two, lambda r, a, s: Work(0.0, 1.0, ranks=2 if r == 0 else 1), cores=2,
                              ranks_per_host=2)
    assert grouped.actions_end == (pytest.approx(3.0), pytest.approx(3.0))
    dag = _dag()
    chain = build_schedule(dag, 2, "1f1b")
    swapped = list(chain.actions)
    swapped[0] = tuple(reversed(chain.actions[0]))  # rank 0 waits for gradients before sending activations
    with pytest.raises(DeadlockError):
        simulate_shared(replace(chain, actions=tuple(swapped)), dag, lambda r, a, s: Work(0.0, 1.0), cores=2,
                        ranks_per_host=4)


@pytest.mark.parametrize("name", ["1f1b", "gpipe", "zero_bubble"])
def test_a_blocking_sync_delays_the_gradients_its_piece_sends_a_trailing_one_does_not(name):
    """A sharded stage on gloo reduce-scatters inside its last gradient piece: under 1F1B and
    GPipe (a fused B) the encoders' last backwards wait for it; under zero_bubble the piece is
    the last W, and the gradients went upstream with the I before it. The same sum run beside
    the rank's later actions (an unsharded stage's all-reduce) delays nothing upstream. The
    shared clock with a core per rank agrees with the simulator."""
    layout = _dag()  # a, b -> c (pp 2): c's first stage sends the encoders their gradients
    schedule = build_schedule(layout, 4, name)
    c0 = layout.rank_of("c", 0, 0)

    def forward(module, stage):
        return {"a": 1.0, "b": 1.5, "c": 2.0}[module]

    def backward(module, stage):
        return 2 * forward(module, stage)

    def blocking(module, stage):
        return 3.0 if (module, stage) == ("c", 0) else 0.0

    def a_done(result):
        return max(end for _, _, end, action in result.computes if action.module == "a")

    plain = simulate(schedule, layout, forward, backward, mode="overlap")
    inside = simulate(schedule, layout, forward, backward, mode="overlap", blocking_sync_cost=blocking)
    pieces = [(start, end) for rank, start, end, action in inside.computes if rank == c0]
    assert pieces[-1][1] - pieces[-1][0] == pytest.approx(3.0 + (2.0 if name == "zero_bubble" else 4.0))
    if name == "zero_bubble":
        assert a_done(inside) == pytest.approx(a_done(plain))
        return
    assert a_done(inside) == pytest.approx(a_done(plain) + 3.0)
    assert inside.step_time == pytest.approx(plain.step_time + 3.0)

    def work(rank, action, stage):
        seconds = forward(action.module, stage) if action.phase is Phase.FORWARD else backward(action.module, stage)
        return Work(0.0, seconds)

    shared = simulate_shared(schedule, layout, work, cores=4, ranks_per_host=4,
                             blocking_syncs={(c0, "c"): Work(0.0, 3.0)})
    assert shared.step_time == pytest.approx(inside.step_time)
    trailing = simulate_shared(schedule, layout, work, cores=4, ranks_per_host=4, syncs={(c0, "c"): Work(0.0, 3.0)})
    assert trailing.step_time == pytest.approx(plain.step_time)


def test_a_rank_steps_its_optimizer_only_after_every_rank_ended_its_pipeline():
    """The step's metrics sum joins every rank before Lightning steps the optimizer: a rank whose
    actions end early (the sink, its gradients sent) starts its final piece at the last rank's end."""
    layout = PipelineLayout({"enc": ModulePlacement(rank_offset=0), "lm": ModulePlacement(rank_offset=1)},
                            {"enc": ["lm"], "lm": []})
    schedule = build_schedule(layout, 1, "1f1b")
    # enc: forward 1, backward 4 (after lm's); lm: forward 1, backward 1, then a 3 s optimizer step
    seconds = {("enc", True): 1.0, ("enc", False): 4.0, ("lm", True): 1.0, ("lm", False): 1.0}
    timing = simulate_shared(schedule, layout, lambda r, a, s: Work(seconds[(a.module, a.phase is Phase.FORWARD)], 0.0),
                             cores=2, ranks_per_host=2, finals={0: Work(0.5, 0.0), 1: Work(3.0, 0.0)})
    assert timing.actions_end == (pytest.approx(7.0), pytest.approx(3.0))
    assert timing.finish == (pytest.approx(7.5), pytest.approx(10.0)) and timing.step_time == pytest.approx(10.0)


def test_the_search_starts_the_optimizer_after_the_last_rank_pipeline():
    """The same rule in the search's own clock: the sink's rank holds a big optimizer step and
    ends its pipeline before the encoder's rank; the step is the encoder's last backward plus it."""
    from lightning_mmpp.plan import LayerProfile, ModelProfile, ModuleProfile

    profile = ModelProfile(
        modules={"enc": ModuleProfile([LayerProfile("0", 0.010, 0.040, param_bytes=1024)]),
                 "lm": ModuleProfile([LayerProfile("0", 0.010, 0.010, param_bytes=10**8)])},
        topology={"enc": ["lm"], "lm": []}, profile_batch_size=8, bandwidth_bytes_per_s=1e12)
    cal = Calibration(world_size=2, optimizer_s_per_byte=2e-10)  # lm's step: 20 ms; nothing else charged
    plans = plan_placements(profile, 2, top_k=20, calibration=cal, num_microbatches=1, allow_shard=False)
    split = [p for p in plans if p.describe().startswith("enc 1x1 @0 | lm 1x1 @1")]
    assert split, [p.describe() for p in plans]
    # enc forward, lm forward, lm backward, enc backward in turn; then lm's optimizer
    assert split[0].step_time_s == pytest.approx(0.010 + 0.010 + 0.010 + 0.040 + 0.020)


def _computing(profile, share: float = 1.0):
    """``profile`` with every layer keeping a core busy for ``share`` of its time."""
    for module in profile.modules.values():
        for layer in module.layers:
            layer.cpu_share = share
    return profile


def _cal(host_cores: int, world_size: int = 4) -> Calibration:
    return Calibration(world_size=world_size, action_s=1e-4, message_s=2e-4, step_s=1e-3, p2p_bandwidth=1e9,
                       allreduce_latency_s=1e-4, allreduce_bandwidth=2e9, optimizer_s_per_byte=1e-10,
                       host_cores=host_cores)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zero_bubble"])
def test_the_planner_re_times_plans_whose_ranks_outnumber_the_cores(schedule):
    profile = _computing(encoders_and_lm())
    alone = plan_placements(profile, 4, schedules=[schedule], top_k=6, calibration=_cal(host_cores=4))
    assert not shares_cores(replace(profile, calibration=_cal(4)), 4)
    equal_dp = 0
    for plan in alone:
        # a core per rank: the shared clock gives the search's own prediction where every module
        # has one dp (the search times replicas as one; where a module's replicas feed another's
        # fewer, the lists of the whole layout, which the shared clock times, order a little
        # differently)
        cost = CostModel(replace(profile, calibration=_cal(4)), plan.placements, plan.num_microbatches)
        seconds = shared_step_seconds(replace(profile, calibration=_cal(4)), plan.placements, plan.num_microbatches,
                                      plan.schedule, cost, frozenset())
        if len({p.dp for p in plan.placements.values()}) == 1:
            equal_dp += 1
            assert seconds == pytest.approx(plan.step_time_s)
        else:
            assert seconds == pytest.approx(plan.step_time_s, rel=0.02)
    assert equal_dp
    shared_profile = replace(profile, calibration=_cal(host_cores=2))
    assert shares_cores(shared_profile, 4)
    shared = plan_placements(profile, 4, schedules=[schedule], top_k=6, calibration=_cal(host_cores=2))
    for plan in shared:  # what the search returns is the shared clock's step
        cost = CostModel(shared_profile, plan.placements, plan.num_microbatches)
        assert plan.step_time_s == pytest.approx(shared_step_seconds(
            shared_profile, plan.placements, plan.num_microbatches, plan.schedule, cost, frozenset()))
    slower = 0
    for plan in alone:  # the same plans, sharing two cores: never faster, and some slower
        cost = CostModel(shared_profile, plan.placements, plan.num_microbatches)
        seconds = shared_step_seconds(shared_profile, plan.placements, plan.num_microbatches, plan.schedule, cost,
                                      frozenset())
        assert seconds >= plan.step_time_s * 0.98  # (the whole layout's lists: within 2%, above)
        slower += seconds > plan.step_time_s * 1.01
    assert slower  # two cores for four computing ranks costs some plan time


def test_a_pure_dp_plan_of_computing_layers_runs_at_the_cores_share():
    """Four ranks of pure dp on two cores, layers all core work, no framework costs: the
    pipeline part of the step doubles exactly; layers that wait (or a host with a core per
    rank, or an older calibration without the host's cores) leave the prediction as it was."""
    profile = _computing(heterogeneous())
    free = Calibration(world_size=4, host_cores=2, optimizer_s_per_byte=0.0, allreduce_bandwidth=float("inf"))
    pure = {m: ModulePlacement(dp=4, rank_offset=0) for m in profile.modules}
    shared_profile = replace(profile, calibration=free)
    cost = CostModel(shared_profile, pure, 1)
    compute = sum(cost.stage(m, 0).forward_s + cost.stage(m, 0).backward_s for m in pure)
    assert shared_step_seconds(shared_profile, pure, 1, "1f1b", cost, frozenset()) == pytest.approx(2 * compute)
    for calibration in (replace(free, host_cores=4), replace(free, host_cores=0)):
        assert shared_step_seconds(replace(profile, calibration=calibration), pure, 1, "1f1b", cost,
                                   frozenset()) == pytest.approx(compute)
    for waiting in (0.0, 0.05):  # layers that wait spend a little CPU on the call: no sharing
        assert not shares_cores(replace(_computing(heterogeneous(), waiting), calibration=free), 4)
    assert shares_cores(replace(_computing(heterogeneous(), 0.5), calibration=free), 4)


@pytest.mark.parametrize("options", [{"tp_options": (1, 2)}, {"schedules": ["gpipe"]}])
def test_the_search_on_a_shared_host_prunes_with_a_valid_bound(options):
    """The shared clock's steps sit far above the per-rank clocks' bounds; the host's core work
    over its cores bounds them from below (tp groups counted whole), so the pruned search still
    returns the exhaustive one's best plans."""
    from lightning_mmpp.plan.sharing import host_bound_seconds

    profile = replace(_computing(encoders_and_lm()), calibration=_cal(host_cores=2))
    pruned = plan_placements(profile, 4, top_k=3, tolerance=0.0, **options)
    exhaustive = plan_placements(profile, 4, top_k=3, tolerance=0.0, exhaustive=True, **options)
    assert [p.step_time_s for p in pruned] == pytest.approx([p.step_time_s for p in exhaustive])
    for plan in exhaustive:
        cost = CostModel(profile, plan.placements, plan.num_microbatches)
        assert 0 < host_bound_seconds(profile, cost, frozenset(), 4) <= plan.step_time_s
