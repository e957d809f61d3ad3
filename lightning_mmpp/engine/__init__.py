"""The distributed engine: payloads and the communicator, the runtime that executes a rank's
actions, data-parallel gradient sync, FSDP2 sharding, tied weights, metrics, microbatching, the
failure board and traces; :class:`~lightning_mmpp.engine.engine.PipelineEngine` assembles them.

No Lightning import anywhere in this package: a plain PyTorch loop can drive it.
"""
