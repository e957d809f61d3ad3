"""The strategy is a full Lightning citizen: evaluation, predict, metrics, clipping, schedulers,
loggers, precision, seeding and frozen modules, on a fan-in layout and a pp>=2 layout.

Each launch runs many checks (starting processes costs seconds); the parent compares them with
the same sequence run by plain Lightning on one process.
"""

from __future__ import annotations

import csv
import glob
import math
import os

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, DistributedSampler

from lightning_mmpp import ModulePlacement as P
from lightning_mmpp import MultiModulePipelineStrategy, run_unpipelined
from tests.dist import run_distributed
from tests.models import (
    AlignmentCheckingModel,
    BatchRecorder,
    DtypeRecordingModel,
    MultiModalModel,
    NamedSamples,
    SyntheticDataset,
    make_loader,
)

TOPOLOGY = {"enc_a": ["llm"], "llm": []}
LAYOUTS = {
    "fanin": {"enc_a": P(dp=2), "llm": P()},
    "pp2": {"enc_a": P(), "llm": P(pp=2)},
}
M = 4
BS = 8
SEED = 7  # seed_everything's seed for the shuffled runs
QUIET = dict(enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


def _val_loader() -> DataLoader:
    # 20 samples in batches of 8: the last batch has 4, run with fewer microbatches
    return DataLoader(SyntheticDataset(20, ["enc_a"], seed=1), batch_size=BS, shuffle=False)


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _scenario(strategy_factory, devices: int, log_dir: str) -> dict:
    """The same sequence of Lightning calls, with or without the pipeline strategy."""
    out: dict = {}

    def trainer(**kwargs) -> L.Trainer:
        strategy = strategy_factory()
        extra = {"strategy": strategy} if strategy is not None else {}
        return L.Trainer(accelerator="cpu", devices=devices, **extra, **QUIET, **kwargs)

    # fit with sanity check, val_check_interval, limit_val_batches, clipping, a step scheduler,
    # LearningRateMonitor, EarlyStopping on val_loss and a CSV logger
    model = MultiModalModel(TOPOLOGY, scheduler="step")
    fit = trainer(
        max_steps=4, val_check_interval=2, limit_val_batches=2, num_sanity_val_steps=1, gradient_clip_val=0.05,
        log_every_n_steps=1,
        logger=CSVLogger(log_dir, name="run"),
        callbacks=[LearningRateMonitor(logging_interval="step"), EarlyStopping(monitor="val_loss", patience=3)],
    )
    fit.fit(model, make_loader(TOPOLOGY, BS, BS * 4), _val_loader())
    out["params"] = _params(model)
    out["val_loss"] = float(fit.callback_metrics["val_loss"])
    out["lr"] = fit.optimizers[0].param_groups[0]["lr"]
    # validate / test / predict on the trained model, with a short last batch
    out["validate"] = fit.validate(model, _val_loader(), verbose=False)
    out["test"] = fit.test(model, _val_loader(), verbose=False)
    out["predict"] = fit.predict(model, _val_loader())

    # value clipping and an epoch scheduler
    model = MultiModalModel(TOPOLOGY, scheduler="epoch")
    run = trainer(max_epochs=2, gradient_clip_val=0.01, gradient_clip_algorithm="value", logger=False,
                  limit_val_batches=0)
    run.fit(model, make_loader(TOPOLOGY, BS, BS * 2))
    out["value_clip_params"] = _params(model)
    out["epoch_lr"] = run.optimizers[0].param_groups[0]["lr"]

    # a frozen encoder
    model = MultiModalModel(TOPOLOGY, freeze=("enc_a",))
    run = trainer(max_steps=2, logger=False, limit_val_batches=0)
    run.fit(model, make_loader(TOPOLOGY, BS, BS * 2))
    out["frozen_params"] = _params(model)
    comm = getattr(run.strategy, "communicator", None)
    out["frozen_stats"] = comm.stats.as_dict() if comm is not None else None
    return out


def _pipelined_extras(rank: int, world: int, placements, log_dir: str) -> dict:
    def factory():
        return MultiModulePipelineStrategy(placements, TOPOLOGY, num_microbatches=M)

    out = _scenario(factory, world, log_dir)
    # bf16 autocast on CPU: the pipelined training, evaluation and predict steps run every stage
    # under autocast (one batch each)
    model = DtypeRecordingModel(TOPOLOGY)
    run = L.Trainer(accelerator="cpu", devices=world, strategy=factory(), precision="bf16-mixed", max_steps=2,
                    logger=False, limit_val_batches=1, limit_test_batches=1, limit_predict_batches=1, **QUIET)
    run.fit(model, make_loader(TOPOLOGY, BS, BS * 2))
    out["bf16_loss"] = float(run.callback_metrics["train_loss"])
    out["bf16_dtypes"] = {"fit": sorted(getattr(model, "seen_dtypes", set()))}
    for stage in ("validate", "test"):
        model.seen_dtypes = set()
        getattr(run, stage)(model, _val_loader(), verbose=False)
        out["bf16_dtypes"][stage] = sorted(model.seen_dtypes)
    model.seen_dtypes = set()
    out["bf16_predict_dtypes"] = sorted({str(p.dtype) for p in run.predict(model, _val_loader())})
    out["bf16_dtypes"]["predict"] = sorted(model.seen_dtypes)
    # seed_everything makes two shuffled runs identical, in the order of the seed's sampler
    seeded, seeded_batches = [], []
    for _ in range(2):
        L.seed_everything(SEED, verbose=False)
        model = MultiModalModel(TOPOLOGY)
        recorder = BatchRecorder()
        run = L.Trainer(accelerator="cpu", devices=world, strategy=factory(), max_steps=3, logger=False,
                        limit_val_batches=0, callbacks=[recorder], **QUIET)
        run.fit(model, DataLoader(NamedSamples(BS * 3, ["enc_a"]), batch_size=BS, shuffle=True))
        seeded.append(_params(model))
        seeded_batches.append(recorder.seen)
    out["seeded"], out["seeded_batches"] = seeded, seeded_batches
    # per-sample strings are split with their samples, over microbatches and dp shards
    model = AlignmentCheckingModel(TOPOLOGY)
    run = L.Trainer(accelerator="cpu", devices=world, strategy=factory(), max_steps=2, logger=False,
                    limit_val_batches=0, **QUIET)
    run.fit(model, DataLoader(NamedSamples(BS * 2, ["enc_a"]), batch_size=BS))
    out["alignment_checks"] = getattr(model, "checked", 0)
    # an unseeded shuffling DataLoader while every rank's global RNG differs: the strategy's
    # sampler (seed 0 without seed_everything) still gives every rank the same batches
    os.environ.pop("PL_GLOBAL_SEED", None)
    model = MultiModalModel(TOPOLOGY)
    torch.manual_seed(1000 + rank)
    recorder = BatchRecorder()
    run = L.Trainer(accelerator="cpu", devices=world, strategy=factory(), max_steps=3, logger=False,
                    limit_val_batches=0, callbacks=[recorder], **QUIET)
    run.fit(model, DataLoader(NamedSamples(BS * 3, ["enc_a"]), batch_size=BS, shuffle=True))
    out["shuffled_batches"] = recorder.seen
    return out


def _sampler_batches(seed: int) -> list[list[int]]:
    """The batches of ``NamedSamples(BS * 3)`` in the order of a sampler shuffled with ``seed``."""
    order = list(DistributedSampler(NamedSamples(BS * 3, ["enc_a"]), 1, 0, shuffle=True, seed=seed))
    return [order[i:i + BS] for i in range(0, BS * 3, BS)]


def _assert_same_everywhere(per_rank, key):
    values = [r[key] for r in per_rank]
    assert all(v == values[0] for v in values), f"{key} differs across ranks: {values}"


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_lightning_features(layout, tmp_path):
    placements = LAYOUTS[layout]
    assert _sampler_batches(SEED) != _sampler_batches(0)
    world = MultiModulePipelineStrategy(placements, TOPOLOGY, M).layout.world_size
    reference = _scenario(lambda: None, 1, str(tmp_path / "ref"))
    per_rank = run_distributed(_pipelined_extras, world, placements, str(tmp_path / "pp"), timeout=200, init_pg=False)

    def close(a, b, what):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=what)

    for key in ("val_loss", "lr", "epoch_lr", "bf16_loss", "shuffled_batches"):
        _assert_same_everywhere(per_rank, key)
    layout = MultiModulePipelineStrategy(placements, TOPOLOGY, M).layout
    for rank, result in enumerate(per_rank):
        for name, value in result["params"].items():  # clipping (global norm) + step scheduler
            close(value, reference["params"][name], f"rank {rank} {name}")
        for name, value in result["value_clip_params"].items():
            close(value, reference["value_clip_params"][name], f"value clip {name}")
        for name, value in result["frozen_params"].items():
            close(value, reference["frozen_params"][name], f"frozen {name}")
        assert math.isclose(result["val_loss"], reference["val_loss"], rel_tol=1e-5)
        assert result["lr"] == reference["lr"] and result["epoch_lr"] == reference["epoch_lr"]
        # trainer.validate / trainer.test return the reduced metrics, short last batch included
        assert result["validate"][0]["val_loss"] == pytest.approx(reference["validate"][0]["val_loss"], rel=1e-5)
        assert result["test"][0]["test_loss"] == pytest.approx(reference["test"][0]["test_loss"], rel=1e-5)
        # predict: the sink output of every batch, in order, gathered over dp replicas
        assert len(result["predict"]) == len(reference["predict"]) == 3
        for ours, ref in zip(result["predict"], reference["predict"]):
            close(ours, ref, "predict")
        assert math.isfinite(result["bf16_loss"])
        # activations computed under autocast are bf16 in every step kind: the encoder's output as
        # the llm receives it (across ranks), and the llm's output at the loss (predict: none)
        llm = layout.slot(rank, "llm")
        for stage, seen in result["bf16_dtypes"].items():
            if llm is not None and llm.stage == 0:
                assert ("llm", "upstream:enc_a", "torch.bfloat16") in seen, (stage, seen)
            if llm is not None and layout.is_loss_stage(llm) and stage != "predict":
                assert ("llm", "output", "torch.bfloat16") in seen, (stage, seen)
        assert result["bf16_predict_dtypes"] == ["torch.bfloat16"], result["bf16_predict_dtypes"]
        assert result["shuffled_batches"] == _sampler_batches(seed=0), rank
        # the strategy's sampler follows seed_everything: another seed, another order
        assert result["seeded_batches"] == [_sampler_batches(SEED)] * 2, rank
        # every hook call this rank made saw names matching its samples (2 steps x M microbatches)
        assert result["alignment_checks"] >= 2 * M, result["alignment_checks"]
        first, second = result["seeded"]
        for name in first:
            assert torch.equal(first[name], second[name]), f"seeded runs differ on {name}"
    # the frozen encoder runs no backward: its ranks receive no gradient message at all
    enc_ranks = list(MultiModulePipelineStrategy(placements, TOPOLOGY, M).layout.module_ranks("enc_a"))
    for rank in enc_ranks:
        assert per_rank[rank]["frozen_stats"]["messages_received"] == 0
        assert per_rank[rank]["frozen_stats"]["messages_sent"] > 0
    for name, value in per_rank[enc_ranks[0]]["frozen_params"].items():
        assert torch.equal(value, MultiModalModel(TOPOLOGY).state_dict()[name]), "frozen encoder changed"
    # rank 0 wrote the CSV log with the reduced metrics and the learning rate
    files = glob.glob(str(tmp_path / "pp" / "run" / "*" / "metrics.csv"))
    assert len(files) == 1
    with open(files[0]) as f:
        columns = set(csv.DictReader(f).fieldnames or [])
    assert {"train_loss", "val_loss", "lr-SGD"} <= columns, columns


