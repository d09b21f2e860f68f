"""One vLLM member's rows in a generation batch: each row is the sequence of ids its calls built
up. A row that is a session (:mod:`.session_rows`) sends only the ids it gained; otherwise (the
drafter alone, which stops at stop strings; an engine where sessions cannot run; the positions a
new session read from the prefix cache) a call re-submits whole sequences in one ``generate``
and vLLM's prefix cache supplies what an earlier call computed.

Prompt log-probs and the prefix cache: vLLM skips *reading* the prefix cache for a request that
asks for prompt log-probs unless told otherwise, and when it reads it, the rows of positions it
took from the cache are not computed (on the CPU runner they hold uninitialised memory:
vllm-project/vllm#42019). So every scoring request reads the cache, and a row predicting position ``p``
(computed from the hidden state at ``p - 1``) is used only when ``p - 1 >= num_cached_tokens``;
the rare rows below that are asked again by a request ending right after them, whose cached
prefix stops short of them, and failing that by one that does not read the cache.
"""

from __future__ import annotations

from typing import Any

import torch

from lm_eval_safe.engines.base import (
    Complete,
    Draft,
    Drafted,
    EngineBatch,
    Forward,
    TopLogprobs,
    consistent_row,
    head_of,
)
from lm_eval_safe.engines.vllm.session_rows import SessionRows, Window
from lm_eval_safe.members.member import Member


