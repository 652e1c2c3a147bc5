"""NS probes on hand-built traces with known answers, and on a real model's rows."""

from __future__ import annotations

import math

import pytest
import torch

from engine.models.ns.dendritic import DendriticTrace
from engine.models.ns.hippocampal import HippocampalTrace
from engine.models.ns.model import NSLM, NSConfig
from engine.models.ns.probes import DendriticProbe, HippocampalProbe, boundary_mask

EOS = 2


def dendritic_readings(dt, A, tokens, spikes=None, train_len=None):
    opens, both = boundary_mask(tokens, EOS)
    probe = DendriticProbe(opens, both, train_len or tokens.shape[1])
    spikes = torch.zeros(*dt.shape[:2], 4) if spikes is None else spikes
    probe.add("layer00", DendriticTrace(dt=dt, A=A, soma_spikes=spikes))
    return probe.results()


def test_boundaries_are_an_eos_followed_by_a_token_of_the_row():
    tokens = torch.tensor([[5, EOS, EOS, 7, EOS], [EOS, 1, 1, 1, 1]])
    opens, both = boundary_mask(tokens, EOS)
    assert opens.tolist() == [[False, True, True, False, False], [True, False, False, False, False]]
    assert both.tolist() == [[False, True, True, True, False], [True, True, False, False, False]]


def test_heads_with_known_decay_and_step_give_known_retention_and_tau():
    A = torch.tensor([-1.0, -0.01, -1e-5])
    dt = torch.full((2, 8, 3), 0.5)
    spikes = torch.zeros(2, 8, 4)
    spikes[0, :2] = 1.0  # 8 of 64 spike slots
    out = dendritic_readings(dt, A, torch.ones(2, 8, dtype=torch.long), spikes)
    expected_retention = [math.exp(-4.0), math.exp(-0.04), math.exp(-4e-5)]
    for prefix in ("dendritic/", "dendritic/layer00/"):
        assert out[f"{prefix}retention_p50"] == pytest.approx(expected_retention[1])
        assert out[f"{prefix}retention_max"] == pytest.approx(expected_retention[2])
        assert out[f"{prefix}retention_frac_gt_0.9"] == pytest.approx(2 / 3)
        assert out[f"{prefix}retention_frac_gt_0.5"] == pytest.approx(2 / 3)
        # Over 32768 tokens at step 0.5: exp(-0.16) for the slowest head, ~0 for the others.
        assert out[f"{prefix}retention32k_frac_gt_0.5"] == pytest.approx(1 / 3)
        assert out[f"{prefix}tau_p50"] == pytest.approx(200.0)
        assert out[f"{prefix}tau_p90"] == pytest.approx(200.0 + 0.8 * (200_000.0 - 200.0))
        assert out[f"{prefix}tau_max"] == pytest.approx(200_000.0)
        assert out[f"{prefix}firing"] == pytest.approx(0.125)
        assert out[f"{prefix}boundaries"] == 0
        assert f"{prefix}boundary_retention_p50" not in out


def test_a_head_that_steps_up_at_boundaries_shows_in_the_boundary_probes():
    A = torch.tensor([-1.0, -0.1])
    tokens = torch.ones(2, 8, dtype=torch.long)
    tokens[0, 2] = tokens[0, 7] = tokens[1, 4] = EOS  # (0, 7) ends the row: not a boundary
    dt = torch.full((2, 8, 2), 0.5)
    for row, position in ((0, 2), (0, 3), (1, 4), (1, 5)):
        dt[row, position] = 2.0
    out = dendritic_readings(dt, A, tokens)
    assert out["dendritic/boundaries"] == 2
    assert out["dendritic/boundary_retention_p50"] == pytest.approx((math.exp(-4.0) + math.exp(-0.4)) / 2)
    assert out["dendritic/boundary_retention_max"] == pytest.approx(math.exp(-0.4))
    assert out["dendritic/boundary_step_ratio_p50"] == pytest.approx(4.0)
    assert out["dendritic/boundary_step_ratio_max"] == pytest.approx(4.0)


def test_long_rows_report_retention_and_firing_by_segment():
    A = torch.tensor([-0.1, -0.01])
    dt = torch.ones(1, 12, 2)
    spikes = torch.zeros(1, 12, 4)
    spikes[0, 4:8] = 1.0
    out = dendritic_readings(dt, A, torch.ones(1, 12, dtype=torch.long), spikes, train_len=4)
    for segment in range(3):
        tokens_so_far = 4 * (segment + 1)
        assert out[f"dendritic/retention_seg{segment}_max"] == pytest.approx(math.exp(-0.01 * tokens_so_far))
        assert out[f"dendritic/retention_seg{segment}_p50"] == pytest.approx(
            (math.exp(-0.1 * tokens_so_far) + math.exp(-0.01 * tokens_so_far)) / 2
        )
    assert [out[f"dendritic/firing_seg{k}"] for k in range(3)] == [0.0, 1.0, 0.0]


