"""Preemption (SIGTERM, SLURM's requeue signal) that cannot hang a pipelined job.

Lightning's own SIGTERM handler broadcasts a flag with a collective from inside the signal
handler. Under a pipeline the handler runs while the rank is in the middle of point-to-point
traffic, so the broadcast never matches and every rank waits for the process-group timeout.
:class:`PreemptionHandler` replaces it:

* the signal handler only records the signal (Python runs it between bytecodes of the main
  thread);
* a watcher thread learns of the signal at once through :func:`signal.set_wakeup_fd` (the C
  handler writes the signal number there even while the main thread is blocked in a transfer);
* every rank's recorded signal rides in each step's metric all-reduce (a ``world_size`` vector
  beside the metrics: :meth:`PreemptionHandler.contribution`), so all ranks learn the same
  answer, whichever rank (or all) got the signal; at the next step boundary (the start of a
  training batch: the previous step, its optimizer step and its callbacks are complete, and no
  transfer is pending) every rank acts on that answer; the strategy then optionally saves a
  checkpoint and every rank exits with status ``128 + signal`` (:class:`Preempted`, a
  ``SystemExit``). Only when no step reduced since the last boundary (the first step) do the
  ranks meet in an all-reduce of their own at the boundary. Why not always: the ranks reach the
  boundary together, and a collective that every rank enters at once is the slowest kind
  (measured with ``python benchmarks/bench_fit.py``: 4-10 ms per step on 4 gloo processes on 2
  cores, against 0.6 ms for the metric all-reduce the last rank to finish enters alone). The
  price: a signal that arrives after a step's metric all-reduce (during its optimizer step and
  callbacks) is acted on one step later;
* Lightning's training loop broadcasts rank 0's SIGTERM flag before every batch, a collective
  every rank enters at once; with the handler installed for a Trainer that broadcast is
  replaced by :meth:`PreemptionHandler.fold_trainer_flag` (Lightning's flag joins this rank's
  contribution), since the metric all-reduce already carries every rank's signal;
* if the main thread does not reach a boundary within ``grace_s`` plus twice the duration of the
  last step (stuck in a transfer with a rank that will never answer, a long validation), the
  watcher publishes the reason to the process group's store (see
  :mod:`lightning_mmpp.engine.failures`, so peers name it) and ends the process with
  ``os._exit(128 + signal)``.

Ctrl-C (SIGINT) is left to Lightning, unchanged.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

from lightning_mmpp.engine.failures import FailureKind
from lightning_mmpp.lightning.lightning_api import (
    cluster_environment_of,
    replace_sigterm_broadcast,
    restore_sigterm_broadcast,
    route_signal_handlers,
)

__all__ = ["Preempted", "PreemptionHandler", "install_preemption", "preemption_signals"]

GRACE_S = 5.0


class Preempted(SystemExit):
    """Raised on every rank at the step boundary where the ranks agreed to stop after a signal.

    A ``SystemExit`` with status ``128 + signal`` (143 for SIGTERM), so the process ends
    non-zero without a traceback and a scheduler sees a preempted job, not a success.
    """

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(128 + signum)
        self.signum = signum
        self.message = message

    def __str__(self) -> str:
        return self.message


def preemption_signals(trainer: Any) -> tuple[int, ...]:
    """SIGTERM, plus SLURM's requeue signal (SIGUSR1 by default) when Lightning's SLURM
    environment requeues automatically."""
    found = [int(signal.SIGTERM)]
    try:
        from lightning.fabric.plugins.environments import SLURMEnvironment

        env = cluster_environment_of(trainer)
        if isinstance(env, SLURMEnvironment) and env.auto_requeue and env.requeue_signal is not None:
            found.append(int(env.requeue_signal))
    except Exception:  # noqa: BLE001 - no Lightning internals: SIGTERM only
        pass
    return tuple(found)


class PreemptionHandler:
    """Records preemption signals and turns them into an agreed stop at a step boundary.

    Args:
        signals: the signal numbers to own.
        on_stuck: called from the watcher thread with the signal number when the main thread
            did not reach a step boundary in time (publish a report); the process then exits.
        grace_s: seconds, on top of twice the last step's duration (a signal that arrives after
            a step's metric all-reduce is acted on a step later), before the watcher gives up on
            the main thread reaching a boundary.
    """

    def __init__(self, signals: Sequence[int], on_stuck: Callable[[int, float], None] = lambda s, t: None,
                 grace_s: float = GRACE_S) -> None:
        self.signals = tuple(signals)
        self.on_stuck = on_stuck
        self.grace_s = grace_s
        self.requested: Optional[int] = None
        self._resolved = threading.Event()
        self._last_boundary: Optional[float] = None
        self._last_step_s = 0.0
        self._carried: Optional[dict[int, int]] = None
        self._fds: Optional[tuple[int, int]] = None
        self._old_wakeup_fd: Optional[int] = None
        self._thread: Optional[threading.Thread] = None
        self._previous: dict[int, Any] = {}
        self._trainer: Any = None

    # --- installing -----------------------------------------------------------------------

    def install(self, trainer: Any = None) -> bool:
        """Own the signals (main thread only; returns False elsewhere).

        With a ``trainer``, Lightning's SIGTERM notifier and SLURM requeue handler are replaced
        by :meth:`record` (Lightning registers its handlers after the strategy's setup and
        composes them with any handler already installed, so replacing them is the only way
        to keep its collective out of the signal handler), and the training loop's per-batch
        SIGTERM broadcast by :meth:`fold_trainer_flag`; otherwise the handlers are set here.
        """
        if threading.current_thread() is not threading.main_thread() or self._fds is not None:
            return False
        self.requested = None
        self._resolved.clear()
        self._last_boundary = None
        self._carried = None
        if trainer is not None:
            route_signal_handlers(trainer, self.record)
            replace_sigterm_broadcast(trainer, lambda: self.fold_trainer_flag(trainer))
            self._trainer = trainer
        for signum in self.signals:  # effective now; Lightning re-registers the same function later
            self._previous[signum] = signal.getsignal(signum)
            signal.signal(signum, self.record)
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        self._fds = (read_fd, write_fd)
        self._old_wakeup_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._watch, args=(read_fd,), name="mmpp-preemption", daemon=True)
        self._thread.start()
        return True

    def uninstall(self) -> None:
        """Give the signals back (Lightning restores its own originals at teardown) and stop the watcher."""
        if self._fds is None or threading.current_thread() is not threading.main_thread():
            return
        signal.set_wakeup_fd(self._old_wakeup_fd if self._old_wakeup_fd is not None else -1)
        for signum, handler in self._previous.items():
            if signal.getsignal(signum) == self.record and handler is not None:
                signal.signal(signum, handler)
        self._previous = {}
        if self._trainer is not None:
            restore_sigterm_broadcast(self._trainer)
            self._trainer = None
        read_fd, write_fd = self._fds
        self._fds = None
        self._resolved.set()
        os.close(write_fd)  # the watcher's read returns b"" and it ends
        if self._thread is not None:
            self._thread.join(timeout=1.0)
        os.close(read_fd)

    # --- the signal side ------------------------------------------------------------------

    def record(self, signum: int, frame: Any = None) -> None:
        """The signal handler: remember the first signal, nothing else."""
        if self.requested is None:
            self.requested = int(signum)

    def fold_trainer_flag(self, trainer: Any) -> None:
        """In place of Lightning's per-batch SIGTERM broadcast: a SIGTERM the Trainer recorded
        (``trainer.received_sigterm``) joins this rank's contribution to the next agreement."""
        if self.requested is None and getattr(trainer, "received_sigterm", False):
            self.requested = int(signal.SIGTERM)

    def _watch(self, read_fd: int) -> None:
        while True:
            try:
                data = os.read(read_fd, 64)
            except OSError:
                return
            if not data:
                return
            hits = [b for b in data if b in self.signals]
            if hits:
                break
        signum = hits[0]
        if self.requested is None:
            self.requested = signum
        budget = self.grace_s + 2 * self._last_step_s
        if self._resolved.wait(budget):
            return
        try:
            self.on_stuck(signum, budget)
        finally:
            sys.stderr.flush()
            os._exit(128 + signum)

    # --- the step side --------------------------------------------------------------------

    def contribution(self, world_size: int, rank: int) -> list[float]:
        """This rank's part of the agreement a step's metric all-reduce carries: a ``world_size``
        vector holding this rank's recorded signal number at ``rank`` (0: none)."""
        flags = [0.0] * world_size
        if self.requested is not None:
            flags[rank] = float(self.requested)
        return flags

    def carried(self, summed: Sequence[float]) -> None:
        """Keep the sum of every rank's :meth:`contribution` from a step's metric all-reduce
        (identical on every rank); the next :meth:`agree` returns it. A later step's sum replaces
        an earlier one (signals are only ever added)."""
        self._carried = {rank: int(value) for rank, value in enumerate(summed) if value}

    def agree(self, world_size: int, rank: int, device: Any) -> dict[int, int]:
        """At a step boundary (every rank, same point): ``{rank: signal}`` of the ranks that
        recorded a signal (empty: carry on).

        The agreement a step's metric all-reduce carried since the last boundary (see
        :meth:`carried`); when no step reduced since (the first boundary), one all-reduce of a
        ``world_size`` vector when ``world_size > 1``: deadlock-free because every rank calls
        it at the same boundary with no point-to-point transfer pending. Every rank takes the
        same branch: they run the same steps between two boundaries.
        """
        now = time.monotonic()
        if self._last_boundary is not None:
            self._last_step_s = now - self._last_boundary
        self._last_boundary = now
        if world_size == 1:
            return {rank: self.requested} if self.requested is not None else {}
        if self._carried is not None:
            agreed, self._carried = self._carried, None
            return agreed
        import torch
        import torch.distributed as dist

        flags = torch.tensor(self.contribution(world_size, rank), dtype=torch.int32, device=device)
        dist.all_reduce(flags)
        return {r: value for r, value in enumerate(flags.tolist()) if value}

    def resolved(self) -> None:
        """The stop is agreed: the watcher must not end the process (a checkpoint may be saving)."""
        self._resolved.set()


