"""``ModulePlacement(shard=..., recompute=...)``: user errors, recompute's exactness and memory,
and sharded checkpoints (save, exact resume, resume sharded <-> unsharded, export, bf16-mixed).

The equivalence of sharded/recomputed training with one process is in test_equivalence.py.
"""

from __future__ import annotations

import functools
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_mmpp import ModulePlacement, MultiModulePipelineStrategy, PipelineConfigError
from lightning_mmpp.state.checkpoint import export_checkpoint
from lightning_mmpp.engine.sharding import enable_recompute
from tests.dist import run_distributed
from tests.models import MultiModalModel, make_loader

P = ModulePlacement
TOPOLOGY = {"enc_a": ["llm"], "llm": []}


# --- user errors, raised at construction ------------------------------------------------------------


def test_shard_needs_replicas_and_booleans():
    with pytest.raises(PipelineConfigError, match="nothing to shard over; give the module dp >= 2"):
        P(shard=True)
    with pytest.raises(PipelineConfigError, match="must be True or False"):
        P(dp=2, shard=1)
    with pytest.raises(PipelineConfigError, match="must be True or False"):
        P(recompute="yes")
    assert P(dp=2, shard=True, recompute=True).shard


# --- recompute: same gradients, fewer saved activations ----------------------------------------------


class _Layer(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim)
        self.drop = nn.Dropout(0.3)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.drop(torch.nn.functional.gelu(self.up(x))))


def _saved_bytes_and_grads(recompute: bool, dim: int = 32, layers: int = 4) -> tuple[int, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(*(_Layer(dim) for _ in range(layers)))
    if recompute:
        for layer in model:
            enable_recompute(layer)
    x = torch.randn(16, dim, requires_grad=True)
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[id(t)] = t.numel() * t.element_size()
        return t

    torch.manual_seed(1)  # the dropout masks
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x).square().mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    grads["input"] = x.grad.clone()
    return sum(saved.values()), grads


def test_recompute_gives_bitwise_equal_gradients_with_dropout_and_keeps_only_layer_inputs():
    plain_bytes, plain = _saved_bytes_and_grads(False)
    ckpt_bytes, recomputed = _saved_bytes_and_grads(True)
    assert plain.keys() == recomputed.keys()
    for name in plain:
        assert torch.equal(plain[name], recomputed[name]), name
    # per layer its input (16 x 32 floats) instead of every intermediate (several 16 x 128), and
    # the output the loss squares
    layer_input = 16 * 32 * 4
    assert ckpt_bytes == (4 + 1) * layer_input, (ckpt_bytes, plain_bytes)
    assert plain_bytes > 5 * ckpt_bytes


def test_recompute_is_idempotent_and_keeps_names():
    layer = _Layer(8)
    names = [n for n, _ in layer.named_parameters()]
    enable_recompute(layer)
    enable_recompute(layer)
    assert [n for n, _ in layer.named_parameters()] == names
    with torch.no_grad():  # no checkpoint outside autograd
        assert layer(torch.zeros(2, 8)).shape == (2, 8)


# --- sharded checkpoints ------------------------------------------------------------------------------

SHARDED = {"enc_a": P(dp=2, shard=True), "llm": P(pp=2)}  # ranks 0-1: sharded enc replicas
UNSHARDED = {"enc_a": P(dp=2), "llm": P(pp=2)}  # the same ranks, plain replicas
BATCH = 8
EPOCH = 3


class _Whole(L.Callback):
    """Every parameter's whole value when training starts (just restored) and ends, before
    teardown releases the dp groups (a sharded parameter is gathered over its group)."""

    @staticmethod
    def _gather(module: nn.Module) -> dict[str, torch.Tensor]:
        from torch.distributed.tensor import DTensor

        return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                for n, p in module.named_parameters()}

    def on_train_start(self, trainer, pl_module) -> None:
        self.start = self._gather(pl_module)
        from torch.distributed.tensor import DTensor

        self.sharded = sorted({n.split(".")[0] for n, p in pl_module.named_parameters() if isinstance(p, DTensor)})

    def on_train_end(self, trainer, pl_module) -> None:
        self.end = self._gather(pl_module)
        self.loss = float(trainer.callback_metrics["train_loss"])


