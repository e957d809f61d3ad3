"""Exceptions raised for mistakes a user can make."""


class PipelineConfigError(ValueError):
    """A placement, topology, model or batch does not fit the multi-module pipeline.

    Raised before any collective, identically on every rank, with a message that names the
    module(s) involved and the fix.
    """


class PipelineError(RuntimeError):
    """A pipeline step failed because of something that happened on (possibly another) rank.

    Raised on a rank whose transfer failed or timed out, or whose peer died, and on every rank
    when a step's loss is not finite. The message starts with the root cause, e.g.
    ``"rank 2 (llm stage 1) raised ValueError: bad shape at step 2, microbatch 0"``; the rank's
    own transport error is chained as ``__cause__``. ``report`` holds the root cause as a
    :class:`lightning_mmpp.engine.failures.FailureReport` (``None`` when no rank reported one).
    """

    def __init__(self, message: str, report: object = None) -> None:
        super().__init__(message)
        self.report = report


class ExchangeMismatchError(RuntimeError):
    """A received message is not the one this rank expected: two ranks issued their exchanges
    with different messages or in a different order (or, under ``static_shapes``, a peer's
    payload changed). Raised by the communicator where it reads the message's header."""
