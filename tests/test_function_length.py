"""Functions stay readable: at most 100 lines, unless the docstring says why ("Long on purpose: ...")."""

import ast
import os

from repo_paths import REPO_ROOT as ROOT

LIMIT = 100


def test_functions_are_at_most_100_lines():
    long = []
    for top in ("megatron_dflash", "tools"):
        for dirpath, _, names in os.walk(os.path.join(ROOT, top)):
            for name in names:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(dirpath, name)
                for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
                    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        lines = node.end_lineno - node.lineno + 1
                        if lines > LIMIT and "Long on purpose:" not in (ast.get_docstring(node) or ""):
                            long.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "functions over 100 lines (split them, or say why in the docstring):\n" + "\n".join(long)
