"""One member on ``engine=vllm`` against lm-eval's own ``--model vllm`` on the same checkpoint
and engine arguments: the same greedy responses through lm-eval's pipeline, log-likelihoods
within a tolerance. Shared by ``tests/engines/vllm_engine/test_vllm_against_lm_eval.py`` (CI, CPU) and
``scripts/check_vllm_gpu.py`` (a GPU machine).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def lm_eval_vllm_for(member: Any, batch_size: int | str = "auto") -> Any:
    """lm-eval's ``vllm`` backend on the folder a vLLM member was loaded from, with the same
    engine arguments (those this package sets for its own decoding, ``max_logprobs``, left out)."""
    from lm_eval.models.vllm_causallms import VLLM

    engine = member.engine
    settings = {k: v for k, v in engine.settings.items() if k not in ("model", "max_logprobs")}
    settings["max_model_len"] = engine.max_model_len
    return VLLM(pretrained=engine.settings["model"], batch_size=batch_size, **settings)


def responses(results: dict[str, Any]) -> dict[tuple[str, int], str]:
    return {
        (task, int(s["doc_id"])): s["resps"][0][0]
        for task, samples in results["samples"].items()
        for s in samples
    }


def scoring_requests(data_dir: Path, n: int = 8) -> list[Any]:
    """Loglikelihood requests from the local data: GSM8K questions with their reference's first
    line, BBH navigate questions with both answers, and one with an empty context."""
    from lm_eval.api.instance import Instance

    def request(context: str, continuation: str) -> Instance:
        return Instance(request_type="loglikelihood", doc={}, arguments=(context, continuation), idx=0)

    gsm8k = [json.loads(x) for x in (data_dir / "gsm8k" / "test.jsonl").read_text().splitlines()[:n]]
    navigate = json.loads((data_dir / "bbh" / "tasks" / "navigate.json").read_text())["examples"][: n // 2]
    requests = [request(f"Question: {r['question']}\nAnswer:", " " + r["answer"].split("\n")[0]) for r in gsm8k]
    requests += [request(f"Q: {r['input']}\nA: The answer is", c) for r in navigate for c in (" Yes", " No")]
    requests.append(request("", "The capital of France is Paris."))
    return requests


def compare_with_lm_eval_vllm(
    ours: Any,
    theirs: Any,
    data_dir: Path,
    tasks: tuple[str, ...] = ("safe_gsm8k", "safe_bbh_navigate"),
    limit: int = 8,
    max_gen_toks: int = 48,
) -> dict[str, Any]:
    """Both models through ``lm_eval.simple_evaluate`` on ``tasks`` (``limit`` documents each)
    and :func:`scoring_requests`: the responses that differ and the largest log-likelihood gap."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    import lm_eval_safe

    manager = TaskManager(include_path=lm_eval_safe.task_dir(), metadata={"data_dir": str(data_dir)})
    runs = [
        lm_eval.simple_evaluate(
            model=lm,
            tasks=list(tasks),
            limit=limit,
            task_manager=manager,
            gen_kwargs={"max_gen_toks": max_gen_toks},
            log_samples=True,
            bootstrap_iters=0,
        )
        for lm in (ours, theirs)
    ]
    mine, other = (responses(r) for r in runs)
    requests = scoring_requests(data_dir, limit)
    scores = [lm.loglikelihood(requests, disable_tqdm=True) for lm in (ours, theirs)]
    gaps = [abs(a - b) for (a, _), (b, _) in zip(*scores, strict=True)]
    return {
        "responses": len(mine),
        "different_responses": sorted(k for k in mine if mine[k] != other.get(k)),
        "loglikelihoods": len(requests),
        "largest_loglikelihood_gap": max(gaps),
        "is_greedy_differs": sum(a[1] != b[1] for a, b in zip(*scores, strict=True)),
    }
