#!/usr/bin/env bash
# Installs the test environment and runs the whole suite (lint, then tests). `.ci/run` calls exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
.venv/bin/ruff check .
.venv/bin/python -m pytest "$@"
