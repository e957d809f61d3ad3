"""The prepared GPU check behind ``scripts/gpu_check.sh``: what one or more GPUs can verify in minutes.

Run it through the shell script (no arguments). It detects the GPUs and picks a mode:

* ``gpu`` (one or more CUDA devices): world size 1 with every module colocated on one rank,
  NCCL backend, through the equivalence layouts that fit one rank (1F1B and GPipe against
  single-process training on the same GPU), fit / validate / test / predict, ``bf16-mixed``,
  checkpoint save and exact resume, the memory check (``torch.cuda.max_memory_allocated``
  next to the theory), the planner's per-layer profile on the GPU and the NVTX ranges of a
  traced fit (real ``torch.cuda.nvtx``). With two or more GPUs also the multi-rank
  equivalence matrix on NCCL (one rank per GPU, ``tests/test_equivalence.py`` with
  ``MMPP_TEST_DEVICE=cuda``). In both modes the schedule benchmark (sleep stages on gloo
  processes: ours against ``torch.distributed.pipelining``).
* ``nogpu`` (no CUDA, or ``MMPP_GPU_CHECK_MODE=nogpu``): every check above has its plumbing
  twin, the same code on CPU / gloo: the single-rank checks on CPU (the memory check without
  ``max_memory_allocated``, the NVTX check through a recording stand-in for
  ``torch.cuda.nvtx``), the multi-rank matrix reduced to one 2-rank layout, the benchmark with
  1 ms sleeps. CI runs this whole mode (``tests/test_gpu_check.py``), so the script cannot rot.

``MMPP_GPU_CHECK_INJECT_FAILURE=<check>`` marks that check failed after it ran (the test uses
it to prove that a failure turns the exit status non-zero). Exit status: 0 when every check
passed or was skipped for a stated reason, 1 otherwise. A summary table is printed at the end:
one row per check (``PASS`` / ``FAIL`` / ``SKIP``, seconds, a one-line detail), then
``ALL PASSED`` or ``FAILED: <checks>``; a failed check's traceback or output is printed above.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


def _gpu_count() -> int:
    if os.environ.get("MMPP_GPU_CHECK_MODE", "").lower() == "nogpu":
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


GPUS = _gpu_count()
MODE = "gpu" if GPUS > 0 else "nogpu"
# tests.dist reads the device and backend from the environment at import
os.environ["MMPP_TEST_DEVICE"] = "cuda" if MODE == "gpu" else "cpu"
os.environ.pop("MMPP_TEST_BACKEND", None)
INJECT = os.environ.get("MMPP_GPU_CHECK_INJECT_FAILURE", "")

from tests.dist import TEST_BACKEND, run_distributed  # noqa: E402


@dataclass
class Outcome:
    name: str
    status: str  # PASS / FAIL / SKIP
    seconds: float
    detail: str


# --- single-rank checks (run inside one worker, world size 1) ---------------------------------


def _one_rank_layouts() -> dict[str, tuple[dict, dict, int, int]]:
    """Equivalence layouts that fit one rank: every module colocated on rank 0."""
    from lightning_mmpp import ModulePlacement as P
    from tests.test_equivalence import CHAIN3, LAYOUTS, ONE_ENC, TWO_ENC

    def colocated(topology: dict) -> dict:
        return {name: P(rank_offset=0) for name in topology}

    layouts = {"all_colocated_world1": LAYOUTS["all_colocated_world1"]}
    layouts["one_enc_colocated"] = (ONE_ENC, colocated(ONE_ENC), 4, 8)
    layouts["chain3_colocated"] = (CHAIN3, colocated(CHAIN3), 3, 6)
    two_sinks = {"enc_a": ["llm", "aux"], "llm": [], "aux": []}
    layouts["two_sinks_colocated"] = (two_sinks, colocated(two_sinks), 4, 8)
    if MODE == "nogpu":  # plumbing only: one layout is enough to exercise the path
        layouts = {"all_colocated_world1": layouts["all_colocated_world1"]}
    assert TWO_ENC  # imported for the reader: the layouts above come from the same matrix
    return layouts


def _trainer(devices: int, accelerator: str, **kwargs: Any) -> Any:
    import lightning as L

    base = dict(
        accelerator=accelerator, devices=devices, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    base.update(kwargs)
    return L.Trainer(**base)


def _params(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b), f"parameter names differ: {sorted(set(a) ^ set(b))}"
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def check_equivalence(accelerator: str) -> str:
    from lightning_mmpp import MultiModulePipelineStrategy
    from tests.models import MultiModalModel, make_loader

    worst = 0.0
    lines = []
    for name, (topology, placements, m, batch) in _one_rank_layouts().items():
        steps = 3
        reference = MultiModalModel(topology)
        _trainer(1, accelerator, max_steps=steps, limit_val_batches=0).fit(
            reference, make_loader(topology, batch, batch * steps))
        expected = _params(reference)
        for schedule in ("1f1b", "gpipe"):
            model = MultiModalModel(topology)
            strategy = MultiModulePipelineStrategy(placements, topology, num_microbatches=m, schedule=schedule)
            _trainer(1, accelerator, max_steps=steps, limit_val_batches=0, strategy=strategy).fit(
                model, make_loader(topology, batch, batch * steps))
            diff = _max_diff(_params(model), expected)
            worst = max(worst, diff)
            if diff > 1e-5:
                raise AssertionError(f"{name} {schedule}: max |param - single-process| = {diff:.3g} > 1e-5")
        lines.append(name)
    return f"{len(lines)} layout(s) x 1f1b/gpipe, max diff {worst:.1e}"


def check_loops(accelerator: str) -> str:
    from lightning_mmpp import MultiModulePipelineStrategy
    from lightning_mmpp import ModulePlacement as P
    from tests.models import MultiModalModel, make_loader

    topology = {"enc_a": ["llm"], "llm": []}
    placements = {"enc_a": P(rank_offset=0), "llm": P(rank_offset=0)}
    model = MultiModalModel(topology)
    strategy = MultiModulePipelineStrategy(placements, topology, num_microbatches=2)
    trainer = _trainer(1, accelerator, max_steps=2, strategy=strategy, limit_val_batches=1)
    trainer.fit(model, make_loader(topology, 8, 16), make_loader(topology, 8, 8))
    val = trainer.validate(model, make_loader(topology, 8, 8), verbose=False)[0]["val_loss"]
    test = trainer.test(model, make_loader(topology, 8, 8), verbose=False)[0]["test_loss"]
    if abs(val - test) > 1e-6:
        raise AssertionError(f"val_loss {val} != test_loss {test} on the same data")
    predictions = trainer.predict(model, make_loader(topology, 8, 16))
    assert predictions is not None and len(predictions) == 2, f"predict returned {predictions!r}"
    reference = MultiModalModel(topology)
    reference.load_state_dict({n: p for n, p in model.state_dict().items()}, strict=False)
    reference.to(predictions[0].device)
    batch = next(iter(make_loader(topology, 8, 16)))
    batch = {k: v.to(predictions[0].device) for k, v in batch.items()}
    with torch.no_grad():
        expected = reference.predict_step(batch, 0)
    torch.testing.assert_close(predictions[0], expected, rtol=1e-5, atol=1e-6)
    return f"val_loss {val:.4f} = test_loss, predict matches forward, shape {tuple(predictions[0].shape)}"


def check_bf16(accelerator: str) -> str:
    from lightning_mmpp import MultiModulePipelineStrategy
    from tests.models import MultiModalModel, make_loader

    topology, placements, m, batch = _one_rank_layouts()["all_colocated_world1"]
    steps = 3
    reference = MultiModalModel(topology)
    _trainer(1, accelerator, max_steps=steps, limit_val_batches=0, precision="bf16-mixed").fit(
        reference, make_loader(topology, batch, batch * steps))
    model = MultiModalModel(topology)
    strategy = MultiModulePipelineStrategy(placements, topology, num_microbatches=m)
    trainer = _trainer(1, accelerator, max_steps=steps, limit_val_batches=0, precision="bf16-mixed", strategy=strategy)
    trainer.fit(model, make_loader(topology, batch, batch * steps))
    loss = float(trainer.callback_metrics["train_loss"])
    diff = _max_diff(_params(model), _params(reference))
    if not (loss == loss) or diff > 2e-2:  # bf16 rounding differs between microbatched and whole batches
        raise AssertionError(f"bf16-mixed: loss {loss}, max param diff {diff:.3g} > 2e-2")
    return f"train_loss {loss:.4f}, max diff vs single-process bf16 {diff:.1e}"


def check_checkpoint(accelerator: str) -> str:
    import tempfile

    from lightning_mmpp import MultiModulePipelineStrategy
    from tests.models import MultiModalModel, make_loader

    topology, placements, m, batch = _one_rank_layouts()["all_colocated_world1"]

    def fit(epochs: int, ckpt_path: str | None = None) -> tuple[Any, Any]:
        model = MultiModalModel(topology, optimizer="adam")
        strategy = MultiModulePipelineStrategy(placements, topology, num_microbatches=m)
        trainer = _trainer(1, accelerator, max_epochs=epochs, limit_val_batches=0, strategy=strategy)
        trainer.fit(model, make_loader(topology, batch, batch * 2), ckpt_path=ckpt_path)
        return model, trainer

    with tempfile.TemporaryDirectory() as root:
        _, trainer = fit(1)
        path = os.path.join(root, "epoch1.ckpt")
        trainer.save_checkpoint(path)
        resumed, _ = fit(2, ckpt_path=path)
        straight, _ = fit(2)
    diff = _max_diff(_params(resumed), _params(straight))
    if diff != 0.0:
        raise AssertionError(f"resume is not exact: max param diff {diff:.3g}")
    return "save after epoch 1, resume to epoch 2 == 2 epochs straight (bit-exact)"


def check_memory(accelerator: str) -> str:
    """Peak device memory of a training step next to what the state and the stash should take."""
    from lightning_mmpp import MultiModulePipelineStrategy
    from lightning_mmpp import ModulePlacement as P
    from tests.models import MultiModalModel, make_loader

    topology = {"enc_a": ["llm"], "llm": []}
    placements = {"enc_a": P(rank_offset=0), "llm": P(rank_offset=0)}
    model = MultiModalModel(topology, llm_layers=8, optimizer="adam")
    strategy = MultiModulePipelineStrategy(placements, topology, num_microbatches=4)
    cuda = accelerator == "gpu"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    trainer = _trainer(1, accelerator, max_steps=2, limit_val_batches=0, strategy=strategy)
    trainer.fit(model, make_loader(topology, 64, 128))
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # parameters + gradients + two Adam moments; the stash bound is what the runtime measured
    theory = 4 * param_bytes
    if not cuda:
        return f"theory {theory / 1024:.1f} KiB (params+grads+Adam); max_memory_allocated: n/a without CUDA"
    measured = torch.cuda.max_memory_allocated() - base
    if measured < param_bytes:
        raise AssertionError(f"max_memory_allocated {measured} B is below the parameter bytes {param_bytes} B")
    return f"max_memory_allocated {measured / 1024:.1f} KiB vs theory {theory / 1024:.1f} KiB (+activations)"


def check_planner_profile(accelerator: str) -> str:
    """The planner's per-layer profile (forward/backward seconds, bytes) measured on this device."""
    import importlib.util

    if importlib.util.find_spec("lightning_mmpp.plan") is None:
        raise _Skip("lightning_mmpp.plan is not in this tree yet")
    from lightning_mmpp import plan

    if not hasattr(plan, "profile_model"):
        raise _Skip("lightning_mmpp.plan has no profile_model()")
    from tests.models import MultiModalModel, make_loader

    topology = {"enc_a": ["llm"], "enc_b": ["llm"], "llm": []}
    batch = next(iter(make_loader(topology, 8, 8)))
    profile = plan.profile_model(MultiModalModel(topology, llm_layers=8), batch,
                                 device="cuda" if accelerator == "gpu" else "cpu", repeats=2, topology=topology)
    layers = sum(len(cost.layers) for cost in profile.modules.values())
    return f"{layers} layers of {len(profile.modules)} modules profiled on {profile.device}"


