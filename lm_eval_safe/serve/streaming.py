"""What part of a request's text a stream may send: text no later cycle can change.

After each SAFE cycle the decoder reports the text of every token committed so far (drafted and
accepted, or chosen at an ensemble point); drafted tokens still waiting for verification are
not in it. Three things can still change or cut that text's tail, so the tail is held back:

- bytes of a character not yet complete (a byte-level token in the middle of a UTF-8 sequence
  decodes to U+FFFD, which the next token turns into the real character);
- the beginning of a stop string: the final text is cut where a stop string starts, so text that
  may turn out to be part of one is sent only once it cannot;
- spaces at the end, where a tokenizer's clean-up (``clean_up_tokenization_spaces``) drops the
  space before punctuation that has not been generated yet.

The streamed pieces of a request therefore concatenate to exactly its non-streamed text.
"""

from __future__ import annotations

from collections.abc import Sequence

REPLACEMENT = "\ufffd"


class StreamMismatch(RuntimeError):
    """The final text does not extend what was sent: a decoding that is not prefix-stable."""


def settled_length(text: str, until: Sequence[str]) -> int:
    """How many leading characters of ``text`` (no stop string in it yet) are final."""
    end = len(text)
    while end and text[end - 1] == REPLACEMENT:
        end -= 1
    longest = max((len(s) for s in until), default=0)
    for start in range(max(0, end - longest + 1), end):
        tail = text[start:end]
        if any(s.startswith(tail) for s in until):
            end = start
            break
    while end and text[end - 1].isspace():
        end -= 1
    return end


class SettledText:
    """The text a stream has sent for one request, and what it may send next."""

    def __init__(self, until: Sequence[str]):
        self.until = [s for s in until if s]
        self.sent = ""

    def update(self, text: str) -> str:
        """The new settled piece of ``text`` (the request's text after a cycle, uncut)."""
        hits = [i for i in (text.find(s) for s in self.until) if i >= 0]
        settled = text[: min(hits)] if hits else text[: settled_length(text, self.until)]
        if len(settled) <= len(self.sent) or not settled.startswith(self.sent):
            return ""
        delta, self.sent = settled[len(self.sent) :], settled
        return delta

    def finish(self, final: str) -> str:
        """The rest of the request's final text (cut at its stop string and budget)."""
        if not final.startswith(self.sent):
            raise StreamMismatch(
                f"streamed {self.sent[-40:]!r} is not a prefix of the final text {final[-40:]!r}"
            )
        delta, self.sent = final[len(self.sent) :], final
        return delta
