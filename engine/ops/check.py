"""The start checks that need no GPU (`nsconsole check LINE`; the trainer runs them at every start).

`check_line` returns one `CheckResult` per check; run.json itself being unreadable or invalid is
raised as a ConfigError, since nothing else can be checked without it.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

import datalines
from datalines import open_data_line
from datalines.errors import DataLineError
from engine.checkpoints.disk_budget import checkpoints_bytes, gib_text, next_checkpoint_size, retention_need
from engine.checkpoints.format import (
    CHECKPOINT_DISK_MARGIN,
    checked_line_checkpoints,
    no_checkpoint_left_problem,
    read_checkpoint_state,
    sized_resume_point,
)
from engine.config.run import LRPiece, RunConfig, stage_length_change
from engine.errors import ConfigError, LineError
from engine.gpu.devices import gpu_snapshot
from engine.gpu.placement import PlacementError, device_finding, gpu_candidates
from engine.gpu.sharing import unshareable_lengths_problem
from engine.layout import LineLayout, checkpoint_update
from engine.metrics import METRICS_VERSION, metrics_mismatch
from engine.models.build import build_model, checked_config, cpu_memory, line_memory_estimate
from engine.models.memory_budget import memory_problem
from engine.models.presets import family_of
from engine.models.pssa.config import STATE_SHAPING, changed_state_setting
from engine.ops.cycle_check import current_cycle_finding
from engine.ops.lines import (
    inspect_data_line,
    load_accepted,
    model_vocab_size,
    open_line,
    resolve_data_path,
    unaccepted_changes,
)
from engine.ops.rollback import rows_remedy
from engine.rows import rows_problem
from engine.training.optim import flat_layout, segment_layout
from engine.units import GIB


@dataclass
class CheckResult:
    """The outcome of one start check."""

    ok: bool
    """Whether the check passed."""
    message: str
    """One line: what was checked and found (names the file on a failure)."""
    warning: bool = False
    """Passed, but with something to act on before it bites (e.g. checkpoints outgrowing the disk)."""


def check_line(root: Path | str, *, verify_checkpoints: bool = True) -> tuple[RunConfig, list[CheckResult]]:
    """Run every start check that needs no GPU; a bad run.json raises ConfigError.

    `verify_checkpoints=False` (`nsconsole run`, before it starts a line) leaves out hashing every
    checkpoint: the trainer's start skips a bad one and discards an interrupted write itself.

    The checks that read the line's position read it from the checkpoint a start resumes from, as
    the start chooses it: over the hashes (the start's own check) when they are verified, else over
    the files' sizes.
    """
    layout = open_line(root)
    config = RunConfig.load(layout.run_json)
    if verify_checkpoints:
        checkpoint_problems, resumed = checked_line_checkpoints(layout.root)
    else:
        resumed = sized_resume_point(layout.checkpoints)[0]
    stages = ", ".join(f"{stage.name}@{stage.seq_len}" for stage in config.plan)
    results = [CheckResult(True, f"run.json: valid ({config.model.preset}; plan {stages})")]
    results += _check_data(layout, config, resumed)
    results += _check_consumption(layout, config, resumed)
    # The checks of the default start, `nsconsole run`: under the supervisor, whose preparer rebuilds shards.
    cycle = current_cycle_finding(layout, config, resumed, preparer_rebuilds=True)
    results.append(CheckResult(cycle.passed, cycle.message, warning=cycle.warning))
    model = _meta_model(config)
    results.append(_check_heldout_rows(layout, config, model))
    results += _check_long_probe(config, model)
    results += _check_lifelong(layout, config, resumed)
    results.append(_check_model_against_checkpoint(resumed, config, model))
    results.append(_check_metrics(config))
    results.append(CheckResult(*device_finding(config.device, gpu_snapshot(), degree=config.parallel.degree)))
    results += _check_parallel(config)
    results += _check_sharing(layout, config)
    results.append(_check_memory(config, model))
    results += disk_results(layout, config, model, resumed)
    results += warmup_results(layout, config)
    if verify_checkpoints:
        results += _check_checkpoints(layout, checkpoint_problems)
    results.append(_check_rows(layout, resumed))
    return config, results


def _check_data(layout: LineLayout, config: RunConfig, resumed: Path | None) -> list[CheckResult]:
    results: list[CheckResult] = []
    lines = [("data line", config.data.line)]
    if config.data.heldout is not None:
        lines.append(("held-out line", config.data.heldout))
    for label, data_line in lines:
        path = resolve_data_path(layout, data_line)
        try:
            facts = inspect_data_line(path)
        except (LineError, DataLineError) as error:
            results.append(CheckResult(False, f"{label}: {error}"))
            continue
        model_vocab = model_vocab_size(config)
        if facts.vocab_size != model_vocab:
            results.append(
                CheckResult(
                    False,
                    f"{label}: {path} has a tokenizer of {facts.vocab_size} tokens but the model's "
                    f"vocab_size is {model_vocab} (set model.overrides.vocab_size to {facts.vocab_size})",
                )
            )
        elif not 0 <= facts.eos_id < model_vocab:
            problem = f"eos_id {facts.eos_id} is outside the vocabulary"
            results.append(CheckResult(False, f"{label}: {path} {problem}"))
        else:
            results.append(
                CheckResult(True, f"{label}: {path} (vocab {facts.vocab_size} = model's, eos {facts.eos_id})")
            )
        if label == "data line":
            results += _check_pinned_files(path, resumed)
    return results


def _check_pinned_files(path: Path, resumed: Path | None) -> list[CheckResult]:
    """The data line's source files read in place as init pinned them (a stat each; one is hashed
    only when its modification time moved): per changed file, a failure when the cycle the line
    trains next still has to be prepared from it (the line would wait for it for good), else a
    warning (the preparer stops at a later cycle, or only a rebuild would fail)."""
    from datalines.pinned_files import files_read_in_place, pinned_file_findings

    try:
        line = open_data_line(path)
    except (LineError, DataLineError):
        return []  # the data line's own check says what is wrong with it
    try:
        findings = pinned_file_findings(line, _next_cycle(resumed))
    except DataLineError as error:
        return [CheckResult(False, f"data files: {error}")]
    if findings:
        return [CheckResult(not finding.fails, f"data files: {finding.message}", warning=not finding.fails)
                for finding in findings]  # fmt: skip
    count = files_read_in_place(line)
    if not count:
        return []
    files = "the 1 file its sources read in place is" if count == 1 else f"the {count} files its sources read in place are"
    return [CheckResult(True, f"data files: {files} as init pinned them")]


def _next_cycle(resumed: Path | None) -> int:
    """The data cycle the line trains next: that of `resumed`, the checkpoint it resumes from (cycle
    0 before any)."""
    state = None if resumed is None else read_checkpoint_state(resumed)
    position = state.get("position") if state is not None else None
    return int(position.get("cycle", 0)) if isinstance(position, dict) else 0


def _check_consumption(layout: LineLayout, config: RunConfig, resumed: Path | None) -> list[CheckResult]:
    """No other line trains on the data line, and the cycle the line reads next was not consumed by
    another line (the trainer refuses either)."""
    from datalines.consumption import consumed_refusal, consumer_of

    data = resolve_data_path(layout, config.data.line)
    cycle = _next_cycle(resumed)
    consumer = consumer_of(data, cycle)
    root = str(layout.root.absolute())
    if consumer is None or (consumer.line is not None and Path(consumer.line) == layout.root.absolute()):
        consumption = CheckResult(True, f"data consumption: cycle {cycle}, the next this line reads, is not another line's")
    else:
        consumption = CheckResult(False, consumed_refusal(data, {cycle: consumer}, root))
    return [_check_training_line(layout, data), consumption]


def _check_training_line(layout: LineLayout, data: Path) -> CheckResult:
    """The data line is this line's to train on: no other line that still trains on it started on
    it first (`datalines.consumption.claim_data_line`, the trainer's start, refuses it)."""
    from datalines.consumption import other_training_line, trained_refusal, training_line_of

    root = layout.root.absolute()
    try:
        owner, recorded = other_training_line(data, root), training_line_of(data)
    except DataLineError as error:
        return CheckResult(False, f"data owner: {error}")
    if owner is not None:
        return CheckResult(False, trained_refusal(data, owner, str(root)))
    if recorded is None:
        return CheckResult(True, f"data owner: no line trains on {data} yet; this line's first start takes it")
    if recorded.resolve() == root.resolve():
        return CheckResult(True, f"data owner: this line trains on {data}")
    gone = f"data owner: {recorded}, the line that trained on {data}, no longer does; this line's start takes it over"
    return CheckResult(True, gone)


def _meta_model(config: RunConfig) -> torch.nn.Module:
    """The line's model on the meta device: its shapes and size without its memory."""
    with torch.device("meta"):
        return build_model(config.model.preset, config.model.overrides)


def _check_heldout_rows(layout: LineLayout, config: RunConfig, model: torch.nn.Module) -> CheckResult:
    """The rows every validation length reads exist (the trainer refuses to start without them)."""
    from engine.training.heldout_rows import heldout_line_path, missing_rows_problem, validation_lengths

    try:
        heldout = open_data_line(heldout_line_path(layout, config))
    except (LineError, DataLineError) as error:
        return CheckResult(False, f"held-out rows: {error}")
    lengths = validation_lengths(config, model.longest_context)
    problem = missing_rows_problem(heldout, lengths)
    if problem is not None:
        return CheckResult(False, problem)
    return CheckResult(True, f"held-out rows: built for lengths {', '.join(map(str, lengths))}")


def _check_long_probe(config: RunConfig, model: torch.nn.Module) -> list[CheckResult]:
    """A warning when `validation.long_seq_len` is set but exceeds no stage's length: the long-row
    probe runs only at a stage it exceeds (`engine.training.validation.long_seq_len`), so the line
    would train with no long probe and nothing would say so. A warning, not a refusal: a branch
    inherits its trunk's long length, and one whose stages all train at it has no longer rows to probe."""
    long = config.validation.long_seq_len
    lengths = sorted({stage.seq_len for stage in config.plan})
    if long is None or long > lengths[0]:
        return []
    if len(lengths) == 1:
        trained, above = f"the training length {lengths[0]}", f"above {lengths[0]}"
    else:
        trained = f"any stage's length ({', '.join(map(str, lengths))})"
        above = f"above {lengths[0]} (above {lengths[-1]} to probe every stage)"
    # null reads the model's longest context: offered only where that would probe.
    context = int(getattr(model, "longest_context", 0))
    null = f", or to null for the model's longest context ({context})" if context > lengths[0] else ""
    return [CheckResult(True, f"validation.long_seq_len: {long} is not above {trained}, so the long-row "
                              f"probe never runs; set it {above}{null}", warning=True)]  # fmt: skip


def stage_length_refusal(layout: LineLayout, config: RunConfig, resumed: Path | None) -> str | None:
    """One line when run.json changes the `seq_len` of the stage the line's checkpoint stands in
    (`engine.config.run.stage_length_change`), else None: `check` reports it and every start of the
    trainer refuses on it, as on a lifelong key. A checkpoint or accepted_run.json that cannot be
    read says nothing here: their own checks report them. `resumed`: the checkpoint the line resumes
    from."""
    state = None if resumed is None else read_checkpoint_state(resumed)
    if state is None:
        return None
    try:
        position, data = state["position"], state.get("data") or {}
        stage, stage_tokens, sample = int(position["stage"]), int(position["stage_tokens"]), int(position["sample"])
        read_at = None if data.get("seq_len") is None else int(data["seq_len"])
        accepted = load_accepted(layout)
    except (TypeError, KeyError, ValueError, LineError):
        return None
    problem = stage_length_change(config, accepted, stage, stage_tokens, sample, read_at)
    return None if problem is None else f"{layout.run_json.name}: {problem}"


def _check_lifelong(layout: LineLayout, config: RunConfig, resumed: Path | None) -> list[CheckResult]:
    refusals = unaccepted_changes(layout, config) if layout.accepted_run_json.exists() else []
    stage_change = stage_length_refusal(layout, config, resumed)
    refusals += [stage_change] if stage_change is not None else []
    if refusals:
        return [CheckResult(False, refusal) for refusal in refusals]
    if not layout.accepted_run_json.exists():
        note = "no accepted_run.json yet (the first start accepts run.json)"
        return [CheckResult(True, f"lifelong keys: {note}")]
    return [CheckResult(True, "lifelong keys: unchanged since accepted_run.json (or allowed)")]


def _check_model_against_checkpoint(resumed: Path | None, config: RunConfig, model: torch.nn.Module) -> CheckResult:
    """The model run.json builds can load the latest checkpoint, as the trainer's resume asks: the
    same parameter layout, and for PSSA the same settings that shape its banks and dreaming cache
    (the model is not a lifelong key: run.json may be edited, and the trainer refuses at resume)."""
    state = None if resumed is None else read_checkpoint_state(resumed)
    if resumed is None or state is None:
        return CheckResult(True, "model: no checkpoint to resume yet")
    where, latest = resumed, resumed.name
    now = f"{config.model.preset} {json.dumps(config.model.overrides, sort_keys=True)}"
    if state.get("layout") != segment_layout(flat_layout(model)[0]):
        saved = f"{state.get('preset')} {json.dumps(state.get('overrides'), sort_keys=True)}"
        return CheckResult(False, f"model: {where}: its parameter layout differs from the model run.json builds "
                                  f"({now}; the checkpoint's model: {saved})")  # fmt: skip
    if family_of(config.model.preset) == "pssa" and isinstance(state.get("overrides"), dict):
        try:
            saved_config = checked_config(str(state.get("preset")), state["overrides"])
        except ConfigError:  # a preset this code no longer has: the layout above matched all the same
            return CheckResult(True, f"model: {now} loads {latest}")
        saved_settings = {name: getattr(saved_config, name) for name in STATE_SHAPING}
        problem = changed_state_setting(saved_settings, model.config)  # the meta model's PSSAConfig
        if problem is not None:
            return CheckResult(False, f"model: {where}: {problem}")
    return CheckResult(True, f"model: {now} loads {latest}")


def _check_metrics(config: RunConfig) -> CheckResult:
    if config.metrics == METRICS_VERSION:
        return CheckResult(True, f"metrics: version {config.metrics} = this code's")
    return CheckResult(False, metrics_mismatch("run.json", config.metrics))


def _check_parallel(config: RunConfig) -> list[CheckResult]:
    """At `parallel.degree` N > 1, whether every rank trains: an update's micro-batches are dealt to
    the ranks (engine.training.distributed), so an update of fewer micro-batches than ranks leaves
    ranks idle (they only join the sum), training at the speed of fewer ranks. A warning naming the
    rows that deal every rank work (the trainer accepts such a line)."""
    degree = config.parallel.degree
    if degree == 1:
        return []
    for seq_len in sorted({stage.seq_len for stage in config.plan}):
        try:
            rows = config.length(seq_len).micro_batch_rows
        except ConfigError:
            continue  # run.json's validation names it
        for piece in config.ramp():
            update_rows = max(1, piece.tokens // seq_len)
            batches = -(-update_rows // rows)
            if batches < degree:
                idle = degree - batches
                return [CheckResult(True, (
                    f"parallel: degree {degree}: at T{seq_len} an update of {_rows(update_rows)} "
                    f"({piece.tokens:,} tokens) makes {batches} micro-batch{'es' if batches > 1 else ''} of "
                    f"{_rows(rows)}, so {idle} of the {degree} ranks {'trains' if idle == 1 else 'train'} nothing; "
                    f"set lengths[].micro_batch_rows at T{seq_len} to {-(-update_rows // degree)} or fewer "
                    "(`nsconsole tune` measures them)"
                ), warning=True)]  # fmt: skip
    return [CheckResult(True, f"parallel: degree {degree}, shard {config.parallel.shard}: every update's "
                              "micro-batches reach every rank")]  # fmt: skip


def _rows(count: int) -> str:
    """`1 row`, `8 rows`: a micro-batch of one row is a common tuning result, so its line must read right."""
    return f"{count} row" if count == 1 else f"{count} rows"


def _check_memory(config: RunConfig, model: torch.nn.Module) -> CheckResult:
    """The training's memory estimate against the device's (the trainer refuses what cannot fit)."""
    snapshot = gpu_snapshot()
    try:
        gpus = gpu_candidates(config.device, snapshot, degree=config.parallel.degree)
    except PlacementError:
        gpus = None  # the device check above fails it; the CPU's figure still says something
    if gpus is None:
        device_type = "cpu"
        available, name = cpu_memory(config.parallel.degree)
    else:
        totals = {device.index: device.memory_total for device in snapshot.devices}
        device_type, available = "cuda", min(totals[gpu.index] for gpu in gpus)
        name = f"GPU {gpus[0].index} ({gpus[0].name})" if len(gpus) == 1 else "the smallest of its GPUs"
    parameters = sum(parameter.numel() for parameter in model.parameters())
    estimate = line_memory_estimate(config, device_type, parameters)
    problem = memory_problem(estimate, available, "memory", name)
    if problem is not None:
        return CheckResult(False, problem)
    return CheckResult(True, f"memory: training needs {estimate.describe()}; {name} has {available / GIB:.3g} GiB")


def _check_sharing(layout: LineLayout, config: RunConfig) -> list[CheckResult]:
    if config.guards.share_reserve_gb is None:
        return []
    problem = unshareable_lengths_problem(config, "run.json", str(layout.root))  # the trainer refuses the same
    if problem is not None:
        return [CheckResult(False, problem)]
    return [CheckResult(True, "GPU sharing: every stage's length has a shared shape")]


def disk_results(
    layout: LineLayout, config: RunConfig, model: torch.nn.Module | None = None, resumed: Path | None = None
) -> list[CheckResult]:
    """Free disk above the guard and room for the next checkpoint (the trainer stops without),
    then what the checkpoints retention keeps take over the line's life (a warning when the disk
    cannot hold them). `model`: the line's model, else built on the meta device; `resumed`: the
    checkpoint the line resumes from (None: a new line's), measured for the next one's size."""
    model = model if model is not None else _meta_model(config)
    parameters = sum(parameter.numel() for parameter in model.parameters())
    try:
        data_line = datalines.open_data_line(resolve_data_path(layout, config.data.line))
    except (LineError, DataLineError) as error:
        return [CheckResult(False, f"disk: {error}")]
    size = next_checkpoint_size(
        resumed, config, parameters, len(data_line.tokenizer_json.encode("utf-8"))
    )
    free = shutil.disk_usage(layout.root).free
    minimum = config.guards.min_free_disk_gb
    checkpoint = f"a checkpoint about {gib_text(size.bytes)}, {size.basis}"
    if free < config.guards.min_free_disk_bytes:  # in bytes, as the trainer's guard compares
        first = CheckResult(
            False,
            f"disk: {gib_text(free)} free at {layout.root}, below guards.min_free_disk_gb {minimum:g}: "
            "the trainer would stop at its first update",
        )
    elif free < CHECKPOINT_DISK_MARGIN * size.bytes:
        first = CheckResult(
            False,
            f"disk: {gib_text(free)} free at {layout.root}, too little for the next checkpoint ({checkpoint}; "
            f"{CHECKPOINT_DISK_MARGIN:g}x needed): the trainer would not start",
        )
    else:
        first = CheckResult(True, f"disk: {gib_text(free)} free (minimum {minimum:g}; {checkpoint})")
    need = retention_need(config, size, data_line.cycle_tokens, data_line.last_cycle())
    shortfall = need.shortfall(free + checkpoints_bytes(layout.checkpoints))
    if shortfall is None:
        return [first, CheckResult(True, f"disk retention: {need.describe()}; it fits")]
    return [first, CheckResult(True, f"disk retention: {need.describe()}; {shortfall}", warning=True)]


def warmup_results(layout: LineLayout, config: RunConfig) -> list[CheckResult]:
    """A warning when the line would end inside a warmup piece of its learning-rate schedule: the
    default warmup (2e8 tokens) outlasts a short plan or a small data line, and such a line never
    trains at its peak rate. Said while it can be changed: nothing once run.json is accepted (the
    schedule may then only grow at its end), nor without a warmup, nor when the line's end is not
    known yet (an open-ended plan on a data line whose last cycle is not planned)."""
    if layout.accepted_run_json.exists() or not any(piece.kind == "warmup" for piece in config.lr.pieces):
        return []
    ends = _line_ends(layout, config)
    if not ends:
        return []
    end = min(tokens for tokens, _what in ends)
    index = _piece_at(config.lr.pieces, end)
    until = None if index is None else config.lr.pieces[index].until_tokens
    if index is None or config.lr.pieces[index].kind != "warmup" or until is None:
        return [CheckResult(True, f"lr warmup: over before the line ends (at about {end:,.0f} tokens)")]
    key = f"lr.pieces[{index}].until"
    short = " and ".join(f"{what} {tokens:,.0f}" for tokens, what in ends if tokens < until)
    return [CheckResult(
        True,
        f"lr warmup: {key} is {until:,.0f} tokens, but {short}: the line would end still warming up, "
        f"never at its peak rate; set {key} in run.json to a fraction of that",
        warning=True,
    )]  # fmt: skip


def _piece_at(pieces: list[LRPiece], tokens: float) -> int | None:
    """The index of the schedule's piece that holds the token count `tokens`; None past a closed last piece."""
    for index, piece in enumerate(pieces):
        if piece.until_tokens is None or tokens < piece.until_tokens:
            return index
    return None


def _line_ends(layout: LineLayout, config: RunConfig) -> list[tuple[float, str]]:
    """What bounds the tokens the line trains, each as (tokens, what says so): its plan when every
    stage has its tokens, its data line once the last cycle is planned (about: cycles are nominal)."""
    ends: list[tuple[float, str]] = []
    if all(stage.tokens is not None for stage in config.plan):
        ends.append((sum(stage.tokens or 0 for stage in config.plan), "the plan trains"))
    path = resolve_data_path(layout, config.data.line)
    try:
        data_line = datalines.open_data_line(path)
    except (LineError, DataLineError):
        return ends  # the data line's own check says what is wrong with it
    last = data_line.last_cycle()
    if last is not None:
        ends.append(((last + 1) * data_line.cycle_tokens, f"its data line {path} holds about"))
    return ends


def _check_rows(layout: LineLayout, resumed: Path | None) -> CheckResult:
    """rows.jsonl holds the rows the checkpoint the line resumes from counts (the trainer refuses it
    otherwise); without one, a line that has trained is refused (a fresh start would erase its rows)."""
    state = None if resumed is None else read_checkpoint_state(resumed)
    if resumed is None or state is None:
        lost = no_checkpoint_left_problem(layout)
        if lost is not None:
            return CheckResult(False, f"rows.jsonl: {lost}")
        return CheckResult(True, "rows.jsonl: no checkpoint to hold it to yet")
    latest = resumed.name
    rows, size = int(state.get("rows", 0)), int(state.get("rows_bytes", 0))
    problem = rows_problem(layout.rows_jsonl, rows, size)
    if problem is not None:
        return CheckResult(False, f"rows.jsonl: {problem}; {rows_remedy(layout)}")
    return CheckResult(True, f"rows.jsonl: holds the {rows} rows {latest} counts")


def _check_checkpoints(layout: LineLayout, problems: list[str]) -> list[CheckResult]:
    if problems:
        return [CheckResult(False, f"checkpoints: {problem}") for problem in problems]
    present = sorted(
        entry.name
        for entry in (layout.checkpoints.iterdir() if layout.checkpoints.is_dir() else ())
        if entry.is_dir() and checkpoint_update(entry.name) is not None
    )
    if not present:
        return [CheckResult(True, "checkpoints: none yet")]
    return [CheckResult(True, f"checkpoints: {len(present)} verified, newest {present[-1]}")]
