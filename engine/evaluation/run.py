"""Running harness tasks on a checkpoint: tasks by name (the harness's own, or task YAMLs under
`include_paths`), `lm_eval.simple_evaluate` over the adapter, the results as a table and as JSON.

The harness's own tasks fetch their datasets from the Hugging Face hub; a task YAML whose
`dataset_path` is `json` with `dataset_kwargs: {data_files: ...}` reads a local file and needs no
network (what the tests run). Each task is built, its data read, before any is run: a task whose
data cannot be read (the hub unreachable or offline, a local file missing) or whose YAML has a
mistake (no `dataset_path`, no `task:`, not YAML at all) is refused in one line naming it and its
YAML file.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import lm_eval.tasks
from lm_eval import evaluator as lm_evaluator
from lm_eval import simple_evaluate
from lm_eval.api.group import Group
from lm_eval.api.task import Task
from lm_eval.tasks import TaskManager
from lm_eval.tasks._yaml_loader import load_yaml
from lm_eval.utils import handle_non_serializable, make_table

from engine.atomic import write_text_atomic
from engine.checkpoints.format import code_version
from engine.errors import LineError
from engine.evaluation.harness import CheckpointLM
from engine.generation.loading import checkpoint_directory, refuse_absent_average
from engine.training.trainer import resolve_device

HARNESS_TASKS = Path(lm_eval.tasks.__file__).resolve().parent
"""Where the harness's own task YAMLs are."""


@dataclass(frozen=True)
class EvaluationSettings:
    """What `nsconsole eval` asks of the harness (its options of the same names)."""

    tasks: list[str]
    """Task, group or tag names the harness knows (with `include_paths`), or task YAML files."""
    include_paths: list[Path] = field(default_factory=list)
    """Directories of task YAMLs indexed beside the harness's own tasks."""
    limit: int | None = None
    """At most this many documents of each task (None: all of them)."""
    num_fewshot: int | None = None
    """Examples put before each question (None: each task's own default; a task fixed at 0 keeps 0)."""
    seed: int = 0
    """Seeds the harness's choice of few-shot examples (and Python's, numpy's and torch's generators)."""


def check_source(source: Path, device: str, average: bool = False) -> None:
    """LineError when `source` names no checkpoint, `device` is not here or (with `average`) the
    checkpoint keeps no parameter average: said before the tasks are read and the checkpoint
    loads, at no cost."""
    directory = checkpoint_directory(source)
    resolve_device(device, "--device")
    if average:
        refuse_absent_average(directory, "eval")


def task_manager(include_paths: list[Path]) -> TaskManager:
    """The harness's task index with the directories of local task YAMLs added."""
    for path in include_paths:
        if not path.is_dir():
            raise LineError(f"{path}: --include-path must be a directory of task YAML files")
    return TaskManager(include_path=[str(path) for path in include_paths] or None)


def unknown_tasks(manager: TaskManager, tasks: list[str]) -> list[str]:
    """The names that are neither a known task, group or tag nor a YAML file."""
    known = set(manager.all_tasks)
    return [task for task in tasks if task not in known and not Path(task).is_file()]


def unreadable_task_files(include_paths: list[Path]) -> list[str]:
    """`FILE (problem)` for each YAML under the include paths that defines no task: the harness
    skips a file it cannot parse, or whose keys name no task, group or task class, without a
    word, so a task of yours with a mistake in its YAML would be only `no task named ...`."""
    problems = []
    for root in include_paths:
        for path in sorted(root.glob("**/*.yaml")):
            problem = task_yaml_problem(path)
            if problem is not None:
                problems.append(f"{path} ({problem})")
    return problems


def task_yaml_problem(path: Path) -> str | None:
    """Why the harness cannot take `path` as a task YAML (None when it can): it does not parse as
    YAML (its `include`s merged, as the harness reads it), or its keys name no task, group or task
    class."""
    try:
        config = load_yaml(path, resolve_func=False)
    except Exception as error:  # yaml's errors, an `include` that is missing, not a mapping, ...
        return one_line(error)
    if not {"task", "group", "class"} & set(config):
        return "no `task:` key names its task"
    return None


def check_task_files(tasks: list[str]) -> None:
    """LineError naming the first task YAML file named in `--tasks` that the harness cannot read:
    said from that one file, before the task index (seconds: every task of the harness's) is read."""
    for task in tasks:
        path = Path(task)
        if path.suffix in (".yaml", ".yml") and path.is_file():
            problem = task_yaml_problem(path)
            if problem is not None:
                raise LineError(f"{path}: not a task YAML the harness can read ({problem})")


