"""The hub source: the real huggingface_hub client against a local HTTP server (HF_ENDPOINT)."""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import shutil
import threading
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.data import make_text, make_tokenizer, write_parquet

from datalines import DataLineError, open_data_line
from datalines.creation import init_data_line
from datalines.dataline import DataLine
from datalines.planning import ensure_plan, files_to_read, plan_files
from datalines.preparer import prepare_cycle
from datalines.service import GIB, disk_need, preparer_running, run_preparer, shard_reserve_bytes
from datalines.sources.hub import HF_DOWNLOAD_CACHE
from datalines.status import PreparerStatus
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

        def not_found(self, code: str = "EntryNotFound") -> None:
            """A 404 as the hub sends it: its kind in X-Error-Code, a message of several lines from the client."""
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.send_header("X-Error-Code", code)
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
            if path.startswith("/api/datasets/") and not path.startswith(api):
                return self.not_found("RepoNotFound")
            if path.startswith(api + "revision/"):
                if path[len(api + "revision/"):] not in (COMMIT, "main"):
                    return self.not_found("RevisionNotFound")
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
    garbled = hashlib.sha256(good[:100] + bytes([good[100] ^ 0xFF]) + good[101:]).hexdigest()
    assert f"now sha256 {garbled[:12]}..., {len(good)} bytes)" in status.last_error  # not only the same size
    reference = init_data_line(tmp_path / "reference", tmp_path / "recipe.json", 0, 3000, None)
    prepare_cycle(reference, 0)
    assert shard_hashes(line, 0) == shard_hashes(reference, 0)


