"""A CPU trainer keeps its freed memory: the same update's large temporaries come back without page
faults (each run in its own process: the setting is process-wide)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers.lines import copy_data_line, data_template_fixture, make_line

from engine.training import trainer as trainer_module
from engine.training.trainer import Trainer

data_template = data_template_fixture()

ROUNDS = r'''
import ctypes, resource, sys
from engine.training.cpu_heap import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else None
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, (ctypes.c_size_t,), (ctypes.c_void_p,)
size = 24 << 20


warm_up = 1


def step():  # three 24 MiB blocks, written and freed: an update's temporaries, in malloc's terms
    blocks = [libc.malloc(size) for _ in range(3)]
    for block in blocks:
        ctypes.memset(block, 1, size)
    for block in blocks:
        libc.free(block)
'''

UPDATES = r'''
import resource, sys, torch
from engine.models.build import build_model
from engine.training.cpu_heap import keep_freed_memory
applied = keep_freed_memory()
torch.manual_seed(0)
model = build_model("transformer-1.5m")
optimizer = torch.optim.AdamW(model.parameters())
rows = torch.randint(0, 2048, (8, 65))
warm_up = 6


def step():
    loss, _ = model(rows[:, :-1], rows[:, 1:])
    loss.mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
'''

MEASURED = r'''
for _ in range(warm_up):
    step()
faults = []
for _ in range(9):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(applied, sorted(faults)[4])  # the median step's (a thread's first touch of a page is not ours)
'''


def run(script: str, *arguments: str) -> tuple[str, float]:
    """`script` (which sets `applied`, `warm_up` and `step`) in a fresh process: the faults of its median
    step after the warm-up."""
    command = [sys.executable, "-c", script + MEASURED, *arguments]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    applied, faults = done.stdout.split()
    return applied, float(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_kept_memory_is_reused_where_glibc_would_hand_it_back() -> None:
    # By default the 72 MiB freed at the heap's top pass glibc's trim threshold (at most 64 MiB) and go
    # back to the kernel: every round faults them in again (18,432 pages of 4 KiB). Kept: none.
    applied, kept = run(ROUNDS, "keep")
    _, default = run(ROUNDS, "default")
    assert applied == "True"
    assert kept == 0 and default >= 9_000, (kept, default)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_training_update_with_kept_memory_takes_no_page_faults() -> None:
    # transformer-1.5m at 8 x 64: 600-2,900 faults an update with glibc's defaults in most processes
    # (where its logits fall in the heap depends on the process's history), none kept.
    applied, kept = run(UPDATES)
    assert applied == "True" and kept < 20, kept


def test_a_cpu_trainer_keeps_its_freed_memory_only_in_its_own_process(
    tmp_path: Path, data_template: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    line = make_line(tmp_path, copy_data_line(data_template, tmp_path))
    calls: list[bool] = []
    monkeypatch.setattr(trainer_module, "keep_freed_memory", lambda: calls.append(True) or True)
    assert Trainer(line, stop_at=1, echo=None).run() == 0  # a test's process: left as it is
    assert calls == []
    # As `python -m engine.training.main` (the supervisor's launch) and `nsconsole run --no-supervisor` run it.
    assert Trainer(line, stop_at=2, echo=None, owns_process=True).run() == 0
    assert calls == [True]
