"""``reference=authors``: the SAFE authors' rules where they differ from this package's, on
made-up tokenizers whose every string can be followed by hand, and on the tiny models.

The expected values are derived in each docstring from the authors' rules as
docs/algorithm.md ("The authors' code") states them, never read from the code under test. The
real members against the authors' own outputs: tests/ensemble/authors/test_authors_conformance.py.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from helpers import gen_request, make_lm, random_prompts
from transformers import AutoTokenizer

from lm_eval_safe.decoder.authors_alignment import first_verified, paired_positions
from lm_eval_safe.ensemble.aggregate import View
from lm_eval_safe.ensemble.authors.aggregate import AuthorsUnite
from lm_eval_safe.ensemble.authors.union import special_prefix
from lm_eval_safe.errors import OptionError, RequestError


class WordTokenizer:
    """Longest-match tokenizer over a list of strings (id = index); ``decode`` joins the strings,
    special ones included, as ``decode`` without ``skip_special_tokens`` does."""

    def __init__(self, strings: list[str], eos: str):
        self.strings = strings
        self.eos_token = eos
        self.eos_token_id = strings.index(eos)

    def _ids(self, text: str) -> list[int]:
        ids, pos = [], 0
        while pos < len(text):
            fits = [i for i, s in enumerate(self.strings) if s and s != self.eos_token and text.startswith(s, pos)]
            best = max(fits, key=lambda i: len(self.strings[i]))
            ids.append(best)
            pos += len(self.strings[best])
        return ids

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": self._ids(text)}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._ids(text)

    def tokenize(self, text: str) -> list[str]:
        return [self.strings[i] for i in self._ids(text)]

    def convert_tokens_to_ids(self, tokens: list[str]) -> list[int]:
        return [self.strings.index(t) for t in tokens]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(self.strings[i] for i in ids if not (skip_special_tokens and i == self.eos_token_id))


DRAFTER = WordTokenizer(
    ["<|im_end|>", " ", "3", " is", "The", " answer", " 4", "4", ".", "\n", "\n\n", "x", "<", "eos", ">"], "<|im_end|>"
)
VERIFIER = WordTokenizer(
    ["<eos>", " ", "3", " is", "The", " ans", "wer", " 4", "4", ".", "<", "|", "im", "_", "end", ">", "\n", "\n\n", "x"],
    "<eos>",
)


def ids_of(tokenizer: WordTokenizer, *strings: str) -> list[int]:
    return [tokenizer.strings.index(s) for s in strings]


# -- where the authors look for ensemble points --------------------------------------------------


def test_a_lone_leading_space_pairs_the_drafters_row_before_it_with_the_verifiers_after_it() -> None:
    """The drafter drafts " ", "3", " is"; the verifier reads " ", "3", " is" too. Stripped of
    leading spaces, the text before drafted token 0 and before drafted token 1 are both "", as
    are the verifier's texts before its tokens 0 and 1. Scanning the verifier's positions, each
    takes the first drafted position with an equal string: i=0 -> j=0, i=1 -> j=0 (not j=1,
    which byte offsets would pair), i=2 ("3") -> j=2."""
    drafted = ids_of(DRAFTER, " ", "3", " is")
    ver_ids = VERIFIER(DRAFTER.decode(drafted))["input_ids"]
    assert ver_ids == ids_of(VERIFIER, " ", "3", " is")
    assert paired_positions(DRAFTER, VERIFIER, [], drafted, ver_ids, gac=False) == [(0, 0), (0, 1), (2, 2)]


def test_a_drafted_eos_is_text_the_verifier_reads() -> None:
    """The drafter's EOS decodes to "<|im_end|>", which the verifier (no such token) reads as
    "<", "|", "im", ...: the position before the EOS pairs with the verifier's row predicting
    "<", its own next token there. Committed "The": the verifier's first examined position is
    the one after "The" (its decoded prefix first reaches the committed length)."""
    committed = ids_of(DRAFTER, "The")
    drafted = ids_of(DRAFTER, " is", " 4", "<|im_end|>")
    ver_ids = VERIFIER(DRAFTER.decode(committed + drafted))["input_ids"]
    assert [VERIFIER.strings[i] for i in ver_ids] == ["The", " is", " 4", "<", "|", "im", "_", "end", "|", ">"]
    pairs = paired_positions(DRAFTER, VERIFIER, committed, drafted, ver_ids, gac=False)
    assert pairs == [(0, 1), (1, 2), (2, 3)]
    assert VERIFIER.strings[ver_ids[3]] == "<"


def test_the_first_examined_position_follows_each_aggregators_rule() -> None:
    """Committed text "The answer": the verifier's prefixes "", "The", "The ans", "The answer"
    reach its length (UniTE's rule) and start with it (GaC's) first at index 3. A committed
    text the verifier's whole text does not start with is never verified by GaC; one longer
    than the verifier's whole text by neither."""
    ver_ids = ids_of(VERIFIER, "The", " ans", "wer", " is")
    for gac in (False, True):
        assert first_verified(VERIFIER, ver_ids, "The answer", gac) == 3
        assert first_verified(VERIFIER, ver_ids, "", gac) == 0
    assert first_verified(VERIFIER, ver_ids, "The answer is 4", False) == len(ver_ids)
    assert first_verified(VERIFIER, ver_ids, "An answer", True) == len(ver_ids)
    assert first_verified(VERIFIER, ver_ids, "An answer", False) == 3


