"""The options of ``safe-ensemble`` (:class:`SafeOptions`): parsed from ``--model_args``
(:mod:`lm_eval_safe.model_args` reads the text) and validated.

Everything a user can type reaches the model as one validated :class:`SafeOptions`, so a typo
fails in one line before any model is loaded, and the rest of the code never re-parses strings.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from lm_eval_safe.engines import engine, engines
from lm_eval_safe.engines.registry import DEFAULT_ENGINE, engine_names
from lm_eval_safe.errors import OptionError
from lm_eval_safe.model_args import (
    as_bool,
    as_number,
    check_distinct_names,
    choice,
    resolve_drafter_index,
    split_list,
)

SCHEDULES = ("safe", "every", "aligned", "threshold", "drafter")
AGGREGATORS = ("gac", "unite")
SHARPENINGS = ("heuristic", "geometric", "none")
LL_AGGREGATES = ("mean", "logmean")
DTYPES = ("auto", "float32", "bfloat16", "float16", "float64")
OVERLAP = ("auto", "on", "off")
#: whose rules decide where they differ: this package's reading of the paper, or the authors'
#: code (docs/algorithm.md, The authors' code)
REFERENCES = ("paper", "authors")


def parse_batch_size(value: Any) -> int | str:
    """``N`` (a positive integer), ``auto`` or lm-eval's ``auto:N``.

    ``auto:N`` asks lm-eval's ``hf`` model to re-measure the batch size N times; here ``auto``
    already sizes every batch from a token budget, so N is checked and then has nothing to do.
    Anything else (``abc``, ``0``, ``-2``, ``2.5``) is refused rather than rounded or clamped."""
    text = str(value).strip().lower()
    hint = "give a positive integer, auto or auto:N"
    head, colon, count = text.partition(":")
    if head == "auto":
        if colon and not (re.fullmatch(r"[0-9]+", count) and int(count) >= 1):
            raise OptionError(
                f"batch_size={value!r}: the N of auto:N must be a positive integer; {hint}"
            )
        return "auto"
    if isinstance(value, bool) or not re.fullmatch(r"[+-]?[0-9]+", text):
        raise OptionError(f"batch_size={value!r} is not a batch size; {hint}")
    if int(text) < 1:
        raise OptionError(f"batch_size={value!r} must be at least 1; {hint}")
    return int(text)


def parse_seed(value: Any) -> int:
    """A whole number (``seed=1234``); ``1.5``, ``abc`` or ``true`` are refused, not rounded."""
    text = str(value).strip()
    if isinstance(value, bool) or not re.fullmatch(r"[+-]?[0-9]+", text):
        raise OptionError(f"seed={value!r} must be a whole number, e.g. seed=1234")
    return int(text)


@dataclass
class SafeOptions:
    """All knobs of the backend, with the paper's best setting as defaults (UniTE+SAFE)."""

    members: list[str]
    drafter: str | None = None
    schedule: str = "safe"
    aggregator: str = "unite"
    sharpen: str = "heuristic"
    sharpen_lambda: float = 0.1
    top_k: int = 10
    reference: str = "paper"  # or "authors": the SAFE authors' code, where it differs
    weights: list[float] | None = None
    draft_len: int | str = 5  # or "auto": adapts to how often drafted tokens are replaced
    threshold: float = 0.5
    ll_aggregate: str = "mean"
    dtype: str = "auto"
    device: str | None = None
    member_devices: list[str] | None = None
    trust_remote_code: bool = False
    batch_size: int | str = 1
    max_batch_size: int = 64
    max_length: int | None = None
    max_gen_toks: int = 256
    cache_dir: str | None = None
    verifier_cache: bool = True
    add_bos_token: bool | None = None
    overlap: str = "auto"  # verifier forwards beside the next draft (overlap.py)
    seed: int | None = None  # sampling: None = lm-eval's torch seed (torch.initial_seed())
    trace: bool = False  # a JSON line per response: where the ensemble acted (tracing.py)
    trace_dir: str | None = None  # where traces go (default: lm-eval's samples folder)
    engine: str = DEFAULT_ENGINE  # what computes every member (lm_eval_safe.engines.registry)
    engines: list[str] | None = None  # or one engine per member
    top_logprobs: int = 20  # log-probs per position an engine that returns heads gives
    # model_args no option claims, for the members' engine that takes them (its spec's
    # ``passthrough``): checked by that engine when the model is built
    engine_args: dict[str, Any] = field(default_factory=dict)
    # the keys every registered engine claims (its spec's ``options``), read as attributes
    engine_options: dict[str, Any] = field(default_factory=lambda: engine_defaults())
    extra: dict[str, Any] = field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:
        """An engine's claimed option (``options.fast_small_linear``), as if it were a field."""
        claimed = self.__dict__.get("engine_options", {})
        if name in claimed:
            return claimed[name]
        raise AttributeError(name)

    def public_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("extra")
        claimed = data.pop("engine_options")
        return {**data, **claimed}

    def member_engines(self) -> list[str]:
        """The engine of each member, in member order."""
        return list(self.engines) if self.engines else [self.engine] * len(self.members)

    def member_weights(self, members: int) -> list[float]:
        """One weight per member: as given, or equal."""
        return list(self.weights) if self.weights else [1.0] * members

    def output_identity(self) -> dict[str, Any]:
        """The options that can change a response or a score (:data:`OUTPUT_OPTIONS`), for
        keying cached results: two runs agreeing here may share a ``--use_cache`` entry."""
        return {key: getattr(self, key) for key in OUTPUT_OPTIONS}


