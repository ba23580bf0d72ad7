"""megatron's `torch_dist` checkpoint format, read without running code planted in it
(docs/design.md §14 Reliability guarantees).

megatron-core 0.16's loader reads the `.metadata` of torch's distributed checkpoint with
`pickle.load` (torch's `FileSystemReader`), the byte items of the `.distcp` files (megatron's
`ShardedObject`s) with `torch.load(weights_only=False)` (torch's `DefaultLoadPlanner.load_bytes`)
and `common.pt` with `torch.load` under whatever torch's default is. Each would run a callable
that a crafted file names. The strategies here take the same steps with every pickle read
through `restricted_unpickle` (allow-lists per file kind), and the file names that `.metadata`
gives for the tensors must lie in the checkpoint directory:

* `RestrictedFileSystemReader`: torch's reader with `.metadata` unpickled against
  `checkpoint.restricted_unpickle.METADATA` (read once, cached) and every storage file a plain name in the
  checkpoint directory;
* `RestrictedLoadPlanner`: megatron's `MCoreLoadPlanner` whose byte items are unpickled against
  `TENSORS | LEGACY_RNG` (this version writes none; those of version 2 hold the RNG state);
* `RestrictedTorchDistLoadStrategy` / `RestrictedCommonLoadStrategy`: megatron's `torch_dist` /
  `torch` load strategies built on them.

`load`, `load_common_state_dict` and `load_tensors_metadata` are `megatron.core.dist_checkpointing`'s
functions of the same names with these strategies; every checkpoint read of the project goes through
them (training resume, conversion, evaluation). Tensors themselves are read by torch with
`weights_only=True`.

Like `checkpoint/torch_dist_save.py`, this module uses megatron's private helpers of the `torch_dist` strategy
(`_replace_state_dict_keys_with_sharded_keys`, `_unwrap_pyt_sharded_tensor`,
`_replace_sharded_keys_with_state_dict_keys`, `_restore_dict_types`), pinned by
`tests/test_convert.py::test_megatron_private_save_helpers`.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Optional

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.core import maybe_load_config
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME, TorchCommonLoadStrategy
from megatron.core.dist_checkpointing.strategies.torch import (  # the private helpers: see the module docstring
    MCoreLoadPlanner,
    TorchDistLoadShardedStrategy,
    _replace_sharded_keys_with_state_dict_keys,
    _replace_state_dict_keys_with_sharded_keys,
    _restore_dict_types,
    _unwrap_pyt_sharded_tensor,
    mcore_to_pyt_state_dict,
)
from megatron.core.dist_checkpointing.validation import verify_checkpoint_and_load_strategy
from torch.distributed import checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta

from ..common.errors import CheckpointError
from .restricted_unpickle import LEGACY_RNG, METADATA, TENSORS, RefusedCheckpointContent, torch_load, unpickle

__all__ = [
    "RestrictedFileSystemReader",
    "RestrictedLoadPlanner",
    "RestrictedTorchDistLoadStrategy",
    "RestrictedCommonLoadStrategy",
    "load",
    "load_common_state_dict",
    "load_tensors_metadata",
    "RefusedCheckpointContent",
]

BACKEND = "torch_dist"


class RestrictedFileSystemReader(dcp.FileSystemReader):
    """torch's `FileSystemReader` with `.metadata` unpickled against `METADATA` (once: cached) and the
    storage files it names checked to be plain file names in the checkpoint directory."""

    def __init__(self, path) -> None:
        super().__init__(path)
        self._metadata: Optional[Metadata] = None

    def read_metadata(self, *args, **kwargs) -> Metadata:
        rank = kwargs.get("rank")
        if rank is None and self._metadata is not None:
            return self._metadata
        path = self._get_metadata_path(rank)
        with self.fs.create_stream(path, "rb") as stream:
            metadata = unpickle(stream, str(path), METADATA)
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not the metadata of a torch_dist checkpoint.")
        for info in (metadata.storage_data or {}).values():
            self._check_storage_file(str(path), getattr(info, "relative_path", None))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        if rank is None:
            self._metadata = metadata
        return metadata

    @staticmethod
    def _check_storage_file(metadata_path: str, name) -> None:
        """A storage file of the checkpoint: a plain file name (no directory part, no `..`)."""
        if not isinstance(name, str) or not name or os.path.basename(name) != name or name in (".", ".."):
            raise CheckpointError(
                f"{metadata_path} names the storage file {name!r}, which is not a file of its checkpoint directory; "
                "refusing to read it (a checkpoint only reads its own files)."
            )

    def read_data(self, plan, planner):
        """torch's read of the planned items; a file it cannot read is named (`ValueError`), a refusal passes as is."""
        try:
            return super().read_data(plan, planner)
        except CheckpointError:
            raise
        except Exception as err:  # noqa: BLE001 - a damaged file; torch's own message would advise unsafe loading
            files = ", ".join(sorted({self.storage_file(item) for item in plan.items}))
            detail = ("not tensor data that torch reads with weights_only=True" if isinstance(err, pickle.UnpicklingError)
                      else (str(err).strip().splitlines() or [""])[0][:200])
            raise ValueError(f"{files} cannot be read ({type(err).__name__}: {detail})") from err

    def storage_file(self, read_item) -> str:
        """The file (in the checkpoint directory) that holds `read_item`: for messages."""
        return os.path.join(str(self.path), self.storage_data[read_item.storage_index].relative_path)


