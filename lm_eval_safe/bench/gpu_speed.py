"""The speed part of ``scripts/check_gpu.sh``: SAFE's time per generated token at realistic
sizes against transformers ``generate`` of the drafter alone, at batch 1 and 8.

Why these pairs: a drafter of Llama-3-8B's shape with a verifier of SmolLM2-1.7B's and another
tokenizer is the paper's setting (random members disagree almost everywhere: the worst case of
ensembling, E/T near its ceiling); the same 8B shape twice, one copy perturbed slightly, is
two members of one family that agree at most positions (the case SAFE's skips are for).

Each row is timed with the transformers engine's ``ForwardClock`` (its instruments), the clock of
``lm-eval-safe bench host`` (CUDA events on the members' stream): wall time, the device time
inside the members' forwards, and from them the host milliseconds per token (the device's time
outside the forwards) and the forward-time share (forward time over wall time; with
``overlap=on`` a verifier thread's forwards may interleave with the drafter's on one stream, so
the share counts some time twice and reads high, the host time low). An interval of a forward
counts the device waiting for the host's launches inside it too, so the GPU's busy share is the
driver's own utilisation (NVML), which counts only time a kernel ran. Every method runs once untimed at its batch size first
(kernels, cuBLAS plans, the union vocabulary); EOS is masked so every row generates its budget.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from lm_eval_safe.bench.eos import mask_eos
from lm_eval_safe.bench.gpu_check import Settings, total_stats
from lm_eval_safe.bench.gpu_members import (
    SHAPES,
    as_member,
    build_model,
    load_tokenizers,
    parameter_count,
    perturbed_copy,
)
from lm_eval_safe.bench.timing import sync_device
from lm_eval_safe.decoder.loop import GenerationJob, SafeDecoder
from lm_eval_safe.engines import instruments
from lm_eval_safe.members.member import Member
from lm_eval_safe.options import parse_options

logger = logging.getLogger("check_gpu")

#: method -> SafeDecoder options (None: transformers ``generate`` of the drafter alone)
METHODS: dict[str, dict[str, Any] | None] = {
    "generate": None,
    "drafter": {"schedule": "drafter"},
    "safe": {"schedule": "safe", "aggregator": "unite", "overlap": "off"},
    "safe_overlap": {"schedule": "safe", "aggregator": "unite", "overlap": "on"},
}


def batched_generate(decoder: SafeDecoder, jobs: list[GenerationJob]) -> list[list[int]]:
    """transformers ``generate`` of the drafter over all ``jobs`` at once (left-padded), greedy."""
    drafter = decoder.drafter
    prompts = [decoder.prompt_ids(drafter, job.context, job.max_new_tokens) for job in jobs]
    pad = drafter.tokenizer.pad_token_id
    return instruments(drafter).generate(drafter, prompts, jobs[0].max_new_tokens, pad, own_eos=False)


class Utilisation:
    """The driver's own GPU utilisation (NVML: the share of time a kernel ran, over its last
    sample window), polled every 50 ms while a run lasts and averaged: a busy share that needs
    no clock of ours and stays right when forwards of two threads interleave (``overlap=on``).
    None off CUDA or without NVML."""

    def __init__(self, device: str) -> None:
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._handle = None
        if device.startswith("cuda"):
            try:
                import pynvml

                pynvml.nvmlInit()
                self._handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
                self._read = pynvml.nvmlDeviceGetUtilizationRates
            except Exception as exc:  # no NVML: the column stays empty, the run goes on
                logger.info("no NVML utilisation: %s", exc)
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        try:
            while not self._stop.wait(0.05):
                self.samples.append(self._read(self._handle).gpu)
        except Exception as exc:  # a driver that refuses the query: no column, same run
            logger.info("NVML utilisation stopped: %s", exc)

    def __enter__(self) -> Utilisation:
        if self._handle is not None:
            self._thread.start()
        return self

    def __exit__(self, *_exc: Any) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    @property
    def percent(self) -> float | None:
        return round(sum(self.samples) / len(self.samples), 1) if self.samples else None


def clocked(members: list[Member], work: Callable[[], Any]) -> tuple[Any, float, float, float | None]:
    """``work()``, its wall seconds, the device seconds inside the members' forwards, and the
    driver's utilisation percent over the run."""
    clock = instruments(members[0]).ForwardClock(members)
    try:
        clock.watch.settle()
        with Utilisation(str(clock.watch.device)) as utilisation:
            start = time.perf_counter()
            result = work()
            clock.watch.settle()
            wall = time.perf_counter() - start
        return result, wall, clock.seconds, utilisation.percent
    finally:
        clock.close()


