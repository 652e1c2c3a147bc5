"""The value checks of a type-correct run.json (`RunConfig.validate()` runs them).

Each check raises `ConfigError("<file>: <key> <problem>")` at the first problem, e.g.
`run.json: optimizer.betas[1] must be in [0, 1), got 1.2`.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any, NoReturn

from engine.config.json_fields import show
from engine.errors import ConfigError
from engine.models import presets
from engine.models.ns.config import NSConfig
from engine.models.ns.presets import recomputed_layers
from engine.models.validation import validate_model_config

if TYPE_CHECKING:
    from engine.config.run import RunConfig

LR_PIECE_KINDS = ("warmup", "constant", "decay")
LR_SHAPES = ("linear", "cosine", "sqrt")
WANDB_MODES = ("online", "offline", "disabled")
WANDB_PROJECT_RESERVED = "/\\#?%:"
WANDB_PROJECT_MAX_LENGTH = 128
"""W&B's limits on a project name (wandb_settings.validate_project): a name past them fails every
`wandb.init` of the line's trainer, which would train on with W&B failing the whole session."""
DEVICE_PATTERN = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")
"""run.json's `device`; which GPU `cuda:N` is on this host is `nsconsole check`'s (`engine/gpu/placement.py`)."""
RECOMPUTE_PATTERN = re.compile(r"^[a-z][a-z0-9_]*(:[0-9]+)?$")
STAGE_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
MAX_SEED = 2**64 - 1
"""The largest seed: torch's generators take 0..2**64-1 and numpy's seed sequence no negative
number, so a seed outside it would pass `check` and crash the trainer's start."""
MAX_SAMPLE_PROMPTS = 8
MAX_SAMPLE_TOKENS = 256
"""Bounds of `validation.samples`: a validation row carries every sample's text (a row past the
supervisor's 64 KiB line reaches the console in pieces, `row`, after an `omitted` marker)."""


