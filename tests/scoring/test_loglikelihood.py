"""loglikelihood against lm-eval's own ``hf`` model and a brute-force two-member reference."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from helpers import hf_encode, ll_request, make_lm
from lm_eval.api.instance import Instance

PAIRS = [
    ("The cat sat on the", " mat"),
    ("Question: 12 + 3 =", " 15"),
    ("Answer: ", "\\boxed{42}"),
    ("", "the cat sat"),
    ("café naïve", " über 数学"),
    ("numbers like 7 and 8", " sum to 15 so we write"),
]


@pytest.fixture(scope="module")
def hf_reference(request):
    from lm_eval.models.huggingface import HFLM

    def build(folder: Path) -> HFLM:
        return HFLM(pretrained=str(folder), device="cpu", dtype="float32", batch_size=1)

    return build


@pytest.mark.parametrize("family", ["bpe", "sp"])
def test_single_member_equals_lm_eval_hf(hf_reference, tiny_bpe_dir: Path, tiny_sp_dir: Path, family: str) -> None:
    folder = tiny_bpe_dir if family == "bpe" else tiny_sp_dir
    requests = [ll_request(c, x) for c, x in PAIRS]
    expected = hf_reference(folder).loglikelihood(requests, disable_tqdm=True)
    got = make_lm(folder).loglikelihood(requests, disable_tqdm=True)
    for (a, ga), (b, gb) in zip(got, expected, strict=True):
        assert a == pytest.approx(b, abs=1e-4)
        assert ga == gb


def test_same_model_twice_equals_single(tiny_bpe_dir: Path) -> None:
    requests = [ll_request(c, x) for c, x in PAIRS]
    single = make_lm(tiny_bpe_dir).loglikelihood(requests, disable_tqdm=True)
    double = make_lm(tiny_bpe_dir, tiny_bpe_dir).loglikelihood(requests, disable_tqdm=True)
    for (a, ga), (b, gb) in zip(single, double, strict=True):
        assert a == pytest.approx(b, abs=1e-5) and ga == gb


def _token_logprobs(model, tok, context: str, continuation: str) -> tuple[list[float], list[int], bytes]:
    """Per-token log-probs of the continuation and the byte end of each token, computed here."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole = hf_encode(tok, context + continuation)
    ctx = hf_encode(tok, context)
    cont = whole[len(ctx) :]
    with torch.no_grad():
        logits = model(torch.tensor([whole])).logits[0, :, : len(tok)]
    lp = torch.log_softmax(logits.float(), -1)
    values = [float(lp[len(ctx) + k - 1, t]) for k, t in enumerate(cont)]
    ends, text = [], continuation.encode()
    for k in range(1, len(cont) + 1):
        piece = tok.decode(cont[:k])
        ends.append(len(piece.encode()) if "\ufffd" not in piece else -1)
    if tok.decode(cont) != continuation:  # e.g. SentencePiece strips a leading space when decoding
        shift = len(text) - len(tok.decode(cont).encode())
        ends = [e + shift if e >= 0 else e for e in ends]
    for k in range(len(ends) - 2, -1, -1):  # half a character: belongs with the token completing it
        if ends[k] < 0:
            ends[k] = ends[k + 1]
    return values, ends, text