def hippocampal_trace(q, k, log_tag, clock_step, rate, length, heads=2):
    spikes = torch.zeros(1, length, heads)
    return HippocampalTrace(
        q=q, k=k, clock=clock_step.cumsum(-1), clock_step=clock_step, rate=rate, log_tag=log_tag,
        gate_spikes=spikes, ffn_gate_spikes=torch.ones(1, length, 3), ffn_up_spikes=torch.zeros(1, length, 3),
    )  # fmt: skip


def hippocampal_readings(trace, tokens, train_len, inv_freq=None):
    opens, both = boundary_mask(tokens, EOS)
    inv_freq = torch.tensor([1.0, 0.1]) if inv_freq is None else inv_freq
    probe = HippocampalProbe(both, train_len, inv_freq, bool(opens.any()))
    probe.add("layer03", trace)
    return probe.results()


def test_uniform_reads_give_known_distance_bins_and_entropy():
    length = 4
    zeros = torch.zeros(1, 2, length, 4)
    trace = hippocampal_trace(zeros, zeros, torch.zeros(1, 2, length), torch.ones(1, 2, length),
                              torch.zeros(2), length)  # fmt: skip
    out = hippocampal_readings(trace, torch.ones(1, length, dtype=torch.long), train_len=4)
    # Query t reads its t + 1 keys with weight 1 / (t + 1) each.
    assert out["hippocampal/attn_dist_bin0"] == pytest.approx((1 + 1 / 2 + 1 / 3 + 1 / 4) / 4)
    assert out["hippocampal/attn_dist_bin1"] == pytest.approx((1 / 2 + 1 / 3 + 1 / 4) / 4)
    assert out["hippocampal/attn_dist_bin2"] == pytest.approx((1 / 3 + 2 / 4) / 4)
    assert out["hippocampal/layer03/attn_entropy_head0"] == pytest.approx(
        sum(math.log(t + 1) for t in range(4)) / 4
    )
    assert out["hippocampal/attn_beyond_train_max"] == 0.0
    assert out["hippocampal/ffn_gate_firing"] == 1.0 and out["hippocampal/ffn_up_firing"] == 0.0


def test_attention_probes_equal_a_naive_computation_of_the_read():
    generator = torch.Generator().manual_seed(0)
    length, train_len, heads, head_dim = 9, 4, 2, 4
    q, k = (torch.randn(1, heads, length, head_dim, generator=generator) for _ in range(2))
    log_tag = torch.nn.functional.logsigmoid(torch.randn(1, heads, length, generator=generator))
    step = torch.rand(1, heads, length, generator=generator) + 0.5
    rate = torch.tensor([0.3, 0.02])
    trace = hippocampal_trace(q, k, log_tag, step, rate, length)
    out = hippocampal_readings(trace, torch.ones(1, length, dtype=torch.long), train_len)
    clock = step.cumsum(-1)
    bins, beyond, mean_log2, entropy = [0.0] * 5, [0.0] * heads, [0.0] * heads, [0.0] * heads
    queries = range(length - train_len, length)
    for h in range(heads):
        for t in queries:
            scores = [float(q[0, h, t] @ k[0, h, s]) / 2 + float(log_tag[0, h, s])
                      - float(rate[h] * (clock[0, h, t] - clock[0, h, s])) for s in range(t + 1)]  # fmt: skip
            weights = torch.softmax(torch.tensor(scores, dtype=torch.float64), 0).tolist()
            for s, w in enumerate(weights):
                distance = t - s
                bins[distance.bit_length()] += w / (len(queries) * heads)
                beyond[h] += w * (distance >= train_len) / len(queries)
                mean_log2[h] += w * math.log2(1 + distance) / len(queries)
                entropy[h] -= w * math.log(w) / len(queries)
    for b, expected in enumerate(bins):
        assert out[f"hippocampal/attn_dist_bin{b}"] == pytest.approx(expected, abs=1e-6)
    for h in range(heads):
        assert out[f"hippocampal/layer03/attn_beyond_train_head{h}"] == pytest.approx(beyond[h], abs=1e-6)
        assert out[f"hippocampal/layer03/attn_mean_log2_head{h}"] == pytest.approx(mean_log2[h], abs=1e-6)
        assert out[f"hippocampal/layer03/attn_entropy_head{h}"] == pytest.approx(entropy[h], abs=1e-6)
    assert out["hippocampal/attn_beyond_train_max"] == pytest.approx(max(beyond), abs=1e-6)
    assert max(beyond) > 0


