"""The timeline trace of a real multi-process fit: valid Chrome trace JSON that follows the schedule."""

from __future__ import annotations

import json
import os
from collections import Counter, defaultdict
from numbers import Number

import lightning as L
import pytest

from lightning_mmpp import ModulePlacement, MultiModulePipelineStrategy
from lightning_mmpp.core.actions import Compute, Exchange
from lightning_mmpp.core.schedule import build_schedule
from lightning_mmpp.engine.trace import PHASE_SPANS
from tests.dist import run_distributed
from tests.models import MultiModalModel, make_loader

pytestmark = pytest.mark.distributed  # every test here launches processes

P = ModulePlacement
STEPS = 2
M = 4
BATCH = 8
TOPOLOGY = {"enc_a": ["llm"], "enc_b": ["llm"], "llm": []}
# enc_a and enc_b colocated on rank 0 (a rank holding two modules), llm in two stages on ranks 1-2
PLACEMENTS = {"enc_a": P(rank_offset=0), "enc_b": P(rank_offset=0), "llm": P(pp=2)}


def _fit(rank: int, world: int, trace_dir: str) -> None:
    strategy = MultiModulePipelineStrategy(PLACEMENTS, TOPOLOGY, num_microbatches=M, trace_dir=trace_dir)
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=STEPS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0,
    )
    trainer.fit(MultiModalModel(TOPOLOGY), make_loader(TOPOLOGY, BATCH, BATCH * STEPS))


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    trace_dir = str(tmp_path_factory.mktemp("trace"))
    layout = MultiModulePipelineStrategy(PLACEMENTS, TOPOLOGY, num_microbatches=M).layout
    run_distributed(_fit, layout.world_size, trace_dir, timeout=60, init_pg=False)
    return trace_dir, layout


def _load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


@pytest.mark.timeout(90)
def test_merged_trace_is_valid_chrome_trace_json(traced):
    trace_dir, layout = traced
    data = _load(os.path.join(trace_dir, "trace.json"))
    assert isinstance(data, dict) and isinstance(data["traceEvents"], list)
    events = data["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert complete and all(e["ph"] in ("X", "M") for e in events)
    for e in complete:
        assert {"name", "ph", "ts", "dur", "pid", "tid", "args"} <= set(e), e
        assert isinstance(e["name"], str) and isinstance(e["args"], dict)
        assert isinstance(e["ts"], Number) and isinstance(e["dur"], Number) and e["dur"] >= 0, e
        assert e["pid"] in range(layout.world_size)
    named = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert named == {r: f"rank {r}" for r in range(layout.world_size)}
    assert {e["args"]["step"] for e in complete} == set(range(STEPS))
    for r in range(layout.world_size):
        per_rank = _load(os.path.join(trace_dir, f"trace_rank{r}.json"))["traceEvents"]
        assert {e["pid"] for e in per_rank} == {r}
        assert [e for e in events if e["pid"] == r] == per_rank  # the merge keeps every event of every rank
        names = Counter(e["name"] for e in per_rank if e["ph"] == "X")
        assert names["optimizer_step"] == STEPS and names["dp_allreduce"] == STEPS and names["exchange"] > 0


@pytest.mark.timeout(90)
def test_every_forward_has_one_later_backward_and_follows_the_schedule(traced):
    trace_dir, layout = traced
    events = [e for e in _load(os.path.join(trace_dir, "trace.json"))["traceEvents"] if e["ph"] == "X"]
    compute = [e for e in events if e["name"] in ("forward", "backward")]
    by_key = defaultdict(lambda: defaultdict(list))
    for e in compute:
        by_key[(e["pid"], e["cat"], e["args"]["microbatch"], e["args"]["step"])][e["name"]].append(e)
    for key, phases in by_key.items():
        assert len(phases["forward"]) == 1 and len(phases["backward"]) == 1, (key, dict(phases))
        fwd, bwd = phases["forward"][0], phases["backward"][0]
        assert bwd["ts"] >= fwd["ts"] + fwd["dur"], key

    schedule = build_schedule(layout, M, "1f1b")
    for rank in range(layout.world_size):
        held = {slot.module: slot.stage for slot in layout.slots(rank)}
        mine = sorted((e for e in compute if e["pid"] == rank), key=lambda e: e["ts"])
        forwards = Counter(e["cat"] for e in mine if e["name"] == "forward")
        assert forwards == {module: M * STEPS for module in held}, (rank, forwards)
        assert all(e["args"]["stage"] == held[e["cat"]] for e in mine)
        expected = [
            (a.phase, a.module, a.microbatch) for a in schedule.for_rank(rank) if isinstance(a, Compute)
        ]
        for step in range(STEPS):
            got = [(e["name"], e["cat"], e["args"]["microbatch"]) for e in mine if e["args"]["step"] == step]
            assert got == [(PHASE_SPANS[p], m, k) for p, m, k in expected], (rank, step)


@pytest.mark.timeout(90)
def test_receives_in_flight_are_on_track_1_and_end_before_their_consumer(traced):
    """Every cross-rank receive is one ``recv`` event on track 1, from its post to the moment its
    consumer has it; waits are apart from the computes (the compute span starts after them)."""
    trace_dir, layout = traced
    events = [e for e in _load(os.path.join(trace_dir, "trace.json"))["traceEvents"] if e["ph"] == "X"]
    recvs = [e for e in events if e["name"] == "recv"]
    assert recvs and all(e["tid"] == 1 and e["cat"] == "transfer" for e in recvs)
    assert all(e["tid"] == 0 for e in events if e["name"] != "recv")
    compute = {(e["pid"], e["cat"], e["args"]["microbatch"], e["args"]["step"], e["name"]): e
               for e in events if e["name"] in ("forward", "backward")}
    for e in recvs:
        a = e["args"]
        assert a["direction"] in ("forward", "backward") and a["peer"] != e["pid"], e
        consumer = a["dst"] if a["direction"] == "forward" else a["src"]
        phase = "forward" if a["direction"] == "forward" else "backward"
        user = compute[(e["pid"], consumer, a["microbatch"], a["step"], phase)]
        assert e["ts"] + e["dur"] <= user["ts"] + 1.0, (e, user)  # 1 us of rounding
    # one receive event per message a rank receives from another rank in the schedule, every step
    schedule = build_schedule(layout, M, "1f1b")
    per_step = sum(len({t.key for a in actions if isinstance(a, Exchange) for t in a.recvs})
                   for actions in schedule.actions)
    assert per_step > 0 and len(recvs) == per_step * STEPS
