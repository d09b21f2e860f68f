"""Table cells and JSON reports of the benchmarks, one way for all of them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def fmt(value: Any, digits: int = 2) -> str:
    """A table cell: a dash for a missing value, ``digits`` decimals for a float."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def write_json_report(
    path: Path, report: Any, indent: int = 2, trailing_newline: bool = False
) -> None:
    """A benchmark's report as JSON (ASCII, so the encoding of the reader never matters)."""
    text = json.dumps(report, indent=indent)
    path.write_text(text + "\n" if trailing_newline else text, encoding="utf-8")
