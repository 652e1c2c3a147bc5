"""The GPU yardstick (issue 22): the project's models against the strongest plain GPT we can write.

In one call, each in a fresh child process (its own compile caches, its own GPU memory):

1. the matmul ceiling: dense bf16 8192^3 products on CUDA (fp32 1024^3 on a CPU), the
   denominator of every row's MFU (`engine.ops.bench.measure_matmul_tflops`);
2. per context length, each model at its micro-batch: the plain GPT below through its own
   nanoGPT-style loop, and each project preset through `engine.ops.bench.bench_shape` (what
   `nsconsole bench` runs: the trainer's model, FlatAdamW and step engine, CUDA graphs on CUDA).

Rows (JSON, one a line, on stdout and appended to --out as they come): model, seq_len, rows,
accum, recompute, tokens_per_s, mfu, peak_mem_gib, flops_per_token, parameters, peer,
ratio_to_plain_gpt (tokens/s over `plain-gpt`'s, or `--yardstick`'s, at the same length), ratio_to_peer (over the
model's peer's: ns-* against transformer-* of the same size, transformer-2b against plain-gpt,
transformer-1p3b against plain-gpt-1p3b, its exact shape), attention (`--attention`: SDPA's
default order, FlashAttention-2 first, or cuDNN's fused attention, the faster on Hopper by
published figures: the stronger yardstick), seconds (the child's wall time,
compilation included) and error (why a child gave no figure: out of memory, timed out, ...).
A ratio is null where either side has no figure in this call.

The plain GPT (`plain-gpt`, 2,047,470,080 parameters): 24 layers, width 2560, 20 heads of 128,
SwiGLU of 6,784, torch's RMSNorm, RoPE (base 500,000), SDPA causal attention (flash), embedding
tied to the output head (as every project preset at this size), no biases, loss
`F.cross_entropy` over the whole (tokens, 65,536) logits in fp32; the whole model under one
`torch.compile`, bf16 autocast over fp32 weights, fused torch AdamW (decay on matrices only),
global-norm clip 1.0. On a CPU (tests) it runs eagerly in fp32 with foreach AdamW.

FLOPs per token, forward + backward, per family (each model's own `flops_per_token`):
- plain GPT and transformer-*: 6 x (matrix weights, output head included, the embedding lookup
  free) + 12 x depth x width x (T + 1) / 2 (causal QK^T and AV, three times the forward);
- ns-*: 3 x the forward's: 2 x (every Linear's weights + the tied head) + per dendritic layer
  the chunked scan's products (C B^T within a chunk, the decay-weighted mixing, the chunk's end
  state, the entering state, the state passing between chunks) + per hippocampal layer the
  pool read, 4 x attention width x (T + 1) / 2;
- pssa-*: 6 x (block matrices x passes + the head) + 3 x passes x (the scan, 8 d N, and the
  memory read, 3 x key width x capacity + 2 x read slots x d).
The loss's recomputed output map (the project's chunked cross-entropy) is not counted: MFU is
the model's FLOPs, not the hardware's.

Micro-batches: `nsconsole tune` would ask for a capture, a warm-up and timed updates per rows
and recomputation setting (16 settings for an NS model), minutes per model at 2B: too slow for
this call's budget. So the rows, accumulation and recomputation are the table `SHAPES` below,
chosen by hand, not tuned (32,768 tokens an update at every length, the issue's 8 x 1 at 4K);
`--rows` and `--accum` replace them for every model of a call, `--recompute` for every NS model
(the only family that has activation recomputation).

    python bench/gpu_peers.py --seq-lens 4096 --models plain-gpt,transformer-2b,ns-2b --updates 10 \\
        --out bench/gpu_peers.jsonl
    python bench/gpu_peers.py --device cpu --models plain-gpt-tiny,transformer-tiny --seq-lens 128
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

# The repository root first: run as a script, bench/ would lead sys.path and its kernels.py
# would shadow the kernels package.
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_MODELS = ("plain-gpt", "transformer-2b", "ns-2b", "transformer-1p3b", "ns-1p3b", "pssa-127m")
DEFAULT_SEQ_LENS = (4096, 16384, 32768)
TOKENS_PER_UPDATE = 32768
"""Tokens an update at every length: the issue's 8 rows of 4K."""

