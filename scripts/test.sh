#!/usr/bin/env bash
# Runs the whole test suite on a CPU: lint, then pytest (3 workers). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
export SLIME_LIKE_SGLANG="${SLIME_LIKE_SGLANG:-1}"
source scripts/env.sh
python -m ruff check slime_like tests benchmarks
# Most tests wait on processes (Ray, routers, engines), not on the CPU: three workers fit
# two cores. SLIME_LIKE_TEST_WORKERS=0 runs everything in this process.
workers="${SLIME_LIKE_TEST_WORKERS:-3}"
if [ "$workers" = "0" ]; then
  python -m pytest -q "$@"
else
  # Whole modules to a worker (their fixtures start once), heaviest first (tests/conftest.py).
  python -m pytest -q -n "$workers" --dist loadscope --no-loadscope-reorder "$@"
fi
