"""The trainer's checkpoints: the restore at a resume, the snapshot and its write, the disk guard.

A mixin of `engine.training.trainer.Trainer`, sharing its state: it uses the run's config and
run.json's bytes, the layout, the device, the model, the optimizer, the moving average, the sharded
model, the data line, rows.jsonl, the checkpoint writer, the W&B mirror (its run's record goes into
the state), the heartbeat, the phase beats, the log and the ranks, and the data position's checks
and digests (`DataCycles`). It sets the position (a restore) and `_last_checkpoint_update`, the
update the newest checkpoint of this launch (or the one resumed) holds.

The disk: a checkpoint is written only where the free space holds the next one's size with a
margin (`engine.checkpoints.disk_budget`); below `guards.min_free_disk_gb` the trainer checkpoints
while there is room and stops for the operator (`DiskFull`: the supervisor does not relaunch).
Rank 0's disk decides for the group.
"""

from __future__ import annotations

import shutil
from dataclasses import asdict
from typing import Any

import torch

from engine.checkpoints.disk_budget import CheckpointSize, gib_text, next_checkpoint_size
from engine.checkpoints.format import CHECKPOINT_DISK_MARGIN, resume_candidate
from engine.checkpoints.tensors import Checkpoint, CheckpointSnapshot
from engine.errors import CheckpointError, DiskFull
from engine.protocol.facts import Stage, StopReason
from engine.training.position import Position


