"""Convert DFlash draft checkpoints between the megatron training layout and the HF format.

The HF format is the one of the published drafters (docs/design.md §11 HF export format, `checkpoint.py`): a
directory with `config.json` and `model.safetensors`. The megatron layout, written by the
trainer (`save_megatron_draft`) and by `to-megatron`, and read by `to-hf` and by the trainer
when it resumes (`load_megatron_draft`), is defined here::

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
  (DFlash 2), `model.prefix_gru.*` / `model.embed_proj.*` (Domino). The converter is
  name-agnostic: it moves whatever tensors the body of the checkpoint's variant has.
* **Global shapes.** Each key has the full (HF) shape; tensor-parallel ranks describe their
  shard by offsets. A checkpoint therefore does not depend on the TP size it was written at:
  it loads at any TP size that the config allows (megatron reshards on load). This is why
  `to-megatron` needs no target TP size; `--target-tensor-parallel-size` only checks that the
  config can be split that way (TP must divide `num_key_value_heads`, heads, MLP width).
* **Other state.** The trainer may put optimizer state, RNG state, the iteration etc. into the
  same dist checkpoint under other keys (`extra_state` of `save_megatron_draft`); the
  converter reads only the `model.` keys and ignores the rest.
* **dflash_config.json** is `config.to_hf_dict(architecture)` of the draft (with `torch_dtype`
  / `dtype` set to the stored dtype), so the body can be rebuilt without the training
  arguments. It picks the variant like any config.json does (`ARCHITECTURES`: Domino by its
  architecture or `projector_type`, DFlash 2 by its architecture, JetSpec as a causal
  `DFlashDraftModel`, else DFlash; `register_architecture` adds one). It is written after
  the tensors: an iteration directory with it holds a complete draft. The trainer writes the
  tracker file last (`write_tracker` on rank 0, once `save_megatron_draft` returned; it ends
  with a barrier).
* **Release checkpoints.** Converted checkpoints carry no optimizer state; like megatron's own
  converters they go to `release/` with tracker text `release`. A trainer that finds
  `release` starts a new run from these weights at iteration 0 with a fresh optimizer.
  `to-megatron --iteration N` writes `iter_NNNNNNN/` (N zero-padded to 7 digits) instead.

Saving never needs CUDA and never starts processes: megatron 0.16.1's `torch_dist` save
strategy always starts a `multiprocessing` manager and forks one writer process per file
(independent of `thread_count`, async or not), which fails inside daemonic processes
(the test rank pool, some launchers), and it calls `torch.cuda.synchronize()` /
`torch.cuda.current_device()`, which fail on a CPU-only torch. `in_process_save_strategy()`
writes the same format (megatron's own translation to `torch.distributed.checkpoint` and its
save planner, then torch's synchronous `FileSystemWriter`) in the calling process. Loading is
megatron's default `torch_dist` loader, which runs on CPU as is.

The CLI (`megatron-dflash-convert`, `tools/convert_checkpoint.py`) runs as one process on the
CPU; when `torch.distributed` is not initialised it sets up a one-rank gloo group with a
`file://` rendezvous in a temporary directory and destroys it at the end. Outputs are written
atomically: into a temporary directory next to `--output`, renamed into place only once
complete (and validated, with `--validate`).

Library use::

    from megatron_dflash import convert
    # every rank; optimizer state etc. under other keys of the same checkpoint
    convert.save_megatron_draft(body, os.path.join(save, convert.iteration_dir_name(it)),
                                extra_state={"optimizer": optimizer.sharded_state_dict(...)})
    if torch.distributed.get_rank() == 0:           # save_megatron_draft ends with a barrier
        convert.write_tracker(save, it)

    checkpoint = convert.resolve_iteration_dir(load)              # tracker, or iteration=...
    body = convert.load_megatron_draft(checkpoint)                # a new body, any TP size
    convert.load_megatron_draft_into(body, checkpoint)            # or into an existing one
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib
import json
import os
import re
import sys
import tempfile
from typing import Any, Iterator, Mapping, Optional, Union

from .atomic import atomic_directory
from .config import architecture_name, resolve_causal

__all__ = [
    "TRACKER_FILENAME",
    "RELEASE",
    "DRAFT_CONFIG_FILENAME",
    "MODEL_PREFIX",
    "DraftArchitecture",
    "ARCHITECTURES",
    "register_architecture",
    "architecture_for_config",
    "architecture_of",
    "serving_notes",
    "iteration_dir_name",
    "read_tracker",
    "write_tracker",
    "list_iterations",
    "resolve_iteration_dir",
    "single_process_group",
    "in_process_save_strategy",
    "draft_config_dict",
    "read_draft_config",
    "megatron_draft_tensors",
    "read_megatron_draft_state",
    "save_megatron_draft",
    "load_megatron_draft_into",
    "load_megatron_draft",
    "ConversionResult",
    "convert_megatron_to_hf",
    "convert_hf_to_megatron",
    "main",
]

# ---------------------------------------------------------------------------------- layout

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
RELEASE = "release"
DRAFT_CONFIG_FILENAME = "dflash_config.json"
MODEL_PREFIX = "model."
# Written by megatron's dist_checkpointing into every checkpoint directory.
_MEGATRON_METADATA = "metadata.json"
_ITERATION_DIR = re.compile(r"^iter_(\d{7,})$")

Iteration = Union[int, str]  # an iteration number or RELEASE


def _parse_iteration(value: Iteration) -> Iteration:
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
    iteration = _parse_iteration(iteration)
    return RELEASE if iteration == RELEASE else f"iter_{iteration:07d}"


def read_tracker(save_dir: str) -> Optional[Iteration]:
    """The iteration named by `save_dir/latest_checkpointed_iteration.txt` (None without one)."""
    path = os.path.join(save_dir, TRACKER_FILENAME)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    try:
        return _parse_iteration(text)
    except ValueError:
        raise ValueError(f"{path} holds {text!r}, not an iteration number or {RELEASE!r}.") from None


def _read_tracker_safely(save_dir: str) -> Optional[Iteration]:
    try:
        return read_tracker(save_dir)
    except (ValueError, OSError):
        return None


def _write_text_atomic(path: str, text: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.tmp-", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_tracker(save_dir: str, iteration: Iteration) -> None:
    """Point `save_dir`'s tracker at `iteration` (atomically). One process (rank 0) calls it,
    after the checkpoint of that iteration is complete on every rank."""
    _write_text_atomic(os.path.join(save_dir, TRACKER_FILENAME), f"{_parse_iteration(iteration)}\n")


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


def _is_checkpoint_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, _MEGATRON_METADATA)) or os.path.isfile(
        os.path.join(path, DRAFT_CONFIG_FILENAME)
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
        iteration = _parse_iteration(iteration)
        path = os.path.join(load, iteration_dir_name(iteration))
        if os.path.isdir(path):
            return path
        if _is_checkpoint_dir(load) and not available:
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
    if _is_checkpoint_dir(load):
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
        f"no {_MEGATRON_METADATA}.{hint}"
    )


# ---------------------------------------------------------------------------------- variants


@dataclasses.dataclass(frozen=True)
class DraftArchitecture:
    """How to recognise and build one draft variant.

    Fields:
        name: the `architectures[0]` its config.json carries (several variants may share one:
            JetSpec is written as `DFlashDraftModel` with `is_causal: true`).
        config_class / body_class: classes or lazy `"module:attribute"` references.
            `config_class.from_hf_dict(dict)` reads the config; `body_class(config,
            parallel_config=, tp_group=, attention_backend=)` builds the body.
        allows_fp16: False refuses float16 weights (DFlash 2 overflows in fp16, docs/design.md §15 Pitfalls).
        matches: optional predicate (or `"module:function"`) on a config.json dict; without one a
            dict matches when its `architectures[0]` is `name` (`DFlashDraftModel` when absent).
    """

    name: str
    config_class: Any
    body_class: Any
    allows_fp16: bool = True
    matches: Any = None

    @staticmethod
    def _resolve(ref: Any):
        if isinstance(ref, str):
            module, _, attribute = ref.partition(":")
            return getattr(importlib.import_module(module), attribute)
        return ref

    def config_cls(self):
        return self._resolve(self.config_class)

    def body_cls(self):
        return self._resolve(self.body_class)

    def accepts(self, data: Mapping[str, Any]) -> bool:
        if self.matches is not None:
            try:
                matches = self._resolve(self.matches)
            except (ImportError, AttributeError):  # the variant's module is unavailable
                return False
            try:
                return bool(matches(data))
            except (AttributeError, TypeError, ValueError):  # malformed: the config parser says what is wrong
                return False
        return _architecture_name(data) == self.name


_DFLASH = "DFlashDraftModel"
_FP16_MESSAGE = (
    "{name} overflows in float16 (its acceptance drops to 0); train, convert and serve it in "
    "bfloat16 (--dtype bf16) or float32."
)


def _architecture_name(data: Mapping[str, Any]) -> str:
    return architecture_name(data)


def _is_jetspec_config(data: Mapping[str, Any]) -> bool:
    """A `DFlashDraftModel` file that declares causal in-block attention (what
    `JetSpecConfig.from_hf_dict` accepts)."""
    if _architecture_name(data) != _DFLASH:
        return False
    dflash = data.get("dflash_config") or {}
    if dflash.get("projector_type", data.get("projector_type")) not in (None, "dflash"):
        return False
    return resolve_causal(data) is True


# Checked in order; the first variant that accepts a config.json builds it. Keys are variant ids.
ARCHITECTURES: dict[str, DraftArchitecture] = {
    "domino": DraftArchitecture(
        "DominoDraftModel",
        "megatron_dflash.variants.domino:DominoConfig",
        "megatron_dflash.variants.domino:DominoBody",
        matches="megatron_dflash.variants.domino:is_domino_hf_config",
    ),
    "dflash2": DraftArchitecture(
        "DFlash2DraftModel",
        "megatron_dflash.variants.dflash2:DFlash2Config",
        "megatron_dflash.variants.dflash2:DFlash2Body",
        allows_fp16=False,
    ),
    "jetspec": DraftArchitecture(
        _DFLASH,
        "megatron_dflash.variants.jetspec:JetSpecConfig",
        "megatron_dflash.body:DFlashBody",
        matches=_is_jetspec_config,
    ),
    "dflash": DraftArchitecture(_DFLASH, "megatron_dflash.config:DFlashConfig", "megatron_dflash.body:DFlashBody"),
    # The Kimi K3 MLA draft family (docs/design.md §16 Kimi K3 draft family), named as NeMo names it.
    "kimi_k3": DraftArchitecture(
        "KimiK3DFlashDraftModel",
        "megatron_dflash.kimi_k3.config:KimiK3DraftConfig",
        "megatron_dflash.kimi_k3.body:KimiK3Body",
    ),
}


def register_architecture(
    key: str,
    name: str,
    config_class: Any,
    body_class: Any,
    *,
    allows_fp16: bool = True,
    matches: Any = None,
    replace: bool = False,
) -> DraftArchitecture:
    """Make a draft variant convertible (see `DraftArchitecture`). It is checked before the
    variants registered so far, so a predicate may claim files another variant would accept."""
    if key in ARCHITECTURES and not replace:
        raise ValueError(f"variant {key!r} is already registered; pass replace=True to change it.")
    entry = DraftArchitecture(name, config_class, body_class, allows_fp16, matches)
    rest = {k: v for k, v in ARCHITECTURES.items() if k != key}
    ARCHITECTURES.clear()
    ARCHITECTURES.update({key: entry, **rest})
    return entry


def _known_names() -> list[str]:
    return sorted({entry.name for entry in ARCHITECTURES.values()})


def architecture_for_config(data: Mapping[str, Any], source: str = "config") -> DraftArchitecture:
    """The registered variant that reads a HF-layout config dict."""
    for entry in ARCHITECTURES.values():
        if entry.accepts(data):
            return entry
    raise ValueError(
        f"{source} has architectures={data.get('architectures')}, not a draft model (known draft architectures: "
        f"{_known_names()}); pass a DFlash drafter directory, or register a new variant with "
        "megatron_dflash.convert.register_architecture(...)."
    )


def architecture_of(body) -> DraftArchitecture:
    """The registered variant of `body`, by the class of its config (nearest base first)."""
    for cls in type(body.config).__mro__:
        for entry in ARCHITECTURES.values():
            try:
                config_cls, body_cls = entry.config_cls(), entry.body_cls()
            except (ImportError, AttributeError):  # an unavailable variant cannot be this body's
                continue
            if config_cls is cls and isinstance(body, body_cls):
                return entry
    raise ValueError(
        f"{type(body).__name__} with {type(body.config).__name__} is not a registered draft variant; register "
        "it with megatron_dflash.convert.register_architecture(...)."
    )


def _config_from_dict(data: Mapping[str, Any], source: str):
    architecture = architecture_for_config(data, source)
    try:
        config = architecture.config_cls().from_hf_dict(dict(data))
    except (TypeError, KeyError, ValueError, AttributeError) as err:
        raise ValueError(f"{source} is not a valid {architecture.name} config: {err}") from err
    return architecture, config


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from err
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object.")
    return data


def _build_body(architecture: DraftArchitecture, config, *, params_dtype=None, parallel_config=None,
                tp_group=None, attention_backend: str = "auto", initialize: bool = False):
    import torch

    from .body import default_parallel_config

    if parallel_config is None:
        # Every weight is overwritten by the checkpoint: skip megatron's initialisation.
        parallel_config = default_parallel_config(
            perform_initialization=initialize, params_dtype=params_dtype or torch.float32
        )
    return architecture.body_cls()(
        config, parallel_config=parallel_config, tp_group=tp_group, attention_backend=attention_backend
    )


# ---------------------------------------------------------------------------------- dtypes

_DTYPE_NAMES = {
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp16": "float16", "float16": "float16", "half": "float16",
    "fp32": "float32", "float32": "float32", "float": "float32",
}


def _parse_dtype(value):
    """`"bf16"` / `torch.bfloat16` / None -> torch dtype or None."""
    import torch

    if value is None or isinstance(value, torch.dtype):
        if value is not None and value not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"dtype {value} is not supported; use bf16, fp16 or fp32.")
        return value
    name = _DTYPE_NAMES.get(str(value).lower().removeprefix("torch."))
    if name is None:
        raise ValueError(f"dtype {value!r} is not supported; use bf16, fp16 or fp32.")
    return getattr(torch, name)


def _common_dtype(dtypes):
    """The one floating dtype all tensors share, else float32 (lossless for the others)."""
    import torch

    found = set(dtypes)
    if len(found) == 1:
        (only,) = found
        if only in (torch.bfloat16, torch.float16, torch.float32):
            return only
    return torch.float32


def _check_dtype_allowed(architecture: DraftArchitecture, dtype) -> None:
    import torch

    if dtype == torch.float16 and not architecture.allows_fp16:
        raise ValueError(_FP16_MESSAGE.format(name=architecture.name))


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------------- process group


@contextlib.contextmanager
def single_process_group() -> Iterator[None]:
    """A one-rank gloo `torch.distributed` group for the block, when none is initialised.

    megatron's dist_checkpointing needs `torch.distributed`; the converter is one process. The
    rendezvous is a `file://` in a private temporary directory (no port, nothing shared). If a
    group already exists it is used as is; the converter then requires it to have one rank.
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


