"""Members named as the stores people keep GGUF models in name them: ``ollama:NAME[:TAG]``,
``hf:ORG/REPO[:QUANT]`` and ``lmstudio:PUBLISHER/REPO[/FILE]``, and ``lm-eval-safe models``,
on stores built as their programs lay them out (tests/store_builders.py) from small GGUF files:
each name resolves to the file it means, bad stores fail in one line that says what to do.
The real members through each name: tests/members/test_store_members.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from store_builders import hf_store, link, ollama_store, sha256, tiny_gguf

from lm_eval_safe.errors import OptionError
from lm_eval_safe.members.gguf_info import join_split, quant_tag, read_header, split_parts
from lm_eval_safe.members.sources import content_identity, resolve_source
from lm_eval_safe.model_args import member_display_name


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A home folder of its own (Ollama's and LM Studio's default places lie in it), a hub
    cache and a cache folder of this package's of their own, the hub offline."""
    from lm_eval_safe.disk_cache import cache_root

    monkeypatch.setenv("LM_EVAL_SAFE_CACHE", os.environ.get("LM_EVAL_SAFE_CACHE") or str(cache_root()))
    folder = tmp_path / "home"
    folder.mkdir()
    monkeypatch.setenv("HOME", str(folder))
    monkeypatch.delenv("OLLAMA_MODELS", raising=False)
    for variable in ("HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return folder


@pytest.fixture
def own_cache(home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache folder of this test's: files are hashed afresh."""
    monkeypatch.setenv("LM_EVAL_SAFE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def small(tmp_path: Path) -> Path:
    return tiny_gguf(tmp_path / "files" / "small-Q4_K_M.gguf")


# -- Ollama --------------------------------------------------------------------------------------


def test_ollama_names_resolve_to_their_blob(home: Path, own_cache: Path, small: Path, tmp_path: Path) -> None:
    root = home / ".ollama" / "models"
    ollama_store(root, "tiny", small)
    ollama_store(root, "tiny", small, tag="1b")
    ollama_store(root, "coder", small, namespace="someone")
    other = tiny_gguf(tmp_path / "files" / "other.gguf", pre="qwen2")
    ollama_store(root, "Mixed", other, tag="Q4")
    digest = sha256(small)
    for spec in ("ollama:tiny", "ollama:tiny:latest", "ollama:tiny:1b", "OLLAMA:someone/coder", "ollama:registry.ollama.ai/library/tiny"):
        source = resolve_source(spec)
        assert (source.kind, Path(source.location).name, source.sha256) == ("gguf", f"sha256-{digest}", (digest,))
    assert resolve_source("ollama:mixed:q4").sha256 == (sha256(other),)  # names match in any case, as Ollama's do
    assert resolve_source("ollama:tiny:1b").name == "tiny-1b"


def test_ollama_models_folder_is_the_one_ollama_uses(home: Path, own_cache: Path, small: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    elsewhere = tmp_path / "elsewhere"
    ollama_store(elsewhere, "tiny", small)
    default = home / ".ollama" / "models"
    with pytest.raises(OptionError, match=rf"Ollama's models folder {default} does not exist: install Ollama and run `ollama pull tiny`, or set OLLAMA_MODELS"):
        resolve_source("ollama:tiny")
    default.mkdir(parents=True)
    with pytest.raises(OptionError, match=r"has no tiny:latest \(it has: nothing\) \(set OLLAMA_MODELS"):
        resolve_source("ollama:tiny")
    monkeypatch.setenv("OLLAMA_MODELS", str(elsewhere))
    assert resolve_source("ollama:tiny").sha256 == (sha256(small),)
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "nonexistent"))
    with pytest.raises(OptionError, match=r"OLLAMA_MODELS names .*nonexistent, which does not exist: set it to the folder"):
        resolve_source("ollama:tiny")


def _one_line(exc: pytest.ExceptionInfo[OptionError]) -> str:
    message = str(exc.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    "case, expected",
    [
        ("missing tag", r"has no tiny:7b \(it has: tiny:latest\); run `ollama pull tiny:7b`"),
        ("missing model", r"has no nothere:latest \(it has: tiny:latest\); run `ollama pull nothere`"),
        ("manifest not JSON", r"is not a manifest's JSON .*; pull the model again"),
        ("manifest without layers", r"is not a manifest's JSON .*; pull the model again"),
        ("blob sha256 mismatch", r"is named by sha256 0{12}\.\.\. but its bytes hash to .*: download the model again"),
        ("adapter layer", r"has an adapter \(LoRA\) layer on top of its weights, .*use the model it is built on"),
        ("projector layer", r"has a projector \(vision\) layer on top of its weights"),
        ("missing blob", r"names the blob sha256-.*, which is missing; run `ollama pull tiny` again"),
        ("no GGUF layer", r"has 0 GGUF weight layers \(its layers: template\)"),
    ],
)
def test_bad_ollama_stores_fail_in_one_line(home: Path, own_cache: Path, small: Path, case: str, expected: str) -> None:
    root = home / ".ollama" / "models"
    manifest = ollama_store(root, "tiny", small)
    spec = {"missing tag": "ollama:tiny:7b", "missing model": "ollama:nothere"}.get(case, "ollama:tiny")
    body = json.loads(manifest.read_text())
    if case == "manifest not JSON":
        manifest.write_text("<html>not found</html>")
    elif case == "manifest without layers":
        manifest.write_text(json.dumps({"schemaVersion": 2}))
    elif case == "blob sha256 mismatch":
        ollama_store(root, "tiny", small, digest="0" * 64)
    elif case in ("adapter layer", "projector layer"):
        kind = case.split()[0]
        ollama_store(root, "tiny", small, layers=({"mediaType": f"application/vnd.ollama.image.{kind}", "digest": "sha256:" + "2" * 64, "size": 1},))
    elif case == "missing blob":
        (root / "blobs" / f"sha256-{sha256(small)}").unlink()
    elif case == "no GGUF layer":
        body["layers"] = body["layers"][1:]
        manifest.write_text(json.dumps(body))
    with pytest.raises(OptionError) as raised:
        resolve_source(spec)
    assert f"member {spec!r}" in _one_line(raised)
    assert raised.match(expected)


def test_a_blob_replaced_after_its_check_is_checked_again(home: Path, own_cache: Path, small: Path, tmp_path: Path) -> None:
    """The sha256 of a file is kept once seen, with its size and time of change: a blob whose
    bytes change afterwards is hashed again and refused."""
    root = home / ".ollama" / "models"
    ollama_store(root, "tiny", small)
    assert resolve_source("ollama:tiny").sha256 == (sha256(small),)
    blob = root / "blobs" / f"sha256-{sha256(small)}"
    data = bytearray(small.read_bytes())
    data[-1] ^= 1
    blob.unlink()
    blob.write_bytes(bytes(data))
    with pytest.raises(OptionError, match="its bytes hash to"):
        resolve_source("ollama:tiny")


# -- the Hugging Face cache ----------------------------------------------------------------------


def test_hf_names_pick_the_quantization_as_llama_cpp_does(home: Path, own_cache: Path, tmp_path: Path) -> None:
    files = tmp_path / "files"
    q4 = tiny_gguf(files / "a.gguf", tokens=5)
    q8 = tiny_gguf(files / "b.gguf", tokens=6)
    split = tiny_gguf(files / "c.gguf", tokens=8, split=1)
    parts = split_parts(split)
    snapshot = hf_store(
        tmp_path / "hub", "org/Tiny-GGUF",
        {"tiny-q4_k_m.gguf": q4, "tiny.Q8_0.gguf": q8, "mmproj-tiny-Q4_K_M.gguf": q8,
         **{f"F16/tiny-F16-{i:05d}-of-00003.gguf": p for i, p in enumerate(parts, 1)}},
    )  # fmt: skip
    assert resolve_source("hf:org/Tiny-GGUF").location == str(snapshot / "tiny-q4_k_m.gguf")
    assert resolve_source("hf:org/Tiny-GGUF:q8_0").location == str(snapshot / "tiny.Q8_0.gguf")
    split_source = resolve_source("hf:org/Tiny-GGUF:F16")
    assert split_source.location == str(snapshot / "F16" / "tiny-F16-00001-of-00003.gguf")
    assert split_source.sha256 == tuple(sha256(p) for p in parts)
    assert resolve_source("hf:org/Tiny-GGUF").sha256 == (sha256(q4),)
    only = hf_store(tmp_path / "hub", "org/Only", {"only-IQ2_M.gguf": q8})
    assert resolve_source("hf:org/Only").location == str(only / "only-IQ2_M.gguf")
    assert member_display_name("hf:org/Tiny-GGUF:q8_0") == "Tiny-GGUF-q8_0"


@pytest.mark.parametrize(
    "case, spec, expected",
    [
        ("missing quant", "hf:org/Tiny:Q5_K_M", r"the cached org/Tiny has no Q5_K_M GGUF \(it has: Q6_K, Q8_0\); name one of those"),
        ("no default", "hf:org/Tiny", r"has 2 GGUF files and none is Q4_K_M \(it has: Q6_K, Q8_0\); name one, e.g. hf:org/Tiny:Q6_K"),
        ("not cached", "hf:org/Absent", r"has no snapshot of org/Absent, and HF_HUB_OFFLINE is set: download it once \(`hf download org/Absent --include '\*Q4_K_M\*'`\)"),
        ("missing part", "hf:org/Split", r"the cached org/Split lacks split-Q8_0-00002-of-00002.gguf of split-Q8_0-00001-of-00002.gguf"),
        ("blob sha256 mismatch", "hf:org/Bad", r"is named by sha256 f{12}\.\.\. but its bytes hash to"),
        ("not a repository", "hf:just-a-name", r"is not a hub GGUF repository: write hf:ORG/REPO\[:QUANT\]"),
    ],
)
def test_bad_hf_names_fail_in_one_line(home: Path, own_cache: Path, tmp_path: Path, case: str, spec: str, expected: str) -> None:
    files = tmp_path / "files"
    a, b = tiny_gguf(files / "a.gguf"), tiny_gguf(files / "b.gguf", tokens=9)
    hf_store(tmp_path / "hub", "org/Tiny", {"tiny-Q8_0.gguf": a, "tiny-Q6_K.gguf": b})
    hf_store(tmp_path / "hub", "org/Split", {"split-Q8_0-00001-of-00002.gguf": a})
    bad = hf_store(tmp_path / "hub", "org/Bad", {"bad-Q4_K_M.gguf": a})
    blobs = tmp_path / "hub" / "models--org--Bad" / "blobs"
    (blobs / sha256(a)).rename(blobs / ("f" * 64))
    (bad / "bad-Q4_K_M.gguf").unlink()
    (bad / "bad-Q4_K_M.gguf").symlink_to(f"../../blobs/{'f' * 64}")
    with pytest.raises(OptionError) as raised:
        resolve_source(spec)
    assert f"member {spec!r}" in _one_line(raised)
    assert raised.match(expected)


def test_hf_download_unreachable_hub_fails_in_one_line(home: Path, own_cache: Path, tmp_path: Path) -> None:
    """With the hub allowed (HF_HUB_OFFLINE unset), a repository the cache lacks is asked of the
    hub through huggingface_hub; a hub that cannot be reached is one line naming the cause."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_HUB_ETAG_TIMEOUT="2", HF_HUB_DOWNLOAD_TIMEOUT="2")
    code = (
        "from lm_eval_safe.members.sources import resolve_source\n"
        "from lm_eval_safe.errors import OptionError\n"
        "try:\n    resolve_source('hf:org/Absent:Q8_0')\n"
        "except OptionError as exc:\n    print('ERROR', exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ERROR member 'hf:org/Absent:Q8_0': org/Absent is not in the"), done
    assert "the hub could not be asked for it" in lines[0]


# -- LM Studio -----------------------------------------------------------------------------------


def test_lmstudio_names_and_folders(home: Path, own_cache: Path, tmp_path: Path) -> None:
    files = tmp_path / "files"
    one, two = tiny_gguf(files / "one.gguf"), tiny_gguf(files / "two.gguf", tokens=4)
    default = home / ".lmstudio" / "models"
    link(one, default / "pub" / "Solo-GGUF" / "solo-Q8_0.gguf")
    link(one, default / "pub" / "Pair-GGUF" / "pair-Q4_K_M.gguf")
    link(two, default / "pub" / "Pair-GGUF" / "pair-Q8_0.gguf")
    assert resolve_source("lmstudio:pub/Solo-GGUF").location == str(default / "pub" / "Solo-GGUF" / "solo-Q8_0.gguf")
    assert resolve_source("lmstudio:pub/Pair-GGUF").sha256 == (sha256(one),)
    assert resolve_source("lmstudio:pub/Pair-GGUF/pair-Q8_0.gguf").sha256 == (sha256(two),)
    assert resolve_source("lmstudio:pub/Pair-GGUF/pair-Q8_0").sha256 == (sha256(two),)
    # a models folder chosen in LM Studio (settings.json's downloadsFolder), under a home that
    # ~/.lmstudio-home-pointer names
    chosen, lm_home = tmp_path / "big-disk" / "models", tmp_path / "lmstudio-home"
    link(two, chosen / "pub" / "Solo-GGUF" / "solo-Q8_0.gguf")
    lm_home.mkdir()
    (lm_home / "settings.json").write_text(json.dumps({"downloadsFolder": str(chosen)}))
    (home / ".lmstudio-home-pointer").write_text(f"{lm_home}\n")
    assert resolve_source("lmstudio:pub/Solo-GGUF").sha256 == (sha256(two),)
    with pytest.raises(OptionError) as raised:
        resolve_source("lmstudio:pub/Pair-GGUF")
    assert raised.match(r"LM Studio's models folder .* has no pub/Pair-GGUF \(it has: pub/Solo-GGUF\); download it in LM Studio first")
    assert "\n" not in str(raised.value)


def test_lmstudio_folder_with_several_files_asks_for_one(home: Path, own_cache: Path, tmp_path: Path) -> None:
    one = tiny_gguf(tmp_path / "files" / "one.gguf")
    folder = home / ".lmstudio" / "models" / "pub" / "Many-GGUF"
    link(one, folder / "many-Q8_0.gguf")
    link(one, folder / "many-Q6_K.gguf")
    with pytest.raises(OptionError, match=r"has 2 GGUF files and none is Q4_K_M \(it has: Q6_K, Q8_0\); name one, e.g. lmstudio:pub/Many-GGUF/many-Q6_K.gguf"):
        resolve_source("lmstudio:pub/Many-GGUF")
    with pytest.raises(OptionError, match=r"has no many-Q4_0.gguf \(it has: many-Q6_K.gguf, many-Q8_0.gguf\)"):
        resolve_source("lmstudio:pub/Many-GGUF/many-Q4_0.gguf")


# -- identity, names, listing ----------------------------------------------------------------------


def test_identity_is_the_files_content(home: Path, own_cache: Path, small: Path, tmp_path: Path) -> None:
    """``--use_cache`` keys a member by its file's sha256: one file under several names is one
    identity (an Ollama blob that is a symbolic link, an LM Studio file linking into the hub
    cache's blobs), and ``latest`` moving to another blob is another."""
    root = home / ".ollama" / "models"
    ollama_store(root, "tiny", small, symbolic=True)
    hf_store(tmp_path / "hub", "org/Tiny", {"tiny-Q4_K_M.gguf": small})
    blob = tmp_path / "hub" / "models--org--Tiny" / "blobs" / sha256(small)
    link(blob, home / ".lmstudio" / "models" / "pub" / "Tiny" / "tiny-Q4_K_M.gguf", symbolic=True)
    identities = {json.dumps(content_identity(resolve_source(s))) for s in ("ollama:tiny", "hf:org/Tiny", "lmstudio:pub/Tiny")}
    assert identities == {json.dumps({"sha256": sha256(small)})}
    newer = tiny_gguf(tmp_path / "files" / "newer.gguf", tokens=11)
    ollama_store(root, "tiny", newer)  # `ollama pull tiny` fetched a new latest
    assert content_identity(resolve_source("ollama:tiny")) == {"sha256": sha256(newer)}
    assert resolve_source("ollama:tiny").describe()["sha256"] == sha256(newer)


def test_display_names_are_file_names() -> None:
    assert [member_display_name(s) for s in (
        "ollama:qwen2.5:1.5b", "ollama:qwen2.5", "ollama:hf.co/bartowski/Foo-GGUF:Q4_K_M",
        "hf:org/Repo-GGUF:Q4_K_M", "hf:org/Repo-GGUF", "lmstudio:pub/Repo/file-Q8_0.gguf", "lmstudio:pub/Repo",
    )] == ["qwen2.5-1.5b", "qwen2.5", "Foo-GGUF-Q4_K_M", "Repo-GGUF-Q4_K_M", "Repo-GGUF", "file-Q8_0", "Repo"]  # fmt: skip


def test_unknown_spec_names_the_store_forms() -> None:
    with pytest.raises(OptionError, match=r"ollama:NAME\[:TAG\], hf:ORG/REPO\[:QUANT\], lmstudio:PUBLISHER/REPO\[/FILE\]"):
        resolve_source("not/a/model")
    with pytest.raises(OptionError, match=r"member 'ollama:' names no model: write ollama:NAME\[:TAG\]"):
        resolve_source("ollama:")


def test_models_lists_every_store(home: Path, own_cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``lm-eval-safe models``: the names to type, sizes and tokenizer families of every store's
    GGUF models, in a table and as JSON."""
    from lm_eval_safe import cli

    files = tmp_path / "files"
    smol, qwen = tiny_gguf(files / "smol.gguf", pre="smollm", tokens=5), tiny_gguf(files / "qwen.gguf", pre="qwen2", tokens=6)
    ollama_store(home / ".ollama" / "models", "smol", smol, tag="135m")
    hf_store(tmp_path / "hub", "org/Qwen-GGUF", {"qwen-Q4_K_M.gguf": qwen, "qwen-Q8_0.gguf": smol, "mmproj-qwen-f16.gguf": smol})
    link(qwen, home / ".lmstudio" / "models" / "pub" / "Qwen-GGUF" / "qwen-Q4_K_M.gguf")
    link(smol, home / ".lmstudio" / "models" / "pub" / "Qwen-GGUF" / "smol-Q8_0.gguf")
    cli.main(["models", "--json"])
    listed = {entry["name"]: entry for entry in json.loads(capsys.readouterr().out)}
    stores = {name: (e["source"], e["size"], e["tokenizer"]) for name, e in listed.items() if e["source"] != "alias"}
    assert stores == {
        "ollama:smol:135m": ("ollama", smol.stat().st_size, "gpt2/smollm 5"),
        "hf:org/Qwen-GGUF:Q4_K_M": ("hub", qwen.stat().st_size, "gpt2/qwen2 6"),
        "hf:org/Qwen-GGUF:Q8_0": ("hub", smol.stat().st_size, "gpt2/smollm 5"),
        "lmstudio:pub/Qwen-GGUF": ("lmstudio", qwen.stat().st_size, "gpt2/qwen2 6"),
        "lmstudio:pub/Qwen-GGUF/smol-Q8_0.gguf": ("lmstudio", smol.stat().st_size, "gpt2/smollm 5"),
    }
    assert {"smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"} <= set(listed)
    assert listed["hf:org/Qwen-GGUF:Q4_K_M"]["quantization"] == "Q4_K_M"
    for name in stores:  # every listed name loads
        assert resolve_source(name).kind == "gguf"
    cli.main(["models"])
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["NAME", "SIZE", "ARCH", "QUANT", "TOKENIZER"]
    assert any(line.startswith("ollama:smol:135m") and line.endswith("gpt2/smollm 5") for line in table)


# -- split files -----------------------------------------------------------------------------------


def test_a_joined_split_holds_the_whole_files_tensors_and_metadata(tmp_path: Path) -> None:
    """A model written in three parts and joined again equals the model written whole: the same
    metadata but the ``split.*`` keys, the same tensors (gguf's own reader reads both)."""
    from gguf import GGUFReader

    whole = tiny_gguf(tmp_path / "whole" / "m-Q4_K_M.gguf")
    first = tiny_gguf(tmp_path / "split" / "m-Q4_K_M.gguf", split=1)
    parts = split_parts(first)
    assert [p.name for p in parts] == [f"m-Q4_K_M-{i:05d}-of-00003.gguf" for i in (1, 2, 3)]
    assert read_header(first).split_count == 3 and quant_tag(first.name) == "Q4_K_M"
    join_split(parts, tmp_path / "joined.gguf")

    def contents(path: Path) -> tuple[dict[str, Any], dict[str, bytes]]:
        reader = GGUFReader(path)
        fields = {k: str(f.contents()) for k, f in reader.fields.items() if not k.startswith(("GGUF.", "split."))}
        return fields, {t.name: t.data.tobytes() for t in reader.tensors}

    assert contents(tmp_path / "joined.gguf") == contents(whole)
