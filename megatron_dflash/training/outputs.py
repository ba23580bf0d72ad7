"""Output paths of a run, checked before training: nothing the run did not write is replaced.

The HF export at the end of training replaces its directory in one rename, so that directory must
be no symbolic link, and new, empty, or hold a previous export of the same run (a run is named by its `--save`
directory; `EXPORT_MARKER` records it). It must not be or contain the checkpoint directory, nor any
input of the run (target, tokenizer, drafter, data). Every output directory must be creatable:
no regular file on its path, a writable existing ancestor. `check_outputs` runs in `prepare_job`
(file reads only, the same result on every rank); `check_export_directory` again right before the
export, in case the directory filled up during training.
"""

from __future__ import annotations

import json
import os
from typing import Optional

from ..common.atomic import check_not_a_link
from .arguments import ArgumentError

__all__ = ["EXPORT_MARKER", "check_outputs", "check_export_directory", "export_marker", "run_name"]

EXPORT_MARKER = "dflash_export.json"  # written into every export: which run (save directory) wrote it


def _real(path: str) -> str:
    return os.path.realpath(os.path.abspath(path))


def _inside(path: str, parent: str) -> bool:
    """`path` is `parent` or below it."""
    path, parent = _real(path), _real(parent)
    return path == parent or path.startswith(parent.rstrip(os.sep) + os.sep)


def run_name(args) -> Optional[str]:
    """What identifies a run across restarts: its checkpoint directory (None without --save)."""
    return _real(args.save) if args.save else None


def _check_creatable(flag: str, path: str) -> None:
    """`path` is a directory or can be made one: no file on the way, a writable existing ancestor."""
    path = os.path.abspath(path)
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise ArgumentError(f"{flag}={path} exists and is not a directory; choose another path.")
        if not os.access(path, os.W_OK | os.X_OK):
            raise ArgumentError(f"{flag}={path} is not writable by this user; choose another path.")
        return
    ancestor = os.path.dirname(path)
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise ArgumentError(f"{flag}={path} cannot be created: {ancestor} is a file, not a directory.")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ArgumentError(f"{flag}={path} cannot be created: {ancestor} is not writable by this user.")


def check_export_directory(export_dir: str, run: Optional[str], flag: str = "--dflash-export") -> None:
    """Raise unless `export_dir` is absent, empty, or a previous export of the run `run`, and no symbolic
    link (the export is renamed onto the path itself: `common.atomic.check_not_a_link`)."""
    try:
        check_not_a_link(export_dir, flag)
    except ValueError as err:
        raise ArgumentError(str(err)) from None
    if not os.path.isdir(export_dir) or not os.listdir(export_dir):
        return
    marker = os.path.join(export_dir, EXPORT_MARKER)
    previous = None
    if os.path.isfile(marker):
        try:
            with open(marker) as f:
                previous = json.load(f).get("run")
        except (OSError, ValueError, AttributeError):
            previous = None
    if run is not None and previous == run:
        return  # this run's own earlier export (e.g. before a restart): replaced at the end
    whose = f"the export of another run (--save {previous})" if previous else "files this run did not write"
    raise ArgumentError(
        f"{flag}={export_dir} is not empty: it holds {whose}, and the export at the end of training replaces the "
        "whole directory. Choose a new or empty directory."
    )


def check_outputs(args, export_dir: str) -> None:
    """Every output path of the run is usable and replaces nothing the run did not write."""
    outputs = [("--dflash-export", export_dir)]
    if args.save:
        outputs.append(("--save", args.save))
    if getattr(args, "tensorboard_dir", None):
        outputs.append(("--tensorboard-dir", args.tensorboard_dir))
    for flag, path in outputs:
        _check_creatable(flag, path)
    export_flag = "--dflash-export" if args.dflash_export is not None else "the default export directory"
    protected = [("--save", args.save), ("--load", args.load), ("--target", args.target),
                 ("--tokenizer", args.tokenizer), ("--dflash-init-from", args.dflash_init_from),
                 ("--train-data", getattr(args, "train_path", None)), ("--valid-data", args.valid_data),
                 ("--tensorboard-dir", getattr(args, "tensorboard_dir", None))]
    for flag, path in protected:
        if path and _inside(path, export_dir):
            raise ArgumentError(
                f"{export_flag}={export_dir} is or contains {flag}={path}; the export replaces its whole directory. "
                "Export to a directory of its own (e.g. a new sibling of the checkpoints)."
            )
    check_export_directory(export_dir, run_name(args), export_flag)


def export_marker(args) -> dict[str, str]:
    """`{EXPORT_MARKER: text}`: the file that records which run wrote an export (so that a restart of that
    run may replace it). It is written into the export's staged directory, published with the weights in
    one rename: an export never appears without it (a kill right after the rename would otherwise leave
    one that the rerun refuses as foreign)."""
    return {EXPORT_MARKER: json.dumps({"run": run_name(args)}) + "\n"}
