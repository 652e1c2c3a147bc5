"""Host settings: defaults, errors naming the file, environment, LINE resolution, the CLI hook."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers.lines import make_data_line, make_line

from engine.config.host import HostSettings
from engine.errors import ConfigError
from nsconsole.cli import main

EXPECTING_NAME = "Expecting property name enclosed in double quotes"


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("NSCONSOLE_HOST", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_missing_default_file_gives_defaults(home: Path) -> None:
    settings = HostSettings.load()
    assert settings == HostSettings()
    assert settings.source is None


def test_default_file_is_read(home: Path) -> None:
    (home / ".nsconsole").mkdir(parents=True)
    (home / ".nsconsole" / "host.json").write_text(
        json.dumps({"env": {"A": "1"}, "work_root": "/data/lines", "notify": "/bin/true"})
    )
    settings = HostSettings.load()
    assert settings.env == {"A": "1"}
    assert settings.work_root == "/data/lines"
    assert settings.notify == "/bin/true"
    assert settings.source == str(home / ".nsconsole" / "host.json")


def test_named_file_must_exist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    missing = tmp_path / "nowhere.json"
    monkeypatch.setenv("NSCONSOLE_HOST", str(missing))
    with pytest.raises(ConfigError, match=rf"^{missing}: no such file \(named by \$NSCONSOLE_HOST\)$"):
        HostSettings.load()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"env": {"A": "1"},}', f"malformed JSON at line 1 column 20: {EXPECTING_NAME}"),
        ('{"neuronspark": "/x"}', "unknown key neuronspark"),
        ('{"source": "/x"}', "unknown key source"),
        ('{"env": {"A": 1}}', "env.A must be a string, got 1"),
        ('{"work_root": 3}', "work_root must be a string or null, got 3"),
        ("[]", "the top level must be an object, got []"),
        # Values os.environ refuses: each was a traceback out of every command.
        ('{"env": {"": "1"}}', "env key '' is not a variable name (empty, or holds = or NUL)"),
        ('{"env": {"A=B": "1"}}', "env key 'A=B' is not a variable name (empty, or holds = or NUL)"),
        ('{"env": {"A": "x\\u0000y"}}', "env.A holds a NUL character"),
        # Found when a line fails and its notification cannot run: said at once instead.
        ('{"notify": "notify-me \'unclosed"}',
         "notify \"notify-me 'unclosed\" is not a command line (No closing quotation)"),
        ('{"notify": "  "}', "notify must name a command, got '  '"),
        ('{"work_root": ""}', "work_root must not be empty (leave it out or null for none)"),
    ],
)
def test_malformed_file_is_one_line_naming_it(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "host.json"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        HostSettings.load(path)
    assert str(info.value) == f"{path}: {message}"


def test_resolve_line_against_work_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.nsconsole/lines
    (tmp_path / "here").mkdir()
    settings = HostSettings(work_root=str(tmp_path / "root"))
    assert settings.resolve_line("here") == tmp_path / "here"  # exists relative to the cwd
    assert settings.resolve_line("trunk") == tmp_path / "root" / "trunk"
    assert settings.resolve_line("/abs/line") == Path("/abs/line")
    assert HostSettings().resolve_line("trunk") == tmp_path / "trunk"


def test_a_line_under_the_default_work_root_is_found_from_any_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # No work_root: the demo's root, ~/.nsconsole/lines, holds the lines `nsconsole --run` made.
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    lines = home / ".nsconsole" / "lines"
    line = make_line(lines, make_data_line(tmp_path / "template", prepare=1))  # lines/line
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    settings = HostSettings()
    assert settings.resolve_line("line") == line
    assert settings.resolve_line("trunk") == elsewhere / "trunk"  # not there: `new` creates it here
    (elsewhere / "line").mkdir()
    assert settings.resolve_line("line") == elsewhere / "line"  # the cwd's comes first
    (elsewhere / "line").rmdir()
    monkeypatch.setenv("NSCONSOLE_HOST", str(tmp_path / "host.json"))
    (tmp_path / "host.json").write_text("{}")
    assert main(["status", "line"]) == 0
    assert str(line) in capsys.readouterr().out


def test_cli_applies_the_environment_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    host = tmp_path / "host.json"
    host.write_text(json.dumps({"env": {"NSCONSOLE_TEST_HOST_VARIABLE": "applied"}}))
    monkeypatch.setenv("NSCONSOLE_HOST", str(host))
    monkeypatch.delenv("NSCONSOLE_TEST_HOST_VARIABLE", raising=False)  # restored afterwards
    # `status` of a missing line fails, but only after the host settings were applied.
    assert main(["status", str(tmp_path / "no-line")]) == 2
    assert os.environ["NSCONSOLE_TEST_HOST_VARIABLE"] == "applied"


def test_cli_reports_an_unusable_env_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    host = tmp_path / "host.json"
    host.write_text(json.dumps({"env": {"A=B": "1"}}))
    monkeypatch.setenv("NSCONSOLE_HOST", str(host))
    assert main(["status", str(tmp_path)]) == 2
    expected = f"nsconsole: {host}: env key 'A=B' is not a variable name (empty, or holds = or NUL)\n"
    assert capsys.readouterr().err == expected


def test_cli_reports_a_broken_host_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    host = tmp_path / "host.json"
    host.write_text("{")
    monkeypatch.setenv("NSCONSOLE_HOST", str(host))
    assert main(["status", str(tmp_path)]) == 2
    expected = f"nsconsole: {host}: malformed JSON at line 1 column 2: {EXPECTING_NAME}\n"
    assert capsys.readouterr().err == expected
