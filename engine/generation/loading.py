"""Loading a checkpoint alone for generation: its weights, extra state, preset, overrides and tokenizer.

A checkpoint is self-contained (DESIGN.md): the model is built from the preset and overrides of
the run.json it carries and text goes through the tokenizer.json it carries, never through a
tokenizer rebuilt from data, so no data line is read. Every file is checked against meta.json's
hashes before anything is used. A line stands for the checkpoint its `latest` names.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from datalines.tokenizer import EMBEDDED_EOS_TOKEN, PlainTextTokenizer
from engine.checkpoints.format import (
    EXTRA_FILE,
    LATEST_NAME,
    META_NAME,
    MODEL_FILE,
    OPTIMIZER_FILE,
    RUN_JSON_FILE,
    STATE_NAME,
    TOKENIZER_FILE,
    latest_file_problem,
    latest_name_problem,
    list_checkpoints,
    no_such_checkpoint,
    read_latest,
    update_of,
)
from engine.checkpoints.tensors import Checkpoint, load_checkpoint
from engine.config.json_fields import parse_json_text
from engine.config.run import RunConfig
from engine.errors import CheckpointError, LineError, NonFiniteLogits
from engine.generation.session import DecodeSession
from engine.generation.settings import SamplingSettings
from engine.layout import LineLayout
from engine.models.base import LanguageModel
from engine.models.build import build_model
from engine.models.presets import family_of
from engine.training.cpu_share import CpuSeat

SEPARATOR_TOKENS = (EMBEDDED_EOS_TOKEN, "</s>", "<|end_of_text|>", "<eos>")
"""Tokens taken for the document separator, in this order, when the model's config names none."""


@dataclass
class GenerationModel:
    """A checkpoint's model in eval mode on its device, with the tokenizer it was trained with."""

    model: LanguageModel
    """The model, weights and extra state (PSSA's banks) as the checkpoint holds them."""
    tokenizer: PlainTextTokenizer
    """The checkpoint's tokenizer.json."""
    directory: Path
    """The checkpoint directory."""
    preset: str
    """The model's preset (run.json `model.preset`)."""
    device: torch.device
    """Where the model runs."""
    separator: int | None
    """The token between documents in the training rows (`document_separator`); None if unknown."""
    seat: CpuSeat | None = field(default=None, repr=False)
    """On the CPU, this process's seat among the host's CPU trainers and generators
    (engine.training.cpu_share): a sampler beside a training line takes its share of the cores,
    not a spinning team of them all."""
    average: bool = False
    """Whether the parameters are the moving average the checkpoint keeps (`--ema`), not its weights."""

    def where(self) -> str:
        """The device, and on the CPU the threads this process runs of its team (`cpu (1 of 2
        threads)` beside another CPU process of nsconsole)."""
        if self.seat is None:
            return str(self.device)
        return f"{self.device} ({torch.get_num_threads()} of {self.seat.cores} threads)"

    def describe(self) -> str:
        """What is loaded, and where: the first line `sample`, `chat` and `eval` print."""
        weights = "the parameters' moving average" if self.average else "weights"
        parameters = self.model.num_parameters()
        return f"{self.directory} ({self.preset}, {parameters:,} parameters, {weights}) on {self.where()}"

    def overflowed(self, problem: str, doing: str) -> NonFiniteLogits:
        """The one line for a model whose logits hold NaN or inf (`problem`: what and where): the
        weights passed the load's check, so its activations overflow, and this checkpoint cannot
        `doing` ("generate", "be evaluated"); an earlier one of the line may."""
        return NonFiniteLogits(
            f"{self.directory}: {problem} (the weights are finite, so the activations overflow): this checkpoint "
            f"cannot {doing}; an earlier one may"
        )

    def session(self, settings: SamplingSettings) -> DecodeSession:
        """A decoding session on the model that takes its share of the cores between steps."""
        return DecodeSession(self.model, self.device, settings, self.share_cpu)

    def share_cpu(self) -> None:
        """Between steps: run this process's share of the cores (a no-op on a GPU; the seats are
        counted at most every CHECK_SECONDS)."""
        if self.seat is not None:
            self.seat.share()

    def prompt_ids(self, text: str) -> list[int]:
        """A prompt as the start of a document: the separator (when known), then the text encoded
        as training encoded documents (plain text: an added token written in it is its characters)."""
        encoded = self.tokenizer.encode_documents([text])[0].tolist() if text else []
        prompt = ([] if self.separator is None else [self.separator]) + encoded
        if not prompt:
            raise LineError(
                f"{self.directory / TOKENIZER_FILE}: names no document separator "
                f"({', '.join(SEPARATOR_TOKENS)}), so generation needs a prompt: give --prompt"
            )
        return prompt


