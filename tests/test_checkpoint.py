"""Checkpoints: save under the strategy, resume exactly, resume on another placement, export, errors.

Three launches share one temporary directory (module fixtures):

1. layout A (enc dp=2 -> llm pp=2, 4 ranks): 6 uninterrupted steps; 3 steps with a
   ``ModelCheckpoint`` whose filename holds ``train_loss``; ``save_checkpoint`` /
   ``remove_checkpoint``; a pipelined validation loss.
2. layout B (everything pp=1 dp=1, 2 ranks): resume A's checkpoint; 3 fresh steps, saved.
3. layout A again: exact resume of A's checkpoint; resume of B's; the error cases.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
import zlib
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_mmpp import ModulePlacement, MultiModulePipelineStrategy, run_unpipelined
from lightning_mmpp.state.checkpoint import export_checkpoint
from tests.dist import run_distributed
from tests.models import HIDDEN, VOCAB, MultiModalModel, make_loader

pytestmark = pytest.mark.distributed  # every test here launches processes

P = ModulePlacement
TOPOLOGY = {"enc_a": ["llm"], "llm": []}
LAYOUT_A = {"enc_a": P(dp=2), "llm": P(pp=2)}  # ranks 0-1: enc replicas; ranks 2-3: llm stages
LAYOUT_B = {"enc_a": P(), "llm": P()}  # rank 0: enc; rank 1: llm
BATCH = 8
EPOCH = 3  # batches per epoch: ModelCheckpoint saves at step 3, an epoch boundary
FILENAME = "{epoch}-{step}-{train_loss:.3f}"


def _model(**kwargs) -> MultiModalModel:
    return MultiModalModel(TOPOLOGY, optimizer="adam", scheduler="step", **kwargs)


class _WideHead(MultiModalModel):
    """The test model with one more output unit: ``llm.4.out`` changes shape."""

    def __init__(self) -> None:
        super().__init__(TOPOLOGY, optimizer="adam", scheduler="step")
        self.llm[4].out = nn.Linear(HIDDEN, VOCAB + 1)


def _loader(batches: int = EPOCH):
    return make_loader(TOPOLOGY, BATCH, BATCH * batches)


def _trainer(layout, epochs: int, callbacks=()) -> L.Trainer:
    # Epoch-based on purpose: with max_steps set, Lightning 2.6 resumes an epoch-end checkpoint
    # with one extra batch of the finished epoch (single-process too), so it cannot resume exactly.
    strategy = MultiModulePipelineStrategy(layout, TOPOLOGY, num_microbatches=2)
    return L.Trainer(
        accelerator="cpu", devices=strategy.layout.world_size, strategy=strategy, max_epochs=epochs, logger=False,
        callbacks=list(callbacks), enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )


class _Executes:
    """Unpickling this would create ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _optim(trainer) -> dict:
    """The rank's Adam state keyed by name, and the learning rate."""
    state = trainer.strategy.optimizer_state(trainer.optimizers[0])
    return {
        "state": {n: {k: v.clone() for k, v in s.items()} for n, s in state["state"].items()},
        "lr": state["param_groups"][0]["lr"],
    }


class _Snapshot(L.Callback):
    """Parameters and optimizer state as training (re)starts, i.e. right after restoring."""

    def on_train_start(self, trainer, pl_module) -> None:
        self.params = _params(pl_module)
        self.optim = _optim(trainer)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == EPOCH:  # the RNG state the first resumed step runs with
            self.rng = (torch.get_rng_state(), random.random())


def _merge(per_rank: list[dict], key: str) -> dict:
    """Union of the ranks' name-keyed dicts; dp replicas must agree exactly."""
    out: dict = {}
    for result in per_rank:
        for name, value in result[key].items():
            if name in out:
                _assert_equal(out[name], value, f"{key} {name}: replicas differ")
            out[name] = value
    return out


def _assert_equal(a, b, msg: str) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), msg
        for k in a:
            _assert_equal(a[k], b[k], f"{msg}/{k}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), msg
    else:
        assert a == b, msg


def _assert_close(a: dict, b: dict, msg: str) -> None:
    assert a.keys() == b.keys(), f"{msg}: {sorted(a.keys() ^ b.keys())}"
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=f"{msg} {name}")


# --- the three launches --------------------------------------------------------------------------


def _seed_per_rank(rank: int) -> None:
    """A different RNG stream on every rank: the checkpoint must save and restore each."""
    torch.manual_seed(100 + rank)
    random.seed(100 + rank)


