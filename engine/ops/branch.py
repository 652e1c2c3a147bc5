"""Branch a line from a trunk cycle end.

`branch_line(BranchRequest)`: a new line forked from the kept checkpoint at the end of a trunk
cycle. Its run.json is the trunk's at the fork with its own data line, plan and lengths; its
learning rate follows the trunk's schedule up to the fork and, with a `decay` stage in the plan,
decays linearly (or along the stage's shape) to 0 from the start of the first decay stage to the
end of the plan. Its first checkpoint is the fork checkpoint: the weights, optimizer state and
tokenizer hard-linked (copied across file systems), state.json and run.json its own (the update
and tokens trained carry on; stage, data cycle and sample start at 0 on the branch's data line;
no rows yet). The parent's branches.json records the branch, and the branch's first start forks
the parent's W&B run (`engine.wandb.mirror.plan_branch`).

Every check runs before anything is written; each file is replaced atomically. A branch of a
cycle that has not ended yet is checked in full when it is asked for (`check_branch_request`:
against the position the trunk is expected to have at that cycle's end), so that a running
line's supervisor queues only a fork it can make, and `nsconsole branch` names what would stop
the fork rather than only that the cycle has not ended.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datalines
from datalines.consumption import other_training_line, trained_refusal
from engine.atomic import fsync_directory
from engine.checkpoints.format import (
    BRANCH_START_KEPT,
    EXTRA_FILE,
    FORMAT_VERSION,
    META_NAME,
    MODEL_FILE,
    OPTIMIZER_FILE,
    RUN_JSON_FILE,
    STATE_NAME,
    TOKENIZER_FILE,
    checkpoint_name,
    cycle_of_kept,
    json_bytes,
    list_checkpoints,
    no_checkpoint_left_problem,
    read_checkpoint_state,
    resume_candidate,
    update_of,
    verify_checkpoint,
    write_bytes_durably,
    write_latest,
)
from engine.config.host import HostSettings
from engine.config.run import DataConfig, LengthConfig, LRPiece, RunConfig, StageConfig
from engine.errors import LineError
from engine.layout import LineLayout
from engine.models import presets
from engine.ops.branch_data import check_fork_cycle, check_plan_fits
from engine.ops.branch_records import record_branch
from engine.ops.fork_point import check_cycle_comes, expected_fork_position, kept_cycle_ends, latest_position
from engine.ops.lines import (
    failed_writes_said,
    inspect_data_line,
    open_line,
    refuse_an_unwritable_directory,
    resolve_data_path,
)
from engine.training.heldout_rows import heldout_line_path, missing_rows_problem, validation_lengths
from engine.training.schedule import learning_rate, tokens_per_update
from engine.wandb.mirror import plan_branch

LINKED_FILES = (MODEL_FILE, OPTIMIZER_FILE, EXTRA_FILE, TOKENIZER_FILE)
"""Checkpoint files a branch shares with its fork checkpoint (hard links)."""
DECAY_SHAPES = ("linear", "cosine", "sqrt")


# -- plans ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlanItem:
    """One item of a branch's `--plan`: `decay:T[:shape]` or `long:T`."""

    kind: str
    """`decay` (a stage at the training length; the rate decays) or `long` (a stage at the long length)."""
    tokens: float
    """Tokens the stage trains."""
    shape: str = "linear"
    """A decay's shape: linear, cosine or sqrt."""


def parse_plan(text: str) -> list[PlanItem]:
    """`decay:10e9,long:2e9` -> plan items; LineError naming the bad item."""
    items: list[PlanItem] = []
    for raw in text.split(","):
        parts = raw.strip().split(":")
        where = f"--plan: {raw.strip()!r}"
        if (
            parts[0] not in ("decay", "long")
            or len(parts) not in (2, 3)
            or (parts[0] == "long" and len(parts) == 3)
        ):
            raise LineError(f"{where} must be decay:TOKENS[:{'|'.join(DECAY_SHAPES)}] or long:TOKENS")
        try:
            tokens = float(parts[1])
        except ValueError:
            raise LineError(f"{where}: {parts[1]!r} is not a number of tokens") from None
        if not tokens > 0 or tokens != tokens or tokens == float("inf"):
            raise LineError(f"{where}: the tokens must be a positive number, got {parts[1]}")
        shape = parts[2] if len(parts) == 3 else "linear"
        if shape not in DECAY_SHAPES:
            raise LineError(
                f"{where}: the decay shape must be one of {', '.join(DECAY_SHAPES)}, got {shape!r}"
            )
        items.append(PlanItem(parts[0], tokens, shape))
    return items