def _require_single_process() -> None:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() != 1:
        raise ValueError(
            f"the converter runs as one process, but torch.distributed has {dist.get_world_size()} "
            "ranks; run it without torchrun (the result loads at any TP size)."
        )


# ---------------------------------------------------------------------------------- torch_dist save


@functools.lru_cache(maxsize=None)
def _in_process_strategy_class():
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.strategies.base import SaveShardedStrategy
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )

    try:
        from torch.distributed.checkpoint.filesystem import SerializationFormat

        writer_format = {"serialization_format": SerializationFormat.TORCH_SAVE}
    except ImportError:  # older torch: torch.save is the only format
        writer_format = {}

    class InProcessTorchDistSaveStrategy(SaveShardedStrategy):
        """megatron's `torch_dist` format (backend `torch_dist`, version 1), written in the
        calling process: no writer processes, no CUDA calls.

        Same steps as megatron's `TorchDistSaveShardedStrategy` (keep the main replica of each
        shard, translate to torch `ShardedTensor`s, plan with `MCoreSavePlanner`), then
        `torch.distributed.checkpoint.save` with torch's synchronous `FileSystemWriter`
        (`thread_count` writer threads, files fsync'ed). Loaded by megatron's default loader.
        """

        def __init__(self, backend: str = "torch_dist", version: int = 1, thread_count: int = 1):
            super().__init__(backend, version)
            if thread_count < 1:
                raise ValueError(f"thread_count={thread_count} must be >= 1.")
            self.thread_count = thread_count

        @property
        def can_handle_sharded_objects(self) -> bool:
            return True

        def save(self, sharded_state_dict, checkpoint_dir) -> None:
            grouped, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, keep_only_main_replica=True)
            pyt_state_dict = mcore_to_pyt_state_dict(grouped, False)
            writer = dcp.FileSystemWriter(str(checkpoint_dir), thread_count=self.thread_count, **writer_format)
            planner = MCoreSavePlanner(
                dedup_replicated_tensors=False, flatten_state_dict=False, can_run_decentralized_global_plan=False
            )
            dcp.save(pyt_state_dict, storage_writer=writer, planner=planner)

    return InProcessTorchDistSaveStrategy


