"""A line asked to stop reads `◼ stopping` until its supervisor says it stopped, also in the seconds
between the trainer serving the stop (it removes STOP and beats `stopped`) and its exit, which the
supervisor's status still calls `training` (frozen data, Pilot).

Walked in tmux: `s` on a training line read `◼ stopping`, then `▶ training` for about 3 s (STOP
gone, the heartbeat `"stage": "stopped", "reason": "stop requested"`), then `■ stopped`.
"""

from __future__ import annotations

import asyncio

from helpers.console import NOW, console, settle

from nsconsole.widgets.lines_table import LinesTable

KEY = "pssa-trunk-id"
"""The frozen book's first line: training, trainer pid 5100, a heartbeat at update 500."""


def test_a_served_stop_reads_stopping_until_the_supervisor_says_stopped() -> None:
    app = console()

    async def main() -> None:
        async with app.run_test(size=(150, 40)) as pilot:
            await settle(pilot)
            line = app.book.get(KEY)
            assert line is not None
            training = dict(line.status)
            line.apply_status({**training, "stop": {"at_cycle_end": None, "requested": "2026-12-07T19:25:14+00:00"}})
            assert line.display_state == "stopping"
            # The trainer served the stop: STOP is gone, its last beat says why; it has not exited yet.
            served = {"time": NOW + 1, "update": 501, "stage": "stopped", "reason": "stop requested", "pid": 5100}
            line.apply_notification("heartbeat", served, NOW + 1)
            line.apply_status({**training, "stop": None, "heartbeat": served})
            app.refresh_views()
            await pilot.pause()
            assert line.display_state == "stopping"
            assert "◼ stopping" in app.screen.query_one(LinesTable).get_cell(KEY, "state").plain
            # A trainer stopped by a stray SIGTERM is relaunched by its supervisor: not a stop.
            stray = {**served, "time": NOW + 2, "reason": "signal SIGTERM"}
            line.apply_status({**training, "stop": None, "heartbeat": stray})
            assert line.display_state == "training"
            # A stopped trainer's beat read before the next trainer's first (another pid): not a stop.
            line.apply_status({**training, "stop": None, "trainer_pid": 5200, "heartbeat": {**served, "time": NOW + 3}})
            assert line.display_state == "training"

    asyncio.run(main())
