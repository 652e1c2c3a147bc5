"""`nsconsole data status`: a data line's cycles, validation rows and preparer, and its damage."""

from __future__ import annotations

import argparse
import json

from nsconsole.commands.data.paths import data_line_path

EXIT_DAMAGED = 1
"""`data status`'s exit status when it reports a damaged cycle: a script (or a cron check) sees the
damage without parsing the report; 1, as `check` fails a check (2 is a refusal: a line unreadable)."""


REOPENED_TEXT = "reopened: shards to rebuild from its manifest"
"""How `data status` shows a `reopened` cycle (`DataLine.cycle_state`): a consumed cycle a rollback reopened."""


def run_status(args: argparse.Namespace) -> int:
    from datalines import open_data_line
    from datalines.service import preparer_running
    from datalines.status import RUNNING_STATES, read_status

    line = open_data_line(data_line_path(args, args.work))
    validation = sorted(int(path.name[1:]) for path in (line.path / "val").glob("T*") if path.is_dir())
    states = {index: line.cycle_state(index) for index in line.known_cycles()}
    report = {
        "path": str(line.path),
        "sources": line.shares(0),
        "schedule": [
            {"from_tokens": piece.from_tokens, "shares": line.recipe.shares_at(piece.from_tokens)}
            for piece in line.recipe.schedule
        ],
        "cycle_tokens": line.cycle_tokens,
        "last_cycle": line.last_cycle(),
        "cycles": states,
        # What is wrong with each damaged cycle, naming every file: its manifest, or its shards.
        "problems": {index: line.cycle_problem(index) for index, state in states.items() if state == "damaged"},
        "validation_seq_lens": validation,
        "preparer": read_status(line.path),
        # preparer.json keeps a killed preparer's last state: whether one runs is its lock's say.
        "preparer_running": preparer_running(line.path),
    }
    status = EXIT_DAMAGED if report["problems"] else 0
    if args.json:
        print(json.dumps(report))
        return status
    shares = ", ".join(f"{name} {share:.3g}" for name, share in report["sources"].items())
    print(f"data line {line.path}: {shares}; {line.cycle_tokens:,} tokens per cycle")
    if len(line.recipe.schedule) > 1:  # the header shows the first piece's shares
        pieces = "; ".join(
            f"from token {piece.from_tokens:,} (cycle {piece.from_tokens // line.cycle_tokens}): "
            + ", ".join(f"{name} {share:.3g}" for name, share in line.recipe.shares_at(piece.from_tokens).items())
            for piece in line.recipe.schedule
        )
        print(f"schedule: {pieces}")
    last = report["last_cycle"]
    print(f"last cycle: {last if last is not None else 'not known yet'}")
    for index, state in report["cycles"].items():
        shown = REOPENED_TEXT if state == "reopened" else state
        print(f"  cycle {index:4d}  {shown}" + (f": {report['problems'][index]}" if state == "damaged" else ""))
    print(f"validation rows: {', '.join(f'T{length}' for length in validation) or 'none (run data val)'}")
    preparer = report["preparer"]
    if preparer:
        reopened = [str(index) for index, state in report["cycles"].items() if state != "consumed"]
        if preparer["state"] == "finished" and reopened:
            # Its message ("every cycle ... is consumed") was true when it finished, before a rollback.
            cycles = f"cycle{'s' if len(reopened) > 1 else ''} {', '.join(reopened)}"
            print(f"preparer: finished (pid {preparer['pid']}) when every cycle was consumed; reopened since: "
                  f"{cycles}, whose shards the next preparer rebuilds (the line's supervisor runs one, or "
                  f"`nsconsole data run-preparer --work {line.path}`)")  # fmt: skip
        elif preparer["state"] in RUNNING_STATES and not report["preparer_running"] and preparer.get("exited"):
            print(f"preparer: exited (--once, pid {preparer['pid']}): {preparer['message']}")
        elif preparer["state"] in RUNNING_STATES and not report["preparer_running"]:
            print(f"preparer: not running (its last status, pid {preparer['pid']}: {preparer['state']}: "
                  f"{preparer['message']}; it stopped without a word: killed or crashed)")  # fmt: skip
        else:
            print(f"preparer: {preparer['state']} (pid {preparer['pid']}): {preparer['message']}")
    return status
