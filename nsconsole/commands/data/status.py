"""`nsconsole data status`: a data line's cycles, validation rows and preparer, and its damage."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from nsconsole.commands.data.paths import data_line_path

if TYPE_CHECKING:
    from datalines.dataline import DataLine

EXIT_DAMAGED = 1
"""`data status`'s exit status when it reports a damaged cycle: a script (or a cron check) sees the
damage without parsing the report; 1, as `check` fails a check (2 is a refusal: a line unreadable)."""
EXIT_PREPARER_STOPPED = 3
"""`data status`'s exit status when no cycle is damaged but the preparer stopped for good (a failure
that does not pass by itself): the operator must act, as `nsconsole status` exits 3 for a line that
needs them."""


REOPENED_TEXT = "reopened: shards to rebuild from its manifest"
"""How `data status` shows a `reopened` cycle (`DataLine.cycle_state`): a consumed cycle a rollback reopened."""


def run_status(args: argparse.Namespace) -> int:
    from datalines import open_data_line
    from datalines.status import RUNNING_STATES, preparer_running, read_status, status_stopped_for_good

    line = open_data_line(data_line_path(args, args.work))
    preparer, preparer_damage = read_status(line.path)
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
        # Bytes that were not UTF-8 (read as U+FFFD) in each prepared cycle: cycle -> source -> file -> bytes.
        "invalid_utf8": invalid_utf8_by_cycle(line, states),
        "validation_seq_lens": validation,
        "preparer": preparer,
        # A damaged preparer.json hides no more than the preparer's state: one line naming it.
        "preparer_problem": preparer_damage,
        # preparer.json keeps a killed preparer's last state: whether one runs is its lock's say.
        "preparer_running": preparer_running(line.path),
    }
    stopped = status_stopped_for_good(preparer, lambda: report["preparer_running"])
    status = EXIT_DAMAGED if report["problems"] else EXIT_PREPARER_STOPPED if stopped else 0
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
        print(f"  cycle {index:4d}  {shown}" + (f": {report['problems'][index]}" if state == "damaged" else "")
              + invalid_utf8_text(report["invalid_utf8"].get(index)))  # fmt: skip
    print(f"validation rows: {', '.join(f'T{length}' for length in validation) or 'none (run data val)'}")
    if preparer_damage is not None:
        # One that runs writes its status again at its next step; else the file stays as it is.
        running = "a preparer runs now" if report["preparer_running"] else "no preparer runs now"
        print(f"preparer: state unknown: {preparer_damage}; {running}")
    if preparer:  # a status the preparer wrote: every field there, but one edited by hand may lack some
        reopened = [str(index) for index, state in report["cycles"].items() if state != "consumed"]
        if preparer["state"] == "finished" and reopened:
            # Its message ("every cycle ... is consumed") was true when it finished, before a rollback.
            cycles = f"cycle{'s' if len(reopened) > 1 else ''} {', '.join(reopened)}"
            print(f"preparer: finished (pid {preparer.get('pid')}) when every cycle was consumed; reopened since: "
                  f"{cycles}, whose shards the next preparer rebuilds (the line's supervisor runs one, or "
                  f"`nsconsole data run-preparer --work {line.path}`)")  # fmt: skip
        elif preparer["state"] in RUNNING_STATES and not report["preparer_running"] and preparer.get("exited"):
            print(f"preparer: exited (--once, pid {preparer.get('pid')}): {preparer.get('message')}")
        elif preparer["state"] in RUNNING_STATES and not report["preparer_running"]:
            print(f"preparer: not running (its last status, pid {preparer.get('pid')}: {preparer['state']}: "
                  f"{preparer.get('message')}; it stopped without a word: killed or crashed)")  # fmt: skip
        elif stopped:
            print(f"preparer: stopped for good (pid {preparer.get('pid')}), not retried: {preparer.get('last_error')}; "
                  f"to go on: {preparer['fix']}; then the supervisor of the line that trains on it starts it "
                  f"again within seconds (with none, `nsconsole data run-preparer --work {line.path}`)")  # fmt: skip
        else:
            print(f"preparer: {preparer['state']} (pid {preparer.get('pid')}): {preparer.get('message')}")
    return status


def invalid_utf8_by_cycle(line: DataLine, states: dict[int, str]) -> dict[int, dict[str, dict[str, int]]]:
    """Cycle -> source -> file -> its bytes in the cycle that were not UTF-8 (replaced by U+FFFD), for
    every cycle with a readable manifest that had any (the manifest records them)."""
    from datalines.errors import DataLineError
    from datalines.manifest import load_manifest
    from datalines.preparer import invalid_utf8_bytes

    found = {}
    for index, state in states.items():
        if state in ("planned", "unplanned"):
            continue
        try:
            counts = invalid_utf8_bytes(load_manifest(line.cycle_dir(index))[0])
        except DataLineError:
            continue  # a damaged manifest: its problem is reported already
        if counts:
            found[index] = counts
    return found


def invalid_utf8_text(counts: dict[str, dict[str, int]] | None) -> str:
    """`; 12 bytes not UTF-8, read as U+FFFD: web books/b.txt 10, ...` for a cycle's line ("" when none)."""
    if not counts:
        return ""
    total = sum(count for files in counts.values() for count in files.values())
    files = ", ".join(f"{name} {path} {count:,}" for name, per_file in counts.items()
                      for path, count in sorted(per_file.items()))  # fmt: skip
    return f"; {total:,} byte{'s' if total > 1 else ''} not UTF-8, read as U+FFFD: {files}"
