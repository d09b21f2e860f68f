"""vLLM arguments passed through ``--model_args``: what they change, and one line when vLLM
refuses one.

Why: any ``EngineArgs`` field passes through to a vLLM member. One that changes what a returned
log-prob means (``logprobs_mode``) would be misread silently; one that changes an answer
(``kv_cache_dtype``, ``hf_overrides``, ...) must key ``--use_cache`` apart, or a run returns
another configuration's cached answers; and a value vLLM refuses (``max_length`` past the
model's limit, a wrong type, range or choice) must say so in one line, not in a page of
pydantic and traceback.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import make_lm

from lm_eval_safe.errors import OptionError

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("vllm_installed")]

ENFORCE = {"enforce_eager": True, "kv_cache_memory_bytes": 16 << 20}  # engines live as long as the process: tiny caches


@pytest.mark.parametrize("mode", ["raw_logits", "processed_logprobs", "processed_logits"])
def test_a_logprobs_mode_other_than_log_probs_is_refused(tiny_bpe_vllm_dir: Path, mode: str) -> None:
    """``raw_logits`` returns logits where log-probs are read; ``processed_*`` applies the
    request's temperature and top-k/top-p, which the decoder applies itself. Before any load."""
    from lm_eval_safe.engines.vllm.args import member_engine_args

    with pytest.raises(OptionError, match=f"^logprobs_mode={mode} is not supported: .*drop the argument$"):
        make_lm(tiny_bpe_vllm_dir, engine="vllm", logprobs_mode=mode, **ENFORCE)
    assert member_engine_args({"logprobs_mode": "raw_logprobs"}, 2) == [{"logprobs_mode": "raw_logprobs"}] * 2


def _identity(**settings) -> dict:
    from lm_eval_safe.engines.vllm.engine import VLLMEngine

    engine = VLLMEngine.__new__(VLLMEngine)
    engine.settings = {"model": "/m", "dtype": "float32", "trust_remote_code": False, "max_logprobs": -1, **settings}
    return engine.identity()


def test_the_cache_identity_names_every_argument_that_changes_an_answer() -> None:
    """A KV cache in another precision, overridden config values, a quantization, another
    model implementation: each its own ``--use_cache`` identity. Memory, scheduling and
    parallelism do not split it, and neither does an argument at vLLM's own default."""
    plain = _identity()
    for changed in (
        {"kv_cache_dtype": "fp8"},
        {"hf_overrides": {"rope_theta": 20000.0}},
        {"quantization": "fp8"},
        {"model_impl": "transformers"},
        {"max_model_len": 64},
    ):
        assert _identity(**changed) != plain, changed
    for neutral in (
        {"gpu_memory_utilization": 0.5, "kv_cache_memory_bytes": 1 << 30, "block_size": 16},
        {"tensor_parallel_size": 2, "max_num_seqs": 8, "enforce_eager": True, "seed": 3},
        {"logprobs_mode": "raw_logprobs", "kv_cache_dtype": "auto"},
    ):
        assert _identity(**neutral) == plain, neutral


def test_a_json_object_is_a_dict() -> None:
    from lm_eval_safe.engines.vllm.args import member_engine_args

    assert member_engine_args({"hf_overrides": '{"rope_theta": 20000.0}'}, 1) == [{"hf_overrides": {"rope_theta": 20000.0}}]
    with pytest.raises(OptionError, match=r"^hf_overrides='\{\"rope_theta\": ' is not a JSON object"):
        member_engine_args({"hf_overrides": '{"rope_theta": '}, 1)


@pytest.mark.parametrize(
    ("argument", "refused"),
    [
        ({"max_length": 4096}, r"max_length=4096: User-specified max_model_len \(4096\) is greater than the derived max_model_len \(max_position_embeddings=512.*give a smaller max_length=$"),
        ({"gpu_memory_utilization": "abc"}, r"gpu_memory_utilization='abc': Input should be a valid number"),
        ({"kv_cache_dtype": "fp9"}, r"kv_cache_dtype='fp9': Input should be 'auto'"),
        ({"block_size": 7}, r"block_size=7: No common block size for 7"),
        ({"tensor_parallel_size": 0}, r"tensor_parallel_size=0: Input should be greater than or equal to 1"),
        ({"hf_overrides": "rope_theta"}, r"hf_overrides='rope_theta': Input should be a valid dictionary"),
    ],
)
def test_a_value_vllm_refuses_is_one_line(tiny_bpe_vllm_dir: Path, argument: dict, refused: str) -> None:
    """The member, the argument as given and vLLM's reason, with nothing chained below it
    (before: a pydantic ValidationError over several lines, or a ValueError from deep in the
    engine; ``gpu_memory_utilization='abc'`` was reported as a KV cache without room)."""
    with pytest.raises(OptionError, match=rf"^member '{tiny_bpe_vllm_dir}': vLLM \S+ refused {refused}") as info:
        make_lm(tiny_bpe_vllm_dir, engine="vllm", **{**ENFORCE, **argument})
    assert "\n" not in str(info.value) and info.value.__suppress_context__
