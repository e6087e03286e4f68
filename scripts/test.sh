#!/usr/bin/env bash
# Runs the whole test suite on a CPU: lint, then pytest. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
export SLIME_LIKE_SGLANG="${SLIME_LIKE_SGLANG:-1}"
source scripts/env.sh
python -m ruff check slime_like tests benchmarks
python -m pytest -q "$@"
