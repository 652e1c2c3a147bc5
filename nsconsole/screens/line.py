"""A line's screen (Enter on the lines screen): tabs for curves, probes, samples, checkpoints, log,
events and, for a PSSA line, its memory. While the supervisor is away the last state stays, dimmed.
The header says what comes next (`widgets/line_header.py`); `j` shows the line's run.json.

The tabs from the keyboard: `[` and `]` show the tab before and after, 1-7 each tab, and each
focuses what its tab shows; Tab and Shift-Tab move the focus between the tab bar and the tab's
content. ← and → go from tab to tab while the tab bar has the focus, and move the curves' cursor
while the curves have it (the screen opens with the curves focused).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.css.query import NoMatches
from textual.screen import Screen
from textual.widgets import Header, Input, TabbedContent, TabPane, Tabs

from engine.errors import LineError
from nsconsole.screens.run_config import RunConfigScreen
from nsconsole.state import LineView
from nsconsole.widgets import format as fmt
from nsconsole.widgets.checkpoint_list import CheckpointList, read_checkpoints
from nsconsole.widgets.closed_watchers import drop_closed_watchers
from nsconsole.widgets.curves_tab import CurvesTab
from nsconsole.widgets.event_list import EventList, event_time
from nsconsole.widgets.keys_footer import KeysFooter
from nsconsole.widgets.line_header import EtaLine
from nsconsole.widgets.log_follower import LogFollower
from nsconsole.widgets.memory_tab import MemoryTab
from nsconsole.widgets.probe_table import ProbeTable
from nsconsole.widgets.quiet_static import QuietStatic
from nsconsole.widgets.request_progress import RequestProgress
from nsconsole.widgets.samples_tab import SamplesTab

TABS = ("curves", "probes", "samples", "checkpoints", "log", "events", "memory")
"""The tabs in their order (the memory tab only for a PSSA line; the pane of `name` is `tab-<name>`);
keys 1-7 show them."""
TAB_KEYS = Binding.Group("Tab")
"""`[` and `]` in the footer: one entry, `[ ] Tab`."""
CHECKPOINT_REFRESH_TICKS = 5
"""The checkpoint directory is listed every this many view refreshes (it changes seldom): every 5 s."""


def summary(line: LineView, now: float, resumable: bool = False) -> Text:
    """The header above the tabs; `resumable`: `R` starts the line's supervisor now (the header says so)."""
    text = Text()
    text.append(f"{line.name}", style="bold")
    text.append(f"  {line.kind if line.parent is None else f'branch of {line.parent}'}  {fmt.state_label(line.display_state)}")
    if not line.connected:
        if line.ended:
            text.append("  the supervisor has exited; last state shown")
        else:
            text.append(f"  ⚡ supervisor unreachable ({line.disconnect_reason or 'not attached yet'}); last state shown")
        # `R` is a change too, and works here: saying "changes off" alone sent people to the command line.
        text.append("; R resumes the line, other changes off" if resumable else ", changes off")
    text.append(f"\n{line.path}", style="dim")
    preset = line.status.get("preset") or line.facts.preset or "?"
    latest = line.latest_checkpoint
    text.append(
        f"\nmodel {preset}  update {line.update if line.update is not None else '—'}  "
        f"tokens {fmt.count(line.tokens)}  loss {fmt.number(line.loss)}  val {fmt.number(line.val_loss)}  "
        f"checkpoint {'—' if latest is None else latest}  {beat(line, now)}"
    )
    if line.sharing_gpu:
        text.append("  ⇄ sharing its GPU (shared shapes)")
    if line.health:
        text.append("  " + " ".join(flag.label for flag in line.health))
    return text


def beat(line: LineView, now: float) -> str:
    """The header's heartbeat: its age while something runs the line, else when the last one came
    (a fixed time: an age that grows on a finished line reads as an alarm)."""
    if not line.ended:
        return f"beat {fmt.age(line.heartbeat_age(now))}"
    beat_time = (line.heartbeat or {}).get("time")
    if not isinstance(beat_time, (int, float)) or isinstance(beat_time, bool) or beat_time <= 0:
        return "beat — (ended)"
    return f"beat — (ended; last {event_time(beat_time)} UTC)"


