"""The SAFE decoder: one loop for every schedule (docs/algorithm.md, The cycle and Stops).

Each cycle the drafter proposes up to ``draft_len`` tokens with its KV cache; the schedule
(:mod:`lm_eval_safe.decoder.schedules`) picks the ensemble points among them, syncing the verifiers
(:mod:`lm_eval_safe.decoder.member_runs`) only when its rule needs them; the ensembler
(:mod:`lm_eval_safe.ensemble.ensembler`) decides each point; the drafter keeps or rewinds. A request's
loop is a generator of forwards, so the batch scheduler (:mod:`lm_eval_safe.decoder.batch_driver`) runs
any number of requests in lock-step with exactly the text each gets alone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import NamedTuple

from lm_eval_safe.decoder.batch_driver import CYCLE_END, InOrder, RequestSource, Steps, run_batched
from lm_eval_safe.decoder.draft_window import DraftWindow
from lm_eval_safe.decoder.latency import CycleForwards, forward_depth
from lm_eval_safe.decoder.member_runs import (
    DrafterRun,
    VerifierRun,
    WindowExhausted,
    verifier_reserve,
)
from lm_eval_safe.decoder.overlap import overlap_enabled, verify_beside_draft
from lm_eval_safe.decoder.schedules import Draft, DrafterAlone, Schedule, make_schedule
from lm_eval_safe.decoder.stats import TRACE_COUNTS, GenerationStats, counts
from lm_eval_safe.decoder.tracing import ResponseTrace
from lm_eval_safe.engines import engines_active
from lm_eval_safe.ensemble.ensembler import Ensembler
from lm_eval_safe.ensemble.sampling import RowSampler, SamplingParams
from lm_eval_safe.errors import RequestError
from lm_eval_safe.members.member import Member
from lm_eval_safe.options import SafeOptions

logger = logging.getLogger(__name__)


class GenerationJob(NamedTuple):
    """One request for :meth:`SafeDecoder.generate_many` (a plain 3-tuple is a greedy job)."""

    context: str
    until: list[str]
    max_new_tokens: int
    sampling: SamplingParams | None = None  # None, or greedy params: argmax decoding
    seed: int = 0  # the request's own random stream (sampling only)


@dataclass
class RequestState:
    """Everything one request's loop carries from cycle to cycle."""

    drafter: DrafterRun
    verifiers: list[VerifierRun]
    schedule: Schedule  # becomes the drafter alone if a verifier's window runs out
    window: DraftWindow
    sampler: RowSampler | None
    stats: GenerationStats = field(default_factory=GenerationStats)
    generated: list[int] = field(default_factory=list)
    generated_bytes: bytes = b""
    text: str = ""
    trace: ResponseTrace | None = None  # trace=true only
    cycles: list[CycleForwards] = field(default_factory=list)  # the forwards of each cycle

    def count_work(self, max_new_tokens: int) -> None:
        """The request's statistics of tokens and forwards, once its loop is over."""
        stats = self.stats
        stats.generated_tokens = len(self.generated[:max_new_tokens])
        stats.drafted_tokens = self.drafter.drafted
        stats.verifier_positions = sum(v.recomputed for v in self.verifiers)
        stats.drafter_forwards = self.drafter.forwards
        stats.verifier_forwards = {v.member.name: v.forwards for v in self.verifiers}
        stats.forward_depth, stats.forward_depth_overlapped = forward_depth(self.cycles)


def encoded_prompt(member: Member, context: str) -> list[int]:
    """The member's ids of ``context`` (its own chat template applied), before truncation;
    a context that leaves a member nothing to continue from is a ``ValueError``."""
    ids = member.encode(member.render_context(context))
    if not ids:
        raise ValueError(
            f"empty prompt for member {member.name!r}: safe-ensemble needs a non-empty context to continue"
        )
    return ids


