"""A request's generation kwargs: parsed as lm-eval normalises them, bad ones refused in one line
naming the key before any forward, and greedy decoding untouched by sampling's settings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers import gen_request, make_lm, random_prompts

from lm_eval_safe.ensemble.sampling import (
    SamplingParams,
    parse_gen_kwargs,
)
from lm_eval_safe.errors import OptionError, RequestError


def test_gen_kwargs_are_parsed_like_lm_eval() -> None:
    greedy = parse_gen_kwargs({"until": "Q:", "max_new_tokens": 7}, 256)
    assert greedy.until == ["Q:"] and greedy.max_gen_toks == 7 and greedy.sampling.greedy
    # lm-eval: a temperature > 0 without do_sample samples; do_sample=False is greedy whatever
    # the temperature; do_sample=True at temperature 0 is greedy (transformers would refuse it)
    assert not parse_gen_kwargs({"temperature": 0.7}, 256).sampling.greedy
    assert parse_gen_kwargs({"do_sample": False, "temperature": 0.7}, 256).sampling.greedy
    assert parse_gen_kwargs({"do_sample": "true", "temperature": 0}, 256).sampling.greedy
    sampled = parse_gen_kwargs(
        {"do_sample": True, "temperature": "0.5", "top_k": 40.0, "top_p": 0.9}, 9
    )
    assert sampled.sampling == SamplingParams(True, 0.5, 40, 0.9) and sampled.max_gen_toks == 9
    # lm-eval's own task configs pass num_beams: 1
    assert parse_gen_kwargs({"num_beams": 1, "until": []}, 256).sampling.greedy


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"until": [], "max_gen_toks": 2, "no_such_option": 1}, "no_such_option"),
        ({"top_p": 0.0, "do_sample": True, "temperature": 1}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": "abc"}, "top_p"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"do_sample": "maybe"}, "do_sample"),
        ({"num_beams": 4}, "num_beams"),
        ({"repetition_penalty": 1.2}, "repetition_penalty"),
        ({"min_p": 0.05}, "min_p"),
        ({"max_gen_toks": "lots"}, "max_gen_toks"),
        ({"until": [3]}, "until"),
    ],
)
def test_bad_gen_kwargs_are_one_line_errors_naming_the_key(kwargs: dict, key: str) -> None:
    with pytest.raises(OptionError) as info:
        parse_gen_kwargs(kwargs, 256)
    message = str(info.value)
    assert key in message and "\n" not in message


def test_lm_eval_task_generation_kwargs_are_accepted() -> None:
    """Every ``generation_kwargs`` block of the installed lm-eval's own task configs parses
    (0.4.9 ships 285 of them, 0.4.13 more), except a value we cannot honour (code_x_glue's beam search, ``num_beams: 10``): real tasks are not
    refused, and nothing is dropped silently."""
    import lm_eval
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("", lambda loader, suffix, node: None)  # !function and co.
    refused, checked = {}, 0
    for path in sorted((Path(lm_eval.__file__).parent / "tasks").rglob("*")):
        if not (path.suffix == ".yaml" or path.name.endswith("_yaml")) or not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="ignore")
        if "generation_kwargs" not in text:
            continue
        config = yaml.load(text, Loader=Loader)
        if not isinstance(config, dict) or not isinstance(config.get("generation_kwargs"), dict):
            continue
        checked += 1
        try:
            parse_gen_kwargs(config["generation_kwargs"], 256)
        except OptionError as exc:
            refused[path.parent.name + "/" + path.name] = str(exc)
    assert checked > 250
    # code_x_glue's beam search: one shared template in 0.4.13, one file per language in 0.4.9
    assert refused and all(name.startswith("code-text/") for name in refused), refused
    assert all("num_beams=10" in message for message in refused.values())


def test_requests_are_checked_before_the_first_forward(
    tiny_bpe_dir: Path, tiny_sp_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lm = make_lm(tiny_bpe_dir, tiny_sp_dir)

    def no_forward(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a forward pass ran before every request was checked")

    monkeypatch.setattr("lm_eval_safe.engines.hf.batch.MemberBatch.forward", no_forward)
    good = gen_request("the cat", until=[], max_gen_toks=2, do_sample=True, temperature=0.5)
    bad = gen_request("the cat", until=[], max_gen_toks=2, no_such_option=1)
    with pytest.raises(RequestError, match="^request 2: unknown generation kwarg 'no_such_option'"):
        lm.generate_until([good, good, bad], disable_tqdm=True)


# -- greedy is untouched ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("schedule", "aggregator"), [("safe", "gac"), ("safe", "unite"), ("every", "unite")]
)
def test_temperature_zero_and_do_sample_false_are_greedy(
    tiny_bpe_dir: Path, tiny_sp_dir: Path, schedule: str, aggregator: str
) -> None:
    prompts = random_prompts(2, seed=31)
    texts = {}
    for name, kwargs in {
        "plain": {},
        "temperature=0": {"temperature": 0.0},
        "do_sample=False": {"do_sample": False, "temperature": 0.9, "top_k": 3, "top_p": 0.5},
        "do_sample=True,temperature=0": {"do_sample": True, "temperature": 0},
    }.items():
        lm = make_lm(tiny_bpe_dir, tiny_sp_dir, schedule=schedule, aggregator=aggregator, seed=3)
        requests = [gen_request(p, until=[], max_gen_toks=12, **kwargs) for p in prompts]
        texts[name] = lm.generate_until(requests, disable_tqdm=True)
        assert lm.run_stats.sampled_requests == 0
    assert len(set(texts["plain"])) > 1
    for name, got in texts.items():
        assert got == texts["plain"], name
