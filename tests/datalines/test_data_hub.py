"""The hub source: the real huggingface_hub client against a local HTTP server (HF_ENDPOINT)."""

from __future__ import annotations

import hashlib
import http.server
import json
import shutil
import threading
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers.data import make_text, make_tokenizer, write_parquet

from datalines import DataLineError, open_data_line
from datalines.creation import init_data_line
from datalines.dataline import DataLine
from datalines.preparer import prepare_cycle
from datalines.service import run_preparer
from nsconsole.cli import main

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class DatasetRepo:
    """A dataset repo at one commit: path -> bytes; files over 1 KB are LFS files as on the hub."""

    def __init__(self, name: str, files: dict[str, bytes]) -> None:
        self.name, self.files = name, files
        self.requests: list[str] = []
        self.drop_after_bytes: dict[str, int] = {}
        """path -> serve only this many bytes of the next GET of it, then drop the connection."""
        self.fail_downloads = 0
        """Hang up on this many file requests without answering (a server having a bad minute)."""

    def tree(self) -> list[dict[str, object]]:
        entries = []
        for path, data in sorted(self.files.items()):
            entry: dict[str, object] = {"type": "file", "path": path, "size": len(data),
                                        "oid": hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()}
            if len(data) > 1024:
                sha256 = hashlib.sha256(data).hexdigest()
                entry["lfs"] = {"oid": sha256, "size": len(data), "pointerSize": 134}
            entries.append(entry)
        return entries


def make_handler(repo: DatasetRepo) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            return None

        def send_json(self, value: object) -> None:
            body = json.dumps(value).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def not_found(self) -> None:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.send_header("X-Error-Code", "EntryNotFound")
            self.end_headers()

        def do_HEAD(self) -> None:
            self.respond(send_body=False)

        def do_GET(self) -> None:
            self.respond(send_body=True)

        def respond(self, send_body: bool) -> None:
            url = urllib.parse.urlparse(self.path)
            path = urllib.parse.unquote(url.path)
            repo.requests.append(f"{self.command} {path}")
            api = f"/api/datasets/{repo.name}/"
            resolve = f"/datasets/{repo.name}/resolve/"
            if path.startswith(api + "revision/"):
                return self.send_json({"id": repo.name, "sha": COMMIT, "private": False,
                                       "siblings": [{"rfilename": name} for name in sorted(repo.files)]})
            if path.startswith(api + "tree/"):
                return self.send_json(repo.tree())
            if path.startswith(resolve):
                revision, _, name = path[len(resolve):].partition("/")
                if revision not in (COMMIT, "main") or name not in repo.files:
                    return self.not_found()
                if repo.fail_downloads:
                    repo.fail_downloads -= 1
                    self.close_connection = True  # hang up without an answer
                    return None
                return self.send_file(name, send_body)
            self.not_found()

        def send_file(self, name: str, send_body: bool) -> None:
            data = repo.files[name]
            start = 0
            ranged = self.headers.get("Range")
            if ranged and ranged.startswith("bytes="):
                start = int(ranged[len("bytes="):].split("-")[0])
            self.send_response(206 if start else 200)
            self.send_header("X-Repo-Commit", COMMIT)
            etag = hashlib.sha256(data).hexdigest() if len(data) > 1024 else hashlib.sha1(data).hexdigest()
            self.send_header("ETag", f'"{etag}"')
            self.send_header("Content-Length", str(len(data) - start))
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.end_headers()
            if not send_body:
                return
            cut = repo.drop_after_bytes.pop(name, None)
            if cut is not None:
                self.wfile.write(data[start : start + cut])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(2)
                return
            self.wfile.write(data[start:])

    return Handler


@pytest.fixture
def serve(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[DatasetRepo], str]]:
    servers = []

    def start(repo: DatasetRepo) -> str:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), make_handler(repo))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        endpoint = f"http://127.0.0.1:{server.server_address[1]}"
        monkeypatch.setenv("HF_ENDPOINT", endpoint)
        return endpoint

    yield start
    for server in servers:
        server.shutdown()



