"""Every command's parser is made here, so that each `--help` has a description and examples.

The description and examples are written as they should read (paragraphs, aligned lists): the
formatter keeps their line breaks.
"""

from __future__ import annotations

import argparse
import math


def add_command(
    subparsers: argparse._SubParsersAction, name: str, *, summary: str, description: str, examples: str
) -> argparse.ArgumentParser:
    """A command's parser: `summary` is its line in the parent's --help; its own --help shows
    `description` and then `examples` (text starting `examples:`, one indented command a line)."""
    return subparsers.add_parser(
        name,
        help=summary,
        description=description,
        epilog=examples,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def non_negative_int(text: str) -> int:
    """An argparse type: a whole number of at least 0 (an update, a cycle)."""
    return _whole_number(text, 0)


def positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1 (a count of tokens, of rows)."""
    return _whole_number(text, 1)


def _whole_number(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
    return value


def gib_amount(text: str) -> float:
    """An argparse type: a finite number of GiB, 0 or more (a disk reserve)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of GiB: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of GiB >= 0, got {text}")
    return value


SEED_LIMIT = 2**32
"""Seeds run from 0 to SEED_LIMIT - 1: what numpy's generator takes (`eval` seeds it with the
harness), so `sample`, `chat` and `eval` accept one range."""
SEED_RANGE = f"0 to {SEED_LIMIT - 1:,} (2**32 - 1)"


def seed(text: str) -> int:
    """An argparse type: a seed in SEED_RANGE (a larger one fails deep in torch or numpy)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if not 0 <= value < SEED_LIMIT:
        raise argparse.ArgumentTypeError(f"must be {SEED_RANGE}, got {value}")
    return value
