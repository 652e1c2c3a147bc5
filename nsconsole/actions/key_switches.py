"""Which keys are on: the mutating keys and `resume` are off while they would do nothing, and a key
that is off, pressed, says why in a toast.

A mixin of `nsconsole.app.ConsoleApp`, sharing its state: it uses `readonly`, `live` (None: not
attached), `pending` (the requests waiting for a reply), the selected line and its screen
(`Navigation`), `resume_refusal` (`Resuming`) and Textual's `screen` and `notify`.
"""

from __future__ import annotations

from textual import events
from textual.actions import parse as parse_action
from textual.screen import Screen

from nsconsole.screens.line import LineScreen
from nsconsole.state import LineView
from nsconsole.widgets import format as fmt

MUTATING_ACTIONS = frozenset({"stop", "branch", "rollback", "tune"})
TOLD_WHEN_OFF = MUTATING_ACTIONS | {"resume", "show_tab"}
"""Actions whose key, pressed while off, says why in a toast. Not the curves' ←/→: off the curves tab
they fall to the tab bar and the lists, and a toast at every press there would be noise."""


class KeySwitches:
    """Which keys are on and why one is off (mixed into `ConsoleApp`, whose state decides it)."""

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
