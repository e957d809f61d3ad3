"""Root cause on every rank: failures published to the process group's store.

When a rank fails inside a pipeline step (user code such as ``pipeline_loss``, a bad payload,
a non-finite loss), its peers only see a transport error ("Connection closed by peer") or a
timeout. :class:`FailureBoard` makes the root cause visible everywhere without a collective:

* the failing rank publishes a :class:`FailureReport` (rank, module/stage, step, microbatch,
  exception type and message) to the default process group's store (``TCPStore``: a key-value
  server every rank can reach, made for this kind of out-of-band coordination) *before* it
  raises and tears down its process group;
* a peer whose transfer fails reads the store first and raises :class:`PipelineError` whose
  message starts with that root cause, chained from its own transport error;
* a peer that finds no report checks the ranks it was talking to: one whose process is gone
  (same host: every rank publishes its host and pid) is reported as dead (SIGKILL, OOM killer)
  at once; one that neither reported nor acknowledged the failure within a grace period (every
  rank that leaves a failing step writes an ack key) is reported as dead or stuck, with its
  module/stage.
  That report is published too, so ranks further away name the same root cause;
* the first report wins (``compare_set``): later failures caused by the first do not hide it.

The board is a ``TCPStore`` served by rank 0's process, apart from the process group's own
store (which a failing rank's ``destroy_process_group`` shuts down); its address travels
through the group's store at setup. Rank 0 waits, bounded, until every live rank has read the
root cause before it leaves a failed step (a ``done`` key after the read; the ack comes
before it), so its peers can still read the report; a peer that cannot reach the
board at all reports rank 0 as the rank that died.

Keys are namespaced per Trainer call (a generation counter), so a failure caught in one
``fit`` does not leak into the next one in the same process.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, Optional

from lightning_mmpp.core.kinds import Choice, StepKind
from lightning_mmpp.core.placement import PipelineLayout
from lightning_mmpp.errors import PipelineError

__all__ = ["FailureBoard", "FailureKind", "FailureReport", "PipelineError", "describe_rank"]

# Seconds a rank whose transfer failed waits for a report (or its peers' acks) before it
# concludes that a silent peer died; and the most rank 0 waits for acks before it leaves.
REPORT_GRACE_S = 3.0
LINGER_S = 5.0
_POLL_S = 0.02


class FailureKind(Choice):
    """How a rank failed: its own code raised, it died (or stopped responding), its step's loss
    was not finite, or its job was preempted."""

    RAISED = "raised"
    DIED = "died"
    NON_FINITE_LOSS = "non-finite loss"
    PREEMPTED = "preempted"

    @classmethod
    def label(cls) -> str:
        return "failure kind"


@dataclass(frozen=True)
class FailureReport:
    """What went wrong where: ``kind`` (a :class:`FailureKind` or its spelling), and the kind of
    step (``phase``) the rank was running."""

    rank: int
    where: str
    kind: FailureKind
    exc_type: str = ""
    message: str = ""
    step: Optional[int] = None
    microbatch: Optional[int] = None
    phase: StepKind = StepKind.TRAIN

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", FailureKind.parse(self.kind))

    def describe(self) -> str:
        """One line that starts with the rank, e.g. ``rank 2 (llm stage 1) raised ValueError: ...``."""
        head = f"rank {self.rank} ({self.where})"
        if self.kind is FailureKind.RAISED:
            what = f"{head} raised {self.exc_type}: {self.message}"
        elif self.kind is FailureKind.DIED:
            what = f"{head} stopped responding: it died, was killed or is stuck ({self.message})"
        else:
            what = f"{head} {self.message}"
        return what + self._at()

    def _at(self) -> str:
        if self.step is None:
            return ""
        phase = "" if self.phase == StepKind.TRAIN else f" ({self.phase})"
        micro = "" if self.microbatch is None else f", microbatch {self.microbatch}"
        return f" at step {self.step}{micro}{phase}"

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str | bytes) -> "FailureReport":
        return FailureReport(**json.loads(text))


def describe_rank(layout: Optional[PipelineLayout], rank: int) -> str:
    """``"llm stage 1"``, ``"vision stage 0 replica 1/2"``, or several for colocated modules."""
    if layout is None:
        return "layout not known yet"
    parts = []
    for slot in layout.slots(rank):
        placement = layout.placements[slot.module]
        text = f"{slot.module} stage {slot.stage}"
        if placement.dp > 1:
            text += f" replica {slot.replica}/{placement.dp}"
        parts.append(text)
    return ", ".join(parts) if parts else "no module"


class FailureBoard:
    """This rank's view of the failure reports of one Trainer call.

    Args:
        layout: the placement (to name a rank's module and stage).
        rank: this process's global rank.
        world_size: the number of ranks.
    """

    def __init__(self, layout: Optional[PipelineLayout], rank: int, world_size: int) -> None:
        self.layout = layout
        self.rank = rank
        self.world_size = world_size
        self.step: Optional[int] = None
        self.phase: StepKind = StepKind.TRAIN
        self._store: Any = None
        self._server: Any = None
        self._address: Optional[tuple[str, int]] = None
        self._prefix = "mmpp/failures/none/"
        self.failed = False
        self._lingered = False

    # --- lifecycle ----------------------------------------------------------------------------

    def attach(self) -> None:
        """Open this Trainer call's board; every rank calls it once per call, after the process
        group exists.

        Rank 0 serves the board from a store of its own (a ``TCPStore`` on a free port,
        advertised through the process group's store): the group's store is shut down with the
        group, which a failing rank destroys so that its peers stop at once.
        """
        import torch.distributed as dist

        from lightning_mmpp.torch_api import default_store

        self.failed = False
        self._lingered = False

        base = default_store()
        if base is None or self.world_size == 1:
            return
        ticket = int(base.add("mmpp/failures/tickets", 1))
        self._prefix = f"mmpp/failures/{(ticket - 1) // self.world_size}/"
        host = os.environ.get("MASTER_ADDR", socket.gethostname())
        if self.rank == 0:
            self._server = dist.TCPStore(host, 0, None, True, timedelta(seconds=30), wait_for_workers=False)
            base.set(self._prefix + "server", f"{host} {self._server.port}")
            self._store = self._server
        else:
            host, port = base.get(self._prefix + "server").decode().split()
            self._address = (host, int(port))
            self._store = self._connect()
        self._store.set(self._prefix + f"proc/{self.rank}", f"{socket.gethostname()} {os.getpid()}")

    def _connect(self) -> Any:
        import torch.distributed as dist

        assert self._address is not None
        return dist.TCPStore(self._address[0], self._address[1], None, False, timedelta(seconds=10))

    def _reconnect(self) -> None:
        """A fresh connection to rank 0's board: a rank's store connection does not always
        survive the failure of its process group's transfers (observed with gloo)."""
        if self._address is not None:
            self._store = self._connect()

    def release(self) -> None:
        """Close this rank's end of the board (rank 0: stop serving it)."""
        self._store = None
        self._server = None

    def begin(self, step: Optional[int], kind: StepKind) -> None:
        """Where this rank is: ``step`` (the global step) and the ``kind`` of step it runs (parsed
        by the caller, :meth:`~lightning_mmpp.engine.engine.PipelineEngine.step`)."""
        self.step = step
        self.phase = kind

    # --- publishing ---------------------------------------------------------------------------

    def report(self, kind: FailureKind | str, exc_type: str = "", message: str = "",
               microbatch: Optional[int] = None, rank: Optional[int] = None) -> FailureReport:
        """A report of this board's step, about this rank or ``rank``."""
        who = self.rank if rank is None else rank
        return FailureReport(who, describe_rank(self.layout, who), FailureKind.parse(kind), exc_type,
                             message[:2000], self.step, microbatch, self.phase)

    def publish(self, report: FailureReport) -> FailureReport:
        """Publish ``report`` unless a root cause is already there; return the root cause."""
        self.failed = True
        if self._store is None:
            return report
        try:
            first = self._store.compare_set(self._prefix + "root", "", report.to_json())
            self._ack()
            self._done()
            return FailureReport.from_json(first) if first else report
        except Exception:  # noqa: BLE001 - the store is gone: keep the local report
            return report

    def publish_exception(self, err: BaseException, microbatch: Optional[int]) -> FailureReport:
        """Publish ``err`` raised by this rank's own code (the root cause of a failing step)."""
        return self.publish(self.report(FailureKind.RAISED, type(err).__name__, str(err).strip(), microbatch))

    def _ack(self) -> None:
        self._store.set(self._prefix + f"ack/{self.rank}", "1")

    def done_reading(self) -> None:
        """Tell rank 0 that this rank needs the board no more (see :meth:`linger`)."""
        if self._store is not None:
            try:
                self._done()
            except Exception:  # noqa: BLE001 - the board is gone: nothing to tell
                pass

    def _done(self) -> None:
        """This rank has read (or written) the root cause and needs the board no more."""
        self._store.set(self._prefix + f"done/{self.rank}", "1")

    # --- reading ------------------------------------------------------------------------------

    def root_cause(self) -> Optional[FailureReport]:
        """The published root cause, if any (no waiting)."""
        if self._store is None:
            return None
        key = self._prefix + "root"
        if not self._store.check([key]):
            return None
        return FailureReport.from_json(self._store.get(key))

    def transport_failure(self, err: BaseException, peers: Iterable[int], microbatch: Optional[int] = None,
                          grace_s: float = REPORT_GRACE_S) -> PipelineError:
        """The error to raise when a transfer with ``peers`` failed or timed out.

        Waits (at most ``grace_s``) for a published root cause or for an ack from every peer;
        a peer that stays silent is reported as dead. The result's message starts with the root
        cause; the caller raises it ``from err``.
        """
        self.failed = True
        peers = sorted(set(peers) - {self.rank})
        seen = f"rank {self.rank}: a transfer with rank(s) {peers} failed during the pipeline step"
        if self._store is None:
            return PipelineError(f"{seen}. If a peer raised an error, its message (on that rank) is the cause. "
                                 f"Transport error: {err}")
        try:
            try:
                self._ack()
            except Exception:  # noqa: BLE001 - one retry on a fresh connection
                self._reconnect()
                self._ack()
            root = self._wait_for_root(peers, grace_s, microbatch)
            self._done()
        except Exception as store_err:  # noqa: BLE001 - the store's host (rank 0) is gone
            if self.rank == 0:
                return PipelineError(f"{seen} and the process group's store failed ({store_err}). "
                                     f"Transport error: {err}")
            root = self.report(FailureKind.DIED, message="the process group's store it hosts is unreachable",
                               microbatch=microbatch, rank=0)
        if root is None:
            return PipelineError(f"{seen}; no rank reported an error (a failure outside the pipeline step, or "
                                 f"a process-group timeout). Transport error: {err}")
        return PipelineError(f"{root.describe()} ({seen}: {_first_line(err)})", report=root)

    def _wait_for_root(self, peers: list[int], grace_s: float, microbatch: Optional[int]) -> Optional[FailureReport]:
        deadline = time.monotonic() + grace_s
        acked: set[int] = set()
        while True:
            root = self.root_cause()
            if root is not None:
                return root
            acked |= {p for p in peers if p not in acked and self._store.check([self._prefix + f"ack/{p}"])}
            silent = [p for p in peers if p not in acked]
            gone = [p for p in silent if self._process_gone(p)]
            if gone:  # a peer on this host whose process no longer exists
                return self.publish(self.report(
                    FailureKind.DIED, message="its process is gone", microbatch=microbatch, rank=gone[0]))
            if time.monotonic() >= deadline:
                if not silent:
                    return None  # every peer is alive and none reported a cause
                return self.publish(self.report(
                    FailureKind.DIED, message=f"no report from it within {grace_s:.0f} s of its connections failing",
                    microbatch=microbatch, rank=silent[0]))
            time.sleep(_POLL_S)

    def _process_gone(self, rank: int) -> bool:
        """Whether ``rank`` ran on this host in a process that has exited (or is a zombie)."""
        key = self._prefix + f"proc/{rank}"
        if not self._store.check([key]):
            return False
        host, pid = self._store.get(key).decode().split()
        if host != socket.gethostname():
            return False  # another machine: only silence tells
        if os.path.exists("/proc/self/stat"):
            try:
                with open(f"/proc/{pid}/stat") as stat:
                    return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
            except OSError:
                return True
        try:  # no procfs: a signal-0 probe
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return True
        except OSError:
            return False
        return False

    def linger(self, timeout_s: float = LINGER_S) -> None:
        """On the rank that serves the store (rank 0), wait until every other rank has read
        the root cause (or ``timeout_s``), so none of them finds the store gone and blames rank
        0. (An ack alone is not enough: a rank acks before it reads.)"""
        if self._store is None or self.rank != 0 or not self.failed or self._lingered:
            return
        self._lingered = True  # once per failure, however many layers see it
        keys = [self._prefix + f"done/{r}" for r in range(1, self.world_size)]
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline and not all(self._store.check([k]) for k in keys):
                time.sleep(_POLL_S)
        except Exception:  # noqa: BLE001 - nothing more to wait for
            return


def drop_transfer_references(exception: BaseException, comm: Any) -> None:
    """Let a failing rank's process group actually close when it is destroyed.

    A gloo group closes its connections (so its peers' transfers fail at once) only when its
    last reference goes; the send works the communicator keeps in flight and the receive works
    held by the locals of the failed step's frames (in ``exception.__traceback__``) are such
    references. Without this a peer notices only when the failing process exits, by which time
    rank 0 can no longer serve the failure board.
    """
    import traceback

    if comm is not None:
        comm.drop_transfers()
    tb = exception.__traceback__
    if tb is not None:
        traceback.clear_frames(tb)


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:300]


def raise_if_loss_not_finite(board: FailureBoard, loss: Any, sink_losses: dict[tuple[str, int], Any]) -> None:
    """Stop every rank, with the same message, when a step's reduced loss is NaN or infinite.

    ``loss`` is the step's loss after the metrics all-reduce, so it is identical on every rank
    and every rank takes the same branch; only then (the failure path) the ranks gather which
    sink replica saw the first non-finite microbatch loss, with one object all-gather.
    ``sink_losses`` maps (sink module, microbatch) to this rank's unscaled loss values.
    """
    import torch
    import torch.distributed as dist

    if bool(torch.isfinite(loss).all()):
        return
    mine = [(k, module, float(value)) for (module, k), value in sorted(sink_losses.items(), key=lambda i: i[0][1])
            if not bool(torch.isfinite(value).all())]
    found: list[Any] = [mine]
    if board.world_size > 1 and dist.is_available() and dist.is_initialized():
        found = [None] * board.world_size
        dist.all_gather_object(found, mine)
    hits = sorted((k, rank, module, value) for rank, part in enumerate(found) for k, module, value in part)
    if hits:
        k, rank, module, value = hits[0]
        report = board.report(FailureKind.NON_FINITE_LOSS, message=f"computed a non-finite loss ({value}) for sink {module!r}",
                              microbatch=k, rank=rank)
    else:
        report = board.report(FailureKind.NON_FINITE_LOSS, message=f"step loss is {float(loss)}")
        report = FailureReport(-1, "all ranks", report.kind, "", report.message, report.step, None, report.phase)
    board.failed = True
    board.done_reading()  # every rank raises this same error: none needs rank 0's board afterwards
    raise PipelineError(
        f"{report.describe()}. The step's loss is {float(loss)}; stopping every rank before the optimizer step "
        "(lower the learning rate, clip gradients or check the inputs of that microbatch).",
        report=report,
    )
