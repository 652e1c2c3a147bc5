"""`R` (binding `resume`): start the supervisor of a line that none runs, as `nsconsole run LINE` does
(the console's part is told in `nsconsole.app`'s docstring); that supervisor, the console's child,
is reaped when it exits (`reap_when_it_exits`).

A mixin of `nsconsole.app.ConsoleApp`, sharing its state: it uses `clock`, the selected line
(`Navigation`), `_no_line_to_act_on` and `check_action` (`KeySwitches`) and Textual's
`push_screen_wait` and `notify`.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from textual import work

from engine.errors import LineError
from nsconsole.screens.confirm import ConfirmScreen
from nsconsole.state import LineView
from nsconsole.widgets.replies import toast_text


class Resuming:
    """The `resume` key (mixed into `ConsoleApp`): why it is off, and the supervisor it starts."""

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
        # Imported here, when a line is resumed: the supervisor's module is not needed to start the console.
        from engine.supervisor.lost import lost_line, unrecorded_settings
        from engine.supervisor.settings import SupervisorSettings
        from engine.supervisor.start import SupervisorSilent, start_detached

        # A line whose supervisor was lost (a reboot, a kill) goes on with the --engine and --stop-at it ran with.
        lost = lost_line(line.path)
        unknown = None if lost is None else unrecorded_settings(lost)
        question = f"Resume {line.path}?"
        detail = ("Its supervisor starts in the background, as `nsconsole run` starts it, and the trainer goes on "
                  "from the latest checkpoint." + (f"\n{unknown}." if unknown is not None else ""))
        if not await self.push_screen_wait(ConfirmScreen(question, detail)):
            return
        line.add_event(self.clock(), "request", "resume: starting its supervisor")
        # What `nsconsole run` refuses (another line trains its data line, a start check fails), `R` refuses.
        from nsconsole.start_checks import start_refusal

        refusal = await asyncio.to_thread(start_refusal, Path(line.path))
        if refusal is not None:
            line.add_event(self.clock(), "refused", f"resume: {refusal}", "error")
            self.notify(toast_text(f"✗ {line.name}: {refusal}"), severity="error", timeout=8, markup=False)
            return
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
