"""The placement planner: profile, cost model, search, CLI (all one process, fast)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

import pytest

from lightning_mmpp.errors import PipelineConfigError
from lightning_mmpp.core.placement import ModulePlacement, PipelineLayout
from lightning_mmpp.plan import LayerProfile, ModelProfile, ModuleProfile, chain_profile, plan_placements
from lightning_mmpp.plan.__main__ import main as cli_main
from lightning_mmpp.plan.costs import CostModel
from lightning_mmpp.core.schedule import build_schedule
from lightning_mmpp.core.simulator import simulate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MB = 2**20


def layers(n: int, forward: float, backward: float, param_bytes: float = MB, activation: float = MB) -> list[LayerProfile]:
    return [LayerProfile(str(i), forward, backward, param_bytes=int(param_bytes), activation_bytes_per_sample=activation,
                         input_bytes_per_sample=activation / 8, output_bytes_per_sample=activation / 8)
            for i in range(n)]


def heterogeneous(batch: int = 32) -> ModelProfile:
    """A heavy vision encoder, a light audio encoder, a big LM (times per 16 samples)."""
    return ModelProfile(
        modules={"vision": ModuleProfile(layers(6, 0.010, 0.020, 50 * MB, 4 * MB)),
                 "audio": ModuleProfile(layers(3, 0.002, 0.004, 10 * MB, 1 * MB)),
                 "llm": ModuleProfile(layers(8, 0.015, 0.030, 200 * MB, 6 * MB))},
        topology={"vision": ["llm"], "audio": ["llm"], "llm": []},
        profile_batch_size=16, batch_size=batch, bandwidth_bytes_per_s=20e9, latency_s=1e-5,
    )


def encoders_and_lm() -> ModelProfile:
    """Two encoders of few heavy layers beside a big LM of many light ones (times per 16 samples)."""
    return ModelProfile(
        modules={"vision": ModuleProfile(layers(4, 0.020, 0.040, 20 * MB, 4 * MB)),
                 "audio": ModuleProfile(layers(2, 0.030, 0.060, 10 * MB, 2 * MB)),
                 "llm": ModuleProfile(layers(8, 0.010, 0.020, 200 * MB, 6 * MB))},
        topology={"vision": ["llm"], "audio": ["llm"], "llm": []},
        profile_batch_size=16, batch_size=32, bandwidth_bytes_per_s=20e9, latency_s=1e-5,
    )


def with_fixed_parts(profile: ModelProfile, share: float = 0.3) -> ModelProfile:
    """``profile`` with ``share`` of every layer time paid per call, whatever the samples."""
    for module in profile.modules.values():
        for layer in module.layers:
            layer.forward_fixed_s, layer.backward_fixed_s = share * layer.forward_s, share * layer.backward_s
    return profile


def with_curves(profile: ModelProfile, bend: float) -> ModelProfile:
    """``profile`` with measured points off the straight line: every layer's time at half its
    samples ``bend`` times the line's (above 1: concave, as a matrix product on few rows; below:
    convex), at a quarter half as far off."""
    for module in profile.modules.values():
        for layer in module.layers:
            for kind in ("forward", "backward"):
                line = getattr(layer, f"{kind}_seconds")
                setattr(layer, f"{kind}_points", ((0.25, line(0.25) * (1 + (bend - 1) / 2)), (0.5, line(0.5) * bend)))
    return profile


def test_a_layer_time_follows_its_measured_points():
    """Between the fixed part and the whole the time is read off the line through the two
    neighbouring points; a point below its predecessor counts as its predecessor; above the
    profiled samples the last segment's slope; the rate floor stays below every charge."""
    layer = LayerProfile("0", forward_s=0.010, backward_s=0.020, forward_fixed_s=0.002,
                         forward_points=((0.5, 0.008), (0.25, 0.005)))
    assert layer.forward_seconds(0.0) == pytest.approx(0.002)
    assert layer.forward_seconds(0.125) == pytest.approx(0.0035)
    assert layer.forward_seconds(0.25) == pytest.approx(0.005)
    assert layer.forward_seconds(0.75) == pytest.approx(0.009)
    assert layer.forward_seconds(2.0) == pytest.approx(0.014)  # 0.010 + 0.004 per half batch
    assert layer.backward_seconds(0.5) == pytest.approx(0.010)  # no points: the line
    assert LayerProfile("0", 0.010, 0.0, forward_points=((0.25, 0.006), (0.5, 0.004))).forward_seconds(0.5) == \
        pytest.approx(0.006)
    for bend in (1.4, 0.7):
        curved = with_curves(heterogeneous(), bend)
        for module in curved.modules.values():
            for x in module.layers:
                for f in (0.01, 0.1, 0.3, 0.5, 0.6, 1.0, 1.5, 4.0):
                    assert x.forward_seconds(0.0) + x.forward_rate_floor() * f <= x.forward_seconds(f) * (1 + 1e-12)
                    assert x.backward_seconds(0.0) + x.backward_rate_floor() * f <= x.backward_seconds(f) * (1 + 1e-12)
    again = ModelProfile.from_json(with_curves(heterogeneous(), 1.3).to_json())
    assert again == with_curves(heterogeneous(), 1.3)


def test_profile_json_round_trip(tmp_path):
    profile = heterogeneous()
    profile.modules["audio"].layers[0].input_grad_s = 0.001
    path = tmp_path / "p.json"
    profile.to_json(path)
    again = ModelProfile.from_json(path)
    assert again == profile
    assert ModelProfile.from_json(profile.to_json()) == profile
    assert json.loads(path.read_text())["version"] == 1


def test_plans_are_valid_layouts_for_the_strategy():
    plans = plan_placements(heterogeneous(), 8, top_k=3)
    assert len(plans) == 3 and plans[0].step_time_s <= plans[1].step_time_s <= plans[2].step_time_s
    for plan in plans:
        layout = PipelineLayout(plan.placements, plan.topology)
        assert layout.world_size == 8 and len(plan.peak_memory_bytes) == 8
        assert 0 <= plan.bubble_fraction < 1 and plan.step_time_s >= plan.lower_bound_s > 0
        code = plan.snippet()
        assert "MultiModulePipelineStrategy(" in code and "num_microbatches=" in code
        namespace: dict = {}
        exec(code.replace("strategy = MultiModulePipelineStrategy(", "args = dict("), namespace)  # noqa: S102
        assert namespace["args"]["placements"] == plan.placements


def test_collapsed_dp_simulation_equals_the_full_layout():
    """The search simulates every dp as 1; replicas are symmetric, so the step is the same."""
    profile = heterogeneous()
    placements = {"vision": ModulePlacement(pp=2, dp=2), "audio": ModulePlacement(dp=1),
                  "llm": ModulePlacement(pp=2, dp=2)}
    small = {n: ModulePlacement(pp=p.pp) for n, p in placements.items()}
    cost = CostModel(profile, placements, 4)
    steps = []
    for p in (placements, small):
        layout = PipelineLayout(p, profile.topology)
        result = simulate(build_schedule(layout, 4), layout, cost.forward, cost.backward, mode="eager")
        steps.append(result.step_time)
    assert steps[0] == pytest.approx(steps[1])


def test_top_plan_matches_exhaustive_search():
    profile = heterogeneous(batch=16)
    exact = plan_placements(profile, 4, top_k=3, tolerance=0.0)
    everything = plan_placements(profile, 4, top_k=1000, exhaustive=True)
    assert len(everything) > 50
    assert [p.step_time_s for p in exact] == pytest.approx([p.step_time_s for p in everything[:3]])
    for world in (4, 6):
        everything = plan_placements(profile, world, top_k=1, exhaustive=True)
        for tolerance in (0.02, 0.05):
            pruned = plan_placements(profile, world, top_k=3, tolerance=tolerance)
            assert pruned[0].step_time_s <= everything[0].step_time_s * (1 + tolerance)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zero_bubble"])
