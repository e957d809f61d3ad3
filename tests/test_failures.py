"""Root cause on every rank: a failing, NaN-producing or killed rank is named by all its peers.

Layout: ``enc_a`` on rank 0 (first stage), ``llm`` with pp=2 on ranks 1 (middle) and 2 (last,
the loss). Faults are injected at a chosen (step, microbatch) on a chosen rank.
"""

from __future__ import annotations

import math
import os
import signal
from datetime import timedelta

import lightning as L
import pytest
import torch

from lightning_mmpp import ModulePlacement as P
from lightning_mmpp import MultiModulePipelineStrategy, PipelineError
from lightning_mmpp.core.kinds import StepKind
from lightning_mmpp.engine.failures import FailureKind, FailureReport, describe_rank
from lightning_mmpp.errors import PipelineConfigError
from lightning_mmpp.core.placement import PipelineLayout
from tests.dist import RankFailure, run_distributed, test_accelerator
from tests.models import MultiModalModel, make_loader

TOPOLOGY = {"enc_a": ["llm"], "llm": []}
PLACEMENTS = {"enc_a": P(), "llm": P(pp=2)}
WHERE = {0: "enc_a stage 0", 1: "llm stage 0", 2: "llm stage 1"}


class FaultyModel(MultiModalModel):
    """Injects ``fault`` on ``rank`` at training ``step``, in the forward of ``microbatch``.

    Faults: ``raise`` (ValueError from the rank's layer or loss), ``nan`` (a NaN loss),
    ``kill`` (SIGKILL to its own process).
    """

    def __init__(self, fault: str, rank: int, step: int, microbatch: int) -> None:
        super().__init__(TOPOLOGY)
        self.fault = (fault, rank, step, microbatch)
        self._seen: dict[int, int] = {}
        original = self.llm[0].forward if rank == 1 else self.enc_a[0].forward
        module = self.llm[0] if rank == 1 else self.enc_a[0]

        def forward(x):  # the first layer of the rank's stage
            self._maybe_fault(x.get("h") if isinstance(x, dict) else x)
            return original(x)

        if rank in (0, 1):
            module.forward = forward

    def _maybe_fault(self, tensor: torch.Tensor) -> torch.Tensor:
        fault, rank, step, microbatch = self.fault
        if self.trainer.global_rank != rank or not self.trainer.training:
            return tensor
        count = self._seen.get(self.trainer.global_step, 0)
        self._seen[self.trainer.global_step] = count + 1
        if self.trainer.global_step != step or count != microbatch:
            return tensor
        if fault == "raise":
            raise ValueError(f"boom on purpose (rank {rank})")
        if fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        return tensor * math.nan

    def pipeline_loss(self, module, output, batch):
        result = super().pipeline_loss(module, output, batch)
        if self.fault[1] == 2:
            result["loss"] = self._maybe_fault(result["loss"])
        return result


def _fit(rank: int, world: int, fault: str, fault_rank: int, step: int, microbatch: int) -> str:
    model = FaultyModel(fault, fault_rank, step, microbatch)
    strategy = MultiModulePipelineStrategy(PLACEMENTS, TOPOLOGY, num_microbatches=2,
                                           timeout=timedelta(seconds=120))
    trainer = L.Trainer(accelerator=test_accelerator(), devices=world, strategy=strategy, max_steps=4, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0)
    try:
        trainer.fit(model, make_loader(TOPOLOGY, 8, 64))
    except Exception as err:  # noqa: BLE001 - the message is what is checked
        return f"{type(err).__name__}: {err}"
    return "no error"


def _launch(fault: str, rank: int, step: int, microbatch: int) -> list[str]:
    return run_distributed(_fit, 3, fault, rank, step, microbatch, timeout=90, init_pg=False,
                           allow_failures=True, failure_grace=20)


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("rank", [2, 1, 0])
def test_exception_on_one_rank_is_named_by_every_peer(rank):
    messages = _launch("raise", rank, 2, 1)
    cause = f"rank {rank} ({WHERE[rank]}) raised ValueError: boom on purpose (rank {rank}) at step 2, microbatch 1"
    for r, message in enumerate(messages):
        if r == rank:
            assert message.startswith(f"ValueError: boom on purpose (rank {rank})"), message
        else:
            assert message.startswith(f"PipelineError: {cause} (rank {r}: a transfer with rank(s)"), (r, message)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_nan_loss_on_one_microbatch_stops_every_rank_with_the_same_message():
    messages = _launch("nan", 2, 1, 1)
    expected = ("PipelineError: rank 2 (llm stage 1) computed a non-finite loss (nan) for sink 'llm' at step 1, "
                "microbatch 1. The step's loss is nan; stopping every rank before the optimizer step")
    for message in messages:
        assert message.startswith(expected), message


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("rank", [2, 1, 0])
def test_killed_rank_is_named_by_every_peer(rank):
    messages = _launch("kill", rank, 1, 0)
    assert isinstance(messages[rank], RankFailure) and "code -9" in messages[rank], messages[rank]
    for r, message in enumerate(messages):
        if r != rank:
            assert message.startswith(f"PipelineError: rank {rank} ({WHERE[rank]}) stopped responding: it died, "
                                      "was killed or is stuck"), (r, message)


def test_reports_describe_rank_and_round_trip():
    layout = PipelineLayout({"vision": P(dp=2), "proj": P(rank_offset=2), "llm": P(rank_offset=2)},
                            {"vision": ["proj"], "proj": ["llm"], "llm": []})
    assert describe_rank(layout, 1) == "vision stage 0 replica 1/2"
    assert describe_rank(layout, 2) == "proj stage 0, llm stage 0"
    report = FailureReport(2, "llm stage 1", FailureKind.RAISED, "ValueError", "bad", 2, 0, StepKind.VALIDATE)
    back = FailureReport.from_json(report.to_json())
    assert back == report and back.kind is FailureKind.RAISED
    assert report.describe() == "rank 2 (llm stage 1) raised ValueError: bad at step 2, microbatch 0 (val)"
    assert FailureReport(2, "llm stage 1", "died", message="gone").kind is FailureKind.DIED  # spellings parse
    with pytest.raises(PipelineConfigError, match=r"unknown failure kind 'crashed'; choose one of \['raised', 'died'"):
        FailureReport(2, "llm stage 1", "crashed")
    assert isinstance(PipelineError("x"), RuntimeError)