def check_nvtx(accelerator: str) -> str:
    """A traced fit pushes one NVTX range per action, balanced, named by module, stage and
    microbatch: on CUDA through the real ``torch.cuda.nvtx`` (on by default with ``trace_dir=``),
    without CUDA through a recording stand-in (asked for with ``MMPP_NVTX=1``)."""
    import tempfile

    from lightning_mmpp import MultiModulePipelineStrategy
    from lightning_mmpp.engine.trace import NVTX_ENV
    from tests.models import MultiModalModel, make_loader
    from tests.test_nvtx import FakeNvtx

    topology, placements, m, batch = _one_rank_layouts()["all_colocated_world1"]
    cuda = accelerator == "gpu"
    real = (torch.cuda.nvtx.range_push, torch.cuda.nvtx.range_pop)
    recorder = FakeNvtx(real=real if cuda else None)
    saved_env = os.environ.pop(NVTX_ENV, None)
    if not cuda:
        os.environ[NVTX_ENV] = "1"
    recorder.install()
    steps = 2
    try:
        with tempfile.TemporaryDirectory() as trace_dir:
            strategy = MultiModulePipelineStrategy(placements, topology, num_microbatches=m, trace_dir=trace_dir)
            _trainer(1, accelerator, max_steps=steps, limit_val_batches=0, strategy=strategy).fit(
                MultiModalModel(topology), make_loader(topology, batch, batch * steps))
    finally:
        torch.cuda.nvtx.range_push, torch.cuda.nvtx.range_pop = real
        os.environ.pop(NVTX_ENV, None)
        if saved_env is not None:
            os.environ[NVTX_ENV] = saved_env
    if recorder.depth != 0:
        raise AssertionError(f"{recorder.depth} NVTX range(s) left open")
    for module in topology:
        for phase in ("forward", "backward"):
            name = f"{phase} {module} microbatch={m - 1} stage=0"
            if recorder.pushed.count(name) != steps:
                raise AssertionError(f"NVTX range {name!r} pushed {recorder.pushed.count(name)} times, not {steps}: "
                                     f"{recorder.pushed[:12]}")
    how = "torch.cuda.nvtx" if cuda else "a stand-in for torch.cuda.nvtx (no CUDA)"
    return f"{len(recorder.pushed)} balanced ranges through {how}, e.g. {recorder.pushed[1]!r}"


