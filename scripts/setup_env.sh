# Sourced by run_train.sh and run_tests.sh: make sure .venv exists with titanlite installed, then set $PY.
# The first run creates it (about a minute); later runs reuse it until pyproject.toml changes.
# Torch: on a machine without an NVIDIA GPU this installs the CPU build (torch==2.13.0 here comes from the
# local wheel; elsewhere set TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu to avoid CUDA packages).
# TORCH_SPEC overrides the requirement, e.g. TORCH_SPEC='torch==2.11.0'.

# TITANLITE_PYTHON=/path/to/python uses an environment you manage yourself and skips all set-up.

TITANLITE_VENV=${TITANLITE_VENV:-.venv}
PY="${TITANLITE_PYTHON:-$TITANLITE_VENV/bin/python}"
_stamp="$TITANLITE_VENV/.titanlite-setup"
_want=$(cat pyproject.toml scripts/setup_env.sh | sha256sum | cut -c1-16)

if [ -z "${TITANLITE_PYTHON:-}" ] && { [ ! -x "$PY" ] || [ "$(cat "$_stamp" 2>/dev/null)" != "$_want" ]; }; then
  echo "titanlite: setting up $TITANLITE_VENV (first run only, about a minute)..." >&2
  if ! python3 -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
    echo "titanlite: error: python3 >= 3.10 is needed; found $(python3 --version 2>&1)" >&2
    exit 2
  fi
  [ -x "$PY" ] || python3 -m venv "$TITANLITE_VENV" || { echo "titanlite: error: could not create $TITANLITE_VENV (install python3-venv)" >&2; exit 2; }
  if ! "$PY" -c 'import torch' 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
      _torch=${TORCH_SPEC:-torch>=2.11}
    else
      _torch=${TORCH_SPEC:-torch==2.13.0}
    fi
    "$PY" -m pip install -q ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$_torch" >&2 \
      || { echo "titanlite: error: could not install $_torch into $TITANLITE_VENV" >&2; exit 1; }
  fi
  "$PY" -m pip install -q --no-build-isolation -e ".[test]" >&2 \
    || { echo "titanlite: error: could not install titanlite into $TITANLITE_VENV" >&2; exit 1; }
  echo "$_want" > "$_stamp"
fi