class RestrictedLoadPlanner(MCoreLoadPlanner):
    """megatron's load planner whose byte items (`ShardedObject`s) are unpickled against
    `TENSORS | LEGACY_RNG` instead of by `torch.load(weights_only=False)`."""

    def __init__(self, reader: RestrictedFileSystemReader, **kwargs) -> None:
        super().__init__(**kwargs)
        self._reader = reader

    def load_bytes(self, read_item, value) -> None:
        fqn = read_item.dest_index.fqn
        source = f"{self._reader.storage_file(read_item)} (item {fqn})"
        obj = torch_load(value, source, TENSORS | LEGACY_RNG)
        if self.flatten_state_dict:
            *parents, last = self.mappings[fqn]
            container = self.original_state_dict
            for key in parents:
                container = container[key]
            container[last] = obj
        else:
            self.state_dict[fqn] = obj


def _refusal_in(error: BaseException) -> Optional[BaseException]:
    """The `CheckpointError` a rank raised inside torch's collective load (which wraps every rank's
    exception into one `CheckpointException`), if any: it is reported as is."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict):
        for _, cause in sorted(failures.items(), key=lambda kv: kv[0]):
            cause = cause[0] if isinstance(cause, tuple) else cause
            if isinstance(cause, CheckpointError):
                return cause
    return None


class RestrictedTorchDistLoadStrategy(TorchDistLoadShardedStrategy):
    """megatron's `torch_dist` load strategy on `RestrictedFileSystemReader` and `RestrictedLoadPlanner`."""

    def load(self, sharded_state_dict, checkpoint_dir):
        # The steps of TorchDistLoadShardedStrategy.load (megatron-core 0.16) with the restricted reader and planner,
        # through torch's `dcp.load` (what its deprecated `load_state_dict` does for these plain values).
        flexible_shape = [t for t in nested_values(sharded_state_dict)
                          if isinstance(t, ShardedTensor) and not t.allow_shape_mismatch]
        shape_mismatch_allowed = {t.key: t for t in nested_values(sharded_state_dict)
                                  if isinstance(t, ShardedTensor) and t.allow_shape_mismatch}
        original = sharded_state_dict
        sharded_state_dict, flat_mapping, rename_mapping = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict)
        pyt_state_dict = mcore_to_pyt_state_dict(sharded_state_dict, True)
        reader = RestrictedFileSystemReader(checkpoint_dir)
        reader.read_metadata()  # a refusal surfaces here, not wrapped into torch's collective exception
        planner = RestrictedLoadPlanner(reader, shapes_validation_sharded_tensors=flexible_shape,
                                        allow_shape_mismatch_sharded_tensors=shape_mismatch_allowed)
        try:
            dcp.load(pyt_state_dict, storage_reader=reader, planner=planner)
        except BaseException as err:  # noqa: BLE001 - torch's CheckpointException is a BaseException
            refusal = _refusal_in(err)
            if refusal is not None:
                raise refusal from None
            raise
        self.cached_global_metadata = reader.read_metadata()
        loaded = {k: _unwrap_pyt_sharded_tensor(v) for k, v in pyt_state_dict.items()}
        loaded = _replace_sharded_keys_with_state_dict_keys(loaded, flat_mapping, rename_mapping)
        _restore_dict_types(loaded, original)
        return loaded

    def load_tensors_metadata(self, checkpoint_dir, metadata=None):
        if metadata is None:
            metadata = RestrictedFileSystemReader(checkpoint_dir).read_metadata()
        return super().load_tensors_metadata(checkpoint_dir, metadata)

    def load_sharded_metadata(self, checkpoint_dir):
        metadata = RestrictedFileSystemReader(checkpoint_dir).read_metadata()
        out = {}
        for key, storage in metadata.state_dict_metadata.items():
            if isinstance(storage, BytesStorageMetadata):
                sharded = ShardedObject.empty_from_unique_key(key)
                out[sharded.unique_key] = sharded
        out.update(super().load_tensors_metadata(checkpoint_dir, metadata))
        return out


