"""A confirmation answers the button ← or → moved to, also when Enter comes right behind it: the
keys of one terminal read (typed fast, over a slow link, pasted) are handled before any callback
the first one scheduled (Pilot; the keys posted together, as the terminal driver posts them).

Walked in tmux: `send-keys Left Enter` on `Roll /tmp/walkE/c/line back to update 50?` answered
No (nothing was rolled back); with 0.3 s between the keys it answered Yes.
"""

from __future__ import annotations

import asyncio

from textual import events
from textual.app import App

from nsconsole.screens.confirm import ConfirmScreen


class OneQuestion(App[bool]):
    def on_mount(self) -> None:
        self.push_screen(ConfirmScreen("Stop /srv/runs/trunk at the next update?"), self.exit)


def answer_to(*keys: tuple[str, str | None]) -> bool | None:
    app = OneQuestion()

    async def main() -> None:
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.pause()
            assert isinstance(app.screen, ConfirmScreen)
            for key, character in keys:  # in one batch: nothing runs between them
                app.post_message(events.Key(key, character))
            await pilot.pause()

    asyncio.run(main())
    return app.return_value


def test_left_then_enter_in_one_read_answers_yes() -> None:
    assert answer_to(("left", None), ("enter", "\r")) is True


def test_left_right_then_enter_in_one_read_answers_no() -> None:
    assert answer_to(("left", None), ("right", None), ("enter", "\r")) is False