def sized_plan(plan: list[PlanItem], train_len: int, long_len: int) -> list[PlanItem]:
    """The plan with each stage's tokens rounded up to whole rows of its length: what its trainer
    trains (it ends a stage with the update that reaches its tokens, cut to the rows still needed),
    so run.json, the schedule's decay and the command's output all say the tokens trained."""
    return [dataclasses.replace(item, tokens=float(math.ceil(item.tokens / length) * length))
            for item in plan for length in [long_len if item.kind == "long" else train_len]]  # fmt: skip


def describe_stages(asked: list[PlanItem], stages: list[StageConfig]) -> list[str]:
    """Each stage as the branch trains it, e.g. `decay at 16 for 112 tokens (100 asked, rounded up to
    7 whole rows of 16)`: `asked` is the plan as given, `stages` the branch's run.json plan."""
    described = []
    for item, stage in zip(asked, stages, strict=True):
        tokens = int(stage.tokens or 0)
        text = f"{stage.name} at {stage.seq_len} for {tokens:,} tokens"
        if tokens != item.tokens:
            text += (f" ({item.tokens:,.0f} asked, rounded up to {tokens // stage.seq_len:,} whole rows "
                     f"of {stage.seq_len})")  # fmt: skip
        described.append(text)
    return described


def schedule_to_fork(config: RunConfig, fork_tokens: float) -> list[LRPiece]:
    """The pieces of `config`'s schedule up to `fork_tokens`, the piece in progress closed there.

    A constant or linear piece closed at the fork gives the same rates up to it (its end rate is
    the rate at the fork); a cosine or sqrt decay cut short would not, so a fork inside one is refused.
    """
    pieces: list[LRPiece] = []
    start = 0.0
    for piece in config.lr.pieces:
        end = piece.until_tokens
        if end is not None and end <= fork_tokens:
            pieces.append(dataclasses.replace(piece))
            start = end
            continue
        if fork_tokens <= start:
            break
        if piece.kind == "decay" and piece.shape != "linear":
            raise LineError(
                f"the fork at {fork_tokens:,.0f} tokens falls inside a {piece.shape} decay piece "
                f"({start:,.0f} to {end:,.0f} tokens): the branch cannot continue it exactly"
            )
        fraction = learning_rate(config, fork_tokens) / config.lr.peak
        to = piece.to_fraction if piece.kind == "constant" else fraction
        pieces.append(dataclasses.replace(piece, until_tokens=fork_tokens, to_fraction=to))
        break
    return pieces


def branch_schedule(config: RunConfig, fork_tokens: float, plan: list[PlanItem]) -> list[LRPiece]:
    """The trunk's pieces to the fork, then the fork's rate held, decayed to 0 when the plan has a decay.

    The decay starts where the plan's first decay stage starts and reaches 0 at the plan's end,
    so a long stage after a decay trains on the decay's tail rather than at a rate of 0.
    """
    pieces = schedule_to_fork(config, fork_tokens)
    fraction = learning_rate(config, fork_tokens) / config.lr.peak
    decays = [index for index, item in enumerate(plan) if item.kind == "decay"]
    if not decays:
        return [*pieces, LRPiece("constant", None, fraction)]
    decay_start = fork_tokens + sum(item.tokens for item in plan[: decays[0]])
    plan_end = fork_tokens + sum(item.tokens for item in plan)
    if decay_start > fork_tokens:
        pieces.append(LRPiece("constant", decay_start, fraction))
    pieces.append(LRPiece("decay", plan_end, 0.0, plan[decays[0]].shape))
    return pieces


# -- branch ---------------------------------------------------------------------------------------


@dataclass
class BranchRequest:
    """What `nsconsole branch` asks for."""

    new: Path
    """The branch line's directory (must not exist, or be empty)."""
    parent: Path
    """The line it forks from."""
    at_cycle: int
    """The parent's data cycle whose end is the fork point."""
    plan: str
    """The branch's stages: `decay:T[:shape]` and `long:T`, comma-separated, in order."""
    data: Path
    """The branch's own data line."""
    long_seq_len: int | None = None
    """The length of `long` stages (None: the parent's validation.long_seq_len, else the longest context)."""


