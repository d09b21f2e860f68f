"""Device placement: ``device=``, ``member_devices=`` (``auto`` = device_map), data parallel.

The rules are tested through :func:`plan_placement` with a pretend GPU count, so they run on
this CPU-only machine; the errors a CPU user can actually hit (``device=cuda:0``, a device torch
cannot parse) are also tested through :class:`SafeEnsembleLM`, where they must fail in one line
before any model is loaded. ``scripts/check_gpu_placement.py`` is smoke-tested on CPU.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import REPO, ll_request, make_lm

from lm_eval_safe.errors import OptionError
from lm_eval_safe.harness.model import SafeEnsembleLM
from lm_eval_safe.members.placement import Placement, plan_placement, resolve_device

MEMBERS = ["org/a", "/models/b"]


def plan(
    device: str | None = None, member_devices: list[str] | None = None, **hw: Any
) -> list[Placement]:
    hw.setdefault("cuda_count", 0)
    return plan_placement(MEMBERS, device, member_devices, **hw)


def assert_one_line_error(info: pytest.ExceptionInfo, *fragments: str) -> None:
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message


# -- the pure rules --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("device", "cuda_count", "expected"),
    [
        (None, 0, "cpu"),
        ("auto", 0, "cpu"),
        ("", 0, "cpu"),
        (None, 2, "cuda"),
        ("auto", 1, "cuda"),
        ("cpu", 2, "cpu"),
        ("cuda", 1, "cuda"),
        ("cuda:1", 2, "cuda:1"),
        (" CUDA:0 ", 1, "cuda:0"),
    ],
)
def test_default_puts_every_member_on_device(
    device: str | None, cuda_count: int, expected: str
) -> None:
    assert plan(device, cuda_count=cuda_count) == [Placement(expected), Placement(expected)]


def test_member_devices_one_gpu_per_member_and_device_map_auto() -> None:
    assert plan(member_devices=["cuda:0", "cuda:1"], cuda_count=2) == [
        Placement("cuda:0"),
        Placement("cuda:1"),
    ]
    # auto: accelerate spreads the member over the GPUs; without one it is plain cpu
    assert plan(member_devices=["cuda:0", "auto"], cuda_count=2) == [
        Placement("cuda:0"),
        Placement("cuda", "auto"),
    ]
    assert plan(member_devices=["cpu", "AUTO"], cuda_count=0) == [
        Placement("cpu"),
        Placement("cpu"),
    ]
    assert plan(member_devices=["mps", "cpu"], mps_available=True) == [
        Placement("mps"),
        Placement("cpu"),
    ]


@pytest.mark.parametrize(
    ("kwargs", "fragments"),
    [
        ({"device": "cuda:0"}, ("device='cuda:0'", "no CUDA device", "use device=cpu")),
        ({"device": "cuda"}, ("device='cuda'", "no CUDA device")),
        (
            {"device": "cuda:2", "cuda_count": 2},
            ("device='cuda:2'", "only 2 CUDA device(s)", "cuda:0 to cuda:1"),
        ),
        ({"device": "gpu7"}, ("device='gpu7' is not a device torch knows", "cuda:N")),
        ({"device": "nonsense"}, ("device='nonsense' is not a device", "use auto, cpu")),
        ({"device": "mps"}, ("device='mps' but MPS is not available", "device=cpu")),
        ({"device": "meta"}, ("runs on cpu, cuda or mps",)),
        (
            {"member_devices": ["cpu", "cuda:1"], "cuda_count": 1},
            ("member_devices entry for b='cuda:1'", "only 1 CUDA device(s)"),
        ),
        (
            {"member_devices": ["gpu0", "cpu"]},
            ("member_devices entry for a='gpu0' is not a device",),
        ),
        (
            {"member_devices": ["cpu", "cuda"]},
            ("member_devices entry for b='cuda'", "no CUDA device"),
        ),
        ({"member_devices": ["cpu"]}, ("member_devices has 1 entries for 2 members",)),
    ],
)
def test_devices_the_machine_lacks_fail_in_one_line(
    kwargs: dict, fragments: tuple[str, ...]
) -> None:
    with pytest.raises(OptionError) as info:
        plan(**kwargs)
    assert_one_line_error(info, *fragments)


def test_data_parallel_gpus_each_process_its_own_gpu() -> None:
    dp = {"cuda_count": 4, "world_size": 4, "process_device": "cuda:3"}
    for device in (None, "auto", "cuda", "cuda:0"):
        assert plan(device, **dp) == [Placement("cuda:3"), Placement("cuda:3")]
    assert plan("cpu", **dp) == [Placement("cpu"), Placement("cpu")]
    # CPU processes (gloo) have no process device: every member on cpu, member_devices allowed
    assert plan(member_devices=["cpu", "cpu"], cuda_count=0, world_size=3) == [Placement("cpu")] * 2


@pytest.mark.parametrize("entries", [["cuda:0", "cuda:1"], ["cpu", "auto"]])
def test_member_devices_on_gpus_with_several_processes_is_refused(entries: list[str]) -> None:
    with pytest.raises(OptionError) as info:
        plan(member_devices=entries, cuda_count=2, world_size=2, process_device="cuda:0")
    assert_one_line_error(info, "2 data-parallel processes", "same GPUs", "run one process")


def test_resolve_device_is_what_members_use() -> None:
    from lm_eval_safe.members.placement import pick_device

    assert resolve_device("cpu:0", cuda_count=0) == "cpu"
    assert (
        pick_device(None) == pick_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    )
    if not torch.cuda.is_available():
        with pytest.raises(OptionError, match="no CUDA device"):
            pick_device("cuda:0")


# -- through SafeEnsembleLM (before anything is loaded) -------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        ({"device": "cuda:0"}, "device='cuda:0' but torch sees no CUDA device"),
        ({"device": "nonsense"}, "device='nonsense' is not a device torch knows"),
        ({"member_devices": "cpu|cuda:0"}, "='cuda:0' but torch sees no CUDA device"),
        ({"member_devices": "cpu,gpu7"}, "='gpu7' is not a device torch knows"),
        ({"member_devices": "cpu"}, "member_devices has 1 entries for 2 members"),
    ],
)
def test_lm_refuses_missing_devices(
    tiny_bpe_dir: Path, tiny_sp_dir: Path, options: dict, fragment: str
) -> None:
    members = f"{tiny_bpe_dir},{tiny_sp_dir}"
    with pytest.raises(OptionError) as info:
        SafeEnsembleLM(members=members, **options)
    assert_one_line_error(info, fragment)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cli_default_device_means_auto_but_other_cli_devices_are_checked(
    tiny_bpe_dir: Path,
) -> None:
    """lm-eval's CLI passes device='cuda:0' even when --device was not typed."""
    lm = SafeEnsembleLM.create_from_arg_obj(
        {"members": str(tiny_bpe_dir)}, {"device": "cuda:0", "batch_size": 1}
    )
    assert [m.device for m in lm.members] == ["cpu"]
    with pytest.raises(OptionError, match="device='cuda:1' but torch sees no CUDA device"):
        SafeEnsembleLM.create_from_arg_obj({"members": str(tiny_bpe_dir)}, {"device": "cuda:1"})
    with pytest.raises(OptionError, match="device='cuda:0' but"):  # typed in model_args: checked
        SafeEnsembleLM.create_from_arg_obj({"members": str(tiny_bpe_dir), "device": "cuda:0"}, {})


