#!/usr/bin/env bash
# The default job on this machine (CPU is enough): two reference engines behind
# sglang-router, one trainer, a tiny model learning a toy task, an engine killed mid-run
# and recovered. Submitted as a Ray job; extra arguments go to the job.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
exec bash scripts/run_job.sh --config configs/quickstart.yaml "$@"