def test_pruned_search_returns_the_exhaustive_top_plans(schedule):
    """With tolerance 0 the bounds (enumeration, compute-only fill, cost model) only skip
    candidates that cannot be among the best: the same top plans as simulating everything,
    also where memory switches shard / recompute on."""
    tight = encoders_and_lm()
    limit = plan_placements(tight, 6, top_k=1, schedules=(schedule,))[0].max_memory_bytes * 0.5
    for profile, world, limits in ((heterogeneous(batch=16), 5, {}), (encoders_and_lm(), 6, {}),
                                   (tight, 6, {"memory_limit_bytes": limit})):
        everything = plan_placements(profile, world, top_k=10_000, exhaustive=True, schedules=(schedule,), **limits)
        pruned = plan_placements(profile, world, top_k=3, tolerance=0.0, schedules=(schedule,), **limits)
        assert [p.step_time_s for p in pruned] == pytest.approx([p.step_time_s for p in everything[:3]])
        assert pruned[0].placements == everything[0].placements or \
            pruned[0].step_time_s == pytest.approx(everything[1].step_time_s)  # a tie
    flagged = plan_placements(tight, 6, top_k=1, memory_limit_bytes=limit, schedules=(schedule,))[0]
    assert any(p.shard or p.recompute for p in flagged.placements.values()), flagged.describe()


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zero_bubble"])
def test_lower_bound_never_exceeds_the_simulated_step(schedule):
    """Pruning is exact only if the bound holds for every candidate the search could skip."""
    for profile, world in ((heterogeneous(batch=16), 5), (encoders_and_lm(), 6), (with_fixed_parts(encoders_and_lm()), 6),
                           (with_curves(with_fixed_parts(encoders_and_lm()), 1.5), 6),
                           (with_curves(with_fixed_parts(encoders_and_lm()), 0.6), 6)):
        everything = plan_placements(profile, world, top_k=10_000, exhaustive=True, schedules=(schedule,))
        assert len(everything) > 20
        for plan in everything:
            assert plan.lower_bound_s <= plan.step_time_s * (1 + 1e-9), plan.describe()


def test_top_plan_beats_uniform_and_single_chain():
    """At equal ranks and memory (the LM does not fit replicated on every rank)."""
    profile = encoders_and_lm()
    limits = dict(memory_limit_bytes=3.5 * 2**30, allow_shard=False, top_k=1)
    best = plan_placements(profile, 8, **limits)[0]
    uniform = plan_placements(profile, 8, uniform=True, **limits)[0]
    chain = plan_placements(chain_profile(profile), 8, **limits)[0]
    assert len({p.pp for p in uniform.placements.values()}) == 1
    assert len({p.rank_offset for p in uniform.placements.values()}) == 3  # no colocation
    assert best.step_time_s * 1.05 < uniform.step_time_s and best.step_time_s * 1.05 < chain.step_time_s


def test_zero_bubble_plans_shard_and_charge_the_weight_pass_its_own_gather_and_recompute():
    """The engine shards (and recomputes) under zero_bubble, where I and W are separate
    autograd calls: each gathers a sharded layer and reruns a recomputed forward."""
    gib = 2**30
    profile = ModelProfile(
        modules={"enc": ModuleProfile(layers(2, 0.004, 0.008, 10 * MB, MB)),
                 "llm": ModuleProfile(layers(2, 0.010, 0.020, gib, 4 * MB))},  # 2 layers: pp <= 2
        topology={"enc": ["llm"], "llm": []}, profile_batch_size=16, bandwidth_bytes_per_s=20e9, latency_s=1e-5)
    plan = plan_placements(profile, 5, top_k=1, memory_limit_bytes=3.5 * gib, schedules=("zero_bubble",))[0]
    assert plan.placements["llm"].shard and plan.placements["llm"].dp == 2, plan.describe()
    assert plan.max_memory_bytes <= 3.5 * gib
    base = {"enc": ModulePlacement(), "llm": ModulePlacement(pp=2, dp=2)}
    plain = CostModel(profile, base, 4).stage("llm", 1)
    for flag in ("shard", "recompute"):
        other = dict(base, llm=ModulePlacement(pp=2, dp=2, **{flag: True}))
        cost = CostModel(profile, other, 4).stage("llm", 1)
        # a gather, or the layer's forward compute (0.010 s per 16 samples, 16 / (4 x 2) samples)
        extra = cost.forward_s - plain.forward_s if flag == "shard" else 0.010 * (16 / (4 * 2)) / 16
        assert extra > 0
        assert cost.input_s - plain.input_s == pytest.approx(extra)
        assert cost.weight_s - plain.weight_s == pytest.approx(extra)
        assert cost.backward_s - plain.backward_s == pytest.approx(extra)  # the fused backward: once


def test_memory_limit_shapes_the_plan_and_too_small_a_limit_says_what_fits():
    profile = encoders_and_lm()
    free = plan_placements(profile, 8, top_k=1)[0]
    limit = free.max_memory_bytes * 0.8
    tight = plan_placements(profile, 8, top_k=1, memory_limit_bytes=limit)[0]
    assert tight.max_memory_bytes <= limit < free.max_memory_bytes
    with pytest.raises(PipelineConfigError, match=r"fits memory_limit .* Raise the limit to at least .* more ranks"):
        plan_placements(profile, 8, memory_limit_bytes=20 * MB)


def test_lower_layers_do_not_import_torch():
    for name in ("costs.py", "search.py"):
        tree = ast.parse(open(os.path.join(ROOT, "lightning_mmpp", "plan", name)).read())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not any(m == "torch" or m.startswith("torch.") for m in imported), name
    code = "import sys, lightning_mmpp.plan.search, lightning_mmpp.plan; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})


def test_cli_on_a_saved_profile(tmp_path, capsys):
    path = tmp_path / "p.json"
    heterogeneous().to_json(path)
    assert cli_main(["--profile", str(path), "--world-size", "8", "--memory-limit", "80GB", "--top-k", "3"]) == 0
    out = capsys.readouterr().out
    assert "step ms" in out and "MultiModulePipelineStrategy(" in out
    assert cli_main(["--profile", str(path), "--world-size", "8", "--json", "--top-k", "2"]) == 0
    plans = json.loads(capsys.readouterr().out)["plans"]
    assert len(plans) == 2 and plans[0]["world_size"] == 8
    assert cli_main(["--profile", str(path), "--world-size", "8", "--memory-limit", "1MB"]) == 2
    assert "Raise the limit" in capsys.readouterr().err


def test_cli_profiles_an_example_script(tmp_path, capsys):
    out_path = tmp_path / "example.json"
    target = os.path.join(ROOT, "examples", "train_multimodal.py") + ":VisionAudioLM"
    assert cli_main([target, "--world-size", "5", "--batch-size", "8", "--repeats", "1",
                     "--profile-out", str(out_path)]) == 0
    assert "best plan:" in capsys.readouterr().out
    profile = ModelProfile.from_json(out_path)
    assert list(profile.modules) == ["vision", "audio", "llm"] and profile.profile_batch_size == 8


def test_cli_plans_the_vision_language_example(capsys):
    """The realistic example: Hugging Face layers built in configure_model (meta), a frozen
    encoder, tied embeddings; profiled layer by layer, planned, printed as JSON."""
    pytest.importorskip("transformers")
    target = os.path.join(ROOT, "examples", "train_vlm.py") + ":VisionLanguageModel"
    assert cli_main([target, "--world-size", "4", "--batch-size", "8", "--repeats", "1", "--json", "--top-k", "2"]) == 0
    plans = json.loads(capsys.readouterr().out)["plans"]
    assert len(plans) == 2 and set(plans[0]["placements"]) == {"vision", "proj", "llm"}
    assert sum(p["pp"] * p["dp"] for p in plans[0]["placements"].values()) >= 4


def test_profile_model_on_the_test_model():
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from models import MultiModalModel, make_loader

    from lightning_mmpp.plan import profile_model

    topology = {"enc_a": ["llm"], "enc_b": ["llm"], "llm": []}
    model = MultiModalModel(topology)
    profile = profile_model(model, next(iter(make_loader(topology, 8, 8))), repeats=1)
    assert profile.topology == topology and profile.profile_batch_size == 8
    assert [len(profile.modules[m].layers) for m in topology] == [3, 3, 5]
    for module in profile.modules.values():
        for layer in module.layers:
            assert layer.forward_s > 0 and layer.backward_s > 0 and layer.output_bytes_per_sample > 0
    assert profile.modules["llm"].layers[0].param_bytes == sum(
        p.numel() * p.element_size() for p in model.llm[0].parameters())
    assert profile.modules["llm"].layers[0].activation_bytes_per_sample > 0
    assert plan_placements(profile, 4, top_k=1)[0].step_time_s > 0


