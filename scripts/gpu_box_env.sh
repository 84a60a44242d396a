#!/usr/bin/env bash
# An offline GPU box: make .venv on top of a Python that already holds torch (by default `python3`), so that
# ./run_tests.sh, ./run_train.sh and the `.venv/bin/titanlite` the docs call work there with no package registry.
#   scripts/gpu_box_env.sh [WHEEL_DIR]
# .venv sees the base Python's packages (a .pth file lists its site-packages) and gets titanlite installed
# editable. Wheels in WHEEL_DIR (default .whl; downloaded elsewhere, docs/testing.md says how) are installed into
# .venv first, ahead of the base's packages; WHEEL_DIR/maybe/protobuf-*.whl only where the base's protobuf is
# older than 5 (wandb needs 5 or later). The stamp run_tests.sh checks is written, so it installs nothing more.
set -euo pipefail
cd "$(dirname "$0")/.."
BASE=${TITANLITE_BASE_PYTHON:-python3}
WHEELS=${1:-.whl}
"$BASE" -c 'import torch' 2>/dev/null || { echo "gpu_box_env: error: $BASE cannot import torch" >&2; exit 2; }
rm -rf .venv
"$BASE" -m venv --without-pip .venv
site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$BASE" -c 'import site; print("\n".join(site.getsitepackages()))' > "$site/_base_python.pth"
pip=(.venv/bin/python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --ignore-installed)
shopt -s nullglob
wheels=("$WHEELS"/*.whl)
if .venv/bin/python -c 'import sys, google.protobuf as p; sys.exit(int(p.__version__.split(".")[0]) >= 5)' 2>/dev/null
then wheels+=("$WHEELS"/maybe/protobuf-*.whl)
fi
[ ${#wheels[@]} -eq 0 ] || "${pip[@]}" "${wheels[@]}"
"${pip[@]}" --no-build-isolation -e .
cat pyproject.toml scripts/setup_env.sh | sha256sum | cut -c1-16 > .venv/.titanlite-setup
.venv/bin/python - <<'PY'
# titanlite went in without its dependencies (--no-deps): name every one of them, and of the test extra, that is
# missing, so that its wheels can be brought (tests that need one fail or skip without it).
import importlib.metadata as md
import re
import torch
missing: dict[str, str] = {}
for requirement in md.requires("titanlite") or []:
    name, marker = re.split(r"[ ;<>=!~\[]", requirement, maxsplit=1)[0], requirement.partition(";")[2]
    if marker and "extra" not in marker:
        continue  # a Python-version marker (tomli on 3.10)
    try:
        md.version(name)
    except md.PackageNotFoundError:
        extra = re.search(r'extra == "(\w+)"', marker)
        missing.setdefault(name, name + (f" ([{extra.group(1)}])" if extra else ""))
print("gpu_box_env: .venv ready, torch", torch.__version__)
if missing:
    print("gpu_box_env: warning: not installed (bring their wheels in .whl):", ", ".join(missing.values()))
PY
