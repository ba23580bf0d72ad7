"""Where a run resumes from: `--load` read once, checked, and agreed on by every rank.

`find_resume_point(load)` recognises what `--load` points at and returns the checkpoint to resume
from, or None to train from scratch, which happens only when the directory is absent or empty
(holding at most the temporaries of an interrupted first save). Everything else is a
`CheckpointError` that says what was found and what to pass instead:

* a save directory: its tracker (`latest_checkpointed_iteration.txt`) must name a complete
  checkpoint; a tracker naming a missing or incomplete one is an error, never a silent fall back
  to an older checkpoint (which would repeat steps) or to scratch (which would overwrite them);
* a save directory without a tracker, one `iter_*` / `release` checkpoint, or a HF drafter
  directory: refused with the `--load` / `--dflash-init-from` to use;
* anything else non-empty (a typo, another run's outputs): refused.

`agree_on_resume_point(load, ...)` runs it on global rank 0 only and broadcasts the result, so all
ranks resume at the same iteration or raise the same error before the collective load; with it goes
the comparison of the checkpoint's `dflash_config.json` with the run's draft configuration.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Optional, Union

import torch.distributed as dist

from ..checkpoint.torch_dist import (
    DRAFT_CONFIG_FILENAME,
    RELEASE,
    TRACKER_FILENAME,
    is_iteration_dir_name,
    iteration_dir_name,
    list_iterations,
    read_draft_config,
)
from ..common.atomic import aside_copy, temporary_of
from ..common.errors import CheckpointError
from .savelock import LOCK_FILE

__all__ = ["ResumePoint", "find_resume_point", "agree_on_resume_point", "draft_config_differences",
           "is_stale_temporary"]

# Files megatron's dist_checkpointing writes into every checkpoint directory.
_METADATA = "metadata.json"
_COMMON = "common.pt"
# Config fields that record how the weights are stored, not what the draft computes.
_STORAGE_FIELDS = {"torch_dtype", "dtype", "transformers_version"}


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint to resume from: `iteration` (a number or "release") in `directory`."""

    iteration: Union[int, str]
    directory: str


def is_stale_temporary(name: str) -> bool:
    """Entries a save leaves behind when killed: staged or moved-aside siblings of a checkpoint
    directory or of the tracker file (`common/atomic.py`; the next save restores or removes them)."""
    of = temporary_of(name)
    return of is not None and (of == TRACKER_FILENAME or is_iteration_dir_name(of))


def _complete(directory: str, iteration) -> bool:
    """A checkpoint is complete when megatron's metadata (and, for training checkpoints, the common
    state) is there; `.tmp` saves are renamed into place only once complete, so anything else was
    damaged or copied partially."""
    if not os.path.isfile(os.path.join(directory, _METADATA)):
        return False
    return iteration == RELEASE or os.path.isfile(os.path.join(directory, _COMMON))


def _complete_iterations(load: str) -> list:
    return [it for it in list_iterations(load) if _complete(os.path.join(load, iteration_dir_name(it)), it)]


def _write_tracker_hint(load: str, iterations: list) -> str:
    if not iterations:
        return "it holds no complete checkpoint"
    newest = iterations[-1] if iterations[-1] != RELEASE else iterations[0]
    return (f"its complete checkpoints are {iterations}; to resume from one, write its iteration into "
            f"{os.path.join(load, TRACKER_FILENAME)} (e.g. `echo {newest} > {os.path.join(load, TRACKER_FILENAME)}`)")


def _read_tracker(load: str):
    path = os.path.join(load, TRACKER_FILENAME)
    try:
        with open(path, "rb") as f:
            raw = f.read(64)
        text = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        raise CheckpointError(
            f"{path} is not a text file (binary content); it must hold one iteration number. "
            + _write_tracker_hint(load, _complete_iterations(load)) + "."
        ) from None
    except OSError as err:
        raise CheckpointError(f"cannot read {path}: {err.strerror or err}.") from None
    if text == RELEASE:
        return RELEASE
    if not text.isdigit():
        raise CheckpointError(
            f"{path} holds {text!r}, not an iteration number or {RELEASE!r}; "
            + _write_tracker_hint(load, _complete_iterations(load)) + "."
        )
    return int(text)


