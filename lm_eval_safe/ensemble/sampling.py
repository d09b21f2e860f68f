"""Sampling for SAFE: a request's generation kwargs, logits warping, per-request random
streams and speculative sampling's acceptance rule.

Kept apart from the decoder so that the decoder's loop stays one loop: it asks this module how to
pick a drafted token (argmax, or a sample of the warped distribution) and, at an ensemble point,
whether to keep the drafted string. Greedy requests never reach anything here but the parser.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lm_eval_safe.errors import OptionError

# lm-eval's names for the generation budget, in its priority order (``normalize_gen_kwargs``).
MAX_TOKEN_KEYS = ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens")
# Options other backends understand that are no-ops at these values; any other value would
# change the output in a way we cannot reproduce, so it is refused rather than ignored.
# (lm-eval 0.4.13's own task configs pass ``num_beams: 1``.)
NO_OP_DEFAULTS: dict[str, float] = {
    "num_beams": 1,
    "num_return_sequences": 1,
    "repetition_penalty": 1.0,
}
SUPPORTED_HINT = (
    "supported: until, max_gen_toks (or max_new_tokens, max_tokens, max_completion_tokens), "
    "do_sample, temperature, top_p, top_k; num_beams, num_return_sequences and "
    "repetition_penalty only at 1"
)


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens, in transformers' meaning of the four keys.

    ``top_k=0`` and ``top_p=1.0`` switch those filters off. A request that does not name
    ``top_k``/``top_p`` gets them off, not transformers' generation-config default of
    ``top_k=50``: the request alone says what is sampled (as lm-eval's vLLM backend does).
    """

    do_sample: bool = False
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        """``do_sample=False``, or a temperature of 0 (lm-eval's convention for greedy)."""
        return not self.do_sample or self.temperature == 0.0


@dataclass(frozen=True)
class GenerationSettings:
    """A request's validated generation kwargs (``until`` before the EOS text is added)."""

    until: list[str]
    max_gen_toks: int
    sampling: SamplingParams

    def canonical(self) -> str:
        """Stable text of the settings, part of a sampled request's seed (never ``hash()``,
        which is salted per process and would differ between data-parallel ranks)."""
        s = self.sampling
        return json.dumps(
            {
                "until": self.until,
                "max_gen_toks": self.max_gen_toks,
                "do_sample": s.do_sample,
                "temperature": s.temperature,
                "top_k": s.top_k,
                "top_p": s.top_p,
            },
            sort_keys=True,
            ensure_ascii=False,
        )


def _number(key: str, value: Any) -> float:
    """A finite real number from YAML, JSON, the CLI or Python (numeric strings included)."""
    if isinstance(value, bool):
        raise OptionError(f"generation kwarg {key}={value!r} must be a number, not a boolean")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise OptionError(f"generation kwarg {key}={value!r} must be a number") from None
    if not math.isfinite(number):
        raise OptionError(f"generation kwarg {key}={value!r} must be a finite number")
    return number


def _integer(key: str, value: Any) -> int:
    number = _number(key, value)
    if number != int(number):
        raise OptionError(f"generation kwarg {key}={value!r} must be a whole number")
    return int(number)


