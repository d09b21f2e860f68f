"""A vLLM member's engine (:class:`VLLMEngine`): one ``vllm.LLM``, the calls the batches make
of it, and its answers read as heads and rows (described in the package's docstring,
:mod:`lm_eval_safe.engines.vllm`)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lm_eval_safe.engines.base import EngineBatch, MemberEngine, TopLogprobs, head_of
from lm_eval_safe.engines.vllm.sessions import EngineSessions, unsupported

logger = logging.getLogger(__name__)


def float32_exp(logprob: float) -> float:
    """``exp`` of a float32 log-prob in float32, as a full row's ``row.max().exp()``: the GaC
    gate and the threshold schedule compare it with 0.5, where float32 and float64 may round a
    log-prob next to log(0.5) to opposite sides."""
    return float(torch.tensor(logprob, dtype=torch.float32).exp())

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
        why_not = unsupported(llm)
        #: rows kept in the engine between calls (:mod:`.sessions`), or None: whole sequences
        #: are re-submitted each call
        self.sessions = EngineSessions(llm) if why_not is None else None
        if why_not is not None:
            logger.info("vLLM rows re-submit whole sequences each call: %s", why_not)

    # -- calls -------------------------------------------------------------------------
    def generate(self, prompts: Sequence[list[int]], params: Sequence[Any]) -> list[Any]:
        """One batched ``generate`` call; prompt tokens submitted and those read from the
        prefix cache are counted as prefill tokens."""
        from vllm import TokensPrompt

        if self.sessions is not None and prompts:  # paused sessions' KV is not vLLM's to evict
            longest = max(len(p) for p in prompts)
            self.sessions.make_room(self.sessions.blocks_for(longest + 1), ())
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

    def head(self, flat: Any, position: int, handle: Any = None) -> TopLogprobs | None:
        """Position ``position`` of a flat log-prob list as a head, or None where the ids vLLM
        returned cannot name the position's argmax.

        vLLM returns the asked-about token (sampled or given) first, then its top ``K`` ids, with
        equal values in the order its top-k kernel met them. The head orders them as
        ``torch.argmax`` orders a full row (by value, equal values by id: the first of equal
        maxima first) and takes ``max_probability`` in float32, as a full row's
        ``row.max().exp()``. Ids past the tokenizer (padded embedding rows, as in Qwen) are not
        tokens and are dropped with their mass: vLLM's log-probs are lm-eval vllm's numbers and
        are not renormalised, here or in :meth:`full_row`. None: no listed id is a token, or every
        listed token ties at the maximum, where an id vLLM did not list may tie too."""
        start, end = flat.start_indices[position], flat.end_indices[position]
        return self.position_head(flat.token_ids[start:end], flat.logprobs[start:end], handle)

    def position_head(
        self, ids: Sequence[int], logprobs: Sequence[float], handle: Any = None
    ) -> TopLogprobs | None:
        """:meth:`head` of one position given as vLLM's row: the asked-about id, then the top
        ``K`` (a resumable request's rows come this way, not as a flat list)."""
        vocab = len(self.member.tokenizer)
        known = {t: lp for t, lp in zip(ids, logprobs, strict=True) if t < vocab}
        listed = {t: known[t] for t in ids[1:] if t < vocab}
        if not listed:
            return None
        best = max(listed.values())
        argmax = min(t for t, lp in known.items() if lp == best)  # the asked id may tie, unlisted
        ranked = sorted({**listed, argmax: best}.items(), key=lambda item: (-item[1], item[0]))
        if len(known) < vocab and ranked[-1][1] == best:
            return None
        top_ids, top_logprobs = [t for t, _ in ranked], [lp for _, lp in ranked]
        return TopLogprobs(top_ids, top_logprobs, known, handle, float32_exp(best))

    def row_head(self, row: torch.Tensor, asked: int, handle: Any) -> TopLogprobs:
        """A head of :attr:`top` ids cut from a :meth:`full_row` (where :meth:`head` gave None),
        knowing the asked-about id too when it is a token (-1: none was asked about)."""
        argmax = int(torch.argmax(row))
        known = {t: float(row[t]) for t in {argmax, asked} if 0 <= t < row.numel()}
        return head_of(row, self.top, TopLogprobs([argmax], [known[argmax]], known, handle))

    def token_score(self, flat: Any, position: int) -> tuple[float, bool]:
        """The given token's log-prob at a ``prompt_logprobs=1`` position and whether it is
        greedy, by lm-eval vllm's rule: its log-prob is at least that of vLLM's most probable id
        (a tie counts as greedy; a padded id counts, as lm-eval reads it)."""
        start = flat.start_indices[position]
        token_logprob = flat.logprobs[start]
        return token_logprob, token_logprob >= flat.logprobs[start + 1]

    def full_row(self, flat: Any, position: int) -> torch.Tensor:
        """A ``logprobs=-1`` position as vLLM's log-probs over the tokenizer's ids (-inf at no id;
        not renormalised, as :meth:`head`)."""
        start, end = flat.start_indices[position], flat.end_indices[position]
        vocab = len(self.member.tokenizer)
        values = torch.full((vocab,), -math.inf, dtype=torch.float32)
        ids = torch.tensor(flat.token_ids[start + 1 : end], dtype=torch.long)
        lps = torch.tensor(flat.logprobs[start + 1 : end], dtype=torch.float32)
        inside = ids < vocab
        values[ids[inside]] = lps[inside]
        return values

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

        return score_tokens(self, pairs, batch_size, max_batch_size, progress)

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
        if self.sessions is not None:  # vLLM resets no cache while requests hold blocks
            self.sessions.close_all()
        self.llm.reset_prefix_cache()

    def describe(self) -> dict[str, Any]:
        shown = {k: v for k, v in self.settings.items() if k not in ("model", "dtype")}
        return {"engine": self.kind, "engine_args": shown}

    def identity(self) -> dict[str, Any]:
        """The engine (another engine's kernels round differently: near-ties may flip, so its
        answers are kept apart from the transformers engine's in ``--use_cache``) and every
        engine argument that can change an answer (:func:`.args.result_arguments`)."""
        from lm_eval_safe.engines.vllm.args import result_arguments

        return {"engine": self.kind, "engine_args": result_arguments(self.settings)}
