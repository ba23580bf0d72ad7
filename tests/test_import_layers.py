"""The package's import graph follows the stage order of docs/design.md §7 Module map.

Every import of the package's own modules is read from the source (also those inside functions) and
resolved to a stage, the first folder under `megatron_dflash/`: a nested subpackage such as
`target/megatron/` belongs to its stage (`target`). An import may only go to the same stage or to an
earlier one in the order that §7 writes down; the graph of modules has no cycle; and every relative
import resolves to a module of the package (one that did not would escape both checks).
"""

import ast
import os
import re

from repo_paths import REPO_ROOT as ROOT

PACKAGE = "megatron_dflash"
DESIGN = os.path.join(ROOT, "docs", "design.md")


def _stage_order() -> dict:
    """`{stage: rank}` from the line of §7 that starts with "Stage order:" (stages in backticks, `<` between
    ranks, `,` between stages of one rank)."""
    with open(DESIGN, encoding="utf-8") as f:
        text = f.read()
    section = text[text.index("## 7. "):text.index("## 8. ")]
    line = re.search(r"^Stage order: (.+?)\.$", section, flags=re.M | re.S)
    assert line, "the module map (docs/design.md §7 Module map) has no 'Stage order:' line"
    order = {}
    for rank, group in enumerate(line.group(1).replace("\n", " ").split("<")):
        for stage in re.findall(r"`(\w+)`", group):
            order[stage] = rank
    return order


def _modules() -> dict:
    """`{dotted module name: path}` of every module of the package."""
    out = {}
    for dirpath, _, names in os.walk(os.path.join(ROOT, PACKAGE)):
        for name in names:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, name), ROOT)[:-3].replace(os.sep, ".")
                out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(dirpath, name)
    return out


def _import_names(module: str, path: str):
    """Per import statement of `module` (top level or inside functions): (is relative, the dotted names it may
    name: the module imported from, and each imported name under it)."""
    is_package = path.endswith("__init__.py")
    base = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Import):
            yield False, [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parent = base[: len(base) - node.level + 1]
                target = ".".join(parent + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            yield bool(node.level), [target] + [f"{target}.{a.name}" for a in node.names]


def _imports(module: str, path: str, modules: dict) -> set:
    """The package modules `module` imports (at top level or inside functions)."""
    found = set()
    for _, names in _import_names(module, path):
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module and name.startswith(PACKAGE + "."):
                found.add(name)
    return found


def test_imports_follow_the_stage_order():
    order = _stage_order()
    modules = _modules()
    wrong, unknown = [], set()
    for module, path in modules.items():
        if module == PACKAGE:
            continue
        for target in _imports(module, path, modules):
            a, b = module.split(".")[1], target.split(".")[1]
            for stage in (a, b):
                if stage not in order:
                    unknown.add(stage)
            if a in order and b in order and order[b] > order[a]:
                wrong.append(f"{module} -> {target}")
    assert not unknown, f"stages missing from the stage order of docs/design.md §7: {sorted(unknown)}"
    assert not wrong, "imports against the stage order of docs/design.md §7:\n" + "\n".join(sorted(wrong))


def test_no_import_cycle():
    modules = _modules()
    graph = {m: _imports(m, p, modules) - {PACKAGE} for m, p in modules.items()}
    state, cycles = {}, []

    def visit(node, stack):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_relative_imports_resolve_to_package_modules():
    modules = _modules()
    stray = []
    for module, path in modules.items():
        for relative, names in _import_names(module, path):
            # `from .x import y` names the module x; `from . import x` names the modules it imports.
            if relative and names[0] not in modules and not all(name in modules for name in names[1:]):
                stray.append(f"{module}: from {names[0]} (no such module of the package)")
    assert not stray, "relative imports that name no module:\n" + "\n".join(sorted(stray))
