"""A preparer killed mid-cycle (a reboot, the supervisor's process group SIGKILLed) leaves, beside
its partial cycle directory, the temporary files of atomic writes it had under way: preparer.json is
rewritten all along a cycle. The next preparer removed the directory and left the files for good
(found in a walkthrough of unattended lines)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from helpers.lines import make_data_line

from datalines import open_data_line
from datalines.preparer import prepare_cycle


def dead_pid() -> int:
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(finished.stdout)


def test_a_killed_preparer_s_temporary_files_are_removed_by_the_next(tmp_path: Path) -> None:
    line = open_data_line(make_data_line(tmp_path, files=1, prepare=0, validation=()))
    dead = dead_pid()
    (line.path / "plans").mkdir(exist_ok=True)
    left = [line.path / f".tmp-{dead}-preparer.json", line.path / "plans" / f".tmp-{dead}-c0000.json"]
    live = line.path / f".tmp-{os.getpid()}-preparer.json"  # a writer still at work: not touched
    for path in (*left, live):
        path.write_text("{")
    prepare_cycle(line, 0)
    assert [path for path in left if path.exists()] == []
    assert live.exists() and line.cycle_ready(0)


WRITE_PAST_A_FILE_SIZE_LIMIT = """
import resource, signal, sys
from pathlib import Path
from datalines.files import write_bytes_atomic
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
try:
    write_bytes_atomic(Path(sys.argv[1]), b"x" * 65536)
except OSError as error:
    print(error.errno)
"""


def test_a_write_that_fails_midway_leaves_no_temporary_and_the_file_as_it_was(tmp_path: Path) -> None:
    """A write the disk refuses midway (ENOSPC; here a file-size limit, the same failed write(2))
    left its 0-byte `.tmp-<pid>-` file beside the status until the next preparer (a walkthrough of
    many lines on one full disk)."""
    status = tmp_path / "preparer.json"
    status.write_text('{"state": "waiting"}\n')
    failed = subprocess.run([sys.executable, "-c", WRITE_PAST_A_FILE_SIZE_LIMIT, str(status)],
                            capture_output=True, text=True, check=True)
    assert failed.stdout.strip() == str(27), failed.stdout + failed.stderr  # EFBIG
    assert status.read_text() == '{"state": "waiting"}\n'
    assert sorted(path.name for path in tmp_path.iterdir()) == ["preparer.json"]


TAKE_THE_LOCK_ON_A_FULL_DISK = """
import resource, signal, sys
from pathlib import Path
from datalines.service import PreparerLock
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1, resource.RLIM_INFINITY))  # the holder's record does not fit
try:
    PreparerLock(Path(sys.argv[1]), "rebuild")
except OSError as error:
    print(error.filename)
"""


def test_a_lock_whose_holder_record_cannot_be_written_names_the_lock_and_lets_it_go(tmp_path: Path) -> None:
    """`data rebuild` on a full disk named the cycle's directory, not preparer.lock, whose write failed."""
    from datalines.service import PreparerLock
    from datalines.status import LOCK_NAME

    failed = subprocess.run([sys.executable, "-c", TAKE_THE_LOCK_ON_A_FULL_DISK, str(tmp_path)],
                            capture_output=True, text=True, check=True)
    assert failed.stdout.strip() == str(tmp_path / LOCK_NAME), failed.stdout + failed.stderr
    PreparerLock(tmp_path, "rebuild").release()  # not held by the failed taker
