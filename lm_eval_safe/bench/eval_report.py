"""The markdown tables of ``lm-eval-safe bench eval``'s report (whole evaluation runs side by
side): wall times and their ratios, what each safe-ensemble run cost per generated token, and
the ensemble against its floor."""

from __future__ import annotations

import statistics
from typing import Any

from lm_eval_safe.bench.output import fmt


def markdown(report: dict[str, Any], labels: dict[str, str], base: str) -> str:
    """``labels``: every run a report may hold (in the order of the tables) and its name in
    them; ``base``: the run the wall times are compared with (an lm-eval backend's)."""
    lines = [
        f"`{report['command']}`",
        "",
        f"{report['machine']}; tasks {', '.join(report['tasks'])}, {report['limit']} documents each, "
        f"batch {report['batch_size']}, max_gen_toks {report['max_gen_toks']}; members {', '.join(report['members'])} "
        f"({report['ensemble_args'] or 'defaults'})",
        "",
        f"| run | wall s (median) | vs {labels[base]} | vs safe-ensemble alone |",
        "|---|---:|---:|---:|",
    ]
    walls = report["wall_seconds"]
    for name in labels:
        if not walls.get(name):
            continue
        med = statistics.median(walls[name])
        ref = statistics.median(walls[base]) if walls.get(base) else None
        al = statistics.median(walls["alone"]) if walls.get("alone") else None
        lines.append(f"| {labels[name]} | {med:.1f} | {fmt(med / ref if ref else None)} | {fmt(med / al if al else None)} |")
    costs = [(name, report["safe_stats"][name]) for name in labels if name in report.get("safe_stats", {})]
    if costs:
        lines += [
            "",
            "| run | generated tokens | submitted tokens / token | computed prefill / token | engine calls / token |",
            "|---|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {labels[name]} | {s['generated_tokens']} | {s['submitted_tokens_per_token']:.1f} "
            f"| {s['computed_prefill_per_token']:.2f} | {s['engine_calls_per_token']:.3f} |"
            for name, s in costs
        ]
    if report.get("floor"):
        f = report["floor"]
        reads = "; ".join(
            f"{name} " + ", ".join(f"{seconds:.1f} s at batch {size}" for size, seconds in by_batch.items())
            for name, by_batch in f["verifier_reads_by_batch_size"].items()
        )
        lines += [
            "",
            f"floor: the drafter's run ({labels[f['drafter_run']]}) {1000 * f['drafter_seconds_per_token']:.1f} ms "
            f"per token x the ensemble's {f['ensemble_tokens']} tokens = {f['drafter_seconds']:.1f} s, plus the "
            f"verifiers' reads of its texts {f['verifier_reads_seconds']:.1f} s (the lesser of {reads}): "
            f"{f['floor_seconds']:.1f} s; the ensemble takes **{f['ensemble_over_floor']:.2f}x** its floor",
        ]
    for key in ("alone_responses_equal_hf", "alone_responses_equal_lm_eval_vllm", "ensemble_responses_equal_ensemble_hf"):
        if report.get(key):
            lines += ["", f"{key.replace('_', ' ')}: {report[key][0]}/{report[key][1]}"]
    return "\n".join(lines) + "\n"


def responses(results: dict[str, Any]) -> dict[tuple[str, int], str]:
    """Each (task, document)'s first response, from ``simple_evaluate``'s logged samples."""
    out = {}
    for task, samples in results.get("samples", {}).items():
        for sample in samples:
            out[task, int(sample["doc_id"])] = sample["resps"][0][0]
    return out


def scores(results: dict[str, Any]) -> dict[str, float]:
    """Each task's exact-match value for the report (of several filters, the last one listed)."""
    return {
        task: value
        for task, metrics in results["results"].items()
        for key, value in metrics.items()
        if key.startswith("exact_match") and "stderr" not in key and isinstance(value, float)
    }
