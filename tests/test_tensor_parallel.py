"""Tensor parallelism (ModulePlacement(tp)): equivalence with one process, the relay, errors."""

from __future__ import annotations

import pytest
import torch

from lightning_mmpp import ModulePlacement, MultiModulePipelineStrategy
from lightning_mmpp.errors import PipelineConfigError
from tests.dist import require_ranks, run_distributed
from tests.models import MultiModalModel, TensorParallelModel
from tests.test_equivalence import _check, _pipelined, _reference

pytestmark = pytest.mark.distributed

P = ModulePlacement
LM = {"llm": []}
ONE_ENC = {"enc_a": ["llm"], "llm": []}

# id: (topology, placements, num_microbatches, batch size, schedules)
TP_LAYOUTS = {
    "llm_tp2_pp2": (LM, {"llm": P(pp=2, tp=2)}, 4, 8, ("1f1b", "zero_bubble")),
    "enc_dp2-llm_tp2": (ONE_ENC, {"enc_a": P(dp=2), "llm": P(tp=2)}, 4, 8, ("1f1b", "zero_bubble")),
    "enc_tp2-llm_tp2_pp2": (ONE_ENC, {"enc_a": P(tp=2), "llm": P(pp=2, tp=2)}, 2, 8, ("1f1b", "zero_bubble")),
    "llm_tp2_dp2_shard": (LM, {"llm": P(dp=2, tp=2, shard=True)}, 2, 8, ("1f1b", "zero_bubble")),
    "enc-llm_tp2_dp2": (ONE_ENC, {"enc_a": P(), "llm": P(dp=2, tp=2)}, 2, 8, ("1f1b", "zero_bubble")),
    "enc_tp2-fanout-llm_dp2": (ONE_ENC, {"enc_a": P(tp=2), "llm": P(dp=2)}, 2, 8, ("gpipe", "zero_bubble")),
}


@pytest.mark.timeout(420)
@pytest.mark.parametrize("layout", list(TP_LAYOUTS))
def test_tensor_parallel_matches_single_process(layout):
    """SGD with momentum and global-norm clipping (shards of split parameters counted on every
    tp rank, replicated ones once per group), against one process without tensor parallelism.

    Not Adam: a row-parallel layer sums its partial products in another order than one process,
    and Adam divides each element's gradient by its own magnitude, so an element whose exact
    gradient is about zero turns that rounding into a full-size step."""
    topology, placements, m, batch_size, schedules = TP_LAYOUTS[layout]
    world = MultiModulePipelineStrategy(placements, topology, m).layout.world_size
    require_ranks(world)
    reference = _reference(topology, batch_size, "sgd", 0.05, model_cls=TensorParallelModel)
    per_rank = run_distributed(_pipelined, world, topology, placements, m, batch_size, "sgd", 0.05, schedules, (),
                               False, TensorParallelModel, timeout=400, init_pg=False)
    _check(per_rank, reference, schedules)


class _MisnamedPlan(TensorParallelModel):
    """A plan naming a submodule the layer does not have (``attn.query``)."""

    def pipeline_parallelize(self, module, index, layer, tp_mesh):
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

        parallelize_module(layer, tp_mesh, {"attn.query": ColwiseParallel()})


def _construct(rank, world, model_cls, placements, topology, heads=None):
    import lightning as L

    from tests.models import make_loader
    from tests.test_equivalence import _trainer_kwargs

    model = model_cls(topology) if heads is None else model_cls(topology, heads=heads)
    strategy = MultiModulePipelineStrategy(placements, topology, num_microbatches=2)
    trainer = L.Trainer(**_trainer_kwargs(world, 1), strategy=strategy)
    try:
        trainer.fit(model, make_loader(topology, 4, 4))
    except PipelineConfigError as err:
        return str(err)
    return None


