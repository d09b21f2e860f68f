"""The markdown tables of ``scripts/bench_eval.py``'s report (whole evaluation runs side by
side): wall times and their ratios, then what each safe-ensemble run cost per generated token."""

from __future__ import annotations

import statistics
from typing import Any

from lm_eval_safe.bench.output import fmt

#: Every run a report may hold, in the order of the first round.
RUNS = ("hf", "vllm", "alone", "ensemble", "ensemble_hf")
LABELS = {
    "hf": "lm-eval hf, drafter alone",
    "vllm": "lm-eval vllm, drafter alone",
    "alone": "safe-ensemble, drafter alone",
    "ensemble": "safe-ensemble, ensemble",
    "ensemble_hf": "safe-ensemble, ensemble on transformers",
}


def label(name: str, report: dict[str, Any]) -> str:
    """A run's name in the tables; safe-ensemble's runs on another engine say which."""
    if name in ("alone", "ensemble") and report["engine"] != "hf":
        return f"{LABELS[name]} on {report['engine']}"
    return LABELS[name]


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"`{report['command']}`",
        "",
        f"{report['machine']}; tasks {', '.join(report['tasks'])}, {report['limit']} documents each, "
        f"batch {report['batch_size']}, max_gen_toks {report['max_gen_toks']}; members {', '.join(report['members'])} "
        f"({report['ensemble_args'] or 'defaults'})",
        "",
        f"| run | wall s (median) | vs lm-eval {'vllm' if report['wall_seconds'].get('vllm') else 'hf'} | vs safe-ensemble alone |",
        "|---|---:|---:|---:|",
    ]
    walls = report["wall_seconds"]
    base = "vllm" if walls.get("vllm") else "hf"
    for name in RUNS:
        if not walls.get(name):
            continue
        med = statistics.median(walls[name])
        ref = statistics.median(walls[base]) if walls.get(base) else None
        al = statistics.median(walls["alone"]) if walls.get("alone") else None
        lines.append(f"| {label(name, report)} | {med:.1f} | {fmt(med / ref if ref else None)} | {fmt(med / al if al else None)} |")
    costs = [(name, report["safe_stats"][name]) for name in RUNS if name in report.get("safe_stats", {})]
    if costs:
        lines += [
            "",
            "| run | generated tokens | submitted tokens / token | computed prefill / token | engine calls / token |",
            "|---|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {label(name, report)} | {s['generated_tokens']} | {s['submitted_tokens_per_token']:.1f} "
            f"| {s['computed_prefill_per_token']:.2f} | {s['engine_calls_per_token']:.3f} |"
            for name, s in costs
        ]
    for key in ("alone_responses_equal_hf", "alone_responses_equal_lm_eval_vllm", "ensemble_responses_equal_ensemble_hf"):
        if report.get(key):
            lines += ["", f"{key.replace('_', ' ')}: {report[key][0]}/{report[key][1]}"]
    return "\n".join(lines) + "\n"
