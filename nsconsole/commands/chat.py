"""`nsconsole chat CHECKPOINT|LINE`: talk with a checkpoint in the terminal, its state carried."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from engine.errors import NonFiniteLogits
from nsconsole.commands.generating import add_generation_arguments, open_model, read_utf8
from nsconsole.commands.parser import add_command
from nsconsole.commands.sample import INTERRUPTED

if TYPE_CHECKING:
    from engine.generation.settings import SamplingSettings

    # Through `generating`, whose import of the loader (torch) is the one the import contract allows.
    from nsconsole.commands.generating import GenerationModel

HELP = "CHECKPOINT|LINE: talk with a checkpoint in the terminal, its state carried between turns"
DESCRIPTION = """\
A plain read-reply loop on stdin and stdout with a checkpoint loaded by itself (as `sample` loads
it). Each line you type is fed after everything said so far, and the model's reply is what it
writes next, up to the end of its first non-empty line, the document separator, or --tokens
tokens. The decoding state runs on between turns (the recurrent state for PSSA and NS, the KV
cache for the transformer), so a turn costs only its own tokens. These are pre-trained models,
not instruction-tuned ones: they continue text. /reset starts a new conversation. Ctrl-C during a
reply ends that reply (what it wrote stays said); an empty line, end of input (Ctrl-D) or Ctrl-C
at the prompt (exit status 130) ends the conversation.
"""
EXAMPLES = """\
examples:
  nsconsole chat runs/trunk
  nsconsole chat runs/trunk/checkpoints/u00030000 --temperature 0.7 --seed 1
"""

RESET = "/reset"
INTERRUPTED_REPLY = " (interrupted)"
"""Written after a reply Ctrl-C stopped (the model never sees it)."""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(subparsers, "chat", summary=HELP, description=DESCRIPTION, examples=EXAMPLES)
    add_generation_arguments(parser, "most tokens of a reply (default 200)", 200)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from engine.generation.session import generation_precision

    loaded, settings = open_model(args)
    interactive = sys.stdin.isatty()
    try:
        with generation_precision(loaded.device):
            converse(loaded, settings, args.tokens, interactive)
    except NonFiniteLogits as error:
        sys.stdout.write("\n")
        raise loaded.overflowed(f"{error} in a reply", "generate") from None
    except KeyboardInterrupt:
        # Ctrl-C ends the conversation as Ctrl-D does, on a line of its own (the shell's prompt
        # would follow the "> " or the reply's last piece), with a shell's status for SIGINT.
        sys.stdout.write("\n")
        return INTERRUPTED
    return 0


def converse(
    loaded: GenerationModel, settings: SamplingSettings, reply_tokens: int, interactive: bool
) -> None:
    """Read turns and write replies until an empty line or the end of input."""
    from engine.generation.chat import Conversation

    conversation = Conversation(loaded, settings, reply_tokens)
    while True:
        if interactive:
            sys.stdout.write("> ")
            sys.stdout.flush()
        # No line number: a strict decoder (stdin in a UTF-8 locale) fails on the chunk it read ahead.
        line = read_utf8(sys.stdin.readline, "stdin: a turn")
        text = line.rstrip("\n")
        if not text:
            if interactive and not line:
                sys.stdout.write("\n")  # Ctrl-D leaves the cursor after "> "
            return
        if text == RESET:
            conversation = Conversation(loaded, settings, reply_tokens)
            print("(a new conversation)")
            continue
        reply = ""
        pieces = conversation.reply(text)
        try:
            for piece in pieces:
                reply += piece
                sys.stdout.write(piece)
                sys.stdout.flush()
        except KeyboardInterrupt:  # ends this reply only; what it wrote stays in the conversation
            pieces.close()
            reply += INTERRUPTED_REPLY
            sys.stdout.write(INTERRUPTED_REPLY)
        if not reply.endswith("\n"):
            sys.stdout.write("\n")