# -- how the authors' UniTE decides -------------------------------------------------------------


def view(tokenizer: WordTokenizer, table: dict[str, float]) -> View:
    """A member whose distribution is ``table`` (strings absent from it share what is left)."""
    rest = [s for s in tokenizer.strings if s not in table]
    left = (1.0 - sum(table.values())) / len(rest)
    probs = torch.tensor([table.get(s, left) for s in tokenizer.strings], dtype=torch.float64)
    return View(probs.log(), None, tokenizer)  # type: ignore[arg-type]


def unite(drafter: View, verifier: View, sharpen: str = "heuristic", k: int = 3) -> Any:
    members = [SimpleNamespace(tokenizer=v.tokenizer, eos_id=v.tokenizer.eos_token_id) for v in (drafter, verifier)]
    return AuthorsUnite(members[0], members[1], sharpen, 0.1, k)  # type: ignore[arg-type]


def test_each_members_eos_is_its_own_string() -> None:
    """Drafter: EOS 0.45, "x" 0.4, "." 0.1 (its 12 other strings 0.05/12 each); verifier: EOS
    0.45, "x" 0.42, "." 0.1 (16 others, 0.03/16 each); top-3. The authors' strings "<|im_end|>"
    and "<eos>" stay apart: the drafter reads "<eos>" at its token "<" (0.0042) and the
    verifier "<|im_end|>" at "<" (0.0019), so over the four strings the mixture is
    <|im_end|> 0.5*0.45/0.9542 + 0.5*0.0019/0.9719 = 0.237, "x" 0.5*0.4/0.9542 + 0.5*0.42/0.9719
    = 0.426, <eos> 0.234: "x", which no sharpening changes (no string prefixes another), written
    as the drafter's "x". This package's one EOS key adds the two stops up: EOS 0.45 against
    "x" 0.41 stops the response."""
    from aggregate_cases import EOS, member

    from lm_eval_safe.ensemble.aggregate import unite as paper_unite

    d = view(DRAFTER, {"<|im_end|>": 0.45, "x": 0.4, ".": 0.1})
    v = view(VERIFIER, {"<eos>": 0.45, "x": 0.42, ".": 0.1})
    choice = unite(d, v).choose([d, v])
    assert choice.key == b"x" and choice.drafter_ids == ids_of(DRAFTER, "x")
    order, scores, _, _ = unite(d, v).table([d, v])
    assert order == ["<|im_end|>", "x", ".", "<eos>"]
    assert float(scores[1]) == pytest.approx(0.5 * 0.4 / (0.95 + 0.05 / 12) + 0.5 * 0.42 / (0.97 + 0.03 / 16), abs=1e-6)
    paper = paper_unite([member({EOS: 0.45, "x": 0.4, ".": 0.15}), member({EOS: 0.45, "x": 0.42, ".": 0.13})], "heuristic", 0.1, 3)
    assert paper.key == b"\x00<eos>"


