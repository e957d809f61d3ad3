"""Pins every use of Lightning's private API in lightning_mmpp/lightning/lightning_api.py: each
test exercises one wrapper (or the Lightning internals it overrides) on the installed Lightning,
so a release that changes one fails here first, with the name of what changed. All in one
process: Trainers are built (and at most run one step) on the CPU, launchers are driven by
calling their worker and parent halves directly."""

from __future__ import annotations

import inspect
import io
import os
import signal
import socket
from datetime import timedelta

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.loops.optimization.automatic import Closure, _AutomaticOptimization
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
from lightning.pytorch.trainer import call
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.utils.data import DataLoader, SequentialSampler, TensorDataset

from lightning_mmpp.lightning.lightning_api import (
    CheckedSubprocessLauncher,
    PipelineMultiProcessingLauncher,
    PipelineOptimization,
    cluster_environment_of,
    default_backend,
    has_validation_data,
    init_process_group,
    install_pipeline_optimization,
    reduce_tensor,
    replace_sigterm_broadcast,
    restore_sigterm_broadcast,
    route_signal_handlers,
    update_dataloader,
)


def _trainer(**kwargs) -> L.Trainer:
    options = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False)
    return L.Trainer(**{**options, **kwargs})


def _loader(n: int = 4) -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(n, 2)), batch_size=2)


class _Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1.0)


class _ValidationStep(_Tiny):
    def validation_step(self, batch, batch_idx):
        pass


class _WithValidation(_ValidationStep):
    def val_dataloader(self):
        return _loader()


class _Stop(Exception):
    pass


class _Probe(L.Callback):
    """Calls ``probe(trainer)`` in ``setup`` (after the strategy connected the model, where
    the pipeline strategy asks its questions) and stops the fit there."""

    def __init__(self, probe) -> None:
        self.probe = probe
        self.seen = None

    def setup(self, trainer, pl_module, stage):
        self.seen = self.probe(trainer)
        raise _Stop


def _probe_fit(model, probe, **fit_kwargs):
    callback = _Probe(probe)
    with pytest.raises(_Stop):
        _trainer(callbacks=[callback], max_steps=1).fit(model, **fit_kwargs)
    return callback.seen


# --- process group -------------------------------------------------------------------------------


def test_default_backend():
    """gloo for the CPU, NCCL for CUDA devices. If this fails, the strategy starts its process
    group on another backend than Lightning's DDP would (``process_group_backend`` still wins)."""
    assert default_backend(torch.device("cpu")) == "gloo"
    assert default_backend(torch.device("cuda", 0)) == "nccl"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_reduce_tensor_without_a_process_group():
    """Outside a process group the tensor comes back as it is. If this fails, ``strategy.reduce``
    breaks single-process use (e.g. metrics logged with ``sync_dist=True`` in a one-rank test)."""
    assert not dist.is_initialized()
    t = torch.tensor([3.0, 5.0])
    assert torch.equal(reduce_tensor(t, None, "mean"), t)


def test_init_process_group_and_reduce_tensor_on_one_process(monkeypatch):
    """``init_process_group`` starts the default group from the cluster environment's rank,
    world size and address; ``reduce_tensor`` then sums or averages over it (one process: the
    value itself). If this fails, the strategy's ``setup_environment`` cannot start the
    process group, or ``strategy.reduce`` returns another value than DDP's."""
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    init_process_group(LightningEnvironment(), "gloo", timeout=timedelta(seconds=30))
    try:
        assert dist.is_initialized() and dist.get_world_size() == 1 and dist.get_rank() == 0
        assert dist.get_backend() == "gloo"
        t = torch.tensor([3.0, 5.0])
        assert torch.equal(reduce_tensor(t.clone(), None, "sum"), t)
        assert torch.equal(reduce_tensor(t.clone(), None, "mean"), t)
        assert torch.equal(reduce_tensor(t.clone(), None, dist.ReduceOp.SUM), t)
    finally:
        dist.destroy_process_group()


# --- the Trainer's state -------------------------------------------------------------------------


