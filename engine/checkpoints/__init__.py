"""Checkpoints: the torch-free format (names, latest, listing, verification,
retention) and the tensor snapshot, writer and loader."""
