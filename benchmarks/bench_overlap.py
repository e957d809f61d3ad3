"""Transfers beside compute: step time with a large payload per transfer vs a small one.

    python benchmarks/bench_overlap.py

Pass-through sleep stages (forward ``--tf``, backward ``--tb`` seconds; the payload is handed
on untouched, and the sink's loss hands back a gradient made once, so only the transfers and the
framework's handling of them grow with its size) on a ``--pp``-stage chain, 1F1B with
``--m`` microbatches, run by lightning_mmpp's runtime in forked gloo processes. Every
transfer (activation forward, gradient backward) carries ``--small-kib`` KiB or ``--large-mib``
MiB of fp32. Two runtime modes, all four runs interleaved round by round in one launch:

* ``overlap`` (the default): an exchange posts its transfers and returns; a compute waits only
  for the receives it consumes;
* ``blocking``: every exchange waits for its receives (and the previous sends) before the next
  action.

Step time = median over the timed steps of the slowest rank. The ideal is ``(m + pp - 1)(tf + tb)``.

Where the rest of the time goes, in the same launch: the one-way time of a single gloo
transfer of each payload between two of the ranks (ping-pong, median), and the project's
simulator run with that time as the per-transfer latency: how many transfers sit on the
schedule's critical path, the step it predicts, and the least any schedule could pay (the
first microbatch's activations cross ``pp - 1`` links before the last stage can start, the
last gradients cross them back).

``--receive-pool`` adds, interleaved in the same rounds, the overlapped runtime with a fresh
receive buffer per message (the communicator's ``reuse_receive_buffers=False``) against the
default pooled buffers.

``--static`` adds, interleaved in the same rounds, the overlapped runtime with ``static_shapes``
(headers checked once per step instead of at each take; receives are posted ahead either way).

``--full-loss`` adds, interleaved in the same rounds, the overlapped runtime with the mean
square of the whole output as the sink's loss (what this benchmark used before 2026-12-07: its
forward and backward cost 5.8 ms at 4 MiB and 0.4 ms at 16 KiB here, on the critical path once
per microbatch; the model's compute, not the transfers').

``--direct`` adds, interleaved in the same rounds, the overlapped runtime with every leaf
copied into the packed buffer (the communicator's ``direct_leaf_bytes`` above every payload)
against the default, where a leaf of at least ``DIRECT_LEAF_BYTES`` (1 MiB) travels as a
transfer of its own, without a copy.

``--trace PNG`` also draws one overlapped step with the large payload (``plot_trace.py``:
receives in flight as thin bars under each rank's computes).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import OurPipeline, chain, interleaved, machine, median, section, table  # noqa: E402
from lightning_mmpp.core.schedule import build_schedule  # noqa: E402
from lightning_mmpp.core.simulator import simulate  # noqa: E402
from tests.dist import run_distributed  # noqa: E402

KIB = 1024


def one_way_seconds(rank: int, nbytes: int, repeats: int = 11) -> float:
    """Median one-way time of one ``nbytes`` gloo transfer between ranks 0 and 1 (ping-pong / 2);
    the other ranks only join the barriers."""
    import time

    import torch
    import torch.distributed as dist

    buf = torch.zeros(max(1, nbytes // 4))
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0)
            dist.send(buf, 0)
        times.append((time.perf_counter() - start) / 2)
    times.sort()
    return times[len(times) // 2]


def worker(rank: int, world: int, m: int, tf: float, tb: float, sizes: dict[str, int], rounds: int,
           steps: int, trace_dir: Optional[str], pool_ablation: bool = False, direct_ablation: bool = False,
           static_ablation: bool = False, loss_ablation: bool = False) -> tuple[dict[str, list[float]], dict[str, float]]:
    raw = {label: one_way_seconds(rank, nbytes) for label, nbytes in sizes.items()}
    runs = {}
    packed = 1 << 62  # direct_leaf_bytes above any payload: every leaf copied into the packed buffer
    # (mode, overlap, pooled receive buffers, direct_leaf_bytes, static shapes, full loss)
    modes = [("overlap", True, True, None, False, False), ("blocking", False, True, None, False, False)]
    if pool_ablation:
        modes.append(("overlap fresh", True, False, None, False, False))
    if direct_ablation:
        modes.append(("overlap packed", True, True, packed, False, False))
    if static_ablation:
        modes.append(("overlap static", True, True, None, True, False))
    if loss_ablation:
        modes.append(("overlap full loss", True, True, None, False, True))
    for label, nbytes in sizes.items():
        rows = max(1, nbytes // (4 * 1024))
        for mode, overlap, pooled, direct, static, full_loss in modes:
            pipe = OurPipeline(chain(world), rank, m, tf, tb, mb_shape=(rows, 1024), overlap=overlap,
                               pass_through=True, reuse_receive_buffers=pooled, direct_leaf_bytes=direct,
                               static_specs=static, full_loss=full_loss)
            runs[f"{label} {mode}"] = (lambda p=pipe: p.step()[0])
    times = interleaved(runs, rounds, steps)
    if trace_dir is not None:  # two traced steps with the large payload, overlapped
        rows = max(1, list(sizes.values())[-1] // (4 * 1024))
        pipe = OurPipeline(chain(world), rank, m, tf, tb, mb_shape=(rows, 1024), trace_dir=trace_dir,
                           pass_through=True)
        for _ in range(2):
            pipe.step()
        pipe.close()  # writes the trace
    return times, raw


def ablation(times: dict[str, list[float]], sizes: dict[str, int], steps: int, title: str, column: str,
             default: tuple[str, str], other: tuple[str, str]) -> None:
    """Print the default overlapped runtime against one changed setting, run in the same rounds."""
    small, large = sizes
    section(title)
    rows = []
    for mode, name in (default, other):
        s, l = median(times[f"{small} {mode}"]), median(times[f"{large} {mode}"])
        rows.append((name, f"{s * 1000:.1f}", f"{l * 1000:.1f}", f"{l / s:.3f}"))
    print(table([column, f"{small} ms", f"{large} ms", "large / small"], rows))
    ours, theirs = (times[f"{large} {mode}"] for mode, _ in (default, other))
    per_round = [median(ours[i:i + steps]) / median(theirs[i:i + steps]) for i in range(0, len(ours), steps)]
    print(f"{large}: {default[1]} / {other[1]} {median(ours) / median(theirs):.3f} "
          f"(per round: {' '.join(f'{r:.2f}' for r in per_round)})")


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
    parser.add_argument("--receive-pool", action="store_true",
                        help="also run the overlapped runtime without pooled receive buffers, interleaved")
    parser.add_argument("--direct", action="store_true",
                        help="also run the overlapped runtime with every leaf packed (no direct transfers), interleaved")
    parser.add_argument("--static", action="store_true",
                        help="also run the overlapped runtime with static_shapes (headers checked once per step), "
                             "interleaved")
    parser.add_argument("--full-loss", action="store_true",
                        help="also run the overlapped runtime with the mean square of the whole output as the "
                             "sink's loss (the benchmark's loss before 2026-12-07), interleaved")
    parser.add_argument("--trace", metavar="PNG", help="draw one overlapped step with the large payload")
    args = parser.parse_args()
    sizes = {f"{args.small_kib:g} KiB": int(args.small_kib * KIB), f"{args.large_mib:g} MiB": int(args.large_mib * KIB * KIB)}
    print(f"$ python benchmarks/bench_overlap.py --pp {args.pp} --m {args.m} --tf {args.tf} --tb {args.tb} "
          f"--small-kib {args.small_kib:g} --large-mib {args.large_mib:g} --rounds {args.rounds} --steps {args.steps}"
          + (" --receive-pool" if args.receive_pool else "") + (" --direct" if args.direct else "")
          + (" --static" if args.static else "") + (" --full-loss" if args.full_loss else ""))
    print(f"({machine()})")
    trace_dir = tempfile.mkdtemp(prefix="overlap_trace_") if args.trace else None
    times, raw = run_distributed(worker, args.pp, args.m, args.tf, args.tb, sizes, args.rounds, args.steps,
                                 trace_dir, args.receive_pool, args.direct, args.static, args.full_loss, timeout=900)[0]
    ideal = (args.m + args.pp - 1) * (args.tf + args.tb)
    small, large = sizes
    rows = []
    for mode in ("overlap", "blocking"):
        s, l = median(times[f"{small} {mode}"]), median(times[f"{large} {mode}"])
        rows.append((mode, f"{s * 1000:.1f}", f"{l * 1000:.1f}", f"{l / s:.3f}", f"{s / ideal:.3f}", f"{l / ideal:.3f}"))
    section(f"1F1B, {args.pp}-stage chain, m={args.m}, ideal {ideal * 1000:.0f} ms")
    print(table(["runtime", f"{small} ms", f"{large} ms", "large / small", "small / ideal", "large / ideal"], rows))
    if args.receive_pool:
        ablation(times, sizes, args.steps, "overlapped, receive buffers pooled (default) vs a fresh buffer per message",
                 "receive buffers", ("overlap", "pooled"), ("overlap fresh", "fresh"))
    if args.direct:
        ablation(times, sizes, args.steps, "overlapped, leaves >= 1 MiB sent direct (default) vs every leaf packed",
                 "large leaves", ("overlap", "direct"), ("overlap packed", "packed"))
    if args.static:
        ablation(times, sizes, args.steps, "overlapped, shapes free (default) vs static_shapes (headers checked "
                 "once per step)", "shapes", ("overlap", "free"), ("overlap static", "static"))
    if args.full_loss:
        ablation(times, sizes, args.steps, "overlapped, sink loss made once (default) vs the mean square of the "
                 "whole output", "sink loss", ("overlap", "made once"), ("overlap full loss", "mean square"))
    layout = chain(args.pp)
    schedule = build_schedule(layout, args.m, "1f1b")
    section("one gloo transfer, and the simulator with it as the per-transfer latency")
    rows = []
    for label in sizes:
        latency = raw[label]
        predicted = simulate(schedule, layout, args.tf, args.tb, mode="eager", latency=latency).step_time
        floor = ideal + 2 * (args.pp - 1) * latency
        on_path = (predicted - ideal) / latency  # transfers on the critical path
        rows.append((label, f"{latency * 1000:.2f}", f"{on_path:.0f}", f"{predicted * 1000:.1f}",
                     f"{median(times[f'{label} overlap']) / predicted:.3f}", f"{floor * 1000:.1f}"))
    print(table(["payload", "one-way ms", "transfers on 1F1B path", "1F1B predicted ms", "overlap / predicted",
                 "any schedule >= ms"], rows))
    if trace_dir is not None:
        from benchmarks.plot_trace import load_trace, plot_step
        from lightning_mmpp.engine.trace import merge_traces

        events, names = load_trace(merge_traces(trace_dir, args.pp))
        last = [e for e in events if e["args"]["step"] == 1]
        span_ms = (max(e["ts"] + e["dur"] for e in last) - min(e["ts"] for e in last)) / 1000
        title = (f"1F1B, {args.pp} pass-through sleep stages (tf {args.tf * 1e3:g} ms, tb {args.tb * 1e3:g} ms), "
                 f"m={args.m}, {large} per transfer, overlapped: step {span_ms:.0f} ms")
        summary = plot_step(events, names, args.trace, step=1, title=title)
        section(f"where the traced step's time goes, {large} per transfer (overlapped, mean per event, all ranks)")
        rows = []
        for name, expected in (("forward", args.tf), ("backward", args.tb), ("exchange", 0.0), ("wait", 0.0)):
            durations = [e["dur"] / 1000 for e in last if e["name"] == name]
            mean = sum(durations) / len(durations) if durations else 0.0
            rows.append((name, len(durations), f"{mean:.1f}", f"{expected * 1e3:.0f}", f"{mean - expected * 1e3:.1f}"))
        print(table(["event", "count", "mean ms", "sleep ms", "excess ms"], rows))
        print(f"\nwrote {args.trace}: {summary['recv']} receives in flight drawn")


if __name__ == "__main__":
    main()
