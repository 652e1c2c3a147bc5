"""The console's colour themes and its stylesheet (textual only).

Three themes, chosen with `nsconsole --theme NAME`: `dark` (the default), `light`, and
`colorblind`, whose success / warning / error colours are the Okabe-Ito sky blue, yellow and
vermillion, told apart without red-green vision. No state is ever shown by colour alone: every
state and health mark also has a glyph and a word, so any theme (or none) reads the same.

`console.tcss` is the layout of every screen; it uses only the themes' variables ($success,
$warning, $error, $primary...), so a theme changes the colours and nothing else.
"""

from __future__ import annotations

from pathlib import Path

from textual.theme import Theme

STYLESHEET = Path(__file__).with_name("console.tcss")
"""The console's stylesheet (every screen and widget)."""

DEFAULT_THEME = "dark"

THEMES: dict[str, Theme] = {
    theme.name: theme
    for theme in (
        Theme(
            name="dark",
            primary="#5FAFD7",
            secondary="#8787D7",
            accent="#D7AF5F",
            success="#5FD75F",
            warning="#FFAF00",
            error="#FF5F5F",
            foreground="#D0D0D0",
            background="#121212",
            surface="#1C1C1C",
            panel="#262626",
            dark=True,
        ),
        Theme(
            name="light",
            primary="#005F87",
            secondary="#5F5FAF",
            accent="#AF5F00",
            success="#007A00",
            warning="#AF5F00",
            error="#C00000",
            foreground="#1C1C1C",
            background="#F5F5F5",
            surface="#FFFFFF",
            panel="#E4E4E4",
            dark=False,
        ),
        Theme(
            # Okabe-Ito: sky blue for good, yellow for a warning, vermillion for an error.
            name="colorblind",
            primary="#CC79A7",
            secondary="#0072B2",
            accent="#E69F00",
            success="#56B4E9",
            warning="#F0E442",
            error="#D55E00",
            foreground="#E0E0E0",
            background="#101010",
            surface="#1A1A1A",
            panel="#242424",
            dark=True,
        ),
    )
}
"""Every theme by the name `--theme` takes."""
