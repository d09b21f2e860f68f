"""What the transformers engine reads back from the device: the head of each distribution.

The decoder needs the whole next-token distribution only at the rare ensemble points that a
head cannot settle (:mod:`lm_eval_safe.ensemble.certified`); everywhere else it reads a drafted token,
its probability, a verifier's argmax and its probability of its own next token. So a forward's
log-softmax rows stay on the member's device, and one copy per batch step brings back, for
every answered position at once, what its caller asked for (a :class:`Want`): the argmax and
its log-prob, the ``top`` most probable ids, and the log-probs of a few named ids. A
:class:`~lm_eval_safe.engines.base.Complete` call later copies the full rows it names.

The head is cut from exactly the tensor the full row would be: every log-prob it holds is the
float the full row holds, its first id is ``torch.argmax``'s (the first of equal maxima), and a
decision taken from it is the one taken from the full row or none at all.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lm_eval_safe.engines.base import TopLogprobs, argmax_first, widened

#: Where a row's largest logit is at least this, the log-softmax's argmax is the logits' own,
#: so a caller that reads the drafted token only is answered without computing the log-softmax.
#: Why: the log-softmax subtracts one constant from every logit, ``(x - m) - L`` with ``m`` the
#: largest logit and ``L = log(sum(exp(x - m)))`` at most ``log(vocab) < 16``; rounding is
#: monotonic, so no order is reversed, and two ids the logits tell apart become equal only if
#: their logits are closer than half the float spacing at ``L``. A logit next to ``m >= 16`` is
#: at least the spacing at 8..16 away, which is no less than the spacing at ``L``. Equal logits
#: stay equal, and both argmaxes take the first of them. Rows below it take the exact path.
EXACT_ARGMAX_LOGIT = 16.0


@functools.cache
def _block_size(width: int) -> int | None:
    """The divisor of a vocabulary size nearest 1024 within 256..4096 (262144: 1024; Qwen's
    151936: 1187), or None (the row is searched by ``max`` itself)."""
    divisors = [b for b in range(256, 4097) if width % b == 0]
    return min(divisors, key=lambda b: abs(b - 1024)) if divisors else None


def largest(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows.max(dim=-1)`` of a ``[positions, vocab]`` tensor: each row's largest value and the
    first id holding it, bit for bit.

    On a CPU ``max`` with indices walks a 262k vocabulary element by element (0.6 ms a row here,
    longer than the log-softmax), while ``amax`` is vectorised (0.03 ms): the largest value of
    each block of ids, then ``max`` over those few block values finds the first block holding
    the row's largest (or its first NaN, which ``max`` returns too), and ``max`` inside that
    block alone the first id. A GPU runs ``max`` in one kernel, where the extra launches would
    cost more than they save; a small tensor costs less than the extra calls."""
    count, width = rows.shape
    block = _block_size(width)
    if rows.device.type != "cpu" or block is None or rows.numel() < 1 << 17:
        best = rows.max(dim=-1)
        return best.values, best.indices
    blocked = rows.unflatten(-1, (-1, block))
    values, first = blocked.amax(dim=-1).max(dim=-1)
    inside = blocked[torch.arange(count), first].max(dim=-1).indices
    return values, first * block + inside


@dataclass(frozen=True)
class Want:
    """What one caller needs of an answered position: the ``top`` most probable ids (1: the
    argmax alone; 0: the argmax's id only, no distribution at all), the log-probs of the
    ``named`` ids too, or the ``full`` row on the host (a sampler draws from it)."""

    top: int = 1
    named: tuple[int, ...] = ()
    full: bool = False


@dataclass(frozen=True)
class DeviceRow:
    """A :class:`TopLogprobs` handle: row ``index`` of a forward's log-softmax on its device."""

    rows: torch.Tensor
    index: int


@dataclass
class CutHeads:
    """One batch step's heads cut on the device and not read back yet (:func:`cut_heads`):
    a window of steps is read back together (:func:`read_cuts`), one copy for all of them."""

    parts: Sequence[tuple[torch.Tensor, Sequence[Want]]]
    packs: list[torch.Tensor]  # per part with positions: its heads, flattened (device)
    shapes: list[tuple[int, int, int]]  # per part: positions, top ids (-1/-2: tokens only), named
    sources: list[torch.Tensor | None]  # per part: its log-softmax (None: tokens only)
    fulls: list[torch.Tensor]  # the full rows asked for (device)
    #: with ``exact_tokens``: every position's argmax id in order, on the device (the next
    #: draft step's input, fed without reading it back)
    tokens: torch.Tensor | None = None


