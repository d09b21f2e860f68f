"""Linear layers over a few rows on CPU: the matrix-matrix form where this machine is faster.

Decoding feeds a model one token per row (the drafter) or a handful (a verifier's window).
On some CPUs' BLAS a float32 ``F.linear`` over one to a few rows takes the matrix-vector path,
which streams the whole weight once *per row*: Gemma-3's 262k x 640 output layer then costs
~45 ms for one row and ~90 ms for two, but ~16-30 ms when the same product is written
``W @ X^T`` (a matrix-matrix product; one row is padded to two, since a lone column goes
back to the slow path). Whether and for which row counts that pays depends on the machine, the
thread count and the shape, so each member's distinct weight shapes are timed both ways the
first time they are used with a given thread count, and the choice is cached on disk per
machine (``fast_small_linear=auto``). ``on`` takes the matrix-matrix form for every row count
up to :data:`MAX_ROWS` without timing; ``off`` leaves the model untouched.

The forms are active only inside :meth:`SmallRowLinears.active` (the decoder's and scorer's
forwards): anything else calling the same model object, e.g. lm-eval's ``hf`` backend in a
side-by-side benchmark, runs transformers' own code. Results differ from ``F.linear`` only by
float rounding (a different summation order).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from lm_eval_safe.disk_cache import atomic_write_json

logger = logging.getLogger(__name__)

MAX_ROWS = 8
# ``auto`` takes the matrix-matrix form only where it is clearly faster, both relatively and in
# absolute terms: timing noise on small shapes must not flip a model's numerics from run to run.
MIN_SPEEDUP = 1.25
MIN_SAVING_SECONDS = 20e-6
_ATTR = "_lm_eval_safe_mm_rows"


def matrix_form(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed as ``weight @ rows^T`` (one row padded to two)."""
    rows = x.numel() // x.shape[-1]
    flat = x.reshape(rows, x.shape[-1])
    if rows == 1:
        flat = flat.repeat(2, 1)
    # in F.linear's row-major layout: a transposed view would make every reduction over the
    # output's last dimension (the log-softmax over a 262k vocabulary) take the strided path,
    # several times slower than this one copy
    out = torch.mm(weight, flat.t()).t()[:rows].contiguous()
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _small_row_forward(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1] if x.dim() else 0
    if rows in getattr(module, _ATTR):
        return matrix_form(x, module.weight, module.bias)
    return F.linear(x, module.weight, module.bias)


def _time(fn: Any, repeats: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


@torch.inference_mode()
def measure_rows(weight: torch.Tensor, bias: torch.Tensor | None) -> list[int]:
    """Row counts (1..MAX_ROWS) at which the matrix-matrix form is clearly faster for this
    weight on this machine, at the current thread count."""
    faster = []
    for rows in range(1, MAX_ROWS + 1):
        x = torch.randn(1, rows, weight.shape[1], dtype=weight.dtype)
        plain = _time(lambda: F.linear(x, weight, bias))  # noqa: B023
        matrix = _time(lambda: matrix_form(x, weight, bias))  # noqa: B023
        if matrix * MIN_SPEEDUP < plain and plain - matrix > MIN_SAVING_SECONDS:
            faster.append(rows)
    return faster


def machine_key() -> str:
    """What the timing depends on: the CPU model, torch's version and its thread count."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            cpu = next((line.split(":", 1)[1].strip() for line in info if "model name" in line), cpu)
    except OSError:
        pass
    text = f"{cpu}|{os.cpu_count()}|torch {torch.__version__}|threads {torch.get_num_threads()}"
    return hashlib.sha1(text.encode()).hexdigest()[:16]


class SmallRowLinears:
    """The small-row forms of one member's linear layers, resolved per thread count. ``mode``
    is the ``fast_small_linear`` option's value, checked where the option is parsed (its one
    list of modes)."""

    def __init__(self, model: Any, mode: str, cache_dir: Path | None, name: str = "member"):
        self.mode = mode
        self.cache_dir = cache_dir
        self.name = name
        self.modules: dict[tuple[Any, ...], list[torch.nn.Linear]] = {}
        self._plans: dict[int, dict[tuple[Any, ...], frozenset[int]]] = {}
        self._depth = 0
        if mode == "off":
            return
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.weight.device.type == "cpu":
                key = (*module.weight.shape, str(module.weight.dtype), module.bias is not None)
                self.modules.setdefault(key, []).append(module)
                setattr(module, _ATTR, frozenset())
                module.forward = _small_row_forward.__get__(module)  # type: ignore[method-assign]

    @contextmanager
    def active(self) -> Iterator[None]:
        """Use the small-row forms for forwards run inside this block."""
        if not self.modules:
            yield
            return
        if self._depth == 0:
            for key, rows in self._plan().items():
                for module in self.modules[key]:
                    setattr(module, _ATTR, rows)
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                for modules in self.modules.values():
                    for module in modules:
                        setattr(module, _ATTR, frozenset())

    def _plan(self) -> dict[tuple[Any, ...], frozenset[int]]:
        threads = torch.get_num_threads()
        if threads not in self._plans:
            if self.mode == "on":
                every = frozenset(range(1, MAX_ROWS + 1))
                self._plans[threads] = {key: every for key in self.modules}
            else:
                self._plans[threads] = self._measured_plan()
        return self._plans[threads]

    def _measured_plan(self) -> dict[tuple[Any, ...], frozenset[int]]:
        path = None
        stored: dict[str, list[int]] = {}
        if self.cache_dir is not None:
            path = self.cache_dir / "small-rows" / f"{machine_key()}.json"
            try:
                stored = json.loads(path.read_text())
            except (OSError, ValueError):
                stored = {}
        plan = {}
        measured = False
        start = time.perf_counter()
        for key, modules in self.modules.items():
            text = json.dumps(list(key))
            if text not in stored or not isinstance(stored[text], list):
                stored[text] = measure_rows(modules[0].weight, modules[0].bias)
                measured = True
            plan[key] = frozenset(int(r) for r in stored[text])
        if measured:
            logger.info(
                "fast_small_linear=auto: timed %s's linear shapes in %.1fs; matrix-matrix form at rows %s",
                self.name,
                time.perf_counter() - start,
                {f"{k[0]}x{k[1]}": sorted(v) for k, v in plan.items() if v},
            )
            if path is not None:
                _write_json(path, stored)
        return plan


def _write_json(path: Path, data: Any) -> None:
    """Replace ``path`` atomically: another process timing the same machine at once can only
    lose its own, equivalent, entries; a cache that cannot be written costs a warning, not the
    run."""
    try:
        atomic_write_json(path, data, sort_keys=True)
    except OSError as exc:
        logger.warning("could not cache small-row timings in %s: %s", path, exc)

