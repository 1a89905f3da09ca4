#!/usr/bin/env bash
# Builds a separate virtual environment with the real `tinker` SDK and `tinker-cookbook`, as a
# user would install them, to run the cookbook's recipes against `grpoflow serve-tinker`
# (docs/tinker.md, "Running tinker-cookbook recipes"). It never touches the project's .venv.
#
#   scripts/tinker_cookbook_env.sh [VENV]     # default: $TINKER_COOKBOOK_VENV, else
#                                             #   .cache/tinker-cookbook-venv
#   VENV/bin/python -m tinker_cookbook.recipes.math_rl.train base_url=... model_name=...
#
# Idempotent: a stamp file records the exact requirement set; a second run with the same set
# returns at once. Only the package index is used (no model or dataset hub).
#
# tinker-cookbook 0.6.1 declares `tml-renderers>=0.4.1`, which the index here does not have;
# it is imported lazily and only for Inkling/Kimi-K3.1 models and the audio recipes
# (docs/tinker-protocol.md §20.1), so the cookbook is installed with --no-deps and its other
# requirements (plus the `math-rl` extra, which recipes/math_rl imports) are listed here.
# torch: the CPU wheel in pip's find-links (PIP_FIND_LINKS, as the Makefile's TORCH_WHEEL),
# else PyTorch's CPU index; never a CUDA build.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-${TINKER_COOKBOOK_VENV:-$HERE/.cache/tinker-cookbook-venv}}"
PYTHON="${PYTHON:-python3.11}"
TORCH="${TORCH:-torch==2.13.0}"
TORCH_INDEX="${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"

# The cookbook's METADATA requirements less tml-renderers and torch (installed first, CPU),
# plus its math-rl extra; transformers as the project pins it (the cookbook allows it).
REQS=(
  "tinker==0.38.0"
  "aiohttp>=3.9.0" "anyio>=4.0.0" "blobfile>=3.0.0" "chz>=0.4.0" "cloudpickle>=3.0.0"
  "datasets>=2.14.0" "huggingface-hub>=0.20.0" "numpy>=1.24.0" "pillow>=10.0.0"
  "pydantic>=2.0.0" "pyrage>=1.4.0" "rich>=13.0.0" "safetensors>=0.4.0" "termcolor>=2.0.0"
  "tiktoken>=0.12.0" "tqdm>=4.60.0" "transformers==5.24.0"
  "math-verify>=0.5.0" "pylatexenc>=2.0" "sympy>=1.12.0"
)
COOKBOOK="tinker-cookbook==0.6.1"
STAMP="$VENV/.grpoflow-cookbook-$(printf '%s\n' "$TORCH" "$COOKBOOK" "${REQS[@]}" | cksum | cut -d' ' -f1)"

if [[ -f "$STAMP" ]]; then
  echo "tinker-cookbook env: $VENV (up to date)"
  exit 0
fi

start=$(date +%s)
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --disable-pip-version-check uv
UV=("$VENV/bin/uv" pip install -q --python "$PY")

wheel=""
for dir in ${PIP_FIND_LINKS:-}; do
  for w in "$dir"/"${TORCH/==/-}"+cpu-cp311-*.whl; do [[ -f "$w" ]] && wheel="$w" && break 2; done
done
if [[ -n "$wheel" ]]; then
  echo ">> torch: $wheel"
  "${UV[@]}" "$wheel"
else
  echo ">> torch: $TORCH from $TORCH_INDEX (CPU)"
  "${UV[@]}" --index-url "$TORCH_INDEX" "$TORCH"
fi
echo ">> the cookbook's requirements (less tml-renderers)"
"${UV[@]}" "${REQS[@]}"
echo ">> $COOKBOOK --no-deps"
"${UV[@]}" --no-deps "$COOKBOOK"
"$PY" -c "import torch, tinker, tinker_cookbook; assert not torch.version.cuda, torch.__version__"
rm -f "$VENV"/.grpoflow-cookbook-*
touch "$STAMP"
echo "tinker-cookbook env: $VENV (built in $(( $(date +%s) - start )) s)"