class _ParamDtypesInForward(L.Callback):
    """The dtypes of the parameters each module computes with, per top-level module, seen when its
    forward starts (after FSDP2's all-gather): ``{module: [dtype, ...]}``."""

    def on_train_start(self, trainer, pl_module) -> None:
        self.seen: dict[str, set[str]] = {}
        for name, layer in pl_module.named_modules():
            if next(layer.parameters(recurse=False), None) is not None:
                layer.register_forward_pre_hook(functools.partial(self._record, name.split(".")[0]))

    def _record(self, module: str, layer: nn.Module, args) -> None:
        self.seen.setdefault(module, set()).update(str(p.dtype) for p in layer.parameters(recurse=False))


def _model() -> MultiModalModel:
    return MultiModalModel(TOPOLOGY, optimizer="adam", scheduler="step")


def _fit(layout, epochs: int, ckpt_path=None, saver=None, precision="32-true", probe=None) -> _Whole:
    strategy = MultiModulePipelineStrategy(layout, TOPOLOGY, num_microbatches=2)
    whole = _Whole()
    trainer = L.Trainer(
        accelerator="cpu", devices=strategy.layout.world_size, strategy=strategy, max_epochs=epochs, logger=False,
        callbacks=[whole] + [c for c in (saver, probe) if c], enable_checkpointing=saver is not None,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, precision=precision,
    )
    trainer.fit(_model(), make_loader(TOPOLOGY, BATCH, BATCH * EPOCH), ckpt_path=ckpt_path)
    return whole


def _sharded_checkpoints(rank, world, root: str) -> dict:
    out: dict = {}
    out["straight"] = _fit(SHARDED, 2).end  # 6 steps without a break
    saver = ModelCheckpoint(dirpath=f"{root}/sharded", filename="s")
    first = _fit(SHARDED, 1, saver=saver)
    out["ckpt"], out["at3"], out["sharded_modules"] = saver.best_model_path, first.end, first.sharded
    again = _fit(SHARDED, 2, ckpt_path=saver.best_model_path)  # sharded -> sharded: exact
    out["exact_start"], out["exact_end"] = again.start, again.end
    out["to_unsharded"] = _fit(UNSHARDED, 2, ckpt_path=saver.best_model_path).end
    plain = ModelCheckpoint(dirpath=f"{root}/unsharded", filename="u")
    _fit(UNSHARDED, 1, saver=plain)
    out["from_unsharded"] = _fit(SHARDED, 2, ckpt_path=plain.best_model_path).end
    out["unsharded_straight"] = _fit(UNSHARDED, 2).end
    recomputed = {"enc_a": P(dp=2, shard=True, recompute=True), "llm": P(pp=2, recompute=True)}
    for precision in ("bf16-mixed", "bf16-true"):
        probe = _ParamDtypesInForward()
        run = _fit(recomputed, 1, precision=precision, probe=probe)
        out[precision] = (run.loss, {p.dtype for p in run.end.values()}, run.sharded)
        out[f"{precision} forward"] = {m: sorted(dtypes) for m, dtypes in probe.seen.items()}
    return out


ONE_EACH = {"enc_a": P(), "llm": P()}  # 2 ranks: another pp, dp and world size


