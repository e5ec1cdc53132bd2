#!/usr/bin/env bash
# GPU check on ONE H100/H200, offline, in under 8 minutes (issue 10, item 6 "Device matrix"):
#   (a) the CUDA test subset:   VLM_TEST_DEVICE=cuda python -m pytest -m device tests
#   (b) 100 steps of the small VLM (configs/train/gpu_check.yaml: vlm_small, ~51M params) with
#       DeepSpeed ZeRO-2 in bf16 under the deepspeed launcher, then a check of its metrics.jsonl:
#       the loss falls (last record >= 10% below the first) and no value is NaN/inf
#   (b') the training MFU of a ~1B-parameter ConceptMoE (configs/model/mfu_1b.yaml) at 8K packed
#       tokens per step, bf16, ZeRO-2 (configs/train/gpu_mfu.yaml), reported against the 40% target
#   (c) the GPU benchmarks (benchmarks/gpu.sh's scripts; quick sizes by default, see below)
# Every step is timed and runs under its own time limit; the other steps still run when one fails;
# a summary comes at the end (exit 1 if any step failed). Everything is also written to
# runs/gpu_check/gpu_check.log; benchmark results go to runs/gpu_check/bench/.
#
#   bash scripts/gpu_check.sh
#   GPU_CHECK_DRY_RUN=1 bash scripts/gpu_check.sh     # print the commands, run nothing (no GPU needed)
#   GPU_CHECK_STEPS=tests,train bash scripts/gpu_check.sh   # a subset of tests,train,mfu,bench
#   GPU_CHECK_BENCH=full bash scripts/gpu_check.sh    # the whole benchmarks/gpu.sh (6-7 min alone:
#                                                     # the total then exceeds the 8-minute budget)
#
# Benchmarks: benchmarks/gpu.sh takes 6-7 minutes by itself, too long next to (a) and (b). If it
# honours GPU_BENCH_QUICK=1 (reduced sizes), it is called that way; otherwise this script runs the
# same benchmark scripts at reduced sizes itself (same code paths, same OUT layout + SUMMARY.md).
#
# No network: the HF hub is forced offline; the environment must already exist (.venv, `make
# setup`). `make setup` is run only when .venv cannot import the packages (pip then needs the
# network), `make data` only when data/default is missing (it is built offline).
# Env: PY (python, default .venv/bin/python), DEVICE (default cuda), GPU_CHECK_BUDGET_S (480).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

DRY=${GPU_CHECK_DRY_RUN:-0}
BUDGET_S=${GPU_CHECK_BUDGET_S:-480}
STEPS=${GPU_CHECK_STEPS:-tests,train,mfu,bench}
BENCH_MODE=${GPU_CHECK_BENCH:-quick}   # quick | full
DEVICE=${DEVICE:-cuda}
VENV=${VENV:-.venv}
if [ -z "${PY:-}" ]; then
  if [ -x "$VENV/bin/python" ]; then PY=$VENV/bin/python; else PY=python3; fi
fi
PY_BIN_DIR=$(dirname "$PY")
TRAIN_CONFIG=configs/train/gpu_check.yaml
TRAIN_STEPS=100
RUN_DIR=runs/gpu_check           # = output_dir/name of $TRAIN_CONFIG
BENCH_OUT=$RUN_DIR/bench
LOG=$RUN_DIR/gpu_check.log

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PIP_NO_INDEX=1            # a pip call that would reach the network fails fast instead
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}

mkdir -p "$RUN_DIR"
if [ "$DRY" != 1 ]; then
  : > "$LOG"
  exec > >(tee -a "$LOG") 2>&1   # everything below also goes to the log
fi

die() { echo "gpu_check: $*" >&2; exit 2; }
START=$(date +%s)
elapsed() { echo $(( $(date +%s) - START )); }
wants() { [[ ",$STEPS," == *",$1,"* ]]; }

# show / run one command (dry run: show only)
cmd() {
  printf '+'; printf ' %q' "$@"; printf '\n'
  if [ "$DRY" = 1 ]; then return 0; fi
  "$@"
}

