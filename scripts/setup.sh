#!/usr/bin/env bash
# Creates (or updates) the project's virtual environment in .venv with the given extras, e.g. `setup.sh test`.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${1:-reference}"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
STAMP=".venv/.camshaft-installed-$EXTRAS"
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ]; then
    # torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
    .venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
    .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[$EXTRAS]"
    touch "$STAMP"
fi
