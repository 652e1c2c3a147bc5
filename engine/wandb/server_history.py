"""A run's history as the W&B server holds it, read back through wandb's public API.

Online, the server is the judge of what a run holds: the mirror asks it for the run's last step
(what the server acknowledged: the client's own status reports nothing useful online) and, after
a resume, for its rows at the steps the trainer trained again, to compare them with rows.jsonl.
wandb 0.31 asks the server `Viewer` once, then `RunHistoryKeys` (the last step) and
`RunParquetHistory` + `HistoryPage` (rows between two steps; `Run.scan_history`).
"""

from __future__ import annotations

from typing import Any

CLIENT_KEYS_PREFIX = "_"
"""Keys the client adds to each row (`_step`, `_runtime`, `_timestamp`): not the line's values."""


class ServerHistory:
    """One run's history on the server. Every call may raise when the server fails."""

    def __init__(
        self, base_url: str, api_key: str | None, entity: str, project: str, run_id: str, timeout_s: int
    ) -> None:
        self.path = f"{entity}/{project}/{run_id}"
        self._arguments = {
            "api_key": api_key,
            "overrides": {"base_url": base_url, "entity": entity, "project": project},
            "timeout": timeout_s,
        }
        self._run: Any = None

    def _public_run(self) -> Any:
        if self._run is None:
            import wandb

            self._run = wandb.Api(**self._arguments).run(self.path)
        return self._run

    def last_step(self) -> int | None:
        """The highest step the server holds (None: no row yet)."""
        step = int(self._public_run().lastHistoryStep)
        return step if step >= 0 else None

    def rows(self, after: int, through: int) -> dict[int, dict[str, Any]]:
        """The server's rows with `after < step <= through`, by step, without the client's own keys."""
        scan = self._public_run().scan_history(min_step=after + 1, max_step=through + 1)
        rows: dict[int, dict[str, Any]] = {}
        for row in scan:
            step = int(row["_step"])
            rows[step] = {key: value for key, value in row.items() if not key.startswith(CLIENT_KEYS_PREFIX)}
        return rows
