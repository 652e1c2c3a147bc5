"""`nsconsole data tokenizer --train`: train a byte-level BPE tokenizer."""

from __future__ import annotations

import argparse


def run_tokenizer(args: argparse.Namespace) -> int:
    from datalines.errors import DataLineError
    from datalines.tokenizer_training import train_tokenizer_file, train_tokenizer_from_recipe

    specials = args.special or ["<|endoftext|>"]
    if (args.recipe is None) == (args.source is None):
        raise DataLineError("data tokenizer --train takes --source DIR (repeatable) or --recipe FILE")
    if args.recipe is not None:
        if args.text_field is not None:
            raise DataLineError("data tokenizer --recipe takes each source's text_field from the recipe; drop --text-field")
        vocab, specials = train_tokenizer_from_recipe(args.recipe, args.vocab, args.out, specials, args.force)
    else:
        vocab = train_tokenizer_file(args.source, args.vocab, args.out, args.text_field or "text", specials, args.force)
    print(f"{args.out}: byte-level BPE, vocab {vocab}, special tokens {', '.join(specials)}")
    return 0