CHAIN = {"enc_a": ["llm"], "llm": ["dec"], "dec": []}


def _frozen_middle(rank: int, world: int) -> dict:
    """A frozen module between trainable ones still runs its backward: gradients reach enc_a."""
    if world == 1:
        strategy = None
    else:
        strategy = MultiModulePipelineStrategy({"enc_a": P(), "llm": P(pp=2), "dec": P()}, CHAIN, num_microbatches=M)
    model = MultiModalModel(CHAIN, freeze=("llm",))
    extra = {"strategy": strategy} if strategy is not None else {}
    run = L.Trainer(accelerator="cpu", devices=world, max_steps=2, logger=False, limit_val_batches=0, **extra,
                    **QUIET)
    run.fit(model, make_loader(CHAIN, BS, BS * 2))
    return _params(model)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_frozen_module_in_the_middle_passes_gradients_through():
    reference = _frozen_middle(0, 1)
    initial = dict(MultiModalModel(CHAIN).named_parameters())
    assert not torch.allclose(reference["enc_a.0.proj.weight"], initial["enc_a.0.proj.weight"])
    per_rank = run_distributed(_frozen_middle, 4, timeout=100, init_pg=False)
    seen = set()
    for params in per_rank:
        for name, value in params.items():
            torch.testing.assert_close(value, reference[name], rtol=1e-5, atol=1e-6, msg=name)
            seen.add(name)
    assert seen == set(reference)


