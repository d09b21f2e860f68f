"""The HTTP routes: they only translate between OpenAI's API and the serving logic.

As vLLM's ``entrypoints/openai`` server: FastAPI parses each body into its pydantic model
(:mod:`.protocol`), the route hands it to :class:`~lm_eval_safe.serve.serving.Serving`, which does
the work through the scheduler; every error is an OpenAI error object, a body FastAPI cannot
parse or validate included (400, naming the field); ``/health`` and Prometheus ``/metrics``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from lm_eval_safe import __version__
from lm_eval_safe.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    not_json,
    request_error,
)
from lm_eval_safe.serve.serving import ServerState, Serving

__all__ = ["ServerState", "build_app"]

logger = logging.getLogger("lm_eval_safe.serve")

#: what the POST routes answer besides 200, for the OpenAPI page (``/docs``)
ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 500, 503)
}


def build_app(state: ServerState) -> FastAPI:
    serving = Serving(state)

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
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        return request_error(exc.errors(), exc.body, await request.body()).response()

    @app.exception_handler(HTTPException)
    async def unreadable_body(request: Request, exc: HTTPException) -> Response:
        """FastAPI's 400 for a JSON body it could not decode (bytes that are not UTF-8); any
        other (an unknown route, a wrong method) as FastAPI answers it."""
        if exc.status_code == 400 and isinstance(exc.__cause__, ValueError):
            return not_json(exc.__cause__).response()
        return await http_exception_handler(request, exc)

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
    async def models() -> JSONResponse:
        return JSONResponse(serving.models().model_dump())

    @app.post("/v1/completions", responses=ERRORS)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await serving.completion(body, request)

    @app.post("/v1/chat/completions", responses=ERRORS)
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        return await serving.chat(body, request)

    return app
