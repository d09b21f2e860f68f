"""``lm-eval-safe bench NAME``: the benchmarks users and reviewers rerun, one module each.

Each module declares its options in ``configure(parser)`` (the shared ones through
:mod:`lm_eval_safe.cli_options`), runs in ``run(args) -> int``, and has ``main(argv)`` for a
caller with a plain argument list (the tests, the thin wrappers left in ``scripts/``). They live
in the package, not in ``scripts/``, so that an installed wheel carries them. A module is
imported only when its command runs, so ``lm-eval-safe models`` never pays for torch.
"""

from __future__ import annotations

import argparse
import importlib
import os
from collections.abc import Sequence
from types import ModuleType

#: command name -> (module under this package, one line of help); ``llama-cpp`` is spelled as
#: the extra that installs its engine (``pip install 'lm-eval-safe[llama-cpp]'``)
COMMANDS: dict[str, tuple[str, str]] = {
    "eval": ("eval", "lm-eval end to end: lm-eval's own backends vs. safe-ensemble alone and ensembled"),
    "speed": ("speed", "per-token time of SAFE vs. the drafter alone and the baselines, side by side"),
    "batch": ("batch", "batched generation vs. one request at a time (and data-parallel processes)"),
    "host": ("host", "host work per generated token: time outside the forwards, device syncs"),
    "serve": ("serve", "the OpenAI-compatible server vs. direct calls, and lm-eval through it"),
    "scoring": ("scoring", "loglikelihood scoring: speed and accuracy of the ensemble's scores"),
    "sampling": ("sampling", "sampled generation: speed and statistics per aggregator"),
    "memory": ("memory", "memory over many requests: RSS and live tensors sampled mid-run"),
    "llama-cpp": ("llamacpp", "the llama.cpp engine vs. llama-cpp-python's own generate"),
    "conformance": ("conformance", "the SAFE authors' code vs. this project on the same prompts"),
    "threads": ("threads", "the main job under each OpenMP thread setting, alone and two at once"),
}
#: what every benchmark runs under unless the caller's environment says otherwise: no network
#: (the members and data are local) and no tokenizer threads beside torch's
ENVIRONMENT = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def load(name: str) -> ModuleType:
    """The module of ``lm-eval-safe bench NAME``, imported after :data:`ENVIRONMENT` is set
    (the hub libraries read it when they are imported)."""
    for key, value in ENVIRONMENT.items():
        os.environ.setdefault(key, value)
    return importlib.import_module(f"{__name__}.{COMMANDS[name][0]}")


def description(module: ModuleType) -> str:
    """A command's ``--help`` text: its module docstring."""
    return module.__doc__ or ""


def parser(name: str) -> argparse.ArgumentParser:
    """``lm-eval-safe bench NAME``'s parser on its own (for :func:`main`)."""
    module = load(name)
    built = argparse.ArgumentParser(
        prog=f"lm-eval-safe bench {name}",
        description=description(module),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    module.configure(built)
    return built


def main(name: str, argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` as ``lm-eval-safe bench NAME`` does and run it."""
    return load(name).run(parser(name).parse_args(argv))
