#!/usr/bin/env bash
# The GPU evidence of this package in one prepared run: parity with transformers' generate,
# Theorem 1, speed at realistic sizes, and lm-eval end to end (scripts/check_gpu.py says what
# each part checks). Writes check_gpu.json and check_gpu.log under $OUT (a new temporary folder
# when $OUT is unset). Each part runs in its own process under its own time limit, so a hang
# loses that part only. Exit status 1 when a part failed.
#
# Why a shell script: the machine it is meant for is lent for minutes, reaches no network and
# lacks lm-eval; this installs the wheels that scripts/prepare_gpu_check.sh put in .whl/ (when
# lm-eval is missing), then runs the parts from the working tree (no install of this package).
#
#   bash scripts/prepare_gpu_check.sh          # here, once: wheels, tokenizers, data
#   bash scripts/check_gpu.sh                  # on the GPU machine (.whl and .gpu_check carried)
#   bash scripts/check_gpu.sh --dry-run        # the same checks on this CPU, small shapes
#   bash scripts/check_gpu.sh --quick          # the dry run's quickest form (float32, 2 tokens)
#   bash scripts/check_gpu.sh --only speed,lm_eval --limit speed=300
set -u -o pipefail

usage() {
    echo "usage: check_gpu.sh [--dry-run|--quick] [--only PART,...] [--limit PART=SECONDS]..." \
        "[--tokenizers DIR] [--data-dir DIR] [--prompts N] [--max-new-tokens N]" \
        "[--dtypes float32,bfloat16] [--perturbation X] [--warm-up SECONDS]" \
        "(parts: parity theorem1 speed lm_eval)"
}
die() { echo "check_gpu.sh: $*" >&2; exit 2; }

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo" || exit 2
parts_all="parity theorem1 speed lm_eval"
only="parity,theorem1,speed,lm_eval"
declare -A limit=([parity]=75 [theorem1]=90 [speed]=230 [lm_eval]=100)
extra=()
dry=0
while (($#)); do
    case $1 in
        --dry-run) dry=1; extra+=(--dry-run) ;;
        --quick) dry=1; extra+=(--dry-run --quick --max-new-tokens 2) ;;
        --only) [[ $# -ge 2 ]] || die "--only needs a list of parts"; only=$2; shift ;;
        --limit)
            [[ ${2:-} =~ ^([a-z_0-9]+)=([0-9]+)$ ]] || die "--limit takes PART=SECONDS, got '${2:-}'"
            [[ " $parts_all " == *" ${BASH_REMATCH[1]} "* ]] || die "unknown part '${BASH_REMATCH[1]}'"
            limit[${BASH_REMATCH[1]}]=${BASH_REMATCH[2]}; shift ;;
        --tokenizers|--data-dir|--prompts|--max-new-tokens|--dtypes|--perturbation|--warm-up)
            [[ $# -ge 2 ]] || die "$1 needs a value"; extra+=("$1" "$2"); shift ;;
        -h|--help) usage; exit 0 ;;
        *) usage >&2; die "unknown argument '$1'" ;;
    esac
    shift
done
parts=()
for part in ${only//,/ }; do
    [[ " $parts_all " == *" $part "* ]] || die "unknown part '$part' (parts: $parts_all)"
    parts+=("$part")
done
((${#parts[@]})) || die "--only names no part"
if ((dry)); then  # a CPU runs the small shapes slower than their size suggests: loose limits
    for part in $parts_all; do limit[$part]=$((limit[$part] * 3)); done
fi

OUT=${OUT:-$(mktemp -d -t check_gpu.XXXXXX)}
mkdir -p "$OUT" || die "cannot create \$OUT=$OUT"
exec > >(tee -a "$OUT/check_gpu.log") 2>&1
if [[ -z ${PYTHON:-} ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
work=$(mktemp -d -t check_gpu_parts.XXXXXX)
trap 'rm -rf "$work"' EXIT
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

if ! "$PYTHON" -c "import lm_eval" 2>/dev/null; then  # every part: the bench modules import it too
    compgen -G ".whl/*.whl" >/dev/null || die "lm-eval is missing and .whl/ holds no wheels: run scripts/prepare_gpu_check.sh"
    site="$work/site"
    echo "check_gpu.sh: installing $(ls .whl | wc -l) wheels into $site"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" .whl/*.whl || die "the wheels of .whl/ did not install"
    export PYTHONPATH="$PYTHONPATH:$site"
fi

echo "check_gpu.sh: parts ${parts[*]}; $( ((dry)) && echo dry run || echo GPU ); $PYTHON; OUT=$OUT"
for part in "${parts[@]}"; do
    echo "check_gpu.sh: $part (limit ${limit[$part]} s)"
    start=$SECONDS
    timeout -k 10 "${limit[$part]}" "$PYTHON" scripts/check_gpu.py "$part" --json "$work/$part.json" \
        --timeout "$((limit[$part] - 15))" "${extra[@]}"
    echo "$? $((SECONDS - start))" >"$work/$part.status"
done
if [[ -n ${CHECK_GPU_COMMIT:-} ]]; then
    commit=$CHECK_GPU_COMMIT  # a copy whose .git is not the code's: the caller knows better
elif commit=$(git rev-parse HEAD 2>/dev/null); then
    git diff --quiet HEAD 2>/dev/null || commit="$commit (with uncommitted changes)"
else
    commit=unknown  # a copy of the working tree without .git
fi
printf '"%s"' "$commit" >"$work/commit.json"
if ((dry)); then echo true; else echo false; fi >"$work/dry_run.json"
"$PYTHON" scripts/check_gpu.py merge --parts-dir "$work" --json "$OUT/check_gpu.json"
