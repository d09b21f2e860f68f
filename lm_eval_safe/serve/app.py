"""The HTTP routes: they only translate between OpenAI's API and the scheduler.

As vLLM's ``entrypoints/openai`` server: FastAPI routes, an engine client that does the work
(:class:`~lm_eval_safe.serve.scheduler.Scheduler`), errors as OpenAI error objects, ``/health``
and Prometheus ``/metrics``. A request is parsed and checked (:mod:`.translate`) before it is
queued, so every bad input is a 4xx and reaches no member; a client that goes away cancels its
requests, which leave the batch at the next cycle's end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from lm_eval_safe import __version__
from lm_eval_safe.serve.metrics import Metrics
from lm_eval_safe.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    parse,
)
from lm_eval_safe.serve.responses import DONE, Envelope, event
from lm_eval_safe.serve.scheduler import RequestCancelled, Scheduler, SchedulerClosed, Update
from lm_eval_safe.serve.translate import Prepared, Translator
from lm_eval_safe.stats import GenerationStats

logger = logging.getLogger("lm_eval_safe.serve")


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


def build_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.scheduler.start()
        logger.info("ready: serving %s", ", ".join(state.names))
        yield
        logger.info("shutting down: no new requests; cancelling what is left")
        await asyncio.get_running_loop().run_in_executor(None, state.scheduler.close, 60.0)
        state.checker.shutdown(wait=False)

    app = FastAPI(title="lm-eval-safe", version=__version__, lifespan=lifespan)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if state.scheduler.alive else 503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        created = int(time.time())
        cards = [
            {"id": name, "object": "model", "created": created, "owned_by": "lm-eval-safe", **state.description}
            for name in state.names
        ]
        return {"object": "list", "data": cards}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = parse(CompletionRequest, await _json(request))
        _check_common(state, body)
        _check_logprobs(body, body.logprobs is not None, body.logprobs or 0, "logprobs")
        prepared = await _check(state, state.translator.completion, body)
        envelope = Envelope("completion", state.names[0])
        prefixes = body.prompts() if body.echo else [""] * len(prepared)
        return await _answer(state, request, body, prepared, envelope, prefixes)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = parse(ChatCompletionRequest, await _json(request))
        _check_common(state, body)
        _check_logprobs(body, body.logprobs, body.top_logprobs or 0, "top_logprobs")
        prepared = [await _check(state, state.translator.chat, body)]
        return await _answer(state, request, body, prepared, Envelope("chat", state.names[0]), [""])

    return app


async def _json(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(f"the request body is not valid JSON: {exc}", param=None) from None


def _check_common(state: ServerState, body: SamplingFields) -> None:
    if body.model is not None and body.model not in state.names:
        raise APIError(
            f"the model {body.model!r} does not exist here; this server serves "
            f"{', '.join(repr(n) for n in state.names)}",
            param="model",
            status=404,
            code="model_not_found",
        )
    extra = sorted(body.model_extra or {})
    if extra:
        logger.warning("request fields ignored (unknown to this server): %s", ", ".join(extra))


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


async def _check(state: ServerState, translate: Callable[[Any], Any], body: Any) -> Any:
    """Run ``translate`` (tokenizers) on the checking thread, off the event loop."""
    return await asyncio.get_running_loop().run_in_executor(state.checker, translate, body)


async def _answer(
    state: ServerState,
    request: Request,
    body: SamplingFields,
    prepared: list[Prepared],
    envelope: Envelope,
    prefixes: list[str],
) -> Response:
    prompt_tokens = sum(p.prompt_tokens for p in prepared)
    if state.log_prompts:
        for p in prepared:
            logger.info("%s prompt: %r", envelope.id, p.job.context)
    loop = asyncio.get_running_loop()
    updates: asyncio.Queue[tuple[int, Update]] = asyncio.Queue()

    def sink_for(index: int) -> Callable[[Update], None]:
        def sink(update: Update) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is gone (shutdown): nobody waits
                loop.call_soon_threadsafe(updates.put_nowait, (index, update))

        return sink

    try:
        rids = [state.scheduler.submit(p.job, sink_for(i), body.stream) for i, p in enumerate(prepared)]
    except SchedulerClosed as exc:
        raise APIError(str(exc), status=503, kind="service_unavailable") from None
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
        stream = _stream(state, rids, updates, envelope, prefixes, prompt_tokens, include_usage)
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
            pieces = await _score(state, "", prefix) if prefix else []
            pieces += await _score(state, p.job.context, update.text) if update.text else []
            logprobs.append(envelope.logprobs(pieces))
    return JSONResponse(envelope.response(texts, stats, prompt_tokens, logprobs))


async def _score(state: ServerState, context: str, text: str) -> list[tuple[str, float]]:
    """``text``'s pieces and their ensemble log-probabilities after ``context``, computed on
    the decoding thread between two cycles."""
    try:
        return await asyncio.wrap_future(state.scheduler.call(lambda: state.score(context, text)))
    except SchedulerClosed as exc:
        raise APIError(str(exc), status=503, kind="service_unavailable") from None
    except ValueError as exc:
        raise APIError(f"logprobs: {exc}", param="logprobs") from None


def _failure(update: Update) -> APIError:
    error = update.error
    if isinstance(error, RequestCancelled):
        return APIError("the server is shutting down; send the request again", status=503, kind="service_unavailable")
    return APIError(f"decoding failed: {type(error).__name__}: {error}", status=500, kind="internal_error")


async def _collect(updates: asyncio.Queue, count: int, request: Request) -> list[Update]:
    """Every request's final update, or :class:`ClientGone` as soon as the client leaves."""
    finals: list[Update | None] = [None] * count
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        while any(f is None for f in finals):
            nxt = asyncio.ensure_future(updates.get())
            await asyncio.wait({nxt, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not nxt.done():
                nxt.cancel()
                raise ClientGone
            index, update = nxt.result()
            if update.error is not None:
                raise _failure(update)
            if update.done:
                finals[index] = update
    finally:
        gone.cancel()
    return [f for f in finals if f is not None]


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _stream(
    state: ServerState,
    rids: list[int],
    updates: asyncio.Queue,
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
            state.scheduler.cancel(rids[index])