class _Skip(Exception):
    """A check that cannot run here, with the reason."""


SINGLE_RANK_CHECKS: dict[str, Callable[[str], str]] = {
    "equivalence (world 1, all colocated)": check_equivalence,
    "fit/validate/test/predict": check_loops,
    "bf16-mixed": check_bf16,
    "checkpoint save/resume": check_checkpoint,
    "memory (max_memory_allocated vs theory)": check_memory,
    "planner per-layer profile": check_planner_profile,
    "NVTX ranges of a traced fit": check_nvtx,
}


def _single_rank_worker(rank: int, world: int, inject: str) -> list[tuple[str, str, float, str]]:
    accelerator = "gpu" if os.environ["MMPP_TEST_DEVICE"] == "cuda" else "cpu"
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    out = []
    for name, check in SINGLE_RANK_CHECKS.items():
        start = time.monotonic()
        try:
            detail = check(accelerator)
            if inject and inject in name:  # after the check ran: the whole mode runs even then
                raise RuntimeError(f"failure injected by MMPP_GPU_CHECK_INJECT_FAILURE={inject!r} "
                                   f"(the check itself passed: {detail})")
            out.append((name, "PASS", time.monotonic() - start, detail))
        except _Skip as skip:
            out.append((name, "SKIP", time.monotonic() - start, str(skip)))
        except Exception as err:  # noqa: BLE001 - every failure becomes a table row
            traceback.print_exc()
            out.append((name, "FAIL", time.monotonic() - start, f"{type(err).__name__}: {err}"[:300]))
    return out


