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

A full file system (`ENOSPC`, or a quota: `EDQUOT`) is one expected failure, said in one line
(`NoSpaceError`, docs/design.md §14): `write_file` and `atomic_directory` raise it naming the
output they were publishing, after removing their staged copy, so the previous version stays in
place and nothing partial is left. The writers below them report it in many shapes: Python's
`OSError`, torch's zip writer ("unexpected pos ...", the `OSError` of the stream in its
`__context__`), torch's distributed checkpoint (`CheckpointException` with the failure of each
rank), safetensors (the Rust `io::Error` text, "(os error 28)"). `no_space_cause` finds the errno
in any of them; `as_no_space` is what the entry points' one-line report (`common.cli.report_failure`) uses.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import shutil
import tempfile
from typing import Iterator, Optional, Union

__all__ = [
    "NoSpaceError",
    "no_space_cause",
    "as_no_space",
    "no_space_as_error",
    "write_file",
    "new_staged_directory",
    "publish_directory",
    "atomic_directory",
    "aside_copy",
    "recover",
    "remove_stale_siblings",
    "temporary_of",
    "file_sha256",
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


# ---------------------------------------------------------------------------------- a full disk

NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
# The text of a Rust `std::io::Error` from the OS (safetensors' writer): "... (os error 28)".
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")


class NoSpaceError(OSError):
    """Writing `path` failed because its file system is full (or its quota used up). One line that
    names `path`, says "no space left on device" and what to do; `note` adds what is still intact."""

    def __init__(self, path: str, note: Optional[str] = None, code: int = errno.ENOSPC):
        super().__init__(code, os.strerror(code), path)
        self.note = note

    def __reduce__(self):  # torch gathers the errors of the ranks by pickling them
        return type(self), (self.filename, self.note, self.errno)

    def __str__(self) -> str:
        reason = "no space left on device" if self.errno == errno.ENOSPC else os.strerror(self.errno).lower()
        note = f" ({self.note})" if self.note else ""
        return (f"{reason} writing {self.filename}{note}; free space on its file system or write somewhere "
                "else, then run again.")


def _errors_in_chain(err: BaseException) -> Iterator[BaseException]:
    """`err`, its causes and contexts, and the failures torch's `CheckpointException` collected per rank."""
    stack, seen = [err], set()
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        stack += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint: {rank: (error, traceback)}
        if isinstance(failures, dict):
            for failure in failures.values():
                failure = failure[0] if isinstance(failure, tuple) and failure else failure
                if isinstance(failure, BaseException):
                    stack.append(failure)


def no_space_cause(err: BaseException) -> Optional[OSError]:
    """The error of a write that found the file system full, anywhere in the chain of `err` (None: the
    chain holds none). Read from the errno wherever the writer kept one, else from the OS error code
    of a Rust writer's message."""
    for e in _errors_in_chain(err):
        if isinstance(e, OSError) and e.errno in NO_SPACE_ERRNOS:
            return e
        match = _RUST_OS_ERROR.search(str(e)) if not isinstance(e, OSError) else None
        if match and int(match.group(1)) in NO_SPACE_ERRNOS:
            code = int(match.group(1))
            return OSError(code, os.strerror(code))
    return None


FULL_BELOW_BYTES = 1 << 20  # a file system with less room than this is full for any checkpoint or export


def _file_system_full(path: str) -> bool:
    """Whether the file system that holds (or would hold) `path` has no room left: under
    `FULL_BELOW_BYTES` free for this user, or no free inode."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        st = os.statvfs(path)
    except (OSError, AttributeError):  # AttributeError: no statvfs on this platform
        return False
    return st.f_bavail * st.f_frsize < FULL_BELOW_BYTES or (st.f_files > 0 and st.f_favail == 0)


def _errno_lost(err: BaseException) -> bool:
    """Whether `err` is a failed write that does not say why: torch's C++ zip writer on a file name
    reports a full disk as `RuntimeError` "unexpected pos ..." from "basic_ios::clear: iostream error",
    with no errno anywhere."""
    return any(isinstance(e, RuntimeError) or (isinstance(e, OSError) and e.errno is None)
               for e in _errors_in_chain(err))


def as_no_space(err: BaseException, path: Optional[str] = None, note: Optional[str] = None) -> Optional[NoSpaceError]:
    """`err` as a `NoSpaceError` naming `path` when a full file system caused it, else None.

    Without `path` (the one-line report of an entry point): the chain of `err` must say so
    (`no_space_cause`), and the path is the file its failed write named; a `NoSpaceError` is
    returned as it is. With `path` (a writer that knows what it was writing): also a write that
    failed without saying why (`_errno_lost`) while the file system of `path` is full."""
    if isinstance(err, NoSpaceError) and path is None:
        return err
    cause = no_space_cause(err)
    if cause is None:
        if path is None or not (_errno_lost(err) and _file_system_full(path)):
            return None
        cause = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    if path is None:
        path = getattr(cause, "filename", None) or "a file (the writer did not say which)"
    return NoSpaceError(path, note, cause.errno)


@contextlib.contextmanager
def no_space_as_error(path: str, note: Optional[str] = None) -> Iterator[None]:
    """Raise a write that fails in the block because the file system is full as `NoSpaceError(path)`
    (chained to the original, which `--debug` shows); every other error passes unchanged."""
    try:
        yield
    except BaseException as err:  # noqa: BLE001 - torch's CheckpointException is a BaseException
        translated = as_no_space(err, os.path.abspath(path), note)
        if translated is None:
            raise
        raise translated from err


# ---------------------------------------------------------------------------------- publishing


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


def write_all(fd: int, data: bytes) -> None:
    """Write all of `data` to the file descriptor `fd` (`os.write` may write part of it)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def write_file(path: str, data: Union[str, bytes]) -> None:
    """Replace the file `path` with `data` atomically (staged sibling, fsync, one rename).
    A full file system raises `NoSpaceError(path)`; `path` then keeps its previous content."""
    path = os.path.abspath(path)
    directory = os.path.dirname(path)
    with no_space_as_error(path):
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.{_STAGED}-", dir=directory)
        try:
            try:
                write_all(fd, data.encode() if isinstance(data, str) else data)
                os.fsync(fd)
            finally:
                os.close(fd)
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


def new_staged_directory(output: str) -> str:
    """A new, uniquely named staged sibling of `output` (`.NAME.tmp-XXXXXX`), empty; a writer fills it and
    publishes it onto `output`, and `remove_stale_siblings` recognises it as a leftover otherwise."""
    output = os.path.abspath(output)
    return tempfile.mkdtemp(prefix=f".{os.path.basename(output)}.{_STAGED}-", dir=os.path.dirname(output))


@contextlib.contextmanager
def atomic_directory(output: str, *, replace: bool, remove_stale: bool = True) -> Iterator[str]:
    """Yield a staged directory that `publish_directory` moves into place as `output` when the
    block succeeds. On error the staged directory is deleted and `output` is untouched. A non-empty
    `output` is replaced only with `replace=True`; otherwise `FileExistsError` is raised, also
    when `output` filled up while writing. A full file system raises `NoSpaceError(output)`.

    `remove_stale=False` where several processes may build the same `output` at once (a shared
    cache): the staged siblings of the others are then not leftovers of a killed writer."""
    output = os.path.abspath(output)
    parent = os.path.dirname(output)
    os.makedirs(parent, exist_ok=True)
    if remove_stale:
        remove_stale_siblings(output)
    with no_space_as_error(output):
        staged = new_staged_directory(output)
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


def file_sha256(path: str) -> str:
    """The hex sha256 of a published file's bytes, read in 1 MiB pieces: the one digest that names a file's
    content (a regeneration input, a cache shard, the tiny target's rebuild)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
