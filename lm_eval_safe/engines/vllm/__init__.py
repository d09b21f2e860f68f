"""The vLLM engine: each member is one ``vllm.LLM`` (paged KV cache, prefix caching, continuous
batching, tensor parallelism), and every batch step of the decoder is one batched ``generate``
call per member for all the requests in the batch.

- a drafter's window is one request with ``max_tokens=n`` and ``logprobs=K`` (the draft and
  each position's head);
- a verifier's positions are read from ``prompt_logprobs=K`` of its whole sequence, submitted
  again each cycle: vLLM's prefix cache holds what an earlier cycle computed, so only the new
  tail runs through the model;
- a full distribution, where a decision needs one, is ``logprobs=-1`` at that position.

Rows are :class:`~lm_eval_safe.engines.base.TopLogprobs` heads; :mod:`lm_eval_safe.certified`
decides from them exactly or asks for the full distribution. What vLLM on this package's
supported versions needs, and what a CPU build does differently, is in :mod:`.args`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from lm_eval_safe.engines.base import EngineBatch, MemberEngine, TopLogprobs

#: Engines running inside this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the CPU default):
#: they share vLLM's process-wide distributed state, which an engine's shutdown tears down for
#: all of them (vLLM 0.32 ``EngineCore.shutdown`` calls ``cleanup_dist_env_and_memory``), so
#: none is shut down before the process ends.
_IN_PROCESS: list[Any] = []


class VLLMEngine(MemberEngine):
    kind = "vllm"
    full_rows = False
    stops_on_text = True

    def __init__(self, llm: Any, top_logprobs: int, settings: dict[str, Any]):
        super().__init__()
        self.llm = llm
        self.top = top_logprobs
        self.settings = settings
        config = llm.llm_engine.vllm_config
        self.max_model_len = int(config.model_config.max_model_len)
        self.max_num_seqs = int(config.scheduler_config.max_num_seqs)
        self.prefix_caching = bool(config.cache_config.enable_prefix_caching)
        from vllm import envs

        if not envs.VLLM_ENABLE_V1_MULTIPROCESSING:
            _IN_PROCESS.append(llm)

    # -- calls -------------------------------------------------------------------------
    def generate(self, prompts: Sequence[list[int]], params: Sequence[Any]) -> list[Any]:
        """One batched ``generate`` call; prompt tokens submitted and those read from the
        prefix cache are counted as prefill tokens."""
        from vllm import TokensPrompt

        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=list(p)) for p in prompts], list(params), use_tqdm=False
        )
        for prompt, output in zip(prompts, outputs, strict=True):
            self.counters.prefill_tokens += len(prompt)
            self.counters.prefill_tokens_saved += int(output.num_cached_tokens or 0)
        return outputs

    def params(self, **settings: Any) -> Any:
        """Sampling parameters of a call: no detokenization, flat log-probs, stops only where
        the decoder says (vLLM's own EOS handling off: the member's stop ids are passed)."""
        from vllm import SamplingParams

        base = {"detokenize": False, "flat_logprobs": True, "ignore_eos": True, "temperature": 0.0}
        return SamplingParams(**{**base, **settings})

    def head(self, flat: Any, position: int, handle: Any = None) -> TopLogprobs:
        """Position ``position`` of a flat log-prob list as a head: the token the engine was
        asked about (sampled or given) comes first, then the top ``K`` by rank. Ids past the
        tokenizer (padded embedding rows, as in Qwen) are not tokens and are dropped."""
        start, end = flat.start_indices[position], flat.end_indices[position]
        ids, logprobs = flat.token_ids[start:end], flat.logprobs[start:end]
        vocab = len(self.member.tokenizer)
        known = {t: lp for t, lp in zip(ids, logprobs, strict=True) if t < vocab}
        top = [(t, lp) for t, lp in zip(ids[1:], logprobs[1:], strict=True) if t < vocab]
        if not top:  # K=0: the asked-about token alone
            top = [(ids[0], logprobs[0])]
        return TopLogprobs([t for t, _ in top], [lp for _, lp in top], known, handle)

    def full_row(self, flat: Any, position: int) -> Any:
        """A ``logprobs=-1`` position as the log-softmax over the tokenizer's ids (renormalised
        without padded rows, as the transformers engine computes it)."""
        import torch

        start, end = flat.start_indices[position], flat.end_indices[position]
        vocab = len(self.member.tokenizer)
        values = torch.full((vocab,), -math.inf, dtype=torch.float32)
        ids = torch.tensor(flat.token_ids[start + 1 : end], dtype=torch.long)
        lps = torch.tensor(flat.logprobs[start + 1 : end], dtype=torch.float32)
        inside = ids < vocab
        values[ids[inside]] = lps[inside]
        return torch.log_softmax(values, dim=-1)

    # -- MemberEngine ------------------------------------------------------------------
    def new_batch(self) -> EngineBatch:
        from lm_eval_safe.engines.vllm.batch import VLLMBatch

        return VLLMBatch(self)

    def score_tokens(
        self,
        pairs: Sequence[tuple[list[int], list[int]]],
        batch_size: int | str,
        max_batch_size: int,
        progress: Callable[[int], Any] | None = None,
    ) -> list[tuple[list[float], list[bool]]]:
        from lm_eval_safe.engines.vllm.scoring import score_tokens

        return score_tokens(self, pairs, batch_size, progress)

    @property
    def rolling_window(self) -> int:
        """lm-eval's vllm: ``max_length - 2`` (a window and its context id within
        :attr:`sequence_limit`)."""
        return self.member.max_length - 2

    @property
    def sequence_limit(self) -> int:
        """vLLM refuses a prompt that fills ``max_model_len`` (it generates at least one token),
        so a sequence whose next-token distribution is read holds one id fewer."""
        return self.member.max_length - 1

    @property
    def shares_prefixes(self) -> bool:
        return self.prefix_caching

    def prefill_counts(self) -> tuple[int, int]:
        return self.counters.prefill_tokens, self.counters.prefill_tokens_saved

    def forget_prefixes(self) -> None:
        self.llm.reset_prefix_cache()

    def describe(self) -> dict[str, Any]:
        shown = {k: v for k, v in self.settings.items() if k not in ("model", "dtype")}
        return {"engine": self.kind, "engine_args": shown}

    def identity(self) -> dict[str, Any]:
        # another engine's kernels round differently: near-ties may flip, so answers are kept
        # apart from the transformers engine's in --use_cache
        return {"engine": self.kind, "quantization": self.settings.get("quantization")}
