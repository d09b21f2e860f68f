"""``safe-ensemble``: the lm-eval model class. It parses options, loads members and delegates
``generate_until`` to :class:`SafeDecoder` and ``loglikelihood`` to :mod:`scoring`."""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from lm_eval.api.model import LM
from tqdm import tqdm

from lm_eval_safe import MODEL_NAME, __version__
from lm_eval_safe.decoder.loop import SafeDecoder
from lm_eval_safe.decoder.stats import GenerationStats
from lm_eval_safe.decoder.tracing import TraceWriter, new_stamp, repeat_indices
from lm_eval_safe.engines import generation_rows, load_members
from lm_eval_safe.errors import OptionError
from lm_eval_safe.harness.distributed import AcceleratorView, ProcessGroup
from lm_eval_safe.harness.generation_requests import EmptyResponses, JobBuilder, request_label
from lm_eval_safe.harness.use_cache import (
    cache_identity,
    cache_namespace,
    earlier_namespace,
    use_cache_table,
)
from lm_eval_safe.lm_eval_compat import first_generation
from lm_eval_safe.members.member import Member, chat_context
from lm_eval_safe.members.placement import (
    LM_EVAL_CLI_DEFAULT_DEVICE,
    plan_placement,
    visible_hardware,
)
from lm_eval_safe.model_args import parse_model_args, resolve_drafter_index
from lm_eval_safe.options import SafeOptions, known_keys, parse_options
from lm_eval_safe.scoring.loglikelihood import score_loglikelihood, score_rolling
from lm_eval_safe.versions import check_versions

logger = logging.getLogger("lm_eval_safe")

#: Per-request statistics kept in memory (the most recent ones; each is also logged at debug
#: level). A bound, so that a run of any length keeps its memory flat.
REQUEST_STATS_KEPT = 256


