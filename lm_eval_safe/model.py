"""``safe-ensemble``: the lm-eval model class. It parses options, loads members and delegates
``generate_until`` to :class:`SafeDecoder` and ``loglikelihood`` to :mod:`scoring`."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import deque
from typing import Any

from lm_eval.api.model import LM
from lm_eval.models.utils import handle_stop_sequences
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from lm_eval_safe import __version__
from lm_eval_safe.batching import generation_batch_size
from lm_eval_safe.decoding import GenerationJob, SafeDecoder
from lm_eval_safe.distributed import AcceleratorView, ProcessGroup
from lm_eval_safe.lm_eval_compat import bos_rule
from lm_eval_safe.members import CHAT_MARKER, Member, check_gguf_file, load_member, resolve_source
from lm_eval_safe.options import (
    OptionError,
    RequestError,
    SafeOptions,
    parse_model_args,
    parse_options,
    resolve_drafter_index,
)
from lm_eval_safe.placement import LM_EVAL_CLI_DEFAULT_DEVICE, plan_placement, visible_hardware
from lm_eval_safe.sampling import parse_gen_kwargs, request_seed
from lm_eval_safe.scoring import (
    MemberScore,
    combine,
    encode_pair,
    safe_consensus,
    score_members,
)
from lm_eval_safe.stats import GenerationStats
from lm_eval_safe.versions import check_versions

logger = logging.getLogger("lm_eval_safe")

#: Per-request statistics kept in memory (the most recent ones; each is also logged at debug
#: level). A bound, so that a run of any length keeps its memory flat.
REQUEST_STATS_KEPT = 256
#: Bump when cached responses of an unchanged configuration would no longer be reproduced (a
#: decoding fix): the ``--use_cache`` table name changes and old entries are not returned.
CACHE_NAMESPACE_FORMAT = 1


def request_label(request: Any, index: int) -> str:
    """How an error names a request: ``<task> doc <id>`` as lm-eval numbers documents."""
    task, doc = getattr(request, "task_name", None), getattr(request, "doc_id", None)
    if task is not None and doc is not None:
        return f"{task} doc {doc}"
    return f"request {index}"


def use_cache_table(store: Any, table: str) -> None:
    """Point lm-eval's ``--use_cache`` store at ``table`` of the same sqlite file.

    lm-eval keys cached responses by the request alone, and ``CachingLM`` and its cache hook
    share one ``SqliteDict``: switching that object's table before the first lookup gives each
    configuration its own namespace in the user's file. Anything but a ``SqliteDict`` cannot be
    namespaced, and sharing it could return another configuration's answers: refused."""
    from sqlitedict import SqliteDict

    if not isinstance(store, SqliteDict):
        raise OptionError(
            f"--use_cache: lm-eval's cache store is a {type(store).__name__}, which safe-ensemble "
            "cannot give a table per configuration; run without --use_cache"
        )
    if store.tablename == table:
        return
    store.conn.execute(f'CREATE TABLE IF NOT EXISTS "{table}" (key TEXT PRIMARY KEY, value BLOB)')
    store.conn.commit(blocking=True)
    store.tablename = table


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
        for spec in opts.members:  # every file checked before any member loads (that takes minutes)
            source = resolve_source(spec, opts.cache_dir)
            if source.kind == "gguf":
                check_gguf_file(source)
        self.members: list[Member] = [
            load_member(
                spec,
                index=i,
                device=self.placements[i].device,
                device_map=self.placements[i].device_map,
                dtype=opts.dtype,
                trust_remote_code=opts.trust_remote_code,
                cache_dir=opts.cache_dir,
                max_length=opts.max_length,
                add_bos_token=opts.add_bos_token,
                fast_small_linear=opts.fast_small_linear,
                prefix_cache_mb=opts.prefix_cache_mb,
            )
            for i, spec in enumerate(opts.members)
        ]
        self.decoder = SafeDecoder(self.members, self.drafter_index, opts)
        # lm-eval seeds torch (--seed / torch_random_seed) before it builds the model, so the
        # seed of sampled requests is read here; a seed= model arg overrides it
        import torch

        self.sampling_seed: int = opts.seed if opts.seed is not None else torch.initial_seed()
        self.run_stats = GenerationStats()
        self.total_stats: GenerationStats | None = None  # all ranks' stats, data parallel only
        self.request_stats: deque[dict[str, Any]] = deque(maxlen=REQUEST_STATS_KEPT)
        self._prefill_counted = [(0, 0) for _ in self.members]
        self._responses = 0  # responses this LM generated, and how many of them were empty
        self._empty_responses = 0
        self._warned_empty = False
        if len(self.members) == 1:
            logger.info(
                "safe-ensemble with one member (%s): single-model path", self.members[0].name
            )

    def _count_prefill(self) -> None:
        """Move the prefix stores' prompt-token counters (since the last call) into run_stats."""
        for i, member in enumerate(self.members):
            store = member.prefix_store
            if store is None:
                continue
            looked, reused = self._prefill_counted[i]
            self.run_stats.prefill_tokens += store.looked_up_tokens - looked
            self.run_stats.prefill_tokens_saved += store.reused_tokens - reused
            self._prefill_counted[i] = (store.looked_up_tokens, store.reused_tokens)

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
        if self.world_size <= 1:
            return
        total = GenerationStats()
        for part in self.process_group.all_gather_object(self.run_stats):
            total.add(part)
        self.total_stats = total

    # -- lm-eval's --use_cache ---------------------------------------------------------------
    def cache_identity(self) -> dict[str, Any]:
        """What the responses of this LM depend on: the output-changing options
        (:data:`~lm_eval_safe.options.OUTPUT_OPTIONS`) with each member's resolved identity
        (alias and checksum, or file/folder and size+mtime, and the dtype it was loaded in) and
        the drafter as an index into them."""
        identity = self.options.output_identity()
        identity["members"] = [m.identity() for m in self.members]
        identity["drafter"] = self.drafter_index
        identity["dtype"] = [str(m.dtype).replace("torch.", "") for m in self.members]
        identity["format"] = CACHE_NAMESPACE_FORMAT
        if self.options.add_bos_token is None and bos_rule() != "tokenizer":
            identity["bos_rule"] = bos_rule()  # lm-eval 0.4.9 encodes without BOS by default
        return identity

    @property
    def cache_namespace(self) -> str:
        """Name of this configuration's table in a ``--use_cache`` file (a hash of
        :meth:`cache_identity`)."""
        text = json.dumps(self.cache_identity(), sort_keys=True, default=str)
        return "safe-ensemble-" + hashlib.sha256(text.encode()).hexdigest()[:20]

    def set_cache_hook(self, cache_hook: Any) -> None:
        """lm-eval wraps the model for ``--use_cache`` by handing it a hook on its cache store;
        give this configuration its own table there first, so another member set or option
        never gets these answers (and this one never gets theirs)."""
        store = getattr(cache_hook, "dbdict", None)
        if store is not None:
            use_cache_table(store, self.cache_namespace)
            logger.info(
                "--use_cache: %s keeps this configuration's results in table %s",
                getattr(store, "filename", "the cache"),
                store.tablename,
            )
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
        args = parse_model_args(arg_dict)
        for key, value in (additional_config or {}).items():
            if key == "device" and value == LM_EVAL_CLI_DEFAULT_DEVICE:
                continue
            if value is not None and key not in args:
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
        plain = [m.name for m in self.members if not getattr(m.tokenizer, "chat_template", None)]
        if len(plain) == len(self.members):
            raise OptionError("--apply_chat_template: no member has a chat template; drop the flag")
        if plain and not getattr(self, "_warned_plain", False):
            logger.warning("--apply_chat_template: %s have no chat template; they get plain text", plain)
            self._warned_plain = True
        payload = {"messages": chat_history, "add_generation_prompt": add_generation_prompt}
        return CHAT_MARKER + json.dumps(payload, ensure_ascii=False)

    def get_model_info(self) -> dict[str, Any]:
        """Configuration and SAFE statistics, saved by lm-eval in the results' ``config``."""
        opts = self.options.public_dict()
        return {
            "lm_eval_safe_version": __version__,
            "members": [m.describe() for m in self.members],
            "drafter": self.drafter.name,
            "schedule": self.decoder.schedule,
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
        eos_text = (
            self.drafter.tokenizer.decode([self.drafter.eos_id])
            if self.drafter.eos_id is not None
            else None
        )
        labels = [request_label(request, i) for i, request in enumerate(requests)]
        jobs: list[GenerationJob] = []
        repeats: dict[str, int] = {}
        for request, label in zip(requests, labels, strict=True):
            try:
                jobs.append(self._generation_job(request, eos_text, repeats))
            except ValueError as exc:
                raise RequestError(f"{label}: {exc}") from exc
        self.decoder.preflight(jobs, labels)
        batch_size = generation_batch_size(self.options, self.members, jobs)
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
            self._responses += 1
            self._empty_responses += int(not text.strip())
            self.request_stats.append({"request": index, **stats.summary()})
            logger.debug("request %d (%s): %s", index, labels[index], stats.line())
            # a sample is no answer for a later request with the same arguments (repeats share
            # one cache key), and lm-eval never reads do_sample=True requests from its cache
            if jobs[index].sampling is None:
                self.cache_hook.add_partial("generate_until", requests[index].args, text)
            progress.update(1)

        outputs = self.decoder.generate_many(jobs, batch_size, on_done=finished)
        progress.close()
        # per-request wall times overlap in a batch: the run's time is the elapsed time
        call_stats.wall_seconds = time.perf_counter() - started if jobs else 0.0
        self.run_stats.add(call_stats)
        self._count_prefill()
        if requests and self.decoder.schedule != "drafter":
            logger.info(
                "SAFE %s/%s (batch_size %d): %s",
                self.decoder.schedule,
                self.options.aggregator,
                batch_size,
                self.run_stats.line(),
            )
        self._warn_if_mostly_empty(jobs)
        return [text for text, _ in outputs]

    def _generation_job(
        self, request: Any, eos_text: str | None, repeats: dict[str, int]
    ) -> GenerationJob:
        """A request's job from its generation kwargs; ``repeats`` counts identical sampled
        requests seen so far in this call (their repeat index)."""
        context, gen_kwargs = request.args
        settings = parse_gen_kwargs(gen_kwargs, self.max_gen_toks)
        until = handle_stop_sequences(list(settings.until), eos=eos_text)
        max_gen_toks = settings.max_gen_toks
        if max_gen_toks >= self.drafter.max_length:
            raise OptionError(
                f"max_gen_toks={max_gen_toks} must be less than {self.drafter.name}'s window ({self.drafter.max_length})"
            )
        if settings.sampling.greedy:
            return GenerationJob(context, until, max_gen_toks)
        content = settings.canonical() + "\x00" + context
        repeat = repeats[content] = repeats.get(content, -1) + 1
        seed = request_seed(self.sampling_seed, context, settings, repeat)
        return GenerationJob(context, until, max_gen_toks, settings.sampling, seed)

    def _warn_if_mostly_empty(self, jobs: list[GenerationJob]) -> None:
        """Say once when most responses so far are empty, with the likely cause and the fix.

        The classic case: an instruct drafter given a bare prompt ends its turn at once (EOS as
        the first token) and every score is 0 with nothing else in the log."""
        if self._warned_empty or self._empty_responses * 2 <= self._responses:
            return
        self._warned_empty = True
        templated = [m.name for m in self.members if getattr(m.tokenizer, "chat_template", None)]
        chat = any(job.context.startswith(CHAT_MARKER) for job in jobs)
        others = [m.name for m in self.members if m is not self.drafter]
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
            self._empty_responses,
            self._responses,
            self.drafter.name,
            fix,
        )

    def _weights(self) -> list[float]:
        return self.options.weights or [1.0] * len(self.members)

    def loglikelihood(
        self, requests: list[Any], disable_tqdm: bool = False
    ) -> list[tuple[float, bool]]:
        """SAFE_SPEC §9: each member scores every request (contexts shared by several choices run
        once per member), then segment probabilities are aggregated at common boundaries."""
        args = [tuple(request.args) for request in requests]
        for i, (context, continuation) in enumerate(args):
            if continuation == "":
                raise RequestError(
                    f"{request_label(requests[i], i)}: loglikelihood request "
                    f"{(context[-60:], continuation)!r}: empty continuation, nothing to score"
                )
        encoded = [[encode_pair(m, c, x) for c, x in args] for m in self.members]
        per_member = score_members(
            self.members,
            [[(ctx, cont) for ctx, cont, _ in enc] for enc in encoded],
            self.options,
            kind="loglikelihood",
            labels=[(c[-60:], x) for c, x in args],
            disable_tqdm=disable_tqdm or self.rank != 0,
        )
        weights = self._weights()
        rule = safe_consensus(
            weights, self.drafter_index, self.options.schedule, self.options.aggregator
        )
        results = []
        for i, (context, continuation) in enumerate(args):
            texts = [enc[i][2] for enc in encoded]
            same = all(t == texts[0] for t in texts)
            scored = (texts[0] if same else continuation).encode("utf-8")
            scores = []
            for enc, member, tokens in zip(encoded, self.members, per_member, strict=True):
                ends = member.vocab.token_ends(enc[i][1], enc[i][2].encode("utf-8"))
                if ends is not None and not same:  # chat contexts: measure from the continuation
                    shift = len(enc[i][2].encode("utf-8")) - len(scored)
                    ends = [max(0, e - shift) for e in ends]
                scores.append(MemberScore(tokens[i][0], tokens[i][1], ends))
            logprob, greedy = combine(
                scores, weights, self.options.ll_aggregate, scored, self.drafter_index, rule
            )
            results.append((logprob, greedy))
            self.cache_hook.add_partial("loglikelihood", (context, continuation), (logprob, greedy))
        self._count_prefill()
        return results

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Perplexity: each member scores the whole text with its own rolling windows (as HFLM:
        its max length, its BOS/EOS prefix token, context_len=1); the members' per-token
        log-probs are then combined at common boundaries like a loglikelihood continuation."""
        texts = [str(request.args[0]) for request in requests]
        token_ids = [[m.encode(text) for text in texts] for m in self.members]
        # every member's rolling windows, and the text each window belongs to
        all_pairs: list[list[tuple[list[int], list[int]]]] = []
        owners: list[list[int]] = []
        for member in self.members:
            pairs, owner = [], []
            for i, ids in enumerate(token_ids[member.index]):
                for ctx, pred in map(
                    make_disjoint_window,
                    get_rolling_token_windows(
                        token_list=ids,
                        prefix_token=member.prefix_token_id,
                        max_seq_len=member.max_length,
                        context_len=1,
                    ),
                ):
                    pairs.append((ctx, pred))
                    owner.append(i)
            all_pairs.append(pairs)
            owners.append(owner)

        per_member = score_members(
            self.members,
            all_pairs,
            self.options,
            kind="loglikelihood_rolling",
            labels=[t[:60] for t in texts],
            disable_tqdm=disable_tqdm or self.rank != 0,
        )
        weights = self._weights()
        scores: list[list[MemberScore]] = [[] for _ in texts]
        for member, tokens, owner in zip(self.members, per_member, owners, strict=True):
            lps: list[list[float]] = [[] for _ in texts]
            greedy: list[list[bool]] = [[] for _ in texts]
            for i, (lp, g) in zip(owner, tokens, strict=True):
                lps[i].extend(lp)
                greedy[i].extend(g)
            for i, text in enumerate(texts):
                ends = member.vocab.token_ends(token_ids[member.index][i], text.encode("utf-8"))
                scores[i].append(MemberScore(lps[i], greedy[i], ends))
        results = []
        for text, member_scores in zip(texts, scores, strict=True):
            logprob, _ = combine(
                member_scores, weights, self.options.ll_aggregate, text.encode("utf-8")
            )
            results.append(float(logprob))
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), float(logprob))
        self._count_prefill()
        return results
