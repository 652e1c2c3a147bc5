"""`nsconsole data`: create data lines, build validation rows, prepare and rebuild cycles, tokenizers."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from engine.units import gib_bytes
from nsconsole.commands.parser import add_command

# datalines (numpy, pyarrow), rich and the preparer's modules load only in the commands that use
# them: `nsconsole --help` and the other commands start without them.
if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress, TaskID

    from datalines.status import PreparerStatus

SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "init": (
        "create a data line (pins inputs, calibrates)",
        """\
Create a data line in --work: pin every input (hub commit shas, each file's sha256, the
tokenizer's sha256), calibrate the tokens per byte of every stratum and plan the cycles.
--embedded makes the demo line from the Python standard library, with a byte-level BPE (vocab
8192) trained on the spot; a line from a recipe needs --recipe, --eos-id and --cycle-tokens (and
a tokenizer: --tokenizer, else the recipe's, else host.json's `tokenizer`). --calibration-from
(default: host.json's `calibration_from`) names a data line whose calibration a source takes
when its files, tokenizer, strata and control markers are that line's, instead of measuring it.
--like DATA makes a line identical to DATA (its recipe, pins, tokenizer, EOS id, cycle size and
calibration: the same cycles and held-out rows, byte for byte), for a second training line on
the same data: a data line is consumed by the line that trains on it.
""",
        """\
examples:
  nsconsole data init --work lines/demo --embedded
  nsconsole data init --work lines/trunk --recipe recipe.json --tokenizer tok.json --eos-id 0 \\
      --cycle-tokens 2e10
  nsconsole data init --work lines/trunk-b --like lines/trunk
""",
    ),
    "val": (
        "build validation rows from the held-out documents",
        """\
Build validation rows of --seq-len tokens (and of --long-seq-len, for the long-row probes) from
the held-out documents of every source, every stratum at its share, into <work>/val/T<length>/.
The defaults are what `nsconsole new` gives a line: 4096, and 32768, the longest context of the
presets (--long-seq-len 0: none); --line LINE builds the lengths that training line validates at.
A trainer refuses to start without the rows of every length it validates at. Each length is
built on its own: one that no source has a row of is left out, with a line saying by how many
tokens each source falls short, and the exit status is 1; the others are built all the same.
""",
        """\
examples:
  nsconsole data val --work lines/trunk
  nsconsole data val --work lines/trunk --seq-len 4096 --long-seq-len 32768
  nsconsole data val --work lines/demo --line runs/demo
""",
    ),
    "run-preparer": (
        "keep the next cycles ready (download, tokenize, delete)",
        """\
Keep the next --ahead cycles ready: download, tokenize and write each cycle's shards (retrying
failures with backoff), wait while free disk is below the next cycle's downloads plus
--min-free-gb, delete the shards of consumed cycles. Runs until interrupted, or with --once
until the wanted cycles are ready; its state is in <work>/preparer.json. A training line's
supervisor runs one itself.
""",
        """\
examples:
  nsconsole data run-preparer --work lines/trunk --ahead 2
  nsconsole data run-preparer --work lines/demo --once
""",
    ),
    "status": (
        "cycles (planned, ready, consumed), validation, preparer",
        """\
Show a data line: its sources' shares, the tokens per cycle, the last cycle (once the data's end
is known), every cycle's state (planned, ready, empty, consumed, reopened: a consumed cycle a
rollback reopened, its shards to rebuild from its manifest, damaged), the validation row lengths
built and the preparer's state; --json prints it as one JSON object. Exit status 0 when no
cycle is damaged, 1 when one is (each named with its damaged files, as above; `data rebuild`
repairs it), 2 when the data line itself cannot be read (one line naming the file).
""",
        """\
examples:
  nsconsole data status --work lines/trunk
  nsconsole data status --work lines/trunk --json
""",
    ),
    "schedule": (
        "append a piece of shares to the schedule's end",
        """\
