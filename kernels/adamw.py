"""Flat AdamW step over one parameter group's slice of the flat fp32 buffers.

    scale = min(1, max_norm / (grad_norm + 1e-6))      (1 when max_norm <= 0)
    g     = grad * scale
    m     = beta1 m + (1 - beta1) g
    v     = beta2 v + (1 - beta2) g^2
    t     = step + 1
    param = param (1 - lr wd) - lr (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)

lr and weight_decay are 0-d fp32 device tensors, grad_norm a 0-d float64 one and step a 0-d
int64 one, read on the device so that a captured CUDA graph replays with new values and nothing
waits on the host. The norm is float64 because its squares are summed in float64
(`kernels.grad_norms`): a huge but finite gradient then has a finite norm and is clipped, with
the scale taken in float64 and applied to the fp32 gradient before the moments. The step is an
integer because an fp32 counter stops at 2^24 (2^24 + 1 rounds back to 2^24); t ln(beta) is
formed in float64 from it. When grad_norm is NaN or Inf the update is skipped: param, m and v
keep their exact bits. `step` is advanced separately, once for all groups, by `advance_step_`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels._dispatch import wants_triton

CLIP_EPS = 1e-6
"""Added to the gradient norm before dividing max_norm by it (a zero norm must not divide by 0)."""


def _check_buffers(
    param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor
) -> None:
    for name, buffer in (("param", param), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if buffer.dtype != torch.float32 or buffer.dim() != 1 or not buffer.is_contiguous():
            raise ValueError(f"adamw_step: {name} must be a 1-D contiguous fp32 tensor")
        if buffer.numel() != param.numel():
            raise ValueError(f"adamw_step: {name} has {buffer.numel()} elements, param has {param.numel()}")


_SCALARS = {"step": torch.int64, "lr": torch.float32, "weight_decay": torch.float32, "grad_norm": torch.float64}
"""The dtype of each device scalar `adamw_step` reads."""


def _check_scalars(param: torch.Tensor, scalars: dict[str, torch.Tensor]) -> None:
    """Both paths take the same scalars: an fp32 step or norm would bring the old limits back."""
    for name, scalar in scalars.items():
        dtype = _SCALARS[name]
        if scalar.dim() != 0 or scalar.dtype != dtype or scalar.device != param.device:
            raise ValueError(f"adamw_step: {name} must be a 0-d {dtype} tensor on {param.device}")


def bias_correction(beta: float, t: torch.Tensor) -> torch.Tensor:
    """1 - beta^t as an fp32 device scalar, from an integer (or float) update count t.

    Computed as -expm1(t ln beta) in float64: 1 - beta^t in fp32 loses most digits when beta^t
    is near 1, and t itself is not exact in fp32 beyond 2^24.
    """
    return (-torch.expm1(t.to(torch.float64) * math.log(beta))).to(torch.float32)


def clip_scale(grad_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The global-norm clip factor as a 0-d fp32 device tensor (1 when clipping is off).

    Divided in float64 by the float64 norm, which may exceed fp32's range even when every
    gradient element is finite.
    """
    if max_norm <= 0:
        return torch.ones_like(grad_norm, dtype=torch.float32)
    return torch.clamp(max_norm / (grad_norm + CLIP_EPS), max=1.0).to(torch.float32)


_BLOCK = 4096
"""Elements per program: 16 per thread at 8 warps, i.e. four 16-byte loads in flight per buffer."""

_DBL_MAX = tl.constexpr(1.7976931348623157e308)
"""The largest float64: a norm above it (Inf) or unordered with it (NaN) skips the update."""


@triton.jit
def _neg_expm1(x):
    """-(exp(x) - 1) accurate near x = 0 (Kahan's trick; Triton has no expm1 of its own).

    Far from 0, exp(x) - 1 is accurate as it is, and the trick would go wrong where exp(x) is
    subnormal (its log is then off by percents).
    """
    u = tl.exp(x)
    near_zero = (tl.abs(x) < 0.5) & (u != 1.0)
    kahan = (u - 1.0) * x / tl.log(tl.where(near_zero, u, 2.0))
    expm1 = tl.where(u == 1.0, x, tl.where(near_zero, kahan, u - 1.0))
    return -expm1


@triton.jit
def _adamw_kernel(
    param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr,
    step_ptr, lr_ptr, weight_decay_ptr, grad_norm_ptr,
    count, max_norm, beta1, beta2, log_beta1, log_beta2, eps,
    CLIP: tl.constexpr, BLOCK: tl.constexpr,
):
    grad_norm = tl.load(grad_norm_ptr)  # float64
    # A non-finite norm (NaN fails both comparisons) masks every load and store off: nothing is
    # read or written.
    finite = tl.abs(grad_norm) <= _DBL_MAX
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < tl.where(finite, count, 0)
    if CLIP:
        scale = tl.minimum(max_norm / (grad_norm + 1e-6), 1.0).to(tl.float32)
    else:
        scale = 1.0
    # Scalar float64 work once per program: t ln(beta) with t an exact integer past 2^24.
    t = (tl.load(step_ptr) + 1).to(tl.float64)
    bias_correction1 = _neg_expm1((t * log_beta1).to(tl.float32))
    bias_correction2 = _neg_expm1((t * log_beta2).to(tl.float32))
    lr = tl.load(lr_ptr)
    decay = 1.0 - lr * tl.load(weight_decay_ptr)

    param = tl.load(param_ptr + offsets, mask=mask)
    g = tl.load(grad_ptr + offsets, mask=mask) * scale
    exp_avg = beta1 * tl.load(exp_avg_ptr + offsets, mask=mask) + (1.0 - beta1) * g
    exp_avg_sq = beta2 * tl.load(exp_avg_sq_ptr + offsets, mask=mask) + (1.0 - beta2) * g * g
    denominator = tl.sqrt_rn(exp_avg_sq / bias_correction2) + eps
    param = param * decay - lr * (exp_avg / bias_correction1) / denominator
    tl.store(param_ptr + offsets, param, mask=mask)
    tl.store(exp_avg_ptr + offsets, exp_avg, mask=mask)
    tl.store(exp_avg_sq_ptr + offsets, exp_avg_sq, mask=mask)


