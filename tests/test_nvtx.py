"""NVTX ranges per action (Nsight Systems): off and free by default, named by action, module,
stage and microbatch when on, balanced push / pop; the real ``torch.cuda.nvtx`` where CUDA exists."""

from __future__ import annotations

import json
import os
from collections import Counter
from typing import Any

import lightning as L
import pytest
import torch

from lightning_mmpp import ModulePlacement, MultiModulePipelineStrategy
from lightning_mmpp.core.actions import Compute
from lightning_mmpp.core.schedule import build_schedule
from lightning_mmpp.engine import trace
from lightning_mmpp.engine.trace import NULL_TRACER, PHASE_SPANS, Tracer, nvtx_range_name, tracer_for
from lightning_mmpp.errors import PipelineConfigError
from tests.dist import TEST_DEVICE, require_ranks, requires_cuda, run_distributed, test_accelerator
from tests.models import MultiModalModel, make_loader

P = ModulePlacement
TOPOLOGY = {"enc_a": ["llm"], "llm": []}
PLACEMENTS = {"enc_a": P(), "llm": P()}  # rank 0: enc_a, rank 1: llm
M = 2
STEPS = 2


class FakeNvtx:
    """A ``range_push`` / ``range_pop`` pair that records the ranges and checks their nesting."""

    def __init__(self, real: Any = None) -> None:
        self.pushed: list[str] = []
        self.depth = 0
        self.real = real  # (push, pop) to delegate to, or None

    def push(self, name: str) -> int:
        self.pushed.append(name)
        self.depth += 1
        return self.real[0](name) if self.real else self.depth - 1

    def pop(self) -> int:
        assert self.depth > 0, "range_pop without a range_push"
        self.depth -= 1
        return self.real[1]() if self.real else self.depth

    def install(self, monkeypatch: Any = None) -> None:
        if monkeypatch is not None:
            monkeypatch.setattr(torch.cuda.nvtx, "range_push", self.push)
            monkeypatch.setattr(torch.cuda.nvtx, "range_pop", self.pop)
        else:  # inside a worker process: nothing to restore
            torch.cuda.nvtx.range_push, torch.cuda.nvtx.range_pop = self.push, self.pop


class _NoCuda:
    """Stands in for the ``torch`` module inside ``trace``: any ``torch.cuda`` access fails."""

    def __getattr__(self, name: str) -> Any:
        if name == "cuda":
            raise AssertionError("torch.cuda touched with NVTX off")
        return getattr(torch, name)


def _spans(tracer: Any) -> None:
    with tracer.span("forward", "llm", microbatch=3, stage=1):
        with tracer.span("exchange", "comm", sends=2, recvs=1):
            pass
    with pytest.raises(ValueError), tracer.span("backward_input", "enc_a", microbatch=0, stage=0):
        raise ValueError("a failing action still pops its range")


def test_off_by_default_calls_no_torch_cuda(monkeypatch):
    monkeypatch.delenv(trace.NVTX_ENV, raising=False)
    monkeypatch.setattr(trace, "torch", _NoCuda())
    assert tracer_for(0, None) is NULL_TRACER
    _spans(NULL_TRACER)
    on_cpu = tracer_for(0, "unused-dir", device="cpu")  # tracing on a CPU rank: events, no NVTX
    assert isinstance(on_cpu, Tracer) and on_cpu.enabled and not on_cpu.nvtx
    _spans(on_cpu)
    assert [e["name"] for e in on_cpu.events] == ["exchange", "forward", "backward_input"]
    monkeypatch.setenv(trace.NVTX_ENV, "0")
    assert not Tracer(0, device="cuda").nvtx  # MMPP_NVTX=0 wins over a CUDA device
    assert tracer_for(0, None, device="cuda") is NULL_TRACER


def test_range_names_and_nesting_with_a_fake_nvtx(monkeypatch):
    fake = FakeNvtx()
    fake.install(monkeypatch)
    monkeypatch.delenv(trace.NVTX_ENV, raising=False)
    tracer = Tracer(0, nvtx=True)
    assert tracer.nvtx and fake.pushed == ["lightning_mmpp rank 0"] and fake.depth == 0  # the probe
    _spans(tracer)
    assert fake.pushed[1:] == ["forward llm microbatch=3 stage=1", "exchange comm sends=2 recvs=1",
                               "backward_input enc_a microbatch=0 stage=0"]
    assert fake.depth == 0
    assert len(tracer.events) == 3  # recording is unchanged

    # MMPP_NVTX=1 without trace_dir: ranges only, nothing recorded
    monkeypatch.setenv(trace.NVTX_ENV, "1")
    only = tracer_for(1, None, device="cpu")
    assert isinstance(only, Tracer) and only.nvtx and not only.enabled
    _spans(only)
    assert fake.pushed[-3:] == fake.pushed[1:4] and only.events == [] and fake.depth == 0
    assert Tracer(0, device="cpu").nvtx  # the environment asks, whatever the device

    monkeypatch.setenv(trace.NVTX_ENV, "yes")
    with pytest.raises(PipelineConfigError, match="MMPP_NVTX='yes'"):
        tracer_for(0, None)


