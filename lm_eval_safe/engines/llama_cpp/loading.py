"""Loading a member on llama.cpp: the GGUF file as it is (no conversion, no de-quantized copy),
its tokenizer, config and stop ids read by transformers from the same file (the ids the other
engines use) and kept in the cache."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lm_eval_safe.disk_cache import cache_root, cached_folder
from lm_eval_safe.engines.llama_cpp.binding import require_llama_cpp
from lm_eval_safe.engines.llama_cpp.memory import check_kv_fits
from lm_eval_safe.engines.llama_cpp.options import DEFAULTS, threads
from lm_eval_safe.errors import OptionError

#: Part of every text-side folder name; bump when what the folder holds changes
TEXT_FORMAT = 1


def text_folder(path: Path, root: Path, sha256: tuple[str, ...] = ()) -> Path:
    """One folder per GGUF content (its sha256, so one file under several names, alias, path
    or store's, shares it; without one: its path, size and time of change) and transformers version:
    the tokenizer and config files are written by the installed transformers, and another
    release may read them differently."""
    import hashlib

    import transformers

    if sha256:
        identity = f"sha256={','.join(sha256)}|format={TEXT_FORMAT}"
        stem = f"sha256-{sha256[0][:16]}"
    else:
        stat = path.stat()
        identity = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|format={TEXT_FORMAT}"
        stem = path.stem
    identity += f"|transformers={transformers.__version__}"
    return root / "gguf-text" / f"{stem}-{hashlib.sha1(identity.encode()).hexdigest()[:12]}"


def text_side(
    path: Path, trust_remote_code: bool, root: Path, sha256: tuple[str, ...] = ()
) -> tuple[Any, Any, Any]:
    """Tokenizer, config and generation config of a GGUF file, as the transformers engine has
    them: read by transformers from the file once, saved under ``root`` and loaded from there
    after. Reading them from the GGUF takes 5 to 30 s per member (transformers parses every
    metadata field in Python, Gemma-3's 262k-token vocabulary included), far longer than
    llama.cpp takes to load the weights; the saved files load in under a second."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    def save(tmp: Path) -> None:
        try:
            tokenizer = AutoTokenizer.from_pretrained(
                str(path.parent), gguf_file=path.name, trust_remote_code=trust_remote_code
            )
            config = AutoConfig.from_pretrained(
                str(path.parent), gguf_file=path.name, trust_remote_code=trust_remote_code
            )
        except (ValueError, OSError, KeyError) as exc:
            first = (str(exc).splitlines() or [type(exc).__name__])[0]
            raise OptionError(
                f"transformers could not read the tokenizer of {path} ({first})"
            ) from exc
        tokenizer.save_pretrained(tmp)
        config.save_pretrained(tmp)

    folder = text_folder(path, root, sha256)
    cached_folder(folder, save, f"tokenizer and config of {path.name}")
    tokenizer = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
    config = AutoConfig.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
    return tokenizer, config, GenerationConfig.from_model_config(config)


def load_gguf(
    load: Any,
    *,
    n_threads: int = DEFAULTS["n_threads"],
    n_ctx: int = DEFAULTS["n_ctx"],
    n_batch: int = DEFAULTS["n_batch"],
    n_seq_max: int = DEFAULTS["n_seq_max"],
    n_gpu_layers: int = DEFAULTS["n_gpu_layers"],
    flash_attn: str = DEFAULTS["flash_attn"],
    use_extra_bufts: bool = DEFAULTS["use_extra_bufts"],
    batch_rows: bool = DEFAULTS["batch_rows"],
) -> Any:
    """One GGUF member on llama.cpp (``load``: its :class:`~lm_eval_safe.engines.spec.
    MemberLoad`). ``max_length`` (None: the config's) is capped at ``n_ctx`` (a row's sequence
    must fit its sequence's cells)."""
    require_llama_cpp()
    import torch

    from lm_eval_safe.engines.llama_cpp.engine import LlamaCppEngine
    from lm_eval_safe.engines.llama_cpp.native import ContextSettings, Model
    from lm_eval_safe.engines.spec import LoadedMember
    from lm_eval_safe.members.member import config_max_length

    source = load.source
    path = Path(source.location)  # a GGUF file (the spec's check_source)
    check_kv_fits(str(path), n_ctx, n_seq_max, n_gpu_layers)  # before the tokenizer's 5-30 s
    tokenizer, config, generation_config = text_side(
        path, load.trust_remote_code, cache_root(load.cache_dir), source.sha256
    )
    settings = ContextSettings(n_ctx, n_batch, n_seq_max, threads(n_threads), flash_attn, use_extra_bufts)
    model = Model(str(path), n_gpu_layers, settings)
    shown = {
        "n_threads": settings.n_threads,
        "n_ctx": model.n_ctx,
        "n_batch": model.n_batch,
        "n_seq_max": n_seq_max,
        "n_gpu_layers": n_gpu_layers,
        "flash_attn": flash_attn,
        "use_extra_bufts": use_extra_bufts,
        "batch_rows": batch_rows,
    }
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return LoadedMember(
        tokenizer=tokenizer,
        config=config,
        generation_config=generation_config,
        engine=LlamaCppEngine(model, batch_rows, shown),
        device="cpu",
        dtype=torch.float32,  # what rows are computed in (the file keeps its own types)
        max_length=min(config_max_length(config, tokenizer, load.max_length), model.n_ctx),
    )