def test_has_validation_data():
    """True when the fit has a validation loader (passed to ``fit`` or defined by the model),
    False otherwise, at the time the strategy connects the model. If this fails, the strategy
    attaches (or misses) the ``validation_step`` placeholder for a fit without (with)
    validation."""
    assert _probe_fit(_Tiny(), has_validation_data, train_dataloaders=_loader()) is False
    assert _probe_fit(_ValidationStep(), has_validation_data, train_dataloaders=_loader(),
                      val_dataloaders=_loader()) is True
    assert _probe_fit(_WithValidation(), has_validation_data, train_dataloaders=_loader()) is True


class _Environment(LightningEnvironment):
    pass


def test_cluster_environment_of():
    """The environment the Trainer resolved: the one given as a plugin, else Lightning's own.
    If this fails, preemption cannot tell a SLURM run (and its requeue signal) from others."""
    env = _Environment()
    assert cluster_environment_of(_trainer(plugins=[env])) is env
    assert isinstance(cluster_environment_of(_trainer()), LightningEnvironment)


def test_route_signal_handlers_replaces_the_connectors_functions():
    """After ``route_signal_handlers``, the handlers Lightning registers for SIGTERM (and SLURM's
    requeue signal) call ours instead of its own (whose SIGTERM notifier runs a collective inside
    the signal handler). If this fails, a preempted pipeline run can hang in Lightning's
    broadcast instead of stopping at a step boundary."""
    trainer = _trainer()
    seen = []
    handler = lambda signum, frame: seen.append(signum)  # noqa: E731
    assert route_signal_handlers(trainer, handler) is True
    connector = trainer._signal_connector
    assert connector._sigterm_notifier_fn is handler and connector._slurm_sigusr_handler_fn is handler
    before = signal.getsignal(signal.SIGTERM)
    try:
        connector.register_signal_handlers()
        signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)  # what a SIGTERM would run
    finally:
        connector.teardown()
        signal.signal(signal.SIGTERM, before)
    assert seen == [signal.SIGTERM]
    assert connector.received_sigterm is False  # Lightning's notifier did not run

    class NoConnector:
        pass

    assert route_signal_handlers(NoConnector(), handler) is False


def test_replace_sigterm_broadcast_takes_the_training_loops_collective_out():
    """The training loop broadcasts rank 0's SIGTERM flag through ``_broadcast_sigterm_tensor``,
    called from ``advance`` before every batch; ``replace_sigterm_broadcast`` swaps that call for
    ours on this trainer's loop only. If this fails, every pipelined training step pays a
    collective every rank enters at once (and a rank-0-only flag) again."""
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    assert "self._broadcast_sigterm_tensor()" in inspect.getsource(_TrainingEpochLoop.advance)
    trainer, other = _trainer(), _trainer()
    calls = []
    replace_sigterm_broadcast(trainer, lambda: calls.append("check"))
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor()
    assert calls == ["check"]
    assert "_broadcast_sigterm_tensor" not in vars(other.fit_loop.epoch_loop)
    restore_sigterm_broadcast(trainer)
    assert "_broadcast_sigterm_tensor" not in vars(trainer.fit_loop.epoch_loop)
    assert trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor.__func__ is _TrainingEpochLoop._broadcast_sigterm_tensor


class _Loader(DataLoader):
    pass


def test_update_dataloader_keeps_the_loader_and_uses_the_new_sampler():
    """The loader is re-created with the same class, dataset, batch size, collate function and
    ``drop_last``, drawing indices from the new sampler. If this fails, the strategy's seeded
    sampler (every rank loading the same batches) changes the user's loader or is ignored."""
    dataset = TensorDataset(torch.arange(10.0).unsqueeze(1))

    def collate(samples):
        return torch.stack([s[0] for s in samples]) * 10

    loader = _Loader(dataset, batch_size=3, shuffle=True, drop_last=True, collate_fn=collate)

    class Reversed(SequentialSampler):
        def __iter__(self):
            return iter(range(len(self.data_source) - 1, -1, -1))

    sampler = Reversed(dataset)
    new = update_dataloader(loader, sampler)
    assert type(new) is _Loader and new.dataset is dataset and new.batch_size == 3 and new.drop_last
    assert new.sampler is sampler and new.collate_fn is collate
    assert [b.flatten().tolist() for b in new] == [[90.0, 80.0, 70.0], [60.0, 50.0, 40.0], [30.0, 20.0, 10.0]]


