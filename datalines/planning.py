"""Cycle planning: which documents of which files each cycle takes, decided from pinned inputs only.

Sizes are planned in estimated tokens: a document of b text bytes in stratum k counts b x the
stratum's calibrated tokens per text byte, plus its EOS. A cycle of C tokens gives source s the
target C x share_s (the shares in force at the cycle's start).

A source is read as one stream of documents in which every stretch holds every stratum at its
share. A stratum is itself a stream: its files in pinned order, each file's training documents
in their shuffled order. Stratum k, with share f_k of the source's estimated tokens of text
(`calibration.stratum_shares`), places a document whose middle lies t tokens of text into its
own stream at the source position t / f_k (rounded to a whole token); the source's stream takes
the strata's documents in the order of those positions (ties: stratum name), so after any
stretch of it each stratum is within about one of its documents of its share.

A cycle takes the source's next documents up to its target, each cut at the document end
nearest to it: a document whose middle would fall past the target waits for the next cycle
(with the rest of its stratum) while the other strata go on filling this one. So a cycle is
over its target by at most half its last document and short of it by less than half of a
document that waits: its size give or take one document. The first document is taken whatever
its size, so no cycle is empty. A document is never split across cycles (a shard holds whole
documents, each closed by its EOS): one larger than a cycle makes a cycle of its own, that much
larger. Each cycle is planned at its own size; what one cycle was over or under is not owed by
the next, so no cycle shrinks to pay back a large document. The strata's shares hold over the
whole line because the merge order is global; a stratum whose documents are larger than its
share of a cycle skips some cycles.

The corpus end (max epochs 1, every token trained once). `at_corpus_end: error`: a cycle that
the source's stream cannot fill, or that reads past the point where one of the source's strata
ran out, raises `SourceExhausted` (a stratum none of whose documents are for training, all held
out, has nothing to run out of). `last_cycle`: a cycle after which some source would have less
than `LAST_CYCLE_MIN_FILL` of its target left is the last one and takes the rest of every
source, so the last cycle holds between half a cycle and about one and a half. In either mode a
cycle in which a source with a share gets no document is never planned.

A plan is a pure function of the previous plan's end state and the pinned inputs; it is written
once (`plans/cNNNN.json`) and never changes, which is what lets `data rebuild` redo a cycle.
"""

from __future__ import annotations

import contextlib
import heapq
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from datalines.calibration import stratum_shares as stratum_shares_of
from datalines.corpus import DocumentLengths
from datalines.errors import DataLineError, SourceExhausted
from datalines.files import directory_lock, read_json, write_json_atomic

if TYPE_CHECKING:
    from datalines.dataline import DataLine

LAST_CYCLE_MIN_FILL = 0.5
"""In `last_cycle` mode a cycle is the last when what would remain after it is under this part of a target."""
EXHAUSTED_SHORTFALL = 0.01
"""In `error` mode a source is used up when a cycle would fall short of its target, or read past the
end of one of its strata, by more than this part of the target."""


@dataclass
class StratumCursor:
    """Where a stratum's stream stands after a cycle: its next document and what came before it."""

    file: int
    """Position in the stratum's file list (not the source's file index)."""
    document: int
    """The next training document of that file."""
    taken_bytes: int
    """Text bytes of the stratum's documents taken by this cycle and every one before it."""

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "document": self.document, "taken_bytes": self.taken_bytes}


def plan_path(line: DataLine, index: int) -> Path:
    return line.path / "plans" / f"c{index:04d}.json"


def load_plan(line: DataLine, index: int) -> dict[str, Any] | None:
    path = plan_path(line, index)
    return read_json(path) if path.exists() else None


@contextlib.contextmanager
def plans_lock(line: DataLine) -> Iterator[None]:
    """An exclusive flock on the line's `plans` directory, held while a plan is written and while
    `data schedule` checks that no cycle its piece covers is planned and writes the schedule: of
    the two, the one that comes second sees what the first did (short: planning itself runs outside)."""
    directory = line.path / "plans"
    directory.mkdir(exist_ok=True)
    with directory_lock(directory):
        yield


