"""Serving one parsed request: checked, translated to decoder jobs, queued, and answered whole or
as a stream (vLLM's ``OpenAIServingCompletion`` and ``OpenAIServingChat``; the routes in
:mod:`.app` only hand bodies over).

A request is checked (:mod:`.translate`) before it is queued, so every bad input is a 4xx and
reaches no member; a client that goes away cancels its requests, which leave the batch at the
next cycle's end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from lm_eval_safe.decoder.stats import GenerationStats
from lm_eval_safe.serve.metrics import Metrics
from lm_eval_safe.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
)
from lm_eval_safe.serve.responses import DONE, Envelope, ModelCard, ModelList, event
from lm_eval_safe.serve.scheduler import RequestCancelled, Scheduler, SchedulerClosed, Update
from lm_eval_safe.serve.translate import Prepared, Translator

logger = logging.getLogger("lm_eval_safe.serve")

#: how often a client waiting for a whole response is asked whether it is still there (seconds)
DISCONNECT_POLL = 0.25


@dataclass
class ServerState:
    """What the routes share: one ensemble's scheduler, translator and metrics."""

    scheduler: Scheduler
    translator: Translator
    metrics: Metrics
    names: list[str]  # served model names, the first one reported
    description: dict[str, Any]  # members, options (``/v1/models``)
    score: Callable[[str, str], list[tuple[str, float]]]  # (context, text) -> pieces, log-probs
    log_prompts: bool = False
    checker: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="lm-eval-safe-check")
    )


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


Updates = asyncio.Queue  # of (choice index, Update), filled from the decoding thread


class Serving:
    """The endpoints' work for one ensemble."""

    def __init__(self, state: ServerState):
        self.state = state

    # -- endpoints ---------------------------------------------------------------------------
    def models(self) -> ModelList:
        created = int(time.time())
        description = self.state.description
        return ModelList(data=[ModelCard(id=name, created=created, **description) for name in self.state.names])

    async def completion(self, body: CompletionRequest, request: Request) -> Response:
        self._check_common(body)
        _check_logprobs(body, body.logprobs is not None, body.logprobs or 0, "logprobs")
        prepared = await self._check(self.state.translator.completion, body)
        envelope = Envelope("completion", self.state.names[0])
        prefixes = body.prompts() if body.echo else [""] * len(prepared)
        return await self._answer(request, body, prepared, envelope, prefixes)

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        self._check_common(body)
        _check_logprobs(body, body.logprobs, body.top_logprobs or 0, "top_logprobs")
        prepared = [await self._check(self.state.translator.chat, body)]
        envelope = Envelope("chat", self.state.names[0])
        return await self._answer(request, body, prepared, envelope, [""])

    # -- checks ------------------------------------------------------------------------------
    def _check_common(self, body: SamplingFields) -> None:
        names = self.state.names
        if body.model is not None and body.model not in names:
            raise APIError(
                f"the model {body.model!r} does not exist here; this server serves "
                f"{', '.join(repr(n) for n in names)}",
                param="model",
                status=404,
                code="model_not_found",
            )
        extra = sorted(body.model_extra or {})
        if extra:
            logger.warning("request fields ignored (unknown to this server): %s", ", ".join(extra))

    async def _check(self, translate: Callable[[Any], Any], body: Any) -> Any:
        """Run ``translate`` (tokenizers) on the checking thread, off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.state.checker, translate, body)

    # -- answering ---------------------------------------------------------------------------
    async def _answer(
        self,
        request: Request,
        body: SamplingFields,
        prepared: list[Prepared],
        envelope: Envelope,
        prefixes: list[str],
    ) -> Response:
        state = self.state
        prompt_tokens = sum(p.prompt_tokens for p in prepared)
        if state.log_prompts:
            for p in prepared:
                logger.info("%s prompt: %r", envelope.id, p.job.context)
        updates: Updates = asyncio.Queue()
        rids = self._submit(prepared, updates, body.stream)
        state.metrics.on_prompt(prompt_tokens)
        logger.info(
            "%s: %d prompt(s), %d prompt tokens, max_tokens %d, %s",
            envelope.id,
            len(prepared),
            prompt_tokens,
            prepared[0].job.max_new_tokens,
            "greedy" if prepared[0].job.sampling is None else "sampled",
        )
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            stream = self._stream(rids, updates, envelope, prefixes, prompt_tokens, include_usage)
            return StreamingResponse(stream, media_type="text/event-stream")
        try:
            finals = await _collect(updates, len(rids), request)
        except ClientGone:
            for rid in rids:
                state.scheduler.cancel(rid)
            logger.info("%s: client disconnected; its requests left the batch", envelope.id)
            return Response(status_code=499)
        texts = [prefix + update.text for prefix, update in zip(prefixes, finals, strict=True)]
        stats = [update.stats or GenerationStats() for update in finals]
        logprobs = None
        if body.logprobs is not None and body.logprobs is not False:  # completions: 0 asks too
            logprobs = []
            for p, prefix, update in zip(prepared, prefixes, finals, strict=True):
                pieces = await self._score("", prefix) if prefix else []
                pieces += await self._score(p.job.context, update.text) if update.text else []
                logprobs.append(envelope.logprobs(pieces))
        return JSONResponse(envelope.response(texts, stats, prompt_tokens, logprobs).model_dump())

    def _submit(self, prepared: list[Prepared], updates: Updates, stream: bool) -> list[int]:
        """Queue every prompt; each one's updates come back into ``updates`` on this loop."""
        loop = asyncio.get_running_loop()

        def sink_for(index: int) -> Callable[[Update], None]:
            def sink(update: Update) -> None:
                with contextlib.suppress(RuntimeError):  # the loop is gone (shutdown): nobody waits
                    loop.call_soon_threadsafe(updates.put_nowait, (index, update))

            return sink

        try:
            return [self.state.scheduler.submit(p.job, sink_for(i), stream) for i, p in enumerate(prepared)]
        except SchedulerClosed as exc:
            raise APIError(str(exc), status=503, kind="service_unavailable") from None

    async def _score(self, context: str, text: str) -> list[tuple[str, float]]:
        """``text``'s pieces and their ensemble log-probabilities after ``context``, computed on
        the decoding thread between two cycles."""
        state = self.state
        try:
            return await asyncio.wrap_future(state.scheduler.call(lambda: state.score(context, text)))
        except SchedulerClosed as exc:
            raise APIError(str(exc), status=503, kind="service_unavailable") from None
        except ValueError as exc:
            raise APIError(f"logprobs: {exc}", param="logprobs") from None

    async def _stream(
        self,
        rids: list[int],
        updates: Updates,
        envelope: Envelope,
        prefixes: list[str],
        prompt_tokens: int,
        include_usage: bool,
    ) -> AsyncIterator[str]:
        """Server-sent events: each settled piece as it comes, a choice's end with its finish
        reason and ``safe`` field, usage if asked, then ``[DONE]``. A client that disconnects
        ends this generator, and its requests leave the batch."""
        left = set(range(len(rids)))
        generated = 0
        try:
            for index, prefix in enumerate(prefixes):
                if envelope.chat:
                    yield envelope.chunk(index, role=True)
                if prefix:
                    yield envelope.chunk(index, prefix)
            while left:
                index, update = await updates.get()
                if update.error is not None:
                    yield event(_failure(update).body())
                    return
                if update.delta:
                    yield envelope.chunk(index, update.delta)
                if update.done:
                    left.discard(index)
                    stats = update.stats or GenerationStats()
                    generated += stats.generated_tokens
                    yield envelope.chunk(index, stats=stats)
            if include_usage:
                yield envelope.usage_chunk(prompt_tokens, generated)
            yield DONE
        finally:
            for index in left:
                self.state.scheduler.cancel(rids[index])


