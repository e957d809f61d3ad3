"""A small vision-language model on ragged batches: ``n_i`` images per sample (zeros allowed) in a
``Ragged``, text of per-sample length (padded per microbatch), a per-token loss."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_mmpp import Ragged
from tests.models import HIDDEN, VOCAB, Block, Head

IMAGE_DIM = 6
MAX_LEN = 5

# id: the per-sample image counts of one global batch of 8 (two microbatches of 4): by index
# and by item count, some encoder replica of dp=2 gets no image in some microbatch
COUNT_PATTERNS = (
    (0, 0, 0, 3, 2, 4, 0, 1),  # microbatch 0: [0,0 | 0,3] (by index) and [0,0,0 | 3] (by items)
    (0, 0, 0, 0, 4, 0, 1, 2),  # a microbatch with no image at all
    (3, 1, 0, 4, 2, 0, 0, 0),  # replica 1 of microbatch 1 gets nothing by index
)


class RaggedVLM(nn.Module):
    """``img`` (ragged images -> per-image features), optionally ``enc_b`` (one feature vector
    per sample), and ``llm`` (token blocks + head) with a per-token loss."""

    def __init__(self, topology: Mapping[str, Sequence[str]], llm_layers: int = 3) -> None:
        super().__init__()
        self.pipeline_topology = {k: list(v) for k, v in topology.items()}
        torch.manual_seed(4321)
        self.img = nn.Sequential(nn.Linear(IMAGE_DIM, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN))
        if "enc_b" in topology:
            self.enc_b = nn.Sequential(nn.Linear(IMAGE_DIM, HIDDEN), nn.Tanh())
        self.llm = nn.Sequential(*[Block() for _ in range(llm_layers)], Head())

    def pipeline_inputs(self, module: str, batch: dict[str, Any], upstream: dict[str, Any]) -> Any:
        if module == "img":
            return batch["images"]
        if module == "enc_b":
            return batch["x_b"]
        images = upstream["img"]
        own = batch["images"]
        if not isinstance(images, Ragged) or images.counts.tolist() != own.counts.tolist():
            raise AssertionError(f"llm got {images!r} for its samples {own!r}")
        size = own.num_samples
        segment = torch.repeat_interleave(torch.arange(size, device=images.values.device), images.counts)
        pooled = torch.zeros(size, HIDDEN, dtype=images.values.dtype, device=images.values.device)
        pooled = pooled.index_add(0, segment, images.values) / images.counts.clamp(min=1).unsqueeze(1)
        if "enc_b" in upstream:
            pooled = pooled + upstream["enc_b"]
        length = int(batch["lengths"].max())  # padding per microbatch (and replica): shapes vary
        ids = batch["ids"][:, :length]
        return {"h": pooled.unsqueeze(1).expand(size, length, HIDDEN).contiguous(), "ids": ids}

    def pipeline_loss(self, module: str, output: torch.Tensor, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        labels = batch["target"][:, : output.shape[1]]
        loss_sum = F.cross_entropy(output.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100, reduction="sum")
        return {"loss_sum": loss_sum, "num_tokens": (labels != -100).sum()}


def ragged_batches(steps: int, batch_size: int, with_enc_b: bool, seed: int = 0) -> Iterator[dict[str, Any]]:
    """Global batches: ``images`` a Ragged with counts from :data:`COUNT_PATTERNS` (then random
    in 0..4), ``ids`` / ``target`` padded to :data:`MAX_LEN` with per-sample ``lengths``."""
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        if step < len(COUNT_PATTERNS) and batch_size == len(COUNT_PATTERNS[step]):
            counts = torch.tensor(COUNT_PATTERNS[step])
        else:
            counts = torch.randint(0, 5, (batch_size,), generator=g)
        values = torch.randn(int(counts.sum()), IMAGE_DIM, generator=g)
        lengths = torch.randint(1, MAX_LEN + 1, (batch_size,), generator=g)
        ids = torch.randint(0, VOCAB, (batch_size, MAX_LEN), generator=g)
        positions = torch.arange(MAX_LEN).unsqueeze(0)
        target = torch.where(positions < lengths.unsqueeze(1), (ids + counts.unsqueeze(1)) % VOCAB, -100)
        batch: dict[str, Any] = {"images": Ragged(values, counts), "ids": ids, "target": target, "lengths": lengths}
        if with_enc_b:
            batch["x_b"] = torch.randn(batch_size, IMAGE_DIM, generator=g)
        yield batch
