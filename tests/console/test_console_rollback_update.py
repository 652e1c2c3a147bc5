"""After a rollback the lines table shows the update the line went back to, until the relaunched
trainer beats: the stopped trainer's last heartbeat, which the supervisor's status keeps sending
meanwhile (the heartbeat file is the stopped trainer's until the new one writes), does not bring
the set-aside update back (frozen data, Pilot).

Walked in tmux: a line rolled back from update 99 to 60 read `▶ training  trunk  99  29.9K  5`
(update 99 beside update 60's tokens and cycle) for the seconds the new trainer took to start.
"""

from __future__ import annotations

import asyncio

from helpers.console import NOW, console, rows_of, settle

from nsconsole.widgets.lines_table import LinesTable

KEY = "tf-baseline-id"
"""The frozen book's transformer line: rows and a heartbeat at update 500."""


def test_a_rolled_back_update_is_not_undone_by_the_stopped_trainers_last_beat() -> None:
    app = console()

    async def main() -> None:
        async with app.run_test(size=(150, 40)) as pilot:
            await settle(pilot)
            line = app.book.get(KEY)
            assert line is not None and line.update == 500
            stale_status = dict(line.status)  # its heartbeat: the trainer's last, at update 500
            rolled_back = {"event": "rolled_back", "time": NOW, "message": "rollback done; the line continues from update 400",
                           "result": {"to_update": 400}}  # fmt: skip
            line.apply_notification("event", rolled_back, NOW)
            line.apply_rows(rows_of(400, 3.4, 1.7), 0)  # the console fetches the rows again
            # The next status poll: the supervisor relaunches the trainer, whose first beat is not written yet.
            line.apply_status({**stale_status, "launches": stale_status["launches"] + 1,
                               "rollbacks": [NOW]})  # fmt: skip
            app.refresh_views()
            await pilot.pause()
            assert line.update == 400
            assert app.screen.query_one(LinesTable).get_cell(KEY, "update").plain == "400"
            # The new trainer's first beat moves it on.
            line.apply_notification("heartbeat", {"time": NOW + 5, "update": 401, "stage": "training", "pid": 5999}, NOW + 5)
            assert line.update == 401

    asyncio.run(main())
