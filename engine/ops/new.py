"""`nsconsole new`: create a training line with a validated run.json.

It validates everything before it writes anything, and every file it writes is replaced
atomically, so a refusal or a crash leaves nothing behind. It writes no accepted_run.json: the
configuration, its learning-rate schedule included, is locked by the line's first start that
passes its checks (the trainer accepts it then), so run.json may be edited freely until then.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.config.run import (
    DEFAULT_SEQ_LEN,
    DEFAULT_TOKENS_PER_UPDATE,
    DataConfig,
    EMAConfig,
    LengthConfig,
    LRConfig,
    ModelConfig,
    OptimizerConfig,
    RampPiece,
    RunConfig,
    StageConfig,
)
from engine.errors import LineError
from engine.gpu.devices import gpu_snapshot
from engine.gpu.placement import device_finding
from engine.layout import LineLayout
from engine.models import presets
from engine.ops.lines import inspect_data_line, model_vocab_size


@dataclass
class NewLineOptions:
    """The choices `nsconsole new` takes; everything else is run.json's default."""

    preset: str
    """The model preset."""
    data: Path
    """The data line directory (stored absolute in run.json)."""
    peak_lr: float | None = None
    """The peak learning rate (None: the default)."""
    tokens_per_update: int | list[RampPiece] | None = None
    """Tokens per update or a ramp (None: about 262,144, a whole number of rows)."""
    weight_decay_batch: int | None = None
    """Scale weight decay with the batch, 1x at this many tokens per update."""
    ema_horizon_tokens: float | None = None
    """Keep a parameter average with this horizon, starting at as many tokens trained."""
    seq_len: int | None = None
    """The trunk's sequence length (None: the default, 4096)."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """Preset overrides."""
    device: str = "auto"
    """run.json's `device`; refused unless it names a device of this host (`engine/gpu/placement.py`)."""


def _check_preset_name(preset: str) -> None:

    known = presets.preset_names()
    if preset not in known:
        raise LineError(f"--model: {preset!r} is not a preset (known: {', '.join(known)})")


def _preset_has_field(config: RunConfig, name: str) -> bool:

    return hasattr(presets.preset_config(config.model.preset, config.model.overrides), name)


def _refuse_taken(data: Path, line: Path) -> None:
    """A data line another line trains on (it started first) is not the new line's to train on, and
    one another line consumed cycles of would keep a new line waiting forever."""
    from datalines.consumption import consumed_cycles, consumed_refusal, other_training_line, trained_refusal

    owner = other_training_line(data, line)
    if owner is not None:
        raise LineError(trained_refusal(data, owner, "a new line"))
    consumed = consumed_cycles(data)
    if consumed:
        raise LineError(consumed_refusal(data, consumed, "a new line"))


def default_tokens_per_update(seq_len: int) -> int:
    """About DEFAULT_TOKENS_PER_UPDATE tokens, as a whole number of rows of `seq_len`."""
    if seq_len < 1:  # no rows to count; validate() then refuses the seq_len by name
        return DEFAULT_TOKENS_PER_UPDATE
    return max(1, round(DEFAULT_TOKENS_PER_UPDATE / seq_len)) * seq_len


def new_line(root: Path | str, options: NewLineOptions) -> RunConfig:
    """Create a training line: its run.json, validated; nothing written on refusal."""
    layout = LineLayout(root)
    if layout.run_json.exists():
        raise LineError(f"{layout.run_json}: already exists (a line is created once; edit its run.json)")
    if layout.root.exists() and not layout.root.is_dir():
        raise LineError(f"{layout.root}: exists and is not a directory")
    _check_preset_name(options.preset)
    data = inspect_data_line(options.data.absolute())
    _refuse_taken(data.path, layout.root)
    # `is None`, not `or`: a --seq-len 0 is refused by validate(), not silently made 4096.
    seq_len = DEFAULT_SEQ_LEN if options.seq_len is None else options.seq_len
    config = RunConfig(
        model=ModelConfig(options.preset, dict(options.overrides)),
        data=DataConfig(str(data.path)),
        lengths=[LengthConfig(seq_len)],
        plan=[StageConfig("trunk", seq_len, None)],
        tokens_per_update=(
            options.tokens_per_update
            if options.tokens_per_update is not None
            else default_tokens_per_update(seq_len)
        ),
        optimizer=OptimizerConfig(weight_decay_batch=options.weight_decay_batch),
        device=options.device,
        ema=(
            EMAConfig(options.ema_horizon_tokens, options.ema_horizon_tokens)
            if options.ema_horizon_tokens is not None
            else None
        ),
    )
    if options.peak_lr is not None:
        config.lr = LRConfig(peak=options.peak_lr)
    source = str(layout.run_json)
    config.validate(source=source)
    usable, finding = device_finding(config.device, gpu_snapshot(), source, degree=config.parallel.degree)
    if not usable:
        raise LineError(finding)
    # The model's vocabulary follows the data line's tokenizer unless the user overrode it.
    follows_data = "vocab_size" not in options.overrides
    if follows_data and model_vocab_size(config) != data.vocab_size:
        config.model.overrides["vocab_size"] = data.vocab_size
        config.validate(source=source)
    # Models that mark document boundaries (NS clocks, probes) read the data line's EOS id.
    if "eos_id" not in options.overrides and _preset_has_field(config, "eos_id"):
        config.model.overrides["eos_id"] = data.eos_id
        config.validate(source=source)
    layout.root.mkdir(parents=True, exist_ok=True)
    layout.checkpoints.mkdir(exist_ok=True)
    config.save(layout.run_json)
    return config
