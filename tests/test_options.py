"""The ``members=`` grammar and option validation, including lm-eval's CLI parser after the hook."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lm_eval_safe.errors import OptionError
from lm_eval_safe.harness.model import SafeEnsembleLM
from lm_eval_safe.model_args import parse_model_args, stable_run_name
from lm_eval_safe.options import parse_options

GRAMMAR = [
    ("members=a,b", {"members": "a,b"}),
    ("members=a,b,drafter=b,dtype=float32", {"members": "a,b", "drafter": "b", "dtype": "float32"}),
    ("members=a|b|c,schedule=every", {"members": "a|b|c", "schedule": "every"}),
    ('members=["a","b"],top_k=5', {"members": '["a","b"]', "top_k": "5"}),
    ('{"members": ["a", "b"], "draft_len": 3}', {"members": ["a", "b"], "draft_len": 3}),
    ("members=/x/y.gguf,org/model", {"members": "/x/y.gguf,org/model"}),
]


@pytest.mark.parametrize(("text", "expected"), GRAMMAR)
def test_arg_string_grammar(text: str, expected: dict) -> None:
    assert parse_model_args(text) == expected


@pytest.mark.parametrize(
    ("members", "expected"),
    [
        ("a,b", ["a", "b"]),
        ("a|b", ["a", "b"]),
        (["a", "b"], ["a", "b"]),
        ('["a", "b"]', ["a", "b"]),
        ("['a', 'b']", ["a", "b"]),
        (" a , b ", ["a", "b"]),
        ("a", ["a"]),
    ],
)
def test_members_forms(members: object, expected: list[str]) -> None:
    assert parse_options({"members": members}).members == expected


def test_lm_eval_plain_parser_dict_is_folded_back() -> None:
    """lm-eval's own string parser turns members=a,b into {'members': 'a', 'b': ''}."""
    from lm_eval.utils import simple_parse_args_string

    broken = simple_parse_args_string("members=a,b,drafter=b")
    assert broken == {"members": "a", "b": "", "drafter": "b"}
    captured = {}

    class Probe(SafeEnsembleLM):
        def __init__(self, **kwargs):  # noqa: D401 - capture instead of loading models
            captured.update(kwargs)

    Probe.create_from_arg_obj(broken, {"device": "cpu", "batch_size": "4", "max_batch_size": None})
    assert captured == {"members": "a,b", "drafter": "b", "device": "cpu", "batch_size": "4"}


