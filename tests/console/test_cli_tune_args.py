"""`nsconsole tune`'s `--budget-gb` and `--max-rows` are refused at parsing when they cannot mean a
budget or a count of rows: `--budget-gb nan` or `inf` ended in a traceback from the bytes conversion,
and `--max-rows 0` or `-3` measured as if it had not been given (found in a README walk of Tune)."""

from __future__ import annotations

import pytest

from nsconsole.cli import build_parser


@pytest.mark.parametrize(
    ("arguments", "error"),
    [
        (["--budget-gb", "nan"], "argument --budget-gb: must be a number of GiB above 0, got nan"),
        (["--budget-gb", "inf"], "argument --budget-gb: must be a number of GiB above 0, got inf"),
        (["--budget-gb", "-1"], "argument --budget-gb: must be a number of GiB above 0, got -1"),
        (["--budget-gb", "0"], "argument --budget-gb: must be a number of GiB above 0, got 0"),
        (["--budget-gb", "four"], "argument --budget-gb: not a number: 'four'"),
        (["--max-rows", "0"], "argument --max-rows: must be at least 1, got 0"),
        (["--max-rows", "-3"], "argument --max-rows: must be at least 1, got -3"),
    ],
)
def test_a_budget_or_rows_that_mean_nothing_are_refused_in_one_line(
    arguments: list[str], error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["tune", "runs/trunk", *arguments])
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"nsconsole tune: error: {error}"


def test_a_budget_and_rows_are_taken() -> None:
    args = build_parser().parse_args(["tune", "runs/trunk", "--budget-gb", "0.5", "--max-rows", "1"])
    assert (args.budget_gb, args.max_rows) == (0.5, 1)