SHAPES: dict[tuple[str, int], tuple[int, int, str]] = {
    # (model, seq_len): (rows, accum, recompute). Chosen by hand, not tuned (module docstring).
    # The NS models recompute their dendritic layers, as the issue measured ns-2b at 8 x 1.
    ("ns-2b", 4096): (8, 1, "dendritic"),
    ("ns-2b", 16384): (2, 1, "dendritic"),
    ("ns-2b", 32768): (1, 1, "dendritic"),
    ("ns-1p3b", 4096): (8, 1, "dendritic"),
    ("ns-1p3b", 16384): (2, 1, "dendritic"),
    ("ns-1p3b", 32768): (1, 1, "dendritic"),
}
"""Every other (model, length): TOKENS_PER_UPDATE // seq_len rows, one micro-batch, no recompute."""

PEERS = {
    "ns-2b": "transformer-2b",
    "ns-1p3b": "transformer-1p3b",
    "ns-tiny": "transformer-tiny",
    "transformer-2b": "plain-gpt",
    "transformer-1p3b": "plain-gpt-1p3b",
    "transformer-tiny": "plain-gpt-tiny",
}
"""Each model's peer: the strongest model of its size one step down the yardstick."""

PLAIN = "plain-gpt"
"""The yardstick every row's ratio_to_plain_gpt is taken against (`--yardstick` names another)."""


@dataclass(frozen=True)
class PlainShape:
    """Shape of a plain GPT."""

    vocab: int
    """Vocabulary (rows of the tied embedding and head)."""
    width: int
    """Residual width."""
    depth: int
    """Layers."""
    heads: int
    """Attention heads (width / heads is the head width)."""
    ffn_hidden: int
    """SwiGLU hidden width."""


PLAIN_SHAPES = {
    "plain-gpt": PlainShape(vocab=65536, width=2560, depth=24, heads=20, ffn_hidden=6784),
    # transformer-1p3b's exact shape: that preset's peer.
    "plain-gpt-1p3b": PlainShape(vocab=65536, width=2048, depth=24, heads=16, ffn_hidden=5248),
    "plain-gpt-tiny": PlainShape(vocab=256, width=32, depth=2, heads=2, ffn_hidden=64),
}
PLAIN_ROPE_BASE = 500_000.0
BENCH_LR = 1e-4
WEIGHT_DECAY = 0.1


def progress(message: str) -> None:
    print(f"[gpu_peers] {message}", file=sys.stderr, flush=True)


def emit(row: dict[str, Any], out: IO[str] | None) -> None:
    """A result row: printed as one JSON line, and appended to `out` (`--out`) when given."""
    line = json.dumps(row)
    print(line, flush=True)
    if out is not None:
        out.write(line + "\n")
        out.flush()


# -- the plain GPT (child side) ---------------------------------------------------------------------


def plain_flops_per_token(shape: PlainShape, seq_len: int) -> float:
    """6 x matrix weights (head included) + causal attention's 12 x depth x width x (T + 1) / 2."""
    per_layer = 4 * shape.width**2 + 3 * shape.width * shape.ffn_hidden
    matrix_weights = shape.depth * per_layer + shape.vocab * shape.width
    return 6.0 * matrix_weights + 12.0 * shape.depth * shape.width * (seq_len + 1) / 2


