"""Shared pytest fixtures: tiny in-process models, the shared/ folder, real GGUF models.

Why session-scoped folders: the backend loads models by path (like a user would), so
fixtures hand out checkpoint folders rather than objects. Building them takes well under
a second, but doing it once per session keeps the suite fast and guarantees every test
sees the same weights. Tests must treat the folders as read-only.
"""

from __future__ import annotations

import os

# Must happen before transformers / huggingface_hub / datasets are imported anywhere:
# they read these at import time. Nothing in the test suite may touch the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING, Any  # noqa: E402

import pytest  # noqa: E402

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    Parts = tuple[PreTrainedTokenizerFast, LlamaForCausalLM]

_TESTS_DIR = Path(__file__).resolve().parent
# Make `import tiny_models` work whether or not tests/ becomes a package later.
if str(_TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(_TESTS_DIR))

from tiny_models import (  # noqa: E402
    make_tiny_causal_lm,
    make_tiny_gemma3,
    perturbed_copy,
    save_member,
    train_byte_bpe_tokenizer,
    train_sentencepiece_style_tokenizer,
)

TINY_BPE_SEED = 0
TINY_BPE_PERTURB_SEED = 100
TINY_SP_SEED = 1
TINY_BPE_PADDED_SEED = 2
TINY_GEMMA_SEED = 3
TINY_VOCAB_PAD = 37  # Qwen-like: embedding rows beyond len(tokenizer)
# vLLM's CPU attention kernels need a head size of at least 32 (the tiny models above use 16)
VLLM_HIDDEN, VLLM_HEADS = 128, 4


# --------------------------------------------------------------------------------------
# Tiny in-process models
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def _tiny_bpe_parts() -> Parts:
    """(tokenizer, model) of the BPE family, in memory, for tests that compare against a reload."""
    tok = train_byte_bpe_tokenizer()
    return tok, make_tiny_causal_lm(tok, seed=TINY_BPE_SEED)


@pytest.fixture(scope="session")
def _tiny_sp_parts() -> Parts:
    """(tokenizer, model) of the SentencePiece-style family, in memory."""
    tok = train_sentencepiece_style_tokenizer()
    return tok, make_tiny_causal_lm(tok, seed=TINY_SP_SEED)


@pytest.fixture(scope="session")
def tiny_bpe_dir(tmp_path_factory: pytest.TempPathFactory, _tiny_bpe_parts: Parts) -> Path:
    """Folder with a byte-level BPE tokenizer (GPT-2/SmolLM2/Qwen style) + tiny Llama, seed 0."""
    tok, model = _tiny_bpe_parts
    return save_member(model, tok, tmp_path_factory.mktemp("tiny_bpe"))


@pytest.fixture(scope="session")
def tiny_bpe_perturbed_dir(
    tmp_path_factory: pytest.TempPathFactory, _tiny_bpe_parts: Parts
) -> Path:
    """Same tokenizer as `tiny_bpe_dir`, weights = that model plus 5% relative gaussian noise."""
    tok, model = _tiny_bpe_parts
    return save_member(
        perturbed_copy(model, seed=TINY_BPE_PERTURB_SEED),
        tok,
        tmp_path_factory.mktemp("tiny_bpe_pert"),
    )


@pytest.fixture(scope="session")
def tiny_sp_dir(tmp_path_factory: pytest.TempPathFactory, _tiny_sp_parts: Parts) -> Path:
    """Folder with a SentencePiece-style tokenizer (Llama-2/Gemma style, adds BOS) + tiny Llama, seed 1."""
    tok, model = _tiny_sp_parts
    return save_member(model, tok, tmp_path_factory.mktemp("tiny_sp"))


@pytest.fixture(scope="session")
def _tiny_bpe_padded_model(_tiny_bpe_parts: Parts) -> LlamaForCausalLM:
    """In-memory BPE-family model whose vocab is padded by 37 rows beyond the tokenizer."""
    tok, _ = _tiny_bpe_parts
    return make_tiny_causal_lm(tok, seed=TINY_BPE_PADDED_SEED, vocab_pad=TINY_VOCAB_PAD)


@pytest.fixture(scope="session")
def tiny_bpe_padded_dir(
    tmp_path_factory: pytest.TempPathFactory,
    _tiny_bpe_parts: Parts,
    _tiny_bpe_padded_model: LlamaForCausalLM,
) -> Path:
    """BPE tokenizer + model with `vocab_size = len(tokenizer) + 37` (mimics Qwen's padded embeddings)."""
    tok, _ = _tiny_bpe_parts
    return save_member(_tiny_bpe_padded_model, tok, tmp_path_factory.mktemp("tiny_bpe_padded"))


