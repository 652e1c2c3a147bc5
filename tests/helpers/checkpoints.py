"""Checkpoints with altered weights, written as a trainer would have written them."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.checkpoints.format import blake2b_of
from engine.checkpoints.tensors import load_checkpoint


def rewritten_checkpoint(source: Path, into: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """A copy of checkpoint `source` in `into` whose weights `change` altered, its hashes intact
    (so the load's checks see the weights themselves, not a corrupted file)."""
    checkpoint = into / source.name
    shutil.copytree(source, checkpoint)
    weights = load_checkpoint(checkpoint).weights
    change(weights)
    save_file(weights, checkpoint / "model.safetensors")
    meta = json.loads((checkpoint / "meta.json").read_text())
    meta["files"]["model.safetensors"] = {"blake2b": blake2b_of(checkpoint / "model.safetensors"),
                                          "bytes": (checkpoint / "model.safetensors").stat().st_size}  # fmt: skip
    (checkpoint / "meta.json").write_text(json.dumps(meta))
    return checkpoint


def overflowing(weights: dict[str, torch.Tensor]) -> None:
    """A transformer's embedding and head scaled to 1e38, finite: hidden states of 1e38 meet a head
    of 1e38, past fp32's 3.4e38, so the logits hold inf or NaN (a diverged model's)."""
    for name in ("embed.weight", "head.weight"):
        weights[name] = weights[name] * 1e38 / weights[name].abs().max()
    assert all(bool(torch.isfinite(tensor).all()) for tensor in weights.values())