def _run_a(rank, world, root: Path) -> dict:
    out: dict = {}
    snap = _Snapshot()
    model = _model()
    _seed_per_rank(rank)
    _trainer(LAYOUT_A, 2, [snap]).fit(model, _loader())
    out["params6"], out["rng6"] = _params(model), snap.rng

    saver = ModelCheckpoint(dirpath=root / "ckpt_a", filename=FILENAME)
    # last.ckpt rewritten after every step: each save replaces the previous one atomically
    last = ModelCheckpoint(dirpath=root / "last", save_top_k=0, save_last=True, every_n_train_steps=1)
    model = _model()
    _seed_per_rank(rank)
    trainer = _trainer(LAYOUT_A, 1, [saver, last])
    trainer.fit(model, _loader())
    out["ckpt"] = saver.best_model_path
    out["train_loss"] = float(trainer.callback_metrics["train_loss"])
    out["params3"] = _params(model)
    out["optim3"] = _optim(trainer)

    extra = root / "extra.ckpt"
    trainer.save_checkpoint(extra)
    out["extra_files"] = sorted(os.listdir(extra)) if rank == 0 else None  # rank 0 removes it next
    trainer.strategy.remove_checkpoint(extra)
    out["extra_removed"] = not extra.exists()

    trainer.validate(model, _loader(batches=1))
    out["val_loss"] = float(trainer.callback_metrics["val_loss"])
    return out


def _run_b(rank, world, root: Path, ckpt_a: str) -> dict:
    out: dict = {}
    snap = _Snapshot()
    model = _model()
    _trainer(LAYOUT_B, 2, [snap]).fit(model, _loader(), ckpt_path=ckpt_a)
    out["start_params"], out["start_optim"], out["params6"] = snap.params, snap.optim, _params(model)

    saver = ModelCheckpoint(dirpath=root / "ckpt_b", filename=FILENAME)
    model = _model()
    trainer = _trainer(LAYOUT_B, 1, [saver])
    trainer.fit(model, _loader())
    out["ckpt"] = saver.best_model_path
    out["params3"], out["optim3"] = _params(model), _optim(trainer)

    trainer = _trainer(LAYOUT_B, 1)  # loading outside fit: the weights only
    trainer.validate(_model(), _loader(batches=1), ckpt_path=ckpt_a)
    out["val_loss_a"] = float(trainer.callback_metrics["val_loss"])
    return out


def _run_a_again(rank, world, ckpt_a: str, ckpt_b: str, broken: dict[str, str]) -> dict:
    out: dict = {}
    snap = _Snapshot()
    model = _model()
    _trainer(LAYOUT_A, 2, [snap]).fit(model, _loader(), ckpt_path=ckpt_a)
    out["exact_start"], out["exact_params6"], out["exact_rng"] = snap.params, _params(model), snap.rng

    snap = _Snapshot()
    model = _model()
    _trainer(LAYOUT_A, 2, [snap]).fit(model, _loader(), ckpt_path=ckpt_b)
    out["from_b_start"], out["from_b_optim"], out["from_b_params6"] = snap.params, snap.optim, _params(model)

    for label, make, path in (
        ("names", lambda: _model(llm_layers=5), ckpt_a),
        ("shapes", _WideHead, ckpt_a),
        *((label, _model, path) for label, path in broken.items()),
    ):
        try:
            _trainer(LAYOUT_A, 2).fit(make(), _loader(), ckpt_path=path)
            out[label] = None
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            out[label] = (type(exc).__name__, str(exc))
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ckpt")


@pytest.fixture(scope="module")
def run_a(root) -> list[dict]:
    return run_distributed(_run_a, 4, root, timeout=120, init_pg=False)


@pytest.fixture(scope="module")
def run_b(root, run_a) -> list[dict]:
    return run_distributed(_run_b, 2, root, run_a[0]["ckpt"], timeout=120, init_pg=False)


# --- tests ---------------------------------------------------------------------------------------