# --- multi-rank checks (subprocesses) ----------------------------------------------------------


def _subprocess(name: str, cmd: list[str], env: dict[str, str], timeout: float) -> Outcome:
    start = time.monotonic()
    print(f"\n$ {' '.join(cmd)}", flush=True)
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **env}, timeout=timeout, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    except subprocess.TimeoutExpired:
        return Outcome(name, "FAIL", time.monotonic() - start, f"no result after {timeout:.0f} s")
    print(proc.stdout[-4000:], flush=True)
    last = next((line for line in reversed(proc.stdout.strip().splitlines()) if line.strip()), "")
    status = "PASS" if proc.returncode == 0 else "FAIL"
    if INJECT and INJECT in name:
        status, last = "FAIL", f"failure injected by MMPP_GPU_CHECK_INJECT_FAILURE={INJECT!r}"
    return Outcome(name, status, time.monotonic() - start, last[:200])


@dataclass
class MultiRankCheck:
    """A subprocess check in both modes: the real one on GPUs and its plumbing twin without."""

    name: str
    gpu_cmd: list[str]
    gpu_env: dict[str, str]
    min_gpus: int
    plumbing_name: str
    plumbing_cmd: list[str]
    timeout: float


def _multi_rank_checks() -> list[MultiRankCheck]:
    py = sys.executable
    equivalence = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_equivalence.py"]
    # sleep stages on gloo / CPU processes in both modes: the schedules' timing, not the GPU's
    bench = [py, "benchmarks/bench_vs_torch.py", "--rounds", "1"]
    return [
        MultiRankCheck(f"equivalence matrix on NCCL ({GPUS} GPUs)", equivalence, {"MMPP_TEST_DEVICE": "cuda"}, 2,
                       "equivalence matrix (plumbing: 2 CPU ranks)",
                       equivalence + ["-x", "-k", "test_pipeline_matches_single_process and enc-llm]"], 300),
        MultiRankCheck("schedule benchmark: ours vs torch pipelining (sleep stages)", bench + ["--steps", "2"],
                       {"MMPP_TEST_DEVICE": "cpu"}, 0,
                       "schedule benchmark (plumbing: 1 ms sleep stages)",
                       bench + ["--steps", "1", "--m", "5", "--tf", "0.001", "--tb", "0.002"], 150),
    ]