class RunConfigChecks:
    """The value checks of a type-correct RunConfig; raises at the first problem."""

    def __init__(self, config: RunConfig, source: str) -> None:
        self.config = config
        self.source = source
        self.model: Any = None
        """The preset's config with the overrides, once `check_preset` has built and validated it."""

    def fail(self, key: str, problem: str) -> NoReturn:
        raise ConfigError(f"{self.source}: {key} {problem}")

    def at_least(self, key: str, value: float | None, minimum: float) -> None:
        if value is not None and value < minimum:
            self.fail(key, f"must be at least {minimum:g}, got {show(value)}")

    def at_most(self, key: str, value: float, maximum: float) -> None:
        if value > maximum:
            self.fail(key, f"must be at most {maximum:g}, got {show(value)}")

    def positive(self, key: str, value: float | None) -> None:
        # JSON reads NaN and Infinity, which a `<= 0` test lets through.
        if value is not None and not math.isfinite(value):
            self.fail(key, f"must be finite, got {show(value)}")
        if value is not None and value <= 0:
            self.fail(key, f"must be positive, got {show(value)}")

    def one_of(self, key: str, value: str, choices: tuple[str, ...]) -> None:
        if value not in choices:
            self.fail(key, f"must be one of {', '.join(choices)}, got {show(value)}")

    def run(self) -> None:
        self.check_model_and_data()
        self.check_lengths_and_plan()
        self.check_tokens_per_update()
        self.check_optimizer()
        self.check_lr()
        self.check_rest()
        # Last: it imports the model modules, and a problem above is more useful to report first.
        self.check_preset()
        self.check_dreaming()

    def check_model_and_data(self) -> None:
        config = self.config
        if not config.model.preset:
            self.fail("model.preset", "must not be empty")
        if not config.data.line:
            self.fail("data.line", "must not be empty")
        if config.data.heldout == "":
            self.fail("data.heldout", "must be a data line directory or null, got \"\"")

    def check_preset(self) -> None:

        known = presets.preset_names()
        if self.config.model.preset not in known:
            preset = show(self.config.model.preset)
            self.fail("model.preset", f"{preset} is not a preset (known: {', '.join(known)})")
        try:
            model = presets.preset_config(self.config.model.preset, self.config.model.overrides)
            validate_model_config(model)
            self.model = model  # check_dreaming's bounds are the model's
        except ConfigError as error:
            raise ConfigError(f"{self.source}: {error}") from None
        except (TypeError, ValueError) as error:
            self.fail("model.overrides", f"are not valid for {self.config.model.preset}: {error}")
        if isinstance(model, NSConfig):
            self.check_recompute_layers(model)

    def check_recompute_layers(self, model: NSConfig) -> None:
        """Each length's recompute setting names layers this NS model has (`dendritic:40` of 36)."""
        for index, entry in enumerate(self.config.lengths):
            shapes = [(f"lengths[{index}]", entry.recompute)]
            if entry.shared is not None:
                shapes.append((f"lengths[{index}].shared", entry.shared.recompute))
            for key, setting in shapes:
                try:
                    recomputed_layers(setting, model)
                except ValueError as error:
                    self.fail(f"{key}.recompute", f"is not valid for {self.config.model.preset}: {error}")

    def check_dreaming(self) -> None:
        # Imported here: engine.config.run imports this module.
        from engine.config.run import DREAM_MODES

        dreaming = self.config.dreaming
        if dreaming is None:
            return
        preset = self.config.model.preset
        if presets.family_of(preset) != "pssa":
            self.fail("dreaming", f"is for pssa-* models only; {preset} does not dream (set it to null)")
        for name in ("every_updates", "sequences", "steps", "repeats", "length"):
            self.at_least(f"dreaming.{name}", getattr(dreaming, name), 1)
        self.positive("dreaming.lr", dreaming.lr)
        self.one_of("dreaming.mode", dreaming.mode, DREAM_MODES)
        self.positive("dreaming.temperature", dreaming.temperature)
        # A dream draws from the cache of mem_capacity chunks and from as many memory values, and a
        # dreamt sequence stands for one chunk: past these it rehearses nothing more, only longer
        # (tokens are dreamt one at a time), while training waits.
        model = self.model
        for name, bound, why in (("sequences", "mem_capacity", "the chunks and memory values a dream draws from"),
                                 ("length", "chunk_len", "a dreamt sequence stands for one chunk")):  # fmt: skip
            value, limit = getattr(dreaming, name), getattr(model, bound)
            if value > limit:
                self.fail(f"dreaming.{name}", f"must be at most the model's {bound} {limit} ({why}), got {show(value)}")

    def check_shape(self, key: str, micro_batch_rows: int, recompute: str) -> None:
        self.at_least(f"{key}.micro_batch_rows", micro_batch_rows, 1)
        if not RECOMPUTE_PATTERN.match(recompute):
            self.fail(f"{key}.recompute", f"must be none, all, a layer kind or kind:count, got {show(recompute)}")

    def check_lengths_and_plan(self) -> None:
        config = self.config
        if not config.lengths:
            self.fail("lengths", "must hold at least one entry")
        seen: dict[int, int] = {}
        for index, entry in enumerate(config.lengths):
            key = f"lengths[{index}]"
            self.at_least(f"{key}.seq_len", entry.seq_len, 2)
            if entry.seq_len in seen:
                first = seen[entry.seq_len]
                self.fail(f"{key}.seq_len", f"{entry.seq_len} already has an entry (lengths[{first}])")
            seen[entry.seq_len] = index
            self.check_shape(key, entry.micro_batch_rows, entry.recompute)
            if entry.shared is not None:
                self.check_shape(f"{key}.shared", entry.shared.micro_batch_rows, entry.shared.recompute)
        if not config.plan:
            self.fail("plan", "must hold at least one stage")
        names: set[str] = set()
        for index, stage in enumerate(config.plan):
            key = f"plan[{index}]"
            if not STAGE_NAME_PATTERN.match(stage.name):
                self.fail(f"{key}.name", f"must be a name of letters, digits, _ . -, got {show(stage.name)}")
            if stage.name in names:
                self.fail(f"{key}.name", f"{show(stage.name)} appears twice in the plan")
            names.add(stage.name)
            if stage.seq_len not in seen:
                self.fail(f"{key}.seq_len", f"{stage.seq_len} has no entry in lengths")
            self.positive(f"{key}.tokens", stage.tokens)
            if stage.tokens is None and index != len(config.plan) - 1:
                self.fail(f"{key}.tokens", "may be null (until the data line ends) only in the last stage")

    def check_tokens_per_update(self) -> None:
        config = self.config
        if isinstance(config.tokens_per_update, int):
            self.check_update_tokens("tokens_per_update", config.tokens_per_update)
            return
        pieces = config.tokens_per_update
        if not pieces:
            self.fail("tokens_per_update", "must be a number or at least one ramp piece")
        for index, piece in enumerate(pieces):
            key = f"tokens_per_update[{index}]"
            expected_start = 0.0 if index == 0 else pieces[index - 1].to_tokens
            if piece.from_tokens != expected_start:
                where = "0" if index == 0 else f"the previous piece's to ({show(expected_start)})"
                self.fail(f"{key}.from", f"must be {where}, got {show(piece.from_tokens)}")
            if piece.to_tokens is None:
                if index != len(pieces) - 1:
                    self.fail(f"{key}.to", "may be null (open-ended) only in the last piece")
            elif piece.to_tokens <= piece.from_tokens:
                start = show(piece.from_tokens)
                self.fail(f"{key}.to", f"must exceed from ({start}), got {show(piece.to_tokens)}")
            self.check_update_tokens(f"{key}.tokens", piece.tokens)

    def check_update_tokens(self, key: str, tokens: int) -> None:
        self.positive(key, tokens)
        # An update is a whole number of rows of its stage's length.
        for index, stage in enumerate(self.config.plan):
            if tokens % stage.seq_len:
                self.fail(
                    key,
                    f"{tokens} is not a multiple of plan[{index}] ({stage.name})'s seq_len {stage.seq_len}",
                )

    def check_optimizer(self) -> None:
        optimizer = self.config.optimizer
        for index, beta in enumerate(optimizer.betas):
            if not 0 <= beta < 1:
                self.fail(f"optimizer.betas[{index}]", f"must be in [0, 1), got {show(beta)}")
        self.positive("optimizer.eps", optimizer.eps)
        self.at_least("optimizer.weight_decay", optimizer.weight_decay, 0)
        self.positive("optimizer.weight_decay_batch", optimizer.weight_decay_batch)
        self.positive("optimizer.clip", optimizer.clip)
        self.at_least("optimizer.max_nonfinite_in_a_row", optimizer.max_nonfinite_in_a_row, 1)

    def check_lr(self) -> None:
        lr = self.config.lr
        self.positive("lr.peak", lr.peak)
        if not lr.pieces:
            self.fail("lr.pieces", "must hold at least one piece")
        previous_end = 0.0
        for index, piece in enumerate(lr.pieces):
            key = f"lr.pieces[{index}]"
            self.one_of(f"{key}.kind", piece.kind, LR_PIECE_KINDS)
            self.one_of(f"{key}.shape", piece.shape, LR_SHAPES)
            if piece.kind != "decay" and piece.shape != "linear":
                self.fail(f"{key}.shape", f"applies to decay pieces only; a {piece.kind} is linear")
            if not 0 <= piece.to_fraction <= 1:
                self.fail(f"{key}.to", f"must be in [0, 1], got {show(piece.to_fraction)}")
            if piece.until_tokens is None:
                if index != len(lr.pieces) - 1:
                    self.fail(f"{key}.until", "may be null (open-ended) only in the last piece")
                if piece.kind != "constant":
                    self.fail(f"{key}.until", f"may be null only in a constant piece, not a {piece.kind}")
            elif piece.until_tokens <= previous_end:
                self.fail(f"{key}.until", f"must exceed {show(previous_end)}, got {show(piece.until_tokens)}")
            else:
                previous_end = piece.until_tokens

    def check_wandb_project(self, project: str | None) -> None:
        if project is None:
            return
        if len(project) > WANDB_PROJECT_MAX_LENGTH:
            self.fail(
                "wandb.project",
                f"must be at most {WANDB_PROJECT_MAX_LENGTH} characters (W&B refuses longer), got {len(project)}",
            )
        if any(character in WANDB_PROJECT_RESERVED for character in project):
            reserved = " ".join(WANDB_PROJECT_RESERVED)
            self.fail("wandb.project", f"must not hold any of {reserved} (W&B refuses them), got {show(project)}")

    def check_samples(self) -> None:
        samples = self.config.validation.samples
        key = "validation.samples"
        self.at_least(f"{key}.prompts", samples.prompts, 0)
        self.at_most(f"{key}.prompts", samples.prompts, MAX_SAMPLE_PROMPTS)
        for name, tokens in (("prompt_tokens", samples.prompt_tokens), ("new_tokens", samples.new_tokens)):
            self.at_least(f"{key}.{name}", tokens, 1)
            self.at_most(f"{key}.{name}", tokens, MAX_SAMPLE_TOKENS)
        if not (math.isfinite(samples.temperature) and samples.temperature >= 0):
            self.fail(f"{key}.temperature", f"must be finite and at least 0 (0: greedy), got {show(samples.temperature)}")
        if not 0 < samples.top_p <= 1:
            self.fail(f"{key}.top_p", f"must be in (0, 1], got {show(samples.top_p)}")

    def check_rest(self) -> None:
        # Imported here: engine.config.run imports this module.
        from engine.config.run import LIFELONG_KEY_NAMES

        config = self.config
        if config.ema is not None:
            self.positive("ema.horizon_tokens", config.ema.horizon_tokens)
            self.at_least("ema.from_tokens", config.ema.from_tokens, 0)
        self.at_least("checkpoints.every_updates", config.checkpoints.every_updates, 1)
        self.at_least("checkpoints.keep_last", config.checkpoints.keep_last, 1)
        self.at_least("checkpoints.keep_cycle_ends", config.checkpoints.keep_cycle_ends, 1)
        self.at_least("validation.every_updates", config.validation.every_updates, 1)
        self.at_least("validation.rows_per_source", config.validation.rows_per_source, 1)
        self.at_least("validation.long_seq_len", config.validation.long_seq_len, 2)
        self.check_samples()
        self.at_least("guards.gpu_check_every", config.guards.gpu_check_every, 1)
        self.positive("guards.share_reserve_gb", config.guards.share_reserve_gb)
        self.positive("guards.watchdog_minutes", config.guards.watchdog_minutes)
        self.at_least("guards.min_free_disk_gb", config.guards.min_free_disk_gb, 0)
        self.one_of("wandb.mode", config.wandb.mode, WANDB_MODES)
        self.check_wandb_project(config.wandb.project)
        for name in ("model", "data"):
            seed = getattr(config.seeds, name)
            if not 0 <= seed <= MAX_SEED:
                self.fail(f"seeds.{name}", f"must be an integer in 0..{MAX_SEED} (2**64 - 1), got {show(seed)}")
        self.at_least("metrics", config.metrics, 1)
        self.at_least("print_every", config.print_every, 1)
        if not DEVICE_PATTERN.match(config.device):
            self.fail("device", f"must be auto, cpu, cuda or cuda:N, got {show(config.device)}")
        for index, key in enumerate(config.allow_changes):
            if key == "tokens_per_update":
                self.fail(
                    f"allow_changes[{index}]",
                    "cannot list tokens_per_update: the ramp may only grow at its end "
                    "(close the open piece with a \"to\" and append the new batch size as a piece)",
                )
            if key not in LIFELONG_KEY_NAMES:
                self.fail(
                    f"allow_changes[{index}]",
                    f"{show(key)} is not a lifelong key (known: {', '.join(LIFELONG_KEY_NAMES)})",
                )
