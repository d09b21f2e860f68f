"""The SAFE decoder: one loop, pluggable schedules (SAFE_SPEC §3, §6, §7).

Each cycle the drafter proposes up to ``draft_len`` tokens with its KV cache; a *schedule*
decides whether and where to ensemble among them; verifiers re-tokenize the generated text and
run one forward pass over what their caches do not already hold. The baselines of the paper
(every-token UniTE, GaC's threshold gate, the drafter alone) are schedules of the same loop,
so speed and accuracy comparisons compare policies, not code bases.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass
from functools import cached_property
from typing import Any, NamedTuple

import torch

from lm_eval_safe.aggregate import (
    Choice,
    UnionVocabulary,
    View,
    gac,
    gac_distribution,
    unite,
    unite_distribution,
)
from lm_eval_safe.batching import Forward, MemberBatch
from lm_eval_safe.members import Member, cache_root
from lm_eval_safe.options import RequestError, SafeOptions
from lm_eval_safe.sampling import RowSampler, SamplingParams
from lm_eval_safe.small_rows import small_row_linears
from lm_eval_safe.stats import GenerationStats
from lm_eval_safe.vocabulary import EOS_KEY, is_char_boundary

logger = logging.getLogger(__name__)


def valid_utf8_prefix(data: bytes) -> str:
    """The longest prefix of ``data`` that decodes; a draft may end inside a multi-byte character."""
    for cut in range(0, 4):
        try:
            return data[: len(data) - cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
    return data.decode("utf-8", errors="ignore")


def boundary_index(ends: list[int], offset: int) -> int | None:
    """Index of the token that starts at byte ``offset`` (one past the tokens ending there),
    or None when ``offset`` falls inside a token: the position is not a boundary."""
    i = bisect.bisect_right(ends, offset)
    return i if offset == 0 or (i > 0 and ends[i - 1] == offset) else None


class WindowExhausted(RuntimeError):
    """A verifier's context window is full; the request continues with the drafter alone."""


# A row's decoding steps are a generator: it yields the forwards it needs (answered with the
# log-prob rows) and CYCLE_END after each SAFE cycle, where the batch waits for all its rows.
CYCLE_END = object()
Steps = Generator[Any, Any, Any]


def drive(steps: Steps, batches: Any) -> Any:
    """Run one row's steps on its own: ``batches[k]`` serves forwards of member ``k``."""
    row = _Row(0, steps)
    row.advance()
    while not row.done:
        call = row.call
        row.advance(None if call is None else batches[call.member].run({0: call})[0])
    return row.result


def solo_batch(member: Member) -> MemberBatch:
    batch = MemberBatch(member)
    batch.add_row()
    return batch


class GenerationJob(NamedTuple):
    """One request for :meth:`SafeDecoder.generate_many` (a plain 3-tuple is a greedy job)."""

    context: str
    until: list[str]
    max_new_tokens: int
    sampling: SamplingParams | None = None  # None, or greedy params: argmax decoding
    seed: int = 0  # the request's own random stream (sampling only)