def _resume_elsewhere(rank, world, ckpt: str) -> dict:
    return _fit(ONE_EACH, 2, ckpt_path=ckpt).end


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_sharded_checkpoints_resume_exactly_across_sharding_and_export(tmp_path: Path):
    per_rank = run_distributed(_sharded_checkpoints, 4, str(tmp_path), timeout=240, init_pg=False)
    elsewhere = run_distributed(_resume_elsewhere, 2, per_rank[0]["ckpt"], timeout=120, init_pg=False)
    enc_rank = per_rank[0]
    assert enc_rank["sharded_modules"] == ["enc_a"]
    close = dict(rtol=1e-5, atol=1e-6)
    for rank, out in enumerate(per_rank):
        for name, value in out["exact_end"].items():  # same layout: bitwise the uninterrupted run
            assert torch.equal(value, out["straight"][name]), (rank, name)
        for name, value in out["exact_start"].items():
            assert torch.equal(value, out["at3"][name]), (rank, name)
        for name, value in out["to_unsharded"].items():  # the reduction order differs: close
            torch.testing.assert_close(value, out["straight"][name], **close, msg=f"rank {rank} {name}")
        for name, value in out["from_unsharded"].items():
            torch.testing.assert_close(value, out["unsharded_straight"][name], **close, msg=f"rank {rank} {name}")
        for precision, dtype in (("bf16-mixed", torch.float32), ("bf16-true", torch.bfloat16)):
            loss, dtypes, sharded = out[precision]  # bf16-mixed: fp32 shards for the optimizer
            assert dtypes == {dtype} and torch.isfinite(torch.tensor(loss)), (precision, loss, dtypes)
            assert sharded == (["enc_a"] if rank < 2 else []), (precision, sharded)
        # bf16-mixed: FSDP2's policy all-gathers a sharded layer's parameters in bf16 for its forward;
        # unsharded layers compute with their fp32 parameters (autocast casts per operation)
        expected = {"enc_a": ["torch.bfloat16"]} if rank < 2 else {"llm": ["torch.float32"]}
        assert out["bf16-mixed forward"] == expected, (rank, out["bf16-mixed forward"])
        assert out["bf16-true forward"] == {m: ["torch.bfloat16"] for m in expected}, (rank, out["bf16-true forward"])

    straight = {**per_rank[0]["straight"], **per_rank[2]["straight"], **per_rank[3]["straight"]}
    for out in elsewhere:
        for name, value in out.items():
            torch.testing.assert_close(value, straight[name], **close, msg=f"pp=1 dp=1 resume {name}")

    # one file for one process: whole tensors, loadable without the strategy
    exported = export_checkpoint(enc_rank["ckpt"], tmp_path / "one.ckpt")
    state = torch.load(exported, weights_only=True)
    at3 = {**per_rank[0]["at3"], **per_rank[2]["at3"], **per_rank[3]["at3"]}
    model = MultiModalModel.load_from_checkpoint(exported)
    for name, value in model.named_parameters():
        assert torch.equal(value.detach(), at3[name]), name
    adam = state["optimizer_states"][0]["state"]
    names = [n for n, _ in model.named_parameters()]
    for index, name in enumerate(names):
        assert adam[index]["exp_avg"].shape == at3[name].shape, name  # whole, not a shard


# --- meta-built sharded modules with pretrained weights ---------------------------------------------

META_SHARDED = {"enc_a": P(dp=2, shard=True), "enc_b": P(), "llm": P(dp=2, shard=True, recompute=True)}


def _fit_meta_sharded(rank, world, sources) -> dict:
    from tests.test_materialize import SEED, TWO_ENC, MetaBuiltModel, _trainer_kwargs

    L.seed_everything(SEED, verbose=False)
    model = MetaBuiltModel(TWO_ENC, freeze=("enc_a",))
    strategy = MultiModulePipelineStrategy(META_SHARDED, TWO_ENC, num_microbatches=4, pretrained=sources)
    whole = _Whole()
    L.Trainer(**_trainer_kwargs(world), strategy=strategy, callbacks=[whole]).fit(model, make_loader(TWO_ENC, 8, 16))
    return {"initial": whole.start, "final": whole.end, "sharded": whole.sharded}


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_meta_built_sharded_modules_load_pretrained_and_train_like_one_process(tmp_path: Path):
    from tests.test_materialize import _pretrained_values, _reference, _write_sources

    sources = _write_sources(tmp_path, _pretrained_values())["kinds"]
    initial, final = _reference(sources, freeze=("enc_a",))
    per_rank = run_distributed(_fit_meta_sharded, 5, sources, timeout=240, init_pg=False)
    seen = set()
    for rank, out in enumerate(per_rank):
        assert out["sharded"] == {0: ["enc_a"], 1: ["enc_a"], 2: [], 3: ["llm"], 4: ["llm"]}[rank], out["sharded"]
        for name, value in out["initial"].items():
            assert torch.equal(value, initial[name]), f"initial {name}"
            torch.testing.assert_close(out["final"][name], final[name], rtol=1e-5, atol=1e-6, msg=name)
            seen.add(name)
    assert seen == set(initial)
