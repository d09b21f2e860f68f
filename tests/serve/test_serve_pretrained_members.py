"""The server with the real members (SmolLM2-135M drafting, Gemma-3-270M verifying) on a few
GSM8K and BBH questions: lm-eval's own API models and the openai client get the answers and
metrics of ``--model safe-ensemble`` run directly. Needs ../shared (CI has it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers import gen_request
from serve_helpers import ServerProcess

pytestmark = pytest.mark.real
pytest.importorskip("fastapi")

MEMBERS = "members=smollm2-135m,gemma3-270m"
BBH_TASK = "safe_bbh_boolean_expressions"


@pytest.fixture(scope="module")
def server(models: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    with ServerProcess(f"{MEMBERS},batch_size=4", log_dir=tmp_path_factory.mktemp("serve_real")) as process:
        yield process


def _evaluate(model: str, model_args: str, task: str, shared_dir: Path, chat: bool) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    import lm_eval_safe

    manager = TaskManager(include_path=lm_eval_safe.task_dir(), metadata={"data_dir": str(shared_dir / "data")})
    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[task],
        task_manager=manager,
        limit=2,
        gen_kwargs="max_gen_toks=40",
        apply_chat_template=chat,
        log_samples=True,
    )


def _responses(results: dict, task: str) -> list[str]:
    return [s["resps"][0][0] for s in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


@pytest.mark.parametrize(
    ("api_model", "task", "chat"),
    [("local-chat-completions", "safe_gsm8k", True), ("local-completions", BBH_TASK, False)],
)
def test_lm_eval_through_the_server_equals_the_backend(
    server: Any, shared_dir: Path, api_model: str, task: str, chat: bool
) -> None:
    endpoint = "chat/completions" if chat else "completions"
    served = _evaluate(
        api_model,
        f"model=safe-ensemble,base_url={server.url}/v1/{endpoint},tokenizer_backend=none,tokenized_requests=False",
        task,
        shared_dir,
        chat,
    )
    direct = _evaluate("safe-ensemble", MEMBERS, task, shared_dir, chat)
    assert _responses(served, task) == _responses(direct, task)
    assert all(_responses(direct, task))  # real answers, not empty ones
    assert served["results"][task] == direct["results"][task]


def test_openai_client_chat_equals_the_backend(server: Any, shared_dir: Path) -> None:
    openai = pytest.importorskip("openai")
    from lm_eval_safe.harness.model import SafeEnsembleLM

    question = json.loads((shared_dir / "data" / "gsm8k" / "test.jsonl").read_text().splitlines()[0])["question"]
    messages = [{"role": "user", "content": question}]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    out = client.chat.completions.create(model="safe-ensemble", messages=messages, max_tokens=48, temperature=0)
    lm = SafeEnsembleLM(members="smollm2-135m,gemma3-270m", device="cpu")
    (expected,) = lm.generate_until([gen_request(lm.apply_chat_template(messages), until=[], max_gen_toks=48)], disable_tqdm=True)
    assert out.choices[0].message.content == expected
    safe = out.model_dump()["safe"]
    assert safe["generated_tokens"] == out.usage.completion_tokens > 0
