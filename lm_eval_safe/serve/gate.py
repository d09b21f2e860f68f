"""What every HTTP request passes before a route sees it: the API key, the body's size, and the
count of answers by route and status for ``/metrics``.

Plain ASGI, outside FastAPI, so that a request without the key is refused before its body is
read, and a body over the limit is refused while it arrives (a ``Content-Length`` over the limit
at once), never buffered whole.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Callable

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lm_eval_safe.serve.protocol import APIError

#: routes whose answers are counted under their own name (others: "other", so that probing
#: random paths cannot grow the metrics without bound)
COUNTED_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


class Gate:
    """``api_key``: required as ``Authorization: Bearer <key>`` on every ``/v1`` route (as vLLM's
    ``--api-key``: ``/health`` and ``/metrics`` stay open for probes), compared in constant time.
    ``max_body``: bytes a request body may have. ``on_answer(route, status)``: each answer."""

    def __init__(
        self,
        app: ASGIApp,
        api_key: str | None,
        max_body: int,
        on_answer: Callable[[str, int], None] | None = None,
    ):
        self.app = app
        self.expected = None if api_key is None else _digest(b"Bearer " + api_key.encode())
        self.max_body = max_body
        self.on_answer = on_answer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        route = path if path in COUNTED_ROUTES else "other"
        if self.on_answer is not None:
            send = self._counting(send, route)
        headers = Headers(scope=scope)
        if self.expected is not None and path.startswith("/v1"):
            given = _digest(headers.get("authorization", "").encode("latin-1"))
            if not secrets.compare_digest(given, self.expected):
                refused = APIError(
                    "missing or wrong API key: send 'Authorization: Bearer <key>'",
                    status=401, kind="authentication_error", code="invalid_api_key",
                )  # fmt: skip
                await refused.response({"www-authenticate": "Bearer"})(scope, receive, send)
                return
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            await self._too_large()(scope, receive, send)
            return
        body, more = b"", True
        while more:  # the body read here, within the limit, then handed on whole
            message = await receive()
            if message["type"] != "http.request":
                break
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body:
                await self._too_large()(scope, receive, send)
                return
        delivered = False

        async def replay() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the client's disconnect, when it comes

        await self.app(scope, replay, send)

    def _too_large(self) -> JSONResponse:
        return APIError(
            f"request body over {self.max_body} bytes: send less (or start the server with a larger --max-request-bytes)",
            status=413, code="request_too_large",
        ).response()  # fmt: skip

    def _counting(self, send: Send, route: str) -> Send:
        on_answer = self.on_answer
        assert on_answer is not None

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                on_answer(route, int(message["status"]))
            await send(message)

        return counted
