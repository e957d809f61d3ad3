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
def test_lower_bound_never_exceeds_the_simulated_step(schedule):
    """Pruning is exact only if the bound holds for every candidate the search could skip."""
    for profile, world in ((heterogeneous(batch=16), 5), (encoders_and_lm(), 6)):
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
