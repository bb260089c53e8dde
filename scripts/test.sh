#!/usr/bin/env bash
# README command 2: set up and run the test suite (CPU only, offline).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1
python -m pytest -q "$@"
