"""One member's token scores of given continuations on the transformers engine, as lm-eval's
HFLM computes them (docs/algorithm.md, Scoring, combines the members' scores: :mod:`lm_eval_safe.scoring.loglikelihood`).

Speed: each member scores all requests in batches of *contexts*. A context shared by several
choices (multiple-choice tasks) goes through the model once; its KV cache is then copied to one
row per choice and only the choices' tokens are fed. The output layer is applied only where a
token is scored (for a 262k vocabulary it costs more than the rest of a small model), and only
the scored token's log-prob and the argmax are kept per position, never a [batch, length,
vocab] tensor of log-probs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from lm_eval_safe.engines.base import MemberEngine, Progress, ScorePairs, TokenScores
from lm_eval_safe.engines.hf import kv_cache, model_calls
from lm_eval_safe.engines.hf.forward import vocab_logits
from lm_eval_safe.engines.scoring import check_pair
from lm_eval_safe.members.member import Member

logger = logging.getLogger(__name__)

# Most logits (floats) one forward call may hold: 2**25 floats = 128 MiB in float32. Bounds the
# memory of long continuations (perplexity windows) against 262k-entry vocabularies.
LOGITS_BUDGET = 1 << 25
# batch_size=auto: contexts per batch such that batch x longest context stays under this many
# tokens (a CPU-friendly size; a GPU user wanting more gives an integer batch size).
AUTO_BATCH_TOKENS = 8192


@dataclass
class _Group:
    """Requests of one member that share the same (windowed) context ids."""

    ctx: list[int]
    items: list[tuple[int, list[int]]] = field(default_factory=list)  # (pair index, cont ids)

    @property
    def length(self) -> int:
        return len(self.ctx) + max(len(cont) for _, cont in self.items) - 1


def _group_pairs(member: Member, pairs: ScorePairs) -> list[_Group]:
    """Window each pair as HFLM does (left-truncate context+continuation to max_length + 1) and
    group pairs whose windowed contexts are identical, so each context runs once."""
    limit = member.max_length
    groups: dict[tuple[int, ...], _Group] = {}
    for index, (ctx, cont) in enumerate(pairs):
        check_pair(member, index, ctx, cont)
        if len(ctx) + len(cont) > limit + 1:
            logger.warning(
                "context+continuation (%d tokens) exceed %s's window %d; truncating from the left",
                len(ctx) + len(cont),
                member.name,
                limit,
            )
            ctx = ctx[len(ctx) + len(cont) - limit - 1 :]
        key = tuple(ctx)
        groups.setdefault(key, _Group(list(ctx))).items.append((index, cont))
    return list(groups.values())


def _batches(
    groups: list[_Group], batch_size: int | str, max_batch_size: int, by_prefix: bool = False
) -> list[list[_Group]]:
    """Longest first (as lm-eval's Collator: padding stays small, out-of-memory shows at once),
    or with ``by_prefix`` (a prefix store) in the order of the context ids, so contexts sharing
    exemplars are scored one after another and the store needs to hold only their prefix;
    ``batch_size`` contexts per batch, or for ``auto`` as many as fit the token budget."""
    if by_prefix:
        ordered = sorted(groups, key=lambda g: g.ctx)
    else:
        ordered = sorted(groups, key=lambda g: (-g.length, g.ctx))
    out: list[list[_Group]] = []
    for group in ordered:
        if out:
            batch = out[-1]
            if batch_size == "auto":
                longest = max(group.length, *(g.length for g in batch))
                fits = (len(batch) + 1) * longest <= AUTO_BATCH_TOKENS
                fits = fits and len(batch) < max_batch_size
            else:
                fits = len(batch) < max(1, int(batch_size))
            if fits:
                batch.append(group)
                continue
        out.append([group])
    return out


def _pick(
    logits: torch.Tensor, targets: torch.Tensor, vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each target and whether it is the argmax, from raw logits [..., V'].

    Columns past the tokenizer's size (padded embedding rows) are not tokens and are dropped.
    logsumexp instead of log_softmax: nothing of vocabulary size is materialised twice."""
    logits = vocab_logits(logits, vocab)
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    return picked, logits.argmax(dim=-1) == targets


def _left_padded(ids: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``ids`` right-aligned in one tensor, and the mask of their real tokens."""
    width = max(len(row) for row in ids)
    padded = torch.full((len(ids), width), pad, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for b, row in enumerate(ids):
        padded[b, width - len(row) :] = torch.tensor(row)
        mask[b, width - len(row) :] = 1
    return padded, mask


def _contexts_forward(
    member: Member, contexts: list[list[int]], keep_cache: bool
) -> tuple[torch.Tensor, Any]:
    """Logits after each context's last token and (``keep_cache``) a left-padded cache of the
    contexts' states, as one left-padded batched forward computes them.

    When the member's prefix store holds a prefix of some context (few-shot exemplars scored
    before), each context instead runs alone from its longest stored prefix and the states
    are laid out left-padded afterwards. Either way each context's blocks go to the store."""
    model, vocab = member.engine.model, len(member.vocab)
    device = member.engine.input_device  # not model.device: under device_map the embeddings decide
    store = member.engine.prefix_store
    keep_cache = keep_cache or store is not None
    width = max(len(ctx) for ctx in contexts)
    if store is not None and any(store.longest(ctx) for ctx in contexts):
        caches, firsts = [], []
        for ctx in contexts:
            reused, cache = store.lookup(ctx)
            logits = model_calls.run(
                model, cache, input_ids=torch.tensor([ctx[reused:]], device=device), logits_to_keep=1
            ).logits
            firsts.append(vocab_logits(logits[0, -1], vocab))
            store.add(ctx, cache)
            caches.append(cache)
        return torch.stack(firsts), kv_cache.stack_left_padded(caches, width)
    ids, mask = _left_padded(contexts, member.tokenizer.pad_token_id or 0)
    extra: dict[str, torch.Tensor] = {}
    if any(len(ctx) != width for ctx in contexts):  # positions count real tokens, pads masked
        extra = {
            "attention_mask": mask.to(device),
            "position_ids": (mask.cumsum(-1) - 1).clamp(min=0).to(device),
        }
    cache = kv_cache.new_cache() if keep_cache else None
    logits = model_calls.run(model, cache, input_ids=ids.to(device), logits_to_keep=1, **extra).logits
    if store is not None:
        for b, ctx in enumerate(contexts):
            store.looked_up_tokens += len(ctx)
            store.add(ctx, cache, row=b, offset=width - len(ctx))
    return vocab_logits(logits[:, -1], vocab), cache


@torch.inference_mode()
def _score_batch(
    member: Member, batch: list[_Group], out: list[TokenScores | None]
) -> None:
    """Two forward calls per batch: the contexts (left-padded, logits at the last position only),
    then every choice's tokens after its context's cached keys/values."""
    model, vocab = member.engine.model, len(member.vocab)
    device = member.engine.input_device  # not model.device: under device_map the embeddings decide
    pad = member.tokenizer.pad_token_id or 0
    lengths = [len(g.ctx) for g in batch]
    _, mask = _left_padded([g.ctx for g in batch], pad)
    padded = min(lengths) != max(lengths)
    rows = [
        (b, index, cont) for b, g in enumerate(batch) for index, cont in g.items if len(cont) > 1
    ]
    first_logits, cache = _contexts_forward(member, [g.ctx for g in batch], bool(rows))
    lse = torch.logsumexp(first_logits, dim=-1)
    top = first_logits.argmax(dim=-1)
    for b, group in enumerate(batch):
        for index, cont in group.items:
            lp = float(first_logits[b, cont[0]] - lse[b])
            out[index] = ([lp], [int(top[b]) == cont[0]])
    del first_logits
    if not rows:
        return
    # one row per multi-token choice; right padding at the end is never attended by real tokens
    row_groups = torch.tensor([b for b, _, _ in rows], dtype=torch.long)
    feed_len = max(len(cont) - 1 for _, _, cont in rows)
    feed = torch.full((len(rows), feed_len), pad, dtype=torch.long)
    targets = torch.zeros((len(rows), feed_len), dtype=torch.long)
    for r, (_, _, cont) in enumerate(rows):
        feed[r, : len(cont) - 1] = torch.tensor(cont[:-1])
        targets[r, : len(cont) - 1] = torch.tensor(cont[1:])
    cache = kv_cache.select_rows(cache, row_groups)
    ctx_mask = mask[row_groups]
    base = torch.tensor(lengths, dtype=torch.long)[row_groups]
    step = max(1, LOGITS_BUDGET // max(1, len(rows) * vocab))
    lps, greedy = [], []
    for start in range(0, feed_len, step):  # position chunks bound the logits' memory
        stop = min(feed_len, start + step)
        extra = {}
        if padded:
            extra = {
                "attention_mask": torch.cat(
                    [ctx_mask, torch.ones((len(rows), stop), dtype=torch.long)], dim=1
                ).to(device),
                "position_ids": (base.unsqueeze(1) + torch.arange(start, stop)).to(device),
            }
        logits = model_calls.run(model, cache, input_ids=feed[:, start:stop].to(device), **extra).logits
        lp, hit = _pick(logits, targets[:, start:stop].to(logits.device), vocab)
        lps.append(lp.cpu())
        greedy.append(hit.cpu())
    all_lp, all_greedy = torch.cat(lps, dim=1), torch.cat(greedy, dim=1)
    for r, (_, index, cont) in enumerate(rows):
        scored = out[index]
        assert scored is not None
        scored[0].extend(all_lp[r, : len(cont) - 1].tolist())
        scored[1].extend(all_greedy[r, : len(cont) - 1].tolist())


def score_tokens(
    engine: MemberEngine,
    pairs: ScorePairs,
    batch_size: int | str,
    max_batch_size: int,
    progress: Progress | None = None,
) -> list[TokenScores]:
    """:meth:`~lm_eval_safe.engines.base.MemberEngine.score_tokens` on the transformers engine:
    as lm-eval's HFLM computes them (same windowing), with each distinct context run once per
    member.

    Raises :class:`ScoringError` (naming the pair) for an empty continuation or one longer than
    the member's window, before anything runs."""
    member = engine.member
    groups = _group_pairs(member, pairs)
    out: list[TokenScores | None] = [None] * len(pairs)
    for batch in _batches(groups, batch_size, max_batch_size, member.engine.prefix_store is not None):
        _score_batch(member, batch, out)
        if progress is not None:
            progress(sum(len(g.items) for g in batch))
    assert all(o is not None for o in out)
    return out  # type: ignore[return-value]


