#!/usr/bin/env bash
# GPU checks for a machine with CUDA: one short prepared script, run from the repository root after
# `make setup` and `.venv/bin/pip install -e '.[gpu]'` (TRL's vllm + quantization extras).
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]
#
# Every check runs the real CLI on the built-in `tiny-random` model (built offline, so a GPU machine
# without network access can run it) in a store under OUT_DIR, and ends as ok, FAIL or skip (with
# why). A failing check does not stop the others. The summary prints what ran, what was skipped and
# the wall time of each; each check's log is OUT_DIR/<check>.log.
#
#   bf16-smoke      the smoke config (SFT -> DPO -> two GRPO stages -> eval) in bf16 on the GPU, its GRPO
#                   stages with `zero_signal: resample` and `drop` (their tensors move to the GPU)
#   qlora-grpo      one GRPO step of a 4-bit (bitsandbytes NF4) QLoRA model
#   optim-8bit      one SFT step with bitsandbytes' 8-bit AdamW (`optim: adamw_bnb_8bit`)
#   vllm-colocate   one GRPO step whose rollouts come from vLLM in colocate mode, then a vLLM eval
#   ddp-2gpu        one SFT step on two GPUs with `launch.launcher: accelerate` (only with 2+ GPUs)
#
# GPU_CHECK_DRY_RUN=1 runs every check as `posttrain run --dry-run` whatever the hardware: the
# overrides are validated against the config schema and the plan is printed (tests/system/test_gpu_check.py).
set -u
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-$(mktemp -d -t posttrain-gpu-check-XXXX)}}
mkdir -p "$OUT"
BIN=${BIN:-.venv/bin}
export MLFLOW_TRACKING_URI="sqlite:///$OUT/mlflow.db" PYTHONUNBUFFERED=1

py() { "$BIN/python" -c "$1" 2>/dev/null; }
NGPU=$(py 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' || echo 0)
HAS_BNB=$(py 'import bitsandbytes; print(1)' || echo 0)
HAS_VLLM=$(py 'import vllm; print(1)' || echo 0)
echo "gpu_check: $NGPU CUDA device(s); bitsandbytes: $HAS_BNB; vllm: $HAS_VLLM; logs in $OUT"
[ "$NGPU" -gt 0 ] && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

SUMMARY=()
check() {  # check NAME SKIP_REASON -- posttrain run arguments...
    local name=$1 skip=$2
    shift 3
    if [ -n "${GPU_CHECK_DRY_RUN:-}" ] && [ "$skip" != "$NO_LAUNCHER" ]; then
        skip=""
        set -- "$@" --dry-run
    fi
    if [ -n "$skip" ]; then
        SUMMARY+=("$(printf '%-14s skip  %s' "$name" "$skip")")
        return
    fi
    local start=$SECONDS status=ok
    "$BIN/posttrain" run configs/smoke.yaml --set "orchestration.store=$OUT/store-$name" \
        --set "name=gpu-check-$name" "$@" >"$OUT/$name.log" 2>&1 || status=FAIL
    local line
    line=$(grep -E "strict [0-9.]+%|Error|error:" "$OUT/$name.log" | tail -1 | cut -c1-110)
    SUMMARY+=("$(printf '%-14s %-5s %4d s  %s' "$name" "$status" $((SECONDS - start)) "$line")")
}

NO_GPU=""; [ "$NGPU" -gt 0 ] || NO_GPU="no CUDA device"
NO_BNB=$NO_GPU; [ -n "$NO_BNB" ] || [ "$HAS_BNB" = 1 ] || NO_BNB="bitsandbytes not installed (pip install -e '.[quantization]')"
NO_VLLM=$NO_GPU; [ -n "$NO_VLLM" ] || [ "$HAS_VLLM" = 1 ] || NO_VLLM="vllm not installed (pip install -e '.[vllm]')"
NO_DDP=$NO_GPU; [ -n "$NO_DDP" ] || [ "$NGPU" -ge 2 ] || NO_DDP="one GPU only"
NO_LAUNCHER=""; grep -q "launcher" src/posttrain/core/config.py || NO_LAUNCHER="launch.launcher not in this version"
NO_DDP=${NO_LAUNCHER:-$NO_DDP}

ONLY_SFT=(--set dpo=null --set "grpo.stages=[]" --set sft.trainer.max_steps=1)
ONE_GRPO=(--set sft=null --set dpo=null --set grpo.stages.0.trainer.max_steps=1
          --set grpo.stages.1.trainer.max_steps=1)

check bf16-smoke "$NO_GPU" -- --set model.precision=bf16 --set grpo.stages.0.zero_signal=resample \
    --set grpo.stages.1.zero_signal=drop
check qlora-grpo "$NO_BNB" -- --set model.precision=bf16 --set model.quantization=4bit "${ONE_GRPO[@]}"
check optim-8bit "$NO_BNB" -- --set model.precision=bf16 --set sft.trainer.optim=adamw_bnb_8bit "${ONLY_SFT[@]}"
check vllm-colocate "$NO_VLLM" -- --set model.precision=bf16 "${ONE_GRPO[@]}" \
    --set grpo.stages.0.trainer.use_vllm=true --set grpo.stages.0.trainer.vllm_mode=colocate \
    --set grpo.stages.0.trainer.vllm_gpu_memory_utilization=0.2 --set eval.backend=vllm
check ddp-2gpu "$NO_DDP" -- --set model.precision=bf16 --set launch.launcher=accelerate "${ONLY_SFT[@]}"

echo
echo "check          status time  last result line"
printf '%s\n' "${SUMMARY[@]}"
! printf '%s\n' "${SUMMARY[@]}" | grep -q " FAIL "
