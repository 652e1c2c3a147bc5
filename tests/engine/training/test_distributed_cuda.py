"""On the GPU: the trainer under torchrun (NCCL) gives the plain trainer's line. Skipped without CUDA
(run on the H200; degree 2 needs two GPUs).

Each line is trained by `python -m engine.training.main` in a child process (so that no CUDA context
of this test process sits on the GPU as "another process"), in the default engine (CUDA graphs).
How far two plain runs of the same line differ is measured first: where they are equal bit for
bit, the torchrun line must be too; otherwise it may differ by no more than twice that spread.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import REPOSITORY
from helpers.lines import copy_data_line, data_template_fixture, line_readings, line_spread, make_line

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

data_template = data_template_fixture()

UPDATES = 12


def train(line: Path, nproc: int | None) -> None:
    """The line to UPDATES updates: alone (`nproc` None) or as `nproc` torchrun ranks."""
    main = ["-m", "engine.training.main", str(line), "--parent", str(os.getpid()), "--stop-at", str(UPDATES)]
    if nproc is None:
        argv = [sys.executable, *main]
    else:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                "--max-restarts=0", *main]  # fmt: skip
    environment = dict(os.environ, PYTHONPATH=str(REPOSITORY))
    done = subprocess.run(argv, cwd=REPOSITORY, env=environment, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize("degree", [1, 2])
def test_torchrun_ranks_train_the_plain_line(tmp_path: Path, data_template: Path, degree: int) -> None:
    if torch.cuda.device_count() < degree:
        pytest.skip(f"degree {degree} needs {degree} GPUs")
    lines = {}
    for name, changes in (("plain", {}), ("again", {}), ("group", {"parallel.degree": degree})):
        lines[name] = make_line(tmp_path / name, copy_data_line(data_template, tmp_path / name),
                                device="cuda", **changes)  # fmt: skip
    train(lines["plain"], None)
    train(lines["again"], None)
    train(lines["group"], degree)
    plain, again, group = (line_readings(lines[name]) for name in ("plain", "again", "group"))
    noise = line_spread(plain, again)
    measured = line_spread(plain, group)
    print(f"degree {degree}: plain vs plain {noise}, plain vs torchrun {measured}")
    assert measured[0] <= 2 * noise[0] and measured[1] <= 2 * noise[1]
    assert "CUDA graph capture failed" not in (lines["group"] / "run.log").read_text()
