#!/usr/bin/env bash
# The GPU weight-sync measurements of docs/WEIGHT_SYNC.md in one go, on a 2xH200 host
# (plain processes, no Ray). Each step has its own time limit so a slow one cannot eat the
# rest; JSON lines go to $OUT (default ./bench-out).
#   bash benchmarks/run_h200.sh [dense7b|moe30b|gputests ...]
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
                --json-out "$out/weight_sync.jsonl" 2>&1 | tee "$out/moe30b.log" ;;
    gputests) timeout -k 10 "${TEST_LIMIT:-200}" python3 -m pytest -q -p no:cacheprovider -x -s \
                tests/reference_engine/test_gpu.py 2>&1 | tee "$out/gputests.log" ;;
    *) echo "unknown step $step" ;;
  esac
done
