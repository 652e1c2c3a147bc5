"""`nsconsole data tokenizer --train`: train a byte-level BPE tokenizer."""

from __future__ import annotations

import argparse


def run_tokenizer(args: argparse.Namespace) -> int:
    from datalines.tokenizer_training import train_tokenizer_file

    specials = args.special or ["<|endoftext|>"]
    vocab = train_tokenizer_file(args.source, args.vocab, args.out, args.text_field, specials)
    print(f"{args.out}: byte-level BPE, vocab {vocab}, special tokens {', '.join(specials)}")
    return 0