@pytest.mark.timeout(120)
def test_tensor_parallel_errors_on_every_rank():
    """A model without the hook, and heads that tp does not divide, fail on every rank."""
    require_ranks(2)
    missing = run_distributed(_construct, 2, MultiModalModel, {"llm": P(tp=2)}, LM, timeout=90, init_pg=False)
    assert all("pipeline_parallelize" in m for m in missing), missing
    heads = run_distributed(_construct, 2, TensorParallelModel, {"llm": P(tp=2)}, LM, 3, timeout=90, init_pg=False)
    assert all("do not split over tp=2" in m for m in heads), heads
    misnamed = run_distributed(_construct, 3, _MisnamedPlan, {"enc_a": P(), "llm": P(tp=2)}, ONE_ENC, timeout=90,
                               init_pg=False)
    assert all("'query' could not be resolved" in m and "fix the plan's keys" in m for m in misnamed), misnamed


def _evaluate(rank, world, placements):
    import lightning as L

    from tests.models import make_loader
    from tests.test_equivalence import _trainer_kwargs

    strategy = MultiModulePipelineStrategy(placements, LM, num_microbatches=2)
    trainer = L.Trainer(**{**_trainer_kwargs(world, 1), "limit_val_batches": 1.0}, strategy=strategy)
    model = TensorParallelModel(LM)
    val = trainer.validate(model, make_loader(LM, 8, 16), verbose=False)[0]["val_loss"]
    predictions = trainer.predict(model, make_loader(LM, 8, 8))
    return val, predictions[0]


@pytest.mark.timeout(120)
def test_validate_and_predict_with_tp():
    """Forward-only steps: val_loss and predictions on every rank equal one process's."""
    from lightning_mmpp import run_unpipelined
    from tests.models import make_loader

    require_ranks(4)
    model = TensorParallelModel(LM)
    with torch.no_grad():
        losses = [float(run_unpipelined(model, b)[0]) for b in make_loader(LM, 8, 16)]
        expected = run_unpipelined(model, next(iter(make_loader(LM, 8, 8))))[1]["llm"]
    for val, prediction in run_distributed(_evaluate, 4, {"llm": P(pp=2, tp=2)}, timeout=100, init_pg=False):
        assert abs(val - sum(losses) / 2) <= 1e-5 * abs(val)
        torch.testing.assert_close(prediction, expected, rtol=1e-5, atol=1e-6)


# --- meta-built tp stages: split while built ----------------------------------------------------

META_SEED = 17
META_TP_LAYOUTS = {"llm_tp2_pp2": {"llm": P(pp=2, tp=2)}, "llm_tp2_dp2_shard": {"llm": P(dp=2, tp=2, shard=True)}}


class _MetaTensorParallelModel(TensorParallelModel):
    """Built on the meta device; its hook records, per call, how many of the rank's other LM
    layers are allocated but not split (no DTensor parameter): split while built, none."""

    def __init__(self, *args, **kwargs) -> None:
        with torch.device("meta"):
            super().__init__(*args, **kwargs)
        self.whole_elsewhere: list[int] = []

    def pipeline_parallelize(self, module, index, layer, tp_mesh) -> None:
        from torch.distributed.tensor import DTensor

        if module == "llm":
            self.whole_elsewhere.append(sum(
                1 for other in self.llm if other is not layer
                and any(not p.is_meta for p in other.parameters())
                and not any(isinstance(p, DTensor) for p in other.parameters())))
        super().pipeline_parallelize(module, index, layer, tp_mesh)


def _meta_reference() -> tuple[dict, dict]:
    import lightning as L

    from lightning_mmpp import materialize
    from tests.models import make_loader
    from tests.test_equivalence import STEPS, _trainer_kwargs

    model = materialize(_MetaTensorParallelModel(LM), seed=META_SEED)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    L.Trainer(**_trainer_kwargs(1, STEPS), gradient_clip_val=0.05).fit(model, make_loader(LM, 8, 8 * STEPS))
    return initial, {n: p.detach().clone() for n, p in model.named_parameters()}


