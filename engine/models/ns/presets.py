"""The NS presets and recomputation choices (no torch: run.json is checked against them by light tools)."""

from __future__ import annotations

from engine.models.ns.config import NSConfig

RECOMPUTE_CHOICES = ("none", "all", "dendritic", "hippocampal")


PRESETS: dict[str, NSConfig] = {
    # CPU-sized: tests and the embedded demo line.
    "ns-tiny": NSConfig(),
    # Small, 32K longest context: long-row probes on one GPU.
    "tiny-32k": NSConfig(
        vocab_size=32768,
        d_model=256,
        n_layers=8,
        dendritic_heads=8,
        dendritic_head_dim=32,
        dendritic_state=32,
        attn_heads=4,
        attn_head_dim=64,
        rope_base=500_000.0,
        rope_max_seq_len=32768,
        ffn_dim=768,
    ),
    "ns-1p3b": NSConfig(
        vocab_size=65536,
        d_model=2048,
        n_layers=48,
        dendritic_heads=32,
        dendritic_head_dim=64,
        dendritic_state=64,
        attn_heads=16,
        attn_head_dim=128,
        rope_base=500_000.0,
        rope_max_seq_len=32768,
        ffn_dim=6144,
    ),
    "ns-2b": NSConfig(
        vocab_size=65536,
        d_model=2560,
        n_layers=48,
        dendritic_heads=40,
        dendritic_head_dim=64,
        dendritic_state=64,
        attn_heads=20,
        attn_head_dim=128,
        rope_base=500_000.0,
        rope_max_seq_len=32768,
        ffn_dim=7680,
    ),
}
