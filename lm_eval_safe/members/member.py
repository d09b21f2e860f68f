"""Members of an ensemble: one causal LM with its own tokenizer and context window, whatever
engine computes it (:class:`Member`), and chat contexts each member renders with its own
template.

Where a member's weights come from is :mod:`lm_eval_safe.members.sources` (a spec resolved once) and
:mod:`lm_eval_safe.members.checkpoints` (a GGUF's converted folder); loading one is its engine's
(:mod:`lm_eval_safe.engines`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from lm_eval_safe.errors import check_text
from lm_eval_safe.lm_eval_compat import default_add_special_tokens
from lm_eval_safe.members.sources import MemberSource, content_identity

CHAT_MARKER = "\x00lm-eval-safe-chat\x00"


def chat_context(messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
    """A conversation as one context string whose rendering is deferred: each member renders
    it with its own chat template when it encodes it (:meth:`Member.render_context`)."""
    payload = {"messages": messages, "add_generation_prompt": add_generation_prompt}
    return CHAT_MARKER + json.dumps(payload, ensure_ascii=False)


@dataclass
class Member:
    """One causal LM with its own tokenizer and context window, whatever engine computes it.

    Everything the decoder and the scorer need of a member's *text* (its tokenizer, stop ids,
    chat template, how lm-eval encodes for it) lives here and reads only the checkpoint's
    config files; its forwards are its :attr:`engine`'s (:mod:`lm_eval_safe.engines`)."""

    source: MemberSource
    tokenizer: Any
    config: Any  # transformers PretrainedConfig of the checkpoint
    generation_config: Any  # its GenerationConfig (stop ids), or None
    engine: Any  # MemberEngine
    device: str
    dtype: Any
    max_length: int
    add_bos_token: bool | None = None
    index: int = 0

    def __post_init__(self) -> None:
        self.engine.bind(self)

    @property
    def name(self) -> str:
        return self.source.name

    @cached_property
    def vocab(self) -> Any:
        from lm_eval_safe.members.vocabulary import TokenVocabulary

        # generation_config may name more stop ids than the tokenizer (Gemma's <end_of_turn>)
        return TokenVocabulary.for_tokenizer(self.tokenizer, extra_eos=self.eos_ids)

    @cached_property
    def eos_ids(self) -> frozenset[int]:
        ids = set()
        generation_eos = None if self.generation_config is None else self.generation_config.eos_token_id
        for candidate in (self.tokenizer.eos_token_id, generation_eos):
            if isinstance(candidate, int):
                ids.add(candidate)
            elif isinstance(candidate, (list, tuple)):
                ids.update(int(c) for c in candidate)
        return frozenset(ids)

    @property
    def eos_id(self) -> int | None:
        eos = self.tokenizer.eos_token_id
        return eos if eos is not None else (min(self.eos_ids) if self.eos_ids else None)

    @property
    def prefix_token_id(self) -> int:
        """Token that stands for an empty context, as lm-eval's HFLM chooses it (BOS, else EOS)."""
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    def encode(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        """Encode as HFLM's ``tok_encode`` does under the installed lm-eval, so scores and
        greedy texts match lm-eval's ``hf`` model (:mod:`lm_eval_safe.lm_eval_compat`)."""
        if add_special_tokens is None:
            add_special_tokens = self.add_bos_token
            if add_special_tokens is None:
                add_special_tokens = default_add_special_tokens(self.config.model_type)
            bos = self.tokenizer.bos_token
            if bos and text.startswith(bos):
                add_special_tokens = False
        kwargs = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        check_text(text)  # a lone surrogate: one line saying so, not the tokenizer's TypeError
        return list(self.tokenizer.encode(text, **kwargs))

    @property
    def has_chat_template(self) -> bool:
        return bool(self.tokenizer.chat_template)

    def render_context(self, context: str) -> str:
        """Context text for this member: chat requests are rendered with the member's own template."""
        if not context.startswith(CHAT_MARKER):
            return context
        payload = json.loads(context[len(CHAT_MARKER) :])
        if not self.has_chat_template:
            # A base model without a template (Gemma-3-270M's GGUF) sees the conversation as the
            # plain prompt lm-eval would have built: the messages' texts, one after another.
            return "\n\n".join(m["content"] for m in payload["messages"])
        return self.tokenizer.apply_chat_template(
            payload["messages"],
            tokenize=False,
            add_generation_prompt=payload["add_generation_prompt"],
        )

    def identity(self) -> dict[str, Any]:
        """What this member's outputs depend on, cheap to compute: the weights' content identity
        (:func:`content_identity`), the dtype they were loaded in, and what the engine adds (the
        transformers engine nothing, so its ``--use_cache`` tables stay those of earlier
        versions)."""
        return {
            **content_identity(self.source, self.config),
            "dtype": str(self.dtype),
            **self.engine.identity(),
        }

    def describe(self) -> dict[str, Any]:
        return {
            **self.source.describe(),
            "dtype": str(self.dtype).replace("torch.", ""),
            "device": self.device,
            **self.engine.describe(),
            "max_length": self.max_length,
            "vocab_size": len(self.tokenizer),
            "model_type": self.config.model_type,
        }


def config_max_length(config: Any, tokenizer: Any, override: int | None) -> int:
    """The context window: ``max_length=`` if given, else the config's, else the tokenizer's."""
    if override:
        return int(override)
    fields = config.get_text_config().to_dict()  # read as data: not every config has each field
    for attr in ("n_positions", "max_position_embeddings", "n_ctx"):
        value = fields.get(attr)
        if isinstance(value, int) and value > 0:
            return value
    model_max = tokenizer.model_max_length
    if isinstance(model_max, int) and 0 < model_max < 10**8:
        return model_max
    return 2048


def member_of(loaded: Any, load: Any) -> Member:
    """The :class:`Member` an engine loaded (``loaded``: its
    :class:`~lm_eval_safe.engines.spec.LoadedMember`, for ``load``: the
    :class:`~lm_eval_safe.engines.spec.MemberLoad` it was given). Every engine's members are
    made here: a tokenizer without a pad token pads with EOS, and an engine that leaves the
    context window open gets the config's (:func:`config_max_length`)."""
    tokenizer = loaded.tokenizer
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    max_length = loaded.max_length
    if max_length is None:
        max_length = config_max_length(loaded.config, tokenizer, load.max_length)
    return Member(
        source=load.source,
        tokenizer=tokenizer,
        config=loaded.config,
        generation_config=loaded.generation_config,
        engine=loaded.engine,
        device=loaded.device,
        dtype=loaded.dtype,
        max_length=max_length,
        add_bos_token=load.add_bos_token,
        index=load.index,
    )