# step NAME LIMIT_S command...: timed, under `timeout`, failure recorded (not fatal)
NAMES=() TIMES=() RESULTS=()
step() {
  local name=$1 limit=$2; shift 2
  echo
  echo "=== [$name] (limit ${limit}s, $(elapsed)s elapsed)"
  local t0 rc=0
  t0=$(date +%s)
  cmd timeout --signal=INT --kill-after=20 "$limit" "$@" || rc=$?
  local dt=$(( $(date +%s) - t0 ))
  NAMES+=("$name") TIMES+=("$dt")
  if [ "$DRY" = 1 ]; then RESULTS+=("dry run")
  elif [ "$rc" -eq 0 ]; then RESULTS+=("ok")
  elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then RESULTS+=("TIMEOUT (>${limit}s)")
  else RESULTS+=("FAILED (exit $rc)"); fi
  echo "=== [$name] ${RESULTS[-1]} in ${dt}s"
}

echo "gpu_check: $(date -u +%Y-%m-%dT%H:%M:%SZ) in $ROOT; steps: $STEPS; bench: $BENCH_MODE; budget ${BUDGET_S}s"
if [ "$DRY" = 1 ]; then echo "gpu_check: DRY RUN (GPU_CHECK_DRY_RUN=1): commands are printed, not run"; fi

# --- preflight: a CUDA GPU, the environment, the data ------------------------------------------
if [ "$DRY" != 1 ]; then
  command -v nvidia-smi > /dev/null 2>&1 || die "no nvidia-smi on PATH: this check needs an NVIDIA GPU with its driver"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > /dev/null 2>&1 \
    || die "nvidia-smi cannot talk to a GPU (driver not loaded / no device visible)"
fi

if [ "$DRY" = 1 ] || "$PY" -c "import torch, deepspeed, transformers, timm, vlm, vision_encoders, data_pipelines" > /dev/null 2>&1; then
  if [ ! -f data/default/.built ]; then
    # -o: treat the setup stamp as up to date (the environment works; pip must not run offline)
    cmd make -o "$VENV/.installed" data PY="$PY"
  fi
else
  echo "gpu_check: $PY cannot import the packages: running 'make setup data' (pip needs the network)"
  cmd make setup data
fi

if [ "$DRY" != 1 ]; then
  "$PY" - "$DEVICE" <<'EOF' || die "CUDA preflight failed (see above): torch cannot use the GPU"
import sys, torch
dev = torch.device(sys.argv[1])
if not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} (CUDA {torch.version.cuda}): torch.cuda.is_available() is False")
p = torch.cuda.get_device_properties(dev)
print(f"gpu: {p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor} | torch {torch.__version__} "
      f"| cuda {torch.version.cuda} | bf16 {torch.cuda.is_bf16_supported()}")
import deepspeed
print("deepspeed", deepspeed.__version__)
EOF
  [ -f data/default/.built ] || die "data/default is missing and 'make data' did not build it"
fi

# --- (a) the CUDA test subset ------------------------------------------------------------------
if wants tests; then
  step tests 180 env VLM_TEST_DEVICE="$DEVICE" "$PY" -m pytest -m device -q -p no:cacheprovider \
    -o addopts="" -r fEs tests
fi

