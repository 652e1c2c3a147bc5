"""run.json: round trip, every kind of error (message text asserted), lifelong keys."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from engine.config.run import (
    EMAConfig,
    LRPiece,
    RampPiece,
    RunConfig,
    SharedShapeConfig,
    check_changes,
)
from engine.errors import ConfigError, LineError
from engine.models import presets
from engine.units import GIB


@dataclasses.dataclass
class FakePresetConfig:
    vocab_size: int = 256
    width: int = 32

    def validate(self) -> None:
        """Every shape of this stand-in can be built (the registry's contract asks for the method)."""


FAKE_PRESETS = {"tiny-test": FakePresetConfig()}


def fake_preset_config(name: str, overrides: dict[str, Any] | None = None) -> FakePresetConfig:
    if name not in FAKE_PRESETS:
        raise ConfigError(f"model.preset: unknown preset {name!r}")
    fields = {spec.name for spec in dataclasses.fields(FakePresetConfig)}
    unknown = sorted(set(overrides or {}) - fields)
    if unknown:
        raise ConfigError(f"model.overrides: unknown key {unknown[0]!r} for preset {name!r}")
    return dataclasses.replace(FAKE_PRESETS[name], **(overrides or {}))


@pytest.fixture(autouse=True)
def fake_presets(monkeypatch: pytest.MonkeyPatch) -> None:
    # The model modules are written alongside this one; the registry's two entry points stand in.
    monkeypatch.setattr(presets, "preset_names", lambda: sorted(FAKE_PRESETS))
    monkeypatch.setattr(presets, "preset_config", fake_preset_config)


def minimal() -> dict[str, Any]:
    return {"model": {"preset": "tiny-test"}, "data": {"line": "/data/lines/trunk"}}


def full() -> dict[str, Any]:
    """A run.json using every feature: ramp, lr pieces, ema, shared shapes, two stages."""
    return {
        **minimal(),
        "lengths": [
            {"seq_len": 4096, "micro_batch_rows": 8, "recompute": "dendritic",
             "shared": {"micro_batch_rows": 2, "recompute": "all"}},
            {"seq_len": 32768, "micro_batch_rows": 1, "recompute": "all"},
        ],
        "plan": [{"name": "decay", "seq_len": 4096, "tokens": 1e10},
                 {"name": "long", "seq_len": 32768, "tokens": None}],
        "tokens_per_update": [{"from": 0, "to": 4.7e9, "tokens": 262144},
                              {"from": 4.7e9, "to": None, "tokens": 393216}],
        "optimizer": {"betas": [0.9, 0.95], "weight_decay_batch": 1048576},
        "lr": {"peak": 3e-4, "pieces": [{"kind": "warmup", "until": 1e8},
                                        {"kind": "decay", "until": 1e9, "to": 0.1, "shape": "cosine"},
                                        {"kind": "constant", "to": 0.1}]},
        "ema": {"horizon_tokens": 2e9, "from_tokens": 2e9},
        "guards": {"share_reserve_gb": 24},
        "wandb": {"project": "ns", "mode": "online"},
        "allow_changes": ["optimizer.eps"],
    }


def loaded(document: dict[str, Any]) -> RunConfig:
    config = RunConfig.from_dict(document)
    config.validate()
    return config


def error_of(document: Any) -> str:
    with pytest.raises(ConfigError) as info:
        loaded(document)
    return str(info.value)


def test_defaults_fill_everything_but_preset_and_data() -> None:
    config = loaded(minimal())
    assert config.tokens_per_update == 262144
    assert config.plan[0].seq_len == config.lengths[0].seq_len
    assert config.optimizer.betas == (0.9, 0.95)


@pytest.mark.parametrize("document", [minimal(), full()], ids=["minimal", "full"])
def test_round_trip_and_stable_text(document: dict[str, Any], tmp_path: Path) -> None:
    config = loaded(document)
    assert RunConfig.from_dict(config.to_dict()) == config
    path = tmp_path / "run.json"
    config.save(path)
    text = path.read_text()
    assert text == json.dumps(json.loads(text), indent=2, sort_keys=True) + "\n"
    again = RunConfig.load(path)
    assert again == config
    again.save(path)
    assert path.read_text() == text
    assert [p.name for p in tmp_path.iterdir()] == ["run.json"]  # no temporary file left


def test_whole_numbers_are_saved_as_the_integers_the_user_wrote(tmp_path: Path) -> None:
    """run.json saved back (by tune, a branch, new) keeps `"until": 100000` as written: it read
    `100000.0` after a save (found in a CLI walkthrough). Fractions stay fractions, and the fields
    stay floats in Python."""
    document = minimal()
    document["lr"] = {"peak": 3e-4, "pieces": [{"kind": "warmup", "until": 100000}, {"kind": "constant"}]}
    document["plan"] = [{"name": "trunk", "seq_len": 4096, "tokens": 3000000}]
    document["guards"] = {"min_free_disk_gb": 5, "watchdog_minutes": 7.5}
    document["ema"] = {"horizon_tokens": 2e9, "from_tokens": 0}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(document))
    RunConfig.load(path).save(path)

    saved = json.loads(path.read_text())
    assert saved["lr"]["pieces"][0] == {"kind": "warmup", "until": 100000, "to": 1, "shape": "linear"}
    assert saved["plan"][0]["tokens"] == 3000000 and saved["ema"] == {"horizon_tokens": 2000000000, "from_tokens": 0}
    assert saved["guards"]["min_free_disk_gb"] == 5 and saved["guards"]["watchdog_minutes"] == 7.5
    assert "100000.0" not in path.read_text()
    assert not [value for value in _numbers(saved) if isinstance(value, float) and value.is_integer()]
    config = RunConfig.load(path)
    assert isinstance(config.lr.pieces[0].until_tokens, float) and config.lr.pieces[0].until_tokens == 100000
    assert config == loaded(document)


