"""`nsconsole` with no command: the full-screen console."""

from __future__ import annotations

from nsconsole.commands.pending import not_built


def open_console(*, readonly: bool, theme: str | None) -> int:
    raise not_built("(console)", "console")
