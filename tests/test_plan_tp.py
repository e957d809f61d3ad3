"""The planner with tensor parallelism: tp in the search, its cost model, its API (one process, fast)."""

from __future__ import annotations

import json

import pytest

from lightning_mmpp.core.placement import ModulePlacement, PipelineLayout
from lightning_mmpp.errors import PipelineConfigError
from lightning_mmpp.plan import Calibration, LayerProfile, ModelProfile, ModuleProfile, plan_placements
from lightning_mmpp.plan.__main__ import main as cli_main
from lightning_mmpp.plan.costs import CostModel, allreduce_seconds, broadcast_seconds
from lightning_mmpp.plan.search import _plan_key

MB = 2**20


def block(name: str, forward: float, backward: float, param_bytes: float = MB, activation: float = MB,
          output: float = MB / 8, **kw) -> LayerProfile:
    return LayerProfile(name, forward, backward, param_bytes=int(param_bytes), activation_bytes_per_sample=activation,
                        input_bytes_per_sample=output, output_bytes_per_sample=output, **kw)


def vision_and_lm(big_layer: float = 10 * MB, batch: int = 8, bandwidth: float = 20e9) -> ModelProfile:
    """A small vision encoder (no tp hook) feeding an LM with one big layer (times per 8 samples)."""
    return ModelProfile(
        modules={"vision": ModuleProfile([block(str(i), 0.002, 0.004, 2 * MB) for i in range(2)], tp_capable=False),
                 "llm": ModuleProfile([block("0", 0.004, 0.008, 2 * MB), block("1", 0.004, 0.008, big_layer),
                                       block("2", 0.004, 0.008, 2 * MB)])},
        topology={"vision": ["llm"], "llm": []},
        profile_batch_size=8, batch_size=batch, bandwidth_bytes_per_s=bandwidth, latency_s=1e-5,
    )


def keys(plans) -> list:
    return [_plan_key(p) for p in plans]


def test_default_tp_options_give_the_plans_without_tp():
    profile = vision_and_lm()
    default = plan_placements(profile, 4, top_k=8)
    assert all(p.tp == 1 for plan in default for p in plan.placements.values())
    assert keys(plan_placements(profile, 4, top_k=8, tp_options=(1,))) == keys(default)
    assert keys(plan_placements(profile, 4, top_k=8, tp_options={"llm": (1,)})) == keys(default)
    # tp sizes for modules whose model cannot split them change nothing
    for module in profile.modules.values():
        module.tp_capable = False
    assert keys(plan_placements(profile, 4, top_k=8, tp_options=(1, 2, 4))) == keys(default)
    assert [p.step_time_s for p in plan_placements(profile, 4, top_k=8, tp_options=(1, 2))] == \
        [p.step_time_s for p in default]


def test_a_layer_too_big_for_one_rank_gets_tp_2():
    """The LM's middle layer (P = 96 MiB, 4 P of state) exceeds the 180 MiB limit on any pp (a
    stage holds it whole) and with shard on any dp the batch allows (a rank still gathers the
    whole layer: P + 4 P / dp >= 2 P = 192 MiB on dp=4); with tp=2 and dp=2 sharded a rank holds
    P / 2 + 2 P / 2 = 144 MiB. The vision encoder has no tp hook, so it keeps tp=1 on a rank of its own."""
    profile = vision_and_lm(big_layer=96 * MB)
    limit = 180 * MB
    with pytest.raises(PipelineConfigError, match="tp_options"):
        plan_placements(profile, 5, memory_limit_bytes=limit)
    plans = plan_placements(profile, 5, memory_limit_bytes=limit, tp_options=(1, 2), top_k=3)
    for plan in plans:
        assert plan.placements["llm"].tp == 2 and plan.placements["vision"].tp == 1
        layout = plan.layout()
        assert layout.world_size == 5 == len(plan.peak_memory_bytes)
        assert max(plan.peak_memory_bytes) <= limit
        # every rank of a tp group holds its share, the lead and the others alike
        for group in layout.tp_groups():
            assert plan.peak_memory_bytes[group[0]] == plan.peak_memory_bytes[group[1]]
    best = plans[0]
    assert "x2 @" in best.describe() and "tp=2" in best.snippet()
    assert best.to_dict()["placements"]["llm"]["tp"] == 2
    assert json.loads(json.dumps(best.to_dict()))["world_size"] == 5