def build_plain_gpt(shape: PlainShape, max_len: int) -> Any:
    """The plain GPT as an nn.Module: `model(tokens, targets)` -> the mean cross-entropy."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    head_dim = shape.width // shape.heads

    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = head_dim // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn_norm = nn.RMSNorm(shape.width, eps=1e-6)
            self.qkv = nn.Linear(shape.width, 3 * shape.width, bias=False)
            self.proj = nn.Linear(shape.width, shape.width, bias=False)
            self.ffn_norm = nn.RMSNorm(shape.width, eps=1e-6)
            self.gate_up = nn.Linear(shape.width, 2 * shape.ffn_hidden, bias=False)
            self.down = nn.Linear(shape.ffn_hidden, shape.width, bias=False)

        def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            batch, length, width = x.shape
            q, k, v = self.qkv(self.attn_norm(x)).view(batch, length, 3, shape.heads, head_dim).unbind(2)
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, hd)
            cos, sin = cos.to(q.dtype), sin.to(q.dtype)
            y = F.scaled_dot_product_attention(rotate(q, cos, sin), rotate(k, cos, sin), v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(batch, length, width))
            gate, up = self.gate_up(self.ffn_norm(x)).chunk(2, dim=-1)
            return x + self.down(F.silu(gate) * up)

    class PlainGPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(shape.vocab, shape.width)
            self.blocks = nn.ModuleList(Block() for _ in range(shape.depth))
            self.final_norm = nn.RMSNorm(shape.width, eps=1e-6)
            inv_freq = PLAIN_ROPE_BASE ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
            angles = torch.arange(max_len, dtype=torch.float64).unsqueeze(1) * inv_freq
            angles = torch.cat([angles, angles], dim=-1)
            self.register_buffer("cos", angles.cos().float(), persistent=False)
            self.register_buffer("sin", angles.sin().float(), persistent=False)
            for module in self.modules():
                if isinstance(module, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(module.weight, std=0.02)
            for block in self.blocks:  # GPT-2's scaled residual projections
                for weight in (block.proj.weight, block.down.weight):
                    nn.init.normal_(weight, std=0.02 / math.sqrt(2 * shape.depth))

        def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            length = tokens.shape[1]
            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x, self.cos[:length], self.sin[:length])
            logits = self.final_norm(x) @ self.embed.weight.T  # tied head
            return F.cross_entropy(logits.float().view(-1, shape.vocab), targets.reshape(-1))

    return PlainGPT()


def run_plain(
    name: str, seq_len: int, rows: int, accum: int, device_name: str, updates: int, warmup: int
) -> dict:
    """Time the plain GPT's updates (nanoGPT's loop); tokens/s, peak memory, FLOPs per token."""
    import torch

    from engine.training.trainer import resolve_device

    device = resolve_device(device_name, "gpu_peers: --device")
    cuda = device.type == "cuda"
    shape = PLAIN_SHAPES[name]
    torch.manual_seed(0)
    with torch.device(device):  # made in place: no CPU initialisation of 2B weights
        model = build_plain_gpt(shape, seq_len)
    parameters = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(
        groups, lr=BENCH_LR, betas=(0.9, 0.95), eps=1e-8, fused=cuda, foreach=not cuda
    )
    step_model = torch.compile(model) if cuda else model
    generator = torch.Generator().manual_seed(0)
    windows = torch.randint(0, shape.vocab, (rows * accum, seq_len + 1), generator=generator)
    if cuda:
        windows = windows.pin_memory()
        torch.cuda.reset_peak_memory_stats(device)

    def update() -> None:
        for chunk in windows.split(rows):
            chunk = chunk.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
                loss = step_model(chunk[:, :-1], chunk[:, 1:]) / accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def synchronize() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        update()
    synchronize()
    started = time.perf_counter()
    for _ in range(updates):
        update()
    synchronize()
    seconds = (time.perf_counter() - started) / updates
    return {
        "parameters": parameters,
        "tokens_per_s": rows * accum * seq_len / seconds,
        "flops_per_token": plain_flops_per_token(shape, seq_len),
        "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
    }


def run_project(
    name: str,
    seq_len: int,
    rows: int,
    accum: int,
    recompute: str,
    device_name: str,
    updates: int,
    warmup: int,
) -> dict:
    """A project preset through `nsconsole bench`'s own path."""
    from engine.ops.bench import bench_shape

    result = bench_shape(
        name, seq_len, rows, accum, device=device_name, updates=updates, warmup=warmup, recompute=recompute
    )
    return {
        "parameters": result.parameters,
        "tokens_per_s": result.tokens_per_s,
        "flops_per_token": result.flops_per_token,
        "peak_mem_gib": result.peak_memory_gib,
        "engine": result.engine,
    }


