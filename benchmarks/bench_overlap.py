"""Transfers beside compute: step time with a large payload per transfer vs a small one.

    python benchmarks/bench_overlap.py

Pass-through sleep stages (forward ``--tf``, backward ``--tb`` seconds; the payload is handed
on untouched, so only the transfers grow with its size) on a ``--pp``-stage chain, 1F1B with
``--m`` microbatches, run by lightning_mmpp's runtime in forked gloo processes. Every
transfer (activation forward, gradient backward) carries ``--small-kib`` KiB or ``--large-mib``
MiB of fp32. Two runtime modes, all four runs interleaved round by round in one launch:

* ``overlap`` (the default): an exchange posts its transfers and returns; a compute waits only
  for the receives it consumes;
* ``blocking``: every exchange waits for its receives (and the previous sends) before the next
  action.

Step time = median over the timed steps of the slowest rank. The ideal is ``(m + pp - 1)(tf + tb)``.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import OurPipeline, chain, interleaved, machine, median, section, table  # noqa: E402
from tests.dist import run_distributed  # noqa: E402

KIB = 1024


def worker(rank: int, world: int, m: int, tf: float, tb: float, sizes: dict[str, int], rounds: int,
           steps: int) -> dict[str, list[float]]:
    runs = {}
    for label, nbytes in sizes.items():
        rows = max(1, nbytes // (4 * 1024))
        for overlap in (True, False):
            pipe = OurPipeline(chain(world), rank, m, tf, tb, mb_shape=(rows, 1024), overlap=overlap,
                               pass_through=True)
            runs[f"{label} {'overlap' if overlap else 'blocking'}"] = (lambda p=pipe: p.step()[0])
    return interleaved(runs, rounds, steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--m", type=int, default=8)
    parser.add_argument("--tf", type=float, default=0.020)
    parser.add_argument("--tb", type=float, default=0.040)
    parser.add_argument("--small-kib", type=float, default=16)
    parser.add_argument("--large-mib", type=float, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    sizes = {f"{args.small_kib:g} KiB": int(args.small_kib * KIB), f"{args.large_mib:g} MiB": int(args.large_mib * KIB * KIB)}
    print(f"$ python benchmarks/bench_overlap.py --pp {args.pp} --m {args.m} --tf {args.tf} --tb {args.tb} "
          f"--small-kib {args.small_kib:g} --large-mib {args.large_mib:g} --rounds {args.rounds} --steps {args.steps}")
    print(f"({machine()})")
    times = run_distributed(worker, args.pp, args.m, args.tf, args.tb, sizes, args.rounds, args.steps,
                            timeout=900)[0]
    ideal = (args.m + args.pp - 1) * (args.tf + args.tb)
    small, large = sizes
    rows = []
    for mode in ("overlap", "blocking"):
        s, l = median(times[f"{small} {mode}"]), median(times[f"{large} {mode}"])
        rows.append((mode, f"{s * 1000:.1f}", f"{l * 1000:.1f}", f"{l / s:.3f}", f"{s / ideal:.3f}", f"{l / ideal:.3f}"))
    section(f"1F1B, {args.pp}-stage chain, m={args.m}, ideal {ideal * 1000:.0f} ms")
    print(table(["runtime", f"{small} ms", f"{large} ms", "large / small", "small / ideal", "large / ideal"], rows))


if __name__ == "__main__":
    main()
