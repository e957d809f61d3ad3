"""``python -m lightning_mmpp.plan``: profile a model (or read a profile) and print the best layouts.

    python -m lightning_mmpp.plan examples/train_multimodal.py:VisionAudioLM --world-size 8 --memory-limit 80GB
    python -m lightning_mmpp.plan --profile profile.json --world-size 64 --json
    python -m lightning_mmpp.plan examples/train_multimodal.py:VisionAudioLM --world-size 5 \
        --calibrate --calibration cal.json --validate 2

``--calibrate`` measures this machine's framework, link and collective costs first
(:func:`lightning_mmpp.plan.calibrate`, on ``--calibrate-ranks`` local processes) and writes them
to ``--calibration FILE`` when given; ``--calibration FILE`` alone reads a saved calibration.
``--tp 1 2 4`` lets the search give a module those tensor-parallel sizes (every module whose
model has the ``pipeline_parallelize`` hook, or only ``--tp-modules NAME ...``); ``--virtual 1 2``
lets it give a module 2 chunks per rank (``virtual_stages``; every module, or only
``--virtual-modules NAME ...``), scored under ``interleaved_1f1b`` (``zbv`` where ``--schedules``
lists ``zero_bubble``).
``--validate K`` then trains the top K plans a few steps through ``Trainer.fit`` on this
machine (``--world-size`` local processes, the sample batch at every step) and prints the
measured step beside the predicted one.

``script.py:ModelClass`` imports the script (its ``if __name__ == "__main__"`` block does not
run), builds ``ModelClass()`` and a sample batch of ``--batch-size`` samples from, in order:
a function ``sample_batch(batch_size)`` in the script, or the first ``Dataset`` class of the
script whose constructor takes the dataset size (``batch_size`` samples, collated by
``default_collate``). The topology is the model's ``pipeline_topology`` or the script's
``TOPOLOGY``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any, Optional

from lightning_mmpp.core.kinds import ScheduleName
from lightning_mmpp.errors import PipelineConfigError
from lightning_mmpp.plan.calibration import CALIBRATION_LAUNCHES, Calibration
from lightning_mmpp.plan.costs import ModelProfile
from lightning_mmpp.plan.search import format_bytes, plan_placements, plans_table
from lightning_mmpp.plan.target import ScriptModel, load_target

# --validate measures as benchmarks/bench_plan.py --accuracy does, whose figures the README quotes: on
# a 2-core VM a pure-dp step spreads +-7% within a launch (a 5-step median moves by up to 5%) and a
# whole launch can run a few percent off (the same plan 124-130 ms over six launches)
VALIDATE_STEPS = 15
VALIDATE_LAUNCHES = 3

_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}


def parse_bytes(text: str) -> float:
    """``"80GB"`` (10^9), ``"80GiB"`` (2^30), ``"2.5e9"`` -> bytes (a trailing ``/s`` is ignored)."""
    match = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([a-zA-Z]*)\s*(/s)?\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 80GB, 80GiB or 8e10")
    return float(match.group(1)) * _UNITS[match.group(2).lower()]


def profile_target(target: str, batch_size: int, device: str, repeats: Optional[int], bandwidth: Optional[float],
                   latency: Optional[float], calibration: Optional[Calibration] = None,
                   num_threads: Optional[int] = None) -> ModelProfile:
    """Profile ``script.py:ModelClass`` on a sample batch (see the module docstring)."""
    from lightning_mmpp.plan.profile import profile_model

    cls, batch, topology = load_target(target, batch_size)
    model = cls()
    topology = getattr(model, "pipeline_topology", None) or topology
    given = {} if repeats is None else {"repeats": repeats}
    return profile_model(model, batch, device=device, topology=topology, bandwidth_bytes_per_s=bandwidth,
                         latency_s=latency, calibration=calibration, num_threads=num_threads, **given)


def main(argv: Optional[list[str]] = None) -> int:
    """The command line; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m lightning_mmpp.plan", description=__doc__.splitlines()[0])
    parser.add_argument("target", nargs="?", help="path/to/script.py:ModelClass to profile")
    parser.add_argument("--profile", help="plan from a saved profile (JSON) instead of a model")
    parser.add_argument("--profile-out", help="write the measured profile to this JSON file")
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--memory-limit", type=parse_bytes, help="per rank, e.g. 80GB or 80GiB")
    parser.add_argument("--batch-size", type=int, help="global batch per step (default: the profiled batch, 32 "
                        "when profiling)")
    parser.add_argument("--microbatches", type=int, help="fix the microbatch count")
    parser.add_argument("--schedules", default=ScheduleName.ONE_F_ONE_B.value,
                        help="comma-separated: " + ",".join(s.value for s in ScheduleName))
    parser.add_argument("--top-k", type=int, default=5)
    parser.add_argument("--tp", type=int, nargs="+", default=[1], metavar="T",
                        help="tensor-parallel sizes to search, e.g. --tp 1 2 4 (modules whose model has the "
                        "pipeline_parallelize hook; default 1: none)")
    parser.add_argument("--tp-modules", nargs="+", metavar="MODULE",
                        help="only these modules may get the --tp sizes (the others keep tp=1)")
    parser.add_argument("--virtual", type=int, nargs="+", default=[1], metavar="V",
                        help="virtual stages (chunks per rank) to search, e.g. --virtual 1 2 (interleaved_1f1b, "
                        "or zbv when zero_bubble is listed, for the candidates with v > 1; default 1: none)")
    parser.add_argument("--virtual-modules", nargs="+", metavar="MODULE",
                        help="only these modules may get the --virtual counts (the others keep 1)")
    parser.add_argument("--tolerance", type=float, default=0.03,
                        help="the top plan is within 1 + this of an exhaustive search's best (0: exact, slower)")
    parser.add_argument("--device", default="cpu", help="where to profile")
    parser.add_argument("--repeats", type=int, help="timed runs per layer measurement (default: profile_model's)")
    parser.add_argument("--bandwidth", type=parse_bytes, help="link bandwidth per second, e.g. 25GB/s")
    parser.add_argument("--latency", type=float, help="seconds per message")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--calibrate", action="store_true", help="measure this machine's costs first (seconds)")
    parser.add_argument("--calibrate-ranks", type=int, help="processes to calibrate with (default: min(world size, 4))")
    parser.add_argument("--calibration", help="a calibration JSON file: written with --calibrate, read without")
    parser.add_argument("--validate", type=int, default=0, metavar="K",
                        help="train the top K plans a few steps through Trainer.fit here; print measured vs predicted")
    parser.add_argument("--validate-steps", type=int, default=VALIDATE_STEPS,
                        help=f"--validate: timed steps per plan and launch (default {VALIDATE_STEPS})")
    parser.add_argument("--launches", type=int, default=None, metavar="N",
                        help=f"separate process launches that --calibrate (default {CALIBRATION_LAUNCHES}) and "
                             f"--validate (default {VALIDATE_LAUNCHES}) "
                             "take the median over: on a shared CPU one launch can run a few percent off throughout")
    args = parser.parse_args(argv)
    try:
        calibration = _calibration(args)
        if calibration is not None and not args.json:
            print(calibration.describe())
        if args.validate and not args.target:
            parser.error("--validate needs script.py:ModelClass (a model to train), not only --profile")
        if args.profile:
            profile = ModelProfile.from_json(args.profile)
            if args.bandwidth:
                profile.bandwidth_bytes_per_s = args.bandwidth
            if args.latency is not None:
                profile.latency_s = args.latency
        elif args.target:
            profile = profile_target(args.target, args.batch_size or 32, args.device, args.repeats, args.bandwidth,
                                     args.latency, calibration, _profile_threads(args))
        else:
            parser.error("give script.py:ModelClass or --profile profile.json")
        if args.profile_out:
            profile.to_json(args.profile_out)
        plans = plan_placements(profile, args.world_size, args.microbatches, args.memory_limit,
                                tuple(s.strip() for s in args.schedules.split(",")), args.top_k,
                                batch_size=args.batch_size, tolerance=args.tolerance, calibration=calibration,
                                tp_options={m: args.tp for m in args.tp_modules} if args.tp_modules else args.tp,
                                virtual_options={m: args.virtual for m in args.virtual_modules}
                                if args.virtual_modules else args.virtual)
    except PipelineConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    measured = _validate(args, plans[:args.validate]) if args.validate else []
    if args.json:
        data = [p.to_dict() for p in plans]
        for entry, step in zip(data, measured):
            entry["measured_step_time_s"] = step.median_s
            entry["measured_launch_medians_s"] = list(step.launch_medians_s)
            entry["measured_low_s"] = step.low_s
        print(json.dumps({"plans": data}, indent=1))
        return 0
    limit = f", memory limit {format_bytes(args.memory_limit)} per rank" if args.memory_limit else ""
    print(f"{len(plans)} best plans for {args.world_size} ranks, global batch {plans[0].batch_size}{limit}:")
    print(plans_table(plans))
    if measured:
        launches = args.launches or VALIDATE_LAUNCHES
        print(f"\nmeasured here through Trainer.fit (median of {args.validate_steps} steps x {launches} launches, "
              f"slowest rank):")
        for i, (plan, step) in enumerate(zip(plans, measured)):
            low, high = step.spread_s
            print(f"#{i + 1}  predicted {plan.step_time_s * 1e3:.1f} ms  measured {step.median_s * 1e3:.1f} ms "
                  f"(launches {low * 1e3:.1f}-{high * 1e3:.1f})  measured/predicted {step.median_s / plan.step_time_s:.3f}"
                  f"  unstalled steps (10th percentile) {step.low_s * 1e3:.1f} ms: {step.low_s / plan.step_time_s:.3f}")
        print("(a median well above the unstalled steps: stalls the cost model does not price; see the README)")
    print()
    print("best plan:")
    print(plans[0].snippet())
    return 0


