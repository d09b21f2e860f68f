"""``lm-eval-safe serve``'s answers to bad input, as a real process on a free port: every bad
request gets the OpenAI error object in one line naming the field, the server keeps serving, and
a JSON body is read whatever content type a client sends it under."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers import gen_request, make_lm
from serve_helpers import ServerProcess, get, post

pytest.importorskip("fastapi")

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def server(tiny_bpe_dir: Path, tiny_sp_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    members = f"members={tiny_bpe_dir},{tiny_sp_dir},dtype=float64"
    with ServerProcess(f"{members},batch_size=8", log_dir=tmp_path_factory.mktemp("serve")) as process:
        yield process


@pytest.fixture(scope="module")
def reference(tiny_bpe_dir: Path, tiny_sp_dir: Path) -> Any:
    """The backend, one request at a time."""
    return make_lm(tiny_bpe_dir, tiny_sp_dir, dtype="float64")


def alone(lm: Any, context: str, **gen_kwargs: Any) -> str:
    return lm.generate_until([gen_request(context, **gen_kwargs)], disable_tqdm=True)[0]


# -- bad input ------------------------------------------------------------------------------
BAD_REQUESTS = [
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": ', 400, None, "not valid JSON"),
    ("/v1/completions", b"[1, 2]", 400, None, "JSON object"),
    ("/v1/completions", {"max_tokens": 5}, 400, "prompt", "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "five"}, 400, "max_tokens", "integer"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "at least 1"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -3}, 400, "max_tokens", "at least 1"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 100000}, 400, "prompt", "context window"),
    ("/v1/completions", {"prompt": "the cat " * 400, "max_tokens": 4}, 400, "prompt", "context window"),
    ("/v1/completions", {"prompt": "", "max_tokens": 4}, 400, "prompt", "empty prompt"),
    ("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 4}, 400, "prompt", "as text"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model", "does not exist"),
    ("/v1/completions", {"prompt": "hi", "n": 2}, 400, "n", "n=2"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature", "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p", "top_p"),
    ("/v1/completions", {"prompt": "hi", "stop": 5}, 400, "stop", "stop"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 0.5}, 400, "presence_penalty", "not supported"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 1.0}}, 400, "logit_bias", "not supported"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 2}, 400, "logprobs", "different tokenizers"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 0, "stream": True}, 400, "logprobs", "stream"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 3}, 400, "top_logprobs", "different tokenizers"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role", "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages.content", "text"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, 400, "tools", "not supported"),
    # bodies FastAPI cannot parse, or parses to something that is not an object
    ("/v1/completions", b"", 400, None, "not valid JSON: Expecting value: line 1 column 1 (char 0)"),
    ("/v1/completions", b"\xff{}", 400, None, "not valid JSON: 'utf-8' codec can't decode byte 0xff"),
    ("/v1/completions", b"null", 400, None, "JSON object"),
    ("/v1/completions", b'"hi"', 400, None, "JSON object"),
    # a wrong type deep in the body: the field's dotted name
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": "maybe"}}, 400, "stream_options.include_usage", "valid boolean"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content", "(got 5)"),
]


@pytest.mark.parametrize(("path", "body", "status", "param", "says"), BAD_REQUESTS)
def test_bad_requests_get_a_clear_4xx(server: Any, path: str, body: Any, status: int, param: str | None, says: str) -> None:
    raw = body if isinstance(body, bytes) else None
    code, answer = post(server.url + path, body, raw=raw)
    assert code == status, answer
    error = answer["error"]
    assert error["param"] == param
    assert says in error["message"] and "\n" not in error["message"]
    assert error["type"] == "invalid_request_error"


def test_the_server_keeps_serving_after_bad_requests(server: Any, reference: Any) -> None:
    """Unknown fields and ``user`` are ignored (as vLLM does); good requests still answer."""
    for _, body, *_ in BAD_REQUESTS[:6]:
        post(server.url + "/v1/completions", body, raw=body if isinstance(body, bytes) else None)
    status, answer = post(server.url + "/v1/completions", {"prompt": "a mat", "max_tokens": 6, "temperature": 0, "user": "u1", "frobnicate": True})
    assert status == 200
    assert answer["choices"][0]["text"] == alone(reference, "a mat", max_gen_toks=6)
    assert get(server.url + "/health")[0] == 200


def test_a_json_body_is_read_whatever_its_content_type(server: Any, reference: Any) -> None:
    """``curl -d`` sends a form's content type: the body is still read as JSON (and a bad one
    is still the OpenAI error object); paths and methods the server lacks get FastAPI's own
    404 and 405."""
    body = {"prompt": "a mat", "max_tokens": 6, "temperature": 0}
    expected = alone(reference, "a mat", max_gen_toks=6)
    for content_type in ("application/x-www-form-urlencoded", "text/plain"):
        status, answer = post(server.url + "/v1/completions", body, {"Content-Type": content_type})
        assert status == 200 and answer["choices"][0]["text"] == expected
        status, answer = post(server.url + "/v1/completions", None, {"Content-Type": content_type}, raw=b"{")
        assert status == 400 and answer["error"]["message"].startswith("the request body is not valid JSON: ")
    assert post(server.url + "/v1/no-such-route", body) == (404, {"detail": "Not Found"})
    assert get(server.url + "/v1/completions") == (405, '{"detail":"Method Not Allowed"}')