def in_process_save_strategy(thread_count: int = 1):
    """A megatron `SaveShardedStrategy` writing the `torch_dist` format in the calling process.

    Pass it as `sharded_strategy=` to `megatron.core.dist_checkpointing.save`. Unlike megatron's
    default it works in daemonic processes and on CPU-only torch (see the module docstring).
    """
    return _in_process_strategy_class()(thread_count=thread_count)


# ---------------------------------------------------------------------------------- megatron draft


def draft_config_dict(body) -> dict:
    """The `dflash_config.json` of `body`: its HF config dict, dtype fields set to the weights'."""
    from .checkpoint import _local_tensors

    architecture = architecture_of(body)
    dtype = _common_dtype(t.dtype for t in _local_tensors(body).values())
    extra = dict(body.config.extra_hf_fields)
    extra.update({"torch_dtype": _dtype_name(dtype), "dtype": _dtype_name(dtype)})
    config = dataclasses.replace(body.config, extra_hf_fields=extra)
    return config.to_hf_dict(architecture.name)


def read_draft_config(iteration_dir: str, config_path: Optional[str] = None):
    """`(architecture, config)` from `iteration_dir/dflash_config.json` (or `config_path`, a HF
    config.json, for checkpoints written without one)."""
    path = config_path or os.path.join(iteration_dir, DRAFT_CONFIG_FILENAME)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        if config_path is not None:
            raise FileNotFoundError(f"{path} does not exist.")
        raise FileNotFoundError(
            f"{iteration_dir} has no {DRAFT_CONFIG_FILENAME}, so the draft cannot be rebuilt from it "
            "(it was not written by megatron_dflash.convert.save_megatron_draft). Pass the draft's "
            "HF config.json with --config."
        )
    return _config_from_dict(_read_json(path), path)


