"""The transformers engine's read-back: heads cut on the device from the full
log-softmax, token-only drafting, and the benchmark's instruments.

References are brute force on the same tensors: ``torch.log_softmax`` of the row and
``torch.argmax`` (the first of equal maxima) over it, which is what the engine computed and
read in full before.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from aggregate_cases import member

from lm_eval_safe.decoder.loop import GenerationJob, SafeDecoder
from lm_eval_safe.engines import load_member
from lm_eval_safe.engines.base import TopLogprobs, head_of, row_max_probability
from lm_eval_safe.engines.hf.heads import EXACT_ARGMAX_LOGIT, Want, full_rows, largest, read_heads
from lm_eval_safe.ensemble.aggregate import unite
from lm_eval_safe.ensemble.certified import certified_unite
from lm_eval_safe.options import parse_options


def _rows(seed: int, n: int = 6, vocab: int = 300) -> torch.Tensor:
    """Logits with exact ties at the maximum, inside the top ids and at the K-th id."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=g) * 3
    logits[0, [7, 3, 200]] = logits[0].max() + 1  # tied maxima: the first (3) is the argmax
    logits[1, [50, 51]] = logits[1].max() + 0.5
    row = logits[2].sort(descending=True).values
    logits[2, 10] = row[4]  # level with the 5th most probable
    return logits


def test_heads_are_cut_from_the_log_softmax() -> None:
    logits = _rows(1)
    logprobs = torch.log_softmax(logits, dim=-1)
    wants = [Want(5), Want(1), Want(8, (0, 299)), Want(full=True), Want(20, (3,)), Want(1, (9,))]
    (answers,) = read_heads([(logits, wants)])
    for row, (want, answer) in enumerate(zip(wants, answers, strict=True)):
        full = logprobs[row]
        if want.full:
            assert torch.equal(answer, full)
            continue
        assert isinstance(answer, TopLogprobs)
        assert answer.argmax == int(torch.argmax(full))
        assert len(answer.ids) == want.top == len(set(answer.ids))
        assert answer.logprobs == [float(full[t]) for t in answer.ids]
        assert answer.logprobs == sorted(answer.logprobs, reverse=True)
        outside = full.clone()
        outside[answer.ids] = -float("inf")
        assert float(outside.max()) <= answer.logprobs[-1]
        assert set(want.named) <= set(answer.known)
        assert all(answer.known[t] == float(full[t]) for t in answer.known)
        assert row_max_probability(answer) == float(full.max().exp())
        assert torch.equal(full_rows([answer])[0], full)


def test_largest_is_max_bit_for_bit() -> None:
    """The blockwise maximum equals ``torch.max(dim=-1)``, values and first ids, on rows with
    many exact ties (rounded logits, maxima in several blocks, at the very last id), NaNs, an
    all ``-inf`` row; blocks of 1024 ids (gemma3, smollm2), 1187 (Qwen) and 1000, a prime width
    (no block: ``max`` itself), one row or several, float32 and bfloat16."""
    g = torch.Generator().manual_seed(4)
    checked = 0
    for width in (4096, 49152, 131071, 151936, 160000, 262144):
        for n in (1, 8):
            for dtype in (torch.float32, torch.bfloat16):
                rows = (torch.randn(n, width, generator=g) * 2).round().to(dtype)
                if n > 1:
                    top = rows.max() + 1
                    rows[1, [width - 1, 17]] = top  # the first of two blocks
                    rows[2, width - 1] = top  # the very last id
                    rows[3, [2000, 1999]] = top
                    rows[4, 3000] = float("nan")
                    rows[4, 4000] = float("nan")
                    rows[5] = float("-inf")
                want = rows.max(dim=-1)
                values, indices = largest(rows)
                assert torch.equal(indices, want.indices), (width, n, dtype)
                assert torch.equal(values.isnan(), want.values.isnan())
                finite = ~want.values.isnan()
                assert torch.equal(values[finite], want.values[finite])
                checked += 1
    assert checked == 24


def test_tokens_only_take_the_log_softmax_argmax() -> None:
    """Rows whose largest logit is at least EXACT_ARGMAX_LOGIT are answered from the logits;
    the others from the log-softmax, which can make distinct logits equal: here a flat row
    where the log-softmax rounds a 1e-7 lead away, so its argmax is id 0, not the logits' 5."""
    vocab = 262_144
    flat = torch.zeros(vocab)
    flat[5] = 1e-7
    assert int(torch.argmax(flat)) == 5
    assert int(torch.argmax(torch.log_softmax(flat, dim=-1))) == 0
    rng = random.Random(3)
    rows = [flat]
    for _ in range(40):  # large logits with neighbours one float step below the maximum
        row = torch.randn(vocab) * rng.choice([1.0, 4.0])
        top = rng.uniform(EXACT_ARGMAX_LOGIT, 40.0)
        i, j = rng.sample(range(vocab), 2)
        row[i] = top
        row[j] = torch.nextafter(torch.tensor(top), torch.tensor(0.0))
        rows.append(row)
    logits = torch.stack(rows)
    (tokens,) = read_heads([(logits, [Want(0)] * len(rows))])
    assert tokens == torch.argmax(torch.log_softmax(logits, dim=-1), dim=-1).tolist()


