"""Rows of tiny fixed-seed CPU lines of every family, to hold a refactor to "behaviour unchanged".

    python bench/fixed_seed_rows.py --out before.json            # on the code before the change
    python bench/fixed_seed_rows.py --compare before.json        # on the code after it

Trains `transformer-tiny`, `ns-tiny` and `pssa-tiny` to the end of the tests' tiny data line
(tests/helpers/lines.py: 42 updates each, validation every 10) on one CPU thread and writes every
row without its wall-clock fields; `--compare` says, per family, whether every row (losses,
gradient norms, learning rates, validation and probes) is bit-identical to the recorded ones
and exits 1 when one is not. Run it from a checkout: the tests' helpers make the data line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402
from helpers.lines import copy_data_line, make_data_line, make_line, rows_without_wall_clock  # noqa: E402

from engine.training.trainer import Trainer  # noqa: E402

PRESETS = ("transformer-tiny", "ns-tiny", "pssa-tiny")


def train_all() -> dict[str, dict]:
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="fixed-seed-rows-"))
    template = make_data_line(work / "template")
    result = {}
    for preset in PRESETS:
        root = work / preset
        # The long-row probe at 64: the tests' data line has held-out rows of 32 and 64 only.
        changes = {"model.preset": preset, "validation.long_seq_len": 64, "validation.every_updates": 10}
        line = make_line(root, copy_data_line(template, root), **changes)
        code = Trainer(line, echo=None).run()
        result[preset] = {"exit": code, "rows": rows_without_wall_clock(line / "rows.jsonl")}
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--out", type=Path, help="write the rows here")
    target.add_argument("--compare", type=Path, help="compare with rows written by --out")
    args = parser.parse_args()
    result = train_all()
    if args.out is not None:
        args.out.write_text(json.dumps(result, sort_keys=True) + "\n")
        for preset, line in result.items():
            print(json.dumps({"preset": preset, "exit": line["exit"], "rows": len(line["rows"])}))
        return 0
    recorded = json.loads(args.compare.read_text())
    same = True
    for preset in PRESETS:
        equal = recorded.get(preset) == result[preset]
        same &= equal
        print(json.dumps({"preset": preset, "rows": len(result[preset]["rows"]), "bit_identical": equal}))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
