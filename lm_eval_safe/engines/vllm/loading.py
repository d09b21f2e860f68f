"""Loading a member as a vLLM engine: its checkpoint folder (a GGUF's converted one), its
tokenizer and config files in this process, and the engine itself (``vllm.LLM``).

vLLM's own failures that a user can fix are turned into one line naming the member and the
setting: an architecture it cannot run (keep that member on transformers with ``engines=``), a
KV cache that does not fit (``gpu_memory_utilization``, ``kv_cache_memory_bytes``,
``max_model_len``), an argument's value vLLM refuses (``max_length`` above the model's own
limit, a type, range or choice its configs do not accept).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from lm_eval_safe.engines.spec import LoadedMember, MemberLoad
from lm_eval_safe.errors import OptionError
from lm_eval_safe.members.checkpoints import checkpoint_folder
from lm_eval_safe.members.placement import pick_dtype
from lm_eval_safe.members.sources import loading_errors

logger = logging.getLogger(__name__)

#: Fragments of vLLM's messages and the setting a user changes for each.
_ARCHITECTURE = ("are not supported for now", "is not supported", "Unsupported CPU attention")
_MEMORY = ("KV cache", "kv cache", "cache blocks", "memory")


@contextmanager
def visible_gpus(gpus: tuple[int, ...] | None) -> Iterator[None]:
    """``CUDA_VISIBLE_DEVICES`` for the engine processes vLLM starts inside this block (how
    vLLM is pointed at GPUs: its engine core and workers inherit the environment)."""
    if gpus is None:
        yield
        return
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


def _engine_error(spec: str, exc: Exception) -> OptionError | None:
    text = str(exc)
    first = (text.splitlines() or [type(exc).__name__])[0]
    if any(fragment in text for fragment in _ARCHITECTURE):
        return OptionError(
            f"member {spec!r}: vLLM cannot run this model ({first}); keep it on transformers, "
            "e.g. engines=vllm,hf with this member's entry hf"
        )
    if any(fragment in text for fragment in _MEMORY):
        return OptionError(
            f"member {spec!r}: vLLM found no room for its KV cache ({first}); give it more with "
            "gpu_memory_utilization= (GPU) or kv_cache_memory_bytes= (CPU), or a smaller "
            "max_model_len="
        )
    return None


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _argument_error(spec: str, exc: Exception, args: dict[str, Any]) -> OptionError | None:
    """vLLM's refusal of an engine argument in one line naming the member, the argument and
    vLLM's reason: its configs' validation (pydantic: a type, a range, a choice; a
    ``max_model_len`` above what the model allows), or a ``ValueError``/``TypeError`` whose text
    names an argument given (``block_size=7``: "No common block size for 7")."""
    from pydantic import ValidationError

    from lm_eval_safe.engines.vllm.args import vllm_version

    refused = f"member {spec!r}: vLLM {vllm_version()} refused"
    if isinstance(exc, ValidationError):
        errors = exc.errors()
        for error in errors:
            reason = _one_line(str(error["msg"]).removeprefix("Value error, "))
            if "User-specified max_model_len" in reason and "max_model_len" in args:
                first = reason.split(". ")[0]
                return OptionError(
                    f"{refused} max_length={args['max_model_len']}: {first}; give a smaller max_length="
                )
            given = [k for k, v in args.items() if type(v) is type(error.get("input")) and v == error.get("input")]
            if given:
                return OptionError(f"{refused} {given[0]}={args[given[0]]!r}: {reason}; change or drop {given[0]}=")
        first_error = errors[0]
        where = ".".join(str(part) for part in first_error["loc"])
        return OptionError(
            f"{refused} its engine arguments ({where}: {_one_line(str(first_error['msg']))}); check "
            "the vLLM arguments in model_args"
        )
    if isinstance(exc, (ValueError, TypeError)):
        text = _one_line(str(exc))
        named = [k for k in args if k in text or k.replace("_", " ") in text.lower()]
        if named:
            return OptionError(f"{refused} {named[0]}={args[named[0]]!r}: {text}; change or drop {named[0]}=")
    return None


def load_vllm_member(
    load: MemberLoad,
    engine_args: dict[str, Any] | None = None,
    gpus: tuple[int, ...] | None = None,
) -> LoadedMember:
    """Load one member as a vLLM engine (``engine_args``: :func:`.args.member_engine_args` with
    its defaults applied; ``gpus``: the GPUs it may use, None for vLLM's choice)."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    from vllm import LLM

    from lm_eval_safe.engines.vllm.args import is_cpu_platform
    from lm_eval_safe.engines.vllm.engine import VLLMEngine

    source, spec, trust_remote_code = load.source, load.source.spec, load.trust_remote_code
    device = "cpu" if is_cpu_platform() else "cuda"
    torch_dtype = pick_dtype(load.dtype, device)
    location = checkpoint_folder(source, torch_dtype, trust_remote_code, load.cache_dir)
    with loading_errors(source):
        tokenizer = AutoTokenizer.from_pretrained(location, trust_remote_code=trust_remote_code)
        config = AutoConfig.from_pretrained(location, trust_remote_code=trust_remote_code)
        try:
            generation_config = GenerationConfig.from_pretrained(location)
        except OSError:  # a checkpoint without generation_config.json
            generation_config = None
    args = dict(engine_args or {})
    if load.max_length:
        args.setdefault("max_model_len", int(load.max_length))
    settings = {
        "model": location,
        "dtype": str(torch_dtype).replace("torch.", ""),
        "trust_remote_code": trust_remote_code,
        **args,
    }
    logger.info("loading %s on vLLM: %s", source.name, settings)
    try:
        with visible_gpus(gpus):
            llm = LLM(**settings)
        engine = VLLMEngine(llm, load.top_logprobs, settings)
        # one token now: kernels vLLM lacks for this model (a head size its CPU attention does
        # not support) fail here, naming the member, not at the first request of a run
        prompt = [tokenizer.bos_token_id or 0, tokenizer.eos_token_id or 0]
        llm.generate([{"prompt_token_ids": prompt}], engine.params(max_tokens=1), use_tqdm=False)
    except (ValueError, TypeError, RuntimeError, NotImplementedError, AssertionError) as exc:
        from pydantic import ValidationError

        given = {k: v for k, v in settings.items() if k not in ("model", "dtype", "trust_remote_code")}
        if not isinstance(exc, ValidationError):
            error = _engine_error(spec, exc)
            if error is not None:
                raise error from exc
        error = _argument_error(spec, exc, given)
        if error is None:
            raise
        raise error from None  # the line says all there is: vLLM's reason and the argument
    return LoadedMember(
        tokenizer=tokenizer,
        config=config,
        generation_config=generation_config,
        engine=engine,
        device=device if gpus is None else ",".join(f"cuda:{g}" for g in gpus),
        dtype=torch_dtype,
        max_length=engine.max_model_len,
    )


def plan_vllm_members(
    options: Any, placements: Sequence[Any], indices: Sequence[int], rank: int, world_size: int
) -> list[dict[str, Any]]:
    """The loading settings of the vLLM members at ``indices`` (``engine_args``, ``gpus`` for
    :func:`load_vllm_member`), decided and checked before anything loads (vLLM's installation
    and version were, by the spec's ``check_versions``): every argument is one it knows,
    per-member lists have the right length.

    GPUs: a ``member_devices`` entry ``cuda:N`` gives the member GPUs N to N+tp-1 (tp: its
    ``tensor_parallel_size``); in a data-parallel run (lm-eval's launcher, one process per rank)
    rank r's members take GPUs r*tp to (r+1)*tp-1; otherwise vLLM chooses. On a CPU build the
    environment of :func:`.args.cpu_environment` is set where the user has not set it."""
    from lm_eval_safe.engines.vllm.args import (
        apply_defaults,
        cpu_environment,
        is_cpu_platform,
        member_engine_args,
    )

    # vLLM logs every engine's configuration and CPU hints at INFO/WARNING; this package is
    # quiet by default (VLLM_LOGGING_LEVEL=INFO shows vLLM's own log). Read when vllm is imported.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    args = member_engine_args(options.engine_args, len(indices))
    on_cpu = is_cpu_platform()
    gpus: list[tuple[int, ...] | None] = []
    for i, member_args in zip(indices, args, strict=True):
        placement = placements[i]
        tp = int(member_args.get("tensor_parallel_size", 1))
        if placement.device_map:
            raise OptionError(
                f"member_devices entry auto for vLLM member {options.members[i]!r}: spread a "
                "member over GPUs with tensor_parallel_size= instead"
            )
        if on_cpu:
            gpus.append(None)
        elif options.member_devices is not None and ":" in placement.device:
            first = int(placement.device.split(":")[1])
            gpus.append(tuple(range(first, first + tp)))
        elif world_size > 1:
            gpus.append(tuple(range(local_rank * tp, (local_rank + 1) * tp)))
        else:
            gpus.append(None)
    apply_defaults(args, on_cpu, gpus)
    if on_cpu:
        environment = cpu_environment()
        if world_size > 1:  # other ranks' engines must not share this process's threads' cores
            environment.pop("VLLM_ENABLE_V1_MULTIPROCESSING")
            environment.pop("VLLM_CPU_OMP_THREADS_BIND")
        if any(int(a.get("tensor_parallel_size", 1)) > 1 for a in args):
            environment.pop("VLLM_CPU_OMP_THREADS_BIND")  # one core list per rank: vLLM's own
        chosen = {k: v for k, v in environment.items() if k not in os.environ}
        os.environ.update(chosen)
        if chosen:
            logger.info("vLLM on CPU: %s (set them to choose otherwise)", chosen)
    return [{"engine_args": a, "gpus": g} for a, g in zip(args, gpus, strict=True)]
