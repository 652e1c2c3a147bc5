"""A line's screen (Enter on the lines screen): tabs for curves, probes, checkpoints, log, events
and, for a PSSA line, its memory. While the supervisor is away the last state stays, dimmed.
"""

from __future__ import annotations

import contextlib

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Container
from textual.screen import Screen
from textual.widgets import Footer, Header, Static, TabbedContent, TabPane

from engine.errors import LineError
from nsconsole.state import LineView
from nsconsole.widgets import format as fmt
from nsconsole.widgets.checkpoint_list import CheckpointList, read_checkpoints
from nsconsole.widgets.curves import CURVES, CurvePlot
from nsconsole.widgets.event_list import EventList
from nsconsole.widgets.log_follower import LogFollower
from nsconsole.widgets.memory_tab import MemoryTab
from nsconsole.widgets.probe_table import ProbeTable

CHECKPOINT_REFRESH_TICKS = 10
"""The checkpoint directory is listed every this many view refreshes (it changes seldom)."""


def summary(line: LineView, now: float) -> Text:
    """The one-line header above the tabs."""
    text = Text()
    text.append(f"{line.name}", style="bold")
    text.append(f"  {line.kind}  {fmt.state_label(line.display_state)}")
    if not line.connected and line.display_state in fmt.FINAL_STATES:
        text.append("  the supervisor has exited; last state shown, changes off")
    elif not line.connected:
        reason = line.disconnect_reason or "not attached yet"
        text.append(f"  ⚡ supervisor unreachable ({reason}); last state shown, changes off")
    text.append(f"\n{line.path}", style="dim")
    preset = line.status.get("preset") or line.facts.preset or "?"
    latest = line.latest_checkpoint
    text.append(
        f"\nmodel {preset}  update {line.update if line.update is not None else '—'}  "
        f"tokens {fmt.count(line.tokens)}  loss {fmt.number(line.loss)}  val {fmt.number(line.val_loss)}  "
        f"checkpoint {'—' if latest is None else latest}  beat {fmt.age(line.heartbeat_age(now))}"
    )
    if line.sharing_gpu:
        text.append("  ⇄ sharing its GPU (shared shapes)")
    if line.health:
        text.append("  " + " ".join(flag.label for flag in line.health))
    return text


class LineScreen(Screen[None]):
    """See the module docstring."""

    BINDINGS = [
        Binding("escape", "app.pop_screen", "Lines", id="back", tooltip="back to the lines"),
        Binding("l", "toggle_log_y", "Log y", id="log_y", tooltip="switch the curves between a linear and a log axis"),
    ]

    def __init__(self, line: LineView) -> None:
        super().__init__()
        self.line = line
        self._ticks = 0
        self._log_busy = False

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False)
        yield Static(id="summary")
        with TabbedContent(initial="tab-curves"):
            with TabPane("curves", id="tab-curves"), Container(id="curves"):
                for column, title in CURVES:
                    yield CurvePlot(self.line, column, title, id=f"curve-{column}")
            with TabPane("probes", id="tab-probes"):
                yield ProbeTable(id="probes")
            with TabPane("checkpoints", id="tab-checkpoints"):
                yield CheckpointList(id="checkpoints")
            with TabPane("log", id="tab-log"):
                yield LogFollower(id="log")
            with TabPane("events", id="tab-events"):
                yield EventList(id="events")
            if self.line.is_pssa:
                with TabPane("memory", id="tab-memory"):
                    yield MemoryTab(id="memory")
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = self.line.name
        self.refresh_view(self.app.clock())  # type: ignore[attr-defined]

    def selected_line_key(self) -> str | None:
        return self.line.key

    def refresh_view(self, now: float) -> None:
        line = self.line
        header = self.query_one("#summary", Static)
        header.update(summary(line, now))
        self.set_class(not line.connected, "detached")
        active = self.query_one(TabbedContent).active
        if active == "tab-curves":
            for plot in self.query(CurvePlot):
                plot.refresh_if_changed()
        elif active == "tab-probes":
            self.query_one(ProbeTable).show(line)
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
        if live is None or self._log_busy or not self.line.connected:
            return
        self._log_busy = True

        async def fetch(offset: int, length: int) -> dict:
            return await live.call(self.line.key, "log", offset=offset, length=length)

        async def follow() -> None:
            try:
                with contextlib.suppress(LineError):
                    await self.query_one(LogFollower).poll(fetch)
            finally:
                self._log_busy = False

        self.run_worker(follow(), group="log", exclusive=True)

    def action_toggle_log_y(self) -> None:
        for plot in self.query(CurvePlot):
            plot.log_y = not plot.log_y
