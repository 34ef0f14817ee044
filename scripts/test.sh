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
# Two pytest workers (CI has 2 cores); a test file stays on one worker (--dist loadfile), so a module's
# fixtures (a compiled plan, one torchrun launch) are built once. --no-loadscope-reorder keeps the order
# tests/conftest.py gives the files (the costliest first; xdist >= 3.8) instead of xdist's most-tests-first.
# Tests marked `serial` measure within a time budget (the profiler's fit, a trace-time bound), so they run
# afterwards, alone. Exit code 5 ("no tests collected") fails the script unless arguments narrowed the
# run to one of the two phases.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
trap 'exit 130' INT  # Ctrl-C in the parallel phase does not start the serial one
set +e
python -m pytest -q -ra -n "${PARTITA_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder -m "not serial" "$@"
parallel=$?
python -m pytest -q -ra -m serial "$@"
serial=$?
set -e
if [ $# -gt 0 ]; then
  if [ $serial -eq 5 ] && [ $parallel -ne 5 ]; then serial=0; fi
  if [ $parallel -eq 5 ] && [ $serial -eq 0 ]; then parallel=0; fi
fi
if [ $parallel -ne 0 ]; then exit $parallel; fi
exit $serial
