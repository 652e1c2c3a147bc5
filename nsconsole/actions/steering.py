"""The keys that steer a line through its supervisor: `s` stop, `b` branch, `r` rollback, `t` tune.

Each asks what and when (a picker or the branch form), then for confirmation, then calls the
supervisor (`mutate`); until the reply the progress line under every screen says what waits.

A mixin of `nsconsole.app.ConsoleApp`, sharing its state: it uses `live` (its `mutate`), `pending`
(the requests waiting, which it keeps), `_branch_drafts` (the branch form as last sent of each
line), `clock`, the selected line (`Navigation`), `check_action` (`KeySwitches`) and Textual's
`push_screen_wait`, `notify`, `screen_stack` and `refresh_bindings`.
"""

from __future__ import annotations

from pathlib import Path

from textual import work

from engine.config.run import RunConfig
from engine.errors import LineError
from engine.layout import LineLayout
from engine.ops.branch_records import branches_forked_after
from nsconsole.screens.branch_form import BranchForm, BranchRequest
from nsconsole.screens.confirm import ConfirmScreen
from nsconsole.screens.picker import PickerScreen
from nsconsole.state import LineView
from nsconsole.widgets import format as fmt
from nsconsole.widgets.checkpoint_list import CheckpointInfo, read_checkpoints
from nsconsole.widgets.replies import reply_words, request_words, toast_text
from nsconsole.widgets.request_progress import PendingRequest, RequestProgress


class Steering:
    """The stop, branch, rollback and tune keys and the request behind them (mixed into `ConsoleApp`)."""

    @work(group="mutation")
    async def action_stop(self) -> None:
        line = self.selected_line()
        if line is None or not self.check_action("stop", ()):
            return
        options = [("now", "at the next update (with a checkpoint)")]
        if line.cycle is not None:
            options.append(("cycle", f"at the end of the current cycle ({line.cycle})"))
        choice = await self.push_screen_wait(PickerScreen(f"Stop {line.name}: when?", options))
        if choice is None:
            return
        at_cycle_end = line.cycle if choice == "cycle" else None
        when = "at the next update" if at_cycle_end is None else f"at the end of cycle {at_cycle_end}"
        if await self.push_screen_wait(ConfirmScreen(f"Stop {line.path} {when}?", "It stops with a checkpoint.")):
            await self.mutate(line, "stop", at_cycle_end=at_cycle_end)

    @work(group="mutation")
    async def action_branch(self) -> None:
        line = self.selected_line()
        if line is None or not self.check_action("branch", ()):
            return
        form = BranchForm(line.name, line.path, line.cycle, self._branch_drafts.get(line.key))
        request: BranchRequest | None = await self.push_screen_wait(form)
        if request is None:
            if form.typed is not None:  # cancelled with fields typed: the next `b` reopens them
                self._branch_drafts[line.key] = form.typed
            return
        # Kept until the supervisor takes it: a refusal, or a No, reopens the form as it was typed.
        self._branch_drafts[line.key] = request
        waits = "" if line.cycle is None or request.at_cycle < line.cycle else " It waits for that cycle to end."
        question = f"Branch {line.path} into {request.path} at the end of cycle {request.at_cycle}?"
        trains = f"\nIt trains: {request.stages}" if request.stages else ""
        detail = f"Plan: {request.plan}{trains}\nData line: {request.data}\nA new line is forked with them.{waits}"
        if await self.push_screen_wait(ConfirmScreen(question, detail)) and (
            await self.mutate(line, "branch", **request.params()) is not None
        ):
            del self._branch_drafts[line.key]

    @work(group="mutation")
    async def action_rollback(self) -> None:
        line = self.selected_line()
        if line is None or not self.check_action("rollback", ()):
            return
        checkpoints = read_checkpoints(line.path)
        latest = next((info for info in checkpoints if info.latest), None)
        # A rollback goes back: only checkpoints before the one `latest` names can be chosen.
        earlier = {info.update: info for info in checkpoints if latest is not None and info.update < latest.update}
        options = [
            (str(info.update), f"update {info.update}  {'kept: ' + info.kept if info.kept else 'rolling'}")
            for info in earlier.values()
        ]
        empty = "this line has no checkpoint before its latest one"
        choice = await self.push_screen_wait(PickerScreen(f"Roll {line.name} back to:", options, empty=empty))
        if choice is None:
            return
        question = f"Roll {line.path} back to update {choice}?"
        if await self.push_screen_wait(ConfirmScreen(question, rollback_consequences(line, earlier[int(choice)]))):
            await self.mutate(line, "rollback", to=int(choice))

    @work(group="mutation")
    async def action_tune(self) -> None:
        line = self.selected_line()
        if line is None or not self.check_action("tune", ()):
            return
        reserve = share_reserve_set(Path(line.path) / "run.json")
        options = tune_choices(line.on_cpu, reserve)
        # Without a reserve the supervisor refuses --shared: shown, with why, but not offered.
        unavailable = frozenset({"shared"}) if reserve is False else frozenset()
        choice = await self.push_screen_wait(
            PickerScreen(f"Tune {line.name}'s micro-batch shape for:", options, unavailable=unavailable)
        )
        if choice is None:
            return
        question = f"Tune {line.path} ({dict(options)[choice]})?"
        if await self.push_screen_wait(ConfirmScreen(question, "The line pauses while the shapes are measured.")):
            await self.mutate(line, "tune", shared=choice == "shared")

    async def mutate(self, line: LineView, method: str, **params: object) -> object | None:
        """Call a mutation; the outcome becomes a notification and an event of the line."""
        assert self.live is not None
        line.add_event(self.clock(), "request", f"{request_words(method, params)}: sent")
        request = PendingRequest(line.key, line.name, method, self.clock())
        self.pending.append(request)
        self.refresh_progress()
        try:
            result = await self.live.mutate(line.key, method, **params)
        except LineError as error:
            line.add_event(self.clock(), "refused", f"{method}: {error}", "error")
            # Not markup: a reason may hold brackets (a path, a list) that markup would eat or choke on.
            self.notify(toast_text(f"✗ {line.name}: {method} refused: {error}"), severity="error", timeout=8,
                        markup=False)
            return None
        finally:
            self.pending.remove(request)
            self.refresh_progress()
        summary, details = reply_words(method, result)
        line.add_event(self.clock(), "request", f"{method} accepted: {summary}{details}")
        self.notify(toast_text(f"✓ {line.name}: {method} accepted: {summary}"), timeout=4, markup=False)
        return result

    def refresh_progress(self) -> None:
        """Redraw the progress line of every screen (a request was sent or answered)."""
        if not self.screen_stack:
            return  # the console is closing
        for screen in self.screen_stack:
            for progress in screen.query(RequestProgress):
                progress.show(self.pending, self.clock())
        self.refresh_bindings()


