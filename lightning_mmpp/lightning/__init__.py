"""The Lightning adapter: the strategy, its optimisation loop, launchers, precision/clipping
plugin and preemption. Lightning's private API is touched in :mod:`.lightning_api` alone."""
