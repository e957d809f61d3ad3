"""The action IR: what a rank does in one pipeline step, as plain data with a text form.

Pure Python (no torch): schedules are built (:mod:`lightning_mmpp.core.schedule`), checked and timed
(:mod:`lightning_mmpp.core.simulator`) and executed (:mod:`lightning_mmpp.engine.runtime`) from these types.

* :class:`Phase` — the kind of a compute: ``F`` forward, ``B`` fused backward, ``I`` the
  input-gradient half of a split backward, ``W`` the weight-gradient half. (The letters are
  torch.distributed.pipelining's: ``B`` is the *full* backward there too; the Zero Bubble paper
  calls the input half "B".) A stage whose inputs need no gradient runs a ``W`` without an
  ``I``: its whole backward is weight gradients, and nothing upstream waits for it.
* :class:`MessageKey` — one logical message ``(direction, src_module, dst_module,
  microbatch)`` (and the chunks at both ends under virtual stages); the communicator carries
  payloads under this key.
* :class:`Transfer` — a message seen from one end: its key plus the rank at the other end.
* :class:`Compute` and :class:`Exchange` — the two actions; :class:`Schedule` — the per-rank
  action lists of one step.

Text form (``str()`` of each, parsed back by :func:`parse_action` / :meth:`Schedule.from_text`)::

    F3:llm                      forward of microbatch 3 of this rank's stage of llm
    F3:llm.1                    the same on the rank's chunk 1 of llm (virtual stages)
    B3:llm  I3:llm  W3:llm      fused backward, input-gradient half, weight-gradient half
    vision->llm#1@2             forward transfer of microbatch 1 on edge vision -> llm, peer rank 2
    vision<-llm#1@2             the gradient of that message (backward direction)
    llm->llm.1#1@0              from the sender's chunk 0 to the receiver's chunk 1 of llm
    X(send[a->a#0@1] recv[])    one exchange: transfers posted together as one batch

A whole schedule is a header line and one line per rank::

    schedule name=1f1b num_microbatches=2 forward_only=false world_size=2
    rank 0: F0:a X(send[a->a#0@1] recv[]) ...
    rank 1: ...

:meth:`Schedule.to_csv` / :meth:`Schedule.from_csv` store one row per action per rank, for a
spreadsheet or a hand edit. A schedule read back from text or CSV is only parsed here; check
it against a layout with :func:`lightning_mmpp.core.simulator.validate_schedule` (or load it with
:func:`lightning_mmpp.core.schedule.load_schedule`, which does) before running it.
"""

from __future__ import annotations

import csv
import enum
import io
import re
from dataclasses import dataclass
from typing import Any, Union


class Direction(enum.Enum):
    """Which way a message travels: activations forward, gradients backward."""

    FORWARD = "forward"
    BACKWARD = "backward"

    # members are singletons: hash by identity (C-level) instead of Enum's Python-level hash of
    # the name, computed for every message key on the hot path of a step
    __hash__ = object.__hash__

    def __lt__(self, other: "Direction") -> bool:  # canonical order for sorting keys
        return self.value > other.value  # forward before backward

    @property
    def arrow(self) -> str:
        return "->" if self is Direction.FORWARD else "<-"


class Phase(enum.Enum):
    """The kind of a :class:`Compute`; the value is its letter in the text form."""

    FORWARD = "F"
    BACKWARD = "B"  # fused: input and weight gradients in one autograd call
    BACKWARD_INPUT = "I"  # gradient w.r.t. the stage inputs; the graph is kept for W
    BACKWARD_WEIGHT = "W"  # gradient w.r.t. the stage parameters (the whole backward without an I)

    @property
    def is_backward(self) -> bool:
        return self is not Phase.FORWARD


