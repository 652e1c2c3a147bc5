"""One module per command; each exposes `register(subparsers)` and sets `func` on its parser.

`func(args) -> int` returns the exit status; user errors are raised as `LineError` or
`DataLineError` and printed by `nsconsole.cli`.
"""

from __future__ import annotations

from nsconsole.commands import (
    bench,
    branch,
    chat,
    check,
    data,
    evaluate,
    new,
    resume,
    rollback,
    run,
    sample,
    status,
    stop,
    tune,
)

COMMAND_MODULES = (
    data, new, tune, check, run, resume, status, stop, branch, rollback, bench, sample, chat, evaluate
)
