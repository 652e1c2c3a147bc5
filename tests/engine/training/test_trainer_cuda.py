"""On the GPU: the CUDA-graph engine gives the eager engine's update, skips a non-finite one, and a
line trains, stops and resumes in graph mode. Skipped where there is no CUDA (run on the H200)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest
import torch
from helpers.lines import copy_data_line, make_data_line, make_line

from engine.checkpoints.format import read_latest
from engine.checkpoints.tensors import load_checkpoint
from engine.gpu.sharing import GpuWatch
from engine.training.arena import Arena
from engine.training.optim import AdamWSettings, FlatAdamW
from engine.training.step import EagerEngine, GraphEngine
from engine.training.trainer import Trainer

# Other pytest workers on the same GPU are not other jobs: these lines train as if alone.
ALONE = partial(GpuWatch.for_line, enabled=False)

pytestmark = pytest.mark.cuda

SEQ_LEN = 64
SETTINGS = AdamWSettings(0.9, 0.95, 1e-8, 1.0)


class PoisonableLoss:
    """A forward hook multiplying the loss by a device scalar (1, or NaN to poison an update)."""

    def __init__(self, device: torch.device):
        self.factor = torch.ones((), device=device)

    def __call__(self, _module, _inputs, output):
        return output[0] * self.factor, output[1]


def build(preset: str, device: torch.device) -> tuple[torch.nn.Module, FlatAdamW, PoisonableLoss]:
    from engine.models.build import build_model

    torch.manual_seed(0)
    model = build_model(preset, {}).to(device)
    poison = PoisonableLoss(device)
    model.register_forward_hook(poison)
    return model, FlatAdamW(model, SETTINGS, device), poison


def windows(rows: int, seed: int, vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (rows, SEQ_LEN + 1), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def arena() -> Iterator[Arena]:
    # Half of what is free when the module starts (earlier tests in the process may hold some):
    # the other half stays for what the tests make outside the arena.
    torch.cuda.empty_cache()
    free, _total = torch.cuda.mem_get_info()
    held = Arena(torch.device("cuda"), slack_bytes=4 << 30, reserve_bytes=free // 2)
    yield held
    held.close()  # the tests after these (tune, say) read the GPU's free memory


# ns-tiny failed here once and once ran past 150 s (its compiled scan and flex attention inside a
# capture; not diagnosed yet): the timeout makes a hang a failure rather than a stalled run.
@pytest.mark.timeout(240)
@pytest.mark.parametrize("preset", ["transformer-tiny", "ns-tiny"])
def test_graph_engine_gives_the_eager_update(preset: str, arena: Arena) -> None:
    device = torch.device("cuda")
    eager_model, eager_optimizer, _ = build(preset, device)
    graph_model, graph_optimizer, _ = build(preset, device)
    eager = EagerEngine(eager_model, eager_optimizer, micro_batch_rows=4)
    graph = GraphEngine(graph_model, graph_optimizer, 4, SEQ_LEN, arena)
    # 8 rows: two micro-batches; 6 rows: a padded last micro-batch; a new rate: no recapture.
    for seed, rows, lr in ((1, 8, 1e-3), (2, 6, 1e-3), (3, 8, 3e-4)):
        batch = windows(rows, seed)
        expected = eager.run_update(batch, lr, 0.1)
        got = graph.run_update(batch, lr, 0.1)
        assert got.target_tokens == expected.target_tokens == rows * SEQ_LEN
        assert got.loss == pytest.approx(expected.loss, rel=1e-4)
        assert got.stats.grad_norm == pytest.approx(expected.stats.grad_norm, rel=1e-3)
    torch.testing.assert_close(graph_optimizer.params, eager_optimizer.params, rtol=1e-3, atol=1e-5)
    torch.testing.assert_close(graph_optimizer.exp_avg_sq, eager_optimizer.exp_avg_sq, rtol=1e-2, atol=1e-9)
    assert graph_optimizer.step.item() == eager_optimizer.step.item() == 3
    graph.close()


def test_graph_engine_skips_a_nonfinite_update(arena: Arena) -> None:
    device = torch.device("cuda")
    model, optimizer, poison = build("transformer-tiny", device)
    graph = GraphEngine(model, optimizer, 4, SEQ_LEN, arena)
    graph.run_update(windows(8, 1), 1e-3, 0.1)
    before = [t.clone() for t in (optimizer.params, optimizer.exp_avg, optimizer.exp_avg_sq, optimizer.step)]
    poison.factor.fill_(float("nan"))
    result = graph.run_update(windows(8, 2), 1e-3, 0.1)
    assert not result.stats.finite and optimizer.nonfinite_in_a_row == 1
    for old, new in zip(before, (optimizer.params, optimizer.exp_avg, optimizer.exp_avg_sq, optimizer.step)):
        assert torch.equal(old, new)
    poison.factor.fill_(1.0)
    assert graph.run_update(windows(8, 3), 1e-3, 0.1).stats.finite
    assert optimizer.step.item() == 2
    graph.close()


def test_graph_engine_clips_a_huge_finite_gradient(arena: Arena) -> None:
    """The loss times 1e22: a gradient norm near 3e20, whose square (and its elements' squares) fp32
    cannot hold; the float64 norm is finite, the captured update clips instead of skipping, and the
    int64 step counts it."""
    device = torch.device("cuda")
    model, optimizer, poison = build("transformer-tiny", device)
    graph = GraphEngine(model, optimizer, 4, SEQ_LEN, arena)
    graph.run_update(windows(8, 1), 1e-3, 0.1)
    before = optimizer.params.clone()
    poison.factor.fill_(1e22)
    result = graph.run_update(windows(8, 2), 1e-3, 0.1)
    assert result.stats.finite and result.stats.grad_norm > 1e20 and optimizer.nonfinite_in_a_row == 0
    assert optimizer.step.dtype == torch.int64 and optimizer.step.item() == 2
    assert not torch.equal(optimizer.params, before)
    for state in (optimizer.params, optimizer.exp_avg, optimizer.exp_avg_sq):
        assert torch.isfinite(state).all()
    graph.close()


def test_arena_serves_allocations_from_its_block(arena: Arena) -> None:
    assert arena.held_bytes > 1 << 30
    reserved = torch.cuda.memory_reserved()
    # On the arena's stream: the caching allocator reuses a segment only for the stream it was made on.
    with torch.cuda.stream(arena.stream), arena.allocating():
        block = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    assert torch.cuda.memory_reserved() == reserved  # carved from the arena, no new cudaMalloc
    del block


def test_an_arena_holds_more_for_as_long_as_asked(arena: Arena) -> None:
    # Sharing: what the others free past their reserve is held again, and given back before a
    # capture. The hold must survive empty_cache (the trainer calls it at every arena switch).
    gib = 1 << 30
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    assert arena.hold(2 * gib)
    torch.cuda.empty_cache()
    assert free_before - torch.cuda.mem_get_info()[0] >= 2 * gib - (64 << 20)
    assert arena.extra_held_bytes == 2 * gib
    with torch.cuda.stream(arena.stream), arena.allocating():
        block = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")  # the arena's pool still serves
    del block
    assert arena.release_held() >= 2 * gib - (64 << 20)
    assert arena.extra_held_bytes == 0 and arena.release_held() == 0
    assert not arena.hold(torch.cuda.mem_get_info()[1] * 2)  # more than the card: nothing held
    assert arena.extra_held_bytes == 0


def test_a_line_trains_and_resumes_in_graph_mode(tmp_path: Path) -> None:
    template = make_data_line(tmp_path / "template")
    changes = {"device": "cuda", "lengths": [{"seq_len": 32, "micro_batch_rows": 2}]}
    reference = make_line(tmp_path / "reference", copy_data_line(template, tmp_path / "reference"), **changes)
    assert Trainer(reference, stop_at=10, echo=None, gpu_watch=ALONE).run() == 0
    line = make_line(tmp_path / "resumed", copy_data_line(template, tmp_path / "resumed"), **changes)
    assert Trainer(line, stop_at=5, echo=None, gpu_watch=ALONE).run() == 0
    assert Trainer(line, stop_at=10, echo=None, gpu_watch=ALONE).run() == 0
    mine = load_checkpoint(line / "checkpoints" / read_latest(line / "checkpoints"))
    theirs = load_checkpoint(reference / "checkpoints" / read_latest(reference / "checkpoints"))
    assert mine.update == theirs.update == 10
    for key, tensor in theirs.weights.items():
        torch.testing.assert_close(mine.weights[key], tensor, rtol=1e-4, atol=1e-6, msg=key)


def line_record(line: Path) -> tuple[list[tuple[float, float]], dict[str, torch.Tensor]]:
    """A line's (loss, grad_norm) of every update and its newest checkpoint's tensors."""
    rows = [json.loads(text) for text in (line / "rows.jsonl").read_text().splitlines()]
    latest = load_checkpoint(line / "checkpoints" / read_latest(line / "checkpoints"))
    tensors = {f"{part}/{key}": tensor for part in ("weights", "optimizer", "extra")
               for key, tensor in getattr(latest, part).items()}  # fmt: skip
    return [(row["loss"], row["grad_norm"]) for row in rows if "loss" in row], tensors


@pytest.mark.timeout(480)
def test_an_ns_line_resumed_on_the_gpu_is_bit_for_bit_the_uninterrupted_one(tmp_path: Path) -> None:
    """Issue 22's goal: NS gradients are bitwise repeatable on CUDA (the pool read's bias gradient
    is summed in a fixed order, not with atomics), so a GPU line stopped and resumed ends in the
    uninterrupted line's state, bit for bit, as a CPU line does."""
    template = make_data_line(tmp_path / "template")
    changes = {"device": "cuda", "model.preset": "ns-tiny", "validation.long_seq_len": 2 * 32,
               "lengths": [{"seq_len": 32, "micro_batch_rows": 2}]}  # fmt: skip
    reference = make_line(tmp_path / "reference", copy_data_line(template, tmp_path / "reference"), **changes)
    assert Trainer(reference, stop_at=10, echo=None, gpu_watch=ALONE).run() == 0
    line = make_line(tmp_path / "resumed", copy_data_line(template, tmp_path / "resumed"), **changes)
    assert Trainer(line, stop_at=5, echo=None, gpu_watch=ALONE).run() == 0
    assert Trainer(line, stop_at=10, echo=None, gpu_watch=ALONE).run() == 0
    (mine_rows, mine), (their_rows, theirs) = line_record(line), line_record(reference)
    assert len(their_rows) == 10 and mine_rows == their_rows
    assert sorted(mine) == sorted(theirs)
    differing = [key for key, tensor in theirs.items() if not torch.equal(mine[key], tensor)]
    assert not differing, f"not bit for bit after a GPU resume: {differing[:8]}"
