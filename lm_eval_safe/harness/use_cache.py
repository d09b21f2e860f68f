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
from lm_eval_safe.options import SafeOptions

logger = logging.getLogger("lm_eval_safe")

#: Bump when cached responses of an unchanged configuration would no longer be reproduced (a
#: decoding fix): the ``--use_cache`` table name changes and old entries are not returned.
#: 2: ``sharpen=geometric`` applies the geometric mean only where the mixture is below 0.5.
CACHE_NAMESPACE_FORMAT = 2


def cache_identity(options: SafeOptions, members: Sequence[Member], drafter: int) -> dict[str, Any]:
    """What the responses of a configuration depend on: the output-changing options
    (:data:`~lm_eval_safe.options.OUTPUT_OPTIONS`) with each member's resolved identity (alias
    and checksum, or file/folder and size+mtime, and the dtype it was loaded in) and the drafter
    as an index into them."""
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
    logger.info("--use_cache: %s keeps this configuration's results in table %s", store.filename, table)
    store.conn.execute(f'CREATE TABLE IF NOT EXISTS "{table}" (key TEXT PRIMARY KEY, value BLOB)')
    store.conn.commit(blocking=True)
    store.tablename = table
