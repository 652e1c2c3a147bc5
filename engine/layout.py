"""The files of a training line's directory: one home for their names.

```
<line>/run.json             the configuration (engine.config.run)
<line>/accepted_run.json    the configuration of the last accepted start (lifelong keys compare to it)
<line>/checkpoints/         u<update:08d>/ directories and `latest` (names the newest good one)
<line>/run.log              the trainer's and the supervisor's output
<line>/rows.jsonl           every logged row (append-only)
<line>/supervisor.out       the background supervisor's own output (start-up errors)
<line>/supervisor.sock      the supervisor's Unix socket
<line>/supervisor.json      supervisor state: pids, launches, failures, last event
<line>/heartbeat            time, update, stage and pid of the trainer
<line>/wandb_run.json       the line's W&B run
<line>/wandb/               the W&B client's local files (offline runs wait here for `wandb sync`)
<line>/STOP                 a stop request
<line>/trainer.lock         flocked by the one trainer of the line for its life
<line>/branches.json        the branches forked from this line
<line>/startup.jsonl        each launch's start-up breakdown (engine.training.startup)
<line>/cache/               the trainer's compile caches: inductor/ and triton/ (engine.training.startup)
```
"""

from __future__ import annotations

from pathlib import Path

CHECKPOINT_PREFIX = "u"


class LineLayout:
    """The paths of one training line's files (nothing is read or created here)."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"LineLayout({str(self.root)!r})"

    @property
    def run_json(self) -> Path:
        return self.root / "run.json"

    @property
    def accepted_run_json(self) -> Path:
        return self.root / "accepted_run.json"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def latest(self) -> Path:
        """A small file naming the newest good checkpoint directory (replaced atomically)."""
        return self.checkpoints / "latest"

    def checkpoint(self, update: int) -> Path:
        """The directory of the checkpoint after `update` updates."""
        return self.checkpoints / f"{CHECKPOINT_PREFIX}{update:08d}"

    @property
    def run_log(self) -> Path:
        return self.root / "run.log"

    @property
    def rows_jsonl(self) -> Path:
        return self.root / "rows.jsonl"

    @property
    def rows_index(self) -> Path:
        """The supervisor's saved index of rows.jsonl (`engine.supervisor.rows_tail.RowsTail.save`): a cache."""
        return self.root / "rows.index.json"

    @property
    def supervisor_out(self) -> Path:
        return self.root / "supervisor.out"

    @property
    def supervisor_sock(self) -> Path:
        return self.root / "supervisor.sock"

    @property
    def supervisor_json(self) -> Path:
        return self.root / "supervisor.json"

    @property
    def heartbeat(self) -> Path:
        return self.root / "heartbeat"

    @property
    def wandb_run_json(self) -> Path:
        return self.root / "wandb_run.json"

    @property
    def wandb_dir(self) -> Path:
        """The W&B client's local run directories (it names this directory itself: `dir` + `wandb/`)."""
        return self.root / "wandb"

    @property
    def stop(self) -> Path:
        return self.root / "STOP"

    @property
    def branches_json(self) -> Path:
        return self.root / "branches.json"

    @property
    def trainer_lock(self) -> Path:
        """Held (flock) by the line's trainer for its life: two trainers never write one line."""
        return self.root / "trainer.lock"

    @property
    def startup_jsonl(self) -> Path:
        """One record per launch: where its seconds went before its first update."""
        return self.root / "startup.jsonl"

    @property
    def compile_cache(self) -> Path:
        """The trainer's compile caches, kept across its relaunches (never part of a checkpoint)."""
        return self.root / "cache"


def checkpoint_update(directory_name: str) -> int | None:
    """The update of a finished checkpoint directory's name (`u00001200` -> 1200), else None."""
    digits = directory_name[len(CHECKPOINT_PREFIX) :]
    if directory_name.startswith(CHECKPOINT_PREFIX) and digits.isdigit() and len(digits) >= 8:
        return int(digits)
    return None