def single_sample_lm(output_bytes: float, bandwidth: float) -> ModelProfile:
    """Two heavy LM layers and one sample per step: dp has nothing to split and pp no second
    microbatch to overlap, so only tp can shorten the step."""
    return ModelProfile(
        modules={"llm": ModuleProfile([block(str(i), 0.050, 0.100, 4 * MB, output=output_bytes) for i in range(2)])},
        topology={"llm": []}, profile_batch_size=1, batch_size=1, bandwidth_bytes_per_s=bandwidth, latency_s=1e-5,
    )


def test_tp_wins_when_compute_bound_and_loses_when_its_all_reduces_dominate():
    fast_link = single_sample_lm(output_bytes=64 * 1024, bandwidth=20e9)
    plans = plan_placements(fast_link, 2, tp_options=(1, 2), top_k=10)
    assert plans[0].placements["llm"].tp == 2
    without = plan_placements(fast_link, 2, top_k=1)[0]
    assert plans[0].step_time_s < 0.6 * without.step_time_s  # the per-sample compute halves

    # 256 MiB activations over 1 GB/s: 2 all-reduces per layer per forward and backward cost more than tp saves
    slow_link = single_sample_lm(output_bytes=256 * MB, bandwidth=1e9)
    plans = plan_placements(slow_link, 2, tp_options=(1, 2), top_k=10)
    assert plans[0].placements["llm"].tp == 1
    with_tp = plan_placements(slow_link, 2, tp_options={"llm": (2,)}, top_k=1)[0]
    assert with_tp.placements["llm"].tp == 2 and with_tp.step_time_s > plans[0].step_time_s


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zero_bubble"])
def test_pruned_search_with_tp_returns_the_exhaustive_top_plans(schedule):
    profile = vision_and_lm(big_layer=24 * MB)
    for module in profile.modules.values():
        module.tp_capable = True  # colocated and beside modules then share a tp > 1
    for world, limits in ((4, {}), (5, {}), (4, {"memory_limit_bytes": 110 * MB})):
        kw = dict(schedules=(schedule,), tp_options=(1, 2, 4), **limits)
        fast = plan_placements(profile, world, top_k=5, tolerance=0.0, **kw)
        everything = plan_placements(profile, world, top_k=10_000, exhaustive=True, **kw)
        assert keys(fast) == keys(everything[:5])
        assert any(p.tp > 1 for plan in everything for p in plan.placements.values())
        for plan in everything:  # every candidate is a layout the strategy accepts (shared tp on shared ranks)
            assert PipelineLayout(plan.placements, plan.topology).world_size == world


def test_stage_costs_with_tp():
    split = block("attn_mlp", 0.010, 0.020, 8 * MB, output=MB, forward_fixed_s=0.002, backward_fixed_s=0.004)
    whole = block("head", 0.010, 0.020, 8 * MB, output=MB, tp_allreduces=0)
    profile = ModelProfile(modules={"enc": ModuleProfile([block("e", 0.001, 0.002)]),
                                    "llm": ModuleProfile([split, whole])},
                           topology={"enc": ["llm"], "llm": []}, profile_batch_size=8, batch_size=8,
                           bandwidth_bytes_per_s=1e9, latency_s=1e-4)

    def stages(tp: int) -> tuple:
        cost = CostModel(profile, {"enc": ModulePlacement(rank_offset=0),
                                   "llm": ModulePlacement(pp=2, tp=tp, rank_offset=1, split_points=(1,))}, 1)
        return cost.stage("llm", 0), cost.stage("llm", 1), cost

    one_a, one_b, _ = stages(1)
    two_a, two_b, cost = stages(2)
    nbytes = 8 * MB  # the layer's output on the 8 samples of a microbatch
    ring = allreduce_seconds(2 * nbytes, 2, 1e9, 1e-4, collectives=2)  # 2 all-reduces of its output
    relay = broadcast_seconds(8 * MB / 8, 2, profile)  # the stage's input, enc's output, inside the tp group
    assert ring > 0 and relay > 0
    # split: fixed part + half the per-sample part, plus its all-reduces; the boundary once plus a broadcast
    received = one_a.forward_s - 0.010
    assert two_a.forward_s == pytest.approx(0.002 + 0.008 / 2 + ring + received + relay)
    assert two_a.backward_s - two_a.input_s == pytest.approx(one_a.backward_s - one_a.input_s - 0.016 / 2 / 2)
    assert two_a.static_bytes == pytest.approx(one_a.static_bytes / 2)
    # the head is left whole: its compute and state do not shrink and it pays no all-reduce; its
    # received activations and gradients are relayed inside the tp group
    relay_b = broadcast_seconds(nbytes, 2, profile)
    assert two_b.forward_s == pytest.approx(one_b.forward_s + relay_b)
    assert two_b.static_bytes == one_b.static_bytes
    assert cost.gradient_seconds("llm", 0) == pytest.approx(cost._message_seconds("llm", 0, 8, 1) + relay_b)
    # a calibration charges its own all-reduce for the tp collectives
    cal = Calibration(world_size=2, allreduce_call_s=1e-3, allreduce_latency_s=2e-4, allreduce_bandwidth=5e8,
                      message_s=1e-4, p2p_bandwidth=1e9)
    calibrated = CostModel(ModelProfile(**{**profile.__dict__, "calibration": cal}),
                           {"enc": ModulePlacement(rank_offset=0),
                            "llm": ModulePlacement(pp=2, tp=2, rank_offset=1, split_points=(1,))}, 1)
    uncal = CostModel(ModelProfile(**{**profile.__dict__, "calibration": cal}),
                      {"enc": ModulePlacement(rank_offset=0),
                       "llm": ModulePlacement(pp=2, tp=1, rank_offset=1, split_points=(1,))}, 1)
    tp_part = cal.allreduce_seconds(2 * nbytes, 2, 2)
    relay_cal = 1e-3 + 2 * 2e-4 + MB / 5e8
    # a fitted negative per-call part never makes the broadcast cheaper than its bytes
    negative = ModelProfile(**{**profile.__dict__, "calibration": Calibration(
        world_size=2, allreduce_call_s=-5e-3, allreduce_latency_s=1e-3, allreduce_bandwidth=5e8)})
    assert broadcast_seconds(MB, 2, negative) == pytest.approx(MB / 5e8)
    assert calibrated.stage("llm", 0).forward_s - uncal.stage("llm", 0).forward_s == pytest.approx(
        -0.008 / 2 + tp_part + relay_cal)


