#!/usr/bin/env bash
# Test: ./run_tests.sh [--slow] [pytest args...]   (default: every test not marked slow)
set -euo pipefail
cd "$(dirname "$0")"
source scripts/setup_env.sh

marker=(-m "not slow")
args=()
for arg in "$@"; do
  if [ "$arg" = "--slow" ]; then marker=(); else args+=("$arg"); fi
done
exec "$PY" -m pytest "${marker[@]}" "${args[@]}"
