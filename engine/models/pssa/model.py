"""PSSA: a continuous diagonal SSM with a Poincare-ball episodic memory (the article in spec/).

One block, for x the RMSNorm (scale and offset) of its input:

    delta = softplus(W_delta x)                     (d)     B = W_B x, C = W_C x   (N)
    h_ij <- exp(delta_i A_ij) h_ij + delta_i B_j x_i        y_i = sum_j C_j h_ij
    q = ball(W_qx x + W_qh y);   m = read(bank, q)          (top-k by hyperbolic distance)
    z = y / sqrt(N) + sigmoid(W_gate x) * (W_proj m) + (U_fast + U_slow) silu(W_down x)
    out = z + W2 silu(W1 z)

with `A = -softplus(A_raw)`. Blocks stack as `u = b0(e)`, `u = u + b_i(u) / sqrt(depth)`; Ouro
loops run the whole stack again with shared weights and bank but each pass its own recurrent
carry, composed as the article's backward describes: pass 0 reads the embeddings, every later
pass adds its output times loop_scale = 1 / loops to the stream (`u = u + stack(u) / loops`),
so the backward walks the passes in reverse order, hands each later pass loop_scale times the
stream's adjoint and adds the adjoint at its input back into the stream's (the residual
adjoint); test_models_pssa_loops.py holds autograd to that recipe computed pass by pass.
Logits are `head(u / sqrt(d))`, without a final norm (the article's model).

The six projections of a block's normed input (delta, B, C, the query's x part, the gate, the
adapter's down map) run as one matrix product. The scan is `pssa.scan` (the Triton kernel on
CUDA, a blocked scan with a hand-written backward on the CPU) and a top-k memory read on the
CPU gathers only the chosen slots (`pssa.read`).

A row of T tokens is processed in pieces of `chunk_len`: the recurrent carry passes exactly
from piece to piece but is detached at each edge (TBPTT), and at each piece's end every block
offers its last token's (query, output) to its bank, gated by the piece's loss (training only).
A training forward does no host read (the write rule is device work: `pssa_memory`), so the
training step can be captured as a CUDA graph.

Decoding carries the SSM state of every block and Ouro pass from token to token (the carry,
O(1) per token) and reads the banks as they stand: the article's inference path reads the memory
and writes nothing, and without writes the chunk edges change nothing in the eval forward (the
carry's value passes exactly), so the decoder need not know where they fall.
"""

from __future__ import annotations

import math
import weakref
from contextlib import ExitStack
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from engine.models.base import IGNORE_INDEX, LanguageModel, ParamGroup, token_losses
from engine.models.common import RMSNorm, stacked_linear
from engine.models.pssa.config import PSSAConfig, changed_state_setting
from engine.models.pssa.dream import DreamCache, DreamReport, dream
from engine.models.pssa.memory import EpisodicBank, PendingDreams, WriteRule, to_poincare_ball, write_banks
from engine.models.pssa.scan import pssa_scan


