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
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import time
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path

from textual import events, work
from textual.actions import parse as parse_action
from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.command import CommandPalette
from textual.css.query import NoMatches
from textual.screen import Screen
from textual.theme import Theme

from engine.errors import LineError
from engine.layout import LineLayout
from engine.ops.branch_records import branches_forked_after
from engine.supervisor.registry import SupervisorEntry, list_supervisors
from nsconsole.live import LiveLines
from nsconsole.screens.branch_form import BranchForm, BranchRequest
from nsconsole.screens.confirm import ConfirmScreen
from nsconsole.screens.help import HelpScreen, KeyHelp
from nsconsole.screens.line import LineScreen
from nsconsole.screens.lines import LinesScreen
from nsconsole.screens.picker import PickerScreen
from nsconsole.state import DEFAULT_BELL, LineBook, LineView
from nsconsole.widgets import format as fmt
from nsconsole.widgets.checkpoint_list import CheckpointInfo, read_checkpoints
from nsconsole.widgets.gpu_panel import GpuPanel, GpuReader, GpuReading, read_gpus
from nsconsole.widgets.replies import reply_words, request_words, toast_text
from nsconsole.widgets.request_progress import PendingRequest, RequestProgress
from themes import DEFAULT_THEME, STYLESHEET, THEMES