def ticking_model(monkeypatch, forward_s, backward_s, layers: int):
    """A one-module model of ``layers`` layers, each advancing the profiler's clock (made
    virtual here) by ``forward_s(rows)`` / ``backward_s(rows)`` per forward / backward."""
    import torch
    from torch import nn

    from lightning_mmpp.plan import profile as profile_module

    clock = [0.0]
    monkeypatch.setattr(profile_module.time, "perf_counter", lambda: clock[0])

    class Tick(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            clock[0] += forward_s(x.shape[0])
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            clock[0] += backward_s(grad.shape[0])
            return grad

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(4))

        def forward(self, x):
            return Tick.apply(x * self.w)

    class Model(nn.Module):
        pipeline_topology = {"net": []}

        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(*(Layer() for _ in range(layers)))

        def pipeline_inputs(self, module, batch, upstream):
            return batch

    return Model()


def test_profile_splits_layer_times_into_a_fixed_part_per_call_and_a_part_per_sample(monkeypatch):
    """A layer costs a fixed part per call plus a part per sample: profile_model finds both (on a
    virtual clock the layer advances) and the cost model charges the fixed part per microbatch."""
    import torch

    from lightning_mmpp.plan import profile_model

    fixed_f, rate_f, fixed_b, rate_b = 3e-3, 1e-4, 5e-3, 2e-4
    model = ticking_model(monkeypatch, lambda rows: fixed_f + rate_f * rows, lambda rows: fixed_b + rate_b * rows, 2)
    profile = profile_model(model, torch.randn(32, 4), repeats=1)
    layer = profile.modules["net"].layers[0]
    assert layer.forward_s == pytest.approx(fixed_f + 32 * rate_f)
    assert layer.backward_s == pytest.approx(fixed_b + 32 * rate_b)
    assert layer.forward_fixed_s == pytest.approx(fixed_f) and layer.backward_fixed_s == pytest.approx(fixed_b)
    assert ModelProfile.from_json(profile.to_json()) == profile
    # 4 microbatches of 8 samples: each pays the fixed parts once per layer
    cost = CostModel(profile, {"net": ModulePlacement()}, 4).stage("net", 0)
    assert cost.forward_s == pytest.approx(2 * (fixed_f + 8 * rate_f))
    assert cost.backward_s == pytest.approx(2 * (fixed_b + 8 * rate_b))
    # a profile without fixed parts (written by hand, or before they were measured) scales the whole time
    plain = ModelProfile({"net": ModuleProfile([LayerProfile("0", 0.032, 0.064)])}, {"net": []}, 32)
    assert CostModel(plain, {"net": ModulePlacement()}, 4).stage("net", 0).forward_s == pytest.approx(0.008)


def test_profile_times_pipeline_inputs_and_the_cost_model_charges_it_on_the_first_stage(monkeypatch):
    """A sink whose pipeline_inputs costs a fixed part plus a part per sample, forward and
    backward (a merge of encoder features into the LM's tokens; on a virtual clock): the profile
    records it as ModuleProfile.inputs, the cost model charges it on the module's first stage
    only, per microbatch, and a single chain runs it as a layer before the module's own."""
    import torch
    from torch import nn

    from lightning_mmpp.plan import profile as profile_module
    from lightning_mmpp.plan import profile_model

    clock = [0.0]  # a virtual clock that only the merge advances
    monkeypatch.setattr(profile_module.time, "perf_counter", lambda: clock[0])

    class Merge(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            clock[0] += 4e-3 + 1e-4 * x.shape[0]
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            clock[0] += 6e-3 + 2e-4 * grad.shape[0]
            return grad

    class TwoModules(nn.Module):
        pipeline_topology = {"enc": ["lm"], "lm": []}

        def __init__(self) -> None:
            super().__init__()
            self.enc, self.lm = nn.Sequential(nn.Linear(4, 4)), nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))

        def pipeline_inputs(self, module, batch, upstream):
            return batch if module == "enc" else Merge.apply(upstream["enc"])

    profile = profile_model(TwoModules(), torch.randn(32, 4), repeats=1)
    assert profile.modules["enc"].inputs is None  # a source's inputs are its batch: nothing to time
    glue = profile.modules["lm"].inputs
    assert glue.forward_s == pytest.approx(4e-3 + 32e-4) and glue.forward_fixed_s == pytest.approx(4e-3)
    assert glue.backward_s == pytest.approx(6e-3 + 64e-4) and glue.param_bytes == 0
    assert ModelProfile.from_json(profile.to_json()) == profile
    without = ModelProfile.from_json(profile.to_json())
    without.modules["lm"].inputs = None
    for pp in (1, 2):
        placements = {"enc": ModulePlacement(), "lm": ModulePlacement(pp=pp)}
        with_glue, plain = CostModel(profile, placements, 4), CostModel(without, placements, 4)
        # 4 microbatches of 8 samples: the first stage pays the call per microbatch, the others nothing
        assert with_glue.stage("lm", 0).forward_s - plain.stage("lm", 0).forward_s == pytest.approx(4e-3 + 8e-4)
        assert with_glue.stage("lm", 0).backward_s - plain.stage("lm", 0).backward_s == pytest.approx(6e-3 + 16e-4)
        if pp == 2:
            assert with_glue.stage("lm", 1).forward_s == plain.stage("lm", 1).forward_s
    names = [layer.name for layer in chain_profile(profile).modules["chain"].layers]
    assert names.index("lm.pipeline_inputs") == names.index("enc.0") + 1 and "enc.pipeline_inputs" not in names


def test_profile_times_layers_on_fractions_of_the_batch_and_prices_microbatches_along_them(monkeypatch):
    """A layer whose time is not a straight line in its samples (dear per sample up to 16, cheap
    beyond, as a matrix product that uses its cores better on more rows; on a virtual clock the
    layer advances): profile_model times it on 1/2 .. 1/16 of the batch, and the cost model prices
    a microbatch of 16 samples at its time, where the line from the fixed part to the whole
    batch is a third short."""
    import torch

    from lightning_mmpp.plan import profile_model

    def seconds(rows: int) -> float:
        return 1e-3 + 1e-4 * min(rows, 16) + 2.5e-5 * max(rows - 16, 0)

    model = ticking_model(monkeypatch, seconds, lambda rows: 2 * seconds(rows), 1)
    profile = profile_model(model, torch.randn(64, 4), repeats=1)
    layer = profile.modules["net"].layers[0]
    assert [f for f, _ in layer.forward_points] == [0.0625, 0.125, 0.25, 0.5]
    assert [t for _, t in layer.forward_points] == pytest.approx([seconds(4), seconds(8), seconds(16), seconds(32)])
    assert [t for _, t in layer.backward_points] == pytest.approx([2 * seconds(n) for n in (4, 8, 16, 32)])
    assert layer.forward_fixed_s == pytest.approx(1e-3)  # from 2 and 4 samples, the lowest segment
    for rows in (2, 4, 12, 16, 24, 48, 64):
        assert layer.forward_seconds(rows / 64) == pytest.approx(seconds(rows))
        assert layer.backward_seconds(rows / 64) == pytest.approx(2 * seconds(rows))
    cost = CostModel(profile, {"net": ModulePlacement()}, 4).stage("net", 0)  # 4 microbatches of 16
    assert cost.forward_s == pytest.approx(seconds(16))
    line = layer.forward_fixed_s + (layer.forward_s - layer.forward_fixed_s) / 4
    assert line == pytest.approx(0.0017) and seconds(16) == pytest.approx(0.0026)
    assert ModelProfile.from_json(profile.to_json()) == profile
    # 24 samples: not halved to whole numbers below 12, nor below twice the small size
    fewer = profile_model(model, torch.randn(24, 4), repeats=1).modules["net"].layers[0]
    assert [f for f, _ in fewer.forward_points] == [0.25, 0.5]


