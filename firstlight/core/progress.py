"""Progress bars for long commands (rich), on stderr, and silent when stderr is not a terminal.

    with progress("requests", total=100) as advance:
        ...
        advance(1)

Scripts, CI logs and piped output see nothing; a person at a terminal sees the bar, its rate and
its ETA. Only CLI code opens a bar: library functions take an `advance`-style callback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager


def _interactive() -> bool:
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


@contextmanager
def progress(description: str, total: float | None = None, *, unit: str = "") -> Iterator[Callable[[float], None]]:
    """Yield `advance(n)`; a no-op when stderr is not a TTY."""
    if not _interactive():
        yield lambda n=1: None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = [TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn(unit), TimeElapsedColumn(), TimeRemainingColumn()]
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n=1: bar.advance(task, n)


@contextmanager
def status(description: str) -> Iterator[Callable[[str], None]]:
    """A spinner with a changing message, for work whose size is unknown (a download, a verification);
    `update(msg)` sets the message. Not a TTY: each message is one plain line on stderr instead."""
    if not _interactive():
        yield lambda msg: print(f"{description}: {msg}", file=sys.stderr)
        return
    from rich.console import Console

    with Console(stderr=True).status(description) as st:
        yield lambda msg: st.update(f"{description}: {msg}")
