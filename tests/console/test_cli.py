from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Iterator

import pytest

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
