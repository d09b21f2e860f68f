"""Each member's decoding state for one request: the drafter's tokens and KV-cache length, and a
verifier's tokenization of the text with its reusable cache (docs/algorithm.md, The cycle and Caches).

Both speak only in engine calls (:class:`~lm_eval_safe.engines.base.Draft`,
:class:`~lm_eval_safe.engines.base.Forward`, yielded from their step generators), so the same
state runs alone or as one row of a batch, on any engine.
"""

from __future__ import annotations

from lm_eval_safe.decoder.batch_driver import Pending, Steps, drive, solo_batch
from lm_eval_safe.engines.base import Draft, EngineBatch, Forward, Row
from lm_eval_safe.ensemble.sampling import RowSampler
from lm_eval_safe.members.member import Member
from lm_eval_safe.members.vocabulary import boundary_index


class WindowExhausted(RuntimeError):
    """A verifier's context window is full; the request continues with the drafter alone."""


def verifier_reserve(member: Member, max_new_tokens: int) -> int:
    """Window room kept free after a verifier's prompt: its tokenization of the generated text
    may be longer than the drafter's (at most twice, plus a margin), but never more than half
    of the window is taken from the prompt."""
    return min(member.max_length // 2, 2 * max_new_tokens + 8)


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
        self.forwards = 0  # every forward, speculative ones that were rolled back included
        # (token, distribution, drafted ahead): tokens waiting for a later cycle
        self.carried: list[tuple[int, Row, bool]] = []

    def draft(self, n: int, until: tuple[str, ...] = (), rows: bool = True) -> Steps:
        """Up to ``n`` tokens: carried ones first, then drafted (``until``: stop strings the
        engine may stop at, for the drafter alone; ``rows``: False when the caller reads the
        tokens only, and the returned distributions may then be fewer than the tokens)."""
        taken, self.carried = self.carried[:n], self.carried[n:]
        tokens = [token for token, _, _ in taken]
        logprobs = [row for _, row, _ in taken]
        self.drafted += sum(ahead for _, _, ahead in taken)  # a speculative draft, now used
        if (tokens and tokens[-1] in self.member.eos_ids) or len(tokens) >= n:
            return tokens, logprobs
        drafted = yield from self._draft(n - len(tokens), until, rows)
        self.drafted += len(drafted.tokens)
        return tokens + drafted.tokens, logprobs + drafted.rows

    def draft_ahead(self, verified: Pending, limit: int) -> Steps:
        """Draft up to ``limit`` tokens after everything drafted so far while ``verified`` (a
        launched verifier forward) runs, on the assumption that the window it verifies is kept:
        they wait in ``carried`` and the next cycle takes them as it takes carried tokens. A
        replacement rolls them back with the rest (:meth:`rewind`). Greedy only: the tokens are
        those the next cycle would draft, from the same cache, one forward each."""
        last = self.pending[-1]  # the last token drafted (or chosen), fed next
        drafted = 0
        while drafted < limit and not verified.done() and last not in self.member.eos_ids:
            ahead = yield from self._draft(1)
            last, row = ahead.tokens[0], ahead.rows[0]
            self.carried.append((last, row, True))
            drafted += 1

    def _draft(self, n: int, until: tuple[str, ...] = (), rows: bool = True) -> Steps:
        """One engine call: feed what is pending and draft up to ``n`` tokens (after an EOS
        none). Every drafted token but the last is in the engine's sequence afterwards; the
        last is fed by the next call."""
        drafted = yield Draft(
            self.slot, self.cached, self.pending, n, self.member.eos_ids, self.sampler, until, rows
        )
        self.cached += len(self.pending) + len(drafted.tokens) - 1
        self.forwards += len(drafted.tokens)
        self.pending = [drafted.tokens[-1]]
        return drafted

    def carry(self, tokens: list[int], logprobs: list[Row]) -> None:
        """Keep drafted tokens that follow an accepted ensemble point for the next cycle."""
        kept = [(token, row, False) for token, row in zip(tokens, logprobs, strict=True)]
        self.carried = kept + self.carried

    def rewind(self, generated_kept: int, pending: list[int]) -> None:
        """Drop drafted tokens from the cache: keep the prompt and ``generated_kept`` tokens."""
        self.cached = min(self.cached, self.prompt_len + generated_kept)
        self.pending = list(pending)
        self.carried = []


class VerifierRun:
    """A verifier's state for one request: its tokenization of the text and a reusable KV cache.

    ``pred[i]`` holds the log-probabilities predicting generated token ``i`` (``pred[0]`` comes
    from the prompt). When the text grows, the cache is kept up to the longest prefix of the ids
    it holds that the new tokenization still starts with (BPE may re-merge the last tokens), and
    only the rest is fed. The prompt is never recomputed.

    A sync feeds the text only up to the last token whose row it wants: tokens after it wait in
    ``gen_ids`` for a later sync, which feeds them with its own window (a replacement in between
    would have made them wasted work). The last fed token's row is therefore always one asked
    for, so the next window's first row never needs that token fed a second time.
    """

    def __init__(
        self, member: Member, prompt_ids: list[int], reuse_cache: bool = True, slot: int = 1
    ):
        self.member = member
        self.slot = slot
        self.prompt_ids = list(prompt_ids)
        self.reuse_cache = reuse_cache
        self.gen_ids: list[int] = []  # this verifier's ids of the text last synced
        self.fed = 0  # of those, how many are in the cache (after the prompt)
        self.pred: dict[int, Row] = {}
        self.recomputed = 0
        self.forwards = 0
        self._solo: dict[int, EngineBatch] | None = None

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
        ids = self.member.vocab.encode_text(self.member.tokenizer, text)
        ends = self.member.vocab.token_ends(ids, text_bytes[: len(text.encode("utf-8"))])
        wanted = {len(ids)} if want_offsets is None else self._indices_at(want_offsets, ends)
        yield from self.feed_steps(ids, wanted)
        return ids, ends

    def feed_steps(self, ids: list[int], wanted: set[int]) -> Steps:
        """Make ``pred`` hold the rows predicting ``ids[i]`` for each ``i`` in ``wanted`` (``ids``:
        this verifier's tokenization of the generated text, however it was made), feeding
        only what the cache lacks, in one forward."""
        if 0 not in self.pred:
            prompt = self.prompt_ids
            self.pred[0] = (yield Forward(self.slot, 0, prompt, [len(prompt) - 1]))[0]
            self.forwards += 1
        if len(self.prompt_ids) + len(ids) > self.member.engine.sequence_limit:
            raise WindowExhausted(self.member.name)
        keep = 0
        if self.reuse_cache:
            limit = min(len(ids), self.fed)
            while keep < limit and ids[keep] == self.gen_ids[keep]:
                keep += 1
        # rows up to index `keep` depend only on cached tokens that are unchanged
        for stale in [i for i in self.pred if i > keep]:
            del self.pred[stale]
        self.gen_ids, self.fed = ids, keep
        missing = sorted(i for i in wanted if i not in self.pred)
        if missing:
            start = min(keep, missing[0] - 1)  # pred[0] always exists
            feed = ids[start : missing[-1]]
            want = [i - 1 - start for i in missing]
            rows = yield Forward(self.slot, len(self.prompt_ids) + start, feed, want)
            for i, row in zip(missing, rows, strict=True):
                self.pred[i] = row
            self.recomputed += len(feed)
            self.forwards += 1
            self.fed = missing[-1]

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
