"""Preemption: real SIGTERMs to real ranks (one, or all) end every rank together, promptly.

Layout: ``enc_a`` on rank 0, ``llm`` pp=2 on ranks 1-2. Rank 0 sends the signals from a
callback at the end of a chosen step, so they land while the ranks are inside the next
pipelined step (a rank blocked in a transfer included). No test depends on timing beyond a
generous overall deadline.
"""

from __future__ import annotations

import os
import signal
import threading
from datetime import timedelta
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_mmpp import ModulePlacement as P
from lightning_mmpp import MultiModulePipelineStrategy
from lightning_mmpp.lightning.preemption import Preempted, PreemptionHandler
from tests.dist import RankFailure, run_distributed, test_accelerator
from tests.models import MultiModalModel, make_loader

TOPOLOGY = {"enc_a": ["llm"], "llm": []}
PLACEMENTS = {"enc_a": P(), "llm": P(pp=2)}
MAX_STEPS = 40
BATCH = 8


class SendSignal(L.Callback):
    """On rank 0, after step ``at`` completes, send ``signum`` to the processes of ``targets``."""

    def __init__(self, root: Path, at: int, targets: list[int], signum: int = signal.SIGTERM) -> None:
        self.root, self.at, self.targets, self.signum = root, at, targets, signum

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_rank == 0 and trainer.global_step == self.at:
            for rank in self.targets:
                os.kill(int((self.root / f"pid{rank}").read_text()), self.signum)


class Hang(L.Callback):
    """Rank ``rank`` never finishes step ``at``: a stage stuck mid-step (a dead peer, a hung kernel)."""

    def __init__(self, rank: int, at: int) -> None:
        self.rank, self.at = rank, at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.at:
            threading.Event().wait()


class CountBroadcasts(L.Callback):
    """Counts ``torch.distributed.broadcast`` calls between the first and the last training batch
    (Lightning's loop broadcasts rank 0's SIGTERM flag before each batch unless the strategy's
    preemption handler took that collective out)."""

    def __init__(self) -> None:
        self.calls = 0
        self._original = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._original is None:
            self._original = torch.distributed.broadcast

            def counted(*args, **kwargs):
                self.calls += 1
                return self._original(*args, **kwargs)

            torch.distributed.broadcast = counted

    def on_train_end(self, trainer, pl_module) -> None:
        if self._original is not None:
            torch.distributed.broadcast, self._original = self._original, None


def _trainer(world: int, callbacks: list, checkpoint: str | None = None, **kwargs) -> L.Trainer:
    strategy = MultiModulePipelineStrategy(PLACEMENTS, TOPOLOGY, num_microbatches=2, preemption_checkpoint=checkpoint,
                                           timeout=timedelta(seconds=300))
    return L.Trainer(accelerator=test_accelerator(), devices=world, strategy=strategy, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     limit_val_batches=0, callbacks=callbacks, **kwargs)


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _preempt_several_times(rank: int, world: int, root: Path) -> dict:
    (root / f"pid{rank}").write_text(str(os.getpid()))
    out: dict = {}
    cases = {  # name: (signal after step, target ranks)
        "group": (2, [0, 1, 2]),
        "last_stage": (1, [2]),
        "middle_stage": (3, [1]),
        "first_stage": (2, [0]),
    }
    for name, (at, targets) in cases.items():
        ckpt = str(root / f"{name}.ckpt") if name == "group" else None
        trainer = _trainer(world, [SendSignal(root, at, targets)], ckpt, max_steps=MAX_STEPS)
        try:
            trainer.fit(MultiModalModel(TOPOLOGY), _loader())
            out[name] = ("finished", trainer.global_step, None)
        except Preempted as stop:
            out[name] = (str(stop), trainer.global_step, stop.code)
    # resume the group case's checkpoint: complete, and exactly where the ranks stopped
    resumed = MultiModalModel(TOPOLOGY)
    trainer = _trainer(world, [], max_steps=out["group"][1] + 2)
    trainer.fit(resumed, _loader(), ckpt_path=str(root / "group.ckpt"))
    out["resumed_to"] = trainer.global_step
    straight, broadcasts = MultiModalModel(TOPOLOGY), CountBroadcasts()
    _trainer(world, [broadcasts], max_steps=out["group"][1] + 2).fit(straight, _loader())
    out["broadcasts"] = broadcasts.calls
    out["resumed_params"], out["straight_params"] = _params(resumed), _params(straight)
    return out


def _loader():
    """One batch per epoch: the preemption boundary is then also an epoch boundary, where
    Lightning resumes exactly (mid-epoch it restarts the epoch's data unless the DataLoader is
    stateful)."""
    return make_loader(TOPOLOGY, BATCH, BATCH)


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_sigterm_to_the_group_or_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    per_rank = run_distributed(_preempt_several_times, 3, tmp_path, timeout=200, init_pg=False)
    for name, targets in {"group": [0, 1, 2], "last_stage": [2], "middle_stage": [1], "first_stage": [0]}.items():
        steps = {result[name][1] for result in per_rank}
        assert len(steps) == 1, f"{name}: ranks stopped at different steps {steps}"
        step = steps.pop()
        assert step < MAX_STEPS, f"{name}: training was not stopped"
        for rank, result in enumerate(per_rank):
            message, _, code = result[name]
            assert code == 128 + signal.SIGTERM, (name, rank, message)
            assert message == (f"rank {rank}: preempted by SIGTERM (received by rank(s) {targets}); all ranks stopped "
                               f"before step {step}" + (f"; checkpoint saved to {tmp_path / 'group.ckpt'}"
                                                         if name == "group" else "")
                               + "; exiting with status 143"), (name, rank, message)
    assert [result["broadcasts"] for result in per_rank] == [0] * 3  # no per-batch SIGTERM broadcast
    group_step = per_rank[0]["group"][1]
    assert (tmp_path / "group.ckpt").is_dir()
    assert [result["resumed_to"] for result in per_rank] == [group_step + 2] * 3
    for result in per_rank:  # preempted + resumed == uninterrupted, bit for bit
        assert result["resumed_params"].keys() == result["straight_params"].keys()
        for name, value in result["resumed_params"].items():
            assert torch.equal(value, result["straight_params"][name]), name


