"""A local W&B server for the online tests: just enough of W&B's HTTP API for the wandb 0.31 client.

There is no W&B server to test against here: `wandb server start` runs the `wandb/local` Docker
image (no Docker daemon, no registry to pull it from) and the network is closed. So this module
answers what the client's Go core (wandb-core) asks, found by running the client against a
server that logged every request:

- `POST /graphql`, by operation: `RunResumeStatus` (does the run exist; its history line count,
  the tail of its history, summary and config: the client continues from there), `UpsertBucket`
  (create or update a run: config, tags, summary), `CreateRunFiles` (where to upload the run's
  files), `OrganizationCoreWeaveOrganizationID`, `Viewer`/`ServerInfo`-style login checks, and
  `HistoryPage` (a run's history rows between two steps: what a resume compares with);
- `POST /files/<entity>/<project>/<run>/file_stream`: the run's history, summary, events and
  console lines, each file as lines at an offset, and at the end `complete` with the exit code;
- `PUT` to the upload URLs handed out by `CreateRunFiles` (config.yaml, wandb-summary.json, ...);
- anything else (the SDK's own telemetry) gets an empty 200.

The server keeps every run's history rows as the client sent them. As W&B does, a history row
whose `_step` is not above the run's last one is not stored (it is counted in `dropped`), so a
test sees every update once or sees what went wrong. It can be taken down and brought back on
the same port (an outage), and a test may plant rows in a run's history (a server whose copy
differs from the line's).
"""

from __future__ import annotations

import base64
import contextlib
import json
import re
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from helpers.environment import scoped_environment, wandb_environment

HISTORY_FILE = "wandb-history.jsonl"
SUMMARY_FILE = "wandb-summary.json"
EVENTS_FILE = "wandb-events.jsonl"
OUTPUT_FILE = "output.log"
HISTORY_TAIL_ROWS = 10
"""How many of a run's last history rows `RunResumeStatus` returns (the client reads the last one)."""
FAKE_API_KEY = "0123456789abcdef0123456789abcdef01234567"
"""A 40-character key: the client checks the shape of a key, this server accepts any."""
CLIENT_TUNING = {
    # Whole seconds (wandb-core truncates these to seconds): rows reach the server each second,
    # and a refused connection is retried after 1-2 s instead of W&B's minutes.
    "WANDB__FILE_STREAM_TRANSMIT_INTERVAL": "1",
    "WANDB__FILE_STREAM_RETRY_WAIT_MIN_SECONDS": "1",
    "WANDB__FILE_STREAM_RETRY_WAIT_MAX_SECONDS": "2",
    "WANDB__GRAPHQL_RETRY_MAX": "2",
    "WANDB__GRAPHQL_RETRY_WAIT_MIN_SECONDS": "1",
    "WANDB__GRAPHQL_RETRY_WAIT_MAX_SECONDS": "2",
    "WANDB_INIT_TIMEOUT": "20",
    # Nothing the tests look at: no system metrics, machine description or requirements upload.
    "WANDB__DISABLE_STATS": "true",
    "WANDB__DISABLE_META": "true",
    "WANDB__SAVE_REQUIREMENTS": "false",
}
"""The environment of a client under test: quick uploads and retries (also for trainer subprocesses)."""


@contextmanager
def online_wandb(home: Path) -> Iterator[FakeWandbServer]:
    """A fresh local W&B server, and every wandb client started inside pointed at it, online.

    Fails the test if the client asked the server anything it does not answer.
    """
    import wandb

    server = FakeWandbServer()
    server.start()
    environment = {
        **wandb_environment(home),
        **CLIENT_TUNING,
        "WANDB_BASE_URL": server.base_url,
        "WANDB_API_KEY": FAKE_API_KEY,
        "WANDB_MODE": "online",
    }
    with scoped_environment(environment):
        # wandb keeps the settings it read from the environment for the life of its service:
        # a fresh one reads this server's address.
        wandb.teardown()
        try:
            yield server
        finally:
            wandb.teardown()
            server.stop()
    assert server.unknown == [], server.unknown


