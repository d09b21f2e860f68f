"""The vLLM releases ``engine=vllm`` is tested with, and the transformers beside them (joined to
the core matrix of :mod:`lm_eval_safe.versions` where a vLLM member runs)."""

from __future__ import annotations

from packaging.version import Version

from lm_eval_safe.versions import installed, refuse

#: the vLLM releases tested (CI's vLLM environment, .ci/vllm-constraints.txt), and the
#: transformers range vLLM 0.32 itself declares, which joins the matrix there.
VLLM_TESTED: tuple[tuple[str, str], ...] = (("0.32.0", "0.33"),)
TRANSFORMERS_FOR_VLLM = ("5.16.1", "5.20")


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
    """:func:`lm_eval_safe.versions.check_versions` for ``engine=vllm``."""
    refuse(vllm_version_problems(vllm, transformers or installed("transformers")))