def _numbers(document: Any) -> list[Any]:
    """Every number in a parsed JSON document."""
    if isinstance(document, dict):
        return [number for value in document.values() for number in _numbers(value)]
    if isinstance(document, list):
        return [number for value in document for number in _numbers(value)]
    return [document] if isinstance(document, (int, float)) and not isinstance(document, bool) else []


def test_full_parses_into_types() -> None:
    config = loaded(full())
    assert config.tokens_per_update == [RampPiece(0.0, 4.7e9, 262144), RampPiece(4.7e9, None, 393216)]
    assert config.lengths[0].shared == SharedShapeConfig(2, "all")
    assert config.lr.pieces[1] == LRPiece("decay", 1e9, 0.1, "cosine")
    assert config.ema == EMAConfig(2e9, 2e9)
    assert config.to_dict()["tokens_per_update"][1] == {"from": 4.7e9, "to": None, "tokens": 393216}


def test_missing_file_and_malformed_json(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"run\.json: no such file"):
        RunConfig.load(tmp_path / "run.json")
    path = tmp_path / "run.json"
    path.write_text('{\n  "model": {"preset": "tiny-test"},\n  "data": }\n')
    with pytest.raises(ConfigError) as info:
        RunConfig.load(path)
    assert str(info.value) == f"{path}: malformed JSON at line 3 column 11: Expecting value"
    # A raw tab inside a string: the decoder's "Invalid control character at" read as cut off.
    path.write_text('{"model": {"preset": "tiny\t"}}')
    with pytest.raises(ConfigError) as info:
        RunConfig.load(path)
    assert str(info.value) == f"{path}: malformed JSON at line 1 column 27: Invalid control character"
    path.write_text('{"print_every": ' + "9" * 5000 + "}")
    with pytest.raises(ConfigError) as info:
        RunConfig.load(path)
    assert str(info.value) == (
        f"{path}: cannot be parsed (Exceeds the limit (4300 digits) for integer string conversion: value has "
        "5000 digits)"
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d["optimizer"].update(beta1=0.9), "run.json: unknown key optimizer.beta1"),
        (lambda d: d.update(lr_peak=1), "run.json: unknown key lr_peak"),
        (lambda d: d["lengths"][1].update(rows=1), "run.json: unknown key lengths[1].rows"),
        (lambda d: d["lengths"][0].update(seq_len="4k"),
         'run.json: lengths[0].seq_len must be an integer, got "4k"'),
        (lambda d: d["lengths"][0].update(seq_len=4096.5),
         "run.json: lengths[0].seq_len must be an integer, got 4096.5"),
        (lambda d: d["optimizer"].update(betas=[0.9]),
         "run.json: optimizer.betas must be a list of 2 numbers, got [0.9]"),
        (lambda d: d["optimizer"].update(betas=[0.9, 1.2]),
         "run.json: optimizer.betas[1] must be in [0, 1), got 1.2"),
        (lambda d: d["optimizer"].update(clip=True), "run.json: optimizer.clip must be a number, got true"),
        (lambda d: d["optimizer"].update(eps=float("nan")),
         "run.json: optimizer.eps must be a finite number, got NaN"),
        (lambda d: d.update(tokens_per_update="many"),
         'run.json: tokens_per_update must be an integer or a list, got "many"'),
        (lambda d: d.update(ema=[1]), "run.json: ema must be an object or null, got [1]"),
        (lambda d: d["model"].pop("preset"), "run.json: missing key model.preset"),
        (lambda d: d["model"].update(preset="gpt-5"),
         'run.json: model.preset "gpt-5" is not a preset (known: tiny-test)'),
        (lambda d: d["model"].update(overrides={"depth": 3}),
         "run.json: model.overrides: unknown key 'depth' for preset 'tiny-test'"),
        (lambda d: d["plan"][1].update(seq_len=8192),
         "run.json: plan[1].seq_len 8192 has no entry in lengths"),
        (lambda d: d["plan"][0].update(tokens=None),
         "run.json: plan[0].tokens may be null (until the data line ends) only in the last stage"),
        (lambda d: d["plan"][1].update(name="decay"),
         'run.json: plan[1].name "decay" appears twice in the plan'),
        (lambda d: d["lengths"][1].update(seq_len=4096),
         "run.json: lengths[1].seq_len 4096 already has an entry (lengths[0])"),
        (lambda d: d["lengths"][0].update(recompute="Some layers"),
         'run.json: lengths[0].recompute must be none, all, a layer kind or kind:count, got "Some layers"'),
        (lambda d: d["lengths"][0].update(recompute="dendritic:"),
         'run.json: lengths[0].recompute must be none, all, a layer kind or kind:count, got "dendritic:"'),
        (lambda d: d["lengths"][0]["shared"].update(micro_batch_rows=0),
         "run.json: lengths[0].shared.micro_batch_rows must be at least 1, got 0"),
        (lambda d: d["tokens_per_update"][1].update({"from": 5e9}),
         "run.json: tokens_per_update[1].from must be the previous piece's to (4.7e9), got 5e9"),
        (lambda d: d["tokens_per_update"][0].update(to=None),
         "run.json: tokens_per_update[0].to may be null (open-ended) only in the last piece"),
        (lambda d: d["tokens_per_update"][1].update(tokens=300000),
         "run.json: tokens_per_update[1].tokens 300000 is not a multiple of plan[0] (decay)'s seq_len 4096"),
        (lambda d: d.update(tokens_per_update=4096),
         "run.json: tokens_per_update 4096 is not a multiple of plan[1] (long)'s seq_len 32768"),
        (lambda d: d["lr"]["pieces"][1].update(until=5e7),
         "run.json: lr.pieces[1].until must exceed 1e8, got 5e7"),
        (lambda d: d["lr"]["pieces"][1].update(kind="anneal"),
         'run.json: lr.pieces[1].kind must be one of warmup, constant, decay, got "anneal"'),
        (lambda d: d["lr"]["pieces"][1].update(shape="exp"),
         'run.json: lr.pieces[1].shape must be one of linear, cosine, sqrt, got "exp"'),
        (lambda d: d["lr"]["pieces"][0].update(shape="cosine"),
         "run.json: lr.pieces[0].shape applies to decay pieces only; a warmup is linear"),
        (lambda d: d["lr"]["pieces"][1].update(to=1.5),
         "run.json: lr.pieces[1].to must be in [0, 1], got 1.5"),
        (lambda d: d["lr"]["pieces"][2].update(kind="decay"),
         "run.json: lr.pieces[2].until may be null only in a constant piece, not a decay"),
        (lambda d: d["lr"].update(peak=0), "run.json: lr.peak must be positive, got 0.0"),
        (lambda d: d["wandb"].update(mode="cloud"),
         'run.json: wandb.mode must be one of online, offline, disabled, got "cloud"'),
        (lambda d: d.update(device="tpu"), 'run.json: device must be auto, cpu, cuda or cuda:N, got "tpu"'),
        (lambda d: d.update(allow_changes=["optimiser"]),
         'run.json: allow_changes[0] "optimiser" is not a lifelong key'),
        (lambda d: d.update(allow_changes=["tokens_per_update"]),
         "run.json: allow_changes[0] cannot list tokens_per_update: the ramp may only grow at its end"),
        (lambda d: d.update(checkpoints={"keep_last": 0}),
         "run.json: checkpoints.keep_last must be at least 1, got 0"),
    ],
)
def test_each_error_is_one_precise_line(change: Any, message: str) -> None:
    document = full()
    change(document)
    text = error_of(document)
    assert text.startswith(message), text
    assert "\n" not in text


