"""`python -m nsconsole.start_checks LINE`: the refusals `nsconsole run LINE` makes before it starts a
line's supervisor, and nothing else: exit 0 when it would start, 2 and one line on stderr when not.

The console's `R` runs it before it starts a supervisor, so that `R` refuses what `nsconsole run`
and `nsconsole resume` refuse. Without it, `R` on a line that another line's start had made
unstartable (its data line trained by that other line, on a host running many lines) started a
supervisor anyway: it ran the data line's preparer, its trainer was refused, and the line failed
again. The start checks size the line's model with torch, so they run in a process of their own:
the console does not load torch for a key.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

REFUSED = 2


def start_refusal(line: Path) -> str | None:
    """Why `nsconsole run LINE` would refuse to start the line (its one line, without the `nsconsole: `
    prefix), or None when it would start it. Blocks for the seconds the checks take."""
    done = subprocess.run([sys.executable, "-m", __name__, str(line)], capture_output=True, text=True, check=False)
    if done.returncode == 0:
        return None
    lines = done.stderr.strip().splitlines()
    message = lines[-1] if lines else f"the start checks exited with status {done.returncode}"
    return message.removeprefix("nsconsole: ")


def main(argv: Sequence[str] | None = None) -> int:
    from nsconsole.cli import user_errors
    from nsconsole.commands.run import refuse_a_bad_start

    parser = argparse.ArgumentParser(prog=f"python -m {__name__}")
    parser.add_argument("line", type=Path)
    line = parser.parse_args(argv).line
    try:
        refuse_a_bad_start(line, check_start=True, again=f"nsconsole run {line}")
    except Exception as error:
        if not isinstance(error, user_errors()):
            raise
        print(f"nsconsole: {error}", file=sys.stderr)
        return REFUSED
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
