"""Where each member's weights go: ``device=``, ``member_devices=`` and data-parallel processes.

The decision is a pure function of the options and of what the machine has (how many CUDA
devices, whether MPS works), passed in rather than read from torch, so every rule here is
unit-tested on a CPU-only machine with a pretend GPU count. A device the machine does not have
is an :class:`OptionError` that says what to type instead, never a silent fallback to cpu: a
run that was meant for a GPU and quietly runs on cpu takes hours and reports misleading speed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lm_eval_safe.errors import OptionError
from lm_eval_safe.model_args import member_display_name

DEVICE_HINT = "use auto, cpu, cuda, cuda:N or mps"
# lm-eval's CLI passes ``device="cuda:0"`` (its EvaluatorConfig default) whether or not the user
# typed --device; it has to mean "auto" or no CPU run through the CLI could start.
LM_EVAL_CLI_DEFAULT_DEVICE = "cuda:0"


@dataclass(frozen=True)
class Placement:
    """Where one member goes.

    ``device`` is a torch device string (``cpu``, ``cuda``, ``cuda:1``, ``mps``). With
    ``device_map="auto"`` accelerate spreads the member's layers over the visible GPUs
    (a member too large for one GPU); ``device`` is then ``cuda``, which picks the dtype.
    """

    device: str
    device_map: str | None = None


def resolve_device(
    requested: str | None, *, cuda_count: int, mps_available: bool = False, what: str = "device"
) -> str:
    """Canonical device string for ``requested``, or an :class:`OptionError` naming the fix.

    ``None``, ``""`` and ``auto`` mean cuda when a CUDA device is visible, else cpu (MPS is
    never picked implicitly: it is slower than cpu for some models, so it must be asked for).
    """
    import torch

    text = "" if requested is None else str(requested).strip().lower()
    if text in ("", "auto"):
        return "cuda" if cuda_count > 0 else "cpu"
    try:
        parsed = torch.device(text)
    except RuntimeError:
        raise OptionError(
            f"{what}={requested!r} is not a device torch knows; {DEVICE_HINT}"
        ) from None
    if parsed.type == "cpu":
        return "cpu"
    if parsed.type == "cuda":
        if cuda_count <= 0:
            raise OptionError(
                f"{what}={requested!r} but torch sees no CUDA device here (a CPU-only torch build, "
                f"or CUDA_VISIBLE_DEVICES hides the GPUs); use {what}=cpu, or install a CUDA build of torch"
            )
        if parsed.index is not None and parsed.index >= cuda_count:
            raise OptionError(
                f"{what}={requested!r} but only {cuda_count} CUDA device(s) are visible "
                f"(cuda:0 to cuda:{cuda_count - 1}); pick one of those"
            )
        return str(parsed)
    if parsed.type == "mps":
        if not mps_available:
            raise OptionError(
                f"{what}={requested!r} but MPS is not available (it needs Apple silicon and a "
                f"torch build with MPS); use {what}=cpu"
            )
        return "mps"
    raise OptionError(
        f"{what}={requested!r}: safe-ensemble runs on cpu, cuda or mps; {DEVICE_HINT}"
    )


def plan_placement(
    members: list[str],
    device: str | None,
    member_devices: list[str] | None,
    *,
    cuda_count: int,
    mps_available: bool = False,
    world_size: int = 1,
    process_device: str | None = None,
) -> list[Placement]:
    """One :class:`Placement` per member spec in ``members``.

    - Without ``member_devices`` every member goes on ``device`` (default: cuda if visible,
      else cpu). In a data-parallel run on GPUs (``process_device`` is this process's
      ``cuda:<local rank>``) a ``device`` of ``auto``/``cuda``/``cuda:N`` becomes that GPU, so
      processes never share one.
    - ``member_devices`` gives one entry per member: a device, or ``auto`` for a member too
      large for one device (``device_map="auto"`` over the GPUs; plain cpu when there is none).
      The paper's setting is one GPU per member: ``member_devices=cuda:0|cuda:1``.
    - ``member_devices`` on GPUs with several processes is refused: every process would load its
      members onto the same GPUs (no per-process GPU sets are planned), overlapping silently.
    """
    if member_devices is None:
        resolved = resolve_device(device, cuda_count=cuda_count, mps_available=mps_available)
        if process_device and resolved.startswith("cuda"):
            resolved = process_device  # data parallel: each process on its own GPU
        return [Placement(resolved) for _ in members]
    if len(member_devices) != len(members):
        raise OptionError(
            f"member_devices has {len(member_devices)} entries for {len(members)} members; "
            "give one per member"
        )
    plan = []
    for spec, entry in zip(members, member_devices, strict=True):
        what = f"member_devices entry for {member_display_name(spec)}"
        if str(entry).strip().lower() == "auto":
            plan.append(Placement("cuda", "auto") if cuda_count > 0 else Placement("cpu"))
        else:
            plan.append(
                Placement(
                    resolve_device(
                        entry, cuda_count=cuda_count, mps_available=mps_available, what=what
                    )
                )
            )
    if world_size > 1 and any(p.device.startswith("cuda") for p in plan):
        raise OptionError(
            f"member_devices={'|'.join(member_devices)} with {world_size} data-parallel processes "
            "would load every process's members onto the same GPUs; run one process with "
            "member_devices, or drop member_devices so each process puts all members on its own GPU"
        )
    return plan


def visible_hardware() -> tuple[int, bool]:
    """(CUDA device count, MPS available) of this process, as torch sees them."""
    import torch

    cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    mps = torch.backends.mps.is_available()
    return cuda_count, mps


def pick_device(requested: str | None) -> str:
    """``requested`` checked against this machine (``auto``/None: cuda if visible, else cpu).

    A device the machine lacks is an :class:`OptionError`, not a warning and a run on cpu: a
    GPU run that silently falls back takes hours and reports CPU speeds as the ensemble's."""
    cuda_count, mps = visible_hardware()
    return resolve_device(requested, cuda_count=cuda_count, mps_available=mps)


def pick_dtype(dtype: str, device: str) -> Any:
    import torch

    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}[dtype]
