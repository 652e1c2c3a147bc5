"""What `sample` and `chat` share: the checkpoint argument, the sampling options, opening the model.

Nothing here imports torch at import time (`--help` stays light): `open_model` loads it when a
command runs.
"""

from __future__ import annotations

import argparse
import secrets
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from engine.errors import LineError
from engine.generation.settings import SamplingSettings
from nsconsole.commands.parser import SEED_RANGE, positive_int, seed

if TYPE_CHECKING:
    from engine.generation.loading import GenerationModel

DEFAULTS = SamplingSettings()


def _setting(name: str) -> Callable[[str], float]:
    """An argparse type checking one field by SamplingSettings' own rule."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        try:
            SamplingSettings(**{name: value})
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        return value

    return parse


def utf8_text(text: str, what: str) -> str:
    """`text`, or LineError naming `what` when it holds bytes that are not UTF-8: Python reads the
    command line (and stdin in a C or POSIX locale) with such bytes kept as lone surrogates, which
    the tokenizer meets with a traceback."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        byte = ord(text[error.start]) & 0xFF  # a surrogate U+DCxx stands for the byte 0xxx
        raise LineError(f"{what} is not UTF-8 text (byte 0x{byte:02x} at character {error.start})") from None
    return text


def read_utf8(read: Callable[[], str], what: str) -> str:
    """What `read` (of stdin) returns, checked by `utf8_text`; a strict decoder's error (stdin in a
    UTF-8 locale) is the same one line."""
    try:
        text = read()
    except UnicodeDecodeError as error:
        raise LineError(f"{what} is not UTF-8 text ({error.reason})") from None
    return utf8_text(text, what)


def add_generation_arguments(parser: argparse.ArgumentParser, tokens_help: str, tokens_default: int) -> None:
    """The checkpoint and the sampling options of `sample` and `chat`."""
    parser.add_argument("source", metavar="CHECKPOINT|LINE",
                        help="a checkpoint directory (LINE/checkpoints/uNNNNNNNN), or a line: its latest checkpoint")
    parser.add_argument("--tokens", type=positive_int, default=tokens_default, metavar="N", help=tokens_help)
    parser.add_argument("--temperature", type=_setting("temperature"), default=DEFAULTS.temperature, metavar="T",
                        help="divide the logits by T before drawing; 0: always the most likely token "
                        f"(default {DEFAULTS.temperature})")
    parser.add_argument("--top-p", type=_setting("top_p"), default=DEFAULTS.top_p, metavar="P",
                        help="draw among the most likely tokens that first reach probability P together; "
                        f"1: from all (default {DEFAULTS.top_p})")
    parser.add_argument("--seed", type=seed, default=None, metavar="S",
                        help=f"seed of the draws, {SEED_RANGE}: the same seed gives the same text "
                        "(default: a fresh one, printed)")
    parser.add_argument("--ema", action="store_true",
                        help="use the parameters' moving average the checkpoint keeps (run.json `ema`)")
    parser.add_argument("--device", default="auto", help="auto (the GPU when there is one), cpu or cuda[:N]")
    parser.add_argument("--data", default=None, metavar="PATH",
                        help="refused: a checkpoint carries the tokenizer it was trained with")
    parser.add_argument("--tokenizer", default=None, metavar="FILE",
                        help="refused: a checkpoint carries the tokenizer it was trained with")


def open_model(args: argparse.Namespace) -> tuple[GenerationModel, SamplingSettings]:
    """The checkpoint the arguments name, verified and loaded, and the sampling settings; the
    header line (what is sampled, where, at which seed) goes to stderr."""
    from engine.generation.loading import checkpoint_directory, open_for_generation, refuse_outside_tokenizer
    from engine.training.trainer import resolve_device

    source = args.host_settings.resolve_line(args.source)
    refuse_outside_tokenizer(checkpoint_directory(source), args.data, args.tokenizer)
    device = resolve_device(args.device, "--device")
    loaded = open_for_generation(source, device, average=args.ema, command=args.command)
    seed = args.seed if args.seed is not None else secrets.randbelow(2**31)
    settings = SamplingSettings(temperature=args.temperature, top_p=args.top_p, seed=seed)
    print(f"{loaded.describe()}, seed {seed}", file=sys.stderr)
    return loaded, settings