@pytest.fixture(scope="session")
def tiny_gemma_dir(tmp_path_factory: pytest.TempPathFactory, _tiny_sp_parts: Parts) -> Path:
    """SentencePiece-style tokenizer + tiny Gemma-3 (sliding window 8, soft-capped logits)."""
    tok, _ = _tiny_sp_parts
    return save_member(make_tiny_gemma3(tok, seed=TINY_GEMMA_SEED), tok, tmp_path_factory.mktemp("tiny_gemma"))


@pytest.fixture(scope="session")
def vllm_installed() -> None:
    """Skip a test that needs vLLM where it is not installed (CI's vLLM environment sets
    ``LM_EVAL_SAFE_REQUIRE_VLLM=1``: there a missing vLLM is a failure, not a skip)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("LM_EVAL_SAFE_REQUIRE_VLLM") == "1":
            pytest.fail("LM_EVAL_SAFE_REQUIRE_VLLM=1 but vllm is not installed")
        pytest.skip("vLLM is not installed (bash scripts/setup.sh --vllm)")


@pytest.fixture(scope="session")
def tiny_bpe_vllm_dir(tmp_path_factory: pytest.TempPathFactory, _tiny_bpe_parts: Parts) -> Path:
    """BPE tokenizer + tiny Llama with head size 32, which vLLM's CPU kernels run."""
    tok, _ = _tiny_bpe_parts
    model = make_tiny_causal_lm(tok, seed=TINY_BPE_SEED, hidden_size=VLLM_HIDDEN, num_heads=VLLM_HEADS)
    return save_member(model, tok, tmp_path_factory.mktemp("tiny_bpe_vllm"))


@pytest.fixture(scope="session")
def tiny_sp_vllm_dir(tmp_path_factory: pytest.TempPathFactory, _tiny_sp_parts: Parts) -> Path:
    """SentencePiece-style tokenizer + tiny Llama with head size 32."""
    tok, _ = _tiny_sp_parts
    model = make_tiny_causal_lm(tok, seed=TINY_SP_SEED, hidden_size=VLLM_HIDDEN, num_heads=VLLM_HEADS)
    return save_member(model, tok, tmp_path_factory.mktemp("tiny_sp_vllm"))


@pytest.fixture(scope="session")
def tiny_gemma_vllm_dir(tmp_path_factory: pytest.TempPathFactory, _tiny_sp_parts: Parts) -> Path:
    """SentencePiece-style tokenizer + tiny Gemma-3 (sliding window, soft-capped logits) with
    head size 32."""
    tok, _ = _tiny_sp_parts
    model = make_tiny_gemma3(tok, seed=TINY_GEMMA_SEED, head_dim=32)
    return save_member(model, tok, tmp_path_factory.mktemp("tiny_gemma_vllm"))


# --------------------------------------------------------------------------------------
# shared/ (data, model fetch script) and real models
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """The shared/ folder that CI places beside the repository (``../shared``).

    ``LM_EVAL_SAFE_SHARED`` overrides it; a ``shared/`` inside the repository is used
    when ``../shared`` is missing (some runners copy it in). The returned path may not
    exist -- fixtures that need it skip with a reason.
    """
    override = os.environ.get("LM_EVAL_SAFE_SHARED")
    if override:
        return Path(override).resolve()
    beside = Path(__file__).resolve().parents[2] / "shared"
    inside = Path(__file__).resolve().parents[1] / "shared"
    if not beside.is_dir() and inside.is_dir():
        return inside
    return beside


