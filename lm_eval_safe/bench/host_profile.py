"""Where SAFE's host time goes (``lm-eval-safe bench host --profile CONFIG:BATCH``): a sampling
profile of one run with the members' forwards cut out, the rest summed by the part of a SAFE
cycle that spent it.

Why a sampling profiler: a deterministic one (``cProfile``) charges each Python call a fixed
cost, which inflates exactly the many small calls between forwards that are being measured;
pyinstrument samples the stack every ``interval`` seconds and costs the same wherever the
program is. It is not a dependency of this package: the option asks for it by name.

Every sample outside the forwards (the outermost ``nn.Module`` call: a forward's own Python and
kernels) is charged to the innermost frame of this package on its stack (time in torch or a
tokenizer goes to the code of ours that called it), and that frame's module and function name
the part (:data:`PARTS`, first match wins).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from lm_eval_safe.decoder.loop import GenerationJob, SafeDecoder
from lm_eval_safe.decoder.stats import total
from lm_eval_safe.errors import UserError

#: (part, module path inside the package, function names or None for all): the parts of a
#: cycle, in the order they are matched
PARTS: list[tuple[str, str, tuple[str, ...] | None]] = [
    ("KV moves (rows, splices, compaction, prefix store)", "engines/hf/kv_cache.py", None),
    ("KV moves (rows, splices, compaction, prefix store)", "engines/hf/slot_layers.py", None),
    ("KV moves (rows, splices, compaction, prefix store)", "engines/hf/cache_rows.py", None),
    ("KV moves (rows, splices, compaction, prefix store)", "engines/hf/packed_slots.py", None),
    ("KV moves (rows, splices, compaction, prefix store)", "engines/hf/prefix_cache.py", None),
    ("KV moves (rows, splices, compaction, prefix store)", "engines/hf/batch.py", ("_prefill_alone",)),
    ("heads: log-softmax, argmax, top-k, read-back", "engines/hf/heads.py", None),
    ("heads: log-softmax, argmax, top-k, read-back", "engines/hf/batch.py", ("answer_completes",)),
    ("forward inputs: ids, positions, masks", "engines/hf/", None),
    ("drafting bookkeeping", "decoder/member_runs.py", ("draft", "_draft", "draft_ahead", "carry", "rewind")),
    ("verifier re-tokenizing and feeding", "decoder/member_runs.py", None),
    ("verifier re-tokenizing and feeding", "members/vocabulary.py", ("encode_text", "token_ends")),
    ("alignment and consensus gate", "decoder/schedules.py", None),
    ("alignment and consensus gate", "ensemble/consensus.py", None),
    ("alignment and consensus gate", "ensemble/certified.py", ("certified_consensus",)),
    ("alignment and consensus gate", "members/vocabulary.py", None),
    ("decisions at ensemble points", "ensemble/", None),
    ("batch driver", "decoder/batch_driver.py", None),
    ("batch driver", "engines/base.py", None),
    ("decoder loop: text, stops, statistics", "decoder/", None),
    ("decoder loop: text, stops, statistics", "", None),
]

_FORWARD_CALLS = {"_call_impl", "_wrapped_call_impl"}  # torch.nn.Module.__call__
_PACKAGE = "lm_eval_safe/"


def part_of(path: str, function: str) -> str:
    """The part a frame of this package (``path`` inside it) belongs to."""
    for part, prefix, functions in PARTS:
        if path.startswith(prefix) and (functions is None or function in functions):
            return part
    return "other"


def profile_run(
    decoder: SafeDecoder, jobs: Sequence[GenerationJob], batch_size: int, interval: float = 0.0002
) -> dict[str, Any]:
    """One ``generate_many`` under the sampling profiler: seconds outside the forwards by part,
    per generated token and per cycle, and the seconds sampled inside the forwards."""
    try:
        from pyinstrument import Profiler
    except ImportError as exc:
        raise UserError("--profile samples with pyinstrument: pip install pyinstrument") from exc
    for member in (decoder.drafter, *decoder.verifiers):
        member.engine.forget_prefixes()
    profiler = Profiler(interval=interval)
    profiler.start()
    start = time.perf_counter()
    results = decoder.generate_many(list(jobs), batch_size)
    wall = time.perf_counter() - start
    profiler.stop()
    seconds: dict[str, float] = defaultdict(float)
    inside = _charge(profiler.last_session.root_frame(), "other", seconds)
    done = total(stats for _, stats in results)
    tokens, cycles = max(1, done.generated_tokens), max(1, done.cycles)
    outside = sum(seconds.values())
    return {
        "wall_s": round(wall, 3),
        "sampled_in_forwards_s": round(inside, 3),
        "sampled_outside_s": round(outside, 3),
        "tokens": done.generated_tokens,
        "cycles": done.cycles,
        "parts": [
            {
                "part": part,
                "ms_per_token": round(1e3 * s / tokens, 3),
                "ms_per_cycle": round(1e3 * s / cycles, 3),
                "share": round(s / outside, 3) if outside else 0.0,
            }
            for part, s in sorted(seconds.items(), key=lambda item: -item[1])
        ],
    }


def _charge(frame: Any, part: str, seconds: dict[str, float]) -> float:
    """Charge ``frame``'s samples outside the forwards to parts; returns the seconds inside."""
    if frame.function in _FORWARD_CALLS:
        return frame.time
    path = (frame.file_path or "").replace("\\", "/")
    if _PACKAGE in path:
        part = part_of(path.rsplit(_PACKAGE, 1)[1], frame.function)
    inside = sum(_charge(child, part, seconds) for child in frame.children)
    seconds[part] += frame.time - sum(child.time for child in frame.children)
    return inside


def profile_table(report: dict[str, Any]) -> str:
    lines = [
        f"{report['tokens']} tokens, {report['cycles']} cycles; sampled outside the forwards "
        f"{report['sampled_outside_s']:.3f} s, inside {report['sampled_in_forwards_s']:.3f} s",
        "",
        "| part of the cycle | ms/token | ms/cycle | share |",
        "|---|---:|---:|---:|",
    ]
    lines += [
        f"| {p['part']} | {p['ms_per_token']:.3f} | {p['ms_per_cycle']:.3f} | {100 * p['share']:.0f}% |"
        for p in report["parts"]
    ]
    return "\n".join(lines)
