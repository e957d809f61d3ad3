"""PipelineEngine on one device against a plain training loop of the same model: the framework's cost.

    python benchmarks/bench_engine_overhead.py                 # CUDA when available, else CPU
    python benchmarks/bench_engine_overhead.py --device cpu --width 512

One process, every module colocated on rank 0 (``ModulePlacement(rank_offset=0)``), so nothing
is sent: what the engine adds over ``loss.backward()`` is its own work per step (batch
splitting, the schedule's actions, stashing, metric reduction) and per microbatch. Both run the
same model (two encoders -> an LM of ``--layers`` MLP blocks of ``--width``), the same batches
and AdamW; the table gives the median step time of each, their ratio, and the peak memory of
its first two steps above what was allocated before them (``torch.cuda.max_memory_allocated``
minus ``memory_allocated``: gradients, AdamW state, activations; on CPU the process's peak RSS
only grows, so the column is left out there) next to the parameter + gradient + Adam bytes. The two variants alternate round by round, so a slow spell of the machine
hits both alike.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from lightning_mmpp import ModulePlacement, PipelineEngine, PipelineLayout, run_unpipelined  # noqa: E402

TOPOLOGY = {"enc_a": ["llm"], "enc_b": ["llm"], "llm": []}


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.enc_a = nn.Sequential(*(Block(width) for _ in range(max(1, layers // 4))))
        self.enc_b = nn.Sequential(*(Block(width) for _ in range(max(1, layers // 4))))
        self.llm = nn.Sequential(*(Block(width) for _ in range(layers)))

    def pipeline_inputs(self, module: str, batch: dict[str, torch.Tensor], upstream: dict[str, Any]) -> Any:
        if module == "enc_a":
            return batch["a"]
        if module == "enc_b":
            return batch["b"]
        return upstream["enc_a"] + upstream["enc_b"]

    def pipeline_loss(self, module: str, output: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return (output - batch["target"]).pow(2).mean()


def peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    g = torch.Generator().manual_seed(0)
    shape = (args.batch, args.seq, args.width)
    batch = {k: torch.randn(*shape, generator=g).to(device) for k in ("a", "b", "target")}

    runs = {}
    torch.manual_seed(0)
    plain = Model(args.width, args.layers).to(device)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-4)

    def plain_step() -> None:
        loss, _ = run_unpipelined(plain, TOPOLOGY, batch)
        loss.backward()
        plain_opt.step()
        plain_opt.zero_grad(set_to_none=True)  # no gradient stays resident between variants

    runs["plain loop"] = plain_step
    layout = PipelineLayout({m: ModulePlacement(rank_offset=0) for m in TOPOLOGY}, TOPOLOGY)
    engines = []
    for m in args.microbatches:
        torch.manual_seed(0)
        engine = PipelineEngine(Model(args.width, args.layers), layout, m, device=device)
        optimizer = torch.optim.AdamW(engine.parameters(), lr=1e-4)
        engines.append(engine)

        def engine_step(engine: PipelineEngine = engine, optimizer: Any = optimizer) -> None:
            engine.step(batch)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        runs[f"PipelineEngine m={m}"] = engine_step

    params = sum(p.numel() * p.element_size() for p in plain.parameters())
    times: dict[str, list[float]] = {name: [] for name in runs}
    peaks: dict[str, int] = {}
    for name, fn in runs.items():  # warm-up, and each variant's peak above what was allocated before it
        sync()
        before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        fn()
        fn()
        sync()
        peaks[name] = peak_bytes(device) - before
    for _ in range(args.rounds):
        for name, fn in runs.items():
            sync()
            start = time.perf_counter()
            for _ in range(args.steps):
                fn()
            sync()
            times[name].append((time.perf_counter() - start) / args.steps)

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{os.cpu_count()} CPU cores"
    print(f"$ python benchmarks/bench_engine_overhead.py --device {args.device} --width {args.width} "
          f"--layers {args.layers} --batch {args.batch} --seq {args.seq}  ({name}, torch {torch.__version__})")
    print(f"model: {params / 2**20:.0f} MiB of fp32 parameters; params + grads + AdamW = {4 * params / 2**30:.2f} GiB")
    base = statistics.median(times["plain loop"])
    print(f"{'variant':>22}  {'step ms':>8}  {'/ plain':>7}  {'peak GiB':>8}  (peak: above the allocations before "
          "the variant's first step, i.e. gradients, AdamW state and activations)")
    for name, values in times.items():
        med = statistics.median(values)
        peak = f"{peaks[name] / 2**30:8.2f}" if device.type == "cuda" else f"{'-':>8}"
        print(f"{name:>22}  {1000 * med:8.2f}  {med / base:7.3f}  {peak}")
    for engine in engines:
        engine.close()


if __name__ == "__main__":
    main()
