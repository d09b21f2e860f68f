#!/usr/bin/env python3
"""Memory of a long generation run (issue 13 §2): RSS after 50, 100 and 200 requests.

Why it measures what it does
----------------------------
* A long evaluation must not grow per request: verifier rows, KV caches, statistics and
  caches all have to be freed or bounded. The script sends ``--requests`` generate requests
  through ``SafeEnsembleLM.generate_until`` (the path lm-eval takes, batching and the cache
  hook included) and samples the process at chosen request counts.
* Samples are taken when a request finishes, from the cache hook lm-eval itself would be
  handed (``add_partial``), so the run is one call as in lm-eval, not many small ones.
* Four numbers per sample: RSS (what the OS charges, allocator slack included), RSS after
  ``malloc_trim`` (slack returned: what is really in use), the bytes of live torch tensors (weights plus KV caches and kept distributions: the part a leak in the
  decoder would grow), and the count of live Python objects (a per-request leak of dicts or
  lists shows here first). Between the first and last mid-run samples the batch holds the same
  number of rows, so the numbers should be level.
* ``--ignore-eos`` (default on) masks every member's EOS in its output layer, so each request
  generates exactly ``--max-new-tokens`` tokens; batching still applies (the mask is a hook on
  the output layer, which the batched forward calls too). Texts are not answers then.

Example (the real members; ~1 h on 2 CPU cores)::

    .venv/bin/python scripts/bench_memory.py --members smollm2-135m,gemma3-270m \\
        --requests 200 --max-new-tokens 256 --batch-size 8
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DATA_DIR = REPO_ROOT.parent / "shared" / "data"
MIB = 1 << 20


def rss_mib() -> float:
    """Current resident set size of this process (not the peak) in MiB."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import psutil  # not Linux: fall back to psutil if it is installed

    return psutil.Process().memory_info().rss / MIB


def trimmed_rss_mib() -> float:
    """RSS after asking glibc to return freed heap pages to the OS (``malloc_trim``).

    Plain RSS also counts memory the allocator keeps after ``free`` (fragmentation from
    tensors of ever-changing sizes); if RSS grows but trimmed RSS does not, nothing is alive
    that should not be. Elsewhere (no glibc) this is plain RSS."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    return rss_mib()


def live_tensor_mib() -> float:
    """Bytes of every live torch tensor's storage, each storage counted once, in MiB."""
    import torch

    seen: set[int] = set()
    total = 0
    with warnings.catch_warnings():  # isinstance on deprecated torch objects warns
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            try:
                if not isinstance(obj, torch.Tensor):
                    continue
                storage = obj.untyped_storage()
            except Exception:  # noqa: BLE001 - exotic objects (lazy modules, meta tensors)
                continue
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total / MIB


class MemoryProbe:
    """A stand-in for lm-eval's cache hook that samples memory when the n-th request ends."""

    def __init__(self, at: list[int]):
        self.at = set(at)
        self.done = 0
        self.samples: dict[int, dict[str, float]] = {}

    def add_partial(self, attr: str, req: Any, res: Any) -> None:
        self.done += 1
        if self.done in self.at:
            gc.collect()
            self.samples[self.done] = {
                "rss_mib": round(rss_mib(), 1),
                "trimmed_rss_mib": round(trimmed_rss_mib(), 1),
                "tensor_mib": round(live_tensor_mib(), 2),
                "objects": len(gc.get_objects()),
                "seconds": round(time.perf_counter(), 1),
            }
            print(
                f"after {self.done} requests: {self.samples[self.done]}",
                file=sys.stderr,
                flush=True,
            )


def mask_eos(lm: Any) -> None:
    """Make no member ever predict EOS (a hook on each output layer), so every request runs to
    its token budget; batched forwards call the same layer and see the same mask."""
    import torch

    for member in lm.members:
        eos = torch.tensor(sorted(member.eos_ids), dtype=torch.long)
        head = member.model.get_output_embeddings()

        def hook(_module: Any, _inputs: Any, logits: torch.Tensor, eos: torch.Tensor = eos) -> Any:
            return logits.index_fill(-1, eos.to(logits.device), float("-inf"))

        head.register_forward_hook(hook)


def gsm8k_prompts(data_dir: Path, n: int) -> list[str]:
    """``n`` GSM8K questions (cycled when ``n`` exceeds the file) in the paper's math prompt."""
    lines = [line for line in (data_dir / "gsm8k" / "test.jsonl").read_text().splitlines() if line]
    questions = [json.loads(lines[i % len(lines)])["question"] for i in range(n)]
    return [
        f"{q} Please reason step by step, and put your final answer within \\boxed{{}}."
        for q in questions
    ]


def run(
    lm: Any, contexts: list[str], max_new_tokens: int, at: list[int]
) -> tuple[MemoryProbe, list[str]]:
    """Generate one request per context in one ``generate_until`` call, sampling memory."""
    from lm_eval.api.instance import Instance

    probe = MemoryProbe(at)
    lm.set_cache_hook(probe)
    requests = [
        Instance("generate_until", {}, (c, {"until": [], "max_gen_toks": max_new_tokens}), i)
        for i, c in enumerate(contexts)
    ]
    return probe, lm.generate_until(requests, disable_tqdm=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--members", default="smollm2-135m,gemma3-270m")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--at", default="50,100,200", help="request counts to sample at")
    parser.add_argument("--model-args-extra", default="", help="e.g. schedule=every,dtype=float32")
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR)
    parser.add_argument("--no-chat-template", action="store_true")
    parser.add_argument(
        "--keep-eos", action="store_true", help="let requests end at EOS (default: masked)"
    )
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)

    import torch

    from lm_eval_safe.model import SafeEnsembleLM
    from lm_eval_safe.options import parse_model_args

    if args.threads:
        torch.set_num_threads(args.threads)
    at = sorted({int(x) for x in args.at.split(",") if x})
    extra = parse_model_args(args.model_args_extra)
    started = time.perf_counter()
    lm = SafeEnsembleLM(members=args.members, batch_size=args.batch_size, **extra)
    print(f"loaded {args.members} in {time.perf_counter() - started:.0f}s, RSS {rss_mib():.0f} MiB")
    if not args.keep_eos:
        mask_eos(lm)
    prompts = gsm8k_prompts(args.data_dir, args.requests)
    contexts = (
        prompts
        if args.no_chat_template
        else [lm.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    )
    before = rss_mib()
    start = time.perf_counter()
    probe, _ = run(lm, contexts, args.max_new_tokens, at)
    stats = lm.run_stats
    print(
        f"{args.requests} requests x {args.max_new_tokens} new tokens, batch_size "
        f"{args.batch_size}, members {args.members}, torch threads {torch.get_num_threads()}: "
        f"{stats.generated_tokens} tokens in {time.perf_counter() - start:.0f}s "
        f"(E/T {stats.ensemble_rate:.2f}%); RSS before the first request {before:.0f} MiB"
    )
    print(
        "| requests done | RSS MiB | RSS after malloc_trim MiB | live tensors MiB | Python objects |"
    )
    print("|---:|---:|---:|---:|---:|")
    for count, sample in sorted(probe.samples.items()):
        print(
            f"| {count} | {sample['rss_mib']:.0f} | {sample['trimmed_rss_mib']:.0f} | "
            f"{sample['tensor_mib']:.1f} | {sample['objects']} |"
        )
    print(f"request_stats kept: {len(lm.request_stats)} (bounded)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