def test_model_args_win_over_cli_device() -> None:
    captured = {}

    class Probe(SafeEnsembleLM):
        def __init__(self, **kwargs):
            captured.update(kwargs)

    Probe.create_from_arg_string("members=a,b,device=cpu", {"device": "cuda:0", "batch_size": 1})
    assert captured["device"] == "cpu" and captured["batch_size"] == 1


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        ({}, "needs members="),
        ({"members": ""}, "needs members="),
        ({"members": "a,b", "bogus": 1}, "unknown model_args key(s) 'bogus'"),
        ({"members": "a,b", "schedule": "sometimes"}, "unknown schedule='sometimes'"),
        ({"members": "a,b", "aggregator": "max"}, "unknown aggregator"),
        ({"members": "a,b", "sharpen": "x"}, "unknown sharpen"),
        ({"members": "a,b", "draft_len": 0}, "draft_len=0 must be at least 1"),
        ({"members": "a,b", "weights": "1"}, "weights has 1 values for 2 members"),
        ({"members": "a,b", "weights": "1,-1"}, "must be non-negative"),
        ({"members": "a,b", "drafter": "c"}, "drafter='c' names no member"),
        ({"members": "a,b", "drafter": "5"}, "out of range"),
        ({"members": "a,b", "top_k": "x"}, "top_k='x' must be a int"),
        ({"members": "a,b", "member_devices": "cpu"}, "member_devices has 1 entries"),
        ({"members": "a", "batch_size": "abc"}, "batch_size='abc' is not a batch size"),
        ({"members": "a", "batch_size": "0"}, "batch_size='0' must be at least 1"),
        ({"members": "a", "batch_size": 0}, "batch_size=0 must be at least 1"),
        ({"members": "a", "batch_size": "-2"}, "batch_size='-2' must be at least 1"),
        ({"members": "a", "batch_size": "2.5"}, "batch_size='2.5' is not a batch size"),
        ({"members": "a", "batch_size": 2.5}, "batch_size=2.5 is not a batch size"),
        ({"members": "a", "batch_size": "auto:0"}, "the N of auto:N must be a positive integer"),
        ({"members": "a", "batch_size": "auto:x"}, "the N of auto:N must be a positive integer"),
        ({"members": "a", "batch_size": "automatic"}, "is not a batch size"),
        ({"members": "a", "max_batch_size": "0"}, "max_batch_size=0 must be at least 1"),
        ({"members": "a", "seed": "abc"}, "seed='abc' must be a whole number"),
        ({"members": "a", "seed": 1.5}, "seed=1.5 must be a whole number"),
        ({"members": "a", "seed": True}, "seed=True must be a whole number"),
        ({"members": "a,b", "engine": "sglang"}, "unknown engine='sglang'; choose one of: hf, vllm"),
        ({"members": "a,b", "engines": "vllm"}, "engines has 1 entries for 2 members"),
        ({"members": "a,b", "engines": "vllm,tpu"}, "unknown engines entry='tpu'"),
        ({"members": "a,b", "engine": "vllm", "engines": "vllm,hf"}, "give engine= (every member) or engines="),
        ({"members": "a,b", "engine": "vllm", "overlap": "on"}, "drop overlap=on"),
        ({"members": "a,b", "engine": "vllm", "top_logprobs": 5}, "top_logprobs=5 is below top_k=10"),
        ({"members": "a,b", "engine": "vllm", "max_model_len": 99, "max_length": 99}, "not both"),
        ({"members": "a,b", "gpu_memory_utilization": 0.5}, "unknown model_args key(s) 'gpu_memory_utilization'"),
    ],
)
def test_bad_options_fail_in_one_line(raw: dict, fragment: str) -> None:
    with pytest.raises(OptionError) as info:
        parse_options(raw)
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("value", "expected"),
    [("4", 4), (8, 8), (" 16 ", 16), ("auto", "auto"), ("AUTO", "auto"), ("auto:4", "auto")],
)
def test_batch_size_forms(value: object, expected: object) -> None:
    """``auto:N`` is lm-eval's syntax (re-measure N times); ``auto`` sizes every batch anyway."""
    assert parse_options({"members": "a", "batch_size": value}).batch_size == expected


def test_vllm_arguments_are_kept_for_the_vllm_members() -> None:
    """Keys safe-ensemble does not know are vLLM's when a member runs on vLLM (checked against
    the installed vLLM when the model is built); lm-eval vllm's names map to vLLM's."""
    opts = parse_options(
        {"members": "a,b", "engines": "vllm,hf", "gpu_memory_utilization": "0.4", "max_model_len": "512", "max_batch_size": "16"}
    )
    assert opts.member_engines() == ["vllm", "hf"]
    assert opts.engine_args == {"gpu_memory_utilization": "0.4", "max_num_seqs": "16"}
    assert opts.max_length == 512 and opts.max_batch_size == 16


def test_engine_vllm_without_vllm_says_the_command(monkeypatch, tiny_bpe_dir, tiny_sp_dir) -> None:
    import importlib.util

    from helpers import make_lm

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(OptionError, match=r"^engine=vllm needs vLLM, which is not installed here: pip install 'lm-eval-safe\[vllm\]' \(GPU machines\), or bash scripts/setup.sh --vllm"):
        make_lm(tiny_bpe_dir, tiny_sp_dir, engine="vllm")


def test_batch_size_errors_say_what_to_type() -> None:
    with pytest.raises(OptionError, match="give a positive integer, auto or auto:N$"):
        parse_options({"members": "a", "batch_size": "-2"})


def test_seed_option() -> None:
    assert parse_options({"members": "a"}).seed is None  # lm-eval's torch seed decides
    assert parse_options({"members": "a", "seed": "1234"}).seed == 1234
    assert parse_options({"members": "a", "seed": -7}).seed == -7


def test_drafter_by_name_and_index() -> None:
    from lm_eval_safe.model_args import resolve_drafter_index

    assert resolve_drafter_index("b", ["x/a", "x/b"]) == 1
    assert resolve_drafter_index("1", ["a", "b"]) == 1
    assert resolve_drafter_index(None, ["a", "b"]) == 0
    assert resolve_drafter_index("m", ["/p/m.gguf", "q"]) == 0


