#!/usr/bin/env bash
# README command 1, the main job: set up, generate the tiny Kimi-K3 stand-in, then calibrate and export it
# with expert parallelism on 2 CPU ranks (gloo) using the production recipe (NVFP4 routed experts, FP8
# attention), and verify the export against the source checkpoint.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
modelopt-ext make-tiny kimi_k3 runs/tiny-kimi-k3 --force
torchrun --standalone --nproc-per-node 2 -m modelopt_ext ptq \
  --model runs/tiny-kimi-k3 --export-dir runs/tiny-kimi-k3-nvfp4 --overwrite \
  --calib-size 64 --batch-size 4 --seq-len 128 --summary-json runs/tiny-kimi-k3-nvfp4.summary.json
modelopt-ext verify runs/tiny-kimi-k3-nvfp4 --source runs/tiny-kimi-k3 --engine all
