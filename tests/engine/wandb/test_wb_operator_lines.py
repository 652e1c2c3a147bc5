"""What the operator reads of W&B's failures: one line each in run.log (the mirror's `report`), and
a stop that does not wait on a W&B that cannot be reached.

The mirror's failures went to the process's logger only: under the supervisor they reached run.log
as bare stderr lines without time or source, and `run --no-supervisor` left run.log without them.
"""

from __future__ import annotations

import errno
import time
from pathlib import Path

import pytest
from helpers.wandb_fakes import ONLINE, RecordingBackend, SimulatedServer, run_ids, wait_for, write_rows

from engine.wandb.mirror import MirrorOptions, RetryPolicy, WandbMirror, plan_rollback
from engine.wandb.state import WandbRunState

QUICK = MirrorOptions(retry=RetryPolicy(first_delay_s=0.01, max_delay_s=0.02), acknowledge_every_s=0.01)


def reporting_mirror(line: Path, server: SimulatedServer, options: MirrorOptions = QUICK) -> tuple[WandbMirror, list[str]]:
    lines: list[str] = []
    mirror = WandbMirror(
        line, ONLINE, backend=RecordingBackend(server), options=options, new_run_id=run_ids(), report=lines.append
    )
    mirror.start()
    return mirror, lines


def test_an_outage_is_one_line_in_run_log_and_its_end_another(tmp_path: Path) -> None:
    server = SimulatedServer(down=True)
    mirror, lines = reporting_mirror(tmp_path, server)
    for item in write_rows(tmp_path, range(1, 4)):
        mirror.log(item)
    wait_for(lambda: len(lines) > 0)
    time.sleep(0.1)  # several more retries (0.01-0.02 s apart) fail meanwhile: still the one line
    failures = [line for line in lines if line.startswith("W&B failed")]
    assert len(failures) == 1, lines
    assert "rows.jsonl" in failures[0] and "retrying in the background" in failures[0]
    server.down = False
    wait_for(lambda: mirror.status().sent_through == 3)
    assert mirror.close(timeout_s=10.0)
    assert any(line.startswith("W&B answers again after") for line in lines), lines
    assert server.steps("run1") == [1, 2, 3]


def test_closing_while_wandb_is_out_does_not_wait_out_the_grown_backoff(tmp_path: Path) -> None:
    # A first delay of 10 s stands for the minutes an outage's backoff has grown to by a stop.
    slow = MirrorOptions(retry=RetryPolicy(first_delay_s=10.0, max_delay_s=300.0), acknowledge_every_s=0.01)
    mirror, lines = reporting_mirror(tmp_path, SimulatedServer(down=True), slow)
    for item in write_rows(tmp_path, range(1, 4)):
        mirror.log(item)
    wait_for(lambda: mirror.status().last_error is not None)
    started = time.monotonic()
    assert mirror.close(timeout_s=15.0) is True
    assert time.monotonic() - started < 5.0  # a few quick tries (1 s apart), not 15 s


def test_a_damaged_state_file_is_one_line_naming_it_and_where_it_was_set_aside(tmp_path: Path) -> None:
    write_rows(tmp_path, range(1, 3))
    (tmp_path / "wandb_run.json").write_text('{"version": 1, "run_id": ')
    mirror, lines = reporting_mirror(tmp_path, SimulatedServer())
    assert mirror.close(timeout_s=10.0)
    [aside] = tmp_path.glob("wandb_run.json.bad-*")
    assert aside.read_text() == '{"version": 1, "run_id": '  # nothing saved is lost
    [line] = [line for line in lines if "wandb_run.json" in line]
    assert line.startswith("W&B: wandb_run.json: malformed JSON at line 1 column 26")
    assert aside.name in line and "new W&B run" in line


class FullDisk:
    """WandbRunState.save failing with ENOSPC while `full` is set."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, full: bool) -> None:
        self.full = full
        original = WandbRunState.save

        def save(state: WandbRunState, path: Path) -> None:
            if self.full:
                raise OSError(errno.ENOSPC, "No space left on device")
            original(state, path)

        monkeypatch.setattr(WandbRunState, "save", save)


def full_disk_mirror(
    line: Path, monkeypatch: pytest.MonkeyPatch, full: bool
) -> tuple[FullDisk, SimulatedServer, WandbMirror, list[str]]:
    disk = FullDisk(monkeypatch, full)
    server = SimulatedServer()
    return (disk, server, *reporting_mirror(line, server))


def test_a_state_file_that_cannot_be_saved_is_one_line_until_a_save_works_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk, server, mirror, lines = full_disk_mirror(tmp_path, monkeypatch, full=False)
    wait_for(lambda: mirror.status().connected)
    disk.full = True
    for item in write_rows(tmp_path, range(1, 4)):
        mirror.log(item)
    wait_for(lambda: mirror.status().sent_through == 3)
    time.sleep(0.1)  # acknowledgements keep trying to save meanwhile
    assert lines == [f"W&B: could not save {tmp_path / 'wandb_run.json'}: No space left on device"]
    disk.full = False
    assert mirror.close(timeout_s=10.0)
    assert WandbRunState.load(tmp_path / "wandb_run.json").acknowledged_step == 3
    assert server.steps("run1") == [1, 2, 3]


def test_a_start_that_cannot_save_its_state_waits_and_its_line_names_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The run's id must be on disk before the run is created (else a crash makes yet another
    # run): the start waits for the disk, as for an outage, and says which file it could not save.
    disk, server, mirror, lines = full_disk_mirror(tmp_path, monkeypatch, full=True)
    for item in write_rows(tmp_path, range(1, 4)):
        mirror.log(item)
    wait_for(lambda: any(line.startswith("W&B failed") for line in lines))
    [failure] = [line for line in lines if line.startswith("W&B failed")]
    assert f"could not save {tmp_path / 'wandb_run.json'}: No space left on device" in failure
    assert server.history == {}  # no run was created before its id was on disk
    disk.full = False
    wait_for(lambda: mirror.status().sent_through == 3)
    assert mirror.close(timeout_s=10.0)
    assert server.steps("run1") == [1, 2, 3]


def test_a_refused_rewind_is_a_line_in_run_log(tmp_path: Path) -> None:
    # A server without W&B's rewind: the rollback's W&B record becomes a new run, which the user
    # must read where they look (it went to the logger only).
    server = SimulatedServer(history={"runA": [(u, {"loss": 1.0}) for u in range(1, 9)]}, refuses_rewind=True)
    write_rows(tmp_path, range(1, 6))
    state = WandbRunState(run_id="runA", start="new", acknowledged_step=8)
    state.save(tmp_path / "wandb_run.json")
    plan_rollback(tmp_path, 5)
    mirror, lines = reporting_mirror(tmp_path, server)
    wait_for(lambda: mirror.status().sent_through == 5)
    assert mirror.close(timeout_s=10.0)
    assert [line for line in lines if line.startswith("W&B refused to rewind run runA (")], lines
    assert any(line.endswith("the rollback starts a new run") for line in lines)