@pytest.mark.timeout(150)
def test_save_under_the_strategy(run_a):
    ckpt = Path(run_a[0]["ckpt"])
    assert all(r["ckpt"] == str(ckpt) for r in run_a)
    # the metric in the filename is the rank-identical train_loss
    losses = {r["train_loss"] for r in run_a}
    assert len(losses) == 1
    assert ckpt.name == f"epoch=0-step=3-train_loss={losses.pop():.3f}.ckpt"
    assert ckpt.is_dir()
    files = sorted(os.listdir(ckpt))
    assert {".metadata", "meta.pt", "manifest.json", *(f"rng_rank{r}.pt" for r in range(4))} <= set(files)
    assert any(re.fullmatch(r"__\d+_0\.distcp", f) for f in files)
    assert run_a[0]["extra_files"] == files
    assert all(r["extra_removed"] for r in run_a)
    assert sorted(os.listdir(ckpt.parent)) == [ckpt.name]  # no staging directories left behind
    last = ckpt.parent.parent / "last"
    assert os.listdir(last) == ["last.ckpt"]
    assert torch.load(last / "last.ckpt" / "meta.pt", weights_only=True)["global_step"] == 3
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert sorted(manifest["files"]) == sorted(set(files) - {"manifest.json"})
    assert all(entry["size"] == (ckpt / name).stat().st_size for name, entry in manifest["files"].items())

    meta = torch.load(ckpt / "meta.pt", weights_only=True)
    assert meta["global_step"] == 3 and "state_dict" not in meta
    assert meta["lr_schedulers"][0]["last_epoch"] == 3
    assert meta["hyper_parameters"]["optimizer"] == "adam"
    group = meta["optimizer_states"][0]["param_groups"][0]
    assert group["params"] == list(_params(_model()))  # every name, in the unpartitioned order
    assert group["lr"] == pytest.approx(0.1 * 0.5**3)
    rng = torch.load(ckpt / "rng_rank3.pt", weights_only=True)
    assert {"torch", "python", "numpy"} <= set(rng)

    # each tensor is stored once, under its original name
    reader = torch.distributed.checkpoint.FileSystemReader(str(ckpt))
    keys = set(reader.read_metadata().state_dict_metadata)
    names = _merge(run_a, "params3")
    assert {f"model/{n}" for n in names} <= keys
    assert {f"optim/0/{n}/{k}" for n in names for k in ("step", "exp_avg", "exp_avg_sq")} <= keys


@pytest.mark.timeout(240)
def test_resume_exactly_and_on_other_placements_and_errors(root, run_a, run_b):
    ckpt_a = run_a[0]["ckpt"]
    reader = torch.distributed.checkpoint.FileSystemReader(str(ckpt_a))
    shard = next(
        info.relative_path for index, info in reader.read_metadata().storage_data.items()
        if index.fqn == "model/llm.4.out.weight"
    )
    broken = {label: root / f"{label}.ckpt" for label in ("missing", "truncated", "crafted")}
    for path in broken.values():
        shutil.copytree(ckpt_a, path)
    (broken["missing"] / shard).unlink()
    with open(broken["truncated"] / shard, "r+b") as f:
        f.truncate(64)
    with open(broken["crafted"] / ".metadata", "wb") as f:
        pickle.dump(_Executes(root / "executed"), f)
    manifest = json.loads((broken["crafted"] / "manifest.json").read_text())
    manifest["files"][".metadata"] = {  # what an attacker would do
        "size": (broken["crafted"] / ".metadata").stat().st_size,
        "crc32": f"{zlib.crc32((broken['crafted'] / '.metadata').read_bytes()):08x}",
    }
    (broken["crafted"] / "manifest.json").write_text(json.dumps(manifest))

    run_a2 = run_distributed(
        _run_a_again, 4, ckpt_a, run_b[0]["ckpt"], {k: str(v) for k, v in broken.items()}, timeout=180,
        init_pg=False,
    )

    params3, params6 = _merge(run_a, "params3"), _merge(run_a, "params6")
    # A -> A: bit for bit the uninterrupted run
    _assert_equal(_merge(run_a2, "exact_start"), params3, "restored parameters")
    _assert_equal(_merge(run_a2, "exact_params6"), params6, "3 steps + resume + 3 steps")
    assert not torch.equal(run_a[0]["rng6"][0], run_a[3]["rng6"][0])
    for rank, (result, reference) in enumerate(zip(run_a2, run_a)):
        assert torch.equal(result["exact_rng"][0], reference["rng6"][0]), f"rank {rank}: torch RNG differs at step 3"
        assert result["exact_rng"][1] == reference["rng6"][1], f"rank {rank}: python RNG differs at step 3"

    # A -> B: everything restored exactly by name, then training continues
    _assert_equal(_merge(run_b, "start_params"), params3, "A -> B parameters")
    start_optim = {n: s for r in run_b for n, s in r["start_optim"]["state"].items()}
    _assert_equal(start_optim, {n: s for r in run_a for n, s in r["optim3"]["state"].items()}, "A -> B Adam state")
    assert all(r["start_optim"]["lr"] == pytest.approx(0.1 * 0.5**3) for r in run_b)
    _assert_close(_merge(run_b, "params6"), params6, "A -> B after 6 steps")
    for result in run_b:
        assert result["val_loss_a"] == pytest.approx(run_a[0]["val_loss"], rel=1e-6)

    # B -> A
    params3_b = _merge(run_b, "params3")
    _assert_equal(_merge(run_a2, "from_b_start"), params3_b, "B -> A parameters")
    from_b_optim = {n: s for r in run_a2 for n, s in r["from_b_optim"]["state"].items()}
    _assert_equal(from_b_optim, {n: s for r in run_b for n, s in r["optim3"]["state"].items()}, "B -> A Adam state")
    _assert_close(_merge(run_a2, "from_b_params6"), params6, "B -> A after 6 steps")

    # errors, identical on every rank (no rank hangs)
    for label, kind, needle in (
        ("names", "PipelineConfigError", "'llm.4.lin.weight' is not in the checkpoint"),
        ("shapes", "PipelineConfigError", "'llm.4.out.weight' has shape (11, 8) in the checkpoint but (12, 8)"),
        ("missing", "PipelineConfigError", f"file {shard!r} (it holds 'model/llm."),
        ("truncated", "PipelineConfigError", f"file {shard!r} (it holds 'model/llm."),
        ("truncated", "PipelineConfigError", "is truncated: 64 bytes on disk"),
        ("crafted", "PipelineConfigError", "its index '.metadata' cannot be read safely"),
    ):
        errors = {r[label] for r in run_a2}
        assert len(errors) == 1, errors
        error = errors.pop()
        assert error is not None and error[0] == kind and needle in error[1], error
    assert not (root / "executed").exists()