def child(job: dict) -> int:
    """Run one job in this (fresh) process and print its JSON line."""
    from engine.errors import is_out_of_memory

    try:
        if job.get("attention") == "cudnn":
            import torch

            # SDPA tries FlashAttention-2 first; with it and the memory-efficient kernel off, the
            # causal attention of plain-gpt and transformer-* runs cuDNN's fused kernel.
            torch.backends.cuda.enable_flash_sdp(False)
            torch.backends.cuda.enable_mem_efficient_sdp(False)
            torch.backends.cuda.enable_cudnn_sdp(True)
        if job["kind"] == "ceiling":
            import torch

            from engine.ops.bench import measure_matmul_tflops
            from engine.training.trainer import resolve_device

            device = resolve_device(job["device"], "gpu_peers: --device")
            name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
            row: dict[str, Any] = {"matmul_tflops": measure_matmul_tflops(device), "device": name}
        elif job["model"] in PLAIN_SHAPES:
            row = run_plain(job["model"], job["seq_len"], job["rows"], job["accum"], job["device"],
                            job["updates"], job["warmup"])  # fmt: skip
        else:
            row = run_project(job["model"], job["seq_len"], job["rows"], job["accum"], job["recompute"],
                              job["device"], job["updates"], job["warmup"])  # fmt: skip
    except RuntimeError as error:  # torch.OutOfMemoryError is one
        if not is_out_of_memory(error):
            raise
        row = {"error": "out of memory"}
    print(json.dumps(row), flush=True)
    return 0


# -- the parent: jobs, children, ratios ------------------------------------------------------------