def test_a_head_of_one_id_certifies_no_unite_choice() -> None:
    """The drafter's argmax-only heads cannot name UniTE's top-k strings: no certified answer
    (the decoder completes the rows), where a head of top_k ids would have given one."""
    views = [member({"a": 0.6, "b": 0.3, "c": 0.1}), member({"a": 0.2, "b": 0.7, "c": 0.1})]
    exact = unite(views, "heuristic", 0.3, 2)

    def head(view, k: int):
        top = torch.topk(view.logprobs, k)
        ids, lps = top.indices.tolist(), top.values.tolist()
        return type(view)(TopLogprobs(ids, lps, dict(zip(ids, lps, strict=True))), view.vocab, view.tokenizer, view.weight)

    assert certified_unite([head(views[0], 1), head(views[1], 3)], "heuristic", 0.3, 2) is None
    wide = certified_unite([head(v, 3) for v in views], "heuristic", 0.3, 2)
    assert wide is not None and wide.key == exact.key


def test_host_reads_at_most_one_per_batch_step(tiny_bpe_dir: Path, tiny_sp_dir: Path) -> None:
    """The benchmark's counter on tiny members: the drafter reads back once per batched step and
    a verifier once per call, at batch 1 and 3; the counted pass writes the timed pass's
    texts, and the clock saw every forward. (A row whose largest logit is below
    EXACT_ARGMAX_LOGIT costs a second read: test_tokens_only_take_the_log_softmax_argmax.)"""
    from lm_eval_safe.bench.host_work import measure

    members = [load_member(str(d), index=i) for i, d in enumerate((tiny_bpe_dir, tiny_sp_dir))]
    with torch.no_grad():  # logits past EXACT_ARGMAX_LOGIT, as a trained drafter's are
        members[0].engine.model.get_output_embeddings().weight.mul_(200.0)
    names = [m.name for m in members]
    jobs = [GenerationJob(p, [], 12) for p in ("the cat sat", "a dog ran over", "numbers like 7 and 8")]
    for schedule in ("drafter", "safe"):
        decoder = SafeDecoder(members, 0, parse_options({"members": names, "schedule": schedule}))
        for batch_size in (1, 3):
            work = measure(schedule, decoder, jobs, batch_size)
            assert work.tokens > 0 and work.forward_seconds > 0
            drafter = names[0]
            reads = work.host_syncs[drafter]
            if schedule == "drafter":
                assert 0 < reads <= work.forwards[drafter]
            else:  # and one per completion call (ensemble points)
                assert 0 < reads <= work.forwards[drafter] + work.engine_calls[drafter]
            if schedule == "safe":
                verifier = names[1]
                # one read per call, plus the completions of ensemble points (one per call too)
                assert work.host_syncs.get(verifier, 0) <= work.engine_calls[verifier]


def test_the_counter_sees_reads_of_weights_only(tiny_bpe_dir: Path) -> None:
    from lm_eval_safe.bench.host_work import SyncCounter
    from lm_eval_safe.engines.hf.clocks import ForwardClock

    m = load_member(str(tiny_bpe_dir))
    clock = ForwardClock([m])
    try:
        with torch.no_grad(), SyncCounter([m], clock) as counter:
            host = torch.arange(4)
            int(host.sum())  # a host tensor: no read of the device
            weight = m.engine.model.get_input_embeddings().weight
            derived = weight[0].sum() * 2
            float(derived)
            derived.tolist()
            derived.cpu().item()  # the copy is on the host: one read, not two
        assert counter.host[m.name] == 3
        # device work: the sum and the product (not the row, a view; not the reads; not the
        # host tensors: arange, its sum, int(), .item() of the copy)
        assert counter.device_ops == 2
        assert counter.host_ops == 5
        with torch.no_grad(), SyncCounter([m], clock) as counter:
            rows = weight[:3].clone()  # one kernel (the slice is a view)
            rows.zero_()  # one in place
            rows[0] = 1.0  # one write
            _ = rows.shape, rows.numel(), rows.float(), rows.unflatten(-1, (2, -1))  # metadata, views
        assert counter.device_ops == 3
        with torch.no_grad(), SyncCounter([m], clock) as counter:
            m.engine.model(input_ids=torch.tensor([[1, 2, 3]]))  # its rotary table goes .to(x.device)
        assert counter.in_forward[m.name] == 0 and counter.host[m.name] == 0
    finally:
        clock.close()