def test_only_a_lone_space_is_barred_from_absorbing() -> None:
    """Both members: "\\n" 0.3, "\\n\\n" 0.25, "x" 0.35, the rest below (top-3): each member's
    table over the three strings is p/0.9, the mixture "x" 0.389, "\\n" 0.333, "\\n\\n" 0.278:
    smooth. "\\n" is a drafter top-k string above 0.1 that prefixes "\\n\\n", and only " " is
    barred, so it absorbs it: (0.3 + 0.25)/0.9 = 0.611 beats "x". This package bars every
    whitespace string from absorbing ("x" would win)."""
    table = {"\n": 0.3, "\n\n": 0.25, "x": 0.35}
    d, v = view(DRAFTER, table), view(VERIFIER, table)
    choice = unite(d, v).choose([d, v])
    assert choice.key == b"\n" and choice.sharpened and choice.drafter_ids == ids_of(DRAFTER, "\n")
    assert choice.probability == pytest.approx((0.3 + 0.25) / 0.9, abs=1e-6)


def test_a_lacking_string_is_read_at_its_first_non_blank_sub_token() -> None:
    """A verifier without " 4" tokenizes it " ", "4": the authors read it at "4", the first
    sub-token that is not its blank " " (this package reads the first token, " ")."""
    verifier = WordTokenizer(["<eos>", " ", "4", ".", "x"], "<eos>")
    d = view(DRAFTER, {" 4": 0.6, "x": 0.2, ".": 0.1})
    v = view(verifier, {"x": 0.5, ".": 0.3, " ": 0.1})
    order, _, ids, _ = unite(d, v).table([d, v])
    assert ids[1][order.index(" 4")] == verifier.strings.index("4")


def test_geometric_sharpening_only_below_one_half() -> None:
    """Decided: drafter x 0.7, "." 0.2; verifier x 0.4, "." 0.5 (top-2, one union of two
    strings): tables x 0.778 and 0.444, mixture x 0.611, kept as it is. Smooth: drafter x 0.5,
    "." 0.3, "\\n" 0.1; verifier "." 0.4, "\\n" 0.35, x 0.05: tables over (x, ., \\n) are
    (0.556, 0.333, 0.111) and (0.0625, 0.5, 0.4375), the mixture's largest 0.417: the geometric
    mean decides, "." with sqrt(0.333 * 0.5) = 0.408."""
    d = view(DRAFTER, {"x": 0.7, ".": 0.2})
    v = view(VERIFIER, {"x": 0.4, ".": 0.5})
    choice = unite(d, v, "geometric", k=2).choose([d, v])
    assert choice.key == b"x" and not choice.sharpened
    assert choice.probability == pytest.approx((0.7 / 0.9 + 0.4 / 0.9) / 2, abs=1e-6)
    d = view(DRAFTER, {"x": 0.5, ".": 0.3, "\n": 0.1})
    v = view(VERIFIER, {".": 0.4, "\n": 0.35, "x": 0.05})
    choice = unite(d, v, "geometric", k=2).choose([d, v])
    assert choice.key == b"." and choice.sharpened
    assert choice.probability == pytest.approx(math.sqrt(0.3 / 0.9 * 0.4 / 0.8), abs=1e-6)


def test_gac_refuses_what_the_authors_union_cannot_map(tiny_bpe_dir: Path, tiny_sp_dir: Path) -> None:
    """Their union writes a byte-level member's letter bytes as the letters when the other member
    is not byte-level, and fails where no vocabulary has the letter as a token (the tiny
    SentencePiece vocabulary has no "C"): refused before any request, in one line."""
    with pytest.raises(OptionError, match="reference=authors with aggregator=gac.*'C'") as caught:
        make_lm(tiny_bpe_dir, tiny_sp_dir, reference="authors", aggregator="gac")
    assert "\n" not in str(caught.value)


