"""A rollback's target is kept from the moment it is chosen: the trainer's own stop checkpoint and
the retention after it cannot remove it before the rollback runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.checkpoints.format import PINNED_NAME, apply_retention, write_latest
from engine.errors import LineError
from engine.layout import LineLayout
from engine.protocol.wire import RequestLog
from engine.supervisor.rpc import LineHandler, PausedWork


class StoppingSupervisor:
    """Stands in for the supervisor's pause: the trainer writes its stop checkpoint (u3), retention
    keeps the newest rolling one, and only then does the work (here: look for the target) run."""

    def __init__(self, root: Path) -> None:
        self.layout = LineLayout(root)
        self.request_log = RequestLog()
        self.seen: dict[str, Any] = {}

    def between_launches(self, work: PausedWork) -> dict[str, Any]:
        (self.layout.checkpoints / "u00000003").mkdir()
        write_latest(self.layout.checkpoints, "u00000003")
        self.seen["removed"] = apply_retention(self.layout.checkpoints, keep_last=1)
        self.seen["target_there"] = (self.layout.checkpoints / "u00000001").is_dir()
        raise LineError("the rollback itself is not what this test is about")


@pytest.fixture
def line(tmp_path: Path) -> Path:
    for update in (1, 2):
        (tmp_path / "checkpoints" / f"u{update:08d}").mkdir(parents=True)
    write_latest(tmp_path / "checkpoints", "u00000002")
    return tmp_path


def test_the_chosen_checkpoint_survives_the_stop_checkpoints_retention(line: Path) -> None:
    supervisor = StoppingSupervisor(line)
    with pytest.raises(LineError):
        LineHandler(supervisor).rollback(to=1)
    assert supervisor.seen == {"removed": ["u00000002"], "target_there": True}
    assert not (line / "checkpoints" / PINNED_NAME).exists()  # unpinned once the rollback is over


def test_without_the_pin_the_same_retention_removes_it(line: Path) -> None:
    # What the pin prevents: keep_last 1 after the stop checkpoint keeps u3 alone.
    (line / "checkpoints" / "u00000003").mkdir()
    write_latest(line / "checkpoints", "u00000003")
    assert apply_retention(line / "checkpoints", keep_last=1) == ["u00000001", "u00000002"]