# --- the optimisation loop -----------------------------------------------------------------------


def test_the_closure_parts_pipeline_optimization_builds_on():
    """``_AutomaticOptimization`` builds its closure from ``_make_zero_grad_fn(batch_idx,
    optimizer)``, ``_make_step_fn(kwargs)`` and ``_make_backward_fn(optimizer)`` inside
    ``_make_closure(kwargs, optimizer, batch_idx)``; ``Closure`` takes ``step_fn``,
    ``backward_fn`` and ``zero_grad_fn``. If this fails, PipelineOptimization's closure calls
    them with the wrong arguments."""
    def params(fn):
        return list(inspect.signature(fn).parameters)

    assert params(_AutomaticOptimization._make_closure) == ["self", "kwargs", "optimizer", "batch_idx"]
    assert params(_AutomaticOptimization._make_zero_grad_fn) == ["self", "batch_idx", "optimizer"]
    assert params(_AutomaticOptimization._make_step_fn) == ["self", "kwargs"]
    assert params(_AutomaticOptimization._make_backward_fn) == ["self", "optimizer"]
    assert params(Closure.__init__) == ["self", "step_fn", "backward_fn", "zero_grad_fn"]
    assert params(PipelineOptimization._make_closure) == params(_AutomaticOptimization._make_closure)


