"""The engine registry: engines are found by name, a third one is one folder registered with
:func:`~lm_eval_safe.engines.registry.register` (here :mod:`third_engine`, in the test tree),
and it runs the decoder end to end with no package file knowing its name."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import third_engine
from helpers import REPO, gen_request, make_lm, random_prompts

from lm_eval_safe import engines
from lm_eval_safe.engines.registry import engine_names, register, unregister
from lm_eval_safe.engines.spec import EngineSpec
from lm_eval_safe.errors import OptionError
from lm_eval_safe.options import parse_options

NAME = third_engine.NAME


@pytest.fixture
def third() -> Iterator[str]:
    register(NAME, "third_engine")
    try:
        yield NAME
    finally:
        unregister(NAME)


def test_every_registered_engine_has_a_spec_of_its_name() -> None:
    for name in engine_names():
        spec = engines.engine(name)
        assert isinstance(spec, EngineSpec) and spec.name == name


def test_no_package_file_knows_the_third_engine(third: str) -> None:
    """The layout's rule (no module outside an engine's folder names an engine), run with the
    third engine registered: no package file names it nor imports its module."""
    from test_layout import engines_named_outside_their_folders

    assert third in engine_names()
    assert engines_named_outside_their_folders() == []
    for path in (REPO / "lm_eval_safe").rglob("*.py"):
        assert "third_engine" not in path.read_text(encoding="utf-8"), path


def test_two_engines_claiming_one_key_is_refused_at_registration(third: str) -> None:
    with pytest.raises(ValueError, match="claims n_ctx, already an option of engine 'llama_cpp'"):
        register("fourth", "fourth_engine")
    assert "fourth" not in engine_names()
    keys = [key for spec in engines.engines() for key in spec.options]
    assert len(keys) == len(set(keys))  # the built-in engines and the third share none


def test_a_registered_engine_is_an_option_with_its_own_keys(third: str) -> None:
    opts = parse_options({"members": "a,b", "engines": f"hf,{third}", "third_dtype": "float32"})
    assert opts.member_engines() == ["hf", third]
    assert opts.third_dtype == "float32" and opts.public_dict()["third_dtype"] == "float32"
    assert parse_options({"members": "a"}).third_dtype == "float64"  # every engine's defaults
    with pytest.raises(OptionError, match="float32 or float64"):
        parse_options({"members": "a", "engine": third, "third_dtype": "float16"})
    with pytest.raises(OptionError, match="reads at most 50 ids"):
        parse_options({"members": "a", "engine": third, "top_k": 60})
    parse_options({"members": "a", "top_k": 60})  # checked only where a member runs on it
    with pytest.raises(OptionError, match=f"choose one of: hf, vllm, llama_cpp, {third}$"):
        parse_options({"members": "a", "engine": "sglang"})
    with pytest.raises(OptionError, match="unknown model_args key"):
        parse_options({"members": "a", "engine": third, "gpu_memory_utilization": "0.4"})


def test_an_option_of_an_engine_no_member_runs_on_is_refused(third: str) -> None:
    """It would be silently ignored: refused in one line naming the engine it belongs to."""
    for raw, owner in (
        ({"members": "a", "third_dtype": "float32"}, third),
        ({"members": "a", "n_ctx": "2048"}, "llama_cpp"),
        ({"members": "a", "engine": "llama_cpp", "prefix_cache_mb": "3"}, "hf"),
        ({"members": "a,b", "engines": "hf,vllm", "n_seq_max": "2"}, "llama_cpp"),
    ):
        key = next(k for k in raw if k not in ("members", "engine", "engines"))
        with pytest.raises(OptionError) as info:
            parse_options(raw)
        assert str(info.value).startswith(f"{key}= is an option of engine={owner}, and no member runs on it")
        assert "\n" not in str(info.value)
    assert parse_options({"members": "a,b", "engines": "hf,llama_cpp", "n_ctx": "2048"}).n_ctx == 2048


def test_unregistered_engines_are_gone(third: str) -> None:
    unregister(third)
    with pytest.raises(OptionError, match=f"unknown engine='{third}'"):
        parse_options({"members": "a", "engine": third})
    register(third, "third_engine")


def test_the_third_engines_forward_is_transformers(third: str, tiny_bpe_dir: Path, tiny_sp_dir: Path) -> None:
    """Its own forward against transformers' on the same weights (float64), and a member alone
    on it writing what transformers' ``generate`` writes."""
    import torch
    from helpers import hf_greedy_text
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for folder in (tiny_bpe_dir, tiny_sp_dir):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
        tokenizer = AutoTokenizer.from_pretrained(folder)
        ids = tokenizer(random_prompts(1, seed=8)[0] * 3)["input_ids"]
        with torch.inference_mode():
            expected = model(input_ids=torch.tensor([ids])).logits[0]
        assert float((third_engine.llama_logits(model, ids) - expected).abs().max()) < 1e-9
        lm = make_lm(folder, engine=third)
        for prompt in random_prompts(3, seed=4):
            (text,) = lm.generate_until([gen_request(prompt, until=[], max_gen_toks=16)], disable_tqdm=True)
            assert text == hf_greedy_text(model, tokenizer, prompt, 16)


