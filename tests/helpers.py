"""Small helpers shared by tests: building the LM, requests, and references."""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path
from typing import Any

from lm_eval.api.instance import Instance

from lm_eval_safe.bench.server import free_port

#: the repository's root (tests lie in folders by concept below tests/)
REPO = Path(__file__).resolve().parents[1]

WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "then", "12", "dogs", "ran", "over", "3", "hills", "while", "Anna", "counted", "45", "apples", "in", "the", "garden", "because", "numbers", "like", "7", "and", "8", "sum", "to", "15", "so", "we", "write", "\\frac{1}{2}", "or", "\\boxed{42}", "café", "naïve", "über", "数学", "question", "answer", "total", "clips", "sold"]


# (schedule, aggregator) pairs that together cover every schedule and aggregator
SCHEDULES = [
    ("safe", "gac"),
    ("safe", "unite"),
    ("aligned", "unite"),
    ("every", "unite"),
    ("threshold", "gac"),
    ("drafter", "gac"),
]


def hf_encode(tok: Any, text: str, model_type: str = "llama") -> list[int]:
    """How lm-eval's ``hf`` backend encodes a plain text of a causal LM, in the installed lm-eval:
    0.4.9.x adds special tokens only to a Gemma's texts, 0.4.10+ leaves them to the tokenizer.
    The brute-force references follow it, as the backend must."""
    from importlib.metadata import version

    from packaging.version import Version

    if Version(version("lm-eval")) < Version("0.4.10"):
        return list(tok.encode(text, add_special_tokens="gemma" in model_type))
    return list(tok.encode(text))


def parse_lm_eval_command(argv: list[str]) -> dict[str, Any]:
    """An ``lm_eval ...`` command line as the installed lm-eval's own CLI parses it (0.4.10+:
    ``HarnessCLI``; 0.4.9: the argparse parser of ``lm_eval.__main__``), with its
    ``key=value`` strings turned into dicts as each CLI does before a run: model_args by the
    backend's parser, gen_kwargs and tasks by lm-eval's."""

    from lm_eval_safe.model_args import parse_model_args

    if importlib.util.find_spec("lm_eval._cli") is not None:
        from lm_eval._cli import HarnessCLI

        old_argv, sys.argv = sys.argv, list(argv)
        try:
            args = vars(HarnessCLI().parse_args())
        finally:
            sys.argv = old_argv
    else:
        from lm_eval.__main__ import setup_parser
        from lm_eval.utils import simple_parse_args_string

        args = vars(setup_parser().parse_args(argv[1:]))
        args["gen_kwargs"] = simple_parse_args_string(args["gen_kwargs"])
        args["tasks"] = args["tasks"].split(",") if args["tasks"] else None
    args["model_args"] = parse_model_args(args["model_args"])
    return args


def leaf_tasks(task_manager: Any, names: list[str]) -> dict[str, Any]:
    """The tasks (not groups) that ``names`` load, by task name, through ``get_task_dict``,
    which lm-eval 0.4.9 and 0.4.13 both offer (``TaskManager.load`` is 0.4.13's only)."""
    from lm_eval.tasks import get_task_dict

    found: dict[str, Any] = {}

    def walk(nested: dict) -> None:
        for value in nested.values():
            if isinstance(value, dict):
                walk(value)
            else:
                found[value.config.task] = value

    walk(get_task_dict(names, task_manager))
    return found


def gen_request(context: str, **gen_kwargs: Any) -> Instance:
    return Instance(request_type="generate_until", doc={}, arguments=(context, gen_kwargs), idx=0)


def ll_request(context: str, continuation: str) -> Instance:
    return Instance(request_type="loglikelihood", doc={}, arguments=(context, continuation), idx=0)


def random_prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(n)]


def make_lm(*members: Path | str, **options: Any) -> Any:
    from lm_eval_safe.harness.model import SafeEnsembleLM

    return SafeEnsembleLM(members=[str(m) for m in members], device="cpu", **options)


