#!/usr/bin/env bash
# What scripts/check_gpu.sh needs on a GPU machine that reaches no network, made here once:
#   .whl/        the wheels of scripts/gpu_wheels.txt, for CPython 3.12 on x86-64 manylinux
#   .gpu_check/  the tokenizers of two GGUF members (tokenizers/a: Qwen2.5's, tokenizers/b:
#                SmolLM2's) and the first GSM8K questions of the local data (data/gsm8k)
# Both folders are git-ignored; a device call carries them (about 20 MiB together).
#
#   bash scripts/prepare_gpu_check.sh [--source-data DIR]   # default: ../shared/data
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
source_data=$repo/../shared/data
while (($#)); do
    case $1 in
        --source-data) [[ $# -ge 2 ]] || { echo "prepare_gpu_check.sh: --source-data needs a folder" >&2; exit 2; }
            source_data=$2; shift ;;
        *) echo "prepare_gpu_check.sh: unknown argument '$1' (usage: [--source-data DIR])" >&2; exit 2 ;;
    esac
    shift
done
if [[ -z ${PYTHON:-} ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
mapfile -t wheels < <(grep -v '^\s*\(#\|$\)' scripts/gpu_wheels.txt)
rm -rf .whl
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${wheels[@]}"
mkdir -p .gpu_check
PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" scripts/check_gpu.py prepare \
    --json .gpu_check/prepared.json --source-data "$source_data"
du -sh .whl .gpu_check
