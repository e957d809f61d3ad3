"""examples/train_vlm.py: Hugging Face SigLIP + Llama layers, pretrained files, meta build,
0 to 2 images per sample (a ``Ragged``).

Needs the ``examples`` extra (safetensors, transformers); skipped
cleanly without it. CI installs it (scripts/install.sh test,examples).
"""

from __future__ import annotations

import math
import os
import sys

import lightning as L
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

try:
    import safetensors.torch  # noqa: F401
    import transformers  # noqa: F401
except Exception as err:  # a missing package, or one that cannot load beside this torch
    pytest.skip(f"the 'examples' extra is not usable here: {type(err).__name__}: {err}", allow_module_level=True)

import train_vlm as vlm  # noqa: E402

from lightning_mmpp import MultiModulePipelineStrategy, load_pretrained  # noqa: E402
from tests.dist import run_distributed  # noqa: E402

STEPS = 3
SIZE = dict(width=32, layers=2, vision_layers=1)


def _trainer_kwargs(devices: int, precision: str = "32-true") -> dict:
    return dict(accelerator="cpu", devices=devices, max_steps=STEPS, precision=precision, logger=False,
                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}


def _pipelined(rank, world, paths):
    L.seed_everything(0, verbose=False)
    model = vlm.VisionLanguageModel(**SIZE)
    strategy = MultiModulePipelineStrategy(
        vlm.placements(), model.pipeline_topology, num_microbatches=2,
        pretrained=vlm.pretrained_sources(paths, SIZE["layers"], SIZE["vision_layers"]),
    )
    trainer = L.Trainer(**_trainer_kwargs(world), strategy=strategy)
    trainer.fit(model, vlm.make_loader(8, STEPS, shuffle=False))
    out = {"params": _params(model), "loss": float(trainer.callback_metrics["train_loss"])}
    # the command line, in bf16-mixed
    out["bf16_losses"] = vlm.main(["--steps", "2", "--batch-size", "8", "--microbatches", "2", "--precision",
                                   "bf16-mixed", "--width", "32", "--layers", "2", "--vision-layers", "1",
                                   "--weights-dir", str(paths["llm"].parent)])
    return out


def _assert_params_match(per_rank, expected) -> None:
    """Every rank's parameters against one process's; together the ranks hold all of them."""
    seen = set()
    for result in per_rank:
        for name, value in result["params"].items():
            # AdamW: a near-zero gradient's rounding can move one element by ~1e-5; a wrong gradient
            # moves whole tensors by lr = 3e-3 per step
            torch.testing.assert_close(value, expected[name], rtol=1e-3, atol=1e-4,
                                       msg=lambda m, name=name: f"{name}: {m}")
            seen.add(name)
    assert seen == set(expected)


@pytest.mark.timeout(300)
@pytest.mark.distributed
def test_vlm_example_matches_one_process(tmp_path):
    paths = vlm.write_pretrained(tmp_path, **SIZE)
    # the batches are ragged: 0, 1 or 2 images per sample, packed by sample
    counts = torch.cat([b["images"].counts for b in vlm.make_loader(8, STEPS, shuffle=False)])
    assert set(counts.tolist()) == {0, 1, 2}
    # one process: the same meta build, materialize, the same pretrained files
    L.seed_everything(0, verbose=False)
    reference = vlm.VisionLanguageModel(**SIZE)
    with torch.device("meta"):
        reference.configure_model()
    # the projector from the seed, the encoder and the LM from their files
    load_pretrained(reference, vlm.pretrained_sources(paths, SIZE["layers"], SIZE["vision_layers"]), seed=0)
    frozen_before = {n: p.clone() for n, p in reference.vision.named_parameters()}
    L.Trainer(**_trainer_kwargs(1)).fit(reference, vlm.make_loader(8, STEPS, shuffle=False))
    expected = _params(reference)
    for n, p in reference.vision.named_parameters():
        assert torch.equal(p, frozen_before[n]), f"frozen encoder changed: {n}"

    per_rank = run_distributed(_pipelined, 3, paths, timeout=280, init_pg=False)
    _assert_params_match(per_rank, expected)
    for result in per_rank:
        assert all(math.isfinite(x) for x in result["bf16_losses"]) and len(result["bf16_losses"]) == 2
    tied = ("llm.0.embed_tokens.weight", f"llm.{SIZE['layers'] + 1}.lm_head.weight")
    copies = [r["params"][n] for r in per_rank for n in tied if n in r["params"]]
    assert len(copies) == 2 and torch.equal(copies[0], copies[1])  # first and last stage, equal
    assert len({r["loss"] for r in per_rank}) == 1


SIZE_TP = dict(width=64, layers=2, vision_layers=1)  # 4 heads, 2 key/value heads: both split over tp=2


def _pipelined_tp(rank, world, paths):
    L.seed_everything(0, verbose=False)
    model = vlm.VisionLanguageModel(**SIZE_TP, tie=False)
    strategy = MultiModulePipelineStrategy(
        vlm.placements(tp=2), model.pipeline_topology, num_microbatches=2,
        pretrained=vlm.pretrained_sources(paths, SIZE_TP["layers"], SIZE_TP["vision_layers"]),
    )
    from torch.distributed.tensor import DTensor

    class Final(L.Callback):
        def on_train_end(self, trainer, pl_module) -> None:
            self.params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                           for n, p in pl_module.named_parameters()}

    final = Final()
    trainer = L.Trainer(**_trainer_kwargs(world), strategy=strategy, callbacks=[final])
    trainer.fit(model, vlm.make_loader(8, STEPS, shuffle=False))
    split = sorted(n for n, p in model.named_parameters() if isinstance(p, DTensor))
    return {"params": final.params, "split": split}


@pytest.mark.timeout(300)
@pytest.mark.distributed
def test_vlm_example_with_tp2_matches_one_process(tmp_path):
    """``--tp 2``: the projector and the Llama layers (the config's own tp plan) on 2 tp ranks per
    stage, untied, against one process."""
    paths = vlm.write_pretrained(tmp_path, **SIZE_TP, tie=False)
    L.seed_everything(0, verbose=False)
    reference = vlm.VisionLanguageModel(**SIZE_TP, tie=False)
    with torch.device("meta"):
        reference.configure_model()
    load_pretrained(reference, vlm.pretrained_sources(paths, SIZE_TP["layers"], SIZE_TP["vision_layers"]), seed=0)
    L.Trainer(**_trainer_kwargs(1)).fit(reference, vlm.make_loader(8, STEPS, shuffle=False))
    expected = _params(reference)
    per_rank = run_distributed(_pipelined_tp, 5, paths, timeout=280, init_pg=False)
    assert "llm.1.layer.self_attn.q_proj.weight" in per_rank[1]["split"] and "proj.0.weight" in per_rank[1]["split"]
    _assert_params_match(per_rank, expected)
