"""In-process tiny causal LMs for the unit tests (their tokenizers: :mod:`tiny_tokenizers`).

Why this module exists: the backend under test has to behave correctly with the two
tokenizer families that real evaluation models use -- GPT-2 style byte-level BPE
(SmolLM2, Qwen) and SentencePiece-style BPE with byte fallback (Llama-2, Gemma) -- and
with models whose embedding matrix is larger than the tokenizer (Qwen). Downloading real
models is impossible in CI (no network) and slow, so everything here is trained / built
from scratch in a couple of seconds on CPU, deterministically, from a corpus generated in
code. Nothing here imports pytest, so benchmarks and scripts can reuse the helpers.

The tokenizers are real ``tokenizers`` pipelines (same component types as the published
``tokenizer.json`` files of those model families), so the edge cases that matter for
log-likelihood scoring -- leading-space handling, BOS insertion, byte fallback for
unseen characters, multi-byte characters split across tokens -- all occur for real.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import torch
from tiny_tokenizers import (
    BPE_CHAT_TEMPLATE,
    DEFAULT_CORPUS,
    SP_CHAT_TEMPLATE,
    build_default_corpus,
    train_byte_bpe_tokenizer,
    train_sentencepiece_style_tokenizer,
)
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

__all__ = [
    "BPE_CHAT_TEMPLATE",
    "DEFAULT_CORPUS",
    "SP_CHAT_TEMPLATE",
    "build_default_corpus",
    "make_tiny_causal_lm",
    "make_tiny_gemma3",
    "perturbed_copy",
    "save_member",
    "train_byte_bpe_tokenizer",
    "train_sentencepiece_style_tokenizer",
]

# --------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------


def make_tiny_causal_lm(
    tokenizer: PreTrainedTokenizerFast,
    seed: int,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    vocab_pad: int = 0,
) -> LlamaForCausalLM:
    """Build a randomly initialised float32 Llama model sized for ``tokenizer``.

    Why Llama: it is the architecture every family under test (SmolLM2, Qwen-like, Gemma-
    like) reduces to for the backend's purposes, and it loads with ``AutoModelForCausalLM``.
    ``vocab_pad`` extra embedding rows mimic Qwen, whose ``lm_head`` is wider than the
    tokenizer -- the backend must never sample/score ids it cannot decode.
    ``initializer_range=0.2`` (10x default) plus an lm_head whose row norms vary widely
    makes the next-token distributions peaky at some positions and flat at others, so
    greedy decoding does not collapse into one repeated id and logprob/greedy-match
    checks are not trivially equal everywhere.
    """
    special_ids = _special_ids(tokenizer)
    config = LlamaConfig(
        vocab_size=len(tokenizer) + vocab_pad,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=max(1, num_heads // 2),
        max_position_embeddings=512,
        initializer_range=0.2,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        dtype="float32",
        **special_ids,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    gen = torch.Generator().manual_seed(seed + 10_007)
    with torch.no_grad():
        head = model.lm_head.weight
        # Log-normal row scales: a few tokens get large logits (peaky), most stay flat.
        scales = torch.exp(torch.randn(head.shape[0], 1, generator=gen) * 0.8)
        head.mul_(scales * 0.6)
    model.eval()
    model.generation_config.pad_token_id = special_ids["pad_token_id"]
    model.generation_config.bos_token_id = special_ids["bos_token_id"]
    model.generation_config.eos_token_id = special_ids["eos_token_id"]
    return model


def make_tiny_gemma3(
    tokenizer: PreTrainedTokenizerFast, seed: int, sliding_window: int = 8, head_dim: int = 16
) -> PreTrainedModel:
    """A tiny Gemma-3 text model: sliding-window and full-attention layers, soft-capped logits.

    Why: the real Gemma-3 member alternates local (sliding) and global layers; batched decoding
    must apply the window from real positions, not cache slots. A window of 8 tokens is shorter
    than every test prompt, so a wrong window changes the logits at once.
    """
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    special_ids = _special_ids(tokenizer)
    config = Gemma3TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        sliding_window=sliding_window,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        max_position_embeddings=512,
        final_logit_softcapping=30.0,
        initializer_range=0.2,
        dtype="float32",
        **special_ids,
    )
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(config).to(torch.float32).eval()
    model.generation_config.pad_token_id = special_ids["pad_token_id"]
    model.generation_config.bos_token_id = special_ids["bos_token_id"]
    model.generation_config.eos_token_id = special_ids["eos_token_id"]
    return model


def _special_ids(tokenizer: PreTrainedTokenizerFast) -> dict[str, int | None]:
    """Return bos/eos/pad ids so config and generation_config agree with the tokenizer."""
    return {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def perturbed_copy(model: LlamaForCausalLM, seed: int, scale: float = 0.05) -> LlamaForCausalLM:
    """Return a deep copy with gaussian noise added to every parameter.

    Why: tests of ensembles / model comparison need a *different* model that shares the
    tokenizer and is close to the original. Noise is relative (``scale`` times each
    tensor's RMS), so norm weights (all ones) and small projections are disturbed alike.
    """
    clone = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in clone.parameters():
            rms = param.detach().pow(2).mean().sqrt().clamp_min(1e-6)
            param.add_(torch.randn(param.shape, generator=gen, dtype=param.dtype) * (scale * rms))
    clone.eval()
    return clone


def save_member(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, folder: str | os.PathLike[str]
) -> Path:
    """Save model + tokenizer so ``Auto*.from_pretrained(folder)`` works offline.

    Why one folder: that is the layout a real checkpoint has, so the backend's loading
    code is exercised exactly as with a downloaded model (config.json, safetensors,
    generation_config.json, tokenizer.json, tokenizer_config.json, chat template).
    """
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