@dataclass
class BranchResult:
    """What a branch made."""

    line: Path
    """The branch line."""
    fork_update: int
    """The parent's update the branch continues from (its first checkpoint's number)."""
    fork_tokens: int
    """Tokens the parent had trained at the fork."""
    config: RunConfig
    """The branch's run.json."""
    hard_linked: bool
    """Whether the fork checkpoint's tensors were hard-linked (else copied)."""


class CycleNotEnded(LineError):
    """The trunk's cycle a branch forks at has not ended yet (a running line's supervisor can queue it)."""


WAIT_OR_QUEUE = "branch once it has, or ask the line's supervisor (the console's b key), which forks it then"
"""What a user can do about a branch of a cycle that has not ended (it passed every other check)."""


def find_cycle_end(parent: LineLayout, cycle: int) -> Path:
    """The parent's kept checkpoint at the end of `cycle`; CycleNotEnded when that cycle has not
    ended, LineError when it has but its kept checkpoint is missing.

    Only checkpoints up to the one a start resumes from (`latest`, or where `latest` is damaged or
    names one that is gone, the newest before it) count: those after it were set aside by a
    rollback (retention removes them at the line's next checkpoint) and belong to a history the
    line no longer has.
    """
    resume = resume_candidate(parent.checkpoints)
    resume_update = None if resume is None else update_of(resume)
    for directory in list_checkpoints(parent.checkpoints):
        if resume_update is None or (update_of(directory) or 0) > resume_update:
            break  # oldest first: every later one is past the resume point too
        state = read_checkpoint_state(directory)
        if cycle_of_kept((state or {}).get("kept")) == cycle:
            return directory
    if resume is None:
        if no_checkpoint_left_problem(parent) is not None:
            # The line has trained but no checkpoint of it reads: "no checkpoint yet" (a cycle still
            # to come) would hide the damage.
            names = ", ".join(path.name for path in list_checkpoints(parent.checkpoints)) or "none left"
            raise LineError(
                f"{parent.checkpoints}: no checkpoint with a readable {STATE_NAME} ({names}), though the line "
                "has trained; put its checkpoints back to branch it"
            )
        raise CycleNotEnded(f"{parent.root}: has no checkpoint yet; cycle {cycle} has not ended; {WAIT_OR_QUEUE}")
    state = read_checkpoint_state(resume) or {}
    position = state.get("position", {})
    at = position.get("cycle", 0)
    if at <= cycle:
        raise CycleNotEnded(
            # The newest checkpoint's position, not the trainer's: a running line may be updates past it.
            f"{parent.root}: cycle {cycle} has not ended (its newest checkpoint, {resume.name}, is in cycle {at} "
            f"at update {state.get('update')}); {WAIT_OR_QUEUE}"
        )
    raise LineError(f"{parent.checkpoints}: the kept checkpoint of cycle {cycle}'s end is missing; "
                    f"{kept_cycle_ends(parent)}")


def _resolved(layout: LineLayout, path: str | None) -> str | None:
    return None if path is None else str(resolve_data_path(layout, path).absolute())


def branch_config(
    trunk: RunConfig, trunk_layout: LineLayout, fork_state: dict[str, Any], request: BranchRequest,
    plan: list[PlanItem], train_len: int, long_len: int,
) -> RunConfig:  # fmt: skip
    """The branch's run.json: the trunk's at the fork with the branch's data, plan (sized: `sized_plan`),
    lengths and schedule."""
    fork_tokens = float(fork_state["position"]["tokens_trained"])
    names: dict[str, int] = {}
    stages = []
    for item in plan:
        names[item.kind] = names.get(item.kind, 0) + 1
        name = item.kind if names[item.kind] == 1 else f"{item.kind}{names[item.kind]}"
        stages.append(StageConfig(name, long_len if item.kind == "long" else train_len, item.tokens))
    lengths: list[LengthConfig] = []
    for seq_len in sorted({stage.seq_len for stage in stages}):
        known = [entry for entry in trunk.lengths if entry.seq_len == seq_len]
        lengths.append(dataclasses.replace(known[0]) if known else LengthConfig(seq_len))
    # The batch the trunk trained at the fork: a ramp read on the branch's own data line would restart.
    fork_data_tokens = _fork_data_tokens(trunk, trunk_layout, fork_state)
    config = dataclasses.replace(
        trunk,
        data=DataConfig(str(request.data.absolute()), _resolved(trunk_layout, trunk.data.heldout)),
        lengths=lengths,
        plan=stages,
        tokens_per_update=tokens_per_update(trunk, fork_data_tokens),
        lr=dataclasses.replace(trunk.lr, pieces=branch_schedule(trunk, fork_tokens, plan)),
        allow_changes=[],
    )
    return config


