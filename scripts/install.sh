#!/usr/bin/env bash
# Install Partita and its dependencies. Without a GPU, take the CPU build of torch explicitly
# (on these machines `torch==2.13.0` is the CPU wheel that lies on disk; a plain `torch` would
# pull a multi-GB CUDA build). Usage: scripts/install.sh [extras], e.g. scripts/install.sh test
set -euo pipefail
cd "$(dirname "$0")/.."
# pip prints its "new release" notice once per call: two calls printed it twice in a fresh clone (issue 35)
export PIP_DISABLE_PIP_VERSION_CHECK=1
extras="${1:-}"
if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    python -m pip install -q "torch>=2.4,<=2.13.0"
  else
    python -m pip install -q "torch==2.13.0"
  fi
fi
# torchao, pyproject's [fp8] extra, for the fp8 tests only: into build/fp8-site, off the test process's path
# (transformers imports torchao whenever it can); tests/runtime/test_fp8_*.py hand it to their subprocesses
if [[ ",$extras," == *,test,* ]] && ! compgen -G "build/fp8-site/torchao-0.18.*.dist-info" >/dev/null; then
  python -m pip install -q --no-deps --upgrade --target build/fp8-site "torchao>=0.18,<0.19" \
    || echo "warning: could not install torchao into build/fp8-site: the fp8 tests will skip (see their reason)" >&2
fi
# scripts/constraints.txt pins what the shipped stored traces were made with (transformers)
if [ -n "$extras" ]; then
  python -m pip install -q -c scripts/constraints.txt -e ".[$extras]"
else
  python -m pip install -q -c scripts/constraints.txt -e .
fi