class DrafterRun:
    """The drafter's decoding state for one request: tokens in its cache plus ids not yet fed.

    Drafted tokens after an ensemble point whose choice was the drafter's own token are kept
    (``carried``) rather than drafted again: they were drawn from the same cache and prefix
    (greedy decoding would reproduce them exactly; a sample of them is as valid as a new one),
    so the next cycle starts with them and drafts only the rest of its window. ``sampler``:
    None picks the argmax, else tokens are drawn from the request's warped distribution.
    """

    def __init__(
        self,
        member: Member,
        prompt_ids: list[int],
        slot: int = 0,
        sampler: RowSampler | None = None,
    ):
        self.member = member
        self.slot = slot
        self.sampler = sampler
        self.prompt_len = len(prompt_ids)
        self.cached = 0
        self.pending = list(prompt_ids)
        self.drafted = 0  # drafter forwards that produced a token (carried tokens count once)
        self.carried: list[tuple[int, torch.Tensor]] = []

    def draft(self, n: int) -> Steps:
        taken, self.carried = self.carried[:n], self.carried[n:]
        tokens = [token for token, _ in taken]
        logprobs = [row for _, row in taken]
        if tokens and tokens[-1] in self.member.eos_ids:
            return tokens, logprobs
        while len(tokens) < n:
            fed = self.pending
            rows = yield Forward(self.slot, self.cached, fed, [len(fed) - 1])
            self.cached += len(fed)
            self.drafted += 1
            row = rows[0]
            token = int(torch.argmax(row)) if self.sampler is None else self.sampler.sample(row)
            tokens.append(token)
            logprobs.append(row)
            self.pending = [token]
            if token in self.member.eos_ids:
                break
        return tokens, logprobs

    def carry(self, tokens: list[int], logprobs: list[torch.Tensor]) -> None:
        """Keep drafted tokens that follow an accepted ensemble point for the next cycle."""
        self.carried = list(zip(tokens, logprobs, strict=True)) + self.carried

    def rewind(self, generated_kept: int, pending: list[int]) -> None:
        """Drop drafted tokens from the cache: keep the prompt and ``generated_kept`` tokens."""
        self.cached = min(self.cached, self.prompt_len + generated_kept)
        self.pending = list(pending)
        self.carried = []


class VerifierRun:
    """A verifier's state for one request: its tokenization of the text and a reusable KV cache.

    ``pred[i]`` holds the log-probabilities predicting generated token ``i`` (``pred[0]`` comes
    from the prompt). When the text grows, the cache is kept up to the longest prefix of the old
    ids that the new tokenization still starts with (BPE may re-merge the last tokens), and only
    the rest is recomputed. The prompt is never recomputed.
    """

    def __init__(
        self, member: Member, prompt_ids: list[int], reuse_cache: bool = True, slot: int = 1
    ):
        self.member = member
        self.slot = slot
        self.prompt_ids = list(prompt_ids)
        self.reuse_cache = reuse_cache
        self.gen_ids: list[int] = []
        self.pred: dict[int, torch.Tensor] = {}
        self.recomputed = 0
        self._solo: dict[int, MemberBatch] | None = None

    def sync(
        self, text: str, text_bytes: bytes, want_offsets: set[int] | None = None
    ) -> tuple[list[int], list[int] | None]:
        """:meth:`sync_steps` run on this verifier's own cache (outside a batch)."""
        if self._solo is None:
            self._solo = {self.slot: solo_batch(self.member)}
        return drive(self.sync_steps(text, text_bytes, want_offsets), self._solo)

    def sync_steps(
        self, text: str, text_bytes: bytes, want_offsets: set[int] | None = None
    ) -> Steps:
        """Tokenize the generated ``text`` and feed what the cache lacks in one forward pass.

        ``pred`` then holds the distributions predicting the token at each byte offset in
        ``want_offsets`` that is one of this verifier's token boundaries (``None``: at the end
        of the text only). Returns the ids and each token's end offset in ``text_bytes`` (None if
        the ids do not spell the text exactly: then no position of this text is aligned).
        """
        if 0 not in self.pred:
            prompt = self.prompt_ids
            self.pred[0] = (yield Forward(self.slot, 0, prompt, [len(prompt) - 1]))[0]
        ids = self.member.vocab.encode_text(self.member.tokenizer, text)
        if len(self.prompt_ids) + len(ids) > self.member.max_length:
            raise WindowExhausted(self.member.name)
        ends = self.member.vocab.token_ends(ids, text_bytes[: len(text.encode("utf-8"))])
        keep = 0
        if self.reuse_cache:
            limit = min(len(ids), len(self.gen_ids))
            while keep < limit and ids[keep] == self.gen_ids[keep]:
                keep += 1
        # rows up to index `keep` depend only on unchanged tokens and stay valid
        for stale in [i for i in self.pred if i > keep]:
            del self.pred[stale]
        wanted = {len(ids)} if want_offsets is None else self._indices_at(want_offsets, ends)
        missing = sorted(i for i in wanted if i not in self.pred)
        start = min(keep, missing[0] - 1) if missing else keep  # pred[0] always exists
        feed = ids[start:]
        if feed:
            want = [i - 1 - start for i in missing]
            rows = yield Forward(self.slot, len(self.prompt_ids) + start, feed, want)
            for i, row in zip(missing, rows, strict=True):
                self.pred[i] = row
            self.recomputed += len(feed)
        self.gen_ids = ids
        return ids, ends

    @staticmethod
    def _indices_at(offsets: set[int], ends: list[int] | None) -> set[int]:
        """Token index predicted at each byte offset that is a token boundary."""
        if ends is None:
            return set()
        found = (boundary_index(ends, offset) for offset in offsets)
        return {i for i in found if i is not None}

    def forget_before(self, index: int) -> None:
        """Free rows no future boundary can need (row 0, the prompt's, is kept: it is cheap)."""
        for stale in [i for i in self.pred if 0 < i < index]:
            del self.pred[stale]