def prompt_ids(member: Member, context: str, reserve: int) -> list[int]:
    """The member's ids of ``context`` with room for ``reserve`` generated ids: left-truncated
    to its window, as lm-eval's ``hf`` truncates."""
    ids = encoded_prompt(member, context)
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


class SafeDecoder:
    """Generation with one drafter and any number of verifiers: greedy, or sampled (README
    "Sampling": speculative sampling's rule over strings at the ensemble points)."""

    def __init__(self, members: list[Member], drafter_index: int, options: SafeOptions):
        self.options = options
        self.drafter = members[drafter_index]
        self.verifiers = [m for i, m in enumerate(members) if i != drafter_index]
        weights = options.member_weights(len(members))
        self.weights = [weights[drafter_index]] + [
            w for i, w in enumerate(weights) if i != drafter_index
        ]
        self.schedule = make_schedule(options, self.drafter, self.weights, len(self.verifiers))
        self.ensembler = Ensembler(self.drafter, self.verifiers, options)
        self.overlap = self.schedule.needs_verifiers and overlap_enabled(
            options.overlap, self.drafter, self.verifiers
        )
        # benchmarks: each request's cycles (lm_eval_safe.decoder.latency) in the order they start
        self.cycle_log: list[list[CycleForwards]] | None = None

    # -- prompts -------------------------------------------------------------------------
    encoded_prompt = staticmethod(encoded_prompt)
    prompt_ids = staticmethod(prompt_ids)

    def preflight(
        self, jobs: list[GenerationJob] | list[tuple[str, list[str], int]], labels: list[str]
    ) -> None:
        """Check every job before the first forward of a run: a request that cannot run fails
        now, in one line naming its document (``labels[i]``), not after hours of generation.

        Each member that will see a prompt renders (chat template) and encodes it; an empty
        prompt or a template that refuses the conversation is a :class:`RequestError`. (Stop
        lists, budgets and sampling values are checked while parsing the request:
        :func:`~lm_eval_safe.ensemble.sampling.parse_gen_kwargs`. Prompts too long for a window are
        left-truncated, as lm-eval's ``hf`` does.)
        Nothing is kept: :meth:`prompt_ids` encodes again when the job runs (memory stays flat
        however many jobs there are; encoding is cheap next to decoding)."""
        members = [self.drafter] + (self.verifiers if self.schedule.needs_verifiers else [])
        for job, label in zip(jobs, labels, strict=True):
            context = job[0]
            check_sampling(self.options, GenerationJob(*job), label)
            for member in members:
                try:
                    encoded_prompt(member, context)
                except Exception as exc:  # a template error would otherwise surface mid-run
                    first = (str(exc).splitlines() or [type(exc).__name__])[0]
                    raise RequestError(f"{label}: {first}") from exc

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
        on_trace: Callable[[int, dict], None] | None = None,
    ) -> list[tuple[str, GenerationStats]]:
        """Decode jobs (:class:`GenerationJob`, or ``(context, until, max_new_tokens)`` for greedy
        ones), ``batch_size`` rows at a time (:func:`~lm_eval_safe.decoder.batch_driver.run_batched`).

        With a prefix store, jobs run in the order of their contexts' text, so requests sharing
        exemplars run one after another and the store needs to hold only the current group's
        prefix (lm-eval hands requests over sorted by length, which interleaves the subtasks of
        a group); without one, longest first, as lm-eval's Collator orders them. Results come
        back in the original order either way. ``on_trace``, when given, receives each
        request's trace (:mod:`lm_eval_safe.decoder.tracing`) as it finishes, before ``on_done``."""
        members = [self.drafter, *self.verifiers]
        if self.drafter.engine.shares_prefixes:
            order = sorted(range(len(jobs)), key=lambda i: jobs[i][0])
        else:
            order = sorted(range(len(jobs)), key=lambda i: -len(jobs[i][0]))
        results: dict[int, tuple[str, GenerationStats]] = {}

        def finished(index: int, result: tuple[str, GenerationStats]) -> None:
            results[index] = result
            if on_done is not None:
                on_done(index, result)

        with engines_active(members):
            run_batched(
                members,
                InOrder(order),
                lambda i: self._decode(
                    GenerationJob(*jobs[i]), None if on_trace is None else partial(on_trace, i)
                ),
                batch_size,
                finished,
                threaded=self.overlap,
            )
        return [results[i] for i in range(len(jobs))]

    def serve(
        self,
        source: RequestSource,
        job_of: Callable[[int], GenerationJob],
        batch_size: int,
        on_done: Callable[[int, tuple[str, GenerationStats]], None],
        on_error: Callable[[int, Exception], None],
        on_text: Callable[[int, str], None] | None = None,
    ) -> None:
        """Decode requests as ``source`` hands them over until it closes (a server's loop):
        each joins the running batch at a cycle's end and leaves it when done or cancelled.
        ``on_text(i, text)``: request ``i``'s text after each cycle, every token in it settled
        (accepted or ensembled; stop strings not yet cut); a request whose own decoding fails
        goes to ``on_error`` and its batch-mates go on."""
        members = [self.drafter, *self.verifiers]
        with engines_active(members):
            run_batched(
                members,
                source,
                lambda i: self._decode(
                    job_of(i), on_text=None if on_text is None else partial(on_text, i)
                ),
                batch_size,
                on_done,
                threaded=self.overlap,
                on_error=on_error,
            )

    def _start(self, job: GenerationJob) -> RequestState:
        check_sampling(self.options, job, "request")
        context, max_new_tokens, sampling = job.context, job.max_new_tokens, job.sampling
        sampler = None if sampling is None or sampling.greedy else RowSampler(sampling, job.seed)
        drafter = DrafterRun(
            self.drafter, self.prompt_ids(self.drafter, context, max_new_tokens), sampler=sampler
        )
        verifiers = []
        if self.schedule.needs_verifiers:
            for slot, member in enumerate(self.verifiers, start=1):
                prompt = self.prompt_ids(member, context, verifier_reserve(member, max_new_tokens))
                verifiers.append(VerifierRun(member, prompt, self.options.verifier_cache, slot=slot))
        state = RequestState(drafter, verifiers, self.schedule, DraftWindow(self.options.draft_len), sampler)
        state.stats.sampled_requests = int(sampler is not None)
        return state

    def _decode(
        self,
        job: GenerationJob,
        emit: Callable[[dict], None] | None = None,
        on_text: Callable[[str], None] | None = None,
    ) -> Steps:
        """One request's SAFE loop (docs/algorithm.md, The cycle): the same code at every batch size.

        Sampled requests (README "Sampling") differ in three places: the drafter draws its
        tokens, every aligned position is an ensemble point, and at each point speculative
        sampling keeps or replaces the drafted string, in order, until the first replacement.
        """
        start_time = time.perf_counter()
        until, max_new_tokens = job.until, job.max_new_tokens
        state = self._start(job)
        if emit is not None:
            state.trace = ResponseTrace([m.name for m in (self.drafter, *self.verifiers)])
        stats, drafter = state.stats, self.drafter
        if self.cycle_log is not None:
            self.cycle_log.append(state.cycles)
        while len(state.generated) < max_new_tokens:
            budget = max_new_tokens - len(state.generated)
            n = state.schedule.draft_size(state.window, budget)
            cycle = CycleForwards(verifiers=[[] for _ in state.verifiers])
            drafted_before = state.drafter.drafted
            alone = not state.schedule.needs_verifiers
            tokens, logprobs = yield from state.drafter.draft(n, tuple(until) if alone else (), not alone)
            cycle.drafter = state.drafter.drafted - drafted_before
            state.cycles.append(cycle)
            stats.cycles += 1
            draft = Draft(state.generated_bytes, tokens, logprobs, state.generated)
            tokens = yield from self._settle(state, draft, cycle, ahead=budget - len(tokens))
            state.window.update()
            eos_at = next((i for i, t in enumerate(tokens) if t in drafter.eos_ids), None)
            if eos_at is not None:
                tokens = tokens[: eos_at + 1]
            state.generated.extend(tokens)
            state.generated_bytes += drafter.vocab.spell(tokens)
            for verifier in state.verifiers:
                verifier.forget_before(len(verifier.gen_ids) - state.window.forget_margin())
            state.text = drafter.tokenizer.decode(
                state.generated[:max_new_tokens], skip_special_tokens=True
            )
            if eos_at is not None or _find_stop(state.text, until) is not None:
                stats.stopped_requests = 1
                break
            if on_text is not None:
                on_text(state.text)
            if len(state.generated) < max_new_tokens:  # else its row leaves the batch now, not a cycle later
                yield CYCLE_END
        state.count_work(max_new_tokens)
        stats.wall_seconds = time.perf_counter() - start_time
        stop = _find_stop(state.text, until)
        text = state.text if stop is None else state.text[:stop]
        if emit is not None and state.trace is not None:
            ids, sampled = state.generated[:max_new_tokens], state.sampler is not None
            emit(state.trace.record(text, ids, counts(stats, TRACE_COUNTS), sampled))
        return text, stats

    def _settle(self, state: RequestState, draft: Draft, cycle: CycleForwards, ahead: int) -> Steps:
        """Ensemble the cycle's points in order; returns the tokens this cycle commits. The
        first point whose choice is not the drafted token replaces the rest of the window and
        rewinds the drafter; drafted tokens after the last judged position wait for the next
        cycle (carried, not drafted again). With overlap, the drafter drafts up to the next
        window (at most ``ahead`` tokens of the budget) while the verifiers run."""
        stats, tokens, drafter = state.stats, draft.tokens, self.drafter
        points, judged = [], len(tokens)
        drafts_ahead = state.drafter if self.overlap and state.sampler is None else None
        ahead = min(ahead, state.window.size_if_kept()) - len(state.drafter.carried)
        try:
            points, judged = yield from verify_beside_draft(
                state.schedule.points(draft, state.verifiers, stats, state.sampler is not None),
                cycle,
                drafts_ahead,
                ahead,
            )
        except WindowExhausted as exc:
            logger.warning(
                "verifier %s ran out of context window; continuing with the drafter alone", exc
            )
            state.schedule = DrafterAlone(self.drafter, self.weights)
        ensembler, traced = self.ensembler, state.trace is not None
        for point in points:
            j = point.position
            decision = yield from ensembler.decide(point.views, tokens[j], state.sampler, traced)
            choice, views, test, certified = decision
            stats.count_point(choice.sharpened, certified)
            replacement = ensembler.to_drafter_ids(choice, tokens[j])
            if state.trace is not None:
                candidates = ensembler.candidates(views, state.sampler)
                state.trace.add_point(
                    drafter, state.generated, tokens, j, choice, replacement, candidates, test
                )
            if replacement != tokens[j : j + 1]:
                stats.ensemble_replaced += 1
                cycle.replaced = True
                stats.accepted_tokens += j
                state.window.rejected = True
                state.drafter.rewind(len(state.generated) + j, replacement)
                return tokens[:j] + replacement
            stats.ensemble_kept += 1  # the drafter's own token: no rewind
        stats.accepted_tokens += judged
        state.drafter.carry(tokens[judged:], draft.logprobs[judged:])
        return tokens[:judged]


def check_sampling(options: SafeOptions, job: GenerationJob, label: str) -> None:
    """The authors' code decodes greedily: ``reference=authors`` has no sampled rule."""
    if options.reference == "authors" and job.sampling is not None and not job.sampling.greedy:
        raise RequestError(f"{label}: reference=authors decodes greedily, as the authors' code; sample with reference=paper")


def _find_stop(text: str, until: list[str]) -> int | None:
    """Earliest index where any stop string starts (stop strings may span tokens)."""
    hits = [text.find(s) for s in until if s]
    hits = [h for h in hits if h >= 0]
    return min(hits) if hits else None
