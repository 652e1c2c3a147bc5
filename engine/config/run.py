"""run.json: a training line's configuration as typed dataclasses.

`RunConfig.load(path)` reads, type-checks and validates a run.json; every problem is one
`ConfigError` line naming the file and the key (`run.json: unknown key optimizer.beta1`,
`run.json: lengths[0].seq_len must be an integer, got "4k"`). `to_dict()` / `save()` write the
stable JSON form (sorted keys, indent 2) and `from_dict(to_dict(c)) == c`.

Parsing is driven by the dataclasses' type hints (`engine.config.json_fields`), so a field is declared
once: its type, its default and its docstring here, and nothing else to keep in step. A field
whose JSON key differs from its Python name carries the key in its metadata (`json_key`). The
value checks are in `engine.config.checks`.

The settings a line keeps for its whole life are compared with the accepted configuration
(`<line>/accepted_run.json`) by `check_changes`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.atomic import write_text_atomic
from engine.config.checks import RunConfigChecks
from engine.config.json_fields import json_key, json_name, parse_json_text, parse_value, show, unparse
from engine.errors import ConfigError, LineError
from engine.metrics import METRICS_VERSION
from engine.units import gib_bytes

DEFAULT_SEQ_LEN = 4096
DEFAULT_TOKENS_PER_UPDATE = 262_144
DEFAULT_WARMUP_TOKENS = 2e8


@dataclass
class ModelConfig:
    """Which model the line trains."""

    preset: str
    """A preset name from `engine.models.presets` (e.g. `ns-2b`, `pssa-1.5m`, `transformer-tiny`)."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """Preset config fields replaced by name (e.g. `{"vocab_size": 8192}`); unknown names are refused."""


@dataclass
class DataConfig:
    """The data the line trains and validates on."""

    line: str
    """The data line directory (absolute, or relative to the training line's directory)."""
    heldout: str | None = None
    """The data line whose held-out rows validate the line; None: the data line's own held-out rows."""


@dataclass
class SharedShapeConfig:
    """The micro-batch shape of a length used while other processes share the GPU."""

    micro_batch_rows: int
    """Rows per micro-batch beside other processes (measured by `nsconsole tune --shared`)."""
    recompute: str = "none"
    """Activation recomputation beside other processes: `none`, `all` or a layer kind."""


@dataclass
class LengthConfig:
    """How updates of one sequence length are computed (chosen by `nsconsole tune`)."""

    seq_len: int
    """Tokens per training row."""
    micro_batch_rows: int = 1
    """Rows per micro-batch (forward + backward); an update accumulates as many as it needs."""
    recompute: str = "none"
    """Activation recomputation: `none`, `all`, or a layer kind (e.g. `dendritic`) recomputed alone."""
    shared: SharedShapeConfig | None = None
    """The shape used beside other GPU processes (None: not measured; sharing then refuses to start)."""


@dataclass
class StageConfig:
    """One stage of the plan: a run of updates at one sequence length."""

    name: str
    """The stage's name (`trunk`, `decay`, `long`, ...), unique within the plan."""
    seq_len: int
    """The stage's sequence length; `lengths` must have an entry for it."""
    tokens: float | None = None
    """Tokens the stage trains; None: until the data line ends (only the last stage)."""


@dataclass
class RampPiece:
    """One piece of a batch-size ramp: the tokens per update over a range of data-line tokens."""

    from_tokens: float = field(metadata=json_key("from"))
    """The data-line token count where the piece starts (the first piece starts at 0)."""
    to_tokens: float | None = field(metadata=json_key("to"))
    """Where it ends (the next piece's `from`); None: open-ended (only the last piece)."""
    tokens: int = field(metadata=json_key("tokens"))
    """Tokens per update within the piece; a multiple of every stage's sequence length."""


@dataclass
class OptimizerConfig:
    """AdamW (decoupled weight decay) with global-norm clipping."""

    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW's moment decay rates, each in [0, 1)."""
    eps: float = 1e-8
    """AdamW's denominator epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay of the `decay` parameter group (at `weight_decay_batch` tokens when set)."""
    weight_decay_batch: int | None = None
    """When set, an update's weight decay is `weight_decay * update tokens / weight_decay_batch`,
    so the AdamW time scale in tokens does not move with a batch-size ramp."""
    clip: float = 1.0
    """Global gradient-norm clipping threshold."""
    max_nonfinite_in_a_row: int = 20
    """Non-finite updates skipped in a row before the line stops."""


@dataclass
class LRPiece:
    """One piece of the learning-rate schedule over tokens trained.

    A piece runs from the previous piece's `until` (0 for the first) to its own `until`.
    `warmup` ramps linearly from the rate at its start (0 for a first piece) to `to` x peak;
    `constant` holds `to` x peak; `decay` goes from the rate at its start (peak for a first
    piece) to `to` x peak along `shape`.
    """

    kind: str
    """`warmup`, `constant` or `decay`."""
    until_tokens: float | None = field(default=None, metadata=json_key("until"))
    """Tokens trained where the piece ends; None: open-ended (only the last piece)."""
    to_fraction: float = field(default=1.0, metadata=json_key("to"))
    """The rate at the piece's end as a fraction of the peak, in [0, 1]."""
    shape: str = "linear"
    """A decay's shape: `linear`, `cosine` or `sqrt` (1 - sqrt); warmup and constant use `linear`."""


def _default_lr_pieces() -> list[LRPiece]:
    return [LRPiece("warmup", DEFAULT_WARMUP_TOKENS, 1.0), LRPiece("constant", None, 1.0)]


@dataclass
class LRConfig:
    """The learning-rate schedule: pieces over tokens trained, append-only over a line's life."""

    peak: float = 3e-4
    """The peak learning rate; the pieces' `to` are fractions of it."""
    pieces: list[LRPiece] = field(default_factory=_default_lr_pieces)
    """Contiguous pieces in order; the last may be open-ended. Past a closed last piece the rate holds."""


@dataclass
class EMAConfig:
    """An exponential moving average of the parameters, validated beside them."""

    horizon_tokens: float
    """The average moves by update tokens / horizon_tokens per update."""
    from_tokens: float = 0.0
    """Tokens trained where the average starts as a copy of the parameters."""


DREAM_MODES = ("memory", "generate", "both")
"""`dreaming.mode` values: what a dream rehearses (the PSSA article's modes)."""


@dataclass
class DreamingConfig:
    """PSSA dreaming (the article's offline rehearsal): after every `every_updates`-th update the
    trainer rehearses sequences with small SGD steps on the output-head rows of their target
    tokens, each step kept only if the update's fresh task (the first chunk of its last row) loses
    no more than 1e-6 nats, else backtracked and, failing that, undone bit for bit."""

    every_updates: int
    """Dream after every this many updates (after the update, before its validation and checkpoint)."""
    sequences: int = 8
    """Per round: the newest cached chunks rehearsed and the newest memory slots dreamt from."""
    steps: int = 1
    """Guarded SGD steps per rehearsed sequence."""
    lr: float = 6e-3
    """The rehearsal SGD's step size (the article's default); AdamW's moments and the lr schedule
    are not touched."""
    mode: str = "memory"
    """`memory`: rehearse the cached chunks whose loss passed the memory write gate; `generate`:
    rehearse sequences the model dreams from its first block's memory values; `both`."""
    repeats: int = 1
    """Rounds over the sequences; each round dreams the generated ones afresh."""
    length: int = 8
    """Tokens dreamt from each memory value."""
    temperature: float = 0.8
    """The dreamt tokens' sampling temperature (> 0); the draws come from a generator seeded by
    `seeds.model` and the update, so a resumed line dreams the same tokens."""


@dataclass
class CheckpointConfig:
    """When checkpoints are written and how many rolling ones are kept."""

    every_updates: int = 1000
    """A rolling checkpoint every this many updates (cycle ends and stage ends are always kept)."""
    keep_last: int = 2
    """The newest rolling checkpoints kept; older ones are removed."""
    keep_cycle_ends: int | None = None
    """The newest cycle-end checkpoints kept; older ones are removed (the line's start and its stage
    ends stay). None: every cycle end stays, as a fork point for a branch or a rollback -- one more
    checkpoint's disk per cycle, without bound over a trunk of many cycles."""


@dataclass
class SamplesConfig:
    """The short generations each validation records in its row (`samples`, the console's samples tab):
    what the model writes at that update, from the weights as they stand (not the moving average)."""

    prompts: int = 2
    """Prompts generated from at each validation, taken from the held-out rows of the training length
    that validation reads (the sources in turn, each one's first rows first, so every validation
    continues the same prompts; no more than `rows_per_source` of each source); 0 turns samples off.
    At most 8, which keeps a validation row far below the supervisor's 64 KiB line."""
    prompt_tokens: int = 32
    """Tokens of each prompt: the start of its held-out row (the whole row when it is shorter); at most 256."""
    new_tokens: int = 48
    """Tokens generated after each prompt (fewer when the model ends the document); at most 256."""
    temperature: float = 0.8
    """Logits are divided by it before the softmax; 0 takes the most likely token (greedy). The draws
    come from a generator seeded by `seeds.model` and the update, so a resumed line writes the same text."""
    top_p: float = 0.95
    """Draw only among the most likely tokens whose probabilities first reach top_p together
    (the most likely one always stays); 1 draws from the whole distribution."""


SAMPLES_KEY = "samples"
"""The validation row's key of its samples: a list of `{"source", "prompt", "text"}` (text, not a
metric: W&B's numeric history leaves it out, the console's samples tab shows it)."""


@dataclass
class ValidationConfig:
    """Held-out validation and probes."""

    every_updates: int = 1000
    """Validate every this many updates."""
    rows_per_source: int = 16
    """Held-out rows per source at the training length."""
    long_seq_len: int | None = None
    """The long-row probe's length; None: the model's longest context when it exceeds the training length."""
    samples: SamplesConfig = field(default_factory=SamplesConfig)
    """The short generations recorded at each validation."""


@dataclass
class GuardsConfig:
    """Health checks of the GPU, the watchdog and the disk."""

    gpu_check_every: int = 50
    """Look for other processes on the GPU every this many updates."""
    share_reserve_gb: float | None = None
    """GPU memory left to other processes when they appear, in GiB (2**30 bytes); None: checkpoint
    and wait for a free GPU. Read it as bytes through `share_reserve_bytes`."""
    watchdog_minutes: float = 30.0
    """Minutes without a heartbeat before the supervisor kills and restarts the trainer."""
    min_free_disk_gb: float = 20.0
    """Free disk, in GiB (2**30 bytes), below which the trainer checkpoints and stops for the operator.
    Read it as bytes through `min_free_disk_bytes`."""

    @property
    def share_reserve_bytes(self) -> int | None:
        """`share_reserve_gb` in bytes (None: no reserve): the one GiB conversion of it."""
        return None if self.share_reserve_gb is None else gib_bytes(self.share_reserve_gb)

    @property
    def min_free_disk_bytes(self) -> int:
        """`min_free_disk_gb` in bytes: the one GiB conversion of it."""
        return gib_bytes(self.min_free_disk_gb)

    def shared_tune_reserve_bytes(self, source: str, asker: str = "--shared") -> int:
        """The reserve in bytes that a shared tune (`nsconsole tune --shared`) leaves to the others;
        without `share_reserve_gb` a `LineError` "`source`: `asker` needs guards.share_reserve_gb".

        The one place of that refusal: the supervisor asks it before pausing its trainer for a tune
        (here, since the supervisor imports no torch and the tune does), the tune again when it runs.
        """
        if self.share_reserve_bytes is None:
            raise LineError(f"{source}: {asker} needs guards.share_reserve_gb (the memory left to others)")
        return self.share_reserve_bytes


@dataclass
class WandbConfig:
    """The line's Weights & Biases run."""

    project: str | None = None
    """The W&B project (None: W&B's default); kept for the line's whole life."""
    mode: str = "offline"
    """`online`, `offline` (local files, synced later) or `disabled`."""
    entity: str | None = None
    """The W&B entity (team or user); None: the logged-in user's default."""


@dataclass
class SeedsConfig:
    """Random seeds."""

    model: int = 0
    """Seeds the model's initialisation (and any noise the model draws)."""
    data: int = 0
    """Seeds the sample order within every cycle."""


PARALLEL_SHARDS = ("none", "fsdp")
"""`parallel.shard` values: whole state on every rank, or FSDP2's shards."""


@dataclass
class ParallelConfig:
    """One line over several processes (torch.distributed, launched by torchrun; see the README's
    "Several GPUs: torch.distributed")."""

    degree: int = 1
    """Data-parallel processes (ranks): on CUDA one GPU each (the line's GPU and the next ones:
    rank r on GPU N + r for `cuda:N`), on the CPU one process each (gloo). Above 1 the supervisor
    starts the trainer through torchrun. Each update's rows are split across the ranks in fixed
    contiguous slices, so the update does not depend on the degree (up to the order of the gradient
    sum), and a checkpoint saved at one degree resumes at any other."""
    shard: str = "none"
    """How the model's state is spread over the ranks: `none` (every rank holds the whole weights
    and optimizer state; the gradient is summed across ranks before the update) or `fsdp` (FSDP2
    `fully_shard` of the model's layers and root: each rank holds 1/degree of the weights, the
    gradient and the AdamW moments, for a model whose training state does not fit one GPU; eager
    engine only, no moving average yet). The update is the same either way (up to the order of
    the gradient sum), and so are the checkpoints: one saved with either value resumes with the
    other, at any degree. At degree 1 `fsdp` trains as `none` (nothing to shard), so a line's
    degree can change without touching this key."""
    timeout_minutes: float = 20.0
    """How long a collective (the gradient sum, a stop agreement) may wait for a rank before it
    fails and the group ends (the supervisor then relaunches it from the newest checkpoint). Longer
    than anything rank 0 does alone: a checkpoint write it waits for, a validation's probes."""

    def validate(self, source: str = "run.json") -> None:
        """ConfigError `<source>: parallel.<key> ...` at the first bad value."""
        if self.degree < 1:
            raise ConfigError(f"{source}: parallel.degree must be at least 1, got {self.degree!r}")
        if self.shard not in PARALLEL_SHARDS:
            raise ConfigError(f"{source}: parallel.shard must be one of {', '.join(PARALLEL_SHARDS)}, got {self.shard!r}")
        if not self.timeout_minutes > 0:
            raise ConfigError(f"{source}: parallel.timeout_minutes must be positive, got {self.timeout_minutes!r}")


@dataclass
class RunConfig:
    """A training line's configuration (`<line>/run.json`)."""

    model: ModelConfig
    """The model preset and its overrides."""
    data: DataConfig
    """The data line and the held-out line."""
    lengths: list[LengthConfig] = field(default_factory=lambda: [LengthConfig(DEFAULT_SEQ_LEN)])
    """Per sequence length: micro-batch rows, recomputation and the shared shape."""
    plan: list[StageConfig] = field(default_factory=lambda: [StageConfig("trunk", DEFAULT_SEQ_LEN, None)])
    """The stages in order."""
    tokens_per_update: int | list[RampPiece] = DEFAULT_TOKENS_PER_UPDATE
    """Tokens per optimizer update: one number, or a batch-size ramp over the data line's tokens."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """AdamW settings."""
    lr: LRConfig = field(default_factory=LRConfig)
    """The learning-rate schedule."""
    ema: EMAConfig | None = None
    """The parameters' moving average; None: not kept."""
    dreaming: DreamingConfig | None = None
    """PSSA dreaming after every N-th update (pssa-* presets only); None: off."""
    checkpoints: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint cadence and retention."""
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    """Validation cadence and size."""
    guards: GuardsConfig = field(default_factory=GuardsConfig)
    """GPU sharing, watchdog and disk guards."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """The W&B run."""
    seeds: SeedsConfig = field(default_factory=SeedsConfig)
    """Random seeds."""
    metrics: int = METRICS_VERSION
    """The metric set's version the line was started with (must equal the code's METRICS_VERSION)."""
    print_every: int = 10
    """Print a row to the terminal and run.log every this many updates (validating updates always)."""
    device: str = "auto"
    """`auto` (the first GPU of the host whose lease is free; the CPU on a host without a GPU),
    `cpu`, `cuda` (as auto, never the CPU) or `cuda:N` (the N-th GPU the supervisor sees: nvidia-smi's
    N, or the N-th entry of its CUDA_VISIBLE_DEVICES; `engine/gpu/placement.py`)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Data parallelism over several processes (GPUs); degree 1: one process, as without it."""
    allow_changes: list[str] = field(default_factory=list)
    """Lifelong keys (dotted) whose change against the accepted configuration is intended."""

    # -- reading and writing -------------------------------------------------------------------

    @classmethod
    def load(cls, path: Path | str) -> RunConfig:
        """Read, type-check and validate a run.json; any problem is one ConfigError naming the file."""
        source = str(path)
        try:
            text = Path(path).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(f"{source}: no such file") from None
        except (OSError, UnicodeDecodeError) as error:
            raise ConfigError(f"{source}: cannot be read ({error})") from None
        document = parse_json_text(text, source)
        config = cls.from_dict(document, source=source)
        config.validate(source=source)
        return config

    @classmethod
    def from_dict(cls, document: Any, source: str = "run.json") -> RunConfig:
        """Type-check a parsed run.json (keys, types); `validate()` checks the values."""
        return parse_value(document, RunConfig, "", source)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: every field, under its run.json key."""
        return unparse(self)

    def to_json(self) -> str:
        """The stable JSON text (sorted keys, indent 2, final newline)."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def save(self, path: Path | str) -> None:
        """Write run.json atomically (temporary file, fsync, rename)."""
        write_text_atomic(path, self.to_json())

    # -- validation ----------------------------------------------------------------------------

    def validate(self, source: str = "run.json") -> None:
        """Check every value; raise ConfigError `<source>: <key> ...` at the first problem."""
        RunConfigChecks(self, source).run()
        self.parallel.validate(source)

    def length(self, seq_len: int) -> LengthConfig:
        """The `lengths` entry of a sequence length."""
        for entry in self.lengths:
            if entry.seq_len == seq_len:
                return entry
        raise ConfigError(f"run.json: no lengths entry for seq_len {seq_len}")

    def ramp(self) -> list[RampPiece]:
        """tokens_per_update as ramp pieces (a single number is one open piece from 0)."""
        if isinstance(self.tokens_per_update, int):
            return [RampPiece(0.0, None, self.tokens_per_update)]
        return list(self.tokens_per_update)


# -- lifelong keys --------------------------------------------------------------------------------

LIFELONG_SECTIONS = ("data", "optimizer", "seeds")
"""Sections every key of which a line keeps for its whole life."""

LIFELONG_KEY_NAMES = (
    *LIFELONG_SECTIONS,
    *(
        f"{section}.{json_name(spec)}"
        for section, cls in (("data", DataConfig), ("optimizer", OptimizerConfig), ("seeds", SeedsConfig))
        for spec in dataclasses.fields(cls)
    ),
    "wandb.project",
)
"""Every name `allow_changes` may list: a whole lifelong section or one of its keys. tokens_per_update
is lifelong too but not listable: its ramp may only grow at its end, which needs no listing."""


def _lifelong_values(config: RunConfig) -> dict[str, Any]:
    """Dotted lifelong key -> its JSON value (tokens_per_update is compared separately)."""
    document = config.to_dict()
    values = {
        f"{section}.{key}": value for section in LIFELONG_SECTIONS for key, value in document[section].items()
    }
    values["wandb.project"] = document["wandb"]["project"]
    return values


def _allowed(key: str, allow_changes: list[str]) -> bool:
    return any(key == allowed or key.startswith(allowed + ".") for allowed in allow_changes)


def accepted_changes(accepted: RunConfig, current: RunConfig) -> list[str]:
    """What a start accepts that accepted_run.json did not hold, one line each for run.log: a lifelong
    key changed on purpose (allow_changes), the batch ramp or the learning-rate schedule grown at its
    end. The line's own record of why its later updates differ from its earlier ones."""
    changes = [f"{key} {show(old)} -> {show(new)} (allow_changes)" for key, old, new in _lifelong_changes(accepted, current)]
    for name, old, new in (("tokens_per_update", unparse(accepted.ramp()), unparse(current.ramp())),
                           ("lr.pieces", unparse(accepted.lr.pieces), unparse(current.lr.pieces))):  # fmt: skip
        if old != new:
            changes.append(f"{name} {show(old)} -> {show(new)}")
    return changes


