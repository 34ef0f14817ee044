#!/usr/bin/env bash
# The main job on the built-in default: install, then compile the bundled model (gpt3-6.7b) for
# the bundled mixed-GPU preset (16xA100-80G + 16xV100-32G + 8xL4). `partita compile` prints the
# search report itself (once) and says whether the plan came from the compile cache and where that is.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
partita compile --out out/default
echo
echo "The report is in out/default/report.txt; 'partita report out/default --html plan.html' writes the page."