class Checkpointing:
    """The trainer's checkpoints and disk guard (mixed into `Trainer`, whose state they save and restore)."""

    def _restore(self, checkpoint: Checkpoint) -> None:
        state = checkpoint.state
        where = checkpoint.directory
        if state.get("layout") != self.optimizer.layout():
            raise CheckpointError(f"{where}: its parameter layout differs from the model run.json builds")
        model_extra = {k[len("model/") :]: v for k, v in checkpoint.extra.items() if k.startswith("model/")}
        try:
            self.optimizer.load(checkpoint.weights, checkpoint.optimizer)
            # The model's own state (PSSA's banks) can differ where the layout does not.
            self.model.load_extra_state_dict({k: v.to(self.device) for k, v in model_extra.items()})
        except ValueError as error:
            raise CheckpointError(f"{where}: {error}") from None
        torch.set_rng_state(checkpoint.extra["rng/cpu"])
        if self.device.type == "cuda" and "rng/cuda" in checkpoint.extra:
            torch.cuda.set_rng_state(checkpoint.extra["rng/cuda"], self.device)
        self.optimizer.nonfinite_in_a_row = int(state["nonfinite_in_a_row"])
        if self.average is not None:
            self.average.started = bool(state.get("ema_started", False))
            if "ema" in checkpoint.optimizer:
                self.average.average.copy_(checkpoint.optimizer["ema"])
        self.position = Position(**state["position"])
        self._check_data_position(state["data"], where)
        self._last_checkpoint_update = checkpoint.update

    def _snapshot(self, kept: str | list[str] | None, host_state: tuple[torch.Tensor, dict[str, torch.Tensor]]) -> CheckpointSnapshot:
        """The checkpoint of the line as it stands; `host_state`: the optimizer's whole weights and state
        on the host (`FlatAdamW.host_state`)."""
        assert self.rows is not None, "rank 0 alone snapshots the line"
        optimizer = self.optimizer
        position = self.position
        params, optimizer_state = host_state
        if self.average is not None:
            optimizer_state["ema"] = self.average.average.to("cpu", copy=True)
        extra = {
            f"model/{key}": value.detach().to("cpu", copy=True)
            for key, value in self.model.extra_state_dict().items()
        }
        extra["rng/cpu"] = torch.get_rng_state()
        if self.device.type == "cuda":
            extra["rng/cuda"] = torch.cuda.get_rng_state(self.device)
        data: dict[str, Any] = {"manifest_sha256": None, "order_digest": None, "seq_len": None}
        if (position.sample > 0 or position.earlier) and position.stage < len(self.config.plan):
            seq_len = self._seq_len()
            data = {
                "manifest_sha256": self._cycle(position.cycle).manifest_sha256,
                "order_digest": self._order_digest(position.cycle, seq_len),
                "seq_len": seq_len,
            }
        state = {
            "position": asdict(position),
            "data": data,
            "kept": kept,
            "nonfinite_in_a_row": optimizer.nonfinite_in_a_row,
            "ema_started": self.average.started if self.average is not None else False,
            "rows": self.rows.rows,
            "rows_bytes": self.rows.bytes,
            "layout": optimizer.layout(),
            "degree": self.ranks.size,
            "preset": self.config.model.preset,
            "overrides": self.config.model.overrides,
            "wandb": self.mirror.checkpoint_record(),
        }
        return CheckpointSnapshot(
            update=position.update,
            weights=optimizer.weights_by_name(params),
            optimizer=optimizer_state,
            extra=extra,
            state=state,
            run_json=self.run_json_bytes,
            tokenizer_json=self.data_line.tokenizer_json.encode("utf-8"),
        )

    def _checkpoint(self, kept: str | list[str] | None = None, wait: bool = False) -> None:
        self.writer.wait()  # the write before this one has taken its space
        free, size = shutil.disk_usage(self.layout.checkpoints).free, self._checkpoint_bytes()
        (short,) = self.ranks.from_writer([int(free < CHECKPOINT_DISK_MARGIN * size)])  # every rank stops, or none
        if short:
            # Whatever the guard's threshold, a write that cannot fit would fail half-way.
            last = self._last_checkpoint_update
            newest = f"the newest is update {last}" if last is not None else "none written yet"
            # The start refusal's words (disk_budget): the size to its precision, and the margin.
            self._stop_for_disk(free, f"too little for the next checkpoint (about {gib_text(size)}; "
                                f"{CHECKPOINT_DISK_MARGIN:g}x needed); {newest}")
        # Rank 0 writes the checkpoint: every rank holds the same state, or, sharded, every rank
        # takes part in gathering it to rank 0.
        if self.rows is not None or self.sharded is not None:
            with self.beats.phase(Stage.CHECKPOINTING, self.position.update):
                host_state = self.optimizer.host_state()
                if self.rows is not None and host_state is not None:
                    self.writer.save(self._snapshot(kept, host_state), before_latest=self.rows.sync)
                    if wait:
                        self.writer.wait()
        self._last_checkpoint_update = self.position.update

    def _rolling_checkpoint_due(self) -> bool:
        every = self.config.checkpoints.every_updates
        return every > 0 and self.position.update % every == 0

    def _check_disk(self) -> None:
        """Below `guards.min_free_disk_gb`: checkpoint while there is room, then stop for the operator.

        A statvfs per update costs microseconds. The checkpoint is written only when the free space
        holds the newest checkpoint's size with a margin, so a full disk never leaves a half-written
        one behind (and `latest` only ever names a complete one in any case).
        """
        free = shutil.disk_usage(self.layout.checkpoints).free
        minimum = self.config.guards.min_free_disk_bytes
        # Rank 0's disk decides for the group (the same disk: one line directory).
        low = free < minimum
        room = low and free > CHECKPOINT_DISK_MARGIN * self._checkpoint_bytes()
        low, room = self.ranks.from_writer([int(low), int(room)])
        if not low:
            return
        update = self.position.update
        if self._last_checkpoint_update == update:
            saved = f"update {update} is checkpointed"
        elif room:
            self._checkpoint(wait=True)
            saved = f"checkpointed update {update}"
        else:
            saved = f"no room for another checkpoint: the newest is update {self._last_checkpoint_update}"
        self._stop_for_disk(free, f"below guards.min_free_disk_gb = {self.config.guards.min_free_disk_gb:g}; {saved}")

    def _stop_for_disk(self, free: int, why: str) -> None:
        """Stop for the operator (DiskFull: the supervisor does not relaunch); what is saved stays."""
        update = self.position.update
        message = (
            f"{self.layout.root}: {gib_text(free)} free on its disk, {why}; "
            "free some space and run the line again"
        )
        self.heartbeat.beat(update, Stage.STOPPED, reason=StopReason.DISK_FULL)
        self.log.write(message)
        raise DiskFull(message)

    def _checkpoint_bytes(self) -> int:
        return self._checkpoint_size().bytes

    def _checkpoint_size(self) -> CheckpointSize:
        tokenizer_bytes = len(self.data_line.tokenizer_json.encode("utf-8"))
        newest = resume_candidate(self.layout.checkpoints)
        return next_checkpoint_size(newest, self.config, self.model.num_parameters(), tokenizer_bytes)
