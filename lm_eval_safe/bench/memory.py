"""How much memory a run holds: the process's RSS (peak and current), live torch tensors, and a
probe that samples them while lm-eval's requests finish.

``tracemalloc`` does not see torch's allocations, so it is not used; the OS's numbers and the
tensors' own storages are what tell whether a run grows per request.
"""

from __future__ import annotations

import gc
import resource
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from lm_eval.api.model import CacheHook

MIB = 1 << 20


def max_rss_mib() -> float:
    """Process peak RSS in MiB (Linux reports KiB, macOS bytes). Monotone: it only shows which
    step first raised the peak."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


def rss_mib() -> float | None:
    """Current resident set size of this process (not the peak) in MiB; None where neither
    ``/proc`` nor psutil can tell."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    try:
        import psutil  # not Linux: psutil, if it is installed
    except ImportError:
        return None
    return psutil.Process().memory_info().rss / MIB


def trimmed_rss_mib() -> float | None:
    """RSS after asking glibc to return freed heap pages to the OS (``malloc_trim``).

    Plain RSS also counts memory the allocator keeps after ``free`` (fragmentation from
    tensors of ever-changing sizes); if RSS grows but trimmed RSS does not, nothing is alive
    that should not be. Elsewhere (no glibc) this is plain RSS."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    return rss_mib()


def live_tensor_mib() -> float:
    """Bytes of every live torch tensor's storage, each storage counted once, in MiB."""
    import torch

    seen: set[int] = set()
    total = 0
    with warnings.catch_warnings():  # isinstance on deprecated torch objects warns
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            try:
                if not isinstance(obj, torch.Tensor):
                    continue
                storage = obj.untyped_storage()
            except Exception:  # noqa: BLE001 - exotic objects (lazy modules, meta tensors)
                continue
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total / MIB


def _rounded(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


class MemoryProbe(CacheHook):
    """lm-eval's cache hook (without a cache) that samples memory when the n-th request ends.

    Samples are taken from the hook lm-eval itself hands the model (``add_partial``), so a
    run stays one ``generate_until`` call, as in lm-eval, instead of many small ones."""

    def __init__(self, at: list[int]):
        super().__init__(None)
        self.at = set(at)
        self.done = 0
        self.samples: dict[int, dict[str, Any]] = {}

    def add_partial(self, attr: str, req: Any, res: Any) -> None:
        self.done += 1
        if self.done in self.at:
            gc.collect()
            self.samples[self.done] = {
                "rss_mib": _rounded(rss_mib(), 1),
                "trimmed_rss_mib": _rounded(trimmed_rss_mib(), 1),
                "tensor_mib": round(live_tensor_mib(), 2),
                "objects": len(gc.get_objects()),
                "seconds": round(time.perf_counter(), 1),
            }
            print(
                f"after {self.done} requests: {self.samples[self.done]}",
                file=sys.stderr,
                flush=True,
            )


def generate_with_probe(
    lm: Any, contexts: list[str], max_new_tokens: int, at: list[int]
) -> tuple[MemoryProbe, list[str]]:
    """Generate one request per context in one ``generate_until`` call, sampling memory after
    the request counts in ``at``."""
    from lm_eval.api.instance import Instance

    probe = MemoryProbe(at)
    lm.set_cache_hook(probe)
    requests = [
        Instance("generate_until", {}, (c, {"until": [], "max_gen_toks": max_new_tokens}), i)
        for i, c in enumerate(contexts)
    ]
    return probe, lm.generate_until(requests, disable_tqdm=True)