def checkpoint_directory(path: Path) -> Path:
    """CHECKPOINT|LINE as a checkpoint directory: a checkpoint as it is, a line's `latest`."""
    if (path / META_NAME).exists():
        return path
    if update_of(path) is not None:  # a checkpoint's name: its directory, or what the line has instead
        if not path.is_dir():
            raise LineError(no_such_checkpoint(path))
        return path
    if (path / STATE_NAME).is_file() or (path / MODEL_FILE).is_file():
        # A checkpoint's files under another name (a copy, a `.partial` one) without the meta.json
        # written last: not a line with no checkpoint yet, which `nsconsole run` would start.
        return path
    layout = LineLayout(path)
    if not layout.checkpoints.is_dir():
        if not path.exists():
            raise LineError(f"{path}: no such checkpoint or training line")
        if layout.run_json.is_file():
            raise CheckpointError(_no_checkpoint_yet(path))
        parent = LineLayout(path.parent)
        if (path / LATEST_NAME).exists() or (parent.checkpoints == path and parent.run_json.is_file()):
            raise LineError(f"{path}: a line's checkpoints directory; name the line ({path.parent}) or one of "
                            f"its checkpoints ({path}/uNNNNNNNN)")  # fmt: skip
        raise LineError(f"{path}: neither a checkpoint (no {META_NAME}) nor a training line (no checkpoints/)")
    return _latest_checkpoint(layout.checkpoints)


def _latest_checkpoint(checkpoints: Path) -> Path:
    """The checkpoint a line's `latest` names; CheckpointError saying why there is none, with the
    checkpoints the line has (any of them can be named instead)."""
    problem = latest_file_problem(checkpoints)
    if problem is not None:
        raise CheckpointError(problem)
    names = [directory.name for directory in list_checkpoints(checkpoints)]
    name = read_latest(checkpoints)
    if name is None and not names:
        raise CheckpointError(_no_checkpoint_yet(checkpoints.parent))
    if name is None:
        raise CheckpointError(f"{latest_name_problem(checkpoints)}; name one of the line's checkpoints instead "
                              f"({', '.join(names)})")  # fmt: skip
    if name not in names:
        raise CheckpointError(f"{checkpoints / LATEST_NAME}: names {name}, which is not there (the line has "
                              f"{', '.join(names) or 'none'})")  # fmt: skip
    return checkpoints / name


def _no_checkpoint_yet(line: Path) -> str:
    return f"{line}: no checkpoint yet (a line writes its first when it starts training: nsconsole run {line})"


LOAD_ATTEMPTS = 3
"""How many of a line's `latest` checkpoints are tried while its trainer replaces them under the reader."""


def open_for_generation(
    source: Path, device: torch.device, average: bool = False, command: str = "sample"
) -> GenerationModel:
    """CHECKPOINT|LINE verified and loaded (`load_for_generation`). A running line's trainer removes
    the checkpoint `latest` named once newer ones are written (retention), possibly while it is
    read: a LINE then stands for its new `latest`, read again (up to LOAD_ATTEMPTS in all); a
    checkpoint named by its directory is refused in one line."""
    directory = checkpoint_directory(source)
    for _ in range(LOAD_ATTEMPTS - 1):
        try:
            return load_for_generation(directory, device, average, command)
        except CheckpointError:
            newer = _newer_latest(source, directory)
            if newer is None:
                raise
            directory = newer
    return load_for_generation(directory, device, average, command)