@pytest.mark.timeout(120)
def test_export_to_one_file(root, run_a):
    from lightning_mmpp.state.export import main

    out = root / "export" / "model.ckpt"
    assert main([run_a[0]["ckpt"], str(out)]) == 0
    ckpt = torch.load(out, weights_only=True)
    assert ckpt["global_step"] == 3 and "mmpp" not in ckpt

    # an ordinary Lightning checkpoint: load_from_checkpoint on one process, no strategy
    model = MultiModalModel.load_from_checkpoint(out)
    assert model.hparams.optimizer == "adam" and model.hparams.scheduler == "step"
    _assert_equal(_params(model), _merge(run_a, "params3"), "exported parameters")
    batch = next(iter(_loader(batches=1)))
    with torch.no_grad():
        loss, _ = run_unpipelined(model, TOPOLOGY, batch)
    torch.testing.assert_close(loss.item(), run_a[0]["val_loss"], rtol=1e-6, atol=1e-7)

    # ... and resumable on one process: index-keyed Adam state, scheduler, loops
    model = _model()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    trainer.fit(model, _loader(), ckpt_path=out)
    _assert_close(_params(model), _merge(run_a, "params6"), "single-process resume from the export")

    assert export_checkpoint(run_a[0]["ckpt"], root / "again.ckpt") == root / "again.ckpt"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        export_checkpoint(root / "nowhere", root / "x.ckpt")


# --- parameters tied across stages ---------------------------------------------------------------

TIED_LAYOUT = {"enc_a": P(), "llm": P(pp=2)}  # the llm's embedding (stage 0) is its head (stage 1)


def _tied_model():
    from tests.test_tied import TiedModel

    return TiedModel(TOPOLOGY, optimizer="adam", scheduler="step")


def _single_process(epochs: int) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=1, max_epochs=epochs, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )


def _save_tied(rank, world, root: str) -> str:
    saver = ModelCheckpoint(dirpath=root, filename="tied")
    _trainer(TIED_LAYOUT, 1, [saver]).fit(_tied_model(), _loader())
    return saver.best_model_path


def _resume_tied(rank, world, ckpt: str) -> dict:
    model = _tied_model()
    _trainer(LAYOUT_B, 2).fit(model, _loader(), ckpt_path=ckpt)  # the tie inside one rank now
    return {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}


