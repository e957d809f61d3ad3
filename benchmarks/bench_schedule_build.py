"""How long building the schedules takes, and (against another checkout) that they are the same.

    python benchmarks/bench_schedule_build.py [--layouts 60] [--seed 1]
    python benchmarks/bench_schedule_build.py --against /path/to/other/lightning_mmpp/core/schedule.py

Random layouts of ``bench_schedule.py``'s DAG family (virtual stages included), each with a random
microbatch count; every schedule kind is built on each, plain, with V-shaped chunks and with some
modules frozen. Printed: the build time per kind (seconds in all, milliseconds per schedule).
With ``--against``, the same schedules are also built by that file's ``build_schedule`` (say,
``git show main:lightning_mmpp/core/schedule.py > /tmp/old_schedule.py``), every pair is checked
action for action, and both times are printed. No processes; CI never runs this.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import sys
import time
from types import ModuleType
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_schedule import SCHEDULE_KINDS, schedule_cases  # noqa: E402

from lightning_mmpp.core import schedule as ours  # noqa: E402
from lightning_mmpp.core.placement import PipelineLayout  # noqa: E402


def _load(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("other_schedule", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["other_schedule"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _timed(module: ModuleType, layout: PipelineLayout, m: int, kind: str, frozen: frozenset[str]) -> tuple[Any, float]:
    start = time.perf_counter()
    try:
        built: Any = module.build_schedule(layout, m, kind, no_backward_modules=frozen)
    except Exception as err:  # noqa: BLE001 - a kind that refuses a layout: compared by its message
        built = f"{type(err).__name__}: {err}"
    return built, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", type=int, default=60)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--against", help="another schedule.py to compare with (same schedules, its time)")
    args = parser.parse_args()
    other: Optional[ModuleType] = _load(args.against) if args.against else None
    seconds = {kind: 0.0 for kind in SCHEDULE_KINDS}
    other_seconds = {kind: 0.0 for kind in SCHEDULE_KINDS}
    counts = {kind: 0 for kind in SCHEDULE_KINDS}
    for layout, m, kind, no_backward in schedule_cases(random.Random(args.seed), args.layouts, max_microbatches=9):
        built, took = _timed(ours, layout, m, kind, no_backward)
        seconds[kind] += took
        counts[kind] += 1
        if other is not None:
            theirs, their_time = _timed(other, layout, m, kind, no_backward)
            other_seconds[kind] += their_time
            assert built == theirs, (kind, layout.placements, layout.topology, m, sorted(no_backward))
    print(f"$ python benchmarks/bench_schedule_build.py --layouts {args.layouts} --seed {args.seed}"
          + (f" --against {args.against}" if args.against else ""))
    header = "| kind | schedules | this tree s | ms each |" + (" other s | this / other |" if other else "")
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for kind in SCHEDULE_KINDS:
        row = f"| {kind} | {counts[kind]} | {seconds[kind]:.2f} | {seconds[kind] / counts[kind] * 1e3:.1f} |"
        if other is not None:
            row += f" {other_seconds[kind]:.2f} | {seconds[kind] / other_seconds[kind]:.3f} |"
        print(row)
    total, other_total = sum(seconds.values()), sum(other_seconds.values())
    print(f"all: {total:.2f} s" + (f"; other {other_total:.2f} s; this / other {total / other_total:.3f}; "
                                    f"every schedule identical" if other is not None else ""))


if __name__ == "__main__":
    main()
