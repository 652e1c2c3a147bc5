"""Environment variables for a block of a test (wandb's among them)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def scoped_environment(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for a block, then restore what was there (or remove them)."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def wandb_environment(home: Path) -> dict[str, str]:
    """Silent wandb with every file of the client under `home` and no way to the network."""
    return {
        "WANDB_SILENT": "true",
        "WANDB_DIR": str(home),
        "WANDB_CONFIG_DIR": str(home / "config"),
        "WANDB_CACHE_DIR": str(home / "cache"),
        "WANDB_DATA_DIR": str(home / "data"),
        # Should anything try the network anyway, it fails at once instead of reaching W&B.
        "WANDB_BASE_URL": "http://127.0.0.1:9",
    }


def nsconsole_process(*arguments: str) -> subprocess.CompletedProcess[str]:
    """`python -m nsconsole ARGUMENTS` as a user runs it, from the repository, on one thread; never
    raises on its exit status."""
    from helpers import REPOSITORY

    environment = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(REPOSITORY))
    return subprocess.run(
        [sys.executable, "-m", "nsconsole", *arguments],
        cwd=REPOSITORY, env=environment, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
