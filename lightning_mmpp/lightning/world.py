"""The world of the strategy's processes: ranks, devices, the default process group and the
collectives Lightning asks a strategy for (``reduce``, ``barrier``, ``broadcast``).

Every rank runs one process; ``devices`` x ``num_nodes`` of them form the world the placements
need. The default process group is set up from Lightning's cluster environment (its own
launcher, torchrun, SLURM, ...) with gloo on CPU and NCCL on CUDA.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import Tensor
from torch.distributed import ReduceOp

from lightning_mmpp.lightning.lightning_api import default_backend, init_process_group, reduce_tensor

__all__ = ["PipelineWorld"]


class PipelineWorld:
    """Mixed into :class:`~lightning_mmpp.MultiModulePipelineStrategy` before ``ParallelStrategy``."""

    # provided by the strategy
    parallel_devices: Optional[list[torch.device]]
    cluster_environment: Any
    layout: Any
    _num_nodes: int
    _process_group_backend: Optional[str]
    _timeout: Any

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

    def setup_environment(self) -> None:
        super().setup_environment()  # type: ignore[misc]
        self.layout.check_world_size(self.world_size)  # user errors first, on every rank, before any collective
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._process_group_backend or default_backend(self.root_device)
        assert self.cluster_environment is not None
        init_process_group(self.cluster_environment, self._process_group_backend, self._timeout)

    # --- collectives Lightning asks for ----------------------------------------------------------

    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Union[ReduceOp, str]] = "mean") -> Any:
        return reduce_tensor(tensor, group, reduce_op) if isinstance(tensor, Tensor) else tensor

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if _distributed():
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]



def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()
