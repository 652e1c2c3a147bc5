"""`nsconsole tune` on CPU (and CUDA where there is one): the settings, the choice, run.json, refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.lines import SEQ_LEN, make_data_line, make_line

from engine.config.run import RunConfig
from engine.errors import LineError
from engine.ops import tune as tune_module
from engine.ops.tune import (
    CpuPeakMeter,
    LengthTuning,
    Measurement,
    Tuner,
    format_table,
    memory_budget,
    partial_recompute,
    rank_rows,
    rows_to_try,
    tune_line,
)
from engine.training.distributed import Ranks
from engine.units import GIB
from nsconsole.cli import main as cli_main

MIB = 1 << 20


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread


@pytest.fixture(scope="module")
def data_line(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_data_line(tmp_path_factory.mktemp("tune"), files=2, prepare=1)


@pytest.fixture
def line(tmp_path: Path, data_line: Path) -> Path:
    return make_line(tmp_path, data_line)


def test_tune_picks_the_fastest_feasible_setting_and_writes_it(line: Path) -> None:
    result = tune_line(line, budget_gb=4.0)
    [tuning] = result.lengths
    assert tuning.seq_len == SEQ_LEN
    rows_tried = [m.micro_batch_rows for m in tuning.measurements]
    assert rows_tried == [1, 2, 4, 8]  # 16 rows per update, CPU search capped at 8
    for m in tuning.measurements:
        assert m.fits and m.tokens_per_s is not None and m.tokens_per_s > 0
        assert m.peak_bytes is not None and 0 < m.peak_bytes <= result.budget_bytes
    chosen = tuning.chosen
    assert chosen is not None and chosen.tokens_per_s == max(m.tokens_per_s or 0 for m in tuning.measurements)
    entry = RunConfig.load(line / "run.json").length(SEQ_LEN)
    assert (entry.micro_batch_rows, entry.recompute, entry.shared) == (chosen.micro_batch_rows, "none", None)


def test_nothing_fits_is_one_clear_error_and_run_json_is_untouched(line: Path) -> None:
    before = (line / "run.json").read_bytes()
    with pytest.raises(LineError, match=r"tune: no setting of length 32 fits 0\.00 GiB"):
        tune_line(line, budget_gb=1e-4, max_rows=2)  # 100 kB: less than the model's own state
    assert (line / "run.json").read_bytes() == before


def test_shared_needs_a_reserve_and_writes_the_shared_shape(line: Path) -> None:
    with pytest.raises(LineError, match="--shared needs guards.share_reserve_gb"):
        tune_line(line, shared=True, budget_gb=4.0)
    document = json.loads((line / "run.json").read_text())
    document["guards"]["share_reserve_gb"] = 1.0
    (line / "run.json").write_text(json.dumps(document))
    result = tune_line(line, shared=True, budget_gb=4.0, max_rows=2)
    # The budget less the reserve, both GiB: 4 GiB - 1 GiB. (This was 3_000_000_000, 4e9 - 1e9, while
    # tune converted *_gb as GB, unlike the trainer and the supervisor: issue #19.)
    assert result.budget_bytes == 3 * GIB == 3_221_225_472
    entry = RunConfig.load(line / "run.json").length(SEQ_LEN)
    chosen = result.lengths[0].chosen
    assert chosen is not None and entry.shared is not None
    assert entry.shared.micro_batch_rows == chosen.micro_batch_rows
    assert entry.micro_batch_rows == 8  # the line's own shape is left as it was


def test_the_budget_and_the_reserve_are_gib() -> None:
    cpu = torch.device("cpu")
    assert memory_budget(cpu, 4.0, 0) == 4 * GIB == 4_294_967_296  # --budget-gb 4: not 4e9
    reserve = RunConfig.from_dict({"model": {"preset": "pssa-1.5m"}, "data": {"line": "d"},
                                   "guards": {"share_reserve_gb": 1.0}}).guards.share_reserve_bytes
    assert reserve == 1_073_741_824
    assert memory_budget(cpu, 4.0, reserve) == 4 * GIB - reserve == 3_221_225_472  # less reserve x 2**30
    with pytest.raises(LineError, match=r"tune: no memory left for the line \(-1\.0 GiB after"):
        memory_budget(cpu, 1.0, 2 * GIB)


def test_a_setting_that_ran_out_of_memory_or_over_budget_is_never_chosen() -> None:
    tuning = LengthTuning(64, [
        Measurement(64, 1, "none", 100.0, 10, fits=True),
        Measurement(64, 2, "none", None, None, fits=False, note="out of memory"),
        Measurement(64, 2, "all", 500.0, 99, fits=False, note="over budget"),
        Measurement(64, 1, "all", 80.0, 5, fits=True),
    ])  # fmt: skip
    assert tuning.chosen is tuning.measurements[0]
    assert LengthTuning(64, [Measurement(64, 1, "none", note="out of memory")]).chosen is None


def test_cpu_rows_stop_growing_when_doubled_activations_would_not_fit(line: Path) -> None:
    config = RunConfig.load(line / "run.json")
    tuner = Tuner(config, torch.device("cpu"), budget=10**12, max_rows=None)
    tuner.static_bytes, tuner.budget = 100 * MIB, 300 * MIB
    # From 1 row: everything above the model and optimizer doubles.
    assert tuner._next_may_fit(Measurement(SEQ_LEN, 1, "none", 1.0, 190 * MIB, fits=True), None, 2)
    assert not tuner._next_may_fit(Measurement(SEQ_LEN, 1, "none", 1.0, 210 * MIB, fits=True), None, 2)
    # From 2 rows on: the growth of the last doubling, twice over.
    one_row = Measurement(SEQ_LEN, 1, "none", 1.0, 210 * MIB, fits=True)
    assert tuner._next_may_fit(Measurement(SEQ_LEN, 2, "none", 1.0, 230 * MIB, fits=True), one_row, 4)  # 270
    assert not tuner._next_may_fit(Measurement(SEQ_LEN, 2, "none", 1.0, 250 * MIB, fits=True), one_row, 4)  # 330
    # To rows that are not the next doubling (the line's current rows): the growth per row, continued.
    two_rows = Measurement(SEQ_LEN, 2, "none", 1.0, 250 * MIB, fits=True)
    assert tuner._next_may_fit(two_rows, one_row, 3)  # 250 + 40 = 290
    assert not tuner._next_may_fit(two_rows, one_row, 5)  # 250 + 3 x 40 = 370


def test_the_lines_current_rows_are_measured_and_kept_when_fastest(line: Path) -> None:
    """The demo line trains 16 rows a micro-batch on a CPU: tune measured only up to its CPU cap of
    8 and wrote 8, fewer rows than the line had, never having tried 16."""
    config = RunConfig.load(line / "run.json")
    config.lengths[0].micro_batch_rows = 16  # the whole update, as the demo line's
    config.save(line / "run.json")
    [tuning] = tune_line(line, budget_gb=4.0).lengths
    assert [m.micro_batch_rows for m in tuning.measurements] == [1, 2, 4, 8, 16]
    assert tuning.chosen is not None
    assert RunConfig.load(line / "run.json").length(SEQ_LEN).micro_batch_rows == tuning.chosen.micro_batch_rows


def test_rows_tried_are_the_doublings_under_the_cap_and_the_current_rows() -> None:
    assert rows_to_try(16, 8, 16) == [1, 2, 4, 8, 16]  # past the cap: the line trains with it
    assert rows_to_try(16, 2, 12) == [1, 2, 12]  # not a doubling
    assert rows_to_try(16, None, 4) == [1, 2, 4, 8, 16]  # no cap (a GPU): every doubling
    assert rows_to_try(16, 8, 32) == [1, 2, 4, 8, 16]  # past the update: the update, what it trains
    assert rows_to_try(16, 8, None) == [1, 2, 4, 8]  # --shared before any shared shape


def test_at_a_degree_above_one_tune_measures_a_rank_s_share_of_the_update(
    line: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A degree-2 line of 8 rows an update: tune measured the whole update in one process, tried 8
    rows a micro-batch (the fastest there) and wrote it, and with one micro-batch an update rank 1
    trained nothing while rank 0 did the degree-1 line's work."""
    document = json.loads((line / "run.json").read_text())
    document["parallel"]["degree"] = 2
    document["tokens_per_update"] = 8 * SEQ_LEN
    document["lengths"][0]["micro_batch_rows"] = 1
    (line / "run.json").write_text(json.dumps(document))
    timed_rows: dict[int, set[int]] = {}
    real_engine = tune_module.EagerEngine

    class RecordingEngine(real_engine):  # type: ignore[misc, valid-type]
        def run_update(self, windows: torch.Tensor, lr: float, weight_decay: float):  # noqa: ANN202
            timed_rows.setdefault(self.micro_batch_rows, set()).add(windows.shape[0])
            return super().run_update(windows, lr, weight_decay)

    monkeypatch.setattr(tune_module, "EagerEngine", RecordingEngine)
    result = tune_line(line, budget_gb=4.0)
    [tuning] = result.lengths
    assert [m.micro_batch_rows for m in tuning.measurements] == [1, 2, 4]  # a rank's 4 rows at most
    assert timed_rows == {1: {4}, 2: {4}, 4: {4}}  # each timed on a rank's rows, not the update's 8
    assert all(m.tokens_per_s is not None for m in tuning.measurements)
    assert result.budget_bytes == 2 * GIB  # --budget-gb 4 for the line: the two ranks share the CPU's memory
    assert RunConfig.load(line / "run.json").length(SEQ_LEN).micro_batch_rows <= 4
    assert "parallel.degree 2" in format_table(result)[0] and "a rank" in format_table(result)[0]


