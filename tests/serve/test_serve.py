"""``lm-eval-safe serve`` as a real process on a free port, driven by real clients (the ``openai``
package, lm-eval's own API models, plain HTTP).

The reference for every text is the backend itself in this process (``--model safe-ensemble``'s
``generate_until``, one request at a time), which the rest of the suite checks against
transformers' own decoding. The members run in float64, so that the batch a request lands in
cannot change its text through rounding (tests/decoder/test_batch_driver.py)."""

from __future__ import annotations

import http.client
import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from helpers import gen_request, make_lm, random_prompts, write_gsm8k
from serve_helpers import ServerProcess, get, metric, post, rss_kib, stream_pieces

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]


@pytest.fixture(scope="module")
def members(tiny_bpe_dir: Path, tiny_sp_dir: Path) -> str:
    return f"members={tiny_bpe_dir},{tiny_sp_dir},dtype=float64"


@pytest.fixture(scope="module")
def server(members: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    with ServerProcess(f"{members},batch_size=8", log_dir=tmp_path_factory.mktemp("serve")) as process:
        yield process


@pytest.fixture(scope="module")
def reference(tiny_bpe_dir: Path, tiny_sp_dir: Path) -> Any:
    """The backend, one request at a time."""
    return make_lm(tiny_bpe_dir, tiny_sp_dir, dtype="float64")


def alone(lm: Any, context: str, **gen_kwargs: Any) -> str:
    return lm.generate_until([gen_request(context, **gen_kwargs)], disable_tqdm=True)[0]


def client(server: Any, key: str = "none") -> Any:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def test_completions_equal_the_backend(server: Any, reference: Any) -> None:
    """Greedy completions through the openai client are byte for byte the backend's; a list of
    prompts gives one choice per prompt, in order; usage and the ``safe`` field are filled."""
    prompts = random_prompts(4, seed=5)
    openai_client = client(server)
    for prompt in prompts[:2]:
        out = openai_client.completions.create(
            model="safe-ensemble", prompt=prompt, max_tokens=20, temperature=0, stop=["cat"]
        )
        assert out.choices[0].text == alone(reference, prompt, until=["cat"], max_gen_toks=20)
        assert out.usage.completion_tokens <= 20
        safe = out.model_dump()["safe"]
        assert safe["generated_tokens"] == out.usage.completion_tokens
        assert safe["drafted_tokens"] >= safe["accepted_tokens"]
    many = openai_client.completions.create(model="safe-ensemble", prompt=prompts, max_tokens=12, temperature=0)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert [c.text for c in many.choices] == [alone(reference, p, max_gen_toks=12) for p in prompts]
    echoed = openai_client.completions.create(model="safe-ensemble", prompt=prompts[0], max_tokens=5, temperature=0, echo=True)
    assert echoed.choices[0].text == prompts[0] + alone(reference, prompts[0], max_gen_toks=5)


def test_chat_equals_the_backend_with_chat_template(server: Any, reference: Any) -> None:
    """A chat request is what ``--apply_chat_template`` sends the backend: each member renders
    the messages with its own template (or gets them as plain text without one)."""
    messages = [
        {"role": "system", "content": "You count apples."},
        {"role": "user", "content": "Tom has 3 apples and buys 4 more. How many now?"},
    ]
    out = client(server).chat.completions.create(
        model="safe-ensemble", messages=messages, max_tokens=16, temperature=0
    )
    context = reference.apply_chat_template(messages)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == alone(reference, context, max_gen_toks=16)
    assert out.choices[0].finish_reason in ("stop", "length")


def test_streamed_pieces_make_the_whole_text(server: Any, reference: Any) -> None:
    """Streaming sends only settled text: the pieces concatenate to the non-streamed text,
    stop strings included (a stop taken from the middle of the text cuts it there, and no
    piece ever ran past it), for completions and chat."""
    for prompt in random_prompts(4, seed=9):
        whole = alone(reference, prompt, max_gen_toks=24)
        stop = whole[len(whole) // 2 : len(whole) // 2 + 3]
        for until in ([], [stop] if stop.strip() else []):
            expected = alone(reference, prompt, until=until, max_gen_toks=24)
            pieces, events = stream_pieces(server, "/v1/completions", {"prompt": prompt, "max_tokens": 24, "temperature": 0, "stop": until})
            assert "".join(pieces) == expected
            assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length")
            assert "safe" in events[-1]
    messages = [{"role": "user", "content": "Name three colours."}]
    pieces, events = stream_pieces(
        server, "/v1/chat/completions",
        {"messages": messages, "max_tokens": 20, "temperature": 0, "stream_options": {"include_usage": True}},
    )  # fmt: skip
    assert "".join(pieces) == alone(reference, reference.apply_chat_template(messages), max_gen_toks=20)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] <= 20


def test_sampling_is_seeded_like_the_backend(server: Any, tiny_bpe_dir: Path, tiny_sp_dir: Path) -> None:
    """A sampled request with ``seed`` gives the same text every time, and the text the backend
    gives the same request under ``seed=`` of the same value."""
    prompt = "the cat sat on"
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 0.9, "top_p": 0.95, "seed": 77}
    first = post(server.url + "/v1/completions", body)[1]["choices"][0]["text"]
    again = post(server.url + "/v1/completions", body)[1]["choices"][0]["text"]
    other = post(server.url + "/v1/completions", {**body, "seed": 78})[1]["choices"][0]["text"]
    seeded = make_lm(tiny_bpe_dir, tiny_sp_dir, dtype="float64", seed=77)
    direct = alone(seeded, prompt, until=[], max_gen_toks=16, do_sample=True, temperature=0.9, top_p=0.95)
    assert first == again == direct
    assert other != first


