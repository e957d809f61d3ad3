"""Parameters tied across stages and modules (``head.weight = embed.weight``)."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_mmpp import ModulePlacement, MultiModulePipelineStrategy, materialize
from lightning_mmpp.model.partition import find_tied_parameters
from lightning_mmpp.core.placement import PipelineLayout
from tests.compare import assert_close_after_adam
from tests.dist import run_distributed
from tests.models import MultiModalModel, make_loader
from tests.test_materialize import MetaBuiltModel

P = ModulePlacement
STEPS = 3
ONE_ENC = {"enc_a": ["llm"], "llm": []}
LLM_ONLY = {"llm": []}
TIED = ("llm.0.emb.weight", "llm.4.out.weight")


def _tie(model) -> None:
    model.llm[4].out.weight = model.llm[0].emb.weight  # [VOCAB, HIDDEN] both: the input/output embedding tie


class TiedModel(MultiModalModel):
    def __init__(self, topology, **kwargs):
        super().__init__(topology, **kwargs)
        _tie(self)


class MetaTiedModel(MetaBuiltModel):
    def configure_model(self):
        built = hasattr(self, "llm")
        super().configure_model()
        if not built:
            _tie(self)


def _all_params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}


def _kwargs(devices, clip=None):
    return dict(accelerator="cpu", devices=devices, max_steps=STEPS, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                gradient_clip_val=clip)


def test_ties_are_found_by_identity():
    model = TiedModel(ONE_ENC)
    layout = PipelineLayout({"enc_a": P(), "llm": P(pp=2)}, ONE_ENC)
    (tie,) = find_tied_parameters(model, layout)
    assert tie.names == list(TIED) and tie.owners == [("llm", 0), ("llm", 1)]
    assert tie.first_owner_name == "llm.0.emb" and tie.attribute == "weight"
    # within one stage nothing is tied across ranks
    assert find_tied_parameters(model, PipelineLayout({"enc_a": P(), "llm": P()}, ONE_ENC)) == []


def test_materialize_initialises_a_tied_parameter_by_its_first_owner():
    model = MetaTiedModel(ONE_ENC)
    with torch.device("meta"):
        model.configure_model()
    materialize(model, seed=3)
    assert model.llm[4].out.weight is model.llm[0].emb.weight
    plain = MetaBuiltModel(ONE_ENC)
    with torch.device("meta"):
        plain.configure_model()
    materialize(plain, seed=3)
    assert torch.equal(model.llm[0].emb.weight, plain.llm[0].emb.weight)  # the embedding's init
    assert torch.equal(model.llm[4].out.bias, plain.llm[4].out.bias)  # the head's other tensors as untied


def _reference(topology, meta: bool, optimizer: str, clip):
    if meta:
        model = MetaTiedModel(topology, optimizer=optimizer)
        with torch.device("meta"):
            model.configure_model()
        materialize(model, seed=11)
    else:
        model = TiedModel(topology, optimizer=optimizer)
    initial = _all_params(model)
    L.Trainer(**_kwargs(1, clip)).fit(model, make_loader(topology, 8, 8 * STEPS))
    return initial, _all_params(model)


def _pipelined(rank, world, topology, placements, meta, optimizer, clip):
    L.seed_everything(11, verbose=False)
    model = (MetaTiedModel if meta else TiedModel)(topology, optimizer=optimizer)
    strategy = MultiModulePipelineStrategy(placements, topology, num_microbatches=2)
    initial = {}

    class Record(L.Callback):
        def on_train_start(self, trainer, pl_module):
            initial.update(_all_params(pl_module))

    L.Trainer(**_kwargs(world, clip), strategy=strategy, callbacks=[Record()]).fit(
        model, make_loader(topology, 8, 8 * STEPS))
    return initial, _all_params(model)


CASES = {
    "pp2_eager_adam_clip": (ONE_ENC, {"enc_a": P(), "llm": P(pp=2)}, False, "adam", 0.05),
    "pp2_dp2_meta": (LLM_ONLY, {"llm": P(pp=2, dp=2)}, True, "sgd", None),
}


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.distributed
def test_tied_weights_train_like_one_process(case):
    topology, placements, meta, optimizer, clip = CASES[case]
    initial, final = _reference(topology, meta, optimizer, clip)
    world = PipelineLayout(placements, topology).world_size
    per_rank = run_distributed(_pipelined, world, topology, placements, meta, optimizer, clip, timeout=200,
                               init_pg=False)
    held = set()
    for start, end in per_rank:
        for name, value in start.items():
            assert torch.equal(value, initial[name]), f"initial {name}"
            if optimizer == "adam":
                assert_close_after_adam(end[name], final[name], name)
            else:
                torch.testing.assert_close(end[name], final[name], rtol=1e-5, atol=1e-6, msg=name)
            held.add(name)
        if all(n in end for n in TIED):  # a rank holding both ends holds one parameter
            assert torch.equal(end[TIED[0]], end[TIED[1]])
    assert held == set(final)
    # the two stage copies, on different ranks, are identical after training
    ends = [end[n] for _, end in per_rank for n in TIED if n in end]
    assert all(torch.equal(ends[0], e) for e in ends)


def test_pretrained_source_with_one_name_of_a_tied_tensor(tmp_path):
    """A tied checkpoint stores the tensor once (Hugging Face drops lm_head.weight): enough, strict."""
    values = TiedModel(ONE_ENC)
    state = {k: v.clone() for k, v in values.llm.state_dict().items() if k != "4.out.weight"}
    torch.save(state, tmp_path / "llm.pt")
    from lightning_mmpp import load_pretrained

    model = MetaTiedModel(ONE_ENC)
    with torch.device("meta"):
        model.configure_model()
    load_pretrained(model, {"llm": str(tmp_path / "llm.pt")}, seed=0)
    assert model.llm[4].out.weight is model.llm[0].emb.weight
    assert torch.equal(model.llm[4].out.weight, values.llm[0].emb.weight)


def _save_resume(rank, world, root):
    topology, placements = ONE_ENC, {"enc_a": P(), "llm": P(pp=2)}
    L.seed_everything(11, verbose=False)
    model = TiedModel(topology, optimizer="adam")
    kwargs = _kwargs(world)
    kwargs["max_steps"] = 2
    trainer = L.Trainer(**kwargs, strategy=MultiModulePipelineStrategy(placements, topology, num_microbatches=2))
    trainer.fit(model, make_loader(topology, 8, 16))
    trainer.save_checkpoint(f"{root}/tied.ckpt")
    resumed = TiedModel(topology, optimizer="adam")
    trainer = L.Trainer(**_kwargs(world), strategy=MultiModulePipelineStrategy(placements, topology, num_microbatches=2))
    trainer.fit(resumed, make_loader(topology, 8, 16), ckpt_path=f"{root}/tied.ckpt")
    return _all_params(resumed)


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_tied_weights_resume_and_export(tmp_path):
    """A checkpoint of a tied model resumes exactly; its export loads into one process, still tied."""
    from lightning_mmpp import export_checkpoint

    reference = TiedModel(ONE_ENC, optimizer="adam")
    L.Trainer(**_kwargs(1)).fit(reference, make_loader(ONE_ENC, 8, 16))  # 2 batches an epoch, 3 steps
    final = _all_params(reference)
    per_rank = run_distributed(_save_resume, 3, str(tmp_path), timeout=200, init_pg=False)
    for end in per_rank:  # Adam: within 1e-5 relative to the norm (tests/compare.py says why)
        for name, value in end.items():
            assert_close_after_adam(value, final[name], name)
    export_checkpoint(tmp_path / "tied.ckpt", tmp_path / "one.ckpt")
    loaded = TiedModel.load_from_checkpoint(tmp_path / "one.ckpt", topology=ONE_ENC, weights_only=False)
    assert loaded.llm[4].out.weight is loaded.llm[0].emb.weight
    two_steps = TiedModel(ONE_ENC, optimizer="adam")
    L.Trainer(**{**_kwargs(1), "max_steps": 2}).fit(two_steps, make_loader(ONE_ENC, 8, 16))
    torch.testing.assert_close(loaded.llm[0].emb.weight, two_steps.llm[0].emb.weight, rtol=1e-5, atol=1e-6)


# --- sharded tied copies: a tied-embedding LM with a per-token loss, FSDP2 on pp=2 x dp=2 ---------------

SHARDED_TIED = {"enc_a": P(), "llm": P(pp=2, dp=2, shard=True)}


def _full_params(model) -> dict[str, torch.Tensor]:
    """Every parameter whole (a sharded one gathered over its dp group: a collective, same order on
    every replica)."""
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters(remove_duplicate=False)}


def _token_tied_fit(schedule=None, placements=None, devices=1, recompute=False, reduction="step"):
    from tests.test_token_loss import TokenModel, _loader

    class TiedTokenModel(TokenModel):
        def __init__(self, topology, **kwargs):
            super().__init__(topology, **kwargs)
            _tie(self)

    L.seed_everything(11, verbose=False)
    model = TiedTokenModel(ONE_ENC, optimizer="adam")
    kwargs = _kwargs(devices, clip=0.05)
    if placements is not None:
        if recompute:
            placements = {**placements, "llm": P(pp=2, dp=2, shard=True, recompute=True)}
        kwargs["strategy"] = MultiModulePipelineStrategy(placements, ONE_ENC, num_microbatches=2, schedule=schedule,
                                                         sharded_grad_reduction=reduction)
    initial, final = {}, {}

    class Record(L.Callback):  # while the engine's groups exist (they go at the end of fit)
        def on_train_start(self, trainer, pl_module):
            initial.update(_full_params(pl_module))

        def on_train_end(self, trainer, pl_module):
            final.update(_full_params(pl_module))

    L.Trainer(**kwargs, callbacks=[Record()]).fit(model, _loader(8 * STEPS, 0))
    return initial, final


def _sharded_tied_runs(rank, world):
    runs = {}
    for name, schedule, recompute, reduction in (("1f1b", "1f1b", False, "step"),
                                                 ("zero_bubble", "zero_bubble", False, "microbatch"),
                                                 ("zero_bubble+recompute", "zero_bubble", True, "step")):
        runs[name] = _token_tied_fit(schedule, SHARDED_TIED, world, recompute, reduction)
    return runs


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_sharded_tied_embedding_lm_with_per_token_loss_trains_like_one_process():
    """Both tied copies sharded (FSDP2, dp=2 on each LM stage), their shard gradients summed per
    replica; Adam + clipping; 1f1b, zero_bubble (per-microbatch reduce-scatter) and zero_bubble +
    recompute against one process. Parameters within 1e-5 relative to their norm: Adam turns the
    last-bit differences of another summation order (reduce-scatter, the global norm, the token
    division) into ~1e-5 absolute changes of near-zero elements, so an element-wise rtol is not the
    measure here."""
    initial, final = _token_tied_fit()
    per_rank = run_distributed(_sharded_tied_runs, 5, timeout=380, init_pg=False)
    for rank, runs in enumerate(per_rank):
        for run, (start, end) in runs.items():
            for name, value in start.items():
                assert torch.equal(value, initial[name]), f"{run}: initial {name} on rank {rank}"
                assert_close_after_adam(end[name], final[name], f"{run}: {name} on rank {rank}")
    for run in per_rank[0]:
        ends = [runs[run][1][n] for runs in per_rank for n in TIED if n in runs[run][1]]
        assert len(ends) == 4 and all(torch.equal(ends[0], e) for e in ends), run