def _check_logprobs(body: SamplingFields, wanted: bool, alternatives: int, field: str) -> None:
    """What ``logprobs`` can mean for an ensemble (README "Serving"): the log-probability of
    each piece of text between the members' common token boundaries. Alternatives to a piece
    are not defined (the members have no common vocabulary), nor are pieces of a text not yet
    complete (a stream)."""
    if not wanted:
        return
    if alternatives:
        raise APIError(
            f"{field}={alternatives}: the ensemble's members have different tokenizers, so there "
            f"are no alternative tokens to list; send {field}=0 for each piece's log-probability",
            param=field,
        )
    if body.stream:
        raise APIError(
            "logprobs with stream=true: the ensemble scores a text once it is complete; "
            "send stream=false for logprobs",
            param="logprobs",
        )


def _failure(update: Update) -> APIError:
    error = update.error
    if isinstance(error, RequestCancelled):
        return APIError("the server is shutting down; send the request again", status=503, kind="service_unavailable")
    return APIError(f"decoding failed: {type(error).__name__}: {error}", status=500, kind="internal_error")


async def _collect(updates: Updates, count: int, request: Request) -> list[Update]:
    """Every request's final update, or :class:`ClientGone` once the client has left (asked
    every :data:`DISCONNECT_POLL` seconds while nothing comes)."""
    finals: list[Update | None] = [None] * count
    nxt = asyncio.ensure_future(updates.get())
    try:
        while any(f is None for f in finals):
            done, _ = await asyncio.wait({nxt}, timeout=DISCONNECT_POLL)
            if not done:
                if await request.is_disconnected():
                    raise ClientGone
                continue
            index, update = nxt.result()
            nxt = asyncio.ensure_future(updates.get())
            if update.error is not None:
                raise _failure(update)
            if update.done:
                finals[index] = update
    finally:
        nxt.cancel()
    return [f for f in finals if f is not None]