def one_line(error: BaseException) -> str:
    """`Type: message` with the message's white space collapsed (the type alone when it has none)."""
    message = " ".join(str(error).split())
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def root_cause(error: BaseException) -> BaseException:
    """The exception at the bottom of `error`'s chain (what `datasets` wraps in `An error occurred
    while generating the dataset`: a line of a JSONL file that is not JSON)."""
    while True:
        cause = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
        if cause is None:
            return error
        error = cause


def load_tasks(manager: TaskManager, names: list[str]) -> list[Task | Group]:
    """The named tasks, groups and tags built, their datasets read (downloaded, or from the cache
    or a local file); LineError naming the first whose data cannot be read or that cannot be built.

    One name at a time, so that the error can name it (the harness's own says only the dataset).
    """
    built: list[Task | Group] = []
    for name in names:
        try:
            loaded = manager.load([name])
        except OSError as error:  # ConnectionError (the hub), FileNotFoundError (a local file), ...
            raise LineError(data_refusal(manager, name, error)) from error
        except Exception as error:  # a task YAML's mistake (a field, a template, a split, a file's format)
            raise LineError(task_refusal(manager, name, error)) from error
        # What the name stands for: a group (the groups in it are its children), else its tasks
        # (one task, or a tag's).
        children = {child for child_names in loaded["group_map"].values() for child in child_names}
        groups = [group for group_name, group in loaded["groups"].items() if group_name not in children]
        built += groups or list(loaded["tasks"].values())
    return built


def task_yaml(manager: TaskManager, name: str) -> Path | None:
    """The YAML file that defines task or group `name` (a name of the index, or a YAML file named
    in `--tasks`); None for a tag (its tasks' YAMLs are many) or a task defined in Python alone."""
    entry = manager.task_index.get(name)
    if entry is not None:
        return entry.yaml_path
    return Path(name).resolve()


def own_task_yaml(manager: TaskManager, name: str) -> Path | None:
    """`task_yaml` when it is a YAML of the user's (under --include-path, or a file named in
    --tasks), not one of the harness's own tasks."""
    path = task_yaml(manager, name)
    return None if path is None or path.resolve().is_relative_to(HARNESS_TASKS) else path


def data_refusal(manager: TaskManager, name: str, error: OSError) -> str:
    """The one line for a task whose data could not be read: what `datasets` said, and where the
    data is named: the harness's own tasks name datasets of the hub, a YAML of yours names its own."""
    cause = " ".join(str(error).split()) or type(error).__name__
    yaml = own_task_yaml(manager, name)
    if yaml is None:
        where = ("the harness's own tasks download their datasets from the Hugging Face hub (HF_ENDPOINT names a "
                 "mirror), a task YAML of yours under --include-path may read a local file offline")  # fmt: skip
    elif isinstance(error, ConnectionError):  # the hub unreachable, or offline with a dataset not cached
        where = (f"{yaml} names a dataset of the Hugging Face hub (HF_ENDPOINT names a mirror); `dataset_path: json` "
                 "with `dataset_kwargs: {data_files: ...}` reads a local file offline")  # fmt: skip
    else:
        # `datasets` reads a relative path from where the command runs, not beside the YAML.
        where = f"{yaml} names it (a relative dataset_path or data_files is read from the current directory, {Path.cwd()})"
    return f"task {name}: its data could not be read: {cause}; {where}"


def task_refusal(manager: TaskManager, name: str, error: Exception) -> str:
    """The one line for a task the harness could not build: the task, its YAML, the error (and
    what lies under it), where the harness's own would be a traceback."""
    where = task_yaml(manager, name)
    built_from = "" if where is None else f" from {where}"
    if where is not None and names_no_dataset(where):
        # The harness hands `datasets` a dataset_path of None (or ""): `TypeError: expected str, bytes
        # or os.PathLike object, not NoneType`, which says nothing of the YAML.
        return (f"task {name}: cannot be built{built_from}: it names no `dataset_path` (a dataset of the Hugging Face "
                "hub, or `json` with `dataset_kwargs: {data_files: ...}` for a local file)")  # fmt: skip
    root = root_cause(error)
    under = "" if root is error else f" (from {one_line(root)})"
    return f"task {name}: cannot be built{built_from}: {one_line(error)}{under}"


def names_no_dataset(path: Path) -> bool:
    """Whether the task YAML at `path` (its `include`s merged) leaves the harness no dataset to
    read: a task of the harness's YAML class (not a group, nor a Python class of its own) with no
    `dataset_path` and no `custom_dataset` function."""
    try:
        config = load_yaml(path, resolve_func=False)
    except Exception:  # what the harness could not read is said by its own error
        return False
    is_yaml_task = "task" in config and not {"group", "class"} & set(config)
    return is_yaml_task and not config.get("dataset_path") and not config.get("custom_dataset")


