from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.errors import ConfigError
from engine.models.presets import preset_config
from nsconsole.cli import build_parser, main

COMMANDS = ["data", "new", "tune", "check", "run", "status", "stop", "branch", "rollback", "bench"]


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for command in COMMANDS:
        assert f"    {command}" in out


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help(command: str) -> None:
    parser = build_parser()
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args([command, "--help"])
    assert exit_info.value.code == 0


def test_console_script_module_entry() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "nsconsole", "--help"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0
    assert "usage: nsconsole" in result.stdout


def every_parser(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """`parser` and every command and subcommand parser below it."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                yield from every_parser(child)


def test_every_command_and_subcommand_has_a_description_and_examples() -> None:
    parsers = list(every_parser(build_parser()))
    names = [parser.prog for parser in parsers]
    assert "nsconsole data init" in names and "nsconsole stop" in names and len(parsers) >= 18
    for parser in parsers:
        assert parser.description and parser.description.strip(), f"{parser.prog}: no description"
        examples = (parser.epilog or "").splitlines()
        assert examples and examples[0] == "examples:", f"{parser.prog}: no examples"
        # Each example is a command line of this command (or, at the top, of any command).
        command = "nsconsole" if parser.prog == "nsconsole" else parser.prog
        assert any(line.strip().startswith(command) for line in examples[1:]), f"{parser.prog}: {examples}"
        # The help shows them as written: line breaks kept.
        assert "\nexamples:\n  " in parser.format_help(), parser.prog


OVERRIDE = re.compile(r"--override[ =](?!KEY=VALUE)\S")
"""An `--override` with a key and value shown (not the usage's `--override KEY=VALUE`)."""


def test_every_override_a_help_shows_names_a_field_its_preset_accepts() -> None:
    """Each `--override KEY=VALUE` in any --help is in an example command, and that command, parsed
    as the CLI parses it, names a preset that takes the key and the value (help examples can't rot)."""
    shown = []
    for parser in every_parser(build_parser()):
        text = parser.format_help().replace("\\\n", " ")  # an example continued on the next line, joined
        for line in text.splitlines():
            if not OVERRIDE.search(line):
                continue
            words = shlex.split(line, comments=True)
            assert "nsconsole" in words, f"{parser.prog} --help: an --override outside an example: {line}"
            args = build_parser().parse_args(words[words.index("nsconsole") + 1 :])
            try:
                preset_config(args.model, dict(args.override)).validate()
            except ConfigError as error:
                pytest.fail(f"{parser.prog} --help: {line.strip()}: {error}")
            shown.append(parser.prog)
    assert "nsconsole new" in shown


@pytest.mark.usefixtures("private_host")  # conftest: an empty host.json of the test's own
@pytest.mark.parametrize("arguments", [["status", "LINE", "--rows", "50"], ["--help"], ["data", "status", "--help"]])
def test_a_reader_that_closes_early_ends_a_command_quietly(tmp_path: Path, arguments: list[str]) -> None:
    """`nsconsole status LINE --rows 50 | head -2`: the command's writes meet a pipe nobody reads any
    more; it exits with a shell's status of a command SIGPIPE ended, with no traceback. --help too,
    unbuffered (argparse's printing swallowed the broken pipe: a README walkthrough found it)."""
    line = tmp_path / "line"
    line.mkdir()
    (line / "run.json").write_text("{}")  # status shows what it can of a line whose run.json is invalid
    (line / "rows.jsonl").write_text("".join(json.dumps({"update": u, "loss": 2.5}) + "\n" for u in range(50)))
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the command writes (deterministic: no race with its writes)
    try:
        completed = subprocess.run(
            [sys.executable, "-m", "nsconsole", *(str(line) if item == "LINE" else item for item in arguments)],
            stdout=write, stderr=subprocess.PIPE, text=True, timeout=120,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
    finally:
        os.close(write)
    assert (completed.returncode, completed.stderr) == (141, "")  # 128 + SIGPIPE, as a shell reports it


@pytest.mark.usefixtures("private_host")
@pytest.mark.parametrize("unbuffered", [False, True], ids=["buffered", "PYTHONUNBUFFERED"])
@pytest.mark.parametrize("arguments", [["status", "LINE", "--rows", "50"], ["--help"]])
def test_a_stdout_that_cannot_be_written_is_said_in_one_line(
    tmp_path: Path, arguments: list[str], unbuffered: bool
) -> None:
    """`nsconsole status LINE > /dev/full` (a full disk under the file stdout goes to): one line
    naming stdout and the error, exit 1; before, a traceback. Under PYTHONUNBUFFERED (common in
    training environments) it was a traceback still: a failed write left nothing behind."""
    line = tmp_path / "line"
    line.mkdir()
    (line / "run.json").write_text("{}")
    (line / "rows.jsonl").write_text("".join(json.dumps({"update": u, "loss": 2.5}) + "\n" for u in range(50)))
    with open("/dev/full", "w") as full:
        completed = subprocess.run(
            [sys.executable, "-m", "nsconsole", *(str(line) if item == "LINE" else item for item in arguments)],
            stdout=full, stderr=subprocess.PIPE, text=True, timeout=120,
            env={**{k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}, "PYTHONPATH": os.pathsep.join(sys.path),
                 **({"PYTHONUNBUFFERED": "1"} if unbuffered else {})},
        )  # fmt: skip
    assert (completed.returncode, completed.stderr) == (1, "nsconsole: stdout: No space left on device\n")


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["new", "runs/x", "--model", "ns-tiny", "--data", "d", "--peak-lr", "x"],
         "nsconsole new: error: argument --peak-lr: invalid float value: 'x'"),
        (["new"], "nsconsole new: error: the following arguments are required: LINE, --model, --data"),
        (["status", "--rows", "0"], "nsconsole status: error: argument --rows: must be at least 1, got 0"),
        (["rollback", "runs/x", "--to", "-5"],  # was `u-0000005: no such checkpoint`
         "nsconsole rollback: error: argument --to: must be at least 0, got -5"),
    ],
)
def test_a_bad_option_is_one_line_without_the_usage_block(
    argv: list[str], line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """As every other refusal (found in a README walk: `new --peak-lr x` printed five usage lines
    before the one that says what is wrong); `--help` shows the usage."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert capsys.readouterr().err == line + "\n"
