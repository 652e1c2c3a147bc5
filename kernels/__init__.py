"""Triton kernels, each beside its PyTorch reference with the same signature.

`<name>(...)` runs the Triton kernel on CUDA tensors (or under TRITON_INTERPRET=1 when asked with
use_triton=True) and `<name>_reference(...)` everywhere else.
"""

from __future__ import annotations

from kernels.adamw import adamw_step, adamw_step_reference, advance_step_
from kernels.grad_norms import segment_sq_sums, segment_sq_sums_reference
from kernels.plif import plif_membrane, plif_scan, plif_scan_reference
from kernels.poincare import poincare_read, poincare_read_reference
from kernels.selective_scan import selective_scan, selective_scan_reference

__all__ = [
    "adamw_step",
    "adamw_step_reference",
    "advance_step_",
    "plif_membrane",
    "plif_scan",
    "plif_scan_reference",
    "poincare_read",
    "poincare_read_reference",
    "segment_sq_sums",
    "segment_sq_sums_reference",
    "selective_scan",
    "selective_scan_reference",
]
