"""Wall-clock timing of work that may run on a GPU.

CUDA kernels run asynchronously: without draining the device before and after, a clock would
stop before the work does and charge it to whatever synchronises next.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def on_cuda(members: Sequence[Any]) -> bool:
    """Whether any member runs on a CUDA device."""
    return any(str(m.device).startswith("cuda") for m in members)


def sync_device(members: Sequence[Any]) -> None:
    """Wait for the members' queued CUDA work (a no-op on CPU)."""
    if on_cuda(members):
        torch.cuda.synchronize()


def timed(work: Callable[[], T], members: Sequence[Any] = ()) -> tuple[T, float]:
    """``work()`` and the seconds it took, the members' device drained before and after."""
    sync_device(members)
    start = time.perf_counter()
    result = work()
    sync_device(members)
    return result, time.perf_counter() - start
