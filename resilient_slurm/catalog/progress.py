"""Byte progress bars on stderr for long verifies and transfers (rich), or nothing.

Who calls what: ``cli.py`` decides whether bars are wanted (stderr is a terminal and ``--json`` is not
given) and passes ``enabled``; ``verify`` and ``export`` open one :func:`byte_progress` per step and hand
its ``advance`` callable to the code that reads or moves bytes (possibly from several threads: rich's
``Progress`` is thread-safe).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def byte_progress(description: str, total: int, *, enabled: bool) -> Iterator[Callable[[int], None]]:
    """A progress bar for ``total`` bytes; yields ``advance(n)``. A no-op when not ``enabled``."""
    if not enabled or total <= 0:
        yield lambda n: None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
               TransferSpeedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n: bar.advance(task, n)


__all__ = ["byte_progress"]