Append a piece to the line's schedule: from the cycle boundary --from-tokens (after the last
piece's start) the sources are mixed at --shares (normalised). The schedule is append-only; a
piece applies from the first cycle starting at or after it.
""",
        """\
examples:
  nsconsole data schedule --work lines/trunk --from-tokens 6e10 --shares '{"web": 0.5, "chat": 0.5}'
""",
    ),
    "rebuild": (
        "rebuild a cycle from its manifest, byte for byte",
        """\
Rebuild a cycle's shards from its permanent manifest (its plan, the pinned inputs and the
tokenizer) and check every shard against the manifest byte for byte, or fail naming the
difference. Refused while a preparer runs on the line (it rebuilds the damaged and reopened
cycles it keeps ready itself), and a preparer is refused while it runs (a line's supervisor
starts its own once it ends). The hub files it downloads again are deleted after it, unless a
cycle still to be prepared reads them.
""",
        """\
examples:
  nsconsole data rebuild --work lines/trunk --cycle 3
""",
    ),
    "tokenizer": (
        "train a byte-level BPE tokenizer",
        """\
Train a byte-level BPE tokenizer of --vocab tokens on every --source (a directory of text, jsonl
or parquet files, or `embedded`: the Python standard library) and write it to --out as a
tokenizers JSON. The special tokens get ids 0, 1, ... (default: <|endoftext|>).
""",
        """\
examples:
  nsconsole data tokenizer --train --source /data/chat --source /data/web --vocab 8192 --out tok.json
  nsconsole data tokenizer --train --source embedded --vocab 2048 --out stdlib.json
""",
    ),
}
"""Each subcommand's summary (its line in `nsconsole data --help`), description and examples."""
DESCRIPTION = """\
Data lines: directories of pre-tokenized data trained in fixed-size cycles, every input pinned so
that any cycle can be rebuilt byte for byte. Create one (init), build its validation rows (val),
keep its next cycles ready (run-preparer), inspect it (status), extend its schedule (schedule),
rebuild a cycle (rebuild); train a tokenizer (tokenizer). A data line named by --work, --like or
--calibration-from is found as every LINE and `new --data DIR` are: a relative path that does
not exist relative to the current directory is taken under host.json's `work_root` (without one,
under ~/.nsconsole/lines where it exists there), so `data init --work lines/d` makes the line
that `nsconsole new ... --data lines/d` finds.
"""
EXAMPLES = """\
examples:
  nsconsole data init --work lines/demo --embedded
  nsconsole data val --work lines/demo --seq-len 256
  nsconsole data status --work lines/demo
"""


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
    val.add_argument("--seq-len", type=int, help="training row length (default 4096, as `nsconsole new`)")
    val.add_argument(
        "--long-seq-len", type=int, help="also rows of this (longer) length (default 32768; 0: none)"
    )
    val.add_argument(
        "--line", dest="for_line", metavar="LINE", help="the lengths this training line validates at"
    )
    val.set_defaults(func=run_val)

    preparer = _subcommand(commands, "run-preparer")
    preparer.add_argument("--work", type=Path, required=True)
    preparer.add_argument("--ahead", type=int, default=2, help="cycles kept ready ahead of the trainer")
    preparer.add_argument(
        "--min-free-gb",
        type=float,
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
        required=True,
        help="a directory of text/jsonl/parquet files, or `embedded`",
    )
    tokenizer.add_argument("--vocab", type=int, default=8192, help="vocabulary size")
    tokenizer.add_argument("--out", type=Path, required=True, help="the tokenizer JSON to write")
    tokenizer.add_argument("--text-field", default="text", help="parquet column / jsonl field")
    tokenizer.add_argument(
        "--special", action="append", help="special tokens, ids 0, 1, ... (default: <|endoftext|>)"
    )
    tokenizer.set_defaults(func=run_tokenizer)


def _subcommand(commands: argparse._SubParsersAction, name: str) -> argparse.ArgumentParser:
    summary, description, examples = SUBCOMMANDS[name]
    return add_command(commands, name, summary=summary, description=description, examples=examples)


