"""The version of the metric set the trainer computes.

A line records in run.json (`metrics`) the version it was started with, and a trainer whose
`METRICS_VERSION` differs refuses to start it: a line's readings are decided before it starts,
not patched along the way. Bump the version whenever a metric is added, removed, renamed or
computed differently; tests/engine/models/test_metric_names.py fails when the names the tiny
presets write change while the version does not (their recorded list: metric_names.json beside it).

Version 3 (this code) holds version 2's set and bits per byte in every validation:
`val_<L>/bpb/<source>` and `val_<L>/bpb/mix` (engine.training.bits_per_byte), and their twins
`ema/val_<L>/bpb/...` with `ema` set.
With run.json's `dreaming` (PSSA), the row of each dreaming update also carries `dream/sequences`,
`dream/generated_tokens`, `dream/steps`, `dream/kept`, `dream/fresh_loss_before` and
`dream/fresh_loss_after` (engine.training.dreaming). No bump: code before them refused a run.json
with that section, so every configuration it accepted still yields exactly its names.

Version 2 holds version 1's set (below) and:
- per PSSA block, the bank's readings `val_<L>/pssa/block<NN>/{occupancy, confidence_mean,
  confidence_min, age_mean, age_max, writes, overwrites, defended}` (added after version 1 was
  fixed, without a bump);
- the gradient norms (`grad_norm`, `train/grad_norm/...`) summed in float64: a huge but finite
  gradient now reads finite and its update is clipped, where version 1 read Inf (or NaN for the
  layers and groups beside it) and skipped the update.

Version 1 holds:
- every row (rows.jsonl): update, tokens trained, data tokens, stage and sequence length, the
  update's mean loss, learning rate, weight decay, tokens per update, the global gradient norm,
  whether the update was skipped as non-finite, throughput (tokens/s), and the gradient norm of
  every parameter group (`train/grad_norm/<group>`) and every layer (`train/grad_norm/layer<NN>`,
  other parts of the model by name);
- every validation: `val_<L>/<source>`, `/mix` (recipe-weighted) and `/mean` at the training
  length `L`; `val_<L>/docpos/bin<k>` and `docpos/tokens_frac`; the model's own probes
  (`val_<L>/dendritic/...`, `val_<L>/hippocampal/...`, `val_<L>/pssa/...`, as each model's
  `probes()` names them); the optimizer summaries `opt/<group>/{param_norm, m_norm, grad_rms,
  update_norm, update_ratio}` and `opt/layer<NN>/{param_norm, update_norm, update_ratio}`;
  with `ema` set, the same losses of the averaged parameters under `ema/`;
- when the model's longest context exceeds the training length, the long-row probe:
  `val_<P>/<source>`, `/mix`, `/mean`, `val_<P>/pos/seg<k>`, `/pos/last_over_first` and the
  dendritic probe over the long rows.
"""

from __future__ import annotations

METRICS_VERSION = 3


def metrics_mismatch(source: str, recorded: int) -> str:
    """The one-line refusal of a line recorded with another metric set, with the way on."""
    return (
        f"{source}: metrics is version {recorded} but this code computes version {METRICS_VERSION} (a line keeps "
        f"the metric set it started with: run it with the matching code, or set run.json's metrics to "
        f"{METRICS_VERSION} to go on with this code's set from the next update)"
    )