@torch.no_grad()
def adamw_step_reference(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: torch.Tensor,
    lr: torch.Tensor,
    weight_decay: torch.Tensor,
    grad_norm: torch.Tensor,
    max_norm: float,
    beta1: float,
    beta2: float,
    eps: float,
) -> None:
    """The update in PyTorch ops, in place; no host synchronisation (the skip is a `where`)."""
    _check_buffers(param, grad, exp_avg, exp_avg_sq)
    _check_scalars(param, {"step": step, "lr": lr, "weight_decay": weight_decay, "grad_norm": grad_norm})
    finite = torch.isfinite(grad_norm)
    g = grad * clip_scale(grad_norm, max_norm)
    new_exp_avg = beta1 * exp_avg + (1 - beta1) * g
    new_exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * g * g
    t = step + 1
    bias_correction1 = bias_correction(beta1, t)
    bias_correction2 = bias_correction(beta2, t)
    denominator = torch.sqrt(new_exp_avg_sq / bias_correction2) + eps
    new_param = param * (1 - lr * weight_decay) - lr * (new_exp_avg / bias_correction1) / denominator
    # A skipped update copies the old values back: the same bits, no host sync to decide.
    param.copy_(torch.where(finite, new_param, param))
    exp_avg.copy_(torch.where(finite, new_exp_avg, exp_avg))
    exp_avg_sq.copy_(torch.where(finite, new_exp_avg_sq, exp_avg_sq))


def adamw_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: torch.Tensor,
    lr: torch.Tensor,
    weight_decay: torch.Tensor,
    grad_norm: torch.Tensor,
    max_norm: float,
    beta1: float,
    beta2: float,
    eps: float,
    use_triton: bool | None = None,
) -> None:
    """One AdamW update of a group, in place (see the module docstring): Triton on CUDA.

    use_triton: None picks Triton on CUDA; True forces it (off CUDA only under
    TRITON_INTERPRET=1); False forces the reference.
    """
    if wants_triton(param, use_triton):
        _check_buffers(param, grad, exp_avg, exp_avg_sq)
        _check_scalars(param, {"step": step, "lr": lr, "weight_decay": weight_decay, "grad_norm": grad_norm})
        count = param.numel()
        if count == 0:
            return
        grid = (triton.cdiv(count, _BLOCK),)
        _adamw_kernel[grid](
            param, grad, exp_avg, exp_avg_sq, step, lr, weight_decay, grad_norm, count,
            max_norm, beta1, beta2, math.log(beta1), math.log(beta2), eps,
            CLIP=max_norm > 0, BLOCK=_BLOCK, num_warps=8,
        )
        return
    update = adamw_step_in_place if param.device.type == "cpu" else adamw_step_reference
    update(
        param, grad, exp_avg, exp_avg_sq, step=step, lr=lr, weight_decay=weight_decay,
        grad_norm=grad_norm, max_norm=max_norm, beta1=beta1, beta2=beta2, eps=eps,
    )


def adamw_step_in_place(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: torch.Tensor,
    lr: torch.Tensor,
    weight_decay: torch.Tensor,
    grad_norm: torch.Tensor,
    max_norm: float,
    beta1: float,
    beta2: float,
    eps: float,
) -> None:
    """`adamw_step_reference`'s update with its bits, for the CPU: the skip read on the host (no
    CUDA graph to keep it on the device; a sync costs nothing here) and every operation in place
    on two work buffers, in the reference's order and roundings (no fused multiply-adds: `add_`
    with `alpha` would round once where the reference rounds twice). The reference's twenty
    full-size temporaries and three `where`s took 20 ms an update at 1.5M parameters on 2 cores."""
    _check_buffers(param, grad, exp_avg, exp_avg_sq)
    _check_scalars(param, {"step": step, "lr": lr, "weight_decay": weight_decay, "grad_norm": grad_norm})
    if not bool(torch.isfinite(grad_norm)):
        return  # skipped: param and moments keep their bits
    g = grad * clip_scale(grad_norm, max_norm)
    work = torch.mul(g, 1 - beta1)
    exp_avg.mul_(beta1).add_(work)  # beta1 m + (1 - beta1) g
    torch.mul(g, 1 - beta2, out=work)
    work.mul_(g)
    exp_avg_sq.mul_(beta2).add_(work)  # beta2 v + ((1 - beta2) g) g
    t = step + 1
    denominator = torch.div(exp_avg_sq, bias_correction(beta2, t), out=g)  # g is spent
    denominator.sqrt_().add_(eps)
    torch.div(exp_avg, bias_correction(beta1, t), out=work)
    work.mul_(lr).div_(denominator)  # lr (m / bc1) / denominator
    param.mul_(1 - lr * weight_decay).sub_(work)


@torch.no_grad()
def advance_step_(step: torch.Tensor, grad_norm: torch.Tensor) -> None:
    """step += 1 when grad_norm is finite (after every group's `adamw_step`); no host sync."""
    step.add_(torch.isfinite(grad_norm).to(step.dtype))