def run_init(args: argparse.Namespace) -> int:
    from datalines.creation import EMBEDDED_CYCLE_TOKENS, init_data_line, init_embedded_line
    from datalines.errors import DataLineError

    if args.like is not None:
        others = (("--embedded", args.embedded or None), ("--recipe", args.recipe), ("--eos-id", args.eos_id),
                  ("--cycle-tokens", args.cycle_tokens), ("--tokenizer", args.tokenizer),
                  ("--calibration-from", args.calibration_from))  # fmt: skip
        given = [flag for flag, value in others if value is not None]
        if given:
            raise DataLineError(f"data init --like takes everything from {args.like}; drop {', '.join(given)}")
        from datalines.identical import init_like_line

        like = _data_line_path(args, args.like)
        line = init_like_line(_data_line_path(args, args.work), like)
        print(f"data line {line.path}: identical to {like} (sources {', '.join(line.sources)}, "
              f"vocab {line.vocab_size}, {line.cycle_tokens:,} tokens per cycle)")  # fmt: skip
        return 0
    if args.cycle_tokens is not None and not args.cycle_tokens.is_integer():
        raise DataLineError(f"--cycle-tokens must be a whole number, got {args.cycle_tokens}")
    if args.embedded:
        if args.recipe or args.eos_id is not None or args.tokenizer or args.calibration_from:
            raise DataLineError(
                "data init --embedded takes no --recipe, --eos-id, --tokenizer or --calibration-from "
                "(it trains its own tokenizer and calibrates on it)"
            )
        cycle_tokens = EMBEDDED_CYCLE_TOKENS if args.cycle_tokens is None else int(args.cycle_tokens)
        line = init_embedded_line(_data_line_path(args, args.work), cycle_tokens)
    else:
        missing = [flag for flag, value in (("--recipe", args.recipe), ("--eos-id", args.eos_id),
                                            ("--cycle-tokens", args.cycle_tokens)) if value is None]
        if missing:
            raise DataLineError(f"data init needs {', '.join(missing)} (or --embedded)")
        host = args.host_settings
        named = _data_line_path(args, args.calibration_from) if args.calibration_from else None
        calibration_from = named or _host_path(host.calibration_from)
        line = init_data_line(
            _data_line_path(args, args.work), args.recipe, args.eos_id, int(args.cycle_tokens), args.tokenizer,
            default_tokenizer=_host_path(host.tokenizer), calibration_from=calibration_from,
        )  # fmt: skip
    last = line.last_cycle()
    print(
        f"data line {line.path}: sources {', '.join(line.sources)}, vocab {line.vocab_size}, "
        f"eos {line.eos_id}, "
        f"{line.cycle_tokens:,} tokens per cycle" + (f", last cycle {last}" if last is not None else "")
    )
    taken = line.config.get("calibration_from")
    if taken:
        print(f"calibration of {', '.join(taken['sources'])} taken from {taken['line']}")
    return 0


def _data_line_path(args: argparse.Namespace, path: Path) -> Path:
    """A data line named on the command line (--work, --like, --calibration-from), resolved as every
    LINE and `new --data DIR` are (`HostSettings.resolve_line`: the current directory, else
    host.json's `work_root`; absolute), so `data init --work lines/d` makes the line that
    `new --data lines/d` then finds, and dataline.json records absolute paths."""
    return args.host_settings.resolve_line(path)


def _host_path(setting: str | None) -> Path | None:
    """A path setting of host.json (`~` expanded), None when unset."""
    return Path(setting).expanduser() if setting else None