def tune_choices(on_cpu: bool | None, reserve: bool | None = None) -> list[tuple[str, str]]:
    """The tune picker's options, in the words of the line's device (`LineView.on_cpu`; None: not
    known); `reserve` False (run.json sets no guards.share_reserve_gb) says why --shared cannot run."""
    if on_cpu:
        # A CPU tune's budget is a share of the free memory (`engine.ops.tune`); --shared leaves the reserve.
        options = [("alone", "alone on the CPU: up to half the free memory"),
                   ("shared", "beside other processes: less guards.share_reserve_gb (--shared)")]
    else:
        device = "the GPU" if on_cpu is False else "its device"
        options = [("alone", f"{device} to itself"), ("shared", "beside other processes (--shared)")]
    if reserve is False:
        options[1] = ("shared", "beside other processes (--shared): needs guards.share_reserve_gb in run.json")
    return options


def share_reserve_set(run_json: Path) -> bool | None:
    """Whether run.json sets `guards.share_reserve_gb` (what `tune --shared` needs); None when the
    file cannot be read (then the supervisor's own refusal says what is wrong)."""
    try:
        return RunConfig.load(run_json).guards.share_reserve_gb is not None
    except LineError:
        return None


def rollback_consequences(line: LineView, target: CheckpointInfo) -> str:
    """What a rollback to `target` sets aside, in the confirmation's words."""
    update = line.update
    updates = "the updates after it" if update is None else f"updates {target.update + 1}-{update}"
    tokens = None if line.tokens is None or target.tokens is None else line.tokens - target.tokens
    trained = "" if tokens is None else f" ({fmt.count(tokens)} tokens)"
    branches = branches_forked_after(LineLayout(line.path), target.update)
    grown = "" if not branches else (f" Branches forked after it keep their own checkpoints and rows, but the trunk "
                                     f"rows they grew from go with the rest: {', '.join(branches)}.")
    return (f"Sets aside {updates}{trained}: their rows are kept in rows.rolledback-<time>.jsonl and the later "
            f"checkpoints go at the next checkpoint; training resumes from update {target.update}.{grown}")
