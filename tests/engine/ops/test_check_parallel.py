"""`nsconsole check` of a line at parallel.degree above 1: an update of fewer micro-batches than
ranks leaves ranks with nothing to train, which the trainer accepts silently (found in a
walkthrough of a degree-2 CPU line, whose `nsconsole tune` had written the whole update as one
micro-batch: rank 1 joined every sum and trained nothing)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.lines import SEQ_LEN, make_data_line, make_line

from engine.ops.check import check_line


@pytest.fixture(scope="module")
def data_line(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_data_line(tmp_path_factory.mktemp("parallel"), files=2, prepare=1)


def parallel_findings(line: Path) -> list[tuple[bool, bool, str]]:
    _config, results = check_line(line, verify_checkpoints=False)
    return [(r.ok, r.warning, r.message) for r in results if r.message.startswith("parallel: ")]


def test_a_degree_2_line_whose_update_is_one_micro_batch_is_warned(tmp_path: Path, data_line: Path) -> None:
    # 16 rows an update (make_line), in one micro-batch of 16: rank 1 would train nothing.
    line = make_line(tmp_path, data_line, **{"parallel.degree": 2, "lengths": [{"seq_len": SEQ_LEN,
                                                                                "micro_batch_rows": 16}]})  # fmt: skip
    assert parallel_findings(line) == [(True, True, (
        f"parallel: degree 2: at T{SEQ_LEN} an update of 16 rows (512 tokens) makes 1 micro-batch of 16 rows, "
        f"so 1 of the 2 ranks trains nothing; set lengths[].micro_batch_rows at T{SEQ_LEN} to 8 or fewer "
        "(`nsconsole tune` measures them)"))]  # fmt: skip


def test_every_rank_with_work_passes_and_degree_1_says_nothing(tmp_path: Path, data_line: Path) -> None:
    two = make_line(tmp_path / "two", data_line, **{"parallel.degree": 2})  # two micro-batches of 8
    assert parallel_findings(two) == [
        (True, False, "parallel: degree 2, shard none: every update's micro-batches reach every rank")
    ]
    assert parallel_findings(make_line(tmp_path / "one", data_line)) == []


def test_a_ramp_piece_too_small_for_the_ranks_is_warned(tmp_path: Path, data_line: Path) -> None:
    ramp = [{"from": 0, "to": 2048, "tokens": 8 * SEQ_LEN}, {"from": 2048, "to": None, "tokens": 16 * SEQ_LEN}]
    line = make_line(tmp_path, data_line, **{"parallel.degree": 2, "tokens_per_update": ramp})
    [(ok, warning, message)] = parallel_findings(line)
    assert ok and warning and "an update of 8 rows (256 tokens) makes 1 micro-batch of 8 rows" in message


def test_a_micro_batch_of_one_row_reads_in_the_singular(tmp_path: Path, data_line: Path) -> None:
    # Found in a README walk: `check` said "a micro-batch of 1 rows". One row a micro-batch is what
    # `nsconsole tune` often writes for a long length, so the line must read right.
    line = make_line(tmp_path, data_line, **{"parallel.degree": 4, "tokens_per_update": 2 * SEQ_LEN,
                                             "lengths": [{"seq_len": SEQ_LEN, "micro_batch_rows": 1}]})  # fmt: skip
    [(ok, warning, message)] = parallel_findings(line)
    assert ok and warning
    assert f"at T{SEQ_LEN} an update of 2 rows ({2 * SEQ_LEN} tokens) makes 2 micro-batches of 1 row, " in message
    assert "1 rows" not in message
