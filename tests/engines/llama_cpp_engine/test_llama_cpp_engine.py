"""The llama.cpp engine against llama.cpp itself (never against this package's own output): the
real GGUF members' greedy texts equal llama-cpp-python's own greedy generation of the same file,
their log-likelihoods equal llama.cpp's logits computed directly, rows decoded in a batch equal
each alone, a rolled-back, prefix-copied or windowed row equals a fresh recompute, and SAFE's
Theorem 1 holds on this engine.

Needs llama-cpp-python (``bash scripts/setup.sh --llama-cpp``; skipped without it unless
``LM_EVAL_SAFE_REQUIRE_LLAMA_CPP=1``, where its absence fails) and ../shared's models.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lm_eval_safe.engines.llama_cpp.options import parse_option
from lm_eval_safe.errors import OptionError

#: Settings of both sides of every comparison (llama.cpp's kernels differ with flash attention
#: on and off, so each side names it)
FLASH = "on"
THREADS = 2
PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Question: Tom has 3 apples and buys 5 more. How many apples does he have?\nAnswer:",
    "Once upon a time, in a small village by the sea,",
)
#: Few-shot exemplars longer than two of the engine's blocks (``n_batch`` 128 ids), so prompts
#: that start with them are prefilled in several decodes and share whole blocks
EXEMPLARS = "".join(
    f"Question: A shop sells {n} pens a day for {n + 3} days. How many pens does it sell?\n"
    f"Answer: {n} pens a day for {n + 3} days is {n} * {n + 3} = {n * (n + 3)} pens.\n\n"
    for n in range(2, 12)
)


def test_blocks_are_cut_at_multiples() -> None:
    from lm_eval_safe.engines.llama_cpp.slots import blocks

    assert list(blocks(0, 300, 128)) == [(0, 128), (128, 256), (256, 300)]
    assert list(blocks(100, 260, 128)) == [(100, 128), (128, 256), (256, 260)]
    assert list(blocks(128, 129, 128)) == [(128, 129)]
    assert list(blocks(5, 5, 128)) == []


def test_options_are_checked() -> None:
    assert parse_option("flash_attn", "true") == "on"
    assert parse_option("n_gpu_layers", "-1") == -1
    assert parse_option("n_ctx", 4096) == 4096
    assert parse_option("batch_rows", "true") is True
    assert parse_option("use_extra_bufts", "0") is False
    for key, value in (
        ("flash_attn", "maybe"),
        ("n_ctx", "many"),
        ("n_gpu_layers", -2),
        ("n_seq_max", 0),
        ("batch_rows", "sometimes"),
    ):
        with pytest.raises(OptionError):
            parse_option(key, value)


# -- real members ---------------------------------------------------------------------------
def _member(alias: str, **settings: Any) -> Any:
    from lm_eval_safe.engines import load_member

    return load_member(
        alias, engine="llama_cpp", n_threads=THREADS, n_ctx=4096, flash_attn=FLASH, **settings
    )


@pytest.fixture(scope="module", params=["smollm2-135m", "gemma3-270m"])
def member(request: pytest.FixtureRequest, llama_cpp_installed: None, models: Path) -> Any:
    return _member(request.param)


def _reference(member: Any, logits_all: bool = True, n_ctx: int = 4096) -> Any:
    """llama-cpp-python's own high-level model of the same file and settings: the same
    ``n_batch`` (its ``eval`` cuts a sequence fed from position 0 at the same multiples) and the
    CPU's repacked weight layouts off, as the engine loads them (``Llama`` has no argument for
    that: its default model parameters are patched while it loads)."""
    import llama_cpp
    from llama_cpp import Llama

    made = llama_cpp.llama_model_default_params

    def without_repacking() -> Any:
        params = made()
        params.use_extra_bufts = False
        return params

    n_batch = member.engine.model.n_batch
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(llama_cpp.llama.llama_cpp, "llama_model_default_params", without_repacking)
        return Llama(
            model_path=member.source.location,
            n_ctx=n_ctx,
            n_batch=n_batch,
            n_ubatch=n_batch,
            n_threads=THREADS,
            n_threads_batch=THREADS,
            flash_attn=FLASH == "on",
            swa_full=True,
            logits_all=logits_all,
            verbose=False,
        )


def _ids(member: Any, text: str) -> list[int]:
    return member.encode(text)


def _draft(member: Any, prompts: list[list[int]], n: int, rows: bool = False) -> list[Any]:
    from lm_eval_safe.engines.base import Draft

    batch = member.engine.new_batch()
    for _ in prompts:
        batch.add_row()
    answers = batch.run({r: Draft(0, 0, ids, n, rows=rows) for r, ids in enumerate(prompts)})
    batch.close()
    return [answers[r] for r in range(len(prompts))]


#: Strings where tokenizers part ways: accents, CJK, emoji, runs of spaces and tabs, chat
#: special tokens of both members, carriage returns, zero-width and no-break spaces. Not among
#: them: a space before a numeric character outside ASCII (" ½"), which transformers' reading of
#: SmolLM2's GGUF keeps in one piece and llama.cpp splits (docs/engines.md)
HARD_TEXTS = (
    "½ héllo wörld — 東京 🚀",
    "  leading spaces\n\n\ttabs   and more",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "x = [1,2,3]  # ünïcode\r\n\u200b\u00a0end",
)


@pytest.mark.real
@pytest.mark.llama_cpp
@pytest.mark.parametrize("alias", ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"])
def test_tokenizer_kept_in_the_cache_tokenizes_as_llama_cpp(
    alias: str, llama_cpp_installed: None, models: Path, tmp_path: Path
) -> None:
    """The tokenizer and config the engine keeps in the cache (written on a first load, read
    on the next) are transformers' own reading of the GGUF file (what the other engines use):
    the same ids (those of llama.cpp's own tokenizer on the same file), vocabulary, special ids,
    chat template and config."""
    from llama_cpp import Llama
    from transformers import AutoConfig, AutoTokenizer

    from lm_eval_safe.engines.llama_cpp.loading import text_folder, text_side
    from lm_eval_safe.members.aliases import ALIASES

    path = models / ALIASES[alias].file
    direct = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    direct_config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name).to_dict()
    native = Llama(model_path=str(path), vocab_only=True, verbose=False)
    for load in ("first", "again"):
        tokenizer, config, _ = text_side(path, False, tmp_path)
        assert (text_folder(path, tmp_path) / "tokenizer_config.json").is_file()
        for text in HARD_TEXTS:
            expected = native.tokenize(text.encode(), add_bos=False, special=True)
            assert direct.encode(text, add_special_tokens=False) == expected, text
            assert tokenizer.encode(text, add_special_tokens=False) == expected, (load, text)
        assert tokenizer.get_vocab() == direct.get_vocab()
        assert tokenizer.chat_template == direct.chat_template
        assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (
            direct.bos_token_id,
            direct.eos_token_id,
        )
        assert tokenizer.eos_token_id == native.token_eos()
        changed = {k for k, v in config.to_dict().items() if direct_config[k] != v}
        assert changed == {"_name_or_path"}, load


@pytest.mark.real
@pytest.mark.llama_cpp
def test_greedy_equals_llama_cpp_python(member: Any) -> None:
    """Each prompt alone, 24 tokens: the tokens llama-cpp-python's ``Llama.generate`` picks at
    temperature 0 on the same GGUF file (a prompt of several blocks among them)."""
    reference = _reference(member, logits_all=False)
    for text in (*PROMPTS[:3], EXEMPLARS + "Question: A shop sells 7 pens a day for 4 days. How many pens does it sell?\nAnswer:"):
        ids = _ids(member, text)
        reference.reset()
        expected = []
        for token in reference.generate(ids, temp=0.0, top_k=1, reset=True):
            expected.append(int(token))
            if len(expected) == 24:
                break
        (drafted,) = _draft(member, [ids], 24)
        assert drafted.tokens == expected, text


@pytest.mark.real
@pytest.mark.llama_cpp
def test_loglikelihoods_equal_llama_cpp_logits(member: Any) -> None:
    """``score_tokens`` of context/continuation pairs (shared contexts of several blocks
    included) within 1e-4 of the log-softmax of llama.cpp's own logits of the whole sequence,
    and the same argmax flags."""
    import torch

    reference = _reference(member)
    contexts = [_ids(member, PROMPTS[0]), _ids(member, EXEMPLARS + PROMPTS[2])]
    conts = [_ids(member, " Paris, of course.")[1:] or [42], [13, 14, 15, 16], [7]]
    pairs = [(ctx, cont) for ctx in contexts for cont in conts]
    member.engine.forget_prefixes()
    saved = member.engine.slots.reused
    scored = member.engine.score_tokens(pairs, "auto", 64)
    # the long context's whole blocks are computed once for its three continuations
    assert member.engine.slots.reused - saved == 2 * ((len(contexts[1]) - 1) // 128 * 128)
    vocab = len(member.tokenizer)
    for (ctx, cont), (logprobs, greedy) in zip(pairs, scored, strict=True):
        reference.reset()
        reference.eval(ctx + cont[:-1])
        logits = torch.tensor(reference.scores[: len(ctx) + len(cont) - 1], dtype=torch.float32)
        rows = torch.log_softmax(logits[len(ctx) - 1 :, :vocab], dim=-1)
        want = rows[torch.arange(len(cont)), torch.tensor(cont)]
        assert torch.allclose(torch.tensor(logprobs), want, atol=1e-4), (logprobs, want)
        assert greedy == (rows.argmax(-1) == torch.tensor(cont)).tolist()


@pytest.mark.real
@pytest.mark.llama_cpp
def test_rows_together_equal_each_alone(member: Any) -> None:
    """Four prompts sharing few-shot exemplars drafted as rows of one batch, then again (their
    exemplars' blocks now read from the cache), then each alone in a cache emptied first: the
    same tokens and distributions every time."""
    import torch

    prompts = [_ids(member, EXEMPLARS + text) for text in PROMPTS]
    member.engine.forget_prefixes()
    together = _draft(member, prompts, 12, rows=True)
    saved = member.engine.slots.reused
    again = _draft(member, prompts, 12, rows=True)
    assert member.engine.slots.reused - saved >= 4 * 256, "the exemplars' blocks were not reused"
    for r, ids in enumerate(prompts):
        member.engine.forget_prefixes()
        (alone,) = _draft(member, [ids], 12, rows=True)
        for got in (together[r], again[r]):
            assert got.tokens == alone.tokens
            for a, b in zip(got.rows, alone.rows, strict=True):
                assert torch.equal(a, b)


@pytest.mark.real
@pytest.mark.llama_cpp
def test_batch_rows_computes_shared_exemplars_once(member: Any) -> None:
    """``batch_rows=true``: four new rows sharing few-shot exemplars in one step compute them
    once (each later row reads the earlier rows' cells), and each row's first distribution is
    its own prompt's: within the rounding of batched kernels of the same prompt alone (up to
    1.3 here; Gemma-3's first token may differ), further from every other prompt's."""
    rows_member = _member(member.name, batch_rows=True)
    prompts = [_ids(member, EXEMPLARS + text) for text in PROMPTS]
    shared = max(n for n in range(min(map(len, prompts)) + 1) if len({tuple(p[:n]) for p in prompts}) == 1)
    together = _draft(rows_member, prompts, 1, rows=True)
    assert rows_member.engine.slots.reused >= 3 * (shared - 1)
    alone = []
    for ids in prompts:
        member.engine.forget_prefixes()
        alone.extend(_draft(member, [ids], 1, rows=True))
    for r, row in enumerate(together):
        gaps = [float((row.rows[0] - other.rows[0]).abs().max()) for other in alone]
        assert gaps[r] < 2.5 < min(g for o, g in enumerate(gaps) if o != r), (r, gaps)


@pytest.mark.real
@pytest.mark.llama_cpp
def test_rollback_prefix_copy_and_windows_equal_a_fresh_recompute(member: Any) -> None:
    """A row rolled back after a draft and then read in a verifier window equals a fresh
    llama.cpp context fed the same ids in the same decodes; a second row whose prompt's whole
    blocks are copied from the first row's sequence equals a fresh context fed its whole
    sequence at once."""
    import torch

    from lm_eval_safe.engines.base import Draft, Forward

    reference = _reference(member)
    vocab = len(member.tokenizer)
    block = member.engine.slots.block

    def fresh(decodes: list[list[int]], positions: list[int]) -> torch.Tensor:
        """A fresh context fed ``decodes``, one ``eval`` each."""
        reference.reset()
        for ids in decodes:
            reference.eval(ids)
        logits = torch.tensor(reference.scores[: reference.n_tokens], dtype=torch.float32)
        return torch.log_softmax(logits[positions, :vocab], dim=-1)

    member.engine.forget_prefixes()
    prompt = _ids(member, EXEMPLARS + PROMPTS[3])
    prompt = prompt[: len(prompt) // block * block - 16]  # the window below within one block
    assert len(prompt) > 2 * block
    batch = member.engine.new_batch()
    batch.add_row()
    (drafted,) = batch.run({0: Draft(0, 0, prompt, 6, rows=False)}).values()
    # reject the last 4 drafted tokens and verify other ones in a window of 3 read positions
    keep = len(prompt) + 2
    other = _ids(member, " and then we went home")[-3:]
    assert len(other) == 3
    rows = torch.stack(batch.run({0: Forward(0, keep, other, [0, 1, 2])})[0])
    d0, d1 = drafted.tokens[:2]
    read = [keep, keep + 1, keep + 2]
    assert torch.allclose(rows, fresh([prompt, [d0], [d1], other], read), atol=1e-4)
    # a second row with the same prompt: its prompt's whole blocks are copied from the first
    # row's sequence (what follows them is the first row's own and is not read)
    second = batch.add_row()
    saved = member.engine.slots.reused
    read = [len(prompt) - 1, len(prompt) + 2]
    rows = torch.stack(batch.run({second: Forward(0, 0, prompt + other, read)})[second])
    assert member.engine.slots.reused - saved == (len(prompt) - 1) // block * block
    assert torch.allclose(rows, fresh([prompt + other], read), atol=1e-4)
    batch.close()


@pytest.mark.real
@pytest.mark.llama_cpp
def test_safe_writes_the_aligned_texts_up_to_a_pair_a_verifier_reads_as_one_token(
    llama_cpp_installed: None, models: Path
) -> None:
    """Theorem 1 on the default members on llama.cpp (``engine=llama_cpp`` through the registry):
    SAFE with the plain average (unite, no sharpening) writes what ensembling at every aligned
    position writes. The theorem takes the next tokens to be one string (docs/algorithm.md); where
    SmolLM2 drafts '\\n' '\\n' and Gemma-3 reads '\\n\\n' as one token, its argmax, rule (a)
    skips while ``aligned`` writes '\\n\\n' as one drafter token: the same text in a token
    fewer, so within one token budget ``aligned`` writes on past SAFE. Every SAFE text is then a
    prefix of the aligned one, equal where no such pair was drafted (three prompts of four)."""
    from helpers import gen_request

    from lm_eval_safe.harness.model import SafeEnsembleLM

    opts = {
        "members": "smollm2-135m,gemma3-270m",
        "engine": "llama_cpp",
        "n_threads": THREADS,
        "n_ctx": 4096,
        "flash_attn": FLASH,
        "aggregator": "unite",
        "sharpen": "none",
        "batch_size": 4,
    }
    safe = SafeEnsembleLM(schedule="safe", **opts)
    aligned = SafeEnsembleLM(schedule="aligned", **opts)
    requests = [gen_request(p, until=[], max_gen_toks=24) for p in PROMPTS]
    safe_texts = safe.generate_until(requests, disable_tqdm=True)
    aligned_texts = aligned.generate_until(requests, disable_tqdm=True)
    assert all(a.startswith(s) for s, a in zip(safe_texts, aligned_texts, strict=True))
    parted = [i for i, (s, a) in enumerate(zip(safe_texts, aligned_texts, strict=True)) if s != a]
    assert parted == [0] and "\n\n" in safe_texts[0], (safe_texts, aligned_texts)
    assert safe.run_stats.ensemble_ops > 0, "the test needs positions where the members disagree"
    assert aligned.run_stats.ensemble_ops > safe.run_stats.ensemble_ops
