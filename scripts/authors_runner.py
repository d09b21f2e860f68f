"""Run the SAFE authors' reference code on a job file written by ``lm-eval-safe bench conformance``.

This is the half of the conformance run that executes *their* code, so it runs in the Python
their code needs, not in this package's: ``lm-eval-safe bench conformance`` starts it with the authors'
folder and a transformers older than 4.54 (their cache pruning reads ``DynamicCache.key_cache``
and ``_seen_tokens``) first on ``PYTHONPATH``. It never imports ``lm_eval_safe`` and never
copies or edits the authors' files; the only changes are made at run time, none to the
algorithm:

- GaC's mapping matrices are built with ``device="cuda"``: on a machine without a GPU the
  sparse tensor is made on the CPU instead (``torch.sparse_coo_tensor`` wrapped while
  ``setup_union_vocab`` runs);
- ``find_special_underscore_token`` compares every ``▁`` token with every other (hours on
  Gemma-3's 262k ids): replaced by :func:`special_underscore_token`, the same result found by
  searching one joined string;
- the members load from the GGUF files the job names, in float32, and their tokenizers from the
  ``tokenizer.json`` files the job's side exported (the tokenizers the project runs with:
  transformers 4.53 reads these GGUF tokenizers differently).

Ensemble points are recorded by wrapping the function each algorithm calls at an ensemble point
(``average_and_sample``, ``get_ensemble_token``) and reading the position from its caller's
frame. Writes one JSON object per case to the job's output file.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast


def special_underscore_token(tokenizer: Any) -> str:
    """What the authors' ``find_special_underscore_token`` returns, without its quadratic scan.

    Their rule: among the tokens that start with ``▁`` (``▁`` itself excluded), keep those that
    are no substring of another such token, hold one ``▁`` only and are not blank once it is
    removed; return the shortest (then lexicographically first) of them without its ``▁``. A
    token occurs in the joined list of all such tokens once as itself, so it is a substring of
    another exactly when it occurs twice (occurrences cannot overlap: a token holds one ``▁``,
    at its start)."""
    vocab = tokenizer.get_vocab()
    g_count = sum(1 for token in vocab if token.startswith("Ġ"))
    u_count = sum(1 for token in vocab if token.startswith("▁"))
    if g_count > u_count:
        return ""
    underscore = [t for t in vocab if t.startswith("▁") and t != "▁"]
    joined = "\x00".join(underscore)
    shortest_first = sorted(
        (t for t in underscore if t.count("▁") == 1 and t[1:].strip() != ""),
        key=lambda t: (len(t) - 1, t[1:]),
    )
    for token in shortest_first:
        if joined.count(token) == 1:
            return token[1:]
    raise ValueError("No special underscore token found that meets the criteria.")


@contextmanager
def sparse_tensors_on_cpu():
    """``torch.sparse_coo_tensor(..., device="cuda")`` made on the CPU while active."""
    original = torch.sparse_coo_tensor

    def on_cpu(*args: Any, **kwargs: Any) -> Any:
        kwargs["device"] = "cpu"
        return original(*args, **kwargs)

    torch.sparse_coo_tensor = on_cpu
    try:
        yield
    finally:
        torch.sparse_coo_tensor = original


def load_tokenizer(spec: dict[str, Any]) -> Any:
    return PreTrainedTokenizerFast(
        tokenizer_file=spec["tokenizer_file"],
        clean_up_tokenization_spaces=spec["clean_up_tokenization_spaces"],
        **{k: v for k, v in spec["special_tokens"].items() if v is not None},
    )


def load_model(spec: dict[str, Any]) -> Any:
    path = Path(spec["gguf"])
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, torch_dtype=torch.float32
    )
    return model.eval()


class PointRecorder:
    """Wraps the function an algorithm calls at each ensemble point; keeps where it was called."""

    def __init__(self, module: Any, name: str):
        self.points: list[dict[str, int]] = []
        original = getattr(module, name)

        def recorded(*args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1).f_locals
            at = caller["current_position"] + caller["num_accepted"]
            self.points.append(
                {
                    "position": at - caller["prompt_len"],
                    "drafted": int(caller["input_ids"][0, at]),
                    "verifier_index": int(caller["num_verify"]),
                }
            )
            return original(*args, **kwargs)

        setattr(module, name, recorded)


def gac_setup(gac_module: Any, models: list[Any], tokenizers: list[Any]) -> dict[str, Any]:
    gac_module.find_special_underscore_token = special_underscore_token
    with sparse_tensors_on_cpu():
        union, matrices, index_to_vocab, byte_maps, prefixes = gac_module.setup_union_vocab(models, tokenizers)
    return {
        "vocab_union": union,
        "mapping_matrices": matrices,
        "index_to_vocab": index_to_vocab,
        "byte_mappings_list": byte_maps,
        "special_prefix_tokens_dict": prefixes,
    }


def run_case(generate: Any, recorder: PointRecorder, case: dict[str, Any], common: dict[str, Any]) -> dict[str, Any]:
    def inputs(ids: list[int]) -> dict[str, torch.Tensor]:
        tensor = torch.tensor([ids], dtype=torch.long)
        return {"input_ids": tensor, "attention_mask": torch.ones_like(tensor)}

    recorder.points.clear()
    start = time.perf_counter()
    ids, accept_rate, ensembles = generate(
        inputs(case["drafter_prompt"]), inputs(case["verifier_prompt"]), **common
    )
    return {
        "id": case["id"],
        "ids": ids[0],
        "points": list(recorder.points),
        "ensemble_ops": ensembles,
        "accept_rate": accept_rate,
        "seconds": round(time.perf_counter() - start, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("job", type=Path)
    parser.add_argument("output", type=Path)
    args = parser.parse_args()
    job = json.loads(args.job.read_text(encoding="utf-8"))
    import safe_generate_gac
    import safe_generate_unite

    torch.set_grad_enabled(False)
    tokenizers = [load_tokenizer(m) for m in job["members"]]
    models = [load_model(m) for m in job["members"]]
    common: dict[str, Any] = {
        "draft_model": models[0],
        "ver_model": models[1],
        "draft_tokenizer": tokenizers[0],
        "ver_tokenizer": tokenizers[1],
        "max_length": job["max_new_tokens"],
        "gamma": job["gamma"],
        "use_cache": True,
        "sharpen_type": job["sharpen_type"],
    }
    if job["aggregator"] == "gac":
        common.update(gac_setup(safe_generate_gac, models, tokenizers))
        generate, recorder = safe_generate_gac.safe_generate_gac, PointRecorder(safe_generate_gac, "get_ensemble_token")
    else:
        generate = safe_generate_unite.safe_generate_unite
        recorder = PointRecorder(safe_generate_unite, "average_and_sample")
    with args.output.open("w", encoding="utf-8") as out:
        out.write(json.dumps({"transformers": transformers.__version__, "torch": torch.__version__}) + "\n")
        for case in job["cases"]:
            out.write(json.dumps(run_case(generate, recorder, case, common)) + "\n")
            out.flush()
            print(f"authors: {case['id']} done", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
