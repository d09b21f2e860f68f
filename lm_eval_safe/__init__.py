"""lm-eval-safe: SAFE ensembling of causal LMs with different tokenizers, as an lm-eval backend.

This module is imported by a ``.pth`` start-up hook in every Python process of the
environment, so it must stay import-light: no torch, no transformers, no lm_eval here.
"""

from __future__ import annotations

__version__ = "0.1.0"
MODEL_NAME = "safe-ensemble"


def task_dir() -> str:
    """Folder of this project's task YAMLs, for ``--include_path``.

    An installed wheel carries them inside the package; an editable install or a
    source checkout has them at the repository root.
    """
    from pathlib import Path

    here = Path(__file__).resolve().parent
    for candidate in (here / "tasks", here.parent / "tasks"):
        if candidate.is_dir():
            return str(candidate)
    raise FileNotFoundError(f"task folder not found next to {here}; reinstall lm-eval-safe")


def register() -> None:
    """Register ``safe-ensemble`` with lm-eval explicitly (the start-up hook does this itself)."""
    from lm_eval_safe._autoregister import register_model

    register_model()
