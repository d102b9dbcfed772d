"""Console output for people (rich, stderr for errors) and process-wide CLI state."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from rich.console import Console

# soft_wrap: never hard-wrap a line (a path or URL split over lines breaks grep and copy-paste).
out = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)


@dataclasses.dataclass
class _State:
    config_path: Path | None = None
    debug: bool = False
    exit_code: int = 0  # a command that finishes without raising may still set a non-zero code


state = _State()


def error(message: str) -> None:
    """One line on stderr. Markup is off so paths and brackets print as they are."""
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)


def escape(text: str) -> str:
    from rich.markup import escape as _escape

    return _escape(text)