def test_the_sink_loss_is_profiled_and_charged_on_its_last_stage_once_per_microbatch(monkeypatch):
    """profile_model times each sink's pipeline_loss (its metrics included) as a layer of the
    sink's output, fixed part and part per sample (on a virtual clock the loss advances); the cost
    model charges it on the sink's last stage only, per microbatch, in the forward and at the
    start of the backward (all of it in I), never recomputed, its saved bytes held until then."""
    import torch
    from torch import nn

    from lightning_mmpp.plan import profile as profile_module
    from lightning_mmpp.plan import profile_model

    clock = [0.0]
    monkeypatch.setattr(profile_module.time, "perf_counter", lambda: clock[0])
    fixed_f, rate_f, fixed_b, rate_b = 2e-3, 1e-4, 1e-3, 5e-5

    class LossTick(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            clock[0] += fixed_f + rate_f * x.shape[0]
            ctx.rows = x.shape[0]
            return x.square().mean()

        @staticmethod
        def backward(ctx, grad):
            clock[0] += fixed_b + rate_b * ctx.rows
            return grad.expand(ctx.rows, 4) / ctx.rows

    class Model(nn.Module):
        pipeline_topology = {"enc": ["net"], "net": []}

        def __init__(self) -> None:
            super().__init__()
            self.enc = nn.Sequential(nn.Linear(4, 4))
            self.net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))

        def pipeline_inputs(self, module, batch, upstream):
            return batch["x"] if module == "enc" else upstream["enc"]

        def pipeline_loss(self, module, output, batch):
            assert batch["y"].shape[0] == output.shape[0]  # the batch cut to the output's samples
            return {"loss": LossTick.apply(output), "accuracy": (output.argmax(-1) == batch["y"]).float().mean()}

    profile = profile_model(Model(), {"x": torch.randn(32, 4), "y": torch.zeros(32, dtype=torch.long)}, repeats=1)
    assert profile.modules["enc"].loss is None  # not a sink
    loss = profile.modules["net"].loss
    assert loss.forward_s == pytest.approx(fixed_f + 32 * rate_f) and loss.forward_fixed_s == pytest.approx(fixed_f)
    assert loss.backward_s == pytest.approx(fixed_b + 32 * rate_b) and loss.backward_fixed_s == pytest.approx(fixed_b)
    assert loss.input_grad_s == loss.backward_s and loss.param_bytes == 0 and loss.tp_allreduces == 0
    assert ModelProfile.from_json(profile.to_json()) == profile

    placements = {"enc": ModulePlacement(), "net": ModulePlacement(pp=2)}
    with_loss = CostModel(profile, placements, 4)  # 4 microbatches of 8 samples
    profile.modules["net"].loss = None
    without = CostModel(profile, placements, 4)
    charged_f, charged_b = fixed_f + 8 * rate_f, fixed_b + 8 * rate_b
    assert with_loss.stage("net", 0) == without.stage("net", 0) and with_loss.stage("enc", 0) == without.stage("enc", 0)
    last, plain = with_loss.stage("net", 1), without.stage("net", 1)
    assert last.forward_s == pytest.approx(plain.forward_s + charged_f)
    assert last.backward_s == pytest.approx(plain.backward_s + charged_b)
    assert last.input_s == pytest.approx(plain.input_s + charged_b) and last.weight_s == pytest.approx(plain.weight_s)
    assert last.activation_bytes == pytest.approx(plain.activation_bytes + 8 * loss.activation_bytes_per_sample)
    profile.modules["net"].loss = loss
    recomputed = {**placements, "net": ModulePlacement(pp=2, recompute=True)}
    again = CostModel(profile, recomputed, 4).stage("net", 1)
    profile.modules["net"].loss = None
    again_plain = CostModel(profile, recomputed, 4).stage("net", 1)
    assert again.backward_s == pytest.approx(again_plain.backward_s + charged_b)  # the layers' forward only, again


def test_a_chain_of_the_modules_runs_every_sink_loss_on_its_last_stage():
    profile = heterogeneous()
    profile.topology = {"vision": ["llm"], "audio": [], "llm": []}  # two sinks
    profile.modules["audio"].loss = LayerProfile("pipeline_loss", 0.001, 0.002, input_grad_s=0.002, cpu_share=1.0)
    profile.modules["llm"].loss = LayerProfile("pipeline_loss", 0.003, 0.004, input_grad_s=0.004, cpu_share=0.5)
    loss = chain_profile(profile).modules["chain"].loss
    assert (loss.forward_s, loss.backward_s, loss.input_grad_s) == pytest.approx((0.004, 0.006, 0.006))
    assert loss.cpu_share == pytest.approx((0.003 + 0.007 * 0.5) / 0.01)
    profile.modules["audio"].loss = None
    assert chain_profile(profile).modules["chain"].loss == profile.modules["llm"].loss


def test_collectives_pay_latency_per_ring_step_and_bridges_on_the_same_ranks_are_free():
    from lightning_mmpp.plan.costs import CostModel, allreduce_seconds, metrics_seconds

    assert allreduce_seconds(8e9, 1, 1e9, 0.5) == 0.0
    assert allreduce_seconds(8e9, 4, 1e9, 0.5) == pytest.approx(2 * 3 / 4 * 8 + 6 * 0.5)
    assert allreduce_seconds(8e9, 4, 1e9, 0.5, scatter_only=True, collectives=3) == pytest.approx(3 / 4 * 8 + 9 * 0.5)
    profile = heterogeneous()
    profile.latency_s = 1e-3
    # 200 MiB per LM layer, 4 layers per stage, fp32 grads summed in 25 MiB buckets: 32 calls
    placements = {"vision": ModulePlacement(dp=2, rank_offset=0), "audio": ModulePlacement(dp=2, rank_offset=0),
                  "llm": ModulePlacement(pp=2, dp=2, rank_offset=0)}
    cost = CostModel(profile, placements, 4)
    lm_bytes = 4 * 200 * MB
    assert cost.stage("llm", 0).sync_s == pytest.approx(lm_bytes / profile.bandwidth_bytes_per_s + 32 * 2 * 1e-3)
    assert metrics_seconds(profile, 8) == pytest.approx(64 * 2 * 7 / 8 / profile.bandwidth_bytes_per_s + 14 * 1e-3)
    # the encoders sit beside the LM's first stage (same ranks): their bridges cost nothing
    assert cost.received_seconds("llm", 0) == 0.0
    apart = CostModel(profile, {**placements, "llm": ModulePlacement(pp=2, dp=2, rank_offset=2)}, 4)
    assert apart.received_seconds("llm", 0) > 2 * profile.latency_s


# --- calibration (issue 28) ---------------------------------------------------------------


def _calibration(**kw):
    from lightning_mmpp.plan import Calibration

    values = dict(world_size=4, action_s=1e-3, message_s=2e-3, step_s=5e-3, p2p_latency_s=1e-4, p2p_bandwidth=1e9,
                  allreduce_latency_s=3e-4, allreduce_bandwidth=2e9, gather_layer_s=4e-3, gather_bandwidth=1e9,
                  scatter_layer_s=6e-3, scatter_bandwidth=5e8, optimizer_s_per_byte=1e-9)
    values.update(kw)
    return Calibration(**values)


def test_calibration_json_round_trip_and_versions(tmp_path):
    from lightning_mmpp.plan import Calibration

    cal = _calibration(scatter_bandwidth=float("inf"), samples={"p2p": [[256, 1e-4], [4096, 2e-4]]})
    path = tmp_path / "cal.json"
    cal.to_json(path)
    assert Calibration.from_json(path) == cal and Calibration.from_json(cal.to_json()) == cal
    profile = heterogeneous()
    profile.calibration = cal
    assert ModelProfile.from_json(profile.to_json()) == profile
    data = json.loads(cal.to_json())
    with pytest.raises(PipelineConfigError, match="version"):
        Calibration.from_dict({**data, "version": 99})
    with pytest.raises(PipelineConfigError, match="unknown fields"):
        Calibration.from_dict({**data, "bogus": 1})