def megatron_draft_tensors(iteration_dir: str, prefix: str = MODEL_PREFIX) -> dict:
    """`{published name: (global shape, dtype)}` of the draft tensors in a torch_dist checkpoint
    (read from its metadata, no data loaded). Needs `torch.distributed` initialised."""
    from megatron.core import dist_checkpointing

    if not os.path.isfile(os.path.join(iteration_dir, _MEGATRON_METADATA)):
        raise FileNotFoundError(
            f"{iteration_dir} has no {_MEGATRON_METADATA}: not a megatron dist_checkpointing checkpoint "
            "(legacy per-rank torch checkpoints are not supported)."
        )
    metadata = dist_checkpointing.load_tensors_metadata(iteration_dir)
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


def read_megatron_draft_state(iteration_dir: str, prefix: str = MODEL_PREFIX) -> dict:
    """`{published name: full tensor}` of a torch_dist checkpoint, in the stored dtypes, read
    directly from the checkpoint (no body involved: the independent view `--validate` uses).
    Needs `torch.distributed` initialised; every calling rank reads every tensor whole."""
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    stored = megatron_draft_tensors(iteration_dir, prefix)
    request = {
        prefix + name: ShardedTensor.from_rank_offsets(prefix + name, torch.empty(shape, dtype=dtype))
        for name, (shape, dtype) in stored.items()
    }
    loaded = dist_checkpointing.load(request, iteration_dir)
    return {name: loaded[prefix + name] for name in stored}


