"""The strategy keeps Python's full garbage collections off the objects alive when training starts,
and (on CPU) the host memory its steps free for the next step."""

from __future__ import annotations

import gc

import lightning as L
import pytest

from lightning_mmpp import ModulePlacement, MultiModulePipelineStrategy
from lightning_mmpp.engine.gc_freeze import FrozenHeap
from lightning_mmpp.engine.host_memory import _glibc
from tests.dist import run_distributed
from tests.models import MultiModalModel, make_loader

TOPOLOGY = {"enc_a": ["llm"], "llm": []}


def test_a_frozen_heap_freezes_once_and_leaves_another_freeze_alone():
    assert gc.get_freeze_count() == 0
    heap = FrozenHeap()
    try:
        assert heap.freeze() and gc.get_freeze_count() > 0
        frozen = gc.get_freeze_count()
        assert not heap.freeze() and gc.get_freeze_count() == frozen  # idempotent
    finally:
        heap.release()
    assert gc.get_freeze_count() == 0
    heap.release()  # nothing frozen: nothing to do
    gc.freeze()  # someone else's freeze (a parent before forking)
    try:
        other = gc.get_freeze_count()
        assert not FrozenHeap().freeze()
        FrozenHeap().release()
        assert gc.get_freeze_count() == other
    finally:
        gc.unfreeze()


class _FreezeCounts(L.Callback):
    def __init__(self) -> None:
        self.during: list[int] = []
        self.kept: list[bool] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.during.append(gc.get_freeze_count())
        self.kept.append(trainer.strategy._kept_host_memory.kept)


def _fit(rank: int, world: int, freeze_gc: bool) -> tuple[int, list[int], int, list[bool], bool]:
    gc.unfreeze()  # a worker forked from a parent that froze starts with its freeze
    before = gc.get_freeze_count()
    counts = _FreezeCounts()
    # the host memory setting goes with the gc freeze in these runs: on in the first, off in the second
    strategy = MultiModulePipelineStrategy({"enc_a": ModulePlacement(pp=1), "llm": ModulePlacement(pp=1)},
                                           TOPOLOGY, num_microbatches=2, freeze_gc=freeze_gc,
                                           keep_host_memory=freeze_gc)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, callbacks=[counts])
    trainer.fit(MultiModalModel(TOPOLOGY), make_loader(TOPOLOGY, 4, 8))
    return before, counts.during, gc.get_freeze_count(), counts.kept, strategy._kept_host_memory.kept


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_the_strategy_freezes_and_keeps_host_memory_during_training_and_undoes_both_at_teardown():
    """Every step runs with the objects of the setup frozen and (glibc, CPU) the host memory kept;
    the fit leaves the collector and the allocator as it found them; ``freeze_gc=False`` never
    freezes, ``keep_host_memory=False`` never keeps."""
    glibc = _glibc() is not None
    for before, during, after, kept, kept_after in run_distributed(_fit, 2, True, init_pg=False, timeout=90):
        assert before == 0 and len(during) == 2 and all(count > 0 for count in during) and after == 0
        assert kept == [glibc, glibc] and not kept_after
    for before, during, after, kept, kept_after in run_distributed(_fit, 2, False, init_pg=False, timeout=90):
        assert before == 0 and during == [0, 0] and after == 0
        assert kept == [False, False] and not kept_after