def multi_rank_checks() -> list[Outcome]:
    outcomes = []
    for check in _multi_rank_checks():
        if MODE == "nogpu":
            outcomes.append(_subprocess(check.plumbing_name, check.plumbing_cmd, {"MMPP_TEST_DEVICE": "cpu"},
                                        check.timeout))
        elif GPUS < check.min_gpus:
            outcomes.append(Outcome(check.name, "SKIP", 0.0, f"needs >= {check.min_gpus} GPUs"))
        else:
            outcomes.append(_subprocess(check.name, check.gpu_cmd, check.gpu_env, check.timeout))
    return outcomes


def summary(outcomes: list[Outcome]) -> str:
    width = max(len(o.name) for o in outcomes)
    lines = [f"{'check':<{width}}  status  seconds  detail", f"{'-' * width}  ------  -------  ------"]
    lines += [f"{o.name:<{width}}  {o.status:<6}  {o.seconds:7.1f}  {o.detail}" for o in outcomes]
    return "\n".join(lines)


def main() -> int:
    start = time.monotonic()
    device = torch.cuda.get_device_name(0) if MODE == "gpu" else "none (CPU, gloo)"
    print(f"gpu_check: mode={MODE} gpus={GPUS} device={device} backend={TEST_BACKEND} torch={torch.__version__}",
          flush=True)
    outcomes: list[Outcome] = []
    try:
        (rows,) = run_distributed(_single_rank_worker, 1, INJECT, timeout=360, init_pg=False)
        outcomes += [Outcome(*row) for row in rows]
    except AssertionError as err:  # the worker died or hung
        outcomes.append(Outcome("single-rank checks", "FAIL", time.monotonic() - start, str(err)[-300:]))
    outcomes += multi_rank_checks()
    print(f"\n=== gpu_check summary (mode={MODE}, {GPUS} GPU(s), {time.monotonic() - start:.0f} s) ===")
    print(summary(outcomes))
    failed = [o.name for o in outcomes if o.status == "FAIL"]
    print(f"\n{'FAILED: ' + ', '.join(failed) if failed else 'ALL PASSED'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
