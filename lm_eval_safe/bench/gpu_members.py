"""Members of ``scripts/check_gpu.sh``: real architectures with random or perturbed weights,
built in the process that measures them, with real tokenizers read from a folder.

Why members are built rather than loaded: the GPU machine the check runs on reaches no hub and
takes 64 MiB from this machine per call, while the members worth measuring there weigh
gigabytes (a drafter of Llama-3-8B's shape, a verifier of SmolLM2-1.7B's). Their architectures,
vocabularies and tokenizers are real; their weights are drawn on the device in a second. What
random weights cannot give, agreement between members, is made by perturbing one model
slightly (members of one family) or by favouring a few shared words (members with different
tokenizers, for Theorem 1's consensus skips).

Shapes come in two scales: ``gpu`` (the sizes the figures are about) and ``dry`` (the same
architectures a few layers and a few dozen dimensions wide, for ``--dry-run`` on a CPU).

Tokenizers: a folder with two tokenizer folders, ``a`` (the drafters': Qwen2.5's, 151,936 ids,
near Llama-3's 128,256) and ``b`` (SmolLM2's, 49,152 ids); ``scripts/prepare_gpu_check.sh``
writes them from the GGUF members, the test from the tiny tokenizers of ``tests/``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lm_eval_safe.engines import engine, instruments
from lm_eval_safe.engines.registry import DEFAULT_ENGINE
from lm_eval_safe.members.member import Member

logger = logging.getLogger("check_gpu")

#: the two tokenizer folders of ``--tokenizers``
TOKENIZER_ROLES = ("a", "b")


@dataclass(frozen=True)
class Shape:
    """A Llama-architecture shape; the vocabulary is the tokenizer's."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int

    def config(self, vocab_size: int, special_ids: dict[str, int | None]) -> Any:
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            max_position_embeddings=4096,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            tie_word_embeddings=False,
            **special_ids,
        )


#: role -> scale -> shape. parity: Llama-3.2-1B's body (1.2B with SmolLM2's vocabulary);
#: speed_drafter: Llama-3-8B's (8.2B with Qwen2.5's); speed_verifier: SmolLM2-1.7B's.
SHAPES: dict[str, dict[str, Shape]] = {
    "parity": {"gpu": Shape(2048, 8192, 16, 32, 8), "dry": Shape(64, 128, 2, 4, 2)},
    "theorem1": {"gpu": Shape(1024, 4096, 8, 16, 8), "dry": Shape(64, 128, 2, 4, 2)},
    "speed_drafter": {"gpu": Shape(4096, 14336, 32, 32, 8), "dry": Shape(128, 256, 2, 4, 2)},
    "speed_verifier": {"gpu": Shape(2048, 8192, 24, 32, 32), "dry": Shape(64, 128, 2, 4, 2)},
    "lm_eval": {"gpu": Shape(512, 1536, 4, 8, 4), "dry": Shape(64, 128, 2, 4, 2)},
}


def load_tokenizers(folder: Path) -> dict[str, Any]:
    """The tokenizers ``a`` and ``b`` of ``folder``; a missing one is a one-line error."""
    from transformers import AutoTokenizer

    tokenizers = {}
    for role in TOKENIZER_ROLES:
        path = folder / role
        if not (path / "tokenizer_config.json").is_file():
            raise SystemExit(
                f"no tokenizer in {path}: run scripts/prepare_gpu_check.sh, or pass --tokenizers "
                "a folder holding tokenizer folders a/ and b/"
            )
        tokenizer = AutoTokenizer.from_pretrained(path)
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        tokenizers[role] = tokenizer
    return tokenizers


def _special_ids(tokenizer: Any) -> dict[str, int | None]:
    return {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def parameter_count(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())


def build_model(tokenizer: Any, shape: Shape, seed: int, device: str, dtype: torch.dtype) -> Any:
    """A randomly initialised Llama model for ``tokenizer``, drawn on ``device`` in ``dtype``.

    The output layer's rows get log-normal scales (as the tests' tiny models): a few ids get
    large logits and most stay flat, so greedy decoding neither collapses into one repeated id
    nor decides every position by a hair, which is closer to a trained model's peaky rows."""
    from transformers import AutoModelForCausalLM

    config = shape.config(len(tokenizer), _special_ids(tokenizer))
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    generator = torch.Generator(device=device).manual_seed(seed + 10_007)
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        scales = torch.randn(head.shape[0], 1, generator=generator, device=device, dtype=torch.float32)
        head.mul_(torch.exp(scales * 0.8).to(head.dtype))
    model.eval()
    generation = model.generation_config
    generation.bos_token_id, generation.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    generation.pad_token_id = tokenizer.pad_token_id
    logger.info("built %s: %.2fB parameters, %s on %s", shape, parameter_count(model) / 1e9, dtype, device)
    return model


def perturb(model: Any, scale: float, seed: int) -> None:
    """Add gaussian noise of ``scale`` times each tensor's RMS to every parameter, in place:
    a member of the same family as the original (it agrees at most positions)."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            rms = param.float().pow(2).mean().sqrt().clamp_min(1e-6)
            noise = torch.randn(param.shape, generator=generator, device=device, dtype=torch.float32)
            param.add_((noise * (scale * rms)).to(param.dtype))


def perturbed_copy(model: Any, scale: float, seed: int) -> Any:
    """A copy of ``model`` whose output layer has :func:`perturb`'s noise (on the model's
    device). Only the output layer: noise on every weight of a deep random model is amplified
    layer by layer (1% on all of an 8B model's weights left its twin disagreeing at 85% of
    positions), while noise on the last layer alone moves each logit by about ``scale`` of its
    spread, so the twins disagree where the drafter's choice was close: as members of one family
    do."""
    import copy

    clone = copy.deepcopy(model)
    perturb(clone.get_output_embeddings(), scale, seed)
    return clone.eval()


def as_member(model: Any, tokenizer: Any, name: str, index: int = 0) -> Member:
    """A member over an in-memory transformers model, built by the default engine's instruments
    (the engine that runs transformers models in this process), as its loader builds one from a
    folder."""
    return engine(DEFAULT_ENGINE).instruments().as_member(model, tokenizer, name, index)


def word_ids(member: Member, words: list[str]) -> dict[str, int]:
    """The id of each word that ``member``'s tokenizer spells as one token with its leading
    space (``" the"``, whatever the tokenizer writes the space as)."""
    lookup = member.vocab.lookup
    return {w: lookup[key] for w in words if (key := (" " + w).encode("utf-8")) in lookup}


def favour_ids(member: Member, ids: list[int], bonus: float) -> None:
    """Add ``bonus`` to the logits of ``ids`` in ``member``'s output layer (every path to the
    logits goes through it): members with different tokenizers then often pick the same word
    and sometimes not, so SAFE has consensus positions to skip and others to ensemble."""
    instruments(member).favour_ids(member, ids, bonus)


def logit_bonus(member: Member, ids: list[int], prompt: str, share: float = 0.9) -> float:
    """The bonus that makes a favoured id the argmax at about ``share`` of the positions of
    ``prompt``: that quantile of the gaps between each position's largest logit and its largest
    favoured one. Random members write byte salad that two tokenizers rarely split at the same
    places; text made mostly of whole words gives Theorem 1 aligned positions to decide."""
    logits = instruments(member).prompt_logits(member, member.encode(prompt))
    gaps = logits.max(-1).values - logits[:, ids].max(-1).values
    return float(torch.quantile(gaps, share))