def hf_greedy_text(model: Any, tokenizer: Any, prompt: str, max_new_tokens: int) -> str:
    """transformers' own greedy decoding, the reference every schedule must reduce to."""
    import torch

    ids = torch.tensor([hf_encode(tokenizer, prompt)])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
    )
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def write_gsm8k(root: Path, rows: list[dict] | None = None) -> Path:
    """A local GSM8K (``<root>/data/gsm8k/test.jsonl``) for ``safe_gsm8k``; returns the data dir."""
    folder = root / "data" / "gsm8k"
    folder.mkdir(parents=True)
    rows = rows or [{"question": "What is 2 plus 3?", "answer": "2+3=5\n#### 5"}] * 2
    (folder / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root / "data"


def evaluate_gsm8k(data: Path, model_args: str, tasks: str = "safe_gsm8k", **kwargs: Any) -> dict:
    """lm-eval's Python entry point on safe_gsm8k (or the comma-separated ``tasks`` reading the
    same data), as a pipeline would call it."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    import lm_eval_safe

    return lm_eval.simple_evaluate(
        model="safe-ensemble",
        model_args=model_args,
        tasks=tasks.split(","),
        task_manager=TaskManager(include_path=lm_eval_safe.task_dir(), metadata={"data_dir": str(data)}),
        device="cpu",
        **kwargs,
    )


def torchrun(processes: int) -> list[str]:
    """The command prefix of a data-parallel run on this machine (lm-eval's launchers)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
            "--master_addr", "127.0.0.1", "--master_port", str(free_port())]  # fmt: skip


def write_apples_gsm8k(data: Path, n: int = 5) -> Path:
    """A local GSM8K of ``n`` short questions for the CLI runs of ``run_gsm8k_cli``."""
    folder = data / "gsm8k"
    folder.mkdir(parents=True)
    questions = [
        {"question": f"Tom has {i} apples and buys {i + 2} more. How many now?", "answer": f"x\n#### {2 * i + 2}"}
        for i in range(n)
    ]
    (folder / "test.jsonl").write_text("".join(json.dumps(q) + "\n" for q in questions))
    return data


def run_gsm8k_cli(prefix: list[str], model_args: str, data_dir: Path, out: Path, timeout: int = 600) -> dict:
    """``<prefix> -m lm_eval --model safe-ensemble`` on 5 safe_gsm8k documents; the results and
    each document's first response."""
    import os
    import subprocess

    repo = REPO
    cmd = [
        *prefix, "-m", "lm_eval",
        "--model", "safe-ensemble",
        "--model_args", model_args, "--gen_kwargs", "max_gen_toks=8",
        "--tasks", "safe_gsm8k",
        "--include_path", str(repo / "tasks"),
        "--metadata", json.dumps({"data_dir": str(data_dir)}),
        "--limit", "5", "--log_samples", "--output_path", str(out),
    ]  # fmt: skip
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=out.parent, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (results,) = out.rglob("results_*.json")
    (samples,) = out.rglob("samples_safe_gsm8k_*.jsonl")
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    return {
        "results": json.loads(results.read_text()),
        # lm-eval pads the shorter rank with a copy of its last request, whose answer it
        # appends to that instance's responses: compare the first response of each document
        "resps": {r["doc_id"]: r["resps"][0][0] for r in rows},
    }


def completed_rows(batch: Any, answers: dict[int, list[Any]], calls: dict[int, Any]) -> dict[int, Any]:
    """The full log-softmax rows behind a transformers batch's answered heads (one Complete per
    row), each head checked against its row first: its ids are the row's most probable (the
    first being ``torch.argmax``), its log-probs the row's own floats, its named ids (the next
    id fed) read from the same row. Returns ``row -> [positions, vocab]`` tensors."""
    import torch

    from lm_eval_safe.engines.base import Complete

    full = batch.run({row: Complete(0, rows) for row, rows in answers.items() if rows})
    out = {}
    for row, heads in answers.items():
        rows = full.get(row, [])
        for head, logprobs, i in zip(heads, rows, calls[row].want, strict=True):
            assert head.ids[0] == int(torch.argmax(logprobs))
            assert head.logprobs == [float(logprobs[t]) for t in head.ids]
            assert head.logprobs == sorted(head.logprobs, reverse=True)
            assert all(float(logprobs[t]) == lp for t, lp in head.known.items())
            ceiling = head.logprobs[-1]
            outside = logprobs.clone()
            outside[head.ids] = -float("inf")
            assert float(outside.max()) <= ceiling
            if i + 1 < len(calls[row].ids):
                assert calls[row].ids[i + 1] in head.known
        out[row] = torch.stack(rows) if rows else torch.empty((0, 0))
    return out


def as_full(row: Any) -> Any:
    """A transformers engine's answered position as its full log-softmax row (a head is read
    from the device row it was cut from)."""
    import torch

    from lm_eval_safe.engines.hf.heads import full_rows

    return row if isinstance(row, torch.Tensor) else full_rows([row])[0]
