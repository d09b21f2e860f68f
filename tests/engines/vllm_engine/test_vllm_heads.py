"""vLLM's heads at their edges: padded output rows, equal log-probs, float32.

Why: vLLM returns per position the asked-about token and its top ``K`` ids over the model's
whole output layer, with equal values in its top-k kernel's order, as float32 numbers. The
decoder reads a head and, where a head cannot settle a decision, the full row fetched in
another request; the two must describe one distribution (or a decision certified from the head
and one taken on the row disagree), ids past the tokenizer must never become tokens, ties must
follow ``torch.argmax``'s order as on the transformers engine, and a member alone must score as
lm-eval's ``vllm``. Tiny models: a Qwen-like member with 37 padded output rows, and one whose
output rows for ids 195 and 385 are equal (every position ties them, often at the maximum).
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import TINY_BPE_SEED, TINY_VOCAB_PAD, VLLM_HEADS, VLLM_HIDDEN
from helpers import gen_request, ll_request, make_lm, random_prompts
from tiny_models import make_tiny_causal_lm, save_member

from lm_eval_safe.engines.vllm.engine import VLLMEngine

ENFORCE = {"enforce_eager": True, "kv_cache_memory_bytes": 16 << 20}  # engines live as long as the process: tiny caches
TIED = (195, 385)  # equal output rows: id 195 is the tiny BPE model's argmax at many positions


def _flat(rows: list[list[tuple[int, float]]]) -> SimpleNamespace:
    """vLLM's flat log-prob list (``FlatLogprobs``' fields): per position the asked-about id,
    then the listed top ids."""
    flat = SimpleNamespace(start_indices=[], end_indices=[], token_ids=[], logprobs=[])
    for row in rows:
        flat.start_indices.append(len(flat.token_ids))
        flat.token_ids += [t for t, _ in row]
        flat.logprobs += [lp for _, lp in row]
        flat.end_indices.append(len(flat.token_ids))
    return flat


def _engine(vocab: int, top: int) -> VLLMEngine:
    engine = VLLMEngine.__new__(VLLMEngine)
    engine.member = SimpleNamespace(tokenizer=range(vocab))
    engine.top = top
    return engine


def test_heads_order_equal_values_as_argmax_and_name_no_argmax_they_cannot() -> None:
    """Equal values listed in vLLM's order come back in id order (the first of equal maxima
    first, as ``torch.argmax`` on the full row); an asked-about id tying the maximum unlisted is
    the argmax when it is the smallest; a head whose listed tokens all tie at the maximum, or
    that lists no token (only padded ids), names none (None); ``max_probability`` is the
    float32 ``exp`` a full row gives, also next to 0.5."""
    engine = _engine(vocab=10, top=3)
    half = float(torch.tensor(math.log(0.5), dtype=torch.float32))  # float32 below log(0.5)
    full = torch.full((10,), -9.0)
    full[[7, 2, 5]] = torch.tensor([half, half, -3.0])
    flat = _flat(
        [
            [(4, -9.0), (7, half), (2, half), (5, -3.0)],
            [(1, half), (7, half), (2, half), (5, -3.0)],
            [(4, -9.0), (7, half), (2, half), (3, half)],
            [(4, -9.0), (11, -0.1), (12, -0.2)],
        ]
    )
    head = engine.head(flat, 0)
    assert head.ids == [2, 7, 5] and head.argmax == int(torch.argmax(full)) == 2
    assert head.max_probability == float(full.max().exp()) and head.max_probability != math.exp(half)
    assert engine.head(flat, 1).ids[:3] == [1, 2, 7]
    assert engine.head(flat, 2) is None and engine.head(flat, 3) is None
    # where a head names no argmax, the batch cuts one from the full row (-1: no id asked about)
    cut = engine.row_head(full, -1, None)
    assert cut.ids == [2, 7, 5] and set(cut.known) == {2, 7, 5}
    assert set(engine.row_head(full, 9, None).known) == {2, 7, 5, 9}


@pytest.fixture(scope="module")
def padded_dir(tmp_path_factory: pytest.TempPathFactory, _tiny_bpe_parts) -> Path:
    """The BPE tokenizer and a tiny model with 37 output rows past it (a Qwen-like padded
    vocabulary, whose random rows here hold much of the mass), head size 32."""
    tok, _ = _tiny_bpe_parts
    model = make_tiny_causal_lm(tok, seed=2, hidden_size=VLLM_HIDDEN, num_heads=VLLM_HEADS, vocab_pad=TINY_VOCAB_PAD)
    return save_member(model, tok, tmp_path_factory.mktemp("tiny_padded_vllm"))


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory: pytest.TempPathFactory, _tiny_bpe_parts) -> Path:
    """``tiny_bpe_vllm_dir``'s model with output row 385 replaced by row 195."""
    tok, _ = _tiny_bpe_parts
    model = make_tiny_causal_lm(tok, seed=TINY_BPE_SEED, hidden_size=VLLM_HIDDEN, num_heads=VLLM_HEADS)
    with torch.no_grad():
        model.lm_head.weight[TIED[1]] = model.lm_head.weight[TIED[0]]
    return save_member(model, tok, tmp_path_factory.mktemp("tiny_tied_vllm"))