@pytest.mark.parametrize("layer, loss", [(None, None), ((0.3e-3, 0.5e-3), None), ((0.3e-3, 0.5e-3), (0.1e-3, 0.08e-3))])
def test_fit_calibration_recovers_known_constants(layer, loss):
    """Synthetic samples made from known constants are fitted back to them; the framework runs'
    layers cost what the profile measured for one (``layer``: their wait plus their own call),
    or, in samples without that measurement, their known wait; and their loss what the profile
    measured for it (``loss``, run once per microbatch on the loss stage), or, in samples without
    that measurement, nothing."""
    from lightning_mmpp.plan.measure import BACKWARD_S, DP_LAYERS, FORWARD_S, _chain_seconds, _width, fit_calibration

    world, action, message, step, pipeline_step = 4, 0.7e-3, 1.5e-3, 9e-3, 4e-3
    lat, bw = 1e-4, 2e9
    work = FORWARD_S + BACKWARD_S + (sum(layer) if layer else 0.0)
    f, b = (FORWARD_S + layer[0], BACKWARD_S + layer[1]) if layer else (FORWARD_S, BACKWARD_S)
    loss_fb = loss or (0.0, 0.0)
    known = _calibration(action_s=action, message_s=message)
    samples = {
        "p2p": [(n, lat + n / bw) for n in (256, 65536, 2**20)],
        "allreduce": [(n, 6 * 2e-4 + 1.5 * n / bw) for n in (256, 2**20)],
        "fsdp": [(n, 3e-3 + 0.75 * n / bw, 5e-3 + 0.75 * n / bw) for n in (4096, 2**20)],
        "optimizer": [(n, 1e-4 + 2e-9 * n) for n in (65536, 2**20)],
        "gradient_copy": [(n, 2e-5 + 5e-10 * n) for n in (2**18, 2**24)],
        "sharded_optimizer": (16, 16 * 1e-4),
        "framework": {"dp": [(m, step + 6 * 2e-4 + 5e-10 * 4 * DP_LAYERS * _width(world)
                              + m * (DP_LAYERS * work + sum(loss_fb) + 2 * action)) for m in (2, 32)],
                      # 2 more modules at 2 microbatches: their layers and actions, 1.5 ms each beyond
                      # (their gradient sums end within the backwards after them)
                      "modules": [(2, step + 6 * 2e-4 + 5e-10 * 4 * DP_LAYERS * _width(world)
                                   + 2 * (DP_LAYERS * work + sum(loss_fb) + 2 * action)
                                   + 2 * (2 * (DP_LAYERS * work + 2 * action) + 1.5e-3))],
                      "chain": [(m, pipeline_step + _chain_seconds(world, m, f, b, known, loss_fb)) for m in (4, 16)]},
    }
    if loss:
        samples["loss"] = list(loss)
    if layer:  # new samples: also the smallest FSDP2 layer over pairs of ranks (one ring step)
        samples["layer"] = [FORWARD_S + layer[0], BACKWARD_S + layer[1]]
        samples["fsdp_pairs"] = [(4096, 1.2e-3 + 0.6e-3 + 0.5 * 4096 / bw, 2e-3 + 1e-3 + 0.5 * 4096 / bw)]
        # the all-reduce: 0.3 ms per call + 0.15 ms per ring step (6 steps over 4 ranks: 1.2 ms, as above)
        samples["allreduce_pairs"] = [(256, 3e-4 + 2 * 1.5e-4 + 256 / bw)]
        # the pure-dp run at 2 microbatches again, logging 8 more metrics at 0.4 ms each
        samples["framework"]["metrics"] = [(8, samples["framework"]["dp"][0][1] + 8 * 0.4e-3)]
    cal = fit_calibration(world, "cpu", samples)
    assert cal.metric_s == (pytest.approx(0.4e-3) if layer else 0.0)
    assert cal.p2p_latency_s == pytest.approx(lat, rel=0.01) and cal.p2p_bandwidth == pytest.approx(bw, rel=1e-6)
    assert cal.allreduce_bandwidth == pytest.approx(bw)
    if layer:
        assert cal.allreduce_latency_s == pytest.approx(1.5e-4, rel=0.01) and cal.allreduce_call_s == pytest.approx(3e-4, rel=0.01)
    else:
        assert cal.allreduce_latency_s == pytest.approx(2e-4, rel=0.01) and cal.allreduce_call_s == 0.0
    assert cal.allreduce_seconds(2**20, 4) == pytest.approx(1.2e-3 + 1.5 * 2**20 / bw, rel=0.01)
    if layer:  # per layer: the hooks' part and a latency per ring step (3 over the 4 calibrated ranks)
        assert cal.gather_layer_s == pytest.approx(1.2e-3, rel=0.01) and cal.gather_step_s == pytest.approx(6e-4, rel=0.01)
        assert cal.scatter_layer_s == pytest.approx(2e-3, rel=0.01) and cal.scatter_step_s == pytest.approx(1e-3, rel=0.01)
        assert cal.gather_seconds(4096, 2, 1) == pytest.approx(1.8e-3 + 0.5 * 4096 / bw, rel=0.01)
    else:  # one group size measured: the whole fixed part per layer, whatever the group
        assert cal.gather_layer_s == pytest.approx(3e-3, rel=0.01) and cal.scatter_layer_s == pytest.approx(5e-3, rel=0.01)
        assert cal.gather_step_s == 0.0 and cal.scatter_step_s == 0.0
    assert cal.gather_seconds(2**20, 4, 1) == pytest.approx(3e-3 + 0.75 * 2**20 / bw, rel=0.01)
    assert cal.gather_bandwidth == pytest.approx(bw) and cal.optimizer_s_per_byte == pytest.approx(2e-9)
    assert cal.gradient_copy_s_per_byte == pytest.approx(5e-10)
    assert cal.sharded_tensor_s == pytest.approx(1e-4)
    assert cal.module_s == pytest.approx(1.5e-3, rel=1e-3)
    assert cal.action_s == pytest.approx(action) and cal.message_s == pytest.approx(message)
    assert cal.step_s == pytest.approx(step, rel=1e-3) and cal.pipeline_step_s == pytest.approx(pipeline_step)
    # the chain's critical path: m + world - 1 forward-backward pairs, less the messages of its ends
    assert 7 * (work + 2 * action) < _chain_seconds(world, 4, f, b, known) < 7 * (work + 2 * (action + message))
    if loss:  # the last stage's 4 losses: at least one on the critical path, at most all
        plain = _chain_seconds(world, 4, f, b, known)
        assert plain + sum(loss) <= _chain_seconds(world, 4, f, b, known, loss) <= plain + 4 * sum(loss) + 1e-12


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("loss", [(0.0, 0.0), (0.2e-3, 0.1e-3)])
def test_fit_calibration_recovers_the_message_cost_on_short_chains(world, loss):
    """The per-message cost is fitted through the same chain timing the cost model uses, whatever
    the chain's length: over 2 ranks each stage receives one message per microbatch, not the two
    of a middle stage (a closed form assuming two fitted half the cost there)."""
    from lightning_mmpp.plan.measure import BACKWARD_S, DP_LAYERS, FORWARD_S, _chain_seconds, fit_calibration

    action, message, step, pipeline_step = 0.7e-3, 1.5e-3, 9e-3, 4e-3
    known = _calibration(world_size=world, action_s=action, message_s=message)
    f, b = FORWARD_S, BACKWARD_S
    samples = {
        "optimizer": [(n, 1e-4 + 2e-9 * n) for n in (65536, 2**20)],
        "layer": [f, b], "loss": list(loss),
        "framework": {"dp": [(m, step + m * (DP_LAYERS * (f + b) + sum(loss) + 2 * action)) for m in (2, 32)],
                      "chain": [(m, pipeline_step + _chain_seconds(world, m, f, b, known, loss))
                                for m in (world, 8 * world)]},
    }
    cal = fit_calibration(world, "cpu", samples)
    assert cal.action_s == pytest.approx(action) and cal.step_s == pytest.approx(step)
    assert cal.message_s == pytest.approx(message, rel=1e-6)
    assert cal.pipeline_step_s == pytest.approx(pipeline_step, rel=1e-6)
    # where the chain run measured its first rank's time outside the pipeline, that is the cost
    samples["framework"]["chain_outside"] = 2.5e-3
    assert fit_calibration(world, "cpu", samples).pipeline_step_s == 2.5e-3


