"""The narrow interface between W&B continuity (engine.wandb.mirror) and a W&B client, and the real client.

Everything the continuity logic needs from W&B is here: start or continue a run (plainly, as a
fork of another run, or rewound to a step), log a row at a step, ask which steps are
acknowledged, read back the server's rows at some steps, finish, and mark an old run superseded.
Any exception from these calls means "W&B failed this time"; the logic above retries with
backoff, so no method here retries by itself. The logic tests drive the same logic through a
recording backend that simulates the server; the online tests run this client against a local
server (tests/helpers/wandb_server.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from engine.config.run import WandbConfig
from engine.layout import LineLayout
from engine.wandb.server_history import ServerHistory
from engine.wandb.state import RunPoint
from engine.wandb.txlog import TransactionLogReader, transaction_log_of

logger = logging.getLogger("nsconsole.wandb")

SUPERSEDED_TAG = "superseded"
LOCAL_LOG_POLL_S = 0.02
"""How often a finishing offline run's local log is read until it holds every step logged."""
SERVER_QUERY_TIMEOUT_S = 30
"""The HTTP timeout of one query to the server (its last step, its rows at some steps)."""


@dataclass(frozen=True)
class StartedRun:
    """What W&B answered to `init`."""

    run_id: str
    """The run's id (a rewind keeps the rewound run's id)."""
    next_step: int | None
    """The step the server expects next for this run; None when unknown (offline mode)."""
    local_dir: Path | None
    """The client's local directory of this run, removed at a later start once finished."""
    offline: bool
    """The run writes only local files (uploaded later by `wandb sync`)."""


class WandbBackend(Protocol):
    """A W&B client as the continuity logic sees it. Every call may raise when W&B fails."""

    def init(
        self,
        run_id: str | None,
        *,
        resume: bool = False,
        fork_from: RunPoint | None = None,
        resume_from: RunPoint | None = None,
        config: dict[str, Any] | None = None,
    ) -> StartedRun:
        """Start a run: create or continue `run_id` (`resume`), fork another run, or rewind one."""
        ...

    def log(self, row: dict[str, Any], step: int) -> None:
        """Log one row's values at `step` to the started run."""
        ...

    def acknowledged_step(self) -> int | None:
        """The highest step of the started run the server holds durably (None: not known yet)."""
        ...

    def server_rows(self, after: int, through: int) -> dict[int, dict[str, Any]] | None:
        """The started run's rows the server holds with `after < step <= through`, by step.

        None when there is no server copy to read (offline: the rows reach W&B only by `wandb sync`).
        """
        ...

    def finish(self) -> bool:
        """Finish the started run; True when everything was handed over in time."""
        ...

    def mark_superseded(self, run_id: str, by_run_id: str, at_update: int) -> StartedRun:
        """Tag an old run `superseded` and record which run replaced it (beside the started run)."""
        ...

    def supports_fork(self) -> bool:
        """Whether `init(fork_from=...)` may be tried (a refusal is still possible and handled)."""
        ...

    def supports_rewind(self) -> bool:
        """Whether `init(resume_from=...)` may be tried (a refusal is still possible and handled)."""
        ...


