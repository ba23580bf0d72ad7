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
warning and goes on without it. The lock itself is `common.dirlock` (regeneration's `--output` takes the
same one); this module adds the save directory's file name, its message and the agreement over the ranks.
"""

from __future__ import annotations

import os
from typing import Callable

from ..common.dirlock import DirectoryLock, acquire_directory_lock
from ..common.errors import RunError

__all__ = ["LOCK_FILE", "SaveLock", "acquire_save_lock", "lock_save_directory"]

LOCK_FILE = ".dflash_save.lock"
SaveLock = DirectoryLock  # the held lock of one save directory (`common.dirlock`, the lock's core)


def acquire_save_lock(save_dir: str, log: Callable = print) -> SaveLock:
    """Lock `save_dir` (created if missing, and removed again at release if it is still empty) for this
    process, or raise `RunError` naming the run that holds it."""
    return acquire_directory_lock(
        save_dir, LOCK_FILE, flag="--save", log_prefix="[checkpoint]", log=log,
        why="two runs on one save directory would corrupt each other's checkpoints: wait for that run to end, "
        "stop it, or use another --save.")


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
