"""Operations on a training line's files: create one, accept its configuration, request a stop.

Each operation validates everything before it writes anything, and every file it writes is
replaced atomically, so a refusal or a crash leaves the line as it was.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from engine.atomic import write_text_atomic
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
    check_changes,
)
from engine.errors import ConfigError, LineError
from engine.layout import LineLayout

DATA_LINE_MARKER = "dataline.json"


def open_line(root: Path | str) -> LineLayout:
    """The layout of an existing training line (a directory holding run.json)."""
    layout = LineLayout(root)
    if not layout.root.is_dir():
        raise LineError(f"{layout.root}: no such training line directory")
    if not layout.run_json.is_file():
        raise LineError(f"{layout.root}: not a training line (no run.json)")
    return layout


def resolve_data_path(layout: LineLayout, data_line: str) -> Path:
    """A data line path from run.json: absolute, or relative to the training line's directory."""
    path = Path(data_line).expanduser()
    return path if path.is_absolute() else layout.root / path


# -- data lines -----------------------------------------------------------------------------------


@dataclass
class DataLineFacts:
    """What a training line needs to know of its data line."""

    path: Path
    """The data line directory."""
    vocab_size: int | None
    """The tokenizer's vocabulary size (None: `datalines.open_data_line` is not available yet)."""
    eos_id: int | None
    """The end-of-document token id (None: as above)."""


def inspect_data_line(path: Path) -> DataLineFacts:
    """Open a data line and read its vocabulary; DataLineError / LineError when it is missing or broken."""
    if not path.is_dir():
        raise LineError(f"{path}: no such data line directory")
    if not (path / DATA_LINE_MARKER).is_file():
        raise LineError(f"{path}: not a data line (no {DATA_LINE_MARKER})")
    # The data lines package grows its reader alongside this one; until `open_data_line` exists
    # only the directory and its dataline.json can be checked.
    open_data_line = getattr(importlib.import_module("datalines"), "open_data_line", None)
    if open_data_line is None:
        return DataLineFacts(path, None, None)
    data_line = open_data_line(path)
    return DataLineFacts(path, int(data_line.vocab_size), int(data_line.eos_id))


def model_vocab_size(config: RunConfig) -> int:
    """The vocabulary of the model a configuration builds (its preset with overrides)."""
    from engine.models.presets import preset_config

    return int(preset_config(config.model.preset, config.model.overrides).vocab_size)


# -- new ------------------------------------------------------------------------------------------


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


def _check_preset_name(preset: str) -> None:
    from engine.models.presets import preset_names

    known = preset_names()
    if preset not in known:
        raise LineError(f"--model: {preset!r} is not a preset (known: {', '.join(known)})")


def _preset_has_field(config: RunConfig, name: str) -> bool:
    from engine.models.presets import preset_config

    return hasattr(preset_config(config.model.preset, config.model.overrides), name)


def default_tokens_per_update(seq_len: int) -> int:
    """About DEFAULT_TOKENS_PER_UPDATE tokens, as a whole number of rows of `seq_len`."""
    return max(1, round(DEFAULT_TOKENS_PER_UPDATE / seq_len)) * seq_len


def new_line(root: Path | str, options: NewLineOptions) -> RunConfig:
    """Create a training line: run.json and accepted_run.json, validated; nothing written on refusal."""
    layout = LineLayout(root)
    if layout.run_json.exists():
        raise LineError(f"{layout.run_json}: already exists (a line is created once; edit its run.json)")
    if layout.root.exists() and not layout.root.is_dir():
        raise LineError(f"{layout.root}: exists and is not a directory")
    _check_preset_name(options.preset)
    data = inspect_data_line(options.data.absolute())
    seq_len = options.seq_len or DEFAULT_SEQ_LEN
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
    # The model's vocabulary follows the data line's tokenizer unless the user overrode it.
    follows_data = data.vocab_size is not None and "vocab_size" not in options.overrides
    if follows_data and model_vocab_size(config) != data.vocab_size:
        config.model.overrides["vocab_size"] = data.vocab_size
        config.validate(source=source)
    # Models that mark document boundaries (NS clocks, probes) read the data line's EOS id.
    if data.eos_id is not None and "eos_id" not in options.overrides and _preset_has_field(config, "eos_id"):
        config.model.overrides["eos_id"] = data.eos_id
        config.validate(source=source)
    layout.root.mkdir(parents=True, exist_ok=True)
    layout.checkpoints.mkdir(exist_ok=True)
    # accepted_run.json first: a directory holding run.json is a complete line.
    config.save(layout.accepted_run_json)
    config.save(layout.run_json)
    return config