def _hung_rank(rank: int, world: int, root: Path, targets: list[int]) -> str:
    (root / f"pid{rank}").write_text(str(os.getpid()))
    trainer = _trainer(world, [SendSignal(root, 2, targets), Hang(1, 2)], max_steps=MAX_STEPS)
    try:
        trainer.fit(MultiModalModel(TOPOLOGY), make_loader(TOPOLOGY, BATCH, BATCH * MAX_STEPS))
    except Exception as err:  # noqa: BLE001 - the message is what is checked
        return f"{type(err).__name__}: {err}"
    return "finished"


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_sigterm_ends_every_rank_when_a_rank_is_stuck_mid_step(tmp_path):
    """Rank 1 hangs at the start of step 2; SIGTERM to every rank: no step boundary comes, so the
    watchers end the ranks (status 143) after their grace period, well within the process-group
    timeout. The watchers expire within moments of each other: a rank whose peer's watcher ended
    that peer first fails at once instead, naming the peer and why it left."""
    results = run_distributed(_hung_rank, 3, tmp_path, [0, 1, 2], timeout=90, init_pg=False,
                              allow_failures=True, failure_grace=30)
    assert isinstance(results[1], RankFailure) and "code 143" in results[1], results[1]  # the hung rank
    for rank, result in enumerate(results):
        ended_by_its_watcher = isinstance(result, RankFailure) and "code 143" in result
        named_a_preempted_peer = result.startswith("PipelineError: rank ") and (
            "received SIGTERM and left mid-step (no step boundary within" in result)
        assert ended_by_its_watcher or named_a_preempted_peer, (rank, result)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_sigterm_to_a_stuck_rank_ends_it_and_its_peers_name_it(tmp_path):
    """Rank 1 hangs at the start of step 2 and only rank 1 gets SIGTERM. It cannot reach a step
    boundary, so its watcher publishes why and ends it (status 143); ranks 0 and 2, waiting for
    it (in a transfer of step 2: the boundary's agreement came with step 1's metric all-reduce),
    fail at once and name rank 1 as the root cause."""
    results = run_distributed(_hung_rank, 3, tmp_path, [1], timeout=60, init_pg=False,
                              allow_failures=True, failure_grace=15)
    assert isinstance(results[1], RankFailure) and "code 143" in results[1], results[1]
    for rank in (0, 2):
        assert results[rank].startswith("PipelineError: rank 1 (llm stage 0) received SIGTERM and left mid-step (no "
                                        "step boundary within"), results[rank]


def test_handler_records_only_and_restores():
    handler = PreemptionHandler([signal.SIGUSR2])
    previous = signal.getsignal(signal.SIGUSR2)
    assert handler.install()
    try:
        os.kill(os.getpid(), signal.SIGUSR2)
        assert handler.requested == signal.SIGUSR2
        assert handler.agree(1, 0, torch.device("cpu")) == {0: signal.SIGUSR2}
        handler.resolved()
    finally:
        handler.uninstall()
    assert signal.getsignal(signal.SIGUSR2) == previous


def test_the_agreement_a_step_carried_is_used_at_the_next_boundary_without_a_collective():
    handler = PreemptionHandler([signal.SIGUSR2])
    assert handler.contribution(3, 1) == [0.0, 0.0, 0.0]
    handler.record(signal.SIGUSR2)
    assert handler.contribution(3, 1) == [0.0, float(signal.SIGUSR2), 0.0]
    handler.carried([0.0, float(signal.SIGUSR2), float(signal.SIGTERM)])  # what the metric all-reduce summed
    assert handler.agree(3, 1, torch.device("cpu")) == {1: signal.SIGUSR2, 2: signal.SIGTERM}  # no process group used
    handler.carried([0.0, 0.0, 0.0])
    assert handler.agree(3, 1, torch.device("cpu")) == {}
    with pytest.raises((RuntimeError, ValueError), match="process group"):  # nothing carried: it must meet the others
        handler.agree(3, 1, torch.device("cpu"))


def test_a_trainer_flag_joins_the_agreement_in_place_of_lightnings_broadcast():
    """Installed for a Trainer, the handler replaces the loop's per-batch SIGTERM broadcast: a
    SIGTERM Lightning recorded itself joins this rank's contribution; uninstalling restores it."""
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    loop = trainer.fit_loop.epoch_loop
    handler = PreemptionHandler([signal.SIGUSR2])
    assert handler.install(trainer)
    try:
        loop._broadcast_sigterm_tensor()  # what the loop runs before each batch: no collective
        assert handler.contribution(2, 1) == [0.0, 0.0]
        trainer._signal_connector.received_sigterm = True
        loop._broadcast_sigterm_tensor()
        assert handler.contribution(2, 1) == [0.0, float(signal.SIGTERM)]
        handler.resolved()
    finally:
        handler.uninstall()
    assert "_broadcast_sigterm_tensor" not in vars(loop)