def test_logprobs_are_the_ensembles_scores_of_the_pieces(server: Any, reference: Any) -> None:
    """``logprobs``: the text cut at the members' common token boundaries, each piece with the
    ensemble's log-probability; they add up to the backend's ``loglikelihood`` of the text
    (which tests/scoring/test_loglikelihood.py checks against lm-eval's ``hf``), ``echo`` prepends the
    prompt's pieces, and a chat response carries them as ``content`` entries."""
    from helpers import ll_request

    for prompt in ("the cat sat on a mat", "while Anna counted 45 apples "):
        body = post(server.url + "/v1/completions", {"prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 0})[1]
        text, logprobs = body["choices"][0]["text"], body["choices"][0]["logprobs"]
        assert "".join(logprobs["tokens"]) == text and len(logprobs["tokens"]) > 1
        assert logprobs["text_offset"][1] == len(logprobs["tokens"][0])
        (expected, _), = reference.loglikelihood([ll_request(prompt, text)], disable_tqdm=True)
        assert sum(logprobs["token_logprobs"]) == pytest.approx(expected, abs=1e-9)
        echoed = post(server.url + "/v1/completions", {"prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 0, "echo": True})[1]
        pieces = echoed["choices"][0]["logprobs"]["tokens"]
        assert "".join(pieces) == prompt + text == echoed["choices"][0]["text"]
    messages = [{"role": "user", "content": "Count to three."}]
    chat = post(server.url + "/v1/chat/completions", {"messages": messages, "max_tokens": 10, "temperature": 0, "logprobs": True})[1]
    content = chat["choices"][0]["logprobs"]["content"]
    assert "".join(c["token"] for c in content) == chat["choices"][0]["message"]["content"]
    (expected, _), = reference.loglikelihood(
        [ll_request(reference.apply_chat_template(messages), chat["choices"][0]["message"]["content"])], disable_tqdm=True
    )
    assert sum(c["logprob"] for c in content) == pytest.approx(expected, abs=1e-9)


# -- batching -------------------------------------------------------------------------------
def test_concurrent_clients_share_one_batch(server: Any, reference: Any) -> None:
    """64 clients at once, budgets of different lengths (rows leave and join mid-run): every
    response equals the same request alone, none lost or mixed, and the requests were decoded
    together (the batch held several rows)."""
    before = get(server.url + "/metrics")[1]
    prompts = random_prompts(64, seed=21)
    budgets = [6 + (i * 7) % 19 for i in range(64)]

    def ask(i: int) -> str:
        status, body = post(server.url + "/v1/completions", {"prompt": prompts[i], "max_tokens": budgets[i], "temperature": 0})
        assert status == 200, body
        return body["choices"][0]["text"]

    with ThreadPoolExecutor(64) as pool:
        served = list(pool.map(ask, range(64)))
    expected = [alone(reference, p, max_gen_toks=b) for p, b in zip(prompts, budgets, strict=True)]
    assert served == expected
    after = get(server.url + "/metrics")[1]
    rows_seen = metric(after, "lm_eval_safe:batch_rows_sum") - metric(before, "lm_eval_safe:batch_rows_sum")
    cycles = metric(after, "lm_eval_safe:batch_rows_count") - metric(before, "lm_eval_safe:batch_rows_count")
    assert rows_seen / cycles > 2.0
    assert metric(after, "lm_eval_safe:num_requests_running") == 0


def test_a_client_that_leaves_mid_stream_leaves_the_batch(server: Any, reference: Any) -> None:
    """A streaming client that disconnects: its request is cancelled (``abort``), the batch
    goes on without it, and the others' texts are those they get alone; so is a request whose
    client leaves before its whole response is ready."""
    before = get(server.url + "/metrics")[1]
    prompts = random_prompts(3, seed=33)
    results: dict[int, str] = {}

    def ask(i: int) -> None:
        results[i] = post(server.url + "/v1/completions", {"prompt": prompts[i], "max_tokens": 40, "temperature": 0})[1]["choices"][0]["text"]

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = {"prompt": "the cat sat on a mat", "max_tokens": 400, "temperature": 0, "stream": True, "stop": []}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    for thread in threads:
        thread.start()
    reply = conn.getresponse()
    assert reply.status == 200
    assert reply.readline().startswith(b"data: ")
    conn.sock.close()
    conn.close()
    for thread in threads:
        thread.join()
    assert [results[i] for i in range(3)] == [alone(reference, p, max_gen_toks=40) for p in prompts]
    # a client waiting for a whole (non-streamed) response that goes away is cancelled too. The
    # tiny members meet EOS within a few dozen tokens, so the request may be over before its
    # client leaves: then it ended as a success, and no request is ever lost either way
    long_prompt = max(random_prompts(12, seed=35), key=lambda p: len(alone(reference, p, until=[], max_gen_toks=450)))
    plain = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = {"prompt": long_prompt, "max_tokens": 450, "temperature": 0, "stop": []}
    plain.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})

    def count(text: str, reason: str) -> float:
        return metric(text, "lm_eval_safe:request_success_total", finished_reason=reason) - metric(
            before, "lm_eval_safe:request_success_total", finished_reason=reason
        )

    def ended(text: str) -> float:
        return count(text, "abort") + count(text, "stop") + count(text, "length")

    _wait_for(server, lambda text: metric(text, "lm_eval_safe:num_requests_running") == 1 or ended(text) == 5)
    plain.sock.close()
    plain.close()

    def settled(text: str) -> bool:  # the 3 clients, the stream, and the plain request
        return ended(text) == 5 and metric(text, "lm_eval_safe:num_requests_running") == 0

    _wait_for(server, settled)
    after = get(server.url + "/metrics")[1]
    assert count(after, "abort") >= 1  # the stream at least


def _wait_for(server: Any, condition: Any, seconds: float = 30.0) -> None:
    """Poll ``/metrics`` until ``condition(text)`` holds (an assertion error after ``seconds``)."""
    deadline = time.monotonic() + seconds
    while not condition(get(server.url + "/metrics")[1]):
        assert time.monotonic() < deadline, "the metrics never showed it"
        time.sleep(0.05)


# -- security -------------------------------------------------------------------------------
def test_api_key_and_body_limit(members: str, tmp_path: Path, reference: Any) -> None:
    """With a key, /v1 routes answer 401 without it or with a wrong one (and the right one
    works through the openai client); probes stay open; a body over the limit is a 413; the
    server binds 127.0.0.1 and does not log prompts unless asked."""
    key = "s3cret-key"
    with ServerProcess(members, "--max-request-bytes", "2048", log_dir=tmp_path, env={"LM_EVAL_SAFE_API_KEY": key}) as server:
        body = {"prompt": "the secret prompt text", "max_tokens": 4, "temperature": 0}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key}):
            code, answer = post(server.url + "/v1/completions", body, headers)
            assert code == 401 and answer["error"]["code"] == "invalid_api_key"
        assert post(server.url + "/v1/models", {}, {})[0] in (401, 405)
        out = client(server, key).completions.create(model="safe-ensemble", **body)
        assert out.choices[0].text == alone(reference, body["prompt"], max_gen_toks=4)
        assert get(server.url + "/health")[0] == 200 and get(server.url + "/metrics")[0] == 200
        code, answer = post(server.url + "/v1/completions", {"prompt": "x" * 5000}, {"Authorization": f"Bearer {key}"})
        assert code == 413 and "--max-request-bytes" in answer["error"]["message"]
        assert "127.0.0.1" in server.log
    assert "the secret prompt text" not in server.log


