"""An engine that lives in the test tree, added through the registry's public call: the proof
that a third engine is one folder (here one module) and touches no package file.

It shares no code with the transformers engine: its forward is written here from the tiny
Llama models' weights (embeddings, RMS norms, rotary attention with grouped key/value heads,
the gated MLP, the output layer), with no KV cache (every call computes its row's whole
sequence again), and its own batches, drafting and scoring. So its greedy texts equal
transformers' ``generate`` and the transformers engine's only if both are right. Nothing in
``lm_eval_safe/`` knows :data:`NAME`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from lm_eval_safe.engines.base import (
    Complete,
    Draft,
    Drafted,
    EngineBatch,
    Forward,
    MemberEngine,
    Progress,
    ScorePairs,
    TokenScores,
)
from lm_eval_safe.engines.spec import EngineSpec, LoadedMember, MemberLoad
from lm_eval_safe.errors import OptionError

NAME = "third"


def _rms_norm(x: torch.Tensor, norm: Any, eps: float) -> torch.Tensor:
    """In float32 whatever the model's dtype, as transformers' Llama computes it."""
    h = x.float()
    return norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions, the pairs ``(i, i + d/2)`` of each head turned by their angles."""
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + turned * sin


@torch.inference_mode()
def llama_logits(model: Any, ids: Sequence[int]) -> torch.Tensor:
    """``[len(ids), vocab]`` logits of a Llama model, computed from its modules' weights."""
    config, body = model.config, model.model
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = config.hidden_size // heads
    eps = config.rms_norm_eps
    length = len(ids)
    x = body.embed_tokens.weight[torch.tensor(list(ids), dtype=torch.long)]
    # rotary angles in float32, as transformers (and llama.cpp) compute them: in float64 the
    # logits would differ from theirs by up to 3e-5 at a hundred positions
    angles = torch.arange(length, dtype=torch.float32)[:, None] * body.rotary_emb.inv_freq.float()[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos().to(x.dtype)[:, None, :], angles.sin().to(x.dtype)[:, None, :]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    for layer in body.layers:
        attn, mlp = layer.self_attn, layer.mlp
        h = _rms_norm(x, layer.input_layernorm, eps)
        q = _rotate(F.linear(h, attn.q_proj.weight, attn.q_proj.bias).view(length, heads, dim), cos, sin)
        k = _rotate(F.linear(h, attn.k_proj.weight, attn.k_proj.bias).view(length, kv_heads, dim), cos, sin)
        v = F.linear(h, attn.v_proj.weight, attn.v_proj.bias).view(length, kv_heads, dim)
        k = k.repeat_interleave(heads // kv_heads, dim=1)  # query head i reads key head i // group
        v = v.repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(dim)
        weights = scores.masked_fill(~causal, -math.inf).softmax(dim=-1)
        mixed = torch.einsum("hqk,khd->qhd", weights, v).reshape(length, heads * dim)
        x = x + F.linear(mixed, attn.o_proj.weight, attn.o_proj.bias)
        h = _rms_norm(x, layer.post_attention_layernorm, eps)
        gated = F.silu(F.linear(h, mlp.gate_proj.weight)) * F.linear(h, mlp.up_proj.weight)
        x = x + F.linear(gated, mlp.down_proj.weight)
    return F.linear(_rms_norm(x, body.norm, eps), model.lm_head.weight)


class ThirdEngine(MemberEngine):
    kind = NAME
    full_rows = True

    def __init__(self, model: Any):
        super().__init__()
        self.model = model

    def bind(self, member: Any) -> None:
        super().bind(member)
        self.vocab_size = len(member.tokenizer)

    def rows(self, ids: Sequence[int]) -> torch.Tensor:
        """Log-softmax rows over the tokenizer's ids after every position of ``ids``."""
        self.counters.calls += 1
        return torch.log_softmax(llama_logits(self.model, ids)[:, : self.vocab_size], dim=-1)

    def new_batch(self) -> EngineBatch:
        return ThirdBatch(self)

    def score_tokens(
        self, pairs: ScorePairs, batch_size: int | str, max_batch_size: int, progress: Progress | None = None
    ) -> list[TokenScores]:
        """As lm-eval's HFLM: ``context + continuation`` cut to its last ``max_length + 1`` ids,
        the last one not fed."""
        out = []
        for context, continuation in pairs:
            ids = (context + continuation)[-(self.rolling_window + 1) :]
            rows = self.rows(ids[:-1])[-len(continuation) :]
            targets = torch.tensor(continuation, dtype=torch.long)
            scores = rows.gather(-1, targets[:, None]).squeeze(-1)
            out.append((scores.tolist(), (rows.argmax(dim=-1) == targets).tolist()))
            if progress is not None:
                progress(1)
        return out

    @property
    def rolling_window(self) -> int:
        return self.member.max_length

    @property
    def sequence_limit(self) -> int:
        return self.member.max_length


class ThirdBatch(EngineBatch):
    """Each row is its sequence of ids; every call computes it whole."""

    engine_title = NAME

    def __init__(self, engine: ThirdEngine):
        self.engine = engine
        self.sequences: list[list[int]] = []

    def add_row(self) -> int:
        self.sequences.append([])
        return len(self.sequences) - 1

    def keep_rows(self, rows: list[int]) -> None:
        self.sequences = [self.sequences[r] for r in rows]

    def _fed(self, row: int, keep: int, ids: list[int]) -> list[int]:
        self.sequences[row] = self.sequences[row][:keep] + list(ids)
        return self.sequences[row]

    def answer_forwards(self, calls: dict[int, Forward]) -> dict[int, list[Any]]:
        out = {}
        for row, call in calls.items():
            rows = self.engine.rows(self._fed(row, call.keep, call.ids))
            out[row] = [rows[call.keep + w] for w in call.want]
        return out

    def answer_drafts(self, calls: dict[int, Draft]) -> dict[int, Drafted]:
        out = {}
        for row, call in calls.items():
            sequence = self._fed(row, call.keep, call.ids)
            drafted = Drafted([], [])
            while len(drafted.tokens) < call.n:
                last = self.engine.rows(sequence)[-1]
                token = int(torch.argmax(last)) if call.sampler is None else call.sampler.sample(last)
                drafted.tokens.append(token)
                if call.rows:
                    drafted.rows.append(last)
                sequence.append(token)
                if token in call.stop_ids:
                    break
            out[row] = drafted
        return out

    def answer_completes(self, calls: dict[int, Complete]) -> dict[int, list[Any]]:
        raise RuntimeError("the third engine's rows are full distributions: nothing to complete")


class ThirdSpec(EngineSpec):
    name = NAME
    options = {"third_dtype": "float64"}  # a key this engine claims, with its default

    def parse_option(self, key: str, value: Any) -> Any:
        if value not in ("float32", "float64"):
            raise OptionError(f"{key}={value!r}: float32 or float64")
        return value

    def check_options(self, options: Any) -> None:
        if options.top_k > 50:
            raise OptionError("the third engine reads at most 50 ids")

    def member_settings(self, options: Any) -> dict[str, Any]:
        return {"precision": options.third_dtype}

    def load(self, load: MemberLoad, precision: str = "float64") -> LoadedMember:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        dtype = {"float32": torch.float32, "float64": torch.float64}[precision]
        location = load.source.location
        model = AutoModelForCausalLM.from_pretrained(location, dtype=dtype).eval()
        tokenizer = AutoTokenizer.from_pretrained(location)
        return LoadedMember(tokenizer, model.config, model.generation_config, ThirdEngine(model), "cpu", dtype)

    def generation_rows(self, members: Sequence[Any], jobs: Sequence[Any]) -> int:
        return 4

    def serving_rows(self, members: Sequence[Any]) -> int | None:
        return 3


ENGINE = ThirdSpec()
