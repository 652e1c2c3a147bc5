"""`nsconsole eval` given a task YAML of one's own with a mistake, as a user writes one: each is
refused in one line naming the YAML file and what is wrong, before the checkpoint loads (and, for a
YAML file named in --tasks that the harness cannot read, before the harness's task index is read).

Each case ran to the harness's own words before its fix: `TypeError: expected str, bytes or
os.PathLike object, not NoneType` for a YAML without `dataset_path`, `Unknown config shape: keys=[...]`
for one without `task:`, and for data that could not be read a hint about the harness's own tasks
that named no YAML.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.harness_index import harness_index_once  # noqa: F401 (a fixture)
from helpers.lines import data_template_fixture, trained_line_fixture

from engine.evaluation import harness, run
from nsconsole.cli import main

pytestmark = pytest.mark.usefixtures("one_thread", "harness_index_once")

data_template = data_template_fixture(prepare=1)
line = trained_line_fixture()

DOCUMENTS = [
    {"question": "the model trains on", "choices": ["tokens", "spikes"], "answer": 0},
    {"question": "spikes flow through", "choices": ["layers", "a cycle"], "answer": 0},
]

NO_DATASET = ("it names no `dataset_path` (a dataset of the Hugging Face hub, or `json` with "
              "`dataset_kwargs: {data_files: ...}` for a local file)")  # fmt: skip


@pytest.fixture
def unloadable_checkpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    """A task that cannot run is refused before the checkpoint loads (minutes for a large one)."""

    def unloadable(*arguments: object, **options: object) -> None:
        raise AssertionError("the checkpoint was loaded before the tasks were checked")

    monkeypatch.setattr(harness, "open_checkpoint", unloadable)


def task_yaml(directory: Path, name: str, dataset: str) -> Path:
    """A multiple-choice task YAML `directory/name.yaml` whose data is named by the lines `dataset`."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.yaml"
    path.write_text(f"task: {name}\n{dataset}test_split: test\noutput_type: multiple_choice\n"
                    'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: answer\n')  # fmt: skip
    return path


def local_data(data: Path) -> str:
    """The YAML lines of a dataset read from the local JSONL file `data`."""
    return f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"


@pytest.mark.slow  # the task index is read before the task is built
@pytest.mark.parametrize("dataset_path", ["", "dataset_path: ''\n"], ids=["absent", "empty"])
def test_a_task_yaml_without_a_dataset_path_is_refused_naming_it(
    line: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    unloadable_checkpoint: None,
    dataset_path: str,
) -> None:
    # Was `task nsc_nopath: cannot be built from FILE: TypeError: expected str, bytes or os.PathLike
    # object, not NoneType` (`IndexError: list index out of range` for an empty one).
    yaml = task_yaml(tmp_path / "tasks", "nsc_nopath", dataset_path)
    status = main(
        ["eval", str(line), "--tasks", "nsc_nopath", "--include-path", str(yaml.parent), "--device", "cpu"]
    )
    captured = capsys.readouterr()
    assert (status, captured.out) == (2, "")
    assert captured.err == f"nsconsole: task nsc_nopath: cannot be built from {yaml}: {NO_DATASET}\n"


@pytest.mark.slow  # the task index is read before the task is built
def test_a_task_yaml_file_without_a_dataset_path_is_refused_naming_it(
    line: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], unloadable_checkpoint: None
) -> None:
    yaml = task_yaml(tmp_path, "nsc_nopath", "")
    status = main(["eval", str(line), "--tasks", str(yaml), "--device", "cpu"])
    captured = capsys.readouterr()
    assert (status, captured.out) == (2, "")
    assert captured.err == f"nsconsole: task {yaml}: cannot be built from {yaml}: {NO_DATASET}\n"


@pytest.mark.slow  # the task index is read before the task is built
def test_a_task_yaml_whose_data_file_is_missing_is_refused_naming_it(
    line: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], unloadable_checkpoint: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    # Was `...; the harness's own tasks download their datasets from the Hugging Face hub (...), a task
    # YAML of yours under --include-path may read a local file offline`: no word of which YAML.
    monkeypatch.chdir(tmp_path)  # where `datasets` reads a relative path from
    missing = tmp_path / "gone.jsonl"
    yaml = task_yaml(tmp_path / "tasks", "nsc_missing", local_data(missing))
    status = main(
        ["eval", str(line), "--tasks", "nsc_missing", "--include-path", str(yaml.parent), "--device", "cpu"]
    )
    captured = capsys.readouterr()
    assert (status, captured.out) == (2, "")
    assert captured.err == (f"nsconsole: task nsc_missing: its data could not be read: Unable to find '{missing}'; "
                            f"{yaml} names it (a relative dataset_path or data_files is read from the current "
                            f"directory, {tmp_path})\n")  # fmt: skip


