"""Helpers shared by the tests: tiny real data lines and training lines, supervisors, fakes."""

from __future__ import annotations

from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[2]
"""The repository's root (the tests run its code, not an installed copy)."""
