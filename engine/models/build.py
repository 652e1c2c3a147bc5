"""Construct the model a preset names (imports every family's model, hence torch), and check before
anything is allocated that the configuration is valid and its training fits the device."""

from __future__ import annotations

from typing import Any

import psutil
import torch

from engine.errors import ConfigError
from engine.models.base import LanguageModel
from engine.models.memory_budget import MemoryEstimate, estimate_memory, line_shapes, memory_problem
from engine.models.ns.model import NSLM
from engine.models.presets import family_of, preset_config
from engine.models.pssa.model import PSSALM
from engine.models.transformer.model import TransformerLM
from engine.models.validation import validate_model_config

_BUILDERS = {"ns": NSLM, "pssa": PSSALM, "transformer": TransformerLM}
"""Each family's model class, by the prefix of its preset names."""


def checked_config(name: str, overrides: dict[str, Any] | None = None) -> Any:
    """A preset's config with overrides applied, validated (ConfigError, one line, on a bad one)."""
    config = preset_config(name, overrides)
    validate_model_config(config)
    return config


def build_model(name: str, overrides: dict[str, Any] | None = None) -> LanguageModel:
    """Construct a preset's model (parameters initialised from the current torch RNG)."""
    config = checked_config(name, overrides)
    return _BUILDERS[family_of(name)](config)


def count_parameters(name: str, overrides: dict[str, Any] | None = None) -> int:
    """The model's trainable parameters, counted on the meta device (nothing allocated)."""
    with torch.device("meta"):
        model = build_model(name, overrides)
    return sum(parameter.numel() for parameter in model.parameters())


def line_memory_estimate(run_config: Any, device_type: str, parameters: int | None = None) -> MemoryEstimate:
    """The memory a line's training needs on a device of `device_type` (engine.models.memory_budget)."""
    model = run_config.model
    config = checked_config(model.preset, model.overrides)
    if parameters is None:
        parameters = count_parameters(model.preset, model.overrides)
    return estimate_memory(
        family_of(model.preset), config, parameters, line_shapes(run_config),
        ema=run_config.ema is not None, device_type=device_type, shards=state_shards(run_config.parallel),
    )  # fmt: skip


def state_shards(parallel: Any) -> int:
    """Ranks a line's state is sharded over: its degree under `shard: fsdp`, else 1 (whole on each)."""
    return parallel.degree if parallel.shard == "fsdp" else 1


def cpu_memory(degree: int = 1) -> tuple[int, str]:
    """(bytes, name) of the CPU's available memory that one process of a line may use: all of it,
    or at `parallel.degree` N an N-th (its N ranks run on this host, and each holds what the
    estimate counts: the whole state under `shard: none`, its chunk and its own activations under
    `fsdp`)."""
    available = int(psutil.virtual_memory().available)
    if degree <= 1:
        return available, "the CPU (available memory)"
    return available // degree, f"a rank's 1/{degree} of the CPU's available memory (the line's {degree} ranks share it)"


def device_memory(device: torch.device, degree: int = 1) -> tuple[int, str]:
    """(bytes, name) of what the line may use: a GPU's total memory (other processes come and go:
    engine.gpu.sharing handles them; each rank has its own GPU), a rank's share of the CPU's
    available memory (`cpu_memory`)."""
    if device.type == "cuda":
        _free, total = torch.cuda.mem_get_info(device)
        return int(total), f"{device} ({torch.cuda.get_device_name(device)})"
    return cpu_memory(degree)


def refuse_unfit_memory(run_config: Any, device: torch.device, where: str) -> MemoryEstimate:
    """Raise ConfigError (one line) when the line's training cannot fit `device`; the estimate otherwise."""
    estimate = line_memory_estimate(run_config, device.type)
    available, name = device_memory(device, run_config.parallel.degree)
    problem = memory_problem(estimate, available, where, name)
    if problem is not None:
        raise ConfigError(problem)
    return estimate