def test_two_tokenizers_equal_brute_force(tiny_bpe_dir: Path, tiny_sp_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    lm = make_lm(tiny_bpe_dir, tiny_sp_dir)
    refs = [(AutoModelForCausalLM.from_pretrained(d).eval(), AutoTokenizer.from_pretrained(d)) for d in (tiny_bpe_dir, tiny_sp_dir)]
    pairs = [p for p in PAIRS if p[0]]
    got = lm.loglikelihood([ll_request(c, x) for c, x in pairs], disable_tqdm=True)
    for (context, continuation), (score, _) in zip(pairs, got, strict=True):
        per_member = [_token_logprobs(m, t, context, continuation) for m, t in refs]
        total_len = len(per_member[0][2])
        common = set(per_member[0][1]) & set(per_member[1][1])
        cuts = sorted(c for c in common if 0 < c <= total_len) or [total_len]
        if cuts[-1] != total_len:
            cuts.append(total_len)
        expected, start = 0.0, 0
        for stop in cuts:
            seg = []
            for values, ends, _ in per_member:
                seg.append(sum(v for v, e in zip(values, ends, strict=True) if start < e <= stop))
            expected += math.log(0.5 * math.exp(seg[0]) + 0.5 * math.exp(seg[1]))
            start = stop
        assert score == pytest.approx(expected, abs=1e-4), (context, continuation)

# --------------------------------------------------------------------------------------
# Batching, shared contexts, rolling windows, end to end, bad input
# --------------------------------------------------------------------------------------

# Multiple-choice style: four choices per context, of different lengths, plus the pairs above.
MC = [
    (ctx, choice)
    for ctx in (
        "Question: how many apples did Anna count in the garden?\nAnswer:",
        "The dogs ran over",
    )
    for choice in (" 45", " twelve apples and then", " 3 hills", " the cat sat on a mat")
]
ROLLING = [
    "the cat sat on the mat",
    "Anna counted 45 apples in the garden because numbers like 7 and 8 sum to 15. " * 4,
    "café naïve über 数学",
]


@pytest.fixture(scope="module")
def hf_cached():
    """lm-eval ``hf`` models, one per (folder, batch size, max_length): loading costs seconds."""
    from lm_eval.models.huggingface import HFLM

    built: dict[tuple, HFLM] = {}

    def get(folder: Path, batch_size: int = 1, max_length: int | None = None) -> HFLM:
        key = (str(folder), batch_size, max_length)
        if key not in built:
            extra = {"max_length": max_length} if max_length else {}
            built[key] = HFLM(
                pretrained=str(folder),
                device="cpu",
                dtype="float32",
                batch_size=batch_size,
                **extra,
            )
        return built[key]

    return get


@pytest.mark.parametrize("family", ["bpe", "sp"])
def test_single_member_batched_equals_lm_eval_hf(
    hf_cached, tiny_bpe_dir: Path, tiny_sp_dir: Path, family: str
) -> None:
    """Batch size 4 (left-padded contexts, shared contexts, cached choices) = lm-eval hf."""
    folder = tiny_bpe_dir if family == "bpe" else tiny_sp_dir
    requests = [ll_request(c, x) for c, x in MC + PAIRS]
    expected = hf_cached(folder, 4).loglikelihood(requests, disable_tqdm=True)
    got = make_lm(folder, batch_size=4).loglikelihood(requests, disable_tqdm=True)
    for (a, ga), (b, gb) in zip(got, expected, strict=True):
        assert a == pytest.approx(b, abs=1e-4)
        assert ga == gb
    auto = make_lm(folder, batch_size="auto").loglikelihood(requests, disable_tqdm=True)
    assert [a for a, _ in auto] == pytest.approx([b for b, _ in expected], abs=1e-4)


@pytest.mark.parametrize(("family", "batch_size"), [("bpe", 1), ("sp", 4)])
def test_rolling_single_member_equals_lm_eval_hf(
    hf_cached, tiny_bpe_dir: Path, tiny_sp_dir: Path, family: str, batch_size: int
) -> None:
    """Several windows per text (max_length=24), the prefix token, batch sizes 1 and 4."""
    folder = tiny_bpe_dir if family == "bpe" else tiny_sp_dir
    requests = [rolling_request(t) for t in ROLLING]
    for max_length in (None, 24):
        expected = hf_cached(folder, batch_size, max_length).loglikelihood_rolling(
            requests, disable_tqdm=True
        )
        lm = make_lm(folder, batch_size=batch_size, max_length=max_length)
        got = lm.loglikelihood_rolling(requests, disable_tqdm=True)
        assert all(isinstance(v, float) for v in got)
        # hf sums each window's log-probs in float32: at -3000 that is 2e-4 of rounding
        assert got == pytest.approx(expected, abs=1e-4, rel=1e-6)


def rolling_request(text: str) -> Instance:
    from lm_eval.api.instance import Instance

    return Instance(request_type="loglikelihood_rolling", doc={}, arguments=(text,), idx=0)


def test_same_model_twice_rolling_equals_single(tiny_bpe_dir: Path) -> None:
    requests = [rolling_request(t) for t in ROLLING]
    single = make_lm(tiny_bpe_dir).loglikelihood_rolling(requests, disable_tqdm=True)
    double = make_lm(tiny_bpe_dir, tiny_bpe_dir, batch_size=2).loglikelihood_rolling(
        requests, disable_tqdm=True
    )
    assert double == pytest.approx(single, abs=1e-4)
    mc = [ll_request(c, x) for c, x in MC]
    single_mc = make_lm(tiny_bpe_dir).loglikelihood(mc, disable_tqdm=True)
    double_mc = make_lm(tiny_bpe_dir, tiny_bpe_dir, batch_size=3).loglikelihood(
        mc, disable_tqdm=True
    )
    for (a, ga), (b, gb) in zip(single_mc, double_mc, strict=True):
        assert a == pytest.approx(b, abs=1e-4) and ga == gb


def _rolling_token_logprobs(model, tok, text: str) -> tuple[list[float], list[int]]:
    """Brute force: BOS/prefix + the whole text in one forward (it fits the tiny models' window),
    per-token log-probs and byte ends found by decoding growing prefixes."""
    ids = hf_encode(tok, text)
    prefix = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    with torch.no_grad():
        logits = model(torch.tensor([[prefix] + ids[:-1]])).logits[0, :, : len(tok)]
    lp = torch.log_softmax(logits.float(), -1)
    values = [float(lp[k, t]) for k, t in enumerate(ids)]
    ends = []
    for k in range(1, len(ids) + 1):
        piece = tok.decode(ids[:k], skip_special_tokens=True)
        ends.append(len(piece.encode()) if "\ufffd" not in piece else -1)
    for k in range(len(ends) - 2, -1, -1):
        if ends[k] < 0:
            ends[k] = ends[k + 1]
    return values, ends


def test_two_tokenizers_rolling_equal_brute_force(tiny_bpe_dir: Path, tiny_sp_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    refs = [
        (AutoModelForCausalLM.from_pretrained(d).eval(), AutoTokenizer.from_pretrained(d))
        for d in (tiny_bpe_dir, tiny_sp_dir)
    ]
    texts = ROLLING[:2] + ["numbers like 7 and 8 sum to 15 so we write \\boxed{42}"]
    got = make_lm(tiny_bpe_dir, tiny_sp_dir, weights="3|1").loglikelihood_rolling(
        [rolling_request(t) for t in texts], disable_tqdm=True
    )
    for text, score in zip(texts, got, strict=True):
        per_member = [_rolling_token_logprobs(m, t, text) for m, t in refs]
        total = len(text.encode())
        cuts = sorted((set(per_member[0][1]) & set(per_member[1][1])) - {0} | {total})
        expected, start = 0.0, 0
        for stop in cuts:
            seg = [
                sum(
                    v
                    for v, e in zip(values, ends, strict=True)
                    if start < e <= stop or (start == 0 and e <= 0)
                )
                for values, ends in per_member
            ]
            expected += math.log(0.75 * math.exp(seg[0]) + 0.25 * math.exp(seg[1]))
            start = stop
        assert score == pytest.approx(expected, abs=1e-4), text


def _count_forwards(member) -> list[int]:
    calls = [0]
    original = member.engine.model.forward

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    member.engine.model.forward = counted
    return calls


@pytest.mark.parametrize("batch_size", [1, 2])
def test_shared_context_runs_once(tiny_bpe_dir: Path, tiny_sp_dir: Path, batch_size: int) -> None:
    """Two contexts x four choices: per member, one context pass per batch of contexts plus one
    pass for the choices' tokens; never a forward per request."""
    lm = make_lm(tiny_bpe_dir, tiny_sp_dir, batch_size=batch_size)
    counters = [_count_forwards(m) for m in lm.members]
    seen: list[int] = []
    for member in lm.members:
        forward = member.engine.model.forward

        def spy(*args, _forward=forward, **kwargs):
            seen.append(int(kwargs["input_ids"].shape[1]))
            return _forward(*args, **kwargs)

        member.engine.model.forward = spy
    lm.loglikelihood([ll_request(c, x) for c, x in MC], disable_tqdm=True)
    n_batches = 2 // batch_size
    for calls in counters:
        assert calls[0] == 2 * n_batches < len(MC)
    # the context is fed once per batch; the choices' pass only holds choice tokens
    long_ctx = max(len(m.encode(MC[0][0])) for m in lm.members)
    assert sum(1 for n in seen if n >= long_ctx - 1) <= 2 * n_batches


def test_is_greedy_rule_uses_safes_consensus() -> None:
    """Two members, one segment: the drafter's tokens are its argmax; the verifier's are not.
    Rule (a) fails, so it is greedy only when rule (b) (mean own-token probability > 0.5) holds."""
    from lm_eval_safe.scoring.loglikelihood import MemberScore, combine, greedy_rule

    text = b" abc"
    drafter = MemberScore([math.log(0.9), math.log(0.95)], [True, True], [2, 4])
    confident = MemberScore([math.log(0.4)], [False], [4])
    unsure = MemberScore([math.log(0.05)], [False], [4])
    rule = greedy_rule([1.0, 1.0], 0)
    assert combine([drafter, confident], [1.0, 1.0], "mean", text, 0, rule)[1] is True
    assert combine([drafter, unsure], [1.0, 1.0], "mean", text, 0, rule)[1] is False
    # without the consensus rule: every member's first token must be its argmax
    assert combine([drafter, confident], [1.0, 1.0], "mean", text, 0)[1] is False
    # the drafter alone: its own argmax decides
    solo = greedy_rule([1.0, 1.0], 0, schedule="drafter")
    assert combine([drafter, unsure], [1.0, 1.0], "mean", text, 0, solo)[1] is True
    not_drafted = MemberScore([math.log(0.9), math.log(0.3)], [True, False], [2, 4])
    assert combine([not_drafted, confident], [1.0, 1.0], "mean", text, 0, rule)[1] is False
    score, _ = combine([drafter, confident], [1.0, 1.0], "logmean", text)
    assert score == pytest.approx(0.5 * (math.log(0.9 * 0.95) + math.log(0.4)))


ARC = [
    ("What do plants need to make food?", ["sunlight", "sand", "salt", "snow"], 0),
    ("Which is a mammal?", ["shark", "dog", "frog", "eagle"], 1),
    ("What melts ice fastest?", ["cold air", "shade", "heat", "wind"], 2),
    ("What is 12 + 3?", ["9", "45", "12", "15"], 3),
    ("Which planet do we live on?", ["Earth", "Mars", "Venus", "Jupiter"], 0),
]


def test_simple_evaluate_multiple_choice_and_perplexity(
    tiny_bpe_dir: Path, tiny_sp_dir: Path, tmp_path: Path
) -> None:
    import json

    import lm_eval
    from lm_eval.tasks import TaskManager

    data = tmp_path / "arc_tiny.jsonl"
    data.write_text(
        "".join(
            json.dumps({"question": q, "choices": c, "answer": a, "text": f"{q} {c[a]}."}) + "\n"
            for q, c, a in ARC
        )
    )
    common = (
        f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
    )
    (tmp_path / "mc.yaml").write_text(
        "task: safe_tiny_mc\n" + common + "output_type: multiple_choice\n"
        'doc_to_text: "Question: {{question}}\\nAnswer:"\n'
        'doc_to_choice: "{{choices}}"\n'
        "doc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n"
    )
    (tmp_path / "ppl.yaml").write_text(
        "task: safe_tiny_ppl\n" + common + "output_type: loglikelihood_rolling\n"
        'doc_to_text: ""\ndoc_to_target: "{{text}}"\n'
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n"
    )
    out = lm_eval.simple_evaluate(
        model="safe-ensemble",
        model_args=f"members={tiny_bpe_dir},{tiny_sp_dir},batch_size=4",
        tasks=["safe_tiny_mc", "safe_tiny_ppl"],
        task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=True,
    )
    acc = out["results"]["safe_tiny_mc"]["acc,none"]
    assert 0.0 <= acc <= 1.0
    assert out["results"]["safe_tiny_ppl"]["word_perplexity,none"] > 1.0
    lm = make_lm(tiny_bpe_dir, tiny_sp_dir)
    samples = out["samples"]["safe_tiny_mc"]
    assert len(samples) == len(ARC)
    for sample in samples:
        q, choices = sample["doc"]["question"], sample["doc"]["choices"]
        direct = lm.loglikelihood(
            [ll_request(f"Question: {q}\nAnswer:", f" {c}") for c in choices], disable_tqdm=True
        )
        logged = [float(r[0][0]) for r in sample["resps"]]
        assert logged == pytest.approx([v for v, _ in direct], abs=1e-4)
    ppl = out["samples"]["safe_tiny_ppl"]
    direct_ppl = lm.loglikelihood_rolling(
        [rolling_request(s["doc"]["text"]) for s in ppl], disable_tqdm=True
    )
    assert [float(s["resps"][0][0]) for s in ppl] == pytest.approx(direct_ppl, abs=1e-4)


def test_bad_input_fails_in_one_line(tiny_bpe_dir: Path) -> None:
    lm = make_lm(tiny_bpe_dir, max_length=8)
    with pytest.raises(ValueError, match="empty continuation") as info:
        lm.loglikelihood([ll_request("The cat", "")], disable_tqdm=True)
    assert "\n" not in str(info.value)
    long = " the cat sat on the mat and then the dogs ran over 3 hills"
    with pytest.raises(ValueError, match=r"longer than .* window \(8\)") as info:
        lm.loglikelihood(
            [ll_request("The cat", " sat"), ll_request("The cat", long)], disable_tqdm=True
        )
    assert "\n" not in str(info.value) and "The cat" in str(info.value)
    # an empty context conditions on the prefix token; an empty text scores 0
    assert lm.loglikelihood([ll_request("", "the cat")], disable_tqdm=True)[0][0] < 0
    assert make_lm(tiny_bpe_dir).loglikelihood_rolling(
        [rolling_request("")], disable_tqdm=True
    ) == [0.0]