@pytest.fixture(scope="session")
def real_models_dir(shared_dir: Path) -> Path:
    """Folder holding the three real GGUF models, fetched once per session by fetch.sh.

    Skips only when shared/ (and so the fetch script) is absent. A failing fetch is a
    test *error*, not a skip: silently skipping would hide a broken model setup.
    Destination: ``$LM_EVAL_SAFE_MODELS`` or ``~/.cache/lm-eval-safe/models``; files already
    present and checksum-verified are reused, so only the first run downloads.
    """
    script = shared_dir / "models" / "fetch.sh"
    if not shared_dir.is_dir():
        pytest.skip(
            f"real models need {shared_dir} (shared/ beside the repo with models/fetch.sh); it is absent"
        )
    if not script.is_file():
        pytest.fail(f"{shared_dir} exists but {script} is missing")
    dest = Path(
        os.environ.get("LM_EVAL_SAFE_MODELS") or Path.home() / ".cache" / "lm-eval-safe" / "models"
    )
    env = dict(os.environ, PYTHON=sys.executable, LM_EVAL_SAFE_MODELS=str(dest))
    proc = subprocess.run(
        ["bash", str(script), str(dest)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        pytest.fail(
            f"{script} failed (exit {proc.returncode}); stderr tail:\n{proc.stderr[-2000:]}\nstdout tail:\n{proc.stdout[-1000:]}"
        )
    lines = proc.stdout.strip().splitlines()
    folder = Path(lines[-1]) if lines else dest
    if not folder.is_dir():
        pytest.fail(f"{script} reported {folder!s}, which is not a folder")
    return folder


@pytest.fixture(scope="module")
def models(real_models_dir: Path) -> Path:
    """The real members' aliases resolve to the fetched GGUF files (``LM_EVAL_SAFE_MODELS``)."""
    os.environ["LM_EVAL_SAFE_MODELS"] = str(real_models_dir)
    return real_models_dir


# --------------------------------------------------------------------------------------
# Tokenizers and their vocabularies (tests/vocab_cases.py names them)
# --------------------------------------------------------------------------------------


Loaded = dict[str, tuple[Any, Any]]  # name -> (tokenizer, TokenVocabulary)


@pytest.fixture(scope="session")
def tiny_loaded(tiny_bpe_dir: Path, tiny_sp_dir: Path) -> Loaded:
    """The two tiny tokenizers, loaded by path like the backend loads them."""
    from transformers import AutoTokenizer

    from lm_eval_safe.members.vocabulary import TokenVocabulary

    out: Loaded = {}
    for name, folder in (("tiny_bpe", tiny_bpe_dir), ("tiny_sp", tiny_sp_dir)):
        tok = AutoTokenizer.from_pretrained(folder)
        out[name] = (tok, TokenVocabulary.for_tokenizer(tok))
    return out


def _real_tokenizer(alias: str, models_dir: Path) -> Any:
    """The alias's tokenizer, without loading weights.

    Why not ``load_member``: it would de-quantize (and cache) a whole model just for its
    tokenizer. The converted folder ``load_member`` leaves in the cache holds the very
    tokenizer that the backend uses and loads in a second or two; when it is absent (Qwen is
    often not converted yet) the GGUF file is read directly, which gives the same tokenizer.
    """
    from transformers import AutoTokenizer

    from lm_eval_safe.disk_cache import cache_root
    from lm_eval_safe.members.aliases import ALIASES

    gguf = ALIASES[alias].file
    # converted folders are named by the file's sha256 (whichever name reached it)
    for folder in sorted((cache_root() / "converted").glob(f"sha256-{ALIASES[alias].sha256[:16]}-*")):
        if (folder / "complete.json").is_file() and (folder / "tokenizer.json").is_file():
            return AutoTokenizer.from_pretrained(folder)
    return AutoTokenizer.from_pretrained(models_dir, gguf_file=gguf)


@pytest.fixture(scope="session")
def real_loaded(real_models_dir: Path) -> Loaded:
    """The three real tokenizers (SmolLM2 byte BPE, Gemma 3 SentencePiece, Qwen byte BPE)."""
    import time

    from lm_eval_safe.members.vocabulary import TokenVocabulary

    out: Loaded = {}
    for alias in ("smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"):
        start = time.perf_counter()
        tok = _real_tokenizer(alias, real_models_dir)
        out[alias] = (tok, TokenVocabulary.for_tokenizer(tok))
        print(f"{alias}: tokenizer + vocabulary in {time.perf_counter() - start:.1f}s")
    return out


@pytest.fixture(scope="session")
def llama_cpp_installed() -> None:
    """Skips without llama-cpp-python, unless ``LM_EVAL_SAFE_REQUIRE_LLAMA_CPP=1`` (CI), where its
    absence fails."""
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        if os.environ.get("LM_EVAL_SAFE_REQUIRE_LLAMA_CPP", "0") == "1":
            pytest.fail("LM_EVAL_SAFE_REQUIRE_LLAMA_CPP=1 but llama-cpp-python is not installed")
        pytest.skip("llama-cpp-python is not installed (bash scripts/setup.sh --llama-cpp)")
