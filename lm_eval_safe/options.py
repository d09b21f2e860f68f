"""Parsing and validation of ``--model_args`` for ``safe-ensemble``.

Everything a user can type reaches the model as one validated :class:`SafeOptions`, so a typo
fails in one line before any model is loaded, and the rest of the code never re-parses strings.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any

SCHEDULES = ("safe", "every", "aligned", "threshold", "drafter")
AGGREGATORS = ("gac", "unite")
SHARPENINGS = ("heuristic", "geometric", "none")
LL_AGGREGATES = ("mean", "logmean")
DTYPES = ("auto", "float32", "bfloat16", "float16", "float64")
FAST_SMALL_LINEAR = ("auto", "on", "off")
OVERLAP = ("auto", "on", "off")
ENGINES = ("hf", "vllm")  # lm_eval_safe.engines


class OptionError(ValueError):
    """A model_args problem the user can fix; the message is one line saying how."""


class RequestError(ValueError):
    """A request that cannot run, found before any work: one line naming its document."""


def split_top_level(text: str) -> list[str]:
    """Split on commas outside brackets, braces and quotes (``weights=[1,2],members=a|b``);
    empty parts are dropped. lm-eval 0.4.13 has the same rule in ``lm_eval._cli.utils``, which
    0.4.9 lacks and 0.4.10-0.4.12 spell differently: hence this copy, the only one used here."""
    parts: list[str] = []
    buf: list[str] = []
    depth = 0
    quote: str | None = None
    for char in text:
        if quote is not None:
            if char == quote:
                quote = None
        elif char in "\"'":
            quote = char
        elif char in "[({":
            depth += 1
        elif char in "])}":
            depth = max(depth - 1, 0)
        elif char == "," and depth == 0:
            parts.append("".join(buf))
            buf = []
            continue
        buf.append(char)
    parts.append("".join(buf))
    return [part for part in parts if part]


def fold_bare_items(items: list[str]) -> list[tuple[str, str]]:
    """Turn ``["members=a", "b", "drafter=b"]`` into ``[("members", "a,b"), ("drafter", "b")]``.

    A bare item (no ``=``) can only be a continuation of the previous value that a comma split.
    """
    pairs: list[tuple[str, str]] = []
    for item in items:
        if "=" in item:
            key, value = item.split("=", 1)
            pairs.append((key.strip(), value))
        elif pairs:
            key, value = pairs[-1]
            pairs[-1] = (key, f"{value},{item}")
        else:
            raise OptionError(f"model_args: expected key=value, got {item!r}")
    return pairs


def parse_model_args(model_args: str | dict[str, Any] | None) -> dict[str, Any]:
    """The one parser of ``--model_args``, for the model, the CLI hook and run names.

    A string is ``key=value`` pairs (``members=a,b,drafter=b``: a bare item continues the value
    before it, so the user's literal ``members=a,b`` works) or a JSON object. A dict is taken as
    it is, except that the bare items of lm-eval's plain parser (``{"members": "a", "b": ""}``)
    are folded back into ``members``."""
    if model_args is None:
        return {}
    if isinstance(model_args, dict):
        args = dict(model_args)
        bare = [k for k, v in args.items() if v == "" and k not in _KNOWN]
        if bare and "members" in args:
            args["members"] = ",".join([str(args["members"]), *bare])
            for key in bare:
                del args[key]
        return args
    text = model_args.strip()
    if not text:
        return {}
    if text.startswith("{"):
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError as exc:
            raise OptionError(f"model_args {text[:60]!r} is not valid JSON: {exc.msg}") from exc
        if not isinstance(parsed, dict):
            raise OptionError("model_args JSON must be an object, e.g. {\"members\": [\"a\", \"b\"]}")
        return parsed
    return dict(fold_bare_items(split_top_level(text)))


def split_list(value: Any, what: str) -> list[str]:
    """Accept ``a,b``, ``a|b``, a JSON/Python list literal, or a real list/tuple."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [str(v).strip() for v in value if str(v).strip()]
    if not isinstance(value, str):
        return [str(value)]
    text = value.strip()
    if text.startswith("["):
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError:
            try:
                parsed = ast.literal_eval(text)
            except (ValueError, SyntaxError) as exc:
                raise OptionError(
                    f"{what}={value!r} is not a valid list; write a,b or a|b"
                ) from exc
        return split_list(list(parsed), what)
    sep = "|" if "|" in text else ","
    return [part.strip() for part in text.split(sep) if part.strip()]


def _as_bool(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise OptionError(f"{key}={value!r} must be true or false")


def _as_number(value: Any, key: str, kind: type) -> Any:
    try:
        return kind(value)
    except (TypeError, ValueError) as exc:
        raise OptionError(f"{key}={value!r} must be a {kind.__name__}") from exc


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


def _choice(value: Any, key: str, choices: tuple[str, ...]) -> str:
    text = str(value).strip().lower()
    if text not in choices:
        raise OptionError(f"unknown {key}={value!r}; choose one of: {', '.join(choices)}")
    return text


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
    fast_small_linear: str = "auto"
    overlap: str = "auto"  # verifier forwards beside the next draft (overlap.py)
    prefix_cache_mb: float = 256.0
    seed: int | None = None  # sampling: None = lm-eval's torch seed (torch.initial_seed())
    trace: bool = False  # a JSON line per response: where the ensemble acted (tracing.py)
    trace_dir: str | None = None  # where traces go (default: lm-eval's samples folder)
    engine: str = "hf"  # what computes every member (lm_eval_safe.engines)
    engines: list[str] | None = None  # or one engine per member
    top_logprobs: int = 20  # log-probs per position an engine that returns heads gives (vLLM)
    # model_args for vLLM members' engines (lm-eval vllm's names, EngineArgs fields): checked
    # against the installed vLLM when the model is built (engines/vllm/args.py)
    engine_args: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def public_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("extra")
        return data

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


_KNOWN = {f.name for f in fields(SafeOptions)} - {"extra", "engine_args"}
# Keys lm-eval itself passes or that users commonly pass to every backend; accepted, not used.
_IGNORED = {"max_batch_size_auto", "pretrained", "parallelize"}


def parse_options(raw: dict[str, Any]) -> SafeOptions:
    """Validate a merged model_args dict; unknown keys are an error, never silently ignored."""
    raw = {k: v for k, v in raw.items()}
    unknown = sorted(k for k in raw if k not in _KNOWN and k not in _IGNORED)
    if "pretrained" in raw and "members" not in raw:
        raw["members"] = raw["pretrained"]
    members = split_list(raw.get("members"), "members")
    if not members:
        raise OptionError(
            "safe-ensemble needs members=, e.g. --model_args members=smollm2-135m,gemma3-270m"
        )
    opts = SafeOptions(members=members)
    _parse_engines(opts, raw)
    if unknown and "vllm" in opts.member_engines():
        # the arguments of lm-eval's vllm backend and vLLM's EngineArgs; checked against the
        # installed vLLM before any member loads
        opts.engine_args = {k: raw[k] for k in unknown}
        if "max_model_len" in raw:
            if raw.get("max_length") not in (None, ""):
                raise OptionError("give max_length= or max_model_len=, not both (they are one setting)")
            raw["max_length"] = opts.engine_args.pop("max_model_len")
        if "max_batch_size" in raw and "max_num_seqs" not in raw:
            opts.engine_args["max_num_seqs"] = raw["max_batch_size"]
    elif unknown:
        raise OptionError(
            f"unknown model_args key(s) {', '.join(map(repr, unknown))} for safe-ensemble; "
            f"known keys: {', '.join(sorted(_KNOWN))}"
        )
    if raw.get("drafter") not in (None, ""):
        opts.drafter = str(raw["drafter"]).strip()
    for key, choices in (
        ("schedule", SCHEDULES),
        ("aggregator", AGGREGATORS),
        ("sharpen", SHARPENINGS),
        ("ll_aggregate", LL_AGGREGATES),
        ("dtype", DTYPES),
        ("fast_small_linear", FAST_SMALL_LINEAR),
        ("overlap", OVERLAP),
    ):
        if raw.get(key) is not None:
            setattr(opts, key, _choice(raw[key], key, choices))
    for key in ("sharpen_lambda", "threshold", "prefix_cache_mb"):
        if raw.get(key) is not None:
            setattr(opts, key, _as_number(raw[key], key, float))
    if str(raw.get("draft_len", "")).strip().lower() == "auto":
        raw["draft_len"] = None
        opts.draft_len = "auto"
    for key in ("top_k", "draft_len", "max_batch_size", "max_gen_toks", "max_length", "top_logprobs"):
        if raw.get(key) is not None:
            setattr(opts, key, _as_number(raw[key], key, int))
    for key in ("trust_remote_code", "verifier_cache", "trace"):
        if raw.get(key) is not None:
            setattr(opts, key, _as_bool(raw[key], key))
    if raw.get("add_bos_token") is not None:
        opts.add_bos_token = _as_bool(raw["add_bos_token"], "add_bos_token")
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
            _as_number(w, "weights", float) for w in split_list(raw["weights"], "weights")
        ]
    _validate(opts)
    return opts


def _parse_engines(opts: SafeOptions, raw: dict[str, Any]) -> None:
    """``engine=hf|vllm`` for every member, or ``engines=`` one per member (not both)."""
    if raw.get("engine") not in (None, ""):
        opts.engine = _choice(raw["engine"], "engine", ENGINES)
    if raw.get("engines") not in (None, ""):
        if raw.get("engine") not in (None, ""):
            raise OptionError("give engine= (every member) or engines= (one per member), not both")
        opts.engines = [_choice(e, "engines entry", ENGINES) for e in split_list(raw["engines"], "engines")]
        if len(opts.engines) != len(opts.members):
            raise OptionError(
                f"engines has {len(opts.engines)} entries for {len(opts.members)} members; give "
                "one per member, e.g. engines=vllm,hf"
            )


def _validate(opts: SafeOptions) -> None:
    n = len(opts.members)
    if "vllm" in opts.member_engines():
        if opts.top_logprobs < opts.top_k:
            raise OptionError(
                f"top_logprobs={opts.top_logprobs} is below top_k={opts.top_k}: vLLM members must "
                "return at least the top_k strings the aggregator reads"
            )
        if opts.overlap == "on":
            raise OptionError(
                "overlap=on runs transformers members on threads of their own; vLLM members "
                "overlap inside their engines: drop overlap=on"
            )
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
    if opts.prefix_cache_mb < 0:
        raise OptionError(f"prefix_cache_mb={opts.prefix_cache_mb} must be >= 0 (0 turns prefix reuse off)")
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
    if opts.drafter is not None:
        resolve_drafter_index(opts.drafter, opts.members)
    if opts.trace_dir is not None and not opts.trace:
        raise OptionError("trace_dir= is where traces go: add trace=true to write them")


def member_display_name(spec: str) -> str:
    """Short, filesystem-safe name of a member spec (alias, folder or file name)."""
    from pathlib import PurePath

    name = PurePath(spec.rstrip("/")).name or spec
    for suffix in (".gguf",):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return name


def resolve_drafter_index(drafter: str | int | None, members: list[str]) -> int:
    if drafter is None:
        return 0
    text = str(drafter).strip()
    if text.isdigit():
        index = int(text)
        if index >= len(members):
            raise OptionError(
                f"drafter={drafter} is out of range; there are {len(members)} members"
            )
        return index
    for index, spec in enumerate(members):
        if text in (spec, member_display_name(spec)):
            return index
    names = ", ".join(member_display_name(m) for m in members)
    raise OptionError(f"drafter={drafter!r} names no member; choose one of: {names} (or an index)")


def stable_run_name(model_args: Any) -> str | None:
    """Folder name for lm-eval's output: members, drafter, schedule and aggregator, not a random id."""
    try:
        args = parse_model_args(model_args) if isinstance(model_args, (str, dict)) else {}
    except OptionError:
        return None
    if "members" not in args:
        return None
    try:
        members = split_list(args["members"], "members")
        drafter = members[resolve_drafter_index(args.get("drafter"), members)]
    except (OptionError, IndexError):
        return None
    names = [member_display_name(m) for m in members]
    if len(names) == 1:
        return f"safe-ensemble__{names[0]}"
    schedule = str(args.get("schedule", "safe")).lower()
    aggregator = str(args.get("aggregator", "unite")).lower()
    return (
        f"safe-ensemble__{'+'.join(names)}__drafter-{member_display_name(drafter)}"
        f"__{schedule}-{aggregator}"
    )
