"""Every command's parser is made here, so that each `--help` has a description and examples.

The description and examples are written as they should read (paragraphs, aligned lists): the
formatter keeps their line breaks.
"""

from __future__ import annotations

import argparse


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
