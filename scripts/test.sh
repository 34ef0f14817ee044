#!/usr/bin/env bash
# Install with test extras, then lint, type-check and run every test (slow and multi-process
# ones included). pytest's exit code 5 ("no tests collected") fails this script like any error.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
python -m ruff check partita tests bench
python -m ruff format --check partita tests bench
python -m mypy
OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" python -m pytest -q -ra "$@"
