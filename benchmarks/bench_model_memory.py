"""Model memory per rank: meta build + own-stage materialisation vs building the whole model.

    python benchmarks/bench_model_memory.py                 # 4 ranks, 16 x Linear(1024, 1024)
    python benchmarks/bench_model_memory.py --width 2048 --layers 32

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


def worker(rank: int, world: int, mode: str, width: int, layers: int, pp: int, directory: str, optimizer: str) -> dict:
    cuda = torch.cuda.is_available()
    base = start_memory_measurement()
    pretrained = None
    if mode == "safetensors":
        pretrained = {"net": os.path.join(directory, "net.safetensors")}
    elif mode == "dcp":
        pretrained = {"net": os.path.join(directory, "net_dcp")}
    model = Net(width, layers, eager=mode == "eager", optimizer=optimizer)
    strategy = MultiModulePipelineStrategy({"net": ModulePlacement(pp=pp)}, {"net": []}, num_microbatches=pp,
                                           pretrained=pretrained)
    trainer = L.Trainer(accelerator="gpu" if cuda else "cpu", devices=world, strategy=strategy, max_steps=2,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    data = TensorDataset(torch.randn(4 * pp, width))
    trainer.fit(model, DataLoader(data, batch_size=pp))
    optimizer = trainer.optimizers[0]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    own = sum(p.numel() * p.element_size() for p in params)
    grads = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    states = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                 if isinstance(t, torch.Tensor) and t.dim() > 0)
    peak = torch.cuda.max_memory_allocated() if cuda else proc_status("VmHWM") - base
    return {"peak": peak, "own": own + grads + states, "params": own}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--optimizer", default="adam", choices=("adam", "sgd"))
    args = parser.parse_args()
    total = args.width * args.width * args.layers * 4
    print(f"$ python benchmarks/bench_model_memory.py --width {args.width} --layers {args.layers} --pp {args.pp} "
          f"--optimizer {args.optimizer}")
    print(f"(whole model {total / MIB:.0f} MiB of fp32 parameters; {machine()})")
    rows = []
    # the framework's own growth (Lightning, process groups, buffers), measured with a tiny model
    tiny = run_distributed(worker, args.pp, "meta", 8, args.pp, args.pp, "", args.optimizer, timeout=300,
                           init_pg=False)
    framework = max(r["peak"] for r in tiny)
    with tempfile.TemporaryDirectory() as directory:
        if {"safetensors", "dcp"} & set(args.modes):
            run_distributed(_write, 1, args.width, args.layers, directory, timeout=300, init_pg=False)
        for mode in args.modes:
            per_rank = run_distributed(worker, args.pp, mode, args.width, args.layers, args.pp, directory,
                                       args.optimizer, timeout=600, init_pg=False)
            for rank, r in enumerate(per_rank):
                model_peak = r["peak"] - framework
                rows.append((mode, rank, f"{r['params'] / MIB:.0f}", f"{r['own'] / MIB:.0f}",
                             f"{r['peak'] / MIB:.0f}", f"{model_peak / MIB:.0f}", f"{model_peak / r['own']:.2f}"))
    section(f"peak memory above the process base, per rank (framework growth with a tiny model: "
            f"{framework / MIB:.0f} MiB)")
    print(table(["mode", "rank", "own params MiB", f"own params+grads+{args.optimizer} state MiB",
                 "peak - base MiB", "minus framework MiB", "ratio to own"], rows))


if __name__ == "__main__":
    main()
