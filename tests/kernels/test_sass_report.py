"""bench/sass_report.py compiles kernels for the H200's sm_90 on this CPU machine: the kernels' tiles
are checked here as the GPU will run them (the interpreter the other kernel tests use has no
layouts, no registers and no shuffles)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPOSITORY as ROOT

TOOLS = Path(__import__("triton").__file__).parent / "backends" / "nvidia" / "bin"

pytestmark = pytest.mark.skipif(not (TOOLS / "cuobjdump").exists(), reason="Triton without its bundled CUDA tools")


def _report(kernel: str, warps: int, floats: list[str], constants: dict[str, object]) -> str:
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    command = [sys.executable, str(ROOT / "bench" / "sass_report.py"), kernel, "--warps", str(warps),
               "--floats", *floats, "--const", *(f"{name}={value}" for name, value in constants.items())]
    done = subprocess.run(command, capture_output=True, text=True, env=environment, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def _largest_loop(report: str) -> str:
    return max((line for line in report.splitlines() if line.strip().startswith("loop ")),
               key=lambda line: int(re.search(r": (\d+) instructions", line).group(1)))


@pytest.mark.parametrize(("block", "constant_width"), [(32, 0), (64, 2560)])
def test_plif_backward_keeps_a_chunks_steps_in_registers(block: int, constant_width: int) -> None:
    """The chunk loop as shipped, at a width divisible by 16 (whole blocks): no shuffle, no spill,
    every 2-D tile's rows in a thread's registers with the warp's 32 lanes along channels
    (bench/RESULTS.md, session 5: told such a width's contiguity, Triton spread the steps over
    lanes and a reduction picked the wrong step; with 64 channels the kernel takes the width as a
    constant and caps the contiguity it is told, with 32 the width at run time, unspecialised).
    Triton 3.6 on the H200 chose differently from this machine's once (session 6): the GPU's own
    compile is the last word (`bash bench/gpu_suite.sh kernel-tests` runs this file there)."""
    report = _report("kernels.plif_backward:_plif_backward_kernel", 1, ["alpha"], dict(
        CHANNELS=constant_width, HAS_V0=True, HAS_GRAD_SPIKES=True, HAS_GRAD_V_PRE=True, HAS_GRAD_V_LAST=True,
        HAS_CARRY=True, BLOCK_D=block, CHUNK_T=8, STAGES=4, MASKED=False))
    assert "stack 0 B" in report
    assert "SHFL" not in _largest_loop(report)
    two_d = [line for line in report.splitlines() if "layout" in line and "sizePerThread = [1, " in line]
    assert two_d and all("threadsPerWarp = [1, 32]" in line for line in two_d)


def test_selective_scan_backward_does_not_spill_or_reverse_lanes() -> None:
    """N 16 at 8-step chunks fits the registers (bench/RESULTS.md: N 32 would spill); the
    adjoint's scan runs on flipped rows, not with reverse=True (92 more shuffles a chunk), and dB
    and dC are summed over the channel lanes by halving (sum_pair_over_channels), not with
    tl.sum's butterflies: 54 shuffles a chunk are left (230 before)."""
    report = _report("kernels.selective_scan_backward:_selective_scan_backward_kernel", 1, ["log2_e"], dict(
        channels=1024, groups=1, state_size=16, HAS_D=True, HAS_CARRY=False, EVEN=True, BLOCK_D=8, N_PAD=16,
        CHUNK_T=8, STAGES=3))
    assert "stack 0 B" in report
    loop = _largest_loop(report)
    # The chunk loop found, its exponentials computed once: a layout pushed back through the sums
    # would recompute them (and the scans) in a second layout.
    assert int(re.search(r"MUFU (\d+)", loop).group(1)) == 32
    assert int(re.search(r"SHFL (\d+)", loop).group(1)) <= 64