def _fork_data_tokens(trunk: RunConfig, trunk_layout: LineLayout, fork_state: dict[str, Any]) -> float:
    """The trunk's data-line token count at the fork (the start of the cycle after the fork)."""
    data_line = datalines.open_data_line(resolve_data_path(trunk_layout, trunk.data.line))
    return float(data_line.cycle_start_tokens(int(fork_state["position"]["cycle"])))


def _link_or_copy(source: Path, target: Path) -> bool:
    """Hard-link `source` to `target` (True), or copy it where links are impossible (False)."""
    try:
        os.link(source, target)
        return True
    except OSError:
        shutil.copy2(source, target)
        with open(target, "rb+") as handle:
            os.fsync(handle.fileno())
        return False


def write_branch_checkpoint(
    fork: Path, checkpoints_dir: Path, state: dict[str, Any], run_json: bytes
) -> tuple[Path, bool]:
    """The branch's first checkpoint: the fork's tensors linked, its own state.json and run.json, meta.json.

    The linked files' hashes are the fork's meta.json entries (the fork was just verified); the
    new files are hashed here. Returns the directory and whether every link succeeded.
    """
    checkpoints_dir.mkdir(parents=True, exist_ok=True)
    directory = checkpoints_dir / checkpoint_name(int(state["update"]))
    directory.mkdir()
    fork_meta = json.loads((fork / META_NAME).read_text())["files"]
    linked = all([_link_or_copy(fork / name, directory / name) for name in LINKED_FILES])
    files = {name: fork_meta[name] for name in LINKED_FILES}
    for name, data in ((STATE_NAME, json_bytes(state)), (RUN_JSON_FILE, run_json)):
        write_bytes_durably(directory / name, data)
        files[name] = {"blake2b": hashlib.blake2b(data, digest_size=32).hexdigest(), "bytes": len(data)}
    write_bytes_durably(
        directory / META_NAME, json_bytes({"format": FORMAT_VERSION, "files": dict(sorted(files.items()))})
    )
    fsync_directory(directory)
    fsync_directory(checkpoints_dir)
    write_latest(checkpoints_dir, directory.name)
    return directory, linked


def sent_path(text: str, trunk: Path) -> Path:
    """A branch's path as a client sent it to the trunk's supervisor, whose working directory is not
    the client's: a relative one is taken under host.json's `work_root`, else beside the trunk."""
    path = Path(text).expanduser()
    if path.is_absolute():
        return path
    work_root = HostSettings.load().work_root
    base = Path(work_root).expanduser() if work_root else trunk.parent
    return (base / path).absolute()


def checked_request(request: BranchRequest) -> tuple[LineLayout, list[PlanItem]]:
    """The checks that need neither the trunk nor its fork: a free target, a cycle index, a plan."""
    new = LineLayout(request.new.absolute())
    if new.root.exists() and (not new.root.is_dir() or any(new.root.iterdir())):
        raise LineError(f"{new.root}: already exists (a branch is a new line directory)")
    if request.at_cycle < 0:
        raise LineError(f"--at-cycle must be a cycle index (0 or more), got {request.at_cycle}")
    return new, parse_plan(request.plan)


