"""The megatron `torch_dist` checkpoint layout of a draft: where training, conversion and evaluation
find its tensors, its config and the newest complete checkpoint (docs/design.md §10 Training checkpoint layout).

::

    <save>/                                   the trainer's --save / --load directory
      latest_checkpointed_iteration.txt       the newest complete checkpoint: "100", or "release"
      iter_0000100/                           one checkpoint (`iteration_dir_name(100)`)
        metadata.json                         \\
        .metadata  __0_0.distcp  ...           | a megatron `dist_checkpointing` checkpoint,
        common.pt                             /  `torch_dist` backend
        dflash_config.json                    the draft's config, in the HF config.json layout
      release/                                a weights-only checkpoint (what `to-megatron`
                                              writes by default; tracker text "release")

* **Sharded keys.** Every tensor of the draft body is stored under `model.` + its published
  HF name (`body.sharded_state_dict(prefix=MODEL_PREFIX)`), e.g.
  `model.layers.0.self_attn.q_proj.weight`, `model.candidate_selector.predecessor_codebook`
  (DFlash 2), `model.prefix_gru.*` / `model.embed_proj.*` (Domino). Readers are name-agnostic:
  they move whatever tensors the body of the checkpoint's variant has.
* **Global shapes.** Each key has the full (HF) shape; tensor-parallel ranks describe their
  shard by offsets. A checkpoint therefore does not depend on the TP size it was written at:
  it loads at any TP size that the config allows (megatron reshards on load).
* **Other state.** The trainer puts optimizer state, RNG state, the iteration etc. into the
  same checkpoint under other keys (`extra_state` of `save_megatron_draft`,
  `training/checkpointing.py`); draft readers take only the `model.` keys.
* **dflash_config.json** is `config.to_hf_dict(architecture)` of the draft (with `torch_dtype`
  / `dtype` set to the stored dtype), so the body can be rebuilt without the training
  arguments; it picks the variant like any config.json does (`checkpoint/architectures.py`). It is
  written after the tensors: an iteration directory with it holds a complete draft.
* **Tracker.** `write_tracker` replaces the tracker file atomically (`common.atomic.write_file`); one
  process (rank 0) calls it last, once the checkpoint it names is complete and in place.
* **Release checkpoints.** Converted checkpoints carry no optimizer state; like megatron's own
  converters they go to `release/` with tracker text `release`. A trainer that finds
  `release` starts a new run from these weights at iteration 0 with a fresh optimizer.

Saving never needs CUDA and never starts processes (`checkpoint/torch_dist_save.py`); loading is megatron's
`torch_dist` loader with every pickled file read against an allow-list of the format's types
(`checkpoint/torch_dist_load.py`: nothing planted in a checkpoint runs), on CPU as is.

Library use::

    from megatron_dflash.checkpoint import torch_dist
    # every rank; optimizer state etc. under other keys of the same checkpoint
    torch_dist.save_megatron_draft(body, directory, extra_state={"optimizer": ...})
    if torch.distributed.get_rank() == 0:           # save_megatron_draft ends with a barrier
        torch_dist.write_tracker(save, iteration)

    checkpoint = torch_dist.resolve_iteration_dir(load)          # tracker, or iteration=...
    body = torch_dist.load_megatron_draft(checkpoint)            # a new body, any TP size
    torch_dist.load_megatron_draft_into(body, checkpoint)        # or into an existing one

Imports: the layout names (tracker, iteration directories) are pure file-system code that the
converter's command line and the resume-point check on rank 0 use before torch and megatron are
loaded, so torch and megatron are imported inside the functions that read or write tensors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import tempfile
from typing import Iterator, Mapping, Optional, Union

from ..common.atomic import write_file
from .architectures import (
    architecture_hint,
    architecture_of,
    build_body_for_checkpoint,
    config_from_dict,
    read_json_object,
)
from .hf_config_check import check_config_shapes

__all__ = [
    "TRACKER_FILENAME",
    "RELEASE",
    "DRAFT_CONFIG_FILENAME",
    "MODEL_PREFIX",
    "MEGATRON_METADATA",
    "Iteration",
    "parse_iteration",
    "iteration_dir_name",
    "read_tracker",
    "write_tracker",
    "is_iteration_dir_name",
    "list_iterations",
    "is_checkpoint_dir",
    "looks_like_save_dir",
    "resolve_iteration_dir",
    "single_process_group",
    "common_dtype",
    "dtype_name",
    "draft_config_dict",
    "read_draft_config",
    "check_draft_config_shapes",
    "megatron_draft_tensors",
    "read_megatron_draft_state",
    "save_megatron_draft",
    "load_megatron_draft_into",
    "load_megatron_draft",
]

# ---------------------------------------------------------------------------------- layout

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
RELEASE = "release"
DRAFT_CONFIG_FILENAME = "dflash_config.json"
MODEL_PREFIX = "model."
# Written by megatron's dist_checkpointing into every checkpoint directory.
MEGATRON_METADATA = "metadata.json"
_ITERATION_DIR = re.compile(r"^iter_(\d{7,})$")

Iteration = Union[int, str]  # an iteration number or RELEASE


def parse_iteration(value: Iteration) -> Iteration:
    """An iteration number (int or digits) or `"release"`; ValueError for anything else."""
    if isinstance(value, str):
        text = value.strip()
        if text == RELEASE:
            return RELEASE
        if not text.isdigit():
            raise ValueError(f"iteration {value!r} must be a non-negative integer or {RELEASE!r}.")
        value = int(text)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"iteration {value!r} must be a non-negative integer or {RELEASE!r}.")
    return value


def iteration_dir_name(iteration: Iteration) -> str:
    """`iter_0000100` for 100 (megatron's 7-digit naming), `release` for RELEASE."""
    iteration = parse_iteration(iteration)
    return RELEASE if iteration == RELEASE else f"iter_{iteration:07d}"


def read_tracker(save_dir: str) -> Optional[Iteration]:
    """The iteration named by `save_dir/latest_checkpointed_iteration.txt` (None without one)."""
    path = os.path.join(save_dir, TRACKER_FILENAME)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    try:
        return parse_iteration(text)
    except ValueError:
        raise ValueError(f"{path} holds {text!r}, not an iteration number or {RELEASE!r}.") from None


def write_tracker(save_dir: str, iteration: Iteration) -> None:
    """Point `save_dir`'s tracker at `iteration` (atomically). One process (rank 0) calls it,
    after the checkpoint of that iteration is complete on every rank."""
    write_file(os.path.join(save_dir, TRACKER_FILENAME), f"{parse_iteration(iteration)}\n")


def is_iteration_dir_name(name: str) -> bool:
    """Whether `name` is a checkpoint directory's name (`iter_0000100`, `release`)."""
    return name == RELEASE or _ITERATION_DIR.match(name) is not None


def list_iterations(save_dir: str) -> list[Iteration]:
    """The checkpoint directories present in `save_dir`, oldest first (`release` last)."""
    if not os.path.isdir(save_dir):
        return []
    found: list[Iteration] = []
    for name in os.listdir(save_dir):
        match = _ITERATION_DIR.match(name)
        if match and os.path.isdir(os.path.join(save_dir, name)):
            found.append(int(match.group(1)))
    found.sort()
    if os.path.isdir(os.path.join(save_dir, RELEASE)):
        found.append(RELEASE)
    return found


def is_checkpoint_dir(path: str) -> bool:
    """Whether `path` is one checkpoint directory (megatron metadata or a draft config in it)."""
    return os.path.isfile(os.path.join(path, MEGATRON_METADATA)) or os.path.isfile(
        os.path.join(path, DRAFT_CONFIG_FILENAME)
    )


def looks_like_save_dir(path: str) -> bool:
    """Whether `path` holds megatron checkpoints in any form (a tracker, iteration directories, or
    is one checkpoint itself): for hints when a tool is given the wrong kind of directory."""
    return os.path.isfile(os.path.join(path, TRACKER_FILENAME)) or is_checkpoint_dir(path) or bool(
        list_iterations(path)
    )


def resolve_iteration_dir(load: str, iteration: Optional[Iteration] = None) -> str:
    """The checkpoint directory to read from `load`.

    `load` is a save directory (with the tracker file and `iter_*` / `release` directories) or
    one checkpoint directory itself. In a save directory, `iteration` picks a checkpoint
    (default: the tracker's).

    Raises:
        FileNotFoundError: `load` is missing, or the requested checkpoint is not there (the
            available ones are listed).
        ValueError: a save directory without a tracker file and no `iteration` given.
    """
    if not os.path.isdir(load):
        raise FileNotFoundError(f"{load} does not exist or is not a directory.")
    available = list_iterations(load)
    if iteration is not None:
        iteration = parse_iteration(iteration)
        path = os.path.join(load, iteration_dir_name(iteration))
        if os.path.isdir(path):
            return path
        if is_checkpoint_dir(load) and not available:
            raise ValueError(
                f"{load} is a single checkpoint directory, not a save directory; drop --iteration "
                "or pass the save directory that holds the iter_* directories."
            )
        raise FileNotFoundError(
            f"{path} does not exist; the checkpoints in {load} are {available or 'none'}."
        )
    tracked = read_tracker(load)
    if tracked is not None:
        path = os.path.join(load, iteration_dir_name(tracked))
        if not os.path.isdir(path):
            raise FileNotFoundError(
                f"{os.path.join(load, TRACKER_FILENAME)} names iteration {tracked} but {path} does not "
                f"exist; the checkpoints in {load} are {available or 'none'} (pick one with --iteration)."
            )
        return path
    if is_checkpoint_dir(load):
        return load
    if available:
        raise ValueError(
            f"{load} has no {TRACKER_FILENAME}; choose one of the checkpoints {available} with "
            "--iteration (iteration=...)."
        )
    hint = ""
    if os.path.isfile(os.path.join(load, "config.json")):
        hint = " It looks like a HF draft directory: convert it with to-megatron."
    raise FileNotFoundError(
        f"{load} holds no megatron checkpoint: no {TRACKER_FILENAME}, no iter_*/release directory and "
        f"no {MEGATRON_METADATA}.{hint}"
    )


# ---------------------------------------------------------------------------------- dtypes


def common_dtype(dtypes):
    """The one floating dtype all tensors share, else float32 (lossless for the others)."""
    import torch

    found = set(dtypes)
    if len(found) == 1:
        (only,) = found
        if only in (torch.bfloat16, torch.float16, torch.float32):
            return only
    return torch.float32


def dtype_name(dtype) -> str:
    """`bfloat16` for `torch.bfloat16` (the name HF configs write)."""
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------------- process group


@contextlib.contextmanager
def single_process_group() -> Iterator[None]:
    """A one-rank gloo `torch.distributed` group for the block, when none is initialised.

    megatron's dist_checkpointing needs `torch.distributed`; the converter and the evaluation
    tool are one process. The rendezvous is a `file://` in a private temporary directory (no port,
    nothing shared). If a group already exists it is used as is.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory(prefix="dflash-convert-") as tmp:
        dist.init_process_group(
            "gloo", init_method=f"file://{os.path.join(tmp, 'rendezvous')}", rank=0, world_size=1
        )
        try:
            yield
        finally:
            dist.destroy_process_group()


# ---------------------------------------------------------------------------------- the draft


def draft_config_dict(body) -> dict:
    """The `dflash_config.json` of `body`: its HF config dict, dtype fields set to the weights'."""
    # Local: this module's layout names are read by the tools' `--help`, which must not import torch.
    from ..draft.sharding import local_tensors

    architecture = architecture_of(body)
    dtype = common_dtype(t.dtype for t in local_tensors(body).values())
    extra = dict(body.config.extra_hf_fields)
    extra.update({"torch_dtype": dtype_name(dtype), "dtype": dtype_name(dtype)})
    config = dataclasses.replace(body.config, extra_hf_fields=extra)
    return config.to_hf_dict(architecture.architecture)


def _draft_config_path(iteration_dir: str, config_path: Optional[str] = None) -> str:
    path = config_path or os.path.join(iteration_dir, DRAFT_CONFIG_FILENAME)
    return os.path.join(path, "config.json") if os.path.isdir(path) else path


def read_draft_config(iteration_dir: str, config_path: Optional[str] = None):
    """`(architecture, config)` from `iteration_dir/dflash_config.json` (or `config_path`, a HF
    config.json, for checkpoints written without one)."""
    path = _draft_config_path(iteration_dir, config_path)
    if not os.path.isfile(path):
        if config_path is not None:
            raise FileNotFoundError(f"{path} does not exist.")
        raise FileNotFoundError(
            f"{iteration_dir} has no {DRAFT_CONFIG_FILENAME}, so the draft cannot be rebuilt from it "
            "(it was not written by megatron_dflash.checkpoint.torch_dist.save_megatron_draft). Pass the draft's "
            "HF config.json with --config."
        )
    return config_from_dict(read_json_object(path), path)


def megatron_draft_tensors(iteration_dir: str, prefix: str = MODEL_PREFIX) -> dict:
    """`{published name: (global shape, dtype)}` of the draft tensors in a torch_dist checkpoint
    (read from its metadata, no data loaded). Needs `torch.distributed` initialised."""
    # here: the layout names serve command lines before torch loads (module docstring, Imports)
    from .torch_dist_load import load_tensors_metadata

    if not os.path.isfile(os.path.join(iteration_dir, MEGATRON_METADATA)):
        raise FileNotFoundError(
            f"{iteration_dir} has no {MEGATRON_METADATA}: not a megatron dist_checkpointing checkpoint "
            "(legacy per-rank torch checkpoints are not supported)."
        )
    metadata = load_tensors_metadata(iteration_dir)
    out = {}
    for key, sharded in metadata.items():
        if key.startswith(prefix):
            out[key[len(prefix):]] = (tuple(int(s) for s in sharded.global_shape), sharded.dtype)
    if not out:
        prefixes = sorted({key.split(".")[0] + "." for key in metadata})
        raise ValueError(
            f"{iteration_dir} holds no tensor under the draft prefix {prefix!r} (found prefixes "
            f"{prefixes}); the draft weights are expected as {prefix}<HF name>."
        )
    return out


def check_draft_config_shapes(config, iteration_dir: str, config_path: Optional[str] = None,
                              stored: Optional[Mapping[str, tuple]] = None) -> None:
    """`CheckpointError` when the draft config (`read_draft_config`) contradicts the checkpoint's tensor shapes
    (`stored`, default: `megatron_draft_tensors` of its metadata): checked before a body is built from it
    (`hf_config_check.check_config_shapes`). Needs `torch.distributed` initialised."""
    stored = megatron_draft_tensors(iteration_dir) if stored is None else stored
    check_config_shapes(config, {name: shape for name, (shape, _) in stored.items()},
                        _draft_config_path(iteration_dir, config_path), iteration_dir)


def read_megatron_draft_state(iteration_dir: str, prefix: str = MODEL_PREFIX) -> dict:
    """`{published name: full tensor}` of a torch_dist checkpoint, in the stored dtypes, read
    directly from the checkpoint (no body involved: the independent view `--validate` uses).
    Needs `torch.distributed` initialised; every calling rank reads every tensor whole."""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    # here: the layout names serve command lines before torch loads (module docstring, Imports)
    from .torch_dist_load import load

    stored = megatron_draft_tensors(iteration_dir, prefix)
    request = {
        prefix + name: ShardedTensor.from_rank_offsets(prefix + name, torch.empty(shape, dtype=dtype))
        for name, (shape, dtype) in stored.items()
    }
    loaded = load(request, iteration_dir)
    return {name: loaded[prefix + name] for name in stored}


def _check_tensors(body, given: Mapping[str, tuple], what: str, architecture=None) -> None:
    """Raise ValueError naming missing, unexpected and mis-shaped tensors of `given`
    (`{name: shape}`, full shapes) against `body`, with a hint when the config is the cause."""
    # here: the layout names serve command lines before torch loads (module docstring, Imports)
    from .hf import check_tensor_shapes

    check_tensor_shapes(body, given, what, extra_hints=(lambda unexpected: architecture_hint(architecture, unexpected),))


def save_megatron_draft(body, iteration_dir: str, *, extra_state: Optional[dict] = None, strategy=None,
                        draft_config: Optional[dict] = None) -> None:
    """Write `body` (any TP size) as one megatron checkpoint directory of the layout above.

    A collective over every rank of `torch.distributed` (a one-rank gloo group is set up when
    none is initialised): all ranks call it with their own shards. The draft tensors go under
    `model.`; `extra_state` (e.g. `{"optimizer": optimizer.sharded_state_dict(...),
    "iteration": 100}`) is saved in the same checkpoint and must not use the key `"model"` or
    sharded keys starting with `model.`. Global rank 0 then writes `dflash_config.json`.
    It ends with a barrier over all ranks; then rank 0 may write the tracker (`write_tracker`).

    `iteration_dir` is written in place: callers that publish it write into a staged directory and
    move that into place (`common.atomic.atomic_directory`, `common.atomic.publish_directory`).

    Args:
        strategy: a megatron `SaveShardedStrategy`; default `in_process_save_strategy()`.
        draft_config: with ``body=None`` (a pipeline-parallel rank off the draft's stage, which joins
            the collective with no draft shards, only `extra_state`): the draft's `draft_config_dict`,
            written by global rank 0 when it holds no draft itself.
    """
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    # here: the layout names serve command lines before torch loads (module docstring, Imports)
    from .torch_dist_save import in_process_save_strategy

    if body is None and draft_config is None:
        raise ValueError("save_megatron_draft: body=None (no draft on this rank) needs draft_config=.")
    state: dict = {"model": body.sharded_state_dict(prefix=MODEL_PREFIX)} if body is not None else {}
    if extra_state:
        if "model" in extra_state:
            raise ValueError("extra_state must not have the key 'model': it holds the draft weights.")
        clashing = sorted(
            v.key for v in nested_values(extra_state) if isinstance(v, ShardedBase) and v.key.startswith(MODEL_PREFIX)
        )
        if clashing:
            raise ValueError(
                f"extra_state has sharded keys under the draft prefix {MODEL_PREFIX!r}: {clashing[:5]}; "
                "use another prefix (e.g. 'optimizer.')."
            )
        state.update(extra_state)
    config = draft_config_dict(body) if body is not None else draft_config
    with single_process_group():
        os.makedirs(iteration_dir, exist_ok=True)
        dist_checkpointing.save(state, iteration_dir, sharded_strategy=strategy or in_process_save_strategy())
        if dist.get_rank() == 0:
            write_file(
                os.path.join(iteration_dir, DRAFT_CONFIG_FILENAME), json.dumps(config, indent=2, sort_keys=True) + "\n"
            )
        dist.barrier()


def load_megatron_draft_into(body, iteration_dir: str) -> None:
    """Load the draft weights of a megatron checkpoint directory into `body` (any TP size:
    megatron reshards). Collective over every rank; values are cast to the body's dtype.

    Raises:
        ValueError: naming missing, unexpected and mis-shaped tensors (checked from the
            checkpoint's metadata before anything is read), with a hint when the config and
            the weights disagree.
    """
    # here: the layout names serve command lines before torch loads (module docstring, Imports)
    from .hf import load_sharded_state_dict_into

    # here: the layout names serve command lines before torch loads (module docstring, Imports)
    from .torch_dist_load import load

    with single_process_group():
        stored = megatron_draft_tensors(iteration_dir)
        _check_tensors(
            body, {name: shape for name, (shape, _) in stored.items()}, f"the checkpoint {iteration_dir}",
            _registered_architecture(body),
        )
        request = body.sharded_state_dict(prefix=MODEL_PREFIX)
        loaded = load(request, iteration_dir)
    # The common (non-sharded) state of the checkpoint comes back too: keep the draft's keys.
    load_sharded_state_dict_into(body, {key: loaded[key] for key in request}, prefix=MODEL_PREFIX)


def _registered_architecture(body):
    try:
        return architecture_of(body)
    except ValueError:
        return None


def load_megatron_draft(
    iteration_dir: str,
    tp_group=None,
    *,
    parallel_config=None,
    attention_backend: str = "auto",
    config_path: Optional[str] = None,
):
    """Build the draft body of a megatron checkpoint directory (from its `dflash_config.json`)
    and load its weights. Collective over every rank; the TP size may differ from the one
    the checkpoint was written at.

    Args:
        iteration_dir: one checkpoint directory (see `resolve_iteration_dir`).
        tp_group: tensor-parallel group (megatron's when None and initialised, else one rank).
        parallel_config: megatron `ModelParallelConfig` for the body (`params_dtype` etc.);
            default `default_parallel_config()` (fp32, weights initialised so megatron marks
            its split weights, then overwritten).
        config_path: a HF config.json to use instead of `dflash_config.json`.
    """
    architecture, config = read_draft_config(iteration_dir, config_path)
    check_draft_config_shapes(config, iteration_dir, config_path)  # before the body is built from it
    body = build_body_for_checkpoint(
        architecture, config, parallel_config=parallel_config, tp_group=tp_group,
        attention_backend=attention_backend, initialize=True,
    )
    load_megatron_draft_into(body, iteration_dir)
    return body