@pytest.mark.slow  # a fresh process: torch and the task index load first
def test_a_task_yaml_whose_hub_dataset_cannot_be_read_offline_is_refused_naming_it(
    line: Path, tmp_path: Path
) -> None:
    # Was the same hint about the harness's own tasks as for hellaswag, naming no YAML.
    yaml = task_yaml(tmp_path / "tasks", "nsc_hub", "dataset_path: nsconsole-tests/no_such_dataset\n")
    environment = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
                   "PYTHONPATH": os.pathsep.join(sys.path)}  # fmt: skip
    completed = subprocess.run(
        [sys.executable, "-m", "nsconsole", "eval", str(line), "--tasks", "nsc_hub", "--include-path", str(yaml.parent),
         "--device", "cpu"], env=environment, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert (completed.returncode, completed.stdout) == (2, ""), completed.stderr
    assert completed.stderr == (
        "nsconsole: task nsc_hub: its data could not be read: Couldn't reach 'nsconsole-tests/no_such_dataset' on the "
        f"Hub (OfflineModeIsEnabled); {yaml} names a dataset of the Hugging Face hub (HF_ENDPOINT names a mirror); "
        "`dataset_path: json` with `dataset_kwargs: {data_files: ...}` reads a local file offline\n"
    )


@pytest.mark.parametrize(
    ("mistake", "problem"),
    [
        ("yaml", 'ScannerError: mapping values are not allowed in this context in "{yaml}", line 6, column 17'),
        ("task", "no `task:` key names its task"),
        ("include", "FileNotFoundError: [Errno 2] No such file or directory: '{tmp_path}/base.yaml'"),
    ],
    ids=["not-yaml", "no-task", "missing-include"],
)  # fmt: skip
def test_a_task_yaml_file_the_harness_cannot_read_is_refused_before_the_task_index(
    line: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    unloadable_checkpoint: None, mistake: str, problem: str,
) -> None:  # fmt: skip
    # Was `task FILE: cannot be built from FILE: ...` after the harness's whole task index was read
    # (seconds), and for a YAML without `task:` the harness's `ValueError: Unknown config shape: keys=[...]`.
    def unindexed(*arguments: object) -> None:
        raise AssertionError("the task index was read before the task YAML was checked")

    monkeypatch.setattr(run, "task_manager", unindexed)
    yaml = task_yaml(tmp_path, "nsc_mistake", local_data(tmp_path / "choice.jsonl"))
    text = yaml.read_text()
    yaml.write_text({
        "yaml": text.replace("test_split: test", "test_split: test: ["),
        "task": text.replace("task: nsc_mistake\n", ""),
        "include": "include: base.yaml\n" + text,
    }[mistake])  # fmt: skip
    status = main(["eval", str(line), "--tasks", str(yaml), "--device", "cpu"])
    captured = capsys.readouterr()
    assert (status, captured.out) == (2, "")
    refusal = f"{yaml}: not a task YAML the harness can read ({problem.format(yaml=yaml, tmp_path=tmp_path)})"
    assert captured.err == f"nsconsole: {refusal}\n"


@pytest.mark.slow  # the task index is read before the names are checked against it
def test_a_task_yaml_without_a_task_key_under_include_path_is_named_in_the_refusal(
    line: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], unloadable_checkpoint: None
) -> None:
    # The harness skips it without a word; the refusal of its name says why (as before this change,
    # whose check of a YAML file named in --tasks shares the reading of it).
    yaml = task_yaml(tmp_path / "tasks", "nsc_untitled", local_data(tmp_path / "choice.jsonl"))
    yaml.write_text(yaml.read_text().replace("task: nsc_untitled\n", ""))
    status = main(
        ["eval", str(line), "--tasks", "nsc_untitled", "--include-path", str(yaml.parent), "--device", "cpu"]
    )
    captured = capsys.readouterr()
    assert (status, captured.out) == (2, "")
    assert captured.err == (f"nsconsole: no task named nsc_untitled (neither the harness's nor a YAML file; task YAMLs "
                            f"searched under {yaml.parent}); the harness skipped {yaml} (no `task:` key names its "
                            "task); `lm-eval ls tasks` lists the harness's tasks\n")  # fmt: skip


@pytest.mark.slow  # the task index is read before the task is built
def test_a_good_task_yaml_still_runs(line: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The checks above refuse only what the harness cannot run.
    data = tmp_path / "choice.jsonl"
    data.write_text("".join(json.dumps(document) + "\n" for document in DOCUMENTS))
    yaml = task_yaml(tmp_path, "nsc_good", local_data(data))
    status = main(["eval", str(line), "--tasks", str(yaml), "--device", "cpu"])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    assert "|nsc_good|" in captured.out.replace(" ", "")
