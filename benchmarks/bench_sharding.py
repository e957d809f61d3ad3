"""Per-module sharding and recompute: memory per rank, and data-parallel gradient sync overlapped with the drain.

    python benchmarks/bench_sharding.py memory          # pp=2, dp=4, Adam: plain / shard / shard+recompute
    python benchmarks/bench_sharding.py sync            # sleep stages: dp=1 vs dp=2, sums started early or post-step

``memory``: a LightningModule holds one pipelined module ``net`` of ``--layers`` MLP blocks
(``x + Linear(4w, w)(gelu(Linear(w, 4w)(x)))``, width ``--width``) placed ``pp=2, dp=4`` (8
forked gloo ranks), Adam (``foreach=False``), two training steps under the real strategy. Per rank:

* the bytes of its parameters + gradients + Adam state as held (local shards when sharded),
  next to the theoretical ``16 B x stage parameters (/ dp when sharded)``;
* peak resident memory minus the worker's base (``VmHWM`` reset through
  ``/proc/self/clear_refs``; GPU: ``torch.cuda.max_memory_allocated``); sharded stages also
  hold, for a moment, one block's gathered parameters and unsharded gradients;
* the peak bytes autograd keeps saved for backward (activations, parameters excluded),
  counted through ``torch.autograd.graph.saved_tensors_hooks`` around ``fit``. Theory per
  block and row: ``9 w`` floats without recompute (the block input, the first linear's output,
  gelu's output), ``w`` with it (the block input), plus, during a backward, one block's
  recomputed intermediates.

``sync``: sleep stages (forward ``--tf``, backward ``--tb`` seconds), each with a
``--grad-mib`` MiB gradient (a parameter whose gradient costs nothing to compute), on
``--layout dag`` (an encoder, dp=1, feeding an LM of ``pp-1`` stages with dp=1 or 2) or
``--layout chain`` (one module of ``pp`` stages, dp=1 or 2). A stage is ``--layers`` sleep
layers, each with ``1/layers`` of the time and of the gradient. Four ways, timed in one launch,
rounds interleaved: ``dp=1`` (no reduction); with dp=2,
:class:`~lightning_mmpp.engine.data_parallel.StageGradients` as the runtime's gradient sync with
``--bucket-mib`` buckets launched from gradient hooks during the stage's last backward
(``in last B``, what the strategy does on accelerators) or after it (``after last B``, what it
does on CPU), and ``post-step`` (the old way: every all-reduce starts after the whole
schedule). Step time: max over ranks of schedule + reduction
wait; ``exposed`` is the longest wait for the reduction after the schedule.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from benchmarks.common import (  # noqa: E402
    Sleep, SleepHooks, gather_max, interleaved, machine, median, proc_status, section, start_memory_measurement, table,
)  # noqa: E402
from lightning_mmpp import ModulePlacement, MultiModulePipelineStrategy  # noqa: E402
from lightning_mmpp.engine.comm import MultiModuleCommunicator  # noqa: E402
from lightning_mmpp.engine.data_parallel import StageGradients  # noqa: E402
from lightning_mmpp.model.partition import StageRunner  # noqa: E402
from lightning_mmpp.core.placement import PipelineLayout  # noqa: E402
from lightning_mmpp.engine.runtime import PipelineRuntime  # noqa: E402
from lightning_mmpp.core.schedule import build_schedule  # noqa: E402
from tests.dist import run_distributed  # noqa: E402

MIB = 1024 * 1024
MEMORY_MODES = {"plain": (False, False), "shard": (True, False), "shard+recompute": (True, True)}


# --- memory ----------------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class Net(L.LightningModule):
    """Built in ``configure_model`` (on the meta device under the strategy): each rank
    allocates only its own stage, so the process base holds no model."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.width, self.layers = width, layers

    def configure_model(self) -> None:
        if not hasattr(self, "net"):
            self.net = nn.Sequential(*(Block(self.width) for _ in range(self.layers)))

    def pipeline_inputs(self, module, batch, upstream):
        return batch[0]

    def pipeline_loss(self, output, batch):
        return output.square().mean()

    def configure_optimizers(self):
        # foreach=False: the multi-tensor path allocates temporaries the size of all parameters
        return torch.optim.Adam(self.parameters(), lr=1e-4, foreach=False)


