"""Where a free-stage step's time goes: cProfile of one rank of a 4-stage 1F1B chain.

    python benchmarks/profile_free_stages.py [--rank 1] [--steps 30] [--top 12] [--torch]

The stages cost nothing (``tf = tb = 0``, microbatch float32 ``[8, 1024]``, m = 8), so the step
is framework and transport time only: the case where ``bench_vs_torch.py`` compares ours with
``torch.distributed.pipelining``. Four forked gloo processes; after 5 warm-up steps, ``--steps``
steps of rank ``--rank`` run under cProfile. Prints the mean step time with and without the
profiler's own cost (an unprofiled step of the same rank is timed first), the functions with
the most own time, and that time per step grouped into gloo calls (posting, waiting), the
stages' ``time.sleep(0)`` (a yield of the core), autograd, and the rest (Python: the runtime,
the communicator, packing, and the profiler's overhead on them). ``--torch`` profiles
``torch.distributed.pipelining``'s ``Schedule1F1B`` on the same stages instead (``bench_vs_torch.py``'s
runner), for a side-by-side reading.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import OurPipeline, chain, machine  # noqa: E402
from tests.dist import run_distributed  # noqa: E402

GROUPS = {
    "gloo wait": ("_distributed_c10d.wait",),
    "gloo post": ("_distributed_c10d.recv", "_distributed_c10d.send"),
    "sleep(0)": ("time.sleep",),
    "autograd": ("run_backward",),
}


class _TorchRun:
    """torch's ``Schedule1F1B`` on this rank's stage, with ``OurPipeline``'s ``step()``."""

    def __init__(self, rank: int, world: int) -> None:
        from benchmarks.bench_vs_torch import TorchPipeline

        self.pipe = TorchPipeline(rank, world, 8, 0.0, 0.0)

    def step(self) -> float:
        return self.pipe.step("1f1b")


def worker(rank: int, world: int, target: int, steps: int, top: int,
           use_torch: bool = False) -> tuple[float, float, dict[str, float], str]:
    import cProfile
    import pstats

    pipe = _TorchRun(rank, world) if use_torch else OurPipeline(chain(world), rank, 8, 0.0, 0.0)
    for _ in range(5):
        pipe.step()
    start = time.perf_counter()
    for _ in range(steps):
        pipe.step()
    plain = (time.perf_counter() - start) / steps
    profiler = cProfile.Profile()
    start = time.perf_counter()
    if rank == target:
        profiler.enable()
    for _ in range(steps):
        pipe.step()
    profiler.disable()
    profiled = (time.perf_counter() - start) / steps
    if rank != target:
        return plain, profiled, {}, ""
    stats = pstats.Stats(profiler)
    grouped = {name: 0.0 for name in GROUPS}
    total = 0.0
    for (filename, _, function), (_, _, own, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        total += own
        label = f"{filename}:{function}"
        for name, needles in GROUPS.items():
            if any(n in label for n in needles):
                grouped[name] += own
                break
    grouped["rest (Python)"] = total - sum(grouped.values())
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    return plain, profiled, {k: v / steps for k, v in grouped.items()}, out.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=1)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--torch", action="store_true", help="profile torch's Schedule1F1B instead of ours")
    args = parser.parse_args()
    print(f"$ python benchmarks/profile_free_stages.py --rank {args.rank} --steps {args.steps} --top {args.top}"
          + (" --torch" if args.torch else ""))
    print(f"({machine()})")
    plain, profiled, grouped, text = run_distributed(worker, 4, args.rank, args.steps, args.top, args.torch,
                                                     timeout=600)[args.rank]
    who = "torch Schedule1F1B" if args.torch else "ours"
    print(f"\n{who}, rank {args.rank}: step {plain * 1e3:.2f} ms unprofiled, {profiled * 1e3:.2f} ms under cProfile")
    for name, seconds in grouped.items():
        print(f"  {name:14s} {seconds * 1e3:6.2f} ms per step (profiled)")
    print(text[text.find("ncalls"):] if "ncalls" in text else text)


if __name__ == "__main__":
    main()