def cut_heads(parts: Sequence[tuple[torch.Tensor, Sequence[Want]]], exact_tokens: bool = False) -> CutHeads:
    """The device work of :func:`read_heads`, no read. ``exact_tokens``: token-only positions
    take the log-softmax's argmax at once (no second read for rows whose largest logit is below
    :data:`EXACT_ARGMAX_LOGIT`), and :attr:`CutHeads.tokens` holds every position's argmax."""
    cut = CutHeads(parts, [], [], [], [])
    tokens: list[torch.Tensor] = []
    for logits, wants in parts:
        if not wants:
            cut.shapes.append((0, 0, 0))
            cut.sources.append(None)
            continue
        if all(w.top == 0 for w in wants):
            if exact_tokens:
                indices = largest(torch.log_softmax(logits, dim=-1))[1]
                cut.packs.append(indices.double())
                cut.shapes.append((len(wants), -2, 0))
                tokens.append(indices)
            else:
                values, indices = largest(logits)
                cut.packs.append(_pack([values[:, None], indices[:, None]], logits.shape[-1]))
                cut.shapes.append((len(wants), -1, 0))
            cut.sources.append(None)
            continue
        logprobs = torch.log_softmax(logits, dim=-1)
        cut.sources.append(logprobs)
        top = min(max(w.top for w in wants), logprobs.shape[-1])
        named = max(len(w.named) for w in wants)
        values, indices = largest(logprobs)
        tokens.append(indices)
        columns = [
            values[:, None],
            indices[:, None],
            values.exp()[:, None],  # float32, as a full row's row.max().exp()
        ]
        if top > 1:
            head = logprobs.topk(top, dim=-1)
            columns += [head.values, head.indices]
        if named:
            index = torch.tensor(
                [list(w.named) + [0] * (named - len(w.named)) for w in wants],
                dtype=torch.long,
                device=logprobs.device,
            )
            columns.append(logprobs.gather(1, index))
        cut.packs.append(_pack(columns, logprobs.shape[-1]))
        cut.shapes.append((len(wants), top if top > 1 else 0, named))
        full = [i for i, w in enumerate(wants) if w.full]
        if full:
            cut.fulls.append(logprobs[full])
    if exact_tokens:
        cut.tokens = torch.cat(tokens) if tokens else None
    return cut


#: ids below this are exact in float32 (its 24-bit significand): a head's ids travel with its
#: float32 log-probs in one float32 pack, where casting every column to float64 first cost a
#: kernel per column
_FLOAT32_EXACT_IDS = 1 << 24


def _pack(columns: list[torch.Tensor], width: int) -> torch.Tensor:
    """A part's head columns (log-probs, and ids as int64, over a ``width``-id vocabulary) as
    one flat tensor in the log-probs' own dtype, so one ``torch.cat`` converts the ids and packs
    them: every value reads back as the float the row holds and every id exactly (float64 where
    an id could exceed float32's exact integers, or the rows are in a narrower dtype)."""
    dtype = columns[0].dtype
    if not (dtype == torch.float64 or (dtype == torch.float32 and width <= _FLOAT32_EXACT_IDS)):
        columns = [c.double() for c in columns]
    return torch.cat(columns, dim=1).flatten()


def read_heads(
    parts: Sequence[tuple[torch.Tensor, Sequence[Want]]],
) -> list[list[TopLogprobs | torch.Tensor | int]]:
    """Each part's rows (``[positions, vocab]`` logits over the tokenizer's ids, on the
    device, one :class:`Want` per position) as the rows its callers asked for: a
    :class:`TopLogprobs`, the full log-softmax row on the host (``full``), or the argmax id
    (``top=0``). One device-to-host copy brings back every head (one more for full rows, and
    for token-only rows whose largest logit is below :data:`EXACT_ARGMAX_LOGIT`, when any)."""
    return read_cuts([cut_heads(parts)])[0]