def checked_branch_config(
    trunk: RunConfig, trunk_layout: LineLayout, fork_state: dict[str, Any], request: BranchRequest,
    plan: list[PlanItem], trained_tokenizer: bytes, new: LineLayout,
) -> RunConfig:  # fmt: skip
    """The branch's run.json once everything the fork decides is checked: the long length, the
    branch's data line (there, with the tokenizer the trunk was trained with, `trained_tokenizer`),
    the schedule at the fork, the whole configuration, and the held-out rows its validation reads."""
    position = fork_state["position"]
    train_len = trunk.plan[min(int(position["stage"]), len(trunk.plan) - 1)].seq_len
    long_len = request.long_seq_len or trunk.validation.long_seq_len or _longest_context(trunk)
    if any(item.kind == "long" for item in plan) and long_len <= train_len:
        # Name where the long length came from: a user who gave no --long-seq-len should not be told off for it.
        source = (
            "--long-seq-len" if request.long_seq_len
            else "the trunk's validation.long_seq_len" if trunk.validation.long_seq_len
            else f"the model's context ({trunk.model.preset}; give --long-seq-len)"
        )  # fmt: skip
        raise LineError(f"{source}: the long length must exceed the training length {train_len}, got {long_len}")
    data = inspect_data_line(request.data.absolute())
    owner = other_training_line(data.path, new.root)
    if owner is not None:  # the branch's first start would be refused (one training line per data line)
        raise LineError(trained_refusal(data.path, owner, f"the branch {new.root}"))
    branch_data = datalines.open_data_line(data.path)
    if branch_data.tokenizer_json.encode("utf-8") != trained_tokenizer:
        raise LineError(
            f"{data.path}: its tokenizer differs from the one {trunk_layout.root.name} was trained with"
        )
    config = branch_config(trunk, trunk_layout, fork_state, request, sized_plan(plan, train_len, long_len),
                           train_len, long_len)  # fmt: skip
    config.validate(source=str(new.run_json))
    check_plan_fits(branch_data, config.plan)
    # The branch's trainer refuses to start without them: refused here, before anything is made.
    heldout = datalines.open_data_line(heldout_line_path(new, config))
    problem = missing_rows_problem(heldout, validation_lengths(config, _longest_context(config)))
    if problem is not None:
        raise LineError(problem)
    return config


def check_branch_request(request: BranchRequest) -> RunConfig:
    """Refuse now (LineError, DataLineError) what `branch_line` would refuse at the end of a trunk
    cycle still to come: everything but the fork checkpoint itself, against the trunk's run.json as
    it is and the position it is expected to have at that cycle's end (`engine.ops.fork_point`).
    Returns the branch's run.json as it would be forked there."""
    parent = open_line(request.parent)
    new, plan = checked_request(request)
    trunk = RunConfig.load(parent.run_json)
    trunk_data = datalines.open_data_line(resolve_data_path(parent, trunk.data.line))
    position = latest_position(parent)
    check_fork_cycle(trunk_data, request.at_cycle)
    check_cycle_comes(parent, position, request.at_cycle)
    fork_position = expected_fork_position(parent, trunk, trunk_data, position, request.at_cycle)
    try:
        schedule_to_fork(trunk, fork_position["tokens_trained"])
    except LineError as error:
        raise LineError(
            f"{parent.run_json}: cycle {request.at_cycle} is expected to end at about "
            f"{fork_position['tokens_trained']:,} tokens trained; {error}"
        ) from None
    return checked_branch_config(
        trunk, parent, {"position": fork_position}, request, plan, _trained_tokenizer(parent, trunk_data), new
    )


def preview_branch(request: BranchRequest) -> RunConfig:
    """The branch's run.json as `branch_line` would make it now (at a cycle that has ended) or at the
    cycle's end (`check_branch_request`), refusing what it would refuse; nothing is written and the
    fork checkpoint is not hashed (the console asks this before its confirmation)."""
    parent = open_line(request.parent)
    new, plan = checked_request(request)
    try:
        fork = find_cycle_end(parent, request.at_cycle)
    except CycleNotEnded:
        return check_branch_request(request)
    trunk, fork_state = _fork_inputs(fork)
    trained_tokenizer = (fork / TOKENIZER_FILE).read_bytes()
    return checked_branch_config(trunk, parent, fork_state, request, plan, trained_tokenizer, new)


def _fork_inputs(fork: Path) -> tuple[RunConfig, dict[str, Any]]:
    """The trunk's run.json and state.json as its fork checkpoint saved them."""
    fork_state = read_checkpoint_state(fork)
    if fork_state is None:
        raise LineError(f"{fork / STATE_NAME}: unreadable")
    trunk = RunConfig.from_dict(
        json.loads((fork / RUN_JSON_FILE).read_text()), source=str(fork / RUN_JSON_FILE)
    )
    return trunk, fork_state


