"""`nsconsole eval CHECKPOINT|LINE --tasks ...`: lm-evaluation-harness tasks on a checkpoint alone."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from nsconsole.commands.parser import SEED_RANGE, add_command, seed
from nsconsole.commands.sample import INTERRUPTED

HELP = "CHECKPOINT|LINE: run lm-evaluation-harness tasks on a checkpoint alone"
DESCRIPTION = """\
Load a checkpoint by itself (its weights, preset, overrides and the tokenizer it carries; every
file checked against its hashes first; no data line is read) and run lm-evaluation-harness
(lm-eval) tasks on it: multiple-choice and other log-likelihood tasks, perplexity tasks (rolling
windows of the model's context) and generation tasks (the model's decoder, stopping at the task's
strings). A LINE stands for the checkpoint its `latest` names. Texts start a document, after the
document separator, as in the training rows. The harness's own tasks fetch their datasets from
the Hugging Face hub; --include-path adds directories of your task YAMLs (a local dataset:
`dataset_path: json` with `dataset_kwargs: {data_files: ...}`, read offline). A task whose data
cannot be read (the hub unreachable, a local file missing), or whose YAML has a mistake (no
dataset_path, no `task:`, not YAML), is refused in one line naming its YAML before the checkpoint
loads.
Prints the harness's results table; --output writes the full results as JSON, whole or not at
all (a FILE that cannot be written there, or that exists without --force, is refused before
anything runs). Needs lm-eval (`pip install 'nsconsole[eval]'`).
"""
EXAMPLES = """\
examples:
  nsconsole eval runs/trunk --tasks hellaswag,arc_easy,lambada_openai --output evals/trunk.json
  nsconsole eval runs/trunk/checkpoints/u00030000 --tasks wikitext --limit 100 --device cuda
  nsconsole eval runs/trunk --tasks my_task --include-path tasks/ --num-fewshot 5 --ema
"""


def _at_least(smallest: int) -> Callable[[str], int]:
    """An argparse type: an integer no smaller than `smallest`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if value < smallest:
            raise argparse.ArgumentTypeError(f"must be at least {smallest}, got {value}")
        return value

    return parse


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(subparsers, "eval", summary=HELP, description=DESCRIPTION, examples=EXAMPLES)
    parser.add_argument("source", metavar="CHECKPOINT|LINE",
                        help="a checkpoint directory (LINE/checkpoints/uNNNNNNNN), or a line: its latest checkpoint")
    parser.add_argument("--tasks", required=True, metavar="T1,T2",
                        help="comma-separated harness task, group or tag names, or task YAML files")
    parser.add_argument("--include-path", action="append", default=[], type=Path, metavar="DIR",
                        help="a directory of task YAMLs to index beside the harness's own (repeatable)")
    parser.add_argument("--limit", type=_at_least(1), default=None, metavar="N",
                        help="at most N documents of each task (default: all)")
    parser.add_argument("--num-fewshot", type=_at_least(0), default=None, metavar="K",
                        help="K examples before each question (default: each task's own)")
    parser.add_argument("--batch-size", type=_at_least(1), default=8, metavar="ROWS",
                        help="requests scored in one forward; their logits (rows x tokens x vocabulary) "
                        "bound the memory (default 8)")
    parser.add_argument("--seed", type=seed, default=0, metavar="S",
                        help=f"seed of the few-shot examples' choice and of sampled generations, {SEED_RANGE} "
                        "(default 0)")
    parser.add_argument("--ema", action="store_true",
                        help="use the parameters' moving average the checkpoint keeps (run.json `ema`)")
    parser.add_argument("--device", default="auto", help="auto (the GPU when there is one), cpu or cuda[:N]")
    parser.add_argument("--output", type=Path, default=None, metavar="FILE",
                        help="write the harness's full results as JSON to FILE (an existing FILE is "
                        "refused unless --force)")
    parser.add_argument("--force", action="store_true", help="replace --output when it exists")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from engine.errors import LineError

    try:
        from engine.evaluation.harness import open_checkpoint
        from engine.evaluation.run import (
            EvaluationSettings,
            check_output,
            check_source,
            evaluate,
            prepare_tasks,
            results_table,
            write_results,
        )
    except ModuleNotFoundError as error:
        if (error.name or "").split(".")[0] != "lm_eval":
            raise
        raise LineError("eval needs lm-eval, which is not installed: pip install 'nsconsole[eval]'") from None

    if args.output is not None:
        check_output(args.output, args.force)
    tasks = [task.strip() for task in args.tasks.split(",") if task.strip()]
    settings = EvaluationSettings(tasks, args.include_path, args.limit, args.num_fewshot, args.seed)
    source = args.host_settings.resolve_line(args.source)
    check_source(source, args.device, average=args.ema)
    prepared = prepare_tasks(settings)  # before the checkpoint loads: a task that cannot run costs no wait
    adapter = open_checkpoint(str(source), ema=args.ema, device=args.device, batch_size=args.batch_size,
                              seed=args.seed)  # fmt: skip
    print(f"{adapter.loaded.describe()}: {', '.join(tasks)}", file=sys.stderr)
    try:
        results = evaluate(adapter, settings, prepared)
    except KeyboardInterrupt:
        # `^C` (or the harness's progress bar) holds the line: the report takes one of its own, and
        # says what became of --output (the harness keeps nothing of a run cut short).
        written = "" if args.output is None else f"; nothing written to {args.output}"
        print(f"\ninterrupted (Ctrl-C) before the results{written}", file=sys.stderr)
        return INTERRUPTED
    print(results_table(results))
    if args.output is not None:
        write_results(results, args.output)
        print(f"results written to {args.output}", file=sys.stderr)
    return 0