def test_the_optimizer_step_is_charged_at_the_model_own_optimizer_rate():
    """profile_model times the optimizer configure_optimizers returns beside AdamW (what the
    calibration times) and on many tiny tensors; the cost model charges the calibration's rate
    times their ratio, plus the cost per tensor for every trainable parameter tensor a rank holds."""
    import torch
    from torch import nn

    from lightning_mmpp.plan.profile import _configured_optimizer, _optimizer_costs

    def _optimizer_ratio(model, device):
        return _optimizer_costs(model, device)[0]

    sgd = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(sgd, 1)
    for configured in (sgd, {"optimizer": sgd, "lr_scheduler": scheduler}, [sgd], ([sgd], [scheduler])):
        assert _configured_optimizer(configured) is sgd
    assert _configured_optimizer([sgd, sgd]) is None and _configured_optimizer(None) is None

    class Model(nn.Module):
        def __init__(self, configure):
            super().__init__()
            self.layer = nn.Linear(4, 4)
            self.configure = configure

        def configure_optimizers(self):
            return self.configure(self)

        def pipeline_inputs(self, module, batch, upstream):
            return batch

    ratio = _optimizer_ratio(Model(lambda m: torch.optim.SGD(m.parameters(), lr=0.1)), torch.device("cpu"))
    assert ratio is not None and ratio > 0
    # AdamW's defaults hold a setting its constructor does not take: rebuilt from the ones it does
    assert _optimizer_ratio(Model(lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3)), torch.device("cpu")) > 0

    def needs_trainer(model):
        raise RuntimeError("not attached to a Trainer")

    assert _optimizer_costs(Model(needs_trainer), torch.device("cpu")) == (None, None)
    per_tensor = _optimizer_costs(Model(lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3)), torch.device("cpu"))[1]
    assert isinstance(per_tensor, float) and per_tensor >= 0
    from lightning_mmpp.plan import profile_model

    profiled = profile_model(Model(lambda m: torch.optim.SGD(m.parameters(), lr=0.1)), torch.zeros(4, 4),
                             topology={"layer": []})
    assert [layer.param_tensors for layer in profiled.modules["layer"].layers] == [2]  # weight and bias
    assert profiled.optimizer_ratio is not None and profiled.optimizer_tensor_s is not None
    profile = replace_calibration(heterogeneous(), _calibration())
    plan = plan_placements(profile, 4, top_k=1)[0]
    adamw = CostModel(profile, plan.placements, plan.num_microbatches)
    profile.optimizer_ratio = 0.25
    assert ModelProfile.from_json(profile.to_json()).optimizer_ratio == 0.25
    cheaper = CostModel(profile, plan.placements, plan.num_microbatches)
    for key, stage in adamw._stages.items():
        assert stage.optimizer_s > 0 and cheaper._stages[key].optimizer_s == pytest.approx(0.25 * stage.optimizer_s)
    # a fixed cost per tensor: each stage pays it for its trainable layers' tensors
    for module in profile.modules.values():
        for layer in module.layers:
            layer.param_tensors = 2
    profile.optimizer_tensor_s = 1e-3
    assert ModelProfile.from_json(profile.to_json()).optimizer_tensor_s == 1e-3
    per_tensor = CostModel(profile, plan.placements, plan.num_microbatches)
    for (module, stage), cost in cheaper._stages.items():
        trainable = [layer for i, layer in enumerate(profile.modules[module].layers)
                     if i in per_tensor.ranges(module)[stage] and layer.trainable]
        assert per_tensor._stages[(module, stage)].optimizer_s == pytest.approx(cost.optimizer_s + 2e-3 * len(trainable))


def test_a_fan_in_pays_the_links_latency_once_for_the_messages_it_waits_on_together():
    """The LM's replica receives two halves from the vision replicas and one message from audio
    per microbatch, posted ahead and waited on together: three messages' costs less two latencies;
    its output gradients go back the same way to the replicas that sent the halves."""
    cal = _calibration(message_s=2e-3, p2p_latency_s=5e-4)
    profile = replace_calibration(heterogeneous(), cal)
    placements = {"vision": ModulePlacement(dp=2, rank_offset=0), "audio": ModulePlacement(rank_offset=2),
                  "llm": ModulePlacement(rank_offset=3)}
    cost = CostModel(profile, placements, 4)
    samples = cost.samples("llm")
    serial = (cost._message_seconds("vision", 0, samples, 2) + cost._message_seconds("audio", 0, samples, 1))
    assert cost.received_seconds("llm", 0) == pytest.approx(serial - 2 * 5e-4)
    # one message alone pays its whole cost; the vision replica gets its half of the gradient back
    assert cost.received_seconds("audio", 0) == 0.0
    assert cost.gradient_seconds("vision", 0) == pytest.approx(cost._message_seconds("vision", 0, cost.samples("vision"), 1))
    plain = CostModel(heterogeneous(), placements, 4)  # uncalibrated: a latency per message, as before
    assert plain.received_seconds("llm", 0) == pytest.approx(
        plain._message_seconds("vision", 0, samples, 2) + plain._message_seconds("audio", 0, samples, 1))


def test_a_pure_dp_step_pays_each_module_beyond_the_first_and_the_sums_tail_is_timed_as_queued():
    """Calibration.module_s: what a module adds to a lockstep step beyond its actions and its
    gradient sum, charged per module beyond the first where every rank runs every module only;
    its fit takes off the part of the modules' sums that runs past the last backward."""
    from lightning_mmpp.plan.costs import in_lockstep, step_overhead_seconds
    from lightning_mmpp.plan.measure import _sync_tail

    cal = _calibration(module_s=2e-3)
    profile = replace_calibration(heterogeneous(), cal)  # 3 modules
    assert step_overhead_seconds(profile, 4, True) == pytest.approx(cal.step_s + 2 * 2e-3)
    assert step_overhead_seconds(profile, 4, False) == pytest.approx(cal.step_seconds(False))
    # small parameters: pure dp over the 4 ranks is the plan, and it pays the 2 modules beyond the first
    small = ModelProfile(modules={name: ModuleProfile(layers(2, 0.010, 0.020, 1024, 1024)) for name in ("a", "b", "c")},
                         topology={"a": ["c"], "b": ["c"], "c": []}, profile_batch_size=16, batch_size=32,
                         bandwidth_bytes_per_s=20e9, latency_s=1e-5)
    plan = plan_placements(replace_calibration(small, cal), 4, top_k=1)[0]
    free = plan_placements(replace_calibration(small, _calibration()), 4, top_k=1)[0]
    assert in_lockstep(plan.placements, 4) and plan.placements == free.placements, plan.describe()
    assert plan.step_time_s == pytest.approx(free.step_time_s + 2 * 2e-3)
    # sums of 5 s after backwards 8 s apart: only the last module's shows; 2 s apart, they queue
    assert _sync_tail(1, 0.0, 5.0) == 5.0 and _sync_tail(3, 8.0, 5.0) == 5.0 and _sync_tail(3, 2.0, 5.0) == 11.0


