"""`nsconsole tune`: per sequence length, the fastest micro-batch rows and recomputation that fit.

For every length of the plan, real updates (forward, backward, norms, AdamW, with the engine the
trainer uses on that device) of the line's model run on random tokens at micro-batch rows 1, 2,
4, ... (up to the rows of an update, and on a CPU up to `CPU_MAX_ROWS` or --max-rows) and at the
line's current rows for that length, even past that cap (so tune never picks fewer rows than the
line has merely because it did not try them; more rows than an update holds count as the
update's), and each recomputation setting the model offers; each is timed (tokens/s over whole
updates after a warm-up) and its peak memory measured:

- CUDA: `torch.cuda.max_memory_allocated` over the model, optimizer, graphs and activations; the
  budget is the free memory at the start minus `GPU_MARGIN_BYTES` (what a capture creates outside
  the allocator), and with --shared minus `guards.share_reserve_gb` as well. A setting that runs
  out of memory is recorded as such and never picked; rows are not grown past it.
- A count of a kind's layers (`dendritic:K`, NS models): where `none` runs out of memory at some
  rows and a kind recomputed whole fits there, one more setting is measured at those rows: the
  fewest of that kind's layers whose recomputation should bring the peak inside the budget
  (`partial_recompute`, from the peaks measured at half the rows), so the line recomputes no more
  layers than the memory asks for (ns-2b's 36 dendritic layers each cost one more forward of
  their projections when recomputed).
- CPU: the model and optimizer's resident memory (what the process grew by while building them)
  plus the setting's growth: the process's peak resident memory (VmHWM, reset through
  /proc/self/clear_refs before each setting, after glibc's free memory is handed back with
  malloc_trim) over its resident memory at that reset. Counting the growth from each setting's own
  start keeps a reading true when the process hands back memory it held before the tune (a test
  worker's earlier work): against one baseline from the start such a reading came out negative.
  Where the peak cannot be reset a sampling thread reads the RSS instead. The budget is `--budget-gb` (GiB), else CPU_BUDGET_FRACTION of the available memory. A CPU
  out of memory kills the process rather than raising, so the next rows are not tried when the
  growth measured so far, continued, would not fit; and recomputation is tried only when no
  setting without it fits (on a CPU it only trades time for memory).

At `parallel.degree` N > 1 the update's micro-batches are dealt to N ranks (engine.training.distributed:
rank r trains the r-th of N contiguous runs of them), so what tune measures is a rank's work: the
rows tried stop at a rank's share of the update (`rows_to_try`: a micro-batch past it leaves ranks
with nothing to train), each setting is timed on the busiest rank's rows (`rank_rows`) while the
tokens/s are the whole update's (the group's update takes that rank's time), and on a CPU, whose
memory and cores the N ranks share, the budget is split among them and the measurement runs on a
rank's share of the cores. The sum across ranks between updates is not measured: it costs the same
at every setting.

The fastest setting that fits is written into run.json's `lengths` (`shared` with --shared),
atomically; nothing is written when some length has no setting that fits.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch

from engine.config.run import LengthConfig, RunConfig, SharedShapeConfig
from engine.errors import LineError, is_out_of_memory
from engine.models.base import LanguageModel
from engine.models.build import build_model
from engine.models.ns.model import NSLM
from engine.models.ns.presets import LAYER_KINDS, RECOMPUTE_CHOICES, recomputed_layers
from engine.ops.lines import failed_writes_said, model_vocab_size, open_line, refuse_an_unwritable_directory
from engine.ops.rollback import running_trainer
from engine.training.arena import DEFAULT_SLACK_BYTES, Arena, release_step_caches
from engine.training.distributed import rank_batches
from engine.training.optim import AdamWSettings, FlatAdamW
from engine.training.schedule import tokens_per_update
from engine.training.step import EagerEngine, GraphEngine
from engine.training.trainer import resolve_device
from engine.units import GIB, gib_bytes

GPU_MARGIN_BYTES = DEFAULT_SLACK_BYTES
"""Left free on the GPU: the arena's slack for what a capture creates outside the allocator."""
CPU_BUDGET_FRACTION = 0.5
"""Share of the available memory a CPU line may use by default."""
CPU_MAX_ROWS = 8
"""The largest power-of-two micro-batch tried on a CPU (the search stays small); the line's current
rows are tried as well when larger."""
TUNE_LR = 1e-5
WARMUP_UPDATES = 1
TIMED_UPDATES = {"cpu": 1, "cuda": 3}