def run_val(args: argparse.Namespace) -> int:
    from datalines import open_data_line
    from datalines.errors import DataLineError
    from datalines.validation import build_validation
    from engine.config.run import DEFAULT_SEQ_LEN
    from engine.ops.val_lengths import default_long_seq_len, line_lengths

    if args.for_line is not None:
        if args.seq_len is not None or args.long_seq_len is not None:
            raise DataLineError("data val: give --line or --seq-len / --long-seq-len, not both")
        lengths = line_lengths(args.host_settings.resolve_line(args.for_line))
    else:
        seq_len = DEFAULT_SEQ_LEN if args.seq_len is None else args.seq_len
        long_seq_len = default_long_seq_len() if args.long_seq_len is None else args.long_seq_len
        lengths = [seq_len] + ([long_seq_len] if long_seq_len > 0 and long_seq_len != seq_len else [])
    built = build_validation(open_data_line(_data_line_path(args, args.work)), lengths)
    for length in built:
        print(length.describe())
    return 0 if all(length.built for length in built) else 1


def run_status(args: argparse.Namespace) -> int:
    from datalines import open_data_line
    from datalines.service import preparer_running
    from datalines.status import RUNNING_STATES, read_status

    line = open_data_line(_data_line_path(args, args.work))
    validation = sorted(int(path.name[1:]) for path in (line.path / "val").glob("T*") if path.is_dir())
    states = {index: line.cycle_state(index) for index in line.known_cycles()}
    report = {
        "path": str(line.path),
        "sources": line.shares(0),
        "cycle_tokens": line.cycle_tokens,
        "last_cycle": line.last_cycle(),
        "cycles": states,
        # What is wrong with each damaged cycle, naming every file: its manifest, or its shards.
        "problems": {index: line.cycle_problem(index) for index, state in states.items() if state == "damaged"},
        "validation_seq_lens": validation,
        "preparer": read_status(line.path),
        # preparer.json keeps a killed preparer's last state: whether one runs is its lock's say.
        "preparer_running": preparer_running(line.path),
    }
    status = EXIT_DAMAGED if report["problems"] else 0
    if args.json:
        print(json.dumps(report))
        return status
    shares = ", ".join(f"{name} {share:.3g}" for name, share in report["sources"].items())
    print(f"data line {line.path}: {shares}; {line.cycle_tokens:,} tokens per cycle")
    last = report["last_cycle"]
    print(f"last cycle: {last if last is not None else 'not known yet'}")
    for index, state in report["cycles"].items():
        shown = REOPENED_TEXT if state == "reopened" else state
        print(f"  cycle {index:4d}  {shown}" + (f": {report['problems'][index]}" if state == "damaged" else ""))
    print(f"validation rows: {', '.join(f'T{length}' for length in validation) or 'none (run data val)'}")
    preparer = report["preparer"]
    if preparer:
        reopened = [str(index) for index, state in report["cycles"].items() if state != "consumed"]
        if preparer["state"] == "finished" and reopened:
            # Its message ("every cycle ... is consumed") was true when it finished, before a rollback.
            cycles = f"cycle{'s' if len(reopened) > 1 else ''} {', '.join(reopened)}"
            print(f"preparer: finished (pid {preparer['pid']}) when every cycle was consumed; reopened since: "
                  f"{cycles}, whose shards the next preparer rebuilds (the line's supervisor runs one, or "
                  f"`nsconsole data run-preparer --work {line.path}`)")  # fmt: skip
        elif preparer["state"] in RUNNING_STATES and not report["preparer_running"]:
            print(f"preparer: not running (its last status, pid {preparer['pid']}: {preparer['state']}: "
                  f"{preparer['message']}; it stopped without a word: killed or crashed)")  # fmt: skip
        else:
            print(f"preparer: {preparer['state']} (pid {preparer['pid']}): {preparer['message']}")
    return status


EXIT_DAMAGED = 1
"""`data status`'s exit status when it reports a damaged cycle: a script (or a cron check) sees the
damage without parsing the report; 1, as `check` fails a check (2 is a refusal: a line unreadable)."""


REOPENED_TEXT = "reopened: shards to rebuild from its manifest"
"""How `data status` shows a `reopened` cycle (`DataLine.cycle_state`): a consumed cycle a rollback reopened."""


