"""`nsconsole data init`: create a data line (from a recipe, the embedded demo, or --like another)."""

from __future__ import annotations

import argparse

from nsconsole.commands.data.paths import data_line_path, host_path


def run_init(args: argparse.Namespace) -> int:
    from datalines.creation import EMBEDDED_CYCLE_TOKENS, init_data_line, init_embedded_line
    from datalines.errors import DataLineError

    if args.like is not None:
        others = (("--embedded", args.embedded or None), ("--recipe", args.recipe), ("--eos-id", args.eos_id),
                  ("--cycle-tokens", args.cycle_tokens), ("--tokenizer", args.tokenizer),
                  ("--calibration-from", args.calibration_from))  # fmt: skip
        given = [flag for flag, value in others if value is not None]
        if given:
            raise DataLineError(f"data init --like takes everything from {args.like}; drop {', '.join(given)}")
        from datalines.identical import init_like_line

        like = data_line_path(args, args.like)
        line = init_like_line(data_line_path(args, args.work), like)
        print(f"data line {line.path}: identical to {like} (sources {', '.join(line.sources)}, "
              f"vocab {line.vocab_size}, {line.cycle_tokens:,} tokens per cycle)")  # fmt: skip
        return 0
    if args.cycle_tokens is not None and not args.cycle_tokens.is_integer():
        raise DataLineError(f"--cycle-tokens must be a whole number, got {args.cycle_tokens}")
    if args.embedded:
        if args.recipe or args.eos_id is not None or args.tokenizer or args.calibration_from:
            raise DataLineError(
                "data init --embedded takes no --recipe, --eos-id, --tokenizer or --calibration-from "
                "(it trains its own tokenizer and calibrates on it)"
            )
        cycle_tokens = EMBEDDED_CYCLE_TOKENS if args.cycle_tokens is None else int(args.cycle_tokens)
        line = init_embedded_line(data_line_path(args, args.work), cycle_tokens)
    else:
        missing = [flag for flag, value in (("--recipe", args.recipe), ("--eos-id", args.eos_id),
                                            ("--cycle-tokens", args.cycle_tokens)) if value is None]
        if missing:
            raise DataLineError(f"data init needs {', '.join(missing)} (or --embedded)")
        host = args.host_settings
        named = data_line_path(args, args.calibration_from) if args.calibration_from else None
        calibration_from = named or host_path(host.calibration_from)
        line = init_data_line(
            data_line_path(args, args.work), args.recipe, args.eos_id, int(args.cycle_tokens), args.tokenizer,
            default_tokenizer=host_path(host.tokenizer), calibration_from=calibration_from,
        )  # fmt: skip
    last = line.last_cycle()
    print(
        f"data line {line.path}: sources {', '.join(line.sources)}, vocab {line.vocab_size}, "
        f"eos {line.eos_id}, "
        f"{line.cycle_tokens:,} tokens per cycle" + (f", last cycle {last}" if last is not None else "")
    )
    taken = line.config.get("calibration_from")
    if taken:
        print(f"calibration of {', '.join(taken['sources'])} taken from {taken['line']}")
    return 0
