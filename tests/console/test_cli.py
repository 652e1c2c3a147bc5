from __future__ import annotations

import subprocess
import sys

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