def test_wider_heads_are_the_rows_top_ids_argmax_first() -> None:
    """A widened head holds the ``top`` most probable ids of the same log-softmax row, the
    first of equal maxima first, and still knows the ids it knew (a verifier's own token)."""
    from lm_eval_safe.engines.hf.heads import wider_heads

    logits = _rows(2)
    logprobs = torch.log_softmax(logits, dim=-1)
    wants = [Want(1), Want(1, (299,)), Want(3), Want(1), Want(2), Want(1)]
    (heads,) = read_heads([(logits, wants)])
    wide = wider_heads(heads, 12)
    for row, (head, widened) in enumerate(zip(heads, wide, strict=True)):
        full = logprobs[row]
        assert widened.argmax == int(torch.argmax(full)) == head.argmax
        assert len(widened.ids) == 12 == len(set(widened.ids))
        assert widened.logprobs == [float(full[t]) for t in widened.ids]
        outside = full.clone()
        outside[widened.ids] = -float("inf")
        assert float(outside.max()) <= widened.logprobs[-1]
        assert set(head.known) <= set(widened.known)
        assert all(widened.known[t] == float(full[t]) for t in widened.known)
        assert widened.max_probability == head.max_probability
        assert torch.equal(full_rows([widened])[0], full)
        on_host = head_of(full, 12, head)  # an engine widening from full rows (vLLM)
        assert (on_host.ids, on_host.logprobs, on_host.known) == (widened.ids, widened.logprobs, widened.known)
    assert 299 in wide[1].known


