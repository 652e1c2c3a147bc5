"""Every target token of a cycle is trained once across a change of sequence length.

A two-stage line (a trunk at 64 tokens whose budget ends inside cycle 0, then a stage at 128)
trains while `Cycle.samples` is watched: each batch it hands out is read a second time with the
source's tokens replaced by their own offsets, so the test sees which token offsets each window
holds. Counting the targets (every window's tokens but its first) over cycle 0 says how many of
the cycle's targets were trained twice and how many never. The relay itself (datalines.relay) is
also held to it on a two-source cycle through three lengths, and a line stopped, resumed or killed
inside the relay ends as the uninterrupted one does.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import REPOSITORY
from helpers.data import make_chat_corpus, make_tokenizer, make_web_corpus, write_recipe
from helpers.lines import assert_same_state, copy_data_line, latest_checkpoint, make_data_line, make_line

from datalines import DataLineError, open_data_line
from datalines.creation import init_data_line
from datalines.cycle import Cycle
from datalines.preparer import prepare_cycle
from engine.checkpoints.format import checkpoint_name, stage_end_kept
from engine.checkpoints.tensors import load_checkpoint
from engine.training.position import Position
from engine.training.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread

TRUNK_LEN, LONG_LEN = 64, 128
TRUNK_TOKENS = 2560
"""The trunk stage's budget: 5 updates of 512 tokens, about half of cycle 0's 5,000 tokens."""
STAGE_END, CYCLE_END = 5, 10
"""Updates of the two-stage line: its trunk ends at update 5, its cycle 0 (re-laid at 128) at 10."""


@pytest.fixture(scope="module")
def data_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_data_line(tmp_path_factory.mktemp("template"), validation=(TRUNK_LEN, LONG_LEN))


def two_stage_line(root: Path, data_template: Path, **changes: Any) -> Path:
    plan = [
        {"name": "trunk", "seq_len": TRUNK_LEN, "tokens": TRUNK_TOKENS},
        {"name": "long", "seq_len": LONG_LEN, "tokens": None},
    ]
    lengths = [
        {"seq_len": TRUNK_LEN, "micro_batch_rows": 4, "recompute": "none", "shared": None},
        {"seq_len": LONG_LEN, "micro_batch_rows": 2, "recompute": "none", "shared": None},
    ]
    return make_line(
        root,
        copy_data_line(data_template, root),
        plan=plan,
        lengths=lengths,
        tokens_per_update=512,
        **{"validation.long_seq_len": LONG_LEN, "checkpoints.every_updates": 3, **changes},
    )


def offsets_of(cycle: Cycle, read: Any) -> np.ndarray:
    """What `read(cycle)` returns with every source's tokens replaced by their offsets in it."""
    offsets = {name: np.arange(cycle.manifest["sources"][name]["tokens"]) for name in cycle.source_names}
    cycle.tokens = offsets.__getitem__  # type: ignore[method-assign]
    try:
        return read(cycle)
    finally:
        del cycle.tokens


@pytest.fixture
def trained_offsets(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[int, np.ndarray]]]:
    """(cycle, offsets) of every batch the trainer reads: its windows' token offsets in the source."""
    batches: list[tuple[int, np.ndarray]] = []
    original = Cycle.samples

    def watched(self: Cycle, *args: Any, **kwargs: Any) -> np.ndarray:
        windows = original(self, *args, **kwargs)
        positions = offsets_of(self, lambda cycle: original(cycle, *args, **kwargs))
        (name,) = self.source_names  # the tests' data line has one source
        assert np.array_equal(np.asarray(self.tokens(name))[positions], windows)
        batches.append((self.index, positions))
        return windows

    monkeypatch.setattr(Cycle, "samples", watched)
    yield batches


def target_counts(batches: list[tuple[int, np.ndarray]], cycle: int, tokens: int) -> np.ndarray:
    """How often each token offset of the cycle's source was trained as a target."""
    counts = np.zeros(tokens, dtype=np.int64)
    for index, positions in batches:
        if index == cycle:
            np.add.at(counts, positions[:, 1:].ravel(), 1)
    return counts


