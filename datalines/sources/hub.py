"""A hub source: a dataset repo on the Hugging Face hub, pinned to a commit sha at init.

The revision the recipe names (a branch, tag or sha) is resolved once, at init, to its commit
sha; the file list and every download use that sha, so a later push to the repo changes
nothing in the line. Each file is pinned by its LFS sha256 (or, for a small non-LFS file, the
sha256 of its bytes taken at init). Files are downloaded into `<line>/downloads/<source>/` and
deleted once every cycle that reads them is prepared. The endpoint is `HF_ENDPOINT` read at call
time (so tests and mirrors can set it), otherwise the public hub.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from datalines.errors import DataLineError
from datalines.files import sha256_file
from datalines.sources.base import Source, SourceFile, matches, stratum_of

DEFAULT_INCLUDE = ("**/*.parquet",)
DOWNLOADS_DIRECTORY = "downloads"


def hub_endpoint() -> str | None:
    return os.environ.get("HF_ENDPOINT") or None


class HubSource(Source):
    def _api(self) -> Any:
        from huggingface_hub import HfApi

        return HfApi(endpoint=hub_endpoint())

    def take_pins(self) -> dict[str, Any]:
        from huggingface_hub.errors import HfHubHTTPError
        from huggingface_hub.hf_api import RepoFile

        repo = self.spec.location
        api = self._api()
        try:
            commit = api.dataset_info(repo, revision=self.spec.revision).sha
            entries = list(api.list_repo_tree(repo, repo_type="dataset", revision=commit, recursive=True))
        except (HfHubHTTPError, OSError) as error:
            where = f"source {self.spec.name}: hub dataset {repo}@{self.spec.revision}"
            raise DataLineError(f"{where}: {error}") from None
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
        from huggingface_hub.errors import HfHubHTTPError

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
        except (HfHubHTTPError, OSError, ValueError) as error:
            message = f"source {self.spec.name}: download of {file.path} failed: {error}"
            raise HubUnavailable(message) from None


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
        """Delete the downloaded copy: every document of the file is in a prepared cycle already."""
        (self.download_dir() / file.path).unlink(missing_ok=True)


class HubUnavailable(OSError):
    """A download failed for a reason that may pass (network, server); the preparer retries it."""
