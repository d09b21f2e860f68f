"""A prompt holding a lone UTF-16 surrogate (``"a\\ud800b"``: JSON's ``"\\ud800"`` decodes to
one) is no text a tokenizer can encode. Every front door refuses it in one line that says so,
before any forward: lm-eval's ``generate_until``, ``loglikelihood`` and
``loglikelihood_rolling`` through the backend, and ``lm-eval-safe serve`` as its usual 400."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers import gen_request, make_lm
from lm_eval.api.instance import Instance
from serve_helpers import ServerProcess, post

from lm_eval_safe.errors import RequestError, check_text

LONE = "a\ud800b"
SAYS = "lone UTF-16 surrogate '\\ud800'"


def _doc(request_type: str, arguments: tuple, doc_id: int) -> Instance:
    """A request as lm-eval builds it for document ``doc_id`` of ``mytask``."""
    return Instance(request_type=request_type, doc={}, arguments=arguments, idx=0, metadata=("mytask", doc_id, 1))


def _count_forwards(lm: Any) -> list[int]:
    calls = [0]
    for member in lm.members:
        member.engine.model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def _one_line(error: BaseException, label: str) -> None:
    text = str(error)
    assert text.startswith(label) and SAYS in text and "\n" not in text, text
    assert "TextEncodeInput" not in text
    text.encode("utf-8")  # the message itself is printable, wherever it is written


@pytest.fixture(scope="module")
def lm(tiny_bpe_dir: Path, tiny_sp_dir: Path) -> Any:
    return make_lm(tiny_bpe_dir, tiny_sp_dir)


@pytest.mark.parametrize("text", [LONE, "\udfff", "x" * 50 + "\ud83d" + "y" * 50, "ok \ud83d\ude00"])
def test_the_check_names_the_surrogate_and_where(text: str) -> None:
    with pytest.raises(RequestError) as info:
        check_text(text)
    message = str(info.value)
    assert "lone UTF-16 surrogate" in message and "\n" not in message
    assert f"at character {text.index(next(c for c in text if 0xD800 <= ord(c) <= 0xDFFF))}" in message
    message.encode("utf-8")


@pytest.mark.parametrize("text", ["", "plain", "emoji \U0001f600 and \u00e9", "\ue000 private use"])
def test_valid_text_passes(text: str) -> None:
    check_text(text)


def test_generate_until_names_the_document_before_any_forward(lm: Any) -> None:
    forwards = _count_forwards(lm)
    good = _doc("generate_until", ("Q: 2+2?", {"until": ["\n"], "max_gen_toks": 4}), 0)
    bad = _doc("generate_until", (LONE, {"until": ["\n"], "max_gen_toks": 4}), 7)
    with pytest.raises(ValueError) as info:
        lm.generate_until([good, bad], disable_tqdm=True)
    _one_line(info.value, "mytask doc 7: ")
    chat = lm.apply_chat_template([{"role": "user", "content": LONE}])
    with pytest.raises(ValueError) as info:
        lm.generate_until([_doc("generate_until", (chat, {"until": [], "max_gen_toks": 4}), 3)], disable_tqdm=True)
    _one_line(info.value, "mytask doc 3: ")
    assert forwards[0] == 0
    assert lm.generate_until([gen_request("Q: 2+2?", until=["\n"], max_gen_toks=4)], disable_tqdm=True)


@pytest.mark.parametrize(("context", "continuation"), [(LONE, " yes"), ("Q: is it?", " a\ud800"), ("", LONE)])
def test_loglikelihood_names_the_document(lm: Any, context: str, continuation: str) -> None:
    requests = [_doc("loglikelihood", ("Q: is it?", " yes"), 0), _doc("loglikelihood", (context, continuation), 5)]
    with pytest.raises(ValueError) as info:
        lm.loglikelihood(requests, disable_tqdm=True)
    _one_line(info.value, "mytask doc 5: ")


def test_loglikelihood_rolling_says_so(lm: Any) -> None:
    with pytest.raises(ValueError) as info:
        lm.loglikelihood_rolling([_doc("loglikelihood_rolling", (LONE,), 2)], disable_tqdm=True)
    _one_line(info.value, "the text holds ")


def test_the_server_answers_its_usual_400(tiny_bpe_dir: Path, tiny_sp_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("fastapi")
    members = f"members={tiny_bpe_dir},{tiny_sp_dir}"
    chat = [{"role": "user", "content": LONE}]
    with ServerProcess(members, log_dir=tmp_path) as server:
        for path, body, param in [
            ("/v1/completions", {"prompt": LONE, "max_tokens": 4}, "prompt"),
            ("/v1/completions", {"prompt": ["fine", LONE], "max_tokens": 4}, "prompt"),
            ("/v1/chat/completions", {"messages": chat, "max_tokens": 4}, "messages"),
        ]:
            status, answer = post(server.url + path, body)  # json.dumps writes "\ud800" escaped
            assert status == 400, answer
            error = answer["error"]
            assert error["type"] == "invalid_request_error" and error["param"] == param
            _one_line(RuntimeError(error["message"]), f"{param}: the text holds ")
        status, answer = post(server.url + "/v1/completions", {"prompt": "a b", "max_tokens": 3, "temperature": 0})
        assert status == 200 and answer["choices"][0]["text"] is not None
