"""The kinds of pipeline step, one spelling everywhere (pure Python)."""

from __future__ import annotations

from enum import Enum

__all__ = ["StepKind"]


class StepKind(str, Enum):
    """What a pipeline step does: its schedule (training runs backwards), what it returns, and the
    key under which its metrics are reduced and logged (``train_loss``, ``val_loss``, ...)."""

    TRAIN = "train"
    VALIDATE = "val"
    TEST = "test"
    PREDICT = "predict"

    @property
    def forward_only(self) -> bool:
        return self is not StepKind.TRAIN

    @classmethod
    def parse(cls, value: "StepKind | str") -> "StepKind":
        """A ``StepKind`` from itself or its value; anything else is a ``ValueError`` naming the choices."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"step kind {value!r}: choose one of {[k.value for k in cls]}") from None
