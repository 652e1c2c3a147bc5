"""How the console writes numbers, ages and states: short, fixed-width friendly, never colour alone."""

from __future__ import annotations

import math
from pathlib import Path

from textual.theme import Theme

from engine.protocol.facts import FINAL_LINE_STATES, LineState, Stage
from engine.units import GIB

UNREACHABLE = "unreachable"
"""The console's own state of a line whose supervisor it has never reached."""
SUPERVISOR_LOST = "supervisor lost, trainer exited"
"""The console's own state of a line whose supervisor and trainer are both gone: nothing runs it."""
UNKNOWN_STATE = "unknown"
"""The console's own state of a line at rest whose supervisor.json is damaged: nothing says what it was doing."""
PAUSING_FOR = {
    "tune": f"{LineState.PAUSING} → {LineState.TUNING}",
    "rollback": f"{LineState.PAUSING} → {LineState.ROLLING_BACK}",
}
"""What a `pausing` line shows, by the mutation it pauses for (the trainer checkpoints first)."""

STATE_LOOKS: dict[str, tuple[str, str]] = {
    LineState.STARTING: ("○", "warning"),
    LineState.WAITING_GPU: ("…", "warning"),
    LineState.TRAINING: ("▶", "success"),
    LineState.PAUSING: ("⏸", "warning"),
    LineState.ROLLING_BACK: ("↶", "warning"),
    LineState.TUNING: ("⚙", "warning"),
    LineState.RELAUNCHING: ("↻", "warning"),
    LineState.STOPPING: ("◼", "warning"),
    LineState.FINISHED: ("✓", "success"),
    LineState.STOPPED: ("■", ""),
    LineState.FAILED: ("✗", "error"),
    LineState.STUCK: ("◷", "error"),
    LineState.DISK_FULL: ("■", "error"),
    Stage.CHECKPOINTING: ("⤓", "success"),
    Stage.VALIDATING: ("◇", "success"),
    Stage.WAITING_DATA: ("…", "warning"),
    Stage.CAPTURING: ("◎", "success"),
    Stage.COMPILING: ("⚙", "success"),
    Stage.PROBING: ("◇", "success"),
    Stage.DREAMING: ("☾", "success"),
    UNREACHABLE: ("⚡", "error"),
    SUPERVISOR_LOST: ("✗", "error"),
    UNKNOWN_STATE: ("?", "error"),
}
"""The glyph and theme colour ("" for the plain foreground) of every state a line's row shows: each
supervisor state, the trainer stages shown in its place while it trains, and `unreachable`. The
glyph makes the state read without its colour; the word is the state's own. A state with more
words after it (`pausing → tuning`, `stopping after cycle 3`) looks like its first word."""

FINAL_STATES = FINAL_LINE_STATES
"""States a supervisor exits in: its socket then goes quiet, which is no connection problem."""

FRESH_HEARTBEAT_S = 30.0
"""A heartbeat younger than this is fresh; older than `health.STALE_HEARTBEAT_S` is stale."""


def _looks(state: str) -> tuple[str, str]:
    return STATE_LOOKS.get(state) or STATE_LOOKS.get(state.split(" ", 1)[0], ("•", ""))


def state_label(state: str) -> str:
    return f"{_looks(state)[0]} {state}"


def state_severity(state: str) -> str:
    """The theme colour of a state ("" for the plain foreground, and for a state this code does not know)."""
    return _looks(state)[1]


def line_label(name: str, path: str, named_alike: bool, width: int = 32) -> str:
    """A line as every panel of the console names it: its name, or where another line listed has that
    name, `⚠` and its short path (else their rows, trainers and leases could not be told apart)."""
    return f"⚠ {short_path(path, width)}" if named_alike else name


def short_path(path: str, width: int = 32) -> str:
    """A line's path in at most about `width` cells: `~` for the home directory, then its last parts."""
    home = str(Path.home())
    if path == home or path.startswith(home + "/"):
        path = "~" + path[len(home):]
    if len(path) <= width:
        return path
    parts = Path(path).parts
    shown = parts[-1]
    for part in reversed(parts[:-1]):
        if len(part) + 1 + len(shown) + 2 > width:
            break
        shown = f"{part}/{shown}"
    return f"…/{shown}"


def count(value: float | None) -> str:
    """A large count in engineering shorthand: 1234 -> 1.2K, 3.8e6 -> 3.8M."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    magnitude = abs(value)
    for limit, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if magnitude >= limit:
            return f"{value / limit:.1f}{suffix}"
    return f"{value:.0f}"


def number(value: float | None, digits: int = 4) -> str:
    """A reading with `digits` significant digits ("—" when unknown or not finite)."""
    if value is None or not math.isfinite(value):
        return "—"
    if abs(value) >= 1e4:
        return count(value)  # 27.6K reads better than 2.765e+04
    return f"{value:.{digits}g}"


def age(seconds: float | None) -> str:
    """Seconds as the largest whole unit: 42s, 5m, 3h, 2d."""
    if seconds is None:
        return "—"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


def heartbeat_mark(seconds: float | None, stale_after_s: float) -> tuple[str, str]:
    """(glyph, severity) of a heartbeat's age: ● fresh, ◐ late, ○ stale, · none."""
    if seconds is None:
        return "·", "muted"
    if seconds < FRESH_HEARTBEAT_S:
        return "●", "success"
    if seconds < stale_after_s:
        return "◐", "warning"
    return "○", "error"


def signed(value: float, digits: int = 3) -> str:
    """A change with its direction as a glyph: ▲ +0.012, ▼ -0.3, = 0."""
    if value > 0:
        return f"▲ +{value:.{digits}g}"
    if value < 0:
        return f"▼ {value:.{digits}g}"
    return "= 0"


def gib(size: float) -> str:
    """Bytes shown in GiB (2**30 bytes, the unit of every `*_gb` setting), one decimal."""
    return f"{size / GIB:.1f}"


def severity_style(theme: Theme, severity: str) -> str:
    """The Rich style of a severity in a theme (`success`, `warning`, `error`, `muted`, other: plain)."""
    colour = {"success": theme.success, "warning": theme.warning, "error": theme.error}.get(severity)
    if colour:
        return colour
    return "dim" if severity == "muted" else ""
