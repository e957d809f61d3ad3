"""CPU time of the framework per step, per rank: free stages on the two-encoder -> LM layout.

    python benchmarks/bench_cpu_per_step.py [--steps 40]

``enc_a`` (pp=1, rank 0) and ``enc_b`` (pp=1, rank 1) -> ``llm`` (pp=2, ranks 2-3), 1F1B,
m = 8, every stage a :class:`~benchmarks.common.SleepStage` with ``tf = tb = 0``: a step is
framework work only. Prints, per rank, the median over ``--steps`` steps of the main thread's
CPU time (``time.thread_time``) in :meth:`~lightning_mmpp.PipelineEngine.run_pipeline`: the
Python and the gloo calls of the runtime and the communicator. CPU time moves less with the
load of a shared machine than wall time does (it still grows with contention for caches and
cores), so two trees can be compared by running this command in each, alternating, several
times, and taking medians. ``--calls`` prints instead the Python function calls per step of each
rank (``cProfile`` over ``--steps`` steps): a count the machine's load cannot move.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import P, OurPipeline, machine  # noqa: E402
from lightning_mmpp.core.placement import PipelineLayout  # noqa: E402
from tests.dist import run_distributed  # noqa: E402


def layout() -> PipelineLayout:
    return PipelineLayout({"enc_a": P(pp=1), "enc_b": P(pp=1), "llm": P(pp=2)},
                          {"enc_a": ["llm"], "enc_b": ["llm"], "llm": []})


def worker(rank: int, world: int, steps: int, calls: bool = False) -> float:
    pipe = OurPipeline(layout(), rank, 8, 0.0, 0.0)
    for _ in range(3):
        pipe.step()
    if calls:
        import cProfile
        import pstats

        profile = cProfile.Profile()
        profile.enable()
        for _ in range(steps):
            pipe.step()
        profile.disable()
        pipe.close()
        return pstats.Stats(profile).total_calls / steps  # type: ignore[attr-defined]
    cpu = []
    for _ in range(steps):
        start = time.thread_time()
        pipe.step()
        cpu.append(time.thread_time() - start)
    pipe.close()
    return statistics.median(cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--calls", action="store_true", help="Python function calls per step instead of CPU time")
    args = parser.parse_args()
    print(f"$ python benchmarks/bench_cpu_per_step.py --steps {args.steps}{' --calls' if args.calls else ''}  "
          f"({machine()})")
    per_rank = run_distributed(worker, 4, args.steps, args.calls, timeout=300)
    if args.calls:
        print("Python function calls per step, ranks 0-3:", " ".join(f"{c:.0f}" for c in per_rank))
        return
    print("CPU ms per step, ranks 0-3:", " ".join(f"{t * 1e3:.2f}" for t in per_rank))


if __name__ == "__main__":
    main()