def test_short_drafter_heads_widen_and_decide_as_the_full_rows(
    tiny_bpe_dir: Path, tiny_sp_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A drafter head of one id cannot name UniTE's candidates (nor GaC's sharpening's): the
    decoder widens it to ``top_logprobs`` ids before asking for full rows. Every decision
    certified from a widened head equals the exact aggregator's on the full rows, and the texts
    equal those of a decoder that never widens (every such point decided on full rows)."""
    from lm_eval_safe.engines.base import Complete
    from lm_eval_safe.ensemble import aggregators
    from lm_eval_safe.ensemble.aggregate import View, gac

    members = [load_member(str(d), index=i) for i, d in enumerate((tiny_bpe_dir, tiny_sp_dir))]
    names = [m.name for m in members]
    jobs = [GenerationJob(p, [], 16) for p in ("the cat sat on", "a dog ran over the", "numbers like 7 and")]
    seen = []
    for aggregator, certify in (("unite", "certified_unite"), ("gac", "certified_gac")):
        original = getattr(aggregators, certify)

        def spy(views, *args, _original=original, _aggregator=aggregator):
            choice = _original(views, *args)
            if choice is not None and len(views[0].logprobs.ids) > 1:
                seen.append((_aggregator, views, args, choice))
            return choice

        options = {"members": names, "schedule": "every", "aggregator": aggregator}
        decoder = SafeDecoder(members, 0, parse_options(options))
        with monkeypatch.context() as patch:
            patch.setattr(aggregators, certify, spy)
            widened = decoder.generate_many(jobs, batch_size=2)
        never_widens = SafeDecoder(members, 0, parse_options(options))
        with monkeypatch.context() as patch:
            patch.setattr(never_widens.ensembler.aggregator, "short_heads", lambda views: [])
            full = never_widens.generate_many(jobs, batch_size=2)
        assert [text for text, _ in widened] == [text for text, _ in full]
        ops = sum(s.ensemble_ops for _, s in widened)
        assert sum(s.full_decisions for _, s in full) == ops > 0
        assert sum(s.full_decisions for _, s in widened) < ops
    assert sum(a == "unite" for a, *_ in seen) > 10 and sum(a == "gac" for a, *_ in seen) > 10
    batches = [m.engine.new_batch() for m in members]
    for aggregator, views, args, choice in seen:
        rows = [batches[slot].run({0: Complete(slot, [v.logprobs])})[0][0] for slot, v in enumerate(views)]
        full_views = [View(r, v.vocab, v.tokenizer, v.weight) for r, v in zip(rows, views, strict=True)]
        union = args[0] if aggregator == "gac" else None
        exact = gac(full_views, *args) if union is not None else unite(full_views, *args)
        assert (exact.key, exact.sharpened) == (choice.key, choice.sharpened)


def test_bench_host_runs_end_to_end(tiny_bpe_dir: Path, tiny_sp_dir: Path, tmp_path: Path) -> None:
    """lm-eval-safe bench host on tiny members: every configuration at each batch size, the
    median of the timed repeats, the device work between the forwards (KV moves and heads,
    timed in the same pass: the host time less it is below the host time), the kernels the
    counted pass saw launched, and the replay of each run's cycles."""
    import json

    from helpers import write_gsm8k

    from lm_eval_safe.bench.commands import host as script

    rows = [{"question": f"What is {i} plus 3?", "answer": f"{i}+3={i + 3}\n#### {i + 3}"} for i in range(4)]
    data = write_gsm8k(tmp_path, rows)
    out = tmp_path / "host.json"
    argv = ["--members", f"{tiny_bpe_dir},{tiny_sp_dir}", "--prompts", "2", "--shots", "1"]
    argv += ["--max-new-tokens", "6", "--batch-sizes", "1,2", "--repeats", "2", "--data-dir", str(data)]
    assert script.main([*argv, "--device", "cpu", "--dtype", "float32", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert (report["config"]["device"], report["config"]["dtype"]) == ("cpu", "torch.float32")
    seen = {(r["configuration"], r["batch_size"]) for r in report["rows"]}
    assert seen == {(c, b) for c in ("drafter", "unite_safe", "gac_safe") for b in (1, 2)}
    for row in report["rows"]:
        repeats = row["host_ms_per_token_repeats"]
        assert len(repeats) == 2 and row["host_ms_per_token"] in repeats
        assert row["tokens"] > 0 and row["device_ops_per_token"] > 0 and row["device_ms_per_token"] > 0
        assert row["host_ms_per_token_less_device_work"] < row["host_ms_per_token"]
        forwards = sum(row["forwards"].values())
        assert row["forwards_per_token"] == pytest.approx(forwards / row["tokens"], abs=1e-4)
        assert row["device_ops_per_forward"] * forwards == pytest.approx(row["device_ops_per_token"] * row["tokens"], rel=0.01)
        # the run's own cycles replayed as the driver batches them give the forwards it ran
        packing = row["packing"]
        assert packing["lock_step_forwards_per_token"] == row["forwards_per_token"]
        assert packing["bound_forwards_per_token"] <= packing["rows_apart_forwards_per_token"]
        assert packing["bound_forwards_per_token"] <= row["forwards_per_token"]


@pytest.mark.parametrize("schedule", ["drafter", "safe", "every", "threshold"])
def test_drafts_kept_on_the_device_write_the_same_texts_with_one_read_per_call(
    tiny_bpe_dir: Path, tiny_sp_dir: Path, schedule: str
) -> None:
    """Greedy windows drafted on the device (each step fed the token the step before left
    there; the window read back at its end, as on a GPU) write the texts that reading every
    token writes, with the same counts, at batch 1 and 3; the drafter then reads back once per
    engine call (a window, or an ensemble point's widened head), not once per token. Requests
    ending at EOS mid-window are among them: their tokens after it are dropped."""
    from lm_eval_safe.bench.host_work import measure

    members = [load_member(str(d), index=i) for i, d in enumerate((tiny_bpe_dir, tiny_sp_dir))]
    names = [m.name for m in members]
    prompts = ["the cat sat", "a dog ran over", "numbers like 7 and 8", "the", "over the hills and far"]
    jobs = [GenerationJob(p, [], 14) for p in prompts]
    stopped_early = 0
    for aggregator in ("unite", "gac"):
        options = {"members": names, "schedule": schedule, "aggregator": aggregator}
        decoder = SafeDecoder(members, 0, parse_options(options))
        for batch_size in (1, 3):
            every_token = decoder.generate_many(jobs, batch_size)
            members[0].engine.keep_drafts_on_device = True
            try:
                work = measure(schedule, decoder, jobs, batch_size)
            finally:
                members[0].engine.keep_drafts_on_device = None
            assert work.texts == [text for text, _ in every_token], (aggregator, batch_size)
            assert work.tokens == sum(s.generated_tokens for _, s in every_token)
            assert work.cycles == sum(s.cycles for _, s in every_token)
            assert work.ensemble_ops == sum(s.ensemble_ops for _, s in every_token)
            # one read per window; an engine call that also serves another row's completion
            # (an ensemble point) reads that apart
            reads, calls = work.host_syncs[names[0]], work.engine_calls[names[0]]
            assert reads == calls if schedule == "drafter" else reads <= calls + work.ensemble_ops
            stopped_early += sum(s.generated_tokens % 5 != 4 and s.generated_tokens < 14 for _, s in every_token)
    assert stopped_early > 0
