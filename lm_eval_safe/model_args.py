"""``--model_args`` as users type it: ``key=value`` pairs or JSON, lists of members written
``a,b``, ``a|b`` or as a list, members named by alias, folder or file, and the run's folder name.

Kept apart from :mod:`lm_eval_safe.options` (what the values mean, and their checks) because the
start-up hook and the leaderboard read the text without building options.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Collection
from typing import Any

from lm_eval_safe.errors import OptionError


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


def parse_model_args(
    model_args: str | dict[str, Any] | None, known: Collection[str] = ()
) -> dict[str, Any]:
    """The one parser of ``--model_args``, for the model, the CLI hook and run names.

    A string is ``key=value`` pairs (``members=a,b,drafter=b``: a bare item continues the value
    before it, so the user's literal ``members=a,b`` works) or a JSON object. A dict is taken as
    it is, except that the bare items of lm-eval's plain parser (``{"members": "a", "b": ""}``)
    are folded back into ``members``: every empty-valued key that is not among ``known`` (the
    option names, :func:`lm_eval_safe.options.known_keys`, which the model passes: this module
    sits below the options, which read their lists with it)."""
    if model_args is None:
        return {}
    if isinstance(model_args, dict):
        args = dict(model_args)
        bare = [k for k, v in args.items() if v == "" and k not in known]
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


def as_bool(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise OptionError(f"{key}={value!r} must be true or false")


def as_number(value: Any, key: str, kind: type) -> Any:
    try:
        return kind(value)
    except (TypeError, ValueError) as exc:
        raise OptionError(f"{key}={value!r} must be a {kind.__name__}") from exc


def choice(value: Any, key: str, choices: tuple[str, ...]) -> str:
    text = str(value).strip().lower()
    if text not in choices:
        raise OptionError(f"unknown {key}={value!r}; choose one of: {', '.join(choices)}")
    return text


#: member specs that name a model in a store (lm_eval_safe.members.stores), written ``PREFIX:REF``
STORE_PREFIXES = ("ollama:", "hf:", "lmstudio:")


def member_display_name(spec: str) -> str:
    """Short, filesystem-safe name of a member spec (alias, folder or file name; a store's
    model by its last name part with its tag: ``ollama:qwen2.5:1.5b`` is ``qwen2.5-1.5b``,
    ``hf:org/repo:Q4_K_M`` is ``repo-Q4_K_M``): run folders and traces are named with it."""
    from pathlib import PurePath

    if spec.strip().lower().startswith(STORE_PREFIXES):
        ref = spec.strip().split(":", 1)[1].rstrip("/")
        last = ref.rsplit("/", 1)[-1]
        name = last.removesuffix(".gguf").replace(":", "-")
        return name.removesuffix("-latest") if spec.strip().lower().startswith("ollama:") else name
    name = PurePath(spec.rstrip("/")).name or spec
    for suffix in (".gguf",):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return name


def check_distinct_names(members: list[str]) -> None:
    """Refuse two different members that one display name would stand for (in any case, as a
    case-blind file system sees run folders): results, traces, run folders and ``drafter=``
    name members by it, and the first would silently win. The same spec listed twice is one
    model twice (an ensemble of a model with itself), which ``drafter=`` tells apart by index."""
    seen: dict[str, str] = {}
    for spec in members:
        name = member_display_name(spec)
        first = seen.setdefault(name.casefold(), spec)
        if first.strip() != spec.strip():
            raise OptionError(
                f"members {first!r} and {spec!r} would both be called {name!r} (in results, traces, "
                "run folders and drafter=): list each model once, or give one as a file or folder "
                "of another name"
            )


def resolve_drafter_index(drafter: str | int | None, members: list[str]) -> int:
    """The drafter's index among ``members``: ``drafter=`` as an index, a spec or a display
    name that names exactly one member."""
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
    found = [index for index, spec in enumerate(members) if text in (spec, member_display_name(spec))]
    if len(found) == 1:
        return found[0]
    if found:
        indices = ", ".join(map(str, found))
        raise OptionError(f"drafter={drafter!r} names members {indices}; give the index of the one to draft, e.g. drafter={found[0]}")
    names = ", ".join(member_display_name(m) for m in members)
    raise OptionError(f"drafter={drafter!r} names no member; choose one of: {names} (or an index)")


def stable_run_name(model_args: Any, known: Collection[str] = ()) -> str | None:
    """Folder name for lm-eval's output: members, drafter, schedule and aggregator, not a random id
    (``known``: the option names, as for :func:`parse_model_args`)."""
    try:
        args = parse_model_args(model_args, known) if isinstance(model_args, (str, dict)) else {}
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