def _newer_latest(source: Path, directory: Path) -> Path | None:
    """The checkpoint a LINE's `latest` names now, when it has moved on from `directory`; None for
    a checkpoint named by its directory, or a line whose `latest` names no other."""
    try:
        newer = checkpoint_directory(source)
    except LineError:
        return None
    return None if newer == directory else newer


def refuse_outside_tokenizer(directory: Path, data: str | None, tokenizer: str | None) -> None:
    """A checkpoint carries its tokenizer: one from a data line or a file could differ from it."""
    given = "--data" if data is not None else "--tokenizer" if tokenizer is not None else None
    if given is not None:
        raise LineError(
            f"{directory}: carries the tokenizer its weights were trained with ({TOKENIZER_FILE}); "
            f"{given} is refused (a tokenizer from elsewhere would not be the one it learned)"
        )


def load_for_generation(
    directory: Path, device: torch.device, average: bool = False, command: str = "sample"
) -> GenerationModel:
    """Verify and load a checkpoint's model (its parameters' moving average with `average`; a
    refusal then names `command`, the one to run without --ema)."""
    checkpoint = _read_checkpoint(directory, average)
    run_json = directory / RUN_JSON_FILE
    try:
        text = checkpoint.run_json.decode("utf-8")
    except UnicodeDecodeError as error:
        raise CheckpointError(f"{run_json}: not UTF-8 ({error})") from None
    model_config = RunConfig.from_dict(parse_json_text(text, str(run_json)), source=str(run_json)).model
    preset, overrides = model_config.preset, model_config.overrides
    try:
        with torch.device("meta"):  # the class alone: no memory, no initialisation
            decodes = type(build_model(preset, overrides)).decodes()
    except LineError as error:  # a preset or override this nsconsole does not know (a newer one's checkpoint)
        raise CheckpointError(f"{run_json}: {error}") from None
    if not decodes:
        raise LineError(
            f"{directory}: {preset} has no stepwise decoder yet (the {family_of(preset)} family's "
            "decode is still to come), so it cannot be sampled from"
        )
    weights = _averaged_weights(checkpoint, command) if average else checkpoint.weights
    with torch.device(device):  # built where it runs: a 2B model's initialisation is quick on a GPU
        model = build_model(preset, overrides).eval()
    _load_parameters(model, weights, directory / (OPTIMIZER_FILE if average else MODEL_FILE))
    model_extra = {k[len("model/") :]: v.to(device) for k, v in checkpoint.extra.items() if k.startswith("model/")}
    try:
        model.load_extra_state_dict(model_extra)
    except ValueError as error:
        raise CheckpointError(f"{directory / EXTRA_FILE}: {error}") from None
    tokenizer = _tokenizer(checkpoint, model)
    seat = CpuSeat.take() if device.type == "cpu" else None
    separator = document_separator(model, tokenizer)
    loaded = GenerationModel(model, tokenizer, directory, preset, device, separator, seat, average)
    loaded.share_cpu()
    return loaded


def _read_checkpoint(directory: Path, average: bool) -> Checkpoint:
    """`load_checkpoint` (every file checked against meta.json first; of the optimizer's tensors
    only the parameters' average, and that with `average`) with a file that vanished while it was
    read said in one line: a running line's retention removes old checkpoints."""
    try:
        return load_checkpoint(directory, optimizer_keys=("ema",) if average else ())
    except (CheckpointError, OSError) as error:
        if not directory.is_dir():
            raise CheckpointError(
                f"{directory}: removed while it was read (its line's trainer keeps only some checkpoints: "
                "name the line for its latest, or a checkpoint it keeps)"
            ) from None
        if isinstance(error, OSError):
            raise CheckpointError(f"{error.filename or directory}: unreadable ({error.strerror or error})") from None
        raise


