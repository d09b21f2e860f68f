"""What goes wrong with ``engine=llama_cpp`` is said before any member loads, in one line, and
what goes wrong inside llama.cpp is said in llama.cpp's own words: its log lines in a failed
load or context, each ``llama_decode`` return code named for what llama.h says it is, and a
binding whose structures lack the fields the rows' exactness rests on refused.

The option checks need nothing installed; the binding and log checks need llama-cpp-python
(skipped without it), the decode and context checks also the real SmolLM2 GGUF (``real``)."""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from helpers import make_lm

from lm_eval_safe import engines
from lm_eval_safe.errors import OptionError
from lm_eval_safe.options import parse_options


def _one_line(exc: pytest.ExceptionInfo[BaseException]) -> str:
    text = str(exc.value)
    assert "\n" not in text, text
    return text


# -- before loading --------------------------------------------------------------------------
def test_batch_size_above_n_seq_max_is_refused_with_the_options() -> None:
    """A row holds a sequence from its first id to its last: a batch of more rows than the
    context has sequences would fail in the middle of a run."""
    with pytest.raises(OptionError) as info:
        parse_options({"members": "a", "engine": "llama_cpp", "batch_size": "8", "n_seq_max": "2"})
    assert _one_line(info).startswith("batch_size=8 is more rows than llama.cpp's n_seq_max=2 sequences")
    assert parse_options({"members": "a", "engine": "llama_cpp", "batch_size": "2", "n_seq_max": "2"}).batch_size == 2
    assert parse_options({"members": "a", "engine": "llama_cpp", "batch_size": "auto", "n_seq_max": "2"}).n_seq_max == 2
    parse_options({"members": "a", "batch_size": "8"})  # no member on llama.cpp: its n_seq_max is not a bound


def test_more_sequences_than_n_batch_are_refused_before_llama_cpp_aborts(tmp_path: Path) -> None:
    """llama.cpp asserts, making a context, that its sequences fit in the output rows of n_batch
    ids: n_batch=128 with n_seq_max=129 aborts the whole process (SIGABRT, nothing to catch).
    Refused with the options, and by the engine's context before llama.cpp is called."""
    from lm_eval_safe.engines.llama_cpp.native import ContextSettings, Model

    expected = "n_seq_max=129 is more sequences than n_batch=128: llama.cpp aborts the process making such a context; give n_batch=129 or more, or n_seq_max=128 or fewer"
    with pytest.raises(OptionError) as info:
        parse_options({"members": "a", "engine": "llama_cpp", "n_seq_max": "129"})
    assert _one_line(info) == expected
    assert parse_options({"members": "a", "engine": "llama_cpp", "n_seq_max": "129", "n_batch": "129"}).n_seq_max == 129
    with pytest.raises(OptionError) as info:
        Model(str(_llama_header(tmp_path / "m.gguf")), 0, ContextSettings(n_ctx=16, n_batch=128, n_seq_max=129, n_threads=1, flash_attn="on"))
    assert _one_line(info) == expected


