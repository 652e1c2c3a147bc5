"""Shared test setup: CPU determinism, Triton in interpreter mode where there is no GPU."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers.environment import scoped_environment, wandb_environment

from engine.supervisor.registry import HISTORY_ENV_VARIABLE, RUN_ENV_VARIABLE

if not torch.cuda.is_available():
    # Triton kernels run on the CPU through the interpreter (needs numpy); must be set
    # before triton is first imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# Lines default to offline W&B: keep every wandb client the suite starts quiet, inside a
# throwaway directory, and pointed at a dead port so nothing can reach a network.
_WANDB_HOME = tempfile.mkdtemp(prefix="nsconsole-tests-wandb-")
for _name, _value in {
    "WANDB_SILENT": "true",
    "WANDB_CONFIG_DIR": os.path.join(_WANDB_HOME, "config"),
    "WANDB_CACHE_DIR": os.path.join(_WANDB_HOME, "cache"),
    "WANDB_DATA_DIR": os.path.join(_WANDB_HOME, "data"),
    "WANDB_BASE_URL": "http://127.0.0.1:9",
}.items():
    os.environ.setdefault(_name, _value)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_cuda = pytest.mark.skip(reason="needs an NVIDIA GPU (run on the H200)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip_cuda)


@pytest.fixture(scope="module")
def offline_wandb(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A module's wandb clients write under one temporary home (yielded)."""
    home = tmp_path_factory.mktemp("wandb_home")
    with scoped_environment(wandb_environment(home)):
        yield home


@pytest.fixture(autouse=True)
def private_line_history(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """`$NSCONSOLE_HISTORY` in a directory of the test's own: never the user's `~/.nsconsole/history`,
    and no line of an earlier test listed by a console (a test may point it elsewhere)."""
    monkeypatch.setenv(HISTORY_ENV_VARIABLE, str(tmp_path_factory.mktemp("line_history")))


@pytest.fixture(autouse=True)
def private_run_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """`$NSCONSOLE_RUN` in a directory of the test's own: no supervisor or GPU lease of the user's
    (`~/.nsconsole/run`) or of another test is seen (a test may point it elsewhere)."""
    monkeypatch.setenv(RUN_ENV_VARIABLE, str(tmp_path_factory.mktemp("run_dir")))


@pytest.fixture
def private_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty host.json of the test's own (`tmp_path/host.json`, `$NSCONSOLE_HOST`) and a private
    runtime directory (`tmp_path/run`, `$XDG_RUNTIME_DIR`): no setting of the user's host (notify
    commands, work roots) reaches the supervisors a test starts. Returns the host.json's path (a
    test may write settings into it). Files that start supervisors take it for every test:
    `pytestmark = pytest.mark.usefixtures("private_host")`."""
    (tmp_path / "run").mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    host = tmp_path / "host.json"
    host.write_text("{}")
    monkeypatch.setenv("NSCONSOLE_HOST", str(host))
    return host


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One intra-op thread: tiny models and layers only lose to threads on a loaded 2-core machine."""
    from helpers.lines import one_torch_thread

    with one_torch_thread():
        yield


@pytest.fixture
def record_launches(monkeypatch: pytest.MonkeyPatch):
    """`record(module, name)` puts a recorder in place of a module's Triton kernel and returns the
    list its launches go to: each launch's keyword arguments plus `args`, the positional ones; the
    kernel still runs. For tests of which variant a shape takes (unmasked loops, launches)."""

    def record(module, name: str) -> list[dict]:
        kernel, launches = getattr(module, name), []

        class Recorder:
            def __getitem__(self, grid):
                launch = kernel[grid]

                def recorded(*args, **kwargs):
                    launches.append(kwargs | {"args": args})
                    return launch(*args, **kwargs)

                return recorded

        monkeypatch.setattr(module, name, Recorder())
        return launches

    return record