@dataclass(frozen=True, order=True)
class MessageKey:
    """One logical message of a microbatch.

    ``src_module`` produces the forward activation; ``dst_module`` consumes it (equal for a
    transfer between consecutive stages of one module). The gradient of that activation
    travels back under the same key with ``direction=BACKWARD``. ``src_chunk`` / ``dst_chunk``
    say which of its rank's chunks of the module produces / consumes it (0 unless the module
    has virtual stages); the text form shows a non-zero chunk as ``module.chunk``.
    """

    direction: Direction
    src_module: str
    dst_module: str
    microbatch: int
    src_chunk: int = 0
    dst_chunk: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.direction, Direction):
            raise TypeError(f"MessageKey.direction must be a Direction, got {self.direction!r}")
        # hashed once: the communicator and the runtime key several dicts by it per message
        object.__setattr__(self, "_hash", hash((self.direction.value, self.src_module, self.dst_module,
                                                 self.microbatch, self.src_chunk, self.dst_chunk)))

    def __hash__(self) -> int:
        return self._hash  # type: ignore[attr-defined, no-any-return]

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # rebuilt by the constructor: a string's hash differs between processes
        return (MessageKey, (self.direction, self.src_module, self.dst_module, self.microbatch, self.src_chunk,
                             self.dst_chunk))

    @property
    def edge(self) -> tuple[str, str, int, int, int]:
        """``(src_module, dst_module, microbatch, src_chunk, dst_chunk)``: the key without its direction."""
        return (self.src_module, self.dst_module, self.microbatch, self.src_chunk, self.dst_chunk)

    @property
    def producer(self) -> tuple[str, int]:
        """``(module, chunk)`` of the stage that computes the activation."""
        return (self.src_module, self.src_chunk)

    @property
    def consumer(self) -> tuple[str, int]:
        """``(module, chunk)`` of the stage that receives the activation."""
        return (self.dst_module, self.dst_chunk)

    def __str__(self) -> str:
        src = _chunk_name(self.src_module, self.src_chunk)
        dst = _chunk_name(self.dst_module, self.dst_chunk)
        return f"{src}{self.direction.arrow}{dst}#{self.microbatch}"


def _chunk_name(module: str, chunk: int) -> str:
    """``module`` for chunk 0, ``module.chunk`` otherwise (the text form)."""
    return f"{module}.{chunk}" if chunk else module


@dataclass(frozen=True, order=True)
class Transfer:
    """A message seen from one end: ``key`` and the rank at the other end (this rank itself for
    colocated modules)."""

    key: MessageKey
    peer: int

    @property
    def direction(self) -> Direction:
        return self.key.direction

    @property
    def src_module(self) -> str:
        return self.key.src_module

    @property
    def dst_module(self) -> str:
        return self.key.dst_module

    @property
    def microbatch(self) -> int:
        return self.key.microbatch

    def mirror(self, rank: int) -> "Transfer":
        """The same message seen from the peer, when this end is ``rank``."""
        return Transfer(self.key, rank)

    def __str__(self) -> str:
        return f"{self.key}@{self.peer}"


@dataclass(frozen=True)
class Compute:
    """Run one phase of ``microbatch`` for this rank's stage of ``module`` (its ``chunk``-th
    stage of the module under virtual stages)."""

    phase: Phase
    module: str
    microbatch: int
    chunk: int = 0

    @property
    def unit(self) -> tuple[str, int]:
        """``(module, chunk)``: which of the rank's stages runs it."""
        return (self.module, self.chunk)

    def __str__(self) -> str:
        return f"{self.phase.value}{self.microbatch}:{_chunk_name(self.module, self.chunk)}"


@dataclass(frozen=True)
class Exchange:
    """Transfers posted as one batch: ``sends`` go to, ``recvs`` come from, their ``peer``."""

    sends: tuple[Transfer, ...]
    recvs: tuple[Transfer, ...]

    def __str__(self) -> str:
        return f"X(send[{' '.join(map(str, self.sends))}] recv[{' '.join(map(str, self.recvs))}])"


Action = Union[Compute, Exchange]


class ScheduleParseError(ValueError):
    """A schedule's text or CSV form is malformed."""


_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
_COMPUTE_RE = re.compile(rf"([FBIW])(\d+):({_NAME})(?:\.(\d+))?")
_TRANSFER_RE = re.compile(rf"({_NAME})(?:\.(\d+))?(->|<-)({_NAME})(?:\.(\d+))?#(\d+)@(\d+)")
_EXCHANGE_RE = re.compile(r"X\(send\[([^\]]*)\] recv\[([^\]]*)\]\)")
_TOKEN_RE = re.compile(r"X\([^)]*\)|\S+")


