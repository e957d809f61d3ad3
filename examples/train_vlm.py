"""Train a small LLaVA-style vision-language model built from real parts, loaded from pretrained files.

    pip install -e ".[examples]"      # safetensors, transformers (scripts/install.sh examples)
    python examples/train_vlm.py      # 3 CPU processes, about 20 s on 2 cores at the default size
    python examples/train_vlm.py --width 512 --layers 8 --precision bf16-mixed
    python examples/train_vlm.py --tp 2   # 5 processes: the projector and each LM stage on 2 tp ranks

Layout (gloo on CPU, NCCL on GPUs):

    rank 0  vision (SigLIP layers, frozen) --> rank 1  proj (projector) + llm stage 0 --> rank 2  llm stage 1
                                                                                            (loss)

The projector is a pp=1 module on the ranks of the LM's first stage. The LM ties its input
embedding to its output head (``tie_word_embeddings``, as small Llama configurations do): the
first and the last stage each keep a copy, and their gradients are summed every step.

``--tp 2`` splits the projector and every Llama decoder layer over two ranks (ranks 1-2: proj
and LM stage 0, ranks 3-4: LM stage 1): ``pipeline_parallelize`` applies the Llama config's own
``base_model_tp_plan`` (q/k/v, gate and up projections column-wise, o and down row-wise) to each
decoder layer, and splits the projector's first linear by columns, its second by rows. A tp
module cannot hold a tied parameter, so ``--tp 2`` unties the embedding and the head.

The modules are created in ``configure_model()``, so under the strategy they are built on the
meta device: each rank allocates only the stages it holds. The vision encoder and the language
model start from pretrained files that this script writes once, the way a download would leave
them: a Hugging Face ``SiglipVisionModel`` state dict and a ``LlamaForCausalLM`` state dict,
both as ``.safetensors`` in their libraries' own key names. ``pretrained=`` with a ``key_map``
renames those keys into the pipelined ``nn.Sequential`` names; each rank reads only its own
tensors. The projector has no pretrained weights: ``materialize`` initialises it from the seed.

Each sample carries 0, 1 or 2 images: the ``collate_fn`` packs them with ``Ragged.from_list``
into ``batch["images"]`` (``values`` every image of the batch, ``counts`` the images per
sample), and the strategy splits microbatches by sample. ``vision`` returns that ``Ragged`` from
``pipeline_inputs``, so the encoder's layers see the packed images and its output travels on as
``Ragged([n_images, PATCHES, width], counts)``; ``proj`` passes it on the same way. The LM's
``pipeline_inputs`` lays its samples' image tokens into ``MAX_IMAGES`` fixed slots of
``PATCHES`` tokens (image k in slot k, empty slots masked out) before the caption, so the
caption starts at the same position for every sample and microbatch.

The data are synthetic but learnable: each image shows a bright square at one of 8 positions;
the caption (3 to 8 tokens, padded) names each image's position in order, or starts with a
``NO_IMAGE`` token when the sample has none, then counts up from its last token. So the first
caption tokens need the images and the rest follow from the text. The loss is the causal-LM
cross-entropy over the caption tokens, with padding ignored, in the per-token form
(``loss_sum`` and ``num_tokens``): the strategy divides by the global token count of the step.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_mmpp import ModulePlacement, MultiModulePipelineStrategy, PipelineConfigError, PretrainedWeights, Ragged

IMAGE = 16
PATCH = 4
PATCHES = (IMAGE // PATCH) ** 2
POSITIONS = 8
MAX_IMAGES = 2  # images per sample: 0, 1 or 2
PREFIX = MAX_IMAGES * PATCHES  # image-token slots before the caption: image k in slot k
MAX_TEXT = 8
PAD, BOS = 0, 1
VOCAB = 32
NO_IMAGE = VOCAB - 1  # the caption of a sample without an image starts with this token
COUNT = VOCAB - 3  # caption tokens 2 .. VOCAB - 2 count up modulo COUNT


def _extras() -> tuple[Any, Any, Any]:
    try:
        import safetensors.torch
        from transformers import LlamaConfig, SiglipVisionConfig
    except ImportError as err:
        raise SystemExit(
            f"examples/train_vlm.py needs the 'examples' extra ({err}): pip install -e '.[examples]' "
            "(scripts/install.sh examples keeps your torch build)."
        ) from err
    return safetensors.torch, SiglipVisionConfig, LlamaConfig


def siglip_config(width: int, layers: int) -> Any:
    _, SiglipVisionConfig, _ = _extras()
    return SiglipVisionConfig(
        hidden_size=width, intermediate_size=4 * width, num_hidden_layers=layers,
        num_attention_heads=max(1, width // 16), image_size=IMAGE, patch_size=PATCH, attn_implementation="sdpa",
    )


def llama_config(width: int, layers: int, tie: bool = True) -> Any:
    _, _, LlamaConfig = _extras()
    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers,
        num_attention_heads=max(1, width // 16), num_key_value_heads=max(1, width // 32),
        max_position_embeddings=PREFIX + MAX_TEXT, tie_word_embeddings=tie, attn_implementation="sdpa",
    )


# --- layers --------------------------------------------------------------------------------


class PatchEmbed(nn.Module):
    """Image -> patch tokens with learned positions (SigLIP's ``embeddings``, in its own names)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(3, width, PATCH, stride=PATCH)
        self.position_embedding = nn.Embedding(PATCHES, width)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(image).flatten(2).transpose(1, 2)
        return patches + self.position_embedding.weight


class VisionLayer(nn.Module):
    """A Hugging Face ``SiglipEncoderLayer`` (full attention over the patches, no mask)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        from transformers.models.siglip.modeling_siglip import SiglipEncoderLayer

        self.layer = SiglipEncoderLayer(config)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if h.shape[0] == 0:  # no image in this microbatch: Hugging Face's attention cannot view zero rows
            return h
        out = self.layer(h, attention_mask=None)
        return out[0] if isinstance(out, tuple) else out


class TokenEmbed(nn.Module):
    """The image-token slots (from the projector) followed by the embedded caption; carries the
    padding mask (empty image slots and caption padding are 0)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, width)

    def forward(self, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        text = self.embed_tokens(x["ids"])
        h = torch.cat([x["image"].to(text.dtype), text], dim=1)
        mask = torch.cat([x["image_mask"], x["mask"]], dim=1)
        return {"h": h, "mask": mask}


class DecoderLayer(nn.Module):
    """A Hugging Face ``LlamaDecoderLayer`` on the dict that crosses stage boundaries.

    Rotary position embeddings are computed per forward (no buffer to materialise); the causal
    and padding masks become one boolean attention mask. Every position also attends to itself,
    so a padded position that precedes every real token (a sample without an image) has a
    finite output; real positions never attend to padding.
    """

    def __init__(self, config: Any, index: int) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        self.layer = LlamaDecoderLayer(config, index)
        object.__setattr__(self, "_rotary_args", (LlamaRotaryEmbedding, config))  # not a submodule

    def forward(self, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        h, mask = x["h"], x["mask"]
        length = h.shape[1]
        positions = torch.arange(length, device=h.device).unsqueeze(0).expand(h.shape[0], -1)
        rotary_cls, config = self._rotary_args
        with torch.device(h.device):
            cos, sin = rotary_cls(config)(h, positions)
        causal = torch.ones(length, length, dtype=torch.bool, device=h.device).tril()
        attend = causal[None, None] & mask.bool()[:, None, None, :]
        attend = attend | torch.eye(length, dtype=torch.bool, device=h.device)
        out = self.layer(h, attention_mask=attend, position_ids=positions, position_embeddings=(cos, sin))
        return {"h": out[0] if isinstance(out, tuple) else out, "mask": mask}


class LMHead(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, VOCAB, bias=False)

    def forward(self, x: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.lm_head(self.norm(x["h"]))


# --- the LightningModule -------------------------------------------------------------------


class VisionLanguageModel(L.LightningModule):
    """``vision`` (frozen SigLIP encoder) -> ``proj`` (projector) -> ``llm`` (Llama decoder layers),
    on 0 to ``MAX_IMAGES`` images per sample."""

    pipeline_topology = {"vision": ["proj"], "proj": ["llm"], "llm": []}

    def __init__(self, width: int = 64, layers: int = 4, vision_layers: int = 2, lr: float = 3e-3,
                 tie: bool = True) -> None:
        super().__init__()
        self.save_hyperparameters()

    def configure_model(self) -> None:
        if hasattr(self, "llm"):  # Lightning calls the hook on every Trainer call
            return
        hp = self.hparams
        width = hp.width
        vision_config = siglip_config(width, hp.vision_layers)
        self.vision = nn.Sequential(
            PatchEmbed(width),
            *[VisionLayer(vision_config) for _ in range(hp.vision_layers)],
            nn.LayerNorm(width, eps=vision_config.layer_norm_eps),
        )
        self.vision.requires_grad_(False)  # a frozen pretrained encoder
        self.proj = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width))
        config = llama_config(width, hp.layers, hp.tie)
        self.llm = nn.Sequential(
            TokenEmbed(width), *[DecoderLayer(config, i) for i in range(hp.layers)], LMHead(config)
        )
        if config.tie_word_embeddings:  # the PyTorch idiom; the two ends land on different stages
            self.llm[-1].lm_head.weight = self.llm[0].embed_tokens.weight

    def pipeline_inputs(self, module: str, batch: dict[str, Any], upstream: dict[str, Any]) -> Any:
        if module == "vision":
            return batch["images"]  # a Ragged: the encoder's layers see the packed images
        if module == "proj":
            return upstream["vision"]  # Ragged([n_images, PATCHES, width], counts): one row per image
        image, image_mask = image_slots(upstream["proj"])
        return {"image": image, "image_mask": image_mask, "ids": batch["ids"], "mask": batch["mask"]}

    def pipeline_loss(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Per-token causal-LM loss: summed here, divided by the step's global token count.

        Captions have different lengths, so a mean per microbatch would weight tokens unequally;
        ``{"loss_sum", "num_tokens"}`` makes the step's loss the mean over all its tokens, as on one
        process. ``correct_sum`` becomes the token accuracy the same way.
        """
        text = logits[:, PREFIX:-1].float()  # position t predicts caption token t + 1
        labels = batch["ids"][:, 1:].masked_fill(batch["mask"][:, 1:] == 0, -100)
        loss_sum = F.cross_entropy(text.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100, reduction="sum")
        valid = labels != -100
        correct = ((text.argmax(-1) == labels) & valid).sum()
        return {"loss_sum": loss_sum, "num_tokens": valid.sum(), "correct_sum": correct}

    def pipeline_parallelize(self, module: str, index: int, layer: nn.Module, tp_mesh: Any) -> None:
        """``--tp``: the projector's linears split by columns then rows, each decoder layer by
        its Llama config's own tensor-parallel plan; embeddings, norms and the head stay whole."""
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        if module == "proj" and isinstance(layer, nn.Linear):
            parallelize_module(layer, tp_mesh, ColwiseParallel() if index == 0 else RowwiseParallel())
        elif module == "llm" and isinstance(layer, DecoderLayer):
            parallelize_module(layer, tp_mesh, hf_layer_plan(layer._rotary_args[1], tp_mesh.size()))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:  # one process, no strategy
        from lightning_mmpp import run_unpipelined

        loss, _ = run_unpipelined(self, self.pipeline_topology, batch)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.hparams.lr)


def hf_layer_plan(config: Any, tp: int) -> dict[str, Any]:
    """A Hugging Face config's ``base_model_tp_plan`` for one decoder layer, as torch parallel
    styles on ``DecoderLayer`` (whose ``layer`` is the Hugging Face layer)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if config.num_attention_heads % tp or config.num_key_value_heads % tp:
        raise PipelineConfigError(
            f"tp={tp} does not divide the LM's {config.num_attention_heads} attention heads and "
            f"{config.num_key_value_heads} key/value heads; choose --tp dividing both (or a wider --width)."
        )
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    prefix = "layers.*."
    return {"layer." + key[len(prefix):]: styles[style]() for key, style in config.base_model_tp_plan.items()
            if key.startswith(prefix)}


def image_slots(features: Ragged) -> tuple[torch.Tensor, torch.Tensor]:
    """The LM's image prefix from the projected images of a microbatch's samples.

    ``features`` holds ``[sum(n_i), PATCHES, width]``: sample ``i``'s image ``k`` goes to slot
    ``k`` (positions ``k * PATCHES .. (k + 1) * PATCHES - 1``), the same layout for every sample
    and microbatch, so the caption always starts at ``PREFIX``. Returns the ``[samples, PREFIX,
    width]`` tokens (zeros in empty slots; differentiable in ``features.values``) and their
    ``[samples, PREFIX]`` mask (1 where an image is).
    """
    values = features.values
    counts = features.counts.to(values.device)
    if features.num_samples and int(counts.max()) > MAX_IMAGES:
        raise ValueError(f"a sample has {int(counts.max())} images; this model has {MAX_IMAGES} image slots")
    samples = features.num_samples
    owner = torch.repeat_interleave(torch.arange(samples, device=values.device), counts)
    first = torch.cumsum(counts, 0) - counts  # the row of each sample's first image
    slot = torch.arange(values.shape[0], device=values.device) - first[owner]
    tokens = values.new_zeros(samples, MAX_IMAGES, *values.shape[1:]).index_put((owner, slot), values)
    present = torch.arange(MAX_IMAGES, device=values.device) < counts.unsqueeze(1)
    mask = present.long().repeat_interleave(PATCHES, dim=1)
    return tokens.flatten(1, 2), mask


# --- pretrained files (what a download would leave), and their key maps ---------------------


def write_pretrained(directory: Path, width: int, layers: int, vision_layers: int, tie: bool = True,
                     seed: int = 0) -> dict[str, Path]:
    """Write a Hugging Face SigLIP vision encoder and Llama state dict once, in their own key names."""
    safetensors_torch, _, _ = _extras()
    from transformers import LlamaForCausalLM, SiglipVisionModel

    directory.mkdir(parents=True, exist_ok=True)
    tag = f"w{width}_l{layers}_v{vision_layers}{'_tied' if tie else ''}"
    paths = {"vision": directory / f"siglip_{tag}.safetensors", "llm": directory / f"llama_{tag}.safetensors"}
    if all(p.exists() for p in paths.values()):
        return paths
    torch.manual_seed(seed)
    encoder = SiglipVisionModel(siglip_config(width, vision_layers))
    lm = LlamaForCausalLM(llama_config(width, layers, tie))
    for name, module in (("vision", encoder), ("llm", lm)):
        tmp = paths[name].with_suffix(f".{os.getpid()}.tmp")
        state = module.state_dict()
        if name == "llm" and tie:
            del state["lm_head.weight"]  # stored once, as Hugging Face does for tied embeddings
        safetensors_torch.save_file({k: v.contiguous() for k, v in state.items()}, str(tmp))
        os.replace(tmp, paths[name])  # atomic: ranks started later see a whole file
    return paths


def from_hf_siglip(vision_layers: int):
    """Hugging Face ``SiglipVisionModel`` names (with or without ``vision_model.``) -> ``self.vision`` names."""

    def key_map(key: str) -> Optional[str]:
        key = key.removeprefix("vision_model.")
        if key.startswith("embeddings."):
            return "0." + key[len("embeddings."):]
        if key.startswith("encoder.layers."):
            index, rest = key[len("encoder.layers."):].split(".", 1)
            return f"{int(index) + 1}.layer.{rest}"
        if key.startswith("post_layernorm."):
            return f"{vision_layers + 1}.{key[len('post_layernorm.'):]}"
        return None  # the attention-pooling head: not part of the token encoder

    return key_map


def from_hf_llama(layers: int):
    """Hugging Face ``LlamaForCausalLM`` names -> ``self.llm`` names."""

    def key_map(key: str) -> Optional[str]:
        if key == "model.embed_tokens.weight":
            return "0.embed_tokens.weight"
        if key.startswith("model.layers."):
            index, rest = key[len("model.layers."):].split(".", 1)
            return f"{int(index) + 1}.layer.{rest}"
        if key == "model.norm.weight":
            return f"{layers + 1}.norm.weight"
        if key == "lm_head.weight":
            return f"{layers + 1}.lm_head.weight"
        return None

    return key_map


def pretrained_sources(paths: dict[str, Path], layers: int, vision_layers: int) -> dict[str, PretrainedWeights]:
    return {
        "vision": PretrainedWeights(paths["vision"], key_map=from_hf_siglip(vision_layers)),
        "llm": PretrainedWeights(paths["llm"], key_map=from_hf_llama(layers)),
    }


# --- data ----------------------------------------------------------------------------------


class SyntheticCaptions(Dataset):
    """Samples with 0, 1 or 2 images, each a bright square at one of ``POSITIONS`` places.

    The caption (after ``BOS``) names each image's position in order, or starts with ``NO_IMAGE``
    when there is none, then counts up from the last token; 3 to ``MAX_TEXT`` tokens, padded.
    """

    def __init__(self, size: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        counts = torch.randint(0, MAX_IMAGES + 1, (size,), generator=g)
        lengths = torch.randint(3, MAX_TEXT + 1, (size,), generator=g)
        self.images: list[torch.Tensor] = []
        self.ids = torch.full((size, MAX_TEXT), PAD)
        for i, n in enumerate(counts.tolist()):
            positions = torch.randint(0, POSITIONS, (n,), generator=g).tolist()
            images = 0.3 * torch.randn(n, 3, IMAGE, IMAGE, generator=g)
            for k, p in enumerate(positions):
                r, c = divmod(p, 4)
                images[k, :, r * 8:(r + 1) * 8, c * 4:(c + 1) * 4] += 1.0
            self.images.append(images)
            body = [2 + p for p in positions] if positions else [NO_IMAGE]
            start = positions[-1] + 1 if positions else 0
            tail = [2 + (start + t) % COUNT for t in range(MAX_TEXT - 1 - len(body))]
            self.ids[i] = torch.tensor([BOS, *body, *tail])
        self.mask = (torch.arange(MAX_TEXT) < lengths.unsqueeze(1)).long()
        self.ids = self.ids.masked_fill(self.mask == 0, PAD)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"images": self.images[i], "ids": self.ids[i], "mask": self.mask[i]}


def collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """Stack the captions; pack the images (``n_i`` per sample, zeros allowed) into a ``Ragged``."""
    return {
        "images": Ragged.from_list([s["images"] for s in samples]),
        "ids": torch.stack([s["ids"] for s in samples]),
        "mask": torch.stack([s["mask"] for s in samples]),
    }


def make_loader(batch_size: int, batches: int, seed: int = 0, shuffle: bool = True) -> DataLoader:
    return DataLoader(SyntheticCaptions(batch_size * batches, seed), batch_size=batch_size, shuffle=shuffle,
                      drop_last=True, collate_fn=collate)


def sample_batch(batch_size: int) -> dict[str, Any]:
    """One collated batch: what ``python -m lightning_mmpp.plan`` profiles the model on."""
    return next(iter(make_loader(batch_size, 1, shuffle=False)))


def placements(tp: int = 1) -> dict[str, ModulePlacement]:
    return {
        "vision": ModulePlacement(),  # rank 0
        "llm": ModulePlacement(pp=2, tp=tp),  # ranks 1-2 (tp=2: 1-4)
        "proj": ModulePlacement(rank_offset=1, tp=tp),  # beside the LM's first stage
    }


class LossHistory(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


def main(argv: Optional[list[str]] = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=64, help="hidden size of the vision encoder and the LM")
    parser.add_argument("--layers", type=int, default=4, help="Llama decoder layers")
    parser.add_argument("--vision-layers", type=int, default=2, help="SigLIP encoder layers")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--precision", default="32-true", help='e.g. "bf16-mixed"')
    parser.add_argument("--weights-dir", default=os.path.join(tempfile.gettempdir(), "lightning_mmpp_vlm_weights"),
                        help="where the pretrained files are written once and then reused (default: %(default)s)")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--untied", action="store_true", help="separate input embedding and output head")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks of the projector and each LM stage "
                        "(> 1 unties the embedding and the head)")
    args = parser.parse_args(argv)

    L.seed_everything(0, verbose=False)
    tie = not args.untied and args.tp == 1
    paths = write_pretrained(Path(args.weights_dir), args.width, args.layers, args.vision_layers, tie)
    model = VisionLanguageModel(args.width, args.layers, args.vision_layers, tie=tie)
    strategy = MultiModulePipelineStrategy(
        placements(args.tp), VisionLanguageModel.pipeline_topology, num_microbatches=args.microbatches,
        pretrained=pretrained_sources(paths, args.layers, args.vision_layers),
    )
    history = LossHistory()
    trainer = L.Trainer(
        accelerator=args.accelerator, devices=strategy.layout.world_size, strategy=strategy, max_steps=args.steps,
        precision=args.precision, logger=False, enable_checkpointing=False, enable_model_summary=False,
        enable_progress_bar=False, callbacks=[history],
    )
    trainer.fit(model, make_loader(args.batch_size, args.steps))
    if trainer.global_rank == 0:
        print(strategy.layout.table())
        print(f"loss {history.losses[0]:.3f} -> {history.losses[-1]:.3f} after {len(history.losses)} steps")
    return history.losses


if __name__ == "__main__":
    main()
