"""The files a data line's preparer reads, stamped: an operator's fix of them changes the stamp.

A preparer stops for good on a failure that does not pass by itself (`datalines/failures.py`): a
pinned source file changed or gone, a dataline.json or tokenizer.json that no longer reads, a
damaged manifest or plan. Each is mended in one of these files (the file restored, `data rebuild
--cycle N`, dataline.json put right), so the line's supervisor watches their stamp and starts the
preparer again once it moved (`engine/supervisor/preparer.py`), instead of waiting for the line's
next start. A stamp is a stat per file, no reads: a data line of thousands of pinned files is
stamped in milliseconds.
"""

from __future__ import annotations

import os
from pathlib import Path

from datalines.dataline import open_data_line
from datalines.errors import DataLineError

FileStamp = tuple[int, int, int] | None
"""(inode, size, modification time in ns), None for a file that is gone or cannot be read."""


def input_stamp(data_path: Path) -> tuple[tuple[str, FileStamp], ...]:
    """Every file the preparer reads before it writes (its configuration, its plans and manifests,
    the pinned files of its sources read in place), each with its `FileStamp`."""
    paths = [data_path / "dataline.json", data_path / "tokenizer.json"]
    paths += sorted((data_path / "plans").glob("c[0-9][0-9][0-9][0-9].json"))
    paths += sorted((data_path / "cycles").glob("c[0-9][0-9][0-9][0-9]/manifest.json"))
    try:
        line = open_data_line(data_path)
        for name in line.sources:
            source = line.source(name)
            paths += [path for file in source.files if (path := source.local_path(file)) is not None]
    except (DataLineError, OSError, ValueError):
        pass  # a dataline.json that does not read: its own stamp tells when it is put right
    return tuple((str(path), file_stamp(path)) for path in paths)


def file_stamp(path: Path) -> FileStamp:
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return stat.st_ino, stat.st_size, stat.st_mtime_ns
