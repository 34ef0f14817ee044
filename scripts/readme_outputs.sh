#!/usr/bin/env bash
# Regenerate (--write) or check (--check) every command output shown in README.md; the blocks and
# their commands are listed in scripts/readme_outputs.py. Example: bash scripts/readme_outputs.sh --write
set -euo pipefail
cd "$(dirname "$0")/.."
exec python scripts/readme_outputs.py "$@"