def test_a_stage_change_inside_a_cycle_trains_every_target_once(
    tmp_path: Path, data_template: Path, trained_offsets: list[tuple[int, np.ndarray]]
) -> None:
    line = two_stage_line(tmp_path, data_template)
    tokens = open_data_line(data_template).cycle(0).manifest["sources"]["text"]["tokens"]
    assert Trainer(line, echo=None).run() == 0
    lengths = {positions.shape[1] - 1 for index, positions in trained_offsets if index == 0}
    assert lengths == {TRUNK_LEN, LONG_LEN}  # the stage changed inside cycle 0
    counts = target_counts(trained_offsets, 0, tokens)[1:]  # offset 0 is no window's target
    twice, never = int((counts > 1).sum()), np.flatnonzero(counts == 0) + 1
    assert twice == 0, f"{twice} of {len(counts)} targets trained twice"
    # What is left out is the relay's stream tail: fewer targets than a window, and run.log says so.
    assert len(never) < LONG_LEN
    log = (line / "run.log").read_text()
    assert f"stage trunk done at update {STAGE_END}" in log and f"cycle 0 done at update {CYCLE_END}" in log
    said = re.search(r"cycle 0: its untrained targets re-laid at seq_len 128, (\d+) windows; (\d+) targets left out", log)
    assert said is not None and int(said[2]) == len(never)
    assert int(said[1]) == sum(len(p) for i, p in trained_offsets if i == 0 and p.shape[1] == LONG_LEN + 1)


@pytest.fixture(scope="module")
def two_source_cycle(tmp_path_factory: pytest.TempPathFactory) -> Cycle:
    root = tmp_path_factory.mktemp("two_sources")
    web, chat = make_web_corpus(root / "web"), make_chat_corpus(root / "chat")
    tokenizer = make_tokenizer(root / "tokenizer.json", [web, chat])
    line = init_data_line(root / "line", write_recipe(root / "recipe.json", web, chat, tokenizer), 0, 5000, None)
    prepare_cycle(line, 0)
    return open_data_line(line.path).cycle(0)


def test_relays_read_each_target_of_every_source_once_through_three_lengths(two_source_cycle: Cycle) -> None:
    cycle, seed = two_source_cycle, 3
    tokens = {name: cycle.manifest["sources"][name]["tokens"] for name in cycle.source_names}
    counts = {name: np.zeros(count, dtype=np.int64) for name, count in tokens.items()}
    earlier: tuple[tuple[int, int], ...] = ()
    for seq_len, fraction in ((32, 0.4), (64, 0.5), (16, 1.0)):
        total = cycle.num_samples(seq_len, seed, earlier)
        read = int(total * fraction)
        windows = cycle.samples(seq_len, 0, read, seed, earlier)
        positions = offsets_of(cycle, lambda c: c.samples(seq_len, 0, read, seed, earlier))  # noqa: B023
        sources = cycle._order(seq_len, seed, earlier)[0][:read]
        for index, name in enumerate(cycle.source_names):
            mine = positions[sources == index]
            assert np.array_equal(np.asarray(cycle.tokens(name))[mine], windows[sources == index])
            assert np.array_equal(mine[:, 0], mine[:, 1] - 1)  # a row opens on its first target's predecessor
            np.add.at(counts[name], mine[:, 1:].ravel(), 1)
        # Exact resume anywhere in a relay; the same seed and reads give the same order.
        assert np.array_equal(cycle.samples(seq_len, 5, 3, seed, earlier), windows[5:8])
        if earlier:
            assert cycle.order_digest(seq_len, seed, earlier) != cycle.order_digest(seq_len, seed)
            assert cycle.order_digest(seq_len, seed, earlier) != cycle.order_digest(seq_len, seed + 1, earlier)
        earlier = (*earlier, (seq_len, read))
    last = earlier[:2]  # the third length read its whole relay
    sources = cycle._order(16, seed, last)[0]
    for index, (name, count) in enumerate(counts.items()):
        assert count.max() == 1 and count[0] == 0, name
        # Never trained: the stream's tail (less than a window) and the windows past the share the
        # interleave stops at (share rounding, as in any cycle), nothing else.
        runs = cycle._runs(seed, last)[index]
        surplus = runs.windows(16) - int((sources == index).sum())
        assert int((count[1:] == 0).sum()) == runs.total % 16 + 16 * surplus and 0 <= surplus <= 4, name
    assert sum(int((count[1:] == 0).sum()) for count in counts.values()) == cycle.unread_targets(16, seed, last)
    # A read that took its length's order to the end closed the cycle; a read past it is refused.
    whole = ((32, cycle.num_samples(32, seed)),)
    assert cycle.num_samples(64, seed, whole) == 0
    with pytest.raises(DataLineError, match=r"a read of \d+ samples of cycle 0 at seq_len 32"):
        cycle.num_samples(64, seed, ((32, whole[0][1] + 1),))