def test_device_map_member_is_loaded_by_accelerate_and_scores_the_same(
    tiny_bpe_dir: Path, tiny_sp_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The device_map path (no ``.to``, inputs on the embeddings' device) gives the same scores.

    On CPU ``auto`` plans plain cpu, so the plan is forced to ``device_map='auto'`` on cpu here:
    accelerate then keeps every layer on cpu, which exercises the loading and feeding code."""
    import lm_eval_safe.harness.model as model_module

    requests = [
        ll_request("Tom has 3 apples and", c) for c in (" buys two more.", " sold 12 clips")
    ]
    plain = make_lm(tiny_bpe_dir, tiny_sp_dir).loglikelihood(requests, disable_tqdm=True)
    monkeypatch.setattr(
        model_module, "plan_placement", lambda *a, **k: [Placement("cpu", "auto"), Placement("cpu")]
    )
    lm = make_lm(tiny_bpe_dir, tiny_sp_dir)
    spread = lm.members[0]
    assert spread.engine.device_map == "auto" and spread.engine.input_device == torch.device("cpu")
    assert spread.describe()["devices"] == ["cpu"]
    assert lm.loglikelihood(requests, disable_tqdm=True) == plain


# -- scripts/check_gpu_placement.py on CPU ---------------------------------------------------
def _script() -> Any:
    spec = importlib.util.spec_from_file_location(
        "check_gpu_placement", REPO / "scripts" / "check_gpu_placement.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_check_gpu_placement_script_passes_on_cpu(
    tiny_bpe_dir: Path, tiny_sp_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    members = f"{tiny_bpe_dir},{tiny_sp_dir}"
    code = _script().main(
        ["--members", members, "--member-devices", "cpu,auto", "--max-gen-toks", "4"]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    for check in (
        "load",
        "placement tiny_bpe",
        "input device tiny_sp",
        "generate_until",
        "loglikelihood",
    ):
        assert any(line.startswith(f"PASS {check}") for line in out.splitlines()), out
    assert "FAIL" not in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_check_gpu_placement_script_fails_on_a_missing_gpu(
    tiny_bpe_dir: Path, tiny_sp_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    members = f"{tiny_bpe_dir},{tiny_sp_dir}"
    code = _script().main(["--members", members, "--member-devices", "cuda:0,cuda:1"])
    out = capsys.readouterr().out
    assert code == 2
    assert out.startswith("FAIL load: member_devices entry for tiny_bpe")
