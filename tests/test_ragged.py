"""Ragged multimodal batches (issue 29): ``n_i`` images per sample, zeros allowed, text of
per-sample length padded per microbatch, a per-token loss; pipelined training equals one process
whatever the layout, schedule and ``balance``, including microbatches in which an encoder replica
gets no image. In-process: the splitting rule, the balance assignment, the bridges' splits and
joins by sample, and the errors."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from lightning_mmpp import ModulePlacement, PipelineConfigError, PipelineEngine, PipelineLayout, Ragged
from lightning_mmpp import run_unpipelined
from lightning_mmpp.core.balance import item_bounds
from lightning_mmpp.engine.microbatch import BatchSplitter, batch_size_of, sample_routing, split_microbatches
from lightning_mmpp.engine.payload import concat_payloads, split_payload
from lightning_mmpp.core.kinds import StepKind
from tests.dist import require_ranks, run_distributed
from tests.ragged_model import RaggedVLM, ragged_batches
from tests.test_readme_snippet import run_readme_snippet

P = ModulePlacement
STEPS = 3
BATCH = 8
M = 2
LR = 0.2
ONE_ENC = {"img": ["llm"], "llm": []}
TWO_ENC = {"img": ["llm"], "enc_b": ["llm"], "llm": []}

# id: (topology, placements); every one runs under 1f1b and zero_bubble, by index and by items
LAYOUTS = {
    "img_dp2-llm": (ONE_ENC, {"img": P(dp=2), "llm": P()}),
    "img-llm_dp2": (ONE_ENC, {"img": P(), "llm": P(dp=2)}),
    "img_dp2-llm_dp2": (ONE_ENC, {"img": P(dp=2), "llm": P(dp=2)}),
    "img_colocated_llm_dp2": (ONE_ENC, {"img": P(dp=2, rank_offset=0), "llm": P(dp=2, rank_offset=0)}),
    "img_dp2+enc_b-llm_pp2": (TWO_ENC, {"img": P(dp=2), "enc_b": P(), "llm": P(pp=2)}),
    "img_pp2-llm": (ONE_ENC, {"img": P(pp=2), "llm": P()}),  # a Ragged between the encoder's stages
}
SCHEDULES = ("1f1b", "zero_bubble")


def _with_balance(placements: dict, balance: str) -> dict:
    return {name: dataclasses.replace(p, balance=balance) if name != "llm" else p for name, p in placements.items()}


def _configs(layouts: list[str]) -> list[tuple[str, dict, dict, str]]:
    """(id, topology, placements, schedule) for each layout x balance x schedule."""
    out = []
    for layout in layouts:
        topology, placements = LAYOUTS[layout]
        balances = ("samples", "items") if placements["img"].dp > 1 else ("samples",)  # items: no-op on dp=1
        for balance in balances:
            for schedule in SCHEDULES:
                out.append((f"{layout}/{balance}/{schedule}", topology, _with_balance(placements, balance), schedule))
    return out


def _reference(topology) -> dict[str, torch.Tensor]:
    model = RaggedVLM(topology)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for batch in ragged_batches(STEPS, BATCH, "enc_b" in topology):
        optimizer.zero_grad()
        loss, _ = run_unpipelined(model, batch)
        loss.backward()
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(rank, world, configs):
    from torch.distributed.tensor import DTensor

    torch.set_num_threads(1)
    results = {}
    for name, topology, placements, schedule in configs:
        model = RaggedVLM(topology)
        engine = PipelineEngine(model, PipelineLayout(placements, topology), num_microbatches=M, schedule=schedule)
        optimizer = torch.optim.SGD(engine.parameters(), lr=LR)
        for batch in ragged_batches(STEPS, BATCH, "enc_b" in topology):
            optimizer.zero_grad()
            engine.step(batch)
            optimizer.step()
        own = {id(p) for p in engine.parameters()}
        results[name] = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                         for n, p in model.named_parameters() if id(p) in own}
        engine.close()
    return results


def _check(per_rank, configs):
    references = {}
    for name, topology, _, _ in configs:
        key = tuple(topology)
        if key not in references:
            references[key] = _reference(topology)
        reference = references[key]
        seen = set()
        for result in per_rank:
            for param, value in result[name].items():
                torch.testing.assert_close(value, reference[param], rtol=1e-5, atol=1e-6, msg=f"{name} {param}")
                seen.add(param)
        assert seen == set(reference), f"{name}: missing {set(reference) - seen}"


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layouts", [
    ["img_colocated_llm_dp2"],
    ["img_dp2-llm", "img-llm_dp2", "img_pp2-llm"],
    ["img_dp2-llm_dp2"],
    ["img_dp2+enc_b-llm_pp2"],
], ids=lambda layouts: "+".join(layouts))
def test_ragged_training_matches_single_process(layouts):
    configs = _configs(layouts)
    world = PipelineLayout(configs[0][2], configs[0][1]).world_size
    assert all(PipelineLayout(c[2], c[1]).world_size == world for c in configs)
    require_ranks(world)
    per_rank = run_distributed(_train, world, configs, timeout=240)
    _check(per_rank, configs)


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_ragged_sharded_encoder_with_empty_replicas_matches_single_process():
    """FSDP2: an encoder replica with no image still joins the all-gathers and reduce-scatters."""
    topology = ONE_ENC
    configs = [
        (f"sharded/{balance}", topology, {"img": P(dp=2, shard=True, balance=balance), "llm": P()}, "1f1b")
        for balance in ("samples", "items")
    ]
    per_rank = run_distributed(_train, 3, configs, timeout=200)
    _check(per_rank, configs)


# --- in process ----------------------------------------------------------------------------


def test_ragged_validates_counts():
    with pytest.raises(PipelineConfigError, match="counts sum to 3 but values has 4 rows"):
        Ragged(torch.zeros(4, 2), [1, 2])
    with pytest.raises(PipelineConfigError, match="must be >= 0"):
        Ragged(torch.zeros(1, 2), [2, -1])
    with pytest.raises(PipelineConfigError, match="1-D integer tensor"):
        Ragged(torch.zeros(1, 2), torch.tensor([1.0]))
    r = Ragged.from_list([torch.ones(2, 3), torch.zeros(0, 3), 2 * torch.ones(1, 3)])
    assert r.counts.tolist() == [2, 0, 1] and r.values.shape == (3, 3)
    assert [t.shape[0] for t in r.items()] == [2, 0, 1]
    back = pickle.loads(pickle.dumps(r))  # DataLoader workers send batches pickled
    assert torch.equal(back.values, r.values) and back.counts.tolist() == [2, 0, 1]
    assert r.to(torch.float64).values.dtype == torch.float64 and r.to(torch.float64).counts.dtype == torch.int64


def test_splitting_rule_splits_ragged_by_sample():
    values = torch.arange(10).float().unsqueeze(1)  # item rows 0..9
    batch = {"images": Ragged(values, [0, 3, 1, 0, 2, 4]), "ids": torch.arange(6)}
    assert batch_size_of(batch) == 6
    parts = split_microbatches(batch, 2)
    assert parts[0]["images"].counts.tolist() == [0, 3, 1]
    assert parts[0]["images"].values.squeeze(1).tolist() == [0, 1, 2, 3]
    assert parts[1]["images"].counts.tolist() == [0, 2, 4]
    assert parts[1]["images"].values.squeeze(1).tolist() == [4, 5, 6, 7, 8, 9]
    assert parts[1]["ids"].tolist() == [3, 4, 5]


def test_batch_errors_name_the_ragged_field_and_the_fix():
    with pytest.raises(PipelineConfigError, match=r"\['images'\]: 3.*\['ids'\]: 4"):
        batch_size_of({"images": Ragged(torch.zeros(2, 1), [1, 0, 1]), "ids": torch.zeros(4)})
    bad = Ragged(torch.zeros(2, 1), [1, 1])
    bad.counts = torch.tensor([1, 2])  # replaced after construction
    with pytest.raises(PipelineConfigError, match=r"batch field \['images'\]: Ragged: counts sum to 3"):
        batch_size_of({"images": bad, "ids": torch.zeros(2)})
    bad.counts = torch.tensor([3, -1])
    with pytest.raises(PipelineConfigError, match=r"\['images'\].*>= 0"):
        batch_size_of({"images": bad, "ids": torch.zeros(2)})
    # a per-sample list of tensors is a container, refused with the field and the fix named
    per_sample = [torch.zeros(2, 1), torch.zeros(4, 1)]
    with pytest.raises(PipelineConfigError, match=r"list of tensors at \['images'\].*Ragged.from_list"):
        batch_size_of({"images": per_sample, "ids": torch.zeros(2)})


def test_item_bounds_balance_items_contiguously():
    assert item_bounds([0, 0, 0, 3], 2) == (0, 3, 4)
    assert item_bounds([4, 0, 0, 0], 2) == (0, 1, 4)
    assert item_bounds([0, 0, 0, 0], 2) == (0, 2, 4)  # no items: equal samples
    assert item_bounds([4, 4, 4, 4, 1, 1, 1, 1], 2) == (0, 3, 8)  # 12 items each way: fewer samples
    assert item_bounds([2, 2, 2, 2], 4) == (0, 1, 2, 3, 4)
    # 20% of the samples carry 80% of the items: the heavy replica gets fewer samples
    skewed = [16, 16, 1, 1, 1, 1, 1, 1, 1, 1]
    bounds = item_bounds(skewed, 2)
    loads = [sum(skewed[a:b]) for a, b in zip(bounds, bounds[1:])]
    assert bounds == (0, 1, 10) and max(loads) == 24
    for weights in ([1, 2, 3, 4, 5, 6, 7], [0] * 5 + [9], [3, 0, 0, 0, 3, 0]):
        for parts in (1, 2, 3):
            b = item_bounds(weights, parts)
            assert b[0] == 0 and b[-1] == len(weights) and all(x < y for x, y in zip(b, b[1:]))
            best = min(max(sum(weights[a:b2]) for a, b2 in zip(c, c[1:])) for c in _all_splits(len(weights), parts))
            assert max(sum(weights[a:c]) for a, c in zip(b, b[1:])) == best
            for offsets in ([100, 0, 0][:parts], [0, 7, 3][:parts], [5, 5, 40][:parts]):  # earlier microbatches
                b = item_bounds(weights, parts, offsets)
                load = lambda c: max(o + sum(weights[x:y]) for o, x, y in zip(offsets, c, c[1:]))  # noqa: E731
                assert all(x < y for x, y in zip(b, b[1:])) and load(b) == min(map(load, _all_splits(len(weights), parts)))


def _all_splits(n, parts):
    from itertools import combinations

    for cuts in combinations(range(1, n), parts - 1):
        yield (0, *cuts, n)


def test_balance_is_validated_and_routes_bridges():
    with pytest.raises(PipelineConfigError, match="balance='tokens'"):
        P(balance="tokens")
    with pytest.raises(PipelineConfigError, match="a sink"):
        PipelineLayout({"img": P(), "llm": P(dp=2, balance="items")}, ONE_ENC)
    layout = PipelineLayout({"img": P(dp=2, balance="items"), "llm": P(dp=2)}, ONE_ENC)
    assert layout.routed("img", "llm")
    slot = layout.slot(0, "img")
    assert [peer.rank for _, peer in layout.forward_targets(slot)] == [2, 3]  # every llm replica
    plain = PipelineLayout({"img": P(dp=2), "llm": P(dp=2)}, ONE_ENC)
    assert [peer.rank for _, peer in plain.forward_targets(plain.slot(0, "img"))] == [2]


def test_routing_assigns_by_items_and_shards_follow():
    layout = PipelineLayout({"img": P(dp=2, balance="items"), "llm": P(dp=2)}, ONE_ENC)
    batch = next(ragged_batches(1, BATCH, False))  # counts (0, 0, 0, 3, 2, 4, 0, 1)
    splitter = BatchSplitter(layout, 0, M)
    m, shard = splitter.split(batch, StepKind.TRAIN)
    routing = splitter.routing
    # microbatch 1, counts (2, 4, 0, 1): replica 1 already holds 3 images, so 6 | 1 (totals 6, 4)
    # beats the even-looking 2 | 5 (totals 2, 8): the step waits for the replica with most images
    assert routing.bounds("img", 0) == (0, 3, 4) and routing.bounds("img", 1) == (0, 2, 4)
    assert routing.bounds("llm", 0) == (0, 2, 4)
    assert shard("img", 0)["images"].counts.tolist() == [0, 0, 0]  # this replica: no image
    assert shard("img", 1)["images"].counts.tolist() == [2, 4]
    # img replica 0 sends its 3 samples of microbatch 0: 2 to llm replica 0, 1 to replica 1
    assert routing.piece_sizes("img", "llm", 0, True, 0) == [2, 1]
    assert routing.piece_sizes("img", "llm", 1, True, 0) == [0, 1]
    assert routing.piece_sizes("img", "llm", 1, False, 0) == [1, 1]  # llm replica 1 receives from both
    # the heavier side of an uneven split goes to the replica with fewer images so far
    micro = [{"images": Ragged(torch.zeros(3, 1), [1, 1, 1])} for _ in range(2)]
    assert [sample_routing(layout, micro, 3).bounds("img", k) for k in (0, 1)] == [(0, 2, 3), (0, 1, 3)]
    with pytest.raises(PipelineConfigError, match="holds no lightning_mmpp.Ragged"):
        sample_routing(layout, [{"x": torch.zeros(4)}], 4)


def test_bridge_split_and_concat_by_sample_round_trip():
    values = torch.arange(7).float().unsqueeze(1).requires_grad_()
    payload = {"feat": Ragged(values, [2, 0, 0, 5]), "pooled": torch.arange(4).float()}
    pieces = split_payload(payload, 3, sizes=[1, 0, 3])
    assert [p["feat"].counts.tolist() for p in pieces] == [[2], [], [0, 0, 5]]
    assert [p["feat"].values.shape[0] for p in pieces] == [2, 0, 5]
    assert [p["pooled"].tolist() for p in pieces] == [[0.0], [], [1.0, 2.0, 3.0]]
    joined = concat_payloads(pieces)
    assert torch.equal(joined["feat"].values, values) and joined["feat"].counts.tolist() == [2, 0, 0, 5]
    equal = split_payload(payload, 2)  # equal chunks: by sample, not by row
    assert [p["feat"].counts.tolist() for p in equal] == [[2, 0], [0, 5]]
    with pytest.raises(PipelineConfigError, match="cannot split the samples of size 4"):
        split_payload(payload, 3)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_readme_ragged_snippet_trains_under_lightning(tmp_path):
    """The README's "Ragged batches" example (Lightning's launcher, batch transfer and sampler with
    a Ragged field, balance="items") trains as shown, its step count lowered."""
    out = run_readme_snippet("Ragged batches", tmp_path, "max_steps=10", "max_steps=2")
    assert "`max_steps=2` reached" in out, out[-4000:]