@dataclass
class ServerRun:
    """One run as the server holds it."""

    entity: str
    project: str
    name: str
    config: dict[str, Any] = field(default_factory=dict)
    tags: list[str] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    history: list[str] = field(default_factory=list)
    """The history lines (JSON objects with `_step`) as the client streamed them, in order."""
    dropped: list[int] = field(default_factory=list)
    """Steps of history lines not stored because they were not above the run's last step."""
    events_lines: int = 0
    output_lines: int = 0
    uploaded: dict[str, bytes] = field(default_factory=dict)
    exit_code: int | None = None
    """Set when the client reports the run complete."""
    upserts: int = 0

    @property
    def storage_id(self) -> str:
        return base64.b64encode(f"Run:v1:{self.name}:{self.project}:{self.entity}".encode()).decode()

    def rows(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.history]

    def steps(self) -> list[int]:
        return [row["_step"] for row in self.rows()]

    def last_step(self) -> int | None:
        return json.loads(self.history[-1])["_step"] if self.history else None

    def wandb_config(self) -> dict[str, Any]:
        """The client's own bookkeeping in the config; a run without `t` counts as not started."""
        internal = self.config.get("_wandb", {})
        value = internal.get("value", {}) if isinstance(internal, dict) else {}
        return {"t": value["t"]} if isinstance(value, dict) and "t" in value else {}


