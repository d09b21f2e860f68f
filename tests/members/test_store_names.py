"""Store names stay in their store: a name that could lead out of the store's folder (``..``, an
absolute path, a separator the store's grammar lacks) is refused in one line for every store,
while the links a store makes itself keep working; a store folder that is not there is said to
be missing, in the error and under ``lm-eval-safe models``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from store_builders import hf_store, link, ollama_store, sha256, tiny_gguf

from lm_eval_safe.errors import OptionError
from lm_eval_safe.members.sources import resolve_source


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A home of its own (Ollama's and LM Studio's folders lie in it), a hub cache beside it, a
    cache folder of this package's, the hub offline."""
    folder = tmp_path / "home"
    folder.mkdir()
    monkeypatch.setenv("HOME", str(folder))
    monkeypatch.setenv("LM_EVAL_SAFE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("OLLAMA_MODELS", raising=False)
    for variable in ("HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return folder


@pytest.fixture
def stores(home: Path, tmp_path: Path) -> Path:
    """A model in each store, and the hub's file also where ``..`` from LM Studio's folder leads
    (``home/.lmstudio/models/../../../hub/...``): the escape would otherwise find a real GGUF."""
    small = tiny_gguf(tmp_path / "files" / "small-Q4_K_M.gguf")
    ollama_store(home / ".ollama" / "models", "tiny", small)
    hf_store(tmp_path / "hub", "org/Tiny", {"tiny-Q4_K_M.gguf": small})
    link(small, home / ".lmstudio" / "models" / "pub" / "Tiny" / "tiny-Q4_K_M.gguf")
    return small


ESCAPES = [
    ("lmstudio:../../../hub/models--org--Tiny/snapshots/" + "a" * 40 + "/tiny-Q4_K_M", r"has the part '\.\.', which a store's name cannot have"),
    ("lmstudio:../../../../../../etc/passwd", r"has the part '\.\.'"),
    ("lmstudio:pub/Tiny/../../../../../hub/models--org--Tiny/snapshots/" + "a" * 40 + "/tiny-Q4_K_M", r"has the part '\.\.'"),
    ("lmstudio:/etc/passwd", r"has an empty part \(a leading or doubled /\)"),
    ("lmstudio:pub//Tiny", r"has an empty part"),
    ("lmstudio:pub/Tiny/..\\..\\x", r"has the part '\.\.\\\\\.\.\\\\x'"),
    ("lmstudio:pub/./Tiny", r"has the part '\.'"),
    ("ollama:../../../etc/passwd", r"is not an Ollama name \(letters, digits, '_', '-' and '\.' in each part, no spaces\)"),
    ("ollama:/tiny", r"is not an Ollama name"),
    ("ollama:my model", r"is not an Ollama name .*no spaces"),
    ("ollama:tiny:../../x", r"is not an Ollama name"),
    ("ollama:a/b/c/tiny", r"is not an Ollama name"),
    ("hf:../Tiny", r"is not a hub GGUF repository"),
    ("hf:/etc/passwd", r"is not a hub GGUF repository"),
    ("hf:org/Tiny/../../x", r"is not a hub GGUF repository"),
    ("hf:org/Tiny:../../../x", r"'\.\./\.\./\.\./x' is not a quantization"),
    ("hf:org/my model", r"is not a hub GGUF repository"),
]


@pytest.mark.parametrize(("spec", "expected"), ESCAPES)
def test_names_that_leave_their_store_are_refused(stores: Path, spec: str, expected: str) -> None:
    with pytest.raises(OptionError) as raised:
        resolve_source(spec)
    message = str(raised.value)
    assert "\n" not in message and message.startswith(f"member {spec!r}")
    assert raised.match(expected)


def test_the_stores_own_names_and_links_still_resolve(stores: Path, home: Path) -> None:
    """The same stores answer their plain names: Ollama's blob, the hub snapshot's file linking to
    its blob, an LM Studio file that is a symbolic link into the hub cache."""
    digest = sha256(stores)
    (home / ".lmstudio" / "models" / "pub" / "Linked").mkdir(parents=True)
    hub_file = home.parent / "hub" / "models--org--Tiny" / "snapshots" / ("a" * 40) / "tiny-Q4_K_M.gguf"
    (home / ".lmstudio" / "models" / "pub" / "Linked" / "tiny-Q4_K_M.gguf").symlink_to(hub_file)
    for spec in ("ollama:tiny", "hf:org/Tiny", "hf:org/Tiny:Q4_K_M", "lmstudio:pub/Tiny", "lmstudio:pub/Tiny/tiny-Q4_K_M", "lmstudio:pub/Linked/"):
        assert resolve_source(spec).sha256 == (digest,), spec


def test_an_ollama_manifest_cannot_name_a_blob_outside_the_store(stores: Path, home: Path) -> None:
    manifest = home / ".ollama" / "models" / "manifests" / "registry.ollama.ai" / "library" / "tiny" / "latest"
    body = json.loads(manifest.read_text())
    body["layers"][0]["digest"] = "sha256:" + ("../" * 10 + "etc/passwd").ljust(64, "x")
    manifest.write_text(json.dumps(body))
    with pytest.raises(OptionError, match=r"names no sha256 blob; pull the model again"):
        resolve_source("ollama:tiny")


def test_missing_store_folders_are_said_to_be_missing(home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lmstudio = home / ".lmstudio" / "models"
    with pytest.raises(OptionError, match=rf"LM Studio's models folder {lmstudio} does not exist: download the model in LM Studio"):
        resolve_source("lmstudio:pub/Tiny")
    with pytest.raises(OptionError, match=rf"the Hugging Face cache {tmp_path / 'hub'} does not exist, and HF_HUB_OFFLINE is set"):
        resolve_source("hf:org/Tiny")
    monkeypatch.setenv("OLLAMA_MODELS", "/nonexistent")
    with pytest.raises(OptionError) as raised:
        resolve_source("ollama:smollm2:135m")
    assert str(raised.value) == (
        "member 'ollama:smollm2:135m': OLLAMA_MODELS names /nonexistent, which does not exist: set it "
        "to the folder Ollama keeps its models in (or unset it)"
    )


def test_models_says_which_folders_are_missing(home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lm_eval_safe import cli

    (home / ".ollama" / "models").mkdir(parents=True)
    cli.main(["models"])
    looked = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("looked in:"))
    assert looked == (
        f"looked in: Ollama {home / '.ollama' / 'models'}, Hugging Face cache {tmp_path / 'hub'} (missing), "
        f"LM Studio {home / '.lmstudio' / 'models'} (missing)"
    )


def test_a_path_is_checked_by_its_names_not_its_links(tmp_path: Path) -> None:
    """The last guard behind each store's grammar: a path whose ``..`` leads out of the folder is
    refused; a link inside the folder pointing elsewhere is the store's own and passes."""
    from lm_eval_safe.members.stores.files import inside_store

    root = tmp_path / "store"
    (root / "pub").mkdir(parents=True)
    (root / "pub" / "linked.gguf").symlink_to(tmp_path / "elsewhere.gguf")
    assert inside_store("lmstudio:pub/linked", root, root / "pub" / "linked.gguf") == root / "pub" / "linked.gguf"
    with pytest.raises(OptionError, match=rf"member 'x' leads out of its store's folder {root}: name a model inside it"):
        inside_store("x", root, root / "pub" / ".." / ".." / "elsewhere.gguf")
    with pytest.raises(OptionError, match="leads out of its store's folder"):
        inside_store("x", root, tmp_path / "store-sibling" / "a.gguf")
