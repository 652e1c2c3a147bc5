"""run.log and supervisor.out stay bounded: rotated past the cap, the newest few kept."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from engine.logrotate import RotatingLog, rotate_if_needed


def test_rotation_keeps_the_newest_files(tmp_path: Path) -> None:
    log_path = tmp_path / "run.log"
    log = RotatingLog(log_path, max_bytes=100, keep=2)
    for number in range(45):
        log.write(f"entry {number:04d}\n")  # 11 bytes each: a rotation every 10 entries
    log.close()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["run.log", "run.log.1", "run.log.2"]
    texts = [(tmp_path / name).read_text() for name in ("run.log.2", "run.log.1", "run.log")]
    entries = "".join(texts).split()
    numbers = [int(word) for word in entries if word.isdigit()]
    assert numbers == list(range(20, 45))  # contiguous, newest last, nothing lost in between
    assert all(len(text) <= 100 + 11 for text in texts)


def test_a_writer_follows_another_writers_rotation(tmp_path: Path) -> None:
    log_path = tmp_path / "run.log"
    first, second = RotatingLog(log_path, max_bytes=50, keep=3), RotatingLog(log_path, max_bytes=50, keep=3)
    first.write("a" * 60 + "\n")  # past the cap: first rotates
    second.write("from second\n")  # second's file was rotated away: it must write to the new run.log
    assert log_path.read_text() == "from second\n"
    assert (tmp_path / "run.log.1").read_text() == "a" * 60 + "\n"
    first.close()
    second.close()


def test_rotate_if_needed_leaves_small_files(tmp_path: Path) -> None:
    log_path = tmp_path / "supervisor.out"
    assert not rotate_if_needed(log_path, max_bytes=10)
    log_path.write_text("short\n")
    assert not rotate_if_needed(log_path, max_bytes=10)
    log_path.write_text("long enough to rotate\n")
    assert rotate_if_needed(log_path, max_bytes=10)
    assert not log_path.exists() and (tmp_path / "supervisor.out.1").exists()
    assert os.listdir(tmp_path) == ["supervisor.out.1"]


def test_the_trainer_s_run_log_rotates_while_it_runs(tmp_path: Path) -> None:
    from engine.rows import RunLog

    log = RunLog(tmp_path / "run.log", max_bytes=1000)
    for update in range(100):  # about 60 bytes a line: several rotations within one "launch"
        log.write(f"update {update:7d}  loss 3.1416")
    log.close()
    assert (tmp_path / "run.log.1").is_file() and (tmp_path / "run.log").stat().st_size <= 1100
    assert "update      99" in (tmp_path / "run.log").read_text()


def test_a_trainers_crash_after_rotations_lands_in_the_current_run_log(tmp_path: Path) -> None:
    # As the supervisor launches it: stdout and stderr on run.log. Its own log rotates run.log four
    # times (three rotated files kept), then it prints and crashes. Before, both went to the file of
    # its launch, deleted by then as the oldest.
    log_path = tmp_path / "run.log"
    program = (
        "import sys\n"
        "from engine.rows import RunLog\n"
        f"log = RunLog(__import__('pathlib').Path({str(log_path)!r}), max_bytes=1000)\n"
        "print('at launch', flush=True)\n"
        "for update in range(80):\n"
        "    log.write(f'update {update:7d}  loss 3.1416')\n"
        "print('printed late')\n"
        "raise RuntimeError('the crash')\n"
    )
    with open(log_path, "ab") as output:
        finished = subprocess.run([sys.executable, "-c", program], stdout=output, stderr=subprocess.STDOUT, check=False)
    assert finished.returncode == 1
    current = log_path.read_text()
    assert (tmp_path / "run.log.3").is_file() and "update      79" in current
    assert "printed late" in current and "RuntimeError: the crash" in current
    assert current.index("update      79") < current.index("printed late")


def test_stdio_elsewhere_is_left_alone(tmp_path: Path) -> None:
    # A foreground trainer's stdout is the terminal (here: another file): its log's rotation keeps off it.
    other = tmp_path / "terminal"
    program = (
        "from pathlib import Path\n"
        "from engine.rows import RunLog\n"
        f"log = RunLog(Path({str(tmp_path / 'run.log')!r}), max_bytes=200)\n"
        "for update in range(20):\n"
        "    log.write(f'update {update:7d}  loss 3.1416')\n"
        "print('still here', flush=True)\n"
    )
    with open(other, "wb") as output:
        subprocess.run([sys.executable, "-c", program], stdout=output, check=True)
    assert other.read_text() == "still here\n"