def test_sigterm_finishes_in_flight_requests_and_exits_0(members: str, tmp_path: Path, reference: Any) -> None:
    """SIGTERM while a stream is under way: the stream runs to its end (the text it gets alone),
    the server exits 0, and it takes no new connection."""
    budget = 300
    for prompt in random_prompts(20, seed=13):  # one the members never end early
        expected = alone(reference, prompt, max_gen_toks=budget)
        if reference.request_stats[-1]["generated_tokens"] == budget:
            break
    server = ServerProcess(members, log_dir=tmp_path).wait_ready()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
        body = {"prompt": prompt, "max_tokens": budget, "temperature": 0, "stream": True}
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        reply = conn.getresponse()
        first = reply.readline()
        assert first.startswith(b"data: ")
        server.proc.send_signal(signal.SIGTERM)
        lines = [first.decode(), *reply.read().decode().splitlines()]
    finally:
        code = server.stop()
    assert code == 0
    events = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events) == expected
    assert lines[-1] == "data: [DONE]" or "data: [DONE]" in lines
    with pytest.raises(OSError):
        post(server.url + "/v1/completions", {"prompt": prompt})


# -- metrics and memory ---------------------------------------------------------------------
def test_metrics_count_what_the_responses_say(server: Any) -> None:
    before = get(server.url + "/metrics")[1]
    totals = {"completion_tokens": 0, "ensemble_ops": 0, "drafted_tokens": 0, "prompt_tokens": 0}
    for prompt in random_prompts(5, seed=41):
        body = post(server.url + "/v1/completions", {"prompt": prompt, "max_tokens": 10, "temperature": 0})[1]
        totals["completion_tokens"] += body["usage"]["completion_tokens"]
        totals["prompt_tokens"] += body["usage"]["prompt_tokens"]
        totals["ensemble_ops"] += body["safe"]["ensemble_ops"]
        totals["drafted_tokens"] += body["safe"]["drafted_tokens"]
    after = get(server.url + "/metrics")[1]

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("lm_eval_safe:generation_tokens_total") == totals["completion_tokens"]
    assert delta("lm_eval_safe:prompt_tokens_total") == totals["prompt_tokens"]
    assert delta("lm_eval_safe:ensemble_ops_total") == totals["ensemble_ops"]
    assert delta("lm_eval_safe:drafted_tokens_total") == totals["drafted_tokens"]
    assert delta("lm_eval_safe:request_success_total") == 5
    assert delta("lm_eval_safe:e2e_request_latency_seconds_count") == 5
    assert delta("lm_eval_safe:http_requests_total", route="/v1/completions", status="200") == 5
    ops, tokens = metric(after, "lm_eval_safe:ensemble_ops_total"), metric(after, "lm_eval_safe:generation_tokens_total")
    assert metric(after, "lm_eval_safe:ensemble_rate_percent") == pytest.approx(100 * ops / tokens)


