"""`nsconsole` with no command: the full-screen console (`nsconsole/app.py`)."""

from __future__ import annotations

from engine.errors import LineError
from nsconsole.state import DEFAULT_BELL, SEVERITIES
from themes import DEFAULT_THEME, THEMES


def bell_severities(text: str | None) -> frozenset[str]:
    """`--bell error,warning` as the set of severities that ring; `none` for silence; `LineError` for
    a severity that does not exist."""
    if text is None:
        return DEFAULT_BELL
    words = [word.strip() for word in text.split(",") if word.strip()]
    if words == ["none"]:
        return frozenset()
    unknown = [word for word in words if word not in SEVERITIES]
    if unknown or not words:
        raise LineError(f"--bell: unknown severity {', '.join(unknown) or repr(text)}; choose from "
                        f"{', '.join(reversed(SEVERITIES))} (comma-separated), or none")
    return frozenset(words)


def open_console(*, readonly: bool, theme: str | None, bell: str | None = None) -> int:
    """Run the console until the operator quits; `LineError` for an unknown theme or bell severity."""
    name = theme or DEFAULT_THEME
    if name not in THEMES:
        raise LineError(f"--theme: unknown theme {name!r}; choose one of {', '.join(sorted(THEMES))}")
    ringing = bell_severities(bell)
    # Imported here: Textual is needed only by the console, not by the other commands.
    from nsconsole.app import ConsoleApp

    ConsoleApp(readonly=readonly, theme_name=name, bell=ringing).run()
    return 0