def read_cuts(cuts: Sequence[CutHeads]) -> list[list[list[TopLogprobs | torch.Tensor | int]]]:
    """Each cut's answers (as :func:`read_heads` gives them), read back with one copy for all
    the heads of every cut (and one for their full rows, when any)."""
    packs = [pack for cut in cuts for pack in cut.packs]
    fulls = [full for cut in cuts for full in cut.fulls]
    values = torch.cat(packs).tolist() if packs else []
    host_rows = list(torch.cat(fulls).cpu().unbind(0)) if fulls else []
    answers: list[list[list[TopLogprobs | torch.Tensor | int]]] = []
    start = 0
    for cut in cuts:
        cut_answers: list[list[TopLogprobs | torch.Tensor | int]] = []
        for (logits, wants), (positions, top, named), logprobs in zip(
            cut.parts, cut.shapes, cut.sources, strict=True
        ):
            if top == -2:  # exact tokens
                cut_answers.append([int(v) for v in values[start : start + positions]])
                start += positions
                continue
            if top == -1:  # tokens only
                cells = values[start : start + 2 * positions]
                cut_answers.append(_tokens(logits, cells))
                start += 2 * positions
                continue
            width = 3 + 2 * top + named
            rows: list[TopLogprobs | torch.Tensor | int] = []
            for i, want in enumerate(wants):
                if want.full:
                    rows.append(host_rows.pop(0))
                    continue
                cells = values[start + i * width : start + (i + 1) * width]
                assert logprobs is not None
                rows.append(_head(cells, want, top, logprobs, i))
            cut_answers.append(rows)
            start += positions * width
        answers.append(cut_answers)
    return answers


def _tokens(logits: torch.Tensor, cells: list[float]) -> list[TopLogprobs | torch.Tensor | int]:
    """Argmax ids from ``(largest logit, its id)`` pairs; rows whose largest logit is below
    :data:`EXACT_ARGMAX_LOGIT` take the log-softmax's argmax (one more copy)."""
    tokens: list[TopLogprobs | torch.Tensor | int] = [int(cells[2 * i + 1]) for i in range(len(cells) // 2)]
    unsure = [i for i in range(len(tokens)) if not cells[2 * i] >= EXACT_ARGMAX_LOGIT]
    if unsure:
        exact = torch.log_softmax(logits[unsure], dim=-1).argmax(dim=-1).tolist()
        for i, token in zip(unsure, exact, strict=True):
            tokens[i] = token
    return tokens


def _head(cells: list[float], want: Want, top: int, logprobs: torch.Tensor, index: int) -> TopLogprobs:
    argmax, best, best_probability = int(cells[1]), cells[0], cells[2]
    ids, values = [argmax], [best]
    if top:
        wanted = min(want.top, top)
        ids, values = argmax_first(argmax, best, cells[3 : 3 + wanted], cells[3 + top : 3 + top + wanted])
    known = dict(zip(ids, values, strict=True))
    for token, lp in zip(want.named, cells[3 + 2 * top :], strict=False):
        known[token] = lp
    return TopLogprobs(ids, values, known, DeviceRow(logprobs, index), best_probability)


def wider_heads(heads: Sequence[TopLogprobs], top: int) -> list[TopLogprobs]:
    """Each head with its row's ``top`` most probable ids, cut on the device from the same
    log-softmax rows and read back with one copy (the full rows stay where they are)."""
    handles = [head.handle for head in heads]
    if not all(isinstance(h, DeviceRow) for h in handles):
        raise TypeError("Complete names a row the transformers engine did not answer")
    stacked = torch.stack([h.rows[h.index] for h in handles])
    k = min(top, stacked.shape[-1])
    best = stacked.topk(k, dim=-1)
    cells = _pack([best.values, best.indices], stacked.shape[-1]).view(len(heads), 2 * k).tolist()
    return [widened(head, row[:k], row[k:]) for head, row in zip(heads, cells, strict=True)]


def full_rows(heads: Sequence[TopLogprobs]) -> list[torch.Tensor]:
    """The full log-softmax rows behind engine heads, with one copy."""
    handles = [head.handle for head in heads]
    if not all(isinstance(h, DeviceRow) for h in handles):
        raise TypeError("Complete names a row the transformers engine did not answer")
    stacked = torch.stack([h.rows[h.index] for h in handles])
    return list(stacked.cpu().unbind(0))
