"""How a chosen string is written with the drafter's own ids (docs/algorithm.md, Aggregators).

Every aggregator chooses a *string*; only the drafter's ids can be appended to the text. The
drafter writes a string with its EOS, its own token for it, or the encoding of its text; some
strings it cannot write at all (another member's special token, bytes that are no UTF-8 text
it has no token for, EOS when it has none), and there the drafted token stays. Sampling reads
the same rule to restrict the ensemble's distribution to strings the drafter can write.
"""

from __future__ import annotations

from lm_eval_safe.members.member import Member
from lm_eval_safe.members.vocabulary import EOS_KEY

#: How :func:`route` says a string is written.
EOS, TOKEN, ENCODE, KEEP_DRAFTED = "eos", "token", "encode", "keep-drafted"


def route(drafter: Member, key: bytes) -> str:
    """How ``drafter`` writes ``key``: its EOS, its own token, the encoding of the text, or not
    at all (:data:`KEEP_DRAFTED`: the drafted token stays)."""
    if key == EOS_KEY:
        return EOS if drafter.eos_id is not None else KEEP_DRAFTED
    if key in drafter.vocab.lookup:
        return TOKEN
    if key.startswith(b"\x00"):
        return KEEP_DRAFTED
    try:
        key.decode("utf-8")
    except UnicodeDecodeError:
        return KEEP_DRAFTED
    return ENCODE


def can_write(drafter: Member, key: bytes) -> bool:
    """``drafter`` writes ``key`` with ids of its own rather than keeping its drafted token."""
    return route(drafter, key) != KEEP_DRAFTED
