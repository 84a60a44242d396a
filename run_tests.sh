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
exec "$PY" -m pytest "${marker[@]}" "${workers[@]}" "${args[@]}"
