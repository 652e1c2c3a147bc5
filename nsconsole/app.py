"""The console: a full-screen Textual app over every line's supervisor on this host.

Screens: the lines screen (`screens/lines.py`) and a line's screen (`screens/line.py`). The
keys that change a line (`s` stop, `b` branch, `r` rollback, `t` tune) are App bindings: each
asks for confirmation (naming the line's full path) with No focused, then calls the supervisor
(`LiveLines.mutate`: one request_id across reconnects, so a retry is applied once); until the
reply a progress line under the screen says what waits and for how long. They act on the line
under the cursor (or the line screen's line), and are off with `--readonly`, for a line whose
supervisor does not answer and while the same request waits for its reply: pressed then, a toast
says why. Every binding has an id and shows in the footer, in `?` help and in the command
palette (ctrl+p), which offers what the screen under it offers.

The app refreshes its views every `refresh_interval` seconds (only changed cells are redrawn),
re-runs the health checks (a new flag becomes an event), rings the terminal bell for new events
of the severities chosen (`bell`, `nsconsole --bell`; errors only by default), reads the GPUs every
`GPU_INTERVAL_S` and the lines' disks every `DISK_INTERVAL_S`, off the UI thread.

`R` (binding `resume`) starts the supervisor of a line that none runs (one listed from the
history: stopped, failed, finished) as `nsconsole run LINE` does, after a confirmation with No
focused; discovery then attaches to it like to any new supervisor. That supervisor is the
console's child: its exit status is collected when it exits (`reap_when_it_exits`).

This module holds the App's state, its bindings and its life (mount, the ticks, the pause); the
actions behind the keys are its mixins in `nsconsole/actions/`, one per concern.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Callable

from textual import work
from textual.app import App
from textual.binding import Binding
from textual.css.query import NoMatches
from textual.screen import ModalScreen
from textual.theme import Theme

from engine.supervisor.registry import SupervisorEntry, list_supervisors
from nsconsole.actions.key_lists import KeyLists
from nsconsole.actions.key_switches import KeySwitches
from nsconsole.actions.navigation import Navigation
from nsconsole.actions.resume import Resuming
from nsconsole.actions.steering import Steering, rollback_consequences
from nsconsole.live import LiveLines
from nsconsole.screens.branch_form import BranchRequest
from nsconsole.screens.line import LineScreen
from nsconsole.screens.lines import LinesScreen
from nsconsole.state import DEFAULT_BELL, LineBook, LineView
from nsconsole.widgets.gpu_panel import GpuPanel, GpuReader, GpuReading, read_gpus
from nsconsole.widgets.request_progress import PendingRequest
from themes import DEFAULT_THEME, STYLESHEET, THEMES

# A rollback's confirmation words stay importable from here: the rollback's own tests check them
# (tests/engine/ops/test_branch_rollback.py).
__all__ = ["ConsoleApp", "rollback_consequences"]

REFRESH_INTERVAL_S = 1.0
"""The views' tick: as often as each supervisor's status is polled (`live.STATUS_INTERVAL_S`) and a GPU
line logs a row; ticking faster showed nothing sooner but cost the console CPU (bench/console_cpu.py)."""
GPU_INTERVAL_S = 2.0
DISK_INTERVAL_S = 10.0


class ConsoleApp(Navigation, KeySwitches, KeyLists, Steering, Resuming, App[None]):
    """See the module docstring. The screens the keys act on are `Navigation`'s, which keys are on
    `KeySwitches`'s, `?` help and the command palette `KeyLists`'s, stop, branch, rollback and tune
    `Steering`'s, `R` `Resuming`'s."""

    TITLE = "nsconsole"
    CSS_PATH = str(STYLESHEET)
    BINDINGS = [
        Binding("s", "stop", "Stop", id="stop",
                tooltip="stop the line with a checkpoint: at the next update or at the end of the cycle"),
        Binding("b", "branch", "Branch", id="branch",
                tooltip="fork a new line at the end of a cycle (a later cycle: it waits for it)"),
        Binding("r", "rollback", "Rollback", id="rollback", tooltip="resume the line from a checkpoint you pick"),
        Binding("t", "tune", "Tune", id="tune", tooltip="measure the micro-batch shapes (alone or shared)"),
        Binding("R", "resume", "Resume", id="resume",
                tooltip="start the supervisor of a line that none runs (as nsconsole run LINE): it trains on"),
        Binding("p", "pause", "Pause", id="pause", tooltip="freeze the views (data keeps arriving)"),
        Binding("question_mark", "help", "Help", key_display="?", id="help", tooltip="this list"),
        Binding("q", "quit", "Quit", id="quit", tooltip="leave the console (the lines keep training)"),
    ]

    def __init__(
        self,
        *,
        readonly: bool = False,
        theme_name: str = DEFAULT_THEME,
        book: LineBook | None = None,
        attach: bool = True,
        clock: Callable[[], float] = time.time,
        gpu_reader: GpuReader = read_gpus,
        discover: Callable[[], list[SupervisorEntry]] = list_supervisors,
        refresh_interval: float = REFRESH_INTERVAL_S,
        bell: frozenset[str] = DEFAULT_BELL,
    ) -> None:
        """`attach=False` shows `book` as given (no discovery, no supervisor): the snapshot tests.
        `bell`: the event severities that ring the terminal bell."""
        super().__init__()
        self.readonly = readonly
        self.theme_name = theme_name
        self.book = book or LineBook()
        self.clock = clock
        self.gpu_reader = gpu_reader
        self.refresh_interval = refresh_interval
        self.gpu_reading: GpuReading | None = None
        self.paused = False
        self.bell_severities = bell
        self.live: LiveLines | None = LiveLines(self.book, self._line_changed, clock, discover) if attach else None
        self.pending: list[PendingRequest] = []
        """Requests sent to a supervisor and not yet answered, oldest first (the progress line shows them)."""
        self._branch_drafts: dict[str, BranchRequest] = {}
        """The branch form as last sent of each line (by key), until a supervisor accepts it."""
        self._key_switches: dict[str, tuple[bool, bool]] = {}
        """(connected, resumable) of each line as the bindings last saw it (a line not seen yet: neither)."""

    @property
    def current_theme(self) -> Theme:
        """The theme by its name. Textual's own copies its whole table of themes to look one up, and
        asks for every screen line it paints: that was a tenth of the console's CPU on a line's screen
        (bench/console_cpu.py). The project's themes (the ones registered at mount) come from their
        table; any other name goes to Textual's lookup."""
        theme = THEMES.get(self.theme)
        return theme if theme is not None else super().current_theme

    # ---- life ----------------------------------------------------------------------------------

    def on_mount(self) -> None:
        for theme in THEMES.values():
            self.register_theme(theme)
        self.theme = self.theme_name
        self.sub_title = self.header_note()
        self.push_screen(LinesScreen())
        if self.live is not None:
            self.run_worker(self.live.run(), name="discovery", group="live")
        self.set_interval(self.refresh_interval, self.refresh_views)
        self.set_interval(GPU_INTERVAL_S, self.read_gpus_now)
        self.set_interval(DISK_INTERVAL_S, self.read_disks)
        self.read_gpus_now()
        self.read_disks()
        self.call_after_refresh(self.refresh_views)

    def _line_changed(self, line: LineView) -> None:
        # A line that came or went changes which mutating keys are on, and whether `resume` is. Called
        # for every row and heartbeat pushed: only the line that changed is looked at.
        switches = (line.connected, line.resumable)
        if self._key_switches.get(line.key, (False, False)) != switches:
            self._key_switches[line.key] = switches
            self.refresh_bindings()

    def refresh_views(self) -> None:
        now = self.clock()
        for line in self.book:
            line.refresh_health(now)
        alerts = [event for line in self.book for event in line.take_alerts()]
        if any(event.severity in self.bell_severities for event in alerts):
            self.bell()
        if self.paused:
            return
        screen = self.watched_screen()
        if screen is not None:
            try:
                screen.refresh_view(now)
            except NoMatches:
                # A tick landed while the screen is being composed or torn down (its widgets are
                # not there): the next tick refreshes it.
                return

    def watched_screen(self) -> LinesScreen | LineScreen | None:
        """The lines table or line screen in sight: the top screen, or the one under the dialogs
        over it (help, a confirmation, a form, the command palette: modal screens, which leave it in
        sight and must not freeze it while a question waits)."""
        for screen in reversed(self.screen_stack):
            if isinstance(screen, (LinesScreen, LineScreen)):
                return screen
            if not isinstance(screen, ModalScreen):
                return None
        return None

    @work(thread=True, exclusive=True, group="gpu")
    def read_gpus_now(self) -> None:
        reading = self.gpu_reader()
        self.call_from_thread(self._take_gpu_reading, reading)

    def _take_gpu_reading(self, reading: GpuReading) -> None:
        self.gpu_reading = reading
        for screen in self.screen_stack:
            if isinstance(screen, LinesScreen):  # the one screen with a GPU panel
                with contextlib.suppress(NoMatches):  # not composed yet: it records from the next reading
                    screen.query_one(GpuPanel).record(reading)

    @work(thread=True, exclusive=True, group="disk")
    def read_disks(self) -> None:
        for line in list(self.book):
            try:
                usage = shutil.disk_usage(line.path)
            except OSError:
                continue
            line.disk_free, line.disk_total = usage.free, usage.total

    def header_note(self) -> str:
        """What the header says of the console itself on every screen: read-only, paused."""
        return " · ".join(
            part for part in ("read-only" if self.readonly else "", "⏸ refresh paused" if self.paused else "") if part
        )

    def action_pause(self) -> None:
        self.paused = not self.paused
        self.sub_title = self.header_note()
        for screen in self.screen_stack:
            if isinstance(screen, LineScreen):
                screen.show_header_note(self.sub_title)
        if not self.paused:
            self.refresh_views()
