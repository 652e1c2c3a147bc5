"""The shape and initial state of an NS (spiking state-space) model: one dataclass, every field documented."""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import ConfigError


@dataclass(frozen=True)
class NSConfig:
    """Shape of an NS preset; every field can be overridden from run.json's `model.overrides`."""

    vocab_size: int = 8192
    """Tokenizer vocabulary size (rows of the embedding, which the output head reuses)."""
    eos_id: int = 0
    """The tokenizer's end-of-document token: the hippocampal pool clocks may jump there.
    The trainer sets it from the data line's `eos_id`."""
    d_model: int = 64
    """Residual stream width D."""
    n_layers: int = 4
    """Number of layers; every `hippocampal_every`-th is hippocampal, the others dendritic."""
    hippocampal_every: int = 4
    """Layer i (from 0) is hippocampal when (i + 1) is a multiple of this; 0 makes every layer dendritic."""

    # Dendritic layers: H heads of width P, each with N compartments (a selective SSM with a
    # scalar decay per head, computed as a chunked scan of matrix products).
    dendritic_heads: int = 4
    """Heads H of a dendritic layer."""
    dendritic_head_dim: int = 16
    """Channels P per dendritic head; the layer's inner width is H * P."""
    dendritic_state: int = 16
    """Compartments N per head (the state of a head is N x P)."""
    dendritic_groups: int = 1
    """Groups of heads sharing the input and output maps B and C (H must be a multiple)."""
    chunk_len: int = 64
    """Tokens per chunk of the chunked scan (within a chunk: a lower-triangular decay matrix)."""
    compile_scan: bool = True
    """Run the chunked scan through `torch.compile` on CUDA (fused kernels, compiled once per shape
    when a line starts; `engine.models.ns.scan.compiled_chunked_scan`). False runs it eagerly there
    too. On a CPU it always runs eagerly."""
    scan_kernel: bool = True
    """Run the chunked scan through the fused Triton kernels on CUDA (`kernels.ssd_scan`: chunk-parallel,
    three launches forward, four backward, no (L x L) tensor in memory; 4.22 against compile_scan's
    5.59 ms forward + backward on the H200 at ns-2b's shape, bench/RESULTS.md). False leaves the choice to
    `compile_scan`, as does a `chunk_len` the kernels do not take (not a power of two of at least 16)."""
    compile_glue: bool = True
    """Run the layers' elementwise work between the matrix products and the kernels (norms, steps,
    the skip path, gating, RoPE, pool clocks and tags, centred residual adds) through `torch.compile`
    on CUDA, a few fused kernels per layer instead of dozens (`engine.models.ns.glue`; compiled once
    per shape when a line starts). False runs it eagerly there too. The CPU and the no-grad forwards
    (validation, probes, decoding) always run it eagerly."""
    dt_init_min: float = 1e-3
    """Smallest initial step dt of a head (steps are log-spaced over the heads)."""
    dt_init_max: float = 1e-1
    """Largest initial step dt of a head."""
    a_init_min: float = 1.0
    """Smallest initial decay rate -A of a head (rates are log-spaced over the heads)."""
    a_init_max: float = 16.0
    """Largest initial decay rate -A of a head."""

    # Hippocampal layers: a pool read (attention with RoPE, pool clocks and write tags), then a
    # spiking feed-forward block.
    attn_heads: int = 2
    """Heads of a hippocampal pool read."""
    attn_head_dim: int = 32
    """Width of a pool-read head's query, key and value (even, for RoPE)."""
    rope_base: float = 10_000.0
    """Base of the rotary frequencies of q and k."""
    rope_max_seq_len: int = 512
    """The longest row the model is meant to read (its `longest_context`)."""
    clock_rate_min: float = 2.0**-10
    """Smallest initial clock rate lambda_h (rates are log-spaced over the heads, like ALiBi slopes)."""
    clock_rate_max: float = 0.5
    """Largest initial clock rate lambda_h."""
    ffn_dim: int = 128
    """Hidden width F of the spiking feed-forward block."""

    # Neurons (PLIF: V = beta V + (1 - beta) x, spike H(V - V_th), soft reset).
    beta_max: float = 0.99
    """Upper bound of every neuron's leak beta (1.0 would stop the leak once rounded to bf16)."""
    surrogate_alpha: float = 4.0
    """Steepness alpha of the sigmoid surrogate gradient of the spikes."""
    threshold_init: float = 1.0
    """Initial firing threshold V_th of every neuron, in units of the neurons' initial input scale
    init_std * sqrt(d_model) (the spread of a linear map of a normalised stream), so that every
    preset starts with neurons that fire sometimes."""
    neuron_tau_min: float = 1.0
    """Shortest initial membrane time constant (tokens); beta = exp(-1 / tau), log-spaced over channels."""
    neuron_tau_max: float = 16.0
    """Longest initial membrane time constant (tokens)."""

    norm_eps: float = 1e-6
    """Epsilon of the RMSNorms."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of matrices and the embedding."""

    @property
    def dendritic_width(self) -> int:
        """Inner width H * P of a dendritic layer (the soma's channels)."""
        return self.dendritic_heads * self.dendritic_head_dim

    @property
    def initial_threshold(self) -> float:
        """The neurons' initial firing threshold V_th (see `threshold_init`)."""
        return self.threshold_init * self.init_std * self.d_model**0.5

    @property
    def attn_width(self) -> int:
        """Width of a hippocampal layer's q, k and v."""
        return self.attn_heads * self.attn_head_dim

    def is_hippocampal(self, layer: int) -> bool:
        """Whether layer `layer` (from 0) is a hippocampal layer."""
        return self.hippocampal_every > 0 and (layer + 1) % self.hippocampal_every == 0

    def validate(self) -> None:
        """Raise ConfigError naming the first field the model cannot be built with."""
        positive = (
            "vocab_size", "d_model", "n_layers", "dendritic_heads", "dendritic_head_dim",
            "dendritic_state", "dendritic_groups", "chunk_len", "attn_heads", "attn_head_dim",
            "rope_max_seq_len", "ffn_dim", "dt_init_min", "dt_init_max", "a_init_min", "a_init_max",
            "clock_rate_min", "clock_rate_max", "surrogate_alpha", "threshold_init",
            "neuron_tau_min", "neuron_tau_max", "norm_eps", "init_std",
        )  # fmt: skip
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"model.overrides: {name} must be positive, got {getattr(self, name)}")
        if not isinstance(self.scan_kernel, bool):
            raise ConfigError(f"model.overrides: scan_kernel must be true or false, got {self.scan_kernel!r}")
        if not isinstance(self.compile_glue, bool):
            raise ConfigError(f"model.overrides: compile_glue must be true or false, got {self.compile_glue!r}")
        if not isinstance(self.compile_scan, bool):
            raise ConfigError(f"model.overrides: compile_scan must be true or false, got {self.compile_scan!r}")
        if self.hippocampal_every < 0:
            raise ConfigError(
                f"model.overrides: hippocampal_every must be >= 0, got {self.hippocampal_every}"
            )
        if not 0 <= self.eos_id < self.vocab_size:
            raise ConfigError(
                f"model.overrides: eos_id must be in [0, vocab_size={self.vocab_size}), got {self.eos_id}"
            )
        if self.dendritic_heads % self.dendritic_groups:
            raise ConfigError(
                f"model.overrides: dendritic_heads ({self.dendritic_heads}) must be a multiple of "
                f"dendritic_groups ({self.dendritic_groups})"
            )
        if self.attn_head_dim % 2:
            raise ConfigError(f"model.overrides: attn_head_dim must be even (RoPE), got {self.attn_head_dim}")
        if not 0 < self.beta_max < 1:
            raise ConfigError(f"model.overrides: beta_max must be in (0, 1), got {self.beta_max}")
        for low, high in (
            ("dt_init_min", "dt_init_max"),
            ("a_init_min", "a_init_max"),
            ("clock_rate_min", "clock_rate_max"),
            ("neuron_tau_min", "neuron_tau_max"),
        ):
            if getattr(self, low) > getattr(self, high):
                raise ConfigError(
                    f"model.overrides: {low} ({getattr(self, low)}) exceeds {high} ({getattr(self, high)})"
                )
