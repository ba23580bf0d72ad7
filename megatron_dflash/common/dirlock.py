"""An exclusive lock on a directory for the life of a run: the kernel's `flock` on a file in it.

Two runs writing into one directory corrupt each other (each removes the other's staged files as
leftovers, each publishes over what the other wrote). So a run holds `DIR/<lock file>` from its start to
its end; a second run is refused in one line naming the holder. The users: the training job's `--save`
(`training/savelock.py`, held by global rank 0) and regeneration's `--output` (`decoding/regenerate.py`).

* The lock is released on any exit: explicitly by `DirectoryLock.release`, and by the kernel when the
  process dies (a crash, SIGKILL, an out-of-memory kill), so no stale lock ever blocks a rerun.
* The file records its holder (JSON: host, pid, start time, and what the caller adds). A run that takes
  the lock while the file still names another holder knows that run died without releasing it, and says so.
* A run that releases the lock deletes the file first; a run that locked a file which was just deleted
  that way (it opened it before the deletion) sees another inode at the path and retries.
* File systems without `flock` (some network mounts) cannot give the guarantee: the run says so in one
  warning and goes on without it.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
from typing import Callable, Optional

from .errors import RunError

__all__ = ["DirectoryLock", "acquire_directory_lock", "describe_holder", "read_holder", "lock_is_held"]

_ATTEMPTS = 20  # retries when the file is deleted by a releasing holder between open and lock
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


def _holder_record(extra: Optional[dict]) -> str:
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    return json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": started, **(extra or {})}) + "\n"


def read_holder(record: str) -> Optional[dict]:
    """The holder a lock file's content records (None: empty or unreadable)."""
    try:
        holder = json.loads(record)
    except ValueError:
        return None
    return holder if isinstance(holder, dict) and {"host", "pid", "started"} <= set(holder) else None


def describe_holder(record: str) -> Optional[str]:
    """`host H, pid P, started T` of a lock file's content (None: empty or unreadable)."""
    holder = read_holder(record)
    return None if holder is None else f"host {holder['host']}, pid {holder['pid']}, started {holder['started']}"


def _read(fd: int) -> str:
    return os.pread(fd, 4096, 0).decode("utf-8", "replace")


def lock_is_held(path: str) -> tuple[bool, str]:
    """Whether some process holds the lock of file `path` now, and the file's content ("" when there is none).
    Probes with a shared lock taken and dropped at once."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False, ""
    try:
        record = _read(fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True, record
        except OSError:
            return False, record
        return False, record
    finally:
        os.close(fd)  # drops the probe's shared lock


class DirectoryLock:
    """The held lock of one directory; `release()` (idempotent) gives it up."""

    def __init__(self, path: str, fd: Optional[int], created_dir: bool = False):
        self.path, self._fd, self._created_dir = path, fd, created_dir

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            if os.stat(self.path).st_ino == os.fstat(self._fd).st_ino:
                os.unlink(self.path)  # before unlocking: a waiting run then retries on a fresh file
        os.close(self._fd)  # releases the flock
        self._fd = None
        if self._created_dir:  # a run that wrote nothing leaves no empty directory behind
            with contextlib.suppress(OSError):
                os.rmdir(os.path.dirname(self.path))

    def __enter__(self) -> "DirectoryLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def acquire_directory_lock(directory: str, lock_file: str, *, flag: str, why: str, log_prefix: str,
                           log: Callable = print, extra: Optional[dict] = None) -> DirectoryLock:
    """Lock `directory` (created if missing, and removed again at release if it is still empty) for this
    process, or raise `RunError` naming the run that holds it: "`flag`=`directory` is in use by another run
    (...); `why`". `extra` goes into the holder record; `log_prefix` starts the warning and notice lines."""
    created_dir = not os.path.isdir(directory)
    path = os.path.join(directory, lock_file)
    for _ in range(_ATTEMPTS):
        os.makedirs(directory, exist_ok=True)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        except FileNotFoundError:  # a releasing run removed the directory it had created: create it again
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = describe_holder(_read(fd)) or "it has not recorded itself yet"
            os.close(fd)
            raise RunError(f"{flag}={directory} is in use by another run ({holder}; lock {path}); {why}") from None
        except OSError as err:
            if err.errno not in _NO_LOCKS:
                os.close(fd)
                raise
            log(f"{log_prefix} WARNING: the file system of {flag}={directory} does not support locks "
                f"({err.strerror}); nothing stops a second run from writing into it at the same time.")
            os.close(fd)
            return DirectoryLock(path, None)  # nothing to release: the directory stays
        try:
            current = os.stat(path).st_ino
        except FileNotFoundError:
            current = None
        if current != os.fstat(fd).st_ino:  # deleted by a releasing holder after we opened it
            os.close(fd)
            continue
        previous = describe_holder(_read(fd))
        if previous is not None:
            log(f"{log_prefix} notice: took over the lock of {flag}={directory} from a run that ended without "
                f"releasing it ({previous}; no process holds it any more).")
        record = _holder_record(extra).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, record, 0)
        os.fsync(fd)
        return DirectoryLock(path, fd, created_dir)
    raise RunError(f"{flag}={directory}: could not lock {path} (it keeps being replaced); is another run starting?")