def _lifelong_changes(accepted: RunConfig, current: RunConfig) -> list[tuple[str, Any, Any]]:
    """(dotted key, accepted value, current value) of each lifelong key that differs."""
    before, after = _lifelong_values(accepted), _lifelong_values(current)
    return [(key, before[key], after[key]) for key in before if before[key] != after[key]]


@dataclass(frozen=True)
class TrainedSoFar:
    """Where a line stands (its latest checkpoint): the clocks its schedule and ramp are read at.

    A schedule may grow only past these: a piece closed or appended before them would say the
    updates already trained had another rate or batch than the ones they had (a branch or a
    rollback from before the edit would then train what the line never did)."""

    tokens: float
    """Tokens trained: the learning-rate schedule's clock."""
    data_tokens: float
    """The data line's token count: the batch-size ramp's clock."""


def check_changes(accepted: RunConfig, current: RunConfig, trained: TrainedSoFar | None = None) -> list[str]:
    """One message per lifelong key changed since `accepted` without being listed in allow_changes.

    The batch-size ramp and the learning-rate pieces may only grow at their end (earlier pieces
    unchanged; an open last piece may be closed and followed by new ones) and, given where the
    line stands (`trained`), only past it; any other change of them is reported whatever
    allow_changes says, since the updates already trained followed them.
    """
    messages: list[str] = []
    for key, old, new in _lifelong_changes(accepted, current):
        if not _allowed(key, current.allow_changes):
            messages.append(
                f"{key} changed from {show(old)} to {show(new)} "
                f"(add {show(key)} to allow_changes to change it on purpose)"
            )
    if isinstance(accepted.tokens_per_update, int) and isinstance(current.tokens_per_update, int):
        if accepted.tokens_per_update != current.tokens_per_update:
            messages.append(
                f"tokens_per_update changed from {accepted.tokens_per_update} to {current.tokens_per_update} "
                f"(the batch may only grow at its end: write it as a ramp, "
                f'[{{"from": 0, "to": <a data-line token count not yet read>, "tokens": {accepted.tokens_per_update}}}, '
                f'{{"from": <that count>, "to": null, "tokens": {current.tokens_per_update}}}])'
            )
    else:
        clock = None if trained is None else ("tokens of the data line this line has read", trained.data_tokens)
        ramp_problem = _growth_problem(unparse(accepted.ramp()), unparse(current.ramp()), "to", clock)
        if ramp_problem:
            messages.append(f"tokens_per_update{ramp_problem} (the ramp may only grow at its end)")
    clock = None if trained is None else ("tokens this line has trained", trained.tokens)
    lr_problem = _growth_problem(unparse(accepted.lr.pieces), unparse(current.lr.pieces), "until", clock)
    if lr_problem:
        messages.append(f"lr.pieces{lr_problem} (the schedule may only grow at its end)")
    return messages