@pytest.mark.parametrize(
    ("members", "first", "second", "name"),
    [
        ("smollm2-135m,ollama:smollm2:135m", "smollm2-135m", "ollama:smollm2:135m", "smollm2-135m"),
        ("a/model,b/model", "a/model", "b/model", "model"),
        ("/p/Tiny.gguf,lmstudio:pub/Repo/tiny.gguf", "/p/Tiny.gguf", "lmstudio:pub/Repo/tiny.gguf", "tiny"),
        ("hf:org/Repo:Q8_0,lmstudio:pub/x/Repo-Q8_0", "hf:org/Repo:Q8_0", "lmstudio:pub/x/Repo-Q8_0", "Repo-Q8_0"),
    ],
)
def test_one_display_name_one_member(members: str, first: str, second: str, name: str) -> None:
    """Results, traces, run folders and drafter= name members by their display name: two
    different members under one name (in any case) are refused before anything loads."""
    with pytest.raises(OptionError) as raised:
        parse_options({"members": members, "drafter": name})
    assert str(raised.value) == (
        f"members {first!r} and {second!r} would both be called {name!r} (in results, traces, run "
        "folders and drafter=): list each model once, or give one as a file or folder of another name"
    )


def test_one_member_twice_takes_the_drafter_by_index() -> None:
    """The same spec twice is one model twice (an ensemble of a model with itself): allowed, but
    drafter= by its name would be ambiguous."""
    assert parse_options({"members": "x/m,x/m"}).members == ["x/m", "x/m"]
    assert parse_options({"members": "x/m,x/m", "drafter": "1"}).drafter == "1"
    with pytest.raises(OptionError, match=r"^drafter='m' names members 0, 1; give the index of the one to draft, e\.g\. drafter=0$"):
        parse_options({"members": "x/m,x/m", "drafter": "m"})


def test_unknown_member_and_missing_file() -> None:
    from lm_eval_safe.members.sources import resolve_source

    with pytest.raises(OptionError, match="unknown member 'nosuchmodel'.*alias"):
        resolve_source("nosuchmodel")
    with pytest.raises(OptionError, match="no such .gguf file"):
        resolve_source("/nonexistent/model.gguf")


def test_stable_run_name() -> None:
    assert stable_run_name("members=a,b,schedule=every") == "safe-ensemble__a+b__drafter-a__every-unite"
    assert stable_run_name({"members": "x/m1|x/m2", "drafter": "m2"}) == (
        "safe-ensemble__m1+m2__drafter-m2__safe-unite"
    )
    assert stable_run_name({"members": "m1"}) == "safe-ensemble__m1"
    assert stable_run_name({"pretrained": "gpt2"}) is None


def test_hook_keeps_builtins_and_patches_cli_in_fresh_process() -> None:
    """The .pth hook registers safe-ensemble lazily without hiding lm-eval's own models, and
    names output folders; lm-eval 0.4.10+'s CLI parser takes ``members=a,b`` after the hook
    (0.4.9 has no such parser: its CLI hands the string to the model, see test_cli.py)."""
    code = (
        "import importlib.util, sys\n"
        "from lm_eval.api.registry import get_model\n"
        "lazy = importlib.util.find_spec('lm_eval._cli') is not None  # lm-eval 0.4.10+\n"
        "# lm-eval 0.4.9's registry module imports torch itself; 0.4.10+ registers lazily\n"
        "assert not lazy or 'torch' not in sys.modules, 'registration must not import torch'\n"
        "assert get_model('hf').__name__ == 'HFLM'\n"
        "assert get_model('safe-ensemble').__name__ == 'SafeEnsembleLM'\n"
        "from lm_eval.loggers.evaluation_tracker import GeneralConfigTracker as G\n"
        "print(G._get_model_name('members=a,b'), G._get_model_name('pretrained=gpt2'))\n"
        "if lazy:\n"
        "    from lm_eval._cli.utils import key_val_to_dict\n"
        "    print(key_val_to_dict('members=a,b,drafter=b,dtype=float32'))\n"
        "    print(G._get_model_name({'members': 'a,b'}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    assert lines[0] == "safe-ensemble__a+b__drafter-a__safe-unite gpt2"
    from importlib.metadata import version

    from packaging.version import Version

    if Version(version("lm-eval")) >= Version("0.4.10"):
        assert lines[1:] == [
            "{'members': 'a,b', 'drafter': 'b', 'dtype': 'float32'}",
            "safe-ensemble__a+b__drafter-a__safe-unite",
        ]
    else:
        assert lines[1:] == []


def test_unrelated_interpreter_does_not_import_lm_eval() -> None:
    code = "import sys; print(sorted(m for m in sys.modules if m.startswith(('lm_eval', 'torch'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['lm_eval_safe', 'lm_eval_safe._autoregister']"