#: Every option that can change what a request returns. Results cached under one combination
#: (lm-eval's ``--use_cache``) are never returned for another: see
#: ``SafeEnsembleLM.cache_namespace``, which adds the members' identities and resolves
#: ``drafter``/``dtype`` to what was actually loaded. An option that only changes speed or
#: placement (batch_size, device, member_devices, verifier_cache, cache_dir, max_batch_size,
#: trace, trace_dir, overlap)
#: must not be listed: it would split the cache for nothing. A new output-changing option is
#: one more name here.
OUTPUT_OPTIONS: tuple[str, ...] = (
    "members",
    "drafter",
    "schedule",
    "aggregator",
    "sharpen",
    "sharpen_lambda",
    "top_k",
    "reference",
    "weights",
    "draft_len",
    "threshold",
    "ll_aggregate",
    "dtype",
    "max_length",
    "max_gen_toks",
    "add_bos_token",
    "trust_remote_code",
)


def engine_defaults() -> dict[str, Any]:
    """Every registered engine's claimed keys with their defaults."""
    return {key: value for spec in engines() for key, value in spec.options.items()}


def known_keys() -> set[str]:
    """The option names ``--model_args`` may carry: the ensemble's and every registered
    engine's (:func:`~lm_eval_safe.model_args.parse_model_args` folds any other bare item back
    into ``members``)."""
    ensemble = {f.name for f in fields(SafeOptions)} - {"extra", "engine_args", "engine_options"}
    return ensemble | set(engine_defaults())


# Keys lm-eval itself passes or that users commonly pass to every backend; accepted, not used.
_IGNORED = {"max_batch_size_auto", "pretrained", "parallelize"}


def parse_options(raw: dict[str, Any]) -> SafeOptions:
    """Validate a merged model_args dict; unknown keys are an error, never silently ignored."""
    raw = {k: v for k, v in raw.items()}
    known = known_keys()
    unknown = sorted(k for k in raw if k not in known and k not in _IGNORED)
    if "pretrained" in raw and "members" not in raw:
        raw["members"] = raw["pretrained"]
    members = split_list(raw.get("members"), "members")
    if not members:
        raise OptionError(
            "safe-ensemble needs members=, e.g. --model_args members=smollm2-135m,gemma3-270m"
        )
    opts = SafeOptions(members=members)
    _parse_engines(opts, raw)
    takers = [spec for spec in map(engine, dict.fromkeys(opts.member_engines())) if spec.passthrough]
    if unknown and takers:  # the engine's own arguments, checked by it before any member loads
        for spec in takers:
            opts.engine_args.update(spec.take_arguments(raw, unknown))
    elif unknown:
        raise OptionError(
            f"unknown model_args key(s) {', '.join(map(repr, unknown))} for safe-ensemble; "
            f"known keys: {', '.join(sorted(known))}"
        )
    if raw.get("drafter") not in (None, ""):
        opts.drafter = str(raw["drafter"]).strip()
    for key, choices in (
        ("schedule", SCHEDULES),
        ("aggregator", AGGREGATORS),
        ("sharpen", SHARPENINGS),
        ("ll_aggregate", LL_AGGREGATES),
        ("dtype", DTYPES),
        ("overlap", OVERLAP),
        ("reference", REFERENCES),
    ):
        if raw.get(key) is not None:
            setattr(opts, key, choice(raw[key], key, choices))
    for key in ("sharpen_lambda", "threshold"):
        if raw.get(key) is not None:
            setattr(opts, key, as_number(raw[key], key, float))
    if str(raw.get("draft_len", "")).strip().lower() == "auto":
        raw["draft_len"] = None
        opts.draft_len = "auto"
    for key in ("top_k", "draft_len", "max_batch_size", "max_gen_toks", "max_length", "top_logprobs"):
        if raw.get(key) is not None:
            setattr(opts, key, as_number(raw[key], key, int))
    for key in ("trust_remote_code", "verifier_cache", "trace"):
        if raw.get(key) is not None:
            setattr(opts, key, as_bool(raw[key], key))
    if raw.get("add_bos_token") is not None:
        opts.add_bos_token = as_bool(raw["add_bos_token"], "add_bos_token")
    if raw.get("device") not in (None, ""):
        opts.device = str(raw["device"])
    if raw.get("member_devices") not in (None, ""):
        opts.member_devices = split_list(raw["member_devices"], "member_devices")
    if raw.get("cache_dir") not in (None, ""):
        opts.cache_dir = str(raw["cache_dir"])
    if raw.get("trace_dir") not in (None, ""):
        opts.trace_dir = str(raw["trace_dir"])
    if raw.get("batch_size") not in (None, ""):
        opts.batch_size = parse_batch_size(raw["batch_size"])
    if raw.get("seed") not in (None, ""):
        opts.seed = parse_seed(raw["seed"])
    if raw.get("weights") not in (None, ""):
        opts.weights = [
            as_number(w, "weights", float) for w in split_list(raw["weights"], "weights")
        ]
    used = set(opts.member_engines())
    for spec in engines():
        for key in spec.options:
            if raw.get(key) is not None:
                if spec.name not in used:  # it would be silently ignored
                    raise OptionError(
                        f"{key}= is an option of engine={spec.name}, and no member runs on it: "
                        f"add engine={spec.name} (or engines=, one per member), or drop {key}="
                    )
                opts.engine_options[key] = spec.parse_option(key, raw[key])
    _validate(opts)
    return opts


