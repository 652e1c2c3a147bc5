"""`nsconsole sample` and `chat` end to end on a tiny real line trained for a few updates.

The line (transformer-tiny with a parameters' average) trains 6 updates once per module, an
ns-tiny line 2; each test runs the command in this process, as `nsconsole` would, and reads what
it printed.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.lines import copy_data_line, data_template_fixture, make_line, one_torch_thread

from engine.checkpoints.format import read_latest
from engine.checkpoints.tensors import load_checkpoint
from engine.errors import CheckpointError
from engine.generation.chat import Conversation
from engine.generation.loading import load_for_generation
from engine.generation.settings import SamplingSettings
from engine.generation.text import TextStream
from engine.models.base import LanguageModel
from engine.models.transformer.model import TransformerLM
from engine.training.trainer import Trainer
from nsconsole.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")

data_template = data_template_fixture(prepare=1)


@pytest.fixture(scope="module")
def line(data_template: Path) -> Path:
    root = data_template.parent / "lines"  # each line on a data line of its own: a data line has one line
    trained = make_line(root, copy_data_line(data_template, root),
                        ema={"horizon_tokens": 2048, "from_tokens": 0})  # fmt: skip
    with one_torch_thread():
        assert Trainer(trained, stop_at=6, echo=None).run() == 0
    return trained


@pytest.fixture(scope="module")
def ns_line(data_template: Path) -> Path:
    # The long-row probe at 64: the tests' data line has held-out rows of 32 and 64 only.
    changes = {"model.preset": "ns-tiny", "validation.long_seq_len": 64}
    root = data_template.parent / "ns_lines"
    trained = make_line(root, copy_data_line(data_template, root), **changes)
    with one_torch_thread():
        assert Trainer(trained, stop_at=2, echo=None).run() == 0
    return trained


def sample(capsys: pytest.CaptureFixture[str], *arguments: str) -> tuple[int, str, str]:
    """`nsconsole sample ARGUMENTS`: exit status, stdout, stderr."""
    status = main(["sample", *arguments])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_sample_streams_text_after_the_prompt(line: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = sample(capsys, str(line), "--prompt", "the model", "--tokens", "30", "--seed", "1")
    assert status == 0, err
    assert out.startswith("the model") and len(out) > len("the model\n")
    header, footer = err.strip().splitlines()
    assert header.startswith(f"{line / 'checkpoints' / 'u00000006'} (transformer-tiny, ") and "seed 1" in header
    assert "; 30 tokens in " in footer


def test_the_same_seed_gives_the_same_text_and_another_seed_other_text(
    line: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    texts = [sample(capsys, str(line), "--tokens", "40", "--seed", seed)[1] for seed in ("5", "5", "6")]
    assert texts[0] == texts[1] != texts[2]


def test_a_line_stands_for_its_latest_checkpoint(line: Path, capsys: pytest.CaptureFixture[str]) -> None:
    latest = line / "checkpoints" / str(read_latest(line / "checkpoints"))
    first = line / "checkpoints" / "u00000000"  # the line's start: untrained weights
    arguments = ("--tokens", "40", "--seed", "2")
    (_, from_line, header), (_, from_latest, _), (_, from_first, _) = (
        sample(capsys, str(path), *arguments) for path in (line, latest, first)
    )
    assert latest.name == "u00000006" and header.startswith(f"{latest} (")
    assert from_line == from_latest != from_first


def test_ema_samples_from_the_parameters_average(line: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = sample(capsys, str(line), "--tokens", "5", "--ema", "--seed", "0")
    assert status == 0 and "the parameters' moving average" in err
    latest = line / "checkpoints" / "u00000006"
    checkpoint = load_checkpoint(latest)
    averaged = dict(load_for_generation(latest, torch.device("cpu"), average=True).model.named_parameters())
    names = [name for name, _, _ in checkpoint.state["layout"]]  # the flat buffers' order
    assert torch.equal(torch.cat([averaged[name].detach().reshape(-1) for name in names]), checkpoint.optimizer["ema"])
    weights = torch.cat([checkpoint.weights[name].reshape(-1) for name in names])
    assert not torch.equal(weights, checkpoint.optimizer["ema"])


@pytest.mark.parametrize("option", ["--data", "--tokenizer"])
def test_a_tokenizer_from_elsewhere_is_refused(line: Path, capsys: pytest.CaptureFixture[str], option: str) -> None:
    status, out, err = sample(capsys, str(line), option, str(line.parent / "tokenizer.json"))
    assert status == 2 and out == ""
    assert err.count("\n") == 1 and f"{option} is refused" in err and "u00000006" in err


def test_a_corrupted_checkpoint_is_refused_naming_the_file(
    line: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    copy = tmp_path / "line"
    shutil.copytree(line / "checkpoints", copy / "checkpoints")
    weights = copy / "checkpoints" / "u00000006" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0xFF
    weights.write_bytes(bytes(data))
    for source in (copy, copy / "checkpoints" / "u00000006"):
        status, out, err = sample(capsys, str(source), "--tokens", "5")
        assert status == 2 and out == ""
        assert err == f"nsconsole: {weights}: blake2b mismatch (corrupted)\n"


SEAT_HOLDER = """
import sys, time
from engine.training.cpu_share import CpuSeat
CpuSeat.take()
print("seated", flush=True)
time.sleep(600)
"""


def test_sample_beside_a_cpu_trainer_takes_its_share_of_the_cores(line: Path) -> None:
    # A README walkthrough: `sample` beside the training demo made 29 tokens/s, 134 with one thread:
    # its team of every core spun against the trainer's. It holds a CPU seat as a trainer does.
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "2"}
    holder = subprocess.Popen([sys.executable, "-c", SEAT_HOLDER], env=environment, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "seated"
        done = subprocess.run([sys.executable, "-m", "nsconsole", "sample", str(line), "--tokens", "3", "--device", "cpu"],
                              env=environment, capture_output=True, text=True, timeout=300)  # fmt: skip
    finally:
        holder.kill()
        holder.wait()
    assert done.returncode == 0, done.stderr
    assert "on cpu (1 of 2 threads), seed " in done.stderr.splitlines()[0]


def test_a_checkpoint_that_is_not_there_is_named_with_those_the_line_has(
    line: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Found in a README walkthrough: a checkpoint name retention had removed was called
    # "meta.json: missing (an incomplete checkpoint)", as if its directory were there.
    absent = line / "checkpoints" / "u00000099"
    status, out, err = sample(capsys, str(absent), "--tokens", "5")
    assert status == 2 and out == ""
    assert err.startswith(f"nsconsole: {absent}: no such checkpoint (the line has u00000000") and err.count("\n") == 1


@torch.no_grad()
def test_an_ns_line_samples_what_its_full_forward_chooses(
    ns_line: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Greedy draws through the command (prefill by the chunked scan, then one-token steps of the
    # recurrences and the pool caches) are the tokens the full forward picks when re-read whole.
    arguments = ("--prompt", "spikes flow", "--tokens", "24", "--temperature", "0")
    status, out, err = sample(capsys, str(ns_line), *arguments)
    assert status == 0, err
    checkpoint = ns_line / "checkpoints" / "u00000002"
    assert err.startswith(f"{checkpoint} (ns-tiny, ") and "; 24 tokens in " in err
    loaded = load_for_generation(checkpoint, torch.device("cpu"))
    tokens = loaded.prompt_ids("spikes flow")
    stream = TextStream(loaded.tokenizer)
    expected = "spikes flow"
    for _ in range(24):
        tokens.append(int(loaded.model.logits(torch.tensor([tokens]))[0, -1].argmax()))
        expected += stream.push(tokens[-1])
    assert out == expected + stream.flush() + "\n" and len(set(tokens)) > 3


def test_a_family_without_a_decoder_is_refused_in_one_line(
    line: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every family decodes now: a stand-in transformer class without its decoder meets the refusal
    # (the check is the class's, made before any weight is loaded).
    monkeypatch.setattr(TransformerLM, "decode", LanguageModel.decode)
    status, out, err = sample(capsys, str(line), "--tokens", "5")
    assert status == 2 and out == ""
    assert err == (f"nsconsole: {line / 'checkpoints' / 'u00000006'}: transformer-tiny has no stepwise decoder "
                   "yet (the transformer family's decode is still to come), so it cannot be sampled from\n")  # fmt: skip


def test_chat_carries_the_conversation_through_its_turns(
    line: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    turns = ["the model trains", "spikes flow through"]
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(turn + "\n" for turn in turns)))
    assert main(["chat", str(line), "--seed", "3", "--tokens", "12"]) == 0
    out = capsys.readouterr().out
    # The same two turns through one Conversation (one decoding state and one stream of draws,
    # whose carried state tests/engine/generation/test_chat.py checks against a single decode):
    # had the command started afresh at the second turn, its draws would differ.
    loaded = load_for_generation(line / "checkpoints" / "u00000006", torch.device("cpu"))
    conversation = Conversation(loaded, SamplingSettings(seed=3), reply_tokens=12)
    replies = ["".join(conversation.reply(turn)) for turn in turns]
    assert all(reply.strip() for reply in replies)
    assert out == "".join(reply if reply.endswith("\n") else reply + "\n" for reply in replies)


def test_help_of_sample_and_chat_does_not_import_torch(tmp_path: Path) -> None:
    environment = {**os.environ, "NSCONSOLE_HOST": str(tmp_path / "host.json"), "PYTHONPATH": os.pathsep.join(sys.path)}
    (tmp_path / "host.json").write_text("{}")
    for command in ("sample", "chat"):
        completed = subprocess.run([sys.executable, "-X", "importtime", "-m", "nsconsole", command, "--help"],
                                   env=environment, capture_output=True, text=True, timeout=120)  # fmt: skip
        assert completed.returncode == 0 and "CHECKPOINT|LINE" in completed.stdout
        imported = {entry.rsplit("|", 1)[-1].strip() for entry in completed.stderr.splitlines()}
        assert "torch" not in imported, command


def test_ema_before_the_average_started_is_refused_naming_the_command(
    line: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = line / "checkpoints" / "u00000000"  # the line's first checkpoint: no average yet
    status, _, err = sample(capsys, str(first), "--tokens", "5", "--ema", "--seed", "0")
    assert status == 2 and err.count("\n") == 1 and err.rstrip().endswith("sample without --ema")
    with pytest.raises(CheckpointError, match=r"; eval without --ema$"):
        load_for_generation(first, torch.device("cpu"), average=True, command="eval")
