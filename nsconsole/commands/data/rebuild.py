"""`nsconsole data rebuild`: rebuild a cycle from its manifest, byte for byte (or its manifest)."""

from __future__ import annotations

import argparse

from nsconsole.commands.data.paths import data_line_path


def run_rebuild(args: argparse.Namespace) -> int:
    from datalines import open_data_line
    from datalines.consumption import consumer_of
    from datalines.errors import ManifestDamaged
    from datalines.manifest import MANIFEST_NAME, load_manifest
    from datalines.preparer import rebuild_cycle, restore_manifest
    from datalines.service import lock_for_rebuild

    line = open_data_line(data_line_path(args, args.work))
    directory = line.cycle_dir(args.cycle)
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
    print(f"cycle {args.cycle} rebuilt: every shard matches its manifest byte for byte")
    consumer = consumer_of(line.path, args.cycle)
    if consumer is not None:
        by = f" by {consumer.line}" if consumer.line else ""
        print(f"cycle {args.cycle} stays consumed{by}: the preparer deletes its shards again at its next round "
              f"(a rollback to before it reopens it)")  # fmt: skip
    return 0
