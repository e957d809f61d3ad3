"""How much a memory-bound layer slows when several processes run it at once on this machine.

    python benchmarks/memory_sharing.py                          # 32 x 16384 floats, 1-4 processes
    python benchmarks/memory_sharing.py --rows 64 --procs 1 2 --iters 500

Each of ``P`` processes (forked, one intra-op thread each) runs, after a barrier, ``--iters``
forward + backward passes of ``x * scale + state.mean()`` on a ``--rows`` x ``--width`` fp32
input (the held-out models' layer of ``bench_plan.py``: an elementwise op that streams its
tensors through memory), and reports its wall and CPU milliseconds per pass. A profile times a
layer in one process alone; in a plan, the replicas of a data-parallel stage run the same layer
at the same moment. With up to as many processes as cores, wall above the one-process figure is
the memory bandwidth and caches the processes share (the planner's shared clock charges only
cores); beyond the cores, processes also wait for one. CI never runs this.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time
from typing import Any

import torch  # imported before forking: the workers start in a fraction of the time


def _work(rows: int, width: int, iters: int, results: Any, start: Any) -> None:
    torch.set_num_threads(1)
    x = torch.randn(rows, width, requires_grad=True)
    scale = torch.ones(width, requires_grad=True)
    state = torch.zeros(4096, requires_grad=True)
    for _ in range(5):  # warm the allocator and autograd
        (x * scale + state.mean()).backward(torch.ones(rows, width))
    start.wait()
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(iters):
        y = x * scale + state.mean()
        y.backward(torch.ones_like(y))
    results.put(((time.perf_counter() - wall) / iters * 1e3, (time.thread_time() - cpu) / iters * 1e3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--width", type=int, default=16384)
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--procs", type=int, nargs="+", default=[1, 2, 3, 4])
    args = parser.parse_args()
    ctx = mp.get_context("fork")
    print(f"x * scale + mean, forward + backward on {args.rows} x {args.width} fp32, {args.iters} passes per process")
    for procs in args.procs:
        results, start = ctx.Queue(), ctx.Barrier(procs)
        workers = [ctx.Process(target=_work, args=(args.rows, args.width, args.iters, results, start))
                   for _ in range(procs)]
        for w in workers:
            w.start()
        timed = sorted(results.get(timeout=600) for _ in workers)
        for w in workers:
            w.join()
        print(f"{procs} process(es): wall / CPU ms per pass: " + ", ".join(f"{a:.3f} / {c:.3f}" for a, c in timed))


if __name__ == "__main__":
    main()
