"""Where a model's step goes, rank by rank, beside the planner's prediction (the README example by default).

    python benchmarks/profile_example_step.py --calibration cal.json            # 2 ranks, top 2 plans
    python benchmarks/profile_example_step.py --world-size 4 --top-k 1 --launches 3
    python benchmarks/profile_example_step.py --model path/to/script.py:ModelClass --batch-size 64
    python benchmarks/profile_example_step.py --world-size 4 --top-k 1 --timeline  # when each action ran

The model is ``--model`` (``script.py:ModelClass``, found and given a sample batch as ``python -m
lightning_mmpp.plan`` does; default ``examples/train_multimodal.py:VisionAudioLM``) on a batch of
``--batch-size`` (default 32). It is profiled with
a rank's share of the cores and planned with the calibration (``--calibration FILE``: read, or
measured with ``calibrate`` and written when the file is absent). Each of the ``--top-k`` plans
is trained through ``Trainer.fit`` in each of ``--launches`` launches (``--steps`` steps, the
first ``--warmup`` dropped; a barrier starts every step, as the planner's ``--validate`` does).
Printed per plan: the predicted step; the median over steps of the slowest rank's step, per
launch (what ``--validate`` compares with the prediction); and, per rank, the medians of

* ``step``: this rank's batch start (after the barrier) to batch end;
* ``before the step``: batch start to the strategy's ``training_step`` (Lightning's loop);
* ``run_pipeline``: the schedule's actions (computes and transfers, waits included);
* ``rest of training_step``: the metric all-reduce, the dp gradient sums, the logging;
* ``optimizer and after``: ``on_before_optimizer_step`` to batch end (clipping, the update,
  zeroing, callbacks);
* ``main thread CPU``: the CPU seconds of the rank's main thread over its step
  (``time.thread_time``): ``step`` less this is the time it waited (for peers, for gloo's
  threads, for a core);

each as its 10th percentile, median and 90th percentile over the steps (the 10th: the steps
that nothing stalled; the 90th: how long a stall runs); per module, the stage costs the prediction used (forward, backward, optimizer step per
microbatch and step); and per rank, the median of each compute action as the runtime ran it (the
wait for its inputs included). CI never runs this.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from benchmarks.common import calibration_at, quantiles  # noqa: E402
from lightning_mmpp.plan import plan_placements, profile_model  # noqa: E402
from lightning_mmpp.plan.target import ScriptModel, load_target  # noqa: E402
from lightning_mmpp.plan.costs import CostModel  # noqa: E402
from lightning_mmpp.plan.launch import rank_threads, run_local  # noqa: E402

PARTS = ("step", "before the step", "run_pipeline", "rest of training_step", "optimizer and after", "main thread CPU")
QUANTILES = (0.1, 0.5, 0.9)


def _worker(rank: int, world: int, model_class: Any, placements: dict, topology: dict, m: int, schedule: str,
            batch: Any, steps: int, warmup: int) -> dict[str, Any]:
    """This rank's quantiles of each part, the median and 10th percentile of the slowest rank's
    step, and this rank's median of each compute action."""
    import lightning as L
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from lightning_mmpp import MultiModulePipelineStrategy

    marks: list[dict[str, float]] = []
    now: dict[str, float] = {}
    computes: dict[str, list[float]] = {}  # "module phase" -> seconds of each compute action (its waits included)
    timeline: list[list[tuple[str, float, float]]] = []  # per step: (action, start, end) from the step's start

    class Marks(L.Callback):
        def on_train_batch_start(self, *args: Any) -> None:
            dist.barrier()
            now.clear()
            timeline.append([])
            now["start"] = time.perf_counter()
            now["cpu"] = time.thread_time()

        def on_before_optimizer_step(self, *args: Any) -> None:
            now["optimizer"] = time.perf_counter()

        def on_train_batch_end(self, *args: Any) -> None:
            now["end"] = time.perf_counter()
            now["cpu"] = time.thread_time() - now["cpu"]
            slowest = torch.tensor([now["end"] - now["start"]], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            now["slowest"] = float(slowest)
            marks.append(dict(now))

    strategy = MultiModulePipelineStrategy(placements, topology, m, schedule=schedule)
    training_step, setup = strategy.training_step, strategy.setup

    def timed_training_step(*args: Any, **kwargs: Any) -> Any:
        now["step_in"] = time.perf_counter()
        out = training_step(*args, **kwargs)
        now["step_out"] = time.perf_counter()
        return out

    def setup_then_time_the_pipeline(trainer: Any) -> None:
        setup(trainer)
        engine = strategy._engine
        run_pipeline = engine.run_pipeline

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            out = run_pipeline(*args, **kwargs)
            now["pipeline"] = time.perf_counter() - start
            return out

        engine.run_pipeline = timed
        runtime = engine.runtime
        compute = runtime._compute

        def timed_compute(step: Any, prepared: Any) -> None:
            start = time.perf_counter()
            compute(step, prepared)
            end = time.perf_counter()
            action = prepared.action
            computes.setdefault(f"{action.module} {action.phase.name.lower()}", []).append(end - start)
            timeline[-1].append((str(action), start - now["start"], end - now["start"]))

        runtime._compute = timed_compute

    strategy.training_step, strategy.setup = timed_training_step, setup_then_time_the_pipeline
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, callbacks=[Marks()])
    trainer.fit(model_class(), DataLoader([batch] * steps, batch_size=None, collate_fn=lambda b: b))
    timed_marks = marks[warmup:]
    parts = {
        "step": [m_["end"] - m_["start"] for m_ in timed_marks],
        "before the step": [m_["step_in"] - m_["start"] for m_ in timed_marks],
        "run_pipeline": [m_["pipeline"] for m_ in timed_marks],
        "rest of training_step": [m_["step_out"] - m_["step_in"] - m_["pipeline"] for m_ in timed_marks],
        "optimizer and after": [m_["end"] - m_["optimizer"] for m_ in timed_marks],
        "main thread CPU": [m_["cpu"] for m_ in timed_marks],
    }
    slowest = quantiles([m_["slowest"] for m_ in timed_marks], QUANTILES)
    steps_kept = timeline[warmup:]
    actions = [(name, statistics.median(t[i][1] for t in steps_kept), statistics.median(t[i][2] for t in steps_kept))
               for i, (name, _, _) in enumerate(steps_kept[0])]
    return {"parts": {k: quantiles(v, QUANTILES) for k, v in parts.items()},
            "slowest": slowest[1], "slowest_p10": slowest[0],
            "computes": {k: statistics.median(v[warmup:]) for k, v in computes.items()},
            "timeline": actions}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=os.path.join(ROOT, "examples", "train_multimodal.py") + ":VisionAudioLM",
                        help="path/to/script.py:ModelClass")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--calibration", help="calibration JSON: read, or measured and written when absent")
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--launches", type=int, default=2)
    parser.add_argument("--memory-limit", type=float, help="bytes per rank the plans must fit (default: none)")
    parser.add_argument("--uniform", action="store_true", help="the best uniform plans (every module the same dp)")
    parser.add_argument("--timeline", action="store_true",
                        help="per rank, each action's median start-end in the step beside the planner's simulated one")
    args = parser.parse_args()
    model_class, batch, topology = load_target(args.model, args.batch_size)
    cal = calibration_at(args.calibration, args.world_size)
    model = model_class()
    topology = getattr(model, "pipeline_topology", None) or topology
    profile = profile_model(model, batch, topology=topology, calibration=cal,
                            num_threads=rank_threads(args.world_size))
    plans = plan_placements(profile, args.world_size, top_k=args.top_k, calibration=cal, batch_size=args.batch_size,
                            memory_limit_bytes=args.memory_limit, uniform=args.uniform)
    print(f"$ python benchmarks/profile_example_step.py --model {args.model} --batch-size {args.batch_size} "
          f"--world-size {args.world_size} --top-k {args.top_k} "
          + (f"--memory-limit {args.memory_limit:.0f} " if args.memory_limit else "") + ("--uniform " if args.uniform else "") +
          f"--steps {args.steps} --launches {args.launches}   (load average {os.getloadavg()[0]:.2f})")
    for i, plan in enumerate(plans, 1):
        cost = CostModel(profile, plan.placements, plan.num_microbatches)
        print(f"\n#{i} {plan.describe()}  m={plan.num_microbatches}: predicted {plan.step_time_s * 1e3:.2f} ms")
        for name in plan.placements:
            stage = cost.stage(name, 0)
            print(f"   {name:8s} stage 0: forward {stage.forward_s * 1e3:.3f}  backward {stage.backward_s * 1e3:.3f}  "
                  f"optimizer {stage.optimizer_s * 1e3:.3f}  gradient copies {stage.gradient_copy_s * 1e3:.3f} ms")
        make = ScriptModel(os.path.abspath(args.model.rpartition(":")[0]), args.model.rpartition(":")[2])
        launches = [run_local(_worker, args.world_size, make, plan.placements, plan.topology,
                              plan.num_microbatches, str(plan.schedule), batch, args.steps, args.warmup, timeout=900)
                    for _ in range(args.launches)]
        slowest = [launch[0]["slowest"] for launch in launches]
        clean = statistics.median(launch[0]["slowest_p10"] for launch in launches)
        print("   slowest rank's step per launch: " + ", ".join(f"{s * 1e3:.2f}" for s in slowest)
              + f" ms; measured / predicted {statistics.median(slowest) / plan.step_time_s:.3f} "
              f"(10th percentile {clean * 1e3:.2f} ms: {clean / plan.step_time_s:.3f})")
        print(f"   {'ms, p10 / p50 / p90':22s} " + "  ".join(f"{'rank ' + str(r):>22s}" for r in range(args.world_size)))
        for part in PARTS:
            cells = ["/".join(f"{statistics.median(l[r]['parts'][part][i] for l in launches) * 1e3:6.2f}"
                              for i in range(len(QUANTILES))) for r in range(args.world_size)]
            print(f"   {part:22s} " + "  ".join(cells))
        for rank in range(args.world_size):
            for name in sorted(launches[0][rank]["computes"]):
                got = statistics.median(l[rank]["computes"][name] for l in launches)
                print(f"   rank {rank} {name:22s} {got * 1e3:6.3f} ms per action (its wait for inputs included)")
        if args.timeline:
            _print_timeline(profile, plan, cost, launches[0])


