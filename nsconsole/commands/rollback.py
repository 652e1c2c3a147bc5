"""`nsconsole rollback LINE --to UPDATE`: continue a line from an earlier checkpoint, its W&B run rewound."""

from __future__ import annotations

import argparse

from nsconsole.commands.parser import add_command, non_negative_int

HELP = "LINE --to UPDATE: continue a line from an earlier checkpoint, its W&B run rewound"
DESCRIPTION = """\
Make the line continue from checkpoint u<UPDATE> at its next start, its W&B run rewound to that
update where the server can (else a new run backfilled from rows.jsonl, the old run marked
superseded). rows.jsonl is cut back
to that checkpoint after the rows it sets aside are kept in rows.rolledback-<time>.jsonl; the later checkpoints
are removed once the line writes its next checkpoint; data cycles it will read again are
reopened. Refused while the line's trainer is running (stop it first).
"""
EXAMPLES = """\
examples:
  nsconsole rollback runs/trunk --to 30000
  nsconsole run runs/trunk
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(subparsers, "rollback", summary=HELP, description=DESCRIPTION, examples=EXAMPLES)
    parser.add_argument("line", metavar="LINE", help="the training line directory")
    parser.add_argument("--to", type=non_negative_int, required=True, metavar="UPDATE", help="the checkpoint's update")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from engine.ops.lines import open_line
    from engine.ops.rollback import record_rollback_at_rest, rollback_line
    from engine.training.line_lock import held_at_rest

    line = args.host_settings.resolve_line(args.line)
    layout = open_line(line)
    # A running line's rollback goes through its supervisor (the console, or the socket).
    with held_at_rest(layout, "roll it back from the console (r)"):
        result = rollback_line(line, args.to)
        record_rollback_at_rest(layout, result)
    print(f"{line}: continues from update {result.to_update} at its next start ({result.rows_now} rows kept)")
    if result.rows_kept is not None:
        print(f"the rows set aside (those after update {result.to_update}): {result.rows_kept}")
    if result.set_aside:
        print(f"set aside until the line moves on: {', '.join(result.set_aside)}")
    if result.reopened_cycles:
        print(f"data cycles reopened: {', '.join(map(str, result.reopened_cycles))}")
    if result.branches_after:
        print(f"branches forked after update {result.to_update} keep their own checkpoints and rows, and the trunk "
              f"rows they grew from are in the copy above: {', '.join(result.branches_after)}")
    return 0