def stop_at_boundary(handler: PreemptionHandler, strategy: Any, checkpoint_path: Optional[str],
                     failures: Any = None) -> None:
    """Called by the strategy at every training step boundary: stop every rank, together, after
    a preemption signal reached any of them (optionally saving ``checkpoint_path`` first).

    If the agreement fails because a peer left (its watcher ended it while it was stuck), the
    error names that peer through ``failures`` (a :class:`~lightning_mmpp.engine.failures.FailureBoard`).
    """
    try:
        got = handler.agree(strategy.world_size, strategy.global_rank, strategy.root_device)
    except RuntimeError as err:
        if failures is None:
            raise
        raise failures.transport_failure(err, range(strategy.world_size)) from err
    if not got:
        return
    handler.resolved()
    signum = min(got.values())
    name = signal.Signals(signum).name
    trainer = strategy.lightning_module.trainer
    saved = ""
    if checkpoint_path is not None:
        trainer.save_checkpoint(checkpoint_path)
        saved = f"; checkpoint saved to {checkpoint_path}"
    if signum != signal.SIGTERM and strategy.global_rank == 0:
        saved += _requeue_slurm_job()
    message = (f"rank {strategy.global_rank}: preempted by {name} (received by rank(s) {sorted(got)}); all ranks "
               f"stopped before step {trainer.global_step}{saved}; exiting with status {128 + signum}")
    print(message, file=sys.stderr, flush=True)
    raise Preempted(signum, message)


