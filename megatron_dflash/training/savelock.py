"""One run per save directory: an exclusive lock on `--save` for the life of the run.

Two runs writing checkpoints into one directory corrupt each other (each deletes the other's staged
checkpoint as a leftover, publishes a directory the other is still writing, moves the tracker back).
So a run holds `SAVE/.dflash_save.lock` from its start to its end:

* the lock is the kernel's `flock` on that file, held by global rank 0 of the run; every other rank
  learns rank 0's verdict by one broadcast, so all ranks go on, or all raise the same one-line
  `RunError` naming the holder (host, pid, start time), before any other collective;
* it is released on any exit: explicitly at the end of `train`, and by the kernel when the process
  dies (a crash, SIGKILL, an out-of-memory kill), so no stale lock ever blocks a rerun;
* the file records its holder (JSON: host, pid, start time). A run that takes the lock while the file
  still names another holder knows that run died without releasing it, and says so;
* a run that releases the lock deletes the file first; a run that locked a file which was just
  deleted that way (it opened it before the deletion) sees another inode at the path and retries.

File systems without `flock` (some network mounts) cannot give the guarantee: the run says so in one
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

from ..common.errors import RunError

__all__ = ["LOCK_FILE", "SaveLock", "acquire_save_lock", "lock_save_directory"]

LOCK_FILE = ".dflash_save.lock"
_ATTEMPTS = 20  # retries when the file is deleted by a releasing holder between open and lock
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


def _holder_record() -> str:
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    return json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": started}) + "\n"


def _describe(record: str) -> Optional[str]:
    """`host H, pid P, started T` of a lock file's content (None: empty or unreadable)."""
    try:
        holder = json.loads(record)
        return f"host {holder['host']}, pid {holder['pid']}, started {holder['started']}"
    except (ValueError, TypeError, KeyError):
        return None


def _read(fd: int) -> str:
    return os.pread(fd, 4096, 0).decode("utf-8", "replace")


class SaveLock:
    """The held lock of one save directory; `release()` (idempotent) gives it up."""

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
        if self._created_dir:  # a run that wrote nothing leaves no empty --save behind
            with contextlib.suppress(OSError):
                os.rmdir(os.path.dirname(self.path))


def acquire_save_lock(save_dir: str, log: Callable = print) -> SaveLock:
    """Lock `save_dir` (created if missing, and removed again at release if it is still empty) for this
    process, or raise `RunError` naming the run that holds it."""
    created_dir = not os.path.isdir(save_dir)
    path = os.path.join(save_dir, LOCK_FILE)
    for _ in range(_ATTEMPTS):
        os.makedirs(save_dir, exist_ok=True)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        except FileNotFoundError:  # a releasing run removed the directory it had created: create it again
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe(_read(fd)) or "it has not recorded itself yet"
            os.close(fd)
            raise RunError(
                f"--save={save_dir} is in use by another run ({holder}; lock {path}); two runs on one save "
                "directory would corrupt each other's checkpoints: wait for that run to end, stop it, or use "
                "another --save."
            ) from None
        except OSError as err:
            if err.errno not in _NO_LOCKS:
                os.close(fd)
                raise
            log(f"[checkpoint] WARNING: the file system of --save={save_dir} does not support locks ({err.strerror});"
                " nothing stops a second run from writing into it at the same time.")
            os.close(fd)
            return SaveLock(path, None)  # nothing to release: the directory stays
        try:
            current = os.stat(path).st_ino
        except FileNotFoundError:
            current = None
        if current != os.fstat(fd).st_ino:  # deleted by a releasing holder after we opened it
            os.close(fd)
            continue
        previous = _describe(_read(fd))
        if previous is not None:
            log(f"[checkpoint] notice: took over the lock of --save={save_dir} from a run that ended without "
                f"releasing it ({previous}; no process holds it any more).")
        record = _holder_record().encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, record, 0)
        os.fsync(fd)
        return SaveLock(path, fd, created_dir)
    raise RunError(f"--save={save_dir}: could not lock {path} (it keeps being replaced); is another run starting?")


def lock_save_directory(save_dir: str, log: Callable = print) -> SaveLock:
    """`acquire_save_lock` on global rank 0; every rank returns (rank 0 holding the lock) or raises the same
    `RunError` (`common.parallel.agree_or_raise`: one all-reduce, the message gathered on failure only). Collective
    over the world when `torch.distributed` is initialised."""
    # Local: this module is read by the argument checks (`resume.py`), which must not import torch.
    import torch.distributed as dist

    from ..common.parallel import agree_or_raise, distributed_ready

    rank = dist.get_rank() if distributed_ready() else 0
    lock, verdict, failure = SaveLock(os.path.join(save_dir, LOCK_FILE), None), None, None
    if rank == 0:
        try:
            lock = acquire_save_lock(save_dir, log)
        except RunError as err:
            verdict = str(err)
        except Exception as err:  # noqa: BLE001 - a bug or an I/O error: the other ranks must not wait
            failure = err
            verdict = f"rank 0 could not lock --save={save_dir}: {type(err).__name__}: {err}"
    try:
        agree_or_raise(verdict, error_type=RunError, explain=_rank_zero_verdict)
    except RunError:
        if failure is not None:  # rank 0 keeps its own error (and traceback)
            raise failure from None
        raise
    return lock


def _rank_zero_verdict(per_rank: list, mismatch: bool) -> str:
    """Rank 0's refusal, the one message every rank raises (`agree_or_raise`'s `explain`)."""
    return per_rank[0][0]
