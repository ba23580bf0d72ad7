"""The tests' own layout: a test module imports no other test module, and the shared helpers are public.

What several test modules share lives in `tests/helpers/` (builders, references, harnesses; see the
docstring of `tests/conftest.py`) and their shared fixtures in a `conftest.py` of their folder. A test
module importing another one would run that module's import-time set-up (and, for a fixture, its tests'
scope) in the importer, and ties one test file to another's private names.
"""

import ast
import os

from repo_paths import TESTS_DIR

HELPERS = os.path.join(TESTS_DIR, "helpers")


def _python_files() -> list:
    return sorted(os.path.join(dirpath, name) for dirpath, _, names in os.walk(TESTS_DIR)
                  for name in names if name.endswith(".py"))


def _imports(path: str):
    """(line, module, imported names) of every import of `path`, at top level or inside functions."""
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, []
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            yield node.lineno, node.module, [alias.name for alias in node.names]


def test_no_test_module_imports_another_test_module():
    test_modules = {name[:-3] for path in _python_files() for name in [os.path.basename(path)]
                    if name.startswith("test_")}
    found = [f"{os.path.relpath(path, TESTS_DIR)}:{line}: imports {module}"
             for path in _python_files() for line, module, _ in _imports(path)
             if module.split(".")[0] in test_modules]
    assert not found, ("test modules import other test modules; move what they share to tests/helpers/ "
                       "(fixtures to a conftest.py):\n" + "\n".join(found))


def test_only_public_names_are_imported_from_the_helpers():
    helpers = {name[:-3] for name in os.listdir(HELPERS) if name.endswith(".py")}
    found = [f"{os.path.relpath(path, TESTS_DIR)}:{line}: from {module} import {name}"
             for path in _python_files() for line, module, names in _imports(path)
             if module in helpers for name in names if name.startswith("_")]
    assert not found, "private helper names imported across modules (make them public):\n" + "\n".join(found)


def test_test_module_base_names_are_unique():
    """The test folders share one sys.path (tests/conftest.py): two test modules of one base name in two folders
    cannot both be imported, and pytest stops at collection."""
    seen: dict = {}
    for path in _python_files():
        name = os.path.basename(path)
        if name.startswith("test_"):
            seen.setdefault(name, []).append(os.path.relpath(path, TESTS_DIR))
    clashes = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not clashes, f"test modules sharing a base name (rename one): {clashes}"
