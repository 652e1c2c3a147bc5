"""Host settings: `$NSCONSOLE_HOST` or `~/.nsconsole/host.json`, read by every command first.

```json
{"env": {"TRITON_PTXAS_PATH": "/usr/local/cuda/bin/ptxas"},
 "work_root": "/data/lines",
 "tokenizer": "/data/tokenizer/tokenizer.json",
 "calibration_from": "/data/lines/trunk",
 "notify": "/usr/local/bin/notify-training"}
```

Every key is optional. The default file missing means defaults; a file named by
`$NSCONSOLE_HOST` that is missing, or any malformed file, is a ConfigError naming it.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.config.json_fields import INTERNAL, parse_json_text, parse_value
from engine.errors import ConfigError

HOST_ENV_VARIABLE = "NSCONSOLE_HOST"
DEFAULT_HOST_FILE = Path("~/.nsconsole/host.json")
DEFAULT_WORK_ROOT = Path("~/.nsconsole/lines")
"""Where lines live without a `work_root` (the demo's, `nsconsole --run`)."""


@dataclass
class HostSettings:
    """What differs between the machines a line may run on."""

    env: dict[str, str] = field(default_factory=dict)
    """Environment variables set before anything else runs (e.g. TRITON_PTXAS_PATH)."""
    work_root: str | None = None
    """Where relative LINE and data paths are looked up when they do not exist relative to the cwd
    (unset: an existing line or data line under ~/.nsconsole/lines, the demo's root, is found)."""
    tokenizer: str | None = None
    """The tokenizer JSON `nsconsole data init` uses when neither --tokenizer nor the recipe names one."""
    calibration_from: str | None = None
    """A data line (its directory or its dataline.json) whose calibration `nsconsole data init`
    reuses, unless --calibration-from names another, for each source with the same files,
    tokenizer, strata and control markers."""
    notify: str | None = None
    """A command run with an event in JSON on stdin when a line finishes, fails or gets stuck."""
    source: str | None = field(default=None, metadata=INTERNAL)
    """The file these settings were read from (None: defaults, no file); not a key of host.json."""

    @classmethod
    def load(cls, path: Path | str | None = None) -> HostSettings:
        """Read the host settings from `path`, else `$NSCONSOLE_HOST`, else the default file."""
        explicit = path is not None or bool(os.environ.get(HOST_ENV_VARIABLE))
        chosen = Path(path if path is not None else os.environ.get(HOST_ENV_VARIABLE) or DEFAULT_HOST_FILE)
        chosen = chosen.expanduser()
        source = str(chosen)
        try:
            text = chosen.read_text(encoding="utf-8")
        except FileNotFoundError:
            if explicit:
                raise ConfigError(f"{source}: no such file (named by ${HOST_ENV_VARIABLE})") from None
            return cls()
        except (OSError, UnicodeDecodeError) as error:
            raise ConfigError(f"{source}: cannot be read ({error})") from None
        document: Any = parse_json_text(text, source)
        settings: HostSettings = parse_value(document, HostSettings, "", source)
        settings.validate(source)
        settings.source = source
        return settings

    def validate(self, source: str) -> None:
        """ConfigError `<source>: <key> ...` at the first value no command could use: found here,
        not as a traceback from every command (`env`) or when a line fails and nobody is told
        (`notify`)."""
        for name, value in self.env.items():
            # What os.environ refuses (OSError, ValueError) when `apply_environment` sets it.
            if not name or "=" in name or "\0" in name:
                raise ConfigError(f"{source}: env key {name!r} is not a variable name (empty, or holds = or NUL)")
            if "\0" in value:
                raise ConfigError(f"{source}: env.{name} holds a NUL character")
        for key in ("work_root", "tokenizer", "calibration_from"):
            if getattr(self, key) == "":
                raise ConfigError(f"{source}: {key} must not be empty (leave it out or null for none)")
        if self.notify is not None:
            try:
                words = shlex.split(self.notify)
            except ValueError as error:  # an unclosed quote
                raise ConfigError(f"{source}: notify {self.notify!r} is not a command line ({error})") from None
            if not words:
                raise ConfigError(f"{source}: notify must name a command, got {self.notify!r}")

    def apply_environment(self) -> None:
        """Set the `env` variables in this process (children inherit them)."""
        os.environ.update(self.env)

    def resolve_line(self, path: Path | str) -> Path:
        """A LINE or data path as a command meant it.

        Relative paths that do not exist relative to the cwd resolve against `work_root` when it
        is set (so `nsconsole new trunk ...` creates `<work_root>/trunk`); without one, against
        ~/.nsconsole/lines when they exist there (`nsconsole status demo` finds the demo from any
        directory; `new` still creates relative to the cwd). Everything else is taken relative to
        the cwd. The result is absolute.
        """
        candidate = Path(path).expanduser()
        if candidate.is_absolute() or candidate.exists():
            return candidate.absolute()
        if self.work_root:
            return (Path(self.work_root).expanduser() / candidate).absolute()
        default = DEFAULT_WORK_ROOT.expanduser() / candidate
        return default.absolute() if default.exists() else candidate.absolute()


def load_and_apply() -> HostSettings:
    """What the CLI does first: read the host settings and apply their environment."""
    settings = HostSettings.load()
    settings.apply_environment()
    return settings
