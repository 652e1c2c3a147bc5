"""Validation on a tiny real line: losses, mix, document positions, probes, optimizer state, EMA, long rows.

Every number is compared with a direct computation from the model and the held-out rows.
"""

from __future__ import annotations

import math
import re
import shlex
from pathlib import Path

import pytest
import torch
from helpers.lines import SEQ_LEN, make_data_line, make_line

from datalines import open_data_line
from datalines.validation import build_validation
from engine.config.run import EMAConfig, RunConfig
from engine.errors import LineError
from engine.models.build import build_model
from engine.training.optim import AdamWSettings, FlatAdamW, ParameterAverage
from engine.training.step import EagerEngine
from engine.training.validation import Validator, probe_batch
from engine.training.validation_losses import document_position_bins

LONG_LEN = 2 * SEQ_LEN


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread


@pytest.fixture(scope="module")
def data_line_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("validate")
    path = make_data_line(root, prepare=1)
    build_validation(open_data_line(path), [SEQ_LEN, LONG_LEN])
    return path


@pytest.fixture(scope="module")
def config(data_line_path: Path, tmp_path_factory: pytest.TempPathFactory) -> RunConfig:
    return RunConfig.load(make_line(tmp_path_factory.mktemp("line"), data_line_path) / "run.json")


def build(
    config: RunConfig, preset: str = "transformer-tiny", overrides: dict | None = None, ema: bool = False
):
    torch.manual_seed(0)
    model = build_model(preset, config.model.overrides if overrides is None else overrides)
    optimizer = FlatAdamW(model, AdamWSettings(0.9, 0.95, 1e-8, 1.0), torch.device("cpu"))
    average = ParameterAverage(optimizer, horizon_tokens=1024, from_tokens=0) if ema else None
    return model, optimizer, average


def train(model, optimizer, average, updates: int, validate=None) -> None:
    """`updates` updates on fixed random windows; `validate(update)` after each when given."""
    generator = torch.Generator().manual_seed(1)
    engine = EagerEngine(model, optimizer, micro_batch_rows=4)
    for update in range(1, updates + 1):
        windows = torch.randint(0, 256, (8, SEQ_LEN + 1), generator=generator)  # below every vocab here
        result = engine.run_update(windows, lr=3e-3, weight_decay=0.1)
        if average is not None:
            average.after_update(update * 8 * SEQ_LEN, 8 * SEQ_LEN, result.stats.finite)
        if validate is not None:
            validate(update)


