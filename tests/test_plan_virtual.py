"""The planner with virtual stages: ``virtual_options`` in the search, its bounds, its API (one process, fast)."""

from __future__ import annotations

import json

import pytest

from lightning_mmpp.core.kinds import ScheduleName
from lightning_mmpp.core.placement import ModulePlacement, PipelineLayout
from lightning_mmpp.core.schedule import build_schedule
from lightning_mmpp.core.simulator import simulate, validate_schedule
from lightning_mmpp.errors import PipelineConfigError
from lightning_mmpp.plan import LayerProfile, ModelProfile, ModuleProfile, Plan, plan_placements, plans_table
from lightning_mmpp.plan.__main__ import main as cli_main
from lightning_mmpp.plan.costs import CostModel
from lightning_mmpp.plan.search import _plan_key

MB = 2**20
# an LM of 16 layers of 16 MiB (1 GiB of parameters, gradients and Adam state): 400 MiB per rank
# without sharding needs pp = 4, and one sample per microbatch leaves a 4-stage 1F1B half idle
LIMIT = 400 * MB


def layers(n: int, forward: float, backward: float, output: float = MB / 8) -> list[LayerProfile]:
    return [LayerProfile(str(i), forward, backward, param_bytes=16 * MB, activation_bytes_per_sample=MB,
                         input_bytes_per_sample=output, output_bytes_per_sample=output) for i in range(n)]


def chain(bandwidth: float = 20e9, output: float = MB / 8) -> ModelProfile:
    """One 16-layer module, 4 samples per step (times per 4 samples)."""
    return ModelProfile(modules={"llm": ModuleProfile(layers(16, 0.010, 0.020, output))}, topology={"llm": []},
                        profile_batch_size=4, batch_size=4, bandwidth_bytes_per_s=bandwidth, latency_s=1e-5)


def encoders_and_lm(bandwidth: float = 20e9, output: float = MB / 8) -> ModelProfile:
    """Two 4-layer encoders feeding the 16-layer LM."""
    return ModelProfile(
        modules={"vision": ModuleProfile(layers(4, 0.010, 0.020, output)),
                 "audio": ModuleProfile(layers(4, 0.008, 0.016, output)),
                 "llm": ModuleProfile(layers(16, 0.010, 0.020, output))},
        topology={"vision": ["llm"], "audio": ["llm"], "llm": []},
        profile_batch_size=4, batch_size=4, bandwidth_bytes_per_s=bandwidth, latency_s=1e-5)


CASES = {"chain": (chain, 4), "encoders_and_lm": (encoders_and_lm, 6)}


def plan(profile: ModelProfile, world: int, **kw) -> list[Plan]:
    kw.setdefault("memory_limit_bytes", LIMIT)
    kw.setdefault("allow_shard", False)  # else dp with FSDP fits, and virtual stages are never sharded
    return plan_placements(profile, world, **kw)


def keys(plans) -> list:
    return [_plan_key(p) for p in plans]


def virtual(p: Plan) -> bool:
    return any(x.virtual_stages > 1 for x in p.placements.values())


def test_default_virtual_options_give_the_plans_without_virtual_stages():
    profile, world = encoders_and_lm(), 6
    default = plan(profile, world, top_k=8)
    assert not any(virtual(p) for p in default)
    assert keys(plan(profile, world, top_k=8, virtual_options=(1,))) == keys(default)
    assert keys(plan(profile, world, top_k=8, virtual_options={"llm": (1,)})) == keys(default)
    # counts no module has the layers for (2 * 9 > 16) change nothing
    assert keys(plan(profile, world, top_k=8, virtual_options=(1, 9))) == keys(default)


