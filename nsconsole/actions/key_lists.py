"""The lists of keys: `?` help (every binding of the screen, and why each one that is off is off) and
the command palette (ctrl+p), which offers the bindings of the screen under it that are on.

A mixin of `nsconsole.app.ConsoleApp`, sharing its state: it uses `why_off` (`KeySwitches`) and
Textual's `screen`, `push_screen`, `get_key_display`, `run_action` and `get_system_commands`.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial

from textual.actions import parse as parse_action
from textual.app import SystemCommand
from textual.screen import Screen

from nsconsole.screens.help import HelpScreen, KeyHelp


class KeyLists:
    """`?` help and the command palette's commands (mixed into `ConsoleApp`, whose bindings they list)."""

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