def _calibration(args: argparse.Namespace) -> Optional[Calibration]:
    """The calibration the command line asks for: measured (``--calibrate``), read, or none."""
    if args.calibrate:
        from lightning_mmpp.plan.measure import calibrate

        ranks = args.calibrate_ranks or min(args.world_size, 4)
        calibration = calibrate(ranks, args.device, launches=args.launches or CALIBRATION_LAUNCHES)
        if args.calibration:
            calibration.to_json(args.calibration)
        return calibration
    if args.calibration:
        if not os.path.isfile(args.calibration):
            raise PipelineConfigError(f"--calibration {args.calibration!r} is not a file; measure one with --calibrate.")
        return Calibration.from_json(args.calibration)
    return None


def _profile_threads(args: argparse.Namespace) -> Optional[int]:
    """Profile a CPU model with the threads one of ``--world-size`` local ranks gets."""
    if not args.device.startswith("cpu"):
        return None
    from lightning_mmpp.plan.launch import rank_threads

    return rank_threads(args.world_size)


def _validate(args: argparse.Namespace, plans: list[Any]) -> list[Any]:
    """The measured step of each plan (:class:`~lightning_mmpp.plan.validate.MeasuredStep`),
    trained here on the sample batch."""
    from lightning_mmpp.plan.validate import measure_steps

    _, batch, _ = load_target(args.target, plans[0].batch_size)
    path, _, cls_name = args.target.rpartition(":")
    make = ScriptModel(os.path.abspath(path), cls_name)
    return measure_steps([(make, batch, plan) for plan in plans], steps=args.validate_steps, device=args.device,
                         launches=args.launches or VALIDATE_LAUNCHES)


if __name__ == "__main__":
    sys.exit(main())