@pytest.mark.parametrize("case", list(CASES))
def test_interleaving_pays_with_many_layers_and_few_microbatches(case):
    """4 samples, so at most 4 microbatches on a 4-deep LM: 1F1B idles most of the step and
    2 chunks per rank halve the fill and drain; the top plan interleaves."""
    make, world = CASES[case]
    best_plain = plan(make(), world, top_k=1, tolerance=0.0)[0]
    plans = plan(make(), world, top_k=5, virtual_options=(1, 2), tolerance=0.0)
    top = plans[0]
    assert top.placements["llm"].virtual_stages == 2 and top.schedule == "interleaved_1f1b", plans_table(plans)
    assert top.step_time_s < 0.95 * best_plain.step_time_s
    assert top.placements["llm"].pp >= 2 and len(top.placements["llm"].split_points) == 2 * top.placements["llm"].pp - 1
    assert max(top.peak_memory_bytes) <= LIMIT
    # the v=1 plans are still there, scored as before
    plain = [p for p in plans if not virtual(p)]
    assert plain and plain[0].step_time_s == pytest.approx(best_plain.step_time_s)


@pytest.mark.parametrize("case", list(CASES))
def test_costly_transfers_keep_one_chunk_per_rank(case):
    """4 MiB per sample over 200 MB/s: the extra boundaries of interleaving cost more than the
    bubble it removes."""
    make, world = CASES[case]
    slow = make(bandwidth=2e8, output=4 * MB)
    plans = plan(slow, world, top_k=5, virtual_options=(1, 2), tolerance=0.0)
    assert not virtual(plans[0]), plans_table(plans)
    assert plans[0].step_time_s == pytest.approx(plan(slow, world, top_k=1, tolerance=0.0)[0].step_time_s)
    held = plan(slow, world, top_k=1, virtual_options={"llm": (2,)})[0]  # the LM must interleave
    assert held.placements["llm"].virtual_stages == 2 and held.step_time_s > plans[0].step_time_s


def test_zero_bubble_listed_scores_virtual_candidates_under_zbv():
    plans = plan(chain(), 4, top_k=10, virtual_options=(1, 2), schedules=("1f1b", "zero_bubble"))
    schedules = {(p.schedule, virtual(p)) for p in plans}
    assert {("zbv", True), ("interleaved_1f1b", True), ("1f1b", False), ("zero_bubble", False)} <= schedules
    assert not ({("zbv", False), ("interleaved_1f1b", False), ("1f1b", True), ("zero_bubble", True)} & schedules)
    only_zb = plan(chain(), 4, top_k=10, virtual_options=(1, 2), schedules=("zero_bubble",))
    assert {p.schedule for p in only_zb if virtual(p)} == {"zbv"}


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_pruned_search_with_virtual_stages_returns_the_exhaustive_top_plans(schedule):
    """With tolerance 0 the bounds (busy, compute-only fill, cost model: all valid for chunks)
    skip only candidates that cannot be among the best; also with recompute on for memory."""
    for profile, world, limits in ((chain(), 4, {}), (encoders_and_lm(), 6, {}),
                                   (encoders_and_lm(), 6, {"memory_limit_bytes": 270 * MB}),
                                   (encoders_and_lm(bandwidth=2e8, output=4 * MB), 6, {})):
        kw = dict(schedules=(schedule,), virtual_options=(1, 2, 3), **limits)
        everything = plan(profile, world, top_k=10_000, exhaustive=True, **kw)
        fast = plan(profile, world, top_k=5, tolerance=0.0, **kw)
        assert [p.step_time_s for p in fast] == pytest.approx([p.step_time_s for p in everything[:5]])
        assert any(virtual(p) for p in everything)
        if limits:  # the LM's 256 MiB of state leave too little for its activations without recompute
            assert any(virtual(p) and p.placements["llm"].recompute for p in everything)
        for p in everything:
            assert p.lower_bound_s <= p.step_time_s * (1 + 1e-9), p.describe()
            for name, x in p.placements.items():  # what the engine runs, and a layer per chunk at least
                assert x.virtual_stages == 1 or (x.pp >= 2 and x.tp == 1 and not x.shard
                                                 and x.num_stages <= len(profile.modules[name].layers))