def test_a_checkpoint_without_earlier_reads_is_a_plain_position() -> None:
    """Checkpoints from before the relay hold no `earlier`: the stage's own order, as they meant."""
    old = Position(**{"update": 7, "tokens_trained": 3584, "stage": 1, "stage_tokens": 0, "cycle": 2, "sample": 9})
    assert old.reads() == () and not old.change_length(64, 64)

    class Starts:
        def cycle_start_tokens(self, index: int) -> int:
            return 5000 * index

    assert old.data_tokens(Starts(), 128) == 10_000 + 9 * 128
    assert old.change_length(128, 64) and old.reads() == ((128, 9),) and old.sample == 0
    old.sample = 3
    assert old.data_tokens(Starts(), 64) == 10_000 + 9 * 128 + 3 * 64


def test_stops_at_the_stage_end_and_inside_the_relay_resume_bit_identically(
    tmp_path: Path, data_template: Path
) -> None:
    reference = two_stage_line(tmp_path / "reference", data_template)
    assert Trainer(reference, stop_at=CYCLE_END + 2, echo=None).run() == 0
    line = two_stage_line(tmp_path / "stopped", data_template)
    for stop_at in (STAGE_END, STAGE_END + 2, CYCLE_END + 2):
        assert Trainer(line, stop_at=stop_at, echo=None).run() == 0
        position = latest_checkpoint(line).state["position"]
        if stop_at < CYCLE_END:  # a checkpoint in cycle 0 after the trunk: the relay's position
            assert position["earlier"] == [[TRUNK_LEN, TRUNK_TOKENS // TRUNK_LEN]], position
            assert position["sample"] == (stop_at - STAGE_END) * 512 // LONG_LEN
    assert_same_state(line, reference)


@pytest.mark.slow
def test_sigkill_inside_the_relay_then_resume_is_bit_identical(tmp_path: Path, data_template: Path) -> None:
    changes = {"checkpoints.every_updates": 1}
    reference = two_stage_line(tmp_path / "reference", data_template, **changes)
    assert Trainer(reference, echo=None).run() == 0
    # A rolling checkpoint due at the stage's last update leaves the stage end's kept one as it is.
    assert load_checkpoint(reference / "checkpoints" / checkpoint_name(STAGE_END)).state["kept"] == stage_end_kept("trunk")
    line = two_stage_line(tmp_path / "killed", data_template, **changes)
    environment = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(REPOSITORY))
    command = [sys.executable, "-m", "nsconsole", "run", str(line), "--no-supervisor"]
    process = subprocess.Popen(command, cwd=REPOSITORY, env=environment, stderr=subprocess.PIPE)
    rows = line / "rows.jsonl"
    while (rows.read_bytes().count(b"\n") if rows.exists() else 0) < STAGE_END + 1 and process.poll() is None:
        time.sleep(0.002)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL, process.stderr.read().decode()
    killed_at = latest_checkpoint(line).state["position"]
    assert killed_at["cycle"] == 0 and killed_at["earlier"], killed_at  # the resume starts inside the relay
    final = subprocess.run(command, cwd=REPOSITORY, env=environment, capture_output=True, timeout=300)
    assert final.returncode == 0, final.stderr.decode()
    assert_same_state(line, reference)
