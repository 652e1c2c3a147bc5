"""One forward (no gradient) and one forward + backward of each scan at the benchmark's Bt 8 shapes,
and nothing else: the program to run under Nsight Compute for the scans' hardware counters.

    ncu --clock-control none -k regex:'plif|selective_scan' --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section WarpStateStats python bench/profile_scans.py

(`bash bench/gpu_suite.sh ncu` runs that.) Each scan's first launches are its no-gradient
forward, then its forward and backward with gradients, in that order in the report.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.plif import plif_scan  # noqa: E402
from kernels.selective_scan import selective_scan  # noqa: E402


def plif(batch: int, steps: int, channels: int) -> None:
    x = torch.randn(batch, steps, channels, device="cuda")
    beta = (torch.rand(channels, device="cuda") * 0.8 + 0.1).requires_grad_()
    threshold = (torch.rand(channels, device="cuda") + 0.5).requires_grad_()
    with torch.no_grad():
        plif_scan(x, beta, threshold)
    leaves = [x.requires_grad_(), beta, threshold]
    spikes, v_pre, _ = plif_scan(*leaves)
    torch.autograd.grad([spikes, v_pre], leaves, [torch.randn_like(x), torch.randn_like(x)])


def scan(batch: int, steps: int, channels: int, state_size: int = 16) -> None:
    x = torch.randn(batch, steps, channels, device="cuda")
    delta = torch.nn.functional.softplus(torch.randn(batch, steps, channels, device="cuda") - 1)
    A = -torch.rand(channels, state_size, device="cuda") * 4 - 0.1
    B, C = (torch.randn(batch, steps, 1, state_size, device="cuda") for _ in range(2))
    D = torch.randn(channels, device="cuda")
    with torch.no_grad():
        selective_scan(x, delta, A, B, C, D)
    leaves = [t.requires_grad_() for t in (x, delta, A, B, C, D)]
    y, _ = selective_scan(*leaves)
    torch.autograd.grad(y, leaves, torch.randn_like(y))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=["plif", "scan"])
    args = parser.parse_args()
    if "plif" in args.only:
        plif(8, 4096, 2560)
    if "scan" in args.only:
        scan(8, 4096, 1024)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