def test_a_proposed_virtual_plan_validates_and_its_prediction_is_the_simulators():
    """The strategy's layout from the plan's placements (V-shaped under zbv), its schedule built
    and proven deadlock-free by the simulator, and the prediction re-derived from the same costs."""
    for schedules in (("1f1b",), ("zero_bubble",)):
        top = plan(encoders_and_lm(), 6, top_k=1, virtual_options={"llm": (2,)}, schedules=schedules)[0]
        assert virtual(top) and top.schedule == ("zbv" if schedules == ("zero_bubble",) else "interleaved_1f1b")
        layout = PipelineLayout(top.placements, top.topology, v_shape=ScheduleName.parse(top.schedule).v_shape)
        assert layout.world_size == 6 and str(top.layout()) == str(layout)
        built = build_schedule(layout, top.num_microbatches, top.schedule)
        validate_schedule(built, layout)
        cost = CostModel(encoders_and_lm(), top.placements, top.num_microbatches, v_shape=layout.v_shape)
        result = simulate(built, layout, cost.forward, cost.backward, mode="eager", input_cost=cost.input,
                          weight_cost=cost.weight)
        assert 0 < result.step_time <= top.step_time_s


def test_v_shape_hand_off_at_the_bottom_of_the_v_is_free():
    profile = chain(bandwidth=1e9, output=MB)
    placement = {"llm": ModulePlacement(pp=2, virtual_stages=2, rank_offset=0)}
    interleaved = CostModel(profile, placement, 2)
    v_shaped = CostModel(profile, placement, 2, v_shape=True)
    # stage 1 -> 2 crosses ranks when interleaved (positions 1, 0), stays on rank 1 V-shaped
    assert interleaved.received_seconds("llm", 2) > 0 and v_shaped.received_seconds("llm", 2) == 0
    assert interleaved.gradient_seconds("llm", 1) > 0 and v_shaped.gradient_seconds("llm", 1) == 0
    assert v_shaped.received_seconds("llm", 1) == interleaved.received_seconds("llm", 1) > 0


def test_plan_shows_and_keeps_virtual_stages(tmp_path):
    top = plan(chain(), 4, top_k=1, virtual_options=(1, 2))[0]
    assert " v2 @" in top.describe() and "virtual_stages=2" in top.snippet()
    assert "v chunks per rank" in plans_table([top]) and " v2 @" in plans_table([top])
    namespace: dict = {}
    code = top.snippet().replace("strategy = MultiModulePipelineStrategy(", "args = dict(").replace(
        "from lightning_mmpp import ModulePlacement, MultiModulePipelineStrategy",
        "from lightning_mmpp.core.placement import ModulePlacement")  # no torch import: the test stays fast
    exec(code, namespace)  # noqa: S102
    assert namespace["args"]["placements"] == top.placements and namespace["args"]["schedule"] == top.schedule
    assert top.to_dict()["placements"]["llm"]["virtual_stages"] == 2
    path = tmp_path / "plan.json"
    top.to_json(path)
    for again in (Plan.from_json(path), Plan.from_json(top.to_json()), Plan.from_dict(json.loads(path.read_text()))):
        assert again == top and again.layout().v_shape == top.layout().v_shape
    plain = plan(chain(), 4, top_k=1)[0]
    assert " v" not in plain.describe() and "virtual_stages" not in plain.snippet()
    assert Plan.from_json(plain.to_json()) == plain


def test_virtual_options_errors():
    profile = encoders_and_lm()
    with pytest.raises(PipelineConfigError, match="does not have"):
        plan_placements(profile, 4, virtual_options={"text": (1, 2)})
    with pytest.raises(PipelineConfigError, match=r"at least 10 layers, but 'vision' has 4.*up to 2"):
        plan_placements(profile, 4, virtual_options={"vision": (1, 5)})
    for bad in ((0, 2), (1, 2.0), (), (True,)):
        with pytest.raises(PipelineConfigError, match="integers >= 1"):
            plan_placements(profile, 4, virtual_options=bad)


