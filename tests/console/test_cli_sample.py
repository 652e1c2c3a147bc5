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
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
from helpers.checkpoints import overflowing, rewritten_checkpoint
from helpers.lines import copy_data_line, data_template_fixture, make_line, one_torch_thread

from datalines.tokenizer import PlainTextTokenizer
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


# Found walking through "using a trained model" (tests below): each failed before its fix.


def test_a_tiny_temperature_takes_the_most_likely_token(line: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # --temperature 1e-310 divided the logits into inf and the draw failed in torch with a traceback.
    arguments = ("--prompt", "the model", "--tokens", "20", "--seed", "1")
    status, tiny, err = sample(capsys, str(line), *arguments, "--temperature", "1e-310")
    assert status == 0, err
    assert tiny == sample(capsys, str(line), *arguments, "--temperature", "0")[1]


def test_sample_stops_where_the_model_ends_the_document(line: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The separator was printed as `<|endoftext|>` and another document followed, unrelated to the prompt.
    loaded = load_for_generation(line / "checkpoints" / "u00000006", torch.device("cpu"))
    for seed in range(20):  # a seed whose draws end the document within 60 tokens
        session = loaded.session(SamplingSettings(seed=seed))
        session.feed(loaded.prompt_ids("the model"))
        drawn = list(session.generate(60, stop=loaded.separator))
        if drawn[-1] == loaded.separator:
            break
    else:
        pytest.fail("no seed of 20 ended the document")
    status, out, err = sample(capsys, str(line), "--prompt", "the model", "--tokens", "60", "--seed", str(seed))
    assert status == 0, err
    assert out == "the model" + loaded.tokenizer.decode(drawn[:-1]) + "\n"
    report = err.splitlines()[-1]
    assert report.split("; ")[1].startswith(f"{len(drawn) - 1} tokens in ")
    assert report.endswith("; the model ended the document (drew the document separator)")


def test_ctrl_c_ends_the_text_on_its_line_and_says_so(
    line: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Ctrl-C left the text without its line end (the shell's prompt followed it) and no report.
    from engine.generation import session

    draws = []

    def interrupted_at_the_fourth(*arguments: object) -> int:
        draws.append(1)
        if len(draws) == 4:
            raise KeyboardInterrupt
        return 5  # a token that is not the separator

    monkeypatch.setattr(session, "choose_token", interrupted_at_the_fourth)
    status, out, err = sample(capsys, str(line), "--prompt", "the model", "--tokens", "50", "--seed", "1")
    assert status == 130
    assert out.startswith("the model") and out.endswith("\n") and out.count("\n") == 1
    assert "; 3 tokens in " in err and err.endswith("; interrupted (Ctrl-C)\n") and "Traceback" not in err


def test_a_prompt_file_or_stdin_is_the_prompt(
    line: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # A prompt longer than a command line takes (`Argument list too long`) had no way in.
    text = "the model trains on tokens\u00e9 " * 300
    (tmp_path / "prompt.txt").write_text(text, encoding="utf-8")
    arguments = ("--tokens", "10", "--seed", "4")
    expected = sample(capsys, str(line), "--prompt", text, *arguments)[1]
    assert sample(capsys, str(line), "--prompt-file", str(tmp_path / "prompt.txt"), *arguments)[1] == expected
    monkeypatch.setattr(sys, "stdin", io.StringIO(text))
    assert sample(capsys, str(line), "--prompt-file", "-", *arguments)[1] == expected


def test_a_prompt_file_that_cannot_be_read_is_refused_before_the_checkpoint_loads(
    line: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (tmp_path / "binary").write_bytes(b"\xff\xfe\x00")
    refusals = {
        tmp_path / "gone.txt": "--prompt-file cannot be read (No such file or directory)",
        tmp_path: "--prompt-file cannot be read (Is a directory)",
        tmp_path / "binary": "--prompt-file is not UTF-8 text (invalid start byte at byte 0)",
    }
    for path, refusal in refusals.items():
        status, out, err = sample(capsys, str(line), "--prompt-file", str(path))
        assert (status, out, err) == (2, "", f"nsconsole: {path}: {refusal}\n")


@pytest.mark.parametrize("errors", ["surrogateescape", "strict"])  # stdin in a C locale, in a UTF-8 one
def test_a_prompt_with_bytes_that_are_not_utf8_is_refused_in_one_line(
    line: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, errors: str
) -> None:
    # Found in a README walk: the tokenizer met them with a traceback (`TextEncodeInput must be ...`).
    assert sample(capsys, str(line), "--prompt", "ab\udcff") == (
        2, "", "nsconsole: --prompt is not UTF-8 text (byte 0xff at character 2)\n")  # fmt: skip
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"\xff\xfe a\n"), "utf-8", errors))
    status, out, err = sample(capsys, str(line), "--prompt-file", "-")
    problem = "byte 0xff at character 0" if errors == "surrogateescape" else "invalid start byte"
    assert (status, out, err) == (2, "", f"nsconsole: stdin (--prompt-file -) is not UTF-8 text ({problem})\n")


def test_a_chat_turn_with_bytes_that_are_not_utf8_is_refused_in_one_line(
    line: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Found in a README walk: a traceback (exit status 1) after the turns before it were answered.
    stdin = io.TextIOWrapper(io.BytesIO(b"the model\n\xff bad\n"), "utf-8", "surrogateescape")
    monkeypatch.setattr(sys, "stdin", stdin)
    assert main(["chat", str(line), "--seed", "3", "--tokens", "5"]) == 2
    captured = capsys.readouterr()
    assert captured.out.count("\n") == 1  # the first turn's reply
    assert captured.err.splitlines()[1:] == ["nsconsole: stdin: a turn is not UTF-8 text (byte 0xff at character 0)"]


def test_a_copied_checkpoint_without_its_meta_json_is_called_incomplete(
    line: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # Found in a README walk: a checkpoint's files under another name (a copy, a `.partial` one)
    # without meta.json were "no checkpoint yet", with `nsconsole run` on the checkpoint suggested.
    copy = tmp_path / "best"
    shutil.copytree(line / "checkpoints" / "u00000006", copy)
    (copy / "meta.json").unlink()
    status, out, err = sample(capsys, str(copy), "--tokens", "5")
    assert (status, out, err) == (2, "", f"nsconsole: {copy / 'meta.json'}: missing (an incomplete checkpoint)\n")


@pytest.mark.parametrize(
    ("option", "value", "problem"),
    [("--tokens", "abc", "not a whole number: 'abc'"), ("--tokens", "1e3", "not a whole number: '1e3'"),
     ("--temperature", "warm", "not a number: 'warm'"), ("--top-p", "x", "not a number: 'x'")],
)  # fmt: skip
def test_an_option_that_is_not_a_number_is_named_plainly(
    line: Path, capsys: pytest.CaptureFixture[str], option: str, value: str, problem: str
) -> None:
    # argparse named the parsing function: `invalid _positive_int value`, `invalid parse value`.
    with pytest.raises(SystemExit) as ended:
        main(["sample", str(line), option, value])
    assert ended.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"nsconsole sample: error: argument {option}: {problem}"


def test_a_line_whose_trainer_replaces_the_checkpoint_being_read_samples_its_new_latest(
    line: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Sampling a running line: its retention removed the checkpoint `latest` had named while it was
    # read, and the command ended in a FileNotFoundError traceback. Here the trainer's step is made
    # at the first read: a newer checkpoint, `latest` moved, the old one removed.
    from engine.checkpoints.format import write_latest
    from engine.generation import loading

    copy = tmp_path / "line"
    shutil.copytree(line / "checkpoints", copy / "checkpoints")
    checkpoints = copy / "checkpoints"
    original = loading.load_checkpoint
    reads: list[Path] = []

    def trainer_moves_on(directory: Path, optimizer_keys: tuple[str, ...]):  # noqa: ANN202 - load_checkpoint's
        reads.append(directory)
        assert optimizer_keys == ()  # sampling reads no AdamW moments
        if len(reads) == 1:
            shutil.copytree(checkpoints / "u00000006", checkpoints / "u00000007")
            write_latest(checkpoints, "u00000007")
            shutil.rmtree(checkpoints / "u00000006")
        return original(directory, optimizer_keys)

    monkeypatch.setattr(loading, "load_checkpoint", trainer_moves_on)
    status, out, err = sample(capsys, str(copy), "--tokens", "5", "--seed", "1")
    assert status == 0, err
    assert reads == [checkpoints / "u00000006", checkpoints / "u00000007"]
    assert err.startswith(f"{checkpoints / 'u00000007'} (transformer-tiny, ")

    # A checkpoint named by its directory is not swapped for another: one line says what happened.
    shutil.move(checkpoints / "u00000007", checkpoints / "u00000006")
    write_latest(checkpoints, "u00000006")
    reads.clear()
    status, out, err = sample(capsys, str(checkpoints / "u00000006"), "--tokens", "5")
    assert (status, out, reads) == (2, "", [checkpoints / "u00000006"])
    assert err == (f"nsconsole: {checkpoints / 'u00000006'}: removed while it was read (its line's trainer keeps "
                   "only some checkpoints: name the line for its latest, or a checkpoint it keeps)\n")  # fmt: skip


@pytest.mark.parametrize(
    ("damage", "refusal"),
    [
        ("latest u00000099", "{c}/latest: names u00000099, which is not there (the line has u00000000, u00000006)"),
        ("latest ", "{c}/latest: empty, so it names no checkpoint; name one of the line's checkpoints instead "
                    "(u00000000, u00000006)"),
        ("no latest", "{c}/latest: missing; name one of the line's checkpoints instead (u00000000, u00000006)"),
        ("no checkpoint", "{l}: no checkpoint yet (a line writes its first when it starts training: nsconsole run {l})"),
        ("the checkpoints directory", "{c}: a line's checkpoints directory; name the line ({l}) or one of its "
                                      "checkpoints ({c}/uNNNNNNNN)"),
        # A fresh line's, empty: it was "neither a checkpoint (no meta.json) nor a training line".
        ("the empty checkpoints directory", "{c}: a line's checkpoints directory; name the line ({l}) or one of "
                                            "its checkpoints ({c}/uNNNNNNNN)"),
    ],
)  # fmt: skip
def test_a_line_without_a_latest_checkpoint_says_why_and_what_it_has(
    line: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path, damage: str, refusal: str
) -> None:
    # `latest` naming a checkpoint retention removed read "u00000099/meta.json: missing (an incomplete
    # checkpoint)"; a fresh line, an empty or missing `latest` were all "missing or unreadable".
    copy = tmp_path / "line"
    checkpoints = copy / "checkpoints"
    shutil.copytree(line / "checkpoints", checkpoints, ignore=shutil.ignore_patterns("u00000005"))
    shutil.copy(line / "run.json", copy / "run.json")
    source = copy
    if damage.startswith("latest "):
        (checkpoints / "latest").write_text(damage.removeprefix("latest ") + "\n")
    elif damage == "no latest":
        (checkpoints / "latest").unlink()
    elif damage == "no checkpoint":
        shutil.rmtree(checkpoints)
    else:
        if damage == "the empty checkpoints directory":
            shutil.rmtree(checkpoints)
            checkpoints.mkdir()
        source = checkpoints
    status, out, err = sample(capsys, str(source), "--tokens", "5")
    assert (status, out) == (2, "")
    assert err == "nsconsole: " + refusal.format(c=checkpoints, l=copy) + "\n"


def controlling_terminal() -> None:
    """In the child, a session leader: its stdin's terminal becomes its controlling one, so that
    Ctrl-C typed there is a SIGINT to it, as in a shell."""
    import fcntl
    import termios

    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def chat_in_a_terminal(line: Path, keys: list[bytes]) -> tuple[int, str]:
    """`nsconsole chat LINE` on a pseudo-terminal, as a user runs it: each of `keys` typed once the
    "> " prompt shows; its exit status and everything it wrote to the terminal."""
    import pty

    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    main_fd, terminal = pty.openpty()
    chat = subprocess.Popen([sys.executable, "-m", "nsconsole", "chat", str(line), "--seed", "1", "--tokens", "8",
                             "--device", "cpu"], stdin=terminal, stdout=terminal, stderr=terminal, env=environment,
                            start_new_session=True, preexec_fn=controlling_terminal)  # fmt: skip
    os.close(terminal)
    screen = b""
    try:
        for key in keys:
            while not screen.endswith(b"> "):
                screen += os.read(main_fd, 4096)
            os.write(main_fd, key)
            screen += os.read(main_fd, 4096)
        status = chat.wait(timeout=180)  # a hang's bound: under CI's load 60 s was once too short
        while True:
            try:
                piece = os.read(main_fd, 4096)
            except OSError:  # the terminal's other side closed with the command
                break
            if not piece:
                break
            screen += piece
    finally:
        chat.kill()
        os.close(main_fd)
    return status, screen.decode("utf-8", "replace")


def test_chat_in_a_terminal_ends_its_line_at_ctrl_d_and_ctrl_c(line: Path) -> None:
    # Ctrl-D and Ctrl-C at the "> " prompt left the shell's prompt on the chat's last line.
    status, screen = chat_in_a_terminal(line, [b"the model trains\n", b"\x04"])
    assert status == 0 and screen.endswith("> \r\n") and "Traceback" not in screen
    status, screen = chat_in_a_terminal(line, [b"\x03"])
    assert status == 130 and screen.endswith("> ^C\r\n") and "Traceback" not in screen


def test_a_checkpoint_whose_weights_are_not_finite_is_refused_naming_the_tensor(
    line: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # A NaN weight ended in torch's `invalid multinomial distribution` traceback at the first draw.
    def one_nan(weights: dict[str, torch.Tensor]) -> None:
        weights[sorted(weights)[0]].view(-1)[0] = float("nan")

    checkpoint = rewritten_checkpoint(line / "checkpoints" / "u00000006", tmp_path, one_nan)
    name = sorted(load_checkpoint(line / "checkpoints" / "u00000006").weights)[0]
    status, out, err = sample(capsys, str(checkpoint), "--tokens", "5")
    assert (status, out) == (2, "")
    assert err == f"nsconsole: {checkpoint / 'model.safetensors'}: {name} holds non-finite values (NaN or inf)\n"


def test_logits_that_overflow_from_finite_weights_end_in_one_line(
    line: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # Finite weights whose logits overflow (a diverged model) passed the load's check and ended in
    # torch's `invalid multinomial distribution` traceback at the first draw.
    checkpoint = rewritten_checkpoint(line / "checkpoints" / "u00000006", tmp_path, overflowing)
    status, out, err = sample(capsys, str(checkpoint), "--prompt", "the model", "--tokens", "5")
    assert (status, out) == (2, "the model\n")
    _described, refusal = err.splitlines()  # what was loaded, then the one line of the refusal
    assert refusal.startswith(f"nsconsole: {checkpoint}: the model's next-token logits hold ")
    assert refusal.endswith(" after 0 generated tokens (the weights are finite, so the activations overflow): "
                            "this checkpoint cannot generate; an earlier one may")  # fmt: skip


def test_ctrl_c_during_a_reply_ends_that_reply_and_the_conversation_goes_on(
    line: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Ctrl-C during a reply ended the whole chat; a user stopping a rambling reply lost the conversation.
    from engine.generation import chat as conversations
    from engine.generation import session
    from nsconsole.commands import chat

    drawn: list[int] = []
    real_choose_token = session.choose_token

    def interrupted_at_the_third(*arguments: object) -> int:
        if len(drawn) == 2:
            drawn.append(-1)
            raise KeyboardInterrupt
        drawn.append(real_choose_token(*arguments))
        return drawn[-1]

    held: list[Conversation] = []

    class HeldConversation(Conversation):
        def __init__(self, *arguments: object) -> None:
            super().__init__(*arguments)
            held.append(self)

    monkeypatch.setattr(session, "choose_token", interrupted_at_the_third)
    monkeypatch.setattr(conversations, "Conversation", HeldConversation)
    monkeypatch.setattr(sys, "stdin", io.StringIO("the model trains\nand then\n\n"))
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    loaded = load_for_generation(line / "checkpoints" / read_latest(line / "checkpoints"), torch.device("cpu"))
    chat.converse(loaded, SamplingSettings(temperature=1.0, seed=1), 8, interactive=False)
    first, second = out.getvalue().splitlines()
    assert first.endswith(chat.INTERRUPTED_REPLY) and second and len(drawn) > 3

    # What the interrupted reply drew stays said; the next turn is fed after it, on a line of its own.
    [conversation] = held
    turn = loaded.tokenizer.encode_documents(["\nand then\n"])[0].tolist()
    assert conversation.session.tokens[: -(len(drawn) - 3)] == loaded.prompt_ids("the model trains\n") + drawn[:2] + turn


# Found walking sample, chat and eval on trained lines, as a user does: each failed before its fix.


def scripted_draws(monkeypatch: pytest.MonkeyPatch, tokens: list[int], on_draw: Callable[[], None] = lambda: None) -> None:
    """The session draws `tokens` in order (none is the separator); `on_draw` runs before each."""
    from engine.generation import session

    draws = iter(tokens)

    def next_draw(*arguments: object) -> int:
        on_draw()
        return next(draws)

    monkeypatch.setattr(session, "choose_token", next_draw)


def test_a_long_sample_decodes_a_few_tokens_a_token_not_the_whole_text(
    line: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # `sample --tokens 100000` slowed down as it went (1,700 tokens/s at first, 150 at 60,000
    # tokens): every token decoded the whole text so far to find its new characters.
    tokenizer = load_for_generation(line / "checkpoints" / "u00000006", torch.device("cpu")).tokenizer
    cycle = tokenizer.encode_documents(["the model trains \u00e9\u2713 "])[0].tolist()  # multi-byte characters too
    count = 3000
    drawn = (cycle * (count // len(cycle) + 1))[:count]
    scripted_draws(monkeypatch, drawn)
    decoded: list[int] = []
    real_decode = PlainTextTokenizer.decode

    def counted(self: PlainTextTokenizer, ids: Sequence[int]) -> str:
        decoded.append(len(ids))
        return real_decode(self, ids)

    monkeypatch.setattr(PlainTextTokenizer, "decode", counted)
    status, out, err = sample(capsys, str(line), "--prompt", "x", "--tokens", str(count))
    assert status == 0, err
    assert out == "x" + real_decode(tokenizer, drawn) + "\n"
    assert sum(decoded) <= 20 * count  # the whole text each time: about count**2 / 2


def test_bytes_that_make_no_character_show_as_they_come(
    line: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # An ns-tiny line's chat answered a turn with a run of one byte that starts a 4-byte character
    # but is never followed by the rest: the stream held every one back as an incomplete character,
    # so the reply showed nothing at all (and `sample` nothing until its last token).
    tokenizer = load_for_generation(line / "checkpoints" / "u00000006", torch.device("cpu")).tokenizer
    lead_byte = tokenizer.full.token_to_id("\u00f3")  # the byte-level alphabet's 0xf3
    written = io.StringIO()
    monkeypatch.setattr(sys, "stdout", written)
    shown: list[str] = []
    scripted_draws(monkeypatch, tokenizer.encode_documents(["x"])[0].tolist() + [lead_byte] * 5,
                   lambda: shown.append(written.getvalue()))  # fmt: skip
    status, _, err = sample(capsys, str(line), "--prompt", "p", "--tokens", "6")
    assert status == 0, err
    # Before each draw: the text so far, less only the last byte (it may yet start a character).
    assert shown == ["p", "px", "px", "px\ufffd", "px\ufffd\ufffd", "px\ufffd\ufffd\ufffd"]
    assert written.getvalue() == "px" + "\ufffd" * 5 + "\n"


@pytest.mark.parametrize(
    ("model", "problem"),
    [({"preset": "ns-99b", "overrides": {}}, "model.preset: unknown preset 'ns-99b' (known: "),
     ({"preset": "transformer-tiny", "overrides": {"experts": 8}},
      "model.overrides: unknown key 'experts' for preset 'transformer-tiny' (known: ")],
)  # fmt: skip
def test_a_checkpoint_of_a_model_this_version_cannot_build_is_refused_naming_its_run_json(
    line: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path, model: dict, problem: str
) -> None:
    # A checkpoint whose run.json names a preset or an override this nsconsole does not know (one a
    # newer version wrote) was refused as `model.preset: unknown preset ...`, naming no file: the
    # user's own run.json, which names another preset, looked to be the one at fault.
    import json

    from engine.checkpoints.format import blake2b_of

    checkpoint = tmp_path / "u00000006"
    shutil.copytree(line / "checkpoints" / "u00000006", checkpoint)
    run_json = checkpoint / "run.json"
    document = json.loads(run_json.read_text())
    document["model"] = model
    run_json.write_text(json.dumps(document))
    meta = json.loads((checkpoint / "meta.json").read_text())
    meta["files"]["run.json"] = {"blake2b": blake2b_of(run_json), "bytes": run_json.stat().st_size}
    (checkpoint / "meta.json").write_text(json.dumps(meta))
    status, out, err = sample(capsys, str(checkpoint), "--tokens", "5")
    assert (status, out) == (2, "")
    assert err.startswith(f"nsconsole: {run_json}: {problem}") and err.count("\n") == 1


@torch.no_grad()
def test_a_prompt_longer_than_the_models_rows_is_fed_in_pieces(
    ns_line: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # A prompt of 15,409 tokens (`--prompt-file`) to an ns-tiny line (rows of 512) took 9 GB and
    # 19 s before its first token: fed whole, the pool read is a (tokens x tokens) matrix per head,
    # and a prompt of twice that length did not fit this machine. In pieces: 1 GB and 5 s.
    from engine.generation.session import PREFILL_TOKENS
    from engine.models.ns.model import NSLM

    pieces: list[int] = []
    real_decode = NSLM.decode

    def recorded(self: NSLM, tokens: torch.Tensor, state: object) -> tuple[torch.Tensor, object]:
        pieces.append(tokens.shape[1])
        return real_decode(self, tokens, state)

    monkeypatch.setattr(NSLM, "decode", recorded)
    # Two whole pieces and a part one (about 2,700 tokens): the reference below runs the full
    # forward over the prompt three times, at a cost that grows with the square of its length.
    text = "spikes flow through layers of state and memory " * 100
    (tmp_path / "prompt.txt").write_text(text)
    status, out, err = sample(capsys, str(ns_line), "--prompt-file", str(tmp_path / "prompt.txt"), "--tokens", "3",
                              "--temperature", "0")  # fmt: skip
    assert status == 0, err
    loaded = load_for_generation(ns_line / "checkpoints" / "u00000002", torch.device("cpu"))
    tokens = loaded.prompt_ids(text)
    assert len(tokens) > 2 * PREFILL_TOKENS
    whole, rest = divmod(len(tokens), PREFILL_TOKENS)
    assert pieces == [PREFILL_TOKENS] * whole + [rest] * (rest > 0) + [1, 1]  # then a token at a time
    # The same text as the full forward's choices over the whole prompt.
    for _ in range(3):
        tokens.append(int(loaded.model.logits(torch.tensor([tokens]))[0, -1].argmax()))
    assert out == text + loaded.tokenizer.decode(tokens[-3:]) + "\n"
