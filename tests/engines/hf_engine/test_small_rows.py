"""Small-row linears: same numbers as ``F.linear`` up to rounding, active
only inside the decoder's and scorer's forwards, choices timed once and cached per machine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import gen_request, ll_request, make_lm, random_prompts

from lm_eval_safe.engines.hf import small_rows
from lm_eval_safe.engines.hf.small_rows import SmallRowLinears, matrix_form


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bias", [False, True])
def test_matrix_form_equals_linear(dtype: torch.dtype, bias: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(300, 48, generator=gen, dtype=dtype)
    b = torch.randn(300, generator=gen, dtype=dtype) if bias else None
    for shape in [(48,), (1, 1, 48), (1, 3, 48), (2, 4, 48), (8, 48)]:
        x = torch.randn(*shape, generator=gen, dtype=dtype)
        tol = 1e-5 if dtype == torch.float32 else 1e-12
        assert torch.allclose(matrix_form(x, weight, b), F.linear(x, weight, b), atol=tol, rtol=tol)
        assert matrix_form(x, weight, b).shape == F.linear(x, weight, b).shape


def test_active_only_inside_the_block(tiny_bpe_dir: Path, tmp_path: Path) -> None:
    """Outside ``active()`` (e.g. lm-eval's ``hf`` running the same model object) every linear
    takes ``F.linear``; inside, the planned row counts take the matrix form."""
    from lm_eval_safe.engines import load_member

    member = load_member(str(tiny_bpe_dir), device="cpu", fast_small_linear="on", cache_dir=str(tmp_path))
    head = member.engine.model.get_output_embeddings()
    x = torch.randn(1, 2, head.in_features)
    calls = []
    original = small_rows.matrix_form

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return original(*args, **kwargs)

    small_rows.matrix_form = spy
    try:
        head(x)
        assert calls == []
        with member.engine.small_rows.active():
            head(x)
            head(torch.randn(1, 9, head.in_features))  # beyond MAX_ROWS: plain
        assert calls == [x.shape]
        head(x)
        assert calls == [x.shape]
    finally:
        small_rows.matrix_form = original


def test_on_gives_the_texts_and_scores_of_off(tiny_bpe_dir: Path, tiny_sp_dir: Path) -> None:
    prompts = random_prompts(4, seed=3)
    generate = [gen_request(p, until=[], max_gen_toks=12) for p in prompts]
    score = [ll_request(p, " the cat sat") for p in prompts]
    out = {}
    for mode in ("off", "on"):
        lm = make_lm(tiny_bpe_dir, tiny_sp_dir, dtype="float64", fast_small_linear=mode)
        patched = [m.engine.small_rows.modules for m in lm.members]
        assert all(patched) if mode == "on" else not any(patched)
        out[mode] = (
            lm.generate_until(generate, disable_tqdm=True),
            [lp for lp, _ in lm.loglikelihood(score, disable_tqdm=True)],
        )
    assert out["on"][0] == out["off"][0]
    assert torch.allclose(torch.tensor(out["on"][1]), torch.tensor(out["off"][1]), atol=1e-9)


def test_auto_times_each_shape_once_per_machine(tiny_bpe_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """``auto`` times every distinct weight shape at first use and caches the choice on disk;
    a second process (a new member) reads it instead of timing again. The choice follows the
    timings: the matrix form only where it is clearly faster."""
    from lm_eval_safe.engines import load_member

    timed: list[tuple[int, int]] = []

    def fake_measure(weight: torch.Tensor, bias: torch.Tensor | None) -> list[int]:
        timed.append(tuple(weight.shape))
        return [1, 2] if weight.shape[0] > 1000 else []

    monkeypatch.setattr(small_rows, "measure_rows", fake_measure)
    member = load_member(str(tiny_bpe_dir), device="cpu", cache_dir=str(tmp_path))
    shapes = {key[:2] for key in member.engine.small_rows.modules}
    with member.engine.small_rows.active():
        head = member.engine.model.get_output_embeddings()
        expected = frozenset({1, 2}) if head.out_features > 1000 else frozenset()
        assert getattr(head, small_rows._ATTR) == expected
    assert sorted(timed) == sorted(shapes)
    assert list((tmp_path / "small-rows").glob("*.json"))

    timed.clear()
    again = load_member(str(tiny_bpe_dir), device="cpu", cache_dir=str(tmp_path))
    with again.engine.small_rows.active():
        pass
    assert timed == []


def test_measure_rows_picks_only_clear_wins(monkeypatch) -> None:
    """Fake clocks: the matrix form wins at 1-2 rows by 2x, ties at 3-8 rows."""
    clock = iter(range(10**6))

    def fake_time(fn, repeats: int = 3) -> float:
        rows = fake_time.rows  # type: ignore[attr-defined]
        is_matrix = next(clock) % 2 == 1
        return (0.5e-3 if rows <= 2 else 1e-3) if is_matrix else 1e-3

    original_randn = torch.randn

    def randn(*shape, **kwargs):
        fake_time.rows = shape[1]  # type: ignore[attr-defined]
        return original_randn(*shape, **kwargs)

    monkeypatch.setattr(small_rows, "_time", fake_time)
    monkeypatch.setattr(small_rows.torch, "randn", randn)
    assert small_rows.measure_rows(torch.zeros(4, 4), None) == [1, 2]


def test_bad_mode_fails_in_one_line(tiny_bpe_dir: Path, tiny_sp_dir: Path) -> None:
    from lm_eval_safe.errors import OptionError

    with pytest.raises(OptionError, match="fast_small_linear"):
        make_lm(tiny_bpe_dir, tiny_sp_dir, fast_small_linear="fast")


def test_off_leaves_the_model_untouched(tiny_bpe_dir: Path) -> None:
    from lm_eval_safe.engines import load_member

    member = load_member(str(tiny_bpe_dir), device="cpu", fast_small_linear="off")
    assert isinstance(member.engine.small_rows, SmallRowLinears) and not member.engine.small_rows.modules
    assert all("forward" not in vars(m) for m in member.engine.model.modules())
