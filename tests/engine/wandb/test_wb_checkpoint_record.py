"""What a checkpoint records of the line's W&B run (`WandbMirror.checkpoint_record`)."""

from __future__ import annotations

from pathlib import Path

from helpers.wandb_fakes import FAST, ONLINE, RecordingBackend, SimulatedServer, save_state

from engine.config.run import WandbConfig
from engine.wandb.mirror import WandbMirror


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
