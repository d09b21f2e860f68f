"""Per-method totals and per-token-time ratios of ``lm-eval-safe bench speed``'s runs, and its
markdown table.

Absolute tokens/s on a shared CPU mean little, so the numbers that matter are ratios of
per-token times measured side by side: computed per (prompt, repeat) pair and aggregated as a
median (robust to a burst of load) and as total-time / total-tokens.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from lm_eval_safe.bench.output import fmt
from lm_eval_safe.bench.speed import Run

# (numerator, denominator) pairs the project cares about
PROJECT_RATIOS = [
    # trace=true's cost: the same decoding with every point's candidates and a JSON line each
    ("safe_unite_traced", "safe_unite"),
    ("safe_gac_traced", "safe_gac"),
    ("safe_unite", "floor"),
    ("safe_gac", "floor"),
    ("safe_unite", "hf_generate"),
    ("safe_unite", "every"),
    ("every", "every_nocache"),
    ("safe_unite", "safe_nocache"),
    ("drafter", "hf_generate"),
    ("floor", "hf_generate"),
    # the same against this project's own single-member path (same speed-ups as the ensemble)
    ("safe_gac", "drafter"),
    ("safe_unite", "drafter"),
    ("safe_gac_auto", "drafter"),
    ("safe_unite_auto", "drafter"),
    ("safe_gac", "hf_generate"),
    ("safe_gac_auto", "hf_generate"),
    ("safe_unite_auto", "hf_generate"),
    ("safe_gac", "every"),
    ("safe_unite_auto", "every"),
    ("safe_gac_auto", "every"),
    # overlap=on on this machine's cores, measured (auto leaves it off on CPU)
    ("safe_unite_overlap", "safe_unite"),
    ("safe_gac_overlap", "safe_gac"),
    ("safe_unite_overlap", "drafter"),
    ("safe_gac_overlap", "drafter"),
]

# ratios of the latency model (lm_eval_safe.bench.latency_model): decoder methods only
MODELLED_RATIOS = [
    ("safe_unite", "drafter"),
    ("safe_gac", "drafter"),
    ("safe_unite_auto", "drafter"),
    ("safe_gac_auto", "drafter"),
    ("every", "drafter"),
    ("safe_unite", "every"),
    ("safe_gac", "every"),
]


def modelled(runs: list[Run], methods: list[str]) -> list[dict[str, Any]]:
    """Per pair: the modelled per-token time ratio with the verifiers in turn and overlapped
    (both sides priced alike: the denominator in turn), and each side's forward depth per
    token (every forward counting one)."""

    def per_token(method: str, value: Callable[[Run], float | None]) -> float | None:
        mine = [(r, value(r)) for r in runs if r.method == method and value(r) is not None]
        tokens = sum(r.tokens for r, _ in mine)
        return sum(v for _, v in mine) / tokens if mine and tokens else None

    out = []
    for num, den in MODELLED_RATIOS:
        if num not in methods or den not in methods:
            continue
        base = per_token(den, lambda r: r.modelled_seconds)
        turn = per_token(num, lambda r: r.modelled_seconds)
        over = per_token(num, lambda r: r.modelled_overlapped_seconds)
        if not base or turn is None or over is None:
            continue
        out.append(
            {
                "ratio": f"{num}/{den}",
                "modelled_in_turn": turn / base,
                "modelled_overlapped": over / base,
                "depth_per_token": per_token(num, lambda r: r.extra.get("forward_depth")),
                "depth_per_token_overlapped": per_token(
                    num, lambda r: r.extra.get("forward_depth_overlapped")
                ),
            }
        )
    return out


def summarise(runs: list[Run], methods: list[str]) -> dict[str, dict[str, Any]]:
    """Per method: totals, E/T, acceptance, verifier positions per token and peak memory, and
    its per-token time against ``hf_generate`` on the same (prompt, repeat)."""
    ref = {(r.prompt, r.repeat): r for r in runs if r.method == "hf_generate"}
    summary: dict[str, dict[str, Any]] = {}
    for method in methods:
        mine = [r for r in runs if r.method == method]
        tokens = sum(r.tokens for r in mine)
        seconds = sum(r.seconds for r in mine)
        drafted = sum(r.drafted for r in mine)
        row: dict[str, Any] = {
            "runs": len(mine),
            "tokens": tokens,
            "seconds": seconds,
            "tokens_per_second": tokens / seconds if seconds else 0.0,
            "ms_per_token": 1000 * seconds / tokens if tokens else 0.0,
            "ensemble_rate_percent": 100 * sum(r.ensemble_ops for r in mine) / tokens
            if tokens
            else 0.0,
            "acceptance_rate": sum(r.accepted for r in mine) / drafted if drafted else None,
            "verifier_positions_per_token": sum(r.verifier_positions for r in mine) / tokens
            if tokens
            else 0.0,
            "max_rss_mib_after": max(r.max_rss_mib for r in mine) if mine else 0.0,
            "cuda_peak_mib": max((r.cuda_peak_mib or 0.0) for r in mine)
            if mine and mine[0].cuda_peak_mib is not None
            else None,
        }
        pairs = [(r, ref[(r.prompt, r.repeat)]) for r in mine if (r.prompt, r.repeat) in ref]
        if pairs:
            row["vs_hf_median"] = statistics.median(r.per_token / h.per_token for r, h in pairs)
            ref_tokens = sum(h.tokens for _, h in pairs)
            ref_seconds = sum(h.seconds for _, h in pairs)
            row["vs_hf_total"] = (seconds / max(tokens, 1)) / (ref_seconds / max(ref_tokens, 1))
            row["same_text_as_hf"] = sum(r.text == h.text for r, h in pairs) / len(pairs)
        if method == "floor":
            gen = sum(r.generate_seconds or 0.0 for r in mine)
            row["floor_generate_seconds"] = gen
            row["floor_verify_seconds"] = seconds - gen
        summary[method] = row
    return summary


def ratios(runs: list[Run], methods: list[str]) -> list[dict[str, Any]]:
    """Per-token-time ratios of two methods: median over (prompt, repeat) pairs, and totals."""
    by_key = {(r.method, r.prompt, r.repeat): r for r in runs}
    out = []
    for num, den in PROJECT_RATIOS:
        if num not in methods or den not in methods:
            continue
        per_pair = []
        for (m, p, rep), r in by_key.items():
            if m == num and (den, p, rep) in by_key:
                per_pair.append(r.per_token / by_key[(den, p, rep)].per_token)
        a = [r for r in runs if r.method == num]
        b = [r for r in runs if r.method == den]
        total = (sum(r.seconds for r in a) / max(sum(r.tokens for r in a), 1)) / (
            sum(r.seconds for r in b) / max(sum(r.tokens for r in b), 1)
        )
        out.append(
            {
                "ratio": f"{num}/{den}",
                "median": statistics.median(per_pair) if per_pair else None,
                "total": total,
                "min": min(per_pair) if per_pair else None,
                "max": max(per_pair) if per_pair else None,
            }
        )
    return out


def engine_label(cfg: dict[str, Any]) -> str:
    """The members' engine with its own settings, as ``scripts/bench_speed.py`` records them
    (the engine's name and the settings its spec claims, beside the other configuration): each
    engine's path is its own (the transformers engine's ``fast_small_linear``, llama.cpp's
    ``n_ctx`` and ``batch_rows``), and one engine's setting says nothing of another's. A report
    that names no engine ran on transformers (it was written before engines were recorded)."""
    from lm_eval_safe.engines import engine
    from lm_eval_safe.engines.registry import DEFAULT_ENGINE, engine_names

    name = cfg.get("engine", DEFAULT_ENGINE)
    claimed = engine(name).options if name in engine_names() else {}
    settings = ", ".join(f"{key}={cfg[key]}" for key in claimed if key in cfg)
    return f"engine={name}" + (f" ({settings})" if settings else "")


def markdown(report: dict[str, Any]) -> str:
    """The printed table of a ``bench_speed`` report, with a warning where methods stopped too
    early for their per-token times to mean much."""
    cfg = report["config"]
    lines = [
        f"### bench_speed: {cfg['members']} (drafter {cfg['drafter']}), {cfg['dataset']}, "
        f"{cfg['prompts']} prompt(s) x {cfg['repeats']} repeat(s), max_new_tokens="
        f"{cfg['max_new_tokens']}, draft_len={cfg['draft_len']}, device={cfg['device']}, "
        f"torch threads={cfg['torch_threads']}, shots={cfg.get('shots', 0)}, {engine_label(cfg)}"
        + (", EOS masked (--ignore-eos)" if cfg["ignore_eos"] else ""),
        "",
        "| method | tokens | s | tok/s | t/token vs hf (median) | (total) | E/T % | acceptance "
        "| verifier pos/token | = hf text | max RSS MiB after | CUDA peak MiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for method, row in report["methods"].items():
        lines.append(
            f"| {method} | {row['tokens']} | {fmt(row['seconds'])} | "
            f"{fmt(row['tokens_per_second'])} | {fmt(row.get('vs_hf_median'))} | "
            f"{fmt(row.get('vs_hf_total'))} | {fmt(row['ensemble_rate_percent'])} | "
            f"{fmt(row['acceptance_rate'], 3)} | {fmt(row['verifier_positions_per_token'])} | "
            f"{fmt(row.get('same_text_as_hf'))} | {fmt(row['max_rss_mib_after'], 0)} | "
            f"{fmt(row['cuda_peak_mib'], 0)} |"
        )
    if "floor" in report["methods"]:
        f = report["methods"]["floor"]
        lines += [
            "",
            f"floor = drafter generate {f['floor_generate_seconds']:.2f}s + verifier forwards "
            f"{f['floor_verify_seconds']:.2f}s",
        ]
    if report["ratios"]:
        lines += [
            "",
            "| per-token time ratio | median | total | min | max |",
            "|---|---:|---:|---:|---:|",
        ]
        for r in report["ratios"]:
            lines.append(
                f"| {r['ratio']} | {fmt(r['median'])} | {fmt(r['total'])} | "
                f"{fmt(r['min'])} | {fmt(r['max'])} |"
            )
    short = [
        m
        for m, row in report["methods"].items()
        if row["runs"] and row["tokens"] < 0.5 * row["runs"] * cfg["max_new_tokens"]
    ]
    if short:
        lines += [
            "",
            f"WARNING: {', '.join(short)} stopped (EOS) at under half of max_new_tokens on "
            "average: per-token times of so few tokens are dominated by prefill and fixed "
            "costs. (SmolLM2-Instruct answers a plain-text prompt with <|im_end|> at once, "
            "and as a verifier it pulls the ensemble to EOS: use --ignore-eos for speed.)",
        ]
    if report.get("modelled"):
        lat = report["forward_latency"]
        lines += [
            "",
            "MODEL, not a measurement (lm_eval_safe.bench.latency_model): counted forwards "
            "priced with per-forward latencies measured here ("
            + ", ".join(f"{n} {1000 * v['one_row']:.1f} ms / 1 row, {1000 * v['five_rows']:.1f} ms / 5 rows" for n, v in lat.items())
            + "); overlapped: verifiers on their own devices beside the next draft.",
            "",
            "| modelled per-token ratio | verifiers in turn | overlapped | forwards/token in turn | overlapped |",
            "|---|---:|---:|---:|---:|",
        ]
        for r in report["modelled"]:
            lines.append(
                f"| {r['ratio']} | {fmt(r['modelled_in_turn'])} | {fmt(r['modelled_overlapped'])} | "
                f"{fmt(r['depth_per_token'])} | {fmt(r['depth_per_token_overlapped'])} |"
            )
    u = report["union_vocabulary"]
    lines += [
        "",
        f"union vocabulary ({int(u['union_size'])} strings): token tables "
        f"{u['token_vocab_tables_s']:.2f}s, build uncached {u['union_uncached_s']:.2f}s, "
        f"cached first build (writes) {u['union_cache_write_s']:.2f}s, cached load "
        f"{u['union_cache_load_s']:.2f}s",
        f"member load {report['load_seconds']:.1f}s",
    ]
    return "\n".join(lines) + "\n"
