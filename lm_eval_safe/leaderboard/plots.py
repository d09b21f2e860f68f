"""The report's plots, drawn by matplotlib as inline SVG: accuracy against E/T, and speed.

Configuration names run to 60-100 characters (the scheme, every member, the drafter, the
engine), which squeezed the axes into a narrow strip and pushed the legend off the page. So
the plots name each configuration by a short key (``C1``, ``C2``... in the leaderboard's
order), the leaderboard shows the keys beside the full names, and the legends stand in a column
of their own beside the axes. The axes and the legend carry SVG ids (:data:`ACCURACY_AXES`, :data:`LEGEND`,
:data:`SPEED_AXES`) so a browser can measure where they landed.
"""

from __future__ import annotations

import io
import re
from collections.abc import Sequence

from lm_eval_safe.leaderboard.report import wilson_interval
from lm_eval_safe.leaderboard.runs import Run, RunsError

ACCURACY_AXES = "plot-accuracy-axes"
LEGEND = "plot-accuracy-legend"
SPEED_AXES = "plot-speed-axes"
MARKERS = "osD^v<>P*X"
#: the longest legend text after a key
SHORT = 34


def keys(runs: Sequence[Run]) -> list[str]:
    """Each run's key in the plots and the leaderboard, in the leaderboard's order."""
    return [f"C{i + 1}" for i in range(len(runs))]


def color(index: int) -> str:
    """The colour of the run at ``index`` (matplotlib's ten-colour cycle)."""
    return f"C{index % 10}"


def short_name(name: str) -> str:
    """A configuration's name without its members and drafter (the leaderboard has them),
    at most :data:`SHORT` characters: ``unite-safe on llama_cpp``."""
    text = re.sub(r" \([^()]* drafts\)", "", name)
    return text if len(text) <= SHORT else text[: SHORT - 1] + "…"


def plots_svg(runs: Sequence[Run], tasks: Sequence[str]) -> str:
    """Accuracy (95% Wilson intervals) against E/T, each configuration a colour and each task
    a marker, the legends to the right of the axes; and each run's tokens per second."""
    try:
        import matplotlib
    except ImportError as exc:
        raise RunsError(
            "lm-eval-safe report draws its plots with matplotlib: pip install 'lm-eval-safe[report]'"
        ) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    names = keys(runs)
    # the legends get a column of their own between the plots: a legend anchored outside its
    # axes is not counted by the layout, and ran over the next plot (or off the page)
    fig, (ax_acc, ax_legend, ax_speed) = plt.subplots(
        1, 3, figsize=(13.5, max(4.2, 1.8 + 0.22 * (len(runs) + len(tasks)))),
        width_ratios=[2.3, 1.25, 1], layout="constrained",
    )  # fmt: skip
    ax_legend.axis("off")
    for i, task in enumerate(tasks):
        for j, run in enumerate(runs):
            o = run.outcomes.get(task)
            if o is None or o.accuracy is None:
                continue
            lo, hi = wilson_interval(o.accuracy, o.n)
            ax_acc.errorbar(
                [o.et_percent or 0.0], [100 * o.accuracy],
                yerr=[[100 * (o.accuracy - lo)], [100 * (hi - o.accuracy)]],
                fmt=MARKERS[i % len(MARKERS)], color=color(j), capsize=3,
            )  # fmt: skip
    ax_acc.set_xscale("symlog", linthresh=1.0)
    ax_acc.set_xlim(-0.2, 110)
    ax_acc.set_ylim(0, 100)
    ax_acc.set_xlabel("E/T % (ensembled / generated tokens; members alone at 0)")
    ax_acc.set_ylabel("accuracy % (95% Wilson CI)")
    ax_acc.set_title("Accuracy against ensembled tokens")
    ax_acc.patch.set_gid(ACCURACY_AXES)
    configurations = ax_legend.legend(
        handles=[
            Line2D([], [], color=color(j), marker="s", linestyle="", label=f"{key}  {short_name(run.config)}")
            for j, (key, run) in enumerate(zip(names, runs, strict=True))
        ],
        title="configuration (leaderboard key)", fontsize=8, title_fontsize=8, loc="upper left", borderaxespad=0.0,
    )  # fmt: skip
    configurations.set_gid(LEGEND)
    ax_legend.add_artist(configurations)
    ax_legend.legend(
        handles=[
            Line2D([], [], color="0.3", marker=MARKERS[i % len(MARKERS)], linestyle="", label=task)
            for i, task in enumerate(tasks)
        ],
        title="task", fontsize=8, title_fontsize=8, loc="lower left", borderaxespad=0.0,
    )  # fmt: skip
    speeds = [(next(iter(r.outcomes.values())).tokens_per_second if r.outcomes else None) or 0.0 for r in runs]
    bars = ax_speed.barh(range(len(runs)), speeds, color=[color(j) for j in range(len(runs))])
    ax_speed.bar_label(bars, labels=[f"{s:.1f}" for s in speeds], fontsize=8, padding=2)
    ax_speed.set_yticks(range(len(runs)), names, fontsize=9)
    ax_speed.invert_yaxis()
    ax_speed.set_xlim(0, 1.2 * max([*speeds, 1e-9]))
    ax_speed.set_xlabel("generated tokens / s (whole run)")
    ax_speed.set_title("Speed")
    ax_speed.patch.set_gid(SPEED_AXES)
    buffer = io.StringIO()
    fig.savefig(buffer, format="svg")
    plt.close(fig)
    svg = buffer.getvalue()
    return svg[svg.index("<svg") :]
