"""Evaluating a checkpoint with the lm-evaluation-harness: `harness` (the harness's model interface
over a checkpoint alone, registered as `nsconsole`) and `run` (tasks by name, local task files, the
results table)."""