def test_tp_options_errors():
    profile = vision_and_lm()
    with pytest.raises(PipelineConfigError, match="does not have"):
        plan_placements(profile, 4, tp_options={"text": (1, 2)})
    with pytest.raises(PipelineConfigError, match="pipeline_parallelize"):
        plan_placements(profile, 4, tp_options={"vision": (1, 2)})
    with pytest.raises(PipelineConfigError, match="integers >= 1"):
        plan_placements(profile, 4, tp_options=(0, 2))


def test_profile_json_keeps_tp_fields():
    profile = vision_and_lm()
    profile.modules["llm"].layers[2].tp_allreduces = 0
    again = ModelProfile.from_json(profile.to_json())
    assert again == profile and not again.modules["vision"].tp_capable
    data = profile.to_dict()
    for module in data["modules"].values():  # a profile written before tp: every module capable, 2 per layer
        del module["tp_capable"]
        for layer in module["layers"]:
            del layer["tp_allreduces"]
    old = ModelProfile.from_dict(data)
    assert all(m.tp_capable for m in old.modules.values())
    assert all(layer.tp_allreduces == 2 for m in old.modules.values() for layer in m.layers)


def test_profile_model_records_the_tp_hook():
    import torch
    from torch import nn

    from lightning_mmpp.plan import profile_model

    class Model(nn.Module):
        pipeline_topology = {"net": []}

        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))

        def pipeline_inputs(self, module, batch, upstream):
            return batch

    class Splittable(Model):
        def pipeline_parallelize(self, module, index, layer, tp_mesh):
            pass

    batch = torch.randn(8, 4)
    assert not profile_model(Model(), batch, repeats=1).modules["net"].tp_capable
    assert profile_model(Splittable(), batch, repeats=1).modules["net"].tp_capable


def test_cli_tp(tmp_path, capsys):
    path = tmp_path / "profile.json"
    vision_and_lm(big_layer=96 * MB).to_json(path)
    args = ["--profile", str(path), "--world-size", "5", "--memory-limit", "180MiB", "--json", "--top-k", "2"]
    assert cli_main(args) == 2  # nothing fits without tp
    capsys.readouterr()
    assert cli_main([*args, "--tp", "1", "2"]) == 0
    plans = json.loads(capsys.readouterr().out)["plans"]
    assert plans[0]["placements"]["llm"]["tp"] == 2 and plans[0]["world_size"] == 5
    assert cli_main([*args, "--tp", "1", "2", "--tp-modules", "llm"]) == 0
    assert json.loads(capsys.readouterr().out)["plans"] == plans