def _requeue_slurm_job() -> str:
    """What Lightning's SLURM auto-requeue does after its save: ``scontrol requeue <job>``."""
    import subprocess

    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array_job}_{os.environ.get('SLURM_ARRAY_TASK_ID')}" if array_job else os.environ.get("SLURM_JOB_ID")
    if not job:
        return ""
    try:
        code = subprocess.call(["scontrol", "requeue", job])
    except FileNotFoundError:
        return f"; could not requeue SLURM job {job}: scontrol not found"
    return f"; requeued SLURM job {job}" if code == 0 else f"; requeueing SLURM job {job} failed ({code})"


def install_preemption(handler: Optional[PreemptionHandler], trainer: Any, board: Any) -> PreemptionHandler:
    """Install ``handler`` (made on first use) for ``trainer``'s run; a rank stuck mid-step past
    the grace period leaves its root cause on the failure ``board`` before it exits."""

    def on_stuck(signum: int, waited_s: float) -> None:  # watcher thread: leave a root cause
        report = board.report(FailureKind.PREEMPTED, message=(
            f"received {signal.Signals(signum).name} and left mid-step (no step boundary within {waited_s:.0f} s)"))
        print(f"{report.describe()}; exiting with status {128 + signum}", file=sys.stderr, flush=True)
        board.publish(report)

    if handler is None:
        handler = PreemptionHandler(preemption_signals(trainer), on_stuck)
    else:
        handler.on_stuck = on_stuck  # this run's failure board
    handler.install(trainer)
    return handler
