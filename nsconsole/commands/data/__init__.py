"""`nsconsole data`: create data lines, build validation rows, prepare and rebuild cycles, tokenizers.

The command's parser is made here (`register`), with its texts from `help_texts.py`; each
subcommand runs from its own module: `init.py`, `val.py`, `preparer.py` (run-preparer),
`status.py`, `schedule.py`, `rebuild.py`, `tokenizer.py`; `paths.py` resolves the data lines they
are given. Every one of them is imported when `nsconsole` starts (to register the command):
datalines (numpy, pyarrow), rich and the preparer's modules load only in the subcommands that use
them, so `nsconsole --help` and the other commands start without them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from nsconsole.commands.data.help_texts import DESCRIPTION, EXAMPLES, SUBCOMMANDS
from nsconsole.commands.data.init import run_init
from nsconsole.commands.data.preparer import PreparerView, run_preparer_command
from nsconsole.commands.data.rebuild import run_rebuild
from nsconsole.commands.data.schedule import run_schedule
from nsconsole.commands.data.status import EXIT_DAMAGED, run_status
from nsconsole.commands.data.tokenizer import run_tokenizer
from nsconsole.commands.data.val import run_val
from nsconsole.commands.parser import add_command, gib_amount, positive_int

# Importable from here, where the data lines' tests import them (as when this was one module).
__all__ = ["EXIT_DAMAGED", "PreparerView", "register"]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(
        subparsers,
        "data",
        summary="data lines: init, val, run-preparer, status, schedule, rebuild, tokenizer",
        description=DESCRIPTION,
        examples=EXAMPLES,
    )
    commands = parser.add_subparsers(dest="data_command", metavar="SUBCOMMAND", required=True)

    init = _subcommand(commands, "init")
    init.add_argument("--work", type=Path, required=True, help="the data line directory to create")
    init.add_argument("--embedded", action="store_true", help="the demo line on Python's standard library")
    init.add_argument(
        "--recipe", type=Path, help="recipe JSON (sources, shares, held-out, markers, schedule)"
    )
    init.add_argument("--eos-id", type=int, help="the tokenizer's end-of-document id")
    init.add_argument(
        "--cycle-tokens", type=float, help="tokens per cycle (e.g. 2e10; --embedded: 1e6 unless given)"
    )
    init.add_argument("--tokenizer", type=Path, help="tokenizers JSON (overrides the recipe's and host.json's)")
    init.add_argument(
        "--calibration-from",
        type=Path,
        metavar="DATA_LINE",
        help="reuse this data line's calibration of the sources it shares (default: host.json's)",
    )
    init.add_argument(
        "--like", type=Path, metavar="DATA_LINE", help="make a line identical to this data line (nothing else given)"
    )
    init.set_defaults(func=run_init)

    val = _subcommand(commands, "val")
    val.add_argument("--work", type=Path, required=True)
    val.add_argument("--seq-len", type=positive_int, help="training row length (default 4096, as `nsconsole new`)")
    val.add_argument(
        "--long-seq-len", type=int, help="also rows of this (longer) length (default 32768; 0: none)"
    )
    val.add_argument(
        "--line", dest="for_line", metavar="LINE", help="the lengths this training line validates at"
    )
    val.set_defaults(func=run_val)

    preparer = _subcommand(commands, "run-preparer")
    preparer.add_argument("--work", type=Path, required=True)
    preparer.add_argument("--ahead", type=positive_int, default=2, help="cycles kept ready ahead of the trainer")
    preparer.add_argument(
        "--min-free-gb",
        type=gib_amount,
        help="free disk kept beside the next cycle's downloads (GiB; default about 3 cycles of shards + 1)",
    )
    preparer.add_argument("--once", action="store_true", help="exit once the wanted cycles are ready")
    preparer.set_defaults(func=run_preparer_command)

    status = _subcommand(commands, "status")
    status.add_argument("--work", type=Path, required=True)
    status.add_argument("--json", action="store_true", help="print one JSON object")
    status.set_defaults(func=run_status)

    schedule = _subcommand(commands, "schedule")
    schedule.add_argument("--work", type=Path, required=True)
    schedule.add_argument(
        "--from-tokens", type=float, required=True, help="a cycle boundary after the last piece"
    )
    schedule.add_argument("--shares", required=True, help='JSON, e.g. \'{"web": 0.5, "code": 0.5}\'')
    schedule.set_defaults(func=run_schedule)

    rebuild = _subcommand(commands, "rebuild")
    rebuild.add_argument("--work", type=Path, required=True)
    rebuild.add_argument("--cycle", type=int, required=True)
    rebuild.set_defaults(func=run_rebuild)

    tokenizer = _subcommand(commands, "tokenizer")
    tokenizer.add_argument("--train", action="store_true", required=True, help="train (the only action)")
    tokenizer.add_argument(
        "--source",
        action="append",
        help="a directory of text/jsonl/parquet files, or `embedded`",
    )
    tokenizer.add_argument(
        "--recipe", type=Path, help="train on this recipe's sources instead (as data init reads them)"
    )
    tokenizer.add_argument("--vocab", type=int, default=8192, help="vocabulary size")
    tokenizer.add_argument("--out", type=Path, required=True, help="the tokenizer JSON to write (a new file)")
    tokenizer.add_argument("--force", action="store_true", help="overwrite --out when it exists")
    tokenizer.add_argument("--text-field", help="parquet column / jsonl field of every --source (default text)")
    tokenizer.add_argument(
        "--special", action="append", help="special tokens, ids 0, 1, ... (default: <|endoftext|>)"
    )
    tokenizer.set_defaults(func=run_tokenizer)


def _subcommand(commands: argparse._SubParsersAction, name: str) -> argparse.ArgumentParser:
    summary, description, examples = SUBCOMMANDS[name]
    return add_command(commands, name, summary=summary, description=description, examples=examples)
