"""`nsconsole data rebuild`: rebuild a cycle from its manifest, byte for byte (or its manifest)."""

from __future__ import annotations

import argparse

from nsconsole.commands.data.paths import data_line_path


def run_rebuild(args: argparse.Namespace) -> int:
    from datalines import open_data_line
    from datalines.consumption import consumer_of
    from datalines.errors import DataLineError, ManifestDamaged
    from datalines.manifest import MANIFEST_NAME, load_manifest
    from datalines.preparer import rebuild_cycle, restore_manifest
    from datalines.service import lock_for_rebuild

    line = open_data_line(data_line_path(args, args.work))
    last = line.last_cycle()
    if args.cycle < 0 or (last is not None and args.cycle > last):
        # Not "not prepared yet" (the loader's word for a cycle still to come): it never will be.
        cycles = f"cycles 0 to {last}" if last is not None else "cycles from 0"
        raise DataLineError(f"{line.path}: has no cycle {args.cycle} ({cycles}); --cycle names one of them")
    directory = line.cycle_dir(args.cycle)
    try:
        # The preparer's lock: a preparer at the same time would write the same cycle and downloads.
        with lock_for_rebuild(line, args.cycle):
            try:
                load_manifest(directory)
            except ManifestDamaged as damage:
                # Written again only where the shards there prove it (restore_manifest), else refused.
                plan = restore_manifest(line, args.cycle, damage)
                print(f"cycle {args.cycle}: {directory / MANIFEST_NAME} written again from {plan}: "
                      f"every shard there matches it byte for byte")  # fmt: skip
                return 0
            rebuild_cycle(line, args.cycle)
    except OSError as error:  # a full disk, say: one line naming the file, not a traceback
        named = error.filename if error.filename is not None else directory
        raise DataLineError(
            f"{named}: {error.strerror or error} (the rebuild stopped there; free some space if the disk is full, "
            "and run it again)"
        ) from None
    print(f"cycle {args.cycle} rebuilt: every shard matches its manifest byte for byte")
    consumer = consumer_of(line.path, args.cycle)
    if consumer is not None:
        by = f" by {consumer.line}" if consumer.line else ""
        print(f"cycle {args.cycle} stays consumed{by}: the preparer deletes its shards again at its next round "
              f"(a rollback to before it reopens it)")  # fmt: skip
    return 0
