"""Publishing: every file and directory the project writes appears whole or not at all.

One way for all of them (HF exports, converter outputs, training checkpoints, the tracker file,
`dflash_config.json`, the run directory's files): the content is written into a *staged* sibling
in the same parent directory (`.NAME.tmp-XXXXXX`, or a fixed `.NAME.tmp` where several ranks
write into one), flushed to disk, then moved into place with one `rename`. The sibling shares the
parent so that the rename stays on one file system. A reader (or a resumed run) therefore finds
the complete previous version or the complete new one, never a half-written one.

Files are replaced by one atomic `os.replace`. A non-empty directory cannot be exchanged in one
POSIX call: the previous version is first moved aside (`.NAME.old-XXXXXX`), then the staged one
into place, then the aside copy deleted. A failure between the two renames in this process moves
the previous version back at once; a crash there (a killed process) leaves NAME missing and its
complete previous version aside, and `recover(NAME)`, which the next publish of NAME (and
`remove_stale_siblings`) runs first, moves it back. Nothing of the
previous version is deleted before the new one is in place.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from typing import Iterator, Optional, Union

__all__ = [
    "write_file",
    "publish_directory",
    "atomic_directory",
    "staged_path",
    "aside_copy",
    "recover",
    "remove_stale_siblings",
    "temporary_of",
    "check_destination",
    "check_not_a_link",
]

_STAGED, _ASIDE = "tmp", "old"
# `.NAME.tmp`, `.NAME.tmp-XXXXXX`, `.NAME.old`, `.NAME.old-XXXXXX`
_TEMPORARY = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)(-[A-Za-z0-9_]+)?$")


def temporary_of(entry: str) -> Optional[str]:
    """The name whose staged or aside sibling the directory entry `entry` is (None: not one)."""
    match = _TEMPORARY.match(entry)
    return match.group("name") if match else None


def staged_path(output: str) -> str:
    """The fixed staged sibling of `output` (`.NAME.tmp`) for writers that must agree on its name
    without talking (every rank of a collective checkpoint save)."""
    output = os.path.abspath(output)
    return os.path.join(os.path.dirname(output), f".{os.path.basename(output)}.{_STAGED}")


def _fsync(path: str) -> None:
    """Flush a file or directory to disk (best effort: some file systems refuse directories)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _ordinary_permissions(root: str) -> None:
    """Directories 0777 and files 0666 less the umask (0755 / 0644 usually): `mkdtemp` makes the
    directory private and safetensors writes 0600 files, which the rest of a shared cluster cannot read."""
    umask = _umask()
    os.chmod(root, 0o777 & ~umask)
    for here, dirs, files in os.walk(root):
        for d in dirs:
            os.chmod(os.path.join(here, d), 0o777 & ~umask)
        for f in files:
            path = os.path.join(here, f)
            if not os.path.islink(path):
                os.chmod(path, 0o666 & ~umask)


def _flush_tree(root: str) -> None:
    """Every file and directory under `root` on disk before the rename makes it visible."""
    for here, _, files in os.walk(root, topdown=False):
        for f in files:
            path = os.path.join(here, f)
            if not os.path.islink(path):
                _fsync(path)
        _fsync(here)


def write_file(path: str, data: Union[str, bytes]) -> None:
    """Replace the file `path` with `data` atomically (staged sibling, fsync, one rename)."""
    path = os.path.abspath(path)
    directory = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.{_STAGED}-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync(directory)


def _aside_copies(output: str) -> list[str]:
    """The moved-aside previous versions of `output`, newest first."""
    parent, name = os.path.dirname(output), os.path.basename(output)
    if not os.path.isdir(parent):
        return []
    found = []
    for entry in os.listdir(parent):
        match = _TEMPORARY.match(entry)
        if match and match.group("name") == name and match.group("kind") == _ASIDE:
            found.append(os.path.join(parent, entry))
    return sorted(found, key=lambda p: os.stat(p).st_mtime_ns, reverse=True)


def aside_copy(output: str) -> Optional[str]:
    """The previous version of `output` that a killed publish left moved aside (None: none)."""
    found = _aside_copies(os.path.abspath(output))
    return found[0] if found else None


def recover(output: str) -> Optional[str]:
    """Undo a publish that was killed between its two renames: when `output` is missing and its
    previous version lies aside, move it back. Returns the restored path (None: nothing to do)."""
    output = os.path.abspath(output)
    if os.path.lexists(output):
        return None
    aside = _aside_copies(output)
    if not aside:
        return None
    os.rename(aside[0], output)
    _fsync(os.path.dirname(output))
    return output