def _flag(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise OptionError(f"generation kwarg {key}={value!r} must be true or false")


def parse_gen_kwargs(
    gen_kwargs: Mapping[str, Any] | None, default_max_gen_toks: int
) -> GenerationSettings:
    """Validate a request's ``generation_kwargs`` and normalise them as lm-eval 0.4.13's
    ``normalize_gen_kwargs`` does (the budget's aliases in its priority order; a temperature
    above 0 without ``do_sample`` samples, ``do_sample=False`` is greedy whatever the
    temperature). The rule is written here, not imported: lm-eval 0.4.9 has no such function
    and its ``hf`` backend reads a bare temperature differently, and a request must mean the
    same thing under every lm-eval this package supports.

    Every key is checked first, so a bad value fails in one line naming its key, and an option
    we cannot honour is refused instead of silently dropped.
    """
    raw = dict(gen_kwargs or {})
    if "until" in raw and raw["until"] is None:
        del raw["until"]
    for key, value in list(raw.items()):
        if key == "until":
            stops = [value] if isinstance(value, str) else value
            if stops is not None and (
                not isinstance(stops, list) or not all(isinstance(s, str) for s in stops)
            ):
                raise OptionError(
                    f"generation kwarg until={value!r} must be a string or a list of strings"
                )
        elif key in MAX_TOKEN_KEYS:
            if value is not None and _integer(key, value) < 0:
                raise OptionError(f"generation kwarg {key}={value!r} must not be negative")
        elif key == "do_sample":
            if value is not None:
                raw[key] = _flag(key, value)
        elif key == "temperature":
            if _number(key, value) < 0:
                raise OptionError(
                    f"generation kwarg temperature={value!r} must be >= 0 (0 is greedy)"
                )
            raw[key] = _number(key, value)
        elif key == "top_p":
            if not 0.0 < _number(key, value) <= 1.0:
                raise OptionError(f"generation kwarg top_p={value!r} must be in (0, 1] (1 is off)")
        elif key == "top_k":
            if _integer(key, value) < 0:
                raise OptionError(
                    f"generation kwarg top_k={value!r} must be a whole number >= 0 (0 is off)"
                )
        elif key in NO_OP_DEFAULTS:
            if _number(key, value) != NO_OP_DEFAULTS[key]:
                raise OptionError(
                    f"generation kwarg {key}={value!r} is not supported by safe-ensemble "
                    f"(only {key}={NO_OP_DEFAULTS[key]:g}, which changes nothing); {SUPPORTED_HINT}"
                )
        else:
            raise OptionError(
                f"unknown generation kwarg {key!r}={value!r} for safe-ensemble; {SUPPORTED_HINT}"
            )
    until = raw.get("until", [])
    budgets = [raw[key] for key in MAX_TOKEN_KEYS if raw.get(key) is not None]
    max_gen_toks = _integer("max_gen_toks", budgets[0]) if budgets else default_max_gen_toks
    temperature = float(raw.get("temperature", 0.0))
    do_sample = raw.get("do_sample")
    if do_sample is None:
        do_sample = temperature > 0.0
    elif not do_sample:
        temperature = 0.0
    sampling = SamplingParams(
        do_sample=bool(do_sample),
        temperature=temperature,
        top_k=_integer("top_k", raw.get("top_k", 0)),
        top_p=_number("top_p", raw.get("top_p", 1.0)),
    )
    return GenerationSettings(
        [until] if isinstance(until, str) else list(until), max_gen_toks, sampling
    )


def request_seed(base_seed: int, context: str, settings: GenerationSettings, repeat: int) -> int:
    """The seed of one sampled request: the run's seed, the request's content and its repeat
    index (the k-th identical request of a ``generate_until`` call is repeat k).

    Content, not position: the same request gets the same stream whatever its place in the
    call, the batch it lands in, or the data-parallel rank that runs it."""
    payload = json.dumps(
        [int(base_seed), context, settings.canonical(), int(repeat)], ensure_ascii=False
    )
    digest = hashlib.sha256(payload.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def warp_logprobs(logprobs: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-probabilities of the distribution a request samples from (``-inf``: filtered out).

    transformers' order and rules (``generation/logits_process.py``): temperature, then top-k
    (every token scoring below the k-th best is dropped, so ties at the k-th score stay), then
    top-p (sorted ascending, tokens whose cumulative probability is ``<= 1 - top_p`` are
    dropped, the most probable token always stays: ``min_tokens_to_keep=1``). Log-probabilities
    and logits differ by a constant per row, which none of the three steps sees. Float64, so
    the ratios of the acceptance rule are not rounded away.
    """
    scores = logprobs.double()
    if params.temperature != 1.0:
        scores = scores / params.temperature
    if params.top_k > 0:
        k = min(params.top_k, scores.shape[-1])
        kth = torch.topk(scores, k).values[..., -1, None]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - params.top_p)
        remove[..., -1:] = False
        scores = scores.masked_fill(remove.scatter(-1, order, remove), float("-inf"))
    return torch.log_softmax(scores, dim=-1)


def sample_index(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One draw from unnormalised non-negative ``probs`` by inverse CDF: exactly one uniform
    per draw, so a request's stream depends on nothing but its own decisions."""
    cdf = probs.double().cumsum(0)
    u = float(torch.rand((), generator=generator, dtype=torch.float64))
    index = int(torch.searchsorted(cdf, u * float(cdf[-1]), right=True))
    if index >= len(probs) or probs[index] <= 0:  # u * total rounded up to the total
        index = int(torch.nonzero(probs > 0)[-1])
    return index


def keep_or_resample(
    target: torch.Tensor,
    draft: torch.Tensor,
    drafted: int,
    generator: torch.Generator,
    test: dict[str, float] | None = None,
) -> int:
    """Speculative sampling's rule over one index space: keep ``drafted`` (drawn from ``draft``)
    with probability ``min(1, target/draft)``, else draw from ``norm(max(0, target - draft))``.

    The result is distributed exactly as ``target`` (both arguments normalised). Returns the
    index chosen, ``drafted`` when kept; ``test``, when given, receives the draw and the
    probability of keeping (for traces).
    """
    p_draft, p_target = float(draft[drafted]), float(target[drafted])
    u = float(torch.rand((), generator=generator, dtype=torch.float64))
    if test is not None:
        keep = 1.0 if p_draft <= 0.0 else min(1.0, p_target / p_draft)
        test.update(draw=round(u, 6), keep_probability=round(keep, 6))
    if u * p_draft < p_target:
        return drafted
    residual = (target - draft).clamp_min(0.0)
    if float(residual.sum()) <= 0.0:  # target == draft up to rounding: nothing to move
        return drafted
    return sample_index(residual, generator)


class RowSampler:
    """One sampled request's parameters and its own random stream (never the global one)."""

    def __init__(self, params: SamplingParams, seed: int):
        self.params = params
        self.generator = torch.Generator(device="cpu").manual_seed(seed)

    def warp(self, logprobs: torch.Tensor) -> torch.Tensor:
        return warp_logprobs(logprobs, self.params)

    def sample(self, logprobs: torch.Tensor) -> int:
        """A token drawn from the request's warped distribution."""
        return sample_index(self.warp(logprobs).exp(), self.generator)

    def stream_seed(self) -> int:
        """A seed for an engine that draws the request's tokens itself (vLLM), taken from the
        request's own stream: the same seed gives the same seeds in the same order, and no two
        windows of a request share one (vLLM restarts a request's stream when it is
        re-submitted, so a fixed seed would repeat the same draws in every window)."""
        return int(torch.randint(0, 2**62, (1,), generator=self.generator))

    def keep_or_resample(
        self, target: torch.Tensor, draft: torch.Tensor, drafted: int, test: dict[str, float] | None = None
    ) -> int:
        return keep_or_resample(target, draft, drafted, self.generator, test)