def ensure_plan(line: DataLine, index: int) -> dict[str, Any]:
    """The plan of cycle `index`, planning it (and every earlier cycle) first if need be.

    A plan takes the shares of the schedule as it is when the plan is written (`data schedule` may
    have grown it since `line` was opened): a schedule grown while the cycle was being planned
    gets it planned again."""
    existing = load_plan(line, index)
    if existing is not None:
        return existing
    previous = ensure_plan(line, index - 1) if index > 0 else None
    if previous is not None and previous["last"]:
        raise DataLineError(f"{line.path}: cycle {index} is past the line's last cycle {index - 1}")
    line.refresh_recipe()
    while True:
        plan = Planner(line).plan(index, previous)
        with plans_lock(line):
            if not line.refresh_recipe():
                write_json_atomic(plan_path(line, index), plan)
                return plan


def plan_files(plan: dict[str, Any]) -> dict[str, set[int]]:
    """Source -> indices of the files the plan's cycle reads."""
    return {
        name: {file_index for stratum in source["strata"].values() for file_index, _, _ in stratum["ranges"]}
        for name, source in plan["sources"].items()
    }


def files_to_read(line: DataLine, index: int) -> dict[str, set[int]]:
    """Source -> indices of the files preparing cycle `index` reads: its plan's, or, before it is
    planned, an estimate (`_estimated_files`).

    Wanted before the cycle is planned: planning reads the files it plans (their documents'
    lengths), so the disk for their downloads must be there first.
    """
    plan = load_plan(line, index)
    if plan is not None:
        return plan_files(plan)
    previous = load_plan(line, index - 1) if index > 0 else None
    shares = line.recipe.shares_at(index * line.cycle_tokens)
    # In `last_cycle` mode every cycle looks that far past its target for what would be left.
    reach = 1 + LAST_CYCLE_MIN_FILL if line.recipe.at_corpus_end == "last_cycle" else 1.0
    return {
        name: _estimated_files(line, name, previous, line.cycle_tokens * shares[name] * reach)
        if shares[name] > 0
        else set()
        for name in line.sources
    }


def _estimated_files(line: DataLine, name: str, previous: dict[str, Any] | None, tokens: float) -> set[int]:
    """The files of source `name` a cycle of `tokens` of it reads, estimated from pins alone: each
    stratum's files from where `previous` left it (the stream's start without one) until their text,
    by the calibrated rates and the files' pinned sizes, holds the stratum's share of the tokens.
    The file the stratum stands in counts for what of it the earlier cycles have not taken."""
    source = line.source(name)
    calibration = line.calibration[name]
    files: set[int] = set()
    for stratum, share in stratum_shares_of(source, calibration).items():
        rates = calibration[stratum]
        indices = [number for number, file in enumerate(source.files) if file.stratum == stratum]
        text = [source.files[number].size * rates["text_bytes_per_file_byte"] for number in indices]
        cursor = _cursor_after(line, previous, name, stratum)
        taken_from_current = max(0.0, cursor.taken_bytes - sum(text[: cursor.file]))
        wanted = tokens * share / rates["tokens_per_text_byte"]
        found = 0.0
        for position in range(cursor.file, len(indices)):
            if found >= wanted:
                break
            files.add(indices[position])
            left = text[position] - (taken_from_current if position == cursor.file else 0.0)
            found += max(0.0, left)
    return files


def _cursor_after(
    line: DataLine, previous: dict[str, Any] | None, source: str, stratum: str
) -> StratumCursor:
    """The stratum's cursor at the end of the previous plan (the stream's start for cycle 0)."""
    if previous is None:
        return StratumCursor(0, 0, 0)
    end = previous["end"][source][stratum]
    try:
        return StratumCursor(int(end["file"]), int(end["document"]), int(end["taken_bytes"]))
    except KeyError as missing:
        raise DataLineError(
            f"{plan_path(line, previous['cycle'])}: the plan's end has no {missing}; it was planned by an "
            f"earlier nsconsole whose cycles could be empty or far off their size: create the line anew"
        ) from None


