"""Per-token losses: ``{"loss_sum", "num_tokens"}`` equals single-process training on padded,
variable-length text, for any split into microbatches and replicas: the loss, the other
per-token metrics (``correct_sum`` -> ``correct``, divided by the step's token count) and the
validation epoch means (weighted by tokens, not samples)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from lightning_mmpp import ModulePlacement, MultiModulePipelineStrategy, PipelineConfigError
from lightning_mmpp import run_unpipelined
from lightning_mmpp.engine.runtime import _token_loss_and_metrics
from tests.dist import run_distributed
from tests.models import SEQ, VOCAB, MultiModalModel, SyntheticDataset

P = ModulePlacement
ONE_ENC = {"enc_a": ["llm"], "llm": []}
STEPS = 3
BATCH = 8
PER_TOKEN = ("correct", "top_prob")  # per-token metrics beside the loss
VAL_BATCHES = 3  # with different token counts: a mean weighted by samples differs from one by tokens
LAYOUTS = {
    "sink_dp2_fanin": {"enc_a": P(dp=2), "llm": P(dp=2)},
    "sink_pp2": {"enc_a": P(), "llm": P(pp=2)},
}


class TokenModel(MultiModalModel):
    def pipeline_loss(self, output, batch):
        labels = batch["target"]
        loss_sum = F.cross_entropy(output.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100, reduction="sum")
        valid = labels != -100
        correct = ((output.argmax(-1) == labels) & valid).sum()
        top_prob = (output.softmax(-1).amax(-1) * valid).sum()  # never 0 while there are tokens
        return {"loss_sum": loss_sum, "num_tokens": valid.sum(), "correct_sum": correct, "top_prob_sum": top_prob,
                "abs_out": output.abs().mean()}

    # the single-process reference: per-token means, logged with the token count as batch size so
    # that Lightning's epoch mean is sum(loss_sum) / sum(num_tokens), as the strategy promises

    def _per_token_logged(self, prefix: str, batch) -> torch.Tensor:
        _, outputs = run_unpipelined(self, batch)
        sums = self.pipeline_loss(outputs["llm"], batch)
        tokens = max(int(sums["num_tokens"]), 1)
        loss = sums["loss_sum"] / tokens
        self.log(f"{prefix}_loss", loss, batch_size=tokens)
        for name in PER_TOKEN:
            self.log(f"{prefix}_{name}", sums[f"{name}_sum"] / tokens, batch_size=tokens)
        return loss

    def training_step(self, batch, batch_idx):
        return self._per_token_logged("train", batch)

    def validation_step(self, batch, batch_idx):
        return self._per_token_logged("val", batch)


def _loader(size: int, seed: int) -> DataLoader:
    data = SyntheticDataset(size, ["enc_a"], seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    lengths = torch.randint(0, SEQ + 1, (size,), generator=g)  # some samples have no token at all
    data.data["target"] = data.data["target"].masked_fill(torch.arange(SEQ) >= lengths.unsqueeze(1), -100)
    return DataLoader(data, batch_size=BATCH, shuffle=False, drop_last=True)


class Losses(L.Callback):
    def on_train_batch_end(self, trainer, *args):
        for name, values in trainer.lightning_module.step_metrics.items():
            values.append(float(trainer.callback_metrics[name]))


def _fit(strategy=None, devices=1):
    model = TokenModel(ONE_ENC)
    model.step_metrics = {f"train_{name}": [] for name in ("loss", *PER_TOKEN)}
    kwargs = dict(accelerator="cpu", devices=devices, max_steps=STEPS, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                  check_val_every_n_epoch=1, callbacks=[Losses()])
    if strategy is not None:
        kwargs["strategy"] = strategy
    trainer = L.Trainer(**kwargs)
    trainer.fit(model, _loader(BATCH * STEPS, 0), _loader(BATCH, 9))
    validated = trainer.validate(model, _loader(BATCH * VAL_BATCHES, 9), verbose=False)[0]
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "steps": model.step_metrics,
            "val": validated}


def _pipelined(rank, world, placements):
    return _fit(MultiModulePipelineStrategy(placements, ONE_ENC, num_microbatches=2), world)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.distributed
def test_per_token_loss_matches_single_process(layout):
    val_tokens = [int((batch["target"] != -100).sum()) for batch in _loader(BATCH * VAL_BATCHES, 9)]
    assert len(set(val_tokens)) > 1, val_tokens
    reference = _fit()
    assert 0 < reference["val"]["val_top_prob"] < 1, reference["val"]  # a wrong divisor cannot match it by chance
    placements = LAYOUTS[layout]
    world = MultiModulePipelineStrategy(placements, ONE_ENC, 2).layout.world_size
    for result in run_distributed(_pipelined, world, placements, timeout=200, init_pg=False):
        for name, value in result["params"].items():
            torch.testing.assert_close(value, reference["params"][name], rtol=1e-5, atol=1e-6, msg=name)
        for name, values in reference["steps"].items():
            assert result["steps"][name] == pytest.approx(values, rel=1e-5), name
        # the other per-token metric is divided by the step's token count too, and the epoch mean
        # of both is weighted by tokens
        for name in (f"val_{name}" for name in ("loss", *PER_TOKEN)):
            assert result["val"][name] == pytest.approx(reference["val"][name], rel=1e-5), name


def test_per_token_form_is_checked():
    loss, sums, metrics = _token_loss_and_metrics(
        {"loss_sum": torch.tensor(6.0), "num_tokens": 3, "correct_sum": torch.tensor(2), "m": torch.tensor(1.0)}, "llm"
    )
    assert float(loss) == 6.0 and set(sums) == {"loss_sum", "num_tokens", "correct_sum"} and set(metrics) == {"m"}
    with pytest.raises(PipelineConfigError, match="'num_tokens'"):
        _token_loss_and_metrics({"loss_sum": torch.tensor(1.0)}, "llm")
