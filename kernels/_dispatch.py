"""Choosing between a kernel's Triton path and its PyTorch reference."""

from __future__ import annotations

import os

import torch


def triton_interpreter_on() -> bool:
    """True when Triton runs kernels through its CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """What a reference computes in: fp32, or fp64 when any input is fp64 (so that
    torch.autograd.gradcheck can check the reference itself)."""
    if any(t is not None and t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


def wants_triton(tensor: torch.Tensor, use_triton: bool | None) -> bool:
    """Whether a call on `tensor` takes the Triton path.

    use_triton None (the default) picks Triton exactly when the tensor is on CUDA; True asks
    for Triton, which off CUDA needs the interpreter; False always takes the reference.
    """
    if use_triton is None:
        return tensor.is_cuda
    if not use_triton:
        return False
    if tensor.is_cuda or triton_interpreter_on():
        return True
    raise RuntimeError(
        "use_triton=True on a CPU tensor needs TRITON_INTERPRET=1 set before triton is imported"
    )


class _PoisonSwitch:
    """Debug switch: when on, buffers the Triton paths allocate start as NaN (-1 for integers),
    so a test sees any element a kernel forgot to write."""

    enabled = False


poison = _PoisonSwitch()


def new_buffer(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.empty for kernel outputs and scratch, NaN-filled while `poison.enabled` is set."""
    buffer = torch.empty(tuple(shape), dtype=dtype, device=device)
    if poison.enabled:
        buffer.fill_(float("nan") if buffer.is_floating_point() else -1)
    return buffer
