"""Crash-safe caches: the converted-weights and union-vocabulary caches survive a
kill mid-write, two processes building the same entry at once, and damaged files.

GGUF conversion itself is replaced by loading a tiny checkpoint (no tiny GGUF exists), so the
real cache code runs end to end: save, manifest, fsync, publish, verify, load."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from lm_eval_safe import disk_cache
from lm_eval_safe.engines.hf.loading import load_weights
from lm_eval_safe.ensemble.aggregate import UnionVocabulary
from lm_eval_safe.members import checkpoints
from lm_eval_safe.members.sources import MemberSource
from lm_eval_safe.members.vocabulary import TokenVocabulary

GGUF_HEADER = b"GGUF" + (3).to_bytes(4, "little")


def _fake_gguf(tmp_path: Path) -> MemberSource:
    """A file with a valid GGUF header, standing for a member's GGUF."""
    path = tmp_path / "member.gguf"
    path.write_bytes(GGUF_HEADER + b"\0" * 64)
    return MemberSource(str(path), "member", "gguf", str(path))


@pytest.fixture
def conversions(monkeypatch: pytest.MonkeyPatch, tiny_bpe_dir: Path) -> list[str]:
    """Replace de-quantization by loading the tiny BPE checkpoint; records each conversion."""
    calls: list[str] = []

    def fake_load_gguf(source: MemberSource, dtype: object, trust: bool) -> tuple:
        calls.append(source.location)
        return checkpoints.load_pretrained(str(tiny_bpe_dir), dtype, trust)

    monkeypatch.setattr(checkpoints, "_load_gguf", fake_load_gguf)
    return calls


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([[1, 2, 3, 4]])).logits


def _entry(cache: Path) -> Path:
    (folder,) = [p for p in (cache / "converted").iterdir() if not p.name.startswith(".")]
    return folder