def _architecture_hint(architecture: Optional["DraftArchitecture"], unexpected: list[str]) -> Optional[str]:
    """When the unexpected tensors are neither an embedding/LM head nor prefixed, they likely
    belong to another variant whose file was labelled with this architecture (docs/design.md §15 Pitfalls)."""
    if architecture is None:
        return None
    foreign = [n for n in unexpected if not (n.startswith(("lm_head", "model.")) or "embed_tokens" in n)]
    if not foreign:
        return None
    return (
        f"the config says architectures=[{architecture.name!r}] but tensors such as {foreign[0]} belong "
        f"to another variant; if so, set `architectures` to it (known: {_known_names()})"
    )


def _check_tensors(body, given: Mapping[str, tuple], what: str, architecture=None) -> None:
    """Raise ValueError naming missing, unexpected and mis-shaped tensors of `given`
    (`{name: shape}`, full shapes) against `body`, with a hint when the config is the cause."""
    from .checkpoint import check_tensor_shapes

    check_tensor_shapes(body, given, what, extra_hints=(lambda unexpected: _architecture_hint(architecture, unexpected),))


@contextlib.contextmanager
def _process_group_if_needed() -> Iterator[None]:
    import torch.distributed as dist

    if dist.is_initialized():
        yield
    else:
        with single_process_group():
            yield