def run_schedule(args: argparse.Namespace) -> int:
    from datalines import open_data_line
    from datalines.errors import DataLineError
    from datalines.schedule import append_schedule_piece

    try:
        shares = json.loads(args.shares)
    except json.JSONDecodeError as error:
        raise DataLineError(f"--shares: not valid JSON ({error})") from None
    if args.from_tokens != int(args.from_tokens):
        raise DataLineError(f"--from-tokens must be a whole number, got {args.from_tokens}")
    line = open_data_line(_data_line_path(args, args.work))
    append_schedule_piece(line, int(args.from_tokens), shares)
    print(f"schedule of {line.path}: from token {int(args.from_tokens):,} the shares are {shares}")
    return 0


def run_rebuild(args: argparse.Namespace) -> int:
    from datalines import open_data_line
    from datalines.errors import ManifestDamaged
    from datalines.manifest import MANIFEST_NAME, load_manifest
    from datalines.preparer import rebuild_cycle, restore_manifest
    from datalines.service import lock_for_rebuild

    line = open_data_line(_data_line_path(args, args.work))
    directory = line.cycle_dir(args.cycle)
    # The preparer's lock: a preparer at the same time would write the same cycle and downloads.
    with lock_for_rebuild(line, args.cycle):
        try:
            load_manifest(directory)
        except ManifestDamaged as damage:
            # Written again only where the shards there prove it (restore_manifest), else refused.
            plan = restore_manifest(line, args.cycle, damage)
            print(f"cycle {args.cycle}: {directory / MANIFEST_NAME} written again from {plan}: "
                  f"every shard there matches it byte for byte")  # fmt: skip
            return 0
        rebuild_cycle(line, args.cycle)
    print(f"cycle {args.cycle} rebuilt: every shard matches its manifest byte for byte")
    return 0


def run_preparer_command(args: argparse.Namespace) -> int:
    from datalines import open_data_line
    from datalines.service import run_preparer

    line = open_data_line(_data_line_path(args, args.work))
    min_free = None if args.min_free_gb is None else gib_bytes(args.min_free_gb)
    # A SIGTERM stops it like Ctrl-C, so the status file says `stopped` rather than a stale state.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        with PreparerView(interactive=sys.stdout.isatty()) as view:
            run_preparer(
                line, ahead=args.ahead, min_free_bytes=min_free, once=args.once, on_status=view.update
            )
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run_tokenizer(args: argparse.Namespace) -> int:
    from datalines.tokenizer_training import train_tokenizer_file

    specials = args.special or ["<|endoftext|>"]
    vocab = train_tokenizer_file(args.source, args.vocab, args.out, args.text_field, specials)
    print(f"{args.out}: byte-level BPE, vocab {vocab}, special tokens {', '.join(specials)}")
    return 0


class PreparerView:
    """What run-preparer shows: a rich progress bar on a terminal, one line per change otherwise."""

    def __init__(self, interactive: bool, console: Console | None = None) -> None:
        from rich.console import Console

        self.interactive = interactive
        self.console = console or Console()
        self.progress: Progress | None = None
        self.task: TaskID | None = None
        self.last_line = ""
        from datalines.service import StatusLines  # the preparer's modules load only for run-preparer

        self.plain = StatusLines()

    def __enter__(self) -> PreparerView:
        from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

        if self.interactive:
            self.progress = Progress(
                TextColumn("[bold]{task.fields[state]}[/]"),
                BarColumn(),
                TaskProgressColumn(),
                TextColumn("{task.description}"),
                TimeElapsedColumn(),
                console=self.console,
            )
            self.progress.start()
            self.task = self.progress.add_task("starting", total=1.0, state="starting")
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if self.progress is not None:
            self.progress.stop()

    def update(self, status: PreparerStatus) -> None:
        line = f"{status.state}: {status.waiting_reason or status.message}"
        if self.progress is not None and self.task is not None:
            self.progress.update(
                self.task, completed=status.progress, description=line, state=status.state, refresh=True
            )
            if status.state in ("waiting", "retrying", "failed") and line != self.last_line:
                self.progress.console.print(f"[yellow]{line}[/]")
        else:
            self.plain(status)
        self.last_line = line