@dataclass
class Measurement:
    """One setting tried."""

    seq_len: int
    """Tokens per row."""
    micro_batch_rows: int
    """Rows per micro-batch."""
    recompute: str
    """Activation recomputation."""
    tokens_per_s: float | None = None
    """Trained tokens per second over whole updates (None: not measured)."""
    peak_bytes: int | None = None
    """Peak memory of the updates (model, optimizer and activations)."""
    fits: bool = False
    """Ran, and its peak is within the budget."""
    note: str = ""
    """Why it does not fit or was not run (`out of memory`, `over budget`, ...)."""


@dataclass
class LengthTuning:
    """The settings tried for one length and the one chosen."""

    seq_len: int
    """Tokens per row."""
    measurements: list[Measurement] = field(default_factory=list)
    """Every setting tried, in order."""

    @property
    def chosen(self) -> Measurement | None:
        """The fastest setting that fits (None: none fits)."""
        fitting = [m for m in self.measurements if m.fits and m.tokens_per_s is not None]
        return max(fitting, key=lambda m: m.tokens_per_s or 0.0, default=None)


@dataclass
class TuneResult:
    """What `tune_line` found and wrote."""

    device: str
    """Where it measured."""
    budget_bytes: int
    """The memory a setting's peak must stay within (a rank's, at a degree above 1)."""
    lengths: list[LengthTuning]
    """Per length of the plan."""
    shared: bool
    """Written as the lengths' shared shapes."""
    degree: int = 1
    """The line's `parallel.degree`: the ranks an update is dealt to."""
    threads: int | None = None
    """On a CPU, the threads each setting was measured on (a rank's share of the cores); None on a GPU."""


# -- memory ---------------------------------------------------------------------------------------


class CpuPeakMeter:
    """The process's peak resident memory since `reset()`, over its resident memory at that reset
    (see the module docstring)."""

    def __init__(self) -> None:
        self._trim = _malloc_trim()
        self._resettable = _can_reset_peak()
        self._sampler: threading.Thread | None = None
        self._sampled_peak = 0
        self._stop = threading.Event()
        self.floor = self._settled_rss()

    @staticmethod
    def _rss() -> int:
        return psutil.Process().memory_info().rss

    def _settled_rss(self) -> int:
        """The resident memory once what is free has been handed back."""
        gc.collect()
        if self._trim is not None:
            self._trim(0)
        return self._rss()

    def growth_since_start(self) -> int:
        """Bytes the process grew by since it was built (the model and optimizer, in the tuner)."""
        return max(0, self._settled_rss() - self.floor)

    def reset(self) -> None:
        """Hand freed memory back, then start a new peak over the memory held now."""
        self.floor = self._settled_rss()
        if self._resettable:
            Path("/proc/self/clear_refs").write_text("5")
            return
        self.stop()
        self._sampled_peak = self.floor
        self._stop.clear()
        self._sampler = threading.Thread(target=self._sample, name="tune-rss", daemon=True)
        self._sampler.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self._sampled_peak = max(self._sampled_peak, self._rss())

    def stop(self) -> None:
        if self._sampler is not None:
            self._stop.set()
            self._sampler.join()
            self._sampler = None

    def peak(self) -> int:
        """Peak resident bytes since `reset()` over the resident bytes at it (never negative)."""
        if self._resettable:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return max(0, int(line.split()[1]) * 1024 - self.floor)
        self.stop()
        return max(0, max(self._sampled_peak, self._rss()) - self.floor)