TWO_SINKS = {"enc_a": ["llm", "aux"], "llm": [], "aux": []}


class _PredictOnly(MultiModalModel):
    """No forward and no predict_step: the strategy's pipelined predict is all there is."""

    predict_step = L.LightningModule.predict_step


def _predict_two_sinks(rank: int, world: int) -> list:
    import torch.distributed as dist

    def refuse(*args, **kwargs):
        raise AssertionError("predictions must move as tensors, not pickled objects")

    dist.all_gather_object = refuse  # forked worker: patched for this process only
    dist.gather_object = refuse
    strategy = MultiModulePipelineStrategy(
        {"enc_a": P(), "llm": P(dp=2), "aux": P()}, num_microbatches=2
    )
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, logger=False, **QUIET)
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        predictions = trainer.predict(_PredictOnly(TWO_SINKS), _val_loader())  # 8, 8 and a short batch of 4
    return predictions, [str(w.message) for w in caught]


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_predict_gathers_every_sink_over_replicas_with_tensor_collectives():
    model = MultiModalModel(TWO_SINKS)
    expected = []
    with torch.no_grad():
        for batch in _val_loader():
            _, outputs = run_unpipelined(model, batch)
            expected.append({"llm": outputs["llm"], "aux": outputs["aux"]})
    per_rank = run_distributed(_predict_two_sinks, 4, timeout=100, init_pg=False)
    for rank, (predictions, warned) in enumerate(per_rank):
        # the model defines neither predict_step nor forward: nothing of its own goes uncalled
        assert not [w for w in warned if "is not called" in w], warned
        assert len(predictions) == len(expected) == 3
        for ours, ref in zip(predictions, expected):
            assert set(ours) == {"llm", "aux"}, rank
            for sink in ours:
                torch.testing.assert_close(ours[sink], ref[sink], rtol=1e-5, atol=1e-6, msg=f"rank {rank} {sink}")