class _GradientInStep(_Tiny):
    """Its training step leaves the gradient in ``.grad`` itself (as a pipeline step does) and
    returns a loss whose backward adds nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.grad_at_step: list[bool] = []

    def training_step(self, batch, batch_idx):
        weight = self.layer.weight
        self.grad_at_step.append(weight.grad is None or not weight.grad.any())
        weight.grad = torch.ones_like(weight)
        return (weight * 0).sum()


class _Install(L.Callback):
    def setup(self, trainer, pl_module, stage):
        # progress made before the swap (e.g. restored from a checkpoint) carries over
        trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total.completed = 5
        self.loop = install_pipeline_optimization(trainer)
        self.again = install_pipeline_optimization(trainer)


def test_pipeline_optimization_zeroes_gradients_before_the_step():
    """With the loop installed, gradients are zeroed before ``training_step`` and the optimizer
    steps on the gradients the step left; progress keeps counting. If this fails, Lightning's
    ``zero_grad`` between the step and ``backward`` erases the pipeline's gradients (no
    parameter ever changes) or they accumulate across steps."""
    model = _GradientInStep()
    start = model.layer.weight.detach().clone()
    install = _Install()
    trainer = _trainer(callbacks=[install], max_steps=5 + 2)
    trainer.fit(model, _loader())
    assert isinstance(install.loop, PipelineOptimization) and install.again is install.loop  # idempotent
    assert model.grad_at_step == [True, True]
    torch.testing.assert_close(model.layer.weight.detach(), start - 2.0)  # lr 1, gradient 1, two steps
    assert trainer.global_step == 5 + 2


# --- the launchers -------------------------------------------------------------------------------


def test_launchers_override_what_lightning_calls():
    """The launchers' overridden methods exist on Lightning's bases with the parameters used:
    ``launch(function, *args, trainer=None, **kwargs)``, ``_collect_rank_zero_results(trainer,
    results)``, ``_recover_results_in_main_process(worker_output, trainer)``,
    ``get_extra_results(trainer)``, ``update_main_process_results(trainer, extra)``; the script
    launcher is made from ``(cluster_environment, num_processes, num_nodes)``. If this fails, a
    Lightning release renamed one and the override is silently never called (the parent gets
    rank 0's partial model back)."""
    def params(cls, name):
        return list(inspect.signature(getattr(cls, name)).parameters)

    base, ours = _MultiProcessingLauncher, PipelineMultiProcessingLauncher
    expected = {
        "launch": ["self", "function", "args", "trainer", "kwargs"],
        "_collect_rank_zero_results": ["self", "trainer", "results"],
        "_recover_results_in_main_process": ["self", "worker_output", "trainer"],
        "get_extra_results": ["self", "trainer"],
        "update_main_process_results": ["self", "trainer", "extra"],
    }
    for name, parameters in expected.items():
        assert params(base, name) == parameters, name
        assert params(ours, name) == parameters, name
    assert params(_SubprocessScriptLauncher, "__init__") == ["self", "cluster_environment", "num_processes", "num_nodes"]
    assert params(_SubprocessScriptLauncher, "launch") == expected["launch"]
    assert params(CheckedSubprocessLauncher, "launch") == expected["launch"]
    assert _WorkerOutput._fields == ("best_model_path", "weights_path", "trainer_state", "trainer_results", "extra")
    # a worker's entry point, its process index first; it sets the worker's threads unless
    # OMP_NUM_THREADS is set (the forked-worker thread guard relies on that)
    assert params(base, "_wrapping_function")[:2] == ["self", "process_idx"]
    assert "_set_num_threads_if_needed" in inspect.getsource(base._wrapping_function)
    assert "OMP_NUM_THREADS" in inspect.getsource(_set_num_threads_if_needed)
    assert "_suggested_max_num_threads(" in inspect.getsource(_set_num_threads_if_needed)


class _Counter(L.Callback):
    def __init__(self, count: int = 0) -> None:
        self.count = count

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


def test_callbacks_state_dict_round_trip():
    """``call._call_callbacks_state_dict(trainer)`` collects every callback's state by its state
    key and ``call._call_callbacks_load_state_dict(trainer, checkpoint)`` hands it back from a
    checkpoint's ``"callbacks"`` entry. If this fails, the callbacks in the launching process do
    not get their workers' state after fit."""
    states = call._call_callbacks_state_dict(_trainer(callbacks=[_Counter(7)]))
    assert states == {_Counter(7).state_key: {"count": 7}}
    parent = _Counter()
    call._call_callbacks_load_state_dict(_trainer(callbacks=[parent]), {"callbacks": states})
    assert parent.count == 7


class _FakeStrategy:
    """What the launcher reads of its strategy in a worker with one process (no pipeline layout:
    the parent is marked as holding the model directly)."""

    num_processes = 1
    local_rank = 0
    global_rank = 0
    accelerator = None

    def __init__(self, checkpoint_io) -> None:
        self.checkpoint_io = checkpoint_io


def test_the_multiprocessing_launcher_brings_the_whole_model_and_state_back(monkeypatch, tmp_path):
    """Lightning's worker half (``_wrapping_function``) calls ``_collect_rank_zero_results(trainer,
    results)`` and queues its ``_WorkerOutput``; the parent half (``_recover_results_in_main_process``)
    then loads the weights strictly and restores the trainer state, callback metrics, fit loop
    progress and callbacks' state. If this fails, ``trainer.fit`` under the spawn/fork launcher
    leaves the user's model (or trainer) in the launching process without the trained state."""
    monkeypatch.setenv("LOCAL_RANK", "0")
    worker_model, parent_model = _Tiny(), _Tiny()
    with torch.no_grad():
        worker_model.layer.weight.fill_(2.0)
    worker = _trainer(callbacks=[_Counter(5)])
    worker.strategy.connect(worker_model)
    worker.state.fn = TrainerFn.FITTING
    worker.callback_metrics["train_loss"] = torch.tensor(1.5)
    worker.fit_loop.epoch_progress.current.completed = 3

    launcher = PipelineMultiProcessingLauncher(_FakeStrategy(worker.strategy.checkpoint_io), start_method="fork")
    launcher._parent_holds_model = True  # set by launch() in the parent
    queued: list = []

    class Queue:
        def put(self, item):
            queued.append(item)

    launcher._wrapping_function(0, worker, lambda: "results", (), {}, Queue())
    (output,) = queued
    assert isinstance(output, _WorkerOutput) and output.trainer_results == "results"
    assert output.weights_path is not None and output.extra["fitted"] is True

    counter = _Counter()
    parent = _trainer(callbacks=[counter])
    parent.strategy.connect(parent_model)
    launcher._recover_results_in_main_process(output, parent)
    assert torch.equal(parent_model.layer.weight, worker_model.layer.weight)
    assert not os.path.exists(output.weights_path)  # removed once loaded
    assert parent.state.fn == TrainerFn.FITTING
    assert parent.callback_metrics["train_loss"] == 1.5
    assert parent.fit_loop.epoch_progress.current.completed == 3
    assert counter.count == 5
