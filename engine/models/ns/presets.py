"""The NS presets and recomputation choices (no torch: run.json is checked against them by light tools)."""

from __future__ import annotations

from engine.models.ns.config import NSConfig

RECOMPUTE_CHOICES = ("none", "all", "dendritic", "hippocampal")
"""The whole-kind recomputation settings. A layer kind may also be named with a count,
`dendritic:K`: the first K layers of that kind only (see `recomputed_layers`)."""
LAYER_KINDS = ("dendritic", "hippocampal")


def recomputed_layers(setting: str, config: NSConfig) -> frozenset[int]:
    """The layers (indices from 0) that `setting` recomputes whole in the backward.

    `none`, `all`, a layer kind (every layer of it), or `kind:K` (the first K layers of that kind):
    a count between none and the whole kind fills a GPU's memory where the kind would not fit
    unrecomputed and recomputing all of it costs time (ns-2b: 36 dendritic layers, each recomputed
    layer one more forward of its projections). Where in the stack the K layers sit does not
    change the peak: every layer's activations are held when the backward begins.
    Raises ValueError naming the problem."""
    kind, _, count_text = setting.partition(":")
    hippocampal = {index for index in range(config.n_layers) if config.is_hippocampal(index)}
    layers = {
        "none": set(),
        "all": set(range(config.n_layers)),
        "hippocampal": hippocampal,
        "dendritic": set(range(config.n_layers)) - hippocampal,
    }
    if kind not in layers or (count_text and kind not in LAYER_KINDS):
        raise ValueError(
            f"recompute must be one of {', '.join(RECOMPUTE_CHOICES)} or <layer kind>:<count>; got {setting!r}"
        )
    chosen = sorted(layers[kind])
    if count_text:
        if not count_text.isdigit() or not 0 < int(count_text) <= len(chosen):
            raise ValueError(
                f"recompute {setting!r}: the count must be 1..{len(chosen)} (this model's {kind} layers)"
            )
        chosen = chosen[: int(count_text)]
    return frozenset(chosen)


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
