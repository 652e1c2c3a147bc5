"""Every state a supervisor can write and every event it can push has a look in the console."""

from __future__ import annotations

import pytest

from engine.protocol.facts import ENDING_EVENTS, FINAL_LINE_STATES, EventKind, LineState, Stage
from nsconsole.state import EVENT_GLYPHS, SHOWN_STAGES, LineView
from nsconsole.widgets import format as fmt


@pytest.mark.parametrize("state", list(LineState) + sorted(SHOWN_STAGES))
def test_every_state_has_a_glyph_a_word_and_a_colour(state: str) -> None:
    glyph, severity = fmt.STATE_LOOKS[state]
    assert glyph.strip() and glyph != "•"
    assert fmt.state_label(state) == f"{glyph} {state.value}"
    assert severity in ("", "success", "warning", "error")


def test_every_trainer_stage_but_training_and_stopped_is_shown_in_place_of_training() -> None:
    assert set(Stage) - {Stage.TRAINING, Stage.STOPPED} == SHOWN_STAGES


def test_the_console_ends_a_line_in_exactly_the_states_a_supervisor_exits_in() -> None:
    assert fmt.FINAL_STATES == FINAL_LINE_STATES
    assert LineState.DISK_FULL in fmt.FINAL_STATES and LineState.DISK_FULL.final
    assert {state for state in LineState if state.final} == FINAL_LINE_STATES
    assert not LineState.PAUSING.final and not LineState.TRAINING.final


@pytest.mark.parametrize("kind", list(EventKind))
def test_every_supervisor_event_has_a_glyph_and_a_word(kind: EventKind) -> None:
    glyph, word = EVENT_GLYPHS[kind]
    assert glyph.strip() and word.strip()


@pytest.mark.parametrize("kind", sorted(ENDING_EVENTS))
def test_an_ending_event_sets_the_lines_final_state_at_once(kind: EventKind) -> None:
    line = LineView("k", "/lines/a")
    line.apply_hello({"epoch": "e1", "line": "/lines/a"}, 1.0)
    line.apply_status({"state": "training", "trainer_pid": 42})
    line.apply_notification("event", {"event": kind.value, "message": "over", "time": 2.0}, 2.0)
    assert line.display_state == ENDING_EVENTS[kind] and line.display_state in fmt.FINAL_STATES
    assert line.status["trainer_pid"] is None
