"""The developer documentation stays in the repository and stays attached to the code.

Docstrings and comments cite `docs/design.md` by section number and name ("docs/design.md §3 Block
attention"). These checks fail when a citation points at a section that does not exist or has been
renumbered under it, when a source file cites a design document outside the repository, or when a
module is missing from the module map.
"""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DESIGN = os.path.join(ROOT, "docs", "design.md")
SOURCE_DIRS = ("megatron_dflash", "tools", "tests", "benchmarks", "examples")
_CITATION = re.compile(r"docs/design\.md((?:[^\n)]*?§\d+[^\n)§]*)+)")
_SECTION = re.compile(r"§(\d+)\s+([A-Za-z][\w-]*)")
# How the design note outside the repository used to be cited (spelled so that this file does not match).
_EXTERNAL = re.compile(r"\bDESIGN\s+sections?\b")


def _python_files():
    yield os.path.join(ROOT, "pretrain_dflash.py")
    for top in SOURCE_DIRS:
        for dirpath, _, names in os.walk(os.path.join(ROOT, top)):
            for name in names:
                if name.endswith(".py"):
                    yield os.path.join(dirpath, name)


def _sections() -> dict:
    """`{number: title}` of the `## N. Title` headings of docs/design.md."""
    with open(DESIGN, encoding="utf-8") as f:
        return {int(m.group(1)): m.group(2).strip() for m in re.finditer(r"^## (\d+)\. (.+)$", f.read(), flags=re.M)}


def test_sections_are_numbered_consecutively():
    numbers = sorted(_sections())
    assert numbers == list(range(1, len(numbers) + 1)), numbers
    assert len(numbers) >= 10


def test_every_citation_names_an_existing_section():
    sections = _sections()
    cited = 0
    for path in _python_files():
        with open(path, encoding="utf-8") as f:
            text = f.read()
        where = os.path.relpath(path, ROOT)
        assert not _EXTERNAL.search(text), f"{where} cites a design document outside the repository"
        for citation in _CITATION.finditer(text):
            for number, word in _SECTION.findall(citation.group(1)):
                title = sections.get(int(number))
                assert title is not None, f"{where}: docs/design.md §{number} does not exist"
                # The cited name must be the section's: a renumbering would otherwise point elsewhere.
                assert title.split()[0].rstrip(":,") == word, f"{where}: §{number} {word}... but the section is {title!r}"
                cited += 1
    assert cited >= 10, cited


def test_the_module_map_lists_every_module():
    with open(DESIGN, encoding="utf-8") as f:
        text = f.read()
    module_map = text[text.index("## 7. "):text.index("## 8. ")]
    missing = []
    for top in ("megatron_dflash", "tools"):
        for dirpath, _, names in os.walk(os.path.join(ROOT, top)):
            for name in names:
                path = os.path.join(dirpath, name)
                if not name.endswith(".py") or os.path.getsize(path) == 0:  # empty package markers
                    continue
                # Listed by their path under the folder: `draft/config.py`, `training/loop.py`, `tools`' scripts.
                key = os.path.relpath(path, os.path.join(ROOT, top)).replace(os.sep, "/")
                if f"`{key}`" not in module_map:
                    missing.append(os.path.join(top, key))
    assert not missing, f"modules missing from docs/design.md §7 Module map: {missing}"


def test_the_design_document_names_no_machine_paths():
    with open(DESIGN, encoding="utf-8") as f:
        text = f.read()
    for prefix in ("/work/", "/tmp/", "/home/", "/root/"):
        assert prefix not in text, prefix
