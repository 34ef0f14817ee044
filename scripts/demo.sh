#!/usr/bin/env bash
# The main job on the built-in default: install, then compile the bundled model (gpt3-1.3b) for
# the bundled mixed-GPU preset (16xA100-80G + 16xV100-32G + 8xL4) and print the search report.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
partita compile --out out/default
partita report out/default
