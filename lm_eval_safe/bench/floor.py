"""The floor of ``lm-eval-safe bench speed``: the least any draft-then-verify scheme can cost.

The drafter's own decoding plus one verifier forward per cycle over only the new verifier
tokens (with cache reuse, through ``VerifierRun.sync``), and nothing else: SAFE's time over the
floor is the overhead of its policy (alignment checks, aggregation, rewinds).

It builds the decoder's own :class:`~lm_eval_safe.decoder.member_runs.VerifierRun` with the decoder's
prompt reserve and forget margin, so it verifies exactly what SAFE's verifiers would.
"""

from __future__ import annotations

from lm_eval_safe.decoder.draft_window import DraftWindow
from lm_eval_safe.decoder.loop import SafeDecoder
from lm_eval_safe.decoder.member_runs import VerifierRun, verifier_reserve
from lm_eval_safe.members.vocabulary import valid_utf8_prefix


def verify_floor(
    decoder: SafeDecoder, context: str, gen_ids: list[int], max_new_tokens: int
) -> int:
    """One verifier forward per cycle over only the new verifier tokens of each window.

    Mirrors what SAFE's decoder must at least do (re-tokenize committed + drafted text and run
    each verifier over what its cache lacks) without any policy. Returns verifier positions.
    """
    opts = decoder.options
    vocab = decoder.drafter.vocab
    runs = []
    for member in decoder.verifiers:
        reserve = verifier_reserve(member, max_new_tokens)
        runs.append(VerifierRun(member, decoder.prompt_ids(member, context, reserve), True))
    margin = DraftWindow(opts.draft_len).forget_margin()
    for end in range(opts.draft_len, len(gen_ids) + opts.draft_len, opts.draft_len):
        start = end - opts.draft_len
        full = vocab.spell(gen_ids[: min(end, len(gen_ids))])
        text = valid_utf8_prefix(full)
        # distributions before every drafted token of the window, as a verify pass needs
        want, offset = set(), len(vocab.spell(gen_ids[:start]))
        for token in gen_ids[start:end]:
            want.add(offset)
            offset += len(vocab.text_bytes[token])
        for run in runs:
            run.sync(text, full, want)
            run.forget_before(len(run.gen_ids) - margin)
    return sum(r.recomputed for r in runs)
