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
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(output)}.tmp-", dir=parent)
    try:
        yield tmp
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private
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