def test_each_logged_metric_beyond_the_loss_costs_the_calibrated_metric_cost():
    """profile_model counts what pipeline_loss returns (the token count of a per-token loss is
    not logged); every metric beyond the loss adds the calibration's metric_s to a step."""
    import torch
    from torch import nn

    from lightning_mmpp.plan import profile_model
    from lightning_mmpp.plan.costs import step_overhead_seconds

    class Model(nn.Module):
        def __init__(self, returns):
            super().__init__()
            self.net = nn.Linear(4, 4)
            self.returns = returns

        def pipeline_inputs(self, module, batch, upstream):
            return batch

        def pipeline_loss(self, module, output, batch):
            return self.returns(output)

    counted = [profile_model(Model(returns), torch.zeros(4, 4), repeats=1, topology={"net": []}).metrics
               for returns in (lambda y: y.mean(), lambda y: {"loss": y.mean(), "accuracy": y.mean(), "rms": y.std()},
                               lambda y: {"loss_sum": y.sum(), "num_tokens": torch.tensor(16)},
                               lambda y: 1 / 0)]  # a hook that cannot run here: the loss alone
    assert counted == [1, 3, 1, 1]
    profile = replace_calibration(heterogeneous(), _calibration(metric_s=0.5e-3))
    base = step_overhead_seconds(profile, 4, True)
    profile.metrics = 3
    assert step_overhead_seconds(profile, 4, True) == pytest.approx(base + 2 * 0.5e-3)
    assert ModelProfile.from_json(profile.to_json()).metrics == 3


def test_a_pipelined_plan_pays_the_pipelined_step_cost_and_pure_dp_the_lockstep_one():
    from lightning_mmpp.plan.costs import in_lockstep

    profile = ModelProfile(  # small parameters: pure dp and pipelined plans both rank high
        modules={"enc": ModuleProfile(layers(2, 0.010, 0.020, 4096, 4096)),
                 "lm": ModuleProfile(layers(4, 0.010, 0.020, 4096, 4096))},
        topology={"enc": ["lm"], "lm": []}, profile_batch_size=16, batch_size=32,
        bandwidth_bytes_per_s=20e9, latency_s=1e-5)
    same, dearer = _calibration(pipeline_step_s=5e-3), _calibration(pipeline_step_s=0.5)
    assert _calibration().step_seconds(False) == 5e-3  # older calibrations: one per-step cost
    plans = {name: {(p.describe(), p.num_microbatches): p for p in plan_placements(profile, 4, top_k=30, calibration=cal)}
             for name, cal in (("same", same), ("dearer", dearer))}
    common = plans["same"].keys() & plans["dearer"].keys()
    kinds = set()
    for key in common:
        a, b = plans["same"][key], plans["dearer"][key]
        lockstep = in_lockstep(a.placements, 4)
        kinds.add(lockstep)
        assert b.step_time_s == pytest.approx(a.step_time_s + (0.0 if lockstep else 0.5 - 5e-3)), key
    assert kinds == {True, False}  # both kinds of plan were compared
    assert in_lockstep({"a": ModulePlacement(dp=4, rank_offset=0), "b": ModulePlacement(dp=2, tp=2, rank_offset=0)}, 4)
    assert not in_lockstep({"a": ModulePlacement(dp=2), "b": ModulePlacement(dp=2)}, 4)
    assert not in_lockstep({"a": ModulePlacement(pp=4)}, 4)


def test_calibrated_cost_model_charges_actions_messages_fsdp_and_the_optimizer():
    profile = heterogeneous()
    for layer in profile.modules["vision"].layers:
        layer.param_tensors = 2  # a weight and a bias
    placements = {"vision": ModulePlacement(pp=2, dp=2, shard=True), "audio": ModulePlacement(dp=1),
                  "llm": ModulePlacement(pp=1, dp=2, recompute=True)}
    plain = CostModel(profile, placements, 4)
    cal = _calibration(gradient_copy_s_per_byte=3e-10, sharded_tensor_s=2e-4)
    calibrated = CostModel(replace_calibration(profile, cal), placements, 4)
    # vision stage 1: 3 layers of 50 MiB sharded over 2, receives one message per forward and backward
    v0, v1 = plain.stage("vision", 1), calibrated.stage("vision", 1)
    gather = cal.gather_seconds(3 * 50 * MB, 2, 3)
    compute_f = 3 * 0.010 * 4 / 16  # 3 layers, 4 samples per replica and microbatch, profiled on 16
    message = cal.message_seconds(4 * MB / 8 * 4, 1)
    assert v1.forward_s == pytest.approx(compute_f + cal.action_s + gather + message)
    assert v1.sync_s == pytest.approx(cal.scatter_seconds(3 * 50 * MB, 2, 3))
    # on a CPU device (gloo) the reduce-scatters run inside the last backward, before its
    # gradients go upstream; on an accelerator beside the later actions, as an all-reduce does
    assert profile.device == "cpu" and v1.sync_in_backward and v1.blocking_sync_s == v1.sync_s
    assert v1.trailing_sync_s == 0.0 and calibrated.blocking_sync("vision", 1) == v1.sync_s
    assert not calibrated.stage("llm", 0).sync_in_backward and calibrated.stage("llm", 0).trailing_sync_s > 0
    on_gpu = replace_calibration(profile, cal)
    on_gpu.device = "cuda"
    gpu_v1 = CostModel(on_gpu, placements, 4).stage("vision", 1)
    assert not gpu_v1.sync_in_backward and gpu_v1.trailing_sync_s == v1.sync_s
    # its optimizer steps its shard, and each of its parameters (2 per layer) is a DTensor
    assert v1.optimizer_s == pytest.approx(cal.optimizer_s_per_byte * 3 * 50 * MB / 2 + cal.sharded_tensor_s * 3 * 2)
    # under zero_bubble W is an action and an autograd call of its own: it gathers the layers again
    assert v1.input_s + v1.weight_s == pytest.approx(v1.backward_s + cal.action_s + gather)
    assert v0.optimizer_s == 0.0
    # recompute: the backward runs the forward again
    llm = calibrated.stage("llm", 0)
    assert llm.backward_s == pytest.approx(8 * (0.030 + 0.015) * 4 / 16 + cal.action_s)
    assert llm.sync_s == pytest.approx(cal.allreduce_seconds(8 * 200 * MB, 2, 64))
    # the engine packs an unsharded dp stage's gradients for their sum and copies the sum back: a
    # sharded stage (FSDP2's reduce-scatter packs its own) and a stage without replicas copy nothing
    assert llm.gradient_copy_s == pytest.approx(cal.gradient_copy_s_per_byte * 8 * 200 * MB) and llm.gradient_copy_s > 0
    assert llm.closing_s == pytest.approx(llm.optimizer_s + llm.gradient_copy_s)
    assert v1.gradient_copy_s == 0.0 and calibrated.stage("audio", 0).gradient_copy_s == 0.0
    # a calibrated plan is predicted slower (every cost above comes on top), and says so with its calibration
    fast = plan_placements(profile, 4, top_k=1)[0]
    slow = plan_placements(profile, 4, top_k=1, calibration=cal)[0]
    assert slow.step_time_s > fast.step_time_s + cal.step_s


def replace_calibration(profile, cal):
    from dataclasses import replace

    return replace(profile, calibration=cal)