def direct_losses(model, windows: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        loss, _ = model(windows[:, :-1], windows[:, 1:])
    model.train()
    return loss.double()


def test_document_position_bins_by_hand() -> None:
    eos = 0
    #              t: 0  1  2  3  4  5  6  7  8  9
    window = torch.tensor([[5, 6, 0, 7, 8, 9, 3, 4, 2, 1, 9]])
    bins = document_position_bins(window, eos)
    # before the first EOS the row cut into a document; after it distances 0,1,2,3,4,5,6,7
    assert bins.tolist() == [[-1, -1, 0, 1, 2, 2, 3, 3, 3, 3]]
    assert document_position_bins(torch.tensor([[0, 1, 0, 2]]), eos).tolist() == [[0, 1, 0]]


def test_losses_mix_and_docpos_equal_a_direct_computation(config: RunConfig, data_line_path: Path) -> None:
    model, optimizer, _ = build(config)
    heldout = open_data_line(data_line_path)
    validator = Validator(model, optimizer, None, config, heldout, torch.device("cpu"))
    metrics = validator.run(SEQ_LEN, at_tokens=0, next_lr=1e-3, next_weight_decay=0.1)

    windows = torch.from_numpy(heldout.validation_rows(SEQ_LEN)["text"][: config.validation.rows_per_source])
    windows = windows.long()
    loss = direct_losses(model, windows)
    assert metrics[f"val_{SEQ_LEN}/text"] == pytest.approx(float(loss.mean()), rel=1e-12)
    assert metrics[f"val_{SEQ_LEN}/mix"] == pytest.approx(float(loss.mean()), rel=1e-12)  # one source
    assert metrics[f"val_{SEQ_LEN}/mean"] == pytest.approx(float(loss.mean()), rel=1e-12)

    # Document positions by a plain loop over every target.
    sums: dict[int, float] = {}
    counts: dict[int, int] = {}
    counted = 0
    for r, row in enumerate(windows.tolist()):
        last_eos = None
        for t in range(SEQ_LEN):
            if row[t] == heldout.eos_id:
                last_eos = t
            if last_eos is None:
                continue
            distance = t - last_eos
            k = 0 if distance == 0 else int(math.floor(math.log2(distance))) + 1
            sums[k] = sums.get(k, 0.0) + float(loss[r, t])
            counts[k] = counts.get(k, 0) + 1
            counted += 1
    assert counts, "the held-out rows hold no EOS: the test line is too small"
    for k in counts:
        assert metrics[f"val_{SEQ_LEN}/docpos/bin{k}"] == pytest.approx(sums[k] / counts[k], rel=1e-9)
    reported = {int(key.rsplit("bin", 1)[1]) for key in metrics if "/docpos/bin" in key}
    assert reported == set(counts) and len(reported) >= 3
    assert metrics[f"val_{SEQ_LEN}/docpos/tokens_frac"] == pytest.approx(counted / windows[:, 1:].numel())


def test_optimizer_summary_equals_adamw_next_step(config: RunConfig, data_line_path: Path) -> None:
    model, optimizer, _ = build(config)
    train(model, optimizer, None, updates=3)
    before = [t.clone() for t in (optimizer.params, optimizer.exp_avg, optimizer.exp_avg_sq, optimizer.step)]
    validator = Validator(model, optimizer, None, config, open_data_line(data_line_path), torch.device("cpu"))
    lr, wd = 2e-3, 0.05
    metrics = validator.run(SEQ_LEN, at_tokens=0, next_lr=lr, next_weight_decay=wd)
    for buffer, saved in zip(
        (optimizer.params, optimizer.exp_avg, optimizer.exp_avg_sq, optimizer.step), before
    ):
        assert torch.equal(buffer, saved)

    t = 3
    for group in optimizer.groups:
        span = slice(group.start, group.end)
        p, m, v = (b[span].double() for b in (optimizer.params, optimizer.exp_avg, optimizer.exp_avg_sq))
        v_hat = v / (1 - 0.95**t)
        update = lr * (m / (1 - 0.9**t)) / (v_hat.sqrt() + 1e-8) + (lr * wd * p if group.weight_decay else 0)
        prefix = f"opt/{group.name}"
        assert metrics[f"{prefix}/param_norm"] == pytest.approx(float(p.norm()), rel=1e-9)
        assert metrics[f"{prefix}/m_norm"] == pytest.approx(float(m.norm()), rel=1e-9)
        assert metrics[f"{prefix}/grad_rms"] == pytest.approx(float(v_hat.mean().sqrt()), rel=1e-6)
        assert metrics[f"{prefix}/update_norm"] == pytest.approx(float(update.norm()), rel=1e-6)
        assert metrics[f"{prefix}/update_ratio"] == pytest.approx(float(update.norm() / p.norm()), rel=1e-6)
    assert set(optimizer.layer_names) >= {"layer00", "layer01"}
    for layer in optimizer.layer_names:
        for name in ("param_norm", "update_norm", "update_ratio"):
            assert math.isfinite(metrics[f"opt/{layer}/{name}"])
    # The layers partition the parameters: their squared norms add up to the groups'.
    layer_sq = sum(metrics[f"opt/{layer}/param_norm"] ** 2 for layer in optimizer.layer_names)
    group_sq = sum(metrics[f"opt/{group.name}/param_norm"] ** 2 for group in optimizer.groups)
    assert layer_sq == pytest.approx(group_sq, rel=1e-9)


def test_validating_changes_nothing_training_depends_on(config: RunConfig, data_line_path: Path) -> None:
    heldout = open_data_line(data_line_path)
    plain = build(config, ema=True)
    train(*plain, updates=4)
    validated = build(config, ema=True)
    validator = Validator(*validated, config, heldout, torch.device("cpu"))
    seen: list[int] = []

    def validate(update: int) -> None:
        if update % 2 == 0:
            rng = torch.get_rng_state()
            validator.run(SEQ_LEN, at_tokens=0, next_lr=1e-3, next_weight_decay=0.1)
            seen.append(update)
            assert torch.equal(torch.get_rng_state(), rng)
            assert validated[0].training

    train(*validated, updates=4, validate=validate)
    assert seen == [2, 4]
    for name in ("params", "grads", "exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(getattr(plain[1], name), getattr(validated[1], name)), name
    assert torch.equal(plain[2].average, validated[2].average)


def test_ema_losses_are_those_of_the_averaged_weights(config: RunConfig, data_line_path: Path) -> None:
    heldout = open_data_line(data_line_path)
    model, optimizer, average = build(config, ema=True)
    train(model, optimizer, average, updates=3)
    assert average is not None and average.started
    assert not torch.equal(average.average, optimizer.params)
    params = optimizer.params.clone()
    metrics = Validator(model, optimizer, average, config, heldout, torch.device("cpu")).run(
        SEQ_LEN, at_tokens=0, next_lr=1e-3, next_weight_decay=0.1
    )
    assert torch.equal(optimizer.params, params)  # the exact bits are back

    twin, twin_optimizer, _ = build(config)
    twin_optimizer.params.copy_(average.average)
    windows = torch.from_numpy(
        heldout.validation_rows(SEQ_LEN)["text"][: config.validation.rows_per_source]
    ).long()
    expected = float(direct_losses(twin, windows).mean())
    assert metrics[f"ema/val_{SEQ_LEN}/text"] == pytest.approx(expected, rel=1e-12)
    assert metrics[f"ema/val_{SEQ_LEN}/mix"] == pytest.approx(expected, rel=1e-12)
    assert metrics[f"val_{SEQ_LEN}/text"] != metrics[f"ema/val_{SEQ_LEN}/text"]


def test_ns_probes_and_the_long_row_probe_appear_with_the_spec_names(
    config: RunConfig, data_line_path: Path
) -> None:
    heldout = open_data_line(data_line_path)
    overrides = {"vocab_size": heldout.vocab_size, "eos_id": heldout.eos_id, "rope_max_seq_len": LONG_LEN,
                 "chunk_len": 16}  # fmt: skip
    ns_config = RunConfig.from_dict(
        {**config.to_dict(), "model": {"preset": "ns-tiny", "overrides": overrides}}
    )
    ns_config.ema = EMAConfig(horizon_tokens=1024, from_tokens=0)
    model, optimizer, average = build(ns_config, "ns-tiny", overrides, ema=True)
    train_windows = torch.randint(
        0, heldout.vocab_size, (2, SEQ_LEN + 1), generator=torch.Generator().manual_seed(3)
    )
    EagerEngine(model, optimizer, 2).run_update(train_windows, 1e-3, 0.1)
    assert average is not None
    average.after_update(2 * SEQ_LEN, 2 * SEQ_LEN, True)
    validator = Validator(model, optimizer, average, ns_config, heldout, torch.device("cpu"))
    assert validator.lengths() == [SEQ_LEN, LONG_LEN]
    metrics = validator.run(SEQ_LEN, at_tokens=0, next_lr=1e-3, next_weight_decay=0.1)

    short, long = f"val_{SEQ_LEN}", f"val_{LONG_LEN}"
    for name in ("dendritic/retention_p50", "dendritic/tau_p50", "dendritic/firing",
                 "hippocampal/clock_tau_p50", "hippocampal/write_p50"):  # fmt: skip
        assert math.isfinite(metrics[f"{short}/{name}"]), name
        assert math.isfinite(metrics[f"{long}/{name}"]), name
    for name in ("text", "mix", "mean", "pos/seg0", "pos/seg1", "pos/last_over_first"):
        assert math.isfinite(metrics[f"{long}/{name}"]), name
    assert metrics[f"{long}/pos/last_over_first"] == pytest.approx(
        metrics[f"{long}/pos/seg1"] / metrics[f"{long}/pos/seg0"]
    )
    assert any(key.startswith(f"{long}/dendritic/retention_seg") for key in metrics)
    for name in ("text", "mix", "mean"):
        assert math.isfinite(metrics[f"ema/{short}/{name}"])
        assert math.isfinite(metrics[f"ema/{long}/{name}"])


def test_probe_batch_takes_every_source_in_turn() -> None:
    rows = {"a": torch.zeros(3, 5, dtype=torch.long), "b": torch.ones(1, 5, dtype=torch.long)}
    assert probe_batch(rows, 3)[:, 0].tolist() == [0, 1, 0]
    assert probe_batch(rows, 1).shape[0] == 2  # at least one row of each source


def test_a_missing_length_of_held_out_rows_is_one_clear_error(config: RunConfig, tmp_path: Path) -> None:
    from datalines.errors import DataLineError

    data = make_data_line(tmp_path, prepare=1, validation=())  # no `data val` run
    model, optimizer, _ = build(config)
    validator = Validator(model, optimizer, None, config, open_data_line(data), torch.device("cpu"))
    assert validator.lengths() == [SEQ_LEN]
    where = re.escape(str(data))
    expected = rf"^{where}: no held-out rows of length 32 .*`nsconsole data val --work {where} --seq-len 32 --long-seq-len 0`$"
    with pytest.raises(LineError, match=expected):
        validator.require_rows()
    with pytest.raises(DataLineError, match=r"no validation rows of length 32; run `nsconsole data val"):
        validator.run(SEQ_LEN, at_tokens=0, next_lr=1e-3, next_weight_decay=0.1)


def test_the_command_a_missing_length_names_builds_it_and_succeeds(
    config: RunConfig, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The refusal's `nsconsole data val` command, run as written, builds the length and exits 0 (it
    also built the default long length, 32768, which these short held-out documents cannot give:
    "not built" and exit status 1)."""
    from nsconsole.cli import main

    data = make_data_line(tmp_path, prepare=1, validation=())
    model, optimizer, _ = build(config)
    validator = Validator(model, optimizer, None, config, open_data_line(data), torch.device("cpu"))
    with pytest.raises(LineError) as refusal:
        validator.require_rows()
    commands = re.findall(r"`nsconsole (data val [^`]*)`", str(refusal.value))
    assert len(commands) == 1
    assert main(shlex.split(commands[0])) == 0, capsys.readouterr()
    assert "not built" not in capsys.readouterr().out
    validator.require_rows()


@pytest.mark.cuda
def test_validation_on_the_gpu_leaves_weights_and_rng_untouched(
    config: RunConfig, data_line_path: Path
) -> None:
    heldout = open_data_line(data_line_path)
    device = torch.device("cuda")
    overrides = {"vocab_size": heldout.vocab_size, "eos_id": heldout.eos_id, "rope_max_seq_len": LONG_LEN}
    ns_config = RunConfig.from_dict(
        {**config.to_dict(), "model": {"preset": "ns-tiny", "overrides": overrides}}
    )
    torch.manual_seed(0)
    model = build_model("ns-tiny", overrides).to(device)
    optimizer = FlatAdamW(model, AdamWSettings(0.9, 0.95, 1e-8, 1.0), device)
    average = ParameterAverage(optimizer, horizon_tokens=1024, from_tokens=0)
    windows = torch.randint(
        0, heldout.vocab_size, (4, SEQ_LEN + 1), generator=torch.Generator().manual_seed(3)
    )
    EagerEngine(model, optimizer, 2).run_update(windows, 1e-3, 0.1)
    average.after_update(4 * SEQ_LEN, 4 * SEQ_LEN, True)
    EagerEngine(model, optimizer, 2).run_update(windows, 1e-3, 0.1)
    average.after_update(8 * SEQ_LEN, 4 * SEQ_LEN, True)
    state = [t.clone() for t in (optimizer.params, optimizer.exp_avg, optimizer.exp_avg_sq, average.average)]
    rng = torch.cuda.get_rng_state(device)
    metrics = Validator(model, optimizer, average, ns_config, heldout, device).run(SEQ_LEN, 0, 1e-3, 0.1)
    after = (optimizer.params, optimizer.exp_avg, optimizer.exp_avg_sq, average.average)
    assert all(torch.equal(a, b) for a, b in zip(after, state))
    assert torch.equal(torch.cuda.get_rng_state(device), rng)
    for key in (
        f"val_{SEQ_LEN}/mix",
        f"ema/val_{SEQ_LEN}/mix",
        f"val_{LONG_LEN}/pos/seg1",
        "opt/decay/update_ratio",
    ):
        assert math.isfinite(metrics[key]), key