def test_converted_weights_are_verified_and_a_damaged_entry_is_rebuilt(
    tmp_path: Path, conversions: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    source = _fake_gguf(tmp_path)
    cache = str(tmp_path / "cache")
    model, _ = load_weights(source, torch.float32, False, cache)
    reference = _logits(model)
    folder = _entry(Path(cache))
    assert len(conversions) == 1
    assert (folder / disk_cache.MANIFEST).is_file() and (folder / "complete.json").is_file()

    # a valid entry is loaded, not converted again
    model, _ = load_weights(source, torch.float32, False, cache)
    assert len(conversions) == 1 and torch.equal(_logits(model), reference)

    weights = folder / "model.safetensors"
    damages = {
        "truncated": lambda: os.truncate(weights, weights.stat().st_size // 2),
        "one byte changed": lambda: _flip_byte(weights, weights.stat().st_size - 100),
        "manifest gone": lambda: (folder / disk_cache.MANIFEST).unlink(),
        "file gone": lambda: (folder / "config.json").unlink(),
    }
    for number, (what, damage) in enumerate(damages.items(), start=2):
        damage()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="lm_eval_safe"):
            model, _ = load_weights(source, torch.float32, False, cache)
        assert len(conversions) == number, what
        warnings = [
            r.getMessage()
            for r in caplog.records
            if r.levelno == logging.WARNING and r.name.startswith("lm_eval_safe")
        ]
        assert len(warnings) == 1 and "damaged" in warnings[0] and "rebuilding" in warnings[0], what
        assert "\n" not in warnings[0]
        assert torch.equal(_logits(model), reference), what
        assert disk_cache.folder_problem(folder) is None, what


def _flip_byte(path: Path, offset: int) -> None:
    with path.open("r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0xFF]))


_BUILDER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from lm_eval_safe.members import checkpoints
    from lm_eval_safe.engines.hf.loading import load_weights
    from lm_eval_safe.members.sources import MemberSource

    tiny, gguf, cache, log, pause, stall = sys.argv[1:7]
    save = checkpoints._save_dequantized

    def slow_conversion(source, dtype, trust):
        with open(log, "a") as handle:
            handle.write("convert\\n")
        time.sleep(float(pause))
        return checkpoints.load_pretrained(tiny, dtype, trust)

    def stalled_save(model, tokenizer, folder):
        save(model, tokenizer, folder)
        print("written", flush=True)
        time.sleep(float(stall))

    checkpoints._load_gguf = slow_conversion
    checkpoints._save_dequantized = stalled_save
    import torch
    load_weights(MemberSource(gguf, "member", "gguf", gguf), torch.float32, False, cache)
    print("loaded", flush=True)
    """
)


def _builder(
    tiny: Path, source: MemberSource, cache: Path, log: Path, pause: float, stall: float = 0.0
) -> subprocess.Popen:
    """A process loading ``source`` whose conversion takes ``pause`` s and which stalls
    ``stall`` s after writing the weights (before the manifest and the rename)."""
    args = [str(tiny), source.location, str(cache), str(log), str(pause), str(stall)]
    return subprocess.Popen(
        [sys.executable, "-c", _BUILDER, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_two_processes_converting_the_same_gguf_at_once(tmp_path: Path, tiny_bpe_dir: Path) -> None:
    """Data-parallel ranks: both get a valid entry; the lock makes the second reuse the first's."""
    source, cache, log = _fake_gguf(tmp_path), tmp_path / "cache", tmp_path / "conversions.log"
    ranks = [_builder(tiny_bpe_dir, source, cache, log, pause=2.0) for _ in range(2)]
    outputs = [rank.communicate(timeout=300) for rank in ranks]
    for rank, (out, err) in zip(ranks, outputs, strict=True):
        assert rank.returncode == 0, err[-2000:]
        assert "loaded" in out
    assert log.read_text().count("convert") == 1
    folder = _entry(cache)
    assert disk_cache.folder_problem(folder) is None
    leftovers = [p.name for p in (cache / "converted").iterdir() if ".tmp-" in p.name]
    assert leftovers == []


def test_a_conversion_killed_mid_write_is_never_read(
    tmp_path: Path, tiny_bpe_dir: Path, conversions: list[str]
) -> None:
    """SIGKILL while the entry is being written: nothing is published, the lock dies with the
    process, and the next load converts afresh."""
    source, cache, log = _fake_gguf(tmp_path), tmp_path / "cache", tmp_path / "conversions.log"
    victim = _builder(tiny_bpe_dir, source, cache, log, pause=0.0, stall=60.0)
    assert victim.stdout is not None
    assert victim.stdout.readline().strip() == "written"
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait(timeout=30)
    entries = list((cache / "converted").iterdir())
    (partial,) = [p for p in entries if ".tmp-" in p.name]
    assert (partial / "model.safetensors").is_file()  # killed with the weights written...
    assert [p for p in entries if not p.name.startswith(".")] == []  # ...and nothing published
    started = time.perf_counter()
    model, _ = load_weights(source, torch.float32, False, str(cache))
    assert time.perf_counter() - started < 60, "the dead process's lock must not block"
    assert conversions == [source.location]
    assert disk_cache.folder_problem(_entry(cache)) is None


def test_a_folder_without_manifest_is_rebuilt_and_temporaries_are_ignored(tmp_path: Path) -> None:
    folder = tmp_path / "entry"
    (tmp_path / ".entry.tmp-1-abc").mkdir()  # what a killed builder leaves behind
    (tmp_path / ".entry.tmp-1-abc" / "data.bin").write_bytes(b"half")
    folder.mkdir()
    (folder / "data.bin").write_bytes(b"half")  # an older layout or a crash: no manifest

    def build(tmp: Path) -> None:
        (tmp / "data.bin").write_bytes(b"whole")

    assert disk_cache.folder_problem(folder) == "no manifest: never finished"
    assert disk_cache.cached_folder(folder, build, "test") is True
    assert (folder / "data.bin").read_bytes() == b"whole"
    assert disk_cache.cached_folder(folder, build, "test") is False


def test_union_vocabulary_cache_survives_damage(
    tmp_path: Path, _tiny_bpe_parts: tuple, _tiny_sp_parts: tuple, caplog: pytest.LogCaptureFixture
) -> None:
    vocabs = [TokenVocabulary.for_tokenizer(tok) for tok, _ in (_tiny_bpe_parts, _tiny_sp_parts)]
    reference = UnionVocabulary.build(vocabs)
    UnionVocabulary.build(vocabs, cache_dir=tmp_path)
    (path,) = (tmp_path / "union-vocab").iterdir()
    hollow = [dataclasses.replace(v, keys=[]) for v in vocabs]  # loads must not rebuild

    def same(union: UnionVocabulary) -> bool:
        return union.keys == reference.keys and all(
            torch.equal(a, b) for a, b in zip(union.maps, reference.maps, strict=True)
        )

    assert same(UnionVocabulary.build(hollow, cache_dir=tmp_path))
    for damage in (
        lambda: os.truncate(path, path.stat().st_size - 10),
        lambda: _flip_byte(path, path.stat().st_size // 2),
        lambda: path.write_bytes(b""),
    ):
        damage()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="lm_eval_safe"):
            assert same(UnionVocabulary.build(vocabs, cache_dir=tmp_path))
        ours = [r for r in caplog.records if r.name.startswith("lm_eval_safe")]
        assert [r.getMessage().split(" (")[0] for r in ours] == [
            f"union vocabulary cache {path} is damaged"
        ]
        assert same(UnionVocabulary.build(hollow, cache_dir=tmp_path))  # rewritten whole
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporaries left


def test_json_written_atomically_leaves_no_temporary(tmp_path: Path) -> None:
    """The one JSON writer (leaderboard records, small-row timings): the whole file or the old
    one, UTF-8 as written, no temporary left next to it."""
    path = tmp_path / "sub" / "record.json"
    disk_cache.atomic_write_json(path, {"b": [1, 2], "a": "café", "where": tmp_path}, indent=2)
    disk_cache.atomic_write_json(path, {"b": 1, "a": "ü"}, sort_keys=True)
    assert path.read_text(encoding="utf-8") == '{"a": "ü", "b": 1}\n'
    assert [p.name for p in path.parent.iterdir()] == ["record.json"]
