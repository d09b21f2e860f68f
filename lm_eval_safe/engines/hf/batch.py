"""Batched forwards for SAFE: one member's KV cache shared by many requests, its rows kept as
:class:`~.cache_rows.CacheRows` (per-row lengths, rollback as holes).

A request's prompt is prefilled alone (batch of one, exactly the forward a lone request runs)
and spliced into its row, so prompts of different lengths never pad each other. The other rows'
calls share one batched forward, masked by their slots' positions.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch

from lm_eval_safe.engines.base import Call, Complete, Draft, Forward, Row
from lm_eval_safe.engines.hf import heads, kv_cache, model_calls
from lm_eval_safe.engines.hf.cache_rows import CacheRows
from lm_eval_safe.engines.hf.drafting import DraftingBatch, DraftStep
from lm_eval_safe.engines.hf.forward import forward_logits, vocab_logits
from lm_eval_safe.engines.hf.heads import Want
from lm_eval_safe.members.member import Member

logger = logging.getLogger(__name__)


class MemberBatch(CacheRows, DraftingBatch):
    """One member's rows of a generation batch: its calls answered by the member's forwards."""

    answer_order = (Complete, Forward, Draft)
    engine_title = "transformers"

    # -- calls ---------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, calls: dict[int, Call]) -> dict[int, Any]:
        """Serve the rows' calls (completions in one copy, forwards in one batched forward,
        drafts step by step: one batched forward per drafted token, for the rows still
        drafting) in the inference mode."""
        return super().run(calls)

    def answer_completes(self, calls: dict[int, Complete]) -> dict[int, list[Any]]:
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
    def answer_forwards(self, calls: dict[int, Forward]) -> dict[int, list[Any]]:
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
        prefilled: list[tuple[int, Any, int]] = []  # (row, its prompt's cache, length)
        for row, call in calls.items():
            self.truncate(row, call.keep)
            if call.keep == 0:
                logits, cache = self._prefill_alone(call)
                prefilled.append((row, cache, len(call.ids)))
                parts.append((logits, self._wants(call)))
                owners.append([row] * len(call.want))
            elif call.ids:
                batched[row] = call
        # the longest prompt first: the batch's cache is made as wide as it once, where a longer
        # prompt spliced after a shorter one re-allocated every layer to widen it on the left
        for row, cache, length in sorted(prefilled, key=lambda p: -p[2]):
            self._splice(row, cache, length)
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

    def _prefill_alone(self, call: Forward) -> tuple[torch.Tensor, Any]:
        """A prompt's forward, starting from the longest prefix of it that the member's prefix
        store holds (few-shot exemplars shared with earlier requests); its blocks then go back
        to the store for later requests. The logits wanted, and the prompt's cache to splice
        into its row."""
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
        return rows, cache

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
            raise kv_cache.UnsupportedModelError(
                f"batch_size>1 cannot reproduce {type(model).__name__}'s output layer; use batch_size=1"
            )
        return model_calls.output_logits(model, hidden)


# batch_size=auto on CPU: rows decoded together. Past about 8 rows a CPU's matrix units are
# busy and more rows only add latency (lm-eval-safe bench batch measures the curve).
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