def parse_transfer(text: str) -> Transfer:
    """Parse ``src->dst#k@peer`` (forward) or ``src<-dst#k@peer`` (backward)."""
    match = _TRANSFER_RE.fullmatch(text.strip())
    if match is None:
        raise ScheduleParseError(f"not a transfer: {text!r} (expected e.g. 'vision->llm#0@2' or 'vision<-llm#0@2')")
    src, src_chunk, arrow, dst, dst_chunk, k, peer = match.groups()
    direction = Direction.FORWARD if arrow == "->" else Direction.BACKWARD
    key = MessageKey(direction, src, dst, int(k), int(src_chunk or 0), int(dst_chunk or 0))
    return Transfer(key, int(peer))


def _parse_transfers(text: str) -> tuple[Transfer, ...]:
    return tuple(parse_transfer(t) for t in text.split())


def parse_action(text: str) -> Action:
    """Parse the ``str()`` of a :class:`Compute` or an :class:`Exchange`."""
    text = text.strip()
    match = _COMPUTE_RE.fullmatch(text)
    if match is not None:
        letter, k, module, chunk = match.groups()
        return Compute(Phase(letter), module, int(k), int(chunk or 0))
    match = _EXCHANGE_RE.fullmatch(text)
    if match is not None:
        return Exchange(_parse_transfers(match.group(1)), _parse_transfers(match.group(2)))
    raise ScheduleParseError(
        f"not an action: {text!r} (expected e.g. 'F0:llm', 'W3:llm' or 'X(send[a->a#0@1] recv[])')"
    )


def _parse_flag(value: str) -> bool:
    if value.lower() in ("true", "1", "yes"):
        return True
    if value.lower() in ("false", "0", "no"):
        return False
    raise ScheduleParseError(f"not a boolean: {value!r}")


def _parse_header(line: str) -> tuple[str, int, bool, int]:
    """``schedule name=.. num_microbatches=.. forward_only=.. world_size=..`` -> its four values."""
    if not line.startswith("schedule "):
        raise ScheduleParseError(f"a schedule starts with 'schedule name=... num_microbatches=...', got {line!r}")
    meta = dict(field.split("=", 1) for field in line.split()[1:] if "=" in field)
    try:
        return meta["name"], int(meta["num_microbatches"]), _parse_flag(meta["forward_only"]), int(meta["world_size"])
    except (KeyError, ValueError) as err:
        raise ScheduleParseError(f"bad schedule header {line!r}: missing or bad {err}") from None


