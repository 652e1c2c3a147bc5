"""`--seed` of `sample`, `chat` and `eval` takes one range, 0 to 2**32 - 1 (numpy's), and refuses
another at parsing with one line: it used to fail deep in torch (`sample --seed 99999999999999999999999`:
Overflow) or numpy (`eval --seed -1`) with a traceback (found in a fault walkthrough)."""

from __future__ import annotations

import pytest

from nsconsole.cli import build_parser
from nsconsole.commands.parser import SEED_LIMIT

COMMANDS = {
    "sample": ["sample", "runs/trunk"],
    "chat": ["chat", "runs/trunk"],
    "eval": ["eval", "runs/trunk", "--tasks", "my_task"],
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("seed", ["-1", str(SEED_LIMIT), "99999999999999999999999"])
def test_a_seed_out_of_range_is_refused_at_parsing(
    command: str, seed: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args([*COMMANDS[command], "--seed", seed])
    assert exited.value.code == 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert error == f"nsconsole {command}: error: argument --seed: must be 0 to 4,294,967,295 (2**32 - 1), got {seed}"


@pytest.mark.parametrize("command", COMMANDS)
def test_both_ends_of_the_range_are_taken(command: str) -> None:
    parser = build_parser()
    assert parser.parse_args([*COMMANDS[command], "--seed", "0"]).seed == 0
    assert parser.parse_args([*COMMANDS[command], "--seed", str(SEED_LIMIT - 1)]).seed == SEED_LIMIT - 1


def test_the_help_of_each_names_the_range(capsys: pytest.CaptureFixture[str]) -> None:
    for command in COMMANDS:
        with pytest.raises(SystemExit):
            build_parser().parse_args([command, "--help"])
        assert "0 to 4,294,967,295 (2**32 - 1)" in " ".join(capsys.readouterr().out.split()), command
