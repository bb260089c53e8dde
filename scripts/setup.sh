#!/usr/bin/env bash
# Creates .venv (if missing) and installs modelopt-ext with its test extra. Idempotent.
# On CPU machines torch must be pinned first: an unpinned torch pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
if ! python -c "import torch" 2>/dev/null; then
  python -m pip install -q --upgrade pip
  python -m pip install -q "$TORCH_SPEC"
fi
python -m pip install -q -e ".[test]"
python -c "import torch, transformers, modelopt, compressed_tensors; print(f'torch {torch.__version__}, transformers {transformers.__version__}, modelopt {modelopt.__version__}, compressed-tensors {compressed_tensors.__version__}')"