class SafeEnsembleLM(LM):
    """An ensemble of causal LMs with different tokenizers, decoded with SAFE."""

    def __init__(self, **kwargs: Any):
        check_versions()
        super().__init__()
        self.options: SafeOptions = parse_options(kwargs)
        opts = self.options
        self.drafter_index = resolve_drafter_index(opts.drafter, opts.members)
        self.process_group = ProcessGroup.from_environment()
        self._rank, self._world_size = self.process_group.rank, self.process_group.world_size
        cuda_count, mps_available = visible_hardware()
        self.placements = plan_placement(
            opts.members,
            opts.device,
            opts.member_devices,
            cuda_count=cuda_count,
            mps_available=mps_available,
            world_size=self._world_size,
            process_device=self.process_group.device,
        )
        self.members: list[Member] = load_members(opts, self.placements, self._rank, self._world_size)
        self.decoder = SafeDecoder(self.members, self.drafter_index, opts)
        self.traces: TraceWriter | None = None
        if opts.trace:  # every rank names its files after rank 0's start
            stamp = self.process_group.all_gather_object(new_stamp())[0]
            self.traces = TraceWriter(opts.trace_dir, stamp, self._rank, self._world_size)
        # lm-eval seeds torch (--seed / torch_random_seed) before it builds the model, so the
        # seed of sampled requests is read here; a seed= model arg overrides it
        import torch

        self.sampling_seed: int = opts.seed if opts.seed is not None else torch.initial_seed()
        self.jobs = JobBuilder(self.drafter, opts.max_gen_toks, self.sampling_seed)
        self.empty_responses = EmptyResponses()
        self._warned_plain = False
        self.run_stats = GenerationStats()
        self.total_stats: GenerationStats | None = None  # all ranks' stats, data parallel only
        self.request_stats: deque[dict[str, Any]] = deque(maxlen=REQUEST_STATS_KEPT)
        self._prefill_counted = [(0, 0) for _ in self.members]
        if len(self.members) == 1:
            logger.info(
                "safe-ensemble with one member (%s): single-model path", self.members[0].name
            )

    def _count_prefill(self) -> None:
        """Move the engines' prompt-token counters (since the last call) into run_stats."""
        count_prefill(self.run_stats, self.members, self._prefill_counted)

    # -- data parallel (lm-eval shards documents by rank) ------------------------------------
    @property
    def device(self) -> Any:
        import torch

        return torch.device(self.drafter.device)

    @property
    def accelerator(self) -> AcceleratorView:
        """lm-eval 0.4.9's evaluator collects through ``lm.accelerator``."""
        return AcceleratorView(self)

    def all_gather(self, tensor: Any) -> Any:
        # lm-eval puts the tensor on self.device: the right place for gloo (CPU) and nccl (GPU)
        return self.process_group.all_gather(tensor)

    def gather_object(self, obj: Any, dst: int = 0) -> Any:
        return self.process_group.gather_object(obj, dst)

    def barrier(self) -> None:
        """Wait for every rank, and sum the ranks' SAFE statistics while at it.

        lm-eval calls ``barrier`` on every rank after each request type, so a collective here
        pairs up across ranks (an all-gather waits for all ranks, as a barrier does). The sum
        is not taken in ``generate_until``: with ``--use_cache`` lm-eval's ``CachingLM`` skips
        ``generate_until`` on a rank whose requests are all cached, and a collective there
        would wait forever for that rank."""
        if self.world_size > 1:
            self.total_stats = summed(self.process_group.all_gather_object(self.run_stats))

    # -- lm-eval's --use_cache (lm_eval_safe.harness.use_cache) --------------------------------------
    @property
    def cache_namespace(self) -> str:
        return cache_namespace(cache_identity(self.options, self.members, self.drafter_index))

    def set_cache_hook(self, cache_hook: Any) -> None:
        """lm-eval wraps the model for ``--use_cache`` by handing it a hook on its cache store;
        give this configuration its own table there first (:func:`use_cache_table`)."""
        if cache_hook.dbdict is not None:
            earlier = earlier_namespace(self.options, self.members, self.drafter_index)
            use_cache_table(cache_hook.dbdict, self.cache_namespace, earlier)
        super().set_cache_hook(cache_hook)

    # -- construction from lm-eval ---------------------------------------------------------
    @classmethod
    def create_from_arg_string(
        cls, arg_string: str, additional_config: dict | None = None
    ) -> SafeEnsembleLM:
        return cls.create_from_arg_obj(parse_model_args(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(
        cls, arg_dict: dict[str, Any], additional_config: dict | None = None
    ) -> SafeEnsembleLM:
        """Merge the CLI's ``device``/``batch_size`` with model_args; model_args win.

        lm-eval's CLI passes ``device="cuda:0"`` even when ``--device`` was not typed, so that
        value from the CLI means ``auto`` (cuda if visible, else cpu); any other CLI device, and
        every device in model_args, is checked and fails in one line when the machine lacks it."""
        args = parse_model_args(arg_dict, known_keys())
        for key, value in (additional_config or {}).items():
            if value is not None and key not in args and (key, value) != ("device", LM_EVAL_CLI_DEFAULT_DEVICE):
                args[key] = value
        return cls(**args)

    # -- lm-eval properties ----------------------------------------------------------------
    @property
    def drafter(self) -> Member:
        return self.members[self.drafter_index]

    @property
    def tokenizer_name(self) -> str:
        return "+".join(m.name for m in self.members)

    @property
    def max_length(self) -> int:
        return self.drafter.max_length

    @property
    def max_gen_toks(self) -> int:
        return self.options.max_gen_toks

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        if not chat_template:
            return None
        return json.dumps({m.name: m.tokenizer.chat_template for m in self.members})

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """Defer rendering: each member renders the conversation with its own template later.

        A member without a chat template (a base model) gets the messages as plain text, which
        is what it would see without the flag; said once in the log, so it is never silent."""
        plain = [m.name for m in self.members if not m.has_chat_template]
        if len(plain) == len(self.members):
            raise OptionError("--apply_chat_template: no member has a chat template; drop the flag")
        if plain and not self._warned_plain:
            logger.warning("--apply_chat_template: %s have no chat template; they get plain text", plain)
            self._warned_plain = True
        return chat_context(chat_history, add_generation_prompt)

    def get_model_info(self) -> dict[str, Any]:
        """Configuration and SAFE statistics, saved by lm-eval in the results' ``config``."""
        opts = self.options.public_dict()
        return {
            "lm_eval_safe_version": __version__,
            "members": [m.describe() for m in self.members],
            "drafter": self.drafter.name,
            "schedule": self.decoder.schedule.name,
            "aggregator": opts["aggregator"],
            "safe_options": opts,
            "safe_stats": (self.total_stats or self.run_stats).summary(),
            "world_size": self.world_size,
        }

    # -- requests --------------------------------------------------------------------------
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """SAFE generation, greedy or sampled per request, ``batch_size`` requests decoded
        together (same text as one at a time). Every request is checked before the first forward
        (a bad one fails in one line naming its document); each finished greedy request goes to
        lm-eval's cache at once, so an interrupted run keeps what it finished.

        A sampled request's random stream is seeded by the run's seed, its content and its
        repeat index: lm-eval sends a task with ``repeats: k`` as k identical requests, and the
        k-th of them in this call is repeat k."""
        labels = [request_label(request, i) for i, request in enumerate(requests)]
        jobs = self.jobs.build(requests, labels)
        self.decoder.preflight(jobs, labels)
        batch_size = generation_rows(self.options, self.members, jobs)
        progress = tqdm(
            total=len(jobs),
            disable=disable_tqdm or self.rank != 0,
            desc="Running generate_until requests",
        )
        started = time.perf_counter()
        call_stats = GenerationStats()

        def finished(index: int, result: tuple[str, GenerationStats]) -> None:
            text, stats = result
            stats.requests = 1
            call_stats.add(stats)
            self.empty_responses.count(text)
            self.request_stats.append({"request": index, **stats.summary()})
            logger.debug("request %d (%s): %s", index, labels[index], stats.line())
            # a sample is no answer for a later request with the same arguments (repeats share
            # one cache key), and lm-eval never reads do_sample=True requests from its cache
            if jobs[index].sampling is None:
                self.cache_hook.add_partial("generate_until", requests[index].args, text)
            progress.update(1)

        on_trace = None if self.traces is None else trace_requests(self.traces, requests)
        engine_before = engine_clocks(self.members)
        outputs = self.decoder.generate_many(jobs, batch_size, on_done=finished, on_trace=on_trace)
        progress.close()
        # per-request wall times overlap in a batch: the run's time is the elapsed time
        call_stats.wall_seconds = time.perf_counter() - started if jobs else 0.0
        add_engine_time(call_stats, self.members, engine_before)
        self.run_stats.add(call_stats)
        self._count_prefill()
        if requests and self.decoder.schedule.needs_verifiers:
            logger.info(
                "SAFE %s/%s (batch_size %d): %s",
                self.decoder.schedule.name,
                self.options.aggregator,
                batch_size,
                self.run_stats.line(),
            )
        self.empty_responses.warn_once(self.members, self.drafter, jobs)
        return [text for text, _ in outputs]

    def loglikelihood(
        self, requests: list[Any], disable_tqdm: bool = False
    ) -> list[tuple[float, bool]]:
        """docs/algorithm.md, Scoring (:func:`~lm_eval_safe.scoring.loglikelihood.score_loglikelihood`)."""
        args = [(str(r.args[0]), str(r.args[1])) for r in requests]
        results = score_loglikelihood(
            self.members,
            self.options,
            self.drafter_index,
            args,
            [request_label(r, i) for i, r in enumerate(requests)],
            disable_tqdm=disable_tqdm or self.rank != 0,
        )
        for pair, result in zip(args, results, strict=True):
            self.cache_hook.add_partial("loglikelihood", pair, result)
        self._count_prefill()
        return results

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Perplexity over each member's own rolling windows, combined at common boundaries
        (:func:`~lm_eval_safe.scoring.loglikelihood.score_rolling`)."""
        texts = [str(request.args[0]) for request in requests]
        results = score_rolling(
            self.members, self.options, texts, disable_tqdm=disable_tqdm or self.rank != 0
        )
        for text, logprob in zip(texts, results, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), logprob)
        self._count_prefill()
        return results


def engine_clocks(members: Sequence[Member]) -> list[tuple[int, float]]:
    """Each member's engine's (calls, seconds) so far."""
    return [(m.engine.counters.calls, m.engine.counters.seconds) for m in members]


def add_engine_time(stats: GenerationStats, members: Sequence[Member], before: list[tuple[int, float]]) -> None:
    """The engines' calls and seconds since ``before`` (:func:`engine_clocks`) into ``stats``."""
    for member, (calls, seconds) in zip(members, before, strict=True):
        stats.engine_calls += member.engine.counters.calls - calls
        stats.engine_seconds += member.engine.counters.seconds - seconds
        stats.engine_seconds_by_member[member.name] = member.engine.counters.seconds - seconds


def trace_requests(writer: TraceWriter, requests: list[Any]) -> Callable[[int, dict[str, Any]], None]:
    """The decoder's ``on_trace``: each request's record under its task, document and repeat."""
    repeats = repeat_indices(requests)

    def on_trace(index: int, record: dict[str, Any]) -> None:
        request = requests[index]
        key = {"task": request.task_name, "doc_id": request.doc_id, "repeat": repeats[index]}
        writer.write(request.task_name, {**key, **record})

    return on_trace


def count_prefill(stats: GenerationStats, members: Sequence[Member], counted: list[tuple[int, int]]) -> None:
    """Add each engine's prompt tokens looked up and reused since ``counted`` (updated) to
    ``stats``."""
    for i, member in enumerate(members):
        looked_now, reused_now = member.engine.prefill_counts()
        looked, reused = counted[i]
        stats.prefill_tokens += looked_now - looked
        stats.prefill_tokens_saved += reused_now - reused
        counted[i] = (looked_now, reused_now)


def summed(parts: Sequence[GenerationStats]) -> GenerationStats:
    """Every rank's statistics added up."""
    total = GenerationStats()
    for part in parts:
        total.add(part)
    return total


if first_generation():
    # lm-eval 0.4.9's registry holds classes: where this module was imported before lm-eval, the
    # start-up hook found it half-imported and left the registration to it
    from lm_eval.api import registry as _registry

    _registry.MODEL_REGISTRY.setdefault(MODEL_NAME, SafeEnsembleLM)