def _trained_tokenizer(layout: LineLayout, data_line: datalines.DataLine) -> bytes:
    """The tokenizer the checkpoint a start resumes from carries (a fork checkpoint carries the same
    one); its data line's before the first checkpoint."""
    resume = resume_candidate(layout.checkpoints)
    carried = None if resume is None else resume / TOKENIZER_FILE
    if carried is not None and carried.is_file():
        return carried.read_bytes()
    return data_line.tokenizer_json.encode("utf-8")


def branch_line(request: BranchRequest) -> BranchResult:
    """Fork a branch line (see the module docstring); nothing is written when a check fails."""
    parent = open_line(request.parent)
    new, plan = checked_request(request)
    try:
        fork = find_cycle_end(parent, request.at_cycle)
    except CycleNotEnded:
        check_branch_request(request)  # what would stop the fork is said now, not once the cycle ends
        raise
    # The trunk takes branches.json (and its lock); the branch's directory, or the nearest one
    # above it that exists, takes the branch.
    refuse_an_unwritable_directory(parent.root, "a branch (the trunk's branches.json)")
    made_in = next(directory for directory in (new.root, *new.root.parents) if directory.exists())
    refuse_an_unwritable_directory(made_in, f"a branch ({new.root})")
    verify_checkpoint(fork)
    trunk, fork_state = _fork_inputs(fork)
    position = fork_state["position"]
    trained_tokenizer = (fork / TOKENIZER_FILE).read_bytes()
    config = checked_branch_config(trunk, parent, fork_state, request, plan, trained_tokenizer, new)
    update = int(fork_state["update"])
    state = {
        **{
            key: fork_state[key]
            for key in ("nonfinite_in_a_row", "ema_started", "layout", "preset", "overrides")
        },
        "degree": fork_state.get("degree", 1),  # the ranks that wrote the tensors (one, before the key)
        # The trainer's record of the line's W&B run (`WandbMirror.checkpoint_record`): the branch's
        # run has not begun (its first start forks the parent's); null when W&B is off.
        "wandb": None if config.wandb.mode == "disabled" else {"run_id": None, "acknowledged_step": None},
        "update": update,
        "format": FORMAT_VERSION,
        "code_version": fork_state.get("code_version"),
        "position": {
            "update": update,
            "tokens_trained": int(position["tokens_trained"]),
            "stage": 0,
            "stage_tokens": 0,
            "cycle": 0,
            "sample": 0,
        },  # fmt: skip
        "data": {"manifest_sha256": None, "order_digest": None, "seq_len": None},
        "kept": BRANCH_START_KEPT,
        "rows": 0,
        "rows_bytes": 0,
        "branched_from": {
            "line": str(parent.root.absolute()),
            "checkpoint": fork.name,
            "cycle": request.at_cycle,
        },
    }

    # Built beside its final place and renamed into it: a crash leaves no half-made line.
    building = new.root.with_name(f".{new.root.name}.branching")
    with failed_writes_said("the branch", new.root):  # a full disk, say: one line naming the file
        shutil.rmtree(building, ignore_errors=True)
        building.mkdir(parents=True)
        try:
            built = LineLayout(building)
            _checkpoint, linked = write_branch_checkpoint(
                fork, built.checkpoints, state, config.to_json().encode()
            )
            config.save(built.accepted_run_json)
            config.save(built.run_json)
            plan_branch(building, parent.root, update)
            fsync_directory(building)
            os.replace(building, new.root)  # over an empty directory, or a new name
            fsync_directory(new.root.parent)
        except BaseException:
            shutil.rmtree(building, ignore_errors=True)
            raise
        record_branch(parent, new.root, request, update, int(position["tokens_trained"]))
    return BranchResult(new.root, update, int(position["tokens_trained"]), config, linked)


LONGEST_CONTEXT_FIELDS = ("rope_max_seq_len", "context_len", "chunk_len")
"""The preset fields each family's model takes its `longest_context` from (NS, transformer, PSSA)."""


def _longest_context(config: RunConfig) -> int:
    """The model's longest context read from its preset (building a 2B model to ask it would cost minutes)."""

    preset = presets.preset_config(config.model.preset, config.model.overrides)
    for name in LONGEST_CONTEXT_FIELDS:
        if hasattr(preset, name):
            return int(getattr(preset, name))
    raise LineError(f"--long-seq-len: preset {config.model.preset!r} names no longest context; give one")


# -- rollback -------------------------------------------------------------------------------------


