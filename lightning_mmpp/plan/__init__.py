"""Placement planner: from a short profile of the real model to the fastest layout that fits.

* :func:`profile_model` (torch) measures every layer of every module in one process and
  returns a :class:`ModelProfile` (saved as JSON with :meth:`ModelProfile.to_json`);
* :func:`plan_placements` (pure Python) searches pp, dp, colocation, split points,
  shard / recompute and microbatch counts, scores each candidate with the project's schedule
  simulator and returns the best :class:`Plan` s, each with its predicted step time, peak
  memory per rank and bubble, ready for ``MultiModulePipelineStrategy``;
* ``python -m lightning_mmpp.plan`` does both from the command line.

``profile_model`` loads on first use, so ``costs`` and ``search`` import without torch.
"""

from typing import Any

from lightning_mmpp.plan.costs import LayerProfile, ModelProfile, ModuleProfile
from lightning_mmpp.plan.search import Plan, chain_profile, plan_placements, plans_table

__all__ = ["LayerProfile", "ModelProfile", "ModuleProfile", "Plan", "chain_profile", "plan_placements",
           "plans_table", "profile_model"]


def __getattr__(name: str) -> Any:
    if name == "profile_model":
        from lightning_mmpp.plan.profile import profile_model

        return profile_model
    raise AttributeError(f"module 'lightning_mmpp.plan' has no attribute {name!r}")