def _malloc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def _can_reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return "VmHWM:" in Path("/proc/self/status").read_text()
    except OSError:
        return False


def memory_budget(device: torch.device, budget_gb: float | None, reserve_bytes: int) -> int:
    """Bytes a setting's peak may reach: --budget-gb (GiB), else the GPU's free memory or a share of
    the RAM; less `reserve_bytes` (the share reserve with --shared, else 0)."""
    if budget_gb is not None:
        budget = gib_bytes(budget_gb)
    elif device.type == "cuda":
        torch.cuda.empty_cache()  # what this process holds cached is not taken
        free, _total = torch.cuda.mem_get_info(device)
        budget = free - GPU_MARGIN_BYTES
    else:
        budget = int(psutil.virtual_memory().available * CPU_BUDGET_FRACTION)
    budget -= reserve_bytes
    if budget <= 0:
        raise LineError(
            f"tune: no memory left for the line ({budget / GIB:.1f} GiB after the margin and reserve)"
        )
    return budget


# -- measuring ------------------------------------------------------------------------------------


def recompute_choices(model: LanguageModel) -> tuple[str, ...]:
    """The recomputation settings a model offers (`none` for models without any)."""
    return RECOMPUTE_CHOICES if isinstance(model, NSLM) else ("none",)


def partial_recompute(
    tuning: LengthTuning, kind: str, layers: int, static_bytes: int, budget: int
) -> tuple[int, str] | None:
    """(rows, `kind:K`) worth measuring, or None: at the most rows where `kind` recomputed whole
    fits and `none` did not, the fewest K of its `layers` layers that should bring the peak within
    `budget`, with one layer's margin.

    From half those rows, where both were measured: activations grow with the rows, so `none`'s
    peak at twice the rows is static + 2 (its peak - static), and each layer recomputed whole saves
    2 (none's peak - kind's peak) / layers there."""
    fitting = {(m.micro_batch_rows, m.recompute): m.peak_bytes for m in tuning.measurements if m.fits}
    failing = [m.micro_batch_rows for m in tuning.measurements if m.recompute == "none" and not m.fits]
    failing = [rows for rows in failing if (rows, kind) in fitting]
    if not failing:
        return None
    rows = max(failing)
    none_peak, kind_peak = (fitting.get((rows // 2, setting)) for setting in ("none", kind))
    if rows < 2 or none_peak is None or kind_peak is None:
        return None
    saving_per_layer = 2 * (none_peak - kind_peak) / layers
    if saving_per_layer <= 0:
        return None
    predicted_none = static_bytes + 2 * (none_peak - static_bytes)
    count = math.ceil((predicted_none - budget) / saving_per_layer) + 1
    if not 0 < count < layers:
        return None
    return rows, f"{kind}:{count}"


def rows_to_try(
    update_rows: int, max_rows: int | None, current_rows: int | None, degree: int = 1
) -> list[int]:
    """1, 2, 4, ... up to a rank's share of the update's rows (all of them at degree 1) and
    `max_rows`, and the line's current rows even past `max_rows`: the cap keeps the search small,
    and tune must not recommend fewer rows than the line trains with only because it never measured
    them. Current rows past the update's are measured as the update's, the micro-batch the line
    trains in effect. At `degree` N a micro-batch of more than an N-th of the update's rows makes
    fewer micro-batches than ranks: a rank would train nothing."""
    share = -(-update_rows // max(1, degree))
    limit = share if max_rows is None else min(share, max_rows)
    rows = {2**power for power in range(max(0, limit).bit_length())}
    if current_rows is not None:
        rows.add(min(current_rows, update_rows))
    return sorted(rows)


def rank_rows(update_rows: int, micro_batch_rows: int, degree: int) -> int:
    """The rows of an update that its busiest rank trains at `degree`: the update's micro-batches
    are dealt in contiguous runs, the first `batches % degree` ranks one more
    (`engine.training.distributed.rank_batches`); the group's update takes that rank's time."""
    _, busiest = rank_batches(-(-update_rows // micro_batch_rows), max(1, degree), 0)
    return min(update_rows, busiest * micro_batch_rows)


class Tuner:
    """Measures settings of one model on one device (see the module docstring)."""

    def __init__(self, config: RunConfig, device: torch.device, budget: int, max_rows: int | None):
        self.config = config
        self.device = device
        self.budget = budget
        self.degree = config.parallel.degree
        """The ranks an update's micro-batches are dealt to: a setting is timed on the busiest one's rows."""
        self.cuda = device.type == "cuda"
        self.max_rows = max_rows if max_rows is not None else (None if self.cuda else CPU_MAX_ROWS)
        self.meter = None if self.cuda else CpuPeakMeter()
        self.capturable = True
        """Whether the model's step can be captured as CUDA graphs (False after a capture failed)."""
        torch.manual_seed(config.seeds.model)
        self.model = build_model(config.model.preset, config.model.overrides).to(device)
        betas = config.optimizer.betas
        settings = AdamWSettings(betas[0], betas[1], config.optimizer.eps, config.optimizer.clip)
        self.optimizer = FlatAdamW(self.model, settings, device)
        self.static_bytes = self._static_bytes()
        self.vocab = model_vocab_size(config)

    def _static_bytes(self) -> int:
        if self.cuda:
            return torch.cuda.memory_allocated(self.device)
        assert self.meter is not None
        return self.meter.growth_since_start()

    def tune_length(self, seq_len: int, current_rows: int | None) -> LengthTuning:
        """Every setting worth trying at `seq_len`, measured; `current_rows` (the line's micro-batch
        at this length, None: it has none) is among the rows tried."""
        update_rows = max(1, tokens_per_update(self.config, 0) // seq_len)
        tuning = LengthTuning(seq_len)
        rows = rows_to_try(update_rows, self.max_rows, current_rows, self.degree)
        for recompute in recompute_choices(self.model):
            if not self.cuda and recompute != "none" and any(m.fits for m in tuning.measurements):
                break  # on a CPU recomputation only trades time for memory
            self._grow_rows(tuning, recompute, rows, update_rows)
        if isinstance(self.model, NSLM):
            for kind in LAYER_KINDS:
                setting = partial_recompute(
                    tuning, kind, len(recomputed_layers(kind, self.model.config)), self.static_bytes, self.budget
                )
                if setting is not None:
                    tuning.measurements.append(self.measure(seq_len, setting[0], setting[1], update_rows))
        return tuning

    def _grow_rows(self, tuning: LengthTuning, recompute: str, rows: list[int], update_rows: int) -> None:
        """Measure `rows` in order at `recompute` until one does not fit or the next is predicted
        not to (a CPU out of memory kills the process)."""
        previous: Measurement | None = None
        for index, micro_batch_rows in enumerate(rows):
            measurement = self.measure(tuning.seq_len, micro_batch_rows, recompute, update_rows)
            tuning.measurements.append(measurement)
            if not measurement.fits:
                return
            following = rows[index + 1 : index + 2]
            if following and not self._next_may_fit(measurement, previous, following[0]):
                return
            previous = measurement

    def _next_may_fit(self, measurement: Measurement, previous: Measurement | None, next_rows: int) -> bool:
        """On a CPU, whether `next_rows` rows are predicted to fit.

        Activations grow with the rows: with a smaller setting measured, the growth per row from it
        to this one continues to `next_rows`; without it, everything above the model and optimizer
        is taken as activations and scaled (an overestimate: it includes the libraries' one-time
        memory).
        """
        if self.cuda or measurement.peak_bytes is None:
            return True
        rows = measurement.micro_batch_rows
        if previous is not None and previous.peak_bytes is not None:
            growth = max(0, measurement.peak_bytes - previous.peak_bytes)
            per_row = growth / (rows - previous.micro_batch_rows)
            return measurement.peak_bytes + per_row * (next_rows - rows) <= self.budget
        activations = max(0, measurement.peak_bytes - self.static_bytes)
        return self.static_bytes + activations * next_rows / rows <= self.budget

    def measure(self, seq_len: int, rows: int, recompute: str, update_rows: int) -> Measurement:
        """Time `TIMED_UPDATES` updates of `update_rows` rows at this setting (at a degree above 1,
        the busiest rank's rows of them) and read their peak memory."""
        measurement = Measurement(seq_len, rows, recompute)
        if hasattr(self.model, "recompute"):
            self.model.recompute = recompute
        generator = torch.Generator().manual_seed(seq_len)
        windows = torch.randint(0, self.vocab, (update_rows, seq_len + 1), generator=generator)
        windows = windows[: rank_rows(update_rows, rows, self.degree)]
        engine = arena = None
        try:
            if self.cuda:
                torch.cuda.empty_cache()
                if self.capturable:
                    arena = Arena(self.device)
                # After the arena's fill (one block of nearly the whole GPU, allocated and freed):
                # from here the peak counts what the setting takes out of the arena.
                torch.cuda.reset_peak_memory_stats(self.device)
                if arena is not None:
                    engine = self._graph_engine(rows, seq_len, arena)
                if engine is None:
                    engine = EagerEngine(self.model, self.optimizer, rows)
            else:
                assert self.meter is not None
                self.meter.reset()
                engine = EagerEngine(self.model, self.optimizer, rows)
            for _ in range(WARMUP_UPDATES):
                engine.run_update(windows, TUNE_LR, 0.0)
            self._synchronize()
            started = time.perf_counter()
            timed = TIMED_UPDATES[self.device.type]
            for _ in range(timed):
                engine.run_update(windows, TUNE_LR, 0.0)
            self._synchronize()
            seconds = (time.perf_counter() - started) / timed
            measurement.tokens_per_s = update_rows * seq_len / seconds
            measurement.peak_bytes = (
                torch.cuda.max_memory_allocated(self.device)
                if self.meter is None
                else self.static_bytes + self.meter.peak()
            )
        except (torch.OutOfMemoryError, RuntimeError) as error:
            if not is_out_of_memory(error):
                raise
            measurement.note = "out of memory"
            return measurement
        finally:
            if engine is not None:
                engine.close()
            del engine
            if arena is not None:
                gc.collect()
                release_step_caches(self.model)
                arena.close()
            self.optimizer.zero_grad()
        measurement.fits = measurement.peak_bytes <= self.budget
        if not measurement.fits:
            measurement.note = "over budget"
        return measurement

    def _graph_engine(self, rows: int, seq_len: int, arena: Arena) -> GraphEngine | None:
        """A CUDA-graph engine, or None for a model whose step cannot be captured (the trainer then
        trains it eagerly too, and so it is measured eagerly from here on)."""
        try:
            return GraphEngine(self.model, self.optimizer, rows, seq_len, arena)
        except RuntimeError as error:
            if is_out_of_memory(error):
                raise
            self.capturable = False
            self.optimizer.zero_grad()
            return None

    def _synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


# -- the command ----------------------------------------------------------------------------------


def tune_line(
    line: Path | str, *, shared: bool = False, budget_gb: float | None = None, max_rows: int | None = None
) -> TuneResult:
    """Measure every length of the line's plan and write the fastest fitting settings into run.json."""
    layout = open_line(line)
    pid = running_trainer(layout)
    if pid is not None:
        raise LineError(
            f"{layout.root}: its trainer is running (pid {pid}); tune measures the line's model alone"
        )
    refuse_an_unwritable_directory(layout.root, "tune (its run.json)")  # minutes of measuring, then the write
    config = RunConfig.load(layout.run_json)
    reserve_bytes = config.guards.shared_tune_reserve_bytes(str(layout.run_json)) if shared else 0
    device = resolve_device(config.device, f"{layout.run_json}: device")  # the line's file, named
    degree = config.parallel.degree
    budget = memory_budget(device, budget_gb, reserve_bytes)
    threads_before = torch.get_num_threads()
    threads = None
    if device.type == "cpu":
        # The ranks of a CPU line share the host: each has its part of the memory and of the cores.
        budget //= degree
        threads = max(1, threads_before // degree)
        torch.set_num_threads(threads)
    try:
        tuner = Tuner(config, device, budget, max_rows)
        tunings = [
            tuner.tune_length(seq_len, current_rows(config, seq_len, shared))
            for seq_len in sorted({stage.seq_len for stage in config.plan})
        ]
    finally:
        torch.set_num_threads(threads_before)
    missing = [tuning.seq_len for tuning in tunings if tuning.chosen is None]
    if missing:
        recomputing = " with recomputation" if len(recompute_choices(tuner.model)) > 1 else ""
        per_rank = f" a rank ({degree} ranks share the CPU's memory)" if degree > 1 and threads is not None else ""
        raise LineError(
            f"tune: no setting of length {missing[0]} fits {budget / GIB:.2f} GiB{per_rank} "
            f"(not even 1 row per micro-batch{recomputing})"
        )
    write_lengths(layout.run_json, tunings, shared)
    return TuneResult(
        torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        budget,
        tunings,
        shared,
        degree,
        threads,
    )


def current_rows(config: RunConfig, seq_len: int, shared: bool) -> int | None:
    """The micro-batch rows the line trains `seq_len` with: its `shared` shape's with --shared
    (None where none was tuned yet), else its own."""
    entry = config.length(seq_len)
    if shared:
        return entry.shared.micro_batch_rows if entry.shared is not None else None
    return entry.micro_batch_rows


def write_lengths(run_json: Path, tunings: list[LengthTuning], shared: bool) -> RunConfig:
    """Put the chosen settings into run.json's `lengths` (re-read now: a concurrent edit is kept)."""
    config = RunConfig.load(run_json)
    lengths = {entry.seq_len: entry for entry in config.lengths}
    for tuning in tunings:
        chosen = tuning.chosen
        assert chosen is not None
        entry = lengths.get(tuning.seq_len, LengthConfig(tuning.seq_len))
        if shared:
            entry = dataclasses.replace(
                entry, shared=SharedShapeConfig(chosen.micro_batch_rows, chosen.recompute)
            )
        else:
            entry = dataclasses.replace(
                entry, micro_batch_rows=chosen.micro_batch_rows, recompute=chosen.recompute
            )
        lengths[tuning.seq_len] = entry
    config.lengths = [lengths[seq_len] for seq_len in sorted(lengths)]
    config.validate(source=str(run_json))
    with failed_writes_said("tune", run_json):  # after minutes of measuring: the table is lost, run.json as it was
        config.save(run_json)
    return config


def format_table(result: TuneResult) -> list[str]:
    """The table `nsconsole tune` prints: every setting tried, the chosen one marked."""
    if result.degree == 1:
        head = f"device {result.device}, budget {result.budget_bytes / GIB:.2f} GiB"
    else:
        cores = "" if result.threads is None else f" on {result.threads} thread(s)"
        head = (f"device {result.device}, parallel.degree {result.degree}: each setting timed on the busiest "
                f"rank's share of an update{cores}, budget {result.budget_bytes / GIB:.2f} GiB a rank")  # fmt: skip
    lines = [head + (" (shared shapes)" if result.shared else "")]
    lines.append(f"{'seq_len':>8} {'rows':>5} {'recompute':>12} {'tokens/s':>12} {'peak GiB':>9}  note")
    for tuning in result.lengths:
        chosen = tuning.chosen
        for m in tuning.measurements:
            speed = f"{m.tokens_per_s:,.0f}" if m.tokens_per_s is not None else "-"
            peak = f"{m.peak_bytes / GIB:.3f}" if m.peak_bytes is not None else "-"
            mark = "chosen" if m is chosen else m.note
            lines.append(
                f"{m.seq_len:>8} {m.micro_batch_rows:>5} {m.recompute:>12} {speed:>12} {peak:>9}  {mark}"
            )
    return lines