# -- accepting a configuration --------------------------------------------------------------------


def load_accepted(layout: LineLayout) -> RunConfig | None:
    """The accepted configuration (None when the line has never been accepted)."""
    if not layout.accepted_run_json.exists():
        return None
    return RunConfig.load(layout.accepted_run_json)


def unaccepted_changes(layout: LineLayout, config: RunConfig) -> list[str]:
    """The lifelong-key changes of `config` that accepted_run.json does not allow (one message each)."""
    accepted = load_accepted(layout)
    if accepted is None:
        return []
    return [f"{layout.run_json.name}: {message}" for message in check_changes(accepted, config)]


def accept(root: Path | str, config: RunConfig | None = None) -> RunConfig:
    """Record run.json (or `config`, read from it) as the accepted configuration of a checked start.

    Refuses (ConfigError, nothing written) when a lifelong key changed without allow_changes or a
    schedule was rewritten rather than grown. A listing in allow_changes permits one change: once
    accepted, the list is cleared in accepted_run.json and in run.json (unless run.json was
    edited again meanwhile), so a later accidental edit of the same key is caught again.
    """
    layout = open_line(root)
    current = config if config is not None else RunConfig.load(layout.run_json)
    problems = unaccepted_changes(layout, current)
    if problems:
        raise ConfigError("; ".join(problems))
    accepted = dataclasses.replace(current, allow_changes=[])
    accepted.save(layout.accepted_run_json)
    if current.allow_changes and _load_or_none(layout.run_json) == current:
        accepted.save(layout.run_json)
    return accepted


def _load_or_none(path: Path) -> RunConfig | None:
    try:
        return RunConfig.load(path)
    except ConfigError:
        return None


# -- stop -----------------------------------------------------------------------------------------


@dataclass
class StopRequest:
    """The STOP file: stop with a checkpoint at the next update, or at the end of a data cycle."""

    requested: str
    """When the stop was requested (ISO 8601, UTC)."""
    at_cycle_end: int | None
    """Stop exactly at the end of this data cycle; None: at the next update."""

    def when(self) -> str:
        """Where the line will stop, in words."""
        if self.at_cycle_end is None:
            return "at the next update"
        return f"at the end of cycle {self.at_cycle_end}"


def request_stop(root: Path | str, at_cycle_end: int | None = None) -> StopRequest:
    """Write the line's STOP file atomically (replacing an earlier request)."""
    layout = open_line(root)
    if at_cycle_end is not None and at_cycle_end < 0:
        raise LineError(f"--at-cycle-end must be a cycle index (0 or more), got {at_cycle_end}")
    request = StopRequest(
        requested=datetime.fromtimestamp(time.time(), tz=timezone.utc).isoformat(timespec="seconds"),
        at_cycle_end=at_cycle_end,
    )
    document = {"requested": request.requested, "at_cycle_end": request.at_cycle_end}
    write_text_atomic(layout.stop, json.dumps(document, sort_keys=True) + "\n")
    return request


def read_stop(layout: LineLayout) -> StopRequest | None:
    """The pending stop request (None when there is none); a malformed STOP is a LineError."""
    try:
        document = json.loads(layout.stop.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        raise LineError(f"{layout.stop}: malformed stop request ({error})") from None
    at_cycle_end = document.get("at_cycle_end") if isinstance(document, dict) else None
    if not isinstance(document, dict) or not (at_cycle_end is None or isinstance(at_cycle_end, int)):
        raise LineError(f"{layout.stop}: malformed stop request (expected requested and at_cycle_end)")
    return StopRequest(str(document.get("requested", "")), at_cycle_end)
