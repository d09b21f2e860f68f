"""lm-eval's ``--use_cache`` per configuration: a table of the user's cache file for each member
set and output-changing options.

lm-eval keys cached responses by the request alone, with no model identity: two member sets on
one cache path would get each other's answers. The backend hashes what its responses depend on
into a table name and points lm-eval's store at that table before the first lookup.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from typing import Any

from lm_eval_safe.errors import OptionError
from lm_eval_safe.lm_eval_compat import bos_rule
from lm_eval_safe.members.member import Member
from lm_eval_safe.members.sources import earlier_identity
from lm_eval_safe.options import SafeOptions

logger = logging.getLogger("lm_eval_safe")

#: Bump when cached responses of an unchanged configuration would no longer be reproduced (a
#: decoding fix): the ``--use_cache`` table name changes and old entries are not returned.
#: 2: ``sharpen=geometric`` applies the geometric mean only where the mixture is below 0.5.
CACHE_NAMESPACE_FORMAT = 2


def cache_identity(options: SafeOptions, members: Sequence[Member], drafter: int) -> dict[str, Any]:
    """What the responses of a configuration depend on: the output-changing options
    (:data:`~lm_eval_safe.options.OUTPUT_OPTIONS`) with each member's resolved identity (a
    GGUF's sha256 whatever alias, path or store name reached it; a folder's files' sizes and
    mtimes; and the dtype it was loaded in) and the drafter as an index into them."""
    identity = options.output_identity()
    identity["members"] = [m.identity() for m in members]
    identity["drafter"] = drafter
    identity["dtype"] = [str(m.dtype).replace("torch.", "") for m in members]
    identity["format"] = CACHE_NAMESPACE_FORMAT
    if options.add_bos_token is None and bos_rule() != "tokenizer":
        identity["bos_rule"] = bos_rule()  # lm-eval 0.4.9 encodes without BOS by default
    return identity


def cache_namespace(identity: dict[str, Any]) -> str:
    """The configuration's table name in a ``--use_cache`` file (a hash of its identity)."""
    text = json.dumps(identity, sort_keys=True, default=str)
    return "safe-ensemble-" + hashlib.sha256(text.encode()).hexdigest()[:20]


def earlier_namespace(options: SafeOptions, members: Sequence[Member], drafter: int) -> str | None:
    """The table this configuration had before every GGUF member was identified by its content
    (aliases by name, paths by size and mtime: :func:`~lm_eval_safe.members.sources.
    earlier_identity`), or None where no member's identity changed. Answers kept there are not
    reused (the format stays, so store-name tables stay valid); :func:`use_cache_table` says so."""
    identity = cache_identity(options, members, drafter)
    changed = False
    for i, member in enumerate(members):
        before = earlier_identity(member.source)
        if before is not None:
            rest = {k: v for k, v in identity["members"][i].items() if k != "sha256"}
            identity["members"][i] = {**before, **rest}
            changed = True
    return cache_namespace(identity) if changed else None


def use_cache_table(store: Any, table: str, earlier: str | None = None) -> None:
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
    logger.info("--use_cache: %s keeps this configuration's results in table %s", store.filename, table)
    known = "SELECT name FROM sqlite_master WHERE type='table' AND name=?"
    if earlier and store.conn.select_one(known, (earlier,)) and not store.conn.select_one(known, (table,)):
        logger.warning(
            "--use_cache: %s holds answers of this configuration from an earlier version (table %s), "
            "kept under its GGUF members' names or paths; they are not reused, since members are now "
            "keyed by their files' sha256 (any name of one file shares answers): this run computes "
            "them again", store.filename, earlier,
        )  # fmt: skip
    store.conn.execute(f'CREATE TABLE IF NOT EXISTS "{table}" (key TEXT PRIMARY KEY, value BLOB)')
    store.conn.commit(blocking=True)
    store.tablename = table