@dataclass(frozen=True)
class Schedule:
    """Per-rank action lists of one step."""

    name: str
    num_microbatches: int
    forward_only: bool
    actions: tuple[tuple[Action, ...], ...]

    @property
    def world_size(self) -> int:
        return len(self.actions)

    def for_rank(self, rank: int) -> tuple[Action, ...]:
        return self.actions[rank]

    def render(self, rank: int) -> str:
        """The actions of ``rank``, space-separated, in text form."""
        return " ".join(str(a) for a in self.actions[rank])

    # --- text ------------------------------------------------------------------------------

    def _header(self) -> str:
        return (
            f"schedule name={self.name} num_microbatches={self.num_microbatches} "
            f"forward_only={str(self.forward_only).lower()} world_size={self.world_size}"
        )

    def to_text(self) -> str:
        """A header line and one ``rank r: ...`` line per rank; :meth:`from_text` reads it back."""
        return "\n".join([self._header()] + [f"rank {r}: {self.render(r)}" for r in range(self.world_size)])

    __str__ = to_text

    @classmethod
    def from_text(cls, text: str) -> "Schedule":
        """Parse :meth:`to_text` output (blank lines and ``#`` comments are ignored)."""
        lines = [line.strip() for line in text.splitlines()]
        lines = [line for line in lines if line and not line.startswith("#")]
        if not lines:
            raise ScheduleParseError("empty schedule text")
        name, m, forward_only, world = _parse_header(lines[0])
        per_rank: dict[int, tuple[Action, ...]] = {}
        for line in lines[1:]:
            match = re.fullmatch(r"rank (\d+):(.*)", line)
            if match is None:
                raise ScheduleParseError(f"expected 'rank <r>: <actions>', got {line!r}")
            rank = int(match.group(1))
            if rank in per_rank:
                raise ScheduleParseError(f"rank {rank} is listed twice")
            per_rank[rank] = tuple(parse_action(tok) for tok in _TOKEN_RE.findall(match.group(2)))
        if sorted(per_rank) != list(range(world)):
            raise ScheduleParseError(f"the header says world_size={world} but ranks {sorted(per_rank)} are listed")
        return cls(name, m, forward_only, tuple(per_rank[r] for r in range(world)))

    # --- CSV ---------------------------------------------------------------------------------

    CSV_COLUMNS = ("rank", "index", "action", "module", "microbatch", "sends", "recvs")

    def to_csv(self) -> str:
        """One row per action per rank (columns :attr:`CSV_COLUMNS`), after a ``#`` header line.

        ``action`` is ``F``/``B``/``I``/``W`` for a compute (with ``module``, ``microbatch`` and
        ``chunk``) or ``X`` for an exchange (with space-separated ``sends`` / ``recvs``). The
        ``chunk`` column follows the others only when some compute runs a chunk other than 0
        (virtual stages); a missing one reads as chunk 0.
        """
        out = io.StringIO()
        out.write(f"# {self._header()}\n")
        writer = csv.writer(out, lineterminator="\n")
        chunked = any(isinstance(a, Compute) and a.chunk for actions in self.actions for a in actions)
        writer.writerow(self.CSV_COLUMNS + (("chunk",) if chunked else ()))
        extra = lambda chunk: [chunk] if chunked else []  # noqa: E731
        for rank, actions in enumerate(self.actions):
            for index, action in enumerate(actions):
                if isinstance(action, Compute):
                    writer.writerow([rank, index, action.phase.value, action.module, action.microbatch, "", ""]
                                    + extra(action.chunk))
                else:
                    sends = " ".join(map(str, action.sends))
                    recvs = " ".join(map(str, action.recvs))
                    writer.writerow([rank, index, "X", "", "", sends, recvs] + extra(""))
        return out.getvalue()

    @classmethod
    def from_csv(cls, text: str) -> "Schedule":
        """Parse :meth:`to_csv` output. Rows are ordered by ``(rank, index)``; gaps in
        ``index`` are fine (a hand edit may delete or insert rows with fractional or spaced
        indices)."""
        lines = text.splitlines()
        header = next((line for line in lines if line.startswith("# schedule ")), None)
        if header is None:
            raise ScheduleParseError("the CSV lacks its '# schedule name=... num_microbatches=...' first line")
        numbered = [(n, line) for n, line in enumerate(lines, start=1) if line.strip() and not line.startswith("#")]
        if not numbered:
            raise ScheduleParseError("the CSV has no column header")
        rows = list(csv.DictReader(line for _, line in numbered))  # one line per row: no quoted newlines
        line_numbers = [n for n, _ in numbered[1:]]
        name, m, forward_only, world = _parse_header(header[2:])
        per_rank: dict[int, list[tuple[float, Action]]] = {r: [] for r in range(world)}
        for line_no, row in zip(line_numbers, rows):
            try:
                rank, index, kind = int(row["rank"]), float(row["index"]), row["action"].strip()
                if kind == "X":
                    action: Action = Exchange(_parse_transfers(row["sends"] or ""), _parse_transfers(row["recvs"] or ""))
                else:
                    chunk = int(row.get("chunk") or 0)
                    action = Compute(Phase(kind), row["module"].strip(), int(row["microbatch"]), chunk)
            except (KeyError, TypeError, ValueError) as err:
                raise ScheduleParseError(f"CSV line {line_no} {row!r}: {err}") from None
            if rank not in per_rank:
                raise ScheduleParseError(f"CSV line {line_no}: rank {rank} is outside world_size={world}")
            per_rank[rank].append((index, action))
        actions = tuple(tuple(a for _, a in sorted(per_rank[r], key=lambda p: p[0])) for r in sorted(per_rank))
        return cls(name, m, forward_only, actions)
