"""The tested version matrix (``lm_eval_safe/versions.py``): an untested transformers or lm-eval
is refused when the model is built, in one line with the fix, unless the user opts in."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import tomllib
from helpers import make_lm
from packaging.requirements import Requirement
from packaging.version import Version

from lm_eval_safe import versions
from lm_eval_safe.versions import ALLOW_UNTESTED, VersionError, check_versions, version_problems

REPO = Path(__file__).resolve().parents[1]


def _found(transformers: str, lm_eval: str) -> dict[str, Version]:
    return {"transformers": Version(transformers), "lm-eval": Version(lm_eval)}


@pytest.mark.parametrize(
    ("transformers", "lm_eval"),
    [("4.57.1", "0.4.9"), ("4.57.6", "0.4.13"), ("5.24.0", "0.4.13"), ("5.0.0", "0.4.10"), ("4.57.6", "0.4.9.2")],
)
def test_tested_pairs_pass(transformers: str, lm_eval: str) -> None:
    assert version_problems(_found(transformers, lm_eval)) == []
    check_versions(_found(transformers, lm_eval))


@pytest.mark.parametrize(
    ("transformers", "lm_eval", "named"),
    [
        ("4.46.3", "0.4.13", "transformers 4.46.3"),  # the old declared floor
        ("5.25.0", "0.4.13", "transformers 5.25.0"),  # newer than anything tested
        ("4.57.6", "0.4.8", "lm-eval 0.4.8"),
        ("4.57.6", "0.4.14", "lm-eval 0.4.14"),
        ("5.24.0", "0.4.9", "lm-eval 0.4.9 needs transformers 4"),  # lm-eval itself cannot import
    ],
)
def test_untested_versions_are_refused_in_one_line(
    transformers: str, lm_eval: str, named: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ALLOW_UNTESTED, raising=False)
    with pytest.raises(VersionError) as info:
        check_versions(_found(transformers, lm_eval))
    message = str(info.value)
    assert "\n" not in message and named in message
    assert re.search(r"pip install '[a-z-]+>=[0-9.]+,<[0-9.]+'", message), message
    assert ALLOW_UNTESTED in message


def test_the_model_refuses_before_loading_anything(
    tiny_bpe_dir: Path, tiny_sp_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ALLOW_UNTESTED, raising=False)
    real = versions.installed
    monkeypatch.setattr(
        versions, "installed", lambda name: Version("4.46.3") if name == "transformers" else real(name)
    )
    loaded = []
    monkeypatch.setattr("lm_eval_safe.engines.load_source", lambda *a, **k: loaded.append(a))
    with pytest.raises(VersionError, match=r"transformers 4\.46\.3 is untested"):
        make_lm(tiny_bpe_dir, tiny_sp_dir)
    assert loaded == []


def test_opting_in_runs_with_a_warning(
    tiny_bpe_dir: Path, tiny_sp_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(ALLOW_UNTESTED, "1")
    real = versions.installed
    monkeypatch.setattr(
        versions, "installed", lambda name: Version("0.4.14") if name == "lm-eval" else real(name)
    )
    with caplog.at_level(logging.WARNING, logger="lm_eval_safe.versions"):
        lm = make_lm(tiny_bpe_dir, tiny_sp_dir)
    assert lm.members
    assert any("lm-eval 0.4.14 is untested" in r.message and "own risk" in r.message for r in caplog.records)


def test_the_installed_versions_are_tested() -> None:
    """Whatever this suite runs on (CI's newest and floor environments) is inside the matrix."""
    assert version_problems() == []


def test_pyproject_ranges_are_the_tested_ranges() -> None:
    """pyproject.toml's floors (the server's extra included) are the floor environment's pins
    (.ci/floor-constraints.txt) and its caps the ends of the tested spans, so pip never
    installs an untested release."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    runtime = [*project["dependencies"], *project["optional-dependencies"]["serve"]]
    declared = {Requirement(r).name: Requirement(r).specifier for r in runtime}
    pins = {}
    for line in (REPO / ".ci" / "floor-constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            pins[name] = version
    for name, specifier in declared.items():
        floors = [s.version for s in specifier if s.operator == ">="]
        assert floors and name in pins, f"{name}: declare a floor and pin it in the floor environment"
        if name == "torch":  # CI has one torch (2.13.0 CPU); its floor is transformers 4.57's
            assert pins[name] == "2.13.0" and floors == ["2.2"]
            continue
        assert floors == [pins[name]], (name, floors, pins[name])
    for package, spans in versions.TESTED.items():
        caps = [s.version for s in declared[package] if s.operator == "<"]
        assert caps == [spans[-1][1]], package
        assert pins[package] == spans[0][0], package
