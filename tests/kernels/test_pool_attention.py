"""Causal attention with a per-key bias (the NS pool read's flash kernel): the reference against a
loop, the Triton kernels against the reference (output, lse and every gradient; ragged rows, odd
head widths, strided views, other tiles), bitwise repeatability, and on CUDA the real shape and a
whole NS model's gradients."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from engine.models.ns.model import NSLM
from engine.models.ns.pool_read import per_key_bias, pool_read_explicit, pool_read_kernel
from engine.models.ns.presets import PRESETS
from kernels import pool_attention as pool_attention_module
from kernels._dispatch import poison
from kernels.pool_attention import Blocks, pool_attention, pool_attention_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAMES = ("out", "lse", "q", "k", "v", "bias")


@pytest.fixture(autouse=True)
def _poisoned_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(poison, "enabled", True)


def _inputs(batch, heads, length, head_dim, dtype=torch.float64, bias_scale=3.0, seed=0, device=DEVICE):
    """q, k, v, a per-key bias shaped like the NS one (log tags below 0 plus a rate times clocks
    relative to the row's last) and the outer gradients of the output and the lse."""
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    q, k, v = (normal(batch, heads, length, head_dim) for _ in range(3))
    log_tag = torch.nn.functional.logsigmoid(bias_scale * normal(batch, heads, length))
    clock = (torch.rand(batch, heads, length, generator=generator, dtype=torch.float64) * 2).cumsum(-1)
    bias = log_tag + 0.05 * bias_scale * (clock - clock[..., -1:])
    grad_out, grad_lse = normal(batch, heads, length, head_dim), normal(batch, heads, length)
    return [t.to(device, dtype) for t in (q, k, v, bias, grad_out, grad_lse)]


def _run(attention, q, k, v, bias, grad_out, grad_lse, **kwargs) -> list[torch.Tensor]:
    """out, lse and the gradients of q, k, v, bias of sum(out * grad_out) + sum(lse * grad_lse)."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, bias)]
    out, lse = attention(*leaves, **kwargs)
    ((out * grad_out.to(out.dtype)).sum() + (lse * grad_lse.to(lse.dtype)).sum()).backward()
    return [out.detach(), lse.detach()] + [leaf.grad for leaf in leaves]


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def test_reference_equals_a_loop():
    q, k, v, bias, _, _ = _inputs(2, 2, 9, 3, device="cpu")
    out, lse = pool_attention_reference(q, k, v, bias)
    for b in range(2):
        for h in range(2):
            for t in range(9):
                scores = q[b, h, t] @ k[b, h, : t + 1].T / math.sqrt(3) + bias[b, h, : t + 1]
                torch.testing.assert_close(lse[b, h, t], torch.logsumexp(scores, 0), rtol=1e-12, atol=1e-12)
                want = torch.softmax(scores, 0) @ v[b, h, : t + 1]
                torch.testing.assert_close(out[b, h, t], want, rtol=1e-12, atol=1e-12)


def test_reference_gradcheck():
    q, k, v, bias, _, _ = (t.requires_grad_() for t in _inputs(1, 2, 6, 2, device="cpu"))
    assert torch.autograd.gradcheck(lambda *a: pool_attention_reference(*a), (q, k, v, bias))


# Tiles the tests run the kernels with: the table's own for the element size, the H200's for bf16
# at d 128 (four query blocks a key block, two key blocks a query block), and small tiles that
# walk many blocks.
TILES = {
    "table": None,
    "h200_bf16": pool_attention_module._blocks(128, 2),
    "small": Blocks((32, 16, 4, 1), (16, 64, 4, 1), (64, 16, 4, 1)),
}


def _use_tiles(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    if TILES[name] is not None:
        monkeypatch.setattr(pool_attention_module, "_blocks", lambda *_: TILES[name])


@pytest.mark.parametrize("tiles", sorted(TILES))
@pytest.mark.parametrize(
    ("batch", "heads", "length", "head_dim"),
    [(2, 3, 200, 16), (1, 2, 256, 32), (1, 1, 77, 24), (2, 1, 5, 8), (1, 1, 1, 4)],
)
def test_kernel_matches_the_reference(monkeypatch, tiles, batch, heads, length, head_dim):
    """The kernels against the float64 reference: ragged and whole rows, a row shorter than a tile,
    head widths padded up to a power of two. In the interpreter in float64 (the kernels' arithmetic
    then float64 too); on CUDA, where float64 takes the reference, in float32."""
    _use_tiles(monkeypatch, tiles)
    inputs = _inputs(batch, heads, length, head_dim)
    dtype, tolerance = (torch.float32, 1e-4) if DEVICE == "cuda" else (torch.float64, 1e-10)
    got = _run(pool_attention, *[t.to(dtype) for t in inputs], use_triton=True)
    want = _run(pool_attention_reference, *inputs)
    for name, a, b in zip(NAMES, got, want):
        assert not a.isnan().any(), name
        assert _relative_error(a, b) < tolerance, f"{name}: {_relative_error(a, b):.2e}"


@pytest.mark.parametrize("tiles", ["table", "h200_bf16"])
def test_float32_kernel_is_as_close_as_the_float32_reference(monkeypatch, tiles):
    """In float32 with clocks of thousands of ticks (a bias of hundreds, as late in a 4K row): the
    kernel's error against float64 stays within a small multiple of the float32 reference's."""
    _use_tiles(monkeypatch, tiles)
    inputs = _inputs(2, 2, 150, 32, bias_scale=60.0, seed=3)
    want = _run(pool_attention_reference, *inputs)
    single = [t.float() for t in inputs]
    got = _run(pool_attention, *single, use_triton=True)
    reference = _run(pool_attention_reference, *single)
    for name, a, r, w in zip(NAMES, got, reference, want):
        bound = max(4 * _relative_error(r, w), 1e-5)
        assert _relative_error(a, w) < bound, f"{name}: kernel {_relative_error(a, w):.2e}, bound {bound:.2e}"


def test_two_backward_passes_give_the_same_bits(monkeypatch):
    _use_tiles(monkeypatch, "small")
    inputs = [t.float() for t in _inputs(1, 2, 100, 16, seed=5)]
    first = _run(pool_attention, *inputs, use_triton=True)
    second = _run(pool_attention, *inputs, use_triton=True)
    for name, a, b in zip(NAMES, first, second):
        assert torch.equal(a, b), name


def test_strided_views_of_one_projection_read_as_contiguous_inputs():
    """q, k, v as the layer makes them (views of one (B, T, 3, H, d) projection) and an output
    gradient in the layer's (B, T, H, d) layout give what contiguous copies give."""
    batch, heads, length, head_dim = 2, 3, 70, 16
    q, k, v, bias, grad_out, grad_lse = _inputs(batch, heads, length, head_dim, seed=7)
    qkv = torch.stack([q, k, v], dim=2).permute(0, 3, 2, 1, 4).contiguous()  # (B, T, 3, H, d)
    views = qkv.permute(2, 0, 3, 1, 4)  # 3 x (B, H, T, d), strided
    strided_grad = grad_out.transpose(1, 2).contiguous().transpose(1, 2)
    got = _run(pool_attention, *views, bias, strided_grad, grad_lse, use_triton=True)
    want = _run(pool_attention, q, k, v, bias, grad_out, grad_lse, use_triton=True)
    for name, a, b in zip(NAMES, got, want):
        assert torch.equal(a, b), name


def test_gradients_of_some_inputs_only():
    """Only the bias and v need gradients (no dQ kernel); the output alone carries the loss."""
    q, k, v, bias, grad_out, _ = (t.float() for t in _inputs(1, 2, 40, 8, seed=9))
    v, bias = v.clone().requires_grad_(), bias.clone().requires_grad_()
    out, _ = pool_attention(q, k, v, bias, use_triton=True)
    (out * grad_out).sum().backward()
    v_ref, bias_ref = v.detach().clone().requires_grad_(), bias.detach().clone().requires_grad_()
    out_ref, _ = pool_attention_reference(q, k, v_ref, bias_ref)
    (out_ref * grad_out).sum().backward()
    assert _relative_error(v.grad, v_ref.grad) < 1e-5 and _relative_error(bias.grad, bias_ref.grad) < 1e-5


def test_bad_shapes_are_refused():
    q, k, v, bias, _, _ = _inputs(1, 2, 8, 4)
    with pytest.raises(ValueError, match=r"bias must be \(B, H, T\) = \(1, 2, 8\), got \(1, 2, 7\)"):
        pool_attention(q, k, v, bias[..., :7], use_triton=True)
    with pytest.raises(ValueError, match="q, k, v must share one"):
        pool_attention(q, k[..., :3], v, bias, use_triton=True)
    with pytest.raises(ValueError, match="q, k, v must share a dtype"):
        pool_attention(q, k.float(), v, bias, use_triton=True)


def test_an_empty_row():
    q, k, v, bias, _, _ = (t.requires_grad_() for t in _inputs(1, 2, 0, 4))
    out, lse = pool_attention(q, k, v, bias, use_triton=True)
    assert out.shape == (1, 2, 0, 4) and lse.shape == (1, 2, 0)


def test_the_pool_read_through_the_kernel_equals_the_explicit_read():
    """The NS read's CUDA path (the per-key bias relative to the row's last clock, then the kernel)
    against its definition, which forms c_t - c_s itself; gradients reach tags, clocks and rates."""
    generator = torch.Generator().manual_seed(11)
    batch, heads, length, head_dim = 2, 3, 90, 16
    q, k, v = (torch.randn(batch, heads, length, head_dim, generator=generator) for _ in range(3))
    log_tag = torch.nn.functional.logsigmoid(torch.randn(batch, heads, length, generator=generator))
    clock = (torch.rand(batch, heads, length, generator=generator) * 2).cumsum(-1) + 500.0
    rate = torch.tensor([0.5, 0.05, 0.002])
    grad = torch.randn(batch, heads, length, head_dim, generator=generator)
    results = []
    for read in (pool_read_kernel, pool_read_explicit):
        leaves = [t.clone().to(DEVICE).requires_grad_() for t in (q, k, v, log_tag, clock, rate)]
        out = read(*leaves)
        (out * grad.to(DEVICE)).sum().backward()
        results.append([out.detach()] + [leaf.grad for leaf in leaves])
    for name, a, b in zip(("out", "q", "k", "v", "log_tag", "clock", "rate"), *results):
        assert _relative_error(a, b) < 1e-4, f"{name}: {_relative_error(a, b):.2e}"
    assert per_key_bias(log_tag, clock, rate).max() <= 0  # relative to the row's last clock


def _explicit_in_bf16(q, k, v, bias):
    """The explicit read's arithmetic in bf16 (as `pool_read_explicit` runs under autocast): bf16
    score and output matmuls, the softmax in fp32 -- the yardstick of a bf16 read's error."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float() / math.sqrt(q.shape[-1]) + bias.float().unsqueeze(-2)
    future = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool, device=q.device).triu(1)
    scores = scores.masked_fill(future, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse.unsqueeze(-1)).to(v.dtype), v), lse


@pytest.mark.cuda
def test_cuda_real_shape_is_repeatable_and_as_close_as_a_bf16_explicit_read():
    """B 8, H 20, T 4096, d 128 in bf16: two forward + backward passes give the same bits, and on
    one batch row the kernel's error against the float64 reference is within twice the bf16
    explicit read's (or 1e-2 of the largest value)."""
    inputs = _inputs(8, 20, 4096, 128, dtype=torch.bfloat16, seed=13)
    inputs[3], inputs[5] = inputs[3].float(), inputs[5].float()
    first = _run(pool_attention, *inputs)
    second = _run(pool_attention, *inputs)
    for name, a, b in zip(NAMES, first, second):
        assert torch.equal(a, b), f"{name} differs between two identical calls"
    row = [t[:1] for t in inputs]
    want = _run(pool_attention_reference, *[t.double() for t in row])
    explicit = _run(_explicit_in_bf16, *row)
    for name, got, e, w in zip(NAMES, (t[:1] for t in first), explicit, want):
        bound = max(2 * _relative_error(e, w), 1e-2)
        assert _relative_error(got, w) < bound, f"{name}: kernel {_relative_error(got, w):.2e}, bound {bound:.2e}"


@pytest.mark.cuda
@pytest.mark.parametrize("length", [1000, 1024])
def test_cuda_float32_matches_the_reference(length):
    inputs = _inputs(2, 3, length, 64, seed=17)
    got = _run(pool_attention, *[t.float() for t in inputs])
    want = _run(pool_attention_reference, *inputs)
    for name, a, b in zip(NAMES, got, want):
        assert _relative_error(a, b) < 1e-4, f"{name}: {_relative_error(a, b):.2e}"


@pytest.mark.cuda
def test_cuda_ns_gradients_are_bitwise_repeatable():
    """A whole NS model (ns-tiny, bf16 autocast, EOS inside the rows): two backward passes from
    the same weights and tokens give the same bits in every gradient, so a resumed GPU line
    repeats an uninterrupted one."""
    config = dataclasses.replace(PRESETS["ns-tiny"])
    tokens = torch.randint(0, config.vocab_size, (2, 512), generator=torch.Generator().manual_seed(19)).cuda()
    tokens[:, 100] = config.eos_id
    torch.manual_seed(0)
    model = NSLM(config).cuda()
    runs = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, _ = model(tokens, tokens.roll(-1, dims=1))
        loss.mean().backward()
        runs.append((loss.detach().clone(), {name: p.grad.clone() for name, p in model.named_parameters()}))
    assert torch.equal(runs[0][0], runs[1][0])
    differing = [name for name, grad in runs[0][1].items() if not torch.equal(grad, runs[1][1][name])]
    assert not differing, f"gradients not bitwise repeatable: {differing}"
