#!/usr/bin/env bash
# Launches a slime_like job the way a cluster user does: as a Ray job.
#
#   bash scripts/run_job.sh --config configs/quickstart.yaml [FLAG ...]
#
# The flags are validated here first (a bad one is the CLI's one-line error, exit 2, and
# nothing is started). With RAY_ADDRESS set (http://head:8265), the job goes to that
# cluster. Without it, a private single-node Ray cluster is started for the job (token
# auth on, GPUs declared for the placement group on machines without any) and every
# process of it is stopped afterwards; other Ray clusters on the machine are left alone.
#
#   SLIME_LIKE_SUBMIT_TIMEOUT  seconds to wait for the dashboard and the head node's job
#                              agent before giving up (default 120)
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$(pwd)"

args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --config|--sglang-config|--hf-checkpoint|--output-dir|--update-weight-disk-dir|--wandb-dir|--tensorboard-dir)
      if [ $# -lt 2 ]; then args+=("$1"); shift; continue; fi  # the validation names it
      # the job's working directory is not ours: hand it absolute paths
      args+=("$1" "$(python -c 'import os,sys; print(os.path.abspath(sys.argv[1]))' "$2")"); shift 2 ;;
    *) args+=("$1"); shift ;;
  esac
done
case " ${args[*]} " in
  *" --output-dir "*) ;;
  *) args+=(--output-dir "$repo/runs/$(date +%Y%m%d-%H%M%S)") ;;
esac

# A dry run needs no cluster: print the plan here.
case " ${args[*]} " in *" --dry-run "*) exec python -m slime_like.cli train "${args[@]}" ;; esac
# Validate before starting anything: the CLI prints a one-line error and exits 2.
python -m slime_like.cli train --dry-run "${args[@]}" >/dev/null || exit 2

export RAY_AUTH_MODE=token
if [ -z "${RAY_ADDRESS:-}" ]; then
  ray_tmp="$(mktemp -d /tmp/slr.XXXXXX)"   # short: Ray's socket paths must fit in 107 bytes
  export RAY_AUTH_TOKEN_PATH="$ray_tmp/auth_token"
  python -c 'import secrets; print(secrets.token_hex(32))' > "$RAY_AUTH_TOKEN_PATH"
  read -r bundles gpus < <(python - "${args[@]}" <<'PY'
import sys
from slime_like.config.layout import layout_from_args
from slime_like.config.parse import parse_args
bundles = layout_from_args(parse_args(sys.argv[1:])).num_bundles
try:
    import torch
    gpus = torch.cuda.device_count()
except ImportError:
    gpus = 0
print(bundles, gpus if gpus else bundles)
PY
)
  gcs_port=""
  stop_cluster() {
    # Every process of this cluster and their children (agents, workers, client server);
    # `ray stop` would stop every Ray cluster of the machine.
    python -m slime_like.submit.local_cluster stop --temp-dir "$ray_tmp" ${gcs_port:+--gcs-port "$gcs_port"} || true
    rm -rf "$ray_tmp"
  }
  trap stop_cluster EXIT
  echo "[slime_like] starting a private Ray cluster ($gpus GPUs declared, $bundles bundles needed)"
  # Free ports for all of Ray's fixed defaults: another cluster on the machine holding the
  # dashboard agent's 52365 would leave this one without a job agent.
  ports="$(python -m slime_like.submit.local_cluster start --temp-dir "$ray_tmp" \
    --num-cpus "$((bundles + 4))" --num-gpus "$gpus")" || exit 1
  read -r gcs_port dash_port <<<"$ports"
  export RAY_ADDRESS="http://127.0.0.1:$dash_port"
fi

# Waits for the dashboard and the head node's job agent, follows the job's logs, and
# exits non-zero unless the job succeeded.
python -m slime_like.submit.ray_job --address "$RAY_ADDRESS" --timeout "${SLIME_LIKE_SUBMIT_TIMEOUT:-120}" \
  --env '{"NCCL_NVLS_ENABLE": "0", "PYTHONUNBUFFERED": "1"}' \
  -- python -m slime_like.train "${args[@]}"
