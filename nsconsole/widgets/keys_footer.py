"""The screens' footer: Textual's, with `?` Help and `q` Quit kept at its right end beside the
command palette's key.

Textual's footer lists the screen's keys, then the app's, and cuts what does not fit: at 80
columns that cut Help and Quit, the two keys that lead to everything else (help lists every key,
the palette runs every action). Docked right with the palette's key, they stay whatever the
width; the keys that do not fit are cut before them instead.
"""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import HorizontalGroup
from textual.widgets import Footer
from textual.widgets._footer import FooterKey  # (not exported by textual.widgets)

from nsconsole.widgets.closed_watchers import drop_closed_watchers

KEPT_ACTIONS = ("help", "quit")
"""The actions whose keys the footer keeps in view at any width, in this order."""


class KeysFooter(Footer):
    """See the module docstring."""

    def compose(self) -> ComposeResult:
        kept: dict[str, FooterKey] = {}
        palette: list[FooterKey] = []
        for widget in super().compose():
            if isinstance(widget, FooterKey) and widget.action in KEPT_ACTIONS:
                kept[widget.action] = widget
            elif isinstance(widget, FooterKey) and widget.has_class("-command-palette"):
                palette.append(widget)
            else:
                yield widget
        with HorizontalGroup(id="kept-keys"):
            yield from (kept[action] for action in KEPT_ACTIONS if action in kept)
            yield from palette

    async def recompose(self) -> None:
        """Redraw the keys (the screen's bindings changed), and forget the old keys' binding to this
        footer's `compact`, which Textual would keep as long as the footer lives."""
        await super().recompose()
        drop_closed_watchers(self)
