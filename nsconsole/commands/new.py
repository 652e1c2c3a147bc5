"""`nsconsole new LINE --model PRESET --data DIR [...]`: create a training line."""

from __future__ import annotations

import argparse
import json
from typing import Any

from engine.config.json_fields import parse_value
from engine.config.run import RampPiece
from engine.errors import ConfigError
from nsconsole.commands.parser import add_command

HELP = "LINE --model PRESET --data DIR: create a training line (its run.json) from a model preset"
DESCRIPTION = """\
Create the training line directory LINE with a validated run.json. Refuses, writing nothing,
when LINE already holds a run.json, the preset is unknown or the data line is missing. The
model's vocab_size follows the data line's tokenizer. Until the line's first start run.json may
be edited freely (the learning-rate schedule, the batch ramp, the seeds): the first start that
passes its checks accepts it (accepted_run.json), and from then on its lifelong keys may only
change as allow_changes permits. It prints what the line's checkpoints will take on disk (one
checkpoint, and everything retention keeps) and warns when the disk cannot hold it, or when the
line would end inside its learning-rate warmup (lr.pieces; 2e8 tokens unless changed) because its
plan or its data line is shorter: lower that piece's `until` before the first start.
"""
EXAMPLES = """\
examples:
  nsconsole new runs/trunk --model ns-2b --data /data/lines/trunk --peak-lr 3e-4
  nsconsole new runs/small --model ns-tiny --data /data/lines/demo --seq-len 512 \\
      --tokens-per-update 16384 --override n_layers=8
  # a batch-size ramp whose weight decay follows the batch (0.1 at 1M tokens per update)
  nsconsole new runs/trunk --model ns-2b --data /data/lines/trunk --tokens-per-update \\
      '[{"from":0,"to":4.7e9,"tokens":262144},{"from":4.7e9,"to":null,"tokens":393216}]' \\
      --weight-decay-batch 1048576 --ema-horizon-tokens 2e9
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(subparsers, "new", summary=HELP, description=DESCRIPTION, examples=EXAMPLES)
    parser.add_argument("line", metavar="LINE", help="the training line directory to create")
    parser.add_argument("--model", required=True, metavar="PRESET", help="model preset (e.g. ns-2b)")
    parser.add_argument("--data", required=True, metavar="DIR", help="the data line directory")
    parser.add_argument("--peak-lr", type=float, metavar="X", help="peak learning rate (default 3e-4)")
    parser.add_argument(
        "--tokens-per-update",
        metavar="N|JSON",
        help="tokens per update, or a ramp: a JSON list of {from, to, tokens} pieces (default about 262144)",
    )
    parser.add_argument(
        "--weight-decay-batch",
        type=_whole_number,
        metavar="N",
        help="scale weight decay with the batch: the configured decay at N tokens per update",
    )
    parser.add_argument(
        "--ema-horizon-tokens",
        type=float,
        metavar="N",
        help="keep a parameter average with this horizon in tokens, starting at as many tokens trained",
    )
    parser.add_argument("--seq-len", type=int, metavar="T", help="the trunk's sequence length (default 4096)")
    parser.add_argument(
        "--device", default="auto", metavar="D",
        help="auto (the first GPU whose lease is free, else the CPU), cpu, cuda or cuda:N (default auto)",
    )
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        type=parse_override,
        metavar="KEY=VALUE",
        help="replace a preset config field (VALUE as JSON, else a string); repeatable",
    )
    parser.set_defaults(func=run)


def _whole_number(text: str) -> int:
    """An integer argument that may be written in float notation (1e6)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value.is_integer():
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}")
    return int(value)


def parse_override(text: str) -> tuple[str, Any]:
    """`--override KEY=VALUE`: VALUE read as JSON (`64`, `true`, `[1, 2]`), else taken as a string."""
    key, separator, value = text.partition("=")
    if not separator or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def parse_tokens_per_update(text: str) -> int | list[RampPiece]:
    """`--tokens-per-update`: a number or a JSON ramp, type-checked like run.json's key."""
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError(f"--tokens-per-update: not a number or JSON ramp ({error.msg})") from None
    return parse_value(document, int | list[RampPiece], "tokens_per_update", "--tokens-per-update")


def run(args: argparse.Namespace) -> int:
    from engine.ops.new import NewLineOptions, new_line

    host = args.host_settings
    line = host.resolve_line(args.line)
    options = NewLineOptions(
        preset=args.model,
        data=host.resolve_line(args.data),
        peak_lr=args.peak_lr,
        tokens_per_update=(
            parse_tokens_per_update(args.tokens_per_update) if args.tokens_per_update is not None else None
        ),
        weight_decay_batch=args.weight_decay_batch,
        ema_horizon_tokens=args.ema_horizon_tokens,
        seq_len=args.seq_len,
        overrides=dict(args.override),
        device=args.device,
    )
    config = new_line(line, options)
    model = config.model.preset
    if config.model.overrides:
        model += f" with overrides {json.dumps(config.model.overrides, sort_keys=True)}"
    print(f"created {line}: {model} on {config.data.line}, device {config.device}")
    # What its checkpoints need: said now, while the settings are easy to change (a warning, not a
    # refusal: the disk may be freed before the start, which refuses a line with no room to start).
    from engine.layout import LineLayout
    from engine.ops.check import disk_results, warmup_results  # torch: the model's size, on the meta device

    layout = LineLayout(line)
    for result in disk_results(layout, config):
        print(f"{'warning: ' if not result.ok or result.warning else ''}{result.message}")
    # A warmup the line would never leave: said now, while run.json may still change (a warning).
    for result in warmup_results(layout, config):
        if result.warning:
            print(f"warning: {result.message}")
    print(f"next: nsconsole tune {args.line}; nsconsole check {args.line}; nsconsole run {args.line}")
    return 0
