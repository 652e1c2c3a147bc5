"""A hub source: a dataset repo on the Hugging Face hub, pinned to a commit sha at init.

The revision the recipe names (a branch, tag or sha) is resolved once, at init, to its commit
sha; the file list and every download use that sha, so a later push to the repo changes
nothing in the line. Each file is pinned by its LFS sha256 (or, for a small non-LFS file, the
sha256 of its bytes taken at init). Files are downloaded into `<line>/downloads/<source>/` and
deleted once every cycle that reads them is prepared. The endpoint is `HF_ENDPOINT` read at call
time (so tests and mirrors can set it), otherwise the public hub.

A failure of the hub (down, an error status, a dropped or garbled download) is a
`SourceUnavailable` in one line: the preparer retries it, a command (init, val, rebuild) prints it.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from datalines.errors import DataLineError, SourceUnavailable
from datalines.files import sha256_file
from datalines.sources.base import Source, SourceFile, matches, stratum_of

DEFAULT_INCLUDE = ("**/*.parquet",)
DOWNLOADS_DIRECTORY = "downloads"
FETCH_LOCK_NAME = ".fetch.lock"
"""In a source's download directory: held while a process of ours downloads into it or deletes from it."""
HF_DOWNLOAD_CACHE = Path(".cache") / "huggingface" / "download"
"""Where huggingface_hub (2.4) keeps, in a directory it downloads into, a `<path>.metadata` and a
`<path>.lock` of every file it downloaded there."""


def hub_endpoint() -> str | None:
    return os.environ.get("HF_ENDPOINT") or None