def test_special_prefix_is_the_authors_rule_on_a_sentencepiece_vocabulary(tiny_sp_dir: Path) -> None:
    """Their rule, by brute force over the tiny vocabulary: the shortest ``▁`` token (then the
    first in order) with one ``▁``, not blank without it, and part of no other ``▁`` token."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_sp_dir)
    marked = [t for t in tokenizer.get_vocab() if t.startswith("▁") and t != "▁"]
    kept = [
        t[1:]
        for t in marked
        if t.count("▁") == 1 and t[1:].strip() and not any(t in other for other in marked if other != t)
    ]
    assert special_prefix(tokenizer) == min(kept, key=lambda x: (len(x), x))


# -- the option --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"weights": "2|1"}, "equally"),
        ({"schedule": "every"}, "schedule=safe"),
    ],
)
def test_what_the_authors_code_cannot_run_is_refused(tiny_bpe_dir: Path, tiny_sp_dir: Path, extra: dict, words: str) -> None:
    with pytest.raises(OptionError, match=words) as caught:
        make_lm(tiny_bpe_dir, tiny_sp_dir, reference="authors", **extra)
    assert "\n" not in str(caught.value)


def test_three_members_and_sampling_are_refused(tiny_bpe_dir: Path, tiny_sp_dir: Path, tiny_gemma_dir: Path) -> None:
    with pytest.raises(OptionError, match="two members"):
        make_lm(tiny_bpe_dir, tiny_sp_dir, tiny_gemma_dir, reference="authors")
    lm = make_lm(tiny_bpe_dir, tiny_sp_dir, reference="authors")
    with pytest.raises(RequestError, match="greedily"):
        lm.generate_until([gen_request("the cat", until=[], max_gen_toks=4, do_sample=True, temperature=0.7)], True)


@pytest.mark.parametrize(
    ("aggregator", "members"), [("unite", ("tiny_bpe_dir", "tiny_sp_dir")), ("gac", ("tiny_sp_dir", "tiny_gemma_dir"))]
)
def test_batched_rows_get_their_texts_alone(request: pytest.FixtureRequest, aggregator: str, members: tuple[str, str]) -> None:
    """Rows of a batch decode exactly as alone (float64: no batch-dependent rounding), and the
    mode acts: some ensemble point is taken. (The authors' GaC union cannot take the tiny
    byte-level vocabulary beside the tiny SentencePiece one: two SentencePiece members.)"""
    folders = [request.getfixturevalue(name) for name in members]
    lm = make_lm(*folders, reference="authors", aggregator=aggregator, dtype="float64")
    requests = [gen_request(p, until=[], max_gen_toks=20) for p in random_prompts(5, seed=11)]
    alone = [lm.generate_until([r], disable_tqdm=True)[0] for r in requests]
    lm.options.batch_size = 3
    assert lm.generate_until(requests, disable_tqdm=True) == alone
    assert lm.run_stats.summary()["ensemble_ops"] > 0


def test_use_cache_keeps_the_modes_apart(tiny_bpe_dir: Path, tiny_sp_dir: Path) -> None:
    paper = make_lm(tiny_bpe_dir, tiny_sp_dir)
    assert make_lm(tiny_bpe_dir, tiny_sp_dir, reference="authors").cache_namespace != paper.cache_namespace


def test_the_server_answers_as_the_backend(tiny_bpe_dir: Path, tiny_sp_dir: Path, tmp_path: Path) -> None:
    """``lm-eval-safe serve`` with ``reference=authors`` as a real process: concurrent clients
    (rows joining and leaving one batch) each get the text the backend gives the request alone;
    a sampled request is refused with the one-line reason as an OpenAI error."""
    from concurrent.futures import ThreadPoolExecutor

    from serve_helpers import ServerProcess, post

    members = f"members={tiny_bpe_dir},{tiny_sp_dir},dtype=float64,reference=authors"
    backend = make_lm(tiny_bpe_dir, tiny_sp_dir, dtype="float64", reference="authors")
    prompts = random_prompts(12, seed=31)
    budgets = [6 + (i * 5) % 13 for i in range(12)]
    with ServerProcess(f"{members},batch_size=4", log_dir=tmp_path) as server:

        def ask(i: int) -> str:
            status, body = post(server.url + "/v1/completions", {"prompt": prompts[i], "max_tokens": budgets[i], "temperature": 0})
            assert status == 200, body
            return body["choices"][0]["text"]

        with ThreadPoolExecutor(12) as pool:
            served = list(pool.map(ask, range(12)))
        status, body = post(server.url + "/v1/completions", {"prompt": prompts[0], "max_tokens": 4, "temperature": 0.8})
    alone = [
        backend.generate_until([gen_request(p, until=[], max_gen_toks=b)], disable_tqdm=True)[0]
        for p, b in zip(prompts, budgets, strict=True)
    ]
    assert served == alone
    assert status == 400 and "reference=authors decodes greedily" in body["error"]["message"]
