"""Expected failures of a training run, as opposed to bugs.

Each carries one line that says what was wrong, with the file it concerns and what to do. The
entry points (`pretrain_dflash.py`, the tools) print that line and exit non-zero; a traceback is
printed only for other exceptions (bugs), or for these too with `--debug` / `MEGATRON_DFLASH_DEBUG=1`.
"""

from __future__ import annotations

from .cli import DEBUG_ENV

__all__ = ["RunError", "CheckpointError", "DataError", "DivergenceError", "DEBUG_ENV"]


class RunError(ValueError):
    """An expected failure of a run; the message names the input and the fix."""


class CheckpointError(RunError):
    """A checkpoint (directory, tracker, shards, draft config) that cannot be resumed from."""


class DataError(RunError):
    """Training or evaluation data that cannot be used (nothing supervised, ids outside the vocabulary)."""


class DivergenceError(RunError, FloatingPointError):
    """The training diverged: non-finite (NaN / Inf) gradients, raised on every rank alike before the update.

    Also a `FloatingPointError`, which is what it is, so callers that catch that keep working."""
