"""Maps of one input as one matrix product (`stacked_linear`): the maps' outputs and gradients, and
one gradient for the input under bf16 autocast, summed in the product's fp32 accumulator."""

from __future__ import annotations

import torch
from torch import nn

from engine.models.common import maps_of, stacked_linear


def _maps() -> tuple[nn.Linear, ...]:
    torch.manual_seed(0)
    return nn.Linear(16, 24, bias=False), nn.Linear(16, 3), nn.Linear(16, 5)


def test_stacked_maps_give_each_map_its_output_and_gradients() -> None:
    maps = _maps()
    x = torch.randn(2, 7, 16, dtype=torch.float64, requires_grad=True)
    for linear in maps:
        linear.double()
    outputs = stacked_linear(x, maps)
    assert [tuple(output.shape) for output in outputs] == [(2, 7, 24), (2, 7, 3), (2, 7, 5)]
    grads = [torch.randn_like(output) for output in outputs]
    torch.autograd.backward(outputs, grads)
    got = [x.grad] + [p.grad for linear in maps for p in linear.parameters()]
    x.grad = None
    for linear in maps:
        linear.zero_grad(set_to_none=True)
    separate = [linear(x) for linear in maps]
    torch.autograd.backward(separate, grads)
    want = [x.grad] + [p.grad for linear in maps for p in linear.parameters()]
    for output, reference in zip(outputs, separate, strict=True):
        torch.testing.assert_close(output, reference, rtol=1e-12, atol=1e-12)
    for mine, theirs in zip(got, want, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12)


def test_under_autocast_the_input_gets_one_gradient_from_one_product() -> None:
    """One bf16 product reads x, so x's gradient is that product's alone (no bf16 gradient a map to
    cast and add), within bf16's rounding of the exact sum of the maps' gradients."""
    maps = _maps()
    x = torch.randn(4, 9, 16).bfloat16().requires_grad_()
    grads = [torch.randn(4, 9, linear.out_features) for linear in maps]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outputs = stacked_linear(x, maps)
    assert all(output.dtype == torch.bfloat16 for output in outputs)
    (split,) = {output.grad_fn for output in outputs}  # the outputs are slices of one tensor
    (product, _), *_ = split.next_functions
    assert product.name() in ("AddmmBackward0", "MmBackward0", "UnsafeViewBackward0", "ViewBackward0")
    torch.autograd.backward(outputs, [g.bfloat16() for g in grads])
    exact = sum(g.double() @ linear.weight.double() for g, linear in zip(grads, maps, strict=True))
    assert (x.grad.double() - exact).norm() / exact.norm() < 2**-7


def test_each_output_starts_aligned_for_the_kernels_that_read_slices() -> None:
    """q, k, v (7,680 wide at ns-2b) then the clock's and the write gate's 20 columns: each starts at a
    multiple of 16 columns and the rows are a multiple of 16 wide, zero rows filling the gaps."""
    maps = (nn.Linear(16, 40, bias=False), nn.Linear(16, 5), nn.Linear(16, 5))
    outputs = stacked_linear(torch.randn(3, 4, 16), maps)
    assert [output.storage_offset() for output in outputs] == [0, 48, 64]
    assert {output.stride(1) for output in outputs} == {80}


def test_without_autograd_the_maps_run_one_by_one() -> None:
    """Validation and decoding gather no gradient: `maps_of` copies no stacked weight a call (a token)."""
    maps = _maps()
    x = torch.randn(2, 1, 16)
    with torch.no_grad():
        outputs = maps_of(x, maps)
    for output, linear in zip(outputs, maps, strict=True):
        assert output.is_contiguous()
        assert torch.equal(output, torch.nn.functional.linear(x, linear.weight, linear.bias))
    assert maps_of(x, maps)[1].storage_offset() == 32  # under autograd: slices of one product
