"""Activation memory: peak stashed bytes per rank, 1F1B vs GPipe, measured by the runtime.

    python benchmarks/bench_memory.py

Sleep stages (1 ms forward, 1 ms backward: only memory matters here) run by lightning_mmpp's
runtime in forked gloo processes; each microbatch is a float32 ``[8, 1024]`` activation
(32 KiB). For every rank the runtime reports ``StepResult.peak_stashed_bytes``: the largest
sum, over the microbatches it holds for a later backward, of the bytes of their stage output
and received inputs (distinct tensors) — the activations a pipeline schedule decides to keep
alive. Beside it: the measured peak count of stashed microbatches and the simulator's
predicted count (``simulate(...).peak_stashed``), which must agree.

Autograd's saved intermediates inside a stage scale with the same count; this measures the
boundary tensors only.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import OurPipeline, chain, machine, section, table, two_encoders  # noqa: E402
from lightning_mmpp.core.kinds import ScheduleName, SimulatorMode  # noqa: E402
from lightning_mmpp.core.schedule import build_schedule  # noqa: E402
from lightning_mmpp.core.simulator import simulate  # noqa: E402
from tests.dist import run_distributed  # noqa: E402

LAYOUTS = {"chain P=4": lambda: chain(4), "2 enc -> llm": two_encoders}
SCHEDULES = (ScheduleName.ONE_F_ONE_B, ScheduleName.GPIPE)
MB_SHAPE = (8, 1024)
KIB = 1024


def worker(rank: int, world: int, name: str, ms: tuple[int, ...], t: float) -> dict:
    out = {}
    for m in ms:
        pipe = OurPipeline(LAYOUTS[name](), rank, m, t, t, mb_shape=MB_SHAPE)
        for schedule in SCHEDULES:
            _, result = pipe.step(schedule)
            out[(m, schedule)] = (result.peak_stashed_bytes, result.peak_stashed)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ms", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--t", type=float, default=0.001, help="forward and backward seconds per stage")
    args = parser.parse_args()
    ms = tuple(args.ms)

    print(f"$ python benchmarks/bench_memory.py  (microbatch float32 {list(MB_SHAPE)} = "
          f"{MB_SHAPE[0] * MB_SHAPE[1] * 4 // KIB} KiB; {machine()})")
    headline = []
    for name, make in LAYOUTS.items():
        layout = make()
        per_rank = run_distributed(worker, layout.world_size, name, ms, args.t, timeout=300)
        ranks = " ".join(f"{slot.module}{slot.stage}" for r in range(layout.world_size) for slot in layout.slots(r))
        section(f"{name} (ranks: {ranks}): peak stashed activations per rank")
        rows = []
        for m in ms:
            totals = {}
            for schedule in SCHEDULES:
                sim = simulate(build_schedule(layout, m, schedule), layout, 1.0, 2.0, mode=SimulatorMode.EAGER).peak_stashed
                nbytes = [per_rank[r][(m, schedule)][0] for r in range(layout.world_size)]
                counts = tuple(per_rank[r][(m, schedule)][1] for r in range(layout.world_size))
                totals[schedule] = (sum(nbytes), max(nbytes))
                rows.append((m, schedule, tuple(b // KIB for b in nbytes), counts, sim,
                             "yes" if counts == sim else "NO", sum(nbytes) // KIB, max(nbytes) // KIB))
            (f_sum, f_max), (g_sum, g_max) = totals["1f1b"], totals["gpipe"]
            rows.append((m, "gpipe/1f1b", "", "", "", "", f"{g_sum / f_sum:.2f}x", f"{g_max / f_max:.2f}x"))
            headline.append((name, m, g_sum / f_sum, g_max / f_max))
        print(table(["m", "schedule", "peak KiB per rank", "measured count", "simulated count", "match",
                     "sum KiB", "max rank KiB"], rows))
    section("GPipe / 1F1B peak stashed bytes")
    print(table(["layout", "m", "sum over ranks", "worst rank"], [(n, m, f"{a:.2f}x", f"{b:.2f}x") for n, m, a, b in headline]))
    print("-> 1F1B holds at most depth - stage index microbatches per rank whatever m; GPipe holds all m, "
          "so the ratio grows linearly with m.")


if __name__ == "__main__":
    main()
