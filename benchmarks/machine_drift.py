"""How steady this machine's compute speed is: the same work timed again every few seconds.

    python benchmarks/machine_drift.py                    # 150 s, a row every 5 s
    python benchmarks/machine_drift.py --seconds 60 --interval 2

Each row is the median of 30 runs, on one thread, of three kinds of work: the README example's
language model forward on 128 samples (many small tensor operations), 20 products of 256 x 256
matrices (one large kernel each), and a pure Python loop (no torch). The spread of a column over
the rows is how far one measurement on this machine can move with nothing of ours changing: a
planner's prediction cannot be judged closer than that, for a model whose step is that kind of
work. CI never runs this.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from lightning_mmpp.plan.target import load_target  # noqa: E402

RUNS = 30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=150.0)
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between rows")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model_class, batch, _ = load_target(os.path.join(ROOT, "examples", "train_multimodal.py") + ":VisionAudioLM", 128)
    model = model_class().train()
    a, b = torch.randn(256, 256), torch.randn(256, 256)

    def lm_forward() -> float:
        upstream = {"vision": model.vision(batch["image"]), "audio": model.audio(batch["audio"])}
        start = time.perf_counter()
        model.llm(model.pipeline_inputs("llm", batch, upstream))
        return time.perf_counter() - start

    def matmuls() -> float:
        start = time.perf_counter()
        for _ in range(20):
            a @ b
        return time.perf_counter() - start

    def python_loop() -> float:
        start, total = time.perf_counter(), 0
        for i in range(100_000):
            total += i
        return time.perf_counter() - start

    rows: list[list[float]] = []
    end = time.monotonic() + args.seconds
    print("time      LM forward ms  20 matmuls ms  Python loop ms  load")
    while time.monotonic() < end:
        row = [statistics.median(work() for _ in range(RUNS)) * 1e3 for work in (lm_forward, matmuls, python_loop)]
        rows.append(row)
        print(f"{time.strftime('%H:%M:%S')}  {row[0]:13.3f}  {row[1]:13.3f}  {row[2]:14.3f}  {os.getloadavg()[0]:.2f}",
              flush=True)
        time.sleep(args.interval)
    for name, column in zip(("LM forward", "20 matmuls", "Python loop"), zip(*rows)):
        low, high = min(column), max(column)
        print(f"{name}: {low:.3f}-{high:.3f} ms over {len(column)} rows, max/min {high / low:.3f}")


if __name__ == "__main__":
    main()
