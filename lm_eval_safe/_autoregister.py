"""Start-up hook that makes ``lm_eval --model safe-ensemble`` work with no user code.

lm-eval 0.4.x has no plugin discovery for models, so a ``.pth`` file imports this module in
every interpreter of the environment. It must cost nothing measurable: it only installs a
meta-path finder that waits for a few lm-eval modules and patches them right after they
execute. Nothing of lm-eval, torch or transformers is imported until lm-eval itself is.

- ``lm_eval.api.registry``: register ``safe-ensemble`` as a lazy placeholder. lm-eval only
  imports its built-in model table when the registry is *empty*, so import
  ``lm_eval.models`` first or ``--model hf`` would disappear.
- ``lm_eval._cli.utils`` (lm-eval 0.4.10+): the CLI rejects ``--model_args members=a,b``
  (``expected key=value, got 'b'``) before any model code runs; fold bare items into the
  preceding key, with the package's one parser (:mod:`lm_eval_safe.options`).
- ``lm_eval.loggers.evaluation_tracker``: give ensemble runs a stable output folder name
  instead of a random id (lm-eval only knows ``pretrained=``-style keys); tell
  :mod:`lm_eval_safe.decoder.tracing` where samples go and when a task's samples file is written.
- ``lm_eval.__main__`` (the ``lm_eval`` command, console script or ``python -m``): this
  package's user errors print as their one line (:func:`lm_eval_safe.errors.install_excepthook`);
  Python callers of ``simple_evaluate`` never load it and get the exception as it is.
- ``lm_eval.evaluator`` (lm-eval 0.4.9 only): keep the backend's configuration and
  ``safe_stats`` in the results, as 0.4.10+ does by itself.

The one import circle of the package runs through here, and must: the package's
``register()`` (:mod:`lm_eval_safe`) calls this module, which reaches up to
:mod:`lm_eval_safe.harness.model` (lm-eval 0.4.9's registry holds classes), which imports the package's
version. The imports that close it run inside functions, only once lm-eval is there, so the
``.pth`` file's import of this module stays as light as it must be.
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from lm_eval_safe import MODEL_NAME

PLACEHOLDER = "lm_eval_safe.harness.model:SafeEnsembleLM"
#: lm-eval's command: where it is found, this package's user errors become one line on stderr
CLI_MODULE = "lm_eval.__main__"


def register_model() -> None:
    """Register ``safe-ensemble`` in lm-eval's model registry, of either generation:

    - lm-eval 0.4.10+: ``model_registry``, a registry of lazy import targets: a placeholder
      string, so nothing of this package (or torch) is imported until the model is asked for;
    - lm-eval 0.4.9.x: ``MODEL_REGISTRY``, a plain dict of classes, filled as ``lm_eval.models``
      imports its modules (its registry module imports torch itself, so importing the class
      now costs nothing more)."""
    try:
        import lm_eval.models  # noqa: F401  (fills the registry with the built-ins first)
    except Exception:
        # lm-eval 0.4.9 under transformers 5, say: lm-eval itself cannot import; say why first
        import logging

        from lm_eval_safe.versions import version_problems

        for problem in version_problems():
            logging.getLogger("lm_eval_safe").error("safe-ensemble: %s", problem)
        raise
    from lm_eval.api import registry

    if "model_registry" in vars(registry):
        if MODEL_NAME not in registry.model_registry:
            registry.model_registry.register(MODEL_NAME, target=PLACEHOLDER)
    else:
        model = sys.modules.get("lm_eval_safe.harness.model")
        if model is not None and not hasattr(model, "SafeEnsembleLM"):
            return  # it is importing lm-eval now (imported first): it registers itself when done
        from lm_eval_safe.harness.model import SafeEnsembleLM

        registry.MODEL_REGISTRY.setdefault(MODEL_NAME, SafeEnsembleLM)


def _patch_cli_utils(module: ModuleType) -> None:
    """lm-eval 0.4.10+ (0.4.9 has no ``lm_eval._cli``; its CLI hands ``--model_args`` to the
    model as the string the user typed, which :func:`lm_eval_safe.model_args.parse_model_args`
    reads)."""
    from lm_eval_safe.model_args import fold_bare_items, split_top_level

    original = module.key_val_to_dict

    def key_val_to_dict(args: str) -> dict[str, Any]:
        try:
            return original(args)
        except ValueError:
            pairs = fold_bare_items(split_top_level(args))
            # Keep comma-joined lists as strings: the CLI's literal_eval would turn "1,2" into a tuple
            # and "a,b" stays a string anyway; SafeEnsembleLM parses both.
            return {k: (v if "," in v else module.handle_cli_value_string(v)) for k, v in pairs}

    key_val_to_dict.__wrapped__ = original  # type: ignore[attr-defined]
    module.key_val_to_dict = key_val_to_dict


def _patch_tracker(module: ModuleType) -> None:
    tracker = module.GeneralConfigTracker
    original = tracker._get_model_name

    def _get_model_name(model_args: Any) -> str | None:
        from lm_eval_safe.model_args import stable_run_name
        from lm_eval_safe.options import known_keys

        name = stable_run_name(model_args, known_keys())
        return name if name is not None else original(model_args)

    tracker._get_model_name = staticmethod(_get_model_name)

    # trace=true (lm_eval_safe.decoder.tracing): traces go where the tracker writes samples, and each
    # task's trace file is renamed to pair with its samples file once lm-eval names that
    evaluation = module.EvaluationTracker
    original_init, original_save = evaluation.__init__, evaluation.save_results_samples

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        from lm_eval_safe.decoder import tracing

        tracing.note_tracker(self)

    def save_results_samples(self: Any, task_name: str, samples: Any) -> None:
        original_save(self, task_name, samples)
        from lm_eval_safe.decoder import tracing

        tracing.samples_saved(self, task_name)

    evaluation.__init__ = __init__
    evaluation.save_results_samples = save_results_samples


def _patch_evaluator(module: ModuleType) -> None:
    """lm-eval 0.4.9 puts ``get_model_info()`` into the results' ``config`` for its own ``hf``
    backend only (0.4.10+ for every model that has one), so a safe-ensemble run would lose its
    members, options and ``safe_stats``. Its ``simple_evaluate`` calls ``add_tokenizer_info``
    last, on rank 0, with the results and the model (wrapped by ``CachingLM`` under
    ``--use_cache``): the backend's info is added there."""
    from lm_eval_safe.lm_eval_compat import first_generation

    if not first_generation():
        return
    original = module.add_tokenizer_info

    def add_tokenizer_info(storage: dict[str, Any], lm: Any) -> None:
        from lm_eval.api.model import CachingLM

        from lm_eval_safe.harness.model import SafeEnsembleLM

        model = lm.lm if isinstance(lm, CachingLM) else lm
        if isinstance(model, SafeEnsembleLM):
            storage["config"].update(model.get_model_info())
        original(storage, lm)

    module.add_tokenizer_info = add_tokenizer_info


HOOKS: dict[str, Callable[[ModuleType], None]] = {
    "lm_eval.api.registry": lambda _module: register_model(),
    "lm_eval._cli.utils": _patch_cli_utils,
    "lm_eval.loggers.evaluation_tracker": _patch_tracker,
    "lm_eval.evaluator": _patch_evaluator,
}


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the real loader of a watched module to run a hook after it."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname == CLI_MODULE:  # the lm_eval command (python -m runs it without exec_module)
            from lm_eval_safe.errors import install_excepthook

            install_excepthook("lm_eval")
        hook = HOOKS.get(fullname)
        if hook is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original_exec = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            original_exec(module)
            try:
                hook(module)
            except Exception as exc:  # a broken hook must never break lm-eval itself
                import logging

                logging.getLogger("lm_eval_safe").warning(
                    "lm-eval-safe could not patch %s: %s", fullname, exc
                )

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    if any(isinstance(f, _PostImportFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _PostImportFinder())
    # The process may have imported lm-eval before this ran (e.g. an explicit register()).
    for name, hook in HOOKS.items():
        module = sys.modules.get(name)
        if module is not None:
            hook(module)


install()
