"""`nsconsole sample CHECKPOINT|LINE`: continue a prompt from a checkpoint alone, streamed as it comes."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from engine.errors import LineError, NonFiniteLogits
from nsconsole.commands.generating import add_generation_arguments, open_model, read_utf8, utf8_text
from nsconsole.commands.parser import add_command

if TYPE_CHECKING:
    from engine.generation.settings import SamplingSettings
    from engine.generation.text import TextStream

    # Through `generating`, whose import of the loader (torch) is the one the import contract allows.
    from nsconsole.commands.generating import GenerationModel

HELP = "CHECKPOINT|LINE: generate text from a checkpoint alone, streamed as it comes"
DESCRIPTION = """\
Load a checkpoint by itself (its weights, preset, overrides and the tokenizer it carries; every
file checked against its hashes first; no data line is read) and continue --prompt (or the text
of --prompt-file, `-` for stdin), or a new document when there is none, by up to --tokens tokens,
printed as they come; it stops early where the model ends the document (draws the document
separator). A LINE stands for the checkpoint its `latest` names. The prompt follows the document
separator, as a document starts in the training rows. Each token costs what the family's decoder
costs: the recurrent state for PSSA and NS, a KV cache for the transformer (whose windows of
context_len it keeps, as training did). What was sampled, on which device and at which seed goes
to stderr; the text to stdout. Ctrl-C ends the text where it is (exit status 130).
"""
EXAMPLES = """\
examples:
  nsconsole sample runs/trunk --prompt "The river" --tokens 200
  nsconsole sample runs/trunk/checkpoints/u00030000 --seed 7 --temperature 0.7 --top-p 0.9
  nsconsole sample runs/trunk --ema --device cpu --prompt-file chapter.txt
"""

INTERRUPTED = 130
"""The exit status after Ctrl-C: a shell's status of a command ended by SIGINT (128 + 2)."""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(subparsers, "sample", summary=HELP, description=DESCRIPTION, examples=EXAMPLES)
    add_generation_arguments(parser, "most tokens to generate (default 200)", 200)
    prompt = parser.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", default="", metavar="TEXT", help="the text to continue (default: none)")
    prompt.add_argument("--prompt-file", type=Path, default=None, metavar="FILE",
                        help="the text to continue, read from FILE (UTF-8; - for stdin): a prompt longer "
                        "than a command line takes")  # fmt: skip
    parser.set_defaults(func=run)


def prompt_text(args: argparse.Namespace) -> str:
    """--prompt, or the text of --prompt-file read whole (before the checkpoint loads, so a file
    that cannot be read costs no wait)."""
    if args.prompt_file is None:
        return utf8_text(str(args.prompt), "--prompt")
    if str(args.prompt_file) == "-":
        return read_utf8(sys.stdin.read, "stdin (--prompt-file -)")
    try:
        return args.prompt_file.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise LineError(
            f"{args.prompt_file}: --prompt-file is not UTF-8 text ({error.reason} at byte {error.start})"
        ) from None
    except OSError as error:
        raise LineError(f"{args.prompt_file}: --prompt-file cannot be read ({error.strerror})") from None


def run(args: argparse.Namespace) -> int:
    from engine.generation.text import TextStream

    text = prompt_text(args)
    loaded, settings = open_model(args)
    stream = TextStream(loaded.tokenizer)
    report = Report(time.perf_counter())
    status = 0
    failure: NonFiniteLogits | None = None
    try:
        generate(loaded, settings, text, args.tokens, stream, report)
    except KeyboardInterrupt:  # the text so far ends its line, and the report says why it stopped
        report.ending = "; interrupted (Ctrl-C)"
        status = INTERRUPTED
    except NonFiniteLogits as error:
        failure = error
    sys.stdout.write(stream.flush() + "\n")
    sys.stdout.flush()
    if failure is not None:
        raise loaded.overflowed(f"{failure} after {report.generated:,} generated tokens", "generate")
    print(report.line(), file=sys.stderr)
    return status


@dataclass
class Report:
    """The line after the text: the prefill's and the generation's times, and how it ended."""

    started: float
    """When the prompt's prefill began (time.perf_counter)."""
    prompt_tokens: int = 0
    prefilled: float | None = None
    generated: int = 0
    finished: float | None = None
    ending: str = ""
    """Why it stopped before --tokens (the document ended, Ctrl-C), as `; ...`."""

    def line(self) -> str:
        finished = time.perf_counter() if self.finished is None else self.finished
        prefilled = finished if self.prefilled is None else self.prefilled
        seconds = max(finished - prefilled, 1e-9)
        return (f"prompt {self.prompt_tokens:,} tokens in {1e3 * (prefilled - self.started):.0f} ms; {self.generated:,} "
                f"tokens in {1e3 * seconds:.0f} ms ({self.generated / seconds:,.0f} tokens/s){self.ending}")  # fmt: skip


def generate(
    loaded: GenerationModel,
    settings: SamplingSettings,
    text: str,
    tokens: int,
    stream: TextStream,
    report: Report,
) -> None:
    """Prefill the prompt after the separator, then write up to `tokens` tokens to stdout as they
    come, stopping where the model ends the document: what follows the separator is another
    document, nothing of the prompt's."""
    from engine.generation.session import generation_precision

    session = loaded.session(settings)
    with generation_precision(loaded.device):
        prompt = loaded.prompt_ids(text)
        report.prompt_tokens = len(prompt)
        session.feed(prompt)
        report.prefilled = time.perf_counter()
        sys.stdout.write(text)
        for token in session.generate(tokens, stop=loaded.separator):
            if token == loaded.separator:
                report.ending = "; the model ended the document (drew the document separator)"
                break
            report.generated += 1
            sys.stdout.write(stream.push(token))
            sys.stdout.flush()
    report.finished = time.perf_counter()
