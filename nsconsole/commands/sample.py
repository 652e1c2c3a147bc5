"""`nsconsole sample CHECKPOINT|LINE`: continue a prompt from a checkpoint alone, streamed as it comes."""

from __future__ import annotations

import argparse
import sys
import time

from nsconsole.commands.generating import add_generation_arguments, open_model
from nsconsole.commands.parser import add_command

HELP = "CHECKPOINT|LINE: generate text from a checkpoint alone, streamed as it comes"
DESCRIPTION = """\
Load a checkpoint by itself (its weights, preset, overrides and the tokenizer it carries; every
file checked against its hashes first; no data line is read) and continue --prompt, or a new
document when there is none, by --tokens tokens, printed as they come. A LINE stands for the
checkpoint its `latest` names. The prompt follows the document separator, as a document starts
in the training rows. Each token costs what the family's decoder costs: the recurrent state for
PSSA and NS, a KV cache for the transformer (whose windows of context_len it keeps, as training
did). What was sampled, on which device and at which seed goes to stderr; the text to stdout.
"""
EXAMPLES = """\
examples:
  nsconsole sample runs/trunk --prompt "The river" --tokens 200
  nsconsole sample runs/trunk/checkpoints/u00030000 --seed 7 --temperature 0.7 --top-p 0.9
  nsconsole sample runs/trunk --ema --device cpu
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(subparsers, "sample", summary=HELP, description=DESCRIPTION, examples=EXAMPLES)
    add_generation_arguments(parser, "tokens to generate (default 200)", 200)
    parser.add_argument("--prompt", default="", metavar="TEXT", help="the text to continue (default: none)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from engine.generation.session import generation_precision
    from engine.generation.text import TextStream

    loaded, settings = open_model(args)
    session = loaded.session(settings)
    stream = TextStream(loaded.tokenizer)
    with generation_precision(loaded.device):
        prompt = loaded.prompt_ids(args.prompt)
        started = time.perf_counter()
        session.feed(prompt)
        prefilled = time.perf_counter()
        sys.stdout.write(args.prompt)
        for token in session.generate(args.tokens):
            sys.stdout.write(stream.push(token))
            sys.stdout.flush()
        finished = time.perf_counter()
    sys.stdout.write(stream.flush() + "\n")
    generated = finished - prefilled
    print(f"prompt {len(prompt)} tokens in {1e3 * (prefilled - started):.0f} ms; {args.tokens} tokens in "
          f"{1e3 * generated:.0f} ms ({args.tokens / generated:,.0f} tokens/s)", file=sys.stderr)  # fmt: skip
    return 0
