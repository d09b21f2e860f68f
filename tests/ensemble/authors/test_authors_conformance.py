"""The SAFE authors' own outputs on the real members, held as expected values.

``tests/data/authors_conformance.json`` records what the authors' ``safe_generate_unite`` and
``safe_generate_gac`` produced on GSM8K (one-shot) and BBH (3-shot chain of thought) prompts:
the drafter's ids and the token positions of every ensemble point, with the settings, the
members' sha256 and the versions both sides ran (``lm-eval-safe bench conformance`` made it and
says how). ``reference=authors`` must give exactly those, for UniTE and GaC with heuristic and
geometric sharpening; no copy of the authors' code is needed here. Float32 on the CPU, as the
record was made. Needs ../shared (the data) and the real GGUF members.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers import REPO

from lm_eval_safe.bench.conformance import SETTINGS, conformance_prompts, prompt_digest, run_project

pytestmark = pytest.mark.real

RECORD = REPO / "tests" / "data" / "authors_conformance.json"
#: rows decoded together (each row's text is its text alone: tests/harness/test_pretrained_members.py); every
#: prompt in one batch halves the suite's time against batches of 4 on 2 cores
BATCH = 20


@pytest.fixture(scope="module")
def record() -> dict[str, Any]:
    return json.loads(RECORD.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def prompts(record: dict[str, Any], shared_dir: Path) -> list[tuple[str, str]]:
    shared = record["shared"]
    return conformance_prompts(shared_dir / "data", shared["gsm8k"], shared["bbh_per_task"])


class Pairs:
    """Members loaded once per pair, in float32 as the record was made (one pair at a time)."""

    def __init__(self) -> None:
        self.loaded: dict[tuple[str, ...], list[Any]] = {}

    def get(self, names: tuple[str, ...]) -> list[Any]:
        from lm_eval_safe.engines import load_member

        if names not in self.loaded:
            self.loaded = {names: [load_member(n, dtype="float32", index=i) for i, n in enumerate(names)]}
        return self.loaded[names]


@pytest.fixture(scope="module")
def pairs(models: Path) -> Pairs:
    return Pairs()


def test_the_record_is_of_these_members_and_prompts(record: dict[str, Any], prompts: list[tuple[str, str]], pairs: Pairs) -> None:
    """The members' files are the ones the record came from (their pinned sha256), and the
    prompts rebuilt from the data are the ones it was made on."""
    from lm_eval_safe.members.sources import content_identity, resolve_source

    for name, identity in record["members"].items():  # older records also name the alias
        assert content_identity(resolve_source(name))["sha256"] == identity["sha256"], name
    for setting in record["settings"]:
        assert [(c["id"], c["prompt_sha256"]) for c in setting["cases"]] == [(i, prompt_digest(p)) for i, p in prompts]
    assert len(prompts) >= 20 and {i.split("-")[0] for i, _ in prompts} == {"gsm8k", "bbh"}


def test_the_authors_gac_refuses_smollm2_in_one_line(pairs: Pairs) -> None:
    """Their union needs one token per byte 0x00-0x7F; SmolLM2's tokenizer gives several control
    bytes its unknown id (their code stops with "Multiple tokens/ Zero token found")."""
    from lm_eval_safe.decoder.loop import SafeDecoder
    from lm_eval_safe.errors import OptionError
    from lm_eval_safe.options import parse_options

    members = pairs.get(("smollm2-135m", "gemma3-270m"))
    options = parse_options({"members": [m.name for m in members], "aggregator": "gac", "reference": "authors"})
    with pytest.raises(OptionError, match="smollm2-135m.*one token per byte") as caught:
        SafeDecoder(members, 0, options)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: s.name)
def test_reference_authors_gives_the_authors_tokens_and_ensemble_points(
    setting: Any, record: dict[str, Any], prompts: list[tuple[str, str]], pairs: Pairs
) -> None:
    (recorded,) = [s for s in record["settings"] if s["name"] == setting.name]
    assert tuple(recorded["members"]) == setting.members and recorded["max_new_tokens"] == setting.max_new_tokens
    outcomes = run_project(pairs.get(setting.members), setting, "authors", [p for _, p in prompts], batch_size=BATCH)
    differ = [
        (case["id"], case["authors_code"]["points"], outcome.points)
        for case, outcome in zip(recorded["cases"], outcomes, strict=True)
        if (outcome.ids, outcome.points) != (case["authors_code"]["ids"], case["authors_code"]["points"])
    ]
    assert differ == []
    assert sum(len(c["authors_code"]["points"]) for c in recorded["cases"]) > 0  # the ensemble acted


def test_the_authors_gac_union_of_qwen_and_gemma(pairs: Pairs) -> None:
    """Their union of raw vocabulary strings: Qwen's "Ġthe" and Gemma's "▁the" meet as " the";
    Qwen's "âĢĻ" (the bytes of "’" in the GPT-2 map) stays itself and never meets Gemma's "’";
    Qwen's newline token is the byte name "<0x0A>", apart from Gemma's own "\\n" token."""
    from lm_eval_safe.ensemble.authors.union import AuthorsUnion

    members = pairs.get(("qwen2.5-coder-0.5b", "gemma3-270m"))
    union = AuthorsUnion.build(members)
    vocabs = [m.tokenizer.get_vocab() for m in members]

    def key(member: int, token: str) -> str:
        return union.keys[int(union.maps[member][vocabs[member][token]])]

    assert key(0, "Ġthe") == key(1, "▁the") == " the"
    assert key(0, "âĢĻ") == "âĢĻ" and key(1, "’") == "’"
    assert key(0, "Ċ") == "<0x0A>" and key(1, "\n") == "\n"


def test_reference_authors_on_llama_cpp_rows_get_their_texts_alone(llama_cpp_installed: None, prompts: list[tuple[str, str]], models: Path) -> None:
    """The mode on the llama.cpp engine: three rows decoded together give each the text and the
    points it gets alone, and the ensemble acts."""
    from lm_eval_safe.engines import load_member

    setting = SETTINGS[0]
    members = [load_member(n, engine="llama_cpp", index=i) for i, n in enumerate(setting.members)]
    texts = [p for _, p in prompts[:3]]
    alone = [run_project(members, setting, "authors", [t])[0] for t in texts]
    together = run_project(members, setting, "authors", texts, batch_size=3)
    assert [(o.ids, o.points) for o in together] == [(o.ids, o.points) for o in alone]
    assert sum(len(o.points) for o in alone) > 0
