"""The console's health checks (pure functions) and its model of a line (`nsconsole/state.py`)."""

from __future__ import annotations

import math

from nsconsole import health
from nsconsole.state import LineFacts, LineView, Series, validation_loss
from nsconsole.widgets.lines_table import gpu_cell


def test_a_loss_spike_is_a_loss_above_one_and_a_half_times_the_mean_of_the_eight_rows_before() -> None:
    calm = [2.0] * 8
    assert health.loss_spike([*calm, 2.9]) is None
    flag = health.loss_spike([*calm, 3.1])
    assert flag is not None and flag.label == "▲ spike" and "1.55x" in flag.detail
    assert health.loss_spike([2.0] * 5 + [3.1]) is None  # too little history to judge
    assert health.loss_spike([*calm, math.nan]) is None  # a NaN is the skipped check's business
    # Only the last eight before the newest count: an old high loss does not hide a spike.
    assert health.loss_spike([9.0, *calm, 3.1]) is not None


def test_slow_throughput_is_three_updates_in_a_row_below_sixty_percent_of_its_running_median() -> None:
    history = [1000.0, 1100.0, 900.0, 1000.0, 1050.0, 950.0, 1000.0, 1000.0]
    assert health.slow_throughput([*history, 650.0, 640.0, 650.0]) is None
    assert health.slow_throughput([*history, 550.0, 550.0, 650.0]) is None  # not every one of the three
    flag = health.slow_throughput([*history, 550.0, 560.0, 550.0])
    assert flag is not None and flag.word == "slow" and "55%" in flag.detail
    assert health.slow_throughput(history[:4] + [10.0] * 3) is None  # warming up


def test_the_lr_check_uses_the_tokens_before_the_update_and_spares_skipped_updates() -> None:
    def schedule(tokens: float) -> float:
        return 1e-3 * min(1.0, tokens / 1000)

    row = {"lr": schedule(512), "tokens": 1024, "tokens_per_update": 512}
    assert health.lr_off_schedule(row, schedule) is None
    assert health.lr_off_schedule({**row, "lr": schedule(1024)}, schedule) is not None
    skipped = {"lr": schedule(1024), "tokens": 1024, "tokens_per_update": 512, "skipped": True}
    assert health.lr_off_schedule(skipped, schedule) is None
    assert health.lr_off_schedule(row, None) is None


def test_stale_heartbeat_counts_only_while_training() -> None:
    assert health.stale_heartbeat("training", 301.0) is not None
    assert health.stale_heartbeat("training", 299.0) is None
    assert health.stale_heartbeat("stopped", 9999.0) is None
    assert health.stale_heartbeat("training", None) is None


def test_skipped_updates_waiting_data_and_full_disk() -> None:
    assert health.skipped_updates([False] * 10) is None
    flag = health.skipped_updates([False, True, False, True])
    assert flag is not None and flag.severity == "error" and "2 of the last 4" in flag.detail
    assert health.waiting_for_data("training") is None
    assert health.waiting_for_data("waiting-data", 3).label == "… data"  # type: ignore[union-attr]
    gib = 2**30
    assert health.full_disk(100 * gib, 1000 * gib, 20e9) is None
    assert health.full_disk(10 * gib, 1000 * gib, 20e9) is not None  # below the line's guard
    assert health.full_disk(10 * gib, 1000 * gib, None) is not None  # 1 % free
    assert health.full_disk(None, None, 20e9) is None


def test_the_line_guards_from_run_json_are_gib_like_the_trainers() -> None:
    facts = LineFacts(share_reserve_gb=1.0, min_free_disk_gb=20.0)
    assert facts.share_reserve_bytes == 1_073_741_824 and facts.min_free_disk_bytes == 21_474_836_480
    assert LineFacts().share_reserve_bytes is None and LineFacts().min_free_disk_bytes is None
    line = LineView("k", "/runs/trunk", facts)
    # 21e9 bytes free is above 20e9 but below the trainer's 20 GiB (and 4.2 % of the disk): flagged
    # as the trainer is about to stop, not only once the disk is 2 % free.
    line.disk_free, line.disk_total = 21 * 10**9, 500 * 10**9
    assert [flag.kind for flag in line.refresh_health(0.0)] == ["disk"]
    line.disk_free = 22 * 10**9  # above 20 GiB: nothing to say
    assert line.refresh_health(1.0) == [] and line.health == []


