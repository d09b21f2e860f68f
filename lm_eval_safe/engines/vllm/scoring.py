"""One vLLM member's token scores of given continuations, as lm-eval's ``vllm`` backend computes
them: ``context + continuation`` left-truncated to ``max_length - 1`` ids (vLLM refuses a prompt
that fills its window), ``prompt_logprobs=1``, a token greedy when its log-prob is at least that of
the position's most probable id.

Requests run in the order of their ids, so those sharing a context (the choices of a question,
few-shot exemplars) follow one another and read it from vLLM's prefix cache. A row read from
the cache is not computed (:mod:`.batch`): the few requests whose cached prefix reaches into
the continuation are submitted again without reading the cache.
"""

from __future__ import annotations

from typing import Any

from lm_eval_safe.engines.base import MemberEngine, Progress, ScorePairs, TokenScores
from lm_eval_safe.engines.scoring import check_pair

#: Requests per ``generate`` call when ``batch_size`` is ``auto``: bounds the Python objects of
#: one call's outputs, while vLLM batches within it as its scheduler sees fit.
AUTO_REQUESTS = 256


def score_tokens(
    engine: MemberEngine,
    pairs: ScorePairs,
    batch_size: int | str,
    max_batch_size: int,
    progress: Progress | None = None,
) -> list[TokenScores]:
    """:meth:`~lm_eval_safe.engines.base.MemberEngine.score_tokens` on vLLM (the module
    docstring); ``batch_size`` requests per ``generate`` call, vLLM batching within it (its
    scheduler, not ``max_batch_size``, bounds a batch)."""
    limit = engine.sequence_limit
    windows: list[tuple[list[int], int]] = []
    for index, (ctx, cont) in enumerate(pairs):
        check_pair(engine.member, index, ctx, cont)
        whole = (ctx + cont)[-limit:]
        windows.append((whole, len(whole) - len(cont)))
    order = sorted(range(len(pairs)), key=lambda i: windows[i][0])
    step = AUTO_REQUESTS if batch_size == "auto" else max(1, int(batch_size))
    out: list[TokenScores | None] = [None] * len(pairs)
    for start in range(0, len(order), step):
        chunk = order[start : start + step]
        _score_chunk(engine, [windows[i] for i in chunk], chunk, out)
        if progress is not None:
            progress(len(chunk))
    assert all(o is not None for o in out)
    return out  # type: ignore[return-value]


def _score_chunk(
    engine: Any,
    windows: list[tuple[list[int], int]],
    indices: list[int],
    out: list[TokenScores | None],
) -> None:
    todo = list(zip(indices, windows, strict=True))
    for attempt in range(2):
        if not todo:
            return
        params = [
            engine.params(max_tokens=1, prompt_logprobs=1, skip_reading_prefix_cache=attempt == 1)
            for _ in todo
        ]
        outputs = engine.generate([w[0] for _, w in todo], params)
        retry = []
        for (index, (ids, start)), output in zip(todo, outputs, strict=True):
            if int(output.num_cached_tokens or 0) > start - 1:
                retry.append((index, (ids, start)))
                continue
            scores = [engine.token_score(output.prompt_logprobs, p) for p in range(start, len(ids))]
            out[index] = ([lp for lp, _ in scores], [greedy for _, greedy in scores])
        todo = retry
    if todo:
        raise RuntimeError("vLLM read the prefix cache of a request told not to")