@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """Parquet files in strata `en` and `de` under `data/`, a README outside it, and a tokenizer."""
    import random

    root = tmp_path_factory.mktemp("hub")
    rng = random.Random(3)
    files: dict[str, bytes] = {"README.md": b"# tiny dataset\n"}
    for stratum, length in (("en", 30), ("de", 60)):
        for number in range(3):
            local = root / "data" / stratum / f"part-{number:03d}.parquet"
            write_parquet(local, [make_text(rng, rng.randrange(length // 2, length)) for _ in range(80)])
            files[f"data/{stratum}/part-{number:03d}.parquet"] = local.read_bytes()
    tokenizer = make_tokenizer(root / "tokenizer.json", [root / "data"], vocab=500)
    return {"files": files, "tokenizer": tokenizer, "root": root}


def hub_recipe(path: Path, tokenizer: Path) -> Path:
    recipe = {
        "tokenizer": str(tokenizer),
        "validation_tokens": 5000,
        "sources": [
            {"name": "web", "kind": "hub", "repo": "org/tiny", "revision": "main", "data_dir": "data"}
        ],
        "schedule": [{"from_tokens": 0, "shares": {"web": 1.0}}],
    }
    path.write_text(json.dumps(recipe))
    return path


def shard_hashes(line: DataLine, index: int) -> dict[str, str]:
    paths = sorted(line.cycle_dir(index).iterdir())
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in paths}


def test_init_pins_the_commit_and_every_file(serve: Callable, corpus: dict, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    repo = DatasetRepo("org/tiny", dict(corpus["files"]))
    serve(repo)
    recipe = hub_recipe(tmp_path / "recipe.json", corpus["tokenizer"])
    assert main(["data", "init", "--work", str(tmp_path / "line"), "--recipe", str(recipe), "--eos-id", "0",
                 "--cycle-tokens", "3000"]) == 0
    assert "sources web" in capsys.readouterr().out
    pins = json.loads((tmp_path / "line" / "dataline.json").read_text())["pins"]["web"]
    assert pins["revision"] == COMMIT and pins["repo"] == "org/tiny"
    assert [(f["path"], f["stratum"]) for f in pins["files"]] == [
        (f"data/{stratum}/part-{n:03d}.parquet", stratum) for stratum in ("de", "en") for n in range(3)
    ]
    for file in pins["files"]:
        assert file["sha256"] == hashlib.sha256(corpus["files"][file["path"]]).hexdigest()
    requests = [request for request in repo.requests if "/datasets/org/tiny/" in request]
    assert requests[:2] == [
        "GET /api/datasets/org/tiny/revision/main",
        f"GET /api/datasets/org/tiny/tree/{COMMIT}",
    ]
    assert all(f"/resolve/{COMMIT}/" in request for request in requests[2:])  # never "main" again

    line = open_data_line(tmp_path / "line")
    prepare_cycle(line, 0)
    manifest = line.cycle(0).manifest
    assert {"de", "en"} == {s for s, info in manifest["sources"]["web"]["strata"].items() if info["tokens"]}


def test_a_dropped_connection_is_resumed_and_the_cycle_bytes_are_identical(
    serve: Callable, corpus: dict, tmp_path: Path
) -> None:
    healthy = DatasetRepo("org/tiny", dict(corpus["files"]))
    serve(healthy)
    recipe = hub_recipe(tmp_path / "recipe.json", corpus["tokenizer"])
    reference = init_data_line(tmp_path / "reference", recipe, 0, 3000, None)
    prepare_cycle(reference, 0)
    prepare_cycle(reference, 1)

    flaky = DatasetRepo("org/tiny", dict(corpus["files"]))
    serve(flaky)
    line = init_data_line(tmp_path / "line", recipe, 0, 3000, None)
    # Init downloaded files for calibration; start the preparer from an empty download folder.
    shutil.rmtree(tmp_path / "line" / "downloads")
    for name in corpus["files"]:
        flaky.drop_after_bytes[name] = 700
    flaky.fail_downloads = 3
    slept: list[float] = []
    status = run_preparer(line, ahead=2, once=True, sleep=slept.append)
    assert status.state == "ready" and status.ready == [0, 1]
    assert shard_hashes(line, 0) == shard_hashes(reference, 0)
    assert shard_hashes(line, 1) == shard_hashes(reference, 1)
    # Three hang-ups: three failed attempts, retried after 2, 4 and 8 s, the same cycle each time.
    assert status.failures == 3 and slept == [2.0, 4.0, 8.0]
    # Every dropped download was resumed (a second GET of the file), and the bytes came out the same.
    gets = [request for request in flaky.requests if request.startswith("GET /datasets/org/tiny/resolve/")]
    assert all(sum(request.endswith("/" + name) for request in gets) >= 2 for name in flaky_paths(line, 0))
    # Downloads that no later cycle reads are deleted once the cycles that read them are prepared.
    downloaded = {p.relative_to(line.path / "downloads" / "web").as_posix()
                  for p in (line.path / "downloads" / "web").rglob("*.parquet")}
    assert downloaded < {name for name in corpus["files"] if name.endswith(".parquet")}


def flaky_paths(line: DataLine, index: int) -> set[str]:
    """The files cycle `index` read."""
    files = line.source("web").files
    plan = line.cycle(index).manifest["plan"]["sources"]["web"]["strata"]
    return {files[file_index].path for stratum in plan.values() for file_index, _, _ in stratum["ranges"]}


def test_a_truncated_parquet_on_the_hub_is_named(serve: Callable, corpus: dict, tmp_path: Path) -> None:
    files = dict(corpus["files"])
    files["data/en/part-000.parquet"] = files["data/en/part-000.parquet"][:-300]
    serve(DatasetRepo("org/tiny", files))
    recipe = hub_recipe(tmp_path / "recipe.json", corpus["tokenizer"])
    with pytest.raises(DataLineError, match=r"data/en/part-000\.parquet is not a readable parquet file"):
        init_data_line(tmp_path / "line", recipe, 0, 3000, None)
    assert not (tmp_path / "line" / "dataline.json").exists()


def test_a_download_with_wrong_bytes_is_deleted_and_fetched_again(
    serve: Callable, corpus: dict, tmp_path: Path
) -> None:
    repo = DatasetRepo("org/tiny", dict(corpus["files"]))
    serve(repo)
    recipe = hub_recipe(tmp_path / "recipe.json", corpus["tokenizer"])
    line = init_data_line(tmp_path / "line", recipe, 0, 3000, None)
    shutil.rmtree(tmp_path / "line" / "downloads")
    victim = "data/de/part-000.parquet"
    good = repo.files[victim]
    repo.files[victim] = good[:100] + bytes([good[100] ^ 0xFF]) + good[101:]  # garbled in transit

    def sleep(seconds: float) -> None:
        repo.files[victim] = good  # the next attempt gets the right bytes

    status = run_preparer(line, ahead=1, once=True, sleep=sleep)
    assert status.state == "ready" and status.failures == 1
    assert "part-000.parquet changed since init" in status.last_error and "fetched again" in status.last_error
    reference = init_data_line(tmp_path / "reference", tmp_path / "recipe.json", 0, 3000, None)
    prepare_cycle(reference, 0)
    assert shard_hashes(line, 0) == shard_hashes(reference, 0)
