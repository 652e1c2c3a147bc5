"""The PSSA models."""