def row(update: int, loss: float = 3.0, **extra: object) -> dict:
    return {"update": update, "tokens": update * 100, "loss": loss, "lr": 1e-3, "grad_norm": 1.0,
            "tokens_per_s": 1000.0, "cycle": update // 10, "stage": "trunk", **extra}


def test_a_resumed_trainer_replaying_updates_cuts_the_series_back() -> None:
    line = LineView("k", "/runs/trunk")
    line.apply_rows([row(u) for u in range(1, 11)], 0)
    for update in range(6, 13):  # a resume from the checkpoint at 5 writes 6.. again
        line.add_row(row(update, loss=2.0))
    assert line.series.update == list(range(1, 13))
    assert line.series.loss[4] == 3.0 and line.series.loss[5] == 2.0
    assert [r["update"] for r in line.recent_rows] == list(range(1, 13))


def test_validation_rows_are_kept_apart_and_give_the_val_loss() -> None:
    line = LineView("k", "/runs/trunk")
    line.apply_rows([row(1), row(2), {"update": 2, "tokens": 200, "seq_len": 64, "val_64/mix": 4.5, "val_64/text": 4.4}], 0)
    assert len(line.series) == 2 and line.val_loss == 4.5
    assert validation_loss({"val_128/mix": 3.0, "val_64/mix": 3.5}) == 3.5  # the training length first
    assert validation_loss({"val_64/a/mean": 2.0}) == 2.0


def test_a_nan_loss_pushed_as_null_is_shown_as_missing() -> None:
    series = Series()
    series.append(row(1, loss=None, skipped=True))  # type: ignore[arg-type]
    assert math.isnan(series.loss[0]) and series.skipped == [True]


def test_state_follows_connection_loss_and_a_restarted_supervisor() -> None:
    line = LineView("k", "/runs/trunk")
    assert line.display_state == "unreachable" and not line.mutable
    assert line.apply_hello({"epoch": "a", "pid": 1}, 10.0) is True  # first: fetch the rows
    line.apply_status({"state": "training", "launches": 3, "crashes": 2,
                       "heartbeat": {"time": 5.0, "stage": "checkpointing"}})
    assert line.display_state == "checkpointing" and line.restarts == 2 and line.mutable
    line.apply_rows([row(1)], 0)
    line.mark_disconnected("connection refused", 11.0)
    assert not line.mutable and line.display_state == "checkpointing"  # the last state stays
    assert line.series.update == [1]
    assert line.apply_hello({"epoch": "a", "pid": 1}, 12.0) is False  # the same supervisor: resubscribe
    assert line.apply_hello({"epoch": "b", "pid": 2}, 13.0) is True  # a new one: refetch
    assert [event.kind for event in line.events] == ["connected", "disconnected", "connected", "restarted"]


def test_health_flags_become_events_once() -> None:
    line = LineView("k", "/runs/trunk", LineFacts(schedule=lambda tokens: 1e-3))
    line.apply_hello({"epoch": "a"}, 0.0)
    line.apply_rows([row(u) for u in range(1, 10)] + [row(10, loss=9.0)], 0)
    new = line.refresh_health(100.0)
    assert [flag.kind for flag in new] == ["spike"]
    assert line.refresh_health(101.0) == []  # still raised: not news
    assert [event.kind for event in line.events][-1] == "spike"
    line.apply_notification("heartbeat", {"time": 100.0, "stage": "waiting-data", "cycle": 2}, 101.0)
    assert [flag.kind for flag in line.refresh_health(102.0)] == ["data"]


def test_a_line_sharing_its_gpu_says_so_while_its_rows_do() -> None:
    line = LineView("k", "/runs/trunk")
    line.apply_status({"state": "training", "gpu_index": 0})
    line.apply_rows([row(1, gpu_mode="own")], 0)
    assert not line.sharing_gpu and gpu_cell(line) == ("gpu0", "")
    line.add_row(row(2, gpu_mode="shared"))
    assert line.sharing_gpu and gpu_cell(line) == ("gpu0 shared", "warning")
    line.add_row(row(3, gpu_mode="own"))  # the others left: its own shapes again
    assert gpu_cell(line) == ("gpu0", "")
    assert gpu_cell(LineView("c", "/runs/cpu")) == ("cpu", "")
