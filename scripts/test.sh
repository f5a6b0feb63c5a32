#!/usr/bin/env bash
# Install (if needed), lint, and run the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
.venv/bin/python -m ruff check .  # the lint (ruff.toml) before the tests
# one worker per core (pytest-xdist); --dist loadscope keeps each module on one worker, so its module-scoped
# fixtures are built once. The fast subset for the edit-test loop: bash scripts/test.sh -m "not slow"
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n auto --dist loadscope tests "$@"