class RestrictedCommonLoadStrategy(TorchCommonLoadStrategy):
    """megatron's `common.pt` loader with the file unpickled against `TENSORS`."""

    def load_common(self, checkpoint_dir):
        path = os.path.join(str(checkpoint_dir), COMMON_STATE_FNAME)
        if not os.path.isfile(path):
            raise CheckpointError(f"{path} does not exist: the checkpoint is incomplete.")
        return torch_load(path, path, TENSORS)

    def load_sharded_objects(self, sharded_objects_state_dict, checkpoint_dir):
        # Only backends without object support keep objects in files of their own; torch_dist does not.
        raise CheckpointError(f"{checkpoint_dir}: sharded objects in separate files are not part of the torch_dist format.")


def _strategies(checkpoint_dir: str):
    """The restricted strategies, once `checkpoint_dir/metadata.json` says the checkpoint is `torch_dist`."""
    config = maybe_load_config(str(checkpoint_dir))
    if config is not None and config.sharded_backend != BACKEND:
        raise CheckpointError(
            f"{os.path.join(str(checkpoint_dir), 'metadata.json')} names the backend {config.sharded_backend!r}; "
            f"only {BACKEND!r} checkpoints are read."
        )
    return verify_checkpoint_and_load_strategy(str(checkpoint_dir), RestrictedTorchDistLoadStrategy(),
                                               RestrictedCommonLoadStrategy())


def load(sharded_state_dict, checkpoint_dir: str):
    """`dist_checkpointing.load` of a `torch_dist` checkpoint through the restricted strategies."""
    sharded, common = _strategies(checkpoint_dir)
    return dist_checkpointing.load(sharded_state_dict, str(checkpoint_dir), sharded_strategy=sharded,
                                   common_strategy=common)


def load_common_state_dict(checkpoint_dir: str) -> dict:
    """`dist_checkpointing.load_common_state_dict` (the `common.pt` state) through the restricted loader."""
    _, common = _strategies(checkpoint_dir)
    return common.load_common(str(checkpoint_dir))


def load_tensors_metadata(checkpoint_dir: str) -> dict:
    """`dist_checkpointing.load_tensors_metadata` (global shapes and dtypes) through the restricted reader."""
    sharded, _ = _strategies(checkpoint_dir)
    return sharded.load_tensors_metadata(Path(str(checkpoint_dir)))

