"""Small multi-module LightningModules used by the distributed tests."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_mmpp.model.reference import run_unpipelined

VOCAB = 11
HIDDEN = 8
SEQ = 3


class Encoder(nn.Module):
    """Features -> hidden activations."""

    def __init__(self, dim_in: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim_in, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(x))


class Block(nn.Module):
    """A layer that passes a dict {"h": float activations, "ids": int64 token ids}."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(HIDDEN, HIDDEN)
        self.emb = nn.Embedding(VOCAB, HIDDEN)

    def forward(self, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        h = torch.tanh(self.lin(x["h"]) + self.emb(x["ids"]))
        return {"h": h, "ids": x["ids"]}


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(HIDDEN, VOCAB)

    def forward(self, x: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.out(x["h"])


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(VOCAB, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class MultiModalModel(L.LightningModule):
    """Encoders ``enc*`` feed a token model ``llm``; optionally ``llm`` feeds a ``dec``oder.

    Every module name in ``topology`` gets layers; the sink computes the loss. Token ids cross
    stage boundaries beside float activations.
    """

    def __init__(self, topology: Mapping[str, Sequence[str]], llm_layers: int = 4, lr: float = 0.1,
                 optimizer: str = "sgd", freeze: Sequence[str] = (), scheduler: str | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()  # load_from_checkpoint rebuilds the model from these
        self.topology = {k: list(v) for k, v in topology.items()}
        self.pipeline_topology = self.topology  # the wiring is a property of the model
        self.lr = lr
        self.optimizer_name = optimizer
        self.scheduler = scheduler
        torch.manual_seed(1234)
        for name in self.topology:
            if name.startswith("enc"):
                setattr(self, name, nn.Sequential(Encoder(6), Encoder(HIDDEN).proj, nn.Tanh()))
            elif name == "llm":
                self.llm = nn.Sequential(*[Block() for _ in range(llm_layers)], Head())
            elif name == "dec":
                self.dec = nn.Sequential(Decoder(), nn.Tanh(), nn.Linear(4, 4))
            elif name == "aux":  # a second sink on the encoder features
                self.aux = nn.Sequential(nn.Linear(HIDDEN, 4), nn.Tanh())
            else:
                raise ValueError(name)
        for name in freeze:
            getattr(self, name).requires_grad_(False)

    # --- the pipeline contract --------------------------------------------------------------

    def pipeline_inputs(self, module: str, batch: dict[str, torch.Tensor], upstream: dict[str, Any]) -> Any:
        if module.startswith("enc"):
            return batch[f"x_{module}"]
        if module == "aux":
            return upstream["enc_a"]
        if module == "llm":
            h = torch.zeros(batch["ids"].shape + (HIDDEN,), dtype=torch.get_default_dtype(), device=batch["ids"].device)
            for name in sorted(upstream):
                h = h + upstream[name].unsqueeze(1)
            return {"h": h, "ids": batch["ids"]}
        return upstream["llm"]

    def pipeline_loss(self, module: str, output: torch.Tensor, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if module == "llm":
            loss = F.cross_entropy(output.reshape(-1, VOCAB), batch["target"].reshape(-1))
        else:
            loss = F.mse_loss(output.mean(1) if output.dim() == 3 else output, batch["y"])
        return {"loss": loss, "abs_out": output.abs().mean()}

    # --- single-process reference ----------------------------------------------------------

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss, _ = run_unpipelined(self, batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss, _ = run_unpipelined(self, batch)
        self.log("val_loss", loss)
        return loss

    def test_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss, _ = run_unpipelined(self, batch)
        self.log("test_loss", loss)
        return loss

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        _, outputs = run_unpipelined(self, batch)
        return outputs[[m for m, d in self.topology.items() if not d][0]]

    def configure_optimizers(self) -> Any:
        params = [p for p in self.parameters() if p.requires_grad]
        if self.optimizer_name == "adam":
            optimizer: torch.optim.Optimizer = torch.optim.Adam(params, lr=self.lr)
        else:
            optimizer = torch.optim.SGD(params, lr=self.lr, momentum=0.9)
        if self.scheduler is None:
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": self.scheduler}}


class SyntheticDataset(Dataset):
    """A learnable task: the target token depends on the encoder features and the input ids."""

    def __init__(self, size: int, encoders: Sequence[str], seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.data = {f"x_{e}": torch.randn(size, 6, generator=g) for e in encoders}
        self.data["ids"] = torch.randint(0, VOCAB, (size, SEQ), generator=g)
        feat = sum((x[:, 0] > 0).long() for x in (self.data[f"x_{e}"] for e in encoders)) if encoders else 0
        self.data["target"] = (self.data["ids"] + torch.as_tensor(feat).unsqueeze(-1)) % VOCAB
        self.data["y"] = torch.randn(size, 4, generator=g)
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[i] for k, v in self.data.items()}


def make_loader(topology: Mapping[str, Sequence[str]], batch_size: int, size: int) -> DataLoader:
    encoders = [m for m in topology if m.startswith("enc")]
    return DataLoader(SyntheticDataset(size, encoders), batch_size=batch_size, shuffle=False, drop_last=True)


class NamedSamples(Dataset):
    """``SyntheticDataset`` samples with a per-sample string ``name`` and their index ``idx``:
    collated, ``name`` is a list of strings the strategy must split with the samples."""

    def __init__(self, size: int, encoders: Sequence[str], seed: int = 0) -> None:
        self.inner = SyntheticDataset(size, encoders, seed)

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {**self.inner[i], "name": f"s{i}", "idx": i}


class AlignmentCheckingModel(MultiModalModel):
    """Fails if a hook sees a ``name`` list that does not match the samples it was given."""

    def _check(self, batch: dict[str, Any]) -> None:
        expected = [f"s{i}" for i in batch["idx"].tolist()]
        if batch["name"] != expected:
            raise ValueError(f"misaligned per-sample names: {batch['name']} for samples {expected}")
        self.checked = getattr(self, "checked", 0) + 1

    def pipeline_inputs(self, module: str, batch: dict[str, Any], upstream: dict[str, Any]) -> Any:
        self._check(batch)
        return super().pipeline_inputs(module, batch, upstream)

    def pipeline_loss(self, module: str, output: torch.Tensor, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        self._check(batch)
        return super().pipeline_loss(module, output, batch)


class DtypeRecordingModel(MultiModalModel):
    """Records the dtype of every activation the hooks see: ``(module, "upstream:<src>" | "output", dtype)``."""

    def pipeline_inputs(self, module: str, batch: dict[str, Any], upstream: dict[str, Any]) -> Any:
        for src, value in upstream.items():
            self._record(module, f"upstream:{src}", value.dtype)
        return super().pipeline_inputs(module, batch, upstream)

    def pipeline_loss(self, module: str, output: torch.Tensor, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        self._record(module, "output", output.dtype)
        return super().pipeline_loss(module, output, batch)

    def _record(self, module: str, what: str, dtype: torch.dtype) -> None:
        if not hasattr(self, "seen_dtypes"):
            self.seen_dtypes: set[tuple[str, str, str]] = set()
        self.seen_dtypes.add((module, what, str(dtype)))


class BatchRecorder(L.Callback):
    """Records the ``idx`` field of every training batch this rank loaded."""

    def __init__(self) -> None:
        self.seen: list[list[int]] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self.seen.append(batch["idx"].tolist())


# --- tensor parallelism -----------------------------------------------------------------------

HEADS = 2


class Attention(nn.Module):
    """Causal multi-head self-attention; the head count is read from the (possibly tp-split) q."""

    def __init__(self, heads: int = HEADS) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, HIDDEN // heads
        # no key bias: it shifts every score of a query alike, so its exact gradient is zero and
        # Adam would amplify rounding noise into updates
        self.q, self.k, self.v, self.o = (nn.Linear(HIDDEN, HIDDEN, bias=name != "k") for name in "qkvo")

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, s, _ = h.shape
        q, k, v = (proj(h).view(b, s, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(att.transpose(1, 2).reshape(b, s, -1))


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.down = nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(h)))


class TransformerBlock(nn.Module):
    """``Block``'s interface (a dict of float activations and token ids) around attention + MLP."""

    def __init__(self, heads: int = HEADS) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.attn = Attention(heads)
        self.mlp = Mlp()

    def forward(self, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        h = x["h"] + self.emb(x["ids"])
        h = h + self.attn(self.norm(h))
        h = h + self.mlp(h)
        return {"h": h, "ids": x["ids"]}


def block_plan() -> dict[str, Any]:
    """The Megatron split of a transformer block: q/k/v and the MLP's up projection column-wise
    (each tp rank holds whole heads and a slice of the hidden units), the output projections
    row-wise (their partial sums all-reduced); the embedding and the norm stay replicated."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.o": RowwiseParallel(), "mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel()}


class TensorParallelModel(MultiModalModel):
    """``MultiModalModel`` whose LM is transformer blocks, with a ``pipeline_parallelize`` hook:
    the LM's blocks split per :func:`block_plan`, an encoder's first projection column-wise (its
    output gathered) and its second linear row-wise (its input scattered)."""

    def __init__(self, topology: Mapping[str, Sequence[str]], llm_layers: int = 4, lr: float = 0.1,
                 optimizer: str = "sgd", freeze: Sequence[str] = (), scheduler: str | None = None,
                 heads: int = HEADS) -> None:
        super().__init__(topology, llm_layers, lr, optimizer, freeze, scheduler)
        if "llm" in self.topology:
            torch.manual_seed(4321)
            self.llm = nn.Sequential(*[TransformerBlock(heads) for _ in range(llm_layers)], Head())

    def pipeline_parallelize(self, module: str, index: int, layer: nn.Module, tp_mesh: Any) -> None:
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        from lightning_mmpp.errors import PipelineConfigError

        if isinstance(layer, TransformerBlock):
            if layer.attn.heads % tp_mesh.size():
                raise PipelineConfigError(
                    f"{module} layer {index}: {layer.attn.heads} attention heads do not split over tp="
                    f"{tp_mesh.size()}; use a tp that divides the head count."
                )
            parallelize_module(layer, tp_mesh, block_plan())
        elif isinstance(layer, Encoder):
            parallelize_module(layer, tp_mesh, {"proj": ColwiseParallel(output_layouts=Replicate())})
        elif module.startswith("enc") and isinstance(layer, nn.Linear):
            parallelize_module(layer, tp_mesh, RowwiseParallel(input_layouts=Replicate()))
