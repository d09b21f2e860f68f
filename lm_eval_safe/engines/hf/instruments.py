"""The transformers engine's benchmark instruments: what ``lm_eval_safe.bench`` measures or
alters inside a member's model, reached through :meth:`~lm_eval_safe.engines.spec.EngineSpec.instruments` so the benchmarks never import this engine nor
read its model.

Each instrument works on the model's own modules (forward hooks on the output layer, the
decoder body, the KV-cache functions), which only this engine has: an engine that cannot be
hooked has no instruments, and the benchmarks that need them refuse it in one line.
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from lm_eval_safe.engines.hf import kv_cache
from lm_eval_safe.engines.hf.clocks import CACHE_MOVES, HEADS_WORK, ForwardClock, FunctionClock
from lm_eval_safe.engines.hf.forward import forward_logprobs
from lm_eval_safe.members.member import Member, config_max_length
from lm_eval_safe.members.sources import MemberSource

__all__ = ["CACHE_MOVES", "HEADS_WORK", "ForwardClock", "FunctionClock"]


def _sync(member: Member) -> None:
    """Wait for the member's queued CUDA work (a clock must not stop before the work does)."""
    if str(member.device).startswith("cuda"):
        torch.cuda.synchronize()


def mask_eos(member: Member) -> None:
    """Make ``member`` never predict EOS: a forward hook on its output layer sets the EOS logits
    to ``-inf``. Every path that produces logits goes through that layer (a forward pass, the
    batched decoder's output head, ``transformers.generate``), so all of them see the mask. On
    a model with final-logit soft-capping (Gemma-2) a masked logit becomes the cap's minimum
    instead of ``-inf``, which no argmax picks."""
    eos = torch.tensor(sorted(member.eos_ids), dtype=torch.long)

    def hook(_module: Any, _inputs: Any, logits: torch.Tensor) -> Any:
        return logits.index_fill(-1, eos.to(logits.device), float("-inf"))

    member.engine.model.get_output_embeddings().register_forward_hook(hook)


def favour_ids(member: Member, ids: list[int], bonus: float) -> None:
    """Add ``bonus`` to the logits of ``ids`` in ``member``'s output layer (every path to the
    logits goes through it)."""
    head = member.engine.model.get_output_embeddings()
    bias = torch.zeros(head.weight.shape[0], dtype=torch.float32)
    bias[ids] = bonus

    def hook(_module: Any, _inputs: Any, logits: torch.Tensor) -> torch.Tensor:
        return logits + bias.to(device=logits.device, dtype=logits.dtype)

    head.register_forward_hook(hook)


@torch.inference_mode()
def prompt_logits(member: Member, ids: list[int]) -> torch.Tensor:
    """The model's logits (float32) at every position of ``ids``, one whole-model forward."""
    tokens = torch.tensor([ids], device=member.engine.input_device)
    return member.engine.model(input_ids=tokens).logits[0].float()


def generate(
    member: Member, prompts: Sequence[list[int]], max_new_tokens: int, pad: int, own_eos: bool = True
) -> list[list[int]]:
    """transformers ``generate`` of ``member`` alone over ``prompts`` at once (left-padded with
    ``pad``), greedy, as a user runs it; each prompt's new ids. ``own_eos``: stop at the
    member's EOS ids (else at the model's generation config's). With EOS masked
    (:func:`mask_eos`) it runs to ``max_new_tokens``."""
    model = member.engine.model
    eos = {"eos_token_id": sorted(member.eos_ids) or model.generation_config.eos_token_id} if own_eos else {}
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], dtype=torch.long, device=member.engine.input_device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=ids.device)
    with warnings.catch_warnings(), torch.inference_mode():
        warnings.simplefilter("ignore")
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            pad_token_id=pad,
            **eos,
        )
    return [row[width:].tolist() for row in out]


@torch.inference_mode()
def forward_seconds(member: Member, prompt_ids: list[int], repeats: int = 7) -> tuple[float, float]:
    """Median seconds of a 1-token and a 5-token forward after ``prompt_ids`` (the cache cropped
    back after each), all rows through the output layer, as a verifier's window needs."""
    cache = kv_cache.new_cache()
    with member.engine.active():
        forward_logprobs(member, prompt_ids, cache, 1)
        base = len(prompt_ids)
        times: dict[int, list[float]] = {1: [], 5: []}
        for repeat in range(repeats + 1):
            for rows in (1, 5):
                kv_cache.crop(cache, base)
                _sync(member)
                start = time.perf_counter()
                forward_logprobs(member, prompt_ids[-rows:], cache, list(range(rows)))
                _sync(member)
                if repeat:  # the first round warms up
                    times[rows].append(time.perf_counter() - start)
    return statistics.median(times[1]), statistics.median(times[5])


def model_tensors(member: Member) -> Iterator[torch.Tensor]:
    """Every parameter and buffer of ``member``'s model (what a sync counter tags as on its
    device)."""
    model = member.engine.model
    yield from model.parameters()
    yield from model.buffers()


def parameter_count(member: Member) -> int:
    """Parameters of ``member``'s model."""
    return sum(p.numel() for p in member.engine.model.parameters())


def as_member(model: Any, tokenizer: Any, name: str, index: int = 0) -> Member:
    """A member over an in-memory transformers model, as the loader builds one from a folder
    (the prefix store at its default size; no small-row linears, a CPU-only speed-up that
    would time itself on the first call)."""
    from lm_eval_safe.engines.hf.engine import HFEngine
    from lm_eval_safe.engines.hf.prefix_cache import PrefixStore
    from lm_eval_safe.engines.hf.small_rows import SmallRowLinears

    return Member(
        source=MemberSource(spec=name, name=name, kind="folder", location=f"built in memory: {name}"),
        tokenizer=tokenizer,
        config=model.config,
        generation_config=model.generation_config,
        engine=HFEngine(model, None, SmallRowLinears(model, "off", None, name), PrefixStore(256 * 2**20)),
        device=str(next(model.parameters()).device),
        dtype=model.dtype,
        max_length=config_max_length(model.config, tokenizer, None),
        index=index,
    )
