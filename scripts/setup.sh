#!/usr/bin/env bash
# Creates (or updates) the project's virtual environment in .venv with the given extras, e.g. `setup.sh test`.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${1:-reference}"
PY="${PYTHON:-python3}"
exec 9<"$0"
flock 9  # demo.sh and test.sh started together: one pip at a time in .venv
healthy() {  # Python 3.11+, with pip, and (once installed) an entry point that runs from this directory
    .venv/bin/python -c 'import sys, pip; assert sys.version_info >= (3, 11)' 2>/dev/null &&
        { [ ! -e .venv/bin/camshaft ] || .venv/bin/camshaft --help >/dev/null 2>&1; }
}
if [ -e .venv ] && ! healthy; then
    echo "setup: .venv is unusable (interrupted, moved, or not Python 3.11+): recreating it" >&2
    rm -rf .venv
fi
if [ ! -x .venv/bin/python ]; then
    "$PY" -c 'import sys; assert sys.version_info >= (3, 11)' 2>/dev/null || {
        echo "setup: $PY is $("$PY" --version 2>&1); camshaft needs Python 3.11+: set PYTHON=python3.11" >&2; exit 1; }
    echo "setup: creating .venv (the first run installs torch and the rest: a few minutes)" >&2
    "$PY" -m venv .venv
fi
STAMP=".venv/.camshaft-installed-$EXTRAS"
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ]; then
    echo "setup: installing camshaft[$EXTRAS] into .venv" >&2
    # torch first and pinned to 2.13.0 (these machines hold its CPU wheel; elsewhere install a CPU build first)
    .venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
    .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[$EXTRAS]"
    touch "$STAMP"
fi
