"""The console: a full-screen Textual app over every line's supervisor on this host.

Screens: the lines screen (`screens/lines.py`) and a line's screen (`screens/line.py`). The
keys that change a line (`s` stop, `b` branch, `r` rollback, `t` tune) are App bindings: each
asks for confirmation with No focused, then calls the supervisor (`LiveLines.mutate`: one
request_id across reconnects, so a retry is applied once). They are off with `--readonly` and
for a line whose supervisor does not answer. Every binding has an id and shows in the footer,
in `?` help and in the command palette (ctrl+p).

The app refreshes its views every `refresh_interval` seconds (only changed cells are redrawn),
re-runs the health checks (a new flag rings the bell and becomes an event), reads the GPUs every
`GPU_INTERVAL_S` and the lines' disks every `DISK_INTERVAL_S`, off the UI thread.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterable
from functools import partial

from textual import work
from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.css.query import NoMatches
from textual.screen import Screen

from engine.errors import LineError
from engine.supervisor.registry import SupervisorEntry, list_supervisors
from nsconsole.live import LiveLines
from nsconsole.screens.branch_form import BranchForm, BranchRequest
from nsconsole.screens.confirm import ConfirmScreen
from nsconsole.screens.help import HelpScreen, KeyHelp
from nsconsole.screens.line import LineScreen
from nsconsole.screens.lines import LinesScreen
from nsconsole.screens.picker import PickerScreen
from nsconsole.state import LineBook, LineView
from nsconsole.widgets import format as fmt
from nsconsole.widgets.checkpoint_list import CheckpointInfo, read_checkpoints
from nsconsole.widgets.gpu_panel import GpuPanel, GpuReader, GpuReading, read_gpus
from themes import DEFAULT_THEME, STYLESHEET, THEMES

REFRESH_INTERVAL_S = 0.5
GPU_INTERVAL_S = 2.0
DISK_INTERVAL_S = 10.0
MUTATING_ACTIONS = frozenset({"stop", "branch", "rollback", "tune"})


class ConsoleApp(App[None]):
    """See the module docstring."""

    TITLE = "nsconsole"
    CSS_PATH = str(STYLESHEET)
    BINDINGS = [
        Binding("s", "stop", "Stop", id="stop",
                tooltip="stop the line with a checkpoint: at the next update or at the end of the cycle"),
        Binding("b", "branch", "Branch", id="branch",
                tooltip="fork a new line at the end of a cycle (a later cycle: it waits for it)"),
        Binding("r", "rollback", "Rollback", id="rollback", tooltip="resume the line from a checkpoint you pick"),
        Binding("t", "tune", "Tune", id="tune", tooltip="measure the micro-batch shapes (alone or shared)"),
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
    ) -> None:
        """`attach=False` shows `book` as given (no discovery, no supervisor): the snapshot tests."""
        super().__init__()
        self.readonly = readonly
        self.theme_name = theme_name
        self.book = book or LineBook()
        self.clock = clock
        self.gpu_reader = gpu_reader
        self.refresh_interval = refresh_interval
        self.gpu_reading: GpuReading | None = None
        self.paused = False
        self.live: LiveLines | None = LiveLines(self.book, self._line_changed, clock, discover) if attach else None
        self._connected_keys: set[str] = set()

    # ---- life ----------------------------------------------------------------------------------

    def on_mount(self) -> None:
        for theme in THEMES.values():
            self.register_theme(theme)
        self.theme = self.theme_name
        self.sub_title = "read-only" if self.readonly else ""
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
        # A line that came or went changes which mutating keys are on.
        connected = {state.key for state in self.book if state.connected}
        if connected != self._connected_keys:
            self._connected_keys = connected
            self.refresh_bindings()

    def refresh_views(self) -> None:
        now = self.clock()
        new_flags = [flag for line in self.book for flag in line.refresh_health(now)]
        if new_flags:
            self.bell()
        if self.paused:
            return
        screen = self.screen
        if isinstance(screen, (LinesScreen, LineScreen)):
            try:
                screen.refresh_view(now)
            except NoMatches:
                # A tick landed while the screen is being composed or torn down (its widgets are
                # not there): the next tick refreshes it.
                return

    @work(thread=True, exclusive=True, group="gpu")
    def read_gpus_now(self) -> None:
        reading = self.gpu_reader()
        self.call_from_thread(self._take_gpu_reading, reading)

    def _take_gpu_reading(self, reading: GpuReading) -> None:
        self.gpu_reading = reading
        for screen in self.screen_stack:
            for panel in screen.query(GpuPanel):
                panel.record(reading)

    @work(thread=True, exclusive=True, group="disk")
    def read_disks(self) -> None:
        for line in list(self.book):
            try:
                usage = shutil.disk_usage(line.path)
            except OSError:
                continue
            line.disk_free, line.disk_total = usage.free, usage.total

    # ---- screens -------------------------------------------------------------------------------

    def open_line(self, key: str) -> None:
        line = self.book.get(key)
        if line is not None:
            self.push_screen(LineScreen(line))

    def selected_line(self) -> LineView | None:
        screen = self.screen
        key = screen.selected_line_key() if isinstance(screen, (LinesScreen, LineScreen)) else None
        return None if key is None else self.book.get(key)

    # ---- keys ----------------------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in MUTATING_ACTIONS:
            if self.readonly:
                return None  # shown, greyed: the console is read-only
            line = self.selected_line()
            if line is None or not line.mutable or self.live is None:
                return None
        return True

    def action_pause(self) -> None:
        self.paused = not self.paused
        self.sub_title = " · ".join(
            part for part in ("read-only" if self.readonly else "", "⏸ refresh paused" if self.paused else "") if part
        )
        if not self.paused:
            self.refresh_views()

    def action_help(self) -> None:
        screen = self.screen
        if isinstance(screen, HelpScreen):
            return
        self.push_screen(HelpScreen(f"Keys: {screen.sub_title or screen.title or 'nsconsole'}", self.key_help(screen)))

    def key_help(self, screen: Screen) -> list[KeyHelp]:
        """Every active binding of `screen` and the app: (key, id, description, enabled)."""
        keys = []
        seen = set()
        for active in screen.active_bindings.values():
            binding = active.binding
            if binding.id is None or binding.id in seen:
                continue
            seen.add(binding.id)
            key = binding.key_display or self.get_key_display(binding)
            keys.append((key, binding.id, binding.tooltip or binding.description, active.enabled))
        return keys

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        for active in screen.active_bindings.values():
            binding = active.binding
            if binding.id is None or not active.enabled or binding.id in ("help.close", "confirm.no"):
                continue
            key = binding.key_display or self.get_key_display(binding)
            yield SystemCommand(
                f"{binding.description} ({key})",
                binding.tooltip or f"binding {binding.id}",
                partial(self.run_action, binding.action, active.node),
            )

    @work(exclusive=True, group="mutation")
    async def action_stop(self) -> None:
        line = self.selected_line()
        if line is None or not self.check_action("stop", ()):
            return
        options = [("now", "at the next update (with a checkpoint)")]
        if line.cycle is not None:
            options.append(("cycle", f"at the end of the current cycle ({line.cycle})"))
        choice = await self.push_screen_wait(PickerScreen(f"Stop {line.name}: when?", options))
        if choice is None:
            return
        at_cycle_end = line.cycle if choice == "cycle" else None
        when = "at the next update" if at_cycle_end is None else f"at the end of cycle {at_cycle_end}"
        if await self.push_screen_wait(ConfirmScreen(f"Stop {line.name} {when}?", "It stops with a checkpoint.")):
            await self.mutate(line, "stop", at_cycle_end=at_cycle_end)

    @work(exclusive=True, group="mutation")
    async def action_branch(self) -> None:
        line = self.selected_line()
        if line is None or not self.check_action("branch", ()):
            return
        request: BranchRequest | None = await self.push_screen_wait(BranchForm(line.name, line.path, line.cycle))
        if request is None:
            return
        waits = "" if line.cycle is None or request.at_cycle < line.cycle else " (it waits for that cycle to end)"
        question = f"Branch {line.name} into {request.path} at the end of cycle {request.at_cycle}?"
        if await self.push_screen_wait(ConfirmScreen(question, f"A new line is forked{waits}.")):
            await self.mutate(line, "branch", **request.params())

    @work(exclusive=True, group="mutation")
    async def action_rollback(self) -> None:
        line = self.selected_line()
        if line is None or not self.check_action("rollback", ()):
            return
        checkpoints = read_checkpoints(line.path)
        latest = next((info for info in checkpoints if info.latest), None)
        # A rollback goes back: only checkpoints before the one `latest` names can be chosen.
        earlier = {info.update: info for info in checkpoints if latest is not None and info.update < latest.update}
        options = [
            (str(info.update), f"update {info.update}  {'kept: ' + info.kept if info.kept else 'rolling'}")
            for info in earlier.values()
        ]
        empty = "this line has no checkpoint before its latest one"
        choice = await self.push_screen_wait(PickerScreen(f"Roll {line.name} back to:", options, empty=empty))
        if choice is None:
            return
        question = f"Roll {line.path} back to update {choice}?"
        if await self.push_screen_wait(ConfirmScreen(question, rollback_consequences(line, earlier[int(choice)]))):
            await self.mutate(line, "rollback", to=int(choice))

    @work(exclusive=True, group="mutation")
    async def action_tune(self) -> None:
        line = self.selected_line()
        if line is None or not self.check_action("tune", ()):
            return
        options = [("alone", "the GPU to itself"), ("shared", "beside other processes (--shared)")]
        choice = await self.push_screen_wait(PickerScreen(f"Tune {line.name}'s micro-batch shape for:", options))
        if choice is None:
            return
        question = f"Tune {line.name} ({options[0][1] if choice == 'alone' else options[1][1]})?"
        if await self.push_screen_wait(ConfirmScreen(question, "The line pauses while the shapes are measured.")):
            await self.mutate(line, "tune", shared=choice == "shared")

    async def mutate(self, line: LineView, method: str, **params: object) -> object | None:
        """Call a mutation; the outcome becomes a notification and an event of the line."""
        assert self.live is not None
        line.add_event(self.clock(), "request", f"{method} {params} sent")
        try:
            result = await self.live.mutate(line.key, method, **params)
        except LineError as error:
            line.add_event(self.clock(), "refused", f"{method}: {error}", "error")
            self.notify(f"✗ {line.name}: {method} refused: {error}", severity="error", timeout=8)
            return None
        line.add_event(self.clock(), "request", f"{method} accepted: {result}")
        self.notify(f"✓ {line.name}: {method} accepted", timeout=4)
        return result


def rollback_consequences(line: LineView, target: CheckpointInfo) -> str:
    """What a rollback to `target` sets aside, in the confirmation's words."""
    update = line.update
    updates = "the updates after it" if update is None else f"updates {target.update + 1}-{update}"
    tokens = None if line.tokens is None or target.tokens is None else line.tokens - target.tokens
    trained = "" if tokens is None else f" ({fmt.count(tokens)} tokens)"
    return (f"Sets aside {updates}{trained}: their rows are kept in rows.rolledback-<time>.jsonl and the later "
            f"checkpoints go at the next checkpoint; training resumes at update {target.update}.")
