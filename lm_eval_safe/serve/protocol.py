"""The OpenAI API's request bodies as FastAPI parses them, and its error object.

Field names, defaults and meanings are OpenAI's (``/v1/completions``, ``/v1/chat/completions``),
with vLLM's extension ``top_k``. Fields a client may send that the ensemble cannot honour at the
value given (``n`` > 1, penalties, ``logit_bias``, tools, ...) are refused with a 400 naming the
field rather than ignored; fields the server does not know at all are ignored and logged, as
vLLM's server does (``user`` among them).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.responses import JSONResponse


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error object: every error the server answers (the gate's included) has it."""

    error: ErrorInfo


class APIError(Exception):
    """A request the server answers with an OpenAI error object: ``status``, one line saying
    what is wrong and what to do, and the field (``param``) it is about."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        kind: str = "invalid_request_error",
        code: str | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.kind = kind
        self.code = code

    def body(self) -> dict[str, Any]:
        info = ErrorInfo(message=self.message, type=self.kind, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def not_json(exc: ValueError) -> APIError:
    return APIError(f"the request body is not valid JSON: {exc}", param=None)


def request_error(errors: Sequence[Any], body: Any, raw: bytes) -> APIError:
    """FastAPI's first complaint about a request body (``RequestValidationError.errors()``) as
    one line naming the field (``messages.0.content``). ``body``: what FastAPI parsed, or the
    text it could not; ``raw``: the bytes received (an empty body and ``null`` both reach the
    model as nothing)."""
    first = errors[0]
    loc = list(first["loc"])
    if loc[:1] == ["body"]:
        loc = loc[1:]
    if first["type"] == "json_invalid":  # FastAPI's own JSON parse: the error's text and offset
        return not_json(json.JSONDecodeError(first["ctx"]["error"], body, loc[0]))
    if not loc:  # the body as a whole
        error = (first.get("ctx") or {}).get("error")
        if first["type"] == "value_error" and isinstance(error, ValueError):
            return not_json(error)  # sent as another content type, and not JSON
        if first["type"] == "missing" and not raw.strip():
            return not_json(json.JSONDecodeError("Expecting value", raw.decode("latin-1"), 0))
        return APIError("the request body must be a JSON object", param=None)
    param = ".".join(str(part) for part in loc if not _union_tag(part)) or None
    got = first.get("input")
    shown = repr(got) if not isinstance(got, (dict, list)) else type(got).__name__
    return APIError(f"{param}: {first['msg']} (got {shown[:80]})", param=param)


def _union_tag(part: object) -> bool:
    """pydantic names the member of a union it tried (``stop.str``, ``prompt.list[int]``):
    not a field of the request."""
    if not isinstance(part, str):
        return False
    return "[" in part or part in ("str", "int", "float", "bool", "dict", "list") or part[:1].isupper()


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class SamplingFields(BaseModel):
    """What both endpoints share: the model, the budget, sampling and stop strings."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _json_text(cls, data: Any) -> Any:
        """A body sent as another content type (``curl -d`` sends a form's) reaches the model as
        bytes: read as JSON, as the server always has."""
        return json.loads(data) if isinstance(data, (bytes, bytearray)) else data

    model: str | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def refuse_unsupported(self) -> None:
        """A value the ensemble cannot honour is a 400, never silently dropped."""
        if self.n != 1:
            raise APIError(
                f"n={self.n}: the ensemble returns one choice per prompt; send n=1 (or the "
                "request several times, with different seeds when sampling)",
                param="n",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0.0:
                raise APIError(f"{name} is not supported by the ensemble; send 0 or leave it out", param=name)
        if self.logit_bias:
            raise APIError("logit_bias is not supported by the ensemble (its members have different vocabularies); leave it out", param="logit_bias")


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    best_of: int | None = None
    suffix: str | None = None

    def prompts(self) -> list[str]:
        if isinstance(self.prompt, str):
            return [self.prompt]
        if self.prompt and all(isinstance(p, str) for p in self.prompt):
            return list(self.prompt)  # type: ignore[arg-type]
        if not self.prompt:
            raise APIError("prompt is an empty list: send a string or a list of strings", param="prompt")
        raise APIError(
            "prompt: token ids are not accepted: the ensemble's members have different "
            "tokenizers, so send the prompt as text",
            param="prompt",
        )

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.best_of not in (None, 1):
            raise APIError("best_of is not supported by the ensemble; send 1 or leave it out", param="best_of")
        if self.suffix:
            raise APIError("suffix (insertion) is not supported by the ensemble; leave it out", param="suffix")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """The message as a chat template reads it: content as one string."""
        content = self.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise APIError(
                        f"content part of type {part.type!r}: only text parts are supported",
                        param="messages.content",
                    )
                texts.append(part.text)
            content = "".join(texts)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True

    def budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.tools:
            raise APIError("tools are not supported by the ensemble; leave them out", param="tools")
        if self.tool_choice not in (None, "none"):
            raise APIError("tool_choice is not supported by the ensemble; leave it out", param="tool_choice")
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise APIError(
                "response_format other than text is not supported by the ensemble; leave it out",
                param="response_format",
            )
