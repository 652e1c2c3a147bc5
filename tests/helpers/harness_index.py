"""The harness's own task index read once per test process, not once per `nsconsole eval` test.

lm-eval's `TaskManager` walks every YAML of the harness's thousands of tasks (6-10 s on the 2-core
CI machine) each time it is made, and each in-process eval test makes one. `TaskIndex.build`
indexes each root on its own and merges the roots in order, later ones overriding, so the
harness's root can be indexed once and merged with the test's own --include-path roots as
`build` merges them: the index each test's manager holds is the one it would have built.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import lm_eval.tasks
import pytest
from lm_eval.tasks._index import TaskIndex

HARNESS_ROOT = Path(lm_eval.tasks.__file__).resolve().parent
_harness_entries: dict[str, Any] = {}
_unpatched_build = TaskIndex.build


def _build(paths: Iterable[Path], *, resolve_includes: bool = True) -> dict[str, Any]:
    index: dict[str, Any] = {}
    for root in paths:
        if Path(root).resolve() == HARNESS_ROOT and resolve_includes:
            if not _harness_entries:
                _harness_entries.update(_unpatched_build([root]))
            index.update(_harness_entries)
        else:
            index.update(_unpatched_build([root], resolve_includes=resolve_includes))
    return index


@pytest.fixture
def harness_index_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """`TaskIndex.build` with the harness's root indexed once per process (see the module docstring)."""
    monkeypatch.setattr(TaskIndex, "build", staticmethod(_build))
