"""How the console words a change it sends to a supervisor (stop, branch, rollback, tune) and the
supervisor's reply, for the line's events and the toasts: sentences, not the wire's dictionaries.

A reply is worded as a short summary (the toast says it) and its details (the event adds them);
a reply of a shape this code does not know is listed field by field, so nothing is lost.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nsconsole.widgets import format as fmt

TOAST_CHARS = 240
"""A toast says at most about this many characters; the line's events tab keeps the whole text.
At 80 columns a toast is about 56 characters wide: this is 5 of its lines, which fit beside others."""


def request_words(method: str, params: Mapping[str, Any]) -> str:
    """What was asked, as the `request` event says it when it is sent."""
    if method == "stop":
        return f"stop {_when(params.get('at_cycle_end'))}"
    if method == "branch":
        return (f"branch into {params.get('path')} at the end of cycle {params.get('at_cycle')}, "
                f"plan {params.get('plan')}, data line {params.get('data')}")
    if method == "rollback":
        return f"rollback to update {params.get('to')}"
    if method == "tune":
        return f"tune ({'shared shapes, --shared' if params.get('shared') else 'the line alone'})"
    return f"{method} ({_fields(params)})" if params else method


def reply_words(method: str, reply: object) -> tuple[str, str]:
    """(summary, details) of a supervisor's reply to `method`; details start with their own separator."""
    if not isinstance(reply, Mapping):
        return ("done" if reply is None else str(reply)), ""
    if method == "stop" and reply.get("stopping"):
        return f"it stops {reply.get('when') or _when(reply.get('at_cycle_end'))}", " with a checkpoint"
    if method == "branch" and reply.get("state") == "queued":
        return f"queued for the end of cycle {reply.get('at_cycle')} → {reply.get('path')}", ""
    if method == "branch" and reply.get("state") == "forked":
        tokens = reply.get("fork_tokens")
        trained = f" ({fmt.count(tokens)} tokens)" if isinstance(tokens, (int, float)) else ""
        return (f"forked at update {reply.get('fork_update')}{trained}, the end of cycle {reply.get('at_cycle')} "
                f"→ {reply.get('path')}"), ""
    if method == "rollback" and "to_update" in reply:
        return f"the line continues from update {reply['to_update']}", _rollback_details(reply)
    if method == "tune" and isinstance(reply.get("lengths"), list):
        shapes = "shared shapes" if reply.get("shared") else "shapes"
        return f"run.json has the new {shapes}", _tune_details(reply["lengths"])
    return _fields(reply), ""


def toast_text(text: str) -> str:
    """`text` as a toast says it: whole when short, else cut at a word with a pointer to the events tab
    (a toast taller than the screen is cut off mid-sentence; the event keeps every word)."""
    if len(text) <= TOAST_CHARS:
        return text
    cut = text.rfind(" ", 0, TOAST_CHARS)
    return f"{text[: cut if cut > 0 else TOAST_CHARS].rstrip(' ,;:')}… (the line's events tab has all of it)"


def _when(at_cycle_end: object) -> str:
    return "at the next update" if at_cycle_end is None else f"at the end of cycle {at_cycle_end}"


def _rollback_details(reply: Mapping[str, Any]) -> str:
    parts = []
    set_aside = reply.get("set_aside")
    if isinstance(set_aside, list) and set_aside:
        parts.append(f"later checkpoints set aside (retention removes them as the line moves on): {', '.join(map(str, set_aside))}")
    if isinstance(reply.get("rows_now"), int):
        parts.append(f"rows.jsonl keeps {reply['rows_now']} rows")
    if reply.get("rows_kept"):
        parts.append(f"the rows set aside are in {Path(str(reply['rows_kept'])).name}")
    reopened = reply.get("reopened_cycles")
    if isinstance(reopened, list) and reopened:
        parts.append(f"data cycles reopened (the preparer rebuilds them): {', '.join(map(str, reopened))}")
    return "".join(f"; {part}" for part in parts)


def _tune_details(lengths: list[Any]) -> str:
    shapes = []
    for entry in lengths:
        if isinstance(entry, Mapping):
            recompute = entry.get("recompute") or "none"
            shapes.append(f"seq_len {entry.get('seq_len')}: {entry.get('micro_batch_rows')} rows a micro-batch, "
                          f"recompute {recompute}")
    return ": " + "; ".join(shapes) if shapes else ""


def _fields(mapping: Mapping[str, Any]) -> str:
    return ", ".join(f"{key} {value}" for key, value in mapping.items())
