"""Training checkpoints: megatron `dist_checkpointing` (torch_dist), atomic, exact resume.

The layout is the draft's `torch_dist` layout (`checkpoint/torch_dist.py`, docs/design.md §10 Training
checkpoint layout), so `megatron-dflash-convert to-hf` reads a training checkpoint::

    SAVE/latest_checkpointed_iteration.txt     "6" (or "release": converted weights, no training state)
    SAVE/iter_0000006/                         torch_dist checkpoint (`checkpoint.torch_dist.save_megatron_draft`)
        model.<published name>                 the draft, each TP rank its shard of the full tensor
        optimizer.*                            megatron's optimizer state (`optimizer.sharded_state_dict`):
                                               Adam moments and fp32 main weights sharded like their
                                               parameter, or (--use-distributed-optimizer) each DP rank's
                                               shard of megatron's gradient buckets (`dp_reshardable`)
        rng_state.*                            the RNG states as tensors, one row per rank (`_rng_state`)
        common.pt                              iteration, scheduler, optimizer step, data position, args
        dflash_config.json                     the draft config (HF layout)

Atomicity (`common/atomic.py`): every rank writes into a staged `SAVE/.iter_0000006.tmp-<random>` (named by
rank 0, new for every save); once all ranks
are done, rank 0 publishes it as `iter_0000006` (`common.atomic.publish_directory`) and then replaces the
tracker file (`checkpoint.torch_dist.write_tracker`: staged file + rename). A crash at any point before that
last rename leaves the previous checkpoint and the tracker untouched; the next save restores an
interrupted replacement of the same iteration and removes the stale staged directories.

Exact resume: the batch plans are a pure function of (step, seed), the data order of (seed, step)
(`MicroBatchIterator(start_step=iteration)`); the optimizer moments and step count, the scheduler
and the RNG states are restored. Training continues as if it had never stopped (bitwise on CPU).
The sharded keys carry global shapes, so a checkpoint also resumes at another TP / DP size (then
without the per-rank RNG states, which nothing in the loop draws from anyway); the distributed
optimizer's state resumes at another DP size but only at its TP size (`optim.optimizer_layout`).

Pipeline parallelism: megatron's `dist_checkpointing` (0.16) is collective over the whole world and its
global rank 0 writes the common state, so every rank calls `save_checkpoint` / `load_checkpoint`; ranks off
the draft's stage pass `body=None, engine=None` and take part with their RNG state only, and the common
state (scheduler, optimizer step) and `dflash_config.json` come from the draft's stage (one broadcast).
"""

from __future__ import annotations

import os
import random
import shutil
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.dict_utils import extract_matching_values
from megatron.core.dist_checkpointing.mapping import ShardedBase, ShardedObject, ShardedTensor
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

from ..checkpoint.hf import load_sharded_state_dict_into
from ..checkpoint.torch_dist import (
    MODEL_PREFIX,
    RELEASE,
    TRACKER_FILENAME,
    draft_config_dict,
    iteration_dir_name,
    load_megatron_draft_into,
    save_megatron_draft,
    write_tracker,
)
from ..checkpoint.torch_dist_load import load, load_common_state_dict, load_tensors_metadata
from ..common.atomic import new_staged_directory, publish_directory, remove_stale_siblings, temporary_of
from ..common.errors import CheckpointError
from ..common.parallel import (
    ProcessGroups,
    agree_or_raise,
    collective_device,
    current_process_groups,
    distributed_ready,
)
from .optim import optimizer_layout
from .resume import ResumePoint, find_resume_point, is_stale_temporary

__all__ = [
    "LATEST_FILE",
    "iteration_dir_name",
    "read_latest_iteration",
    "save_checkpoint",
    "load_checkpoint",
]

LATEST_FILE = TRACKER_FILENAME
# 2: megatron's optimizer state on every device (version 1 CPU runs stored a layout of their own)
# 3: the RNG state as tensors (versions 1 and 2 pickled it; still read, through the allow-list)
CHECKPOINT_VERSION = 3


# ------------------------------------------------------------------------------------------ helpers


def _rank() -> int:
    return dist.get_rank() if distributed_ready() else 0


def _world() -> int:
    return dist.get_world_size() if distributed_ready() else 1


def _barrier() -> None:
    if _world() > 1:
        dist.barrier()