class FakeWandbServer:
    """A threading HTTP server on 127.0.0.1 (a free port) holding runs in memory."""

    def __init__(self) -> None:
        self.runs: dict[str, ServerRun] = {}
        self.operations: list[str] = []
        """Every GraphQL operation asked for, in order."""
        self.unknown: list[str] = []
        """Requests this server does not know how to answer (a test may assert there are none)."""
        self.lock = threading.Lock()
        self.port = 0
        self.history_capacity: int | None = None
        """When set, a run takes at most this many history lines; a request carrying more is
        answered 503 (a struggling W&B), so the client keeps the rest and tries again later."""
        self.connections: set[socket.socket] = set()
        """Open client connections (kept alive by HTTP/1.1), cut when the server goes down."""
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # Lifecycle.

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def up(self) -> bool:
        return self._httpd is not None

    def start(self) -> str:
        """Listen (on the same port as before after a `stop`); returns the base URL."""
        handler = type("Handler", (_Handler,), {"server_state": self})
        self._httpd = _QuietHTTPServer(("127.0.0.1", self.port), handler)
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="fake-wandb", daemon=True)
        self._thread.start()
        return self.base_url

    def stop(self) -> None:
        """Stop listening and cut every open connection: the client is refused, as in an outage."""
        if self._httpd is None:
            return
        self._httpd.shutdown()
        self._httpd.server_close()
        with self.lock:
            for connection in self.connections:
                with contextlib.suppress(OSError):  # already closed by the client
                    connection.shutdown(socket.SHUT_RDWR)
        assert self._thread is not None
        self._thread.join()
        self._httpd = None

    # What tests read and plant.

    def run(self, name: str) -> ServerRun:
        with self.lock:
            return self.runs[name]

    def plant_history(self, name: str, rows: list[dict[str, Any]], entity: str, project: str) -> None:
        """Give run `name` these history rows (each with `_step`), as if a client had logged them."""
        with self.lock:
            run = self.runs.setdefault(name, ServerRun(entity, project, name))
            run.config.setdefault("_wandb", {"value": {"t": {}}})
            run.history.extend(json.dumps(row) for row in rows)
            run.summary.update(rows[-1])

    # Requests.

    def graphql(self, body: dict[str, Any]) -> dict[str, Any]:
        query = body.get("query", "")
        operation = body.get("operationName") or _operation_name(query)
        variables = body.get("variables") or {}
        with self.lock:
            self.operations.append(operation)
            answer = getattr(self, f"_op_{operation}", None)
            if answer is None:
                self.unknown.append(f"graphql {operation}: {' '.join(query.split())}")
                return {"data": {}}
            return {"data": answer(variables)}

    def file_stream(self, entity: str, project: str, name: str, body: dict[str, Any]) -> dict[str, Any] | None:
        """Take a file_stream request; None when part of it was refused (answered 503)."""
        with self.lock:
            run = self.runs.setdefault(name, ServerRun(entity, project, name))
            files = body.get("files") or {}
            history = files.get(HISTORY_FILE)
            if history is not None and self.history_capacity is not None:
                room = max(0, self.history_capacity - int(history.get("offset", 0)))
                if len(history.get("content", [])) > room:
                    self._stream_file(run, HISTORY_FILE, int(history["offset"]), history["content"][:room])
                    return None
            for file_name, chunk in files.items():
                self._stream_file(run, file_name, int(chunk.get("offset", 0)), list(chunk.get("content", [])))
            if body.get("complete"):
                run.exit_code = int(body.get("exitcode") or 0)
        return {"exitcode": None, "limits": {}}

    def _stream_file(self, run: ServerRun, file_name: str, offset: int, lines: list[str]) -> None:
        if file_name == HISTORY_FILE:
            for index, line in enumerate(lines, start=offset):
                if index < len(run.history):
                    run.history[index] = line  # the client sent this chunk again (a retry)
                    continue
                step = json.loads(line)["_step"]
                last = run.last_step()
                if last is not None and step <= last:
                    run.dropped.append(step)
                    continue
                run.history.append(line)
        elif file_name == SUMMARY_FILE:
            if lines:
                run.summary = json.loads(lines[-1])
        elif file_name == EVENTS_FILE:
            run.events_lines = max(run.events_lines, offset + len(lines))
        elif file_name == OUTPUT_FILE:
            run.output_lines = max(run.output_lines, offset + len(lines))
        else:
            self.unknown.append(f"file_stream file {file_name}")

    def upload(self, path: str, data: bytes) -> None:
        _, name, file_name = path.strip("/").split("/", 2)
        with self.lock:
            if name in self.runs:
                self.runs[name].uploaded[file_name] = data

    # GraphQL operations (called with the lock held).

    def _bucket(self, run: ServerRun) -> dict[str, Any]:
        history_tail = run.history[-HISTORY_TAIL_ROWS:]
        return {
            "id": run.storage_id,
            "name": run.name,
            "displayName": run.name,
            "description": None,
            "notes": None,
            "sweepName": None,
            "config": json.dumps(run.config),
            "summaryMetrics": json.dumps(run.summary),
            "historyLineCount": len(run.history),
            "eventsLineCount": run.events_lines,
            "logLineCount": run.output_lines,
            "historyTail": json.dumps(history_tail),
            "eventsTail": json.dumps([]),
            "tags": list(run.tags),
            "wandbConfig": json.dumps(run.wandb_config()),
            "project": self._project(run.entity, run.project),
        }

    @staticmethod
    def _project(entity: str, project: str) -> dict[str, Any]:
        return {"id": f"project-{project}", "name": project, "entity": {"id": f"entity-{entity}", "name": entity}}

    def _op_RunResumeStatus(self, variables: dict[str, Any]) -> dict[str, Any]:
        entity, project = variables.get("entity") or "nsconsole", variables["project"]
        run = self.runs.get(variables["name"])
        model = self._project(entity, project)
        model["bucket"] = self._bucket(run) if run is not None else None
        return {"model": model}

    def _op_UpsertBucket(self, variables: dict[str, Any]) -> dict[str, Any]:
        name = variables["name"]
        inserted = name not in self.runs
        entity = variables.get("entity") or "nsconsole"
        run = self.runs.setdefault(name, ServerRun(entity, variables.get("project") or "uncategorized", name))
        run.upserts += 1
        if variables.get("config") is not None:
            run.config = json.loads(variables["config"])
        if variables.get("tags") is not None:
            run.tags = list(variables["tags"])
        if variables.get("summaryMetrics") is not None:
            run.summary.update(json.loads(variables["summaryMetrics"]))
        return {"upsertBucket": {"bucket": self._bucket(run), "inserted": inserted}}

    def _op_CreateRunFiles(self, variables: dict[str, Any]) -> dict[str, Any]:
        name = variables["run"]
        files = [{"name": file, "uploadUrl": f"{self.base_url}/_upload/{name}/{file}"} for file in variables["files"]]
        storage_id = self.runs[name].storage_id if name in self.runs else None
        return {"createRunFiles": {"runID": storage_id, "uploadHeaders": [], "files": files}}

    def _op_OrganizationCoreWeaveOrganizationID(self, variables: dict[str, Any]) -> dict[str, Any]:
        return {"entity": {"organization": None}}

    def _op_Run(self, variables: dict[str, Any]) -> dict[str, Any]:
        """A run's fields, for `wandb.Api().run(path)`."""
        run = self.runs.get(variables["name"])
        if run is None:
            return {"project": {"run": None}}
        fields = {
            "projectId": 1,
            "id": run.storage_id,
            "name": run.name,
            "displayName": run.name,
            "tags": list(run.tags),
            "state": "finished" if run.exit_code is not None else "running",
            "config": json.dumps(run.config),
            "summaryMetrics": json.dumps(run.summary),
            "systemMetrics": json.dumps({}),
            "historyLineCount": len(run.history),
            "historyKeys": self._history_keys(run),
            "createdAt": "2026-01-01T00:00:00",
            "heartbeatAt": "2026-01-01T00:00:00",
            "user": {"name": "nsconsole", "username": "nsconsole"},
            **dict.fromkeys(("sweepName", "group", "jobType", "commit", "description", "notes"), None),
            "readOnly": False,
        }
        return {"project": {"run": fields}}

    def _op_RunHistoryKeys(self, variables: dict[str, Any]) -> dict[str, Any]:
        run = self.runs.get(variables["name"])
        return {"project": {"run": {"historyKeys": self._history_keys(run)} if run is not None else None}}

    @staticmethod
    def _history_keys(run: ServerRun) -> dict[str, Any]:
        last = run.last_step()
        return {"lastStep": last if last is not None else -1, "keys": {}}

    def _op_Viewer(self, variables: dict[str, Any]) -> dict[str, Any]:
        """The account behind the API key (`wandb.Api()` checks the key with it)."""
        viewer = {"id": "viewer", "entity": "nsconsole", "username": "nsconsole", "email": None, "flags": None}
        return {"viewer": {**viewer, "teams": {"edges": []}}}

    def _op_RunParquetHistory(self, variables: dict[str, Any]) -> dict[str, Any]:
        """No history exported to parquet files: all of it is live (read with `HistoryPage`)."""
        run = self.runs.get(variables["runName"])
        if run is None:
            return {"project": {"run": None}}
        keys = variables.get("liveKeys") or ["_step"]
        live = [{key: row[key] for key in keys if key in row} for row in run.rows()]
        return {"project": {"run": {"parquetHistory": {"parquetUrls": [], "liveData": live}}}}

    def _op_HistoryPage(self, variables: dict[str, Any]) -> dict[str, Any]:
        """A run's history rows with minStep <= _step < maxStep, at most `pageSize` of them."""
        run = self.runs.get(variables["run"])
        if run is None:
            return {"project": {"run": None}}
        low, high, size = int(variables["minStep"]), int(variables["maxStep"]), int(variables["pageSize"])
        lines = [line for line in run.history if low <= json.loads(line)["_step"] < high][:size]
        return {"project": {"run": {"history": lines}}}