def test_a_member_llama_cpp_cannot_load_is_refused_before_any_member_loads(
    tiny_bpe_dir: Path, tiny_sp_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_loading(*_: Any, **__: Any) -> None:
        raise AssertionError("a member was loaded before every member was checked")

    monkeypatch.setattr(engines, "load_source", no_loading)
    with pytest.raises(OptionError) as info:
        make_lm(tiny_bpe_dir, tiny_sp_dir, engines="hf,llama_cpp")
    assert _one_line(info) == (
        f"member {str(tiny_sp_dir)!r} is a folder checkpoint: engine=llama_cpp loads GGUF files (an "
        "alias, a .gguf file, or a GGUF model of Ollama, LM Studio or the Hugging Face cache: "
        "`lm-eval-safe models`); put it on another engine with engines="
    )
    with pytest.raises(OptionError, match="is a folder checkpoint: engine=llama_cpp loads GGUF files"):
        engines.load_member(str(tiny_bpe_dir), engine="llama_cpp")


def test_load_member_runs_the_checks_load_members_runs(
    tmp_path: Path, llama_cpp_installed: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The single-member path (tests, benchmarks): the GGUF header, then the engine's versions,
    before anything loads."""
    from lm_eval_safe.versions import ALLOW_UNTESTED, VersionError

    monkeypatch.setattr(engines, "load_source", lambda *_, **__: pytest.fail("loaded"))
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"PK\x03\x04 a zip file")
    with pytest.raises(OptionError, match="is not a valid GGUF file"):
        engines.load_member(str(broken), engine="llama_cpp")
    header = tmp_path / "header.gguf"
    header.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + b"\0" * 32)
    monkeypatch.delenv(ALLOW_UNTESTED, raising=False)
    monkeypatch.setattr("importlib.metadata.version", lambda name: "0.3.20")
    with pytest.raises(VersionError) as info:
        engines.load_member(str(header), engine="llama_cpp")
    assert "llama-cpp-python 0.3.20 is untested for engine=llama_cpp (tested: >=0.3.36,<0.4)" in _one_line(info)


def test_the_server_keeps_a_sequence_for_scoring(caplog: pytest.LogCaptureFixture) -> None:
    """A request's ``echo``+``logprobs`` scoring runs between two decoding cycles on a sequence
    of its own: the server's rows leave one of each llama.cpp member's sequences free."""

    def member(sequences: int) -> Any:
        return SimpleNamespace(engine=SimpleNamespace(kind="llama_cpp", slots=SimpleNamespace(busy=[False] * sequences)))

    opts = parse_options({"members": "a,b", "engine": "llama_cpp", "n_seq_max": "3"})
    assert engines.serving_rows(opts, [member(3), member(3)]) == 2
    assert engines.serving_rows(opts, [member(3), member(3)], asked=1) == 1
    with caplog.at_level(logging.WARNING, logger="lm_eval_safe.engines"):
        assert engines.serving_rows(opts, [member(3), member(3)], asked=3) == 2
    assert [r.getMessage() for r in caplog.records] == [
        "batch_size=3: the server decodes 2 rows at once (rows each engine serves: llama_cpp 2)"
    ]
    with pytest.raises(OptionError, match="a llama.cpp sequence of its own beside the rows: give n_seq_max=2"):
        engines.serving_rows(opts, [member(1)])


def _llama_header(path: Path) -> Path:
    """A GGUF header shaped as SmolLM2-135M's (30 layers, 9 heads, 3 of keys and values, width
    576), without weights: llama.cpp cannot load it, so a refusal before loading is the only
    way past it."""
    from gguf import GGUFWriter

    writer = GGUFWriter(path, "llama")
    writer.add_block_count(30)
    writer.add_embedding_length(576)
    writer.add_head_count(9)
    writer.add_head_count_kv(3)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


def test_a_kv_cache_this_machine_cannot_hold_is_refused_before_loading(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cache's bytes, by hand: 8 sequences of 4096 cells x 30 layers x 3 heads x (64 + 64)
    values x 2 bytes (f16) = 754974720; n_ctx=4000 is padded to the same 4096 cells, n_ctx=100
    to 256. Past the available memory it is refused in one line naming the bytes; a GPU's
    memory (n_gpu_layers) is llama.cpp's to refuse."""
    from lm_eval_safe.engines.llama_cpp import memory
    from lm_eval_safe.engines.llama_cpp.native import ContextSettings, Model
    from lm_eval_safe.members.gguf_info import read_header

    path = _llama_header(tmp_path / "smol-shaped.gguf")
    shape = memory.kv_shape(read_header(path))
    assert shape is not None and shape.bytes(4096, 8) == shape.bytes(4000, 8) == 754974720
    assert shape.bytes(100, 1) == 256 * 30 * 3 * 128 * 2
    monkeypatch.setattr(memory, "available_memory", lambda: 5 * 10**8)
    with pytest.raises(OptionError) as info:
        Model(str(path), 0, ContextSettings(n_ctx=4000, n_batch=8, n_seq_max=8, n_threads=1, flash_attn="on"))
    assert _one_line(info) == (
        "n_ctx=4000 with n_seq_max=8: llama.cpp's KV cache of smol-shaped.gguf would take 754974720 bytes "
        "(0.7 GiB: 8 sequences of 4096 cells, 30 layers, f16) and this machine has 500000000 bytes "
        "(0.5 GiB) available: give a smaller n_ctx= or n_seq_max="
    )
    memory.check_kv_fits(str(path), 2048, 8, n_gpu_layers=0)  # 377487360 bytes: fits
    memory.check_kv_fits(str(path), 4000, 8, n_gpu_layers=-1)
    monkeypatch.undo()
    with pytest.raises(OptionError, match=r"^n_ctx=16777216 with n_seq_max=64: llama.cpp's KV cache .* would take 24739011624960 bytes"):
        Model(str(path), 0, ContextSettings(n_ctx=2**24, n_batch=64, n_seq_max=64, n_threads=1, flash_attn="on"))


# -- the binding -----------------------------------------------------------------------------
class _Narrow(ctypes.Structure):
    _fields_ = [("n_ctx", ctypes.c_uint32), ("n_batch", ctypes.c_uint32)]


def test_fields_a_structure_lacks_are_refused_not_set(llama_cpp_installed: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """ctypes itself takes any name without a word; the engine's setter and its version check
    refuse a binding that lacks the fields the rows' exactness rests on."""
    import llama_cpp

    from lm_eval_safe.engines.llama_cpp.binding import check_binding, missing_fields, set_fields

    narrow = _Narrow()
    narrow.kv_unified = False  # what a binding without the field would silently accept
    with pytest.raises(OptionError) as info:
        set_fields(_Narrow(), n_ctx=64, kv_unified=False, swa_full=True)
    assert "lacks _Narrow.kv_unified, _Narrow.swa_full, which engine=llama_cpp sets" in _one_line(info)
    assert missing_fields(llama_cpp) == []
    check_binding()  # the installed binding has every field
    monkeypatch.setattr(llama_cpp, "llama_context_params", _Narrow)
    with pytest.raises(OptionError) as info:
        check_binding()
    text = _one_line(info)
    assert "lacks llama_context_params.n_ubatch" in text and "llama_context_params.kv_unified" in text
    assert "llama_context_params.swa_full" in text and "(tested: >=0.3.36,<0.4)" in text


def test_llama_cpps_log_is_kept_for_its_errors() -> None:
    from lm_eval_safe.engines.llama_cpp.native import CONT, ERROR, INFO, WARN, Log

    log = Log()
    log(INFO, b"llama_model_loader: loaded meta data\n", None)
    log(ERROR, b"gguf_init_from_reader: failed ", None)
    log(CONT, b"to read header\n", None)
    log(WARN, b"a warning\n", None)
    log(ERROR, b"llama_model_load: error loading model\n", None)
    assert log.words(0) == "gguf_init_from_reader: failed to read header; llama_model_load: error loading model"
    mark = log.mark()
    assert log.words(mark) == ""
    log(WARN, b"decode: failed to find a memory slot for batch of size 44\n", None)
    log(INFO, b"not kept\n", None)
    assert log.words(mark) == "decode: failed to find a memory slot for batch of size 44"  # no error: its warnings


def test_a_failed_load_says_what_llama_cpp_logged(tmp_path: Path, llama_cpp_installed: None) -> None:
    from lm_eval_safe.engines.llama_cpp.native import ContextSettings, Model

    path = tmp_path / "cut.gguf"
    path.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + b"garbage")
    with pytest.raises(OSError) as info:
        Model(str(path), 0, ContextSettings(n_ctx=64, n_batch=8, n_seq_max=1, n_threads=1, flash_attn="on"))
    assert _one_line(info).startswith(f"llama.cpp could not load {path} (gguf_init_from_reader: failed to read header; ")


# -- llama.cpp's words with a real model -----------------------------------------------------
@pytest.fixture(scope="module")
def smollm2(llama_cpp_installed: None, models: Path) -> str:
    from lm_eval_safe.members.sources import resolve_source

    return resolve_source("smollm2-135m").location


@pytest.mark.real
@pytest.mark.llama_cpp
def test_a_failed_context_says_what_llama_cpp_logged(smollm2: str) -> None:
    from lm_eval_safe.engines.llama_cpp.native import ContextSettings, Model

    with pytest.raises(OSError) as info:  # past llama.cpp's bound (the options refuse it first)
        Model(smollm2, 0, ContextSettings(n_ctx=16, n_batch=512, n_seq_max=300, n_threads=1, flash_attn="on"))
    text = _one_line(info)
    assert "failed to initialize the context: n_seq_max must be <= 256" in text
    assert "give a smaller n_ctx=" not in text  # not a memory failure: not blamed on memory


@pytest.mark.real
@pytest.mark.llama_cpp
def test_each_decode_code_is_named_for_what_it_is(smollm2: str) -> None:
    """1: no KV slot (a sequence past its cells: llama.cpp gives each at least 256); -1: an
    invalid batch (a token id past the vocabulary). Either way the sequence is rolled back to
    before the failed feed."""
    from lm_eval_safe.engines.llama_cpp.native import ContextSettings, Model
    from lm_eval_safe.engines.llama_cpp.slots import Feed, Slots

    model = Model(smollm2, 0, ContextSettings(n_ctx=32, n_batch=64, n_seq_max=2, n_threads=2, flash_attn="on"))
    try:
        slots = Slots(model, batch_rows=False)
        slots.decode([Feed(0, 0, [1] * 200, [199])])
        with pytest.raises(RuntimeError) as info:
            slots.decode([Feed(0, 200, [1] * 100, [299])])
        assert _one_line(info).startswith("llama.cpp found no KV slot for this batch (256 cells for each sequence, n_ctx=32 padded by llama.cpp; llama.cpp: decode: failed to find a memory slot")
        assert str(info.value).endswith("give a larger n_ctx=")
        assert info.value.__cause__.code == 1 and slots.cached[0] == [1] * 200
        with pytest.raises(RuntimeError) as info:
            slots.decode([Feed(1, 0, [1, model.n_vocab + 5], [1])])
        text = _one_line(info)
        assert text.startswith(f"llama.cpp refused a decode: llama_decode returned -1 (an invalid batch): init: invalid token[1] = {model.n_vocab + 5}")
        assert info.value.__cause__.code == -1 and slots.cached[1] == []
    finally:
        model.close()


@pytest.mark.real
@pytest.mark.llama_cpp
def test_a_context_made_otherwise_than_asked_is_refused(smollm2: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The settings read back from the context: a micro-batch smaller than a block would cut a
    block's decode in two (other logits), so such a context is refused."""
    import llama_cpp

    from lm_eval_safe.engines.llama_cpp.native import ContextSettings, Model

    monkeypatch.setattr(llama_cpp, "llama_n_ubatch", lambda ctx: 32)
    with pytest.raises(OSError) as info:
        Model(smollm2, 0, ContextSettings(n_ctx=64, n_batch=64, n_seq_max=2, n_threads=1, flash_attn="on"))
    assert "with {'n_ubatch': 32, 'n_seq_max': 2} where this engine set {'n_ubatch': 64, 'n_seq_max': 2}" in _one_line(info)


@pytest.mark.real
@pytest.mark.llama_cpp
@pytest.mark.parametrize("alias", ["smollm2-135m", "gemma3-270m"])
def test_the_kv_cache_bytes_are_llama_cpps_own(alias: str, llama_cpp_installed: None, models: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The bytes computed from the header are those llama.cpp logs for its caches (Gemma-3:
    its full-attention and sliding-window caches, each ``size = X MiB (N cells, L layers, S/S
    seqs)``), with the cells per sequence it reads back; an absurd n_ctx is refused before
    the weights load."""
    import re

    from lm_eval_safe.engines.llama_cpp.memory import kv_shape
    from lm_eval_safe.engines.llama_cpp.native import ContextSettings, Model
    from lm_eval_safe.members.gguf_info import read_header
    from lm_eval_safe.members.sources import resolve_source

    path = resolve_source(alias).location
    with caplog.at_level(logging.DEBUG, logger="lm_eval_safe.engines.llama_cpp.native"):
        model = Model(path, 0, ContextSettings(n_ctx=300, n_batch=64, n_seq_max=3, n_threads=1, flash_attn="on"))
    model.close()
    caches = [re.search(r"llama_kv_cache: size = +([\d.]+) MiB \( *(\d+) cells, +(\d+) layers, +(\d+)/\d+ seqs\)", r.getMessage()) for r in caplog.records]
    caches = [(float(m[1]), int(m[2]), int(m[3]), int(m[4])) for m in caches if m]
    assert caches and {(cells, seqs) for _, cells, _, seqs in caches} == {(512, 3)} and model.cells_per_sequence == 512
    shape = kv_shape(read_header(Path(path)))
    assert shape is not None and shape.layers == sum(layers for _, _, layers, _ in caches)
    assert shape.bytes(300, 3) / 2**20 == pytest.approx(sum(mib for mib, *_ in caches), abs=0.005 * len(caches))
    with pytest.raises(OptionError) as info:
        engines.load_member(alias, engine="llama_cpp", n_ctx=2**26, n_seq_max=8)
    assert re.match(rf"n_ctx={2**26} with n_seq_max=8: llama.cpp's KV cache of {Path(path).name} would take {shape.bytes(2**26, 8)} bytes", _one_line(info))
