"""GPUs: NVML readings, the per-GPU lease, and sharing a GPU with other processes."""
