"""Meta-device construction, layout-independent initialisation and pretrained weights."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn

from lightning_mmpp import (
    ModulePlacement,
    MultiModulePipelineStrategy,
    PipelineConfigError,
    PretrainedWeights,
    load_pretrained,
    materialize,
)
from tests.dist import run_distributed
from tests.models import HIDDEN, Block, Decoder, Encoder, Head, MultiModalModel, make_loader

P = ModulePlacement
SEED = 77
STEPS = 2
TWO_ENC = {"enc_a": ["llm"], "enc_b": ["llm"], "llm": []}
# layout A: colocated encoders, llm in two stages; layout B: fan-in (enc_a dp=2) into one llm stage
LAYOUT_A = {"enc_a": P(rank_offset=0), "enc_b": P(rank_offset=0), "llm": P(pp=2)}
LAYOUT_B = {"enc_a": P(dp=2), "enc_b": P(), "llm": P()}


class MetaBuiltModel(MultiModalModel):
    """``MultiModalModel`` whose modules are created in ``configure_model`` (meta under the strategy)."""

    def __init__(self, topology: Mapping[str, Sequence[str]], freeze: Sequence[str] = (), optimizer: str = "sgd") -> None:
        L.LightningModule.__init__(self)
        self.topology = {k: list(v) for k, v in topology.items()}
        self.pipeline_topology = self.topology
        self.lr = 0.1
        self.optimizer_name = optimizer
        self.scheduler = None
        self.freeze = tuple(freeze)

    def configure_model(self) -> None:
        if hasattr(self, "llm"):
            return
        for name in self.topology:
            if name.startswith("enc"):
                setattr(self, name, nn.Sequential(Encoder(6), Encoder(HIDDEN).proj, nn.Tanh()))
            elif name == "llm":
                self.llm = nn.Sequential(*[Block() for _ in range(4)], Head())
            elif name == "dec":
                self.dec = nn.Sequential(Decoder(), nn.Tanh(), nn.Linear(4, 4))
        for name in self.freeze:
            getattr(self, name).requires_grad_(False)
        # every layer, kept outside the module tree: after setup a rank's non-owned layers must still be on meta
        object.__setattr__(self, "all_layers", {f"{m}.{i}": layer for m in self.topology
                                                 for i, layer in enumerate(getattr(self, m))})


def _meta_model(freeze: Sequence[str] = (), optimizer: str = "sgd") -> MetaBuiltModel:
    model = MetaBuiltModel(TWO_ENC, freeze, optimizer)
    with torch.device("meta"):
        model.configure_model()
    return model


def _trainer_kwargs(devices: int) -> dict:
    return dict(
        accelerator="cpu", devices=devices, max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
    )


class RecordInitial(L.Callback):
    def on_train_start(self, trainer, pl_module) -> None:
        pl_module.initial = {n: p.detach().clone() for n, p in pl_module.named_parameters()}


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _reference(pretrained=None, freeze=()) -> tuple[dict, dict]:
    """Single process: materialize (+ load_pretrained), then train."""
    model = _meta_model(freeze)
    materialize(model, seed=SEED)
    if pretrained:
        load_pretrained(model, pretrained)
    initial = _state(model)
    trainer = L.Trainer(**_trainer_kwargs(1))
    trainer.fit(model, make_loader(TWO_ENC, 8, 8 * STEPS))
    return initial, _state(model)


def _fit_meta(rank, world, placements, pretrained=None, freeze=()):
    L.seed_everything(SEED, verbose=False)
    model = MetaBuiltModel(TWO_ENC, freeze)
    strategy = MultiModulePipelineStrategy(placements, TWO_ENC, num_microbatches=4, pretrained=pretrained)
    trainer = L.Trainer(**_trainer_kwargs(world), strategy=strategy, callbacks=[RecordInitial()])
    trainer.fit(model, make_loader(TWO_ENC, 8, 8 * STEPS))
    own = {name for runner in strategy.engine.partition.runners.values() for name in
           (f"{runner.module}.{n}" for n in runner.layer_names)}
    not_meta = [f"{name}: {n}" for name, layer in model.all_layers.items() if name not in own
                for n, p in layer.named_parameters() if not p.is_meta]
    return {"initial": model.initial, "final": _state(model), "not_meta": not_meta,
            "read": strategy.engine.pretrained_keys_read}


def _check_runs(per_rank, initial, final, exact_final=False):
    seen = set()
    for result in per_rank:
        assert not result["not_meta"], f"non-owned parameters were materialised: {result['not_meta']}"
        for name, value in result["initial"].items():
            assert torch.equal(value, initial[name]), f"initial {name} differs"
            torch.testing.assert_close(result["final"][name], final[name], rtol=1e-5, atol=1e-6, msg=name)
            seen.add(name)
    assert seen == set(initial)


# --- one process ---------------------------------------------------------------------------


def test_materialize_depends_only_on_seed_and_name():
    whole = _meta_model()
    materialize(whole, seed=SEED)
    assert all(not p.is_meta for p in whole.parameters())
    # a model holding only some layers (as a partitioned rank does) gets the same values for them
    part = _meta_model()
    del part.llm._modules["0"], part.enc_a._modules["2"]  # as partitioning does: names kept
    part.enc_b = nn.Sequential()
    materialize(part, seed=SEED)
    expected = dict(whole.named_parameters())
    for name, p in part.named_parameters():
        assert torch.equal(p, expected[name]), name
    other = materialize(_meta_model(), seed=SEED + 1)
    assert not torch.equal(other.llm[1].lin.weight, whole.llm[1].lin.weight)
    # seed=None is torch.initial_seed(); parameters keep their identity
    torch.manual_seed(SEED)
    model = _meta_model()
    weight = model.llm[2].emb.weight
    materialize(model)
    assert model.llm[2].emb.weight is weight and torch.equal(weight, whole.llm[2].emb.weight)
    # buffers too
    with torch.device("meta"):
        norm = nn.Sequential(nn.BatchNorm1d(3))
    materialize(norm, seed=0)
    assert torch.equal(norm[0].running_var, torch.ones(3)) and norm[0].num_batches_tracked.item() == 0


class NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return x * self.scale


def test_materialize_names_a_submodule_it_cannot_initialise():
    with torch.device("meta"):
        model = nn.Module()
        model.llm = nn.Sequential(nn.Linear(3, 3), nn.Sequential(NoReset()))
    with pytest.raises(PipelineConfigError) as err:
        materialize(model)
    assert str(err.value) == (
        "submodule(s) llm.1.0 (NoReset) were built on the meta device and have no reset_parameters(), so they "
        "cannot be initialised. Give the class a reset_parameters() that fills every parameter and buffer it owns, "
        "or load pretrained weights for them (pretrained=...)."
    )


def _write_sources(root: Path, model: nn.Module) -> dict[str, object]:
    """The same weights in every kind of source, keyed for module ``llm`` / ``enc_*``."""
    import torch.distributed.checkpoint as dcp

    safetensors = pytest.importorskip("safetensors.torch")
    llm = {k: v.clone() for k, v in model.llm.state_dict().items()}
    safetensors.save_file(llm, str(root / "llm.safetensors"))
    torch.save({k: v.clone() for k, v in model.enc_a.state_dict().items()}, root / "enc_a.pt")
    dcp.save({k: v.clone() for k, v in model.enc_b.state_dict().items()},
             storage_writer=dcp.FileSystemWriter(str(root / "enc_b_dcp")), no_dist=True)
    # Hugging Face style names, one extra tensor that key_map drops; stored in bfloat16-free fp64
    hf = {f"model.layers.{k}": v.double() for k, v in llm.items()}
    hf["model.rotary.inv_freq"] = torch.ones(2)
    safetensors.save_file(hf, str(root / "hf.safetensors"))
    # this project's checkpoint layout: full names under model/
    dcp.save({f"model/enc_a.{k}": v.clone() for k, v in model.enc_a.state_dict().items()} | {"optim/0": torch.ones(1)},
             storage_writer=dcp.FileSystemWriter(str(root / "project_ckpt")), no_dist=True)
    # a Lightning checkpoint file (what lightning_mmpp.state.export writes): full names under state_dict
    torch.save({"state_dict": {f"enc_b.{k}": v.clone() for k, v in model.enc_b.state_dict().items()}, "epoch": 1},
               root / "export.ckpt")
    return {
        "kinds": {"llm": str(root / "llm.safetensors"), "enc_a": str(root / "enc_a.pt"),
                  "enc_b": str(root / "enc_b_dcp")},
        "renamed": {"llm": PretrainedWeights(root / "hf.safetensors", key_map=_from_hf),
                    "enc_a": str(root / "project_ckpt"), "enc_b": str(root / "export.ckpt")},
    }


def _from_hf(key: str) -> str | None:
    return None if "rotary" in key else key.removeprefix("model.layers.")


def _pretrained_values(seed: int = 5) -> nn.Module:
    model = _meta_model()
    return materialize(model, seed=seed)


def test_load_pretrained_from_every_kind_of_source(tmp_path):
    values = _pretrained_values()
    sources = _write_sources(tmp_path, values)
    for kind in ("kinds", "renamed"):
        model = materialize(_meta_model(), seed=SEED)
        load_pretrained(model, sources[kind])
        for name, p in model.named_parameters():
            assert torch.equal(p, dict(values.named_parameters())[name]), f"{kind}: {name}"


def test_pretrained_mismatches_name_module_key_file_and_shapes(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    good = {k: v.clone() for k, v in _pretrained_values().llm.state_dict().items()}
    bad = dict(good)
    bad["0.lin.weight"] = torch.zeros(HIDDEN, HIDDEN + 1)
    del bad["4.out.bias"]
    bad["9.extra"] = torch.zeros(2)
    path = tmp_path / "bad.safetensors"
    safetensors.save_file(bad, str(path))
    with pytest.raises(PipelineConfigError) as err:
        load_pretrained(materialize(_meta_model(), seed=0), {"llm": str(path)})
    assert str(err.value) == (
        f"pretrained weights do not fit (module 'llm', file {str(path)!r}):\n"
        "  key '0.lin.weight': expected shape [8, 8], found shape [8, 9]\n"
        "  missing key '4.out.bias': expected shape [11] torch.float32, found nothing\n"
        "  unexpected key '9.extra': found shape [2], the module has no such entry\n"
        "Rename keys with PretrainedWeights(path, key_map=...) (return None to drop a key), or pass strict=False "
        "to load only the keys both sides have."
    )
    # strict=False loads what fits in name and shape is still required
    del bad["0.lin.weight"]
    safetensors.save_file(bad, str(path))
    model = materialize(_meta_model(), seed=0)
    load_pretrained(model, {"llm": PretrainedWeights(path, strict=False)})
    assert torch.equal(model.llm[1].lin.weight, good["1.lin.weight"])
    # a dtype that cannot be cast
    ints = dict(good)
    ints["1.lin.weight"] = torch.zeros(HIDDEN, HIDDEN, dtype=torch.int64)
    safetensors.save_file(ints, str(path))
    with pytest.raises(PipelineConfigError, match=r"key '1.lin.weight': expected dtype torch.float32, found "
                                                  r"torch.int64 \(cannot cast\)"):
        load_pretrained(materialize(_meta_model(), seed=0), {"llm": str(path)})
    with pytest.raises(PipelineConfigError, match="does not exist"):
        load_pretrained(materialize(_meta_model(), seed=0), {"llm": str(tmp_path / "nope.safetensors")})


def test_missing_safetensors_names_the_extra(tmp_path, monkeypatch):
    path = tmp_path / "w.safetensors"
    path.write_bytes(b"")
    monkeypatch.setitem(sys.modules, "safetensors", None)
    fix = r"pip install safetensors \(in a clone of lightning_mmpp: pip install -e '\.\[safetensors\]'\)"
    with pytest.raises(PipelineConfigError, match=fix):
        load_pretrained(materialize(_meta_model(), seed=0), {"llm": str(path)})


def test_unknown_pretrained_module_is_refused():
    with pytest.raises(PipelineConfigError, match=r"pretrained= names \['vision'\]"):
        MultiModulePipelineStrategy(LAYOUT_A, TWO_ENC, 4, pretrained={"vision": "x.safetensors"})


# --- distributed ---------------------------------------------------------------------------


@pytest.mark.timeout(300)
@pytest.mark.distributed
def test_meta_build_is_layout_independent_and_trains_like_one_process():
    """Layouts A (colocation) and B (fan-in) initialise bitwise like ``materialize`` in one process,
    allocate nothing they do not own, and train like the single-process run started from it."""
    initial, final = _reference()
    for placements, world in ((LAYOUT_A, 3), (LAYOUT_B, 4)):
        per_rank = run_distributed(_fit_meta, world, placements, timeout=240, init_pg=False)
        _check_runs(per_rank, initial, final)


def _fit_pretrained_and_errors(rank, world, placements, sources, bad):
    out = {}
    for kind in ("kinds", "renamed"):
        out[kind] = _fit_meta(rank, world, placements, sources[kind], freeze=("enc_a",))
    try:
        _fit_meta(rank, world, placements, {"llm": bad})
    except PipelineConfigError as err:
        out["error"] = str(err)
    return out


@pytest.mark.timeout(300)
@pytest.mark.distributed
def test_pretrained_under_the_strategy(tmp_path):
    """Each source kind loads the values a single process loads; a frozen pretrained encoder trains
    like one process; each rank reads only its own stages; a mismatch fails on every rank."""
    values = _pretrained_values()
    sources = _write_sources(tmp_path, values)
    bad = tmp_path / "bad.pt"
    torch.save({"0.lin.weight": torch.zeros(1)}, bad)
    per_rank = run_distributed(_fit_pretrained_and_errors, 3, LAYOUT_A, sources, str(bad), timeout=240, init_pg=False)
    for kind in ("kinds", "renamed"):
        initial, final = _reference(sources[kind], freeze=("enc_a",))
        _check_runs([r[kind] for r in per_rank], initial, final)
    # rank 0 holds both encoders, ranks 1 and 2 one llm stage each (layers 0-2 and 3-4)
    reads = [{m: sorted(k.split(".")[0] for k in keys) for m, keys in r["kinds"]["read"].items()} for r in per_rank]
    assert reads[0] == {"enc_a": ["0", "0", "1", "1"], "enc_b": ["0", "0", "1", "1"], "llm": []}
    assert set(reads[1]["llm"]) | set(reads[2]["llm"]) == {"0", "1", "2", "3", "4"}
    assert not set(reads[1]["llm"]) & set(reads[2]["llm"])
    assert reads[1]["enc_a"] == reads[2]["enc_a"] == []
    messages = {r["error"] for r in per_rank}
    assert len(messages) == 1 and "key '0.lin.weight': expected shape [8, 8], found shape [1]" in messages.pop()
