"""Data-parallel runs: ``accelerate launch -m lm_eval --model safe-ensemble ...``.

lm-eval shards documents by ``rank``/``world_size`` and calls ``all_gather``, ``gather_object``
and ``barrier`` on the model; every process holds all members on its own device. Nothing here
is imported in a single-process run.
"""

from __future__ import annotations

import atexit
import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

logger = logging.getLogger(__name__)


def launched_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


@dataclass
class ProcessGroup:
    """This process's place in a data-parallel run (rank 0 of 1 when not launched)."""

    backend: Any = None  # torch.distributed once initialised
    rank: int = 0
    world_size: int = 1
    device: str | None = None  # the device accelerate assigned to this process, if a GPU

    @classmethod
    def from_environment(cls) -> ProcessGroup:
        """Join the process group that ``accelerate launch``/``torchrun`` set up in the environment.

        torch.distributed is used directly rather than ``accelerate.Accelerator``: on CPU the
        latter reports a single process under torchrun unless configured for MULTI_CPU, while
        the launcher's environment (RANK, WORLD_SIZE, MASTER_ADDR) is all a process group needs.
        """
        if launched_world_size() <= 1:
            return cls()
        import torch
        import torch.distributed as dist

        use_cuda = torch.cuda.is_available()
        if not dist.is_initialized():
            dist.init_process_group(backend="nccl" if use_cuda else "gloo", timeout=timedelta(weeks=4))
            # a group left to the interpreter's teardown can abort a rank at exit (seen once in
            # CI: gloo's threads destroyed while joinable, "terminate called without an active
            # exception", SIGABRT after the results were written); the group we made, we end
            atexit.register(_destroy_process_group)
        rank, world = dist.get_rank(), dist.get_world_size()
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        device = None
        if use_cuda:
            device = f"cuda:{local_rank % torch.cuda.device_count()}"
            torch.cuda.set_device(device)
        elif "OMP_NUM_THREADS" not in os.environ:
            # CPU processes share the machine's cores; oversubscription makes every rank slower
            local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
        logger.info("data parallel: rank %d of %d", rank, world)
        return cls(dist, rank, world, device)

    def all_gather(self, tensor: Any) -> Any:
        if self.world_size <= 1:
            return tensor
        import torch

        parts = [torch.zeros_like(tensor) for _ in range(self.world_size)]
        self.backend.all_gather(parts, tensor)
        return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        if self.world_size <= 1:
            return [obj]
        result = [None] * self.world_size if self.rank == dst else None
        self.backend.gather_object(obj=obj, object_gather_list=result, dst=dst)
        return result

    def all_gather_object(self, obj: Any) -> list[Any]:
        if self.world_size <= 1:
            return [obj]
        result: list[Any] = [None] * self.world_size
        self.backend.all_gather_object(result, obj)
        return result

    def barrier(self) -> None:
        if self.world_size > 1:
            self.backend.barrier()


class AcceleratorView:
    """What lm-eval 0.4.9's evaluator asks of ``lm.accelerator`` in a data-parallel run (it
    gathers request counts and waits after each request type; 0.4.10+ calls the model's own
    ``all_gather`` and ``barrier``): the same two collectives, through the model, so the
    statistics are summed in ``barrier`` under either lm-eval."""

    def __init__(self, lm: Any):
        self._lm = lm

    def gather(self, tensor: Any) -> Any:
        return self._lm.all_gather(tensor)

    def wait_for_everyone(self) -> None:
        self._lm.barrier()


def _destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
