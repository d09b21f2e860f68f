"""The library versions this package is tested with, and a refusal outside them (an engine's own
library is its spec's: :meth:`lm_eval_safe.engines.spec.EngineSpec.check_versions`).

A pipeline brings its own transformers and lm-eval. Code written against one transformers
cache API silently misreads another (on transformers 4.57 an earlier version of this package
ran every forward without its KV cache, with no error), so a version no test has run is
refused when the model is built, in one line that says what was found, what is tested and the
pip command that fixes it. ``LM_EVAL_SAFE_ALLOW_UNTESTED_VERSIONS=1`` goes on anyway, with a
warning.

The tested versions are a matrix, not two ranges: lm-eval 0.4.9.x imports
``transformers.AutoModelForVision2Seq``, which transformers 5 removed, so it runs only with
transformers 4.57. CI (``.ci/run``) runs the full suite on the newest versions and the fast
suite plus the real-model parity tests on the floors (``.ci/floor-constraints.txt``);
``pyproject.toml``'s floors are those floors and its caps the newest tested releases.
"""

from __future__ import annotations

import logging
import os
from importlib import metadata

from packaging.version import Version

from lm_eval_safe.errors import UserError

logger = logging.getLogger(__name__)

ALLOW_UNTESTED = "LM_EVAL_SAFE_ALLOW_UNTESTED_VERSIONS"

#: (first tested, first not supported) per package; several spans where a line is skipped.
TESTED: dict[str, tuple[tuple[str, str], ...]] = {
    "transformers": (("4.57.1", "4.58"), ("5.0.0", "5.25")),
    "lm-eval": (("0.4.9", "0.4.14"),),
}
#: lm-eval releases before this one import a transformers 4 API and need transformers < 5.
LM_EVAL_FOR_TRANSFORMERS_5 = "0.4.10"


class VersionError(UserError, RuntimeError):
    """An installed library version outside the tested matrix (one line with the fix)."""


def _spans(package: str) -> str:
    return ", ".join(f">={low},<{high}" for low, high in TESTED[package])


def _pip_range(package: str) -> str:
    spans = TESTED[package]
    return f"{package}>={spans[0][0]},<{spans[-1][1]}"


def installed(package: str) -> Version:
    return Version(metadata.version(package))


def version_problems(found: dict[str, Version] | None = None) -> list[str]:
    """What is untested about the installed (or the given) versions, one sentence each."""
    found = found if found is not None else {name: installed(name) for name in TESTED}
    problems = []
    for package, spans in TESTED.items():
        version = found[package]
        if not any(Version(low) <= version < Version(high) for low, high in spans):
            problems.append(
                f"{package} {version} is untested (tested: {_spans(package)}): "
                f"pip install '{_pip_range(package)}'"
            )
    old_lm_eval = found["lm-eval"] < Version(LM_EVAL_FOR_TRANSFORMERS_5)
    if not problems and found["transformers"].major >= 5 and old_lm_eval:
        problems.append(
            f"lm-eval {found['lm-eval']} needs transformers 4 (found {found['transformers']}): "
            f"pip install 'lm-eval>={LM_EVAL_FOR_TRANSFORMERS_5},<{TESTED['lm-eval'][-1][1]}' "
            "or 'transformers>=4.57.1,<4.58'"
        )
    return problems


def check_versions(found: dict[str, Version] | None = None) -> None:
    """Raise :class:`VersionError` for an untested version (warn only when
    ``LM_EVAL_SAFE_ALLOW_UNTESTED_VERSIONS=1``)."""
    refuse(version_problems(found))


def refuse(problems: list[str]) -> None:
    """Raise :class:`VersionError` for ``problems`` (an engine's too), or only warn when
    ``LM_EVAL_SAFE_ALLOW_UNTESTED_VERSIONS=1``."""
    if not problems:
        return
    line = "safe-ensemble: " + "; ".join(problems)
    if os.environ.get(ALLOW_UNTESTED, "") == "1":
        logger.warning("%s; going on because %s=1: results are at your own risk", line, ALLOW_UNTESTED)
        return
    raise VersionError(f"{line} (or set {ALLOW_UNTESTED}=1 to run untested, at your own risk)")