# --- (b) 100 steps of vlm_small, DeepSpeed ZeRO-2, bf16, deepspeed launcher ----------------------
if wants train; then
  if [ "$DRY" = 1 ]; then PORT='<free port>'; else
    PORT=$("$PY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
  fi
  if [ "$DRY" != 1 ]; then rm -f "$RUN_DIR/metrics.jsonl"; fi   # the check reads this run's records only
  # the deepspeed launcher next to $PY (DeepSpeed 0.19's launcher wants --module, not -m)
  DS=$PY_BIN_DIR/deepspeed
  [ -x "$DS" ] || DS=deepspeed
  if [[ "$DEVICE" == cuda:* ]]; then GPUS=(--include "localhost:${DEVICE#cuda:}"); else GPUS=(--num_gpus 1); fi
  step train 300 "$DS" "${GPUS[@]}" --master_port "$PORT" --module vlm.train --config "$TRAIN_CONFIG" \
    device=cuda precision=bf16 train.max_steps="$TRAIN_STEPS"
  step train-metrics 30 "$PY" scripts/check_train_metrics.py "$RUN_DIR/metrics.jsonl" \
    --steps "$TRAIN_STEPS" --min-drop 0.1
fi

# --- (b') the MFU of a ~1B-parameter ConceptMoE at 8K packed tokens (configs/train/gpu_mfu.yaml) ---
if wants mfu; then
  if [ "$DRY" = 1 ]; then PORT='<free port>'; else
    PORT=$("$PY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
    rm -f runs/gpu_mfu/metrics.jsonl
  fi
  DS=$PY_BIN_DIR/deepspeed
  [ -x "$DS" ] || DS=deepspeed
  if [[ "$DEVICE" == cuda:* ]]; then GPUS=(--include "localhost:${DEVICE#cuda:}"); else GPUS=(--num_gpus 1); fi
  step mfu-docs 30 "$PY" scripts/gpu_mfu.py docs
  step mfu-1b 150 "$DS" "${GPUS[@]}" --master_port "$PORT" --module vlm.train --config configs/train/gpu_mfu.yaml
  step mfu-report 20 "$PY" scripts/gpu_mfu.py report
fi

# --- (c) the GPU benchmarks -------------------------------------------------------------------
if wants bench; then
  if [ "$BENCH_MODE" = full ]; then
    step bench-gpu.sh 480 env OUT="$BENCH_OUT" DEVICE="$DEVICE" PY="$PY" bash benchmarks/gpu.sh
  elif grep -q GPU_BENCH_QUICK benchmarks/gpu.sh; then
    step bench-gpu.sh-quick 270 env GPU_BENCH_QUICK=1 OUT="$BENCH_OUT" DEVICE="$DEVICE" PY="$PY" bash benchmarks/gpu.sh
  else
    # benchmarks/gpu.sh has no quick mode yet: its scripts at reduced sizes (gpu.sh: 1K..64K
    # prefill, KV 1K..32K decode, 5-10 rounds each; here fewer sizes and 3 rounds)
    B=(--device "$DEVICE" --dtype bfloat16 --out "$BENCH_OUT")
    step bench-prefill 75 "$PY" -m benchmarks.prefill "${B[@]}" --sizes 1024,8192,32768 --reps 3
    step bench-decode 75 "$PY" -m benchmarks.decode "${B[@]}" --sizes 1024,8192 --batches 1,8 --reps 3
    step bench-moe 45 "$PY" -m benchmarks.moe "${B[@]}" --sizes 64,1024,16384 --reps 3
    step bench-train 50 "$PY" -m benchmarks.train "${B[@]}" --reps 3
    # the training path (issue targets: flash varlen >= 2x the dense mask at 8K; dechunk 16K / 1K)
    step bench-attention 45 "$PY" -m benchmarks.attention "${B[@]}" --sizes 8192,16384 --reps 5
    step bench-dechunk 30 "$PY" -m benchmarks.dechunk "${B[@]}" --sizes 1024,16384 --reps 5
    step bench-train-packed 90 "$PY" -m benchmarks.train_packed "${B[@]}" --sizes 8192 --reps 5
    step bench-summary 20 "$PY" -m benchmarks.run_all --summary-only --device "$DEVICE" --out "$BENCH_OUT"
  fi
fi

# --- summary ----------------------------------------------------------------------------------
TOTAL=$(elapsed)
echo
echo "=== gpu_check summary ($(date -u +%Y-%m-%dT%H:%M:%SZ))"
FAILED=0
for i in "${!NAMES[@]}"; do
  printf '  %-22s %6ss  %s\n' "${NAMES[$i]}" "${TIMES[$i]}" "${RESULTS[$i]}"
  case ${RESULTS[$i]} in ok | "dry run") ;; *) FAILED=1 ;; esac
done
printf '  %-22s %6ss  (budget %ss)\n' total "$TOTAL" "$BUDGET_S"
if [ "$TOTAL" -gt "$BUDGET_S" ]; then
  echo "gpu_check: WARNING: took ${TOTAL}s, over the ${BUDGET_S}s budget"
fi
if [ "$DRY" != 1 ]; then echo "gpu_check: log $LOG; training run $RUN_DIR; benchmark results $BENCH_OUT"; fi
if [ "$FAILED" -ne 0 ]; then
  echo "gpu_check: FAILED"
  exit 1
fi
if [ "$DRY" = 1 ]; then echo "gpu_check: dry run done"; else echo "gpu_check: all steps passed"; fi
