"""The real members named by their stores (Ollama, a hub cache repository, a split one among
them, LM Studio) give the same greedy text as their files by path on llama.cpp and transformers,
and run as members through lm-eval (traces, the report, ``--use_cache``) and the server.
The stores link to the fetched files (tests/store_builders.py); nothing is copied but the split.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from store_builders import hf_store, link, ollama_store, split_in_two

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def real_stores(tmp_path_factory: pytest.TempPathFactory, real_models_dir: Path) -> dict[str, Any]:
    """SmolLM2 and Gemma-3 in each store (links to the fetched files, no copies), SmolLM2 also
    split in two parts in a hub repository beside a vision projector."""
    from lm_eval_safe.members.aliases import ALIASES

    root = tmp_path_factory.mktemp("real-stores")
    smol = real_models_dir / ALIASES["smollm2-135m"].file
    gemma = real_models_dir / ALIASES["gemma3-270m"].file
    ollama_store(root / "ollama", "smollm2", smol, tag="135m")
    ollama_store(root / "ollama", "gemma3", gemma, tag="270m")
    hf_store(root / "hub", "test/SmolLM2-135M-Instruct-GGUF", {"SmolLM2-135M-Instruct-Q4_1.gguf": smol})
    parts = split_in_two(smol, root / "split", "smollm2-Q4_1")
    hf_store(root / "hub", "test/SmolLM2-split-GGUF", {
        **{f"smollm2-Q4_1-{i:05d}-of-00002.gguf": p for i, p in enumerate(parts, 1)},
        "mmproj-smollm2-f16.gguf": smol,
    })  # fmt: skip
    link(smol, root / "lmstudio" / "models" / "test" / "SmolLM2-GGUF" / "smollm2-135m-instruct-Q4_1.gguf")
    link(gemma, root / "lmstudio" / "models" / "test" / "gemma-3-270m-GGUF" / "gemma-3-270m-Q4_K_M.gguf")
    return {"root": root, "smol": smol, "gemma": gemma}


@pytest.fixture
def in_stores(real_stores: dict[str, Any], models: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The real stores as this machine's: Ollama's, the hub cache and LM Studio's folder."""
    from lm_eval_safe.disk_cache import cache_root

    root = real_stores["root"]
    monkeypatch.setenv("LM_EVAL_SAFE_CACHE", str(cache_root()))  # the real cache, whatever HOME is
    monkeypatch.setenv("OLLAMA_MODELS", str(root / "ollama"))
    monkeypatch.setenv("HF_HUB_CACHE", str(root / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    home = root / "home"
    home.mkdir(exist_ok=True)
    (home / ".lmstudio-home-pointer").write_text(str(root / "lmstudio"))
    monkeypatch.setenv("HOME", str(home))
    return real_stores


SMOL_NAMES = (
    "ollama:smollm2:135m",
    "hf:test/SmolLM2-135M-Instruct-GGUF",
    "hf:test/SmolLM2-split-GGUF:q4_1",
    "lmstudio:test/SmolLM2-GGUF",
)
PROMPT = "The capital of France is"


def _greedy(spec: str, engine: str) -> str:
    from helpers import gen_request, make_lm

    lm = make_lm(spec, engine=engine)
    (text,) = lm.generate_until([gen_request(PROMPT, until=["\n\n"], max_gen_toks=12)])
    return text


@pytest.mark.llama_cpp
def test_every_name_gives_the_files_greedy_text_on_llama_cpp(in_stores: dict[str, Any], llama_cpp_installed: None) -> None:
    """Each store's name of SmolLM2 (a split one among them, whose parts llama.cpp finds beside
    the first) loads the same bytes as the file by path: the same greedy text."""
    reference = _greedy(str(in_stores["smol"]), "llama_cpp")
    assert reference.strip()
    assert {spec: _greedy(spec, "llama_cpp") for spec in SMOL_NAMES} == dict.fromkeys(SMOL_NAMES, reference)


def test_store_names_give_the_files_greedy_text_on_transformers(in_stores: dict[str, Any]) -> None:
    """On the transformers engine too: an Ollama blob (a file without the .gguf suffix) and a
    split model (joined for transformers, then de-quantized once into the cache)."""
    reference = _greedy(str(in_stores["smol"]), "hf")
    assert reference.strip()
    specs = ("ollama:smollm2:135m", "hf:test/SmolLM2-split-GGUF:Q4_1")
    assert {spec: _greedy(spec, "hf") for spec in specs} == dict.fromkeys(specs, reference)


@pytest.mark.llama_cpp
def test_store_members_through_lm_eval_traces_report_and_use_cache(
    in_stores: dict[str, Any], llama_cpp_installed: None, tmp_path: Path
) -> None:
    """SmolLM2 from Ollama and Gemma-3 from LM Studio, ensembled on llama.cpp through lm-eval:
    the answers of the same files named as aliases; traced, read back by the report, and kept by
    ``--use_cache`` in a table of their own, answered again from it, also to the aliases (a
    member is its file's content, whatever names it)."""
    import sqlite3

    from helpers import evaluate_gsm8k, write_apples_gsm8k
    from lm_eval.loggers import EvaluationTracker

    from lm_eval_safe.leaderboard.html_report import write_report
    from lm_eval_safe.leaderboard.runs import read_runs

    data = write_apples_gsm8k(tmp_path / "data", n=2)

    def run(members: str, **kwargs: Any) -> dict:
        return evaluate_gsm8k(data, f"members={members},engine=llama_cpp", gen_kwargs={"max_gen_toks": 16}, apply_chat_template=True,
                              log_samples=True, bootstrap_iters=0, **kwargs)  # fmt: skip

    def texts(results: dict) -> list[str]:
        return [s["resps"][0][0] for s in sorted(results["samples"]["safe_gsm8k"], key=lambda s: s["doc_id"])]

    aliases = run("smollm2-135m,gemma3-270m")
    stored = "ollama:smollm2:135m,lmstudio:test/gemma-3-270m-GGUF"
    tracker = EvaluationTracker(output_path=str(tmp_path / "out"))
    cache = str(tmp_path / "requests")
    traced = run(f"{stored},trace=true", use_cache=cache, evaluation_tracker=tracker)
    assert texts(traced) == texts(aliases) and all(texts(aliases))
    members = traced["config"]["safe_stats"]["engine_seconds_by_member"]
    assert set(members) == {"smollm2-135m", "gemma-3-270m-GGUF"}
    tracker.save_results_aggregated(results=traced, samples=traced["samples"])
    tracker.save_results_samples(task_name="safe_gsm8k", samples=traced["samples"]["safe_gsm8k"])
    (report_run,) = read_runs([tmp_path / "out"])
    assert report_run.traced and "smollm2-135m" in report_run.config
    assert report_run.config in write_report([tmp_path / "out"], tmp_path / "report.html").read_text()
    again = run(f"{stored},trace=true", use_cache=cache)
    assert again["config"]["safe_stats"]["requests"] == 0 and texts(again) == texts(aliases)
    named = run("smollm2-135m,gemma3-270m", use_cache=cache)  # the same files as aliases: one table
    assert named["config"]["safe_stats"]["requests"] == 0 and texts(named) == texts(aliases)
    with sqlite3.connect(f"{cache}_rank0.db") as db:
        tables = [name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type='table'") if name != "unnamed"]
    assert len(tables) == 1 and tables[0].startswith("safe-ensemble-")


@pytest.mark.llama_cpp
def test_store_members_behind_the_server(in_stores: dict[str, Any], llama_cpp_installed: None, tmp_path: Path) -> None:
    """``lm-eval-safe serve`` with members named by their stores answers a chat as the same
    files named as aliases answer it in-process."""
    pytest.importorskip("fastapi")
    from helpers import gen_request
    from serve_helpers import ServerProcess, post

    from lm_eval_safe.harness.model import SafeEnsembleLM

    messages = [{"role": "user", "content": "Tom has 3 apples and buys 5 more. How many apples does he have?"}]
    with ServerProcess("members=ollama:smollm2:135m,lmstudio:test/gemma-3-270m-GGUF,engine=llama_cpp", log_dir=tmp_path) as server:
        status, body = post(server.url + "/v1/chat/completions",
                            {"model": "safe-ensemble", "messages": messages, "max_tokens": 16, "temperature": 0})  # fmt: skip
    assert status == 200, body
    lm = SafeEnsembleLM(members="smollm2-135m,gemma3-270m", engine="llama_cpp", device="cpu")
    (expected,) = lm.generate_until([gen_request(lm.apply_chat_template(messages), until=[], max_gen_toks=16)], disable_tqdm=True)
    assert body["choices"][0]["message"]["content"] == expected != ""
