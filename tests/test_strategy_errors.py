"""User mistakes raise PipelineConfigError naming the fix, on every rank, before any collective."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn

from lightning_mmpp import ModulePlacement as P
from lightning_mmpp import MultiModulePipelineStrategy, PipelineConfigError
from tests.dist import run_distributed
from tests.models import MultiModalModel, make_loader

TOPOLOGY = {"enc_a": ["llm"], "llm": []}
QUIET = dict(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
             enable_model_summary=False, limit_val_batches=0, max_steps=1)


def test_construction_errors_and_table():
    with pytest.raises(PipelineConfigError, match="unknown schedule 'zb'"):
        MultiModulePipelineStrategy({"enc_a": P(), "llm": P()}, TOPOLOGY, 4, schedule="zb")
    with pytest.raises(PipelineConfigError, match="num_microbatches=0"):
        MultiModulePipelineStrategy({"enc_a": P(), "llm": P()}, TOPOLOGY, 0)
    with pytest.raises(PipelineConfigError, match="stage numbering"):
        MultiModulePipelineStrategy({"enc_a": P(), "llm": P()}, TOPOLOGY, 4, stage_numbering="middle")
    with pytest.raises(PipelineConfigError, match="cycle"):
        MultiModulePipelineStrategy({"a": P(), "b": P()}, {"a": ["b"], "b": ["a"]}, 4)
    with pytest.raises(PipelineConfigError, match="no placement"):
        MultiModulePipelineStrategy({"enc_a": P()}, TOPOLOGY, 4)
    strategy = MultiModulePipelineStrategy({"enc_a": P(dp=2), "llm": P(pp=2)}, TOPOLOGY, 4)
    text = str(strategy)
    assert "rank  module  stage  replica  global-stage" in text
    assert "3     llm     1/2    0/1      2" in text
    assert strategy.ranks_needed == strategy.layout.world_size == 4


def test_world_size_and_table_before_the_model_gives_the_topology():
    strategy = MultiModulePipelineStrategy({"enc_a": P(dp=2), "enc_b": P(), "llm": P(pp=2)}, num_microbatches=4)
    assert strategy.ranks_needed == 5  # known from the placements alone
    text = str(strategy)
    assert "module  ranks  pp  dp" in text and "llm     3-4    2   1" in text, text
    with pytest.raises(PipelineConfigError, match="ranks_needed"):
        strategy.layout


class _NoLoss(MultiModalModel):
    pipeline_loss = None  # type: ignore[assignment]


class _NoContainer(MultiModalModel):
    def __init__(self) -> None:
        super().__init__(TOPOLOGY)
        del self.llm
        self.llm = [nn.Linear(2, 2)]  # a Python list, not an nn.Module


class _StrayParameter(MultiModalModel):
    def __init__(self) -> None:
        super().__init__(TOPOLOGY)
        self.scale = nn.Parameter(torch.ones(1))


class _Manual(MultiModalModel):
    def __init__(self) -> None:
        super().__init__(TOPOLOGY)
        self.automatic_optimization = False


class _VectorLoss(MultiModalModel):
    def pipeline_loss(self, output, batch):
        return output.sum(-1)


class _TwoOptimizers(MultiModalModel):
    def configure_optimizers(self):
        return [torch.optim.SGD(self.enc_a.parameters(), lr=0.1), torch.optim.SGD(self.llm.parameters(), lr=0.1)]


class _WrongWiring(MultiModalModel):
    def __init__(self) -> None:
        super().__init__(TOPOLOGY)
        self.pipeline_topology = {"llm": ["enc_a"], "enc_a": []}


class _NoWiring(MultiModalModel):
    def __init__(self) -> None:
        super().__init__(TOPOLOGY)
        self.pipeline_topology = None


def _fit_errors(rank: int, world: int) -> dict[str, str]:
    placements = {"enc_a": P(rank_offset=0), "llm": P(rank_offset=0)} if world == 1 else {"enc_a": P(), "llm": P()}
    cases = {
        "no_hook": (_NoLoss(TOPOLOGY), {}, 8),
        "no_container": (_NoContainer(), {}, 8),
        "stray_parameter": (_StrayParameter(), {}, 8),
        "manual": (_Manual(), {}, 8),
        "accumulate": (MultiModalModel(TOPOLOGY), {"accumulate_grad_batches": 2}, 8),
        "batch": (MultiModalModel(TOPOLOGY), {}, 6),
        "vector_loss": (_VectorLoss(TOPOLOGY), {}, 8),
        "wiring_mismatch": (_WrongWiring(), {}, 8),
        "no_wiring": (_NoWiring(), {}, 8),
        "two_optimizers": (_TwoOptimizers(TOPOLOGY), {}, 8),
    }
    if world > 1:
        cases = {k: cases[k] for k in ("batch", "no_container", "wiring_mismatch")}
    messages = {}
    for name, (model, kwargs, batch_size) in cases.items():
        topology = None if name == "no_wiring" else TOPOLOGY
        strategy = MultiModulePipelineStrategy(placements, topology, num_microbatches=4)
        trainer = L.Trainer(devices=world, strategy=strategy, **QUIET, **kwargs)
        try:
            trainer.fit(model, make_loader(TOPOLOGY, batch_size, batch_size * 2))
            messages[name] = "no error"
        except PipelineConfigError as err:
            messages[name] = str(err)
    return messages


EXPECTED = {
    "no_hook": "pipeline_loss",
    "no_container": "nn.Sequential or nn.ModuleList",
    "stray_parameter": "not inside any pipelined module",
    "manual": "manual optimization",
    "accumulate": "num_microbatches",
    "batch": "a batch of 6 samples cannot be split: it must split into num_microbatches=4 equal microbatches; use a "
    "batch size that is a multiple of 4",
    "vector_loss": "reduce it to a scalar",
    "wiring_mismatch": "_WrongWiring.pipeline_topology {'enc_a': [], 'llm': ['enc_a']} and the strategy's topology= "
    "{'enc_a': ['llm'], 'llm': []} disagree",
    "two_optimizers": "Put the parameters in one optimizer with a parameter group per part",
    "no_wiring": "declare `pipeline_topology = {module: [downstream modules]}` on _NoWiring or pass topology=",
}


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_fit_errors_single_rank():
    (messages,) = run_distributed(_fit_errors, 1, timeout=100, init_pg=False)
    for name, fragment in EXPECTED.items():
        assert fragment in messages[name], f"{name}: {messages[name]}"


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_fit_errors_raise_identically_on_every_rank():
    per_rank = run_distributed(_fit_errors, 2, timeout=100, init_pg=False)
    assert per_rank[0] == per_rank[1]
    for name, message in per_rank[0].items():
        assert EXPECTED[name] in message, f"{name}: {message}"


def _world_mismatch(rank: int, world: int) -> str:
    strategy = MultiModulePipelineStrategy({"enc_a": P(dp=2), "llm": P()}, TOPOLOGY, num_microbatches=2)
    trainer = L.Trainer(devices=world, strategy=strategy, **QUIET)
    try:
        trainer.fit(MultiModalModel(TOPOLOGY), make_loader(TOPOLOGY, 8, 16))
    except PipelineConfigError as err:
        return str(err)
    return "no error"


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_world_size_mismatch_raises_on_every_rank():
    messages = run_distributed(_world_mismatch, 2, timeout=100, init_pg=False)
    for message in messages:
        assert "need 3 ranks" in message and "world has 2" in message and "devices=3" in message, message


def _sink_only_error(rank: int, world: int) -> str:
    strategy = MultiModulePipelineStrategy({"enc_a": P(), "llm": P()}, TOPOLOGY, num_microbatches=4)
    trainer = L.Trainer(devices=world, strategy=strategy, **QUIET)
    try:
        trainer.fit(_VectorLoss(TOPOLOGY), make_loader(TOPOLOGY, 8, 16))
    except Exception as err:  # noqa: BLE001 - the message is what is checked
        return f"{type(err).__name__}: {err}"
    return "no error"


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_error_on_one_rank_stops_its_peers():
    """pipeline_loss runs on the sink rank only; its peers must fail fast, not hang."""
    encoder, sink = run_distributed(_sink_only_error, 2, timeout=60, init_pg=False)
    assert "PipelineConfigError" in sink and "reduce it to a scalar" in sink, sink
    assert "failed during the pipeline step" in encoder, encoder


class _PlainEncoder(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


class _HooksOnly(MultiModalModel):
    """Only the pipeline hooks and configure_optimizers: no step methods at all; a plain nn.Module encoder."""

    def __init__(self, topology) -> None:
        super().__init__(topology)
        self.enc_a = _PlainEncoder(self.enc_a)  # pp=1: any nn.Module is one layer

    training_step = L.LightningModule.training_step
    validation_step = L.LightningModule.validation_step
    test_step = L.LightningModule.test_step
    predict_step = L.LightningModule.predict_step  # and no forward


def _hooks_only(rank: int, world: int):
    from torch.utils.data import DataLoader

    from tests.models import SyntheticDataset

    def val():
        return DataLoader(SyntheticDataset(16, ["enc_a"]), batch_size=8)

    import logging

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("lightning.pytorch").addHandler(handler)
    model = _HooksOnly(TOPOLOGY)
    # no topology=: the model's pipeline_topology is the wiring
    strategy = MultiModulePipelineStrategy({"enc_a": P(), "llm": P()}, num_microbatches=2)
    trainer = L.Trainer(devices=world, strategy=strategy,
                        **{**QUIET, "limit_val_batches": None, "max_steps": 2, "enable_model_summary": True})
    trainer.fit(model, make_loader(TOPOLOGY, 8, 16), val())
    summaries = [r for r in records if "param bytes/rank" in r or "Trainable params" in r]
    fit_val = float(trainer.callback_metrics["val_loss"])
    validated = trainer.validate(model, val(), verbose=False)[0]["val_loss"]
    tested = trainer.test(model, val(), verbose=False)[0]["test_loss"]
    predicted = trainer.predict(model, val())
    # the placeholders live only for the Trainer call: nothing stays bound on the model
    leftovers = sorted(n for n in ("training_step", "validation_step", "test_step", "predict_step") if n in vars(model))
    return fit_val, validated, tested, [tuple(p.shape) for p in predicted], leftovers, summaries


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_module_needs_only_the_pipeline_hooks():
    per_rank = run_distributed(_hooks_only, 2, timeout=100, init_pg=False)
    assert per_rank[0][:5] == per_rank[1][:5]
    fit_val, validated, tested, predicted_shapes, leftovers, _ = per_rank[0]
    # one pipeline summary (rank 0), instead of Lightning's summary of rank 0's stages
    summary, = per_rank[0][5]
    rows = [line.split() for line in summary.splitlines()]
    assert ["enc_a", "0/1", "0", "(whole", "module)", "128", "0", "512", "B"] in rows, summary
    assert ["llm", "0/1", "1", "0-4", "(5)", "739", "0", "2.9", "KB"] in rows, summary
    assert per_rank[1][5] == []
    assert fit_val == pytest.approx(validated) == pytest.approx(tested)
    assert predicted_shapes == [(8, 3, 11), (8, 3, 11)]  # the sink output of each batch, no predict_step
    assert leftovers == []


def test_precision_plugin_is_a_clipping_copy_and_pickles():
    """Global-norm clipping comes from a copy of the user's plugin; the user's object is untouched."""
    import pickle

    from lightning.pytorch.plugins.precision import MixedPrecision

    users = MixedPrecision("bf16-mixed", "cpu")
    before = dict(vars(users))
    strategy = MultiModulePipelineStrategy({"enc_a": P(), "llm": P()}, TOPOLOGY, 4, precision_plugin=users)
    plugin = strategy.precision_plugin
    assert plugin is not users and isinstance(plugin, MixedPrecision)
    assert type(plugin).clip_grad_by_norm is not MixedPrecision.clip_grad_by_norm
    assert vars(users) == before
    copy = pickle.loads(pickle.dumps(strategy))  # the spawn launcher pickles the strategy
    assert isinstance(copy.precision_plugin, MixedPrecision) and copy.precision_plugin.pipeline_strategy is copy


@pytest.mark.timeout(60)
@pytest.mark.parametrize("start_method", ["popen", "fork"])
def test_errors_before_launch_start_no_worker(start_method, monkeypatch):
    """Knowable mistakes are raised in the launching process, before any worker starts."""
    from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher

    def no_workers(*args, **kwargs):
        raise AssertionError("a worker was started")

    monkeypatch.setattr(_SubprocessScriptLauncher, "_call_children_scripts", no_workers)
    monkeypatch.setattr(_MultiProcessingLauncher, "_wrapping_function", no_workers)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "TORCHELASTIC_RUN_ID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)

    def fit(placements, model, batch_size, devices, topology=None):
        strategy = MultiModulePipelineStrategy(placements, topology, num_microbatches=4, start_method=start_method)
        trainer = L.Trainer(devices=devices, strategy=strategy, **QUIET)
        with pytest.raises(PipelineConfigError) as err:
            trainer.fit(model, make_loader(TOPOLOGY, batch_size, batch_size * 2))
        return str(err.value)

    assert "need 3 ranks" in fit({"enc_a": P(dp=2), "llm": P()}, MultiModalModel(TOPOLOGY), 8, 2)
    assert "multiple of 8" in fit({"enc_a": P(dp=2), "llm": P()}, MultiModalModel(TOPOLOGY), 12, 3)
    assert "nn.Sequential or nn.ModuleList" in fit({"enc_a": P(), "llm": P()}, _NoContainer(), 8, 2)
    assert "pipeline_loss" in fit({"enc_a": P(), "llm": P()}, _NoLoss(TOPOLOGY), 8, 2)
    assert "disagree" in fit({"enc_a": P(), "llm": P()}, _WrongWiring(), 8, 2, topology=TOPOLOGY)