def test_a_presets_own_refusal_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    def refusing(name: str, overrides: dict[str, Any] | None = None) -> FakePresetConfig:
        raise ValueError("width 30 is not a multiple of heads 4")

    monkeypatch.setattr(presets, "preset_config", refusing)
    document = minimal()
    document["model"]["overrides"] = {"width": 30}
    assert error_of(document) == (
        "run.json: model.overrides are not valid for tiny-test: width 30 is not a multiple of heads 4"
    )


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("dendritic:7", "lengths[0].recompute is not valid for ns-tiny: recompute 'dendritic:7': the count must be 1..3"),
        ("hippocampal:0", "lengths[0].recompute is not valid for ns-tiny: recompute 'hippocampal:0': the count must be 1..1"),
        ("all:2", "lengths[0].recompute is not valid for ns-tiny: recompute must be one of"),
        ("most", "lengths[0].recompute is not valid for ns-tiny: recompute must be one of"),
    ],
)
def test_an_ns_recompute_setting_must_name_layers_the_model_has(
    monkeypatch: pytest.MonkeyPatch, setting: str, message: str
) -> None:
    monkeypatch.undo()  # the real registry: an NS preset's layers
    document = minimal()
    document["model"]["preset"] = "ns-tiny"
    document["lengths"] = [{"seq_len": 64, "micro_batch_rows": 1, "recompute": setting}]
    document["plan"] = [{"name": "main", "seq_len": 64, "tokens": None}]
    document["tokens_per_update"] = 64
    assert error_of(document).startswith(f"run.json: {message}")
    document["lengths"][0]["shared"] = {"micro_batch_rows": 1, "recompute": setting}
    document["lengths"][0]["recompute"] = "dendritic:2"
    assert error_of(document).startswith(f"run.json: {message}".replace("lengths[0]", "lengths[0].shared"))


