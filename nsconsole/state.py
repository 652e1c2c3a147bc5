"""The console's model of the lines it shows, in one import: its parts live in `nsconsole/lines/`.

`LineView` (`view.py`: a line fed by its supervisor or read from its files, what the widgets read
off it, its health checks) and `LineBook` (`book.py`: every line shown), with what they hold: the
rows (`rows.py`), the events (`events.py`), the forks (`forks.py`), run.json's facts (`run_facts.py`).
"""

from __future__ import annotations

from nsconsole.lines.book import LineBook
from nsconsole.lines.events import DEFAULT_BELL, EVENT_GLYPHS, SEVERITIES, ConsoleEvent
from nsconsole.lines.forks import ForkView
from nsconsole.lines.readings import SHOWN_STAGES
from nsconsole.lines.rows import FULL_ROWS, MAX_POINTS, RECENT_ROWS, Series, joined_rows, validation_loss
from nsconsole.lines.run_facts import LineFacts
from nsconsole.lines.view import LineView

__all__ = [
    "DEFAULT_BELL",
    "EVENT_GLYPHS",
    "FULL_ROWS",
    "MAX_POINTS",
    "RECENT_ROWS",
    "SEVERITIES",
    "SHOWN_STAGES",
    "ConsoleEvent",
    "ForkView",
    "LineBook",
    "LineFacts",
    "LineView",
    "Series",
    "joined_rows",
    "validation_loss",
]
