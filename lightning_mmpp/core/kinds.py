"""The named choices of the pipeline, one spelling each (pure Python).

Every concept that users or layers pass around by name is a ``str`` enum here: the step kind,
the schedule, the stage numbering and the simulator's exchange model. Being ``str`` subclasses,
their members *are* their spellings: ``schedule="1f1b"`` and ``schedule=ScheduleName.ONE_F_ONE_B``
are the same argument, members compare equal to (and hash like) their values, and they print,
format and ``repr`` as their values, so messages quote them as the user wrote them. Parse a
user's value once, at the boundary, with :meth:`Choice.parse`: anything else raises
:class:`~lightning_mmpp.errors.PipelineConfigError` naming the choices.
"""

from __future__ import annotations

from enum import Enum
from typing import TypeVar

from lightning_mmpp.errors import PipelineConfigError

__all__ = ["DEFAULT_NUMBERING", "Choice", "Numbering", "ScheduleName", "SimulatorMode", "StepKind"]

_C = TypeVar("_C", bound="Choice")


class Choice(str, Enum):
    """Base of the named choices: a ``str`` enum that prints as its value and parses with a clear error."""

    @classmethod
    def label(cls) -> str:
        """What the choice is called in messages (``"schedule"``, ``"step kind"``, ...)."""
        return cls.__name__

    @classmethod
    def parse(cls: type[_C], value: object) -> _C:
        """The member for ``value`` (a member or its spelling); anything else is a
        :class:`~lightning_mmpp.errors.PipelineConfigError` naming the choices."""
        try:
            return cls(value)
        except ValueError:
            raise PipelineConfigError(
                f"unknown {cls.label()} {value!r}; choose one of {[c.value for c in cls]}."
            ) from None

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    def __repr__(self) -> str:
        return repr(self.value)


class StepKind(Choice):
    """What a pipeline step does: its schedule (training runs backwards), what it returns, and the
    key under which its metrics are reduced and logged (``train_loss``, ``val_loss``, ...)."""

    TRAIN = "train"
    VALIDATE = "val"
    TEST = "test"
    PREDICT = "predict"

    @classmethod
    def label(cls) -> str:
        return "step kind"

    @property
    def forward_only(self) -> bool:
        return self is not StepKind.TRAIN


class ScheduleName(Choice):
    """The schedules :func:`~lightning_mmpp.core.schedule.build_schedule` builds (see
    :mod:`lightning_mmpp.core.schedule` for what each does)."""

    ONE_F_ONE_B = "1f1b"
    GPIPE = "gpipe"
    ZERO_BUBBLE = "zero_bubble"
    INTERLEAVED_1F1B = "interleaved_1f1b"
    ZBV = "zbv"

    @classmethod
    def label(cls) -> str:
        return "schedule"

    @property
    def split_backward(self) -> bool:
        """Whether the schedule splits backwards into ``I`` and ``W`` (the zero-bubble family)."""
        return self in (ScheduleName.ZERO_BUBBLE, ScheduleName.ZBV)

    @property
    def v_shape(self) -> bool:
        """Whether modules with virtual stages place their chunks V-shaped (``"zbv"``) rather than
        interleaved (see :mod:`lightning_mmpp.core.placement`)."""
        return self is ScheduleName.ZBV


class Numbering(Choice):
    """How global stage indices are assigned on a DAG (see :mod:`lightning_mmpp.core.topology`):
    as late as possible (the default everywhere) or as soon as possible (Megatron's)."""

    ALAP = "alap"
    ASAP = "asap"

    @classmethod
    def label(cls) -> str:
        return "stage numbering"


# THE stage numbering: what the schedules, the runtime, the planner and ``PipelineLayout.table``
# use unless a caller picks another one.
DEFAULT_NUMBERING = Numbering.ALAP


class SimulatorMode(Choice):
    """How :func:`~lightning_mmpp.core.simulator.simulate` completes an exchange: ``"rendezvous"``
    (a send waits for its receive: the strict deadlock check), ``"eager"`` (sends complete at
    once; an exchange waits for the sends it receives from) or ``"overlap"`` (sends complete at
    once; an exchange only posts its receives, and the compute that consumes a message waits for
    its send: the runtime's overlap mode, the planner's timing model)."""

    RENDEZVOUS = "rendezvous"
    EAGER = "eager"
    OVERLAP = "overlap"

    @classmethod
    def label(cls) -> str:
        return "simulator mode"