class VLLMBatch(EngineBatch):
    engine_title = "vLLM"

    def __init__(self, engine: Any):
        self.engine = engine
        self.rows: list[list[int]] = []
        self.sessions = None if engine.sessions is None else SessionRows(engine, engine.sessions)

    def add_row(self) -> int:
        self.rows.append([])
        if self.sessions is not None:
            self.sessions.add_row()
        return len(self.rows) - 1

    def keep_rows(self, rows: list[int]) -> None:
        self.rows = [self.rows[r] for r in rows]
        if self.sessions is not None:
            self.sessions.keep_rows(rows)

    def _sequence(self, row: int, keep: int, ids: list[int]) -> list[int]:
        held = self.rows[row]
        if keep > len(held):
            raise RuntimeError(f"row {row} holds {len(held)} ids, cannot keep {keep}")
        sequence = held[:keep] + list(ids)
        self.rows[row] = sequence
        return sequence

    # -- drafts ----------------------------------------------------------------------------
    def answer_drafts(self, calls: dict[int, Draft]) -> dict[int, Drafted]:
        """Every row's window: ``max_tokens=n``, ``logprobs=K``, greedy or with the request's
        temperature/top-k/top-p and a seed drawn from its own random stream (each window gets a
        fresh seed, never the same one twice). A row with a session (:mod:`.sessions`) sends the
        ids it gained; the drafter alone, which stops at stop strings, and a batch without
        sessions submit whole sequences.

        vLLM draws from the model's whole output layer, padded rows included; a padded id is no
        token, so the window ends there and that id is replaced by the argmax of the position's
        full row over the tokenizer's ids, or a draw from it with the request's sampler (what
        the transformers engine drafts: its rows hold the tokenizer's ids only)."""
        engine = self.engine
        sequences = {row: self._sequence(row, call.keep, call.ids) for row, call in calls.items()}
        settings = {row: self._draft_settings(call) for row, call in calls.items()}
        in_sessions = {r: c for r, c in calls.items() if self.sessions is not None and not c.until}
        windows = self._resubmitted_windows(
            {r: sequences[r] for r in calls if r not in in_sessions}, settings
        )
        if in_sessions:
            assert self.sessions is not None
            windows.update(
                self.sessions.draft({r: (sequences[r], c.keep) for r, c in in_sessions.items()}, settings)
            )
        vocab = len(engine.member.tokenizer)
        drafted: dict[int, Drafted] = {}
        missing: list[tuple[int, int]] = []  # (row, index) of positions read from a full row
        for row in calls:
            prompt, tokens, positions = windows[row]
            padded = next((i for i, t in enumerate(tokens) if t >= vocab), None)
            if padded is not None:  # the tokens after a padded id were drafted from it
                tokens = tokens[: padded + 1]
                if self.sessions is not None:
                    self.sessions.forget_after(row, len(prompt) + padded)
            sequence = prompt + tokens
            self.rows[row] = sequence
            rows = [
                engine.position_head(*positions[i], (sequence, len(prompt) + i))
                for i in range(len(tokens))
            ]
            missing += [(row, i) for i, head in enumerate(rows) if head is None or i == padded]
            drafted[row] = Drafted(tokens, rows)  # type: ignore[arg-type]
        places = [(self.rows[r], len(self.rows[r]) - len(drafted[r].tokens) + i) for r, i in missing]
        for (row, i), place, full in zip(missing, places, self._full_rows(places), strict=True):
            draft, sequence, position = drafted[row], *place
            if draft.tokens[i] >= vocab:
                sampler = calls[row].sampler
                token = int(torch.argmax(full)) if sampler is None else sampler.sample(full)
                draft.tokens[i] = sequence[position] = token
            draft.rows[i] = engine.row_head(full, draft.tokens[i], place)
        return drafted

    def _draft_settings(self, call: Draft) -> dict[str, Any]:
        settings: dict[str, Any] = {
            "max_tokens": call.n,
            "logprobs": self.engine.top,
            "stop_token_ids": sorted(call.stop_ids),
        }
        if call.until:  # vLLM then detokenizes to find them
            settings.update(stop=list(call.until), detokenize=True)
        sampler = call.sampler
        if sampler is not None:
            p = sampler.params
            settings.update(
                temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, seed=sampler.stream_seed()
            )
        return settings

    def _resubmitted_windows(
        self, sequences: dict[int, list[int]], settings: dict[int, dict[str, Any]]
    ) -> dict[int, Window]:
        """Windows of whole sequences submitted in one ``generate``."""
        if not sequences:
            return {}
        engine = self.engine
        order = list(sequences)
        outputs = engine.generate(
            [sequences[r] for r in order], [engine.params(**settings[r]) for r in order]
        )
        windows: dict[int, Window] = {}
        for row, output in zip(order, outputs, strict=True):
            completion = output.outputs[0]
            flat = completion.logprobs
            positions = [
                (
                    flat.token_ids[flat.start_indices[i] : flat.end_indices[i]],
                    flat.logprobs[flat.start_indices[i] : flat.end_indices[i]],
                )
                for i in range(len(completion.token_ids))
            ]
            windows[row] = (sequences[row], list(completion.token_ids), positions)
        return windows

    def _full_rows(self, places: list[tuple[list[int], int]]) -> list[torch.Tensor]:
        """The full distribution (:meth:`VLLMEngine.full_row`) predicting each ``(sequence,
        position)``: one request per position, ``sequence[:position]`` with ``logprobs=-1``."""
        if not places:
            return []
        engine = self.engine
        prompts = [sequence[:position] for sequence, position in places]
        outputs = engine.generate(prompts, [engine.params(max_tokens=1, logprobs=-1) for _ in places])
        engine.counters.full_rows += len(places)
        return [engine.full_row(output.outputs[0].logprobs, 0) for output in outputs]

    # -- scores ----------------------------------------------------------------------------
    def answer_forwards(self, calls: dict[int, Forward]) -> dict[int, list[TopLogprobs]]:
        """The rows' wanted positions: inner ones from prompt log-probs, the one after a row's
        last id from the request's single generated position. Rows with sessions send the ids
        they gained; a position a session's chunk did not compute is asked as a row without one
        asks it."""
        wanted: dict[int, list[int]] = {}
        sequences: dict[int, list[int]] = {}
        for row, call in calls.items():
            sequences[row] = self._sequence(row, call.keep, call.ids)
            wanted[row] = [call.keep + w + 1 for w in call.want]
        answers: dict[int, dict[int, TopLogprobs | None]] = {row: {} for row in calls}
        if self.sessions is not None:
            found = self.sessions.score(
                {row: (sequences[row], calls[row].keep, wanted[row]) for row in calls}
            )
            for row, heads in found.items():
                answers[row].update(heads)
        rest = {
            row: (sequences[row], [p for p in wanted[row] if p not in answers[row]]) for row in calls
        }
        for row, heads in self._positions(rest).items():
            answers[row].update(heads)
        self._name_heads(sequences, answers)
        return {row: [answers[row][p] for p in wanted[row]] for row in calls}  # type: ignore[misc]

    def _positions(
        self, requests: dict[int, tuple[list[int], list[int]]]
    ) -> dict[int, dict[int, TopLogprobs | None]]:
        """For each request ``(sequence, positions)``, the head predicting each position
        (``len(sequence)``: the next token), valid under the prefix cache (module docstring);
        None where vLLM's top ids cannot name the argmax."""
        engine = self.engine
        found: dict[int, dict[int, TopLogprobs | None]] = {key: {} for key in requests}
        todo = [(key, seq, sorted(set(pos))) for key, (seq, pos) in requests.items() if pos]
        for attempt in range(3):
            if not todo:
                break
            prompts, params = [], []
            for _, seq, positions in todo:
                inner = any(p < len(seq) for p in positions)
                prompts.append(seq)
                params.append(
                    engine.params(
                        max_tokens=1,
                        logprobs=engine.top,
                        prompt_logprobs=engine.top if inner else None,
                        skip_reading_prefix_cache=attempt == 2,
                    )
                )
            outputs = engine.generate(prompts, params)
            retry = []
            for (key, seq, positions), output in zip(todo, outputs, strict=True):
                cached = int(output.num_cached_tokens or 0)
                stale = []
                for p in positions:
                    if p == len(seq):
                        found[key][p] = engine.head(output.outputs[0].logprobs, 0, (seq, p))
                    elif p - 1 >= cached:
                        found[key][p] = engine.head(output.prompt_logprobs, p, (seq, p))
                    else:
                        stale.append(p)
                # a request ending right after a stale row: its cached prefix stops before it
                retry.extend((key, seq[: p + 1], [p]) for p in stale)
            todo = retry
        if todo:
            raise RuntimeError("vLLM returned prompt log-probs from its prefix cache three times")
        return found

    def _name_heads(
        self, sequences: dict[int, list[int]], found: dict[int, dict[int, TopLogprobs | None]]
    ) -> None:
        """Heads cut from full rows where vLLM's top ids could not name a position's argmax."""
        unnamed = [(key, p) for key, heads in found.items() for p, head in heads.items() if head is None]
        places = [(sequences[key], p) for key, p in unnamed]
        for (key, p), place, full in zip(unnamed, places, self._full_rows(places), strict=True):
            sequence = place[0]
            found[key][p] = self.engine.row_head(full, sequence[p] if p < len(sequence) else -1, place)

    # -- full distributions ----------------------------------------------------------------
    def answer_completes(self, calls: dict[int, Complete]) -> dict[int, list[Any]]:
        places: list[tuple[list[int], int]] = []
        where: list[tuple[int, int]] = []
        for row, call in calls.items():
            for i, head in enumerate(call.rows):
                places.append(head.handle)
                where.append((row, i))
        results: dict[int, list[Any]] = {row: [None] * len(call.rows) for row, call in calls.items()}
        for (row, i), full in zip(where, self._full_rows(places), strict=True):
            head = calls[row].rows[i]
            full = consistent_row(full, head)  # computed again: the head's values, within its bounds
            top = calls[row].top  # a wider head (vLLM's heads are top_logprobs wide already)
            results[row][i] = full if not top else head_of(full, top, head)
        return results


def auto_generation_rows(members: list[Member], jobs: list[Any]) -> int:
    """``batch_size=auto`` for vLLM members: as many rows as each engine schedules at once
    (its ``max_num_seqs``), one fewer where rows are sessions (one request slot stays free for
    a one-off request); vLLM's own scheduler holds what does not fit its KV cache."""
    return min(
        m.engine.max_num_seqs if m.engine.sessions is None else m.engine.sessions.capacity
        for m in members
    )
