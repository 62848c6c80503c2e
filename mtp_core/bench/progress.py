"""A rich progress bar over requests on stderr, hidden when stderr is not a terminal."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


@contextmanager
def request_progress(total: int, description: str) -> Iterator[Callable[..., None]]:
    """Yields advance(*_): call it once per finished request."""
    console = Console(stderr=True)
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=console, transient=True, disable=not console.is_terminal)
    with progress:
        task = progress.add_task(description, total=total)
        yield lambda *_: progress.advance(task)
