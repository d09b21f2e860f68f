#!/usr/bin/env python3
"""Check that ``safe-ensemble`` puts each member where it was asked to, and still works there.

Why it exists
-------------
Placement (``device=``, ``member_devices=``, ``member_devices=...,auto`` for a member spread by
accelerate over several GPUs) only matters on GPU machines, which CI does not have. This script
is the short check to run on one: it loads the ensemble through :class:`SafeEnsembleLM` exactly
as lm-eval would, checks that every member's weights sit on the requested device(s) and that
input ids go to the device of each member's input embeddings, then runs one ``generate_until``
and one multiple-choice ``loglikelihood`` (a shared context, multi-token choices: the path that
copies KV-cache rows between choices). One PASS/FAIL line per check; exit status 1 on a failure,
2 when the ensemble cannot even be built (e.g. a device the machine lacks).

It runs on CPU too, so it is smoke-tested in CI with tiny models (``--member-devices cpu,cpu``).

Example (a machine with two GPUs: the paper's one GPU per member)::

    python scripts/check_gpu_placement.py --members smollm2-135m,gemma3-270m --member-devices cuda:0,cuda:1
    python scripts/check_gpu_placement.py --member-devices cuda:0,auto   # 2nd member spread over GPUs
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--members", default="smollm2-135m,gemma3-270m", help="comma list of member specs"
    )
    p.add_argument(
        "--member-devices",
        default=None,
        help="one device per member (cpu, cuda:N, mps, or auto = device_map over the GPUs); "
        "default: every member on --device",
    )
    p.add_argument("--device", default=None, help="device of all members without --member-devices")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-gen-toks", type=int, default=16)
    return p.parse_args(argv)


def same_device(actual: Any, wanted: str) -> bool:
    """Whether torch device ``actual`` is ``wanted`` (``cuda`` means the current CUDA device)."""
    import torch

    want = torch.device(wanted)
    if want.type == "cuda" and want.index is None:
        want = torch.device("cuda", torch.cuda.current_device())
    if want.type != actual.type:
        return False
    return want.type != "cuda" or want.index == actual.index


class Report:
    """PASS/FAIL lines, printed as they come; ``failed`` decides the exit status."""

    def __init__(self) -> None:
        self.failed = 0

    def check(self, ok: bool, name: str, detail: str) -> None:
        print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
        self.failed += not ok


def check_placement(lm: Any, report: Report) -> None:
    """Every member's weights on its planned device(s); inputs on its embeddings' device."""
    for member, placement in zip(lm.members, lm.placements, strict=True):
        devices = member.engine.parameter_devices()
        if placement.device_map:
            ok = all(d.startswith("cuda") for d in devices)
            detail = f"device_map={placement.device_map} spread over {', '.join(devices)}"
            if not ok:
                detail += " (some weights offloaded off the GPUs: the member does not fit them)"
        else:
            ok = len(devices) == 1 and same_device(
                next(member.engine.model.parameters()).device, placement.device
            )
            detail = f"weights on {', '.join(devices)} (wanted {placement.device})"
        report.check(ok, f"placement {member.name}", detail)
        wanted = "cuda" if placement.device_map else placement.device
        where = member.engine.input_device
        report.check(
            str(where) in devices
            and (where.type == wanted if placement.device_map else same_device(where, wanted)),
            f"input device {member.name}",
            f"input ids go to {member.engine.input_device} (its input embeddings' device)",
        )


def check_requests(lm: Any, report: Report, max_gen_toks: int) -> None:
    """One generation and one multiple-choice question through the lm-eval entry points."""
    from lm_eval.api.instance import Instance

    gen = Instance(
        request_type="generate_until",
        doc={},
        arguments=(
            "Question: What is 2 + 3?\nAnswer:",
            {"until": ["\n\n"], "max_gen_toks": max_gen_toks},
        ),
        idx=0,
    )
    try:
        (text,) = lm.generate_until([gen], disable_tqdm=True)
        report.check(isinstance(text, str), "generate_until", repr(text[:80]))
    except Exception as exc:  # noqa: BLE001 - a check reports every failure, then moves on
        report.check(False, "generate_until", f"{type(exc).__name__}: {exc}")
    context = "The capital of France is"
    choices = [" Paris, the largest city of France.", " Lyon, on the Rhone river."]
    requests = [
        Instance(request_type="loglikelihood", doc={}, arguments=(context, c), idx=i)
        for i, c in enumerate(choices)
    ]
    try:
        scores = lm.loglikelihood(requests, disable_tqdm=True)
        ok = len(scores) == 2 and all(
            math.isfinite(lp) and lp < 0 and isinstance(g, bool) for lp, g in scores
        )
        report.check(ok, "loglikelihood", ", ".join(f"{lp:.3f}" for lp, _ in scores))
    except Exception as exc:  # noqa: BLE001
        report.check(False, "loglikelihood", f"{type(exc).__name__}: {exc}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from lm_eval_safe.errors import OptionError
    from lm_eval_safe.harness.model import SafeEnsembleLM

    options: dict[str, Any] = {"members": args.members, "dtype": args.dtype}
    if args.device:
        options["device"] = args.device
    if args.member_devices:
        options["member_devices"] = args.member_devices
    report = Report()
    try:
        lm = SafeEnsembleLM(**options)
    except OptionError as exc:
        report.check(False, "load", str(exc))
        return 2
    report.check(True, "load", ", ".join(f"{m.name} ({m.dtype})" for m in lm.members))
    check_placement(lm, report)
    check_requests(lm, report, args.max_gen_toks)
    print(f"{'FAILED' if report.failed else 'ALL PASSED'}: {report.failed} failing check(s)")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
