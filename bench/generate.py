"""Generation speed of every preset with a decoder, beside its transformer peer: tokens/s, ms per 200 tokens.

Each model is built at its preset (random weights: the speed does not depend on them), a prompt
of random tokens is fed in one prefill, and then tokens are drawn one at a time through
`DecodeSession`, the path `nsconsole sample` takes (a host draw per token, bf16 autocast on
CUDA): the recurrent state for PSSA and NS, a KV cache for the transformer. One JSON row per
preset (the median of the timed runs after one warm-up run), then one row per model and its peer
(`transformer-1.5m` for `pssa-1.5m`, the parameter-matched transformer for each NS preset) with the
ratio of their speeds. The PSSA article: 200 tokens in 226 ms on its 1.5M model, 12x its
transformer peer (CPU). Presets over --max-parameters are left out (by default on the CPU: the
1B-scale ones); presets without a decoder yet get a row saying so.

    python bench/generate.py [--device cpu|cuda[:N]] [--tokens 200] [--prompt-tokens 16] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

# The repository root first: run as a script, bench/ would lead sys.path and its kernels.py
# would shadow the kernels package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.generation.session import DecodeSession, generation_precision  # noqa: E402
from engine.generation.settings import SamplingSettings  # noqa: E402
from engine.models.build import build_model  # noqa: E402
from engine.models.presets import preset_names  # noqa: E402
from engine.training.trainer import resolve_device  # noqa: E402

PEERS = {
    "pssa-1.5m": "transformer-1.5m",
    "pssa-tiny": "transformer-tiny",
    "ns-tiny": "transformer-tiny",
    "ns-1p3b": "transformer-1p3b",
    "ns-2b": "transformer-2b",
}
"""Each model's transformer peer (the article's for PSSA, the parameter-matched one for NS)."""

CPU_MAX_PARAMETERS = 200_000_000
"""The CPU's default limit: a 1B-scale preset takes minutes a run there."""

WARMUP_TOKENS = 8
"""Tokens of the untimed first run (kernels compiled, caches allocated)."""


def parameters_of(preset: str) -> int:
    with torch.device("meta"):
        return build_model(preset).num_parameters()


def generate_once(model: Any, device: torch.device, prompt: list[int], tokens: int) -> tuple[float, float]:
    """(prefill seconds, generation seconds) of one prompt and `tokens` greedy draws."""
    session = DecodeSession(model, device, SamplingSettings(temperature=0.0))
    with generation_precision(device):
        started = time.perf_counter()
        session.feed(prompt)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        prefilled = time.perf_counter()
        for _ in session.generate(tokens):
            pass  # each draw reads the logits on the host: the time includes every token's sync
        finished = time.perf_counter()
    return prefilled - started, finished - prefilled


def measure(preset: str, device: torch.device, tokens: int, prompt_tokens: int, runs: int) -> dict[str, Any]:
    torch.manual_seed(0)
    with torch.device(device):
        model = build_model(preset).eval()
    row: dict[str, Any] = {"bench": "generate", "model": preset, "parameters": model.num_parameters()}
    if not model.decodes():
        return row | {"skipped": "no stepwise decoder yet"}
    vocab = model.embed.weight.shape[0]
    prompt = torch.randint(0, vocab, (prompt_tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    generate_once(model, device, prompt, WARMUP_TOKENS)
    timings = [generate_once(model, device, prompt, tokens) for _ in range(runs)]
    generation = statistics.median(seconds for _, seconds in timings)
    return row | {
        "device": str(device),
        "precision": "bf16 autocast" if device.type == "cuda" else "fp32",
        "prompt_tokens": prompt_tokens,
        "tokens": tokens,
        "tokens_per_s": round(tokens / generation, 1),
        "ms_per_200_tokens": round(1e3 * generation * 200 / tokens, 1),
        "prefill_ms": round(1e3 * statistics.median(seconds for seconds, _ in timings), 2),
        "runs": runs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--models", nargs="*", default=None, metavar="PRESET", help="default: every preset")
    parser.add_argument("--tokens", type=int, default=200, help="tokens generated a run")
    parser.add_argument("--prompt-tokens", type=int, default=16, help="tokens of the prompt's prefill")
    parser.add_argument("--runs", type=int, default=3, help="timed runs a model (the median is reported)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--max-parameters", type=float, default=None,
                        help=f"leave out larger presets (default {CPU_MAX_PARAMETERS:.0e} on the CPU, none on CUDA)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device, "--device")
    limit = args.max_parameters or (CPU_MAX_PARAMETERS if device.type == "cpu" else float("inf"))
    machine = {
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine(),
    }
    speeds: dict[str, float] = {}
    for preset in args.models or preset_names():
        parameters = parameters_of(preset)
        if parameters > limit:
            row: dict[str, Any] = {"bench": "generate", "model": preset, "parameters": parameters,
                                   "skipped": f"over --max-parameters {limit:.0e}"}  # fmt: skip
        else:
            row = measure(preset, device, args.tokens, args.prompt_tokens, args.runs) | machine
            if "tokens_per_s" in row:
                speeds[preset] = row["tokens_per_s"]
        print(json.dumps(row), flush=True)
    for model, peer in PEERS.items():
        if model in speeds and peer in speeds:
            print(json.dumps({"bench": "generate_vs_peer", "model": model, "peer": peer, "device": str(device),
                              "tokens_per_s": speeds[model], "peer_tokens_per_s": speeds[peer],
                              "speedup": round(speeds[model] / speeds[peer], 2)}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
