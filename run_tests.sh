#!/usr/bin/env bash
# Test: ./run_tests.sh [--slow] [pytest args...]   (default: every test not marked slow)
# What runs where: every CPU test computes on the CPU with gloo, on any machine (tests/conftest.py sets
# TITANLITE_DEVICE=cpu, so a GPU server runs them as a laptop does); tests marked `gpu` (tests/gpu/) run
# where torch sees a CUDA GPU, on CUDA/NCCL, and are skipped with the reason elsewhere. `-m gpu`: only them.
set -euo pipefail
cd "$(dirname "$0")"
source scripts/setup_env.sh

marker=(-m "not slow")
args=()
workers=(-n "${TITANLITE_TEST_WORKERS:-2}" --dist worksteal)  # pytest-xdist: two pytest processes side by side
for arg in "$@"; do
  case "$arg" in
    --slow) marker=() ;;
    -n|-n[0-9]*|--numprocesses|--numprocesses=*|no:xdist|-pno:xdist) workers=(); args+=("$arg") ;;  # the caller's
    *) args+=("$arg") ;;
  esac
done
if [ ${#workers[@]} -gt 0 ] && ! "$PY" -c 'import xdist' 2>/dev/null; then  # an environment of one's own (TITANLITE_PYTHON)
  echo "titanlite: pytest-xdist is not installed in $PY: the tests run in one process (pip install pytest-xdist for two)" >&2
  workers=()
fi
exec "$PY" -m pytest "${marker[@]}" "${workers[@]}" "${args[@]}"
