"""Growing a data line's schedule: a new piece of shares appended at its end, never a change in the past.

A piece may start only on a cycle boundary after the last piece and after every cycle planned so
far (a planned cycle's shares are fixed in its plan and manifest). dataline.json is rewritten
atomically with the longer schedule; everything else in it stays byte for byte the same.
"""

from __future__ import annotations

from typing import Any

from datalines.dataline import CONFIG_NAME, DataLine
from datalines.errors import DataLineError
from datalines.files import read_json, write_json_atomic
from datalines.planning import plans_lock
from datalines.recipe import parse_recipe


def append_schedule_piece(line: DataLine, from_tokens: int, shares: dict[str, Any]) -> None:
    """Append the piece under the plans' lock: a preparer planning a cycle meanwhile writes its plan
    before this looks (and the piece is refused) or after (and plans it with the new shares)."""
    with plans_lock(line):
        _append(line, from_tokens, shares)


def _append(line: DataLine, from_tokens: int, shares: dict[str, Any]) -> None:
    where = str(line.path / CONFIG_NAME)
    line.refresh_recipe()
    config = read_json(line.path / CONFIG_NAME)
    last = line.recipe.schedule[-1].from_tokens
    if from_tokens <= last:
        raise DataLineError(f"{where}: the schedule is append-only; --from-tokens must exceed {last}")
    if from_tokens % line.cycle_tokens:
        raise DataLineError(
            f"{where}: --from-tokens {from_tokens} is not a multiple of the cycle tokens {line.cycle_tokens}"
        )
    first_cycle = from_tokens // line.cycle_tokens
    planned = [index for index in line.known_cycles() if index >= first_cycle]
    if planned:
        free = (planned[-1] + 1) * line.cycle_tokens
        cycles = f"cycle {planned[0]} is" if len(planned) == 1 else f"cycles {planned[0]}..{planned[-1]} are"
        raise DataLineError(
            f"{where}: {cycles} planned already (a planned cycle keeps its shares); a new piece must start "
            f"at token {free:,} (cycle {planned[-1] + 1}) or later"
        )
    recipe = dict(config["recipe"])
    recipe["schedule"] = [*recipe["schedule"], {"from_tokens": from_tokens, "shares": shares}]
    parse_recipe(recipe, where)  # the same checks as at init, on the whole new schedule
    config["recipe"] = recipe
    write_json_atomic(line.path / CONFIG_NAME, config)