def document_separator(model: LanguageModel, tokenizer: PlainTextTokenizer) -> int | None:
    """The token between documents in training rows: the model config's `eos_id` where it has one
    (the NS presets), else the first of SEPARATOR_TOKENS the tokenizer has; None when neither."""
    eos_id = getattr(getattr(model, "config", None), "eos_id", None)
    if eos_id is not None:
        return int(eos_id)
    for token in SEPARATOR_TOKENS:
        token_id = tokenizer.full.token_to_id(token)
        if token_id is not None:
            return int(token_id)
    return None


def refuse_absent_average(directory: Path, command: str) -> None:
    """CheckpointError when the checkpoint's state.json says it keeps no parameter average: said
    before `eval` reads its tasks (their datasets may take minutes to download) and the checkpoint
    loads. The load checks the average itself, the files' hashes first, again; a state.json that
    cannot be read is left to it, which says what is wrong with the file."""
    try:
        state = json.loads((directory / STATE_NAME).read_text())
    except (OSError, ValueError):
        return
    if isinstance(state, dict) and not state.get("ema_started", False):
        raise CheckpointError(_no_average(directory, state.get("update"), command))


def _no_average(directory: Path, update: object, command: str) -> str:
    return (f"{directory / OPTIMIZER_FILE}: no parameter average at update {update} (run.json sets no `ema`, "
            f"or the average had not started yet); {command} without --ema")  # fmt: skip


def _averaged_weights(checkpoint: Checkpoint, command: str) -> dict[str, torch.Tensor]:
    """The parameters' moving average by name, cut from its flat buffer by the checkpoint's layout."""
    average = checkpoint.optimizer.get("ema")
    if average is None or not checkpoint.state.get("ema_started", False):
        raise CheckpointError(_no_average(checkpoint.directory, checkpoint.update, command))
    try:
        return {
            str(name): average[int(offset) : int(offset) + math.prod(shape)].view(tuple(shape))
            for name, offset, shape in checkpoint.state["layout"]
        }
    except (KeyError, TypeError, ValueError, RuntimeError) as error:
        raise CheckpointError(f"{checkpoint.directory}: state.json's layout does not cut the average ({error})") from None


@torch.no_grad()
def _load_parameters(model: LanguageModel, weights: dict[str, torch.Tensor], where: Path) -> None:
    parameters = dict(model.named_parameters())
    missing, extra = sorted(set(parameters) - set(weights)), sorted(set(weights) - set(parameters))
    if missing or extra:
        raise CheckpointError(f"{where}: its weights do not fit the model (missing {missing[:3]}, extra {extra[:3]})")
    for name, parameter in parameters.items():
        if tuple(weights[name].shape) != tuple(parameter.shape):
            shape = tuple(weights[name].shape)
            raise CheckpointError(f"{where}: {name} has shape {shape}, the model {tuple(parameter.shape)}")
        if not bool(torch.isfinite(weights[name]).all()):  # every text would be NaN draws or scores
            raise CheckpointError(f"{where}: {name} holds non-finite values (NaN or inf)")
        parameter.copy_(weights[name])


def _tokenizer(checkpoint: Checkpoint, model: LanguageModel) -> PlainTextTokenizer:
    where = checkpoint.directory / TOKENIZER_FILE
    try:
        tokenizer = PlainTextTokenizer(checkpoint.tokenizer_json.decode("utf-8"), str(where))
    except UnicodeDecodeError as error:
        raise CheckpointError(f"{where}: not UTF-8 ({error})") from None
    vocab = model.embed.weight.shape[0]
    if tokenizer.vocab_size > vocab:
        raise CheckpointError(f"{where}: {tokenizer.vocab_size} tokens, more than the model's vocabulary of {vocab}")
    return tokenizer
