#!/usr/bin/env bash
# Install (if needed), lint, and run the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
.venv/bin/python -m ruff check .  # the lint (ruff.toml) before the tests
exec .venv/bin/python -m pytest -q -p no:cacheprovider tests "$@"