class LineScreen(Screen[None]):
    """See the module docstring."""

    AUTO_FOCUS = "#curves-tab"
    """The curves have the focus first: ←/→ move their cursor; Shift-Tab reaches the tab bar."""

    BINDINGS = [
        Binding("escape", "app.pop_screen", "Lines", id="back", tooltip="back to the lines"),
        Binding("l", "toggle_log_y", "Log y", id="log_y", tooltip="switch the curves between a linear and a log axis"),
        Binding("m", "smoothing", "Smooth", id="smoothing",
                tooltip="curves: smoothing off, EMA 0.6, 0.9, 0.99 (the raw readings dimmed under it)"),
        Binding("x", "x_axis", "X axis", id="x_axis", tooltip="curves: x axis by tokens, updates or wall time"),
        # Not priority bindings: on the focused tab bar ← and → are the bar's own (the tab before or after).
        Binding("left", "cursor(-1)", "Cursor ←", id="cursor_left", show=False,
                tooltip="curves: move the cursor left (its row's readings show under the plots)"),
        Binding("right", "cursor(1)", "Cursor →", id="cursor_right", show=False,
                tooltip="curves: move the cursor right (the first press puts it at the newest row)"),
        Binding("left_square_bracket", "step_tab(-1)", "Previous tab", key_display="[", id="previous_tab",
                group=TAB_KEYS, tooltip="the tab before this one (← on the tab bar too; Shift-Tab focuses it)"),
        Binding("right_square_bracket", "step_tab(1)", "Next tab", key_display="]", id="next_tab",
                group=TAB_KEYS, tooltip="the tab after this one (→ on the tab bar too; Shift-Tab focuses it)"),
        *(
            Binding(str(number), f"show_tab('tab-{name}')", name.capitalize(), id=f"tab_{name}", show=False,
                    tooltip=f"the {name} tab")
            for number, name in enumerate(TABS, start=1)
        ),
        Binding("slash", "search_probes", "Search", key_display="/", id="probe_search",
                tooltip="probes: show only readings whose name has these words"),
        # Off the footer, which the tab keys fill at 150 columns; in `?` help and the palette.
        Binding("j", "run_json", "run.json", id="run_json", show=False, tooltip="show the line's run.json"),
    ]

    def __init__(self, line: LineView) -> None:
        super().__init__()
        self.line = line
        self._ticks = 0
        self._log_busy = False

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False)
        yield QuietStatic(id="summary")
        yield EtaLine(id="eta")
        with TabbedContent(initial="tab-curves"):
            with TabPane("curves", id="tab-curves"):
                yield CurvesTab(self.line, id="curves-tab")
            with TabPane("probes", id="tab-probes"):
                yield Input(placeholder="search readings: words in their names", id="probe-search")
                yield ProbeTable(id="probes")
            with TabPane("samples", id="tab-samples"):
                yield SamplesTab(id="samples")
            with TabPane("checkpoints", id="tab-checkpoints"):
                yield CheckpointList(id="checkpoints")
            with TabPane("log", id="tab-log"):
                yield LogFollower(id="log")
            with TabPane("events", id="tab-events"):
                yield EventList(id="events")
            if self.line.is_pssa:
                with TabPane("memory", id="tab-memory"):
                    yield MemoryTab(id="memory")
        yield RequestProgress(id="progress")
        yield KeysFooter()

    def on_mount(self) -> None:
        self.show_header_note(self.app.header_note())  # type: ignore[attr-defined]
        self.refresh_view(self.app.clock())  # type: ignore[attr-defined]

    def on_unmount(self) -> None:
        # Its header, closed by now (a screen unmounts after its children), watched the app's title:
        # Textual would keep it for as long as the app runs (`nsconsole/widgets/closed_watchers.py`).
        drop_closed_watchers(self.app)

    def show_header_note(self, note: str) -> None:
        """The line's name in the header, and what the console says of itself (paused...) beside it."""
        self.sub_title = " · ".join(part for part in (self.line.name, note) if part)

    def selected_line_key(self) -> str | None:
        return self.line.key

    def refresh_view(self, now: float) -> None:
        line = self.line
        resumable = self.app.resume_refusal(line) is None  # type: ignore[attr-defined]
        self.query_one("#summary", QuietStatic).show_text(summary(line, now, resumable))
        eta = self.query_one(EtaLine)
        eta.show(line)
        curves = self.query_one(CurvesTab)
        if eta.plan is not None:
            curves.fork = eta.plan.fork
        self.set_class(not line.connected, "detached")
        active = self.query_one(TabbedContent).active
        if active == "tab-curves":
            curves.refresh_if_changed()
        elif active == "tab-probes":
            query = self.query_one("#probe-search", Input).value
            self.query_one(ProbeTable).show(line, query, curves.settings.pinned)
        elif active == "tab-samples":
            self.query_one(SamplesTab).show(line)
        elif active == "tab-checkpoints":
            if self._ticks % CHECKPOINT_REFRESH_TICKS == 0:
                self.query_one(CheckpointList).show(read_checkpoints(line.path))
        elif active == "tab-log":
            self._follow_log()
        elif active == "tab-events":
            self.query_one(EventList).show(line)
        elif active == "tab-memory":
            self.query_one(MemoryTab).show(line)
        self._ticks += 1

    def on_tabbed_content_tab_activated(self, event: TabbedContent.TabActivated) -> None:
        self._ticks = 0  # the newly shown tab reads its data at once
        self.refresh_view(self.app.clock())  # type: ignore[attr-defined]

    def _follow_log(self) -> None:
        live = self.app.live  # type: ignore[attr-defined]
        if live is None or self._log_busy or not (self.line.connected or self.line.at_rest):
            return
        self._log_busy = True

        async def fetch(offset: int, length: int) -> dict:
            # Through the supervisor; a line at rest (none runs it) from its run.log.
            return await live.read_log(self.line.key, offset, length)

        async def follow() -> None:
            try:
                with contextlib.suppress(LineError):
                    await self.query_one(LogFollower).poll(fetch)
            finally:
                self._log_busy = False

        self.run_worker(follow(), group="log", exclusive=True)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        # The cursor keys are the curves tab's; elsewhere left/right go to the tabs and tables.
        if action == "cursor":
            tabs = self.query(TabbedContent)
            return bool(tabs) and tabs.first().active == "tab-curves"
        if action == "show_tab":
            # Off, not hidden: `?` lists it with the reason and a press says it (`why_off`).
            return True if parameters[0] != "tab-memory" or self.line.is_pssa else None
        return True

    def why_off(self, action: str, parameters: tuple[object, ...]) -> str | None:
        """Why a key of this screen is off (None: it is on, or no reason is known)."""
        if action == "show_tab" and parameters and parameters[0] == "tab-memory" and not self.line.is_pssa:
            preset = self.line.status.get("preset") or self.line.facts.preset
            model = f"a {preset} line" if preset else "not a PSSA line, as far as its run.json tells"
            return f"the memory tab is for PSSA lines' memory banks; {self.line.name} is {model}"
        return None

    def _tab_bar_ready(self) -> bool:
        """Whether the tab bar has mounted its tabs. A tab key pressed right after Enter (a loaded
        machine) can come before: a tab shown then broke Textual's own mount of the bar (`No Tab with
        id '--content-tab-tab-curves'`), and the console exited."""
        tabbed = self.query(TabbedContent)
        if not tabbed or not tabbed.first().active:
            return False
        try:
            tabbed.first().get_tab(tabbed.first().active)
        except NoMatches:
            return False
        return True

    def _when_tab_bar_ready(self, action: Callable[[], None]) -> bool:
        """True when the tab bar is ready; else `action` runs again after the messages queued so far
        (the bar's mount among them)."""
        if self._tab_bar_ready():
            return True
        if self.is_attached:
            self.call_later(action)
        return False

    def action_step_tab(self, step: int) -> None:
        """Show the tab `step` places after the one shown (before it for a negative step), round the ends."""
        if not self._when_tab_bar_ready(lambda: self.action_step_tab(step)):
            return
        tabs = [f"tab-{name}" for name in TABS if self.check_action("show_tab", (f"tab-{name}",))]
        active = self.query_one(TabbedContent).active
        self.action_show_tab(tabs[(tabs.index(active) + step) % len(tabs)])

    def action_show_tab(self, tab: str) -> None:
        """Show `tab` and focus what it shows, so its keys (←/→ on the curves, ↑/↓ in a list) work at
        once; the search box is passed over (it would take the keys typed next), and a tab without
        anything to focus leaves the focus on the tab bar."""
        if not self._when_tab_bar_ready(lambda: self.action_show_tab(tab)):
            return
        tabbed = self.query_one(TabbedContent)
        tabbed.active = tab
        pane = tabbed.get_pane(tab)
        content = next((widget for widget in pane.query("*") if widget.can_focus and not isinstance(widget, Input)),
                       None)
        (content or tabbed.query_one(Tabs)).focus()

    def action_toggle_log_y(self) -> None:
        curves = self.query_one(CurvesTab)
        curves.settings.log_y = not curves.settings.log_y
        curves.changed()

    def action_smoothing(self) -> None:
        curves = self.query_one(CurvesTab)
        curves.settings.next_smoothing()
        curves.changed()

    def action_x_axis(self) -> None:
        curves = self.query_one(CurvesTab)
        curves.settings.next_x_axis()
        curves.changed()

    def action_cursor(self, step: int) -> None:
        self.query_one(CurvesTab).move_cursor(step)

    def action_search_probes(self) -> None:
        self.query_one(TabbedContent).active = "tab-probes"
        self.query_one("#probe-search", Input).focus()

    def on_input_changed(self, event: Input.Changed) -> None:
        self.refresh_view(self.app.clock())  # type: ignore[attr-defined]

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.query_one(ProbeTable).focus()

    def on_probe_table_pin_toggled(self, event: ProbeTable.PinToggled) -> None:
        self.query_one(CurvesTab).toggle_pin(event.name)
        self.refresh_view(self.app.clock())  # type: ignore[attr-defined]

    def action_run_json(self) -> None:
        eta = self.query_one(EtaLine)
        if eta.plan is None:
            self.notify(f"run.json: {eta.problem or 'not read yet'}", severity="warning")
            return
        self.app.push_screen(RunConfigScreen(str(self.line.path) + "/run.json", eta.plan.run_json))
