"""`nsconsole branch NEW --from LINE --at-cycle N --plan PLAN --data DIR`: fork a branch at a cycle end."""

from __future__ import annotations

import argparse
from pathlib import Path

from nsconsole.commands.parser import add_command

HELP = "NEW --from LINE --at-cycle N --plan PLAN --data DIR: fork a branch line from a trunk cycle end"
DESCRIPTION = """\
Create the line NEW from LINE's kept checkpoint at the end of data cycle N. While that cycle has
not ended the branch is refused, but checked first as if the cycle had ended where LINE is
expected to end it, so that a branch which could never be made says why now (the console's b key
asks LINE's supervisor, which queues a branch that passes these checks and forks it then).
The branch continues LINE's learning-rate schedule up to the fork (which must not fall inside a
cosine or sqrt decay piece) and trains the stages of PLAN in order on its own data line DIR
(LINE's tokenizer, with held-out rows of every length the branch validates at):

  decay:T[:shape]  a stage of T tokens at LINE's training length; the rate decays to 0 from the
                   start of the first decay stage to the end of the plan (linear, cosine or sqrt)
  long:T           a stage of T tokens at the long length (--long-seq-len, else LINE's
                   validation.long_seq_len, else the model's longest context)

A stage trains whole rows: its T is rounded up to a multiple of its length (the output says so).
A fork past the end of LINE's data line, or a plan longer than DIR holds, is refused (estimated
from the data lines' pinned files and calibration while their last cycle is not planned yet).

The branch's first checkpoint is the fork checkpoint (hard-linked); LINE's branches.json records
the branch; its first start forks LINE's W&B run. Run `nsconsole tune NEW` for a new length.
"""
EXAMPLES = """\
examples:
  nsconsole branch runs/b1 --from runs/trunk --at-cycle 1 --plan decay:10e9,long:2e9 --data /data/lines/b1
  nsconsole branch runs/b2 --from runs/trunk --at-cycle 3 --plan decay:5e9:sqrt --data /data/lines/b2
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(subparsers, "branch", summary=HELP, description=DESCRIPTION, examples=EXAMPLES)
    parser.add_argument("new", metavar="NEW", help="the branch line's directory (new)")
    parser.add_argument("--from", dest="parent", required=True, metavar="LINE", help="the line to fork from")
    parser.add_argument(
        "--at-cycle", type=int, required=True, metavar="N", help="fork at the end of data cycle N"
    )
    parser.add_argument(
        "--plan", required=True, metavar="PLAN", help="the branch's stages, e.g. decay:10e9,long:2e9"
    )
    parser.add_argument("--data", required=True, metavar="DIR", help="the branch's own data line")
    parser.add_argument(
        "--long-seq-len", type=int, default=None, metavar="P", help="the length of long stages"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from engine.ops.branch import BranchRequest, branch_line, describe_stages, parse_plan

    host = args.host_settings
    request = BranchRequest(
        new=host.resolve_line(args.new),
        parent=host.resolve_line(args.parent),
        at_cycle=args.at_cycle,
        plan=args.plan,
        data=Path(host.resolve_line(args.data)),
        long_seq_len=args.long_seq_len,
    )
    result = branch_line(request)
    stages = "; ".join(describe_stages(parse_plan(request.plan), result.config.plan))
    how = "hard-linked" if result.hard_linked else "copied (no hard links across file systems)"
    print(f"branch {result.line} from {request.parent} after update {result.fork_update} "
          f"({result.fork_tokens:,} tokens, end of cycle {request.at_cycle}); checkpoint {how}")  # fmt: skip
    print(f"plan: {stages}")
    print(f"next: nsconsole tune {result.line}  then  nsconsole run {result.line}")
    return 0