class DraftWindow:
    """Tokens drafted per cycle: ``draft_len`` fixed, or ``auto``, which adapts as transformers'
    assisted generation does: two more after a cycle whose drafted tokens were all kept, one
    fewer after a cycle that threw drafted tokens away (an ensemble replaced one of them).

    Members that often disagree waste a long window's tail at every replacement; members that
    agree pay a verifier call per few tokens with a short one. The window a position is verified
    in decides how much text follows it, and a verifier's tokenization (and so alignment and its
    own next token) can depend on that text, so ``auto`` may give other texts than a fixed
    window; a fixed ``draft_len`` gives exactly the texts it always gave."""

    START = 5
    LARGEST = 12

    def __init__(self, draft_len: int | str):
        self.adaptive = draft_len == "auto"
        self.size = self.START if self.adaptive else int(draft_len)
        self.largest = self.LARGEST if self.adaptive else self.size
        self.rejected = False

    def update(self) -> None:
        if self.adaptive:
            self.size = max(1, self.size - 1) if self.rejected else min(self.largest, self.size + 2)
        self.rejected = False


@dataclass
class EnsemblePoint:
    position: int  # index into the drafted tokens
    views: list[View]


class SafeDecoder:
    """Generation with one drafter and any number of verifiers: greedy, or sampled (README
    "Sampling": speculative sampling's rule over strings at the ensemble points)."""

    def __init__(self, members: list[Member], drafter_index: int, options: SafeOptions):
        self.options = options
        self.drafter = members[drafter_index]
        self.verifiers = [m for i, m in enumerate(members) if i != drafter_index]
        weights = options.weights or [1.0] * len(members)
        self.weights = [weights[drafter_index]] + [
            w for i, w in enumerate(weights) if i != drafter_index
        ]
        self.schedule = options.schedule if self.verifiers else "drafter"
        self._union: UnionVocabulary | None = None

    @property
    def union(self) -> UnionVocabulary:
        if self._union is None:
            vocabs = [self.drafter.vocab] + [v.vocab for v in self.verifiers]
            self._union = UnionVocabulary.build(vocabs, cache_root(self.options.cache_dir))
        return self._union

    # -- prompts -------------------------------------------------------------------------
    @staticmethod
    def encoded_prompt(member: Member, context: str) -> list[int]:
        """The member's ids of ``context`` (its own chat template applied), before truncation;
        a context that leaves a member nothing to continue from is a ``ValueError``."""
        ids = member.encode(member.render_context(context))
        if not ids:
            raise ValueError(
                f"empty prompt for member {member.name!r}: safe-ensemble needs a non-empty context to continue"
            )
        return ids

    def preflight(
        self, jobs: list[GenerationJob] | list[tuple[str, list[str], int]], labels: list[str]
    ) -> None:
        """Check every job before the first forward of a run: a request that cannot run fails
        now, in one line naming its document (``labels[i]``), not after hours of generation.

        Each member that will see a prompt renders (chat template) and encodes it; an empty
        prompt or a template that refuses the conversation is a :class:`RequestError`. (Stop
        lists, budgets and sampling values are checked while parsing the request:
        :func:`~lm_eval_safe.sampling.parse_gen_kwargs`. Prompts too long for a window are
        left-truncated, as lm-eval's ``hf`` does.)
        Nothing is kept: :meth:`prompt_ids` encodes again when the job runs (memory stays flat
        however many jobs there are; encoding is cheap next to decoding)."""
        members = [self.drafter] + (self.verifiers if self.schedule != "drafter" else [])
        for (context, *_), label in zip(jobs, labels, strict=True):
            for member in members:
                try:
                    self.encoded_prompt(member, context)
                except Exception as exc:  # a template error would otherwise surface mid-run
                    first = (str(exc).splitlines() or [type(exc).__name__])[0]
                    raise RequestError(f"{label}: {first}") from exc

    def prompt_ids(self, member: Member, context: str, reserve: int) -> list[int]:
        ids = self.encoded_prompt(member, context)
        room = max(1, member.max_length - reserve)
        if len(ids) > room:
            logger.warning(
                "prompt of %d tokens exceeds %s's window (%d) minus %d generation tokens; keeping the last %d",
                len(ids),
                member.name,
                member.max_length,
                reserve,
                room,
            )
            ids = ids[-room:]
        return ids

    # -- requests ----------------------------------------------------------------------
    def generate(
        self,
        context: str,
        until: list[str],
        max_new_tokens: int,
        sampling: SamplingParams | None = None,
        seed: int = 0,
    ) -> tuple[str, GenerationStats]:
        job = GenerationJob(context, until, max_new_tokens, sampling, seed)
        return self.generate_many([job], batch_size=1)[0]

    def generate_many(
        self,
        jobs: list[GenerationJob] | list[tuple[str, list[str], int]],
        batch_size: int = 1,
        on_done: Callable[[int, tuple[str, GenerationStats]], None] | None = None,
    ) -> list[tuple[str, GenerationStats]]:
        """Decode jobs (:class:`GenerationJob`, or ``(context, until, max_new_tokens)`` for greedy
        ones), ``batch_size`` rows at a time.

        Rows advance in lock-step SAFE cycles: every row drafts (one batched drafter forward per
        step), then each verifier serves the rows that need it in one batched forward, then each
        row accepts or rolls back on its own. A finished row is replaced by the next job at the
        cycle's end (continuous refill). With a prefix store, jobs run in the order of their
        contexts' text, so requests sharing exemplars run one after another and the store needs
        to hold only the current group's prefix (lm-eval hands requests over sorted by length,
        which interleaves the subtasks of a group); without one, longest first, as lm-eval's
        Collator orders them. Results come back in the original order either way.
        """
        members = [self.drafter, *self.verifiers]
        with small_row_linears(members):
            return self._generate_many(members, jobs, batch_size, on_done)

    def _generate_many(
        self,
        members: list[Member],
        jobs: list[GenerationJob] | list[tuple[str, list[str], int]],
        batch_size: int,
        on_done: Callable[[int, tuple[str, GenerationStats]], None] | None,
    ) -> list[tuple[str, GenerationStats]]:
        batches = [MemberBatch(m) for m in members]
        if self.drafter.prefix_store is not None:
            order = sorted(range(len(jobs)), key=lambda i: jobs[i][0])
        else:
            order = sorted(range(len(jobs)), key=lambda i: -len(jobs[i][0]))
        queue = deque(order)
        results: list[Any] = [None] * len(jobs)
        rows: list[_Row] = []
        while queue or rows:
            while queue and len(rows) < max(1, batch_size):
                index = queue.popleft()
                for batch in batches:
                    batch.add_row()
                rows.append(_Row(index, self._decode(*jobs[index])))
            for row in rows:
                row.advance()
            # serve forwards, drafter first, until every row has ended its cycle
            while waiting := [(r, row.call) for r, row in enumerate(rows) if row.call is not None]:
                member = min(call.member for _, call in waiting)
                calls = {r: call for r, call in waiting if call.member == member}
                for r, out in batches[member].run(calls).items():
                    rows[r].advance(out)
            alive = [r for r, row in enumerate(rows) if not row.done]
            for row in rows:
                if row.done:
                    results[row.index] = row.result
                    if on_done is not None:
                        on_done(row.index, row.result)
            for batch in batches:
                batch.keep_rows(alive)
            rows = [rows[r] for r in alive]
        return results

    def _decode(
        self,
        context: str,
        until: list[str],
        max_new_tokens: int,
        sampling: SamplingParams | None = None,
        seed: int = 0,
    ) -> Steps:
        """One request's SAFE loop (SAFE_SPEC §3): the same code at every batch size.

        Sampled requests (README "Sampling") differ in three places: the drafter draws its
        tokens, every aligned position is an ensemble point, and at each point speculative
        sampling keeps or replaces the drafted string, in order, until the first replacement.
        """
        start_time = time.perf_counter()
        stats = GenerationStats()
        drafter = self.drafter
        sampler = None if sampling is None or sampling.greedy else RowSampler(sampling, seed)
        stats.sampled_requests = int(sampler is not None)
        run = DrafterRun(
            drafter, self.prompt_ids(drafter, context, max_new_tokens), sampler=sampler
        )
        verifiers: list[VerifierRun] = []
        if self.schedule != "drafter":
            for slot, member in enumerate(self.verifiers, start=1):
                reserve = min(member.max_length // 2, 2 * max_new_tokens + 8)
                verifiers.append(
                    VerifierRun(
                        member,
                        self.prompt_ids(member, context, reserve),
                        self.options.verifier_cache,
                        slot=slot,
                    )
                )
        schedule = self.schedule
        window = DraftWindow(self.options.draft_len)
        generated: list[int] = []
        generated_bytes = b""
        text = ""
        while len(generated) < max_new_tokens:
            budget = max_new_tokens - len(generated)
            n = 1 if schedule == "every" else min(window.size, budget)
            tokens, logprobs = yield from run.draft(n)
            stats.cycles += 1
            points: list[EnsemblePoint] = []
            judged = len(tokens)
            if schedule != "drafter":
                try:
                    points, judged = yield from self._find_points(
                        schedule, verifiers, generated_bytes, tokens, logprobs, stats, sampler
                    )
                except WindowExhausted as exc:
                    logger.warning(
                        "verifier %s ran out of context window; continuing with the drafter alone",
                        exc,
                    )
                    schedule = "drafter"
            for point in points:
                j = point.position
                if sampler is None:
                    choice = self._aggregate(point.views)
                else:
                    choice = self._sample_choice(point.views, tokens[j], sampler)
                replacement = self._to_drafter_ids(choice, tokens[j])
                stats.ensemble_ops += 1
                stats.sharpened_ops += int(choice.sharpened)
                if replacement != tokens[j : j + 1]:
                    stats.ensemble_replaced += 1
                    stats.accepted_tokens += j
                    window.rejected = True
                    tokens = tokens[:j] + replacement
                    run.rewind(len(generated) + j, replacement)
                    break
                stats.ensemble_kept += 1  # the drafter's own token: no rewind
            else:
                # positions up to `judged` are settled; later ones wait for the next cycle
                stats.accepted_tokens += judged
                run.carry(tokens[judged:], logprobs[judged:])
                tokens = tokens[:judged]
            window.update()
            eos_at = next((i for i, t in enumerate(tokens) if t in drafter.eos_ids), None)
            if eos_at is not None:
                tokens = tokens[: eos_at + 1]
            generated.extend(tokens)
            generated_bytes += drafter.vocab.spell(tokens)
            for verifier in verifiers:
                verifier.forget_before(len(verifier.gen_ids) - 2 * window.largest - 4)
            text = drafter.tokenizer.decode(generated[:max_new_tokens], skip_special_tokens=True)
            if eos_at is not None or _find_stop(text, until) is not None:
                break
            yield CYCLE_END
        generated = generated[:max_new_tokens]
        stats.generated_tokens = len(generated)
        stats.drafted_tokens = run.drafted
        stats.verifier_positions = sum(v.recomputed for v in verifiers)
        stats.wall_seconds = time.perf_counter() - start_time
        stop = _find_stop(text, until)
        return (text if stop is None else text[:stop]), stats

    # -- schedules -----------------------------------------------------------------------
    def _find_points(
        self,
        schedule: str,
        verifiers: list[VerifierRun],
        committed: bytes,
        tokens: list[int],
        logprobs: list[torch.Tensor],
        stats: GenerationStats,
        sampler: RowSampler | None = None,
    ) -> Steps:
        """The positions to ensemble among the drafted ``tokens``, in order, and how many
        drafted positions that settles: the schedule's rule, with verifiers synced only when the
        rule needs them.

        Greedy: the first point only; the positions after it are judged in a later cycle.
        Sampled (``sampler``): every aligned position of ``safe``/``aligned``, since SAFE's
        consensus skip holds for an argmax only (README "Sampling"); gates that read the
        drafter's distribution alone (GaC's p < 0.5, ``threshold``) stay, they do not depend on
        the token drawn.
        """
        vocab = self.drafter.vocab
        if schedule == "every":
            views = yield from self._views_at_end(verifiers, committed, logprobs[0], stats)
            return [EnsemblePoint(0, views)], 1
        if schedule == "threshold":
            for j, row in enumerate(logprobs):
                if float(row.max().exp()) < self.options.threshold:
                    prefix = committed + vocab.spell(tokens[:j])
                    views = yield from self._views_at_end(verifiers, prefix, row, stats)
                    return [EnsemblePoint(j, views)], j + 1
            return [], len(tokens)
        # safe / aligned: drafter-side filters first, so a cycle with no candidate position
        # costs no verifier forward at all (the verifier caches catch up in a later cycle).
        full = committed + vocab.spell(tokens)
        gac_gate = schedule == "safe" and self.options.aggregator == "gac"
        # Sampling: the start of the generation is a token boundary of every member whatever is
        # drawn there (each tokenizes the prompt and the generated text apart), so it is not
        # judged from the drafted token, and the first string is distributed exactly as P_ens.
        start = sampler is not None and not committed
        candidates: list[tuple[int, int]] = []  # (drafted index, byte offset before it)
        offset = len(committed)
        for j, token in enumerate(tokens):
            here = offset
            offset += len(vocab.text_bytes[token])
            if gac_gate and float(logprobs[j].max().exp()) >= 0.5:
                # GaC's own gate: a confident drafter is never ensembled (its largest
                # probability: the drafted token's own when greedy; never the token drawn)
                continue
            is_eos = token in self.drafter.eos_ids
            if not (start and j == 0) and (
                (not is_eos and here == offset) or not is_char_boundary(full, here)
            ):
                continue
            candidates.append((j, here))
        if not candidates:
            return [], len(tokens)
        text = valid_utf8_prefix(full)
        want = {here for _, here in candidates}
        synced = []
        for verifier in verifiers:
            ids, ends = yield from verifier.sync_steps(text, full, want)
            if ends is None and not start:
                return [], len(tokens)
            synced.append((verifier, ids, ends))
        points: list[EnsemblePoint] = []
        for j, here in candidates:
            token = tokens[j]
            if start and j == 0:
                indices: list[tuple[int, int | None]] | None = [(0, None)] * len(synced)
            else:
                indices = self._aligned_indices(synced, here, token)
            if indices is None:
                continue
            stats.aligned_positions += 1
            views = [View(logprobs[j], vocab, self.drafter.tokenizer, self.weights[0])]
            views += [
                View(verifier.pred[i], verifier.member.vocab, verifier.member.tokenizer, w)
                for (verifier, _, _), (i, _), w in zip(
                    synced, indices, self.weights[1:], strict=True
                )
            ]
            if (
                schedule == "safe"
                and sampler is None
                and self._consensus(views, token, [own for _, own in indices])
            ):
                continue
            points.append(EnsemblePoint(j, views))
            if sampler is None:
                return points, j + 1
        return points, len(tokens)

    def _aligned_indices(
        self, synced: list[tuple[VerifierRun, list[int], list[int] | None]], here: int, token: int
    ) -> list[tuple[int, int | None]] | None:
        """Each verifier's index predicting the token at byte ``here`` and its own next token
        there, or None when ``here`` is not a boundary of every verifier's tokenization."""
        is_eos = token in self.drafter.eos_ids
        indices: list[tuple[int, int | None]] = []
        for verifier, ids, ends in synced:
            i = None if ends is None else boundary_index(ends, here)
            if i is None:
                return None
            own = ids[i] if i < len(ids) else (verifier.member.eos_id if is_eos else None)
            if own is None or (is_eos and i < len(ids)):
                return None
            indices.append((i, own))
        return indices

    def _consensus(self, views: list[View], token: int, own_ids: list[int]) -> bool:
        """SAFE's skip rules: (a) every verifier's argmax is its own next token, or (b) the mean
        probability of each member's own next token exceeds 0.5."""
        drafter_p = float(views[0].logprobs[token].exp())
        if all(
            int(torch.argmax(v.logprobs)) == own for v, own in zip(views[1:], own_ids, strict=True)
        ):
            return True
        probs = [drafter_p] + [
            float(v.logprobs[own].exp()) for v, own in zip(views[1:], own_ids, strict=True)
        ]
        total = sum(v.weight for v in views)
        mean = sum(v.weight * p for v, p in zip(views, probs, strict=True)) / total
        return mean > 0.5

    def _views_at_end(
        self,
        verifiers: list[VerifierRun],
        text_bytes: bytes,
        drafter_row: torch.Tensor,
        stats: GenerationStats,
    ) -> Steps:
        """Views after each verifier's full tokenization of the text (OOV-like where misaligned:
        the behaviour of the every-token and threshold baselines, counted in the stats)."""
        text = valid_utf8_prefix(text_bytes)
        aligned = len(text.encode("utf-8")) == len(text_bytes)
        views = [View(drafter_row, self.drafter.vocab, self.drafter.tokenizer, self.weights[0])]
        for verifier, weight in zip(verifiers, self.weights[1:], strict=True):
            ids, ends = yield from verifier.sync_steps(text, text_bytes)
            aligned = aligned and ends is not None and (not ends or ends[-1] == len(text_bytes))
            member = verifier.member
            views.append(View(verifier.pred[len(ids)], member.vocab, member.tokenizer, weight))
        stats.misaligned_ensembles += int(not aligned)
        return views

    # -- ensembling ----------------------------------------------------------------------
    def _aggregate(self, views: list[View]) -> Choice:
        o = self.options
        if o.aggregator == "gac":
            return gac(views, self.union, o.sharpen, o.sharpen_lambda, o.top_k)
        return unite(views, o.sharpen, o.sharpen_lambda, o.top_k)

    def _sample_choice(self, views: list[View], drafted: int, sampler: RowSampler) -> Choice:
        """Speculative sampling at an ensemble point, over strings (README "Sampling").

        P_draft is the drafter's warped distribution summed per string; P_ens the aggregate of
        every member's warped distribution (the same code as the greedy argmax), restricted to
        strings the drafter can write and renormalised. The drafted string is kept with
        probability min(1, P_ens/P_draft), else replaced by a draw from the residual
        norm(max(0, P_ens - P_draft)): the string emitted is distributed as P_ens.
        """
        o = self.options
        warped = [View(sampler.warp(v.logprobs), v.vocab, v.tokenizer, v.weight) for v in views]
        drafter_probs = warped[0].logprobs.exp()
        if o.aggregator == "gac":
            target = gac_distribution(warped, self.union, o.sharpen, o.sharpen_lambda, o.top_k)
            mapping = self.union.maps[0]
            draft = torch.zeros(len(self.union), dtype=torch.float64)
            draft.scatter_add_(0, mapping, drafter_probs)
            drafted_index = int(mapping[drafted])
            probs = target.probs * self._union_sayable
        else:
            # unite's strings, then one slot for every other string (P_ens is 0 there)
            target = unite_distribution(warped, o.sharpen, o.sharpen_lambda, o.top_k)
            ids_of = self._drafter_ids_by_key
            draft = torch.tensor(
                [float(drafter_probs[ids_of.get(key, [])].sum()) for key in target.keys] + [0.0],
                dtype=torch.float64,
            )
            draft[-1] = max(0.0, 1.0 - float(draft.sum()))
            key = self.drafter.vocab.keys[drafted]
            drafted_index = target.keys.index(key) if key in target.keys else len(target.keys)
            sayable = [self._drafter_can_say(k) for k in target.keys] + [False]
            probs = torch.cat([target.probs, torch.zeros(1, dtype=torch.float64)])
            probs = probs * torch.tensor(sayable, dtype=torch.float64)
        total = float(probs.sum())
        if total <= 0.0:  # the members share no string the drafter can write: keep its draw
            return Choice(self.drafter.vocab.keys[drafted], 0.0, False)
        probs = probs / total
        index = sampler.keep_or_resample(probs, draft, drafted_index)
        if index == drafted_index:
            return Choice(self.drafter.vocab.keys[drafted], float(probs[index]), target.sharpened)
        return Choice(target.keys[index], float(probs[index]), target.sharpened)

    @cached_property
    def _drafter_ids_by_key(self) -> dict[bytes, list[int]]:
        """Every drafter id of each string (several ids may spell one string: P_draft sums them)."""
        ids: dict[bytes, list[int]] = {}
        for token_id, key in enumerate(self.drafter.vocab.keys):
            ids.setdefault(key, []).append(token_id)
        return ids

    @cached_property
    def _union_sayable(self) -> torch.Tensor:
        """1.0 for each union string the drafter can write, else 0.0 (see _drafter_can_say)."""
        return torch.tensor(
            [self._drafter_can_say(key) for key in self.union.keys], dtype=torch.float64
        )

    def _drafter_can_say(self, key: bytes) -> bool:
        """Whether :meth:`_to_drafter_ids` turns ``key`` into drafter ids of its own rather than
        falling back to the drafted token: not for another member's special tokens, bytes that
        are no UTF-8 text the drafter has no token for, or EOS when the drafter has none."""
        if key == EOS_KEY:
            return self.drafter.eos_id is not None
        if key in self.drafter.vocab.lookup:
            return True
        if key.startswith(b"\x00"):
            return False
        try:
            key.decode("utf-8")
        except UnicodeDecodeError:
            return False
        return True

    def _to_drafter_ids(self, choice: Choice, drafted: int) -> list[int]:
        """The chosen string as drafter ids (SAFE_SPEC §4): gac keeps all ids, unite the first."""
        vocab = self.drafter.vocab
        if choice.key == EOS_KEY:
            eos = self.drafter.eos_id
            return [eos] if eos is not None else [drafted]
        if vocab.keys[drafted] == choice.key:
            return [drafted]
        if choice.key in vocab.lookup:
            return [vocab.lookup[choice.key]]
        if choice.key.startswith(b"\x00"):
            return [drafted]  # another member's special token: the drafter cannot say it
        try:
            text = choice.key.decode("utf-8")
        except UnicodeDecodeError:
            return [drafted]
        ids = vocab.encode_text(self.drafter.tokenizer, text)
        if not ids:
            return [drafted]
        return ids if self.options.aggregator == "gac" else ids[:1]


class _Row:
    """A job in the batch: its decoding steps and the forward it waits for (None: the cycle's
    end, or done)."""

    def __init__(self, index: int, steps: Steps):
        self.index = index
        self.steps = steps
        self.call: Forward | None = None
        self.done = False
        self.result: Any = None
        self._started = False

    def advance(self, answer: Any = None) -> None:
        if self.done:
            return
        try:
            step = self.steps.send(answer) if self._started else next(self.steps)
        except StopIteration as stop:
            self.done, self.call, self.result = True, None, stop.value
            return
        self._started = True
        self.call = None if step is CYCLE_END else step


def _find_stop(text: str, until: list[str]) -> int | None:
    """Earliest index where any stop string starts (stop strings may span tokens)."""
    hits = [text.find(s) for s in until if s]
    hits = [h for h in hits if h >= 0]
    return min(hits) if hits else None