REFRESH_INTERVAL_S = 1.0
"""The views' tick: as often as each supervisor's status is polled (`live.STATUS_INTERVAL_S`) and a GPU
line logs a row; ticking faster showed nothing sooner but cost the console CPU (bench/console_cpu.py)."""
GPU_INTERVAL_S = 2.0
DISK_INTERVAL_S = 10.0
MUTATING_ACTIONS = frozenset({"stop", "branch", "rollback", "tune"})
TOLD_WHEN_OFF = MUTATING_ACTIONS | {"resume", "show_tab"}
"""Actions whose key, pressed while off, says why in a toast. Not the curves' ←/→: off the curves tab
they fall to the tab bar and the lists, and a toast at every press there would be noise."""


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

    # ---- screens -------------------------------------------------------------------------------

    def open_line(self, key: str) -> None:
        line = self.book.get(key)
        if line is not None:
            self.push_screen(LineScreen(line))

    def line_screen(self) -> LinesScreen | LineScreen | None:
        """The screen whose line the keys act on: the one shown, or the one the command palette is over."""
        screen = self.screen
        if isinstance(screen, CommandPalette) and len(self.screen_stack) > 1:
            screen = self.screen_stack[-2]
        return screen if isinstance(screen, (LinesScreen, LineScreen)) else None

    def selected_line(self) -> LineView | None:
        screen = self.line_screen()
        key = None if screen is None else screen.selected_line_key()
        return None if key is None else self.book.get(key)

    def header_note(self) -> str:
        """What the header says of the console itself on every screen: read-only, paused."""
        return " · ".join(
            part for part in ("read-only" if self.readonly else "", "⏸ refresh paused" if self.paused else "") if part
        )

    # ---- keys ----------------------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in MUTATING_ACTIONS and self.refusal(action) is not None:
            return None  # shown, greyed; pressed, a toast says why
        if action == "resume" and self.resume_refusal() is not None:
            return None
        return True

    def _no_line_to_act_on(self, line: LineView | None) -> str | None:
        """Why no key that acts on `line` works now (None: it can be acted on)."""
        if self.readonly:
            return "the console is read-only (--readonly)"
        if self.live is None:
            return "this console is not attached to any supervisor"
        if line is None:
            return "no line is selected"
        return None

    def refusal(self, action: str) -> str | None:
        """Why a mutating key does nothing now (None: it works)."""
        line = self.selected_line()
        reason = self._no_line_to_act_on(line)
        if reason is not None:
            return reason
        assert line is not None
        if not line.mutable:
            if line.display_state in fmt.FINAL_STATES:
                return f"{line.path} has ended ({line.display_state}); its supervisor has exited"
            return f"{line.path}: its supervisor is not attached ({line.disconnect_reason or 'not yet reached'})"
        waiting = next((request for request in self.pending if (request.key, request.method) == (line.key, action)), None)
        if waiting is not None:
            return f"a {action} of {line.path} is still waiting for the supervisor's reply"
        return None

    def why_off(self, screen: Screen, action: str, parameters: tuple[object, ...]) -> str | None:
        """Why `screen`'s binding of `action` is off (None: it is on, or no reason is known)."""
        if action in MUTATING_ACTIONS:
            return self.refusal(action)
        if action == "resume":
            return self.resume_refusal()
        if isinstance(screen, LineScreen):
            return screen.why_off(action, parameters)
        return None

    def on_key(self, event: events.Key) -> None:
        # A key that is off reaches here unhandled: say why instead of doing nothing.
        screen = self.line_screen()
        if screen is not self.screen:
            return
        active = screen.active_bindings.get(event.key)
        if active is None or active.enabled:
            return
        _, action, parameters = parse_action(active.binding.action)
        reason = self.why_off(screen, action, parameters) if action in TOLD_WHEN_OFF else None
        if reason is not None:
            self.notify(f"{active.binding.description}: {reason}", severity="warning", timeout=6, markup=False)

    def action_pause(self) -> None:
        self.paused = not self.paused
        self.sub_title = self.header_note()
        for screen in self.screen_stack:
            if isinstance(screen, LineScreen):
                screen.show_header_note(self.sub_title)
        if not self.paused:
            self.refresh_views()

    def action_help(self) -> None:
        screen = self.screen
        if isinstance(screen, HelpScreen):
            return
        title = f"Keys: {screen.sub_title or screen.title or 'nsconsole'}"
        self.push_screen(HelpScreen(title, self.key_help(screen), self.off_reasons(screen)))

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

    def off_reasons(self, screen: Screen) -> dict[str, str]:
        """Why each binding of `screen` that is off is off, by binding id (where a reason is known)."""
        reasons = {}
        for active in screen.active_bindings.values():
            binding = active.binding
            if binding.id is None or active.enabled:
                continue
            _, action, parameters = parse_action(binding.action)
            reason = self.why_off(screen, action, parameters)
            if reason is not None:
                reasons[binding.id] = reason
        return reasons

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

    @work(group="mutation")
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
        if await self.push_screen_wait(ConfirmScreen(f"Stop {line.path} {when}?", "It stops with a checkpoint.")):
            await self.mutate(line, "stop", at_cycle_end=at_cycle_end)

    @work(group="mutation")
    async def action_branch(self) -> None:
        line = self.selected_line()
        if line is None or not self.check_action("branch", ()):
            return
        form = BranchForm(line.name, line.path, line.cycle, self._branch_drafts.get(line.key))
        request: BranchRequest | None = await self.push_screen_wait(form)
        if request is None:
            return
        # Kept until the supervisor takes it: a refusal, or a No, reopens the form as it was typed.
        self._branch_drafts[line.key] = request
        waits = "" if line.cycle is None or request.at_cycle < line.cycle else " It waits for that cycle to end."
        question = f"Branch {line.path} into {request.path} at the end of cycle {request.at_cycle}?"
        trains = f"\nIt trains: {request.stages}" if request.stages else ""
        detail = f"Plan: {request.plan}{trains}\nData line: {request.data}\nA new line is forked with them.{waits}"
        if await self.push_screen_wait(ConfirmScreen(question, detail)) and (
            await self.mutate(line, "branch", **request.params()) is not None
        ):
            del self._branch_drafts[line.key]

    @work(group="mutation")
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

    @work(group="mutation")
    async def action_tune(self) -> None:
        line = self.selected_line()
        if line is None or not self.check_action("tune", ()):
            return
        options = tune_choices(line.on_cpu)
        choice = await self.push_screen_wait(PickerScreen(f"Tune {line.name}'s micro-batch shape for:", options))
        if choice is None:
            return
        question = f"Tune {line.path} ({dict(options)[choice]})?"
        if await self.push_screen_wait(ConfirmScreen(question, "The line pauses while the shapes are measured.")):
            await self.mutate(line, "tune", shared=choice == "shared")

    def resume_refusal(self, line: LineView | None = None) -> str | None:
        """Why `resume` does nothing now for `line` (None: it starts its supervisor); the selected
        line when none is given."""
        line = line or self.selected_line()
        reason = self._no_line_to_act_on(line)
        if reason is not None:
            return reason
        assert line is not None
        if not line.resumable:
            return f"{line.path}: its supervisor runs"
        return None

    @work(exclusive=True, group="resume")
    async def action_resume(self) -> None:
        line = self.selected_line()
        if line is None or not self.check_action("resume", ()):
            return
        # A finished line starts nothing, as `nsconsole run` says (imported here: it reads the data line).
        from datalines.errors import DataLineError
        from engine.ops.line_end import refuse_a_finished_line

        try:
            await asyncio.to_thread(refuse_a_finished_line, Path(line.path))
        except (LineError, DataLineError, OSError) as error:  # a data line gone or damaged is said too
            line.add_event(self.clock(), "refused", f"resume: {error}", "error")
            self.notify(toast_text(f"✗ {line.name}: {error}"), severity="error", timeout=8, markup=False)
            return
        question = f"Resume {line.path}?"
        detail = ("Its supervisor starts in the background, as `nsconsole run` starts it, and the trainer goes on "
                  "from the latest checkpoint.")
        if not await self.push_screen_wait(ConfirmScreen(question, detail)):
            return
        line.add_event(self.clock(), "request", "resume: starting its supervisor")
        # Imported here, when a line is resumed: the supervisor's module is not needed to start the console.
        from engine.supervisor.lost import lost_line
        from engine.supervisor.settings import SupervisorSettings
        from engine.supervisor.start import SupervisorSilent, start_detached

        # A line whose supervisor was lost (a reboot, a kill) goes on with the --engine and --stop-at it ran with.
        lost = lost_line(line.path)
        settings = SupervisorSettings() if lost is None else SupervisorSettings(engine=lost.engine, stop_at=lost.stop_at)
        try:
            pid = await asyncio.to_thread(start_detached, Path(line.path), settings)
        except (LineError, OSError) as error:
            if isinstance(error, SupervisorSilent):
                reap_when_it_exits(error.pid)  # it may still come up; it is our child either way
            line.add_event(self.clock(), "refused", f"resume: {error}", "error")
            self.notify(toast_text(f"✗ {line.name}: resume failed: {error}"), severity="error", timeout=8, markup=False)
            return
        reap_when_it_exits(pid)
        line.add_event(self.clock(), "request", f"resume: its supervisor runs (pid {pid})")
        self.notify(f"✓ {line.name}: resumed (supervisor pid {pid})", timeout=4)

    async def mutate(self, line: LineView, method: str, **params: object) -> object | None:
        """Call a mutation; the outcome becomes a notification and an event of the line."""
        assert self.live is not None
        line.add_event(self.clock(), "request", f"{request_words(method, params)}: sent")
        request = PendingRequest(line.key, line.name, method, self.clock())
        self.pending.append(request)
        self.refresh_progress()
        try:
            result = await self.live.mutate(line.key, method, **params)
        except LineError as error:
            line.add_event(self.clock(), "refused", f"{method}: {error}", "error")
            # Not markup: a reason may hold brackets (a path, a list) that markup would eat or choke on.
            self.notify(toast_text(f"✗ {line.name}: {method} refused: {error}"), severity="error", timeout=8,
                        markup=False)
            return None
        finally:
            self.pending.remove(request)
            self.refresh_progress()
        summary, details = reply_words(method, result)
        line.add_event(self.clock(), "request", f"{method} accepted: {summary}{details}")
        self.notify(toast_text(f"✓ {line.name}: {method} accepted: {summary}"), timeout=4, markup=False)
        return result

    def refresh_progress(self) -> None:
        """Redraw the progress line of every screen (a request was sent or answered)."""
        if not self.screen_stack:
            return  # the console is closing
        for screen in self.screen_stack:
            for progress in screen.query(RequestProgress):
                progress.show(self.pending, self.clock())
        self.refresh_bindings()


