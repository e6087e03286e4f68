#!/usr/bin/env bash
# Launches a slime_like job the way a cluster user does: as a Ray job.
#
#   bash scripts/run_job.sh --config configs/quickstart.yaml [FLAG ...]
#
# With RAY_ADDRESS set (http://head:8265), the job goes to that cluster. Without it, a
# private single-node Ray cluster is started for the job (token auth on, GPUs declared
# for the placement group on machines without any) and stopped afterwards; other Ray
# clusters on the machine are left alone.
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$(pwd)"

args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --config|--sglang-config|--hf-checkpoint|--output-dir|--update-weight-disk-dir)
      # the job's working directory is not ours: hand it absolute paths
      args+=("$1" "$(python -c 'import os,sys; print(os.path.abspath(sys.argv[1]))' "$2")"); shift 2 ;;
    *) args+=("$1"); shift ;;
  esac
done
case " ${args[*]} " in
  *" --output-dir "*) ;;
  *) args+=(--output-dir "$repo/runs/$(date +%Y%m%d-%H%M%S)") ;;
esac

export RAY_AUTH_MODE=token
if [ -z "${RAY_ADDRESS:-}" ]; then
  ray_tmp="$(mktemp -d /tmp/slr.XXXXXX)"   # short: Ray's socket paths must fit in 107 bytes
  export RAY_AUTH_TOKEN_PATH="$ray_tmp/auth_token"
  python -c 'import secrets; print(secrets.token_hex(32))' > "$RAY_AUTH_TOKEN_PATH"
  stop_cluster() {
    # Only this job's cluster: every process started with our temp dir.
    pkill -TERM -f -- "$ray_tmp" 2>/dev/null || true
    sleep 2
    pkill -KILL -f -- "$ray_tmp" 2>/dev/null || true
    rm -rf "$ray_tmp"
  }
  trap stop_cluster EXIT
  read -r gcs_port dash_port bundles gpus < <(python - "${args[@]}" <<'PY'
import socket, sys
from slime_like.config.layout import layout_from_args
from slime_like.config.parse import parse_args
def free():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
bundles = layout_from_args(parse_args(sys.argv[1:])).num_bundles
try:
    import torch
    gpus = torch.cuda.device_count()
except ImportError:
    gpus = 0
print(free(), free(), bundles, gpus if gpus else bundles)
PY
)
  echo "[slime_like] starting a private Ray cluster ($gpus GPUs declared, $bundles bundles needed)"
  ray start --head --temp-dir "$ray_tmp" --port "$gcs_port" --dashboard-host 127.0.0.1 \
    --dashboard-port "$dash_port" --include-dashboard true --num-cpus "$((bundles + 4))" \
    --num-gpus "$gpus" --disable-usage-stats >"$ray_tmp/ray_start.log" 2>&1 \
    || { cat "$ray_tmp/ray_start.log"; exit 1; }
  export RAY_ADDRESS="http://127.0.0.1:$dash_port"
fi

ray job submit --address "$RAY_ADDRESS" --runtime-env-json \
  '{"env_vars": {"NCCL_NVLS_ENABLE": "0", "PYTHONUNBUFFERED": "1"}}' \
  -- python -m slime_like.train "${args[@]}"
