"""Batched forwards for SAFE: one member's KV cache shared by many requests.

SAFE rolls each request back on its own (the drafter after a rejection, a verifier when its
re-tokenization changes the last tokens), so rows of a batch never have one common length.
Instead of re-packing the cache on every rollback, a row's rolled-back slots become *holes*:
every cache slot carries the real position of its token (or -1), and the attention mask is
built from those positions. Masks, rotary positions and sliding windows therefore see exactly
the sequence a lone request would see; holes and left padding only cost memory until the next
compaction.

A request's prompt is prefilled alone (batch of one, exactly the forward a lone request runs)
and spliced into its row, so prompts of different lengths never pad each other.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch

from lm_eval_safe.engines.base import Call, Complete, Draft, EngineBatch, Forward, Row
from lm_eval_safe.engines.hf import drafting, heads, kv_cache, model_calls
from lm_eval_safe.engines.hf.drafting import DraftStep
from lm_eval_safe.engines.hf.forward import forward_logits, vocab_logits
from lm_eval_safe.engines.hf.heads import Want
from lm_eval_safe.members import Member

logger = logging.getLogger(__name__)

# Slots beyond the longest row that may hold holes before the cache is compacted: compaction
# copies the whole cache, like one forward's ``torch.cat`` does, so it must be rare.
_COMPACT_SLACK = 48

# Spare slots a batch's cache is given when it is made (kv_cache.SlotLayer): a generation's
# forwards then write into them instead of copying the cache on every step.
_SPARE_SLOTS = 64


class MemberBatch(EngineBatch):
    """One member's KV cache for the rows of a batch, with per-row lengths and rollback.

    ``positions[r, s]`` is the position in row ``r``'s sequence of the token cached in slot
    ``s``, or -1 for a hole or padding. Row ``r`` holds positions ``0 .. lengths[r] - 1``.
    """

    def __init__(self, member: Member):
        self.member = member
        self.cache: Any = None
        self.positions = torch.empty((0, 0), dtype=torch.long)
        self.lengths: list[int] = []
        self._trimmed = True  # no trailing slot that no row uses (False after a rollback)

    # -- rows ----------------------------------------------------------------------------
    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def slots(self) -> int:
        return self.positions.shape[1]

    def add_row(self) -> int:
        """An empty row at the end of the batch; returns its index."""
        self.lengths.append(0)
        pad = torch.full((1, self.slots), -1, dtype=torch.long)
        self.positions = torch.cat([self.positions, pad]) if self.rows > 1 else pad
        if self.cache is not None:
            kv_cache.add_rows(self.cache, 1)
        return self.rows - 1

    def keep_rows(self, rows: list[int]) -> None:
        """Drop every row not listed (finished requests); the listed rows keep their order."""
        if rows == list(range(self.rows)):
            return
        self.lengths = [self.lengths[r] for r in rows]
        index = torch.tensor(rows, dtype=torch.long)
        self.positions = self.positions[index]
        if self.cache is not None:
            if not rows:
                self.cache = None
                self.positions = torch.empty((0, 0), dtype=torch.long)
                return
            kv_cache.keep_rows(self.cache, rows)
        self._trim()

    def truncate(self, row: int, length: int) -> None:
        if length > self.lengths[row]:
            raise RuntimeError(
                f"row {row} of {self.member.name} holds {self.lengths[row]} tokens, cannot keep {length}"
            )
        if length < self.lengths[row]:
            self.positions[row][self.positions[row] >= length] = -1
            self.lengths[row] = length
            self._trimmed = False

    # -- calls ---------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, calls: dict[int, Call]) -> dict[int, Any]:
        """Serve the rows' calls: drafts step by step (one batched forward per drafted token,
        for the rows still drafting), forwards in one batched forward, completions in one
        copy."""
        drafts = {r: c for r, c in calls.items() if isinstance(c, Draft)}
        forwards = {r: c for r, c in calls.items() if isinstance(c, Forward)}
        completes = {r: c for r, c in calls.items() if isinstance(c, Complete)}
        if len(drafts) + len(forwards) + len(completes) != len(calls):
            raise TypeError("the transformers engine answers Draft, Forward and Complete calls only")
        results: dict[int, Any] = {}
        if completes:
            results.update(self._complete(completes))
        if forwards:
            results.update(self.answered(forwards))
        if drafts:
            results.update(drafting.draft(self, drafts))
        return results

    def _complete(self, calls: dict[int, Complete]) -> dict[int, list[Any]]:
        """Full rows with one copy, and wider heads (``Complete.top``) with one more, per width."""
        results: dict[int, list[Any]] = {}
        for top in sorted({call.top for call in calls.values()}):
            group = {row: call for row, call in calls.items() if call.top == top}
            asked = [head for call in group.values() for head in call.rows]
            if top:
                answered: Iterator[Any] = iter(heads.wider_heads(asked, top))
            else:
                answered = iter(heads.full_rows(asked))
                self.member.engine.counters.full_rows += len(asked)
            results.update({row: [next(answered) for _ in call.rows] for row, call in group.items()})
        return results

    # -- forwards ------------------------------------------------------------------------
    def answered(self, calls: dict[int, Forward]) -> dict[int, list[Any]]:
        """The rows' forwards (:meth:`forward`), each row's answered positions read back from
        the device in one copy (:func:`~.heads.read_heads`): rows, or a draft step's token id
        when its call reads tokens only."""
        parts, owners = self.forward(calls)
        results: dict[int, list[Row]] = {row: [] for row in calls}
        for rows, part_owners in zip(heads.read_heads(parts), owners, strict=True):
            for answer, row in zip(rows, part_owners, strict=True):
                results[row].append(answer)
        return results

    def forward(
        self, calls: dict[int, Forward], fed: torch.Tensor | None = None
    ) -> tuple[list[tuple[torch.Tensor, list[Want]]], list[list[int]]]:
        """The one place this batch runs its member's forwards (inside an engine call, which
        holds the inference mode): fresh rows (``keep == 0``) are prefilled alone and spliced
        in, the others share one batched forward. Nothing is read back: each part's logits (on
        the device) with what its positions are wanted as, and the row of each position.
        ``fed``: the tokens a :class:`DraftStep` with ``fed`` feeds from (on the device)."""
        parts: list[tuple[torch.Tensor, list[Want]]] = []
        owners: list[list[int]] = []  # per part: the row of each of its positions
        batched: dict[int, Forward] = {}
        for row, call in calls.items():
            self.truncate(row, call.keep)
            if call.keep == 0:
                parts.append((self._prefill_alone(row, call), self._wants(call)))
                owners.append([row] * len(call.want))
            elif call.ids:
                batched[row] = call
        if not self._trimmed:
            self._trim()
        if batched:
            logits = self._forward(batched, fed)
            parts.append((logits, [w for call in batched.values() for w in self._wants(call)]))
            owners.append([row for row, call in batched.items() for _ in call.want])
        self._maybe_compact()
        return parts, owners

    def _wants(self, call: Forward) -> list[Want]:
        """What each answered position is read back as: a draft step's token (the argmax) or
        the full row its sampler draws from; a verifier position's head of ``top_logprobs`` ids
        and its log-prob of the next id fed (its own next token, which SAFE's consensus reads)."""
        if isinstance(call, DraftStep) and call.draft is not None:
            draft = call.draft
            want = Want(full=True) if draft.sampler is not None else Want(top=int(draft.rows))
            return [want for _ in call.want]
        top = self.member.engine.top_logprobs
        return [
            Want(top, (call.ids[i + 1],) if i + 1 < len(call.ids) else ()) for i in call.want
        ]

    def _prefill_alone(self, row: int, call: Forward) -> torch.Tensor:
        """A prompt's forward, starting from the longest prefix of it that the member's prefix
        store holds (few-shot exemplars shared with earlier requests); its blocks then go back
        to the store for later requests."""
        store = self.member.engine.prefix_store
        if store is None:
            cache, reused = kv_cache.new_cache(), 0
        else:
            first_wanted = min(call.want, default=len(call.ids) - 1)
            reused, cache = store.lookup(call.ids, limit=first_wanted)
        want = [i - reused for i in call.want]
        rows = forward_logits(self.member, call.ids[reused:], cache, want)
        if store is not None:
            store.add(call.ids, cache)
        self._splice(row, cache, len(call.ids))
        return rows

    def _splice(self, row: int, cache: Any, length: int) -> None:
        """Put a lone sequence's cache into ``row``'s last slots (right-aligned), widening the
        batch's cache on the left when the sequence is longer than it."""
        self.lengths[row] = length
        if self.cache is None:  # the first prompt: every other row holds a copy, as holes
            self.cache = kv_cache.with_slots(cache, _SPARE_SLOTS, rows=self.rows)
            self.positions = torch.full((self.rows, length), -1, dtype=torch.long)
            self.positions[row] = torch.arange(length)
            return
        grow = length - self.slots
        if grow > 0:
            self.positions = torch.cat(
                [torch.full((self.rows, grow), -1, dtype=torch.long), self.positions], dim=1
            )
            kv_cache.widen_left(self.cache, grow)
        start = self.slots - length
        self.positions[row] = -1
        self.positions[row, start:] = torch.arange(length)
        kv_cache.write_row(self.cache, row, start, cache)

    def _trim(self) -> None:
        """Crop trailing slots that no row uses (a lone row's rollback becomes a plain crop)."""
        if self.cache is None or self.slots == 0:
            return
        used = (self.positions >= 0).any(dim=0).nonzero()
        keep = int(used.max()) + 1 if used.numel() else 0
        if keep < self.slots:
            kv_cache.crop(self.cache, keep)
            self.positions = self.positions[:, :keep]
        self._trimmed = True

    def _maybe_compact(self) -> None:
        longest = max(self.lengths, default=0)
        if self.cache is None or self.slots <= longest + _COMPACT_SLACK:
            return
        # each row's live slots, in order, right-aligned to the longest row
        order = torch.full((self.rows, longest), -1, dtype=torch.long)
        for row in range(self.rows):
            live = (self.positions[row] >= 0).nonzero().flatten()
            if live.numel():
                order[row, longest - live.numel() :] = live
        gather = order.clamp_min(0)
        new_positions = torch.where(order >= 0, self.positions.gather(1, gather), -1)
        kv_cache.gather_slots(self.cache, gather)
        self.positions = new_positions

    def _forward(self, calls: dict[int, Forward], fed: torch.Tensor | None = None) -> torch.Tensor:
        """One batched forward of the calling rows; the logits at every wanted position, on the
        member's device, in the calls' order. Draft steps fed from the device take their id
        from ``fed``."""
        member = self.member
        device = member.engine.input_device
        # a lone row holds positions 0 .. length - 1 once each, so it has holes iff it has
        # more slots than tokens
        if self.rows == 1 and self.slots == self.lengths[0]:
            ((row, call),) = calls.items()
            return self._forward_plain(row, call, fed)
        width = max(len(call.ids) for call in calls.values())
        pad_id = member.tokenizer.pad_token_id or 0
        ids_table = [[pad_id] * width for _ in range(self.rows)]
        positions_table = [[-1] * width for _ in range(self.rows)]
        for row, call in calls.items():
            n = len(call.ids)
            ids_table[row][:n] = call.ids
            positions_table[row][:n] = range(self.lengths[row], self.lengths[row] + n)
        input_ids = torch.tensor(ids_table, dtype=torch.long).to(device)
        on_device = {row: c.fed for row, c in calls.items() if isinstance(c, DraftStep) and c.fed is not None}
        if on_device:
            assert fed is not None
            rows_fed = torch.tensor(list(on_device), dtype=torch.long, device=device)
            sources = torch.tensor(list(on_device.values()), dtype=torch.long, device=fed.device)
            tokens = fed[sources]  # on the output layer's device (the last of a device_map)
            input_ids[rows_fed, 0] = tokens if tokens.device == input_ids.device else tokens.to(device)
        query_pos = torch.tensor(positions_table, dtype=torch.long)
        key_pos = torch.cat([self.positions, query_pos], dim=1)
        # rows without a call would each cost `width` padded positions of compute: when they are
        # the majority, run only the calling rows (their slots gathered, new ones written back)
        rows = sorted(calls)
        subset = 2 * len(rows) <= self.rows
        local = {row: i for i, row in enumerate(rows)} if subset else {r: r for r in calls}
        cache = kv_cache.rows_view(self.cache, rows) if subset else self.cache
        pick = torch.tensor(rows) if subset else slice(None)
        out = model_calls.run(
            model_calls.decoder(member.engine.model),
            cache,
            input_ids=input_ids[pick],
            attention_mask=model_calls.attention_mask(
                member.engine.model, key_pos[pick], query_pos[pick], device
            ),
            position_ids=query_pos[pick].clamp_min(0).to(device),
        )
        hidden = out.last_hidden_state
        picks = [(local[row], i) for row, call in calls.items() for i in call.want]
        for row, call in calls.items():
            self.lengths[row] += len(call.ids)
        self.positions = key_pos
        if not picks:
            return hidden.new_empty((0, len(member.vocab)))
        index_rows = torch.tensor([p[0] for p in picks], device=hidden.device)
        index_cols = torch.tensor([p[1] for p in picks], device=hidden.device)
        return vocab_logits(self._head(hidden[index_rows, index_cols][None])[0], len(member.vocab))

    def _forward_plain(self, row: int, call: Forward, fed: torch.Tensor | None) -> torch.Tensor:
        """A lone, hole-free row: exactly the unbatched forward (no mask, no padding)."""
        if isinstance(call, DraftStep) and call.fed is not None:
            assert fed is not None
            ids: list[int] | torch.Tensor = fed[call.fed : call.fed + 1][None]
            if ids.device != self.member.engine.input_device:
                ids = ids.to(self.member.engine.input_device)
        else:
            ids = call.ids
        start, n = self.lengths[row], len(call.ids)
        last_only = list(call.want) == [n - 1]
        logits = forward_logits(self.member, ids, self.cache, 1 if last_only else list(call.want))
        self.positions = torch.cat([self.positions, torch.arange(start, start + n)[None]], dim=1)
        self.lengths[row] += n
        return logits

    # -- model specifics -----------------------------------------------------------------
    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output layer on chosen hidden states (``logits_to_keep`` selects the same columns
        for every row, which would run a 262k-vocabulary head on every padded position)."""
        member = self.member
        model = member.engine.model
        if not model_calls.output_head_reproduces_logits(model, member.prefix_token_id, member.engine.input_device):
            raise NotImplementedError(
                f"batch_size>1 cannot reproduce {type(model).__name__}'s output layer; use batch_size=1"
            )
        return model_calls.output_logits(model, hidden)


# batch_size=auto on CPU: rows decoded together. Past about 8 rows a CPU's matrix units are
# busy and more rows only add latency (scripts/bench_batch.py measures the curve).
AUTO_CPU_ROWS = 8


def auto_generation_rows(members: list[Member], jobs: list[Any]) -> int:
    """``batch_size=auto`` for transformers members: as many rows as the free memory of their
    GPUs holds (KV caches of the longest job, half the free memory); on CPU,
    :data:`AUTO_CPU_ROWS`."""
    devices = {m.engine.input_device for m in members}
    if not all(d.type == "cuda" for d in devices):
        return AUTO_CPU_ROWS
    # tokens a row may hold: the longest prompt (counted as one token per 2 characters, more
    # than any tokenizer here makes) plus its generation
    longest = max(len(job[0]) // 2 + job[2] for job in jobs)  # (context, until, new tokens, ...)
    per_row = {d: 0 for d in devices}
    for member in members:
        tokens = min(longest, member.max_length)
        per_row[member.engine.input_device] += (
            model_calls.kv_bytes_per_token(member.engine.model) * tokens * 2  # cat copies
        )
    rows = min(
        torch.cuda.mem_get_info(device)[0] // 2 // max(1, need) for device, need in per_row.items()
    )
    logger.info("batch_size=auto: %d rows fit the free GPU memory", rows)
    return int(rows)
