"""On the GPU: samples at validation decode eagerly beside the captured graphs (from the arena, as
validation runs) and leave training as it was. Skipped where there is no CUDA (run on the H200)."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
import torch
from helpers.lines import copy_data_line, make_data_line, make_line

from engine.checkpoints.format import read_latest
from engine.checkpoints.tensors import load_checkpoint
from engine.config.run import SAMPLES_KEY
from engine.gpu.sharing import GpuWatch
from engine.training.trainer import Trainer

# Other pytest workers on the same GPU are not other jobs: these lines train as if alone.
ALONE = partial(GpuWatch.for_line, enabled=False)

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("preset", ["transformer-tiny", "pssa-tiny"])
def test_samples_in_graph_mode_leave_training_as_it_was(tmp_path: Path, preset: str) -> None:
    template = make_data_line(tmp_path / "template", prepare=1)
    changes = {
        "device": "cuda",
        "lengths": [{"seq_len": 32, "micro_batch_rows": 2}],
        "model.preset": preset,
        "validation.every_updates": 2,
        "wandb.mode": "disabled",
    }
    lines = {}
    for name, prompts in (("sampled", 2), ("unsampled", 0)):
        root = tmp_path / name
        lines[name] = make_line(root, copy_data_line(template, root), **changes, **{"validation.samples.prompts": prompts})
        assert Trainer(lines[name], stop_at=6, echo=None, gpu_watch=ALONE).run() == 0
    rows = {name: [json.loads(text) for text in (line / "rows.jsonl").read_text().splitlines()]
            for name, line in lines.items()}  # fmt: skip
    for row in rows["sampled"]:
        samples = row.get(SAMPLES_KEY)
        assert (samples is not None) == (row["update"] % 2 == 0)
        assert samples is None or (len(samples) == 2 and all(sample["text"] for sample in samples))
    for mine, theirs in zip(rows["sampled"], rows["unsampled"], strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-4)
    mine, theirs = (load_checkpoint(line / "checkpoints" / read_latest(line / "checkpoints")) for line in lines.values())
    assert mine.update == theirs.update == 6
    for key, tensor in theirs.weights.items():
        torch.testing.assert_close(mine.weights[key], tensor, rtol=1e-4, atol=1e-6, msg=key)
