"""Local paths and URLs (gs://...): the one place that tells them apart.

This library opens local paths itself and leaves URLs to the file access its caller passes (the pipelines:
Beam FileSystems), so every module that handles paths asks :func:`is_url` and joins with :func:`join_path`.
"""
from __future__ import annotations

import os


def is_url(path) -> bool:
    """``gs://bucket/x.tsv`` and other ``scheme://`` paths: not reachable with Python's own file access."""
    return "://" in os.fspath(path)


def join_path(base: str, name: str) -> str:
    """``base/name``; URLs always join with "/" (os.path.join would use the local separator)."""
    return f"{base.rstrip('/')}/{name}" if is_url(base) else os.path.join(base, name)
