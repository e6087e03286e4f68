#!/usr/bin/env bash
# The GPU weight-sync measurements of docs/WEIGHT_SYNC.md in one go (plain processes, no
# Ray). dense7b/moe30b need 2 GPUs (trainer GPU 0, engine GPU 1); tensor and receiver run on
# one. Each step has its own time limit so a slow one cannot eat the rest; JSON lines go to
# $OUT (default ./bench-out).
# `colocate` runs the colocated step phase by phase on one GPU (docs/COLOCATE.md).
# `colocatejob` runs the 0.75B colocated job itself (needs Ray and sglang-router installed):
#   colocated, with the trainer's weights kept on the GPU, with the engines' weights backup,
#   and nothing moving (JOB_VARIANTS picks some; JOB_MODEL="--tiny-model-layers 28
#   --tiny-model-hidden 3072" runs a 3B-shaped model instead of the 0.75B one).
# `fp8` runs the FP8 sync against the unquantized one on one GPU, both colocated (tensor).
#   bash benchmarks/run_h200.sh [dense7b|moe30b|tensor|fp8|receiver|control|colocate|colocatejob|gputests ...]
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-bench-out}"
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
steps=("${@:-dense7b moe30b}")
for step in ${steps[*]}; do
  echo "=== $step $(date +%T)"
  case "$step" in
    dense7b)  timeout -k 10 "${DENSE_LIMIT:-230}" python3 benchmarks/weight_sync.py --layout dense7b \
                --engines 1 --json-out "$out/weight_sync.jsonl" 2>&1 | tee "$out/dense7b.log" ;;
    moe30b)   timeout -k 10 "${MOE_LIMIT:-300}" python3 benchmarks/weight_sync.py --layout moe30b \
                --engines 1 --verify "${MOE_VERIFY:-ends}" --repeats 2 \
                --modes raw,per_tensor,ours,facade,sglang_per_tensor \
                --json-out "$out/weight_sync.jsonl" 2>&1 | tee "$out/moe30b.log" ;;
    tensor)   for params in separate flat; do
                timeout -k 10 "${TENSOR_LIMIT:-200}" python3 benchmarks/weight_sync.py --layout dense7b \
                  --modes tensor --trainer-params $params --bucket-mb "${TENSOR_BUCKETS:-1024,2048,4096}" \
                  --repeats "${TENSOR_REPEATS:-5}" --json-out "$out/weight_sync.jsonl" 2>&1 \
                  | tee -a "$out/tensor.log"
              done ;;
    fp8)      timeout -k 10 "${FP8_LIMIT:-240}" python3 benchmarks/fp8_sync.py --device cuda \
                --layout dense7b --transport tensor --bucket-mb 1024 --warmup 2 \
                --json-out "$out/fp8_sync.jsonl" 2>&1 | tee "$out/fp8.log" ;;
    control)  timeout -k 10 "${CONTROL_LIMIT:-120}" python3 benchmarks/control_plane.py --device cuda \
                --json-out "$out/control_plane.jsonl" 2>&1 | tee "$out/control.log" ;;
    receiver) timeout -k 10 "${RECEIVER_LIMIT:-200}" python3 benchmarks/receiver_load.py \
                --layout dense7b,moe30b --bucket-mb 512,1024 \
                --json-out "$out/receiver_load.jsonl" 2>&1 | tee "$out/receiver.log" ;;
    colocate) timeout -k 10 "${COLOCATE_LIMIT:-330}" python3 benchmarks/colocate.py \
                --layout "${COLOCATE_LAYOUTS:-tiny0.75b,dense7b}" --steps "${COLOCATE_STEPS:-5}" \
                --json-out "$out/colocate.jsonl" 2>&1 | tee "$out/colocate.log" ;;
    colocatejob)  # the job itself (Ray + router): colocated; with the trainer's weights kept
              # on the GPU; with the engines' host backup of their weights; nothing moving
              sed 's/^sglang_enable_weights_cpu_backup: false/sglang_enable_weights_cpu_backup: true/' \
                configs/colocate_cpu.yaml > "$out/colocate_backup.yaml"
              for variant in ${JOB_VARIANTS:-colocated keep_weights backup no_offload}; do
                extra=(); config=configs/colocate_cpu.yaml
                [ "$variant" = keep_weights ] && extra=(--no-offload-train-weights)
                [ "$variant" = backup ] && config="$out/colocate_backup.yaml"
                [ "$variant" = no_offload ] && extra=(--no-offload-train --no-offload-rollout)
                timeout -k 10 "${JOB_LIMIT:-240}" python3 -m slime_like.train \
                  --config "$config" --num-rollout "${JOB_STEPS:-8}" \
                  ${JOB_MODEL:---tiny-model-layers 16 --tiny-model-hidden 2048} \
                  --update-weight-buffer-size 1073741824 --output-dir "${JOB_DIR:-runs/colocate-job}/$variant" \
                  "${extra[@]}" > "$out/job-$variant.log" 2>&1
                echo "job $variant: exit $?"
                python3 benchmarks/job_phases.py "${JOB_DIR:-runs/colocate-job}/$variant/metrics.jsonl" \
                  --label "$variant" --d2d --json-out "$out/job_phases.jsonl"
              done ;;
    gputests) timeout -k 10 "${TEST_LIMIT:-200}" python3 -m pytest -q -p no:cacheprovider -x -s \
                tests/reference_engine/test_gpu.py tests/trainer/test_offload_gpu.py 2>&1 \
                | tee "$out/gputests.log" ;;
    *) echo "unknown step $step" ;;
  esac
done