def reap_when_it_exits(pid: int) -> None:
    """Collect the exit status of `pid`, a child of the console's (a supervisor `R` started, detached
    into its own session but still our child), once it exits: else it stays a zombie (`<defunct>`)
    as long as the console runs. Waited for on the event loop through a pidfd, which becomes
    readable at the child's exit: nothing polls, and no thread blocks the console's exit."""
    loop = asyncio.get_running_loop()
    pidfd = os.pidfd_open(pid)  # a zombie has one too: a child that exited already is collected at once

    def reap() -> None:
        loop.remove_reader(pidfd)
        os.close(pidfd)
        os.waitpid(pid, 0)

    loop.add_reader(pidfd, reap)


def tune_choices(on_cpu: bool | None) -> list[tuple[str, str]]:
    """The tune picker's options, in the words of the line's device (`LineView.on_cpu`; None: not known)."""
    if on_cpu:
        # A CPU tune's budget is a share of the free memory (`engine.ops.tune`); --shared leaves the reserve.
        return [("alone", "alone on the CPU: up to half the free memory"),
                ("shared", "beside other processes: less guards.share_reserve_gb (--shared)")]
    device = "the GPU" if on_cpu is False else "its device"
    return [("alone", f"{device} to itself"), ("shared", "beside other processes (--shared)")]


def rollback_consequences(line: LineView, target: CheckpointInfo) -> str:
    """What a rollback to `target` sets aside, in the confirmation's words."""
    update = line.update
    updates = "the updates after it" if update is None else f"updates {target.update + 1}-{update}"
    tokens = None if line.tokens is None or target.tokens is None else line.tokens - target.tokens
    trained = "" if tokens is None else f" ({fmt.count(tokens)} tokens)"
    branches = branches_forked_after(LineLayout(line.path), target.update)
    grown = "" if not branches else (f" Branches forked after it keep their own checkpoints and rows, but the trunk "
                                     f"rows they grew from go with the rest: {', '.join(branches)}.")
    return (f"Sets aside {updates}{trained}: their rows are kept in rows.rolledback-<time>.jsonl and the later "
            f"checkpoints go at the next checkpoint; training resumes from update {target.update}.{grown}")