def test_virtual_stages_never_come_with_tp_or_shard():
    profile = chain()
    plans = plan_placements(profile, 4, top_k=50, virtual_options=(1, 2), tp_options=(1, 2), memory_limit_bytes=LIMIT)
    assert any(virtual(p) for p in plans) and any(p.placements["llm"].tp > 1 for p in plans)
    assert any(p.placements["llm"].shard for p in plans)
    for p in plans:
        x = p.placements["llm"]
        assert x.virtual_stages == 1 or (x.tp == 1 and not x.shard)
    # tp 2 only: no module can interleave
    assert not any(virtual(p) for p in plan_placements(profile, 4, top_k=20, virtual_options=(1, 2),
                                                       tp_options={"llm": (2,)}))


def test_cli_virtual(tmp_path, capsys):
    path = tmp_path / "profile.json"
    chain().to_json(path)
    args = ["--profile", str(path), "--world-size", "4", "--memory-limit", "400MiB", "--json", "--top-k", "10"]
    assert cli_main(args) == 0
    assert not any(p["placements"]["llm"]["virtual_stages"] > 1 for p in json.loads(capsys.readouterr().out)["plans"])
    assert cli_main([*args, "--virtual", "1", "2"]) == 0
    plans = json.loads(capsys.readouterr().out)["plans"]
    expected = plan_placements(chain(), 4, memory_limit_bytes=LIMIT, top_k=10, virtual_options=(1, 2))
    assert [Plan.from_dict(p) for p in plans] == expected
    assert any(p["placements"]["llm"]["virtual_stages"] == 2 and p["schedule"] == "interleaved_1f1b" for p in plans)
    assert cli_main([*args, "--virtual", "1", "2", "--virtual-modules", "llm"]) == 0
    assert json.loads(capsys.readouterr().out)["plans"] == plans
    assert cli_main([*args, "--virtual", "0"]) == 2
    assert "integers >= 1" in capsys.readouterr().err


def model_profile() -> ModelProfile:
    """A hand-written profile of the test suite's ``MultiModalModel`` on two encoders (3 layers
    each: encoder, projection, tanh) and an LM of 4 blocks and a head, 8 samples per step."""
    return ModelProfile(
        modules={"enc_a": ModuleProfile(layers(3, 0.002, 0.004)), "enc_b": ModuleProfile(layers(3, 0.002, 0.004)),
                 "llm": ModuleProfile(layers(5, 0.010, 0.020))},
        topology={"enc_a": ["llm"], "enc_b": ["llm"], "llm": []},
        profile_batch_size=8, batch_size=8, bandwidth_bytes_per_s=20e9, latency_s=1e-5)


@pytest.mark.distributed
@pytest.mark.timeout(400)
@pytest.mark.parametrize("schedules", [("1f1b",), ("zero_bubble",)])
def test_a_planned_virtual_layout_trains_as_one_process(schedules):
    """The planner's v=2 plan, handed to the strategy as it is (placements, microbatches,
    schedule), trains the test model to the single-process result."""
    from tests.dist import require_ranks, run_distributed
    from tests.test_equivalence import _check, _pipelined, _reference

    top = plan_placements(model_profile(), 4, num_microbatches=4, top_k=1, schedules=schedules,
                          virtual_options={"llm": (2,)})[0]
    assert top.placements["llm"].virtual_stages == 2 and top.schedule in ("interleaved_1f1b", "zbv"), top.describe()
    require_ranks(top.world_size)
    topology = top.topology
    reference = _reference(topology, top.batch_size, "adam", 0.05)
    per_rank = run_distributed(_pipelined, top.world_size, topology, top.placements, top.num_microbatches,
                               top.batch_size, "adam", 0.05, (top.schedule,), timeout=360, init_pg=False)
    _check(per_rank, reference, (top.schedule,), adam=True)
