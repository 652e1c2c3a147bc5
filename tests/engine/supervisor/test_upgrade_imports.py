"""A running supervisor loads no code of ours after it starts: a line runs for weeks under it, and
users upgrade nsconsole (`pip install -U`) under running lines. A module first imported after the
upgrade is the new code inside the old process, beside old modules it was not written for: in the
upgrade walkthrough a supervisor of a day before, asked for a branch after the upgrade, failed with
`internal error in branch: ImportError: cannot import name 'directory_lock' from 'datalines.files'`.

So every import of our packages inside a function of a module the supervisor has loaded must name a
module it has loaded already. Its children (trainer, preparer, tune, branch supervisors) are new
processes: they run whatever is installed when they start, as they should."""

from __future__ import annotations

import json
import subprocess
import sys

# Run in a process of its own: what `python -m engine.supervisor.supervisor` has loaded once it has
# started, nothing else of the test's. Prints [importing module, lazily imported module] pairs.
_LAZY_IMPORTS = """
import ast, importlib, json, sys
importlib.import_module("engine.supervisor.supervisor")
ours = ("engine", "datalines", "kernels", "nsconsole", "themes")
# Its functions run in the child processes the supervisor starts (`python -m engine.supervisor.children`).
child_entry_points = {"engine.supervisor.children"}
loaded = sorted(name for name, module in sys.modules.items()
                if name.split(".")[0] in ours and getattr(module, "__file__", None))
found = set()
for name in loaded:
    if name in child_entry_points:
        continue
    with open(sys.modules[name].__file__, encoding="utf-8") as handle:
        tree = ast.parse(handle.read())
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(function):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            if targets[0].split(".")[0] in ours and not any(target in sys.modules for target in targets):
                found.add((name, targets[0]))
print(json.dumps(sorted(found)))
"""


def test_the_supervisor_imports_at_start_every_module_it_imports_later() -> None:
    finished = subprocess.run([sys.executable, "-c", _LAZY_IMPORTS], capture_output=True, text=True, timeout=120)
    assert finished.returncode == 0, finished.stderr
    lazy = json.loads(finished.stdout)
    assert lazy == [], (
        "a running supervisor would import these from the code installed after it started "
        f"([importing module, imported module]): {lazy}; import them at the top of engine/supervisor/supervisor.py"
    )