def _meta_pipelined(rank, world):
    import lightning as L

    from tests.models import make_loader
    from tests.test_equivalence import STEPS, _FinalParameters, _trainer_kwargs

    out = {}
    for name, placements in META_TP_LAYOUTS.items():
        L.seed_everything(META_SEED, verbose=False)
        model = _MetaTensorParallelModel(LM)
        final, start = _FinalParameters(), _StartParameters.callback()
        strategy = MultiModulePipelineStrategy(placements, LM, num_microbatches=2)
        L.Trainer(**_trainer_kwargs(world, STEPS), strategy=strategy, gradient_clip_val=0.05,
                  callbacks=[final, start]).fit(model, make_loader(LM, 8, 8 * STEPS))
        out[name] = (start.values, final.values, model.whole_elsewhere)
    return out


@pytest.mark.timeout(300)
def test_meta_built_tp_stages_are_split_layer_by_layer_and_train_like_one_process():
    """A meta-built LM on pp=2 tp=2 and on dp=2 tp=2 shard=True: each layer is allocated whole
    and split (and sharded) before the next one is allocated, starts from ``materialize``'s
    one-process values and trains like one process (SGD + momentum, clipping)."""
    require_ranks(4)
    initial, final = _meta_reference()
    for rank, runs in enumerate(run_distributed(_meta_pipelined, 4, timeout=280, init_pg=False)):
        for layout, (start, end, whole_elsewhere) in runs.items():
            assert whole_elsewhere and not any(whole_elsewhere), f"{layout} rank {rank}: {whole_elsewhere}"
            assert start.keys() == end.keys() and start, layout
            for name, value in start.items():
                assert torch.equal(value, initial[name]), f"{layout} rank {rank}: initial {name}"
                torch.testing.assert_close(end[name], final[name], rtol=1e-5, atol=1e-6, msg=f"{layout} {name}")


# --- checkpoints ---------------------------------------------------------------------------------

CKPT_BATCHES = 3


def _ckpt_trainer(placements, epochs, callbacks):
    import lightning as L

    strategy = MultiModulePipelineStrategy(placements, LM, num_microbatches=2)
    return L.Trainer(
        accelerator="cpu", devices=strategy.layout.world_size, strategy=strategy, max_epochs=epochs, logger=False,
        callbacks=list(callbacks), enable_checkpointing=any(type(c).__name__ == "ModelCheckpoint" for c in callbacks),
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
    )


class _StartParameters:
    """Every parameter's whole value when training (re)starts, i.e. right after restoring."""

    @staticmethod
    def callback():
        import lightning as L
        from torch.distributed.tensor import DTensor

        class Start(L.Callback):
            values: dict = {}

            def on_train_start(self, trainer, pl_module) -> None:
                self.values = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                               for n, p in pl_module.named_parameters()}

        return Start()


def _save_tp(rank, world, root):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.models import make_loader
    from tests.test_equivalence import _FinalParameters

    final, saver = _FinalParameters(), ModelCheckpoint(dirpath=f"{root}/tp", filename="{epoch}")
    _ckpt_trainer({"llm": P(pp=2, tp=2)}, 1, [final, saver]).fit(
        TensorParallelModel(LM), make_loader(LM, 8, 8 * CKPT_BATCHES))
    return saver.best_model_path, final.values


def _resume(rank, world, placements, ckpt):
    from tests.models import make_loader
    from tests.test_equivalence import _FinalParameters

    final, start = _FinalParameters(), _StartParameters.callback()
    _ckpt_trainer(placements, 2, [final, start]).fit(
        TensorParallelModel(LM), make_loader(LM, 8, 8 * CKPT_BATCHES), ckpt_path=ckpt)
    return start.values, final.values


