"""The library versions this package is tested with, and a refusal outside them.

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

logger = logging.getLogger(__name__)

ALLOW_UNTESTED = "LM_EVAL_SAFE_ALLOW_UNTESTED_VERSIONS"

#: (first tested, first not supported) per package; several spans where a line is skipped.
TESTED: dict[str, tuple[tuple[str, str], ...]] = {
    "transformers": (("4.57.1", "4.58"), ("5.0.0", "5.25")),
    "lm-eval": (("0.4.9", "0.4.14"),),
}
#: lm-eval releases before this one import a transformers 4 API and need transformers < 5.
LM_EVAL_FOR_TRANSFORMERS_5 = "0.4.10"
#: engine=vllm: the vLLM releases tested (CI's vLLM environment, .ci/vllm-constraints.txt), and
#: the transformers range vLLM 0.32 itself declares, which joins the matrix there.
VLLM_TESTED: tuple[tuple[str, str], ...] = (("0.32.0", "0.33"),)
TRANSFORMERS_FOR_VLLM = ("5.16.1", "5.20")


class VersionError(RuntimeError):
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


def vllm_version_problems(vllm: Version, transformers: Version) -> list[str]:
    """What is untested about a vLLM (``engine=vllm``) and the transformers beside it."""
    problems = []
    if not any(Version(low) <= Version(vllm.base_version) < Version(high) for low, high in VLLM_TESTED):
        spans = ", ".join(f">={low},<{high}" for low, high in VLLM_TESTED)
        problems.append(
            f"vllm {vllm} is untested for engine=vllm (tested: {spans}): pip install "
            f"'vllm>={VLLM_TESTED[0][0]},<{VLLM_TESTED[-1][1]}' (CPU: bash scripts/setup.sh --vllm)"
        )
    low, high = TRANSFORMERS_FOR_VLLM
    if not Version(low) <= transformers < Version(high):
        problems.append(
            f"transformers {transformers} is untested beside vLLM (tested: >={low},<{high}): "
            f"pip install 'transformers>={low},<{high}'"
        )
    return problems


def check_vllm_versions(vllm: Version, transformers: Version | None = None) -> None:
    """:func:`check_versions` for ``engine=vllm``."""
    _refuse(vllm_version_problems(vllm, transformers or installed("transformers")))


def check_versions(found: dict[str, Version] | None = None) -> None:
    """Raise :class:`VersionError` for an untested version (warn only when
    ``LM_EVAL_SAFE_ALLOW_UNTESTED_VERSIONS=1``)."""
    _refuse(version_problems(found))


def _refuse(problems: list[str]) -> None:
    if not problems:
        return
    line = "safe-ensemble: " + "; ".join(problems)
    if os.environ.get(ALLOW_UNTESTED, "") == "1":
        logger.warning("%s; going on because %s=1: results are at your own risk", line, ALLOW_UNTESTED)
        return
    raise VersionError(f"{line} (or set {ALLOW_UNTESTED}=1 to run untested, at your own risk)")
