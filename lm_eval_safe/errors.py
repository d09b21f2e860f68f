"""The two errors a user can fix, each a one-line message saying how."""

from __future__ import annotations


class OptionError(ValueError):
    """A model_args problem the user can fix; the message is one line saying how."""


class RequestError(ValueError):
    """A request that cannot run, found before any work: one line naming its document."""
