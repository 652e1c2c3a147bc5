"""The texts of `nsconsole data --help` and of each subcommand's `--help`."""

from __future__ import annotations

SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "init": (
        "create a data line (pins inputs, calibrates)",
        """\
Create a data line in --work: pin every input (hub commit shas, each file's sha256, the
tokenizer's sha256), calibrate the tokens per byte of every stratum and plan the cycles.
--embedded makes the demo line from the Python standard library, with a byte-level BPE (vocab
8192) trained on the spot; a line from a recipe needs --recipe, --eos-id and --cycle-tokens (and
a tokenizer: --tokenizer, else the recipe's, else host.json's `tokenizer`). --calibration-from
(default: host.json's `calibration_from`) names a data line whose calibration a source takes
when its files, tokenizer, strata and control markers are that line's, instead of measuring it.
--like DATA makes a line identical to DATA (its recipe, pins, tokenizer, EOS id, cycle size and
calibration: the same cycles and held-out rows, byte for byte), for a second training line on
the same data: a data line is consumed by the line that trains on it.
""",
        """\
examples:
  nsconsole data init --work lines/demo --embedded
  nsconsole data init --work lines/trunk --recipe recipe.json --tokenizer tok.json --eos-id 0 \\
      --cycle-tokens 2e10
  nsconsole data init --work lines/trunk-b --like lines/trunk
""",
    ),
    "val": (
        "build validation rows from the held-out documents",
        """\
Build validation rows of --seq-len tokens (and of --long-seq-len, for the long-row probes) from
the held-out documents of every source, every stratum at its share, into <work>/val/T<length>/.
The defaults are what `nsconsole new` gives a line: 4096, and 32768, the longest context of the
presets (--long-seq-len 0: none); --line LINE builds the lengths that training line validates at.
A --long-seq-len must be above --seq-len; a --seq-len at or above the default long length gets no
long rows unless a longer --long-seq-len is given.
A trainer refuses to start without the rows of every length it validates at. Each length is
built on its own: one that no source has a row of is left out, with a line saying by how many
tokens each source falls short, and the exit status is 1; the others are built all the same.
""",
        """\
examples:
  nsconsole data val --work lines/trunk
  nsconsole data val --work lines/trunk --seq-len 4096 --long-seq-len 32768
  nsconsole data val --work lines/demo --line runs/demo
""",
    ),
    "run-preparer": (
        "keep the next cycles ready (download, tokenize, delete)",
        """\
Keep the next --ahead cycles ready: download, tokenize and write each cycle's shards (retrying
failures that may pass with backoff: the hub down, a full disk), wait while free disk is below
the next cycle's downloads plus --min-free-gb, delete the shards of consumed cycles. Runs until
interrupted, or with --once until the wanted cycles are ready; its state is in
<work>/preparer.json. A file whose bytes are not all UTF-8 is read all the same (as U+FFFD), with
a warning naming it and how many bytes. A training line's supervisor runs one itself.

exit status: 0 done (every cycle consumed, or with --once the cycles wanted ready); 78 stopped on a
failure that does not pass by itself (a source used up, a pinned file changed or gone, a
dataline.json that no longer parses): one line with its reason and what to do, also in
preparer.json (state `failed`); a supervisor does not restart it until the line starts again;
2 refused (e.g. another preparer runs on the line).
""",
        """\
examples:
  nsconsole data run-preparer --work lines/trunk --ahead 2
  nsconsole data run-preparer --work lines/demo --once
""",
    ),
    "status": (
        "cycles (planned, ready, consumed), validation, preparer",
        """\
Show a data line: its sources' shares, the tokens per cycle, the last cycle (once the data's end
is known), every cycle's state (planned, ready, empty, consumed, reopened: a consumed cycle a
rollback reopened, its shards to rebuild from its manifest, damaged), the validation row lengths
built, the bytes that were not UTF-8 in each prepared cycle (per file; read as U+FFFD) and the
preparer's state (one stopped for good: why, and what to do; a damaged preparer.json: named, in
one line); --json prints it as one JSON object. Exit status 0 when no cycle is damaged, 1 when
one is (each named with its damaged files, as above; `data rebuild` repairs it), 2 when the data
line itself cannot be read (one line naming the file), 3 when no cycle is damaged but its preparer
stopped for good and none runs (a cron job's cue that the line will wait for data).
""",
        """\
examples:
  nsconsole data status --work lines/trunk
  nsconsole data status --work lines/trunk --json
""",
    ),
    "schedule": (
        "append a piece of shares to the schedule's end",
        """\
Append a piece to the line's schedule: from the cycle boundary --from-tokens (after the last
piece's start) the sources are mixed at --shares (normalised). The schedule is append-only; a
piece applies from the first cycle starting at or after it.
""",
        """\
examples:
  nsconsole data schedule --work lines/trunk --from-tokens 6e10 --shares '{"web": 0.5, "chat": 0.5}'
""",
    ),
    "rebuild": (
        "rebuild a cycle from its manifest, byte for byte",
        """\
Rebuild a cycle's shards from its permanent manifest (its plan, the pinned inputs and the
tokenizer) and check every shard against the manifest byte for byte, or fail naming the
difference. Refused while a preparer runs on the line (it rebuilds the damaged and reopened
cycles it keeps ready itself), and a preparer is refused while it runs (a line's supervisor
starts its own once it ends). The hub files it downloads again are deleted after it, unless a
cycle still to be prepared reads them.
""",
        """\
examples:
  nsconsole data rebuild --work lines/trunk --cycle 3
""",
    ),
    "tokenizer": (
        "train a byte-level BPE tokenizer",
        """\
Train a byte-level BPE tokenizer of --vocab tokens on every --source (a directory of text, jsonl
or parquet files, or `embedded`: the Python standard library), or on the sources of --recipe
(each with its include, text_field and held-out fraction, as data init reads them; local and
embedded sources), and write it to --out as a tokenizers JSON (an existing --out is refused, unless
--force). Held-out documents are left out.
The special tokens get ids 0, 1, ... (default: <|endoftext|>; a recipe's control markers follow).
""",
        """\
examples:
  nsconsole data tokenizer --train --source /data/chat --source /data/web --vocab 8192 --out tok.json
  nsconsole data tokenizer --train --recipe recipe.json --vocab 8192 --out tok.json
  nsconsole data tokenizer --train --source embedded --vocab 2048 --out stdlib.json
""",
    ),
}
"""Each subcommand's summary (its line in `nsconsole data --help`), description and examples."""
DESCRIPTION = """\
Data lines: directories of pre-tokenized data trained in fixed-size cycles, every input pinned so
that any cycle can be rebuilt byte for byte. Create one (init), build its validation rows (val),
keep its next cycles ready (run-preparer), inspect it (status), extend its schedule (schedule),
rebuild a cycle (rebuild); train a tokenizer (tokenizer). A data line named by --work, --like or
--calibration-from is found as every LINE and `new --data DIR` are: a relative path that does
not exist relative to the current directory is taken under host.json's `work_root` (without one,
under ~/.nsconsole/lines where it exists there), so `data init --work lines/d` makes the line
that `nsconsole new ... --data lines/d` finds.
"""
EXAMPLES = """\
examples:
  nsconsole data init --work lines/demo --embedded
  nsconsole data val --work lines/demo --seq-len 256
  nsconsole data status --work lines/demo
"""