def test_memory_stays_flat_over_1000_requests(server: Any) -> None:
    prompts = random_prompts(50, seed=3)

    def ask(i: int) -> None:
        status, _ = post(server.url + "/v1/completions", {"prompt": prompts[i % 50], "max_tokens": 3, "temperature": 0})
        assert status == 200

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(ask, range(200)))
        warm = rss_kib(server.proc.pid)
        list(pool.map(ask, range(200, 1000)))
    grown = rss_kib(server.proc.pid) - warm
    assert grown < 16 * 1024, f"RSS grew by {grown} KiB over 800 requests"


# -- lm-eval's own API models as clients ----------------------------------------------------
@pytest.mark.parametrize("api_model", ["local-completions", "local-chat-completions"])
def test_lm_eval_api_models_get_the_backends_answers(server: Any, members: str, api_model: str, tmp_path: Path) -> None:
    """lm-eval's ``local-completions`` / ``local-chat-completions`` against the server give the
    samples and metrics of ``--model safe-ensemble`` run directly on the same task."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    import lm_eval_safe

    rows = [{"question": f"Tom has {i} apples and buys {i + 2} more. How many now?", "answer": f"x\n#### {2 * i + 2}"} for i in range(3)]
    data = write_gsm8k(tmp_path, rows)
    chat = api_model == "local-chat-completions"
    endpoint = "chat/completions" if chat else "completions"
    common = {
        "tasks": ["safe_gsm8k"],
        "gen_kwargs": "max_gen_toks=12",
        "apply_chat_template": chat,
        "log_samples": True,
    }

    def run(model: str, model_args: str) -> dict:
        manager = TaskManager(include_path=lm_eval_safe.task_dir(), metadata={"data_dir": str(data)})
        return lm_eval.simple_evaluate(model=model, model_args=model_args, task_manager=manager, **common)

    served = run(api_model, f"model=safe-ensemble,base_url={server.url}/v1/{endpoint},tokenizer_backend=none,tokenized_requests=False")
    direct = run("safe-ensemble", members)

    def responses(results: dict) -> list[str]:
        return [s["resps"][0][0] for s in sorted(results["samples"]["safe_gsm8k"], key=lambda s: s["doc_id"])]

    assert responses(served) == responses(direct)
    assert served["results"]["safe_gsm8k"] == direct["results"]["safe_gsm8k"]