def test_load_names_the_file_it_read(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    document = full()
    document["optimizer"]["betas"] = [0.9, 1.2]
    path.write_text(json.dumps(document))
    with pytest.raises(ConfigError) as info:
        RunConfig.load(path)
    assert str(info.value) == f"{path}: optimizer.betas[1] must be in [0, 1), got 1.2"


def test_whole_float_is_accepted_for_integers() -> None:
    document = minimal()
    document["tokens_per_update"] = 5.24288e5
    assert loaded(document).tokens_per_update == 524288


# -- units: every *_gb setting is GiB ------------------------------------------------------------


def test_the_gb_guards_convert_to_bytes_as_gib() -> None:
    guards = loaded(full()).guards  # share_reserve_gb 24, min_free_disk_gb 20 (the default)
    assert GIB == 1_073_741_824
    assert guards.share_reserve_bytes == 24 * 1_073_741_824 == 25_769_803_776  # not 24e9
    assert guards.min_free_disk_bytes == 20 * 1_073_741_824 == 21_474_836_480  # not 20e9
    document = minimal()
    document["guards"] = {"share_reserve_gb": 1.5, "min_free_disk_gb": 0.25}
    fractional = loaded(document).guards
    assert (fractional.share_reserve_bytes, fractional.min_free_disk_bytes) == (1_610_612_736, 268_435_456)
    assert loaded(minimal()).guards.share_reserve_bytes is None  # no reserve: no bytes either


def test_a_shared_tune_needs_a_reserve_and_gets_it_in_bytes() -> None:
    assert loaded(full()).guards.shared_tune_reserve_bytes("run.json") == 24 * GIB
    guards = loaded(minimal()).guards
    with pytest.raises(LineError, match=r"^x/run\.json: --shared needs guards\.share_reserve_gb \(the memory"):
        guards.shared_tune_reserve_bytes("x/run.json")
    with pytest.raises(LineError, match=r"^x/run\.json: a shared tune needs guards\.share_reserve_gb"):
        guards.shared_tune_reserve_bytes("x/run.json", "a shared tune")


# -- lifelong keys --------------------------------------------------------------------------------


def changed(config: RunConfig, edit: Any) -> RunConfig:
    document = config.to_dict()
    edit(document)
    return loaded(document)


def test_unchanged_and_non_lifelong_changes_pass() -> None:
    accepted = loaded(full())
    assert check_changes(accepted, accepted) == []
    other = changed(accepted, lambda d: d.update(print_every=1, device="cpu", lr={**d["lr"], "peak": 1e-3}))
    assert check_changes(accepted, other) == []


def test_lifelong_key_change_is_refused_with_its_dotted_name() -> None:
    accepted = loaded(full())
    def edit(document: dict[str, Any]) -> None:
        document["optimizer"]["weight_decay"] = 0.05
        document["seeds"]["data"] = 7
        document["data"]["line"] = "/elsewhere"
        document["wandb"]["project"] = "x"

    current = changed(accepted, edit)
    messages = check_changes(accepted, current)
    assert [m.split(" changed")[0] for m in messages] == [
        "data.line", "optimizer.weight_decay", "seeds.data", "wandb.project"
    ]
    assert messages[1] == (
        'optimizer.weight_decay changed from 0.1 to 0.05 (add "optimizer.weight_decay" to allow_changes to change it on purpose)'
    )


def test_allow_changes_by_key_and_by_section() -> None:
    accepted = loaded(full())
    by_key = changed(
        accepted, lambda d: (d["optimizer"].update(eps=1e-6), d.update(allow_changes=["optimizer.eps"]))
    )
    assert check_changes(accepted, by_key) == []
    not_listed = changed(
        accepted, lambda d: (d["optimizer"].update(clip=0.5), d.update(allow_changes=["optimizer.eps"]))
    )
    assert len(check_changes(accepted, not_listed)) == 1
    by_section = changed(
        accepted, lambda d: (d["optimizer"].update(clip=0.5, eps=1e-6), d.update(allow_changes=["optimizer"]))
    )
    assert check_changes(accepted, by_section) == []


def test_ramp_may_only_grow_at_its_end() -> None:
    accepted = loaded(full())  # ramp: [0, 4.7e9) 262144, [4.7e9, open) 393216
    closed_and_appended = [
        {"from": 0, "to": 4.7e9, "tokens": 262144},
        {"from": 4.7e9, "to": 9e9, "tokens": 393216},
        {"from": 9e9, "to": None, "tokens": 524288},
    ]
    grown = changed(accepted, lambda d: d.update(tokens_per_update=closed_and_appended))
    assert check_changes(accepted, grown) == []
    rewritten = changed(accepted, lambda d: d["tokens_per_update"][0].update(tokens=131072))
    (message,) = check_changes(accepted, rewritten)
    assert message.startswith("tokens_per_update piece 0 changed from")
    assert message.endswith("(the ramp may only grow at its end)")
    # The open piece's batch cannot change in place, whatever allow_changes lists.
    in_place = changed(accepted, lambda d: (d["tokens_per_update"][1].update(tokens=524288),
                                            d.update(allow_changes=["optimizer", "data", "seeds"])))
    assert len(check_changes(accepted, in_place)) == 1


def test_single_number_grows_into_a_ramp() -> None:
    document = minimal()
    document["tokens_per_update"] = 262144
    accepted = loaded(document)
    ramp = changed(accepted, lambda d: d.update(tokens_per_update=[
        {"from": 0, "to": 1e9, "tokens": 262144}, {"from": 1e9, "to": None, "tokens": 524288}]))
    assert check_changes(accepted, ramp) == []
    other_number = changed(accepted, lambda d: d.update(tokens_per_update=524288))
    assert len(check_changes(accepted, other_number)) == 1


def test_lr_pieces_may_only_grow_at_their_end() -> None:
    accepted = loaded(minimal())  # warmup to 2e8, then constant (open)
    closed_and_decayed = changed(accepted, lambda d: d["lr"].update(pieces=[
        d["lr"]["pieces"][0], {**d["lr"]["pieces"][1], "until": 5e9},
        {"kind": "decay", "until": 6e9, "to": 0.0, "shape": "sqrt"}, {"kind": "constant", "to": 0.0}]))
    assert check_changes(accepted, closed_and_decayed) == []
    shortened_warmup = changed(accepted, lambda d: d["lr"]["pieces"][0].update(until=1e8))
    (message,) = check_changes(accepted, shortened_warmup)
    assert message.startswith("lr.pieces piece 0 changed")
    dropped = changed(accepted, lambda d: d["lr"].update(pieces=[{"kind": "constant"}]))
    assert check_changes(accepted, dropped) == [
        "lr.pieces lost pieces: 2 accepted, 1 now (the schedule may only grow at its end)"
    ]
