"""One self-contained HTML page over a leaderboard's lm-eval runs: ``lm-eval-safe report``.

It shows what ``safe_stats`` totals cannot: *where* an ensemble acted. Four parts, one file, no
network (styles, scripts and plots are inline, so it opens from disk on an offline machine):

- the leaderboard, with the figures :func:`~lm_eval_safe.leaderboard.report.cell_figures`
  computes for the leaderboard's markdown (one code path, so two views never disagree), and a
  paired test of each ensemble's gap on the questions both it and the best member alone
  answered (exact McNemar);
- plots (accuracy against E/T, speed) drawn by matplotlib as inline SVG
  (:mod:`~lm_eval_safe.leaderboard.plots`), each configuration named by its key in the
  leaderboard;
- a grid of questions x configurations, right or wrong, filterable to the questions an
  ensemble fixed (every member alone wrong) or broke (some member alone right);
- a response view per question: each ensemble's text with every ensemble point marked
  (``data-point`` = its index in the trace; replaced drafts and kept ones styled apart), a
  click showing the drafted and chosen strings and every member's and the ensemble's top
  candidates there, and the members' own responses beside it.
"""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from lm_eval_safe.leaderboard.configs import Config
from lm_eval_safe.leaderboard.plots import keys, plots_svg
from lm_eval_safe.leaderboard.report import best_single, cell_figures, fmt, mcnemar_exact
from lm_eval_safe.leaderboard.result_cache import Outcome
from lm_eval_safe.leaderboard.runs import Run, RunsError, Sample, read_runs

_STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:1.5em;color:#1d1d1f;max-width:1500px}
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:2em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:.5em 0}th,td{border:1px solid #ddd;padding:3px 7px;text-align:right}
th:first-child,td:first-child{text-align:left}thead th{background:#f4f4f6}
td.right{background:#d9f2dc;text-align:center}td.wrong{background:#f7d9d9;text-align:center}
td.none{color:#999;text-align:center}tr.question{cursor:pointer}tr.question:hover td{outline:1px solid #88a}
tr.question.selected td{outline:2px solid #336}.plots svg{max-width:100%;height:auto}
.responses{display:flex;gap:1em;align-items:flex-start;flex-wrap:wrap}
.response{flex:1 1 420px;border:1px solid #ccc;border-radius:6px;padding:.5em .8em;min-width:320px}
.response pre{white-space:pre-wrap;word-wrap:break-word;font:13px/1.5 ui-monospace,monospace;margin:0}
.response h4{margin:.2em 0 .4em}.verdict-right{color:#17702a}.verdict-wrong{color:#a11}
span.point{border-radius:3px;cursor:pointer;padding:0 1px}
span.point.kept{background:#dde7ff;border-bottom:2px solid #5b7fd6}
span.point.replaced{background:#ffe0b3;border-bottom:2px solid #d97a00;font-weight:600}
span.point.active{outline:2px solid #222}
#candidates{position:sticky;top:0;background:#fffdf5;border:1px solid #d8cfa8;border-radius:6px;
padding:.5em .8em;margin:.8em 0;min-height:2em}#candidates table{font-size:13px}
.legend span{margin-right:1em}.muted{color:#777}.filters label{margin-right:1em}
#leaderboard td:nth-child(2),#leaderboard th:nth-child(2){text-align:left}td.gap-test{white-space:nowrap}
"""

_SCRIPT = """
const TRACES = JSON.parse(document.getElementById('trace-data').textContent);
function esc(s){return String(s).replace(/[&<>"]/g,c=>({'&':'&amp;','<':'&lt;','>':'&gt;','"':'&quot;'}[c]));}
function show(q){
  document.querySelectorAll('.question-view').forEach(v=>v.hidden=(v.id!=='view-'+q));
  document.querySelectorAll('tr.question').forEach(r=>r.classList.toggle('selected',r.dataset.q===q));
  document.getElementById('candidates').innerHTML='<span class="muted">Click a marked point to see the candidates there.</span>';
}
function candidates(el){
  const p = TRACES[el.dataset.trace].points[Number(el.dataset.point)];
  const members = Object.keys(p.members);
  document.querySelectorAll('span.point.active').forEach(e=>e.classList.remove('active'));
  el.classList.add('active');
  let h = '<b>point '+p.index+'</b> at character '+p.offset+' (token '+p.position+'): drafted <code>'+
    esc(JSON.stringify(p.drafted))+'</code>, chosen <code>'+esc(JSON.stringify(p.chosen))+'</code>: <b>'+p.action+'</b>'+
    (p.sharpened?', sharpened':'');
  if(p.acceptance){h+=', draw '+p.acceptance.draw+' vs keep probability '+p.acceptance.keep_probability;}
  h += '<table class="candidates"><thead><tr><th>#</th><th>ensemble</th>'+members.map(m=>'<th>'+esc(m)+'</th>').join('')+'</tr></thead><tbody>';
  const rows = Math.max(p.ensemble.length, ...members.map(m=>p.members[m].length));
  const cell = c => c ? '<td><code>'+esc(JSON.stringify(c[0]))+'</code> '+c[1].toFixed(3)+'</td>' : '<td></td>';
  for(let i=0;i<rows;i++){h+='<tr><td>'+(i+1)+'</td>'+cell(p.ensemble[i])+members.map(m=>cell(p.members[m][i])).join('')+'</tr>';}
  document.getElementById('candidates').innerHTML = h+'</tbody></table>';
}
function filterGrid(){
  const f = document.querySelector('input[name=grid-filter]:checked').value;
  let shown = 0;
  document.querySelectorAll('tr.question').forEach(r=>{
    const on = f==='all' || r.dataset[f]==='1'; r.hidden=!on; shown+=on;});
  document.getElementById('grid-count').textContent = shown+' questions';
}
document.querySelectorAll('tr.question').forEach(r=>r.addEventListener('click',()=>show(r.dataset.q)));
document.querySelectorAll('span.point').forEach(s=>s.addEventListener('click',e=>{e.stopPropagation();candidates(s);}));
document.querySelectorAll('input[name=grid-filter]').forEach(i=>i.addEventListener('change',filterGrid));
filterGrid();
const first = document.querySelector('tr.question'); if(first) show(first.dataset.q);
"""


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _configs(runs: Sequence[Run]) -> list[Config]:
    return [Config(run.config, "", run.is_single) for run in runs]


def _tasks(runs: Sequence[Run]) -> list[str]:
    tasks: list[str] = []
    for run in runs:
        tasks += [t for t in run.outcomes if t not in tasks]
    return tasks


def _best_member(runs: Sequence[Run], task: str) -> Run | None:
    """The member alone with the best accuracy on ``task`` (the gap column's reference)."""
    singles = [r for r in runs if r.is_single and (o := r.outcomes.get(task)) is not None and o.accuracy is not None]
    return max(singles, key=lambda r: r.outcomes[task].accuracy, default=None)


def _gap_test(run: Run, best: Run | None, task: str) -> str:
    """An ensemble's questions right where the best member alone was wrong, the reverse, and
    the exact McNemar p-value of that difference (``-`` for a member alone)."""
    if run.is_single or best is None:
        return "<td>-</td>"
    mine, theirs = run.task_samples(task), best.task_samples(task)
    pairs = [
        (s.correct, theirs[key].correct)
        for key, s in mine.items()
        if key in theirs and s.correct is not None and theirs[key].correct is not None
    ]
    fixed = sum(1 for a, b in pairs if a and not b)
    broken = sum(1 for a, b in pairs if b and not a)
    title = (
        f"of {len(pairs)} questions both answered: {fixed} right here and wrong for {best.config}, "
        f"{broken} the reverse; exact two-sided McNemar p-value"
    )
    return f'<td class="gap-test" title="{_e(title)}">+{fixed} / −{broken}, p = {mcnemar_exact(fixed, broken):.2g}</td>'


def _leaderboard(runs: Sequence[Run], tasks: Sequence[str]) -> str:
    outcomes = [o for run in runs for o in run.outcomes.values()]
    configs = _configs(runs)
    head = "".join(
        f"<th>{_e(t)}<br>accuracy % (gap)</th><th>gap test</th><th>95% CI</th><th>n</th>" for t in tasks
    )
    best = {task: _best_member(runs, task) for task in tasks}
    rows = []
    for key, run in zip(keys(runs), runs, strict=True):
        cells = []
        for task in tasks:
            outcome = run.outcomes.get(task)
            if outcome is None:
                cells.append("<td>-</td><td>-</td><td>-</td><td>-</td>")
                continue
            figures = cell_figures(outcome, best_single(outcomes, configs, task), run.is_single)
            acc = fmt(figures.accuracy_percent, "{:.1f}")
            if figures.gap_points is not None:
                acc += f" ({figures.gap_points:+.1f})"
            ci = "-" if figures.interval_percent is None else "[{:.1f}, {:.1f}]".format(*figures.interval_percent)
            cells.append(f"<td>{acc}</td>{_gap_test(run, best[task], task)}<td>{ci}</td><td>{figures.n}</td>")
        speed = _speed_cells(_run_wide(run), run.is_single)
        rows.append(
            f'<tr class="leaderboard-row" data-config="{_e(run.config)}" data-key="{key}">'
            f"<td><b>{key}</b></td><td>{_e(run.config)}</td>"
            + "".join(cells)
            + speed
            + "</tr>"
        )
    return (
        '<table id="leaderboard"><thead><tr><th>key</th><th>configuration</th>'
        + head
        + "<th>E/T %</th><th>acceptance</th><th>tok/s</th><th>wall s</th></tr></thead><tbody>"
        + "".join(rows)
        + "</tbody></table>"
        + '<p class="muted">gap: accuracy points to the best member alone; gap test: the questions '
        "the ensemble got right and that member wrong (+) and the reverse (−), with the exact "
        "two-sided McNemar p-value of the difference (the questions both got right or both wrong "
        "say nothing about it); the key names the configuration in the plots.</p>"
    )


def _run_wide(run: Run) -> Outcome | None:
    """Any of a run's outcomes: E/T, acceptance, tokens/s and wall time are the run's, the same
    in each of its tasks."""
    return next(iter(run.outcomes.values()), None)


def _speed_cells(outcome: Outcome | None, single: bool) -> str:
    if outcome is None:
        return "<td>-</td>" * 4
    return (
        f"<td>{fmt(outcome.et_percent, '{:.2f}')}</td>"
        f"<td>{'-' if single else fmt(outcome.acceptance, '{:.3f}')}</td>"
        f"<td>{fmt(outcome.tokens_per_second, '{:.2f}')}</td><td>{outcome.wall_seconds:.0f}</td>"
    )


def _verdict(sample: Sample | None) -> tuple[str, str]:
    if sample is None or sample.correct is None:
        return "none", "·"
    return ("right", "✓") if sample.correct else ("wrong", "✗")


def _questions(runs: Sequence[Run]) -> list[tuple[str, int]]:
    keys: list[tuple[str, int]] = []
    seen = set()
    for run in runs:
        for task, samples in run.samples.items():
            for doc_id in sorted(samples):
                if (task, doc_id) not in seen:
                    seen.add((task, doc_id))
                    keys.append((task, doc_id))
    return keys


def _grid(runs: Sequence[Run], questions: Sequence[tuple[str, int]]) -> str:
    singles = [r for r in runs if r.is_single]
    ensembles = [r for r in runs if not r.is_single]
    head = "".join(f"<th>{_e(r.config)}</th>" for r in runs)
    rows = []
    for task, doc in questions:
        got = [r.samples.get(task, {}).get(doc) for r in runs]
        single_right = [s.correct for r, s in zip(runs, got, strict=True) if r.is_single and s]
        ensemble_right = [s.correct for r, s in zip(runs, got, strict=True) if not r.is_single and s]
        fixed = bool(singles and ensembles) and any(ensemble_right) and not any(single_right)
        broken = bool(singles and ensembles) and any(single_right) and not all(ensemble_right)
        cells = "".join(
            f'<td class="{cls}" data-config="{_e(r.config)}">{mark}</td>'
            for r, (cls, mark) in zip(runs, map(_verdict, got), strict=True)
        )
        rows.append(
            f'<tr class="question" data-q="{_e(_qid(task, doc))}" data-fixed="{int(fixed)}" '
            f'data-broken="{int(broken)}"><td>{_e(task)} #{doc}</td>{cells}</tr>'
        )
    filters = (
        '<p class="filters">'
        '<label><input type="radio" name="grid-filter" value="all" checked> all</label>'
        '<label><input type="radio" name="grid-filter" value="fixed"> the ensemble fixed a '
        "question every member got wrong</label>"
        '<label><input type="radio" name="grid-filter" value="broken"> the ensemble broke a '
        'question a member got right</label> <span id="grid-count" class="muted"></span></p>'
    )
    return (
        filters
        + f'<table id="grid"><thead><tr><th>question</th>{head}</tr></thead><tbody>'
        + "".join(rows)
        + "</tbody></table>"
    )


def _qid(task: str, doc: int) -> str:
    return f"{task}-{doc}"


def _marked_text(text: str, trace: dict[str, Any], trace_key: str) -> str:
    """The response with each ensemble point wrapped in a ``span.point`` (points the stop
    string cut off, or that chose the end of text, are listed after it)."""
    out, at, unplaced = [], 0, []
    for point in trace["points"]:
        start, chosen = point["offset"], point["written"]
        end = start + len(chosen)
        attrs = (
            f'class="point {point["action"]}" data-point="{point["index"]}" '
            f'data-trace="{_e(trace_key)}" title="{_e(point["action"])}: drafted '
            f'{_e(json.dumps(point["drafted"]))}"'
        )
        if point["chosen"] == "<eos>" or start < at or end > len(text) or text[start:end] != chosen:
            unplaced.append(f"<span {attrs}>{_e(chosen if chosen else '∅')}</span>")
            continue
        out.append(_e(text[at:start]))
        out.append(f"<span {attrs}>{_e(chosen) if chosen else '∅'}</span>")
        at = end
    out.append(_e(text[at:]))
    body = "".join(out)
    if unplaced:
        body += '\n<span class="muted">after the response\'s end: </span>' + " ".join(unplaced)
    return body


def _views(
    runs: Sequence[Run], questions: Sequence[tuple[str, int]], traces: dict[str, Any]
) -> str:
    views = []
    for task, doc in questions:
        parts = []
        first = next((r.samples[task][doc] for r in runs if doc in r.samples.get(task, {})), None)
        for run in sorted(runs, key=lambda r: r.is_single):  # ensembles first, members beside
            sample = run.samples.get(task, {}).get(doc)
            if sample is None:
                continue
            cls, mark = _verdict(sample)
            text = sample.responses[0] if sample.responses else ""
            trace = sample.traces.get(0)
            if trace is not None:
                key = f"{len(traces)}"
                traces[key] = {"points": trace["points"]}
                body = _marked_text(text, trace, key)
                counts = trace["counts"]
                note = (
                    f'<p class="muted">{len(trace["points"])} ensemble points '
                    f'({counts["ensemble_replaced"]} replaced), {counts["generated_tokens"]} tokens, '
                    f'{counts["consensus_skips"]} aligned positions skipped by consensus</p>'
                )
            else:
                body = _e(text)
                note = "" if run.is_single else '<p class="muted">no trace (run without trace=true)</p>'
            parts.append(
                f'<div class="response" data-config="{_e(run.config)}"><h4>{_e(run.config)} '
                f'<span class="verdict-{cls}">{mark}</span></h4>{note}<pre>{body}</pre></div>'
            )
        prompt = "" if first is None else first.prompt
        target = "" if first is None else first.target
        views.append(
            f'<div class="question-view" id="view-{_e(_qid(task, doc))}" hidden>'
            f"<h3>{_e(task)} #{doc} <span class=\"muted\">target: {_e(target)}</span></h3>"
            f"<details><summary>prompt</summary><pre>{_e(prompt)}</pre></details>"
            f'<div class="responses">{"".join(parts)}</div></div>'
        )
    return "".join(views)


def build_report(runs: Sequence[Run], sources: Sequence[Path]) -> str:
    """The page's HTML."""
    if not runs:
        raise RunsError("no runs to report")
    tasks = _tasks(runs)
    questions = _questions(runs)
    traces: dict[str, Any] = {}
    views = _views(runs, questions, traces)
    data = json.dumps(traces, ensure_ascii=False).replace("</", "<\\/")
    traced = [r.config for r in runs if r.traced]
    return (
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>lm-eval-safe report: {_e(', '.join(tasks))}</title><style>{_STYLE}</style></head><body>"
        f"<h1>lm-eval-safe report</h1><p class=\"muted\">{len(runs)} runs from "
        f"{_e(', '.join(str(s) for s in sources))}; written {datetime.now():%Y-%m-%d %H:%M}. "
        f"Traced (trace=true): {_e(', '.join(traced) or 'none')}.</p>"
        f"<h2>Leaderboard</h2>{_leaderboard(runs, tasks)}"
        f'<h2>Plots</h2><div class="plots">{plots_svg(runs, tasks)}</div>'
        f"<h2>Questions</h2>{_grid(runs, questions)}"
        '<h2>Responses</h2><p class="legend"><span><span class="point replaced">replaced</span> '
        'the ensemble replaced the drafted string</span><span><span class="point kept">kept</span> '
        "the ensemble kept it</span></p>"
        '<div id="candidates"></div>'
        f'<section id="responses">{views}</section>'
        f'<script type="application/json" id="trace-data">{data}</script>'
        f"<script>{_SCRIPT}</script></body></html>"
    )


def write_report(folders: Sequence[Path], output: Path) -> Path:
    """Read the runs under ``folders`` and write the page to ``output``."""
    runs = read_runs(folders)
    page = build_report(runs, folders)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(page, encoding="utf-8")
    return output
