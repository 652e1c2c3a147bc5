"""Launching one trainer and watching it until it exits.

A mixin of `engine.supervisor.supervisor.Supervisor`: the watch is the supervisor's loop while a
trainer runs (it pushes rows and beats, and acts on a stop, paused work and a silent heartbeat),
and shares its state (supervisor.json's record, the stop asked, the paused work, run.json as last
read). What an exit means is `engine/supervisor/verdict.py`'s to judge; this gives it the facts.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import sys
import time

import psutil

from engine.gpu.devices import GpuLease
from engine.logrotate import rotate_if_needed
from engine.process_start import is_recorded_process
from engine.protocol.facts import EventKind, LineState, Stage, StopReason
from engine.supervisor.child import clear_exits, group_environment, group_exit
from engine.supervisor.gpu_watch import processes_on_gpu
from engine.supervisor.reads import beat_time, latest_update, pending_stop, read_json, reload_config
from engine.supervisor.verdict import TrainerExit


class TrainerLaunching:
    """The trainer's launch and watch (mixed into `Supervisor`, whose loop, state and log it uses)."""

    def _run_trainer(self, leases: list[GpuLease]) -> TrainerExit:
        self._wait_for_an_earlier_trainer()
        self._config = reload_config(self.layout, self._config)
        rotate_if_needed(self.layout.run_log)
        checkpoint_before = latest_update(self.layout)
        argv = self._trainer_argv()
        environment = self.placed_environment()
        if self._degree() > 1:
            environment = group_environment(environment, on_cpu=self._gpus is None)
        clear_exits(self.layout.root)
        output = os.open(self.layout.run_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            trainer = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
                pass_fds=tuple(lease.fileno() for lease in leases), close_fds=True, env=environment,
            )
        finally:
            os.close(output)
        for lease in leases:
            lease.record_holder(trainer.pid)
            lease.release()  # the trainer (torchrun and its ranks) holds it now, for exactly its life
        launched = time.time()
        self._set(state=LineState.TRAINING, trainer_pid=trainer.pid, launches=self.state.launches + 1,
                  trainer_launched=launched)
        self._say(f"trainer launched (pid {trainer.pid}, launch {self.state.launches})")
        self._publish_event(EventKind.LAUNCHED, f"trainer launched (pid {trainer.pid})")
        outcome = self._watch(trainer, launched)
        if self._degree() > 1 and outcome.code not in (0, None) and not outcome.killed_by_watchdog:
            # torchrun exits 1 whatever its ranks said: the verdict reads the status they left.
            recorded = group_exit(self.layout.root)
            outcome.code = outcome.code if recorded is None else recorded
        outcome.progressed = (latest_update(self.layout) or -1) > (checkpoint_before or -1)
        self._pump()
        exit_record = {"code": outcome.code, "ran_seconds": round(outcome.ran_seconds, 3),
                       "latest_checkpoint": latest_update(self.layout), "time": time.time()}
        self._set(trainer_pid=None, trainer_children=[], trainer_launched=None, last_exit=exit_record)
        return outcome

    def _trainer_argv(self) -> list[str]:
        """The trainer's command line. At `parallel.degree` N > 1, torchrun starting N ranks of it
        (`--max-restarts=0`: the supervisor relaunches, from the newest checkpoint, by its verdict;
        `--shutdown-timeout`: ranks asked to stop may take as long to checkpoint as a trainer
        alone), exec'd through engine.supervisor.child so that it gets SIGTERM if the supervisor
        dies; torchrun forwards it to the ranks. torchrun runs as engine.training.torchrun, which
        ends it quietly on the signals that stop a line (no traceback in run.log)."""
        program = self.settings.trainer_command or [sys.executable, "-m", "engine.training.main"]
        argv = [*program, str(self.layout.root), "--parent", str(os.getpid())]
        argv += ["--engine", self.settings.engine]
        if self.settings.stop_at is not None:
            argv += ["--stop-at", str(self.settings.stop_at)]
        degree = self._degree()
        if degree == 1:
            return argv
        torchrun = [
            sys.executable, "-m", "engine.training.torchrun", "--standalone", f"--nproc-per-node={degree}",
            "--max-restarts=0", f"--shutdown-timeout={math.ceil(self.settings.stop_wait_seconds)}", "--no-python",
        ]  # fmt: skip
        return [sys.executable, "-m", "engine.supervisor.child", str(os.getpid()), "--", *torchrun, *argv]

    def _group_of(self, trainer: subprocess.Popen[bytes]) -> tuple[int, ...]:
        """The trainer's pid and, at a degree above 1, its ranks' (torchrun's descendants)."""
        if self._degree() == 1:
            return (trainer.pid,)
        try:
            return (trainer.pid, *(child.pid for child in psutil.Process(trainer.pid).children(recursive=True)))
        except psutil.Error:
            return (trainer.pid,)

    def _watch(self, trainer: subprocess.Popen[bytes], launched: float) -> TrainerExit:
        stopped_by_us = False
        paused = False  # stopped for paused work (a rollback, a tune): relaunched after it
        stop_file_seen = False  # a clean exit after a STOP request is a stop, not the line's end
        asked_to_stop_at = 0.0
        data_wait_since: float | None = None  # when the trainer began waiting for a data cycle
        told_data_wait = False
        others: list[int] = []
        launch_pids: set[int] = set()
        # Silence is timed on this process's monotonic clock from when a new beat was seen: a beat's
        # own time is the wall clock's, which an NTP step or a resumed VM moves by hours (forward,
        # a healthy trainer would be killed; back, a hung one kept).
        beat_stamp: float | None = None  # the newest beat's own time, only to tell a new beat
        beat_seen_at = time.monotonic()
        while True:
            stop_file_seen = stop_file_seen or pending_stop(self.layout) is not None
            code = trainer.poll()
            group = self._group_of(trainer)
            if sorted(group[1:]) != self.state.trainer_children:
                self._set(trainer_children=sorted(group[1:]))
            if self.state.gpu_indices:  # every rank's GPU is the line's to watch
                now_on_gpu = sorted({pid for index in self.state.gpu_indices
                                     for pid in processes_on_gpu(index, exclude=group)})  # fmt: skip
                # At the exit, what was there at the last look before it counts too.
                others = sorted(set(others) | set(now_on_gpu)) if code is not None else now_on_gpu
            if code is not None:
                ran = time.time() - launched
                heartbeat = read_json(self.layout.heartbeat) or {}
                stop_served = (heartbeat.get("stage") == Stage.STOPPED and heartbeat.get("reason") == StopReason.STOP_FILE
                               and heartbeat.get("pid") in launch_pids | set(group))  # this launch's beat
                return TrainerExit(
                    code, ran, stopped_by_us=stopped_by_us, stop_requested=stop_file_seen, stop_served=stop_served,
                    others_on_gpu=others, paused_for_work=paused,
                )
            self._pump()
            if self._stopping and not stopped_by_us:
                self._set(state=LineState.STOPPING)
                self._say("stopping the trainer (SIGTERM: it checkpoints first)")
                trainer.send_signal(signal.SIGTERM)
                stopped_by_us, asked_to_stop_at = True, time.monotonic()
            work = self._paused_work
            if work is not None and not (paused or stopped_by_us):
                self._set(state=LineState.PAUSING)
                self._say(f"stopping the trainer for the {work.name} (SIGTERM: it checkpoints first)")
                trainer.send_signal(signal.SIGTERM)
                paused, asked_to_stop_at = True, time.monotonic()
            asked = stopped_by_us or paused
            if asked and time.monotonic() - asked_to_stop_at > self.settings.stop_wait_seconds:
                self._say(f"the trainer did not stop in {self.settings.stop_wait_seconds:g} s: killing it")
                outcome = self._kill(trainer, launched, watchdog=False, stopped_by_us=stopped_by_us)
                outcome.paused_for_work = paused
                return outcome
            heartbeat = read_json(self.layout.heartbeat)
            silence_allowed = self._watchdog_seconds()
            # Every pid of this launch seen so far: rank 0 may have left (its heartbeat says so) while
            # torchrun tears the group down, and its beat is still this launch's, not a stale one.
            launch_pids.update(self._group_of(trainer))
            if heartbeat is not None and heartbeat.get("pid") in launch_pids:  # rank 0's in a group
                if (stamp := beat_time(heartbeat)) != beat_stamp:
                    beat_stamp, beat_seen_at = stamp, time.monotonic()
                if heartbeat.get("stage") == Stage.STOPPED:
                    # It has checkpointed and is leaving (W&B's bounded close, a group's last barrier):
                    # a stopping trainer's allowance bounds that, not the watchdog's silence.
                    silence_allowed = max(silence_allowed, self.settings.stop_wait_seconds)
                if heartbeat.get("stage") != Stage.WAITING_DATA:
                    data_wait_since, told_data_wait = None, False
                elif data_wait_since is None:
                    data_wait_since = beat_seen_at
                # The wait is timed to the newest beat that said so: a trainer that stopped beating while
                # it waited is hung, the watchdog's to tell, not a data line's delay.
                elif not told_data_wait and beat_seen_at - data_wait_since > self._watchdog_seconds():
                    cycle = heartbeat.get("cycle")
                    self._event(EventKind.DATA_WAIT, f"the trainer has waited for data cycle {cycle} longer than the "
                                "watchdog interval")
                    told_data_wait = True
            if not asked and time.monotonic() - beat_seen_at > silence_allowed:
                return self._kill(trainer, launched, watchdog=True, stopped_by_us=False)
            time.sleep(self.settings.poll_seconds)

    def _kill(
        self, trainer: subprocess.Popen[bytes], launched: float, watchdog: bool, stopped_by_us: bool
    ) -> TrainerExit:
        if watchdog:
            silence = self._watchdog_seconds()
            self._say(f"no heartbeat for {silence:g} s: killing the trainer (pid {trainer.pid})")
        # A group's ranks run in sessions of their own, and one stopped or stuck in a collective
        # answers no SIGTERM torchrun forwards: each is killed, as torchrun is.
        ranks = [psutil.Process(pid) for pid in self._group_of(trainer)[1:] if psutil.pid_exists(pid)]
        trainer.kill()
        for rank in ranks:
            with contextlib.suppress(psutil.Error):
                rank.kill()
        try:
            code: int | None = trainer.wait(timeout=self.settings.kill_wait_seconds)
        except subprocess.TimeoutExpired:
            code = None
        _gone, alive = psutil.wait_procs(ranks, timeout=self.settings.kill_wait_seconds)
        if alive:
            code = None  # a rank that SIGKILL does not end: the GPU may hang
        ran = time.time() - launched
        return TrainerExit(code, ran, killed_by_watchdog=watchdog, stopped_by_us=stopped_by_us)

    def _wait_for_an_earlier_trainer(self) -> None:
        """A trainer of this line still alive (its supervisor died; it is checkpointing) must end first."""
        heartbeat = read_json(self.layout.heartbeat)
        if heartbeat is None or heartbeat.get("stage") == Stage.STOPPED:
            return
        pid = heartbeat.get("pid")
        try:
            process = psutil.Process(int(pid))
            if not is_recorded_process(process, heartbeat.get("pid_boot_start"), beat_time(heartbeat)):
                return  # the pid now belongs to another process
        except (psutil.Error, TypeError, ValueError):
            return
        self._say(f"an earlier trainer of this line (pid {pid}) is still running: waiting for it to exit")
        deadline = time.monotonic() + self.settings.stop_wait_seconds
        try:
            process.terminate()  # its supervisor is gone: it must checkpoint and go
            while process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                if time.monotonic() > deadline:
                    process.kill()
                    process.wait(self.settings.kill_wait_seconds)
                    return
                self._pump()
                time.sleep(self.settings.poll_seconds)
        except (psutil.NoSuchProcess, psutil.TimeoutExpired):
            pass  # gone (or, past the kill, stuck: the launch then fails and is counted)