class RealWandbBackend:
    """The `wandb` 0.31 client, for one line.

    The client writes its local files under `<line>/wandb/`. Fork and rewind are W&B features in
    preview on its cloud and absent from some servers; they are tried when asked for, and a
    refusal surfaces as an exception from `init` that the logic answers with a backfilled run.
    """

    def __init__(self, settings: WandbConfig, line_dir: Path, finish_timeout_s: float = 60.0) -> None:
        self.settings = settings
        self.line_dir = Path(line_dir)
        self.layout = LineLayout(line_dir)
        self.finish_timeout_s = finish_timeout_s
        self._run: Any = None
        self._last_logged_step: int | None = None
        self._local_log: TransactionLogReader | None = None
        self._locally_written_step: int | None = None
        self._server: ServerHistory | None = None

    def _client_settings(self) -> Any:
        import wandb

        # console "off": the trainer's own output goes to run.log, not through W&B.
        return wandb.Settings(
            console="off",
            silent=True,
            use_dot_wandb=False,
            finish_timeout=self.finish_timeout_s,
            finish_timeout_raises=True,
        )

    def _start(self, **arguments: Any) -> Any:
        import wandb

        # The client writes its run directories under `dir`/wandb/ (use_dot_wandb=False: never
        # `dir`/.wandb/), which is the line's wandb_dir.
        self.layout.wandb_dir.mkdir(exist_ok=True)
        try:
            return wandb.init(
                project=self.settings.project,
                entity=self.settings.entity,
                mode=self.settings.mode,
                dir=str(self.line_dir),
                name=self.line_dir.name,
                settings=self._client_settings(),
                reinit="create_new",
                **arguments,
            )
        except Exception:
            # wandb-core keeps the id of a start that failed (the server unreachable) "in use" for
            # the life of its service, refusing every retry of the same run: the next try gets a
            # fresh service. The mirror runs one W&B run at a time, so no other run is cut short.
            wandb.teardown()
            raise

    def init(
        self,
        run_id: str | None,
        *,
        resume: bool = False,
        fork_from: RunPoint | None = None,
        resume_from: RunPoint | None = None,
        config: dict[str, Any] | None = None,
    ) -> StartedRun:
        arguments: dict[str, Any] = {"config": config or {}}
        if resume_from is not None:
            # A rewind continues the rewound run under its own id; wandb refuses `id` beside it.
            arguments["resume_from"] = f"{resume_from.run_id}?_step={resume_from.step}"
        else:
            arguments["id"] = run_id
            if fork_from is not None:
                arguments["fork_from"] = f"{fork_from.run_id}?_step={fork_from.step}"
            elif resume:
                arguments["resume"] = "allow"
        run = self._start(**arguments)
        self._run = run
        self._last_logged_step = None
        self._locally_written_step = None
        local_dir = Path(run.dir).parent
        self._local_log = None
        self._server = None
        if run.offline:
            log_path = transaction_log_of(local_dir)
            self._local_log = TransactionLogReader(log_path) if log_path else None
        else:
            settings = run.settings
            self._server = ServerHistory(
                settings.base_url, settings.api_key, run.entity, run.project, run.id, SERVER_QUERY_TIMEOUT_S
            )
        # Online, `starting_step` is the server's next step for this run (0 for a run the server
        # did not have). Offline it reads 0 for a resumed run, which says nothing: unknown.
        next_step = None if run.offline else int(run.starting_step)
        return StartedRun(run_id=run.id, next_step=next_step, local_dir=local_dir, offline=bool(run.offline))

    def log(self, row: dict[str, Any], step: int) -> None:
        if self._run is None:
            raise RuntimeError("no W&B run is started")
        # commit: the row is whole, so the client sends it now instead of holding it until a
        # higher step is logged (a crash would otherwise lose each session's last row).
        self._run.log(row, step=step, commit=True)
        self._last_logged_step = step

    def acknowledged_step(self) -> int | None:
        if self._run is None:
            return None
        if self._run.offline:
            return self._read_local_log(self._run)
        # Online the server's own count decides. (wandb 0.31's `run.status()` reports no sync
        # time against a server, so the client cannot say what arrived.) A failed query is no
        # outage of the run: the client keeps retrying its uploads; the step is asked again later.
        assert self._server is not None
        try:
            return self._server.last_step()
        except Exception as error:  # the server is unreachable or answers nonsense: not known now
            logger.debug("W&B: reading the run's last step failed: %s", error)
            return None

    def server_rows(self, after: int, through: int) -> dict[int, dict[str, Any]] | None:
        if self._run is None or self._server is None:
            return None
        return self._server.rows(after, through)

    def _read_local_log(self, run: Any) -> int | None:
        """Offline: the highest step present in the run's local transaction log."""
        if self._local_log is None:
            log_path = transaction_log_of(Path(run.dir).parent)
            if log_path is None:
                return None
            self._local_log = TransactionLogReader(log_path)
        for history in self._local_log.read_history():
            self._locally_written_step = max(history.step, self._locally_written_step or history.step)
        return self._locally_written_step

    def finish(self) -> bool:
        if self._run is None:
            return True
        run, self._run = self._run, None
        try:
            run.finish()
        except TimeoutError:
            return False
        return self._wait_for_local_log(run) if run.offline else True

    def _wait_for_local_log(self, run: Any) -> bool:
        """Offline: wait (bounded) until the run's local log holds every step logged.

        `finish()` only tells the client's service that the run is done; the service writes the
        log's last block and closes it afterwards. A clean finish must mean the log holds
        everything (the mirror then records it all as acknowledged, and a later start may remove
        the directory once synced), so the log is read until it does.
        """
        logged = self._last_logged_step
        deadline = time.monotonic() + self.finish_timeout_s
        while logged is not None:
            written = self._read_local_log(run)
            if written is not None and written >= logged:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(LOCAL_LOG_POLL_S)
        return True

    def mark_superseded(self, run_id: str, by_run_id: str, at_update: int) -> StartedRun:
        run = self._start(id=run_id, resume="allow")
        try:
            run.tags = tuple(tag for tag in run.tags if tag != SUPERSEDED_TAG) + (SUPERSEDED_TAG,)
            run.summary["superseded_by"] = by_run_id
            run.summary["superseded_at_update"] = at_update
        finally:
            run.finish()
        local_dir = Path(run.dir).parent
        return StartedRun(run_id=run_id, next_step=None, local_dir=local_dir, offline=bool(run.offline))

    def supports_fork(self) -> bool:
        return True

    def supports_rewind(self) -> bool:
        return True