@pytest.mark.timeout(300)
def test_a_tp_checkpoint_resumes_exactly_on_tp1_and_on_another_pp(tmp_path):
    """Saved from llm pp=2 tp=2 after one epoch, resumed for a second on pp=2 tp=1 and pp=3 tp=1
    (and on tp=2 again): the restored weights are the saved ones, the final ones those of one
    process training two epochs; the single-process export holds the whole saved tensors."""
    import lightning as L

    from tests.models import make_loader
    from tests.test_equivalence import _trainer_kwargs

    require_ranks(4)
    reference = TensorParallelModel(LM)
    kwargs = {**_trainer_kwargs(1, -1), "max_epochs": 2}
    L.Trainer(**kwargs).fit(reference, make_loader(LM, 8, 8 * CKPT_BATCHES))
    saved = run_distributed(_save_tp, 4, str(tmp_path), timeout=200, init_pg=False)
    ckpt = saved[0][0]
    from lightning_mmpp.state.checkpoint import export_checkpoint

    exported = torch.load(export_checkpoint(ckpt, tmp_path / "one.ckpt"), weights_only=True)["state_dict"]
    for rank_saved in saved:  # the single-process export holds every whole tensor
        for name, value in rank_saved[1].items():
            assert torch.equal(exported[name], value), name
    for placements in ({"llm": P(pp=2)}, {"llm": P(pp=3)}, {"llm": P(tp=2)}):
        world = MultiModulePipelineStrategy(placements, LM, 2).layout.world_size
        results = run_distributed(_resume, world, placements, ckpt, timeout=200, init_pg=False)
        assert set().union(*(final for _, final in results)) == set(exported), placements
        for start, final in results:
            for name, value in start.items():
                assert torch.equal(value, saved[0][1][name] if name in saved[0][1] else saved[-1][1][name]), name
            for name, value in final.items():
                torch.testing.assert_close(value, dict(reference.named_parameters())[name].detach(), rtol=1e-5,
                                           atol=1e-6, msg=f"{placements} {name}")


# --- bytes per boundary --------------------------------------------------------------------------

BYTES_TOPOLOGY = ONE_ENC


def boundary_bytes(rank, world, placements, m=2, batch_size=8):
    """One rank's traffic in the second training step (no spec metadata any more) of a
    :class:`PipelineEngine` over ``placements``: point-to-point bytes sent and received (headers
    included) and the bytes relayed inside its tp group (broadcast by a lead, received by the others)."""
    from lightning_mmpp.core.placement import PipelineLayout
    from lightning_mmpp.engine.engine import PipelineEngine
    from tests.models import make_loader

    torch.manual_seed(0)
    engine = PipelineEngine(TensorParallelModel(BYTES_TOPOLOGY), PipelineLayout(placements, BYTES_TOPOLOGY), m)
    batch = next(iter(make_loader(BYTES_TOPOLOGY, batch_size, batch_size)))
    engine.step(batch)
    engine.comm.reset_stats()
    relay_before = getattr(engine.comm, "relayed_bytes", 0)
    engine.step(batch)
    out = {"sent": engine.comm.stats.bytes_sent, "received": engine.comm.stats.bytes_received,
           "relayed": getattr(engine.comm, "relayed_bytes", 0) - relay_before}
    engine.close()
    return out


@pytest.mark.timeout(120)
def test_a_boundary_moves_one_copy_per_tp_group():
    """enc tp=2 -> llm pp=2 tp=2 against enc -> llm pp=2: each tp lead moves exactly the bytes of
    the rank it stands for without tp, the other tp ranks none point-to-point; inside a group the
    lead broadcasts what it received once."""
    require_ranks(6)
    plain = run_distributed(boundary_bytes, 3, {"enc_a": P(), "llm": P(pp=2)}, timeout=90)
    tp = run_distributed(boundary_bytes, 6, {"enc_a": P(tp=2), "llm": P(pp=2, tp=2)}, timeout=90)
    for lead, (rank, other) in enumerate(((0, 1), (2, 3), (4, 5))):
        assert (tp[rank]["sent"], tp[rank]["received"]) == (plain[lead]["sent"], plain[lead]["received"]) > (0, 0)
        assert (tp[other]["sent"], tp[other]["received"]) == (0, 0)
        assert tp[other]["relayed"] == tp[rank]["relayed"] > 0
    # what a lead relays is what it received, less the 16-byte header (and padding) of each message
    assert tp[2]["relayed"] <= tp[2]["received"]


@pytest.mark.timeout(300)
def test_readme_tensor_parallel_snippet_trains(tmp_path):
    from tests.test_readme_snippet import run_readme_snippet

    out = run_readme_snippet("Tensor parallelism inside a module", tmp_path, "max_steps=8", "max_steps=2")
    assert "Starting with 4 processes" in out and "`max_steps=2` reached" in out, out[-4000:]
