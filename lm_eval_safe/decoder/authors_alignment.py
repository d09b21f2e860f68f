"""Where the SAFE authors' code looks for ensemble points (``reference=authors``;
docs/algorithm.md, The authors' code).

This package aligns by byte offsets of the text (docs/algorithm.md, Token strings and
alignment). The authors' code instead compares *decoded prefixes*: it decodes the drafter's ids
up to each drafted position and the verifier's ids up to each of its positions, strips leading
spaces from both, and pairs a verifier position with the first drafted position whose string is
equal. After a response that starts with a lone space token, the stripped strings of the
drafter's row before the space and the verifier's row after it are both empty, so those two
are paired; byte offsets never pair them. Their verifier also reads the drafter's text as its
``decode`` gives it, special tokens included (a drafted EOS is its text, ``<|im_end|>``), and
tokenizes it with ``tokenizer(text, add_special_tokens=False)``.

Only the pairing is reproduced here: the verifier's rows come from the same cache code as
always (:meth:`~lm_eval_safe.decoder.member_runs.VerifierRun.feed_steps`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def verifier_ids(drafter_tokenizer: Any, verifier_tokenizer: Any, ids: list[int]) -> list[int]:
    """The verifier's tokenization of the drafter's ``ids`` as the authors make it."""
    text = drafter_tokenizer.decode(ids)
    return list(verifier_tokenizer(text, add_special_tokens=False)["input_ids"])


def _first_true(predicate: Callable[[int], bool], high: int) -> int:
    """The least ``i`` in ``[0, high]`` where ``predicate`` holds, for a predicate false then
    true as ``i`` grows (``high`` when it never holds below it)."""
    low = 0
    while low < high:
        middle = (low + high) // 2
        if predicate(middle):
            high = middle
        else:
            low = middle + 1
    return low


def first_verified(
    verifier_tokenizer: Any, ver_ids: list[int], committed: str, gac: bool
) -> int:
    """The first verifier position the authors examine this cycle (their ``ver_current_position``):
    where the verifier's decoded prefix first reaches the committed text, by length (their UniTE
    code) or by starting with it (their GaC code); none (``len(ver_ids)``) when the verifier's
    whole text is shorter, or with GaC does not start with the committed text. Their search
    starts a window before the previous cycle's position; on prefixes that only grow it finds
    the same first position."""
    if not committed:
        return 0

    def prefix(i: int) -> str:
        return verifier_tokenizer.decode(ver_ids[:i])

    whole = prefix(len(ver_ids))
    if gac:
        if not whole.startswith(committed):
            return len(ver_ids)
        return _first_true(lambda i: prefix(i).startswith(committed), len(ver_ids))
    if len(committed) > len(whole):
        return len(ver_ids)
    return _first_true(lambda i: len(prefix(i)) >= len(committed), len(ver_ids))


def paired_positions(
    drafter_tokenizer: Any,
    verifier_tokenizer: Any,
    committed_ids: Sequence[int],
    drafted: Sequence[int],
    ver_ids: list[int],
    gac: bool,
) -> list[tuple[int, int]]:
    """``(drafted index j, verifier index i)`` pairs in the order the authors test them: for
    each verifier position from :func:`first_verified` on, the first drafted position whose
    stripped decoded prefix equals the verifier's (a longer drafted prefix ends the search).
    ``i`` indexes the verifier's row predicting ``ver_ids[i]``, its own next token there."""
    committed = list(committed_ids)
    drafted_prefixes = [
        drafter_tokenizer.decode(committed + list(drafted[:j])).lstrip(" ") for j in range(len(drafted))
    ]
    start = first_verified(
        verifier_tokenizer, ver_ids, drafter_tokenizer.decode(committed) if committed else "", gac
    )
    pairs: list[tuple[int, int]] = []
    for i in range(start, len(ver_ids)):
        ver_prefix = verifier_tokenizer.decode(ver_ids[:i]).lstrip(" ")
        for j, drafted_prefix in enumerate(drafted_prefixes):
            if drafted_prefix == ver_prefix:
                pairs.append((j, i))
                break
            if len(drafted_prefix) > len(ver_prefix):
                break
    return pairs


def authors_agree(drafter_probability: float, verifier_probability: float, verifier_argmax_is_own: bool) -> bool:
    """The authors' skip test at a pair: the verifier's argmax is its own next token, or the
    two members' probabilities of their own next tokens sum to 1 or more (this package skips
    only above 0.5 on average: the two differ at exactly 0.5)."""
    return verifier_argmax_is_own or drafter_probability + verifier_probability >= 1.0
