"""``lm-eval-safe serve`` with members on vLLM (``engine=vllm``): concurrent clients, streamed and
whole, get the texts the same members write alone on the transformers engine (the two engines
write identical texts: tests/engines/vllm_engine/test_vllm_engine.py). Tiny members with a head size vLLM's CPU
kernels accept."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from helpers import gen_request, make_lm, random_prompts
from serve_helpers import ServerProcess, get, post, stream_pieces

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("vllm_installed")]
pytest.importorskip("fastapi")

VLLM_ARGS = "enforce_eager=true,kv_cache_memory_bytes=16777216"  # small caches: CI runs many engines at once


def test_vllm_members_behind_the_server(tiny_bpe_vllm_dir: Path, tiny_sp_vllm_dir: Path, tmp_path: Path) -> None:
    reference = make_lm(tiny_bpe_vllm_dir, tiny_sp_vllm_dir)  # the transformers engine

    def alone(prompt: str, budget: int) -> str:
        return reference.generate_until([gen_request(prompt, max_gen_toks=budget)], disable_tqdm=True)[0]

    prompts = random_prompts(6, seed=17)
    budgets = [8 + 5 * i for i in range(6)]
    args = f"members={tiny_bpe_vllm_dir},{tiny_sp_vllm_dir},engine=vllm,batch_size=4,{VLLM_ARGS}"
    with ServerProcess(args, log_dir=tmp_path) as server:

        def ask(i: int) -> Any:
            return post(server.url + "/v1/completions", {"prompt": prompts[i], "max_tokens": budgets[i], "temperature": 0})

        with ThreadPoolExecutor(6) as pool:
            replies = list(pool.map(ask, range(6)))
        assert [status for status, _ in replies] == [200] * 6, json.dumps(replies)[:500]
        assert [body["choices"][0]["text"] for _, body in replies] == [alone(p, b) for p, b in zip(prompts, budgets, strict=True)]
        pieces, _ = stream_pieces(server, "/v1/completions", {"prompt": prompts[0], "max_tokens": 20, "temperature": 0})
        assert "".join(pieces) == alone(prompts[0], 20)
        models = json.loads(get(server.url + "/v1/models")[1])
        assert models["data"][0]["members"] == [tiny_bpe_vllm_dir.name, tiny_sp_vllm_dir.name]


def test_rows_leave_a_vllm_request_slot_free(tiny_bpe_vllm_dir: Path, tiny_sp_vllm_dir: Path, tmp_path: Path) -> None:
    """``max_batch_size=4`` gives vLLM members 4 request slots: the server decodes 3 rows at once
    (a row's session holds a slot; one stays free for one-off requests), and a fourth client
    waits for a row instead of stalling the engines."""
    reference = make_lm(tiny_bpe_vllm_dir, tiny_sp_vllm_dir)
    prompts = random_prompts(4, seed=19)
    args = f"members={tiny_bpe_vllm_dir},{tiny_sp_vllm_dir},engine=vllm,max_batch_size=4,{VLLM_ARGS}"
    with ServerProcess(args, log_dir=tmp_path) as server:
        models = json.loads(get(server.url + "/v1/models")[1])
        assert models["data"][0]["max_num_seqs"] == 3

        def ask(prompt: str) -> Any:
            return post(server.url + "/v1/completions", {"prompt": prompt, "max_tokens": 16, "temperature": 0})

        with ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(ask, prompts))
    want = reference.generate_until([gen_request(p, max_gen_toks=16) for p in prompts], disable_tqdm=True)
    assert [body["choices"][0]["text"] for _, body in replies] == want