def _parse_engines(opts: SafeOptions, raw: dict[str, Any]) -> None:
    """``engine=`` for every member, or ``engines=`` one per member (not both), each a name of
    :mod:`lm_eval_safe.engines.registry`."""
    names = engine_names()
    if raw.get("engine") not in (None, ""):
        opts.engine = choice(raw["engine"], "engine", names)
    if raw.get("engines") not in (None, ""):
        if raw.get("engine") not in (None, ""):
            raise OptionError("give engine= (every member) or engines= (one per member), not both")
        opts.engines = [choice(e, "engines entry", names) for e in split_list(raw["engines"], "engines")]
        if len(opts.engines) != len(opts.members):
            raise OptionError(
                f"engines has {len(opts.engines)} entries for {len(opts.members)} members; give "
                "one per member, e.g. engines=vllm,hf"
            )


def _validate(opts: SafeOptions) -> None:
    n = len(opts.members)
    for name in dict.fromkeys(opts.member_engines()):
        engine(name).check_options(opts)
    if opts.draft_len != "auto" and int(opts.draft_len) < 1:
        raise OptionError(f"draft_len={opts.draft_len} must be at least 1 (or auto)")
    if opts.top_k < 1:
        raise OptionError(f"top_k={opts.top_k} must be at least 1")
    if not 0.0 < opts.threshold <= 1.0:
        raise OptionError(f"threshold={opts.threshold} must be in (0, 1]")
    if not 0.0 <= opts.sharpen_lambda < 1.0:
        raise OptionError(f"sharpen_lambda={opts.sharpen_lambda} must be in [0, 1)")
    if opts.max_gen_toks < 1:
        raise OptionError(f"max_gen_toks={opts.max_gen_toks} must be at least 1")
    if opts.max_batch_size < 1:
        raise OptionError(f"max_batch_size={opts.max_batch_size} must be at least 1")
    if opts.weights is not None:
        if len(opts.weights) != n:
            raise OptionError(
                f"weights has {len(opts.weights)} values for {n} members; give one weight per member"
            )
        if any(w < 0 for w in opts.weights) or sum(opts.weights) <= 0:
            raise OptionError(f"weights={opts.weights} must be non-negative and not all zero")
    if opts.member_devices is not None and len(opts.member_devices) != n:
        raise OptionError(
            f"member_devices has {len(opts.member_devices)} entries for {n} members; give one per member"
        )
    check_distinct_names(opts.members)
    if opts.drafter is not None:
        resolve_drafter_index(opts.drafter, opts.members)
    if opts.trace_dir is not None and not opts.trace:
        raise OptionError("trace_dir= is where traces go: add trace=true to write them")
    if opts.reference == "authors":
        _check_authors_reference(opts)


def _check_authors_reference(opts: SafeOptions) -> None:
    """``reference=authors`` reproduces code that ensembles one drafter with one verifier,
    equally weighted, under SAFE's schedule: anything else has no meaning there."""
    if len(opts.members) != 2:
        raise OptionError(
            f"reference=authors reproduces the authors' code, which ensembles two members (a drafter "
            f"and one verifier); got {len(opts.members)}: give two members or use reference=paper"
        )
    if opts.weights is not None and opts.weights[0] != opts.weights[1]:
        raise OptionError(
            "reference=authors weighs both members equally, as the authors' code does; drop "
            "weights= or use reference=paper"
        )
    if opts.schedule != "safe":
        raise OptionError(
            f"reference=authors reproduces the authors' SAFE code: it needs schedule=safe (got "
            f"schedule={opts.schedule}); use reference=paper for the baselines"
        )
