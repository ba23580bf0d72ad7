"""Preemption: SIGTERM (how SLURM and Kubernetes stop a job) and SIGINT (Ctrl-C) end training with a checkpoint.

During the training steps (`StopSignals` installed by `train`) a first SIGTERM or SIGINT only sets a flag
and prints one line; the current step finishes, and at its end every rank learns whether any rank got
a signal (`StopSignals.agreed`: one all-reduce of one integer per step, so a signal that reached a
single rank stops all of them at the same step). The run then saves a checkpoint of that step on every
rank (with `--save`), skips the evaluation and the export, and `pretrain_dflash.py` exits with
`STOPPED_EXIT_STATUS` after a one-line message; `--load` resumes exactly there.

The first signal also gives both signals back their default action, so a second one ends the process
at once (the kernel's default, also inside a collective or a long save; the status a shell reports is
then 128 + the signal number). Outside the steps (loading, the final evaluation and export) the
handlers are not installed: SIGINT ends the run in one line (`common.cli.INTERRUPTED_EXIT_STATUS`), SIGTERM by
its default action.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Optional

__all__ = ["STOP_SIGNALS", "STOPPED_EXIT_STATUS", "StopSignals"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# sysexits' EX_TEMPFAIL ("try again later"): stopped by a signal with a checkpoint, resume with --load.
# Distinct from 0 (done), 1 (an error), 2 (a usage error) and 128 + N (killed by signal N, nothing saved).
STOPPED_EXIT_STATUS = 75


class StopSignals:
    """SIGTERM / SIGINT handlers for the training steps: `install()`, `agreed()` once per step, `restore()`.

    Only the main thread can install handlers; elsewhere (a test thread) `install` does nothing and the
    run reacts to signals as it would without it."""

    def __init__(self):
        self.received: Optional[int] = None  # the first signal's number
        self._previous: dict = {}

    def install(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def restore(self) -> None:
        """The handlers from before `install` back (idempotent)."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def _handle(self, signum: int, frame) -> None:
        if self.received is None:
            self.received = signum
        for other in STOP_SIGNALS:  # a second signal: the default action, at once
            signal.signal(other, signal.SIG_DFL)
        # os.write, not print: the signal may land inside a print to the same stream (a reentrant write fails)
        try:
            os.write(1, f"[dflash] {signal.Signals(signum).name} received: finishing this step, then saving a "
                        "checkpoint and exiting; send it again to exit at once without saving.\n".encode())
        except OSError:  # no usable stdout: the stop goes on silently
            pass

    def agreed(self) -> Optional[str]:
        """The name of the signal that any rank received (the lowest number when several did), or None.

        Collective over the world when `torch.distributed` is initialised: one all-reduce of one integer."""
        # Local: this module is read before torch loads (the argument checks, `pretrain_dflash.py`).
        import torch
        import torch.distributed as dist

        from ..common.parallel import collective_device, distributed_ready

        received = self.received or 0
        if distributed_ready() and dist.get_world_size() > 1:
            # MIN over (number or a large value): the same signal named on every rank
            flag = torch.tensor([received or 1 << 30], dtype=torch.int64, device=collective_device())
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            received = int(flag.item())
            received = 0 if received == 1 << 30 else received
        return signal.Signals(received).name if received else None
