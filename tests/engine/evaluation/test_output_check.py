"""`nsconsole eval --output FILE` is checked before the evaluation runs: a FILE that cannot be
written is refused in one line, where it used to crash after the whole run with its results lost
(`--output /proc/x.json`, found in a fault walkthrough)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.errors import LineError
from engine.evaluation import harness
from engine.evaluation.run import check_output, write_results
from nsconsole.cli import main

pytestmark = pytest.mark.usefixtures("private_host")


def unloadable(*args: object, **kwargs: object) -> None:
    raise AssertionError("the checkpoint was loaded: --output was not checked first")


@pytest.mark.parametrize(
    ("output", "refusal"),
    [
        ("/proc/x.json", "nsconsole: /proc/x.json: --output cannot be written in /proc ("),
        ("{tmp}", "nsconsole: {tmp}: --output is a directory; name the file to write the results to"),
        ("{tmp}/a_file/x.json", "nsconsole: {tmp}/a_file/x.json: --output's directory cannot be made: "
                                "{tmp}/a_file is not a directory"),
    ],
)  # fmt: skip
def test_an_output_that_cannot_be_written_is_refused_before_the_checkpoint_loads(
    output: str, refusal: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "a_file").write_text("")
    monkeypatch.setattr(harness, "open_checkpoint", unloadable)
    output, refusal = output.format(tmp=tmp_path), refusal.format(tmp=tmp_path)
    assert main(["eval", str(tmp_path / "line"), "--tasks", "nsc_choice", "--output", output]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(refusal) and captured.err.count("\n") == 1, captured.err
    assert captured.out == ""


def test_a_writable_output_passes_and_its_missing_directories_are_made(tmp_path: Path) -> None:
    root = tmp_path / "out"
    root.mkdir()
    output = root / "evals" / "trunk" / "results.json"
    check_output(output)
    assert sorted(root.iterdir()) == []  # the probe is gone, and nothing is made before the run
    write_results({"results": {"task": {"acc,none": 0.5}}}, output)
    assert '"acc,none": 0.5' in output.read_text()
    check_output(output, force=True)  # an existing file is replaced with --force
    assert [path.name for path in output.parent.iterdir()] == ["results.json"]


def test_an_existing_output_is_refused_without_force_before_the_checkpoint_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # An earlier evaluation's results were replaced without a word (found in a README walk): a
    # typo in --output cost them, as `data tokenizer --out` refuses to without --force.
    output = tmp_path / "trunk.json"
    output.write_text('{"results": "an earlier evaluation"}')
    monkeypatch.setattr(harness, "open_checkpoint", unloadable)
    assert main(["eval", str(tmp_path / "line"), "--tasks", "nsc_choice", "--output", str(output)]) == 2
    captured = capsys.readouterr()
    assert captured.err == (f"nsconsole: {output}: --output already exists; name another file, or give --force "
                            "to replace it\n")  # fmt: skip
    assert output.read_text() == '{"results": "an earlier evaluation"}'


def test_a_file_that_is_not_a_regular_file_is_refused(tmp_path: Path) -> None:
    link = tmp_path / "dangling.json"
    link.symlink_to(tmp_path / "nowhere" / "x.json")
    with pytest.raises(LineError, match=r"dangling.json: --output is not a regular file$"):
        check_output(link)
