"""Directories that appear whole or not at all.

Checkpoints and exports are written into a temporary sibling directory and moved into place
in one rename, so a reader (or a resumed run) finds either the complete old directory or the
complete new one, never a half-written one. The sibling sits in the same parent so that the
rename stays on one file system.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Iterator


@contextlib.contextmanager
def atomic_directory(output: str, *, replace: bool) -> Iterator[str]:
    """Yield a temporary directory that replaces `output` when the block succeeds.

    On error the temporary directory is deleted and `output` is untouched. A non-empty
    `output` is replaced only with `replace=True` (it is swapped out, then deleted);
    otherwise `FileExistsError` is raised, also when `output` filled up while writing.
    """
    output = os.path.abspath(output)
    parent = os.path.dirname(output)
    os.makedirs(parent, exist_ok=True)
    remove_stale_siblings(output)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(output)}.tmp-", dir=parent)
    try:
        yield tmp
        _ordinary_permissions(tmp)
        if os.path.isdir(output) and os.listdir(output):
            if not replace:
                raise FileExistsError(f"{output} is not empty; refusing to replace it.")
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(output)}.old-", dir=parent)
            os.rmdir(old)
            os.rename(output, old)
            os.rename(tmp, output)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, output)  # onto a missing or empty directory
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def remove_stale_siblings(output: str) -> None:
    """Delete the temporary and swapped-out siblings of `output` that a killed writer left behind
    (`.NAME.tmp-*`, `.NAME.old-*`: full copies of a model)."""
    output = os.path.abspath(output)
    parent, name = os.path.dirname(output), os.path.basename(output)
    if not os.path.isdir(parent):
        return
    for entry in os.listdir(parent):
        if entry.startswith(f".{name}.tmp-") or entry.startswith(f".{name}.old-"):
            shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)


def _ordinary_permissions(root: str) -> None:
    """Directories 0777 and files 0666 less the umask (0755 / 0644 usually): `mkdtemp` makes the
    directory private and safetensors writes 0600 files, which the rest of a shared cluster cannot read."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(root, 0o777 & ~umask)
    for here, dirs, files in os.walk(root):
        for d in dirs:
            os.chmod(os.path.join(here, d), 0o777 & ~umask)
        for f in files:
            path = os.path.join(here, f)
            if not os.path.islink(path):
                os.chmod(path, 0o666 & ~umask)
