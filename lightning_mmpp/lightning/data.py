"""Every rank loads the same global batch: the DataLoader seen through the strategy."""

from __future__ import annotations

import os

from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

from lightning_mmpp.lightning.lightning_api import update_dataloader


def same_order_on_every_rank(dataloader: object) -> object:
    """Give a shuffling DataLoader the same order on every rank.

    A ``RandomSampler`` without its own generator draws from each process's global RNG, which
    differs across ranks; it is replaced by a sampler seeded from the run's seed
    (``seed_everything``, else 0) and re-shuffled each epoch. Sequential and user-seeded
    samplers are kept as they are. The shuffled order then differs from a single-process run
    of the unseeded sampler; for exact comparability give the sampler a seeded generator
    (``DataLoader(..., generator=torch.Generator().manual_seed(s))``), which is kept.
    """
    if (
        isinstance(dataloader, DataLoader)
        and isinstance(dataloader.sampler, RandomSampler)
        and dataloader.sampler.generator is None
        and not dataloader.sampler.replacement
    ):
        from lightning.pytorch.utilities.rank_zero import rank_zero_warn

        seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
        global _WARNED_SAMPLER
        if not _WARNED_SAMPLER:
            _WARNED_SAMPLER = True
            rank_zero_warn(
                f"MultiModulePipelineStrategy replaced the DataLoader's unseeded RandomSampler by one seeded with "
                f"{seed} (the seed_everything seed, else 0), reshuffled each epoch, so that every rank loads the same "
                "batches; the order differs from a single-process run. For the single-process order give the "
                "DataLoader a seeded generator, which is kept: DataLoader(..., shuffle=True, "
                "generator=torch.Generator().manual_seed(seed))."
            )
        sampler = DistributedSampler(dataloader.dataset, num_replicas=1, rank=0, shuffle=True, seed=seed)
        return update_dataloader(dataloader, sampler)
    return dataloader


_WARNED_SAMPLER = False  # the sampler replacement is stated once per process