def _print_timeline(profile: Any, plan: Any, cost: CostModel, ranks: list[dict[str, Any]]) -> None:
    """Each rank's actions, start-end in ms from the step's start (the median over the first
    launch's steps, the wait for inputs included), beside the simulator's overlap clock for the
    plan (its compute actions only: the per-step cost, the sums and the optimizer come after)."""
    from lightning_mmpp.core.simulator import simulate
    from lightning_mmpp.plan.sharing import planned_schedule

    built = planned_schedule(plan.layout(), plan.num_microbatches, plan.schedule, cost, cost.no_backward)
    result = simulate(built, plan.layout(), cost.forward, cost.backward, mode="overlap", input_cost=cost.input,
                      weight_cost=cost.weight)
    simulated: dict[int, list[str]] = {}
    for rank, start, end, action in sorted(result.computes, key=lambda c: c[1]):
        simulated.setdefault(rank, []).append(f"{action} {start * 1e3:.1f}-{end * 1e3:.1f}")
    for rank, worker in enumerate(ranks):
        real = [f"{name} {start * 1e3:.1f}-{end * 1e3:.1f}" for name, start, end in worker["timeline"]]
        print(f"   rank {rank} real:      " + "; ".join(real))
        print(f"   rank {rank} simulated: " + "; ".join(simulated.get(rank, [])))


if __name__ == "__main__":
    main()