class SavedActivations:
    """Live bytes autograd holds for backward (parameters excluded), and their peak.

    Tensors are counted once per storage however many ops save them, and leave the count when
    the last graph node holding them is freed."""

    def __init__(self) -> None:
        self.live: dict[int, list[int]] = {}  # storage pointer -> [bytes, holders]
        self.bytes = 0
        self.peak = 0

    def pack(self, t: torch.Tensor) -> Any:
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter) or t.device.type == "meta":
            return t  # a parameter (or a view of one, as a linear saves weight.t()) is no activation
        return _Held(self, t)

    @staticmethod
    def unpack(held: Any) -> torch.Tensor:
        return held.tensor if isinstance(held, _Held) else held

    def add(self, key: int, size: int) -> None:
        entry = self.live.setdefault(key, [size, 0])
        if entry[1] == 0:
            self.bytes += size
            self.peak = max(self.peak, self.bytes)
        entry[1] += 1

    def remove(self, key: int) -> None:
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.bytes -= entry[0]
            del self.live[key]


class _Held:
    def __init__(self, owner: SavedActivations, tensor: torch.Tensor) -> None:
        self.owner, self.tensor = owner, tensor
        self.key = tensor.untyped_storage().data_ptr()
        owner.add(self.key, tensor.untyped_storage().nbytes())

    def __del__(self) -> None:
        self.owner.remove(self.key)



