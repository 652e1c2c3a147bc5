"""The version of the metric set the trainer computes.

A line records in run.json (`metrics`) the version it was started with, and a trainer whose
`METRICS_VERSION` differs refuses to start it: a line's readings are decided before it starts,
not patched along the way. Bump the version whenever a metric is added, removed, renamed or
computed differently.

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

METRICS_VERSION = 1