def test_clock_tau_write_tags_and_boundary_steps():
    length = 6
    tokens = torch.ones(1, length, dtype=torch.long)
    tokens[0, 2] = EOS
    step = torch.ones(1, 2, length)
    step[:, 1, 2:4] = 5.0  # head 1 jumps its clock at the boundary (tokens 2 and 3)
    log_tag = torch.log(torch.tensor([0.2, 0.6])).view(1, 2, 1).expand(1, 2, length)
    zeros = torch.zeros(1, 2, length, 4)
    trace = hippocampal_trace(zeros, zeros, log_tag, step, torch.tensor([0.25, 0.5]), length)
    out = hippocampal_readings(trace, tokens, train_len=length)
    assert out["hippocampal/layer03/clock_tau_head0"] == pytest.approx(4.0)  # 1 / (0.25 * 1)
    assert out["hippocampal/layer03/clock_tau_head1"] == pytest.approx(1 / (0.5 * 14 / 6))
    assert out["hippocampal/clock_tau_max"] == pytest.approx(4.0)
    assert out["hippocampal/layer03/write_head1"] == pytest.approx(0.6)
    assert out["hippocampal/write_p50"] == pytest.approx(0.4)
    assert out["hippocampal/clock_boundary_step_ratio"] == pytest.approx((1.0 + 5.0) / 2)


def test_rope_extension_shares_count_the_pairs_slower_than_the_training_length():
    # head_dim 8: pairs (i, i + 4) turn by 1, 0.1, 0.01, 0.001 per token; wavelengths 6.3, 63,
    # 628, 6283 tokens; at training length 100 the last two pairs are "extended".
    inv_freq = torch.tensor([1.0, 0.1, 0.01, 0.001])
    length = 3
    q = torch.zeros(1, 2, length, 8)
    q[:, 0, :, 0] = 1.0  # head 0: all energy in pair 0
    q[:, 1, :, 3] = q[:, 1, :, 7] = 1.0  # head 1: all in pair 3
    k = torch.ones(1, 2, length, 8)  # every pair alike
    trace = hippocampal_trace(q, k, torch.zeros(1, 2, length), torch.ones(1, 2, length), torch.zeros(2), length)
    out = hippocampal_readings(trace, torch.ones(1, length, dtype=torch.long), 100, inv_freq)
    assert out["hippocampal/rope_ext_pairs_frac"] == 0.5
    assert out["hippocampal/layer03/rope_ext_q_head0"] == 0.0
    assert out["hippocampal/layer03/rope_ext_q_head1"] == 1.0
    assert out["hippocampal/rope_ext_k_p50"] == pytest.approx(0.5)


MICRO = NSConfig(
    vocab_size=13, eos_id=EOS, d_model=8, n_layers=4, dendritic_heads=2, dendritic_head_dim=3,
    dendritic_state=2, chunk_len=4, attn_heads=2, attn_head_dim=4, ffn_dim=6,
)  # fmt: skip


def test_model_probes_read_every_layer_and_change_nothing():
    torch.manual_seed(0)
    model = NSLM(MICRO)
    before = {name: p.clone() for name, p in model.state_dict().items()}
    tokens = torch.randint(3, MICRO.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    tokens[0, 5] = tokens[1, 17] = EOS
    out = model.probes(tokens, tokens, EOS, train_len=8)
    assert all(math.isfinite(value) for value in out.values())
    assert out["dendritic/boundaries"] == 2
    for name in ("retention_p50", "tau_p90", "firing", "boundary_step_ratio_max", "retention_seg2_p50"):
        assert f"dendritic/{name}" in out and f"dendritic/layer02/{name}" in out
    for name in ("clock_tau_head1", "write_head0", "rope_ext_q_head0", "attn_entropy_head1", "gate_firing"):
        assert f"hippocampal/layer03/{name}" in out
    for name in ("clock_tau_p50", "clock_boundary_step_ratio", "write_max", "ffn_up_firing",
                 "rope_ext_pairs_frac", "attn_dist_bin5", "attn_beyond_train_p50", "attn_mean_log2_max"):  # fmt: skip
        assert f"hippocampal/{name}" in out
    assert "hippocampal/attn_dist_bin6" not in out  # distances up to 23 need bins 0..5
    assert out["hippocampal/attn_beyond_train_max"] > 0
    assert model.probes(tokens, tokens, EOS)["hippocampal/attn_beyond_train_max"] == 0.0
    assert all(torch.equal(before[name], value) for name, value in model.state_dict().items())
