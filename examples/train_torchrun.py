"""Train the multimodal example with ``PipelineEngine`` in a plain PyTorch loop (no Lightning Trainer).

The model, data and layout are those of ``train_multimodal.py`` (see ``multimodal_model.py``):
vision (dp=2) and audio feed a 2-stage language model, 5 processes. torchrun starts them::

    torchrun --nproc-per-node 5 examples/train_torchrun.py

Every rank builds the same model (same seed) and loads the same global batches; the engine
keeps the rank's own stages, splits each batch into microbatches and dp shards, runs the
schedule, and leaves dp-summed gradients in ``.grad`` for an ordinary optimizer over
``engine.parameters()``. The loss it returns is the step's global loss, the same on every rank.
With ``--save DIR`` each rank writes the parameters it owns to ``DIR/rank{r}.pt`` at the end.
"""

from __future__ import annotations

import argparse
import itertools
import os

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from lightning_mmpp import PipelineEngine, PipelineLayout

from multimodal_model import PLACEMENTS, TOPOLOGY, SyntheticCaptions, VisionAudioModel


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe", "zero_bubble"])
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", default=None, help="write each rank's own parameters to DIR/rank{r}.pt")
    return parser.parse_args()


def batches(batch_size: int, seed: int):
    """The same global batches on every rank: a seeded shuffle, reshuffled each epoch."""
    loader = DataLoader(SyntheticCaptions(4096), batch_size=batch_size, shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(seed))
    return itertools.chain.from_iterable(itertools.repeat(loader))


def make_optimizer(name: str, params, lr: float) -> torch.optim.Optimizer:
    """AdamW (the default) or plain SGD with momentum."""
    return torch.optim.AdamW(params, lr=lr) if name == "adamw" else torch.optim.SGD(params, lr=lr, momentum=0.9)


def main() -> None:
    args = parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")  # torchrun set RANK, WORLD_SIZE, MASTER_ADDR
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)  # more ranks than cores: one thread per rank

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = VisionAudioModel()
    layout = PipelineLayout(PLACEMENTS, TOPOLOGY)
    engine = PipelineEngine(model, layout, num_microbatches=args.microbatches, schedule=args.schedule,
                            device=device)
    optimizer = make_optimizer(args.optimizer, engine.parameters(), args.lr)
    if rank == 0:
        print(layout.table(), flush=True)

    first = last = None
    for step, batch in zip(range(args.steps), batches(args.batch_size, args.seed)):
        optimizer.zero_grad(set_to_none=True)
        out = engine.step(batch)  # forwards, backwards, dp gradient sums; the loss of the whole batch
        optimizer.step()
        last = float(out.loss)
        first = last if first is None else first
        if rank == 0 and (step % 20 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {last:.4f}  accuracy {float(out.metrics['accuracy']):.3f}", flush=True)
    print(f"rank {rank}: loss {first:.4f} -> {last:.4f}", flush=True)

    if args.save:
        os.makedirs(args.save, exist_ok=True)
        own = {id(p) for p in engine.parameters()}
        state = {name: p.detach().cpu() for name, p in model.named_parameters() if id(p) in own}
        torch.save(state, os.path.join(args.save, f"rank{rank}.pt"))
    # every rank done (the saves included) before any closes its groups: a gloo rank that closes
    # a pair while its peer still holds it open now and then aborts that peer at exit
    dist.barrier()
    engine.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