def _agree_on_save(error: Optional[BaseException], final: str, staged: Optional[str], step: str) -> None:
    """`agree_or_raise` after a step of `save_checkpoint` (`step`: what it did; collective over the world):
    the same error on every rank, a full file system `NoSpaceError` everywhere; on failure rank 0 first
    deletes the staged directory (every rank has stopped writing into it)."""
    try:
        agree_or_raise(error, path=final, note="the checkpoints saved before are intact",
                       elsewhere=f"{step} checkpoint {final} failed on another rank; the previous checkpoint is intact.")
    except BaseException:
        if _rank() == 0 and staged is not None:
            shutil.rmtree(staged, ignore_errors=True)
        raise


def read_latest_iteration(directory: str):
    """The checkpoint `directory` resumes from: an iteration number, `"release"`, or None (absent or
    empty directory). Raises `CheckpointError` when the tracker names a missing or incomplete
    checkpoint, or the directory is not a save directory (see `resume.find_resume_point`)."""
    point = find_resume_point(directory)
    return None if point is None else point.iteration


def _rng_state() -> dict:
    """This rank's RNG states as tensors, so that a checkpoint holds no pickled object
    (docs/design.md §14 Reliability guarantees):

        python        int64 [625]   `random`'s Mersenne Twister words and position
        python_gauss  float64 [2]   whether `random` holds a cached gauss value, and that value
        numpy         int64 [626]   numpy's legacy Mersenne Twister words, position and has-gauss flag
        numpy_gauss   float64 [1]   numpy's cached gauss value
        torch         uint8 [n]     `torch.get_rng_state()`
        cuda          uint8 [m]     `torch.cuda.get_rng_state()` (with CUDA)
        tracker.NAME  uint8 [k]     megatron's CUDA RNG tracker states (with CUDA, once initialised)
    """
    version, words, gauss = random.getstate()
    if version != 3:
        raise RuntimeError(f"random.getstate() has version {version}; this code stores version 3.")
    _, np_words, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)
    state = {
        "python": torch.tensor(words, dtype=torch.int64),
        "python_gauss": torch.tensor([0.0 if gauss is None else 1.0, gauss or 0.0], dtype=torch.float64),
        "numpy": torch.cat([torch.from_numpy(np_words.astype(np.int64)), torch.tensor([np_pos, np_has_gauss])]),
        "numpy_gauss": torch.tensor([np_gauss], dtype=torch.float64),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state().cpu()
        try:
            tracker = get_cuda_rng_tracker().get_states()
        except Exception:  # noqa: BLE001 - tracker not initialised
            tracker = {}
        # megatron's tracker keeps byte tensors; a graph-safe one (Transformer Engine) keeps generators, which
        # then start again from their seeds (nothing in the training loop draws from them: no dropout)
        state.update({f"tracker.{name}": value.cpu() for name, value in tracker.items() if isinstance(value, torch.Tensor)})
    return state


def _set_rng_state(state: dict) -> None:
    """Restore the RNG states of `_rng_state` (or the pickled dict of checkpoints of version 2 and earlier)."""
    if "python" not in state:
        _set_legacy_rng_state(state)
        return
    gauss = state["python_gauss"].tolist()
    random.setstate((3, tuple(state["python"].tolist()), gauss[1] if gauss[0] else None))
    numpy = state["numpy"]
    np.random.set_state(("MT19937", numpy[:624].numpy().astype(np.uint32), int(numpy[624]), int(numpy[625]),
                         float(state["numpy_gauss"][0])))
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
        tracker = {key.removeprefix("tracker."): value for key, value in state.items() if key.startswith("tracker.")}
        if tracker:
            states = dict(get_cuda_rng_tracker().get_states())  # keeps the states that were not saved (generators)
            states.update(tracker)
            get_cuda_rng_tracker().set_states(states)


def _set_legacy_rng_state(state: dict) -> None:
    """The RNG states as checkpoints of version 2 and earlier pickled them (`random` / numpy state tuples)."""
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
        if "tracker" in state:
            get_cuda_rng_tracker().set_states(state["tracker"])


def _rng_sharded(state: Optional[dict], legacy: bool = False):
    """The checkpoint entry of this rank's RNG state: each tensor of `_rng_state` one row of a
    `(world size, n)` tensor (`rng_state.<name>`, row = global rank). `state=None` (loading): the
    current state gives the shapes. `legacy`: the one pickled object of checkpoints of version 2
    and earlier (loading only)."""
    if legacy:
        return ShardedObject("rng_state", None, (_world(),), (_rank(),), replica_id=0)
    state = _rng_state() if state is None else state
    return {
        name: ShardedTensor.from_rank_offsets(f"rng_state.{name}", tensor, (0, _rank(), _world()),
                                              replica_id=0, prepend_axis_num=1)
        for name, tensor in state.items()
    }


def _pipeline_parallel(groups: ProcessGroups) -> bool:
    """Whether the job has several pipeline stages (the draft then lives on one of them only)."""
    return _world() > 1 and groups.pp_size > 1


def _from_a_draft_rank(payload, holds_draft: bool):
    """`payload` of the lowest global rank that holds the draft, on every rank (collective over the world).

    Pipeline parallelism: global rank 0 writes the checkpoint's common state and `dflash_config.json`
    but may sit on a stage without the draft (no optimizer, no scheduler)."""
    src = torch.tensor([_rank() if holds_draft else _world()], dtype=torch.int64, device=collective_device())
    dist.all_reduce(src, op=dist.ReduceOp.MIN)
    box = [payload if holds_draft else None]
    dist.broadcast_object_list(box, src=int(src.item()))
    return box[0]


def _extra_state(body, engine, *, common: dict, for_load: bool = False, include_rng: bool = True,
                 rng_request: Optional[dict] = None) -> dict:
    """Everything of a training checkpoint besides the draft weights (optimizer, RNG, common state).

    The optimizer state is sharded like the parameters it belongs to, so it is described from the
    body's own sharded state dict (the same one `save_megatron_draft` stores under `model.`)."""
    model_sd = body.sharded_state_dict(prefix=MODEL_PREFIX)
    state: dict = {}
    if for_load and hasattr(engine, "sharded_state_dict_for_load"):
        state.update(engine.sharded_state_dict_for_load(model_sd))
    else:
        state.update(engine.sharded_state_dict(model_sd, prefix=MODEL_PREFIX))
    if include_rng:
        state["rng_state"] = rng_request if rng_request is not None else _rng_sharded(None if for_load else _rng_state())
    state.update(common)
    return state


def _remove_stale_temporaries(save_dir: str) -> None:
    """Leftovers of interrupted saves in `save_dir`: a replaced checkpoint that was moved aside is
    restored (`common.atomic.recover`), staged checkpoint directories and tracker files are deleted."""
    for entry in os.listdir(save_dir):
        if is_stale_temporary(entry):
            remove_stale_siblings(os.path.join(save_dir, temporary_of(entry)))


def _agree_on_staged_directory(save_dir: str, final: str, log: Callable) -> str:
    """The staged directory of this save of `final`, created by rank 0 and named on every rank.

    Its name is new for every save (`.iter_XXXXXXX.tmp-<random>`), never a fixed one: a staged directory
    that some other writer also uses (another run, despite the save directory's lock, see `savelock.py`)
    would mix the two runs' shards. Rank 0 first removes what interrupted saves left behind. A failure to
    create it is raised alike on every rank (`_agree_on_save`: a full disk is `NoSpaceError` everywhere)
    before the name is broadcast."""
    staged, error = None, None
    if _rank() == 0:
        try:
            os.makedirs(save_dir, exist_ok=True)
            _remove_stale_temporaries(save_dir)
            staged = new_staged_directory(final)
        except OSError as err:
            log(f"[checkpoint] cannot prepare a staged directory for {final} in {save_dir}: {err}")
            error = err
    _agree_on_save(error, final, staged, "preparing")
    if _world() > 1:
        box = [staged]
        dist.broadcast_object_list(box, src=0)
        staged = box[0]
    return staged


# ------------------------------------------------------------------------------------------ save / load


def save_checkpoint(
    save_dir: str,
    iteration: int,
    body,
    engine,
    *,
    common: dict,
    log: Callable = print,
    groups: Optional[ProcessGroups] = None,
) -> str:
    """Write the checkpoint of `iteration` atomically (collective over all ranks); returns its directory.

    `groups`: the job's process groups (default `common.parallel.current_process_groups()`).

    `common`: picklable training state identical on every rank (iteration, scheduler, data position,
    args). The shards go into a staged `.iter_XXXXXXX.tmp-<random>` through `checkpoint.torch_dist.save_megatron_draft`
    (the `torch_dist` format written in-process, `dflash_config.json` included); rank 0 then publishes
    the directory and, last, points the tracker file at it.
    """
    name = iteration_dir_name(iteration)
    final = os.path.join(save_dir, name)
    tmp = _agree_on_staged_directory(save_dir, final, log)

    common = dict(common, checkpoint_version=CHECKPOINT_VERSION, world_size=_world())
    draft_config = None
    if body is not None:
        extra = _extra_state(body, engine, common=common)
    if _pipeline_parallel(groups or current_process_groups()):
        # Only the draft's stage has the draft and its optimizer; the other stages join the collective
        # save with no shards but their RNG state, and the common state of the draft's stage (global
        # rank 0, which writes it, may be on another stage).
        payload = None
        if body is not None:
            payload = (extract_matching_values(extra, lambda v: isinstance(v, ShardedBase))[1],
                       draft_config_dict(body))
        shared, draft_config = _from_a_draft_rank(payload, body is not None)
        if body is None:
            extra = dict(shared, rng_state=_rng_sharded(_rng_state()))
    elif body is None:
        raise ValueError("save_checkpoint: body=None is only for pipeline stages without the draft.")
    error: Optional[BaseException] = None
    try:
        save_megatron_draft(body, tmp, extra_state=extra, draft_config=draft_config)
    except BaseException as err:  # noqa: BLE001 - every rank must learn about any rank's failure
        error = err
    _agree_on_save(error, final, tmp, "saving")

    error = None
    if _rank() == 0:
        try:
            publish_directory(tmp, final, replace=True)  # re-saving an iteration replaces it
            write_tracker(save_dir, iteration)
        except OSError as err:
            log(f"[checkpoint] publishing {final} failed: {err}")
            error = err
    _agree_on_save(error, final, tmp, "publishing")
    return final


def load_checkpoint(load_dir: str, body, engine, *, point: Optional[ResumePoint] = None,
                    log: Callable = print, optimizer_layout: Optional[str] = None) -> Optional[dict]:
    """Restore the checkpoint `point` of `load_dir` (default: `find_resume_point(load_dir)`).

    A training checkpoint (`iter_*`) restores the draft, the optimizer (moments, step count), the
    scheduler and the RNGs and returns its common state (with `iteration`). A `release` checkpoint
    (converted weights, no optimizer) restores the draft only and returns `{"iteration": 0}`.
    Returns None when there is nothing to resume from (`load_dir` absent or empty).
    `optimizer_layout` (`optim.optimizer_layout` of this run): a training checkpoint whose optimizer state
    has another layout is refused.

    Raises `CheckpointError` on every rank when the checkpoint cannot be read on any rank (damaged
    shards, a missing common state, tensors of another shape), naming the directory.
    """
    if point is None:
        point = find_resume_point(load_dir)
    if point is None:
        return None
    error: Optional[BaseException] = None
    out = None
    try:
        out = _load(point.directory, point.iteration, body, engine, log, optimizer_layout)
    except BaseException as err:  # noqa: BLE001 - every rank must learn about any rank's failure
        if isinstance(err, (KeyboardInterrupt, SystemExit)):  # torch's CheckpointException is a BaseException
            raise
        error = err
    hint = ("resume from an earlier checkpoint (write its iteration into "
            f"{os.path.join(load_dir, TRACKER_FILENAME)}) or start from scratch with a new --save/--load directory")
    if error is not None and not isinstance(error, CheckpointError):
        cause = error
        error = CheckpointError(
            f"cannot load {point.directory}: {_describe(cause)}; the checkpoint is damaged or was not written for this "
            f"draft: {hint}."
        )
        error.__cause__ = cause  # as `raise ... from cause` (--debug shows it)
    agree_or_raise(error, elsewhere=CheckpointError(
        f"loading {point.directory} failed on another rank (see its error); {hint}."))
    return out


def _describe(error: BaseException) -> str:
    """`Type: first line` of an exception; for torch's CheckpointException, of the first rank's cause."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, cause = next(iter(sorted(failures.items(), key=lambda kv: kv[0])))
        cause = cause[0] if isinstance(cause, tuple) else cause
        if isinstance(cause, BaseException):
            return f"{_describe(cause)} (rank {rank})"
    first = (str(error).strip().splitlines() or [""])[0][:300]
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


def _load(directory: str, iteration, body, engine, log: Callable, optimizer_layout: Optional[str]) -> dict:
    if body is None:  # a pipeline stage without the draft: join the collective load, nothing to restore
        return _load_off_draft_stage(directory, iteration, optimizer_layout)
    if iteration == RELEASE:
        load_megatron_draft_into(body, directory)
        log(f"[checkpoint] loaded the draft weights of {directory} (release: new run, fresh optimizer)")
        return {"iteration": 0, "directory": directory, "release": True}
    common = load_common_state_dict(directory)
    if "scheduler" not in common:
        raise CheckpointError(
            f"{directory} holds draft weights but no training state (no optimizer/scheduler); start a new run "
            "from it with --dflash-init-from (after converting to HF) or as a 'release' checkpoint."
        )
    _check_optimizer_layout(common, directory, optimizer_layout)
    same_world = common.get("world_size") == _world()
    if not same_world:
        log(f"[checkpoint] {directory} was written by {common.get('world_size')} ranks, this run has "
            f"{_world()}: the RNG states are not restored (everything else is).")
    request = {"model": body.sharded_state_dict(prefix=MODEL_PREFIX)}
    request.update(_extra_state(body, engine, common={}, for_load=True, include_rng=same_world,
                                rng_request=_rng_request(directory, common) if same_world else None))
    loaded = load(request, directory)
    model = {k: loaded["model"][k] for k in request["model"]}
    load_sharded_state_dict_into(body, model, prefix=MODEL_PREFIX)
    engine.load_state(loaded)
    engine.scheduler.load_state_dict(loaded["scheduler"])
    if same_world and loaded.get("rng_state") is not None:
        _set_rng_state(loaded["rng_state"])
    out = {k: v for k, v in loaded.items() if k not in ("model", "rng_state", "optimizer")}
    out["directory"] = directory
    return out


def _rng_request(directory: str, common: dict):
    """What to load of the RNG state of the checkpoint `directory` (its common state `common`): the tensors of
    this process's RNGs that it holds (one written without CUDA has no CUDA states), or, from checkpoints of
    version 2 and earlier, the one pickled object (unpickled against `checkpoint.restricted_unpickle.LEGACY_RNG`)."""
    if int(common.get("checkpoint_version", 1)) < 3:
        return _rng_sharded(None, legacy=True)
    stored = load_tensors_metadata(directory)
    return {name: entry for name, entry in _rng_sharded(None).items() if entry.key in stored}


def _check_optimizer_layout(common: dict, directory: str, expected: Optional[str]) -> None:
    """Refuse (on every rank alike, before any collective) an optimizer state this run cannot restore."""
    saved_args = common.get("args", {})
    if int(common.get("checkpoint_version", 1)) < 2 and not saved_args.get("use_cuda", False):
        raise CheckpointError(
            f"{directory} was written on CPU by an earlier megatron-dflash, whose optimizer state has a layout of "
            "its own; its weights carry over: tools/convert_checkpoint.py to-hf, then --dflash-init-from (a new "
            "optimizer)."
        )
    saved = optimizer_layout(bool(saved_args.get("use_distributed_optimizer", False)),
                             int(saved_args.get("tensor_model_parallel_size", 1)))
    if expected is not None and saved != expected:
        raise CheckpointError(
            f"{directory} holds the state of a {saved}, this run has a {expected}; resume with the layout it "
            "was written with (the distributed optimizer's state resumes at any DP size but only at its TP "
            "size), or start a new run from its weights (tools/convert_checkpoint.py to-hf, then "
            "--dflash-init-from)."
        )


def _load_off_draft_stage(directory: str, iteration, optimizer_layout: Optional[str] = None) -> dict:
    """`load_checkpoint` on a pipeline stage without the draft: the same collectives, only the RNG state."""
    if iteration == RELEASE:
        load({}, directory)
        return {"iteration": 0, "directory": directory, "release": True}
    common = load_common_state_dict(directory)
    if "scheduler" not in common:
        raise CheckpointError(f"{directory} holds draft weights but no training state (no optimizer/scheduler).")
    _check_optimizer_layout(common, directory, optimizer_layout)
    same_world = common.get("world_size") == _world()
    request = {"rng_state": _rng_request(directory, common)} if same_world else {}
    loaded = load(request, directory)
    if same_world and loaded.get("rng_state") is not None:
        _set_rng_state(loaded["rng_state"])
    out = {k: v for k, v in loaded.items() if k not in ("model", "rng_state", "optimizer")}
    out["directory"] = directory
    return out
