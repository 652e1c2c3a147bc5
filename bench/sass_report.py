"""What a Triton kernel becomes on the H200, without one: compile it for sm_90 with Triton's bundled
ptxas (any machine, no GPU) and report its registers, stack (register spills), shared memory, the
layouts Triton chose, and each loop's instructions by kind. The scans were tuned this way before
spending device time (bench/RESULTS.md, sessions 4 and 5): it predicts layouts, instruction counts
and spills, not latency-bound timings.

    python bench/sass_report.py kernels.plif_backward:_plif_backward_kernel --warps 1 \\
        --floats alpha --const HAS_V0=True HAS_GRAD_SPIKES=True HAS_GRAD_V_PRE=True \\
        HAS_GRAD_V_LAST=True HAS_CARRY=False BLOCK_D=32 CHUNK_T=8 STAGES=4 MASKED=False

Arguments ending in `_ptr` are fp32 pointers unless --pointers names another element type
(`--pointers x_ptr=bf16`), those named by --floats fp32 scalars, the others int32. As a launch
with aligned buffers and sizes divisible by 16 does, every pointer and integer is specialised as a multiple of 16, except those the kernel lists in `do_not_specialize` (the
layouts depend on it: bench/RESULTS.md, session 5). This machine's Triton may not be the GPU
machine's; the report describes this one's compiler.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,6})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)([^;]*);")


def _tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def compile_for_sm90(
    kernel: Any, constexprs: dict[str, Any], warps: int, floats: set[str], pointers: dict[str, str] | None = None
) -> Any:
    """The kernel compiled for sm_90 (Triton's CompiledKernel), specialised as described above."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(kernel.arg_names)
    unknown = set(constexprs) - set(names)
    if unknown:
        raise SystemExit(f"sass_report: {kernel.__name__} has no arguments {sorted(unknown)}")
    signature = {}
    for name in names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = "*" + (pointers or {}).get(name, "fp32")
        else:
            signature[name] = "fp32" if name in floats else "i32"
    unspecialised = set(kernel.do_not_specialize)
    divisible = [n for n, kind in signature.items()
                 if (kind.startswith("*") or kind == "i32") and n not in unspecialised]  # fmt: skip
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})


def sass_and_usage(cubin: bytes) -> tuple[str, dict[str, int]]:
    """The SASS text and the register, stack and shared-memory use cuobjdump reads from the cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        sass = subprocess.run([_tool("cuobjdump"), "--dump-sass", handle.name], capture_output=True,
                              text=True, check=True).stdout
        usage_text = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", handle.name],
                                    capture_output=True, text=True, check=True).stdout
    usage = {key.lower(): int(value) for key, value in re.findall(r"\b(REG|STACK|SHARED):(\d+)", usage_text)}
    return sass, usage


def loops(sass: str) -> list[tuple[int, int, Counter[str]]]:
    """Each loop as (start, end, instructions by kind): a backward branch and what it jumps over."""
    lines = [(int(m.group(1), 16), m.group(2), m.group(3)) for m in INSTRUCTION.finditer(sass)]
    found = []
    for address, operation, operands in lines:
        target = re.search(r"0x([0-9a-f]+)", operands) if operation.startswith("BRA") else None
        if target and int(target.group(1), 16) < address:
            start = int(target.group(1), 16)
            body = Counter(op.split(".")[0] for at, op, _ in lines if start <= at <= address)
            found.append((start, address, body))
    return found


def _constant(text: str) -> tuple[str, Any]:
    name, _, value = text.partition("=")
    if not value:
        raise SystemExit(f"sass_report: --const takes NAME=VALUE, got {text!r}")
    return name, ast.literal_eval(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kernel", help="module:name of a @triton.jit kernel, e.g. kernels.plif:_plif_forward_kernel")
    parser.add_argument("--const", nargs="*", default=[], metavar="NAME=VALUE", help="the constexpr arguments")
    parser.add_argument("--floats", nargs="*", default=[], help="scalar arguments that are fp32 (others int32)")
    parser.add_argument("--pointers", nargs="*", default=[], metavar="NAME=TYPE",
                        help="pointer arguments of another element type than fp32 (e.g. x_ptr=bf16)")
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--save", type=Path, help="also write the .sass, .ptx and .ttgir here")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("sass_report: unset TRITON_INTERPRET (interpreted kernels cannot be compiled)", file=sys.stderr)
        return 2
    module_name, _, kernel_name = args.kernel.partition(":")
    importlib.import_module(module_name)  # a package may shadow the module's name with a function
    kernel = getattr(sys.modules[module_name], kernel_name)
    pointers = dict(text.partition("=")[::2] for text in args.pointers)
    compiled = compile_for_sm90(kernel, dict(_constant(text) for text in args.const), args.warps, set(args.floats),
                                pointers)
    sass, usage = sass_and_usage(compiled.asm["cubin"])
    if args.save:
        args.save.mkdir(parents=True, exist_ok=True)
        for suffix, text in (("sass", sass), ("ptx", compiled.asm["ptx"]), ("ttgir", compiled.asm["ttgir"])):
            (args.save / f"{kernel_name}.{suffix}").write_text(text)
    print(f"{args.kernel}: registers {usage.get('reg')}, stack {usage.get('stack')} B (spills if > 0),"
          f" shared {compiled.metadata.shared} B, {len(INSTRUCTION.findall(sass))} instructions")
    for layout in sorted(set(re.findall(r"#ttg\.blocked<\{[^}]*\}>", compiled.asm["ttgir"]))):
        print(f"  layout {layout}")
    for start, end, body in loops(sass):
        kinds = ", ".join(f"{kind} {count}" for kind, count in body.most_common())
        print(f"  loop {start:#x}-{end:#x}: {sum(body.values())} instructions: {kinds}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
