#!/usr/bin/env bash
# Installs the test environment and runs the whole suite (lint, then tests). `.ci/run` calls exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
.venv/bin/ruff check . || { echo "test.sh: ruff failed; the tests were not run" >&2; exit 1; }
.venv/bin/python -m pytest "$@"  # pytest arguments pass through, e.g. -q, -x, -m 'not slow', tests/test_cli.py