def find_resume_point(load: str) -> Optional[ResumePoint]:
    """The checkpoint of `load` to resume from, or None (absent or empty: train from scratch)."""
    if not os.path.exists(load):
        return None
    if not os.path.isdir(load):
        raise CheckpointError(f"--load={load} is not a directory.")
    if os.path.isfile(os.path.join(load, TRACKER_FILENAME)):
        iteration = _read_tracker(load)
        directory = os.path.join(load, iteration_dir_name(iteration))
        if _complete(directory, iteration):
            empty = sorted(f for f in os.listdir(directory)
                           if os.path.isfile(os.path.join(directory, f)) and os.path.getsize(os.path.join(directory, f)) == 0)
            if empty:
                raise CheckpointError(
                    f"{directory} is damaged: {', '.join(empty)} {'is' if len(empty) == 1 else 'are'} empty (a copy or "
                    "disk that failed?); " + _write_tracker_hint(load, [it for it in _complete_iterations(load)
                                                                        if it != iteration]) + "."
                )
            return ResumePoint(iteration, directory)
        state = "is incomplete (no megatron metadata or common state)" if os.path.isdir(directory) else "does not exist"
        aside = aside_copy(directory)
        extra = ""
        if aside is not None and iteration != RELEASE and _complete(aside, iteration):
            extra = (f"; a save of the same iteration was interrupted and the previous copy is intact in {aside}: "
                     f"rename it to {directory}")
        raise CheckpointError(
            f"{os.path.join(load, TRACKER_FILENAME)} names iteration {iteration} but {directory} {state}{extra}; "
            + _write_tracker_hint(load, [it for it in _complete_iterations(load) if it != iteration]) + "."
        )
    name = os.path.basename(os.path.normpath(load))
    named_like_one = is_iteration_dir_name(name)
    if os.path.isfile(os.path.join(load, _METADATA)) or (named_like_one and os.listdir(load)):
        parent = os.path.dirname(os.path.abspath(load))
        raise CheckpointError(
            f"--load={load} is one checkpoint, not a save directory; pass the directory that holds it and "
            f"{TRACKER_FILENAME}: --load {parent}."
        )
    iterations = list_iterations(load)
    if iterations:
        raise CheckpointError(
            f"--load={load} has checkpoint directories but no {TRACKER_FILENAME}, so which one to resume from is "
            f"unknown; " + _write_tracker_hint(load, _complete_iterations(load)) + "."
        )
    if os.path.isfile(os.path.join(load, "config.json")):
        raise CheckpointError(
            f"--load={load} is a HF drafter directory (config.json), not a training checkpoint; start a new run "
            f"from its weights with --dflash-init-from {load}."
        )
    # the lock of a run saving here (`savelock.py`; this run's own when --load is its --save) is no content
    entries = sorted(e for e in os.listdir(load) if not is_stale_temporary(e) and e != LOCK_FILE)
    if entries:
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        raise CheckpointError(
            f"--load={load} holds no checkpoint ({shown}); pass the directory that holds "
            f"{TRACKER_FILENAME}, or an empty or new directory to start from scratch."
        )
    return None


# ------------------------------------------------------------------------------------------ draft config


def _flat(data: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in data.items():
        if isinstance(value, dict) and key not in ("rope_scaling",):
            out.update(_flat(value, f"{prefix}{key}."))
        elif key not in _STORAGE_FIELDS:
            out[f"{prefix}{key}"] = value
    return out


def draft_config_differences(saved, config) -> list[str]:
    """`field: checkpoint X, run Y` for every field where the two draft configs differ.

    Both are config dataclasses; the fields that record the weights' storage dtype are ignored."""
    lines = []
    if type(saved) is not type(config):
        lines.append(f"draft type: checkpoint {type(saved).__name__}, run {type(config).__name__}")
    a, b = _flat(dataclasses.asdict(saved)), _flat(dataclasses.asdict(config))
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key):
            lines.append(f"{key}: checkpoint {a.get(key)!r}, run {b.get(key)!r}")
    return lines


def _check_draft_config(point: ResumePoint, config, override: bool, log) -> None:
    path = os.path.join(point.directory, DRAFT_CONFIG_FILENAME)
    if not os.path.isfile(path):
        return  # written by another tool: the tensor shapes are still checked by the load
    try:
        _, saved = read_draft_config(point.directory)
    except (ValueError, KeyError, TypeError, OSError) as err:
        raise CheckpointError(f"{path} cannot be read ({type(err).__name__}: {err}).") from None
    differences = draft_config_differences(saved, config)
    if not differences:
        return
    text = "; ".join(differences)
    if override:
        log(f"[checkpoint] WARNING: resuming {point.directory} with a different draft configuration "
            f"(--dflash-override-checkpoint-config): {text}")
        return
    raise CheckpointError(
        f"{point.directory} was trained as a different draft: {text}. Resume with the checkpoint's settings, "
        "or pass --dflash-override-checkpoint-config to continue its weights under the new ones."
    )


# ------------------------------------------------------------------------------------------ agreement


def agree_on_resume_point(load: str, config, *, override_config: bool = False, log=print) -> Optional[ResumePoint]:
    """`find_resume_point(load)` (and the draft-config check) read on global rank 0 and broadcast, so
    every rank returns the same point or raises the same `CheckpointError` before any collective load.
    Collective over the world when `torch.distributed` is initialised."""
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    rank = dist.get_rank() if distributed else 0
    box = [None]
    failure = None
    if rank == 0:
        try:
            point = find_resume_point(load)
            if point is not None:
                _check_draft_config(point, config, override_config, log)
            box[0] = ("ok", point)
        except CheckpointError as err:
            box[0] = ("error", str(err))
        except Exception as err:  # noqa: BLE001 - a bug: the other ranks must not wait for rank 0 forever
            failure = err
            box[0] = ("bug", f"rank 0 failed while reading --load={load}: {type(err).__name__}: {err}")
    if distributed:
        dist.broadcast_object_list(box, src=0)
    if failure is not None:
        raise failure
    kind, value = box[0]
    if kind == "error":
        raise CheckpointError(value)
    if kind == "bug":
        raise RuntimeError(value)
    return value