def _timed_after_gaps(rank: int, world: int) -> float:
    import time

    import torch

    from lightning_mmpp.plan.measure import _after_gaps

    calls = iter(range(20))

    def call() -> None:  # rank 1 is the slower one; its 8th call a 0.5 s outlier
        index = next(calls)
        time.sleep(0.5 if (rank, index) == (1, 7) else 0.002 if rank == 1 else 0.0005)

    return _after_gaps(call, 20, torch.device("cpu"), gap_s=0.001)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_collective_is_timed_call_by_call_on_the_slowest_rank_without_its_outliers():
    """_after_gaps: each call's time is the slowest rank's (2 ms, not rank 0's 0.5 ms), and the
    slowest 5% of calls (a 0.5 s outlier) stay out of the mean (with it, the mean is >= 27 ms)."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from dist import run_distributed

    means = run_distributed(_timed_after_gaps, 2)
    assert means[0] == means[1]  # one all-reduce of the maximum: every rank gets the same
    assert 0.002 <= means[0] < 0.02


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_calibrate_measures_positive_constants_and_validate_trains_plans(capsys):
    """calibrate() on 2 real processes, then the CLI plans a model with it and validates the top plan."""
    from lightning_mmpp.plan import calibrate

    cal = calibrate(2, steps=2, launches=1)
    # action_s is a difference of two timed steps, clamped at 0: on a loaded 2-core box it can come out 0
    assert cal.world_size == 2 and cal.action_s >= 0 and cal.p2p_latency_s > 0 and cal.gather_layer_s > 0
    assert set(cal.samples) == {"p2p", "allreduce", "fsdp", "sharded_optimizer", "optimizer", "gradient_copy",
                                "framework", "layer", "loss", "host_cores"}
    assert cal.samples["sharded_optimizer"][0] == 16 and cal.sharded_tensor_s >= 0
    assert [m for m, _ in cal.samples["framework"]["modules"]] == [2] and cal.module_s >= 0
    assert cal.gradient_copy_s_per_byte > 0  # two copies of every byte: 16 MiB cost more than 256 KiB
    outside = cal.samples["framework"]["chain_outside"]  # the chain's first rank, outside its pipeline
    assert 0 < outside < min(t for _, t in cal.samples["framework"]["chain"]) and cal.pipeline_step_s == outside
    assert cal.host_cores >= 1


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_measure_steps_trains_plans_after_a_warm_up_fit_and_reports_each_launch():
    """--validate's measurement: the plans trained through Trainer.fit on local processes, in
    every launch after one untimed warm-up fit; a median over all the launches' steps and each
    launch's own median."""
    import functools

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from models import MultiModalModel, make_loader

    from lightning_mmpp.plan import profile_model
    from lightning_mmpp.plan.validate import MeasuredStep, measure_runs, measure_steps

    topology = {"enc_a": ["llm"], "enc_b": ["llm"], "llm": []}
    batch = next(iter(make_loader(topology, 8, 8)))
    profile = profile_model(MultiModalModel(topology), batch, repeats=1)
    plans = plan_placements(profile, 2, top_k=2)
    make = functools.partial(MultiModalModel, topology)
    measured = measure_steps([(make, batch, plan) for plan in plans], steps=2, launches=2)
    assert len(measured) == len(plans)
    for step in measured:
        assert isinstance(step, MeasuredStep) and len(step.launch_medians_s) == 2
        low, high = step.spread_s
        assert 0 < low <= step.median_s <= high
        assert 0 < step.low_s <= step.median_s
    assert measure_runs([], steps=2) == []
    with pytest.raises(PipelineConfigError, match="launches"):
        measure_runs([(make, batch, plans[0])], launches=0)


def test_cli_reads_a_calibration_and_validate_needs_a_model(tmp_path, capsys):
    path, cal_path = tmp_path / "p.json", tmp_path / "cal.json"
    heterogeneous().to_json(path)
    _calibration().to_json(cal_path)
    assert cli_main(["--profile", str(path), "--world-size", "8", "--top-k", "2", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)["plans"][0]["step_time_s"]
    assert cli_main(["--profile", str(path), "--world-size", "8", "--top-k", "2",
                     "--calibration", str(cal_path)]) == 0
    out = capsys.readouterr().out
    assert "calibration: 4 ranks on cpu" in out and "per compute action 1.000 ms" in out
    assert cli_main(["--profile", str(path), "--world-size", "8", "--top-k", "2", "--json",
                     "--calibration", str(cal_path)]) == 0
    assert json.loads(capsys.readouterr().out)["plans"][0]["step_time_s"] > plain
    assert cli_main(["--profile", str(path), "--world-size", "8", "--calibration", str(tmp_path / "no.json")]) == 2
    assert "--calibrate" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["--profile", str(path), "--world-size", "8", "--validate", "1"])


def test_calibration_launches_merge_by_median_and_the_dp_run_sums_a_real_gradient():
    from lightning_mmpp.plan import calibrate
    from lightning_mmpp.plan.calibration import median_samples
    from lightning_mmpp.plan.measure import DP_LAYERS, _width

    launches = [{"p2p": [(256, 1.0), (1024, 4.0)], "framework": {"dp": [(2, 0.03), (32, 0.4)]}, "layer": [0.002, 0.004]},
                {"p2p": [(256, 3.0), (1024, 2.0)], "framework": {"dp": [(2, 0.05), (32, 0.5)]}, "layer": [0.001, 0.006]},
                {"p2p": [(256, 2.0), (1024, 9.0)], "framework": {"dp": [(2, 0.01), (32, 0.3)]}, "layer": [0.003, 0.005]}]
    merged = median_samples(launches)
    assert merged == {"p2p": [(256, 2.0), (1024, 4.0)], "framework": {"dp": [(2, 0.03), (32, 0.4)]},
                      "layer": [0.002, 0.005]}
    two = median_samples(launches[:2])
    assert two["layer"] == [pytest.approx(0.0015), pytest.approx(0.005)]
    # an even number of launches: sizes and microbatch counts stay ints (the chain's count is a
    # schedule's microbatch count when the fit times it)
    assert [type(m) for m, _ in two["framework"]["dp"]] == [int, int]
    assert [type(size) for size, _ in two["p2p"]] == [int, int]
    with pytest.raises(ValueError, match="different sample counts"):
        median_samples([{"p2p": [(1, 1.0)]}, {"p2p": []}])
    # a gradient of fewer floats than ranks leaves ring chunks empty and times no real sum
    for world in (2, 4, 64, 200):
        assert DP_LAYERS * _width(world) >= world
    with pytest.raises(PipelineConfigError, match="launches"):
        calibrate(2, launches=0)


def _threaded_conv(rank: int, world: int) -> int:
    """A convolution on the rank's intra-op threads (an OpenMP team where there are several)."""
    import torch

    conv = torch.nn.Conv2d(3, 8, 3)
    conv(torch.randn(4, 3, 32, 32)).sum().item()
    return torch.get_num_threads()


def test_local_processes_start_fresh_where_a_rank_gets_several_threads():
    from lightning_mmpp.plan.launch import rank_threads, start_method

    cores = os.cpu_count() or 1
    assert start_method(cores, "cpu") == "fork" and rank_threads(cores) == 1
    assert start_method(1, "cuda") == "spawn"
    assert start_method(1, "cpu") == ("spawn" if cores > 1 else "fork")


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_a_rank_with_several_threads_runs_after_its_parent_ran_openmp():
    """One rank on a machine of several cores gets them all; forked from a parent that already
    ran an OpenMP team (as after profiling a model), its first parallel region would hang."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs 2 cores: one rank must get several threads")
    import torch

    from lightning_mmpp.plan.launch import rank_threads, run_local

    threads = torch.get_num_threads()
    torch.set_num_threads(rank_threads(1))
    try:
        _threaded_conv(0, 1)  # the parent's OpenMP team
        assert run_local(_threaded_conv, 1, timeout=120) == [rank_threads(1)]
    finally:
        torch.set_num_threads(threads)
    # what cannot be rebuilt in a fresh process is refused before anything starts, naming the fix
    with pytest.raises(PipelineConfigError, match="must pickle.*module level"):
        run_local(lambda rank, world: rank, 1)


def test_a_script_model_pickles_as_its_path_and_builds_its_class():
    import pickle

    from lightning_mmpp.plan.target import ScriptModel, load_target

    path = os.path.join(ROOT, "examples", "train_multimodal.py")
    make = pickle.loads(pickle.dumps(ScriptModel(path, "VisionAudioLM")))
    cls, _, _ = load_target(f"{path}:VisionAudioLM", 4)
    assert type(make()) is cls  # the script is loaded once per process


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_cli_validates_where_one_rank_gets_every_core(tmp_path, capsys):
    """--world-size 1 --validate: the rank gets the cores (several threads), so the measuring
    process is spawned and rebuilds the script's model from its path (it hung when forked)."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs 2 cores: the rank must get several threads")
    cal_path = tmp_path / "cal.json"
    _calibration().to_json(cal_path)
    target = os.path.join(ROOT, "examples", "train_multimodal.py") + ":VisionAudioLM"
    assert cli_main([target, "--world-size", "1", "--batch-size", "8", "--repeats", "1", "--top-k", "1",
                     "--calibration", str(cal_path), "--validate", "1", "--validate-steps", "2",
                     "--launches", "1"]) == 0
    out = capsys.readouterr().out
    assert "measured here through Trainer.fit" in out and "measured/predicted" in out and "unstalled steps" in out
