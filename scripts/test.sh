#!/usr/bin/env bash
# Install with test extras, then lint, type-check and run every test (slow and multi-process
# ones included). pytest's exit code 5 ("no tests collected") fails this script like any error.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
# The HTML report is checked in a real headless browser (Debian's chromium).
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null 2>&1 \
    || echo "warning: could not install chromium; the HTML report test will fail in CI" >&2
fi
python -m ruff check partita tests bench
python -m ruff format --check partita tests bench
python -m mypy
OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" python -m pytest -q -ra "$@"