@pytest.mark.skipif(torch.version.cuda is not None, reason="a CUDA build of torch records NVTX ranges")
def test_nvtx_on_a_cpu_build_of_torch_is_refused_naming_the_fix(monkeypatch):
    monkeypatch.delenv(trace.NVTX_ENV, raising=False)
    with pytest.raises(PipelineConfigError, match="use a CUDA build of torch, or turn them off"):
        Tracer(0, nvtx=True)


def test_the_engine_takes_nvtx_without_a_trace(monkeypatch):
    """``PipelineEngine(nvtx=True)`` with no trace_dir: refused on a CPU build of torch (naming the
    fix); through a stand-in, one range per action and nothing recorded."""
    from lightning_mmpp import ModulePlacement, PipelineEngine, PipelineLayout

    monkeypatch.delenv(trace.NVTX_ENV, raising=False)
    layout = PipelineLayout({m: ModulePlacement(rank_offset=0) for m in TOPOLOGY}, TOPOLOGY)  # one rank
    if torch.version.cuda is None:
        with pytest.raises(PipelineConfigError, match="use a CUDA build of torch"):
            PipelineEngine(MultiModalModel(TOPOLOGY), layout, 2, nvtx=True)
    fake = FakeNvtx()
    fake.install(monkeypatch)
    engine = PipelineEngine(MultiModalModel(TOPOLOGY), layout, 2, nvtx=True)
    engine.step(next(iter(make_loader(TOPOLOGY, 4, 4))))
    engine.close()
    assert fake.depth == 0 and engine.tracer.events == []
    assert sum(name.startswith("forward ") for name in fake.pushed) == 2 * len(TOPOLOGY), fake.pushed


def _fit_with_fake_nvtx(rank: int, world: int, trace_dir: str) -> list[str]:
    os.environ[trace.NVTX_ENV] = "1"
    fake = FakeNvtx()
    fake.install()
    strategy = MultiModulePipelineStrategy(PLACEMENTS, TOPOLOGY, num_microbatches=M, schedule="zero_bubble",
                                           trace_dir=trace_dir)
    trainer = L.Trainer(accelerator=test_accelerator(), devices=world, strategy=strategy, max_steps=STEPS,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(MultiModalModel(TOPOLOGY), make_loader(TOPOLOGY, 8, 8 * STEPS))
    assert fake.depth == 0, f"{fake.depth} NVTX range(s) left open"
    return fake.pushed


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_pipelined_fit_pushes_one_named_range_per_traced_action(tmp_path):
    """Every span of the real runtime (forward, backward_input, backward_weight, exchange, waits,
    reductions) is one NVTX range named after what the trace recorded, on every rank."""
    require_ranks(2)
    layout = MultiModulePipelineStrategy(PLACEMENTS, TOPOLOGY, num_microbatches=M).layout
    pushed = run_distributed(_fit_with_fake_nvtx, 2, str(tmp_path), timeout=100, init_pg=False)
    schedule = build_schedule(layout, M, "zero_bubble")
    phases: set[str] = set()
    for rank in range(2):
        names = pushed[rank]
        assert names[0] == f"lightning_mmpp rank {rank}"
        with open(tmp_path / f"trace_rank{rank}.json") as f:
            events = [e for e in json.load(f)["traceEvents"] if e["ph"] == "X"]
        spans = [e for e in events if e["name"] not in ("recv", "optimizer_step")]  # recorded after the fact
        expected = Counter(
            nvtx_range_name(e["name"], e["cat"], {k: v for k, v in e["args"].items() if k != "step"}) for e in spans)
        assert Counter(names[1:]) == expected
        computes = Counter(n for n in names if n.split()[0] in PHASE_SPANS.values())
        (slot,) = layout.slots(rank)
        assert computes == Counter({
            nvtx_range_name(PHASE_SPANS[a.phase], a.module, {"microbatch": a.microbatch, "stage": slot.stage}): STEPS
            for a in schedule.for_rank(rank) if isinstance(a, Compute)
        })
        phases |= {n.split()[0] for n in computes}
        assert any(n.startswith("exchange comm sends=") for n in names), names
    # zero_bubble: forward, and the split backward (I and W) of llm; enc_a needs no input gradient (lone W)
    assert phases == {"forward", "backward_input", "backward_weight"}, phases


@requires_cuda
def test_real_nvtx_ranges_on_cuda(monkeypatch):
    """On CUDA a tracer pushes real ``torch.cuda.nvtx`` ranges, by default where tracing is on."""
    assert TEST_DEVICE == "cuda"
    monkeypatch.delenv(trace.NVTX_ENV, raising=False)
    counting = FakeNvtx(real=(torch.cuda.nvtx.range_push, torch.cuda.nvtx.range_pop))
    counting.install(monkeypatch)
    tracer = tracer_for(0, "unused-dir", device=torch.device("cuda", 0))
    assert isinstance(tracer, Tracer) and tracer.nvtx
    x = torch.randn(64, 64, device="cuda")
    with tracer.span("forward", "llm", microbatch=0, stage=0):
        y = x @ x
        with tracer.span("exchange", "comm", sends=1, recvs=0):
            y = y + 1
    torch.cuda.synchronize()
    assert counting.pushed == ["lightning_mmpp rank 0", "forward llm microbatch=0 stage=0",
                               "exchange comm sends=1 recvs=0"]
    assert counting.depth == 0 and [e["name"] for e in tracer.events] == ["exchange", "forward"]