def test_a_rank_s_rows_are_the_trainers_deal() -> None:
    for update_rows in range(1, 18):
        for micro_batch_rows in (1, 2, 3, 4, 8, 16):
            for degree in (1, 2, 3, 4):
                windows = torch.zeros(update_rows, 2)
                busiest = max(Ranks(rank, degree, rank, launched=True).rows_of(windows, micro_batch_rows).shape[0]
                              for rank in range(degree))  # fmt: skip
                assert rank_rows(update_rows, micro_batch_rows, degree) == busiest
    assert rows_to_try(8, 8, 1, degree=2) == [1, 2, 4]
    assert rows_to_try(16, 8, 16, degree=2) == [1, 2, 4, 8, 16]  # the line's own rows, even past a rank's share
    assert rows_to_try(6, None, None, degree=4) == [1, 2]  # 2 rows a rank at most: 3 micro-batches for 4 ranks


def test_cpu_peak_meter_sees_an_allocation() -> None:
    meter = CpuPeakMeter()
    meter.reset()
    block = torch.ones(64 * MIB // 4)  # 64 MiB, every page touched
    peak = meter.peak()
    del block
    assert peak >= 60 * MIB


def test_cpu_peak_meter_reads_true_after_the_process_hands_back_memory_it_held_at_the_start() -> None:
    # A test worker's earlier work can be freed after the meter is built: a reading against the
    # memory held at the start came out negative (the clean-clone CI's failure).
    held = torch.ones(256 * MIB // 4)  # resident when the meter starts
    meter = CpuPeakMeter()
    del held
    meter.reset()
    block = torch.ones(32 * MIB // 4)
    peak = meter.peak()
    del block
    assert 28 * MIB <= peak < 128 * MIB


def test_cli_prints_the_table(line: Path, capsys: pytest.CaptureFixture) -> None:
    assert cli_main(["tune", str(line), "--budget-gb", "4", "--max-rows", "2"]) == 0
    out = capsys.readouterr().out
    assert "seq_len" in out and "chosen" in out and "written to" in out


@pytest.mark.cuda
def test_tune_on_the_gpu_measures_with_cuda_memory(line: Path) -> None:
    document = json.loads((line / "run.json").read_text())
    document["device"] = "cuda"
    (line / "run.json").write_text(json.dumps(document))
    result = tune_line(line, max_rows=4)
    chosen = result.lengths[0].chosen
    assert chosen is not None and chosen.peak_bytes is not None and chosen.peak_bytes > 0
    assert RunConfig.load(line / "run.json").length(SEQ_LEN).micro_batch_rows == chosen.micro_batch_rows


def test_a_kind_recomputed_in_part_is_tried_where_none_runs_out_and_the_kind_fits() -> None:
    """At 8 rows `none` ran out and `dendritic` (36 layers) fits; from 4 rows: none's peak would be
    10 + 2 x 50 = 110 GiB at 8 rows, each layer recomputed saves 2 x 36 / 36 = 2 GiB there, so a
    budget of 100 GiB needs 5 of them, and one more for the margin."""
    tuning = LengthTuning(4096)
    for rows, setting, peak_gib, fits in [
        (4, "none", 60, True), (8, "none", None, False), (4, "dendritic", 24, True), (8, "dendritic", 38, True),
    ]:  # fmt: skip
        peak = None if peak_gib is None else peak_gib * GIB
        tuning.measurements.append(Measurement(4096, rows, setting, 1.0, peak, fits))
    assert partial_recompute(tuning, "dendritic", 36, 10 * GIB, 100 * GIB) == (8, "dendritic:6")
    # Nothing to try: the kind was not measured at 8 rows, or does not fit there, or every layer is needed.
    assert partial_recompute(tuning, "hippocampal", 12, 10 * GIB, 100 * GIB) is None
    assert partial_recompute(tuning, "dendritic", 36, 10 * GIB, 30 * GIB) is None
    tuning.measurements[3].fits = False
    assert partial_recompute(tuning, "dendritic", 36, 10 * GIB, 100 * GIB) is None
