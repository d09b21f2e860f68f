"""lm-eval's ``generate_until`` requests as decoder jobs, and the one warning a run of empty
responses deserves.

The model class adapts lm-eval to the decoder; what a request *means* (its stop strings with the
drafter's EOS text, its budget against the drafter's window, its sampling seed and repeat
index) is decided here, before the first forward, so a bad request fails in one line naming its
document.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from lm_eval.models.utils import handle_stop_sequences

from lm_eval_safe.decoder.loop import GenerationJob
from lm_eval_safe.ensemble.sampling import GenerationSettings, parse_gen_kwargs, request_seed
from lm_eval_safe.errors import OptionError, RequestError
from lm_eval_safe.members.member import CHAT_MARKER, Member

logger = logging.getLogger("lm_eval_safe")


def request_label(request: Any, index: int) -> str:
    """How an error names a request: ``<task> doc <id>`` as lm-eval numbers documents."""
    if request.task_name is not None and request.doc_id is not None:
        return f"{request.task_name} doc {request.doc_id}"
    return f"request {index}"


class JobBuilder:
    """Turns requests into :class:`~lm_eval_safe.decoder.loop.GenerationJob` for one drafter."""

    def __init__(self, drafter: Member, default_max_gen_toks: int, sampling_seed: int):
        self.drafter = drafter
        self.default_max_gen_toks = default_max_gen_toks
        self.sampling_seed = sampling_seed
        eos = drafter.eos_id
        self.eos_text = None if eos is None else drafter.tokenizer.decode([eos])

    def build(self, requests: Sequence[Any], labels: Sequence[str]) -> list[GenerationJob]:
        """Every request's job, or a :class:`RequestError` naming the first bad one.

        A sampled request's random stream is seeded by the run's seed, its content and its
        repeat index: lm-eval sends a task with ``repeats: k`` as k identical requests, and the
        k-th of them in this call is repeat k."""
        repeats: dict[str, int] = {}
        jobs = []
        for request, label in zip(requests, labels, strict=True):
            context, gen_kwargs = request.args
            try:
                settings = parse_gen_kwargs(gen_kwargs, self.default_max_gen_toks)
                content = settings.canonical() + "\x00" + context
                repeat = repeats[content] = repeats.get(content, -1) + 1
                jobs.append(self.job(context, settings, self.sampling_seed, repeat))
            except ValueError as exc:
                raise RequestError(f"{label}: {exc}") from exc
        return jobs

    def job(
        self, context: str, settings: GenerationSettings, seed: int, repeat: int = 0
    ) -> GenerationJob:
        """One request's job: its stop strings with the drafter's EOS text (as lm-eval's
        ``hf`` adds it), its budget checked against the drafter's window, and for a sampled
        request its own random stream from ``seed``, its content and ``repeat``."""
        until = handle_stop_sequences(list(settings.until), eos=self.eos_text)
        max_gen_toks = settings.max_gen_toks
        window = self.drafter.max_length
        if max_gen_toks >= window:
            raise OptionError(
                f"max_gen_toks={max_gen_toks} must be less than {self.drafter.name}'s window ({window})"
            )
        if settings.sampling.greedy:
            return GenerationJob(context, until, max_gen_toks)
        stream = request_seed(seed, context, settings, repeat)
        return GenerationJob(context, until, max_gen_toks, settings.sampling, stream)


class EmptyResponses:
    """Counts a model's empty responses and says once when most of them are empty, with the
    likely cause and the fix.

    The classic case: an instruct drafter given a bare prompt ends its turn at once (EOS as the
    first token) and every score is 0 with nothing else in the log."""

    def __init__(self) -> None:
        self.responses = 0
        self.empty = 0
        self.warned = False

    def count(self, text: str) -> None:
        self.responses += 1
        self.empty += int(not text.strip())

    def warn_once(self, members: Sequence[Member], drafter: Member, jobs: Sequence[GenerationJob]) -> None:
        if self.warned or self.empty * 2 <= self.responses:
            return
        self.warned = True
        templated = [m.name for m in members if m.has_chat_template]
        chat = any(job.context.startswith(CHAT_MARKER) for job in jobs)
        others = [m.name for m in members if m is not drafter]
        if templated and not chat:
            # measured: SmolLM2-Instruct votes end-of-text on a bare prompt whichever member
            # drafts, so another drafter is no fix here; its chat template is
            verb = "expects" if len(templated) == 1 else "expect"
            fix = (
                f"the prompts are plain text and {', '.join(templated)} {verb} a chat: add "
                "--apply_chat_template"
            )
        else:
            fix = "try another drafter" + (f" (drafter={others[0]})" if others else "")
            fix += " or a few-shot task (examples in the prompt)"
        logger.warning(
            "safe-ensemble: %d of %d responses are empty: the drafter %s stops at its first "
            "token; likely fix: %s",
            self.empty,
            self.responses,
            drafter.name,
            fix,
        )