@dataclass(frozen=True)
class PreparedTasks:
    """The tasks `nsconsole eval` names, built with their data read: what is checked before the
    checkpoint loads (a typo in a task name costs no minutes of loading a large model)."""

    manager: TaskManager
    """The task index, the directories of local task YAMLs included."""
    tasks: list[Task | Group]
    """The named tasks, groups and tags, built."""


def prepare_tasks(settings: EvaluationSettings) -> PreparedTasks:
    """`settings.tasks` built, their data read; LineError when none is named, one is unknown or its
    data cannot be read."""
    if not settings.tasks:
        raise LineError("--tasks names no task")
    check_task_files(settings.tasks)  # one file each: before the task index, which takes seconds
    # Reading a task's data draws `datasets`' progress bars ("Generating test split") on stderr,
    # before a refusal that is to be one line; the harness's own bars over the requests stay.
    datasets.disable_progress_bars()
    manager = task_manager(settings.include_paths)
    unknown = unknown_tasks(manager, settings.tasks)
    if unknown:
        where = ", ".join(str(path) for path in settings.include_paths) or "no --include-path"
        skipped = unreadable_task_files(settings.include_paths)
        unread = f"; the harness skipped {', '.join(skipped)}" if skipped else ""
        raise LineError(
            f"no task named {', '.join(unknown)} (neither the harness's nor a YAML file; task YAMLs "
            f"searched under {where}){unread}; `lm-eval ls tasks` lists the harness's tasks"
        )
    return PreparedTasks(manager, load_tasks(manager, settings.tasks))


def evaluate(
    adapter: CheckpointLM, settings: EvaluationSettings, prepared: PreparedTasks | None = None
) -> dict[str, Any]:
    """The harness's results of `settings.tasks` (as `prepare_tasks` built them, unless `prepared`
    already holds them) on the adapter's checkpoint."""
    prepared = prepare_tasks(settings) if prepared is None else prepared
    with _code_version_as_git_hash():
        results = simple_evaluate(
            model=adapter,
            tasks=prepared.tasks,
            limit=settings.limit,
            num_fewshot=settings.num_fewshot,
            task_manager=prepared.manager,
            log_samples=False,
            random_seed=settings.seed,
            numpy_random_seed=settings.seed,
            torch_random_seed=settings.seed,
            fewshot_random_seed=settings.seed,
            # Recorded in the results' `config` only (the adapter is built already).
            batch_size=adapter.batch_rows,
            device=str(adapter.loaded.device),
        )
    assert results is not None  # one process: rank 0 always gets its results
    return results


@contextmanager
def _code_version_as_git_hash() -> Iterator[None]:
    """The harness records `git describe` run in the current directory as its results' `git_hash`:
    outside a git checkout git prints `fatal: not a git repository` on the terminal, and inside one
    it records whatever repository the user stands in. This code's version is what was run."""
    original = lm_evaluator.get_git_commit_hash
    lm_evaluator.get_git_commit_hash = code_version
    try:
        yield
    finally:
        lm_evaluator.get_git_commit_hash = original


def results_table(results: dict[str, Any]) -> str:
    """The harness's tables: one row per task and metric, then one per group when there are groups."""
    table = make_table(results)
    if results.get("groups"):
        table += "\n" + make_table(results, "groups")
    return table


def check_output(path: Path, force: bool = False) -> None:
    """LineError (one line) when the results could not be written to `path`, or (without `force`)
    would replace a file there, such as an earlier evaluation's results: said before the
    evaluation runs (it may take hours), not after it with its results lost. Directories that do
    not exist yet are made when the results are written; the nearest one that exists must take a
    new file (a probe is made and removed: access bits do not tell for root or for /proc)."""
    if path.is_dir():
        raise LineError(f"{path}: --output is a directory; name the file to write the results to")
    if os.path.lexists(path) and not path.is_file():
        raise LineError(f"{path}: --output is not a regular file")
    if path.is_file() and not force:
        raise LineError(f"{path}: --output already exists; name another file, or give --force to replace it")
    if path.is_file() and not os.access(path, os.W_OK):
        raise LineError(f"{path}: --output is not writable")
    directory = _nearest_existing(path.parent)
    if not directory.is_dir():
        raise LineError(f"{path}: --output's directory cannot be made: {directory} is not a directory")
    try:
        descriptor, probe = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".probe", dir=directory)
    except OSError as error:
        raise LineError(f"{path}: --output cannot be written in {directory} ({error.strerror})") from None
    os.close(descriptor)
    os.unlink(probe)


def _nearest_existing(directory: Path) -> Path:
    """`directory`, or its nearest ancestor that exists (`write_results` makes the rest)."""
    while not os.path.lexists(directory) and directory != directory.parent:
        directory = directory.parent
    return directory


def write_results(results: dict[str, Any], path: Path) -> None:
    """The results as JSON, written whole or not at all (values JSON cannot hold as their text)."""
    text = json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, text + "\n")