@pytest.mark.vllm
@pytest.mark.usefixtures("vllm_installed")
def test_padded_rows_heads_and_full_rows_are_one_distribution(padded_dir: Path) -> None:
    """Drafted and verified heads of a padded member, then their full rows (``Complete``): the
    row holds every log-prob the head holds, bit for bit (the head's are vLLM's over the whole
    output layer; a row renormalised over the tokenizer's ids differed by up to 6 nats here)."""
    from lm_eval_safe.engines.base import Complete, Draft, Forward

    member = make_lm(padded_dir, engine="vllm", **ENFORCE).members[0]
    prompts = [member.encode(p) for p in random_prompts(3, seed=3)]
    batch = member.engine.new_batch()
    for _ in prompts:
        batch.add_row()
    drafts = batch.run({r: Draft(0, 0, p, 6, member.eos_ids) for r, p in enumerate(prompts)})
    forwards = batch.run({r: Forward(0, len(prompts[r]), drafts[r].tokens, [0, len(drafts[r].tokens) - 1]) for r in drafts})
    checked = 0
    for r in drafts:
        heads = list(drafts[r].rows) + list(forwards[r])
        assert all(t < len(member.tokenizer) for t in drafts[r].tokens)
        (rows,) = batch.run({0: Complete(0, heads)}).values()
        for head, row in zip(heads, rows, strict=True):
            assert all(float(row[t]) == lp for t, lp in head.known.items())
            checked += len(head.known)
    assert checked > 100


@pytest.mark.vllm
@pytest.mark.usefixtures("vllm_installed")
def test_a_padded_drafter_writes_the_transformers_texts(padded_dir: Path) -> None:
    """vLLM drafts from the whole output layer, and this model's padded rows often win: each
    such id is replaced by the argmax over the tokenizer's ids (a crash with IndexError before),
    so greedy texts are the transformers engine's, alone and verified by another member; a
    sampled request runs and is reproducible."""
    requests = [gen_request(p, until=[], max_gen_toks=16) for p in random_prompts(4, seed=3)]
    hf = make_lm(padded_dir).generate_until(requests, disable_tqdm=True)
    vllm = make_lm(padded_dir, engine="vllm", batch_size=2, **ENFORCE)
    assert vllm.generate_until(requests, disable_tqdm=True) == hf
    assert vllm.run_stats.summary()["full_decisions"] == 0
    sampled = [gen_request(p, until=[], max_gen_toks=16, do_sample=True, temperature=1.0) for p in random_prompts(3, seed=4)]
    assert vllm.generate_until(sampled, disable_tqdm=True) == vllm.generate_until(sampled, disable_tqdm=True)


@pytest.mark.vllm
@pytest.mark.usefixtures("vllm_installed")
def test_ties_score_as_lm_eval_vllm(tied_dir: Path) -> None:
    """Continuations whose token ties the most probable one: lm-eval's vllm counts them greedy
    (its log-prob is at least the top one's); so does a member alone on vLLM, whatever order
    vLLM lists the tied ids in."""
    from lm_eval_safe.bench.vllm_parity import lm_eval_vllm_for

    ours = make_lm(tied_dir, engine="vllm", batch_size=8, **ENFORCE)
    tokenizer = ours.members[0].tokenizer
    words = [tokenizer.decode([t]) for t in TIED]
    # contexts where the model itself writes id 195: its greedy texts, cut before each one
    prompts = random_prompts(16, seed=9)
    texts = ours.generate_until([gen_request(p, until=[], max_gen_toks=40) for p in prompts], disable_tqdm=True)
    contexts = [p + t[:i] for p, t in zip(prompts, texts, strict=True) for i, c in enumerate(t) if c == words[0]]
    requests = [ll_request(c, w) for c in contexts for w in words]
    theirs = lm_eval_vllm_for(ours.members[0], batch_size=8)
    mine, reference = (lm.loglikelihood(requests, disable_tqdm=True) for lm in (ours, theirs))
    assert [g for _, g in mine] == [g for _, g in reference]
    assert max(abs(a - b) for (a, _), (b, _) in zip(mine, reference, strict=True)) < 1e-4
    assert sum(g for _, g in reference[1::2]) >= 3  # the second id of the pair, greedy by a tie


@pytest.mark.vllm
@pytest.mark.usefixtures("vllm_installed")
def test_ties_decide_as_on_transformers(tiny_bpe_vllm_dir: Path, tied_dir: Path) -> None:
    """A verifier whose own next token ties its maximum with another id: SAFE's consensus rule
    (a) reads its argmax, the first of the equal maxima on both engines, so both take the same
    decisions and write the same texts."""
    requests = [gen_request(p, until=[], max_gen_toks=24) for p in random_prompts(6, seed=5)]
    results = {}
    for engine in ("hf", "vllm"):
        lm = make_lm(tiny_bpe_vllm_dir, tied_dir, engine=engine, batch_size=3, **(ENFORCE if engine == "vllm" else {}))
        results[engine] = (lm.generate_until(requests, disable_tqdm=True), lm.run_stats.summary())
    assert results["vllm"][0] == results["hf"][0]
    for key in ("ensemble_ops", "consensus_skips", "aligned_positions"):
        assert results["vllm"][1][key] == results["hf"][1][key], key