def shape_of(model: str, seq_len: int, args: argparse.Namespace) -> tuple[int, int, str]:
    """(rows, accum, recompute) of a model at a length: the table, then the command line's."""
    from engine.models.presets import family_of

    rows, accum, recompute = SHAPES.get((model, seq_len), (max(1, TOKENS_PER_UPDATE // seq_len), 1, "none"))
    if args.recompute and model not in PLAIN_SHAPES and family_of(model) == "ns":
        recompute = args.recompute  # the only family with activation recomputation
    return (args.rows or rows, args.accum or accum, recompute)


def run_child(job: dict, timeout: float) -> tuple[dict, float]:
    """The child's JSON row (or an `error` row) and its wall time."""
    started = time.perf_counter()
    command = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(job)]
    try:
        done = subprocess.run(command, cwd=ROOT, stdout=subprocess.PIPE, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}, time.perf_counter() - started
    seconds = time.perf_counter() - started
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"error": f"child exited with status {done.returncode} (its stderr above)"}, seconds
    return json.loads(lines[-1]), seconds


def measure_order(models: list[str]) -> list[str]:
    """Plain GPTs first, then the transformers, then the rest (a peer before the models it rates)."""

    def rank(model: str) -> int:
        return 0 if model in PLAIN_SHAPES else 1 if model.startswith("transformer") else 2

    return sorted(models, key=rank)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return None if numerator is None or not denominator else numerator / denominator


def check_models(models: list[str]) -> None:
    from engine.errors import ConfigError
    from engine.models.presets import preset_names

    known = set(PLAIN_SHAPES) | set(preset_names())
    unknown = [model for model in models if model not in known]
    if unknown:
        raise ConfigError(
            f"gpu_peers: --models: unknown model {unknown[0]!r} (known: {', '.join(sorted(known))})"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS), help="comma-separated")
    parser.add_argument("--seq-lens", default=",".join(map(str, DEFAULT_SEQ_LENS)), help="comma-separated")
    parser.add_argument("--updates", type=int, default=10, help="timed updates per model, after the warm-up")
    parser.add_argument("--warmup", type=int, default=2, help="untimed updates first (compilation, capture)")
    parser.add_argument("--rows", type=int, help="rows per micro-batch for every model (default: SHAPES)")
    parser.add_argument(
        "--accum", type=int, help="micro-batches per update for every model (default: SHAPES)"
    )
    parser.add_argument("--recompute", help="recomputation for every NS model (default: SHAPES)")
    parser.add_argument("--attention", choices=("default", "cudnn"), default="default",
                        help="SDPA's kernel for plain-gpt and transformer-*: its default order, or cuDNN's")
    parser.add_argument("--device", default="auto", help="auto, cuda, cuda:N or cpu")
    parser.add_argument("--yardstick", default=PLAIN, help="the plain GPT ratio_to_plain_gpt divides by")
    parser.add_argument("--child-timeout", type=float, default=300.0, help="seconds before a child is killed")
    parser.add_argument("--out", type=Path, help="append the JSON rows to this file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(json.loads(args.child))

    from engine.errors import ConfigError

    models = measure_order([name for name in args.models.split(",") if name])
    try:
        check_models(models)
        seq_lens = [int(value) for value in args.seq_lens.split(",") if value]
    except (ConfigError, ValueError) as error:
        parser.error(str(error))
    if args.yardstick not in PLAIN_SHAPES:
        parser.error(f"--yardstick: {args.yardstick!r} is not a plain GPT (known: {', '.join(PLAIN_SHAPES)})")
    if args.updates < 1 or args.warmup < 0 or any(length < 1 for length in seq_lens):
        parser.error("--updates must be at least 1, --warmup at least 0, every --seq-lens entry positive")

    started = time.perf_counter()
    ceiling, seconds = run_child({"kind": "ceiling", "device": args.device}, args.child_timeout)
    if "error" in ceiling:
        progress(f"matmul ceiling: {ceiling['error']}")
        return 1
    tflops = ceiling["matmul_tflops"]
    progress(f"matmul ceiling on {ceiling['device']}: {tflops:.4g} TFLOP/s ({seconds:.0f} s)")
    out = args.out.open("a") if args.out else None
    jobs = [(seq_len, model) for seq_len in seq_lens for model in models]
    speeds: dict[tuple[str, int], float | None] = {}
    for index, (seq_len, model) in enumerate(jobs, 1):
        rows, accum, recompute = shape_of(model, seq_len, args)
        progress(
            f"{index}/{len(jobs)} {model} at {seq_len}: {rows} x {accum} rows, recompute {recompute} ..."
        )
        job = {"kind": "model", "model": model, "seq_len": seq_len, "rows": rows, "accum": accum,
               "recompute": recompute, "device": args.device, "updates": args.updates, "warmup": args.warmup,
               "attention": args.attention}  # fmt: skip
        result, seconds = run_child(job, args.child_timeout)
        speed = result.get("tokens_per_s")
        speeds[(model, seq_len)] = speed
        peer = PEERS.get(model)
        flops = result.get("flops_per_token")
        row = {
            "model": model,
            "seq_len": seq_len,
            "rows": rows,
            "accum": accum,
            "recompute": recompute,
            "attention": args.attention,
            "tokens_per_s": speed,
            "mfu": None if speed is None or flops is None else flops * speed / (tflops * 1e12),
            "peak_mem_gib": result.get("peak_mem_gib"),
            "flops_per_token": flops,
            "parameters": result.get("parameters"),
            "matmul_tflops": tflops,
            "device": ceiling["device"],
            "peer": peer,
            "ratio_to_plain_gpt": ratio(speed, speeds.get((args.yardstick, seq_len))),
            "ratio_to_peer": ratio(speed, speeds.get((peer, seq_len))) if peer else None,
            "seconds": round(seconds, 1),
            "error": result.get("error"),
        }
        emit(row, out)
        summary = (
            f"{speed:,.0f} tok/s, MFU {row['mfu']:.3f}" if speed is not None else f"no figure: {row['error']}"
        )
        progress(f"{index}/{len(jobs)} {model} at {seq_len}: {summary} ({seconds:.0f} s)")
    if out is not None:
        out.close()
    progress(f"done in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
