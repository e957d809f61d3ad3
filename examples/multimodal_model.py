"""The model and data of the multimodal examples, in plain PyTorch (no Lightning).

A tiny vision + audio -> language model. The task is synthetic but learnable: an image shows one
of four bright quadrants, a clip is a tone of one of four pitches, and the "caption" spells out
(quadrant, pitch, their sum) as tokens. The loss falls from ln(16) ~ 2.8 towards 0.

Layout (5 processes):

    rank 0  vision  (replica 0 of 2) --.
    rank 1  vision  (replica 1 of 2) --+--> rank 3  llm stage 0 --> rank 4  llm stage 1 (loss)
    rank 2  audio                    --'

``train_multimodal.py`` trains it with the Lightning Trainer, ``train_torchrun.py`` with
:class:`~lightning_mmpp.PipelineEngine` in a plain PyTorch loop.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from lightning_mmpp import ModulePlacement

VOCAB = 16
DIM = 32
CAPTION = 4  # BOS, quadrant, pitch, sum
BOS = 15


class SyntheticCaptions(Dataset):
    def __init__(self, size: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.quadrant = torch.randint(0, 4, (size,), generator=g)
        self.pitch = torch.randint(0, 4, (size,), generator=g)
        images = 0.3 * torch.randn(size, 1, 8, 8, generator=g)
        for i, q in enumerate(self.quadrant.tolist()):
            r, c = divmod(q, 2)
            images[i, 0, r * 4:(r + 1) * 4, c * 4:(c + 1) * 4] += 1.0
        t = torch.arange(32, dtype=torch.float32)
        freqs = (self.pitch.float() + 1.0).unsqueeze(1)
        self.audio = torch.sin(2 * math.pi * freqs * t / 32).unsqueeze(1) + 0.3 * torch.randn(size, 1, 32, generator=g)
        self.images = images
        caption = torch.stack([self.quadrant, 4 + self.pitch, 8 + (self.quadrant + self.pitch) % 7], dim=1)
        self.tokens = torch.cat([torch.full((size, 1), BOS), caption], dim=1)  # [size, CAPTION]

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"image": self.images[i], "audio": self.audio[i], "tokens": self.tokens[i]}


class Embed(nn.Module):
    """Prefix the text embeddings with one vision and one audio token."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.zeros(CAPTION + 1, DIM))

    def forward(self, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        text = self.tok(x["ids"][:, :-1])
        h = torch.cat([x["prefix"], text], dim=1) + self.pos
        return {"h": h, "ids": x["ids"]}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(DIM, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True)

    def forward(self, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        n = x["h"].shape[1]
        causal = torch.triu(torch.full((n, n), float("-inf"), device=x["h"].device), diagonal=1)
        return {"h": self.layer(x["h"], src_mask=causal), "ids": x["ids"]}


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.out = nn.Linear(DIM, VOCAB)

    def forward(self, x: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.out(self.norm(x["h"]))


class VisionAudioModel(nn.Module):
    """The three modules (``vision``, ``audio``, ``llm``: the layers the pipeline splits) and the
    two pipeline hooks. A LightningModule gets them by inheriting from this class too."""

    def __init__(self) -> None:
        super().__init__()
        self.vision = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.AvgPool2d(4), nn.Flatten(), nn.Linear(8 * 4, DIM)
        )
        self.audio = nn.Sequential(
            nn.Conv1d(1, 8, 5, padding=2), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 32, DIM)
        )
        self.llm = nn.Sequential(Embed(), Block(), Block(), Head())

    def pipeline_inputs(self, module: str, batch: dict[str, torch.Tensor], upstream: dict[str, Any]) -> Any:
        if module == "vision":
            return batch["image"]
        if module == "audio":
            return batch["audio"]
        prefix = torch.stack([upstream["vision"], upstream["audio"]], dim=1)
        return {"prefix": prefix, "ids": batch["tokens"]}

    def pipeline_loss(self, module: str, output: torch.Tensor, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        logits = output[:, 2:]  # positions that predict caption tokens 1..3
        target = batch["tokens"][:, 1:]
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))
        accuracy = (logits.argmax(-1) == target).float().mean()
        return {"loss": loss, "accuracy": accuracy}


TOPOLOGY = {"vision": ["llm"], "audio": ["llm"], "llm": []}
PLACEMENTS = {
    "vision": ModulePlacement(pp=1, dp=2),  # ranks 0-1
    "audio": ModulePlacement(pp=1, dp=1),   # rank 2
    "llm": ModulePlacement(pp=2, dp=1),     # ranks 3-4
}