def run_method(method: str, members: list[Member], jobs: list[GenerationJob], batch: int) -> dict[str, Any]:
    """One method over ``jobs`` at ``batch`` rows (batch 1: one job after another)."""
    names = [m.name for m in members]
    overrides = METHODS[method]
    decoder = SafeDecoder(members, 0, parse_options({"members": names, **(overrides or {"schedule": "drafter"})}))

    def work() -> Any:
        if overrides is not None:
            return decoder.generate_many(jobs, batch)
        return [ids for i in range(0, len(jobs), batch) for ids in batched_generate(decoder, jobs[i : i + batch])]

    warm = [GenerationJob(job.context, [], 4) for job in jobs[:batch]]
    if overrides is None:
        batched_generate(decoder, warm)
    else:
        decoder.generate_many(warm, batch)
    result, wall, forwards, utilisation = clocked(members, work)
    row: dict[str, Any] = {"method": method, "batch": batch}
    if overrides is None:
        tokens = sum(len(ids) for ids in result)
    else:
        stats = total_stats(result)
        tokens = stats.generated_tokens
        row |= {
            "ensemble_rate_percent": round(stats.ensemble_rate, 2),
            "acceptance": round(stats.acceptance_rate, 3),
            "ensemble_ops": stats.ensemble_ops,
            "cycles": stats.cycles,
        }
    return row | {
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "ms_per_token": round(1e3 * wall / max(1, tokens), 3),
        "host_ms_per_token": round(1e3 * (wall - forwards) / max(1, tokens), 3),
        "forward_time_share": round(forwards / wall, 3) if wall else None,
        "gpu_util_percent_nvml": utilisation,
    }


def time_pair(
    label: str, members: list[Member], settings: Settings, tokens: dict[int, int], rows: list[dict[str, Any]], on_row: Callable[[], None]
) -> None:
    """Every method at batch 1 (two prompts) and batch 8 (eight) into ``rows``, each row's time
    per token also as a ratio to ``generate``'s; ``on_row`` after each (the part's JSON is
    rewritten, so a run stopped at its time limit keeps the rows it has)."""
    for batch, new_tokens in tokens.items():
        jobs = settings.jobs(2 if batch == 1 else 8, new_tokens)
        reference = None
        for method in METHODS:
            row = {"pair": label, **run_method(method, members, jobs, batch)}
            reference = reference or row["ms_per_token"]
            row["over_generate"] = round(row["ms_per_token"] / reference, 3)
            logger.info("speed %s", row)
            rows.append(row)
            on_row()


def warm_up(drafter: Member, jobs: list[GenerationJob], seconds: float) -> list[float]:
    """``generate`` of the drafter over ``jobs`` at batch 1, again and again for ``seconds``;
    the ms per token of each round. On an H200 the first minute or two of a process ran the same
    rows two to four times slower than later ones (the drafter's ``generate`` at batch 1: 61 and
    34 ms per token first, 28 and 14 ms later, in two processes), whatever the pair: rows timed
    after a warm-up compare with each other, and the rounds logged show the drift."""
    decoder = SafeDecoder([drafter], 0, parse_options({"members": [drafter.name], "schedule": "drafter"}))
    rounds: list[float] = []
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        begin = time.perf_counter()
        tokens = sum(len(batched_generate(decoder, [job])[0]) for job in jobs)
        sync_device([drafter])
        rounds.append(round(1e3 * (time.perf_counter() - begin) / max(1, tokens), 2))
        logger.info("warm-up round %d: %.2f ms per token", len(rounds), rounds[-1])
    return rounds


def speed(
    settings: Settings, perturbation: float, on_update: Callable[[dict[str, Any]], None], warm_up_seconds: float = 0.0
) -> dict[str, Any]:
    """Both pairs in bfloat16 (float32 on a CPU dry run): the 8B drafter with its perturbed
    copy, then with the 1.7B verifier. The same drafter object serves both pairs, so its rows
    in the second pair repeat those of the first on a device that has run for a while."""
    dtype = torch.bfloat16 if settings.device.startswith("cuda") else torch.float32
    tokenizers = load_tokenizers(settings.tokenizers)
    scale = settings.scale
    tokens = {1: settings.max_new_tokens * 2, 8: settings.max_new_tokens}
    drafter_model = build_model(tokenizers["a"], SHAPES["speed_drafter"][scale], 10, settings.device, dtype)
    drafter = as_member(drafter_model, tokenizers["a"], "drafter-8b", 0)
    mask_eos([drafter])
    rows: list[dict[str, Any]] = []
    out: dict[str, Any] = {
        "dtype": str(dtype)[6:],
        "drafter_parameters": parameter_count(drafter_model),
        "perturbation": perturbation,
        "new_tokens": tokens,
        "rows": rows,
        "passed": False,
    }

    def on_row() -> None:
        if settings.device.startswith("cuda"):
            out["cuda_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
        on_update(out)

    out["warm_up_ms_per_token"] = warm_up(drafter, settings.jobs(2, tokens[1]), warm_up_seconds)
    twin = as_member(perturbed_copy(drafter_model, perturbation, 12), tokenizers["a"], "drafter-8b-perturbed", 1)
    time_pair("8b+8b-perturbed", [drafter, twin], settings, tokens, rows, on_row)
    del twin
    verifier_model = build_model(tokenizers["b"], SHAPES["speed_verifier"][scale], 11, settings.device, dtype)
    out["verifier_parameters"] = parameter_count(verifier_model)
    verifier = as_member(verifier_model, tokenizers["b"], "verifier-1.7b", 1)
    mask_eos([verifier])
    time_pair("8b+1.7b", [drafter, verifier], settings, tokens, rows, on_row)
    out["passed"] = all(row["tokens"] > 0 for row in rows)
    return out
