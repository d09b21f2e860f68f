"""The OpenAI response objects the server writes, as pydantic models: whole responses, streamed
chunks and the model list. A chunk is written with the fields it was given (``exclude_unset``, as
vLLM writes its chunks): a ``safe`` field only on a choice's last chunk, ``usage`` only on the
usage chunk.

Beside ``usage`` each response carries ``safe``: what SAFE did for it (ensemble operations,
drafted and accepted tokens, E/T). Clients that do not know the field ignore it, as they ignore
vLLM's own additions.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict

from lm_eval_safe.decoder.stats import RESPONSE_COUNTS, GenerationStats

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


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


def usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


class CompletionLogprobs(BaseModel):
    """A completion's pieces (no alternatives: ``top_logprobs`` is null)."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int]


class ChatLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[Any] = []


class ChatLogprobs(BaseModel):
    content: list[ChatLogprob]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class ChatMessageOut(BaseModel):
    role: str = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: Any = None
    finish_reason: str | None = None


class CompletionStreamChoice(BaseModel):
    index: int
    text: str
    logprobs: Any = None
    finish_reason: str | None = None


class Head(BaseModel):
    """What every response and chunk begins with."""

    id: str
    object: str
    created: int
    model: str


class CompletionResponse(Head):
    choices: list[CompletionChoice]
    usage: UsageInfo
    safe: dict[str, Any]


class ChatCompletionResponse(Head):
    choices: list[ChatChoice]
    usage: UsageInfo
    safe: dict[str, Any]


class CompletionStreamResponse(Head):
    choices: list[CompletionStreamChoice]
    usage: UsageInfo | None = None
    safe: dict[str, Any] | None = None


class ChatCompletionStreamResponse(Head):
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    safe: dict[str, Any] | None = None


class ModelCard(BaseModel):
    """One served name, with what the ensemble is (members, drafter, ...) beside OpenAI's fields."""

    model_config = ConfigDict(extra="allow")

    id: str
    object: str = "model"
    created: int
    owned_by: str = "lm-eval-safe"


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]


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
    ) -> CompletionResponse | ChatCompletionResponse:
        total = GenerationStats()
        for st in stats:
            total.add(st)
        tail = {"usage": usage(prompt_tokens, total.generated_tokens), "safe": safe_field(total)}
        each = zip(texts, stats, logprobs or [None] * len(texts), strict=True)
        if self.chat:
            said = [
                ChatChoice(index=i, message=ChatMessageOut(content=text), logprobs=lp, finish_reason=finish_reason(st))
                for i, (text, st, lp) in enumerate(each)
            ]
            return ChatCompletionResponse(**self._head(False), choices=said, **tail)
        written = [
            CompletionChoice(index=i, text=text, logprobs=lp, finish_reason=finish_reason(st))
            for i, (text, st, lp) in enumerate(each)
        ]
        return CompletionResponse(**self._head(False), choices=written, **tail)

    def logprobs(self, pieces: list[tuple[str, float]]) -> CompletionLogprobs | ChatLogprobs:
        """A choice's ``logprobs``: each piece of its text between the members' common token
        boundaries, with the ensemble's log-probability (no alternatives: ``top_logprobs``
        is null, or empty in a chat response)."""
        if self.chat:
            return ChatLogprobs(
                content=[ChatLogprob(token=t, logprob=lp, bytes=list(t.encode("utf-8"))) for t, lp in pieces]
            )
        offsets, at = [], 0
        for text, _ in pieces:
            offsets.append(at)
            at += len(text)
        return CompletionLogprobs(
            tokens=[t for t, _ in pieces], token_logprobs=[lp for _, lp in pieces], text_offset=offsets
        )

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
        reason = None if stats is None else finish_reason(stats)
        tail = {} if stats is None else {"safe": safe_field(stats)}
        chunk: CompletionStreamResponse | ChatCompletionStreamResponse
        if self.chat:
            said: dict[str, str] = {"role": "assistant", "content": ""} if role else {}
            if text:
                said["content"] = text
            delta = DeltaMessage(**said)
            choice = ChatStreamChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=reason)
            chunk = ChatCompletionStreamResponse(**self._head(True), choices=[choice], **tail)
        else:
            piece = CompletionStreamChoice(index=index, text=text or "", logprobs=logprobs, finish_reason=reason)
            chunk = CompletionStreamResponse(**self._head(True), choices=[piece], **tail)
        return event(chunk.model_dump(exclude_unset=True))

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> str:
        usage_only = {"choices": [], "usage": usage(prompt_tokens, completion_tokens)}
        chunk_type = ChatCompletionStreamResponse if self.chat else CompletionStreamResponse
        return event(chunk_type(**self._head(True), **usage_only).model_dump(exclude_unset=True))


def event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


DONE = "data: [DONE]\n\n"