def test_the_third_engine_decodes_as_the_transformers_engine(
    third: str, tiny_bpe_dir: Path, tiny_sp_dir: Path
) -> None:
    requests = [gen_request(p, until=["\n\n"], max_gen_toks=16) for p in random_prompts(4, seed=3)]
    reference = make_lm(tiny_bpe_dir, tiny_sp_dir, dtype="float64", batch_size=2)
    expected = reference.generate_until(requests, disable_tqdm=True)
    for chosen in ({"engine": third}, {"engines": f"{third},hf"}):
        lm = make_lm(tiny_bpe_dir, tiny_sp_dir, dtype="float64", batch_size="auto", **chosen)
        assert lm.members[0].engine.kind == third
        assert lm.members[0].describe()["engine"] == third
        assert lm.generate_until(requests, disable_tqdm=True) == expected


def test_claimed_keys_are_options_like_the_ensembles() -> None:
    """In the model's info they stand beside the ensemble's options, as fields did."""
    opts = parse_options({"members": "a", "prefix_cache_mb": "3"})
    public = opts.public_dict()
    assert public["prefix_cache_mb"] == 3.0 and public["fast_small_linear"] == "auto"
    assert "engine_options" not in public and opts.prefix_cache_mb == 3.0
    with pytest.raises(AttributeError):
        _ = opts.no_such_option


def test_rows_come_from_each_engine_of_the_members(third: str) -> None:
    """``batch_size=auto`` and the server's rows: the fewest any engine's members hold."""
    from types import SimpleNamespace

    from lm_eval_safe.serve.main import serving_rows

    def on(kind: str) -> SimpleNamespace:
        return SimpleNamespace(engine=SimpleNamespace(kind=kind))

    opts = parse_options({"members": "a,b", "batch_size": "auto", "max_batch_size": "5"})
    assert serving_rows(opts, {}, [on("hf"), on("hf")]) == 5  # transformers: no bound of its own
    assert serving_rows(opts, {}, [on("hf"), on(third)]) == 3
    typed = parse_options({"members": "a", "batch_size": "2"})
    assert serving_rows(typed, {"batch_size": "2"}, [on(third)]) == 2  # a number as typed
    typed.batch_size = 4  # more than the engine serves: its rows, said in one line
    assert serving_rows(typed, {"batch_size": "4"}, [on(third)]) == 3
    assert engines.generation_rows(opts, [on(third)], [("job",)]) == 4
    opts.max_batch_size = 2
    assert engines.generation_rows(opts, [on(third)], [("job",)]) == 2