class StratumStream:
    """One stratum's documents in stream order, from its cursor on (see the module docstring)."""

    def __init__(
        self,
        name: str,
        files: list[int],
        lengths: DocumentLengths,
        tokens_per_byte: float,
        share: float,
        cursor: StratumCursor,
    ) -> None:
        self.name = name
        self.files = files
        self.lengths = lengths
        self.tokens_per_byte = tokens_per_byte
        self.share = share
        self.cursor = cursor
        self.ranges: list[list[int]] = []
        """[source file index, first document, end document] of every run taken by this cycle."""
        self.bytes = 0
        """Text bytes taken by this cycle."""

    def estimated_tokens(self, text_bytes: int, documents: int) -> float:
        """Tokens of that much text of the stratum in that many documents (each closed by an EOS)."""
        return text_bytes * self.tokens_per_byte + documents

    def position(self, text_bytes: float) -> int:
        """The source position of the point `text_bytes` into the stratum's stream.

        In estimated tokens of text (the unit of the stratum's share), rounded to whole tokens so
        that points equal but for float rounding tie, and ties go by stratum name: a stratum of a
        single document (`strata: files`) has its middle halfway through the source like every
        other such stratum, so those strata follow in file order.
        """
        return round(text_bytes * self.tokens_per_byte / self.share)

    def next_length(self) -> int | None:
        """The next document's byte length, moving past used-up files; None when the stratum has run out."""
        cursor = self.cursor
        while cursor.file < len(self.files):
            lengths = self.lengths.of(self.files[cursor.file])
            if cursor.document < len(lengths):
                return int(lengths[cursor.document])
            cursor.file, cursor.document = cursor.file + 1, 0
        return None

    def next_document(self) -> tuple[int, float] | None:
        """The source position of the next document's middle and its estimated tokens; None once run out."""
        length = self.next_length()
        if length is None:
            return None
        return self.position(self.cursor.taken_bytes + length / 2), self.estimated_tokens(length, 1)

    def end(self) -> int:
        """The source position where what the stratum has taken so far ends."""
        return self.position(self.cursor.taken_bytes)

    def take(self, count: int) -> float:
        """Take the next `count` documents of the current file; their estimated tokens."""
        cursor = self.cursor
        file_index = self.files[cursor.file]
        start, end = cursor.document, cursor.document + count
        text_bytes = int(self.lengths.of(file_index)[start:end].sum())
        if self.ranges and self.ranges[-1][0] == file_index and self.ranges[-1][2] == start:
            self.ranges[-1][2] = end
        else:
            self.ranges.append([file_index, start, end])
        cursor.document = end
        cursor.taken_bytes += text_bytes
        self.bytes += text_bytes
        return self.estimated_tokens(text_bytes, count)

    def take_rest(self) -> float:
        """Take every document left (the last cycle); their estimated tokens."""
        tokens = 0.0
        while self.next_length() is not None:
            tokens += self.take(len(self.lengths.of(self.files[self.cursor.file])) - self.cursor.document)
        return tokens

    def tokens_left(self, enough: float) -> float:
        """Estimated tokens left in the stratum, counted only until they reach `enough`."""
        left = 0.0
        position, document = self.cursor.file, self.cursor.document
        while position < len(self.files) and left < enough:
            lengths = self.lengths.of(self.files[position])[document:]
            left += self.estimated_tokens(int(lengths.sum()), len(lengths))
            position, document = position + 1, 0
        return left


class SourceStream:
    """A source's strata merged into one stream of documents (see the module docstring)."""

    def __init__(self, strata: list[StratumStream]) -> None:
        self.strata = strata
        self.queue: list[tuple[int, int, float]] = []
        """(source position of the next document's middle, stratum number, the document's estimated
        tokens) of every stratum not run out."""
        for number in range(len(strata)):
            self._enqueue(number)
        self.position = 0
        """The source position of the middle of the last document taken (where the stream stands)."""
        self.tokens = 0.0
        """Estimated tokens taken by this cycle."""

    def _enqueue(self, number: int) -> None:
        document = self.strata[number].next_document()
        if document is not None:
            heapq.heappush(self.queue, (document[0], number, document[1]))

    def take(self, target: float) -> None:
        """Take documents in stream order up to `target` tokens, each cut at the document end nearest to it.

        A document whose middle lies past the target waits for the next cycle, and so does the rest
        of its stratum; the other strata go on filling the cycle. So a large document never leaves
        the cycle before it short: the cycle ends within half of the smallest document that waits.
        The first document is taken whatever its size (no cycle is empty).
        """
        waiting: list[tuple[int, int, float]] = []
        while self.queue and self.tokens < target:
            middle, number, tokens = heapq.heappop(self.queue)
            if self.tokens > 0 and self.tokens + tokens / 2 > target:
                waiting.append((middle, number, tokens))
                continue
            self.tokens += self.strata[number].take(1)
            self.position = max(self.position, middle)
            self._enqueue(number)
        for entry in waiting:
            heapq.heappush(self.queue, entry)

    def take_rest(self) -> None:
        self.tokens += sum(stratum.take_rest() for stratum in self.strata)
        self.queue = []

    def tokens_left(self, enough: float) -> float:
        """Estimated tokens left in the source, counted only until they reach `enough`."""
        left = 0.0
        for stratum in self.strata:
            left += stratum.tokens_left(enough - left)
        return left

    def ran_out(self) -> list[StratumStream]:
        """Strata that gave training documents and have none left."""
        return [
            stratum for stratum in self.strata if stratum.cursor.taken_bytes and stratum.next_length() is None
        ]


