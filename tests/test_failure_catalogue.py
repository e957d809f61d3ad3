"""The catalogue: user mistakes and injected faults, each ending every rank with a clear message.

Three kinds of rows:

* ``MISTAKES_HERE``: user mistakes checked in this file, in one process (construction,
  placement, topology, batch and payload checks) or in one single-rank ``fit`` launch;
* ``COVERED_ELSEWHERE``: mistakes and faults with their own tests in other files; the catalogue
  checks that each referenced test (or table entry) still exists, so the list cannot rot;
* ``FAULTS``: injected faults (a raising, NaN-producing or SIGKILLed rank, real SIGTERMs,
  failures under the fork/spawn launchers, checkpoint faults once they land), referenced the
  same way.

Every mistake raises ``PipelineConfigError`` naming the fix (on every rank, before any
collective, where it is knowable then); every fault ends every rank with a message whose first
line names the root cause (see README "When things go wrong").
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import lightning as L
import pytest
import torch

from lightning_mmpp import ModulePlacement as P
from lightning_mmpp import MultiModulePipelineStrategy, PipelineConfigError, PipelineLayout
from lightning_mmpp.engine.payload import flatten_payload
from tests.dist import run_distributed, test_accelerator
from tests.models import MultiModalModel, make_loader

TOPOLOGY = {"enc_a": ["llm"], "llm": []}
TWO = {"enc_a": P(), "llm": P()}


def _strategy(placements: Any = None, topology: Any = None, m: int = 4, **kwargs: Any) -> Any:
    return MultiModulePipelineStrategy(TWO if placements is None else placements,
                                       TOPOLOGY if topology is None else topology, m, **kwargs)


def _split(batch_size: int, m: int, divisor: int) -> Any:
    from lightning_mmpp.engine.microbatch import microbatch_count

    return microbatch_count(batch_size, m, divisor)


def _batch_size(batch: Any) -> Any:
    from lightning_mmpp.engine.microbatch import batch_size_of

    return batch_size_of(batch)


def _partition(placements: dict, model: Any) -> Any:
    from lightning_mmpp.model.partition import partition_model

    return partition_model(model, PipelineLayout(placements, TOPOLOGY), 0)


# id: (what the user did, expected fragment of the PipelineConfigError message)
MISTAKES_HERE: dict[str, tuple[Callable[[], Any], str]] = {
    "unknown_schedule": (lambda: _strategy(schedule="zb"), "unknown schedule 'zb'"),
    "zero_microbatches": (lambda: _strategy(m=0), "num_microbatches=0: it must be an integer >= 1"),
    "unknown_stage_numbering": (lambda: _strategy(stage_numbering="middle"), "unknown stage numbering 'middle'"),
    "unknown_start_method": (lambda: _strategy(start_method="thread"), "choose 'popen', 'spawn' or 'fork'"),
    "cycle": (lambda: _strategy({"a": P(), "b": P()}, {"a": ["b"], "b": ["a"]}), "topology has a cycle"),
    "module_without_placement": (lambda: _strategy({"enc_a": P()}), "have no placement; add 'llm'"),
    "placement_without_topology": (lambda: _strategy({**TWO, "x": P()}), "have no topology entry; add 'x'"),
    "pp_zero": (lambda: P(pp=0), "pp must be an integer >= 1"),
    "dp_zero": (lambda: P(dp=0), "dp must be an integer >= 1"),
    "negative_rank_offset": (lambda: P(rank_offset=-1), "rank_offset must be None or an integer >= 0"),
    "split_points_wrong_length": (lambda: P(pp=3, split_points=(2,)), "give pp-1 = 2 increasing layer indices"),
    "split_points_not_increasing": (lambda: P(pp=3, split_points=(3, 2)), "increasing layer indices"),
    "batch_dim_not_int": (lambda: P(batch_dim="0"), "batch_dim must be an integer"),
    "empty_placements": (lambda: _strategy({}), "placements must be a non-empty dict"),
    "placement_not_wrapped": (lambda: _strategy({"enc_a": {"pp": 1}, "llm": P()}), "wrap it as ModulePlacement"),
    "overlapping_ranks": (lambda: _strategy({"enc_a": P(dp=2, rank_offset=0), "llm": P(pp=2, rank_offset=1)}),
                          "Colocated modules need the same rank_offset, pp, dp and tp"),
    "rank_gap": (lambda: _strategy({"enc_a": P(rank_offset=0), "llm": P(rank_offset=2)}), "hold no module"),
    "dp_ratio_not_whole": (lambda: _strategy({"enc_a": P(dp=3), "llm": P(dp=2)}), "do not divide one another"),
    "empty_topology": (lambda: _strategy(TWO, {}), "topology must be a non-empty dict"),
    "topology_value_is_a_string": (lambda: _strategy(TWO, {"enc_a": "llm", "llm": []}), "is the string 'llm'"),
    "topology_value_not_a_list": (lambda: _strategy(TWO, {"enc_a": None, "llm": []}),
                                  "give a list of downstream module names"),
    "duplicate_downstream": (lambda: _strategy(TWO, {"enc_a": ["llm", "llm"], "llm": []}), "lists a downstream module twice"),
    "self_loop": (lambda: _strategy({"a": P()}, {"a": ["a"]}), "lists itself as downstream"),
    "unknown_downstream": (lambda: _strategy(TWO, {"enc_a": ["lm"], "llm": []}), "names unknown module 'lm'"),
    "invalid_module_name": (lambda: _strategy({"a.b": P()}, {"a.b": []}), "is not a valid module name"),
    "world_size_mismatch": (lambda: PipelineLayout({"enc_a": P(dp=2), "llm": P()}, TOPOLOGY).check_world_size(2),
                            "need 3 ranks"),
    "microbatch_not_divisible_by_dp": (lambda: PipelineLayout({"enc_a": P(dp=2), "llm": P()}, TOPOLOGY)
                                       .batch_shard("enc_a", 0, 3), "cannot be split over 'enc_a' dp=2"),
    "batch_not_divisible": (lambda: _split(6, 4, 1), "a multiple of 4"),
    "batch_without_tensors": (lambda: _batch_size({"step": 3}), "holds no tensor with a batch dimension"),
    "batch_sizes_disagree": (lambda: _batch_size({"x": torch.zeros(4, 2), "y": torch.zeros(3)}), "disagree on dim 0"),
    "string_in_payload": (lambda: flatten_payload({"h": torch.zeros(2), "name": "cat"}, "enc_a -> llm"),
                          "Payloads between stages and modules must be tensors"),
    "fewer_layers_than_stages": (lambda: _partition({"enc_a": P(), "llm": P(pp=9)}, MultiModalModel(TOPOLOGY)),
                                 "has 5 layer(s) but pp=9"),
    "split_point_beyond_layers": (lambda: _partition({"enc_a": P(), "llm": P(pp=2, split_points=(7,))},
                                                     MultiModalModel(TOPOLOGY)), "must be < its 5 layers"),
}


@pytest.mark.parametrize("mistake", list(MISTAKES_HERE))
def test_mistake_raises_a_config_error_naming_the_fix(mistake):
    make, fragment = MISTAKES_HERE[mistake]
    with pytest.raises(PipelineConfigError) as info:
        make()
    assert fragment in str(info.value), str(info.value)


class _LossIsNone(MultiModalModel):
    def pipeline_loss(self, module, output, batch):
        return None


class _VectorMetric(MultiModalModel):
    def pipeline_loss(self, module, output, batch):
        return {"loss": super().pipeline_loss(module, output, batch)["loss"], "per_sample": output.mean((1, 2))}


class _NoInputsHook(MultiModalModel):
    pipeline_inputs = None  # type: ignore[assignment]


class _MissingModule(MultiModalModel):
    def __init__(self) -> None:
        super().__init__(TOPOLOGY)
        del self.enc_a


FIT_MISTAKES: dict[str, tuple[Callable[[], Any], dict, str]] = {
    "loss_is_none": (lambda: _LossIsNone(TOPOLOGY), {}, "returned NoneType; return a scalar tensor"),
    "metric_not_scalar": (lambda: _VectorMetric(TOPOLOGY), {}, "metrics must be scalars"),
    "no_pipeline_inputs": (lambda: _NoInputsHook(TOPOLOGY), {}, "no `pipeline_inputs` method"),
    "module_attribute_missing": (lambda: _MissingModule(), {}, "needs an attribute `self.enc_a`"),
}


def _fit_mistakes(rank: int, world: int) -> dict[str, str]:
    placements = {"enc_a": P(rank_offset=0), "llm": P(rank_offset=0)}
    messages = {"empty_dataloader": _empty_loader(world, placements)}
    for name, (make, kwargs, _) in FIT_MISTAKES.items():
        strategy = MultiModulePipelineStrategy(placements, TOPOLOGY, num_microbatches=2)
        trainer = L.Trainer(accelerator=test_accelerator(), devices=world, strategy=strategy, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            limit_val_batches=0, max_steps=1, **kwargs)
        try:
            trainer.fit(make(), make_loader(TOPOLOGY, 8, 16))
            messages[name] = "no error"
        except PipelineConfigError as err:
            messages[name] = str(err)
        except Exception as err:  # noqa: BLE001 - a wrong exception type is a catalogue failure
            messages[name] = f"not a PipelineConfigError: {type(err).__name__}: {err}"
    return messages


def _empty_loader(world: int, placements: dict) -> str:
    """An empty training DataLoader: Lightning skips the loop; nothing hangs, nothing trains."""
    strategy = MultiModulePipelineStrategy(placements, TOPOLOGY, num_microbatches=2)
    trainer = L.Trainer(accelerator=test_accelerator(), devices=world, strategy=strategy, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, max_steps=1)
    try:
        trainer.fit(MultiModalModel(TOPOLOGY), make_loader(TOPOLOGY, 8, 0))
    except Exception as err:  # noqa: BLE001
        return f"{type(err).__name__}: {err}"
    return f"finished at step {trainer.global_step}"


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_fit_time_mistakes_raise_config_errors():
    (messages,) = run_distributed(_fit_mistakes, 1, timeout=100, init_pg=False)
    assert messages["empty_dataloader"] == "finished at step 0", messages["empty_dataloader"]
    for name, (_, _, fragment) in FIT_MISTAKES.items():
        assert fragment in messages[name], f"{name}: {messages[name]}"


# Mistakes with their own tests elsewhere: "module::test_function" or "module::TABLE[key]".
COVERED_ELSEWHERE = [
    "tests.test_strategy_errors::EXPECTED[no_hook]",
    "tests.test_strategy_errors::EXPECTED[no_container]",
    "tests.test_strategy_errors::EXPECTED[stray_parameter]",
    "tests.test_strategy_errors::EXPECTED[manual]",
    "tests.test_strategy_errors::EXPECTED[accumulate]",
    "tests.test_strategy_errors::EXPECTED[batch]",
    "tests.test_strategy_errors::EXPECTED[vector_loss]",
    "tests.test_strategy_errors::test_world_size_mismatch_raises_on_every_rank",
    "tests.test_strategy_errors::test_error_on_one_rank_stops_its_peers",
]

# Injected faults, each ending every rank with a message naming the root cause.
FAULTS = [
    "tests.test_failures::test_exception_on_one_rank_is_named_by_every_peer",  # x3: first/middle/last stage
    "tests.test_failures::test_nan_loss_on_one_microbatch_stops_every_rank_with_the_same_message",
    "tests.test_failures::test_killed_rank_is_named_by_every_peer",  # x3: SIGKILL of first/middle/last stage
    "tests.test_preemption::test_sigterm_to_the_group_or_one_rank_stops_every_rank_at_the_same_step",  # x4
    "tests.test_preemption::test_sigterm_ends_every_rank_when_a_rank_is_stuck_mid_step",
    "tests.test_preemption::test_sigterm_to_a_stuck_rank_ends_it_and_its_peers_name_it",
    "tests.test_launchers::test_failure_ends_every_rank_promptly",  # x2: fork, spawn
    "tests.test_checkpoint::test_resume_exactly_and_on_other_placements_and_errors",  # missing shard, wrong shapes
    # checkpoint faults (engineer "ckpt"): a crash at each phase of a save, a save failing on one
    # rank, truncated / altered / missing / foreign files, crafted pickles
    "tests.test_checkpoint_safety::test_a_crash_at_any_phase_of_a_save_leaves_the_old_or_the_new_checkpoint",
    "tests.test_checkpoint_safety::test_a_failing_save_raises_on_every_rank_and_keeps_the_old_checkpoint",
    "tests.test_checkpoint_safety::test_corrupt_files_are_named",
    "tests.test_checkpoint_safety::test_crafted_pickles_run_nothing",
    "tests.test_failure_catalogue::test_fit_time_mistakes_raise_config_errors",  # an empty DataLoader
]
# parametrised rows count once per case
FAULT_CASES = {"test_exception_on_one_rank_is_named_by_every_peer": 3, "test_killed_rank_is_named_by_every_peer": 3,
               "test_sigterm_to_the_group_or_one_rank_stops_every_rank_at_the_same_step": 4,
               "test_failure_ends_every_rank_promptly": 2, "test_resume_exactly_and_on_other_placements_and_errors": 2}


def _resolve(reference: str) -> Any:
    module_name, _, name = reference.partition("::")
    module = importlib.import_module(module_name)
    if "[" in name:
        table, key = name[:-1].split("[")
        return getattr(module, table)[key]
    return getattr(module, name)


def test_catalogue_references_exist_and_counts():
    for reference in COVERED_ELSEWHERE + FAULTS:
        assert _resolve(reference) is not None, reference
    mistakes = len(MISTAKES_HERE) + len(FIT_MISTAKES) + len(COVERED_ELSEWHERE)
    faults = sum(FAULT_CASES.get(reference.partition("::")[2], 1) for reference in FAULTS)
    assert mistakes >= 30, mistakes
    assert faults >= 10, faults
