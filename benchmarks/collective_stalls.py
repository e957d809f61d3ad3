"""How often a tiny collective stalls on this machine: the latency of a 16-byte all-reduce between two ranks.

    python benchmarks/collective_stalls.py                 # 2 ranks, 200 all-reduces per case
    python benchmarks/collective_stalls.py --rounds 500
    python benchmarks/collective_stalls.py --after-gaps --world-size 4   # what a step's collective costs

Two local processes (gloo, one thread each) run, after a barrier, an asynchronous all-reduce of
four floats and wait for it, ``--rounds`` times per case:

* ``together``: both ranks launch at once and only wait;
* ``one late``: rank 1 computes for 3 ms (matrix products) before it launches, as a rank whose
  pipeline ends later does before a step's metric all-reduce;
* ``compute after launch``: both launch at once, then compute for 1 ms before waiting, as a
  rank's logging runs while its all-reduce is in flight.

Printed per case and rank: the 10th percentile, the median and the 90th percentile of the
launch and of the whole (launch to completion), and the share of rounds whose whole ran more
than 2 ms over the median (stalled). The steps ``--validate`` measures hold several
such hand-offs between a rank's main thread and gloo's threads, so a machine whose 90th
percentile sits milliseconds above its median stalls some steps by that much, whatever the
planner predicts. Such a stall is not priced by the cost model. On the 2-core VM of
benchmarks/README.md (Linux 6.18, HZ=250, no kernel preemption) the stall is one scheduler tick,
about 4 ms.

``--after-gaps``: ``--world-size`` ranks time all-reduces of 256 B, 256 KiB and 2 MiB call by
call (the slowest rank's time per call), 60 per case: back to back; after 2 ms and 10 ms of
sleep on every rank (a step's collective after a layer that waits); and after 2 ms of busy
spinning (after a layer that computes). Printed: median, mean and 10th percentile. The
calibration times its collectives after a 2 ms sleep and charges the mean
(``lightning_mmpp.plan.measure._after_gaps``). CI never runs this.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.common import quantiles  # noqa: E402
from lightning_mmpp.plan.launch import run_local  # noqa: E402

# case: (ms rank 1 computes before it launches, ms both compute between launch and wait)
CASES = {"together": (0.0, 0.0), "one late": (3.0, 0.0), "compute after launch": (0.0, 1.0)}
STALL_S = 0.002  # a round counts as stalled this far over its case's median


def _quantiles(values: list[float]) -> str:
    return " / ".join(f"{v * 1e3:5.2f}" for v in quantiles(values))


def _worker(rank: int, world: int, rounds: int) -> dict[str, str]:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    a = torch.randn(128, 128)

    def compute(ms: float) -> None:
        end = time.perf_counter() + ms / 1e3
        while time.perf_counter() < end:
            a @ a

    out = {}
    for name, (late_ms, after_ms) in CASES.items():
        launches, totals = [], []
        for _ in range(rounds):
            dist.barrier()
            if rank == 1:
                compute(late_ms)
            vector = torch.zeros(4)
            start = time.perf_counter()
            work = dist.all_reduce(vector, async_op=True)
            launched = time.perf_counter()
            compute(after_ms)
            work.wait()
            launches.append(launched - start)
            totals.append(time.perf_counter() - start)
        median = statistics.median(totals)
        stalled = sum(t > median + STALL_S for t in totals) / len(totals)
        out[name] = f"launch {_quantiles(launches)}   whole {_quantiles(totals)}   stalled {stalled:4.0%}"
    dist.destroy_process_group()
    return out


GAP_SIZES = (256, 256 * 1024, 2 * 1024 * 1024)
GAP_CASES = ("back to back", "sleep 2 ms", "sleep 10 ms", "spin 2 ms")
GAP_CALLS = 60


def _gap_worker(rank: int, world: int) -> list[str]:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    lines = []
    for size in GAP_SIZES:
        buf = torch.zeros(size // 4)
        for _ in range(3):
            dist.all_reduce(buf)
        cells = []
        for case in GAP_CASES:
            times = []
            for _ in range(GAP_CALLS):
                if case.startswith("sleep"):
                    time.sleep(float(case.split()[1]) / 1e3)
                elif case.startswith("spin"):
                    end = time.perf_counter() + 0.002
                    while time.perf_counter() < end:
                        pass
                start = time.perf_counter()
                dist.all_reduce(buf)
                times.append(time.perf_counter() - start)
            slowest = torch.tensor(times, dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            per_call = slowest.tolist()
            cells.append(f"{statistics.median(per_call) * 1e3:.2f} / {statistics.fmean(per_call) * 1e3:.2f} / "
                         f"{quantiles(per_call)[0] * 1e3:.2f}")
        lines.append(f"| {world} | {size} | " + " | ".join(cells) + " |")
    dist.destroy_process_group()
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--after-gaps", action="store_true", help="all-reduces timed after idle or busy gaps")
    parser.add_argument("--world-size", type=int, default=2, help="--after-gaps: ranks")
    args = parser.parse_args()
    if args.after_gaps:
        print(f"$ python benchmarks/collective_stalls.py --after-gaps --world-size {args.world_size}   "
              f"(load average {os.getloadavg()[0]:.2f})")
        print("ms, median / mean / 10th percentile of the slowest rank per call")
        print("| ranks | bytes | " + " | ".join(GAP_CASES) + " |")
        print("|---|---|" + "---|" * len(GAP_CASES))
        print("\n".join(run_local(_gap_worker, args.world_size, timeout=600)[0]))
        return
    print(f"$ python benchmarks/collective_stalls.py --rounds {args.rounds}   (load average {os.getloadavg()[0]:.2f})")
    print("ms, 10th percentile / median / 90th percentile")
    results = run_local(_worker, 2, args.rounds, timeout=600)
    for name in CASES:
        for rank, result in enumerate(results):
            print(f"  {name:21s} rank {rank}: {result[name]}")


if __name__ == "__main__":
    main()
