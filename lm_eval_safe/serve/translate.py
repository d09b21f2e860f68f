"""OpenAI requests as decoder jobs, each checked before it joins the batch.

A request means here what the same request means to ``--model safe-ensemble``: its context is a
completion prompt, or a conversation each member renders with its own chat template (what
``--apply_chat_template`` sends); its stop strings get the drafter's EOS text; greedy when
``temperature`` is 0, else SAFE's sampling with a stream seeded by ``seed``. So a greedy
request's text through the server is byte for byte the backend's.

Every member that will read a prompt encodes it here first, so a prompt that leaves a member no
room, an empty one or a conversation a template refuses is a 400 before any decoding. The
checks run on one thread of their own with their own copies of the tokenizers (a tokenizer is
not safe to use from two threads while the decoding thread uses the originals).
"""

from __future__ import annotations

import copy
import secrets
from dataclasses import dataclass

from lm_eval_safe.decoder.loop import GenerationJob, SafeDecoder, check_sampling
from lm_eval_safe.ensemble.sampling import parse_gen_kwargs
from lm_eval_safe.errors import OptionError, RequestError
from lm_eval_safe.harness.generation_requests import JobBuilder
from lm_eval_safe.members.member import Member, chat_context
from lm_eval_safe.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
)

#: OpenAI's default temperature (a request that does not name one samples at 1.0)
DEFAULT_TEMPERATURE = 1.0
#: the request fields behind the generation kwargs the decoder's parser names in its errors
FIELD_OF_KWARG = {"until": "stop", "max_gen_toks": "max_tokens"}


@dataclass
class Prepared:
    """One prompt, ready for the scheduler."""

    job: GenerationJob
    prompt_tokens: int  # the drafter's tokens of the rendered prompt (``usage.prompt_tokens``)


def own_tokenizer(member: Member) -> Member:
    """A shallow copy of ``member`` with a deep copy of its tokenizer (the engine is shared but
    never used through the copy)."""
    twin = copy.copy(member)
    twin.tokenizer = copy.deepcopy(member.tokenizer)
    return twin


class Translator:
    """Turns request bodies into :class:`Prepared` jobs for one ensemble."""

    def __init__(self, members: list[Member], drafter_index: int, decoder: SafeDecoder, max_gen_toks: int):
        self.members = [own_tokenizer(m) for m in members]
        self.drafter = self.members[drafter_index]
        needs_verifiers = decoder.schedule.needs_verifiers
        self.readers = [self.drafter] + (
            [m for i, m in enumerate(self.members) if i != drafter_index] if needs_verifiers else []
        )
        self.jobs = JobBuilder(self.drafter, max_gen_toks, 0)
        self.options = decoder.options
        self.chat_members = [m.name for m in self.members if m.has_chat_template]

    # -- endpoints ---------------------------------------------------------------------------
    def completion(self, request: CompletionRequest) -> list[Prepared]:
        request.refuse_unsupported()
        budget = _budget(request.max_tokens, "max_tokens")
        return [self._prepare(prompt, request, budget, "prompt") for prompt in request.prompts()]

    def chat(self, request: ChatCompletionRequest) -> Prepared:
        request.refuse_unsupported()
        if not self.chat_members:
            raise APIError(
                "no member of this ensemble has a chat template: use /v1/completions with a "
                "plain prompt",
                param="messages",
            )
        field = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        budget = _budget(request.budget(), field)
        messages = [m.as_dict() for m in request.messages]
        context = chat_context(messages, request.add_generation_prompt)
        return self._prepare(context, request, budget, "messages")

    # -- one prompt --------------------------------------------------------------------------
    def _prepare(
        self, context: str, request: SamplingFields, budget: int | None, prompt_field: str
    ) -> Prepared:
        lengths = {}
        for member in self.readers:
            try:
                lengths[member.name] = len(SafeDecoder.encoded_prompt(member, context))
            except Exception as exc:  # an empty prompt, or a template refusing the conversation
                first = (str(exc).splitlines() or [type(exc).__name__])[0]
                raise APIError(f"{prompt_field}: {first}", param=prompt_field) from None
        drafter, prompt_tokens = self.drafter, lengths[self.drafter.name]
        if budget is None:  # the rest of the drafter's window, as vLLM's server does
            budget = max(1, drafter.max_length - prompt_tokens)
        if prompt_tokens + budget > drafter.max_length:
            raise APIError(
                f"the drafter {drafter.name}'s context window is {drafter.max_length} tokens, and "
                f"{prompt_tokens + budget} were requested ({prompt_tokens} in the {prompt_field}, "
                f"{budget} to generate): shorten the {prompt_field} or lower max_tokens",
                param=prompt_field,
            )
        for member in self.readers[1:]:
            if lengths[member.name] >= member.max_length:
                raise APIError(
                    f"the {prompt_field} is {lengths[member.name]} tokens for member "
                    f"{member.name}, whose context window is {member.max_length}: shorten it",
                    param=prompt_field,
                )
        temperature = DEFAULT_TEMPERATURE if request.temperature is None else request.temperature
        gen_kwargs: dict[str, object] = {
            "until": request.stop_list(),
            "max_gen_toks": budget,
            "do_sample": temperature > 0.0,
            "temperature": temperature,
        }
        if request.top_p is not None:
            gen_kwargs["top_p"] = request.top_p
        if request.top_k is not None:
            gen_kwargs["top_k"] = max(0, request.top_k)  # vLLM's -1 and 0 both mean off
        try:
            settings = parse_gen_kwargs(gen_kwargs, budget)
            seed = secrets.randbits(63) if request.seed is None else request.seed
            job = self.jobs.job(context, settings, seed)
            check_sampling(self.options, job, "temperature")
        except (OptionError, RequestError) as exc:
            raise APIError(str(exc), param=_field_named(str(exc))) from None
        return Prepared(job, prompt_tokens)


def _budget(value: int | None, field: str) -> int | None:
    if value is not None and value < 1:
        raise APIError(f"{field}={value} must be at least 1", param=field)
    return value


def _field_named(message: str) -> str | None:
    for kwarg in ("until", "max_gen_toks", "temperature", "top_p", "top_k"):
        if kwarg in message:
            return FIELD_OF_KWARG.get(kwarg, kwarg)
    return None
