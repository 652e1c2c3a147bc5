"""`nsconsole check` of a `validation.long_seq_len` that exceeds no stage's length: the long-row
probe runs only at a stage whose length it exceeds, so such a line trained with no long probe and
nothing said so (found in a README walk: 100 with lengths [256] passed `check`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.lines import SEQ_LEN, make_data_line, make_line

from engine.ops.check import check_line


@pytest.fixture(scope="module")
def data_line(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_data_line(tmp_path_factory.mktemp("long"), files=2, prepare=1)


def long_findings(line: Path) -> list[tuple[bool, bool, str]]:
    _config, results = check_line(line, verify_checkpoints=False)
    return [(r.ok, r.warning, r.message) for r in results if r.message.startswith("validation.long_seq_len")]


def test_a_long_length_not_above_the_training_length_is_warned(tmp_path: Path, data_line: Path) -> None:
    line = make_line(tmp_path, data_line, **{"validation.long_seq_len": SEQ_LEN // 2})
    # transformer-tiny reads 32 tokens at most: null would not probe either, so it is not offered.
    assert long_findings(line) == [(True, True, (
        f"validation.long_seq_len: {SEQ_LEN // 2} is not above the training length {SEQ_LEN}, so the long-row "
        f"probe never runs; set it above {SEQ_LEN}"))]  # fmt: skip
    equal = make_line(tmp_path / "equal", data_line, **{"model.preset": "ns-tiny", "validation.long_seq_len": SEQ_LEN})
    [(ok, warning, message)] = long_findings(equal)
    assert ok and warning and message.endswith(f"set it above {SEQ_LEN}, or to null for the model's longest context (512)")


def test_a_long_length_some_stage_is_shorter_than_passes_silently(tmp_path: Path, data_line: Path) -> None:
    assert long_findings(make_line(tmp_path / "above", data_line, **{"validation.long_seq_len": 2 * SEQ_LEN})) == []
    assert long_findings(make_line(tmp_path / "null", data_line)) == []
    # A plan whose first stage is shorter: probed there, not at the long stage (as a branch's `long:`).
    stages = {
        "lengths": [{"seq_len": SEQ_LEN, "micro_batch_rows": 8}, {"seq_len": 2 * SEQ_LEN, "micro_batch_rows": 4}],
        "plan": [{"name": "trunk", "seq_len": SEQ_LEN, "tokens": 4096},
                 {"name": "long", "seq_len": 2 * SEQ_LEN, "tokens": None}],
        "validation.long_seq_len": 2 * SEQ_LEN,
    }  # fmt: skip
    assert long_findings(make_line(tmp_path / "stages", data_line, **stages)) == []
    # Every stage at the long length or more: nothing probes.
    stages["plan"][0]["seq_len"] = 2 * SEQ_LEN
    [(ok, warning, message)] = long_findings(make_line(tmp_path / "long", data_line, **stages))
    assert ok and warning and message.startswith(f"validation.long_seq_len: {2 * SEQ_LEN} is not above the training length")
