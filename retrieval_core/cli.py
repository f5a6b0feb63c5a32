"""What every command-line entry point shares (no Beam): -h, one spelling of --device and --threads, and
one-line errors at the CLI boundary.

``pipelines.common.cli_errors`` should delegate to :func:`cli_errors` here (retrieval_core cannot import
pipelines, which imports Beam), so that the library's CLIs (``python -m retrieval_core.train``) and the
pipelines' report bad input the same way.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

import click

#: Set to 1 to get the full traceback of an error that cli_errors would report in one line.
DEBUG_ENV = "RR_DEBUG"

#: click context settings of every CLI here: -h is --help.
CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"]}

DEVICES = ("cpu", "cuda")


@contextlib.contextmanager
def cli_errors(*error_types: type) -> Iterator[None]:
    """At a CLI boundary: report bad input as one ``Error: ...`` line and exit 1, not as a traceback.

    Bad input = a missing or inconsistent staged dir (StagedDataError), a missing file, the library's
    validation errors (ValueError and its subclasses) and the caller's own ``error_types``. Their messages
    name the path or value at fault; ``RR_DEBUG=1`` re-raises them with the traceback."""
    from retrieval_core.store import StagedDataError

    try:
        yield
    except (StagedDataError, FileNotFoundError, ValueError, *error_types) as exc:
        if os.environ.get(DEBUG_ENV) == "1":
            raise
        raise click.ClickException(str(exc)) from None


def device_option(default: str = "cpu"):
    """``--device cpu|cuda`` (case-insensitive; the value arrives lower-case)."""
    return click.option("--device", type=click.Choice(DEVICES, case_sensitive=False), default=default,
                        show_default=True, callback=lambda ctx, param, value: value.lower(),
                        help="Where the model runs (cuda fails when no GPU is visible).")


def threads_option():
    """``--threads N``: torch CPU threads (default: torch's own choice)."""
    return click.option("--threads", type=click.IntRange(min=1), default=None,
                        help="torch CPU threads [torch's default].")


def apply_device_and_threads(device: str, threads: int | None) -> None:
    """Set the torch thread count and check that a requested GPU exists (one line if not)."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    if device == "cuda" and not torch.cuda.is_available():
        raise click.ClickException("--device cuda was requested but CUDA is not available on this machine")
