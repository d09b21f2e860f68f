#!/usr/bin/env python3
"""Per-subject and per-level breakdown of a ``safe_math500`` run.

lm-eval only aggregates over the whole task; the paper-style analysis needs
accuracy by MATH subject and difficulty level.  Each logged sample carries its
doc (``subject``, ``level``) and the per-sample metrics, so the breakdown is a
pure function of the ``--log_samples`` output:

    lm_eval ... --tasks safe_math500 --log_samples --output_path out/
    python scripts/math500_breakdown.py out/<model>/samples_safe_math500_*.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

METRICS = ("math_equiv", "exact_match")


def load_samples(paths: list[Path]) -> list[dict]:
    """Read lm-eval samples jsonl files (one JSON object per line)."""
    rows = []
    for path in paths:
        with path.open(encoding="utf-8") as fh:
            rows.extend(json.loads(line) for line in fh if line.strip())
    return rows


def breakdown(samples: list[dict], key: str) -> dict[str, dict[str, float]]:
    """Mean of each metric per value of ``doc[key]``, plus the sample count ``n``."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for s in samples:
        groups[str(s["doc"].get(key, "?"))].append(s)
    table = {}
    for name, items in sorted(groups.items()):
        row: dict[str, float] = {"n": len(items)}
        for metric in METRICS:
            values = [float(s[metric]) for s in items if metric in s]
            if values:
                row[metric] = sum(values) / len(values)
        table[name] = row
    return table


def _print(title: str, table: dict[str, dict[str, float]]) -> None:
    print(f"\n{title:<26} {'n':>5} " + " ".join(f"{m:>12}" for m in METRICS))
    for name, row in table.items():
        cells = " ".join(f"{100 * row[m]:>11.1f}%" if m in row else f"{'-':>12}" for m in METRICS)
        print(f"{name:<26} {int(row['n']):>5} {cells}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("samples", nargs="+", type=Path, help="samples_safe_math500_*.jsonl")
    parser.add_argument("--json", action="store_true", help="print the breakdown as JSON")
    args = parser.parse_args(argv)
    samples = load_samples(args.samples)
    if not samples:
        print("no samples found", file=sys.stderr)
        return 1
    result = {
        "overall": breakdown(samples, "__all__")["?"],
        "subject": breakdown(samples, "subject"),
        "level": breakdown(samples, "level"),
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    _print("overall", {"all": result["overall"]})
    _print("subject", result["subject"])
    _print("level", result["level"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
