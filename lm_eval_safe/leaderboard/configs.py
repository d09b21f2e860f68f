"""The rows of a leaderboard: members alone, the built-in ensembles, and the SAFE paper's pairs.

Every row is a ``model_args`` string for ``safe-ensemble``. A member "alone" is
``members=<that member>``: the identical decoder loop with one model, so a comparison
measures ensembling and nothing else (prompting, stopping and answer checking are shared).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lm_eval_safe.model_args import member_display_name

DEFAULT_TASKS = ("safe_gsm8k", "safe_math500", "safe_bbh_paper")

#: Built-in ensemble configurations: name -> model_args (members are added in front).
#: Names follow the paper's method names; "alone" rows are generated per member.
ENSEMBLE_CONFIGS: dict[str, str] = {
    "gac-threshold": "schedule=threshold,aggregator=gac",
    "unite-every": "schedule=every,aggregator=unite",
    "gac-safe": "schedule=safe,aggregator=gac",
    "unite-safe": "schedule=safe,aggregator=unite",
    "unite-safe-sharpen-none": "schedule=safe,aggregator=unite,sharpen=none",
    "unite-safe-sharpen-geometric": "schedule=safe,aggregator=unite,sharpen=geometric",
    "gac-safe-sharpen-none": "schedule=safe,aggregator=gac,sharpen=none",
    "gac-safe-sharpen-geometric": "schedule=safe,aggregator=gac,sharpen=geometric",
}
ALONE_PREFIX = "alone:"


@dataclass(frozen=True)
class Config:
    """One row of the leaderboard: a name and the model_args that produce it."""

    name: str
    model_args: str
    is_single: bool


@dataclass(frozen=True)
class PaperPair:
    """One member pair of the SAFE paper's Table 2 and the numbers the paper reports for it."""

    name: str
    members: tuple[str, ...]  # hub ids; the first one drafts (see README, "Reproduce the paper")
    accuracy: dict[tuple[str, str], float]  # (configuration, task) -> accuracy in %
    et_math500: dict[str, float]  # configuration -> E/T % on MATH-500


#: Table 2 configurations: each member alone, then UniTE (every token), UniTE+SAFE, GaC (its
#: 0.5 threshold gate) and GaC+SAFE. ``alone`` expands to one row per member.
PAPER_CONFIGS = ("alone", "unite-every", "unite-safe", "gac-threshold", "gac-safe")
PAPER_LABELS = {
    "unite-every": "UniTE",
    "unite-safe": "UniTE+SAFE",
    "gac-threshold": "GaC",
    "gac-safe": "GaC+SAFE",
}
PAPER_TASKS = ("safe_math500", "safe_gsm8k", "safe_bbh_paper")
_INTERNLM3, _QWEN25, _EXAONE35 = (
    "internlm/internlm3-8b-instruct",
    "Qwen/Qwen2.5-7B-Instruct",
    "LGAI-EXAONE/EXAONE-3.5-7.8B-Instruct",
)


def _per_task(config: str, values: tuple[float, float, float]) -> dict[tuple[str, str], float]:
    """One configuration's reported accuracies, in the order of :data:`PAPER_TASKS`."""
    return {(config, t): v for t, v in zip(PAPER_TASKS, values, strict=True)}


#: The numbers of docs/algorithm.md, The paper's numbers (its Table 2, greedy, one GPU per model). The page gives
#: the best single model (Internlm3) but not Qwen2.5 alone, and no numbers for the second pair:
#: those cells print no paper number rather than an invented one.
PAPER_PAIRS: tuple[PaperPair, ...] = (
    PaperPair(
        name="internlm3-8b+qwen2.5-7b",
        members=(_INTERNLM3, _QWEN25),
        accuracy={
            **_per_task(f"{ALONE_PREFIX}internlm3-8b-instruct", (74.8, 90.14, 82.26)),
            **_per_task("gac-threshold", (74.2, 91.28, 82.34)),
            **_per_task("gac-safe", (76.0, 91.36, 82.34)),
            **_per_task("unite-every", (59.6, 75.06, 79.58)),
            **_per_task("unite-safe", (77.4, 92.04, 82.97)),
        },
        et_math500={
            "gac-threshold": 1.04,
            "gac-safe": 0.71,
            "unite-every": 100.0,
            "unite-safe": 3.82,
        },
    ),
    PaperPair(
        name="qwen2.5-7b+exaone3.5-7.8b", members=(_QWEN25, _EXAONE35), accuracy={}, et_math500={}
    ),
)
#: Settings of the paper's runs: 2048 new tokens, bf16, each member on its own GPU (a member
#: alone on the first), chat templates (instruct models), and remote code, which the
#: Internlm3 and EXAONE-3.5 checkpoints need.
PAPER_SETTINGS = {
    "max_gen_toks": 2048,
    "model_args_extra": "dtype=bfloat16,trust_remote_code=true",
    "alone_args": "device=cuda:0",
    "ensemble_args": "member_devices=cuda:0|cuda:1",
}
#: ``--preset paper``: the settings above as command-line defaults (the output folder is the
#: command line's to choose). Each pair's members and drafter come from :data:`PAPER_PAIRS`.
PAPER_PRESET: dict[str, Any] = {
    "tasks": ",".join(PAPER_TASKS),
    "configs": ",".join(PAPER_CONFIGS),
    **PAPER_SETTINGS,
    "apply_chat_template": True,
    "runner": "cli",
}


def build_configs(members: Sequence[str], names: Sequence[str] | None) -> list[Config]:
    """Expand ``--configs`` into rows; ``alone`` means every member alone, ``all`` everything.

    Members alone come first because the gap column of every other row refers to them.
    """
    alone = {}
    for member in members:
        name = ALONE_PREFIX + member_display_name(member)
        alone[name] = Config(name, f"members={member}", True)
    joined = "|".join(members)
    ensembles = {
        name: Config(name, f"members={joined},{args}", False)
        for name, args in ENSEMBLE_CONFIGS.items()
    }
    if not names or list(names) == ["all"]:
        return [*alone.values(), *ensembles.values()]
    chosen: list[Config] = []
    for name in names:
        if name == "all":
            picks = [*alone.values(), *ensembles.values()]
        elif name == "alone":
            picks = list(alone.values())
        elif name in alone:
            picks = [alone[name]]
        elif ALONE_PREFIX + name in alone:
            picks = [alone[ALONE_PREFIX + name]]
        elif name in ensembles:
            picks = [ensembles[name]]
        else:
            known = ", ".join(["all", "alone", *alone, *ensembles])
            raise SystemExit(f"--configs: unknown configuration {name!r}; known: {known}")
        chosen.extend(p for p in picks if p not in chosen)
    singles = [c for c in chosen if c.is_single]
    return singles + [c for c in chosen if not c.is_single]


def full_model_args(config: Config, extra: str, alone: str = "", ensemble: str = "") -> str:
    """Configuration model_args plus ``--model-args-extra`` (e.g. ``device=cpu``) and the extra
    of its kind (``--alone-args`` for a member alone, ``--ensemble-args`` for an ensemble: one
    GPU for a model alone, ``member_devices`` for a pair)."""
    parts = [config.model_args, alone if config.is_single else ensemble, extra]
    return ",".join(p for p in parts if p)