def _operation_name(query: str) -> str:
    match = re.search(r"\b(?:query|mutation)\s+(\w+)", query)
    return match.group(1) if match else "anonymous"


class _QuietHTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that drops its connection (or one this server cut) is no error worth a traceback."""


class _Handler(BaseHTTPRequestHandler):
    server_state: FakeWandbServer
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        super().setup()
        with self.server_state.lock:
            self.server_state.connections.add(self.connection)

    def finish(self) -> None:
        with self.server_state.lock:
            self.server_state.connections.discard(self.connection)
        super().finish()

    def _body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _reply(self, payload: dict[str, Any] | None, status: int = 200) -> None:
        data = json.dumps(payload if payload is not None else {}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:  # noqa: N802 (the name http.server calls)
        body = self._body()
        state = self.server_state
        if self.path == "/graphql":
            self._reply(state.graphql(json.loads(body)))
            return
        match = re.fullmatch(r"/files/([^/]+)/([^/]+)/([^/]+)/file_stream", self.path)
        if match:
            answer = state.file_stream(*match.groups(), json.loads(body))
            self._reply(answer, status=200 if answer is not None else 503)
            return
        self._reply(None)  # the SDK's telemetry and anything else: taken, ignored

    def do_PUT(self) -> None:  # noqa: N802
        body = self._body()
        if self.path.startswith("/_upload/"):
            self.server_state.upload(self.path, body)
        self._reply(None)

    def do_GET(self) -> None:  # noqa: N802
        self._body()
        self.server_state.unknown.append(f"GET {self.path}")
        self._reply(None)

    def log_message(self, format: str, *arguments: Any) -> None:  # noqa: A002
        """Quiet: the tests read what the server holds, not its access log."""
