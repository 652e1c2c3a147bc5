"""How a `WandbMirror` retries a failing W&B and paces its work: its options, with the defaults a
line uses."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RetryPolicy:
    """How long and how often a failing W&B is tried again."""

    first_delay_s: float = 1.0
    """The wait after the first failure; doubled after each further failure."""
    max_delay_s: float = 300.0
    """The longest wait between two tries (W&B is still tried this often after giving up rows)."""
    give_up_after_s: float = 7200.0
    """After this long without success, the rows held in memory are given up (recorded as a gap)."""


@dataclass(frozen=True)
class MirrorOptions:
    """Tuning of a `WandbMirror` (the defaults are what a line uses)."""

    retry: RetryPolicy = field(default_factory=RetryPolicy)
    """Retries while W&B fails."""
    acknowledge_every_s: float = 30.0
    """How often the server's acknowledged step is read and saved to wandb_run.json."""
    max_queued_rows: int = 20_000
    """Rows held in memory while W&B lags; past it they are dropped and re-read from rows.jsonl later."""
    finish_timeout_s: float = 60.0
    """How long the real client may take to finish a run (upload what is left)."""