class Planner:
    def __init__(self, line: DataLine) -> None:
        self.line = line
        self.lengths = {name: DocumentLengths(line.source(name), line.recipe.seed) for name in line.sources}

    def strata(self, name: str, previous: dict[str, Any] | None) -> list[StratumStream]:
        """The source's strata, each from where the previous cycle left it (nothing is read yet)."""
        line = self.line
        source = line.source(name)
        strata = []
        for stratum, share in stratum_shares_of(source, line.calibration[name]).items():
            files = [index for index, file in enumerate(source.files) if file.stratum == stratum]
            tokens_per_byte = line.calibration[name][stratum]["tokens_per_text_byte"]
            cursor = _cursor_after(line, previous, name, stratum)
            strata.append(StratumStream(stratum, files, self.lengths[name], tokens_per_byte, share, cursor))
        return strata

    def plan(self, index: int, previous: dict[str, Any] | None) -> dict[str, Any]:
        line = self.line
        start_tokens = index * line.cycle_tokens
        shares = line.recipe.shares_at(start_tokens)
        targets = {name: line.cycle_tokens * shares[name] for name in line.sources}
        strata = {name: self.strata(name, previous) for name in line.sources}
        # A source without a share in this piece waits where it is (its files are not even read).
        streams = {name: SourceStream(strata[name]) for name in line.sources if targets[name] > 0}
        for name, stream in streams.items():
            stream.take(targets[name])
        last = line.recipe.at_corpus_end == "last_cycle" and any(
            stream.tokens_left(LAST_CYCLE_MIN_FILL * targets[name]) < LAST_CYCLE_MIN_FILL * targets[name]
            for name, stream in streams.items()
        )
        for name, stream in streams.items():
            if last:
                stream.take_rest()
            self._check_not_used_up(index, name, stream, targets[name])
        return {
            "cycle": index,
            "start_tokens": start_tokens,
            "last": last,
            "sources": {
                name: {
                    "share": shares[name],
                    "target_tokens": targets[name],
                    "planned_tokens": streams[name].tokens if name in streams else 0.0,
                    "strata": {
                        stratum.name: {"bytes": stratum.bytes, "ranges": stratum.ranges}
                        for stratum in strata[name]
                    },
                }
                for name in line.sources
            },
            "end": {
                name: {stratum.name: stratum.cursor.to_json() for stratum in strata[name]}
                for name in line.sources
            },
        }

    def _check_not_used_up(self, index: int, name: str, stream: SourceStream, target: float) -> None:
        """`SourceExhausted` when the cycle has no document of the source or, in error mode, when the
        source cannot fill it (its documents end short of the target, or one of its strata ran out)."""
        reason = ""
        left = "untrained documents left"
        if stream.tokens == 0 and not any(stratum.cursor.taken_bytes for stratum in stream.strata):
            # Never one to give (not "all trained": nothing was): what the user must fix is the source.
            left, reason = "documents to train on", "every document of its files is held out or empty"
        elif stream.tokens == 0:
            reason = "its documents are all trained"
        elif self.line.recipe.at_corpus_end == "error":
            tolerance = EXHAUSTED_SHORTFALL * target
            if stream.tokens < target - tolerance and not stream.queue:
                reason = f"its documents end {target - stream.tokens:,.0f} tokens short of the cycle"
            for stratum in stream.ran_out():
                if stream.position - stratum.end() > tolerance:
                    reason = f"stratum {stratum.name} ran out"
                    break
        if reason:
            raise SourceExhausted(
                f"{self.line.path}: source {name} has no {left} for cycle {index} "
                f"({reason}; max epochs 1)"
            )
