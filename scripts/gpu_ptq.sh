#!/usr/bin/env bash
# The main job on GPUs: a mid-size stand-in (Kimi-K3's expert shapes in their real roles: latent width
# routed_expert_hidden_size 3584, expert width moe_intermediate_size 3072, so w1/w3 [3072, 3584] and w2
# [3584, 3072]; 14 experts per rank at EP2) calibrated and exported at EP1 (one GPU) and EP2 (two GPUs, NCCL);
# summaries, verify output and the byte comparison of the two exports go to $OUT (default ./gpu_out).
# FAMILY=deepseek_v3: the DeepSeek-V3 stand-in instead (FP8 128x128-block source, MTP layer; 4 layers, hidden
# 2048, 32 experts of width 1024, top-8), through the family's production recipe and its engines' rules.
# Wheels missing from the machine are installed from .whl/ when present.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:.
fi
export HF_HUB_OFFLINE=1 HF_MODULES_CACHE=/tmp/hf_modules
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || echo "no GPU"; } | tee "$OUT/gpus.txt"
FAMILY=${FAMILY:-kimi_k3}; MID=/tmp/mid_$FAMILY
if [ "$FAMILY" = kimi_k3 ]; then SIZES="--hidden-size 4096 --latent-size 3584 --moe-intermediate-size 3072 --num-experts 28"
else SIZES="--hidden-size 2048 --moe-intermediate-size 1024 --num-experts 32"; fi
[ -f "$MID/config.json" ] || python3 -m modelopt_ext make-tiny "$FAMILY" "$MID" --force --num-layers 4 $SIZES --top-k 8 \
  --vocab-size 8192
# The embedded calibration set is a few thousand tokens: repeat the stand-in's corpus (shuffled lines) so
# every rank gets full 2048-token blocks (60 copies: about 172k tokens; CORPUS_COPIES=800 for 2M).
python3 - <<'PY'
import os
import random
lines = [l for l in open("modelopt_ext/quant/corpus.txt").read().splitlines() if l.strip()]
rng = random.Random(0)
with open("/tmp/calib.txt", "w") as f:
    for _ in range(int(os.environ.get("CORPUS_COPIES", "60"))):
        rng.shuffle(lines)
        f.write("\n".join(lines) + "\n\n")
PY
ARGS="--model $MID --dataset /tmp/calib.txt --calib-size ${CALIB_SIZE:-64} --batch-size 4 --seq-len 2048 --no-progress --overwrite"
# run NAME NPROC [NAME=VALUE ...]: one ptq with those experts options (`--experts-option`; $EXTRA holds more ptq
# flags).
run() {
  local name=$1 n=$2; shift 2
  local options=() o
  for o in "$@"; do options+=(--experts-option "$o"); done
  python3 -m torch.distributed.run --standalone --nproc-per-node "$n" -m modelopt_ext ptq $ARGS ${EXTRA:-} ${options[@]+"${options[@]}"} \
    --export-dir "/tmp/export_$name" --summary-json "$OUT/summary_$name.json" > "$OUT/ptq_$name.txt" 2>&1 \
    || { grep -v Warning "$OUT/ptq_$name.txt" | tail -40; exit 1; }
  echo "== $name"; grep -E "calibrate done|tokens/s|peak" "$OUT/ptq_$name.txt" | tail -4
}
# EPS: the EP degrees to run, each on as many GPUs (default "1 2"; "1" on a machine of one GPU).
EPS=${EPS:-"1 2"}; LAST=${EPS##* }
# WARMUP=1: a short run at the last degree first, so Triton's and torch.compile's on-disk caches are filled
# before timing.
if [ "${WARMUP:-0}" = 1 ]; then
  FULL=$ARGS; ARGS="${ARGS/--calib-size ${CALIB_SIZE:-64}/--calib-size 16}"; run warmup "$LAST"; ARGS=$FULL
fi
# REPEAT rounds of EP1, EP2 (with AB=1 also EP2 without the overlapped pipeline: dispatch -> experts' class
# forward -> combine; with CE=1 also EP2 with the exchange through the copy engines, ep.copy_engine; with
# TOKENS=1 also EP2 through NCCL with each token sent once per rank, ep.token_link; with NOWARM=1 also each
# degree without the warm-up forward during the load, `--no-warmup`),
# alternating, so all see the same machine state; summary_<name>_<round>.json each.
for r in $(seq 1 "${REPEAT:-1}"); do
  for n in $EPS; do
    run "ep${n}_$r" "$n"
    [ "${NOWARM:-0}" = 1 ] && EXTRA=--no-warmup run "ep${n}nowarm_$r" "$n"
  done
  [ "${AB:-0}" = 1 ] && run "ep2base_$r" 2 pipeline=false
  [ "${CE:-0}" = 1 ] && run "ep2ce_$r" 2 transport=copy_engine
  [ "${TOKENS:-0}" = 1 ] && run "ep2tokens_$r" 2 token_dispatch=true
done
# PROFILE=1: one more run of each (64 blocks) with the calibration profiler (tables per rank under $OUT/prof_<name>/).
if [ "${PROFILE:-0}" = 1 ]; then
  ARGS="${ARGS/--calib-size ${CALIB_SIZE:-64}/--calib-size 64}"
  for n in $EPS; do MODELOPT_EXT_PROFILE="$OUT/prof_ep$n" run "prof_ep$n" "$n"; done
  [ "${AB:-0}" = 1 ] && MODELOPT_EXT_PROFILE="$OUT/prof_ep2base" run prof_ep2base 2 pipeline=false
fi
# CPROFILE=1: one more EP1 run (64 blocks) under cProfile, for the host cost of the conversion and the first
# batch ($OUT/cprofile_ep1.prof; read with pstats).
if [ "${CPROFILE:-0}" = 1 ]; then
  python3 -m cProfile -o "$OUT/cprofile_ep1.prof" -m modelopt_ext ptq ${ARGS/--calib-size ${CALIB_SIZE:-64}/--calib-size 64} \
    --export-dir /tmp/export_cprofile --summary-json "$OUT/summary_cprofile_ep1.json" > "$OUT/ptq_cprofile_ep1.txt" 2>&1
fi
python3 -m modelopt_ext verify "/tmp/export_ep${LAST}_1" --source "$MID" 2>&1 | tail -4 | tee "$OUT/verify_ep$LAST.txt"
if [ "$EPS" != "$LAST" ]; then
  (cd /tmp && for f in $(ls "export_ep${EPS%% *}_1"); do cmp -s "export_ep${EPS%% *}_1/$f" "export_ep${LAST}_1/$f" || echo "differs: $f"; done) \
    | tee "$OUT/compare.txt" | head -20
fi
