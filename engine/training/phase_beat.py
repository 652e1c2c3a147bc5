"""Heartbeats through the trainer's long phases.

The trainer beats after every update, but some phases take far longer than an update: a 2B line's
validation over long rows, the first capture of a length (its warm-up compiles kernels), the probe
rows before a capture, a length's first eager update on CUDA (compiling), a checkpoint's snapshot.
Silent for that long, the line looks hung to the supervisor's watchdog (which kills a trainer whose
heartbeat is older than `watchdog_minutes`) and to the console. So while a phase runs, a side
thread beats its stage every `interval_s`, with the time the phase began. Phases nest (the probe
rows run inside a capture): the innermost one is beaten, and the enclosing one, or `between` (the
trainer's `training`) once the outermost ends, is beaten at once, so no stage word outlives its
phase by an update. A phase that outlasts `limit_s` is taken as hung: its beats stop, and the
watchdog ends it.

Every beat names the trainer's cycle, read when it beats, as each update's own beat does: a beat of
a validation or a checkpoint is the line's last for minutes, and `nsconsole stop --at-cycle-end`
reads the cycle there to refuse a cycle the line has left behind (engine.ops.stop).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from engine.rows import Heartbeat

PHASE_BEAT_INTERVAL_S = 30.0
"""How often a long phase beats: far inside the watchdog's minutes, cheap (one small file)."""
PHASE_BEAT_LIMIT_S = 6 * 3600.0
"""A phase still running after this is taken as hung: no more beats, so the watchdog acts."""


@dataclass
class _Phase:
    stage: str
    update: int
    details: dict[str, object]
    began: float = field(default_factory=time.time)


class PhaseBeats:
    """Beats `heartbeat` with the running phase's stage (see the module docstring)."""

    def __init__(
        self,
        heartbeat: Heartbeat,
        between: str,
        cycle: Callable[[], int],
        interval_s: float = PHASE_BEAT_INTERVAL_S,
        limit_s: float = PHASE_BEAT_LIMIT_S,
    ) -> None:
        self.heartbeat = heartbeat
        self.between = between
        """The stage beaten when the outermost phase ends (what the trainer does between phases)."""
        self.cycle = cycle
        """The cycle each beat names, asked when it beats (the trainer's `_beaten_cycle`)."""
        self.interval_s = interval_s
        self.limit_s = limit_s
        self._running: list[_Phase] = []
        self._lock = threading.Lock()

    @contextmanager
    def phase(self, stage: str, update: int, **details: object) -> Iterator[None]:
        """Beat `stage` now and every `interval_s` until the block ends (or `limit_s` passes)."""
        current = _Phase(stage, update, details)
        with self._lock:
            self._running.append(current)
            self._beat(current)
        done = threading.Event()

        def keep_beating() -> None:
            deadline = time.monotonic() + self.limit_s
            while not done.wait(self.interval_s) and time.monotonic() < deadline:
                with self._lock:
                    if self._running and self._running[-1] is current and not done.is_set():
                        self._beat(current)

        beater = threading.Thread(target=keep_beating, name=f"heartbeat-{stage}", daemon=True)
        beater.start()
        try:
            yield
        finally:
            done.set()
            beater.join()  # no beat of this phase may land after the next stage's
            with self._lock:
                self._running.remove(current)
                if self._running:  # back in the enclosing phase: say so at once
                    self._beat(self._running[-1])
                else:
                    self.heartbeat.beat(update, self.between, cycle=self.cycle())

    def _beat(self, phase: _Phase) -> None:
        cycle = self.cycle()
        self.heartbeat.beat(phase.update, phase.stage, phase_began=phase.began, cycle=cycle, **phase.details)
