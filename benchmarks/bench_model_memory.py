"""Model memory per rank: meta build + own-stage materialisation vs building the whole model.

    python benchmarks/bench_model_memory.py                 # 4 ranks, 16 x Linear(1024, 1024)
    python benchmarks/bench_model_memory.py --width 2048 --layers 32
    python benchmarks/bench_model_memory.py --width 4096 --layers 24 --pp 2 --dp 2 --shard \
        --modes meta safetensors --grad-reduction step microbatch     # FSDP2, sharded while built
    python benchmarks/bench_model_memory.py --width 4096 --layers 24 --pp 2 --tp 2 --modes eager meta safetensors

With ``--shard`` the module is placed ``pp, dp, shard=True`` (``pp * dp`` ranks) and the table
also shows the peak *before the first step* (read at the first batch's start) against the rank's
own sharded parameter bytes (target <= 1.25x: each layer is sharded on meta and only its shards
are allocated; a random-init submodule is built whole once and keeps its rows, a pretrained one
reads only its rows), and the training peak split into the local parameters, gradients and Adam
state and the rest ("transients": the all-gathered layer, the unsharded gradients that
``sharded_grad_reduction="step"`` accumulates between microbatches, activations), per
``--grad-reduction``.

With ``--tp t`` every stage runs on ``t`` tensor-parallel ranks (``pp * dp * t`` ranks): each
layer is split by columns (``ColwiseParallel``, output replicated). Built on meta, a layer is
allocated whole, filled, and split before the next one is allocated, so the peak before the
first step is the rank's 1/t of its stages plus one whole layer; eager construction holds the
whole model first.

A LightningModule holds one pipelined module ``net`` (``--layers`` bias-free
``Linear(width, width)``), placed ``pp=4`` (``--pp``); Adam, 2 training steps, tiny batches (so
activations are negligible). For every rank: peak resident memory of the process minus its
base (CPU: ``VmHWM`` after resetting it through ``/proc/self/clear_refs``, minus ``VmRSS`` when
the worker starts; GPU: ``torch.cuda.max_memory_allocated``), next to the bytes the rank must
hold, its own parameters + gradients + optimizer state. Target: peak - base <= 1.2 x own.
What Lightning, the process groups and the communicator add whatever the model (measured with
a tiny model in the same run) is shown, and subtracted in the last two columns. Linux only
(``/proc``, glibc's ``mallopt``).

Modes:
- ``eager``: the old way, the whole model built in ``__init__`` on every rank, then partitioned.
- ``meta``: built in ``configure_model`` (meta), each rank materialises its own stage.
- ``safetensors``: meta build + ``pretrained=`` one safetensors file of the whole model.
- ``dcp``: meta build + ``pretrained=`` a torch.distributed.checkpoint directory of it.

Workers are forked gloo processes (``tests/dist.py``); the pretrained files are written by a
separate process first, so no worker inherits the whole model.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from benchmarks.common import machine, proc_status, section, start_memory_measurement, table  # noqa: E402
from lightning_mmpp import ModulePlacement, MultiModulePipelineStrategy  # noqa: E402
from tests.dist import run_distributed  # noqa: E402

MIB = 1024 * 1024
MODES = ("eager", "meta", "safetensors", "dcp")


def _layers(width: int, layers: int) -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])


class _BeforeFirstStep(L.Callback):
    """Peak RSS above ``base`` when the first training batch starts (before any step work)."""

    def __init__(self, base: int) -> None:
        self.base = base
        self.peak: Optional[int] = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if self.peak is None:
            self.peak = proc_status("VmHWM") - self.base


class Net(L.LightningModule):
    def __init__(self, width: int, layers: int, eager: bool, optimizer: str) -> None:
        super().__init__()
        self.width, self.layers, self.optimizer = width, layers, optimizer
        if eager:
            self.net = _layers(width, layers)

    def configure_model(self) -> None:
        if not hasattr(self, "net"):
            self.net = _layers(self.width, self.layers)

    def pipeline_inputs(self, module, batch, upstream):
        return batch[0]

    def pipeline_loss(self, output, batch):
        return output.square().mean()

    def pipeline_parallelize(self, module, index, layer, tp_mesh):
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

        parallelize_module(layer, tp_mesh, ColwiseParallel(output_layouts=Replicate()))

    def configure_optimizers(self):
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=1e-4)
        # foreach=False: the multi-tensor path allocates temporaries the size of all parameters
        return torch.optim.Adam(self.parameters(), lr=1e-4, foreach=False)



def _write(rank: int, world: int, width: int, layers: int, directory: str) -> None:
    import safetensors.torch
    import torch.distributed.checkpoint as dcp

    state = {k: v.contiguous() for k, v in _layers(width, layers).state_dict().items()}
    safetensors.torch.save_file(state, os.path.join(directory, "net.safetensors"))
    dcp.save(state, storage_writer=dcp.FileSystemWriter(os.path.join(directory, "net_dcp")), no_dist=True)


def worker(rank: int, world: int, mode: str, width: int, layers: int, pp: int, directory: str, optimizer: str,
           dp: int = 1, shard: bool = False, grad_reduction: str = "step", tp: int = 1) -> dict:
    cuda = torch.cuda.is_available()
    base = start_memory_measurement()
    before = _BeforeFirstStep(base)
    pretrained = None
    if mode == "safetensors":
        pretrained = {"net": os.path.join(directory, "net.safetensors")}
    elif mode == "dcp":
        pretrained = {"net": os.path.join(directory, "net_dcp")}
    model = Net(width, layers, eager=mode == "eager", optimizer=optimizer)
    strategy = MultiModulePipelineStrategy({"net": ModulePlacement(pp=pp, dp=dp, tp=tp, shard=shard)}, {"net": []},
                                           num_microbatches=pp, pretrained=pretrained,
                                           sharded_grad_reduction=grad_reduction)
    trainer = L.Trainer(accelerator="gpu" if cuda else "cpu", devices=world, strategy=strategy, max_steps=2,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[before])
    data = TensorDataset(torch.randn(4 * pp * dp, width))
    trainer.fit(model, DataLoader(data, batch_size=pp * dp))
    optimizer = trainer.optimizers[0]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    own = sum(_local_bytes(p) for p in params)
    grads = sum(_local_bytes(p.grad) for p in params if p.grad is not None)
    states = sum(_local_bytes(t) for s in optimizer.state.values() for t in s.values()
                 if isinstance(t, torch.Tensor) and t.dim() > 0)
    peak = torch.cuda.max_memory_allocated() if cuda else proc_status("VmHWM") - base
    return {"peak": peak, "own": own + grads + states, "params": own, "grads": grads, "states": states,
            "before_step": before.peak if not cuda else None}


def _local_bytes(t: torch.Tensor) -> int:
    """Bytes this rank holds of ``t`` (a DTensor's local shard)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per stage")
    parser.add_argument("--shard", action="store_true", help="ModulePlacement(shard=True) (needs --dp >= 2)")
    parser.add_argument("--grad-reduction", nargs="+", default=["step"], choices=("step", "microbatch"),
                        help="sharded_grad_reduction values to run (with --shard)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--optimizer", default="adam", choices=("adam", "sgd"))
    args = parser.parse_args()
    total = args.width * args.width * args.layers * 4
    world = args.pp * args.dp * args.tp
    reductions = args.grad_reduction if args.shard else ["step"]
    print(f"$ python benchmarks/bench_model_memory.py --width {args.width} --layers {args.layers} --pp {args.pp} "
          f"--dp {args.dp}{f' --tp {args.tp}' if args.tp > 1 else ''}{' --shard' if args.shard else ''} --modes {' '.join(args.modes)} "
          f"--grad-reduction {' '.join(reductions)} --optimizer {args.optimizer}")
    print(f"(whole model {total / MIB:.0f} MiB of fp32 parameters, {world} ranks; {machine()})")
    rows, before_rows, training_rows = [], [], []
    # the framework's own growth (Lightning, process groups, buffers), measured with a tiny model
    tiny = run_distributed(worker, world, "meta", 8, args.pp, args.pp, "", args.optimizer, args.dp, args.shard,
                           "step", args.tp, timeout=300, init_pg=False)
    framework = max(r["peak"] for r in tiny)
    framework_before = max(r["before_step"] or 0 for r in tiny)
    with tempfile.TemporaryDirectory() as directory:
        if {"safetensors", "dcp"} & set(args.modes):
            run_distributed(_write, 1, args.width, args.layers, directory, timeout=300, init_pg=False)
        for mode in args.modes:
            for reduction in reductions:
                per_rank = run_distributed(worker, world, mode, args.width, args.layers, args.pp, directory,
                                           args.optimizer, args.dp, args.shard, reduction, args.tp, timeout=600,
                                           init_pg=False)
                for rank, r in enumerate(per_rank):
                    model_peak = r["peak"] - framework
                    rows.append((mode, reduction, rank, f"{r['params'] / MIB:.0f}", f"{r['own'] / MIB:.0f}",
                                 f"{r['peak'] / MIB:.0f}", f"{model_peak / MIB:.0f}",
                                 f"{model_peak / r['own']:.2f}"))
                    if r["before_step"] is not None and reduction == reductions[0]:
                        before = r["before_step"]
                        before_rows.append((mode, rank, f"{r['params'] / MIB:.0f}", f"{before / MIB:.0f}",
                                            f"{before / r['params']:.2f}", f"{(before - framework_before) / MIB:.0f}",
                                            f"{(before - framework_before) / r['params']:.2f}"))
                    rest = model_peak - r["own"]
                    training_rows.append((mode, reduction, rank, f"{r['params'] / MIB:.0f}", f"{r['grads'] / MIB:.0f}",
                                          f"{r['states'] / MIB:.0f}", f"{rest / MIB:.0f}",
                                          f"{model_peak / MIB:.0f}"))
    if before_rows:
        section(f"peak above the process base BEFORE the first step, per rank (framework with a tiny model: "
                f"{framework_before / MIB:.0f} MiB)")
        print(table(["mode", "rank", "own params MiB", "peak - base MiB", "ratio to own params",
                     "minus framework MiB", "ratio minus framework"], before_rows))
    section(f"training peak above the process base, per rank (framework growth with a tiny model: "
            f"{framework / MIB:.0f} MiB)")
    print(table(["mode", "grad reduction", "rank", "own params MiB", f"own params+grads+{args.optimizer} state MiB",
                 "peak - base MiB", "minus framework MiB", "ratio to own"], rows))
    section("training peak minus framework, split: local parameters, gradients, optimizer state, the rest "
            "(unsharded transients and activations)")
    print(table(["mode", "grad reduction", "rank", "params MiB", "grads MiB", f"{args.optimizer} state MiB",
                 "transients MiB", "peak - framework MiB"], training_rows))


if __name__ == "__main__":
    main()
