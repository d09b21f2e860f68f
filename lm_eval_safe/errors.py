"""The two errors a user can fix, each a one-line message saying how, and the text check every
front door's prompts pass."""

from __future__ import annotations

import re

#: a UTF-16 surrogate code point: JSON's ``"\ud800"`` and Python's ``"\ud800"`` make one, and
#: no UTF-8 text holds one (a pair in JSON decodes to the one character it stands for)
SURROGATE = re.compile("[\ud800-\udfff]")


class OptionError(ValueError):
    """A model_args problem the user can fix; the message is one line saying how."""


class RequestError(ValueError):
    """A request that cannot run, found before any work: one line naming its document."""


def check_text(text: str) -> None:
    """Refuse text holding a lone surrogate, in one line that says so.

    Tokenizers cannot encode it (the fast ones answer ``TextEncodeInput must be Union[...]``,
    which names no cause), and a response echoing it could not be written as UTF-8. Every
    prompt and scored text a member encodes passes here (:meth:`Member.encode`), so
    ``generate_until``, ``loglikelihood`` and the server all refuse it the same way; each adds
    where the text came from (a document, a request field)."""
    found = SURROGATE.search(text)
    if found is None:
        return
    at = found.start()
    around = text[max(0, at - 20) : at + 20]
    raise RequestError(
        f"the text holds a lone UTF-16 surrogate {ascii(found.group())} at character {at} "
        f"(in {ascii(around)}), which is not Unicode text and no tokenizer encodes: send valid "
        "UTF-8 (a surrogate pair as the one character it stands for)"
    )
