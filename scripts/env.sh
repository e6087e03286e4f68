# shellcheck shell=bash
# Creates (or reuses) the project's virtual environment and activates it.
# Sourced by scripts/quickstart.sh and scripts/test.sh; safe to re-run.
#   SLIME_LIKE_VENV    where the environment lives (default: .venv in the repo)
#   SLIME_LIKE_SGLANG  1 = also install sglang 0.5.23 --no-deps for the contract tests
#   SLIME_LIKE_RAY_VERSION  install exactly this Ray (e.g. the oldest supported, 2.52.1)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${SLIME_LIKE_VENV:-$repo/.venv}"
python_bin="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
  echo "[slime_like] creating virtual environment in $venv"
  "$python_bin" -m venv "$venv"
fi
# shellcheck disable=SC1091
source "$venv/bin/activate"

# sshd for the multi-node tests (tests/hosts/): each simulated host runs its own, as a real
# node would. A no-op where it is installed; without root or apt those tests skip, saying so.
if [ ! -x /usr/sbin/sshd ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[slime_like] installing openssh-server (the multi-node tests run an sshd per host)"
    { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
        --no-install-recommends openssh-server; } >/dev/null \
      || echo "[slime_like] apt-get could not install openssh-server; the multi-node tests will skip"
  else
    echo "[slime_like] /usr/sbin/sshd is missing and this is not root with apt-get:" \
      "install openssh-server for the multi-node tests (tests/hosts/)"
  fi
fi

stamp="$venv/.slime_like_stamp"
want="$(cat "$repo/pyproject.toml" "$repo/scripts/env.sh" | sha256sum | cut -c1-16)-sglang${SLIME_LIKE_SGLANG:-0}-ray${SLIME_LIKE_RAY_VERSION:-}"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  python -m pip install -q --upgrade pip
  if ! python -c "import torch" 2>/dev/null; then
    # A CPU build of torch: the CUDA wheel PyPI serves on Linux is several GB and useless here.
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
      python -m pip install -q "torch>=2.6"
    elif [ "$(uname -s)" = "Darwin" ]; then
      python -m pip install -q "torch==2.13.0"
    else
      extra=()
      if python - <<'PY' 2>/dev/null; then
import socket
socket.setdefaulttimeout(3)
socket.getaddrinfo("download.pytorch.org", 443)
PY
        extra=(--extra-index-url https://download.pytorch.org/whl/cpu)
      fi
      python -m pip install -q "torch==2.13.0+cpu" "${extra[@]}"
    fi
  fi
  python -m pip install -q -e "$repo[test]"
  if [ -n "${SLIME_LIKE_RAY_VERSION:-}" ]; then
    # e.g. 2.52.1, the oldest supported Ray: run the tests against it instead of the newest.
    python -m pip install -q "ray[default]==${SLIME_LIKE_RAY_VERSION}"
  fi
  if [ "${SLIME_LIKE_SGLANG:-0}" = "1" ]; then
    # sglang's own weight-sync and server-args code imports on a CPU without its CUDA stack;
    # the contract tests use it as the other side. Failure here only skips those tests.
    python -m pip install -q --no-deps "sglang==0.5.23" \
      && python -m pip install -q pybase64 triton pillow msgspec pyzmq IPython \
      || echo "[slime_like] sglang could not be installed; its contract tests will be skipped"
  fi
  echo "$want" > "$stamp"
fi
