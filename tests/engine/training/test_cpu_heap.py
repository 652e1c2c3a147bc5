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

UPDATES = r'''
import resource, sys, torch
from engine.models.build import build_model
from engine.training.cpu_heap import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else None
torch.manual_seed(0)
model = build_model("transformer-1.5m")
optimizer = torch.optim.AdamW(model.parameters())
rows = torch.randint(0, 2048, (8, 65))

def update():
    loss, _ = model(rows[:, :-1], rows[:, 1:])
    loss.mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

for _ in range(6):
    update()
faults = []
for _ in range(9):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    update()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(applied, sorted(faults)[4])  # the median update's (a thread's first touch of a page is not ours)
'''


def faults_an_update(mode: str) -> tuple[str, float]:
    done = subprocess.run([sys.executable, "-c", UPDATES, mode], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    applied, faults = done.stdout.split()
    return applied, float(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_kept_memory_removes_the_page_faults_of_an_update() -> None:
    applied, kept = faults_an_update("keep")
    assert applied == "True"
    _, default = faults_an_update("default")
    # transformer-1.5m at 8 x 64: 400-2,000 faults an update by default (its logits and their
    # log-softmax handed back to the kernel and taken again), none once its heap keeps them.
    assert kept < 20 and default > 200, (kept, default)


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
