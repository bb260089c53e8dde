#!/usr/bin/env bash
# README command 1: set up, generate the tiny Kimi-K3 stand-in, load it with transformers and run a
# text and a text+image forward through it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1
modelopt-ext make-tiny kimi_k3 runs/tiny-kimi-k3 --force
modelopt-ext forward runs/tiny-kimi-k3
