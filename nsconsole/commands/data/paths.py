"""The paths the data subcommands are given: data lines (resolved as every LINE is) and host.json's."""

from __future__ import annotations

import argparse
from pathlib import Path


def data_line_path(args: argparse.Namespace, path: Path) -> Path:
    """A data line named on the command line (--work, --like, --calibration-from), resolved as every
    LINE and `new --data DIR` are (`HostSettings.resolve_line`: the current directory, else
    host.json's `work_root`; absolute), so `data init --work lines/d` makes the line that
    `new --data lines/d` then finds, and dataline.json records absolute paths."""
    return args.host_settings.resolve_line(path)


def host_path(setting: str | None) -> Path | None:
    """A path setting of host.json (`~` expanded), None when unset."""
    return Path(setting).expanduser() if setting else None
