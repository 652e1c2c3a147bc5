"""What a checkpoint records of the line's W&B run (`WandbMirror.checkpoint_record`): the run, the step
acknowledged, and a rewind or fork planned and not carried out yet."""

from __future__ import annotations

from pathlib import Path

from helpers.wandb_fakes import FAST, ONLINE, RecordingBackend, SimulatedServer, save_state

from engine.config.run import WandbConfig
from engine.wandb.mirror import WandbMirror, plan_rollback


def test_a_checkpoint_taken_as_the_mirror_starts_names_the_line_s_run(tmp_path: Path) -> None:
    save_state(tmp_path, run_id="run7", start="new", acknowledged_step=4)
    server = SimulatedServer(down=True)  # W&B unreachable: nothing changes what the line knows
    mirror = WandbMirror(tmp_path, ONLINE, backend=RecordingBackend(server), options=FAST)
    mirror.start()
    # Read at start, not when the background thread gets to it.
    assert mirror.checkpoint_record() == {"run_id": "run7", "acknowledged_step": 4}
    mirror.close(timeout_s=0.1)


def test_a_disabled_line_records_no_run(tmp_path: Path) -> None:
    mirror = WandbMirror(tmp_path, WandbConfig(project="p", mode="disabled"))
    mirror.start()
    assert mirror.checkpoint_record() is None


def test_a_checkpoint_records_a_planned_start_until_it_is_carried_out(tmp_path: Path) -> None:
    save_state(tmp_path, run_id="a", start="new", acknowledged_step=8)
    plan_rollback(tmp_path, 5)
    server = SimulatedServer(down=True)
    mirror = WandbMirror(tmp_path, ONLINE, backend=RecordingBackend(server), options=FAST)
    mirror.start()
    assert mirror.checkpoint_record() == {
        "run_id": "a",
        "acknowledged_step": 8,
        "pending": {"kind": "rewind", "at_update": 5, "parent_run_id": None, "parent_rows": None,
                    "parent_acknowledged": None, "new_run_id": None, "initialized": False},
    }  # fmt: skip
    mirror.close(timeout_s=0.1)