def save_megatron_draft(body, iteration_dir: str, *, extra_state: Optional[dict] = None, strategy=None,
                        draft_config: Optional[dict] = None) -> None:
    """Write `body` (any TP size) as one megatron checkpoint directory of the layout above.

    A collective over every rank of `torch.distributed` (a one-rank gloo group is set up when
    none is initialised): all ranks call it with their own shards. The draft tensors go under
    `model.`; `extra_state` (e.g. `{"optimizer": optimizer.sharded_state_dict(...),
    "iteration": 100}`) is saved in the same checkpoint and must not use the key `"model"` or
    sharded keys starting with `model.`. Global rank 0 then writes `dflash_config.json`.
    It ends with a barrier over all ranks; then rank 0 may write the tracker (`write_tracker`).

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
    with _process_group_if_needed():
        os.makedirs(iteration_dir, exist_ok=True)
        dist_checkpointing.save(state, iteration_dir, sharded_strategy=strategy or in_process_save_strategy())
        if dist.get_rank() == 0:
            _write_text_atomic(
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
    from megatron.core import dist_checkpointing

    from .checkpoint import load_sharded_state_dict_into

    with _process_group_if_needed():
        stored = megatron_draft_tensors(iteration_dir)
        _check_tensors(
            body, {name: shape for name, (shape, _) in stored.items()}, f"the checkpoint {iteration_dir}",
            _registered_architecture(body),
        )
        request = body.sharded_state_dict(prefix=MODEL_PREFIX)
        loaded = dist_checkpointing.load(request, iteration_dir)
    # The common (non-sharded) state of the checkpoint comes back too: keep the draft's keys.
    load_sharded_state_dict_into(body, {key: loaded[key] for key in request}, prefix=MODEL_PREFIX)


def _registered_architecture(body) -> Optional[DraftArchitecture]:
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
    body = _build_body(
        architecture, config, parallel_config=parallel_config, tp_group=tp_group,
        attention_backend=attention_backend, initialize=True,
    )
    load_megatron_draft_into(body, iteration_dir)
    return body


# ---------------------------------------------------------------------------------- conversion


@dataclasses.dataclass
class ConversionResult:
    """What a conversion wrote."""

    architecture: str
    source: str  # the HF directory or megatron checkpoint directory read
    output: str
    dtype: str
    num_tensors: int
    num_parameters: int
    validated: bool
    iteration: Optional[Iteration] = None  # to-megatron: the checkpoint written


def serving_notes(config_data: Mapping[str, Any]) -> list[str]:
    """What a user serving an exported HF draft must know that its config.json cannot say.

    SpecForge 0.2.0 ignores `is_causal` and runs every full-attention layer bidirectionally, so a
    drafter with causal in-block attention (JetSpec, or `causal: true`) runs wrong there.
    """
    if resolve_causal(dict(config_data)) is True:
        return [
            "this draft has causal in-block attention (is_causal / dflash_config.causal: true). The z-lab "
            "dflash reference and vLLM honour it; SpecForge ignores is_causal and would run its "
            "full-attention layers bidirectionally, so do not serve it with SpecForge."
        ]
    return []


def _overlap(a: str, b: str) -> bool:
    a, b = os.path.realpath(a), os.path.realpath(b)
    return a == b or a.startswith(b + os.sep) or b.startswith(a + os.sep)


def _check_output(output: str, force: bool, source: str, force_flag: str = "force=True") -> None:
    if _overlap(output, source):
        raise ValueError(f"--output {output} overlaps the input {source}; write somewhere else.")
    if os.path.exists(output) and not os.path.isdir(output):
        raise FileExistsError(f"{output} exists and is not a directory; choose another --output.")
    if os.path.isdir(output) and os.listdir(output) and not force:
        raise FileExistsError(
            f"{output} exists and is not empty; pass {force_flag} to replace it, or choose a new "
            "or empty directory."
        )


def _compare_exact(expected: Mapping[str, Any], got: Mapping[str, Any], what: str) -> None:
    """Every tensor of `expected` is in `got` with the same dtype, shape and values."""
    import torch

    missing = sorted(set(expected) - set(got))
    unexpected = sorted(set(got) - set(expected))
    wrong = []
    for name in sorted(set(expected) & set(got)):
        a, b = expected[name], got[name]
        if a.dtype != b.dtype:
            wrong.append(f"{name}: dtype {b.dtype} vs {a.dtype}")
        elif tuple(a.shape) != tuple(b.shape):
            wrong.append(f"{name}: shape {list(b.shape)} vs {list(a.shape)}")
        elif not torch.equal(a.cpu(), b.cpu()):
            diff = (a.float().cpu() - b.float().cpu()).abs().max().item()
            wrong.append(f"{name}: values differ (max |diff| {diff:.3g})")
    if missing or unexpected or wrong:
        parts = []
        if missing:
            parts.append(f"missing tensors {missing}")
        if unexpected:
            parts.append(f"unexpected tensors {unexpected}")
        if wrong:
            parts.append("; ".join(wrong))
        raise ValueError(f"validation failed: {what} differs from the source: " + "; ".join(parts) + ".")


def _compare_configs(expected, got, what: str) -> None:
    a = dataclasses.replace(expected, extra_hf_fields={})
    b = dataclasses.replace(got, extra_hf_fields={})
    if type(a) is not type(b) or a != b:
        diffs = [
            f"{f.name}: {getattr(b, f.name, None)!r} vs {getattr(a, f.name)!r}"
            for f in dataclasses.fields(a)
            if getattr(a, f.name) != getattr(b, f.name, None)
        ]
        raise ValueError(
            f"validation failed: the config of {what} differs from the source: {diffs or type(b).__name__}."
        )


def _convert_dtype(tensors: Mapping[str, Any], dtype) -> dict:
    return {name: (t.to(dtype) if t.is_floating_point() else t) for name, t in tensors.items()}


def convert_megatron_to_hf(
    load: str,
    output: str,
    *,
    iteration: Optional[Iteration] = None,
    dtype=None,
    validate: bool = False,
    force: bool = False,
    config_path: Optional[str] = None,
) -> ConversionResult:
    """Megatron checkpoint (save or checkpoint directory) -> HF draft directory.

    Args:
        load: a save directory (tracker + iter_*/release) or one checkpoint directory.
        output: the HF directory to write (missing or empty unless `force`).
        iteration: which checkpoint of a save directory (default: the tracker's).
        dtype: dtype of the written weights (default: the checkpoint's).
        validate: reload the written directory and compare every tensor and the config.
        force: replace a non-empty `output`.
        config_path: HF config.json to use when the checkpoint has no dflash_config.json.
    """
    import torch

    from .checkpoint import _local_tensors, load_hf_state_dict_into, read_safetensors, save_hf_checkpoint

    iteration_dir = resolve_iteration_dir(load, iteration)
    _check_output(output, force, load)
    architecture, config = read_draft_config(iteration_dir, config_path)
    dtype = _parse_dtype(dtype)
    with _process_group_if_needed():
        _require_single_process()
        stored = megatron_draft_tensors(iteration_dir)
        out_dtype = dtype or _common_dtype(d for _, d in stored.values())
        _check_dtype_allowed(architecture, out_dtype)
        # The body holds the weights as stored (fp32 when they mix dtypes: exact for all of
        # them); the one cast to the output dtype happens on export.
        body_dtype = _common_dtype(d for _, d in stored.values())
        if body_dtype == torch.float16 and not architecture.allows_fp16:
            body_dtype = torch.float32
        body = _build_body(architecture, config, params_dtype=body_dtype, tp_group=None)
        load_megatron_draft_into(body, iteration_dir)
        # The source as stored, read without the body, for the comparison.
        source = _convert_dtype(read_megatron_draft_state(iteration_dir), out_dtype) if validate else None
    with atomic_directory(output, replace=force) as tmp:
        save_hf_checkpoint(body, tmp, dtype=out_dtype, architecture=architecture.name, overwrite=True)
        if validate:
            written = read_safetensors(tmp)
            _compare_exact(source, written, f"the written {os.path.join(output, 'model.safetensors')}")
            with open(os.path.join(tmp, "config.json")) as f:
                written_arch, written_config = _config_from_dict(json.load(f), "the written config.json")
            if written_arch.name != architecture.name:
                raise ValueError(
                    f"validation failed: the written config.json says {written_arch.name}, expected "
                    f"{architecture.name}."
                )
            _compare_configs(config, written_config, "the written config.json")
            rebuilt = _build_body(written_arch, written_config, params_dtype=out_dtype)
            load_hf_state_dict_into(rebuilt, written)  # the written config agrees with the weights
    local = _local_tensors(body)
    return ConversionResult(
        architecture=architecture.name,
        source=iteration_dir,
        output=os.path.abspath(output),
        dtype=_dtype_name(out_dtype),
        num_tensors=len(local),
        num_parameters=sum(t.numel() for t in local.values()),
        validated=validate,
    )


def convert_hf_to_megatron(
    load: str,
    output: str,
    *,
    dtype=None,
    validate: bool = False,
    force: bool = False,
    target_tensor_parallel_size: Optional[int] = None,
    iteration: Iteration = RELEASE,
) -> ConversionResult:
    """HF draft directory -> megatron save directory (tracker + one checkpoint directory).

    The result loads at any TP size the config allows (megatron reshards torch_dist
    checkpoints on load); `target_tensor_parallel_size` only checks that the config allows it.

    Args:
        load: HF directory (config.json + model.safetensors or a sharded safetensors index).
        output: the save directory to write (missing or empty unless `force`).
        dtype: dtype of the stored weights (default: the HF file's).
        validate: reload the written checkpoint and compare every tensor and the config.
        force: replace a non-empty `output`.
        target_tensor_parallel_size: refuse (naming `num_key_value_heads`) a TP size the
            config cannot be split into.
        iteration: the checkpoint to write (`release` by default: weights only).
    """
    from .checkpoint import _local_tensors, hf_state_dict, load_hf_state_dict_into, read_safetensors

    if not os.path.isdir(load):
        raise FileNotFoundError(f"{load} does not exist or is not a directory.")
    config_file = os.path.join(load, "config.json")
    if not os.path.isfile(config_file):
        hint = ""
        if _read_tracker_safely(load) is not None or _is_checkpoint_dir(load) or list_iterations(load):
            hint = " It looks like a megatron checkpoint: convert it with to-hf."
        raise FileNotFoundError(f"{config_file} does not exist: not a HF draft directory.{hint}")
    iteration = _parse_iteration(iteration)
    _check_output(output, force, load)
    architecture, config = _config_from_dict(_read_json(config_file), config_file)
    if target_tensor_parallel_size is not None:
        config.validate_tensor_parallel(int(target_tensor_parallel_size))
    dtype = _parse_dtype(dtype)
    tensors = read_safetensors(load)
    out_dtype = dtype or _common_dtype(t.dtype for t in tensors.values())
    _check_dtype_allowed(architecture, out_dtype)
    with _process_group_if_needed():
        _require_single_process()
        body = _build_body(architecture, config, params_dtype=out_dtype, tp_group=None)
        try:
            load_hf_state_dict_into(body, tensors)
        except ValueError as err:
            message = f"{load}: {err}"
            hint = _architecture_hint(architecture, sorted(set(tensors) - set(_local_tensors(body))))
            if hint:
                message += f" Also: {hint}."
            raise ValueError(message) from None
        with atomic_directory(output, replace=force) as tmp:
            iteration_dir = os.path.join(tmp, iteration_dir_name(iteration))
            save_megatron_draft(body, iteration_dir)
            write_tracker(tmp, iteration)
            if validate:
                expected = _convert_dtype(tensors, out_dtype)
                # As stored (dtype included), read without the body ...
                _compare_exact(expected, read_megatron_draft_state(iteration_dir), "the written megatron checkpoint")
                # ... and through the tracker, dflash_config.json and a rebuilt body.
                reloaded = load_megatron_draft(resolve_iteration_dir(tmp), parallel_config=_parallel_config(out_dtype))
                _compare_configs(config, reloaded.config, f"the written {DRAFT_CONFIG_FILENAME}")
                _compare_exact(expected, hf_state_dict(reloaded), "the megatron checkpoint loaded into a draft body")
    return ConversionResult(
        architecture=architecture.name,
        source=os.path.abspath(load),
        output=os.path.abspath(output),
        dtype=_dtype_name(out_dtype),
        num_tensors=len(tensors),
        num_parameters=sum(t.numel() for t in tensors.values()),
        validated=validate,
        iteration=iteration,
    )


def _parallel_config(dtype):
    from .body import default_parallel_config

    return default_parallel_config(perform_initialization=False, params_dtype=dtype)


# ---------------------------------------------------------------------------------- CLI

_PROG = "megatron-dflash-convert"


def _iteration_arg(text: str) -> Iteration:
    try:
        return _parse_iteration(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def build_parser(prog: str = _PROG) -> argparse.ArgumentParser:
    from .cli import ArgumentParser  # one-line usage errors, each default shown once in --help

    parser = ArgumentParser(
        prog=prog,
        description="Convert DFlash draft checkpoints (DFlash, DFlash 2 and other registered variants) "
        "between megatron's torch_dist training checkpoints and the HF format of the published "
        "drafters (config.json + model.safetensors). Runs as one CPU process; no GPU needed.",
        epilog="Megatron layout: <save>/latest_checkpointed_iteration.txt and <save>/iter_0000100/ "
        "(a torch_dist checkpoint with the draft under 'model.<HF name>' plus dflash_config.json). "
        "See the module docstring of megatron_dflash.convert.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="{to-hf,to-megatron}")

    def common(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
                         help="dtype of the written weights (default: the input's). fp16 is refused "
                         "for DFlash 2.")
        sub.add_argument("--validate", action="store_true",
                         help="reload the written result and compare every tensor (exactly, after the "
                         "dtype cast) and the config before moving it into place.")
        sub.add_argument("--force", action="store_true",
                         help="replace --output if it exists and is not empty.")

    to_hf = commands.add_parser(
        "to-hf", help="megatron checkpoint -> HF draft directory",
        description="Megatron torch_dist checkpoint (any TP size) -> HF draft directory.",
    )
    to_hf.add_argument("--load", required=True,
                       help="megatron save directory (with latest_checkpointed_iteration.txt) or one "
                       "checkpoint directory (iter_0000100/).")
    to_hf.add_argument("--output", required=True, help="HF directory to write.")
    to_hf.add_argument("--iteration", type=_iteration_arg, default=None,
                       help="checkpoint of the save directory to convert: an iteration number or "
                       "'release' (default: the one the tracker file names).")
    to_hf.add_argument("--config", default=None,
                       help="HF config.json (or its directory) to use when the checkpoint has no "
                       "dflash_config.json.")
    common(to_hf)

    to_meg = commands.add_parser(
        "to-megatron", help="HF draft directory -> megatron checkpoint",
        description="HF draft directory -> megatron save directory (torch_dist). The result is resharded "
        "when loaded, so it loads at any tensor-parallel size the config allows.",
    )
    to_meg.add_argument("--load", required=True, help="HF draft directory (config.json + model.safetensors).")
    to_meg.add_argument("--output", required=True, help="megatron save directory to write.")
    to_meg.add_argument("--iteration", type=_iteration_arg, default=RELEASE,
                        help="checkpoint to write: 'release' (weights only, the default) or an "
                        "iteration number (iter_NNNNNNN/).")
    to_meg.add_argument("--target-tensor-parallel-size", type=_positive_int, default=None,
                        help="only check that the draft can be trained at this TP size (it must divide "
                        "num_key_value_heads); torch_dist checkpoints are resharded at load, so the "
                        "written files do not depend on it.")
    common(to_meg)
    return parser


def _check_cli_paths(args) -> None:
    """The command line's paths, checked before torch and megatron load (raises `UsageError`)."""
    from .cli import UsageError, require_dir, require_file

    require_dir("--load", args.load)
    config = getattr(args, "config", None)
    if config is not None and not os.path.isdir(config):
        require_file("--config", config)
    try:
        _check_output(args.output, args.force, args.load, force_flag="--force")
    except (ValueError, FileExistsError) as err:
        raise UsageError(str(err)) from None


def main(argv: Optional[list[str]] = None, prog: str = _PROG) -> int:
    """CLI entry point; returns the exit status (0 ok, 1 conversion error, 2 usage error).

    Usage errors (a bad flag, a missing --load, a non-empty --output without --force) are found
    before torch and megatron are imported and reported in one line, like every tool here.
    """
    from .cli import USAGE_EXIT_CODE, UsageError, quiet_dependency_warnings, report_failure

    quiet_dependency_warnings()
    args = build_parser(prog).parse_args(argv)
    try:
        _check_cli_paths(args)
    except UsageError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return USAGE_EXIT_CODE
    try:
        if args.command == "to-hf":
            result = convert_megatron_to_hf(
                args.load, args.output, iteration=args.iteration, dtype=args.dtype,
                validate=args.validate, force=args.force, config_path=args.config,
            )
        else:
            result = convert_hf_to_megatron(
                args.load, args.output, dtype=args.dtype, validate=args.validate, force=args.force,
                target_tensor_parallel_size=args.target_tensor_parallel_size, iteration=args.iteration,
            )
    except (ValueError, FileExistsError, FileNotFoundError, NotADirectoryError) as err:
        report_failure(prog, err)
        return 1
    where = f" ({iteration_dir_name(result.iteration)})" if result.iteration is not None else ""
    print(
        f"wrote {result.architecture} ({result.num_tensors} tensors, {result.num_parameters:,} parameters, "
        f"{result.dtype}) from {result.source} to {result.output}{where}"
        + ("; validated: every tensor identical" if result.validated else "")
    )
    if args.command == "to-hf":
        for note in serving_notes(_read_json(os.path.join(result.output, "config.json"))):
            print(f"note: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