@pytest.mark.timeout(180)
def test_a_tied_parameter_is_stored_once_and_resumes_anywhere(tmp_path):
    ckpt = Path(run_distributed(_save_tied, 3, str(tmp_path), timeout=120, init_pg=False)[0])
    keys = set(torch.distributed.checkpoint.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata)
    assert "model/llm.0.emb.weight" in keys and "model/llm.4.out.weight" not in keys
    assert "optim/0/llm.0.emb.weight/exp_avg" in keys
    assert not any(k.startswith("optim/0/llm.4.out.weight") for k in keys)
    meta = torch.load(ckpt / "meta.pt", weights_only=True)
    assert meta["mmpp"]["aliases"] == {"llm.4.out.weight": "llm.0.emb.weight"}
    reference = _tied_model()
    names = [n for n, _ in reference.named_parameters()]  # one entry for the tied parameter, as in one process
    assert meta["optimizer_states"][0]["param_groups"][0]["params"] == names

    _single_process(2).fit(reference, _loader())
    expected = {n: p.detach() for n, p in reference.named_parameters(remove_duplicate=False)}

    # export -> single-process resume (index-keyed Adam state for the one tied parameter)
    out = export_checkpoint(ckpt, tmp_path / "tied_export.ckpt")
    exported = torch.load(out, weights_only=True)
    assert torch.equal(exported["state_dict"]["llm.4.out.weight"], exported["state_dict"]["llm.0.emb.weight"])
    model = _tied_model()
    _single_process(2).fit(model, _loader(), ckpt_path=out)
    assert model.llm[4].out.weight is model.llm[0].emb.weight
    _assert_close({n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}, expected,
                  "single-process resume of the export")

    # pipelined resume where one rank holds both ends of the tie
    resumed = {n: v for r in run_distributed(_resume_tied, 2, str(ckpt), timeout=120, init_pg=False)
               for n, v in r.items()}
    _assert_close(resumed, expected, "resume on another placement")


SHARDED_TIED_LAYOUT = {"enc_a": P(), "llm": P(pp=2, dp=2, shard=True)}  # both tied copies FSDP2-sharded


def _zero_bubble_trainer(layout, epochs: int, callbacks=()) -> L.Trainer:
    strategy = MultiModulePipelineStrategy(layout, TOPOLOGY, num_microbatches=2, schedule="zero_bubble")
    return L.Trainer(
        accelerator="cpu", devices=strategy.layout.world_size, strategy=strategy, max_epochs=epochs, logger=False,
        callbacks=list(callbacks), enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )


def _save_sharded_tied(rank, world, root: str) -> str:
    saver = ModelCheckpoint(dirpath=root, filename="sharded_tied")
    _zero_bubble_trainer(SHARDED_TIED_LAYOUT, 1, [saver]).fit(_tied_model(), _loader())
    return saver.best_model_path


def _resume_sharded_tied(rank, world, ckpt: str) -> dict:
    final: dict = {}

    class Gather(L.Callback):  # whole tensors while the dp groups exist
        def on_train_end(self, trainer, pl_module):
            final.update({n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                          for n, p in pl_module.named_parameters(remove_duplicate=False)})

    _zero_bubble_trainer(SHARDED_TIED_LAYOUT, 2, [Gather()]).fit(_tied_model(), _loader(), ckpt_path=ckpt)
    return final


@pytest.mark.timeout(300)
def test_sharded_tied_zero_bubble_checkpoints_resume_exactly_on_unsharded_layouts_and_back(tmp_path):
    """A checkpoint of a sharded tied LM trained with zero_bubble resumes exactly on an unsharded
    layout (the tie inside one rank), and an unsharded tied checkpoint resumes exactly on the
    sharded zero_bubble layout; the tied tensor is stored once either way."""
    reference = _tied_model()
    _single_process(2).fit(reference, _loader())
    expected = {n: p.detach() for n, p in reference.named_parameters(remove_duplicate=False)}

    sharded = Path(run_distributed(_save_sharded_tied, 5, str(tmp_path), timeout=150, init_pg=False)[0])
    keys = set(torch.distributed.checkpoint.FileSystemReader(str(sharded)).read_metadata().state_dict_metadata)
    assert "model/llm.0.emb.weight" in keys and "model/llm.4.out.weight" not in keys
    resumed = {n: v for r in run_distributed(_resume_tied, 2, str(sharded), timeout=150, init_pg=False)
               for n, v in r.items()}
    _assert_close(resumed, expected, "sharded zero_bubble -> unsharded resume")

    plain = Path(run_distributed(_save_tied, 3, str(tmp_path / "plain"), timeout=150, init_pg=False)[0])
    back = {n: v for r in run_distributed(_resume_sharded_tied, 5, str(plain), timeout=150, init_pg=False)
            for n, v in r.items()}
    _assert_close(back, expected, "unsharded -> sharded zero_bubble resume")