def publish_directory(staged: str, output: str, *, replace: bool) -> None:
    """Move the complete directory `staged` into place as `output` (a sibling of it).

    `output` missing or empty: one rename. `output` non-empty: refused with `FileExistsError`
    unless `replace`; then the previous version is moved aside, `staged` moved in, the aside copy
    deleted (see the module docstring for what a crash in between leaves and how it is undone).
    On any error `staged` is left where it is for the caller to delete, and `output` holds its
    previous content.
    """
    staged, output = os.path.abspath(staged), os.path.abspath(output)
    parent = os.path.dirname(output)
    if os.path.dirname(staged) != parent:
        raise ValueError(f"{staged} must sit next to {output} (same parent directory) to be renamed into place.")
    recover(output)
    _ordinary_permissions(staged)
    _flush_tree(staged)
    if os.path.isdir(output) and os.listdir(output):
        if not replace:
            raise FileExistsError(f"{output} is not empty; refusing to replace it.")
        aside = tempfile.mkdtemp(prefix=f".{os.path.basename(output)}.{_ASIDE}-", dir=parent)
        os.rmdir(aside)
        os.rename(output, aside)
        try:
            os.rename(staged, output)
        except BaseException:
            os.rename(aside, output)  # the previous version back where it was
            raise
        _fsync(parent)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.replace(staged, output)  # onto a missing or empty directory
    _fsync(parent)


@contextlib.contextmanager
def atomic_directory(output: str, *, replace: bool, remove_stale: bool = True) -> Iterator[str]:
    """Yield a staged directory that `publish_directory` moves into place as `output` when the
    block succeeds. On error the staged directory is deleted and `output` is untouched. A non-empty
    `output` is replaced only with `replace=True`; otherwise `FileExistsError` is raised, also
    when `output` filled up while writing.

    `remove_stale=False` where several processes may build the same `output` at once (a shared
    cache): the staged siblings of the others are then not leftovers of a killed writer."""
    output = os.path.abspath(output)
    parent = os.path.dirname(output)
    os.makedirs(parent, exist_ok=True)
    if remove_stale:
        remove_stale_siblings(output)
    staged = tempfile.mkdtemp(prefix=f".{os.path.basename(output)}.{_STAGED}-", dir=parent)
    try:
        yield staged
        publish_directory(staged, output, replace=replace)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.unlink(path)


def remove_stale_siblings(output: str) -> None:
    """Clean up after killed publishes of `output`: restore an interrupted replacement
    (`recover`), then delete the staged and aside siblings left behind (full copies of a model)."""
    output = os.path.abspath(output)
    parent, name = os.path.dirname(output), os.path.basename(output)
    if not os.path.isdir(parent):
        return
    recover(output)
    for entry in os.listdir(parent):
        match = _TEMPORARY.match(entry)
        if match and match.group("name") == name:
            _remove(os.path.join(parent, entry))



def check_not_a_link(output: str, flag: Optional[str] = None) -> None:
    """Refuse a destination that is a symbolic link: publishing renames the staged directory onto the
    path itself, which replaces a link (or fails on it) instead of writing where it points. `flag`
    names the option in the message (`--dflash-export=PATH`)."""
    if os.path.islink(output):
        name = f"{flag}={output}" if flag else output
        raise ValueError(
            f"{name} is a symbolic link (to {os.readlink(output)}); an output directory is moved into place by a "
            f"rename, which cannot go through a link: pass the directory itself ({os.path.realpath(output)})."
        )


def check_destination(output: str, *, replace: bool, source: Optional[str] = None,
                      replace_flag: str = "replace=True") -> None:
    """Refuse, before anything is written, a destination that a publish of `output` could not
    take: a symbolic link, one that overlaps `source`, a file, or a non-empty directory without `replace`
    (`replace_flag` names the switch that allows it, e.g. `--force`)."""
    check_not_a_link(output)
    if source is not None:
        a, b = os.path.realpath(output), os.path.realpath(source)
        if a == b or a.startswith(b + os.sep) or b.startswith(a + os.sep):
            raise ValueError(f"{output} overlaps the input {source}; write somewhere else.")
    if os.path.exists(output) and not os.path.isdir(output):
        raise FileExistsError(f"{output} exists and is not a directory; choose another path.")
    if os.path.isdir(output) and os.listdir(output) and not replace:
        raise FileExistsError(
            f"{output} exists and is not empty; pass {replace_flag} to replace it, or choose a new "
            "or empty directory."
        )
