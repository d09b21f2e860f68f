"""Whether a model's rows may share a ``llama_decode`` (the load-time check).

A row decoded together with others must get the distributions it gets alone, or a request's
text would depend on what it was batched with. On llama.cpp's CPU kernels every output row of a
matrix product and of attention is computed on its own, so most models give bit-identical logits
either way; where a model's do not (see ``docs/engines.md``), its rows are decoded one
``llama_decode`` each: still sequences of one context (rollback and prefix copies stay), only
the matrix products are not shared. Decided by running the model, not by a list of names.
"""

from __future__ import annotations

import torch

from lm_eval_safe.engines.llama_cpp.native import Model

#: Short, different prompts (token ids from the tokenizer's own range are enough: the check is
#: of arithmetic, not of text), each fed and then stepped greedily.
PROBE_LENGTHS = (7, 12, 5, 9, 30, 17, 3, 24)
PROBE_STEPS = 1
#: Largest difference of logits still counted as equal (they are bit-identical where rows are
#: independent; anything else shows as differences of whole units)
TOLERANCE = 1e-4


def _prompts(n_vocab: int, rows: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    span = min(n_vocab, 30000)
    return [
        [int(t) for t in torch.randint(100, span, (PROBE_LENGTHS[i % len(PROBE_LENGTHS)],), generator=generator)]
        for i in range(rows)
    ]


def _run(model: Model, prompts: list[list[int]], together: bool) -> list[torch.Tensor]:
    """Each prompt's logits after its prompt and after each of ``PROBE_STEPS`` greedy tokens,
    the prompts as sequences ``0..n-1`` of one decode (``together``) or each alone."""
    model.clear()
    groups = [list(range(len(prompts)))] if together else [[i] for i in range(len(prompts))]
    rows: list[list[torch.Tensor]] = [[] for _ in prompts]
    for group in groups:
        if not together:
            model.clear()
        sequences = {i: list(prompts[i]) for i in group}
        fed = dict.fromkeys(group, 0)
        for _ in range(PROBE_STEPS + 1):
            entries = []
            for i in group:
                seq = sequences[i]
                for p in range(fed[i], len(seq)):
                    entries.append((seq[p], p, i if together else 0, p == len(seq) - 1))
                fed[i] = len(seq)
            logits = model.decode(entries)
            for k, i in enumerate(group):
                rows[i].append(logits[k])
                sequences[i].append(int(torch.argmax(logits[k])))
    model.clear()
    return [torch.stack(r) for r in rows]


def rows_agree(model: Model) -> tuple[bool, float]:
    """Whether rows decoded together get the logits they get alone, and the largest
    difference seen."""
    count = min(len(PROBE_LENGTHS), model.settings.n_seq_max)  # up to 8 rows, 107 ids
    if count < 2:
        return True, 0.0
    prompts = _prompts(model.n_vocab, count)
    together = _run(model, prompts, True)
    alone = _run(model, prompts, False)
    worst = max(float((a - b).abs().max()) for a, b in zip(together, alone, strict=True))
    return worst <= TOLERANCE, worst
