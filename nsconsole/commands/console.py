"""`nsconsole` with no command: the full-screen console (`nsconsole/app.py`)."""

from __future__ import annotations

from engine.errors import LineError
from themes import DEFAULT_THEME, THEMES


def open_console(*, readonly: bool, theme: str | None) -> int:
    """Run the console until the operator quits; `LineError` for an unknown theme."""
    name = theme or DEFAULT_THEME
    if name not in THEMES:
        raise LineError(f"--theme: unknown theme {name!r}; choose one of {', '.join(sorted(THEMES))}")
    # Imported here: Textual is needed only by the console, not by the other commands.
    from nsconsole.app import ConsoleApp

    ConsoleApp(readonly=readonly, theme_name=name).run()
    return 0
