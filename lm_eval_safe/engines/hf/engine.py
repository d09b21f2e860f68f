"""A transformers member's engine (:class:`HFEngine`): its model, on its device or spread by
``device_map``, stepped by :mod:`.batch`; what it reads back is described in the package's
docstring (:mod:`lm_eval_safe.engines.hf`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import cached_property
from typing import Any

from lm_eval_safe.engines.base import EngineBatch, MemberEngine


class HFEngine(MemberEngine):
    kind = "hf"
    full_rows = False

    def __init__(
        self,
        model: Any,
        device_map: str | None,
        small_rows: Any,
        prefix_store: Any,
        top_logprobs: int = 20,
    ):
        super().__init__()
        self.top_logprobs = top_logprobs  # ids per verifier position read back (a head)
        self.model = model
        self.device_map = device_map
        self.small_rows = small_rows  # SmallRowLinears: faster linears over few rows on this CPU
        self.prefix_store = prefix_store  # PrefixStore: prompt prefixes shared across requests

    #: Greedy drafts kept on the device for a whole window, read back once at its end
    #: (:meth:`~.drafting.DraftingBatch.draft_on_device`): on a GPU a read waits for every queued kernel, so
    #: reading each drafted token would stall the host once a token. On a CPU a read is free,
    #: and reading each token lets a row stop at its EOS without further forwards. None: by the
    #: member's device (tests set True to run the device path on a CPU).
    keep_drafts_on_device: bool | None = None

    @property
    def resident_drafts(self) -> bool:
        if self.keep_drafts_on_device is not None:
            return self.keep_drafts_on_device
        return self.input_device.type != "cpu"

    @cached_property
    def input_device(self) -> Any:
        """The torch device of the input embedding layer: where input ids must go.

        Equal to the member's device on one device; the first GPU of a member spread by
        ``device_map``. Cached: it is read once per forward pass and weights never move."""
        return self.model.get_input_embeddings().weight.device

    def parameter_devices(self) -> list[str]:
        """Every device holding some of the member's weights, sorted (one unless device_map)."""
        return sorted({str(p.device) for p in self.model.parameters()})

    def new_batch(self) -> EngineBatch:
        from lm_eval_safe.engines.hf.batch import MemberBatch

        return MemberBatch(self.member)

    def score_tokens(
        self,
        pairs: Sequence[tuple[list[int], list[int]]],
        batch_size: int | str,
        max_batch_size: int,
        progress: Callable[[int], Any] | None = None,
    ) -> list[tuple[list[float], list[bool]]]:
        from lm_eval_safe.engines.hf.scoring import score_tokens

        return score_tokens(self, pairs, batch_size, max_batch_size, progress)

    @property
    def rolling_window(self) -> int:
        return self.member.max_length  # HFLM: a window of max_length + 1 ids, the last not fed

    @property
    def sequence_limit(self) -> int:
        return self.member.max_length

    @property
    def shares_prefixes(self) -> bool:
        return self.prefix_store is not None

    def prefill_counts(self) -> tuple[int, int]:
        store = self.prefix_store
        return (0, 0) if store is None else (store.looked_up_tokens, store.reused_tokens)

    def forget_prefixes(self) -> None:
        from lm_eval_safe.engines.hf.prefix_cache import PrefixStore

        if self.prefix_store is not None:
            self.prefix_store = PrefixStore(self.prefix_store.budget)

    @contextmanager
    def active(self) -> Iterator[None]:
        with self.small_rows.active():
            yield

    def describe(self) -> dict[str, Any]:
        if not self.device_map:
            return {"engine": self.kind}
        return {"engine": self.kind, "device_map": self.device_map, "devices": self.parameter_devices()}