def memory_worker(rank: int, world: int, mode: str, width: int, layers: int, pp: int, dp: int, m: int,
                  rows: int) -> dict:
    from torch.distributed.tensor import DTensor

    cuda = torch.cuda.is_available()
    model = Net(width, layers)
    base = start_memory_measurement()
    shard, recompute = MEMORY_MODES[mode]
    placement = ModulePlacement(pp=pp, dp=dp, shard=shard, recompute=recompute)
    strategy = MultiModulePipelineStrategy({"net": placement}, {"net": []}, num_microbatches=m)
    trainer = L.Trainer(accelerator="gpu" if cuda else "cpu", devices=world, strategy=strategy, max_steps=2,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    data = TensorDataset(torch.randn(2 * m * dp * rows, width))
    saved = SavedActivations()
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        trainer.fit(model, DataLoader(data, batch_size=m * dp * rows))
    optimizer = trainer.optimizers[0]
    params = [p for g in optimizer.param_groups for p in g["params"]]

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    def nbytes(t: torch.Tensor) -> int:
        t = local(t)
        return t.numel() * t.element_size()

    held = sum(nbytes(p) for p in params)
    grads = sum(nbytes(p.grad) for p in params if p.grad is not None)
    states = sum(nbytes(t) for s in optimizer.state.values() for t in s.values()
                 if isinstance(t, torch.Tensor) and t.dim() > 0)
    stage_params = sum(p.numel() for p in params)  # a DTensor's numel is the whole parameter's
    peak = torch.cuda.max_memory_allocated() if cuda else proc_status("VmHWM") - base
    return {"peak": peak, "own": held + grads + states, "stage_params": stage_params, "saved": saved.peak,
            "stage": strategy.layout.slot(rank, "net").stage}


def run_memory(args: argparse.Namespace) -> None:
    world = args.pp * args.dp
    block = 2 * 4 * args.width * args.width + 5 * args.width
    print(f"$ python benchmarks/bench_sharding.py memory --width {args.width} --layers {args.layers} --pp {args.pp} "
          f"--dp {args.dp} --m {args.m} --rows {args.rows}")
    print(f"({args.layers} blocks of {block * 4 / MIB:.1f} MiB fp32 parameters, {world} ranks, microbatch "
          f"{args.rows} rows per replica; {machine()})")
    rows, summary = [], {}
    # what Lightning, the process groups and FSDP2 add whatever the model: a tiny model, same run
    framework = {mode: max(r["peak"] for r in run_distributed(
        memory_worker, world, mode, 8, args.layers, args.pp, args.dp, args.m, 1, timeout=900, init_pg=False))
        for mode in args.modes}
    for mode in args.modes:
        per_rank = run_distributed(memory_worker, world, mode, args.width, args.layers, args.pp, args.dp, args.m,
                                   args.rows, timeout=900, init_pg=False)
        shard = MEMORY_MODES[mode][0]
        for rank, r in enumerate(per_rank):
            theory = 16 * r["stage_params"] / (args.dp if shard else 1)
            # 1F1B keeps min(m, pp - stage) microbatches in flight on a stage
            in_flight = min(args.m, args.pp - r["stage"])
            per_row = args.width if MEMORY_MODES[mode][1] else 9 * args.width
            stash = in_flight * args.layers // args.pp * args.rows * per_row * 4
            rows.append((mode, rank, r["stage"], f"{theory / MIB:.1f}", f"{r['own'] / MIB:.1f}",
                         f"{r['own'] / theory:.3f}", f"{r['peak'] / MIB:.0f}",
                         f"{(r['peak'] - framework[mode]) / MIB:.0f}", f"{stash / MIB:.1f}",
                         f"{r['saved'] / MIB:.1f}"))
        summary[mode] = per_rank
    section("per rank: parameters + gradients + Adam state (as held), peak RSS - base, peak saved activations")
    print("framework growth with a tiny model (same run): "
          + ", ".join(f"{mode} {v / MIB:.0f} MiB" for mode, v in framework.items()))
    print(table(["mode", "rank", "stage", "theory MiB", "held MiB", "held/theory", "peak-base MiB",
                 "minus framework MiB", "stash theory MiB", "saved act. MiB"], rows))
    if {"plain", "shard"} <= summary.keys():
        section("ratios, same run (per stage, max over its replicas)")
        out = []
        for stage in range(args.pp):
            def worst(mode: str, key: str) -> float:
                return max(r[key] for r in summary[mode] if r["stage"] == stage)
            def model_peak(mode: str) -> float:
                return worst(mode, "peak") - framework[mode]
            line = [stage, f"{worst('shard', 'own') / (worst('plain', 'own') / args.dp):.3f}",
                    f"{model_peak('shard') / model_peak('plain'):.2f}"]
            if "shard+recompute" in summary:
                line.append(f"{worst('shard', 'saved') / worst('shard+recompute', 'saved'):.2f}")
                line.append(f"{model_peak('shard+recompute') / model_peak('plain'):.2f}")
            out.append(line)
        headers = ["stage", "sharded held / (plain held / dp)", "peak shard / plain (minus framework)"]
        if "shard+recompute" in summary:
            headers += ["saved act. shard / shard+recompute", "peak shard+recompute / plain"]
        print(table(headers, out))


# --- gradient sync -----------------------------------------------------------------------------------


class BallastSleepStage(nn.Module):
    """A sleep stage with a ``numel``-element parameter whose gradient (zeros) costs one fill."""

    def __init__(self, tf: float, tb: float, numel: int) -> None:
        super().__init__()
        self.tf, self.tb = tf, tb
        self.scale = nn.Parameter(torch.ones(()))
        self.ballast = nn.Parameter(torch.zeros(numel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Sleep.apply(x * self.scale, self.tf, self.tb) + self.ballast[:1] * 0.0


class SyncPipeline:
    """This rank's stages of a sleep-stage chain, with its gradient reduction done one of three ways."""

    def __init__(self, layout: PipelineLayout, rank: int, m: int, tf: float, tb: float, numel: int,
                 way: str, groups: dict, p2p_group: Any = None, layers: int = 1,
                 bucket_bytes: int = 4 * MIB) -> None:
        self.layout, self.rank, self.way = layout, rank, way
        self.active = rank < layout.world_size
        if not self.active:
            return
        # each stage: ``layers`` sleep layers sharing tf, tb and the gradient bytes
        self.runners = {
            slot.module: StageRunner(slot.module, slot.stage,
                                     [BallastSleepStage(tf / layers, tb / layers, numel // layers) for _ in range(layers)],
                                     [str(i) for i in range(layers)])
            for slot in layout.slots(rank)
        }
        self.gradients = StageGradients.for_rank(layout, rank, self.runners, groups, layout.world_size,
                                                 bucket_bytes=bucket_bytes)
        self.gradients.launch_in_backward = way == "in backward"
        comm = MultiModuleCommunicator(layout, rank, torch.device("cpu"), group=p2p_group)
        self.comm = comm
        sync = self.gradients if way in ("in backward", "after") else None
        self.runtime = PipelineRuntime(layout, rank, comm, self.runners, SleepHooks(), gradient_sync=sync)
        self.schedule = build_schedule(layout, m, "1f1b")
        g = torch.Generator().manual_seed(0)
        rows = 8 * max(p.dp for p in layout.placements.values())
        self.data = [torch.randn(rows, 256, generator=g) for _ in range(m)]
        self.exposed: list[float] = []

    def _shard(self, module: str, k: int) -> torch.Tensor:
        slot = self.layout.slot(self.rank, module)
        return self.data[k][self.layout.batch_shard(module, slot.replica, self.data[k].shape[0])]

    def step(self) -> float:
        dist.barrier()
        if not self.active:
            return 0.0
        for runner in self.runners.values():
            for p in runner.parameters():
                p.grad = None
        start = time.perf_counter()
        self.runtime.run(self.schedule, self._shard)  # ends with comm.finish_step()
        drained = time.perf_counter()
        self.gradients.synchronize()  # post-step: starts and waits; otherwise: waits
        end = time.perf_counter()
        self.exposed.append(end - drained)
        return end - start


def sync_layouts(layout: str, pp: int) -> tuple[PipelineLayout, PipelineLayout]:
    """(dp=1, dp=2) versions of a benchmark layout: the same stages, the dp=2 one with two
    replicas of the data-parallel module (each doing the dp=1 per-replica work)."""
    if layout == "chain":  # one module: stage 0's last backward ends the step, no drain after it
        return tuple(PipelineLayout({"a": ModulePlacement(pp=pp, dp=dp)}, {"a": []}) for dp in (1, 2))  # type: ignore[return-value]
    # an encoder (dp=1) feeding an LM of pp-1 stages: the LM's reductions overlap the encoder's drain
    return tuple(PipelineLayout({"enc": ModulePlacement(), "llm": ModulePlacement(pp=pp - 1, dp=dp)},  # type: ignore[return-value]
                                {"enc": ["llm"], "llm": []}) for dp in (1, 2))


def sync_worker(rank: int, world: int, layout: str, pp: int, m: int, tf: float, tb: float, numel: int,
                rounds: int, steps: int, layers: int, bucket_bytes: int) -> dict:
    dp1, dp2 = sync_layouts(layout, pp)
    groups = {ranks: dist.new_group(list(ranks)) for ranks in dp2.dp_groups()}
    first = dist.new_group(list(range(dp1.world_size)))  # every rank creates it; the dp=1 ranks use it
    pipes = {
        "dp=1": SyncPipeline(dp1, rank, m, tf, tb, numel, "none", {}, first, layers, bucket_bytes),
        "dp=2 in last B (buckets)": SyncPipeline(dp2, rank, m, tf, tb, numel, "in backward", groups, None, layers,
                                                 bucket_bytes),
        "dp=2 after last B": SyncPipeline(dp2, rank, m, tf, tb, numel, "after", groups, None, layers, bucket_bytes),
        "dp=2 post-step": SyncPipeline(dp2, rank, m, tf, tb, numel, "post-step", groups, None, layers, bucket_bytes),
    }
    times = interleaved({name: pipe.step for name, pipe in pipes.items()}, rounds, steps)
    exposed = {name: gather_max([median(pipe.exposed) if pipe.active else 0.0])[0] for name, pipe in pipes.items()}
    # what one stage's reduction costs when nothing overlaps it
    flat = torch.zeros(numel + 1)
    mine = [group for ranks, group in groups.items() if rank in ranks]
    alone = []
    for _ in range(5):
        dist.barrier()
        start = time.perf_counter()
        if mine:
            dist.all_reduce(flat, group=mine[0])
        alone.append(time.perf_counter() - start)
    return {"times": times, "exposed": exposed, "alone": gather_max([median(alone)])[0]}


def run_sync(args: argparse.Namespace) -> None:
    numel = int(args.grad_mib * MIB / 4)
    print(f"$ python benchmarks/bench_sharding.py sync --layout {args.layout} --pp {args.pp} --m {args.m} "
          f"--tf {args.tf} --tb {args.tb} --grad-mib {args.grad_mib} --layers {args.layers} "
          f"--bucket-mib {args.bucket_mib} --rounds {args.rounds} --steps {args.steps}")
    print(f"({machine()})")
    world = sync_layouts(args.layout, args.pp)[1].world_size
    out = run_distributed(sync_worker, world, args.layout, args.pp, args.m, args.tf, args.tb, numel, args.rounds,
                          args.steps, args.layers, int(args.bucket_mib * MIB), timeout=900, init_pg=True)[0]
    base = median(out["times"]["dp=1"])
    rows = [(name, f"{median(t) * 1000:.1f}", f"{median(t) / base:.3f}", f"{out['exposed'][name] * 1000:.1f}")
            for name, t in out["times"].items()]
    what = f"{args.pp}-stage chain" if args.layout == "chain" else f"encoder -> LM of {args.pp - 1} stages (dp on the LM)"
    section(f"1F1B step, {what}, m={args.m}, {args.grad_mib} MiB gradient per stage in {args.layers} layers "
            f"(one all-reduce alone: {out['alone'] * 1000:.1f} ms)")
    print(table(["gradient sync", "step ms (median)", "/ dp=1", "exposed reduction ms (median, worst rank)"], rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    mem = sub.add_parser("memory")
    mem.add_argument("--width", type=int, default=512)
    mem.add_argument("--layers", type=int, default=8)
    mem.add_argument("--pp", type=int, default=2)
    mem.add_argument("--dp", type=int, default=4)
    mem.add_argument("--m", type=int, default=4)
    mem.add_argument("--rows", type=int, default=128, help="rows per microbatch and replica")
    mem.add_argument("--modes", nargs="+", default=list(MEMORY_MODES), choices=list(MEMORY_MODES))
    sync = sub.add_parser("sync")
    sync.add_argument("--layout", default="dag", choices=("dag", "chain"))
    sync.add_argument("--pp", type=int, default=4)
    sync.add_argument("--m", type=int, default=8)
    sync.add_argument("--tf", type=float, default=0.02)
    sync.add_argument("--tb", type=float, default=0.04)
    sync.add_argument("--grad-mib", type=float, default=16.0)
    sync.add_argument("--layers", type=int, default=4, help="layers per stage (one gradient bucket each)")
    sync.add_argument("--bucket-mib", type=float, default=4.0)
    sync.add_argument("--rounds", type=int, default=3)
    sync.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    run_memory(args) if args.what == "memory" else run_sync(args)


if __name__ == "__main__":
    main()