def stage_length_change(
    current: RunConfig, accepted: RunConfig | None, stage: int, stage_tokens: int, sample: int, read_at: int | None
) -> str | None:
    """Why `current` may not train the stage the line stands in (`stage`, by its checkpoint's position)
    at its `seq_len`, or None. A stage the line has begun keeps its length: the checkpoint counts the
    cycle's samples (`sample`) at the length they were read at (`read_at`, its `data.seq_len`), and
    the trainer would go on at that count in another length's sample order, training some of the
    cycle's targets twice and others never, and nothing would say so. Past a cycle's end (nothing
    read yet) the stage would still change its length in the middle, against the plan it was accepted
    with. A stage not begun (`stage_tokens` and `sample` 0) is one of the plan's later stages: free.
    Not listable in allow_changes: the accepted start would mis-train all the same."""
    if stage >= len(current.plan):
        return None  # the plan is done: nothing more is trained
    new = current.plan[stage].seq_len
    if sample > 0 and read_at is not None:
        old = read_at  # the checkpoint's own record: whatever accepted_run.json says
    elif (stage_tokens > 0 or sample > 0) and accepted is not None and stage < len(accepted.plan):
        old = accepted.plan[stage].seq_len
    else:
        return None
    if old == new:
        return None
    name = current.plan[stage].name
    return (
        f"plan[{stage}].seq_len changed from {old} to {new}, but the line stands in stage {name}, begun at "
        f"{old} (its checkpoint counts the cycle's samples at that length; a begun stage keeps its length): "
        f"set it back to {old}; to train at {new}, end stage {name} (plan[{stage}].tokens) and add a stage at "
        f"{new} after it, or branch the line (`nsconsole branch`)"
    )


def _growth_problem(
    before: list[dict[str, Any]], after: list[dict[str, Any]], end_key: str, clock: tuple[str, float] | None
) -> str | None:
    """Why `after` is not `before` grown at its end (past `clock`, what the line has trained,
    when given), or None when it is; the text follows the list's key (` piece 1 changed ...`)."""
    if len(after) < len(before):
        return f" lost pieces: {len(before)} accepted, {len(after)} now"
    grows: tuple[str, float] | None = None  # where `after` first differs from `before`
    for index, (old, new) in enumerate(zip(before, after)):
        if old == new:
            continue
        is_last_open = index == len(before) - 1 and old[end_key] is None
        if is_last_open and {**new, end_key: None} == old:
            grows = (f"piece {index} closed at", new[end_key])
            continue
        return f" piece {index} changed from {show(old)} to {show(new)}"
    if grows is None and len(after) > len(before):  # appended after a closed last piece, which held till now
        grows = (f"piece {len(before)} starts at", before[-1][end_key])
    if clock is not None and grows is not None and grows[1] < clock[1]:
        where, point = grows
        return f" {where} {point:,.0f}, before the {clock[1]:,.0f} {clock[0]}: only there or later"
    return None
