"""GPU forward + backward time of the NS model's heavy parts at the ns-2b shapes, one JSON row each.

- `chunked_scan`: the dendritic compartments' chunked scan (B 8, T 4096, 40 heads of 64, N 64,
  bf16 autocast), eager and as the model runs it on CUDA (`compiled_chunked_scan`); DESIGN.md
  measured 22 ms eager and 6.3 ms compiled for this shape.
- `pool_read_flex`: the hippocampal read through flex_attention with the clock / tag bias as a
  score_mod (B 8, 20 heads, T 4096, d 128, bf16); DESIGN.md measured 14.9 ms (SDPA flash
  without the bias: 4.9 ms, also printed as `sdpa_flash`).
- `dendritic_layer`, `hippocampal_layer`, `ns-2b_step`: whole layers and a whole ns-2b
  micro-batch (B 1, T 4096), as the model runs them (the PLIF scans through whatever
  `kernels.plif` dispatches to); the dendritic layer and the model with the chunked scan eager
  and compiled (`compile_scan`) side by side.
- `glue`: the same layers and micro-batch with the elementwise work between the kernels eager and
  compiled (`compile_glue`) side by side.

    python bench/ns_layers.py [--iters 10] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

# The repository root first: run as a script, bench/ would lead sys.path and its kernels.py
# would shadow the kernels package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.models.ns.config import NSConfig  # noqa: E402
from engine.models.ns.dendritic import DendriticLayer  # noqa: E402
from engine.models.ns.hippocampal import HippocampalLayer  # noqa: E402
from engine.models.ns.model import NSLM  # noqa: E402
from engine.models.ns.pool_read import pool_read_flex  # noqa: E402
from engine.models.ns.presets import PRESETS  # noqa: E402
from engine.models.ns.scan import chunked_scan, compiled_chunked_scan  # noqa: E402
from engine.units import GIB  # noqa: E402


def time_ms(step: Callable[[], None], iters: int, warmup: int = 3) -> float:
    """Median milliseconds of `step` (forward + backward) over `iters` CUDA-event-timed runs."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def scan_rows(iters: int) -> list[dict]:
    batch, length, heads, head_dim, state = 8, 4096, 40, 64, 64
    device = "cuda"
    u = torch.randn(batch, length, heads, head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    dt = (torch.rand(batch, length, heads, device=device) * 0.1).requires_grad_()
    A = (-torch.rand(heads, device=device) * 4).requires_grad_()
    B = torch.randn(batch, length, 1, state, device=device, dtype=torch.bfloat16, requires_grad=True)
    C = torch.randn(batch, length, 1, state, device=device, dtype=torch.bfloat16, requires_grad=True)
    rows = []
    for name, scan in (("eager", chunked_scan), ("compiled", compiled_chunked_scan())):

        def step(scan=scan):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y, last = scan(u, dt, A, B, C, 64)
            (y.float().square().mean() + last.square().mean()).backward()

        rows.append({"bench": "chunked_scan", "mode": name, "ms": time_ms(step, iters),
                     "shape": "B8 T4096 H40 P64 N64 L64 bf16"})  # fmt: skip
    return rows


def pool_read_rows(iters: int) -> list[dict]:
    batch, heads, length, head_dim = 8, 20, 4096, 128
    device = "cuda"

    def leaf(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device=device, dtype=dtype).requires_grad_()

    q, k, v = (leaf(batch, heads, length, head_dim) for _ in range(3))
    log_tag = torch.nn.functional.logsigmoid(torch.randn(batch, heads, length, device=device)).requires_grad_()
    clock = torch.rand(batch, heads, length, device=device).cumsum(-1).requires_grad_()
    rate = torch.full((heads,), 0.01, device=device, requires_grad=True)

    def flex_step():
        pool_read_flex(q, k, v, log_tag, clock, rate).float().square().mean().backward()

    def sdpa_step():
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.float().square().mean().backward()

    shape = "B8 H20 T4096 d128 bf16"
    return [
        {"bench": "pool_read_flex", "ms": time_ms(flex_step, iters), "shape": shape},
        {"bench": "sdpa_flash", "ms": time_ms(sdpa_step, iters), "shape": shape},
    ]


def layer_ms(layer_class: type[DendriticLayer | HippocampalLayer], config: NSConfig, iters: int) -> float:
    """Forward + backward of one layer of `config` on B 1, T 4096 under bf16 autocast."""
    torch.manual_seed(0)
    layer = layer_class(config).cuda()
    x = torch.randn(1, 4096, config.d_model, device="cuda", requires_grad=True)
    is_eos = torch.zeros(1, 4096, dtype=torch.bool, device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out, _, _ = layer(x, is_eos, None)
        out.float().square().mean().backward()

    return time_ms(step, iters)


def model_row(config: NSConfig, iters: int) -> dict:
    """Forward + backward of a whole model of `config` on one row of 4096 tokens under bf16 autocast."""
    torch.manual_seed(0)
    model = NSLM(config).cuda()
    tokens = torch.randint(0, config.vocab_size, (1, 4096), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, _ = model(tokens, tokens)
        loss.mean().backward()

    torch.cuda.reset_peak_memory_stats()
    ms = time_ms(step, iters, warmup=2)
    return {"ms": ms, "tokens_per_s": 4096 / ms * 1e3, "params": model.num_parameters(),
            "peak_gib": torch.cuda.max_memory_allocated() / GIB}  # fmt: skip


def layer_rows(iters: int) -> list[dict]:
    rows = []
    cases = (
        ("dendritic_layer", DendriticLayer, False),
        ("dendritic_layer", DendriticLayer, True),
        ("hippocampal_layer", HippocampalLayer, True),
    )
    for name, layer_class, compile_scan in cases:
        config = dataclasses.replace(PRESETS["ns-2b"], compile_scan=compile_scan)
        rows.append({"bench": name, "compile_scan": compile_scan, "ms": layer_ms(layer_class, config, iters),
                     "shape": "ns-2b B1 T4096 bf16 eager"})  # fmt: skip
    return rows


def model_rows(iters: int) -> list[dict]:
    rows = []
    for compile_scan in (False, True):
        row = model_row(dataclasses.replace(PRESETS["ns-2b"], compile_scan=compile_scan), iters)
        rows.append({"bench": "ns-2b_step", "compile_scan": compile_scan, **row, "shape": "B1 T4096 bf16 eager"})
    return rows


def glue_rows(iters: int) -> list[dict]:
    """The layers and the whole model with their elementwise glue eager and compiled (`compile_glue`,
    engine/models/ns/glue.py), each with its recomputation in the backward as on CUDA."""
    rows = []
    for compile_glue in (False, True):
        config = dataclasses.replace(PRESETS["ns-2b"], compile_glue=compile_glue)
        for name, layer_class in (("dendritic_layer", DendriticLayer), ("hippocampal_layer", HippocampalLayer)):
            rows.append({"bench": name, "compile_glue": compile_glue, "ms": layer_ms(layer_class, config, iters),
                         "shape": "ns-2b B1 T4096 bf16"})  # fmt: skip
        rows.append({"bench": "ns-2b_step", "compile_glue": compile_glue, **model_row(config, iters),
                     "shape": "B1 T4096 bf16"})  # fmt: skip
    return rows


BENCHES = {"scan": scan_rows, "pool_read": pool_read_rows, "layers": layer_rows, "model": model_rows,
           "glue": glue_rows}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--only", nargs="*", choices=sorted(BENCHES), default=sorted(BENCHES))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/ns_layers.py needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name()
    for name in args.only:
        for row in BENCHES[name](args.iters):
            print(json.dumps({**row, "device": device, "torch": torch.__version__}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
