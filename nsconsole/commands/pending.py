"""Commands whose capability has not landed yet say so plainly instead of pretending."""

from __future__ import annotations

from engine.errors import LineError


def not_built(command: str, issue: str) -> LineError:
    """The error a registered but not yet built command raises (exit status 2)."""
    return LineError(f"`nsconsole {command}` is not built yet: it lands with the {issue} issue")