def closed_port() -> int:
    """A local port nothing listens on (a hub that is down)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_init_with_the_hub_down_is_one_line(
    corpus: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    recipe = hub_recipe(tmp_path / "recipe.json", corpus["tokenizer"])
    assert main(["data", "init", "--work", str(tmp_path / "line"), "--recipe", str(recipe), "--eos-id", "0",
                 "--cycle-tokens", "3000"]) == 2  # fmt: skip
    error = capsys.readouterr().err
    assert error.startswith("nsconsole: source web: hub dataset org/tiny@main: ") and error.count("\n") == 1
    assert "unreachable" in error and "Connection refused" in error
    assert not (tmp_path / "line" / "dataline.json").exists()


@pytest.mark.parametrize(
    ("change", "said"),
    [({"repo": "org/nope"}, "org/nope@main: no such dataset repo on the hub (or it is private or gated"),
     ({"revision": "v9"}, "org/tiny@v9: the repo has no revision 'v9'")],
)  # fmt: skip
def test_a_missing_repo_or_revision_is_refused_in_one_line(
    serve: Callable, corpus: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    change: dict[str, str], said: str,
) -> None:  # fmt: skip
    serve(DatasetRepo("org/tiny", dict(corpus["files"])))
    recipe = hub_recipe(tmp_path / "recipe.json", corpus["tokenizer"])
    raw = json.loads(recipe.read_text())
    raw["sources"][0].update(change)
    recipe.write_text(json.dumps(raw))
    assert main(["data", "init", "--work", str(tmp_path / "line"), "--recipe", str(recipe), "--eos-id", "0",
                 "--cycle-tokens", "3000"]) == 2  # fmt: skip
    error = capsys.readouterr().err
    assert error.startswith(f"nsconsole: source web: hub dataset {said}") and error.count("\n") == 1


def test_data_val_with_a_download_failing_is_one_line(
    serve: Callable, corpus: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A command that reads a source outside the preparer (val, rebuild) says a failed download in one
    line and exits 2; only the preparer retries it."""
    repo = DatasetRepo("org/tiny", dict(corpus["files"]))
    serve(repo)
    line = init_data_line(tmp_path / "line", hub_recipe(tmp_path / "recipe.json", corpus["tokenizer"]), 0, 3000, None)
    shutil.rmtree(line.path / "downloads")
    repo.fail_downloads = 1
    assert main(["data", "val", "--work", str(line.path), "--seq-len", "64", "--long-seq-len", "0"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("nsconsole: source web: download of data/de/part-000.parquet failed: ")
    assert error.count("\n") == 1


def test_a_source_whose_files_hold_no_text_is_refused_at_init(
    serve: Callable, corpus: dict, tmp_path: Path
) -> None:
    """Found by the preparer weeks later it read `no untrained documents left for cycle 0 (its documents
    are all trained)`: the source never had one."""
    write_parquet(tmp_path / "blank.parquet", ["", "", ""])
    files = dict(corpus["files"], **{"blank/part-000.parquet": (tmp_path / "blank.parquet").read_bytes()})
    serve(DatasetRepo("org/tiny", files))
    recipe = hub_recipe(tmp_path / "recipe.json", corpus["tokenizer"])
    raw = json.loads(recipe.read_text())
    raw["sources"].append({"name": "blank", "kind": "hub", "repo": "org/tiny", "revision": "main",
                           "data_dir": "blank"})  # fmt: skip
    raw["schedule"] = [{"from_tokens": 0, "shares": {"web": 0.9, "blank": 0.1}}]
    recipe.write_text(json.dumps(raw))
    with pytest.raises(DataLineError, match=r"source blank: its files hold no text \(3 documents, all empty"):
        init_data_line(tmp_path / "line", recipe, 0, 3000, None)
    assert not (tmp_path / "line" / "dataline.json").exists()


def test_a_stratum_whose_first_files_hold_no_text_is_refused_at_init(
    serve: Callable, corpus: dict, tmp_path: Path
) -> None:
    """Its share would be 0: its documents, later files' too, left out of every cycle without a word
    (found in a hub walkthrough; only a whole empty source was refused)."""
    write_parquet(tmp_path / "blank.parquet", ["", "", ""])
    files = dict(corpus["files"], **{"data/xx/part-000.parquet": (tmp_path / "blank.parquet").read_bytes()})
    serve(DatasetRepo("org/tiny", files))
    recipe = hub_recipe(tmp_path / "recipe.json", corpus["tokenizer"])
    with pytest.raises(DataLineError, match=r"source web: stratum .*xx's first files hold no text, so it would get no share"):
        init_data_line(tmp_path / "line", recipe, 0, 3000, None)
    assert not (tmp_path / "line" / "dataline.json").exists()


def test_a_download_a_killed_preparer_left_half_done_is_deleted(
    serve: Callable, corpus: dict, tmp_path: Path
) -> None:
    """huggingface_hub downloads into a temporary `*.incomplete` file of its own and deletes it when a
    download fails, but a kill -9 leaves it: each kill mid-download would keep up to a file's size."""
    serve(DatasetRepo("org/tiny", dict(corpus["files"])))
    line = init_data_line(tmp_path / "line", hub_recipe(tmp_path / "recipe.json", corpus["tokenizer"]), 0, 3000, None)
    shutil.rmtree(line.path / "downloads")
    partial = line.path / "downloads" / "web" / ".cache" / "huggingface" / "download" / "data" / "de"
    partial.mkdir(parents=True)
    (partial / f"fb60LaVdVxod.{'e' * 64}.9ed8c3ca.incomplete").write_bytes(b"x" * 5000)
    assert run_preparer(line, ahead=1, once=True, min_free_bytes=0).state == "ready"
    assert not list((line.path / "downloads").rglob("*.incomplete"))


def test_data_status_says_when_the_preparer_is_gone(
    serve: Callable, corpus: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A preparer killed mid-cycle (kill -9, a crash) leaves preparer.json saying `preparing`: status
    must not show it as running."""
    serve(DatasetRepo("org/tiny", dict(corpus["files"])))
    line = init_data_line(tmp_path / "line", hub_recipe(tmp_path / "recipe.json", corpus["tokenizer"]), 0, 3000, None)
    # Stopped mid-cycle without a last word: preparer.json as a kill -9 leaves it, its lock free.
    left = run_preparer(line, ahead=1, min_free_bytes=0, should_stop=lambda status: status.state == "preparing")
    assert left.state == "preparing"

    assert main(["data", "status", "--work", str(line.path)]) == 0
    out = capsys.readouterr().out
    assert (f"preparer: not running (its last status, pid {left.pid}: preparing: preparing cycle 0; "
            f"it stopped without a word: killed or crashed)\n") in out  # fmt: skip
    assert main(["data", "status", "--work", str(line.path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["preparer_running"] is False


def test_a_source_whose_documents_are_all_held_out_is_named_so(serve: Callable, corpus: dict, tmp_path: Path) -> None:
    """Its first cycle said `no untrained documents left for cycle 0 (its documents are all trained)`."""
    import random

    from datalines.heldout import is_held_out

    rng = random.Random(5)
    # Enough text that init finds the source able to fill its share of a cycle (were it trained on).
    held_out = [text for text in (make_text(rng, 20) for _ in range(200)) if is_held_out(text, 0.5)][:30]
    write_parquet(tmp_path / "small.parquet", held_out)
    files = dict(corpus["files"], **{"small/part-000.parquet": (tmp_path / "small.parquet").read_bytes()})
    serve(DatasetRepo("org/tiny", files))
    recipe = hub_recipe(tmp_path / "recipe.json", corpus["tokenizer"])
    raw = json.loads(recipe.read_text())
    raw["sources"].append({"name": "small", "kind": "hub", "repo": "org/tiny", "revision": "main",
                           "data_dir": "small", "heldout_fraction": 0.5})  # fmt: skip
    raw["schedule"] = [{"from_tokens": 0, "shares": {"web": 0.9, "small": 0.1}}]
    recipe.write_text(json.dumps(raw))
    line = init_data_line(tmp_path / "line", recipe, 0, 3000, None)
    with pytest.raises(DataLineError, match=r"source small has no documents to train on for cycle 0 \(every "
                                            r"document of its files is held out or empty; max epochs 1\)"):
        prepare_cycle(line, 0)


def test_a_refused_init_leaves_no_downloads(serve: Callable, corpus: dict, tmp_path: Path) -> None:
    """Init downloads each stratum's first files to calibrate (gigabytes on a real dataset): a recipe
    refused after that (here a wrong text_field) must not leave them in a directory no line owns."""
    serve(DatasetRepo("org/tiny", dict(corpus["files"])))
    recipe = hub_recipe(tmp_path / "recipe.json", corpus["tokenizer"])
    raw = json.loads(recipe.read_text())
    raw["sources"][0]["text_field"] = "content"
    recipe.write_text(json.dumps(raw))
    with pytest.raises(DataLineError, match=r"part-000\.parquet has no column 'content' \(columns: text, id\)"):
        init_data_line(tmp_path / "line", recipe, 0, 3000, None)
    assert not (tmp_path / "line").exists()
    (tmp_path / "mine").mkdir()  # a directory the user made: kept, and what was in it
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    with pytest.raises(DataLineError, match="has no column 'content'"):
        init_data_line(tmp_path / "mine", recipe, 0, 3000, None)
    assert [path.name for path in (tmp_path / "mine").iterdir()] == ["notes.txt"]


# Hub downloads over a line's life: who may write them (the preparer lock, which `data rebuild`
# takes too), what a released download leaves (nothing), the free disk the next cycle's downloads need.

def hub_line(serve: Callable, corpus: dict[str, Any], tmp_path: Path) -> DataLine:
    serve(DatasetRepo("org/tiny", dict(corpus["files"])))
    recipe = hub_recipe(tmp_path / "recipe.json", corpus["tokenizer"])
    return init_data_line(tmp_path / "line", recipe, 0, 3000, None)


def downloads(line: DataLine) -> set[str]:
    """The hub files downloaded now, by their path in the repo."""
    root = line.path / "downloads" / "web"
    return {path.relative_to(root).as_posix() for path in (root / "data").rglob("*.parquet")}


def cache_entries(line: DataLine) -> set[str]:
    """huggingface_hub's bookkeeping files for downloads, by the repo path they are kept for (a
    layout other than HF_DOWNLOAD_CACHE's shows here as none at all)."""
    root = line.path / "downloads" / "web" / HF_DOWNLOAD_CACHE
    entries = set()
    for path in root.rglob("*"):
        if path.is_file():
            assert path.suffix in (".metadata", ".lock"), path
            entries.add(path.relative_to(root).with_suffix("").as_posix())
    return entries


def empty_directories(root: Path) -> list[Path]:
    return [path for path in root.rglob("*") if path.is_dir() and not any(path.iterdir())]


def files_read(line: DataLine, index: int) -> set[str]:
    """The hub files cycle `index`'s plan reads."""
    files = line.source("web").files
    strata = line.cycle(index, verify=False).manifest["plan"]["sources"]["web"]["strata"]
    return {files[file_index].path for stratum in strata.values() for file_index, _, _ in stratum["ranges"]}


def test_rebuild_is_refused_while_a_preparer_runs_naming_its_pid(
    serve: Callable, corpus: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Both would write the cycle's directory and the same downloads (one releasing what the other reads)."""
    line = hub_line(serve, corpus, tmp_path)
    assert run_preparer(line, ahead=1, once=True, min_free_bytes=0).state == "ready"
    codes: list[int] = []

    def rebuild_meanwhile(status: PreparerStatus) -> bool:
        if status.state != "preparing":
            return False
        codes.append(main(["data", "rebuild", "--work", str(line.path), "--cycle", "0"]))
        return True

    run_preparer(open_data_line(line.path), ahead=2, min_free_bytes=0, should_stop=rebuild_meanwhile)
    assert codes == [2]
    error = capsys.readouterr().err
    assert error.count("\n") == 1
    assert error.startswith(f"nsconsole: {line.path / 'preparer.lock'}: a preparer runs on this line "
                            f"(pid {os.getpid()}); ")  # fmt: skip
    assert "stop it first to rebuild cycle 0 by hand" in error
    # With the preparer gone the rebuild runs.
    assert main(["data", "rebuild", "--work", str(line.path), "--cycle", "0"]) == 0


def test_a_preparer_is_refused_while_a_rebuild_runs(
    serve: Callable, corpus: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import datalines.preparer

    line = hub_line(serve, corpus, tmp_path)
    assert run_preparer(line, ahead=1, once=True, min_free_bytes=0).state == "ready"
    real_build = datalines.preparer.build_cycle
    refused: list[str] = []

    def build_with_a_preparer_starting(*args: Any, **kwargs: Any) -> dict[str, Any]:
        assert preparer_running(line.path)
        with pytest.raises(DataLineError) as error:
            run_preparer(open_data_line(line.path), ahead=2, once=True, min_free_bytes=0)
        refused.append(str(error.value))
        return real_build(*args, **kwargs)

    monkeypatch.setattr(datalines.preparer, "build_cycle", build_with_a_preparer_starting)
    assert main(["data", "rebuild", "--work", str(line.path), "--cycle", "0"]) == 0
    lock = line.path / "preparer.lock"
    assert refused == [f"{lock}: a rebuild of cycle 0 runs on this line (pid {os.getpid()})"]
    assert not preparer_running(line.path)
    assert not line.cycle_dir(1).exists()  # the refused preparer wrote nothing


def test_a_rebuild_releases_the_downloads_no_cycle_still_reads(
    serve: Callable, corpus: dict, tmp_path: Path
) -> None:
    """A rebuild of an early cycle fetches its files again: kept until the next cycle prepared released
    them, a line that had finished (or whose preparer no longer ran) kept them for good."""
    line = hub_line(serve, corpus, tmp_path)
    assert run_preparer(line, ahead=4, once=True, min_free_bytes=0).ready == [0, 1, 2, 3]
    before = downloads(line)
    assert files_read(line, 0) == {"data/de/part-000.parquet", "data/en/part-000.parquet"}
    assert not files_read(line, 0) & before  # released once cycle 2 moved past them

    assert main(["data", "rebuild", "--work", str(line.path), "--cycle", "0"]) == 0
    assert downloads(line) == before

    # A rollback's reopened cycle, rebuilt by the preparer: the same.
    line.mark_consumed(0)
    assert run_preparer(line, ahead=4, once=True, min_free_bytes=0).ready == [1, 2, 3, 4]
    before = downloads(line)
    assert line.reopen(0)
    assert run_preparer(line, ahead=1, once=True, min_free_bytes=0).ready == [0]
    assert downloads(line) == before
    assert cache_entries(line) == downloads(line)


def test_a_released_download_leaves_no_cache_files(serve: Callable, corpus: dict, tmp_path: Path) -> None:
    """huggingface_hub keeps a `.metadata` and a `.lock` of each file it downloaded into a directory:
    two files left for good per hub file, tens of thousands over a large dataset."""
    line = hub_line(serve, corpus, tmp_path)
    every_file = {path for path in corpus["files"] if path.startswith("data/")}
    assert cache_entries(line) == downloads(line) == every_file
    assert run_preparer(line, ahead=4, once=True, min_free_bytes=0).ready == [0, 1, 2, 3]
    assert downloads(line) < every_file  # cycle 2 released the first files
    assert cache_entries(line) == downloads(line)
    assert not empty_directories(line.path / "downloads")
    # Nor do the directories of a stratum whose files are all released.
    source = line.source("web")
    for file in source.files:
        if file.stratum == "de":
            source.release(file)
    assert {path.split("/")[1] for path in downloads(line) | cache_entries(line)} == {"en"}
    assert not empty_directories(line.path / "downloads")


def test_the_files_a_cycle_reads_are_estimated_before_it_is_planned(
    serve: Callable, corpus: dict, tmp_path: Path
) -> None:
    """Planning a cycle reads (downloads) its files, so the disk they take is wanted before: estimated
    from the pins (sizes) and the calibration, here exactly the files the plan then takes."""
    line = hub_line(serve, corpus, tmp_path)
    for index in range(6):
        estimated = files_to_read(line, index)
        assert estimated == plan_files(ensure_plan(line, index))
        assert files_to_read(line, index) == estimated  # planned: read from the plan


def test_the_preparer_waits_for_room_for_the_next_cycles_downloads(
    serve: Callable, corpus: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hub file can be several GiB: a disk with room for the shards alone fills while downloading."""
    line = hub_line(serve, corpus, tmp_path)
    shutil.rmtree(line.path / "downloads")
    wanted = ("data/de/part-000.parquet", "data/en/part-000.parquet")
    download_bytes = sum(len(corpus["files"][path]) for path in wanted)
    shards = 3 * 3000 * 2  # three cycles of uint16 tokens
    assert shard_reserve_bytes(line) == shards
    reserve = shards + GIB
    free = {"bytes": reserve + download_bytes - 1}
    real_disk_usage = shutil.disk_usage

    def disk_usage(path: Any) -> Any:
        usage = real_disk_usage(path)
        return type(usage)(usage.total, usage.used, free["bytes"])

    monkeypatch.setattr(shutil, "disk_usage", disk_usage)
    status = run_preparer(line, ahead=1, once=True, should_stop=lambda status: status.state == "waiting")
    assert status.state == "waiting"
    assert status.waiting_reason == (
        f"disk: {free['bytes'] / GIB:.2f} GiB free < {(reserve + download_bytes) / GIB:.2f} GiB needed to prepare "
        f"cycle 0 (shards {shards / GIB:.2f} GiB + 1 GiB spare, downloads {download_bytes / GIB:.2f} GiB)"
    )
    assert not line.cycle_dir(0).exists() and not downloads(line)

    free["bytes"] += 1
    assert run_preparer(line, ahead=1, once=True).state == "ready"
    assert files_read(line, 0) == set(wanted)  # the files it counted are the ones the cycle read
    # Downloaded now, they are needed no more; a threshold given (--min-free-gb) stands for the shards'.
    need = disk_need(line, 0, 5 * GIB)
    assert need.downloads == 0 and need.total == 5 * GIB
    assert need.describe() == "minimum 5.00 GiB, downloads 0.00 GiB"
