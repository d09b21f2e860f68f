"""The OpenAI response objects the server writes: whole responses and streamed chunks.

Beside ``usage`` each response carries ``safe``: what SAFE did for it (ensemble operations,
drafted and accepted tokens, E/T). Clients that do not know the field ignore it, as they ignore
vLLM's own additions.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from lm_eval_safe.stats import RESPONSE_COUNTS, GenerationStats

#: the statistics of a response's ``safe`` field
SAFE_FIELDS = RESPONSE_COUNTS


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def finish_reason(stats: GenerationStats) -> str:
    return "stop" if stats.stopped_requests else "length"


def safe_field(stats: GenerationStats) -> dict[str, Any]:
    data: dict[str, Any] = {name: getattr(stats, name) for name in SAFE_FIELDS}
    data["ensemble_rate_percent"] = round(stats.ensemble_rate, 4)
    data["acceptance_rate"] = round(stats.acceptance_rate, 4)
    return data


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class Envelope:
    """What every response and chunk of one HTTP request shares."""

    def __init__(self, kind: str, model: str):
        self.chat = kind == "chat"
        self.id = new_id("chatcmpl" if self.chat else "cmpl")
        self.created = int(time.time())
        self.model = model

    def _head(self, streamed: bool) -> dict[str, Any]:
        if self.chat:
            obj = "chat.completion.chunk" if streamed else "chat.completion"
        else:
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def response(
        self,
        texts: list[str],
        stats: list[GenerationStats],
        prompt_tokens: int,
        logprobs: list[Any] | None = None,
    ) -> dict[str, Any]:
        choices = []
        for i, (text, st) in enumerate(zip(texts, stats, strict=True)):
            choice: dict[str, Any] = {"index": i}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choice["logprobs"] = None if logprobs is None else logprobs[i]
            choice["finish_reason"] = finish_reason(st)
            choices.append(choice)
        total = GenerationStats()
        for st in stats:
            total.add(st)
        return {
            **self._head(False),
            "choices": choices,
            "usage": usage(prompt_tokens, total.generated_tokens),
            "safe": safe_field(total),
        }

    def logprobs(self, pieces: list[tuple[str, float]]) -> dict[str, Any]:
        """A choice's ``logprobs``: each piece of its text between the members' common token
        boundaries, with the ensemble's log-probability (no alternatives: ``top_logprobs``
        is null, or empty in a chat response)."""
        if self.chat:
            return {
                "content": [
                    {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8")), "top_logprobs": []}
                    for t, lp in pieces
                ]
            }
        offsets, at = [], 0
        for text, _ in pieces:
            offsets.append(at)
            at += len(text)
        return {
            "tokens": [t for t, _ in pieces],
            "token_logprobs": [lp for _, lp in pieces],
            "top_logprobs": None,
            "text_offset": offsets,
        }

    def chunk(
        self,
        index: int,
        text: str | None = None,
        stats: GenerationStats | None = None,
        role: bool = False,
        logprobs: Any = None,
    ) -> str:
        """One server-sent event: a piece of text, the role (chat's first chunk), or the end of
        a choice (``stats``: its finish reason and ``safe`` field)."""
        choice: dict[str, Any] = {"index": index}
        if self.chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
                delta["content"] = ""
            if text:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        choice["logprobs"] = logprobs
        choice["finish_reason"] = None if stats is None else finish_reason(stats)
        body = {**self._head(True), "choices": [choice]}
        if stats is not None:
            body["safe"] = safe_field(stats)
        return event(body)

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> str:
        return event({**self._head(True), "choices": [], "usage": usage(prompt_tokens, completion_tokens)})


def event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


DONE = "data: [DONE]\n\n"
