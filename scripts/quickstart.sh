#!/usr/bin/env bash
# Runs the default job on this machine (CPU is enough). Extra arguments go to the job.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
exec python -m slime_like.quickstart "$@"
