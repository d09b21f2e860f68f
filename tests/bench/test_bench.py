"""The benchmark pieces of ``lm_eval_safe.bench`` on the tiny in-process members.

Why: the benchmark scripts run only on real members, by hand, so nothing else would notice a
break in what they share -- prompts, EOS masking, the timed methods (the draft-then-verify
floor among them) and the report over their runs. Tiny models give meaningless speeds; the
checks are about structure: every method runs to its token budget with EOS masked, the floor
recomputes verifier positions, and the table has a row per method.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

from lm_eval_safe.answer_checking import MATH_PROMPT_SUFFIX
from lm_eval_safe.bench.eos import mask_eos
from lm_eval_safe.bench.output import fmt
from lm_eval_safe.bench.prompts import load_prompts
from lm_eval_safe.bench.speed import METHODS, make_decoder, run_method, time_methods, time_union
from lm_eval_safe.bench.speed_report import markdown, ratios, summarise
from lm_eval_safe.engines import load_member

QUESTIONS = [
    {"question": "What is 2 plus 3?", "answer": "2+3=5\n#### 5"},
    {"question": "What is 4 times 2?", "answer": "4*2=8\n#### 8"},
    {"question": "What is 10 minus 7?", "answer": "10-7=3\n#### 3"},
]


def test_prompts_are_the_papers_math_prompt_few_shot_or_cycled(tmp_path: Path) -> None:
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "test.jsonl").write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    assert load_prompts(tmp_path, "gsm8k", 2) == [
        "What is 2 plus 3?" + MATH_PROMPT_SUFFIX,
        "What is 4 times 2?" + MATH_PROMPT_SUFFIX,
    ]
    assert len(load_prompts(tmp_path, "gsm8k", 5, cycle=True)) == 5
    shot = load_prompts(tmp_path, "gsm8k", 1, shots=1)[0]
    assert shot == (
        "Question: What is 10 minus 7?\nAnswer: 10-7=3\n#### 3\n\n"
        "Question: What is 2 plus 3?\nAnswer:"
    )
    with pytest.raises(SystemExit, match="no data file"):
        load_prompts(tmp_path, "math500", 1)
    assert (fmt(None), fmt(1.23456), fmt(2.0, 0), fmt(7)) == ("-", "1.23", "2", "7")


def test_every_speed_method_runs_to_its_budget_with_eos_masked(
    tiny_bpe_dir: Path, tiny_sp_dir: Path
) -> None:
    specs = [str(tiny_bpe_dir), str(tiny_sp_dir)]
    members = [
        load_member(spec, index=i, device="cpu", fast_small_linear="off", prefix_cache_mb=0)
        for i, spec in enumerate(specs)
    ]
    mask_eos(members)
    base = {"members": specs, "drafter": "0", "draft_len": 2}
    methods = ["hf_generate", "drafter", "safe_unite", "safe_gac", "every", "floor"]
    decoders = {"_base": make_decoder(members, 0, base, {})}
    for method in methods:
        if METHODS[method] is not None:
            decoders[method] = make_decoder(members, 0, base, METHODS[method])
    max_new = 6
    runs = time_methods(methods, decoders, members, ["the cat sat on"], max_new, repeats=1)
    assert [r.method for r in runs] == methods
    assert all(r.tokens == max_new for r in runs), [(r.method, r.tokens) for r in runs]
    floor = next(r for r in runs if r.method == "floor")
    assert floor.verifier_positions > 0 and floor.generate_seconds is not None
    # the drafter through the decoder is transformers' own greedy decoding
    assert next(r for r in runs if r.method == "drafter").text == runs[0].text
    assert run_method("every", decoders, members, "a mat", 3).ensemble_ops == 3

    report = {
        "config": {
            "members": ",".join(specs),
            "drafter": members[0].name,
            "dataset": "gsm8k",
            "prompts": 1,
            "repeats": 1,
            "max_new_tokens": max_new,
            "draft_len": 2,
            "device": "cpu",
            "torch_threads": 1,
            "ignore_eos": True,
        },
        "methods": summarise(runs, methods),
        "ratios": ratios(runs, methods),
        "union_vocabulary": time_union(members, 0),
        "load_seconds": 0.0,
    }
    table = markdown(report)
    for method in methods:
        assert f"| {method} | {max_new} |" in table
    assert "| safe_unite/floor |" in table and "WARNING" not in table


def test_the_speed_table_names_each_engines_own_settings() -> None:
    """The table's heading says the members' engine and the settings of that engine only (the
    transformers engine's fast_small_linear is no setting of llama.cpp's or vLLM's); a report
    naming no engine was a transformers run."""
    base = {"members": "a,b", "drafter": "a", "dataset": "gsm8k", "prompts": 1, "repeats": 1, "max_new_tokens": 4,
            "draft_len": 2, "device": "cpu", "torch_threads": 2, "ignore_eos": False}  # fmt: skip
    union = {"union_size": 1, "token_vocab_tables_s": 0.0, "union_uncached_s": 0.0, "union_cache_write_s": 0.0, "union_cache_load_s": 0.0}

    def heading(**config: object) -> str:
        report = {"config": {**base, **config}, "methods": {}, "ratios": [], "union_vocabulary": union, "load_seconds": 0.0}
        return markdown(report).splitlines()[0]

    llama = {"n_threads": 0, "n_ctx": 4096, "n_batch": 128, "n_seq_max": 8, "n_gpu_layers": 0, "flash_attn": "auto",
             "use_extra_bufts": False, "batch_rows": False}  # fmt: skip
    assert heading(engine="llama_cpp", **llama).endswith(
        "shots=0, engine=llama_cpp (n_threads=0, n_ctx=4096, n_batch=128, n_seq_max=8, n_gpu_layers=0, "
        "flash_attn=auto, use_extra_bufts=False, batch_rows=False)"
    )
    assert heading(engine="hf", fast_small_linear="auto", prefix_cache_mb=0.0).endswith(
        "shots=0, engine=hf (fast_small_linear=auto, prefix_cache_mb=0.0)"
    )
    assert heading(engine="vllm").endswith("shots=0, engine=vllm")
    assert heading(fast_small_linear="on").endswith("shots=0, engine=hf (fast_small_linear=on)")
    for other in ("llama_cpp", "vllm"):
        assert "fast_small_linear" not in heading(engine=other, fast_small_linear="auto")


def test_bench_speed_script_end_to_end(tiny_bpe_dir: Path, tiny_sp_dir: Path, tmp_path: Path) -> None:
    """The command line itself (warm-up, the union built outside the timed loop, the report)."""
    from helpers import write_gsm8k

    from lm_eval_safe.bench.commands import speed as script

    data = write_gsm8k(tmp_path, QUESTIONS)
    out = tmp_path / "speed.json"
    argv = [
        "--members", f"{tiny_bpe_dir},{tiny_sp_dir}", "--data-dir", str(data), "--prompts", "2",
        "--max-new-tokens", "4", "--ignore-eos", "--device", "cpu",
        "--methods", "hf_generate,drafter,safe_gac,safe_unite,safe_unite_overlap,floor", "--json", str(out),
        "--engine-args", "fast_small_linear=off",
    ]
    assert script.main(argv) == 0
    report = json.loads(out.read_text())
    config = report["config"]  # the engine's settings, checked by its spec, the store off by default
    assert (config["engine"], config["fast_small_linear"], config["prefix_cache_mb"]) == ("hf", "off", 0.0)
    assert set(report["methods"]) == {"hf_generate", "drafter", "safe_gac", "safe_unite", "safe_unite_overlap", "floor"}
    assert report["methods"]["safe_gac"]["tokens"] == 2 * 4
    # the latency model: measured inputs, and each decoder run priced from its own cycles
    assert all(v["five_rows"] > 0 and v["one_row"] > 0 for v in report["forward_latency"].values())
    modelled = {r["ratio"]: r for r in report["modelled"]}
    assert set(modelled) == {"safe_unite/drafter", "safe_gac/drafter"}
    for row in modelled.values():
        assert row["modelled_in_turn"] >= row["modelled_overlapped"] > 0
        assert row["depth_per_token"] >= row["depth_per_token_overlapped"] >= 1.0
    drafter_runs = [r for r in report["runs"] if r["method"] == "drafter"]
    latency = report["forward_latency"][Path(tiny_bpe_dir).name]["one_row"]
    for r in drafter_runs:  # the drafter alone: one drafter forward per token, nothing else
        assert r["modelled_seconds"] == pytest.approx(r["extra"]["drafter_forwards"] * latency)


def test_a_benchmark_refuses_a_member_whose_engine_has_no_instruments() -> None:
    """A benchmark reaches a model only through its engine's instruments; an engine whose models
    it cannot hook (vLLM's run in the engine's own process) is refused in one line."""
    from types import SimpleNamespace

    member = SimpleNamespace(name="remote", engine=SimpleNamespace(kind="vllm"))
    with pytest.raises(RuntimeError, match="remote: the vllm engine has no benchmark instruments"):
        mask_eos([member])


def test_an_engines_instruments_are_checked_against_the_protocol(monkeypatch: pytest.MonkeyPatch) -> None:
    """The transformers engine's instruments have every name of the protocol the benchmarks
    read; an engine whose instruments lack some is refused naming them, before any is used."""
    from types import SimpleNamespace

    from lm_eval_safe import engines
    from lm_eval_safe.engines.spec import missing_instruments

    member = SimpleNamespace(name="tiny", engine=SimpleNamespace(kind="hf"))
    tools = engines.instruments(member)
    assert missing_instruments(tools) == []
    partial = SimpleNamespace(**{name: getattr(tools, name) for name in ("mask_eos", "generate", "ForwardClock")})
    monkeypatch.setattr(type(engines.engine("hf")), "instruments", lambda self: partial)
    with pytest.raises(RuntimeError, match="the hf engine's benchmark instruments lack CACHE_MOVES, FunctionClock"):
        engines.instruments(member)
    with pytest.raises(RuntimeError, match="lack"):
        mask_eos([member])


def test_the_host_table_states_each_configuration_against_the_drafter_at_its_batch_size() -> None:
    """``bench host`` judges SAFE's own work by the drafter alone's in the same run: each row's
    host time and device ops over the drafter's at the same batch size (none without it)."""
    from lm_eval_safe.bench.commands.host import ratio_to_drafter

    rows = [
        {"configuration": "drafter", "batch_size": 1, "host_ms_per_token": 0.8, "device_ops_per_token": 10.0},
        {"configuration": "drafter", "batch_size": 8, "host_ms_per_token": 0.5, "device_ops_per_token": 2.0},
        {"configuration": "unite_safe", "batch_size": 8, "host_ms_per_token": 1.5, "device_ops_per_token": 5.0},
        {"configuration": "gac_safe", "batch_size": 4, "host_ms_per_token": 1.0, "device_ops_per_token": None},
    ]
    assert ratio_to_drafter(rows[2], rows, "host_ms_per_token") == "3.00x"
    assert ratio_to_drafter(rows[2], rows, "device_ops_per_token") == "2.50x"
    assert ratio_to_drafter(rows[1], rows, "host_ms_per_token") == "1.00x"
    assert ratio_to_drafter(rows[3], rows, "host_ms_per_token") == "-"  # no drafter at batch 4


def test_the_forwards_table_takes_the_device_op_ratio_apart() -> None:
    """Device ops per token over the drafter's is forwards per token over the drafter's times
    device ops per forward over the drafter's; rows per forward is the same configuration's
    batch-1 forwards over this run's, only where the texts are the same."""
    from lm_eval_safe.bench.commands.host import forwards_table, rows_per_forward

    def row(name: str, batch: int, forwards: dict[str, int], ops: int, tokens: int, texts: list[str]) -> dict:
        total = sum(forwards.values())
        return {
            "configuration": name, "batch_size": batch, "forwards": forwards, "texts": texts,
            "forwards_per_token": total / tokens, "device_ops_per_forward": ops / total,
            "device_ops_per_token": ops / tokens,
        }

    rows = [
        row("drafter", 1, {"d": 400}, 4000, 384, ["a"]),
        row("drafter", 8, {"d": 50}, 500, 384, ["a"]),
        row("unite_safe", 1, {"d": 440, "v": 140}, 6960, 360, ["b"]),
        row("unite_safe", 8, {"d": 96, "v": 24}, 1440, 360, ["b"]),
        row("gac_safe", 8, {"d": 90, "v": 20}, 1320, 384, ["c"]),
    ]
    assert rows_per_forward(rows[1], rows) == "8.00"
    assert rows_per_forward(rows[3], rows) == "4.83"  # 580 forwards alone, 120 at batch 8
    assert rows_per_forward(rows[4], rows) == "-"  # no batch-1 run of it
    rows[2]["texts"] = ["other"]
    assert rows_per_forward(rows[3], rows) == "-"  # another text: not the same requests' forwards
    table = forwards_table(rows).splitlines()
    # 120/360 forwards a token against 50/384: 2.56x; 12 ops a forward against 10: 1.20x;
    # 1440/360 ops a token against 500/384: 3.07x = 2.56 x 1.20
    assert table[5].split(" | ")[3:] == ["2.56x", "-", "12.00", "1.20x", "3.07x |"]


def test_the_packing_table_states_the_bound_against_the_drafter() -> None:
    """The bound's forwards per token over the drafter alone's at the same batch size, and the
    device ops it would leave: the bound times this run's ops per forward over the drafter's
    ops per token; batch-1 rows and the drafter's own are not replayed."""
    from lm_eval_safe.bench.commands.host import packing_table

    packing = {
        "drafts_per_token": 1.2, "lock_step_forwards_per_token": 0.34, "rows_apart_forwards_per_token": 0.33,
        "rows_apart_verify_at": 5, "bound_forwards_per_token": 0.27,
    }
    rows = [
        {"configuration": "drafter", "batch_size": 8, "forwards_per_token": 0.15, "device_ops_per_token": 1.5,
         "device_ops_per_forward": 10.0, "packing": packing},
        {"configuration": "unite_safe", "batch_size": 1, "forwards_per_token": 1.5, "device_ops_per_token": 16.0,
         "device_ops_per_forward": 11.0, "packing": packing},
        {"configuration": "unite_safe", "batch_size": 8, "forwards_per_token": 0.34, "device_ops_per_token": 4.1,
         "device_ops_per_forward": 12.0, "packing": packing},
    ]
    table = packing_table(rows).splitlines()
    assert len(table) == 3
    # 0.27 / 0.15 = 1.80x; 0.27 x 12 / 1.5 = 2.16x
    assert table[2].split(" | ")[2:] == ["1.200", "0.340", "0.340", "0.330 (5)", "0.270", "1.80x", "2.16x |"]


def test_the_host_profile_cuts_out_forwards_and_charges_the_innermost_frame_of_ours() -> None:
    """A sampled stack: time inside an ``nn.Module`` call is the forwards'; the rest goes to the
    part of the innermost frame of this package above it (torch's own frames included)."""
    from types import SimpleNamespace

    from lm_eval_safe.bench.host_profile import _charge

    def frame(function: str, path: str | None, own: float, *children: SimpleNamespace) -> SimpleNamespace:
        return SimpleNamespace(
            function=function, file_path=path, time=own + sum(c.time for c in children), children=list(children)
        )

    site = "/venv/site-packages/"
    tree = frame(
        "generate_many", "/x/lm_eval_safe/decoder/loop.py", 0.001,
        frame("run", "/x/lm_eval_safe/engines/hf/batch.py", 0.002,
              frame("_call_impl", site + "torch/nn/modules/module.py", 0.5,
                    frame("forward", site + "transformers/llama.py", 0.25)),
              frame("cut_heads", "/x/lm_eval_safe/engines/hf/heads.py", 0.003,
                    frame("log_softmax", None, 0.010))),
        frame("keep_rows", "/x/lm_eval_safe/engines/hf/cache_rows.py", 0.004,
              frame("_foreach_copy_", None, 0.020)),
    )  # fmt: skip
    seconds: defaultdict[str, float] = defaultdict(float)
    inside = _charge(tree, "other", seconds)
    assert inside == pytest.approx(0.75)
    assert seconds["heads: log-softmax, argmax, top-k, read-back"] == pytest.approx(0.013)
    assert seconds["KV moves (rows, splices, compaction, prefix store)"] == pytest.approx(0.024)
    assert seconds["forward inputs: ids, positions, masks"] == pytest.approx(0.002)
    assert seconds["decoder loop: text, stops, statistics"] == pytest.approx(0.001)
    assert sum(seconds.values()) == pytest.approx(0.040)


def test_bench_threads_runs_the_readme_main_job_as_a_user_types_it(tmp_path: Path) -> None:
    """Each setting runs the README's main job through ``python -m lm_eval`` with this package's
    tasks, the members in the README's order and the data folder given, smaller by ``--limit``
    and ``--max-gen-toks``."""
    import argparse
    import sys

    import lm_eval_safe
    from lm_eval_safe.bench.commands import threads

    parser = argparse.ArgumentParser()
    threads.configure(parser)
    args = parser.parse_args(["--data-dir", str(tmp_path), "--limit", "3", "--max-gen-toks", "64"])
    argv = threads.command(args, tmp_path / "out")
    assert argv[:3] == [sys.executable, "-m", "lm_eval"]
    options = {flag: argv[i + 1] for i, flag in enumerate(argv) if flag.startswith("--") and i + 1 < len(argv)}
    assert options["--model_args"] == "members=smollm2-135m,gemma3-270m"
    assert options["--include_path"] == str(lm_eval_safe.task_dir())
    assert json.loads(options["--metadata"]) == {"data_dir": str(tmp_path)}
    assert options["--limit"] == "3" and options["--gen_kwargs"] == "max_gen_toks=64"
    assert "--apply_chat_template" in argv and options["--tasks"] == "safe_gsm8k"
    assert set(threads.SETTINGS["one-thread"]) == {"OMP_NUM_THREADS"}


def test_bench_batch_splits_each_runs_time_into_the_members_engines_and_the_rest(
    tiny_bpe_dir: Path, tiny_sp_dir: Path
) -> None:
    """The ensemble's batching gain is read part by part: each member's engine seconds (its
    engine's own clock) and the host rest add up to the run's wall time, at every batch size."""
    from lm_eval_safe.bench.commands.batch import time_parts, timed_run
    from tests.helpers import make_lm

    lm = make_lm(tiny_bpe_dir, tiny_sp_dir)
    jobs = [(context, [], 6) for context in ("the cat sat on", "a dog ran to the", "one two three")]
    runs = [timed_run(lm, jobs, batch_size) for batch_size in (1, 3)]
    for run in runs:
        parts = time_parts(run)
        assert set(parts) == {lm.members[0].name, lm.members[1].name, "host"}
        assert all(parts[m.name] > 0 for m in lm.members)  # both members ran, on their own clocks
        assert sum(parts.values()) == pytest.approx(run["seconds"])
    # rows decoded together write what they write alone
    assert runs[0]["texts"] == runs[1]["texts"]