class _CachedRate(torch.autograd.Function):
    """Returns a precomputed A = -softplus(A_raw); backward multiplies by dA/dA_raw = -sigmoid(A_raw)."""

    @staticmethod
    def forward(ctx: Any, raw: torch.Tensor, rate: torch.Tensor, slope: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(slope)
        return rate.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (slope,) = ctx.saved_tensors
        return grad * slope, None, None


class PSSABlock(nn.Module):
    """One continuous block: SSM, memory read, gate, plastic adapter, MLP (see the module docstring)."""

    def __init__(self, config: PSSAConfig) -> None:
        super().__init__()
        d, n, k, r = config.d_latent, config.d_state, config.d_mem_key, config.adapter_rank
        self.config = config
        self.norm = RMSNorm(d, eps=config.norm_eps, offset=True)
        self.A_raw = nn.Parameter(torch.empty(d, n))
        self.W_delta = nn.Linear(d, d, bias=False)
        self.W_B = nn.Linear(d, n, bias=False)
        self.W_C = nn.Linear(d, n, bias=False)
        self.W_qx = nn.Linear(d, k, bias=False)
        self.W_qh = nn.Linear(d, k, bias=False)
        self.W_gate = nn.Linear(d, d, bias=False)
        self.W_proj = nn.Linear(d, d, bias=False)
        self.adapter_down = nn.Linear(d, r, bias=False)
        self.adapter_up = nn.Linear(r, d, bias=False)
        # The slow adapter weights are not trained by the optimizer: consolidation moves mass
        # into them from adapter_up. Checkpointed through the model's extra state.
        self.register_buffer("consolidated_up", torch.zeros(d, r), persistent=False)
        self.mlp_up = nn.Linear(d, config.mlp_ratio * d, bias=False)
        self.mlp_down = nn.Linear(config.mlp_ratio * d, d, bias=False)
        self.bank = EpisodicBank(
            config.mem_capacity, k, d, WriteRule(loss_threshold=config.write_loss_threshold)
        )
        self.ssm_scale = 1.0 / math.sqrt(n)
        # The projections of the normed input, in the order of `forward`'s split.
        self._input_projections = (self.W_delta, self.W_B, self.W_C, self.W_qx, self.W_gate, self.adapter_down)
        # (weakref to A_raw, its version, its values, A, dA/dA_raw) of the last transform.
        self._rate_cache: tuple[Any, int, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._initialise()

    @torch.no_grad()
    def _initialise(self) -> None:
        config = self.config
        # Time constants log-spaced tau_min..tau_max across the states of every channel:
        # rate 1/tau = softplus(A_raw), so A_raw = log(expm1(1/tau)).
        ratio = torch.linspace(0.0, 1.0, config.d_state, dtype=torch.float64)
        log_min, log_max = math.log(config.tau_min), math.log(config.tau_max)
        tau = torch.exp(log_min + ratio * (log_max - log_min))  # (N,)
        raw = torch.log(torch.expm1(1.0 / tau))
        self.A_raw.copy_(raw.expand(config.d_latent, config.d_state))
        for linear in (self.W_delta, self.W_B, self.W_C, self.W_qx, self.W_qh, self.W_gate, self.W_proj,
                       self.adapter_down, self.mlp_up):  # fmt: skip
            nn.init.xavier_uniform_(linear.weight)
        # Zero-initialised outputs: a new adapter and the MLP branch start as exact no-ops.
        nn.init.zeros_(self.adapter_up.weight)
        nn.init.zeros_(self.mlp_down.weight)

    def rates(self) -> torch.Tensor:
        """A = -softplus(A_raw), (d, N); on the CPU recomputed only when A_raw has changed.

        The version counter alone does not see every change: the flat-buffer optimizer makes
        each parameter a `.data` view of its buffer and writes the buffer, and finite-difference
        checks write through `.data`, neither of which bumps the parameter's version. So the
        cache is valid while the tensor, its version and its values are those of the snapshot
        (the value comparison costs what one elementwise pass over d x N costs). On CUDA that
        comparison would need a host sync, so there the transform is simply recomputed: one
        small elementwise kernel per chunk, and nothing to go stale inside a CUDA graph.
        """
        raw = self.A_raw
        if raw.is_cuda:
            return -F.softplus(raw)
        if not self._rate_cache_valid(raw):
            with torch.no_grad():
                snapshot = raw.detach().clone()
                self._rate_cache = (weakref.ref(raw), raw._version, snapshot, -F.softplus(snapshot),
                                    -torch.sigmoid(snapshot))  # fmt: skip
        _, _, _, rate, slope = self._rate_cache
        if not torch.is_grad_enabled() or not raw.requires_grad:
            return rate
        return _CachedRate.apply(raw, rate, slope)

    def _rate_cache_valid(self, raw: torch.Tensor) -> bool:
        cache = self._rate_cache
        if cache is None or cache[0]() is not raw or cache[1] != raw._version:
            return False
        return torch.equal(cache[2], raw.detach())

    def _apply(self, fn: Any, recurse: bool = True) -> PSSABlock:
        # .to() / .double() give the parameter new storage: start the rate cache afresh.
        self._rate_cache = None
        return super()._apply(fn, recurse)

    def forward(
        self, u: torch.Tensor, h0: torch.Tensor | None, probe: dict[str, list[torch.Tensor]] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, L, d) input, (B, d, N) carry -> (B, L, d) output, (B, d, N) last state, (B, L, Dk) queries.

        probe, when given, collects the per-token delta and the read weights (validation probes).
        """
        config = self.config
        batch, length, width = u.shape
        x = self.norm(u)  # (B, L, d)
        # Every projection of x in one matrix product (one pass over x, one weight gradient).
        delta_raw, B_t, C_t, query_x, gate, down = stacked_linear(x, self._input_projections)
        delta = F.softplus(delta_raw)  # (B, L, d)
        # B_t, C_t (B, L, N): one group shared by every channel.
        y, h_last = pssa_scan(x, delta, self.rates(), B_t, C_t, h0)  # (B, L, d), (B, d, N)
        # The ball map in fp32 at least: under bf16 autocast its radius cap would round to 1.
        query = query_x + self.W_qh(y)  # (B, L, Dk)
        q_ball = to_poincare_ball(query.to(torch.promote_types(query.dtype, torch.float32)))
        flat_q = q_ball.reshape(batch * length, -1)
        m = self.bank.read(flat_q, config.tau_mem, config.mem_top_k).view(batch, length, width)
        # silu of a contiguous copy: on the 16-wide strided slice of `inputs` it and its backward
        # ran PyTorch's slow strided path (about 55 against 15 us, 8 x 64 tokens).
        adapter = F.linear(F.silu(down.contiguous()), self.adapter_up.weight + self.consolidated_up)
        # z = y / sqrt(N) + sigmoid(gate) * (W_proj m) + adapter in three operations, not five.
        z = torch.addcmul(torch.add(adapter, y, alpha=self.ssm_scale), torch.sigmoid(gate), self.W_proj(m))
        out = z + self.mlp_down(F.silu(self.mlp_up(z)))  # (B, L, d)
        if probe is not None:
            probe["delta"].append(delta.detach().reshape(-1, width))
            probe["weights"].append(self.bank.read_weights(flat_q, config.tau_mem, config.mem_top_k))
        return out, h_last, q_ball

    @torch.no_grad()
    def consolidate(self, alpha: float) -> None:
        """Exact transfer of fast adapter weight into the slow copy: their sum is kept."""
        moved = alpha * self.adapter_up.weight
        self.consolidated_up += moved
        self.adapter_up.weight -= moved


class PSSALM(LanguageModel):
    """Embedding, `depth` PSSA blocks looped `loops` times, output head scaled by 1/sqrt(d).

    The memory writes and the dreaming record are device work with no host read, so a training
    forward can be captured in a CUDA graph; consolidation, dreaming and the update clock are set
    outside the captured step.
    """

    def __init__(self, config: PSSAConfig) -> None:
        super().__init__()
        config.validate()
        self.config = config
        self.longest_context = config.chunk_len
        self.embed = nn.Embedding(config.vocab_size, config.d_latent)
        self.blocks = nn.ModuleList(PSSABlock(config) for _ in range(config.depth))
        self.head = nn.Linear(config.d_latent, config.vocab_size, bias=False)
        nn.init.xavier_uniform_(self.head.weight)
        # Optimizer updates done so far: the memory write rule's clock (`set_update`), on the
        # host and as a device buffer the captured write rule reads.
        self.update = 0
        self.register_buffer("update_clock", torch.zeros(1, dtype=torch.int64), persistent=False)
        self._dream_cache = DreamCache(config.mem_capacity, config.chunk_len)
        self.pending_dreams = PendingDreams(
            config.mem_capacity, config.chunk_len, config.write_loss_threshold
        )

    # ----------------------------------------------------------------------------- forward

    @property
    def dream_cache(self) -> DreamCache:
        """The dreaming cache, with the chunks training recorded since its last read moved in
        (a host read: outside the training step)."""
        for tokens, targets in self.pending_dreams.drain():
            self._dream_cache.remember(tokens, targets)
        return self._dream_cache

    def carry_shape(self, batch: int) -> tuple[int, ...]:
        """The carry's shape (loops, depth, B, d, N)."""
        config = self.config
        return (config.loops, config.depth, batch, config.d_latent, config.d_state)

    def initial_carry(self, batch: int) -> torch.Tensor:
        """Zeros of the carry's shape (loops, depth, B, d, N) for fresh rows."""
        dtype = torch.float64 if self.head.weight.dtype == torch.float64 else torch.float32
        return torch.zeros(self.carry_shape(batch), device=self.head.weight.device, dtype=dtype)

    def forward(
        self, tokens: torch.Tensor, targets: torch.Tensor, carry: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T) tokens and targets, carry (loops, depth, B, d, N) or None -> (B, T) loss, carry."""
        batch, length = tokens.shape
        state = self.initial_carry(batch) if carry is None else carry
        expected = self.carry_shape(batch)
        if tuple(state.shape) != expected:
            raise ValueError(f"PSSA carry has shape {tuple(state.shape)}, expected {tuple(expected)}")
        writes = self.training
        losses = []
        with ExitStack() as sessions:
            if writes:
                for block in self.blocks:
                    sessions.enter_context(block.bank.writing())
            for start in range(0, length, self.config.chunk_len):
                piece = slice(start, start + self.config.chunk_len)
                # TBPTT: the carry's value passes exactly, its gradient stops at the chunk edge.
                loss, state, last = self._chunk(tokens[:, piece], targets[:, piece], state.detach())
                if writes:
                    self._write_memories(tokens[:, piece], targets[:, piece], loss.detach(), last)
                losses.append(loss)
        return torch.cat(losses, dim=1), state.detach()

    def hidden(
        self, tokens: torch.Tensor, carry: torch.Tensor, probe: dict[str, list[torch.Tensor]] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """One piece (B, L <= chunk_len): final stream (B, L, d), new carry, and per block the
        last pass's (queries (B, L, Dk), outputs (B, L, d)) for memory writes."""
        config = self.config
        u = self.embed(tokens)  # (B, L, d)
        residual_scale = 1.0 / math.sqrt(config.depth)
        new_carry = []
        last_pass: list[tuple[torch.Tensor, torch.Tensor]] = []
        for loop in range(config.loops):
            stream = u
            pass_carry = []
            last_pass = []
            for index, block in enumerate(self.blocks):
                out, h_last, q_ball = block(stream, carry[loop, index], probe)
                stream = out if index == 0 else stream + residual_scale * out
                pass_carry.append(h_last)
                last_pass.append((q_ball, out))
            u = stream if loop == 0 else u + stream / config.loops
            new_carry.append(torch.stack(pass_carry))
        return u, torch.stack(new_carry), last_pass

    def _chunk(
        self, tokens: torch.Tensor, targets: torch.Tensor, carry: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        u, new_carry, last_pass = self.hidden(tokens, carry)
        return token_losses(self._head_logits(u), targets), new_carry, last_pass

    def _head_logits(self, u: torch.Tensor) -> torch.Tensor:
        """(B, L, d) final stream -> (B, L, V) logits, at least float32."""
        # Scaled before the head: (B, L, d) numbers to scale, not (B, L, V).
        logits = self.head(u * (1.0 / math.sqrt(self.config.d_latent)))
        return logits.to(torch.promote_types(logits.dtype, torch.float32))

    # ---------------------------------------------------------------------------- decoding

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, T) tokens of fresh rows -> (B, T, V) logits, chunk by chunk as `forward` runs them
        (no memory writes)."""
        carry = self.initial_carry(tokens.shape[0])
        pieces = []
        for start in range(0, tokens.shape[1], self.config.chunk_len):
            u, carry, _ = self.hidden(tokens[:, start : start + self.config.chunk_len], carry)
            pieces.append(self._head_logits(u))
        return torch.cat(pieces, dim=1)

    def decode_state(self, batch: int, device: torch.device) -> torch.Tensor:
        """Zeros of the carry's shape (loops, depth, B, d, N) on `device`."""
        return self.initial_carry(batch).to(device)

    def decode(self, tokens: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens through every block and pass from the carry `state` (see the module docstring)."""
        u, carry, _ = self.hidden(tokens, state)
        return self._head_logits(u), carry

    def _write_memories(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor,
        loss: torch.Tensor,
        last_pass: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        """Offer each row's last (query, output) to every block's bank (all banks in one go) and
        record its chunk for dreaming, gated by the row's mean loss: device work only (no host
        read, capturable)."""
        counted = (targets != IGNORE_INDEX).sum(dim=1)  # (B,)
        row_loss = loss.sum(dim=1) / counted.clamp_min(1)
        row_loss = torch.where(counted > 0, row_loss, torch.full_like(row_loss, float("nan")))  # (B,)
        keys = torch.stack([q_ball[:, -1] for q_ball, _ in last_pass])  # (depth, B, Dk)
        values = torch.stack([out[:, -1] for _, out in last_pass])  # (depth, B, d)
        write_banks([block.bank for block in self.blocks], keys, values, row_loss, self.update_clock)
        self.pending_dreams.record(tokens, targets, row_loss)

    # --------------------------------------------------------------------- trainer hooks

    def set_update(self, update: int) -> None:
        """Tell the model how many optimizer updates are done (the memory write rule's clock);
        outside the captured step, which reads the clock from its device buffer."""
        self.update = int(update)
        self.update_clock.fill_(self.update)

    def consolidate(self) -> None:
        """After each pass over the data: `U_slow += a U_fast; U_fast *= 1 - a` in every block."""
        for block in self.blocks:
            block.consolidate(self.config.ema_alpha)

    def on_update(self, update: int) -> None:
        self.set_update(update)

    def on_cycle_end(self, cycle: int) -> None:
        self.consolidate()

    def dream(
        self, fresh_tokens: torch.Tensor, fresh_targets: torch.Tensor, lr: float = 1e-3, steps: int = 1
    ) -> DreamReport:
        """Rehearse the cached high-loss sequences (see `pssa_dream.dream`)."""
        return dream(self, fresh_tokens, fresh_targets, lr=lr, steps=steps)

    def param_groups(self) -> list[ParamGroup]:
        """Matrices and the embedding decay; norms and the SSM rates (A_raw) do not."""
        decay = ParamGroup("decay", weight_decay=True)
        no_decay = ParamGroup("no_decay", weight_decay=False)
        for name, param in self.named_parameters():
            rate_like = param.dim() < 2 or name.endswith("A_raw")
            (no_decay if rate_like else decay).params.append((name, param))
        return [group for group in (decay, no_decay) if group.params]

    def layer_of(self, param_name: str) -> str:
        parts = param_name.split(".")
        if parts[0] == "blocks":
            return f"layer{int(parts[1]):02d}"
        return parts[0]

    def flops_per_token(self, seq_len: int) -> float:
        """Matrices at 6 FLOPs per weight, scan and memory read at 3x their forward FLOPs."""
        config = self.config
        d, n, k, r = config.d_latent, config.d_state, config.d_mem_key, config.adapter_rank
        block_weights = 3 * d * d + 2 * d * n + 2 * d * k + 2 * d * r + 2 * config.mlp_ratio * d * d
        # Scan per token and channel-state: exp(delta A), decay * h + drive, delta B x, C h.
        scan = 8 * d * n
        # Read: distances to every slot (about 3 Dk each), softmax and the weighted sum of values.
        read_slots = config.mem_top_k if config.mem_top_k > 0 else config.mem_capacity
        read = 3 * k * config.mem_capacity + 2 * read_slots * d
        passes = config.depth * config.loops
        return 6.0 * (passes * block_weights + d * config.vocab_size) + 3.0 * passes * (scan + read)

    # ------------------------------------------------------------------------- probes

    @torch.no_grad()
    def probes(self, tokens: torch.Tensor, targets: torch.Tensor, eos_id: int) -> dict[str, float]:
        """Memory occupancy, read entropy and SSM time constants on held-out rows (no writes),
        and per block `pssa/block<NN>/<reading>` of its bank (`EpisodicBank.readings`): occupancy,
        confidence mean/min and age mean/max over the occupied slots at the update clock, and
        the cumulative writes, overwrites and defended writes."""
        probe: dict[str, list[torch.Tensor]] = {"delta": [], "weights": []}
        carry = self.initial_carry(tokens.shape[0])
        step_means = []
        entropies = []
        for start in range(0, tokens.shape[1], self.config.chunk_len):
            _, carry, _ = self.hidden(tokens[:, start : start + self.config.chunk_len], carry, probe)
        blocks = len(self.blocks)
        for index, block in enumerate(self.blocks):
            # Probe lists hold (pass, block) entries in call order: block `index` of every pass.
            deltas = torch.cat(probe["delta"][index::blocks])  # (tokens * passes, d)
            step_means.append((block, deltas.double().mean(dim=0)))
            weights = torch.cat(probe["weights"][index::blocks]).double()  # (tokens * passes, S)
            if block.bank.count:
                plogp = torch.where(weights > 0, weights * weights.clamp_min(1e-300).log(), 0.0)
                entropies.append(-plogp.sum(dim=-1).mean())
        # e-fold length in tokens of channel i, state j at the rows' mean step: 1 / (-A_ij mean delta_i).
        taus = torch.cat(
            [(1 / (F.softplus(block.A_raw.double()) * step[:, None])).flatten() for block, step in step_means]
        )
        occupancy = sum(block.bank.occupancy() for block in self.blocks) / blocks
        readings = {
            "pssa/memory_occupancy": float(occupancy),
            "pssa/read_entropy": float(torch.stack(entropies).mean()) if entropies else 0.0,
            "pssa/ssm_tau_p50": float(taus.median()),
            "pssa/ssm_tau_max": float(taus.max()),
        }
        for index, block in enumerate(self.blocks):
            for name, value in block.bank.readings(self.update).items():
                readings[f"pssa/block{index:02d}/{name}"] = value
        return readings

    # -------------------------------------------------------------------- extra state

    def extra_state_dict(self) -> dict[str, torch.Tensor]:
        """Memory banks, slow adapter weights, the dreaming cache and the update clock."""
        state: dict[str, torch.Tensor] = {"update": torch.tensor(self.update, dtype=torch.int64)}
        for index, block in enumerate(self.blocks):
            prefix = f"blocks.{index}."
            state.update(block.bank.state(prefix + "bank."))
            state[prefix + "consolidated_up"] = block.consolidated_up.detach().cpu().clone()
        state.update(self.dream_cache.state("dream."))
        return state

    def load_extra_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if "update" not in state:
            raise ValueError("PSSA extra state: 'update' is missing")
        self._refuse_changed_memory_settings(state)
        for index, block in enumerate(self.blocks):
            prefix = f"blocks.{index}."
            block.bank.load_state(state, prefix + "bank.")
            slow = state.get(prefix + "consolidated_up")
            if slow is None or slow.shape != block.consolidated_up.shape:
                raise ValueError(f"PSSA extra state: {prefix}consolidated_up is missing or misshapen")
            block.consolidated_up.copy_(slow)
        self.pending_dreams.clear()
        self._dream_cache.load_state(state, "dream.")
        self.set_update(int(state["update"]))

    def _refuse_changed_memory_settings(self, state: dict[str, torch.Tensor]) -> None:
        """ValueError naming the model.overrides setting whose banks or dreaming cache the saved
        state does not fit (`changed_state_setting`), read from the saved tensors' shapes."""
        keys, values = state.get("blocks.0.bank.keys"), state.get("blocks.0.bank.values")
        dreams = state.get("dream.tokens")
        saved = {
            "mem_capacity": None if keys is None else keys.shape[0],
            "d_mem_key": None if keys is None or keys.dim() != 2 else keys.shape[1],
            "d_latent": None if values is None or values.dim() != 2 else values.shape[1],
            "chunk_len": None if dreams is None or dreams.dim() != 2 else dreams.shape[1],
        }
        problem = changed_state_setting(saved, self.config)
        if problem is not None:
            raise ValueError(problem)
