"""The default members on llama.cpp inside lm-eval's pipeline, as on the other engines:
``--use_cache`` answers a run again without computing and keeps answers of settings that change
logits apart, ``lm-eval-safe serve`` (a real process on a free port, lm-eval's own API model as
its client) answers what the backend answers directly, and ``safe_stats`` says where the
engine's seconds went. Traces on this engine: tests/decoder/test_tracing.py. Needs llama-cpp-python and
../shared."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest
from helpers import evaluate_gsm8k
from serve_helpers import ServerProcess

pytestmark = [pytest.mark.real, pytest.mark.llama_cpp]

MEMBERS = "members=smollm2-135m,gemma3-270m,engine=llama_cpp"
TASK = "safe_bbh_navigate"
GEN_KWARGS = {"max_gen_toks": 32}


@pytest.fixture(autouse=True)
def _needs(llama_cpp_installed: None, models: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LM_EVAL_SAFE_MODELS", str(models))


def _responses(results: dict) -> list[str]:
    return [s["resps"][0][0] for s in sorted(results["samples"][TASK], key=lambda s: s["doc_id"])]


def _run(shared_dir: Path, model_args: str, **kwargs: Any) -> dict:
    return evaluate_gsm8k(
        shared_dir / "data", model_args, tasks=TASK, limit=3, gen_kwargs=GEN_KWARGS,
        log_samples=True, bootstrap_iters=0, **kwargs,
    )  # fmt: skip


def test_use_cache_answers_again_and_keeps_batch_rows_apart(shared_dir: Path, tmp_path: Path) -> None:
    """A second run on the same ``--use_cache`` path computes nothing and gets the first run's
    answers; ``batch_rows=true`` (rows in one decode: other logits) computes its own, in a table
    of its own; ``safe_stats`` splits the engine's seconds between the members."""
    cache = str(tmp_path / "requests")
    first = _run(shared_dir, MEMBERS, use_cache=cache)
    stats = first["config"]["safe_stats"]
    assert stats["requests"] == 3 and all(_responses(first))
    by_member = stats["engine_seconds_by_member"]
    assert set(by_member) == {"smollm2-135m", "gemma3-270m"} and min(by_member.values()) > 0
    assert abs(sum(by_member.values()) - stats["engine_seconds"]) < 0.01
    again = _run(shared_dir, MEMBERS, use_cache=cache)
    assert again["config"]["safe_stats"]["requests"] == 0
    assert _responses(again) == _responses(first)
    rows = _run(shared_dir, f"{MEMBERS},batch_rows=true,batch_size=3", use_cache=cache)
    assert rows["config"]["safe_stats"]["requests"] == 3
    with sqlite3.connect(f"{cache}_rank0.db") as db:
        tables = {
            name: db.execute(f'SELECT COUNT(*) FROM "{name}"').fetchone()[0]
            for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type='table'")
        }
    tables.pop("unnamed", None)
    assert sorted(tables.values()) == [3, 3]


def test_server_answers_what_the_backend_answers(shared_dir: Path, tmp_path: Path) -> None:
    """lm-eval's ``local-completions`` through ``lm-eval-safe serve`` with the members on
    llama.cpp: the responses and metrics of ``--model safe-ensemble`` run directly."""
    pytest.importorskip("fastapi")
    import lm_eval
    from lm_eval.tasks import TaskManager

    import lm_eval_safe

    with ServerProcess(f"{MEMBERS},batch_size=4", log_dir=tmp_path) as server:
        served = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=(
                f"model=safe-ensemble,base_url={server.url}/v1/completions,"
                "tokenizer_backend=none,tokenized_requests=False"
            ),
            tasks=[TASK],
            task_manager=TaskManager(
                include_path=lm_eval_safe.task_dir(), metadata={"data_dir": str(shared_dir / "data")}
            ),
            limit=3,
            gen_kwargs=GEN_KWARGS,
            log_samples=True,
            bootstrap_iters=0,
        )
    direct = _run(shared_dir, MEMBERS)
    assert _responses(served) == _responses(direct)
    assert served["results"][TASK] == direct["results"][TASK]

