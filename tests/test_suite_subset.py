"""The fast subset (pytest -m "not slow") is defined by names in tests/conftest.py SLOW: a name that no longer
names a test would silently put a slow test back into the edit-test loop."""
from __future__ import annotations

import re

from tests.conftest import REPO_ROOT, SLOW


def test_every_slow_entry_names_an_existing_test():
    for entry in SLOW:
        module, _, name = entry.partition("::")
        path = REPO_ROOT / "tests" / f"{module}.py"
        assert path.is_file(), f"SLOW names {module}, which is not a test module"
        if name:
            assert re.search(rf"^def {re.escape(name)}\(", path.read_text(encoding="utf-8"), re.M), \
                f"SLOW names {entry}, which is not a test in {path.name}"
