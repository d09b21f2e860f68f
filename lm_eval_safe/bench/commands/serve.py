"""The ensemble through ``lm-eval-safe serve`` against the same ensemble called directly, side by
side on one machine: what a client pays for the HTTP server, what concurrent clients gain from
its continuous batching, and whether lm-eval's own API models get the backend's answers.

Three parts, each on chat-templated GSM8K questions (instruct members answer bare prompts with
EOS at once, which would flatter every ratio) or lm-eval's task prompts:

1. **overhead**: the same requests, one at a time, through the server (one client) and through
   ``SafeEnsembleLM.generate_until`` at ``batch_size=1`` in this process (the server stays idle
   meanwhile); ratio of wall times, and whether every text is equal.
2. **batching**: the same requests from ``--clients`` concurrent clients; tokens/s against the
   one client's, and whether every text equals the one client's. The backend's own
   ``batch_size=--clients`` run is printed beside it.
3. **lm-eval**: ``local-chat-completions`` on ``safe_gsm8k`` and ``local-completions`` on a BBH
   subtask (``num_concurrent=--clients``), against ``--model safe-ensemble`` at
   ``batch_size=--clients``: equal responses and metrics.

Example (about 8 minutes on 2 idle CPU cores)::

    .venv/bin/lm-eval-safe bench serve --questions 16 --max-tokens 64 --clients 8 \\
        --json benchmarks/serve/bench_serve.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from lm_eval_safe.bench import commands
from lm_eval_safe.bench.output import fmt, write_json_report
from lm_eval_safe.bench.server import ServerProcess
from lm_eval_safe.cli_options import add_data_dir, add_members, local_data_dir

GSM8K_STOPS = ["\n\nProblem:", "\n\nQuestion:"]


def chat_post(url: str, messages: list[dict], max_tokens: int) -> dict:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stop": GSM8K_STOPS}
    request = urllib.request.Request(
        url + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=3600) as reply:
        return json.loads(reply.read())


def through_server(url: str, conversations: list[list[dict]], max_tokens: int, clients: int) -> dict[str, Any]:
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        replies = list(pool.map(lambda m: chat_post(url, m, max_tokens), conversations))
    wall = time.perf_counter() - start
    tokens = sum(r["usage"]["completion_tokens"] for r in replies)
    return {
        "clients": clients,
        "wall_s": round(wall, 2),
        "tokens": tokens,
        "tokens_per_s": round(tokens / wall, 3),
        "ensemble_ops": sum(r["safe"]["ensemble_ops"] for r in replies),
        "texts": [r["choices"][0]["message"]["content"] for r in replies],
    }


def direct(lm: Any, conversations: list[list[dict]], max_tokens: int, batch_size: int) -> dict[str, Any]:
    from lm_eval.api.instance import Instance

    lm.options.batch_size = batch_size
    requests = [
        Instance("generate_until", {}, (lm.apply_chat_template(m), {"until": GSM8K_STOPS, "max_gen_toks": max_tokens}), i)
        for i, m in enumerate(conversations)
    ]
    before = lm.run_stats.generated_tokens
    start = time.perf_counter()
    texts = lm.generate_until(requests, disable_tqdm=True)
    wall = time.perf_counter() - start
    tokens = lm.run_stats.generated_tokens - before
    return {"batch_size": batch_size, "wall_s": round(wall, 2), "tokens": tokens, "tokens_per_s": round(tokens / wall, 3), "texts": texts}


def responses(results: dict, task: str) -> list[str]:
    return [s["resps"][0][0] for s in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


def lm_eval_part(url: str, members: str, data_dir: Path, limit: int, clients: int, max_tokens: int) -> list[dict]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    import lm_eval_safe

    rows = []
    for api_model, task, chat in (
        ("local-chat-completions", "safe_gsm8k", True),
        ("local-completions", "safe_bbh_date_understanding", False),
    ):
        def run(model: str, model_args: str, task: str = task, chat: bool = chat) -> tuple[dict, float]:
            manager = TaskManager(include_path=lm_eval_safe.task_dir(), metadata={"data_dir": str(data_dir)})
            start = time.perf_counter()
            results = lm_eval.simple_evaluate(
                model=model, model_args=model_args, tasks=[task], task_manager=manager, limit=limit,
                gen_kwargs=f"max_gen_toks={max_tokens}", apply_chat_template=chat, log_samples=True,
            )  # fmt: skip
            return results, time.perf_counter() - start

        endpoint = "chat/completions" if chat else "completions"
        served, served_wall = run(
            api_model,
            f"model=safe-ensemble,base_url={url}/v1/{endpoint},tokenizer_backend=none,"
            f"tokenized_requests=False,num_concurrent={clients}",
        )
        backend, backend_wall = run("safe-ensemble", f"{members},batch_size={clients}")

        a, b = responses(served, task), responses(backend, task)
        rows.append({
            "api_model": api_model, "task": task, "docs": len(a),
            "equal_responses": sum(x == y for x, y in zip(a, b, strict=True)),
            "metric_served": served["results"][task].get("exact_match,none"),
            "metric_backend": backend["results"][task].get("exact_match,none"),
            "wall_served_s": round(served_wall, 1), "wall_backend_s": round(backend_wall, 1),
        })  # fmt: skip
    return rows


def configure(parser: argparse.ArgumentParser) -> None:
    add_members(parser)
    add_data_dir(parser)
    parser.add_argument("--questions", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--lm-eval-limit", type=int, default=8, help="documents per lm-eval task (0: skip part 3)")
    parser.add_argument("--json", type=Path, default=None)


def main(argv: list[str] | None = None) -> int:
    """``lm-eval-safe bench serve`` with a plain argument list."""
    return commands.main("serve", argv)


def run(args: argparse.Namespace) -> int:
    args.data_dir = local_data_dir(args.data_dir, "lm-eval-safe bench serve")
    from lm_eval_safe.harness.model import SafeEnsembleLM

    rows = [json.loads(line) for line in (args.data_dir / "gsm8k" / "test.jsonl").read_text().splitlines()[: args.questions]]
    conversations = [[{"role": "user", "content": row["question"]}] for row in rows]
    members = f"members={args.members}"
    lm = SafeEnsembleLM.create_from_arg_string(members)
    with tempfile.TemporaryDirectory() as logs, ServerProcess(f"{members},batch_size={args.clients}", log_dir=Path(logs)) as server:
        through_server(server.url, conversations[:2], 8, 2)  # warm-up: lazy vocabularies, unions
        direct(lm, conversations[:2], 8, 2)
        one = through_server(server.url, conversations, args.max_tokens, 1)
        alone = direct(lm, conversations, args.max_tokens, 1)
        many = through_server(server.url, conversations, args.max_tokens, args.clients)
        batched = direct(lm, conversations, args.max_tokens, args.clients)
        api = lm_eval_part(server.url, members, args.data_dir, args.lm_eval_limit, args.clients, args.max_tokens) if args.lm_eval_limit else []
    report = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "members": args.members, "questions": len(conversations), "max_tokens": args.max_tokens,
        "overhead": {
            "server_one_client": {k: v for k, v in one.items() if k != "texts"},
            "backend_batch_1": {k: v for k, v in alone.items() if k != "texts"},
            "wall_ratio": round(one["wall_s"] / alone["wall_s"], 3),
            "equal_texts": sum(a == b for a, b in zip(one["texts"], alone["texts"], strict=True)),
        },
        "batching": {
            "server_clients": {k: v for k, v in many.items() if k != "texts"},
            "backend_batched": {k: v for k, v in batched.items() if k != "texts"},
            "throughput_vs_one_client": round(many["tokens_per_s"] / one["tokens_per_s"], 3),
            "equal_to_one_client": sum(a == b for a, b in zip(many["texts"], one["texts"], strict=True)),
            "backend_batched_equal_to_server": sum(a == b for a, b in zip(batched["texts"], many["texts"], strict=True)),
        },
        "lm_eval": api,
    }  # fmt: skip
    n = len(conversations)
    o, b = report["overhead"], report["batching"]
    print(f"overhead: one client {fmt(one['wall_s'])} s, backend batch 1 {fmt(alone['wall_s'])} s: "
          f"ratio {o['wall_ratio']:.3f} (goal <= 1.1); equal texts {o['equal_texts']}/{n}")  # fmt: skip
    print(f"batching: {args.clients} clients {fmt(many['tokens_per_s'])} tok/s vs one client {fmt(one['tokens_per_s'])}: "
          f"{b['throughput_vs_one_client']:.2f}x (goal >= 2.5); equal to one client {b['equal_to_one_client']}/{n}; "
          f"backend batch {args.clients}: {fmt(batched['tokens_per_s'])} tok/s")  # fmt: skip
    for row in api:
        print(f"lm-eval {row['api_model']} {row['task']}: equal responses {row['equal_responses']}/{row['docs']}, "
              f"exact_match served {row['metric_served']} backend {row['metric_backend']}")  # fmt: skip
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_json_report(args.json, report, trailing_newline=True)
    return 0
