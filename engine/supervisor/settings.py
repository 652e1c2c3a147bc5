"""The supervisor's settings: its timings and limits, and what its command was told.

Given by `nsconsole run` (`engine.supervisor.supervisor.run_line`), the console's resume, a branch's
start (`engine.supervisor.start`), and tests and benchmarks (a scripted trainer, short timings).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.protocol.facts import Engine


@dataclass
class SupervisorSettings:
    """The supervisor's timings and limits (run.json's guards give the watchdog interval)."""

    poll_seconds: float = 1.0
    """How often it looks at the trainer, its heartbeat, rows.jsonl and stop requests."""
    max_failures: int = 5
    """Crashes in a row without a newer checkpoint after which the line stops (`failed`)."""
    relaunch_delay_seconds: float = 5.0
    """Pause before relaunching the trainer after a crash (or restarting the data preparer after a
    failure); doubles with each one in a row (up to 5 min)."""
    kill_wait_seconds: float = 120.0
    """How long a trainer killed with SIGKILL may take to exit before it is reported `stuck`."""
    stop_wait_seconds: float = 1800.0
    """How long a trainer asked to stop (SIGTERM: checkpoint first) may take before SIGKILL."""
    watchdog_seconds: float | None = None
    """Overrides run.json's guards.watchdog_minutes (None: use it)."""
    engine: str = Engine.AUTO
    """The trainer's step engine (an `Engine`)."""
    stop_at: int | None = None
    """Passed to the trainer: stop cleanly at this update."""
    echo: bool = False
    """Print run.log as it grows (the foreground supervisor in a terminal)."""
    run_preparer: bool = True
    """Keep the data line's preparer running beside the trainer (`engine/supervisor/preparer.py`)."""
    preparer_command: list[str] | None = None
    """The preparer program before its `--work DATA` (None: `nsconsole data run-preparer`)."""
    preparer_recheck_seconds: float = 15.0
    """How often the files of a preparer that stopped for good are looked at: once the operator's
    fix changed them (and they held still for one look), the preparer is started again."""
    trainer_command: list[str] | None = None
    """The program launched as the trainer, before its arguments (None: this Python running
    `engine.training.main`); tests give a scripted stand-in."""
