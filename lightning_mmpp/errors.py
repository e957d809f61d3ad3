"""Exceptions raised for mistakes a user can make."""


class PipelineConfigError(ValueError):
    """A placement, topology, model or batch does not fit the multi-module pipeline.

    Raised before any collective, identically on every rank, with a message that names the
    module(s) involved and the fix.
    """