class HubSource(Source):
    def _api(self) -> Any:
        from huggingface_hub import HfApi

        return HfApi(endpoint=hub_endpoint())

    def take_pins(self) -> dict[str, Any]:
        from huggingface_hub.hf_api import RepoFile

        repo = self.spec.location
        api = self._api()
        try:
            commit = api.dataset_info(repo, revision=self.spec.revision).sha
            entries = list(api.list_repo_tree(repo, repo_type="dataset", revision=commit, recursive=True))
        except Exception as error:  # noqa: BLE001 (every failure of the call is the hub's: hub_failure)
            where = f"source {self.spec.name}: hub dataset {repo}@{self.spec.revision}"
            raise SourceUnavailable(f"{where}: {hub_failure(error, self.spec.revision)}") from None
        if not commit:
            raise DataLineError(f"source {self.spec.name}: hub dataset {repo} gave no commit sha")
        self.pins = {"repo": repo, "revision": commit, "files": []}
        include = self.spec.include or DEFAULT_INCLUDE
        prefix = f"{self.spec.data_dir}/" if self.spec.data_dir else ""
        files = []
        repo_files = sorted((entry for entry in entries if isinstance(entry, RepoFile)), key=lambda e: e.path)
        for entry in repo_files:
            relative = entry.path[len(prefix) :]
            if not entry.path.startswith(prefix) or not matches(relative, include):
                continue
            stratum = stratum_of(relative, self.spec.strata)
            if entry.lfs is not None:
                files.append(SourceFile(entry.path, stratum, int(entry.size), entry.lfs.sha256))
            else:
                # A small file kept in git: its bytes are hashed once, now, and pinned.
                unpinned = SourceFile(entry.path, stratum, int(entry.size), "")
                sha256 = sha256_file(self.fetch(unpinned))
                files.append(SourceFile(entry.path, stratum, int(entry.size), sha256))
        self.pins["files"] = [file.to_json() for file in files]
        return self.pins

    def fetch(self, file: SourceFile) -> Path:
        """Download the file at the pinned commit (resumed by huggingface_hub after a dropped connection)."""
        from huggingface_hub import hf_hub_download

        with self._fetching():
            try:
                return Path(
                    hf_hub_download(
                        self.pins["repo"],
                        file.path,
                        repo_type="dataset",
                        revision=self.pins["revision"],
                        local_dir=self.download_dir(),
                        endpoint=hub_endpoint(),
                    )
                )
            except Exception as error:  # noqa: BLE001 (every failure of the call is the hub's: hub_failure)
                message = f"source {self.spec.name}: download of {file.path} failed: {hub_failure(error, None)}"
                raise HubUnavailable(message) from None

    @contextmanager
    def _fetching(self) -> Iterator[None]:
        """Hold the source's download directory and delete what killed downloads left in it.

        huggingface_hub downloads into a temporary `*.incomplete` file named for the process's
        download and deletes it when the download fails, but a process killed mid-download (kill
        -9, out of memory, a reboot) leaves it, as large as what had arrived: each kill of a
        preparer running for weeks would keep up to a file's size for good. Under the lock no
        other process of ours downloads into the directory, so every such file there is a dead one's.
        """
        directory = self.download_dir()
        directory.mkdir(parents=True, exist_ok=True)
        with self._holding():
            for partial in directory.glob(".cache/**/*.incomplete"):
                partial.unlink(missing_ok=True)
            yield

    @contextmanager
    def _holding(self) -> Iterator[None]:
        """Hold the source's (existing) download directory: no other process of ours downloads into it
        or deletes from it meanwhile."""
        with open(self.download_dir() / FETCH_LOCK_NAME, "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def verify(self, file: SourceFile, path: Path) -> None:
        """A download whose bytes differ from the pin is deleted and retried, never read."""
        try:
            super().verify(file, path)
        except DataLineError as error:
            path.unlink(missing_ok=True)
            raise HubUnavailable(f"{error}; the download was deleted and will be fetched again") from None

    def download_dir(self) -> Path:
        return self.work / DOWNLOADS_DIRECTORY / self.spec.name

    def release(self, file: SourceFile) -> None:
        """Delete the downloaded copy: every document of the file is in a prepared cycle already.

        huggingface_hub's `.metadata` and `.lock` of the file go with it, and the directories that
        leaves empty: kept, they would be two small files for every file of the dataset, for good.
        Done under the fetch lock, so no download of ours is using them (or a directory) meanwhile.
        """
        directory = self.download_dir()
        if not directory.is_dir():
            return
        metadata = directory / HF_DOWNLOAD_CACHE / f"{file.path}.metadata"
        with self._holding():
            for path in (directory / file.path, metadata, metadata.with_suffix(".lock")):
                path.unlink(missing_ok=True)
                _remove_empty_directories(path.parent, directory)

    def needs_download(self, file: SourceFile) -> bool:
        return not (self.download_dir() / file.path).is_file()


def _remove_empty_directories(directory: Path, top: Path) -> None:
    """Remove `directory` and its parents below `top` while they are empty."""
    while directory != top and directory.is_relative_to(top):
        try:
            directory.rmdir()
        except OSError:  # not empty (or gone)
            return
        directory = directory.parent


def hub_failure(error: BaseException, revision: str | None) -> str:
    """Why a call of huggingface_hub failed, in one line (its own messages run over several).

    Every exception of such a call is taken as the hub's: huggingface_hub lets the transport
    errors of the HTTP library under it (a refused or reset connection, a timeout, a server that
    hung up) through as they are, neither OSError nor its own `HfHubHTTPError`.
    """
    from huggingface_hub.errors import (
        EntryNotFoundError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(error, RepositoryNotFoundError):
        return "no such dataset repo on the hub (or it is private or gated: set HF_TOKEN to a token that may read it)"
    if isinstance(error, RevisionNotFoundError):
        return f"the repo has no revision {revision!r}" if revision else "the repo has no such revision"
    if isinstance(error, LocalEntryNotFoundError) and error.__cause__ is not None:
        error = error.__cause__  # the hub could not be asked for the file: say why, not the cache's story
    elif isinstance(error, EntryNotFoundError):
        return "no such file in the repo at the pinned commit"
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    first = lines[0] if lines else "no message"
    if isinstance(error, HfHubHTTPError):
        return first
    if isinstance(error, OSError):
        return f"{type(error).__name__}: {first}"
    return f"the hub is unreachable or broke off ({type(error).__name__}: {first})"


class HubUnavailable(SourceUnavailable):
    """A download failed for a reason that may pass (network, server); the preparer retries it."""
