"""One regeneration per output directory: `common.dirlock`'s exclusive lock on `--output`, for every rank.

Two regenerations writing into one directory leave a manifest of one run's settings over shards made with
another's settings, and each removes the other's staged shards as leftovers. The ranks of one run share no
process group (each writes its own shards), so each rank locks a file of its own and checks the other side:

* rank 0 holds `OUT/.dflash_regenerate.lock`, then refuses when a rank file of another run is held;
* rank `k > 0` holds `OUT/.dflash_regenerate.rank-KKKKK.lock`, then refuses when rank 0's file is held by
  another run.

Each lock records the run (`torchrun`'s run id and rendezvous address; nothing for a single process), so
"another run" is told from this run's rank 0. Whichever of two runs checks second sees the other's held
lock, in any order of starts. A refusal is one line naming the holder (host, pid, start time).
"""

from __future__ import annotations

import os
import time
from typing import Callable, Optional

from ..common.dirlock import DirectoryLock, acquire_directory_lock, describe_holder, lock_is_held, read_holder
from ..common.errors import RunError

__all__ = ["LOCK_FILE", "lock_output"]

LOCK_FILE = ".dflash_regenerate.lock"
_WHY = ("two regenerations into one directory would mix their settings and remove each other's shards: wait "
        "for that run to end, stop it, or pass another --output.")


def _rank_file(rank: int) -> str:
    return f".dflash_regenerate.rank-{rank:05d}.lock"


def run_key() -> Optional[str]:
    """What the ranks of one `torchrun` launch share (its run id and rendezvous address); None for one process."""
    parts = [os.environ.get(k) for k in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT")]
    return "/".join(p or "" for p in parts) if any(parts) else None


def _other_run_holds(path: str, key: Optional[str]) -> Optional[str]:
    """The holder of the lock file `path` when another run than `key` holds it now (None: free or ours)."""
    for _ in range(40):  # a holder between its flock and its record: wait for the record (2 s at most)
        held, record = lock_is_held(path)
        holder = read_holder(record)
        if not held or holder is not None:
            break
        time.sleep(0.05)
    if not held or (holder is not None and key is not None and holder.get("run") == key):
        return None
    return describe_holder(record) or "it has not recorded itself yet"


def lock_output(output: str, rank: int = 0, log: Callable = print) -> DirectoryLock:
    """This rank's lock of `output` (see the module docstring), or a `RunError` naming the run in the way."""
    key = run_key()
    own, other = (LOCK_FILE, None) if rank == 0 else (_rank_file(rank), LOCK_FILE)
    lock = acquire_directory_lock(output, own, flag="--output", why=_WHY, log_prefix="[regenerate]", log=log,
                                  extra={"run": key, "rank": rank})
    try:
        others = [other] if other else sorted(n for n in os.listdir(output)
                                               if n.startswith(".dflash_regenerate.rank-") and n.endswith(".lock"))
        for name in others:
            holder = _other_run_holds(os.path.join(output, name), key)
            if holder is not None:
                raise RunError(f"--output={output} is in use by another run ({holder}; lock "
                               f"{os.path.join(output, name)}); {_WHY}")
    except BaseException:
        lock.release()
        raise
    return lock
