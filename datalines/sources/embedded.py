"""The embedded source: the Python standard library's `.py` files, without tests.

Every machine with Python has it, so the demo data line needs no network and no download. A
document is one file; a stratum is a top-level package (`email`, `asyncio`, ...), and the
top-level single-file modules together form the stratum `modules`. A recipe's `include`
patterns (e.g. `["json/*", "email/*"]`) narrow it to part of the library.
"""

from __future__ import annotations

import os
import platform
import sysconfig
from pathlib import Path
from typing import Any

from datalines.errors import InputChanged
from datalines.files import sha256_file
from datalines.sources.base import Source, SourceFile, matches

_SKIPPED_DIRECTORIES = frozenset(
    {"test", "tests", "idle_test", "__pycache__", "site-packages", "dist-packages", "__phello__"}
)
MODULES_STRATUM = "modules"


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_test_file(relative: Path) -> bool:
    if any(part in _SKIPPED_DIRECTORIES for part in relative.parts[:-1]):
        return True
    name = relative.name
    return name.startswith("test_") or name.endswith("_test.py") or name == "conftest.py"


def stdlib_files(root: Path) -> list[Path]:
    """Relative paths of the standard library's `.py` files without tests, sorted."""
    found = []
    for directory, subdirectories, names in os.walk(root):
        # Pruned in place so the walk never enters site-packages (often larger than the stdlib).
        subdirectories[:] = [name for name in subdirectories if name not in _SKIPPED_DIRECTORIES]
        relative_directory = Path(directory).relative_to(root)
        found.extend(relative_directory / name for name in names if name.endswith(".py"))
    return sorted((path for path in found if not is_test_file(path)), key=lambda path: path.as_posix())


class EmbeddedSource(Source):
    def take_pins(self) -> dict[str, Any]:
        root = stdlib_root()
        files = []
        for relative in stdlib_files(root):
            if self.spec.include and not matches(relative.as_posix(), self.spec.include):
                continue
            stratum = relative.parts[0] if len(relative.parts) > 1 else MODULES_STRATUM
            path = root / relative
            files.append(SourceFile(relative.as_posix(), stratum, path.stat().st_size, sha256_file(path)))
        return {
            "root": str(root),
            "python": platform.python_version(),
            "files": [file.to_json() for file in files],
        }

    def local_path(self, file: SourceFile) -> Path:
        return Path(self.pins["root"]) / file.path

    def fetch(self, file: SourceFile) -> Path:
        path = self.local_path(file)
        if not path.is_file():
            raise InputChanged(
                f"{path}: embedded source file is gone (the line was made with Python {self.pins['python']})",
                f"run the preparer with Python {self.pins['python']}, whose standard library the line pinned",
            )
        return path
