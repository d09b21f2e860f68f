"""A PNG of an ``lm-eval-safe report`` page as headless Chromium renders it, opened at a
question with ensemble points and one point's candidates shown (the README's screenshot).

    python scripts/report_screenshot.py report.html --output docs/report.png [--question TASK-DOC]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lm_eval_safe.leaderboard.browser import HeadlessPage, find_chromium

# the question with the most replaced points (or the one asked for), that question's first
# replaced point (else its first point) clicked, the page scrolled to the response view
_PICK = """(() => {
  const want = %s;
  const rows = [...document.querySelectorAll('tr.question')];
  const score = r => document.querySelectorAll('#view-' + CSS.escape(r.dataset.q) + ' span.point.replaced').length;
  const row = want ? rows.find(r => r.dataset.q === want) : rows.sort((a, b) => score(b) - score(a))[0];
  if (!row) return null;
  row.click();
  const view = document.getElementById('view-' + row.dataset.q);
  const point = view.querySelector('span.point.replaced') || view.querySelector('span.point');
  if (point) point.click();
  document.getElementById('candidates').scrollIntoView();
  window.scrollBy(0, -40);
  return row.dataset.q;
})()"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", type=Path)
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--question", default=None, help="TASK-DOC_ID, e.g. safe_bbh_navigate-3")
    parser.add_argument("--width", type=int, default=1400)
    parser.add_argument("--height", type=int, default=1100)
    parser.add_argument("--top", action="store_true", help="the top of the page (leaderboard, plots) instead")
    args = parser.parse_args(argv)
    binary = find_chromium()
    if binary is None:
        sys.exit("report_screenshot: no chromium on PATH (apt-get install chromium)")
    with HeadlessPage(binary, args.width, args.height) as page:
        page.open(args.report)
        if not args.top:
            picked = page.evaluate(_PICK % json.dumps(args.question))
            if picked is None:
                sys.exit(f"report_screenshot: no question {args.question!r} in {args.report}")
            print(f"question {picked}")
        args.output.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(args.output)
    print(args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
