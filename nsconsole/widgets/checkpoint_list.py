"""The checkpoints tab: a line's checkpoints, kept ones (with why) and rolling ones, newest first.

A checkpoint directory gets its final name by an atomic rename after every file in it is
written, and `checkpoints/latest` is replaced atomically: listing finished directories never
reads a checkpoint mid-write.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from rich.text import Text
from textual.widgets import DataTable

from engine.checkpoints.format import kept_text
from engine.layout import LineLayout, checkpoint_update


@dataclass(frozen=True)
class CheckpointInfo:
    """One finished checkpoint of a line."""

    update: int
    """The update it was written after."""
    name: str
    """Its directory name (`u00001200`)."""
    kept: str | None
    """Why it is kept for good (`cycle-end 3`, `stage-end trunk`, `stage-end trunk, cycle-end 3`...);
    None: a rolling one."""
    latest: bool
    """`checkpoints/latest` names it (a resume starts here)."""
    tokens: int | None
    """Tokens trained at that update (from its state.json)."""


def read_checkpoints(line: str | Path) -> list[CheckpointInfo]:
    """A line's finished checkpoints, newest first."""
    layout = LineLayout(line)
    try:
        latest = layout.latest.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        latest = ""
    try:
        entries = list(layout.checkpoints.iterdir())
    except OSError:
        return []
    found = []
    for directory in entries:
        update = checkpoint_update(directory.name)
        if update is None or not directory.is_dir():
            continue
        try:
            state = json.loads((directory / "state.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            state = {}
        state = state if isinstance(state, dict) else {}
        kept = state.get("kept")
        position = state.get("position")
        tokens = position.get("tokens_trained") if isinstance(position, dict) else None
        found.append(CheckpointInfo(
            update=update,
            name=directory.name,
            kept=kept_text(kept),
            latest=directory.name == latest,
            tokens=tokens if isinstance(tokens, int) else None,
        ))
    return sorted(found, key=lambda info: info.update, reverse=True)


class CheckpointList(DataTable):
    """`show(checkpoints)` lists them (★ marks the one `latest` names)."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(cursor_type="row", **kwargs)  # type: ignore[arg-type]
        self._shown: list[CheckpointInfo] | None = None

    def on_mount(self) -> None:
        self.add_column("update", key="update")
        self.add_column("tokens", key="tokens")
        self.add_column("kind", key="kind")
        self.add_column("", key="latest")

    def show(self, checkpoints: list[CheckpointInfo]) -> None:
        if checkpoints == self._shown:
            return
        self._shown = checkpoints
        self.clear()
        for info in checkpoints:
            kind = f"kept: {info.kept}" if info.kept else "rolling"
            self.add_row(
                Text(str(info.update), justify="right"),
                Text("—" if info.tokens is None else f"{info.tokens:,}", justify="right"),
                kind,
                "★ latest" if info.latest else "",
                key=info.name,
            )
        self.border_subtitle = f"{len(checkpoints)} checkpoints" if checkpoints else "no checkpoint yet"
